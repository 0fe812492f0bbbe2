"""Numerics at the edges (issue 41, item 6): normalisers exact for huge tied logits on both backends (Def 2.8's
masked softmax), against the exact value -log 2."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ppl_thought.distributions.token_rule import TokenRule, log_mass_ratio, masked_log_softmax, token_step
from ppl_thought.projections.automaton import Automaton
from ppl_thought.validation import FloatOrNaN, checked

LOG_HALF = -math.log(2.0)


def tied(V: int = 5, big: float = 1e30) -> torch.Tensor:
    """Two tied logits of ``big`` (ids 2 and 3), the rest -big: each of the two has probability 1/2 exactly."""
    x = torch.full((1, V), -big)
    x[0, 2] = x[0, 3] = big
    return x


def only(V: int, ids: list[int]) -> Automaton:
    """One state (0, final) that admits the tokens ``ids`` and stays."""
    delta = np.full((1, V), -1, dtype=np.int64)
    delta[0, ids] = 0
    return Automaton(delta, np.array([True]), np.zeros(1, dtype=np.int64))


@pytest.mark.parametrize("big", [1e30, 3e38, 1e4])
def test_tied_huge_logits_have_log_probability_minus_log_2(big):
    x, s = tied(big=big), torch.zeros(1, dtype=torch.long)
    rule = TokenRule(None, 5)
    lp = rule.log_probs(x, s)
    assert float(lp[0, 2]) == pytest.approx(LOG_HALF, abs=1e-6) and float(lp[0, 3]) == pytest.approx(LOG_HALF)
    assert float(torch.logsumexp(lp, -1)) == pytest.approx(0.0, abs=1e-6)
    st = token_step(rule, x, s, generator=torch.Generator().manual_seed(0))
    assert int(st.token) in (2, 3) and float(st.log_prob) == pytest.approx(LOG_HALF, abs=1e-6)
    assert float(masked_log_softmax(x, torch.ones(1, 5, dtype=torch.bool))[0, 2]) == pytest.approx(LOG_HALF)


def test_the_old_normaliser_lost_log_2():
    """The float32 normaliser logsumexp(x) = 1e30 + log 2 rounds to 1e30: the old x - logsumexp(x) gave 0."""
    x = tied()
    assert float((x - torch.logsumexp(x, -1, keepdim=True))[0, 2]) == 0.0  # the old answer, wrong


def test_the_mass_of_an_automaton_on_one_of_two_tied_huge_logits_is_one_half():
    """log Z_t = log Z_rule - log Z_free of Constrained (Section 3.3): one of two tied 1e30 logits admitted."""
    x, s = tied(), torch.zeros(1, dtype=torch.long)
    rule, free = TokenRule(only(5, [2, 4]), 5), TokenRule(None, 5)
    assert float(log_mass_ratio(rule, free, x, s)) == pytest.approx(LOG_HALF, abs=1e-6)
    assert float(rule.log_normaliser(x, s) - free.log_normaliser(x, s)) == 0.0  # the difference of the sums: lost
    st = token_step(rule, x, s, generator=torch.Generator().manual_seed(1))
    assert int(st.token) == 2 and float(st.log_prob) == pytest.approx(0.0, abs=1e-6)  # the only admitted heavy one
    none = TokenRule(only(5, [4]), 5)  # admits only a -1e30 token: mass exp(-2e30) = 0 in float32, -inf not NaN
    lz = log_mass_ratio(none, free, x, s)
    assert not torch.isnan(lz).any() and float(lz) < -1e29


def test_jax_normalisers_are_exact_for_tied_huge_logits():
    jnp = pytest.importorskip("jax.numpy")
    from ppl_thought.numpyro.distributions import masked_log_softmax as jax_masked

    out = np.asarray(jax_masked(jnp.asarray(tied().numpy()), jnp.ones((1, 5), bool)))
    assert out[0, 2] == pytest.approx(LOG_HALF, abs=1e-6) and out[0, 3] == pytest.approx(LOG_HALF, abs=1e-6)


# ---------------------------------------------------------------------------------------------- (b) NaN arguments
def test_nan_arguments_are_refused_by_name():
    import ppl_thought as pt
    from ppl_thought.draws import bounded_num_draws
    from ppl_thought.errors import ArgumentTypeError, ConfigError

    assert bounded_num_draws(100.0) == 56  # 56 * log10(56) = 97.9 <= 100 < 57 * log10(57) = 100.1
    with pytest.raises(ConfigError, match="ess = inf"):  # inf / log10(inf) was a bare ValueError
        bounded_num_draws(float("inf"))
    for call, name in [(lambda: bounded_num_draws(float("nan")), "ess"),
                       (lambda: bounded_num_draws(np.float32("nan")), "ess"),
                       (lambda: pt.infer.SMC(4, ess_threshold=float("nan")), "ess_threshold"),
                       (lambda: pt.infer.SMC(4, ess_threshold=np.float64("nan")), "ess_threshold")]:
        with pytest.raises(ConfigError, match=f"{name} is NaN, where a number is due") as e:
            call()
        assert isinstance(e.value, ArgumentTypeError)


def test_a_hint_may_admit_nan():
    @checked
    def f(a: float, b: FloatOrNaN = 0.0) -> float:
        return b

    assert math.isnan(f(1.0, float("nan")))  # (hints resolve in this module: FloatOrNaN is imported at its top)
    with pytest.raises(ValueError, match="a is NaN"):
        f(float("nan"))


# ---------------------------------------------------------------------------------------------- (c) tokenizer prints
def _lm_with_vocab(vocab):
    from ppl_thought.lm.tabular import Tabular

    V = len(vocab)
    lm = Tabular(1, V, torch.zeros(V), trainable=False)
    lm.vocab = vocab  # an LM that knows its tokenizer (pt.lm.HuggingFace has lm.vocab)
    return lm


def test_an_automaton_from_another_tokenizers_texts_is_refused_where_it_meets_the_lm():
    import dataclasses

    import ppl_thought as pt
    from ppl_thought.errors import ConfigError, TokenizerMismatchError
    from ppl_thought.program import OneTokenStep
    from ppl_thought.projections import CharDFA, token_automaton, token_texts
    from ppl_thought.vocab import Vocab

    ours, other = Vocab(["a", "e", "x"]), Vocab(["e", "a", "x"])  # same size, the texts of "a" and "e" swapped
    no_e = CharDFA.lipogram("e")
    foreign = token_automaton(no_e, token_texts(other))
    own = token_automaton(no_e, token_texts(ours))
    assert foreign.tokenizer != own.tokenizer and foreign.vocab_size == own.vocab_size == len(ours)
    lm = _lm_with_vocab(ours)
    with pytest.raises(TokenizerMismatchError, match="another tokenizer") as e:
        pt.models.Constrained(lm, foreign, 6)
    assert isinstance(e.value, ConfigError) and "token_texts(lm.vocab)" in str(e.value)
    with pytest.raises(TokenizerMismatchError, match="LMSequence"):
        pt.dist.LMSequence(lm, constraint=foreign, max_len=6)
    assert pt.dist.LMSequence(lm, constraint=own, max_len=6).constraint is own
    bare = _lm_with_vocab(ours)
    del bare.vocab  # an LM without a vocabulary: the vocab= argument is what is checked
    with pytest.raises(TokenizerMismatchError, match=r"LMSequence \(its vocab=\)"):
        pt.dist.LMSequence(bare, constraint=foreign, max_len=6, vocab=ours)
    assert pt.dist.LMSequence(bare, constraint=own, max_len=6, vocab=ours).constraint is own
    model = pt.models.Constrained(lm, own, 6)  # built for this vocabulary: accepted
    assert OneTokenStep.of(model, "greedy").rule.constraint is own
    # the silent old answer: without the check the foreign automaton lets the LM write "e" (its id is "a" in `other`)
    unchecked = dataclasses.replace(foreign, tokenizer=None)
    model = pt.models.Constrained(lm, unchecked, 6)
    torch.manual_seed(0)
    z = pt.infer.Importance(64).run(model, None).samples
    assert any(bool((v == ours.id("e")).any()) for v in z.values())  # outside the lipogram: why it is checked
    # OneTokenStep.of checks a step whose parts disagree (a program built around the constructor)
    step = OneTokenStep.of(pt.models.Constrained(lm, own, 6), "greedy")
    bad = dataclasses.replace(step, rule=type(step.rule)(foreign, len(ours)))

    class Prog:
        def one_token_step(self):
            return bad

    with pytest.raises(TokenizerMismatchError, match="greedy on Prog"):
        OneTokenStep.of(Prog(), "greedy")


def test_fragment_texts_and_sizes_keep_their_checks():
    from ppl_thought.projections import CharDFA, token_automaton, token_texts
    from ppl_thought.projections.token_lift import check_tokenizer, vocab_fingerprints
    from ppl_thought.vocab import Vocab

    v = Vocab(["a", "b"])
    auto = token_automaton(CharDFA.lipogram("b"), token_texts(v, keep_fragments=True))
    assert auto.tokenizer in vocab_fingerprints(v)
    check_tokenizer(auto, _lm_with_vocab(v), "here")  # passes
    check_tokenizer(auto, object(), "here")  # an LM without a vocabulary: nothing to compare


# ---------------------------------------------------------------------------------------------- (d) clamping sites
TINY = 1.29e-12  # below float32 eps (1.19e-7): torch's probs= clamps it to eps
A = torch.tensor([[0.9, 0.1], [0.3, 0.7]])  # transitions
B = torch.tensor([[0.6, 0.4 - TINY, TINY], [0.2, 0.8 - TINY, TINY]])  # emissions: symbol 2 is (almost) impossible
X = torch.tensor([0, 1, 2, 1, 1, 2, 0, 0, 2, 1])  # three emissions of probability 1.29e-12 each


def hmm(sample, observe):
    """NumPyro's HMM example written literally with torch's Categorical(probs=...)."""
    import pyro.distributions as dist

    def model(x):
        z = sample("z_0", dist.Categorical(probs=torch.tensor([0.5, 0.5])))
        for t in range(len(x)):
            if t:
                z = sample(f"z_{t}", dist.Categorical(probs=A[z]))
            observe(f"x_{t}", dist.Categorical(probs=B[z]), x[t])

    return model


def exact_hmm_log_marginal(x) -> float:
    """The forward algorithm in float64 (3.1): log p(x) exactly."""
    a, b = A.double(), B.double()
    alpha = torch.tensor([0.5, 0.5], dtype=torch.float64) * b[:, x[0]]
    for t in range(1, len(x)):
        alpha = (alpha @ a) * b[:, x[t]]
    return float(alpha.sum().log())


def test_a_probs_site_is_scored_exactly_by_the_verbs():
    import pyro
    import pyro.distributions as dist

    import ppl_thought as pt
    from ppl_thought.distributions.unclamped import unclamped

    d = dist.Categorical(probs=torch.tensor([1 - TINY, TINY, 0.0]))
    assert float(d.log_prob(torch.tensor(1))) == pytest.approx(-15.94, abs=0.01)  # torch's clamp: the old answer
    assert float(d.log_prob(torch.tensor(2))) == pytest.approx(-15.94, abs=0.01)  # p = 0 scored as eps
    exact = unclamped(d, "x")
    assert float(exact.log_prob(torch.tensor(1))) == pytest.approx(math.log(TINY), rel=1e-6)  # -27.38
    assert torch.isneginf(exact.log_prob(torch.tensor(2)))
    assert isinstance(exact, dist.Categorical) and torch.equal(exact.probs, d.probs)  # the same law
    bern = unclamped(dist.Bernoulli(probs=torch.tensor([TINY, 1.0])), "b")
    assert torch.allclose(bern.log_prob(torch.tensor([1.0, 1.0])), torch.tensor([math.log(TINY), 0.0]))
    assert torch.isneginf(bern.log_prob(torch.tensor([1.0, 0.0]))[1])
    ind = unclamped(dist.Categorical(probs=torch.tensor([[1 - TINY, TINY]])).to_event(1), "i")
    assert float(ind.log_prob(torch.tensor([1]))) == pytest.approx(math.log(TINY), rel=1e-6)
    logits_site = dist.Categorical(logits=torch.tensor([0.0, 1.0]))
    assert unclamped(logits_site, "l") is logits_site  # nothing to fix: the same object

    def model():
        pt.observe("y", dist.Categorical(probs=torch.tensor([1 - TINY, TINY])), torch.tensor(1))

    tr = pyro.poutine.trace(model).get_trace()
    assert float(tr.log_prob_sum()) == pytest.approx(math.log(TINY), rel=1e-6)


def test_a_clamping_site_without_an_exact_form_is_flagged_once_by_name():
    import warnings

    import pyro.distributions as dist

    from ppl_thought.distributions.unclamped import unclamped

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            unclamped(dist.Binomial(4, probs=torch.tensor(TINY)), "counts_site")
    msgs = [str(m.message) for m in w if "counts_site" in str(m.message)]
    assert len(msgs) == 1 and "logits=" in msgs[0]


def test_the_hmm_of_the_issue_gets_its_exact_log_marginal():
    """Bootstrap Importance on the literal HMM: plain pyro.sample sites are clamped (three emissions scored -15.94
    instead of -27.38: log Z-hat too high by about 34 nats); the library's verbs score them exactly."""
    import pyro

    import ppl_thought as pt

    exact = exact_hmm_log_marginal(X)
    assert 3 * math.log(TINY) - 15 < exact < 3 * math.log(TINY)  # the three tiny emissions dominate it
    torch.manual_seed(0)
    old = pt.infer.Importance(4000, fast=False, max_plate_nesting=0).run(
        hmm(pyro.sample, lambda n, d, v: pyro.sample(n, d, obs=v)), None, X)
    torch.manual_seed(0)
    new = pt.infer.Importance(4000, fast=False, max_plate_nesting=0).run(hmm(pt.sample, pt.observe), None, X)
    gap = 3 * (math.log(torch.finfo(torch.float32).eps) - math.log(TINY))  # 34.3 nats
    assert float(old.log_marginal) == pytest.approx(exact + gap, abs=0.5)  # the silent old answer
    assert float(new.log_marginal) == pytest.approx(exact, abs=max(0.1, 4 * float(new.log_marginal_stderr)))
