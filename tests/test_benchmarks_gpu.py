"""benchmarks/gpu.py --device cpu --quick: runs anywhere (CI has no GPU) and writes the JSON of issue 21 with every
key; the default test runs one particle count, ``pytest --slow`` the whole quick run (N in {16, 64})."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

KEYS = {"device", "n", "smc", "limit_eager", "limit_graph", "fraction_of_graph_limit", "llamppl"}


def _bench():
    path = Path(__file__).parent.parent / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(out: dict, sizes: list[int]) -> None:
    assert set(out) == KEYS | {"provenance"}  # and where it comes from (ppl_thought.provenance)
    assert out["n"] == sizes and "limit_graph is the eager" in out["device"]
    for key in ("smc", "limit_eager", "limit_graph", "fraction_of_graph_limit"):
        assert set(out[key]) == {"transformer", "hf_gpt2"}
        for lm in out[key].values():
            assert set(lm) == {"fp32", "bf16"}
            for per_n in lm.values():
                assert set(per_n) == {str(n) for n in sizes}
                assert all(math.isfinite(v) and v > 0 for v in per_n.values())
    for lm, per_dtype in out["smc"].items():
        for d, per_n in per_dtype.items():
            for n, v in per_n.items():
                assert out["fraction_of_graph_limit"][lm][d][n] == pytest.approx(v / out["limit_graph"][lm][d][n])
    assert out["llamppl"] is None or set(out["llamppl"]) == {str(n) for n in sizes}


def test_gpu_benchmark_quick_on_cpu_writes_every_key(tmp_path, request):
    """The quick run (with --slow; one particle count by default) writes exactly the issue's keys."""
    sizes = [16, 64] if request.config.getoption("--slow") else [16]
    f, meta = tmp_path / "gpu.json", tmp_path / "meta.json"
    _bench().main(["--device", "cpu", "--quick", "--sizes", ",".join(map(str, sizes)), "--json", str(f),
                   "--meta", str(meta)])
    _check(json.loads(f.read_text()), sizes)
    m = json.loads(meta.read_text())
    assert m["quick"] and m["limit_graph_kind"] == "eager" and m["new_tokens"] == 32
    assert all(math.isfinite(v) for v in m["extra"]["log_marginal"].values())
