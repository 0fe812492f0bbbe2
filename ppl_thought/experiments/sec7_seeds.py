"""Section 7 across seeds (:func:`ppl_thought.experiments.sec7.run_seeds`): the relative improvement and its
criterion, the thought / choice mutual information, the across-seed summary with a paired bootstrap interval, and
the merge of a multi-seed run split over processes. Pure statistics of the replicates' numbers.
"""

from __future__ import annotations

import numpy as np

from ppl_thought.errors import ConfigError
from ppl_thought.experiments.common import standard_error


def _relative_improvement(gain_pred: float, gain_expl: float) -> float:
    """(L_fast - L_expl) / (L_fast - L_pred) - 1 of Section 7 (NaN when the predictive gain is 0)."""
    return gain_expl / gain_pred - 1 if gain_pred != 0 else float("nan")


def _criterion(gain_pred: float, gain_expl: float, gain_expl_se: float) -> bool:
    """The issue's test: the explanatory gain is at least twice the predictive one and above 3 s.e."""
    return bool(gain_expl >= 2 * gain_pred and gain_expl > 3 * gain_expl_se)


def mutual_information(thoughts: np.ndarray, choices: np.ndarray) -> float:
    """I(thought; hidden choice) in nats from the test particles [N, n] (how much y tells about c)."""
    y = thoughts.reshape(-1)
    c = np.repeat(choices, thoughts.shape[1])
    joint = np.zeros((int(y.max()) + 1, int(c.max()) + 1))
    np.add.at(joint, (y, c), 1.0)
    joint /= joint.sum()
    py, pc = joint.sum(1, keepdims=True), joint.sum(0, keepdims=True)
    nz = joint > 0
    return float((joint[nz] * np.log(joint[nz] / (py @ pc)[nz])).sum())


# the paper's Section 7 / App. L numbers (Qwen2.5-7B on OpenWebMath), for comparison in the JSON
PAPER = {"8": {"L_fast": 1.7345, "L_pred": 1.7331, "L_expl": 1.7294, "relative_improvement": 2.64},
         "16": {"L_fast": 1.7345, "L_pred": 1.7301, "L_expl": 1.7278, "relative_improvement": 0.52}}

# what run_seeds keeps of each replicate (the curves stay in the JSON too)
_SEED_KEYS = ("seed", "L_fast", "L_pred", "L_expl", "L_fast_se", "L_pred_se", "L_expl_se", "gain_pred", "gain_pred_se",
              "gain_expl", "gain_expl_se", "relative_improvement", "causal_gap", "causal_gap_pred",
              "thought_choice_mutual_information", "criterion_expl_ge_2x_pred_and_3se", "base_model", "seconds",
              "total_seconds", "num_params", "test_loss_curve", "causal_gap_curve")


def bootstrap_relative_improvement(gain_pred: np.ndarray, gain_expl: np.ndarray, resamples: int = 10000,
                                   seed: int = 0) -> dict:
    """The relative improvement of Section 7, mean(gain_expl) / mean(gain_pred) - 1 over seeds, and its
    bootstrap over seeds: resample the S seeds with replacement ``resamples`` times (paired: a seed brings
    both its gains), the ratio of each resample's mean gains, its 2.5 / 97.5 percentiles (resamples whose
    mean predictive gain is exactly 0 have no ratio and are left out). ``share_gain_pred_nonpositive`` is
    the share of resamples with mean predictive gain <= 0, where the ratio does not read as "how much more
    the explanatory sampler gains"; the same bootstrap of the difference gain_expl - gain_pred is always
    defined."""
    gp, ge = np.asarray(gain_pred, dtype=float), np.asarray(gain_expl, dtype=float)
    if gp.shape != ge.shape or gp.ndim != 1 or len(gp) < 2:
        raise ConfigError(f"gain_pred and gain_expl must be 1-d arrays of the same length >= 2 (one value per seed), "
                          f"got shapes {gp.shape} and {ge.shape}")
    idx = np.random.default_rng(seed).integers(len(gp), size=(resamples, len(gp)))
    mp, me = gp[idx].mean(1), ge[idx].mean(1)
    ok = mp != 0
    ratio = me[ok] / mp[ok] - 1
    diff = me - mp
    return {"relative_improvement": _relative_improvement(float(gp.mean()), float(ge.mean())),
            "ci95": [float(np.percentile(ratio, 2.5)), float(np.percentile(ratio, 97.5))] if ok.any() else None,
            "share_gain_pred_nonpositive": float((mp <= 0).mean()),
            "difference_ci95": [float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))],
            "resamples": int(resamples), "bootstrap_seed": int(seed)}


