"""The result every engine returns (ARCHITECTURE.md, "Contracts")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


def log_mean_exp(log_w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log (1/n) sum_i exp(log_w_i), -inf (never NaN) when every weight is zero: estimator (3.2)."""
    n = log_w.shape[dim]
    return torch.logsumexp(log_w, dim=dim) - math.log(n)


def effective_sample_size(log_w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Importance ESS (sum w)^2 / sum w^2 from log weights; 0 when every weight is zero."""
    a = torch.logsumexp(log_w, dim=dim)
    b = torch.logsumexp(2 * log_w, dim=dim)
    ess = torch.exp(2 * a - b)
    return torch.where(torch.isneginf(a), torch.zeros_like(ess), ess)


@dataclass
class Result:
    """Weighted particles or MCMC draws.

    ``samples`` maps site names to values with particles (IS, SMC: ``[num_particles, ...]``) or
    chains x draws (MCMC: ``[num_chains, num_draws, ...]``) leading. ``log_weights`` is ``None``
    for unweighted MCMC draws. ``log_marginal`` is the estimate of log p(data) ((3.2)) with its
    delta-method standard error. ``stats`` holds engine-specific statistics (acceptance
    probabilities, step sizes, ESS per SMC step, ...); ``observed`` the data the engine saw.
    """

    samples: dict[str, Any]
    log_weights: torch.Tensor | None = None
    log_marginal: torch.Tensor | None = None
    log_marginal_stderr: torch.Tensor | None = None
    ancestry: torch.Tensor | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    engine: str = ""

    @property
    def ess(self) -> torch.Tensor | None:
        """Importance ESS of the final weights (``None`` for MCMC results)."""
        if self.log_weights is None:
            return None
        return effective_sample_size(self.log_weights)

    @property
    def normalized_weights(self) -> torch.Tensor | None:
        if self.log_weights is None:
            return None
        return torch.softmax(self.log_weights, dim=-1)
