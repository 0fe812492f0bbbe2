"""Building blocks for the automata of the concrete projections (private).

Most projections of Section 2.6 and 5.1 are described by a small *phase* machine: a table
``next_phase[P, V]`` (``-1`` = inadmissible) over the whole vocabulary, plus a table
``emits[P, V]`` giving the observable token that an edge emits (``-1`` for a latent-only
token such as ``<s>``, ``</s>`` or a thought token). Two automata are derived from it:

- :func:`unroll` counts the emitted observables: state ``(t, phase)`` with t observables read,
  a single final state once ``n`` are read (no admissible tokens there). With ``x`` given, the
  emitting edges at level t are restricted to ``x_t``: the lifting automaton of Prop 2.3.
  Without ``x``, ``domain(num_observed=n)``. The level table may depend on t (Ex 2.4).
- :func:`loop`: the phase machine itself, the infinite domain Dom(Proj^{<w}) of Def 2.6.

Both trim unreachable and dead-end states, so every state of a lifting automaton lies on a
path to its final state (decoding under its masks never gets stuck), and ``max_len`` is the
longest accepted string. Sizes are O(n * P) states, never exponential.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ppl_thought import checks
from ppl_thought.errors import ConfigError, UnsatisfiableConstraintError
from ppl_thought.projections.automaton import DEAD, Automaton
from ppl_thought.resources import automaton_bytes, check_bytes

LevelTables = Callable[[int], tuple[np.ndarray, np.ndarray]]


def phase_tables(num_phases: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Empty ``(next_phase, emits)`` tables, all ``-1``."""
    shape = (num_phases, vocab_size)
    return np.full(shape, DEAD, dtype=np.int64), np.full(shape, DEAD, dtype=np.int64)


def set_edges(
    next_phase: np.ndarray, emits: np.ndarray, src: int, tokens, dst: int, emitting: bool
) -> None:
    """Edges ``src --tokens--> dst``; an emitting edge emits the token itself."""
    tokens = np.asarray(tokens, dtype=np.int64)
    next_phase[src, tokens] = dst
    emits[src, tokens] = tokens if emitting else DEAD


def unroll(
    level_tables: LevelTables,
    start_phase: int,
    n: int,
    x: np.ndarray | None = None,
    name: str = "automaton",
) -> Automaton:
    """The phase machine unrolled over the number of emitted observables, up to ``n``.

    ``level_tables(t)`` gives ``(next_phase, emits)`` while t observables have been read. States
    are ``(t, phase)`` for t < n plus one final state for t = n; ``emitted`` is t. With ``x``
    (length n), an emitting edge at level t is kept only if it emits ``x[t]``.
    """
    if n < 0:
        raise ConfigError(f"num_observed must be a non-negative integer, got {n}")
    if x is not None and len(x) != n:
        raise ConfigError(f"x has length {len(x)}, expected {n}")
    if n == 0:
        return Automaton(np.full((1, _vocab_size(level_tables)), DEAD, dtype=np.int64),
                         np.array([True]), np.array([0]), 0, 0, name)
    nxt0, _ = level_tables(0)
    P, V = nxt0.shape
    check_bytes(automaton_bytes(n * P + 1, V), name, f"num_observed={n}")  # (n x phases) states, before allocating
    F = n * P
    rows = np.full((F + 1, V), DEAD, dtype=np.int64)
    for t in range(n):
        nxt, em = level_tables(t)
        if nxt.shape != (P, V) or em.shape != (P, V):
            raise ConfigError("every level table must have the same shape")
        ok = nxt >= 0
        is_emit = em >= 0
        keep_emit = ok & is_emit & ((em == x[t]) if x is not None else True)
        internal = ok & ~is_emit
        emit_dst = (t + 1) * P + nxt if t + 1 < n else np.full_like(nxt, F)
        rows[t * P : (t + 1) * P] = np.where(internal, t * P + nxt, np.where(keep_emit, emit_dst, DEAD))
    final = np.zeros(F + 1, dtype=bool)
    final[F] = True
    emitted = np.concatenate([np.repeat(np.arange(n, dtype=np.int64), P), [n]])
    ns, final, emitted, start, edges = trim(rows, final, emitted, start_phase)
    return Automaton(ns, final, emitted, start, longest_path(ns, start, edges), name)


