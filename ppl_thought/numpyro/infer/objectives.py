"""The paper's training objectives as NumPyro losses for ``numpyro.infer.SVI``, on whole-trace NumPyro models and on
``ptn.Program`` s (torch twin: ppl_thought/training/objectives.py; docs/training.md).

Each loss draws ``num_particles`` latent values from the guide and reads per particle

* ``log_p[i]`` = log p(z_i, x): the model's log joint (gradients to the model's parameters theta), and
* ``log_q[i]`` = log Q(z_i | x): the guide's log-probability (gradients to the guide's parameters psi),

then builds a *surrogate* scalar whose gradient is the paper's estimator (the detach operators U / D are
``jax.lax.stop_gradient``). ``loss`` / ``loss_with_mutable_state`` return ``value + surrogate - U(surrogate)``:
its value is the estimated loss, its gradient the estimator's, which is what ``numpyro.infer.SVI`` differentiates.

On a program (``SVI(program, guide_program, optim, loss)``) the particles are a batch: the program's ``init`` and
its ``max_steps`` steps run once for all n particles inside ``numpyro.plate("particles", n)`` with the engines' step
runner (:func:`ppl_thought.numpyro.infer.steps._run_step`: guide step, model step replayed on it, the program
contract checked while tracing), the step loop unrolled so that reverse-mode differentiation runs through it; a
finished particle's later steps add nothing. A whole-trace model runs one particle per ``vmap`` lane.

``ptn.Program.__call__`` (:func:`ppl_thought.numpyro.program.run_whole_trace`) is the program as one whole-trace
NumPyro model with one particle (step t's sites renamed ``f"{name}_{t}"`` when ``max_steps > 1``), which is what
``SVI.init`` traces for the parameters and what ``ptn.infer.MALA`` / ``ULA`` take the potential from.

Log-weights may be -inf (a proposal outside the model's support): weights are then 0, never NaN. Compiled code cannot
raise, so a policy gradient with a non-finite reward (and no ``invalid_reward=``) reports loss ``+inf`` with a zero
gradient for that batch instead of NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from numpyro.handlers import replay, seed, substitute, trace
from numpyro.infer.elbo import ELBO as _NumPyroELBO

from ppl_thought.checks import integer
from ppl_thought.errors import ConfigError, ProgramError, SiteMismatchError
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.infer.importance import site_log_prob
from ppl_thought.numpyro.infer.resampling import log_mean_exp
from ppl_thought.numpyro.infer.steps import (
    _check_state,
    _freeze,
    _latent,
    _run_step,
    _same_structure,
    _site_log_prob,
    as_programs,
)
from ppl_thought.numpyro.program import is_output, is_program
from ppl_thought.numpyro.transforms.cost import CostAware, latent_lengths
from ppl_thought.validation import per_token

__all__ = ["GRPO", "OneSampler", "ParticleLoss", "R1Zero", "SamplerPolicyGradient", "TwoSampler",
           "program_particles"]


# ---------------------------------------------------------------------------------------------- programs
def _max_steps(program: Any) -> int:
    T = getattr(program, "max_steps", None)
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ProgramError(f"{type(program).__name__}.max_steps = {T!r}: a program run as one trace (SVI, MALA) "
                           "unrolls max_steps steps; set the class attribute max_steps to an integer >= 1")
    return T


def _sum_sites(tr: dict, n: int, depth: int, keep: Callable[[dict], bool]) -> jax.Array:
    total = jnp.zeros(n)
    for s in tr.values():
        if s["type"] == "sample" and keep(s):
            total = total + _site_log_prob(s, n, depth)
    return total


@per_token
def program_particles(rng_key: Any, param_map: dict, model: Any, guide: Any, n: int, args: tuple,
                      kwargs: dict | None = None, *, lengths: bool = False) -> tuple:
    """``(log_p [n], log_q [n], values)`` of n particles of a program and its guide program, as a batch: the
    engines' step runner for init and each of the ``max_steps`` steps (unrolled), parameters substituted from
    ``param_map``; ``values[name]`` is ``[n, T, ...]`` for a step site, ``[n, ...]`` for an init site. With
    ``lengths=True`` a fourth entry: the latent lengths |Z_i| ``[n]`` the model's steps drew (``CostAware``)."""
    kwargs = kwargs or {}
    if guide is None:
        raise SiteMismatchError("the objectives need a guide program that proposes the model's latent sites "
                                "(SVI(program, guide_program, optim, loss))")
    model, guide, args, _ = as_programs(model, guide, tuple(args), "SVI")
    if not is_program(guide):
        raise SiteMismatchError(f"SVI: the guide of a ptn.Program must be a ptn.Program with the same steps and latent "
                                f"sites, got {type(guide).__name__}")
    T = _max_steps(model)
    depth = max(int(getattr(model, "max_plate_nesting", 0) or 0), int(getattr(guide, "max_plate_nesting", 0) or 0))
    name = type(model).__name__
    traces: dict = {}

    def recorded(fn, who):
        def f():
            with trace() as tr:
                out = fn()
            traces[who] = tr
            return out
        return f

    drawn = [jnp.zeros(n)]

    def one(model_fn, guide_fn, key, where, finished=None):
        out = _run_step(recorded(model_fn, "model"), recorded(guide_fn, "guide"), key, n, depth, where, name)
        lp = _sum_sites(traces["model"], n, depth, lambda s: not is_output(s))
        lq = _sum_sites(traces["guide"], n, depth, lambda s: not s["is_observed"])
        if lengths:  # |Z_i| of the latent segments / tokens this step drew (CostAware)
            ln = latent_lengths(traces["model"], n)
            drawn[0] = drawn[0] + (ln if finished is None else jnp.where(finished, 0.0, ln))
        return out, lp, lq

    sm: dict = {}
    sg: dict = {}
    with substitute(data=param_map):
        key, k0 = jax.random.split(rng_key)
        out, log_p, log_q = one(lambda: model.init(sm, *args, **kwargs), lambda: guide.init(sg, *args, **kwargs),
                                k0, "in init")
        _check_state(sm, n, name)
        _check_state(sg, n, f"the guide {type(guide).__name__}")
        values = dict(out.values)
        finished = jnp.zeros(n, bool) if out.done is None else out.done
        steps: list = []
        for t in range(T):
            key, kt = jax.random.split(key)
            sm2, sg2 = jax.tree.map(lambda a: a, sm), jax.tree.map(lambda a: a, sg)
            tt = jnp.int32(t)
            out, lp, lq = one(lambda sm2=sm2, tt=tt: model.step(sm2, tt, *args, **kwargs),
                              lambda sg2=sg2, tt=tt: guide.step(sg2, tt, *args, **kwargs), kt, "in step", finished)
            _same_structure(sm, sm2, name, "model")
            _same_structure(sg, sg2, "the guide", "guide")
            log_p = log_p + jnp.where(finished, 0.0, lp)
            log_q = log_q + jnp.where(finished, 0.0, lq)
            steps.append(out.values)
            sm, sg = _freeze(finished, sm, sm2), _freeze(finished, sg, sg2)
            finished = finished if out.done is None else finished | out.done
    for k in steps[0]:
        values[k] = jnp.stack([s[k] for s in steps], axis=1)
    return (log_p, log_q, values, drawn[0]) if lengths else (log_p, log_q, values)


