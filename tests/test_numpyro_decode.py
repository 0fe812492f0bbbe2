"""``ptn.infer.decode`` (the JAX side's decoding, docs/numpyro.md "Decoding") against the exact predictive law by
enumeration, on the JAX twin of tests/test_decoding_programs.py's ``QuestionThoughtAnswer``: question (observed, in
``init``) -> thought (latent, 3 values, in ``init``) -> answer tokens, one per step (the first observed: the prompt;
the next ones outputs, masked before the end of the prompt; ``<eos>`` = 2 ends the answer).

Each method runs with a deliberately poor guide (it prefers the thought the posterior finds unlikely) and with
``guide=None`` (the program proposes). The bounds are the theory's: (3.12) has the law of the guide's thought
(exact with the posterior as guide, Prop 3.1), (3.14) is within sqrt((6 chi2 + 2) / n) in TV (Prop 3.3), best-of-K
has a small regret against the exact log p(prompt, y), plus about two standard deviations of sampling noise (fixed
seeds). ``test_wrong_weights_fail``: with uniform weights instead of p/q (``decode._log_weights`` replaced) the
same checks fail ((3.14) then follows the proposal, best-of-K scores every candidate alike). The torch and JAX
decoders give the same law on the same program (``test_torch_and_jax_decode_the_same_law``).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import pathlib

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax.numpy as jnp  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import ConfigError, SiteMismatchError, ZeroWeightsError  # noqa: E402
from ppl_thought.numpyro.infer import decode_methods as decode_module  # noqa: E402

EOS = 2
PQ = np.array([0.5, 0.5])
PZ = np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
PA = np.array([[0.1, 0.8, 0.1], [0.8, 0.1, 0.1], [0.3, 0.3, 0.4]])
L = 3  # answer tokens at most


class QTA(ptn.Program):
    """question q -> thought z -> answer a_0 a_1 a_2 from PA[z]; ``answer`` (the prompt) observes the first ones."""

    max_steps = L

    def __init__(self, pz=PZ, pa=PA):
        self.pz, self.pa = jnp.asarray(pz), jnp.asarray(pa)

    def init(self, state, q, answer):
        n = ptn.particles()
        ptn.observe("question", nd.Categorical(jnp.asarray(PQ)).expand([n]), q)
        state["z"] = ptn.sample("thought", nd.Categorical(self.pz[q]).expand([n]))

    def step(self, state, t, q, answer):
        P = answer.shape[0]
        prompt = answer[jnp.minimum(t, P - 1)]
        d = nd.Categorical(self.pa[state["z"]])
        with numpyro.handlers.mask(mask=t < P):
            ptn.observe("prompt", d, prompt)
        with numpyro.handlers.mask(mask=t >= P):
            a = ptn.observe("answer", d, None)
        a = jnp.where(t < P, prompt, a)
        return (a == EOS) | (t + 1 == L)


class ThoughtGuide(ptn.Program):
    """Proposes the thought (the prompt's only latent) from a fixed table; the program draws the rest."""

    max_steps = L

    def __init__(self, probs):
        self.probs = jnp.asarray(probs, jnp.float32)

    def init(self, state, q, answer):
        ptn.sample("thought", nd.Categorical(self.probs).expand([ptn.particles()]))

    def step(self, state, t, q, answer):
        return None


ARGS = (0, jnp.array([0]))
GUIDE = [0.7, 0.1, 0.2]  # prefers thought 0; the posterior prefers thought 1 (chi2 4.4)
NAMES = 2  # outputs: answer_1, answer_2


# ---------------------------------------------------------------------------------------------- exact answers
def posterior(q=0, a0=0) -> np.ndarray:
    w = PZ[q] * PA[:, a0]
    return w / w.sum()


def law(latent) -> dict:
    """Law of (answer_1, answer_2) (None: not drawn, the answer had ended) when the thought follows ``latent``."""
    out: dict = {}
    for z, a1 in itertools.product(range(3), range(3)):
        if a1 == EOS:
            out[(a1, None)] = out.get((a1, None), 0.0) + latent[z] * PA[z, a1]
            continue
        for a2 in range(3):
            out[(a1, a2)] = out.get((a1, a2), 0.0) + latent[z] * PA[z, a1] * PA[z, a2]
    return out


def exact_joint(outs: tuple) -> float:
    """log p(question 0, answer_0 = 0, outputs) by enumeration."""
    a = [0] + [v for v in outs if v is not None]
    return math.log(sum(PQ[0] * PZ[0, z] * np.prod(PA[z, a]) for z in range(3)))


def chi2(post, prop) -> float:
    return float((np.asarray(post) ** 2 / np.asarray(prop)).sum() - 1)


EXACT = law(posterior())


def rows(out) -> list[tuple]:
    """Each sample's outputs as a tuple of length 2 (None after the answer ended), from ``tokens``."""
    tok = np.asarray(out.tokens)
    tok = np.pad(tok, ((0, 0), (0, NAMES - tok.shape[1])), constant_values=-1)
    return [tuple(None if v < 0 else int(v) for v in r) for r in tok]


def empirical(rs: list[tuple]) -> dict:
    out: dict = {}
    for r in rs:
        out[r] = out.get(r, 0.0) + 1.0 / len(rs)
    return out


def tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def noise_tv(p: dict, S: int) -> float:
    """About two standard deviations of the TV between ``p`` and the empirical law of S draws, plus 0.01."""
    return 0.5 * sum(2 * math.sqrt(v * (1 - v) / S) for v in p.values()) + 0.01


def case(guided: bool):
    """(guide, the law of the proposal's thought)."""
    return (ThoughtGuide(GUIDE), np.array(GUIDE)) if guided else (None, PZ[0])


# ---------------------------------------------------------------------------------------------- (3.12), (3.13)
@pytest.mark.parametrize("guided", [True, False], ids=["guide", "none"])
def test_direct_is_the_law_of_312(guided):
    """(3.12): the outputs follow int P(. | [z]) dQ(z | x) (the guide's law for the thought, the program for the
    answer), which is not the exact predictive law here (Q != Q_* shows)."""
    guide, prop = case(guided)
    S = 3000
    out = decode_module.decode(QTA(), guide, *ARGS, method="direct", num_samples=S, rng_key=0)
    want = law(prop)
    assert tv(empirical(rows(out)), want) < noise_tv(want, S)
    assert tv(want, EXACT) > 3 * noise_tv(want, S)


def test_direct_with_the_posterior_guide_is_exact():
    S = 3000
    out = ptn.infer.decode(QTA(), ThoughtGuide(posterior()), *ARGS, method="direct", num_samples=S, rng_key=1)
    assert tv(empirical(rows(out)), EXACT) < noise_tv(EXACT, S)


def test_streaming_yields_outputs_step_by_step():
    """(3.13): ``(site, value)`` pairs as the compiled steps draw them, only the outputs (not the masked prompt
    step), stopping at ``<eos>``; with the posterior as guide its law is the exact predictive law (Prop 3.2)."""
    S = 400
    guide = ThoughtGuide(posterior())
    got = []
    for s in range(S):
        pairs = list(ptn.infer.decode(QTA(), guide, *ARGS, method="streaming", rng_key=100 + s))
        assert [k for k, _ in pairs] == ["answer"] * len(pairs) and 1 <= len(pairs) <= 2
        vals = [int(v) for _, v in pairs]
        assert len(vals) == 2 or vals[-1] == EOS
        got.append(tuple(vals) + (None,) * (NAMES - len(vals)))
    assert tv(empirical(got), EXACT) < noise_tv(EXACT, S)


# ---------------------------------------------------------------------------------------------- (3.14)
def resampling_check(guided: bool, n: int = 1024, S: int = 1000, seed: int = 3, ess_threshold: float = 0.0):
    guide, prop = case(guided)
    out = ptn.infer.decode(QTA(), guide, *ARGS, method="resampling", n=n, num_samples=S, rng_key=seed,
                           ess_threshold=ess_threshold)
    err = tv(empirical(rows(out)), EXACT)
    return err, math.sqrt((6 * chi2(posterior(), prop) + 2) / n) + noise_tv(EXACT, S)


@pytest.mark.parametrize("guided", [True, False], ids=["guide", "none"])
def test_resampling_prop33(guided):
    """(3.14): TV(exact predictive, law of the decoded outputs) <= sqrt((6 chi2 + 2) / n) (Prop 3.3) + noise."""
    err, bound = resampling_check(guided)
    assert err < bound, f"TV {err:.3f} vs bound {bound:.3f}"


def test_resampling_with_smc_sets():
    """``ess_threshold > 0``: each particle set is an SMC run (resampled on the device); the same bound holds."""
    err, bound = resampling_check(True, ess_threshold=0.5, seed=4)
    assert err < bound, f"TV {err:.3f} vs bound {bound:.3f}"


# ---------------------------------------------------------------------------------------------- best of K
def best_of_k_regret(guided: bool, reps: int = 20) -> float:
    guide, _ = case(guided)
    regret = []
    for r in range(reps):
        out = ptn.infer.decode(QTA(), guide, *ARGS, method="best_of_k", n=256, k=4, rng_key=200 + r)
        cand = np.asarray(out.stats["candidate_tokens"])
        cand = np.pad(cand, ((0, 0), (0, NAMES - cand.shape[1])), constant_values=-1)
        keys = [tuple(None if v < 0 else int(v) for v in c) for c in cand]
        ex = np.array([exact_joint(key) for key in keys])
        best = int(np.argmax(np.asarray(out.stats["scores"])))
        assert rows(out)[0] == keys[best]
        regret.append(float(ex.max() - ex[best]))
    return sum(regret) / len(regret)


@pytest.mark.parametrize("guided", [True, False], ids=["guide", "none"])
def test_best_of_k_regret(guided):
    """Best-of-K picks the candidate with the largest exact p(prompt, y) up to a mean regret of 0.1 nats."""
    assert best_of_k_regret(guided) < 0.1


def test_best_of_k_scores_are_the_exact_joint():
    """Each candidate's score log p_n(x y) ((3.2) on prompt + candidate, the program as its own proposal) is within
    4 delta-method standard errors, sqrt(chi2(p(z | x y) || p(z | q)) / n) by enumeration, of the enumerated
    log p(question, answer_0, y)."""
    n = 256
    for r in range(3):
        out = ptn.infer.decode(QTA(), None, *ARGS, method="best_of_k", n=n, k=4, rng_key=300 + r)
        cand = np.asarray(out.stats["candidate_tokens"])
        cand = np.pad(cand, ((0, 0), (0, NAMES - cand.shape[1])), constant_values=-1)
        for c, score in zip(cand, np.asarray(out.stats["scores"])):
            key = tuple(None if v < 0 else int(v) for v in c)
            a = [0] + [v for v in key if v is not None]
            post = PZ[0] * np.prod(PA[:, a], 1)
            se = math.sqrt(chi2(post / post.sum(), PZ[0]) / n)
            assert abs(float(score) - exact_joint(key)) < 4 * se + 0.01, (key, float(score), exact_joint(key), se)


# ---------------------------------------------------------------------------------------------- wrong weights
def test_wrong_weights_fail(monkeypatch):
    """With uniform weights instead of p/q, (3.14) follows the proposal ((3.12)'s law) and best-of-K scores every
    candidate alike: the same checks fail."""
    monkeypatch.setattr(decode_module, "_log_weights", lambda log_w: jnp.zeros_like(log_w))
    for guided in (True, False):
        err, bound = resampling_check(guided)
        assert err > bound, f"uniform weights passed the (3.14) check: TV {err:.3f} vs {bound:.3f}"
    assert best_of_k_regret(True) > 0.1


# ---------------------------------------------------------------------------------------------- both backends
def test_torch_and_jax_decode_the_same_law():
    """The same program on both backends (tests/test_decoding_programs.py's QuestionThoughtAnswer and ThoughtGuide
    on the torch side): (3.12) and (3.14) give laws within the two-sample noise of each other."""
    torch = pytest.importorskip("torch")
    root = pathlib.Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("torch_decoding_programs", root / "test_decoding_programs.py")
    T = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(T)
    assert np.allclose(T.QuestionThoughtAnswer.PA.numpy(), PA) and np.allclose(T.QuestionThoughtAnswer.PZ.numpy(), PZ)
    for method, n, S in (("direct", 1, 3000), ("resampling", 1024, 1000)):
        torch.manual_seed(11)
        t_out = T.decode(T.QuestionThoughtAnswer(), T.ThoughtGuide(GUIDE), *T.Q_ARGS, method=method, n=n,
                         num_samples=S)
        t_law = empirical(T.outcomes(t_out, ["answer_1", "answer_2"]))
        j_out = ptn.infer.decode(QTA(), ThoughtGuide(GUIDE), *ARGS, method=method, n=n, num_samples=S, rng_key=12)
        j_law = empirical(rows(j_out))
        ref = law(np.array(GUIDE)) if method == "direct" else EXACT
        assert tv(t_law, j_law) < 2 * noise_tv(ref, S), (method, tv(t_law, j_law))


# ---------------------------------------------------------------------------------------------- an HMM
HA = np.array([[0.8, 0.15, 0.05], [0.1, 0.8, 0.1], [0.05, 0.15, 0.8]])
HB = np.array([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]])
HX, HT = jnp.array([1, 1, 1]), 5  # the prompt x_0 x_1 x_2; outputs y_3, y_4


