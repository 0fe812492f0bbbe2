"""Inference with an active lifting model on the JAX side (Section 6, ppl_thought/numpyro/infer/active_inference.py;
issue 40): ``ptn.infer.encode`` (6.17)/(6.18), ``conditional_encode`` (6.22), ``conditional_decode`` (6.20)/(6.21),
and ``ptn.transforms.ActiveLift`` with per-row x ``[B, L]``.

The problem (as tests/test_numpyro_objectives_active.py): three trigram Tabular LMs (Q, P, G, random logits), T = 2
latent tokens over Omega = {0, 1} (4 latent sequences), x = "a b <eos>". Exact answers by enumerating the 4 latent
sequences: P_model^{<=t}(x) = sum_{z_<=t} P^{<=t}(z_<=t) G^{<=t}(x | z_<=t); the expectation of p_{t,n} over all 16
batches of n = 2 particles drawn from Q is that number (unbiasedness, exactly); (6.20)'s law is
sum_z Q(z | x) G(x' | z, x) and (6.21)'s approaches P_model(. | [x]). Against torch (ppl_thought/training/active.py)
on the same weights and latents: within 1e-5.
"""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import ppl_thought as pt  # noqa: E402
import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import ActiveLiftError  # noqa: E402
from ppl_thought.numpyro.infer import active_inference as ai  # noqa: E402
from ppl_thought.training import active as tactive  # noqa: E402
from ppl_thought.transforms import ActiveLift as TorchActiveLift  # noqa: E402
from ppl_thought.vocab import PAD_ID  # noqa: E402

VOCAB = pt.Vocab(["0", "1", "a", "b"])
V = len(VOCAB)
T, N = 2, 2
a, b, eos = VOCAB.id("a"), VOCAB.id("b"), VOCAB.id("<eos>")
X = np.array([a, b, eos])
ZS = np.array(list(itertools.product([VOCAB.id("0"), VOCAB.id("1")], repeat=T)))  # the 4 latent sequences
BATCHES = np.array(list(itertools.product(range(len(ZS)), repeat=N)))  # 16 batches of n = 2


def _tables() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(0.0, 1.2, (V,) * 3).astype(np.float32) for _ in range(3)]


def _jax_lift(max_x_len: int = 3, tables=None) -> ptn.transforms.ActiveLift:
    q, p, g = (ptn.lm.Tabular.from_numpy(t) for t in (tables or _tables()))
    return ptn.transforms.ActiveLift(q, VOCAB, T, ["0", "1"], max_x_len=max_x_len, prior_lm=p, generator_lm=g)


def _torch_lift(max_x_len: int = 3) -> TorchActiveLift:
    q, p, g = (pt.lm.Tabular(3, V, torch.tensor(t)) for t in _tables())
    return TorchActiveLift(q, VOCAB, T, ["0", "1"], max_x_len=max_x_len, prior_lm=p, generator_lm=g)


@pytest.fixture(scope="module")
def lifts():
    return _jax_lift(), _torch_lift()


def _exact_log_marginals(lift, x) -> np.ndarray:
    """log P_model^{<=t}(x) for t = 0 .. T: every prefix z_<=t appears 2^(T - t) times among the 4 sequences (the
    log-probs of the 4 sequences in one compile)."""
    lp, lg = (np.asarray(v) for v in jax.jit(lambda zs: (lift.prior_log_probs(zs),
                                                         lift.generator_log_probs(x, zs)))(jnp.asarray(ZS)))
    lp = np.pad(np.cumsum(lp, -1), ((0, 0), (1, 0)))
    return np.array([np.logaddexp.reduce(lp[:, t] + lg[:, t]) - (T - t) * math.log(2) for t in range(T + 1)])


class _Fixed:
    """A torch sampler stub whose draws are the given latents (the torch functions on the JAX particles)."""

    def __init__(self, z):
        self.z = torch.tensor(np.asarray(z))

    def sample(self, shape):
        return self.z


