"""The first-token switch of Remark 2.8: a projection that is not disentangled (Def 3.5)."""

from __future__ import annotations

import numpy as np

from ppl_thought import checks
from ppl_thought.errors import ConfigError, UnknownTokenError
from ppl_thought.projections.automaton import Automaton, AutomatonBuilder
from ppl_thought.projections.base import Projection
from ppl_thought.resources import automaton_bytes, check_bytes
from ppl_thought.validation import checked
from ppl_thought.vocab import Vocab


@checked
class FirstTokenSwitch(Projection):
    """Remark 2.8 over any Sigma: Omega = Sigma and, for a repeat token r,
    Proj(z) = r^w if z_1 = r, and Proj(z) = z_{>1} otherwise.

    Proj is continuous and surjective with Dom(Proj) = Omega^w. Its lifting is
    lifting(empty) = {empty}, lifting(r^k) = {r} U {u r^k : u != r} for k >= 1, and
    lifting(x) = {u x : u != r} for any other x. The lifting is not the inverse of any map:
    ``r`` lies in the lifting of every r^k. In the lifting automaton of r^k, ``emitted`` jumps
    from 0 to k on reading r. It is not disentangled: with r = a,
    Phi_a(a, a) = {()} but Phi_a(ba, a) = {(a,)} (the text after Def 3.5).

    ``_project_one`` (hence :meth:`project`) returns Proj^{<w}(z) = r^w for z starting with r
    truncated to ``horizon`` tokens, since an infinite sequence cannot be returned; the lifting
    automata and the segments are exact for any length of x.
    """

    is_disentangled = False

    def __init__(self, vocab: Vocab, repeat_token: str | int, horizon: int = 8):
        super().__init__(vocab)
        r = vocab.id(repeat_token) if isinstance(repeat_token, str) else int(repeat_token)
        if r not in set(vocab.observable_ids.tolist()):
            raise UnknownTokenError(
                f"FirstTokenSwitch: repeat token {vocab.token(r)!r} is not observable "
                "(Sigma = the ordinary tokens and <eos>)"
            )
        checks.integer("FirstTokenSwitch: horizon", horizon, minimum=1)
        self.repeat_id = r
        self.horizon = int(horizon)
        sigma = vocab.observable_ids
        self._others = sigma[sigma != r]

    @property
    def latent_ids(self) -> np.ndarray:
        """Omega = Sigma."""
        return self.observable_ids

    def _project_one(self, z: np.ndarray) -> np.ndarray:
        self._check_latent_is_observable(z)
        if len(z) == 0:
            return np.zeros(0, dtype=np.int64)
        if z[0] == self.repeat_id:
            return np.full(self.horizon, self.repeat_id, dtype=np.int64)  # r^w, truncated
        return z[1:].astype(np.int64, copy=True)

    def domain(self, num_observed: int | None = None) -> Automaton:
        num_observed = checks.optional_integer("num_observed", num_observed, minimum=0)
        sigma, V = self.observable_ids, len(self.vocab)
        if num_observed is None:
            b = AutomatonBuilder(V, "FirstTokenSwitch.domain")
            s0, free, rep = b.add_state(), b.add_state(), b.add_state()
            b.edge(s0, self._others, free)
            b.edge(s0, [self.repeat_id], rep)
            b.edge(free, sigma, free)
            b.edge(rep, sigma, rep)
            return b.build(s0, None)
        n = int(num_observed)
        if n < 0:
            raise ConfigError(f"num_observed must be a non-negative integer, got {n}")
        check_bytes(automaton_bytes(n + 3, V), f"FirstTokenSwitch.domain({n})", f"num_observed={n}")
        return self._chain(n, None, f"FirstTokenSwitch.domain({n})")

    def _lifting(self, x: np.ndarray) -> Automaton:
        return self._chain(len(x), x, "FirstTokenSwitch.lifting")

    def _chain(self, n: int, x: np.ndarray | None, name: str) -> Automaton:
        b = AutomatonBuilder(len(self.vocab), name)
        if n == 0:
            return b.build(b.add_state(final=True, emitted=0), 0)
        s0 = b.add_state()
        chain = [b.add_state(final=(i == n), emitted=i) for i in range(n + 1)]
        b.edge(s0, self._others, chain[0])
        for i in range(n):
            b.edge(chain[i], self.observable_ids if x is None else [x[i]], chain[i + 1])
        if x is None or bool((x == self.repeat_id).all()):
            b.edge(s0, [self.repeat_id], b.add_state(final=True, emitted=n))
        return b.build(s0, n + 1)

    def __repr__(self) -> str:
        return (f"FirstTokenSwitch({self.vocab!r}, repeat_token={self.vocab.token(self.repeat_id)!r}, "
                f"horizon={self.horizon})")
