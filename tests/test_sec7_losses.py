"""The sampler loss of Section 7 against exact answers: on a toy with K = 3 thoughts the expected gradient of
(7.2) (plain policy gradient, as printed) and of (3.25) (leave-one-out baseline, our default), taken over every
n-tuple of draws, equals the hand-computed gradient of KL(Q || Q_*); a baseline without the 1/(n-1) correction
does not. One draw's gradient of (7.2) and of (7.1) against their closed forms."""

from __future__ import annotations

import itertools

import pytest
import torch

from ppl_thought.errors import ConfigError
from ppl_thought.experiments.sec7 import Sec7Config
from ppl_thought.experiments.sec7_losses import latent_surrogate, sampler_surrogate

PSI = torch.tensor([0.3, -0.5, 0.9], dtype=torch.float64)  # Q = softmax(psi)
LOG_JOINT = torch.tensor([-1.2, -0.4, -2.5], dtype=torch.float64)  # log P(y, x_r | x), unnormalised posterior


def _kl_gradient_by_hand() -> torch.Tensor:
    """d/dpsi_k KL(Q || Q_*) = Q_k (log Q_k - log P_k - KL0), KL0 = sum_y Q_y (log Q_y - log P_y) (softmax)."""
    q = torch.softmax(PSI, 0)
    d = torch.log(q) - LOG_JOINT
    return q * (d - (q * d).sum())


def _expected_gradient(n: int, surrogate) -> torch.Tensor:
    """E over all K^n draws (probability prod_i Q(y_i)) of the gradient of the surrogate of one example."""
    total = torch.zeros(3, dtype=torch.float64)
    for draw in itertools.product(range(3), repeat=n):
        psi = PSI.clone().requires_grad_(True)
        log_q = torch.log_softmax(psi, 0)
        y = torch.tensor(draw)
        (grad,) = torch.autograd.grad(surrogate(LOG_JOINT[y][None], log_q[y][None]).sum(), psi)
        total += torch.exp(torch.log_softmax(PSI, 0)[y].sum()) * grad
    return total


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("baseline", ["none", "loo"])
def test_sampler_loss_expected_gradient_is_the_kl_gradient(n, baseline):
    exact = _kl_gradient_by_hand()
    got = _expected_gradient(n, lambda lp, lq: sampler_surrogate(lp, lq, baseline))
    assert torch.allclose(got, exact, atol=1e-12), (got, exact)


def test_a_mean_baseline_without_the_n_minus_1_correction_is_biased():
    """-1/n sum_i (R_i - mean_j R_j) log Q_i has expectation (n-1)/n times the KL gradient: the test above
    would catch it."""
    def wrong(lp, lq):
        r = (lp - lq).detach()
        return -((r - r.mean(-1, keepdim=True)) * lq).sum(-1) / lq.shape[-1]
    exact = _kl_gradient_by_hand()
    got = _expected_gradient(2, wrong)
    assert torch.allclose(got, exact / 2, atol=1e-12) and not torch.allclose(got, exact, atol=1e-3)


def test_one_draw_gradients_match_their_closed_forms():
    """(7.2) as printed, draws y = (0, 2, 2): grad_psi = -1/n sum_i R_i (e_{y_i} - Q), R_i = log P(y_i) - log Q(y_i).
    (7.1): grad wrt log P(Y_i X_r | X) is -w_i, w = softmax(log P - log Q) (Q detached: no gradient to psi)."""
    y = torch.tensor([0, 2, 2])
    psi = PSI.clone().requires_grad_(True)
    log_q = torch.log_softmax(psi, 0)
    (g,) = torch.autograd.grad(sampler_surrogate(LOG_JOINT[y][None], log_q[y][None], "none").sum(), psi)
    q = torch.softmax(PSI, 0)
    r = LOG_JOINT[y] - torch.log(q[y])
    hand = -(r[:, None] * (torch.eye(3, dtype=torch.float64)[y] - q)).sum(0) / 3
    assert torch.allclose(g, hand, atol=1e-12)
    lp = LOG_JOINT[y].clone().requires_grad_(True)
    psi = PSI.clone().requires_grad_(True)
    lq = torch.log_softmax(psi, 0)[y]
    g_lp, g_psi = torch.autograd.grad(latent_surrogate(lp[None], lq[None]).sum(), (lp, psi), allow_unused=True)
    w = torch.softmax(LOG_JOINT[y] - torch.log(q[y]), 0)
    assert torch.allclose(g_lp, -w, atol=1e-12) and (g_psi is None or torch.all(g_psi == 0))


def test_bad_sampler_loss_settings_are_named():
    with pytest.raises(ConfigError, match=r"sampler_loss must be 'loo'.*got 'plain'"):
        Sec7Config(sampler_loss="plain")
    lp = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match=r"sampler baseline must be .*got 'mean'"):
        sampler_surrogate(lp, lp, "mean")
    with pytest.raises(ConfigError, match=r"needs n >= 2 .*baseline='none'"):
        sampler_surrogate(torch.zeros(1, 1), torch.zeros(1, 1), "loo")
    assert torch.equal(sampler_surrogate(torch.zeros(1, 1), torch.zeros(1, 1), "none"), torch.zeros(1))


def test_sampler_loss_option_reaches_the_training_step(monkeypatch):
    """Sec7Config.sampler_loss picks the surrogate of the training step: 'paper' -> (7.2) without baseline."""
    from tqdm.auto import tqdm

    from ppl_thought.data.query_response import permutation_choice_task
    from ppl_thought.experiments import sec7

    calls = []
    original = sec7.sampler_surrogate

    def spy(lp, lq, baseline="loo"):
        calls.append(baseline)
        return original(lp, lq, baseline)

    monkeypatch.setattr(sec7, "sampler_surrogate", spy)
    task = permutation_choice_task(m=3, query_len=2, num_choices=3)
    q, _, r = task.sample(8, generator=torch.Generator().manual_seed(0))
    for mode in ("paper", "loo"):
        cfg = Sec7Config(m=3, query_len=2, num_choices=3, d_model=16, n_layers=1, n_heads=2, pretrain_steps=0, steps=1,
                         batch=4, n=2, num_test=8, num_eval_curve=8, eval_every=1, sampler_loss=mode)
        out = sec7.Sec7(task, cfg, seed=0).train("expl", (q, r), (q, r), tqdm(disable=True))
        assert torch.isfinite(torch.as_tensor(out["final"]["loss"]))
    assert calls == ["none", "loo"]
