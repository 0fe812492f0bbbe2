"""Token automata: integer state arrays with transition and mask tables (Def 2.8, (2.26)).

An :class:`Automaton` reads latent tokens one at a time. Its table ``next_state[s, a]`` is the
state after reading token ``a`` in state ``s``, or ``-1`` where ``a`` is not admissible; the
admissible next tokens Phi^{<=1}(z) of (2.26) are ``next_state[s] >= 0``. ``final[s]`` marks a
complete string: for a lifting automaton, the strings that end in a final state are exactly
Proj^{-1}_{<w}(x) (Prop 2.3); since liftings are prefix-free no token is admissible there, and
decoding stops. ``emitted[s]`` is |Proj^{<w}(z)| (Def 2.6), the number of observable tokens
the prefix read so far determines (capped at |x| for a lifting); it gives the unique segment
decomposition of Lemma 2.1 and the step structure that SMC advances on.

``-1`` is the dead state: stepping it stays dead and its mask is empty. Every operation is
vectorised over a batch of states, so all particles move at once. The tables are numpy; a batch of
torch tensors (or jax arrays) is stepped with the same tables lent to its framework and device and
cached per device (:mod:`ppl_thought.projections.arrays`), so this module imports neither framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ppl_thought import checks
from ppl_thought.errors import ConfigError, TooLargeToEnumerateError
from ppl_thought.projections.arrays import as_framework_array, table_key
from ppl_thought.validation import ArrayLike, checked, per_token
from ppl_thought.vocab import BOS_ID, PAD_ID

DEAD = -1


def _dtype_kind(dtype) -> str:
    """NumPy's kind letter of a NumPy, torch or JAX dtype ("f" for the float types NumPy does not name)."""
    try:
        return dtype.kind if isinstance(dtype, np.dtype) else np.dtype(str(dtype).replace("torch.", "")).kind
    except TypeError:
        return "f"


