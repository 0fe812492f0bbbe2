"""Importance sampling: the estimator (3.2) of (Proj # P)(x), vectorised over particles.

``Importance(n).run(model, guide, *args)`` runs the guide once under a particle plate (the
particles are a batch dimension of every site), replays the model on the guide trace, and
weights particle i by log w_i = log p(all model sites) - log q(all guide sites). For a
slow-thinking model this is S_i = log P^{<=|Z_i|}(Z_i) - log Q(Z_i | x), and

    log p_n = logsumexp(S) - log n                                           (3.2)

is an unbiased estimate of p = (Proj # P)^{<=|x|}(x) on the probability scale; its variance is
p^2 chi2(Q_* || Q) / n (3.4). The log-normal variant of Remark 3.4 estimates log p by
mean(S) + var(S) / 2. :meth:`Importance.conditional_log_prob` is (3.7) with the shared-sample
variant of Remark 3.5.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pyro.poutine as poutine
import torch

from ppl_thought import checks
from ppl_thought.checks import integer
from ppl_thought.errors import (
    ConfigError,
    NotInImageError,
    NumericalError,
    SiteMismatchError,
    ZeroWeightsError,
    describe_proposal,
    zero_weights_message,
)
from ppl_thought.inference.particles import check_compatible, infinite_sites, sample_particles
from ppl_thought.inference.result import Result, pareto_k
from ppl_thought.models.slow_thinking import lifted_prefix_length as lifted_prefix_length
from ppl_thought.resources import check_particles
from ppl_thought.validation import ArrayLike, SupportsSampleWithLogProb, checked, per_token
from ppl_thought.weights import effective_sample_size, log_mean_exp


# ---------------------------------------------------------------------------------------------- statistics
def log_marginal_stderr(log_w: torch.Tensor) -> torch.Tensor:
    """Delta-method standard error of log p_n: sd(w) / (sqrt(n) mean(w)), from log weights ``[..., n]``.

    var(p_n) = var(w) / n ((3.4)), and d log p = dp / p. With normalised weights W_i
    (sum 1), w_i / mean(w) = n W_i, so se = sqrt(sum_i (n W_i - 1)^2 / ((n - 1) n)).
    Equal weights give exactly 0 (with a finite gradient); one particle, or every weight zero, gives
    ``inf`` (no estimate of the spread), never NaN.
    """
    n = log_w.shape[-1]
    lw = log_w.double()
    if n < 2:
        return torch.full(log_w.shape[:-1], float("inf"), dtype=log_w.dtype, device=log_w.device)
    zero = torch.isneginf(torch.logsumexp(lw, -1))
    equal = (lw == lw[..., :1]).all(-1)
    rel = n * torch.softmax(torch.where(zero[..., None], torch.zeros_like(lw), lw), -1)
    var = ((rel - 1) ** 2).sum(-1) / (n - 1)
    var = torch.where(equal, torch.zeros_like(var), var)
    se = torch.where(var > 0, var / n, torch.ones_like(var)).sqrt() * (var > 0)  # sqrt'(0) would be inf
    return torch.where(zero, torch.full_like(se, float("inf")), se).to(log_w.dtype)


def log_normal_estimate(log_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Remark 3.4: log p ~ mean(S) + var(S)/2 under S ~ N(mu, s^2) (unbiased variance); and its stderr.

    Particles with S = -inf are outside the log-normal model; they are dropped (an
    estimate with all S = -inf is -inf). stderr^2 = s^2/n + s^4/(2(n-1)) (delta method); inf for fewer
    than two finite S (no spread to estimate from).
    """
    s = log_w[torch.isfinite(log_w)].double()
    n = s.numel()
    if n == 0:  # no spread to estimate from: stderr inf (never NaN)
        return torch.tensor(float("-inf")), torch.tensor(float("inf"))
    if n == 1:
        return s[0].float(), torch.tensor(float("inf"))
    var = s.var(unbiased=True)
    est = s.mean() + var / 2
    se = (var / n + var**2 / (2 * (n - 1))).sqrt()
    return est.float(), se.float()


