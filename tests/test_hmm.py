"""HMM (Def 2.2): forward algorithm (3.1) vs brute force, sampling, Theorem 2.3's slow-thinking form."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chi2

from ppl_thought.errors import MalformedSequenceError, TooLargeToEnumerateError, UnknownTokenError
from ppl_thought.models.hmm import HMM


def random_hmm(S: int, K: int, seed: int, sparsity: float = 0.4) -> HMM:
    """A random HMM with some zero entries (so that some sequences are impossible)."""
    g = torch.Generator().manual_seed(seed)

    def rows(n: int, m: int) -> torch.Tensor:
        p = torch.rand(n, m, generator=g, dtype=torch.float64) + 0.05
        keep = torch.rand(n, m, generator=g) > sparsity
        keep[torch.arange(n), torch.randint(m, (n,), generator=g)] = True  # >= 1 nonzero per row
        p = p * keep
        return p / p.sum(-1, keepdim=True)

    return HMM(rows(S, S), rows(S, K), rows(1, S)[0])


def all_sequences(K: int, T: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(K), repeat=T)), dtype=torch.long).reshape(K**T, T)


# ---------------------------------------------------------------------- forward algorithm
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_equals_brute_force(seed):
    hmm = random_hmm(3, 3, seed, sparsity=0.6)
    saw_impossible = False
    for T in range(0, 5):
        x = all_sequences(3, T)
        fwd = hmm.log_prob(x)
        brute = hmm.brute_force_log_prob(x)
        assert fwd.shape == (x.shape[0],)
        assert not torch.isnan(fwd).any() and not torch.isnan(brute).any()
        assert torch.equal(torch.isneginf(fwd), torch.isneginf(brute))
        saw_impossible |= bool(torch.isneginf(fwd).any())
        ok = torch.isfinite(fwd)
        torch.testing.assert_close(fwd[ok], brute[ok], rtol=1e-10, atol=1e-10)
        # probabilities over all of Sigma^T sum to one
        assert math.isclose(float(torch.logsumexp(fwd, 0).exp()), 1.0, abs_tol=1e-12)
    assert saw_impossible, "the random sparse HMMs should make some sequences impossible"


def test_single_sequence_and_empty():
    hmm = random_hmm(4, 3, 5)
    x = torch.tensor([0, 2, 1, 1])
    lp = hmm.log_prob(x)
    assert lp.ndim == 0
    assert torch.allclose(lp, hmm.log_prob(x[None])[0])
    assert torch.allclose(lp, hmm.brute_force_log_prob(x))
    assert hmm.log_prob(torch.zeros(0, dtype=torch.long)).item() == 0.0
    assert hmm.log_prob([0, 2, 1, 1]).item() == lp.item()  # lists work too


def test_impossible_sequences_are_neg_inf_not_nan():
    # state 0 emits only symbol 0, state 1 only symbol 1, and 0 -> 1 -> 0 deterministically
    A = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    B = torch.eye(2)
    hmm = HMM(A, B, torch.tensor([1.0, 0.0]))
    x = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0], [1, 0, 1, 0]])
    lp = hmm.log_prob(x)
    assert lp[0].item() == 0.0
    assert torch.isneginf(lp[1:]).all()
    pre = hmm.prefix_log_probs(x)
    assert torch.isneginf(pre[1, 1:]).all() and pre[1, 0].item() == 0.0
    assert not torch.isnan(hmm.filter(x)).any() and not torch.isnan(hmm.predictive(x)).any()
    assert (hmm.filter(x)[1, 1:] == 0).all() and (hmm.predictive(x)[1, 2:] == 0).all()


def test_long_sequences_do_not_underflow():
    # an iid HMM (one state): log P(x) = sum log B[0, x_t] exactly
    B = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)
    hmm = HMM(torch.ones(1, 1), B, torch.ones(1))
    x = torch.randint(3, (4, 5000), generator=torch.Generator().manual_seed(0))
    expected = B[0].log()[x].sum(-1)
    torch.testing.assert_close(hmm.log_prob(x), expected, rtol=1e-12, atol=1e-9)
    assert torch.isfinite(hmm.log_prob(x)).all()


@pytest.mark.parametrize("seed", [3, 4])
def test_prefix_filter_predictive_consistency(seed):
    hmm = random_hmm(3, 3, seed, sparsity=0.2)
    _, x = hmm.sample(64, 6, generator=torch.Generator().manual_seed(seed))
    pre = hmm.prefix_log_probs(x)
    for t in range(6):
        torch.testing.assert_close(pre[:, t], hmm.log_prob(x[:, : t + 1]))
    pred = hmm.predictive(x)  # [N, T+1, K]
    assert pred.shape == (64, 7, 3)
    torch.testing.assert_close(pred.sum(-1), torch.ones(64, 7, dtype=torch.float64))
    torch.testing.assert_close(pred[:, 0], (hmm.lam @ hmm.B).expand(64, 3))
    step = pred[:, :-1].gather(-1, x[..., None])[..., 0].log()  # log P(x_{t+1} | x_{<=t})
    torch.testing.assert_close(step.cumsum(-1), pre)
    filt = hmm.filter(x)  # [N, T, S]
    torch.testing.assert_close(filt.sum(-1), torch.ones(64, 6, dtype=torch.float64))
    torch.testing.assert_close(pred[:, 1:], filt @ hmm.A @ hmm.B)


def test_filter_equals_brute_force_posterior():
    hmm = random_hmm(3, 2, 7, sparsity=0.2)
    S, T = 3, 4
    paths = all_sequences(S, T)
    for x in all_sequences(2, T):
        lj = hmm.log_joint(paths, x.expand(paths.shape[0], T))
        if torch.isneginf(lj).all():
            continue
        post = torch.zeros(S, dtype=torch.float64).index_add_(0, paths[:, -1], torch.softmax(lj, 0))
        torch.testing.assert_close(hmm.filter(x)[-1], post)


# ---------------------------------------------------------------------- sampling
def _chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled an outcome of probability zero"
    expected = n * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def test_sampling_frequencies_match_exact_probabilities():
    hmm = random_hmm(3, 2, 11, sparsity=0.25)
    T, n = 3, 60_000
    z, x = hmm.sample(n, T, generator=torch.Generator().manual_seed(123))
    assert z.shape == x.shape == (n, T) and z.dtype == x.dtype == torch.long
    # observations: all 2^3 sequences
    xs = all_sequences(2, T)
    code = (x * torch.tensor([4, 2, 1])).sum(-1)
    counts = torch.bincount(code, minlength=8).double()
    probs = hmm.log_prob(xs).exp()
    stat, df = _chi2_stat(counts, probs)
    bound = chi2.ppf(1 - 1e-4, df)
    assert stat < bound, f"chi2 {stat:.1f} >= {bound:.1f} (df={df}): the sampler is biased"
    # the test has power: the exact law of a different HMM is rejected
    other = random_hmm(3, 2, 12, sparsity=0.25).log_prob(xs).exp()
    if (other[probs > 0] > 0).all():
        assert _chi2_stat(counts, other)[0] > bound
    # joint law of (hidden, observed): 3^3 * 2^3 cells against exp(log_joint)
    zs = all_sequences(3, T)
    zc = (z * torch.tensor([9, 3, 1])).sum(-1)
    jcounts = torch.bincount(zc * 8 + code, minlength=27 * 8).double()
    zz = zs.repeat_interleave(8, 0)
    xx = xs.repeat(27, 1)
    jprobs = hmm.log_joint(zz, xx).exp()
    stat, df = _chi2_stat(jcounts, jprobs)
    assert stat < chi2.ppf(1 - 1e-4, df)


def test_sampling_is_reproducible_with_generator():
    hmm = random_hmm(4, 3, 2)
    a = hmm.sample(10, 7, generator=torch.Generator().manual_seed(5))
    b = hmm.sample(10, 7, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.isfinite(hmm.log_joint(*a)).all()


# ---------------------------------------------------------------------- cross-entropy
def test_cross_entropy_and_entropy_rate_iid():
    B = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)
    hmm = HMM(torch.ones(1, 1), B, torch.ones(1))
    H = float(-(B * B.log()).sum())
    est = hmm.entropy_rate_estimate(length=64, num_sequences=400, generator=torch.Generator().manual_seed(0))
    assert abs(est.estimate - H) < 5 * est.stderr and est.stderr < 0.02
    _, x = hmm.sample(10, 20, generator=torch.Generator().manual_seed(1))
    assert math.isclose(hmm.cross_entropy(x), float((-hmm.log_prob(x) / 20).mean()), rel_tol=1e-12)
    torch.testing.assert_close(hmm.per_token_nll(x), -hmm.log_prob(x) / 20)


def test_entropy_rate_estimate_with_burn_in_is_conditional_log_loss():
    hmm = random_hmm(3, 3, 8, sparsity=0.0)
    est0 = hmm.entropy_rate_estimate(32, 200, burn_in=0, generator=torch.Generator().manual_seed(0))
    est8 = hmm.entropy_rate_estimate(32, 200, burn_in=8, generator=torch.Generator().manual_seed(0))
    assert est0.estimate > 0 and est8.estimate > 0
    assert abs(est0.estimate - est8.estimate) < 5 * (est0.stderr + est8.stderr)


# ---------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "A, B, lam, match",
    [
        ([[0.5, 0.5]], [[1.0], [1.0]], [0.5, 0.5], "square"),
        ([[0.5, 0.5], [0.2, 0.7]], [[1.0], [1.0]], [0.5, 0.5], "row 1 of A sums to 0.9"),
        ([[0.5, 0.5], [1.2, -0.2]], [[1.0], [1.0]], [0.5, 0.5], r"A\[1, 1\] = -0.2 is negative"),
        ([[0.5, 0.5], [0.5, 0.5]], [[1.0], [float("nan")]], [0.5, 0.5], r"B\[1, 0\] = nan"),
        ([[0.5, 0.5], [0.5, 0.5]], [[1.0]], [0.5, 0.5], "rows"),
        ([[0.5, 0.5], [0.5, 0.5]], [[1.0], [1.0]], [0.5, 0.6], "lam sums to 1.1"),
        ([[0.5, 0.5], [0.5, 0.5]], [[1.0], [1.0]], [1.0], "shape"),
    ],
)
def test_validation_errors_name_the_problem(A, B, lam, match):
    with pytest.raises(ValueError, match=match):
        HMM(torch.tensor(A), torch.tensor(B), torch.tensor(lam))


def test_bad_observations_and_enumeration_limit():
    hmm = random_hmm(3, 2, 0)
    with pytest.raises(UnknownTokenError):
        hmm.log_prob(torch.tensor([0, 2]))
    with pytest.raises(MalformedSequenceError):
        hmm.log_prob(torch.tensor([0.0, 1.0]))
    with pytest.raises(MalformedSequenceError):
        hmm.log_prob(torch.zeros(2, 2, 2, dtype=torch.long))
    with pytest.raises(TooLargeToEnumerateError):
        hmm.brute_force_log_prob(torch.zeros(30, dtype=torch.long))


# ---------------------------------------------------------------------- Theorem 2.3
def _tabular_log_prob(prior, z: tuple[int, ...]) -> float:
    """log P_f(z) = sum_t log softmax(f(<bos> z_{<t}))[z_t] from one Tabular forward pass."""
    tokens = torch.tensor([[1, *z]], dtype=torch.long)  # <bos> = 1
    with torch.no_grad():
        logits, _ = prior(tokens)
    logp = torch.log_softmax(logits[0, :-1].double(), -1)
    return float(logp.gather(-1, tokens[0, 1:, None]).sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_theorem_2_3_product_prior_reproduces_hmm(seed):
    hmm = random_hmm(3, 2, seed, sparsity=0.3)
    product, prior = hmm.as_slow_thinking_parts(observable_tokens=["a", "b"], hidden_names=["p", "q", "r"])
    assert not torch.isnan(prior.logits).any()
    assert not torch.isneginf(prior.logits).all(-1).any()
    obs_ids = hmm.observation_ids(product, ["a", "b"])
    for T in range(1, 4):
        for x in all_sequences(2, T):
            lifting = product.enumerate_lifting(obs_ids[x].tolist())
            assert len(lifting) == 3**T
            total = sum(math.exp(_tabular_log_prob(prior, z)) for z in lifting)
            assert math.isclose(total, math.exp(hmm.log_prob(x)), rel_tol=1e-5, abs_tol=1e-7), (x, total)
            for z in lifting:  # and Proj maps every lifted string back to x
                assert list(product.project(list(z))) == obs_ids[x].tolist()


def test_theorem_2_3_pair_rows_are_the_pair_chain():
    hmm = random_hmm(2, 3, 4, sparsity=0.3)
    product, prior = hmm.as_slow_thinking_parts()
    probs = torch.softmax(prior.logits.double(), -1)
    for x_name in hmm.observable_tokens:
        for g, g_name in enumerate(hmm.hidden_names):
            row = probs[product.pair_id(x_name, g_name)]
            bos = probs[1]
            for a2, x2 in enumerate(hmm.observable_tokens):
                for g2, h2 in enumerate(hmm.hidden_names):
                    j = product.pair_id(x2, h2)
                    assert math.isclose(row[j], hmm.A[g, g2] * hmm.B[g2, a2], abs_tol=1e-6)
                    assert math.isclose(bos[j], hmm.lam[g2] * hmm.B[g2, a2], abs_tol=1e-6)
    # non-pair next tokens have probability zero after every context
    pair_ids = [product.pair_id(a, g) for a in hmm.observable_tokens for g in hmm.hidden_names]
    mask = torch.ones(len(product.vocab), dtype=torch.bool)
    mask[pair_ids] = False
    assert (probs[:, mask] == 0).all()


def test_as_slow_thinking_model_exact_log_prob():
    hmm = random_hmm(3, 2, 1, sparsity=0.3)
    model = hmm.as_slow_thinking()
    ids = hmm.observation_ids(model.projection)
    for x in all_sequences(2, 3):
        got, want = float(model.exact_log_prob(ids[x])), float(hmm.log_prob(x))
        assert (math.isinf(got) and math.isinf(want)) or math.isclose(got, want, rel_tol=1e-5), (x, got, want)
