"""The Section 6 objectives as NumPyro losses (ppl_thought/numpyro/infer/objectives_active.py), checked exactly
(issue 40).

The problem: ``ptn.transforms.ActiveLift`` with three trigram Tabular LMs (Q, P, G, random logits), T = 2 latent
tokens over Omega = {0, 1} (4 latent sequences), x = "a b <eos>". With n = 2 particles drawn i.i.d. from Q(. | x)
there are 16 batches; the expectation of the estimator's value and gradient is their sum weighted by
Q(z_1 | x) Q(z_2 | x), compared with the objective computed by enumerating the 4 latent sequences:

* value: E[value] = sum_z Q(z | x) sum_t r_t(z, x) (r_t of (6.7), (6.10), (6.15), (6.16));
* gradients: E[grad_Q] = grad_Q J (score function, reward-to-go, leave-one-out baseline), E[grad_P] = -grad_P J
  (P maximises), E[grad_G] = grad_G J; (6.19): E[value] and E[grad_Q] of the cross-entropy of Q(. | x_<=l) to Q(. | x).

On every batch the JAX loss equals the torch objective (ppl_thought/training/active.py) on the same weights and
latents: value within 1e-5, gradients of the three tables within 1e-5. A wrong estimator (token s credited with its
own term only, no reward-to-go) misses the exact Q gradient.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpyro  # noqa: E402
import torch  # noqa: E402

import ppl_thought as pt  # noqa: E402
import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import ActiveLiftError  # noqa: E402
from ppl_thought.training import active as tactive  # noqa: E402
from ppl_thought.transforms import ActiveLift as TorchActiveLift  # noqa: E402

VOCAB = pt.Vocab(["0", "1", "a", "b"])
V = len(VOCAB)
T, N = 2, 2
X = np.array([VOCAB.id("a"), VOCAB.id("b"), VOCAB.id("<eos>")])
ZS = np.array(list(itertools.product([VOCAB.id("0"), VOCAB.id("1")], repeat=T)))  # the 4 latent sequences
BATCHES = np.array(list(itertools.product(range(len(ZS)), repeat=N)))  # 16 batches of n = 2 (indices into ZS)
ROLES = ("lm", "prior_lm", "generator_lm")
TOL = 2e-5
KINDS = {"min_max": ptn.infer.ActiveLifting, "coding": ptn.infer.MinimumLengthCoding,
         "generator": ptn.infer.GeneratorLoss, "active": ptn.infer.ActiveGenerative}
TORCH = {"min_max": tactive.ActiveLifting, "coding": tactive.MinimumLengthCoding, "generator": tactive.GeneratorLoss,
         "active": tactive.ActiveGenerative, "conditional": tactive.ConditionalSamplerLoss}


def _tables() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(0.0, 1.2, (V,) * 3).astype(np.float32) for _ in ROLES]


def _jax_lift() -> ptn.transforms.ActiveLift:
    q, p, g = (ptn.lm.Tabular.from_numpy(t) for t in _tables())
    return ptn.transforms.ActiveLift(q, VOCAB, T, ["0", "1"], max_x_len=3, prior_lm=p, generator_lm=g)


def _torch_lift() -> TorchActiveLift:
    q, p, g = (pt.lm.Tabular(3, V, torch.tensor(t)) for t in _tables())
    return TorchActiveLift(q, VOCAB, T, ["0", "1"], max_x_len=3, prior_lm=p, generator_lm=g)


def _params() -> dict:
    return {f"active/{r}/0": jnp.asarray(t) for r, t in zip(ROLES, _tables())}


def _exact(kind: str, loss, params: dict) -> jax.Array:
    """J = sum_z Q(z | x) sum_t r_t(z, x) by enumeration of the 4 latent sequences (gradients to every table)."""
    lift = loss.bound(params)
    lq = lift.sampler_log_probs(ZS, X)
    LQ = jnp.pad(jnp.cumsum(lq, -1), ((0, 0), (1, 0)))
    LP = jnp.pad(jnp.cumsum(lift.prior_log_probs(ZS), -1), ((0, 0), (1, 0)))
    lg = lift.generator_log_probs(X, ZS)
    r = {"min_max": LP - LQ, "coding": -lg, "generator": -lg, "active": LP - LQ - lg}[kind]
    return jnp.sum(jnp.exp(LQ[:, -1]) * r.sum(-1))


def _expected(loss, params: dict, surrogate=None):
    """(E value, E grad surrogate) over the 16 batches, weighted by prod_i Q(z_i | x)."""
    surrogate = surrogate or (lambda p, z: loss.from_latents(p, z, X))
    zb = jnp.asarray(ZS[BATCHES])  # [16, n, T]
    # jitted: eagerly, every primitive of the enumerations and their gradients is a compile of its own
    values = jax.jit(jax.vmap(lambda z: surrogate(params, z)[0]))(zb)
    grads = jax.jit(jax.vmap(lambda z: jax.grad(lambda p: surrogate(p, z)[1])(params)))(zb)
    q = np.exp(np.asarray(loss.bound(params).sampler_log_probs(ZS, X)).sum(-1))
    w = q[BATCHES].prod(1)
    assert abs(w.sum() - 1) < 1e-5  # Q is a distribution on Omega^T
    ev = float((w * np.asarray(values, np.float64)).sum())
    eg = {k: np.tensordot(w, np.asarray(g, np.float64), 1) for k, g in grads.items()}
    return ev, eg


@pytest.mark.parametrize("kind", list(KINDS))
def test_active_losses_are_unbiased_for_the_enumerated_objective(kind):
    loss = KINDS[kind](_jax_lift(), N)
    params = _params()
    ev, eg = _expected(loss, params)
    J = float(jax.jit(lambda p: _exact(kind, loss, p))(params))
    assert abs(ev - J) < TOL, (kind, ev, J)
    gJ = jax.jit(jax.grad(lambda p: _exact(kind, loss, p)))(params)
    want = {"active/lm/0": gJ["active/lm/0"] if kind != "generator" else 0 * gJ["active/lm/0"],
            "active/generator_lm/0": gJ["active/generator_lm/0"]}
    if kind in ("min_max", "active"):
        want["active/prior_lm/0"] = -gJ["active/prior_lm/0"]  # P maximises
    elif kind == "coding":  # (6.6) on the same particles: P ascends sum_z Q(z) sum_t lp_t
        want["active/prior_lm/0"] = -jax.jit(jax.grad(lambda p: _exact("min_max", loss, p) - _exact("min_max", loss, {
            **p, "active/prior_lm/0": jax.lax.stop_gradient(p["active/prior_lm/0"])})))(params)["active/prior_lm/0"]
    else:
        want["active/prior_lm/0"] = 0 * gJ["active/prior_lm/0"]
    for k, g in want.items():
        np.testing.assert_allclose(eg[k], np.asarray(g), atol=TOL, err_msg=f"{kind} {k}")
    assert np.abs(np.asarray(want["active/lm/0"])).max() > 1e-2 or kind == "generator"  # the check has power


def test_a_loss_without_reward_to_go_misses_the_exact_sampler_gradient():
    """Token s credited with its own term r_s only (the wrong estimator of tests/test_active_lifting.py)."""
    from ppl_thought.numpyro.infer import objectives_active as oa

    loss = ptn.infer.ActiveLifting(_jax_lift(), N)

    def wrong(p, z):
        lift = loss.bound(p)
        lq = lift.sampler_log_probs(z, X)
        LQ, LP = oa._prefix_sums(lq), oa._prefix_sums(lift.prior_log_probs(z))
        r = jax.lax.stop_gradient(LP - LQ)[:, 1:]
        a = (r - r.mean(0)) * N / (N - 1)
        return r.sum(-1).mean(), (a * lq).sum(-1).mean() - LP.sum(-1).mean()

    params = _params()
    _, eg = _expected(loss, params, wrong)
    gJ = jax.grad(lambda p: _exact("min_max", loss, p))(params)["active/lm/0"]
    assert np.abs(eg["active/lm/0"] - np.asarray(gJ)).max() > 1e-2


def _torch_grads(lift: TorchActiveLift) -> dict:
    return {f"active/{r}/0": (getattr(lift, r).logits.grad if getattr(lift, r).logits.grad is not None
                              else torch.zeros(V, V, V)).numpy().copy() for r in ROLES}


@pytest.mark.parametrize("kind", [*KINDS, "conditional"])
def test_active_losses_equal_the_torch_objectives_on_every_batch(kind):
    jloss = (ptn.infer.ConditionalSamplerLoss if kind == "conditional" else KINDS[kind])(_jax_lift(), N)
    params = _params()
    zb = jnp.asarray(ZS[BATCHES])
    vals, surrs = jax.jit(jax.vmap(lambda z: jloss.from_latents(params, z, X)))(zb)
    grads = jax.jit(jax.vmap(lambda z: jax.grad(lambda p: jloss.from_latents(p, z, X)[1])(params)))(zb)
    tlift = _torch_lift()
    tobj = TORCH[kind](tlift, N)
    for b, idx in enumerate(BATCHES):
        z = torch.tensor(ZS[idx])
        if kind == "conditional":
            tlift.sampler = lambda x, z=z: type("Fixed", (), {"sample": lambda self, shape: z})()
        else:
            tobj.sample_latents = lambda *a, z=z, **k: z
        for r in ROLES:
            getattr(tlift, r).zero_grad(set_to_none=True)
        value, surr = tobj.surrogate(None, None, torch.tensor(X))
        surr.backward()
        assert abs(float(vals[b]) - float(value)) < 1e-5, (kind, b)
        assert abs(float(surrs[b]) - float(surr)) < 1e-5, (kind, b)
        for k, g in _torch_grads(tlift).items():
            np.testing.assert_allclose(np.asarray(grads[k][b]), g, atol=1e-5, err_msg=f"{kind} {k} batch {b}")


def test_conditional_sampler_loss_is_the_enumerated_cross_entropy():
    """(6.19): E value = (1/(L-1)) sum_l sum_z Q(z | x) (-log Q(z | x_<=l)), E grad_Q its gradient with Q(. | x)
    held fixed; L = |x| = 3."""
    loss = ptn.infer.ConditionalSamplerLoss(_jax_lift(), N)
    params = _params()

    def ce(p):
        lift = loss.bound(p)
        q = jax.lax.stop_gradient(jnp.exp(lift.sampler_log_probs(ZS, X).sum(-1)))
        return sum(-(q * lift.sampler_log_probs(ZS, X[:m]).sum(-1)).sum() for m in (1, 2)) / 2

    ev, eg = _expected(loss, params)
    assert abs(ev - float(jax.jit(ce)(params))) < TOL
    np.testing.assert_allclose(eg["active/lm/0"], np.asarray(jax.jit(jax.grad(ce))(params)["active/lm/0"]), atol=TOL)
    with pytest.raises(ActiveLiftError, match=r"\|x\| >= 2"):
        loss.from_latents(params, ZS[:2], X[-1:])


def test_svi_registers_the_three_tables_and_trains_through_loss_model_and_guide():
    """numpyro.infer.SVI(loss.model, loss.guide, optim, loss): the three LMs' parameters are param sites, an
    update moves Q, P and G, and the reported loss is the estimator's value on the particles Q drew."""
    loss = ptn.infer.ActiveGenerative(_jax_lift(), 8)
    svi = numpyro.infer.SVI(loss.model, loss.guide, numpyro.optim.Adam(0.05), loss)
    state = svi.init(jax.random.PRNGKey(0), X)
    assert sorted(svi.get_params(state)) == sorted(f"active/{r}/0" for r in ROLES)
    # compiled (x closed over: ActiveLift reads it concretely); eagerly, each primitive was a compile of its own
    state2, value = jax.jit(lambda s: svi.update(s, X))(state)
    before, after = svi.get_params(state), svi.get_params(state2)
    assert all(float(jnp.abs(after[k] - before[k]).max()) > 0 for k in before)
    assert np.isfinite(float(value))
    shared = ptn.infer.ActiveLifting(ptn.transforms.ActiveLift(ptn.lm.Tabular.from_numpy(_tables()[0]), VOCAB, T,
                                                               ["0", "1"], max_x_len=3), 4)
    svi = numpyro.infer.SVI(shared.model, shared.guide, numpyro.optim.Adam(0.05), shared)
    assert sorted(svi.get_params(svi.init(jax.random.PRNGKey(0), X))) == ["active/lm/0"]  # one LM: one set
    with pytest.raises(ActiveLiftError, match="num_particles >= 2"):
        ptn.infer.ActiveLifting(_jax_lift(), 1)
