"""The training objectives' values and gradients in expectation, computed exactly (issue 42, item 4).

A tiny problem whose every batch can be enumerated: a latent z in {0, 1, 2}, a model (policy) p_theta(z, x) =
softmax(theta)_z L_z, a guide q_psi(z) = softmax(psi)_z. For n particles drawn i.i.d. from q, the expectation of any
function of the batch is the sum over all 3^n batches weighted by prod_i q(z_i), so the expected gradient of each
objective's surrogate is computed exactly (float64) and compared with the gradient of the quantity the paper says
it estimates:

* (3.25) ``SamplerPolicyGradient``: E grad_psi = grad_psi KL(Q || Q_*), E value = KL(Q || Q_*) - log Z;
* (5.14)-(5.15) ``R1Zero`` (with and without the baseline): E grad_theta = -E_Q grad_theta log p,
  E grad_psi = -sum_z grad_psi Q(z) U(R(z)), E value = -E_Q R;
* Remark 3.10 ``SeparatePolicy``: E grad_theta = -grad_theta E_{pi_theta}[R], E value = -E_{pi_theta}[R];
* (5.17) / (5.18) ``GRPO``: the surrogate's gradient on a fixed batch against the formula written out by hand
  (ratio and group advantages, with and without clipping).

Each unbiasedness check is shown to fail for the classic wrong estimator (the baseline's 1/n in place of
1/(n - 1), or the importance ratio dropped): ``test_wrong_estimators_fail_the_exact_checks``.
"""

from __future__ import annotations

import itertools

import torch

from ppl_thought.training import GRPO, R1Zero, SamplerPolicyGradient, SeparatePolicy
from ppl_thought.training.objectives import Particles

K, N = 3, 3
THETA0 = torch.tensor([0.3, -0.5, 0.9], dtype=torch.float64)
PSI0 = torch.tensor([-0.2, 0.4, 0.1], dtype=torch.float64)
LOG_L = torch.tensor([-0.7, -2.0, -0.1], dtype=torch.float64)  # log likelihood of x given z
REWARD = torch.tensor([1.0, 0.0, 2.5], dtype=torch.float64)


def batch(z: tuple[int, ...], theta: torch.Tensor, psi: torch.Tensor, log_l: torch.Tensor = LOG_L) -> Particles:
    idx = torch.tensor(z)
    log_p = torch.log_softmax(theta, 0)[idx] + log_l[idx]
    log_q = torch.log_softmax(psi, 0)[idx]
    return Particles(log_p, log_q, {"z": idx}, params=[theta])


def expected(objective, n: int = N, log_l: torch.Tensor = LOG_L, use_surrogate: bool = False):
    """(E value, E grad_theta, E grad_psi) of ``objective`` over n i.i.d. draws of q_psi, by enumeration."""
    q = torch.softmax(PSI0, 0)
    ev, gt, gp = 0.0, torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for z in itertools.product(range(K), repeat=n):
        theta, psi = THETA0.clone().requires_grad_(), PSI0.clone().requires_grad_()
        pt = batch(z, theta, psi, log_l)
        if use_surrogate:  # objectives that draw their own particles: hand them this batch
            objective.particles = lambda *a, _pt=pt, **k: _pt
            value, surr = objective.surrogate(None, None)
        else:
            value, surr = objective.from_particles(pt)
        g_theta, g_psi = torch.autograd.grad(surr, [theta, psi], allow_unused=True)
        w = float(torch.prod(q[list(z)]))
        ev += w * float(value)
        gt += w * (g_theta if g_theta is not None else 0.0)
        gp += w * (g_psi if g_psi is not None else 0.0)
    return ev, gt, gp


