"""The checkpoint format, torch-free: one home for both backends (docs/architecture.md, "Rules that keep it right").

A checkpoint is a directory::

    model.<sha>.safetensors   the tensors; tensors that alias one another (tied weights) are stored
                              once and the other names are listed in the metadata entry
                              "ppl_thought.aliases"; <sha> is the first 16 hex digits of its SHA-256
    config.json               {"format", "config", "extra", "tensors": {"file", "sha256"}}

Each file is written to a temporary file in the same directory, fsynced and moved into place with
``os.replace``. The tensors go first, under a name of their own; ``config.json`` is the commit point: it
names the tensors file it belongs to, so overwriting a checkpoint leaves either the old pair or the new
one, whenever the writer is killed. Tensors files no config names are removed after the commit.
Loading checks the config (a plain file name inside the folder, every key present) and the SHA-256.

This module imports neither torch nor jax: ``ppl_thought.io`` (torch tensors) and
``ppl_thought.numpyro.lm.transformer`` (numpy / jax arrays) both read and write through it, and both
Transformer loaders validate a config against the saved tensors with :func:`check_transformer_config`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ppl_thought.errors import CheckpointError, MissingCheckpointError

FORMAT = "ppl_thought.checkpoint/1"
TENSORS_STEM = "model"  # tensors files: model.<sha256[:16]>.safetensors (older checkpoints: model.safetensors)
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")
CONFIG_FILE = "config.json"
ALIASES_KEY = "ppl_thought.aliases"

# ------------------------------------------------------------------------------------------- files


def fsync_file(file: str | Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
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


def sha256(file: str | Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write(target: str | Path, write: Callable[[str], object]) -> Path:
    """``write(tmp)`` into a temporary file next to ``target`` (same suffix, for writers that choose a format
    by it), fsync it, then ``os.replace`` it in: readers see the old file or the new one, never a torn one."""
    target = Path(target)
    tmp = target.with_name(f".{target.stem}.{secrets.token_hex(8)}.tmp{target.suffix}")
    try:
        write(str(tmp))
        fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
    return target


def atomic_write_json(target: str | Path, obj, default=None) -> Path:
    """``obj`` as indented JSON at ``target``, atomically (:func:`atomic_write`)."""
    text = json.dumps(obj, indent=2, default=default) + "\n"
    return atomic_write(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


# ------------------------------------------------------------------------------------ the format


def write_checkpoint(path: str | Path, write_tensors: Callable[[str, dict[str, str]], object],
                     aliases: Mapping[str, str], config, extra: dict | None = None) -> Path:
    """Write a checkpoint directory: ``write_tensors(file, metadata)`` writes the safetensors file (torch or
    numpy, whichever framework holds the tensors), ``aliases`` maps each tied name to the stored one.

    ``config`` and ``extra`` must be JSON-serialisable (checked before anything is written).
    """
    path = Path(path)
    header = {"format": FORMAT, "config": config, "extra": extra if extra is not None else {}}
    json.dumps(header)  # fail early (TypeError) on anything JSON cannot hold
    path.mkdir(parents=True, exist_ok=True)

    metadata = {"format": "pt", ALIASES_KEY: json.dumps(dict(aliases), sort_keys=True)}
    tmp = path / f".{TENSORS_STEM}.{secrets.token_hex(8)}.tmp"
    try:
        write_tensors(str(tmp), metadata)
        fsync_file(tmp)
        digest = sha256(tmp)
        name = f"{TENSORS_STEM}.{digest[:16]}.safetensors"
        os.replace(tmp, path / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path)
    header["tensors"] = {"file": name, "sha256": digest}
    text = json.dumps(header, indent=2, sort_keys=True) + "\n"
    atomic_write(path / CONFIG_FILE, lambda t: Path(t).write_text(text, encoding="utf-8"))  # the commit
    for stale in path.glob(f"{TENSORS_STEM}*.safetensors"):
        if stale.name != name:
            stale.unlink(missing_ok=True)
    return path


def read_header(path: str | Path) -> dict:
    """The checked ``config.json`` of a checkpoint directory (clear errors, never a bare KeyError)."""
    path = Path(path)
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
    if not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise CheckpointError(f"{cfg} names the tensors file {name!r}: it must be a plain file name in the "
                              "checkpoint folder ending in .safetensors")
    return header


def checked_tensors_file(path: str | Path) -> tuple[dict, Path]:
    """``(header, tensors file)`` of a checkpoint whose tensors file exists and matches its SHA-256."""
    path = Path(path)
    header = read_header(path)
    tensors_file = path / header["tensors"]["file"]
    if not tensors_file.is_file():
        raise CheckpointError(f"{path / CONFIG_FILE} names {tensors_file.name}, which is missing")
    if sha256(tensors_file) != header["tensors"]["sha256"]:
        raise CheckpointError(f"{tensors_file} does not match {path / CONFIG_FILE} (interrupted or mixed write?)")
    return header, tensors_file


def read_aliases(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """``{alias: stored name}`` from a tensors file's metadata."""
    return json.loads((metadata or {}).get(ALIASES_KEY, "{}"))


