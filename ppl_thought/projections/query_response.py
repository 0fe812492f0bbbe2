"""The multi-round query-response format of Section 5.1, (5.1)-(5.4)."""

from __future__ import annotations

import numpy as np

from ppl_thought import checks
from ppl_thought.errors import NotInDomainError
from ppl_thought.projections.base import Projection
from ppl_thought.projections.phase_tables import PhaseMachine, phase_tables, set_edges
from ppl_thought.validation import checked
from ppl_thought.vocab import Vocab


@checked
class QueryResponse(PhaseMachine, Projection):
    """Section 5.1: observations alternate queries and responses, each ending in ``<eos>``,
    x = x_q^(1) x_r^(1) x_q^(2) ... with x_q, x_r in Sigma_box^* = {w <eos> : <eos> not in w};
    the latent sequence puts exactly one thought y^(t) in T = {<s> w </s> : w ordinary^{<=c}}
    right after each query's ``<eos>`` (before each response) and nowhere else:
    Omega_q^w = {(x_q^(t) y^(t) x_r^(t))_t}. Thoughts may be empty (``<s></s>``), as in (5.1).

    Admissible next tokens: in a query or a response, Sigma; right after a query's ``<eos>``,
    only ``<s>``; inside a thought of k tokens, ordinary tokens and ``</s>`` while k < c, only
    ``</s>`` at k = c (the masks described after (5.4): never ``<eos>`` or ``<s>``).

    The lifting (5.3) ends at the last observable token: when x ends with a query's ``<eos>`` the
    next thought is not part of it. Phi_x(z, a) of (5.4) is {y a : y in T} when x ends a query
    and {a} otherwise, whatever z: Proj is disentangled (Def 3.5). Every x in Sigma* is a prefix
    of the format (split it at its ``<eos>`` tokens), so every x is in the image.
    """

    is_disentangled = True

    def __init__(self, vocab: Vocab, max_thought_len: int):
        super().__init__(vocab)
        c = checks.integer("QueryResponse: max_thought_len", max_thought_len, minimum=0)
        self.max_thought_len = c
        # phases: Q = 0 (in a query), A = 1 (after a query's <eos>), T_k = 2 + k, Rsp = c + 3
        Q, A, Rsp = 0, 1, c + 3
        nxt, em = phase_tables(c + 4, len(vocab))
        ordinary, eos = vocab.ordinary_ids, [vocab.eos_id]
        set_edges(nxt, em, Q, ordinary, Q, emitting=True)
        set_edges(nxt, em, Q, eos, A, emitting=True)
        set_edges(nxt, em, A, [vocab.think_id], 2, emitting=False)
        for k in range(c + 1):
            if k < c:
                set_edges(nxt, em, 2 + k, ordinary, 3 + k, emitting=False)
            set_edges(nxt, em, 2 + k, [vocab.end_think_id], Rsp, emitting=False)
        set_edges(nxt, em, Rsp, ordinary, Rsp, emitting=True)
        set_edges(nxt, em, Rsp, eos, Q, emitting=True)
        self._tables = (nxt, em)

    def _project_one(self, z: np.ndarray) -> np.ndarray:
        v, c = self.vocab, self.max_thought_len
        ordinary = set(v.ordinary_ids.tolist())
        out: list[int] = []
        phase = "query"  # query | await (after a query's <eos>) | thought | response
        k = 0
        for i, a in enumerate(z.tolist()):
            name = v.token(a)
            if phase in ("query", "response"):
                if a in ordinary:
                    out.append(a)
                elif a == v.eos_id:
                    out.append(a)
                    phase = "await" if phase == "query" else "query"
                else:
                    raise NotInDomainError(
                        f"QueryResponse: token {name!r} at position {i} inside a {phase}; a thought is "
                        "allowed only right after a query's <eos>"
                    )
            elif phase == "await":
                if a != v.think_id:
                    raise NotInDomainError(
                        f"QueryResponse: token {name!r} at position {i}: a thought <s> ... </s> must follow "
                        "each query's <eos>"
                    )
                phase, k = "thought", 0
            elif a == v.end_think_id:
                phase = "response"
            elif a in ordinary and k < c:
                k += 1
            elif a in ordinary:
                raise NotInDomainError(f"QueryResponse: thought longer than max_thought_len={c} "
                                       f"at position {i}")
            else:
                raise NotInDomainError(
                    f"QueryResponse: token {name!r} at position {i} inside a thought; thoughts contain "
                    "ordinary tokens only"
                )
        return np.asarray(out, dtype=np.int64)

    def __repr__(self) -> str:
        return f"QueryResponse({self.vocab!r}, max_thought_len={self.max_thought_len})"