def _summarise(log_w: torch.Tensor, log_normal: bool, what: str, traces=(),
               proposal: str = "the proposal") -> dict[str, Any]:
    """log Z-hat (3.2), its stderr, ESS and k-hat of a run's weights, checked once (one host sync): NaN or +inf
    weights raise :class:`NumericalError` (naming the sites of +inf log-probability found in ``traces``),
    all-zero weights :class:`ZeroWeightsError` naming ``proposal`` and the sites of -inf log-probability."""
    nan, posinf = torch.stack([torch.isnan(log_w).any(), torch.isposinf(log_w).any()]).tolist()
    if nan or posinf:
        named = infinite_sites(*traces)
        where = f" at site(s) {', '.join(named)}" if named else ""
        raise NumericalError(f"{what}: {'NaN' if nan else '+inf'} log weights: a log-probability of "
                             f"{'NaN or ' if nan else ''}+inf{where} (e.g. pyro.factor(name, +inf)); log Z-hat and "
                             "the ESS would be NaN or inf")
    lse = torch.logsumexp(log_w, -1)
    if torch.isneginf(lse):
        raise ZeroWeightsError(zero_weights_message(what, log_w.shape[-1], proposal, sites=_dead_sites(traces)))
    out: dict[str, Any] = {
        "log_marginal": log_mean_exp(log_w),
        "log_marginal_stderr": log_marginal_stderr(log_w),
        "ess": effective_sample_size(log_w, check=False),  # checked above
        "khat": pareto_k(log_w),  # PSIS (arviz.psislw): one implementation, in inference/result.py
    }
    if log_normal:
        est, se = log_normal_estimate(log_w)
        out["log_marginal_iid"], out["log_marginal_stderr_iid"] = out["log_marginal"], out["log_marginal_stderr"]
        out["log_marginal"], out["log_marginal_stderr"] = est, se
    return out


def _dead_sites(traces) -> list[str]:
    """The sample sites whose log-probability is -inf in every particle (the error path of a run only)."""
    out = []
    for who, tr in zip(("model", "guide"), traces):
        for name, site in ([] if tr is None else tr.nodes.items()):
            lp = site.get("log_prob") if site["type"] == "sample" else None
            if isinstance(lp, torch.Tensor) and lp.numel() and bool(torch.isneginf(lp).all()):
                out.append(f"{name!r} ({who})")
    return out


# ---------------------------------------------------------------------------------------------- results
def not_in_image_result(message: str, n: int, engine: str, observed: dict) -> Result:
    """The result of an engine asked for p(x) of an x outside the image of Proj: log Z-hat = -inf, every
    weight zero, with a warning (an answer, not an error: p(x) = 0 is exact)."""
    warnings.warn(message, stacklevel=3)
    log_w = torch.full((n,), float("-inf"))
    return Result(samples={}, log_weights=log_w, log_marginal=torch.tensor(float("-inf")),
                  log_marginal_stderr=torch.tensor(0.0), stats={"message": message}, observed=observed,
                  engine=engine)


