"""Verifier-guided generation (``pt.verifiers``; the data-training-inference thesis, Chapter 3; docs/verifiers.md).

* :class:`ProcessVerifier` (Def 3.1.3) on a token automaton, :func:`dyck` (the bounded-depth Dyck language (2.37));
* :class:`VerifiedLM`: the LM restricted to the verifier's set A (Defs 3.1.2-3.1.3) as a ``pt.Program`` that every
  engine runs, drawing its tokens from the LM, the masked LM or by weighted rejection; its proposals as guides
  (:class:`LocallyOptimalProposal`, :class:`WeightedRejectionProposal`); its ``one_token_step()`` rule is
  :func:`length_automaton` (the verifier's automaton times the position); :class:`TokenSteps`: any token-level
  program's :class:`~ppl_thought.program.OneTokenStep` drawn by one of those proposals;
* the samplers, each ``run(program, guide, *args)`` on any token-level program (``one_token_step()``; ``run(lm,
  verifier, prompt)`` is sugar): :class:`RejectionSampling` (Def 3.1.4), :class:`TokenwiseRejection` (Def 3.1.5),
  :class:`VerifierSMC` (``pt.infer.SMC`` on :class:`TokenSteps`), :class:`TokenwiseBacktracking` (Algorithm 1),
  :class:`VGB`;
* a trained, imperfect verifier: :class:`LinearProbeVerifier` (Section 3.2.1.2) and its error parser
  :func:`first_errors`.

Names are imported on first use: :mod:`ppl_thought.verifiers.process` sits low in the layers (data sets build
verifiers), the samplers above the engines (docs/architecture.md, "The layers").
"""

from __future__ import annotations

import importlib

_NAMES = {
    "ProcessVerifier": "process", "dyck": "process",
    "VerifiedLM": "program", "LocallyOptimalProposal": "program", "WeightedRejectionProposal": "program",
    "NextToken": "program", "verifier_factor": "program", "TokenSteps": "program", "length_automaton": "program",
    "RejectionSampling": "sampling", "TokenwiseRejection": "sampling", "VerifierSMC": "sampling",
    "TokenwiseBacktracking": "backtracking", "VGB": "backtracking", "TabularValue": "backtracking",
    "LinearProbeVerifier": "trained", "first_errors": "trained",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        globals()[name] = getattr(importlib.import_module(f"ppl_thought.verifiers.{_NAMES[name]}"), name)
        return globals()[name]
    raise AttributeError(f"module 'ppl_thought.verifiers' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_NAMES))
