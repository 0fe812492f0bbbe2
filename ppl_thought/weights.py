"""Importance weights in log space: the mean weight (estimator (3.2)) and the effective sample size.

The lowest torch layer: models (importance-weighted bounds), engines and diagnostics all average weights
the same way, so the two formulas live here once.
"""

from __future__ import annotations

import math

import torch

from ppl_thought.errors import DiagnosticError

__all__ = ["check_log_weights", "effective_sample_size", "log_mean_exp"]


def log_mean_exp(log_w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log (1/n) sum_i exp(log_w_i), -inf (never NaN) when every weight is zero: estimator (3.2)."""
    n = log_w.shape[dim]
    return torch.logsumexp(log_w, dim=dim) - math.log(n)


def check_log_weights(log_w: torch.Tensor, what: str) -> None:
    """Refuse log weights holding NaN or +inf (:class:`~ppl_thought.errors.DiagnosticError` naming ``what``):
    a weight of NaN or +inf has no meaning, and every statistic of it would be NaN. One host sync."""
    if not isinstance(log_w, torch.Tensor) or not log_w.is_floating_point():
        return
    nan, posinf = torch.stack([torch.isnan(log_w).any(), torch.isposinf(log_w).any()]).tolist()
    if nan or posinf:
        raise DiagnosticError(f"{what}: the log weights hold {'NaN' if nan else '+inf'} (shape "
                              f"{tuple(log_w.shape)}): a model or guide log-probability is NaN or +inf (e.g. "
                              "pyro.factor(+inf)); a statistic of them would be NaN")


def effective_sample_size(log_w: torch.Tensor, dim: int = -1, *, check: bool = True) -> torch.Tensor:
    """Importance ESS (sum w)^2 / sum w^2 from log weights; 0 when every weight is zero.

    Log weights with NaN or +inf raise :class:`~ppl_thought.errors.DiagnosticError` (never a NaN ESS);
    ``check=False`` skips that check (and its host sync): the engines' per-step calls, which check their
    weights themselves."""
    if check:
        check_log_weights(log_w, "effective_sample_size")
    a = torch.logsumexp(log_w, dim=dim)
    b = torch.logsumexp(2 * log_w, dim=dim)
    ess = torch.exp(2 * a - b)
    return torch.where(torch.isneginf(a), torch.zeros_like(ess), ess)
