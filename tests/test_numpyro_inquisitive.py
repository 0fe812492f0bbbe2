"""The inquisitive sampler Q_bullet of (3.22) on the JAX side (``ptn.guides.Inquisitive``; issue 40): its table
against a brute-force computation (one fresh ``jax.grad`` per latent sequence of the enumerated lifting) and against
torch's ``pt.guides.Inquisitive`` on the same weights (plain and Remark 3.7's centered variant, within 1e-5); as a
guide of ``ptn.infer.Importance`` / ``SMC`` its draws have the table's law and its weights are P(z) / Q_bullet(z), so
the estimate of log p(x) is unbiased against the enumerated (2.22)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import ppl_thought as pt  # noqa: E402
import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.vocab import PAD_ID  # noqa: E402

VOCAB = pt.Vocab(["a", "b"])
V = len(VOCAB)
X = VOCAB.encode("ab")


@pytest.fixture(scope="module")
def models():
    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=1)
    logits = np.random.default_rng(7).normal(0.0, 1.5, (V, V)).astype(np.float32)
    jm = ptn.models.SlowThinking(ptn.lm.Tabular.from_numpy(logits), proj)
    tm = pt.models.SlowThinking(pt.lm.Tabular(2, V, torch.tensor(logits), trainable=True), proj)
    return jm, tm


@pytest.fixture(scope="module")
def brute_force(models) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(support, log P(z), d log P(z) / d logits) of every lifting of X, one z at a time: independent of the guide's
    batched Jacobian (a fresh distribution and one gradient per z; one compiled value-and-grad, called per z)."""
    model, _ = models
    support = np.asarray(model.enumerate_log_joint(X)[0])

    def f(params, z):
        d = ptn.dist.LMSequence(model.prior, constraint=model.projection.domain(len(X)), params=params)
        return d.log_prob(z[None])[0]

    value_and_grad = jax.jit(jax.value_and_grad(f))
    out = [value_and_grad(model.prior.params, jnp.asarray(z)) for z in support]
    lp = np.array([float(v) for v, _ in out])
    G = np.stack([np.asarray(g["logits"], np.float64).reshape(-1) for _, g in out])
    return support, lp, G


def _brute_force(brute_force, centered: bool) -> tuple[np.ndarray, np.ndarray]:
    support, lp, G = brute_force
    if centered:
        q = np.exp(lp - np.logaddexp.reduce(lp))
        G = G - (q[:, None] * G).sum(0)
    w = lp + np.log(np.linalg.norm(G, axis=-1))
    return support, w - np.logaddexp.reduce(w)


@pytest.mark.parametrize("centered", [False, True])
def test_table_matches_brute_force_and_torch(models, brute_force, centered):
    jm, tm = models
    q = ptn.guides.Inquisitive(jm, centered=centered)
    support, want = _brute_force(brute_force, centered)
    got = np.asarray(q.log_prob(support, X))
    np.testing.assert_allclose(got, want, atol=1e-5)
    with torch.no_grad():
        torch_lq = pt.guides.Inquisitive(tm, centered=centered).log_prob(torch.as_tensor(support).long(), X).numpy()
    np.testing.assert_allclose(got, torch_lq, atol=1e-5)
    post = np.asarray(jm.exact_posterior(X).log_probs)
    assert np.abs(np.exp(got) - np.exp(post)).max() > 0.01  # Q_bullet is not Q_* here
    outside = support[:1].copy()
    outside[0, 0] = VOCAB.id("b") if outside[0, 0] == VOCAB.id("a") else VOCAB.id("a")
    assert np.isneginf(np.asarray(q.log_prob(outside, X))).all()


def test_guide_under_importance_and_smc(models):
    """Importance(4000): the draws' law is the table (TV < 0.04), every log weight is log P(z) - log Q_bullet(z),
    log p-hat within 4 SE of the enumerated log p(x); SMC(2000) over the same program pair likewise."""
    jm, _ = models
    q = ptn.guides.Inquisitive(jm)
    support, lq = q.table(np.asarray(X))
    support, lq = np.asarray(support), np.asarray(lq)
    _, lp = jm.enumerate_log_joint(X)
    exact = float(jm.exact_log_prob(X))
    res = ptn.infer.Importance(4000).run(jm, q, X, rng_key=jax.random.PRNGKey(0))
    z = np.asarray(res.samples["z"])[:, : support.shape[1]]
    idx = np.array([np.flatnonzero((support == row).all(-1))[0] for row in z])
    emp = np.bincount(idx, minlength=len(support)) / len(idx)
    assert 0.5 * np.abs(emp - np.exp(lq)).sum() < 0.04
    np.testing.assert_allclose(np.asarray(res.log_weights), (np.asarray(lp) - lq)[idx], atol=1e-5)
    assert abs(float(res.log_marginal) - exact) < 4 * float(res.log_marginal_stderr) + 1e-6
    smc = ptn.infer.SMC(2000).run(jm, q, X, rng_key=jax.random.PRNGKey(1))
    assert abs(float(smc.log_marginal) - exact) < 0.05
    zs = np.asarray(smc.samples["z"])[:, : support.shape[1]]
    assert all((support == row).all(-1).any() for row in zs)  # every particle in the lifting
    assert (zs[:, : support.shape[1]] != PAD_ID).any()