# ---------------------------------------------------------------------------------------------- engine
@checked
class Importance:
    """Vectorised importance sampling, estimator (3.2) (docs/architecture.md, "Engines").

    Args:
        num_particles: n, the number of draws from the guide.
        log_normal_correction: report the log-normal estimate of Remark 3.4 as ``log_marginal``
            (the plain (3.2) estimate stays in ``stats["log_marginal_iid"]``).
        fast: when the model offers the protocol method ``sampler_weights(guide, x, n) -> (samples, log_w [n],
            extra)`` (docs/programs.md, "Protocol methods"; :meth:`~ppl_thought.models.SlowThinking.sampler_weights`
            samples z and log q in one decoding loop and scores log P with one teacher-forced pass instead of
            tracing) and the guide is a sampler (``sample_with_log_prob(x, n)``), take it for one observation
            ``x``. Read with ``getattr``: any program offering the method gets the path. Same numbers as the trace
            path.
        max_plate_nesting: plates of the user program (found by tracing once when ``None``).

    ``run(model, guide, *args, **kwargs) -> Result``: ``log_weights [n]``, ``log_marginal`` (3.2),
    ``log_marginal_stderr`` (delta method), ``samples`` (the guide's latent sites, particles
    leading), ``stats`` with ``ess`` and ``khat`` (PSIS Pareto k). When x is outside the image
    of Proj (the lifting is empty) the result has ``log_marginal = -inf`` and a message (with a
    warning), guided or bootstrap; when x is in the image but every weight is zero, :class:`ZeroWeightsError`
    naming the guide, or the model's prior when there is none (docs/architecture.md, "Rules that keep it right").
    """

    def __init__(self, num_particles: int, log_normal_correction: bool = False, fast: bool = True,
                 max_plate_nesting: int | None = None):
        self.num_particles = integer("num_particles", num_particles)
        check_particles("Importance", self.num_particles)  # up front: never the allocator's error
        self.log_normal_correction = bool(log_normal_correction)
        self.fast = bool(fast)
        self.max_plate_nesting = max_plate_nesting

    # ------------------------------------------------------------------ public API
    def run(self, model: Callable[..., Any], guide: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Result:
        """Draw n particles from the guide, weight them by p/q, and estimate log p(data) by (3.2)."""
        observed = {"args": args, "kwargs": kwargs}
        check_compatible(model, guide)
        if guide is not None:
            checks.callable_arg("guide", guide, "a Pyro guide, a pt.Program, or None (the model's prior proposes)")
        fast = getattr(model, "sampler_weights", None) if self.fast else None
        try:
            if callable(fast) and callable(getattr(guide, "sample_with_log_prob", None)) and len(args) == 1 \
                    and not kwargs:
                samples, log_w, extra = fast(guide, args[0], self.num_particles)
            else:
                samples, log_w, extra = self._traced(model, guide, args, kwargs)
        except NotInImageError as e:
            return not_in_image_result(f"log p(x) = -inf: {e}", self.num_particles, "Importance", observed)
        traces = extra.pop("traces", ())
        stats = _summarise(log_w, self.log_normal_correction, "Importance", traces, describe_proposal(guide))
        stats.update(extra)
        return Result(
            samples=samples, log_weights=log_w, log_marginal=stats.pop("log_marginal"),
            log_marginal_stderr=stats.pop("log_marginal_stderr"), stats=stats, observed=observed,
            engine="Importance",
        )

    @per_token
    def log_prob(self, model: Callable[..., Any], guide: Callable[..., Any] | None, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """log p_n of (3.2) (``-inf`` for x outside the image of Proj)."""
        return self.run(model, guide, *args, **kwargs).log_marginal

    # ------------------------------------------------------------------ paths
    def _traced(self, model, guide, args, kwargs):
        """Generic path: guide and model under one vectorised particle plate; replay the model on the guide
        (:func:`~ppl_thought.inference.particles.sample_particles`, with the site check)."""
        with torch.no_grad(), poutine.block():
            pt = sample_particles(model, guide, self.num_particles, *args,
                                  max_plate_nesting=self.max_plate_nesting, **kwargs)
        return pt.values, pt.log_w, {"log_p": pt.log_p, "log_q": pt.log_q, "log_likelihood": pt.log_likelihood,
                                     "traces": (pt.model_trace, pt.guide_trace)}

    # ------------------------------------------------------------------ (3.7) and Remark 3.5
    def conditional_log_prob(self, model: Callable[..., Any], sampler: SupportsSampleWithLogProb, x: ArrayLike,
                             y: ArrayLike, shared: bool = True) -> Result:
        """log (Proj # P)(y | x) ~ log p_n(xy) - log q_n(x), estimator (3.7).

        ``shared=False``: p_n from W_i ~ Q(. | xy) and q_n from independent Z_i ~ Q(. | x), the
        plain (3.7), overestimated by chi2(Q_*(.|x) || Q(.|x)) / n in relative terms (3.8).
        ``shared=True`` (Remark 3.5): Z_i = the prefix of W_i in the lifting of x (Lemma 2.1), with
        Q(Z_i | x) = int Q(Z_i s | xy) ds the product of the sampler's token probabilities over
        Z_i; positively correlated p and q reduce the bias. Needs the sampler's token probabilities:
        ``sampler.token_log_probs(z, x)`` (every library guide) or ``sampler.dist(x)`` (an LMSequence).

        Returns a Result whose ``log_marginal`` is the estimate, with ``stats["log_p_xy"]`` and
        ``stats["log_p_x"]``. The weights come from the model's protocol method ``conditional_weights(sampler, x,
        y, n, shared) -> (samples, log_w_xy [n], log_w_x [n])`` (docs/programs.md; read with ``getattr``, e.g.
        :meth:`~ppl_thought.models.SlowThinking.conditional_weights`); a model without it is a ConfigError.
        """
        n = self.num_particles
        weights = getattr(model, "conditional_weights", None)
        if not callable(weights):
            raise ConfigError(f"conditional_log_prob needs {type(model).__name__}.conditional_weights(sampler, x, y, "
                              "n, shared) -> (samples, log_w_xy [n], log_w_x [n]): the protocol method of "
                              "docs/programs.md (pt.models.SlowThinking offers it)")
        try:
            samples, log_w_xy, log_w_x = weights(sampler, x, y, n, shared)
        except NotInImageError as e:
            return not_in_image_result(f"log p(y | x) = -inf: {e}", n, "Importance.conditional", {"x": x, "y": y})
        q = describe_proposal(sampler)
        lp_xy = _summarise(log_w_xy, False, "Importance.conditional (xy)", proposal=q)["log_marginal"]
        lp_x = _summarise(log_w_x, False, "Importance.conditional (x)", proposal=q)["log_marginal"]
        est = lp_xy - lp_x
        return Result(samples=samples, log_weights=log_w_xy, log_marginal=est,
                      log_marginal_stderr=None,
                      stats={"log_p_xy": lp_xy, "log_p_x": lp_x, "log_weights_x": log_w_x, "shared": shared},
                      observed={"x": x, "y": y}, engine="Importance.conditional")


def _pad_to(z: torch.Tensor, length: int) -> torch.Tensor:
    if z.shape[-1] == length:
        return z
    if z.shape[-1] > length:
        if (z[..., length:] != 0).any():
            raise SiteMismatchError(f"sampled z of length {z.shape[-1]} exceeds the model's z length {length}")
        return z[..., :length]
    pad = torch.zeros(z.shape[:-1] + (length - z.shape[-1],), dtype=z.dtype, device=z.device)
    return torch.cat([z, pad], -1)


__all__ = ["Importance", "ZeroWeightsError", "lifted_prefix_length", "log_marginal_stderr", "log_normal_estimate",
           "not_in_image_result"]

