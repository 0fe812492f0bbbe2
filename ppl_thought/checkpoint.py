"""The checkpoint format, torch-free: one home for both backends (docs/architecture.md, "Rules that keep it right").

A checkpoint is a directory::

    model.<sha>.safetensors   the tensors; tensors that alias one another (tied weights) are stored
                              once and the other names are listed in the metadata entry
                              "ppl_thought.aliases"; <sha> is the first 16 hex digits of its SHA-256
    config.json               {"format", "config", "extra", "tensors": {"file", "sha256"}}

Each file is written to a temporary file in the same directory, fsynced and moved into place with
``os.replace``. The tensors go first, under a name of their own; ``config.json`` is the commit point: it
names the tensors file it belongs to, so overwriting a checkpoint leaves either the old pair or the new
one, whenever the writer is killed.

Readers and writers at once (docs/architecture.md, "Rules that keep it right"):

* writers serialise through the lock file ``.lock`` (``fcntl.flock``, released by the OS when a writer dies);
  the writer holding it removes the temporary files a killed writer left behind;
* after the commit a writer keeps the tensors file the previous config named (a reader that read that
  config a moment before still finds it) and removes older ones;
* a reader reads the tensors file once (the SHA-256 and the tensors come from the same bytes), through one
  descriptor (``open`` with ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat`` and ``read`` on it: no check by path
  is followed by an open by path); when the file its config named is missing, vanished or was replaced
  between these steps, it reads the config again (a newer commit). A problem is the folder's own only when
  two reads in a row see the same config and the same problem; after :data:`READ_RETRIES` reads that each
  met a newer commit, the reader reads once more holding ``.lock`` shared, so no writer commits meanwhile.

Loading never trusts the files: ``config.json`` and the tensors file must be regular files of the folder (a
symlink may not lead out of it), the config is parsed only up to :data:`MAX_JSON_DEPTH` levels, the
tensors file may hold only the metadata this module writes, and an alias may only name a stored tensor
under a name that is not stored itself. Every failure is a :class:`~ppl_thought.errors.CheckpointError`
naming the damage.

This module imports neither torch nor jax: ``ppl_thought.io`` (torch tensors) and
``ppl_thought.numpyro.lm.transformer`` (numpy / jax arrays) both read and write through it, and both
Transformer loaders validate a config against the saved tensors with :func:`check_transformer_config`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ppl_thought import schemas
from ppl_thought.errors import CheckpointError, CheckpointWriteError, MissingCheckpointError, SchemaError

FORMAT = schemas.CHECKPOINT.version  # "ppl_thought.checkpoint/1"
TENSORS_STEM = "model"  # tensors files: model.<sha256[:16]>.safetensors (older checkpoints: model.safetensors)
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")
CONFIG_FILE = "config.json"
ALIASES_KEY = "ppl_thought.aliases"
LOCK_FILE = ".lock"
#: the metadata keys of a tensors file this module writes; any other key is refused on loading
METADATA_KEYS = frozenset({"format", ALIASES_KEY})
#: the deepest nesting of JSON objects and arrays a config may have (deeper: CheckpointError, never a
#: RecursionError); a saved Result's tree uses about 3 levels per nested container
MAX_JSON_DEPTH = 64
#: how many times a reader reads the config and the tensors file it names, each time a writer committed
#: meanwhile, before it reads once more holding the writers' lock shared (:func:`read_checkpoint`)
READ_RETRIES = 8
#: the temporary files of a writer: ``.model.<hex>.tmp``, ``.config.<hex>.tmp.json`` and the ``.tmpXXXXXX`` that
#: safetensors' own writer makes next to its target before renaming it
_TEMP = re.compile(r"\.(model|config)\.[0-9a-f]{16}\.tmp(\.json)?|\.tmp[A-Za-z0-9]{6}")

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
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        raise_write_error(e, target)
        raise
    fsync_directory(target.parent)
    return target


def raise_write_error(e: BaseException, target: Path) -> None:
    """A failed write as a :class:`CheckpointWriteError` naming ``target`` (a full disk, no permission; e.g.
    safetensors' bare "No space left on device"); anything else (an interrupt, a bug) is left to propagate."""
    if isinstance(e, OSError) or "No space left" in str(e):
        raise CheckpointWriteError(f"could not write {target}: {e} (the previous file is left as it was)") from e


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(text: str | bytes) -> int:
    """The deepest nesting of objects and arrays in the JSON ``text``, found without parsing it (strings are
    cut out first, then the brackets counted), so that a deeply nested file cannot exhaust the stack."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    raw = _STRINGS.sub(b'""', raw)
    codes = np.frombuffer(raw, dtype=np.uint8)
    step = (np.isin(codes, (ord("["), ord("{"))).astype(np.int64)
            - np.isin(codes, (ord("]"), ord("}"))).astype(np.int64))
    return int(np.cumsum(step).max()) if step.size else 0


def parse_json(text: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH):
    """``json.loads(text)`` for a file read from disk: :class:`CheckpointError` naming ``what`` for text that
    is not JSON or is nested deeper than ``max_depth`` (checked before parsing)."""
    depth = json_depth(text)
    if depth > max_depth:
        raise CheckpointError(f"{what} is nested {depth} levels deep, more than the {max_depth} a checkpoint "
                              "may have (a damaged or hostile file)")
    try:
        return json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{what} is not valid JSON: {e}"[:300]) from None


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
    depth = json_depth(json.dumps(header))  # fails early (TypeError) on anything JSON cannot hold
    if depth > MAX_JSON_DEPTH - 2:
        raise CheckpointError(f"the config and extra of {path} are nested {depth} levels deep: a checkpoint "
                              f"holds at most {MAX_JSON_DEPTH - 2} (loading would refuse it)")
    path.mkdir(parents=True, exist_ok=True)

    metadata = {"format": "pt", ALIASES_KEY: json.dumps(dict(aliases), sort_keys=True)}
    with writer_lock(path):
        remove_temporary_files(path)  # left by a writer killed before its commit (we hold the lock)
        previous = _committed_tensors_file(path)
        tmp = path / f".{TENSORS_STEM}.{secrets.token_hex(8)}.tmp"
        try:
            write_tensors(str(tmp), metadata)
            fsync_file(tmp)
            digest = sha256(tmp)
            name = f"{TENSORS_STEM}.{digest[:16]}.safetensors"
            os.replace(tmp, path / name)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            raise_write_error(e, path)
            raise
        fsync_directory(path)
        header["tensors"] = {"file": name, "sha256": digest}
        text = json.dumps(header, indent=2, sort_keys=True) + "\n"
        atomic_write(path / CONFIG_FILE, lambda t: Path(t).write_text(text, encoding="utf-8"))  # the commit
        # keep the file the previous config named: a reader that read that config just before the commit
        # still finds its tensors; anything older no config names any more
        for stale in path.glob(f"{TENSORS_STEM}*.safetensors"):
            if stale.name not in (name, previous):
                stale.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def writer_lock(path: Path) -> Iterator[None]:
    """Hold the folder's lock file (``fcntl.flock``, exclusive) while writing: two writers of one folder take
    turns; the OS releases the lock of a writer that is killed. Where ``fcntl`` is missing (Windows) writers
    are not serialised."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - POSIX only
        yield
        return
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def remove_temporary_files(path: Path) -> list[str]:
    """Remove the temporary files of writers killed mid-write (call it holding :func:`writer_lock`: no live
    writer has one then). Returns their names."""
    removed = []
    for f in path.iterdir():
        if _TEMP.fullmatch(f.name):
            f.unlink(missing_ok=True)
            removed.append(f.name)
    return removed


def _committed_tensors_file(path: Path) -> str | None:
    """The tensors file name the current config names (None if there is no readable one)."""
    try:
        header = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
        name = header["tensors"]["file"]
    except Exception:  # noqa: BLE001 - a damaged or missing config names nothing worth keeping
        return None
    return name if isinstance(name, str) and SAFE_NAME.fullmatch(name) else None


#: how a loader opens a checkpoint's files: without following a link (a link is resolved and checked
#: first, see :func:`_read_file`) and without blocking on a FIFO (refused by ``fstat`` before any read)
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
#: the errno of ``open(O_NOFOLLOW)`` on a symlink (ELOOP on Linux and macOS, EMLINK on FreeBSD)
_LINK_ERRNOS = frozenset({errno.ELOOP, errno.EMLINK})


class _Gone(Exception):
    """The file is missing, or vanished or was replaced between two steps of opening it: a writer may have
    committed meanwhile, so the caller reads the config (the commit point) again."""


class _NotRegular(Exception):
    """A folder, a FIFO, a socket or a device at the file's name (never read: a FIFO would block forever)."""


def _link_target(path: Path, file: Path, what: str) -> Path:
    """Where the link ``file`` leads, if that is a file directly inside the folder ``path``: a link out of the
    folder or a loop is a :class:`CheckpointError`, a dangling (or vanished) link is :class:`_Gone`."""
    try:
        real, folder = file.resolve(strict=True), path.resolve(strict=True)
    except FileNotFoundError:
        raise _Gone from None
    except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before Python 3.13, OSError after)
        raise CheckpointError(f"{file} ({what}) is a link that cannot be resolved: {e}"[:300]) from None
    if real.parent != folder:
        raise CheckpointError(f"{file} ({what}) is a link to {real}, outside the checkpoint folder {folder}: "
                              "refused (a checkpoint's files live in its folder)")
    return real


