"""Tokens/s of KV-cached incremental decoding with ``Transformer.step`` (batch 256, d_model 128, 4 layers).

Cases: full causal attention and a sliding window, each with the preallocated in-place cache (default)
and with ``KVCache.preallocate = False`` (every step a ``torch.cat``), plus cross-attention to latents.
The figures that matter are the ratios in one run (docs/architecture.md, "Rules that make it fast").

    python benchmarks/transformer_step.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from ppl_thought import provenance as pv
from ppl_thought.lm import KVCache, Transformer


def decode(model: Transformer, batch: int, prompt_len: int, steps: int, latents=None) -> float:
    """Seconds to decode ``steps`` tokens for ``batch`` rows after a ``prompt_len`` prompt."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(model.vocab_size, (batch, prompt_len), generator=g)
    tokens = torch.randint(model.vocab_size, (steps, batch), generator=g)
    with torch.inference_mode():
        _, cache = model(prompt, latents=latents)
        start = time.perf_counter()
        for t in range(steps):
            _, cache = model.step(tokens[t], cache, latents=latents)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=None, help="decoding steps (default 512, quick 128)")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="best of N runs (default 2, quick 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    run_record = pv.record(pv.script(__file__, None))  # before the run: the code that runs
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (128 if args.quick else 512)
    args.repeats = args.repeats or (1 if args.quick else 2)
    prompt_len = 16
    torch.manual_seed(0)
    arch = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_len=prompt_len + steps)

    cases = [("full", {}, True), ("full", {}, False),
             ("window", {"window": args.window}, True), ("window", {"window": args.window}, False),
             ("cross", {"cross_attention": True}, True)]
    models = {}
    for name, options, _ in cases:
        if name not in models:
            torch.manual_seed(0)
            models[name] = Transformer(**arch, **options).eval()
    latents = torch.randn(args.batch, arch["n_layers"], 4, arch["d_model"])
    best = {i: float("inf") for i in range(len(cases))}
    for _ in range(args.repeats):  # interleaved, best of repeats: load from other processes averages out
        for i, (name, _, preallocate) in enumerate(cases):
            model = models[name]
            KVCache.preallocate = preallocate
            try:
                z = latents if model.cross_attention else None
                best[i] = min(best[i], decode(model, args.batch, prompt_len, steps, z))
            finally:
                KVCache.preallocate = True
    results = []
    for i, (name, options, preallocate) in enumerate(cases):
        seconds = best[i]
        row = {"case": name, "options": options, "preallocate": preallocate, "batch": args.batch,
               "steps": steps, "seconds": seconds, "ms_per_step": 1e3 * seconds / steps,
               "tokens_per_s": args.batch * steps / seconds}
        results.append(row)
        print(f"{name:7s} preallocate={preallocate!s:5s}  {row['tokens_per_s']:10.0f} tokens/s  "
              f"{row['ms_per_step']:7.2f} ms/step")

    def speed(name, preallocate=True):
        return next(r["tokens_per_s"] for r in results
                    if r["case"] == name and r["preallocate"] == preallocate)

    ratios = {"full_preallocate_over_cat": speed("full") / speed("full", False),
              "window_preallocate_over_cat": speed("window") / speed("window", False),
              "window_over_full": speed("window") / speed("full"),
              "cross_over_full": speed("cross") / speed("full")}
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    if args.json:
        report = {"benchmark": "transformer_step", "quick": args.quick, "model": arch,
                  "prompt_len": prompt_len, "window": args.window, "repeats": args.repeats,
                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "machine": platform.machine(), "processor": platform.processor(),
                  "results": results, "ratios": ratios}
        with open(args.json, "w") as f:
            report[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
