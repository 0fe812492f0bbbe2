"""Argument checks shared by the public entry points (docs/architecture.md, "Rules that keep it right"): a bad
value gets a :class:`~ppl_thought.errors.PPLThoughtError` subclass that names the argument, what it got and what it
expects (never a silent ``int(2.7) == 2``, ``int("4")`` or ``bool`` taken for a number, a string read as token
ids, or an allocation larger than the machine)."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

import numpy as np

from ppl_thought.errors import (
    ActiveLiftError,
    ConfigError,
    MalformedSequenceError,
    PPLThoughtError,
    TransformError,
    UnknownTokenError,
)


def integer(name: str, value, minimum: int = 1) -> int:
    """``value`` as a Python int ``>= minimum``: a Python or numpy integer, not a bool, a float or a string."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral) or value < minimum:
        sign = " (non-negative)" if minimum == 0 else " (positive)" if minimum == 1 else ""
        raise ConfigError(f"{name} must be an integer >= {minimum}{sign}, got {value!r}")
    return int(value)


def fraction(name: str, value) -> float:
    """``value`` as a float in [0, 1]: a real number (not a bool, a string or NaN)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real) or math.isnan(value) \
            or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def optional_integer(name: str, value, minimum: int = 1) -> int | None:
    """``None``, or ``value`` as by :func:`integer`."""
    return None if value is None else integer(name, value, minimum)


def generation_length(length) -> int:
    """The number of steps of a program run with no observations (``x=None``): ``length``, which must be given,
    as by :func:`integer` with minimum 0 (both backends' ``HMM.program_length``)."""
    if length is None:
        raise ConfigError("give the observations x, or length= to generate")
    return integer("length", length, minimum=0)


def real(name: str, value, minimum: float | None = None, maximum: float | None = None, *,
         open_min: bool = False, open_max: bool = False) -> float:
    """``value`` as a finite float in the given range: a real number, not a bool, a string, NaN or +-inf."""
    lo = "" if minimum is None else ("> " if open_min else ">= ") + f"{minimum:g}"
    hi = "" if maximum is None else ("< " if open_max else "<= ") + f"{maximum:g}"
    want = "a finite number" + (f" {lo}" if lo else "") + (" and " if lo and hi else " " if hi else "") + hi
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{name} must be {want.strip()}, got {value!r}")
    v = float(value)
    if minimum is not None and (v <= minimum if open_min else v < minimum) or \
            maximum is not None and (v >= maximum if open_max else v > maximum):
        raise ConfigError(f"{name} must be {want.strip()}, got {value!r}")
    return v


def token_id(name: str, value, size: int) -> int:
    """One token id: a Python/numpy integer or a 0-d integer tensor (not a bool, a float or a string) in
    ``[0, size)``; :class:`MalformedSequenceError` for the wrong type, :class:`UnknownTokenError` outside."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "dtype") and not isinstance(value, np.generic):
        id_dtype(name, value.dtype)  # a 0-d tensor or array: integer dtypes only
        value = value.item()
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise MalformedSequenceError(f"{name} must be an integer token id in [0, {size}), got {value!r} "
                                     f"({type(value).__name__})")
    if not 0 <= int(value) < size:
        raise UnknownTokenError(f"{name} {int(value)} is outside the vocabulary [0, {size})")
    return int(value)


def id_dtype(name: str, dtype) -> None:
    """Refuse token ids held as floats or bools (``[6.5]`` is not token 6; ``True`` is not token 1)."""
    if isinstance(dtype, np.dtype):
        kind = dtype.kind
    else:
        try:
            kind = np.dtype(str(dtype).replace("torch.", "")).kind
        except TypeError:  # torch dtypes numpy does not name (bfloat16, float8 ...): none is an integer type
            kind = "f"
    if kind not in "iu":
        raise MalformedSequenceError(f"{name} must hold integer token ids, got dtype {dtype}")


def token_ids(name: str, value, *, vocab_hint: str = "") -> None:
    """Refuse a string (or a list of strings) where token ids are expected, naming how to encode it."""
    if isinstance(value, str) or (isinstance(value, list | tuple) and value and isinstance(value[0], str)):
        hint = vocab_hint or "encode it first (vocab.encode(text), or a tokenizer's encode)"
        raise MalformedSequenceError(f"{name} must be token ids (a 1-D integer tensor or list), got the string "
                                     f"{value!r}: {hint}")
    if isinstance(value, float | bool | np.floating | np.bool_):
        raise MalformedSequenceError(f"{name} must be token ids (a 1-D integer tensor or list), got {value!r}")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and getattr(value, "numel", lambda: getattr(value, "size", 1))():
        id_dtype(name, dtype)
    elif isinstance(value, list | tuple) and any(isinstance(v, float | bool | np.floating | np.bool_)
                                                 for v in value):
        raise MalformedSequenceError(f"{name} must hold integer token ids, got {list(value)[:8]!r}")


def numeric_array(name: str, value, error: type[PPLThoughtError] = ConfigError,
                  expects: str = "an array of numbers (a tensor, a NumPy array or a list of numbers)") -> None:
    """Refuse what cannot be read as an array of numbers before ``torch.as_tensor`` / ``np.asarray`` meet it:
    ``None``, a string or bytes (a ``Sequence`` to the type layer), an array of strings or objects, or a list
    holding anything but numbers (``[1.5, 'a']``, a ragged nesting). ``error`` names the argument, the value and
    what is expected. An array's dtype is read, its elements never are (no host sync for a GPU tensor), and the value
    is formatted only for a message (a repr of a large array costs more than the check)."""

    def got() -> str:
        return f"got {type(value).__name__} {value!r}"[:200]

    if value is None or isinstance(value, str | bytes | bytearray):
        raise error(f"{name} must be {expects}, {got()}")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and not isinstance(value, numbers.Number):
        try:
            kind = dtype.kind if isinstance(dtype, np.dtype) else np.dtype(str(dtype).replace("torch.", "")).kind
        except TypeError:  # torch dtypes NumPy does not name (bfloat16, float8 ...): all of them numbers
            kind = "f"
        if kind not in "biuf":
            raise error(f"{name} must be {expects}, got an array of dtype {dtype}")
        return
    if isinstance(value, numbers.Number):
        return
    if isinstance(value, list | tuple) and value and all(hasattr(v, "dtype") for v in value):
        for i, v in enumerate(value):  # a list of arrays (maybe on a GPU): their dtypes, not their elements
            numeric_array(f"{name}[{i}]", v, error, expects)
        return
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise error(f"{name} must be {expects}, {got()} ({type(e).__name__}: {e})"[:300]) from None
    if arr.dtype.kind not in "biuf":
        raise error(f"{name} must be {expects}, {got()}")


def path(name: str, value):
    """``value`` as a ``pathlib.Path``: a ``str`` or ``os.PathLike`` (not None, bytes, a number or a tensor, which
    ``str()`` would turn into a file name such as ``'None'``); :class:`ConfigError` naming ``name`` otherwise."""
    from pathlib import Path

    if isinstance(value, bool) or not isinstance(value, str | os.PathLike) or str(value) == "":
        raise ConfigError(f"{name} must be a path (a non-empty str or os.PathLike), got {value!r}")
    return Path(value)


def callable_arg(name: str, value, expects: str) -> None:
    """Refuse ``None``, a string or any non-callable where a model, guide or LM goes."""
    if value is None or isinstance(value, str) or not callable(value):
        raise ConfigError(f"{name} must be {expects}, got {value!r}"[:300])


def instance(name: str, value, cls: type | tuple[type, ...], expects: str) -> None:
    """Refuse a value that is not an instance of ``cls`` (e.g. ``None`` or a string for a Vocab)."""
    if not isinstance(value, cls):
        raise ConfigError(f"{name} must be {expects}, got {type(value).__name__} {value!r}"[:300])


def available_memory() -> int | None:
    """Bytes of memory the machine can still give (:func:`ppl_thought.resources.available_bytes`: the one home
    of the limit, ``PPL_THOUGHT_MAX_BYTES`` included), or None where it cannot be measured."""
    from ppl_thought.resources import available_bytes

    free = available_bytes()
    return None if free == float("inf") else int(free)


#: allocations below this many bytes are never refused by :func:`allocation`
SMALL_ALLOCATION = 1 << 28


def allocation(what: str, nbytes: int, device=None) -> None:
    """Refuse, before allocating, a tensor of ``nbytes`` that is larger than the memory the device has free
    (host memory for the CPU, ``torch.cuda.mem_get_info`` for a GPU; :func:`ppl_thought.resources.check_bytes`):
    a :class:`~ppl_thought.errors.ResourceError` (a ``ConfigError``) naming the sizes, instead of a hang, a swap
    storm or a raw allocator error. Sizes under 256 MiB are not checked (asking the OS for its free memory costs
    a file read; an engine calls this once per run)."""
    if nbytes < SMALL_ALLOCATION:
        return
    from ppl_thought.resources import check_bytes

    check_bytes(nbytes, what, "this allocation", device, fix="fewer particles or shorter sequences")


def lm(name: str, value) -> None:
    """Refuse what is not a language model: a callable with an integer ``vocab_size`` (``None``, a string, a
    tokenizer or a vocabulary are refused naming the argument)."""
    if value is None or isinstance(value, str) or not callable(value) or \
            isinstance(getattr(value, "vocab_size", None), bool) or \
            not isinstance(getattr(value, "vocab_size", None), numbers.Integral):
        raise ConfigError(f"{name} must be a ppl_thought LM (pt.lm.Transformer, pt.lm.Tabular, pt.lm.HuggingFace, "
                          f"or a module with an integer vocab_size), got {type(value).__name__} {value!r}"[:300])


def has_attributes(name: str, value, attributes: tuple[str, ...], expects: str) -> None:
    """Refuse a value without the attributes its role needs (e.g. a projection without ``vocab`` and
    ``lifting``), naming the argument and what is expected, instead of an AttributeError from inside."""
    if value is None or isinstance(value, str) or any(not hasattr(value, a) for a in attributes):
        raise ConfigError(f"{name} must be {expects}, got {type(value).__name__} {value!r}"[:300])


# ---------------------------------------------------------------------------------------------- transforms
# the argument checks of the transforms, one home for the torch (ppl_thought/transforms) and JAX
# (ppl_thought/numpyro/transforms) twins


def latent_token_ids(vocab, latent_tokens) -> list[int]:
    """ActiveLift's latent alphabet Omega (Section 6.1) as ids of ``vocab``: its ordinary tokens when
    ``latent_tokens`` is None, else the given names or ids; none of <pad>, <bos>, <s>, </s> (they delimit the
    formats of Section 6.6) and at least two distinct tokens, else an :class:`ActiveLiftError`."""
    omega = [int(i) for i in vocab.ordinary_ids] if latent_tokens is None else \
        [vocab.id(t) if isinstance(t, str) else integer("a latent token id", t, minimum=0) for t in latent_tokens]
    vocab.check_ids(omega, "latent tokens")
    special = sorted(set(omega) & {vocab.pad_id, vocab.bos_id, vocab.think_id, vocab.end_think_id})
    if special:
        raise ActiveLiftError(f"latent tokens may not include <pad>, <bos>, <s> or </s> (ids {special}): "
                              "they delimit the formats of Section 6.6")
    if len(set(omega)) < 2:
        raise ActiveLiftError(f"Omega needs at least two distinct tokens (Section 6.1), got ids {omega}")
    return omega


def cost_weight(weight) -> float:
    """CostAware's weight (cost per latent token, Section 5.6.3): a finite number >= 0, else a
    :class:`TransformError`."""
    w = float(weight)
    if not w >= 0 or w == float("inf"):
        raise TransformError(f"CostAware weight must be a finite number >= 0 (cost per latent token), got {weight!r}")
    return w


def decoding_view(program: Any, **options: Any) -> Any:
    """The program a decoder runs (both backends): ``program.continuation(**options)`` when the program offers that
    protocol method (docs/programs.md; options given as ``None`` are left out), else the program itself, which then
    takes no options (it decides how much it generates through its arguments): a :class:`ConfigError` says so."""
    options = {k: v for k, v in options.items() if v is not None}
    view = getattr(program, "continuation", None)
    if callable(view):
        return view(**options)
    if options:
        raise ConfigError(f"{sorted(options)} are options of a program's continuation(...) protocol method "
                          f"(docs/programs.md); {type(program).__name__} has none and decides how much it "
                          "generates: pass the horizon as one of its arguments")
    return program



def one_token_step(program: Any, engine: str, spec_type: type, examples: str) -> Any:
    """``program.one_token_step()`` for a token-level engine (both backends; docs/programs.md, the token-level
    protocol): the declared step, a ``spec_type`` (the backend's ``OneTokenStep``), or a :class:`ConfigError` that
    names the method to implement (``examples``: the library's programs that have it)."""
    name = type(program).__name__
    ask = getattr(program, "one_token_step", None)
    spec = ask() if callable(ask) else None
    where = f"{spec_type.__module__}.{spec_type.__name__}"
    if spec is None:
        why = "does not define one_token_step()" if not callable(ask) else "has one_token_step() returning None"
        raise ConfigError(f"{engine} runs token-level programs: a step is one token of one LM under a token "
                          f"automaton, declared by one_token_step() -> {where} ({examples} have it); {name} {why}: "
                          f"implement {name}.one_token_step()")
    if not isinstance(spec, spec_type):
        raise ConfigError(f"{name}.one_token_step() must return a {where} or None, got {type(spec).__name__}")
    return spec
