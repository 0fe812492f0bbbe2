"""Inference and learning for latent-thought models (latent-thought-models.txt, Algorithm 1, Eq. 4).

* :class:`DualRateTrainer`: dual-rate (fast-slow) learning, Algorithm 1, with the learning-rate schedules of
  App. A.2 (:func:`fast_lr_schedule`, :func:`slow_lr_schedule`).
* :class:`LangevinTrainer` (MLE with Eq. 4 samples in the inner loop; :func:`langevin_latents`, batched) and
  :class:`VAETrainer` (an amortised encoder, no inner loop): the learners the paper compares with dual-rate VB.
* :func:`langevin_posterior`: p(z | x) for one sequence by Langevin dynamics (Eq. 4; MALA or ULA through
  :class:`ppl_thought.inference.Langevin`), the decoder fixed; :func:`langevin_evaluate`: a perplexity bound
  from those draws.

The model itself (the generative program, its ELBO and bounds) is :class:`ppl_thought.models.LatentThought`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pyro.distributions as dist
import torch
from pyro.infer.autoguide.initialization import init_to_sample

from ppl_thought import checks
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.inference.langevin import Langevin
from ppl_thought.inference.result import Result
from ppl_thought.models.latent_thought import LatentThought, frozen
from ppl_thought.validation import checked, per_token

__all__ = ["DualRateTrainer", "LangevinTrainer", "VAETrainer", "fast_lr_schedule", "langevin_evaluate",
           "langevin_latents", "langevin_posterior", "slow_lr_schedule"]


@checked
def fast_lr_schedule(progress: float, start: float = 0.3, end: float = 0.34) -> float:
    """The fast (local) learning rate of App. A.2: linear from 0.3 to 0.34 over training (progress in [0, 1],
    clamped). NaN or infinite arguments, or a negative rate: a :class:`~ppl_thought.errors.ConfigError`."""
    progress = min(max(checks.real("progress", progress), 0.0), 1.0)
    start, end = checks.real("start", start, 0.0), checks.real("end", end, 0.0)
    return start + (end - start) * progress


@checked
def slow_lr_schedule(step: int, total: int, lr: float = 4e-4, lr_min: float = 4e-5, warmup: int = 0) -> float:
    """The slow (decoder) learning rate of App. A.2: linear warmup, then cosine decay from lr to lr_min."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    t = min(max(step - warmup, 0) / span, 1.0)
    return lr_min + 0.5 * (lr - lr_min) * (1.0 + math.cos(math.pi * t))


# -- Langevin (Eq. 4) --------------------------------------------------------------------------------

@checked
def langevin_posterior(ltm: LatentThought, tokens: torch.Tensor, mask: torch.Tensor | None = None, num_steps: int = 200,
                       warmup_steps: int = 100, num_chains: int = 2, step_size: float = 0.01,
                       adjust: bool = True, seed: int | None = None, progress: bool = False) -> Result:
    """Sample p(z | x) for ONE sequence with Langevin dynamics (Eq. 4), the decoder fixed.

    Runs :class:`ppl_thought.inference.Langevin` (MALA when ``adjust=True``: the Eq. 4 proposal plus a
    Metropolis correction so the posterior is exactly invariant; ``adjust=False`` is Eq. 4 as written,
    ULA) on :meth:`LatentThought.conditioned_model`.
    ``Result.samples["z"]`` is ``[num_chains, num_steps, 1, L, N_z, d]``.
    """
    tokens2, mask2 = ltm.batch(tokens, mask)
    if tokens2.shape[0] != 1:
        raise MalformedSequenceError(f"langevin_posterior conditions on one sequence, got {tokens2.shape[0]}")
    engine = Langevin(step_size=step_size, num_steps=num_steps, num_chains=num_chains, warmup_steps=warmup_steps,
                      adjust=adjust, seed=seed, disable_progbar=not progress, init_strategy=init_to_sample,
                      target_accept=0.57 if adjust else 0.85)
    with frozen(ltm.decoder):
        return engine.run(ltm.conditioned_model, None, tokens2, mask2)

