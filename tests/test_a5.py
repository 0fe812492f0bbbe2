"""The A5 "cups and ball" HMM of App. E.1: (E.1), the reveal knob, exact cross-entropy."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import ppl_thought.data as data
from ppl_thought.data.a5 import SIGMA_0, SIGMA_1, SWAP_INDEX, A5Task, a5_hmm, compose, hidden_state


def _is_even(p: tuple[int, ...]) -> bool:
    inversions = sum(1 for i, j in itertools.combinations(range(len(p)), 2) if p[i] > p[j])
    return inversions % 2 == 0


def test_exports():
    assert data.a5_hmm is a5_hmm and data.A5Task is A5Task


def test_generators_span_a5():
    assert SIGMA_0 == (2, 1, 4, 3, 5) and SIGMA_1 == (3, 2, 5, 4, 1)  # (1 2)(3 4) and (1 3 5)
    group = {tuple(range(1, 6))}
    frontier = list(group)
    while frontier:
        g = frontier.pop()
        for s in (SIGMA_0, SIGMA_1):
            h = compose(s, g)
            if h not in group:
                group.add(h)
                frontier.append(h)
    assert len(group) == 60
    assert all(_is_even(g) for g in group)  # inside A_5, hence all of A_5


def test_F_composition():
    F = A5Task.F
    assert F([]) == 1
    assert F([0]) == 2 and F([1]) == 3
    assert F([0, 1]) == SIGMA_1[SIGMA_0[0] - 1] == 2  # sigma_1 o sigma_0 (1)
    assert F([1, 0]) == SIGMA_0[SIGMA_1[0] - 1] == 4  # sigma_0 o sigma_1 (1)
    bits = [1, 1, 0, 1, 0, 0, 1]
    perm = compose(*[(SIGMA_0, SIGMA_1)[b] for b in reversed(bits)])
    assert F(bits) == perm[0]
    with pytest.raises(ValueError):
        F([2])


def test_hmm_structure_matches_appendix_e1():
    task = a5_hmm()
    hmm = task.hmm
    assert (hmm.num_states, hmm.num_observations) == (15, 7)
    assert ((hmm.B == 0) | (hmm.B == 1)).all()  # deterministic emissions
    assert ((hmm.A > 0).sum(-1) == 3).all()  # three successors per state
    assert sorted(hmm.A[0][hmm.A[0] > 0].tolist()) == [0.25, 0.25, 0.5]
    assert sorted(hmm.lam[hmm.lam > 0].tolist()) == [0.25, 0.25, 0.5]
    for i in range(15):
        v, w = hidden_state(i)
        emitted = int(hmm.B[i].argmax())
        assert emitted == (SWAP_INDEX[w] if w < 2 else v - 1)
    # the paper's numbers: every all-swap sequence has probability 4^{-T}; reveals have probability 1/2
    x = task.encode("s0 s1 s1 s0 s1")
    assert math.isclose(float(hmm.log_prob(x)), -5 * math.log(4), rel_tol=1e-12)
    pred = hmm.predictive(x)[-1]
    assert math.isclose(float(pred[:5].sum()), 0.5, rel_tol=1e-12)
    assert float(pred[task.F(task.swaps(x)) - 1]) == pytest.approx(0.5)


def test_revealed_element_is_F_of_swaps_so_far():
    task = a5_hmm()
    z, x = task.sample(200, 40, generator=torch.Generator().manual_seed(0), return_hidden=True)
    v = torch.tensor([[hidden_state(int(i))[0] for i in row] for row in z])
    w = torch.tensor([[hidden_state(int(i))[1] for i in row] for row in z])
    assert torch.equal(task.ball_position(x), v)  # v_t is determined by the observations
    reveals = 0
    for n in range(20):  # the slow, literal check of (E.1) on a few sequences
        for t in range(40):
            if w[n, t] == 2:
                reveals += 1
                assert int(x[n, t]) + 1 == int(v[n, t]) == task.F(task.swaps(x[n, :t]))
            else:
                assert int(x[n, t]) == SWAP_INDEX[int(w[n, t])]
    assert reveals > 100
    assert task.decode(x[0]).split() == [task.observable_tokens[i] for i in x[0].tolist()]
    assert torch.equal(task.encode(task.decode(x[0])), x[0])
    assert torch.equal(task.from_vocab_ids(task.to_vocab_ids(x)), x)


@pytest.mark.parametrize("r", [0.1, 0.5, 0.9])
def test_reveal_prob_knob(r):
    task = a5_hmm(reveal_prob=r)
    x = task.sample(500, 40, generator=torch.Generator().manual_seed(1))
    n = x.numel()
    frac = float((x < 5).double().mean())
    assert abs(frac - r) < 5 * math.sqrt(r * (1 - r) / n)
    s0, s1 = float((x == 5).double().mean()), float((x == 6).double().mean())
    assert abs(s0 - s1) < 5 * math.sqrt((1 - r) / 2 / n) * 2


def test_reveal_prob_extremes_and_validation():
    x = a5_hmm(0.0).sample(10, 20, generator=torch.Generator().manual_seed(2))
    assert (x >= 5).all()
    x = a5_hmm(1.0).sample(10, 20, generator=torch.Generator().manual_seed(2))
    assert (x == 0).all()  # the ball never moves from cup 1
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            a5_hmm(bad)


def test_exact_cross_entropy_forward_equals_brute_force():
    task = a5_hmm()
    g = torch.Generator().manual_seed(3)
    for T in (1, 2, 3, 4):
        x = task.sample(6, T, generator=g)
        x = torch.cat([x, x[:1].flip(-1)])  # a reversed sequence may be impossible
        fwd = task.hmm.log_prob(x)
        brute = task.hmm.brute_force_log_prob(x)
        assert torch.equal(torch.isneginf(fwd), torch.isneginf(brute))
        ok = torch.isfinite(fwd)
        torch.testing.assert_close(fwd[ok], brute[ok], rtol=1e-12, atol=1e-12)
        if ok.all():
            ce = task.exact_cross_entropy(x)
            assert math.isclose(ce, float((-brute / T).mean()), rel_tol=1e-12)
    # a wrong reveal is impossible
    bad = task.encode("s1 1")  # after s1 the ball is under cup 3
    assert torch.isneginf(task.hmm.log_prob(bad)) and torch.isneginf(task.hmm.brute_force_log_prob(bad))


def test_forward_equals_tracking_on_long_sequences():
    task = a5_hmm(0.3)
    x = task.sample(64, 200, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(task.hmm.log_prob(x), task.log_prob_by_tracking(x), rtol=1e-10, atol=1e-9)
    corrupted = x.clone()
    reveal = (corrupted[0] < 5).nonzero()[0, 0]
    corrupted[0, reveal] = (corrupted[0, reveal] + 1) % 5  # reveal the wrong cup
    assert torch.isneginf(task.hmm.log_prob(corrupted[0]))
    assert torch.isneginf(task.log_prob_by_tracking(corrupted[0]))


@pytest.mark.parametrize("r", [0.5, 0.2])
def test_entropy_rate(r):
    task = a5_hmm(r)
    H = task.entropy_rate
    assert math.isclose(H, -(1 - r) * math.log((1 - r) / 2) - r * math.log(r))
    est = task.entropy_rate_estimate(length=64, num_sequences=256, generator=torch.Generator().manual_seed(5))
    assert abs(est.estimate - H) < 5 * est.stderr
    x = task.sample(100, 32, generator=torch.Generator().manual_seed(6))
    assert abs(task.exact_cross_entropy(x) - H) < 0.05


def test_theorem_2_3_slow_thinking_form_of_a5():
    task = a5_hmm()
    product, prior = task.as_slow_thinking_parts()
    ids = task.hmm.observation_ids(product)
    x = task.encode("s1 s0 4")
    lifting = product.enumerate_lifting(ids[x].tolist())
    assert len(lifting) == 15**3
    tokens = torch.tensor([[1, *z] for z in lifting])  # <bos> = 1
    with torch.no_grad():
        logits, _ = prior(tokens)
    lp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None])[..., 0].sum(-1)
    total = float(torch.logsumexp(lp, 0))
    assert math.isclose(total, float(task.hmm.log_prob(x)), rel_tol=1e-5)
    assert math.isclose(total, math.log(1 / 4 * 1 / 4 * 1 / 2), rel_tol=1e-5)


def test_a5_hmm_refuses_a_reveal_prob_outside_0_1_with_a_config_error():
    """Found by the public sweep: a5_hmm(reveal_prob=nan) raised a bare ValueError."""
    from ppl_thought.errors import ConfigError

    for bad in (float("nan"), float("inf"), -0.1, 1.5, True):
        with pytest.raises(ConfigError, match="reveal_prob"):
            a5_hmm(reveal_prob=bad)
    assert a5_hmm(reveal_prob=1).reveal_prob == 1.0
