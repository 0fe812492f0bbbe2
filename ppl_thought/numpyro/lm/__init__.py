"""JAX language models: the protocol (:class:`LM`, :func:`reorder`) and the Tabular n-gram."""

from ppl_thought.numpyro.lm.base import LM, reorder
from ppl_thought.numpyro.lm.tabular import Tabular

__all__ = ["LM", "Tabular", "reorder"]
