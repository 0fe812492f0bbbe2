"""``SFT``, ``SeparatePolicy``, ``Inquisitive`` and ``Sum`` as NumPyro losses for ``numpyro.infer.SVI`` (torch twins:
ppl_thought/training/objectives.py; docs/training.md). Same conventions as :mod:`.objectives`: a loss returns
``value + surrogate - U(surrogate)``, whose value is the estimated loss and whose gradient is the estimator.

* ``SFT`` (App. L, (5.25)): -(1/B) sum_b log p(z_b, x) on given ``sequences=`` (the model conditioned on them,
  one ``vmap`` lane per row) or, without them, on the guide's (detached) samples.
* ``SeparatePolicy`` (Remark 3.10): the policy pi_theta (the model) trained on samples of pi^boxminus (the guide),
  and pi^boxminus towards pi_•, whose reward reads the per-sample norms ||grad_theta log pi_theta(Z_i)||: one
  ``jax.jacrev`` of the batch's log p in theta (the parameters the guide does not register).
* ``Inquisitive``: (3.25) with the reward (3.26), which reads the same norms;
* ``Sum``: a weighted sum of losses; terms that read the same particles share one batch.

Compiled code cannot raise: where the torch side raises on a non-finite reward or a sequence of probability 0,
the loss is ``+inf`` with a zero gradient for that batch (never NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.handlers import condition, seed, substitute, trace

from ppl_thought.checks import real
from ppl_thought.errors import ArgumentTypeError, ConfigError, MalformedSequenceError, ProgramError, SiteMismatchError
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.infer.importance import site_log_prob
from ppl_thought.numpyro.infer.objectives import ParticleLoss, SamplerPolicyGradient, _finite, _guard
from ppl_thought.numpyro.program import is_output, is_program
from ppl_thought.validation import per_token

__all__ = ["SFT", "Inquisitive", "SeparatePolicy", "Sum"]


# ---------------------------------------------------------------------------------------------- SFT
def _conditioned_log_p(rng_key: Any, param_map: dict, model: Any, site: str, seq: jax.Array, args: tuple,
                       kwargs: dict) -> jax.Array:
    """``[B]`` log p of a whole-trace model conditioned on ``site = seq[b]``, one ``vmap`` lane per row."""

    def one(row, key):
        tr = trace(condition(substitute(seed(model, key), data=param_map), data={site: row})).get_trace(*args,
                                                                                                      **kwargs)
        if site not in tr or tr[site]["type"] != "sample":
            sites = sorted(k for k, s in tr.items() if s["type"] == "sample")
            raise SiteMismatchError(f"SFT: the model has no site {site!r} to fit the sequences to (its sample sites: "
                                    f"{sites}); pass site= naming it")
        return sum((site_log_prob(s) for s in tr.values() if s["type"] == "sample" and not is_output(s)),
                   jnp.zeros(()))

    return jax.vmap(one)(seq, jax.random.split(rng_key, seq.shape[0]))


@checked_jax
class SFT(ParticleLoss):
    """Supervised next-token loss, -(1/B) sum_b log p(z_b, x) teacher-forced (the SFT baseline, App. L).

    ``SVI.update(state, *args, sequences=z)`` (or ``loss.loss(..., sequences=z)``) with ``z`` ``[B, ...]`` values of
    the site ``site`` (a 1-D z for a sequence site is one row): the whole-trace model conditioned on each row.
    Without ``sequences`` the rows are the guide's ``num_particles`` samples, detached: the mini-batch loss (5.25),
    L_1^(n) = -(1/n) sum_i log P_f(Y_i x_r), Y_i ~ Q(. | x x_r). Value and surrogate are both the mean NLL; a
    row of probability 0 makes the loss ``+inf`` with a zero gradient (torch: a ConfigError)."""

    def __init__(self, num_particles: int = 1, site: str = "z"):
        super().__init__(num_particles)
        self.site = site

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict) -> tuple[jax.Array, jax.Array]:
        ok = jnp.isfinite(jax.lax.stop_gradient(log_p)).all()
        safe = jnp.where(ok, log_p, 0.0)
        return _guard(-jax.lax.stop_gradient(safe).mean(), -safe.mean(), ok)

    @per_token
    def surrogate(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                  sequences: Any = None, **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        if sequences is None:
            log_p, log_q, values = self.particles(rng_key, param_map, model, guide, *args, **kwargs)
            return self.from_particles(log_p, log_q, values)
        if is_program(model) or (not callable(model) and callable(getattr(model, "as_program", None))):
            raise ConfigError("SFT(sequences=) conditions a whole-trace NumPyro model on the rows; for a ptn.Program "
                              "give a guide program that proposes the sequences and call SFT without sequences=")
        seq = jnp.asarray(sequences)
        if seq.ndim == 1 and np.issubdtype(seq.dtype, np.integer):
            seq = seq[None]
        if seq.ndim == 0 or seq.shape[0] == 0:
            raise MalformedSequenceError(f"SFT sequences must be [B, ...] with B >= 1, got shape {tuple(seq.shape)}")
        log_p = _conditioned_log_p(rng_key, param_map, model, self.site, seq, args, kwargs)
        return self.from_particles(log_p, jnp.zeros_like(log_p), {self.site: seq})


# ---------------------------------------------------------------------------------------------- SeparatePolicy
def _guide_param_names(guide: Any, args: tuple, kwargs: dict) -> set[str]:
    """The ``numpyro.param`` sites a guide registers (a program's whole trace with one particle)."""
    tr = trace(seed(guide, 0)).get_trace(*args, **kwargs)
    return {k for k, s in tr.items() if s["type"] == "param"}


def _grad_norms(loss: ParticleLoss, rng_key: Any, param_map: dict, model: Any, guide: Any, args: tuple,
                kwargs: dict) -> jax.Array | None:
    """``[n]`` ||grad_theta log p(Z_i, x)|| of the particles ``loss.particles`` draws with ``rng_key``: one
    ``jax.jacrev`` of the batch's log p in theta, the parameters of ``param_map`` the guide does not register
    (the norm in (3.22), (3.26)); ``None`` when there are none. Non-finite entries count 0."""
    theta = sorted(set(param_map) - _guide_param_names(guide, args, kwargs))
    if not theta:
        return None
    rest = {k: v for k, v in param_map.items() if k not in theta}

    def log_p(th):
        return loss.particles(rng_key, {**rest, **th}, model, guide, *args, **kwargs)[0]

    jac = jax.jacrev(log_p)({k: param_map[k] for k in theta})
    n = loss.num_particles
    sq = sum(jnp.sum(jnp.where(jnp.isfinite(j), j, 0.0).reshape(n, -1) ** 2, -1) for j in jax.tree.leaves(jac))
    return jax.lax.stop_gradient(jnp.sqrt(sq))


@checked_jax
class SeparatePolicy(ParticleLoss):
    """Remark 3.10: a policy pi_theta (the model) trained on samples of a separate policy pi^boxminus (the guide),
    which is itself trained towards the variance-minimising pi_•:

        L = -1/(n-1) sum_i A_i U(pi_theta(Z_i) / pi^boxminus(Z_i)) log pi_theta(Z_i),  Z_i ~ pi^boxminus,
        L_sampler = -(1/n) sum_i (R^boxminus_i - mean R^boxminus) log pi^boxminus(Z_i),
        R^boxminus_i = U(log |A_i| + log ||grad_theta log pi_theta(Z_i)|| + log pi_theta(Z_i) / pi^boxminus(Z_i)),

    A_i = R(Z_i) - mean_j R(Z_j), |A_i| and the norm floored at ``floor``. theta: the parameters of ``param_map`` the
    guide does not register; the norms are one ``jax.jacrev`` of the batch's log p (no loop over particles).
    ``reward(z, *args, **kwargs) -> [n]`` reads the guide's values at ``site``. Value -(1/n) sum_i ratio_i R(Z_i),
    unbiased for -E_{pi_theta}[R]."""

    min_particles = 2

    def __init__(self, reward: Callable[..., Any], num_particles: int = 8, site: str = "z",
                 train_sampler: bool = True, floor: float = 1e-12):
        super().__init__(num_particles)
        if not callable(reward):
            raise ArgumentTypeError(f"SeparatePolicy: reward must be a callable z -> [n] rewards, got "
                                    f"{type(reward).__name__}")
        self.reward, self.site, self.train_sampler = reward, site, bool(train_sampler)
        self.floor = real("floor", floor)

    @per_token
    def grad_norms(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                   **kwargs: Any) -> jax.Array:
        """``[n]`` ||grad_theta log pi_theta(Z_i)|| of the particles drawn with ``rng_key`` (ones if the model has no
        parameter of its own)."""
        norms = _grad_norms(self, rng_key, param_map, model, guide, args, kwargs)
        return jnp.ones(self.num_particles) if norms is None else norms

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict, rewards: Any = None,
                       norms: Any = None) -> tuple[jax.Array, jax.Array]:
        """(value, surrogate) from one batch, its rewards ``[n]`` and (``train_sampler``) the norms ``[n]``."""
        n = log_p.shape[0]
        r = jax.lax.stop_gradient(jnp.asarray(rewards, log_p.dtype))
        if r.shape != (n,):
            raise ProgramError(f"SeparatePolicy: reward must return one value per particle, shape ({n},), got "
                               f"{r.shape}")
        r, ok = _finite(r, None)
        log_w = jax.lax.stop_gradient(log_p - log_q)
        ok = ok & jnp.isfinite(log_w).all()
        log_w = jnp.where(jnp.isfinite(log_w), log_w, 0.0)
        ratio = jnp.exp(log_w)
        a = r - r.mean()
        safe_p = jnp.where(jnp.isfinite(log_p), log_p, 0.0)
        surr = -jnp.sum(a * ratio * safe_p) / (n - 1)
        value = -(ratio * r).mean()
        if self.train_sampler:
            norms = jnp.ones(n) if norms is None else jax.lax.stop_gradient(norms)
            rb = (jnp.log(jnp.maximum(jnp.abs(a), self.floor)) + jnp.log(jnp.maximum(norms, self.floor)) + log_w)
            surr = surr - jnp.mean((rb - rb.mean()) * jnp.where(jnp.isfinite(log_q), log_q, 0.0))
        return _guard(value, surr, ok)

    @per_token
    def surrogate(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                  **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        log_p, log_q, values = self.particles(rng_key, param_map, model, guide, *args, **kwargs)
        if self.site not in values:
            raise SiteMismatchError(f"SeparatePolicy: the guide has no site {self.site!r} (sites: {sorted(values)}); "
                                    "pass site= naming the latent the reward reads")
        rewards = self.reward(values[self.site], *args, **kwargs)
        norms = self.grad_norms(rng_key, param_map, model, guide, *args, **kwargs) if self.train_sampler else None
        return self.from_particles(log_p, log_q, values, rewards, norms)


# ---------------------------------------------------------------------------------------------- Inquisitive
@checked_jax
class Inquisitive(SamplerPolicyGradient):
    """The train sampler Q^boxminus trained towards the inquisitive sampler Q_• (3.22) by (3.25) with the reward
    (3.26): R•_i = log P(Z•_i) + log ||grad_theta log P(Z•_i)|| - log Q^boxminus(Z•_i | x). theta: the parameters of
    ``param_map`` the guide does not register; the norms are one ``jax.jacrev`` of the batch's log p, detached (never
    differentiated, as the text after (3.26) says) and floored at ``norm_floor``. Value -mean R•."""

    def __init__(self, num_particles: int = 8, norm_floor: float = 1e-12, invalid_reward: float | None = None):
        super().__init__(num_particles, invalid_reward)
        self.norm_floor = real("norm_floor", norm_floor, minimum=0.0, open_min=True)

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict,
                       norms: Any = None) -> tuple[jax.Array, jax.Array]:
        """(3.25) with the reward (3.26) on one batch and its norms ``[n]``."""
        if norms is None:
            raise ProgramError("Inquisitive.from_particles needs the per-particle norms ||grad_theta log P(Z_i)|| "
                               "(norms=); surrogate computes them")
        lw = jax.lax.stop_gradient(log_p - log_q)
        r, ok = _finite(lw + jnp.log(jnp.maximum(jax.lax.stop_gradient(norms), self.norm_floor)),
                        self.invalid_reward)
        a = r - r.mean()
        return _guard(-r.mean(), -jnp.sum(a * log_q) / (log_p.shape[0] - 1), ok)

    @per_token
    def surrogate(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                  **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        log_p, log_q, values = self.particles(rng_key, param_map, model, guide, *args, **kwargs)
        norms = _grad_norms(self, rng_key, param_map, model, guide, args, kwargs)
        if norms is None:
            raise ProgramError("Inquisitive needs the model to register parameters of P (numpyro.param) that the "
                               "guide does not: none found (the reward (3.26) reads ||grad_theta log P||)")
        return self.from_particles(log_p, log_q, values, norms)


# ---------------------------------------------------------------------------------------------- Sum
@checked_jax
class Sum(ParticleLoss):
    """A weighted sum of losses trained together, e.g. ``Sum(OneSampler(n), SamplerPolicyGradient(n))`` for P and
    Q at once (Section 3.4.3: "one only needs to sample X, Z once"). Terms that read the particles only through
    ``from_particles`` (the default ``surrogate``) with equal ``num_particles`` share one batch; the others draw
    their own (independent keys). Value: the weighted sum of the terms' values; surrogate likewise."""

    def __init__(self, *terms: ParticleLoss, weights: Sequence[float] | None = None):
        if not terms or not all(isinstance(t, ParticleLoss) for t in terms):
            raise ArgumentTypeError(f"Sum needs one or more ptn.infer losses (e.g. Sum(OneSampler(n), "
                                    f"SamplerPolicyGradient(n))), got {[type(t).__name__ for t in terms]}")
        w = [1.0] * len(terms) if weights is None else [real(f"weights[{i}]", x) for i, x in enumerate(weights)]
        if len(w) != len(terms):
            raise ConfigError(f"Sum: {len(w)} weights for {len(terms)} terms")
        super().__init__(max(t.num_particles for t in terms))
        self.terms, self.weights = tuple(terms), tuple(w)

    @staticmethod
    def _shares(t: ParticleLoss) -> bool:
        return type(t).surrogate is ParticleLoss.surrogate

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict) -> tuple[jax.Array, jax.Array]:
        """The weighted sum of the terms' ``from_particles`` on one shared batch (every term must share)."""
        if not all(self._shares(t) for t in self.terms):
            raise ConfigError("Sum.from_particles: a term draws its own particles ("
                              f"{[type(t).__name__ for t in self.terms if not self._shares(t)]}); call surrogate")
        value, surr = jnp.zeros(()), jnp.zeros(())
        for t, w in zip(self.terms, self.weights):
            v, s = t.from_particles(log_p, log_q, values)
            value, surr = value + w * v, surr + w * s
        return value, surr

    @per_token
    def surrogate(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                  **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        shared = [t for t in self.terms if self._shares(t)]
        sizes = {t.num_particles for t in shared}
        key, k0 = jax.random.split(rng_key)
        batch = None
        if shared and len(sizes) == 1:
            batch = shared[0].particles(k0, param_map, model, guide, *args, **kwargs)
        value, surr = jnp.zeros(()), jnp.zeros(())
        for t, w in zip(self.terms, self.weights):
            key, kt = jax.random.split(key)
            if batch is not None and self._shares(t):
                v, s = t.from_particles(*batch)
            else:
                v, s = t.surrogate(kt, param_map, model, guide, *args, **kwargs)
            value, surr = value + w * v, surr + w * s
        return value, surr
