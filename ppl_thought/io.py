"""Checkpoints of torch tensors: safetensors for tensors, JSON for the config, atomic writes, no pickle
(docs/architecture.md). The format itself (layout, atomic commit, SHA-256 and config checks) lives in the
torch-free :mod:`ppl_thought.checkpoint`, shared with the JAX backend; this module adds torch tensors.

A checkpoint is a directory::

    model.<sha>.safetensors   the state dict; tensors that alias one another (tied weights) are stored
                              once and the other names are listed in the metadata entry
                              "ppl_thought.aliases"; <sha> is the first 16 hex digits of its SHA-256
    config.json               {"format", "config", "extra", "tensors": {"file", "sha256"}}
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from ppl_thought import checks
from ppl_thought.checkpoint import (  # noqa: F401  (re-exported: the historical home of these names)
    CONFIG_FILE,
    FORMAT,
    TENSORS_STEM,
    RawCheckpoint,
    atomic_write,
    atomic_write_json,
    checked_tensors_file,
    decode_error,
    read_aliases,
    read_checkpoint,
    write_checkpoint,
)
from ppl_thought.errors import ArgumentTypeError, CheckpointError, ConfigError
from ppl_thought.validation import checked

__all__ = ["load_checkpoint", "load_checkpoint_raw", "nonfinite_names", "save_checkpoint"]


@checked
def save_checkpoint(path: str | os.PathLike, module: torch.nn.Module | Mapping[str, torch.Tensor], config: dict,
                    extra: dict | None = None) -> Path:
    """Write ``module.state_dict()`` (or a dict of tensors), ``config`` and ``extra`` to directory ``path``.

    ``config`` and ``extra`` must be JSON-serialisable and every value of the state a tensor with a string name
    (checked before anything is written: a :class:`~ppl_thought.errors.ConfigError` naming the argument, an
    :class:`~ppl_thought.errors.ArgumentTypeError`, also a ``TypeError``, for what JSON cannot hold).
    Returns the checkpoint directory.
    """
    path = checks.path("path", path)
    for name, value in (("config", config), ("extra", extra)):
        try:
            json.dumps(value)
        except (TypeError, ValueError, RecursionError) as e:
            raise ArgumentTypeError(f"save_checkpoint: {name} must be JSON-serialisable (a dict of numbers, "
                                    f"strings, lists and dicts), got {type(value).__name__} ({type(e).__name__}: "
                                    f"{e})"[:300]) from None
    state = module.state_dict() if isinstance(module, torch.nn.Module) else dict(module)
    _check_state(state, "save_checkpoint: module")
    tensors, aliases = _unshared(state)
    # save_file is looked up at call time (tests replace it to simulate a crash mid-write)
    return write_checkpoint(path, lambda file, metadata: save_file(tensors, file, metadata=metadata),
                            aliases, config, extra)


@checked
def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[dict, dict, dict]:
    """Read a checkpoint written by ``save_checkpoint``: ``(state_dict, config, extra)``.

    Aliased names (tied weights) come back as the same tensor object. Raises ``CheckpointError`` if the
    directory holds no checkpoint of this format, the tensors file does not match the config, or any of the
    checks of :func:`ppl_thought.checkpoint.read_checkpoint` fails (links out of the folder, unknown metadata,
    aliases that shadow a stored tensor, a config nested too deep).
    """
    state, raw = load_checkpoint_raw(path, device)
    return state, raw.header["config"], raw.header["extra"]


@checked
def load_checkpoint_raw(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[dict, RawCheckpoint]:
    """``(state_dict, raw)``: :func:`load_checkpoint` with the :class:`~ppl_thought.checkpoint.RawCheckpoint`
    it read (stored dtypes, aliases), for loaders that check more (``Transformer.load``, ``Trainer.load``)."""
    try:
        path = checks.path("path", path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    raw = read_checkpoint(path)
    try:
        state = load_bytes(raw.data)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors on a damaged file: name the file
        raise decode_error(raw.file, e) from None
    if str(device) != "cpu":
        state = {k: v.to(device) for k, v in state.items()}
    for name, target in raw.aliases.items():
        state[name] = state[target]
    return state, raw


@checked
def nonfinite_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating tensors in ``state`` holding NaN or inf (one check per tensor, at load time).
    A ``state`` that is not a mapping of names to tensors: :class:`~ppl_thought.errors.ConfigError`."""
    _check_state(state, "nonfinite_names: state")
    return [k for k, v in state.items() if v.is_floating_point() and v.numel() and not bool(torch.isfinite(v).all())]


def _check_state(state, what: str) -> None:
    """Refuse a state that is not a mapping of string names to tensors, naming the first bad entry."""
    if not isinstance(state, Mapping):
        raise ArgumentTypeError(f"{what} must be a torch.nn.Module or a mapping of names to tensors, got "
                                f"{type(state).__name__} {state!r}"[:300])
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ArgumentTypeError(f"{what} must map string names to tensors, got the entry {key!r}: "
                                    f"{type(value).__name__} {value!r}"[:300])


def _unshared(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors accepts (contiguous, no shared memory) plus ``{alias: stored name}``.

    A name whose tensor is exactly another's (same memory, shape and strides: tied weights) becomes an
    alias; tensors that merely overlap in memory are copied.
    """
    tensors, aliases, seen = {}, {}, {}
    for name, t in state.items():
        t = t.detach()
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t.shape, t.stride())
        if t.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t
    owners = Counter((t.device, t.untyped_storage().data_ptr()) for t in tensors.values() if t.numel())
    for name, t in tensors.items():
        shared = t.numel() and owners[(t.device, t.untyped_storage().data_ptr())] > 1
        tensors[name] = (t.clone() if shared else t).contiguous().cpu()
    return tensors, aliases


