"""``ptn.Program`` under the one generic JAX engine (docs/architecture.md, "One protocol, two backends"): the
question -> thought -> answer program of examples/custom_program_numpyro.py and an HMM, run by Importance and SMC
(bootstrap, a guide program, a factor, a twist), against exact answers (enumeration by the program itself, the
torch side's enumeration, the forward algorithm); a biased estimator fails the same bound; a fresh engine
does not recompile; the errors name the fix; ``ptn.dist.LMState`` scores what it samples."""

import itertools
import math
import os
import pathlib
import subprocess
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import ConcreteValueError, ProgramError, SiteMismatchError  # noqa: E402
from ppl_thought.numpyro.dist import LMState, TokenRule  # noqa: E402
from ppl_thought.numpyro.infer.steps import compilations  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import custom_program_numpyro as ex  # noqa: E402

SWAPS = jnp.asarray(ex.VOCAB.encode("AB BC"), jnp.int32)
ANSWER = jnp.asarray(ex.VOCAB.id("A"), jnp.int32)  # the ball is under C: the LM got it wrong
SEEDS = range(8)


def pooled(log_z: list[float]) -> tuple[float, float]:
    """log of the mean Z-hat over independent runs (unbiased in Z) and its delta-method standard error."""
    a = np.asarray(log_z, np.float64)
    r = np.exp(a - a.max())
    return float(np.log(r.mean()) + a.max()), float(r.std(ddof=1) / (math.sqrt(len(a)) * r.mean()))


def runs(engine, model, guide, *args) -> list[float]:
    return [float(engine.run(model, guide, *args, rng_key=jax.random.PRNGKey(s)).log_marginal) for s in SEEDS]


def within(log_z: list[float], exact: float, what: str) -> None:
    est, se = pooled(log_z)
    assert abs(est - exact) < 3 * se, f"{what}: {est:.4f} vs exact {exact:.4f} (SE {se:.4f})"


@pytest.fixture(scope="module")
def cups():
    lm = ex.tracker_lm()
    plain, verified = ex.WhichCup(lm, 2), ex.WhichCup(lm, 2, "factor")
    return {"lm": lm, "plain": plain, "factor": verified, "twist": ex.WhichCup(lm, 2, "twist"),
            "guide": ex.Proposal(ex.tracker_lm(skip=0.2), 2),
            "exact": {"plain": ex.exact(plain, SWAPS, ANSWER), "factor": ex.exact(verified, SWAPS, ANSWER)}}


# ---------------------------------------------------------------------------------------------- exact answers
def test_the_jax_enumeration_equals_the_torch_programs_exact_answer(cups):
    """The same program on both backends: log Z by the JAX program (Importance over every thought sequence)
    equals the torch example's enumeration (poutine.condition over the torch program)."""
    torch = pytest.importorskip("torch")
    import custom_program as tex

    swaps, answer = torch.tensor(ex.VOCAB.encode("AB BC")), torch.tensor(ex.VOCAB.id("A"))
    lm = tex.tracker_lm()
    assert abs(tex.exact(tex.WhichCup(lm), swaps, answer)[0] - cups["exact"]["plain"]) < 1e-4
    assert abs(tex.exact(tex.WhichCup(lm, "factor"), swaps, answer)[0] - cups["exact"]["factor"]) < 1e-4
    assert cups["exact"]["factor"] < cups["exact"]["plain"] - 0.5  # the factor changes the target


# ---------------------------------------------------------------------------------------------- engines
@pytest.mark.parametrize("engine,kind", [("IS", "plain"), ("SMC", "plain"), ("SMC", "guide"), ("SMC", "factor"),
                                         ("IS", "factor"), ("SMC", "twist")])
def test_question_thought_answer_within_three_standard_errors(cups, engine, kind):
    eng = ptn.infer.Importance(128) if engine == "IS" else ptn.infer.SMC(128, ess_threshold=0.9)
    model = cups["twist" if kind == "twist" else "factor" if kind == "factor" else "plain"]
    guide = cups["guide"] if kind == "guide" else None
    exact = cups["exact"]["factor" if kind == "factor" else "plain"]  # a twist leaves the target
    within(runs(eng, model, guide, SWAPS, ANSWER), exact, f"{engine} {kind}")
    if engine == "SMC" and kind in ("factor", "twist"):  # evidence along the way: the compiled loop resampled
        res = eng.run(model, guide, SWAPS, ANSWER)
        assert bool(np.asarray(res.stats["resampled"]).any())
        assert res.samples["thought"].shape == (128, 2, 2) and res.ancestry.shape == (2, 128)


