"""HMM (Def 2.2): forward algorithm (3.1) vs brute force, sampling, Theorem 2.3, the Pyro program."""

from __future__ import annotations

import itertools
import math

import pyro
import pyro.poutine as poutine
import pytest
import torch
from scipy.stats import chi2

from ppl_thought.errors import MalformedSequenceError, TooLargeToEnumerateError, UnknownTokenError
from ppl_thought.guides.hmm import HMMGuide
from ppl_thought.models.hmm import HMM
from ppl_thought.models.hmm_lifting import hmm_as_slow_thinking, slow_thinking_parts
from ppl_thought.program import Program, reorder_state


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
    product, prior = slow_thinking_parts(hmm, observable_tokens=["a", "b"], hidden_names=["p", "q", "r"])
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
    product, prior = slow_thinking_parts(hmm)
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
    model = hmm_as_slow_thinking(hmm)
    ids = hmm.observation_ids(model.projection)
    for x in all_sequences(2, 3):
        got, want = float(model.exact_log_prob(ids[x])), float(hmm.log_prob(x))
        assert (math.isinf(got) and math.isinf(want)) or math.isclose(got, want, rel_tol=1e-5), (x, got, want)


# ---------------------------------------------------------------------- the Pyro program (Def 2.2)
def _site_stack(tr, prefix: str, T: int, n: int) -> torch.Tensor:
    """The values of sites ``prefix_0 .. prefix_{T-1}`` as ``[n, T]``."""
    return torch.stack([tr.nodes[f"{prefix}_{t}"]["value"].reshape(n) for t in range(T)], dim=-1)


def _per_particle(tr, n: int, observed: bool | None = None) -> torch.Tensor:
    """Sum of the site log-probs of each particle, float64 ``[n]`` (any particle dim)."""
    tr.compute_log_prob()
    total = torch.zeros(n, dtype=torch.float64)
    for site in tr.nodes.values():
        if site["type"] == "sample" and (observed is None or site["is_observed"] == observed):
            lp = site["log_prob"]
            assert not torch.isnan(lp).any(), site["name"]
            total = total + lp.reshape(n).double()
    return total


def _is_log_weights(model, guide, x, n: int, seed: int, dim: int = -1) -> torch.Tensor:
    """Importance sampling with Pyro's own machinery: guide under a particle plate, model replayed on it.

    ``guide=None``: the model's own prior proposes (bootstrap), the weight is the likelihood.
    """
    pyro.set_rng_seed(seed)
    with torch.no_grad():
        if guide is None:
            with pyro.plate("particles", n, dim=dim):
                mtr = poutine.trace(model).get_trace(x)
            return _per_particle(mtr, n, observed=True)
        with pyro.plate("particles", n, dim=dim):
            gtr = poutine.trace(guide).get_trace(x)
        with pyro.plate("particles", n, dim=dim):
            mtr = poutine.trace(poutine.replay(model, trace=gtr)).get_trace(x)
        assert {k for k, s in gtr.nodes.items() if s["type"] == "sample"} == {f"z_{t}" for t in range(len(x))}
        log_q = _per_particle(gtr, n)
        assert torch.isfinite(log_q).all()
        return _per_particle(mtr, n) - log_q


def _estimate(log_w: torch.Tensor) -> tuple[float, float]:
    """(log Zhat, its delta-method SE sd(w) / (sqrt(n) mean(w)))."""
    n = log_w.shape[0]
    w = (log_w - log_w.max()).exp()
    return float(torch.logsumexp(log_w, 0) - math.log(n)), float(w.std() / (math.sqrt(n) * w.mean()))


def _guide(hmm: HMM, kind: str):
    return {"bootstrap": None, "filtering": HMMGuide.filtering(hmm), "posterior": HMMGuide.posterior(hmm)}[kind]


