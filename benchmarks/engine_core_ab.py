"""Old against new, alternated in one run: the engines' workloads at a base commit and at this checkout.

    python benchmarks/engine_core_ab.py --base 60fef74 --json FILE [--rounds 3] [--runs 40]
    python benchmarks/engine_core_ab.py --typecheck-ab --json FILE   # this checkout, type layer off vs on
    python benchmarks/engine_core_ab.py --base 2c2398b --count --json FILE   # counts, not times (issue 39)

``--only A,B`` runs the named workloads only; ``--base-tree DIR`` runs an existing checkout of the base commit
instead of a temporary git worktree.

With ``--count`` nothing is timed: each tree runs each workload once (seeded, after a warm-up) and counts the
Python calls cProfile sees (functions and builtins), the ATen ops torch dispatches (a ``TorchDispatchMode``) and
the elements those ops write. Counts do not depend on the machine's load (repeated runs give the same op counts
and Python calls within about 10 in 50,000), so one run decides what a timing A/B
on a shared machine cannot (its per-round ratios of one workload spread 0.81-1.26): whether the new tree does more
work per run. The JSON has both trees' totals, ``ratio_new_over_old`` per count and the functions and ops whose
counts differ most.

With ``--typecheck-ab`` the two sides are this checkout with the type layer of ``ppl_thought/validation.py``
off (``PPL_THOUGHT_TYPECHECK=0``, "old") and on ("new"): what checking every public call costs (issue 32 asks
for no figure more than 3% slower).

The base commit is checked out into a temporary git worktree; each round runs the workloads once in a fresh
process of each tree (old, new, old, new, ...), so the two see the same load. Every workload is run ``--runs``
times with the seeds 0..4 in turn (the same draws in both trees wherever the random streams are unchanged)
and timed by its best run (other load on a shared machine only adds time), on two clocks: the process's CPU
time (``time.process_time``: one torch thread, so other processes on a busy machine barely move it) and wall
time. Rounds alternate which tree goes first. The workloads are those of
``benchmarks/engines.py`` (one torch thread): Importance and SMC on SlowThinking with Tabular and Transformer
priors and a causal proposal, the user-written program of the same law (``UserPauseProgram``), and
``LMSequence`` sampling of 256 sequences; and the ppl_thought side of ``benchmarks/llamppl_race.py`` (SMC under
the lipogram on its random GPT-2, N = 16, 64, 256; a third of the runs, at least 6; the constraint built in both trees
by the library's ``token_automaton(CharDFA.lipogram("e"), token_texts(vocab))``, which both commits have); and the same
program (``Constrained``) under ``SMC(n, backend="static")``, the static backend of ``benchmarks/gpu.py`` (eager on
CPU), N = 16, 64, 256 (``static_smc_N``).
The JSON has per tree and round the best seconds of each workload
on both clocks, ``ratio_new_over_old`` (CPU time, best over rounds; above 1: the new tree is slower) and
``ratio_new_over_old_wall``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ppl_thought import provenance as pv

ROOT = Path(__file__).resolve().parents[1]

SETUP = r"""
import json, sys, time, torch, pyro
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import engines as E
from ppl_thought.distributions import LMSequence
from ppl_thought.inference import SMC, Importance
torch.set_num_threads(1)
torch.manual_seed(0)
vocab = E.Vocab(["a", "b", "c", "d"])
V = len(vocab)
proj = E.PauseToThink(vocab, max_thought_len=2)
prior = E.Transformer(V, d_model=32, n_layers=2, n_heads=2).eval()
q_lm = E.Transformer(V, d_model=32, n_layers=2, n_heads=2).eval()
model, tab = E.SlowThinking(prior, proj), E.Tabular(2, V, torch.randn(V, V), trainable=False)
guide, tmodel = E.CausalSampler(q_lm, model), E.SlowThinking(tab, proj)
tguide = E.CausalSampler(E.Tabular(2, V, torch.randn(V, V), trainable=False), tmodel)
x = "abcdabcd"
sampler = LMSequence(prior, constraint=proj.domain(8), max_len=16)
jobs = {
    "importance_transformer": lambda: Importance(256).run(model, guide, x),
    "importance_tabular": lambda: Importance(256).run(tmodel, tguide, x),
    "sampling_transformer": lambda: sampler.sample_with_log_prob((256,)),
    "smc_tabular": lambda: SMC(256).run(tmodel, tguide, x),
    "smc_transformer": lambda: SMC(256).run(model, guide, x),
    "smc_program_transformer": lambda: SMC(256).run(E.UserPauseProgram(prior, proj), guide, model.x_ids(x)),
}
import llamppl_race as R
lm, prompt = R.build(R.WORKLOAD["vocab_size"], R.WORKLOAD["n_layer"], R.WORKLOAD["n_embd"], R.WORKLOAD["n_head"])
from ppl_thought.projections import CharDFA, token_automaton, token_texts
lipogram = token_automaton(CharDFA.lipogram("e"), token_texts(lm.vocab))  # one definition in both trees
for n in R.SIZES:
    jobs[f"race_smc_{n}"] = R.ppl_thought_run(lm, lipogram, prompt, n, R.WORKLOAD["new_tokens"])[0]
