"""The type layer at the public boundary (docs/architecture.md, "Validation at the boundary").

Every public callable (the names in a subpackage's ``__all__``: functions, and the constructors and public
methods of classes) is checked against its own type hints on each call by ``beartype`` (O(1) per call: one
check per argument, never per element or per token). A violation raises :class:`ArgumentTypeError` naming the
callable, the argument, the value and the declared type, where a bare ``TypeError`` / ``AttributeError`` from
deep inside torch used to come. Value checks (ranges, sizes, vocabularies that must agree) stay in
:mod:`ppl_thought.checks`, written once per kind of value.

The JAX side (``ppl_thought.numpyro``) uses the same layer with two additions: ``check_exports(...,
skip_while=tracing)`` makes every checked callable call the plain one while its predicate is true (JAX is
tracing: under ``jit`` / ``vmap`` / ``lax.scan`` the values are tracers and the check would run at trace time
only, so the layer stays out of compiled code), and a class may name its own per-step methods in a class
attribute ``__ppl_thought_hot__`` (they join :data:`_HOT` for that class and its subclasses).

``PPL_THOUGHT_TYPECHECK=0`` in the environment turns the layer off (set before ``import ppl_thought``), for
benchmarking what it costs (``benchmarks/engines.py --typecheck-ab``).

Numbers: a hint ``int`` also admits NumPy integers, ``float`` admits ``int`` and NumPy floating scalars (the
numeric tower of PEP 484), so ``SMC(np.int64(64))`` still works; ``Sequence[int]`` / ``Iterable[int]`` (and
``float``) admit any framework's array.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import typing
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from beartype import BeartypeConf, FrozenDict, beartype
from beartype.roar import BeartypeDecorHintPep585DeprecationWarning, BeartypeException

from ppl_thought.errors import ArgumentTypeError, PPLThoughtError, ResultTypeError

__all__ = ["ENABLED", "CONF", "ArrayLike", "SupportsArray", "SupportsLogProb", "SupportsSampleWithLogProb",
           "check_exports", "checked", "UNCHECKED"]




class _Duck(type):
    """The metaclass of the duck-typed hints below: ``isinstance(obj, C)`` is one ``hasattr`` per method that ``C``
    names, where a ``typing.Protocol``'s runtime check re-collects the protocol's attributes on every call (about
    half a millisecond on a busy machine: it was most of the layer's cost on small calls such as
    ``Automaton.run``)."""

    _methods: tuple[str, ...] = ()
    _on_type: bool = False

    def __instancecheck__(cls, obj: Any) -> bool:
        where = type(obj) if cls._on_type else obj
        return all(hasattr(where, m) for m in cls._methods)

    def __subclasscheck__(cls, sub: type) -> bool:
        return all(hasattr(sub, m) for m in cls._methods)


class SupportsArray(metaclass=_Duck):
    """Anything NumPy turns into an array without copying element by element: NumPy, torch and JAX arrays (an
    object whose type has ``__array__``)."""

    _methods, _on_type = ("__array__",), True


#: the hint of an argument that is read with ``np.asarray``: an array of any framework or a (nested) sequence
ArrayLike = SupportsArray | Sequence[Any]


class SupportsSampleWithLogProb(metaclass=_Duck):
    """A sampler Q(z | x) of Def 3.1 as the engines call it: ``sample_with_log_prob(x, n) -> (z [n, L], log Q [n])``
    (every :mod:`ppl_thought.guides` sampler, or a user's class offering the method)."""

    _methods = ("sample_with_log_prob",)


class SupportsLogProb(metaclass=_Duck):
    """A sampler scored on given latents: ``log_prob(z, x) -> log Q(z | x)`` (the exact divergences of Table 3.1)."""

    _methods = ("log_prob",)


ENABLED: bool = os.environ.get("PPL_THOUGHT_TYPECHECK", "1").strip().lower() not in ("0", "false", "no", "off")

CONF = BeartypeConf(
    violation_param_type=ArgumentTypeError,
    violation_return_type=ResultTypeError,
    hint_overrides=FrozenDict({
        int: int | np.integer,
        float: float | int | np.integer | np.floating,
        # ids and numbers may come as any framework's array wherever a sequence of them is read
        Sequence[int]: Sequence[int] | SupportsArray,
        Iterable[int]: Iterable[int] | SupportsArray,
        Sequence[float]: Sequence[float] | SupportsArray,
        Iterable[float]: Iterable[float] | SupportsArray,
        Sequence[bool]: Sequence[bool] | SupportsArray,
        Iterable[bool]: Iterable[bool] | SupportsArray,
    }),
)

#: callables whose hints beartype could not compile (qualified name -> reason); empty in a healthy tree
#: (tests/test_validation.py checks it)
UNCHECKED: dict[str, str] = {}

_MARK = "__ppl_thought_checked__"
# methods that engines call per token or per step: checked once per run at the engine's boundary instead
_HOT = frozenset({
    "forward", "step", "init", "log_prob", "sample", "rsample", "expand", "reorder", "index_select",
    # LMState / Segment / LMSequence: an engine calls these once per token step
    "segment", "next_token", "extend", "snapshot", "feed", "feed_checked", "sample_with_log_prob", "step_log_probs",
    "lm_kwargs_for",
    # TokenRule (automaton stepping for all particles at once)
    "allowed", "log_probs", "inactive_row", "advance", "is_final", "num_emitted", "end_tables", "forced_runs",
    # Automaton (its states/tokens hint ArrayLike: a protocol isinstance costs tens of microseconds per call)
    "mask",
    # caches and the HuggingFace adapter's per-step id maps
    "with_rows", "append", "store", "finish", "latent_projections", "empty", "to_hf", "from_hf", "library_logits",
})


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


_WRAPPED: dict[Callable, Callable] = {}


def checked(func: Callable, skip_while: Callable[[], bool] | None = None) -> Callable:
    """``func`` checked against its hints on every call (or ``func`` itself when the layer is off, when it has
    no hints, or when its hints cannot be resolved or compiled: then it is listed in :data:`UNCHECKED`). One
    wrapper per function, however many subpackages export it. With ``skip_while``, the checked version calls
    ``func`` unchecked whenever ``skip_while()`` is true (the JAX side: while JAX traces)."""
    if not ENABLED or getattr(func, _MARK, False) or not getattr(func, "__annotations__", None):
        return func
    if func in _WRAPPED:
        return _WRAPPED[func]
    try:  # a hint naming what only a TYPE_CHECKING import brings would fail at call time: find it now
        typing.get_type_hints(func)
    except Exception as e:  # noqa: BLE001 -- any failure to resolve means: this callable cannot be checked
        UNCHECKED[_qualname(func)] = f"unresolvable hint: {type(e).__name__}: {e}"
        return func
    try:
        with warnings.catch_warnings():  # beartype's notes on PEP 585 spellings are for us, not for users
            warnings.simplefilter("ignore", BeartypeDecorHintPep585DeprecationWarning)
            wrapped = beartype(func, conf=CONF)
    except BeartypeException as e:
        UNCHECKED[_qualname(func)] = f"{type(e).__name__}: {e}".splitlines()[0]
        return func
    if wrapped is not func:
        wrapped = _guarded(func, wrapped)  # first: it reads beartype's frame right under its own
        if skip_while is not None:
            wrapped = _unless(func, wrapped, skip_while)
        setattr(wrapped, _MARK, True)
        _WRAPPED[func] = wrapped
    return wrapped


def _unless(func: Callable, check: Callable, skip_while: Callable[[], bool]) -> Callable:
    """``check`` (the checked ``func``), except that ``func`` itself runs while ``skip_while()`` is true."""

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs) if skip_while() else check(*args, **kwargs)

    return call