def _read_file(path: Path, file: Path, what: str) -> bytes:
    """The bytes of ``file``, a regular file directly in the folder ``path`` or a link to one in it.

    Read through one descriptor, so that a writer replacing the file cannot slip in between a check and a
    read: ``open`` with ``O_NOFOLLOW | O_NONBLOCK`` (a link is resolved and checked by :func:`_link_target`,
    then its target opened the same way), ``fstat`` of that descriptor (refuses a folder or a FIFO before
    reading), ``read`` from it (the bytes of the file that was opened, even if it is replaced or removed
    meanwhile: writers never change a file in place). Raises :class:`_Gone` when the file is missing or
    vanished between these steps, :class:`_NotRegular` for a file that is no regular file, and
    :class:`CheckpointError` for a link out of the folder or a file that cannot be read.
    """
    target = file
    if not getattr(os, "O_NOFOLLOW", 0) and file.is_symlink():  # pragma: no cover - platforms without it
        target = _link_target(path, file, what)
    for hop in range(2):  # the name itself, then (a link inside the folder) its target
        try:
            fd = os.open(target, _OPEN_FLAGS)
        except (FileNotFoundError, NotADirectoryError):  # no such file, or the folder is no folder (any more)
            raise _Gone from None
        except OSError as e:
            if e.errno not in _LINK_ERRNOS:
                raise CheckpointError(f"{file} ({what}) cannot be read: {e}"[:300]) from None
            if hop:  # the link's target became a link itself since it was resolved: replaced meanwhile
                raise _Gone from None
            target = _link_target(path, file, what)
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _NotRegular
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        except OSError as e:
            raise CheckpointError(f"{file} ({what}) cannot be read: {e}"[:300]) from None
        finally:
            os.close(fd)
    raise _Gone  # pragma: no cover - the loop returns or raises


