"""ptn.transforms (the JAX transforms) against the torch ones and exact answers: on the same weights (a tiny
Transformer saved by torch and loaded by JAX, or the same Tabular table) the JAX and torch transformed models give
equal exact log-likelihoods by enumeration of the lifting (within 1e-5): Forgetful (Def 5.1, (5.5)-(5.8)) in both
orders with ProjectionLift, Persistent (= the plain lifting), Ubiquitous (5.6.1), compose; CostAware's estimators of
5.6.3 equal torch's (values and gradients); and the TransformError refusals of issue 41, item 5."""

import os

import pytest

# XLA's cheap backend passes: these tests compile small programs (faster compiles on a loaded CPU)
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import pyro  # noqa: E402
import torch  # noqa: E402
from numpyro.handlers import seed, substitute, trace  # noqa: E402

import ppl_thought as pt  # noqa: E402
import ppl_thought.numpyro as ptn  # noqa: E402
import ppl_thought.transforms as ptt  # noqa: E402
from ppl_thought.errors import ArgumentTypeError, TransformError  # noqa: E402
from ppl_thought.vocab import Vocab  # noqa: E402

T = ptn.transforms
VOCAB = Vocab(["a", "b"])
V = len(VOCAB)


def tabular_pair(seed_: int, order: int = 3, scale: float = 1.5):
    g = torch.Generator().manual_seed(seed_)
    t = pt.lm.Tabular(order, V, torch.randn((V,) * order, generator=g) * scale, trainable=False)
    return t, ptn.lm.Tabular.from_numpy(t.logits.detach().numpy())


@pytest.fixture(scope="module")
def transformer_pair(tmp_path_factory):
    """A random network with sharp logits (thoughts matter to what follows), the same weights on both sides."""
    torch.manual_seed(1)
    t = pt.lm.Transformer(V, d_model=16, n_layers=2, n_heads=2, max_len=64)
    with torch.no_grad():
        t.lm_head.weight.mul_(4.0)
    t.eval()
    return t, ptn.lm.Transformer.load(t.save(tmp_path_factory.mktemp("lm") / "lm"))


def torch_plain(lm):
    def lm_program(x):
        return pyro.sample("x", pt.distributions.LMSequence(lm, max_len=len(x), vocab=VOCAB), obs=x)
    return lm_program


def jax_plain(lm):
    def lm_program(x=None):
        numpyro.sample("x", ptn.dist.LMSequence(lm, max_len=len(x)), obs=x)
    return lm_program


def jax_log_joint(model, proj, x):
    """log p(z, x) of a lifted JAX model for every z in the lifting of x (Prop 2.3), in one compiled pass."""
    x = np.asarray(x)
    lifting = proj.enumerate_lifting(x)
    zlen = trace(seed(model, 0)).get_trace(x)["z"]["fn"].max_len
    Z = np.zeros((len(lifting), zlen), np.int32)
    for i, z in enumerate(lifting):
        Z[i, :len(z)] = z

    @jax.jit
    def log_joint(Z):
        tr = trace(substitute(seed(model, 0), data={"z": Z})).get_trace(x)
        return sum(tr[k]["fn"].log_prob(tr[k]["value"]) for k in ("z", "x"))

    return np.asarray(log_joint(jnp.asarray(Z)))


def jax_exact(model, proj, x) -> float:
    return float(jax.scipy.special.logsumexp(jax_log_joint(model, proj, x)))


