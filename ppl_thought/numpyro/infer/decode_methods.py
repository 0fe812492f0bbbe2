"""Decoding (Proj # P)(. | [x]) given a prompt, on the JAX side: Section 3.3 and best-of-K (end of 5.5) over any
``ptn.Program`` (torch twin: ppl_thought/inference/decoding.py; docs/numpyro.md, "Decoding").

``ptn.infer.decode(program, guide, *args, method=..., n=16, num_samples=1, k=4, rng_key=None, static=(),
ess_threshold=0.0)`` runs the program on its own arguments: the *prompt* is the data it observes, the
*continuation* its output sites (``ptn.observe(name, d, None)``), drawn by the program itself. The guide (a
``ptn.Program`` with the program's steps, or ``None``: the program proposes) proposes the prompt's latents; the
latents its steps do not sample (the continuation's) are drawn by the program and left out of the weights, like
the outputs. In a JAX program ``t`` is traced and every step has the same sites, so an output site is sampled at
every step and *masked* (``numpyro.handlers.mask``) where it is not an output (e.g. before the end of the
prompt); an output counts where it is unmasked and the particle had not finished before the step.

* ``"direct"`` (3.12): one compiled run of ``num_samples`` particles (guide for the prompt, program for the
  rest): Z0 ~ Q(. | x), then Z ~ P(. | [Z0]), X = Proj(Z) (Prop 3.1: KL error bounded by KL(Q_* || Q)).
* ``"resampling"`` (3.14): ``num_samples`` independent sets of ``n`` particles (one compiled ``vmap``), one
  particle of each set chosen with probability proportional to p/q. The outputs are out of the weights, so the
  weights only involve the prompt's sites and the guide's latents; choosing a whole trajectory by them has the
  law of choosing Z0 by (3.14) and continuing it by (3.12) (Prop 3.3: E TV <= sqrt((6 chi2 + 2) / n)).
  ``ess_threshold > 0``: the sets are SMC runs (resampled on the device when the ESS falls under
  ``ess_threshold * n``, Lemma 2.1) and the choice uses their final weights.
* ``"best_of_k"``: K candidates by ``"resampling"``, each scored by log p_n of prompt + candidate ((3.2): one
  compiled run of ``k * n`` particles of the program with its outputs conditioned on the candidates' values; a
  particle that draws an output where its candidate has none, or finishes before its candidate's last output, has
  weight 0); the argmax of the scores (that of (3.7)).
* ``"streaming"`` (3.13): an iterator of ``(site, value)`` pairs: one particle, a compiled ``init`` and a
  compiled ``step`` (one compile for every t) driven by a Python loop that yields each step's outputs as soon as
  the step has drawn them (Prop 3.2).

Algorithm 2 (``"unbiased"``) and Algorithm 1 (``"exact"``) are torch-only (``pt.infer.decode``): each output
conditions a fresh run on the outputs decoded so far, a host loop over outputs by design (docs/numpyro.md).

Returns :class:`Decoded`: ``outputs`` ``{site: [S, T, ...]}`` for a site of the steps (``[S, ...]`` for one of
``init``), ``stats["active"]`` the same ``{site: bool}``, ``latents`` (the other sites), ``tokens [S, m]`` when
every output is one integer per step (each sample's active outputs in program order, -1 after its last).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from ppl_thought.checks import decoding_view, fraction, integer
from ppl_thought.errors import ConfigError, NumericalError, ZeroWeightsError, describe_proposal, zero_weights_message
from ppl_thought.numpyro.boundary import Array, checked_jax
from ppl_thought.numpyro.infer.decode_views import ACTIVE, ACTIVE_INIT, Runner, stream, views
from ppl_thought.numpyro.infer.resampling import prng_key, systematic_resample
from ppl_thought.numpyro.infer.steps import as_programs
from ppl_thought.resources import check_particles

METHODS = ("direct", "streaming", "resampling", "best_of_k")
TORCH_ONLY = ("unbiased", "exact")


@checked_jax
@dataclass
class Decoded:
    """The decoded samples (the torch side's ``Decoded``, with jnp arrays): ``tokens [S, m]`` (each sample's
    integer outputs in program order, -1 after its last; ``None`` unless every output is one integer per step),
    ``outputs`` ``{site: [S, T, ...]}`` (``[S, ...]`` for a site of ``init``), ``latents`` (every other site the
    program or its guide drew), ``stats`` (``active``: where each output was drawn; for ``"best_of_k"`` every
    candidate's ``candidates``, ``candidate_active``, ``candidate_tokens`` and ``scores``), the ``method``,
    ``prompt`` (the program's argument when it takes one). ``z`` is ``None`` on the JAX side."""

    tokens: Array | None
    z: Array | None = None
    stats: dict = field(default_factory=dict)
    method: str = ""
    prompt: Any = None
    outputs: dict = field(default_factory=dict)
    latents: dict = field(default_factory=dict)


@checked_jax
def decode(model: Any, guide: Any, *args: Any, method: str = "resampling", n: int = 16,
           max_new_tokens: int | None = None, num_samples: int = 1, stop_at_eos: bool | None = None, k: int = 4,
           rng_key: jax.Array | int | None = None, static: tuple = (), ess_threshold: float = 0.0
           ) -> Decoded | Iterator:
    """Decode continuations of a prompt with a ``ptn.Program``; see the module docstring for ``method``
    ((3.12)-(3.14), best-of-K). ``rng_key``: a PRNG key or an int seed (default ``PRNGKey(0)``); ``static``: the
    indices of arguments that must be concrete (as for ``ptn.infer.SMC``); ``ess_threshold``: SMC resampling inside
    each particle set of ``"resampling"`` / ``"best_of_k"`` (0: none, (3.14) exactly)."""
    if method not in METHODS:
        extra = (f"; {method!r} (Algorithms 1 and 2 of App. G) is torch-only: pt.infer.decode"
                 if method in TORCH_ONLY else "")
        raise ConfigError(f"unknown decoding method {method!r} for ptn.infer.decode; choose one of {METHODS}{extra}")
    n, num_samples, k = integer("n", n), integer("num_samples", num_samples), integer("k", k)
    threshold = fraction("ess_threshold", ess_threshold)
    if max_new_tokens is not None:
        integer("max_new_tokens", max_new_tokens, minimum=0)
    check_particles("ptn.infer.decode", n * max(num_samples, k))
    key = prng_key(rng_key)
    program = decoding_view(model, max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos)
    program, guide, args, _ = as_programs(program, guide, tuple(args), "decode")
    static = tuple(sorted({int(i) % max(len(args), 1) for i in static})) if args else ()
    prompt = args[0] if len(args) == 1 else None
    if method == "streaming":
        view, gview = views(program, guide)
        return stream(view, gview, args, key, static)
    if method == "direct":  # (3.12): Z0 ~ Q(. | x) for the prompt, the rest drawn by the program
        draws = _run(program, guide, args, key, static, num_samples, 1, 0.0, "decode (3.12)")
        draws = {s: v[0] for s, v in draws["samples"].items()}
        stats: dict = {}
    elif method == "resampling":
        draws, _ = _resample(program, guide, args, key, static, n, num_samples, threshold)
        stats = {}
    else:
        draws, stats = _best_of_k(program, guide, args, key, static, n, k, threshold)
    outputs, active, latents = _split(draws)
    stats["active"] = active
    return Decoded(_tokens(outputs, active), None, stats, method, prompt, outputs, latents)


def _run(program, guide, args, key, static, R: int, G: int, threshold: float, engine: str,
         conditioned: dict | None = None) -> dict:
    """G independent runs of R particles of the decoding views (one compiled ``vmap``): the engine's output,
    every sample ``[G, R, ...]``, ``log_weights [G, R]``."""
    names = tuple(conditioned or ())
    view, gview = views(program, guide, names)
    extra: tuple = ()
    if conditioned:
        for name in names:
            extra += conditioned[name]
        extra += (_conditioned_last(conditioned),)
    out = Runner(R, G).run(view, gview, tuple(args) + extra, key, static, threshold, engine)
    if G == 1:
        out = {**out, "log_weights": out["log_weights"][None],
               "samples": {s: v[None] for s, v in out["samples"].items()}}
    out["proposal"] = describe_proposal(guide)
    return out


def _conditioned_last(conditioned: dict) -> jax.Array:
    """``[R]`` the last step at which a candidate drew an output (-1: none in the steps)."""
    last = None
    for _values, active in conditioned.values():
        if active.ndim < 2:
            continue
        steps = jnp.where(active.astype(bool), jnp.arange(active.shape[1]), -1).max(1)
        last = steps if last is None else jnp.maximum(last, steps)
    if last is None:
        last = jnp.full(next(iter(conditioned.values()))[1].shape[:1], -1)
    return last.astype(jnp.int32)


def _log_weights(log_w: jax.Array) -> jax.Array:
    """log w = log p - log q per particle as decoding uses them: the weights of (3.14) and of best-of-K's (3.2),
    formed by the engine core. Every decoding method reads them here (the tests replace it with wrong weights to
    show that the statistical checks notice)."""
    return log_w


@jax.jit
def _choose(key: jax.Array, log_w: jax.Array) -> jax.Array:
    """One particle per set ``[G]``, with probability proportional to its weight (the resampler of the JAX
    side with one draw)."""
    keys = jax.random.split(key, log_w.shape[0])
    return jax.vmap(lambda kk, lw: systematic_resample(kk, lw, 1)[0])(keys, log_w)


def _resample(program, guide, args, key, static, n: int, S: int, threshold: float) -> tuple[dict, jax.Array]:
    """(3.14): S sets of n particles, one chosen per set with probability proportional to p/q (the final weights
    of an SMC run when ``threshold > 0``)."""
    k_run, k_pick = jax.random.split(key)
    out = _run(program, guide, args, k_run, static, n, S, threshold, "decode (3.14)")
    lw = out["log_weights"]
    _check_weights(lw, "resampling decoding (3.14)", out["proposal"])
    idx = _choose(k_pick, _log_weights(lw))
    rows = jnp.arange(S)
    return {s: v[rows, idx] for s, v in out["samples"].items()}, lw


def _check_weights(lw: jax.Array, what: str, proposal: str) -> None:
    """NaN or +inf weights are a :class:`NumericalError`; a set whose weights are all zero has no particle to
    choose: :class:`ZeroWeightsError` with the one message of both backends."""
    nan, inf, zero = jax.device_get((jnp.isnan(lw).any(), jnp.isposinf(lw).any(), jnp.isneginf(lw).all(-1).any()))
    if nan:
        raise NumericalError(f"{what}: NaN log weights (a log-probability, factor or twist is NaN)")
    if inf:
        raise NumericalError(f"{what}: a log weight of +inf (a log-probability or factor of +inf); a log-potential "
                             "must be finite or -inf")
    if zero:
        raise ZeroWeightsError(zero_weights_message(what, lw.shape[-1], proposal, group="of a particle set ",
                                                    where="given the prompt"))


def _best_of_k(program, guide, args, key, static, n: int, K: int, threshold: float) -> tuple[dict, dict]:
    """End of 5.5: K candidates by (3.14), each scored by log p_n(x y_k) of (3.2) with n particles of the program
    conditioned on y_k (all K * n particles in one compiled run); the argmax of the scores."""
    k_cand, k_score = jax.random.split(key)
    cands, _ = _resample(program, guide, args, k_cand, static, n, K, threshold)
    outputs, active, _ = _split(cands)
    data = {s: (jnp.repeat(v, n, 0), jnp.repeat(active[s].astype(jnp.int32), n, 0)) for s, v in outputs.items()}
    out = _run(program, guide, args, k_score, static, K * n, 1, 0.0, "decode (best-of-K)", conditioned=data)
    lw = out["log_weights"][0]
    if bool(jnp.isnan(lw).any() | jnp.isposinf(lw).any()):
        raise NumericalError("best-of-K decoding: NaN or +inf log weights (a log-probability, factor or twist)")
    scores = jax.scipy.special.logsumexp(_log_weights(lw).reshape(K, n), -1) - math.log(n)
    best = int(jnp.argmax(scores))  # one host read per decode: the chosen candidate
    pick = {s: v[best:best + 1] for s, v in cands.items()}
    return pick, {"candidates": outputs, "candidate_active": active, "candidate_tokens": _tokens(outputs, active),
                  "scores": scores}


def _split(samples: dict) -> tuple[dict, dict, dict]:
    """(outputs, their active flags, latents) of decoded samples (the views' records dropped)."""
    active = {}
    for s, v in samples.items():
        for prefix in (ACTIVE, ACTIVE_INIT):
            if s.startswith(prefix):
                a = v.astype(bool)
                active[s[len(prefix):]] = a.reshape(a.shape[:2] if prefix == ACTIVE else a.shape[:1])
    outputs = {s: v for s, v in samples.items() if s in active}
    latents = {s: v for s, v in samples.items() if s not in active and not s.startswith((ACTIVE, ACTIVE_INIT))
               and not s.startswith("_pt_")}
    return outputs, {s: active[s] for s in outputs}, latents


def _tokens(outputs: dict, active: dict) -> jax.Array | None:
    """``[S, m]``: each sample's outputs in program order (init's, then step by step in site order), -1 after its
    last; ``None`` unless every output is one integer per step."""
    if not outputs:
        return None
    cols, acts = [], []
    for s, v in outputs.items():
        a = active[s]
        if v.shape != a.shape or not jnp.issubdtype(v.dtype, jnp.integer):
            return None
        if v.ndim == 1:
            cols.insert(0, v[:, None])
            acts.insert(0, a[:, None])
    step = [(v, active[s]) for s, v in outputs.items() if v.ndim == 2]
    if step:  # interleave the step sites step by step: [S, T, sites] -> [S, T * sites]
        S, T = step[0][0].shape
        cols.append(jnp.stack([v for v, _ in step], 2).reshape(S, -1))
        acts.append(jnp.stack([a for _, a in step], 2).reshape(S, -1))
    vals, act = jnp.concatenate(cols, 1).astype(jnp.int32), jnp.concatenate(acts, 1)
    order = jnp.argsort(~act, axis=1, stable=True)  # the active ones first, in program order
    vals, act = jnp.take_along_axis(vals, order, 1), jnp.take_along_axis(act, order, 1)
    m = int(act.sum(1).max()) if act.size else 0  # one host read: the longest continuation
    return jnp.where(act, vals, -1)[:, :m]


__all__ = ["METHODS", "Decoded", "decode"]
