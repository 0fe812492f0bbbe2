"""The objectives of active lifting (Section 6) as NumPyro losses for ``numpyro.infer.SVI`` (torch twin:
ppl_thought/training/active.py, whose module docstring derives the estimators).

With Z ~ Q^{<=T}(. | x) and its prefixes Z_<=t (t = 0..T): lp_t = log P^{<=t}(Z_<=t), lq_t = log Q^{<=t}(Z_<=t | x),
lg_t = log G^{<=t}(x | Z_<=t) (``ptn.transforms.ActiveLift``'s prefix quantities, one teacher-forced pass each):

* ``ActiveLifting``: (6.4)-(6.7), min_Q max_P sum_{t=1}^T E[lp_t - lq_t];
* ``MinimumLengthCoding``: (6.10), min_{Q, G} sum_{t=0}^T E[-lg_t] (P fitted to Q_* by (6.6) on the same particles);
* ``GeneratorLoss``: (6.15), min_G sum_t E[-lg_t] with Q fixed;
* ``ActiveGenerative``: (6.16), min_{Q, G} max_P sum_t E[lp_t - lq_t - lg_t];
* ``ConditionalSamplerLoss``: (6.19), E_l E_{Z ~ D(Q)(.|x)}[-log Q^{<=T}(Z | x_<=l)], every l in one pass each.

Q's gradient is the score function with the reward-to-go R_s = sum_{t >= s} r_t and a leave-one-out baseline
(A_s = n/(n-1) (R_s - mean_j R_s^(j))); P's and G's are pathwise (P ascends, G descends).

Parameters. The three LMs' parameters are ``numpyro.param`` sites ``"active/lm/{i}"``, ``"active/prior_lm/{i}"``,
``"active/generator_lm/{i}"`` (one set per distinct LM object: one LM playing all parts, Section 6.6, is one set).
:meth:`ActiveLoss.model` (Z ~ P, X ~ G(. | Z)) and :meth:`ActiveLoss.guide` (Z ~ Q(. | x)) register them, so
``numpyro.infer.SVI(loss.model, loss.guide, optim, loss)`` trains all three; with another model and guide (e.g.
``lift(program)``, ``lift.guide``) the parts missing from ``param_map`` keep the LMs' own weights (no gradient).

Compiled code cannot raise: a batch whose reward is not finite (the torch side's ActiveLiftError) gives loss
``+inf`` and a zero gradient.
"""

from __future__ import annotations

import copy
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro

from ppl_thought.checks import integer
from ppl_thought.errors import ActiveLiftError
from ppl_thought.numpyro.boundary import ArrayLike, checked_jax
from ppl_thought.numpyro.infer.objectives import ParticleLoss, _guard
from ppl_thought.numpyro.params import param_tree
from ppl_thought.numpyro.transforms.active import ActiveLift
from ppl_thought.validation import per_token
from ppl_thought.vocab import PAD_ID

__all__ = ["ActiveGenerative", "ActiveLifting", "ActiveLoss", "ConditionalSamplerLoss", "GeneratorLoss",
           "MinimumLengthCoding"]

ROLES = ("lm", "prior_lm", "generator_lm")


# ---------------------------------------------------------------------------------------------- array core
def _prefix_sums(steps: jax.Array) -> jax.Array:
    """``[..., T]`` per-token log-probabilities -> ``[..., T + 1]`` prefix sums (column 0: the empty prefix)."""
    return jnp.pad(jnp.cumsum(steps, -1), [(0, 0)] * (steps.ndim - 1) + [(1, 0)])


def _reward_to_go(r: jax.Array) -> jax.Array:
    """``[..., T + 1]`` rewards r_t -> ``[..., T]`` R_s = sum_{t >= s} r_t, s = 1..T."""
    return jnp.flip(jnp.cumsum(jnp.flip(r[..., 1:], -1), -1), -1)


def _active_terms(kind: str, lq_steps: jax.Array, lp_steps: jax.Array | None, lg: jax.Array | None,
                  baseline: bool, fit_prior: bool = True) -> tuple[jax.Array, jax.Array]:
    """(value, surrogate) of one objective from ``[n, T]`` log Q / log P steps and ``[n, T + 1]`` log G^{<=t}
    (the torch ``active_terms`` for one observation)."""
    lq = _prefix_sums(lq_steps)
    lp = _prefix_sums(lp_steps) if lp_steps is not None else None
    if kind == "min_max":
        r = lp - lq
    elif kind == "active":
        r = lp - lq - lg
    else:
        r = -lg
    rs = jax.lax.stop_gradient(r)
    ok = jnp.isfinite(rs).all()
    rs = jnp.where(jnp.isfinite(rs), rs, 0.0)
    value = rs.sum(-1).mean()
    surr = jnp.zeros(())
    if kind != "generator":  # Q descends by the score function, reward-to-go
        g = _reward_to_go(rs)
        n = g.shape[0]
        if baseline:
            g = (g - g.mean(0, keepdims=True)) * (n / (n - 1))
        surr = surr + (g * lq_steps).sum(-1).mean()
    if lp is not None:  # P ascends (6.6)
        surr = surr - lp.sum(-1).mean()
    if lg is not None:  # G descends (6.15)
        surr = surr + (-lg).sum(-1).mean()
    return _guard(value, surr, ok)


