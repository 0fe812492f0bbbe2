"""``ptn.dist``: the NumPyro distributions of the JAX backend in one namespace (docs/numpyro.md): the sequence
distributions of :mod:`ppl_thought.numpyro.distributions` (LMSequence, ProjectionDelta, TokenRule and the
decoding loop) and the program-side sequence sites of :mod:`ppl_thought.numpyro.lm_state` (LMState)."""

from ppl_thought.numpyro.distributions import (
    NEG_INF,
    LMSequence,
    ProjectionDelta,
    Tables,
    TokenRule,
    check_ids,
    const,
    decode,
    encode,
    masked_log_softmax,
    pad_to,
    sample_token,
    score,
    tables,
    teacher_forced,
    tree_where,
)
from ppl_thought.numpyro.lm_state import LMState, NextToken, Segment

__all__ = ["NEG_INF", "LMSequence", "LMState", "NextToken", "ProjectionDelta", "Segment", "Tables", "TokenRule",
           "check_ids", "const", "decode", "encode", "masked_log_softmax", "pad_to", "sample_token", "score",
           "tables", "teacher_forced", "tree_where"]

