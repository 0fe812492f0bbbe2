"""Training objectives of Sections 3.4 and 5.3 as :class:`pyro.infer.ELBO` subclasses.

Every objective draws ``num_particles`` latent sequences from the guide in ONE batched call
under a Pyro particle plate (``pyro.plate("particles", n, dim=-max_plate_nesting - 1)``), replays
the model on them and reads per-particle log-probabilities from the two traces:

* ``log_p[i]`` = log p(z_i, x): the model's log joint over all its sample sites (for
  :class:`~ppl_thought.models.SlowThinking`: log P_f^{<=|z|}(z) + log 1{Proj(z) = x}); it carries
  gradients to the parameters theta of P (``LMSequence.log_prob`` is teacher-forced);
* ``log_q[i]`` = log Q(z_i | x): the guide's log-probability, with gradients to the sampler's psi.

Each objective then builds a *surrogate* scalar whose autograd gradient is the estimator of the
paper, with the detach operators (written D / U / boxplus in the text) implemented by
``.detach()``. ``loss`` returns the value of the estimated loss (not of the surrogate);
``loss_and_grads`` also back-propagates the surrogate, so the objectives run under
``pyro.infer.SVI`` as well as under :class:`~ppl_thought.training.trainer.Trainer`.

Log-weights may be ``-inf`` (a particle outside the model's support); weights are then 0 and
never NaN. Rewards that must be finite (policy gradients) raise a ValueError naming the problem.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import ELBO

from ppl_thought import checks
from ppl_thought.errors import (
    ArgumentTypeError,
    ConfigError,
    MalformedSequenceError,
    NumericalError,
    ProgramError,
    SiteMismatchError,
)
from ppl_thought.inference.particles import (
    PARTICLES,
    Particles,
    find_max_plate_nesting,
    per_particle,
    sample_particles,
)
from ppl_thought.lm.base import as_id_batch
from ppl_thought.validation import ArrayLike, checked
from ppl_thought.weights import effective_sample_size, log_mean_exp

__all__ = [
    "GRPO",
    "SFT",
    "Inquisitive",
    "OneSampler",
    "ParticleObjective",
    "Particles",
    "R1Zero",
    "SamplerPolicyGradient",
    "SeparatePolicy",
    "Sum",
    "TwoSampler",
    "group_advantages",
    "per_sample_grad_norms",
]


# ---------------------------------------------------------------------------------------- helpers
def _normalized(log_w: torch.Tensor) -> torch.Tensor:
    """Self-normalised weights softmax(log_w); all zero (never NaN) when every weight is zero."""
    lse = torch.logsumexp(log_w, 0)
    w = torch.exp(log_w - lse)
    return torch.where(torch.isfinite(lse), w, torch.zeros_like(w))


def _weighted(coef: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """sum_i coef_i * logp_i with coef detached and -inf entries (coef 0) contributing 0, not NaN."""
    coef = coef.detach()
    finite = torch.isfinite(logp) & (coef != 0)
    return (coef * logp.masked_fill(~finite, 0.0)).masked_fill(~finite, 0.0).sum()


def _finite_rewards(r: torch.Tensor, what: str) -> torch.Tensor:
    if not torch.isfinite(r).all():
        bad = (~torch.isfinite(r)).nonzero().flatten()[:5].tolist()
        raise NumericalError(
            f"{what} is not finite for particles {bad} (values {r[bad].tolist()}): the sampler proposes z "
            "outside the support of the model (log p = -inf) or the reward is NaN/inf. Check that the guide "
            "is supported on the lifting of x, or pass invalid_reward= to replace such rewards"
        )
    return r


@checked
def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (5.18): A_i = (r_i - mean(r)) / (std(r) + eps), over the last dim.

    ``std`` is the population standard deviation (the (5.18) text does not say which); a group
    with equal rewards gets advantages exactly 0 (decided by max == min: the mean of equal floats is not always
    the value itself, e.g. seven 0.1s in float32, and that rounding divided by eps gave advantages of 0.007-0.1).
    """
    r = torch.as_tensor(rewards, dtype=torch.get_default_dtype())
    if r.ndim == 0 or r.shape[-1] < 2:
        raise ConfigError(f"group_advantages needs a group of at least 2 rewards, got shape {tuple(r.shape)}")
    _finite_rewards(r, "reward")
    centred = r - r.mean(-1, keepdim=True)
    spread = r.amax(-1, keepdim=True) > r.amin(-1, keepdim=True)
    return torch.where(spread, centred / (r.std(-1, correction=0, keepdim=True) + eps), torch.zeros_like(centred))


