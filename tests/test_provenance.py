"""ppl_thought.provenance (issue 42, item 1): the one home of where a result JSON comes from."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ppl_thought import provenance as pv


def test_command_line_is_what_a_user_retypes_from_the_root():
    root = pv.ROOT
    assert pv.command_line([f"{root}/ppl_thought/experiments/sec7.py", "--quick", "--json", "a b.json"]) == \
        "python -m ppl_thought.experiments.sec7 --quick --json 'a b.json'"
    assert pv.command_line([f"{root}/benchmarks/gpu.py", "--quick"]) == "python benchmarks/gpu.py --quick"
    assert pv.command_line(["/usr/local/bin/ppl-thought", "demo", "--quick"]) == "ppl-thought demo --quick"
    assert pv.command_line("anything as typed") == "anything as typed"
    assert pv.script(f"{root}/examples/x.py", ["--seed", "1"]) == [f"{root}/examples/x.py", "--seed", "1"]


def test_record_then_finish_has_every_field_and_the_seconds_between():
    rec = pv.record(["benchmarks/x.py", "--json", "f.json"], threads=3)
    time.sleep(0.05)
    out = pv.finish(rec)
    assert set(out) == {"commit", "dirty", "command", "machine", "threads", "load_average_at_start",
                        "load_average_at_end", "started_at", "seconds"}
    assert out["command"] == "python benchmarks/x.py --json f.json" and out["threads"] == 3
    assert 0.05 <= out["seconds"] < 60
    assert set(out["machine"]) >= {"processor", "nproc", "platform", "python", "torch", "jax", "device"}
    assert len(out["commit"]) == 40  # the tests run in a checkout
    assert pv.stamped({"x": 1}, rec)["provenance"]["command"] == out["command"]


def test_finish_reads_the_threads_a_script_set_after_recording():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    rec = pv.record("cmd")
    try:
        torch.set_num_threads(1 if before != 1 else 2)
        assert pv.finish(rec)["threads"] == torch.get_num_threads() != before
        assert pv.finish(pv.record("cmd", threads=7))["threads"] == 7  # an explicit count is kept
    finally:
        torch.set_num_threads(before)


def test_of_prefers_the_provenance_entry_and_reads_older_layouts():
    assert pv.of({"commit": "a", "command": "old", "provenance": {"commit": "b", "seconds": None}}) == \
        {"commit": "b", "command": "old"}
    assert pv.of({"workload": {"commit": "w", "seconds": 2.0}})["commit"] == "w"
    assert pv.of({}) == {}


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_dirty_means_uncommitted_code_not_results(tmp_path, monkeypatch):
    """A result written under benchmarks/results does not make the next run 'dirty'; an edit of the code does."""
    for f in ("ppl_thought/m.py", "benchmarks/b.py", "benchmarks/results/r.json", "docs/d.md"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("0\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    monkeypatch.setattr(pv, "ROOT", str(tmp_path))
    assert pv.source()["dirty"] is False and len(pv.source()["commit"]) == 40
    (tmp_path / "benchmarks/results/r.json").write_text("1\n")
    (tmp_path / "docs/d.md").write_text("1\n")
    assert pv.source()["dirty"] is False
    (tmp_path / "benchmarks/b.py").write_text("1\n")
    assert pv.source()["dirty"] is True
    monkeypatch.setattr(pv, "ROOT", str(tmp_path / "docs"))  # inside the checkout still
    assert pv.source()["commit"] is not None


def test_outside_a_checkout_the_commit_is_none(tmp_path, monkeypatch):
    monkeypatch.setattr(pv, "ROOT", str(tmp_path))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert pv.source() == {"commit": None, "dirty": None}


def test_the_module_imports_no_array_framework():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['jax'] = None; "
            "import importlib.util as u; s = u.spec_from_file_location('p', sys.argv[1]); m = u.module_from_spec(s); "
            "s.loader.exec_module(m); print(m.machine()['torch_threads'], m.machine()['device'])")
    r = subprocess.run([sys.executable, "-c", code, pv.__file__], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "cpu"]
