"""Verifier-guided generation on the Dyck sandbox (thesis Ch. 3), measured against exact answers.

    python -m ppl_thought.experiments.verifiers [--quick] [--seed S] [--json FILE]

1. Train a small Transformer on Dyck_{k,D} strings of length N whose bracket types follow an unbalanced law,
   then complete out-of-distribution prefixes (the opposite type law), as in Section 3.2.1.
2. Compare, per prompt and with the same number of samples, plain sampling, nucleus sampling (top-p 0.9),
   tokenwise rejection (Def 3.1.5), Algorithm 1 (Q = 4, B = 4), VGB (Algorithm 2, first-leaf output), and the
   exact baselines SMC with the verifier as twist and AWRS-style weighted rejection
   (:class:`~ppl_thought.inference.VerifierSMC`), all with the perfect process verifier of the prompt's
   completions. Measured: accuracy (completions in Dyck), total variation to the exact constrained
   distribution of the trained LM given the prompt (enumerated), distinct completions per sample, LM and
   verifier calls per sample.
3. Propositions 3.1.1-3.1.2 on the uniform oracle: the oracle-call counts and the tokenwise bias.
4. Self-reducible sampling (cot-or-loop Section 5), when :mod:`ppl_thought.data.self_reducible` is present.
5. ``thesis_tables``: the thesis' own protocol, Tables 3.1-3.3 at small scale (Definition 3.2.1's Dyck law, a
   trained imperfect verifier, OOD error counts with and without backtracking at top-p 0.9 / 1.0) beside the
   thesis' figures: :mod:`ppl_thought.experiments.dyck_thesis`. ``--thesis-only`` runs that part alone.

Everything is built from library parts: :class:`~ppl_thought.data.DyckTask`, :class:`~ppl_thought.lm.Transformer`,
the engines of :mod:`ppl_thought.inference`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ppl_thought import provenance as pv
from ppl_thought.data.dyck import DyckTask
from ppl_thought.data.self_reducible import self_reducible_curve
from ppl_thought.distributions.lm_state import generated_tokens
from ppl_thought.experiments import dyck_thesis
from ppl_thought.experiments.common import score
from ppl_thought.inference.resampling import resample
from ppl_thought.io import atomic_write_json
from ppl_thought.lm import Tabular, Transformer
from ppl_thought.projections.automaton import AutomatonBuilder
from ppl_thought.verifiers import (
    VGB,
    ProcessVerifier,
    RejectionSampling,
    TokenwiseBacktracking,
    TokenwiseRejection,
    VerifierSMC,
)
from ppl_thought.vocab import BOS_ID, Vocab

METHODS = ("sample", "nucleus", "tokenwise", "backtracking", "vgb", "smc", "awrs")
IN_DIST, OUT_OF_DIST = (0.8, 0.2), (0.2, 0.8)


def train_dyck_lm(task: DyckTask, steps: int, batch: int = 64, seed: int = 0, lr: float = 3e-3) -> Transformer:
    """A small Transformer trained by teacher forcing on in-distribution Dyck strings (type law ``IN_DIST``)."""
    torch.manual_seed(seed)
    lm = Transformer(len(task.vocab), d_model=64, n_layers=2, n_heads=4, max_len=task.N + 1)
    opt = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.01)
    data = task.sample(steps * batch, IN_DIST, seed=seed)
    bos = torch.full((batch, 1), BOS_ID, dtype=torch.long)
    lm.train()
    for i in range(steps):
        z = data[i * batch:(i + 1) * batch]
        logits, _ = lm(torch.cat([bos, z[:, :-1]], 1))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), z.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    lm.eval()
    return lm


def exact_law(lm: torch.nn.Module, prompt: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """The LM's distribution restricted to ``completions`` of ``prompt``: p(c | prompt) 1(c valid) / Z."""
    C = completions.shape[0]
    ctx = torch.cat([torch.full((C, 1), BOS_ID), prompt.expand(C, -1), completions], 1)
    with torch.no_grad():
        seq = score(lm, ctx, 1 + prompt.numel(), generated_tokens(lm.vocab_size)).sum(-1)
    return torch.softmax(seq.double(), 0)


