"""Tokens/s of one latent-training step on SmolLM2 + LoRA against a plain HuggingFace forward + backward of the
same batch (the limit), in one run (issue 43, item 4).

    python benchmarks/real_training.py [--batch 2] [--particles 4] [--repeats 3] [--device cpu] [--dtype float32]
                                       [--json benchmarks/results/real_training_speed.json]

Rows: ``batch`` problems x ``particles`` thoughts of :mod:`ppl_thought.experiments.real_training`, as one dense
batch ``[batch * particles, L]``. Timed (median of ``repeats``, after one warm-up):

- ``score_step``: the library's training pass of (7.1): teacher-forced log P(thought) and log P(answer | thought)
  through ``pt.lm.HuggingFace`` (id maps, float32 library logits), ``latent_surrogate``, backward;
- ``hf_limit``: ``model(input_ids).logits`` of the same rows in HF ids, cross-entropy, backward (no library);
- ``full_step``: ``train_step`` of the predictive method: sampling the thoughts with the KV cache, then
  ``score_step``'s work.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.experiments import real_training as rt
from ppl_thought.experiments.sec7_losses import latent_surrogate
from ppl_thought.io import atomic_write_json
from ppl_thought.vocab import PAD_ID


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, repeats: int, device: str) -> float:
    fn()
    out = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--particles", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bf16"])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    dtype = {"float32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    lm = pt.lm.lora(pt.lm.smollm2(dtype=dtype, device=args.device), r=8, alpha=16)
    prompts = rt.SumPrompts(lm)
    probs = rt.sum_problems(args.batch, seed=1)
    n = args.particles
    b = rt.Batches(prompts, [p for p in probs for _ in range(n)], args.device)
    torch.manual_seed(0)
    thought, _ = rt.sample_thoughts(lm, b.model, prompts.thought_end.to(args.device), 7)
    params = list(pt.lm.lora_parameters(lm).values())

    def score_step():
        for p in params:
            p.grad = None
        log_th, log_ans = rt.score(lm, b.model, thought, prompts.close, b.answer)
        log_p = (log_th + log_ans).view(args.batch, n)
        latent_surrogate(log_p, log_th.detach().view(args.batch, n)).mean().backward()

    # the same rows in HF ids: prefix, thought (its <pad> moved to the end), close, answer
    full = torch.cat([b.model, thought, prompts.close.to(args.device).expand(len(thought), -1), b.answer], 1)
    keep = full != PAD_ID
    dest = torch.where(keep, keep.cumsum(1) - 1, full.shape[1])
    rows = torch.full((len(full), full.shape[1] + 1), PAD_ID, dtype=torch.long, device=args.device)
    rows = rows.scatter_(1, dest, full)[:, :-1]
    hf_rows = lm.to_hf(rows)

    def hf_limit():
        for p in params:
            p.grad = None
        logits = lm.model(input_ids=hf_rows).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 hf_rows[:, 1:].reshape(-1))
        loss.backward()

    def full_step():
        for p in params:
            p.grad = None
        rt.train_step(lm, prompts, "predictive", probs, n, 7)

    tokens = rows.numel()
    out = {"rows": len(rows), "row_tokens": rows.shape[1], "tokens": tokens, "device": args.device,
           "dtype": args.dtype, "threads": torch.get_num_threads()}
    for name, fn in (("hf_limit", hf_limit), ("score_step", score_step), ("full_step", full_step)):
        s = _time(fn, args.repeats, args.device)
        out[name] = {"seconds": s, "tokens_per_s": tokens / s}
        print(f"{name:10s} {s:7.3f} s  {tokens / s:8.1f} tokens/s", flush=True)
    out["score_over_limit"] = out["score_step"]["tokens_per_s"] / out["hf_limit"]["tokens_per_s"]
    print(f"score_step / hf_limit tokens/s: {out['score_over_limit']:.2f}")
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        out["dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                           capture_output=True, text=True).stdout.strip())
    except OSError:
        pass
    out["command"] = " ".join(sys.argv)
    if args.json:
        out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
