"""Engine results as ArviZ ``InferenceData`` (ARCHITECTURE.md, "Contracts").

Weighted results (importance sampling (3.2), SMC) become one chain whose draws are the particles;
MCMC results (Langevin) keep their chains x draws. Groups:

- ``posterior``: every latent site, numeric only. Integer sequence sites (``[particles, L]``) stay padded
  integer arrays (pad id 0) with a length variable ``<site>_length``.
- ``posterior_text``: with a ``vocab``, the decoded text of each sequence site, ``<site>_text`` (strings
  live apart so that ``az.summary``, ``az.plot_trace`` and ``az.plot_posterior`` work on ``posterior``).
- ``sample_stats``: ``log_weight`` (and ``ancestry`` ``[chain, draw, step]`` for SMC; ``log_p``/``log_q``
  where the engine kept them) or, for Langevin, ``accept_prob``, ``step_size``, ``diverging`` and
  ``lp`` (= -potential energy). Its attrs (and the posterior's) record ``log_marginal``,
  ``log_marginal_stderr`` (delta method, (3.4)), the importance ``ess``, the PSIS Pareto ``khat``
  (``arviz.psislw``) and, for SMC, ``ess_per_step`` and ``resampled``.
- ``observed_data``: the data the engine saw (``x``, or ``arg<i>`` / keyword names).
- ``log_likelihood``: where the engine computed one (``stats["log_likelihood"]``, per particle), or
  passed explicitly.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ppl_thought.errors import DiagnosticError
from ppl_thought.inference.smc import resample
from ppl_thought.vocab import PAD_ID


def import_arviz():
    """``import arviz`` with its FutureWarning about the 1.0 refactor silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*arviz.*")
        import arviz

    return arviz


def psis_khat(log_w) -> float:
    """PSIS Pareto k-hat of importance log-weights (``arviz.psislw``).

    ``-inf`` for constant weights (the exact posterior: nothing to smooth), ``nan`` when fewer than
    10 finite weights are available; k < 0.5 good, 0.5-0.7 usable, > 0.7 unreliable.
    """
    lw = np.asarray(torch.as_tensor(log_w, dtype=torch.float64).detach().cpu()).reshape(-1)
    lw = lw[np.isfinite(lw)]
    if lw.size < 10:
        return math.nan
    if float(lw.max() - lw.min()) < 1e-12:
        return -math.inf
    az = import_arviz()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, k = az.psislw(lw.copy())
    return float(np.asarray(k))


def _np(v) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        if v.dtype == torch.bfloat16:
            v = v.float()
        return v.numpy()
    return np.asarray(v)


def _scalar(v) -> float:
    if v is None:
        return math.nan
    return float(torch.as_tensor(v).detach().double().reshape(-1)[0]) if torch.as_tensor(v).numel() else math.nan


def _decode(vocab, row: np.ndarray) -> str:
    ids = [int(t) for t in row if int(t) != PAD_ID]
    try:
        return vocab.decode(ids)
    except Exception:  # noqa: BLE001 - decoding is a convenience: never fail the conversion on it
        return " ".join(str(i) for i in ids)


def _site_vars(name: str, value: np.ndarray, lead: int, vocab) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
    """xarray variables for one site whose first ``lead`` dims are (chain, draw)."""
    dims = ("chain", "draw")
    extra = tuple(f"{name}_dim_{i}" for i in range(value.ndim - lead))
    out = {name: (dims + extra, value)}
    if np.issubdtype(value.dtype, np.integer) and value.ndim == lead + 1:  # a padded sequence site
        out[name] = (dims + (f"{name}_pos",), value)
        out[f"{name}_length"] = (dims, (value != PAD_ID).sum(-1).astype(np.int64))
    return out


def _text_vars(name: str, value: np.ndarray, lead: int, vocab) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
    """``<site>_text``: a padded integer sequence site decoded with ``vocab`` (group ``posterior_text``)."""
    if vocab is None or not (np.issubdtype(value.dtype, np.integer) and value.ndim == lead + 1):
        return {}
    text = np.array([_decode(vocab, r) for r in value.reshape(-1, value.shape[-1])], dtype=object)
    return {f"{name}_text": (("chain", "draw"), text.reshape(value.shape[:lead]).astype(str))}