def _odd_arguments(func: Callable, args: tuple, kwargs: dict) -> str:
    """The arguments of a failed call, 0-d arrays (the usual culprits) first, as ``name=value`` (the error path)."""
    try:
        bound = inspect.signature(func).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return f"arguments {args!r} {kwargs!r}"[:200]
    named = {k: v for k, v in bound.items() if k not in ("self", "cls")}
    odd = {k: v for k, v in named.items() if getattr(v, "ndim", None) == 0} or named
    return ", ".join(f"{k}={v!r}"[:120] for k, v in odd.items())


def _binds(func: Callable, args: tuple, kwargs: dict) -> bool:
    try:
        inspect.signature(func).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _hints(func: Callable) -> str:
    return ", ".join(f"{k}: {v}" for k, v in getattr(func, "__annotations__", {}).items() if k != "return")


def _guarded(func: Callable, wrapped: Callable) -> Callable:
    """``wrapped`` (beartype's check of ``func``) with the exceptions the *check itself* raises on an odd value
    turned into :class:`ArgumentTypeError`: beartype sizes a value hinted ``Iterable[...]`` or ``Sequence[...]``
    with ``len()``, which a 0-d tensor or array answers with a bare ``TypeError``. An exception from ``func``'s own
    body (the frame after beartype's is ``func``'s) passes unchanged."""
    code = func.__code__

    @functools.wraps(func)
    def guard(*args: Any, **kwargs: Any) -> Any:
        try:
            return wrapped(*args, **kwargs)
        except (TypeError, ValueError, AttributeError, IndexError) as e:
            tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # beartype's wrapper frame
            if tb is None or not tb.tb_frame.f_code.co_filename.startswith("<@beartype(") or \
                    (tb.tb_next is not None and tb.tb_next.tb_frame.f_code is code) or isinstance(e, PPLThoughtError) \
                    or not _binds(func, args, kwargs):  # a call with missing or extra arguments: Python's own error
                raise
            raise ArgumentTypeError(f"{_qualname(func)}() got {_odd_arguments(func, args, kwargs)}, which its type "
                                    f"hints cannot read ({type(e).__name__}: {e}): expected the declared types "
                                    f"{_hints(func)}"[:600]) from None

    return guard