def _sticky_hmm() -> HMM:
    A = torch.tensor([[0.8, 0.15, 0.05], [0.1, 0.8, 0.1], [0.0, 0.2, 0.8]])
    B = torch.tensor([[0.7, 0.3, 0.0], [0.1, 0.7, 0.2], [0.1, 0.1, 0.8]])
    return HMM(A, B, torch.tensor([0.6, 0.4, 0.0]))


@pytest.mark.parametrize("dim", [-1, -2])
def test_program_trace_is_the_joint_law(dim):
    hmm = random_hmm(3, 3, 21, sparsity=0.3)
    assert isinstance(hmm, Program) and hmm.max_plate_nesting == 0
    T, n = 6, 64
    x = hmm.sample(1, T, generator=torch.Generator().manual_seed(0))[1][0]
    pyro.set_rng_seed(0)
    with pyro.plate("particles", n, dim=dim):
        tracer = poutine.trace(hmm)
        state = tracer(x)
    tr = tracer.trace
    shape = (n,) + (1,) * (-dim - 1)
    names = [k for k, s in tr.nodes.items() if s["type"] == "sample"]
    assert names == [f"{v}_{t}" for t in range(T) for v in ("z", "x")]
    assert all(tr.nodes[k]["value"].shape == shape for k in names)
    assert all(tr.nodes[f"x_{t}"]["is_observed"] and not tr.nodes[f"z_{t}"]["is_observed"] for t in range(T))
    assert hmm.max_steps == T
    z = _site_stack(tr, "z", T, n)
    assert torch.equal(state["z"].reshape(n), z[:, -1])
    torch.testing.assert_close(_per_particle(tr, n), hmm.log_joint(z, x.expand(n, T)), rtol=1e-12, atol=1e-12)
    # generation: x sites are sampled, and the joint is still log_joint
    with pyro.plate("particles", n, dim=dim):
        tr = poutine.trace(hmm).get_trace(length=T)
    assert not any(tr.nodes[f"x_{t}"]["is_observed"] for t in range(T))
    z, xs = _site_stack(tr, "z", T, n), _site_stack(tr, "x", T, n)
    torch.testing.assert_close(_per_particle(tr, n), hmm.log_joint(z, xs), rtol=1e-12, atol=1e-12)


def test_program_outside_a_plate_and_errors():
    hmm = random_hmm(3, 2, 22)
    x = torch.tensor([0, 1, 1, 0])
    pyro.set_rng_seed(1)
    tr = poutine.trace(hmm).get_trace(x)
    assert all(s["value"].shape == () for s in tr.nodes.values() if s["type"] == "sample")
    z = _site_stack(tr, "z", 4, 1)[0]
    torch.testing.assert_close(tr.log_prob_sum(), hmm.log_joint(z, x))
    assert poutine.trace(hmm).get_trace([0, 1]).nodes["x_1"]["value"].item() == 1  # lists work
    # pyro's sequential Importance (no particle plate) with the posterior guide: every weight is log p(x)
    imp = pyro.infer.Importance(hmm, HMMGuide.posterior(hmm), num_samples=20).run(x)
    torch.testing.assert_close(torch.stack(imp.log_weights).double(), hmm.log_prob(x).expand(20))
    # T = 0: one empty step, no sites
    assert not [s for s in poutine.trace(hmm).get_trace(length=0).nodes.values() if s["type"] == "sample"]
    with pytest.raises(ValueError, match="length="):
        hmm()
    with pytest.raises(ValueError, match="length=3"):
        hmm(x, length=3)
    with pytest.raises(MalformedSequenceError):
        hmm(x[None].expand(2, 4))
    with pytest.raises(UnknownTokenError):
        hmm(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="call it with x"):
        HMMGuide.filtering(hmm)(length=3)