# ---------------------------------------------------------------------------------------------- Forgetful
def test_forgetful_lm_equals_torch_forgetful_lm_on_ragged_thoughts(transformer_pair):
    """ForgetfulLM (Def 5.1): the JAX wrapper's log-probabilities at every position equal the torch wrapper's (its
    logits log-softmaxed) on the same weights, fed at once or token by token (the decoding path)."""
    tl, jl = transformer_pair
    rows = [VOCAB.encode("<bos> a <eos> <s> b </s> a <eos> <s> a </s> b"), VOCAB.encode("<bos> b <s> a </s> <s> b")]
    L = max(map(len, rows))
    tokens = np.array([r + [0] * (L - len(r)) for r in rows])
    ref = torch.log_softmax(ptt.ForgetfulLM(tl)(torch.tensor(tokens))[0], -1).detach().numpy()
    f = T.ForgetfulLM(jl)
    out, _ = jax.jit(lambda p, t: f.apply(p, f.init_cache(2, L), t))(f.params, jnp.asarray(tokens))
    for i, r in enumerate(rows):
        np.testing.assert_allclose(np.asarray(out)[i, :len(r)], ref[i, :len(r)], atol=1e-5)
    cache, steps = f.init_cache(2, L), []
    step = jax.jit(lambda p, c, t, v: f.apply(p, c, t, valid=v))
    for m in range(L):
        lp, cache = step(f.params, cache, jnp.asarray(tokens[:, m:m + 1]), jnp.asarray(tokens[:, m:m + 1] != 0))
        steps.append(np.asarray(lp[:, 0]))
    steps = np.stack(steps, 1)
    for i, r in enumerate(rows):
        np.testing.assert_allclose(steps[i, :len(r)], ref[i, :len(r)], atol=1e-5)


def test_forgetful_exact_log_prob_equals_torch_in_both_orders(transformer_pair):
    """(5.5)-(5.8): the enumerated likelihood of the forgetful lifting equals torch's exact_log_prob (which the torch
    tests check against the per-round sums of (5.8)), in both orders with ProjectionLift; the persistent number
    differs (the earlier thought matters to a persistent latent)."""
    tl, jl = transformer_pair
    proj = pt.projections.QueryResponse(VOCAB, max_thought_len=1)
    x = VOCAB.encode("a <eos> b <eos> a <eos> b")  # two rounds: a thought after each of two queries
    torch_forgetful = float(ptt.exact_log_prob(ptt.Forgetful()(ptt.ProjectionLift(proj)(torch_plain(tl))),
                                               torch.tensor(x)))
    torch_persistent = float(ptt.exact_log_prob(ptt.ProjectionLift(proj)(torch_plain(tl)), torch.tensor(x)))
    a = jax_exact(T.Forgetful()(T.ProjectionLift(proj)(jax_plain(jl))), proj, x)
    b = jax_exact(T.ProjectionLift(proj)(T.Forgetful()(jax_plain(jl))), proj, x)
    assert abs(a - torch_forgetful) < 1e-5 and abs(b - torch_forgetful) < 1e-5
    assert abs(torch_forgetful - torch_persistent) > 1e-4


# ---------------------------------------------------------------------------------------------- Persistent, Ubiquitous
def test_persistent_is_the_default_and_refuses_forgetful():
    tl, jl = tabular_pair(3)
    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=1)
    x = VOCAB.encode("a b")
    plain = T.ProjectionLift(proj)(jax_plain(jl))
    np.testing.assert_array_equal(jax_log_joint(T.Persistent()(plain), proj, x), jax_log_joint(plain, proj, x))
    for model in (T.Persistent()(T.Forgetful()(plain)), T.Forgetful()(T.Persistent()(plain))):
        with pytest.raises(TransformError, match="forgetful"):
            trace(seed(model, 0)).get_trace(np.asarray(x))


def test_ubiquitous_exact_log_prob_equals_torch_and_reads_x_explain():
    """5.6.1: thoughts anywhere (the lifting of PauseToThink); the same enumerated likelihood as torch's Ubiquitous
    and its sampler prompt ``x <explain>`` (Fig 5.5)."""
    tl, jl = tabular_pair(8)
    x = VOCAB.encode("a <eos> b")
    tub, jub = ptt.Ubiquitous(VOCAB, max_thought_len=1), T.Ubiquitous(VOCAB, max_thought_len=1)
    exact = float(ptt.exact_log_prob(tub(torch_plain(tl)), torch.tensor(x)))
    assert abs(jax_exact(jub(jax_plain(jl)), jub.projection, x) - exact) < 1e-5
    assert jub.explain_prompt(np.array(x)).tolist() == tub.explain_prompt(torch.tensor(x)).tolist()