def read_header(path: str | Path) -> dict:
    """The checked ``config.json`` of a checkpoint directory (clear errors, never a bare KeyError).

    The config is read like the tensors file (:func:`_read_file`: opened once, checked on its descriptor):
    it must be a regular file of the folder or a link to one in it."""
    path = Path(path)
    cfg = path / CONFIG_FILE
    try:
        text = _read_file(path, cfg, "the config")
    except _Gone:
        raise MissingCheckpointError(f"no checkpoint at {path} (missing {CONFIG_FILE})") from None
    except _NotRegular:
        raise CheckpointError(f"{cfg} is not a regular file (a folder, a FIFO or a device): refused without "
                              "reading it") from None
    header = parse_json(text, str(cfg))
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SchemaError(f"{cfg} is not a {FORMAT} checkpoint (its format is "
                          f"{header.get('format') if isinstance(header, dict) else None!r})")
    schemas.check(schemas.CHECKPOINT, header, cfg)  # every key, its type; nothing filled in
    tensors = schemas.check(schemas.CHECKPOINT_TENSORS, header["tensors"], cfg)
    name = tensors["file"]
    if not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise CheckpointError(f"{cfg} names the tensors file {name!r}: it must be a plain file name in the "
                              "checkpoint folder ending in .safetensors")
    return header


