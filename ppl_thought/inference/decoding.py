"""Decoding (Proj # P)(. | [x]) given a prompt x: Section 3.3, Appendix G, best-of-K (end of 5.5).

``decode(model, sampler, x, method=...)`` with

* ``"direct"`` (3.12): Z0 ~ Q(. | x), then Z ~ P(. | [Z0]) and X = Proj(Z) (Prop 3.1: KL error
  bounded by KL(Q_* || Q)).
* ``"streaming"`` (3.13): the same process as an iterator that yields each observable token as
  soon as the latent prefix determines it (Prop 3.2).
* ``"resampling"`` (3.14): Z0 drawn from n particles of Q(. | x) with probabilities proportional
  to P(Z)/Q(Z | x), then continued as (3.12) (Prop 3.3: E TV <= sqrt((6 chi2 + 2) / n)).
* ``"unbiased"``: Algorithm 2 of App. G: at each step fresh Z_i ~ Q(. | X^(t)), weights w_i,
  m_i = ceil(n w_i^2 / sum w^2) continuations per particle (Algorithm 3), next-token vector (G.1).
* ``"exact"``: Algorithm 1 of App. G for small models (enumeration of the lifting).
* ``"best_of_k"``: K candidates by (3.14); return the one with the largest estimated (Proj # P)(y | x)
  ((3.2) with ``n`` particles on xy: the argmax of log p_n(xy) is that of (3.7)).

``sampler`` is a guide with ``sample_with_log_prob(x, n) -> (z [n, L], log Q(z | x) [n])``.
Particles are batch rows; continuations decode all rows in one lockstep loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ppl_thought.distributions.lm_sequence import BOS_ID, PAD_ID
from ppl_thought.inference._stepper import Stepper, context_rows, masked_log_softmax

METHODS = ("direct", "streaming", "resampling", "unbiased", "exact", "best_of_k")


@dataclass
class Decoded:
    """``tokens [S, m]`` new observable tokens (``<pad>`` after a stop), ``z [S, L]`` latent sequences,
    ``stats`` (next-token vectors for ``"unbiased"`` / ``"exact"``, scores for ``"best_of_k"``)."""

    tokens: torch.Tensor
    z: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)


def _rows_pad(rows: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
    w = max([len(r) for r in rows] + [0]) if width is None else width
    out = torch.full((len(rows), w), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def continue_prior(model, z0: torch.Tensor, num_observed: int, max_new: int, stop_at_eos: bool = True,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Z ~ P(. | [Z0]) under the domain until ``max_new`` more observable tokens are determined (3.12).

    ``z0 [S, L0]`` right-padded liftings of a prompt with ``num_observed`` tokens. Returns the
    continued latent rows ``[S, L]`` and the new observable tokens ``[S, max_new]`` (``<pad>``
    after ``<eos>`` when ``stop_at_eos``).
    """
    S = z0.shape[0]
    dom = model.projection.domain(num_observed + max_new)
    table = dom.torch_table()
    state = dom.start_states(S)
    for i in range(z0.shape[1]):
        tok = z0[:, i]
        state = torch.where(tok == PAD_ID, state, table[state, tok])
    if bool((state < 0).any()):
        raise ValueError("a prompt latent sequence is outside Dom(Proj)")
    lm = model.prior
    step = Stepper(lm).start(context_rows(torch.zeros(0, dtype=torch.long), z0, S))
    new: list[torch.Tensor] = []
    stopped = torch.zeros(S, dtype=torch.bool)
    rows = [list(r[r != PAD_ID].tolist()) for r in z0]
    with torch.no_grad():
        while True:
            active = ~dom.is_final(state) & ~stopped
            if not bool(active.any()):
                break
            mask = dom.mask(state)
            mask[:, PAD_ID] = False
            mask[:, BOS_ID] = False
            lp = masked_log_softmax(step.logits, mask)
            probs = torch.where(active[:, None], lp.exp(), torch.zeros_like(lp))
            probs[~active, PAD_ID] = 1.0
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            before = dom.num_emitted(state)
            state = torch.where(active, dom.step(state, tok), state)
            emitted = active & (dom.num_emitted(state) > before)
            for i in torch.nonzero(active).flatten().tolist():
                rows[i].append(int(tok[i]))
            if stop_at_eos:
                stopped = stopped | (emitted & (tok == model.vocab.eos_id))
            step.feed(tok, active)
    z = _rows_pad([torch.tensor(r, dtype=torch.long) for r in rows])
    xs = model.projection.project(z)
    out = torch.full((S, max_new), PAD_ID, dtype=torch.long)
    for i, xi in enumerate(xs):
        tail = torch.as_tensor(np.asarray(xi[num_observed : num_observed + max_new]), dtype=torch.long)
        if stop_at_eos and (tail == model.vocab.eos_id).any():
            tail = tail[: int(torch.nonzero(tail == model.vocab.eos_id)[0]) + 1]
        out[i, : len(tail)] = tail
        new.append(tail)
    return z, out