def test_compose_is_nesting():
    tl, jl = tabular_pair(1)
    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=1)
    x = VOCAB.encode("a b")
    f, p = T.Forgetful(), T.ProjectionLift(proj)
    composed = T.compose(f, p)(jax_plain(jl))
    nested = T.Forgetful()(T.ProjectionLift(proj)(jax_plain(jl)))
    np.testing.assert_array_equal(jax_log_joint(composed, proj, x), jax_log_joint(nested, proj, x))
    torch_exact = float(ptt.exact_log_prob(ptt.compose(ptt.Forgetful(), ptt.ProjectionLift(proj))(torch_plain(tl)),
                                           torch.tensor(x)))
    assert abs(float(jax.scipy.special.logsumexp(jax_log_joint(composed, proj, x))) - torch_exact) < 1e-5
    assert f.fn is None  # applying a transform binds a copy: f can be applied to another model
    with pytest.raises((ArgumentTypeError, TransformError), match="transforms"):
        T.compose(f, "x")


# ---------------------------------------------------------------------------------------------- CostAware
def test_cost_aware_estimators_equal_torch_values_and_gradients():
    """5.6.3: T_s, T~*_s and the loss (value C_s T_s, surrogate gradient T_s grad C_s + C_s grad T~*_s) equal the
    torch CostAware's on the same numbers, gradients included; a -inf weight drops out (no NaN)."""
    rng = np.random.default_rng(0)
    theta = rng.normal(size=6).astype(np.float32)
    log_w = np.array([-1.0, -0.5, -np.inf, -2.0, -0.1, -0.7], np.float32)
    lengths = np.array([0, 3, 2, 1, 3, 0], np.float32)
    tc, jc = ptt.CostAware(0.5, entropy=0.3), T.CostAware(0.5, entropy=0.3)

    th = torch.tensor(theta, requires_grad=True)
    t_s, t_tilde = tc.estimate(torch.log_softmax(th, 0), torch.tensor(log_w), torch.tensor(lengths))
    (g_torch,) = torch.autograd.grad(t_tilde, [th])

    def jax_t_tilde(th):
        return jc.estimate(jax.nn.log_softmax(th), jnp.asarray(log_w), jnp.asarray(lengths))[1]

    j_s, j_tilde = jc.estimate(jax.nn.log_softmax(jnp.asarray(theta)), jnp.asarray(log_w), jnp.asarray(lengths))
    assert abs(float(j_s) - float(t_s)) < 1e-5 and abs(float(j_tilde) - t_tilde.item()) < 1e-5
    np.testing.assert_allclose(np.asarray(jax.grad(jax_t_tilde)(jnp.asarray(theta))), g_torch.numpy(), atol=1e-5)
    value, _ = jc.loss(2.0, 0.0, jax.nn.log_softmax(jnp.asarray(theta)), jnp.asarray(log_w), jnp.asarray(lengths))
    assert abs(float(value) - (2.0 - 0.3) * float(t_s)) < 1e-5
    assert float(jc.tau(jnp.array([4.0]))[0]) == 3.0
    with pytest.raises(TransformError, match="finite number >= 0"):
        T.CostAware(-1.0)


