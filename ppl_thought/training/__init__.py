"""Training: the learning objectives of Sections 4, 6, 7 and App. L as ``pyro.infer.ELBO`` subclasses, the
SVI driver, the one-process / DDP ``Trainer``, active lifting (Section 6) and latent-thought training (dual-rate
learning, Algorithm 1 of the LTM paper). ``pt.train``; the engines they call are ``pt.infer``
(docs/architecture.md).
"""

from ppl_thought.training.active import ActiveGenerative as ActiveGenerative
from ppl_thought.training.active import ActiveLifting as ActiveLifting
from ppl_thought.training.active import ConditionalSamplerLoss as ConditionalSamplerLoss
from ppl_thought.training.active import GeneratorLoss as GeneratorLoss
from ppl_thought.training.active import MinimumLengthCoding as MinimumLengthCoding
from ppl_thought.training.active import active_terms as active_terms
from ppl_thought.training.active import conditional_decode as conditional_decode
from ppl_thought.training.active import conditional_encode as conditional_encode
from ppl_thought.training.active import encode as encode
from ppl_thought.training.active import score_function_surrogate as score_function_surrogate
from ppl_thought.training.latent_thought import DualRateTrainer as DualRateTrainer
from ppl_thought.training.latent_thought import LangevinTrainer as LangevinTrainer
from ppl_thought.training.latent_thought import VAETrainer as VAETrainer
from ppl_thought.training.latent_thought import fast_lr_schedule as fast_lr_schedule
from ppl_thought.training.latent_thought import langevin_evaluate as langevin_evaluate
from ppl_thought.training.latent_thought import langevin_latents as langevin_latents
from ppl_thought.training.latent_thought import langevin_posterior as langevin_posterior
from ppl_thought.training.latent_thought import slow_lr_schedule as slow_lr_schedule
from ppl_thought.training.objectives import GRPO as GRPO
from ppl_thought.training.objectives import SFT as SFT
from ppl_thought.training.objectives import Inquisitive as Inquisitive
from ppl_thought.training.objectives import OneSampler as OneSampler
from ppl_thought.training.objectives import ParticleObjective as ParticleObjective
from ppl_thought.training.objectives import R1Zero as R1Zero
from ppl_thought.training.objectives import SamplerPolicyGradient as SamplerPolicyGradient
from ppl_thought.training.objectives import SeparatePolicy as SeparatePolicy
from ppl_thought.training.objectives import Sum as Sum
from ppl_thought.training.objectives import TwoSampler as TwoSampler
from ppl_thought.training.objectives import group_advantages as group_advantages
from ppl_thought.training.svi import SVI as SVI
from ppl_thought.training.trainer import Trainer as Trainer
from ppl_thought.training.trainer import clip_joint_ as clip_joint_
from ppl_thought.training.trainer import cosine_lr as cosine_lr

__all__ = [
    "active_terms",
    "ActiveGenerative",
    "ActiveLifting",
    "clip_joint_",
    "conditional_decode",
    "conditional_encode",
    "ConditionalSamplerLoss",
    "cosine_lr",
    "DualRateTrainer",
    "encode",
    "fast_lr_schedule",
    "GeneratorLoss",
    "group_advantages",
    "GRPO",
    "Inquisitive",
    "langevin_evaluate",
    "langevin_latents",
    "LangevinTrainer",
    "langevin_posterior",
    "MinimumLengthCoding",
    "OneSampler",
    "ParticleObjective",
    "R1Zero",
    "SamplerPolicyGradient",
    "score_function_surrogate",
    "SeparatePolicy",
    "SFT",
    "slow_lr_schedule",
    "Sum",
    "SVI",
    "Trainer",
    "TwoSampler",
    "VAETrainer",
]

