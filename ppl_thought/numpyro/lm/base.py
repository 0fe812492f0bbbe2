"""The JAX language-model protocol of the NumPyro backend (docs/numpyro.md; the torch twin is ppl_thought/lm/base.py).

An LM is parameters plus pure, jit-able functions. ``apply`` returns next-token log-probabilities, the log
softmax of f(z) in (2.13); masking to the domain of a projection (Def 2.8) is done by the callers
(:mod:`ppl_thought.numpyro.distributions`). A sequence always starts with ``<bos>`` (``BOS_ID``): the
per-sequence log-probability of y_1..y_T is ``sum_t log_probs[:, t-1, y_t]`` after feeding
``[BOS, y_1, ..., y_{T-1}]``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.errors import MalformedSequenceError
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.validation import per_token
from ppl_thought.vocab import Vocab


@checked_jax
class LM:
    """A JAX language model: parameters plus pure, jit-able functions. Caches are pytrees whose every
    leaf has the batch (particles) on axis 0, so resampling is `reorder(cache, index)`."""

    vocab_size: int
    params: Any  # pytree of jnp arrays (float32 by default)
    #: the tokenizer's vocabulary when known (``Transformer.load`` reads the one saved with the checkpoint; set it
    #: by hand otherwise): ``ptn.dist.LMSequence`` refuses a token automaton built from another tokenizer's texts
    vocab: Vocab | None = None

    @per_token
    def init_cache(self, batch: int, max_len: int) -> Any:
        """An empty cache for `batch` rows and at most `max_len` tokens per row (static shapes)."""
        raise NotImplementedError

    @per_token
    def apply(self, params: Any, cache: Any, tokens: Any, valid: Any = None,
              latents: Any = None) -> tuple[jax.Array, Any]:
        """Feed tokens int32[B, T]; return (log_probs float32[B, T, V], new_cache): log_probs[:, t] is the
        log-softmax of the next token after tokens[:, :t+1] (and everything already in the cache).
        valid bool[B, T] (default all True): a False entry is not written to the cache and not attended to
        (ragged rows; its output row is arbitrary but finite). latents float32[B, L, d_latent]: what
        cross-attention reads (Transformer with d_latent set; ignored/error otherwise)."""
        raise NotImplementedError


@checked_jax
def reorder(cache: Any, index: jax.Array | np.ndarray) -> Any:
    """Row ``i`` of the result is row ``index[i]`` of ``cache`` (SMC resampling; works under ``jit``): every leaf
    of ``cache`` an array with the rows on axis 0, ``index`` integer ``[m]``."""
    if not jnp.issubdtype(index.dtype, jnp.integer) or index.ndim != 1:
        raise MalformedSequenceError(f"reorder: index must be integer row numbers [m], got {index.dtype} "
                                     f"{tuple(index.shape)}")

    def take(a: Any) -> Any:
        if not isinstance(a, jax.Array | np.ndarray) or a.ndim < 1:
            raise MalformedSequenceError(f"reorder: every leaf of the cache must be an array [rows, ...], got "
                                         f"{type(a).__name__} of shape {getattr(a, 'shape', None)}")
        return a[index]

    return jax.tree.map(take, cache)