@checked
def langevin_evaluate(ltm: LatentThought, tokens: torch.Tensor, mask: torch.Tensor | None = None, iw_samples: int = 256,
                      num_steps: int = 200, warmup_steps: int = 100, num_chains: int = 2,
                      step_size: float = 0.01, adjust: bool = True, seed: int | None = None,
                      var_floor: float = 1e-4) -> dict[str, Any]:
    """A perplexity estimate from Langevin draws (Eq. 4), sequence by sequence.

    For each sequence, fit a diagonal Gaussian (mean, variance of all kept draws, variance floored at
    ``var_floor``) to the Langevin draws and use it as the proposal of the importance-weighted bound
    (:meth:`LatentThought.iw_bound`, K = ``iw_samples``). Why this choice: MCMC draws carry no density, so they do not
    give log p(x) directly (the harmonic-mean estimator from raw draws has infinite variance); an IW
    bound stays a valid bound for *any* proposal, is consistent as K grows, and is never looser than the
    ELBO of that same Gaussian (which is its K = 1 case). The draws thus enter only through the quality
    of the proposal; a poorly mixed chain gives a looser (still valid in expectation) bound, never a
    biased-low perplexity.
    """
    tokens2, mask2 = ltm.batch(tokens, mask)
    bounds, accept = [], []
    for i in range(tokens2.shape[0]):
        res = langevin_posterior(ltm, tokens2[i], mask2[i], num_steps, warmup_steps, num_chains, step_size,
                                      adjust, None if seed is None else seed + i)
        z = res.samples["z"].reshape(-1, *ltm.latent_shape).detach()
        loc, var = z.mean(0), z.var(0, unbiased=z.shape[0] > 1).clamp_min(var_floor)
        proposal = dist.Normal(loc[None], var.sqrt()[None]).to_event(3)
        bounds.append(float(ltm.iw_bound(tokens2[i:i + 1], proposal, iw_samples, mask2[i:i + 1])))
        accept.append(float(res.stats["accept_prob"].mean()))
    n_tokens = int(mask2.sum())
    total = sum(bounds)
    return {"log_marginal_bound": total, "num_tokens": n_tokens, "ppl": math.exp(-total / n_tokens),
            "per_sequence": bounds, "mean_accept_prob": sum(accept) / len(accept)}