class DropStepZero(ptn.infer.SMC):
    """A deliberately biased SMC: the incremental weight of step 0 is dropped."""

    def _weigh(self, inc, t):
        return jnp.where(t == 0, 0.0, inc)


def test_a_biased_estimator_fails_the_same_bound(cups):
    exact = cups["exact"]["factor"]
    log_z = runs(DropStepZero(128, ess_threshold=0.9), cups["factor"], None, SWAPS, ANSWER)
    est, se = pooled(log_z)
    assert abs(est - exact) > 3 * se, (est, exact, se)


# ---------------------------------------------------------------------------------------------- an HMM
PI = np.array([0.6, 0.3, 0.1])
A = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.0, 0.7]])
B = np.array([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]])
X = jnp.asarray([0, 1, 1, 0, 1], jnp.int32)


class HMM(ptn.Program):
    """Def 2.2 as a program: z_t ~ A[z_{t-1}] (pi at t = 0), x_t ~ B[z_t] observed."""

    max_steps = len(X)

    def init(self, state, x):
        state["z"] = jnp.zeros(ptn.particles(), jnp.int32)

    def step(self, state, t, x):
        probs = jnp.where(t == 0, jnp.asarray(PI)[None], jnp.asarray(A)[state["z"]])
        z = ptn.sample("z", nd.Categorical(probs=probs))
        ptn.observe("x", nd.Categorical(probs=jnp.asarray(B)[z]), x[t])
        state["z"] = z
        return jnp.broadcast_to(t == x.shape[0] - 1, z.shape)


class Filter(ptn.Program):
    """The locally optimal proposal q(z_t | z_{t-1}, x_t) proportional to A[z_{t-1}, z_t] B[z_t, x_t]."""

    max_steps = len(X)

    def init(self, state, x):
        state["z"] = jnp.zeros(ptn.particles(), jnp.int32)

    def step(self, state, t, x):
        prior = jnp.where(t == 0, jnp.asarray(PI)[None], jnp.asarray(A)[state["z"]])
        w = prior * jnp.asarray(B)[:, x[t]][None]
        state["z"] = ptn.sample("z", nd.Categorical(probs=w / w.sum(-1, keepdims=True)))
        return jnp.broadcast_to(t == x.shape[0] - 1, state["z"].shape)


def forward(x) -> float:
    alpha = PI * B[:, x[0]]
    for xt in x[1:]:
        alpha = (alpha @ A) * B[:, xt]
    return float(np.log(alpha.sum()))


_hmm, _filter = HMM(), Filter()


@pytest.mark.parametrize("engine,guide", [("IS", None), ("SMC", None), ("SMC", "filter")])
def test_hmm_program_against_the_forward_algorithm(engine, guide):
    eng = ptn.infer.Importance(64) if engine == "IS" else ptn.infer.SMC(64, ess_threshold=0.7)
    g = _filter if guide else None
    within(runs(eng, _hmm, g, X), forward(np.asarray(X)), f"HMM {engine} {guide}")
    # new data of the same shape: the same compiled run (arguments are traced), another exact answer
    x2 = jnp.asarray([1, 1, 0, 0, 0], jnp.int32)
    before = compilations()
    within(runs(eng, _hmm, g, x2), forward(np.asarray(x2)), f"HMM {engine} {guide}, new x")
    assert compilations() == before


# ptn.models.HMM as a program with its guides (torch twins: pt.models.HMM, pt.guides.HMMGuide)
_model_hmm = ptn.models.HMM(A, B, PI)
_post, _filt = ptn.guides.HMMGuide.posterior(_model_hmm), ptn.guides.HMMGuide.filtering(_model_hmm)


class SkipsStepZeroProposal(ptn.guides.HMMGuideProgram):
    """A deliberately wrong weight: the filtering guide's z at step 0 is sampled but not scored (log q = 0)."""

    def step(self, state, t, x=None):
        with numpyro.handlers.mask(mask=t != 0):
            return super().step(state, t, x)


