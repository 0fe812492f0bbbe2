"""``ppl-thought diagnose FILE``: a short report and plots for any result file the library writes.

FILE is a netcdf written by ``to_inference_data(result).to_netcdf(FILE)`` (any result type: Importance, SMC,
Langevin, SVI, rejection samplers, decoding), one of the demo's ``.nc`` files, or a directory written by
:func:`ppl_thought.inference.save_result`. Anything else gets a :class:`~ppl_thought.errors.DiagnosticError` that
says what the file is and what diagnose reads; an ArviZ netcdf written by another library is reported
generically, with a note.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

from ppl_thought.arviz_compat import group_dataset, group_names, is_arviz_1
from ppl_thought.checkpoint import read_header
from ppl_thought.diagnostics.inference_data import import_arviz, load_inference_data, to_inference_data
from ppl_thought.diagnostics.plots import plot_ess, plot_trace, plot_weights
from ppl_thought.errors import CheckpointError, DiagnosticError, MissingCheckpointError, PPLThoughtError
from ppl_thought.inference.result import RESULT_FORMAT, load_result, saved_vocab
from ppl_thought.io import CONFIG_FILE
from ppl_thought.validation import checked

#: at most this many rows of az.summary and variables in the posterior plot (a short report)
MAX_ROWS = 12
MAX_PLOTTED = 4
#: variables with more values per draw than this (e.g. a padded token sequence) are left out of the summary
MAX_VALUES_PER_DRAW = 8
READS = ("diagnose reads a netcdf from to_inference_data(...).to_netcdf, the demo's .nc files, or a directory "
         "written by ppl_thought.inference.save_result")


def _load(path: Path):
    """(InferenceData, note): the note is set for an ArviZ file that another library wrote."""

    if path.is_dir():
        if (path / CONFIG_FILE).exists():
            header = read_header(path)  # a damaged folder: CheckpointError naming the damage
            if isinstance(header["config"], dict) and header["config"].get("kind") == RESULT_FORMAT:
                result = load_result(path)
                vocab = saved_vocab(path)  # token sites decoded to text when the result was saved with its vocabulary
                try:
                    return to_inference_data(result, vocab=vocab), None
                except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as e:
                    if isinstance(e, PPLThoughtError):
                        raise
                    raise CheckpointError(f"{path}: the saved Result is inconsistent (its arrays do not fit "
                                          f"together): {type(e).__name__}: {e}"[:300]) from None
            raise DiagnosticError(f"{path} is a ppl_thought checkpoint (model weights, save_checkpoint), not a "
                                  f"result: nothing to diagnose. {READS}")
        raise DiagnosticError(f"{path} is a directory but not a result saved by ppl_thought.inference.save_result. "
                              f"{READS}")
    if not path.is_file():
        raise MissingCheckpointError(f"no such file or folder: {path} (diagnose reads a result saved by "
                                     f"save_result or an ArviZ .nc file)")
    try:
        idata = load_inference_data(path)
    except Exception as e:  # noqa: BLE001 - re-raised with what the file is and what was expected
        raise DiagnosticError(f"{path} is not an ArviZ netcdf file, so not a result file of ppl_thought"
                              f"{_what(path)}. {READS} ({type(e).__name__}: {str(e)[:120]})") from e
    if not group_names(idata):
        raise DiagnosticError(f"{path} is a netcdf file without ArviZ groups, not a result file of ppl_thought. "
                              f"{READS}")
    ours = any(idata[g].attrs.get("inference_library") == "ppl_thought" for g in group_names(idata))
    note = None if ours else ("not written by ppl_thought (no inference_library='ppl_thought' attribute): a "
                              "generic ArviZ report")
    return idata, note


def _what(path: Path) -> str:
    """What a non-netcdf file looks like (for the message)."""
    head = path.read_bytes()[:8] if path.stat().st_size else b""
    if head.startswith(b"\x89PNG"):
        return " (it is a PNG image: a plot)"
    if path.suffix == ".json" or head[:1] in (b"{", b"["):
        try:
            json.loads(path.read_text(encoding="utf-8"))
            return " (it is a JSON file, e.g. the demo's numbers; the .nc files next to it are the results)"
        except (ValueError, UnicodeDecodeError):
            pass
    if not head:
        return " (it is empty)"
    return ""


def _fmt(v) -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f"{f:.6g}" if math.isfinite(f) or math.isinf(f) else "nan"


def _numeric_vars(ds) -> list[str]:
    """Numeric variables with chain/draw dims and at most MAX_VALUES_PER_DRAW values per draw."""
    out = []
    for name, v in ds.data_vars.items():
        if not (np.issubdtype(v.dtype, np.number) and {"chain", "draw"} <= set(v.dims)):
            continue
        if any(str(d).endswith("_pos") for d in v.dims):
            continue  # a padded token sequence: its values are token ids (its length, <site>_length, is shown)
        per_draw = int(np.prod([v.sizes[d] for d in v.dims if d not in ("chain", "draw")], dtype=np.int64))
        if per_draw <= MAX_VALUES_PER_DRAW and v.sizes["draw"] > 0:
            out.append(name)
    return out


def summary_table(idata, group: str, names: list[str]):
    """``az.summary`` of ``names`` in ``group``, with only the diagnostics the group's shape supports.

    R-hat compares chains and needs at least 2 of 4 draws, the ESS and MCSE estimators at least 4 draws
    (Vehtari et al. 2021). A weighted result's posterior (one chain: the equal-weight resample) and its
    particles are one chain, so ``kind="all"`` made ArviZ log "Shape validation failed" for R-hat on every
    summary and put NaN in the column: here R-hat is asked for only with >= 2 chains, and ESS / MCSE only
    with >= 4 draws (the table then has no such column instead of a NaN one)."""
    az = import_arviz()
    ds = group_dataset(idata, group)
    chains, draws = int(ds.sizes.get("chain", 1)), int(ds.sizes.get("draw", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if chains >= 2 and draws >= 4:
            return az.summary(idata, var_names=names, group=group, kind="all")
        table = az.summary(idata, var_names=names, group=group, kind="stats")
        if draws >= 4:
            sub = ds[names]
            for col, fn in (("mcse_mean", lambda: az.mcse(sub, method="mean")),
                            ("ess_bulk", lambda: az.ess(sub, method="bulk")),
                            ("ess_tail", lambda: az.ess(sub, method="tail"))):
                values = fn()
                table[col] = np.concatenate([np.asarray(values[n]).reshape(-1) for n in names])
    return table


def _summary_lines(idata, group: str, names: list[str]) -> list[str]:

    table = summary_table(idata, group, names)
    lines = ["  " + row for row in table.head(MAX_ROWS).to_string().splitlines()]
    if len(table) > MAX_ROWS:
        lines.append(f"  ... {len(table) - MAX_ROWS} more rows: az.summary(idata, group={group!r})")
    return lines


def _texts(ds, title: str) -> list[str]:
    """The most frequent decoded texts of each text variable (at most two variables, three texts each)."""
    lines = []
    for name in list(ds.data_vars)[:2]:
        vals = np.asarray(ds[name]).reshape(-1).astype(str)
        if not vals.size:
            continue
        lines.append(f"  {title} {name}: " + "; ".join(f"{str(t)!r} {c / vals.size:.2f}"
                                                      for t, c in Counter(vals).most_common(3)))
    return lines


@checked
def diagnose(path: str | Path, out: str | Path | None = None) -> tuple[str, list[Path]]:
    """Summarise a saved result and write its plots (next to it, or into ``out``).

    Returns the report and the written PNG paths: ``<name>.weights.png`` (sorted weights and the PSIS k-hat)
    for weighted results, ``<name>.ess.png`` (ESS over the SMC steps), ``<name>.posterior.png``
    (``az.plot_posterior``; ``az.plot_trace`` for chains: ``<name>.trace.png``), ``<name>.accept_prob.png``
    (MCMC), ``<name>.loss.png`` (SVI), ``<name>.values.png`` (files without a posterior).
    Raises :class:`~ppl_thought.errors.MissingCheckpointError` (no such file or folder; a ``FileNotFoundError``
    too), :class:`DiagnosticError` (a file that is not one of ours, ``out`` naming
    a file) or :class:`~ppl_thought.errors.CheckpointError` (a damaged saved-result folder, naming the damage).
    """

    path = Path(path)
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise DiagnosticError(f"out={str(out)!r} is a file, not a folder for the plots: name a folder (it is "
                              "created if missing)")
    idata, note = _load(path)
    out_dir = Path(out) if out is not None else (path if path.is_dir() else path.parent)
    stem = path.name if path.is_dir() else path.stem
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DiagnosticError(f"cannot make the folder for the plots {str(out_dir)!r}: {e.strerror or e}") from None
    groups = group_names(idata)
    attrs: dict = {}
    for g in ("posterior", "particles", "sample_stats", "predictions"):
        if g in groups:
            attrs = {**dict(idata[g].attrs), **attrs}
    lines = [f"{path}: engine {attrs.get('engine', '?')}; groups {', '.join(groups)}"]
    if note:
        lines.append(f"  note: {note}")
    files: list[Path] = []
    if not any(g in groups for g in ("posterior", "sample_stats", "predictions")):
        return _describe_groups(idata, path, out_dir, stem, lines)
    post = group_dataset(idata, "posterior") if "posterior" in groups else None
    if post is not None:
        desc = f"  posterior: {post.sizes.get('chain', 0)} chain(s) x {post.sizes.get('draw', 0)} draw(s)"
        if "num_particles" in attrs:
            desc += (f", an equal-weight resample of {attrs['num_particles']} weighted particles "
                     f"({attrs.get('posterior_weights', 'raw')} weights)")
        lines.append(desc)
    for key in ("log_marginal", "log_marginal_stderr", "ess", "ess_fraction", "khat", "num_draws", "mean_accept_prob",
                "objective", "num_steps", "final_loss", "acceptance_rate", "num_samples", "message"):
        if key in attrs:
            lines.append(f"  {key:22s} {_fmt(attrs[key])}")
    weights = group_dataset(idata, "particles") if "particles" in groups else None
    if weights is None and "sample_stats" in groups and "log_weight" in group_dataset(idata, "sample_stats"):
        weights = group_dataset(idata, "sample_stats")  # older files kept the weights in sample_stats
    if weights is not None and "log_weight" in weights:
        lw = np.asarray(weights["log_weight"]).reshape(-1)
        f = out_dir / f"{stem}.weights.png"
        plot_weights(lw, f, khat=attrs.get("khat"))
        files.append(f)
        if "ess_per_step" in attrs:
            ess = np.atleast_1d(np.asarray(attrs["ess_per_step"], dtype=float))
            lines.append("  ESS per step           " + " ".join(f"{e:.1f}" for e in ess.reshape(-1)))
            f = out_dir / f"{stem}.ess.png"
            plot_ess(ess.reshape(-1), int(lw.size), f,
                     resampled=np.atleast_1d(attrs.get("resampled", [])).astype(bool).reshape(-1))
            files.append(f)
    ss = group_dataset(idata, "sample_stats") if "sample_stats" in groups else None
    if ss is not None and "loss" in ss:  # SVI: the trajectory (draw = step)
        loss = np.asarray(ss["loss"], dtype=float).reshape(-1)
        if loss.size:
            lines.append(f"  loss                   {_fmt(loss[0])} (step 1) -> {_fmt(loss[-1])} (step {loss.size})")
        params = [v for v in ss.data_vars if v != "loss"]
        for v in params[:6]:
            last = np.asarray(ss[v])[0, -1] if ss[v].sizes["draw"] else np.nan
            lines.append(f"  {v:22s} {np.array2string(np.asarray(last), precision=4, threshold=6)} (final)")
        f = out_dir / f"{stem}.loss.png"
        plot_trace(loss[None], f, name="loss")
        files.append(f)
    if ss is not None and "accept_prob" in ss:
        f = out_dir / f"{stem}.accept_prob.png"
        plot_trace(np.asarray(ss["accept_prob"]), f)
        files.append(f)
    if post is not None:
        names = _numeric_vars(post)
        skipped = [v for v in post.data_vars if v not in names]
        if names:
            lines += _summary_lines(idata, "posterior", names)
        if skipped:
            lines.append(f"  (not in the table: {', '.join(skipped[:6])}{' ...' if len(skipped) > 6 else ''}: "
                         "token sequences or more than 8 values per draw; az.summary(idata) shows them)")
        if "posterior_text" in groups:
            lines += _texts(group_dataset(idata, "posterior_text"), "most frequent")
        if names:
            files.append(_posterior_plot(idata, names[:MAX_PLOTTED], out_dir, stem,
                                         trace=post.sizes.get("chain", 1) > 1))
        pooled = {f"posterior/{v}": post[v] for v in skipped if _per_unit(post[v])}
        if pooled:  # values per held-out example, problem, seed: pooled over them, one labelled panel each
            lines += [_pooled_line(k, v) for k, v in pooled.items()]
            f = out_dir / f"{stem}.values.png"
            _panels({k: np.asarray(v, dtype=float).reshape(-1) for k, v in pooled.items()},
                    f"{path.name}: {attrs.get('engine', 'engine not recorded')}", f)
            files.append(f)
    if "predictions" in groups:
        pred = group_dataset(idata, "predictions")
        if "tokens_length" in pred:
            lines.append(f"  predictions: {pred.sizes.get('draw', 0)} continuations, mean length "
                         f"{_fmt(float(np.asarray(pred['tokens_length']).mean()))} tokens")
        if "predictions_text" in groups:
            lines += _texts(group_dataset(idata, "predictions_text"), "most frequent")
        if ss is not None and "score" in ss and "best" in attrs:
            lines.append(f"  best of {ss.sizes.get('draw', 0)}: candidate {attrs['best']} (score "
                         f"{_fmt(np.asarray(ss['score']).reshape(-1)[int(attrs['best'])])})")
    lines += [f"  wrote {f}" for f in files]
    return "\n".join(lines), files


def _posterior_plot(idata, names: list[str], out_dir: Path, stem: str, trace: bool) -> Path:
    """``az.plot_trace`` (several chains) or ``az.plot_posterior`` of the summarised variables, Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    az = import_arviz()
    f = out_dir / f"{stem}.{'trace' if trace else 'posterior'}.png"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if is_arviz_1():  # arviz-plots: a PlotCollection; plot_dist is 0.x's plot_posterior
                pc = (az.plot_trace if trace else az.plot_dist)(idata, var_names=names, backend="matplotlib")
                pc.savefig(f, dpi=90)
            else:
                axes = az.plot_trace(idata, var_names=names) if trace else az.plot_posterior(idata, var_names=names)
                fig = np.asarray(axes).reshape(-1)[0].figure
                fig.savefig(f, dpi=90)
        finally:
            plt.close("all")
    return f