def test_per_row_x_equals_row_by_row_and_torch(lifts):
    """sampler / sampler_log_probs / generator_log_probs with x [B, L] right-padded: each row equals the 1-D call
    of its own x, and the torch lift's per-row numbers, within 1e-5."""
    lift, tl = lifts
    xs = np.array([[a, b, eos], [b, eos, PAD_ID], [eos, PAD_ID, PAD_ID], [a, eos, PAD_ID]])
    z = ZS[[0, 3, 1, 2]]
    d = lift.sampler(xs)
    assert d.batch_shape == (4,)
    # one compile for the three (op by op, each eager primitive was an XLA compile of its own)
    lq, lg, lqd = (np.asarray(v) for v in jax.jit(lambda zz: (lift.sampler_log_probs(zz, xs),
                                                              lift.generator_log_probs(xs, zz),
                                                              d.log_prob(zz)))(jnp.asarray(z)))
    for i, row in enumerate(xs):
        x1 = row[row != PAD_ID]
        one = jax.jit(lambda zi, x1=x1: (lift.sampler_log_probs(zi, x1)[0], lift.generator_log_probs(x1, zi)[0],
                                         lift.sampler(x1).log_prob(zi)))(jnp.asarray(z[i]))  # its own x alone
        np.testing.assert_allclose(lq[i], np.asarray(one[0]), atol=1e-5)
        np.testing.assert_allclose(lg[i], np.asarray(one[1]), atol=1e-5)
        np.testing.assert_allclose(lqd[i], float(one[2]), atol=1e-5)
    with torch.no_grad():
        np.testing.assert_allclose(lq, tl.sampler_log_probs(torch.as_tensor(z), torch.as_tensor(xs)).numpy(), atol=1e-5)
        np.testing.assert_allclose(lg, tl.generator_log_probs(torch.as_tensor(xs), torch.as_tensor(z)).numpy(),
                                   atol=1e-5)
    draws = np.asarray(d.sample(jax.random.PRNGKey(0), (3,)))
    assert draws.shape == (3, 4, T) and np.isin(draws, ZS).all()


def test_encode_is_exactly_unbiased_and_equals_torch_on_the_same_particles(lifts):
    """For every batch of n = 2 latents: (6.17) = (6.18) and = torch's encode on the same particles (1e-5); the
    expectation of p_{t,n} under Q over the 16 batches is P_model^{<=t}(x) for every t (exact, 1e-5)."""
    lift, tl = lifts
    q = np.exp(np.asarray(jax.jit(lambda zs: lift.sampler_log_probs(zs, X))(jnp.asarray(ZS))).sum(-1))
    assert abs(q.sum() - 1) < 1e-5
    both = jax.jit(jax.vmap(lambda z: (ai.encode_from(lift, X, z), ai.encode_from(lift, X, z, False))))
    incs, fulls = (np.asarray(v) for v in both(jnp.asarray(ZS[BATCHES])))  # one compile for the 16 batches
    np.testing.assert_allclose(incs, fulls, atol=1e-5)
    mean = np.zeros(T + 1)
    for batch, inc in zip(BATCHES, incs):
        tl.sampler = lambda x, z=ZS[batch]: _Fixed(z)
        np.testing.assert_allclose(inc, tactive.encode(tl, torch.as_tensor(X), N).numpy(), atol=1e-5)
        mean += q[batch].prod() * np.exp(inc)
    del tl.sampler
    exact = np.exp(_exact_log_marginals(lift, X))
    np.testing.assert_allclose(mean, exact, rtol=1e-5)


def test_encode_compiled_runs_draw_from_q_and_reuse_one_compile():
    """``ptn.infer.encode`` (compiled): the mean of p_{T,n} over 150 seeds is within 4 SE of P_model(x); new
    weights in a new ActiveLift of the same configuration reuse the compiled run (and change the answer)."""
    lift = _jax_lift()
    before = ptn.compile_stats()["count"]
    reps = np.array([np.asarray(ptn.infer.encode(lift, X, 4, rng_key=i)) for i in range(150)])
    assert ptn.compile_stats()["count"] - before <= 1
    exact = np.exp(_exact_log_marginals(lift, X))
    for t in range(T + 1):
        p = np.exp(reps[:, t])
        assert abs(p.mean() - exact[t]) < 4 * p.std() / math.sqrt(len(p)) + 1e-7, t
    other = _jax_lift(tables=[t * 0.5 for t in _tables()])
    count = ptn.compile_stats()["count"]
    out = np.asarray(ptn.infer.encode(other, X, 4, rng_key=0))
    assert ptn.compile_stats()["count"] == count  # no compile: same configuration, arrays are arguments
    assert np.abs(out - reps[0]).max() > 1e-3


