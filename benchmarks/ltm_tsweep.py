"""LTM inference-steps sweep with one evaluation protocol for every model (issue 42, item 3).

latent-thought-models.txt, Algorithm 1 and Fig 1/4: models trained by dual-rate learning with T_fast fast steps
per mini-batch, T_fast in {0, 2, 4, 8, 16}, each a separate training from the same initial decoder on the same
batches (the quick sizes of :class:`ppl_thought.experiments.latent_thought.SweepConfig`), for two inner-loop
learning-rate schedules ("arms"):

* ``constant``: the fast rate 0.3 -> 0.34 over training (App. A.2), constant within the T_fast steps (the
  committed sweep before this script);
* ``cosine``: the same rate, decayed to 0 over the T_fast steps by a cosine (Sec 3.2: "for larger steps ...
  we adopt a cosine decay scheduler").

Every model is then scored twice on the same held-out sequences:

* ``own``: its ELBO-perplexity after its own T_fast inner steps at its training schedule (the budget at which
  the paper reports Fig 1: inference compute "close to trFLOPs/tok");
* ``common``: the same long, converged inference budget for every model (``--eval-T`` cosine-decayed Adam
  steps from the prior, then the importance-weighted bound with ``--iw`` draws from the fitted q), and the
  KL(q || p) per token of that converged q (how much the decoder's latent channel carries).

Seeds change the data, the batch order and the initial decoder. Each (seed) runs as its own process
(``--seed S --out-dir D``) and writes one JSON per run into D as it finishes; ``--aggregate D --json FILE`` then
writes the means over seeds with 95% t-intervals and the per-seed paired differences against T_fast = 0.

    python benchmarks/ltm_tsweep.py --seed 0 --out-dir /tmp/ltm_tsweep &   # likewise seeds 1, 2
    python benchmarks/ltm_tsweep.py --aggregate /tmp/ltm_tsweep --json benchmarks/results/ltm_tsweep.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
from dataclasses import asdict

import torch

from ppl_thought.data.markov_mixture import MarkovMixture
from ppl_thought.experiments.common import provenance
from ppl_thought.experiments.latent_thought import SweepConfig, train_ar_baseline
from ppl_thought.io import atomic_write_json
from ppl_thought.models import LatentThought
from ppl_thought.training import DualRateTrainer

ARMS = ("constant", "cosine")
#: ``--quick``, the size ``ppl-thought reproduce --quick`` runs (entry "ltm"): the cosine inner schedule only, the
#: two ends of the T_fast axis of Fig 1/4, two seeds one after the other in this process, the sweep's own model,
#: updates and common protocol (so the verdict is at the scale of the committed sweep, with fewer T_fast and seeds)
QUICK = {"seeds": (0, 1), "T": [0, 16], "arms": ("cosine",), "steps": 300, "eval_size": 128, "eval_T": 100,
         "iw": 128}


def _setup(cfg: SweepConfig, seed: int) -> tuple[MarkovMixture, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    data = MarkovMixture(cfg.vocab_size, cfg.num_chains, cfg.concentration, gen)
    train = data.sample(cfg.train_size, cfg.seq_len, gen)
    test = data.sample(cfg.eval_size, cfg.seq_len, gen)
    order = [torch.randint(0, cfg.train_size, (cfg.batch_size,), generator=gen) for _ in range(cfg.steps)]
    return data, train, test, order


def common_eval(ltm: LatentThought, test: torch.Tensor, T: int, lr: float, iw: int, batch: int = 128) -> dict:
    """The common protocol: T cosine-decayed Adam steps on Eq. 5 from the prior, then the ELBO (16 draws), the
    KL of the fitted q and the IW bound (``iw`` draws from q); totals in nats over the test set."""
    elbo = kl = iw_total = 0.0
    per_seq: list[float] = []
    for i in range(0, test.shape[0], batch):
        x = test[i:i + batch]
        guide = ltm.fit_local(x, None, T, lr, "cosine")
        with torch.no_grad():
            elbo += float(ltm.elbo(x, guide, None, 16, detach_guide=True).sum())
            kl += float(guide.kl_to_prior(detach=True).sum())
            iw_seq = ltm.iw_bound(x, guide.distribution(detach=True), iw)
            iw_total += float(iw_seq.sum())
            per_seq += (-iw_seq / x.shape[1]).tolist()
    n = test.numel()
    return {"elbo_ppl": math.exp(-elbo / n), "iw_ppl": math.exp(-iw_total / n), "kl_per_token": kl / n,
            "iw_nats_per_token": -iw_total / n, "iw_nats_per_seq": per_seq}


def run_seed(cfg: SweepConfig, seed: int, Ts: list[int], eval_T: int, out_dir: str,
             arms: tuple[str, ...] = ARMS, baseline: bool = True) -> None:
    data, train, test, order = _setup(cfg, seed)
    n_tok = test.numel()
    exact = -float(data.log_prob(test).sum()) / n_tok
    os.makedirs(out_dir, exist_ok=True)
    prov = provenance()

    def write(name: str, res: dict) -> None:
        res.update(seed=seed, exact_ppl=math.exp(exact), exact_nats_per_token=exact, commit=prov["commit"],
                   dirty=prov["dirty"], finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   load_avg=os.getloadavg()[0])
        atomic_write_json(os.path.join(out_dir, f"{name}_s{seed}.json"), res)
        print(name, seed, {k: v for k, v in res.items() if k.endswith("ppl") or k == "seconds"}, flush=True)

    if baseline:
        _ar_baseline(cfg, seed, train, test, order, write)
    # T_fast = 0 has no inner loop, so no inner schedule: one run, filed under "constant", whatever the arms
    runs = [("constant" if T == 0 else a, T) for T in _order(Ts) for a in (arms[:1] if T == 0 else arms)
            if T > 0 or baseline]
    for arm, T in runs:
        _train_and_eval(cfg, seed, arm, T, eval_T, train, test, order, write)


def _ar_baseline(cfg: SweepConfig, seed: int, train: torch.Tensor, test: torch.Tensor, order: list[torch.Tensor],
                 write) -> None:
    """The windowed autoregressive Transformer: same batches, schedule and clipping as the LTM's slow step."""
    t = time.time()
    ar_nats = train_ar_baseline(cfg, train, test, order, seed)
    write("ar", {"ar_window_ppl": math.exp(ar_nats), "ar_nats_per_token": ar_nats, "seconds": time.time() - t})


