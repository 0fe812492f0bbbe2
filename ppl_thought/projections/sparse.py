"""Sparse thoughts, Example 2.4: fixed-length thoughts at a sparse set of positions."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from ppl_thought import checks
from ppl_thought.errors import ConfigError, NotInDomainError, NotRegularError
from ppl_thought.projections.automaton import Automaton
from ppl_thought.projections.base import Projection, as_id_array
from ppl_thought.projections.phase_tables import phase_tables, set_edges, unroll
from ppl_thought.validation import ArrayLike, checked
from ppl_thought.vocab import Vocab


@checked
def exponential_schedule(t: int) -> bool:
    """Ex 2.4: a thought starts each block x^(1), x^(2), ... of lengths 2, 4, 8, ...,
    i.e. before the 0-based observable positions 0, 2, 6, 14, 30, ... (t + 2 a power of two)."""
    return t >= 0 and ((t + 2) & (t + 1)) == 0


@checked
class SparseThoughts(Projection):
    """Ex 2.4: Dom(Proj) = {(<s> y^(k) </s> x^(k))_k : y^(k) in ordinary^c}, Proj deletes thoughts.

    A thought ``<s> y </s>`` with exactly c = ``thought_len`` ordinary tokens stands right before
    the observable at 0-based position t iff t is in ``positions``: mandatory there, forbidden
    elsewhere. ``positions`` is a finite iterable of positions, a predicate ``t -> bool``, or
    None for the exponential schedule of Ex 2.4 (:func:`exponential_schedule`).

    The lifting of x has (number of ordinary tokens)^(c * #{t in positions : t < |x|}) strings,
    polynomial in |x| for the exponential schedule: Proj is polynomially simple (Def 2.9).
    Phi_x(z, a) is {<s> y </s> a} if |x| is a position and {a} otherwise, whatever z: Proj is
    disentangled (Def 3.5). Every x in Sigma* is in the image.

    The infinite domain (``domain()``) is a finite automaton only for a finite set of positions;
    for a predicate or the exponential schedule it is not regular, and ``domain()`` raises
    :class:`NotRegularError` (use ``domain(num_observed=n)``).
    """

    is_disentangled = True

    def __init__(
        self,
        vocab: Vocab,
        thought_len: int,
        positions: Iterable[int] | Callable[[int], bool] | None = None,
    ):
        super().__init__(vocab)
        c = checks.integer("SparseThoughts: thought_len", thought_len, minimum=0)
        self.thought_len = c
        self._finite: frozenset[int] | None = None
        if positions is None:
            self._is_position: Callable[[int], bool] = exponential_schedule
        elif callable(positions):
            self._is_position = positions
        else:
            pos = frozenset(int(t) for t in positions)
            if any(t < 0 for t in pos):
                raise ConfigError(f"SparseThoughts: positions must be >= 0, got {sorted(pos)}")
            self._finite = pos
            self._is_position = pos.__contains__
        # phases: E = 0 (entering a level), T_k = 1 + k (k thought tokens read), P = c + 2
        sigma = vocab.observable_ids
        E, P = 0, c + 2
        think, plain = phase_tables(c + 3, len(vocab)), phase_tables(c + 3, len(vocab))
        for nxt, em in (think, plain):
            for k in range(c):
                set_edges(nxt, em, 1 + k, vocab.ordinary_ids, 2 + k, emitting=False)
            set_edges(nxt, em, 1 + c, [vocab.end_think_id], P, emitting=False)
            set_edges(nxt, em, P, sigma, E, emitting=True)
        set_edges(*think, E, [vocab.think_id], 1, emitting=False)
        set_edges(*plain, E, sigma, E, emitting=True)
        self._think, self._plain = think, plain

    def definition(self) -> dict:
        """What defines this projection (compared when a guide meets a model): the vocabulary, the thought
        length and the positions (a finite set, or the schedule callable itself)."""
        return {"vocab": self.vocab, "thought_len": self.thought_len,
                "positions": self._finite if self._finite is not None else self._is_position}

    def is_position(self, t: int) -> bool:
        """Whether a thought stands before the observable at 0-based position t."""
        return bool(self._is_position(int(t)))

    def num_thoughts(self, n: int) -> int:
        """Number of thoughts in the lifting of any x of length n (positions t < n)."""
        return sum(self.is_position(t) for t in range(n))

    def _level(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        return self._think if self.is_position(t) else self._plain

    def _project_one(self, z: np.ndarray) -> np.ndarray:
        v, c = self.vocab, self.thought_len
        sigma = set(self.observable_ids.tolist())
        ordinary = set(v.ordinary_ids.tolist())
        out: list[int] = []
        k = None  # thought tokens read inside an open thought
        done = False  # the thought before the next observable has been read
        for i, a in enumerate(z.tolist()):
            t = len(out)
            if k is not None:
                if k < c and a in ordinary:
                    k += 1
                elif k == c and a == v.end_think_id:
                    k, done = None, True
                else:
                    raise NotInDomainError(
                        f"SparseThoughts: token {v.token(a)!r} at position {i}: a thought is <s>, exactly "
                        f"{c} ordinary tokens, </s> (read {k} so far)"
                    )
            elif self.is_position(t) and not done:
                if a != v.think_id:
                    raise NotInDomainError(
                        f"SparseThoughts: token {v.token(a)!r} at position {i}: a thought <s> ... </s> is "
                        f"mandatory before observable position {t}"
                    )
                k = 0
            elif a in sigma:
                out.append(a)
                done = False
            elif a == v.think_id:
                raise NotInDomainError(
                    f"SparseThoughts: <s> at position {i}: "
                    + ("only one thought is allowed" if done else "no thought is allowed")
                    + f" before observable position {t}"
                )
            else:
                raise NotInDomainError(f"SparseThoughts: token {v.token(a)!r} at position {i} is not allowed "
                                       "here (an observable token is expected)")
        return np.asarray(out, dtype=np.int64)

    def in_domain(self, z: ArrayLike) -> bool:
        """Whether z is in Dom(Proj^{<w}) (decided by a scan; the domain may not be regular)."""
        try:
            self._project_one(as_id_array(z, self.vocab, "latent z"))
        except NotInDomainError:
            return False
        return True

    def domain(self, num_observed: int | None = None) -> Automaton:
        num_observed = checks.optional_integer("num_observed", num_observed, minimum=0)
        if num_observed is not None:
            return unroll(self._level, 0, int(num_observed), None, f"SparseThoughts.domain({num_observed})")
        if self._finite is None:
            raise NotRegularError(
                "SparseThoughts: with an unbounded schedule of thought positions the domain Dom(Proj^{<w}) "
                "is not a regular language, so no finite automaton accepts it; use "
                "domain(num_observed=n), or give a finite set of positions"
            )
        # after the last position the domain is Sigma^w: unroll to it, then loop.
        L = max(self._finite) + 1 if self._finite else 0
        a = unroll(self._level, 0, L, None, "SparseThoughts.domain")
        ns = a.next_state.copy()
        tail = int(np.nonzero(a.final)[0][0])
        ns[tail, self.observable_ids] = tail
        S = ns.shape[0]
        return Automaton(ns, np.zeros(S, dtype=bool), np.zeros(S, dtype=np.int64), a.start, None,
                         "SparseThoughts.domain")

    def _lifting(self, x: np.ndarray) -> Automaton:
        return unroll(self._level, 0, len(x), x, "SparseThoughts.lifting")

    def __repr__(self) -> str:
        pos = sorted(self._finite) if self._finite is not None else getattr(
            self._is_position, "__name__", "callable")
        return f"SparseThoughts({self.vocab!r}, thought_len={self.thought_len}, positions={pos})"