def _whole_trace_particles(rng_key, param_map, model, guide, n, args, kwargs, lengths=False):
    """Particles of a whole-trace model and guide: one trace per particle, vmapped (``lengths``: as
    :func:`program_particles`)."""

    def one(key):
        kq, kp = jax.random.split(key)
        g_tr = trace(substitute(seed(guide, kq), data=param_map)).get_trace(*args, **kwargs)
        m_tr = trace(replay(substitute(seed(model, kp), data=param_map), trace=g_tr)).get_trace(*args, **kwargs)
        log_q = sum((site_log_prob(s) for s in g_tr.values() if s["type"] == "sample" and not s["is_observed"]),
                    jnp.zeros(()))
        log_p = sum((site_log_prob(s) for s in m_tr.values() if s["type"] == "sample" and not is_output(s)),
                    jnp.zeros(()))
        values = {k: s["value"] for k, s in g_tr.items() if s["type"] == "sample" and _latent(s)}
        return (log_p, log_q, values) + ((latent_lengths(m_tr, 1)[0],) if lengths else ())

    return jax.vmap(one)(jax.random.split(rng_key, n))


# ---------------------------------------------------------------------------------------------- helpers
def _cost_aware(model: Any) -> Any:
    """The ``ptn.transforms.CostAware`` a model is transformed by (``CostAware(w)(program)``, a bound
    ``CostAware(w)(model)``, or inside a composition), else ``None``."""
    for _ in range(32):
        if model is None:
            return None
        if isinstance(model, CostAware):
            return model
        d = getattr(model, "__dict__", {})
        if isinstance(d.get("transform"), CostAware):
            return d["transform"]
        model = d.get("inner", d.get("fn"))
    return None


