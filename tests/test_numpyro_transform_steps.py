"""The step view of ``ptn.transforms`` (issue 40): a ``ptn.Program`` that starts its LM state with
``ptn.transforms.sequence_start`` (``ptn.models.SlowThinking.program(x)`` does) runs under ``Forgetful``,
``Persistent`` and ``CostAware`` in every engine, with the torch side's numbers.

Exact answers: Importance with a guide that proposes every element of the lifting of x once (a point mass per
particle on its segments, log q = 0), so each particle's log weight is the program's log p(z, x) for that z; these
equal the torch transformed model's enumerated log joint (``pt.transforms.enumerate_log_joint``) within 1e-5,
Forgetful (Def 5.1, (5.5)) and persistent alike, and their log-sum-exp is the exact log p(x) of (2.22). A program
without a sequence start (a user HMM) is refused with a TransformError naming what the transform needs."""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402
import pyro  # noqa: E402
import torch  # noqa: E402
from numpyro.handlers import seed, trace  # noqa: E402

import ppl_thought as pt  # noqa: E402
import ppl_thought.numpyro as ptn  # noqa: E402
import ppl_thought.transforms as ptt  # noqa: E402
from ppl_thought.errors import TransformError  # noqa: E402
from ppl_thought.vocab import PAD_ID, Vocab  # noqa: E402

T = ptn.transforms
VOCAB = Vocab(["a", "b"])
V = len(VOCAB)
PROJ = pt.projections.QueryResponse(VOCAB, max_thought_len=1)
# two thoughts (after each query): Forgetful drops the first one; an order-7 table reads back to it
X = np.asarray(VOCAB.encode("a <eos> b <eos> a <eos> b"))


def tabular_pair(seed_: int, order: int = 7, scale: float = 1.5):
    g = torch.Generator().manual_seed(seed_)
    t = pt.lm.Tabular(order, V, torch.randn((V,) * order, generator=g) * scale, trainable=False)
    return t, ptn.lm.Tabular.from_numpy(t.logits.detach().numpy())


def torch_table(tl, forgetful: bool) -> dict:
    def lm_program(x):
        return pyro.sample("x", pt.distributions.LMSequence(tl, max_len=len(x), vocab=VOCAB), obs=x)
    model = ptt.ProjectionLift(PROJ)(lm_program)
    model = ptt.Forgetful()(model) if forgetful else model
    support, lp = ptt.enumerate_log_joint(model, torch.tensor(X))
    return {tuple(int(t) for t in row if t != 0): float(v) for row, v in zip(support, lp)}


def segments(z, domain, T_: int, L: int) -> np.ndarray:
    """z split into the steps of ``SlowThinking.program``: step t < T-1 ends at the token that makes the domain
    automaton emit x_t (Lemma 2.1), the last step takes the rest; ``[T, L]`` right-padded."""
    out = np.full((T_, L), PAD_ID, np.int32)
    s, t, j = domain.start, 0, 0
    nxt, emitted = np.asarray(domain.next_state), np.asarray(domain.emitted)
    for tok in z:
        out[t, j] = tok
        s, j = nxt[s, tok], j + 1
        if t < T_ - 1 and emitted[s] >= t + 1:
            t, j = t + 1, 0
    return out


class Enumerate(ptn.Program):
    """A guide proposing, for particle k, the segments of the k-th element of the lifting (log q = 0)."""

    def __init__(self, segs):
        self.segs = jnp.asarray(segs)  # [K, T, L]
        self.max_steps = int(segs.shape[1])

    def step(self, state, t):
        numpyro.sample("z", nd.Delta(self.segs[:, t], event_dim=1))


def lifting_guide(model):
    lifting = PROJ.enumerate_lifting(X)
    dom = model.domain(len(X))
    L = int(dom.max_len)
    segs = np.stack([segments(z, dom, len(X), L) for z in lifting])
    return lifting, Enumerate(segs)


@pytest.mark.parametrize("forgetful", [True, False], ids=["forgetful", "persistent"])
def test_step_view_log_joints_equal_torch_enumeration(forgetful):
    tl, jl = tabular_pair(5)
    model = ptn.models.SlowThinking(jl, PROJ)
    lifting, guide = lifting_guide(model)
    table = torch_table(tl, forgetful)
    prog = (T.Forgetful() if forgetful else T.Persistent())(model.program(X))
    res = ptn.infer.Importance(len(lifting)).run(prog, guide, rng_key=jax.random.PRNGKey(0))
    lw = np.asarray(res.log_weights)
    want = np.array([table[tuple(int(t) for t in z)] for z in lifting])
    np.testing.assert_allclose(lw, want, atol=1e-5)
    exact = float(jax.scipy.special.logsumexp(jnp.asarray(want)))
    assert abs(float(res.log_marginal) - (exact - np.log(len(lifting)))) < 1e-5
    other = torch_table(tl, not forgetful)
    assert np.abs(np.array([other[tuple(int(t) for t in z)] for z in lifting]) - want).max() > 1e-3


