"""Readers racing writers of one checkpoint folder, writers killed with SIGKILL: how many loads fail (issue 41, 3).

    python benchmarks/checkpoint_race.py [--loads 50000] [--readers 2] [--seed 0] [--jitter MS] [--dir DIR]
                                        [--json FILE]

Reader processes load one folder in a loop (reader 0 through ``ppl_thought.checkpoint.load_numpy``, reader 1
through the torch loader ``ppl_thought.io.load_checkpoint``, alternating if there are more) until together they
have done ``--loads`` loads, while writer processes overwrite the folder (``save_numpy``, the writer of both
backends) in a tight loop. One writer is always writing; each round either starts a new writer and kills the
oldest at a random moment, or starts two more and kills two of the three at independent moments, or adds a
writer that stops on its own after a few writes (the folder's lock makes writers take turns). Every load must
come back with the tensors of its own config (``w`` filled with the config's ``i``, ``b`` with ``-i``, the alias
``w_tied`` the same array as ``w``): ``failed`` counts the loads that raised anything (``CheckpointError`` included) or
came back inconsistent. Target: 0 failed.

Each reader also counts how often the race was met: ``retried`` loads read the config more than once (the file
it named had vanished, was replaced, or no longer matched), ``locked`` loads fell back to reading under the
writers' lock. At the end the folder must load, and the next write must leave no temporary file behind.

``--jitter MS`` makes each reader pause, before one in 20 of its file system calls (``stat``, ``lstat``, ``open``,
``fstat``, ``read``, ``readlink``, ``io.open``), for a random time (uniform in 0..MS milliseconds), as if it were
preempted at that step: each window between two steps of a load is now and then wide enough for writers to
commit twice in it, so that a race a busy machine meets once in thousands of loads is met far more often.
``--dir`` chooses where the folder lives (default: the system's temporary folder); on a tmpfs such as /dev/shm
writes skip the disk's fsync and writers commit several times more often.

Run it against another checkout with ``PYTHONPATH=<checkout>`` (the JSON records the commit of the code it ran).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from ppl_thought import provenance as pv

# writer: overwrites the folder with {"w": i everywhere, "b": -i} and config {"i": i}, `count` times (0: forever)
_WRITER = textwrap.dedent("""
    import sys, random
    import numpy as np
    from ppl_thought.checkpoint import save_numpy
    path, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    print("ready", flush=True)
    n = 0
    while count == 0 or n < count:
        i = rng.randrange(1, 10**9)
        save_numpy(path, {"w": np.full((96, 96), i, np.float32), "b": np.full(7, -i, np.int64)},
                   {"i": i}, aliases={"w_tied": "w"})
        n += 1
