"""Pause to think, Example 2.3 and (5.1): a thought ``<s> y </s>`` may precede each observable token."""

from __future__ import annotations

import numpy as np

from ppl_thought import checks
from ppl_thought.errors import NotInDomainError
from ppl_thought.projections.base import Projection
from ppl_thought.projections.phase_tables import PhaseMachine, phase_tables, set_edges
from ppl_thought.validation import checked
from ppl_thought.vocab import Vocab


@checked
class PauseToThink(PhaseMachine, Projection):
    """Ex 2.3 with constant bounds c_t = c: Dom(Proj) = {(y^(t) x_t)_t : x_t in Sigma, y^(t) in T_c},
    T_c = {empty} U {<s> y </s> : y ordinary, 1 <= |y| <= c}, and Proj deletes the thoughts.

    Admissible next tokens Phi^{<=1}(z) of (2.26) (the masks of :meth:`domain`):

    - at the start or after an observable token: Sigma and ``<s>``;
    - right after ``<s>``: ordinary tokens (a thought has at least one token);
    - inside a thought of k tokens: ordinary tokens and ``</s>`` while k < c, only ``</s>`` at k = c;
    - right after ``</s>``: Sigma (no two thoughts in a row).

    Thoughts are ordinary tokens only, never ``<eos>``, as in the masks of Section 5.1 (the
    text of Ex 2.3 writes y in Sigma*, which would include ``<eos>``). The lifting of x is
    {(y^(t) x_t)_{t<=|x|}}: it ends with the last observable token, so it is prefix-free, and
    Phi_x(z, a) = {y a : y in T_c} does not depend on z: Proj is disentangled (Def 3.5).
    Every x in Sigma* is in the image. ``|lifting(x)| = (1 + sum_{k=1}^c m^k)^{|x|}`` for m
    ordinary tokens (exponential: not polynomially simple, Def 2.9); its automaton has
    |x| (c + 3) + 1 states.
    """

    is_disentangled = True

    def __init__(self, vocab: Vocab, max_thought_len: int):
        super().__init__(vocab)
        c = checks.integer("PauseToThink: max_thought_len (a thought has 1..c tokens)", max_thought_len, minimum=1)
        self.max_thought_len = c
        # phases: R = 0 (start / after an observable), T_k = 1 + k (k tokens into a thought), P = c + 2
        R, P = 0, c + 2
        nxt, em = phase_tables(c + 3, len(vocab))
        sigma, ordinary = vocab.observable_ids, vocab.ordinary_ids
        set_edges(nxt, em, R, sigma, R, emitting=True)
        set_edges(nxt, em, R, [vocab.think_id], 1, emitting=False)
        for k in range(c + 1):
            if k < c:
                set_edges(nxt, em, 1 + k, ordinary, 2 + k, emitting=False)
            if k >= 1:
                set_edges(nxt, em, 1 + k, [vocab.end_think_id], P, emitting=False)
        set_edges(nxt, em, P, sigma, R, emitting=True)
        self._tables = (nxt, em)

    def _project_one(self, z: np.ndarray) -> np.ndarray:
        v, c = self.vocab, self.max_thought_len
        sigma = set(self.observable_ids.tolist())
        ordinary = set(v.ordinary_ids.tolist())
        out: list[int] = []
        k = None  # tokens inside the open thought, None outside
        after_thought = False
        for i, a in enumerate(z.tolist()):
            if k is None:
                if a in sigma:
                    out.append(a)
                    after_thought = False
                elif a == v.think_id and not after_thought:
                    k = 0
                elif a == v.think_id:
                    raise NotInDomainError(f"PauseToThink: <s> at position {i} right after </s>: "
                                           "two thoughts in a row (an observable token must come between)")
                elif a == v.end_think_id:
                    raise NotInDomainError(f"PauseToThink: </s> at position {i} outside a thought")
                else:
                    raise NotInDomainError(f"PauseToThink: token {v.token(a)!r} at position {i} is not in "
                                           "Omega = Sigma + {<s>, </s>}")
            elif a == v.end_think_id:
                if k == 0:
                    raise NotInDomainError(f"PauseToThink: empty thought <s></s> at position {i - 1} "
                                           "(a thought has 1..c tokens)")
                k, after_thought = None, True
            elif a in ordinary:
                if k == c:
                    raise NotInDomainError(f"PauseToThink: thought longer than max_thought_len={c} "
                                           f"at position {i}")
                k += 1
            else:
                raise NotInDomainError(f"PauseToThink: token {v.token(a)!r} at position {i} inside a "
                                       "thought; thoughts contain ordinary tokens only")
        return np.asarray(out, dtype=np.int64)

    def __repr__(self) -> str:
        return f"PauseToThink({self.vocab!r}, max_thought_len={self.max_thought_len})"
