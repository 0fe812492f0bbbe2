"""Chunked encoding for sparse thoughts (end of Section 5.6.2): tokens/s token by token vs chunked.

A sparse-thought program: ``SparseThoughts`` puts a thought of ``thought_len`` tokens before every
``every``-th observable, so between thoughts the latent sequence is forced (it must copy x). Token by token,
each forced token costs one LM step of the prior and one of the guide; chunked (``chunk=C``), a run of
forced tokens is fed to the LM in one pass, and SMC steps only where a thought may start (``step_ends``).

    python benchmarks/chunked_encoding.py [--quick] [--json FILE]

Same model, guide, particles and seed both ways; ``same_log_weights`` says whether the two paths gave the
same log weights (to 1e-4: a multi-token Transformer pass rounds differently from one-token passes).
Tokens/s counts latent tokens (thought and text) summed over particles. One torch thread.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.projections import SparseThoughts


def timed(fn, reps: int):
    """(best seconds of ``reps`` runs after one warm-up, the last result)."""
    out = fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short x and one timed repetition")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    run_record = pv.record(pv.script(__file__, None))  # before the run: the code that runs
    torch.set_num_threads(1)

    vocab = pt.Vocab(list("abcdefgh"))
    V = len(vocab)
    T, every, thought_len, n = (32, 8, 2, 32) if args.quick else (128, 16, 4, 64)
    reps = 1 if args.quick else 3
    g = torch.Generator().manual_seed(0)
    ordinary = torch.as_tensor(vocab.ordinary_ids)
    x = ordinary[torch.randint(len(ordinary), (T,), generator=g)]
    proj = SparseThoughts(vocab, thought_len, positions=range(0, len(x), every))
    torch.manual_seed(0)
    prior = pt.lm.Transformer(V, d_model=64, n_layers=2, n_heads=4).eval()
    q_lm = pt.lm.Transformer(V, d_model=64, n_layers=2, n_heads=4).eval()

    out: dict = {"x_len": len(x), "thought_every": every, "thought_len": thought_len, "num_particles": n,
                 "results": {}}
    engines = {"importance": lambda: pt.infer.Importance(n),
               "smc": lambda: pt.infer.SMC(n, ess_threshold=0.0)}  # no resampling: the same random stream
    with torch.no_grad():
        for name, make in engines.items():
            row = {}
            weights = {}
            for label, chunk in (("token_by_token", 0), ("chunked", 4 * every)):
                model = pt.models.SlowThinking(prior, proj, chunk=chunk)
                guide = pt.guides.Causal(q_lm, proj, chunk=chunk)

                def run(model=model, guide=guide, make=make):
                    torch.manual_seed(1)
                    return make().run(model, guide, x)

                sec, res = timed(run, reps)
                tokens = int((res.samples["z"] != vocab.pad_id).sum())
                weights[label] = res.log_weights
                row[label] = {"seconds": sec, "tokens": tokens, "tokens_per_s": tokens / sec,
                              "steps": int(res.stats.get("steps", 1)) if name == "smc" else 1}
            row["speedup"] = row["chunked"]["tokens_per_s"] / row["token_by_token"]["tokens_per_s"]
            row["same_log_weights"] = bool(torch.allclose(weights["chunked"], weights["token_by_token"],
                                                          atol=1e-4, rtol=0))
            out["results"][name] = row
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
