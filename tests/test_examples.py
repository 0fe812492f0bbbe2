"""examples/custom_program.py runs (as in CI) and its numbers are the posterior's."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_custom_program_quick(tmp_path):
    out = tmp_path / "custom_program.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "examples" / "custom_program.py"), "--quick", "--no-progress",
                    "--json", str(out)], check=True, cwd=tmp_path, env=env, timeout=300, capture_output=True)
    d = json.loads(out.read_text())
    assert abs(d["exact"]["twist"] - d["exact"]["plain"]) < 1e-6  # a twist leaves Z unchanged
    for name, r in d["results"].items():  # every engine and proposal: log Z within 4 SE (+ slack) of exact
        assert abs(r["log_z"] - r["exact"]) <= 4 * r["se"] + 0.05, (name, r)
    assert d["svi"]["loss_last"] < d["svi"]["loss_first"]  # SVI trained the guide
    assert d["svi"]["is_ess_after"] > d["svi"]["is_ess_before"]
    assert "thought_0" in d["site_check"]
    assert "posterior" in d["idata"]["groups"]
