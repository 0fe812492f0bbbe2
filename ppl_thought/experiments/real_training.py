"""Section 7's comparison on a real LM: SFT vs latent training with the predictive or the explanatory sampler, with
LoRA adapters on SmolLM2-135M-Instruct (issue 43).

    python examples/real_training.py [--quick] [--seeds 2] [--steps N] [--device cuda] [--dtype bf16] [--json F]

The task (:func:`sum_problems`): two-digit additions whose ones digits carry, ``"47+38="``, answer ``85``. The
thought that helps is the carry step (``"7+8=15"``, the gold thought, kept for display only: training never sees
it). Every text is short (a row is < 48 tokens) and has one length per format, so batches are dense. The model
(the same format as :class:`~ppl_thought.experiments.real_thoughts.ThoughtThenAnswer`):

    P(thought, answer | question) = P(thought | question <think>) P(answer | question <think> thought
                                    </think> The answer is)

with the thought a free-text segment that ends at its first token starting a tag or after ``max_thought``
tokens. The three trainings, from the same base and fresh adapters, at equal compute (the same number of steps,
each a forward + backward over ``batch x particles`` rows, all clipped jointly to norm 1, App. L):

- ``sft``: -log P(answer | question, empty thought) on ``batch x particles`` questions (answers only);
- ``predictive``: (7.1) (:func:`~ppl_thought.experiments.sec7_losses.latent_surrogate`) with thoughts from the
  predictive sampler, here P's own prior (so the weights are P(answer | question, thought));
- ``explanatory``: (7.1) for P and (7.2) (:func:`~ppl_thought.experiments.sec7_losses.sampler_surrogate`) for the
  sampler Q(thought | question, answer) = App. L's gate (:func:`~ppl_thought.experiments.sec7_losses.gate_mix`)
  over the logits of the predictive context (fast) and of a context that shows the answer (slow, Figure 5.2),
  the gate an MLP on the two contexts' last features; both clipped jointly
  (:func:`~ppl_thought.experiments.sec7_losses.clip_gradients_`).

Held-out evaluation before and after each training: the accuracy of ranking four candidate answers (the right
one, the carry forgotten, +-1) by p(answer | question) with the thought marginalised by importance sampling from
the prior (:func:`marginal_scores`, batched over questions, particles and candidates; the same estimator as
bootstrap SMC), the mean log p(right answer | question) by SMC with real_thoughts' program
(:class:`~ppl_thought.experiments.real_thoughts.ThoughtThenAnswer`, ``pt.infer.SMC``), and direct scoring
(empty thought). Means and standard errors over seeds.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

import pyro
import torch
from torch import nn

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.errors import ConfigError
from ppl_thought.experiments.common import provenance
from ppl_thought.experiments.real_thoughts import Problem, Prompts, ThoughtThenAnswer
from ppl_thought.experiments.sec7_losses import clip_gradients_, gate_mix, latent_surrogate, sampler_surrogate
from ppl_thought.io import atomic_write_json
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["SumPrompts", "sum_problems", "sample_thoughts", "score", "train", "evaluate", "run", "report", "main"]

METHODS = ("sft", "predictive", "explanatory")


def sum_problems(k: int, seed: int = 0) -> list[Problem]:
    """``k`` additions ``a + b < 100`` of two-digit numbers whose ones digits carry, each with four candidates: the
    answer, the answer without the carry (``- 10``) and ``+- 1``, shuffled."""
    rng = random.Random(seed)
    out = []
    while len(out) < k:
        a, b = rng.randint(10, 89), rng.randint(10, 89)
        if a % 10 + b % 10 < 10 or a + b > 99:
            continue
        ans = a + b
        cands = [ans, ans - 10, ans + 1, ans - 1]
        rng.shuffle(cands)
        out.append(Problem(f"{a}+{b}=", ans, cands))
    return out


def gold_thought(p: Problem) -> str:
    a, b = (int(x) for x in p.question.rstrip("=").split("+"))
    return f"{a % 10}+{b % 10}={a % 10 + b % 10}"


class SumPrompts(Prompts):
    """:class:`~ppl_thought.experiments.real_thoughts.Prompts` in plain text (no chat template: rows stay short)."""

    def chat(self, user: str) -> list[int]:
        return self.vocab.encode(user)

    def explanatory_prompt(self, question: str, answer: int) -> torch.Tensor:
        return torch.tensor(self.vocab.encode(f"{question}{answer}. Why? ") + self.open_think)


def _rows(prompts: list[torch.Tensor], device) -> torch.Tensor:
    """``[BOS] + prompt`` rows ``[N, L]``; the prompts of one format have one length (checked)."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ConfigError(f"the prompts of one batch must have one length (dense rows), got lengths {sorted(lengths)}")
    body = torch.stack(prompts).to(device)
    return torch.cat([torch.full((len(prompts), 1), BOS_ID, device=device), body], 1)


