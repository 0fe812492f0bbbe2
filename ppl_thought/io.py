"""Checkpoints: safetensors for tensors, JSON for the config, atomic writes, no pickle (ARCHITECTURE.md).

A checkpoint is a directory::

    model.<sha>.safetensors   the state dict; tensors that alias one another (tied weights) are stored
                              once and the other names are listed in the metadata entry
                              "ppl_thought.aliases"; <sha> is the first 16 hex digits of its SHA-256
    config.json               {"format", "config", "extra", "tensors": {"file", "sha256"}}

Each file is written to a temporary file in the same directory, fsynced and moved into place with
``os.replace``. The tensors go first, under a name of their own; ``config.json`` is the commit point: it
names the tensors file it belongs to, so overwriting a checkpoint leaves either the old pair or the new
one, whenever the writer is killed. Tensors files no config names are removed after the commit.
Loading checks the config (a plain file name inside the folder, every key present) and the SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ppl_thought.errors import CheckpointError, MissingCheckpointError

FORMAT = "ppl_thought.checkpoint/1"
TENSORS_STEM = "model"  # tensors files: model.<sha256[:16]>.safetensors (older checkpoints: model.safetensors)
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")
CONFIG_FILE = "config.json"
_ALIASES_KEY = "ppl_thought.aliases"


def save_checkpoint(path: str | Path, module: torch.nn.Module | Mapping[str, torch.Tensor], config: dict,
                    extra: dict | None = None) -> Path:
    """Write ``module.state_dict()`` (or a dict of tensors), ``config`` and ``extra`` to directory ``path``.

    ``config`` and ``extra`` must be JSON-serialisable (checked before anything is written).
    Returns the checkpoint directory.
    """
    path = Path(path)
    state = module.state_dict() if isinstance(module, torch.nn.Module) else dict(module)
    tensors, aliases = _unshared(state)
    header = {"format": FORMAT, "config": config, "extra": extra if extra is not None else {}}
    json.dumps(header)  # fail early (TypeError) on anything JSON cannot hold
    path.mkdir(parents=True, exist_ok=True)

    metadata = {"format": "pt", _ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
    tmp = path / f".{TENSORS_STEM}.{secrets.token_hex(8)}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        _fsync_file(tmp)
        digest = _sha256(tmp)
        name = f"{TENSORS_STEM}.{digest[:16]}.safetensors"
        os.replace(tmp, path / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path)
    header["tensors"] = {"file": name, "sha256": digest}
    text = json.dumps(header, indent=2, sort_keys=True) + "\n"
    atomic_write(path / CONFIG_FILE, lambda t: Path(t).write_text(text, encoding="utf-8"))  # the commit
    for stale in path.glob(f"{TENSORS_STEM}*.safetensors"):
        if stale.name != name:
            stale.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[dict, dict, dict]:
    """Read a checkpoint written by ``save_checkpoint``: ``(state_dict, config, extra)``.

    Aliased names (tied weights) come back as the same tensor object. Raises ``ValueError`` if the
    directory holds no checkpoint of this format or the tensors file does not match the config.
    """
    path = Path(path)
    header = _read_header(path)
    tensors_file = path / header["tensors"]["file"]
    if not tensors_file.is_file():
        raise CheckpointError(f"{path / CONFIG_FILE} names {tensors_file.name}, which is missing")
    if _sha256(tensors_file) != header["tensors"]["sha256"]:
        raise CheckpointError(f"{tensors_file} does not match {path / CONFIG_FILE} (interrupted or mixed write?)")

    state = load_file(tensors_file, device=str(device))
    with safe_open(tensors_file, framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    for name, target in aliases.items():
        state[name] = state[target]
    return state, header["config"], header["extra"]


def _read_header(path: Path) -> dict:
    """The checked ``config.json`` of a checkpoint directory (clear errors, never a bare KeyError)."""
    cfg = path / CONFIG_FILE
    if not cfg.is_file():
        raise MissingCheckpointError(f"no checkpoint at {path} (missing {CONFIG_FILE})")
    try:
        header = json.loads(cfg.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg} is not valid JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"{cfg} is not a {FORMAT} checkpoint")
    missing = [k for k in ("config", "extra", "tensors") if k not in header]
    tensors = header.get("tensors")
    if not missing and isinstance(tensors, dict):
        missing = [f"tensors.{k}" for k in ("file", "sha256") if not isinstance(tensors.get(k), str)]
    elif not missing:
        missing = ["tensors"]
    if missing:
        raise CheckpointError(f"{cfg} lacks {', '.join(missing)}")
    name = tensors["file"]
    if not _SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise CheckpointError(f"{cfg} names the tensors file {name!r}: it must be a plain file name in the "
                              "checkpoint folder ending in .safetensors")
    return header


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


def _fsync_file(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(target: str | Path, write: Callable[[str], object]) -> Path:
    """``write(tmp)`` into a temporary file next to ``target`` (same suffix, for writers that choose a format
    by it), fsync it, then ``os.replace`` it in: readers see the old file or the new one, never a torn one."""
    target = Path(target)
    tmp = target.with_name(f".{target.stem}.{secrets.token_hex(8)}.tmp{target.suffix}")
    try:
        write(str(tmp))
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(target.parent)
    return target


def atomic_write_json(target: str | Path, obj, default=None) -> Path:
    """``obj`` as indented JSON at ``target``, atomically (:func:`atomic_write`)."""
    text = json.dumps(obj, indent=2, default=default) + "\n"
    return atomic_write(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
