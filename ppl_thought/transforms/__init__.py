"""Model transforms in the style of ``pyro.poutine``: one small Messenger per effect, composed by nesting.

``ActiveLift`` (Section 6): a learned sampler Q, latent prior P and generator G in one LM in place of a
fixed projection; its objectives are in :mod:`ppl_thought.inference.active`.
"""

from ppl_thought.transforms.active import ActiveLift as ActiveLift
from ppl_thought.transforms.active import score_continuation as score_continuation

__all__ = ["ActiveLift", "score_continuation"]