def _run(method: str, lm, ver: ProcessVerifier, prompt: torch.Tensor, n: int, L: int):
    if method in ("sample", "nucleus", "backtracking"):
        q, b = (4, 4) if method == "backtracking" else (0, 1)
        res = TokenwiseBacktracking(n, L, quota=q, stride=b, top_p=0.9 if method == "nucleus" else 1.0)
        return res.run(lm, ver, prompt)
    if method == "tokenwise":
        return TokenwiseRejection(n, L).run(lm, ver, prompt)
    if method == "vgb":
        return VGB(n, L, num_steps=16 * L, output="first_leaf").run(lm, ver, prompt)
    return VerifierSMC(n, L, proposal="masked" if method == "smc" else "rejection").run(lm, ver, prompt)


def _scores(z: torch.Tensor, w: torch.Tensor, completions: torch.Tensor, law: torch.Tensor) -> tuple[float, float]:
    """(accuracy, total variation to ``law``) of the weighted samples ``z`` (mass outside counts in full)."""
    index = {tuple(c): j for j, c in enumerate(completions.tolist())}
    emp = torch.zeros(len(index), dtype=torch.float64)
    outside = 0.0
    for row, wi in zip(z.tolist(), w.tolist()):
        j = index.get(tuple(row))
        if j is None:
            outside += wi
        else:
            emp[j] += wi
    return 1.0 - outside, 0.5 * (float((emp - law).abs().sum()) + outside)


def compare_methods(lm, task: DyckTask, prompts: torch.Tensor, n: int, seed: int = 0) -> tuple[dict, float]:
    """Every method on every prompt: mean accuracy, TV, distinct fraction, LM / verifier calls per sample; and the
    TV floor, the mean TV of ``n`` i.i.d. draws from the exact law (what an exact sampler scores with ``n``)."""
    table = {m: {"accuracy": 0.0, "tv": 0.0, "distinct": 0.0, "lm_calls": 0.0, "verifier_calls": 0.0}
             for m in METHODS}
    floor = 0.0
    for p_i, prompt in enumerate(prompts):
        ver = task.verifier(prompt.tolist())
        L = task.N - prompt.numel()
        completions = task.completions(prompt.tolist())
        law = exact_law(lm, prompt, completions)
        g = torch.Generator().manual_seed(seed + p_i)
        for _ in range(10):
            draws = completions[torch.multinomial(law, n, replacement=True, generator=g)]
            uniform = torch.full((n,), 1.0 / n, dtype=torch.float64)
            floor += _scores(draws, uniform, completions, law)[1] / 10 / len(prompts)
        for method in METHODS:
            torch.manual_seed(seed + 1000 * p_i)
            res = _run(method, lm, ver, prompt, n, L)
            z = res.samples["z"]
            if res.log_weights is None:
                w = torch.full((n,), 1.0 / n, dtype=torch.float64)
                drawn = z
            else:
                w = torch.softmax(res.log_weights.double(), 0)
                drawn = z[resample(w, "systematic")]
            acc, tv = _scores(z, w, completions, law)
            row = table[method]
            row["accuracy"] += acc / len(prompts)
            row["tv"] += tv / len(prompts)
            row["distinct"] += len({tuple(r) for r in drawn.tolist()}) / n / len(prompts)
            row["lm_calls"] += res.stats["lm_calls"] / n / len(prompts)
            row["verifier_calls"] += res.stats.get("verifier_calls", res.stats.get("value_calls", 0)) / n / len(prompts)
    return table, floor


def _bits_task():
    bits = Vocab(["0", "1"])
    zero, one = bits.id("0"), bits.id("1")
    lg = torch.full((len(bits),), float("-inf"))
    lg[[zero, one]] = 0.0
    return bits, zero, one, Tabular(1, len(bits), lg, trainable=False)