def _describe_groups(idata, path: Path, out_dir: Path, stem: str, lines: list[str]) -> tuple[str, list[Path]]:
    """A file without a posterior (e.g. the demo's ``a5_excess.nc``: per-sequence values in ``observed_data``,
    or ``sec7_*_particles.nc``: weighted particles per example): mean +- standard error and range of every
    numeric variable (token sequences left out), and one labelled panel per variable."""
    lines.append("  no posterior group: each numeric variable's values")
    series = {}
    for g in group_names(idata):
        ds = group_dataset(idata, g)
        for name in ds.data_vars:
            if not np.issubdtype(ds[name].dtype, np.number):
                continue
            if np.issubdtype(ds[name].dtype, np.integer) and ds[name].ndim > 2:
                continue  # token sequences: values are ids, their mean means nothing
            v = np.asarray(ds[name], dtype=float).reshape(-1)
            if v.size == 0:
                continue
            finite = v[np.isfinite(v)]
            se = finite.std(ddof=1) / math.sqrt(finite.size) if finite.size > 1 else float("nan")
            lines.append(f"  {g}/{name:20s} n {v.size:5d}  mean {_fmt(finite.mean() if finite.size else np.nan)}"
                         f" +- {_fmt(se)}  range [{_fmt(finite.min() if finite.size else np.nan)}, "
                         f"{_fmt(finite.max() if finite.size else np.nan)}]")
            series[f"{g}/{name}"] = finite
    files: list[Path] = []
    if series:
        f = out_dir / f"{stem}.values.png"
        _panels(series, path.name, f)
        files.append(f)
    lines += [f"  wrote {f}" for f in files]
    return "\n".join(lines), files


