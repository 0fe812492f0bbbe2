"""Small samplers for the engine tests (independent of pt.guides): causal lifting sampler, exact posterior."""

from __future__ import annotations

import pyro
import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought.distributions import LMSequence
from ppl_thought.lm.tabular import Tabular
from ppl_thought.models import SlowThinking
from ppl_thought.projections import PauseToThink
from ppl_thought.vocab import Vocab

VOCAB = Vocab(["a", "b"])


def tabular(vocab_size: int, seed: int, order: int = 2, scale: float = 1.5) -> Tabular:
    g = torch.Generator().manual_seed(seed)
    return Tabular(order, vocab_size, torch.randn((vocab_size,) * order, generator=g) * scale, trainable=False)


def pause_model(seed: int = 0, c: int = 2) -> SlowThinking:
    proj = PauseToThink(VOCAB, max_thought_len=c)
    return SlowThinking(tabular(len(VOCAB), seed), proj)


class LiftingSampler:
    """Q(z | x) = an LM decoded under the lifting of x (the causal sampler), optionally with a prompt."""

    def __init__(self, lm, model: SlowThinking, prompt=None):
        self.lm, self.model, self.prompt = lm, model, prompt

    def dist(self, x) -> LMSequence:
        x = self.model.x_ids(x)
        prompt = self.prompt(x) if callable(self.prompt) else self.prompt
        return LMSequence(self.lm, prompt=prompt, constraint=self.model.projection.lifting(x),
                          max_len=self.model.z_dist(len(x)).max_len)

    def sample_with_log_prob(self, x, n: int):
        return self.dist(x).sample_with_log_prob((n,))

    def sample(self, x, n: int):
        return self.sample_with_log_prob(x, n)[0]

    def log_prob(self, z, x):
        return self.dist(x).log_prob(z)

    def __call__(self, x):
        return pyro.sample("z", self.dist(x))


class Enumerated(TorchDistribution):
    """A distribution over the rows of ``support [K, L]`` with ``log_probs [K]``."""

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)

    def __init__(self, support, log_probs, batch_shape=()):
        self.rows, self.lps = support, log_probs
        super().__init__(torch.Size(batch_shape), torch.Size([support.shape[-1]]))

    def expand(self, batch_shape, _instance=None):
        return Enumerated(self.rows, self.lps, batch_shape)

    def sample(self, sample_shape=()):
        shape = torch.Size(sample_shape) + self.batch_shape
        idx = torch.multinomial(self.lps.exp(), max(1, shape.numel()), replacement=True)
        return self.rows[idx].reshape(shape + self.event_shape)

    def log_prob(self, value):
        eq = (value[..., None, :] == self.rows).all(-1)
        lp = torch.where(eq, self.lps, torch.full_like(self.lps, float("-inf")))
        return torch.logsumexp(lp, -1)


class ExactPosterior:
    """Q_*(z | x) of (2.24) by enumeration."""

    def __init__(self, model: SlowThinking):
        self.model = model

    def post(self, x):
        return self.model.exact_posterior(x)

    def sample_with_log_prob(self, x, n: int):
        p = self.post(x)
        idx = torch.multinomial(p.probs, n, replacement=True)
        return p.support[idx], p.log_probs[idx]

    def log_prob(self, z, x):
        p = self.post(x)
        return Enumerated(p.support, p.log_probs).log_prob(z)

    def __call__(self, x):
        p = self.post(x)
        return pyro.sample("z", Enumerated(p.support, p.log_probs))


# ------------------------------------------------------------------ priors under which thinking matters
def thinking_prior(seed: int = 0, boost: float = 4.0, favour_a: float = 1.5) -> Tabular:
    """An order-4 Tabular over VOCAB (3 tokens of context) under which a thought changes what comes next.

    Random N(0, 1) logits, plus: after a thought ending in y in {a, b} and one observable o, the next token
    is the observable y (``+boost``, thinking again ``-boost``); thoughts tend to start with ``aa``
    (``+favour_a``). So the next observable after x depends on the thought before x's last token, and
    decoding answers depend on how the prompt's latent Z0 is weighted (unlike under a bigram prior, where
    P(. | [Z0]) is the same for every lifting Z0 of x).
    """
    g = torch.Generator().manual_seed(seed)
    V = len(VOCAB)
    a, b, think, end = VOCAB.id("a"), VOCAB.id("b"), VOCAB.think_id, VOCAB.end_think_id
    logits = torch.randn((V,) * 4, generator=g)
    for y in (a, b):
        for o in (a, b, VOCAB.eos_id):
            logits[y, end, o, y] += boost
            logits[y, end, o, think] -= boost
    logits[:, :, think, a] += favour_a
    logits[:, think, a, a] += favour_a
    return Tabular(4, V, logits, trainable=False)


def thinking_model(seed: int = 0, c: int = 2) -> SlowThinking:
    """PauseToThink(c) over VOCAB with :func:`thinking_prior`."""
    return SlowThinking(thinking_prior(seed), PauseToThink(VOCAB, max_thought_len=c))


def contrary_lm(seed: int = 1, favour_b: float = 1.5) -> Tabular:
    """A random bigram that prefers ``b`` in thoughts: as a LiftingSampler for :func:`thinking_model` it
    puts its mass on thoughts the posterior Q_* finds unlikely (but has the same support)."""
    g = torch.Generator().manual_seed(seed)
    V = len(VOCAB)
    logits = torch.randn((V, V), generator=g)
    logits[VOCAB.think_id, VOCAB.id("b")] += favour_b
    logits[VOCAB.id("b"), VOCAB.id("b")] += favour_b
    return Tabular(2, V, logits, trainable=False)
