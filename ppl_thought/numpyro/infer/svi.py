"""The ELBO for ``numpyro.infer.SVI`` with discrete sequence sites: the score-function estimator (the torch
objectives' form, ppl_thought/training/objectives.py) over vmapped particles with a leave-one-out baseline.

ELBO = E_Q[log P(z, x) - log Q(z | x)] <= log p(x) (the bound of Section 3, tight at Q = Q_*, (2.24)). Its
gradient in the guide's parameters phi is E_Q[(f(z) - b) grad log Q_phi(z | x)] + E_Q[grad f] with
f = log P - log Q; b, the mean of f over the other particles, leaves it unbiased and lowers its variance.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from numpyro.handlers import replay, seed, substitute, trace
from numpyro.infer.elbo import ELBO as _NumPyroELBO

from ppl_thought.checks import integer
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.infer.importance import site_log_prob
from ppl_thought.validation import per_token


@checked_jax
class ELBO(_NumPyroELBO):
    """``numpyro.infer.SVI(model, guide, optim, ptn.infer.ELBO(num_particles))``: minimises -ELBO with the
    score-function gradient (the sequence sites are discrete, so NumPyro's reparametrised Trace_ELBO does not
    apply). ``loss`` returns the estimate of -ELBO; its gradient is the estimator's."""

    can_infer_discrete = True

    def __init__(self, num_particles: int = 8):
        super().__init__(num_particles=integer("num_particles", num_particles, minimum=1))

    @per_token
    def particles(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                  **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        """``(log P(z, x), log Q(z | x))`` for ``num_particles`` draws of the guide, vmapped."""

        def one(key):
            kq, kp = jax.random.split(key)
            g_tr = trace(substitute(seed(guide, kq), data=param_map)).get_trace(*args, **kwargs)
            m_tr = trace(replay(substitute(seed(model, kp), data=param_map), trace=g_tr)).get_trace(*args, **kwargs)
            log_q = sum((site_log_prob(s) for s in g_tr.values() if s["type"] == "sample" and not s["is_observed"]),
                        jnp.zeros(()))
            log_p = sum((site_log_prob(s) for s in m_tr.values() if s["type"] == "sample"), jnp.zeros(()))
            return log_p, log_q

        return jax.vmap(one)(jax.random.split(rng_key, self.num_particles))

    @per_token
    def loss_with_mutable_state(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                                **kwargs: Any) -> dict[str, Any]:
        log_p, log_q = self.particles(rng_key, param_map, model, guide, *args, **kwargs)
        f = jnp.where(jnp.isneginf(log_p), -jnp.inf, log_p - log_q)
        fs = jax.lax.stop_gradient(f)
        n = self.num_particles
        baseline = (fs.sum() - fs) / (n - 1) if n > 1 else jnp.zeros_like(fs)
        surrogate = jnp.mean(f + (fs - baseline) * log_q)
        value = -jnp.mean(fs)
        return {"loss": value + (-surrogate - jax.lax.stop_gradient(-surrogate)), "mutable_state": None}
