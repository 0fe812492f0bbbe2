"""The n-gram LM with an explicit logits table, in JAX: the same parameters and numbers as
``ppl_thought.lm.Tabular`` (its ``logits`` table loads here unchanged, :meth:`Tabular.from_numpy`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.checks import integer
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.numpyro.boundary import ArrayLike, as_numpy, checked_jax
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.validation import per_token
from ppl_thought.vocab import BOS_ID


@checked_jax
class Tabular(LM):
    """n-gram LM: ``logits[c_1, ..., c_{n-1}, next]``; order 2 is a bigram ``logits[prev, next]``.

    As on the torch side the logits after position i are read at the last ``order - 1`` tokens up to and
    including i, padded on the left with ``<bos>``, so the first token is conditioned on ``<bos>``
    (P_f^{+1}(. | z) = softmax(f(z)), (2.13)). Entries may be ``-inf`` (forbidden transitions).

    ``params = {"logits": float32 [V] * order}``; the cache is ``{"context": int32 [B, order - 1]}`` (the last
    ``order - 1`` tokens of each row). ``apply`` returns log-probabilities (the log softmax of the row).
    """

    def __init__(self, order: int, vocab_size: int, logits: ArrayLike | None = None):
        self.order = integer("order", order)
        self.vocab_size = integer("vocab_size", vocab_size)
        if self.vocab_size ** self.order > 1 << 28:
            raise ConfigError(f"Tabular(order={self.order}, vocab_size={self.vocab_size}) would hold "
                              f"vocab_size**order = {self.vocab_size}**{self.order} logits (over 2**28)")
        shape = (self.vocab_size,) * self.order
        table = np.zeros(shape, np.float32) if logits is None else as_numpy("logits", logits, where="Tabular")
        if table.dtype.kind not in "biuf":
            raise ConfigError(f"Tabular logits must be numbers, got dtype {table.dtype}")
        table = table.astype(np.float32)
        if table.shape != shape:
            raise ConfigError(f"Tabular(order={order}, vocab_size={vocab_size}) needs logits of shape {shape}, "
                              f"got {table.shape}")
        if np.isnan(table).any() or np.isposinf(table).any():
            raise MalformedSequenceError("Tabular logits contain NaN or +inf (a logit may be -inf: a forbidden "
                                         "transition; +inf has no probability)")
        if np.isneginf(table).all(axis=-1).any():
            raise ConfigError("some context of the Tabular logits has every next token at -inf")
        self.params = {"logits": jnp.asarray(table)}

    @classmethod
    def from_numpy(cls, logits: ArrayLike) -> Tabular:
        """A Tabular LM from a logits array ``[V] * order`` (e.g. ``torch_tabular.logits.detach().numpy()``)."""
        a = as_numpy("logits", logits, where="Tabular.from_numpy")
        if a.ndim < 1 or len(set(a.shape)) != 1:
            raise ConfigError(f"Tabular logits must have shape [V] * order, got {a.shape}")
        return cls(a.ndim, a.shape[0], a)

    @per_token
    def init_cache(self, batch: int, max_len: int = 0) -> dict:
        """``<bos>``-filled contexts for ``batch`` rows (an n-gram needs no room for ``max_len`` tokens)."""
        return {"context": jnp.full((int(batch), self.order - 1), BOS_ID, dtype=jnp.int32)}

    @per_token
    def apply(self, params: Any, cache: Any, tokens: Any, valid: Any = None,
              latents: Any = None) -> tuple[jax.Array, Any]:
        """``tokens int32 [B, T]`` -> ``(log_probs [B, T, V], cache)``; an invalid token leaves its row's
        context unchanged (its output row is that of the unchanged context)."""
        if latents is not None:
            raise ConfigError("Tabular has no cross-attention: latents must be None")
        tokens = jnp.asarray(tokens, dtype=jnp.int32)
        if tokens.ndim != 2:
            raise MalformedSequenceError(f"tokens must be int32 [B, T], got shape {tokens.shape}")
        B, T = tokens.shape
        logits = params["logits"]
        k = self.order - 1
        ctx = cache["context"]
        if k == 0:
            lp = jax.nn.log_softmax(logits, -1)
            return jnp.broadcast_to(lp, (B, T, self.vocab_size)), cache
        valid = jnp.ones((B, T), bool) if valid is None else jnp.asarray(valid, bool)

        if T == 1:  # one token (a decoding step): no loop, which keeps compiled decoders small
            shifted = jnp.concatenate([ctx[:, 1:], tokens], 1)
            ctx = jnp.where(valid, shifted, ctx)
            row = logits[tuple(ctx[:, j] for j in range(k))]
            return jax.nn.log_softmax(row[:, None], -1), {"context": ctx}

        def body(c, inp):
            tok, ok = inp
            shifted = jnp.concatenate([c[:, 1:], tok[:, None]], 1)
            c = jnp.where(ok[:, None], shifted, c)
            return c, logits[tuple(c[:, j] for j in range(k))]

        ctx, rows = jax.lax.scan(body, ctx, (tokens.T, valid.T))
        return jax.nn.log_softmax(jnp.swapaxes(rows, 0, 1), -1), {"context": ctx}

    def __repr__(self) -> str:
        return f"Tabular(order={self.order}, vocab_size={self.vocab_size})"