class HMM(ptn.Program):
    """z_t ~ A[z_{t-1}] (uniform at t = 0), x_t ~ B[z_t]: observed (site "x") for t < len(x), an output (site "y")
    after; a latent "z" at every step."""

    max_steps = HT

    def init(self, state, x):
        state["z"] = jnp.zeros(ptn.particles(), jnp.int32)

    def step(self, state, t, x):
        n = ptn.particles()
        probs = jnp.where(t == 0, jnp.full((n, 3), 1 / 3), jnp.asarray(HA)[state["z"]])
        z = ptn.sample("z", nd.Categorical(probs))
        state["z"] = z
        P = x.shape[0]
        with numpyro.handlers.mask(mask=t < P):
            ptn.observe("x", nd.Categorical(jnp.asarray(HB)[z]), x[jnp.minimum(t, P - 1)])
        with numpyro.handlers.mask(mask=t >= P):
            ptn.observe("y", nd.Categorical(jnp.asarray(HB)[z]), None)
        return jnp.broadcast_to(t + 1 == HT, (n,))


class HMMGuide(ptn.Program):
    """Proposes z at every step from a fixed table, or (``probs=None``) nothing: a partial guide, the program then
    draws every z and they stay out of the weights."""

    max_steps = HT

    def __init__(self, probs=None):
        self.probs = None if probs is None else jnp.asarray(probs, jnp.float32)

    def step(self, state, t, x):
        if self.probs is not None:
            ptn.sample("z", nd.Categorical(self.probs).expand([ptn.particles()]))


