"""What a compiled JAX run depends on, and the record of every compile (docs/numpyro.md, "Compilation").

An engine compiles one function per *what the function depends on*, never per object identity:

* the program's class and its configuration, read off the object: a structural fingerprint of its attributes
  (through nested objects, lists, tuples, dicts and registered pytrees) in which every Python value counts by
  value, every numpy array by value (host data: automaton tables, vocabularies, read concretely), and every
  ``jax.Array`` by shape and dtype only: JAX arrays (LM parameters, probability tables) are passed into the
  compiled function as arguments and the program is rebuilt around them while it is traced
  (:meth:`Fingerprint.rebuild`), so two instances with different weights share one compile and each gets its
  own answer;
* the guide likewise (walked with the model, so objects they share stay shared);
* the shapes and dtypes of the run's traced arguments (a Python scalar counts as the array it becomes:
  ``3`` and ``jnp.array(3)`` are the same ``int32[]``), static arguments by value;
* the engine's configuration (number of particles, threshold, loop length, plates, groups).

Attributes named ``_...cache...`` are memo tables, not configuration: skipped (and shared, never copied).
Functions and other opaque objects count by identity (equal only to themselves), which can only compile more,
never share wrongly. A program that reads a JAX attribute concretely while traced (``int(self.table[0])``)
cannot take it as an argument: the engine then compiles it once more with every array a constant keyed by
value (``mode="constants"``) and remembers that for its class; the record says so.

:func:`compile_stats` lists every compile with its reason; each compile also logs one line on the
``ppl_thought.numpyro`` logger.
"""

from __future__ import annotations

import copy
import enum
import functools
import inspect
import logging
import types
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.numpyro.boundary import checked_jax

__all__ = ["Fingerprint", "arg_names", "as_traced_arg", "compile_stats", "explain", "record_compile",
           "record_hit", "logger"]

logger = logging.getLogger("ppl_thought.numpyro")

_PRIMS = (type(None), bool, int, float, complex, str, bytes, np.bool_, np.integer, np.floating)
_COMPILES: list[dict] = []
_HITS = [0]
_MAX_DEPTH = 64


def _prim(v: Any) -> Hashable:
    if isinstance(v, (float, np.floating)):
        return ("float", float(v).hex())  # NaN equals NaN here: a key must equal itself
    return (type(v).__name__, v)


def _is_cache(name: str) -> bool:
    return name.startswith("_") and "cache" in name.lower()


