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

``max_new_tokens`` and ``stop_at_eos`` belong to the token-level path below (a program decides its own
length: pass it as one of the program's arguments).

**The LMState path (a slow-thinking model).** A model that offers the *lifted LM protocol* (``prior``: its
latent LM, ``projection``: a Projection, ``x_ids(x)``; e.g. :class:`~ppl_thought.models.SlowThinking`) is
decoded by ``decode(model, sampler, x, method=..., n=16, max_new_tokens=8, num_samples=1, stop_at_eos=True,
k=4, generator=None)``; ``sampler`` is a guide with ``sample_with_log_prob(x, n) -> (z [n, L], log Q(z | x)
[n])``. Every LM computation goes through the one decoding loop, :class:`~ppl_thought.distributions.lm_state.LMState`
under the domain automaton ``projection.domain(|x| + max_new)`` (Def 2.8): a prompt lifting Z0 is
teacher-forced as one segment (``segment(until_emitted=|x|)``, whose log-probability is the
P^{<=|Z0|}(Z0) of the weights (3.14) / Algorithm 2, so the weights cost no extra pass), particles are
selected with ``reorder`` and continued with ``segment(until_emitted=...)``. Particles are batch rows;
tensors live on the LM's device (pass a ``generator`` on that device).

**Search, for comparison** (:func:`greedy`, :func:`beam_search`): the usual deterministic decoders of an LM under
a token automaton (``pt.infer.decoding.greedy(lm, prompt, constraint=auto)``). They are not samplers of any law
the engines target: greedy takes the most probable admissible token at each step; beam search keeps the
``width`` best prefixes by log-probability (one batch of ``width`` rows, the KV cache reordered with the beams),
so with a ``width`` at least the number of admissible sequences it returns the exact argmax of the score over
them. Score ``"model"``: the LM's own log-probabilities of the tokens (the mode of the constrained posterior
p(z | z in C), the law SMC approximates); ``"masked"``: the masked softmax of Def 2.8 (the law of masked
decoding, ``LMSequence`` under a constraint).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyro.poutine as poutine
import torch
from pyro.poutine.messenger import Messenger

from ppl_thought.checks import integer
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.errors import ConfigError, NotInDomainError, NotInImageError, ProgramError, ZeroWeightsError
from ppl_thought.guides.base import as_step_guide
from ppl_thought.inference.particles import (
    engine_device,
    find_max_plate_nesting,
    latent_sites,
    output_sites,
    particle_frame_dim,
    particle_plate,
    per_particle,
    require_program,
    run_step,
    sample_particles,
)
from ppl_thought.inference.resampling import ancestors, log_ratio
from ppl_thought.lm.base import as_id_batch, lm_device
from ppl_thought.lm.base import step as lm_step
from ppl_thought.models.slow_thinking import pad_sequences
from ppl_thought.program import OUTPUT, as_done, is_output
from ppl_thought.validation import ArrayLike, SupportsSampleWithLogProb, checked
from ppl_thought.vocab import BOS_ID, EOS_ID, PAD_ID

METHODS = ("direct", "streaming", "resampling", "unbiased", "exact", "best_of_k")


@checked
@dataclass
class Decoded:
    """``tokens [S, m]`` new observable tokens (``<pad>`` after a stop; for a program: its integer outputs, -1
    where not active, or ``None``), ``z [S, L]`` latent sequences (lifted LM path), ``outputs`` ``{site: [S,
    ...]}`` and ``latents`` ``{site: [S, ...]}`` (programs), ``stats`` (next-token vectors for ``"unbiased"`` /
    ``"exact"``; for ``"best_of_k"`` every candidate's ``candidates``, ``candidate_z`` and ``scores``), the
    ``method`` and the ``prompt`` ids x. ``pt.diagnostics.to_inference_data`` converts it (``z`` in
    ``posterior``, ``tokens`` in ``predictions``)."""

    tokens: torch.Tensor | None
    z: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)
    method: str = ""
    prompt: torch.Tensor | None = None
    outputs: dict = field(default_factory=dict)
    latents: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- weights
