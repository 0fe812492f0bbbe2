"""Engine results as ArviZ ``InferenceData`` (docs/architecture.md, "Contracts"; the table in docs/diagnostics.md).

Every result type converts; the draw layout follows what the draws are:

- weighted results (Importance (3.2), SMC, the final batch of a particle-objective SVI run): ``posterior``
  holds equal-weight draws, a systematic resample of the particles (copies of one particle adjacent, in
  particle order), of a size that keeps every ``az.ess`` at or under the importance ESS
  (:func:`bounded_num_draws`). The raw particles with ``log_weight`` (``log_weight_psis``, ``ancestry``,
  ``log_p``, ``log_q``) are in ``particles``. Grouped SMC results convert one group at a time (``group=``).
- MCMC results (Langevin): ``posterior`` is chains x draws; ``sample_stats`` ``accept_prob``, ``step_size``,
  ``diverging``, ``lp``.
- unweighted independent draws (rejection samplers; decoding): one chain whose draws are the samples.
  Decoded continuations (:class:`~ppl_thought.inference.decoding.Decoded`) put the latent sequences in
  ``posterior`` and the new observable tokens in ``predictions`` (ArviZ's group for out-of-sample draws).
- SVI: the optimisation trajectory in ``sample_stats`` (draw = step): ``loss`` and each recorded parameter.

Integer sequence sites ``[.., L]`` are padded arrays (pad id 0) with ``<site>_length``; with a ``vocab`` their
decoded text is in a ``*_text`` group of its own (``posterior_text``, ``particles_text``, ``predictions_text``),
so that every ArviZ summary and plot works on the numeric groups. Attrs (``posterior``, ``particles``,
``sample_stats``) record the engine's numbers: ``log_marginal`` (3.2), ``log_marginal_stderr`` (delta
method, (3.4)), the importance ``ess``, the PSIS ``khat`` (``arviz.psislw``), ``num_draws`` and, for SMC,
``ess_per_step`` and ``resampled``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppl_thought import checks, schemas
from ppl_thought.arviz_compat import group_dataset, group_names, import_arviz, load_netcdf, make_inference_data
from ppl_thought.draws import bounded_num_draws
from ppl_thought.errors import DiagnosticError, SchemaError, UnsupportedResultError
from ppl_thought.inference.decoding import Decoded
from ppl_thought.inference.resampling import resample
from ppl_thought.inference.result import Result, pareto_k, psis
from ppl_thought.validation import checked
from ppl_thought.vocab import PAD_ID, Vocab
from ppl_thought.weights import check_log_weights, effective_sample_size

#: engines whose unweighted results are chains x draws of a Markov chain (others: independent draws)
MCMC_ENGINES = ("langevin",)
#: above this PSIS k-hat the raw weights have infinite variance (Vehtari et al. 2024): the posterior is
#: resampled from the PSIS-smoothed weights instead
PSIS_THRESHOLD = 0.5

psis_khat = pareto_k  # the public name in ppl_thought.diagnostics (one implementation: inference/result.py)


# ---------------------------------------------------------------------------------------------- small helpers
def _np(v) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        if v.dtype == torch.bfloat16 or v.dtype == torch.float16:
            v = v.float()
        return v.numpy()
    return np.asarray(v)


def _scalar(v) -> float:
    if v is None:
        return math.nan
    t = torch.as_tensor(v).detach()
    return float(t.double().reshape(-1)[0]) if t.numel() else math.nan


def _decode(vocab, row: np.ndarray) -> str:
    ids = [int(t) for t in row if int(t) != PAD_ID]
    try:
        return vocab.decode(ids)
    except Exception:  # noqa: BLE001 - decoding is a convenience: never fail the conversion on it
        return " ".join(str(i) for i in ids)


def _is_sequence(value: np.ndarray, lead: int) -> bool:
    return np.issubdtype(value.dtype, np.integer) and value.ndim == lead + 1


def _site_vars(name: str, value: np.ndarray) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
    """xarray variables for one site ``[chain, draw, ...]``; a padded integer sequence also gets its length."""
    if value.dtype == bool:
        value = value.astype(np.int8)
    if _is_sequence(value, 2):
        return {name: (("chain", "draw", f"{name}_pos"), value),
                f"{name}_length": (("chain", "draw"), (value != PAD_ID).sum(-1).astype(np.int64))}
    return {name: (("chain", "draw") + tuple(f"{name}_dim_{i}" for i in range(value.ndim - 2)), value)}


def _text_vars(name: str, value: np.ndarray, vocab) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
    """``<site>_text``: a padded integer sequence ``[chain, draw, L]`` decoded with ``vocab``."""
    if vocab is None or not _is_sequence(value, 2):
        return {}
    text = np.array([_decode(vocab, r) for r in value.reshape(-1, value.shape[-1])], dtype=object)
    return {f"{name}_text": (("chain", "draw"), text.reshape(value.shape[:2]).astype(str))}


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
        if arr.dtype == bool:  # netcdf has no boolean type
            arr = arr.astype(np.int8)
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
            try:
                a = _np(v)
            except Exception:  # noqa: BLE001 - ragged lists are not attributes
                continue
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


def _safe_name(name: str) -> str:
    """A variable name netcdf (HDF5) accepts: no ``/``."""
    return str(name).replace("/", "_")


def _check_num_draws(num_draws) -> int | None:
    if num_draws is None:
        return None
    try:
        m = operator.index(num_draws)
    except TypeError:
        m = 0
    if isinstance(num_draws, bool) or m < 1:
        raise DiagnosticError(f"num_draws must be a positive int (the size of the equal-weight posterior) or "
                              f"None (the ESS-bounded default), got {num_draws!r}")
    return int(m)


# ---------------------------------------------------------------------------------------------- layouts
class _Groups:
    """The groups of one conversion, filled by the layout functions below."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, Any]] = {}
        self.coords: dict[str, dict[str, Any]] = {}
        self.attrs: dict[str, Any] = dict(_OURS)

    def add(self, group: str, variables: Mapping[str, Any]) -> None:
        if variables:
            self.data.setdefault(group, {}).update(variables)

    def build(self, attr_groups: tuple[str, ...] = ("posterior", "particles", "sample_stats", "predictions")):
        import xarray as xr

        attrs = _clean_attrs(self.attrs)
        groups = {}
        for name, variables in self.data.items():
            ds = xr.Dataset(variables, coords=self.coords.get(name))
            ds.attrs.update(attrs if name in attr_groups else _OURS)
            groups[name] = ds
        return make_inference_data(groups)  # InferenceData (ArviZ 0.x) or xarray.DataTree (1.x)


