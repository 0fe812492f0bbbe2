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

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ppl_thought.checkpoint import (  # noqa: F401  (re-exported: the historical home of these names)
    CONFIG_FILE,
    FORMAT,
    TENSORS_STEM,
    atomic_write,
    atomic_write_json,
    checked_tensors_file,
    read_aliases,
    write_checkpoint,
)


def save_checkpoint(path: str | Path, module: torch.nn.Module | Mapping[str, torch.Tensor], config: dict,
                    extra: dict | None = None) -> Path:
    """Write ``module.state_dict()`` (or a dict of tensors), ``config`` and ``extra`` to directory ``path``.

    ``config`` and ``extra`` must be JSON-serialisable (checked before anything is written).
    Returns the checkpoint directory.
    """
    state = module.state_dict() if isinstance(module, torch.nn.Module) else dict(module)
    tensors, aliases = _unshared(state)
    # save_file is looked up at call time (tests replace it to simulate a crash mid-write)
    return write_checkpoint(path, lambda file, metadata: save_file(tensors, file, metadata=metadata),
                            aliases, config, extra)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[dict, dict, dict]:
    """Read a checkpoint written by ``save_checkpoint``: ``(state_dict, config, extra)``.

    Aliased names (tied weights) come back as the same tensor object. Raises ``CheckpointError`` if the
    directory holds no checkpoint of this format or the tensors file does not match the config.
    """
    header, tensors_file = checked_tensors_file(path)
    state = load_file(tensors_file, device=str(device))
    with safe_open(tensors_file, framework="pt") as f:
        aliases = read_aliases(f.metadata())
    for name, target in aliases.items():
        state[name] = state[target]
    return state, header["config"], header["extra"]


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


