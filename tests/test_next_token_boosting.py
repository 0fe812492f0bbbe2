"""next-token-long-range: Theorem 3's advantage bound and the boosting of Lemmas 1-2 ((1.3)-(1.4)), Algorithm 1,
checked against exact answers by enumeration of Sigma^n on tiny tabular LMs."""

from __future__ import annotations

import math

import pytest
import torch

from ppl_thought.diagnostics import advantage_bound
from ppl_thought.diagnostics.boosting import (
    Boosted,
    TabularText,
    boosted_log_ratio,
    enumerate_strings,
    exact_boosting,
    exact_window_advantages,
    kl_advantage_bound,
    lemma1_kl_decrease,
    lm_next_token_model,
    self_boosting_schedule,
    self_boosting_threshold,
    sequence_log_prob,
    window_log_prob,
    window_terms,
)
from ppl_thought.errors import ConfigError, DiagnosticError, PPLThoughtError
from ppl_thought.lm import Tabular


def _kl(p, q, V, n):
    X = enumerate_strings(V, n)
    lp, lq = sequence_log_prob(p, X), sequence_log_prob(q, X)
    return float((lp.exp() * (lp - lq)).sum())


def _optimal_d(p, q):
    """d*(s, x) = 1[p^k(window | prefix) > q^k(window | prefix)]: its advantage is the mean window TV."""

    def d(s, tokens):
        lpw = sequence_log_prob(p, tokens) - sequence_log_prob(p, tokens[:, :s])
        lqw = sequence_log_prob(q, tokens) - sequence_log_prob(q, tokens[:, :s])
        return lpw > lqw

    return d


def _middle_token_pair(delta):
    """n = 3, V = 2: p draws x_1 ~ Bern(1/2 + delta), q is uniform; tokens 0 and 2 are uniform under both."""
    zero = torch.zeros
    lo = math.log((0.5 + delta) / (0.5 - delta))
    p = TabularText([zero(1, 2), torch.tensor([[0.0, lo], [0.0, lo]]), zero(4, 2)])
    q = TabularText([zero(1, 2), zero(2, 2), zero(4, 2)])
    return p, q


# ---------------------------------------------------------------------------------------------- Theorem 3
def test_theorem3_bound_is_informative_and_holds_exactly():
    V, n = 3, 4
    g = torch.Generator().manual_seed(1)
    p = TabularText.random(V, n, 0.4, g)
    q = TabularText.random(V, n, 0.4, g)
    kl = _kl(p, q, V, n)
    for k in (1, 2, 3):
        d = _optimal_d(p, q)
        adv = float(exact_window_advantages(p, q, d, V, n, k).mean())
        bound = kl_advantage_bound(kl, n, k)
        assert 0 < adv <= bound < 1  # the bound is below 1 and the best distinguisher stays under it
        # the per-token form (L - H = KL / n) gives the same number
        assert advantage_bound(k, 1.0 + kl / n, 1.0, n) == pytest.approx(bound)


def test_theorem3_wrong_bounds_fail():
    """A mean shift of the middle token: both windows see it, Pinsker is nearly tight. The bound with its
    factor min(k, N) / N holds; without k, or with n in place of N = n - k + 1 (the old per-token form
    sqrt(k (L - H) / 2)), it is violated."""
    p, q = _middle_token_pair(0.2)
    n, k = 3, 2
    kl = _kl(p, q, 2, n)
    assert kl == pytest.approx(0.7 * math.log(1.4) + 0.3 * math.log(0.6))
    adv = float(exact_window_advantages(p, q, lambda s, t: t[:, 1] == 1, 2, n, k).mean())
    assert adv == pytest.approx(0.2)
    N = n - k + 1
    assert adv <= kl_advantage_bound(kl, n, k) < 1
    assert adv <= advantage_bound(k, kl / n, 0.0, n)
    assert adv > math.sqrt(kl / (2 * N))  # missing the factor k
    assert adv > math.sqrt(k * kl / (2 * n))  # n instead of N
    assert adv > advantage_bound(k, kl / n, 0.0)  # the n -> infinity form is not a bound at finite n


