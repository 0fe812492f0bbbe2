"""The decoding methods over a program (docs/inference.md, "decode"): (3.14) resampling, best-of-K (end of 5.5),
Algorithm 2 of App. G (the next-output vector (G.1)) and Algorithm 1's ideal setting (exact, by enumeration or by
the program's own ``next_output_law``). Each takes a :class:`~ppl_thought.inference.decoding_program._ProgramRun`
and returns the chosen rows (:class:`~ppl_thought.inference.decoding_program._Draws`) and the method's stats.
"""

from __future__ import annotations

import math

import torch

from ppl_thought.errors import ConfigError, ZeroWeightsError, describe_proposal, zero_weights_message
from ppl_thought.inference.decoding_program import (
    _FIXED_OUTPUT,
    _active,
    _collect,
    _Draws,
    _finish_mismatch,
    _first_of_each,
    _joined,
    _keys,
    _on_values,
    _ProgramRun,
    _rows,
    _tokens,
)
from ppl_thought.inference.particles import latent_sites, output_sites, per_particle
from ppl_thought.inference.resampling import ancestors


def _program_resample(run: _ProgramRun, n: int, S: int, generator) -> tuple[_Draws, torch.Tensor]:
    """(3.14) for a program: one run of ``n * S`` particles (rows ``s * n .. s * n + n - 1`` serve sample s), one
    particle per sample chosen with probability proportional to p/q. The outputs are out of the weights, so the
    choice weighs the prompt's sites only, and the chosen trajectory's continuation, drawn from P(. | Z0), is
    (3.12) after (3.14)."""
    p = run.run(n * S)
    lw = run.weights(p).reshape(S, n)
    if bool(torch.isneginf(lw).all(-1).any()):
        raise ZeroWeightsError(zero_weights_message("resampling decoding (3.14)", n, describe_proposal(run.guide),
                                                    group="of a particle set ", where="given the prompt"))
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
                                "candidate_tokens": _tokens(cands), "candidate_z": _joined(cands.latents),
                                "scores": scores}


def _program_algorithm2(run: _ProgramRun, n: int, S: int, generator) -> tuple[_Draws, dict]:
    """Algorithm 2 for a program, one sample at a time (the prompt grows with what was decoded): at each step the
    next output's vector (G.1) by :func:`_algorithm2_step`, from which the next output (or "the program finished")
    is drawn."""
    outs, probs, supports = [], [], []
    for _ in range(S):
        fixed: dict = {}
        while True:
            step = _algorithm2_step(run, n, fixed)
            if step is None:
                break  # every particle finished: nothing more to decode
            name, pv, finished, values = step
            probs.append(pv.float())
            supports.append({"site": name, "finished": finished, "values": values})
            j = int(torch.multinomial(pv, 1, generator=generator))  # the next prompt: one host sync per output
            if bool(finished[j]):
                break  # the program finished: no further output
            fixed[name] = values[j: j + 1]
        outs.append(dict(fixed))
    stats = {"next_output_probs": probs, "next_output_support": supports}
    return _collect(outs), _on_output_values(run, stats, [(p, s["finished"], s["values"]) for p, s in
                                                          zip(probs, supports)])


def _on_output_values(run: _ProgramRun, stats: dict, steps: list) -> dict:
    """Adds ``next_token_probs`` (each step's vector over ``output_values``, the protocol method of
    docs/programs.md) and ``sigma`` (those values) when the program offers ``output_values``."""
    support = getattr(run.program, "output_values", None)
    if callable(support):
        sigma = torch.as_tensor(support(*run.args, **run.kwargs))
        stats["next_token_probs"] = [_on_values(sigma, v, f, p) for p, f, v in steps]
        stats["sigma"] = sigma
    return stats