import ppl_thought as pt
for n in R.SIZES:  # the static backend (benchmarks/gpu.py's smc_run; eager on CPU): one engine kept per size
    engine, program = SMC(n, ess_threshold=0.5, backend="static"), pt.models.Constrained(lm, lipogram,
                                                                                         R.WORKLOAD["new_tokens"])
    jobs[f"static_smc_{n}"] = lambda engine=engine, program=program: engine.run(program, None, prompt)
only = [k for k in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if k] or list(jobs)  # none: all
jobs = {k: jobs[k] for k in only}
"""

CHILD = SETUP + r"""
out = {}
with torch.no_grad():
    for name, fn in jobs.items():
        wall = cpu = float("inf")
        runs = int(sys.argv[2]) if not name.startswith(("race", "static")) else max(6, int(sys.argv[2]) // 3)
        for k in range(runs):
            torch.manual_seed(k % 5)
            pyro.set_rng_seed(k % 5)
            t, c = time.perf_counter(), time.process_time()
            fn()
            cpu = min(cpu, time.process_time() - c)
            wall = min(wall, time.perf_counter() - t)
        out[name] = {"wall": wall, "cpu": cpu}
print(json.dumps(out))
"""


# One seeded run of each workload after a warm-up, counted three ways (none depends on the machine's load): the
# Python calls cProfile sees (functions and builtins, torch's Python-bound ops among them), the ATen ops torch
# dispatches (a TorchDispatchMode: every op a kernel runs, whichever Python line asked for it) and the elements
# those ops write (the work the ops do, up to the cost per element).
COUNT_CHILD = SETUP + r"""
import cProfile, pstats, re
from collections import Counter
from torch.utils._python_dispatch import TorchDispatchMode

class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.numel = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.ops[name] += 1
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor):
                self.numel[name] += o.numel()
        return out

def seeded(fn):
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    return fn()

root = sys.argv[1].rstrip("/") + "/"
out = {}
with torch.no_grad():
    for name, fn in jobs.items():
        seeded(fn)  # warm-up: caches, compiled checks, lazily built tables
        prof = cProfile.Profile()
        prof.enable()
        seeded(fn)
        prof.disable()
        calls = Counter()
        for (path, line, func), (_, ncalls, *_) in pstats.Stats(prof).stats.items():
            where = path[len(root):] if path.startswith(root) else path.split("site-packages/")[-1]
            calls[re.sub(r" at 0x[0-9a-f]+", "", f"{where}({func})")] += ncalls  # one key per function in both trees
        mode = Ops()
        with mode:
            seeded(fn)
        out[name] = {"python_calls": sum(calls.values()), "torch_ops": sum(mode.ops.values()),
                     "torch_numel": sum(mode.numel.values()), "calls_by_function": dict(calls),
                     "ops_by_name": dict(mode.ops)}
