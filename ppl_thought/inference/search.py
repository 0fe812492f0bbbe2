"""Greedy decoding and beam search, for comparison with the samplers (docs/architecture.md, "Engines").

The usual deterministic decoders of an LM under
a token automaton (``pt.infer.greedy(lm, prompt, constraint=auto)``). They are not samplers of any law
the engines target: greedy takes the most probable admissible token at each step; beam search keeps the
``width`` best prefixes by log-probability (one batch of ``width`` rows, the KV cache reordered with the beams),
so with a ``width`` at least the number of admissible sequences it returns the exact argmax of the score over
them. Score ``"model"``: the LM's own log-probabilities of the tokens (the mode of the constrained posterior
p(z | z in C), the law SMC approximates); ``"masked"``: the masked softmax of Def 2.8 (the law of masked
decoding, ``LMSequence`` under a constraint).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppl_thought.checks import integer
from ppl_thought.distributions.lm_state import TokenRule
from ppl_thought.errors import ConfigError
from ppl_thought.lm.base import as_id_batch, lm_device
from ppl_thought.lm.base import step as lm_step
from ppl_thought.vocab import BOS_ID, EOS_ID, PAD_ID

SCORES = ("model", "masked")


@dataclass
class Searched:
    """The sequences a search found, best first: ``tokens [K, m]`` (new tokens, ``<pad>`` after ``<eos>``),
    ``log_prob [K]`` (the search's score of each, ``<eos>`` included), ``finished [K]`` (ended in a final
    state of the constraint, or with ``<eos>``; unfinished ones ran out of ``max_new_tokens`` and come after
    every finished one), the ``prompt`` and the ``score`` used."""

    tokens: torch.Tensor
    log_prob: torch.Tensor
    finished: torch.Tensor
    prompt: torch.Tensor
    score: str


def _step_scores(logits: torch.Tensor, s: torch.Tensor, rule: TokenRule, score: str) -> torch.Tensor:
    """``[W, V]`` log-probabilities of the next token, -inf where the constraint does not admit it."""
    if score == "masked":
        return rule.log_probs(logits, s)  # Def 2.8
    own = torch.log_softmax(logits.float(), -1)
    return own.masked_fill(~rule.allowed(s), float("-inf"))


@torch.no_grad()
def beam_search(lm: torch.nn.Module, prompt, *, constraint=None, width: int = 4, max_new_tokens: int = 32,
                score: str = "model") -> Searched:
    """Beam search under a token automaton (module docstring, "Search"), batched over the beams.

    Args:
        lm: an LM (LM protocol, lm/base.py): ``pt.lm.Transformer``, ``pt.lm.HuggingFace``, ...
        prompt: library ids (1-D); ``<bos>`` is written before them.
        constraint: a token :class:`~ppl_thought.projections.automaton.Automaton` (e.g. ``token_automaton``) or
            ``None`` (every token but ``<pad>`` / ``<bos>``).
        width: the number of beams W. The W best prefixes (or finished sequences, which keep their slot and
            score) by total score are kept at each step: one top-k over ``[W, V]``, the cache reordered by the
            beams' parents (``cache.reorder``). With W >= the number of admissible sequences of at most
            ``max_new_tokens`` tokens nothing is pruned and the best one is the exact argmax.
        max_new_tokens: the most tokens generated (``<eos>`` included).
        score: ``"model"`` (the LM's own log-probabilities) or ``"masked"`` (masked softmax, Def 2.8).

    Returns:
        :class:`Searched` with up to W sequences, best first (sequences whose score is -inf are dropped).
    """
    width = integer("width", width)
    max_new_tokens = integer("max_new_tokens", max_new_tokens)
    if score not in SCORES:
        raise ConfigError(f"score must be one of {SCORES}, got {score!r}")
    device = lm_device(lm)
    prompt_ids = as_id_batch(prompt, "prompt", device)
    if prompt_ids.shape[0] != 1:
        raise ConfigError(f"beam_search takes one prompt (1-D ids), got shape {tuple(prompt_ids.shape)}")
    V = int(lm.vocab_size)
    rule = TokenRule(constraint, V)
    ctx = torch.cat([torch.full((1, 1), BOS_ID, dtype=torch.long, device=device), prompt_ids], 1)
    logits, cache = lm(ctx)
    logits, cache = logits[:, -1].expand(width, V), cache.expand(width)
    s = rule.start(width, device)
    total = torch.full((width,), float("-inf"), device=device)
    total[0] = 0.0  # one live beam to start with; the others fill from its candidates
    done = torch.zeros(width, dtype=torch.bool, device=device)
    finished = torch.zeros(width, dtype=torch.bool, device=device)
    tokens = torch.empty(width, 0, dtype=torch.long, device=device)
    is_final = getattr(constraint, "is_final", None)
    # a finished beam's one continuation: <pad>, at its score
    keep = torch.full((1, V), float("-inf"), device=device).index_fill_(1, torch.tensor([PAD_ID], device=device), 0.0)
    for _ in range(max_new_tokens):
        cand = total[:, None] + torch.where(done[:, None], keep, _step_scores(logits, s, rule, score))
        total, flat = cand.reshape(-1).topk(width)
        parent, tok = flat // V, flat % V
        alive = total > float("-inf")
        tok = torch.where(alive, tok, torch.full_like(tok, PAD_ID))
        s = rule.advance(s[parent], tok)
        ended = (tok == EOS_ID) | (is_final(s) if is_final is not None else torch.zeros_like(alive))
        finished = (finished[parent] | ended) & alive
        done = done[parent] | ended | ~alive
        tokens = torch.cat([tokens[parent], tok[:, None]], 1)
        if bool(done.all()):
            break
        logits, cache = lm_step(lm, tok, cache.reorder(parent))
    order = torch.argsort(total, descending=True, stable=True)  # best first, finished ones before the others
    order = order[torch.argsort((~finished[order]).to(torch.int8), stable=True)]
    order = order[torch.isfinite(total[order])]
    return Searched(tokens[order], total[order], finished[order], prompt_ids[0], score)


def greedy(lm: torch.nn.Module, prompt, *, constraint=None, max_new_tokens: int = 32,
           score: str = "model") -> Searched:
    """Greedy decoding under a token automaton: at each step the most probable admissible token (the same
    token under either ``score``; the score only sets the reported ``log_prob``). :func:`beam_search` with
    one beam; returns :class:`Searched` with one row."""
    return beam_search(lm, prompt, constraint=constraint, width=1, max_new_tokens=max_new_tokens, score=score)


__all__ = ["SCORES", "Searched", "beam_search", "greedy"]