def _weights(model, z: torch.Tensor, log_q: torch.Tensor, num_observed: int) -> torch.Tensor:
    """log P^{<=|z|}(z) - log Q(z | x) (the summand of (3.2)); -inf never NaN."""
    dist = model.z_dist(num_observed)
    if z.shape[-1] < dist.max_len:
        z = torch.cat([z, torch.zeros(z.shape[:-1] + (dist.max_len - z.shape[-1],), dtype=torch.long)], -1)
    lp = dist.log_prob(z)
    return torch.where(torch.isneginf(lp), lp, lp - log_q)


def _resample_init(model, sampler, xt, n: int, num_samples: int, generator) -> torch.Tensor:
    """(3.14): for each of ``num_samples`` outputs, one of n particles of Q(. | x) with p_i propto P/Q."""
    z, lq = sampler.sample_with_log_prob(xt, n * num_samples)
    lw = _weights(model, z, lq, len(xt)).reshape(num_samples, n)
    if bool(torch.isneginf(lw).all(-1).any()):
        raise ValueError("resampling decoding: all n weights P/Q of a particle set are zero")
    idx = torch.multinomial(torch.softmax(lw, -1), 1, generator=generator).squeeze(-1)
    return z.reshape(num_samples, n, -1)[torch.arange(num_samples), idx]


def decode(model, sampler, x, method: str = "resampling", n: int = 16, max_new_tokens: int = 8,
           num_samples: int = 1, stop_at_eos: bool = True, k: int = 4,
           generator: torch.Generator | None = None) -> Decoded | Iterator[int]:
    """Decode continuations of the prompt x; see the module docstring for ``method``.

    Returns :class:`Decoded` (``tokens [num_samples, max_new_tokens]``), or for
    ``"streaming"`` an iterator of observable token ids (one stream).
    """
    if method not in METHODS:
        raise ValueError(f"unknown decoding method {method!r}; choose one of {METHODS}")
    xt = model.x_ids(x)
    model.projection.lifting(xt)  # NotInImageError for a prompt outside the image
    with torch.no_grad():
        if method == "streaming":
            return _stream(model, sampler, xt, max_new_tokens, stop_at_eos, generator)
        if method == "direct":
            z0, _ = sampler.sample_with_log_prob(xt, num_samples)
        elif method == "resampling":
            z0 = _resample_init(model, sampler, xt, n, num_samples, generator)
        elif method == "unbiased":
            return _next_token_loop(model, xt, max_new_tokens, num_samples, stop_at_eos, generator,
                                    lambda X: next_token_distribution(model, sampler, X, n, "unbiased", generator))
        elif method == "exact":
            return _exact_loop(model, xt, max_new_tokens, num_samples, stop_at_eos, generator)
        else:
            return _best_of_k(model, sampler, xt, n, k, max_new_tokens, stop_at_eos, generator)
        z, toks = continue_prior(model, z0, len(xt), max_new_tokens, stop_at_eos, generator)
        return Decoded(toks, z)


