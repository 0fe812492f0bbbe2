"""Bad input and killed writers: how the public entry points answer (the reliability issue).

    python benchmarks/robustness.py [--quick] [--json FILE] [--property-examples N]
    python benchmarks/robustness.py --public [--public-examples N] --json benchmarks/results/robustness_public.json
    python benchmarks/robustness.py --public --only pt. --json /tmp/torch_side.json   (one side only)
    python benchmarks/robustness.py --edges N [--json FILE]   (only the generated edge families of issue 41)

Each case feeds one bad input to one public entry point and classifies the answer:

* ``clear``: a :class:`ppl_thought.errors.PPLThoughtError` (or argparse's usage error, exit 2) whose
  message names the problem (checked by a phrase);
* ``unclear``: another exception type, or a library error whose message misses the phrase;
* ``silent``: a value came back (or NaN) where an error was due;
* ``crash``: an error from deep inside torch / numpy / Python (``RuntimeError``, ``IndexError``,
  ``KeyError``, ``AttributeError``, ...).

The table below is hand-written (40 inputs). The property-based suite (tests/test_robustness_properties.py, with
hypothesis) adds its families: N derandomized draws each (default 30, 10 with ``--quick``), whose bad inputs (by
each family's oracle) are classified the same way and counted in ``inputs``; its valid draws are checked too
(``ok``: a finite or -inf answer that passes the family's exact checks, ``wrong`` otherwise) and reported under
``valid``. Without hypothesis installed only the table runs.

``--public`` runs only the sweep over every public callable of tests/test_robustness_properties.py (every callable
of ``pt.__all__``, its subpackages' ``__all__`` and ``ptn``'s, N derandomized draws of wrong-type, -size and
-value arguments each, default 3, what the test runs): callables covered / total, tried / clear / valid / silent /
unclear / crash counts and, per callable, its worst answer (the recorded defects the test holds the library to).

Then a writer overwriting one checkpoint folder (and one saved result) in a loop is killed with SIGKILL at
random moments; ``unloadable`` counts the folders that could not be loaded afterwards, or whose tensors
do not belong to their config. Target: 0 silent, 0 crash, 0 unloadable.
"""

from __future__ import annotations

import argparse
import contextlib
import io as _io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyro
import torch

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.errors import PPLThoughtError

VOCAB = pt.Vocab(["a", "b"])
V = len(VOCAB)


def _tab():
    return pt.lm.Tabular(2, V, torch.zeros(V, V), trainable=False)


def _tf():
    torch.manual_seed(0)
    return pt.lm.Transformer(V, d_model=16, n_layers=1, n_heads=2, max_len=16)


def _model():
    return pt.models.SlowThinking(_tab(), pt.projections.PauseToThink(VOCAB, max_thought_len=1))


def _plain_function(x):
    pyro.sample("z", pyro.distributions.Normal(0.0, 1.0))


def _bad_checkpoint(kind: str):
    d = Path(tempfile.mkdtemp())
    path = pt.io.save_checkpoint(d / "ck", {"w": torch.ones(2)}, {"a": 1})
    cfg = path / "config.json"
    header = json.loads(cfg.read_text())
    if kind == "json":
        cfg.write_text("{not json")
    elif kind == "outside":
        header["tensors"]["file"] = "../evil.safetensors"
        cfg.write_text(json.dumps(header))
    elif kind == "missing":
        del header["tensors"]
        cfg.write_text(json.dumps(header))
    return pt.io.load_checkpoint(path)


def _cli(*argv):
    from ppl_thought.cli import main

    with contextlib.redirect_stderr(_io.StringIO()), contextlib.redirect_stdout(_io.StringIO()):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code
    if code == 2:
        raise _UsageError("usage error (exit 2)")
    return code


class _UsageError(PPLThoughtError):
    """argparse's clear usage message, counted as a clear answer."""


