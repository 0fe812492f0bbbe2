"""``ppl-thought demo``: what the library computes today, measured against exact answers.

1. Pause to think (Ex 2.3): a Transformer prior P_f over Omega = Sigma + {<s>, </s>}; the exact
   likelihood (2.22) of an observation by enumerating its lifting, and the Monte-Carlo
   estimator (3.2) with the causal sampler "decode the prior under the lifting automaton",
   for growing sample sizes n, with its error against the exact value.
2. The A5 "cups and ball" HMM (App. E.1): exact per-token entropy by the forward algorithm (3.1),
   and the Theorem 2.3 construction Proj # P_f reproducing the HMM's likelihood exactly.

The Section 7 experiment and the A5 training comparison replace this with the main job when
the engines and guides land (see docs/paper-map.md).
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from ppl_thought.data import a5_hmm
from ppl_thought.distributions import LMSequence
from ppl_thought.lm import Transformer
from ppl_thought.models import SlowThinking
from ppl_thought.projections import PauseToThink
from ppl_thought.vocab import Vocab


def _pause_to_think(quick: bool, seed: int) -> dict:
    torch.manual_seed(seed)
    vocab = Vocab(["a", "b", "c"])
    projection = PauseToThink(vocab, max_thought_len=2)
    prior = Transformer(len(vocab), d_model=32, n_layers=2, n_heads=4).eval()
    with torch.no_grad():  # a sharper random prior, so that thinking matters
        prior.embed.weight.mul_(4.0)
    model = SlowThinking(prior, projection)
    x = "a b c"
    exact = float(model.exact_log_prob(x))
    sampler = LMSequence(prior, constraint=projection.lifting(x), vocab=vocab)
    target = model.z_dist(len(vocab.encode(x)))
    sizes = [16, 64, 256] if quick else [16, 64, 256, 1024, 4096]
    reps = 20 if quick else 50
    rows = []
    for n in tqdm(sizes, desc="importance sampling (3.2)", leave=False):
        est = []
        for _ in range(reps):
            with torch.no_grad():
                z, log_q = sampler.sample_with_log_prob((n,))
                log_p = target.log_prob(z)
            est.append(float(torch.logsumexp(log_p - log_q, 0) - math.log(n)))
        est = np.array(est)
        ratio = np.exp(est - exact)
        rows.append({"n": n, "mean_log_estimate": float(est.mean()), "rel_mse": float(np.mean((ratio - 1) ** 2)),
                     "z_ratio_mean": float(ratio.mean()), "z_ratio_se": float(ratio.std(ddof=1) / np.sqrt(reps))})
    post = model.exact_posterior(x)
    top = torch.argsort(post.probs, descending=True)[:5]
    return {
        "x": x,
        "lifting_size": len(post.support),
        "exact_log_prob": exact,
        "importance": rows,
        "posterior_top": [{"z": vocab.decode(post.support[i]), "prob": float(post.probs[i])} for i in top],
    }


def _a5(quick: bool, seed: int) -> dict:
    task = a5_hmm(reveal_prob=0.5)
    g = torch.Generator().manual_seed(seed)
    T = 64 if quick else 256
    x = task.sample(64, T, generator=g)
    ce = task.exact_cross_entropy(x)
    model = task.hmm.as_slow_thinking()
    short = task.sample(8, 3, generator=g)
    from ppl_thought.models.hmm import observation_ids

    diffs = []
    for row in short:
        z_x = observation_ids(model.projection)[row]
        diffs.append(abs(float(model.exact_log_prob(z_x.numpy())) - float(task.hmm.log_prob(row))))
    return {
        "sequence_length": T,
        "exact_cross_entropy_nats": float(ce),
        "entropy_rate_nats": float(task.entropy_rate),
        "theorem_2_3_max_abs_diff": max(diffs),
    }


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["pause_to_think"]["importance"]
    n = np.array([r["n"] for r in rows])
    mse = np.array([r["rel_mse"] for r in rows])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.loglog(n, mse, "o-", label="measured E[(Z_n/Z - 1)^2]")
    ax.loglog(n, mse[0] * n[0] / n, "--", label="1/n slope (3.4)")
    ax.set_xlabel("particles n")
    ax.set_ylabel("relative squared error")
    ax.set_title("Encoding error of (3.2), causal sampler")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(out: str = "out/demo", quick: bool = False, seed: int = 0) -> dict:
    """Run the demo, print a table, and write ``results.json`` and ``encoding_error.png`` into ``out``."""
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    results = {"pause_to_think": _pause_to_think(quick, seed), "a5": _a5(quick, seed)}
    results["seconds"] = round(time.time() - t0, 1)
    p = results["pause_to_think"]
    print(f"\nPause to think (Ex 2.3): x = {p['x']!r}, |lifting| = {p['lifting_size']}")
    print(f"  exact log p(x) by enumeration (2.22): {p['exact_log_prob']:.4f}")
    print(f"  {'n':>6} {'mean log Z_n':>14} {'E[Z_n/Z]':>16} {'rel. MSE':>10}")
    for r in p["importance"]:
        print(f"  {r['n']:>6} {r['mean_log_estimate']:>14.4f} {r['z_ratio_mean']:>9.3f} +- {r['z_ratio_se']:.3f}"
              f" {r['rel_mse']:>10.4f}")
    print("  most probable thoughts under the exact posterior (2.24):")
    for r in p["posterior_top"]:
        print(f"    {r['prob']:.3f}  {r['z']}")
    a = results["a5"]
    print(f"\nA5 cups-and-ball HMM (App. E.1), T = {a['sequence_length']}:")
    print(f"  exact cross-entropy of samples (forward algorithm): {a['exact_cross_entropy_nats']:.4f} nats/token")
    print(f"  entropy rate (closed form): {a['entropy_rate_nats']:.4f} nats/token")
    print(f"  Theorem 2.3: |log (Proj # P_f)(x) - log P_HMM(x)| <= {a['theorem_2_3_max_abs_diff']:.2e}")
    _plot(results, os.path.join(out, "encoding_error.png"))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {out}/results.json and {out}/encoding_error.png in {results['seconds']} s")
    return results
