"""One schema per file format, and the one check every loader runs against it (docs/architecture.md, "Loading").

A :class:`Schema` is a small declarative table: the format's version (the value of its ``version_key``), and for
each key its JSON types, whether it is required, and an optional rule on its value. :func:`check` compares a
parsed JSON object with it and refuses, with a :class:`~ppl_thought.errors.SchemaError` naming the file, the key
and what was expected: a version other than the schema's, a missing required key, a key the schema does not
list, a value of another type, a value its rule refuses. Nothing is filled in from defaults.

Formats (their writers write the version):

* :data:`CHECKPOINT` - a checkpoint folder's ``config.json`` (``ppl_thought.checkpoint``);
* :data:`TRANSFORMER` - the ``config`` of a Transformer checkpoint (both backends' ``Transformer.save`` / ``load``);
  files written before it carried ``"format"`` are version 1;
* :data:`TRAINER_CONFIG` / :data:`TRAINER_EXTRA` - a ``Trainer.save`` checkpoint's config and extra;
* :data:`RESULT` - the ``config`` of a folder written by ``save_result``;
* :data:`VOCAB` - a vocabulary saved inside a Transformer checkpoint or a saved result (``Vocab.to_dict``);
* :data:`INFERENCE_DATA` - the attributes of a netcdf written by ``to_inference_data(...).to_netcdf``.

Base layer: no torch, no jax.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ppl_thought.errors import SchemaError

#: a rule returns None for a value it accepts, else what it expected (a few words)
Rule = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Field:
    """One key of a format: its JSON ``types`` (``bool`` is never an ``int``), whether it is ``required``, and a
    ``rule`` on its value (None: any value of those types)."""

    types: tuple[type, ...]
    required: bool = True
    rule: Rule | None = None
    expected: str = ""


@dataclass(frozen=True)
class Schema:
    """A format: ``title`` (what the object is, in messages), ``version`` (the value of ``version_key``; None: the
    object carries no version of its own, its container does), ``legacy`` (a missing version key means this
    version: files written before writers wrote it) and the ``fields``."""

    title: str
    fields: Mapping[str, Field]
    version: str | None = None
    version_key: str | None = None
    legacy: bool = False
    allowed: str = ""  # how the keys are named in an "unknown keys" message (e.g. "Transformer arguments")
    prefix: str = ""  # how the keys are named in messages, for an object nested in another (e.g. "tensors.")
    notes: dict = field(default_factory=dict)


def _type_name(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
             dict: "a JSON object", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _has_type(value, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def check(schema: Schema, obj: Any, file: Any) -> dict:
    """``obj`` checked against ``schema`` (module docstring); raises :class:`SchemaError` naming ``file``, the key
    and what was expected. Returns ``obj`` unchanged (a dict)."""
    if not isinstance(obj, dict):
        raise SchemaError(f"{file}: the {schema.title} must be a JSON object, got {type(obj).__name__}")
    if schema.version_key is not None:
        got = obj.get(schema.version_key, schema.version if schema.legacy else None)
        if got != schema.version:
            raise SchemaError(f"{file}: the {schema.title} has {schema.version_key}={got!r}, expected "
                              f"{schema.version!r} (a file of another format or version)")
    unknown = sorted(str(k) for k in set(obj) - set(schema.fields) - {schema.version_key})
    if unknown:
        raise SchemaError(f"{file}: the {schema.title} has keys {unknown[:8]} that are not "
                          f"{schema.allowed or 'keys of this format'} (expected only {sorted(schema.fields)})")
    missing = [schema.prefix + k for k, f in schema.fields.items() if f.required and k not in obj]
    if missing:
        raise SchemaError(f"{file}: the {schema.title} lacks {', '.join(missing)} (required: no default is filled "
                          "in, a file without it was not written by this library's writer)")
    for key, f in schema.fields.items():
        if key not in obj:
            continue
        value = obj[key]
        problem = None if _has_type(value, f.types) else _type_name(f.types)
        if problem is None and f.rule is not None:
            problem = f.rule(value)
        if problem is not None:
            raise SchemaError(f"{file}: the {schema.title}'s {schema.prefix}{key}={_short(value)} is not "
                              f"{f.expected or problem}")
    return obj


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------------------ rules


def positive_int(v) -> str | None:
    return None if v is None or (isinstance(v, int) and v >= 1) else "a positive integer"


def nonnegative_int(v) -> str | None:
    return None if isinstance(v, int) and v >= 0 else "an integer >= 0"


def positive_finite(v) -> str | None:
    return None if v is None or (math.isfinite(v) and v > 0) else "a finite number > 0"


def probability(v) -> str | None:
    return None if math.isfinite(v) and 0 <= v < 1 else "a number in [0, 1)"


def strings(v) -> str | None:
    return None if all(isinstance(t, str) for t in v) else "a list of strings"


def hex_digest(v) -> str | None:
    return None if len(v) == 64 and all(c in "0123456789abcdef" for c in v) else "a SHA-256 hex digest"


def equal(value) -> Rule:
    return lambda v: None if v == value else repr(value)


INT, FLOAT, STR, BOOL, LIST, DICT, NONE = (int,), (float,), (str,), (bool,), (list,), (dict,), (type(None),)
ANY_JSON = (dict, list, str, int, float, bool, type(None))

# ---------------------------------------------------------------------------------------------- formats

#: a checkpoint folder's config.json (ppl_thought.checkpoint)
CHECKPOINT = Schema("checkpoint config.json", version="ppl_thought.checkpoint/1", version_key="format", fields={
    "config": Field(ANY_JSON), "extra": Field(DICT), "tensors": Field(DICT)})
#: the "tensors" entry of a checkpoint's config.json
CHECKPOINT_TENSORS = Schema("checkpoint config.json's tensors entry", prefix="tensors.", fields={
    "file": Field(STR), "sha256": Field(STR, rule=hex_digest, expected="a SHA-256 hex digest (64 hex digits)")})

#: a vocabulary saved with a model or a result (``Vocab.to_dict``); versioned by its container
VOCAB = Schema("saved vocabulary", fields={
    "tokens": Field(LIST, rule=strings, expected="a list of strings"),
    "specials": Field(LIST, rule=strings, expected="a list of strings")})

_POS = "a positive integer"
#: the config of a Transformer checkpoint: every constructor argument is required (a missing one is refused,
#: never filled with the constructor's default)
TRANSFORMER = Schema("Transformer config", version="ppl_thought.transformer/1", version_key="format", legacy=True,
                     allowed="Transformer arguments", fields={
                         "class": Field(STR, required=False, rule=equal("Transformer"),
                                        expected="'Transformer' (not a Transformer checkpoint)"),
                         "vocab": Field(DICT, required=False),
                         "vocab_size": Field(INT, rule=positive_int, expected=_POS),
                         "d_model": Field(INT, rule=positive_int, expected=_POS),
                         "n_layers": Field(INT, rule=positive_int, expected=_POS),
                         "n_heads": Field(INT, rule=positive_int, expected=_POS),
                         "d_ff": Field(INT + NONE, rule=positive_int, expected="a positive integer or null"),
                         "max_len": Field(INT, rule=positive_int, expected=_POS),
                         "window": Field(INT + NONE, rule=positive_int, expected="a positive integer or null"),
                         "cross_attention": Field(BOOL),
                         "d_latent": Field(INT + NONE, rule=positive_int, expected="a positive integer or null"),
                         "rope_base": Field(FLOAT, rule=positive_finite, expected="a finite number > 0"),
                         "dropout": Field(FLOAT, rule=probability, expected="a number in [0, 1)"),
                         "tie_embeddings": Field(BOOL)})

#: a Trainer checkpoint's config and extra (``Trainer.save``; the version is the extra's "format")
TRAINER_CONFIG = Schema("Trainer checkpoint config", fields={
    "modules": Field(LIST, rule=strings, expected="a list of module names"), "optimizer": Field(STR),
    "clip_norm": Field(FLOAT + NONE), "batch_size": Field(INT + NONE, rule=positive_int),
    "objective": Field(STR), "seed": Field(INT + NONE), "world_size": Field(INT, rule=positive_int)})
TRAINER_EXTRA = Schema("Trainer checkpoint extra", version="ppl_thought.trainer/1", version_key="format", fields={
    "step_count": Field(INT, rule=nonnegative_int, expected="an integer >= 0"), "history": Field(LIST),
    "optim": Field(DICT), "rng": Field(DICT), "rng_ranks": Field(DICT, required=False)})

#: the config of a saved Result (``save_result``)
RESULT = Schema("saved Result config", version="ppl_thought.result/1", version_key="kind", fields={
    "engine": Field(STR), "tree": Field(ANY_JSON), "vocab": Field(DICT, required=False)})
#: the fields of a saved Result's tree, with the role of each
RESULT_FIELDS = ("samples", "log_weights", "log_marginal", "log_marginal_stderr", "ancestry", "stats", "observed")

#: the attributes ``to_inference_data`` writes on every group that carries them; a netcdf without the version
#: attribute was written before it existed (version 1)
INFERENCE_DATA_VERSION_KEY = "ppl_thought_format"
INFERENCE_DATA = Schema("InferenceData attributes", version="ppl_thought.inference_data/1",
                        version_key=INFERENCE_DATA_VERSION_KEY, legacy=True, fields={})
#: the groups ``to_inference_data`` writes (a netcdf of ours holding others was not written by it)
INFERENCE_DATA_GROUPS = frozenset({"posterior", "posterior_text", "particles", "particles_text", "sample_stats",
                                   "predictions", "predictions_text", "observed_data", "log_likelihood"})
#: the variables a group of ours must hold, with their leading dimensions
INFERENCE_DATA_VARIABLES = {"particles": {"log_weight": ("chain", "draw")}}


__all__ = ["CHECKPOINT", "CHECKPOINT_TENSORS", "INFERENCE_DATA", "INFERENCE_DATA_GROUPS", "INFERENCE_DATA_VARIABLES",
           "RESULT", "RESULT_FIELDS", "TRAINER_CONFIG", "TRAINER_EXTRA", "TRANSFORMER", "VOCAB", "Field", "Schema",
           "check"]
