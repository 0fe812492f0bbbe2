"""What every autoregressive LM in ppl_thought provides (docs/architecture.md, "Contracts").

An LM is a ``torch.nn.Module`` with ``vocab_size`` and
``forward(tokens, cache=None, **kwargs) -> (logits, cache)``: ``tokens`` is a LongTensor
``[B, T]``; ``logits`` is ``[B, T, vocab_size]`` (the next-token logits after each position, the
f(x) of (2.13)); ``cache`` holds what the LM needs to continue the same rows incrementally.
The caller writes ``<bos>`` explicitly at the start of a sequence. Logits may be ``-inf``.

A cache has ``length`` (positions consumed), ``batch_size``, ``reorder(index)`` (gather rows
along the batch dimension; resampling in SMC) and ``expand(n)`` (repeat each row n times; one
prompt encoded once and shared by n particles). It may also take ``with_room(room)``, a hint of how many
positions are still to come that sizes its buffers (:class:`~ppl_thought.lm.kv_cache.KVCache`; see
:func:`with_room`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from ppl_thought.errors import MalformedSequenceError, UnknownTokenError
from ppl_thought.validation import checked, per_token


@checked
@runtime_checkable
class LMCache(Protocol):
    length: int

    @property
    def batch_size(self) -> int: ...

    @per_token
    def reorder(self, index: torch.Tensor) -> LMCache: ...

    @per_token
    def expand(self, n: int) -> LMCache: ...


@checked
def step(lm: torch.nn.Module, tokens: torch.Tensor, cache: LMCache | None = None, **kwargs: Any):
    """One incremental step: ``tokens [B]`` -> ``(logits [B, V], cache)``."""
    logits, cache = lm(tokens[:, None], cache=cache, **kwargs)
    return logits[:, -1], cache


def with_room(cache: Any, room: int | None) -> Any:
    """``cache.with_room(room)`` for a cache that takes the hint (the positions still to come, which size the
    buffers of its gathers: :meth:`~ppl_thought.lm.kv_cache.KVCache.with_room`), any other cache (or None) as it
    is. Samplers that know how far they go (``max_len``) say it here; values never depend on it."""
    take = getattr(cache, "with_room", None)
    return take(room) if take is not None else cache


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


#: integer dtypes accepted for token ids
TOKEN_DTYPES = (torch.int64, torch.int32)


def as_id_batch(x, what: str, device=None) -> torch.Tensor:
    """Token ids as a LongTensor ``[B, L]`` (a 1-D row becomes ``[1, L]``) on ``device`` (default: where x is);
    :class:`MalformedSequenceError` naming ``what`` for float / bool arrays or other shapes."""
    t = torch.as_tensor(x, device=device if not isinstance(x, torch.Tensor) else None)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise MalformedSequenceError(f"{what} must hold integer token ids, got dtype {t.dtype}")
    t = t.long()
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2:
        raise MalformedSequenceError(f"{what} must be 1-D or [B, L] token ids, got shape {tuple(t.shape)}")
    return t if device is None else t.to(device)


def describe(x) -> str:
    """``"torch.float32 tensor of shape (2, 3)"`` or the type's name: for error messages."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


_IDS_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("ppl_thought_ids_checked", default=False)


@contextlib.contextmanager
def ids_checked() -> Iterator[None]:
    """Inside, LM calls skip the range check of :func:`check_token_ids` (its ``aminmax`` and the host sync of
    reading it): for callers whose ids are in range by construction (sampled below ``vocab_size``) or were
    checked once where they came in (the decoding loop, teacher-forced segments), so that a decode step does
    not synchronise with the device. Shapes and dtypes are still checked."""
    token = _IDS_CHECKED.set(True)
    try:
        yield
    finally:
        _IDS_CHECKED.reset(token)


def ids_are_checked() -> bool:
    """Whether the caller is inside :func:`ids_checked` (an LM may then skip its own range test)."""
    return _IDS_CHECKED.get()


def check_token_ids(tokens, vocab_size: int) -> tuple[int, int]:
    """``(B, T)`` of a LongTensor ``[B, T]`` of ids in ``[0, vocab_size)``, else a clear error (LM protocol).

    The range test reads ``aminmax`` on the host (one sync): skipped inside :func:`ids_checked`, where the
    caller vouches for the ids (checked once where the user's input came in, not per decode step)."""
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.dtype not in TOKEN_DTYPES:
        raise MalformedSequenceError(f"tokens must be a LongTensor [B, T], got {describe(tokens)}")
    if tokens.numel() and not _IDS_CHECKED.get():
        lo, hi = torch.aminmax(tokens)
        if lo < 0 or hi >= vocab_size:
            bad = lo.item() if lo < 0 else hi.item()
            raise UnknownTokenError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    B, T = tokens.shape
    return B, T


def one_token(tokens, valid=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``step`` form of an LM call: ``tokens [B]`` (and ``valid [B]``) as ``[B, 1]`` for ``forward``."""
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 1:
        raise MalformedSequenceError(f"step takes tokens [B], got {describe(tokens)}")
    if valid is not None:
        valid = torch.as_tensor(valid)
        if valid.ndim != 1:
            raise MalformedSequenceError(f"step takes valid [B], got {describe(valid)}")
        valid = valid[:, None]
    return tokens[:, None], valid
