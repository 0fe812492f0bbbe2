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

Every LM computation goes through the one decoding loop, :class:`~ppl_thought.distributions.lm_state.LMState`
under the domain automaton ``projection.domain(|x| + max_new)`` (Def 2.8): a prompt lifting Z0 is
teacher-forced as one segment (``segment(until_emitted=|x|)``, whose log-probability is the
P^{<=|Z0|}(Z0) of the weights (3.14) / Algorithm 2, so the weights cost no extra pass), particles are
selected with ``reorder`` and continued with ``segment(until_emitted=...)``. Particles are batch rows;
tensors live on the LM's device (pass a ``generator`` on that device).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.errors import NotInImageError
from ppl_thought.inference.particles import engine_device
from ppl_thought.lm.base import lm_device
from ppl_thought.models.slow_thinking import pad_sequences
from ppl_thought.vocab import PAD_ID

METHODS = ("direct", "streaming", "resampling", "unbiased", "exact", "best_of_k")


@dataclass
class Decoded:
    """``tokens [S, m]`` new observable tokens (``<pad>`` after a stop), ``z [S, L]`` latent sequences,
    ``stats`` (next-token vectors for ``"unbiased"`` / ``"exact"``; for ``"best_of_k"`` every candidate's
    ``candidates``, ``candidate_z`` and ``scores``), the ``method`` and the ``prompt`` ids x.
    ``pt.diagnostics.to_inference_data`` converts it (``z`` in ``posterior``, ``tokens`` in ``predictions``)."""

    tokens: torch.Tensor
    z: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)
    method: str = ""
    prompt: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------- weights
def _log_weights(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """log w = log P^{<=|z|}(z) - log Q(z | x): the weights of (3.2), (3.14) and Algorithm 2; -inf never NaN.

    The one place the importance weights are formed (the tests replace it with wrong weights to check
    that they would notice).
    """
    return torch.where(torch.isneginf(log_p), log_p, log_p - log_q)


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
        raise ValueError("a prompt latent sequence is outside Dom(Proj)")


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
        raise ValueError("resampling decoding: all n weights P/Q of a particle set are zero")
    idx = torch.multinomial(torch.softmax(lw.double(), -1), 1, generator=generator).squeeze(-1)
    state.reorder(torch.arange(num_samples, device=idx.device) * n + idx)
    return state


# ---------------------------------------------------------------------------------------------- decode
def decode(model, sampler, x, method: str = "resampling", n: int = 16, max_new_tokens: int = 8,
           num_samples: int = 1, stop_at_eos: bool = True, k: int = 4,
           generator: torch.Generator | None = None) -> Decoded | Iterator[int]:
    """Decode continuations of the prompt x; see the module docstring for ``method``.

    Returns :class:`Decoded` (``tokens [num_samples, max_new_tokens]``), or for
    ``"streaming"`` an iterator of observable token ids (one stream).
    """
    if method not in METHODS:
        raise ValueError(f"unknown decoding method {method!r}; choose one of {METHODS}")
    engine_device(model, sampler)  # DeviceMismatchError naming both devices
    xt = model.x_ids(x)
    model.projection.lifting(xt)  # NotInImageError for a prompt outside the image
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


def next_token_distribution(model, sampler, x, n: int = 16, method: str = "unbiased",
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
            raise ValueError("Algorithm 2: all n weights P/Q are zero")
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


__all__ = ["decode", "next_token_distribution", "Decoded", "METHODS"]
