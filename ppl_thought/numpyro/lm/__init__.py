"""JAX language models: the protocol (:class:`LM`, :func:`reorder`), the Tabular n-gram and the Transformer
that loads the torch side's checkpoints."""

from ppl_thought.numpyro.lm.base import LM, reorder
from ppl_thought.numpyro.lm.tabular import Tabular
from ppl_thought.numpyro.lm.transformer import Transformer

__all__ = ["LM", "Tabular", "Transformer", "reorder"]