def _stream(model, sampler, xt, max_new, stop_at_eos, generator) -> Iterator[int]:
    """(3.13): extend Z one latent token at a time; yield each observable token once determined."""
    z0, _ = sampler.sample_with_log_prob(xt, 1)
    dom = model.projection.domain(len(xt) + max_new)
    z = [int(t) for t in z0[0] if t != PAD_ID]
    state = int(dom.run(np.asarray(z, dtype=np.int64))[-1])
    step = Stepper(model.prior).start(context_rows(torch.zeros(0, dtype=torch.long), z0[:1], 1))
    shown = len(xt)
    while not dom.final[state]:
        mask = torch.as_tensor(dom.allowed[state])[None].clone()
        mask[:, PAD_ID] = False
        mask[:, BOS_ID] = False
        probs = masked_log_softmax(step.logits, mask).exp()
        tok = int(torch.multinomial(probs, 1, generator=generator))
        z.append(tok)
        state = int(dom.next_state[state, tok])
        step.feed(torch.tensor([tok]), torch.ones(1, dtype=torch.bool))
        if dom.emitted[state] > shown:
            xs = model.projection.project(np.asarray(z, dtype=np.int64))
            for a in xs[shown : int(dom.emitted[state])]:
                yield int(a)
                if stop_at_eos and int(a) == model.vocab.eos_id:
                    return
            shown = int(dom.emitted[state])


def _next_token_loop(model, xt, max_new, num_samples, stop_at_eos, generator, dist_fn) -> Decoded:
    sigma = torch.as_tensor(model.projection.observable_ids)
    out = torch.full((num_samples, max_new), PAD_ID, dtype=torch.long)
    probs_log: list = []
    for s in range(num_samples):
        X = xt.clone()
        for t in range(max_new):
            p = dist_fn(X)
            probs_log.append(p)
            a = int(sigma[torch.multinomial(p, 1, generator=generator)])
            out[s, t] = a
            X = torch.cat([X, torch.tensor([a])])
            if stop_at_eos and a == model.vocab.eos_id:
                break
    return Decoded(out, None, {"next_token_probs": probs_log, "sigma": sigma})


