"""Tokens/s of one KV-cached decode step, JAX (``ptn.lm.Transformer``, jitted) vs torch (``Transformer.step``).

The same checkpoint on both sides (a torch model saved, loaded by the JAX side): vocab 256, d_model 128,
4 layers, 4 heads; a 16-token prompt, then ``steps`` tokens one at a time for B rows, B in {16, 64, 256}.
JAX runs ``jax.jit(model.step)`` with the cache donated (updated in place), its cache preallocated to
prompt + steps slots (every step reads all of them; torch reads the filled part only); torch runs
``model.step`` under ``inference_mode`` with its preallocated in-place cache, with 1 and with 2 intra-op
threads (XLA uses its own pool over the machine's cores). Compile time (first call) is reported apart.
The load average is recorded: the machine is shared, and the figure that matters is the ratio measured in
one run, interleaved, best of ``repeats``.

    python benchmarks/jax_transformer.py [--quick] [--json FILE] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import ppl_thought.numpyro as ptn
from ppl_thought import provenance as pv
from ppl_thought.lm.transformer import Transformer


def torch_decode(model: Transformer, prompt: torch.Tensor, tokens: torch.Tensor) -> tuple[float, np.ndarray]:
    """Seconds for the steps after the prompt, and the last step's log-probs."""
    with torch.inference_mode():
        _, cache = model(prompt)
        start = time.perf_counter()
        for t in range(tokens.shape[0]):
            logits, cache = model.step(tokens[t], cache)
        seconds = time.perf_counter() - start
        return seconds, torch.log_softmax(logits, -1).numpy()


def jax_decode(model, step, prompt: jax.Array, tokens: jax.Array) -> tuple[float, np.ndarray]:
    cache = model.init_cache(prompt.shape[0], prompt.shape[1] + tokens.shape[0])
    _, cache = model.apply(model.params, cache, prompt)
    jax.block_until_ready(cache)
    start = time.perf_counter()
    for t in range(tokens.shape[0]):
        log_probs, cache = step(model.params, cache, tokens[t])
    jax.block_until_ready(log_probs)
    return time.perf_counter() - start, np.asarray(log_probs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat (a smoke run)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--steps", type=int, default=None, help="decoding steps (default 64, quick 16)")
    parser.add_argument("--repeats", type=int, default=None, help="best of N (default 2, quick 1)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch.set_num_threads values")
    args = parser.parse_args()
    run_record = pv.record(pv.script(__file__, None))  # before the run: the code that runs
    steps = args.steps or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 2)
    prompt_len = 16
    arch = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_len=prompt_len + steps)

    torch.manual_seed(0)
    model = Transformer(**arch).eval()
    with tempfile.TemporaryDirectory() as tmp:
        jmodel = ptn.lm.Transformer.load(model.save(tmp))
    step = jax.jit(jmodel.step, donate_argnums=(1,))

    load_before = os.getloadavg()
    rows = []
    for B in args.batches:
        g = torch.Generator().manual_seed(B)
        prompt = torch.randint(arch["vocab_size"], (B, prompt_len), generator=g)
        tokens = torch.randint(arch["vocab_size"], (steps, B), generator=g)
        jprompt, jtokens = jnp.asarray(prompt.numpy(), jnp.int32), jnp.asarray(tokens.numpy(), jnp.int32)

        t0 = time.perf_counter()  # compile: the prompt's forward and one step
        cache = jmodel.init_cache(B, prompt_len + steps)
        _, cache = jmodel.apply(jmodel.params, cache, jprompt)
        jax.block_until_ready(step(jmodel.params, cache, jtokens[0]))
        compile_s = time.perf_counter() - t0

        best_t, best_j = {n: float("inf") for n in args.threads}, float("inf")
        for _ in range(repeats):  # interleaved: load from other processes hits both sides alike
            for n in args.threads:
                torch.set_num_threads(n)
                seconds, ref = torch_decode(model, prompt, tokens)
                best_t[n] = min(best_t[n], seconds)
            seconds, ours = jax_decode(jmodel, step, jprompt, jtokens)
            best_j = min(best_j, seconds)
        row = {"batch": B, "steps": steps, "jax_tokens_per_s": B * steps / best_j,
               "jax_ms_per_step": 1e3 * best_j / steps, "jax_compile_s": compile_s,
               "max_abs_log_prob_diff": float(np.abs(ours - ref).max())}
        for n in args.threads:
            row[f"torch_{n}t_tokens_per_s"] = B * steps / best_t[n]
            row[f"ratio_jax_over_torch_{n}t"] = best_t[n] / best_j
        rows.append(row)
        print(f"B={B:4d}  jax {row['jax_tokens_per_s']:8.0f} tok/s (compile {compile_s:.1f}s, "
              f"|diff| {row['max_abs_log_prob_diff']:.1e})  " + "  ".join(
                  f"torch {n}t {row[f'torch_{n}t_tokens_per_s']:8.0f} tok/s (jax/torch "
                  f"{row[f'ratio_jax_over_torch_{n}t']:.2f})" for n in args.threads))

    out = {"benchmark": "jax_transformer", "arch": arch, "prompt_len": prompt_len, "repeats": repeats,
           "torch_threads": args.threads, "torch": torch.__version__, "jax": jax.__version__,
           "jax_device": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "platform": platform.platform(),
           "load_average_before": load_before, "load_average_after": os.getloadavg(), "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
