"""The paper's objectives as NumPyro losses (ppl_thought/numpyro/infer/objectives.py), checked exactly (issue 40).

The enumerable problem of tests/test_objective_values.py: a latent z in {0, 1, 2}, a model p_theta(z, x) =
softmax(theta)_z L_z and a guide q_psi(z) = softmax(psi)_z. For n = 3 particles drawn i.i.d. from q, the expectation
of any function of the batch is the sum over the 27 batches weighted by prod_i q(z_i) (vmapped here), so the
expected value and gradient of each loss's estimator are compared with what the paper says it estimates:

* ELBO: E value = -ELBO(psi), E grad = grad(-ELBO) in psi and -E_q grad_theta log p in theta;
* (3.17) ``OneSampler`` and (3.23) ``TwoSampler`` with the exact posterior as the inference sampler: E grad_theta =
  grad_theta(-log Z) (Fisher's identity), for any train sampler in (3.23); E value = -log Z;
* (3.25) ``SamplerPolicyGradient``: E grad_psi = grad_psi KL(Q || Q_*), E value = KL - log Z, no theta gradient;
* (5.14)-(5.15) ``R1Zero`` with and without baseline: the exact expectations of tests/test_objective_values.py;
* (5.17) / (5.18) ``GRPO``: the gradient on every batch against the formula written out by hand.

On every batch the JAX loss equals the torch objective (ppl_thought/training/objectives.py) in value and gradient
within 1e-5 (same parameters, same samples). Wrong estimators fail the exact checks. On a user's program
(``JaxPlanThenAnswer`` with a trainable guide program), ``numpyro.infer.SVI`` converges to the exact posterior.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", False)
import jax.numpy as jnp  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402
import torch  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought import training as ptt  # noqa: E402
from ppl_thought.errors import SiteMismatchError  # noqa: E402
from ppl_thought.training.objectives import Particles  # noqa: E402

K, N = 3, 3
THETA0 = np.array([0.3, -0.5, 0.9])
PSI0 = np.array([-0.2, 0.4, 0.1])
LOG_L = np.array([-0.7, -2.0, -0.1])
REWARD = np.array([1.0, 0.0, 2.5])
BATCHES = jnp.asarray(list(itertools.product(range(K), repeat=N)))  # [27, 3]
TOL = 2e-5  # float32 sums of 27 terms against float64 references


def _lsm(x):
    return x - np.log(np.exp(x).sum())


def _log_q_star(log_l=LOG_L) -> np.ndarray:
    lj = _lsm(THETA0) + log_l
    return lj - np.log(np.exp(lj).sum())


def expected(loss, log_l=LOG_L, psi=PSI0):
    """(E value, E grad_theta, E grad_psi) of ``loss.from_particles`` over n i.i.d. draws of q_psi (enumerated)."""
    ll = jnp.asarray(log_l, jnp.float32)

    def one(theta, psi_, z):
        log_p = jax.nn.log_softmax(theta)[z] + ll[z]
        log_q = jax.nn.log_softmax(psi_)[z]
        return loss.from_particles(log_p, log_q, {"z": z})

    def surr(theta, psi_, z):
        return one(theta, psi_, z)[1]

    th, ps = jnp.asarray(THETA0, jnp.float32), jnp.asarray(psi, jnp.float32)
    values = jax.vmap(lambda z: one(th, ps, z)[0])(BATCHES)
    g_theta, g_psi = jax.vmap(lambda z: jax.grad(surr, argnums=(0, 1))(th, ps, z))(BATCHES)
    w = np.exp(_lsm(np.asarray(psi)))[np.asarray(BATCHES)].prod(1)
    return (float((w * np.asarray(values, np.float64)).sum()), (w[:, None] * np.asarray(g_theta, np.float64)).sum(0),
            (w[:, None] * np.asarray(g_psi, np.float64)).sum(0))


def _num_grad(f, x, h=1e-6):
    return np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in np.eye(len(x))])


def _kl(psi):
    lq = _lsm(psi)
    return float((np.exp(lq) * (lq - _log_q_star())).sum())


def _log_z(theta=THETA0, log_l=LOG_L) -> float:
    return float(np.log(np.exp(_lsm(theta) + log_l).sum()))


def test_elbo_is_unbiased_for_the_elbo_and_its_gradient():
    def neg_elbo(psi):
        lq = _lsm(psi)
        return float(-(np.exp(lq) * (_lsm(THETA0) + LOG_L - lq)).sum())

    ev, gt, gp = expected(ptn.infer.ELBO(N))
    q = np.exp(_lsm(PSI0))
    assert abs(ev - neg_elbo(PSI0)) < TOL
    assert np.allclose(gp, _num_grad(neg_elbo, PSI0), atol=TOL)
    assert np.allclose(gt, -_num_grad(lambda th: float((q * _lsm(th)).sum()), THETA0), atol=TOL)


def test_one_and_two_sampler_are_unbiased_for_the_marginal_gradient_with_the_exact_sampler():
    """(3.17) and (3.23) with Q = Q_*: every weight is Z, so the value is -log Z on every batch and the expected
    gradient is -grad_theta log Z (Fisher's identity); (3.23)'s train sampler is any distribution (here q_psi)."""
    target = -_num_grad(_log_z, THETA0)
    ev, gt, gp = expected(ptn.infer.OneSampler(N), psi=_log_q_star())
    assert abs(ev + _log_z()) < TOL and np.allclose(gt, target, atol=TOL) and np.allclose(gp, 0.0)

    class Fixed(ptn.infer.TwoSampler):
        """TwoSampler.surrogate on two given batches: the inference batch of Q_* (every weight Z), then the
        enumerated train batch of q_psi."""

        def from_particles(self, log_p, log_q, values):
            z0 = jnp.zeros(N, jnp.int32)
            inference = (jnp.asarray(_lsm(THETA0) + LOG_L, jnp.float32)[z0], jnp.asarray(_log_q_star(),
                                                                                         jnp.float32)[z0], {})
            batches = iter([inference, (log_p, log_q, values)])
            self.particles = lambda *a, **k: next(batches)
            return self.surrogate(jax.random.PRNGKey(0), {}, None, None)

    ev, gt, gp = expected(Fixed(None, N))
    assert abs(ev + _log_z()) < TOL and np.allclose(gt, target, atol=TOL) and np.allclose(gp, 0.0)


def test_two_sampler_surrogate_draws_both_batches_from_programs():
    """TwoSampler.surrogate on a program: the inference and train guides both run through the step runner."""
    loss = ptn.infer.TwoSampler(_Guide(), 64)
    value, surr = loss.surrogate(jax.random.PRNGKey(0), {"plan_logit": jnp.float32(0.0)}, _Plan(), _Guide(),
                                 jnp.int32(2), jnp.int32(0))
    assert abs(float(value) + _plan_log_z()) < 0.2 and np.isfinite(float(surr))


def test_sampler_policy_gradient_is_unbiased_for_the_reverse_kl():
    ev, gt, gp = expected(ptn.infer.SamplerPolicyGradient(N))
    assert np.allclose(gp, _num_grad(_kl, PSI0), atol=TOL)
    assert abs(ev - (_kl(PSI0) - _log_z())) < TOL
    assert np.allclose(gt, 0.0)


def test_r1zero_with_and_without_baseline_against_the_exact_expectations():
    q = np.exp(_lsm(PSI0))
    r = _lsm(THETA0) + LOG_L - _lsm(PSI0)
    g_theta = -_num_grad(lambda th: float((q * (_lsm(th) + LOG_L)).sum()), THETA0)
    g_psi = -_num_grad(lambda ps: float((np.exp(_lsm(ps)) * r).sum()), PSI0)
    for baseline in (False, True):
        ev, gt, gp = expected(ptn.infer.R1Zero(N, baseline=baseline))
        assert abs(ev + float((q * r).sum())) < TOL, baseline
        assert np.allclose(gt, g_theta, atol=TOL), baseline
        assert np.allclose(gp, g_psi, atol=TOL), baseline


def _grpo_by_hand(z, theta, psi, advantage, clip):
    """(5.17) / (5.18) element by element in numpy: the gradient in theta of -(1/n) sum_i min(rho_i A_i, ...)."""
    r = REWARD[z]
    mean = r.mean()
    a = (r - mean) / (r.std() + 1e-6) if advantage == "group" else (r / mean if mean != 0 else 0 * r)
    lq = _lsm(psi)[z]
    grad = np.zeros(K)
    for i in range(len(z)):
        rho = np.exp(_lsm(theta)[z[i]] - lq[i])
        dlogp = np.eye(K)[z[i]] - np.exp(_lsm(theta))  # grad_theta log softmax(theta)_z
        active = clip is None or rho * a[i] <= np.clip(rho, 1 - clip, 1 + clip) * a[i]
        if clip is not None and not active and not (1 - clip < rho < 1 + clip):
            continue  # the clipped branch is flat in theta
        grad -= rho * a[i] * dlogp / len(z)
    return grad


def test_grpo_gradient_matches_the_formula_written_by_hand():
    th = jnp.asarray(THETA0, jnp.float32)
    for advantage, clip in itertools.product(("ratio", "group"), (None, 0.2)):
        loss = ptn.infer.GRPO(lambda z: jnp.asarray(REWARD, jnp.float32)[z], N, clip_eps=clip, advantage=advantage)

        def surr(theta, z, loss=loss):
            log_p = jax.nn.log_softmax(theta)[z]
            log_q = jax.nn.log_softmax(jnp.asarray(PSI0, jnp.float32))[z]
            return loss.from_particles(log_p, log_q, {"z": z})

        # compiled, as training runs it (a batch of equal rewards, e.g. z = (2, 2, 2), once gave gradients of
        # -0.035..0.051 here where the formula gives 0: the compiled mean of equal rewards is off by an ulp)
        vals = jax.jit(jax.vmap(lambda z, surr=surr: surr(th, z)[0]))(BATCHES)
        grads = jax.jit(jax.vmap(lambda z, surr=surr: jax.grad(lambda t: surr(t, z)[1])(th)))(BATCHES)
        for b, z in enumerate(np.asarray(BATCHES)):
            want = _grpo_by_hand(z, THETA0, PSI0, advantage, clip)
            assert np.allclose(np.asarray(grads[b]), want, atol=TOL), (advantage, clip, z)
            assert abs(float(vals[b]) + REWARD[z].mean()) < TOL


def test_grpo_group_advantages_of_equal_rewards_are_zero_compiled():
    loss = ptn.infer.GRPO(lambda z: z, N)
    adv = jax.jit(loss.advantages)
    for v, n in [(0.1, 3), (0.1, 7), (0.3, 12), (0.9, 5), (0.9, 6)]:  # each gave 0.007-0.1 before the tie rule
        assert np.array_equal(np.asarray(adv(jnp.full(n, v, jnp.float32))), np.zeros(n))


def _torch_particles(z, theta, psi, log_l):
    idx = torch.tensor(z)
    lp = torch.log_softmax(theta, 0)[idx] + torch.as_tensor(log_l)[idx]
    lq = torch.log_softmax(psi, 0)[idx]
    return Particles(lp, lq, {"z": idx}, params=[theta])


@pytest.mark.parametrize("name", ["ELBO", "OneSampler", "SamplerPolicyGradient", "R1Zero", "R1ZeroBaseline", "GRPO"])
def test_jax_losses_equal_the_torch_objectives_on_the_same_samples(name):
    """Same parameters, same batch of samples: value and gradients (theta and psi) within 1e-5 on all 27 batches.
    The torch side has no ELBO objective: its ELBO is the value E[log p - log q] the torch SVI reports."""
    torch_obj, jax_loss = {
        "ELBO": (None, ptn.infer.ELBO(N)),
        "OneSampler": (ptt.OneSampler(N), ptn.infer.OneSampler(N)),
        "SamplerPolicyGradient": (ptt.SamplerPolicyGradient(N), ptn.infer.SamplerPolicyGradient(N)),
        "R1Zero": (ptt.R1Zero(N), ptn.infer.R1Zero(N)),
        "R1ZeroBaseline": (ptt.R1Zero(N, baseline=True), ptn.infer.R1Zero(N, baseline=True)),
        "GRPO": (ptt.GRPO(lambda z: torch.as_tensor(REWARD)[z], N),
                 ptn.infer.GRPO(lambda z: jnp.asarray(REWARD, jnp.float32)[z], N)),
    }[name]
    ll = jnp.asarray(LOG_L, jnp.float32)

    def jx(theta, psi, z):
        return jax_loss.from_particles(jax.nn.log_softmax(theta)[z] + ll[z], jax.nn.log_softmax(psi)[z], {"z": z})

    th, ps = jnp.asarray(THETA0, jnp.float32), jnp.asarray(PSI0, jnp.float32)
    values = jax.vmap(lambda z: jx(th, ps, z)[0])(BATCHES)
    grads = jax.vmap(lambda z: jax.grad(lambda t, p: jx(t, p, z)[1], argnums=(0, 1))(th, ps))(BATCHES)
    for b, z in enumerate(itertools.product(range(K), repeat=N)):
        value, g = float(values[b]), (grads[0][b], grads[1][b])
        theta = torch.tensor(THETA0, requires_grad=True)
        psi = torch.tensor(PSI0, requires_grad=True)
        pt = _torch_particles(z, theta, psi, LOG_L)
        if torch_obj is None:
            f = (pt.log_p - pt.log_q).detach()
            assert abs(value + float(f.mean())) < 1e-5
            continue
        t_value, t_surr = torch_obj.from_particles(pt)
        t_gt, t_gp = torch.autograd.grad(t_surr, [theta, psi], allow_unused=True)
        assert abs(value - float(t_value)) < 1e-5, z
        for got, want in ((g[0], t_gt), (g[1], t_gp)):
            want = np.zeros(K) if want is None else want.numpy()
            assert np.allclose(np.asarray(got), want, atol=1e-5), (name, z, np.asarray(got), want)


def test_wrong_estimators_fail_the_exact_checks():
    """(3.25) with the baseline normalised by 1/n instead of 1/(n - 1), and (3.17) without self-normalising the
    weights, miss the exact expectations by far more than the tolerance."""

    class OneOverN(ptn.infer.SamplerPolicyGradient):
        def from_particles(self, log_p, log_q, values):
            value, surr = super().from_particles(log_p, log_q, values)
            return value, surr * (N - 1) / N

    _, _, gp = expected(OneOverN(N))
    assert not np.allclose(gp, _num_grad(_kl, PSI0), atol=1e-3)

    class Unnormalised(ptn.infer.OneSampler):
        def from_particles(self, log_p, log_q, values):
            w = jnp.exp(jax.lax.stop_gradient(log_p - log_q))
            return -jnp.log(w.mean()), -jnp.sum(jax.lax.stop_gradient(w) * log_p) / N

    _, gt, _ = expected(Unnormalised(N), psi=_log_q_star())
    assert not np.allclose(gt, -_num_grad(_log_z, THETA0), atol=1e-3)


# ---------------------------------------------------------------------------------------------- programs
PLAN = 0.3
Q_LOGITS = np.array([[1.0, 0.0, -1.0], [-1.0, 0.5, 1.5]])
A_LOGITS = np.array([[2.0, 0.0, -2.0], [-1.0, 1.0, 0.0]])
Q_OBS, A_OBS = 2, 0


def _plan_log_joint() -> np.ndarray:
    return (np.log([1 - PLAN, PLAN]) + np.array([_lsm(r) for r in Q_LOGITS])[:, Q_OBS]
            + np.array([_lsm(r) for r in A_LOGITS])[:, A_OBS])


def _plan_log_z() -> float:
    return float(np.log(np.exp(_plan_log_joint()).sum()))


class _Plan(ptn.Program):
    """A user's program (tests/test_engine_matrix.py's JaxPlanThenAnswer): plan, question, answer."""

    max_steps = 1

    def step(self, state, t, question, answer):
        n = ptn.particles()
        z = ptn.sample("plan", nd.Bernoulli(jnp.full((n,), PLAN))).astype(jnp.int32)
        ptn.observe("question", nd.Categorical(logits=jnp.asarray(Q_LOGITS)[z]), question)
        ptn.observe("answer", nd.Categorical(logits=jnp.asarray(A_LOGITS)[z]), answer)
        return jnp.ones(n, bool)


class _Guide(ptn.Program):
    """A user's guide program: the plan from a Bernoulli with one learnable logit (torch twin: PlanGuide)."""

    max_steps = 1

    def step(self, state, t, question, answer):
        logit = numpyro.param("plan_logit", jnp.zeros(()))
        ptn.sample("plan", nd.Bernoulli(logits=jnp.broadcast_to(logit, (ptn.particles(),))))
        return jnp.ones(ptn.particles(), bool)


