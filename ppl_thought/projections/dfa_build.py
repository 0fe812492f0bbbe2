"""Building character DFAs: character-class maps, Thompson's NFA, subset construction, trimming, minimisation.

The steps behind :meth:`ppl_thought.projections.CharDFA.from_regex` and :meth:`~ppl_thought.projections.CharDFA.minimal`
(numpy only). Characters are grouped into classes (the intervals of code points that every character set of a
pattern treats alike, :func:`partition`), so tables are ``[states, classes]``, never ``[states, 0x110000]``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from ppl_thought.errors import PatternError
from ppl_thought.projections.regex import MAX_CODE, Intervals

DEAD = -1
#: the most NFA states (Thompson construction) and DFA states (subset construction) a pattern may need
MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 20_000

__all__ = ["DEAD", "MAX_DFA_STATES", "MAX_NFA_STATES", "NFA", "bfs_order", "collect_sets", "compact_map", "minimise",
           "partition", "subset_construction", "trim"]


# ---------------------------------------------------------------------------------------------- class maps
def partition(sets: Sequence[Intervals]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut the code points into classes by membership in ``sets``: (bounds [K], interval_class [K],
    member [C, len(sets)] bool). Class 0 is the characters in no set (it exists even if empty)."""
    n = len(sets)
    if n == 0:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros((1, 0), bool)
    pts = {0}
    for s in sets:
        for lo, hi in s:
            pts.add(lo)
            if hi < MAX_CODE:
                pts.add(hi + 1)
    bounds = np.array(sorted(pts), dtype=np.int64)
    inside = np.zeros((len(bounds), n), dtype=bool)
    for j, s in enumerate(sets):  # a loop over the pattern's sets, vectorised over intervals
        if not s:
            continue
        los = np.array([lo for lo, _ in s], dtype=np.int64)
        his = np.array([hi for _, hi in s], dtype=np.int64)
        k = np.searchsorted(los, bounds, side="right") - 1
        inside[:, j] = (k >= 0) & (bounds <= his[np.clip(k, 0, None)])
    rows = np.concatenate([np.zeros((1, n), dtype=bool), inside])
    member, inv = np.unique(rows, axis=0, return_inverse=True)  # the all-False row sorts first: class 0
    return compact_map(bounds, inv.ravel()[1:]) + (member,)


def compact_map(bounds: np.ndarray, interval_class: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge adjacent intervals of the same class."""
    keep = np.concatenate([[True], interval_class[1:] != interval_class[:-1]])
    return bounds[keep], interval_class[keep].astype(np.int64)


# ---------------------------------------------------------------------------------------------- construction
def collect_sets(node, sets: list, index: dict) -> None:
    kind = node[0]
    if kind == "set":
        if node[1] not in index:
            index[node[1]] = len(sets)
            sets.append(node[1])
    elif kind in ("cat", "alt"):
        for child in node[1]:
            collect_sets(child, sets, index)
    else:  # rep
        collect_sets(node[1], sets, index)


class NFA:
    """Thompson's epsilon-NFA: ``eps[s]`` (epsilon successors), ``edges[s]`` (set index, successor)."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int]]] = []

    def new(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise PatternError(f"pattern needs over {MAX_NFA_STATES} NFA states (nested repetition counts are "
                               "too large)", self.pattern)
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node, index: dict) -> tuple[int, int]:
        """(entry, exit) of the fragment of ``node``."""
        kind = node[0]
        if kind == "set":
            a, b = self.new(), self.new()
            self.edges[a].append((index[node[1]], b))
            return a, b
        if kind == "cat":
            a = self.new()
            cur = a
            for child in node[1]:
                s, e = self.build(child, index)
                self.eps[cur].append(s)
                cur = e
            return a, cur
        if kind == "alt":
            a, b = self.new(), self.new()
            for child in node[1]:
                s, e = self.build(child, index)
                self.eps[a].append(s)
                self.eps[e].append(b)
            return a, b
        _, child, lo, hi = node  # rep: lo copies, then hi - lo optional copies (or a star)
        a = self.new()
        cur = a
        for _ in range(lo):
            s, e = self.build(child, index)
            self.eps[cur].append(s)
            cur = e
        if hi is None:
            s, e = self.build(child, index)
            b = self.new()
            self.eps[cur] += [s, b]
            self.eps[e] += [s, b]
            return a, b
        b = self.new()
        for _ in range(hi - lo):
            s, e = self.build(child, index)
            self.eps[cur] += [s, b]
            cur = e
        self.eps[cur].append(b)
        return a, b

    def closure(self, states) -> frozenset[int]:
        seen = set(states)
        stack = list(seen)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)