def test_conditional_encode_is_consistent_and_its_weights_equal_torch(lifts):
    """(6.22): the estimate over 10 seeds with n = 256 is within 4 SE + 0.02 of log P_model(x_q x_r | [x_q]); the
    weights it sums (log G([x] | z) + log P(z) - log Q(z | x)) equal torch's within 1e-5."""
    lift, tl = lifts
    x_q, x_r = X[:1], X[1:]
    exact = _exact_log_marginals(lift, X)[T] - _exact_log_marginals(lift, x_q)[T]
    est = np.array([float(ptn.infer.conditional_encode(lift, x_q, x_r, 256, rng_key=i)) for i in range(10)])
    assert abs(est.mean() - exact) < 4 * est.std() / math.sqrt(len(est)) + 0.02
    for x in (X, x_q):
        lp, lq, lg = tactive._log_weights(tl, torch.as_tensor(ZS), torch.as_tensor(x)[None])
        want = (lp.sum(-1) - lq.sum(-1) + lg[:, -1]).detach().numpy()
        got = jax.jit(lambda zs, x=x: ai.whole_log_weights(lift, zs, x))(jnp.asarray(ZS))  # one compile
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_conditional_decode_laws_against_enumeration():
    """(6.20) has the law sum_z Q(z | x) G(x' | z, x); (6.21) with 64 particles approaches P_model(. | [x]); a
    chi-square test of 3000 draws each, which rejects the other law (G a 5-gram: x' reads z_1 z_2 </s> a)."""
    q, p = (ptn.lm.Tabular.from_numpy(t) for t in _tables()[:2])
    g = ptn.lm.Tabular.from_numpy(np.random.default_rng(1).normal(0.0, 1.5, (V,) * 5).astype(np.float32))
    lift = ptn.transforms.ActiveLift(q, VOCAB, T, ["0", "1"], max_x_len=2, prior_lm=p, generator_lm=g)  # G sees z
    x = np.array([a])
    conts = np.asarray(VOCAB.observable_ids).tolist()  # X = a x', x' one token of Sigma (max_x_len = 2)
    # the enumerated laws' terms in one compile (op by op, each eager primitive was an XLA compile of its own)
    lq, lp, lg_x, lg_full = (np.asarray(v) for v in jax.jit(lambda zs: (
        lift.sampler_log_probs(zs, x).sum(-1), lift.prior_log_probs(zs).sum(-1),
        lift.generator_log_probs(x, zs)[:, -1],
        jnp.stack([lift.generator_log_probs(np.array([a, c]), zs)[:, -1] for c in conts], 1)))(jnp.asarray(ZS)))
    direct = np.exp(np.logaddexp.reduce(lq[:, None] + lg_full - lg_x[:, None], 0))
    target = np.logaddexp.reduce(lp[:, None] + lg_full, 0)
    target = np.exp(target - np.logaddexp.reduce(target))
    assert abs(direct.sum() - 1) < 1e-4 and np.abs(direct - target).max() > 0.02  # the two laws differ
    m = 3000
    for seed, (resample, n, law) in enumerate(((False, 1, direct), (True, 64, target))):
        out = np.asarray(ptn.infer.conditional_decode(lift, x, num_samples=m, num_particles=n, resample=resample,
                                                      rng_key=seed))
        assert out.shape == (m, 2) and (out[:, 0] == a).all()
        counts = np.array([(out[:, 1] == c).sum() for c in conts], float)
        assert counts.sum() == m
        assert ((counts - m * law) ** 2 / (m * law)).sum() < 20.5  # chi-square(5) at 0.999
        other = target if law is direct else direct  # the check has power: the other law is rejected
        assert ((counts - m * other) ** 2 / (m * other)).sum() > 20.5
    with pytest.raises(ActiveLiftError, match="shorter than max_x_len"):
        ptn.infer.conditional_decode(lift, np.array([a, b]))
