"""Documented experiment tables, rendered from the committed JSON in benchmarks/results/ (issue 30, item 1).

    python tools/doc_tables.py            # check: exit 1 if a documented table differs from its JSON
    python tools/doc_tables.py --write    # rewrite every generated block from its JSON
    python tools/doc_tables.py --list     # the tables, their JSON and the command that writes it

In README.md and docs/*.md a generated block is

    <!-- doc-table NAME -->
    ...rendered from TABLES[NAME].source; never edited by hand...
    <!-- /doc-table -->

Each block ends with the machine and seconds recorded in its JSON and a line "From <file> at <commit>, command:
<command>" (``ppl_thought.provenance``, issue 42).
``tests/test_doc_tables.py`` checks that every block equals its rendering.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as ``python tools/doc_tables.py`` from a checkout
    sys.path.insert(0, str(ROOT))
from ppl_thought import provenance as pv  # noqa: E402

DOCS = ("README.md", "docs")
# a block may be indented (inside a list item): its body is the rendering with every line so indented
BLOCK = re.compile(r"^(?P<indent> *)<!-- doc-table (?P<name>[\w.-]+) -->\n(?P<body>.*?)^(?P=indent)<!-- /doc-table -->",
                   re.S | re.M)


def _pm(mean: float, se: float | None, digits: int = 3, sign: bool = False) -> str:
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    if se is None or not math.isfinite(se):
        return f.format(mean)
    return f"{f.format(mean)} ± {se:.{digits}f}"


def _pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n.d."
    return f"{100 * x:+.0f} %"


def _machine_text(m: dict, threads: int | None) -> str:
    return (f"{m.get('nproc') or m.get('cpu_count')} cores ({m.get('processor') or '?'}), torch {m.get('torch')}"
            + ("" if threads is None else f" with {threads} thread(s)"))


def _provenance(d: dict, command: str | None = None) -> str:
    """The machine, load and wall time of the run that wrote ``d`` (its commit and command are the source line
    :func:`render` puts under every table). ``command`` is unused (kept for the renderers' calls)."""
    if isinstance(d.get(pv.KEY), dict):
        p = d[pv.KEY]
        load = [p.get("load_average_at_start"), p.get("load_average_at_end")]
        load = ("; load average " + " at the start, ".join(f"{x:.1f}" for x in load) + " at the end"
                if all(isinstance(x, (int, float)) for x in load) else "")
        secs = p.get("seconds")
        secs = f"{secs:.0f} s wall" if isinstance(secs, (int, float)) else "time not recorded"
        return f"Machine: {_machine_text(p.get('machine') or {}, p.get('threads'))}{load}; {secs}."
    m = d.get("machine") or {}
    machine = _machine_text(m, m.get("torch_threads")) if m else "not recorded"
    secs = next((v for v in (d.get("seconds"), d.get("total_seconds")) if isinstance(v, (int, float))), None)
    if not isinstance(secs, (int, float)):
        secs = "time not recorded"
    elif d.get("commands"):
        secs = f"{secs:.0f} s wall summed over its {len(d['commands'])} parts (run in parallel)"
    else:
        secs = f"{secs:.0f} s wall"
    return f"Machine: {machine}; {secs}."


def source_line(name: str, d: dict) -> str:
    """The line under every rendered table: the JSON it comes from, the commit and the command that wrote it
    (``ppl_thought.provenance``; a JSON written before it recorded them says so)."""
    t = TABLES[name]
    p = pv.of(d)
    commit = p.get("commit")
    at = (f"commit {commit[:7]}" + (" with uncommitted changes" if p.get("dirty") else "")) if commit else \
        "a commit not recorded"
    cmd = p.get("command")
    how = f"command: `{cmd}`" if cmd else f"command not recorded (the documented command: `{t.command}`)"
    return f"From `{t.source}` at {at}, {how}."


# ---------------------------------------------------------------------------------------------- Section 7
def sec7_summary(d: dict) -> str:
    """README / docs: the Section 7 table over seeds, one column per sampling size n."""
    ns = list(d["summary"])
    S = {n: d["summary"][n] for n in ns}
    c = d["config"]
    rows = ["| mean over seeds ± s.e. across seeds | "
            + " | ".join(f"n = {n} ({len(S[n]['seeds'])} seeds)" for n in ns) + " |",
            "|---|" + "---|" * len(ns)]

    def row(label: str, cell: Callable[[dict], str]) -> None:
        rows.append(f"| {label} | " + " | ".join(cell(S[n]) for n in ns) + " |")

    row("L_fast (SFT)", lambda s: _pm(s["L_fast"]["mean"], s["L_fast"]["se"]))
    row("L_pred (latent + predictive)", lambda s: _pm(s["L_pred"]["mean"], s["L_pred"]["se"]))
    row("L_expl (latent + explanatory)", lambda s: _pm(s["L_expl"]["mean"], s["L_expl"]["se"]))
    row("gain_pred = L_fast - L_pred", lambda s: _pm(s["gain_pred"]["mean"], s["gain_pred"]["se"], sign=True))
    row("gain_expl = L_fast - L_expl", lambda s: _pm(s["gain_expl"]["mean"], s["gain_expl"]["se"], sign=True))
    row("gain_expl - gain_pred (bootstrap 95 % CI)", lambda s: (
        f"{s['gain_difference']['mean']:+.3f} [{s['relative_improvement']['difference_ci95'][0]:+.3f}, "
        f"{s['relative_improvement']['difference_ci95'][1]:+.3f}]"))
    row("relative improvement gain_expl / gain_pred - 1 (bootstrap 95 % CI)", lambda s: (
        (_pct(s['relative_improvement']['relative_improvement']) if s["gain_pred"]["mean"] > 0
         else "not defined (mean gain_pred <= 0)") + " "
        f"[{_pct(s['relative_improvement']['ci95'][0])}, {_pct(s['relative_improvement']['ci95'][1])}]"))
    row("bootstrap resamples with mean gain_pred <= 0",
        lambda s: f"{100 * s['relative_improvement']['share_gain_pred_nonpositive']:.0f} %")
    row("seeds with gain_expl > gain_pred / gain_pred > 0 / gain_expl > 0", lambda s: (
        f"{s['seeds_expl_beats_pred']} / {s['seeds_gain_pred_positive']} / {s['seeds_gain_expl_positive']} "
        f"of {len(s['seeds'])}"))
    row("causal gap (7.3) at the end, explanatory / predictive",
        lambda s: f"{s['causal_gap']['mean']:+.3f} / {s['causal_gap_pred']['mean']:+.3f}")
    row("I(thought; method), explanatory (max log C)", lambda s: _pm(
        s["thought_choice_mutual_information"]["mean"], s["thought_choice_mutual_information"]["se"], 2))
    paper = d.get("paper", {})
    row("paper (Qwen2.5-7B, OpenWebMath): relative improvement",
        lambda s: next((_pct(paper[n]["relative_improvement"]) for n in ns if S[n] is s and n in paper), "-"))
    cfg = (f"{c['steps']} steps per training, batch {c['batch']}, {c['num_test']} test examples, "
           f"C = {c['num_choices']} methods, gating of P {'on' if c['gating'] else 'off'}, gating of the "
           f"explanatory sampler {'on' if c['gate_sampler'] else 'off'}, {c['clipping']} clipping; entropy floor "
           f"{d['entropy_floor_exact']:.4f}")
    part = (" **Partial**: the run was stopped before every (seed, n) finished; the columns pool the replicates "
            "that did." if d.get("partial") else "")
    return "\n".join(rows) + f"\n\n{cfg}. {_provenance(d)}{part}\n"


def sec7_per_seed(d: dict) -> str:
    """docs/demo.md: every seed and n of the multi-seed run."""
    rows = ["| n | seed | L_fast | L_pred | L_expl | gain_pred | gain_expl | causal gap expl / pred | "
            "I(thought; method) | base steps |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, runs in d["runs"].items():
        for r in runs:
            rows.append(f"| {n} | {r['seed']} | {r['L_fast']:.4f} | {r['L_pred']:.4f} | {r['L_expl']:.4f} | "
                        f"{_pm(r['gain_pred'], r['gain_pred_se'], 4, True)} | "
                        f"{_pm(r['gain_expl'], r['gain_expl_se'], 4, True)} | "
                        f"{r['causal_gap']:+.3f} / {r['causal_gap_pred']:+.3f} | "
                        f"{r['thought_choice_mutual_information']:.2f} | {r['base_model']['steps']} |")
    return "\n".join(rows) + "\n\n± is the test-set (paired) standard error of one seed. " + _provenance(d) + "\n"


def _interval_verdict(lo: float, hi: float) -> str:
    if lo > 0:
        return "reproduced"
    if hi < 0:
        return "contradicted"
    return "not shown (the interval contains 0)"


def sec7_verdict(d: dict) -> str:
    """README / docs: what of Section 7 is reproduced and what is not, decided from the JSON by fixed rules:
    a claim about a difference is *reproduced* when its 95 % bootstrap interval over seeds lies above 0,
    *contradicted* when it lies below 0, *not shown* otherwise; a gain counts as positive when its mean is
    more than 2 standard errors (across seeds) above 0."""
    S = d["summary"]
    lines = []
    for n, s in S.items():
        ri = s["relative_improvement"]
        lo, hi = ri["difference_ci95"]
        gp, ge = s["gain_pred"], s["gain_expl"]
        pos = lambda g: ("positive" if g["mean"] > 2 * g["se"] else  # noqa: E731
                         "negative" if g["mean"] < -2 * g["se"] else "not distinguishable from 0")
        paper = d.get("paper", {}).get(n, {}).get("relative_improvement")
        if gp["mean"] > 0 and ri.get("ci95"):
            rel = (f"the relative improvement is {_pct(ri['relative_improvement'])} (95 % interval "
                   f"{_pct(ri['ci95'][0])} to {_pct(ri['ci95'][1])}; "
                   f"{100 * ri['share_gain_pred_nonpositive']:.0f} % of the resamples have no positive predictive "
                   "gain, where the ratio is meaningless)")
            if paper is not None:
                inside = ri["ci95"][0] <= paper <= ri["ci95"][1]
                rel += f"; the paper's {_pct(paper)} is {'inside' if inside else 'outside'} that interval"
        else:
            rel = ("the relative improvement is not defined: the mean predictive gain is not positive"
                   + (f" (the paper: {_pct(paper)})" if paper is not None else ""))
        lines.append(
            f"- n = {n}: explanatory beats predictive (L_expl < L_pred, the claim of Section 7): "
            f"**{_interval_verdict(lo, hi)}** (gain_expl - gain_pred {s['gain_difference']['mean']:+.3f}, 95 % "
            f"interval {lo:+.3f} to {hi:+.3f}; {s['seeds_expl_beats_pred']} of {len(s['seeds'])} seeds). "
            f"Gain over SFT: explanatory {pos(ge)}, predictive {pos(gp)}; {rel}.")
    ns = [n for n in S if S[n]["gain_pred"]["mean"] > 0]
    if len(ns) >= 2:
        a, b = sorted(ns, key=int)[:2]
        ra, rb = (S[x]["relative_improvement"]["relative_improvement"] for x in (a, b))
        lines.append(f"- Saturation with n (App. L: the relative improvement falls from n = {a} to n = {b}): "
                     f"**{'reproduced on the point values' if rb < ra else 'not reproduced'}** "
                     f"({_pct(ra)} vs {_pct(rb)}; the intervals above say how far to trust this).")
    else:
        lines.append("- Saturation with n (App. L: the relative improvement falls from n = 8 to n = 16): "
                     "**not testable here**: the relative improvement is undefined at one or both n.")
    rules = ("From `benchmarks/results/sec7_seeds.json` (the table above). "
             "Rules (tools/doc_tables.py `sec7_verdict`): a difference is reproduced when its 95 % bootstrap "
             "interval over seeds lies above 0, contradicted below 0, not shown otherwise; a gain is positive or "
             "negative beyond 2 standard errors across seeds. The scale is far from the paper's (a 2-layer "
             "Transformer with d_model 64 on a synthetic task, not Qwen2.5-7B on OpenWebMath), so magnitudes are "
             "not comparable; the signs and the ordering are.")
    return "\n".join(lines) + "\n\n" + rules + "\n"


# the Section 7 runs that show the trend with size and the sampler loss (sec7-scale); each a merged run_seeds JSON
SEC7_SCALE = ("benchmarks/results/sec7_seeds_150x16_8a16c04.json", "benchmarks/results/sec7_seeds_150x16_vm.json",
              "benchmarks/results/sec7_seeds_150x16.json",
              "benchmarks/results/sec7_seeds.json", "benchmarks/results/sec7_seeds_600x32.json",
              "benchmarks/results/sec7_seeds_paper72.json")


def sec7_scale(d: dict, root: Path = ROOT) -> str:
    """docs/demo.md: explanatory vs predictive across the Section 7 runs of ``SEC7_SCALE`` (size, sampler loss,
    commit): relative improvement and gain_expl - gain_pred with their bootstrap intervals over seeds, the seeds
    where the explanatory model wins, and those whose explanatory sampler learned to name the method
    (I(thought; method) > 0.1 nats). ``d`` (sec7_seeds.json) is one of the rows."""
    sources, split = [], {True: [], False: []}
    rows = ["| run | steps x batch | sampler loss | commit, torch | n | relative improvement [95 % CI] | "
            "gain_expl - gain_pred [95 % CI] | seeds expl < pred | seeds with I(thought; method) > 0.1 |",
            "|---|---|---|---|---|---|---|---|---|"]
    for f in SEC7_SCALE:
        e = json.loads((root / f).read_text())
        sources.append(f"- `{f.split('/')[-1]}`: {_provenance(e)}")
        for reps in e["runs"].values():
            for r in reps:
                split[r["thought_choice_mutual_information"] > 0.1].append(r["gain_expl"] - r["gain_pred"])
        c = e["config"]
        loss = {"paper": "(7.2) as printed", "loo": "(3.25) leave-one-out"}[c.get("sampler_loss", "loo")]
        for n, s in e["summary"].items():
            ri = s["relative_improvement"]
            mi = sum(x > 0.1 for x in s["thought_choice_mutual_information"]["per_seed"])
            rows.append(f"| `{f.split('/')[-1]}` | {c['steps']} x {c['batch']} | {loss} | {e['commit'][:7]}, "
                        f"{e['machine']['torch']} | {n} | {_pct(ri['relative_improvement'])} "
                        f"[{_pct(ri['ci95'][0])}, {_pct(ri['ci95'][1])}] | {s['gain_difference']['mean']:+.3f} "
                        f"[{ri['difference_ci95'][0]:+.3f}, {ri['difference_ci95'][1]:+.3f}] | "
                        f"{s['seeds_expl_beats_pred']} of {len(s['seeds'])} | {mi} of {len(s['seeds'])} |")
    paper = ", ".join(f"n = {n}: {_pct(v['relative_improvement'])}" for n, v in d.get("paper", {}).items())
    by_mi = "; ".join(
        f"I(thought; method) {'>' if k else '<='} 0.1 in {len(v)}: the explanatory model wins in "
        f"{sum(x > 0 for x in v)}, "
        f"gain_expl - gain_pred {sum(v) / len(v):+.3f} on average" for k, v in split.items() if v)
    rows.append(f"\nOver the {len(split[True]) + len(split[False])} replicates (seed, n) of these runs: {by_mi}.")
    return ("\n".join(rows) + f"\n\nThe paper (1000 steps x batch 1920, (7.2) as printed): {paper}. Each row is one "
            "JSON of benchmarks/results/:\n\n" + "\n".join(sources) + "\n")


# ---------------------------------------------------------------------------------------------- real model
def real_quick(d: dict) -> str:
    """README: latent thoughts on SmolLM2-135M-Instruct (``demo_real_quick.json``)."""
    r = d["real"]
    rows = ["| scoring | accuracy (4 candidates) | log P(right \\| candidates) | gain over direct (paired) | ESS / n |",
            "|---|---|---|---|---|"]
    for key, label in (("direct", "direct scoring (no thought)"),
                       ("predictive", "thoughts marginalised, predictive sampler"),
                       ("explanatory", "thoughts marginalised, explanatory sampler")):
        s = r[key]
        gain = s.get("gain_over_direct")
        rows.append(f"| {label} | {_pm(s['accuracy'], s['accuracy_se'], 2)} | "
                    f"{_pm(s['log_p_right_among_candidates'], s['log_p_right_se'], 2)} | "
                    f"{_pm(gain['mean'], gain['se'], 2) if gain else ''} | "
                    f"{_ess(s.get('ess'))} |")
    cfg = f"{r['problems']} problems, {r['particles']} particles, thoughts of at most {r['max_thought_tokens']} tokens"
    cmd = ("ppl-thought demo --quick --parts real --seed 0 --threads 1 "
           "--json benchmarks/results/demo_real_quick.json")
    return "\n".join(rows) + f"\n\n{cfg}. " + _provenance(d, cmd) + "\n"


def real_default(d: dict) -> str:
    """docs/demo.md: ``examples/real_thoughts.py`` at its default size (``real_thoughts_default.json``), the same
    table as the demo's quick part."""
    return real_quick({"real": d, **({pv.KEY: d[pv.KEY]} if pv.KEY in d else {})})


def _ess(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


DEMO_CMDS = {"quick": "ppl-thought demo --quick --json benchmarks/results/demo_quick.json"}
PART_NAMES = {"sec7": "Section 7", "a5": "A5", "real": "SmolLM2 (real model)"}


def _demo_times(d: dict, size: str) -> str:
    """README: how long ``ppl-thought demo`` took, part by part, with the machine's load (``demo_<size>.json``)."""
    parts = d.get("seconds_per_part") or {}
    rows = ["| part | seconds |", "|---|---|"]
    rows += [f"| {PART_NAMES.get(k, k)} | {v:.0f} |" for k, v in parts.items()]
    rows.append(f"| **all, with plots and ArviZ files** | **{d['seconds']:.0f}** ({d['seconds'] / 60:.1f} min) |")
    head = f"`ppl-thought demo{' --quick' if size == 'quick' else ''}`"
    if isinstance(d.get(pv.KEY), dict):  # the provenance line has the load
        return "\n".join(rows) + f"\n\n{head}. " + _provenance(d, DEMO_CMDS[size]) + "\n"
    load = [d.get("load_average_at_start"), d.get("load_average_at_end")]
    load_s = ("load average " + " at the start, ".join(f"{x:.1f}" for x in load) + " at the end"
              if all(isinstance(x, (int, float)) for x in load) else "load not recorded")
    return "\n".join(rows) + f"\n\n{head}: {load_s}. " + _provenance(d, DEMO_CMDS[size]) + "\n"


def demo_quick_times(d: dict) -> str:
    return _demo_times(d, "quick")


def a5_quick(d: dict) -> str:
    """README: the A5 part of ``ppl-thought demo --quick`` (``demo_quick.json``): excess loss over the exact
    entropy (forward algorithm) of a plain Transformer and of Proj # P_f."""
    a = d["a5"]
    c, n = a["config"], a["num_params"]
    ratio = a["plain_excess_nats"] / a["latent_excess_nats"] if a["latent_excess_nats"] > 0 else float("inf")
    rows = ["| model | parameters | excess nats / token (test length) | at train length |", "|---|---|---|---|",
            f"| plain Transformer | {n['plain']:,} | {_pm(a['plain_excess_nats'], a['plain_excess_se'])} | "
            f"{a['plain_excess_train_len']:.3f} |",
            f"| Proj # P_f (latent) | {n['latent']:,} | {_pm(a['latent_excess_nats'], a['latent_excess_se'])} "
            f"({ratio:.1f}x lower) | {a['latent_excess_train_len']:.3f} |"]
    crit = "met" if a["criterion_latent_3x_below_plain"] else "not met"
    cfg = (f"Trained on length-{c['train_len']} sequences, tested on length {c['test_len']}; exact cross-entropy "
           f"{a['exact_cross_entropy_nats']:.3f} nats/token. The demo's criterion (latent at most a third of the "
           f"plain excess): {crit}")
    return "\n".join(rows) + f"\n\n{cfg}. " + _provenance(d, DEMO_CMDS["quick"]) + "\n"


# ---------------------------------------------------------------------------------------------- backends
BACKENDS_CMD = "python benchmarks/backends.py --json benchmarks/results/backends.json"


def backends(d: dict) -> str:
    """docs/numpyro.md: torch vs JAX on SlowThinking (IS, SMC) and on the user program (``backends.json``)."""
    rows = ["| workload | N | torch particle-steps/s | JAX particle-steps/s | JAX / torch | JAX compile s |",
            "|---|---|---|---|---|---|"]
    for key, label in (("is", "SlowThinking, Importance"), ("smc", "SlowThinking, SMC (ESS 0.5)"),
                       ("program", "user program, bootstrap SMC"), ("decode", "user program, decode (3.14), 4 sets"),
                       ("svi", "user HMM program, one SVI step (3.25)")):
        for n, r in d.get(key, {}).items():
            comp = d.get("compile_s", {}).get(key, {}).get(n)
            rows.append(f"| {label} | {n} | {r['torch']:,.0f} | {r['jax']:,.0f} | {r['ratio_jax_over_torch']:.2f} | "
                        f"{'' if comp is None else f'{comp:.1f}'} |")
    fresh = d.get("rerun_fresh_engine_s", {})
    par = d.get("parity", {})
    lfp, lfe = par.get("max_abs_log_prob_diff", float("nan")), par.get("max_abs_exact_diff", float("nan"))
    tail = (f"A fresh `ptn.infer.SMC(N)` object on the user program, same configuration: "
            f"{', '.join(f'{v * 1000:.1f} ms (N = {n})' for n, v in fresh.items())} (no recompilation). "
            + _new_instance(d) +
            f"Parity on the same weights: max |log P(z)| difference {lfp:.1e}, max |exact log p(x)| difference "
            f"{lfe:.1e}. jax {d.get('jax')} on {d.get('jax_device')}; load average "
            f"{d.get('load_average_before', [float('nan')])[0]:.1f} before the run. " + _provenance(d, BACKENDS_CMD))
    return "\n".join(rows) + "\n\n" + tail + "\n"


def _new_instance(d: dict) -> str:
    """The runs of a new program instance of the same class (``new_instance_s``, ``new_instance_compiles``)."""
    secs, comp = d.get("new_instance_s", {}), d.get("new_instance_compiles", {})
    parts = []
    for key, label in (("smc", "SMC"), ("decode", "decode")):
        if secs.get(key):
            parts.append(f"{label}: " + ", ".join(f"{v * 1000:.1f} ms (N = {n}, {comp.get(key, {}).get(n)} compiles)"
                                                  for n, v in secs[key].items()))
    return (f"A new instance of the user program's class (other weights) with a new engine: {'; '.join(parts)}. "
            if parts else "")


# ---------------------------------------------------------------------------------------------- benchmarks
def _bench_provenance(cmd: str, w: dict, d: dict | None = None) -> str:
    """Machine, load and time of a benchmark JSON: its ``provenance`` entry when ``d`` has one, else the machine
    older runs recorded in their ``workload`` (or ``--meta``) entry ``w``. ``cmd`` is unused (the source line has
    the command)."""
    if d is not None and isinstance(d.get(pv.KEY), dict):
        return _provenance(d)
    cores = w.get("cpu_count") or w.get("nproc")
    threads = w.get("torch_threads")
    machine = (f"{cores} cores{f' ({m})' if (m := w.get('machine')) else ''}, torch {w.get('torch')}"
               + ("" if threads is None else f" with {threads} thread(s)")) if cores else "not recorded"
    load = w.get("load_average_at_start")
    end = w.get("load_average_at_end")
    load = ("" if load is None else f"; load average {load:.1f} at the start"
            + ("" if end is None else f" and {end:.1f} at the end"))
    secs = w.get("extra", {}).get("seconds") or {}
    timed = sum(v for row in secs.values() for v in (row.values() if isinstance(row, dict) else [row]))
    timed = f"; {timed:.1f} s in the timed rounds" if secs else "; wall time not recorded"
    return f"Machine: {machine}{load}{timed}."


def _int(x: float) -> str:
    return f"{x:,.0f}"


GPU_CPU_CMD = ("python benchmarks/gpu.py --device cpu --quick --json benchmarks/results/gpu_cpu_quick.json "
               "--meta benchmarks/results/gpu_cpu_quick_meta.json")


def gpu_cpu_quick(d: dict) -> str:
    """docs/gpu.md: the CPU quick run of benchmarks/gpu.py (``gpu_cpu_quick.json`` and its ``--meta`` file)."""
    m = d["meta"]
    rows = ["| LM | dtype | N | smc | limit_eager | limit_graph (eager, CPU) | fraction |",
            "|---|---|---|---|---|---|---|"]
    for lm, by_dtype in d["smc"].items():
        for dtype, by_n in by_dtype.items():
            for n, v in by_n.items():
                rows.append(f"| {lm} | {dtype} | {n} | {_int(v)} | {_int(d['limit_eager'][lm][dtype][n])} | "
                            f"{_int(d['limit_graph'][lm][dtype][n])} | "
                            f"{d['fraction_of_graph_limit'][lm][dtype][n]:.2f} |")
    cfg = (f"A tiny model ({m['n_layer']} layers, d_model {m['d_model']}, library vocabulary {m['library_vocab']}), "
           f"{m['prompt_tokens']}-token prompt, {m['new_tokens']} new tokens, {m['rounds']} timed round(s); "
           f"device: {d['device']}. Particle-tokens per second.")
    return "\n".join(rows) + f"\n\n{cfg} " + _bench_provenance(GPU_CPU_CMD, m, d) + "\n"


RACE_CMD = "python benchmarks/llamppl_race.py --json benchmarks/results/llamppl_race.json"


def llamppl_race(d: dict) -> str:
    """docs/huggingface.md: the race of issue 16 on the toy GPT-2 (``llamppl_race.json``)."""
    w, x = d["workload"], d["workload"]["extra"]
    rows = ["| particles | ppl_thought | LLaMPPL " + str(w.get("llamppl")) + " | limit (HF forward, DynamicCache) | "
            "adapter forward | ppl_thought / limit | ppl_thought / LLaMPPL | LLaMPPL / limit |",
            "|---|---|---|---|---|---|---|---|"]
    for n in map(str, d["n"]):
        rows.append(f"| {n} | {_int(d['ppl_thought'][n])} | {_int(d['llamppl'][n])} | {_int(d['limit'][n])} | "
                    f"{_int(x['adapter_forward'][n])} | {d['fraction'][n]:.2f} | {x['llamppl_ratio'][n]:.1f}x | "
                    f"{100 * d['llamppl'][n] / d['limit'][n]:.1f} % |")
    big = str(max(d["n"]))
    goal = (f"Issue 16's goal, at least 0.6 of the limit at {big} particles (about 10x LLaMPPL): "
            f"**{'met' if d['fraction'][big] >= 0.6 else 'not met'}** ({d['fraction'][big]:.2f} of the limit, "
            f"{x['llamppl_ratio'][big]:.1f}x LLaMPPL).")
    cfg = (f"Particle-tokens per second, best of {w['rounds']} interleaved rounds after a warm-up, "
           f"{w['new_tokens']} new tokens after a {w['prompt_tokens']}-token prompt.")
    return "\n".join(rows) + f"\n\n{cfg} {goal} " + _bench_provenance(RACE_CMD, w, d) + "\n"


RACE_SMOLLM2_CMD = ("python benchmarks/llamppl_race.py --model smollm2 --quick "
                    "--json benchmarks/results/llamppl_race_smollm2.json")


def llamppl_race_smollm2(d: dict) -> str:
    """docs/huggingface.md: the race on SmolLM2-135M-Instruct (``llamppl_race_smollm2.json``)."""
    w, x = d["workload"], d["workload"]["extra"]
    rows = ["| particles | ppl_thought | LLaMPPL | limit (DynamicCache) | ppl_thought / limit | ppl_thought / LLaMPPL "
            "| LLaMPPL seconds in its round | ppl_thought / adapter forward (in-place cache) |",
            "|---|---|---|---|---|---|---|---|"]
    for n in map(str, d["n"]):
        rows.append(f"| {n} | {d['ppl_thought'][n]:.1f} | {d['llamppl'][n]:.1f} | {d['limit'][n]:.1f} | "
                    f"{d['fraction'][n]:.2f} | {x['llamppl_ratio'][n]:.1f}x | {x['seconds'][n]['llamppl']:.0f} | "
                    f"{d['ppl_thought'][n] / x['adapter_forward'][n]:.2f} |")
    cfg = (f"Particle-tokens per second, {w['rounds']} round{'s' if w['rounds'] != 1 else ''} "
           f"({'--quick' if w.get('quick') else 'full'}), {w['new_tokens']} new tokens after a "
           f"{w['prompt_tokens']}-token prompt, {w['admitted_tokens']:,} of {w['library_vocab']:,} tokens admitted.")
    goal = [n for n in ("64", "256") if n in d["fraction"]]
    met = all(d["fraction"][n] >= 0.85 and x["llamppl_ratio"][n] >= 10 for n in goal)
    goal = (f"Issue 33's goal (at least 0.85 of the limit and 10x LLaMPPL at 64 and 256 particles): "
            f"**{'met' if met and len(goal) == 2 else 'not met'}**." if goal else "")
    return ("\n".join(rows) + f"\n\n{cfg} {goal} " + _bench_provenance(w.get("command") or RACE_SMOLLM2_CMD, w, d)
            + "\n")


GENLM_CMD = ("python benchmarks/llamppl_race.py --model smollm2 --quick --sizes 16 --new-tokens 8 --no-llamppl "
             "--genlm --json benchmarks/results/llamppl_race_smollm2_genlm_n16.json")


def genlm_smollm2(d: dict) -> str:
    """docs/huggingface.md: genlm-control beside ppl_thought on SmolLM2 (``llamppl_race_smollm2_genlm_n16.json``)."""
    w, x = d["workload"], d["workload"]["extra"]
    n = str(d["n"][0])
    g = x["genlm_control"][n]
    return (f"At {n} particles and {w['new_tokens']} new tokens, {w['rounds']} round: ppl_thought "
            f"{d['ppl_thought'][n]:.2f} particle-tokens/s, genlm-control {g:.2f} "
            f"({d['ppl_thought'][n] / g:.1f}x slower), the forward limit {d['limit'][n]:.2f}. "
            + _bench_provenance(GENLM_CMD, w, d) + "\n")


MARKERS_CMD = "python benchmarks/smollm2_markers.py --json benchmarks/results/smollm2_markers.json"


def smollm2_markers(d: dict) -> str:
    """docs/huggingface.md: the next-token mass of the added, untrained markers (``smollm2_markers.json``)."""
    totals = {p: v["total"] for p, v in d["mass"].items()}
    spread = max((max(v["per_marker"].values()) - min(v["per_marker"].values())) / min(v["per_marker"].values())
                 for v in d["mass"].values())
    lo, hi = min(totals.values()), max(totals.values())
    return (f"On {d['model']} the {len(d['added_markers'])} new tokens take between {lo:.1e} and {hi:.1e} of the "
            f"next-token mass after {len(totals)} prompts (chat and plain text), and about the same for each of "
            f"them (at most {100 * spread:.2g} % apart after one prompt). "
            + (_provenance(d) if pv.KEY in d else "Machine and time not recorded (the masses do not depend on them "
               "beyond float rounding).") + "\n")


TOKEN_AUTOMATA_CMD = "python benchmarks/token_automata.py --json benchmarks/results/token_automata.json"
TOKEN_AUTOMATA_ROWS = (("lipogram", 'lipogram "e"'), ("regex", "regex `{regex}`"),
                       ("dyck", "Dyck over `()[]{{}}`, depth 3, text between brackets"),
                       ("dyck_and_lipogram", 'the same Dyck AND lipogram "e"'),
                       ("regex_max_len_32", "regex, `max_len=32`"), ("dyck_max_len_32", "Dyck, `max_len=32`"))


def token_automata(d: dict) -> str:
    """docs/constraints.md: seconds to lift character automata to a 50k-token vocabulary (``token_automata.json``)."""
    c = d["cases"]
    lines = [f"On {d['vocab']:,} ids ({d['vocab'] - 6:,} random strings of {d['token_lengths'][0]} to "
             f"{d['token_lengths'][1]} printable characters, 5% of them with a non-ASCII letter), each build the best "
             f"of {d['repeats']}:", "",
             "| constraint | DFA states | token states | build | one char per gather | table |",
             "|---|---|---|---|---|---|"]
    for key, label in TOKEN_AUTOMATA_ROWS:
        r = c[key]
        build = f"{r['build_s']:.2f} s" + (f" (first build {r['first_build_s']:.2f} s)" if "max_len" in key else "")
        one = f"{r['build_s_one_char_per_gather']:.2f} s" if "build_s_one_char_per_gather" in r else ""
        lines.append(f"| {label.format(regex=d['regex'])} | {r['dfa_states']} | {r['token_states']} | {build} | {one} "
                     f"| {r['table_mb']:g} MB |")
    ratios = [c[k]["build_s_one_char_per_gather"] / c[k]["build_s"] for k in c if "build_s_one_char_per_gather" in c[k]]
    text = (f"\nReading one character per gather instead of k is {min(ratios):.1f}-{max(ratios):.1f}x slower. "
            f"Compiling all four DFAs takes {d['compile_all_dfas_s']:.2f} s.")
    deep = d.get("deep") or {}
    if deep:
        text += (f" The cost grows with the number of reachable states: Dyck over `()[]{{}}` at depth {deep['depth']} "
                 f"has {deep['dfa_states']} DFA states, {deep['token_states']} token states, and one build took "
                 f"{deep['build_s']:.1f} s.")
    return "\n".join(lines) + "\n" + text + " " + _provenance(d) + "\n"


RACE_JITTER = "benchmarks/results/checkpoint_race_jitter.json"
RACE_JITTER_BEFORE = "benchmarks/results/checkpoint_race_jitter_before.json"


def checkpoint_race(d: dict) -> str:
    """docs/reliability.md: loads racing writers killed at random (``checkpoint_race*.json``)."""
    rows = ["| run | code | loads | failed | re-read the config | under the lock | writers killed | seconds |",
            "|---|---|---|---|---|---|---|---|"]
    runs = (d, d["more"][RACE_JITTER], d["more"][RACE_JITTER_BEFORE])
    for r in runs:
        args = pv.of(r)["command"].split("checkpoint_race.py", 1)[1].split(" --json")[0]
        args = " ".join(a for a in args.split() if a not in ("--readers", "2", "--seed", "0"))
        rows.append(f"| `{args}` | {pv.of(r)['commit'][:7]} | {r['loads']:,} | {r['failed']:,} | {r['retried']:,} | "
                    f"{r['locked']:,} | {r['writers']['killed']} | {r['seconds']:.0f} |")
    clean = all(r["after"]["loads_consistently"] and not r["after"]["temporary_files_after_next_write"] for r in runs)
    after = ("The folder loads after the last kill and the next write leaves no temporary file, in every run."
             if clean else "**In some run the folder did not load after the last kill, or a temporary file stayed.**")
    return ("\n".join(rows) + f"\n\n{after} The first row's run: " + _provenance(d) + " The other two record no load: "
            f"{RACE_JITTER} and {RACE_JITTER_BEFORE}.\n")


def robustness_public(d: dict) -> str:
    """docs/reliability.md: every public callable called with wrong arguments (``robustness_public.json``)."""
    kinds = ("clear", "valid", "silent", "unclear", "crash")
    rows = ["| draws per callable | callables covered / total | calls tried | " + " | ".join(kinds) + " |",
            "|---" * 8 + "|"]
    worst = []
    for key, label in (("public_callables", "default"), ("public_callables_slow", "`--slow`")):
        r = d[key]
        rows.append(f"| {r['examples_per_callable']} ({label}) | {r['covered']} / {r['total']} | {r['tried']} | "
                    + " | ".join(str(r[k]) for k in kinds) + " |")
        w = r["callables_by_worst_answer"]
        worst.append(f"{r['examples_per_callable']} draws: " + ", ".join(f"{w[k]} {k}" for k in kinds if w.get(k)))
    return "\n".join(rows) + "\n\nBy callable (worst answer), " + "; ".join(worst) + ". " + _provenance(d) + "\n"


CUSTOM_CMD = "python examples/custom_program.py --quick --json benchmarks/results/custom_program.json"
CUSTOM_JAX_CMD = ("python examples/custom_program_numpyro.py --quick --json "
                  "benchmarks/results/custom_program_numpyro.json")


def _engine_rows(d: dict, extra: bool) -> list[str]:
    """The engines of a custom-program example (``custom_program*.json``): log of the mean Z-hat and its SE over the
    runs, the exact value, ESS/n, resampling steps per run (and, with ``extra``, the Pareto k-hat and the TV of the
    estimated posterior over thought sequences to the exact one)."""
    head = "| engine | log Z-hat | SE | exact | ESS/n | resampled per run |"
    head += " k-hat | TV to exact |" if extra else ""
    rows = [head, "|---" * (8 if extra else 6) + "|"]
    for name, r in d["results"].items():
        res = "" if name.startswith("IS") else f"{r['resampled']:.1f}"
        row = f"| {name} | {r['log_z']:.3f} | {r['se']:.3f} | {r['exact']:.3f} | {r['ess_fraction']:.2f} | {res} |"
        if extra:
            khat = r.get("khat")
            row += (f" {khat:.2f} |" if isinstance(khat, (int, float)) and math.isfinite(khat) else " - |")
            row += f" {r['tv_to_exact']:.3f} |"
        rows.append(row)
    return rows


def custom_program(d: dict) -> str:
    """docs/programs.md: the torch example's engines and its guide's SVI (``custom_program.json``)."""
    s = d["svi"]
    svi = (f"SVI on the guide ({len(s['losses'])} steps): the loss goes from {s['loss_first']:.2f} to "
           f"{s['loss_last']:.2f} (its floor is -log Z = {-d['exact']['plain']:.2f}, at q = posterior); the ESS/n of "
           f"the guide's particles from {s['ess_first']:.2f} to {s['ess_last']:.2f}; Importance with the guide from "
           f"ESS/n {s['is_ess_before']:.2f} to {s['is_ess_after']:.2f}.")
    return ("\n".join(_engine_rows(d, True)) + f"\n\n{d['runs']} runs of {d['num_particles']} particles each. {svi} "
            + _provenance(d) + "\n")


def custom_program_numpyro(d: dict) -> str:
    """docs/programs.md: the JAX example's engines and its compile (``custom_program_numpyro.json``)."""
    return ("\n".join(_engine_rows(d, False)) + f"\n\n{d['runs']} runs of {d['num_particles']} particles each. The "
            f"first SMC run compiled in {d['compile_s']:.1f} s; a fresh `ptn.infer.SMC({d['num_particles']})` object "
            f"with the same configuration then ran in {d['rerun_fresh_engine_s']:.3f} s (compiled runs are cached at "
            "module level, not on the engine object). " + _provenance(d) + "\n")


CHUNKED_CMD = "python benchmarks/chunked_encoding.py --json benchmarks/results/chunked_encoding.json"


def chunked_encoding(d: dict) -> str:
    """docs/transforms.md: token-by-token against chunked encoding of thoughts (``chunked_encoding.json``)."""
    rows = ["| engine | token by token, tokens/s | chunked, tokens/s | speed-up | SMC steps |", "|---|---|---|---|---|"]
    names = {"importance": "Importance", "smc": "SMC (no resampling: same random stream)"}
    same = []
    for k, name in names.items():
        r = d["results"][k]
        steps = (f"{r['token_by_token']['steps']} -> {r['chunked']['steps']}" if k == "smc" else "")
        rows.append(f"| {name} | {r['token_by_token']['tokens_per_s']:,.0f} | {r['chunked']['tokens_per_s']:,.0f} | "
                    f"{r['speedup']:.1f}x | {steps} |")
        same.append(r["same_log_weights"])
    agree = ("Both paths gave the same log weights (to 1e-4) in the run." if all(same)
             else "**The two paths' log weights differed in this run.**")
    cfg = (f"{d['num_particles']} particles, |x| = {d['x_len']}, a {d['thought_len']}-token thought every "
           f"{d['thought_every']} tokens.")
    return "\n".join(rows) + f"\n\n{cfg} {agree} " + _provenance(d) + "\n"


SELF_REDUCIBLE_CMD = "python benchmarks/self_reducible.py --json benchmarks/results/self_reducible.json"


def self_reducible(d: dict) -> str:
    """docs/verifiers.md: Section 5's sampler against Lemma 5.11's bounds, vs T (``self_reducible.json``)."""
    tv, ex = d["tv"], d["exact_log_count_error"]
    sampled = dict(zip(d["sampled_log_count_error"]["T"], d["sampled_log_count_error"]["value"]))
    rows = [f"Mean over {d['formulas']} random satisfiable 3-CNFs, `m = {d['m']}`, {d['clauses']} clauses (seeds 0-"
            f"{d['formulas'] - 1}; `|R(x)|` = {', '.join(map(str, d['num_solutions']))}), `bad=\"{d['bad']}\"`. Every "
            "column is exact but the sampled counting error (`self_reducible_curve`, "
            f"{d['sampled_log_count_error']['count']} solutions per formula, seed 0).", "",
            "| T | TV (alpha 0.01, gamma 0.25) | mass outside R | log-count error, sampled | log-count error, exact E "
            "over q_T | sharp bound | Lemma 5.11 bound | TV (alpha 0.001, gamma 0.25) | its Lemma 5.11 bound | "
            "TV (alpha 0.01, gamma 0.1) | TV (alpha 0.01, gamma -0.1) | log-count error, exact E (gamma -0.1) |",
            "|" + "---|" * 12]
    for i, T in enumerate(d["T"]):
        smp = f"{sampled[T]:.3f}" if T in sampled else "-"
        rows.append(f"| {T} | {tv['alpha=0.01,gamma=0.25'][i]:.3f} | {d['mass_outside'][i]:.3f} | {smp} | "
                    f"{ex['alpha=0.01,gamma=0.25'][i]:.3f} | {d['sharp_bound'][i]:.3g} | {d['lemma_bound'][i]:.3g} | "
                    f"{tv['alpha=0.001,gamma=0.25'][i]:.3f} | {d['lemma_bound_alpha=0.001'][i]:.3g} | "
                    f"{tv['alpha=0.01,gamma=0.1'][i]:.3f} | {tv['alpha=0.01,gamma=-0.1'][i]:.4f} | "
                    f"{ex['alpha=0.01,gamma=-0.1'][i]:.1f} |")
    return "\n".join(rows) + "\n\n" + _provenance(d) + "\n"


LOAD_CMD = "python benchmarks/smollm2_load.py --json benchmarks/results/smollm2_load.json"


def smollm2_load(d: dict) -> str:
    """docs/huggingface.md: loading SmolLM2 from its GGUF file, first and cached (``smollm2_load.json``)."""
    imports = [d["first"]["import_s"]] + [c["import_s"] for c in d["cached"]]
    cached = " and ".join(f"{c['load_s']:.1f} s" for c in d["cached"])
    return (f"{d['dtype']} on {d['device']}, {d['torch_threads']} torch thread, each load in a fresh process: first "
            f"load {d['first']['load_s']:.1f} s, cached loads {cached}, plus the import of torch, ppl_thought and "
            f"transformers' Llama module ({min(imports):.1f} s to {max(imports):.1f} s, paid by any transformers "
            f"Llama); the cache entry is {d['cache_bytes']:,} bytes. "
            + (_provenance(d) if pv.KEY in d else "Machine not recorded.") + "\n")


def real_quick_gains(d: dict) -> str:
    """docs/huggingface.md: the paired gains of the two samplers over direct scoring (``demo_real_quick.json``)."""
    r = d["real"]
    p, e = r["predictive"]["gain_over_direct"], r["explanatory"]["gain_over_direct"]
    beats = [k for k, g in (("predictive", p), ("explanatory", e)) if g["mean"] - 2 * g["se"] > 0]
    verdict = (f"the {' and '.join(beats)} sampler{'s' if len(beats) > 1 else ''} beat{'' if len(beats) > 1 else 's'}"
               " direct scoring by more than 2 s.e." if beats else "neither sampler beats direct scoring")
    return (f"On {r['problems']} problems with {r['particles']} particles, {verdict} (paired gains "
            f"{_pm(p['mean'], p['se'], 2, True)} and {_pm(e['mean'], e['se'], 2, True)} nats of log P(right | "
            f"candidates), predictive and explanatory); direct accuracy "
            f"{_pm(r['direct']['accuracy'], r['direct']['accuracy_se'], 2)} with "
            f"{len(r['questions'][0]['candidates'])} candidates. "
            + _provenance(d, TABLES_REAL_CMD) + "\n")


TABLES_REAL_CMD = ("ppl-thought demo --quick --parts real --seed 0 --threads 1 "
                   "--json benchmarks/results/demo_real_quick.json")


# ---------------------------------------------------------------------------------------------- active coding
ACTIVE_CODING_CMD = ("python -m ppl_thought.experiments.active_coding --quick --seed 0 --steps 300 "
                     "--json benchmarks/results/active_coding.json")
_VARIANT_LABEL = {"learned": "plain run (learned decoder G)", "learned+anneal": "entropy annealing",
                  "exact": "exact posterior decoder", "exact+anneal": "exact posterior decoder + entropy annealing"}


def _pct1(x: float) -> str:
    return f"{100 * x:+.1f} %"


def active_coding(d: dict) -> str:
    """docs/active-lifting.md: Section 6.3, every remedy (variant) at every N against Huffman (its JSON)."""
    rows = ["| N | variant | (6.10) of the kept restart, bits | Huffman (6.12), bits | vs Huffman | H(X\\|Z) nats | "
            "prefix-free | learned E\\|c\\| / Huffman's | restarts within 5 % | restarts reaching the goal | "
            "each restart: vs Huffman, H(X\\|Z) nats |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    goal_by = {}
    for N, r in d["coding"].items():
        for v, s in r["remedies"].items():
            each = "; ".join(f"{_pct1(x['relative_gap'])}, {x['h_x_given_z']:.3f}"
                             + (" (kept)" if x["restart"] == s["selected_restart"] else "") for x in s["restarts"])
            R = len(s["restarts"])
            rows.append(f"| {N} | {_VARIANT_LABEL.get(v, v)} | {s['learned_objective']:.3f} | "
                        f"{s['huffman_objective']:.3f} | {_pct1(s['relative_gap'])} | {s['h_x_given_z']:.4f} | "
                        f"{'yes' if s['prefix_free'] else 'no'} | "
                        f"{s['learned_length']:.2f} / {s['huffman_length']:.2f} | "
                        f"{round(s['restarts_within_5pct'] * R)} of {R} | {round(s['restarts_goal'] * R)} of {R} | "
                        f"{each} |")
            goal_by.setdefault(N, [])
            if s["goal"]:
                goal_by[N].append(v)
    c = d["config"]
    lines = []
    cells = [s for r in d["coding"].values() for s in r["remedies"].values()]
    best_kept = sum(s["learned_objective"] <= min(x["learned_objective"] for x in s["restarts"]) for s in cells)
    for N, r in d["coding"].items():
        v, s = min(r["remedies"].items(), key=lambda kv: kv[1]["relative_gap"])
        lines.append(f"N = {N}: closest to Huffman: {_VARIANT_LABEL.get(v, v)}, {_pct1(s['relative_gap'])} with "
                     f"H(X|Z) = {s['h_x_given_z']:.4f} nats.")
    for N, vs in goal_by.items():
        if vs:
            only_exact = all(d["coding"][N]["remedies"][v]["decoder"] == "exact" for v in vs)
            lines.append(f"N = {N}: the goal (within 5 % of Huffman and H(X|Z) < 0.01 nats, kept restart) is "
                         "reached by " + ", ".join(_VARIANT_LABEL.get(v, v) for v in vs)
                         + (" (only with the exact posterior decoder)" if only_exact else "") + ".")
        else:
            lines.append(f"N = {N}: the goal (within 5 % of Huffman and H(X|Z) < 0.01 nats) is reached by no variant's "
                         "kept restart.")
    cfg = (f"{c['steps']} steps per run, {c['particles']} particles per x, {c['restarts']} restarts per variant kept "
           f"by the least training objective (never by the evaluated (6.10)), entropy annealing from "
           f"{c['entropy_start']} x beta_c to 0 at {100 * c['entropy_until']:.0f} % of the steps; CPU "
           f"{d.get('total_cpu_seconds', float('nan')):.0f} s in all")
    lines.append(f"The restart kept by the training objective is also the best by the evaluated (6.10) in {best_kept} "
                 f"of the {len(cells)} (N, variant) cells.")
    return "\n".join(rows) + "\n\n" + " ".join(lines) + f"\n\n{cfg}. {_provenance(d)}\n"


def real_training(d: dict) -> str:
    """README / docs/training.md: SFT vs latent training on SmolLM2 with LoRA (``real_training_quick.json``)."""
    from ppl_thought.experiments.real_training import table

    return table(d) + f"\n\n{_provenance(d)}\n"


REPRODUCE_CMD = "ppl-thought reproduce --quick"


def reproduce_quick(d: dict) -> str:
    """README "Reproductions": the table ``ppl-thought reproduce`` writes (``reproduce_quick.json``); each row's
    numbers come from its own JSON at the commit the last column names."""
    from ppl_thought.reproduce import markdown

    ran = d.get("ran") or []
    secs = {r["name"]: r["seconds"] for r in d["rows"] if "seconds" in r}
    cpu = {r["name"]: r["cpu_seconds"] for r in d["rows"] if "cpu_seconds" in r}

    def took(n: str) -> str:
        if n not in secs:
            return f"`{n}`"
        return f"`{n}` ({secs[n]:.0f} s" + (f", {cpu[n]:.0f} CPU s)" if n in cpu else ")")

    total = (f" (in all {sum(secs.values()) / 60:.1f} min wall at the load below, {sum(cpu.values()) / 60:.1f} CPU min)"
             if cpu else "")
    how = (f"This table's run executed {', '.join(took(n) for n in ran)}{total}"
           + ("; the other rows are read from their JSON as committed" if set(ran) < {r["name"] for r in d["rows"]}
              else "") if ran else
           "This table's run executed no command: every row is read from its JSON as committed")
    return (markdown(d["rows"]) + f"\n\n{how}. Verdict rules "
            "(`ppl_thought/reproduce.py`, shown by `ppl-thought reproduce --list`): "
            + "; ".join(f"`{r['name']}`: {r['rule']}" for r in d["rows"]) + ". " + _provenance(d) + "\n")


# ---------------------------------------------------------------------------------------------- ArviZ layout
ARVIZ_WEIGHTED_CMD = "python benchmarks/arviz_weighted.py --json benchmarks/results/arviz_weighted.json"
ARVIZ_WEIGHTED_MODELS = (("slow_thinking", "z_length", "PauseToThink, Importance(200), E\\|z\\|"),
                         ("hmm", "z_1", "HMM (3 states, T = 4), SMC(200), E[z_1]"))


def arviz_weighted(d: dict) -> str:
    """docs/diagnostics.md: the bounded default layout of ``to_inference_data`` (``arviz_weighted.json``) against
    one draw per particle (``--num-draws 200``, the ``meta`` file ``arviz_weighted_n200.json``), over the same
    seeds, against the exact posterior mean (enumeration)."""
    rows = ["| model, engine | layout | draws | importance ESS | largest `az.ess` | seeds with `az.ess` > ESS "
            "| RMSE of the summary mean | mean MCSE | beyond 3 MCSE |", "|---|---|---|---|---|---|---|---|---|"]
    for key, var, label in ARVIZ_WEIGHTED_MODELS:
        for i, (layout, r) in enumerate((("one draw per particle (`num_draws=n`)", d["meta"][key]),
                                         ("default (bounded)", d[key]))):
            v = r[var]
            beyond = round(v["frac_beyond_3_mcse"] * r["seeds"])
            head = f"{label} = {r['exact'][var]:.3f}" if i == 0 else ""
            rows.append(f"| {head} | {layout} | {r['num_draws']:.0f} | {r['ess_importance_mean']:.1f} "
                        f"| {r['az_ess_max_mean']:.1f} | {100 * r['frac_az_ess_above_importance_ess']:.0f}% "
                        f"| {v['rmse']:.3f} | {v['mean_mcse']:.3f} | {beyond} of {r['seeds']} |")
    cmd = pv.of(d["meta"]).get("command") or "python benchmarks/arviz_weighted.py --num-draws 200"
    return ("\n".join(rows) + f"\n\nThe first row of each model: `{cmd}` (at commit "
            f"{(pv.of(d['meta']).get('commit') or 'not recorded')[:7]}). {_provenance(d)}\n")


# ---------------------------------------------------------------------------------------------- reliability
ROBUSTNESS_CMD = "python benchmarks/robustness.py --json benchmarks/results/robustness.json"


def robustness(d: dict) -> str:
    """docs/reliability.md: bad inputs (the hand-written table and the property families), the families' valid
    draws and the killed writers, as ``benchmarks/robustness.py`` counts them."""
    i, v, k = d["inputs"], d["valid"], d["kills"]
    table, fams = d["table"]["tried"], i["tried"] - d["table"]["tried"]
    draws = {f["draws"] for f in d["property_families"].values()}
    per = f", {draws.pop()} draws per family" if len(draws) == 1 else ""
    return (f"| | tried | clear | unclear | silent | crash |\n|---|---|---|---|---|---|\n"
            f"| bad inputs ({table} from the table, {fams} from the {len(d['property_families'])} property "
            f"families{per}) | {i['tried']} | {i['clear']} | {i['unclear']} | {i['silent']} | {i['crash']} |\n\n"
            f"| | tried | ok | wrong |\n|---|---|---|---|\n"
            f"| valid inputs drawn by the property families | {v['tried']} | {v['ok']} | {v['wrong']} |\n\n"
            f"| | tried | unloadable |\n|---|---|---|\n"
            f"| writers killed with SIGKILL while overwriting (checkpoint, saved result) | {k['tried']} "
            f"| {k['unloadable']} |\n\n{_provenance(d)}\n")


# ---------------------------------------------------------------------------------------------- Dyck (verifiers)
DYCK_QUICK_CMD = "python examples/dyck_backtracking.py --quick --json benchmarks/results/dyck_thesis_quick.json"
DYCK_FULL_CMD = "python examples/dyck_backtracking.py --json benchmarks/results/verifiers.json"
DYCK_METHODS = (("sample", "sample"), ("nucleus", "nucleus (top-p 0.9)"), ("tokenwise", "tokenwise"),
                ("backtracking", "backtracking (Q = 4, B = 4)"), ("vgb", "vgb (first leaf)"),
                ("smc", "smc (masked)"), ("awrs", "awrs"))


def dyck_methods(d: dict) -> str:
    """docs/verifiers.md, the Dyck sandbox: every method's accuracy, TV to the exact constrained law, distinct
    completions and calls per sample (``experiments/verifiers.py``, the ``dyck`` entry of its JSON)."""
    su, r = d["setup"], d["dyck"]
    rows = ["| method | accuracy | TV | distinct | LM calls / sample | verifier calls / sample |",
            "|---|---|---|---|---|---|"]
    for key, label in DYCK_METHODS:
        m = r[key]
        vc = f"{m['verifier_calls']:.1f}" if m["verifier_calls"] else "0"
        rows.append(f"| {label} | {m['accuracy']:.3f} | {m['tv']:.3f} | {m['distinct']:.3f} | {m['lm_calls']:.1f} "
                    f"| {vc} |")
    secs = f"; the Dyck part took {su['seconds']:.0f} s" if isinstance(su.get("seconds"), (int, float)) else ""
    head = (f"Seed {su['seed']}, {su['prompts']} prompts, {su['samples_per_prompt']} samples each; TV floor (as many "
            f"i.i.d. exact draws) {su['tv_floor']:.3f}{secs}.")
    tb, oc = d.get("tokenwise_bias"), d.get("oracle_calls")
    props = ("" if not (tb and oc) else
             f"\n\nProps 3.1.1-3.1.2 at larger sizes (same JSON): tokenwise rejection puts {tb['measured']:.4f} on "
             f"1^(D-1)0 where Prop 3.1.2 predicts {tb['predicted']:.3f} (the restricted law: "
             f"{tb['restricted']:.3f}); LM calls per sample {oc['rejection']:.1f} (rejection, predicted "
             f"{oc['predicted_rejection']:.0f}) and "
             f"{oc['tokenwise']:.2f} (tokenwise, predicted {oc['predicted_tokenwise']:.0f}).")
    return head + "\n\n" + "\n".join(rows) + props + f"\n\n{_provenance(d)}\n"


def _errs(t: dict, top_p: str, key: str) -> str:
    e = t["table_3_3"][f"top_p={top_p}"][key]
    return f"{e['errors_per_10000']:.0f} +- {e['stderr_per_10000']:.0f}"


def _acc(t: dict, table: str, *keys: str) -> str:
    return " / ".join(f"{t[table][k]['mean']:.3f}" for k in keys)


def _span(a: float, b: float) -> str:
    lo, hi = f"{100 * min(a, b):.0f}", f"{100 * max(a, b):.0f}"
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def dyck_thesis(d: dict) -> str:
    """docs/verifiers.md, the thesis' Tables 3.1-3.3 at small scale: seed 0 (``dyck_thesis_quick.json``, the
    ``thesis_tables`` entry) and seed 1 (``--thesis-only --seed 1``, the ``meta`` file), beside the thesis."""
    runs = [d["thesis_tables"], d["meta"]["thesis_tables"]]
    th, ours = runs[0]["thesis"], [r["ours"] for r in runs]
    seeds = " | ".join(f"ours, seed {r['setup']['seed']}" for r in runs)
    t3 = th["table_3_3"]
    out = [f"| Table 3.3: errors per 10000 OOD prompts | thesis | {seeds} |", "|---|---|---|---|"]
    for top_p in ("0.9", "1.0"):
        plain, back = t3[f"top_p={top_p}"]["Q=0,B=0"], t3[f"top_p={top_p}"]["Q=4,B=4"]
        out.append(f"| top-p {top_p}, no backtracking (Q = 0) | {plain['errors']:.1f} +- {plain['stderr']:.1f} | "
                   + " | ".join(_errs(o, top_p, "Q=0,B=0") for o in ours) + " |")
        out.append(f"| top-p {top_p}, Algorithm 1 (Q = 4, B = 4), trained verifier | {back['errors']:.1f} +- "
                   f"{back['stderr']:.1f} | " + " | ".join(_errs(o, top_p, "Q=4,B=4") for o in ours) + " |")
        out.append(f"| top-p {top_p}, Algorithm 1, exact verifier | - | "
                   + " | ".join(_errs(o, top_p, "Q=4,B=4,exact_verifier") for o in ours) + " |")
    b = ("B=1", "B=2", "B=4", "B=8")
    out += ["", f"| Tables 3.1-3.2: accuracy at error-inducing prefixes | thesis | {seeds} |", "|---|---|---|---|",
            f"| nucleus top-p 0.9 / greedy | {th['table_3_1']['nucleus_0.9']:.3f} / {th['table_3_1']['greedy']:.3f} | "
            + " | ".join(_acc(o, "table_3_1", "nucleus_0.9", "greedy") for o in ours) + " |",
            "| one forced backtrack, B = 1 / 2 / 4 / 8, then top-p 0.9 | "
            + " / ".join(f"{th['table_3_1'][k]:.3f}" for k in b) + " | "
            + " | ".join(_acc(o, "table_3_1", *b) for o in ours) + " |"]
    for q in (1, 4):
        keys = tuple(f"Q={q},B={bb}" for bb in (2, 4, 6))
        label = "Algorithm 1, trained verifier, Q = 1: B = 2 / 4 / 6" if q == 1 else "Q = 4: B = 2 / 4 / 6"
        out.append(f"| {label} | " + " / ".join(f"{th['table_3_2'][k]:.3f}" for k in keys) + " | "
                   + " | ".join(_acc(o, "table_3_2", *keys) for o in ours) + " |")
    va = th["verifier_val_accuracy"]
    out += ["", f"| the LM and the verifier | thesis | {seeds} |", "|---|---|---|---|",
            f"| OOD accuracy, top-p 0.9 (verifier-data prompts) | {th['ood_accuracy_nucleus_0.9']} | "
            + " | ".join(f"{o['ood_accuracy_nucleus_0.9']:.3f}" for o in ours) + " |",
            f"| verifier validation accuracy (held out of its balanced data; ours: "
            f"{ours[0]['verifier']['n_val']} strings) | {va['mean']} +- {va['stderr']} | "
            + " | ".join(f"{o['verifier']['val_accuracy']:.3f}" for o in ours) + " |",
            "| verifier vs the exact verifier on every prefix it judged in Table 3.3 | - | "
            + " | ".join(f"{o['verifier']['audit_table_3_3']['accuracy_vs_exact']:.3f} "
                         f"({o['verifier']['audit_table_3_3']['calls']} calls)" for o in ours) + " |",
            "| share of the exact verifier's rejections it missed | - | "
            + " | ".join(f"{o['verifier']['audit_table_3_3']['miss_rate']:.3f}" for o in ours) + " |"]

    def cut(o: dict, top_p: str) -> str:
        e = o["table_3_3"][f"top_p={top_p}"]
        return f"{100 * (1 - e['Q=4,B=4']['mean'] / e['Q=0,B=0']['mean']):.0f}%"

    thesis_cut = [f"{100 * (1 - t3[f'top_p={p}']['Q=4,B=4']['errors'] / t3[f'top_p={p}']['Q=0,B=0']['errors']):.0f}%"
                  for p in ("0.9", "1.0")]
    su = [r["setup"] for r in runs]
    out += ["", "Backtracking with the trained verifier cuts the OOD errors by "
            + "; ".join(f"{cut(o, '0.9')} at top-p 0.9 and {cut(o, '1.0')} at top-p 1.0 for seed {s['seed']}"
                        for o, s in zip(ours, su))
            + f" (the thesis: {thesis_cut[0]} and {thesis_cut[1]}). From error-inducing prefixes nucleus and greedy "
            "succeed " + " and ".join(_span(o['table_3_1']['nucleus_0.9']['mean'], o['table_3_1']['greedy']['mean'])
                                        for o in ours)
            + f" of the time (seeds {' and '.join(str(s['seed']) for s in su)}; the thesis: "
            f"{100 * th['table_3_1']['nucleus_0.9']:.0f}%). Our model has {su[0]['lm_parameters']} parameters "
            f"(`setup.lm_parameters`), the thesis' a {th['model']['n_layers']} x {th['model']['d_model']} model. "
            "Seed 1: " + _provenance(d["meta"]) + " Seed 0: " + _provenance(d)]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- boosting (A5)
BOOSTING_CMD = ("python -m ppl_thought.experiments.next_token_boosting "
                "--json benchmarks/results/next_token_boosting.json")


def boosting(d: dict) -> str:
    """docs/diagnostics.md: Theorem 3, Lemmas 1-2 and the eps sweep of next-token boosting on the A5 task
    (``experiments/next_token_boosting.py`` at its default size)."""
    c, t3, l1, l2 = d["config"], d["theorem3"], d["lemma1"], d["lemma2"]
    n_win = c["n"] - c["k"] + 1
    by_eps = {e["eps"]: e for e in d["eps_sweep"]}
    big = [e for e in (1.0, 4.0) if e in by_eps]
    after = " / ".join(f"{x['advantage_after']:.3f}" for x in [d["eps_sweep"][0]] + [by_eps[e] for e in big])
    rows = [
        "| | paper | measured |", "|---|---|---|",
        f"| advantage a (1.2) vs Theorem 3 | a ≤ sqrt(min(k, N) KL / (2N)) = {t3['bound']:.3f} (KL(p‖q) = "
        f"{d['kl_p_q_nats_per_doc']:.2f} nats/doc, N = {n_win}) | {d['advantage']:.3f} ± {d['advantage_se']:.3f} |",
        f"| KL fall at eps = a/2, offset m = {d['offset_m']} (Lemma 1) | ≥ a² N / (8k) = "
        f"{l1['guaranteed_fall_nats_per_doc']:.3f} nats/doc | {l1['measured_fall_nats_per_doc']:.3f} ± "
        f"{l1['measured_fall_se']:.3f} |",
        f"| per-token loss fall (Lemma 2) | ≥ {l2['guaranteed_fall_nats_per_token']:.4f} nats/token "
        f"| {l2['measured_fall_nats_per_token']:.4f} |",
        f"| advantage after boosting, eps = a/2{''.join(f' / {e:g}' for e in big)} | (not stated) | {after} |"]
    if big:
        rows.append(f"| KL fall, eps = {' / '.join(f'{e:g}' for e in big)} | (Lemma 1 needs only eps = a/2) | "
                    + " / ".join(f"{by_eps[e]['kl_fall_nats_per_doc']:.2f}" for e in big) + " nats/doc |")
    head = (f"A {c['n_layers']}-layer Transformer (d_model {c['d_model']}) trained for {c['steps']} steps on "
            f"documents of n = {c['n']} tokens, k = {c['k']}, {c['num_test']} held-out prefixes and documents.")
    return head + "\n\n" + "\n".join(rows) + f"\n\n{_provenance(d)}\n"


@dataclass(frozen=True)
class Table:
    source: str  # JSON under the repository root
    render: Callable[[dict], str]
    command: str  # what writes the JSON
    meta: str | None = None  # a second JSON of the same run (``--meta``), passed to ``render`` as d["meta"]
    more: tuple[str, ...] = ()  # other runs' JSONs the table compares, passed to ``render`` as d["more"][path]


REAL_TRAINING_CMD = "python examples/real_training.py --quick --json benchmarks/results/real_training_quick.json"
SEC7_CMD = "python -m ppl_thought.experiments.sec7 --seeds 5 --n 8 16 --quick --json benchmarks/results/sec7_seeds.json"
TABLES: dict[str, Table] = {
    "sec7-seeds": Table("benchmarks/results/sec7_seeds.json", sec7_summary, SEC7_CMD),
    "sec7-verdict": Table("benchmarks/results/sec7_seeds.json", sec7_verdict, SEC7_CMD),
    "sec7-per-seed": Table("benchmarks/results/sec7_seeds.json", sec7_per_seed, SEC7_CMD),
    "sec7-scale": Table("benchmarks/results/sec7_seeds.json", sec7_scale, SEC7_CMD),
    "backends": Table("benchmarks/results/backends.json", backends, BACKENDS_CMD),
    "real-quick": Table("benchmarks/results/demo_real_quick.json", real_quick, TABLES_REAL_CMD),
    "real-quick-gains": Table("benchmarks/results/demo_real_quick.json", real_quick_gains, TABLES_REAL_CMD),
    "gpu-cpu-quick": Table("benchmarks/results/gpu_cpu_quick.json", gpu_cpu_quick, GPU_CPU_CMD,
                           meta="benchmarks/results/gpu_cpu_quick_meta.json"),
    "llamppl-race": Table("benchmarks/results/llamppl_race.json", llamppl_race, RACE_CMD),
    "llamppl-race-smollm2": Table("benchmarks/results/llamppl_race_smollm2.json", llamppl_race_smollm2,
                                  RACE_SMOLLM2_CMD),
    "genlm-smollm2": Table("benchmarks/results/llamppl_race_smollm2_genlm_n16.json", genlm_smollm2, GENLM_CMD),
    "smollm2-markers": Table("benchmarks/results/smollm2_markers.json", smollm2_markers, MARKERS_CMD),
    "smollm2-load": Table("benchmarks/results/smollm2_load.json", smollm2_load, LOAD_CMD),
    "checkpoint-race": Table("benchmarks/results/checkpoint_race.json", checkpoint_race,
                             "python benchmarks/checkpoint_race.py --loads 50000 --readers 2 --seed 0 --dir /dev/shm "
                             "--json benchmarks/results/checkpoint_race.json", more=(RACE_JITTER, RACE_JITTER_BEFORE)),
    "robustness-public": Table("benchmarks/results/robustness_public.json", robustness_public,
                               "python benchmarks/robustness.py --public --json "
                               "benchmarks/results/robustness_public.json"),
    "custom-program": Table("benchmarks/results/custom_program.json", custom_program, CUSTOM_CMD),
    "custom-program-numpyro": Table("benchmarks/results/custom_program_numpyro.json", custom_program_numpyro,
                                    CUSTOM_JAX_CMD),
    "chunked-encoding": Table("benchmarks/results/chunked_encoding.json", chunked_encoding, CHUNKED_CMD),
    "self-reducible": Table("benchmarks/results/self_reducible.json", self_reducible, SELF_REDUCIBLE_CMD),
    "token-automata": Table("benchmarks/results/token_automata.json", token_automata, TOKEN_AUTOMATA_CMD),
    "active-coding": Table("benchmarks/results/active_coding.json", active_coding, ACTIVE_CODING_CMD),
    "demo-quick-times": Table("benchmarks/results/demo_quick.json", demo_quick_times, DEMO_CMDS["quick"]),
    "a5-quick": Table("benchmarks/results/demo_quick.json", a5_quick, DEMO_CMDS["quick"]),
    "real-training-quick": Table("benchmarks/results/real_training_quick.json", real_training, REAL_TRAINING_CMD),
    "reproduce-quick": Table("benchmarks/results/reproduce_quick.json", reproduce_quick, REPRODUCE_CMD),
    "robustness": Table("benchmarks/results/robustness.json", robustness, ROBUSTNESS_CMD),
    "dyck-quick": Table("benchmarks/results/dyck_thesis_quick.json", dyck_methods, DYCK_QUICK_CMD),
    "dyck-full": Table("benchmarks/results/verifiers.json", dyck_methods, DYCK_FULL_CMD),
    "dyck-thesis": Table("benchmarks/results/dyck_thesis_quick.json", dyck_thesis, DYCK_QUICK_CMD,
                         meta="benchmarks/results/dyck_thesis_quick_seed1.json"),
    "boosting": Table("benchmarks/results/next_token_boosting.json", boosting, BOOSTING_CMD),
    "real-default": Table("benchmarks/results/real_thoughts_default.json", real_default,
                          "python examples/real_thoughts.py --json benchmarks/results/real_thoughts_default.json"),
    "arviz-weighted": Table("benchmarks/results/arviz_weighted.json", arviz_weighted, ARVIZ_WEIGHTED_CMD,
                            meta="benchmarks/results/arviz_weighted_n200.json"),
}


def load(name: str, root: Path = ROOT) -> dict:
    """The JSON of table ``name`` (with its ``--meta`` file under ``"meta"``)."""
    t = TABLES[name]
    d = json.loads((root / t.source).read_text())
    if t.meta:
        d = {**d, "meta": json.loads((root / t.meta).read_text())}
    if t.more:
        d = {**d, "more": {m: json.loads((root / m).read_text()) for m in t.more}}
    return d


def render(name: str, root: Path = ROOT) -> str:
    """Table ``name`` rendered from its JSON, ending with :func:`source_line` (file, commit, command)."""
    d = load(name, root)
    return TABLES[name].render(d).rstrip("\n") + "\n\n" + source_line(name, d) + "\n"


def doc_files(root: Path = ROOT) -> list[Path]:
    out = []
    for p in DOCS:
        q = root / p
        out += sorted(q.rglob("*.md")) if q.is_dir() else [q]
    return out


def blocks(text: str) -> list[tuple[str, str]]:
    """``(name, body)`` of every generated block of a Markdown text."""
    return [(m["name"], m["body"]) for m in BLOCK.finditer(text)]


def _indented(text: str, indent: str) -> str:
    return "".join(indent + line if line.strip() else line for line in text.splitlines(keepends=True))


def check(root: Path = ROOT) -> list[str]:
    """Problems: blocks that differ from their JSON, unknown names, tables no document shows."""
    problems, seen = [], set()
    for f in doc_files(root):
        for m in BLOCK.finditer(f.read_text()):
            name, body = m["name"], m["body"]
            seen.add(name)
            if name not in TABLES:
                problems.append(f"{f.relative_to(root)}: unknown table {name!r}")
            elif body != _indented(render(name, root), m["indent"]):
                problems.append(f"{f.relative_to(root)}: table {name!r} differs from {TABLES[name].source} "
                                "(python tools/doc_tables.py --write)")
    problems += [f"table {n!r} is in no document" for n in TABLES if n not in seen]
    return problems


def write(root: Path = ROOT) -> list[Path]:
    changed = []
    for f in doc_files(root):
        text = f.read_text()
        new = BLOCK.sub(lambda m: f"{m['indent']}<!-- doc-table {m['name']} -->\n"
                                  f"{_indented(render(m['name'], root), m['indent'])}{m['indent']}<!-- /doc-table -->",
                        text)
        if new != text:
            f.write_text(new)
            changed.append(f)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the generated blocks from their JSON")
    ap.add_argument("--list", action="store_true", help="list the tables")
    args = ap.parse_args(argv)
    if args.list:
        for name, t in TABLES.items():
            print(f"{name}: {t.source}  <-  {t.command}")
        return 0
    if args.write:
        for f in write():
            print(f"rewrote {f.relative_to(ROOT)}")
    problems = check()
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
