"""Slow-thinking scaling laws (Table 3.1), measured against their chi^2 / n predictions.

For a small :class:`~ppl_thought.models.SlowThinking` model the lifting of x is enumerated, so the
targets are exact. :func:`scaling_law` draws ``reps`` independent batches of n samples from the
sampler Q(.|x) for each n and measures

- ``"encoding"``: E[(p_n - p)^2] of the estimator (3.2) of p = (Proj # P)^{<=|x|}(x). Prediction
  (3.4): p^2 chi^2(Q_*(.|x) || Q(.|x)) / n (an identity, not a bound).
- ``"decoding"``: E[TV(Q_*(.|x), Q_n)] with Q_n = sum_i W_i delta_{Z_i} the self-normalised
  weighted empirical posterior that direct decoding (3.14) resamples from. Prediction (Prop 3.3):
  the upper bound sqrt((6 chi^2 + 2) / n). That bound is formal: the empirical Q_n has at most n atoms,
  so when the lifting has many more than n sequences E[TV] stays large and can exceed it (pre-asymptotic
  regime). ``extra["tv_of_mean"]`` is TV(Q_*, mean over reps of Q_n), the law of one decoded latent
  (its SIR bias, plus a Monte-Carlo floor of order sqrt(|lifting| / reps)).
- ``"gradient"``: E[||v_n - grad_theta p||^2] with v_n = (1/n) sum_i w_i grad_theta log P(Z_i) the
  unbiased estimate of the training target grad_theta (Proj # P_f)^{<=|x|}(x). Its exact error is
  [C_up^2 (chi^2(Q_bullet || Q) + 1) - C_down^2] / n with C_up = sum_z P(z) ||grad log P(z)||,
  C_down = ||grad p|| and Q_bullet the inquisitive sampler (3.22): the form of (3.24) with one
  sampler (the chi^2(Q_* || Q) term of (3.24) comes from the normalisation 1/q_n, absent here).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppl_thought.diagnostics.plots import plot_scaling_law
from ppl_thought.diagnostics.sampler_quality import chi2
from ppl_thought.errors import ConfigError, DiagnosticError
from ppl_thought.guides.exact import Inquisitive
from ppl_thought.models.slow_thinking import SlowThinking
from ppl_thought.validation import ArrayLike, SupportsSampleWithLogProb, checked

TASKS = ("encoding", "decoding", "gradient")
_ALPHA = {"encoding": 1.0, "decoding": 0.5, "gradient": 1.0}  # error ~ n^-alpha


@checked
@dataclass
class ScalingLaw:
    """Measured error against sampling size n next to the Table 3.1 prediction.

    ``measured[j]`` is the mean error over ``reps`` batches of ``ns[j]`` samples, ``measured_se[j]`` its
    standard error, ``predicted[j]`` the prediction at ``ns[j]``. ``constant`` = mean_j n^alpha
    measured_j / scale (alpha = 1, or 1/2 for decoding; scale = p^2 for encoding, else 1) is the
    measured constant of the law, ``predicted_constant`` the same for the prediction (for encoding it
    is chi^2(Q_* || Q) exactly); ``slope`` the least-squares slope of log error against log n (-alpha).
    """

    task: str
    ns: np.ndarray
    measured: np.ndarray
    measured_se: np.ndarray
    predicted: np.ndarray
    chi2: float
    constant: float
    predicted_constant: float
    slope: float
    reps: int
    scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    def plot(self, path: str | Path | None = None):
        """A log-log plot of the measured error (with 2 standard errors) and the prediction."""

        return plot_scaling_law(self, path)

    def table(self) -> str:
        lines = [f"{self.task}: chi2(Q*||Q) = {self.chi2:.4g}, constant {self.constant:.4g} "
                 f"(predicted {self.predicted_constant:.4g}), slope {self.slope:.3f}"]
        lines += [f"  n={int(n):6d}  measured {m:.4e} +- {s:.1e}  predicted {p:.4e}"
                  for n, m, s, p in zip(self.ns, self.measured, self.measured_se, self.predicted)]
        return "\n".join(lines)


def _pad(z: torch.Tensor, L: int) -> torch.Tensor:
    if z.shape[-1] >= L:
        if z.shape[-1] > L and (z[..., L:] != 0).any():
            raise DiagnosticError("a sampled z is longer than every sequence of the enumerated lifting")
        return z[..., :L]
    return torch.cat([z, torch.zeros(z.shape[:-1] + (L - z.shape[-1],), dtype=z.dtype)], -1)


def support_index(support: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Row index of each row of ``z`` in ``support`` (both right-padded with 0), -1 where absent."""
    L = max(support.shape[-1], z.shape[-1])
    s, zz = _pad(support.long(), L), _pad(z.long(), L)
    uniq, inv = torch.unique(torch.cat([s, zz]), dim=0, return_inverse=True)
    table = torch.full((uniq.shape[0],), -1, dtype=torch.long)
    table[inv[: len(s)]] = torch.arange(len(s))
    return table[inv[len(s):]]


