"""Steer a HuggingFace causal LM with SMC: a lipogram (no letter e) and a grammar (a regular expression).

    python examples/hf_steering.py [--model PATH] [--particles 64] [--max-tokens 24] [--json FILE]

With ``--model`` it loads a local ``transformers`` model folder (``pt.lm.HuggingFace.from_pretrained``);
without, it builds a tiny GPT-2 and a byte-level BPE tokenizer in-process and teaches it a little
pseudo-English for a few seconds (nothing is downloaded). For each constraint it builds a character
automaton (``CharDFA``), lifts it to the tokenizer's vocabulary (``token_automaton``), and runs SMC on
``pt.models.Constrained``: the LM conditioned on the constraint's language, proposed by the masked LM and
weighted by the mass the mask removes. A twist (``pt.twist``) steers resampling towards particles whose
current word is short, without changing the target. It prints the highest-weight completions, log Z-hat
(the log-probability that the LM's own text would satisfy the constraint) and checks every completion
against the character automaton.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import pyro
import torch

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.inference import SMC
from ppl_thought.io import atomic_write_json
from ppl_thought.projections import CharDFA, token_automaton, token_texts
from ppl_thought.vocab import BOS_ID

WORDS = ("a about all also and any are as at back be because but by can come day do even first for from get "
         "go good have he her him his how if in into it just know like look make man me my new no not now of on "
         "one only or our out over say see she so some take than that the them then they think this time to two "
         "up use want way we well what when who will with work you spoon quick brown fox jumps lazy dog crab "
         "prawn cold sun path road north wind storm bird song hill lamp black white green fish draw stop").split()


def tiny_model(train_steps: int, seed: int = 0):
    """A 2-layer GPT-2 over a 512-token byte-level BPE, trained briefly on seeded pseudo-English."""
    from ppl_thought.lm.huggingface import HuggingFace, random_gpt2, train_bpe_tokenizer

    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + "." for _ in range(600)]
    tok = train_bpe_tokenizer(texts, 512)
    lm = HuggingFace(random_gpt2(len(tok), n_layer=2, n_embd=128, n_head=2, seed=seed), tok)
    ids = [torch.tensor([BOS_ID] + lm.vocab.encode(t) + [lm.vocab.eos_id]) for t in texts]
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    lm.train()
    for _ in range(train_steps):  # teacher forcing through the adapter's own forward
        batch = torch.nn.utils.rnn.pad_sequence(rng.sample(ids, 16), batch_first=True, padding_value=0)
        logits, _ = lm(batch[:, :-1])
        target = batch[:, 1:].masked_fill(batch[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    lm.eval()
    return lm, " ".join(texts[0].split()[:4])


def short_words_twist(vocab):
    """log psi = -0.3 x (characters of the current, unfinished word): a lookahead that favours particles about to
    end a word; SMC adds it at each step and removes it at the next, so the target is unchanged."""
    texts = token_texts(vocab)
    length = torch.tensor([len(t) if t else 0 for t in texts], dtype=torch.float32)
    breaks = torch.tensor([bool(t) and (" " in t or "." in t) for t in texts])

    def twist(tokens: torch.Tensor) -> torch.Tensor:
        n, T = tokens.shape
        if T == 0:
            return torch.zeros(n)
        pos = torch.arange(T).expand(n, -1)
        last_break = torch.where(breaks[tokens], pos, torch.full_like(pos, -1)).max(-1).values
        since = torch.where(pos > last_break[:, None], length[tokens], torch.zeros(n, T)).sum(-1)
        return -0.3 * since

    return twist


def steer(lm, prompt: str, name: str, dfa: CharDFA, n: int, T: int, twist) -> dict:
    vocab = lm.vocab
    auto = token_automaton(dfa, token_texts(vocab))
    program = pt.models.Constrained(lm, auto, T, twist=twist)
    pyro.set_rng_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        res = SMC(n, ess_threshold=0.5).run(program, None, torch.tensor(vocab.encode(prompt)))
    seconds = time.perf_counter() - t0
    toks = torch.stack([res.samples[f"x_{t}"] for t in range(T) if f"x_{t}" in res.samples], -1)
    w = torch.softmax(res.log_weights, 0)
    texts = [vocab.decode([i for i in row if i > vocab.eos_id]) for row in toks.tolist()]
    ended = (toks == vocab.eos_id).any(-1)
    ok = [dfa.accepts(t) if e else dfa.admits_prefix(t) for t, e in zip(texts, ended.tolist())]
    best = torch.argsort(w, descending=True)[:3].tolist()
    print(f"\n== {name}: log Z-hat {float(res.log_marginal):.3f}, ESS {float(res.ess):.1f} of {n}, "
          f"{seconds:.1f} s, all completions satisfy it: {all(ok)}")
    for i in best:
        print(f"  w={float(w[i]):.3f}  {prompt!r} + {texts[i]!r}{'' if ended[i] else ' (cut)'}")
    return {"log_marginal": float(res.log_marginal), "ess": float(res.ess), "seconds": seconds,
            "all_satisfy": all(ok), "ended_fraction": float(ended.float().mean()),
            "top": [texts[i] for i in best]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a local transformers model folder (default: a tiny model)")
    ap.add_argument("--particles", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--train-steps", type=int, default=60, help="training steps of the tiny model")
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    if args.model:
        lm, prompt = pt.lm.HuggingFace.from_pretrained(args.model), "Once upon a time"
    else:
        lm, prompt = tiny_model(args.train_steps)
    prompt = args.prompt or prompt
    twist = short_words_twist(lm.vocab)
    out = {
        "lipogram": steer(lm, prompt, "no letter e", CharDFA.lipogram("e"), args.particles, args.max_tokens, twist),
        "grammar": steer(lm, prompt, "words then a full stop", CharDFA.from_regex(r"( [a-z]+)+\."),
                         args.particles, args.max_tokens, twist),
    }
    if args.json:
        out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, out)
        print(json.dumps({k: {"log_marginal": v["log_marginal"], "ess": v["ess"]} for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