def _observed_vars(observed: Mapping[str, Any], vocab) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
    flat: dict[str, Any] = {}
    for key, v in observed.items():
        if key == "args" and isinstance(v, tuple | list):
            for i, a in enumerate(v):
                flat["x" if len(v) == 1 else f"arg{i}"] = a
        elif key == "kwargs" and isinstance(v, Mapping):
            flat.update(v)
        else:
            flat[key] = v
    out = {}
    for key, v in flat.items():
        if v is None:
            continue
        if isinstance(v, str):
            out[key] = ((), np.array(v))
            continue
        try:
            arr = _np(v)
        except Exception:  # noqa: BLE001 - data of a kind xarray cannot hold is skipped
            continue
        if arr.dtype == object:
            continue
        out[key] = (tuple(f"{key}_dim_{i}" for i in range(arr.ndim)), arr)
        if vocab is not None and np.issubdtype(arr.dtype, np.integer) and arr.ndim == 1:
            out[f"{key}_text"] = ((), np.array(_decode(vocab, arr)))
    return out


def _clean_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes netcdf can store: numbers, strings and numeric arrays (bools become ints)."""
    out = {}
    for k, v in attrs.items():
        if v is None:
            continue
        if isinstance(v, torch.Tensor | np.ndarray | list | tuple):
            a = _np(v)
            if a.dtype == bool:
                a = a.astype(np.int8)
            if a.dtype == object:
                continue
            out[k] = a.item() if a.ndim == 0 else a
        elif isinstance(v, bool):
            out[k] = int(v)
        elif isinstance(v, int | float | str | np.number):
            out[k] = v
    return out


def to_inference_data(result, vocab=None, log_likelihood: Mapping[str, Any] | None = None,
                      num_draws: int | None = None, seed: int = 0):
    """Convert an engine ``Result`` to ``arviz.InferenceData`` (see the module docstring for the groups).

    Args:
        result: a :class:`~ppl_thought.inference.result.Result` from Importance, SMC or Langevin.
        vocab: a :class:`~ppl_thought.Vocab`; when given, sequence sites and observed token arrays are
            also decoded to text.
        log_likelihood: optional ``{name: values}`` with particles (or chains x draws) leading, stored in
            the ``log_likelihood`` group (overrides ``result.stats["log_likelihood"]``).

        num_draws: weighted results: the size of the equal-weight ``posterior`` (default: the number of
            particles), drawn by systematic resampling with ``seed``.

    Weighted results (IS (3.2), SMC): ``posterior`` holds equal-weight draws (systematic resampling of the
    particles by their weights), so ArviZ's summaries, ESS and plots describe the weighted posterior,
    not the proposal; ``sample_stats.particle`` says which particle each draw is. The raw particles and
    their ``log_weight`` (and ``ancestry``, ``log_p``, ``log_q``) are in the ``particles`` group (text in
    ``particles_text``). ``log_marginal`` (3.2), its delta-method standard error ((3.4)), the importance
    ``ess`` = (sum w)^2 / sum w^2 and the PSIS Pareto ``khat`` are attrs of ``posterior``,
    ``sample_stats`` and ``particles``; ``-inf`` log weights stay ``-inf``.
    """
    import xarray as xr

    az = import_arviz()
    if result is None or not hasattr(result, "samples"):
        raise TypeError(f"to_inference_data expects an engine Result, got {type(result).__name__}")
    weighted = result.log_weights is not None
    stats = dict(result.stats or {})
    if weighted:
        lw = _np(result.log_weights).astype(np.float64).reshape(-1)
        n = lw.size
        lead = 1

        def shape_draws(v):
            a = _np(v)
            if a.ndim == 0 or a.shape[0] != n:
                raise ValueError(f"a weighted result's site has leading size {a.shape[:1]}, expected the {n} "
                                 "particles")
            return a[None]
    else:
        lead = 2

        def shape_draws(v):
            a = _np(v)
            if a.ndim < 2:
                raise ValueError(f"an MCMC result's site needs [chains, draws, ...], got shape {a.shape}")
            return a

    draws = None
    if weighted:
        m = n if num_draws is None else int(num_draws)
        if m < 1:
            raise DiagnosticError(f"num_draws must be >= 1, got {num_draws}")
        draws = np.zeros(0, dtype=np.int64)
        if n:  # systematic resampling (the SMC engine's), in particle order: copies of a particle stay adjacent
            w = torch.softmax(torch.as_tensor(lw), 0) if np.isfinite(lw).any() else torch.ones(n)
            draws = resample(w, "systematic", torch.Generator().manual_seed(seed), size=m).numpy()

    def at_draws(a: np.ndarray) -> np.ndarray:
        return a if draws is None else a[:, draws]

    post: dict[str, Any] = {}
    texts: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    raw_texts: dict[str, Any] = {}
    for name, value in result.samples.items():
        drawn = shape_draws(value)
        post.update(_site_vars(name, at_draws(drawn), 2, vocab))
        texts.update(_text_vars(name, at_draws(drawn), 2, vocab))
        if weighted:
            raw.update(_site_vars(name, drawn, 2, vocab))
            raw_texts.update(_text_vars(name, drawn, 2, vocab))
    del lead

    attrs: dict[str, Any] = {"engine": result.engine or "", "inference_library": "ppl_thought"}
    ss: dict[str, Any] = {}
    if weighted:
        ss["particle"] = (("chain", "draw"), draws[None].astype(np.int64))
        raw["log_weight"] = (("chain", "draw"), lw[None])
        ess = float(result.ess) if n else 0.0
        attrs.update(log_marginal=_scalar(result.log_marginal), log_marginal_stderr=_scalar(result.log_marginal_stderr),
                     ess=ess, ess_fraction=ess / n if n else 0.0, khat=psis_khat(lw), num_particles=n,
                     num_draws=len(draws), posterior="systematic resample of the weighted particles")
        for key in ("log_p", "log_q"):
            v = stats.get(key)
            if isinstance(v, torch.Tensor) and v.numel() == n:
                raw[key] = (("chain", "draw"), _np(v).reshape(1, n))
        if result.ancestry is not None and torch.as_tensor(result.ancestry).numel():
            anc = _np(result.ancestry).astype(np.int64)  # [steps, n]
            raw["ancestry"] = (("chain", "draw", "step"), anc.T[None])
        if "ess" in stats and isinstance(stats["ess"], list | tuple):
            attrs["ess_per_step"] = np.asarray(stats["ess"], dtype=np.float64)
        if "resampled" in stats:
            attrs["resampled"] = np.asarray(stats["resampled"], dtype=np.int8)
    else:
        names = {"accept_prob": "accept_prob", "step_size": "step_size", "divergences": "diverging"}
        for key, out in names.items():
            if key in stats:
                ss[out] = (("chain", "draw"), shape_draws(stats[key]))
        if "potential_energy" in stats:
            ss["lp"] = (("chain", "draw"), -shape_draws(stats["potential_energy"]).astype(np.float64))
        if "accept_prob" in stats:
            attrs["mean_accept_prob"] = float(np.mean(_np(stats["accept_prob"])))
    attrs = _clean_attrs(attrs)

    groups: dict[str, Any] = {"posterior": xr.Dataset(post, attrs=attrs)}
    if texts:  # strings in a group of their own: every ArviZ summary and plot works on the posterior
        groups["posterior_text"] = xr.Dataset(texts)
    if raw:
        groups["particles"] = xr.Dataset(raw, attrs=attrs)
    if raw_texts:
        groups["particles_text"] = xr.Dataset(raw_texts)
    if ss:
        groups["sample_stats"] = xr.Dataset(ss, attrs=attrs)
    obs = _observed_vars(result.observed or {}, vocab)
    if obs:
        groups["observed_data"] = xr.Dataset(obs)
    ll = dict(log_likelihood) if log_likelihood is not None else None
    if ll is None and stats.get("log_likelihood") is not None:
        v = stats["log_likelihood"]
        ll = dict(v) if isinstance(v, Mapping) else {"x": v}
    if ll:
        lvars = {}
        for name, v in ll.items():
            a = at_draws(shape_draws(v).astype(np.float64))  # aligned with the posterior's draws
            lvars[name] = (("chain", "draw") + tuple(f"{name}_dim_{i}" for i in range(a.ndim - 2)), a)
        groups["log_likelihood"] = xr.Dataset(lvars)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        return az.InferenceData(**groups)


def load_inference_data(path) -> Any:
    """``arviz.from_netcdf(path)`` (the inverse of ``to_inference_data(...).to_netcdf(path)``)."""
    az = import_arviz()
    return az.from_netcdf(str(path))


__all__ = ["import_arviz", "load_inference_data", "psis_khat", "to_inference_data"]