""")

# reader: `quota` loads, each checked against its own config; counts config reads per load (the race met)
_READER = textwrap.dedent("""
    import json, sys, time
    import ppl_thought.checkpoint as ck
    from ppl_thought.errors import CheckpointError
    path, quota, kind, jitter = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    if jitter:  # now and then a pause before a file system call of the reader: a preemption at that step
        import io, os, random
        rng = random.Random(int(sys.argv[5]))
        def jittered(call):
            def wrapped(*args, **kwargs):
                if rng.random() < 0.05:
                    time.sleep(rng.uniform(0.0, jitter))
                return call(*args, **kwargs)
            return wrapped
        for name in ("stat", "lstat", "open", "fstat", "read", "readlink"):
            setattr(os, name, jittered(getattr(os, name)))
        io.open = jittered(io.open)
    if kind == "torch":
        from ppl_thought.io import load_checkpoint
        def load(p):
            state, config, _ = load_checkpoint(p)
            i = config["i"]
            return bool((state["w"] == i).all()) and bool((state["b"] == -i).all()) and state["w_tied"] is state["w"]
    else:
        def load(p):
            state, config, _ = ck.load_numpy(p)
            i = config["i"]
            return bool((state["w"] == i).all()) and bool((state["b"] == -i).all()) and state["w_tied"] is state["w"]
    reads = [0]
    locks = [0]
    read_header = ck.read_header
    def counted_read_header(p):
        reads[0] += 1
        return read_header(p)
    ck.read_header = counted_read_header
    if hasattr(ck, "_shared_lock"):
        shared_lock = ck._shared_lock
        def counted_shared_lock(p):
            locks[0] += 1
            return shared_lock(p)
        ck._shared_lock = counted_shared_lock
    counts = {"ok": 0, "checkpoint_error": 0, "inconsistent": 0, "other": 0, "retried": 0, "locked": 0,
              "max_config_reads": 0}
    errors = []
    print("ready", flush=True)
    sys.stdin.readline()  # "go": every reader and the first writer are running
    started = time.monotonic()
    for _ in range(quota):
        reads[0] = locks[0] = 0
        try:
            counts["ok" if load(path) else "inconsistent"] += 1
        except CheckpointError as e:
            counts["checkpoint_error"] += 1
            errors.append(f"CheckpointError: {e}"[:300])
        except Exception as e:
            counts["other"] += 1
            errors.append(f"{type(e).__name__}: {e}"[:300])
        counts["retried"] += reads[0] > 1
        counts["locked"] += locks[0] > 0
        counts["max_config_reads"] = max(counts["max_config_reads"], reads[0])
    counts["seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps({"kind": kind, "module": ck.__file__, **counts, "errors": errors[:10]}), flush=True)
""")


def _start(script: str, root: Path, path: Path, *args) -> subprocess.Popen:
    """A process running ``script`` on the folder ``path``; it runs the ppl_thought of ``$PYTHONPATH`` (default:
    this checkout), started in the folder's parent so that the current directory puts no other one first."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.setdefault("PYTHONPATH", str(root))
    proc = subprocess.Popen([sys.executable, "-c", script, str(path), *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=str(path.parent))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _commit(root: Path) -> str:
    import ppl_thought

    code = Path(ppl_thought.__file__).resolve().parent.parent  # the checkout the processes run
    try:
        head = subprocess.run(["git", "-C", str(code), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "ppl_thought"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"unknown ({code})"
    return head + (" (with uncommitted changes to ppl_thought/)" if dirty else "")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=50_000, help="loads in all, shared among the readers")
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jitter", type=float, default=0.0,
                    help="ms: each reader pauses up to this long (uniformly) before each file system call")
    ap.add_argument("--dir", type=Path, default=None, help="make the checkpoint folder under DIR")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    root = Path(__file__).resolve().parent.parent
    if not os.environ.get("PYTHONPATH"):
        sys.path.insert(0, str(root))
    import numpy as np

    from ppl_thought.checkpoint import load_numpy, save_numpy

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="checkpoint_race_", dir=args.dir))
    path = work / "ck"
    started = time.monotonic()
    readers: list[subprocess.Popen] = []
    live: list[subprocess.Popen] = []
    try:
        save_numpy(path, {"w": np.zeros((96, 96), np.float32), "b": np.zeros(7, np.int64)}, {"i": 0},
                   aliases={"w_tied": "w"})
        quotas = [args.loads // args.readers + (r < args.loads % args.readers) for r in range(args.readers)]
        for r, q in enumerate(quotas):
            readers.append(_start(_READER, root, path, q, "torch" if r % 2 else "numpy", args.jitter / 1000,
                                  args.seed * 100 + r))
        # one writer is always writing; each round starts new writers, then kills old ones at random moments
        rounds = {"replace_one": 0, "kill_two": 0, "finished": 0}
        kills, seed = 0, 1000 * args.seed
        live.append(_start(_WRITER, root, path, seed, 0))
        started_writers = 1
        for r in readers:
            r.stdin.write("go\n")
            r.stdin.flush()
        while any(r.poll() is None for r in readers):
            kind = rng.choice(sorted(rounds))
            rounds[kind] += 1
            if kind == "replace_one":  # a new writer starts, the oldest is killed mid-write
                seed += 1
                live.append(_start(_WRITER, root, path, seed, 0))
                time.sleep(rng.uniform(0.02, 0.4))
                _kill(live.pop(0))
                kills, started_writers = kills + 1, started_writers + 1
            elif kind == "kill_two":  # two more writers at once; two of the three are killed at independent moments
                live += [_start(_WRITER, root, path, seed + 1, 0), _start(_WRITER, root, path, seed + 2, 0)]
                seed += 2
                rng.shuffle(live)
                time.sleep(rng.uniform(0.02, 0.3))
                _kill(live.pop())
                time.sleep(rng.uniform(0.0, 0.2))
                _kill(live.pop())
                kills, started_writers = kills + 2, started_writers + 2
            else:  # a writer that stops on its own after a few writes, beside the live one
                seed += 1
                live.append(_start(_WRITER, root, path, seed, rng.randint(1, 40)))
                live.pop().wait()
                started_writers += 1
        for w in live:
            _kill(w)
        kills += len(live)
        outs = [json.loads(r.communicate()[0].strip().splitlines()[-1]) for r in readers]
        # the folder loads after the last kill, and the next write removes what killed writers left behind
        state, config, _ = load_numpy(path)
        final_ok = bool((state["w"] == config["i"]).all())
        save_numpy(path, {"w": np.full((96, 96), 7, np.float32), "b": np.full(7, -7, np.int64)}, {"i": 7},
                   aliases={"w_tied": "w"})
        leftovers = sorted(f for f in os.listdir(path) if ".tmp" in f)
    finally:  # on an error or ^C too: no process of ours outlives the run
        for proc in readers + live:
            if proc.poll() is None:
                _kill(proc)
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - started
    keys = ("ok", "checkpoint_error", "inconsistent", "other", "retried", "locked")
    total = {k: sum(o[k] for o in outs) for k in keys}
    failed = total["checkpoint_error"] + total["inconsistent"] + total["other"]
    command = "python benchmarks/checkpoint_race.py" + "".join(
        f" --{k} {v}" for k, v in (("loads", args.loads), ("readers", args.readers), ("seed", args.seed))) + (
        f" --jitter {args.jitter:g}" if args.jitter else "") + (f" --dir {args.dir}" if args.dir else "") + (
        f" --json {args.json}" if args.json else "")
    out = {
        "command": command, "commit": _commit(root), "seconds": round(seconds, 1), "folder": str(work),
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "loads": sum(total[k] for k in ("ok", "checkpoint_error", "inconsistent", "other")), "failed": failed,
        **total, "max_config_reads": max(o["max_config_reads"] for o in outs),
        "writers": {"started": started_writers, "killed": kills, "rounds": rounds},
        "after": {"loads_consistently": final_ok, "temporary_files_after_next_write": leftovers},
        "readers": outs,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    result = main()
    sys.exit(1 if result["failed"] or not result["after"]["loads_consistently"]
             or result["after"]["temporary_files_after_next_write"] else 0)
