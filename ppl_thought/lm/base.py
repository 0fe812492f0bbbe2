"""What every autoregressive LM in ppl_thought provides (ARCHITECTURE.md, "Contracts").

An LM is a ``torch.nn.Module`` with ``vocab_size`` and
``forward(tokens, cache=None, **kwargs) -> (logits, cache)``: ``tokens`` is a LongTensor
``[B, T]``; ``logits`` is ``[B, T, vocab_size]`` (the next-token logits after each position, the
f(x) of (2.13)); ``cache`` holds what the LM needs to continue the same rows incrementally.
The caller writes ``<bos>`` explicitly at the start of a sequence. Logits may be ``-inf``.

A cache has ``length`` (positions consumed), ``batch_size``, ``reorder(index)`` (gather rows
along the batch dimension; resampling in SMC) and ``expand(n)`` (repeat each row n times; one
prompt encoded once and shared by n particles).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LMCache(Protocol):
    length: int

    @property
    def batch_size(self) -> int: ...

    def reorder(self, index: torch.Tensor) -> LMCache: ...

    def expand(self, n: int) -> LMCache: ...


def step(lm: torch.nn.Module, tokens: torch.Tensor, cache=None, **kwargs):
    """One incremental step: ``tokens [B]`` -> ``(logits [B, V], cache)``."""
    logits, cache = lm(tokens[:, None], cache=cache, **kwargs)
    return logits[:, -1], cache


def lm_device(lm: torch.nn.Module) -> torch.device:
    """The device of an LM's first parameter or buffer (CPU if it has none): where its inputs are made."""
    for t in list(lm.parameters())[:1] + list(lm.buffers())[:1]:
        return t.device
    return torch.device("cpu")


def match_rows(kwargs: dict, n: int) -> dict:
    """LM keyword arguments with batched tensors (e.g. ``latents``) repeated to ``n`` rows.

    A tensor whose leading dimension divides ``n`` is repeated row by row (``repeat_interleave``),
    matching ``cache.expand``; everything else is passed as is.
    """
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] != n and n % v.shape[0] == 0:
            v = v.repeat_interleave(n // v.shape[0], 0)
        out[k] = v
    return out
