"""The same IS and SMC workload on both backends: torch (``pt.infer``) and JAX / NumPyro (``ptn.infer``).

Workload: ``SlowThinking(Transformer prior, PauseToThink)`` with a ``Causal`` proposal (a second
Transformer), one checkpoint per LM saved by the torch side and loaded by the JAX side (one set of weights,
two frameworks); x of 8 tokens; N in {16, 64, 256} particles (``--quick``: 16, 256, and no decode / SVI
entries; ``--tiny``, the size tests/test_benchmarks_backends.py runs: ``--quick`` with N = 256 alone and
``TINY_ARCH``, the same code path with half the compilations, no figure to quote).

    python benchmarks/backends.py [--quick | --tiny] [--json FILE] [--repeats R] [--only program|decode]

``program``: the user program of examples/custom_program.py (question -> thought -> answer, 4 swaps, a 4-gram
Tabular LM) and its NumPyro twin examples/custom_program_numpyro.py, bootstrap SMC (ESS 0.5) on both backends,
in particle-steps/s (N x 4 program steps over the best wall time); ``compile_s["program"]`` is JAX's first run
minus its best, ``rerun_fresh_engine_s`` the time of a run by a new ``ptn.infer.SMC`` object with the same
configuration (the compiled run is cached at module level, so it does not recompile). ``--only program`` runs
that part alone.

``decode`` and ``svi`` (issue 40): the same user program with the answer as the continuation (an output site drawn
by the program: ``pt.observe`` / ``ptn.observe(name, d, None)``, masked to the last step on the JAX side) decoded
by (3.14), ``pt.infer.decode`` / ``ptn.infer.decode(..., method="resampling", n=N, num_samples=4)`` with a guide
program; and one SVI step of the sampler loss (3.25) with N particles on a user's HMM program (8 observations)
with a step-wise guide program whose transition logits are learnable (``pt.train.SVI(pt.train.SamplerPolicyGradient
(N))`` / ``numpyro.infer.SVI(..., ptn.infer.SamplerPolicyGradient(N))``, its update one ``jax.jit`` taking the
program's tables as arguments), in particle-steps/s. (The JAX side cannot differentiate through an ``LMState``
segment yet: its sampling loop is a ``lax.while_loop``, which reverse mode refuses, so that guide has no LM.)
``new_instance_s``: a run of a
*new program instance of the same class* (new weights, same shapes) with a new engine: it reuses the compiled run
(``new_instance_compiles``, from ``ptn.compile_stats()`` or the jitted update's cache, is 0), so its time is a
run's, not a compile's.

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
#: ``--tiny``'s Transformers (the test's size: one layer compiles and runs in a fraction of ARCH's time)
TINY_ARCH = dict(d_model=16, n_layers=1, n_heads=2, max_len=64)


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
    ap.add_argument("--tiny", action="store_true",
                    help="the test's size: --quick with N = 256 alone and a one-layer d_model-16 Transformer")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--only", choices=("all", "program", "decode"), default="all",
                    help="'program': only the user-program entry; 'decode': only the decode and SVI entries")
    global _T0
    _T0 = time.perf_counter()
    args = ap.parse_args(argv)
    global _RECORD
    _RECORD = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    args.quick = args.quick or args.tiny
    ns = (256,) if args.tiny else (16, 256) if args.quick else (16, 64, 256)
    arch = TINY_ARCH if args.tiny else ARCH
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if args.only in ("program", "decode"):
        out = {"benchmark": "backends", "n": list(ns), "repeats": repeats, "torch": torch.__version__,
               "jax": jax.__version__, "torch_threads": torch.get_num_threads(),
               "jax_device": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "platform": platform.platform(),
               "load_average_before": list(os.getloadavg()), "compile_s": {}}
        if args.only == "program":
            user_program(out, ns, repeats)
        else:
            decode_and_svi(out, ns, repeats)
        out["load_average_after"] = list(os.getloadavg())
        return _write(out, args.json)

    vocab = pt.Vocab(["a", "b", "c", "d"])
    V = len(vocab)
    proj = PauseToThink(vocab, max_thought_len=2)
    x = "abcdabcd"
    torch.manual_seed(0)
    prior_t = pt.lm.Transformer(V, **arch).eval()
    q_t = pt.lm.Transformer(V, **arch).eval()
    with tempfile.TemporaryDirectory() as tmp:
        prior_j = ptn.lm.Transformer.load(prior_t.save(os.path.join(tmp, "prior")))
        q_j = ptn.lm.Transformer.load(q_t.save(os.path.join(tmp, "q")))
    model_t, guide_t = pt.models.SlowThinking(prior_t, proj), pt.guides.Causal(q_t, proj)
    model_j, guide_j = ptn.models.SlowThinking(prior_j, proj), ptn.guides.Causal(q_j, proj)
    xt = model_t.x_ids(x)

    out: dict = {"benchmark": "backends", "workload": {"model": "SlowThinking(Transformer, PauseToThink(2))",
                                                       "guide": "Causal(Transformer)", "x_len": len(xt),
                                                       "arch": arch, "vocab_size": V},
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
    if not args.quick:  # --quick and --tiny keep their time: decode / SVI compile more
        decode_and_svi(out, ns, repeats)
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
        before = ptn.compile_stats()["count"]  # a new instance of the class (other weights): no compile
        t0 = time.perf_counter()
        block(ptn.infer.SMC(n).run(jex.WhichCup(jex.tracker_lm(err=0.2), steps), None, swaps_j, answer_j,
                                   rng_key=jax.random.PRNGKey(2)))
        out.setdefault("new_instance_s", {}).setdefault("smc", {})[str(n)] = time.perf_counter() - t0
        out.setdefault("new_instance_compiles", {}).setdefault("smc", {})[str(n)] = \
            ptn.compile_stats()["count"] - before
        rate_t, rate_j = n * steps / sec_t, n * steps / sec_j
        out["program"][str(n)] = {"torch": rate_t, "jax": rate_j, "ratio_jax_over_torch": rate_j / rate_t}
        out["seconds"]["program"][str(n)] = {"torch": sec_t, "jax": sec_j, "jax_first": first_j}
        out["compile_s"]["program"][str(n)] = max(first_j - sec_j, 0.0)
        out["rerun_fresh_engine_s"][str(n)] = fresh
        out["log_marginal"]["program"][str(n)] = {"torch": float(res_t.log_marginal),
                                                  "jax": float(np.asarray(res_j.log_marginal))}


_CLASSES: dict = {}


def _decode_classes():
    """The user program with its answer as an output, and a guide program with a learnable thinker, on both
    backends (built once: compiled runs are keyed by the program's class)."""
    if _CLASSES:
        return _CLASSES
    import numpyro
    import pyro

    tex, jex = _example("custom_program"), _example("custom_program_numpyro")

    class TorchAsk(tex.WhichCup):
        """WhichCup whose answer is drawn by the program (an output): what ``decode`` continues."""

        def step(self, state, t, swaps, answer=None):
            lm = state["lm"]
            lm.extend(swaps[t].expand(lm.n))
            lm.extend(pyro.sample(f"thought_{t}", lm.segment(stop=tex.END, max_tokens=2)))
            if t + 1 < len(swaps):
                return None
            pt.observe("answer", lm.next_token(), None)
            return torch.ones(lm.n, dtype=torch.bool)

    class JaxAsk(jex.WhichCup):
        def step(self, state, t, swaps, answer):
            lm = state["lm"]
            lm.extend(swaps[t])
            lm.extend(ptn.sample("thought", lm.segment(stop=jex.END, max_tokens=2)))
            last = t == swaps.shape[0] - 1
            with numpyro.handlers.mask(mask=last):  # the answer is the continuation, after the last swap
                ptn.observe("answer", lm.next_token(), None)
            return jnp.broadcast_to(last, (lm.n,))

    _CLASSES.update(tex=tex, jex=jex, TorchAsk=TorchAsk, JaxAsk=JaxAsk)
    return _CLASSES


def decode_and_svi(out: dict, ns, repeats: int) -> None:
    """The ``decode`` and ``svi`` entries (see the module docstring) in ``out["decode"]``, ``out["svi"]``,
    ``out["compile_s"]``, ``out["seconds"]``, ``out["new_instance_s"]``, ``out["new_instance_compiles"]``."""
    c = _decode_classes()
    tex, jex = c["tex"], c["jex"]
    swaps = "AB BC AC AB"
    swaps_t = torch.tensor(tex.VOCAB.encode(swaps))
    swaps_j = jnp.asarray(jex.VOCAB.encode(swaps), jnp.int32)
    steps = int(swaps_j.shape[0])
    doubtful = dict(err=0.3, skip=0.2, doubt=0.3)  # the guide's thinker: another LM of the same shapes
    S = 4  # decoded samples: S particle sets of N
    for part in ("decode", "svi"):
        out[part], out.setdefault("seconds", {})[part] = {}, {}
        out.setdefault("compile_s", {})[part] = {}
    for k in ("new_instance_s", "new_instance_compiles"):
        out.setdefault(k, {}).update(decode={}, svi={})
    out.setdefault("workload", {})["decode"] = {
        "model": "WhichCup (4 swaps), the answer an output", "guide": "Proposal program (another 4-gram table)",
        "method": f"resampling (3.14), n=N, num_samples={S}", "unit": "particle-steps/s: S x N x steps / best wall"}
    out["workload"]["svi"] = {"model": "a user's 3-state HMM program, 8 observations",
                              "guide": "a step-wise guide program, q(z_t | z_{t-1}) a learnable logits table",
                              "loss": "SamplerPolicyGradient(N) (3.25)", "optimizer": "Adam(1e-2)",
                              "unit": "particle-steps/s: N x steps / best wall of one step"}
    key = jax.random.PRNGKey(0)
    for n in ns:
        # ---- decode (3.14)
        mt, gt = c["TorchAsk"](tex.tracker_lm()), tex.Proposal(tex.tracker_lm(**doubtful))
        mj, gj = c["JaxAsk"](jex.tracker_lm(), steps), jex.Proposal(jex.tracker_lm(**doubtful), steps)
        with torch.no_grad():
            _, sec_t, _ = best_time(lambda mt=mt, gt=gt, n=n: pt.infer.decode(
                mt, gt, swaps_t, None, method="resampling", n=n, num_samples=S), repeats)
        first_j, sec_j, res_j = best_time(lambda mj=mj, gj=gj, n=n: jax.block_until_ready(ptn.infer.decode(
            mj, gj, swaps_j, None, method="resampling", n=n, num_samples=S, rng_key=key).outputs["answer"]),
            repeats)
        before = ptn.compile_stats()["count"]
        fresh_m, fresh_g = c["JaxAsk"](jex.tracker_lm(err=0.2), steps), jex.Proposal(jex.tracker_lm(skip=0.3), steps)
        t0 = time.perf_counter()
        jax.block_until_ready(ptn.infer.decode(fresh_m, fresh_g, swaps_j, None, method="resampling", n=n,
                                               num_samples=S, rng_key=jax.random.PRNGKey(1)).outputs["answer"])
        out["new_instance_s"]["decode"][str(n)] = time.perf_counter() - t0
        out["new_instance_compiles"]["decode"][str(n)] = ptn.compile_stats()["count"] - before
        work = S * n * steps
        out["decode"][str(n)] = {"torch": work / sec_t, "jax": work / sec_j, "ratio_jax_over_torch": sec_t / sec_j}
        out["seconds"]["decode"][str(n)] = {"torch": sec_t, "jax": sec_j, "jax_first": first_j}
        out["compile_s"]["decode"][str(n)] = max(first_j - sec_j, 0.0)

        # ---- one SVI step of (3.25) on the user HMM with a learnable step-wise guide
        _svi_at(out, c, n, repeats)


HMM_A = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.4, 0.2, 0.4]], np.float32)  # no zero: finite rewards
HMM_B = np.array([[0.9, 0.1], [0.3, 0.7], [0.5, 0.5]], np.float32)
HMM_LAM = np.array([0.5, 0.3, 0.2], np.float32)
HMM_X = [0, 1, 1, 0, 1, 1, 0, 0]


