"""Section 5's self-consistent sampler against its bounds, exactly: the TV-vs-T table of docs/verifiers.md.

    python benchmarks/self_reducible.py --json benchmarks/results/self_reducible.json [--formulas 8] [--m 12]

For ``--formulas`` random satisfiable 3-CNFs over ``--m`` variables (``round(3 m)`` clauses, seeds 0, 1, ...) and
the weak chain-of-thought ``WeakCoT(alpha, gamma, "flip")`` (Definition 5.10), every figure but one is exact,
computed over all ``2^m`` assignments (``ppl_thought/data/self_reducible.py``):

- ``tv``: TV(q_T, p) of the median-of-T sampler (6) to the uniform law p over R(x) (``sampler_log_law``,
  ``total_variation``), at (alpha, gamma) = (0.01, 0.25), (0.001, 0.25), (0.01, 0.1) and (0.01, -0.1);
- ``mass_outside``: q_T's mass on non-solutions, (0.01, 0.25);
- ``exact_log_count_error``: E_{y ~ q_T | R} |log q_T(y) + log |R(x)|| (``expected_log_count_error``), at (0.01, 0.25)
  and (0.01, -0.1);
- ``sharp_bound`` and ``lemma_bound``: Lemma 5.11 with the hybrid argument, ``tv_bound(sharp=True / False)``;
- the one sampled figure, ``sampled_log_count_error``: ``self_reducible_curve``'s counting by sampling
  (``--count`` solutions per formula, seed 0), for the T values up to ``--max-sampled-T``.

Each figure is the mean over the formulas; ``num_solutions`` lists |R(x)| of each.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from ppl_thought import provenance as pv
from ppl_thought.data.self_reducible import (
    WeakCoT,
    expected_log_count_error,
    random_cnf,
    sampler_log_law,
    self_reducible_curve,
    total_variation,
    tv_bound,
)
from ppl_thought.io import atomic_write_json

T_VALUES = (1, 3, 5, 9, 17, 33, 257)
SETTINGS = ((0.01, 0.25), (0.001, 0.25), (0.01, 0.1), (0.01, -0.1))


def key(alpha: float, gamma: float) -> str:
    return f"alpha={alpha:g},gamma={gamma:g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--formulas", type=int, default=8, help="random satisfiable 3-CNFs (seeds 0, 1, ...)")
    ap.add_argument("--m", type=int, default=12, help="variables per formula (2^m assignments are enumerated)")
    ap.add_argument("--count", type=int, default=2000, help="solutions drawn per formula for the sampled count")
    ap.add_argument("--max-sampled-T", type=int, default=33, help="the sampled count runs for T up to this")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    t0 = time.perf_counter()
    cnfs = [random_cnf(args.m, 3, round(3 * args.m), seed=s) for s in range(args.formulas)]
    n = len(cnfs)
    tv = {key(a, g): [] for a, g in SETTINGS}
    exact_err = {key(a, g): [] for a, g in ((0.01, 0.25), (0.01, -0.1))}
    outside, sharp, lemma, lemma_small = [], [], [], []
    for T in T_VALUES:
        for a, g in SETTINGS:
            model = WeakCoT(a, g, "flip")
            laws = [sampler_log_law(c, model, T) for c in cnfs]
            tv[key(a, g)].append(sum(total_variation(c, lq) for c, lq in zip(cnfs, laws)) / n)
            if key(a, g) in exact_err:
                exact_err[key(a, g)].append(sum(expected_log_count_error(c, lq) for c, lq in zip(cnfs, laws)) / n)
            if (a, g) == (0.01, 0.25):
                outside.append(sum(1 - float(lq[c.satisfied].exp().sum()) for c, lq in zip(cnfs, laws)) / n)
                sharp.append(sum(tv_bound(c, model, T, sharp=True) for c in cnfs) / n)
                lemma.append(sum(tv_bound(c, model, T) for c in cnfs) / n)
            if (a, g) == (0.001, 0.25):
                lemma_small.append(sum(tv_bound(c, model, T) for c in cnfs) / n)
        print(f"T = {T:3d}: TV {tv[key(0.01, 0.25)][-1]:.3f}, mass outside {outside[-1]:.3f}, "
              f"sharp bound {sharp[-1]:.3f}, Lemma 5.11 {lemma[-1]:.3f}", flush=True)
    sampled_T = [T for T in T_VALUES if T <= args.max_sampled_T]
    curve = self_reducible_curve(sampled_T, m=args.m, num_formulas=args.formulas, n_count=args.count, seed=0)
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(curve["tv"], tv[key(0.01, 0.25)]))  # same formulas
    out = {
        "T": list(T_VALUES), "m": args.m, "clauses": round(3 * args.m), "formulas": args.formulas,
        "num_solutions": [int(c.num_solutions) for c in cnfs], "bad": "flip",
        "tv": tv, "mass_outside": outside, "exact_log_count_error": exact_err,
        "sharp_bound": sharp, "lemma_bound": lemma, "lemma_bound_alpha=0.001": lemma_small,
        "sampled_log_count_error": {"T": sampled_T, "value": curve["log_count_error"], "count": args.count},
        "seconds": time.perf_counter() - t0, "torch": torch.__version__,
    }
    if args.json:
        out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, out)
    else:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