# (name, call, phrase the message must contain)
CASES = [
    ("vocab: no ordinary token", lambda: pt.Vocab([]), "at least one"),
    ("vocab: duplicate token", lambda: pt.Vocab(["a", "a"]), "twice"),
    ("vocab: whitespace token", lambda: pt.Vocab(["a b"]), "whitespace"),
    ("vocab: non-string token", lambda: pt.Vocab([3]), "tokens"),
    ("vocab: duplicate special", lambda: pt.Vocab(["a"], specials=["<x>", "<x>"]), "more than once"),
    ("vocab: unknown token", lambda: VOCAB.id("zz"), "not in the vocabulary"),
    ("vocab: id out of range", lambda: VOCAB.token(99), "outside"),
    ("vocab: encode unknown text", lambda: VOCAB.encode("azz"), "cannot tokenize"),
    ("projection: lifting of a latent token", lambda: pt.projections.PauseToThink(VOCAB, 1).lifting(["<s>"]),
     "non-observable"),
    ("tabular: wrong table shape", lambda: pt.lm.Tabular(2, V, torch.zeros(3, 3)), "shape"),
    ("tabular: NaN logits", lambda: pt.lm.Tabular(2, V, torch.full((V, V), float("nan"))), "NaN"),
    ("tabular: +inf logits", lambda: pt.lm.Tabular(2, V, torch.full((V, V), float("inf"))), "+inf"),
    ("tabular: ids out of range", lambda: _tab()(torch.tensor([[1, 99]])), "[0,"),
    ("tabular: float tokens", lambda: _tab()(torch.tensor([[1.0, 2.0]])), "LongTensor"),
    ("transformer: ids out of range", lambda: _tf()(torch.tensor([[1, 99]])), "outside"),
    ("transformer: negative ids", lambda: _tf()(torch.tensor([[1, -3]])), "outside"),
    ("transformer: float tokens", lambda: _tf()(torch.tensor([[1.0, 2.0]])), "token"),
    ("transformer: longer than max_len", lambda: _tf()(torch.ones(1, 40, dtype=torch.long)), "max_len"),
    ("lmsequence: negative max_len", lambda: pt.dist.LMSequence(_tab(), max_len=-1), "max_len"),
    ("lmsequence: float value", lambda: pt.dist.LMSequence(_tab(), max_len=4).log_prob(torch.ones(4)), "integer"),
    ("lmsequence: pad inside", lambda: pt.dist.LMSequence(_tab(), max_len=4).log_prob(torch.tensor([6, 0, 7, 0])),
     "pad"),
    ("lmsequence: too long", lambda: pt.dist.LMSequence(_tab(), max_len=2).log_prob(torch.tensor([6, 7, 6])),
     "max_len"),
    ("lmstate: stop as a string",
     lambda: pt.dist.LMState.start(_tab(), 2, max_len=4).segment(stop="</s>"), "vocab.id"),
    ("importance: 0 particles", lambda: pt.infer.Importance(0), "num_particles"),
    ("smc: 0 particles", lambda: pt.infer.SMC(0), "num_particles"),
    ("smc: ess_threshold 2", lambda: pt.infer.SMC(4, ess_threshold=2.0), "ess_threshold"),
    ("smc: unknown resampling", lambda: pt.infer.SMC(4, resampling="foo"), "resampling"),
    ("smc: groups 0", lambda: pt.infer.SMC(4, groups=0), "groups"),
    ("smc: a plain function", lambda: pt.infer.SMC(4).run(_plain_function, None, "ab"), "pt.Program"),
    ("importance: guide on another vocabulary",
     lambda: pt.infer.Importance(4).run(_model(), pt.guides.Causal(_tab(), pt.projections.PauseToThink(
         pt.Vocab(["b", "a"]), 1)), "ab"), "vocabulary"),
    ("importance: observation with an unknown token", lambda: pt.infer.Importance(4).run(_model(), None, "azz"),
     "cannot tokenize"),
    ("checkpoint: bad JSON", lambda: _bad_checkpoint("json"), "JSON"),
    ("checkpoint: tensors outside the folder", lambda: _bad_checkpoint("outside"), "plain file name"),
    ("checkpoint: missing key", lambda: _bad_checkpoint("missing"), "lacks"),
    ("checkpoint: no folder", lambda: pt.io.load_checkpoint("/nonexistent/ck"), "no checkpoint"),
    ("diagnostics: chi2 of NaN", lambda: pt.diagnostics.chi2(torch.tensor([-0.1, float("nan")]),
                                                             torch.tensor([-0.5, -0.9])), "NaN"),
    ("diagnostics: chi2 shapes", lambda: pt.diagnostics.chi2(torch.zeros(2), torch.zeros(3)), "shape"),
    ("cli: demo --n 0", lambda: _cli("demo", "--n", "0"), "usage"),
    ("cli: demo --seeds x", lambda: _cli("demo", "--seeds", "x"), "usage"),
    ("cli: unknown command", lambda: _cli("dmeo"), "usage"),
]

CRASH_TYPES = (RuntimeError, IndexError, KeyError, AttributeError, ZeroDivisionError, AssertionError)


def classify(call, phrase: str) -> tuple[str, str]:
    try:
        with torch.no_grad():
            out = call()
    except PPLThoughtError as e:
        return ("clear" if phrase.lower() in str(e).lower() else "unclear"), f"{type(e).__name__}: {e}"[:160]
    except CRASH_TYPES as e:
        return "crash", f"{type(e).__name__}: {e}"[:160]
    except Exception as e:  # noqa: BLE001 - other exception types are answers, but not the library's
        return "unclear", f"{type(e).__name__}: {e}"[:160]
    if isinstance(out, torch.Tensor) and out.is_floating_point() and torch.isnan(out).any():
        return "silent", "NaN"
    return "silent", f"returned {type(out).__name__}"


