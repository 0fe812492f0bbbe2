"""Active lifting learns a code (Section 6.3, minimum-length regular coding), compared with Huffman's.

For N in {8, 16, 32}: a random P_* over N elements, Omega = {0, 1}; one Transformer plays the sampler Q,
the latent model P and the decoder G (``pt.transforms.ActiveLift``), trained on (6.10) with the
score-function estimator of ``pt.train.active_terms``; the learned (6.12) value, expected code length,
H(X | Z) and prefix-freeness are computed exactly and set next to Huffman's code and the entropy bound.
Each remedy (exact posterior decoder, entropy annealing, both) is a variant run with R restarts.
See ppl_thought/experiments/active_coding.py and docs/active-lifting.md.

    python examples/active_lifting.py [--quick | --smoke] [--seed S] [--json FILE] [--plot FILE]

``--quick`` is the committed run (N = 8 and 16, ``CodingConfig.quick()``); ``--smoke`` a few steps at N = 8
(the tests). ``--plot`` draws Figure 6.1 (right) from this run (matplotlib, Agg).
"""

from __future__ import annotations

import argparse
import json

import torch

from ppl_thought import provenance as pv
from ppl_thought.experiments.active_coding import CodingConfig, plot_coding, run_active_coding
from ppl_thought.io import atomic_write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 8 and 16, every remedy, 3 restarts")
    ap.add_argument("--smoke", action="store_true", help="N = 8, a few steps (the tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results as JSON to this file")
    ap.add_argument("--plot", default=None, help="write Figure 6.1 (right) from this run to this PNG")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1 is fastest)")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    torch.set_num_threads(args.threads)
    cfg = CodingConfig.smoke() if args.smoke else CodingConfig.quick() if args.quick else CodingConfig()
    res = run_active_coding(cfg, args.seed, progress=True)
    if args.json:
        res[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, res)
    if args.plot:
        plot_coding(res, args.plot)
    rows = [f"{'N':>3} {'learned (6.12)':>15} {'Huffman (6.12)':>15} {'learned E|c|':>13} {'Huffman E|c|':>13} "
            f"{'H(P*)':>7} {'H(X|Z) nats':>12} {'prefix-free':>11}"]
    for N, r in res["coding"].items():
        rows.append(f"{N:>3} {r['learned_objective']:>15.3f} {r['huffman_objective']:>15.3f} "
                    f"{r['learned_length']:>13.3f} {r['huffman_length']:>13.3f} {r['entropy']:>7.3f} "
                    f"{r['h_x_given_z']:>12.4f} "
                    f"{str(r['prefix_free']):>11}")
    rows.append(f"{'N':>3} {'variant':>14} {'(6.10) bits':>12} {'vs Huffman':>10} {'H(X|Z) nats':>12} "
                f"{'prefix-free':>11} {'restarts within 5%':>18}")
    for N, r in res["coding"].items():
        for v, s in r["remedies"].items():
            rows.append(f"{N:>3} {v:>14} {s['learned_objective']:>12.3f} {100 * s['relative_gap']:>+9.1f}% "
                        f"{s['h_x_given_z']:>12.4f} {str(s['prefix_free']):>11} {s['restarts_within_5pct']:>18.2f}")
    print("\n".join(rows))
    print(json.dumps(res["criteria"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