def _log_weights(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """log w = log P^{<=|z|}(z) - log Q(z | x): the weights of (3.2), (3.14) and Algorithm 2; -inf never NaN
    (:func:`~ppl_thought.inference.resampling.log_ratio`).

    Every decoding method forms its weights here (the tests replace it with wrong weights to check that they
    would notice).
    """
    return log_ratio(log_p, log_q)


# ---------------------------------------------------------------------------------------------- LMState helpers
def _device(model) -> torch.device:
    return lm_device(model.prior)


def _start(model, z0: torch.Tensor, num_observed, total: int) -> tuple[LMState, torch.Tensor]:
    """An LMState of ``z0.shape[0]`` rows under Dom(Proj) stopped at ``total`` observables, with the prompt
    liftings ``z0 [n, L0]`` (right-padded) teacher-forced as one segment ``until_emitted=num_observed``.

    Returns the state (ready to continue P(. | [Z0]), (3.12)) and log P^{<=|z0|}(z0) ``[n]`` (``-inf`` where
    z0 is not a complete lifting of the ``num_observed`` observables, or has probability 0).
    ``num_observed`` may be a per-row tensor.
    """
    lm, dev = model.prior, _device(model)
    dom = model.projection.domain(int(total))
    rule = TokenRule(dom, lm.vocab_size)
    z0 = torch.as_tensor(z0, dtype=torch.long, device=dev)
    max_len = dom.max_len if dom.max_len is not None else 1 << 30
    state = LMState.start(lm, z0.shape[0], rule=rule, max_len=max_len)
    until = num_observed.to(dev) if isinstance(num_observed, torch.Tensor) else int(num_observed)
    seg = state.segment(until_emitted=until)
    log_p = seg.log_prob(z0)
    state.extend(z0)
    return state, log_p


def _check_in_domain(state: LMState) -> None:
    if bool((state.s < 0).any()):
        raise NotInDomainError("a prompt latent sequence is outside Dom(Proj)")


def _continue(model, state: LMState, num_observed: int, max_new: int, stop_at_eos: bool,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Z ~ P(. | [Z0]) under the domain until ``max_new`` more observables are determined ((3.12); (3.13)
    read segment by segment). All rows in one lockstep loop (``LMState.segment``).

    With ``stop_at_eos`` a row stops after the latent token that emits ``<eos>``: the continuation is drawn
    one next segment (Def 2.5) at a time, ``segment(until_emitted=|x| + j)``, so the token that ends a
    segment is the one that determines the j-th new observable. Returns the latent rows ``z [S, L]``
    (right-padded) and the new observable tokens ``[S, max_new]`` (``<pad>`` after ``<eos>``).
    """
    dev = state.device
    eos = model.vocab.eos_id
    if max_new > 0 and not stop_at_eos:
        seg = state.segment(until_emitted=num_observed + max_new)
        val, _ = seg.sample_with_log_prob(generator)
        state.extend(val)
    elif max_new > 0:
        stopped = torch.zeros(state.n, dtype=torch.bool, device=dev)
        for j in range(1, max_new + 1):
            target = torch.where(stopped, torch.full_like(stopped, -1, dtype=torch.long),
                                 torch.full_like(stopped, num_observed + j, dtype=torch.long))
            seg = state.segment(until_emitted=target)
            val, _ = seg.sample_with_log_prob(generator)
            state.extend(val)
            if val.shape[1]:
                seg_len = (val != PAD_ID).sum(-1)
                last = val.gather(1, (seg_len - 1).clamp(min=0)[:, None]).squeeze(1)
                stopped = stopped | ((seg_len > 0) & (last == eos))
    z = state.tokens
    return z, _new_observables(model, z, num_observed, max_new, stop_at_eos)


def _new_observables(model, z: torch.Tensor, num_observed: int, max_new: int, stop_at_eos: bool) -> torch.Tensor:
    """Proj^{<w}(z)[|x| : |x| + max_new] per row, ``<pad>``-filled, cut after the first ``<eos>``."""
    xs = model.projection.project(z.cpu())  # the projection's batched (numpy) prefix projection, Def 2.6
    out = pad_sequences([xi[num_observed: num_observed + max_new] for xi in xs], max_new).to(z.device)
    if stop_at_eos:
        is_eos = (out == model.vocab.eos_id).long()
        after = (torch.cumsum(is_eos, 1) - is_eos) > 0
        out = out.masked_fill(after, PAD_ID)
    return out


def _resample(model, sampler, xt, n: int, num_samples: int, total: int, generator) -> LMState:
    """(3.14): for each of ``num_samples`` outputs, one of n particles Z^(i,0) ~ Q(. | x) chosen with
    p_i propto P^{<=|Z^(i,0)|}(Z^(i,0)) / Q(Z^(i,0) | x). One LMState prefill scores all n * num_samples
    particles; ``reorder`` keeps the chosen ones, ready to continue."""
    N = len(xt)
    z, lq = sampler.sample_with_log_prob(xt, n * num_samples)
    state, lp = _start(model, z, N, total)
    lw = _log_weights(lp, lq.to(lp.device)).reshape(num_samples, n)
    if bool(torch.isneginf(lw).all(-1).any()):
        raise ZeroWeightsError("resampling decoding: all n weights P/Q of a particle set are zero")
    idx = ancestors(lw.double(), "multinomial", generator, size=1).squeeze(-1)  # one of n per sample, propto P/Q
    state.reorder(torch.arange(num_samples, device=idx.device) * n + idx)
    return state


# ---------------------------------------------------------------------------------------------- decode
def lifts_lm(model) -> bool:
    """Whether ``model`` offers the lifted LM protocol of the LMState path: ``prior`` (its latent LM),
    ``projection`` (a Projection) and ``x_ids(x)`` (e.g. :class:`~ppl_thought.models.SlowThinking`)."""
    return getattr(model, "prior", None) is not None and getattr(model, "projection", None) is not None \
        and callable(getattr(model, "x_ids", None))


@checked
def decode(model: Callable[..., Any], guide: Callable[..., Any] | SupportsSampleWithLogProb | None, *args: Any,
           method: str = "resampling", n: int = 16, max_new_tokens: int | None = None,
           num_samples: int = 1, stop_at_eos: bool | None = None, k: int = 4,
           generator: torch.Generator | None = None, **kwargs) -> Decoded | Iterator:
    """Decode continuations of a prompt; see the module docstring for ``method`` ((3.12)-(3.14), Algorithms 1
    and 2 of App. G, best-of-K).

    ``decode(model, sampler, x, ...)`` for a model with the lifted LM protocol (:func:`lifts_lm`): returns
    :class:`Decoded` (``tokens [num_samples, max_new_tokens]``, ``max_new_tokens`` default 8, ``stop_at_eos``
    default True), or for ``"streaming"`` an iterator of observable token ids (one stream).

    ``decode(program, guide, *args, **kwargs)`` for any program: the program runs on ``*args, **kwargs``
    (the prompt is what it observes, the continuation its output sites); returns :class:`Decoded` with
    ``outputs``, or for ``"streaming"`` an iterator of ``(site, value)`` pairs.
    """
    if method not in METHODS:
        raise ConfigError(f"unknown decoding method {method!r}; choose one of {METHODS}")
    n, num_samples, k = integer("n", n), integer("num_samples", num_samples), integer("k", k)
    engine_device(model, guide)  # DeviceMismatchError naming both devices
    if lifts_lm(model):
        if len(args) != 1 or kwargs:
            raise ConfigError(f"decode({type(model).__name__}, sampler, x, ...) takes one prompt x (got {len(args)} "
                              f"positional argument(s) and keywords {sorted(kwargs)})")
        if max_new_tokens is not None:
            integer("max_new_tokens", max_new_tokens, minimum=0)
        return _decode_lifted(model, guide, args[0], method, n, 8 if max_new_tokens is None else max_new_tokens,
                              num_samples, True if stop_at_eos is None else stop_at_eos, k, generator)
    if max_new_tokens is not None or stop_at_eos is not None:
        raise ConfigError("max_new_tokens / stop_at_eos are for models with the lifted LM protocol (prior, "
                          f"projection, x_ids); a program such as {type(model).__name__} decides how much it "
                          "generates: pass the horizon as one of its arguments")
    return _decode_program(model, guide, args, kwargs, method, n, num_samples, k, generator)


def _decode_lifted(model, sampler, x, method, n, max_new_tokens, num_samples, stop_at_eos, k,
                   generator) -> Decoded | Iterator[int]:
    """The LMState path of a model with the lifted LM protocol."""
    xt = model.x_ids(x)
    model.projection.lifting(xt)  # NotInImageError for a prompt outside the image
    if sampler is None and method != "exact":
        raise ConfigError(f"decode({type(model).__name__}, None, x, method={method!r}) needs a sampler Q(z | x) "
                          "of the prompt's thoughts, e.g. pt.guides.Causal(lm, model.projection) or "
                          "pt.guides.Posterior(model); only method='exact' decodes without one")
    if method == "streaming":
        return _stream(model, sampler, xt, max_new_tokens, stop_at_eos, generator)
    out = _decode(model, sampler, xt, method, n, max_new_tokens, num_samples, stop_at_eos, k, generator)
    out.method, out.prompt = method, xt
    return out


def _decode(model, sampler, xt, method, n, max_new_tokens, num_samples, stop_at_eos, k, generator) -> Decoded:
    """Every method but streaming (see :func:`decode`)."""
    N = len(xt)
    with torch.no_grad():
        if method == "direct":  # (3.12)
            z0, _ = sampler.sample_with_log_prob(xt, num_samples)
            state, _ = _start(model, z0, N, N + max_new_tokens)
            _check_in_domain(state)
        elif method == "resampling":  # (3.14), then (3.12)
            state = _resample(model, sampler, xt, n, num_samples, N + max_new_tokens, generator)
        elif method == "unbiased":
            return _next_token_loop(model, xt, max_new_tokens, num_samples, stop_at_eos, generator,
                                    lambda X: next_token_distribution(model, sampler, X, n, "unbiased", generator))
        elif method == "exact":
            return _exact_loop(model, xt, max_new_tokens, num_samples, stop_at_eos, generator)
        else:
            return _best_of_k(model, sampler, xt, n, k, max_new_tokens, stop_at_eos, generator)
        z, toks = _continue(model, state, N, max_new_tokens, stop_at_eos, generator)
        return Decoded(toks, z)


def _stream(model, sampler, xt, max_new, stop_at_eos, generator) -> Iterator[int]:
    """(3.13) in its next-segment form: Z^(t) = Z^(t-1) S_t with S_t ~ P(. | Z^(t-1) -> next segment), one
    ``segment(until_emitted=|x| + t)`` of the LMState per step; yield X_t as soon as S_t determines it."""
    N = len(xt)
    with torch.no_grad():
        z0, _ = sampler.sample_with_log_prob(xt, 1)
        state, _ = _start(model, z0[:1], N, N + max_new)
        _check_in_domain(state)
    shown = N
    for t in range(1, max_new + 1):
        with torch.no_grad():
            seg = state.segment(until_emitted=N + t)
            val, _ = seg.sample_with_log_prob(generator)
            state.extend(val)
            emitted = int(state.rule.num_emitted(state.s)[0])
        if emitted > shown:
            row = state.tokens[0, : int(state.lengths[0])]
            xs = model.projection.project(row.cpu())
            for a in xs[shown:min(emitted, N + max_new)]:
                yield int(a)
                if stop_at_eos and int(a) == model.vocab.eos_id:
                    return
            shown = emitted
        if bool(state.done[0]) or shown >= N + max_new:
            return


def _next_token_loop(model, xt, max_new, num_samples, stop_at_eos, generator, dist_fn) -> Decoded:
    """Algorithm 1 line 7 / Algorithm 2: sample X_{t+1} from an estimated next-token vector, append, repeat."""
    dev = _device(model)
    sigma = torch.as_tensor(model.projection.observable_ids, device=dev)
    out = torch.full((num_samples, max_new), PAD_ID, dtype=torch.long, device=dev)
    probs_log: list = []
    for s in range(num_samples):
        X = xt.clone()
        for t in range(max_new):
            p = dist_fn(X)
            probs_log.append(p)
            a = sigma[torch.multinomial(p, 1, generator=generator)]
            out[s, t] = a[0]
            a = int(a)  # the next prompt X^(t+1) is handed to the sampler (one host sync per token: it is input)
            X = torch.cat([X, torch.tensor([a], device=X.device)])
            if stop_at_eos and a == model.vocab.eos_id:
                break
    return Decoded(out, None, {"next_token_probs": probs_log, "sigma": sigma})


@checked
def next_token_distribution(model: Callable[..., Any], sampler: SupportsSampleWithLogProb | None, x: ArrayLike,
                            n: int = 16, method: str = "unbiased",
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """(Proj # P)^{<=|x|+1}(a | x) over a in Sigma (``projection.observable_ids`` order).

    ``"unbiased"``: one step of Algorithm 2: Z_i ~ Q(. | x) (i <= n), w_i = P^{<=|Z_i|}(Z_i) / Q(Z_i | x),
    m_i = ceil(n w_i^2 / sum_j w_j^2) next segments S ~ P(. | Z_i -> next segment) per particle
    (Algorithm 3, ``segment(until_emitted=|x| + 1)`` of the reordered LMState) and the vector (G.1)
    p = sum_i w_i p_m^(i) / sum_i w_i. (G.1) is self-normalised, so its bias is O(chi2 / n) (Prop G.2 bounds
    its mean squared error by (32 chi2 + 12) / n). ``"exact"``: Algorithm 1 (enumeration; small models only).
    """
    engine_device(model, sampler)
    xt = model.x_ids(x)
    if method == "exact":
        with torch.no_grad():
            return _algorithm1_step(model, xt, _algorithm1_cache(model, xt))[0]
    N = len(xt)
    with torch.no_grad():
        z, lq = sampler.sample_with_log_prob(xt, n)
        state, lp = _start(model, z, N, N + 1)
        dev = lp.device
        sigma = torch.as_tensor(model.projection.observable_ids, device=dev)
        lw = _log_weights(lp, lq.to(dev))
        if bool(torch.isneginf(lw).all()):
            raise ZeroWeightsError("Algorithm 2: all n weights P/Q are zero")
        w = torch.softmax(lw.double(), 0)  # w_i / sum_j w_j
        m = torch.ceil(n * w**2 / (w**2).sum()).long().clamp(min=1)
        m = torch.where(w > 0, m, torch.zeros_like(m))
        rows = torch.repeat_interleave(torch.arange(n, device=dev), m)
        state.reorder(rows)
        _, toks = _continue(model, state, N, 1, False, generator)  # Algorithm 3: A_j with S_j in Phi_x(Z_i, A_j)
        onehot = (toks[:, :1] == sigma[None]).double()  # e_{A_j}
        per = torch.zeros(n, len(sigma), dtype=torch.float64, device=dev).index_add_(0, rows, onehot)
        per = per / m.clamp(min=1)[:, None].double()  # p_m^(i)
        p = (w[:, None] * per).sum(0)  # (G.1)
    return (p / p.sum()).float()


# ---------------------------------------------------------------------------------------------- Algorithm 1
def _algorithm1_cache(model, xt) -> dict[tuple[int, ...], float]:
    """Line 2 of Algorithm 1: {P^{<=|z|}(z) : z in Proj^{-1}_{<w}(x)} (log values, P(z) > 0 only)."""
    support, lp = model.enumerate_log_joint(xt)
    return {tuple(int(t) for t in row if t != PAD_ID): float(v) for row, v in zip(support, lp) if v > -math.inf}


def _algorithm1_step(model, xt, cache):
    """Lines 4-6 of Algorithm 1: p(a | X) = sum_z Q_*(z | X) P(Phi_X(z, a) | z), and the terms of line 8.

    Phi_X(z, a) is enumerated from the lifting of Xa; every P^{<=|zs|}(s | z) of line 4 is the
    log-probability of the segment s of the LMState started at z (one teacher-forced pass for all (z, s)).
    """
    proj = model.projection
    sigma = [int(a) for a in proj.observable_ids]
    keys = list(cache)
    index = {key: i for i, key in enumerate(keys)}
    lpz = torch.tensor([cache[key] for key in keys], dtype=torch.float64, device="cpu")  # host: enumeration
    post = torch.softmax(lpz, 0)  # line 5
    zi, segs, ai, zss = [], [], [], []
    for j, a in enumerate(sigma):
        try:
            lift = proj.lifting(torch.cat([xt.cpu(), torch.tensor([a], device="cpu")]))
        except NotInImageError:
            continue
        for zs in lift.enumerate():
            # the lifting of X is prefix-free: exactly one prefix of zs is in it (Lemma 2.1)
            cut = next((c for c in range(len(zs), -1, -1) if zs[:c] in index), None)
            if cut is None:
                continue
            zi.append(index[zs[:cut]])
            segs.append(zs[cut:])
            ai.append(j)
            zss.append(zs)
    p = torch.zeros(len(sigma), dtype=torch.float64, device="cpu")
    new_terms: dict[int, dict[tuple[int, ...], float]] = {a: {} for a in sigma}
    if zi:
        N = len(xt)
        state, _ = _start(model, pad_sequences(keys, device=_device(model)), N, N + 1)
        state.reorder(torch.tensor(zi, device=state.device))
        lp_s = state.segment(until_emitted=N + 1).log_prob(pad_sequences(segs, device=state.device))  # line 4
        lp_s = lp_s.double().cpu()
        zi_t, ai_t = torch.tensor(zi, device="cpu"), torch.tensor(ai, device="cpu")
        ok = ~torch.isneginf(lp_s)
        p.index_add_(0, ai_t[ok], post[zi_t[ok]] * lp_s[ok].exp())  # line 6
        lp_zs = lpz[zi_t] + lp_s  # line 8: P(zs) = P(z) P(s | z)
        for zs, j, v, good in zip(zss, ai, lp_zs.tolist(), ok.tolist()):
            if good:
                new_terms[sigma[j]][zs] = v
    return (p / p.sum()).float().to(_device(model)), new_terms


def _exact_loop(model, xt, max_new, num_samples, stop_at_eos, generator) -> Decoded:
    """Algorithm 1 (ideal setting): exact next-token distributions with the cache of line 8."""
    dev = _device(model)
    sigma = torch.as_tensor(model.projection.observable_ids, device=dev)
    out = torch.full((num_samples, max_new), PAD_ID, dtype=torch.long, device=dev)
    probs_log = []
    for s in range(num_samples):
        X, cache = xt.clone(), _algorithm1_cache(model, xt)
        for t in range(max_new):
            p, terms = _algorithm1_step(model, X, cache)
            probs_log.append(p)
            a = int(sigma[torch.multinomial(p, 1, generator=generator)])  # line 7
            out[s, t] = a
            X = torch.cat([X, torch.tensor([a], device=X.device)])
            cache = terms[a]  # line 8
            if stop_at_eos and a == model.vocab.eos_id:
                break
    return Decoded(out, None, {"next_token_probs": probs_log, "sigma": sigma})


# ---------------------------------------------------------------------------------------------- best of K
def _log_marginals(model, sampler, xs: list[torch.Tensor], n: int) -> torch.Tensor:
    """log p_n(x_k) of (3.2) for each prompt x_k: log (1/n) sum_i P(Z_i) / Q(Z_i | x_k), Z_i ~ Q(. | x_k).

    One sampler call per prompt; log P of all K * n particles in one LMState pass (per-row
    ``until_emitted=|x_k|`` under the domain of the longest x_k)."""
    zs, lqs, lens = [], [], []
    for xk in xs:
        z, lq = sampler.sample_with_log_prob(xk, n)
        zs.append(z)
        lqs.append(lq)
        lens.append(len(xk))
    width = max(z.shape[-1] for z in zs)
    dev = _device(model)
    z = torch.cat([torch.nn.functional.pad(zk.to(dev), (0, width - zk.shape[-1]), value=PAD_ID) for zk in zs])
    num = torch.tensor(lens, device=dev).repeat_interleave(n)
    _, lp = _start(model, z, num, max(lens))
    lw = _log_weights(lp, torch.cat([lq.to(lp.device) for lq in lqs])).reshape(len(xs), n)
    return torch.logsumexp(lw.double(), -1) - math.log(n)


def _best_of_k(model, sampler, xt, n, k, max_new, stop_at_eos, generator) -> Decoded:
    """End of 5.5: K candidates y_k by (3.14) + (3.12), each scored by log p_n(x y_k) ((3.2) on x y_k with
    n particles; its argmax is that of the conditional (3.7), p_n(x y) / p(x))."""
    N = len(xt)
    state = _resample(model, sampler, xt, n, k, N + max_new, generator)
    z, toks = _continue(model, state, N, max_new, stop_at_eos, generator)
    cands = [torch.cat([xt, y[y != PAD_ID].to(xt.device)]) for y in toks]
    scores = _log_marginals(model, sampler, cands, n)
    best = int(torch.argmax(scores))
    return Decoded(toks[best: best + 1], z[best: best + 1], {"candidates": toks, "candidate_z": z, "scores": scores})


# ---------------------------------------------------------------------------------------------- any program
_FIXED_OUTPUT = "_pt_fixed_output"  # the infer key of an output site that _Condition made an observation


class _Condition(Messenger):
    """Fix sites of a program to given values, rows leading ``[R, ...]`` (moved to the particle dim ``dim`` at
    the site): output sites become observations (their log-probability enters the weights, (3.2) on x y) and
    latent sites are observed too (scored, not drawn)."""

    def __init__(self, data: dict, dim: int):
        super().__init__()
        self.data, self.dim = data, dim

    def _pyro_sample(self, msg) -> None:
        v = self.data.get(msg["name"])
        if v is None or msg["is_observed"]:
            return
        ev = len(msg["fn"].event_shape)
        msg["value"] = v.movedim(0, v.ndim - ev + self.dim)
        msg["is_observed"] = True
        if is_output(msg):
            msg["infer"] = {**msg["infer"], OUTPUT: False, _FIXED_OUTPUT: True}


class _Conditioned:
    """``program`` with the sites in ``data`` fixed (:class:`_Condition`); a Pyro model for the engines."""

    def __init__(self, program, data: dict, dim: int):
        self.program, self.data, self.dim = program, data, dim
        self.max_plate_nesting = getattr(program, "max_plate_nesting", None)

    def __call__(self, *args, **kwargs):
        with _Condition(self.data, self.dim):
            return self.program(*args, **kwargs)


def _rows(site) -> torch.Tensor:
    """A site's value with the particle dim leading ``[R, ...]``."""
    d = particle_frame_dim(site)
    v = torch.as_tensor(site["value"])
    if d is None:
        raise ConfigError(f"site {site['name']!r} is outside the particle plate: a decoded program's outputs and "
                          "latents must carry the particles (sample them inside pt.particles()'s batch)")
    ev = len(site["fn"].event_shape)
    v = v.movedim(v.ndim - ev + d, 0)
    return v


def _active(site, R: int) -> torch.Tensor:
    """``[R]`` bool: the rows whose program had not finished at this site (its particle mask)."""
    v = torch.as_tensor(site["value"])
    m = site.get("mask")
    if m is None or m is True:
        return torch.ones(R, dtype=torch.bool, device=v.device)
    if m is False:
        return torch.zeros(R, dtype=torch.bool, device=v.device)
    bs = site["fn"].batch_shape
    m = torch.broadcast_to(torch.as_tensor(m, device=v.device), bs)
    m = m.movedim(len(bs) + particle_frame_dim(site), 0)
    return m.reshape(R, -1).all(-1)


@dataclass
class _Draws:
    """The output (and latent) sites of one engine run, rows leading; ``active`` per output site."""

    outputs: dict
    active: dict
    latents: dict

    @staticmethod
    def of(trace, R: int) -> _Draws:
        outs = output_sites(trace)
        return _Draws({k: _rows(s) for k, s in outs.items()}, {k: _active(s, R) for k, s in outs.items()},
                      {k: _rows(s) for k, s in latent_sites(trace).items()})

    def select(self, idx: torch.Tensor) -> _Draws:
        pick = {}
        for name in ("outputs", "active", "latents"):
            pick[name] = {k: v[idx.to(v.device)] for k, v in getattr(self, name).items()}
        return _Draws(**pick)


def _tokens(draws: _Draws) -> torch.Tensor | None:
    """The outputs as ``[S, m]`` token ids (-1 where not active) when each is one integer per sample."""
    vals = list(draws.outputs.values())
    if not vals or any(v.ndim != 1 or torch.is_floating_point(v) or v.dtype == torch.bool for v in vals):
        return None
    t = torch.stack([v.long() for v in vals], 1)
    act = torch.stack([draws.active[k].to(t.device) for k in draws.outputs], 1)
    return t.masked_fill(~act, -1)


class _ProgramRun:
    """One program, guide and arguments: engine runs of R particles (``sample_particles`` with a partial guide)."""

    def __init__(self, program, guide, args: tuple, kwargs: dict):
        self.program, self.guide, self.args, self.kwargs = program, guide, args, kwargs
        self.depth = find_max_plate_nesting(program, guide, args, kwargs)
        self.dim = -(self.depth + 1)
        self.device = engine_device(program, guide, args, kwargs)

    def run(self, R: int, data: dict | None = None, guide: bool = True):
        """Particles of R rows; ``data`` ``{site: [R, ...]}`` fixes sites (outputs become observations)."""
        model = _Conditioned(self.program, data, self.dim) if data else self.program
        with torch.no_grad(), poutine.block():
            return sample_particles(model, self.guide if guide else None, R, *self.args,
                                    max_plate_nesting=self.depth, partial_guide=True, **self.kwargs)

    def weights(self, p) -> torch.Tensor:
        """log w = log p - log q per particle: the weights of (3.2), (3.14) and Algorithm 2 (:func:`_log_weights`)."""
        return _log_weights(p.log_p, p.log_q.to(p.log_p.device))


def _finish_mismatch(trace, R: int, expected: dict, complete: bool) -> torch.Tensor:
    """``[R]`` bool: rows whose program finished elsewhere than the fixed outputs say (weight 0).

    ``expected`` ``{site: bool [R]}``: whether each fixed output site was drawn (the program had not finished).
    ``complete``: the fixed outputs are a whole continuation, so a row still active at a further output site
    does not match either."""
    dev = next(iter(expected.values())).device if expected else None
    bad = torch.zeros(R, dtype=torch.bool, device=dev)
    for name, want in expected.items():
        site = trace.nodes.get(name)
        got = _active(site, R).to(want.device) if site is not None else torch.zeros_like(want)
        bad = bad | (got != want)
    if complete:
        for site in output_sites(trace).values():
            bad = bad | _active(site, R).to(bad.device)
    return bad


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
    return Decoded(_tokens(draws), None, stats, method, None, draws.outputs, draws.latents)


def _stream_program(program, guide, args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(3.13) for a program: one particle, stepped through the Program protocol (``init``, then ``step(state, t,
    ...)`` until it returns finished flags; the guide's ``init`` / ``step`` propose the prompt's latents, the
    program draws the rest, :func:`~ppl_thought.inference.particles.run_step`); each step's outputs are yielded as
    ``(site, value)`` as soon as that step has drawn them (the value without the particle dim)."""

    require_program(program, "model")
    guide = as_step_guide(guide)
    require_program(guide, "guide")
    depth = find_max_plate_nesting(program, guide, args, kwargs)
    dim = -(depth + 1)
    dev = engine_device(program, guide, args, kwargs)
    plate = particle_plate(1, dim, device=dev)
    sm: dict = {}
    sg: dict = {}
    bound = program.max_steps if getattr(program, "max_steps", None) is not None else 10_000
    t = -1
    while True:
        if t >= bound:
            raise ProgramError(f"{type(program).__name__} did not finish within max_steps={bound} steps")
        if t < 0:
            mf, gf = (lambda: program.init(sm, *args, **kwargs)), (lambda: guide.init(sg, *args, **kwargs))
        else:
            mf = (lambda t=t: program.step(sm, t, *args, **kwargs))
            gf = (lambda t=t: guide.step(sg, t, *args, **kwargs))
        with torch.no_grad(), poutine.block():
            out = run_step(mf, gf if guide is not None else None, 1, dim, "in init" if t < 0 else f"in step {t}",
                           plate, dev, partial_guide=True)
        for name in out.outputs:
            v, d = out.values[name]
            yield name, (v.movedim(d, 0)[0] if d is not None else v)
        if t >= 0:
            done = as_done(out.done, 1, dev)
            if done is not None and bool(done.all()):
                return
        t += 1


def _program_resample(run: _ProgramRun, n: int, S: int, generator) -> tuple[_Draws, torch.Tensor]:
    """(3.14) for a program: one run of ``n * S`` particles (rows ``s * n .. s * n + n - 1`` serve sample s), one
    particle per sample chosen with probability proportional to p/q. The outputs are out of the weights, so the
    choice weighs the prompt's sites only, and the chosen trajectory's continuation, drawn from P(. | Z0), is
    (3.12) after (3.14)."""
    p = run.run(n * S)
    lw = run.weights(p).reshape(S, n)
    if bool(torch.isneginf(lw).all(-1).any()):
        raise ZeroWeightsError(f"resampling decoding: all {n} weights p/q of a particle set are zero (the proposal "
                               "only produced latents under which the program gives the prompt probability 0)")
    idx = ancestors(lw.double(), "multinomial", generator, size=1).squeeze(-1)  # one of n per sample, propto p/q
    idx = torch.arange(S, device=idx.device) * n + idx
    return _Draws.of(p.model_trace, n * S).select(idx), lw


def _program_best_of_k(run: _ProgramRun, n: int, K: int, generator) -> tuple[_Draws, dict]:
    """End of 5.5 for a program: K candidates by (3.14), each scored by log p_n(x y_k) of (3.2) with n particles
    of the program conditioned on y_k (all K * n particles in one run); the argmax of the scores."""
    cands, _ = _program_resample(run, n, K, generator)
    data = {name: v.repeat_interleave(n, 0) for name, v in cands.outputs.items()}
    want = {name: a.repeat_interleave(n, 0) for name, a in cands.active.items()}
    p = run.run(K * n, data)
    lw = run.weights(p)
    lw = torch.where(_finish_mismatch(p.model_trace, K * n, want, complete=True).to(lw.device),
                     torch.full_like(lw, -math.inf), lw)
    scores = torch.logsumexp(lw.view(K, n).double(), -1) - math.log(n)
    best = int(torch.argmax(scores))
    pick = torch.tensor([best], device=scores.device)
    return cands.select(pick), {"candidates": cands.outputs, "candidate_active": cands.active,
                                "candidate_tokens": _tokens(cands), "scores": scores}


def _program_algorithm2(run: _ProgramRun, n: int, S: int, generator) -> tuple[_Draws, dict]:
    """Algorithm 2 for a program, one sample at a time (the prompt grows with what was decoded).

    Step t: Z^(t,i), i <= n, from one run of the program with the decoded outputs X^(t) fixed (the guide
    proposes the prompt's latents); w_i = p/q (weight 0 where a particle finished before a decoded output);
    Z^(t,i) is every latent site before the next output site; m_i = ceil(n w_i^2 / sum_j w_j^2) continuations
    of particle i (Algorithm 3) by one run of the program with Z^(t,i) and X^(t) fixed, rows
    ``repeat_interleave(m)``; the next output's vector (G.1) p = sum_i w_i p_m^(i) / sum_i w_i over its values
    and "the program finished" (no further output); the next output is drawn from it.
    """
    outs, probs, supports = [], [], []
    for _ in range(S):
        fixed: dict = {}
        while True:
            data = {k: v.expand(n, *v.shape[1:]) for k, v in fixed.items()}
            p = run.run(n, data)
            trace = p.model_trace
            lw = run.weights(p)
            want = {k: torch.ones(n, dtype=torch.bool, device=v.device) for k, v in fixed.items()}
            lw = torch.where(_finish_mismatch(trace, n, want, complete=False).to(lw.device),
                             torch.full_like(lw, -math.inf), lw)
            nxt = list(output_sites(trace))
            if not nxt:
                break  # every particle finished: nothing more to decode
            if bool(torch.isneginf(lw).all()):
                raise ZeroWeightsError(f"Algorithm 2: all {n} weights p/q are zero given the prompt and the "
                                       f"{len(fixed)} output(s) decoded so far")
            name = nxt[0]
            w = torch.softmax(lw.double(), 0)
            m = torch.ceil(n * w**2 / (w**2).sum()).long().clamp(min=1)
            m = torch.where(w > 0, m, torch.zeros_like(m))
            rows = torch.repeat_interleave(torch.arange(n, device=m.device), m)
            M = int(rows.shape[0])
            prefix, latents = {}, latent_sites(trace)
            for key in trace.nodes:
                if key == name:
                    break
                if key in latents:
                    v = _rows(latents[key])
                    prefix[key] = v[rows.to(v.device)]
            prefix.update({k: v.expand(M, *v.shape[1:]) for k, v in fixed.items()})
            cont = run.run(M, prefix, guide=False).model_trace.nodes[name]  # Algorithm 3: m_i draws after Z^(t,i)
            y, act = _rows(cont), _active(cont, M)
            key = torch.cat([act[:, None].double(),
                             torch.where(act[:, None], y.reshape(M, -1).double(), torch.zeros((), dtype=torch.float64,
                                                                                                device=y.device))], 1)
            uniq, inv = torch.unique(key, dim=0, return_inverse=True)
            onehot = torch.nn.functional.one_hot(inv, uniq.shape[0]).double().to(w.device)
            per = torch.zeros(n, uniq.shape[0], dtype=torch.float64, device=w.device).index_add_(0, rows.to(w.device),
                                                                                               onehot)
            per = per / m.clamp(min=1)[:, None].double()  # p_m^(i)
            pv = (w[:, None] * per).sum(0)  # (G.1)
            pv = pv / pv.sum()
            probs.append(pv.float())
            supports.append({"site": name, "finished": ~uniq[:, 0].bool(), "values": uniq[:, 1:]})
            j = int(torch.multinomial(pv, 1, generator=generator))
            if not bool(uniq[j, 0]):
                break  # the program finished: no further output
            r = int((inv == j).nonzero()[0, 0])
            fixed[name] = y[r: r + 1]
        outs.append(dict(fixed))
    return _collect(outs), {"next_output_probs": probs, "next_output_support": supports}


def _collect(outs: list[dict]) -> _Draws:
    """Samples decoded one at a time (possibly of different lengths) as one :class:`_Draws` (rows leading)."""
    order: list[str] = []
    for o in outs:
        order += [k for k in o if k not in order]
    values, active = {}, {}
    for k in order:
        like = next(o[k] for o in outs if k in o)
        values[k] = torch.cat([o[k] if k in o else torch.zeros_like(like) for o in outs])
        active[k] = torch.tensor([k in o for o in outs], dtype=torch.bool, device=like.device)
    return _Draws(values, active, {})


def _keys(values: dict, act: dict, names: list) -> torch.Tensor:
    """``[R, D]`` float64 rows identifying each row's values at ``names`` (a site after the finish counts as absent)."""
    cols = []
    for k in names:
        v = values[k].reshape(values[k].shape[0], -1).double()
        a = act[k][:, None].to(v.device)
        cols += [a.double(), torch.where(a, v, torch.zeros((), dtype=torch.float64, device=v.device))]
    return torch.cat(cols, 1)


def _first_of_each(key: torch.Tensor) -> torch.Tensor:
    """The first row index of each distinct row of ``key``, in ``torch.unique``'s order."""
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)
    pos = torch.arange(key.shape[0], device=key.device)
    first = torch.full((uniq.shape[0],), key.shape[0], dtype=torch.long, device=key.device)
    return first.scatter_reduce_(0, inv, pos, "amin")


def _program_exact(run: _ProgramRun, S: int, generator) -> tuple[_Draws, dict]:
    """Algorithm 1's ideal setting for a program: every configuration of its latent and output sites
    (``program.enumerate_sites(*args, **kwargs)``) scored in one run, log p(z, y, x) per configuration; the
    exact predictive law of the outputs sums it over the configurations with the same outputs (configurations
    that differ only at sites after the program finished are one)."""
    enum = getattr(run.program, "enumerate_sites", None)
    if not callable(enum):
        raise ConfigError(f"method='exact' needs {type(run.program).__name__}.enumerate_sites(*args, **kwargs) -> "
                          "{site: tensor [K, ...]}: every configuration of the program's latent and output sites "
                          "(rows leading), to enumerate the exact law (Algorithm 1); or use method='unbiased'")
    support = {k: torch.as_tensor(v) for k, v in enum(*run.args, **run.kwargs).items()}
    K = {int(v.shape[0]) for v in support.values()}
    if len(K) != 1:
        raise ConfigError(f"enumerate_sites gave sites with different numbers of rows {sorted(K)}")
    K = K.pop()
    p = run.run(K, support, guide=False)
    trace = p.model_trace
    left = sorted(latent_sites(trace)) + sorted(output_sites(trace))
    if left:
        raise ConfigError(f"enumerate_sites must give every latent and output site of the program; missing {left}")
    sites = [k for k in trace.nodes if k in support]
    skip = frozenset(k for k, s in trace.nodes.items() if s["type"] == "sample" and k not in support)
    lp_sites = per_particle(trace, K, skip=skip).double()  # log p(z, y) of the enumerated sites
    joint = per_particle(trace, K).double()  # log p(z, y, x)
    act = {k: _active(trace.nodes[k], K) for k in sites}
    outs = [k for k in sites if trace.nodes[k]["infer"].get(_FIXED_OUTPUT, False)]
    first = _first_of_each(_keys(support, act, sites))  # configurations equal up to finished rows are one
    mass = float(torch.logsumexp(lp_sites[first.to(lp_sites.device)], 0).exp())
    if abs(mass - 1.0) > 1e-4:
        raise ConfigError(f"enumerate_sites misses configurations: their probability sums to {mass:.6f}, not 1")
    joint = joint[first.to(joint.device)]
    okey = _keys(support, act, outs)[first]
    uniq, inv = torch.unique(okey, dim=0, return_inverse=True)
    law = torch.zeros(uniq.shape[0], dtype=torch.float64, device=joint.device)
    law.index_add_(0, inv.to(law.device), torch.softmax(joint, 0))
    rep = first[_first_of_each(okey)]  # one configuration per distinct output, in the order of ``law``
    draws = _Draws({k: support[k][rep] for k in outs}, {k: act[k][rep] for k in outs}, {})
    idx = torch.multinomial(law.float(), S, replacement=True, generator=generator)
    return draws.select(idx), {"output_law": {"support": draws.outputs, "active": draws.active, "probs": law.float()}}


# ------------------------------------------------------------------------------------ greedy and beam search

SCORES = ("model", "masked")


@dataclass
class Searched:
    """The sequences a search found, best first: ``tokens [K, m]`` (new tokens, ``<pad>`` after ``<eos>``),
    ``log_prob [K]`` (the search's score of each, ``<eos>`` included), ``finished [K]`` (ended in a final
    state of the constraint, or with ``<eos>``; unfinished ones ran out of ``max_new_tokens`` and come after
    every finished one), the ``prompt`` and the ``score`` used."""

    tokens: torch.Tensor
    log_prob: torch.Tensor
    finished: torch.Tensor
    prompt: torch.Tensor
    score: str


def _step_scores(logits: torch.Tensor, s: torch.Tensor, rule: TokenRule, score: str) -> torch.Tensor:
    """``[W, V]`` log-probabilities of the next token, -inf where the constraint does not admit it."""
    if score == "masked":
        return rule.log_probs(logits, s)  # Def 2.8
    own = torch.log_softmax(logits.float(), -1)
    return own.masked_fill(~rule.allowed(s), float("-inf"))


@torch.no_grad()
def beam_search(lm: torch.nn.Module, prompt, *, constraint=None, width: int = 4, max_new_tokens: int = 32,
                score: str = "model") -> Searched:
    """Beam search under a token automaton (module docstring, "Search"), batched over the beams.

    Args:
        lm: an LM (LM protocol, lm/base.py): ``pt.lm.Transformer``, ``pt.lm.HuggingFace``, ...
        prompt: library ids (1-D); ``<bos>`` is written before them.
        constraint: a token :class:`~ppl_thought.projections.automaton.Automaton` (e.g. ``token_automaton``) or
            ``None`` (every token but ``<pad>`` / ``<bos>``).
        width: the number of beams W. The W best prefixes (or finished sequences, which keep their slot and
            score) by total score are kept at each step: one top-k over ``[W, V]``, the cache reordered by the
            beams' parents (``cache.reorder``). With W >= the number of admissible sequences of at most
            ``max_new_tokens`` tokens nothing is pruned and the best one is the exact argmax.
        max_new_tokens: the most tokens generated (``<eos>`` included).
        score: ``"model"`` (the LM's own log-probabilities) or ``"masked"`` (masked softmax, Def 2.8).

    Returns:
        :class:`Searched` with up to W sequences, best first (sequences whose score is -inf are dropped).
    """
    width = integer("width", width)
    max_new_tokens = integer("max_new_tokens", max_new_tokens)
    if score not in SCORES:
        raise ConfigError(f"score must be one of {SCORES}, got {score!r}")
    device = lm_device(lm)
    prompt_ids = as_id_batch(prompt, "prompt", device)
    if prompt_ids.shape[0] != 1:
        raise ConfigError(f"beam_search takes one prompt (1-D ids), got shape {tuple(prompt_ids.shape)}")
    V = int(lm.vocab_size)
    rule = TokenRule(constraint, V)
    ctx = torch.cat([torch.full((1, 1), BOS_ID, dtype=torch.long, device=device), prompt_ids], 1)
    logits, cache = lm(ctx)
    logits, cache = logits[:, -1].expand(width, V), cache.expand(width)
    s = rule.start(width, device)
    total = torch.full((width,), float("-inf"), device=device)
    total[0] = 0.0  # one live beam to start with; the others fill from its candidates
    done = torch.zeros(width, dtype=torch.bool, device=device)
    finished = torch.zeros(width, dtype=torch.bool, device=device)
    tokens = torch.empty(width, 0, dtype=torch.long, device=device)
    is_final = getattr(constraint, "is_final", None)
    # a finished beam's one continuation: <pad>, at its score
    keep = torch.full((1, V), float("-inf"), device=device).index_fill_(1, torch.tensor([PAD_ID], device=device), 0.0)
    for _ in range(max_new_tokens):
        cand = total[:, None] + torch.where(done[:, None], keep, _step_scores(logits, s, rule, score))
        total, flat = cand.reshape(-1).topk(width)
        parent, tok = flat // V, flat % V
        alive = total > float("-inf")
        tok = torch.where(alive, tok, torch.full_like(tok, PAD_ID))
        s = rule.advance(s[parent], tok)
        ended = (tok == EOS_ID) | (is_final(s) if is_final is not None else torch.zeros_like(alive))
        finished = (finished[parent] | ended) & alive
        done = done[parent] | ended | ~alive
        tokens = torch.cat([tokens[parent], tok[:, None]], 1)
        if bool(done.all()):
            break
        logits, cache = lm_step(lm, tok, cache.reorder(parent))
    order = torch.argsort(total, descending=True, stable=True)  # best first, finished ones before the others
    order = order[torch.argsort((~finished[order]).to(torch.int8), stable=True)]
    order = order[torch.isfinite(total[order])]
    return Searched(tokens[order], total[order], finished[order], prompt_ids[0], score)


def greedy(lm: torch.nn.Module, prompt, *, constraint=None, max_new_tokens: int = 32,
           score: str = "model") -> Searched:
    """Greedy decoding under a token automaton: at each step the most probable admissible token (the same
    token under either ``score``; the score only sets the reported ``log_prob``). :func:`beam_search` with
    one beam; returns :class:`Searched` with one row."""
    return beam_search(lm, prompt, constraint=constraint, width=1, max_new_tokens=max_new_tokens, score=score)


__all__ = ["decode", "next_token_distribution", "Decoded", "METHODS", "Searched", "beam_search", "greedy"]