@pytest.mark.parametrize("engine,guide", [("IS", None), ("IS", "filtering"), ("SMC", None), ("SMC", "filtering")])
def test_the_hmm_model_program_against_the_forward_algorithm(engine, guide):
    """ptn.models.HMM.program(x) with the bootstrap or an HMMGuide: log Z within 3 SE of (3.1) over seeds."""
    eng = ptn.infer.Importance(64) if engine == "IS" else ptn.infer.SMC(64, ess_threshold=0.7)
    g = _filt.program(X) if guide else None
    log_z = runs(eng, _model_hmm.program(X), g, X)
    within(log_z, forward(np.asarray(X)), f"ptn.models.HMM {engine} {guide}")
    assert abs(forward(np.asarray(X)) - float(_model_hmm.log_prob(np.asarray(X)))) < 1e-5


@pytest.mark.parametrize("engine", ["IS", "SMC"])
def test_the_hmm_posterior_guide_gives_constant_exact_weights(engine):
    """The exact posterior by the backward messages: every weight is P(x), so log Z-hat = log P(x) (3.1) to 1e-5.
    (SMC without resampling: a step's weight beta_{t-1} / beta_t varies until the last step, as on the torch
    side, so resampling on it keeps Z-hat unbiased but not exact.)"""
    eng = ptn.infer.Importance(32) if engine == "IS" else ptn.infer.SMC(32, ess_threshold=0.0)
    exact = forward(np.asarray(X))
    for s in range(3):
        res = eng.run(_model_hmm.program(X), _post.program(X), X, rng_key=jax.random.PRNGKey(s))
        lw = np.asarray(res.log_weights)
        assert np.abs(lw - lw[0]).max() < 1e-5, lw
        assert abs(float(res.log_marginal) - exact) < 1e-5, (float(res.log_marginal), exact)
        assert res.samples["z"].shape == (32, len(X))


def test_the_hmm_program_samples_the_posterior_and_generates():
    """The posterior guide's paths are drawn from P(z | x) (the first state's marginal against the backward
    messages), and with x = None the program generates: x is an output site of shape [n, T]."""
    res = ptn.infer.Importance(4096).run(_model_hmm.program(X), _post.program(X), X, rng_key=jax.random.PRNGKey(0))
    beta = np.asarray(_model_hmm.backward(np.asarray(X)))[0]
    p0 = PI * B[:, int(X[0])] * np.exp(beta)
    p0 /= p0.sum()
    freq = np.bincount(np.asarray(res.samples["z"])[:, 0], minlength=3) / 4096
    assert np.abs(freq - p0).max() < 4 * np.sqrt(p0 * (1 - p0) / 4096).max() + 1e-3, (freq, p0)
    gen = ptn.infer.Importance(8).run(_model_hmm.program(length=4), None, None)
    assert gen.samples["x"].shape == (8, 4) and gen.samples["z"].shape == (8, 4)
    np.testing.assert_allclose(np.asarray(gen.log_weights), 0.0)


@pytest.mark.parametrize("engine", ["IS", "SMC"])
def test_the_hmm_with_a_biased_proposal_weight_fails_the_same_bound(engine):
    """The filtering guide with its step-0 correction dropped (log q not subtracted): the same bound fails."""
    eng = ptn.infer.Importance(64) if engine == "IS" else ptn.infer.SMC(64, ess_threshold=0.7)
    est, se = pooled(runs(eng, _model_hmm.program(X), SkipsStepZeroProposal(_filt, len(X)), X))
    assert abs(est - forward(np.asarray(X))) > 3 * se, (est, se)


def test_a_fresh_engine_does_not_recompile():
    """Compiled runs are cached by (program, guide, shapes, configuration), not by engine object."""
    ptn.infer.SMC(32, ess_threshold=0.5).run(_hmm, _filter, X)
    before = compilations()
    for s in range(3):
        res = ptn.infer.SMC(32, ess_threshold=0.5).run(_hmm, _filter, X, rng_key=jax.random.PRNGKey(s))
        assert np.isfinite(float(res.log_marginal))
    assert compilations() == before
    ptn.infer.SMC(32, ess_threshold=0.25).run(_hmm, _filter, X)  # another configuration compiles anew
    assert compilations() == before + 1


