"""The LLaMPPL race (issue 16): SMC over a HuggingFace model under a "no letter e" mask, against the
forward-only KV-cached limit of the same model, and against LLaMPPL when it is installed.

    python benchmarks/llamppl_race.py --json FILE [--quick]

Workload: a random GPT-2 (2 layers, d=128, 2 heads) with a byte-level BPE vocabulary of 512 trained in
process (nothing downloaded), a prompt of 16 tokens, 32 generated tokens whose decoded strings contain
no letter e (a one-state token automaton admitting those tokens and <eos>), SMC resampling when the ESS
falls under n/2. Figures are particle-tokens per second (particles x 32 / wall time, prompt included)
at 16 / 64 / 256 particles, best of a few runs after a warm-up, one torch thread:

- ``ppl_thought``: ``SMC(n).run(Lipogram(...), None, prompt)``: bootstrap SMC whose model draws each
  token from the masked LM (Def 2.8) and weights it by the LM's mass on the admitted tokens
  (``pyro.factor``), so the target is the LM restricted to e-free text, Z = P(e-free);
- ``limit``: the same HF model alone, run eagerly with a ``DynamicCache``: the prompt encoded once and
  repeated to n rows, then 32 single-token steps of n rows (no sampling, no masking, no weights);
- ``llamppl``: a ``llamppl.Model`` whose ``step`` samples a masked next token the same way, run with
  ``smc_standard`` (null when llamppl is not importable).

The JSON has ``{"n", "ppl_thought", "limit", "fraction", "llamppl", "workload"}``; ``workload["extra"]``
holds the ratio to LLaMPPL, the forward-only rate through the adapter (``adapter_forward``: the same
loop as ``limit`` with library ids, float32 library logits and the in-place KVCache), the seconds of each
run and the number of resampling steps. The runs of one particle count are timed in interleaved rounds
(best of each; one warm-up round), so their ratios are measured under the same load; ``--quick`` takes
one round instead of five.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import pyro
import torch

import ppl_thought as pt
from ppl_thought.inference import SMC
from ppl_thought.projections import Automaton, AutomatonBuilder
from ppl_thought.vocab import EOS_ID, TokenizerVocab

WORKLOAD = {"model": "random GPT-2", "n_layer": 2, "n_embd": 128, "n_head": 2, "vocab_size": 512,
            "prompt_tokens": 16, "new_tokens": 32, "mask": "no letter e (a one-state token automaton) + <eos>",
            "ess_threshold": 0.5, "resampling": "systematic (ppl_thought), multinomial (llamppl)",
            "torch_threads": 1}
SIZES = [16, 64, 256]

_WORDS = ("a about all also and any are as at back be because but by can come could day do even first for "
          "from get give go good have he her him his how i if in into it its just know like look make man "
          "me most my new no not now of on one only or other our out over people say see she so some take "
          "than that the their them then there these they think this time to two up us use want way we well "
          "what when which who will with work would year you your spoon quick brown fox jumps lazy dog crab "
          "prawn cold sun path road north wind storm bird song hill lamp black white green fish draw stop").split()


def corpus(n_sentences: int = 400, seed: int = 0) -> list[str]:
    """Seeded pseudo-English to train the BPE on (words drawn from a fixed list)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 14))) + "." for _ in range(n_sentences)]


def build(vocab_size: int = 512, n_layer: int = 2, n_embd: int = 128, n_head: int = 2, seed: int = 0):
    """(adapter, prompt ids [16] as library ids) for the race; nothing is downloaded."""
    from ppl_thought.lm.huggingface import HuggingFace, random_gpt2, train_bpe_tokenizer

    texts = corpus()
    tok = train_bpe_tokenizer(texts, vocab_size)
    lm = HuggingFace(random_gpt2(len(tok), n_layer=n_layer, n_embd=n_embd, n_head=n_head, seed=seed), tok)
    prompt = torch.tensor(lm.vocab.encode(" ".join(texts[:4]))[: WORKLOAD["prompt_tokens"]])
    return lm, prompt


