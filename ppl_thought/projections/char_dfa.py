"""Deterministic automata over characters: regular expressions, lipograms, bounded-depth Dyck (numpy only).

A :class:`CharDFA` is a complete description of a regular language over Unicode strings:

- a **class map** from characters to class ids: the code points are cut into intervals
  ``[bounds[k], bounds[k+1])``, interval ``k`` has class ``interval_class[k]``; characters of one
  class behave identically in every state. Class 0 is "any other character": the characters the
  language's definition never mentions (e.g. every character but ``e``/``E`` for a lipogram), merged
  with the classes that behave like them; it may be empty (``[^e]|e`` mentions every character);
- a transition table ``delta [S, C]`` (``-1`` = the dead state: no continuation is accepted), the
  accepting states and a start state.

Every constructor returns the **trimmed, minimal** automaton: every state is reachable from the start
and can reach an accepting state (so "the walk is alive" means "the text read so far is a prefix of
an accepted string"), no two states are equivalent (Moore's partition refinement), states are numbered
breadth-first from the start (0), and classes with identical columns are merged. Two equal languages
built over the same class map therefore have equal tables.

Constructors: :meth:`CharDFA.from_regex` (Thompson's construction from the syntax tree of
:mod:`~ppl_thought.projections.regex`, then the subset construction; full-match semantics of
``re.fullmatch``), :meth:`CharDFA.lipogram`, :meth:`CharDFA.dyck` (Dyck_{k,D} of equation (2.37) of the
data-training-inference thesis), and the products ``a & b`` (intersection) and ``a | b`` (union).
:func:`~ppl_thought.projections.token_lift.token_automaton` lifts one to a token vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ppl_thought.errors import ConfigError
from ppl_thought.projections.dfa_build import (
    DEAD,
    MAX_DFA_STATES,
    MAX_NFA_STATES,
    NFA,
    bfs_order,
    collect_sets,
    compact_map,
    minimise,
    partition,
    subset_construction,
    trim,
)
from ppl_thought.projections.regex import Intervals, char_set, parse
from ppl_thought.validation import ArrayLike, checked

__all__ = ["CharDFA", "MAX_DFA_STATES", "MAX_NFA_STATES"]


def _merge_maps(a: CharDFA, b: CharDFA) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The common refinement of two class maps: (bounds, interval_class, class in a [C], class in b [C]);
    class 0 is (other of a, other of b)."""
    bounds = np.union1d(a.bounds, b.bounds)
    ca = a.interval_class[np.searchsorted(a.bounds, bounds, side="right") - 1]
    cb = b.interval_class[np.searchsorted(b.bounds, bounds, side="right") - 1]
    pairs = ca * b.num_classes + cb
    uniq, inv = np.unique(np.concatenate([[0], pairs]), return_inverse=True)
    bounds, iclass = compact_map(bounds, inv.ravel()[1:])
    return bounds, iclass, uniq // b.num_classes, uniq % b.num_classes


