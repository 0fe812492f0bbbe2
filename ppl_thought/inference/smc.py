"""Sequential Monte Carlo over observed segments (Lemma 2.1), with adaptive resampling and twists.

A latent z in the lifting of x decomposes uniquely as z = z^(1) ... z^(|x|) with z^(t) in
Phi_{x<t}(z^(<t), x_t) (Lemma 2.1); the lifting automaton's ``emitted`` counts mark where
segment t ends (the first prefix that determines x_t). Particles are drawn from the
proposal Q (the guide, decoded under the lifting of x) one segment at a time; segment t of
particle i gets the incremental weight

    w_t^i = P(z^(t) | z^(<t)) / Q(z^(t) | z^(<t), x) * psi_t(z^(<=t)) / psi_{t-1}(z^(<t))

with psi_0 = psi_|x| = 1 (the last segment removes the last twist). When the ESS falls
under ``ess_threshold * n`` the particles are resampled (multinomial, stratified, systematic
or residual: each unbiased in the offspring counts), so Z-hat = prod_t (1/n) sum_i W_{t-1}^i w_t^i
is an unbiased estimate of p(x) = (Proj # P)^{<=|x|}(x) (2.22).

Lockstep decoding of ragged segments: segments of different particles have different token
counts while a batched KV cache advances one token for every row. Here every particle
decodes token by token; a particle that reached the end of segment t *waits* (its row is
inactive: it feeds a dummy token with ``valid=False``, which changes neither its context nor
its logits) until every particle has reached the boundary, and only then are weights
updated and particles resampled (the KV cache gathered with ``cache.reorder``). LMs whose
``forward`` has no ``valid`` argument are run without a cache on right-padded contexts
(exact, quadratic in length); see :mod:`ppl_thought.inference._stepper`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ppl_thought.distributions.lm_sequence import PAD_ID, LMSequence
from ppl_thought.errors import NotInImageError
from ppl_thought.inference._stepper import Stepper, context_rows, masked_log_softmax
from ppl_thought.inference.importance import ZeroWeightsError, _not_in_image_result, log_marginal_stderr
from ppl_thought.inference.result import Result, effective_sample_size, log_mean_exp

RESAMPLING = ("multinomial", "stratified", "systematic", "residual")


def resample(weights: torch.Tensor, method: str = "systematic", generator: torch.Generator | None = None
             ) -> torch.Tensor:
    """Ancestor indices ``[n]`` from normalised weights ``[n]`` (each scheme has E[#offspring_i] = n w_i)."""
    n = weights.shape[0]
    w = weights.double() / weights.double().sum()
    if method == "multinomial":
        return torch.multinomial(w, n, replacement=True, generator=generator)
    cdf = torch.cumsum(w, 0)
    cdf[-1] = 1.0
    if method == "stratified":
        u = (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=generator, dtype=torch.float64)) / n
    elif method == "systematic":
        u = (torch.arange(n, dtype=torch.float64) + torch.rand(1, generator=generator, dtype=torch.float64)) / n
    elif method == "residual":
        counts = torch.floor(n * w).long()
        rest = n - int(counts.sum())
        base = torch.repeat_interleave(torch.arange(n), counts)
        if rest == 0:
            return base
        res = n * w - counts
        extra = torch.multinomial(res / res.sum(), rest, replacement=True, generator=generator)
        return torch.cat([base, extra])
    else:
        raise ValueError(f"unknown resampling scheme {method!r}; choose one of {RESAMPLING}")
    return torch.searchsorted(cdf, u).clamp(max=n - 1)


def _guide_dist(guide, x: torch.Tensor) -> LMSequence:
    if isinstance(guide, LMSequence):
        return guide
    for name in ("dist", "seq", "sequence", "distribution"):
        if hasattr(guide, name):
            d = getattr(guide, name)(x)
            if isinstance(d, LMSequence):
                return d
    raise TypeError(
        "SMC needs the proposal as an LMSequence decoded under the lifting of x: pass an LMSequence, "
        "pt.guides.Causal / pt.guides.Explanatory, or a guide with dist(x) -> LMSequence (the marginalising "
        f"samplers Identity / Predictive are not step-wise LMSequences yet; got {type(guide).__name__})"
    )


class SMC:
    """Segment-wise SMC for slow-thinking models (Lemma 2.1), unbiased estimate of (2.22).

    Args:
        num_particles: n.
        ess_threshold: resample after segment t (t < |x|) when ESS / n falls under it (0: never,
            1: always).
        resampling: ``"systematic"`` (default), ``"stratified"``, ``"multinomial"`` or ``"residual"``.
        twist: optional potential on prefixes, ``twist(tokens [n, L], t) -> log psi_t [n]`` evaluated
            at the end of segment t < |x| (``tokens`` right-padded latent prefixes), e.g. a process
            verifier. Weights are multiplied by psi_t / psi_{t-1}; the last segment divides by
            psi_{|x|-1}, so Z-hat stays unbiased for p(x) whatever the twist (it only moves variance).
        generator: a ``torch.Generator`` for sampling and resampling.

    ``run(model, guide, x) -> Result``: ``samples["z"] [n, L]``, final ``log_weights``,
    ``log_marginal`` (log Z-hat), ``ancestry [|x|, n]`` (ancestor of each particle after segment
    t; the identity where no resampling happened), ``stats["ess"]`` per segment and
    ``stats["resampled"]``. ``model`` is a :class:`~ppl_thought.models.SlowThinking`; ``guide``
    an LMSequence or an object with ``dist(x) -> LMSequence`` (Q decoded under the lifting of x).
    """

    def __init__(self, num_particles: int, ess_threshold: float = 0.5, resampling: str = "systematic",
                 twist: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                 generator: torch.Generator | None = None):
        if int(num_particles) < 1:
            raise ValueError(f"num_particles must be >= 1, got {num_particles}")
        if resampling not in RESAMPLING:
            raise ValueError(f"unknown resampling scheme {resampling!r}; choose one of {RESAMPLING}")
        if not 0.0 <= float(ess_threshold) <= 1.0:
            raise ValueError(f"ess_threshold is a fraction of num_particles in [0, 1], got {ess_threshold}")
        self.num_particles = int(num_particles)
        self.ess_threshold = float(ess_threshold)
        self.resampling = resampling
        self.twist = twist
        self.generator = generator

    def run(self, model, guide, x) -> Result:
        """Run SMC over the |x| segments of the lifting of x; see the class docstring."""
        n = self.num_particles
        xt = model.x_ids(x)
        T = len(xt)
        try:
            lift = model.projection.lifting(xt)
        except NotInImageError as e:
            return _not_in_image_result(f"log p(x) = -inf: {e}", n, "SMC", {"x": x})
        with torch.no_grad():
            return self._run(model, guide, xt, lift, T, n)

    def _run(self, model, guide, xt, lift, T, n) -> Result:
        qd = _guide_dist(guide, xt)
        pd = model.z_dist(T)
        L = pd.max_len
        gen = self.generator
        q = Stepper(qd.lm, qd.lm_kwargs).start(context_rows(qd.prompt, None, n))
        p = Stepper(pd.lm, pd.lm_kwargs).start(context_rows(pd.prompt, None, n))
        q_auto = qd.constraint.start_states(n) if qd.constraint is not None else torch.zeros(n, dtype=torch.long)
        p_auto = pd.constraint.start_states(n)
        l_auto = lift.start_states(n)
        tokens = torch.full((n, L), PAD_ID, dtype=torch.long)
        lengths = torch.zeros(n, dtype=torch.long)
        rows = torch.arange(n)
        lw = torch.zeros(n)
        prev_psi = torch.zeros(n)
        ancestry, ess_hist, resampled = [], [], []
        token_steps = 0
        for t in range(1, T + 1):
            seg = torch.zeros(n)
            while True:
                at_boundary = lift.is_final(l_auto) if t == T else lift.num_emitted(l_auto) >= t
                active = ~at_boundary
                if not bool(active.any()):
                    break
                if bool((active & (lengths >= L)).any()):
                    raise RuntimeError(f"a particle exceeded the model's z length {L} inside segment {t}")
                lq_all = masked_log_softmax(q.logits, qd._mask(q_auto))
                dead = torch.isneginf(lq_all).all(-1) & active
                if bool(dead.any()):
                    raise ValueError(f"{int(dead.sum())} particles have no admissible token of positive "
                                     "probability under the proposal")
                probs = torch.where(active[:, None], lq_all.exp(), torch.zeros_like(lq_all))
                probs[~active, PAD_ID] = 1.0
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
                lq = lq_all.gather(-1, tok[:, None]).squeeze(-1)
                lp = masked_log_softmax(p.logits, pd._mask(p_auto)).gather(-1, tok[:, None]).squeeze(-1)
                step = torch.where(torch.isneginf(lp), lp, lp - lq)
                seg = seg + torch.where(active, step, torch.zeros_like(step))
                if qd.constraint is not None:
                    q_auto = torch.where(active, qd.constraint.step(q_auto, tok), q_auto)
                p_auto = torch.where(active, pd.constraint.step(p_auto, tok), p_auto)
                l_auto = torch.where(active, lift.step(l_auto, tok), l_auto)
                tokens[rows[active], lengths[active]] = tok[active]
                lengths = lengths + active.long()
                q.feed(tok, active)
                p.feed(tok, active)
                token_steps += 1
            inc = seg
            if self.twist is not None:
                psi = torch.as_tensor(self.twist(tokens, t), dtype=lw.dtype) if t < T else torch.zeros(n)
                inc = inc + torch.where(torch.isneginf(inc), inc, psi - prev_psi)
                prev_psi = psi
            lw = lw + inc
            if torch.isnan(lw).any():
                raise ValueError(f"NaN weights after segment {t} (a twist returned NaN or +inf?)")
            if torch.isneginf(torch.logsumexp(lw, 0)):
                raise ZeroWeightsError(
                    f"SMC: all {n} particle weights are zero (log weight -inf) after segment {t} of {T}: the "
                    "proposal only produced latent segments the prior (or the twist) gives probability 0"
                )
            ess = effective_sample_size(lw)
            ess_hist.append(float(ess))
            if t < T and float(ess) < self.ess_threshold * n:
                idx = resample(torch.softmax(lw, 0), self.resampling, gen)
                carry = log_mean_exp(lw)
                lw = carry.expand(n).clone()
                tokens, lengths = tokens[idx], lengths[idx]
                q_auto, p_auto, l_auto, prev_psi = q_auto[idx], p_auto[idx], l_auto[idx], prev_psi[idx]
                q.reorder(idx)
                p.reorder(idx)
                ancestry.append(idx)
                resampled.append(True)
            else:
                ancestry.append(torch.arange(n))
                resampled.append(False)
        log_z = log_mean_exp(lw)
        return Result(
            samples={"z": tokens}, log_weights=lw, log_marginal=log_z,
            log_marginal_stderr=log_marginal_stderr(lw) if not any(resampled) else None,
            ancestry=torch.stack(ancestry) if ancestry else torch.zeros(0, n, dtype=torch.long),
            stats={"ess": ess_hist, "resampled": resampled, "token_steps": token_steps,
                   "particle_steps": token_steps * n, "mode": p.mode},
            observed={"x": xt}, engine="SMC",
        )


__all__ = ["SMC", "resample", "RESAMPLING"]
