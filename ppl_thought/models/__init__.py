"""Ready programs: SlowThinking (Proj # P_f), Constrained (an LM conditioned on a token automaton), HMM (Def 2.2),
LatentThought (continuous z, LTM Sec 2.1)."""

from ppl_thought.models.constrained import Constrained
from ppl_thought.models.hmm import HMM
from ppl_thought.models.hmm_lifting import hmm_as_slow_thinking, slow_thinking_parts
from ppl_thought.models.latent_thought import LatentThought
from ppl_thought.models.plain import PlainLM
from ppl_thought.models.slow_thinking import EnumeratedPosterior, SlowThinking, pad_sequences

__all__ = ["SlowThinking", "PlainLM", "Constrained", "EnumeratedPosterior", "HMM", "pad_sequences", "LatentThought",
           "hmm_as_slow_thinking", "slow_thinking_parts"]