def subset_construction(nfa: NFA, start: int, end: int, set_classes: list[list[int]], C: int,
                         pattern: str) -> tuple[np.ndarray, np.ndarray]:
    """The DFA of reachable NFA state sets (the empty set is the dead state -1)."""
    first = nfa.closure([start])
    ids = {first: 0}
    order = [first]
    rows = []
    closures: dict[frozenset, frozenset] = {}
    i = 0
    while i < len(order):
        targets: list[set[int]] = [set() for _ in range(C)]
        for s in order[i]:
            for j, dst in nfa.edges[s]:
                for c in set_classes[j]:
                    targets[c].add(dst)
        row = np.full(C, DEAD, dtype=np.int64)
        for c, tg in enumerate(targets):
            if not tg:
                continue
            key = frozenset(tg)
            d = closures.get(key)
            if d is None:
                d = closures[key] = nfa.closure(key)
            if d not in ids:
                if len(order) >= MAX_DFA_STATES:
                    raise PatternError(f"pattern needs over {MAX_DFA_STATES} DFA states", pattern)
                ids[d] = len(order)
                order.append(d)
            row[c] = ids[d]
        rows.append(row)
        i += 1
    accepting = np.array([end in st for st in order], dtype=bool)
    return np.stack(rows), accepting


def trim(delta: np.ndarray, accepting: np.ndarray, start: int):
    """Keep the states reachable from ``start`` that can reach an accepting state; renumber (start first).
    ``(None, None)`` when the start cannot reach acceptance (empty language)."""
    S = delta.shape[0]
    d = np.where(delta >= 0, delta, S)
    reach = np.zeros(S + 1, dtype=bool)
    reach[start] = True
    while True:  # forward closure, vectorised over states
        new = reach.copy()
        new[d[reach[:S]].ravel()] = True
        new[S] = False
        if (new == reach).all():
            break
        reach = new
    co = np.concatenate([accepting, [False]])
    while True:  # backward closure
        new = co.copy()
        new[:S] |= co[d].any(1)
        if (new == co).all():
            break
        co = new
    keep = reach[:S] & co[:S]
    if not keep[start]:
        return None, None
    idx = np.nonzero(keep)[0]
    idx = np.concatenate([[start], idx[idx != start]])
    new_id = np.full(S + 1, DEAD, dtype=np.int64)
    new_id[idx] = np.arange(len(idx))
    return new_id[d[idx]], accepting[idx]


def minimise(delta: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Moore's partition refinement on a trimmed DFA (state 0 the start); the quotient automaton."""
    block = accepting.astype(np.int64)
    count = len(np.unique(block))
    while True:
        nb = np.where(delta >= 0, block[np.clip(delta, 0, None)], -1)
        sig = np.concatenate([block[:, None], nb], 1)
        _, new = np.unique(sig, axis=0, return_inverse=True)
        new = new.ravel()
        c = int(new.max()) + 1
        block = new
        if c == count:
            break
        count = c
    rep = np.zeros(count, dtype=np.int64)
    rep[block[::-1]] = np.arange(len(block))[::-1]  # the first state of each block
    q = np.where(delta[rep] >= 0, block[np.clip(delta[rep], 0, None)], DEAD)
    # renumber so that the start's block is 0
    perm = np.concatenate([[block[0]], np.setdiff1d(np.arange(count), [block[0]])])
    inv = np.empty(count, dtype=np.int64)
    inv[perm] = np.arange(count)
    q = np.where(q >= 0, inv[np.clip(q, 0, None)], DEAD)[perm]
    return q, accepting[rep][perm]


def bfs_order(delta: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Renumber states breadth-first from 0, successors in class order (a canonical numbering)."""
    S = delta.shape[0]
    new_id = np.full(S, DEAD, dtype=np.int64)
    new_id[0] = 0
    order = [0]
    queue = deque([0])
    while queue:
        s = queue.popleft()
        for t in delta[s].tolist():
            if t >= 0 and new_id[t] < 0:
                new_id[t] = len(order)
                order.append(t)
                queue.append(t)
    idx = np.array(order)
    return np.where(delta[idx] >= 0, new_id[np.clip(delta[idx], 0, None)], DEAD), accepting[idx]
