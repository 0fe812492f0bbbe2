"""Autoregressive LMs with KV caches: ``forward(tokens, cache=None) -> (logits, cache)``."""

from ppl_thought.lm.base import LMCache, step
from ppl_thought.lm.huggingface import HuggingFace
from ppl_thought.lm.tabular import Tabular, TabularCache
from ppl_thought.lm.transformer import KVCache, Transformer

__all__ = ["HuggingFace", "Transformer", "KVCache", "Tabular", "TabularCache", "LMCache", "step"]