def _weighted(g: _Groups, result: Result, vocab, num_draws: int | None, seed: int,
              per_draw_stats: bool = True) -> np.ndarray:
    """Posterior = ESS-bounded systematic resample; particles = the raw weighted particles. Returns the
    particle index of each posterior draw."""
    lw = _np(result.log_weights).astype(np.float64).reshape(-1)
    n = lw.size
    stats = result.stats or {}
    finite = np.isfinite(lw)
    ess = float(effective_sample_size(torch.as_tensor(lw, device="cpu"))) if n else 0.0
    smoothed, k = psis(torch.as_tensor(lw, device="cpu"))
    khat = float(k)
    use_psis = bool(np.isfinite(khat) and khat >= PSIS_THRESHOLD)
    w_log = smoothed if use_psis else torch.as_tensor(lw, device="cpu")
    ess_used = min(ess, float(effective_sample_size(w_log))) if finite.any() else 0.0
    m = bounded_num_draws(ess_used) if num_draws is None else num_draws
    draws = np.zeros(0, dtype=np.int64)
    if finite.any() and m > 0:  # systematic resampling in particle order: copies of a particle stay adjacent
        draws = resample(torch.softmax(w_log.double(), 0), "systematic", torch.Generator().manual_seed(int(seed)),
                         size=m).numpy()
    for name, value in result.samples.items():
        a = _np(value)
        if a.ndim == 0 or a.shape[0] != n:
            raise DiagnosticError(f"site {name!r} of a weighted result has leading size {a.shape[:1]}, expected "
                                  f"the {n} particles")
        g.add("posterior", _site_vars(name, a[draws][None]))
        g.add("posterior_text", _text_vars(name, a[draws][None], vocab))
        g.add("particles", _site_vars(name, a[None]))
        g.add("particles_text", _text_vars(name, a[None], vocab))
    g.coords["posterior"] = {"chain": [0], "draw": np.arange(len(draws)), "particle": ("draw", draws)}
    g.add("particles", {"log_weight": (("chain", "draw"), lw[None])})
    if np.isfinite(khat):
        g.add("particles", {"log_weight_psis": (("chain", "draw"), _np(smoothed)[None])})
    for key in ("log_p", "log_q"):
        v = stats.get(key)
        if isinstance(v, torch.Tensor) and v.numel() == n:
            g.add("particles", {key: (("chain", "draw"), _np(v).astype(np.float64).reshape(1, n))})
            if key == "log_p" and per_draw_stats and len(draws):  # ArviZ's lp: log p(z, x) of each draw
                g.add("sample_stats", {"lp": (("chain", "draw"), _np(v).astype(np.float64).reshape(n)[draws][None])})
    if result.ancestry is not None and torch.as_tensor(result.ancestry).numel():
        g.add("particles", {"ancestry": (("chain", "draw", "step"), _np(result.ancestry).astype(np.int64).T[None])})
    g.attrs.update(log_marginal=_scalar(result.log_marginal), log_marginal_stderr=_scalar(result.log_marginal_stderr),
                   ess=ess, ess_fraction=ess / n if n else 0.0, khat=khat, num_particles=n, num_draws=len(draws),
                   posterior_weights="psis" if use_psis else "raw", ess_posterior_weights=ess_used,
                   posterior="systematic resample of the weighted particles (particle order)", seed=int(seed))
    if isinstance(stats.get("ess"), list | tuple):
        g.attrs["ess_per_step"] = np.asarray(stats["ess"], dtype=np.float64)
    if "resampled" in stats:
        g.attrs["resampled"] = np.asarray(stats["resampled"], dtype=np.int8)
    if "message" in stats:
        g.attrs["message"] = str(stats["message"])
    return draws


