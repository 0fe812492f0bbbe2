"""The JAX backend's one home of resampling and of the log-weight algebra (torch twin:
ppl_thought/inference/resampling.py; the two sides import without each other, docs/architecture.md).

* :func:`systematic_resample`: ancestor indices from log weights (E[#offspring_i] = m W_i, in particle order),
  fixed shapes, traceable (decided and gathered on the device);
* :func:`log_mean_exp` (estimator (3.2)) and :func:`effective_sample_size`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["effective_sample_size", "log_mean_exp", "systematic_resample"]


def log_mean_exp(log_w: jax.Array, axis: int = -1) -> jax.Array:
    """log (1/n) sum_i exp(log_w_i), estimator (3.2); -inf (never NaN) when every weight is zero."""
    return jax.scipy.special.logsumexp(log_w, axis) - math.log(log_w.shape[axis])


def effective_sample_size(log_w: jax.Array, axis: int = -1) -> jax.Array:
    """Importance ESS (sum w)^2 / sum w^2 from log weights; 0 when every weight is zero."""
    a = jax.scipy.special.logsumexp(log_w, axis)
    b = jax.scipy.special.logsumexp(2 * log_w, axis)
    return jnp.where(jnp.isneginf(a), 0.0, jnp.exp(2 * a - jnp.where(jnp.isneginf(a), 0.0, b)))


def systematic_resample(key: jax.Array, log_w: jax.Array, size: int | None = None) -> jax.Array:
    """Ancestor indices ``[size]`` (default n) by systematic resampling of log weights ``[n]``
    (E[#offspring_i] = size W_i; indices in particle order; the CDF's last entry set to 1)."""
    n = log_w.shape[0]
    m = n if size is None else int(size)
    cdf = jnp.cumsum(jax.nn.softmax(log_w))
    cdf = cdf.at[-1].set(1.0)
    u = (jnp.arange(m) + jax.random.uniform(key)) / m
    return jnp.clip(jnp.searchsorted(cdf, u), 0, n - 1)
