"""Greedy and beam search under a token automaton (pt.infer.greedy / beam_search) against exact answers:
greedy is the step-wise argmax of a full recomputation, and beam search with as many beams as admissible
sequences is the argmax found by enumerating them (scores from full-context forwards, no cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ppl_thought as pt
from ppl_thought.errors import ConfigError
from ppl_thought.lm import Transformer
from ppl_thought.projections import CharDFA, token_automaton, token_texts
from ppl_thought.vocab import BOS_ID, EOS_ID, PAD_ID, Vocab

VOCAB = Vocab(list("abc"))


def tiny_lm(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    lm = Transformer(len(VOCAB), d_model=16, n_layers=2, n_heads=2, max_len=64)
    with torch.no_grad():  # sharper than at initialisation: beams then disagree with greedy
        lm.lm_head.weight.mul_(8.0)
    return lm.eval()


def automaton(pattern: str = "[ab]{1,3}c?", max_len: int | None = None):
    return token_automaton(CharDFA.from_regex(pattern), token_texts(VOCAB), max_len=max_len)


def admitted(auto, limit: int) -> list[list[int]]:
    """Every token sequence (``<eos>`` included) the automaton accepts within ``limit`` tokens, by depth-first
    search over its table."""
    out, stack = [], [(auto.start, [])]
    while stack:
        s, z = stack.pop()
        if auto.final[s]:
            out.append(z)
            continue
        if len(z) == limit:
            continue
        for tok in np.nonzero(auto.next_state[s] >= 0)[0].tolist():
            stack.append((int(auto.next_state[s, tok]), z + [tok]))
    return out


def full_scores(lm, prompt: list[int], z: list[int], auto, score: str) -> float:
    """Sum of the per-token scores of z after prompt, each from one full forward (no cache)."""
    ctx = torch.tensor([[BOS_ID, *prompt, *z]])
    with torch.no_grad():
        logits = lm(ctx)[0][0, len(prompt):len(prompt) + len(z)].double()
    total, s = 0.0, auto.start
    for t, tok in enumerate(z):
        allowed = torch.as_tensor(auto.next_state[s] >= 0)
        allowed[[PAD_ID, BOS_ID]] = False
        row = logits[t]
        if score == "masked":
            row = row.masked_fill(~allowed, float("-inf"))
        total += float(torch.log_softmax(row, -1)[tok])
        s = int(auto.next_state[s, tok])
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_is_the_stepwise_argmax(seed):
    lm, auto, prompt = tiny_lm(seed), automaton(), VOCAB.encode("ab")
    out = pt.infer.greedy(lm, prompt, constraint=auto, max_new_tokens=6)
    z, s = [], auto.start
    while not auto.final[s]:
        with torch.no_grad():
            row = lm(torch.tensor([[BOS_ID, *prompt, *z]]))[0][0, -1]
        allowed = torch.as_tensor(auto.next_state[s] >= 0)
        allowed[[PAD_ID, BOS_ID]] = False
        tok = int(row.masked_fill(~allowed, float("-inf")).argmax())
        z.append(tok)
        s = int(auto.next_state[s, tok])
    assert out.tokens.shape[0] == 1 and bool(out.finished[0])
    assert out.tokens[0, : len(z)].tolist() == z and z[-1] == EOS_ID
    assert (out.tokens[0, len(z):] == PAD_ID).all()
    assert float(out.log_prob[0]) == pytest.approx(full_scores(lm, prompt, z, auto, "model"), abs=1e-5)
    assert auto.accepts(z)


@pytest.mark.parametrize("score", ["model", "masked"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_beam_as_wide_as_the_language_is_the_exact_argmax(seed, score):
    lm, auto, prompt = tiny_lm(seed), automaton(), VOCAB.encode("c")
    language = admitted(auto, 5)
    assert len(language) == 28  # [ab]{1,3} (14 strings) with or without c, then <eos>
    exact = {tuple(z): full_scores(lm, prompt, z, auto, score) for z in language}
    best = max(exact, key=exact.get)
    out = pt.infer.beam_search(lm, prompt, constraint=auto, width=len(language), max_new_tokens=5,
                                        score=score)
    assert out.finished.all() and len(out.tokens) == len(language)  # every sequence kept: nothing pruned
    found = {tuple(t for t in row.tolist() if t != PAD_ID): float(lp) for row, lp in zip(out.tokens, out.log_prob)}
    assert found.keys() == exact.keys()
    assert max(abs(found[z] - exact[z]) for z in exact) < 1e-5  # every score, through the reordered cache
    assert tuple(t for t in out.tokens[0].tolist() if t != PAD_ID) == best
    assert (out.log_prob[:-1] >= out.log_prob[1:]).all()  # best first
    narrow = pt.infer.beam_search(lm, prompt, constraint=auto, width=2, max_new_tokens=5, score=score)
    assert float(narrow.log_prob[0]) <= exact[best] + 1e-6 and all(auto.accepts(
        [t for t in row.tolist() if t != PAD_ID]) for row in narrow.tokens)


def test_beam_search_beats_greedy_somewhere_and_never_loses():
    """Over seeds, beam search (width 4) never scores below greedy and, on some seed, strictly above it: the
    search is not greedy under another name."""
    gaps = []
    for seed in range(6):
        lm, auto = tiny_lm(seed), automaton()
        g = pt.infer.greedy(lm, VOCAB.encode("a"), constraint=auto, max_new_tokens=5)
        b = pt.infer.beam_search(lm, VOCAB.encode("a"), constraint=auto, width=4, max_new_tokens=5)
        gaps.append(float(b.log_prob[0] - g.log_prob[0]))
    assert min(gaps) >= -1e-6 and max(gaps) > 1e-3


def test_unconstrained_and_unfinished_search():
    lm = tiny_lm(0)
    out = pt.infer.beam_search(lm, VOCAB.encode("ab"), width=3, max_new_tokens=2)
    assert out.tokens.shape == (3, 2) and (out.tokens[:, 0] != PAD_ID).all()
    assert not (out.tokens == BOS_ID).any()
    # no string of [ab]{4} fits in 2 tokens: every beam runs out of tokens, unfinished, still admissible
    auto = automaton("[ab]{4}")
    cut = pt.infer.beam_search(lm, VOCAB.encode("c"), constraint=auto, width=3, max_new_tokens=2)
    assert not cut.finished.any() and cut.tokens.shape == (3, 2)
    assert all(auto.admits_prefix(row.tolist()) for row in cut.tokens)


def test_bad_arguments_name_the_problem():
    lm = tiny_lm(0)
    with pytest.raises(ConfigError, match="width"):
        pt.infer.beam_search(lm, [6], width=0)
    with pytest.raises(ConfigError, match="score"):
        pt.infer.beam_search(lm, [6], score="best")
    with pytest.raises(ConfigError, match="one prompt"):
        pt.infer.beam_search(lm, [[6], [7]])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        pt.infer.greedy(lm, [6], max_new_tokens=0)
