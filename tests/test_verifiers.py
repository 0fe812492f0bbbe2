"""Verifiers and verifier-assisted samplers against exact answers (thesis Ch. 3: (2.37), Defs 3.1.3-3.1.6,
Props 3.1.1-3.1.2).

The LMs are Tabular n-gram tables, so every distribution is enumerable: the restricted distribution
p(s) ~ 1(s in A) p_O(s) that rejection sampling must hit, and the locally renormalised distribution
that tokenwise rejection sampling actually samples (Prop 3.1.2).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import ppl_thought as pt
from ppl_thought.errors import (
    ConfigError,
    MalformedSequenceError,
    PPLThoughtError,
    SamplingBudgetError,
    UnknownTokenError,
    UnsatisfiableConstraintError,
)
from ppl_thought.inference import Result
from ppl_thought.lm import Tabular
from ppl_thought.projections.automaton import AutomatonBuilder
from ppl_thought.verifiers import ProcessVerifier, RejectionSampling, TokenwiseRejection, dyck

BRACKETS = pt.Vocab(["(", ")", "[", "]"])
BITS = pt.Vocab(["0", "1"])
ZERO, ONE = BITS.id("0"), BITS.id("1")


# ---------------------------------------------------------------------------------------------- helpers
def is_dyck(s: tuple[int, ...], pairs: list[tuple[int, int]], D: int) -> bool:
    """Brute-force recursive membership in Dyck_{k,D} (2.37): balanced, every prefix of depth <= D."""
    opens = {o: t for t, (o, _) in enumerate(pairs)}
    closes = {c: t for t, (_, c) in enumerate(pairs)}

    def go(i: int, stack: tuple[int, ...]) -> bool:
        if i == len(s):
            return not stack
        a = s[i]
        if a in opens:
            return len(stack) < D and go(i + 1, stack + (opens[a],))
        if a in closes:
            return bool(stack) and stack[-1] == closes[a] and go(i + 1, stack[:-1])
        return False

    return go(0, ())


def seq_log_prob(lm: Tabular, s: tuple[int, ...]) -> float:
    """log p_O(s) of a bigram (order 2) or unigram (order 1) Tabular LM, from its table."""
    logp = torch.log_softmax(lm.logits.double(), -1)
    prev, total = 1, 0.0  # <bos>
    for a in s:
        total += float(logp[prev, a] if lm.order == 2 else logp[a])
        prev = a
    return total


def restricted(lm: Tabular, A: list[tuple[int, ...]]) -> np.ndarray:
    """p(s) ~ 1(s in A) p_O(s) over the strings of A (Section 3.1.1)."""
    lp = np.array([seq_log_prob(lm, s) for s in A])
    p = np.exp(lp - lp.max())
    return p / p.sum()


def tokenwise_law(lm: Tabular, A: list[tuple[int, ...]], alphabet: list[int]) -> np.ndarray:
    """The distribution tokenwise rejection sampling draws from (Def 3.1.5, Prop 3.1.2): each token from
    O(. | s) restricted to the tokens t with s o t completable in A, renormalised."""
    prefixes = {s[:i] for s in A for i in range(len(s) + 1)}
    out = []
    for s in A:
        p = 1.0
        for i in range(len(s)):
            pre = s[:i]
            w = {t: math.exp(seq_log_prob(lm, pre + (t,)) - seq_log_prob(lm, pre)) for t in alphabet}
            p *= w[s[i]] / sum(w[t] for t in alphabet if pre + (t,) in prefixes)
        out.append(p)
    return np.array(out)


def counts_of(z: torch.Tensor, A: list[tuple[int, ...]]) -> np.ndarray:
    index = {s: j for j, s in enumerate(A)}
    c = np.zeros(len(A))
    for row in z.tolist():
        c[index[tuple(row)]] += 1  # a KeyError here would be a sample outside A
    return c


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Pearson chi-square, pooling the cells with expected count < 5 into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    res = chisquare(counts, exp)
    return float(res.statistic), float(res.pvalue)


def bracket_lm() -> Tabular:
    """A bigram over the four brackets (specials at -inf) that favours closing what it just opened."""
    V = len(BRACKETS)
    g = torch.Generator().manual_seed(0)
    lg = torch.full((V, V), float("-inf"))
    lg[:, 6:] = 0.5 * torch.randn(V, 4, generator=g)
    lg[BRACKETS.id("("), BRACKETS.id(")")] += 1.5
    lg[BRACKETS.id("["), BRACKETS.id("]")] += 1.5
    lg[1, BRACKETS.id(")")] = lg[1, BRACKETS.id("]")] = -3.0
    return Tabular(2, V, lg, trainable=False)


def uniform_bits_lm() -> Tabular:
    """The uniform oracle on {0, 1} of Props 3.1.1-3.1.2 (a unigram; specials never generated)."""
    lg = torch.full((len(BITS),), float("-inf"))
    lg[[ZERO, ONE]] = 0.0
    return Tabular(1, len(BITS), lg, trainable=False)


def only_zeros(D: int):
    """A = {0^D} (Prop 3.1.1)."""
    b = AutomatonBuilder(len(BITS), "0^D")
    s = [b.add_state(final=(i == D)) for i in range(D + 1)]
    for i in range(D):
        b.edge(s[i], [ZERO], s[i + 1])
    return b.build(max_len=D)


def has_a_zero():
    """A = strings with at least one 0 (Prop 3.1.2; the length D comes from the verifier)."""
    b = AutomatonBuilder(len(BITS), "has-a-0")
    none, seen = b.add_state(), b.add_state(final=True)
    b.edge(none, [ONE], none)
    b.edge(none, [ZERO], seen)
    b.edge(seen, [ZERO, ONE], seen)
    return b.build()


PAIRS = [(BRACKETS.id("("), BRACKETS.id(")")), (BRACKETS.id("["), BRACKETS.id("]"))]
ALPHABET = [t for p in PAIRS for t in p]


# ---------------------------------------------------------------------------------------------- (d) the automaton
@pytest.mark.parametrize("k,D", [(1, 1), (1, 3), (2, 2), (2, 3)])
def test_dyck_automaton_accepts_exactly_dyck_kD(k, D):
    """(2.37): accepted strings = brute-force Dyck_{k,D}, for every string up to length 7 over the brackets
    and <eos>; the process verifier of length N = "is a prefix of a length-N member" (Def 3.1.3)."""
    vocab = BRACKETS if k == 2 else pt.Vocab(["(", ")"])
    pairs = PAIRS[:k] if k == 2 else [(vocab.id("("), vocab.id(")"))]
    aut = dyck(k, D, vocab)
    alphabet = [t for p in pairs for t in p] + [vocab.eos_id]
    any_len = ProcessVerifier(aut)
    for n in range(8):
        strings = list(itertools.product(alphabet, repeat=n))
        z = torch.tensor(strings, dtype=torch.long).reshape(len(strings), n)
        truth = torch.tensor([is_dyck(s, pairs, D) for s in strings])
        assert torch.equal(any_len.accepts(z), truth), (k, D, n)
        assert [aut.accepts(s) for s in strings[:50]] == truth[:50].tolist()
    N = 6
    members = [s for s in itertools.product(alphabet, repeat=N) if is_dyck(s, pairs, D)]
    prefixes = {s[:i] for s in members for i in range(N + 1)}
    ver = ProcessVerifier(aut, length=N)
    for n in range(N + 2):
        strings = list(itertools.product(alphabet, repeat=n))
        z = torch.zeros(len(strings), N + 1, dtype=torch.long)  # right-padded
        z[:, :n] = torch.tensor(strings, dtype=torch.long).reshape(len(strings), n)
        assert ver(z).tolist() == [s in prefixes for s in strings], (k, D, n)


def test_dyck_and_verifier_refuse_bad_arguments():
    with pytest.raises(ConfigError):
        dyck(0, 2, BRACKETS)
    with pytest.raises(ConfigError):
        dyck(2, -1, BRACKETS)
    with pytest.raises(ConfigError):
        dyck(1, 2, BRACKETS)  # 4 ordinary tokens for 1 type
    with pytest.raises(ConfigError):
        dyck(2, 2, BRACKETS, brackets=[("(", ")"), ("(", "]")])
    with pytest.raises(UnknownTokenError):
        dyck(1, 2, BRACKETS, brackets=[("{", "}")])
    with pytest.raises(ConfigError):
        ProcessVerifier(dyck(2, 2, BRACKETS), length=-1)
    with pytest.raises(MalformedSequenceError):
        ProcessVerifier(dyck(2, 2, BRACKETS), 4)(torch.tensor([[0, 6, 7, 0]]))  # token after <pad>
    assert issubclass(ConfigError, PPLThoughtError)


def test_engines_refuse_bad_arguments():
    lm, ver = bracket_lm(), ProcessVerifier(dyck(2, 2, BRACKETS), 4)
    with pytest.raises(ConfigError):
        RejectionSampling(10, 6).run(lm, ver)  # verifier length 4 != max_len 6
    with pytest.raises(ConfigError):
        TokenwiseRejection(0, 4).run(lm, ver)
    with pytest.raises(ConfigError):
        RejectionSampling(10, 4, batch_size=0)
    with pytest.raises(ConfigError):
        TokenwiseRejection(10, 4).run(uniform_bits_lm(), ver)  # vocabularies differ
    with pytest.raises(UnsatisfiableConstraintError):  # odd length: no balanced string (FAIL, Def 3.1.2)
        TokenwiseRejection(10, 5).run(lm, ProcessVerifier(dyck(2, 2, BRACKETS), 5))
    with pytest.raises(SamplingBudgetError):
        RejectionSampling(10, 5, max_rounds=3).run(lm, ProcessVerifier(dyck(2, 2, BRACKETS), 5))


# ---------------------------------------------------------------------------------------------- (a) exactness
def dyck_task(N: int = 6):
    lm = bracket_lm()
    ver = ProcessVerifier(dyck(2, 2, BRACKETS), N)
    A = [s for s in itertools.product(ALPHABET, repeat=N) if is_dyck(s, PAIRS, 2)]
    return lm, ver, A


def test_rejection_sampling_is_exactly_the_restricted_distribution():
    """Def 3.1.4: rejection samples follow p(s) ~ 1(s in A) p_O(s) (chi-square); tokenwise rejection, the
    deliberately wrong sampler for this target, fails the same test."""
    lm, ver, A = dyck_task()
    assert len(A) == 32  # 4 height-<=2 Dyck paths of length 6 x 2^3 bracket types
    p = restricted(lm, A)
    torch.manual_seed(0)
    res = RejectionSampling(3000, 6, batch_size=4096).run(lm, ver)
    assert isinstance(res, Result) and res.samples["z"].shape == (3000, 6)
    stat, pval = chi2_pvalue(counts_of(res.samples["z"], A), p)
    assert pval > 1e-3, (stat, pval)
    assert res.stats["lm_calls"] == 6 * res.stats["verifier_calls"]
    assert int(res.stats["lm_calls_per_sample"].sum()) == res.stats["lm_calls"]
    torch.manual_seed(0)
    wrong = TokenwiseRejection(3000, 6).run(lm, ver)
    stat_w, pval_w = chi2_pvalue(counts_of(wrong.samples["z"], A), p)
    assert pval_w < 1e-8, (stat_w, pval_w)


def test_tokenwise_rejection_samples_the_locally_renormalised_law():
    """Def 3.1.5 / Prop 3.1.2 in general: tokenwise samples follow prod_i O(s_i | s_<i) / Z(s_<i), Z summing
    O over the completable tokens (chi-square passes against that law)."""
    lm, ver, A = dyck_task()
    q = tokenwise_law(lm, A, ALPHABET)
    assert abs(q.sum() - 1) < 1e-9
    torch.manual_seed(1)
    res = TokenwiseRejection(3000, 6).run(lm, ver)
    stat, pval = chi2_pvalue(counts_of(res.samples["z"], A), q)
    assert pval > 1e-3, (stat, pval)


# ---------------------------------------------------------------------------------------------- (b) Prop 3.1.2
def test_tokenwise_bias_of_proposition_3_1_2():
    """Uniform oracle on {0,1}^D, A = strings with a 0: tokenwise rejection gives 1^{D-1} 0 mass 2^{-(D-1)}
    (every other string 2^{-D}), the restricted distribution 1 / (2^D - 1). Measured within 3 SE of the
    former and more than 8 SE from the latter; rejection sampling within 3 SE of the latter."""
    D, n = 4, 4000
    lm, ver = uniform_bits_lm(), ProcessVerifier(has_a_zero(), D)
    target = torch.tensor([ONE] * (D - 1) + [ZERO])
    torch.manual_seed(2)
    z = TokenwiseRejection(n, D).run(lm, ver).samples["z"]
    assert ver.accepts(z).all()
    freq = float((z == target).all(-1).float().mean())
    predicted, exact = 2.0 ** -(D - 1), 1 / (2**D - 1)
    se = math.sqrt(predicted * (1 - predicted) / n)
    assert abs(freq - predicted) < 3 * se, (freq, predicted, se)
    assert abs(freq - exact) > 8 * se, (freq, exact, se)
    torch.manual_seed(3)
    zr = RejectionSampling(n, D, batch_size=n).run(lm, ver).samples["z"]
    freq_r = float((zr == target).all(-1).float().mean())
    assert abs(freq_r - exact) < 3 * math.sqrt(exact * (1 - exact) / n), (freq_r, exact)


# ---------------------------------------------------------------------------------------------- (c) Prop 3.1.1
def test_oracle_complexity_of_proposition_3_1_1():
    """Uniform oracle on {0,1}^D, A = {0^D}: expected LM calls 2^D D for rejection sampling (D x a geometric
    number of strings with p = 2^-D), 2D for tokenwise rejection (D geometric(1/2) counts). Measured means
    within 4 standard errors (the sample SE of the per-sample counts, which are i.i.d.)."""
    D = 5
    lm, ver = uniform_bits_lm(), ProcessVerifier(only_zeros(D), D)
    torch.manual_seed(4)
    rej = RejectionSampling(400, D, batch_size=2048).run(lm, ver)
    c = rej.stats["lm_calls_per_sample"].double()
    se = float(c.std() / math.sqrt(c.numel()))
    assert abs(float(c.mean()) - 2**D * D) < 4 * se, (float(c.mean()), 2**D * D, se)
    # the SE itself matches the geometric law: sd = D sqrt(1 - p) / p
    assert abs(se - D * math.sqrt(1 - 2**-D) * 2**D / math.sqrt(400)) < 0.2 * se
    v = rej.stats["verifier_calls_per_sample"].double()
    assert abs(float(v.mean()) - 2**D) < 4 * float(v.std() / math.sqrt(v.numel()))
    assert (rej.samples["z"] == ZERO).all()

    torch.manual_seed(5)
    tok = TokenwiseRejection(2000, D).run(lm, ver)
    t = tok.stats["lm_calls_per_sample"].double()
    se_t = math.sqrt(2 * D / t.numel())  # variance of a geometric(1/2) count is 2
    assert abs(float(t.mean()) - 2 * D) < 4 * se_t, (float(t.mean()), 2 * D, se_t)
    assert tok.stats["verifier_calls"] == tok.stats["lm_calls"] == int(t.sum())
    assert (tok.samples["z"] == ZERO).all()
