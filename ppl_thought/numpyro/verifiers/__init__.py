"""``ptn.verifiers``: verifier-guided generation on the JAX side (Chapter 3 of the data-training-inference thesis;
docs/verifiers.md, docs/numpyro.md; torch twin: ``pt.verifiers``).

* :class:`ProcessVerifier` (Def 3.1.3) on a token automaton (the same numpy tables as the torch one), :func:`dyck`
  (the bounded-depth Dyck language (2.37));
* :class:`VerifiedLM`: the LM restricted to the verifier's set A (Defs 3.1.2-3.1.3) as a ``ptn.Program``, drawing
  its tokens from the LM, the masked LM or by weighted rejection; :class:`LocallyOptimalProposal` as its guide;
  :class:`TokenSteps`: any token-level program's step (``one_token_step()``) drawn by one of those proposals;
* the samplers, each ``run(program, None, *args, rng_key=...)`` on any token-level program (``run(lm, verifier,
  prompt)`` is sugar), compiled through the generic engine core: :class:`RejectionSampling` (Def 3.1.4),
  :class:`TokenwiseRejection` (Def 3.1.5), :class:`VerifierSMC` (``ptn.infer.SMC`` on :class:`TokenSteps`).

Torch-only: Algorithm 1 (``TokenwiseBacktracking``) and VGB, whose control flow (erase and redo, a random walk with
restarts) depends on the values drawn: a host loop, not a fixed-shape compiled run (docs/numpyro.md).

Names are imported on first use.
"""

from __future__ import annotations

import importlib

_NAMES = {
    "ProcessVerifier": "process", "as_verifier": "process", "dyck": "ppl_thought.projections.constraints",
    "VerifiedLM": "program", "LocallyOptimalProposal": "program", "TokenSteps": "program", "DRAWS": "program",
    "RejectionSampling": "sampling", "TokenwiseRejection": "sampling", "VerifierSMC": "sampling",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        where = _NAMES[name]
        mod = where if "." in where else f"ppl_thought.numpyro.verifiers.{where}"
        globals()[name] = getattr(importlib.import_module(mod), name)
        return globals()[name]
    raise AttributeError(f"module 'ppl_thought.numpyro.verifiers' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_NAMES))