def next_token_distribution(model, sampler, x, n: int = 16, method: str = "unbiased",
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """(Proj # P)^{<=|x|+1}(a | x) over a in Sigma (``projection.observable_ids`` order).

    ``"unbiased"``: (G.1) of Algorithm 2 with Algorithm 3 continuations; ``"exact"``: Algorithm 1
    (enumeration; small models only).
    """
    xt = model.x_ids(x)
    sigma = torch.as_tensor(model.projection.observable_ids)
    if method == "exact":
        return _algorithm1_step(model, xt, _algorithm1_cache(model, xt))[0]
    with torch.no_grad():
        z, lq = sampler.sample_with_log_prob(xt, n)
        lw = _weights(model, z, lq, len(xt))
        if torch.isneginf(lw).all():
            raise ValueError("Algorithm 2: all n weights P/Q are zero")
        w = torch.softmax(lw.double(), 0)  # w_i / sum_j w_j
        m = torch.ceil(n * w**2 / (w**2).sum()).long().clamp(min=1)
        m = torch.where(w > 0, m, torch.zeros_like(m))
        rows = torch.repeat_interleave(torch.arange(n), m)
        _, toks = continue_prior(model, z[rows], len(xt), 1, stop_at_eos=False, generator=generator)
        a = toks[:, 0]
        onehot = (a[:, None] == sigma[None]).double()  # Algorithm 3: e_{A_j}
        per = torch.zeros(n, len(sigma), dtype=torch.float64).index_add_(0, rows, onehot)
        per = per / m.clamp(min=1)[:, None].double()
        p = (w[:, None] * per).sum(0)
    return (p / p.sum()).float()


def _algorithm1_cache(model, xt) -> dict[tuple[int, ...], float]:
    support, lp = model.enumerate_log_joint(xt)
    return {tuple(int(t) for t in row if t != PAD_ID): float(v) for row, v in zip(support, lp) if v > -math.inf}


def _algorithm1_step(model, xt, cache):
    """Lines 4-6 of Algorithm 1: p(a | X) = sum_z Q_*(z | X) P(Phi_X(z, a) | z); also the terms for line 8."""
    proj = model.projection
    sigma = [int(a) for a in proj.observable_ids]
    keys = list(cache)
    lpz = torch.tensor([cache[k] for k in keys], dtype=torch.float64)
    post = torch.softmax(lpz, 0)  # line 5
    dist = model.z_dist(len(xt) + 1)
    ext: list[tuple[int, tuple[int, ...], int]] = []  # (z index, zs, a)
    for a in sigma:
        try:
            lift = proj.lifting(torch.cat([xt, torch.tensor([a])]))
        except Exception:
            continue
        for zs in lift.enumerate():
            for i, z in enumerate(keys):
                if zs[: len(z)] == z:
                    ext.append((i, zs, a))
                    break
    p = torch.zeros(len(sigma), dtype=torch.float64)
    new_terms: dict[int, dict[tuple[int, ...], float]] = {a: {} for a in sigma}
    if ext:
        zs_rows = _rows_pad([torch.tensor(e[1], dtype=torch.long) for e in ext], dist.max_len)
        lp_zs = dist.log_prob(zs_rows).double()
        for (i, zs, a), v in zip(ext, lp_zs.tolist()):
            if v == -math.inf:
                continue
            p[sigma.index(a)] += post[i] * math.exp(v - float(lpz[i]))  # line 4 and 6
            new_terms[a][zs] = v  # line 8: P(zs) = P(z) P(s | z)
    return (p / p.sum()).float(), new_terms


def _exact_loop(model, xt, max_new, num_samples, stop_at_eos, generator) -> Decoded:
    """Algorithm 1 (ideal setting): exact next-token distributions with the cache of line 8."""
    sigma = torch.as_tensor(model.projection.observable_ids)
    out = torch.full((num_samples, max_new), PAD_ID, dtype=torch.long)
    probs_log = []
    for s in range(num_samples):
        X, cache = xt.clone(), _algorithm1_cache(model, xt)
        for t in range(max_new):
            p, terms = _algorithm1_step(model, X, cache)
            probs_log.append(p)
            a = int(sigma[torch.multinomial(p, 1, generator=generator)])  # line 7
            out[s, t] = a
            X = torch.cat([X, torch.tensor([a])])
            cache = terms[a]
            if stop_at_eos and a == model.vocab.eos_id:
                break
    return Decoded(out, None, {"next_token_probs": probs_log, "sigma": sigma})


def _best_of_k(model, sampler, xt, n, k, max_new, stop_at_eos, generator) -> Decoded:
    """End of 5.5: K candidates by (3.14), each scored by log p_n(x y) ((3.2) on xy, n particles)."""
    from ppl_thought.inference.importance import Importance

    z0 = _resample_init(model, sampler, xt, n, k, generator)
    z, toks = continue_prior(model, z0, len(xt), max_new, stop_at_eos, generator)
    scores = []
    for y in toks:
        y = y[y != PAD_ID]
        scores.append(Importance(n).run(model, sampler, torch.cat([xt, y])).log_marginal)
    scores_t = torch.stack(scores)
    best = int(torch.argmax(scores_t))
    return Decoded(toks[best : best + 1], z[best : best + 1], {"candidates": toks, "scores": scores_t})


__all__ = ["decode", "next_token_distribution", "continue_prior", "Decoded", "METHODS"]
