"""The JAX backend's one home of resampling and of the log-weight algebra (torch twin:
ppl_thought/inference/resampling.py; the two sides import without each other, docs/architecture.md).

* :func:`systematic_resample`: ancestor indices from log weights (E[#offspring_i] = m W_i, in particle order),
  fixed shapes, traceable (decided and gathered on the device);
* :func:`log_mean_exp` (estimator (3.2)) and :func:`effective_sample_size`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.errors import DiagnosticError
from ppl_thought.numpyro.boundary import Array, Key, checked_jax

__all__ = ["check_log_weights", "effective_sample_size", "log_mean_exp", "prng_key", "systematic_resample"]


def _axis(log_w: Array, axis: int, what: str) -> None:
    if not jnp.issubdtype(log_w.dtype, jnp.floating) or not -log_w.ndim <= axis < log_w.ndim \
            or log_w.shape[axis] == 0:
        raise DiagnosticError(f"{what}: log_w must be float log weights with a non-empty axis {axis}, got "
                              f"{log_w.dtype} {tuple(log_w.shape)}")


@checked_jax
def log_mean_exp(log_w: Array, axis: int = -1) -> jax.Array:
    """log (1/n) sum_i exp(log_w_i), estimator (3.2); -inf (never NaN) when every weight is zero. Concrete log
    weights holding NaN or +inf raise :class:`~ppl_thought.errors.DiagnosticError`."""
    _axis(log_w, axis, "log_mean_exp")
    check_log_weights(log_w, "log_mean_exp")
    return jax.scipy.special.logsumexp(log_w, axis) - math.log(log_w.shape[axis])


def check_log_weights(log_w: Array, what: str) -> None:
    """Refuse concrete log weights holding NaN or +inf (:class:`~ppl_thought.errors.DiagnosticError` naming
    ``what``); traced values (under ``jit`` / ``vmap``) are not known yet and pass (the engines check their
    results once, after the run)."""
    if isinstance(log_w, jax.core.Tracer):
        return
    a = np.asarray(log_w)
    if not np.issubdtype(a.dtype, np.floating):
        return
    nan, posinf = bool(np.isnan(a).any()), bool(np.isposinf(a).any())
    if nan or posinf:
        raise DiagnosticError(f"{what}: the log weights hold {'NaN' if nan else '+inf'} (shape {a.shape}): a model "
                              "or guide log-probability is NaN or +inf (e.g. numpyro.factor(+inf)); a statistic "
                              "of them would be NaN")


@checked_jax
def effective_sample_size(log_w: Array, axis: int = -1, *, check: bool = True) -> jax.Array:
    """Importance ESS (sum w)^2 / sum w^2 from log weights; 0 when every weight is zero. Concrete log weights
    with NaN or +inf raise :class:`~ppl_thought.errors.DiagnosticError` (``check=False`` skips it)."""
    _axis(log_w, axis, "effective_sample_size")
    if check:
        check_log_weights(log_w, "effective_sample_size")
    a = jax.scipy.special.logsumexp(log_w, axis)
    b = jax.scipy.special.logsumexp(2 * log_w, axis)
    return jnp.where(jnp.isneginf(a), 0.0, jnp.exp(2 * a - jnp.where(jnp.isneginf(a), 0.0, b)))


@checked_jax
def systematic_resample(key: Key, log_w: Array, size: int | None = None) -> jax.Array:
    """Ancestor indices ``[size]`` (default n) by systematic resampling of log weights ``[n]``
    (E[#offspring_i] = size W_i; indices in particle order; the CDF's last entry set to 1)."""
    if log_w.ndim != 1 or log_w.shape[0] == 0 or not jnp.issubdtype(log_w.dtype, jnp.floating):
        raise DiagnosticError(f"systematic_resample takes float log weights [n >= 1], got {log_w.dtype} "
                              f"{tuple(log_w.shape)}")
    check_log_weights(log_w, "systematic_resample")
    n = log_w.shape[0]
    if size is not None and size < 1:
        raise DiagnosticError(f"systematic_resample: size must be an integer >= 1, got {size}")
    m = n if size is None else int(size)
    cdf = jnp.cumsum(jax.nn.softmax(log_w))
    cdf = cdf.at[-1].set(1.0)
    u = (jnp.arange(m) + jax.random.uniform(key)) / m
    return jnp.clip(jnp.searchsorted(cdf, u), 0, n - 1)


def prng_key(rng_key: Any, what: str = "rng_key") -> jax.Array:
    """The JAX PRNG key an engine runs with: ``None`` -> ``PRNGKey(0)``; an int (numpy ints too) -> ``PRNGKey(int)``
    (accepted for convenience, like a seed); a key (``PRNGKey(...)``: uint32 ``[2]``, or a typed ``jax.random.key``)
    as it is. Anything else: :class:`~ppl_thought.errors.ConfigError` naming the argument."""
    from ppl_thought.errors import ConfigError

    if rng_key is None:
        return jax.random.PRNGKey(0)
    if isinstance(rng_key, int | np.integer) and not isinstance(rng_key, bool | np.bool_):
        return jax.random.PRNGKey(int(rng_key))
    if isinstance(rng_key, jax.Array | np.ndarray):
        if jnp.issubdtype(rng_key.dtype, jax.dtypes.prng_key) and rng_key.shape == ():
            return rng_key
        if rng_key.dtype == np.uint32 and rng_key.shape == (2,):
            return jnp.asarray(rng_key)
    shown = f"{rng_key.dtype} array of shape {tuple(rng_key.shape)}" if hasattr(rng_key, "shape") else repr(rng_key)
    raise ConfigError(f"{what} must be a JAX PRNG key (jax.random.PRNGKey(seed)) or an int seed, got {shown[:80]}")