def _order(Ts: list[int]) -> list[int]:
    """T = 0 (no inner loop, one run) and the ends of the sweep first, so that a run cut short keeps them."""
    first = [T for T in (0, 16, 4, 8, 2) if T in Ts]
    return first + [T for T in Ts if T not in first]


def _train_and_eval(cfg: SweepConfig, seed: int, arm: str, T: int, eval_T: int, train: torch.Tensor,
                    test: torch.Tensor, order: list[torch.Tensor], write) -> None:
    """One dual-rate training (Algorithm 1) at T inner steps with the arm's inner schedule, then both evaluations."""
    if True:
        t, cpu = time.time(), time.process_time()
        torch.manual_seed(seed)  # the same initial decoder for every run of a seed
        ltm = LatentThought(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_z, window=cfg.window,
                            d_latent=cfg.d_latent, max_len=cfg.seq_len)
        trainer = DualRateTrainer(ltm, cfg.steps, T, slow_lr=cfg.slow_lr, slow_lr_min=cfg.slow_lr_min,
                                  warmup_steps=cfg.warmup, inner_schedule=arm, progress=False)
        torch.manual_seed(seed + 1)
        trainer.fit(train[i] for i in order)
        train_s = time.time() - t
        lr = trainer.current_fast_lr()
        tail = trainer.history[-max(1, cfg.steps // 10):]
        torch.manual_seed(seed + 2)
        own = ltm.evaluate(test, num_steps=T, lr=lr, schedule=arm, elbo_samples=16)
        torch.manual_seed(seed + 3)
        com = common_eval(ltm, test, eval_T, lr, cfg.iw_samples)
        write(f"{arm}_T{T}", {
            "arm": arm, "T_fast": T, "own_elbo_ppl": own["elbo_ppl"], "common": com,
            "train_kl_per_token_last10pct": sum(h["kl_per_token"] for h in tail) / len(tail),
            "train_elbo_ppl_last10pct": math.exp(sum(h["loss"] for h in tail) / len(tail)),
            "seconds": time.time() - t, "train_seconds": train_s, "cpu_seconds": time.process_time() - cpu})


def _ci(xs: list[float]) -> dict:
    from scipy.stats import t as student_t

    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return {"mean": m, "lo": None, "hi": None, "n": n}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = float(student_t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return {"mean": m, "lo": m - h, "hi": m + h, "n": n}


def _paired_sequences(rs: list[dict], base: dict[int, dict]) -> dict | None:
    """The IW nats/token of each test sequence minus T_fast = 0's on the same sequence (same seed), pooled over the
    seeds: mean, standard error and count (None for runs that did not record per-sequence values)."""
    d = [a - b for r in rs if r["seed"] in base and "iw_nats_per_seq" in r["common"]
         for a, b in zip(r["common"]["iw_nats_per_seq"], base[r["seed"]]["common"].get("iw_nats_per_seq", []))]
    if len(d) < 2:
        return None
    m = sum(d) / len(d)
    se = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d))
    return {"mean": m, "se": se, "n": len(d)}


def aggregate(out_dir: str) -> dict:
    runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out_dir, "*_s*.json")))]
    seeds = sorted({r["seed"] for r in runs})
    ar = {r["seed"]: r for r in runs if "ar_window_ppl" in r}
    ltm = [r for r in runs if "arm" in r]
    base = {r["seed"]: r for r in ltm if r["T_fast"] == 0}
    table: dict = {}
    for arm in ARMS:
        for T in sorted({r["T_fast"] for r in ltm}):
            rs = [r for r in ltm if r["T_fast"] == T and r["arm"] == arm]
            if not rs:
                continue
            paired = [r["common"]["iw_nats_per_token"] - base[r["seed"]]["common"]["iw_nats_per_token"]
                      for r in rs if r["seed"] in base]
            gap = [(ar[r["seed"]]["ar_nats_per_token"] - r["common"]["iw_nats_per_token"])
                   / (ar[r["seed"]]["ar_nats_per_token"] - r["exact_nats_per_token"]) for r in rs if r["seed"] in ar]
            table.setdefault(arm, {})[str(T)] = {
                "seeds": [r["seed"] for r in rs],
                "common_iw_ppl": _ci([r["common"]["iw_ppl"] for r in rs]),
                "common_elbo_ppl": _ci([r["common"]["elbo_ppl"] for r in rs]),
                "common_kl_per_token": _ci([r["common"]["kl_per_token"] for r in rs]),
                "own_elbo_ppl": _ci([r["own_elbo_ppl"] for r in rs]),
                "train_kl_per_token": _ci([r["train_kl_per_token_last10pct"] for r in rs]),
                "iw_nats_vs_T0": _ci(paired),
                "per_seed_iw_nats_vs_T0": paired,
                "iw_nats_vs_T0_per_sequence": _paired_sequences(rs, base),
                "gap_closed": _ci(gap),
                "per_seed_iw_ppl": [r["common"]["iw_ppl"] for r in rs],
            }
    return {"table": table, "seeds": seeds,
            "exact_ppl": _ci([ar[s]["exact_ppl"] for s in seeds if s in ar]),
            "ar_window_ppl": _ci([ar[s]["ar_window_ppl"] for s in seeds if s in ar]),
            "runs": runs}