def _chains(g: _Groups, result: Result, vocab) -> None:
    """MCMC: every site ``[chains, draws, ...]``."""
    stats = result.stats or {}
    for name, value in result.samples.items():
        a = _np(value)
        if a.ndim < 2:
            raise DiagnosticError(f"site {name!r} of an MCMC result needs [chains, draws, ...], got shape {a.shape}")
        g.add("posterior", _site_vars(name, a))
        g.add("posterior_text", _text_vars(name, a, vocab))
    names = {"accept_prob": "accept_prob", "step_size": "step_size", "divergences": "diverging"}
    for key, out in names.items():
        if key in stats:
            g.add("sample_stats", {out: (("chain", "draw"), _np(stats[key]))})
    if "potential_energy" in stats:
        g.add("sample_stats", {"lp": (("chain", "draw"), -_np(stats["potential_energy"]).astype(np.float64))})
    if "accept_prob" in stats:
        g.attrs["mean_accept_prob"] = float(np.mean(_np(stats["accept_prob"])))


def _draws(g: _Groups, result: Result, vocab) -> int:
    """Independent unweighted draws (rejection samplers): one chain; per-draw statistics in sample_stats."""
    S = None
    for name, value in result.samples.items():
        a = _np(value)
        if a.ndim == 0:
            raise DiagnosticError(f"site {name!r} holds one value, not a batch of draws")
        if S is not None and a.shape[0] != S:
            raise DiagnosticError(f"site {name!r} has {a.shape[0]} draws, another site {S}")
        S = a.shape[0]
        g.add("posterior", _site_vars(name, a[None]))
        g.add("posterior_text", _text_vars(name, a[None], vocab))
    for key, v in (result.stats or {}).items():
        if S is not None and isinstance(v, torch.Tensor | np.ndarray) and v.ndim >= 1 and v.shape[0] == S:
            a = _np(v)
            g.add("sample_stats", {key: (("chain", "draw") + tuple(f"{key}_dim_{i}" for i in range(a.ndim - 1)),
                                         a[None])})
        else:
            g.attrs.setdefault(key, v)
    return S or 0


