"""ppl_thought: language models with latent thoughts as probabilistic programs.

A slow-thinking model is the tuple (Sigma, Omega, Proj, P, Q) of the static theory
(slow-thinking-active-perception, Section 3.7). The public names::

    import ppl_thought as pt
    pt.Vocab                      # token strings <-> ids with reserved specials
    pt.projections                # Proj, liftings, token automata (Sections 2.6, 5.1)
    pt.lm                         # Transformer (KV cache, window, cross-attention), Tabular n-gram
    pt.dist                       # LMSequence: Pyro distribution over token sequences (Def 2.8)
    pt.models                     # SlowThinking (Proj # P_f), HMM (Def 2.2, Theorem 2.3)
    pt.data                       # synthetic tasks with exact answers (A5 cups-and-ball HMM)
    pt.infer                      # engines over any program: Importance, SMC, Langevin, decode (Result)
    pt.train                      # training: SVI, the objectives of Sections 4, 6, 7, Trainer, LTM training
    pt.verifiers                  # verifier-guided generation: VerifiedLM, VerifierSMC, rejection, backtracking
    pt.transforms                 # model transforms: ProjectionLift, Forgetful, Persistent, Ubiquitous, CostAware,
                                  # ActiveLift (Section 6)
    pt.Program                    # the step-wise program protocol (init / step); its four verbs pt.sample,
                                  # pt.observe, pt.factor, pt.twist; pt.particles, pt.particle_groups

Subpackages are imported on first use, so ``import ppl_thought`` stays light.
"""

from __future__ import annotations

import importlib

from ppl_thought.vocab import Vocab

__version__ = "0.1.0"

_SUBMODULES = {
    "projections": "ppl_thought.projections",
    "lm": "ppl_thought.lm",
    "dist": "ppl_thought.distributions",
    "distributions": "ppl_thought.distributions",
    "models": "ppl_thought.models",
    "data": "ppl_thought.data",
    "infer": "ppl_thought.inference",
    "inference": "ppl_thought.inference",
    "train": "ppl_thought.training",
    "training": "ppl_thought.training",
    "guides": "ppl_thought.guides",
    "diagnostics": "ppl_thought.diagnostics",
    "errors": "ppl_thought.errors",
    "io": "ppl_thought.io",
    "transforms": "ppl_thought.transforms",
    "verifiers": "ppl_thought.verifiers",
}

_ATTRIBUTES = {name: "ppl_thought.program" for name in ("Program", "Shared", "sample", "observe", "factor", "twist",
                                                         "particles", "particle_groups")}

__all__ = ["Vocab", "__version__", *_SUBMODULES, *_ATTRIBUTES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        mod = importlib.import_module(_SUBMODULES[name])
        globals()[name] = mod
        return mod
    if name in _ATTRIBUTES:
        value = getattr(importlib.import_module(_ATTRIBUTES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ppl_thought' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES) + list(_ATTRIBUTES))
