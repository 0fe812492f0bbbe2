"""Constraint sets of verifiers as numpy tables, read by both backends (Chapter 3 of the data-training-inference
thesis; docs/verifiers.md). Numpy only: the torch verifiers (``pt.verifiers``) and the JAX ones
(``ptn.verifiers``) build on the same tables.

* :func:`dyck`: the automaton of the bounded-depth Dyck language Dyck_{k,D}, equation (2.37);
* :func:`reach_table`: the reachability table that decides the perfect process verifier of Def 3.1.3 exactly from
  the automaton state of a prefix (``reach[r, q]``: a final state within exactly r tokens of q);
* :func:`length_automaton`: the constraint set A of a length-N process verifier as one token automaton (admitted
  tokens are those with V(s o t) = 1, final exactly at N): the rule of ``VerifiedLM.one_token_step()`` on both
  sides, whose masked softmax (Def 2.8) is the locally optimal proposal of Def 3.1.5's law.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ppl_thought.errors import ConfigError
from ppl_thought.projections.automaton import DEAD, Automaton
from ppl_thought.validation import checked
from ppl_thought.vocab import Vocab

__all__ = ["dyck", "length_automaton", "reach_table"]


@checked
def dyck(k: int, D: int, vocab: Vocab, brackets: Sequence[tuple[str, str]] | None = None) -> Automaton:
    """The automaton of the bounded-depth Dyck language Dyck_{k,D} of equation (2.37).

    Dyck_{k,D} is the set of balanced strings over ``k`` bracket types whose grammar depth (the stack
    depth after each prefix) never exceeds ``D``. A state is the stack of unmatched open brackets
    (a tuple of types, at most ``D`` long): reading the open bracket of type t pushes t (inadmissible
    at depth ``D``), reading the close bracket of type t pops a t (inadmissible unless t is on top).
    The final state is the empty stack (a complete balanced string); the start state is also the
    empty stack, so the empty string is accepted. Every other token of the vocabulary (specials
    included) is inadmissible everywhere. The language is unbounded in length (``max_len=None``):
    pair it with ``ProcessVerifier(..., length=N)`` for the strings of length ``N``. ``emitted`` is 0
    (the automaton is a constraint, not a projection's lifting).

    Args:
        k: number of bracket types (>= 1).
        D: maximal depth (>= 0; depth 0 accepts only the empty string).
        vocab: the vocabulary whose ids index the table's columns.
        brackets: ``k`` pairs (open, close) of tokens of ``vocab``. Default: the ordinary tokens of
            ``vocab`` in id order, taken two by two (the thesis's convention: tokens 2t-1 and 2t are
            the open and close bracket of type t); ``vocab`` must then have exactly ``2k`` of them.

    Raises:
        ConfigError: ``k < 1``, ``D < 0``, the wrong number of brackets, or a token used twice.
        UnknownTokenError: a bracket that is not in ``vocab``.
    """
    if k < 1:
        raise ConfigError(f"dyck needs k >= 1 bracket types, got {k!r}")
    if D < 0:
        raise ConfigError(f"dyck needs a depth bound D >= 0, got {D!r}")
    if brackets is None:
        ordinary = vocab.ordinary_ids
        if len(ordinary) != 2 * k:
            raise ConfigError(f"dyck(k={k}) without `brackets` needs a vocabulary of exactly {2 * k} ordinary tokens, "
                              f"got {len(ordinary)}; pass brackets=[(open, close), ...]")
        ids = [(int(ordinary[2 * t]), int(ordinary[2 * t + 1])) for t in range(k)]
    else:
        if len(brackets) != k:
            raise ConfigError(f"dyck(k={k}) needs {k} (open, close) pairs, got {len(brackets)}")
        ids = [(vocab.id(o), vocab.id(c)) for o, c in brackets]
    flat = [i for pair in ids for i in pair]
    if len(set(flat)) != len(flat):
        raise ConfigError(f"dyck brackets must be 2k distinct tokens, got {brackets if brackets else flat}")
    if any(i < vocab.num_specials for i in flat):
        raise ConfigError("dyck brackets must be ordinary tokens, not specials such as <pad> or <eos>")

    # states: every stack of length <= D, numbered breadth-first from the empty stack
    stacks: list[tuple[int, ...]] = [()]
    index: dict[tuple[int, ...], int] = {(): 0}
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(D):
        nxt = []
        for st in frontier:
            for t in range(k):
                child = st + (t,)
                index[child] = len(stacks)
                stacks.append(child)
                nxt.append(child)
        frontier = nxt
    table = np.full((len(stacks), len(vocab)), DEAD, dtype=np.int64)
    for s, st in enumerate(stacks):
        for t, (op, cl) in enumerate(ids):
            if len(st) < D:
                table[s, op] = index[st + (t,)]
            if st and st[-1] == t:
                table[s, cl] = index[st[:-1]]
    final = np.zeros(len(stacks), dtype=bool)
    final[0] = True
    return Automaton(table, final, np.zeros(len(stacks), dtype=np.int64), 0, None, f"Dyck_{{{k},{D}}}")


@checked
def reach_table(automaton: Automaton, length: int | None = None) -> np.ndarray:
    """The table that decides the process verifier of Def 3.1.3 from an automaton state.

    With a ``length`` N: bool ``[N + 1, S + 1]``, ``reach[r, q]`` true iff a final state can be reached from
    state ``q`` in exactly ``r`` tokens (dynamic programming over the table); without: ``[1, S + 1]``, reachable
    in any number of tokens. The last column is the dead state (``-1`` indexes it): always false.
    """
    if length is not None and (isinstance(length, bool) or length < 0):
        raise ConfigError(f"length must be a non-negative integer or None, got {length!r}")
    ns, S = automaton.next_state, automaton.num_states
    if length is None:
        alive = automaton.final.copy()
        while True:
            succ = np.concatenate([alive, [False]])[ns].any(axis=1)  # ns == -1 indexes the False pad
            new = alive | succ
            if (new == alive).all():
                break
            alive = new
        return np.concatenate([alive, [False]])[None]
    reach = np.zeros((int(length) + 1, S + 1), dtype=bool)
    reach[0, :S] = automaton.final
    for r in range(1, int(length) + 1):
        reach[r, :S] = reach[r - 1][ns].any(axis=1)
    return reach


@checked
def length_automaton(automaton: Automaton, length: int, reach: np.ndarray | None = None) -> Automaton:
    """The constraint set A of a length-N process verifier (Def 3.1.3) as one token automaton: states (q, i) for the
    verifier's automaton state q after i tokens, kept where V = 1 (a string of A extends the prefix: ``reach[N - i,
    q]``), a token admitted iff V(s o t) = 1, final exactly at i = N in a final q. Its masked softmax (Def 2.8) is the
    locally optimal proposal q(t | s) = O(t | s) V(s o t) / Z_V(s) and its language is A. When A is empty the start
    state admits nothing and is not final (FAIL). ``reach``: :func:`reach_table` of ``(automaton, length)`` when the
    caller has it."""
    N = int(length)
    reach = reach_table(automaton, N) if reach is None else reach
    if reach.shape != (N + 1, automaton.num_states + 1):
        raise ConfigError(f"reach must be reach_table(automaton, {N}) of shape {(N + 1, automaton.num_states + 1)}, "
                          f"got {reach.shape}")
    aut = automaton
    S, V = aut.num_states, aut.vocab_size
    ns = aut.next_state
    live = np.stack([reach[N - i, :S] for i in range(N + 1)])  # [N + 1, S]: (q, i) kept
    live[0, aut.start] = True  # the start state always exists (admitting nothing when A is empty)
    ids = np.full((N + 1, S), DEAD, dtype=np.int64)
    ids[live] = np.arange(int(live.sum()))
    table = np.full((int(live.sum()), V), DEAD, dtype=np.int64)
    final = np.zeros(int(live.sum()), dtype=bool)
    for i in range(N + 1):  # a loop over positions
        rows = ids[i][live[i]]
        if i == N:
            final[rows] = aut.final[live[i]]
            continue
        nxt = ns[live[i]]  # [k, V]
        ok = (nxt >= 0) & live[i + 1][np.clip(nxt, 0, None)] & reach[N - i, :S][live[i]][:, None]
        table[rows] = np.where(ok, ids[i + 1][np.clip(nxt, 0, None)], DEAD)
    return Automaton(table, final, np.zeros(len(final), dtype=np.int64), int(ids[0, aut.start]), N,
                     f"{aut.name}^{N}")
