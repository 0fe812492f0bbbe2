"""``ptn.dist``: the NumPyro distributions of the JAX backend in one namespace (docs/numpyro.md): the sequence
distributions of :mod:`ppl_thought.numpyro.distributions` (LMSequence, ProjectionDelta, TokenRule and the
decoding loop) and the program-side sequence sites of :mod:`ppl_thought.numpyro.lm_state` (LMState). What users
call, only: the helpers the distributions are built from (``const``, ``tree_where``, ``Tables``, ``NEG_INF``,
``encode``, ``score``, ``sample_token``) stay importable from :mod:`ppl_thought.numpyro.distributions`."""

from ppl_thought.numpyro.distributions import (
    LMSequence,
    ProjectionDelta,
    TokenRule,
    check_ids,
    decode,
    masked_log_softmax,
    pad_to,
    tables,
    teacher_forced,
)
from ppl_thought.numpyro.lm_state import LMState, NextToken, Segment

__all__ = ["LMSequence", "LMState", "NextToken", "ProjectionDelta", "Segment", "TokenRule", "check_ids", "decode",
           "masked_log_softmax", "pad_to", "tables", "teacher_forced"]
