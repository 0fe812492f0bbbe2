"""JAX engine results as ArviZ ``InferenceData``, with the weights kept as on the torch side
(ppl_thought/diagnostics/inference_data.py; the table in docs/diagnostics.md).

Weighted results (Importance (3.2), SMC): ``posterior`` holds an equal-weight systematic resample of the particles
(copies of one particle adjacent, in particle order; by the PSIS-smoothed weights when the Pareto k-hat is >= 0.5)
of the size :func:`~ppl_thought.draws.bounded_num_draws` gives, so no ``az.ess`` of it exceeds the importance ESS;
``particles`` holds the raw particles with ``log_weight`` (and ``log_weight_psis``, ``log_p``, ``log_q``,
``ancestry``); attrs record ``log_marginal``, ``log_marginal_stderr``, ``ess``, ``khat``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.arviz_compat import make_inference_data
from ppl_thought.arviz_compat import psislw as _psislw
from ppl_thought.draws import bounded_num_draws
from ppl_thought.errors import DiagnosticError, UnsupportedResultError
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.infer.resampling import check_log_weights, effective_sample_size, systematic_resample
from ppl_thought.validation import not_checked

PSIS_THRESHOLD = 0.5


@not_checked("a NumPy helper behind to_inference_data, which is checked")
def psis(lw: np.ndarray) -> tuple[np.ndarray, float]:
    """ArviZ's PSIS on the finite weights (as ``ppl_thought.inference.result.psis``): smoothed normalised log
    weights and k-hat (-inf for constant weights, nan when the tail is too short for the fit)."""
    out = np.full(lw.shape, -np.inf)
    fin = np.isfinite(lw)
    if not fin.any():
        return out, math.nan
    x = lw[fin]
    if float(x.max() - x.min()) < 1e-12:
        out[fin] = -math.log(x.size)
        return out, -math.inf
    smoothed, k = _psislw(x)
    out[fin] = smoothed
    return out, float(k) if np.isfinite(k) else math.nan


def _vars(name: str, a: np.ndarray) -> dict[str, Any]:
    dims = ("chain", "draw") + tuple(f"{name}_dim_{i}" for i in range(a.ndim - 2))
    out = {name: (dims, a)}
    if a.ndim == 3 and np.issubdtype(a.dtype, np.integer):  # a padded token sequence: its length too
        out[f"{name}_length"] = (("chain", "draw"), (a != 0).sum(-1))
    return out


@checked_jax
def to_inference_data(result: Any, num_draws: int | None = None, seed: int = 0, group: int | None = None) -> Any:
    """Convert a :class:`~ppl_thought.numpyro.infer.Result` of Importance or SMC to ``arviz.InferenceData``
    (module docstring; an ``xarray.DataTree`` with the same groups under ArviZ 1.x). ``group``: the group of a
    grouped SMC result (``SMC(n, groups=G)``)."""
    import xarray as xr

    from ppl_thought.numpyro.infer.result import Result

    if not isinstance(result, Result):
        raise UnsupportedResultError(f"to_inference_data expects a ptn.infer.Result, got {type(result).__name__}")
    if result.log_weights is None:
        raise UnsupportedResultError("to_inference_data: this converter takes weighted results (Importance, SMC)")
    lw = np.asarray(result.log_weights, np.float64)
    check_log_weights(lw, "to_inference_data")  # NaN in, an error out (DiagnosticError)
    for name in ("log_marginal",):
        v = getattr(result, name)
        if v is not None and bool(np.isnan(np.asarray(v, np.float64)).any()):
            raise DiagnosticError(f"to_inference_data: the result's {name} is NaN: nothing trustworthy to convert "
                                  "(a model or guide log-probability was NaN)")
    samples = {k: np.asarray(v) for k, v in result.samples.items()}
    logz, se = result.log_marginal, result.log_marginal_stderr
    ancestry = result.ancestry
    if lw.ndim == 2:
        if group is None or not 0 <= int(group) < lw.shape[0]:
            raise DiagnosticError(f"a grouped result ({lw.shape[0]} groups): pass group= in [0, {lw.shape[0]})")
        g = int(group)
        lw, samples = lw[g], {k: v[g] for k, v in samples.items()}
        logz = np.asarray(logz)[g]
        se = None if se is None else np.asarray(se)[g]
        ancestry = None if ancestry is None else np.asarray(ancestry)[g]
    n = lw.size
    ess = float(effective_sample_size(jnp.asarray(lw)))
    smoothed, khat = psis(lw)
    use_psis = bool(np.isfinite(khat) and khat >= PSIS_THRESHOLD)
    w_log = smoothed if use_psis else lw
    ess_used = min(ess, float(effective_sample_size(jnp.asarray(w_log))))
    m = bounded_num_draws(ess_used) if num_draws is None else int(num_draws)
    draws = np.zeros(0, np.int64)
    if np.isfinite(lw).any() and m > 0:
        draws = np.asarray(systematic_resample(jax.random.PRNGKey(int(seed)), jnp.asarray(w_log), m))
    post, parts, stats = {}, {"log_weight": (("chain", "draw"), lw[None])}, {}
    for name, a in samples.items():
        if a.shape[:1] != (n,):
            raise DiagnosticError(f"site {name!r} has leading size {a.shape[:1]}, expected the {n} particles")
        post.update(_vars(name, a[draws][None]))
        parts.update(_vars(name, a[None]))
    if np.isfinite(khat):
        parts["log_weight_psis"] = (("chain", "draw"), smoothed[None])
    for key in ("log_p", "log_q"):
        v = result.stats.get(key)
        if v is not None and np.size(v) == n:
            parts[key] = (("chain", "draw"), np.asarray(v, np.float64).reshape(1, n))
            if key == "log_p" and len(draws):
                stats["lp"] = (("chain", "draw"), np.asarray(v, np.float64).reshape(n)[draws][None])
    if ancestry is not None:
        parts["ancestry"] = (("chain", "draw", "step"), np.asarray(ancestry, np.int64).T[None])
    attrs = {"inference_library": "ppl_thought.numpyro", "engine": result.engine,
             "log_marginal": float(logz), "log_marginal_stderr": math.nan if se is None else float(se),
             "ess": ess, "ess_fraction": ess / n if n else 0.0, "khat": khat, "num_particles": n,
             "num_draws": int(len(draws)), "posterior_weights": "psis" if use_psis else "raw",
             "posterior": "systematic resample of the weighted particles (particle order)", "seed": int(seed)}
    groups = {"posterior": xr.Dataset(post, coords={"chain": [0], "draw": np.arange(len(draws)),
                                                    "particle": ("draw", draws)}, attrs=attrs),
              "particles": xr.Dataset(parts, attrs=attrs)}
    if stats:
        groups["sample_stats"] = xr.Dataset(stats, attrs=attrs)
    return make_inference_data(groups)  # InferenceData (ArviZ 0.x) or xarray.DataTree (1.x)


__all__ = ["PSIS_THRESHOLD", "psis", "to_inference_data"]
