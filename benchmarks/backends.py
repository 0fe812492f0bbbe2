"""The same IS and SMC workload on both backends: torch (``pt.infer``) and JAX / NumPyro (``ptn.infer``).

Workload: ``SlowThinking(Transformer prior, PauseToThink)`` with a ``Causal`` proposal (a second
Transformer), one checkpoint per LM saved by the torch side and loaded by the JAX side (one set of weights,
two frameworks); x of 8 tokens; N in {16, 64, 256} particles (``--quick``: 16, 256).

    python benchmarks/backends.py [--quick] [--json FILE] [--repeats R] [--only program]

``program``: the user program of examples/custom_program.py (question -> thought -> answer, 4 swaps, a 4-gram
Tabular LM) and its NumPyro twin examples/custom_program_numpyro.py, bootstrap SMC (ESS 0.5) on both backends,
in particle-steps/s (N x 4 program steps over the best wall time); ``compile_s["program"]`` is JAX's first run
minus its best, ``rerun_fresh_engine_s`` the time of a run by a new ``ptn.infer.SMC`` object with the same
configuration (the compiled run is cached at module level, so it does not recompile). ``--only program`` runs
that part alone.

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
import importlib.util
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
from ppl_thought import provenance as pv
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


_T0 = time.perf_counter()
_RECORD: dict = {}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N in {16, 256}, one timed repetition")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--only", choices=("all", "program"), default="all",
                    help="'program': only the user-program entry")
    global _T0
    _T0 = time.perf_counter()
    args = ap.parse_args(argv)
    global _RECORD
    _RECORD = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    ns = (16, 256) if args.quick else (16, 64, 256)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if args.only == "program":
        out = {"benchmark": "backends", "n": list(ns), "repeats": repeats, "torch": torch.__version__,
               "jax": jax.__version__, "torch_threads": torch.get_num_threads(),
               "jax_device": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "platform": platform.platform(),
               "load_average_before": list(os.getloadavg()), "compile_s": {}}
        user_program(out, ns, repeats)
        out["load_average_after"] = list(os.getloadavg())
        return _write(out, args.json)

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
    user_program(out, ns, repeats)
    out["load_average_after"] = list(os.getloadavg())
    return _write(out, args.json)


def _write(out: dict, path: str | None) -> dict:
    from ppl_thought.experiments.common import provenance
    from ppl_thought.io import atomic_write_json

    out.update(provenance())  # the commit and the machine of the run (docs tables show them)
    out["total_seconds"] = time.perf_counter() - _T0
    print(json.dumps(out, indent=2))
    if path:
        out[pv.KEY] = pv.finish(_RECORD)  # commit, command, machine, load, seconds
        atomic_write_json(path, out)
    return out


def _example(name: str):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def user_program(out: dict, ns, repeats: int) -> None:
    """The ``program`` entry (see the module docstring): bootstrap SMC on the question -> thought -> answer
    program, torch against JAX, in ``out["program"]``, ``out["compile_s"]["program"]``,
    ``out["rerun_fresh_engine_s"]``."""
    tex, jex = _example("custom_program"), _example("custom_program_numpyro")
    swaps_t, answer_t = torch.tensor(tex.VOCAB.encode("AB BC AC AB")), torch.tensor(tex.VOCAB.id("A"))
    swaps_j = jnp.asarray(jex.VOCAB.encode("AB BC AC AB"), jnp.int32)
    answer_j = jnp.asarray(jex.VOCAB.id("A"), jnp.int32)
    steps = int(swaps_j.shape[0])
    model_t, model_j = tex.WhichCup(tex.tracker_lm()), jex.WhichCup(jex.tracker_lm(), steps)
    out["program"], out["rerun_fresh_engine_s"] = {}, {}
    out["compile_s"]["program"] = {}
    out.setdefault("log_marginal", {})["program"] = {}
    out.setdefault("seconds", {})["program"] = {}
    out.setdefault("workload", {})["program"] = {"model": "examples/custom_program*.py WhichCup (4 swaps)",
                                                 "engine": "SMC(N, ess_threshold=0.5), guide=None",
                                                 "steps": steps}
    key = jax.random.PRNGKey(0)
    for n in ns:
        with torch.no_grad():
            _, sec_t, res_t = best_time(lambda n=n: pt.infer.SMC(n).run(model_t, None, swaps_t, answer_t), repeats)
        first_j, sec_j, res_j = best_time(
            lambda n=n: block(ptn.infer.SMC(n).run(model_j, None, swaps_j, answer_j, rng_key=key)), repeats)
        t0 = time.perf_counter()
        block(ptn.infer.SMC(n).run(model_j, None, swaps_j, answer_j, rng_key=jax.random.PRNGKey(1)))
        fresh = time.perf_counter() - t0
        rate_t, rate_j = n * steps / sec_t, n * steps / sec_j
        out["program"][str(n)] = {"torch": rate_t, "jax": rate_j, "ratio_jax_over_torch": rate_j / rate_t}
        out["seconds"]["program"][str(n)] = {"torch": sec_t, "jax": sec_j, "jax_first": first_j}
        out["compile_s"]["program"][str(n)] = max(first_j - sec_j, 0.0)
        out["rerun_fresh_engine_s"][str(n)] = fresh
        out["log_marginal"]["program"][str(n)] = {"torch": float(res_t.log_marginal),
                                                  "jax": float(np.asarray(res_j.log_marginal))}


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        main()
