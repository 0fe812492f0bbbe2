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
