"""Model transforms: the static theory as composable effect handlers (``pt.transforms``, docs/architecture.md).

- :class:`ProjectionLift` (Def 2.8, (2.22), Lemma 2.1): a plain LM program becomes Proj # P_f.
- :class:`Forgetful` (Def 5.1, (5.5)-(5.8)): earlier thoughts leave the context when a new thought starts.
- :class:`Persistent` / :class:`Ubiquitous` (5.6.1): thoughts stay in context / may stand anywhere in the text.
- :class:`CostAware` ((5.26)-(5.27), 5.6.3): the cost-aware objective, thought length against likelihood.
- :func:`chunked_sample` (end of 5.6.2): sparse thoughts decoded with the text between them in chunks.
- :class:`ActiveLift` (Section 6): a learned sampler Q, latent prior P and generator G in one LM in place of a
  fixed projection; its objectives are in :mod:`ppl_thought.training.active`.
- :func:`compose`, :func:`sequence_start`, :class:`Transform`, :class:`Transformed`: the machinery.
"""

from ppl_thought.transforms.active import ActiveLift, score_continuation
from ppl_thought.transforms.base import Transform, Transformed, TransformedFunction, compose, rebuild, sequence_start
from ppl_thought.transforms.cost import CostAware, latent_lengths
from ppl_thought.transforms.projection_lift import ProjectionLift, SegmentCheck, enumerate_log_joint, exact_log_prob
from ppl_thought.transforms.thinking import Forgetful, ForgetfulLM, Persistent, Ubiquitous, forgetful_context

__all__ = ["ActiveLift", "CostAware", "Forgetful", "ForgetfulLM", "Persistent", "ProjectionLift", "SegmentCheck",
           "Transform", "Transformed", "TransformedFunction", "Ubiquitous", "compose", "enumerate_log_joint",
           "exact_log_prob", "forgetful_context", "latent_lengths", "rebuild", "score_continuation", "sequence_start"]