@checked
def scaling_law(model: SlowThinking, sampler: SupportsSampleWithLogProb, x: ArrayLike, task: str = "encoding",
                ns: Iterable[int] = (4, 8, 16, 32, 64), reps: int = 500,
                seed: int | None = 0, limit: int = 2_000) -> ScalingLaw:
    """Measure a Table 3.1 scaling law on a small (enumerable) model; see the module docstring.

    Args:
        model: a :class:`~ppl_thought.models.SlowThinking` whose lifting of x can be enumerated.
        sampler: Q(.|x) with ``sample_with_log_prob(x, n)`` and ``log_prob(z, x)``.
        x: the observation.
        task: ``"encoding"`` | ``"decoding"`` | ``"gradient"`` (needs a prior with trainable parameters).
        ns: sampling sizes n; reps: independent batches per n (one pool of reps x max(ns) draws, the first
            n of each batch used for size n). seed: torch seed (global RNG state is restored).
    """
    if task not in TASKS:
        raise ConfigError(f"task must be one of {TASKS}, got {task!r}")
    ns_arr = np.array(sorted({int(n) for n in ns}), dtype=np.int64)
    if len(ns_arr) == 0 or ns_arr[0] < 1:
        raise ConfigError(f"ns must be positive sampling sizes, got {ns}")
    if int(reps) < 2:
        raise ConfigError(f"reps must be >= 2, got {reps}")
    reps = int(reps)
    G = None
    if task == "gradient":

        support, lj, G = Inquisitive(model, limit=limit).per_sequence_gradients(x)
        G = G.double()
    else:
        support, lj = model.enumerate_log_joint(x, limit=limit)
    lj = lj.double()
    log_p = torch.logsumexp(lj, 0)
    if not torch.isfinite(log_p):
        raise DiagnosticError("x has probability 0 under the model: no scaling law to measure")
    post = (lj - log_p).exp()
    with torch.no_grad():
        lq_support = sampler.log_prob(support, x).double()
    chi2_x = chi2(lj - log_p, lq_support)
    if not math.isfinite(chi2_x):
        raise DiagnosticError("the sampler misses posterior mass (chi2 = inf): every scaling law is infinite")

    N = reps * int(ns_arr[-1])
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            z, lq = sampler.sample_with_log_prob(x, N)
    idx = support_index(support, z)
    lq = lq.double()
    lw = torch.where(idx >= 0, lj[idx.clamp(min=0)] - lq, torch.full_like(lq, -math.inf))
    lw_rel = (lw - log_p).reshape(reps, -1)  # log (w / p)
    idx = idx.clamp(min=0).reshape(reps, -1)

    alpha = _ALPHA[task]
    p2 = float((2 * log_p).exp())
    scale = p2 if task == "encoding" else 1.0
    extra: dict[str, Any] = {"log_p": float(log_p)}
    if task == "gradient":
        v_star = (post[:, None] * G).sum(0)  # grad p / p
        q = lq_support.exp()
        c_up = float((post * G.norm(dim=-1)).sum())  # / p
        second = float(((post**2 / q).nan_to_num(0.0) * (G**2).sum(-1)).sum())  # E_Q[(w/p)^2 |G|^2]
        var1 = p2 * max(0.0, second - float((v_star**2).sum()))
        extra.update(C_up=c_up * math.sqrt(p2), C_down=float(v_star.norm()) * math.sqrt(p2),
                     chi2_inquisitive=(second / c_up**2 - 1.0) if c_up > 0 else math.nan)
    measured, se, predicted = [], [], []
    for n in ns_arr:
        lwn, idn = lw_rel[:, :n], idx[:, :n]
        if task == "encoding":
            err = p2 * ((torch.logsumexp(lwn, -1) - math.log(n)).exp() - 1.0) ** 2
            pred = p2 * chi2_x / n
        elif task == "decoding":
            W = torch.softmax(lwn, -1)
            Qn = torch.zeros(reps, len(post), dtype=torch.float64).scatter_add_(1, idn, W)
            err = 0.5 * (Qn - post[None]).abs().sum(-1)
            extra.setdefault("tv_of_mean", []).append(float(0.5 * (Qn.mean(0) - post).abs().sum()))
            pred = math.sqrt((6 * chi2_x + 2) / n)
        else:
            S = torch.zeros(reps, len(post), dtype=torch.float64).scatter_add_(1, idn, lwn.exp()) / n
            err = p2 * ((S @ G - v_star[None]) ** 2).sum(-1)
            pred = var1 / n
        measured.append(float(err.mean()))
        se.append(float(err.std() / math.sqrt(reps)))
        predicted.append(pred)
    m, p = np.array(measured), np.array(predicted)
    const = float(np.mean(ns_arr**alpha * m) / scale)
    pconst = float(np.mean(ns_arr**alpha * p) / scale)
    pos = m > 0
    slope = float(np.polyfit(np.log(ns_arr[pos]), np.log(m[pos]), 1)[0]) if pos.sum() >= 2 else math.nan
    return ScalingLaw(task=task, ns=ns_arr, measured=m, measured_se=np.array(se), predicted=p, chi2=chi2_x,
                      constant=const, predicted_constant=pconst, slope=slope, reps=reps, scale=scale, extra=extra)


__all__ = ["TASKS", "ScalingLaw", "scaling_law", "support_index"]
