"""``CostAware(weight)`` on the JAX side (torch twin: ppl_thought/transforms/cost.py): (5.26)-(5.27) with the
estimators of 5.6.3."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ppl_thought.checks import cost_weight
from ppl_thought.numpyro.boundary import Array, ArrayLike, checked_jax
from ppl_thought.numpyro.distributions import LMSequence
from ppl_thought.numpyro.lm_state import NextToken, Segment
from ppl_thought.numpyro.program import is_output
from ppl_thought.numpyro.transforms.base import Transform
from ppl_thought.vocab import PAD_ID

__all__ = ["CostAware", "latent_lengths"]

#: the latent sequence sites CostAware prices: whole sequences (whole view), segments and single tokens of an
#: ``LMState`` (step view: a ``ptn.Program``)
_PRICED = (LMSequence, Segment, NextToken)


def _priced(msg: dict) -> bool:
    return msg["type"] == "sample" and not msg["is_observed"] and \
        isinstance(getattr(msg["fn"], "base_dist", msg["fn"]), _PRICED)


def _tokens(fn: Any, value: Any) -> jax.Array:
    """The latent tokens of one site's value per row: ``[..., L]`` sequences / segments counted up to padding, a
    :class:`NextToken` value ``[...]`` one token each."""
    v = jnp.asarray(value)
    if isinstance(fn, NextToken):
        return (v != PAD_ID).astype(jnp.int32)
    return (v != PAD_ID).sum(-1)


# ---------------------------------------------------------------------------------------------- CostAware
@checked_jax
def latent_lengths(trace: dict, n: int) -> jax.Array:
    """|Z_i| ``[n]``: the tokens of every latent (unobserved) sequence site of a NumPyro trace, per particle: whole
    sequences, and the segments and tokens of a step-wise program's ``LMState`` (the torch
    ``pt.transforms.latent_lengths``). Output sites (``ptn.observe(name, d, None)``) are not latent."""
    total = jnp.zeros(int(n))
    for site in trace.values():
        if not _priced(site) or is_output(site):
            continue
        fn = getattr(site["fn"], "base_dist", site["fn"])
        counts = _tokens(fn, site["value"]).reshape(-1).astype(jnp.float32)
        if counts.shape[0] != n:
            counts = counts.reshape(n, -1).sum(-1) if counts.size % n == 0 else jnp.broadcast_to(counts.sum(), (n,))
        total = total + counts
    return total


@checked_jax
class CostAware(Transform):
    """The cost-aware objective (5.26)-(5.27) of Section 5.6.3 (torch twin: ``pt.transforms.CostAware``):
    tau(l) = 1 + weight * l (or ``tau``), and the one-sampler estimators

        T_s = (1/n) sum_i tau(|Z_i|),
        T~*_s = sum_i w_i tau(|Z_i|) log P(Z_i) - (sum_i w_i tau(|Z_i|)) (sum_i w_i log P(Z_i)),

    w_i the self-normalised importance weights; the loss C_s (T~*_s + D(T_s - T~*_s)) has value C_s T_s and
    gradient T_s grad C_s + C_s grad T~*_s (:meth:`loss`, C_s = L_n - H~(P_*)). The model's distribution is
    unchanged: engines run the transformed model as the inner one; the handler records each latent sequence
    site's lengths in ``msg["infer"]["latent_tokens"]``: whole sequences (whole view) and the segments / tokens a
    ``ptn.Program`` samples from an ``LMState`` (step view: ``CostAware(w)(program)`` is a program).

    Args:
        weight: the cost of one latent token relative to the fixed cost of a sequence (finite, >= 0).
        entropy: the estimate H~(P_*) subtracted from the cross entropy (4.1) (default 0).
        tau: a cost function of the latent lengths ``[n] -> [n]`` in place of 1 + weight * l.
    """

    needs = ("a latent sequence site whose length it prices (an unobserved LMSequence, e.g. the thoughts z of "
             "ProjectionLift(proj)(model), or a segment / token a ptn.Program samples from an LMState); a model "
             "without latent thoughts has nothing to cost")

    def __init__(self, weight: float, entropy: float = 0.0, tau: Callable[[Any], Any] | None = None, *,
                 fn: Callable[..., Any] | None = None):
        super().__init__(fn)
        self.weight = cost_weight(weight)
        self.entropy = float(entropy)
        self._tau = tau

    def tau(self, lengths: ArrayLike) -> jax.Array:
        """tau(|Z|): the time cost of latent sequences of these lengths."""
        lengths = jnp.asarray(lengths, jnp.float32)
        return jnp.asarray(self._tau(lengths)) if self._tau is not None else 1.0 + self.weight * lengths

    def act(self, msg: dict) -> None:
        if _priced(msg) and not is_output(msg):
            self._acted()

    def postprocess_message(self, msg: dict) -> None:
        if _priced(msg) and not is_output(msg):
            msg["infer"]["latent_tokens"] = _tokens(getattr(msg["fn"], "base_dist", msg["fn"]), msg["value"])

    def estimate(self, log_p: Array, log_w: Array, lengths: Array) -> tuple[jax.Array, jax.Array]:
        """(T_s, T~*_s) of one batch: ``log_p`` = log P(Z_i) (differentiable), ``log_w`` = log q_i (held fixed),
        ``lengths`` = |Z_i|. -inf weights and log-probabilities drop out (never NaN)."""
        log_p = jnp.asarray(log_p)
        tau = self.tau(lengths).astype(log_p.dtype)
        lw = jax.lax.stop_gradient(jnp.asarray(log_w))
        lse = jax.scipy.special.logsumexp(lw, 0)
        w = jnp.where(jnp.isfinite(lse), jnp.exp(lw - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
        finite = jnp.isfinite(log_p) & (w > 0)
        lp = jnp.where(finite, log_p, 0.0)
        wt = w * tau
        t_tilde = (wt * lp).sum() - jax.lax.stop_gradient(wt.sum()) * (w * lp).sum()
        return tau.mean(), t_tilde

    def loss(self, cross_entropy: ArrayLike, surrogate: ArrayLike, log_p: Array, log_w: Array,
             lengths: Array) -> tuple[jax.Array, jax.Array]:
        """(value C_s T_s, surrogate T_s * surrogate + C_s T~*_s) of (5.27) from an objective's loss value L_n
        (``cross_entropy``) and its differentiable ``surrogate`` (the torch ``CostAware.surrogate``)."""
        t_s, t_tilde = self.estimate(log_p, log_w, lengths)
        c_s = jax.lax.stop_gradient(jnp.asarray(cross_entropy)) - self.entropy
        return c_s * jax.lax.stop_gradient(t_s), jax.lax.stop_gradient(t_s) * surrogate + c_s * t_tilde

    def __repr__(self) -> str:
        return f"CostAware(weight={self.weight})"
