"""Tables 3.1-3.3 of the data-training-inference thesis (Section 3.2.1) at small scale, with a trained verifier.

    python -m ppl_thought.experiments.dyck_thesis [--quick] [--seed S] [--json FILE]

The protocol of Section 3.2.1, step by step:

1. A small Transformer is trained on strings of the Dyck distribution of Definition 3.2.1
   (:class:`~ppl_thought.data.DyckDistribution`, ``p = 0.2, q = 0.5``; ``D = 16`` here, 32 in the thesis:
   :class:`DyckThesisConfig`).
2. OOD prompts (Section 3.2.1.1): prefixes of length ``N``, uniform in ``D - 7..D - 1`` (25..31 in the thesis),
   drawn with ``p = 0.8``.
3. The verifier (Section 3.2.1.2): the LM completes OOD prompts with nucleus sampling ``top_p = 0.9``; the error
   parser (:func:`~ppl_thought.verifiers.first_errors`) cuts each wrong completion after its first error
   (``X_error``); as many OOD prefixes of the same lengths are drawn (``X_correct``); a linear layer on the LM's
   last-layer-last-position features learns to tell them apart (:class:`~ppl_thought.verifiers.LinearProbeVerifier`,
   90 of every 882 strings held out).
4. Table 3.1: at the error-inducing prefixes ``x_{1:|x|-1}``, ``x`` in ``X_error``, one forced backtrack of stride
   ``B`` (Algorithm 1's erase-and-redo-greedily, triggered unconditionally at the first sampled token) and then
   nucleus sampling, against nucleus and greedy decoding.
5. Table 3.2: Algorithm 1 with the trained verifier at the same prefixes, ``Q in {1, 2, 4}``, ``B in {2, 4, 6}``.
   In 4 and 5 a backtrack may erase the model's own tokens of the prefix, never the OOD prompt.
6. Table 3.3: fresh OOD prompts, errors (completions outside Dyck_D) without backtracking (``Q = 0``) and with
   Algorithm 1 (``Q = 4, B = 4``) using the trained verifier and, as a reference, the exact process verifier
   (Def 3.1.3), at ``top_p = 0.9`` and ``1.0``; mean and standard error over repeats, and the same per 10000
   prompts (the thesis' count). The trained verifier's decisions are checked against the exact verifier's on
   every prefix it was asked about.

The thesis' numbers sit beside ours in :data:`THESIS_TABLES`. Its model is a 6-layer, 512-wide Transformer
trained to 100% accuracy; ours is far smaller (the ``setup`` entry of the JSON), so our error rates are higher:
compare the direction and size of the changes, not the counts.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ppl_thought import checks
from ppl_thought import provenance as pv
from ppl_thought.data.dyck import DyckDistribution
from ppl_thought.errors import ConfigError, SamplingBudgetError
from ppl_thought.io import atomic_write_json
from ppl_thought.lm import Transformer
from ppl_thought.verifiers import LinearProbeVerifier, TokenwiseBacktracking, first_errors
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["THESIS_TABLES", "DyckThesisConfig", "run", "main"]

#: The thesis' figures, typed once: data-training-inference thesis, Section 3.2.1, Tables 3.1, 3.2 and 3.3 (and the
#: verifier's validation accuracy and the nucleus OOD accuracy quoted in Sections 3.2.1.1-3.2.1.2).
THESIS_TABLES = {
    "source": "data-training-inference thesis, Section 3.2.1, Tables 3.1-3.3",
    "table_3_1": {"nucleus_0.9": 0.331, "greedy": 0.334, "B=1": 0.366, "B=2": 0.438, "B=4": 0.591, "B=8": 0.790},
    "table_3_2": {"Q=1,B=2": 0.421, "Q=1,B=4": 0.500, "Q=1,B=6": 0.604, "Q=2,B=2": 0.457, "Q=2,B=4": 0.634,
                  "Q=2,B=6": 0.762, "Q=4,B=2": 0.518, "Q=4,B=4": 0.762, "Q=4,B=6": 0.921,
                  "nucleus_0.9": 0.331, "greedy": 0.334},
    "table_3_3": {"top_p=0.9": {"Q=0,B=0": {"errors": 240.0, "stderr": 5.177},
                                "Q=4,B=4": {"errors": 179.4, "stderr": 1.020}},
                  "top_p=1.0": {"Q=0,B=0": {"errors": 461.8, "stderr": 8.304},
                                "Q=4,B=4": {"errors": 200.0, "stderr": 3.225}},
                  "prompts": 10000, "repeats": 5},
    "verifier_val_accuracy": {"mean": 0.93, "stderr": 0.039, "repeats": 10},
    "ood_accuracy_nucleus_0.9": 0.9423,
    "verifier_data": {"errors": 441, "correct": 441, "train": 792, "val": 90},
    "model": {"n_layers": 6, "n_heads": 8, "d_model": 512, "D": 32, "p": 0.2, "q": 0.5, "batch": 32,
              "lr": 3e-4, "weight_decay": 0.1},
}

_GREEDY_TOP_P = 1e-9  # the nucleus of a tiny mass is the most probable token: greedy (argmax) decoding


@dataclass
class DyckThesisConfig:
    """The knobs of the protocol (module docstring); the defaults are the full run, :meth:`quick` the short one.

    Strings have length ``D = 16``, not the thesis' 32, and prompts lengths 9..15 (completions of 1 to 7 tokens,
    as with the thesis' 25..31 out of 32): a 2-layer Transformer learns D = 16 in a few hundred steps on a CPU
    and D = 32 far more slowly. ``DyckThesisConfig(D=32, prompt_min=25, prompt_max=31)`` is the thesis' setting.
    The verifier data (441 + 441 strings), the prompt count (10000) and the repeats (5) of the full run are the
    thesis'.
    """

    D: int = 16
    p: float = 0.2
    q: float = 0.5
    p_ood: float = 0.8
    prompt_min: int = 9
    prompt_max: int = 15
    d_model: int = 48
    n_layers: int = 2
    n_heads: int = 4
    train_steps: int = 3000
    batch: int = 64
    lr: float = 5e-3
    weight_decay: float = 0.1
    n_errors: int = 441  # X_error (and X_correct) sizes, as in the thesis
    collect_batch: int = 2000
    collect_rounds: int = 20
    table_repeats: int = 5
    unseen_prompts: int = 10000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("D", "d_model", "n_layers", "n_heads", "train_steps", "batch", "n_errors", "collect_batch",
                     "collect_rounds", "table_repeats", "unseen_prompts"):
            checks.integer(f"DyckThesisConfig: {name}", getattr(self, name))
        checks.integer("DyckThesisConfig: prompt_min", self.prompt_min, 0)
        if not self.prompt_min <= self.prompt_max < self.D:
            raise ConfigError(f"DyckThesisConfig: prompt lengths need prompt_min <= prompt_max < D, got "
                              f"prompt_min={self.prompt_min}, prompt_max={self.prompt_max}, D={self.D}")
        checks.real("DyckThesisConfig: p_ood", self.p_ood, 0.0, 1.0, open_min=True, open_max=True)

    @classmethod
    def quick(cls, seed: int = 0) -> DyckThesisConfig:
        """Fewer training steps, error strings, prompts and repeats than the full run."""
        return cls(train_steps=800, n_errors=200, collect_batch=1000, table_repeats=2, unseen_prompts=1000,
                   seed=seed)


# ---------------------------------------------------------------------------------------------- pieces
def train_lm(dist: DyckDistribution, cfg: DyckThesisConfig) -> Transformer:
    """A small Transformer trained by teacher forcing on fresh strings of Definition 3.2.1 (AdamW, cosine lr)."""
    torch.manual_seed(cfg.seed)
    lm = Transformer(len(dist.vocab), d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                     max_len=dist.D + 1)
    opt = torch.optim.AdamW(lm.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 100) * 0.5 * (1 + math.cos(math.pi * i / cfg.train_steps)))
    g = torch.Generator().manual_seed(cfg.seed)
    bos = torch.full((cfg.batch, 1), BOS_ID, dtype=torch.long)
    chunk = 100  # draw the strings of 100 steps at once (one batched loop over positions)
    lm.train()
    for i in range(cfg.train_steps):
        if i % chunk == 0:
            data = dist.sample(cfg.batch * min(chunk, cfg.train_steps - i), seed=g)
        z = data[(i % chunk) * cfg.batch:(i % chunk + 1) * cfg.batch]
        logits, _ = lm(torch.cat([bos, z[:, :-1]], 1))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), z.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    lm.eval()
    return lm


def ood_prompts(dist: DyckDistribution, cfg: DyckThesisConfig, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` OOD prompts (Section 3.2.1.1), right-padded ``[n, prompt_max]``: length uniform in
    ``prompt_min..prompt_max``, drawn from Definition 3.2.1 with ``p = p_ood``."""
    ood = dist.with_p(cfg.p_ood)
    full = ood.sample(n, length=cfg.prompt_max, seed=g)
    lengths = torch.randint(cfg.prompt_min, cfg.prompt_max + 1, (n,), generator=g)
    cols = torch.arange(cfg.prompt_max)
    return torch.where(cols[None] < lengths[:, None], full, torch.full_like(full, PAD_ID))