def test_program_particles_are_the_exact_log_joint_and_guide_log_prob():
    """The batch a loss reads off a program: log p is the enumerated log joint at each particle's plan, log q
    the guide's Bernoulli, all particles in one batch."""
    logit = 0.4
    log_p, log_q, values = ptn.infer.ELBO(16).particles(jax.random.PRNGKey(3), {"plan_logit": jnp.float32(logit)},
                                                         _Plan(), _Guide(), jnp.int32(Q_OBS), jnp.int32(A_OBS))
    z = np.asarray(values["plan"]).reshape(16).astype(int)
    assert 0 < z.sum() < 16
    q1 = 1 / (1 + np.exp(-logit))
    assert np.allclose(np.asarray(log_p), _plan_log_joint()[z], atol=1e-5)
    assert np.allclose(np.asarray(log_q), np.log(np.where(z == 1, q1, 1 - q1)), atol=1e-5)


def test_numpyro_svi_trains_a_guide_program_to_the_exact_posterior():
    """numpyro.infer.SVI(program, guide program, Adam, loss): (3.25) drives the guide's plan probability to the
    exact posterior p(plan = 1 | q, a) = 0.2543 within 0.02, and its value to -log p(q, a) within 0.01 (the weights
    are constant there); the ELBO moves it from 0.5 to within 0.05 of the posterior."""
    lj = _plan_log_joint()
    post = float(np.exp(lj[1] - np.log(np.exp(lj).sum())))
    svi = numpyro.infer.SVI(_Plan(), _Guide(), numpyro.optim.Adam(0.1), ptn.infer.SamplerPolicyGradient(32))
    res = svi.run(jax.random.PRNGKey(0), 300, jnp.int32(Q_OBS), jnp.int32(A_OBS), progress_bar=False)
    got = float(jax.nn.sigmoid(res.params["plan_logit"]))
    assert abs(got - post) < 0.02, (got, post)
    assert abs(float(res.losses[-1]) + _plan_log_z()) < 0.01
    svi = numpyro.infer.SVI(_Plan(), _Guide(), numpyro.optim.Adam(0.05), ptn.infer.ELBO(32))
    res = svi.run(jax.random.PRNGKey(1), 300, jnp.int32(Q_OBS), jnp.int32(A_OBS), progress_bar=False)
    got = float(jax.nn.sigmoid(res.params["plan_logit"]))
    assert abs(got - post) < 0.05, (got, post)