@checked
@dataclass(frozen=True, eq=False)
class Automaton:
    """A deterministic token automaton over the whole vocabulary (one column per token id).

    Attributes:
        next_state: int64 ``[S, V]``; ``-1`` where the token is inadmissible.
        final: bool ``[S]``; reading stops in a final state (the string is complete).
        emitted: int64 ``[S]``; observable tokens determined so far, |Proj^{<w}(z)|.
        start: the start state.
        max_len: the longest accepted string, or ``None`` when unbounded (a domain automaton).
        tokenizer: the fingerprint of the token texts a lifted automaton was built from (or ``None``).
    """

    next_state: ArrayLike
    final: ArrayLike
    emitted: ArrayLike
    start: int = 0
    max_len: int | None = None
    name: str = "automaton"
    #: the fingerprint of the token texts it was built from (:func:`~ppl_thought.projections.token_automaton`),
    #: checked against an LM's vocabulary where the two meet (``Constrained``, ``OneTokenStep.of``); ``None``:
    #: built from a table, not checked
    tokenizer: str | None = None
    _table: np.ndarray = field(init=False, repr=False)
    _device_cache: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        # every failure is a ConfigError naming the field, its value and what is expected (a ValueError too)
        for what, value, integral in (("next_state", self.next_state, True), ("final", self.final, False),
                                      ("emitted", self.emitted, True)):
            checks.numeric_array(what, value, expects="an array of integers" if integral else "an array of bools")
            kind = np.asarray(value).dtype.kind if not hasattr(value, "dtype") else None
            if integral and (kind or _dtype_kind(value.dtype)) not in "iu":
                raise ConfigError(f"{what} must hold integers (states, counts), got dtype "
                                  f"{getattr(value, 'dtype', None) or np.asarray(value).dtype}")
        ns = np.asarray(self.next_state, dtype=np.int64)
        if ns.ndim != 2 or ns.shape[0] == 0:
            raise ConfigError(f"next_state must be a non-empty [S, V] table, got shape {ns.shape}")
        S = ns.shape[0]
        if ns.min() < -1 or ns.max() >= S:
            raise ConfigError(f"next_state entries must be -1 or a state index in [0, {S}), got values in "
                              f"[{ns.min()}, {ns.max()}]")
        final = np.asarray(self.final, dtype=bool)
        emitted = np.asarray(self.emitted, dtype=np.int64)
        if final.shape != (S,) or emitted.shape != (S,):
            raise ConfigError(f"final and emitted must have shape ({S},), got {final.shape} and {emitted.shape}")
        checks.integer("start", self.start, 0)
        if not 0 <= self.start < S:
            raise ConfigError(f"start state {self.start} outside [0, {S})")
        checks.optional_integer("max_len", self.max_len, 0)
        object.__setattr__(self, "next_state", ns)
        object.__setattr__(self, "final", final)
        object.__setattr__(self, "emitted", emitted)
        # one extra row for the dead state: table[-1] is all -1, so stepping -1 stays -1.
        table = np.concatenate([ns, np.full((1, ns.shape[1]), DEAD, dtype=np.int64)], axis=0)
        object.__setattr__(self, "_table", table)

    # ------------------------------------------------------------------ sizes
    @property
    def num_states(self) -> int:
        return self.next_state.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.next_state.shape[1]

    @property
    def allowed(self) -> np.ndarray:
        """bool ``[S, V]``: the admissible next tokens of each state, Phi^{<=1} of (2.26)."""
        return self.next_state >= 0

    # ------------------------------------------------------------------ batched stepping
    @per_token
    def step(self, states: ArrayLike | int, tokens: ArrayLike | int):
        """States after reading ``tokens`` (same shape; numpy, torch or jax arrays). Numpy states (e.g.
        ``start_states(n)``) read with framework tokens come back in the tokens' framework and device."""
        states = _like_tokens(states, tokens)
        if table_key(states) is not None:
            return self.device_table("table", states)[states, tokens]
        return self._table[np.asarray(states), np.asarray(tokens)]

    @per_token
    def advance(self, states: ArrayLike | int, tokens: ArrayLike | int):
        """:meth:`step` on framework arrays, except that ``<pad>`` (id 0, never admissible) keeps the state:
        one gather steps a right-padded batch."""
        states = _like_tokens(states, tokens)
        return self.device_table("advance", states)[states, tokens]

    @per_token
    def mask(self, states: ArrayLike | int):
        """bool ``[..., V]``: admissible next tokens for a batch of states (dead -> all False)."""
        if table_key(states) is not None:
            return self.device_table("table", states)[states] >= 0
        return self._table[np.asarray(states)] >= 0

    @per_token
    def is_final(self, states: ArrayLike | int):
        if table_key(states) is not None:
            return (states >= 0) & self.device_table("final", states)[states]
        s = np.asarray(states)
        return (s >= 0) & self._host_table("final")[s]

    @per_token
    def num_emitted(self, states: ArrayLike | int):
        """|Proj^{<w}| of the prefixes that led to ``states`` (dead -> -1)."""
        if table_key(states) is not None:
            return self.device_table("emitted", states)[states]
        return self._host_table("emitted")[np.asarray(states)]

    def start_states(self, n: int, like: Any = None):
        """``n`` start states (int64) in the framework and on the device of ``like`` (an array, a torch
        device, or a torch device name; numpy when ``None``)."""
        return self.device_table("start", like).repeat(n)

    # ------------------------------------------------------------------ tables on a device
    @per_token
    def device_table(self, what: str, like: Any):
        """One of the tables, with the dead state as row ``-1``, in the framework and on the device of
        ``like`` (cached per device):

        - ``"table"``: next states ``[S + 1, V]`` (the dead row is all ``-1``);
        - ``"advance"``: the same, except that ``<pad>`` keeps a live state;
        - ``"final"``: bool ``[S + 1]``; ``"emitted"``: int64 ``[S + 1]`` (dead -> -1);
        - ``"start"``: int64 ``[1]`` holding the start state.
        """
        key = table_key(like)
        if key is None:
            return self._host_table(what)
        t = self._device_cache.get((what, key))
        if t is None:
            t = as_framework_array(self._host_table(what), key)
            self._device_cache[(what, key)] = t
        return t

    def _host_table(self, what: str) -> np.ndarray:
        if what == "table":
            return self._table
        if what == "advance":
            src = self._table.copy()
            if (src[:-1, 0] >= 0).any():
                raise ConfigError("this automaton reads id 0 as a token: <pad> cannot keep the state")
            src[:-1, 0] = np.arange(src.shape[0] - 1)  # <pad> keeps a live state; the dead row stays dead
            return src
        if what == "final":
            return np.concatenate([self.final, [False]])
        if what == "emitted":
            return np.concatenate([self.emitted, [-1]])
        if what == "start":
            return np.array([self.start], dtype=np.int64)
        raise ConfigError(f"unknown automaton table {what!r}")

    # ------------------------------------------------------------------ single strings
    def run(self, z: ArrayLike) -> np.ndarray:
        """The state after each prefix of ``z``: array of length ``len(z) + 1`` (``-1`` once dead)."""
        z = np.asarray(z, dtype=np.int64).ravel()
        out = np.empty(len(z) + 1, dtype=np.int64)
        s = self.start
        out[0] = s
        for i, a in enumerate(z):
            s = int(self._table[s, a]) if 0 <= a < self.vocab_size else DEAD
            out[i + 1] = s
        return out

    def accepts(self, z: ArrayLike) -> bool:
        """Whether ``z`` is read without leaving the automaton and ends in a final state."""
        s = int(self.run(z)[-1])
        return s >= 0 and bool(self.final[s])

    def admits_prefix(self, z: ArrayLike) -> bool:
        """Whether ``z`` is a prefix of some accepted string (for a domain: z in Dom(Proj^{<w}))."""
        return int(self.run(z)[-1]) >= 0

    def enumerate(self, limit: int = 100_000) -> list[tuple[int, ...]]:
        """All accepted strings (depth-first, in id order). Requires a finite language.

        Raises :class:`~ppl_thought.errors.TooLargeToEnumerateError` past ``limit`` strings or
        when the automaton accepts an unbounded language.
        """

        if self.max_len is None:
            raise TooLargeToEnumerateError(f"{self.name} accepts unboundedly long strings; cannot enumerate")
        out: list[tuple[int, ...]] = []
        # every state's moves, as Python ints, read once (in reverse id order, so the stack pops in id order)
        rows, cols = np.nonzero(self.allowed)
        targets = self.next_state[rows, cols]
        moves: list[list[tuple[int, int]]] = [[] for _ in range(self.allowed.shape[0])]
        for s_, a, t in zip(rows.tolist()[::-1], cols.tolist()[::-1], targets.tolist()[::-1], strict=True):
            moves[s_].append((t, a))
        final = self.final.tolist()
        stack: list[tuple[int, tuple[int, ...]]] = [(self.start, ())]
        while stack:
            s, z = stack.pop()
            if final[s]:
                out.append(z)
                if len(out) > limit:
                    raise TooLargeToEnumerateError(
                        f"{self.name} accepts more than {limit} strings; raise `limit` or use a sampler"
                    )
            for t, a in moves[s]:
                stack.append((t, z + (a,)))
        return out

    def count(self) -> int:
        """Number of accepted strings, by dynamic programming over the (acyclic) state graph."""
        if self.max_len is None:
            raise TooLargeToEnumerateError(f"{self.name} accepts unboundedly long strings")
        memo: dict[int, int] = {}
        order = self._topological_order()
        for s in reversed(order):
            c = int(self.final[s])
            for a in np.nonzero(self.next_state[s] >= 0)[0]:
                c += memo[int(self.next_state[s, a])]
            memo[s] = c
        return memo[self.start]

    def _topological_order(self) -> list[int]:
        seen: set[int] = set()
        order: list[int] = []
        stack = [(self.start, False)]
        while stack:
            s, done = stack.pop()
            if done:
                order.append(s)
                continue
            if s in seen:
                continue
            seen.add(s)
            stack.append((s, True))
            for t in set(self.next_state[s][self.next_state[s] >= 0].tolist()):
                if t not in seen:
                    stack.append((t, False))
        return order[::-1]

    def __repr__(self) -> str:
        return (
            f"Automaton({self.name}: {self.num_states} states x {self.vocab_size} tokens, "
            f"start={self.start}, max_len={self.max_len})"
        )