def complete(lm, verifier, prompts: torch.Tensor, D: int, quota: int, stride: int, top_p: float,
             keep: torch.Tensor | None = None, seed: int = 0):
    """Algorithm 1 on per-row prompts (Q = 0: plain sampling from the nucleus); the whole strings ``[n, D]``."""
    alg = TokenwiseBacktracking(prompts.shape[0], D, quota=quota, stride=max(stride, 1), top_p=top_p)
    return alg.run(lm, verifier, row_prompts=prompts, keep=keep, generator=torch.Generator().manual_seed(seed))


def _never(prefixes: torch.Tensor) -> torch.Tensor:
    """A verifier that rejects every prefix: with quota 1, Algorithm 1 backtracks exactly once, at once."""
    return torch.zeros(prefixes.shape[0], dtype=torch.bool, device=prefixes.device)


class _Audited:
    """A verifier whose every decision is compared with the exact process verifier's (accuracy, misses)."""

    def __init__(self, trained, exact):
        self.trained, self.exact = trained, exact
        self.counts = {"calls": 0, "agree": 0, "false_reject": 0, "false_accept": 0, "exact_reject": 0}

    def __call__(self, prefixes: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(self.trained(prefixes)).bool()
        e = self.exact(prefixes).to(t.device)
        c = self.counts
        c["calls"] += int(t.numel())
        c["agree"] += int((t == e).sum())
        c["false_reject"] += int((~t & e).sum())
        c["false_accept"] += int((t & ~e).sum())
        c["exact_reject"] += int((~e).sum())
        return t


def collect_verifier_data(lm, dist: DyckDistribution, cfg: DyckThesisConfig, g: torch.Generator) -> dict:
    """Section 3.2.1.2's data: the LM's wrong nucleus completions of OOD prompts cut after the first error
    (``errors``, with the OOD prompt length of each), and OOD prefixes of the same lengths (``correct``);
    also the LM's OOD accuracy with nucleus sampling over the prompts used."""
    errs, keeps, seen, wrong = [], [], 0, 0
    for r in range(cfg.collect_rounds):
        prompts = ood_prompts(dist, cfg, cfg.collect_batch, g)
        z = complete(lm, dist.verifier, prompts, dist.D, 0, 0, 0.9, seed=cfg.seed + 7919 * (r + 1)).samples["z"]
        first = first_errors(dist.verifier, z)
        bad = torch.nonzero(first >= 0).squeeze(-1)
        seen += len(prompts)
        wrong += len(bad)
        cols = torch.arange(dist.D)
        zb = z[bad]
        errs.append(torch.where(cols[None] <= first[bad, None], zb, torch.full_like(zb, PAD_ID)))
        keeps.append((prompts[bad] != PAD_ID).sum(-1))
        if sum(len(e) for e in errs) >= cfg.n_errors:
            break
    errors = torch.cat(errs)[:cfg.n_errors]
    keep = torch.cat(keeps)[:cfg.n_errors]
    lengths = (errors != PAD_ID).sum(-1)
    ood = dist.with_p(cfg.p_ood)
    correct = torch.full_like(errors, PAD_ID)
    for L in lengths.unique().tolist():  # X_correct: OOD prefixes with X_error's length distribution
        rows = torch.nonzero(lengths == L).squeeze(-1)
        correct[rows, :L] = ood.sample(len(rows), length=L, seed=g)
    return {"errors": errors, "keep": keep, "correct": correct,
            "ood_accuracy_nucleus_0.9": 1.0 - wrong / max(seen, 1), "ood_prompts_completed": seen}


def _accuracy(dist: DyckDistribution, z: torch.Tensor) -> float:
    return float(dist.is_valid(z).float().mean())


def _mean_se(xs: list[float]) -> dict:
    t = torch.tensor(xs, dtype=torch.float64)
    se = float(t.std(unbiased=True) / math.sqrt(len(xs))) if len(xs) > 1 else float("nan")
    return {"mean": float(t.mean()), "stderr": se, "runs": [float(x) for x in xs]}


def tables_1_2(lm, dist: DyckDistribution, verifier, data: dict, cfg: DyckThesisConfig) -> tuple[dict, dict]:
    """Tables 3.1 and 3.2 on the error-inducing prefixes (mean accuracy and standard error over repeats)."""
    prefixes = data["errors"].clone()
    last = (prefixes != PAD_ID).sum(-1) - 1
    prefixes[torch.arange(len(prefixes)), last] = PAD_ID  # x_{1:|x|-1}
    keep = data["keep"]
    seeds = [cfg.seed + 101 * (r + 1) for r in range(cfg.table_repeats)]

    def acc(quota, stride, top_p, ver):
        return _mean_se([_accuracy(dist, complete(lm, ver, prefixes, dist.D, quota, stride, top_p, keep, s)
                                   .samples["z"]) for s in seeds])

    base = {"nucleus_0.9": acc(0, 0, 0.9, dist.verifier), "greedy": acc(0, 0, _GREEDY_TOP_P, dist.verifier)}
    t1 = dict(base)
    for B in (1, 2, 4, 8):
        t1[f"B={B}"] = acc(1, B, 0.9, _never)
    t2 = {}
    for Q in (1, 2, 4):
        for B in (2, 4, 6):
            t2[f"Q={Q},B={B}"] = acc(Q, B, 0.9, verifier)
    t2.update(base)
    return t1, t2


def table_3(lm, dist: DyckDistribution, verifier, cfg: DyckThesisConfig) -> tuple[dict, dict]:
    """Table 3.3 on fresh OOD prompts (new prompts each repeat), and the audit of the trained verifier."""
    audited = _Audited(verifier, dist.verifier)
    out: dict = {}
    runs: dict[tuple[str, str], list[float]] = {}
    for r in range(cfg.table_repeats):
        g = torch.Generator().manual_seed(cfg.seed + 5003 * (r + 1))
        prompts = ood_prompts(dist, cfg, cfg.unseen_prompts, g)
        for top_p in (0.9, 1.0):
            for name, (Q, B, ver) in {"Q=0,B=0": (0, 0, dist.verifier), "Q=4,B=4": (4, 4, audited),
                                      "Q=4,B=4,exact_verifier": (4, 4, dist.verifier)}.items():
                z = complete(lm, ver, prompts, dist.D, Q, B, top_p, seed=cfg.seed + 31 * r).samples["z"]
                runs.setdefault((f"top_p={top_p}", name), []).append(float((~dist.is_valid(z)).sum()))
    scale = 10000 / cfg.unseen_prompts
    for (tp, name), errs in runs.items():
        row = _mean_se(errs)
        row["errors_per_10000"] = row["mean"] * scale
        row["stderr_per_10000"] = row["stderr"] * scale
        out.setdefault(tp, {})[name] = row
    out["prompts"], out["repeats"] = cfg.unseen_prompts, cfg.table_repeats
    c = audited.counts
    audit = {"calls": c["calls"], "accuracy_vs_exact": c["agree"] / max(c["calls"], 1),
             "false_reject_rate": c["false_reject"] / max(c["calls"] - c["exact_reject"], 1),
             "miss_rate": c["false_accept"] / max(c["exact_reject"], 1), "exact_rejects": c["exact_reject"]}
    return out, audit


def verifier_accuracy_balanced(verifier, dist: DyckDistribution, data: dict) -> float:
    """Accuracy against the exact verifier on all of ``X_error`` and ``X_correct`` (training rows included)."""
    x = torch.cat([data["errors"], data["correct"]])
    return float((torch.as_tensor(verifier(x)).bool() == dist.is_valid(x)).float().mean())


# ---------------------------------------------------------------------------------------------- the run
def run(quick: bool = False, seed: int = 0, cfg: DyckThesisConfig | None = None) -> dict:
    """The whole protocol; the dict is the ``thesis_tables`` entry of ``examples/dyck_backtracking.py --json``."""
    t0 = time.perf_counter()
    if cfg is None:  # an explicit cfg carries its own seed
        cfg = DyckThesisConfig.quick(seed) if quick else DyckThesisConfig(seed=seed)
    dist = DyckDistribution(cfg.D, cfg.p, cfg.q)
    lm = train_lm(dist, cfg)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    in_dist = complete(lm, dist.verifier, torch.full((1000, 1), PAD_ID, dtype=torch.long), dist.D, 0, 0, 1.0,
                       seed=cfg.seed)
    data = collect_verifier_data(lm, dist, cfg, g)
    if len(data["errors"]) < 10:
        raise SamplingBudgetError(f"the LM made only {len(data['errors'])} errors on OOD prompts: too few to train a "
                           f"verifier (raise collect_rounds or lower train_steps)")
    verifier, fit = LinearProbeVerifier.fit(lm, data["errors"], data["correct"], seed=cfg.seed)
    t1, t2 = tables_1_2(lm, dist, verifier, data, cfg)
    t3, audit = table_3(lm, dist, verifier, cfg)
    ours = {
        "table_3_1": t1, "table_3_2": t2, "table_3_3": t3,
        "verifier": {**fit, "accuracy_vs_exact_on_its_data": verifier_accuracy_balanced(verifier, dist, data),
                     "audit_table_3_3": audit, "n_errors": len(data["errors"]), "n_correct": len(data["correct"])},
        "ood_accuracy_nucleus_0.9": data["ood_accuracy_nucleus_0.9"],
        "in_distribution_accuracy_top_p_1": _accuracy(dist, in_dist.samples["z"]),
    }
    return {"thesis": THESIS_TABLES, "ours": ours,
            "setup": {**asdict(cfg), "quick": quick, "lm_parameters": lm.num_parameters(),
                      "seconds": round(time.perf_counter() - t0, 1)}}


def format_table(res: dict) -> str:
    th, us = res["thesis"], res["ours"]
    lines = ["Table 3.1 (error-inducing prefixes; accuracy)   thesis   ours"]
    for k, v in us["table_3_1"].items():
        lines.append(f"  {k:<40}{th['table_3_1'][k]:>7.3f}{v['mean']:>8.3f}")
    lines.append("Table 3.2 (Algorithm 1, trained verifier)")
    for k, v in us["table_3_2"].items():
        lines.append(f"  {k:<40}{th['table_3_2'][k]:>7.3f}{v['mean']:>8.3f}")
    lines.append("Table 3.3 (errors per 10000 OOD prompts)")
    for tp in ("top_p=0.9", "top_p=1.0"):
        for k, v in us["table_3_3"][tp].items():
            ref = th["table_3_3"][tp].get(k, {}).get("errors")
            ref_s = "-" if ref is None else f"{ref:.1f}"
            lines.append(f"  {tp} {k:<30}{ref_s:>7}{v['errors_per_10000']:>8.1f} +- {v['stderr_per_10000']:.1f}")
    v = us["verifier"]
    lines.append(f"verifier: val accuracy {v['val_accuracy']:.3f} (thesis {th['verifier_val_accuracy']['mean']}), "
                 f"vs exact during Table 3.3 {v['audit_table_3_3']['accuracy_vs_exact']:.3f}, "
                 f"miss rate {v['audit_table_3_3']['miss_rate']:.3f}")
    lines.append(f"OOD nucleus accuracy {us['ood_accuracy_nucleus_0.9']:.4f} (thesis {th['ood_accuracy_nucleus_0.9']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller run (about two minutes on one core)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    res = run(args.quick, args.seed)
    print(format_table(res))
    if args.json is not None:
        res[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