def _per_unit(v) -> bool:
    """A numeric chain/draw variable with more values per draw than the table shows and no token positions:
    one value per held-out example, problem or seed (the demo's files), pooled over them."""
    return (np.issubdtype(v.dtype, np.number) and {"chain", "draw"} <= set(v.dims)
            and not any(str(d).endswith("_pos") for d in v.dims))


def _pooled_line(key: str, v) -> str:
    x = np.asarray(v, dtype=float).reshape(-1)
    x = x[np.isfinite(x)]
    over = ", ".join(f"{d} ({v.sizes[d]})" for d in v.dims if d not in ("chain", "draw"))
    mean = _fmt(x.mean()) if x.size else "n.d."
    return f"  {key:30s} mean {mean} over {x.size} values (draws pooled over {over})"


def _panels(series: dict[str, np.ndarray], title: str, f: Path) -> None:
    """One labelled panel per variable: the histogram of its values (x: the variable, y: how many values)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(series)
    fig, axes = plt.subplots(1, k, figsize=(3.4 * k, 3.0), squeeze=False)
    for ax, (name, v) in zip(axes[0], series.items()):
        v = np.asarray(v, dtype=float)
        v = v[np.isfinite(v)]
        ax.hist(v, bins=min(30, max(2, len(np.unique(v)))), color="C0")
        ax.set_xlabel(name.split("/")[-1])
        ax.set_ylabel("number of values")
        ax.set_title(f"{name}\nmean {v.mean():.3g}, n = {v.size}" if v.size else name, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(f, dpi=100)
    plt.close(fig)


__all__ = ["diagnose"]
