"""``pt.models.Constrained``: an LM conditioned on a token automaton's language, checked against enumeration.

A bigram table over {a, b, e} and the lipogram "no e" lifted by ``token_automaton``: the exact mass of the
language (e-free strings ended by <eos>, or cut at ``max_tokens``) is a finite sum. Importance and SMC with
``guide=None`` estimate it without bias; masked decoding alone (no mass factors) is the wrong law.
"""

from __future__ import annotations

import itertools
import math

import pyro
import pytest
import torch

import ppl_thought as pt
from ppl_thought.errors import ArgumentTypeError, ConfigError
from ppl_thought.inference import SMC, Importance
from ppl_thought.lm import Tabular
from ppl_thought.projections import CharDFA, token_automaton, token_texts
from ppl_thought.vocab import EOS_ID

VOCAB = pt.Vocab(["a", "b", "e"])
L = 4


def setup():
    g = torch.Generator().manual_seed(0)
    lg = torch.full((len(VOCAB), len(VOCAB)), float("-inf"))
    cols = [EOS_ID] + VOCAB.ordinary_ids.tolist()
    lg[:, cols] = torch.randn(len(VOCAB), len(cols), generator=g)
    lm = Tabular(2, len(VOCAB), lg, trainable=False)
    auto = token_automaton(CharDFA.lipogram("e"), token_texts(VOCAB))
    return lm, auto


def exact_mass(lm: Tabular) -> float:
    """P(e-free and ended by <eos> within L tokens) + P(e-free first L tokens without <eos>)."""
    p = torch.softmax(lm.logits.double(), -1)
    a, b = VOCAB.id("a"), VOCAB.id("b")
    total = 0.0
    for k in range(L + 1):
        for s in itertools.product([a, b], repeat=k):
            prob, prev = 1.0, 1  # <bos>
            for t in s:
                prob *= float(p[prev, t])
                prev = t
            total += prob * float(p[prev, EOS_ID]) if k < L else prob
    return total


@pytest.mark.parametrize("engine", ["importance", "smc", "smc_twisted", "smc_lookahead"])
def test_constrained_mass_is_estimated_without_bias(engine):
    """Mean of Z-hat / Z over 20 seeds within 3 SE of 1 (the twist steers resampling but keeps the target);
    the masked proposal alone has no such weights: its Z-hat would be 1, far from Z."""
    lm, auto = setup()
    Z = exact_mass(lm)
    assert Z < 0.8
    twist = (lambda toks: 0.7 * (toks == VOCAB.id("a")).sum(-1).float()) if engine == "smc_twisted" else None
    twist = "lookahead" if engine == "smc_lookahead" else twist
    program = pt.models.Constrained(lm, auto, L, twist=twist)
    ratios = []
    for seed in range(20):
        pyro.set_rng_seed(seed)
        if engine == "importance":
            res = Importance(256).run(program, None, torch.zeros(0, dtype=torch.long))
        else:
            res = SMC(256, ess_threshold=0.7).run(program, None, torch.zeros(0, dtype=torch.long))
        ratios.append(math.exp(float(res.log_marginal)) / Z)
    r = torch.tensor(ratios)
    se = float(r.std() / math.sqrt(len(r)))
    assert abs(float(r.mean()) - 1) < 3 * se + 1e-3, (float(r.mean()), se)
    assert abs(1 / Z - 1) > 10 * se  # the unweighted masked law would be this far off


def test_constrained_refuses_bad_arguments():
    lm, auto = setup()
    with pytest.raises(ConfigError, match="max_tokens"):
        pt.models.Constrained(lm, auto, 0)
    with pytest.raises(ArgumentTypeError, match="Automaton"):
        pt.models.Constrained(lm, "no e", 4)
    with pytest.raises(ConfigError, match="twist"):
        pt.models.Constrained(lm, auto, 4, twist=3)
    with pytest.raises(ConfigError, match="lookahead"):
        pt.models.Constrained(lm, auto, 4, twist="look-ahead")


def test_log_mass_is_the_admitted_over_the_generable_mass():
    """Constrained.log_mass (the factor log Z_t of Section 3.3, read from the token rule's kept masked law): the
    logsumexp of the admitted logits minus that of every generable token (all but <pad> and <bos>, whatever
    their logits), 0 for ended rows, -inf (never NaN) for a row with nothing admitted or nothing generable; the
    draw that follows reuses the law (the rule keeps it for these logits and states until they change)."""
    lm, auto = setup()
    program = pt.models.Constrained(lm, auto, L)
    g = torch.Generator().manual_seed(3)
    n, V = 12, len(VOCAB)
    logits = 4 * torch.randn(n, V, generator=g)  # <pad> and <bos> finite on purpose: they must not count
    s = program.rule.start(n, "cpu")
    s[1] = auto.num_states  # dead: nothing admitted
    logits[2] = float("-inf")  # nothing generable
    done = torch.zeros(n, dtype=torch.bool)
    done[3] = True
    got = program.log_mass(logits, s, done)
    allowed = program.rule.allowed(s)
    admitted = torch.logsumexp(logits.masked_fill(~allowed, float("-inf")), -1)
    generable = torch.logsumexp(logits[:, 2:], -1)
    ref = admitted - generable
    rows = torch.tensor([i for i in range(n) if i not in (1, 2, 3)])
    assert torch.allclose(got[rows], ref[rows], atol=1e-5)
    assert got[3] == 0 and torch.isneginf(got[1]) and torch.isneginf(got[2]) and not torch.isnan(got).any()
    assert program.rule.masked_law(logits, s) is program.rule.masked_law(logits, s)