def _features_hook(lm: pt.lm.HuggingFace, out: dict):
    """Record the input of the unembedding (f_pre of App. L) of every forward."""
    head = lm.model.get_output_embeddings()
    return head.register_forward_pre_hook(lambda _m, args: out.__setitem__("f", args[0]))


@torch.no_grad()
def sample_thoughts(lm: pt.lm.HuggingFace, fast: torch.Tensor, stop: torch.Tensor, max_tokens: int,
                    slow: torch.Tensor | None = None, gate: nn.Module | None = None
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Thoughts ``[N, max_tokens]`` (``<pad>`` after a row's end; the stop token that ends a row is its last),
    all rows at once with KV caches: from the LM after the contexts ``fast [N, L]`` (the predictive sampler),
    or with ``slow`` and ``gate`` from App. L's gated mix of the two contexts' logits (the explanatory
    sampler), whose per-step features and logits are returned (detached) for :func:`gated_log_q`. No host sync
    per token: every row runs ``max_tokens`` steps."""
    feats: dict = {}
    handle = _features_hook(lm, feats) if gate is not None else None
    try:
        logits_f, cache_f = lm(fast)
        logits_f, f_f = logits_f[:, -1], (feats["f"][:, -1] if gate is not None else None)
        if gate is not None:
            logits_s, cache_s = lm(slow)
            logits_s, f_s = logits_s[:, -1], feats["f"][:, -1]
        n = fast.shape[0]
        out = torch.full((n, max_tokens), PAD_ID, dtype=torch.long, device=fast.device)
        live = torch.ones(n, dtype=torch.bool, device=fast.device)
        kept = []
        for t in range(max_tokens):
            if gate is None:
                mixed = logits_f
            else:
                kept.append((f_f.float(), f_s.float(), logits_f, logits_s))
                mixed = gate_mix(gate, f_f.float(), f_s.float(), logits_f, logits_s)
            u = torch.rand(mixed.shape, device=mixed.device).clamp_(1e-20, 1.0)
            tok = (mixed - torch.log(-torch.log(u))).argmax(-1)  # Gumbel-max: one draw of softmax(mixed)
            tok = torch.where(live, tok, PAD_ID)
            out[:, t] = tok
            live = live & ~torch.isin(tok, stop)
            if t + 1 < max_tokens:
                logits_f, cache_f = lm(tok[:, None], cache_f)
                logits_f = logits_f[:, -1]
                if gate is not None:
                    f_f = feats["f"][:, -1]
                    logits_s, cache_s = lm(tok[:, None], cache_s)
                    logits_s, f_s = logits_s[:, -1], feats["f"][:, -1]
    finally:
        if handle is not None:
            handle.remove()
    if gate is None:
        return out, None
    return out, tuple(torch.stack(x, 1) for x in zip(*kept))


def gated_log_q(gate: nn.Module, kept: tuple[torch.Tensor, ...], thought: torch.Tensor) -> torch.Tensor:
    """log Q(thought | question, answer) ``[N]`` under the gated sampler, differentiable in the gate's parameters
    only (the LM's features and logits were recorded without gradients)."""
    f_f, f_s, l_f, l_s = kept
    logq = torch.log_softmax(gate_mix(gate, f_f, f_s, l_f, l_s), -1)
    lp = logq.gather(-1, thought[..., None]).squeeze(-1)
    return torch.where(thought != PAD_ID, lp, torch.zeros_like(lp)).sum(-1)


def score(lm: pt.lm.HuggingFace, prefix: torch.Tensor, thought: torch.Tensor, close: torch.Tensor,
          answer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced ``(log P(thought | prefix), log P(answer | prefix thought close))`` ``[N]`` float32 in one
    forward pass over all rows (differentiable in the LM's trainable parameters): the rows are ``prefix thought
    close answer`` with each thought's ``<pad>`` moved to the end of its row (right padding is never read)."""
    n, device = prefix.shape[0], prefix.device
    parts = [prefix, thought, close.to(device).expand(n, -1), answer]
    full = torch.cat(parts, 1)
    role = torch.cat([torch.full(p.shape, r, device=device) for r, p in enumerate(parts)], 1)
    keep = full != PAD_ID
    width = full.shape[1]
    dest = torch.where(keep, keep.cumsum(1) - 1, width)
    rows = torch.full((n, width + 1), PAD_ID, dtype=torch.long, device=device).scatter_(1, dest, full)[:, :width]
    roles = torch.full((n, width + 1), -1, dtype=torch.long, device=device).scatter_(1, dest, role)[:, :width]
    logits, _ = lm(rows)
    logits = logits[:, :-1]
    target = rows[:, 1:]
    lp = logits.gather(-1, target[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
    zero = torch.zeros_like(lp)
    return (torch.where(roles[:, 1:] == 1, lp, zero).sum(-1), torch.where(roles[:, 1:] == 3, lp, zero).sum(-1))


class Batches:
    """The token tensors of a list of problems (one format each), on the LM's device."""

    def __init__(self, prompts: SumPrompts, probs: list[Problem], device, answers: list[int] | None = None):
        answers = [p.answer for p in probs] if answers is None else answers
        self.model = _rows([prompts.model_prompt(p.question) for p in probs], device)
        self.direct = _rows([prompts.direct_prompt(p.question) for p in probs], device)
        self.explain = _rows([prompts.explanatory_prompt(p.question, a) for p, a in zip(probs, answers)], device)
        self.answer = torch.stack([prompts.answer(a) for a in answers]).to(device)
        self.empty = torch.zeros(len(probs), 0, dtype=torch.long, device=device)


def make_gate(lm: pt.lm.HuggingFace, hidden: int = 64) -> nn.Module:
    """The gate MLP of (L.2) on ``f_fast (+) f_slow``; its last layer starts at zero (an even mix)."""
    d = lm.model.get_output_embeddings().in_features
    gate = nn.Sequential(nn.Linear(2 * d, hidden), nn.Tanh(), nn.Linear(hidden, 2))
    nn.init.zeros_(gate[2].weight)
    nn.init.zeros_(gate[2].bias)
    return gate.to(next(lm.parameters()).device)


def train_step(lm, prompts: SumPrompts, method: str, probs: list[Problem], particles: int, max_thought: int,
               gate: nn.Module | None = None) -> dict:
    """The loss of one step of ``method`` on ``probs`` (backward done; the caller clips and steps). SFT reads
    ``len(probs) * particles`` problems, the latent methods ``len(probs)`` problems x ``particles`` thoughts."""
    device = next(lm.parameters()).device
    if method == "sft":
        b = Batches(prompts, probs, device)
        _, log_ans = score(lm, b.direct, b.empty, prompts.close[:0], b.answer)
        loss = -log_ans.mean()
        loss.backward()
        return {"loss": float(loss.detach()), "tokens": b.direct.numel() + b.answer.numel()}
    rep = [p for p in probs for _ in range(particles)]
    b = Batches(prompts, rep, device)
    stop = prompts.thought_end.to(device)
    if method == "predictive":
        thought, _ = sample_thoughts(lm, b.model, stop, max_thought)
    elif method == "explanatory":
        thought, kept = sample_thoughts(lm, b.model, stop, max_thought, slow=b.explain, gate=gate)
    else:
        raise ConfigError(f"method must be one of {METHODS}, got {method!r}")
    log_th, log_ans = score(lm, b.model, thought, prompts.close, b.answer)
    log_p = (log_th + log_ans).view(len(probs), particles)
    if method == "predictive":
        log_q = log_th.detach().view(len(probs), particles)
        loss = latent_surrogate(log_p, log_q).mean()
    else:
        log_q = gated_log_q(gate, kept, thought).view(len(probs), particles)
        loss = latent_surrogate(log_p, log_q).mean() + sampler_surrogate(log_p, log_q).mean()
    loss.backward()
    tokens = int((thought != PAD_ID).sum()) + b.model.numel() + b.answer.numel() + len(rep) * len(prompts.close)
    return {"loss": float(loss.detach()), "tokens": tokens, "log_p_answer": float(log_ans.detach().mean())}


def train(lm, prompts: SumPrompts, method: str, steps: int, batch: int, particles: int, max_thought: int,
          lr: float, seed: int, progress: bool = True) -> dict:
    """``steps`` AdamW steps of ``method`` from fresh adapters (:func:`~ppl_thought.lm.lora.reset_lora` with
    ``seed``), each on ``batch`` new training problems; joint clipping to norm 1 (App. L)."""
    from tqdm.auto import tqdm

    pt.lm.reset_lora(lm, seed)
    torch.manual_seed(seed)
    adapters = list(pt.lm.lora_parameters(lm).values())
    gate = make_gate(lm) if method == "explanatory" else None
    groups = [adapters] + ([list(gate.parameters())] if gate is not None else [])
    opt = torch.optim.AdamW([p for g in groups for p in g], lr=lr, weight_decay=0.0)
    history, tokens = [], 0
    t0 = time.perf_counter()
    for step in tqdm(range(steps), desc=f"{method} seed {seed}", file=sys.stderr, disable=not progress):
        probs = sum_problems(batch, seed=10_000 * (seed + 1) + step)
        opt.zero_grad(set_to_none=True)
        out = train_step(lm, prompts, method, probs, particles, max_thought, gate)
        out["grad_norm"] = clip_gradients_(groups, 1.0, "joint")[0]
        opt.step()
        tokens += out["tokens"]
        history.append(out)
    seconds = time.perf_counter() - t0
    return {"losses": [h["loss"] for h in history], "seconds": seconds, "tokens_per_s": tokens / seconds,
            "gate": gate}


@torch.no_grad()
def marginal_scores(lm, prompts: SumPrompts, probs: list[Problem], particles: int, max_thought: int,
                    chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``(log p(c | q) [k, 4], direct log P(c | q, empty thought) [k, 4], top thoughts)``: the thought marginalised
    by importance sampling from the prior (``particles`` thoughts per question, shared by its four candidates;
    log (1/n) sum_i P(c | q, thought_i), (5.7)), batched over questions, particles and candidates."""
    device = next(lm.parameters()).device
    stop = prompts.thought_end.to(device)
    k, n = len(probs), particles
    b = Batches(prompts, [p for p in probs for _ in range(n)], device)
    thought, _ = sample_thoughts(lm, b.model, stop, max_thought)
    rows = [(p, c, i) for j, p in enumerate(probs) for c in p.candidates for i in range(j * n, (j + 1) * n)]
    log_ans = []
    for s in range(0, len(rows), chunk):
        part = rows[s:s + chunk]
        idx = torch.tensor([i for _, _, i in part], device=device)
        ans = torch.stack([prompts.answer(c) for _, c, _ in part]).to(device)
        log_ans.append(score(lm, b.model[idx], thought[idx], prompts.close, ans)[1])
    per = torch.cat(log_ans).view(k, 4, n)
    marginal = torch.logsumexp(per, -1) - math.log(n)
    cb = Batches(prompts, [p for p in probs for _ in p.candidates], device,
                 answers=[c for p in probs for c in p.candidates])
    direct = score(lm, cb.direct, cb.empty, prompts.close[:0], cb.answer)[1].view(k, 4)
    texts = []
    for j, p in enumerate(probs[:3]):  # the thought with the largest weight for the right answer
        right = p.candidates.index(p.answer)
        best = j * n + int(per[j, right].argmax())
        texts.append(lm.vocab.decode([t for t in thought[best].tolist() if t != PAD_ID]))
    return marginal, direct, texts


def evaluate(lm, prompts: SumPrompts, probs: list[Problem], particles: int, max_thought: int, seed: int,
             smc_problems: int) -> dict:
    """Held-out accuracy (ranking the four candidates) and mean log p(right | question), the thought marginalised,
    and the same by direct scoring; log p(right | question) by SMC (real_thoughts' program) on the first
    ``smc_problems`` problems."""
    torch.manual_seed(seed)
    marginal, direct, texts = marginal_scores(lm, prompts, probs, particles, max_thought)
    right = torch.tensor([p.candidates.index(p.answer) for p in probs])
    out = {}
    for name, s in (("marginal", marginal), ("direct", direct)):
        s = s.cpu().double()
        out[name] = {"accuracy": float((s.argmax(-1) == right).double().mean()),
                     "log_p": float(s.gather(1, right[:, None]).mean())}
    model = ThoughtThenAnswer(lm, prompts, max_thought)
    logz = []
    with torch.no_grad():
        for i, p in enumerate(probs[:smc_problems]):
            pyro.set_rng_seed(seed * 7919 + i)
            res = pt.infer.SMC(particles, ess_threshold=0.5).run(model, None, prompts.model_prompt(p.question),
                                                                 prompts.answer(p.answer))
            logz.append(float(res.log_marginal))
    out["smc_log_p"] = sum(logz) / len(logz) if logz else None
    out["thoughts"] = [{"question": p.question, "gold": gold_thought(p), "thought": t} for p, t in zip(probs, texts)]
    return out


def _mean_se(xs: list[float]) -> dict:
    m = sum(xs) / len(xs)
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else float("nan")
    return {"mean": m, "se": se, "values": xs}


SIZES = {"quick": {"steps": 6, "batch": 2, "particles": 4, "max_thought": 7, "held_out": 8, "eval_particles": 4,
                   "smc_problems": 2, "lr": 3e-3, "rank": 8},
         "default": {"steps": 300, "batch": 8, "particles": 8, "max_thought": 10, "held_out": 200,
                     "eval_particles": 16, "smc_problems": 50, "lr": 1e-3, "rank": 16}}


def run(quick: bool = False, seeds: int = 2, device: str = "cpu", dtype: str = "float32", lm=None,
        progress: bool = True, **overrides) -> dict:
    """The comparison: evaluation of the base model, then for each seed and method a training from fresh
    adapters and its evaluation on the same held-out problems. Returns the JSON's dict."""
    size = dict(SIZES["quick" if quick else "default"])
    unknown = set(overrides) - set(size)
    if unknown:
        raise ConfigError(f"unknown sizes {sorted(unknown)}; known: {sorted(size)}")
    size.update({k: v for k, v in overrides.items() if v is not None})
    dtypes = {"float32": torch.float32, "bf16": torch.bfloat16}
    if dtype not in dtypes:
        raise ConfigError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    t0 = time.perf_counter()
    source = provenance()  # the commit, whether the checkout had uncommitted changes, and the machine
    if lm is None:
        lm = pt.lm.smollm2(dtype=dtypes[dtype], device=device)
    if not pt.lm.lora_parameters(lm):
        pt.lm.lora(lm, r=size["rank"], alpha=2.0 * size["rank"])
    prompts = SumPrompts(lm)
    held = sum_problems(size["held_out"], seed=12345)
    ev = dict(particles=size["eval_particles"], max_thought=size["max_thought"], smc_problems=size["smc_problems"])
    pt.lm.reset_lora(lm, 0)
    before = evaluate(lm, prompts, held, seed=0, **ev)
    runs = {m: [] for m in METHODS}
    for seed in range(seeds):
        for method in METHODS:
            tr = train(lm, prompts, method, size["steps"], size["batch"], size["particles"], size["max_thought"],
                       size["lr"], seed, progress)
            tr.pop("gate")
            tr["eval"] = evaluate(lm, prompts, held, seed=seed + 1, **ev)
            runs[method].append(tr)
    summary = {}
    for method, rs in runs.items():
        summary[method] = {
            "accuracy_marginal": _mean_se([r["eval"]["marginal"]["accuracy"] for r in rs]),
            "log_p_marginal": _mean_se([r["eval"]["marginal"]["log_p"] for r in rs]),
            "accuracy_direct": _mean_se([r["eval"]["direct"]["accuracy"] for r in rs]),
            "log_p_direct": _mean_se([r["eval"]["direct"]["log_p"] for r in rs]),
            "log_p_smc": _mean_se([r["eval"]["smc_log_p"] for r in rs]),
            "first_loss": _mean_se([r["losses"][0] for r in rs]),
            "last_loss": _mean_se([r["losses"][-1] for r in rs]),
            "tokens_per_s": _mean_se([r["tokens_per_s"] for r in rs]),
        }
    return {"command": " ".join(sys.argv), **source, "seconds": time.perf_counter() - t0,
            "device": device, "dtype": dtype, "seeds": seeds, "quick": quick, "sizes": size,
            "model": "SmolLM2-135M-Instruct + LoRA (peft) on q_proj, v_proj", "task": "a+b= with a carry, a+b<100",
            "before": before, "summary": summary, "runs": runs}


def _cell(d: dict, digits: int = 2) -> str:
    return f"{d['mean']:.{digits}f} +- {d['se']:.{digits}f}" if d["se"] == d["se"] else f"{d['mean']:.{digits}f}"


def table(out: dict) -> str:
    """The markdown table of docs/training.md ("Training a real model")."""
    b = out["before"]
    lines = ["| training | accuracy, thought marginalised | log p(right), marginalised | log p(right), SMC | "
             "accuracy, direct | log p(right), direct |", "|---|---|---|---|---|---|",
             f"| none (base model) | {b['marginal']['accuracy']:.2f} | {b['marginal']['log_p']:.2f} | "
             f"{b['smc_log_p']:.2f} | {b['direct']['accuracy']:.2f} | {b['direct']['log_p']:.2f} |"]
    for m in METHODS:
        s = out["summary"][m]
        lines.append(f"| {m} | {_cell(s['accuracy_marginal'])} | {_cell(s['log_p_marginal'])} | "
                     f"{_cell(s['log_p_smc'])} | {_cell(s['accuracy_direct'])} | {_cell(s['log_p_direct'])} |")
    return "\n".join(lines)


def report(out: dict) -> None:
    z = out["sizes"]
    print(f"{out['seeds']} seeds x {z['steps']} steps of {z['batch']} problems x {z['particles']} thoughts "
          f"(SFT: {z['batch'] * z['particles']} problems), held-out {z['held_out']} problems, "
          f"{out['device']} {out['dtype']}, {out['seconds']:.0f} s\n")
    print(table(out))
    print()
    for m in METHODS:
        s = out["summary"][m]
        print(f"{m:12s} loss {_cell(s['first_loss'])} -> {_cell(s['last_loss'])}, "
              f"{s['tokens_per_s']['mean']:.0f} tokens/s")
    print("\nthoughts (largest weight for the right answer; gold = the carry step):")
    for m in METHODS:
        for t in out["runs"][m][0]["eval"]["thoughts"]:
            print(f"  {m:12s} {t['question']!r:10s} gold {t['gold']!r:10s} thought {t['thought']!r}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a size for 2 CPU cores (minutes)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--held-out", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bf16"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", help="write the numbers to this JSON file")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    if args.threads:
        torch.set_num_threads(args.threads)
    out = run(args.quick, args.seeds, args.device, args.dtype, steps=args.steps, held_out=args.held_out)
    if args.json:  # first: the numbers are kept whatever the printing does
        out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, out)
    report(out)
    return out