# ---------------------------------------------------------------------------------------------- Lemmas 1-2
@pytest.mark.parametrize("V,n,k", [(2, 6, 2), (2, 5, 3), (3, 4, 2)])
def test_boosted_law_and_kl_fall_match_lemma(V, n, k):
    g = torch.Generator().manual_seed(V * 100 + n * 10 + k)
    p = TabularText.random(V, n, 1.5, g)
    q = TabularText.random(V, n, 1.5, g)
    r = exact_boosting(p, q, _optimal_d(p, q), V, n, k)
    # (1.4) token by token is the law (1.3), a probability distribution
    assert r.total_mass == pytest.approx(1.0, abs=1e-12)
    assert r.chain_vs_text_max_abs < 1e-10
    # the exact KL fall equals sum_{s in I_m} E_p[eps d - log Z_s] and is at least the lemma's bounds
    assert r.kl_after == pytest.approx(_kl(p, Boosted(q, _optimal_d(p, q), k, n, r.offset, r.eps, V), V, n))
    assert r.kl_decrease == pytest.approx(r.identity, abs=1e-10)
    assert r.alpha > 0 and r.a_m >= r.alpha - 1e-12 and r.eps == pytest.approx(r.alpha / 2)
    assert r.kl_decrease >= r.proof_bound >= r.lemma1_bound == pytest.approx(lemma1_kl_decrease(r.alpha, n, k))
    assert r.lemma1_bound > 0
    # boosting lowers the advantage of the distinguisher it used, most on its own starts
    assert r.alpha_after < r.alpha
    own = list(range(r.offset, n - k + 1, k))
    assert sum(r.per_start_after[s] for s in own) < sum(r.per_start[s] for s in own)
    # Lemma 15: every conditional of (1.4) lies within a factor e^eps of q's (eps >= 0)
    X = enumerate_strings(V, n)
    qb = Boosted(q, _optimal_d(p, q), k, n, r.offset, r.eps, V)
    gap = qb(X[:, :-1]) - q(X[:, :-1])
    assert gap.abs().max() <= r.eps + 1e-12 and gap.abs().max() > 0
    # Theorem 3 holds before and after
    assert r.alpha <= r.theorem3_before and r.alpha_after <= r.theorem3_after


def test_complemented_distinguisher_boosts_the_same():
    """a(1 - d) = -a(d): exact_boosting then takes eps = a/2 < 0 and the most negative offset, which is the same
    boosted law as d's with eps = |a|/2 (the paper's 'assume a >= 0 without loss of generality')."""
    V, n, k = 2, 5, 2
    g = torch.Generator().manual_seed(11)
    p = TabularText.random(V, n, 1.5, g)
    q = TabularText.random(V, n, 1.5, g)
    d = _optimal_d(p, q)
    r = exact_boosting(p, q, d, V, n, k)
    rc = exact_boosting(p, q, lambda s, t: ~d(s, t), V, n, k)
    assert rc.alpha == pytest.approx(-r.alpha) and rc.eps == pytest.approx(-r.eps) and rc.offset == r.offset
    assert rc.kl_after == pytest.approx(r.kl_after) and rc.kl_decrease >= rc.lemma1_bound > 0