# ---------------------------------------------------------------------------------------------- errors
def test_a_guide_that_misses_a_site_is_an_error(cups):
    class Misnamed(ex.Proposal):
        def step(self, state, t, swaps, answer):
            lm = state["lm"]
            lm.extend(swaps[t])
            lm.extend(ptn.sample("thinking", lm.segment(stop=ex.END, max_tokens=2)))
            return jnp.broadcast_to(t == swaps.shape[0] - 1, (lm.n,))

    with pytest.raises(SiteMismatchError, match=r"does not sample the model's latent site\(s\) \['thought'\]"):
        ptn.infer.SMC(8).run(cups["plain"], Misnamed(cups["lm"], 2), SWAPS, ANSWER)


class WithOutput(ptn.Program):
    """z ~ Bernoulli(0.3) latent, y ~ Bernoulli(0.9 if z else 0.2) an output (drawn, never weighted)."""

    max_steps = 1

    def step(self, state, t):
        z = ptn.sample("z", nd.Bernoulli(probs=jnp.full(ptn.particles(), 0.3)))
        ptn.observe("y", nd.Bernoulli(probs=jnp.where(z > 0, 0.9, 0.2)), None)
        return jnp.ones(ptn.particles(), bool)


class SamplesTheOutput(ptn.Program):
    max_steps = 1

    def step(self, state, t):
        ptn.sample("z", nd.Bernoulli(probs=jnp.full(ptn.particles(), 0.5)))
        ptn.sample("y", nd.Bernoulli(probs=jnp.full(ptn.particles(), 0.5)))
        return jnp.ones(ptn.particles(), bool)


@pytest.mark.parametrize("engine", ["importance", "smc"])
def test_a_guide_that_samples_an_output_site_is_an_error(engine):
    """NumPyro's replay copies the guide's ``infer`` over the model's site: the output flag of ``y`` was lost, and
    log p(y) - log q(y) entered the weights silently (log Z-hat != 0). Now the site check names ``y``. The model
    alone has Z = 1 exactly (the output is not weighted): checked, so the flag is read where it should be."""
    eng = ptn.infer.Importance(64) if engine == "importance" else ptn.infer.SMC(64)
    assert abs(float(eng.run(WithOutput(), None).log_marginal)) < 1e-6
    with pytest.raises(SiteMismatchError, match=r"samples \['y'\].*outputs"):
        eng.run(WithOutput(), SamplesTheOutput())


class FromObservation(ptn.Program):
    """Builds a token automaton from its argument: a value that must be concrete."""

    max_steps = 1

    def __init__(self, lm):
        self.lm = lm

    def init(self, state, prefix):
        from ppl_thought.projections import Identity

        rule = TokenRule(Identity(ex.VOCAB).lifting(np.asarray(prefix)), len(ex.VOCAB))
        state["lm"] = LMState.start(self.lm, ptn.particles(), rule=rule, max_len=4)

    def step(self, state, t, prefix):
        lm = state["lm"]
        lm.extend(ptn.sample("y", lm.segment(max_tokens=2)))
        return jnp.ones(lm.n, bool)


def test_a_traced_value_where_a_concrete_one_is_needed_names_static(cups):
    prefix = jnp.asarray(ex.VOCAB.encode("A B"), jnp.int32)
    with pytest.raises(ConcreteValueError, match=r"static=\(index, \.\.\.\)"):
        ptn.infer.Importance(4).run(FromObservation(cups["lm"]), None, prefix)
    # the fix the message names: the argument as a compile-time constant; the rule then forces the prefix
    res = ptn.infer.Importance(4).run(FromObservation(cups["lm"]), None, prefix, static=(0,))
    assert (np.asarray(res.samples["y"])[:, 0] == np.asarray(prefix)).all()


def test_a_program_that_never_finishes_names_max_steps():
    class Forever(HMM):
        max_steps = 2

        def step(self, state, t, x):
            super().step(state, t, x)
            return None

    with pytest.raises(ProgramError, match="did not finish within max_steps=2"):
        ptn.infer.SMC(4).run(Forever(), None, X)


def test_a_site_named_after_t_is_an_error():
    """The torch habit f"z_{t}": under the compiled loop t is traced, so the name would hold a tracer."""
    class Named(HMM):
        def step(self, state, t, x):
            z = ptn.sample(f"z_{t}", nd.Categorical(probs=jnp.asarray(PI)))
            ptn.observe("x", nd.Categorical(probs=jnp.asarray(B)[z]), x[t])
            return jnp.broadcast_to(t == x.shape[0] - 1, z.shape)

    with pytest.raises(ProgramError, match="name it without t"):
        ptn.infer.SMC(4).run(Named(), None, X)


