"""Importance weights in log space: the mean weight (estimator (3.2)) and the effective sample size.

The lowest torch layer: models (importance-weighted bounds), engines and diagnostics all average weights
the same way, so the two formulas live here once.
"""

from __future__ import annotations

import math

import torch

__all__ = ["effective_sample_size", "log_mean_exp"]


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
