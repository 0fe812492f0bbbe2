"""Writing your own program: question -> hidden thought -> answer (docs/programs.md walks through it).

The task is "which cup": a ball starts under cup A; the question is a list of swaps ("AB" swaps cups
A and B). A small LM reads one swap per step and writes a hidden thought, where it believes the
ball is now ("B </s>"; "</s>": it skips thinking and loses track; "B C": it changes its mind), and
after the last swap it names a cup. We observe the question and the answer, never the thoughts.

Here the ball ends under B but the LM answered A. Which thoughts explain the mistake? That is the
posterior over thoughts p(thoughts | question, answer), and p(answer | question) is its
normalising constant Z. With 4 swaps there are 10^4 thought sequences, so both are computed
exactly (by running the program on every one of them as particles) and printed next to:

* Importance sampling and SMC with the model as its own proposal (guide=None, the bootstrap);
* a guide Program (the same steps with its own LM) trained by SVI, then used by Importance and SMC;
* a verifier of the thoughts as ``pyro.factor`` (part of the model: another posterior and another Z)
  and as ``pt.twist`` (a potential that SMC adds and removes: the same Z);
* ArviZ ``InferenceData`` of each run (its ESS, and the posterior over thoughts read back from it).

The LMs are 4-gram tables built in-process (no downloads); everything runs on one CPU thread.

    python examples/custom_program.py [--quick] [--json FILE] [--plot FILE] [--seed S]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections import defaultdict

import pyro
import pyro.poutine as poutine
import torch

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.distributions import LMState

VOCAB = pt.Vocab(["A", "B", "C", "AB", "BC", "AC"])  # + <pad>=0 <bos>=1 <eos>=2 <s>=3 </s>=4 <explain>=5
V = len(VOCAB)
CUPS = torch.tensor([VOCAB.id(c) for c in "ABC"])
START, END = VOCAB.id("A"), VOCAB.end_think_id  # the ball starts under A; "</s>" ends a thought
AFTER = torch.arange(V)[None].repeat(V, 1)  # AFTER[swap, cup]: where a ball under `cup` is after `swap`
for _s in ("AB", "BC", "AC"):
    _a, _b = VOCAB.id(_s[0]), VOCAB.id(_s[1])
    AFTER[VOCAB.id(_s), _a], AFTER[VOCAB.id(_s), _b] = _b, _a


def track(cup, swaps: torch.Tensor) -> torch.Tensor:
    """Where a ball under ``cup`` is after ``swaps``."""
    cup = torch.as_tensor(cup)
    for s in swaps.tolist():
        cup = AFTER[s, cup]
    return cup


def last_cup(thought: torch.Tensor) -> torch.Tensor:
    """The cup each thought ``[n, S]`` names last (0 if it names none)."""
    last = torch.zeros(thought.shape[0], dtype=torch.long)
    for j in range(thought.shape[1]):
        last = torch.where(torch.isin(thought[:, j], CUPS), thought[:, j], last)
    return last


def verify(thought: torch.Tensor, cup) -> torch.Tensor:
    """A verifier's soft score of each thought: 0 if it names ``cup`` last, -2 another cup, -1 none."""
    last = last_cup(thought)
    return torch.where(last == 0, -1.0, torch.where(last == torch.as_tensor(cup), 0.0, -2.0))


# ---------------------------------------------------------------------------------------------- the program
class WhichCup(pt.Program):
    """The LM reads one swap per step and thinks (a latent segment); after the last swap it answers
    (observed). ``check``: None, "factor" (a verifier in the model) or "twist" (a potential for SMC)."""

    def __init__(self, lm, check=None):
        self.lm, self.check = lm, check

    def init(self, state, swaps, answer):
        state["lm"] = LMState.start(self.lm, pt.particles(), prompt=torch.tensor([START]))

    def step(self, state, t, swaps, answer):
        lm = state["lm"]
        lm.extend(swaps[t].expand(lm.n))  # read the question: one swap per step
        thought = pyro.sample(f"thought_{t}", lm.segment(stop=END, max_tokens=2))  # think (latent)
        lm.extend(thought)
        if self.check == "factor":  # a process verifier that knows where the ball is: part of the model
            pyro.factor(f"verify_{t}", verify(thought, track(START, swaps[: t + 1])))
        elif self.check == "twist":  # would the observed answer come out from here? (SMC only)
            pt.twist(verify(thought, track(answer, swaps[t + 1:].flip(0))))
        if t + 1 < len(swaps):
            return None  # not finished
        pyro.sample("answer", lm.next_token(), obs=answer.expand(lm.n))  # the answer (observed)
        return torch.ones(lm.n, dtype=torch.bool)  # every particle has finished


