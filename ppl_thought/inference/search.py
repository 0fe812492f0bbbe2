"""Greedy decoding and beam search, for comparison with the samplers (docs/architecture.md, "Engines").

The usual deterministic decoders of a token-level program (``pt.infer.greedy(program, None, *args)``: any program
whose ``one_token_step()`` declares one token of one LM per step; ``pt.infer.greedy(lm, prompt, constraint=auto)``
is sugar for ``Constrained(lm, auto, max_new_tokens)``). They are not samplers of any law the engines target:
greedy takes the most probable admissible token at each step; beam search keeps the
``width`` best prefixes by log-probability (one batch of ``width`` rows, the KV cache reordered with the beams),
so with a ``width`` at least the number of admissible sequences it returns the exact argmax of the score over
them. Score ``"model"``: the LM's own log-probabilities of the tokens (the mode of the constrained posterior
p(z | z in C), the law SMC approximates); ``"masked"``: the masked softmax of Def 2.8 (the law of masked
decoding, ``LMSequence`` under a constraint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ppl_thought.checks import integer
from ppl_thought.distributions.lm_state import TokenRule
from ppl_thought.errors import ConfigError
from ppl_thought.lm.base import as_id_batch, lm_device
from ppl_thought.lm.base import step as lm_step
from ppl_thought.program import OneTokenStep, is_program
from ppl_thought.validation import checked
from ppl_thought.vocab import BOS_ID, PAD_ID

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


def _search_program(program: Any, guide: Any, args: tuple, constraint: Any, max_new_tokens: int | None,
                    engine: str) -> tuple[Any, tuple]:
    """(the token-level program, its arguments): ``program`` itself, or for the sugar ``engine(lm, prompt,
    constraint=..., max_new_tokens=...)`` the program ``Constrained(lm, constraint, max_new_tokens)`` on ``prompt``."""
    if isinstance(program, torch.nn.Module) and not is_program(program):
        from ppl_thought.models.constrained import Constrained  # (models sit above the engines)

        if args:
            raise ConfigError(f"{engine}(lm, prompt, ...) takes one prompt; got {len(args) + 1} positional arguments")
        max_new = 32 if max_new_tokens is None else integer("max_new_tokens", max_new_tokens)
        return Constrained(program, constraint, max_new), (guide,)
    if constraint is not None or max_new_tokens is not None:
        raise ConfigError(f"{engine}(program, ...) reads the constraint and the length from program.one_token_step(); "
                          "constraint= and max_new_tokens= belong to the sugar engine(lm, prompt, ...)")
    if guide is not None:
        raise ConfigError(f"{engine} searches the program's own law: guide must be None, got {type(guide).__name__}")
    return program, args


@torch.no_grad()
@checked
def beam_search(program: Any, guide: Any = None, *args: Any, width: int = 4, score: str = "model",
                constraint: Any = None, max_new_tokens: int | None = None, **kwargs: Any) -> Searched:
    """Beam search over a token-level program (module docstring), batched over the beams.

    Args:
        program: any program whose :meth:`~ppl_thought.program.Program.one_token_step` declares one token of one LM
            per step (``pt.models.Constrained``, ``pt.verifiers.VerifiedLM``, a user's own): the search reads only
            that (its LM, rule, ``max_tokens``, ``stop_ids`` and prompt, from ``*args, **kwargs``). Or, as sugar, an
            LM (LM protocol, lm/base.py) with ``guide`` the prompt (library ids, 1-D; ``<bos>`` is written before
            them), ``constraint`` a token :class:`~ppl_thought.projections.automaton.Automaton` or ``None`` and
            ``max_new_tokens``: the program ``Constrained(lm, constraint, max_new_tokens)``.
        guide: ``None`` (the search has no proposal).
        width: the number of beams W. The W best prefixes (or finished sequences, which keep their slot and
            score) by total score are kept at each step: one top-k over ``[W, V]``, the cache reordered by the
            beams' parents (``cache.reorder``). With W >= the number of admissible sequences of at most
            ``max_tokens`` tokens nothing is pruned and the best one is the exact argmax.
        score: ``"model"`` (the LM's own log-probabilities) or ``"masked"`` (masked softmax, Def 2.8).

    Returns:
        :class:`Searched` with up to W sequences, best first (sequences whose score is -inf are dropped); finished:
        ended in a final state of the rule or after a stop id.
    """
    width = integer("width", width)
    if score not in SCORES:
        raise ConfigError(f"score must be one of {SCORES}, got {score!r}")
    program, args = _search_program(program, guide, args, constraint, max_new_tokens, "beam_search")
    spec = OneTokenStep.of(program, "beam_search")
    lm, rule, T = spec.lm, spec.rule, int(spec.max_tokens)
    device = lm_device(lm)
    prompt = spec.prompt_ids(args, kwargs)
    prompt_ids = as_id_batch(prompt, "prompt", device) if prompt is not None else \
        torch.zeros(1, 0, dtype=torch.long, device=device)
    if prompt_ids.shape[0] != 1:
        raise ConfigError(f"beam_search takes one prompt (1-D ids), got shape {tuple(prompt_ids.shape)}")
    V = int(lm.vocab_size)
    ctx = torch.cat([torch.full((1, 1), BOS_ID, dtype=torch.long, device=device), prompt_ids], 1)
    logits, cache = lm(ctx)
    logits, cache = logits[:, -1].expand(width, V), cache.expand(width)
    s = rule.start(width, device)
    total = torch.full((width,), float("-inf"), device=device)
    total[0] = 0.0  # one live beam to start with; the others fill from its candidates
    done = torch.zeros(width, dtype=torch.bool, device=device)
    finished = torch.zeros(width, dtype=torch.bool, device=device)
    tokens = torch.empty(width, 0, dtype=torch.long, device=device)
    # a finished beam's one continuation: <pad>, at its score
    keep = torch.full((1, V), float("-inf"), device=device).index_fill_(1, torch.tensor([PAD_ID], device=device), 0.0)
    for t in range(T):
        cand = total[:, None] + torch.where(done[:, None], keep, _step_scores(logits, s, rule, score))
        total, flat = cand.reshape(-1).topk(width)
        parent, tok = flat // V, flat % V
        alive = total > float("-inf")
        tok = torch.where(alive, tok, torch.full_like(tok, PAD_ID))
        s = rule.advance(s[parent], tok)
        ended, _ = spec.ends(tok, s, torch.full_like(tok, t + 1))  # a final state of the rule, a stop id
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


@checked
def greedy(program: Any, guide: Any = None, *args: Any, score: str = "model", constraint: Any = None,
           max_new_tokens: int | None = None, **kwargs: Any) -> Searched:
    """Greedy decoding of a token-level program: at each step the most probable admissible token (the same
    token under either ``score``; the score only sets the reported ``log_prob``). :func:`beam_search` with
    one beam (the same arguments, and the sugar ``greedy(lm, prompt, constraint=..., max_new_tokens=...)``);
    returns :class:`Searched` with one row."""
    return beam_search(program, guide, *args, width=1, score=score, constraint=constraint,
                       max_new_tokens=max_new_tokens, **kwargs)


__all__ = ["SCORES", "Searched", "beam_search", "greedy"]