def lipogram_automaton(vocab: TokenizerVocab, letter: str = "e") -> Automaton:
    """One state that admits every ordinary token whose decoded string has no ``letter`` (either case), and
    ``<eos>`` (the thought markers and the tokenizer's other specials are not admitted)."""
    b = AutomatonBuilder(len(vocab), name=f"no-{letter}")
    s = b.add_state()
    bad = {letter.lower(), letter.upper()}
    ok = [i for i in vocab.ordinary_ids.tolist() if not bad & set(vocab.decode([i]))]
    b.edge(s, ok + [EOS_ID], s)
    return b.build(start=s)


#: the LM restricted to the lipogram's language: the library's conditioned-LM program (masked proposal + the
#: mass factors log Z_t, ppl_thought/models/constrained.py)
Lipogram = pt.models.Constrained


def forward_limit(model, prompt_hf: torch.Tensor, n: int, steps: int, seed: int = 0):
    """The HF model alone: prompt [1, P] encoded once and repeated to n rows, then ``steps`` single-token
    steps of n rows through a ``DynamicCache`` (random tokens, drawn beforehand)."""
    g = torch.Generator().manual_seed(seed)
    feed = torch.randint(0, model.config.vocab_size, (steps, n, 1), generator=g)

    def run():
        with torch.no_grad():
            out = model(input_ids=prompt_hf[None], use_cache=True)
            cache = out.past_key_values
            cache.batch_repeat_interleave(n)
            for t in range(steps):
                out = model(input_ids=feed[t], past_key_values=cache, use_cache=True)
        return out.logits

    return run


def ppl_thought_run(lm, constraint, prompt, n: int, steps: int, seed: int = 0):
    program = Lipogram(lm, constraint, steps)
    results = []

    def run():
        pyro.set_rng_seed(seed)
        with torch.no_grad():
            results.append(SMC(n, ess_threshold=WORKLOAD["ess_threshold"]).run(program, None, prompt))
        return results[-1]

    return run, results


def llamppl_available() -> bool:
    try:
        import llamppl  # noqa: F401
    except Exception:
        return False
    return True