#: one interpreter pays the imports once, then forks a writer per kill (each fork a process of its own, killed with
#: SIGKILL mid-write as a freshly started one would be; the zygote itself runs no torch op, so its forks start clean)
_ZYGOTE = """
import json, os, sys, torch
from ppl_thought import io
from ppl_thought.inference.result import Result, save_result
print("imported", flush=True)
for line in sys.stdin:
    path, kind = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the writer
        print("ready", os.getpid(), flush=True)
        i = 0
        while True:
            i += 1
            w = torch.full((256, 256), float(i))
            if kind == "result":
                res = Result(samples={"z": w}, log_weights=torch.zeros(8), log_marginal=torch.tensor(float(i)))
                save_result(path, res)
            else:
                io.save_checkpoint(path, {"w": w}, {"i": i})
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def kill_loop(kills: int, seed: int = 0) -> dict:
    """``kills`` writers of a checkpoint folder and ``kills`` of a saved result, each killed with SIGKILL 0.2-0.6 s
    after it starts writing; ``unloadable`` counts the folders that do not load with their own config's tensors."""
    rng = random.Random(seed)
    tried = unloadable = 0
    writer = None  # the pid of the writer running, if any
    zygote = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert zygote.stdout.readline().strip() == "imported", "the writers' interpreter did not start"
        with tempfile.TemporaryDirectory() as d:
            for kind in ("checkpoint", "result"):
                path = Path(d) / kind
                for _ in range(kills):
                    zygote.stdin.write(json.dumps([str(path), kind]) + "\n")
                    zygote.stdin.flush()
                    writer = int(zygote.stdout.readline().split()[1])  # "ready PID": it starts writing
                    time.sleep(rng.uniform(0.2, 0.6))
                    os.kill(writer, signal.SIGKILL)
                    assert zygote.stdout.readline().strip() == "reaped"
                    writer = None
                    tried += 1
                    try:
                        if kind == "result":
                            r = pt.infer.load_result(path)
                            ok = float(r.samples["z"][0, 0]) == float(r.log_marginal)
                        else:
                            state, config, _ = pt.io.load_checkpoint(path)
                            ok = float(state["w"][0, 0]) == config["i"]
                    except Exception:  # noqa: BLE001 - any failure to load counts
                        ok = False
                    unloadable += not ok
    finally:
        if writer is not None:  # an error mid-loop: no writer outlives the run
            with contextlib.suppress(ProcessLookupError):
                os.kill(writer, signal.SIGKILL)
        zygote.stdin.close()
        zygote.wait(timeout=60)
    return {"tried": tried, "unloadable": unloadable}


BAD_ANSWERS = ("clear", "unclear", "silent", "crash")


