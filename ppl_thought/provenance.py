"""Where a result comes from: the one home of the provenance every result JSON records (issue 42, item 1).

A script that writes a JSON calls :func:`record` when it starts and :func:`finish` when it is done, and stores the
returned dict under the key ``"provenance"`` of its JSON (:func:`stamp` does both steps' bookkeeping)::

    rec = provenance.record([__file__, *argv])      # commit, dirty, command, machine, threads, load, start time
    ...                                             # the run
    out["provenance"] = provenance.finish(rec)      # + seconds and the load at the end

``tools/doc_tables.py`` prints the commit and the command under every table it renders, and
``tests/test_doc_tables.py`` checks that every JSON under ``benchmarks/results`` records them and that the recorded
command still parses with its script's ``argparse`` parser.

This module is in the base layer: it imports no array framework. The torch / JAX versions come from the installed
distributions; the threads and the device are read from torch / JAX only when the running program has imported them.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ROOT", "KEY", "record", "script", "start", "stamped", "finish", "command_line", "source", "machine",
           "load_average", "of"]

#: the checkout this package lives in (the repository root when installed editable)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the key of a result JSON that holds :func:`record`'s dict
KEY = "provenance"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source() -> dict:
    """``{"commit", "dirty"}``: the git commit of the package's checkout (None outside a git checkout) and whether
    the package's tracked files (``ppl_thought/``, ``benchmarks/`` but its ``results/``, ``examples/``) have
    uncommitted changes: the code that runs, not the docs or the results it writes."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", "--", "ppl_thought", "benchmarks", "examples",
                  ":(exclude)benchmarks/results")  # the results a run writes are not the code that ran
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")  # never imported here: the base layer imports no array framework
    return torch.get_num_threads() if torch is not None else None


def _device() -> str:
    """The accelerator the run could use: CUDA's device name when torch sees one, JAX's backend when JAX is loaded,
    else ``cpu``."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return f"cuda ({torch.cuda.get_device_name(0)})"
    except Exception:  # noqa: BLE001 - a broken CUDA install: the run is on the CPU
        pass
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            backend = jax.default_backend()
            if backend != "cpu":
                return f"jax {backend}"
        except Exception:  # noqa: BLE001
            pass
    return "cpu"


def machine() -> dict:
    """The machine: CPU model, the cores this process may use (``nproc``) and the machine's (``cpu_count``), the
    platform, the Python, torch and JAX versions, torch's threads (when torch is loaded) and the device."""
    return {"processor": _cpu_model(), "nproc": _cores(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": _version("torch"), "jax": _version("jax"),
            "torch_threads": _torch_threads(), "device": _device()}


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none): times are read with it."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def command_line(command: Sequence[str] | str) -> str:
    """The command as a user retypes it from the repository root. A string is kept as it is; a sequence is
    ``argv``-like, its first item the program: a file of this package becomes ``python -m ppl_thought.x.y``, another
    file under the checkout ``python its/relative/path.py``, the installed ``ppl-thought`` script ``ppl-thought``."""
    if isinstance(command, str):
        return command
    prog, *args = [str(a) for a in command] or [""]
    full = os.path.abspath(prog) if prog else ""
    package = os.path.join(ROOT, "ppl_thought") + os.sep
    if os.path.basename(prog) == "ppl-thought":
        head = ["ppl-thought"]
    elif full.startswith(package) and full.endswith(".py"):
        module = os.path.relpath(full, ROOT)[:-3].replace(os.sep, ".")
        head = ["python", "-m", module.removesuffix(".__main__")]
    elif full.startswith(ROOT + os.sep):
        head = ["python", os.path.relpath(full, ROOT)]
    else:
        head = [prog]
    return shlex.join(head + args)


def script(file: str, argv: Sequence[str] | None = None) -> list[str]:
    """The ``argv`` of a script's run for :func:`record`: its ``__file__`` and ``argv`` (``sys.argv[1:]`` when None,
    as ``argparse`` reads it)."""
    if argv is None:  # the program as it was started (a wrapper such as examples/real_thoughts.py), else ``file``
        prog = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else file
        return [prog, *sys.argv[1:]]
    return [file, *argv]


def record(command: Sequence[str] | str, threads: int | None = None) -> dict:
    """Provenance at the start of a run: ``commit``, ``dirty``, the exact ``command`` (see :func:`command_line`),
    ``machine`` (:func:`machine`), ``threads`` (the torch threads the run uses; default: torch's current count when
    torch is loaded), ``load_average_at_start``, ``started_at`` (UTC, ISO 8601) and a monotonic clock for
    :func:`finish`. Record at the start: the commit is the code that runs, whatever the checkout becomes meanwhile."""
    m = machine()
    return {**source(), "command": command_line(command), "machine": m,
            "threads": threads if threads is not None else m["torch_threads"],
            "load_average_at_start": load_average(),
            "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "_t0": time.perf_counter(), "_threads_given": threads is not None}


def finish(rec: Mapping[str, Any]) -> dict:
    """:func:`record`'s dict with ``seconds`` (wall time since the record) and ``load_average_at_end`` added (a new
    dict, ready for JSON); ``threads`` is torch's count now unless :func:`record` was given it (a script may set
    its threads after recording)."""
    out = {k: v for k, v in rec.items() if not k.startswith("_")}
    if not rec.get("_threads_given") and _torch_threads() is not None:  # a script that set its threads after
        out["threads"] = _torch_threads()                                # record() ran with these
        out["machine"] = {**out.get("machine", {}), "torch_threads": out["threads"]}
    t0 = rec.get("_t0")
    out["seconds"] = round(time.perf_counter() - t0, 2) if isinstance(t0, (int, float)) else None
    out["load_average_at_end"] = load_average()
    return out


def of(d: Mapping[str, Any]) -> dict:
    """The provenance a result JSON records, wherever it is: its ``"provenance"`` entry, else the keys older writers
    put at the top level or in a ``workload`` / ``meta`` entry (``commit``, ``dirty``, ``command``, ``machine``,
    ``seconds``, ...). Missing keys are absent."""
    keys = ("commit", "dirty", "command", "machine", "threads", "load_average_at_start", "load_average_at_end",
            "started_at", "seconds")
    out: dict = {}
    for place in (d.get("meta"), d.get("workload"), d):
        if isinstance(place, Mapping):
            out.update({k: place[k] for k in keys if k in place and place[k] is not None})
    if isinstance(d.get(KEY), Mapping):
        out.update({k: v for k, v in d[KEY].items() if v is not None})
    return out


def start(file: str, argv: Sequence[str] | None = None, threads: int | None = None) -> dict:
    """``record(script(file, argv), threads)``: the record of a script's run, at its start."""
    return record(script(file, argv), threads)


def stamped(d: Mapping[str, Any], rec: Mapping[str, Any]) -> dict:
    """``d`` with ``"provenance": finish(rec)``: what a script writes as its JSON."""
    return {**d, KEY: finish(rec)}
