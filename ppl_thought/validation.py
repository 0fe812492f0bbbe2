"""The type layer at the public boundary (docs/architecture.md, "Validation at the boundary").

Every public callable (the names in a subpackage's ``__all__``) says at its definition that it is checked:
``@checked`` on a function, or on a class (its ``__init__``, ``__call__`` and public methods), checks each call
against the callable's own type hints with ``beartype`` (O(1) per call: one check per argument, never per
element or per token). A violation raises :class:`ArgumentTypeError` naming the callable, the argument, the
value and the declared type, where a bare ``TypeError`` / ``AttributeError`` from deep inside torch used to come.
The methods an engine calls once per token or per step carry :func:`per_token` and stay unchecked (the engine
checks its run once, at its boundary); a public name left unchecked on purpose carries :func:`not_checked` with
the reason. Value checks (ranges, sizes, vocabularies that must agree) stay in :mod:`ppl_thought.checks`,
written once per kind of value.

The JAX side (``ppl_thought.numpyro``) uses ``@checked(skip_while=tracing)``, spelled ``checked_jax`` in
:mod:`ppl_thought.numpyro.boundary`: the checked callable calls the plain one while JAX traces (under ``jit`` /
``vmap`` / ``lax.scan`` the values are tracers and the check would run at trace time only, so the layer stays
out of compiled code).

``PPL_THOUGHT_TYPECHECK=0`` in the environment turns the layer off (set before ``import ppl_thought``), for
benchmarking what it costs (``benchmarks/engine_core_ab.py --typecheck-ab``).

Numbers: a hint ``int`` also admits NumPy integers, ``float`` admits ``int`` and NumPy floating scalars (the
numeric tower of PEP 484), so ``SMC(np.int64(64))`` still works; ``Sequence[int]`` / ``Iterable[int]`` (and
``float``) admit any framework's array. A ``float`` argument is never NaN: a NaN (Python or NumPy float) given
to a parameter hinted ``float`` (alone, in a union or ``Optional``) is an :class:`ArgumentTypeError` (a
``ConfigError``) naming the parameter, before the body runs, where it used to flow on (``bounded_num_draws(nan)``
returned 0). A parameter that admits NaN says so with the hint :class:`FloatOrNaN`. (+-inf stay admitted:
log-probabilities may be -inf; return values are not scanned.)
"""

from __future__ import annotations

import functools
import inspect
import os
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from beartype import BeartypeConf, FrozenDict, beartype
from beartype.door import is_bearable
from beartype.roar import BeartypeDecorHintPep585DeprecationWarning, BeartypeException

from ppl_thought.errors import ArgumentTypeError, PPLThoughtError, ResultTypeError

__all__ = ["ENABLED", "CONF", "ArrayLike", "FloatOrNaN", "SupportsArray", "SupportsLogProb",
           "SupportsSampleWithLogProb", "checked", "per_token", "not_checked", "resolve_all", "UNCHECKED"]




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


class FloatOrNaN(metaclass=_Duck):
    """The hint of a number argument that may be NaN on purpose (a plain ``float`` hint refuses NaN): anything
    with ``__float__``."""

    _methods, _on_type = ("__float__",), True


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

_MARK = "__ppl_thought_checked__"  # on a checked function (its wrapper) and in the dict of a checked class
_PER_TOKEN = "__ppl_thought_per_token__"  # on a method that the class decorator leaves unchecked
_EXEMPT = "__ppl_thought_exempt__"  # on a public name that is not checked: why

#: the compilers of checks not yet compiled (a check is compiled on its first call, when every name its hints
#: read exists): :func:`resolve_all` runs them all
_PENDING: list[Callable[[], Callable]] = []


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def per_token(func: Callable) -> Callable:
    """Mark a method that an engine calls once per token or per step (``step``, ``log_prob``, a cache's
    ``reorder`` ...): :func:`checked` on its class leaves it unchecked, since the engine checks the run once at its
    boundary. The mark is the only effect: the method itself is unchanged."""
    setattr(func, _PER_TOKEN, True)
    return func


