"""Langevin posterior sampling of continuous latents, ULA and MALA, as NumPyro ``MCMCKernel`` s.

The JAX twin of ``ppl_thought.inference.langevin`` (read its docstring for the algorithm). With the
potential energy U(z) = -log p(x, z) one step is (latent-thought-models.txt, Eq. 4)::

    z' = z - s grad U(z) + sqrt(2 s) xi,                                  xi ~ N(0, I)     (ULA)

and MALA accepts z' with probability min(1, exp(U(z) - U(z')) q(z | z') / q(z' | z)),
log q(z' | z) = -||z' - z + s grad U(z)||^2 / (4 s), which leaves the posterior exactly invariant;
ULA always moves and is biased for s > 0 (Gaussian target of precision P: covariance (P - s P^2/2)^-1).

Both run in NumPyro's unconstrained space (``numpyro.infer.util.initialize_model``: any model with
continuous latent sites), under ``numpyro.infer.MCMC`` (jitted, chains vectorised or sequential)::

    mcmc = numpyro.infer.MCMC(ptn.infer.MALA(model), num_warmup=300, num_samples=1000, num_chains=4,
                              chain_method="vectorized")
    mcmc.run(jax.random.PRNGKey(0), y, extra_fields=("accept_prob", "step_size", "diverging"))
    az.from_numpyro(mcmc)

The step size is found by doubling / halving (as Pyro's HMC) and adapted during warmup by dual averaging
on log s toward ``target_accept`` (0.57 for MALA, Roberts & Rosenthal 1998; 0.99 for ULA), the final warmup
step taking the averaged value, as on the torch side. ULA adapts with the MALA acceptance probability computed,
not used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpyro
from jax.flatten_util import ravel_pytree
from numpyro.infer.hmc_util import dual_averaging
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.infer.util import initialize_model

from ppl_thought.errors import ConfigError, DiscreteLatentError, ProgramError
from ppl_thought.numpyro.boundary import checked_jax, refuse_nan
from ppl_thought.numpyro.program import Program, is_output, is_program, run_whole_trace
from ppl_thought.validation import per_token

__all__ = ["LangevinState", "MALA", "ULA"]

_MIN_STEP_SIZE, _MAX_STEP_SIZE = 1e-10, 1e10
# a move whose log acceptance ratio is below -_MAX_LOG_RATIO (or not finite) counts as a divergence
_MAX_LOG_RATIO = 1000.0


class _LangevinFields(NamedTuple):
    i: jax.Array
    z: Any  # unconstrained latent values (a dict of arrays)
    potential_energy: jax.Array
    z_grad: Any
    step_size: jax.Array
    accept_prob: jax.Array  # of the last proposal (MALA's, also for ULA)
    mean_accept_prob: jax.Array
    diverging: jax.Array
    adapt_state: tuple
    rng_key: jax.Array


@checked_jax
class LangevinState(_LangevinFields):
    """The chain's state; ``MCMC(..., extra_fields=(...))`` records any of these fields.

    JAX rebuilds it at every step (a pytree), also with placeholders and tracers: only NaN is refused here, in
    a field given as a Python float or a host array (:class:`~ppl_thought.errors.NumericalError` naming the
    field); JAX arrays are not read back (no device sync per step)."""

    __slots__ = ()

    def __new__(cls, i: Any, z: Any, potential_energy: Any, z_grad: Any, step_size: Any, accept_prob: Any,
                mean_accept_prob: Any, diverging: Any, adapt_state: Any, rng_key: Any) -> LangevinState:
        fields = (i, z, potential_energy, z_grad, step_size, accept_prob, mean_accept_prob, diverging, adapt_state,
                  rng_key)
        leaves = {}
        for name, value in zip(cls._fields, fields, strict=True):
            if isinstance(value, dict | list | tuple):
                leaves.update({f"{name}[{i}]": v for i, v in enumerate(jax.tree.leaves(value))})
            else:
                leaves[name] = value
        refuse_nan("LangevinState", leaves)
        return super().__new__(cls, *fields)


@checked_jax
class MALA(MCMCKernel):
    """Metropolis-adjusted Langevin (``adjust=True``; :class:`ULA` is the unadjusted one).

    Args:
        model: a NumPyro model with continuous latent sites, a ``ptn.Program`` with continuous latent sites (its
            whole trace with one particle, ``Program.__call__``: U = -log joint of init and every step), or None
            with ``potential_fn``.
        potential_fn: U(z) on unconstrained values (then ``init_params`` must be given to ``MCMC.run``).
        step_size: initial s (> 0).
        adapt_step_size: find s and adapt it by dual averaging during warmup.
        target_accept: the acceptance probability dual averaging aims for, in (0, 1); ``None`` (default): 0.57
            for MALA, 0.99 for ULA (as ``pt.infer.Langevin``: at 0.57 the adapted ULA step sits near ULA's
            stability limit in low dimension and its uncorrected sd is several times too large).
        init_strategy: NumPyro initialisation strategy of the latent sites.
    """

    adjust = True
    sample_field = "z"

    def __init__(self, model: Callable | Program | None = None, potential_fn: Callable | None = None,
                 step_size: float = 0.1,
                 adapt_step_size: bool = True, target_accept: float | None = None,
                 init_strategy: Callable = init_to_uniform):
        if target_accept is None:
            target_accept = 0.57 if self.adjust else 0.99
        if (model is None) == (potential_fn is None):
            raise ConfigError(f"{type(self).__name__} needs exactly one of model and potential_fn")
        if not step_size > 0:
            raise ConfigError(f"{type(self).__name__}: step_size must be > 0, got {step_size}")
        if not 0.0 < target_accept < 1.0:
            raise ConfigError(f"{type(self).__name__}: target_accept must be in (0, 1), got {target_accept}")
        if model is not None and is_program(model) and not isinstance(model, Program):
            program = model  # a duck-typed program (init / step, not callable): its whole trace

            def model(*args, **kwargs):
                run_whole_trace(program, args, kwargs)
        self._model, self._potential_fn = model, potential_fn
        self._step_size, self.adapt_step_size, self.target_accept = float(step_size), adapt_step_size, target_accept
        self._init_strategy = init_strategy
        self._potential_fn_gen = self._postprocess_fn = None
        self._num_warmup = 0
        self._da_init, self._da_update = dual_averaging()

    @property
    def model(self) -> Callable | None:
        return self._model

    @property
    def default_fields(self) -> tuple[str, ...]:
        return ("z", "diverging")

    def get_diagnostics_str(self, state: LangevinState) -> str:
        return f"step size {float(state.step_size):.2e}. acc. prob={float(state.mean_accept_prob):.2f}"

    def postprocess_fn(self, args: Any, kwargs: Any) -> Callable:
        if self._postprocess_fn is None:
            return lambda z: z
        return self._postprocess_fn(*args, **kwargs)

    # -- initialisation ---------------------------------------------------------------------------------

    def _potential(self, model_args, model_kwargs) -> Callable:
        if self._potential_fn_gen is not None:
            return self._potential_fn_gen(*model_args, **model_kwargs)
        return self._potential_fn

    @per_token
    def init(self, rng_key: Any, num_warmup: Any, init_params: Any, model_args: Any,
             model_kwargs: Any) -> LangevinState:
        """The initial state; ``rng_key`` of shape ``[chains, 2]`` (``chain_method="vectorized"``) gives
        one state per chain, stacked."""
        model_kwargs = {} if model_kwargs is None else model_kwargs
        batched = jnp.ndim(rng_key) > 1
        keys = jax.vmap(lambda k: jax.random.split(k, 3))(rng_key) if batched else jax.random.split(rng_key, 3)
        rng_key, key_init, key_step = (keys[:, i] for i in range(3)) if batched else keys
        if self._model is not None:
            self._refuse_discrete(key_init[0] if batched else key_init, model_args, model_kwargs)
            info = initialize_model(key_init, self._model, init_strategy=self._init_strategy, dynamic_args=True,
                                    model_args=model_args, model_kwargs=model_kwargs)
            self._potential_fn_gen, self._postprocess_fn = info.potential_fn, info.postprocess_fn
            if init_params is None:
                init_params = info.param_info.z
        elif init_params is None:
            raise ConfigError(f"{type(self).__name__}(potential_fn=...) needs init_params")
        self._num_warmup = int(num_warmup)
        potential = self._potential(model_args, model_kwargs)

        def init_one(z, key, key_step) -> LangevinState:
            pe, grad = jax.value_and_grad(potential)(z)
            step_size = jnp.asarray(self._step_size, jnp.float32)
            if self.adapt_step_size and num_warmup > 0:
                step_size = self._find_reasonable_step_size(potential, z, pe, grad, step_size, key_step)
            adapt_state = self._da_init(jnp.log(10 * step_size))
            zero = jnp.zeros((), jnp.float32)
            return LangevinState(jnp.zeros((), jnp.int32), z, pe, grad, step_size, zero, zero,
                                 jnp.zeros((), bool), adapt_state, key)

        return jax.vmap(init_one)(init_params, rng_key, key_step) if batched else init_one(init_params, rng_key,
                                                                                          key_step)

    def _refuse_discrete(self, key, model_args, model_kwargs) -> None:
        """DiscreteLatentError naming the discrete latent sites (before NumPyro's initialisation, which would
        ask for funsor to enumerate them)."""
        trace = numpyro.handlers.trace(numpyro.handlers.seed(self._model, key)).get_trace(*model_args,
                                                                                           **model_kwargs)
        outputs = [name for name, site in trace.items() if site["type"] == "sample" and is_output(site)]
        if outputs:
            raise ProgramError(f"{type(self).__name__} samples the posterior of latent sites; sites {outputs} "
                               "are outputs (observe(name, fn, None)), which are not in the target: observe them "
                               "with a value or draw them afterwards (numpyro.infer.Predictive)")
        discrete = [name for name, site in trace.items() if site["type"] == "sample" and not site["is_observed"]
                    and site["fn"].support.is_discrete]
        if discrete:
            raise DiscreteLatentError(f"{type(self).__name__} needs continuous latents; sites {discrete} are "
                                      "discrete")

    def _find_reasonable_step_size(self, potential, z, pe, grad, step_size, key) -> jax.Array:
        """Double or halve s until the one-step acceptance probability crosses the target (one noise draw,
        so the search is monotone in s); a ``lax.while_loop``, so vectorised chains can run it."""
        z_flat, _ = ravel_pytree(z)
        noise = jax.random.normal(key, z_flat.shape, z_flat.dtype)
        log_target = jnp.log(self.target_accept)

        def above(s):
            return self._trial(potential, z, pe, grad, s, noise)[3] > log_target

        direction = jnp.where(above(step_size), 2.0, 0.5)

        def cond(carry):
            _, done, n = carry
            return ~done & (n < 100)

        def body(carry):
            s, _, n = carry
            new = s * direction
            outside = ~((new > _MIN_STEP_SIZE) & (new < _MAX_STEP_SIZE))
            flipped = jnp.where(above(new), 2.0, 0.5) != direction
            return jnp.where(outside, s, new), outside | flipped, n + 1

        s, _, _ = jax.lax.while_loop(cond, body, (step_size, jnp.zeros((), bool), 0))
        return jnp.clip(s, _MIN_STEP_SIZE, _MAX_STEP_SIZE)

    # -- one transition ---------------------------------------------------------------------------------

    @staticmethod
    def _trial(potential, z, pe, grad, step_size, noise):
        """The proposal z' = z - s grad U(z) + sqrt(2 s) xi (Eq. 4), U and grad U there, and the log
        Metropolis-Hastings ratio U(z) - U(z') + log q(z | z') - log q(z' | z) (-inf where U(z') is not finite)."""
        z_flat, unravel = ravel_pytree(z)
        g_flat, _ = ravel_pytree(grad)
        z_new_flat = z_flat - step_size * g_flat + jnp.sqrt(2 * step_size) * noise
        z_new = unravel(z_new_flat)
        pe_new, grad_new = jax.value_and_grad(potential)(z_new)
        g_new_flat, _ = ravel_pytree(grad_new)

        def log_q(to, frm, g_frm):  # log q(to | frm) up to its constant
            return -jnp.sum((to - frm + step_size * g_frm) ** 2) / (4 * step_size)

        log_ratio = pe - pe_new + log_q(z_flat, z_new_flat, g_new_flat) - log_q(z_new_flat, z_flat, g_flat)
        finite = jnp.isfinite(pe_new) & jnp.all(jnp.isfinite(g_new_flat))
        log_ratio = jnp.where(finite & ~jnp.isnan(log_ratio), log_ratio, -jnp.inf)
        return z_new, pe_new, grad_new, log_ratio, finite

    @per_token
    def sample(self, state: LangevinState, model_args: Any, model_kwargs: Any) -> LangevinState:
        """One ULA or MALA transition (pure, jitted by ``MCMC``); adapts s during warmup. A stacked state
        (``chain_method="vectorized"``: every field has the chains on axis 0) moves every chain at once."""
        model_kwargs = {} if model_kwargs is None else model_kwargs
        potential = self._potential(model_args, model_kwargs)
        if jnp.ndim(state.i):
            return jax.vmap(lambda st: self._transition(potential, st))(state)
        return self._transition(potential, state)

    def _transition(self, potential: Callable, state: LangevinState) -> LangevinState:
        rng_key, key_noise, key_accept = jax.random.split(state.rng_key, 3)
        z_flat, _ = ravel_pytree(state.z)
        noise = jax.random.normal(key_noise, z_flat.shape, z_flat.dtype)
        z_new, pe_new, grad_new, log_ratio, finite = self._trial(potential, state.z, state.potential_energy,
                                                                 state.z_grad, state.step_size, noise)
        accept_prob = jnp.exp(jnp.minimum(log_ratio, 0.0))
        diverging = ~finite | (log_ratio < -_MAX_LOG_RATIO)
        accepted = jax.random.uniform(key_accept) < accept_prob if self.adjust else finite
        z, pe, grad = jax.tree.map(lambda new, old: jnp.where(accepted, new, old),
                                   (z_new, pe_new, grad_new), (state.z, state.potential_energy, state.z_grad))

        i = state.i + 1
        step_size, adapt_state = state.step_size, state.adapt_state
        if self.adapt_step_size:  # dual averaging on log s, statistic target - alpha (Hoffman & Gelman 2014)
            warm = i <= self._num_warmup
            new_adapt = self._da_update(self.target_accept - accept_prob, adapt_state)
            log_step = jnp.where(i == self._num_warmup, new_adapt[1], new_adapt[0])
            new_step = jnp.clip(jnp.exp(log_step), _MIN_STEP_SIZE, _MAX_STEP_SIZE).astype(step_size.dtype)
            step_size = jnp.where(warm, new_step, step_size)
            adapt_state = jax.tree.map(lambda new, old: jnp.where(warm, new, old), new_adapt, adapt_state)
        n = jnp.where(i <= self._num_warmup, i, i - self._num_warmup).astype(jnp.float32)
        mean_accept = state.mean_accept_prob + (accept_prob - state.mean_accept_prob) / n
        return LangevinState(i, z, pe, grad, step_size, accept_prob, mean_accept, diverging, adapt_state, rng_key)


@checked_jax
class ULA(MALA):
    """The unadjusted Langevin algorithm: every finite proposal is taken (biased for s > 0)."""

    adjust = False
