"""The objectives and inference of active lifting (Section 6): (6.4)-(6.7), (6.10), (6.15)-(6.22).

An active lifting model (:class:`~ppl_thought.transforms.ActiveLift`) has a sampler Q (Def 6.1), a latent
model P and a generator G. With Z ~ Q^{<=T}(. | x) and its prefixes Z_<=t (t = 0..T), write

    lp_t = log P^{<=t}(Z_<=t),   lq_t = log Q^{<=t}(Z_<=t | x),   lg_t = log G^{<=t}(x | Z_<=t)

(``lp_0 = lq_0 = 0``). The objectives are sums over the observation steps t of expectations under Q,
estimated from n particles Z_1..Z_n ~ Q(. | x) (a batch dimension):

* (6.4)-(6.7), the min-max objective: min_Q max_P sum_{t=1}^T E[lp_t - lq_t]; at P = Q_* each term is
  C_t = H(Z_<=t | X) - H(Z_<=t) = -I(X; Z_<=t) (6.4), (6.5), and P = Q_* is the maximiser (6.6).
* (6.10), minimum-length coding with a decoder: min_{Q, G} sum_{t=0}^T E[-lg_t], the decoder G playing
  P_*(x | z_<=t); at G = P_*(. | z) the value is sum_t H(X | Z_<=t) (nats), (6.10) = (6.7) + T H(X).
* (6.15), the passive generator loss: min_G sum_t E[-lg_t] with Q fixed (detached).
* (6.16), the active objective: min_{Q, G} max_P sum_{t=0}^T E[lp_t - lq_t - lg_t].
* (6.19), the conditional sampler loss: E_l E_{Z ~ D(Q)(.|x)}[-log Q(Z | x_<=l)], l ~ U[1, |x| - 1].

Gradients (the surrogates below; their autograd gradient is the estimator):

* Q, by the score function (policy gradient, the "trick" the text after (6.7) asks for): a token Z_s
  influences the terms t >= s only, so with the reward-to-go R_s = sum_{t >= s} r_t,
      grad_Q E[sum_t r_t] = E[sum_s R_s grad log Q(Z_s | x, Z_<s)]  (+ E[sum_t grad r_t] where r_t reads Q),
  and the last expectation is 0 for the terms -lq_t (E_Q[grad log Q^{<=t}] = 0), so it is dropped.
  ``baseline=True`` subtracts the leave-one-out mean of R_s over the other particles of the same x, as
  in (3.25): A_s = n/(n-1) (R_s - mean_j R_s^(j)); unbiased because the other particles are independent.
* P and G, pathwise (teacher-forced log-probabilities of the sampled Z): P ascends (it maximises),
  G descends. With one LM playing all parts (Section 6.6) the gradients add up on the shared weights.

A wrong estimator is easy to write: crediting token s with its own term r_s only (no reward-to-go)
drops the effect of Z_s on the later prefixes; ``tests/test_active_lifting.py`` shows its mean missing
the enumerated gradient by many standard errors while the estimator here matches it.

Inference: :func:`encode` (6.17)/(6.18) estimates P_model(x) = sum_z P^{<=t}(z) G^{<=t}(x | z) at every
step t of the time axis from the same particles; :func:`conditional_decode` (6.20)/(6.21) samples
continuations of a prompt; :func:`conditional_encode` (6.22) estimates P_model(x_q x_r | [x_q]).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ppl_thought.checks import integer
from ppl_thought.distributions.lm_sequence import LMSequence, concat
from ppl_thought.errors import ActiveLiftError
from ppl_thought.training.objectives import ParticleObjective
from ppl_thought.transforms.active import ActiveLift
from ppl_thought.validation import ArrayLike, checked
from ppl_thought.vocab import END_THINK_ID, EOS_ID, PAD_ID

__all__ = [
    "ActiveGenerative", "ActiveLifting", "ConditionalSamplerLoss", "GeneratorLoss", "MinimumLengthCoding",
    "active_terms", "conditional_decode", "conditional_encode", "encode", "prefix_sums", "reward_to_go",
    "score_function_surrogate",
]


# ------------------------------------------------------------------------------------------ tensor core
def prefix_sums(steps: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` per-token log-probabilities -> ``[..., T + 1]`` prefix log-probabilities log Q^{<=t}, t = 0..T
    (column 0 is the empty prefix, 0), the product (6.1) in log space."""
    return torch.nn.functional.pad(steps.cumsum(-1), (1, 0))