def _trajectory(g: _Groups, result: Result) -> None:
    """SVI: ``loss`` per step and each recorded parameter per step (``stats["params"]``), draw = step."""
    stats = result.stats or {}
    losses = _np(stats["losses"]).astype(np.float64).reshape(-1)
    g.add("sample_stats", {"loss": (("chain", "draw"), losses[None])})
    for name, v in (stats.get("params") or {}).items():
        a = _np(v).astype(np.float64)
        if a.ndim == 0 or a.shape[0] != losses.size:
            continue
        key = _safe_name(name)
        if key in ("loss",):
            key = f"param_{key}"
        g.add("sample_stats", {key: (("chain", "draw") + tuple(f"{key}_dim_{i}" for i in range(a.ndim - 1)),
                                     a[None])})
    g.attrs.update(objective=str(stats.get("objective", "")), num_steps=int(losses.size),
                   final_loss=float(losses[-1]) if losses.size else math.nan,
                   sample_stats_draw="optimisation step (SVI): not aligned with posterior draws")


def _log_likelihood(g: _Groups, result: Result, log_likelihood, draws: np.ndarray | None, layout: str) -> None:
    stats = result.stats or {}
    ll = dict(log_likelihood) if log_likelihood is not None else None
    if ll is None and stats.get("log_likelihood") is not None:
        v = stats["log_likelihood"]
        ll = dict(v) if isinstance(v, Mapping) else {"x": v}
    for name, v in (ll or {}).items():
        a = _np(v).astype(np.float64)
        if layout == "chains":
            if a.ndim < 2:
                raise DiagnosticError(f"log_likelihood {name!r} of an MCMC result needs [chains, draws, ...]")
        else:
            a = a[draws][None] if draws is not None else a[None]
        g.add("log_likelihood", {name: (("chain", "draw") + tuple(f"{name}_dim_{i}" for i in range(a.ndim - 2)), a)})


def _select_group(result: Result, group) -> Result:
    """Group ``group`` of a grouped SMC result (``SMC(n, groups=G)``) as a plain one-group result."""
    G, n = result.log_weights.shape[-2:] if result.log_weights.ndim == 2 else (1, result.log_weights.shape[-1])
    if group is None:
        raise DiagnosticError(f"this result holds {G} independent weighted samples (SMC(..., groups={G})): each "
                              "is the posterior of its own observation; convert one with group=g (0 <= g < "
                              f"{G})")
    try:
        gi = operator.index(group)
    except TypeError:
        gi = -1
    if isinstance(group, bool) or not 0 <= gi < G:
        raise DiagnosticError(f"group must be an int in [0, {G}), got {group!r}")
    rows = slice(gi * n, (gi + 1) * n)
    stats = dict(result.stats or {})
    for key in ("ess", "resampled"):
        if isinstance(stats.get(key), list):
            stats[key] = [e[gi] if isinstance(e, list | tuple) else e for e in stats[key]]
    anc = None
    if result.ancestry is not None and torch.as_tensor(result.ancestry).numel():
        anc = torch.as_tensor(result.ancestry)[:, rows] - gi * n
    lm = result.log_marginal
    se = result.log_marginal_stderr
    return Result(samples={k: v[rows] for k, v in result.samples.items()}, log_weights=result.log_weights[gi],
                  log_marginal=None if lm is None else torch.as_tensor(lm).reshape(-1)[gi],
                  log_marginal_stderr=None if se is None or torch.as_tensor(se).numel() < G
                  else torch.as_tensor(se).reshape(-1)[gi],
                  ancestry=anc, stats=stats, observed=result.observed, engine=f"{result.engine} (group {gi})")