def test_wrong_updates_fail():
    V, n, k = 2, 6, 2
    g = torch.Generator().manual_seed(7)
    p = TabularText.random(V, n, 1.5, g)
    q = TabularText.random(V, n, 1.5, g)
    d = _optimal_d(p, q)
    good = exact_boosting(p, q, d, V, n, k)
    # a constant missing from the lemma (1/8 dropped) is above the exact fall: it is not a valid bound
    assert good.kl_decrease < good.alpha ** 2 * (n - k + 1) / k
    # the wrong sign of eps moves q away from p
    bad = exact_boosting(p, q, d, V, n, k, eps=-good.eps)
    assert bad.kl_decrease < 0 < bad.lemma1_bound
    X = enumerate_strings(V, n)
    lq = sequence_log_prob(q, X)

    # reweighting every window (overlapping blocks) with per-window normalisers is not a law
    def all_windows(x):
        out = torch.zeros(x.shape[0], dtype=torch.float64)
        for s in range(n - k + 1):
            dy = torch.stack([d(s, torch.cat([x[:, :s], y.expand(x.shape[0], k)], 1)) for y in
                              enumerate_strings(V, k)], 1).double()
            logz = torch.logsumexp(window_log_prob(q, x[:, :s], k, V) + good.eps * dy, -1)
            out = out + good.eps * d(s, x[:, :s + k]).double() - logz
        return out

    assert abs(float((lq + all_windows(X)).exp().sum()) - 1.0) > 1e-3

    # (1.4) without the look-ahead sum in the numerator (reweight only the block's last token) is a law,
    # but not (1.3), and its KL fall is not the identity
    class NoLookahead(Boosted):
        def _in_block(self, prefix, s):
            t = prefix.shape[1]
            base = self.q(prefix, start=t)[:, 0]
            if t < s + self.k - 1:
                return base
            rows = torch.cat([prefix.repeat_interleave(V, 0), torch.arange(V).repeat(prefix.shape[0])[:, None]], 1)
            w = base + self.eps * torch.as_tensor(self.d(s, rows)).double().view(-1, V)
            return w - torch.logsumexp(w, -1, keepdim=True)

    wrong = NoLookahead(q, d, k, n, good.offset, good.eps, V)
    lw = sequence_log_prob(wrong, X)
    assert float(lw.exp().sum()) == pytest.approx(1.0)
    ratio = boosted_log_ratio(q, d, k, good.offset, good.eps, X, V)
    assert float((lw - (lq + ratio)).abs().max()) > 1e-3


def test_large_eps_removes_the_advantage_on_the_boosted_blocks():
    """d = 'the window is p-possible' with p putting mass 0 on some windows: as eps grows, q' on the blocks of
    I_m tends to q conditioned on d = 1, so those starts lose their advantage (the limit of (1.3))."""
    V, n, k = 2, 4, 2
    g = torch.Generator().manual_seed(3)
    p = TabularText([torch.zeros(1, 2), torch.tensor([[0.0, 0.0], [0.0, -math.inf]]), torch.zeros(4, 2),
                     torch.zeros(8, 2)])  # "1 1" never starts a document under p
    q = TabularText.random(V, n, 0.5, g)

    def d(s, tokens):
        return ~((tokens[:, s] == 1) & (tokens[:, s + 1] == 1) & torch.tensor(s == 0))

    per = exact_window_advantages(p, q, d, V, n, k)
    assert per[0] > 0.1 and per[1:].abs().max() < 1e-12
    for eps, tol in ((5.0, 0.01), (20.0, 1e-6)):
        r = exact_boosting(p, q, d, V, n, k, eps=eps, offset=0)
        assert 0 <= r.per_start_after[0] < tol
        assert r.kl_decrease == pytest.approx(r.identity)


def test_lm_adapter_matches_tabular_text():
    """A pt.lm Tabular bigram through lm_next_token_model is the same law as the TabularText built from it."""
    V, n = 3, 4
    g = torch.Generator().manual_seed(5)
    table = torch.randn(V + 1, V + 1, generator=g)  # id 0 = <bos>, ids 1..V = the alphabet
    lm = Tabular(2, V + 1, table, trainable=False)
    model = lm_next_token_model(lm, torch.arange(1, V + 1), bos_id=0)
    rows = [torch.log_softmax(table[0, 1:].double(), -1)[None]]
    for j in range(1, n):
        last = enumerate_strings(V, j)[:, -1]
        rows.append(torch.log_softmax(table[last + 1][:, 1:].double(), -1))
    tt = TabularText(rows)
    X = enumerate_strings(V, n)
    assert torch.allclose(sequence_log_prob(model, X), sequence_log_prob(tt, X), atol=1e-6)
    assert torch.allclose(model(X[:, :2], start=1), tt(X[:, :2], start=1), atol=1e-6)