def _bind(lm: Any, params: Any) -> Any:
    """A shallow copy of ``lm`` reading ``params`` (the caller's LM is unchanged)."""
    out = copy.copy(lm)
    out.params = params
    return out


# ---------------------------------------------------------------------------------------------- the losses
@checked_jax
class ActiveLoss(ParticleLoss):
    """Base of the Section 6 losses: ``num_particles`` Z ~ Q(. | x) drawn by the SVI guide (detached), then the
    prefix quantities of ``lift`` with the parameters of ``param_map``. ``model`` / ``guide`` register them."""

    kind = "min_max"

    def __init__(self, lift: ActiveLift, num_particles: int = 8, baseline: bool = True, prefix: str = "active"):
        if not isinstance(lift, ActiveLift):
            raise ActiveLiftError(f"{type(self).__name__} needs the ptn.transforms.ActiveLift of the model, got "
                                  f"{type(lift).__name__}")
        n = integer("num_particles", num_particles, minimum=1)
        if baseline and n < 2 and self.kind != "generator":
            raise ActiveLiftError(f"{type(self).__name__}(baseline=True) needs num_particles >= 2 (the leave-one-out "
                                  "baseline); pass baseline=False for one particle")
        super().__init__(n)
        self.lift, self.baseline, self.prefix = lift, bool(baseline), str(prefix)
        self._names: dict[str, str] = {}
        for role in ROLES:
            first = next(r for r in ROLES if getattr(lift, r) is getattr(lift, role))
            self._names[role] = f"{self.prefix}/{first}"

    # ------------------------------------------------------------------ parameters
    def _register(self, roles: tuple[str, ...]) -> ActiveLift:
        """``numpyro.param`` sites of the roles' LMs (each distinct LM once); a copy of the lift reading them (every
        role played by a registered LM, e.g. the one LM of Section 6.6, reads the same parameters)."""
        lift = copy.copy(self.lift)
        bound: dict[str, Any] = {}
        for role in roles:
            name = self._names[role]
            if name not in bound:
                m = getattr(self.lift, role)
                bound[name] = _bind(m, param_tree(name, m.params))
        for role in ROLES:
            if self._names[role] in bound:
                setattr(lift, role, bound[self._names[role]])
        return lift

    @per_token
    def bound(self, param_map: Any) -> ActiveLift:
        """A copy of the lift whose LMs read their parameters from ``param_map`` where it holds them."""
        lift = copy.copy(self.lift)
        for role in ROLES:
            m = getattr(self.lift, role)
            leaves, treedef = jax.tree.flatten(m.params)
            keys = [f"{self._names[role]}/{i}" for i in range(len(leaves))]
            if all(k in param_map for k in keys):
                setattr(lift, role, _bind(m, jax.tree.unflatten(treedef, [param_map[k] for k in keys])))
        return lift

    def guide(self, x: ArrayLike, *args: Any, **kwargs: Any) -> Any:
        """The sampler Q as a NumPyro guide with its parameters registered: Z ~ Q^{<=T}(. | x) (6.1)."""
        lift = self._register(("lm",))
        return numpyro.sample(self.lift.latent_site, lift.sampler(x))

    def model(self, x: ArrayLike | None, *args: Any, **kwargs: Any) -> Any:
        """The lifted model (6.13) with P's and G's parameters registered: Z ~ P, X ~ G(. | Z) observed at x."""
        lift = self._register(("prior_lm", "generator_lm"))
        z = numpyro.sample(self.lift.latent_site, lift.prior())
        return numpyro.sample(self.lift.site, lift.generator(z), obs=None if x is None else self.lift._x(x))

    # ------------------------------------------------------------------ the estimator
    @per_token
    def from_latents(self, param_map: Any, z: Any, x: Any) -> tuple[jax.Array, jax.Array]:
        """(value, surrogate) for the latent draws ``z`` ``[n, T]`` of Q(. | x) (detached here)."""
        lift = self.bound(param_map)
        z = jax.lax.stop_gradient(jnp.asarray(z, jnp.int32))
        lq = lift.sampler_log_probs(z, x)
        lp = lift.prior_log_probs(z) if self.kind in ("min_max", "active", "coding") else None
        lg = lift.generator_log_probs(x, z) if self.kind in ("coding", "generator", "active") else None
        return _active_terms(self.kind, lq, lp, lg, self.baseline and self.kind != "generator")

    @per_token
    def surrogate(self, rng_key: Any, param_map: Any, model: Any, guide: Any, x: Any, *args: Any,
                  **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        _, _, values = self.particles(rng_key, param_map, model, guide, x, *args, **kwargs)
        site = self.lift.latent_site
        if site not in values:
            raise ActiveLiftError(f"the guide has no latent site {site!r} (sites {sorted(values)}); use loss.guide "
                                  "or lift.guide")
        return self.from_latents(param_map, values[site].reshape(self.num_particles, -1), x)


@checked_jax
class ActiveLifting(ActiveLoss):
    """The min-max objective (6.4)-(6.7) for one observation x: min_Q max_P sum_{t=1}^T E_{Z ~ Q^{<=T}(.|x)}[
    log P^{<=t}(Z_<=t) - log Q^{<=t}(Z_<=t | x)]; at P = Q_* the t-th term is C_t = -I(X; Z_<=t) (6.5). Q by the
    score function (reward-to-go, leave-one-out baseline), P pathwise (ascends). Value: the estimated sum."""

    kind = "min_max"


@checked_jax
class MinimumLengthCoding(ActiveLoss):
    """The coding objective (6.10), (6.12): min_{Q, G} sum_{t=0}^T E[-log G^{<=t}(x | Z_<=t)], equal to
    sum_t H(X | Z_<=t) at the best G; P is fitted to Q_* by (6.6) on the same particles (not in the value)."""

    kind = "coding"


@checked_jax
class GeneratorLoss(ActiveLoss):
    """The passive generator loss (6.15): min_G sum_{t=0}^T E_{Z ~ D(Q)(.|x)}[-log G^{<=t}(x | Z_<=t)], Q fixed."""

    kind = "generator"

    def __init__(self, lift: ActiveLift, num_particles: int = 8, prefix: str = "active"):
        super().__init__(lift, num_particles, baseline=False, prefix=prefix)


@checked_jax
class ActiveGenerative(ActiveLoss):
    """The active objective (6.16): min_{Q, G} max_P sum_{t=0}^T E[log P^{<=t}(Z_<=t) - log Q^{<=t}(Z_<=t | x)
    - log G^{<=t}(x | Z_<=t)], 2 sum_t C_t + const at the inner optimum (P = Q_*, G = P_*(. | z))."""

    kind = "active"


@checked_jax
class ConditionalSamplerLoss(ActiveLoss):
    """The conditional sampler loss (6.19) for one complete x: E_{l ~ U[1, |x| - 1]} E_{Z ~ D(Q)(.|x)}
    [-log Q^{<=T}(Z | x_<=l)]: Q on proper prefixes imitates its own detached samples on the whole x. The
    expectation over l is exact (one pass per prefix), over Z by ``num_particles`` draws of Q(. | x) (the lift's
    sampler with the parameters of ``param_map``; the SVI model and guide are not run). Needs |x| >= 2."""

    kind = "conditional"

    def __init__(self, lift: ActiveLift, num_particles: int = 8, prefix: str = "active"):
        super().__init__(lift, num_particles, baseline=False, prefix=prefix)

    @per_token
    def from_latents(self, param_map: Any, z: Any, x: Any) -> tuple[jax.Array, jax.Array]:
        lift = self.bound(param_map)
        xi = lift._x(x)
        L = int(np.sum(xi != PAD_ID))
        if L < 2:
            raise ActiveLiftError(f"(6.19) needs |x| >= 2 (a nonempty proper prefix), got |x| = {L}")
        z = jax.lax.stop_gradient(jnp.asarray(z, jnp.int32))
        lq = jnp.stack([lift.sampler_log_probs(z, xi[:m]).sum(-1) for m in range(1, L)])  # the L - 1 prefixes
        loss = -lq.mean()
        return jax.lax.stop_gradient(loss), loss

    @per_token
    def surrogate(self, rng_key: Any, param_map: Any, model: Any, guide: Any, x: Any, *args: Any,
                  **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        z = self.bound(param_map).sampler(x).sample(rng_key, (self.num_particles,))
        return self.from_latents(param_map, z, x)