def loop(next_phase: np.ndarray, start_phase: int, name: str = "domain") -> Automaton:
    """The phase machine as an automaton with no final state: the infinite domain.

    ``emitted`` is 0 everywhere: a finite automaton cannot count the observables of an
    unbounded string; use ``domain(num_observed=n)`` for the counts.
    """
    S = next_phase.shape[0]
    ns, _, _, start, _ = trim(next_phase, np.zeros(S, dtype=bool), np.zeros(S, dtype=np.int64), start_phase,
                           coreachable=False)
    return Automaton(ns, np.zeros(ns.shape[0], dtype=bool), np.zeros(ns.shape[0], dtype=np.int64), start,
                     None, name)


def _vocab_size(level_tables: LevelTables) -> int:
    return level_tables(0)[0].shape[1]


def _edges(ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique (src, dst) pairs of a transition table, sorted by src then dst."""
    srt = np.sort(ns, axis=1)
    first = np.ones_like(srt, dtype=bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    src, col = np.nonzero(first & (srt >= 0))
    return src, srt[src, col]


def trim(
    ns: np.ndarray, final: np.ndarray, emitted: np.ndarray, start: int, coreachable: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, tuple[np.ndarray, np.ndarray]]:
    """Keep the states reachable from ``start`` (and, by default, from which a final state is
    reachable); renumber them in order and redirect edges into removed states to ``-1``.

    Returns the new ``(next_state, final, emitted, start)`` and the unique (src, dst) edges.
    """
    S = ns.shape[0]
    esrc, edst = _edges(ns)
    keep = np.zeros(S, dtype=bool)
    keep[start] = True
    frontier = np.array([start])
    while frontier.size:
        d = ns[frontier].ravel()
        d = np.unique(d[d >= 0])
        d = d[~keep[d]]
        keep[d] = True
        frontier = d
    if coreachable:
        order = np.argsort(edst, kind="stable")
        src, dst = esrc[order], edst[order]
        bounds = np.searchsorted(dst, np.arange(S + 1))
        alive = final.copy()
        stack = list(np.nonzero(final)[0])
        while stack:
            d = stack.pop()
            for s in src[bounds[d] : bounds[d + 1]]:
                if not alive[s]:
                    alive[s] = True
                    stack.append(int(s))
        keep &= alive
        if not keep[start]:
            raise UnsatisfiableConstraintError("the automaton accepts no string")
    new_id = np.full(S + 1, DEAD, dtype=np.int64)  # new_id[-1] = -1 maps the dead state
    new_id[np.nonzero(keep)[0]] = np.arange(int(keep.sum()))
    out = new_id[ns[keep]]
    both = keep[esrc] & keep[edst]
    edges = (new_id[esrc[both]], new_id[edst[both]])
    return out, final[keep], emitted[keep], int(new_id[start]), edges


def longest_path(
    ns: np.ndarray, start: int, edges: tuple[np.ndarray, np.ndarray] | None = None
) -> int | None:
    """Length of the longest path from ``start`` (None if a cycle is reachable)."""
    S = ns.shape[0]
    src, dst = _edges(ns) if edges is None else edges
    bounds = np.searchsorted(src, np.arange(S + 1))
    succ = [dst[bounds[s] : bounds[s + 1]].tolist() for s in range(S)]
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[int, bool]] = [(start, False)]
    while stack:
        s, done = stack.pop()
        if done:
            on_path.discard(s)
            depth[s] = max((depth[t] + 1 for t in succ[s]), default=0)
            continue
        if s in depth:
            continue
        if s in on_path:
            return None
        on_path.add(s)
        stack.append((s, True))
        for t in succ[s]:
            if t in on_path:
                return None
            if t not in depth:
                stack.append((t, False))
    return depth[start]


class PhaseMachine:
    """Mixin for projections given by one phase machine ``self._tables = (next_phase, emits)``
    that does not change along the sequence (start phase 0): the domain and lifting automata."""

    _tables: tuple[np.ndarray, np.ndarray]

    def domain(self, num_observed: int | None = None) -> Automaton:
        name = type(self).__name__
        num_observed = checks.optional_integer("num_observed", num_observed, minimum=0)
        if num_observed is None:
            return loop(self._tables[0], 0, f"{name}.domain")
        return unroll(lambda t: self._tables, 0, int(num_observed), None, f"{name}.domain({num_observed})")

    def _lifting(self, x: np.ndarray) -> Automaton:
        return unroll(lambda t: self._tables, 0, len(x), x, f"{type(self).__name__}.lifting")