def test_a_state_that_changes_shape_is_an_error():
    class Growing(HMM):
        def step(self, state, t, x):
            done = super().step(state, t, x)
            state["z"] = jnp.stack([state["z"], state["z"]], 1)
            return done

    with pytest.raises(ProgramError, match="changed the structure or shapes of its state"):
        ptn.infer.SMC(4).run(Growing(), None, X)


# ---------------------------------------------------------------------------------------------- LMState
@pytest.mark.parametrize("lm_kind", ["tabular", "transformer"])
def test_lmstate_scores_what_it_samples(lm_kind):
    """A segment's sampled log Q (the decoding loop) equals its teacher-forced log_prob from the same state, and
    extend moves every row on: the next token's law after extend equals a fresh state started on the longer
    prompt."""
    V = len(ex.VOCAB)
    lm = ex.tracker_lm() if lm_kind == "tabular" else ptn.lm.Transformer(V, d_model=16, n_layers=1, n_heads=2,
                                                                         max_len=32)
    st = LMState.start(lm, 16, prompt=[ex.START], max_len=8)
    st.extend(jnp.asarray(ex.VOCAB.id("AB")))
    seg = st.segment(stop=ex.END, max_tokens=3)
    v, (lq,) = seg.sample_with_intermediates(jax.random.PRNGKey(0))
    assert np.abs(np.asarray(seg.log_prob(v)) - np.asarray(lq)).max() < 1e-5
    assert np.isfinite(np.asarray(lq)).all()
    bad = np.asarray(v).copy()
    bad[:, 0] = 0  # <pad> before tokens: not a right-padded segment
    bad[:, 1] = ex.END
    assert np.isneginf(np.asarray(seg.log_prob(jnp.asarray(bad)))).all()
    st.extend(v)
    row = [t for t in np.asarray(v)[0].tolist() if t != 0]
    fresh = LMState.start(lm, 1, prompt=[ex.START, ex.VOCAB.id("AB"), *row], max_len=8)
    np.testing.assert_allclose(np.asarray(st.logp[0]), np.asarray(fresh.logp[0]), atol=1e-5)


def test_the_program_side_imports_with_torch_blocked():
    prog = ("import sys\nsys.modules['torch'] = None\nsys.modules['pyro'] = None\n"
            "import ppl_thought.numpyro as ptn\nptn.Program, ptn.sample, ptn.twist, ptn.dist.LMState, ptn.infer.SMC\n"
            "import runpy, sys\nsys.argv = ['x']\n"
            "import importlib.util as u\ns = u.spec_from_file_location('ex', 'examples/custom_program_numpyro.py')\n"
            "m = u.module_from_spec(s); s.loader.exec_module(m); print('ok')")
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_enumeration_covers_every_thought_sequence(cups):
    """The Enumerate guide's prior mass sums to 1 (no thought sequence missing): with no answer observed, the
    enumerated weights of the plain program are the prior probabilities."""
    class NoAnswer(ex.WhichCup):
        def step(self, state, t, swaps, answer):
            lm = state["lm"]
            lm.extend(swaps[t])
            lm.extend(ptn.sample("thought", lm.segment(stop=ex.END, max_tokens=2)))
            return jnp.broadcast_to(t == swaps.shape[0] - 1, (lm.n,))

    th = ex.all_thoughts()
    combos = np.array(list(itertools.product(range(len(th)), repeat=2)))
    table = np.stack([np.array(th)[combos[:, t]] for t in range(2)]).astype(np.int32)
    res = ptn.infer.Importance(len(combos)).run(NoAnswer(cups["lm"], 2), ex.Enumerate(table), SWAPS, ANSWER)
    assert abs(float(jax.scipy.special.logsumexp(res.log_weights))) < 1e-5


def test_a_traced_prompt_is_encoded_under_jit():
    """A prompt built from traced values (an argument, a sampled token) has a static length, so LMState.start
    encodes it under jit with the same numbers as a concrete prompt."""
    lm = ex.tracker_lm()
    prompt = [ex.START, ex.VOCAB.id("AB")]
    traced = jax.jit(lambda p: LMState.start(lm, 4, prompt=jnp.stack([p[0], p[1]]), max_len=2).logp)
    np.testing.assert_allclose(np.asarray(traced(jnp.asarray(prompt))),
                               np.asarray(LMState.start(lm, 4, prompt=prompt, max_len=2).logp), atol=1e-6)