def test_cost_aware_records_latent_lengths_and_refuses_a_model_without_latent_thoughts():
    tl, jl = tabular_pair(1)
    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=1)
    x = np.asarray(VOCAB.encode("a b"))
    with pytest.raises(TransformError, match="latent sequence site"):
        trace(seed(T.CostAware(0.1)(jax_plain(jl)), 0)).get_trace(x)
    lifted = T.CostAware(0.1)(T.ProjectionLift(proj)(jax_plain(jl)))
    tr = trace(seed(lifted, 0)).get_trace(x)
    z = np.asarray(tr["z"]["value"])
    assert int(tr["z"]["infer"]["latent_tokens"]) == int((z != 0).sum())
    assert float(T.latent_lengths(tr, 1)[0]) == float((z != 0).sum())


# ---------------------------------------------------------------------------------------------- refusals
def normal_model(x=None):
    return numpyro.sample("x", numpyro.distributions.Normal(0.0, 1.0), obs=0.3)


@pytest.mark.parametrize("transform", [T.Forgetful, T.Persistent])
def test_thinking_transforms_refuse_a_model_without_a_sequence_site(transform):
    with pytest.raises(TransformError, match=r"needs a sequence site.*sequence sites: none"):
        trace(seed(transform()(normal_model), 0)).get_trace()
    tl, jl = tabular_pair(1)
    tr = trace(seed(transform()(jax_plain(jl)), 0)).get_trace(np.asarray(VOCAB.encode("a b")))
    assert np.isfinite(float(tr["x"]["fn"].log_prob(tr["x"]["value"])))


def test_ubiquitous_refuses_a_missing_site_and_a_site_that_is_not_a_sequence():
    tl, jl = tabular_pair(1)
    x = np.asarray(VOCAB.encode("a b"))
    with pytest.raises(TransformError, match=r"needs the token-sequence site 'nope'.*sequence sites: 'x'"):
        trace(seed(T.Ubiquitous(VOCAB, 2, site="nope")(jax_plain(jl)), 0)).get_trace(x)
    with pytest.raises(TransformError, match=r"site 'x': it is a Normal"):
        trace(seed(T.Ubiquitous(VOCAB, 2)(normal_model), 0)).get_trace()


# ---------------------------------------------------------------------------------------------- engines
def test_importance_on_a_forgetful_lifting_has_torch_log_weights():
    """ptn.infer.Importance runs Forgetful()(ProjectionLift(proj)(model)) compiled; every particle's log p(z, x) is
    the torch forgetful model's for the same z (its enumerated log joint), and log w = log p - log q."""
    tl, jl = tabular_pair(5, order=4)
    _, jq = tabular_pair(6, order=2, scale=0.5)
    proj = pt.projections.QueryResponse(VOCAB, max_thought_len=1)
    x = VOCAB.encode("a <eos> b <eos> a <eos> b")
    support, lp = ptt.enumerate_log_joint(ptt.Forgetful()(ptt.ProjectionLift(proj)(torch_plain(tl))),
                                          torch.tensor(x))
    table = {tuple(int(t) for t in row if t != 0): float(v) for row, v in zip(support, lp)}
    model = T.Forgetful()(T.ProjectionLift(proj)(jax_plain(jl)))
    res = ptn.infer.Importance(16).run(model, ptn.guides.Causal(jq, proj), np.asarray(x), rng_key=jax.random.PRNGKey(0))
    z = np.asarray(res.samples["z"])
    log_p, log_q = np.asarray(res.stats["log_p"]), np.asarray(res.stats["log_q"])
    for i in range(len(z)):
        assert abs(log_p[i] - table[tuple(int(t) for t in z[i] if t != 0)]) < 1e-5
    np.testing.assert_allclose(np.asarray(res.log_weights), log_p - log_q, atol=1e-5)