def _check_class(cls: type, skip_while: Callable[[], bool] | None = None) -> None:
    if cls.__dict__.get(_MARK, False):
        return
    hot = _HOT | frozenset(getattr(cls, "__ppl_thought_hot__", ()))
    for name, attr in list(vars(cls).items()):
        if name in hot or (name.startswith("_") and name not in ("__init__", "__call__")):
            continue
        if isinstance(attr, staticmethod | classmethod):
            fn = checked(attr.__func__, skip_while)
            if fn is not attr.__func__:
                setattr(cls, name, type(attr)(fn))
        elif inspect.isfunction(attr):
            fn = checked(attr, skip_while)
            if fn is not attr:
                setattr(cls, name, fn)
    setattr(cls, _MARK, True)


def check_exports(namespace: dict[str, Any], names: Iterable[str] | None = None, *,
                  skip_while: Callable[[], bool] | None = None) -> None:
    """Put the type layer on the public names of a module: call at the end of a subpackage's ``__init__`` as
    ``check_exports(globals())``. Functions are replaced by their checked version in ``namespace`` and under
    every name already bound to them in a loaded ``ppl_thought`` module (its home, every re-export), so there is
    one object per function; classes get their constructor and public methods checked in place (except the
    per-step methods of :data:`_HOT` and of the class's ``__ppl_thought_hot__``). ``skip_while``: see
    :func:`checked` (the JAX side passes "JAX is tracing")."""
    if not ENABLED:
        return
    replaced: dict[int, Callable] = {}  # id(original) -> its checked version
    for name in names if names is not None else namespace.get("__all__", ()):
        obj = namespace.get(name)
        if not str(getattr(obj, "__module__", "")).startswith("ppl_thought"):
            continue
        if inspect.isclass(obj):
            if not issubclass(obj, BaseException):
                _check_class(obj, skip_while)
        elif inspect.isfunction(obj):
            namespace[name] = wrapped = checked(obj, skip_while)
            if wrapped is not obj:
                replaced[id(obj)] = wrapped
    if replaced:  # one pass over the loaded modules for all of this namespace's functions
        for mod_name, mod in list(sys.modules.items()):
            if mod_name.startswith("ppl_thought") and mod is not None:
                for key, value in list(vars(mod).items()):
                    if id(value) in replaced and replaced[id(value)].__wrapped__ is value:
                        setattr(mod, key, replaced[id(value)])