def not_checked(reason: str) -> Callable[[Any], Any]:
    """Mark a public name that the type layer leaves alone on purpose, saying why (tests/test_validation.py reads
    the reason: every name in an ``__all__`` is checked or carries one)."""

    def mark(obj: Any) -> Any:
        setattr(obj, _EXEMPT, reason)
        return obj

    return mark


def checked(obj: Any = None, skip_while: Callable[[], bool] | None = None) -> Any:
    """The type layer, written at the definition: ``@checked`` on a function checks each call against its hints;
    on a class it checks ``__init__``, ``__call__`` and the public, static and class methods defined in the class
    (inherited ones are checked where they are defined), except the methods marked :func:`per_token`. A
    violation raises :class:`ArgumentTypeError` (:class:`ResultTypeError` for a returned value).

    The check of a function is compiled on its first call (then every name its hints read is defined); a hint
    that cannot be resolved or compiled leaves the function unchecked and listed in :data:`UNCHECKED`. With
    ``skip_while`` (``@checked(skip_while=tracing)``, the JAX side's ``checked_jax``) the function runs unchecked
    whenever ``skip_while()`` is true. Without the layer (``PPL_THOUGHT_TYPECHECK=0``) it returns ``obj``."""
    if obj is None:
        return functools.partial(checked, skip_while=skip_while)
    if inspect.isclass(obj):
        return _check_class(obj, skip_while)
    return _check_function(obj, skip_while)


_WRAPPED: dict[Callable, Callable] = {}


def _check_function(func: Callable, skip_while: Callable[[], bool] | None) -> Callable:
    """``func`` checked against its hints on every call (see :func:`checked`); one wrapper per function."""
    if not ENABLED or getattr(func, _MARK, False) or not getattr(func, "__annotations__", None):
        return func
    if func in _WRAPPED:
        return _WRAPPED[func]

    def compile_check() -> Callable:
        nonlocal check
        if check is not first_call:
            return check
        check = func
        try:  # a hint naming what only a TYPE_CHECKING import brings would fail at call time: say so
            typing.get_type_hints(func)
        except Exception as e:  # noqa: BLE001 -- any failure to resolve means: this callable cannot be checked
            UNCHECKED[_qualname(func)] = f"unresolvable hint: {type(e).__name__}: {e}"
            return check
        try:
            with warnings.catch_warnings():  # beartype's notes on PEP 585 spellings are for us, not for users
                warnings.simplefilter("ignore", BeartypeDecorHintPep585DeprecationWarning)
                check = beartype(func, conf=CONF)
        except BeartypeException as e:
            UNCHECKED[_qualname(func)] = f"{type(e).__name__}: {e}".splitlines()[0]
            return check
        at = _float_parameters(func)
        if at:  # a NaN where the hint says float: refused before the body runs (one comparison per such argument)
            typed = check

            def check(*args: Any, **kwargs: Any) -> Any:
                for i, name in at:
                    v = args[i] if i < len(args) else kwargs.get(name)
                    if v.__class__ in _FLOATS and v != v:
                        raise _nan_error(func, args, kwargs, at)
                return typed(*args, **kwargs)
        return check

    def first_call(*args: Any, **kwargs: Any) -> Any:
        return compile_check()(*args, **kwargs)

    check = first_call
    if skip_while is None:
        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return check(*args, **kwargs)
            except (TypeError, ValueError, AttributeError, IndexError) as e:
                _refuse_unreadable(func, e, args, kwargs)
                raise
    else:
        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            if skip_while():
                return func(*args, **kwargs)
            try:
                return check(*args, **kwargs)
            except (TypeError, ValueError, AttributeError, IndexError) as e:
                _refuse_unreadable(func, e, args, kwargs)
                raise

    setattr(call, _MARK, True)
    _PENDING.append(compile_check)
    _WRAPPED[func] = call
    return call


def _check_class(cls: type, skip_while: Callable[[], bool] | None) -> type:
    if not ENABLED or cls.__dict__.get(_MARK, False):
        return cls
    for name, attr in list(vars(cls).items()):
        if name.startswith("_") and name not in ("__init__", "__call__"):
            continue
        if isinstance(attr, staticmethod | classmethod):
            if not getattr(attr.__func__, _PER_TOKEN, False):
                fn = _check_function(attr.__func__, skip_while)
                if fn is not attr.__func__:
                    setattr(cls, name, type(attr)(fn))
        elif inspect.isfunction(attr) and not getattr(attr, _PER_TOKEN, False):
            fn = _check_function(attr, skip_while)
            if fn is not attr:
                setattr(cls, name, fn)
    setattr(cls, _MARK, True)
    return cls


