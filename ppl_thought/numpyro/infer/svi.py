"""The ELBO for ``numpyro.infer.SVI`` with discrete sequence sites: the score-function estimator (the torch
objectives' form, ppl_thought/training/objectives.py) over a batch of particles with a leave-one-out baseline, on
whole-trace models and on ``ptn.Program`` s (ppl_thought/numpyro/infer/objectives.py draws the particles).

ELBO = E_Q[log P(z, x) - log Q(z | x)] <= log p(x) (the bound of Section 3, tight at Q = Q_*, (2.24)). Its
gradient in the guide's parameters phi is E_Q[(f(z) - b) grad log Q_phi(z | x)] + E_Q[grad f] with
f = log P - log Q; b, the mean of f over the other particles, leaves it unbiased and lowers its variance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.infer.objectives import ParticleLoss
from ppl_thought.validation import per_token


@checked_jax
class ELBO(ParticleLoss):
    """``numpyro.infer.SVI(model, guide, optim, ptn.infer.ELBO(num_particles))`` (model and guide: whole-trace
    NumPyro models or ``ptn.Program`` s): minimises -ELBO with the score-function gradient (the sequence sites are
    discrete, so NumPyro's reparametrised Trace_ELBO does not apply). ``loss`` returns the estimate of -ELBO; its
    gradient is the estimator's."""

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict) -> tuple[jax.Array, jax.Array]:
        f = jnp.where(jnp.isneginf(log_p), -jnp.inf, log_p - log_q)
        fs = jax.lax.stop_gradient(f)
        n = log_p.shape[0]
        baseline = (fs.sum() - fs) / (n - 1) if n > 1 else jnp.zeros_like(fs)
        return -jnp.mean(fs), -jnp.mean(f + (fs - baseline) * log_q)