class Fingerprint:
    """The structural key of a set of objects, the JAX arrays found in them (the compiled function's
    arguments) and how to rebuild the objects around traced arrays.

    ``Fingerprint(objs, trace_arrays=True)``: ``.key`` (hashable: equal for objects the same compiled function
    serves), ``.parts`` (one key per object, for :func:`explain`), ``.arrays`` (the JAX leaves, in walk order)
    and ``.rebuild(arrays)`` (copies of the objects holding ``arrays`` where the originals hold theirs; objects
    without JAX arrays are the originals). With ``trace_arrays=False`` every array is keyed by value and
    nothing is an argument (``.arrays == []``, ``.rebuild`` returns the originals)."""

    def __init__(self, objs: tuple, trace_arrays: bool = True):
        self.trace_arrays = trace_arrays
        self._objs = list(objs)
        self.arrays: list = []
        self._memo: dict[int, tuple[int, bool | None]] = {}  # id -> (visit index, has a rebuild); walk-local
        self._alive: list = []  # the objects of _memo stay alive while walking (their ids stay unique)
        walked = [self._walk(o, 0) for o in objs]
        self.parts = tuple(fp for fp, _ in walked)
        self._rebuilds = [r for _, r in walked]
        self.key = (trace_arrays, self.parts)
        self._memo.clear()
        self._alive.clear()

    def rebuild(self, arrays: list) -> tuple:
        """The objects with ``arrays`` in place of their JAX arrays (called inside the traced function)."""
        memo: dict = {}
        return tuple(o if r is None else r(arrays, memo) for o, r in zip(self._objs, self._rebuilds))

    # the walk: (key, rebuild or None)
    def _walk(self, v: Any, depth: int) -> tuple[Hashable, Callable | None]:
        if isinstance(v, _PRIMS) or isinstance(v, enum.Enum):
            return _prim(v), None
        if isinstance(v, jax.Array):
            if not self.trace_arrays or isinstance(v, jax.core.Tracer):
                return ("jax-value", v.shape, str(v.dtype), np.asarray(v).tobytes()), None
            i = len(self.arrays)
            self.arrays.append(as_traced_arg(v))  # a weak type would make jit trace again
            return ("jax", v.shape, str(v.dtype)), lambda arrays, memo: arrays[i]
        if isinstance(v, np.ndarray):
            if v.dtype == object:
                return ("np-object", v.shape, tuple(self._walk(x, depth + 1)[0] for x in v.flat)), None
            return ("np", v.shape, str(v.dtype), v.tobytes()), None
        if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type)):
            return ("id", v), None
        if depth > _MAX_DEPTH:
            return ("deep", type(v).__name__, v if _hashable(v) else repr(v)), None
        if isinstance(v, (list, tuple)) and all(isinstance(x, _PRIMS) for x in v):
            return (type(v), tuple(_prim(x) for x in v)), None
        if type(v) in (list, tuple) or (isinstance(v, tuple) and hasattr(type(v), "_make")):
            return self._sequence(v, depth)
        if isinstance(v, dict):
            return self._dict(v, depth)
        if isinstance(v, (set, frozenset)):
            return ("set", frozenset(self._walk(x, depth + 1)[0] for x in v)), None
        if isinstance(v, types.MethodType):
            fp, r = self._walk(v.__self__, depth + 1)
            func = v.__func__
            return ("method", func, fp), (None if r is None else
                                          lambda arrays, memo: types.MethodType(func, r(arrays, memo)))
        if isinstance(v, functools.partial):
            (f, rf), (a, ra), (k, rk) = (self._walk(x, depth + 1) for x in (v.func, v.args, v.keywords))
            if rf is None and ra is None and rk is None:
                return ("partial", f, a, k), None
            return ("partial", f, a, k), lambda arrays, memo: functools.partial(
                rf(arrays, memo) if rf else v.func, *(ra(arrays, memo) if ra else v.args),
                **(rk(arrays, memo) if rk else v.keywords))
        if callable(v) and hasattr(v, "__wrapped__") and hasattr(v, "lower"):  # a jax.jit of something
            fp, r = self._walk(v.__wrapped__, depth + 1)
            return ("jit", fp), (None if r is None else lambda arrays, memo: jax.jit(r(arrays, memo)))
        return self._object(v, depth)

    def _sequence(self, v, depth):
        kids = [self._walk(x, depth + 1) for x in v]
        fp = (type(v), tuple(k for k, _ in kids))
        if all(r is None for _, r in kids):
            return fp, None

        def rebuild(arrays, memo):
            items = [x if r is None else r(arrays, memo) for x, (_, r) in zip(v, kids)]
            if type(v) is list:
                return items
            return type(v)._make(items) if hasattr(type(v), "_make") else type(v)(items)
        return fp, rebuild

    def _dict(self, v, depth):
        items = list(v.items())
        if all(isinstance(k, _PRIMS) and isinstance(x, _PRIMS) for k, x in items):
            return (type(v), tuple((_prim(k), _prim(x)) for k, x in items)), None
        kids = [(self._walk(k, depth + 1)[0], self._walk(x, depth + 1)) for k, x in items]
        fp = (type(v), tuple((k, x[0]) for k, x in kids))
        if all(x[1] is None for _, x in kids):
            return fp, None

        def rebuild(arrays, memo):
            new = copy.copy(v)
            for (k, _x), (_, (_, r)) in zip(items, kids):
                if r is not None:
                    new[k] = r(arrays, memo)
            return new
        return fp, rebuild

    def _object(self, v, depth):
        seen = self._memo.get(id(v))
        if seen is not None:
            index, has = seen
            if has is False:
                return ("ref", index), None
            return ("ref", index), lambda arrays, memo: memo.get(index, v)
        index = len(self._memo)
        self._memo[id(v)] = (index, None)
        self._alive.append(v)
        kind, kids, rebuild = self._children(v, depth)
        self._memo[id(v)] = (index, rebuild is not None)
        return (kind, type(v), kids), rebuild

    def _children(self, v, depth):
        leaves, treedef = jax.tree_util.tree_flatten(v, is_leaf=lambda x: x is not v)
        if not (len(leaves) == 1 and leaves[0] is v):  # a registered pytree node (LMState, a distribution, ...)
            kids = [self._walk(x, depth + 1) for x in leaves]
            if all(r is None for _, r in kids):
                return "pytree", (treedef, tuple(k for k, _ in kids)), None
            index = self._memo[id(v)][0]

            def rebuild_tree(arrays, memo):
                new = treedef.unflatten([x if r is None else r(arrays, memo) for x, (_, r) in zip(leaves, kids)])
                memo[index] = new
                return new
            return "pytree", (treedef, tuple(k for k, _ in kids)), rebuild_tree
        attrs = getattr(v, "__dict__", None)
        if attrs is None:
            return "opaque", (v if _hashable(v) else repr(v)), None
        names = [k for k in attrs if not _is_cache(k)]
        kids = [(k, self._walk(attrs[k], depth + 1)) for k in names]
        fp = tuple((k, x[0]) for k, x in kids)
        if all(x[1] is None for _, x in kids):
            return "object", fp, None
        index = self._memo[id(v)][0]

        def rebuild(arrays, memo):
            new = copy.copy(v)
            memo[index] = new
            for k, (_, r) in kids:
                if r is not None:
                    new.__dict__[k] = r(arrays, memo)
            return new
        return "object", fp, rebuild


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def as_traced_arg(a: Any) -> jax.Array:
    """A run argument as the array the compiled function receives: a Python scalar becomes the array
    ``jnp.asarray`` makes of it, without JAX's weak type, so ``3`` and ``jnp.array(3)`` key (and are) the same
    ``int32[]``; numpy arrays take JAX's canonical dtype."""
    x = jnp.asarray(a)
    return jnp.asarray(x, x.dtype) if getattr(x, "weak_type", False) else x


