"""Ready NumPyro programs: SlowThinking (Proj # P_f, Def 2.8) and HMM (Def 2.2) and LatentThought (z ~ N(0, I),
x | z by the cross-attention Transformer)."""

from ppl_thought.numpyro.models.hmm import HMM, HMMProgram
from ppl_thought.numpyro.models.latent_thought import LatentThought
from ppl_thought.numpyro.models.slow_thinking import EnumeratedPosterior, SlowThinking

__all__ = ["HMM", "HMMProgram", "EnumeratedPosterior", "LatentThought", "SlowThinking"]