# ---------------------------------------------------------------------------------------------- ActiveLift
def test_active_lift_log_probs_equal_torch_and_importance_weights_are_p_g_over_q(tmp_path):
    """Section 6 on the same weights: the JAX lifted model's log P(z) and log G(x | z) (6.13) and the guide's
    log Q(z | x) (6.1) equal the torch ActiveLift's prefix quantities at t = T for every z in Omega^T, and
    Importance's log weights are log P + log G - log Q of its particles; the refusals name the site."""
    from ppl_thought.errors import ActiveLiftError

    vocab = Vocab(["0", "1", "a", "b"])
    torch.manual_seed(0)
    tlm = pt.lm.Transformer(len(vocab), d_model=8, n_layers=1, n_heads=2, max_len=16)
    with torch.no_grad():
        for p in tlm.parameters():
            p.normal_(0.0, 0.6)
    jlm = ptn.lm.Transformer.load(tlm.save(tmp_path / "lm"))
    tlift = ptt.ActiveLift(tlm, vocab, 2, ["0", "1"], max_x_len=3)
    jlift = T.ActiveLift(jlm, vocab, 2, ["0", "1"], max_x_len=3)
    x = np.array([vocab.id("a"), vocab.id("<eos>")])
    zs = np.array([[vocab.id(a), vocab.id(b)] for a in "01" for b in "01"])

    def program(x=None):
        numpyro.sample("x", ptn.dist.LMSequence(jlm, max_len=3), obs=x)

    lifted = jlift(program)

    @jax.jit
    def parts(z):
        tr = trace(substitute(seed(lifted, 0), data={"z": z})).get_trace(x)
        gq = trace(substitute(seed(jlift.guide, 0), data={"z": z})).get_trace(x)
        return (tr["z"]["fn"].log_prob(z), tr["x"]["fn"].log_prob(tr["x"]["value"]), gq["z"]["fn"].log_prob(z))

    zt = torch.tensor(zs)
    with torch.no_grad():
        ref = (tlift.prior_log_probs(zt).sum(-1), tlift.generator_log_probs(torch.tensor(x), zt)[:, -1],
               tlift.sampler_log_probs(zt, torch.tensor(x)).sum(-1))
    table = {}
    for i, z in enumerate(zs):
        got = parts(jnp.asarray(z))
        for g, r in zip(got, ref):
            assert abs(float(g) - float(r[i])) < 1e-5
        table[tuple(z)] = float(got[0] + got[1] - got[2])
    # one compile for the three (op by op, each eager primitive of the Transformer was an XLA compile of its own)
    lg, lq, lp = jax.jit(lambda z: (jlift.generator_log_probs(x, z), jlift.sampler_log_probs(z, x),
                                    jlift.prior_log_probs(z)))(jnp.asarray(zs))
    np.testing.assert_allclose(np.asarray(lg), tlift.generator_log_probs(torch.tensor(x), zt).detach().numpy(),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(lq), tlift.sampler_log_probs(zt, torch.tensor(x)).detach().numpy(),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(lp), tlift.prior_log_probs(zt).detach().numpy(), atol=1e-5)
    res = ptn.infer.Importance(8).run(lifted, jlift.guide, x, rng_key=jax.random.PRNGKey(0))
    for z, lw in zip(np.asarray(res.samples["z"]), np.asarray(res.log_weights)):
        assert abs(lw - table[tuple(z)]) < 1e-5

    @jax.jit
    def generate():  # generation: x ~ G(. | z), z ~ P
        gen = trace(seed(jlift.model, 1)).get_trace(None)
        return gen["x"]["value"], gen["x"]["fn"].log_prob(gen["x"]["value"])

    xg, lx = (np.asarray(v) for v in generate())
    assert set(xg[xg != 0].tolist()) <= set(vocab.observable_ids.tolist())
    assert np.isfinite(float(lx))

    def other_site(x=None):
        numpyro.sample("y", ptn.dist.LMSequence(jlm, max_len=3), obs=x)

    with pytest.raises(ActiveLiftError, match=r"site 'x'.*sequence sites: 'y'"):
        trace(seed(jlift(other_site), 0)).get_trace(x)
    with pytest.raises(ActiveLiftError, match=r"site 'x': it is a Normal"):
        trace(seed(jlift(normal_model), 0)).get_trace()
