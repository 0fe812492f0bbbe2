"""Decoding (Proj # P)(. | [x]) given a prompt x: Section 3.3, Appendix G, best-of-K (end of 5.5); over any
program (docs/architecture.md, "Engines"; docs/inference.md, "decode").

``decode(model, guide, *args, method=...)`` with

* ``"direct"`` (3.12): Z0 ~ Q(. | x), then Z ~ P(. | [Z0]) and X = Proj(Z) (Prop 3.1: KL error
  bounded by KL(Q_* || Q)).
* ``"streaming"`` (3.13): the same process as an iterator that yields each output as soon as the
  latent prefix determines it (Prop 3.2).
* ``"resampling"`` (3.14): Z0 drawn from n particles of Q(. | x) with probabilities proportional
  to P(Z)/Q(Z | x), then continued as (3.12) (Prop 3.3: E TV <= sqrt((6 chi2 + 2) / n)).
* ``"unbiased"``: Algorithm 2 of App. G: at each step fresh Z_i ~ Q(. | X^(t)), weights w_i,
  m_i = ceil(n w_i^2 / sum w^2) continuations per particle (Algorithm 3), next-token vector (G.1).
* ``"exact"``: Algorithm 1 of App. G for small models (enumeration).
* ``"best_of_k"``: K candidates by (3.14); return the one with the largest estimated (Proj # P)(y | x)
  ((3.2) with ``n`` particles on xy: the argmax of log p_n(xy) is that of (3.7)).

**Any program.** ``decode(program, guide, *args, method=..., n=16, num_samples=1, k=4, generator=None,
**kwargs)`` runs a :class:`~ppl_thought.program.Program` (or any Pyro model that runs under the particle
plate) on its own arguments ``*args, **kwargs``: the *prompt* is the data the program observes, the
*continuation* is its output sites (``pt.observe(name, fn, None)``), drawn by the program itself. The
program says how much it generates (e.g. through a horizon argument: ``pt.observe(f"x_{t}", d, x[t] if
t < len(x) else None)`` up to ``t < T``). The guide (a Pyro function or program over the same arguments,
or ``None``: the program proposes) proposes the latents of the prompt; latents it does not propose (those
of the continuation) are drawn by the program, P continuing from [Z0], and are out of the weights like the
outputs (``partial_guide`` in :func:`~ppl_thought.inference.particles.sample_particles`); a guide that
samples an output site is a :class:`~ppl_thought.errors.SiteMismatchError`. Returns :class:`Decoded` with
``outputs`` ``{site: [num_samples, ...]}`` in program order, ``stats["active"]`` ``{site: bool
[num_samples]}`` (False where the program had finished that sample before the site) and, when every output
is one integer per sample (token ids), ``tokens [num_samples, num_outputs]`` (-1 where not active);
``"streaming"`` returns an iterator of ``(site, value)`` pairs. Per method:

* ``"direct"``: one engine run of ``num_samples`` particles (guide for the prompt, program for the rest).
* ``"resampling"``: one engine run of ``n * num_samples`` particles (a batch dimension), one chosen per
  sample with probability proportional to p/q. Outputs are out of the weights, so the weights only
  involve the prompt's sites (and the guide's latents); choosing a whole trajectory by them has the law of
  choosing Z0 by (3.14) and then continuing it by (3.12), because the continuation was drawn from P(. | Z0).
* ``"streaming"``: the program and its guide are stepped (``init``, then ``step(state, t, ...)``, one
  particle, :func:`~ppl_thought.inference.particles.run_step`) and each step's outputs are yielded as soon as
  the step has drawn them: (3.13).
* ``"best_of_k"``: K candidates by ``"resampling"``, each scored by log p_n of prompt + candidate ((3.2):
  one engine run of ``k * n`` particles of the program with its output sites conditioned on the candidates'
  values; a particle that finishes where its candidate did not, or the other way round, has weight 0).
* ``"unbiased"``: Algorithm 2: per decoded output, n particles of the program conditioned on the outputs
  decoded so far (X^(t)); Z^(t,i) is every site before the next output site (in the program's order),
  ``m_i`` continuations of each by one engine run of the program with those sites and the decoded outputs
  fixed, rows repeated by ``repeat_interleave``; (G.1) over the values of the next output (and "the program
  finished"), from which the next output is drawn. ``stats["next_output_probs"]`` / ``["next_output_support"]``.
* ``"exact"``: Algorithm 1's ideal setting by enumeration: the program offers ``enumerate_sites(*args,
  **kwargs) -> {site: [K, ...]}``, every configuration of its latent and output sites (rows leading). All K are
  scored in one run of the program conditioned on them; the exact predictive law of the outputs is
  ``stats["output_law"]`` (``{"support": {site: [U, ...]}, "probs": [U]}``) and the samples are drawn from
  it. A :class:`~ppl_thought.errors.ConfigError` names what is missing when the program lacks the method
  or the enumeration misses a site or some probability mass.

**Protocol methods** (docs/programs.md; read with ``getattr``, never by a class test): a program may offer

* ``continuation(max_new_tokens=..., stop_at_eos=...) -> program``: its decoding view. ``decode`` runs that
  program instead (with the keywords given; without them, the method's defaults), e.g.
  :class:`~ppl_thought.models.SlowThinking`, whose :class:`~ppl_thought.models.slow_thinking.Continuation`
  observes the prompt x (site ``"z"``: its lifting Z0, proposed by the guide, e.g. ``pt.guides.Causal``; site
  ``"x"``: log 1{Proj(Z0) = x}) and then draws one next segment ``s_t`` (Def 2.5) and its observable ``y_t`` (an
  output) per step. Without the method, ``max_new_tokens`` / ``stop_at_eos`` are a
  :class:`~ppl_thought.errors.ConfigError` (a program decides its own length through its arguments).
* ``next_output_law(decoded, *args, **kwargs) -> (site, values [U, ...], probs [U]) | None``: the exact law of
  the next output given the outputs decoded so far (a list of values, in order), or ``None`` once it has
  finished; ``method="exact"`` uses it when the program offers no ``enumerate_sites`` (Algorithm 1 of App. G:
  SlowThinking's is lines 4-6 with the cache of line 8).
* ``output_values(*args, **kwargs) -> [U, ...]``: the values an output takes, the order of
  :func:`next_token_distribution`'s vector.

Search (:func:`~ppl_thought.inference.search.greedy`, :func:`~ppl_thought.inference.search.beam_search`) lives in
:mod:`ppl_thought.inference.search`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ppl_thought.checks import decoding_view, integer
from ppl_thought.errors import ConfigError
from ppl_thought.inference.decoding_methods import (
    _algorithm2_step,
    _program_algorithm2,
    _program_best_of_k,
    _program_exact,
    _program_resample,
)
from ppl_thought.inference.decoding_program import _Draws, _joined, _on_values, _ProgramRun, _stream_program, _tokens
from ppl_thought.inference.particles import engine_device
from ppl_thought.validation import checked

METHODS = ("direct", "streaming", "resampling", "unbiased", "exact", "best_of_k")


@checked
@dataclass
class Decoded:
    """``tokens [S, m]`` the program's integer outputs (-1 where the program had finished before the output;
    ``None`` unless every output is one integer per sample), ``outputs`` ``{site: [S, ...]}`` and ``latents``
    ``{site: [S, ...]}`` (for SlowThinking's continuation: ``"z"`` and every segment ``"s_t"``), ``stats`` (the
    next-output vectors for ``"unbiased"`` / ``"exact"``; for ``"best_of_k"`` every candidate's ``candidates``,
    ``candidate_tokens`` and ``scores``; ``active``), the ``method``; ``z [S, L]`` the latents joined when they
    are token segments (SlowThinking: Z0 followed by every S_t); ``prompt`` the program's
    argument when it takes one (the data it observes, e.g. x).
    ``pt.diagnostics.to_inference_data`` converts it."""

    tokens: torch.Tensor | None
    z: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)
    method: str = ""
    prompt: Any = None
    outputs: dict = field(default_factory=dict)
    latents: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- decode
@checked
def decode(model: Callable[..., Any], guide: Callable[..., Any] | None, *args: Any,
           method: str = "resampling", n: int = 16, max_new_tokens: int | None = None,
           num_samples: int = 1, stop_at_eos: bool | None = None, k: int = 4,
           generator: torch.Generator | None = None, **kwargs) -> Decoded | Iterator:
    """Decode continuations of a prompt; see the module docstring for ``method`` ((3.12)-(3.14), Algorithms 1
    and 2 of App. G, best-of-K).

    ``decode(program, guide, *args, **kwargs)``: the program (or its ``continuation(max_new_tokens=...,
    stop_at_eos=...)``, a protocol method) runs on ``*args, **kwargs`` (the prompt is what it observes, the
    continuation its output sites); returns :class:`Decoded` with ``outputs`` (and ``tokens [num_samples,
    num_outputs]`` when each output is one token id, -1 where the program had finished), or for
    ``"streaming"`` an iterator of ``(site, value)`` pairs.
    """
    if method not in METHODS:
        raise ConfigError(f"unknown decoding method {method!r}; choose one of {METHODS}")
    n, num_samples, k = integer("n", n), integer("num_samples", num_samples), integer("k", k)
    if max_new_tokens is not None:
        integer("max_new_tokens", max_new_tokens, minimum=0)
    engine_device(model, guide)  # DeviceMismatchError naming both devices
    if not callable(model):
        raise ConfigError(f"decode takes a pt.Program (or a Pyro model), got {type(model).__name__}")
    program = decoding_view(model, max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos)
    return _decode_program(program, guide, args, kwargs, method, n, num_samples, k, generator)


@checked
def next_token_distribution(model: Callable[..., Any], guide: Callable[..., Any] | None, *args: Any, n: int = 16,
                            method: str = "unbiased", generator: torch.Generator | None = None,
                            **kwargs: Any) -> torch.Tensor:
    """The law of the program's next output given its prompt, (Proj # P)^{<=|x|+1}(a | x) for a slow-thinking
    model, over ``output_values(*args, **kwargs)`` (a protocol method; Sigma in ``projection.observable_ids``
    order for SlowThinking); the mass of "the program finished" is what the vector lacks from 1.

    ``"unbiased"``: one step of Algorithm 2 (G.1): Z_i from the guide (i <= n), w_i = p/q, m_i = ceil(n w_i^2 /
    sum_j w_j^2) continuations per particle (Algorithm 3), p = sum_i w_i p_m^(i) / sum_i w_i. (G.1) is
    self-normalised, so its bias is O(chi2 / n) (Prop G.2 bounds its mean squared error by (32 chi2 + 12) / n).
    ``"exact"``: the program's ``next_output_law`` (Algorithm 1; small models only).
    """
    if method not in ("unbiased", "exact"):
        raise ConfigError(f"next_token_distribution: method must be 'unbiased' or 'exact', got {method!r}")
    n = integer("n", n)
    engine_device(model, guide)
    program = decoding_view(model, max_new_tokens=1) if callable(getattr(model, "continuation", None)) else model
    support = getattr(program, "output_values", None)
    if not callable(support):
        raise ConfigError(f"next_token_distribution needs {type(program).__name__}.output_values(*args, **kwargs) "
                          "-> [U, ...]: the values an output takes (docs/programs.md)")
    values = torch.as_tensor(support(*args, **kwargs))
    if method == "exact":
        law = getattr(program, "next_output_law", None)
        if not callable(law):
            raise ConfigError(f"method='exact' needs {type(program).__name__}.next_output_law(decoded, *args, "
                              "**kwargs) (Algorithm 1, docs/programs.md); or use method='unbiased'")
        nxt = law([], *args, **kwargs)
        if nxt is None:
            return torch.zeros(values.shape[0], device=values.device)
        _, got, p = nxt
        finished = torch.zeros(got.shape[0], dtype=torch.bool, device=got.device)
    else:
        with torch.no_grad():
            step = _algorithm2_step(_ProgramRun(program, guide, args, kwargs), n, {})
        if step is None:
            return torch.zeros(values.shape[0], device=values.device)
        _, p, finished, got = step
    return _on_values(values, got, finished, p)


def _decode_program(program, guide, args, kwargs, method, n, S, k, generator) -> Decoded | Iterator:
    """:func:`decode` for any program (module docstring)."""
    if method == "streaming":
        return _stream_program(program, guide, args, kwargs)
    run = _ProgramRun(program, guide, args, kwargs)
    stats: dict = {}
    if method == "direct":  # (3.12): Z0 ~ Q(. | x) for the prompt, the rest drawn by the program
        draws = _Draws.of(run.run(S).model_trace, S)
    elif method == "resampling":  # (3.14), then (3.12)
        draws, _ = _program_resample(run, n, S, generator)
    elif method == "best_of_k":
        draws, stats = _program_best_of_k(run, n, k, generator)
    elif method == "unbiased":
        draws, stats = _program_algorithm2(run, n, S, generator)
    else:
        draws, stats = _program_exact(run, S, generator)
    stats["active"] = draws.active
    prompt = args[0] if len(args) == 1 and not kwargs else None  # the data the program observes
    return Decoded(_tokens(draws), _joined(draws.latents), stats, method, prompt, draws.outputs, draws.latents)


__all__ = ["decode", "next_token_distribution", "Decoded", "METHODS"]
