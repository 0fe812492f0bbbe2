"""Sampler families (Def 3.1) as Pyro guides for the site ``"z"`` (docs/architecture.md, "Guides").

The hierarchy of Section 3.6: identity (3.30) ⊆ predictive (Def 3.7) ⊆ causal (3.33) ⊆
explanatory (Def 3.9); the exact posterior Q_* (2.24) and the inquisitive sampler Q_bullet (3.22).

- :class:`Identity` (model), :class:`Predictive` (lm, projection): thought decisions with the next
  observable marginalised, then x_t forced.
- :class:`Causal` (lm, projection): the LM decoded under the lifting automaton (masked softmax).
- :class:`Explanatory` (lm, projection, mode_tag, gating): "x <explain> z" (Section 5.6.2).
- :class:`Posterior` (model), :class:`Inquisitive` (model, centered): exact, by enumeration.
- :class:`HMMGuide`: an HMM's exact posterior (backward algorithm) or filtering proposal, step-wise.
- :class:`LocalGaussianGuide`: the per-sequence Gaussian of latent-thought models (continuous z, Eq. 5);
  :class:`AmortizedGaussianEncoder`: the amortised (VAE) q_phi(z | x) that produces one.
- :func:`explanatory_guide`: the program view. (The gated LM of App. L is :class:`ppl_thought.lm.GatedLM`.)
- :class:`Sampler`, :class:`SamplerDistribution`: the protocol and its Pyro distribution.
"""

from ppl_thought.guides.base import Sampler, SamplerDistribution
from ppl_thought.guides.exact import Inquisitive, Posterior
from ppl_thought.guides.explanatory import Causal, Explanatory, explanatory_guide
from ppl_thought.guides.gaussian import AmortizedGaussianEncoder, LocalGaussianGuide
from ppl_thought.guides.hmm import HMMGuide
from ppl_thought.guides.predictive import Identity, MarginalizedDecoder, Predictive, emission_substitution

__all__ = [
    "AmortizedGaussianEncoder",
    "Causal",
    "Explanatory",
    "HMMGuide",
    "Identity",
    "Inquisitive",
    "LocalGaussianGuide",
    "MarginalizedDecoder",
    "Posterior",
    "Predictive",
    "Sampler",
    "SamplerDistribution",
    "emission_substitution",
    "explanatory_guide",
]

