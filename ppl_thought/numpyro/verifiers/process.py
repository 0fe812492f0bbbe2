"""The perfect process verifier of Def 3.1.3 on the JAX side (torch twin: ppl_thought/verifiers/process.py).

``V(s) = 1`` iff some ``s'`` makes ``s o s'`` a member of ``A`` (of length ``N`` when a length is given), decided
exactly from the automaton state of the prefix by the numpy reachability table both backends build
(:func:`~ppl_thought.projections.constraints.reach_table`): one gather, batched over rows, jit-able. The automaton
is any token :class:`~ppl_thought.projections.Automaton` (:func:`~ppl_thought.projections.constraints.dyck`,
``token_automaton`` of a character DFA); its tables are the ones the JAX token rules read
(:func:`~ppl_thought.numpyro.distributions.tables`: the dead state is the last row, ``-1`` wraps onto it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.numpyro.boundary import ArrayLike, as_numpy, checked_jax
from ppl_thought.numpyro.distributions import const, tables
from ppl_thought.projections.automaton import Automaton
from ppl_thought.projections.constraints import reach_table
from ppl_thought.validation import per_token
from ppl_thought.vocab import PAD_ID

__all__ = ["ProcessVerifier", "as_verifier"]


@checked_jax
class ProcessVerifier:
    """The perfect process verifier of Def 3.1.3 for the constraint set of a token automaton, in JAX.

    ``reach[r, q]`` (numpy, :func:`~ppl_thought.projections.constraints.reach_table`) says whether a final state
    can be reached from state ``q`` in exactly ``r`` tokens (any number when ``length`` is ``None``); a call is one
    automaton pass (a ``lax.scan`` over positions) and one gather, all rows at once. The same numbers as
    ``pt.verifiers.ProcessVerifier`` on the same automaton (both read one table).
    """

    def __init__(self, automaton: Automaton, length: int | None = None):
        if length is not None and (isinstance(length, bool) or int(length) < 0):
            raise ConfigError(f"length must be a non-negative integer or None, got {length!r}")
        if (automaton.next_state[:, PAD_ID] >= 0).any():
            raise ConfigError("the constraint automaton reads <pad> (id 0) as a token: padded prefixes are ambiguous")
        self.automaton = automaton
        self.length = None if length is None else int(length)
        self._reach = reach_table(automaton, self.length)  # numpy [N + 1 or 1, S + 1]; the dead column False
        self.reach = const(self._reach)

    def __repr__(self) -> str:
        return f"ptn.verifiers.ProcessVerifier({self.automaton.name}, length={self.length})"

    @per_token
    def from_states(self, states: Any, lengths: Any) -> jax.Array:
        """V(s) ``[n]`` for prefixes given by their automaton states ``[n]`` (``-1``: dead) and lengths (``[n]`` or
        one for all)."""
        states = jnp.asarray(states, jnp.int32)
        live = states >= 0
        if self.length is None:
            return live & self.reach[0][states]
        remaining = self.length - jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), states.shape)
        ok = live & (remaining >= 0)
        return ok & self.reach[jnp.clip(remaining, 0, self.length), states]

    def states(self, prefixes: ArrayLike) -> tuple[jax.Array, jax.Array]:
        """(automaton state ``[n]``, length ``[n]``) of right-padded prefixes ``[n, L]`` (``-1`` once dead)."""
        p = as_numpy("prefixes", prefixes, where="ProcessVerifier.states")
        if p.ndim != 2 or (p.size and not np.issubdtype(p.dtype, np.integer)):
            raise MalformedSequenceError(f"prefixes must be integer ids [n, L], got {p.dtype} of shape {p.shape}")
        V = self.automaton.vocab_size
        if p.size and (p.min() < 0 or p.max() >= V):
            raise MalformedSequenceError(f"token ids must lie in [0, {V})")
        is_tok = p != PAD_ID
        if p.shape[1] > 1 and (is_tok[:, 1:] & ~is_tok[:, :-1]).any():
            raise MalformedSequenceError("prefixes must be right-padded: a token after <pad>")
        t = tables(self.automaton)
        s0 = jnp.full((p.shape[0],), t.start, jnp.int32)
        s, _ = jax.lax.scan(lambda s, tok: (t.advance(s, tok), None), s0, jnp.asarray(p, jnp.int32).T)
        return s, jnp.asarray(is_tok.sum(-1), jnp.int32)

    def __call__(self, prefixes: ArrayLike) -> jax.Array:
        """V(s) (Def 3.1.3) for each right-padded row of ``prefixes [n, L]``: bool ``[n]``."""
        s, lengths = self.states(prefixes)
        return self.from_states(s, lengths)

    def accepts(self, strings: ArrayLike) -> jax.Array:
        """Membership in ``A`` of complete right-padded strings ``[n, L]``: accepted and, with a length, of it."""
        s, lengths = self.states(strings)
        t = tables(self.automaton)
        ok = (s >= 0) & t.final[s]
        return ok if self.length is None else ok & (lengths == self.length)


@checked_jax
def as_verifier(verifier: Any) -> ProcessVerifier:
    """A JAX :class:`ProcessVerifier` from one (returned as is) or from any object with ``automaton`` and ``length``
    (``pt.verifiers.ProcessVerifier``, read without importing torch: its automaton is the shared numpy table)."""
    if isinstance(verifier, ProcessVerifier):
        return verifier
    aut = getattr(verifier, "automaton", None)
    if not isinstance(aut, Automaton) or not hasattr(verifier, "length"):
        raise ConfigError(f"expected a ProcessVerifier (ptn.verifiers or pt.verifiers), got {type(verifier).__name__}")
    return ProcessVerifier(aut, verifier.length)

