"""Latent Thought Models (latent-thought-models.txt, Sections 2.1-2.4, Algorithm 1, Eq. 4 and 5).

The generative program (Sec 2.1)::

    z = (z_1, ..., z_L) ~ N(0, I),        z_l in R^{N_z x d_latent} cross-attended by decoder layer l
    x_n | z, x_{n-k:n-1} ~ Categorical(softmax(f_beta(x_{n-k:n-1}, z)))       (Eq. 1, window k)

The decoder f_beta is :class:`ppl_thought.lm.transformer.Transformer` with ``window=k`` sliding-window
self-attention and ``cross_attention=True``; layer l reads ``z[:, l]``. The first token is predicted from
a reserved begin-of-sequence id (``vocab_size``, an extra decoder row whose logit is never a target:
the next-token softmax is over the ``vocab_size`` real ids only).

Posterior inference and learning:

* Classical variational Bayes (Eq. 5): a *local* Gaussian q(z | x_i) = N(mu_i, diag(sigma_i^2)) per
  sequence (:class:`LocalGaussianGuide`), parameterised by (mu, log sigma^2), fitted by a few Adam steps
  with a high learning rate on the ELBO with the decoder fixed (:meth:`LatentThought.fit_local`,
  "fast learning", Algorithm 1 lines 5-11).
* Dual-rate learning (Algorithm 1): :class:`DualRateTrainer` re-initialises the local parameters for
  each mini-batch, runs T_fast inner steps, then takes one slow AdamW step on the decoder with the
  optimised posterior held fixed (lines 13-15).
* Langevin dynamics (Eq. 4) as the alternative posterior sampler: :meth:`LatentThought.langevin_posterior`
  runs :class:`ppl_thought.inference.Langevin` on the model conditioned on one sequence, decoder fixed.

Evaluation: the ELBO-perplexity ``exp(-ELBO / num_tokens)`` after T inner steps (an upper bound on the
true perplexity), and the importance-weighted bound ``log (1/K) sum_k p(x, z_k) / q(z_k)``, z_k ~ q
(tighter, still a bound in expectation, and consistent as K grows).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from torch import nn

from ppl_thought.distributions.lm_state import upcast
from ppl_thought.errors import MalformedSequenceError
from ppl_thought.inference.result import Result, log_mean_exp
from ppl_thought.lm.transformer import Transformer

__all__ = ["LatentThought", "LocalGaussianGuide", "DualRateTrainer", "fast_lr_schedule", "slow_lr_schedule"]


@contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """Turn off ``requires_grad`` of every parameter of ``module`` for the block, then restore it.

    The fast inner loop (Algorithm 1, lines 5-11) runs under it: autograd then never builds a path to
    the decoder weights, so they cannot be changed or receive gradients.
    """
    params = list(module.parameters())
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)


def fast_lr_schedule(progress: float, start: float = 0.3, end: float = 0.34) -> float:
    """The fast (local) learning rate of App. A.2: linear from 0.3 to 0.34 over training (progress in [0, 1])."""
    progress = min(max(float(progress), 0.0), 1.0)
    return start + (end - start) * progress


def slow_lr_schedule(step: int, total: int, lr: float = 4e-4, lr_min: float = 4e-5, warmup: int = 0) -> float:
    """The slow (decoder) learning rate of App. A.2: linear warmup, then cosine decay from lr to lr_min."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    t = min(max(step - warmup, 0) / span, 1.0)
    return lr_min + 0.5 * (lr - lr_min) * (1.0 + math.cos(math.pi * t))