def adapter_forward(lm, prompt: torch.Tensor, n: int, steps: int, seed: int = 0):
    """Forward only through the adapter (library ids in, float32 library logits out, the KVCache appended in
    place): the model's cost plus the adapter's, without sampling, masking, weights or the engine."""
    g = torch.Generator().manual_seed(seed)
    feed = torch.randint(6, lm.vocab_size, (steps, n, 1), generator=g)
    ctx = torch.cat([torch.tensor([lm.vocab.bos_id]), prompt])[None]

    def run():
        with torch.no_grad():
            _, cache = lm(ctx)
            cache = cache.expand(n)
            for t in range(steps):
                logits, cache = lm(feed[t], cache=cache)
        return logits

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="comma-separated particle counts (default 16,64,256)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    rounds = 1 if args.quick else 5
    steps = WORKLOAD["new_tokens"]
    lm, prompt = build(WORKLOAD["vocab_size"], WORKLOAD["n_layer"], WORKLOAD["n_embd"], WORKLOAD["n_head"])
    constraint = lipogram_automaton(lm.vocab)
    prompt_hf = lm.to_hf(torch.cat([torch.tensor([lm.vocab.bos_id]), prompt]))
    race = llamppl_race(lm, constraint, prompt) if llamppl_available() else None
    extra: dict = {"llamppl_ratio": {} if race is not None else None, "adapter_forward": {}, "seconds": {},
                   "ppl_thought_resampling_steps": {}, "ppl_thought_log_marginal": {}}
    out: dict = {"n": sizes, "ppl_thought": {}, "limit": {}, "fraction": {}, "llamppl": {} if race else None,
                 "workload": {**WORKLOAD, "admitted_tokens": int(constraint.allowed[0].sum()),
                              "library_vocab": len(lm.vocab), "rounds": rounds, "torch": torch.__version__,
                              "transformers": _version("transformers"), "llamppl": _version("llamppl"),
                              "machine": platform.machine(), "cpu_count": os.cpu_count(),
                              "load_average_at_start": os.getloadavg()[0], "extra": extra}}
    for n in sizes:
        key = str(n)
        run, results = ppl_thought_run(lm, constraint, prompt, n, steps)
        runs = {"limit": forward_limit(lm.model, prompt_hf, n, steps), "ppl_thought": run,
                "adapter_forward": adapter_forward(lm, prompt, n, steps)}
        if race is not None:
            runs["llamppl"] = lambda n=n: race(n)
        best = dict.fromkeys(runs, float("inf"))
        for rnd in range(1 + rounds):  # round 0 warms up; then interleaved rounds, best of each (same load)
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                if rnd:
                    best[name] = min(best[name], time.perf_counter() - t0)
        rate = {name: n * steps / t for name, t in best.items()}
        out["limit"][key], out["ppl_thought"][key] = rate["limit"], rate["ppl_thought"]
        out["fraction"][key] = rate["ppl_thought"] / rate["limit"]
        extra["adapter_forward"][key] = rate["adapter_forward"]
        extra["seconds"][key] = best
        res = results[-1]
        extra["ppl_thought_resampling_steps"][key] = int(sum(bool(r) for r in res.stats["resampled"]))
        extra["ppl_thought_log_marginal"][key] = float(res.log_marginal)
        if race is not None:
            out["llamppl"][key] = rate["llamppl"]
            extra["llamppl_ratio"][key] = rate["ppl_thought"] / rate["llamppl"]
        print(json.dumps({key: {k: round(v, 1) for k, v in rate.items()}}), flush=True)
    out["workload"]["load_average_at_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def llamppl_race(lm, constraint, prompt):
    """``race(n)``: one LLaMPPL SMC run of the same workload with n particles (written from LLaMPPL's
    documented API: a ``llamppl.Model`` whose ``step`` observes ``mask_dist(mask) == True``, i.e. weights
    the particle by the LM's mass on the admitted tokens and restricts the next token to them, then
    samples ``next_token()``; ``smc_standard`` at ESS n/2). The same HF model and tokenizer objects, the
    same prompt ids (<bos> + 16 tokens), the prompt's KV cached with ``cache_kv``, the backend batching
    up to n queries at once; every run starts from cleared caches."""
    import asyncio

    import numpy as np
    from genlm.backend.llm import AsyncTransformer
    from llamppl import CachedCausalLM, LMContext, Model, smc_standard

    prompt_hf = lm.to_hf(torch.cat([torch.tensor([lm.vocab.bos_id]), prompt])).tolist()
    text = lm.tokenizer.decode(prompt_hf)
    if lm.tokenizer.encode(text) != prompt_hf:
        raise RuntimeError("the prompt does not re-tokenize to the same ids; pick another prompt")
    admitted = set(lm.to_hf(torch.as_tensor(constraint.allowed[0].nonzero()[0])).tolist())
    eos = int(lm.to_hf(torch.tensor(EOS_ID)))
    steps = WORKLOAD["new_tokens"]

    class Lipogram(Model):
        def __init__(self, llm, prompt_text):
            super().__init__()
            self.context = LMContext(llm, prompt_text)
            self.mask, self.eos, self.left = admitted, eos, steps

        def immutable_properties(self):
            return {"mask", "eos"}

        async def step(self):
            await self.observe(self.context.mask_dist(self.mask), True)  # weight: mass of the mask
            token = await self.sample(self.context.next_token())
            self.left -= 1
            if token.token_id == self.eos or self.left == 0:
                self.finish()

    llms: dict[int, CachedCausalLM] = {}

    def race(n: int):
        if n not in llms:
            llms[n] = CachedCausalLM(AsyncTransformer(lm.model, lm.tokenizer, batch_size=n))
        llm = llms[n]
        llm.clear_cache()
        np.random.seed(0)
        llm.cache_kv(prompt_hf)
        with torch.no_grad():
            return asyncio.run(smc_standard(Lipogram(llm, text), n, ess_threshold=WORKLOAD["ess_threshold"]))

    return race


if __name__ == "__main__":
    main()