@dataclass
class RawCheckpoint:
    """A checkpoint read and checked, its tensors not yet decoded: the config's ``header``, the tensors
    file's bytes (``data``, matching the SHA-256 the config records), the ``{name: (dtype, shape)}`` its
    header lists (stored names only) and the ``{alias: stored name}`` of tied weights."""

    header: dict
    file: Path
    data: bytes
    stored: dict[str, tuple[str, tuple[int, ...]]]
    aliases: dict[str, str]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every name (aliases included) with its shape."""
        out = {k: v[1] for k, v in self.stored.items()}
        out.update({a: self.stored[t][1] for a, t in self.aliases.items()})
        return out

    @property
    def dtypes(self) -> dict[str, str]:
        """Every name (aliases included) with its safetensors dtype (``"F32"``, ``"I64"``, ``"BOOL"``, ...)."""
        out = {k: v[0] for k, v in self.stored.items()}
        out.update({a: self.stored[t][0] for a, t in self.aliases.items()})
        return out


def read_checkpoint(path: str | Path) -> RawCheckpoint:
    """Read a checkpoint folder's config and tensors file once, checked (module docstring): the one reader of
    both backends.

    Racing writers never make it fail: when the tensors file the config named is missing, vanished or was
    replaced while being opened, or does not match the config's SHA-256, the config (the commit point) is
    read again and the file it names then. A problem is the folder's own (a :class:`CheckpointError` naming
    the file) only when two reads in a row find the same config and the same problem. After
    :data:`READ_RETRIES` reads that each found a newer commit, the last read holds the writers' lock
    (``.lock``, shared), so that no writer commits while it reads."""
    path = Path(path)
    last = None
    for _ in range(READ_RETRIES):
        raw, header, problem = _read_once(path)
        if raw is not None:
            return raw
        if (header, problem) == last:  # the same config twice, with the same problem: not a race
            raise CheckpointError(problem)
        last = header, problem
    with _shared_lock(path) as locked:  # writers commit faster than this reader reads: make them wait
        if locked:
            raw, _, problem = _read_once(path)
            if raw is not None:
                return raw
            raise CheckpointError(problem)
    raise CheckpointError(f"{problem}; {path / CONFIG_FILE} named another tensors file at each of {READ_RETRIES} "
                          f"reads (writers commit faster than it can be read, and the folder has no lock file "
                          f"{LOCK_FILE} to wait on): load it again when no writer is overwriting it")


def _read_once(path: Path) -> tuple[RawCheckpoint | None, dict, str]:
    """``(raw, header, "")`` for a consistent read of the config and the tensors file it names, else
    ``(None, header, problem)`` naming the file and what is wrong with it (missing, vanished, no regular
    file, another SHA-256): the caller decides whether a writer raced it."""
    header = read_header(path)
    tensors_file = path / header["tensors"]["file"]
    try:
        data = _read_file(path, tensors_file, "the tensors file")
    except _Gone:
        return None, header, f"{path / CONFIG_FILE} names {tensors_file.name}, which is missing"
    except _NotRegular:
        return None, header, (f"{tensors_file} is not a regular file (a folder, a FIFO or a device): refused "
                              "without reading it")
    if hashlib.sha256(data).hexdigest() != header["tensors"]["sha256"]:
        return None, header, f"{tensors_file} does not match {path / CONFIG_FILE} (interrupted or mixed write?)"
    stored, aliases = parse_safetensors_header(tensors_file, data)
    return RawCheckpoint(header, tensors_file, data, stored, aliases), header, ""


@contextlib.contextmanager
def _shared_lock(path: Path) -> Iterator[bool]:
    """Hold the folder's lock file shared (``fcntl.flock``) while reading: writers (:func:`writer_lock`,
    exclusive) wait until the read is done. Yields False, holding nothing, where there is no lock file to
    open (a folder copied without it, a read-only one never written here) or no ``fcntl`` (Windows)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - POSIX only
        yield False
        return
    try:
        fd = os.open(path / LOCK_FILE, _OPEN_FLAGS)
    except OSError:
        yield False
        return
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield regular
    finally:
        os.close(fd)  # closing the descriptor releases the lock


_SAFETENSORS_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16",
                                 "F32", "F64", "F8_E4M3", "F8_E5M2"})
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


