"""Tiny exact problems shared by the objective and trainer tests (PauseToThink c=2, two ordinary tokens)."""

import pyro
import torch

from ppl_thought.distributions import LMSequence
from ppl_thought.lm.tabular import Tabular
from ppl_thought.models import SlowThinking
from ppl_thought.projections import PauseToThink
from ppl_thought.vocab import Vocab

VOCAB = Vocab(["a", "b"])
PROJ = PauseToThink(VOCAB, max_thought_len=2)
X = torch.tensor(VOCAB.encode(["a", "b"]))


def tabular(seed: int, scale: float = 1.0) -> Tabular:
    g = torch.Generator().manual_seed(seed)
    return Tabular(2, len(VOCAB), torch.randn(len(VOCAB), len(VOCAB), generator=g) * scale)


class CausalGuide:
    """The causal sampler (3.33): q_lm decoded under the lifting of x, padded to the model's z length."""

    def __init__(self, q_lm, projection=PROJ, name="sampler"):
        self.q_lm, self.projection, self.name = q_lm, projection, name

    def dist(self, x) -> LMSequence:
        x = torch.as_tensor(x)
        L = self.projection.domain(len(x)).max_len
        return LMSequence(self.q_lm, constraint=self.projection.lifting(x.numpy()), max_len=L)

    def __call__(self, x):
        pyro.module(self.name, self.q_lm)
        return pyro.sample("z", self.dist(x))


def problem(prior_seed=0, q_seed=1):
    prior, q = tabular(prior_seed), tabular(q_seed)
    return prior, q, SlowThinking(prior, PROJ), CausalGuide(q)


def exact_nll(model, x=X) -> torch.Tensor:
    """-log (Proj # P)(x) (2.22) with gradients to the prior."""
    support, _ = model.enumerate_log_joint(x)
    return -torch.logsumexp(model.z_dist(len(x)).log_prob(support), 0)


def exact_reverse_kl(model, guide, x=X) -> torch.Tensor:
    """KL(Q(.|x) || Q_*(.|x)) over the enumerated lifting, with gradients to Q."""
    post = model.exact_posterior(x)
    log_q = guide.dist(x).log_prob(post.support)
    return (log_q.exp() * (log_q - post.log_probs.detach())).sum()