def _algorithm2_step(run: _ProgramRun, n: int, fixed: dict):
    """One step of Algorithm 2 given the outputs decoded so far (``fixed`` ``{site: [1, ...]}``, X^(t)).

    Z^(t,i), i <= n, from one run of the program with X^(t) fixed (the guide proposes the prompt's latents);
    w_i = p/q (weight 0 where a particle finished before a decoded output); Z^(t,i) is every latent site before the
    next output site; m_i = ceil(n w_i^2 / sum_j w_j^2) continuations of particle i (Algorithm 3) by one run of the
    program with Z^(t,i) and X^(t) fixed, rows ``repeat_interleave(m)``; the vector (G.1)
    p = sum_i w_i p_m^(i) / sum_i w_i over the next output's values and "the program finished".

    Returns ``None`` when every particle has finished, else ``(site, p [U] float64, finished [U] bool,
    values [U, ...])`` (the values of a finished entry are zeros).
    """
    data = {k: v.expand(n, *v.shape[1:]) for k, v in fixed.items()}
    p = run.run(n, data)
    trace = p.model_trace
    lw = run.weights(p)
    want = {k: torch.ones(n, dtype=torch.bool, device=v.device) for k, v in fixed.items()}
    lw = torch.where(_finish_mismatch(trace, n, want, complete=False, device=lw.device),
                     torch.full_like(lw, -math.inf), lw)
    nxt = list(output_sites(trace))
    if not nxt:
        return None
    if bool(torch.isneginf(lw).all()):
        raise ZeroWeightsError(zero_weights_message("Algorithm 2", n, describe_proposal(run.guide),
                                                    where=f"given the prompt and the {len(fixed)} output(s) decoded "
                                                          "so far"))
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
    zero = torch.zeros((), dtype=torch.float64, device=y.device)
    key = torch.cat([act[:, None].double(), torch.where(act[:, None], y.reshape(M, -1).double(), zero)], 1)
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)
    onehot = torch.nn.functional.one_hot(inv, uniq.shape[0]).double().to(w.device)
    per = torch.zeros(n, uniq.shape[0], dtype=torch.float64, device=w.device).index_add_(0, rows.to(w.device), onehot)
    per = per / m.clamp(min=1)[:, None].double()  # p_m^(i)
    pv = (w[:, None] * per).sum(0)  # (G.1)
    first = _first_of_each(key)  # one row per distinct value, in the order of ``uniq``
    values = torch.where(act[first.to(act.device)].reshape((-1,) + (1,) * (y.ndim - 1)), y[first.to(y.device)],
                         torch.zeros_like(y[first.to(y.device)]))
    return name, pv / pv.sum(), ~uniq[:, 0].bool(), values


def _program_algorithm1(run: _ProgramRun, S: int, generator) -> tuple[_Draws, dict]:
    """Algorithm 1 of App. G through the program's own exact next-output law (protocol method ``next_output_law(
    decoded, *args, **kwargs) -> (site, values [U, ...], probs [U]) | None``, docs/programs.md): draw the next
    output from it (line 7), append it to the decoded ones, repeat until the program says it has finished."""
    law = run.program.next_output_law
    outs, probs, supports = [], [], []
    for _ in range(S):
        fixed: dict = {}
        while True:
            nxt = law([v[0] for v in fixed.values()], *run.args, **run.kwargs)
            if nxt is None:
                break
            name, values, p = nxt
            probs.append(p)
            supports.append({"site": name, "values": values})
            j = int(torch.multinomial(p.float(), 1, generator=generator))  # line 7 (the next prompt: host sync)
            fixed[name] = values[j: j + 1]
        outs.append(fixed)
    stats = {"next_output_probs": probs, "next_output_support": supports}
    steps = [(p, torch.zeros(s["values"].shape[0], dtype=torch.bool, device=p.device), s["values"])
             for p, s in zip(probs, supports)]
    return _collect(outs), _on_output_values(run, stats, steps)


def _program_exact(run: _ProgramRun, S: int, generator) -> tuple[_Draws, dict]:
    """Algorithm 1's ideal setting for a program: every configuration of its latent and output sites
    (``program.enumerate_sites(*args, **kwargs)``) scored in one run, log p(z, y, x) per configuration; the
    exact predictive law of the outputs sums it over the configurations with the same outputs (configurations
    that differ only at sites after the program finished are one)."""
    enum = getattr(run.program, "enumerate_sites", None)
    if not callable(enum) and callable(getattr(run.program, "next_output_law", None)):
        return _program_algorithm1(run, S, generator)
    if not callable(enum):
        raise ConfigError(f"method='exact' needs {type(run.program).__name__}.enumerate_sites(*args, **kwargs) -> "
                          "{site: tensor [K, ...]}: every configuration of the program's latent and output sites "
                          "(rows leading), to enumerate the exact law, or next_output_law(decoded, *args, **kwargs) "
                          "-> (site, values, probs) (Algorithm 1, docs/programs.md); or use method='unbiased'")
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

