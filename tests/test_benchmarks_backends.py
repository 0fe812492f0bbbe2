"""benchmarks/backends.py: the same IS and SMC workload on torch and on JAX / NumPyro (issue 15's JSON: ``parity``,
``is``, ``smc``, ``compile_s``), one checkpoint per LM read by both backends.

By default ``--tiny``: ``--quick``'s code path with N = 256 alone and a one-layer Transformer (each N is a
compilation of its own on the JAX side: one N halves them); ``--slow`` runs ``--quick`` itself, N in {16, 256}
with the two-layer ``ARCH``: another size through the same code, which the default run covers at N = 256."""

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


def test_backends_benchmark_quick(tmp_path, request):
    f = tmp_path / "backends.json"
    slow = request.config.getoption("--slow")
    _bench().main(["--quick" if slow else "--tiny", "--json", str(f)])
    ns = {"16", "256"} if slow else {"256"}
    out = json.loads(f.read_text())
    assert {"parity", "is", "smc", "compile_s"} <= set(out)
    # one set of weights, two frameworks: the per-sequence log P(z) and the exact log p(x) agree in float32
    assert out["parity"]["max_abs_log_prob_diff"] < 1e-5
    assert out["parity"]["max_abs_exact_diff"] < 1e-5
    assert out["workload"]["arch"]["n_layers"] == (2 if slow else 1) and set(map(str, out["n"])) == ns
    for engine in ("is", "smc"):
        assert set(out[engine]) == ns
        for per_n in out[engine].values():
            assert per_n["torch"] > 0 and per_n["jax"] > 0
            assert per_n["ratio_jax_over_torch"] == pytest.approx(per_n["jax"] / per_n["torch"])
        assert set(out["compile_s"][engine]) == ns
        assert all(math.isfinite(v) and v >= 0 for v in out["compile_s"][engine].values())
        # both backends estimate the same log p(x): finite, and within a few nats of each other at N = 256
        lm = out["log_marginal"][engine]["256"]
        assert math.isfinite(lm["torch"]) and math.isfinite(lm["jax"]) and abs(lm["torch"] - lm["jax"]) < 2.0
    # the user program (question -> thought -> answer): both backends, compile time apart, a fresh engine reuses it
    assert set(out["program"]) == ns
    for n, per_n in out["program"].items():
        assert per_n["torch"] > 0 and per_n["jax"] > 0
        lm = out["log_marginal"]["program"][n]
        assert math.isfinite(lm["torch"]) and math.isfinite(lm["jax"])
        assert out["rerun_fresh_engine_s"][n] < out["seconds"]["program"][n]["jax_first"]
    assert set(out["compile_s"]["program"]) == ns
