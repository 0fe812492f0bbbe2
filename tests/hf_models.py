"""Tiny HuggingFace models built in process for the adapter tests (nothing is downloaded).

- ``byte_level()``: a byte-level BPE tokenizer (GPT-2 style, 300 HF ids) and a random 2-layer GPT-2 (d=64).
- ``small()``: a character BPE over "abc" with 7 ordinary tokens: small enough to enumerate thoughts.
- ``mistral()``: a random Mistral with a sliding window of 4 (ragged rows unsupported: recompute mode).
- ``llama()``: a random Llama (RoPE, grouped-query attention) with a Llama-style tokenizer whose bos is
  "<s>" and eos "</s>": the thought markers must not take those strings.

Each builder is cached (one model per process); tests that change a model's parameters build their own.
The builders pass ``add_markers=True``: these tests run thought models, which need the markers as tokens
(the adapter adds none unasked).
"""

from __future__ import annotations

import functools

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from ppl_thought.lm.huggingface import HuggingFace, random_gpt2, train_bpe_tokenizer  # noqa: E402

TEXTS = ["the quick brown fox jumps over the lazy dog", "a man, a plan, a canal: panama",
         "hello world, hello there", "she sells sea shells by the sea shore", "no letter e in this? wrong"] * 4
SMALL_TEXTS = ["abcab", "cabba", "abcabc", "bacab", "ccab"] * 4


@functools.cache
def byte_tokenizer(vocab_size: int = 300):
    return train_bpe_tokenizer(TEXTS, vocab_size)


def byte_level(seed: int = 0, attn_implementation: str = "sdpa") -> HuggingFace:
    """A fresh adapter over a random GPT-2 (each call builds a new model and a new tokenizer)."""
    tok = train_bpe_tokenizer(TEXTS, 300)
    return HuggingFace(random_gpt2(len(tok), n_embd=64, seed=seed, attn_implementation=attn_implementation), tok,
                       add_markers=True)


@functools.cache
def shared_byte_level() -> HuggingFace:
    """One adapter shared by the read-only tests."""
    return byte_level(0)


def small(seed: int = 0, n_embd: int = 32) -> HuggingFace:
    tok = train_bpe_tokenizer(SMALL_TEXTS, 8, byte_level=False, alphabet="abc")
    return HuggingFace(random_gpt2(len(tok), n_embd=n_embd, n_head=2, seed=seed), tok, add_markers=True)


def llama(seed: int = 0) -> HuggingFace:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                     pad_token="<pad>")
    config = LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return HuggingFace(model.eval(), hf_tok, add_markers=True)


def mistral(seed: int = 0, window: int = 4) -> HuggingFace:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    tok = train_bpe_tokenizer(TEXTS, 300)
    config = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                           max_position_embeddings=128, bos_token_id=None, eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MistralForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return HuggingFace(model.eval(), tok, add_markers=True)