print(json.dumps(out))
"""


def run_tree(tree: Path, runs: int, typecheck: bool = True, only: str = "", child: str = CHILD) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), PPL_THOUGHT_TYPECHECK="1" if typecheck else "0")
    r = subprocess.run([sys.executable, "-c", child, str(tree), str(runs), only], capture_output=True, text=True,
                       env=env, cwd=tempfile.gettempdir(), timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"the workloads failed in {tree}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


WORKLOADS = ("importance_transformer", "importance_tabular", "sampling_transformer", "smc_tabular", "smc_transformer",
             "smc_program_transformer", "race_smc_16", "race_smc_64", "race_smc_256", "static_smc_16", "static_smc_64",
             "static_smc_256")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="the old commit (e.g. 60fef74)")
    ap.add_argument("--typecheck-ab", action="store_true",
                    help="instead of --base: this checkout with the type layer off (old) and on (new)")
    ap.add_argument("--count", action="store_true",
                    help="with --base: count Python calls and torch ops of one seeded run in each tree (no timing)")
    ap.add_argument("--base-tree", default=None,
                    help="with --base: a checkout of the base commit to run (else a temporary git worktree)")
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all of " + ", ".join(WORKLOADS)
                    + ")")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args()
    args.run_record = pv.record(pv.script(__file__, None))  # before the run: the code that runs
    if (args.base is None) == (not args.typecheck_ab):
        ap.error("give exactly one of --base COMMIT and --typecheck-ab")
    if args.count and args.base is None:
        ap.error("--count compares two trees: give --base COMMIT")
    unknown = sorted(set(filter(None, args.only.split(","))) - set(WORKLOADS))
    if unknown:
        ap.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    t0 = time.perf_counter()
    if args.typecheck_ab:
        commit = "HEAD, PPL_THOUGHT_TYPECHECK=0"
        rounds = []
        for i in range(args.rounds):
            order = [("old", False), ("new", True)][:: 1 if i % 2 == 0 else -1]
            rounds.append({side: run_tree(ROOT, args.runs, typecheck=on, only=args.only) for side, on in order})
            r = rounds[-1]
            print(f"round {i + 1}/{args.rounds} (cpu ratio on/off): " + ", ".join(
                f"{k} {r['new'][k]['cpu'] / r['old'][k]['cpu']:.3f}" for k in r["old"]), flush=True)
    else:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.base], capture_output=True, text=True,
                                check=True).stdout.strip()
        if args.count:
            _count(args, commit, head, t0)
            return
        rounds = _old_and_new(commit, args.rounds, args.runs, args.only, args.base_tree)
    _report(args, commit, head, rounds, t0)


@contextlib.contextmanager
def _base_tree(commit: str, given: str | None) -> Iterator[Path]:
    """The checkout of ``commit`` to run: ``given`` (checked to be at ``commit``) or a temporary git worktree."""
    if given is not None:
        at = subprocess.run(["git", "-C", given, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        if at != commit:
            raise SystemExit(f"--base-tree {given} is at {at or 'no commit'}, not at the base {commit}")
        yield Path(given).resolve()
        return
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), commit], check=True,
                       capture_output=True)
        try:
            yield old
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)


def _old_and_new(commit: str, n_rounds: int, runs: int, only: str = "", base_tree: str | None = None) -> list[dict]:
    with _base_tree(commit, base_tree) as old:
        rounds = []
        for i in range(n_rounds):
            order = [("old", old), ("new", ROOT)][:: 1 if i % 2 == 0 else -1]  # old first, then new first
            rounds.append({side: run_tree(tree, runs, only=only) for side, tree in order})
            r = rounds[-1]
            print(f"round {i + 1}/{n_rounds} (cpu ratio new/old): " + ", ".join(
                f"{k} {r['new'][k]['cpu'] / r['old'][k]['cpu']:.3f}" for k in r["old"]), flush=True)
    return rounds


def _count(args: argparse.Namespace, commit: str, head: str, t0: float) -> None:
    """``--count``: the work of one seeded run of each workload in both trees, as counts (load-independent), with
    the functions and ops whose counts differ most."""
    with _base_tree(commit, args.base_tree) as old:
        counts = {"old": run_tree(old, 1, only=args.only, child=COUNT_CHILD),
                  "new": run_tree(ROOT, 1, only=args.only, child=COUNT_CHILD)}
    totals = ("python_calls", "torch_ops", "torch_numel")
    out: dict = {"base": commit, "head": head, "mode": "count", "totals": {}, "ratio_new_over_old": {},
                 "differences": {}}
    for name in counts["old"]:
        o, n = counts["old"][name], counts["new"][name]
        out["totals"][name] = {side: {k: counts[side][name][k] for k in totals} for side in ("old", "new")}
        out["ratio_new_over_old"][name] = {k: n[k] / o[k] for k in totals}
        out["differences"][name] = {key: _largest_differences(o[key], n[key], 25)
                                    for key in ("calls_by_function", "ops_by_name")}
        print(f"{name}: " + ", ".join(f"{k} {o[k]:,} -> {n[k]:,} ({n[k] / o[k]:.3f})" for k in totals), flush=True)
    out["seconds"] = time.perf_counter() - t0
    if args.json:
        out[pv.KEY] = pv.finish(args.run_record)
        Path(args.json).write_text(json.dumps(out, indent=2))


def _largest_differences(old: dict, new: dict, k: int) -> list[dict]:
    """The ``k`` keys whose counts differ most between the trees, as ``{"name", "old", "new"}``."""
    keys = sorted(set(old) | set(new), key=lambda key: (-abs(new.get(key, 0) - old.get(key, 0)), key))
    return [{"name": key, "old": old.get(key, 0), "new": new.get(key, 0)} for key in keys[:k]
            if new.get(key, 0) != old.get(key, 0)]


def _report(args: argparse.Namespace, commit: str, head: str, rounds: list[dict], t0: float) -> None:
    names = list(rounds[0]["old"])
    best = {clock: {side: {k: min(r[side][k][clock] for r in rounds) for k in names} for side in ("old", "new")}
            for clock in ("cpu", "wall")}
    ratio = {clock: {k: b["new"][k] / b["old"][k] for k in names} for clock, b in best.items()}
    out = {"base": commit, "head": head, "rounds": rounds, "best_s": best,
           "ratio_new_over_old": ratio["cpu"], "ratio_new_over_old_wall": ratio["wall"],
           "runs": args.runs, "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "seconds": time.perf_counter() - t0}
    print(json.dumps(out["ratio_new_over_old"], indent=2))
    if args.json:
        out[pv.KEY] = pv.finish(args.run_record)  # commit, command, machine, load, seconds
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