def resolve_all() -> dict[str, str]:
    """Compile every check not compiled yet (each is compiled on its first call) and return :data:`UNCHECKED`:
    the tests' way to see that every hint of every imported checked callable compiles."""
    for compile_check in _PENDING:
        compile_check()
    return UNCHECKED


def _refuse_unreadable(func: Callable, error: BaseException, args: tuple, kwargs: dict) -> None:
    """Raise :class:`ArgumentTypeError` when ``error`` came from the check itself failing to read an argument
    (beartype sizes a value hinted ``Iterable[...]`` / ``Sequence[...]`` with ``len()``, which a 0-d tensor or
    array answers with a bare ``TypeError``); return (the caller re-raises ``error`` unchanged) when the error is
    the library's own, when the call does not bind (Python's own error), or when every argument meets its hint
    (the body raised). Runs only after an exception: each argument is asked again with ``beartype.door``."""
    if isinstance(error, PPLThoughtError):
        return
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError:
        return
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # noqa: BLE001 -- unresolvable hints: the function ran unchecked, the body raised
        return
    params = inspect.signature(func).parameters
    odd = []
    for name, value in bound.arguments.items():
        if name not in hints:
            continue
        kind = params[name].kind
        values = value if kind is inspect.Parameter.VAR_POSITIONAL else \
            value.values() if kind is inspect.Parameter.VAR_KEYWORD else (value,)
        for v in values:
            try:
                ok = is_bearable(v, hints[name], conf=CONF)
            except Exception:  # noqa: BLE001 -- a value the hint cannot read at all
                ok = False
            if not ok:
                odd.append(f"{name}={v!r}"[:120])
                break
    if odd:
        raise ArgumentTypeError(f"{_qualname(func)}() got {', '.join(odd)}, which its type hints cannot read "
                                f"({type(error).__name__}: {error}): expected the declared types "
                                f"{_hints(func)}"[:600]) from None


_FLOATS = frozenset((float, np.float16, np.float32, np.float64, np.longdouble))


def _admits_float(hint: Any) -> bool:
    """Whether a hint is ``float`` itself or a union / ``Annotated`` / ``Optional`` with ``float`` as a member
    (not the items of a container: a sequence is read as an array)."""
    if hint is float:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType or origin is typing.Annotated:
        members = typing.get_args(hint)[:1] if origin is typing.Annotated else typing.get_args(hint)
        return any(_admits_float(h) for h in members)
    return False


def _float_parameters(func: Callable) -> tuple[tuple[int, str], ...]:
    """(position, name) of the parameters of ``func`` hinted ``float`` (keyword-only: no position)."""
    try:
        hints, params = typing.get_type_hints(func, include_extras=True), inspect.signature(func).parameters
    except Exception:  # noqa: BLE001 -- unresolvable: nothing to scan (the layer already records why)
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    return tuple((i if p.kind is not inspect.Parameter.KEYWORD_ONLY else 1 << 30, name)
                 for i, (name, p) in enumerate(params.items())
                 if p.kind in kinds and name in hints and _admits_float(hints[name]))


def _nan_error(func: Callable, args: tuple, kwargs: dict, at: tuple) -> ArgumentTypeError:
    """The error of a NaN given where a hint says ``float``: the parameters (of ``at``) that hold a NaN, by name."""
    def is_nan(v: Any) -> bool:
        return v.__class__ in _FLOATS and v != v

    names = [name for i, name in at if is_nan(args[i] if i < len(args) else kwargs.get(name))]
    return ArgumentTypeError(f"{_qualname(func)}(): {', '.join(names)} is NaN, where a number is due (a float "
                             "argument must be a number, finite or +-inf; NaN usually comes from a failed computation "
                             "upstream, e.g. 0/0 or a NaN log-probability): pass a number")


def _hints(func: Callable) -> str:
    return ", ".join(f"{k}: {v}" for k, v in getattr(func, "__annotations__", {}).items() if k != "return")