def _decoded(g: _Groups, decoded, vocab) -> None:
    """Decoded continuations: latent ``z`` in ``posterior``, new observable ``tokens`` in ``predictions``."""
    stats = decoded.stats or {}
    tokens, z = decoded.tokens, decoded.z
    if "candidates" in stats:  # best-of-K: every candidate is a draw of (3.14) + (3.12); the argmax is marked
        tokens = stats.get("candidate_tokens", stats["candidates"])
        z = stats.get("candidate_z", None)
        g.add("sample_stats", {"score": (("chain", "draw"), _np(stats["scores"]).astype(np.float64)[None])})
        g.attrs["best"] = int(torch.as_tensor(stats["scores"]).argmax())
    t = _np(tokens)
    t = np.where(t < 0, PAD_ID, t)  # a program's outputs after it finished (-1) read as <pad>
    g.add("predictions", _site_vars("tokens", t[None]))
    g.add("predictions_text", _text_vars("tokens", t[None], vocab))
    if z is not None:
        a = _np(z)
        g.add("posterior", _site_vars("z", a[None]))
        g.add("posterior_text", _text_vars("z", a[None], vocab))
    probs = stats.get("next_token_probs")
    if probs:  # one vector per generated token, samples one after the other (each stops after <eos>)
        sigma = _np(stats["sigma"]).reshape(-1)
        steps = (t != PAD_ID).sum(-1)
        P = np.full((t.shape[0], t.shape[1], sigma.size), np.nan)
        flat = np.stack([_np(p).astype(np.float64) for p in probs])
        i = 0
        for s, k in enumerate(steps.tolist()):  # a loop over samples (a handful), not over particles
            P[s, :k] = flat[i:i + k]
            i += k
        g.add("sample_stats", {"next_token_probs": (("chain", "draw", "tokens_pos", "token"), P[None])})
        g.coords["sample_stats"] = {"token": sigma}
    g.attrs.update(engine=f"decode ({decoded.method})" if getattr(decoded, "method", "") else "decode",
                   num_samples=int(t.shape[0]))
    prompt = getattr(decoded, "prompt", None)
    if isinstance(prompt, str) and vocab is not None:  # the prompt as the program was given it: text
        prompt = torch.as_tensor(vocab.encode(prompt), dtype=torch.long)
    if prompt is not None:
        g.add("observed_data", _observed_vars({"x": prompt}, vocab))


# ---------------------------------------------------------------------------------------------- the conversion
@checked
def to_inference_data(result: Any, vocab: Vocab | None = None, log_likelihood: Mapping[str, Any] | None = None,
                      num_draws: int | None = None, seed: int = 0, group: int | None = None):
    """Convert an engine result to ``arviz.InferenceData`` (module docstring; docs/diagnostics.md has the table).

    With ArviZ 1.x installed the answer is the ``xarray.DataTree`` with the same groups, variables and attrs
    (:func:`ppl_thought.arviz_compat.make_inference_data`).

    Args:
        result: a :class:`~ppl_thought.inference.result.Result` of any engine (Importance, SMC, Langevin, SVI,
            RejectionSampling, TokenwiseRejection) or a :class:`~ppl_thought.inference.decoding.Decoded`.
        vocab: a :class:`~ppl_thought.Vocab`; sequence sites and observed token arrays are also decoded to text.
        log_likelihood: optional ``{name: values}`` with particles (or chains x draws) leading, stored in
            ``log_likelihood`` aligned with the posterior's draws (overrides ``result.stats["log_likelihood"]``).
        num_draws: weighted results: the size m of the equal-weight ``posterior``. Default ``None``: the largest
            m with m max(1, log10 m) <= the importance ESS (:func:`bounded_num_draws`), so that no ``az.ess`` of
            the posterior exceeds the importance ESS. A larger m (e.g. the number of particles) gives a
            posterior mean closer to the weighted mean, but ArviZ then counts copies of one particle as
            separate draws and its ESS and MCSE overstate the precision.
        seed: the seed of the systematic resampling.
        group: grouped SMC results (``SMC(n, groups=G)``): the group to convert.

    Weighted results (IS (3.2), SMC): the posterior draws are a systematic resample of the particles by their
    weights (by the PSIS-smoothed weights when the Pareto k-hat is >= 0.5, where the raw weights have
    infinite variance), copies of one particle adjacent; ``posterior.particle`` (a coordinate of ``draw``) is
    the particle each draw copies. ``-inf`` log weights stay ``-inf``; a result whose weights are all zero has
    an empty posterior.
    """

    g = _Groups()
    if isinstance(result, Decoded):
        _decoded(g, result, vocab)
        return g.build()
    if isinstance(result, Iterator):
        raise UnsupportedResultError("decode(..., method='streaming') returns an iterator of token ids, not a "
                                     "result: collect it, or decode with method='direct' / 'resampling' and "
                                     "convert the Decoded it returns")
    if not isinstance(result, Result):
        raise UnsupportedResultError(f"to_inference_data expects an engine Result (or a Decoded from decode), "
                                     f"got {type(result).__name__}")
    m = _check_num_draws(num_draws)
    _check_finite_result(result)
    if result.log_weights is not None and torch.as_tensor(result.log_weights).ndim > 1:
        result = _select_group(result, group)
    g.attrs["engine"] = result.engine or ""
    stats = result.stats or {}
    draws = None
    if "losses" in stats and result.engine == "SVI":
        _trajectory(g, result)
        if result.log_weights is not None and result.samples:
            draws = _weighted(g, result, vocab, m, seed, per_draw_stats=False)
        layout = "weighted"
    elif result.log_weights is not None:
        draws = _weighted(g, result, vocab, m, seed)
        layout = "weighted"
    elif result.engine.lower() in MCMC_ENGINES or "accept_prob" in stats:
        _chains(g, result, vocab)
        layout = "chains"
    else:
        _draws(g, result, vocab)
        layout = "draws"
    if layout != "weighted" or draws is not None:
        _log_likelihood(g, result, log_likelihood, draws, layout)
    g.add("observed_data", _observed_vars(result.observed or {}, vocab))
    return g.build()


