"""JAX language models: the LM protocol (``base``) and the Transformer that loads torch checkpoints."""

from ppl_thought.numpyro.lm.base import LM, reorder
from ppl_thought.numpyro.lm.transformer import Transformer

__all__ = ["LM", "Transformer", "reorder"]
