"""One process of tests/test_distributed.py, launched by ``python -m torch.distributed.run``.

    python -m torch.distributed.run --nproc-per-node 2 tests/_ddp_worker.py SPEC.json

SPEC: ``{"record": PREFIX, "runs": [[example args], ...], "hang_after": K or null, "watch": FOLDER}``. Runs
``examples/train_ddp.py``'s ``main`` once per entry of ``runs`` in one process group and writes
``PREFIX.<rank>.json``: per run the example's output, plus every file this process created, renamed or removed
under ``watch`` (an audit hook, so a write by a rank other than 0 is seen whatever code path makes it). With
``hang_after`` every rank stops after step K of the first run (after its checkpoint), touches
``PREFIX.hang.<rank>`` (holding its process id: torchrun starts each worker in a session of its own, so killing
torchrun's process group does not reach it) and waits to be killed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "examples" / "train_ddp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    watch = str(Path(spec["watch"]).resolve())
    writes: list[list[str]] = []

    def audit(event: str, args) -> None:
        if event == "open" and isinstance(args[0], str | bytes | os.PathLike):
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wxa+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            paths = [args[0]] if writing else []
        elif event in ("os.rename", "os.mkdir", "os.remove", "os.rmdir"):
            paths = [a for a in args[:2] if isinstance(a, str | bytes | os.PathLike)]
        else:
            return
        for p in paths:
            p = os.path.abspath(os.fsdecode(p))
            if p.startswith(watch):
                writes.append([event, p])

    sys.addaudithook(audit)
    example = _example()
    rank = int(os.environ["RANK"])
    hang_after = spec.get("hang_after")

    def hang(trainer, metrics) -> None:
        if trainer.step_count == hang_after:
            hang = Path(f"{spec['record']}.hang.{rank}")
            part = Path(f"{hang}.part")
            part.write_text(str(os.getpid()))
            os.replace(part, hang)  # whole when it appears: the test reads the pid at once
            time.sleep(600)

    outs = []
    for i, argv in enumerate(spec["runs"]):
        outs.append(example.main(argv, callback=hang if hang_after is not None and i == 0 else None))
    Path(f"{spec['record']}.{rank}.json").write_text(json.dumps({"rank": rank, "runs": outs, "writes": writes}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # both ranks done before either tears down its gloo connections
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
