"""The one place ArviZ is imported (on first use), with its version checked.

ppl_thought supports ArviZ 0.x (``arviz>=0.18,<1`` in pyproject.toml): ``arviz.InferenceData`` made of
xarray Datasets, ``az.psislw``, ``az.summary`` / ``az.ess`` with the antithetic cap of Vehtari et al.
(2021) that :func:`ppl_thought.diagnostics.to_inference_data` relies on. ArviZ 1.x (arviz-base /
arviz-stats / arviz-plots, Python >= 3.12) replaces ``InferenceData`` with ``xarray.DataTree``, has no
``InferenceData(**groups)`` constructor and moves PSIS and ESS to arviz-stats; the conversion is not
written for it, so a 1.x found at run time (installed against the bound) raises :class:`DependencyError`
naming the fix instead of failing somewhere inside the conversion.
"""

from __future__ import annotations

import warnings
from types import ModuleType

from ppl_thought.errors import DependencyError

SUPPORTED_ARVIZ = ">=0.18,<1"


def check_arviz_version(version: str) -> None:
    """Raise :class:`DependencyError` unless ``version`` is an ArviZ 0.x release (the supported range)."""
    head = str(version).split(".")[0]
    if not head.isdigit() or int(head) >= 1:
        raise DependencyError(
            f"ArviZ {version} is installed; ppl_thought needs arviz{SUPPORTED_ARVIZ} (ArviZ 1.x builds on "
            "xarray.DataTree and arviz-stats, which the conversion does not support yet). Install "
            f"'arviz{SUPPORTED_ARVIZ}' (0.x releases install on Python >= 3.10)")


def import_arviz() -> ModuleType:
    """``import arviz`` with its FutureWarning about the 1.0 refactor silenced; version checked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*arviz.*")
        import arviz

    check_arviz_version(getattr(arviz, "__version__", "unknown"))
    return arviz


__all__ = ["SUPPORTED_ARVIZ", "check_arviz_version", "import_arviz"]