def property_families():
    """The families of tests/test_robustness_properties.py (None without hypothesis)."""
    import importlib.util

    try:
        import hypothesis  # noqa: F401
    except ImportError:
        return None
    path = Path(__file__).resolve().parent.parent / "tests" / "test_robustness_properties.py"
    spec = importlib.util.spec_from_file_location("robustness_properties", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def property_rows(examples: int) -> dict[str, list[tuple[str, str, str]]]:
    """``{family: [(input, answer, message)]}`` of ``examples`` derandomized draws per family."""
    mod = property_families()
    if mod is None:
        print("hypothesis is not installed: the property-based families are left out")
        return {}
    return {name: mod.run_family(name, examples) for name in mod.FAMILIES}


def public_sweep(examples: int, only: tuple[str, ...] = ()) -> dict:
    """The sweep over every public callable (tests/test_robustness_properties.py, ``run_public``); with ``only``,
    over the callables whose qualified name starts with one of those prefixes (``pt.`` is the torch side, ``ptn``
    the JAX side)."""
    mod = property_families()
    if mod is None:
        return {}
    cwd = Path.cwd()
    by_callable, counts = {}, Counter()
    with tempfile.TemporaryDirectory() as d:
        import os

        os.chdir(d)  # a drawn path such as "x" lands in a temporary folder
        try:
            for name, fn in mod.PUBLIC.items():
                if only and not name.startswith(only):
                    continue
                rows = mod.run_public(name, fn, examples)
                answers = Counter(a for _, a, _ in rows)
                counts.update(answers)
                odd = [{"input": i, "answer": a, "message": m} for i, a, m in rows
                       if a in ("crash", "unclear", "silent")]
                by_callable[name] = {"worst": mod._worst(rows), "answers": dict(answers), "examples": odd[:2]}
        finally:
            os.chdir(cwd)
    worst = Counter(r["worst"] for r in by_callable.values())
    return {"examples_per_callable": examples, "covered": sum(1 for r in by_callable.values() if r["answers"]),
            "total": len(by_callable) if only else len(mod.PUBLIC), "tried": sum(counts.values()),
            **{k: counts.get(k, 0) for k in ("clear", "valid", "silent", "unclear", "crash")},
            "callables_by_worst_answer": {k: worst.get(k, 0) for k in ("crash", "unclear", "silent", "clear",
                                                                       "valid")},
            "by_callable": by_callable}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--property-examples", type=int, default=None,
                    help="draws per property-based family (default 30, 10 with --quick; 0 leaves them out)")
    ap.add_argument("--public", action="store_true", help="only the sweep over every public callable")
    ap.add_argument("--public-examples", type=int, default=3,
                    help="draws per public callable (default 3, what the test runs); --public-slow-examples (20, "
                         "pytest --slow) is recorded as well")
    ap.add_argument("--public-slow-examples", type=int, default=20)
    ap.add_argument("--only", action="append", default=[], metavar="PREFIX",
                    help="with --public: only the callables whose name starts with PREFIX (repeatable; 'pt.' is the "
                         "torch side, 'ptn' the JAX side); the JSON then records the prefixes")
    ap.add_argument("--edges", type=int, default=None, metavar="N",
                    help="only the generated edge families of issue 41 (benchmarks/robustness_edges.py), N cases each")
    args = ap.parse_args()
    run_record = pv.record(pv.script(__file__, None))  # before the run: the code that runs
    if args.edges is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from robustness_edges import edge_rows

        fams = edge_rows(args.edges)
        summary = {fam: dict(sorted(Counter(a for _, a, _ in rows).items())) for fam, rows in fams.items()}
        for fam, rows in fams.items():
            print(f"{fam:18s} {summary[fam]}")
            for inp, a, msg in rows:
                if a not in ("clear", "ok", "skipped"):
                    print(f"    {a:8s} {inp}: {msg}")
        if args.json:
            pt.io.atomic_write_json(args.json, {"command": f"python benchmarks/robustness.py --edges {args.edges}",
                                                pv.KEY: pv.finish(run_record), "families": summary,
                                                "cases": {f: [list(r) for r in rows] for f, rows in fams.items()}})
        return
    if args.public:
        only = tuple(args.only)
        sweep = public_sweep(args.public_examples, only)
        slow = public_sweep(args.public_slow_examples, only)
        for s in (sweep, slow):
            print(json.dumps({k: v for k, v in s.items() if k != "by_callable"}, indent=2))
        if args.json:
            command = "python benchmarks/robustness.py --public" + "".join(f" --only {p}" for p in only)
            pt.io.atomic_write_json(args.json, {"command": f"{command} --json {args.json}", **({"only": list(only)}
                                                if only else {}), pv.KEY: pv.finish(run_record),
                                                "public_callables": sweep,
                                                "public_callables_slow": slow})
        return
    rows = [(name, *classify(call, phrase)) for name, call, phrase in CASES]
    width = max(len(n) for n, _, _ in rows)
    for name, kind, msg in rows:
        print(f"{name:{width}s}  {kind:8s} {msg}")
    n_prop = args.property_examples if args.property_examples is not None else (10 if args.quick else 30)
    families = property_rows(n_prop) if n_prop > 0 else {}
    prop_cases, valid = {}, Counter()
    for fam, draws in families.items():
        answers = Counter(a for _, a, _ in draws)
        valid.update({k: answers.get(k, 0) for k in ("ok", "wrong")})
        rows += [(f"{fam} #{i}", a, m) for i, (_, a, m) in enumerate(draws) if a in BAD_ANSWERS]
        odd = [{"input": inp, "answer": a, "message": m} for inp, a, m in draws if a not in ("clear", "ok")]
        prop_cases[fam] = {"draws": len(draws), "answers": dict(answers), "not clear or ok": odd[:10]}
        print(f"{fam:{width}s}  {len(draws)} draws: {dict(sorted(answers.items()))}")
    counts = Counter(kind for _, kind, _ in rows)
    kills = kill_loop(5 if args.quick else 25)
    out = {"inputs": {"tried": len(rows), **{k: counts.get(k, 0) for k in BAD_ANSWERS}},
           "kills": kills,
           "valid": {"tried": sum(valid.values()), "ok": valid.get("ok", 0), "wrong": valid.get("wrong", 0)},
           "table": {"tried": len(CASES)},
           "property_families": prop_cases,
           "cases": {name: {"answer": kind, "message": msg} for name, kind, msg in rows[:len(CASES)]}}
    print(json.dumps({k: out[k] for k in ("inputs", "kills", "valid")}, indent=2))
    if args.json:
        out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        pt.io.atomic_write_json(args.json, out)


if __name__ == "__main__":
    main()
