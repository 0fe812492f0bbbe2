"""Argument checks shared by the public entry points: a bad value gets a :class:`~ppl_thought.errors.ConfigError`
that names the argument (never a silent ``int(2.7) == 2``, ``int("4")`` or ``bool`` taken for a number)."""

from __future__ import annotations

import math
import numbers

import numpy as np

from ppl_thought.errors import ConfigError


def integer(name: str, value, minimum: int = 1) -> int:
    """``value`` as a Python int ``>= minimum``: a Python or numpy integer, not a bool, a float or a string."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def fraction(name: str, value) -> float:
    """``value`` as a float in [0, 1]: a real number (not a bool, a string or NaN)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real) or math.isnan(value) \
            or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)
