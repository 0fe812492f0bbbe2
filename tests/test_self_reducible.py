"""Self-reducible sampling with a weak CoT (cot-or-loop Section 5): exact counts, Definition 5.10, Lemma 5.11 (6)."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import torch
from scipy import stats

import ppl_thought.data as data
from ppl_thought.data.self_reducible import (
    CNF,
    WeakCoT,
    coordinatewise_median,
    count_by_sampling,
    expected_log_count_error,
    random_cnf,
    sample,
    sampler_log_law,
    self_reducible_curve,
    total_variation,
    tv_bound,
)
from ppl_thought.errors import (
    ArgumentTypeError,
    ConfigError,
    MalformedSequenceError,
    PPLThoughtError,
    TooLargeToEnumerateError,
    UnsatisfiableConstraintError,
)

T_VALUES = [1, 3, 5, 9, 17, 33]


def _brute_count(clauses, m, prefix):
    """Satisfying completions of a prefix by plain Python enumeration."""
    total = 0
    for rest in itertools.product((0, 1), repeat=m - len(prefix)):
        y = tuple(prefix) + rest
        if all(any((y[abs(lit) - 1] == 1) == (lit > 0) for lit in c) for c in clauses):
            total += 1
    return total


def test_exports():
    assert data.CNF is CNF and data.WeakCoT is WeakCoT and data.self_reducible_curve is self_reducible_curve
    assert data.random_cnf is random_cnf and data.coordinatewise_median is coordinatewise_median


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_counts_match_brute_force(seed):
    m = 6 + seed
    cnf = random_cnf(m, 3, 3 * m, seed=seed)
    assert cnf.num_solutions == _brute_count(cnf.clauses, m, ())
    for i in range(m + 1):
        prefixes = list(itertools.product((0, 1), repeat=i))
        got = cnf.count(torch.tensor(prefixes, dtype=torch.long).reshape(len(prefixes), i))
        assert got.tolist() == [_brute_count(cnf.clauses, m, p) for p in prefixes]
    sols = cnf.solutions()
    assert sols.shape == (cnf.num_solutions, m)
    assert all(_brute_count(cnf.clauses, m, tuple(s)) == 1 for s in sols.tolist())


def test_count_by_hand():
    cnf = CNF([[1, 2], [-1, 3]], m=3)  # (y1 or y2) and (not y1 or y3)
    assert cnf.num_solutions == 4  # 010, 011, 101, 111
    assert cnf.count([0]).item() == 2 and cnf.count([1, 0]).item() == 1 and cnf.count([0, 0]).item() == 0
    assert cnf.count(torch.tensor([[1, 1, 1], [1, 1, 0]])).tolist() == [1, 0]
    assert torch.allclose(cnf.relative_counts([1]), torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert torch.allclose(cnf.relative_counts([0]), torch.tensor([0.0, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 3])
def test_relative_counts_sum_to_one_and_multiply_to_inverse_count(seed):
    m = 8
    cnf = random_cnf(m, 3, 24, seed=seed)
    for i in range(m):
        prefixes = torch.tensor(list(itertools.product((0, 1), repeat=i)), dtype=torch.long).reshape(2**i, i)
        live = cnf.count(prefixes) > 0
        p = cnf.relative_counts(prefixes[live])
        assert torch.allclose(p.sum(-1), torch.ones(int(live.sum()), dtype=torch.float64))
    sols = cnf.solutions()  # Proposition 5.12: prod_i p(y_i | y_<i) = 1 / |R| along every solution
    log_prod = torch.zeros(len(sols), dtype=torch.float64)
    for i in range(m):
        p = cnf.relative_counts(sols[:, :i])
        log_prod += torch.log(p.gather(-1, sols[:, i:i + 1]).squeeze(-1))
    assert torch.allclose(log_prod, torch.full_like(log_prod, -math.log(cnf.num_solutions)))
    # the chain rule over all prefixes at once gives the uniform law over R (and nothing outside)
    p_true = torch.cat([cnf.level_table(i) for i in range(m)])
    from ppl_thought.data.self_reducible import _chain_log_law
    assert torch.allclose(_chain_log_law(cnf, p_true).exp(), cnf.log_uniform().exp())


def test_dead_prefix_and_bad_input_errors():
    cnf = CNF([[1, 2], [-1, 3]], m=3)
    with pytest.raises(UnsatisfiableConstraintError, match=r"\[0, 0\]"):
        cnf.relative_counts([0, 0])
    assert cnf.relative_counts([0, 0], dead="uniform").tolist() == [0.5, 0.5]
    for bad in ([0, 2], [0.0, 1.0], [[0, 1, 1, 0]]):
        with pytest.raises((MalformedSequenceError, ArgumentTypeError)):
            cnf.count(bad)
    with pytest.raises(MalformedSequenceError, match="shorter than m"):
        cnf.relative_counts([1, 1, 1])
    with pytest.raises(ConfigError, match="literal 4"):
        CNF([[1, 4]], m=3)
    with pytest.raises(ConfigError, match="literal 0"):
        CNF([[0]], m=3)
    with pytest.raises(ConfigError):
        CNF([[]], m=3)
    with pytest.raises(TooLargeToEnumerateError):
        CNF([[1]], m=21)
    with pytest.raises(UnsatisfiableConstraintError):
        random_cnf(1, 1, 60, seed=0, max_tries=5)  # x1 and not x1 both appear
    with pytest.raises(UnsatisfiableConstraintError):
        CNF([[1], [-1]], m=2).log_uniform()
    with pytest.raises(ConfigError):
        WeakCoT(alpha=0.0, gamma=0.1)
    with pytest.raises(ConfigError):
        WeakCoT(alpha=0.1, gamma=0.6)
    with pytest.raises(ConfigError):
        WeakCoT(alpha=0.1, gamma=0.1, bad="nice")
    with pytest.raises(ConfigError, match="T"):
        WeakCoT(0.1, 0.1).consensus_mean(torch.tensor([[0.5, 0.5]], dtype=torch.float64), 0)
    with pytest.raises(MalformedSequenceError):
        WeakCoT(0.1, 0.1).good_interval(torch.tensor([0.2, 0.3, 0.5]))
    with pytest.raises(ConfigError, match="gamma > 0"):
        tv_bound(cnf, WeakCoT(0.1, -0.1), 5)
    assert issubclass(UnsatisfiableConstraintError, PPLThoughtError)


def test_coordinatewise_median_is_equation_6():
    gen = torch.Generator().manual_seed(0)
    for T in (1, 2, 5, 8):
        preds = torch.softmax(torch.randn(7, T, 4, generator=gen, dtype=torch.float64), -1)
        med = np.median(preds.numpy(), axis=1)
        expected = med / med.sum(-1, keepdims=True)
        assert np.allclose(coordinatewise_median(preds).numpy(), expected)
    # binary: the median of pi(0) = 1 - pi(1) is 1 - median(pi(1)), so no renormalisation is needed
    pi1 = torch.rand(5, 6, generator=gen, dtype=torch.float64)
    out = coordinatewise_median(torch.stack([1 - pi1, pi1], -1))
    assert torch.allclose(out[:, 1], torch.from_numpy(np.median(pi1.numpy(), axis=1)))
    # all medians zero (three paths, each sure of a different token): uniform
    eye = torch.eye(3, dtype=torch.float64).unsqueeze(0)
    assert torch.allclose(coordinatewise_median(eye), torch.full((1, 3), 1 / 3, dtype=torch.float64))
    with pytest.raises(MalformedSequenceError):
        coordinatewise_median(torch.ones(3))


def test_good_interval_is_the_kl_ball():
    alpha = 0.02
    model = WeakCoT(alpha, 0.2)
    p1 = torch.tensor([0.0, 1.0, 0.5, 0.3, 1 / 60, 0.999], dtype=torch.float64)
    p = torch.stack([1 - p1, p1], -1)
    lo, hi = model.good_interval(p)
    assert (lo <= p1).all() and (p1 <= hi).all()
    assert lo[0] == 0 and math.isclose(hi[0], 1 - math.exp(-alpha), rel_tol=1e-12)
    assert hi[1] == 1 and math.isclose(lo[1], math.exp(-alpha), rel_tol=1e-12)

    def kl(a, x):
        return sum(pa * math.log(pa / px) for pa, px in ((a, x), (1 - a, 1 - x)) if pa > 0)

    for a, l, h in zip(p1.tolist(), lo.tolist(), hi.tolist()):
        for end in (l, h):
            if 0 < end < 1:  # up to the float64 spacing of pi(1) near 1 (p1 = 0.999: 1 - hi = 7.6e-13)
                assert kl(a, end) <= alpha * (1 + 1e-4) and math.isclose(kl(a, end), alpha, rel_tol=1e-4)
    # sampled good paths stay inside the ball: Definition 5.10 holds with probability >= 1/2 + gamma
    paths = model.sample_paths(p, 4000, torch.Generator().manual_seed(1))[..., 1]
    assert model.sample_paths(p, 3, num_samples=5).shape == (5, 6, 3, 2)
    inside = (paths >= lo.unsqueeze(-1)) & (paths <= hi.unsqueeze(-1))
    frac = inside[2:].double().mean().item()  # bad values of p1 = 0, 1 are outside, of 0.5 inside
    assert frac > 0.7 - 4 * math.sqrt(0.21 / 16000)


@pytest.mark.parametrize("bad", ["flip", "extreme"])
def test_consensus_mean_closed_form_matches_monte_carlo(bad):
    p1 = torch.tensor([0.0, 1.0, 0.5, 0.3, 0.9, 1 / 58], dtype=torch.float64)
    p = torch.stack([1 - p1, p1], -1)
    gen = torch.Generator().manual_seed(7)
    n = 40_000
    for gamma in (0.25, -0.2):
        model = WeakCoT(0.05, gamma, bad)
        for T in (1, 2, 3, 8):
            exact = model.consensus_mean(p, T)
            assert torch.allclose(exact.sum(-1), torch.ones(6, dtype=torch.float64))
            mc = model.consensus(p, T, gen, num_samples=n)[..., 1]
            se = mc.std(0) / math.sqrt(n)
            assert ((mc.mean(0) - exact[:, 1]).abs() <= 4.5 * se + 1e-12).all(), (gamma, T)


def test_all_good_paths_and_tiny_alpha_recover_p():
    cnf = random_cnf(8, 3, 24, seed=0)
    lq = sampler_log_law(cnf, WeakCoT(1e-8, 0.5), 3)
    assert total_variation(cnf, lq) < 1e-3
    assert total_variation(cnf, cnf.log_uniform()) == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_sampler_draws_follow_its_exact_law(seed):
    """The vectorised sampler (fresh paths and a median per prefix) matches q_T(y) = prod_i E[pi*] (chi-square)."""
    cnf = random_cnf(5, 3, 12, seed=seed)
    model = WeakCoT(0.05, 0.15)
    T, n = 3, 20_000
    probs = sampler_log_law(cnf, model, T).exp()
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-12)
    y, log_prob = sample(cnf, model, T, n, torch.Generator().manual_seed(seed))
    assert y.shape == (n, 5) and torch.isfinite(log_prob).all()
    counts = torch.bincount(cnf.prefix_index(y), minlength=32).double()
    expected = n * probs
    keep = expected > 5
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert stats.chi2.sf(chi2, len(obs) - 1) > 1e-3


def _curve(cnf, model):
    return [total_variation(cnf, sampler_log_law(cnf, model, T)) for T in T_VALUES]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_median_with_margin_drives_tv_down_below_lemma_5_11_bound(seed):
    m = 10
    cnf = random_cnf(m, 3, 30, seed=seed)
    model = WeakCoT(alpha=1e-3, gamma=0.3)
    tv = _curve(cnf, model)
    assert all(b < a for a, b in zip(tv, tv[1:])), tv
    assert tv[0] > 0.5 and tv[-1] < 0.05
    for T, t in zip(T_VALUES, tv):
        sharp, loose = tv_bound(cnf, model, T, sharp=True), tv_bound(cnf, model, T)
        assert t <= sharp <= loose
    assert tv_bound(cnf, model, 33) < 0.3  # m (sqrt(alpha/2) + exp(-2 T gamma^2)) = 0.25: not vacuous here


@pytest.mark.parametrize("bad", ["flip", "extreme"])
def test_median_without_margin_does_not_improve(bad):
    """gamma < 0 (a bad majority): more paths make the consensus surer of the wrong law, TV grows towards 1."""
    cnf = random_cnf(10, 3, 30, seed=0)
    tv = _curve(cnf, WeakCoT(alpha=1e-3, gamma=-0.1, bad=bad))
    assert all(b >= a - 1e-12 for a, b in zip(tv, tv[1:])), tv
    assert tv[-1] > 0.95
    good = _curve(cnf, WeakCoT(alpha=1e-3, gamma=0.1, bad=bad))
    assert good[-1] < good[0] and good[-1] < tv[-1] - 0.5


def test_counting_error_decreases_with_T():
    cnf = random_cnf(10, 3, 30, seed=1)
    model = WeakCoT(alpha=1e-3, gamma=0.3)
    exact_err = [expected_log_count_error(cnf, sampler_log_law(cnf, model, T)) for T in T_VALUES]
    assert all(b < a for a, b in zip(exact_err, exact_err[1:])), exact_err
    gen = torch.Generator().manual_seed(0)
    log_r = math.log(cnf.num_solutions)
    err = [float((count_by_sampling(cnf, model, T, 1000, gen) - log_r).abs().mean()) for T in (1, 5, 33)]
    assert err[0] > err[1] > err[2] and err[2] < 0.05, err
    # with the exact relative counts (alpha -> 0, all paths good) every estimate is log |R|
    est = count_by_sampling(cnf, WeakCoT(1e-10, 0.5), 1, 50, gen)
    assert torch.allclose(est, torch.full_like(est, log_r), atol=1e-3)


def test_self_reducible_curve_quick():
    start = time.perf_counter()
    out = self_reducible_curve(T_VALUES, quick=True)
    assert time.perf_counter() - start < 20
    assert set(out) == {"T", "tv", "log_count_error"}
    assert out["T"] == T_VALUES and len(out["tv"]) == len(out["log_count_error"]) == len(T_VALUES)
    assert all(0 <= t <= 1 for t in out["tv"]) and out["tv"][-1] < out["tv"][0] / 5
    assert out["log_count_error"][-1] < out["log_count_error"][0]


def test_self_reducible_curve_refuses_empty_text_or_float_T_values_at_once():
    """Found by the public sweep: self_reducible_curve('') and (zeros(0)) ran every formula for no T (no answer in
    3 s), a [2, 3] NaN tensor raised a bare ValueError. Refused before any work now."""
    t = time.perf_counter()
    for bad in ("", [], torch.zeros(0, dtype=torch.long)):
        with pytest.raises(ConfigError, match="T_values"):
            data.self_reducible_curve(bad)
    with pytest.raises(MalformedSequenceError, match="integer"):
        data.self_reducible_curve(torch.tensor([1.5, 2.0]))
    with pytest.raises(ConfigError, match="T_values"):
        data.self_reducible_curve(torch.full((2, 3), float("nan")))
    with pytest.raises(ConfigError, match="T_values\\[1\\]"):
        data.self_reducible_curve([1, 0])
    assert time.perf_counter() - t < 1.0