def _jac(f, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    return torch.autograd.grad(f(x), x)[0]


def _log_q_star() -> torch.Tensor:
    log_joint = torch.log_softmax(THETA0, 0) + LOG_L
    return log_joint - torch.logsumexp(log_joint, 0)


def test_sampler_policy_gradient_is_unbiased_for_the_reverse_kl():
    """(3.25): E grad_psi L = grad_psi KL(Q || Q_*) exactly; E value = KL - log Z; P gets no gradient."""
    ev, gt, gp = expected(SamplerPolicyGradient(N))
    log_joint = torch.log_softmax(THETA0, 0) + LOG_L
    log_z = torch.logsumexp(log_joint, 0)

    def kl(psi):
        lq = torch.log_softmax(psi, 0)
        return (lq.exp() * (lq - _log_q_star())).sum()

    assert torch.allclose(gp, _jac(kl, PSI0), atol=1e-12)
    assert abs(ev - (float(kl(PSI0)) - float(log_z))) < 1e-12
    assert torch.equal(gt, torch.zeros(K, dtype=torch.float64))


def _r1zero_targets():
    q = torch.softmax(PSI0, 0)
    log_p = torch.log_softmax(THETA0, 0) + LOG_L
    r = (log_p - torch.log_softmax(PSI0, 0)).detach()  # R(z) = log p(z, x) - log Q(z | x), held fixed (U)
    g_theta = -_jac(lambda th: (q * (torch.log_softmax(th, 0) + LOG_L)).sum(), THETA0)
    g_psi = -_jac(lambda ps: (torch.softmax(ps, 0) * r).sum(), PSI0)
    return -float((q * r).sum()), g_theta, g_psi


def test_r1zero_with_and_without_baseline_against_the_exact_expectations():
    """(5.14)-(5.15): both forms of the policy gradient have the same (exact) expectation; so has the value."""
    value, g_theta, g_psi = _r1zero_targets()
    for baseline in (False, True):
        ev, gt, gp = expected(R1Zero(N, baseline=baseline))
        assert abs(ev - value) < 1e-12, baseline
        assert torch.allclose(gt, g_theta, atol=1e-12), baseline
        assert torch.allclose(gp, g_psi, atol=1e-12), baseline


def test_separate_policy_is_unbiased_for_the_policy_gradient():
    """Remark 3.10: samples of pi^boxminus (the guide), importance ratios pi_theta / pi^boxminus and a group
    baseline give E grad_theta L = -grad_theta E_{pi_theta}[R] and E value = -E_{pi_theta}[R]."""
    flat = torch.zeros(K, dtype=torch.float64)  # a policy: p_theta(z) = softmax(theta)_z, no likelihood factor
    obj = SeparatePolicy(lambda z: REWARD[z], N, train_sampler=False)
    ev, gt, _ = expected(obj, log_l=flat, use_surrogate=True)
    target = lambda th: -(torch.softmax(th, 0) * REWARD).sum()  # noqa: E731
    assert abs(ev - float(target(THETA0))) < 1e-12
    assert torch.allclose(gt, _jac(target, THETA0), atol=1e-12)


def _grpo_by_hand(pt: Particles, r: torch.Tensor, theta: torch.Tensor, advantage: str, clip: float | None):
    """(5.17) / (5.18) written out element by element, without the library's helpers."""
    n = len(r)
    mean = sum(float(v) for v in r) / n
    if advantage == "group":
        std = (sum((float(v) - mean) ** 2 for v in r) / n) ** 0.5
        a = [(float(v) - mean) / (std + 1e-6) for v in r]
    else:
        a = [float(v) / mean if mean != 0 else 0.0 for v in r]
    total = 0.0
    for i in range(n):
        rho = torch.exp(pt.log_p[i] - pt.log_q[i].detach())
        term = rho * a[i]
        if clip is not None:
            term = torch.minimum(term, rho.clamp(1 - clip, 1 + clip) * a[i])
        total = total + term
    return torch.autograd.grad(-total / n, theta)[0]


def test_grpo_gradient_matches_the_formula_written_by_hand():
    """(5.17) ratio and (5.18) group advantages, clipped and not, on every batch of the enumerable problem; the
    clipped surrogate has zero gradient where every ratio is clipped on the side of its advantage."""
    flat = torch.zeros(K, dtype=torch.float64)
    for advantage, clip in itertools.product(("ratio", "group"), (None, 0.2)):
        obj = GRPO(lambda z: REWARD[z], N, clip_eps=clip, advantage=advantage)
        for z in itertools.product(range(K), repeat=N):
            theta, psi = THETA0.clone().requires_grad_(), PSI0.clone().requires_grad_()
            pt = batch(z, theta, psi, flat)
            value, surr = obj.from_particles(pt)
            got = torch.autograd.grad(surr, theta)[0]
            want = _grpo_by_hand(batch(z, theta, psi, flat), REWARD[list(z)], theta, advantage, clip)
            assert torch.allclose(got, want, atol=1e-12), (advantage, clip, z)
            assert abs(float(value) + float(REWARD[list(z)].mean())) < 1e-12
    # every ratio far above 1 + eps with positive advantages: the clipped objective is flat in theta
    theta = torch.tensor([3.0, -3.0, -3.0], dtype=torch.float64, requires_grad=True)
    pt = Particles(torch.log_softmax(theta, 0)[[0, 0]], torch.log(torch.tensor([0.1, 0.1], dtype=torch.float64)),
                   {"z": torch.tensor([0, 0])})
    obj = GRPO(lambda z: torch.tensor([1.0, 1.0], dtype=torch.float64), 2, advantage="ratio")
    assert torch.equal(torch.autograd.grad(obj.from_particles(pt)[1], theta)[0], torch.zeros(3, dtype=torch.float64))


def test_wrong_estimators_fail_the_exact_checks():
    """The checks above have teeth: the baseline normalised by 1/n instead of 1/(n - 1) (3.25), and the policy
    gradient of Remark 3.10 without its importance ratio, miss the exact expectations by far more than 1e-12."""

    class OneOverN(SamplerPolicyGradient):
        def from_particles(self, pt, *args, **kwargs):
            value, surr = super().from_particles(pt, *args, **kwargs)
            return value, surr * (pt.n - 1) / pt.n

    _, _, gp = expected(OneOverN(N))

    def kl(psi):
        lq = torch.log_softmax(psi, 0)
        return (lq.exp() * (lq - _log_q_star())).sum()

    assert not torch.allclose(gp, _jac(kl, PSI0), atol=1e-3)

    class NoRatio(SeparatePolicy):
        def surrogate(self, model, guide, *args, **kwargs):
            pt = self.particles(model, guide)
            r = self.reward(pt.values[self.site])
            return -r.mean(), -((r - r.mean()) * pt.log_p).sum() / (pt.n - 1)

    flat = torch.zeros(K, dtype=torch.float64)
    _, gt, _ = expected(NoRatio(lambda z: REWARD[z], N, train_sampler=False), log_l=flat, use_surrogate=True)
    target = lambda th: -(torch.softmax(th, 0) * REWARD).sum()  # noqa: E731
    assert not torch.allclose(gt, _jac(target, THETA0), atol=1e-3)