def per_sample_grad_norms(log_p: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """||grad_theta log p_i|| for every particle i, ``[n]`` (the norm in (3.22), (3.26)).

    One batched backward (``is_grads_batched``, vmap over the rows of the identity) instead of a
    loop over particles; falls back to one backward per particle only where vmap is unsupported.
    Particles with log p = -inf get norm 0.
    """
    params = [p for p in params if p.requires_grad]
    n = log_p.shape[0]
    if not params or not log_p.requires_grad:
        raise ConfigError("per-sample gradient norms need log p with a graph to parameters that require grad")
    eye = torch.eye(n, dtype=log_p.dtype, device=log_p.device)
    try:
        grads = torch.autograd.grad(log_p, params, grad_outputs=eye, is_grads_batched=True,
                                    retain_graph=True, allow_unused=True)
        sq = sum(g.reshape(n, -1).pow(2).sum(-1) for g in grads if g is not None)
    except RuntimeError:  # an op without a batching rule: one backward per particle
        rows = []
        for i in range(n):
            gi = torch.autograd.grad(log_p[i], params, retain_graph=True, allow_unused=True)
            rows.append(sum(g.pow(2).sum() for g in gi if g is not None))
        sq = torch.stack([torch.as_tensor(r, dtype=log_p.dtype) for r in rows])
    sq = torch.as_tensor(sq, dtype=log_p.dtype)
    sq = torch.where(torch.isfinite(sq), sq, torch.zeros_like(sq))
    return sq.sqrt().detach()


# ---------------------------------------------------------------------------------------- base
@checked
class ParticleObjective(ELBO):
    """Base of the objectives: vectorised particles plus a surrogate whose gradient is the estimator.

    Args:
        num_particles: n, the number of latent samples per observation (a batch dimension).
        max_plate_nesting: plates the model and guide use themselves; the particle plate sits left of them.

    Subclasses implement :meth:`from_particles` (or :meth:`surrogate`). ``last_stats`` holds
    diagnostics of the last call (ESS, mean reward, ...), read by the Trainer.
    """

    min_particles = 1
    needs_grad_for_value = False

    def __init__(self, num_particles: int = 8, max_plate_nesting: int | None = None):
        if num_particles < self.min_particles:
            raise ConfigError(f"{type(self).__name__} needs num_particles >= {self.min_particles} (an int), "
                             f"got {num_particles!r}")
        if max_plate_nesting is not None and max_plate_nesting < 0:
            raise ConfigError(f"max_plate_nesting must be >= 0, got {max_plate_nesting}")
        # Pyro's ELBO adds one to max_plate_nesting when it vectorises itself; we place the plate ourselves.
        self._given_nesting = max_plate_nesting is not None
        self._found_nesting: dict = {}
        super().__init__(num_particles=num_particles, max_plate_nesting=max_plate_nesting or 0,
                         vectorize_particles=False)
        self.vectorize_particles = True
        self.last_stats: dict[str, float] = {}

    # pyro.infer.ELBO declares this abstract; our traces are built in `particles`.
    def _get_trace(self, model, guide, args, kwargs):  # pragma: no cover - not used
        raise NotImplementedError("ParticleObjective builds its traces in .particles()")

    def _in_plate(self, fn: Callable, n: int, depth: int) -> Callable:
        def wrapped(*args, **kwargs):
            with pyro.plate(PARTICLES, n, dim=-depth - 1):
                return fn(*args, **kwargs)
        return wrapped

    def particles(self, model: Callable | None, guide: Callable | None, *args, num_particles: int | None = None,
                  **kwargs) -> Particles:
        """Sample n particles from ``guide`` in one batched call and score them under ``model``
        (:func:`~ppl_thought.inference.particles.sample_particles`, with the site check)."""
        n = int(num_particles or self.num_particles)
        if guide is None:
            raise SiteMismatchError("the objectives need a guide that proposes the model's latent sites")
        depth = self.plate_nesting(model, guide, args, kwargs)
        return sample_particles(model, guide, n, *args, max_plate_nesting=depth, **kwargs)

    def plate_nesting(self, model: Callable[..., Any] | None, guide: Callable[..., Any] | None, args: tuple = (),
                      kwargs: dict | None = None) -> int:
        """``max_plate_nesting`` as given, else as declared by model and guide (every library model and
        guide declares it), else found by tracing them once (cached per model and guide)."""
        if self._given_nesting:
            return int(self.max_plate_nesting)
        key = (id(model), id(guide))
        if key not in self._found_nesting:
            with torch.no_grad():
                self._found_nesting[key] = find_max_plate_nesting(model, guide, args, kwargs or {})
        return self._found_nesting[key]

    # ------------------------------------------------------------------ the estimator
    def from_particles(self, pt: Particles, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss value, surrogate) from one batch of particles."""
        raise NotImplementedError

    def surrogate(self, model: Callable | None, guide: Callable | None, *args,
                  **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """(value of the estimated loss, surrogate scalar whose gradient is the estimator)."""
        return self.from_particles(self.particles(model, guide, *args, **kwargs), *args, **kwargs)

    # ------------------------------------------------------------------ pyro.infer.ELBO API
    def loss(self, model: Callable | None, guide: Callable | None, *args, **kwargs) -> float:
        """The estimated loss (no gradients)."""
        ctx = torch.enable_grad() if self.needs_grad_for_value else torch.no_grad()
        with ctx:
            value, _ = self.model_surrogate(model, guide, *args, **kwargs)
        return float(value)

    def model_surrogate(self, model: Callable | None, guide: Callable | None, *args,
                        **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`surrogate`, or the cost-aware loss (5.27) of a model transformed by
        :class:`~ppl_thought.transforms.CostAware` (this objective's loss as the cross-entropy estimate)."""
        cost = getattr(model, "cost_aware", None)
        if cost is not None:
            return cost.surrogate(self, model, guide, *args, **kwargs)
        return self.surrogate(model, guide, *args, **kwargs)

    def differentiable_loss(self, model: Callable | None, guide: Callable | None, *args, **kwargs) -> torch.Tensor:
        """The surrogate (its gradient is the estimator; its value is not the loss)."""
        return self.model_surrogate(model, guide, *args, **kwargs)[1]

    def loss_and_grads(self, model: Callable | None, guide: Callable | None, *args, **kwargs) -> float:
        """The estimated loss; back-propagates the surrogate into every parameter it reaches."""
        value, surr = self.model_surrogate(model, guide, *args, **kwargs)
        if surr.requires_grad:
            surr.backward()
        return float(value)


# ---------------------------------------------------------------------------------------- latent P
@checked
class OneSampler(ParticleObjective):
    """The one-sampler loss (3.17) / (5.20) for the latent distribution P_f.

    L_n = -log( (1/n) sum_i P_f(Z_i) / U(Q)(Z_i | x) ), Z_i ~ Q(. | x) i.i.d., whose gradient is
    -sum_i w_i grad_theta log P_f(Z_i) with the self-normalised weights w_i = q_i / sum_j q_j,
    q_i = P_f(Z_i) / Q(Z_i | x). The sampler Q is detached (U in (5.20)): this loss trains P only.
    As n grows the gradient converges to grad_theta(-log (Proj # P_f)(x)) = v_* of (3.21). The value
    returned is -log p_n, the estimate of -log (Proj # P)(x) (``+inf`` if every weight is zero).
    """

    def from_particles(self, pt: Particles, *args, **kwargs):
        log_w = pt.log_w
        w = _normalized(log_w)
        value = -log_mean_exp(log_w, 0)
        self.last_stats = {"ess": float(effective_sample_size(log_w, 0, check=False)), "log_marginal": float(-value)}
        return value, -_weighted(w, pt.log_p)


@checked
class TwoSampler(ParticleObjective):
    """The two-sampler loss (3.23) / (5.21): inference sampler Q (the SVI guide) in the denominator,
    train sampler Q^boxminus (``train_guide``) in the numerator.

    v_n = -[(1/n) sum_i q•_i grad log P_f(Z•_i)] / [(1/n) sum_i q_i], q_i = P_f(Z_i)/Q(Z_i|x) with
    Z_i ~ Q, q•_i = P_f(Z•_i)/Q^boxminus(Z•_i|x) with Z•_i ~ Q^boxminus, both detached except the
    log P_f factor (the D in (3.16)). Reading of (5.21): it is printed without the log of P_f in
    the numerator; only its gradient -U(p_n)^{-1} (1/n) sum_i q•_i grad log P_f(Z•_i) matches (3.23),
    so that is what is implemented. With Q^boxminus = Q and shared samples it reduces to (3.17).
    The value returned is -log p_n from the inference sampler. Both samplers draw n particles.
    """

    def __init__(self, train_guide: Callable, num_particles: int = 8, max_plate_nesting: int | None = None):
        super().__init__(num_particles, max_plate_nesting)
        self.train_guide = train_guide

    def surrogate(self, model: Callable[..., Any] | None, guide: Callable[..., Any] | None, *args: Any, **kwargs: Any):
        with torch.no_grad():
            inf = self.particles(model, guide, *args, **kwargs)
        tr = self.particles(model, self.train_guide, *args, **kwargs)
        log_pn = log_mean_exp(inf.log_w, 0)
        coef = torch.exp(tr.log_w - math.log(tr.n) - log_pn)  # q•_i / (n p_n)
        ok = torch.isfinite(log_pn) & torch.isfinite(coef)
        coef = torch.where(ok, coef, torch.zeros_like(coef))
        self.last_stats = {"ess": float(effective_sample_size(inf.log_w, 0, check=False)),
                           "ess_train": float(effective_sample_size(tr.log_w, 0, check=False)),
                           "log_marginal": float(log_pn)}
        return -log_pn, -_weighted(coef, tr.log_p)


@checked
class SFT(ParticleObjective):
    """Supervised next-token loss: -(1/B) sum_b log p(z_b, x), teacher-forced (the SFT baseline, App. L).

    ``loss(model, guide, *args, sequences=z)`` with ``z`` ``[B, L]`` (or 1-D) right-padded values of
    the site ``site``: the model is conditioned on them under the particle plate (B rows at once).
    Without ``sequences`` the rows are drawn from the guide and detached: the mini-batch loss
    (5.25), L_1^(n) = -(1/n) sum_i log P_f(Y_i x_r), Y_i ~ Q(. | x x_r). Sequences the model gives
    probability 0 raise a ValueError (they cannot be fitted).
    """

    def __init__(self, num_particles: int = 1, site: str = "z", max_plate_nesting: int | None = None):
        super().__init__(num_particles, max_plate_nesting)
        self.site = site

    def surrogate(self, model: Callable[..., Any] | None, guide: Callable[..., Any] | None, *args: Any,
                  sequences: ArrayLike | None = None, **kwargs: Any):
        if sequences is None:
            pt = self.particles(model, guide, *args, **kwargs)
            log_p = pt.log_p
        else:
            seq = as_id_batch(sequences, "SFT sequences")
            if seq.shape[0] == 0:
                raise MalformedSequenceError(f"SFT sequences must be [B, L] with B >= 1, got shape {tuple(seq.shape)}")
            depth = self.plate_nesting(model, None, args, kwargs)
            conditioned = poutine.condition(self._in_plate(model, seq.shape[0], depth), data={self.site: seq})
            tr = poutine.trace(conditioned).get_trace(*args, **kwargs)
            if self.site not in tr.nodes:
                raise SiteMismatchError(f"the model has no site {self.site!r} to fit the sequences to")
            tr.compute_log_prob()
            log_p = per_particle(tr, seq.shape[0])
            if not torch.isfinite(log_p).all():
                bad = (~torch.isfinite(log_p)).nonzero().flatten()[:5].tolist()
                raise ConfigError(f"SFT sequences {bad} have probability 0 under the model (outside its support, "
                                 "or inconsistent with the observation)")
        value = -log_p.detach().mean()
        return value, -log_p.mean()


@checked
class R1Zero(ParticleObjective):
    """R1-Zero with a prescribed response: (5.14) for P_f plus (5.15) for the identity sampler.

    The guide is the identity sampler Q_id = P_f(. | x -> T) (it shares P_f's parameters). With
    R_i = log p(z_i, x) - log Q_id(z_i | x) = log P_f(x_r | x Y_i) (the thought factor cancels),
    the surrogate is

        -(1/n) sum_i [log p(z_i, x) - log Q(z_i | x)]      (5.14): -log P_f(x_r | x Y_i), grads through both
        -(1/n) sum_i U(R_i) log Q(z_i | x)                  (5.15): policy gradient of the thought.

    Reading of (5.15): "min U(-log P_f(x_r|xY)) . log P_f(Y|x)" = min -U(R) log P_f(Y|x), the n = 1
    case of L_n = -(1/n) sum U(R_i) log Q_id(Y_i|x). ``baseline=True`` subtracts the group mean
    and uses 1/(n-1) as in (3.25) (unbiased, lower variance); the paper's R1-Zero has none.
    The value returned is -(1/n) sum_i R_i.
    """

    def __init__(self, num_particles: int = 1, baseline: bool = False, max_plate_nesting: int | None = None):
        self.min_particles = 2 if baseline else 1
        super().__init__(num_particles, max_plate_nesting)
        self.baseline = baseline

    def from_particles(self, pt: Particles, *args, **kwargs):
        r = _finite_rewards(pt.log_w, "R1-Zero reward log P_f(x_r | x Y)")
        log_ratio = pt.log_p - pt.log_q
        if self.baseline:
            pg = -((r - r.mean()) * pt.log_q).sum() / (pt.n - 1)
        else:
            pg = -(r * pt.log_q).mean()
        self.last_stats = {"reward": float(r.mean())}
        return -r.mean(), -log_ratio.mean() + pg


# ---------------------------------------------------------------------------------------- samplers
@checked
class SamplerPolicyGradient(ParticleObjective):
    """The sampler loss (3.25) / (5.24): policy gradient of the reverse KL(Q(.|x) || Q_*(.|x)).

    L = -1/(n-1) sum_i U(A_i) log Q(Z_i | x), A_i = R_i - (1/n) sum_j R_j,
    R_i = log P(Z_i) / Q(Z_i | x), Z_i ~ Q(. | x). Its gradient is unbiased for grad_psi KL(Q || Q_*):
    R_i - mean_j R_j = (n-1)/n (R_i - mean_{j != i} R_j), a leave-one-out baseline. Trains Q only (P
    is detached). The value returned is -(1/n) sum_i R_i, an unbiased estimate of
    KL(Q || Q_*) - log (Proj # P)(x). Needs n >= 2. Rewards must be finite (``invalid_reward``
    replaces non-finite ones instead of raising).
    """

    min_particles = 2

    def __init__(self, num_particles: int = 8, invalid_reward: float | None = None,
                 max_plate_nesting: int | None = None):
        super().__init__(num_particles, max_plate_nesting)
        self.invalid_reward = invalid_reward

    def rewards(self, pt: Particles) -> torch.Tensor:
        """R_i of (3.25)."""
        return pt.log_w

    def _clean(self, r: torch.Tensor, what: str) -> torch.Tensor:
        if self.invalid_reward is not None:
            return torch.where(torch.isfinite(r), r, torch.full_like(r, float(self.invalid_reward)))
        return _finite_rewards(r, what)

    def from_particles(self, pt: Particles, *args, **kwargs):
        r = self._clean(self.rewards(pt).detach(), "sampler reward R = log P/Q")
        a = r - r.mean()
        self.last_stats = {"reward": float(r.mean()), "ess": float(effective_sample_size(pt.log_w, 0, check=False))}
        return -r.mean(), -(a * pt.log_q).sum() / (pt.n - 1)


@checked
class Inquisitive(SamplerPolicyGradient):
    """The train sampler Q^boxminus trained towards the inquisitive sampler Q_• (3.22) by (3.25)
    with the reward (3.26): R•_i = log P_f(Z•_i) + log ||grad_theta log P_f(Z•_i)|| - log Q^boxminus(Z•_i | x).

    theta are the parameters the model registers (``pyro.module``/``pyro.param``) that the guide does
    not; the per-particle norms come from one batched backward (:func:`per_sample_grad_norms`) and
    are detached, so the norm is never differentiated (as the text after (3.26) notes). A zero norm
    is floored at ``norm_floor`` (log 0 would make the reward -inf).
    """

    needs_grad_for_value = True

    def __init__(self, num_particles: int = 8, norm_floor: float = 1e-12, invalid_reward: float | None = None,
                 max_plate_nesting: int | None = None):
        super().__init__(num_particles, invalid_reward, max_plate_nesting)
        self.norm_floor = norm_floor

    def surrogate(self, model: Callable[..., Any] | None, guide: Callable[..., Any] | None, *args: Any, **kwargs: Any):
        with torch.enable_grad():
            pt = self.particles(model, guide, *args, **kwargs)
            if not pt.params:
                raise ProgramError("Inquisitive needs the model to register the parameters of P (pyro.module) "
                                 "that are not the guide's: none found in the model trace")
            self._norms = per_sample_grad_norms(pt.log_p, pt.params)
        return self.from_particles(pt, *args, **kwargs)

    def rewards(self, pt: Particles) -> torch.Tensor:
        return pt.log_w + torch.log(self._norms.clamp_min(self.norm_floor))


@checked
class SeparatePolicy(ParticleObjective):
    """Remark 3.10: a policy pi_theta (the model) trained on samples of a separate policy pi^boxminus
    (the guide), which is itself trained towards the variance-minimising pi_•.

    For the policy (unbiased for grad_theta -E_{pi_theta}[R]):
        L = -1/(n-1) sum_i A_i log pi_theta(Z_i) U(pi_theta(Z_i) / pi^boxminus(Z_i)),
        Z_i ~ pi^boxminus, A_i = R(Z_i) - mean_j R(Z_j).
    For the separate policy:
        L_sampler = -(1/n) sum_i A^boxminus_i log pi^boxminus(Z_i), A^boxminus = R^boxminus - mean,
        R^boxminus_i = U(log |A_i| ||grad_theta log pi_theta(Z_i)|| pi_theta(Z_i) / pi^boxminus(Z_i)).
    Reading of the garbled first formula: the boxplus after log pi_theta is the detached importance
    ratio multiplying it. |A_i| and the norm are floored at ``floor`` before the log.

    ``reward(z, *args, **kwargs) -> [n]`` gets the guide's values at ``site``. The value returned
    is -(1/n) sum_i ratio_i R(Z_i), an unbiased estimate of L(theta) = -E_{pi_theta}[R].
    """

    min_particles = 2
    needs_grad_for_value = True

    def __init__(self, reward: Callable[..., torch.Tensor], num_particles: int = 8, site: str = "z",
                 train_sampler: bool = True, floor: float = 1e-12, max_plate_nesting: int | None = None):
        super().__init__(num_particles, max_plate_nesting)
        self.reward, self.site, self.train_sampler, self.floor = reward, site, train_sampler, floor

    def surrogate(self, model: Callable[..., Any] | None, guide: Callable[..., Any] | None, *args: Any, **kwargs: Any):
        with torch.enable_grad():
            pt = self.particles(model, guide, *args, **kwargs)
            if self.site not in pt.values:
                raise SiteMismatchError(f"the guide has no site {self.site!r} (sites: {sorted(pt.values)})")
            r = _finite_rewards(torch.as_tensor(self.reward(pt.values[self.site], *args, **kwargs),
                                                dtype=pt.log_p.dtype).detach(), "reward")
            if r.shape != (pt.n,):
                raise ProgramError(f"reward must return one value per particle, shape ({pt.n},), got {tuple(r.shape)}")
            ratio = _finite_rewards(pt.log_w, "log pi_theta / pi^boxminus").exp()
            a = r - r.mean()
            surr = -(a * ratio * pt.log_p).sum() / (pt.n - 1)
            value = -(ratio * r).mean()
            if self.train_sampler:
                norms = per_sample_grad_norms(pt.log_p, pt.params) if pt.params else torch.ones(pt.n)
                rb = (torch.log(a.abs().clamp_min(self.floor)) + torch.log(norms.clamp_min(self.floor))
                      + pt.log_w)
                surr = surr - ((rb - rb.mean()) * pt.log_q).mean()
        self.last_stats = {"reward": float(r.mean()), "ess": float(effective_sample_size(pt.log_w, 0, check=False))}
        return value, surr


@checked
class GRPO(ParticleObjective):
    """R1-Zero with relaxed targets: the one-sampler loss (5.17) and GRPO's group advantages (5.18).

    The model is the policy pi_theta = P_f(. | x -> T Sigma_box) with a latent site ``site`` (thought
    and response), the guide the behaviour policy pi_old that drew the group (pass the model itself
    for on-policy training; its log-probabilities are detached). With r_i = ``reward(z_i, ...)``
    (e.g. 1{X_r^(i) in Sigma_odot}) and rho_i = pi_theta(Z_i) / U(pi_old(Z_i)):

        advantage="group" (5.18): A_i = (r_i - mean r) / (std r + eps)
        advantage="ratio" (5.17): A_i = r_i / U(p_n), p_n = mean r (0 when p_n = 0)
        L = -(1/n) sum_i min(rho_i A_i, clip(rho_i, 1 - clip_eps, 1 + clip_eps) A_i)

    Reading of (5.17): its p_n is printed with a factor P_f(...) that equals 1 under Q_id = P_f;
    we read R_i = 1{...}/p_n as the text after it says. The ratio is per sequence (the theory
    scores whole sequences), not per token as in the GRPO paper; the KL regulariser is not included.
    ``clip_eps=None`` disables clipping. The value returned is -(1/n) sum_i r_i.
    """

    min_particles = 2

    def __init__(self, reward: Callable[..., torch.Tensor], num_particles: int = 8, clip_eps: float | None = 0.2,
                 advantage: str = "group", eps: float = 1e-6, site: str = "z", max_plate_nesting: int | None = None):
        if advantage not in ("group", "ratio"):
            raise ConfigError(f"advantage must be 'group' (5.18) or 'ratio' (5.17), got {advantage!r}")
        if clip_eps is not None and not (0 < clip_eps < 1):
            raise ConfigError(f"clip_eps must lie in (0, 1) or be None, got {clip_eps}")
        super().__init__(num_particles, max_plate_nesting)
        self.reward, self.clip_eps, self.advantage, self.eps, self.site = reward, clip_eps, advantage, eps, site

    def advantages(self, r: torch.Tensor) -> torch.Tensor:
        if self.advantage == "group":
            return group_advantages(r, self.eps)
        p_n = r.mean()
        return torch.where(p_n != 0, r / torch.where(p_n != 0, p_n, torch.ones_like(p_n)), torch.zeros_like(r))

    def from_particles(self, pt: Particles, *args, **kwargs):
        if self.site not in pt.values:
            raise SiteMismatchError(f"the guide has no site {self.site!r} (sites: {sorted(pt.values)})")
        r = torch.as_tensor(self.reward(pt.values[self.site], *args, **kwargs), dtype=pt.log_p.dtype).detach()
        if r.shape != (pt.n,):
            raise ProgramError(f"reward must return one value per particle, shape ({pt.n},), got {tuple(r.shape)}")
        _finite_rewards(r, "reward")
        a = self.advantages(r)
        log_rho = pt.log_p - pt.log_q.detach()
        _finite_rewards(log_rho.detach(), "log pi_theta / pi_old")
        rho = log_rho.exp()
        obj = rho * a
        if self.clip_eps is not None:
            obj = torch.minimum(obj, rho.clamp(1 - self.clip_eps, 1 + self.clip_eps) * a)
        self.last_stats = {"reward": float(r.mean()), "advantage_std": float(a.std(correction=0))}
        return -r.mean(), -obj.mean()


# ---------------------------------------------------------------------------------------- sums
@checked
class Sum(ParticleObjective):
    """A weighted sum of objectives trained together, e.g. ``Sum(OneSampler(n), SamplerPolicyGradient(n))``
    for P and Q at once (Section 3.4.3: "one only needs to sample X, Z once"). Terms that read the
    same particles (the ones implementing ``from_particles``, with equal num_particles) share one
    batch; the others draw their own. The value is the weighted sum of the terms' values.
    """

    def __init__(self, *terms: ParticleObjective, weights: list[float] | None = None):
        if not terms or not all(isinstance(t, ParticleObjective) for t in terms):
            raise ArgumentTypeError(f"Sum needs one or more ParticleObjective terms (e.g. Sum(OneSampler(n), "
                                    f"SamplerPolicyGradient(n))), got {[type(t).__name__ for t in terms]}")
        weights = [1.0] * len(terms) if weights is None else [checks.real(f"weights[{i}]", w)
                                                              for i, w in enumerate(weights)]
        if len(weights) != len(terms):
            raise ConfigError(f"{len(weights)} weights for {len(terms)} terms")
        super().__init__(max(t.num_particles for t in terms), max(t.max_plate_nesting for t in terms))
        self.terms, self.weights = terms, weights
        self.needs_grad_for_value = any(t.needs_grad_for_value for t in terms)

    @staticmethod
    def _shares(t: ParticleObjective) -> bool:
        return type(t).surrogate is ParticleObjective.surrogate

    def surrogate(self, model: Callable[..., Any] | None, guide: Callable[..., Any] | None, *args: Any, **kwargs: Any):
        shared = [t for t in self.terms if self._shares(t)]
        pt = None
        if shared and len({t.num_particles for t in shared}) == 1:
            pt = shared[0].particles(model, guide, *args, **kwargs)
        value, surr, stats = 0.0, 0.0, {}
        for t, w in zip(self.terms, self.weights):
            if pt is not None and self._shares(t) and t.num_particles == pt.n:
                v, s = t.from_particles(pt, *args, **kwargs)
            else:
                v, s = t.surrogate(model, guide, *args, **kwargs)
            value, surr = value + w * v, surr + w * s
            stats.update({f"{type(t).__name__}.{k}": x for k, x in t.last_stats.items()})
        self.last_stats = stats
        return torch.as_tensor(value), torch.as_tensor(surr)
