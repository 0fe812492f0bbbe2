"""How far a sampler is from the optimal one: chi^2 and KL divergences (Table 3.1, Prop 3.5).

The slow-thinking scaling laws of Table 3.1 all scale with chi^2(Q_*(.|x) || Q(.|x)).

- :func:`chi2` exactly, from log-probability vectors over one enumerated support, or from two
  samplers and a small model (the lifting of x is enumerated);
- :func:`chi2_from_weights`: the Monte-Carlo estimate from importance log-weights w = P/Q under Q;
- :func:`kl`: KL(p || q) exactly, with the same inputs as :func:`chi2`;
- :func:`kl_from_weights`: the self-normalised estimates of both KLs from log-weights;
- :func:`sampler_report`: all of these, exact next to estimated, with ESS and Pareto k.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ppl_thought import checks
from ppl_thought.diagnostics.inference_data import psis_khat
from ppl_thought.errors import ConfigError, DiagnosticError, TooLargeToEnumerateError
from ppl_thought.inference.importance import Importance
from ppl_thought.models.slow_thinking import SlowThinking
from ppl_thought.validation import ArrayLike, FloatOrNaN, SupportsLogProb, SupportsSampleWithLogProb, checked
from ppl_thought.weights import check_log_weights


def _log_vectors(p, q, model=None, x=None) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(p, "log_prob") and hasattr(q, "log_prob") and not isinstance(p, torch.Tensor):
        if model is None or x is None:
            raise DiagnosticError("chi2/kl of two samplers needs model= and x= (the lifting of x is enumerated), got "
                                  f"model={type(model).__name__}, x={x!r}"[:300])
        support, _ = model.enumerate_log_joint(x)
        with torch.no_grad():
            lp, lq = p.log_prob(support, x).double(), q.log_prob(support, x).double()
    else:
        for name, v in (("p", p), ("q", q)):
            checks.numeric_array(name, v, DiagnosticError, "a vector of log-probabilities (a tensor, an array or a "
                                 "list of numbers) or a sampler with log_prob")
        lp, lq = torch.as_tensor(p, dtype=torch.float64), torch.as_tensor(q, dtype=torch.float64)
    if lp.shape != lq.shape:
        raise DiagnosticError(f"log-probability vectors differ in shape: {tuple(lp.shape)} vs {tuple(lq.shape)}")
    for name, v in (("p", lp), ("q", lq)):
        if torch.isnan(v).any() or torch.isposinf(v).any():
            raise DiagnosticError(f"the log-probabilities of {name} contain NaN or +inf: a divergence of them "
                                  "would be meaningless")
    return lp, lq


@checked
def chi2(p: ArrayLike | SupportsLogProb, q: ArrayLike | SupportsLogProb, *, model: SlowThinking | None = None,
         x: ArrayLike | None = None) -> float:
    """chi^2(p || q) = sum_z p(z)^2 / q(z) - 1 (``inf`` if q misses mass of p).

    ``p``, ``q``: log-probability vectors over the same enumerated support (e.g. Q_* first),
    or two samplers with ``model`` and ``x``.
    """
    lp, lq = _log_vectors(p, q, model, x)
    has = torch.isfinite(lp)
    if (has & torch.isneginf(lq)).any():
        return math.inf
    terms = torch.where(has, 2 * lp - lq, torch.full_like(lp, -math.inf))
    return max(0.0, float(torch.logsumexp(terms, -1).exp() - 1.0))  # >= 0 up to rounding


@checked
def kl(p: ArrayLike | SupportsLogProb, q: ArrayLike | SupportsLogProb, *, model: SlowThinking | None = None,
       x: ArrayLike | None = None) -> float:
    """KL(p || q) = sum_z p(z) (log p(z) - log q(z)) (``inf`` if q misses mass of p)."""
    lp, lq = _log_vectors(p, q, model, x)
    has = torch.isfinite(lp)
    if (has & torch.isneginf(lq)).any():
        return math.inf
    return max(0.0, float(torch.where(has, lp.exp() * (lp - lq), torch.zeros_like(lp)).sum()))


def _weights(log_w, what: str) -> torch.Tensor:
    """Log weights as a float64 vector; :class:`DiagnosticError` for none, NaN, +inf, or no nonzero weight."""
    try:
        lw = torch.as_tensor(log_w, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise DiagnosticError(f"{what}: log_w must be a vector of log weights, got {type(log_w).__name__} "
                              f"({e})"[:300]) from None
    check_log_weights(lw, what)
    if lw.numel() == 0 or torch.isneginf(lw).all():
        raise DiagnosticError(f"{what}: no nonzero weight among {lw.numel()} log weights (every one is -inf or "
                              "there are none): the divergence is not defined")
    return lw


@checked
def chi2_from_weights(log_w: ArrayLike) -> float:
    """Monte-Carlo chi^2(Q_* || Q) = E_q[w^2] / E_q[w]^2 - 1 from log-weights w = P(z)/Q(z), z ~ Q
    (the normaliser cancels: n sum w^2 / (sum w)^2 - 1). :class:`DiagnosticError` for NaN or +inf log
    weights and for no nonzero weight (never NaN)."""
    lw = _weights(log_w, "chi2_from_weights")
    n = lw.numel()
    return float(
        torch.exp(math.log(n) + torch.logsumexp(2 * lw, 0) - 2 * torch.logsumexp(lw, 0)) - 1.0)


# ---------------------------------------------------------------------------------------------- estimates
@checked
def kl_from_weights(log_w: ArrayLike) -> tuple[float, float]:
    """Self-normalised Monte-Carlo (KL(Q_* || Q), KL(Q || Q_*)) from log-weights w = P(z)/Q(z), z ~ Q.

    With p_n = mean(w) ((3.2)) and normalised weights W_i: KL(Q_* || Q) ~ sum_i W_i log(w_i / p_n) and
    KL(Q || Q_*) ~ log p_n - mean(log w) (``inf`` when some w_i = 0: Q puts mass outside Q_*).
    :class:`DiagnosticError` for NaN or +inf log weights and for no nonzero weight (never NaN).
    """
    lw = _weights(log_w, "kl_from_weights")
    n = lw.numel()
    log_pn = torch.logsumexp(lw, 0) - math.log(n)
    W = torch.softmax(lw, 0)
    fin = torch.isfinite(lw)
    fwd = float(torch.where(fin, W * (lw - log_pn), torch.zeros_like(lw)).sum())
    rev = math.inf if not bool(fin.all()) else float(log_pn - lw.mean())
    return max(0.0, fwd), max(0.0, rev)


@checked
@dataclass
class SamplerReport:
    """How good a sampler Q is for x: exact numbers (enumeration) next to estimates from n weights.

    ``chi2_exact`` = chi^2(Q_*(.|x) || Q(.|x)), the constant of every scaling law of Table 3.1
    ((3.4), (3.8), (3.9)); ``kl_exact`` = KL(Q_* || Q), ``kl_reverse_exact`` = KL(Q || Q_*) (the loss
    (3.5) up to log p). ``*_est`` are the Monte-Carlo estimates from ``n`` importance weights
    (``chi2_from_weights``, ``kl_from_weights``); ``ess`` the importance ESS, ``khat`` the PSIS Pareto
    k (``nan`` where the tail is too short for the fit: ArviZ 1.x declines tied weights that 0.x fits, see
    :func:`~ppl_thought.inference.result.psis`). ``exact_available`` is False (exact fields ``nan``) when the lifting
    of x is too large to enumerate.
    """

    n: int
    log_marginal_exact: FloatOrNaN
    log_marginal_est: float
    log_marginal_stderr: FloatOrNaN
    chi2_exact: FloatOrNaN
    chi2_est: float
    kl_exact: FloatOrNaN
    kl_est: float
    kl_reverse_exact: FloatOrNaN
    kl_reverse_est: float
    ess: float
    ess_fraction: float
    khat: FloatOrNaN
    exact_available: bool
    predicted_relative_mse: FloatOrNaN = math.nan  # chi2_exact / n: the relative squared error of p_n, (3.4)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def table(self) -> str:
        """A plain-text two-column table (exact | estimated)."""
        rows = [("log p(x)", self.log_marginal_exact, self.log_marginal_est),
                ("chi2(Q*||Q)", self.chi2_exact, self.chi2_est),
                ("KL(Q*||Q)", self.kl_exact, self.kl_est),
                ("KL(Q||Q*)", self.kl_reverse_exact, self.kl_reverse_est)]
        lines = [f"{'':14s} {'exact':>12s} {'estimated':>12s}"]
        lines += [f"{name:14s} {a:12.5g} {b:12.5g}" for name, a, b in rows]
        lines.append(f"ESS {self.ess:.1f} / {self.n} ({self.ess_fraction:.3f}), Pareto k {self.khat:.3g}")
        return "\n".join(lines)


@checked
def sampler_report(model: SlowThinking, sampler: SupportsSampleWithLogProb, x: ArrayLike, n: int = 1000,
                   seed: int | None = 0, limit: int = 20_000) -> SamplerReport:
    """Exact and estimated sampler quality of ``sampler`` (a Q(.|x) with ``sample_with_log_prob`` and
    ``log_prob``) against the posterior Q_*(.|x) of the :class:`~ppl_thought.models.SlowThinking` ``model``.

    The estimates come from one run of importance sampling with ``n`` particles (estimator (3.2)); the
    exact values enumerate the lifting of x (skipped, ``nan``, when it has more than ``limit`` sequences).
    """

    if int(n) < 2:
        raise ConfigError(f"sampler_report needs n >= 2 draws, got {n}")
    exact = True
    lp_exact = chi2_x = kl_x = klr_x = math.nan
    try:
        support, lj = model.enumerate_log_joint(x, limit=limit)
        lp_exact_t = torch.logsumexp(lj.double(), 0)
        lp_exact = float(lp_exact_t)
        log_post = lj.double() - lp_exact_t
        with torch.no_grad():
            lq = sampler.log_prob(support, x).double()
        chi2_x, kl_x, klr_x = chi2(log_post, lq), kl(log_post, lq), kl(lq, log_post)
    except TooLargeToEnumerateError:
        exact = False
    ctx = torch.random.fork_rng(devices=[]) if seed is not None else _null()
    with ctx:
        if seed is not None:
            torch.manual_seed(seed)
        res = Importance(int(n)).run(model, sampler, x)
    lw = res.log_weights.double()
    kl_e, klr_e = kl_from_weights(lw)
    ess = float(res.ess)
    se = res.log_marginal_stderr
    return SamplerReport(
        n=int(n), log_marginal_exact=lp_exact, log_marginal_est=float(res.log_marginal),
        log_marginal_stderr=float(se) if se is not None else math.nan,
        chi2_exact=chi2_x, chi2_est=chi2_from_weights(lw), kl_exact=kl_x, kl_est=kl_e,
        kl_reverse_exact=klr_x, kl_reverse_est=klr_e, ess=ess, ess_fraction=ess / int(n), khat=psis_khat(lw),
        exact_available=exact, predicted_relative_mse=chi2_x / int(n) if exact else math.nan,
    )


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