@checked
class AutomatonBuilder:
    """Helper to build tables state by state: ``b.add_state(final, emitted)``, ``b.edge(s, tokens, t)``."""

    def __init__(self, vocab_size: int, name: str = "automaton"):
        self.V = vocab_size
        self.name = name
        self._rows: list[np.ndarray] = []
        self._final: list[bool] = []
        self._emitted: list[int] = []

    def add_state(self, final: bool = False, emitted: int = 0) -> int:
        self._rows.append(np.full(self.V, DEAD, dtype=np.int64))
        self._final.append(bool(final))
        self._emitted.append(int(emitted))
        return len(self._rows) - 1

    def edge(self, src: int, tokens: ArrayLike | int, dst: int) -> None:
        self._rows[src][np.asarray(tokens, dtype=np.int64)] = dst

    def build(self, start: int = 0, max_len: int | None = None) -> Automaton:
        return Automaton(
            np.stack(self._rows), np.array(self._final), np.array(self._emitted), start, max_len, self.name
        )


def step_ends(lifting: Automaton, chunked: bool = False) -> tuple[int, ...]:
    """Where the steps of a step-wise (SMC) program end, as observable counts: step k draws the latent tokens
    until ``ends[k]`` observables are determined (the last step: until a final state of the lifting).

    Token by token (``chunked=False``) step t is segment t of Lemma 2.1: ``(1, 2, ..., |x|)``. Chunked
    (end of Section 5.6.2) a step also takes every following segment that is *forced*: one in which no live
    state of the lifting admits more than one token (e.g. an observable x_t between two sparse thoughts, which
    the lifting fixes), so a step begins only where a thought may start and the text after it is encoded
    in one chunk. The product of the step laws is the same law of z either way (a coarser decomposition of
    Lemma 2.1); SMC only resamples less often.
    """
    final = np.asarray(lifting.final, dtype=bool)
    emitted = np.asarray(lifting.emitted, dtype=np.int64)
    T = int(emitted[final].max()) if final.any() else 0
    if not chunked:
        return tuple(range(1, T + 1)) if T else (0,)
    allowed = lifting.next_state >= 0
    allowed[:, [PAD_ID, BOS_ID]] = False  # never tokens of z
    free = (allowed.sum(1) > 1) & ~final
    free_at = np.zeros(T + 1, dtype=bool)
    np.logical_or.at(free_at, np.clip(emitted[free], 0, T), True)
    return tuple(int(t) for t in range(1, T) if free_at[t]) + (T,)



