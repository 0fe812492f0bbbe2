"""The local Gaussian guide of latent-thought models (latent-thought-models.txt, Eq. 5, Algorithm 1 line 6).

Continuous thoughts z in R^{L x N_z x d} get a diagonal Gaussian q(z | x_i) = N(mu_i, diag(sigma_i^2)) per
sequence; :meth:`ppl_thought.models.LatentThought.fit_local` fits it ("fast learning") and
:class:`ppl_thought.inference.DualRateTrainer` re-initialises it for every mini-batch.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from torch import nn

from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.validation import checked, per_token

__all__ = ["AmortizedGaussianEncoder", "LocalGaussianGuide"]


@checked
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
    @per_token
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

    @per_token
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


@checked
class AmortizedGaussianEncoder(nn.Module):
    """The amortised inference model q_phi(z | x) of the VAE baseline (latent-thought-models.txt, Sec 2.2,
    "Variational Autoencoder with Amortized Inference"): global parameters phi map a sequence to
    (mu, log sigma^2) of a diagonal Gaussian in one forward pass, instead of fitting local parameters per
    sequence.

    The network (small on purpose): each position n embeds the pair (x_{n-1}, x_n) (the first position the
    pair (<bos>, x_1)), the embeddings are averaged over the scored positions, and a two-layer MLP gives
    mu and log sigma^2 of shape ``latent_shape``. Averaged pair embeddings are a learned function of the
    bigram counts of x, which is what identifies a Markov chain. Calling it returns a
    :class:`LocalGaussianGuide` whose tensors carry the path to phi (reparameterised ELBO gradients, Eq. 5).
    """

    def __init__(self, vocab_size: int, latent_shape: tuple[int, int, int], hidden: int = 64) -> None:
        super().__init__()
        if vocab_size < 1 or hidden < 1 or len(latent_shape) != 3 or min(latent_shape) < 1:
            raise ConfigError(f"AmortizedGaussianEncoder needs vocab_size >= 1, hidden >= 1 and a "
                                         f"latent_shape of three positive sizes, got {vocab_size}, {hidden}, "
                                         f"{latent_shape}")
        self.vocab_size, self.latent_shape = vocab_size, tuple(latent_shape)
        self.pairs = nn.Embedding((vocab_size + 1) * vocab_size, hidden)
        size = latent_shape[0] * latent_shape[1] * latent_shape[2]
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 2 * size))
        with torch.no_grad():  # start at the prior: mu = 0, log sigma^2 = 0
            self.mlp[-1].weight.mul_(0.01)
            self.mlp[-1].bias.zero_()

    @per_token
    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> LocalGaussianGuide:
        """q_phi(z | x) for tokens ``[B, N]`` (ids in ``[0, vocab_size)``; ``mask`` True = scored)."""
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise MalformedSequenceError(f"tokens must be a LongTensor [B, N], got "
                                         f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                                         f"{tuple(getattr(tokens, 'shape', ()))}")
        if mask is None:
            mask = torch.ones_like(tokens, dtype=torch.bool)
        x = torch.where(mask, tokens.long(), torch.zeros_like(tokens, dtype=torch.long))
        if ((x < 0) | (x >= self.vocab_size)).any():
            raise MalformedSequenceError(f"tokens must lie in [0, {self.vocab_size}), got "
                                         f"{x[(x < 0) | (x >= self.vocab_size)][0].item()}")
        prev = torch.cat([torch.full_like(x[:, :1], self.vocab_size), x[:, :-1]], 1)
        h = self.pairs(prev * self.vocab_size + x)  # [B, N, hidden]
        w = mask.to(h.dtype)[..., None]
        pooled = (h * w).sum(1) / w.sum(1).clamp_min(1.0)
        loc, log_var = self.mlp(pooled).chunk(2, dim=-1)
        B = tokens.shape[0]
        return LocalGaussianGuide(loc.reshape(B, *self.latent_shape), log_var.reshape(B, *self.latent_shape))