def _normalized(log_w: jax.Array) -> jax.Array:
    """softmax(log_w); all zero (never NaN) when every weight is zero."""
    lse = jax.nn.logsumexp(log_w)
    return jnp.where(jnp.isfinite(lse), jnp.exp(log_w - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)


def _weighted(coef: jax.Array, logp: jax.Array) -> jax.Array:
    """sum_i U(coef_i) logp_i; a -inf log p (or a coefficient 0) contributes 0, not NaN."""
    coef = jax.lax.stop_gradient(coef)
    ok = jnp.isfinite(logp) & (coef != 0)
    return jnp.sum(jnp.where(ok, coef * jnp.where(ok, logp, 0.0), 0.0))


def _finite(r: jax.Array, invalid: float | None) -> tuple[jax.Array, jax.Array]:
    """(rewards with non-finite entries replaced by ``invalid`` (else 0), whether the batch is usable)."""
    ok = jnp.isfinite(r)
    if invalid is not None:
        return jnp.where(ok, r, invalid), jnp.ones((), bool)
    return jnp.where(ok, r, 0.0), ok.all()


def _guard(value: jax.Array, surrogate: jax.Array, ok: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A batch with a non-finite reward: loss +inf, zero gradient (compiled code cannot raise)."""
    return jnp.where(ok, value, jnp.inf), jnp.where(ok, surrogate, 0.0)


# ---------------------------------------------------------------------------------------------- base
@checked_jax
class ParticleLoss(_NumPyroELBO):
    """Base of the losses: particles from programs or whole-trace models, and a surrogate (module docstring).

    Subclasses implement :meth:`from_particles`. Args: ``num_particles`` n (a batch dimension)."""

    can_infer_discrete = True
    min_particles = 1

    def __init__(self, num_particles: int = 8):
        n = integer("num_particles", num_particles, minimum=1)
        if n < self.min_particles:
            raise ConfigError(f"{type(self).__name__} needs num_particles >= {self.min_particles}, got {n}")
        super().__init__(num_particles=n)

    @per_token
    def particles(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                  **kwargs: Any) -> tuple[jax.Array, jax.Array, dict]:
        """``(log p(z, x) [n], log Q(z | x) [n], guide values)`` for ``num_particles`` draws of the guide."""
        return self._particles(rng_key, param_map, model, guide, args, kwargs, False)

    def _particles(self, rng_key: Any, param_map: Any, model: Any, guide: Any, args: tuple, kwargs: dict,
                   lengths: bool) -> tuple:
        """:meth:`particles`, with the latent lengths |Z_i| as a fourth entry when ``lengths``."""
        if is_program(model) or (guide is not None and is_program(guide)) or (
                not callable(model) and callable(getattr(model, "as_program", None))):
            return program_particles(rng_key, param_map, model, guide, self.num_particles, args, kwargs,
                                     lengths=lengths)
        return _whole_trace_particles(rng_key, param_map, model, guide, self.num_particles, args, kwargs, lengths)

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict) -> tuple[jax.Array, jax.Array]:
        """(value of the estimated loss, surrogate whose gradient is the estimator)."""
        raise NotImplementedError

    @per_token
    def surrogate(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                  **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        log_p, log_q, values = self.particles(rng_key, param_map, model, guide, *args, **kwargs)
        return self.from_particles(log_p, log_q, values)

    def _cost_aware_surrogate(self, cost: Any, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                             **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        """The cost-aware loss (5.27) of a model transformed by ``ptn.transforms.CostAware`` (the torch
        ``CostAware.surrogate``): this loss's value L_n is the cross-entropy estimate C_s = L_n - H~(P_*), and
        fresh particles give T_s = mean tau(|Z_i|) and T~*_s (:meth:`CostAware.estimate`); value C_s T_s,
        gradient T_s grad L_n + C_s grad T~*_s."""
        k1, k2 = jax.random.split(rng_key)
        value_c, surr_c = self.surrogate(k1, param_map, model, guide, *args, **kwargs)
        cost_kwargs = {k: v for k, v in kwargs.items() if k != "sequences"}
        log_p, log_q, _, lengths = self._particles(k2, param_map, model, guide, args, cost_kwargs, True)
        log_w = jnp.where(jnp.isneginf(log_p), -jnp.inf, log_p - log_q)
        return cost.loss(value_c, surr_c, log_p, log_w, lengths)

    @per_token
    def loss_with_mutable_state(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                                **kwargs: Any) -> dict[str, Any]:
        cost = _cost_aware(model)
        if cost is not None:
            value, surr = self._cost_aware_surrogate(cost, rng_key, param_map, model, guide, *args, **kwargs)
            value = jax.lax.stop_gradient(value)
            return {"loss": value + surr - jax.lax.stop_gradient(surr), "mutable_state": None}
        value, surr = self.surrogate(rng_key, param_map, model, guide, *args, **kwargs)
        value = jax.lax.stop_gradient(value)
        return {"loss": value + surr - jax.lax.stop_gradient(surr), "mutable_state": None}


# ---------------------------------------------------------------------------------------------- objectives
@checked_jax
class OneSampler(ParticleLoss):
    """The one-sampler loss (3.17) / (5.20): value -log p_n, p_n = (1/n) sum_i P(Z_i) / U(Q)(Z_i | x); gradient
    -sum_i w_i grad_theta log P(Z_i), w the self-normalised weights (detached). Trains the model only."""

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict) -> tuple[jax.Array, jax.Array]:
        log_w = jax.lax.stop_gradient(log_p - log_q)
        return -log_mean_exp(log_w), -_weighted(_normalized(log_w), log_p)


@checked_jax
class TwoSampler(ParticleLoss):
    """The two-sampler loss (3.23) / (5.21): the SVI guide Q in the denominator, ``train_guide`` Q^boxminus in the
    numerator: gradient -[(1/n) sum_i q•_i grad log P(Z•_i)] / p_n, q•_i = P(Z•_i) / Q^boxminus(Z•_i | x),
    Z•_i ~ Q^boxminus, p_n = (1/n) sum_i P(Z_i) / Q(Z_i | x), Z_i ~ Q, both detached. Value -log p_n."""

    def __init__(self, train_guide: Any, num_particles: int = 8):
        super().__init__(num_particles)
        self.train_guide = train_guide

    @per_token
    def surrogate(self, rng_key: Any, param_map: Any, model: Any, guide: Any, *args: Any,
                  **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        k1, k2 = jax.random.split(rng_key)
        lp, lq, _ = self.particles(k1, param_map, model, guide, *args, **kwargs)
        log_pn = log_mean_exp(jax.lax.stop_gradient(lp - lq))
        tp, tq, _ = self.particles(k2, param_map, model, self.train_guide, *args, **kwargs)
        coef = jnp.exp(jax.lax.stop_gradient(tp - tq) - jnp.log(self.num_particles) - log_pn)
        coef = jnp.where(jnp.isfinite(log_pn) & jnp.isfinite(coef), coef, 0.0)
        return -log_pn, -_weighted(coef, tp)


@checked_jax
class SamplerPolicyGradient(ParticleLoss):
    """The sampler loss (3.25) / (5.24): L = -1/(n-1) sum_i U(A_i) log Q(Z_i | x), A_i = R_i - mean_j R_j,
    R_i = log P(Z_i) - log Q(Z_i | x): unbiased for grad_psi KL(Q || Q_*); value -mean R (unbiased for
    KL(Q || Q_*) - log p(x)). Trains the guide only; n >= 2. ``invalid_reward`` replaces non-finite rewards."""

    min_particles = 2

    def __init__(self, num_particles: int = 8, invalid_reward: float | None = None):
        super().__init__(num_particles)
        self.invalid_reward = invalid_reward

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict) -> tuple[jax.Array, jax.Array]:
        r, ok = _finite(jax.lax.stop_gradient(log_p - log_q), self.invalid_reward)
        a = r - r.mean()
        return _guard(-r.mean(), -jnp.sum(a * log_q) / (log_p.shape[0] - 1), ok)


@checked_jax
class R1Zero(ParticleLoss):
    """R1-Zero with a prescribed response, (5.14) + (5.15): with R_i = U(log P(z_i, x) - log Q(z_i | x)),
    surrogate -(1/n) sum_i [log P(z_i, x) - log Q(z_i | x)] - (1/n) sum_i R_i log Q(z_i | x) (``baseline=True``:
    -1/(n-1) sum_i (R_i - mean R) log Q(z_i | x)); value -mean R."""

    def __init__(self, num_particles: int = 1, baseline: bool = False):
        self.min_particles = 2 if baseline else 1
        super().__init__(num_particles)
        self.baseline = bool(baseline)

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict) -> tuple[jax.Array, jax.Array]:
        r, ok = _finite(jax.lax.stop_gradient(log_p - log_q), None)
        n = log_p.shape[0]
        pg = -jnp.sum((r - r.mean()) * log_q) / (n - 1) if self.baseline else -jnp.mean(r * log_q)
        ratio = jnp.where(ok, log_p - log_q, 0.0)
        return _guard(-r.mean(), -jnp.mean(ratio) + pg, ok)


@checked_jax
class GRPO(ParticleLoss):
    """The one-sampler loss with relaxed targets (5.17) and GRPO's group advantages (5.18), per sequence:
    rho_i = pi_theta(Z_i) / U(pi_old(Z_i)) (model over guide), L = -(1/n) sum_i min(rho_i A_i,
    clip(rho_i, 1 - eps, 1 + eps) A_i) with A = (r - mean r) / (std r + eps) (``advantage="group"``, population
    std) or r / U(p_n), p_n = mean r (``"ratio"``; 0 where p_n = 0). ``reward(values[site]) -> [n]``; value -mean r."""

    min_particles = 2

    def __init__(self, reward: Callable, num_particles: int = 8, clip_eps: float | None = 0.2,
                 advantage: str = "group", eps: float = 1e-6, site: str = "z"):
        if advantage not in ("group", "ratio"):
            raise ConfigError(f"advantage must be 'group' (5.18) or 'ratio' (5.17), got {advantage!r}")
        if clip_eps is not None and not 0 < clip_eps < 1:
            raise ConfigError(f"clip_eps must lie in (0, 1) or be None, got {clip_eps}")
        super().__init__(num_particles)
        self.reward, self.clip_eps, self.advantage, self.eps, self.site = reward, clip_eps, advantage, eps, site

    def advantages(self, r: jax.Array) -> jax.Array:
        """(5.18) or (5.17)'s advantages of a group of rewards ``[n]``."""
        if self.advantage == "group":
            # equal rewards: exactly 0 (max == min; the compiled mean of equal floats may differ from them by an ulp,
            # which / eps made advantages of up to 0.1, torch's group_advantages)
            return jnp.where(r.max() > r.min(), (r - r.mean()) / (r.std() + self.eps), 0.0)
        p_n = r.mean()
        return jnp.where(p_n != 0, r / jnp.where(p_n != 0, p_n, 1.0), 0.0)

    @per_token
    def from_particles(self, log_p: jax.Array, log_q: jax.Array, values: dict) -> tuple[jax.Array, jax.Array]:
        if self.site not in values:
            raise SiteMismatchError(f"GRPO: the guide has no site {self.site!r} (sites: {sorted(values)}); pass "
                                    "site= naming the latent the reward reads")
        n = log_p.shape[0]
        r = jax.lax.stop_gradient(jnp.asarray(self.reward(values[self.site]), log_p.dtype))
        if r.shape != (n,):
            raise ProgramError(f"GRPO: reward must return one value per particle, shape ({n},), got {r.shape}")
        r, ok = _finite(r, None)
        a = self.advantages(r)
        log_rho = log_p - jax.lax.stop_gradient(log_q)
        ok = ok & jnp.isfinite(jax.lax.stop_gradient(log_rho)).all()
        rho = jnp.exp(jnp.where(jnp.isfinite(log_rho), log_rho, 0.0))
        obj = rho * a
        if self.clip_eps is not None:
            obj = jnp.minimum(obj, jnp.clip(rho, 1 - self.clip_eps, 1 + self.clip_eps) * a)
        return _guard(-r.mean(), -obj.mean(), ok)
