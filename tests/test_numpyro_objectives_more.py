"""``SFT``, ``SeparatePolicy`` and ``Sum`` as NumPyro losses (ppl_thought/numpyro/infer/objectives_more.py), checked
exactly (issue 40).

The enumerable problem of tests/test_numpyro_objectives.py: z in {0, 1, 2}, p_theta(z, x) = softmax(theta)_z L_z,
q_psi(z) = softmax(psi)_z, n = 3 particles (27 batches, weighted by prod_i q(z_i)):

* ``SFT`` on given rows: value and gradient equal -(1/B) sum_b log p(z_b, x) and its gradient written by hand; on the
  guide's samples (5.25): E value = -E_q log p(z, x), E grad_theta = -E_q grad log p, no psi gradient;
* ``Sum(ELBO, SamplerPolicyGradient, weights=[1, 0.5])``: E value and E grad are the weighted sums of the exact targets;
* ``SeparatePolicy`` (Remark 3.10, pi_theta = softmax(theta), reward R): E value = -E_pi R, E grad_theta =
  grad_theta(-E_pi R); the psi gradient on every batch equals the formula written by hand; the per-sample norms
  ||grad_theta log pi(Z_i)|| of the real (jacrev) path are ||e_z - softmax(theta)||.

On every batch each loss equals the torch objective (value and gradients within 1e-5); a wrong variant of each fails.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402
import pyro  # noqa: E402
import pyro.distributions as pd  # noqa: E402
import torch  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought import training as ptt  # noqa: E402
from ppl_thought.errors import ArgumentTypeError, ConfigError, ProgramError  # noqa: E402
from ppl_thought.training.objectives import Particles  # noqa: E402

K, N = 3, 3
THETA0 = np.array([0.3, -0.5, 0.9])
PSI0 = np.array([-0.2, 0.4, 0.1])
LOG_L = np.array([-0.7, -2.0, -0.1])
REWARD = np.array([1.0, 0.0, 2.5])
BATCHES = jnp.asarray(list(itertools.product(range(K), repeat=N)))  # [27, 3]
TOL = 2e-5


def _lsm(x):
    return x - np.log(np.exp(x).sum())


def _num_grad(f, x, h=1e-6):
    return np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in np.eye(len(x))])


def _expected(fn, psi=PSI0):
    """(E value, E grad_theta, E grad_psi) of ``fn(theta, psi, z) -> (value, surrogate)`` over the 27 batches."""
    th, ps = jnp.asarray(THETA0, jnp.float32), jnp.asarray(psi, jnp.float32)
    values = jax.vmap(lambda z: fn(th, ps, z)[0])(BATCHES)
    gt, gp = jax.vmap(lambda z: jax.grad(lambda t, p: fn(t, p, z)[1], argnums=(0, 1))(th, ps))(BATCHES)
    w = np.exp(_lsm(np.asarray(psi)))[np.asarray(BATCHES)].prod(1)
    return (float((w * np.asarray(values, np.float64)).sum()), (w[:, None] * np.asarray(gt, np.float64)).sum(0),
            (w[:, None] * np.asarray(gp, np.float64)).sum(0))


def _parts(theta, psi, z):
    return (jax.nn.log_softmax(theta)[z] + jnp.asarray(LOG_L, jnp.float32)[z], jax.nn.log_softmax(psi)[z], {"z": z})


def _torch_particles(z, theta, psi, log_l=LOG_L):
    idx = torch.tensor(np.asarray(z))
    lp = torch.log_softmax(theta, 0)[idx] + torch.as_tensor(log_l)[idx]
    return Particles(lp, torch.log_softmax(psi, 0)[idx], {"z": idx}, params=[theta])


# ---------------------------------------------------------------------------------------------- SFT
SEQS = np.array([[0, 2], [1, 1], [2, 0]])


def _jax_model(x=None):
    theta = numpyro.param("theta", jnp.asarray(THETA0, jnp.float32))
    z = numpyro.sample("z", nd.Categorical(logits=theta).expand([2]).to_event(1))
    numpyro.factor("x", jnp.asarray(LOG_L, jnp.float32)[z].sum(-1))


def _torch_model(x=None):
    theta = pyro.param("theta", torch.tensor(THETA0))
    z = pyro.sample("z", pd.Categorical(logits=theta).expand([2]).to_event(1))
    pyro.factor("x", torch.as_tensor(LOG_L)[z].sum(-1))


def test_sft_on_given_rows_is_the_mean_nll_written_by_hand_and_equals_torch():
    loss = ptn.infer.SFT()

    def f(theta):
        out = loss.loss_with_mutable_state(jax.random.PRNGKey(0), {"theta": theta}, _jax_model, None,
                                           sequences=jnp.asarray(SEQS))
        return out["loss"]

    th = jnp.asarray(THETA0, jnp.float32)
    value, grad = float(f(th)), np.asarray(jax.grad(f)(th))
    lsm, soft = _lsm(THETA0), np.exp(_lsm(THETA0))
    want = -np.mean([sum(lsm[t] + LOG_L[t] for t in row) for row in SEQS])
    want_grad = -np.mean([sum(np.eye(K)[t] - soft for t in row) for row in SEQS], 0)
    assert abs(value - want) < 1e-5 and np.allclose(grad, want_grad, atol=1e-5)
    pyro.clear_param_store()
    t_value, t_surr = ptt.SFT().surrogate(_torch_model, None, sequences=torch.tensor(SEQS))
    t_surr.backward()
    assert abs(value - float(t_value)) < 1e-5
    assert np.allclose(grad, pyro.param("theta").unconstrained().grad.numpy(), atol=1e-5)
    # a row of probability 0: loss +inf with a zero gradient (the torch side raises), never NaN
    def impossible(x=None):  # token 1 has probability 0 after the factor: row [1, 1] cannot be fitted
        theta = numpyro.param("theta", jnp.asarray(THETA0, jnp.float32))
        z = numpyro.sample("z", nd.Categorical(logits=theta).expand([2]).to_event(1))
        numpyro.factor("x", jnp.where((z == 1).any(), -jnp.inf, 0.0))

    f0 = lambda t: loss.loss_with_mutable_state(jax.random.PRNGKey(0), {"theta": t}, impossible, None,  # noqa: E731
                                                sequences=jnp.asarray(SEQS))["loss"]
    assert float(f0(th)) == np.inf and np.allclose(np.asarray(jax.grad(f0)(th)), 0.0)
    with pytest.raises(ConfigError, match="whole-trace"):
        loss.surrogate(jax.random.PRNGKey(0), {}, _Plan(), None, sequences=jnp.asarray(SEQS))


class _Plan(ptn.Program):
    max_steps = 1

    def step(self, state, t):
        return jnp.ones(ptn.particles(), bool)


def test_sft_on_guide_samples_is_unbiased_for_the_expected_nll_and_does_not_train_the_guide():
    """(5.25) without rows: E value = -E_q log p(z, x), E grad_theta = -E_q grad log p, E grad_psi = 0; a variant
    that weights the rows by their importance weights (wrong for (5.25)) misses the theta gradient."""
    q = np.exp(_lsm(PSI0))
    ev, gt, gp = _expected(lambda t, p, z: ptn.infer.SFT(N).from_particles(*_parts(t, p, z)))
    assert abs(ev + float((q * (_lsm(THETA0) + LOG_L)).sum())) < TOL
    assert np.allclose(gt, -_num_grad(lambda th: float((q * _lsm(th)).sum()), THETA0), atol=TOL)
    assert np.allclose(gp, 0.0)

    def wrong(t, p, z):  # rows weighted by their self-normalised importance weights: (3.17)'s gradient, not (5.25)
        lp, lq, _ = _parts(t, p, z)
        w = jax.nn.softmax(jax.lax.stop_gradient(lp - lq))
        return -jax.lax.stop_gradient(lp).mean(), -(w * lp).sum()

    _, gt_wrong, _ = _expected(wrong)
    assert not np.allclose(gt_wrong, -_num_grad(lambda th: float((q * _lsm(th)).sum()), THETA0), atol=1e-3)
    for z in np.asarray(BATCHES):  # torch's SFT on the same guide samples, every batch
        theta, psi = torch.tensor(THETA0, requires_grad=True), torch.tensor(PSI0, requires_grad=True)
        tobj = ptt.SFT(N)
        tobj.particles = lambda *a, z=z, theta=theta, psi=psi, **k: _torch_particles(z, theta, psi)
        tv, ts = tobj.surrogate(None, None)
        v, s = ptn.infer.SFT(N).from_particles(*_parts(jnp.asarray(THETA0, jnp.float32),
                                                       jnp.asarray(PSI0, jnp.float32), jnp.asarray(z)))
        assert abs(float(v) - float(tv)) < 1e-5 and abs(float(s) - float(ts.detach())) < 1e-5


# ---------------------------------------------------------------------------------------------- Sum
def _kl(psi):
    lj = _lsm(THETA0) + LOG_L
    lq = _lsm(psi)
    return float((np.exp(lq) * (lq - (lj - np.log(np.exp(lj).sum())))).sum())


def _neg_elbo(psi):
    lq = _lsm(psi)
    return float(-(np.exp(lq) * (_lsm(THETA0) + LOG_L - lq)).sum())


def test_sum_is_the_weighted_sum_of_the_exact_targets():
    """Sum(ELBO, SamplerPolicyGradient, weights=[1, 0.5]) on one shared batch: E value = -ELBO + 0.5 (KL - log Z),
    E grad_psi = grad(-ELBO) + 0.5 grad KL, E grad_theta = -E_q grad log p. A Sum that weights the value but not the
    surrogate (wrong) misses the psi gradient."""
    log_z = float(np.log(np.exp(_lsm(THETA0) + LOG_L).sum()))
    loss = ptn.infer.Sum(ptn.infer.ELBO(N), ptn.infer.SamplerPolicyGradient(N), weights=[1.0, 0.5])
    ev, gt, gp = _expected(lambda t, p, z: loss.from_particles(*_parts(t, p, z)))
    q = np.exp(_lsm(PSI0))
    assert abs(ev - (_neg_elbo(PSI0) + 0.5 * (_kl(PSI0) - log_z))) < TOL
    assert np.allclose(gp, _num_grad(_neg_elbo, PSI0) + 0.5 * _num_grad(_kl, PSI0), atol=TOL)
    assert np.allclose(gt, -_num_grad(lambda th: float((q * _lsm(th)).sum()), THETA0), atol=TOL)

    def wrong(t, p, z):
        (v1, s1), (v2, s2) = (term.from_particles(*_parts(t, p, z)) for term in loss.terms)
        return v1 + 0.5 * v2, s1 + s2

    _, _, gp_wrong = _expected(wrong)
    assert not np.allclose(gp_wrong, _num_grad(_neg_elbo, PSI0) + 0.5 * _num_grad(_kl, PSI0), atol=1e-3)
    with pytest.raises(ArgumentTypeError, match="Sum needs"):
        ptn.infer.Sum()
    with pytest.raises(ConfigError, match="2 weights for 1 terms"):
        ptn.infer.Sum(ptn.infer.ELBO(N), weights=[1.0, 2.0])


def test_sum_equals_the_torch_sum_on_every_batch():
    jl = ptn.infer.Sum(ptn.infer.OneSampler(N), ptn.infer.SamplerPolicyGradient(N), weights=[1.0, 0.5])
    th, ps = jnp.asarray(THETA0, jnp.float32), jnp.asarray(PSI0, jnp.float32)
    values = jax.vmap(lambda z: jl.from_particles(*_parts(th, ps, z))[0])(BATCHES)
    gt, gp = jax.vmap(lambda z: jax.grad(lambda t, p: jl.from_particles(*_parts(t, p, z))[1], (0, 1))(th, ps))(BATCHES)
    for b, z in enumerate(np.asarray(BATCHES)):
        theta, psi = torch.tensor(THETA0, requires_grad=True), torch.tensor(PSI0, requires_grad=True)
        tl = ptt.Sum(ptt.OneSampler(N), ptt.SamplerPolicyGradient(N), weights=[1.0, 0.5])
        tl.terms[0].particles = lambda *a, z=z, theta=theta, psi=psi, **k: _torch_particles(z, theta, psi)
        tv, ts = tl.surrogate(None, None)
        tgt, tgp = torch.autograd.grad(ts, [theta, psi])
        assert abs(float(values[b]) - float(tv)) < 1e-5
        assert np.allclose(np.asarray(gt[b]), tgt.numpy(), atol=1e-5)
        assert np.allclose(np.asarray(gp[b]), tgp.numpy(), atol=1e-5)


def _policy(x=None):
    theta = numpyro.param("theta", jnp.asarray(THETA0, jnp.float32))
    numpyro.sample("z", nd.Categorical(logits=theta))
    numpyro.factor("x", jnp.zeros(()))


def _sampler(x=None):
    psi = numpyro.param("psi", jnp.asarray(PSI0, jnp.float32))
    numpyro.sample("z", nd.Categorical(logits=psi))


def test_sum_shares_one_batch_between_its_terms():
    """Sum.surrogate draws one batch for the terms that read particles only: its value is the terms' values on
    that batch (the batch of ``terms[0].particles`` with the key Sum hands it)."""
    params = {"theta": jnp.asarray(THETA0, jnp.float32), "psi": jnp.asarray(PSI0, jnp.float32)}
    loss = ptn.infer.Sum(ptn.infer.OneSampler(16), ptn.infer.SamplerPolicyGradient(16))
    key = jax.random.PRNGKey(4)
    value, _ = loss.surrogate(key, params, _policy, _sampler)
    batch = loss.terms[0].particles(jax.random.split(key)[1], params, _policy, _sampler)
    want = sum(float(t.from_particles(*batch)[0]) for t in loss.terms)
    assert abs(float(value) - want) < 1e-5


# ---------------------------------------------------------------------------------------------- SeparatePolicy
def _norms(theta, z):
    return jnp.linalg.norm(jax.jacrev(lambda t: jax.nn.log_softmax(t)[z])(theta), axis=-1)


def _sep(loss):
    r = jnp.asarray(REWARD, jnp.float32)

    def fn(theta, psi, z):
        lp, lq, values = jax.nn.log_softmax(theta)[z], jax.nn.log_softmax(psi)[z], {"z": z}
        return loss.from_particles(lp, lq, values, r[z], _norms(theta, z))

    return fn


def test_separate_policy_is_unbiased_for_the_policy_gradient_and_matches_the_sampler_formula():
    pi = np.exp(_lsm(THETA0))
    loss = ptn.infer.SeparatePolicy(lambda z: jnp.asarray(REWARD)[z], N)
    ev, gt, _ = _expected(_sep(loss))
    assert abs(ev + float((pi * REWARD).sum())) < TOL
    assert np.allclose(gt, -_num_grad(lambda th: float((np.exp(_lsm(th)) * REWARD).sum()), THETA0), atol=TOL)
    th, ps = jnp.asarray(THETA0, jnp.float32), jnp.asarray(PSI0, jnp.float32)
    gp = jax.vmap(lambda z: jax.grad(lambda p: _sep(loss)(th, p, z)[1])(ps))(BATCHES)
    for b, z in enumerate(np.asarray(BATCHES)):  # the sampler's gradient by hand
        r, lw = REWARD[z], _lsm(THETA0)[z] - _lsm(PSI0)[z]
        a = r - r.mean()
        nrm = np.linalg.norm(np.eye(K)[z] - pi, axis=1)
        rb = np.log(np.maximum(np.abs(a), 1e-12)) + np.log(nrm) + lw
        want = -np.mean([(rb[i] - rb.mean()) * (np.eye(K)[z[i]] - np.exp(_lsm(PSI0))) for i in range(N)], 0)
        assert np.allclose(np.asarray(gp[b]), want, atol=1e-5), z

    class OnPolicy(ptn.infer.SeparatePolicy):  # wrong: no importance ratio on samples of pi^boxminus
        def from_particles(self, log_p, log_q, values, rewards=None, norms=None):
            v, s = super().from_particles(log_p, jax.lax.stop_gradient(log_p), values, rewards, norms)
            return v, s

    _, gt_wrong, _ = _expected(_sep(OnPolicy(lambda z: z, N)))
    assert not np.allclose(gt_wrong, -_num_grad(lambda th: float((np.exp(_lsm(th)) * REWARD).sum()), THETA0),
                           atol=1e-3)


def test_separate_policy_equals_torch_on_every_batch_and_its_norms_are_the_jacobian_rows():
    jl = ptn.infer.SeparatePolicy(lambda z: jnp.asarray(REWARD)[z], N)
    th, ps = jnp.asarray(THETA0, jnp.float32), jnp.asarray(PSI0, jnp.float32)
    fn = _sep(jl)
    values = jax.vmap(lambda z: fn(th, ps, z)[0])(BATCHES)
    gt, gp = jax.vmap(lambda z: jax.grad(lambda t, p: fn(t, p, z)[1], (0, 1))(th, ps))(BATCHES)
    for b, z in enumerate(np.asarray(BATCHES)):
        theta, psi = torch.tensor(THETA0, requires_grad=True), torch.tensor(PSI0, requires_grad=True)
        tl = ptt.SeparatePolicy(lambda zz: torch.as_tensor(REWARD)[zz], N)
        tl.particles = lambda *a, z=z, theta=theta, psi=psi, **k: _torch_particles(z, theta, psi, np.zeros(K))
        tv, ts = tl.surrogate(None, None)
        tgt, tgp = torch.autograd.grad(ts, [theta, psi])
        assert abs(float(values[b]) - float(tv)) < 1e-5, z
        assert np.allclose(np.asarray(gt[b]), tgt.numpy(), atol=1e-5), z
        assert np.allclose(np.asarray(gp[b]), tgp.numpy(), atol=1e-5), z
    # the real path: particles from the whole-trace policy and sampler, norms by jacrev over theta only
    params = {"theta": th, "psi": ps}
    loss = ptn.infer.SeparatePolicy(lambda z: jnp.asarray(REWARD)[z], 8)
    key = jax.random.PRNGKey(2)
    _, _, values = loss.particles(key, params, _policy, _sampler)
    z = np.asarray(values["z"])
    want = np.linalg.norm(np.eye(K)[z] - np.exp(_lsm(THETA0)), axis=1)
    assert np.allclose(np.asarray(loss.grad_norms(key, params, _policy, _sampler)), want, atol=1e-5)
    svi = numpyro.infer.SVI(_policy, _sampler, numpyro.optim.Adam(0.05), loss)
    res = svi.run(jax.random.PRNGKey(0), 200, progress_bar=False)
    assert float(jax.nn.softmax(res.params["theta"])[2]) > 0.6  # the policy moves to the best reward (z = 2)


# ---------------------------------------------------------------------------------------------- Inquisitive
def _log_q_dot() -> np.ndarray:
    """log Q_•(z) (3.22): proportional to p(z, x) ||grad_theta log p(z, x)||, grad log softmax(theta)_z = e_z - pi."""
    lj = _lsm(THETA0) + LOG_L + np.log(np.linalg.norm(np.eye(K) - np.exp(_lsm(THETA0)), axis=1))
    return lj - np.log(np.exp(lj).sum())


def test_inquisitive_is_unbiased_for_the_reverse_kl_to_the_inquisitive_sampler_and_equals_torch():
    """(3.25) with the reward (3.26): E grad_psi = grad_psi KL(q_psi || Q_•), E value = KL - log Z_•; without the
    norm in the reward (plain (3.25), wrong here) it misses; on every batch it equals torch's Inquisitive."""
    log_z_dot = float(np.log(np.exp(_lsm(THETA0) + LOG_L + np.log(np.linalg.norm(np.eye(K) - np.exp(_lsm(THETA0)),
                                                                                   axis=1))).sum()))

    def kl(psi):
        lq = _lsm(psi)
        return float((np.exp(lq) * (lq - _log_q_dot())).sum())

    loss = ptn.infer.Inquisitive(N)

    def fn(theta, psi, z):
        return loss.from_particles(*_parts(theta, psi, z), norms=_norms(theta, z))

    ev, gt, gp = _expected(fn)
    assert np.allclose(gp, _num_grad(kl, PSI0), atol=TOL) and np.allclose(gt, 0.0)
    assert abs(ev - (kl(PSI0) - log_z_dot)) < TOL
    _, _, gp_plain = _expected(lambda t, p, z: ptn.infer.SamplerPolicyGradient(N).from_particles(*_parts(t, p, z)))
    assert not np.allclose(gp_plain, _num_grad(kl, PSI0), atol=1e-3)
    th, ps = jnp.asarray(THETA0, jnp.float32), jnp.asarray(PSI0, jnp.float32)
    values = jax.vmap(lambda z: fn(th, ps, z)[0])(BATCHES)
    grads = jax.vmap(lambda z: jax.grad(lambda p: fn(th, p, z)[1])(ps))(BATCHES)
    for b, z in enumerate(np.asarray(BATCHES)):
        theta, psi = torch.tensor(THETA0, requires_grad=True), torch.tensor(PSI0, requires_grad=True)
        tl = ptt.Inquisitive(N)
        tl.particles = lambda *a, z=z, theta=theta, psi=psi, **k: _torch_particles(z, theta, psi)
        tv, ts = tl.surrogate(None, None)
        assert abs(float(values[b]) - float(tv)) < 1e-5, z
        assert np.allclose(np.asarray(grads[b]), torch.autograd.grad(ts, [psi])[0].numpy(), atol=1e-5), z
    params = {"theta": th, "psi": ps}
    value, _ = loss.surrogate(jax.random.PRNGKey(0), params, _policy, _sampler)
    assert np.isfinite(float(value))
    with pytest.raises(ProgramError, match="parameters of P"):
        loss.surrogate(jax.random.PRNGKey(0), {"psi": ps}, lambda: numpyro.sample("z", nd.Categorical(logits=th)),
                       _sampler)