@checked
def forced_runs(automaton: Automaton, until: int | None, stops: tuple[int, ...], limit: int) -> tuple[np.ndarray, ...]:
    """The host (numpy) tables of the *forced runs* of chunked encoding (end of Section 5.6.2), read by both backends.

    A token is forced in a state when it is the only admissible one there (never ``<pad>`` / ``<bos>``): the masked
    softmax of Def 2.8 gives it probability 1 whatever the logits (if the LM gives it any mass at all), so no decoding
    decision is made. From each state the run follows forced tokens for at most ``limit`` tokens and stops before a
    token that would end the segment (``until`` observables emitted, a final state) or that is a stop id. Returns
    (run length ``[S + 1]``, tokens ``[S + 1, limit]`` (``<pad>`` past the run), states ``[S + 1, limit + 1]``: the
    state before each run token and after the run (held once the run stops)); the last row is the dead state."""
    table = automaton.device_table("table", None)  # [S + 1, V], the dead row all -1
    n_states = table.shape[0]
    allowed = table >= 0
    allowed[:, PAD_ID] = False
    allowed[:, BOS_ID] = False
    single = allowed.sum(1) == 1
    tok = np.where(single, allowed.argmax(1), PAD_ID)
    nxt = np.where(single, table[np.arange(n_states), tok], n_states - 1)
    final = automaton.device_table("final", None)
    seg_end = final if until is None else final | (automaton.device_table("emitted", None) >= until)
    safe = single & ~seg_end[nxt] & ~np.isin(tok, np.asarray(stops, dtype=np.int64))
    safe[-1] = False
    cur = np.arange(n_states)
    going = np.ones(n_states, dtype=bool)
    run_len = np.zeros(n_states, dtype=np.int64)
    toks = np.full((n_states, limit), PAD_ID, dtype=np.int64)
    states = np.empty((n_states, limit + 1), dtype=np.int64)
    states[:, 0] = cur
    for j in range(limit):
        going = going & safe[cur]
        toks[:, j] = np.where(going, tok[cur], PAD_ID)
        cur = np.where(going, nxt[cur], cur)
        run_len += going
        states[:, j + 1] = cur
    return run_len, toks, states

def _like_tokens(states, tokens):
    """Host (numpy) states moved to the framework and device of framework ``tokens``; otherwise unchanged."""
    key = table_key(tokens)
    if key is not None and table_key(states) is None:
        return as_framework_array(np.asarray(states, dtype=np.int64), key)
    return states
