"""The same IS and SMC workload on both backends: torch (``pt.infer``) and JAX / NumPyro (``ptn.infer``).

Workload: ``SlowThinking(Transformer prior, PauseToThink)`` with a ``Causal`` proposal (a second
Transformer), one checkpoint per LM saved by the torch side and loaded by the JAX side (one set of weights,
two frameworks); x of 8 tokens; N in {16, 64, 256} particles (``--quick``: 16, 256).

    python benchmarks/backends.py [--quick] [--json FILE] [--repeats R]

Figures are **particle-steps/s**: N x L over the best wall time of ``repeats`` runs after a warm-up, where
L = ``domain(|x|).max_len`` is the longest latent sequence Dom(Proj) allows for this x: one fixed workload for
both backends (the tokens actually decoded are random and, after resampling, not those of the final
particles), so the JAX / torch ratio is the ratio of wall times; ``seconds`` has the times themselves.
JAX's first call compiles: ``compile_s`` is the first call's time minus the
best steady-state time (a new x, or a new N, compiles anew; the same x and N reuse the compiled run).
torch runs with ``torch.get_num_threads()`` intra-op threads, XLA with its own pool over the same cores.

``parity``: ``max_abs_log_prob_diff``, the largest |log P(z)| difference between the two backends over the
sequences the torch side drew (the prior masked to Dom(Proj), Def 2.8, per sequence); ``max_abs_exact_diff``,
the largest |log p(x)| difference of the exact marginal (2.22, enumeration of the lifting) over prefixes of x
short enough to enumerate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

import ppl_thought as pt
import ppl_thought.numpyro as ptn
from ppl_thought.projections import PauseToThink

ARCH = dict(d_model=64, n_layers=2, n_heads=4, max_len=64)


def best_time(fn, repeats: int) -> tuple[float, float, object]:
    """(first call's seconds, best seconds of ``repeats`` more calls, the last result)."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return first, best, out


def block(result) -> object:
    jax.block_until_ready(result.log_weights)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N in {16, 256}, one timed repetition")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    ns = (16, 256) if args.quick else (16, 64, 256)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)

    vocab = pt.Vocab(["a", "b", "c", "d"])
    V = len(vocab)
    proj = PauseToThink(vocab, max_thought_len=2)
    x = "abcdabcd"
    torch.manual_seed(0)
    prior_t = pt.lm.Transformer(V, **ARCH).eval()
    q_t = pt.lm.Transformer(V, **ARCH).eval()
    with tempfile.TemporaryDirectory() as tmp:
        prior_j = ptn.lm.Transformer.load(prior_t.save(os.path.join(tmp, "prior")))
        q_j = ptn.lm.Transformer.load(q_t.save(os.path.join(tmp, "q")))
    model_t, guide_t = pt.models.SlowThinking(prior_t, proj), pt.guides.Causal(q_t, proj)
    model_j, guide_j = ptn.models.SlowThinking(prior_j, proj), ptn.guides.Causal(q_j, proj)
    xt = model_t.x_ids(x)

    out: dict = {"benchmark": "backends", "workload": {"model": "SlowThinking(Transformer, PauseToThink(2))",
                                                       "guide": "Causal(Transformer)", "x_len": len(xt),
                                                       "arch": ARCH, "vocab_size": V},
                 "unit": "particle-steps/s: N x L (L = longest latent Dom(Proj) allows for x) / best wall time",
                 "n": list(ns), "repeats": repeats, "torch": torch.__version__, "jax": jax.__version__,
                 "torch_threads": torch.get_num_threads(), "jax_device": str(jax.devices()[0]),
                 "cpu_count": os.cpu_count(), "platform": platform.platform(),
                 "load_average_before": list(os.getloadavg())}

    # ---- parity on the same checkpoints
    with torch.no_grad():
        dom = model_t.z_dist(len(xt))
        z, lp_t = dom.sample_with_log_prob((64,))
    z_np = z.numpy().astype(np.int32)
    dist_j = ptn.dist.LMSequence(prior_j, constraint=model_j.domain(len(xt)), max_len=z_np.shape[1])
    lp_j = np.asarray(dist_j.log_prob(jnp.asarray(z_np)))
    exact = []
    for k in (1, 2, 3):
        with torch.no_grad():
            e_t = float(model_t.exact_log_prob(xt[:k]))
        e_j = float(model_j.exact_log_prob(np.asarray(xt[:k])))
        exact.append(abs(e_t - e_j))
    out["parity"] = {"max_abs_log_prob_diff": float(np.max(np.abs(lp_j - lp_t.numpy()))),
                     "max_abs_exact_diff": float(max(exact))}

    # ---- the same runs, timed
    out["is"], out["smc"], out["compile_s"] = {}, {}, {"is": {}, "smc": {}}
    out["log_marginal"] = {"is": {}, "smc": {}}
    out["seconds"] = {"is": {}, "smc": {}}
    L = int(model_t.z_dist(len(xt)).max_len)
    out["workload"]["latent_max_len"] = L
    key = jax.random.PRNGKey(0)
    for n in ns:
        engines = {"is": (pt.infer.Importance(n), ptn.infer.Importance(n)),
                   "smc": (pt.infer.SMC(n), ptn.infer.SMC(n))}
        for name, (eng_t, eng_j) in engines.items():
            with torch.no_grad():
                _, sec_t, res_t = best_time(lambda eng_t=eng_t: eng_t.run(model_t, guide_t, x), repeats)
            first_j, sec_j, res_j = best_time(
                lambda eng_j=eng_j: block(eng_j.run(model_j, guide_j, x, rng_key=key)), repeats)
            rate_t, rate_j = n * L / sec_t, n * L / sec_j
            out[name][str(n)] = {"torch": rate_t, "jax": rate_j, "ratio_jax_over_torch": rate_j / rate_t}
            out["seconds"][name][str(n)] = {"torch": sec_t, "jax": sec_j}
            out["compile_s"][name][str(n)] = max(first_j - sec_j, 0.0)
            out["log_marginal"][name][str(n)] = {"torch": float(res_t.log_marginal),
                                                 "jax": float(np.asarray(res_j.log_marginal))}
    out["load_average_after"] = list(os.getloadavg())
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        main()