class LocalGaussianGuide:
    max_plate_nesting = 1  # the "sequences" plate
    """The local variational posterior of Eq. 5: q(z | x_i) = N(mu_i, diag(exp(log_var_i))), one per sequence.

    ``loc`` and ``log_var`` are leaf tensors ``[B, n_layers, n_z, d_latent]`` (not in Pyro's param store:
    they are re-initialised for every mini-batch, Algorithm 1 line 6). As a Pyro guide, ``guide(tokens,
    mask=None)`` samples the site ``"z"`` inside the plate ``"sequences"``, matching
    :meth:`LatentThought.model`.
    """

    def __init__(self, loc: torch.Tensor, log_var: torch.Tensor) -> None:
        if loc.shape != log_var.shape or loc.ndim != 4:
            raise MalformedSequenceError(
                f"LocalGaussianGuide needs loc and log_var of one shape [B, L, N_z, d], got "
                f"{tuple(loc.shape)} and {tuple(log_var.shape)}")
        self.loc = loc
        self.log_var = log_var

    @classmethod
    def init(cls, batch_size: int, latent_shape: tuple[int, int, int], init_log_var: float = 0.0,
             device: torch.device | str | None = None) -> LocalGaussianGuide:
        """mu = 0, log sigma^2 = ``init_log_var`` (0: the prior), as leaf tensors that require grad."""
        loc = torch.zeros(batch_size, *latent_shape, device=device, requires_grad=True)
        log_var = torch.full((batch_size, *latent_shape), float(init_log_var), device=device, requires_grad=True)
        return cls(loc, log_var)

    @property
    def batch_size(self) -> int:
        return self.loc.shape[0]

    def parameters(self) -> list[torch.Tensor]:
        return [self.loc, self.log_var]

    def distribution(self, detach: bool = False) -> dist.Distribution:
        """q as a Pyro distribution with batch shape ``[B]`` and event shape ``[L, N_z, d]``."""
        loc, log_var = (self.loc.detach(), self.log_var.detach()) if detach else (self.loc, self.log_var)
        return dist.Normal(loc, (0.5 * log_var).exp()).to_event(3)

    def rsample(self, num_samples: int | None = None, detach: bool = False) -> torch.Tensor:
        """Reparameterised draws: ``[B, ...]`` or ``[num_samples, B, ...]``."""
        shape = () if num_samples is None else (num_samples,)
        return self.distribution(detach).rsample(shape)

    def kl_to_prior(self, detach: bool = False) -> torch.Tensor:
        """KL(q || N(0, I)) per sequence ``[B]``, in closed form: 1/2 sum(mu^2 + sigma^2 - log sigma^2 - 1)."""
        loc, log_var = (self.loc.detach(), self.log_var.detach()) if detach else (self.loc, self.log_var)
        return 0.5 * (loc.pow(2) + log_var.exp() - log_var - 1.0).flatten(1).sum(-1)

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        n = 1 if tokens.ndim == 1 else tokens.shape[0]
        if n != self.batch_size:
            raise MalformedSequenceError(f"guide holds {self.batch_size} sequences but got {n}")
        with pyro.plate("sequences", n, dim=-1):
            return pyro.sample("z", self.distribution())


