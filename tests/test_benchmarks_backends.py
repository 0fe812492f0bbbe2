"""benchmarks/backends.py --quick: the same IS and SMC workload on torch and on JAX / NumPyro (issue 15's JSON:
``parity``, ``is``, ``smc``, ``compile_s``; N in {16, 256}), one checkpoint per LM read by both backends."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("numpyro")


def _bench():
    path = Path(__file__).parent.parent / "benchmarks" / "backends.py"
    spec = importlib.util.spec_from_file_location("backends_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_backends_benchmark_quick(tmp_path):
    f = tmp_path / "backends.json"
    _bench().main(["--quick", "--json", str(f)])
    out = json.loads(f.read_text())
    assert {"parity", "is", "smc", "compile_s"} <= set(out)
    # one set of weights, two frameworks: the per-sequence log P(z) and the exact log p(x) agree in float32
    assert out["parity"]["max_abs_log_prob_diff"] < 1e-5
    assert out["parity"]["max_abs_exact_diff"] < 1e-5
    for engine in ("is", "smc"):
        assert set(out[engine]) == {"16", "256"}
        for per_n in out[engine].values():
            assert per_n["torch"] > 0 and per_n["jax"] > 0
            assert per_n["ratio_jax_over_torch"] == pytest.approx(per_n["jax"] / per_n["torch"])
        assert set(out["compile_s"][engine]) == {"16", "256"}
        assert all(math.isfinite(v) and v >= 0 for v in out["compile_s"][engine].values())
        # both backends estimate the same log p(x): finite, and within a few nats of each other at N = 256
        lm = out["log_marginal"][engine]["256"]
        assert math.isfinite(lm["torch"]) and math.isfinite(lm["jax"]) and abs(lm["torch"] - lm["jax"]) < 2.0
    # the user program (question -> thought -> answer): both backends, compile time apart, a fresh engine reuses it
    assert set(out["program"]) == {"16", "256"}
    for n, per_n in out["program"].items():
        assert per_n["torch"] > 0 and per_n["jax"] > 0
        lm = out["log_marginal"]["program"][n]
        assert math.isfinite(lm["torch"]) and math.isfinite(lm["jax"])
        assert out["rerun_fresh_engine_s"][n] < out["seconds"]["program"][n]["jax_first"]
    assert set(out["compile_s"]["program"]) == {"16", "256"}