def load_numpy(path: str | Path) -> tuple[dict[str, np.ndarray], object, dict]:
    """Read a checkpoint as numpy arrays, without torch: ``(state, config, extra)``; aliases (tied weights)
    come back as the same array object. Same checks and errors as ``ppl_thought.io.load_checkpoint``."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    header, tensors_file = checked_tensors_file(path)
    state = load_file(str(tensors_file))
    with safe_open(str(tensors_file), framework="np") as f:
        aliases = read_aliases(f.metadata())
    for name, target in aliases.items():
        state[name] = state[target]
    return state, header["config"], header["extra"]


def save_numpy(path: str | Path, state: Mapping[str, np.ndarray], config, extra: dict | None = None,
               aliases: Mapping[str, str] | None = None) -> Path:
    """Write numpy arrays as a checkpoint (the torch side loads it with ``ppl_thought.io.load_checkpoint``);
    the names in ``aliases`` are not stored but point at their target."""
    from safetensors.numpy import save_file

    aliases = dict(aliases or {})
    tensors = {k: np.ascontiguousarray(v) for k, v in state.items() if k not in aliases}
    return write_checkpoint(path, lambda file, metadata: save_file(tensors, file, metadata=metadata),
                            aliases, config, extra)


# -------------------------------------------------------------------------- Transformer checkpoints

#: the constructor arguments of both Transformers (``pt.lm.Transformer`` and ``ptn.lm.Transformer``), with
#: their defaults: the keys a Transformer checkpoint's config may hold besides "class" and "vocab"
TRANSFORMER_ARGS: dict[str, object] = {
    "vocab_size": None, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": None, "max_len": 2048,
    "window": None, "cross_attention": False, "d_latent": None, "rope_base": 10000.0, "dropout": 0.0,
    "tie_embeddings": True,
}


def transformer_sizes(config: Mapping) -> dict:
    """Every constructor argument (defaults filled in, ``d_ff`` and ``d_latent`` resolved) of a Transformer
    config, checked the way the constructor checks them: ``ValueError`` naming the problem."""
    c = {**TRANSFORMER_ARGS, **config}
    if c["vocab_size"] is None:
        raise ValueError("vocab_size is required")
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
        if isinstance(c[k], bool) or not isinstance(c[k], int) or c[k] < 1:
            raise ValueError(f"{k}={c[k]!r} is not a positive integer")
    if c["d_model"] % c["n_heads"] or (c["d_model"] // c["n_heads"]) % 2:
        raise ValueError(f"d_model / n_heads must be an even integer (RoPE), got {c['d_model']} / {c['n_heads']}")
    if c["window"] is not None and (not isinstance(c["window"], int) or c["window"] < 1):
        raise ValueError(f"window must be >= 1, got {c['window']!r}")
    if c["d_latent"] is not None and not c["cross_attention"]:
        raise ValueError("d_latent is only used with cross_attention=True")
    c["d_ff"] = c["d_ff"] if c["d_ff"] is not None else 8 * math.ceil(8 * c["d_model"] / 3 / 8)
    c["d_latent"] = (c["d_latent"] or c["d_model"]) if c["cross_attention"] else None
    c["cross_attention"], c["tie_embeddings"] = bool(c["cross_attention"]), bool(c["tie_embeddings"])
    c["rope_base"], c["dropout"] = float(c["rope_base"]), float(c["dropout"])
    return c


def transformer_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """The state-dict names and shapes of a Transformer (torch naming, ``Linear`` weights ``[out, in]``).

    The one description of the tensors of a Transformer checkpoint: ``ptn.lm.Transformer`` reads its
    parameters by these names, and a test checks them against ``pt.lm.Transformer.state_dict()``."""
    c = transformer_sizes(config)
    D, F, V = c["d_model"], c["d_ff"], c["vocab_size"]
    shapes = {"embed.weight": (V, D)}
    for i in range(c["n_layers"]):
        b = f"blocks.{i}."
        shapes.update({b + "attn_norm.weight": (D,), b + "attn.qkv.weight": (3 * D, D), b + "attn.out.weight": (D, D)})
        if c["cross_attention"]:
            shapes.update({b + "cross_norm.weight": (D,), b + "cross.q.weight": (D, D),
                           b + "cross.kv.weight": (2 * D, c["d_latent"]), b + "cross.out.weight": (D, D)})
        shapes.update({b + "mlp_norm.weight": (D,), b + "mlp.gate_up.weight": (2 * F, D),
                       b + "mlp.down.weight": (D, F)})
    shapes.update({"norm.weight": (D,), "lm_head.weight": (V, D)})
    return shapes


def check_transformer_config(path, config, saved: Mapping[str, tuple[int, ...]]) -> dict:
    """The constructor arguments of a Transformer checkpoint, checked against the saved tensor shapes.

    A config that does not describe the saved tensors (keys that are no constructor argument, sizes that
    are not positive integers, another depth, width or tensor shape than saved) raises
    :class:`~ppl_thought.errors.CheckpointError` naming it, before anything is allocated. Shared by the
    torch and the JAX loader: the same checkpoint is accepted or refused, with the same message, by both.
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: the config of a Transformer checkpoint is a JSON object, got {config!r}")
    config = dict(config)
    config.pop("vocab", None)
    if config.pop("class", "Transformer") != "Transformer":
        raise CheckpointError(f"{path} is not a Transformer checkpoint")
    unknown = sorted(set(config) - set(TRANSFORMER_ARGS))
    if unknown or "vocab_size" not in config:
        raise CheckpointError(f"{path}: the config " + (f"has keys {unknown} that are not Transformer arguments"
                                                         if unknown else "lacks vocab_size"))
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
        v = config.get(k, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointError(f"{path}: config {k}={v!r} is not a positive integer")
    # depth and width from the tensors first: a corrupted n_layers would describe that many blocks
    blocks = {k.split(".")[1] for k in saved if k.startswith("blocks.")}
    embed = saved.get("embed.weight")
    want = (config["vocab_size"], config.get("d_model", TRANSFORMER_ARGS["d_model"]))
    n_layers = config.get("n_layers", TRANSFORMER_ARGS["n_layers"])
    if len(blocks) != n_layers or embed is None or tuple(embed) != want:
        raise CheckpointError(
            f"{path}: the config (n_layers={n_layers}, vocab_size, d_model = {want}) does not "
            f"describe the saved tensors ({len(blocks)} blocks, embed.weight "
            f"{None if embed is None else tuple(embed)})")
    try:
        expected = transformer_shapes(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: the config cannot build a Transformer: {e}") from None
    saved = {k: tuple(v) for k, v in saved.items()}
    if expected != saved:
        bad = sorted(set(expected) ^ set(saved)) + sorted(k for k in set(expected) & set(saved)
                                                          if expected[k] != saved[k])
        raise CheckpointError(f"{path}: the saved tensors do not match the config (missing, unexpected or "
                              f"of another shape: {bad[:5]})")
    return config