def parse_safetensors_header(file: Path, data: bytes) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """``({stored name: (dtype, shape)}, {alias: stored name})`` from the header of a safetensors file's bytes.

    Refuses (:class:`CheckpointError`) a header that is not a JSON object of tensor entries, metadata keys
    other than :data:`METADATA_KEYS`, and aliases that are not ``{new name: stored name}``: an alias may not
    shadow a stored tensor (that would rewire one weight to another) nor point at a name that is not stored.
    """
    if len(data) < 8:
        raise CheckpointError(f"{file} is not a safetensors file ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CheckpointError(f"{file} is not a safetensors file (a header of {n} bytes in {len(data)})")
    header = parse_json(data[8:8 + n], f"the header of {file}", max_depth=3)
    if not isinstance(header, dict):
        raise CheckpointError(f"the header of {file} is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"the metadata of {file} is not a map of strings")
    unknown = sorted(set(meta) - METADATA_KEYS)
    if unknown:
        raise CheckpointError(f"{file} holds metadata {unknown[:5]} this library does not write (it writes "
                              f"{sorted(METADATA_KEYS)}): refused")
    stored = {}
    for name, entry in header.items():
        if (not isinstance(entry, dict) or entry.get("dtype") not in _SAFETENSORS_DTYPES
                or not isinstance(entry.get("shape"), list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])):
            raise CheckpointError(f"{file}: the entry of tensor {name!r} is malformed: {str(entry)[:100]}")
        stored[name] = (entry["dtype"], tuple(entry["shape"]))
    try:
        aliases = json.loads(meta.get(ALIASES_KEY, "{}"))
    except ValueError:
        raise CheckpointError(f"{file}: the aliases metadata is not JSON") from None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in aliases.items()):
        raise CheckpointError(f"{file}: the aliases metadata is not a map of names")
    shadow = sorted(a for a in aliases if a in stored)
    if shadow:
        raise CheckpointError(f"{file}: aliases {shadow[:5]} name tensors that are stored themselves: an alias "
                              "would replace one weight by another; refused")
    dangling = sorted(a for a, t in aliases.items() if t not in stored)
    if dangling:
        raise CheckpointError(f"{file}: aliases {dangling[:5]} point at names that are not stored "
                              f"({[aliases[a] for a in dangling[:5]]})")
    return stored, aliases


def checked_tensors_file(path: str | Path) -> tuple[dict, Path]:
    """``(header, tensors file)`` of a checkpoint whose tensors file exists and matches its SHA-256."""
    raw = read_checkpoint(path)
    return raw.header, raw.file


def read_aliases(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """``{alias: stored name}`` from a tensors file's metadata."""
    return json.loads((metadata or {}).get(ALIASES_KEY, "{}"))


def decode_error(file: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{file}: the tensors cannot be decoded: {e}"[:300])


def load_numpy(path: str | Path) -> tuple[dict[str, np.ndarray], object, dict]:
    """Read a checkpoint as numpy arrays, without torch: ``(state, config, extra)``; aliases (tied weights)
    come back as the same array object. Same checks and errors as ``ppl_thought.io.load_checkpoint``."""
    state, raw = load_numpy_raw(path)
    return state, raw.header["config"], raw.header["extra"]


def load_numpy_raw(path: str | Path) -> tuple[dict[str, np.ndarray], RawCheckpoint]:
    """``(state, raw)``: :func:`load_numpy` with the :class:`RawCheckpoint` (dtypes, aliases) it read."""
    from safetensors.numpy import load as load_bytes

    raw = read_checkpoint(path)
    try:
        state = load_bytes(raw.data)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors on a damaged file: name the file
        raise decode_error(raw.file, e) from None
    for name, target in raw.aliases.items():
        state[name] = state[target]
    return state, raw


def check_finite(path, nonfinite: list[str], allow_nonfinite: bool) -> None:
    """Refuse weights with NaN or inf (``nonfinite``: their names) unless ``allow_nonfinite`` (for debugging)."""
    if nonfinite and not allow_nonfinite:
        raise CheckpointError(f"{path}: tensors {sorted(nonfinite)[:5]} hold NaN or inf values; a model with "
                              "them computes NaN probabilities (load with allow_nonfinite=True to inspect them)")


def check_float_dtypes(path, dtypes: Mapping[str, str]) -> None:
    """Refuse weights whose stored dtype is not a float type (int64 or bool weights would be cast silently)."""
    bad = sorted(k for k, d in dtypes.items() if d not in FLOAT_DTYPES)
    if bad:
        raise CheckpointError(f"{path}: tensors {bad[:5]} are stored as {[dtypes[k] for k in bad[:5]]}, not as "
                              f"a float type ({sorted(FLOAT_DTYPES)}): refused, not cast")


def save_numpy(path: str | Path, state: Mapping[str, np.ndarray], config, extra: dict | None = None,
               aliases: Mapping[str, str] | None = None) -> Path:
    """Write numpy arrays as a checkpoint (the torch side loads it with ``ppl_thought.io.load_checkpoint``);
    the names in ``aliases`` are not stored but point at their target."""
    from safetensors.numpy import save_file

    aliases = dict(aliases or {})
    tensors = {k: np.ascontiguousarray(v) for k, v in state.items() if k not in aliases}
    return write_checkpoint(path, lambda file, metadata: save_file(tensors, file, metadata=metadata),
                            aliases, config, extra)