def test_a_guide_that_misses_a_latent_site_is_refused_naming_it():
    class Empty(ptn.Program):
        max_steps = 1

        def step(self, state, t, question, answer):
            numpyro.param("plan_logit", jnp.zeros(()))
            return jnp.ones(ptn.particles(), bool)

    with pytest.raises(SiteMismatchError, match="plan"):
        ptn.infer.ELBO(4).loss(jax.random.PRNGKey(0), {"plan_logit": jnp.float32(0.0)}, _Plan(), Empty(),
                               jnp.int32(Q_OBS), jnp.int32(A_OBS))


class _Chain(ptn.Program):
    """A three-step user program: z_t ~ Bernoulli(0.8 if z_{t-1} else 0.3), x_t ~ Bernoulli(0.9 if z_t else 0.2)."""

    max_steps = 3

    def init(self, state, x):
        state["prev"] = jnp.zeros(ptn.particles(), jnp.int32)

    def step(self, state, t, x):
        n = ptn.particles()
        z = ptn.sample("z", nd.Bernoulli(jnp.where(state["prev"] == 1, 0.8, 0.3))).astype(jnp.int32)
        ptn.observe("x", nd.Bernoulli(jnp.where(z == 1, 0.9, 0.2)), jnp.broadcast_to(x[t], (n,)).astype(jnp.float32))
        state["prev"] = z
        return jnp.broadcast_to(t == 2, (n,))