# ---------------------------------------------------------------------------------------------- the automaton
@checked
@dataclass(frozen=True, eq=False)
class CharDFA:
    """A deterministic automaton over characters (see the module docstring).

    Attributes:
        delta: int64 ``[S, C]``; ``delta[s, c]`` is the state after a character of class ``c``, ``-1`` dead.
        accepting: bool ``[S]``.
        bounds: int64 ``[K]``, sorted, ``bounds[0] == 0``: starts of the code-point intervals.
        interval_class: int64 ``[K]``: the class of each interval (class 0: any other character).
        start: the start state.
        name: a label (the pattern, ``lipogram(e)``, ``Dyck_{2,3}``, ...).

    Build with the constructors; the raw initialiser checks shapes but neither trims nor minimises
    (use :meth:`minimal` for that).
    """

    delta: np.ndarray
    accepting: np.ndarray
    bounds: np.ndarray
    interval_class: np.ndarray
    start: int = 0
    name: str = "dfa"

    def __post_init__(self) -> None:
        delta = np.asarray(self.delta, dtype=np.int64)
        acc = np.asarray(self.accepting, dtype=bool)
        bounds = np.asarray(self.bounds, dtype=np.int64)
        iclass = np.asarray(self.interval_class, dtype=np.int64)
        if delta.ndim != 2 or delta.shape[0] == 0 or delta.shape[1] == 0:
            raise ConfigError(f"delta must be a non-empty [S, C] table, got shape {delta.shape}")
        S, C = delta.shape
        if delta.min() < -1 or delta.max() >= S:
            raise ConfigError("delta entries must be -1 (dead) or a state in [0, S)")
        if acc.shape != (S,):
            raise ConfigError(f"accepting must have shape ({S},), got {acc.shape}")
        if bounds.ndim != 1 or bounds.shape != iclass.shape or bounds.size == 0 or bounds[0] != 0 \
                or (np.diff(bounds) <= 0).any():
            raise ConfigError("bounds must be increasing interval starts beginning at 0, one class per interval")
        if iclass.min() < 0 or iclass.max() >= C:
            raise ConfigError(f"interval classes must lie in [0, {C})")
        if not 0 <= int(self.start) < S:
            raise ConfigError(f"start state {self.start} outside [0, {S})")
        for k, v in (("delta", delta), ("accepting", acc), ("bounds", bounds), ("interval_class", iclass),
                     ("start", int(self.start))):
            object.__setattr__(self, k, v)

    # ------------------------------------------------------------------ sizes and the class map
    @property
    def num_states(self) -> int:
        return self.delta.shape[0]

    @property
    def num_classes(self) -> int:
        return self.delta.shape[1]

    def classify(self, codes: ArrayLike | int) -> np.ndarray | np.integer:
        """Class ids of code points (an int array of any shape, vectorised; a scalar for a scalar)."""
        codes = np.asarray(codes, dtype=np.int64)
        return self.interval_class[np.searchsorted(self.bounds, codes, side="right") - 1]

    def class_chars(self) -> list[str | None]:
        """One character of each class (the smallest code point of it), ``None`` for an empty class."""
        out: list[str | None] = [None] * self.num_classes
        for lo, c in zip(self.bounds.tolist(), self.interval_class.tolist(), strict=True):
            if out[c] is None:
                out[c] = chr(lo)
        return out

    # ------------------------------------------------------------------ reading strings
    def run(self, text: str) -> int:
        """The state after reading ``text`` from the start (``-1`` once dead)."""
        classes = self.classify(np.fromiter(map(ord, text), dtype=np.int64, count=len(text)))
        s = self.start
        for c in classes.tolist():
            s = int(self.delta[s, c])
            if s < 0:
                return DEAD
        return s

    def accepts(self, text: str) -> bool:
        """Whether ``text`` is in the language."""
        s = self.run(text)
        return s >= 0 and bool(self.accepting[s])

    def admits_prefix(self, text: str) -> bool:
        """Whether some continuation of ``text`` is in the language (the automaton is trimmed)."""
        s = self.run(text)
        return s >= 0 and (bool(self.accepting[s]) or bool((self.delta[s] >= 0).any()))

    @property
    def is_empty(self) -> bool:
        """Whether the language is empty (a minimal automaton then has one dead-end start state)."""
        return not self.accepting.any()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_regex(cls, pattern: str) -> CharDFA:
        """The minimal DFA of the strings ``s`` with ``re.fullmatch(pattern, s)``.

        Thompson's construction (an epsilon-NFA with one fragment per node of the syntax tree,
        ``{m,n}`` unrolled), then the subset construction over the character classes of the pattern,
        then trimming and minimisation. Supported syntax: see :mod:`ppl_thought.projections.regex`.

        Raises:
            PatternError: a malformed pattern, an unsupported construct (anchors, backreferences,
                lookarounds, possessive quantifiers), or one whose automaton is too large.
        """
        tree = parse(pattern)
        sets: list[Intervals] = []
        index: dict[Intervals, int] = {}
        collect_sets(tree, sets, index)
        bounds, iclass, member = partition(sets)
        nfa = NFA(pattern)
        start, end = nfa.build(tree, index)
        set_classes = [np.nonzero(member[:, j])[0].tolist() for j in range(len(sets))]
        delta, accepting = subset_construction(nfa, start, end, set_classes, member.shape[0], pattern)
        return cls(delta, accepting, bounds, iclass, 0, f"/{pattern}/").minimal()

    @classmethod
    def lipogram(cls, letters: str = "e", ignore_case: bool = True) -> CharDFA:
        """The strings that contain none of ``letters`` (with ``ignore_case``, neither their upper- nor
        their lower-case forms): one accepting state, the letters' class dead, every other character a
        self-loop."""
        if not letters:
            raise ConfigError(f"lipogram needs a non-empty string of letters to exclude, got {letters!r}")
        chars = set(letters)
        if ignore_case:
            for c in letters:
                chars.update(x for x in (c.lower(), c.upper(), c.casefold()) if len(x) == 1)
        bounds, iclass, _ = partition([char_set("".join(sorted(chars)))])
        delta = np.array([[0, DEAD]], dtype=np.int64)
        name = f"lipogram({letters}{', ignore_case' if ignore_case else ''})"
        return cls(delta, np.array([True]), bounds, iclass, 0, name).minimal()

    @classmethod
    def dyck(cls, pairs: str = "()[]", depth: int = 3, ignore_other: bool = False) -> CharDFA:
        """Bounded-depth Dyck_{k,D} (equation (2.37)): balanced strings over the ``k = len(pairs) / 2``
        bracket types ``pairs[2t], pairs[2t+1]`` (open, close) whose stack depth never exceeds ``depth``.

        A state is the stack of unmatched open brackets (at most ``depth`` of them); accepting = the
        empty stack (so the empty string is accepted). Other characters are dead, or with
        ``ignore_other`` keep the state (brackets inside free text).
        """
        if len(pairs) < 2 or len(pairs) % 2 or len(set(pairs)) != len(pairs):
            raise ConfigError(f"dyck needs pairs as a string of 2k distinct characters (open, close, ...), "
                              f"got {pairs!r}")
        if isinstance(depth, bool) or depth < 0:
            raise ConfigError(f"dyck needs a depth bound D >= 0, got {depth!r}")
        k = len(pairs) // 2
        stacks: list[tuple[int, ...]] = [()]
        frontier: list[tuple[int, ...]] = [()]
        for _ in range(int(depth)):
            frontier = [st + (t,) for st in frontier for t in range(k)]
            stacks.extend(frontier)
        index = {st: i for i, st in enumerate(stacks)}
        bounds, iclass, member = partition([char_set(c) for c in pairs])
        cls_of = [int(np.nonzero(member[:, j])[0][0]) for j in range(len(pairs))]
        delta = np.full((len(stacks), member.shape[0]), DEAD, dtype=np.int64)
        if ignore_other:
            delta[:, 0] = np.arange(len(stacks))
        for s, st in enumerate(stacks):
            for t in range(k):
                if len(st) < depth:
                    delta[s, cls_of[2 * t]] = index[st + (t,)]
                if st and st[-1] == t:
                    delta[s, cls_of[2 * t + 1]] = index[st[:-1]]
        accepting = np.zeros(len(stacks), dtype=bool)
        accepting[0] = True
        return cls(delta, accepting, bounds, iclass, 0, f"Dyck_{{{k},{depth}}}({pairs})").minimal()

    # ------------------------------------------------------------------ products
    def _product(self, other: CharDFA, mode: str) -> CharDFA:
        if not isinstance(other, CharDFA):
            raise ConfigError(f"a CharDFA combines with a CharDFA, got {type(other).__name__}")
        name = f"({self.name} {dict(zip(('and', 'or', 'xor'), '&|^', strict=True))[mode]} {other.name})"
        bounds, iclass, ca, cb = _merge_maps(self, other)
        # -1 is a sink on each side: (s, -1) lives on in a union, dies in an intersection
        da = np.concatenate([self.delta[:, ca], np.full((1, len(ca)), DEAD)], 0)
        db = np.concatenate([other.delta[:, cb], np.full((1, len(cb)), DEAD)], 0)
        acc_a = np.concatenate([self.accepting, [False]])
        acc_b = np.concatenate([other.accepting, [False]])
        ids = {(self.start, other.start): 0}
        order = [(self.start, other.start)]
        rows = []
        i = 0
        while i < len(order):  # breadth-first over the reachable pairs, vectorised over classes
            sa, sb = order[i]
            na, nb = da[sa], db[sb]
            live = (na >= 0) & (nb >= 0) if mode == "and" else (na >= 0) | (nb >= 0)
            row = np.full(len(ca), DEAD, dtype=np.int64)
            for c in np.nonzero(live)[0].tolist():
                key = (int(na[c]), int(nb[c]))
                if key not in ids:
                    ids[key] = len(order)
                    order.append(key)
                row[c] = ids[key]
            rows.append(row)
            i += 1
        pa = np.array([a for a, _ in order])
        pb = np.array([b for _, b in order])
        accepting = {"and": acc_a[pa] & acc_b[pb], "or": acc_a[pa] | acc_b[pb], "xor": acc_a[pa] ^ acc_b[pb]}[mode]
        return CharDFA(np.stack(rows), accepting, bounds, iclass, 0, name).minimal()

    def intersect(self, other: CharDFA) -> CharDFA:
        """The strings both automata accept (product construction), minimal."""
        return self._product(other, "and")

    def union(self, other: CharDFA) -> CharDFA:
        """The strings either automaton accepts (product construction), minimal."""
        return self._product(other, "or")

    __and__ = intersect
    __or__ = union

    def equivalent(self, other: CharDFA) -> bool:
        """Whether both accept the same language (the symmetric difference is empty)."""
        return self._product(other, "xor").is_empty

    # ------------------------------------------------------------------ normal form
    def minimal(self) -> CharDFA:
        """The trimmed, minimal, breadth-first-numbered equivalent automaton with merged classes."""
        used = np.zeros(self.num_classes, dtype=bool)
        used[self.interval_class] = True  # a class no character maps to (an empty class 0) leads nowhere
        delta, accepting = trim(np.where(used, self.delta, DEAD), self.accepting, self.start)
        if delta is None:  # empty language: one dead-end start state
            return CharDFA(np.full((1, 1), DEAD), np.array([False]), np.zeros(1, np.int64),
                           np.zeros(1, np.int64), 0, self.name)
        delta, accepting = minimise(delta, accepting)
        delta, accepting = bfs_order(delta, accepting)
        # merge classes whose columns are equal; groups numbered by first appearance, so class 0 stays 0
        _, inv = np.unique(delta.T, axis=0, return_inverse=True)
        inv = inv.ravel().tolist()
        new_id = {g: i for i, g in enumerate(dict.fromkeys(inv))}
        remap = np.array([new_id[g] for g in inv], dtype=np.int64)
        new_delta = np.empty((delta.shape[0], len(new_id)), dtype=np.int64)
        new_delta[:, remap] = delta
        bounds, iclass = compact_map(self.bounds, remap[self.interval_class])
        return CharDFA(new_delta, accepting, bounds, iclass, 0, self.name)

    def __repr__(self) -> str:
        return f"CharDFA({self.name}: {self.num_states} states x {self.num_classes} character classes)"