def test_a_fresh_importance_object_reuses_the_compiled_whole_trace_run():
    """Plain NumPyro models (SlowThinking) under Importance: the compiled function is cached at module level."""
    from ppl_thought.numpyro.infer import importance
    from ppl_thought.projections import PauseToThink

    vocab = ex.VOCAB
    proj = PauseToThink(vocab, max_thought_len=1)
    prior = ptn.lm.Tabular(2, len(vocab), np.random.default_rng(0).normal(size=(len(vocab),) * 2))
    model = ptn.models.SlowThinking(prior, proj)
    x = np.array(vocab.encode("A"))
    ptn.infer.Importance(16).run(model, None, x, rng_key=jax.random.PRNGKey(1))
    size, before = len(importance._COMPILED), ptn.compile_stats()["count"]
    res = ptn.infer.Importance(16).run(model, None, x, rng_key=jax.random.PRNGKey(1))
    assert len(importance._COMPILED) == size and np.isfinite(float(res.log_marginal))
    assert ptn.compile_stats()["count"] == before


def test_a_transformer_program_under_importance_against_enumeration():
    """The same program over a (random, tiny) ptn.lm.Transformer: its KV cache is a fixed-size LMState cache inside
    the compiled loop. Exact log Z over every thought the LM can write (one swap: 91 thoughts; the prior mass of
    the enumeration sums to 1); Importance within 3 standard errors."""
    V = len(ex.VOCAB)
    lm = ptn.lm.Transformer(V, d_model=16, n_layers=1, n_heads=2, max_len=16, key=jax.random.PRNGKey(3))
    toks = [t for t in range(V) if t not in (0, 1)]
    thoughts = [[ex.END, 0]] + [[a, b] for a in toks if a != ex.END for b in toks]
    table = np.array(thoughts, np.int32)[None]  # [1 step, K, 2]
    swaps = SWAPS[:1]

    class NoAnswer(ex.WhichCup):
        def step(self, state, t, swaps, answer):
            lm = state["lm"]
            lm.extend(swaps[t])
            lm.extend(ptn.sample("thought", lm.segment(stop=ex.END, max_tokens=2)))
            return jnp.ones(lm.n, bool)

    prior = ptn.infer.Importance(len(thoughts)).run(NoAnswer(lm, 1), ex.Enumerate(table), swaps, ANSWER)
    assert abs(float(jax.scipy.special.logsumexp(prior.log_weights))) < 1e-4
    model = ex.WhichCup(lm, 1)
    exact = float(jax.scipy.special.logsumexp(
        ptn.infer.Importance(len(thoughts)).run(model, ex.Enumerate(table), swaps, ANSWER).log_weights))
    within(runs(ptn.infer.Importance(64), model, None, swaps, ANSWER), exact, "Transformer IS")


# ---------------------------------------------------------------------------------------------- SlowThinking
@pytest.fixture(scope="module")
def slow():
    from ppl_thought.projections import PauseToThink
    from ppl_thought.vocab import Vocab

    vocab = Vocab(["a", "b"])
    prior = ptn.lm.Tabular(3, len(vocab), np.random.default_rng(7).normal(size=(len(vocab),) * 3) * 1.5)
    model = ptn.models.SlowThinking(prior, PauseToThink(vocab, max_thought_len=2))
    x = np.array(vocab.encode("ab"))
    return model, x, model.program(x), float(model.exact_log_prob(x))


class Segments(ptn.Program):
    """A guide proposing fixed segments: particle k gets ``table[t, k]`` at step t (a Delta)."""

    def __init__(self, table: np.ndarray):
        self.table, self.max_steps = table, table.shape[0]

    def step(self, state, t, *args):
        ptn.sample("z", nd.Delta(jnp.asarray(self.table)[t], event_dim=1))
        return jnp.broadcast_to(t == self.max_steps - 1, (self.table.shape[1],))


