"""Projections Proj: Omega^w -> Sigma^w, their liftings and token automata (Sections 2.6, 5.1).

- :class:`Identity` (Ex 2.1), :class:`Product` (Ex 2.2), :class:`PauseToThink` (Ex 2.3, (5.1)),
  :class:`SparseThoughts` (Ex 2.4), :class:`QueryResponse` (Section 5.1, (5.1)-(5.4)),
  :class:`FirstTokenSwitch` (Remark 2.8, not disentangled).
- :class:`Projection`: the base class; :class:`Automaton`, :class:`AutomatonBuilder`: token automata.
- Constraints over any tokenizer: :class:`CharDFA` (a regular expression, a lipogram, bounded-depth Dyck
  (2.37), their intersections and unions) lifted to a token :class:`Automaton` by :func:`token_automaton`.
"""

from ppl_thought.projections.automaton import DEAD, Automaton, AutomatonBuilder
from ppl_thought.projections.base import Projection
from ppl_thought.projections.char_dfa import CharDFA
from ppl_thought.projections.identity import Identity
from ppl_thought.projections.pause import PauseToThink
from ppl_thought.projections.product import Product
from ppl_thought.projections.query_response import QueryResponse
from ppl_thought.projections.sparse import SparseThoughts, exponential_schedule
from ppl_thought.projections.switch import FirstTokenSwitch
from ppl_thought.projections.token_lift import token_automaton, token_texts

__all__ = [
    "DEAD",
    "Automaton",
    "AutomatonBuilder",
    "CharDFA",
    "FirstTokenSwitch",
    "Identity",
    "PauseToThink",
    "Product",
    "Projection",
    "QueryResponse",
    "SparseThoughts",
    "exponential_schedule",
    "token_automaton",
    "token_texts",
]