def _check_finite_result(result: Result) -> None:
    """NaN in, an error out: log weights with NaN or +inf, a NaN log Z-hat (DiagnosticError)."""
    if result.log_weights is not None:
        check_log_weights(torch.as_tensor(result.log_weights).detach(), "to_inference_data")
    for name in ("log_marginal",):
        v = getattr(result, name)
        if v is not None and bool(torch.isnan(torch.as_tensor(v, dtype=torch.float64)).any()):
            raise DiagnosticError(f"to_inference_data: the result's {name} is NaN: nothing trustworthy to convert "
                                  "(a model or guide log-probability was NaN)")


@checked
def load_inference_data(path: str | Path) -> Any:
    """``arviz.from_netcdf(path)`` (the inverse of ``to_inference_data(...).to_netcdf(path)``); a path that is not
    one, or names no file, is a :class:`DiagnosticError` (never ArviZ's or h5py's own error)."""
    p = checks.path("path", path)
    if not p.is_file():
        raise DiagnosticError(f"load_inference_data: no file at {str(p)!r} (path must name a netcdf file written by "
                              "to_inference_data(...).to_netcdf)")
    return _check_schema(p, load_netcdf(str(p)))


#: the attributes every group ``to_inference_data`` writes carries: who wrote it, and the format's version
_OURS = {"inference_library": "ppl_thought",
         schemas.INFERENCE_DATA_VERSION_KEY: schemas.INFERENCE_DATA.version}


def _check_schema(path: Path, idata: Any) -> Any:
    """A netcdf written by ``to_inference_data`` (its groups say ``inference_library="ppl_thought"``) checked
    against :data:`ppl_thought.schemas.INFERENCE_DATA`: the format version (files without it predate it: version
    1), only the groups it writes, the variables they must hold (``particles.log_weight`` over chain x draw, a
    float). A :class:`~ppl_thought.errors.SchemaError` names the file, the group and the key. Inference data of
    other libraries is returned as read."""
    names = group_names(idata)
    ours = [n for n in names if group_dataset(idata, n).attrs.get("inference_library") == "ppl_thought"]
    if not ours:
        return idata
    unknown = sorted(set(names) - schemas.INFERENCE_DATA_GROUPS)
    if unknown:
        raise SchemaError(f"{path}: groups {unknown[:5]} are not groups to_inference_data writes (expected among "
                          f"{sorted(schemas.INFERENCE_DATA_GROUPS)})")
    key = schemas.INFERENCE_DATA_VERSION_KEY
    for name in ours:
        attrs = group_dataset(idata, name).attrs
        schemas.check(schemas.INFERENCE_DATA, {key: attrs[key]} if key in attrs else {}, f"{path} (group {name})")
    for name, variables in schemas.INFERENCE_DATA_VARIABLES.items():
        if name not in names:
            continue
        ds = group_dataset(idata, name)
        for var, dims in variables.items():
            if var not in ds.data_vars:
                raise SchemaError(f"{path}: group {name} lacks the variable {var!r} (to_inference_data writes it)")
            v = ds[var]
            if tuple(v.dims[:len(dims)]) != dims or v.dtype.kind != "f":
                raise SchemaError(f"{path}: {name}.{var} is {v.dtype} over {tuple(v.dims)}, expected floats over "
                                  f"{dims}")
    return idata


__all__ = ["MCMC_ENGINES", "PSIS_THRESHOLD", "bounded_num_draws", "import_arviz", "load_inference_data",
           "psis_khat", "to_inference_data"]