def test_backward_messages_give_the_forward_probability():
    hmm = random_hmm(3, 3, 2, sparsity=0.6)
    x = all_sequences(3, 4)
    beta = hmm.backward(x)  # [N, T, S]
    assert beta.shape == (81, 4, 3) and not torch.isnan(beta).any()
    lp = torch.logsumexp(hmm.log_lam + hmm.log_B.T[x[:, 0]] + beta[:, 0], -1)
    fwd = hmm.log_prob(x)
    assert torch.equal(torch.isneginf(lp), torch.isneginf(fwd)) and torch.isneginf(fwd).any()
    ok = torch.isfinite(fwd)
    torch.testing.assert_close(lp[ok], fwd[ok], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dim", [-1, -2])
def test_posterior_guide_is_zero_variance(dim):
    for seed in (0, 1, 2):
        hmm = random_hmm(4, 3, seed, sparsity=0.4)
        x = hmm.sample(1, 7, generator=torch.Generator().manual_seed(seed))[1][0]
        log_w = _is_log_weights(hmm, HMMGuide.posterior(hmm), x, 256, seed, dim=dim)
        torch.testing.assert_close(log_w, hmm.log_prob(x).expand(256), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["bootstrap", "filtering"])
def test_importance_estimate_is_unbiased(kind):
    hmm = _sticky_hmm()
    x = torch.tensor([0, 0, 1, 1, 2, 2, 1, 0])
    log_z = float(hmm.log_prob(x))
    est, se = _estimate(_is_log_weights(hmm, _guide(hmm, kind), x, 4000, seed=0))
    assert abs(est - log_z) < 3 * se, (est, log_z, se)
    # Zhat / Z over 20 seeds: mean within 3 standard errors of 1
    ratios = torch.tensor([math.exp(_estimate(_is_log_weights(hmm, _guide(hmm, kind), x, 100, seed=s))[0] - log_z)
                           for s in range(20)])
    assert abs(float(ratios.mean()) - 1) < 3 * float(ratios.std()) / math.sqrt(20), ratios


def test_wrong_estimators_fail_the_bound():
    """The bound has power: the wrong A, or dropping the emission factor, is caught."""
    hmm = _sticky_hmm()
    x = torch.tensor([0, 0, 1, 1, 2, 2, 1, 0])
    log_z = float(hmm.log_prob(x))
    wrong_A = HMM(hmm.A.roll(1, dims=1), hmm.B, hmm.lam)  # right B and lam, wrong transitions
    est, se = _estimate(_is_log_weights(wrong_A, None, x, 4000, seed=0))
    assert abs(est - log_z) > 3 * se, (est, log_z, se)
    no_emission = poutine.block(hmm, hide_fn=lambda site: site["is_observed"])
    est, se = _estimate(_is_log_weights(no_emission, HMMGuide.filtering(hmm), x, 4000, seed=0))
    assert abs(est - log_z) > 3 * se + 1, (est, log_z, se)


def _mini_smc(model: HMM, guide, x, n: int, seed: int) -> float:
    """Step-wise SMC over the Program protocol (multinomial resampling every step): log Zhat."""
    pyro.set_rng_seed(seed)
    ms: dict = {}
    gs: dict = {}
    model.init(ms, x)
    if guide is not None:
        guide.init(gs, x)
    log_z, t = 0.0, 0
    with torch.no_grad():
        while True:
            assert t < model.max_steps
            with pyro.plate("particles", n):
                gtr = poutine.trace(guide.step).get_trace(gs, t, x) if guide is not None else None
                tracer = poutine.trace(poutine.replay(model.step, trace=gtr) if guide is not None else model.step)
                done = tracer(ms, t, x)
            log_w = _per_particle(tracer.trace, n, observed=True if guide is None else None)
            if guide is not None:
                log_w = log_w - _per_particle(gtr, n)
            inc = float(torch.logsumexp(log_w, 0)) - math.log(n)
            log_z += inc
            if done is not None and bool(done.all()) or inc == float("-inf"):
                return log_z
            idx = torch.multinomial(torch.softmax(log_w, 0), n, replacement=True)
            reorder_state(ms, idx, n)
            reorder_state(gs, idx, n)
            t += 1


@pytest.mark.parametrize("kind", ["bootstrap", "filtering", "posterior"])
def test_stepwise_smc_over_the_program_is_unbiased(kind):
    hmm = _sticky_hmm()
    x = torch.tensor([0, 0, 1, 1, 2, 2, 1, 0])
    log_z = float(hmm.log_prob(x))
    ratios = torch.tensor([math.exp(_mini_smc(hmm, _guide(hmm, kind), x, 50, seed=s) - log_z) for s in range(20)])
    assert abs(float(ratios.mean()) - 1) < 3 * float(ratios.std()) / math.sqrt(20) + 1e-9, ratios


def test_predictive_generates_from_the_hmm():
    hmm = random_hmm(3, 3, 5, sparsity=0.3)
    N, T = 4000, 5
    pyro.set_rng_seed(0)
    samples = pyro.infer.Predictive(hmm, num_samples=N, parallel=True)(length=T)
    assert set(samples) == {f"{v}_{t}" for t in range(T) for v in ("z", "x")}
    assert all(v.shape == (N,) and v.dtype == torch.long for v in samples.values())
    for t, law in ((0, hmm.lam @ hmm.B), (1, hmm.lam @ hmm.A @ hmm.B)):
        freq = torch.bincount(samples[f"x_{t}"], minlength=3).double() / N
        assert (freq - law).abs().max() < 4 * math.sqrt(0.25 / N), (t, freq, law)
    z, x = (torch.stack([samples[f"{v}_{t}"] for t in range(T)], -1) for v in ("z", "x"))
    assert torch.isfinite(hmm.log_joint(z, x)).all()  # only possible paths are generated
    seq = pyro.infer.Predictive(hmm, num_samples=5)(length=T)  # sequential: one plain run per sample
    assert all(v.shape == (5,) for v in seq.values())


def test_zero_entries_give_neg_inf_not_nan():
    hmm = _sticky_hmm()  # A[2, 0] = 0, B[0, 2] = 0, lam[2] = 0
    x = torch.tensor([0, 2, 1])
    for z, finite in (([0, 1, 1], True), ([2, 1, 1], False), ([0, 0, 1], False), ([1, 2, 0], False)):
        data = {f"z_{t}": torch.tensor(v) for t, v in enumerate(z)}
        tr = poutine.trace(poutine.condition(hmm, data=data)).get_trace(x)
        lp = _per_particle(tr, 1)[0]
        assert not torch.isnan(lp) and bool(torch.isfinite(lp)) == finite
        torch.testing.assert_close(lp, hmm.log_joint(torch.tensor(z), x))
    # an impossible x: every proposal gives weights -inf, never NaN, and the guides still sample
    det = HMM(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.eye(2), torch.tensor([1.0, 0.0]))
    bad = torch.tensor([0, 0, 1, 0])
    assert torch.isneginf(det.log_prob(bad))
    for kind in ("bootstrap", "filtering", "posterior"):
        log_w = _is_log_weights(det, _guide(det, kind), bad, 16, seed=0)
        assert torch.isneginf(log_w).all(), kind


def test_hmm_tables_of_text_or_empty_get_a_config_error_naming_the_table():
    """Found by the public sweep: HMM('', ...) raised torch's TypeError (new(): invalid data type 'str'), empty
    tables a bare ValueError. Both are ConfigErrors naming the table now (still ValueErrors)."""
    from ppl_thought.errors import ConfigError

    A, B, lam = torch.eye(2), torch.full((2, 3), 1 / 3), torch.tensor([0.5, 0.5])
    with pytest.raises(ConfigError, match="HMM A must be a probability table"):
        HMM("", B, lam)
    with pytest.raises(ConfigError, match="HMM B must be a probability table"):
        HMM(A, b"\x00", lam)
    with pytest.raises(ConfigError, match="HMM A must be 2-D"):
        HMM(torch.zeros(0), B, lam)
    with pytest.raises(ConfigError, match="sums to"):
        HMM(A, B, torch.tensor([0.5, 0.6]))
    assert HMM(A.tolist(), B.numpy(), lam).num_observations == 3