def test_step_view_smc_is_unbiased_for_the_forgetful_likelihood():
    """SMC over Forgetful()(program) (bootstrap): mean Z-hat / Z within 3 SE of 1 over seeds, Z the torch
    forgetful enumeration (not the persistent one, which sits far outside that bound)."""
    tl, jl = tabular_pair(5)
    prog = T.Forgetful()(ptn.models.SlowThinking(jl, PROJ).program(X))
    z_f = np.logaddexp.reduce(list(torch_table(tl, True).values()))
    z_p = np.logaddexp.reduce(list(torch_table(tl, False).values()))
    eng = ptn.infer.SMC(256, ess_threshold=0.5)
    ratios = np.exp([float(eng.run(prog, None, rng_key=jax.random.PRNGKey(s)).log_marginal) - z_f
                     for s in range(24)])
    se = ratios.std(ddof=1) / np.sqrt(len(ratios))
    assert abs(ratios.mean() - 1) < 3 * se + 1e-3, (ratios.mean(), se)
    assert abs(ratios.mean() * np.exp(z_f - z_p) - 1) > 3 * se * np.exp(z_f - z_p)


def test_persistent_and_forgetful_on_one_start_are_refused():
    tl, jl = tabular_pair(5)
    prog = ptn.models.SlowThinking(jl, PROJ).program(X)
    for p in (T.Persistent()(T.Forgetful()(prog)), T.Forgetful()(T.Persistent()(prog))):
        with pytest.raises(TransformError, match="forgetful and persistent|both"):
            ptn.infer.SMC(8).run(p, None, rng_key=jax.random.PRNGKey(0))


class UserHMM(ptn.Program):
    """A program with no sequence site: nothing for the thinking transforms or CostAware to act on."""

    max_steps = 2

    def step(self, state, t):
        z = ptn.sample("z", nd.Categorical(jnp.full((ptn.particles(), 2), 0.5)))
        ptn.observe("x", nd.Categorical(jnp.where(z[:, None] == 0, jnp.array([0.9, 0.1]), jnp.array([0.2, 0.8]))), 1)


@pytest.mark.parametrize("transform", [T.Forgetful, T.Persistent, lambda: T.CostAware(0.1)],
                         ids=["forgetful", "persistent", "cost"])
def test_a_program_without_a_sequence_start_is_refused(transform):
    with pytest.raises(TransformError, match=r"cannot act on this model.*sequence sites: none"):
        ptn.infer.SMC(8).run(transform()(UserHMM()), None, rng_key=jax.random.PRNGKey(0))


def test_cost_aware_prices_the_segments_of_a_program():
    """CostAware(w)(program): every latent segment's ``latent_tokens`` is its token count, ``latent_lengths`` of the
    whole trace is |Z| (the lifting's z drawn), and the engines' numbers are the program's (CostAware changes no
    number). The whole trace is traced under one ``jax.jit`` (run op by op, each eager primitive was an XLA compile
    of its own: ~130 of them)."""
    tl, jl = tabular_pair(5, order=3)
    model = ptn.models.SlowThinking(jl, PROJ)
    prog = model.program(X)
    cost = T.CostAware(0.1)(prog)

    @jax.jit
    def whole_trace():
        tr = trace(seed(cost, 3)).get_trace()
        segs = {k: (s["value"], s["infer"]["latent_tokens"]) for k, s in tr.items()
                if s["type"] == "sample" and k.startswith("z_")}
        return segs, T.latent_lengths(tr, 1)

    segs, lengths = whole_trace()
    assert len(segs) == len(X)
    for value, tokens in segs.values():
        assert int(tokens[0]) == int((np.asarray(value) != PAD_ID).sum())
    total = sum(int((np.asarray(value) != PAD_ID).sum()) for value, _ in segs.values())
    assert float(lengths[0]) == total
    lifting, guide = lifting_guide(model)
    a = ptn.infer.Importance(len(lifting)).run(cost, guide, rng_key=jax.random.PRNGKey(0))
    b = ptn.infer.Importance(len(lifting)).run(prog, guide, rng_key=jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(a.log_weights), np.asarray(b.log_weights), atol=1e-6)


def test_the_decoders_continuation_view_stays_transformed():
    """``decoding_view`` reads ``program.continuation(...)``: on a transformed program it is the inner program's view
    under a copy of the same transform (not the bare inner view), other attributes are the inner program's."""

    class WithView(UserHMM):
        label = "inner"

        def continuation(self, max_new_tokens: int = 1):
            view = UserHMM()
            view.max_steps = max_new_tokens
            return view

    prog = T.Forgetful()(WithView())
    view = prog.continuation(max_new_tokens=3)
    assert isinstance(view, T.Transformed) and isinstance(view.transform, T.Forgetful)
    assert view.transform is not prog.transform and view.max_steps == 3 and prog.label == "inner"