def hmm_laws() -> tuple[dict, dict, float, float]:
    """(exact law of (y_3, y_4) given x, the prior predictive law, chi2 of the posterior of z_0..z_4 against the
    prior and against the table guide [0.3, 0.4, 0.3]^5), by enumeration."""
    post, prior = np.zeros((3,) * HT), np.zeros((3,) * HT)
    for zs in itertools.product(range(3), repeat=HT):
        p = 1 / 3
        for t in range(1, HT):
            p *= HA[zs[t - 1], zs[t]]
        prior[zs] = p
        post[zs] = p * np.prod([HB[zs[t], int(HX[t])] for t in range(3)])
    post /= post.sum()
    q = np.einsum("a,b,c,d,e->abcde", *[np.array([0.3, 0.4, 0.3])] * HT)

    def law(pz):
        return {(a, b): float((pz * HB[:, a][None, None, None, :, None] * HB[:, b][None, None, None, None, :]).sum())
                for a, b in itertools.product(range(3), repeat=2)}

    return law(post), law(prior), chi2(post, prior), chi2(post, q)


@pytest.mark.parametrize("table", [False, True], ids=["partial", "table"])
def test_resampling_on_an_hmm(table, monkeypatch):
    """A prompt of three observed steps and two output steps, a latent at every step: with a partial guide (it
    proposes no z: the program draws them, out of the weights) or a guide proposing every z, (3.14) is within
    Prop 3.3's bound of the exact predictive law; with uniform weights the partial guide's law is the prior
    predictive and fails the same bound."""
    exact, prior, c_prior, c_table = hmm_laws()
    n, S = 1024, 1000
    out = ptn.infer.decode(HMM(), HMMGuide([0.3, 0.4, 0.3] if table else None), HX, method="resampling", n=n,
                           num_samples=S, rng_key=8)
    assert out.tokens.shape == (S, 2) and out.latents["z"].shape == (S, HT) and list(out.outputs) == ["y"]
    bound = math.sqrt((6 * (c_table if table else c_prior) + 2) / n) + noise_tv(exact, S)
    got = empirical([tuple(int(v) for v in r) for r in np.asarray(out.tokens)])
    assert tv(got, exact) < bound, (tv(got, exact), bound)
    if not table:
        monkeypatch.setattr(decode_module, "_log_weights", lambda log_w: jnp.zeros_like(log_w))
        out = ptn.infer.decode(HMM(), HMMGuide(), HX, method="resampling", n=n, num_samples=S, rng_key=8)
        got = empirical([tuple(int(v) for v in r) for r in np.asarray(out.tokens)])
        assert tv(got, prior) < noise_tv(prior, S) and tv(got, exact) > bound