# ---------------------------------------------------------------------------------------------- Algorithm 1
def test_self_boosting_schedule_stops_where_the_loss_flattens():
    losses = {i: 2.0 / i for i in range(1, 200)}  # L_i - L_{i+1} = 2 / (i (i + 1))
    thr = self_boosting_threshold(0.5, n=16, k=2)
    assert thr == pytest.approx(0.25 * 15 / (8 * 2 * 16))
    first_ok = min(i for i in range(1, 199) if losses[i] - losses[i + 1] <= thr)
    for seed in range(20):
        run = self_boosting_schedule(losses.__getitem__, thr, num_indices=40,
                                     generator=torch.Generator().manual_seed(seed))
        assert run.output == max(run.start, first_ok)
        assert run.indices == list(range(run.start, run.output + 2))
        assert len(run.indices) == 2 or run.start < first_ok
    # Lemma 4's count: fewer than L_1 / threshold indices are followed by a fall above the threshold
    assert sum(losses[i] - losses[i + 1] > thr for i in range(1, 199)) <= losses[1] / thr


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    V, n, k = 2, 4, 2
    p = TabularText.random(V, n)
    with pytest.raises(DiagnosticError, match="0 or 1"):
        exact_window_advantages(p, p, lambda s, t: torch.full((t.shape[0],), 0.5), V, n, k)
    with pytest.raises(DiagnosticError, match="longer than the document"):
        kl_advantage_bound(0.1, 2, 3)
    with pytest.raises(DiagnosticError, match="offset"):
        Boosted(p, lambda s, t: t[:, 0] == 0, k, n, offset=2, eps=0.1, vocab_size=V)
    with pytest.raises(ConfigError, match="eps"):
        Boosted(p, lambda s, t: t[:, 0] == 0, k, n, offset=0, eps=float("nan"), vocab_size=V)
    with pytest.raises(ConfigError, match="n \\(the document length\\)"):
        advantage_bound(3, 1.0, 0.5, n=2)
    with pytest.raises(PPLThoughtError, match="alphabet"):
        p(torch.tensor([[0, 2]]))
    with pytest.raises(PPLThoughtError, match="limit"):
        enumerate_strings(7, 20)


# ---------------------------------------------------------------------------------------------- the A5 pieces
def test_a5_pieces_are_exact():
    """The A5 run's p (forward algorithm), d (reveal checker) and (1.4) on a Transformer: p is never caught by
    d, d agrees with the HMM's support, and (1.4) through the Transformer is (1.3) per document."""
    from ppl_thought.data.a5 import a5_hmm
    from ppl_thought.experiments.next_token_boosting import hmm_next_token_model, reveal_checker
    from ppl_thought.lm import Transformer

    task = a5_hmm(0.5)
    V, n, k = 7, 6, 2
    p, d = hmm_next_token_model(task.hmm), reveal_checker(task, k)
    g = torch.Generator().manual_seed(0)
    x = task.sample(6, n, generator=g)
    assert torch.allclose(sequence_log_prob(p, x), task.hmm.log_prob(x).double())
    # d = 0 exactly on the windows that make the document impossible (the first wrong reveal)
    X = torch.cat([x[:, :3].repeat_interleave(V * V, 0), enumerate_strings(V, 2).repeat(6, 1)], 1)  # [6 V^2, 5]
    possible = torch.isfinite(task.log_prob_by_tracking(X))
    assert torch.equal(d(3, X).bool(), possible)
    torch.manual_seed(0)
    lm = Transformer(len(task.vocab), d_model=16, n_layers=1, n_heads=2, max_len=n + 2)
    q = lm_next_token_model(lm, torch.arange(task.vocab.num_specials, len(task.vocab)), task.vocab.bos_id)
    for s in range(n - k + 1):
        assert window_terms(p, p, d, x[:, :s], k, V).abs().max() < 1e-12
        t = window_terms(p, q, d, x[:, :s], k, V)
        assert (t > 0).all() and (t < 1).all()  # 1 - E_q d: an untrained q reveals wrong cups
    for m in (0, 1):
        qb = Boosted(q, d, k, n, m, 1.5, V)
        lhs = sequence_log_prob(qb, x) - sequence_log_prob(q, x)
        assert torch.allclose(lhs, boosted_log_ratio(q, d, k, m, 1.5, x, V), atol=1e-5)
