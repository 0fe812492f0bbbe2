"""The causal gap (7.3) as a training statistic, and posterior drift (Def 3.10, Ex 3.4).

Causal gap. For a query X, thoughts Y_i ~ Q_psi (i = 1..n) and a response X_r, the causal gap of
thought i is (Section 7)

    r_i = log Q_psi(Y_i | X X_r) - log P_theta(Y_i | X)        (explanatory sampler)
    r_i = log Q_psi(Y_i | X)     - log P_theta(Y_i | X)        (predictive sampler, the control group)

the gap between the a-posteriori and the a-priori likelihood of the thought; r_i > 0 suggests the
thought carries information about X_r. The training statistic (7.3) is the importance-weighted average

    (1/B) sum_b sum_i r_i^(b) p_i^(b),   p_i = p~_i / sum_j p~_j,
    p~_i = P_theta(Y_i X_r | X) / Q_psi(Y_i | X X_r)             (X_r dropped from Q for the control group)

with log p~_i = log P(Y_i | X) + log P(X_r | X Y_i) - log Q(Y_i | ...). Both are computed from the same
log Q passed in, so the one function serves both groups.

Posterior drift. The marginal of Q_*(.|x) over the prefixes in Proj^{-1}_{<w}(x_{<=t}) generally
differs from Q_*(.|x_{<=t}) (Def 3.10); :func:`posterior_drift` measures the total variation between
Pi_{t0} # Q_*(.|x_{<=t1}) and Pi_{t0} # Q_*(.|x_{<=t2}) (Ex 3.4) exactly by enumeration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ppl_thought.diagnostics.plots import plot_causal_gap
from ppl_thought.errors import ConfigError, DiagnosticError, ZeroWeightsError, zero_weights_message
from ppl_thought.models.slow_thinking import SlowThinking, lifted_prefix_length
from ppl_thought.validation import ArrayLike, checked


@checked
def causal_gap(log_q: torch.Tensor, log_prior_thought: torch.Tensor, log_response: torch.Tensor,
               response_length: int | torch.Tensor | None = None) -> torch.Tensor:
    """The weighted average causal gap (7.3) of one batch.

    Args:
        log_q: ``[B, n]`` log Q_psi(Y_i | X X_r) (explanatory) or log Q_psi(Y_i | X) (predictive).
        log_prior_thought: ``[B, n]`` log P_theta(Y_i | X).
        log_response: ``[B, n]`` log P_theta(X_r | X Y_i).
        response_length: divide by |X_r| (as in Fig 7.1); an int or ``[B]``.

    Returns a scalar tensor. Thoughts with weight p~_i = 0 (P(Y_i X_r | X) = 0) contribute nothing
    (their possibly infinite r_i is never multiplied by 0, so the result is never NaN); a batch element
    whose weights are all zero raises :class:`ZeroWeightsError`. 1-D inputs are one batch element.
    """
    lq, lpy, lpr = (torch.as_tensor(t, dtype=torch.float64) for t in (log_q, log_prior_thought, log_response))
    if lq.ndim == 1:
        lq, lpy, lpr = lq[None], lpy[None], lpr[None]
    if not (lq.shape == lpy.shape == lpr.shape) or lq.ndim != 2:
        raise DiagnosticError(f"log_q, log_prior_thought, log_response must share a shape [B, n]; got "
                         f"{tuple(lq.shape)}, {tuple(lpy.shape)}, {tuple(lpr.shape)}")
    if torch.isnan(lq).any() or torch.isnan(lpy).any() or torch.isnan(lpr).any():
        raise DiagnosticError("causal_gap: NaN log-probabilities")
    if torch.isneginf(lq).any():
        raise DiagnosticError("causal_gap: log Q(Y_i | ...) = -inf for a thought Y_i drawn from Q")
    log_pt = torch.where(torch.isneginf(lpy) | torch.isneginf(lpr), torch.full_like(lq, -torch.inf), lpy + lpr - lq)
    dead = torch.isneginf(log_pt).all(-1)
    if dead.any():
        raise ZeroWeightsError(zero_weights_message("causal_gap (7.3)", lq.shape[-1], "the thought sampler Q",
                                                    group=f"of batch element(s) {dead.nonzero().flatten().tolist()} ",
                                                    where="(P(Y_i X_r | X) = 0 for every sampled thought Y_i)"))
    p = torch.softmax(log_pt, -1)
    r = lq - lpy
    per_b = torch.where(p > 0, r * p, torch.zeros_like(r)).sum(-1)
    if response_length is not None:
        per_b = per_b / torch.as_tensor(response_length, dtype=torch.float64)
    return per_b.mean()


@checked
@dataclass
class CausalGapTracker:
    """Records the causal gap (7.3) per training step (e.g. from a Trainer's hook) for plotting."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    label: str = "causal gap (7.3)"

    def update(self, step: int, log_q: torch.Tensor, log_prior_thought: torch.Tensor, log_response: torch.Tensor,
               response_length: int | torch.Tensor | None = None) -> float:
        """Compute (7.3) for one batch, record it under ``step`` and return it."""
        v = float(causal_gap(log_q, log_prior_thought, log_response, response_length))
        self.steps.append(int(step))
        self.values.append(v)
        return v

    def plot(self, path: str | Path | None = None, others: dict[str, CausalGapTracker] | None = None):

        series = {self.label: (self.steps, self.values)}
        for name, t in (others or {}).items():
            series[name] = (t.steps, t.values)
        return plot_causal_gap(series, path)


# ---------------------------------------------------------------------------------------------- drift
def _prefix_marginal(model, x, t0: int, t: int, limit: int) -> dict[tuple[int, ...], float]:
    """Pi_{t0} # Q_*(.|x_{<=t}): the law of the prefix of Z ~ Q_*(.|x_{<=t}) in Proj^{-1}(x_{<=t0})."""

    xt = model.x_ids(x)
    post = model.exact_posterior(xt[:t], limit=limit)
    k = lifted_prefix_length(model.projection.lifting(xt[:t0]), post.support)
    out: dict[tuple[int, ...], float] = {}
    for row, kk, pr in zip(post.support.tolist(), k.tolist(), post.probs.double().tolist()):
        key = tuple(row[:kk])
        out[key] = out.get(key, 0.0) + pr
    return out


@checked
def posterior_drift(model: SlowThinking, x: ArrayLike, t0: int, t1: int | None = None, t2: int | None = None,
                    limit: int = 20_000) -> float:
    """Total variation between Pi_{t0} # Q_*(.|x_{<=t1}) and Pi_{t0} # Q_*(.|x_{<=t2}) (Def 3.10, Ex 3.4).

    Defaults t1 = t0 and t2 = |x|: the drift of Def 3.10 between the posterior given x_{<=t0} and the
    marginal over the same prefixes of the posterior given all of x. Exact, by enumeration (small models).
    """
    xt = model.x_ids(x)
    T = len(xt)
    t1 = t0 if t1 is None else int(t1)
    t2 = T if t2 is None else int(t2)
    if not 1 <= t0 <= min(t1, t2) or max(t1, t2) > T:
        raise ConfigError(f"posterior_drift needs 1 <= t0 <= t1, t2 <= |x| = {T}; got t0={t0}, t1={t1}, t2={t2}")
    a = _prefix_marginal(model, xt, t0, t1, limit)
    b = _prefix_marginal(model, xt, t0, t2, limit)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@checked
def posterior_drift_curve(model: SlowThinking, x: ArrayLike, limit: int = 20_000) -> list[float]:
    """[posterior_drift(model, x, t) for t = 1..|x|-1] (Def 3.10 at every earlier time)."""
    T = len(model.x_ids(x))
    return [posterior_drift(model, x, t, limit=limit) for t in range(1, T)]


__all__ = ["CausalGapTracker", "ZeroWeightsError", "causal_gap", "posterior_drift", "posterior_drift_curve"]
