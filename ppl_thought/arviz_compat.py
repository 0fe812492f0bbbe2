"""The one place ArviZ is imported (on first use): ArviZ 0.x and 1.x behind one small interface.

ppl_thought supports both ArviZ lines (docs/diagnostics.md, "ArviZ versions"):

- ArviZ 0.x (``arviz>=0.18,<1``, every Python this project supports): ``arviz.InferenceData`` made of xarray
  Datasets, ``az.psislw``;
- ArviZ 1.x (arviz-base / arviz-stats / arviz-plots, Python >= 3.12): ``xarray.DataTree`` with one child per
  group, PSIS in arviz-stats (whose array-level ``psislw`` takes the *negated* log ratios and refuses tails of
  fewer than 5 draws, where 0.x returns k = inf and the normalised, unsmoothed weights).

:func:`make_inference_data` builds what the installed ArviZ calls inference data from the same groups (same
variables, coordinates and attrs, hence the same numbers), :func:`psislw` gives 0.x's PSIS numbers on both, and
:func:`group_names` / :func:`group_dataset` read either kind back. ``az.summary`` / ``az.ess`` / ``az.mcse``
take both objects. Other majors raise :class:`DependencyError` naming the supported range.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from ppl_thought.errors import DependencyError

SUPPORTED_ARVIZ = ">=0.18,<2"


def arviz_major(version: str) -> int:
    """The major version of an ArviZ version string; :class:`DependencyError` outside ``SUPPORTED_ARVIZ``."""
    head = str(version).split(".")[0]
    if not head.isdigit() or int(head) >= 2:
        raise DependencyError(
            f"ArviZ {version} is installed; ppl_thought needs arviz{SUPPORTED_ARVIZ} (0.x: InferenceData; 1.x: "
            f"xarray.DataTree with arviz-stats). Install 'arviz{SUPPORTED_ARVIZ}'")
    return int(head)


def check_arviz_version(version: str) -> None:
    """Raise :class:`DependencyError` unless ``version`` is an ArviZ 0.x or 1.x release (the supported range)."""
    arviz_major(version)


def import_arviz() -> ModuleType:
    """``import arviz`` with its FutureWarning about the 1.0 refactor silenced; version checked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*arviz.*")
        import arviz

    check_arviz_version(getattr(arviz, "__version__", "unknown"))
    return arviz


def is_arviz_1() -> bool:
    """Whether the installed ArviZ is a 1.x release (inference data is then an ``xarray.DataTree``)."""
    return arviz_major(import_arviz().__version__) == 1


def psislw(log_weights: np.ndarray) -> tuple[np.ndarray, float]:
    """PSIS (Vehtari, Simpson, Gelman, Yao & Gabry 2024) of one 1-D array of finite log weights, as ArviZ 0.x's
    ``az.psislw`` gives it on both lines: ``(smoothed normalised log weights, k-hat)``; a tail too short for the
    Pareto fit gives k = inf and the normalised raw weights (0.x's answer; 1.x raises there). Where 1.x's fit
    declines (tied weights: the tail's first quartile equal to its minimum) k is NaN where 0.x fits a number."""
    x = np.asarray(log_weights, dtype=np.float64).reshape(-1).copy()
    az = import_arviz()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if arviz_major(az.__version__) == 0:
            smoothed, k = az.psislw(x)
            return np.asarray(smoothed, dtype=np.float64), float(k)
        from arviz_stats.base.array import array_stats

        try:
            smoothed, k = array_stats.psislw(-x)  # 1.x takes log ratios with the opposite sign
        except (ValueError, IndexError) as e:  # a tail of < 5 draws (IndexError: none at all, a handful of
            # weights), or a constant tail: no fit (0.x: k = inf, the normalised raw weights)
            if isinstance(e, ValueError) and "n_draws_tail" not in str(e) and "tail values are the same" not in str(e):
                raise
            m = x.max()
            return x - (m + math.log(np.exp(x - m).sum())), math.inf
    return np.asarray(smoothed, dtype=np.float64), float(k)


def make_inference_data(groups: Mapping[str, Any]) -> Any:
    """ArviZ inference data of ``{group name: xarray.Dataset}``: ``arviz.InferenceData`` on 0.x, an
    ``xarray.DataTree`` whose children are the groups on 1.x (same variables, coordinates and attrs)."""
    import xarray as xr

    az = import_arviz()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)  # our extra groups (particles, *_text)
        if arviz_major(az.__version__) == 0:
            return az.InferenceData(**dict(groups))
        # arviz-plots maps over the chain / draw coordinates: give them the indices 0.. where a group has none
        return xr.DataTree.from_dict({name: ds.assign_coords({d: np.arange(ds.sizes[d]) for d in ("chain", "draw")
                                                             if d in ds.dims and d not in ds.coords})
                                      for name, ds in groups.items()})


def from_dict(groups: Mapping[str, Mapping[str, Any]], attrs: Mapping[str, Any] | None = None) -> Any:
    """``{group: {variable: array [chain, draw, ...]}}`` as inference data (``az.from_dict`` of either line:
    keyword groups on 0.x, one nested dict on 1.x); ``attrs`` on every group."""
    az = import_arviz()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if arviz_major(az.__version__) == 0:
            return az.from_dict(**{k: dict(v) for k, v in groups.items()}, attrs=dict(attrs or {}))
        return az.from_dict({k: dict(v) for k, v in groups.items()}, attrs=dict(attrs or {}))


def group_names(idata: Any) -> list[str]:
    """The group names of inference data of either line (``idata.groups()`` on 0.x, the children on 1.x)."""
    groups = idata.groups
    if callable(groups):
        return list(groups())
    return [str(name) for name in idata.children]


def group_dataset(idata: Any, name: str) -> Any:
    """Group ``name`` as an ``xarray.Dataset`` (a DataTree child becomes its Dataset)."""
    node = idata[name]
    return node.to_dataset() if type(node).__name__ == "DataTree" else node


def load_netcdf(path: str) -> Any:
    """``az.from_netcdf`` of either line."""
    return import_arviz().from_netcdf(str(path))


__all__ = ["SUPPORTED_ARVIZ", "arviz_major", "check_arviz_version", "from_dict", "group_dataset", "group_names",
           "import_arviz", "is_arviz_1", "load_netcdf", "make_inference_data", "psislw"]
