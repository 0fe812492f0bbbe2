"""How far a sampler is from the optimal one: chi^2 and KL divergences (Table 3.1, Prop 3.5).

The slow-thinking scaling laws of Table 3.1 all scale with chi^2(Q_*(.|x) || Q(.|x)).

- :func:`chi2` exactly, from log-probability vectors over one enumerated support, or from two
  samplers and a small model (the lifting of x is enumerated);
- :func:`chi2_from_weights`: the Monte-Carlo estimate from importance log-weights w = P/Q under Q;
- :func:`kl`: KL(p || q) exactly, with the same inputs as :func:`chi2`.
"""

from __future__ import annotations

import math

import torch


def _log_vectors(p, q, model=None, x=None) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(p, "log_prob") and hasattr(q, "log_prob") and not isinstance(p, torch.Tensor):
        if model is None or x is None:
            raise ValueError("chi2/kl of two samplers needs model= and x= (the lifting of x is enumerated)")
        support, _ = model.enumerate_log_joint(x)
        with torch.no_grad():
            return p.log_prob(support, x).double(), q.log_prob(support, x).double()
    lp, lq = torch.as_tensor(p, dtype=torch.float64), torch.as_tensor(q, dtype=torch.float64)
    if lp.shape != lq.shape:
        raise ValueError(f"log-probability vectors differ in shape: {tuple(lp.shape)} vs {tuple(lq.shape)}")
    return lp, lq


def chi2(p, q, *, model=None, x=None) -> float:
    """chi^2(p || q) = sum_z p(z)^2 / q(z) - 1 (``inf`` if q misses mass of p).

    ``p``, ``q``: log-probability vectors over the same enumerated support (e.g. Q_* first),
    or two samplers with ``model`` and ``x``.
    """
    lp, lq = _log_vectors(p, q, model, x)
    has = torch.isfinite(lp)
    if (has & torch.isneginf(lq)).any():
        return math.inf
    terms = torch.where(has, 2 * lp - lq, torch.full_like(lp, -math.inf))
    return max(0.0, float(torch.logsumexp(terms, -1).exp() - 1.0))  # >= 0 up to rounding


def kl(p, q, *, model=None, x=None) -> float:
    """KL(p || q) = sum_z p(z) (log p(z) - log q(z)) (``inf`` if q misses mass of p)."""
    lp, lq = _log_vectors(p, q, model, x)
    has = torch.isfinite(lp)
    if (has & torch.isneginf(lq)).any():
        return math.inf
    return max(0.0, float(torch.where(has, lp.exp() * (lp - lq), torch.zeros_like(lp)).sum()))


def chi2_from_weights(log_w) -> float:
    """Monte-Carlo chi^2(Q_* || Q) = E_q[w^2] / E_q[w]^2 - 1 from log-weights w = P(z)/Q(z), z ~ Q
    (the normaliser cancels: n sum w^2 / (sum w)^2 - 1). ``nan`` for no finite weight."""
    lw = torch.as_tensor(log_w, dtype=torch.float64).reshape(-1)
    n = lw.numel()
    if n == 0 or not torch.isfinite(lw).any():
        return math.nan
    return float(
        torch.exp(math.log(n) + torch.logsumexp(2 * lw, 0) - 2 * torch.logsumexp(lw, 0)) - 1.0)