def tables(res: dict) -> str:
    """The Markdown table of docs/latent-thought.md ("Inference steps: one evaluation protocol")."""
    def f(c: dict, d: int = 3) -> str:
        if c["lo"] is None:
            return f"{c['mean']:.{d}f}"
        return f"{c['mean']:.{d}f} [{c['lo']:.{d}f}, {c['hi']:.{d}f}]"

    cfg = res["config"]
    lines = [f"Mean over seeds {res['seeds']} with 95% t-intervals; exact perplexity {f(res['exact_ppl'])}, windowed "
             f"AR {f(res['ar_window_ppl'])}. Common protocol: {cfg['eval_T']} cosine-decayed inner steps, IW bound "
             f"with K = {cfg['iw_samples']}, {cfg['eval_size']} test sequences. Commit {res.get('commit')}.", "",
             "| inner schedule | T_fast | IW ppl, common | Delta nats/token vs T_fast = 0 | share of AR-to-exact gap "
             "closed | KL/token of converged q | own ELBO-ppl (T_eval = T_fast) | train KL/token |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, rows in res["table"].items():
        for T, r in rows.items():
            lines.append(f"| {arm if T != '0' else '- (no inner loop)'} | {T} | {f(r['common_iw_ppl'])} | "
                         f"{f(r['iw_nats_vs_T0'])} | {f(r['gap_closed'], 2)} | {f(r['common_kl_per_token'])} | "
                         f"{f(r['own_elbo_ppl'])} | {f(r['train_kl_per_token'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int)
    ap.add_argument("--out-dir", default="/tmp/ltm_tsweep")
    ap.add_argument("--T", type=int, nargs="+", default=[0, 2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--eval-T", type=int, default=100)
    ap.add_argument("--iw", type=int, default=256)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--no-baseline", action="store_true", help="skip the AR baseline and T_fast = 0 (run elsewhere)")
    ap.add_argument("--aggregate", metavar="DIR")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--command", help="the command lines that produced the runs (recorded in the JSON)")
    ap.add_argument("--tables", metavar="JSON", help="print the Markdown table of an aggregated JSON and exit")
    ap.add_argument("--quick", action="store_true",
                    help="the size of `ppl-thought reproduce --quick` (QUICK: seeds 0 and 1, cosine, T_fast 0 and "
                         "16): runs the seeds here, one after the other, and writes the aggregate to --json")
    args = ap.parse_args(argv)
    if args.tables:
        print(tables(json.load(open(args.tables))), end="")
        return 0
    if args.quick:
        return _quick(args.json, argv)
    cfg = SweepConfig(steps=args.steps, eval_size=args.eval_size, iw_samples=args.iw, eval_T=args.eval_T, T_fast=args.T)
    if args.aggregate:
        res = aggregate(args.aggregate)
        runs = res["runs"]
        res.update(config=asdict(cfg), **provenance(), command=args.command or " ".join(sys.argv),
                   seconds_per_seed={str(s): sum(r["seconds"] for r in runs if r["seed"] == s) for s in res["seeds"]})
        print(tables(res), end="")
        if args.json:
            atomic_write_json(args.json, res)
        return 0
    torch.set_num_threads(1)
    run_seed(cfg, args.seed, args.T, args.eval_T, args.out_dir, tuple(args.arms), not args.no_baseline)
    return 0


def _quick(json_path: str | None, argv: list[str] | None) -> int:
    """``--quick``: every seed of :data:`QUICK` in this process (a fresh folder for the per-run JSONs), then the
    aggregate with ``ppl_thought.provenance`` (command, commit, seconds) to ``json_path``."""
    import tempfile

    from ppl_thought import provenance as pv

    rec = pv.start(__file__, argv, threads=1)
    q = QUICK
    cfg = SweepConfig(steps=q["steps"], eval_size=q["eval_size"], iw_samples=q["iw"], eval_T=q["eval_T"], T_fast=q["T"])
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ltm_tsweep_quick_") as out_dir:
        for seed in q["seeds"]:
            run_seed(cfg, seed, q["T"], q["eval_T"], out_dir, q["arms"], True)
        res = aggregate(out_dir)
    res.update(config=asdict(cfg), quick=dict(q), seconds_per_seed={
        str(s): sum(r["seconds"] for r in res["runs"] if r["seed"] == s) for s in res["seeds"]})
    res = pv.stamped(res, rec)
    print(tables(res | {"commit": res[pv.KEY]["commit"]}), end="")
    if json_path:
        atomic_write_json(json_path, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
