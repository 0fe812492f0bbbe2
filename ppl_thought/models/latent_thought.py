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
  sequence (:class:`ppl_thought.guides.LocalGaussianGuide`), parameterised by (mu, log sigma^2), fitted by a
  few Adam steps with a high learning rate on the ELBO with the decoder fixed (:meth:`LatentThought.fit_local`,
  "fast learning", Algorithm 1 lines 5-11).
* Dual-rate learning (Algorithm 1): :class:`ppl_thought.inference.DualRateTrainer` re-initialises the local
  parameters for each mini-batch, runs T_fast inner steps, then takes one slow AdamW step on the decoder with the
  optimised posterior held fixed (lines 13-15).
* Langevin dynamics (Eq. 4) as the alternative posterior sampler: :func:`ppl_thought.inference.langevin_posterior`
  runs :class:`ppl_thought.inference.Langevin` on the model conditioned on one sequence, decoder fixed.

Evaluation: the ELBO-perplexity ``exp(-ELBO / num_tokens)`` after T inner steps (an upper bound on the
true perplexity), and the importance-weighted bound ``log (1/K) sum_k p(x, z_k) / q(z_k)``, z_k ~ q
(tighter, still a bound in expectation, and consistent as K grows).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from torch import nn

from ppl_thought.distributions.token_rule import token_step, upcast
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.guides.gaussian import LocalGaussianGuide
from ppl_thought.lm.transformer import Transformer
from ppl_thought.validation import checked
from ppl_thought.weights import log_mean_exp

__all__ = ["LatentThought", "frozen"]


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


@checked
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
            raise ConfigError(f"n_z (latent vectors per layer) must be >= 1, got {n_z}")
        if vocab_size < 1:
            raise ConfigError(f"vocab_size must be >= 1, got {vocab_size}")
        if pad_id is not None and not 0 <= pad_id < vocab_size:
            raise ConfigError(f"pad_id must lie in [0, {vocab_size}), got {pad_id}")
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

    def batch(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked tokens ``[B, N]`` (long) and a boolean mask ``[B, N]`` (True = scored), from one sequence
        ``[N]`` or a batch, with or without a mask."""
        if tokens.dtype not in (torch.int64, torch.int32) \
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
        tokens, mask = self.batch(tokens, mask)
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

    # -- generation (Sec 2.3, Eq. 6-8) ------------------------------------------------------------------

    def generate(self, z: torch.Tensor, num_tokens: int, prefix: torch.Tensor | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Ancestral sampling of ``num_tokens`` tokens from p_beta(y | x, z) (Sec 2.3), one row per z.

        ``z [B, L, N_z, d]`` is one latent per row: a draw from q(z | x) fitted to the prefix gives the
        posterior-conditioned continuation of Eq. 7, a draw from N(0, I) with no prefix the unconditional
        sample of Eq. 8. ``prefix [B, M]`` (optional) is kept and continued. Returns ``[B, M + num_tokens]``.
        Each token is drawn from the softmax of the teacher-forced logits at its position (temperature 1, by
        :func:`~ppl_thought.distributions.token_rule.token_step`, the one token step), so the law of the output
        given z is exactly the product in Eq. 1.
        """
        if num_tokens < 0:
            raise MalformedSequenceError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if z.ndim != 4:
            raise MalformedSequenceError(f"z must be a float tensor [B, {', '.join(map(str, self.latent_shape))}], "
                                         f"got {tuple(getattr(z, 'shape', ()))}")
        B = z.shape[0]
        z = self._check_z(z, B)
        if prefix is None:
            out = torch.zeros(B, 0, dtype=torch.long, device=z.device)
        else:
            out, _ = self.batch(prefix)
            if out.shape[0] != B:
                raise MalformedSequenceError(f"prefix has {out.shape[0]} rows but z has {B}")
        if out.shape[1] + num_tokens > self.decoder.max_len:
            raise MalformedSequenceError(f"prefix + num_tokens = {out.shape[1] + num_tokens} exceeds the decoder's "
                                         f"max_len {self.decoder.max_len}")
        with torch.no_grad():
            for _ in range(num_tokens):
                # position n = len(out) is predicted from <bos>, out (the appended 0 is never read)
                probe = torch.cat([out, out.new_zeros(B, 1)], 1)
                law = torch.log_softmax(upcast(self.logits(probe, z)[:, -1]), -1)  # Eq. 1, every token
                nxt = token_step(None, None, None, generator=generator, log_probs=law).token  # the one token step
                out = torch.cat([out, nxt[:, None]], 1)
        return out

    # -- Pyro programs ---------------------------------------------------------------------------------

    def _program(self, tokens: torch.Tensor, mask: torch.Tensor | None, register: bool) -> torch.Tensor:
        tokens, mask = self.batch(tokens, mask)
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
            raise ConfigError(f"num_steps must be >= 0, got {num_steps}")
        if schedule not in ("constant", "cosine"):
            raise ConfigError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
        tokens2, mask2 = self.batch(tokens, mask)
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
        tokens2, mask2 = self.batch(tokens, mask)
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
        tokens2, mask2 = self.batch(tokens, mask)
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