class Proposal(pt.Program):
    """A guide: the same steps and latent sites from its own LM; it observes nothing."""

    def __init__(self, lm):
        self.lm = lm

    def init(self, state, swaps, answer):
        state["lm"] = LMState.start(self.lm, pt.particles(), prompt=torch.tensor([START]))

    def step(self, state, t, swaps, answer):
        lm = state["lm"]
        lm.extend(swaps[t].expand(lm.n))
        lm.extend(pyro.sample(f"thought_{t}", lm.segment(stop=END, max_tokens=2)))
        return torch.ones(lm.n, dtype=torch.bool) if t + 1 == len(swaps) else None


# ---------------------------------------------------------------------------------------------- the LM
def tracker_lm(err=0.1, skip=0.1, doubt=0.1, slip=0.02, trainable=False) -> pt.lm.Tabular:
    """A 4-gram LM that tracks the ball with mistakes, as a logits table over contexts (c1, c2, c3).

    After a swap it names the cup the ball moved to (wrong cups: ``err``; "</s>" at once: ``skip``,
    after which it has forgotten where the ball is); after naming a cup it ends the thought, or
    names another cup (``doubt``); after a thought it names the cup it believes (another: ``slip``).
    """
    cups, swaps = set(CUPS.tolist()), {VOCAB.id(s) for s in ("AB", "BC", "AC")}
    logits = torch.full((V,) * 4, -math.inf)
    for c1, c2, c3 in itertools.product(range(V), repeat=3):
        if c3 in swaps:  # a thought starts; the belief is the last cup of the previous thought
            belief = c2 if c2 in cups else c1 if (c2 == END and c1 in cups) else None
            p = {c: (1 - skip) / 3 for c in cups} if belief is None else \
                {c: 1 - skip - err if c == int(AFTER[c3, belief]) else err / 2 for c in cups}
            p[END] = skip
        elif c3 in cups and c2 in swaps:  # one cup named: end the thought or change its mind
            p = {c: doubt / 2 for c in cups - {c3}} | {END: 1 - doubt}
        elif c3 == END or (c3 in cups and c2 in cups):  # a thought ended: the answer (or the next swap)
            belief = c3 if c3 in cups else c2 if c2 in cups else None
            p = {c: (1 - slip if c == belief else slip / 2) if belief else 1 / 3 for c in cups}
            p = {c: 0.97 * q for c, q in p.items()} | {s: 0.01 for s in swaps}
        else:  # contexts that never occur
            p = {c: 1 / 3 for c in cups}
        for tok, q in p.items():
            logits[c1, c2, c3, tok] = math.log(q)
    return pt.lm.Tabular(4, V, logits, trainable=trainable)


# ---------------------------------------------------------------------------------------------- exact answers
def all_thoughts() -> list[list[int]]:
    """Every thought the LM can write: "</s>", "X </s>", "X Y" (Y != X; cut by max_tokens=2)."""
    cups = CUPS.tolist()
    return [[END, 0]] + [[c, END] for c in cups] + [[c, d] for c in cups for d in cups if d != c]


def exact(model, swaps, answer) -> tuple[float, dict]:
    """log Z and the posterior over thought sequences: the program itself, run on every thought
    sequence as particles (``poutine.condition``), scores them all in one trace."""
    th = all_thoughts()
    combos = list(itertools.product(range(len(th)), repeat=len(swaps)))
    data = {f"thought_{t}": torch.tensor([th[c[t]] for c in combos]) for t in range(len(swaps))}

    def run():
        with pyro.plate("particles", len(combos)):
            model(swaps, answer)

    with torch.no_grad():
        tr = poutine.trace(poutine.condition(run, data=data)).get_trace()
        tr.compute_log_prob()
    log_prior = sum(tr.nodes[k]["log_prob"] for k in data)
    log_joint = sum(s["log_prob"] for s in tr.nodes.values() if s["type"] == "sample")
    assert abs(float(torch.logsumexp(log_prior, 0))) < 1e-4, "the enumeration misses thoughts"
    post = torch.softmax(log_joint, 0)
    key = [" | ".join(text(th[i]) for i in c) for c in combos]
    return float(torch.logsumexp(log_joint, 0)), {k: float(p) for k, p in zip(key, post)}


def text(ids) -> str:
    return VOCAB.decode([int(i) for i in ids if int(i) != 0])


