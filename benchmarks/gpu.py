"""Issue 21's GPU workload: SMC under a "no letter e" mask on a GPT-2-small-shaped model, against the eager and the
CUDA-graph forward-only rates of the same model (docs/gpu.md).

    python benchmarks/gpu.py --json FILE [--device cuda|cpu] [--quick] [--sizes 16,64]

Workload: a random model of GPT-2-small shape (12 layers, d_model 768, 12 heads) over a byte-level BPE vocabulary
of 32768 trained in process (``tokenizers``; nothing is downloaded), both as the library ``pt.lm.Transformer`` and
as ``GPT2LMHeadModel`` through ``pt.lm.HuggingFace``; a 16-token prompt; 32 tokens whose decoded strings contain no
letter e (``pt.models.Constrained`` with the lipogram token automaton of benchmarks/llamppl_race.py, the CPU
version of this race); SMC resampling when the ESS falls under n/2 (``SMC(n, backend="static")``: the per-token
work on a static KV cache, one CUDA graph per token step on CUDA). At N = 16, 64, 256, 1024 particles, in fp32
and bf16, particle-tokens per second (n x 32 / wall time, prompt included, best of a few runs after a warm-up
that also captures the graphs):

- ``smc[lm][dtype][N]``: the SMC run;
- ``limit_eager[lm][dtype][N]``: the model alone, eager, with its dynamic cache (the library ``KVCache`` for the
  Transformer, transformers' ``DynamicCache`` for GPT-2): prompt encoded once and repeated to N rows, then 32
  single-token steps of N rows (random tokens; no sampling, mask or weights);
- ``limit_graph[lm][dtype][N]``: the same steps on the static cache (lm/static_cache.py), each step one replayed
  CUDA graph; on a machine without CUDA the static steps run eagerly (``workload["limit_graph_kind"]`` says
  which);
- ``fraction_of_graph_limit[lm][dtype][N]`` = smc / limit_graph (same model, dtype and N);
- ``llamppl[N]``: LLaMPPL's SMC on the HF model in fp32 (llamppl_race.py's program), or null when ``llamppl`` is
  not importable.

The JSON has exactly the keys above (on a machine without CUDA the ``device`` string says that ``limit_graph`` is
the eager figure); ``--meta FILE`` writes the workload (sizes, vocabulary, admitted tokens, versions), the seconds,
the resampling steps and log Z-hat of each run to a second file.

``--quick``: a tiny model (2 layers, d_model 64, vocabulary 512), N in {16, 64}, one timed round: the same keys,
runs anywhere in about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import pyro
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llamppl_race  # noqa: E402  (same folder: corpus, lipogram automaton, the LLaMPPL program)

import ppl_thought as pt  # noqa: E402
from ppl_thought import provenance as pv
from ppl_thought.inference import SMC  # noqa: E402
from ppl_thought.lm.static_cache import static_decoder  # noqa: E402
from ppl_thought.projections import token_texts  # noqa: E402
from ppl_thought.vocab import BOS_ID  # noqa: E402

FULL = {"n_layer": 12, "d_model": 768, "n_head": 12, "vocab_size": 32768, "sizes": [16, 64, 256, 1024], "rounds": 3}
QUICK = {"n_layer": 2, "d_model": 64, "n_head": 2, "vocab_size": 512, "sizes": [16, 64], "rounds": 1}
PROMPT_TOKENS, NEW_TOKENS, ESS_THRESHOLD = 16, 32, 0.5
LMS, DTYPES = ("transformer", "hf_gpt2"), {"fp32": torch.float32, "bf16": torch.bfloat16}


def bpe_corpus(vocab_size: int, seed: int = 0) -> list[str]:
    """llamppl_race's pseudo-English plus, for large vocabularies, enough distinct pseudo-words (random syllables,
    Zipf-like frequencies) for the BPE trainer to reach ``vocab_size`` merges."""
    texts = llamppl_race.corpus()
    if vocab_size <= 1024:
        return texts
    rng = random.Random(seed)
    syll = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiouy"] + ["th", "sh", "ch", "st", "nd", "ng"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(2 * vocab_size)]
    weights = [1.0 / (i + 1) ** 0.7 for i in range(len(words))]
    for _ in range(4000):
        texts.append(" ".join(rng.choices(words, weights, k=60)) + ".")
    return texts


def build(cfg: dict, device: str):
    """(library Transformer, HF adapter, prompt ids [16]) on ``device`` in fp32; nothing is downloaded."""
    from ppl_thought.lm.huggingface import HuggingFace, random_gpt2, train_bpe_tokenizer

    texts = bpe_corpus(cfg["vocab_size"])
    tok = train_bpe_tokenizer(texts, cfg["vocab_size"])
    max_len = PROMPT_TOKENS + NEW_TOKENS + 2
    hf = HuggingFace(random_gpt2(len(tok), n_layer=cfg["n_layer"], n_embd=cfg["d_model"], n_head=cfg["n_head"],
                                 n_positions=max(64, max_len)), tok).to(device)
    torch.manual_seed(0)
    tr = pt.lm.Transformer(len(hf.vocab), d_model=cfg["d_model"], n_layers=cfg["n_layer"], n_heads=cfg["n_head"],
                           max_len=max_len).eval().to(device)
    prompt = torch.tensor(hf.vocab.encode(" ".join(texts[:4]))[:PROMPT_TOKENS])
    return {"transformer": tr, "hf_gpt2": hf}, prompt


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def eager_limit(lm, name: str, prompt: torch.Tensor, n: int, device):
    """The model alone with its dynamic cache: the prompt once, repeated to n rows, then 32 single-token steps."""
    g = torch.Generator().manual_seed(0)
    feed = torch.randint(6, lm.vocab_size, (NEW_TOKENS, n), generator=g).to(device)
    ctx = torch.cat([torch.tensor([BOS_ID]), prompt]).to(device)
    if name == "hf_gpt2":  # the HF model alone with transformers' own DynamicCache, HF ids (llamppl_race's limit)
        model, ctx_hf, feed_hf = lm.model, lm.to_hf(ctx)[None], lm.to_hf(feed)[..., None]

        def run_hf():
            out = model(input_ids=ctx_hf, use_cache=True)
            cache = out.past_key_values
            cache.batch_repeat_interleave(n)
            for t in range(NEW_TOKENS):
                out = model(input_ids=feed_hf[t], past_key_values=cache, use_cache=True)
            return out.logits

        return run_hf

    def run():
        _, cache = lm(ctx[None])
        cache = cache.expand(n)
        for t in range(NEW_TOKENS):
            logits, cache = lm.step(feed[t], cache)
        return logits

    return run


def graph_limit(lm, prompt: torch.Tensor, n: int, device):
    """The same steps on the static cache: each step one replayed CUDA graph (eager on a machine without CUDA)."""
    g = torch.Generator().manual_seed(0)
    feed = torch.randint(6, lm.vocab_size, (NEW_TOKENS, n), generator=g).to(device)
    ctx = torch.cat([torch.tensor([BOS_ID]), prompt]).to(device)
    dec = static_decoder(lm, n, len(ctx) + NEW_TOKENS)
    tokens = torch.zeros(n, dtype=torch.long, device=device)
    if torch.device(device).type != "cuda":
        def run():
            dec.start(ctx)
            for t in range(NEW_TOKENS):
                logits = dec.step(feed[t])
            return logits

        return run
    dec.full = True
    dec.start(ctx)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            dec.step(tokens)
    torch.cuda.current_stream().wait_stream(side)
    dec.start(ctx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dec.step(tokens)

    def run():
        dec.start(ctx)
        for t in range(NEW_TOKENS):
            tokens.copy_(feed[t])
            graph.replay()
        return out

    return run


def smc_run(lm, constraint, prompt: torch.Tensor, n: int, device):
    program = pt.models.Constrained(lm, constraint, NEW_TOKENS)
    engine = SMC(n, ess_threshold=ESS_THRESHOLD, backend="static")
    results = []

    def run():
        pyro.set_rng_seed(0)
        results.append(engine.run(program, None, prompt.to(device)))
        return results[-1]

    return run, results


def timed(fns: dict, rounds: int, device) -> dict:
    """Best wall time of each function over ``rounds`` interleaved rounds after one warm-up round."""
    best = dict.fromkeys(fns, float("inf"))
    for rnd in range(1 + rounds):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if rnd:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="comma-separated particle counts")
    ap.add_argument("--meta", default=None, help="also write the workload, seconds and log Z-hats to this JSON file")
    args = ap.parse_args(argv)
    args.run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    cfg = QUICK if args.quick else FULL
    device = torch.device(args.device)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else cfg["sizes"]
    if device.type == "cpu":
        torch.set_num_threads(1)
    with torch.inference_mode():
        return _main(args, cfg, device, sizes)


def _main(args, cfg: dict, device: torch.device, sizes: list[int]) -> dict:
    lms, prompt = build(cfg, device)
    constraint = llamppl_race.lipogram_constraint(token_texts(lms["hf_gpt2"].vocab))
    if device.type == "cuda":
        dev_name = torch.cuda.get_device_name(device)
    else:  # the mark: without CUDA, limit_graph is the eager figure of the static cache
        dev_name = f"cpu ({platform.machine()}): limit_graph is the eager static-cache figure (no CUDA graphs)"
    out: dict = {"device": dev_name, "n": sizes, "smc": {}, "limit_eager": {}, "limit_graph": {},
                 "fraction_of_graph_limit": {}, "llamppl": None}
    extra: dict = {"seconds": {}, "resampling_steps": {}, "log_marginal": {}}
    meta = {**{k: cfg[k] for k in ("n_layer", "d_model", "n_head")}, "library_vocab": len(lms["hf_gpt2"].vocab),
            "bpe_vocab_requested": cfg["vocab_size"], "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
            "ess_threshold": ESS_THRESHOLD, "mask": llamppl_race.MASK,
            "admitted_tokens": int(llamppl_race.admitted_ids(constraint).numel()), "quick": args.quick,
            "rounds": cfg["rounds"],
            "limit_graph_kind": "cuda_graph" if device.type == "cuda" else "eager", "torch": torch.__version__,
            "transformers": llamppl_race._version("transformers"), "cpu_count": os.cpu_count(), "extra": extra}
    for name in LMS:
        for key in ("smc", "limit_eager", "limit_graph", "fraction_of_graph_limit"):
            out[key][name] = {d: {} for d in DTYPES}
        for dname, dtype in DTYPES.items():
            lm = lms[name].to(dtype)
            for n in sizes:
                run, results = smc_run(lm, constraint, prompt, n, device)
                fns = {"smc": run, "limit_eager": eager_limit(lm, name, prompt, n, device),
                       "limit_graph": graph_limit(lm, prompt, n, device)}
                best = timed(fns, cfg["rounds"], device)
                rate = {k: n * NEW_TOKENS / t for k, t in best.items()}
                for k, v in rate.items():
                    out[k][name][dname][str(n)] = v
                out["fraction_of_graph_limit"][name][dname][str(n)] = rate["smc"] / rate["limit_graph"]
                tag = f"{name}/{dname}/{n}"
                extra["seconds"][tag] = best
                extra["resampling_steps"][tag] = int(sum(results[-1].stats["resampled"]))
                extra["log_marginal"][tag] = float(results[-1].log_marginal)
                print(json.dumps({tag: {k: round(v, 1) for k, v in rate.items()}}), flush=True)
                del fns, run, results
            lms[name] = lm.float()
    race, meta["llamppl_absent_because"] = llamppl_race.llamppl_race(lms["hf_gpt2"], constraint, prompt, NEW_TOKENS,
                                                                     ESS_THRESHOLD)
    if race is not None:
        out["llamppl"] = {}
        for n in sizes:
            best = timed({"llamppl": race(n)}, cfg["rounds"], device)
            out["llamppl"][str(n)] = n * NEW_TOKENS / best["llamppl"]
    if args.json:
        with open(args.json, "w") as f:
            out[pv.KEY] = pv.finish(args.run_record)  # commit, command, machine, load, seconds
            json.dump(out, f, indent=2)
    if args.meta:
        with open(args.meta, "w") as f:
            meta[pv.KEY] = pv.finish(args.run_record)  # commit, command, machine, load, seconds
            json.dump(meta, f, indent=2)
    print(json.dumps({k: out[k] for k in ("device", "smc", "fraction_of_graph_limit", "llamppl")}, indent=1))
    return out


if __name__ == "__main__":
    main()