def propositions(quick: bool, seed: int = 0) -> tuple[dict, dict]:
    """Prop 3.1.2 (tokenwise bias on A = strings with a 0, D = 4) and Prop 3.1.1 (oracle calls on A = {0^D}, D = 5),
    measured on the uniform oracle: ({measured, predicted}, {rejection, tokenwise, predicted_*})."""
    bits, zero, one, lm = _bits_task()
    D = 4
    b = AutomatonBuilder(len(bits), "has-a-0")
    none, seen = b.add_state(), b.add_state(final=True)
    b.edge(none, [one], none)
    b.edge(none, [zero], seen)
    b.edge(seen, [zero, one], seen)
    torch.manual_seed(seed)
    z = TokenwiseRejection(2000 if quick else 20000, D).run(lm, ProcessVerifier(b.build(), D)).samples["z"]
    target = torch.tensor([one] * (D - 1) + [zero])
    bias = {"measured": float((z == target).all(-1).float().mean()), "predicted": 2.0 ** -(D - 1),
            "restricted": 1 / (2**D - 1)}

    D = 5
    b = AutomatonBuilder(len(bits), "0^D")
    s = [b.add_state(final=(i == D)) for i in range(D + 1)]
    for i in range(D):
        b.edge(s[i], [zero], s[i + 1])
    ver = ProcessVerifier(b.build(max_len=D), D)
    rej = RejectionSampling(200 if quick else 1000, D, batch_size=2048).run(lm, ver)
    tok = TokenwiseRejection(2000 if quick else 10000, D).run(lm, ver)
    calls = {"rejection": float(rej.stats["lm_calls_per_sample"].double().mean()),
             "tokenwise": float(tok.stats["lm_calls_per_sample"].double().mean()),
             "predicted_rejection": float(2**D * D), "predicted_tokenwise": float(2 * D)}
    return bias, calls


def self_reducible(quick: bool, seed: int = 0) -> dict:
    return self_reducible_curve([1, 3, 5, 9, 17, 33], seed=seed, quick=quick)


def run(quick: bool = False, seed: int = 0, thesis_only: bool = False) -> dict:
    """The whole experiment; the returned dict is what ``--json`` writes (``thesis_only``: the
    ``thesis_tables`` entry alone)."""
    if thesis_only:
        return {"thesis_tables": dyck_thesis.run(quick, seed)}
    t0 = time.perf_counter()
    task = DyckTask(k=2, D=4, N=12)
    lm = train_dyck_lm(task, steps=300 if quick else 1500, seed=seed)
    prompts = task.sample(4 if quick else 12, OUT_OF_DIST, length=task.N // 2, seed=seed + 1)
    table, floor = compare_methods(lm, task, prompts, n=200 if quick else 500, seed=seed)
    bias, calls = propositions(quick, seed)
    return {
        "dyck": table,
        "tokenwise_bias": bias,
        "oracle_calls": calls,
        "self_reducible": self_reducible(quick, seed),
        "thesis_tables": dyck_thesis.run(quick, seed),
        "setup": {"k": task.k, "D": task.D, "N": task.N, "prompt_len": task.N // 2, "prompts": len(prompts),
                  "samples_per_prompt": 200 if quick else 500, "tv_floor": floor,
                  "train_types": IN_DIST, "prompt_types": OUT_OF_DIST,
                  "quick": quick, "seed": seed, "seconds": round(time.perf_counter() - t0, 1)},
    }


def format_table(result: dict) -> str:
    if "dyck" not in result:
        return dyck_thesis.format_table(result["thesis_tables"])
    lines = [f"{'method':<13}{'accuracy':>9}{'TV':>8}{'distinct':>9}{'LM calls':>10}{'verifier':>10}"]
    for m, r in result["dyck"].items():
        lines.append(f"{m:<13}{r['accuracy']:>9.3f}{r['tv']:>8.3f}{r['distinct']:>9.3f}{r['lm_calls']:>10.1f}"
                     f"{r['verifier_calls']:>10.1f}")
    lines.append(f"(TV of as many i.i.d. exact draws: {result['setup']['tv_floor']:.3f})")
    b, c = result["tokenwise_bias"], result["oracle_calls"]
    lines.append(f"Prop 3.1.2: P(1^(D-1)0) measured {b['measured']:.4f}, predicted {b['predicted']:.4f} "
                 f"(restricted law {b['restricted']:.4f})")
    lines.append(f"Prop 3.1.1: LM calls rejection {c['rejection']:.1f} (predicted {c['predicted_rejection']:.0f}), "
                 f"tokenwise {c['tokenwise']:.2f} (predicted {c['predicted_tokenwise']:.0f})")
    if result.get("self_reducible"):
        sr = result["self_reducible"]
        lines.append("self-reducible: T " + " ".join(str(t) for t in sr["T"]) + " | TV "
                     + " ".join(f"{v:.3f}" for v in sr["tv"]))
    lines.append(dyck_thesis.format_table(result["thesis_tables"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer training steps, prompts and samples (minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON to this file")
    ap.add_argument("--thesis-only", action="store_true", help="only the thesis' Tables 3.1-3.3 protocol")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    result = run(args.quick, args.seed, args.thesis_only)
    print(format_table(result))
    if args.json is not None:
        result[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
