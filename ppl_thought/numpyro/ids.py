"""Validation of token-id arrays on the JAX side (numpy on the host): prompts and stop ids shared by every row
(:func:`prompt_ids`), right-padded id arrays (:func:`check_ids`) and padding (:func:`pad_to`); re-exported by
:mod:`ppl_thought.numpyro.distributions`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.checks import integer
from ppl_thought.errors import MalformedSequenceError, UnknownTokenError
from ppl_thought.numpyro.boundary import Array, ArrayLike, as_numpy, checked_jax
from ppl_thought.vocab import PAD_ID

__all__ = ["check_ids", "pad_to", "prompt_ids"]


@checked_jax
def prompt_ids(prompt: ArrayLike | None, vocab_size: int, what: str = "prompt") -> np.ndarray:
    """Concrete 1-D integer ids in ``[0, vocab_size)`` (a prompt or stop ids shared by every row)."""
    p = as_numpy(what, [] if prompt is None else prompt)
    p = np.atleast_1d(p)
    if p.ndim != 1 or (p.size and not np.issubdtype(p.dtype, np.integer)):
        raise MalformedSequenceError(f"{what} must be 1-D integer token ids, got {p.dtype} of shape {p.shape}")
    if p.size and (p.min() < 0 or p.max() >= vocab_size):
        raise UnknownTokenError(f"{what} contains ids outside the vocabulary [0, {vocab_size})")
    return p.astype(np.int64)


@checked_jax
def check_ids(value: ArrayLike, vocab_size: int, max_len: int, what: str = "sequence") -> np.ndarray | jax.Array:
    """Validate a right-padded id array ``[..., L]`` (concrete values only; traced values pass unchecked)."""
    vocab_size, max_len = integer("vocab_size", vocab_size, minimum=1), integer("max_len", max_len, minimum=0)
    if isinstance(value, jax.core.Tracer):
        if value.shape[-1] > max_len:
            raise MalformedSequenceError(f"{what} of length {value.shape[-1]} is over max_len={max_len}")
        return value
    a = as_numpy(what, value, where="check_ids")
    if a.ndim == 0:
        raise MalformedSequenceError(f"{what} must have a sequence dimension")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise MalformedSequenceError(f"{what} must hold integer token ids, got dtype {a.dtype}")
    if a.shape[-1] > max_len:
        if (a[..., max_len:] != PAD_ID).any():
            raise MalformedSequenceError(f"{what} of length {a.shape[-1]} is over max_len={max_len}")
        a = a[..., :max_len]
    if a.size and (a.min() < 0 or a.max() >= vocab_size):
        raise UnknownTokenError(f"{what} contains ids outside the vocabulary [0, {vocab_size})")
    nonpad = a != PAD_ID
    if a.shape[-1] and (nonpad[..., 1:] & ~nonpad[..., :-1]).any():
        raise MalformedSequenceError("padding inside a sequence: <pad> must only fill the end of a row")
    return a.astype(np.int32)


@checked_jax
def pad_to(z: Array, length: int) -> Array:
    """Right-pad (or cut padding off) ``z [..., L]`` to ``length`` columns."""
    length = integer("length", length, minimum=0)
    if z.ndim == 0:
        raise MalformedSequenceError("pad_to takes ids z [..., L], got a scalar")
    L = z.shape[-1]
    if L >= length:
        return z[..., :length]
    return jnp.concatenate([z, jnp.full(z.shape[:-1] + (length - L,), PAD_ID, z.dtype)], -1)
