"""Documented experiment tables, rendered from the committed JSON in benchmarks/results/ (issue 30, item 1).

    python tools/doc_tables.py            # check: exit 1 if a documented table differs from its JSON
    python tools/doc_tables.py --write    # rewrite every generated block from its JSON
    python tools/doc_tables.py --list     # the tables, their JSON and the command that writes it

In README.md and docs/*.md a generated block is

    <!-- doc-table NAME -->
    ...rendered from TABLES[NAME].source; never edited by hand...
    <!-- /doc-table -->

Each block ends with the command that wrote its JSON and the commit, machine and seconds recorded in it.
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
DOCS = ("README.md", "docs")
BLOCK = re.compile(r"<!-- doc-table (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /doc-table -->", re.S)


def _pm(mean: float, se: float | None, digits: int = 3, sign: bool = False) -> str:
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    if se is None or not math.isfinite(se):
        return f.format(mean)
    return f"{f.format(mean)} ± {se:.{digits}f}"


def _pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n.d."
    return f"{100 * x:+.0f} %"


def _provenance(d: dict, command: str | None = None) -> str:
    cmd = command or d.get("command")
    m = d.get("machine") or {}
    commit = d.get("commit")
    commit = (commit[:7] + (" + uncommitted changes" if d.get("dirty") else "")) if commit else "not recorded"
    machine = (f"{m.get('nproc')} cores ({m.get('processor') or '?'}), torch {m.get('torch')} with "
               f"{m.get('torch_threads')} thread(s)") if m else "not recorded"
    secs = next((v for v in (d.get("seconds"), d.get("total_seconds")) if isinstance(v, (int, float))), None)
    if not isinstance(secs, (int, float)):
        secs = "time not recorded"
    elif d.get("commands"):
        secs = f"{secs:.0f} s wall summed over its {len(d['commands'])} parts (run in parallel)"
    else:
        secs = f"{secs:.0f} s wall"
    return f"Written by `{cmd}`; commit {commit}; machine {machine}; {secs}."


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


def _ess(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


# ---------------------------------------------------------------------------------------------- backends
BACKENDS_CMD = "python benchmarks/backends.py --json benchmarks/results/backends.json"


def backends(d: dict) -> str:
    """docs/numpyro.md: torch vs JAX on SlowThinking (IS, SMC) and on the user program (``backends.json``)."""
    rows = ["| workload | N | torch particle-steps/s | JAX particle-steps/s | JAX / torch | JAX compile s |",
            "|---|---|---|---|---|---|"]
    for key, label in (("is", "SlowThinking, Importance"), ("smc", "SlowThinking, SMC (ESS 0.5)"),
                       ("program", "user program, bootstrap SMC")):
        for n, r in d.get(key, {}).items():
            comp = d.get("compile_s", {}).get(key, {}).get(n)
            rows.append(f"| {label} | {n} | {r['torch']:,.0f} | {r['jax']:,.0f} | {r['ratio_jax_over_torch']:.2f} | "
                        f"{'' if comp is None else f'{comp:.1f}'} |")
    fresh = d.get("rerun_fresh_engine_s", {})
    par = d.get("parity", {})
    lfp, lfe = par.get("max_abs_log_prob_diff", float("nan")), par.get("max_abs_exact_diff", float("nan"))
    tail = (f"A fresh `ptn.infer.SMC(N)` object on the user program, same configuration: "
            f"{', '.join(f'{v * 1000:.1f} ms (N = {n})' for n, v in fresh.items())} (no recompilation). "
            f"Parity on the same weights: max |log P(z)| difference {lfp:.1e}, max |exact log p(x)| difference "
            f"{lfe:.1e}. jax {d.get('jax')} on {d.get('jax_device')}; load average "
            f"{d.get('load_average_before', [float('nan')])[0]:.1f} before the run. " + _provenance(d, BACKENDS_CMD))
    return "\n".join(rows) + "\n\n" + tail + "\n"


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


@dataclass(frozen=True)
class Table:
    source: str  # JSON under the repository root
    render: Callable[[dict], str]
    command: str  # what writes the JSON


SEC7_CMD = "python -m ppl_thought.experiments.sec7 --seeds 5 --n 8 16 --quick --json benchmarks/results/sec7_seeds.json"
TABLES: dict[str, Table] = {
    "sec7-seeds": Table("benchmarks/results/sec7_seeds.json", sec7_summary, SEC7_CMD),
    "sec7-verdict": Table("benchmarks/results/sec7_seeds.json", sec7_verdict, SEC7_CMD),
    "sec7-per-seed": Table("benchmarks/results/sec7_seeds.json", sec7_per_seed, SEC7_CMD),
    "backends": Table("benchmarks/results/backends.json", backends, BACKENDS_CMD),
    "active-coding": Table("benchmarks/results/active_coding.json", active_coding, ACTIVE_CODING_CMD),
    "real-quick": Table("benchmarks/results/demo_real_quick.json", real_quick,
                        "ppl-thought demo --quick --parts real --seed 0 --threads 1 "
                        "--json benchmarks/results/demo_real_quick.json"),
}


def render(name: str, root: Path = ROOT) -> str:
    t = TABLES[name]
    return t.render(json.loads((root / t.source).read_text()))


def doc_files(root: Path = ROOT) -> list[Path]:
    out = []
    for p in DOCS:
        q = root / p
        out += sorted(q.rglob("*.md")) if q.is_dir() else [q]
    return out


def blocks(text: str) -> list[tuple[str, str]]:
    """``(name, body)`` of every generated block of a Markdown text."""
    return [(m["name"], m["body"]) for m in BLOCK.finditer(text)]


def check(root: Path = ROOT) -> list[str]:
    """Problems: blocks that differ from their JSON, unknown names, tables no document shows."""
    problems, seen = [], set()
    for f in doc_files(root):
        for name, body in blocks(f.read_text()):
            seen.add(name)
            if name not in TABLES:
                problems.append(f"{f.relative_to(root)}: unknown table {name!r}")
            elif body != render(name, root):
                problems.append(f"{f.relative_to(root)}: table {name!r} differs from {TABLES[name].source} "
                                "(python tools/doc_tables.py --write)")
    problems += [f"table {n!r} is in no document" for n in TABLES if n not in seen]
    return problems


def write(root: Path = ROOT) -> list[Path]:
    changed = []
    for f in doc_files(root):
        text = f.read_text()
        new = BLOCK.sub(lambda m: f"<!-- doc-table {m['name']} -->\n{render(m['name'], root)}<!-- /doc-table -->",
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
