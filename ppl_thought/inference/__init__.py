"""Engines over any program (``pt.infer``; docs/architecture.md, "Engines").

Every engine takes a :class:`~ppl_thought.program.Program` (or, for the whole-trace engines, any Pyro model)
with a guide, runs its particles as one batch and returns a :class:`Result`:

* :class:`Importance` (estimator (3.2), Remark 3.4, (3.7)), :class:`SMC` (Lemma 2.1's segments or any
  program's steps; twists, groups, four resampling schemes; ``backend="static"`` for one-token programs);
* :func:`decode` (3.12)-(3.14), App. G's Algorithms 1-2, best-of-K; :func:`next_token_distribution` (G.1);
* :func:`greedy` / :func:`beam_search` (:mod:`ppl_thought.inference.search`): deterministic search, for comparison;
* :class:`Langevin` / :class:`LangevinKernel` (ULA / MALA for continuous latents);
* :func:`resample` and :data:`RESAMPLING`: the one resampler (:mod:`ppl_thought.inference.resampling`).

Training (SVI, the objectives, the Trainer, active lifting, latent-thought training) is ``pt.train``; the
verifier-guided samplers are ``pt.verifiers``.
"""

from ppl_thought.inference.decoding import Decoded as Decoded
from ppl_thought.inference.decoding import decode as decode
from ppl_thought.inference.decoding import next_token_distribution as next_token_distribution
from ppl_thought.inference.importance import Importance as Importance
from ppl_thought.inference.langevin import Langevin as Langevin
from ppl_thought.inference.langevin import LangevinKernel as LangevinKernel
from ppl_thought.inference.resampling import RESAMPLING as RESAMPLING
from ppl_thought.inference.resampling import resample as resample
from ppl_thought.inference.result import Result as Result
from ppl_thought.inference.result import load_result as load_result
from ppl_thought.inference.result import save_result as save_result
from ppl_thought.inference.search import beam_search as beam_search
from ppl_thought.inference.search import greedy as greedy
from ppl_thought.inference.smc import SMC as SMC

__all__ = [
    "Importance", "SMC", "Langevin", "LangevinKernel", "decode", "next_token_distribution", "Decoded", "Result",
    "save_result", "load_result", "resample", "RESAMPLING", "greedy", "beam_search",
]



#: names that lived here before the engines were separated from training and verifier sampling
_MOVED = {name: "pt.train" for name in (
    "ActiveGenerative", "ActiveLifting", "ConditionalSamplerLoss", "GeneratorLoss", "MinimumLengthCoding",
    "active_terms", "conditional_decode", "conditional_encode", "encode", "score_function_surrogate",
    "DualRateTrainer", "fast_lr_schedule", "langevin_evaluate", "langevin_posterior", "slow_lr_schedule", "GRPO",
    "SFT", "Inquisitive", "OneSampler", "ParticleObjective", "R1Zero", "SamplerPolicyGradient", "SeparatePolicy",
    "Sum", "TwoSampler", "group_advantages", "SVI", "Trainer", "clip_joint_", "cosine_lr")}
_MOVED.update({name: "pt.verifiers" for name in (
    "RejectionSampling", "TokenwiseRejection", "VerifierSMC", "TokenwiseBacktracking", "VGB")})
_MOVED.update({"ZeroWeightsError": "pt.errors", "SamplingBudgetError": "pt.errors",
               "UnsatisfiableConstraintError": "pt.errors"})


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"pt.infer.{name} is now {_MOVED[name]}.{name} (pt.infer holds the engines; "
                             "docs/architecture.md)")
    raise AttributeError(f"module 'ppl_thought.inference' has no attribute {name!r}")