# ---------------------------------------------------------------------------------------------- API
def test_decoded_fields_tokens_and_no_recompile():
    """outputs ``{site: [S, T]}`` with their active flags, tokens ``[S, 2]`` with -1 after ``<eos>``; a new program
    instance with other weights and a new guide reuse the compiled run and follow their own weights."""
    S = 1000  # the sizes of test_resampling_prop33: no new compile
    out = ptn.infer.decode(QTA(), ThoughtGuide(GUIDE), *ARGS, method="resampling", n=1024, num_samples=S, rng_key=5)
    assert list(out.outputs) == ["answer"] and out.outputs["answer"].shape == (S, L) and out.method == "resampling"
    act = np.asarray(out.stats["active"]["answer"])
    assert not act[:, 0].any() and act[:, 1].all()  # step 0 is the prompt
    tok = np.asarray(out.tokens)
    assert tok.shape == (S, 2) and set(out.latents) == {"thought"}
    ended = tok[:, 0] == EOS
    assert ended.any() and (tok[ended, 1] == -1).all() and (tok[~ended, 1] >= 0).all()
    assert np.array_equal(act[:, 2], ~ended)
    before = ptn.compile_stats()["count"]
    pz = np.array([[0.0, 1.0, 0.0], [0.2, 0.2, 0.6]])  # the thought is 1 for question 0
    out = ptn.infer.decode(QTA(pz), ThoughtGuide([0.2, 0.6, 0.2]), *ARGS, method="resampling", n=1024,
                           num_samples=S, rng_key=6)
    assert ptn.compile_stats()["count"] == before
    assert (np.asarray(out.latents["thought"]) == 1).all()