# ---------------------------------------------------------------------------------------------- estimates
def posterior_from_idata(idata, steps: int) -> dict[str, float]:
    """The weighted posterior over thought sequences, read from an ArviZ InferenceData."""
    w = torch.softmax(torch.as_tensor(idata.particles["log_weight"].values[0], dtype=torch.float64), 0)
    texts = [idata.particles_text[f"thought_{t}_text"].values[0] for t in range(steps)]
    out: dict[str, float] = defaultdict(float)
    for i in range(len(w)):
        out[" | ".join(str(tx[i]) for tx in texts)] += float(w[i])
    return dict(out)


def first_mistake(post: dict[str, float], truth: list[str]) -> dict[str, float]:
    """P(the first thought that does not name the right cup is at swap k): where the LM lost the ball."""
    out = {f"swap {t + 1}": 0.0 for t in range(len(truth))} | {"never (it misspoke)": 0.0}
    for k, p in post.items():
        named = [[w for w in th.split() if w in "ABC"][-1:] for th in k.split(" | ")]  # the last cup named
        wrong = [t for t, c in enumerate(named) if c != [truth[t]]]
        out[f"swap {wrong[0] + 1}" if wrong else "never (it misspoke)"] += p
    return out


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def estimate(engine, model, guide, swaps, answer, runs: int, seed: int) -> dict:
    """``runs`` independent runs: the pooled estimate log mean(Z-hat) (unbiased in Z) with its standard
    error across runs, the mean ESS, and the posterior averaged over runs (via ArviZ)."""
    from ppl_thought.diagnostics import to_inference_data

    log_z, ess, khat, resampled, post = [], [], [], [], defaultdict(float)
    for r in range(runs):
        pyro.set_rng_seed(seed + r)
        res = engine.run(model, guide, swaps, answer)
        idata = to_inference_data(res, vocab=VOCAB)  # one chain, the particles are its draws
        attrs = idata.posterior.attrs
        log_z.append(float(res.log_marginal))
        ess.append(attrs["ess_fraction"])
        khat.append(attrs["khat"])
        resampled.append(int(sum(res.stats.get("resampled", []))))
        for k, p in posterior_from_idata(idata, len(swaps)).items():
            post[k] += p / runs
    lz = torch.tensor(log_z, dtype=torch.float64)
    ratio = torch.exp(lz - lz.max())
    pooled = float(torch.log(ratio.mean()) + lz.max())
    se = float(ratio.std() / (math.sqrt(runs) * ratio.mean())) if runs > 1 else float("nan")
    return {"log_z": pooled, "se": se, "log_z_runs": log_z, "ess_fraction": sum(ess) / runs,
            "khat": sorted(khat)[runs // 2], "resampled": sum(resampled) / runs, "posterior": dict(post),
            "idata": idata}


def train_guide(model, guide, swaps, answer, steps: int, particles: int, lr: float, progress: bool) -> dict:
    """SVI on the guide's LM: the sampler loss (3.25), a policy gradient of KL(q || posterior)."""
    from tqdm.auto import tqdm

    objective = pt.train.SamplerPolicyGradient(particles)
    svi = pt.train.SVI(objective, {"lr": lr})
    losses, ess = [], []
    bar = tqdm(range(steps), desc="SVI (guide LM)", disable=not progress, mininterval=0.5)
    for _ in bar:
        losses.append(svi.step(model, guide, swaps, answer))  # -E_q[log p/q]: KL(q || post) - log Z
        ess.append(objective.last_stats["ess"] / particles)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}",
                        ess=f"{sum(ess[-20:]) / len(ess[-20:]):.2f}", refresh=False)
    k = max(1, steps // 10)
    return {"losses": losses, "ess": ess, "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k,
            "ess_first": sum(ess[:k]) / k, "ess_last": sum(ess[-k:]) / k}


# ---------------------------------------------------------------------------------------------- main
def run(quick: bool = False, seed: int = 0, progress: bool = True) -> tuple[dict, dict]:
    """Every engine on the example; returns (the numbers, as JSON can hold them; each engine's estimates)."""
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    n, runs = (256, 8) if quick else (1024, 16)
    svi_steps = 150 if quick else 400
    swaps = torch.tensor(VOCAB.encode("AB BC AC AB"))
    answer = torch.tensor(VOCAB.id("A"))  # the ball is under B: the LM got it wrong
    lm = tracker_lm()
    model, verified, twisted = WhichCup(lm), WhichCup(lm, "factor"), WhichCup(lm, "twist")
    out: dict = {"question": text(swaps), "answer": text([answer]), "truth": text([track(START, swaps)]),
                 "num_particles": n, "runs": runs}

    t0 = time.perf_counter()
    exact_plain, post_plain = exact(model, swaps, answer)
    exact_factor, post_factor = exact(verified, swaps, answer)
    out["exact"] = {"plain": exact_plain, "factor": exact_factor, "twist": exact(twisted, swaps, answer)[0]}

    guide = Proposal(tracker_lm(trainable=True))  # starts as a copy of the model's LM: the bootstrap
    est = {}
    est["IS, bootstrap"] = estimate(pt.infer.Importance(n), model, None, swaps, answer, runs, seed)
    est["SMC, bootstrap"] = estimate(pt.infer.SMC(n), model, None, swaps, answer, runs, seed)
    before = estimate(pt.infer.Importance(n), model, guide, swaps, answer, runs, seed)
    out["svi"] = train_guide(model, guide, swaps, answer, svi_steps, 64, 0.05, progress)
    est["IS, trained guide"] = estimate(pt.infer.Importance(n), model, guide, swaps, answer, runs, seed)
    est["SMC, trained guide"] = estimate(pt.infer.SMC(n), model, guide, swaps, answer, runs, seed)
    est["SMC, twist"] = estimate(pt.infer.SMC(n), twisted, None, swaps, answer, runs, seed)
    est["IS, factor"] = estimate(pt.infer.Importance(n), verified, None, swaps, answer, runs, seed)
    est["SMC, factor"] = estimate(pt.infer.SMC(n), verified, None, swaps, answer, runs, seed)
    out["svi"]["is_ess_before"] = before["ess_fraction"]
    out["svi"]["is_ess_after"] = est["IS, trained guide"]["ess_fraction"]

    # the site check: a guide whose latent sites differ from the model's is an error, not a wrong Z
    class Misnamed(Proposal):
        def step(self, state, t, swaps, answer):
            lm = state["lm"]
            lm.extend(swaps[t].expand(lm.n))
            lm.extend(pyro.sample(f"thinking_{t}", lm.segment(stop=END, max_tokens=2)))
            return torch.ones(lm.n, dtype=torch.bool) if t + 1 == len(swaps) else None

    try:
        pt.infer.SMC(8).run(model, Misnamed(lm), swaps, answer)
    except pt.errors.SiteMismatchError as e:
        out["site_check"] = str(e)

    truth_t = [text([track(START, swaps[: t + 1])]) for t in range(len(swaps))]
    out["results"] = {}
    for name, e in est.items():
        target = "factor" if "factor" in name else "plain"
        ex_post = post_factor if target == "factor" else post_plain
        out["results"][name] = {"log_z": e["log_z"], "se": e["se"], "exact": out["exact"][target],
                                "ess_fraction": e["ess_fraction"], "resampled": e["resampled"],
                                "khat": e["khat"] if math.isfinite(e["khat"]) else None,
                                "tv_to_exact": total_variation(e["posterior"], ex_post)}
    top = sorted(post_plain, key=post_plain.get, reverse=True)[:5]
    out["top_thoughts"] = {"thoughts": top, "exact": [post_plain[k] for k in top]}
    out["first_mistake"] = {"exact": first_mistake(post_plain, truth_t)}
    for name in ("IS, bootstrap", "SMC, bootstrap", "IS, trained guide", "SMC, trained guide", "SMC, twist"):
        out["top_thoughts"][name] = [est[name]["posterior"].get(k, 0.0) for k in top]
        out["first_mistake"][name] = first_mistake(est[name]["posterior"], truth_t)
    top_f = sorted(post_factor, key=post_factor.get, reverse=True)[:3]
    out["top_thoughts_factor"] = {"thoughts": top_f, "exact": [post_factor[k] for k in top_f]}
    out["first_mistake_factor"] = first_mistake(post_factor, truth_t)
    out["idata"] = describe(est["SMC, trained guide"]["idata"])
    out["seconds"] = time.perf_counter() - t0
    return out, est


def describe(idata) -> dict:
    """What the InferenceData of one run holds: its groups, variables and the engine's numbers."""
    attrs = idata.posterior.attrs
    return {"groups": list(idata.groups()), "posterior": sorted(idata.posterior.data_vars),
            "particles": sorted(idata.particles.data_vars),
            "attrs": {k: attrs[k] for k in ("engine", "log_marginal", "ess", "ess_fraction", "khat", "num_draws")
                      if k in attrs}}


def report(out: dict) -> None:
    print(f"question: swaps {out['question']} (the ball starts under A and ends under {out['truth']}); "
          f"the LM answered {out['answer']}")
    print(f"{out['runs']} runs x {out['num_particles']} particles per engine: log Z-hat is the log of the mean "
          "Z-hat over the runs, SE its standard error across them\n")
    print(f"{'engine':20s} {'log Z-hat':>9s} {'SE':>7s} {'exact':>8s} {'ESS/n':>6s} {'resampled':>9s} {'TV':>6s}")
    for name, r in out["results"].items():
        print(f"{name:20s} {r['log_z']:9.4f} {r['se']:7.4f} {r['exact']:8.4f} {r['ess_fraction']:6.2f} "
              f"{r['resampled']:9.1f} {r['tv_to_exact']:6.3f}")
    print("ESS/n: mean importance ESS of the final weights (from the ArviZ attrs); resampled: resampling steps "
          "per run;\nTV: total variation between the estimated and the exact posterior over thought sequences.")
    print("SMC rows that never resampled repeat the IS rows: with no evidence before the answer the weights stay "
          "equal,\nso SMC does not resample and, on the same seeds, is importance sampling.")
    print("factor: the verifier is part of the model (another Z, another posterior); twist: SMC steers by it and "
          "divides it out (the Z of the plain program)\n")
    s = out["svi"]
    print(f"SVI on the guide LM ({len(s['losses'])} steps): loss {s['loss_first']:.3f} -> {s['loss_last']:.3f} "
          f"(its floor is -log Z = {-out['exact']['plain']:.3f}, at q = posterior); ESS/n of its particles "
          f"{s['ess_first']:.2f} -> {s['ess_last']:.2f}; IS with the guide: ESS/n {s['is_ess_before']:.2f} -> "
          f"{s['is_ess_after']:.2f}\n")
    fm = out["first_mistake"]
    cols = list(fm)
    print("where did the LM lose the ball? P(first thought naming a wrong cup, or none, is at swap k | answer):")
    print(f"  {'':20s}" + "".join(f"{c:>19s}" for c in cols))
    for k in fm["exact"]:
        print(f"  {k:20s}" + "".join(f"{fm[c][k]:19.3f}" for c in cols))
    tt = out["top_thoughts"]
    print("\nthe most probable thought sequences (thought_0 | thought_1 | thought_2 | thought_3):")
    for i, k in enumerate(tt["thoughts"]):
        print(f"  {k:34s} exact {tt['exact'][i]:.3f}   SMC, trained guide {tt['SMC, trained guide'][i]:.3f}")
    tf = out["top_thoughts_factor"]
    print("with the verifier as a factor: " + ", ".join(f"{k} ({v:.2f})" for k, v in zip(tf["thoughts"], tf["exact"])))
    print("\nthe site check, for a guide that names its site thinking_{t}:\n  " + out.get("site_check", "-"))
    d = out["idata"]
    print(f"\nArviZ InferenceData of a run (SMC, trained guide): groups {d['groups']}; posterior "
          f"{d['posterior'][:3]} ...; particles {d['particles'][:3]} ...; attrs " +
          ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d["attrs"].items()))