def reward_to_go(rewards: torch.Tensor) -> torch.Tensor:
    """``[..., T + 1]`` per-step rewards r_t (t = 0..T) -> ``[..., T]`` R_s = sum_{t >= s} r_t for s = 1..T:
    what latent token Z_s influences (the terms of the prefixes that contain it)."""
    return rewards[..., 1:].flip(-1).cumsum(-1).flip(-1)


def _average(per_x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return per_x.mean()
    w = torch.as_tensor(weights, dtype=per_x.dtype, device=per_x.device)
    if w.shape != per_x.shape:
        raise ActiveLiftError(f"weights have shape {tuple(w.shape)}, the observations {tuple(per_x.shape)}")
    return (w * per_x).sum()


def _finite(r: torch.Tensor, what: str) -> torch.Tensor:
    if not torch.isfinite(r).all():
        raise ActiveLiftError(f"{what} is not finite ({int((~torch.isfinite(r)).sum())} entries): a part of the "
                              "model gives probability 0 to a sampled sequence; check the alphabets (Omega, Sigma)")
    return r


@checked
def score_function_surrogate(rewards: torch.Tensor, log_q_steps: torch.Tensor, baseline: bool = True,
                             weights: torch.Tensor | None = None) -> torch.Tensor:
    """A scalar whose gradient is the score-function estimator of grad_Q E_{Z ~ Q}[sum_{t=0}^T r_t(Z)].

    Args:
        rewards: ``[*B, n, T + 1]`` per-step rewards of n particles per observation (detached here).
        log_q_steps: ``[*B, n, T]`` log Q(Z_s | x, Z_<s), with gradients to Q.
        baseline: leave-one-out baseline per step (needs n >= 2), see the module docstring.
        weights: ``[*B]`` weights of the observations (e.g. P_*(x)); default: their mean.
    """
    r = _finite(rewards.detach(), "a reward")
    g = reward_to_go(r)
    n = g.shape[-2]
    if baseline:
        if n < 2:
            raise ActiveLiftError("the leave-one-out baseline needs at least 2 particles per observation")
        g = (g - g.mean(-2, keepdim=True)) * (n / (n - 1))
    return _average((g * log_q_steps).sum(-1).mean(-1), weights)


@checked
def active_terms(kind: str, log_q_steps: torch.Tensor, log_p_steps: torch.Tensor | None = None,
                 log_g: torch.Tensor | None = None, *, baseline: bool = True, weights: torch.Tensor | None = None,
                 fit_prior: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, surrogate) of one objective of Section 6 from the particles' per-step log-probabilities.

    Args:
        kind: ``"min_max"`` (6.7), ``"coding"`` (6.10) with the decoder G, ``"generator"`` (6.15) or
            ``"active"`` (6.16).
        log_q_steps: ``[*B, n, T]`` log Q(Z_t | x, Z_<t) (gradients to Q).
        log_p_steps: ``[*B, n, T]`` log P(Z_t | Z_<t) (gradients to P); needed by (6.7), (6.16) and by (6.10)
            with ``fit_prior``.
        log_g: ``[*B, n, T + 1]`` log G^{<=t}(x | Z_<=t) (gradients to G); needed by (6.10), (6.15), (6.16).
        fit_prior: in (6.10), also fit P to Q_* by (6.6) (P does not enter the value; it is the latent model).

    The value is the Monte-Carlo estimate of the objective, averaged over the observations: for
    "min_max" sum_{t=1}^T E[lp_t - lq_t] (-> sum_t C_t at P = Q_*), for "coding" and "generator"
    sum_{t=0}^T E[-lg_t] (-> sum_t H(X | Z_<=t) at G = P_*(. | z), in nats), for "active"
    sum_{t=0}^T E[lp_t - lq_t - lg_t]. The surrogate's gradient descends for Q and G and ascends for P.
    """
    if kind not in ("min_max", "coding", "generator", "active"):
        raise ActiveLiftError(f"kind must be 'min_max' (6.7), 'coding' (6.10), 'generator' (6.15) or 'active' "
                              f"(6.16), got {kind!r}")
    need_p = kind in ("min_max", "active") or (kind == "coding" and fit_prior)
    need_g = kind in ("coding", "generator", "active")
    if need_p and log_p_steps is None:
        raise ActiveLiftError(f"the {kind!r} objective needs log_p_steps (the latent model P)")
    if need_g and log_g is None:
        raise ActiveLiftError(f"the {kind!r} objective needs log_g (the generator G)")
    lq = prefix_sums(log_q_steps)
    zero = lq.new_zeros(())
    lp = prefix_sums(log_p_steps) if need_p else None
    surrogate = zero
    if kind == "min_max":
        r = lp - lq
    elif kind == "active":
        r = lp - lq - log_g
    else:
        r = -log_g
    value = _average(r.detach().sum(-1).mean(-1), weights)
    if kind != "generator":  # Q minimises by the score function
        surrogate = surrogate + score_function_surrogate(r, log_q_steps, baseline, weights)
    else:
        lq = lq.detach()
    if need_p:  # P maximises sum_t E[lp_t] (the part of the objective that reads P), (6.6)
        surrogate = surrogate - _average(lp.sum(-1).mean(-1), weights)
    if need_g:  # G minimises sum_t E[-lg_t], (6.15)
        surrogate = surrogate + _average((-log_g).sum(-1).mean(-1), weights)
    return value, surrogate


# ------------------------------------------------------------------------------------------ ELBO classes
class _ActiveObjective(ParticleObjective):
    """Base: n particles Z ~ Q(. | x) through the library's particles primitive (model = the lifted program or
    ``lift.model``, guide = ``lift.guide``), then the prefix terms from :class:`ActiveLift` (one pass each)."""

    kind = "min_max"
    min_particles = 1

    def __init__(self, lift: ActiveLift, num_particles: int = 8, baseline: bool = True,
                 max_plate_nesting: int | None = None):
        if not isinstance(lift, ActiveLift):
            raise ActiveLiftError(f"{type(self).__name__} needs the ActiveLift of the model, got {type(lift).__name__}")
        if baseline and num_particles < 2 and self.kind != "generator":
            raise ActiveLiftError(f"{type(self).__name__}(baseline=True) needs num_particles >= 2")
        super().__init__(num_particles, max_plate_nesting)
        self.lift, self.baseline = lift, baseline

    def sample_latents(self, model: Callable, guide: Callable, x, **kwargs) -> torch.Tensor:
        """``[n, T]`` latent sequences Z ~ Q(. | x) from the guide, replayed through the model (site check)."""
        with torch.no_grad():
            pt = self.particles(model, guide, x, **kwargs)
        site = self.lift.latent_site
        if site not in pt.values:
            raise ActiveLiftError(f"the guide has no latent site {site!r} (sites {sorted(pt.values)})")
        return pt.values[site].reshape(pt.n, -1)

    def terms(self, z: torch.Tensor, x) -> dict[str, torch.Tensor]:
        lift = self.lift
        out = {"log_q_steps": lift.sampler_log_probs(z, x)[None]}
        if self.kind in ("min_max", "active", "coding"):
            out["log_p_steps"] = lift.prior_log_probs(z)[None]
        if self.kind in ("coding", "generator", "active"):
            out["log_g"] = lift.generator_log_probs(x, z)[None]
        return out

    def surrogate(self, model: Callable[..., Any] | None, guide: Callable[..., Any] | None, x: ArrayLike, *args: Any,
                  **kwargs: Any):
        z = self.sample_latents(model, guide, x, **kwargs)
        value, surr = active_terms(self.kind, baseline=self.baseline, **self.terms(z, x))
        self.last_stats = {"objective": float(value)}
        return value, surr


@checked
class ActiveLifting(_ActiveObjective):
    """The min-max objective (6.4)-(6.7) for one observation x:

        min_Q max_P sum_{t=1}^T E_{Z ~ Q^{<=T}(.|x)}[log P^{<=t}(Z_<=t) - log Q^{<=t}(Z_<=t | x)]   (6.7)

    averaged over x ~ P_* by the caller (one x per call, as every objective of the library). At the inner
    maximum P = Q_* (6.6) the t-th term is C_t of (6.4) = -I(X; Z_<=t) (6.5). Q's gradient is the
    score-function estimator with reward-to-go and a leave-one-out baseline; P's is pathwise (it ascends).
    The value is the estimate of the sum. ``pyro.infer.SVI(lift(program), lift.guide, optim, ActiveLifting(lift))``.
    """

    kind = "min_max"


@checked
class MinimumLengthCoding(_ActiveObjective):
    """The coding objective (6.10) with the decoder G playing P_*(x | z_<=t):

        min_{Q, G} sum_{t=0}^T E_{Z ~ Q(.|x)}[-log G^{<=t}(x | Z_<=t)]        (6.10), (6.12)

    equal to sum_t H(X | Z_<=t) at the best G (and an upper bound otherwise), the expected code length of
    (6.12) in nats for a deterministic Q. P is fitted to Q_* by (6.6) on the same particles (``fit_prior``).
    """

    kind = "coding"


@checked
class GeneratorLoss(_ActiveObjective):
    """The passive generator loss (6.15): min_G sum_{t=0}^T E_{Z ~ D(Q)(.|x)}[-log G^{<=t}(x | Z_<=t)]: Q is fixed
    (its samples detached), only G is trained; E KL(P_*^{<=t}(.|Z) || G^{<=t}(.|Z)) (6.14) up to a constant."""

    kind = "generator"

    def __init__(self, lift: ActiveLift, num_particles: int = 8, max_plate_nesting: int | None = None):
        super().__init__(lift, num_particles, baseline=False, max_plate_nesting=max_plate_nesting)


@checked
class ActiveGenerative(_ActiveObjective):
    """The active objective (6.16): min_{Q, G} max_P sum_{t=0}^T E[log P^{<=t}(Z_<=t) - log Q^{<=t}(Z_<=t | x)
    - log G^{<=t}(x | Z_<=t)], equal to 2 sum_t C_t + const at the inner optimum (P = Q_*, G = P_*(.|z))."""

    kind = "active"


@checked
class ConditionalSamplerLoss(ParticleObjective):
    """The conditional sampler loss (6.19) for one complete x:

        E_{l ~ U[1, |x| - 1]} E_{Z ~ D(Q)(.|x)}[-log Q^{<=T}(Z | x_<=l)]

    trains Q on proper prefixes x_<=l to imitate its own (detached) samples on the whole x, so that
    Q(. | x_<=l) approaches the conditional sampler Q_<w(. | x_<=l) used by (6.20)-(6.22). The expectation over
    l is taken exactly (every l, one batched pass), over Z with n particles. Needs |x| >= 2.
    """

    def __init__(self, lift: ActiveLift, num_particles: int = 8):
        super().__init__(num_particles, 0)
        self.lift = lift

    def surrogate(self, model: Callable[..., Any] | None, guide: Callable[..., Any] | None, x: ArrayLike, *args: Any,
                  **kwargs: Any):
        lift = self.lift
        xi = lift.as_ids(x)[0]
        L = int((xi != PAD_ID).sum())
        if L < 2:
            raise ActiveLiftError(f"(6.19) needs |x| >= 2 (a nonempty proper prefix), got |x| = {L}")
        with torch.no_grad():
            z = lift.sampler(xi).sample((self.num_particles,))  # D(Q)(. | x)
        n = z.shape[0]
        prefixes = torch.stack([torch.where(torch.arange(L, device=xi.device) < l, xi[:L], PAD_ID)
                                for l in range(1, L)])  # [L-1, L]
        rows_x = prefixes.repeat_interleave(n, 0)
        rows_z = z.repeat(L - 1, 1)
        lq = lift.sampler_log_probs(rows_z, rows_x).sum(-1)
        loss = -lq.mean()
        self.last_stats = {"objective": float(loss.detach())}
        return loss.detach(), loss


# ------------------------------------------------------------------------------------------ inference
def _log_weights(lift: ActiveLift, z: torch.Tensor, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return lift.prior_log_probs(z), lift.sampler_log_probs(z, x), lift.generator_log_probs(x, z)


@checked
@torch.no_grad()
def encode(lift: ActiveLift, x: ArrayLike, num_particles: int, incremental: bool = True) -> torch.Tensor:
    """Unconditional encoding along the time axis: ``[T + 1]`` log p_{t,n}, t = 0..T, estimates of
    log P_model(x) = log sum_z P^{<=t}(z) G^{<=t}(x | z) from one set of particles Z^(i) ~ Q^{<=T}(. | x)
    (their prefixes Z_<=t are draws of Q^{<=t}).

    ``incremental=False`` is (6.17): p_{t,n} = (1/n) sum_i P^{<=t}(Z^(i)) G^{<=t}(x | Z^(i)) / Q^{<=t}(Z^(i) | x).
    ``incremental=True`` is (6.18): log q_t = log q_{t-1} + log P(Z_t | Z_<t) + g(x, Z_<=t) - log Q(Z_t | x, Z_<t)
    with g(x, z_<=t) = log G^{<=t}(x | z_<=t) - log G^{<=t-1}(x | z_<t) (so that log G^{<=T} = sum_t g) and
    log q_0 = g(x, emptyset) = log G(x | emptyset); then log p_{t,n} = logsumexp_i(log q_t^(i)) - log n. Reading of
    (6.18): it prints p_{t,n} = (1/n) logsumexp(...), which is the log of the mean only after -log n; and
    log q_0 = 0 there leaves out the t = 0 factor G(x | emptyset) that (6.17) has. p_{t,n} is unbiased for
    P_model^{<=t}(x) (not its log).
    """
    n = integer("num_particles", num_particles, minimum=1)
    xi = lift.as_ids(x)[:1]
    z = lift.sampler(xi[0]).sample((n,))
    lp, lq, lg = _log_weights(lift, z, xi)
    if incremental:
        g = torch.diff(lg, dim=-1, prepend=torch.zeros_like(lg[:, :1]))  # g(x, z_<=t), t = 0..T
        inc = g + torch.nn.functional.pad(lp - lq, (1, 0))
        log_q = inc.cumsum(-1)
    else:
        log_q = prefix_sums(lp) - prefix_sums(lq) + lg
    return torch.logsumexp(log_q, 0) - math.log(n)


@checked
@torch.no_grad()
def conditional_encode(lift: ActiveLift, x_q: ArrayLike, x_r: ArrayLike, num_particles: int) -> torch.Tensor:
    """Conditional encoding (6.22): an estimate of log P_model(x_q x_r | [x_q]),

        p_n = [(1/n) sum_i G(x_q x_r | Z_i) P(Z_i) / Q(Z_i | x_q x_r)]
              / [(1/n) sum_i G([x_q] | Z~_i) P(Z~_i) / Q(Z~_i | x_q)]

    with Z_i ~ Q(. | x_q x_r), Z~_i ~ Q(. | x_q) (the printed Q^{<=w}(Z) read as these conditionals). Numerator
    and denominator are unbiased for P_model(x_q x_r) and P_model([x_q]); the ratio is consistent. x_q x_r
    should be complete (end with ``<eos>``).
    """
    n = integer("num_particles", num_particles, minimum=1)
    q = lift.as_ids(x_q)[0]
    r = lift.as_ids(x_r)[0]
    full = concat(q, r)
    z = lift.sampler(full).sample((n,))
    zt = lift.sampler(q).sample((n,))
    lp, lq, lg = _log_weights(lift, z, full[None])
    num = torch.logsumexp(lp.sum(-1) - lq.sum(-1) + lg[:, -1], 0)
    lp, lq, lg = _log_weights(lift, zt, q[None])
    den = torch.logsumexp(lp.sum(-1) - lq.sum(-1) + lg[:, -1], 0)
    return num - den


@checked
@torch.no_grad()
def conditional_decode(lift: ActiveLift, x: ArrayLike, num_samples: int = 1, num_particles: int = 1,
                       resample: bool = True) -> torch.Tensor:
    """Conditional decoding given a prompt x: ``[num_samples, max_x_len]`` right-padded texts X = x X'.

    ``resample=False`` or ``num_particles=1`` is (6.20): Z ~ Q(. | x), X ~ G(. | Z) continuing x (G reads
    ``z </s> x`` and decodes X', Section 6.6). ``resample=True`` is (6.21): n particles Z^(i) ~ Q(. | x) per
    sample, I ~ Categorical(p) with p_i proportional to G([x] | Z^(i)) P(Z^(i)) / Q(Z^(i) | x), then X ~ G(. | Z^(I)).
    Its law approaches P_model(. | [x]) as n grows (the bound after (6.21)).
    """
    m = integer("num_samples", num_samples, minimum=1)
    n = integer("num_particles", num_particles, minimum=1)
    xi = lift.as_ids(x)[0]
    xi = xi[xi != PAD_ID]
    L = xi.shape[0]
    if L >= lift.max_x_len or (L and int(xi[-1]) == EOS_ID):
        raise ActiveLiftError(f"the prompt must be shorter than max_x_len = {lift.max_x_len} and not end with <eos>")
    z = lift.sampler(xi).sample((m * n,))  # [m n, T]
    if resample and n > 1:
        lp, lq, lg = _log_weights(lift, z, xi[None])
        logw = (lp.sum(-1) - lq.sum(-1) + lg[:, -1]).view(m, n)
        idx = torch.distributions.Categorical(logits=logw).sample()
        z = z.view(m, n, -1)[torch.arange(m, device=z.device), idx]
    else:
        z = z.view(m, n, -1)[:, 0]
    end = torch.full((m, 1), END_THINK_ID, dtype=torch.long, device=z.device)
    prompt = torch.cat([z, end, xi.expand(m, -1)], 1)
    cont = LMSequence(lift.generator_lm, prompt=prompt, constraint=lift._sigma_auto, stop=EOS_ID,
                      max_len=lift.max_x_len - L).sample()
    return concat(xi.expand(m, -1), cont)
