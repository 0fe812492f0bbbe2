"""Projections Proj: Omega^w -> Sigma^w, their liftings and token automata (Sections 2.6, 5.1).

- :class:`Identity` (Ex 2.1), :class:`Product` (Ex 2.2), :class:`PauseToThink` (Ex 2.3, (5.1)),
  :class:`SparseThoughts` (Ex 2.4), :class:`QueryResponse` (Section 5.1, (5.1)-(5.4)),
  :class:`FirstTokenSwitch` (Remark 2.8, not disentangled).
- :class:`Projection`: the base class; :class:`Automaton`, :class:`AutomatonBuilder`: token automata.
"""

from ppl_thought.projections.automaton import DEAD, Automaton, AutomatonBuilder
from ppl_thought.projections.base import Projection
from ppl_thought.projections.identity import Identity
from ppl_thought.projections.pause import PauseToThink
from ppl_thought.projections.product import Product
from ppl_thought.projections.query_response import QueryResponse
from ppl_thought.projections.sparse import SparseThoughts, exponential_schedule
from ppl_thought.projections.switch import FirstTokenSwitch

__all__ = [
    "DEAD",
    "Automaton",
    "AutomatonBuilder",
    "FirstTokenSwitch",
    "Identity",
    "PauseToThink",
    "Product",
    "Projection",
    "QueryResponse",
    "SparseThoughts",
    "exponential_schedule",
]