class _ChainGuide(ptn.Program):
    """Its guide: z_t from a Bernoulli with a learnable logit per (t, z_{t-1}) (the posterior's form)."""

    max_steps = 3

    def init(self, state, x):
        state["prev"] = jnp.zeros(ptn.particles(), jnp.int32)

    def step(self, state, t, x):
        w = numpyro.param("w", jnp.zeros((3, 2)))
        state["prev"] = ptn.sample("z", nd.Bernoulli(logits=w[t][state["prev"]])).astype(jnp.int32)
        return jnp.broadcast_to(t == 2, (ptn.particles(),))


def test_svi_on_a_multi_step_program_reaches_the_exact_marginal():
    """Three steps (sites z_0..z_2 in the whole trace): (3.25) trains the guide program until every weight is
    p(x), so its value -mean R = KL - log p(x) reaches -log p(x) (enumerated over the 8 paths) within 0.01."""
    x = np.array([0, 1, 1])
    log_joint = []
    for zs in itertools.product((0, 1), repeat=3):
        lp, prev = 0.0, 0
        for t, z in enumerate(zs):
            p, e = (0.8 if prev else 0.3), (0.9 if z else 0.2)
            lp += np.log(p if z else 1 - p) + np.log(e if x[t] else 1 - e)
            prev = z
        log_joint.append(lp)
    log_z = float(np.log(np.exp(log_joint).sum()))
    tr = numpyro.handlers.trace(numpyro.handlers.seed(_Chain(), 0)).get_trace(jnp.asarray(x))
    assert [k for k, s in tr.items() if s["type"] == "sample"] == ["z_0", "x_0", "z_1", "x_1", "z_2", "x_2"]
    svi = numpyro.infer.SVI(_Chain(), _ChainGuide(), numpyro.optim.Adam(0.1), ptn.infer.SamplerPolicyGradient(64))
    res = svi.run(jax.random.PRNGKey(0), 400, jnp.asarray(x), progress_bar=False)
    assert abs(float(np.mean(res.losses[-20:])) + log_z) < 0.01, (float(np.mean(res.losses[-20:])), -log_z)
