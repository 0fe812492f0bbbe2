"""A mixture of Markov chains: sequence data with an exact log p(x) (the latent-thought experiment's task).

Each sequence picks one of C Markov chains over V tokens uniformly and runs it, so
log p(x) = logsumexp_c [log(1/C) + log p(x | chain c)] exactly. A decoder that sees a window of k tokens
cannot tell the chain beyond its receptive field; a latent thought z can carry it over the sequence.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MarkovMixture", "dirichlet"]


class MarkovMixture:
    """C Markov chains over V tokens; a sequence picks a chain uniformly, then runs it (exact log p(x))."""

    def __init__(self, vocab_size: int, num_chains: int, concentration: float, generator: torch.Generator):
        conc = torch.full((num_chains, vocab_size, vocab_size), concentration)
        trans = torch.distributions.Dirichlet(conc).sample() if generator is None else dirichlet(conc, generator)
        init = dirichlet(torch.ones(num_chains, vocab_size), generator)
        self.log_trans, self.log_init = trans.clamp_min(1e-30).log(), init.clamp_min(1e-30).log()
        self.C, self.V = num_chains, vocab_size

    def sample(self, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
        chain = torch.randint(0, self.C, (n,), generator=generator)
        x = torch.empty(n, length, dtype=torch.long)
        x[:, 0] = torch.multinomial(self.log_init[chain].exp(), 1, generator=generator)[:, 0]
        for t in range(1, length):
            x[:, t] = torch.multinomial(self.log_trans[chain, x[:, t - 1]].exp(), 1, generator=generator)[:, 0]
        return x

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """Exact log p(x) per sequence: logsumexp over chains."""
        per_chain = self.log_init[:, x[:, 0]]  # [C, B]
        per_chain = per_chain + self.log_trans[:, x[:, :-1], x[:, 1:]].sum(-1)
        return torch.logsumexp(per_chain, 0) - math.log(self.C)


def dirichlet(conc: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Dirichlet draws through normalised Gamma draws made from the generator (torch's Dirichlet takes none)."""
    # Gamma(a) for a < 1 via Gamma(a + 1) * U^(1/a); Gamma(a + 1) by Marsaglia-Tsang.
    a = conc + 1.0
    d = a - 1.0 / 3.0
    c = 1.0 / torch.sqrt(9.0 * d)
    out = torch.empty_like(conc)
    todo = torch.ones_like(conc, dtype=torch.bool)
    while todo.any():
        z = torch.randn(conc.shape, generator=generator)
        u = torch.rand(conc.shape, generator=generator)
        v = (1.0 + c * z) ** 3
        ok = (v > 0) & (u.clamp_min(1e-30).log() < 0.5 * z * z + d - d * v + d * v.clamp_min(1e-30).log())
        take = todo & ok
        out[take] = (d * v)[take]
        todo &= ~take
    u = torch.rand(conc.shape, generator=generator).clamp_min(1e-30)
    g = out * u ** (1.0 / conc)
    return g / g.sum(-1, keepdim=True)
