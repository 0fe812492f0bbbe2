"""The Dyck sandbox of thesis Section 3.2.1: bounded-depth Dyck strings of a fixed length, in and out of distribution.

Dyck_{k,D} (equation (2.37)) strings of length ``N`` are generated left to right: open a bracket with
probability ``p_open`` while the depth is below ``D`` and the remaining length still allows every open
bracket to close, otherwise close the top one. An opened bracket has type ``t`` with probability
``type_probs[t]``. The thesis makes prompts *out of distribution* by an unbalanced bracket-type law
(Section 3.6: "unbalanced bracket type probability"): training strings favour type 0, OOD prefixes type 1.

:meth:`DyckTask.completions` enumerates every valid completion of a prefix, so the exact constrained
distribution of an LM given a prompt is computable on small cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ppl_thought.errors import ConfigError
from ppl_thought.projections.automaton import Automaton
from ppl_thought.verifiers.process import ProcessVerifier, dyck
from ppl_thought.vocab import Vocab

__all__ = ["DyckTask"]

_OPEN, _CLOSE = "([{<", ")]}>"


#: the largest Dyck automaton DyckTask builds (a bigger depth is refused before any state is made)
MAX_DYCK_STATES = 1_000_000


@dataclass
class DyckTask:
    """Dyck_{k,D} strings of length ``N`` over a vocabulary of ``2k`` bracket tokens."""

    k: int = 2
    D: int = 4
    N: int = 16
    p_open: float = 0.5

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 4:
            raise ConfigError(f"DyckTask supports 1..4 bracket types, got k={self.k}")
        if self.N % 2 or self.N < 2 or self.D < 1:
            raise ConfigError(f"DyckTask needs an even length N >= 2 and a depth D >= 1, got N={self.N}, D={self.D}")
        states, width = 1, 1  # the automaton's states: the stacks of depth <= D, 1 + k + ... + k^D of them
        for _ in range(self.D):
            width *= self.k
            states += width
            if states > MAX_DYCK_STATES:
                raise ConfigError(f"DyckTask: depth D={self.D} with k={self.k} bracket types needs an automaton of "
                                  f"more than {MAX_DYCK_STATES} states (1 + k + ... + k^D); strings of length "
                                  f"N={self.N} never go deeper than N/2 = {self.N // 2}")
        self.vocab = Vocab([c for t in range(self.k) for c in (_OPEN[t], _CLOSE[t])])
        self.pairs = [(self.vocab.id(_OPEN[t]), self.vocab.id(_CLOSE[t])) for t in range(self.k)]
        self.automaton: Automaton = dyck(self.k, self.D, self.vocab)

    # ------------------------------------------------------------------ sampling
    def sample(self, n: int, type_probs: Sequence[float] | None = None, length: int | None = None,
               seed: int = 0) -> torch.Tensor:
        """``n`` strings ``[n, length]`` (default ``N``): prefixes of valid length-N Dyck strings, generated
        left to right (module docstring); ``type_probs`` defaults to uniform over the ``k`` types."""
        L = self.N if length is None else int(length)
        probs = np.full(self.k, 1 / self.k) if type_probs is None else np.asarray(type_probs, dtype=float)
        if probs.shape != (self.k,) or (probs < 0).any() or not np.isclose(probs.sum(), 1):
            raise ConfigError(f"type_probs must be {self.k} probabilities summing to 1, got {type_probs!r}")
        rng = np.random.default_rng(seed)
        opens = np.array([o for o, _ in self.pairs])
        closes = np.array([c for _, c in self.pairs])
        out = np.zeros((n, L), dtype=np.int64)
        stack = np.zeros((n, self.D), dtype=np.int64)  # bracket types on the stack
        depth = np.zeros(n, dtype=np.int64)
        rows = np.arange(n)
        for i in range(L):  # a loop over positions, vectorised over strings
            remaining = self.N - i
            can_open = (depth < self.D) & (depth + 1 <= remaining - 1)
            must_open = depth == 0
            do_open = must_open | (can_open & (rng.random(n) < self.p_open))
            t = rng.choice(self.k, size=n, p=probs)
            top = stack[rows, np.maximum(depth - 1, 0)]
            out[:, i] = np.where(do_open, opens[t], closes[top])
            stack[rows[do_open], depth[do_open]] = t[do_open]
            depth = depth + np.where(do_open, 1, -1)
        return torch.as_tensor(out)

    # ------------------------------------------------------------------ exact answers
    def state_after(self, prefix: Sequence[int]) -> int:
        """The Dyck automaton's state after ``prefix`` (-1 if the prefix is not a Dyck prefix)."""
        return int(self.automaton.run(np.asarray(prefix, dtype=np.int64))[-1])

    def verifier(self, prefix: Sequence[int]) -> ProcessVerifier:
        """The perfect process verifier (Def 3.1.3) of the completions of ``prefix`` to a length-N Dyck string."""
        q = self.state_after(prefix)
        if q < 0:
            raise ConfigError("the prompt is not a prefix of a Dyck string")
        return ProcessVerifier(replace(self.automaton, start=q), length=self.N - len(prefix))

    def completions(self, prefix: Sequence[int]) -> torch.Tensor:
        """Every completion ``[C, N - |prefix|]`` making ``prefix`` a length-N string of Dyck_{k,D}."""
        ver = self.verifier(prefix)
        L = self.N - len(prefix)
        aut = ver.automaton
        frontier = [((), aut.start)]
        for i in range(L):
            nxt = []
            for s, q in frontier:
                for a in np.nonzero(aut.next_state[q] >= 0)[0]:
                    q2 = int(aut.next_state[q, a])
                    if bool(ver.from_states(torch.tensor([q2]), i + 1)[0]):
                        nxt.append((s + (int(a),), q2))
            frontier = nxt
        return torch.tensor([s for s, _ in frontier], dtype=torch.long).reshape(len(frontier), L)