class LatentThought(nn.Module):
    """A Latent Thought Model (Sec 2.1): z ~ N(0, I) per layer, x | z by a window-k cross-attending decoder.

    Args:
        vocab_size: number of token ids (targets lie in ``[0, vocab_size)``); the decoder has one more
            row, the begin-of-sequence id ``vocab_size``.
        d_model, n_layers, n_heads: decoder width, depth, heads.
        n_z: latent vectors per decoder layer (N_z of Sec 2.4); z has shape ``[n_layers, n_z, d_latent]``.
        window: the self-attention window k (Sec 2.1, "Short Context Window"); ``None`` for full attention.
        d_latent: width of a latent vector (default ``d_model``, as App. A.1).
        d_ff, max_len, dropout: passed to the decoder (``max_len`` counts sequence tokens).
        pad_id: if set, positions holding it are padding (not scored) unless an explicit mask is given.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_z: int,
                 window: int | None = None, d_latent: int | None = None, d_ff: int | None = None,
                 max_len: int = 1024, dropout: float = 0.0, pad_id: int | None = None) -> None:
        super().__init__()
        if n_z < 1:
            raise ValueError(f"n_z (latent vectors per layer) must be >= 1, got {n_z}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if pad_id is not None and not 0 <= pad_id < vocab_size:
            raise ValueError(f"pad_id must lie in [0, {vocab_size}), got {pad_id}")
        self.vocab_size, self.n_z, self.pad_id = vocab_size, n_z, pad_id
        self.bos_id = vocab_size
        self.decoder = Transformer(vocab_size + 1, d_model, n_layers, n_heads, d_ff=d_ff, max_len=max_len,
                                   window=window, cross_attention=True, d_latent=d_latent, dropout=dropout)
        self.n_layers, self.d_latent, self.window = n_layers, self.decoder.d_latent, window

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(n_layers, n_z, d_latent)``: the event shape of z."""
        return (self.n_layers, self.n_z, self.d_latent)

    def config(self) -> dict[str, Any]:
        d = self.decoder
        return {"vocab_size": self.vocab_size, "d_model": d.d_model, "n_layers": d.n_layers, "n_heads": d.n_heads,
                "n_z": self.n_z, "window": d.window, "d_latent": d.d_latent, "d_ff": d.d_ff, "max_len": d.max_len,
                "dropout": d.dropout, "pad_id": self.pad_id}

    # -- data ------------------------------------------------------------------------------------------

    def _prepare(self, tokens: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[B, N]`` (long) and a boolean mask ``[B, N]`` (True = scored)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32) \
                or tokens.ndim not in (1, 2):
            raise MalformedSequenceError(f"tokens must be a LongTensor [N] or [B, N], got "
                                         f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                                         f"{tuple(getattr(tokens, 'shape', ()))}")
        tokens = tokens.long()
        if tokens.ndim == 1:
            tokens = tokens[None]
            mask = None if mask is None else mask[None]
        if tokens.shape[1] < 1:
            raise MalformedSequenceError("tokens must hold at least one position")
        if mask is None:
            mask = tokens != self.pad_id if self.pad_id is not None else torch.ones_like(tokens, dtype=torch.bool)
        else:
            mask = mask.to(torch.bool)
            if mask.shape != tokens.shape:
                raise MalformedSequenceError(f"mask shape {tuple(mask.shape)} != tokens shape {tuple(tokens.shape)}")
        bad = mask & ((tokens < 0) | (tokens >= self.vocab_size))
        if bad.any():
            raise MalformedSequenceError(f"scored token ids must lie in [0, {self.vocab_size}), got "
                                         f"{tokens[bad][0].item()}")
        return torch.where(mask, tokens, torch.zeros_like(tokens)), mask

    def _check_z(self, z: torch.Tensor, B: int) -> torch.Tensor:
        if not isinstance(z, torch.Tensor) or not z.is_floating_point() or z.ndim < 4 \
                or tuple(z.shape[-3:]) != self.latent_shape or z.shape[-4] not in (1, B):
            shape = ", ".join(map(str, self.latent_shape))
            raise MalformedSequenceError(f"z must be a float tensor [..., B={B}, {shape}] (B may be 1), "
                                         f"got {tuple(getattr(z, 'shape', ()))}")
        return z.expand(*z.shape[:-4], B, *self.latent_shape)

    # -- likelihood ------------------------------------------------------------------------------------

    def logits(self, tokens: torch.Tensor, z: torch.Tensor, max_rows: int = 4096) -> torch.Tensor:
        """Teacher-forced next-token logits ``[..., B, N, vocab_size]``; tokens ``[B, N]``, z ``[..., B, L, N_z, d]``.

        Position n is predicted from ``<bos>, x_1 .. x_{n-1}`` (within the window) and z (Eq. 1). Leading
        sample dimensions of z are flattened into the decoder batch, ``max_rows`` rows at a time.
        """
        B, N = tokens.shape
        z = self._check_z(z, B)
        sample_shape = z.shape[:-4]
        S = math.prod(sample_shape)
        inputs = torch.cat([torch.full_like(tokens[:, :1], self.bos_id), tokens[:, :-1]], dim=1)
        inputs = inputs.expand(S, B, N).reshape(S * B, N)
        zf = z.reshape(S * B, *self.latent_shape)
        chunks = []
        for i in range(0, S * B, max_rows):
            out, _ = self.decoder(inputs[i:i + max_rows], latents=zf[i:i + max_rows])
            chunks.append(out[..., :self.vocab_size])
        out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        return out.reshape(*sample_shape, B, N, self.vocab_size)

    def token_log_probs(self, tokens: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None,
                        max_rows: int = 4096) -> torch.Tensor:
        """log p(x_n | z, x_{<n}) per position ``[..., B, N]``; padding positions give 0."""
        tokens, mask = self._prepare(tokens, mask)
        logp = torch.log_softmax(upcast(self.logits(tokens, z, max_rows)), dim=-1)  # float32 for half precision
        lp = logp.gather(-1, tokens.expand(*logp.shape[:-1]).unsqueeze(-1)).squeeze(-1)
        return torch.where(mask, lp, torch.zeros_like(lp))

    def log_likelihood(self, tokens: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None,
                       max_rows: int = 4096) -> torch.Tensor:
        """log p_beta(x | z) = sum_n log p(x_n | z, x_{n-k:n-1}) (Eq. 1), exact teacher-forced sum.

        ``tokens [B, N]`` with ``z [..., B, L, N_z, d]`` gives ``[..., B]`` (batched over samples of z);
        ``tokens [N]`` with ``z [..., L, N_z, d]`` gives ``[...]``.
        """
        single = tokens.ndim == 1
        if single:
            z = z.unsqueeze(-4)
        out = self.token_log_probs(tokens, z, mask, max_rows).sum(-1)
        return out.squeeze(-1) if single else out

    forward = log_likelihood

    def log_prior(self, z: torch.Tensor) -> torch.Tensor:
        """log N(z; 0, I) summed over the event ``[L, N_z, d]``."""
        return dist.Normal(z.new_zeros(()), z.new_ones(())).log_prob(z).flatten(-3).sum(-1)

    # -- Pyro programs ---------------------------------------------------------------------------------

    def _program(self, tokens: torch.Tensor, mask: torch.Tensor | None, register: bool) -> torch.Tensor:
        tokens, mask = self._prepare(tokens, mask)
        B = tokens.shape[0]
        if register:
            pyro.module("ltm_decoder", self.decoder)
        zeros = torch.zeros(self.latent_shape, device=tokens.device)
        with pyro.plate("sequences", B, dim=-1, device=tokens.device):
            z = pyro.sample("z", dist.Normal(zeros, 1.0).to_event(3))
            logits = self.logits(tokens, z)
            pyro.sample("x", dist.Categorical(logits=logits).mask(mask).to_event(1), obs=tokens)
        return z

    def model(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The Pyro model: ``z ~ N(0, I)`` (site ``"z"``, event ``[L, N_z, d]``) per sequence in the plate
        ``"sequences"``, and the observed categorical site ``"x"`` over the teacher-forced logits, masked
        by padding. Registers the decoder with ``pyro.module("ltm_decoder", ...)``.
        Leading (particle) dimensions of z broadcast through the likelihood."""
        return self._program(tokens, mask, register=True)

    def conditioned_model(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same program without ``pyro.module``: the decoder is a fixed function (posterior inference)."""
        return self._program(tokens, mask, register=False)

    model.max_plate_nesting = 1  # the "sequences" plate: engines and objectives read it
    conditioned_model.max_plate_nesting = 1

    # -- variational Bayes (Eq. 5) -----------------------------------------------------------------------

    def elbo(self, tokens: torch.Tensor, guide: LocalGaussianGuide, mask: torch.Tensor | None = None,
             num_samples: int = 1, detach_guide: bool = False) -> torch.Tensor:
        """Monte Carlo ELBO (Eq. 5) per sequence ``[B]``: mean over ``num_samples`` reparameterised draws of
        log p(x | z), minus the closed-form KL(q || p). ``detach_guide`` cuts the path to (mu, log sigma^2)."""
        z = guide.rsample(num_samples, detach=detach_guide)
        recon = self.log_likelihood(tokens if tokens.ndim == 2 else tokens[None], z, mask).mean(0)
        return recon - guide.kl_to_prior(detach=detach_guide)

    def fit_local(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, num_steps: int = 16,
                  lr: float = 0.34, schedule: str = "constant", num_samples: int = 1, init_log_var: float = 0.0,
                  betas: tuple[float, float] = (0.9, 0.999)) -> LocalGaussianGuide:
        """Fast learning / inference-time computation (Algorithm 1, lines 5-11).

        Initialises (mu, log sigma^2) = (0, ``init_log_var``) per sequence and takes ``num_steps`` Adam steps
        (learning rate ``lr``; ``schedule="cosine"`` decays it to 0 over the steps, as the paper does for
        large T) on the ELBO of Eq. 5 with z reparameterised. The decoder is frozen (its parameters'
        ``requires_grad`` is off during the loop), so it is never changed and receives no gradient.
        Returns the fitted :class:`LocalGaussianGuide` (its tensors still require grad).
        """
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        if schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
        tokens2, mask2 = self._prepare(tokens, mask)
        guide = LocalGaussianGuide.init(tokens2.shape[0], self.latent_shape, init_log_var, tokens2.device)
        if num_steps == 0:
            return guide
        opt = torch.optim.Adam(guide.parameters(), lr=lr, betas=betas)
        with frozen(self.decoder), torch.enable_grad():
            for t in range(num_steps):
                if schedule == "cosine":
                    for g in opt.param_groups:
                        g["lr"] = 0.5 * lr * (1.0 + math.cos(math.pi * t / num_steps))
                loss = -self.elbo(tokens2, guide, mask2, num_samples).sum()
                grads = torch.autograd.grad(loss, guide.parameters())
                for p, g in zip(guide.parameters(), grads):
                    p.grad = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
                opt.step()
        for p in guide.parameters():
            p.grad = None
        return guide

    def iw_bound(self, tokens: torch.Tensor, proposal: dist.Distribution, num_samples: int,
                 mask: torch.Tensor | None = None, chunk: int = 64) -> torch.Tensor:
        """Importance-weighted bound log (1/K) sum_k p(x, z_k) / q(z_k), z_k ~ q, per sequence ``[B]``.

        ``proposal`` has batch shape ``[B]`` and event ``[L, N_z, d]``. A lower bound on log p(x) in
        expectation for any q (Jensen), tightening to log p(x) as K grows. Samples are drawn ``chunk`` at a
        time and scored in batches (no Python loop over single particles).
        """
        tokens2, mask2 = self._prepare(tokens, mask)
        log_w = []
        with torch.no_grad():
            for start in range(0, num_samples, chunk):
                k = min(chunk, num_samples - start)
                z = proposal.sample((k,))
                lw = self.log_likelihood(tokens2, z, mask2) + self.log_prior(z) - proposal.log_prob(z)
                log_w.append(torch.nan_to_num(lw, nan=-math.inf))
        return log_mean_exp(torch.cat(log_w), dim=0)

    def evaluate(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, num_steps: int = 16,
                 lr: float = 0.34, schedule: str = "constant", elbo_samples: int = 16, iw_samples: int = 0,
                 batch_size: int = 256, init_log_var: float = 0.0) -> dict[str, float]:
        """ELBO-perplexity exp(-sum ELBO / num_tokens) after ``num_steps`` inner steps (fast learning only,
        no decoder update), and with ``iw_samples = K > 0`` the importance-weighted perplexity bound using the
        fitted q as proposal. Both are upper bounds on the model's true perplexity (in expectation)."""
        tokens2, mask2 = self._prepare(tokens, mask)
        total_elbo, total_iw, n_tokens = 0.0, 0.0, int(mask2.sum())
        for i in range(0, tokens2.shape[0], batch_size):
            x, m = tokens2[i:i + batch_size], mask2[i:i + batch_size]
            guide = self.fit_local(x, m, num_steps, lr, schedule, init_log_var=init_log_var)
            with torch.no_grad():
                total_elbo += float(self.elbo(x, guide, m, elbo_samples, detach_guide=True).sum())
                if iw_samples > 0:
                    total_iw += float(self.iw_bound(x, guide.distribution(detach=True), iw_samples, m).sum())
        out = {"elbo": total_elbo, "num_tokens": n_tokens, "elbo_ppl": math.exp(-total_elbo / n_tokens)}
        if iw_samples > 0:
            out.update(iw_bound=total_iw, iw_ppl=math.exp(-total_iw / n_tokens), iw_samples=iw_samples)
        return out

    # -- Langevin (Eq. 4) --------------------------------------------------------------------------------

    def langevin_posterior(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, num_steps: int = 200,
                           warmup_steps: int = 100, num_chains: int = 2, step_size: float = 0.01,
                           adjust: bool = True, seed: int | None = None, progress: bool = False) -> Result:
        """Sample p(z | x) for ONE sequence with Langevin dynamics (Eq. 4), the decoder fixed.

        Runs :class:`ppl_thought.inference.Langevin` (MALA when ``adjust=True``: the Eq. 4 proposal plus a
        Metropolis correction so the posterior is exactly invariant; ``adjust=False`` is Eq. 4 as written,
        ULA) on :meth:`conditioned_model`. ``Result.samples["z"]`` is ``[num_chains, num_steps, 1, L, N_z, d]``.
        """
        from pyro.infer.autoguide.initialization import init_to_sample

        from ppl_thought.inference.langevin import Langevin

        tokens2, mask2 = self._prepare(tokens, mask)
        if tokens2.shape[0] != 1:
            raise MalformedSequenceError(f"langevin_posterior conditions on one sequence, got {tokens2.shape[0]}")
        engine = Langevin(step_size=step_size, num_steps=num_steps, num_chains=num_chains, warmup_steps=warmup_steps,
                          adjust=adjust, seed=seed, disable_progbar=not progress, init_strategy=init_to_sample,
                          target_accept=0.57 if adjust else 0.85)
        with frozen(self.decoder):
            return engine.run(self.conditioned_model, None, tokens2, mask2)

    def langevin_evaluate(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, iw_samples: int = 256,
                          num_steps: int = 200, warmup_steps: int = 100, num_chains: int = 2,
                          step_size: float = 0.01, adjust: bool = True, seed: int | None = None,
                          var_floor: float = 1e-4) -> dict[str, Any]:
        """A perplexity estimate from Langevin draws (Eq. 4), sequence by sequence.

        For each sequence, fit a diagonal Gaussian (mean, variance of all kept draws, variance floored at
        ``var_floor``) to the Langevin draws and use it as the proposal of the importance-weighted bound
        (:meth:`iw_bound`, K = ``iw_samples``). Why this choice: MCMC draws carry no density, so they do not
        give log p(x) directly (the harmonic-mean estimator from raw draws has infinite variance); an IW
        bound stays a valid bound for *any* proposal, is consistent as K grows, and is never looser than the
        ELBO of that same Gaussian (which is its K = 1 case). The draws thus enter only through the quality
        of the proposal; a poorly mixed chain gives a looser (still valid in expectation) bound, never a
        biased-low perplexity.
        """
        tokens2, mask2 = self._prepare(tokens, mask)
        bounds, accept = [], []
        for i in range(tokens2.shape[0]):
            res = self.langevin_posterior(tokens2[i], mask2[i], num_steps, warmup_steps, num_chains, step_size,
                                          adjust, None if seed is None else seed + i)
            z = res.samples["z"].reshape(-1, *self.latent_shape).detach()
            loc, var = z.mean(0), z.var(0, unbiased=z.shape[0] > 1).clamp_min(var_floor)
            proposal = dist.Normal(loc[None], var.sqrt()[None]).to_event(3)
            bounds.append(float(self.iw_bound(tokens2[i:i + 1], proposal, iw_samples, mask2[i:i + 1])))
            accept.append(float(res.stats["accept_prob"].mean()))
        n_tokens = int(mask2.sum())
        total = sum(bounds)
        return {"log_marginal_bound": total, "num_tokens": n_tokens, "ppl": math.exp(-total / n_tokens),
                "per_sequence": bounds, "mean_accept_prob": sum(accept) / len(accept)}


class DualRateTrainer:
    """Dual-rate (fast-slow) learning of an LTM, Algorithm 1.

    For each mini-batch: re-initialise the local (mu, log sigma^2) of every sequence and take
    ``inner_steps`` = T_fast Adam steps on the ELBO of Eq. 5 with the decoder frozen (fast learning, learning
    rate linear from ``fast_lr[0]`` = 0.3 to ``fast_lr[1]`` = 0.34 over training, App. A.2); then one AdamW
    step (betas 0.9, 0.95; gradient norm clipped to ``grad_clip``) on the decoder with the batch ELBO
    L_batch = (1/B) sum_i L_i, z drawn from the optimised q with the local parameters detached (slow
    learning; rate ``slow_lr`` with linear warmup then cosine decay to ``slow_lr_min``). The loss is
    normalised per token. Metrics per step are appended to :attr:`history`.
    """

    def __init__(self, ltm: LatentThought, total_steps: int, inner_steps: int = 16,
                 fast_lr: tuple[float, float] = (0.3, 0.34), slow_lr: float = 4e-4, slow_lr_min: float = 4e-5,
                 warmup_steps: int = 0, weight_decay: float = 0.0, grad_clip: float = 1.0, num_samples: int = 1,
                 inner_schedule: str = "constant", progress: bool = True) -> None:
        if total_steps < 1 or inner_steps < 0:
            raise ValueError(f"need total_steps >= 1 and inner_steps >= 0, got {total_steps}, {inner_steps}")
        self.ltm, self.total_steps, self.inner_steps = ltm, total_steps, inner_steps
        self.fast_lr, self.slow_lr, self.slow_lr_min, self.warmup_steps = fast_lr, slow_lr, slow_lr_min, warmup_steps
        self.grad_clip, self.num_samples, self.inner_schedule, self.progress = (grad_clip, num_samples,
                                                                                 inner_schedule, progress)
        self.optimizer = torch.optim.AdamW(ltm.decoder.parameters(), lr=slow_lr, betas=(0.9, 0.95),
                                           weight_decay=weight_decay)
        self.step_count = 0
        self.history: list[dict[str, float]] = []

    def current_fast_lr(self) -> float:
        return fast_lr_schedule(self.step_count / max(self.total_steps - 1, 1), *self.fast_lr)

    def step(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
        """One iteration of Algorithm 1 (lines 3-15) on a mini-batch; returns its metrics."""
        ltm = self.ltm
        tokens2, mask2 = ltm._prepare(tokens, mask)
        fast = self.current_fast_lr()
        slow = slow_lr_schedule(self.step_count, self.total_steps, self.slow_lr, self.slow_lr_min, self.warmup_steps)
        guide = ltm.fit_local(tokens2, mask2, self.inner_steps, fast, self.inner_schedule, self.num_samples)
        for g in self.optimizer.param_groups:
            g["lr"] = slow
        n_tokens = mask2.sum().clamp_min(1)
        z = guide.rsample(self.num_samples, detach=True)
        recon = ltm.log_likelihood(tokens2, z, mask2).mean(0)
        kl = guide.kl_to_prior(detach=True)
        loss = -(recon - kl).sum() / n_tokens
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(ltm.decoder.parameters(), self.grad_clip)
        self.optimizer.step()
        self.step_count += 1
        loss = loss.detach()
        metrics = {"step": self.step_count, "loss": float(loss), "elbo_ppl": math.exp(min(float(loss), 50.0)),
                   "recon_per_token": float(recon.detach().sum() / n_tokens),
                   "kl_per_token": float(kl.sum() / n_tokens),
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
