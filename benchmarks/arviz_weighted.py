"""What ArviZ reports on the default conversion of weighted results, against the exact posterior.

    python benchmarks/arviz_weighted.py [--seeds 40] [--json FILE]

Two enumerable models, every seed an independent run:

* ``slow_thinking``: the 49-sequence PauseToThink model of ``tests/test_diagnostics.py`` (Tabular bigram prior,
  x = "a b"), Importance(200) with the identity sampler; the statistic is E[|z|] (``z_length``), exact by
  enumeration of the lifting (Q_*, (2.24)).
* ``hmm``: a 3-state HMM over T = 4 observations, SMC(200) with the prior as proposal (bootstrap); the
  statistics are E[z_t] for each t, exact by enumerating the 3^4 hidden paths (Def 2.2).

Per seed, from ``az.summary`` / ``az.ess`` of ``to_inference_data(result)`` (the default conversion):
the summary mean's error against the exact posterior mean in units of its MCSE, and the largest
``az.ess`` over every variable of ``posterior`` (bulk, tail and mean methods) against the importance
ESS (sum w)^2 / sum w^2 of the run. The script only calls the public conversion, so it runs unchanged
on an older checkout (``PYTHONPATH=<checkout>``): that is how the "before" numbers were taken
(commit 44170bd's conversion, a resample of size n; its file is in git history). ``--num-draws 200``
gives that layout with the current conversion (``benchmarks/results/arviz_weighted_n200.json``; the
trade-off table in docs/diagnostics.md shows both).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import time
import warnings

import numpy as np
import torch

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.diagnostics import to_inference_data
from ppl_thought.diagnostics.inference_data import import_arviz

VOCAB = pt.Vocab(["a", "b"])


def slow_thinking_case():
    g = torch.Generator().manual_seed(0)
    V = len(VOCAB)
    prior = pt.lm.Tabular(2, V, torch.randn((V, V), generator=g) * 1.5, trainable=True)
    model = pt.models.SlowThinking(prior, pt.projections.PauseToThink(VOCAB, max_thought_len=2))
    post = model.exact_posterior("a b")
    exact = {"z_length": float((post.probs.double() * (post.support != 0).sum(-1).double()).sum())}

    def run(seed):
        torch.manual_seed(seed)
        return pt.infer.Importance(200).run(model, pt.guides.Identity(model), "a b")

    return run, exact


def hmm_case():
    A = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.7, 0.2], [0.2, 0.1, 0.7]], dtype=torch.float64)
    B = torch.tensor([[0.8, 0.2], [0.3, 0.7], [0.5, 0.5]], dtype=torch.float64)
    lam = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    hmm = pt.models.HMM(A, B, lam)
    x = torch.tensor([0, 1, 1, 0])
    paths = torch.tensor(list(itertools.product(range(3), repeat=len(x))))
    lj = hmm.log_joint(paths, x.expand(len(paths), -1))
    p = torch.softmax(lj, 0)
    exact = {f"z_{t}": float((p * paths[:, t].double()).sum()) for t in range(len(x))}

    def run(seed):
        torch.manual_seed(seed)
        return pt.infer.SMC(200, generator=torch.Generator().manual_seed(seed)).run(hmm, None, x)

    return run, exact


def measure(run, exact: dict, seeds: range, num_draws: int | None = None) -> dict:
    az = import_arviz()
    rows = []
    for seed in seeds:
        r = run(seed)
        idata = to_inference_data(r) if num_draws is None else to_inference_data(r, num_draws=num_draws)
        ess_is = float(r.ess)
        ess_max = max(float(np.nanmax(np.asarray(az.ess(idata, method=m)[v])))
                      for m in ("bulk", "tail", "mean") for v in idata.posterior.data_vars)
        summ = az.summary(idata, var_names=list(exact))
        errs = {v: (float(summ.loc[v, "mean"]) - exact[v], float(summ.loc[v, "mcse_mean"]),
                    float(summ.loc[v, "ess_bulk"])) for v in exact}
        rows.append({"seed": seed, "ess_importance": ess_is, "az_ess_max": ess_max,
                     "num_draws": int(idata.posterior.sizes["draw"]), "errors": errs})
    out = {"exact": exact, "seeds": len(rows), "num_draws": float(np.mean([r["num_draws"] for r in rows])),
           "ess_importance_mean": float(np.mean([r["ess_importance"] for r in rows])),
           "az_ess_max_mean": float(np.mean([r["az_ess_max"] for r in rows])),
           "frac_az_ess_above_importance_ess": float(np.mean([r["az_ess_max"] > r["ess_importance"]
                                                               for r in rows]))}
    for v in exact:
        err = np.array([r["errors"][v][0] for r in rows])
        mcse = np.array([r["errors"][v][1] for r in rows])
        bulk = np.array([r["errors"][v][2] for r in rows])
        out[v] = {"rmse": float(np.sqrt((err**2).mean())), "mean_mcse": float(mcse.mean()),
                  "frac_beyond_3_mcse": float((np.abs(err) > 3 * mcse).mean()),
                  "ess_bulk_mean": float(bulk.mean()), "ess_bulk_range": [float(bulk.min()), float(bulk.max())]}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--json", default=None)
    p.add_argument("--num-draws", type=int, default=None,
                   help="size of the equal-weight posterior (default: the conversion's default)")
    args = p.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.getLogger("arviz").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    out = {name: measure(*case(), range(args.seeds), args.num_draws)
           for name, case in (("slow_thinking", slow_thinking_case), ("hmm", hmm_case))}
    out["num_draws_argument"] = args.num_draws
    out["seconds"] = time.perf_counter() - t0
    for name in ("slow_thinking", "hmm"):
        o = out[name]
        print(f"{name}: {o['seeds']} seeds, {o['num_draws']:.0f} draws, importance ESS {o['ess_importance_mean']:.1f}, "
              f"max az.ess {o['az_ess_max_mean']:.1f} (above the importance ESS in "
              f"{100 * o['frac_az_ess_above_importance_ess']:.0f}% of seeds)")
        for v, e in o["exact"].items():
            s = o[v]
            print(f"  {v:9s} exact {e:.4f}  RMSE {s['rmse']:.4f}  mean MCSE {s['mean_mcse']:.4f}  "
                  f"beyond 3 MCSE {100 * s['frac_beyond_3_mcse']:.0f}%  ess_bulk {s['ess_bulk_mean']:.1f} "
                  f"[{s['ess_bulk_range'][0]:.0f}, {s['ess_bulk_range'][1]:.0f}]")
    if args.json:
        with open(args.json, "w") as f:
            out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            json.dump(out, f, indent=1, default=lambda o: o if not isinstance(o, float) or math.isfinite(o) else None)
    return out


if __name__ == "__main__":
    main()
