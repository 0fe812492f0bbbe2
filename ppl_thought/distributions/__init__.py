"""Pyro distributions over token sequences (``pt.dist``)."""

from ppl_thought.distributions.lm_sequence import LMSequence, concat, register_lm, trim_padding
from ppl_thought.distributions.lm_state import LMState, Segment, TokenRule
from ppl_thought.distributions.projected import ProjectionDelta

__all__ = ["LMSequence", "LMState", "Segment", "TokenRule", "ProjectionDelta", "concat", "register_lm",
           "trim_padding"]