def split_segments(model, x, z: np.ndarray) -> np.ndarray:
    """Each latent sequence ``z [K, L]`` cut into the |x| segments of Lemma 2.1 (the domain automaton emits
    x_{t+1}'s position at the end of segment t; the last one ends in a final state): ``[|x|, K, L]``."""
    dom = model.domain(len(x))
    T, (K, L) = len(x), z.shape
    out = np.zeros((T, K, L), np.int32)
    for k in range(K):
        s, pos = dom.start, 0
        row = [int(v) for v in z[k] if v != 0]
        for t in range(T):
            def done(s, t=t):
                return bool(dom.final[s]) if t == T - 1 else int(dom.emitted[s]) >= t + 1
            seg = []
            while not done(s) and pos < len(row):
                s = int(dom.next_state[s, row[pos]])
                seg.append(row[pos])
                pos += 1
            out[t, k, :len(seg)] = seg
        assert pos == len(row)
    return out


def test_slow_thinking_as_a_program_scores_every_lifting_sequence_as_the_whole_trace_model(slow):
    """SlowThinking through the generic path: the program's weights of the enumerated lifting (each z cut into its
    segments) are log P^{<=|z|}(z) of the whole-sequence LMSequence (which equals the torch side's, see
    tests/test_numpyro_backend.py) within 1e-5, and their log-sum-exp is the exact log p(x) (2.22)."""
    model, x, prog, exact = slow
    support, log_joint = model.enumerate_log_joint(x)
    table = split_segments(model, x, np.asarray(support))
    res = ptn.infer.Importance(len(support)).run(prog, Segments(table))
    np.testing.assert_allclose(np.asarray(res.log_weights), np.asarray(log_joint), atol=1e-5)
    assert abs(float(jax.scipy.special.logsumexp(res.log_weights)) - exact) < 1e-5


def test_slow_thinking_as_a_program_under_generic_smc(slow):
    model, x, prog, exact = slow
    log_z = runs(ptn.infer.SMC(512, ess_threshold=0.5), prog, None)
    within(log_z, exact, "SlowThinking program, bootstrap SMC")


class CountingTabular(ptn.lm.Tabular):
    """A Tabular LM that records the length of every block of tokens it is fed (at trace time)."""

    calls: list[int] = []

    def apply(self, params, cache, tokens, valid=None, latents=None):
        # by order (the engine traces copies of the LMs rebuilt around their traced parameters: not by id)
        CountingTabular.calls.append((self.order, int(np.shape(tokens)[1])))
        return super().apply(params, cache, tokens, valid, latents)


def test_extend_after_segment_runs_the_lm_once():
    """``lm.extend(sample("z", lm.segment(...)))`` feeds the segment once: a sampled segment hands its decoding
    loop's final state to extend; a segment the engine scores (a guide proposed it) reads the teacher-forced pass
    extend made (fed token by token, while some row has a token: ``LMState.extend``). Per traced step each LM
    is applied once (the bootstrap: the prior's decoding loop; with a guide: the guide's decoding loop and the
    model's extend), never in a block wider than one token (a separate scoring pass would be ``[n, K - 1]``).
    The estimate still agrees with the exact log p(x) (2.22)."""
    from ppl_thought.projections import PauseToThink
    from ppl_thought.vocab import Vocab

    vocab = Vocab(["a", "b"])
    proj = PauseToThink(vocab, max_thought_len=2)
    V = len(proj.vocab)
    prior = CountingTabular(3, V, np.random.default_rng(7).normal(size=(V,) * 3) * 1.5)
    guide_lm = CountingTabular(2, V, np.random.default_rng(8).normal(size=(V,) * 2))
    model = ptn.models.SlowThinking(prior, proj)
    x = np.array(vocab.encode("ab"))
    exact = float(model.exact_log_prob(x))
    for guide in (None, ptn.guides.Causal(guide_lm, proj)):
        CountingTabular.calls = []
        res = ptn.infer.SMC(256, ess_threshold=0.5, groups=8).run(model, guide, x, rng_key=3)
        traces = 2  # the step is traced twice: for its output shapes, and in the compiled loop
        calls = CountingTabular.calls
        assert all(w == 1 for _, w in calls), calls
        for lm in (prior, guide_lm) if guide is not None else (prior,):
            assert sum(i == lm.order for i, _ in calls) == 1 + traces, calls  # LMState.start, then once per step
        est, se = float(res.stats["log_marginal_pooled"]), float(res.stats["log_marginal_pooled_stderr"])
        assert abs(est - exact) < 3 * se, (est, exact, se)
