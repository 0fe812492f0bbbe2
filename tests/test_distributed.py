"""Training on two processes (torch.distributed, gloo on CPU) against one process, as a user runs it:
``python -m torch.distributed.run --nproc-per-node 2`` on ``examples/train_ddp.py`` (through
``tests/_ddp_worker.py``, which records each process's file writes and can stop after a step to be killed).

Checked: with the same global batch and seed the losses, gradient norms and weights of every step equal
single-process training to float tolerance (the sampled objective (3.17) + (3.25) with per-item streams, and
the deterministic teacher-forced SFT); both ranks hold the same weights; only rank 0 writes checkpoints;
a run killed with SIGKILL after a checkpoint and started again goes on to the numbers of the uninterrupted
run bit for bit; with per-rank streams (seed + rank) a resume restores every rank's RNG state.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ppl_thought as pt

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_ddp_worker.py"
STEPS, BATCH = 6, 4

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")


def _free_ports(k: int) -> list[int]:
    """k distinct free ports (the sockets are held until all are chosen, so two launches never share one)."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_port() -> int:
    return _free_ports(1)[0]


def _launch(tmp: Path, name: str, runs: list[list[str]], hang_after: int | None = None,
            port: int | None = None) -> subprocess.Popen:
    spec = {"record": str(tmp / name), "runs": runs, "hang_after": hang_after, "watch": str(tmp / "ck")}
    (tmp / f"{name}.spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port or _free_port()), str(WORKER), str(tmp / f"{name}.spec.json")]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, tmp: Path, name: str) -> list[dict]:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:]
    return [json.loads((tmp / f"{name}.{r}.json").read_text()) for r in range(2)]


def _args(objective: str, ck: Path | None, streams: str = "item", steps: int = STEPS) -> list[str]:
    a = ["--objective", objective, "--steps", str(steps), "--batch-size", str(BATCH), "--seed", "0",
         "--streams", streams, "--no-progress"]
    return a + (["--checkpoint-dir", str(ck), "--checkpoint-every", "2"] if ck is not None else [])


def _example():
    spec = importlib.util.spec_from_file_location("train_ddp_example", ROOT / "examples" / "train_ddp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch A (uninterrupted: item streams with checkpoints, SFT, rank streams with checkpoints) and
    launch B (killed after step 3) at once, then C (B started again, and a resume of A's rank-stream run
    from its step-2 checkpoint)."""
    tmp = tmp_path_factory.mktemp("ddp")
    ck = tmp / "ck"
    ck.mkdir()
    t0 = time.perf_counter()
    port_a, port_b = _free_ports(2)
    a = _launch(tmp, "A", [_args("svi", ck / "a"), _args("sft", None), _args("svi", ck / "a_rank", "rank")],
                port=port_a)
    b = _launch(tmp, "B", [_args("svi", ck / "b")], hang_after=3, port=port_b)
    deadline = time.time() + 120
    while not all((tmp / f"B.hang.{r}").exists() for r in range(2)):
        assert b.poll() is None, b.communicate()[0][-4000:]
        assert time.time() < deadline, "the run to be killed never reached step 3"
        time.sleep(0.05)
    # torchrun and both workers, mid-run: torchrun starts each worker in a session of its own (elastic's
    # start_new_session), so killing torchrun's group alone left the two workers running after the suite
    workers = [int((tmp / f"B.hang.{r}").read_text()) for r in range(2)]
    os.killpg(b.pid, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    b.wait(timeout=30)
    killed = sorted(p.name for p in (ck / "b").iterdir())
    out_a = _finish(a, tmp, "A")
    (ck / "c_rank").mkdir()
    shutil.copytree(ck / "a_rank" / "step-00000002", ck / "c_rank" / "step-00000002")
    c = _launch(tmp, "C", [_args("svi", ck / "b"), _args("svi", ck / "c_rank", "rank")])
    out_c = _finish(c, tmp, "C")
    print(f"three launches of 2 processes: {time.perf_counter() - t0:.1f} s")  # about 20 s on 2 idle cores
    return {"A": out_a, "C": out_c, "killed": killed, "tmp": tmp, "ck": ck}


def _single(argv: list[str]) -> dict:
    """The same training on this one process (no process group)."""
    assert not dist.is_initialized()
    return _example().main(argv)


def _close(a: list[dict], b: list[dict], keys=("loss", "grad_norm", "grad_norm/prior")) -> None:
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        for k in keys:
            assert math.isclose(x[k], y[k], rel_tol=1e-5, abs_tol=1e-6), (k, x, y)


def _weights_close(a: dict, b: dict, exact: bool = False) -> None:
    for name in a:
        for k in a[name]:
            ta, tb = torch.tensor(a[name][k]), torch.tensor(b[name][k])
            if exact:
                assert torch.equal(ta, tb), (name, k)
            else:
                torch.testing.assert_close(ta, tb, rtol=1e-5, atol=1e-6)


def test_two_processes_take_the_steps_of_one(runs):
    rank0, rank1 = runs["A"]
    for i, argv in enumerate((_args("svi", None), _args("sft", None))):
        single = _single(argv)
        assert rank0["runs"][i]["world_size"] == 2
        _close(rank0["runs"][i]["history"], single["history"],
               ("loss", "grad_norm", "grad_norm/prior") + (("grad_norm/sampler", "SamplerPolicyGradient.reward")
                                                           if i == 0 else ()))
        _weights_close(rank0["runs"][i]["weights"], single["weights"])
        # the ranks agree bit for bit: same reduced gradients, same update
        assert rank0["runs"][i]["history"] == rank1["runs"][i]["history"]
        _weights_close(rank0["runs"][i]["weights"], rank1["runs"][i]["weights"], exact=True)
    # training did something: the loss of the sampled objective went down
    h = rank0["runs"][0]["history"]
    assert h[-1]["loss"] < h[0]["loss"]


def test_rank_streams_differ_from_one_process_but_both_ranks_agree(runs):
    """seed + rank streams: the same number of steps and equal weights on both ranks, other samples than one
    process draws (equal in distribution only)."""
    rank0, rank1 = runs["A"]
    run0, run1 = rank0["runs"][2], rank1["runs"][2]
    assert run0["history"] == run1["history"]
    _weights_close(run0["weights"], run1["weights"], exact=True)
    assert [h["loss"] for h in run0["history"]] != [h["loss"] for h in rank0["runs"][0]["history"]]


def test_only_rank_0_writes_checkpoints(runs):
    rank0, rank1 = runs["A"]
    ck = runs["ck"]
    assert rank1["writes"] == [] and all(r["written"] == [] for r in rank1["runs"])
    assert [Path(p).name for p in rank0["runs"][0]["written"]] == ["step-00000002", "step-00000004",
                                                                  "step-00000006"]
    written = {Path(p).relative_to(ck).parts[:2] for _, p in rank0["writes"] if Path(p).parent != ck}
    assert {("a", f"step-0000000{s}") for s in (2, 4, 6)} <= written
    for s in (2, 4, 6):
        cfg = json.loads((ck / "a" / f"step-0000000{s}" / "config.json").read_text())
        assert cfg["config"]["world_size"] == 2 and cfg["extra"]["step_count"] == s
        assert "rng/1/torch" in _tensor_names(ck / "a" / f"step-0000000{s}")


def _tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    (f,) = folder.glob("model.*.safetensors")
    with safe_open(str(f), framework="pt") as st:
        return set(st.keys())


def test_killed_and_restarted_goes_on_to_the_uninterrupted_numbers(runs):
    """SIGKILL after step 3 (the newest checkpoint: step 2), then the same command again: it resumes from
    step 2 and reaches the uninterrupted run's losses and weights bit for bit."""
    assert runs["killed"] == ["step-00000002"]
    full = runs["A"][0]["runs"][0]
    for rank in range(2):
        resumed = runs["C"][rank]["runs"][0]
        assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in full["history"]]
        assert resumed["history"] == full["history"]
        _weights_close(resumed["weights"], full["weights"], exact=True)
    # with per-rank streams every rank's RNG state came back from the checkpoint
    full_rank = runs["A"][0]["runs"][2]
    resumed_rank = runs["C"][0]["runs"][1]
    assert resumed_rank["history"] == full_rank["history"]
    _weights_close(resumed_rank["weights"], full_rank["weights"], exact=True)


def test_a_one_process_group_runs_the_collective_path_and_changes_nothing(tmp_path, monkeypatch):
    """distributed=True inside a process group of one (in this process): broadcast, all-reduce, the JSON
    gathers and the collective save run, and give exactly the numbers of the plain Trainer. pt.train.SVI, which
    cannot average over processes, warns when the group has several."""
    example = _example()
    plain = example.build("svi", checkpoint_dir=tmp_path / "plain", checkpoint_every=2)
    plain.fit(example.dataset("svi"), 4)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        t = example.build("svi", checkpoint_dir=tmp_path / "group", checkpoint_every=2)
        assert not t.distributed  # auto: a group of one process is no reason to communicate
        t = example.build("svi", checkpoint_dir=tmp_path / "group", checkpoint_every=2, distributed=True)
        assert (t.distributed, t.rank, t.world_size) == (True, 0, 1)
        t.fit(example.dataset("svi"), 4)
        assert t.history == plain.history
        assert [p.name for p in t.checkpoints_written] == ["step-00000002", "step-00000004"]
        for name in t.modules:
            assert torch.equal(t.modules[name].logits, plain.modules[name].logits)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        with pytest.warns(UserWarning, match="Trainer"):
            pt.train.SVI(pt.train.OneSampler(2), {"lr": 0.01}).run(t.model, t.guide, "ab", num_steps=1)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()

