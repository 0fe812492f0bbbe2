"""Headless diagnostic plots (matplotlib's Agg canvas; no display and no pyplot state needed).

Every function returns the matplotlib ``Figure`` and, with ``path``, writes it as a PNG there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ppl_thought import checks
from ppl_thought.diagnostics.inference_data import psis_khat
from ppl_thought.errors import DiagnosticError
from ppl_thought.validation import ArrayLike, FloatOrNaN, checked


def _figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _save(fig, path: str | Path | None):
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100, format="png")
    return fig


@checked
def plot_weights(log_weights: ArrayLike, path: str | Path | None = None, khat: FloatOrNaN | None = None,
                 title: str = "importance weights"):
    """Sorted normalised importance weights (log scale) and the PSIS Pareto k against 0.5 / 0.7."""

    checks.numeric_array("log_weights", log_weights, DiagnosticError, "log weights (a tensor, an array or a list "
                         "of numbers)")
    lw = np.asarray(torch.as_tensor(log_weights, dtype=torch.float64).cpu()).reshape(-1)
    if lw.size == 0:
        raise DiagnosticError("plot_weights: no log weights (an empty array): nothing to plot")
    if khat is not None and np.ndim(khat) != 0:
        raise DiagnosticError(f"plot_weights: khat is one number (the PSIS Pareto k, NaN where unknown), got an array "
                              f"of shape {np.shape(khat)}")
    k = psis_khat(lw) if khat is None else float(khat)
    fin = np.isfinite(lw)
    fig, (ax1, ax2) = _figure(2)
    if fin.any():
        w = np.exp(lw[fin] - lw[fin].max())
        w = np.sort(w / w.sum())[::-1]
        ax1.semilogy(np.arange(1, len(w) + 1), w, ".-", ms=3)
        ess = 1.0 / float((w**2).sum())
        ax1.set_title(f"{title}: ESS {ess:.1f} / {len(lw)} ({(~fin).sum()} zero)")
    else:
        ax1.set_title(f"{title}: every weight is zero")
    ax1.set_xlabel("rank")
    ax1.set_ylabel("normalised weight")
    kk = k if math.isfinite(k) else 0.0
    ax2.bar([0], [kk], color="C1" if kk > 0.7 else ("C2" if kk < 0.5 else "C0"))
    for thr, style in ((0.5, ":"), (0.7, "--")):
        ax2.axhline(thr, ls=style, color="k", lw=1)
    ax2.set_xticks([0], ["Pareto k"])
    ax2.set_ylim(min(0.0, kk) - 0.1, max(1.0, kk + 0.1))
    if math.isfinite(k):
        ax2.set_title(f"PSIS k-hat = {k:.3g}")
    else:  # PSIS fits a tail: too few distinct finite weights (e.g. a handful of particles)
        ax2.set_title("PSIS k-hat: not available")
        ax2.text(0, 0.5, f"no Pareto fit\n({int(fin.sum())} finite weights)", ha="center", va="center")
    return _save(fig, path)


@runtime_checkable
class ScalingLawLike(Protocol):
    """What :func:`plot_scaling_law` reads of a :class:`~ppl_thought.diagnostics.scaling.ScalingLaw` (that module
    imports this one, so the class is named by its fields here)."""

    task: str
    ns: Any
    measured: Any
    measured_se: Any
    predicted: Any
    chi2: float
    slope: float


@checked
def plot_scaling_law(law: ScalingLawLike, path: str | Path | None = None):
    """Measured error against n (2 standard errors) with the Table 3.1 prediction, log-log."""
    fig, (ax,) = _figure()
    ns = np.asarray(law.ns, dtype=float)
    ax.errorbar(ns, law.measured, yerr=2 * np.asarray(law.measured_se), fmt="o", label="measured", capsize=3)
    ax.plot(ns, law.predicted, "-", label="prediction (Table 3.1)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sampling size n")
    ax.set_ylabel({"encoding": "E (p_n - p)^2", "decoding": "E TV(Q*, Q_n)",
                   "gradient": "E ||v_n - grad p||^2"}.get(law.task, "error"))
    ax.set_title(f"{law.task}: chi2 = {law.chi2:.3g}, slope {law.slope:.2f}")
    ax.legend()
    return _save(fig, path)


@checked
def plot_ess(ess_per_step: Sequence[float], num_particles: int | None = None, path: str | Path | None = None,
             resampled: Sequence[bool] | None = None, threshold: float | None = None):
    """ESS after each SMC step, with resampling steps marked."""
    checks.numeric_array("ess_per_step", ess_per_step, DiagnosticError, "a sequence of ESS values (numbers)")
    ess = np.asarray(torch.as_tensor(ess_per_step, dtype=torch.float64).cpu()).reshape(-1)
    fig, (ax,) = _figure()
    steps = np.arange(1, len(ess) + 1)
    ax.plot(steps, ess, "o-", label="ESS")
    if resampled is not None and len(resampled):
        r = np.asarray(resampled, dtype=bool)[: len(ess)]
        ax.plot(steps[r], ess[r], "rx", ms=9, label="resampled")
    if num_particles:
        ax.axhline(num_particles, color="k", lw=1, ls=":", label="n")
        if threshold:
            ax.axhline(threshold * num_particles, color="r", lw=1, ls="--", label="threshold")
    ax.set_xlabel("SMC step (observed segment)")
    ax.set_ylabel("effective sample size")
    ax.set_ylim(bottom=0)
    ax.legend()
    return _save(fig, path)


@checked
def plot_causal_gap(series: Mapping[str, tuple[Sequence[int], Sequence[float]]] | Sequence[float],
                    path: str | Path | None = None):
    """The causal gap (7.3) over training steps (several named series, e.g. explanatory vs predictive)."""
    if not isinstance(series, Mapping):
        vals = list(series)
        series = {"causal gap (7.3)": (list(range(len(vals))), vals)}
    fig, (ax,) = _figure()
    for name, (steps, vals) in series.items():
        ax.plot(steps, vals, "-", label=name)
    ax.axhline(0.0, color="k", lw=1, ls=":")
    ax.set_xlabel("training step")
    ax.set_ylabel("weighted causal gap")
    ax.legend()
    return _save(fig, path)


@checked
def plot_trace(values: ArrayLike, path: str | Path | None = None, name: str = "accept_prob"):
    """A per-chain trace ``[chains, draws]`` (e.g. Langevin acceptance probabilities)."""
    checks.numeric_array("values", values, DiagnosticError, "a trace [chains, draws] or [draws] of numbers")
    v = np.asarray(torch.as_tensor(values, dtype=torch.float64).cpu())
    if v.ndim == 1:
        v = v[None]
    if v.ndim != 2 or v.size == 0:
        raise DiagnosticError(f"plot_trace: values must be a non-empty trace [chains, draws] or [draws], got shape "
                              f"{tuple(v.shape)}")
    fig, (ax,) = _figure()
    for c in range(v.shape[0]):
        ax.plot(v[c], lw=0.8, label=f"chain {c}")
    ax.set_xlabel("draw")
    ax.set_ylabel(name)
    if v.shape[0] <= 8:
        ax.legend()
    return _save(fig, path)


__all__ = ["plot_causal_gap", "plot_ess", "plot_scaling_law", "plot_trace", "plot_weights"]