def _hmm_classes():
    """A user's HMM program and its learnable guide program (q(z_t | z_{t-1}): a logits table), both backends."""
    if "TorchHMM" in _CLASSES:
        return _CLASSES
    import numpyro
    import numpyro.distributions as nd
    import pyro
    import pyro.distributions as tdist

    class TorchHMM(pt.Program):
        def __init__(self, A, B, lam):
            self.A, self.B, self.lam = (torch.as_tensor(a) for a in (A, B, lam))

        def init(self, state, x):
            state["z"] = torch.zeros(pt.particles(), dtype=torch.long)

        def step(self, state, t, x):
            n = pt.particles()
            z = pt.sample(f"z_{t}", tdist.Categorical(self.lam.expand(n, 3) if t == 0 else self.A[state["z"]]))
            state["z"] = z
            pt.observe(f"x_{t}", tdist.Categorical(self.B[z]), x[t].expand(n))
            return torch.ones(n, dtype=torch.bool) if t + 1 == len(x) else None

    class TorchHMMGuide(pt.Program):
        def init(self, state, x):
            state["z"] = torch.zeros(pt.particles(), dtype=torch.long)

        def step(self, state, t, x):
            n = pt.particles()
            logits = pyro.param("q_trans", torch.zeros(4, 3))  # row 3: the first state
            z = pt.sample(f"z_{t}", tdist.Categorical(logits=logits[torch.full((n,), 3) if t == 0 else state["z"]]))
            state["z"] = z
            return torch.ones(n, dtype=torch.bool) if t + 1 == len(x) else None

    class JaxHMM(ptn.Program):
        def __init__(self, A, B, lam, T):
            self.A, self.B, self.lam, self.max_steps = jnp.asarray(A), jnp.asarray(B), jnp.asarray(lam), T

        def init(self, state, x):
            state["z"] = jnp.zeros(ptn.particles(), jnp.int32)

        def step(self, state, t, x):
            z = ptn.sample("z", nd.Categorical(probs=jnp.where(t == 0, self.lam[None], self.A[state["z"]])))
            state["z"] = z
            ptn.observe("x", nd.Categorical(probs=self.B[z]), x[t])
            return jnp.broadcast_to(t == x.shape[0] - 1, z.shape)

    class JaxHMMGuide(ptn.Program):
        def __init__(self, T):
            self.max_steps = T

        def init(self, state, x):
            state["z"] = jnp.zeros(ptn.particles(), jnp.int32)

        def step(self, state, t, x):
            logits = numpyro.param("q_trans", jnp.zeros((4, 3)))
            z = ptn.sample("z", nd.Categorical(logits=logits[jnp.where(t == 0, 3, state["z"])]))
            state["z"] = z
            return jnp.broadcast_to(t == x.shape[0] - 1, z.shape)

    def svi_update(n, state, A, B, lam, x):
        """One update of numpyro.infer.SVI on ``JaxHMM(A, B, lam)``: the instance is rebuilt around the traced
        arrays, so a new instance of the class (other tables, same shapes) reuses the compiled update."""
        svi = numpyro.infer.SVI(JaxHMM(A, B, lam, x.shape[0]), JaxHMMGuide(x.shape[0]), numpyro.optim.Adam(1e-2),
                                ptn.infer.SamplerPolicyGradient(n))
        svi.init(jax.random.PRNGKey(0), x)  # sets svi.constrain_fn (its state is unused: dead code for XLA)
        return svi.update(state, x)

    _CLASSES.update(TorchHMM=TorchHMM, TorchHMMGuide=TorchHMMGuide, JaxHMM=JaxHMM, JaxHMMGuide=JaxHMMGuide,
                    svi_update=jax.jit(svi_update, static_argnums=0))
    return _CLASSES