def summarize_seeds(rows: list[dict], resamples: int = 10000) -> dict:
    """Across-seed summary of one n: mean and standard error across seeds (std / sqrt(S)) of the three test
    losses, both gains and the causal gaps; the relative improvement with its bootstrap interval
    (:func:`bootstrap_relative_improvement`)."""
    out: dict = {"seeds": [r["seed"] for r in rows]}
    for key in ("L_fast", "L_pred", "L_expl", "gain_pred", "gain_expl", "causal_gap", "causal_gap_pred",
                "thought_choice_mutual_information"):
        v = np.array([r[key] for r in rows], dtype=float)
        out[key] = {"mean": float(v.mean()), "se": standard_error(v), "per_seed": v.tolist()}
    gp = np.array(out["gain_pred"]["per_seed"])
    ge = np.array(out["gain_expl"]["per_seed"])
    d = ge - gp
    out["gain_difference"] = {"mean": float(d.mean()), "se": standard_error(d)}
    out["seeds_expl_beats_pred"] = int((d > 0).sum())
    out["seeds_gain_pred_positive"] = int((gp > 0).sum())
    out["seeds_gain_expl_positive"] = int((ge > 0).sum())
    out["relative_improvement"] = bootstrap_relative_improvement(gp, ge, resamples) if len(rows) > 1 else {
        "relative_improvement": _relative_improvement(float(gp.mean()), float(ge.mean()))}
    return out


def merge_seed_runs(parts: list[dict], allow_partial: bool = False) -> dict:
    """One multi-seed result from several :func:`run_seeds` results of the same task and sizes that cover
    different (seed, n) pairs (the run split over processes): the rows of each n are pooled, sorted by seed,
    and summarized again. Each replicate depends only on its seed and n, so the pooled rows are those of
    one run over all of them. ``seconds`` is the sum, ``commands`` lists the parts' commands. Parts still
    running (``"partial": true``) are refused unless ``allow_partial``; the result then says ``"partial": true``."""
    if not parts:
        raise ConfigError("merge_seed_runs needs at least one run_seeds result, got none")
    skip = ("ns", "seeds")
    base = {k: v for k, v in parts[0]["config"].items() if k not in skip}
    for p in parts[1:]:
        other = {k: v for k, v in p["config"].items() if k not in skip}
        if other != base or p["task"] != parts[0]["task"]:
            diff = {k: (base.get(k), other.get(k)) for k in set(base) | set(other) if base.get(k) != other.get(k)}
            raise ConfigError(f"merge_seed_runs: the parts differ in config or task; config differences {diff}")
    runs: dict[str, dict[int, dict]] = {}
    for p in parts:
        for n, rows in p["runs"].items():
            for r in rows:
                if r["seed"] in runs.setdefault(n, {}):
                    raise ConfigError(f"merge_seed_runs: seed {r['seed']} at n = {n} appears twice")
                runs[n][r["seed"]] = r
    ns = sorted(runs, key=int)
    merged = {n: [runs[n][s] for s in sorted(runs[n])] for n in ns}
    seeds = sorted({s for n in ns for s in runs[n]})
    commits = {p.get("commit") for p in parts}
    partial = any(p.get("partial") for p in parts)
    if partial and not allow_partial:
        raise ConfigError("merge_seed_runs: a part is partial (its run has not finished); allow_partial=True "
                          "(--allow-partial) pools the replicates finished so far")
    return {**{k: v for k, v in parts[0].items() if k not in ("runs", "summary", "seconds", "command", "paper")},
            "commit": parts[0].get("commit") if len(commits) == 1 else sorted(str(c) for c in commits),
            "dirty": any(p.get("dirty") for p in parts),
            "config": {**base, "ns": [int(n) for n in ns], "seeds": seeds},
            "paper": {k: v for k, v in PAPER.items() if k in merged},
            "runs": merged, "summary": {n: summarize_seeds(v) for n, v in merged.items()},
            "seconds": round(sum(p["seconds"] for p in parts), 1),
            "commands": [p.get("command") for p in parts], "partial": partial}


def _mean_curves(reps: list[dict], curves: str, value: str) -> dict:
    """Average over replicates of the curves ``rep[curves][method]`` (the same evaluation steps)."""
    return {m: [{"step": row["step"], value: float(np.mean([r[curves][m][i][value] for r in reps]))}
                for i, row in enumerate(reps[0][curves][m])] for m in reps[0][curves]}



def _smooth(xs: list[float], bins: int = 20) -> list[float]:
    if not xs:
        return []
    chunks = np.array_split(np.asarray(xs), min(bins, len(xs)))
    return [float(c.mean()) for c in chunks]

