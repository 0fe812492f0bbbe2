"""The result of the JAX engines: the names of ppl_thought/inference/result.py (``log_weights``, ``log_marginal``,
``log_marginal_stderr``, ``ess``, ``samples``, ``ancestry``, ``stats``), with jnp arrays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from ppl_thought.errors import DiagnosticError
from ppl_thought.numpyro.boundary import Array, checked_jax
from ppl_thought.numpyro.infer.resampling import check_log_weights, effective_sample_size


@checked_jax
def log_marginal_stderr(log_w: Array) -> jax.Array:
    """Delta-method standard error of log p_n, sd(w) / (sqrt(n) mean(w)) ((3.4): var(p_n) = var(w) / n): with
    normalised weights W_i, se = sqrt(sum_i (n W_i - 1)^2 / ((n - 1) n)). Equal weights give exactly 0 (with a
    finite gradient); one particle or every weight zero gives ``inf`` (no estimate of the spread), never NaN."""
    if log_w.ndim < 1 or not jnp.issubdtype(log_w.dtype, jnp.floating):
        raise DiagnosticError(f"log_marginal_stderr takes float log weights [..., n], got {log_w.dtype} "
                              f"{tuple(log_w.shape)}")
    check_log_weights(log_w, "log_marginal_stderr")
    n = log_w.shape[-1]
    if n < 2:
        return jnp.full(log_w.shape[:-1], jnp.inf)
    zero = jnp.isneginf(log_w).all(-1)
    equal = (log_w == log_w[..., :1]).all(-1)
    rel = n * jax.nn.softmax(jnp.where(zero[..., None], 0.0, log_w), -1)
    var = jnp.where(equal, 0.0, ((rel - 1) ** 2).sum(-1) / (n - 1))
    se = jnp.where(var > 0, jnp.sqrt(jnp.where(var > 0, var / n, 1.0)), 0.0)  # sqrt'(0) would be inf
    return jnp.where(zero, jnp.inf, se)


@checked_jax
@dataclass
class Result:
    """Weighted particles: ``samples`` (site -> ``[num_particles, ...]``), ``log_weights [n]``, ``log_marginal``
    (log Z-hat, (3.2) / SMC's product of mean incremental weights) with ``log_marginal_stderr``, ``ancestry``
    (SMC: ``[steps, n]``), ``stats`` (engine statistics: ``ess`` per step, ``resampled``, ``log_p``, ``log_q``)."""

    samples: dict[str, Any]
    log_weights: Array | None = None
    log_marginal: Array | None = None
    log_marginal_stderr: Array | None = None
    ancestry: Array | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    engine: str = ""

    @property
    def ess(self) -> jax.Array | None:
        """Importance ESS of the final weights."""
        return None if self.log_weights is None else effective_sample_size(self.log_weights)

    @property
    def normalized_weights(self) -> jax.Array | None:
        return None if self.log_weights is None else jax.nn.softmax(self.log_weights, -1)

    def __repr__(self) -> str:
        parts = [self.engine or "Result"]
        if self.log_weights is not None:
            parts.append(f"{self.log_weights.shape[-1]} particles")
        if self.log_marginal is not None:
            se = "" if self.log_marginal_stderr is None else f" +- {float(self.log_marginal_stderr):.2g}"
            parts.append(f"log Z-hat {float(self.log_marginal):.4g}{se}")
        if self.log_weights is not None:
            parts.append(f"ESS {float(effective_sample_size(self.log_weights, check=False)):.3g}")
        return f"<{'; '.join(parts)}; sites: {', '.join(self.samples)}>"
