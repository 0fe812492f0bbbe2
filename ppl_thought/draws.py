"""Torch-free helpers for turning weighted particles into equal-weight draws, shared by both backends'
ArviZ converters (ppl_thought/diagnostics/inference_data.py, ppl_thought/numpyro/inference_data.py)."""

from __future__ import annotations

import math

from ppl_thought.errors import ConfigError
from ppl_thought.validation import checked


@checked
def bounded_num_draws(ess: float) -> int:
    """The default size m of the equal-weight posterior of a weighted result: the largest m >= 1 with
    m * max(1, log10 m) <= ``ess``.

    ArviZ's ESS estimators (bulk, tail, mean, sd, quantile, local; Vehtari, Gelman, Simpson, Carpenter &
    Buerkner 2021) bound the integrated autocorrelation time below by 1 / log10 N for N draws, so every
    ``az.ess`` of N draws is at most N log10 N (and N for a constant variable). With N = m, no ESS that
    ArviZ reports for the posterior can exceed the importance ESS of the weights: the resample carries no
    more information than the weighted particles it copies. ``0`` when ``ess`` < 1 (no finite weight).
    """
    ess = float(ess)
    if not ess >= 1.0:
        return 0
    if math.isinf(ess):  # (NaN is refused by the type layer)
        raise ConfigError("bounded_num_draws: ess = inf; an effective sample size is at most the number of particles")

    def size(m: int) -> float:
        return m * max(1.0, math.log10(m))

    m = max(1, int(ess / max(1.0, math.log10(ess))))
    while size(m + 1) <= ess:
        m += 1
    while m > 1 and size(m) > ess:
        m -= 1
    return m