def arg_names(fn: Any, skip: int, count: int) -> list[str]:
    """Names for a run's positional arguments: the parameters of ``fn`` after the first ``skip`` ones."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][skip:]
    except (TypeError, ValueError):
        params = []
    return [params[i].name if i < len(params) else f"arg {i}" for i in range(count)]


def _attr_diff(old: Any, new: Any) -> list[str]:
    """The top-level attribute names whose keys differ between two object fingerprints."""
    if (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == 3 == len(new) and old[0] == "object"
            and new[0] == "object"):
        a, b = dict(old[2]), dict(new[2])
        return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return []


def explain(previous: dict | None, parts: dict) -> str:
    """Why a run compiles: what differs from the closest earlier compile of the same engine and program class."""
    if previous is None:
        return "first run" + (", arrays as constants (the program reads an attribute concretely while traced)"
                              if parts.get("mode") else "")
    why = []
    for part in ("engine", "mode", "program", "guide", "shapes", "static"):
        old, new = previous.get(part), parts.get(part)
        if old == new:
            continue
        if part == "engine":
            diff = [f"{k} {dict(old).get(k)!r} -> {v!r}" for k, v in new if dict(old).get(k) != v]
            why.append("new engine configuration (" + ", ".join(diff) + ")")
        elif part == "mode":
            why.append("arrays as constants (the program reads an attribute concretely while traced)")
        elif part in ("program", "guide"):
            names = _attr_diff(old, new)
            why.append(f"new {'guide ' if part == 'guide' else ''}configuration" +
                       (f" ({', '.join(names)})" if names else ""))
        elif part == "shapes":
            changed = [f"{name}: {shape} {dtype}" for name, shape, dtype in new if (name, shape, dtype) not in old]
            why.append("new shapes (" + (", ".join(changed) or "fewer arguments") + ")")
        else:
            why.append("new static arguments")
    return "; ".join(why) or "recompiled"


def record_compile(engine: str, program: str, guide: str, why: str, seconds: float) -> None:
    """Count a compile (:func:`compile_stats`) and log it."""
    guide = "None" if guide == "NoneType" else guide
    _COMPILES.append({"engine": engine, "program": program, "guide": guide, "why": why,
                      "seconds": round(float(seconds), 4)})
    logger.info("compiled %s for %s (guide %s) in %.2f s: %s", engine, program, guide, seconds, why)


def record_hit() -> None:
    _HITS[0] += 1


@checked_jax
def compile_stats() -> dict[str, Any]:
    """The compiles of JAX engine runs in this process: ``{"count": int, "cache_hits": int, "compiles": [{
    "engine", "program", "guide", "why", "seconds"}, ...]}`` (``why``: ``"first run"``, ``"new shapes (x: (3,)
    int32)"``, ``"new configuration (table)"``, ``"new engine configuration (num_particles 32 -> 64)"``, ...;
    ``seconds``: the first call, compile included). Each compile also logs a line on the ``ppl_thought.numpyro``
    logger (level INFO)."""
    return {"count": len(_COMPILES), "cache_hits": _HITS[0], "compiles": [dict(c) for c in _COMPILES]}
