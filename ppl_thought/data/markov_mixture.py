"""A mixture of Markov chains: sequence data with an exact log p(x) (the latent-thought experiment's task).

Each sequence picks one of C Markov chains over V tokens uniformly and runs it, so
log p(x) = logsumexp_c [log(1/C) + log p(x | chain c)] exactly. A decoder that sees a window of k tokens
cannot tell the chain beyond its receptive field; a latent thought z can carry it over the sequence.

The exact posterior over chains p(c | x) and the exact conditional law of a continuation,
p(y | x) = sum_c p(c | x) p(y | c, x_last), score the generations of latent-thought-models.txt Eq. 6-8
(``docs/latent-thought.md``, "Training-time sweep, learners and generation").
"""

from __future__ import annotations

import math

import torch

from ppl_thought.errors import MalformedSequenceError

__all__ = ["MarkovMixture", "dirichlet"]


class MarkovMixture:
    """C Markov chains over V tokens; a sequence picks a chain uniformly, then runs it (exact log p(x))."""

    def __init__(self, vocab_size: int, num_chains: int, concentration: float, generator: torch.Generator):
        conc = torch.full((num_chains, vocab_size, vocab_size), concentration)
        trans = torch.distributions.Dirichlet(conc).sample() if generator is None else dirichlet(conc, generator)
        init = dirichlet(torch.ones(num_chains, vocab_size), generator)
        self.log_trans, self.log_init = trans.clamp_min(1e-30).log(), init.clamp_min(1e-30).log()
        self.C, self.V = num_chains, vocab_size

    def sample(self, n: int, length: int, generator: torch.Generator,
               return_chains: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``n`` sequences ``[n, length]``; with ``return_chains`` also the chain of each ``[n]``."""
        chain = torch.randint(0, self.C, (n,), generator=generator)
        x = torch.empty(n, length, dtype=torch.long)
        x[:, 0] = torch.multinomial(self.log_init[chain].exp(), 1, generator=generator)[:, 0]
        for t in range(1, length):
            x[:, t] = torch.multinomial(self.log_trans[chain, x[:, t - 1]].exp(), 1, generator=generator)[:, 0]
        return (x, chain) if return_chains else x

    def _check(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int64, torch.int32) or x.ndim != 2 \
                or x.shape[1] < 1:
            raise MalformedSequenceError(f"{name} must be a LongTensor [B, N] with N >= 1, got "
                                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if ((x < 0) | (x >= self.V)).any():
            raise MalformedSequenceError(f"{name} token ids must lie in [0, {self.V}), got "
                                         f"{x[(x < 0) | (x >= self.V)][0].item()}")
        return x.long()

    def chain_log_likelihood(self, x: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
        """log p(x | chain c) per chain and sequence ``[C, B]``.

        Without ``start`` the first token is scored by the chain's initial law; with ``start`` ``[B]`` (the
        token before x, e.g. the last token of a prefix) every token of x is a transition.
        """
        x = self._check(x, "x")
        if start is None:
            per_chain = self.log_init[:, x[:, 0]]  # [C, B]
            return per_chain + self.log_trans[:, x[:, :-1], x[:, 1:]].sum(-1)
        prev = torch.cat([start.long()[:, None], x[:, :-1]], 1)
        return self.log_trans[:, prev, x].sum(-1)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """Exact log p(x) per sequence: logsumexp over chains."""
        return torch.logsumexp(self.chain_log_likelihood(x), 0) - math.log(self.C)

    def chain_log_posterior(self, x: torch.Tensor) -> torch.Tensor:
        """Exact log p(c | x) ``[B, C]`` (uniform prior over the C chains)."""
        return torch.log_softmax(self.chain_log_likelihood(x), 0).T

    def conditional_log_prob(self, prefix: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
        """Exact log p(y | x) per row ``[B]`` of a continuation y after a prefix x:
        logsumexp_c [log p(c | x) + log p(y | c, x_last)] (the data law's Eq. 6)."""
        prefix, continuation = self._check(prefix, "prefix"), self._check(continuation, "continuation")
        if prefix.shape[0] != continuation.shape[0]:
            raise MalformedSequenceError(f"prefix and continuation must have the same number of rows, got "
                                         f"{prefix.shape[0]} and {continuation.shape[0]}")
        post = self.chain_log_posterior(prefix).T  # [C, B]
        return torch.logsumexp(post + self.chain_log_likelihood(continuation, prefix[:, -1]), 0)

    def sample_continuation(self, prefix: torch.Tensor, length: int, generator: torch.Generator) -> torch.Tensor:
        """Continuations ``[B, length]`` drawn from the exact p(y | x): a chain c ~ p(c | x), then run from x_last."""
        prefix = self._check(prefix, "prefix")
        chain = torch.multinomial(self.chain_log_posterior(prefix).exp(), 1, generator=generator)[:, 0]
        y = torch.empty(prefix.shape[0], length, dtype=torch.long)
        prev = prefix[:, -1]
        for t in range(length):
            prev = torch.multinomial(self.log_trans[chain, prev].exp(), 1, generator=generator)[:, 0]
            y[:, t] = prev
        return y


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