def test_guide_sampling_an_output_is_refused():
    class Greedy(ThoughtGuide):
        def step(self, state, t, q, answer):
            ptn.sample("answer", nd.Categorical(self.probs).expand([ptn.particles()]))

    for method in ("direct", "resampling", "best_of_k"):
        with pytest.raises(SiteMismatchError, match="answer"):
            ptn.infer.decode(QTA(), Greedy(GUIDE), *ARGS, method=method, n=4)
    with pytest.raises(SiteMismatchError, match="answer"):
        list(ptn.infer.decode(QTA(), Greedy(GUIDE), *ARGS, method="streaming"))


def test_methods_and_options_are_checked():
    with pytest.raises(ConfigError, match="torch-only"):
        ptn.infer.decode(QTA(), None, *ARGS, method="unbiased")
    with pytest.raises(ConfigError, match="unknown decoding method"):
        ptn.infer.decode(QTA(), None, *ARGS, method="beam")
    with pytest.raises(ConfigError, match="horizon"):
        ptn.infer.decode(QTA(), None, *ARGS, method="direct", max_new_tokens=3)
    with pytest.raises(ConfigError, match="ess_threshold"):
        ptn.infer.decode(QTA(), None, *ARGS, ess_threshold=2.0)


def test_a_prompt_of_probability_zero_is_a_zero_weights_error():
    """Every particle set weighs 0 when no thought can emit the prompt's token: nothing to choose from, the one
    ZeroWeightsError of both backends (the compiled run is reused: the table is an argument)."""
    pa = np.array([[0.0, 0.9, 0.1]] * 3)
    with pytest.raises(ZeroWeightsError, match="resampling decoding"):
        ptn.infer.decode(QTA(pa=pa), ThoughtGuide(GUIDE), *ARGS, method="resampling", n=1024, num_samples=1000)