def _svi_at(out: dict, c: dict, n: int, repeats: int) -> None:
    """One step of ``pt.train.SVI(pt.train.SamplerPolicyGradient(n))`` against one jitted update of
    ``numpyro.infer.SVI(..., ptn.infer.SamplerPolicyGradient(n))`` on the user HMM (8 observations)."""
    import numpyro
    import pyro

    c = _hmm_classes()
    T = len(HMM_X)
    x_t, x_j = torch.tensor(HMM_X), jnp.asarray(HMM_X, jnp.int32)
    pyro.clear_param_store()
    torch.manual_seed(0)
    model_t, guide_t = c["TorchHMM"](HMM_A, HMM_B, HMM_LAM), c["TorchHMMGuide"]()
    svi_t = pt.train.SVI(pt.train.SamplerPolicyGradient(n), {"lr": 1e-2})
    _, sec_t, _ = best_time(lambda: svi_t.step(model_t, guide_t, x_t), repeats)
    pyro.clear_param_store()

    update = c["svi_update"]  # one jax.jit for every instance: the program's arrays are its arguments
    svi0 = numpyro.infer.SVI(c["JaxHMM"](HMM_A, HMM_B, HMM_LAM, T), c["JaxHMMGuide"](T), numpyro.optim.Adam(1e-2),
                             ptn.infer.SamplerPolicyGradient(n))
    box = [svi0.init(jax.random.PRNGKey(0), x_j)]

    def one_step():
        box[0], loss = update(n, box[0], jnp.asarray(HMM_A), jnp.asarray(HMM_B), jnp.asarray(HMM_LAM), x_j)
        return jax.block_until_ready(loss)

    first_j, sec_j, _ = best_time(one_step, repeats)
    before = update._cache_size()  # a new instance (other transition table): the same compiled update
    t0 = time.perf_counter()
    jax.block_until_ready(update(n, box[0], jnp.asarray(HMM_A[::-1].copy()), jnp.asarray(HMM_B),
                                 jnp.asarray(HMM_LAM), x_j)[1])
    out["new_instance_s"]["svi"][str(n)] = time.perf_counter() - t0
    out["new_instance_compiles"]["svi"][str(n)] = update._cache_size() - before
    work = n * T
    out["svi"][str(n)] = {"torch": work / sec_t, "jax": work / sec_j, "ratio_jax_over_torch": sec_t / sec_j}
    out["seconds"]["svi"][str(n)] = {"torch": sec_t, "jax": sec_j, "jax_first": first_j}
    out["compile_s"]["svi"][str(n)] = max(first_j - sec_j, 0.0)


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        main()
