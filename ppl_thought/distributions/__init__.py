"""Pyro distributions over token sequences (``pt.dist``)."""

from ppl_thought.distributions.lm_sequence import DecodeState, LMSequence, concat, trim_padding
from ppl_thought.distributions.projected import ProjectionDelta

__all__ = ["LMSequence", "DecodeState", "ProjectionDelta", "concat", "trim_padding"]