def plot(out: dict, path: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fm = out["first_mistake"]
    cols, rows = list(fm), list(fm["exact"])
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(cols)
    for j, c in enumerate(cols):
        ax[0].bar([i + j * width for i in range(len(rows))], [fm[c][r] for r in rows], width, label=c,
                  color="k" if c == "exact" else None)
    ax[0].set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax[0].set_xticklabels(rows)
    ax[0].set_ylabel("posterior probability")
    ax[0].set_title(f"where the LM lost the ball (it answered {out['answer']}, the ball is under {out['truth']})")
    ax[0].legend(fontsize=8)
    s = out["svi"]
    ax[1].plot(s["losses"], color="tab:blue", alpha=0.7)
    ax[1].axhline(-out["exact"]["plain"], color="tab:blue", ls="--", lw=1, label="-log Z (exact)")
    ax[1].set_xlabel("SVI step")
    ax[1].set_ylabel("loss", color="tab:blue")
    ax[1].legend(loc="upper center", fontsize=8)
    ax2 = ax[1].twinx()
    ax2.plot(s["ess"], color="tab:red", alpha=0.7)
    ax2.set_ylabel("ESS / n of the guide's particles", color="tab:red")
    ax[1].set_title("training the guide LM")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer particles, runs and SVI steps (< 60 s)")
    ap.add_argument("--json", help="write the numbers to this JSON file")
    ap.add_argument("--plot", help="write a matplotlib figure (PNG) to this file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    torch.set_num_threads(1)
    out, _ = run(quick=a.quick, seed=a.seed, progress=not a.no_progress)
    report(out)
    if a.plot and plot(out, a.plot):
        print("plot:", a.plot)
    if a.json:
        with open(a.json, "w") as f:
            out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            json.dump(out, f, indent=1)
    print(f"\ndone in {out['seconds']:.1f} s")
    return out


if __name__ == "__main__":
    main()
