"""The type layer of the JAX side (docs/architecture.md, "Validation at the boundary"; docs/numpyro.md).

Every public ``ptn`` callable carries :func:`checked_jax` at its definition (``validation.checked`` with
``skip_while=tracing``): it is checked against its hints when called from Python, and runs unchecked while JAX
traces (under ``jit`` / ``vmap`` / ``grad`` / ``lax.scan`` the arguments are tracers and a check would only run
at trace time; the compiled code never holds one). The per-step methods (``step``, ``init``, ``apply``, a token
rule's ``log_probs`` ...) carry ``validation.per_token`` and are never wrapped.

Hints used on the JAX side:

* :data:`Array`: a JAX or NumPy array (a tracer is a ``jax.Array``);
* :data:`ArrayLike`: what ``jnp.asarray`` reads: an array, a NumPy scalar, a Python number or a list / tuple
  (a string is not an array of ids);
* :data:`Key`: a PRNG key (``jax.random.PRNGKey(seed)`` or ``jax.random.key(seed)``);
* :class:`SupportsTokenRule`: a token rule (what :func:`~ppl_thought.numpyro.distributions.decode` steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.errors import ArgumentTypeError, NumericalError
from ppl_thought.validation import checked

try:  # the one probe of "is JAX tracing now" (jax.core no longer re-exports it)
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover -- a JAX without it: check always (tracers pass the Array hints)
    def _trace_state_clean() -> bool:
        return True

__all__ = ["Array", "ArrayLike", "Key", "SupportsTokenRule", "as_array", "as_numpy", "checked_jax", "refuse_nan",
           "tracing"]

Array = jax.Array | np.ndarray
ArrayLike = jax.Array | np.ndarray | np.generic | int | float | list | tuple
Key = jax.Array | np.ndarray


@runtime_checkable
class SupportsTokenRule(Protocol):
    """A token rule (docs/numpyro.md): ``start(n)``, ``log_probs(logp, s)``, ``step(s, tok)``, ``is_final(s)``
    (:class:`~ppl_thought.numpyro.distributions.TokenRule` and the guides' rules)."""

    def start(self, n: int) -> Any: ...

    def log_probs(self, logp: Any, s: Any) -> Any: ...

    def step(self, s: Any, tok: Any) -> Any: ...

    def is_final(self, s: Any) -> Any: ...


def tracing() -> bool:
    """True while JAX traces a function (``jit``, ``vmap``, ``grad``, ``lax.scan``, ``eval_shape``)."""
    return not _trace_state_clean()


def checked_jax(obj: Any) -> Any:
    """``@checked_jax``: the type layer on a ``ptn`` function or class (``validation.checked`` with
    ``skip_while=tracing``; see the module docstring)."""
    return checked(obj, skip_while=tracing)


def as_array(name: str, value: Any, dtype: Any = None, where: str = "") -> jax.Array:
    """``jnp.asarray(value, dtype)``, or an :class:`~ppl_thought.errors.ArgumentTypeError` naming ``name``, the
    value and what it expects when the value is not numbers (a ragged or mixed list, text, an object)."""
    if isinstance(value, jax.core.Tracer):
        return value if dtype is None else value.astype(dtype)
    try:
        return jnp.asarray(value, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as e:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ArgumentTypeError(f"{where + ': ' if where else ''}{name}={shown} is not an array of numbers "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:80]})") from None


def as_numpy(name: str, value: Any, where: str = "") -> np.ndarray:
    """``np.asarray(value)`` of a concrete value, or an :class:`~ppl_thought.errors.ArgumentTypeError` naming
    ``name`` when it is not an array of numbers (a traced value: it must be concrete here)."""
    if isinstance(value, jax.core.Tracer):
        raise ArgumentTypeError(f"{where + ': ' if where else ''}{name} must be concrete (known outside jit), got a "
                                "traced value: close over it instead of passing it through jit")
    try:
        a = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as e:
        a = None
        err = e
    if a is None or a.dtype == object or a.dtype.kind in "USV":
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        why = f" ({type(err).__name__}: {str(err).splitlines()[0][:80]})" if a is None else ""
        raise ArgumentTypeError(f"{where + ': ' if where else ''}{name}={shown} is not an array of numbers{why}")
    return a


def _has_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, jax.Array):  # traced, or on the device: not read back here (no sync)
        return False
    if isinstance(value, np.ndarray | np.generic) or hasattr(value, "__array__"):
        try:
            a = np.asarray(value)
        except Exception:  # noqa: BLE001 -- not an array of numbers: nothing to say about NaN
            return False
        return bool(np.issubdtype(a.dtype, np.floating) and a.size and np.isnan(a).any())
    return False


def refuse_nan(where: str, fields: dict[str, Any], skip: Callable[[], bool] = tracing) -> None:
    """Raise :class:`~ppl_thought.errors.NumericalError` naming the first field that holds NaN: a Python float or a
    host array (NumPy, or anything NumPy reads); JAX arrays are not read back (no device sync on a state JAX
    rebuilds every step), nor is anything while JAX traces."""
    if skip():
        return
    for name, value in fields.items():
        if _has_nan(value):
            raise NumericalError(f"{where}: {name} holds NaN ({type(value).__name__}); expected finite numbers")
