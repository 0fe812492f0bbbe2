"""``ppl-thought diagnose FILE``: a summary table and plots for a saved result.

FILE is a netcdf written by ``to_inference_data(result).to_netcdf(FILE)`` or a directory written by
:func:`ppl_thought.io.save_result`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np


def _load(path: Path):
    from ppl_thought.diagnostics.inference_data import load_inference_data, to_inference_data
    from ppl_thought.io import is_saved_result, load_result

    if path.is_dir():
        if not is_saved_result(path):
            raise ValueError(f"{path} is a directory but not a Result saved by ppl_thought.io.save_result")
        return to_inference_data(load_result(path))
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        return load_inference_data(path)
    except Exception as e:  # noqa: BLE001 - re-raised with what was expected
        raise ValueError(f"{path} is not an ArviZ netcdf file (to_inference_data(...).to_netcdf): {e}") from e


def _fmt(v) -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f"{f:.6g}" if math.isfinite(f) or math.isinf(f) else "nan"


def diagnose(path: str | Path, out: str | Path | None = None) -> tuple[str, list[Path]]:
    """Summarise a saved result and write its plots (next to it, or into ``out``).

    Returns the summary text and the written PNG paths: ``weights.png`` (weights and Pareto k) for
    weighted results, ``ess.png`` (ESS over SMC steps) for SMC, ``accept_prob.png`` for MCMC.
    """
    from ppl_thought.diagnostics.inference_data import import_arviz
    from ppl_thought.diagnostics.plots import plot_ess, plot_trace, plot_weights

    path = Path(path)
    idata = _load(path)
    out_dir = Path(out) if out is not None else (path if path.is_dir() else path.parent)
    stem = path.name if path.is_dir() else path.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    if "posterior" not in idata.groups():
        return _describe_groups(idata, path, out_dir, stem)
    post = idata.posterior
    attrs = dict(post.attrs)
    lines = [f"{path}: engine {attrs.get('engine', '?')}, {post.sizes.get('chain', 0)} chain(s) x "
             f"{post.sizes.get('draw', 0)} draw(s); groups {', '.join(idata.groups())}"]
    for key in ("log_marginal", "log_marginal_stderr", "ess", "ess_fraction", "khat", "num_particles",
                "mean_accept_prob"):
        if key in attrs:
            lines.append(f"  {key:22s} {_fmt(attrs[key])}")
    files: list[Path] = []
    ss = getattr(idata, "sample_stats", None)
    weights = getattr(idata, "particles", None) if "particles" in idata.groups() else ss  # (older files: sample_stats)
    if weights is not None and "log_weight" in weights:
        lw = np.asarray(weights["log_weight"]).reshape(-1)
        f = out_dir / f"{stem}.weights.png"
        plot_weights(lw, f, khat=attrs.get("khat"))
        files.append(f)
        if "ess_per_step" in attrs:
            ess = np.atleast_1d(np.asarray(attrs["ess_per_step"], dtype=float))
            lines.append("  ESS per step           " + " ".join(f"{e:.1f}" for e in ess))
            f = out_dir / f"{stem}.ess.png"
            plot_ess(ess, int(lw.size), f, resampled=np.atleast_1d(attrs.get("resampled", [])).astype(bool))
            files.append(f)
    elif ss is not None and "accept_prob" in ss:
        f = out_dir / f"{stem}.accept_prob.png"
        plot_trace(np.asarray(ss["accept_prob"]), f)
        files.append(f)
        az = import_arviz()
        numeric = [v for v in post.data_vars if np.issubdtype(post[v].dtype, np.floating)]
        if numeric:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                table = az.summary(idata, var_names=numeric, kind="all")
            lines.append(table.to_string())
    lines += [f"  wrote {f}" for f in files]
    return "\n".join(lines), files


def _describe_groups(idata, path: Path, out_dir: Path, stem: str) -> tuple[str, list[Path]]:
    """A file without a posterior (e.g. the demo's ``a5_excess.nc``: per-sequence values in
    ``observed_data``): mean +- standard error and range of every numeric variable, and one box plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"{path}: no posterior group; groups {', '.join(idata.groups())}"]
    series = {}
    for g in idata.groups():
        ds = getattr(idata, g)
        for name in ds.data_vars:
            v = np.asarray(ds[name], dtype=float).reshape(-1) if np.issubdtype(ds[name].dtype, np.number) else None
            if v is None or v.size == 0:
                continue
            finite = v[np.isfinite(v)]
            se = finite.std(ddof=1) / math.sqrt(finite.size) if finite.size > 1 else float("nan")
            lines.append(f"  {g}/{name:20s} n {v.size:5d}  mean {_fmt(finite.mean() if finite.size else np.nan)}"
                         f" +- {_fmt(se)}  range [{_fmt(finite.min() if finite.size else np.nan)}, "
                         f"{_fmt(finite.max() if finite.size else np.nan)}]")
            series[f"{g}/{name}"] = finite
    files: list[Path] = []
    if series:
        fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(series), 3.2))
        ax.boxplot(list(series.values()))
        ax.set_xticks(range(1, len(series) + 1), [k.split("/")[-1] for k in series], rotation=20)
        ax.set_title(path.name)
        fig.tight_layout()
        f = out_dir / f"{stem}.values.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    lines += [f"  wrote {f}" for f in files]
    return "\n".join(lines), files


__all__ = ["diagnose"]
