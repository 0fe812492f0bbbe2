"""Constraint sets as automata and the idealised process verifier of Chapter 3 (Def 3.1.3).

The constrained-generation task (Def 3.1.2) is a triple (Sigma, A, O): a vocabulary, a constraint
set ``A`` and an autoregressive oracle (the LM, Def 3.1.1). Here ``A`` is given by a token
:class:`~ppl_thought.projections.automaton.Automaton` (strings read without dying and ending in a
final state) and, optionally, a fixed length ``N`` (the thesis's tasks are sets of strings of one
length: ``A subset Sigma^D`` in Props 3.1.1-3.1.2, "valid sequences of given length" for Dyck).

* :func:`dyck` builds the automaton of the bounded-depth Dyck language Dyck_{k,D}, equation (2.37).
* :class:`ProcessVerifier` is the perfect process verifier of Def 3.1.3 (of any token automaton, or of a
  character language over any vocabulary: :meth:`ProcessVerifier.from_char_dfa`): ``V(s) = 1`` iff some
  ``s'`` makes ``s o s'`` a member of ``A`` (of length ``N`` when a length is given). It is decided
  exactly from the automaton state of the prefix by a reachability table, batched over rows.

The engines that use it (rejection sampling, Def 3.1.4; tokenwise rejection sampling, Def 3.1.5)
live in :mod:`ppl_thought.verifiers.sampling`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.projections.automaton import Automaton
from ppl_thought.projections.char_dfa import CharDFA
from ppl_thought.projections.constraints import dyck, reach_table
from ppl_thought.projections.token_lift import token_automaton
from ppl_thought.validation import checked
from ppl_thought.vocab import PAD_ID

__all__ = ["dyck", "ProcessVerifier"]


@checked
class ProcessVerifier:
    """The perfect process verifier of Def 3.1.3 for the constraint set of an automaton.

    ``V(s) = 1`` iff there is a completion ``s'`` with ``s o s'`` accepted by ``automaton`` and, when
    ``length`` is given, ``|s o s'| = length`` (the thesis's tasks have ``A subset Sigma^N``). On a
    complete string (``|s| = length``) it is the membership test of ``A`` that rejection sampling
    (Def 3.1.4) uses. Decided exactly: ``reach[r, q]`` says whether a final state can be reached from
    state ``q`` in exactly ``r`` tokens (any number when ``length`` is ``None``), built by dynamic
    programming over the table, so a call is one automaton pass and one gather, batched over rows.

    Call it on right-padded prefixes ``[n, L]`` (``<pad>`` = 0, never a token of the constraint) to
    get bool ``[n]``; or use :meth:`from_states` on automaton states and prefix lengths.
    """

    def __init__(self, automaton: Automaton, length: int | None = None):
        if length is not None and (length < 0):
            raise ConfigError(f"length must be a non-negative integer or None, got {length!r}")
        if (automaton.next_state[:, PAD_ID] >= 0).any():
            raise ConfigError("the constraint automaton reads <pad> (id 0) as a token: padded prefixes are ambiguous")
        self.automaton = automaton
        self.length = None if length is None else int(length)
        reach = reach_table(automaton, self.length)  # numpy, shared with ptn.verifiers
        self._reach = reach
        self._cache: dict[str, torch.Tensor] = {}

    @classmethod
    def from_char_dfa(cls, dfa: CharDFA, token_text: Sequence[str | None], length: int | None = None,
                      allow: np.ndarray | Iterable[int] | None = None) -> ProcessVerifier:
        """The process verifier of a character language (a regular expression, a lipogram, Dyck over
        characters: a :class:`~ppl_thought.projections.CharDFA`) over any token vocabulary.

        ``A`` is the token strings whose concatenated text (``token_text[i]`` for id i, ``None`` for ids never
        admissible) the DFA accepts, of exactly ``length`` tokens when given; there is no end token. The
        automaton is :func:`~ppl_thought.projections.token_automaton` with ``eos_id=None``, so for a character
        vocabulary ``from_char_dfa(CharDFA.dyck("()[]", D), token_texts(vocab), N)`` equals
        ``ProcessVerifier(dyck(2, D, vocab), N)``.
        """
        return cls(token_automaton(dfa, token_text, eos_id=None, allow=allow), length)

    def __repr__(self) -> str:
        return f"ProcessVerifier({self.automaton.name}, length={self.length})"

    def _reach_on(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        t = self._cache.get(key)
        if t is None:
            t = torch.as_tensor(self._reach, device=device)
            self._cache[key] = t
        return t

    def states(self, prefixes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(automaton state ``[n]``, length ``[n]``) of right-padded prefixes ``[n, L]`` (``-1`` once dead)."""
        prefixes = torch.as_tensor(prefixes)
        if prefixes.ndim != 2 or prefixes.dtype not in (torch.int64, torch.int32):
            raise MalformedSequenceError(f"prefixes must be an integer tensor [n, L], got {tuple(prefixes.shape)} "
                                         f"{prefixes.dtype}")
        prefixes = prefixes.long()
        V = self.automaton.vocab_size
        if prefixes.numel() and (prefixes.min() < 0 or prefixes.max() >= V):
            raise MalformedSequenceError(f"token ids must lie in [0, {V})")
        is_tok = prefixes != PAD_ID
        if prefixes.shape[1] > 1 and (is_tok[:, 1:] & ~is_tok[:, :-1]).any():
            raise MalformedSequenceError("prefixes must be right-padded: a token after <pad>")
        s = self.automaton.start_states(prefixes.shape[0], prefixes.device)
        for i in range(prefixes.shape[1]):  # a loop over positions, batched over rows
            s = self.automaton.advance(s, prefixes[:, i])
        return s, is_tok.sum(-1)

    def from_states(self, states: torch.Tensor, lengths: torch.Tensor | int) -> torch.Tensor:
        """V(s) for prefixes given by their automaton states ``[n]`` and lengths (``[n]`` or an int)."""
        reach = self._reach_on(states.device)
        live = states >= 0
        if self.length is None:
            return live & reach[0][states]
        lengths = torch.as_tensor(lengths, device=states.device).expand_as(states)
        remaining = self.length - lengths
        ok = live & (remaining >= 0)
        return ok & reach[remaining.clamp(0, self.length), states]

    def __call__(self, prefixes: torch.Tensor) -> torch.Tensor:
        """V(s) (Def 3.1.3) for each right-padded row of ``prefixes [n, L]``: bool ``[n]``."""
        s, lengths = self.states(prefixes)
        return self.from_states(s, lengths)

    def accepts(self, strings: torch.Tensor) -> torch.Tensor:
        """Membership in ``A`` of complete right-padded strings ``[n, L]``: accepted and, with a length, of it."""
        s, lengths = self.states(strings)
        ok = self.automaton.is_final(s)
        return ok if self.length is None else ok & (lengths == self.length)
