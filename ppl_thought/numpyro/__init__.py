"""ppl_thought.numpyro: the JAX / NumPyro backend (docs/numpyro.md). Never imports torch or pyro.

The same programs as the torch side, as NumPyro programs over the same vocabularies and projections (their
numpy automaton tables)::

    import ppl_thought.numpyro as ptn
    ptn.lm                       # LM protocol (LM, reorder), Tabular n-gram, Transformer (loads torch checkpoints)
    ptn.Program                  # the step-wise program protocol (init / step), as pt.Program
    ptn.sample, observe, factor, twist, particles   # its verbs (NumPyro primitives under the theory's names)
    ptn.dist                     # LMSequence (Def 2.8), ProjectionDelta, LMState: NumPyro distributions
    ptn.models                   # SlowThinking (Proj # P_f), HMM (Def 2.2, forward algorithm (3.1)), LatentThought
    ptn.guides                   # Identity (3.30), Predictive, Causal (3.33), Explanatory (Def 3.9), Posterior,
                                 # Inquisitive (3.22)
    ptn.infer                    # Importance (3.2), SMC, ELBO (for numpyro.infer.SVI), Result, ULA / MALA kernels,
                                 # encode, conditional_encode, conditional_decode (active lifting, (6.17)-(6.22))
    ptn.handlers                 # ProjectionLift: a plain LM program -> Proj # P_f
    ptn.transforms               # pt.transforms as NumPyro handlers: ProjectionLift, Forgetful, Persistent,
                                 # Ubiquitous, CostAware, ActiveLift, compose
    ptn.verifiers                # VerifiedLM (a Program), ProcessVerifier, RejectionSampling, TokenwiseRejection,
                                 # VerifierSMC over any token-level program (one_token_step() -> ptn.OneTokenStep)
    ptn.to_inference_data        # ArviZ InferenceData with the weights kept as on the torch side
    ptn.compile_stats()          # every compile of an engine run so far, and why (docs/numpyro.md, "Compilation")

Subpackages are imported on first use.
"""

from __future__ import annotations

import importlib

_SUBMODULES = {
    "lm": "ppl_thought.numpyro.lm",
    "dist": "ppl_thought.numpyro.dist",
    "distributions": "ppl_thought.numpyro.distributions",
    "models": "ppl_thought.numpyro.models",
    "guides": "ppl_thought.numpyro.guides",
    "infer": "ppl_thought.numpyro.infer",
    "handlers": "ppl_thought.numpyro.handlers",
    "transforms": "ppl_thought.numpyro.transforms",
    "verifiers": "ppl_thought.numpyro.verifiers",
}
_ATTRIBUTES = {
    "Program": "ppl_thought.numpyro.program",
    "OneTokenStep": "ppl_thought.numpyro.program",
    "sample": "ppl_thought.numpyro.program",
    "observe": "ppl_thought.numpyro.program",
    "factor": "ppl_thought.numpyro.program",
    "twist": "ppl_thought.numpyro.program",
    "particles": "ppl_thought.numpyro.program",
    "to_inference_data": "ppl_thought.numpyro.inference_data",
    "ProjectionLift": "ppl_thought.numpyro.handlers",
    "compile_stats": "ppl_thought.numpyro.infer.compiled",
}

__all__ = [*_SUBMODULES, *_ATTRIBUTES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        mod = importlib.import_module(_SUBMODULES[name])
        globals()[name] = mod
        return mod
    if name in _ATTRIBUTES:
        value = getattr(importlib.import_module(_ATTRIBUTES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ppl_thought.numpyro' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES) + list(_ATTRIBUTES))
