"""Readers and writers of one checkpoint folder at once, with SIGKILLs (issue 32, item 2, the Done-when test).

A reader process loads in a loop while writer processes overwrite the same folder: first one writer at a
time, then two at once, each killed (SIGKILL) at a random moment. Every load either succeeds, with the
tensors of its own config, or raises CheckpointError; after every kill the folder loads; the temporary
files of killed writers are gone after the next write.

At 60fef74 the reader saw a bare FileNotFoundError (the writer removed the tensors file the reader's config
named), two writers killed together could leave the folder unloadable, and temp files piled up.

The processes use the torch-free half of the format (``ppl_thought.checkpoint.save_numpy`` / ``load_numpy``,
the same writer and reader as ``ppl_thought.io``) so that each starts in well under a second; the checks
after each kill load through ``ppl_thought.io`` (torch).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from ppl_thought import io as ptio
from ppl_thought.checkpoint import save_numpy

ROOT = Path(__file__).resolve().parent.parent

# writer: overwrites the folder with {"w": i everywhere, "b": -i} and config {"i": i}, forever
_WRITER = textwrap.dedent("""
    import sys, random
    import numpy as np
    from ppl_thought.checkpoint import save_numpy
    path, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    print("ready", flush=True)
    while True:
        i = rng.randrange(1, 10**6)
        save_numpy(path, {"w": np.full((192, 192), i, np.float32), "b": np.full(7, -i, np.int64)},
                   {"i": i}, aliases={"w_tied": "w"})
""")

# reader: loads in a loop until the file "stop" appears; counts loads that succeed (consistently),
# CheckpointErrors, and others
_READER = textwrap.dedent("""
    import json, os, sys
    from ppl_thought.checkpoint import load_numpy
    from ppl_thought.errors import CheckpointError
    path, stop = sys.argv[1], sys.argv[2]
    counts = {"ok": 0, "checkpoint_error": 0, "inconsistent": 0, "other": 0}
    others = []
    print("ready", flush=True)
    while not os.path.exists(stop):
        try:
            state, config, _ = load_numpy(path)
            i = config["i"]
            good = ((state["w"] == i).all() and (state["b"] == -i).all() and state["w_tied"] is state["w"])
            counts["ok" if good else "inconsistent"] += 1
        except CheckpointError:
            counts["checkpoint_error"] += 1
        except Exception as e:
            counts["other"] += 1
            others.append(f"{type(e).__name__}: {e}"[:200])
    print(json.dumps({**counts, "others": others[:5]}), flush=True)
""")


def _start(script: str, *args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=str(ROOT))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _loads_consistently(path: Path) -> None:
    state, config, _ = ptio.load_checkpoint(path)
    i = config["i"]
    assert bool((state["w"] == i).all()) and bool((state["b"] == -i).all()) and state["w_tied"] is state["w"]


def _temporary_files(path: Path) -> list[str]:
    return sorted(f for f in os.listdir(path) if ".tmp" in f)


def test_readers_and_killed_writers_never_break_the_folder(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "ck"
    save_numpy(path, {"w": np.zeros((192, 192), np.float32), "b": np.zeros(7, np.int64)}, {"i": 0},
               aliases={"w_tied": "w"})
    rounds = 4
    started = time.monotonic()
    stop = tmp_path / "stop"
    reader = _start(_READER, path, stop)
    kills = 0
    # one writer at a time, killed mid-write
    for k in range(rounds):
        w = _start(_WRITER, path, k)
        time.sleep(rng.uniform(0.05, 0.5))
        _kill(w)
        kills += 1
        _loads_consistently(path)
    # two writers at once, killed at independent moments
    for k in range(rounds):
        a, b = _start(_WRITER, path, 100 + k), _start(_WRITER, path, 200 + k)
        time.sleep(rng.uniform(0.05, 0.4))
        _kill(a)
        time.sleep(rng.uniform(0.0, 0.2))
        _kill(b)
        kills += 2
        _loads_consistently(path)
    stop.touch()
    out = json.loads(reader.communicate(timeout=120)[0].strip().splitlines()[-1])
    elapsed = time.monotonic() - started
    print(f"{kills} kills, reader: {out}, {elapsed:.1f} s")
    assert out["other"] == 0 and out["inconsistent"] == 0, out
    assert out["ok"] >= 20, out  # the reader really raced the writers
    # every load succeeded or raised CheckpointError; with the previous tensors file kept and the reader
    # reading a newer config when its file was replaced, none should have failed at all
    assert out["checkpoint_error"] == 0, out
    # the folder loads, and the next write removes what killed writers left behind
    _loads_consistently(path)
    save_numpy(path, {"w": np.full((192, 192), 7, np.float32), "b": np.full(7, -7, np.int64)}, {"i": 7},
               aliases={"w_tied": "w"})
    assert _temporary_files(path) == []
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) <= 2
    _loads_consistently(path)