@checked
class DualRateTrainer:
    """Dual-rate (fast-slow) learning of an LTM, Algorithm 1.

    For each mini-batch: re-initialise the local (mu, log sigma^2) of every sequence and take
    ``inner_steps`` = T_fast Adam steps on the ELBO of Eq. 5 with the decoder frozen (fast learning, learning
    rate linear from ``fast_lr[0]`` = 0.3 to ``fast_lr[1]`` = 0.34 over training, App. A.2, and by default decayed
    by a cosine to 0 inside the loop, ``inner_schedule="cosine"``, as Sec. 3.2 does "for larger steps": at a
    constant rate, ``inner_schedule="constant"``, Adam's q never converges and the model is charged the gap,
    docs/latent-thought.md "Why more inference steps"); then one AdamW
    step (betas 0.9, 0.95; gradient norm clipped to ``grad_clip``) on the decoder with the batch ELBO
    L_batch = (1/B) sum_i L_i, z drawn from the optimised q with the local parameters detached (slow
    learning; rate ``slow_lr`` with linear warmup then cosine decay to ``slow_lr_min``). The loss is
    normalised per token. Metrics per step are appended to :attr:`history`.
    """

    def __init__(self, ltm: LatentThought, total_steps: int, inner_steps: int = 16,
                 fast_lr: tuple[float, float] = (0.3, 0.34), slow_lr: float = 4e-4, slow_lr_min: float = 4e-5,
                 warmup_steps: int = 0, weight_decay: float = 0.0, grad_clip: float = 1.0, num_samples: int = 1,
                 inner_schedule: str = "cosine", progress: bool = True) -> None:
        if total_steps < 1 or inner_steps < 0:
            raise ConfigError(f"need total_steps >= 1 and inner_steps >= 0, got {total_steps}, {inner_steps}")
        self.ltm, self.total_steps, self.inner_steps = ltm, total_steps, inner_steps
        self.fast_lr, self.slow_lr, self.slow_lr_min, self.warmup_steps = fast_lr, slow_lr, slow_lr_min, warmup_steps
        self.grad_clip, self.num_samples, self.inner_schedule, self.progress = (grad_clip, num_samples,
                                                                                 inner_schedule, progress)
        self.optimizer = torch.optim.AdamW(self.trained_parameters(), lr=slow_lr, betas=(0.9, 0.95),
                                           weight_decay=weight_decay)
        self.step_count = 0
        self.history: list[dict[str, float]] = []

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """What the slow step updates: the decoder beta (subclasses add their own global parameters)."""
        return list(self.ltm.decoder.parameters())

    def current_fast_lr(self) -> float:
        return fast_lr_schedule(self.step_count / max(self.total_steps - 1, 1), *self.fast_lr)

    def posterior(self, tokens: torch.Tensor, mask: torch.Tensor, fast_lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The inner loop (Algorithm 1, lines 5-11): fit q(z | x) by ``inner_steps`` Adam steps on Eq. 5 and
        return ``num_samples`` draws of z ``[S, B, L, N_z, d]`` and KL(q || p) ``[B]``, both detached."""
        guide = self.ltm.fit_local(tokens, mask, self.inner_steps, fast_lr, self.inner_schedule, self.num_samples)
        return guide.rsample(self.num_samples, detach=True), guide.kl_to_prior(detach=True)

    @per_token
    def step(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
        """One iteration of Algorithm 1 (lines 3-15) on a mini-batch; returns its metrics."""
        ltm = self.ltm
        tokens2, mask2 = ltm.batch(tokens, mask)
        fast = self.current_fast_lr()
        slow = slow_lr_schedule(self.step_count, self.total_steps, self.slow_lr, self.slow_lr_min, self.warmup_steps)
        z, kl = self.posterior(tokens2, mask2, fast)
        for g in self.optimizer.param_groups:
            g["lr"] = slow
        recon = ltm.log_likelihood(tokens2, z, mask2).mean(0)
        return self._slow_step(recon, kl, mask2, fast, slow)

    def _slow_step(self, recon: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, fast: float,
                   slow: float) -> dict[str, float]:
        """One slow (decoder) update on the negative ELBO per token, -(recon - KL) / tokens (Eq. 5), with the
        gradient clipped; records and returns the step's metrics."""
        n_tokens = mask.sum().clamp_min(1)
        loss = -(recon - kl).sum() / n_tokens
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[0]["params"], self.grad_clip)
        self.optimizer.step()
        self.step_count += 1
        loss = loss.detach()
        metrics = {"step": self.step_count, "loss": float(loss), "elbo_ppl": math.exp(min(float(loss), 50.0)),
                   "recon_per_token": float(recon.detach().sum() / n_tokens),
                   "kl_per_token": float(kl.detach().sum() / n_tokens),
                   "fast_lr": fast, "slow_lr": slow, "grad_norm": float(gnorm)}
        self.history.append(metrics)
        return metrics

    def fit(self, batches: Iterable[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
            num_steps: int | None = None) -> list[dict[str, float]]:
        """Run :meth:`step` over ``batches`` (tensors or (tokens, mask) pairs), at most ``num_steps`` times
        (default ``total_steps - steps taken``), with a tqdm progress bar."""
        from tqdm.auto import tqdm

        n = self.total_steps - self.step_count if num_steps is None else num_steps
        bar = tqdm(total=n, disable=not self.progress, desc="LTM dual-rate")
        it = iter(batches)
        for _ in range(n):
            try:
                batch = next(it)
            except StopIteration:
                break
            tokens, mask = batch if isinstance(batch, tuple) else (batch, None)
            m = self.step(tokens, mask)
            bar.update(1)
            bar.set_postfix(ppl=f"{m['elbo_ppl']:.3f}", kl=f"{m['kl_per_token']:.3f}")
        bar.close()
        return self.history


@checked
def langevin_latents(ltm: LatentThought, tokens: torch.Tensor, mask: torch.Tensor | None = None, num_steps: int = 8,
                     step_size: float = 0.03, z0: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Eq. 4 for a whole batch at once, the decoder fixed: z^{tau+1} = z^tau + s grad_z log p(z^tau | x) + sqrt(2s) eps.

    grad_z log p(z | x) = grad_z [log p_beta(x | z) + log N(z; 0, I)] (the evidence does not depend on z);
    the sequences are independent given beta, so one backward pass of the batch sum gives every sequence's
    gradient. Starts from ``z0`` ``[B, L, N_z, d]`` or, by default, a draw from the prior N(0, I), and runs
    ``num_steps`` unadjusted steps (``num_steps = 0`` returns the start). Returns z ``[B, L, N_z, d]``, detached.
    """
    tokens2, mask2 = ltm.batch(tokens, mask)
    if num_steps < 0:
        raise ConfigError(f"num_steps must be an int >= 0, got {num_steps!r}")
    if not step_size > 0:
        raise ConfigError(f"step_size must be > 0 (the Eq. 4 step s), got {step_size!r}")
    B = tokens2.shape[0]
    if z0 is None:
        z = torch.randn(B, *ltm.latent_shape, generator=generator, device=tokens2.device)
    else:
        z = ltm._check_z(z0, B).detach().clone()
    noise_scale = math.sqrt(2.0 * step_size)
    with frozen(ltm.decoder), torch.enable_grad():
        for _ in range(num_steps):
            z = z.detach().requires_grad_(True)
            log_joint = (ltm.log_likelihood(tokens2, z, mask2) + ltm.log_prior(z)).sum()
            (grad,) = torch.autograd.grad(log_joint, z)
            grad = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
            eps = torch.randn(z.shape, generator=generator, device=z.device)
            z = z + step_size * grad + noise_scale * eps
    return z.detach()


@checked
class LangevinTrainer(DualRateTrainer):
    """Maximum likelihood with Langevin posterior samples (latent-thought-models.txt Sec 2.2, Eq. 2-4): the
    Langevin baseline of the paper's ablation (Table 4), at the budget of :class:`DualRateTrainer`.

    Per mini-batch: draw z^0 ~ N(0, I) per sequence, run ``inner_steps`` steps of Eq. 4
    (:func:`langevin_latents`, step size ``step_size``) with the decoder frozen, then one slow AdamW step on
    -log p_beta(x | z) per token: a one-sample estimate of the gradient of Eq. 3,
    grad log p_beta(x) = E_{p(z | x)}[grad log p_beta(x | z)]. Each inner step costs one forward and one
    backward pass of the decoder, as a fast VB step does, so equal ``inner_steps`` is equal inner compute.
    The slow step, its schedule and its clipping are those of :class:`DualRateTrainer`; ``kl_per_token``
    in the metrics is 0 (no KL term in the MLE objective).
    """

    def __init__(self, ltm: LatentThought, total_steps: int, inner_steps: int = 16, step_size: float = 0.03,
                 **kwargs: Any) -> None:
        super().__init__(ltm, total_steps, inner_steps, **kwargs)
        if not step_size > 0:
            raise ConfigError(f"step_size must be > 0 (the Eq. 4 step s), got {step_size!r}")
        self.step_size = step_size

    def posterior(self, tokens: torch.Tensor, mask: torch.Tensor, fast_lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        z = langevin_latents(self.ltm, tokens, mask, self.inner_steps, self.step_size)
        return z[None], z.new_zeros(z.shape[0])


@checked
class VAETrainer(DualRateTrainer):
    """The amortised (VAE) baseline of latent-thought-models.txt Sec 2.2 and Table 4, at the budget of
    :class:`DualRateTrainer`: q_phi(z | x) = ``encoder(x)`` (:class:`ppl_thought.guides.AmortizedGaussianEncoder`)
    in one pass, no inner loop, and one AdamW step per mini-batch on the per-token ELBO of Eq. 5 jointly in
    beta and phi (reparameterised z; same optimiser, schedule and clipping as the slow step of Algorithm 1).
    ``inner_steps`` is 0 by construction.
    """

    def __init__(self, ltm: LatentThought, encoder: torch.nn.Module, total_steps: int, **kwargs: Any) -> None:
        kwargs.pop("inner_steps", None)
        self.encoder = encoder
        super().__init__(ltm, total_steps, 0, **kwargs)

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.ltm.decoder.parameters()) + list(self.encoder.parameters())

    @per_token
    def step(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
        ltm = self.ltm
        tokens2, mask2 = ltm.batch(tokens, mask)
        slow = slow_lr_schedule(self.step_count, self.total_steps, self.slow_lr, self.slow_lr_min, self.warmup_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = slow
        guide = self.encoder(tokens2, mask2)
        recon = ltm.log_likelihood(tokens2, guide.rsample(self.num_samples), mask2).mean(0)
        return self._slow_step(recon, guide.kl_to_prior(), mask2, 0.0, slow)
