"""Prompts on the JAX side, in one place (docs/architecture.md, "One protocol, two backends"): :func:`encode`
feeds ``<bos> + prompt`` into a fresh LM cache for n rows, a prompt shared by every row (1-D) or one per row
(``[r, P]`` right-padded with ``<pad>``, the torch rule: each prompt to n / r consecutive rows), and
:func:`prompt_array` reads and checks a prompt. ``ptn.dist.LMSequence``, ``ptn.dist.LMState.start`` and
``ptn.transforms.ActiveLift`` (per-row x) go through them, so each row's numbers equal a run with its own prompt
alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.checks import integer
from ppl_thought.errors import MalformedSequenceError, UnknownTokenError
from ppl_thought.numpyro.boundary import ArrayLike, as_numpy, checked_jax
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["encode", "prompt_array"]


def prompt_array(prompt: Any, vocab_size: int, where: str = "prompt") -> np.ndarray | jax.Array:
    """A prompt as ids: 1-D (shared by every row) or ``[r, P]`` right-padded with ``<pad>`` (one per row). A
    ``jax.Array`` stays one (int32; traced ones pass unread), anything else becomes int64 numpy ids, checked
    (integers, in ``[0, vocab_size)``, padding only at the end of a row)."""
    if isinstance(prompt, jax.Array):
        if prompt.ndim > 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
            raise MalformedSequenceError(f"{where} must be integer ids, 1-D (shared by every row) or [r, P] (per row), "
                                         f"got shape {tuple(prompt.shape)}, dtype {prompt.dtype}")
        if not isinstance(prompt, jax.core.Tracer):
            _check_prompt(np.asarray(prompt), vocab_size, where)
        return prompt.astype(jnp.int32)
    a = np.atleast_1d(as_numpy(where, [] if prompt is None else prompt))
    if a.ndim > 2 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise MalformedSequenceError(f"{where} must be integer ids, 1-D (shared by every row) or [r, P] (per row), "
                                     f"got shape {a.shape}, dtype {a.dtype}")
    a = a.astype(np.int64)
    _check_prompt(a, vocab_size, where)
    return a


def _check_prompt(a: np.ndarray, vocab_size: int, where: str) -> None:
    if a.size and (a.min() < 0 or a.max() >= vocab_size):
        raise UnknownTokenError(f"{where} contains ids outside the vocabulary [0, {vocab_size})")
    if a.ndim == 2 and a.shape[1]:
        real = a != PAD_ID
        if (real[:, 1:] & ~real[:, :-1]).any():
            raise MalformedSequenceError(f"padding inside a per-row {where}: <pad> must only fill the end of a row")


@checked_jax
def encode(lm: LM, params: Any, prompt: ArrayLike, n: int, max_new: int, latents: Any = None) -> tuple[jax.Array, Any]:
    """Feed ``<bos> + prompt`` into a fresh cache with room for ``max_new`` more tokens per row: ``(next log-probs
    [n, V], cache)``. The one home of prompts on the JAX side (``LMSequence``, ``LMState.start``, ``ActiveLift``):
    ``prompt`` 1-D is shared by every row; ``[r, P]`` right-padded with ``<pad>`` (r dividing n) gives each prompt
    to n / r consecutive rows (the torch rule), its padding fed as nothing (``valid=False``: no cache slot, no
    position), so each row's state is that of its own prompt alone (equal to row-by-row runs)."""
    n, max_new = integer("n", n, minimum=0), integer("max_new", max_new, minimum=0)
    p = prompt_array(prompt, lm.vocab_size)
    if p.ndim == 2:  # per-row prompts
        r = p.shape[0]
        if r == 0 or n % r:
            raise MalformedSequenceError(f"a per-row prompt [r, P] needs r dividing n = {n} (each prompt to n / r "
                                         f"consecutive rows), got r = {r}")
        ctx = jnp.concatenate([jnp.full((n, 1), BOS_ID, jnp.int32), jnp.repeat(jnp.asarray(p, jnp.int32), n // r, 0)],
                              1)
        valid = ctx != PAD_ID
        cache = lm.init_cache(n, ctx.shape[1] + max_new)
        logp, cache = lm.apply(params, cache, ctx, valid=valid, latents=latents)
        return logp[jnp.arange(n), valid.sum(1) - 1], cache  # each row's last prompt token (<bos> if empty)
    ctx = jnp.concatenate([jnp.full((1,), BOS_ID, jnp.int32), jnp.asarray(p, jnp.int32)])
    cache = lm.init_cache(n, ctx.shape[0] + max_new)
    logp, cache = lm.apply(params, cache, jnp.broadcast_to(ctx, (n, ctx.shape[0])), latents=latents)
    return logp[:, -1], cache
