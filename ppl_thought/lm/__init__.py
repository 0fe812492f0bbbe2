"""Autoregressive LMs with KV caches: ``forward(tokens, cache=None) -> (logits, cache)``."""

from ppl_thought.lm.base import LMCache, step
from ppl_thought.lm.gated import GatedCache, GatedLM
from ppl_thought.lm.huggingface import HuggingFace, smollm2
from ppl_thought.lm.kv_cache import KVCache
from ppl_thought.lm.looped import Looped
from ppl_thought.lm.lora import load_lora, lora, lora_adapters, lora_parameters, reset_lora, save_lora
from ppl_thought.lm.tabular import Tabular, TabularCache
from ppl_thought.lm.transformer import Transformer

__all__ = ["GatedCache", "GatedLM", "HuggingFace", "KVCache", "LMCache", "Looped", "Tabular", "TabularCache",
           "Transformer", "load_lora", "lora", "lora_adapters", "lora_parameters", "reset_lora", "save_lora", "smollm2",
           "step"]
