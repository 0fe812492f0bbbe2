"""``CostAware(weight)``: the a-priori balance of fast and slow thinking, (5.26)-(5.27) with the estimators of 5.6.3.

Training minimises the running cost (5.27), C(theta) T_s(theta): cross entropy (4.1) times the time a step
takes, with tau(l) the cost of a latent sequence of length l (decoding, encoding, backpropagation). Here
tau(l) = 1 + weight * l (a fixed cost per sequence, the unit, plus ``weight`` per latent token), or any
``tau`` given. The estimators of 5.6.3, one-sampler form (Q^boxminus = Q, Z• = Z):

    C_s = L_n - H~(P_*)                                    (L_n: the SVI objective's loss, e.g. (3.17))
    T_s = (1/n) sum_i tau(|Z_i|)                           (the time of the step, Z_i ~ Q)
    T~*_s = sum_i w_i tau(|Z_i|) log P(Z_i) - (sum_i w_i tau(|Z_i|)) (sum_i w_i log P(Z_i))
            with w_i = D(q_i) / sum_j D(q_j), q_i = P(Z_i) / Q(Z_i | x): its gradient estimates
            grad_theta T*(theta, x), T* = E_{Q_*(.|x)}[tau(|Z|)] (the posterior's mean cost)
    loss  = C_s (T~*_s + D(T_s - T~*_s))                  value C_s T_s, gradient T_s grad C_s + C_s grad T~*_s

Only the latent model's parameters get the cost term's gradient (log P(Z_i)); the sampler keeps its own
objective (the third approximation of 5.6.3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from pyro.poutine import Trace

from ppl_thought.checks import cost_weight
from ppl_thought.distributions.lm_sequence import LMSequence
from ppl_thought.distributions.lm_state import Segment
from ppl_thought.transforms.base import Transform
from ppl_thought.validation import checked
from ppl_thought.vocab import PAD_ID


@runtime_checkable
class SupportsParticles(Protocol):
    """What :meth:`CostAware.surrogate` reads of an SVI objective (every ``pt.train`` ParticleObjective): its own
    ``surrogate(model, guide, *args)`` and the weighted ``particles(model, guide, *args)`` of (3.2)."""

    def surrogate(self, *args: Any, **kwargs: Any) -> Any: ...

    def particles(self, *args: Any, **kwargs: Any) -> Any: ...

__all__ = ["CostAware", "latent_lengths"]


@checked
def latent_lengths(trace: Trace, n: int) -> torch.Tensor:
    """|Z_i| ``[n]``: the tokens of every latent sequence site of a trace (the whole ``z`` or the segments
    ``z_t`` of a step-wise program), per particle."""
    total = torch.zeros(n)
    for site in trace.nodes.values():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        fn = site["fn"]
        fn = getattr(fn, "base_dist", fn)
        if not isinstance(fn, (LMSequence, Segment)):
            continue
        v = torch.as_tensor(site["value"])
        if v.ndim == 1 and isinstance(fn, Segment) and fn.scalar:
            v = v[:, None]
        counts = (v != PAD_ID).reshape(-1, v.shape[-1]).sum(-1).float()
        if counts.shape[0] != n:
            counts = counts.reshape(n, -1).sum(-1) if counts.numel() % n == 0 else counts.sum().expand(n)
        total = total + counts.to(total.device)
    return total


@checked
class CostAware(Transform):
    """The cost-aware objective (5.26)-(5.27) for a model: every SVI objective of :mod:`ppl_thought.inference`
    (``pyro.infer.ELBO`` subclasses) trains ``CostAware(weight)(model)`` on the loss of the module docstring
    instead of its own, with its own loss as the cross-entropy estimate L_n.

    Args:
        weight: the cost of one latent token relative to the fixed cost of a sequence, tau(l) = 1 + weight * l.
        entropy: the estimate H~(P_*) of the target's entropy subtracted from the loss (4.1) (default 0).
        tau: a cost function of the latent lengths ``[n] -> [n]`` in place of 1 + weight * l.

    The model's distribution is unchanged: Importance, SMC and decoding run the transformed model as the
    inner one (its handler only records the latent lengths).
    """

    needs = ("a latent sequence site whose length it prices (an unobserved LMSequence or segment, e.g. the thoughts "
             "z of ProjectionLift(proj)(model)); a model without latent thoughts has nothing to cost")

    def __init__(self, weight: float, entropy: float = 0.0, tau: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.weight = cost_weight(weight)
        self.entropy = float(entropy)
        self._tau = tau

    @property
    def provides(self) -> dict:
        return {"cost_aware": self}

    def tau(self, lengths: torch.Tensor) -> torch.Tensor:
        """tau(|Z|): the time cost of latent sequences of these lengths."""
        return self._tau(lengths) if self._tau is not None else 1.0 + self.weight * lengths

    def _pyro_sample(self, msg) -> None:
        # a latent of the model itself (no obs=); an engine may condition it later (exact enumeration does)
        if not msg["is_observed"] and isinstance(getattr(msg["fn"], "base_dist", msg["fn"]), (LMSequence, Segment)):
            self._acted()

    def _pyro_post_sample(self, msg) -> None:
        fn = getattr(msg["fn"], "base_dist", msg["fn"])
        if not msg["is_observed"] and isinstance(fn, (LMSequence, Segment)):
            msg["infer"]["latent_tokens"] = (torch.as_tensor(msg["value"]) != PAD_ID).sum(-1)

    # ------------------------------------------------------------------ the estimators of 5.6.3
    def estimate(self, log_p: torch.Tensor, log_w: torch.Tensor,
                 lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T_s, T~*_s) from one batch: ``log_p`` = log P(Z_i) with its graph, ``log_w`` = log q_i, ``lengths``
        = |Z_i|."""
        tau = self.tau(lengths.to(log_p.device)).to(log_p.dtype)
        lw = log_w.detach()
        lse = torch.logsumexp(lw, 0)
        w = torch.where(torch.isfinite(lse), torch.exp(lw - lse), torch.zeros_like(lw))
        finite = torch.isfinite(log_p) & (w > 0)
        lp = log_p.masked_fill(~finite, 0.0)
        wt = w * tau
        t_tilde = (wt * lp).sum() - wt.sum().detach() * (w * lp).sum()
        return tau.mean(), t_tilde

    def surrogate(self, objective: SupportsParticles, model: Callable[..., Any] | None,
                  guide: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(value C_s T_s, surrogate) of the cost-aware loss for an SVI ``objective`` (a ParticleObjective)."""
        value_c, surr_c = objective.surrogate(model, guide, *args, **kwargs)
        cost_kwargs = {k: v for k, v in kwargs.items() if k != "sequences"}
        with torch.enable_grad():
            pt = objective.particles(model, guide, *args, **cost_kwargs)
            t_s, t_tilde = self.estimate(pt.log_p, pt.log_w, latent_lengths(pt.model_trace, pt.n))
        c_s = torch.as_tensor(value_c).detach() - self.entropy
        value = c_s * t_s.detach()
        surr = t_s.detach() * surr_c + c_s * t_tilde
        objective.last_stats = {**getattr(objective, "last_stats", {}), "time": float(t_s), "cross_entropy": float(c_s)}
        return value, surr

    def __repr__(self) -> str:
        return f"CostAware(weight={self.weight})"
