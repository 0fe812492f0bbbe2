"""Writing your own program in NumPyro: the JAX twin of examples/custom_program.py (docs/programs.md shows the
two side by side). No torch: it runs with torch and pyro blocked.

The task is "which cup": a ball starts under cup A; the question is a list of swaps ("AB" swaps cups A and B).
A small LM reads one swap per step and writes a hidden thought, where it believes the ball is now ("B </s>";
"</s>": it skips thinking and loses track; "B C": it changes its mind), and after the last swap it names a cup.
We observe the question and the answer, never the thoughts. Here the ball ends under B but the LM answered A.

The program is a ``ptn.Program``: the same ``init`` / ``step`` as the torch one, written for a compiled run
(``t`` is traced, the answer's site is masked to the last step, the finished mask is an array). Its exact
log Z = log p(answer | question) is computed by the program itself: Importance with a guide that proposes every
thought sequence once (``Enumerate``, a ``Delta`` per step), whose weights are then p(thoughts, answer).
Printed next to it: Importance and SMC with the model as its own proposal (the bootstrap), with a guide
program, with a verifier as ``ptn.factor`` (another target) and as ``ptn.twist`` (the same target), and the
time of the first run (compilation) against a fresh engine object's run (the compiled run is reused).

    python examples/custom_program_numpyro.py [--quick] [--json FILE] [--seed S]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought import provenance as pv
from ppl_thought.errors import SiteMismatchError  # noqa: E402
from ppl_thought.numpyro.dist import LMState  # noqa: E402
from ppl_thought.vocab import Vocab  # noqa: E402

VOCAB = Vocab(["A", "B", "C", "AB", "BC", "AC"])  # + <pad>=0 <bos>=1 <eos>=2 <s>=3 </s>=4 <explain>=5
V = len(VOCAB)
CUPS = np.array([VOCAB.id(c) for c in "ABC"])
START, END = VOCAB.id("A"), VOCAB.end_think_id
AFTER = np.tile(np.arange(V), (V, 1))  # AFTER[swap, cup]: where a ball under `cup` is after `swap`
for _s in ("AB", "BC", "AC"):
    _a, _b = VOCAB.id(_s[0]), VOCAB.id(_s[1])
    AFTER[VOCAB.id(_s), _a], AFTER[VOCAB.id(_s), _b] = _b, _a
AFTER_J = jnp.asarray(AFTER)


def track(cup, swaps: jax.Array, upto) -> jax.Array:
    """Where a ball under ``cup`` is after ``swaps[:upto]`` (``upto`` may be traced)."""
    cup = jnp.asarray(cup)
    for j in range(swaps.shape[0]):
        cup = jnp.where(j < upto, AFTER_J[swaps[j], cup], cup)
    return cup


def track_back(cup, swaps: jax.Array, after) -> jax.Array:
    """Where a ball must be now to end under ``cup`` after ``swaps[after:]`` (a swap is its own inverse)."""
    cup = jnp.asarray(cup)
    for j in reversed(range(swaps.shape[0])):
        cup = jnp.where(j >= after, AFTER_J[swaps[j], cup], cup)
    return cup


def verify(thought: jax.Array, cup) -> jax.Array:
    """A verifier's soft score of each thought ``[n, S]``: 0 if it names ``cup`` last, -2 another cup, -1 none."""
    last = jnp.zeros(thought.shape[0], jnp.int32)
    for j in range(thought.shape[1]):
        last = jnp.where(jnp.isin(thought[:, j], jnp.asarray(CUPS)), thought[:, j], last)
    return jnp.where(last == 0, -1.0, jnp.where(last == cup, 0.0, -2.0))


# ---------------------------------------------------------------------------------------------- the program
class WhichCup(ptn.Program):
    """The LM reads one swap per step and thinks (a latent segment); after the last swap it answers (observed).
    ``check``: None, "factor" (a verifier in the model) or "twist" (a potential for SMC)."""

    def __init__(self, lm, num_swaps: int, check=None):
        self.lm, self.check, self.max_steps = lm, check, num_swaps

    def init(self, state, swaps, answer):
        state["lm"] = LMState.start(self.lm, ptn.particles(), prompt=[START], max_len=4 * self.max_steps)

    def step(self, state, t, swaps, answer):
        lm = state["lm"]
        lm.extend(swaps[t])  # read the question: one swap per step
        thought = ptn.sample("thought", lm.segment(stop=END, max_tokens=2))  # think (latent)
        lm.extend(thought)
        if self.check == "factor":  # a process verifier that knows where the ball is: part of the model
            ptn.factor("verify", verify(thought, track(START, swaps, t + 1)))
        elif self.check == "twist":  # would the observed answer come out from here? (SMC only)
            ptn.twist(verify(thought, track_back(answer, swaps, t + 1)))
        last = t == swaps.shape[0] - 1
        with numpyro.handlers.mask(mask=last):  # the answer is observed after the last swap only
            ptn.observe("answer", lm.next_token(), answer)
        return jnp.broadcast_to(last, (lm.n,))  # every particle finishes at the last swap


class Proposal(ptn.Program):
    """A guide: the same steps and latent sites from its own LM; it observes nothing."""

    def __init__(self, lm, num_swaps: int):
        self.lm, self.max_steps = lm, num_swaps

    def init(self, state, swaps, answer):
        state["lm"] = LMState.start(self.lm, ptn.particles(), prompt=[START], max_len=4 * self.max_steps)

    def step(self, state, t, swaps, answer):
        lm = state["lm"]
        lm.extend(swaps[t])
        lm.extend(ptn.sample("thought", lm.segment(stop=END, max_tokens=2)))
        return jnp.broadcast_to(t == swaps.shape[0] - 1, (lm.n,))


class Enumerate(ptn.Program):
    """A guide that proposes thought sequence k to particle k (a Delta per step): Importance with it over all
    sequences gives log w_k = log p(thoughts_k, answer), so logsumexp(log w) = log Z exactly."""

    def __init__(self, table: np.ndarray):
        self.table, self.max_steps = table, table.shape[0]  # [steps, K, 2]

    def step(self, state, t, swaps, answer):
        numpyro.sample("thought", nd.Delta(jnp.asarray(self.table)[t], event_dim=1))
        return jnp.broadcast_to(t == swaps.shape[0] - 1, (self.table.shape[1],))


# ---------------------------------------------------------------------------------------------- the LM
def tracker_table(err=0.1, skip=0.1, doubt=0.1, slip=0.02) -> np.ndarray:
    """The 4-gram logits table of examples/custom_program.py's ``tracker_lm`` (the same numbers)."""
    cups, swaps = set(CUPS.tolist()), {VOCAB.id(s) for s in ("AB", "BC", "AC")}
    logits = np.full((V,) * 4, -np.inf, np.float32)
    for c1, c2, c3 in itertools.product(range(V), repeat=3):
        if c3 in swaps:
            belief = c2 if c2 in cups else c1 if (c2 == END and c1 in cups) else None
            p = {c: (1 - skip) / 3 for c in cups} if belief is None else \
                {c: 1 - skip - err if c == int(AFTER[c3, belief]) else err / 2 for c in cups}
            p[END] = skip
        elif c3 in cups and c2 in swaps:
            p = {c: doubt / 2 for c in cups - {c3}} | {END: 1 - doubt}
        elif c3 == END or (c3 in cups and c2 in cups):
            belief = c3 if c3 in cups else c2 if c2 in cups else None
            p = {c: (1 - slip if c == belief else slip / 2) if belief else 1 / 3 for c in cups}
            p = {c: 0.97 * q for c, q in p.items()} | {s: 0.01 for s in swaps}
        else:
            p = {c: 1 / 3 for c in cups}
        for tok, q in p.items():
            logits[c1, c2, c3, tok] = math.log(q)
    return logits


def tracker_lm(**kw) -> ptn.lm.Tabular:
    return ptn.lm.Tabular.from_numpy(tracker_table(**kw))


# ---------------------------------------------------------------------------------------------- exact answers
def all_thoughts() -> list[list[int]]:
    """Every thought the LM can write: "</s>", "X </s>", "X Y" (Y != X; cut by max_tokens=2)."""
    cups = CUPS.tolist()
    return [[END, 0]] + [[c, END] for c in cups] + [[c, d] for c in cups for d in cups if d != c]


def exact(model, swaps, answer) -> float:
    """log Z by enumeration: Importance over every thought sequence with the :class:`Enumerate` guide."""
    th = all_thoughts()
    T = len(swaps)
    combos = np.array(list(itertools.product(range(len(th)), repeat=T)))
    table = np.stack([np.array(th)[combos[:, t]] for t in range(T)]).astype(np.int32)  # [T, K, 2]
    res = ptn.infer.Importance(len(combos)).run(model, Enumerate(table), swaps, answer)
    return float(jax.scipy.special.logsumexp(res.log_weights))


def estimate(engine, model, guide, swaps, answer, runs: int, seed: int) -> dict:
    """``runs`` seeds: log of the mean Z-hat over runs (unbiased in Z) and its standard error across runs."""
    lz, ess, resampled = [], [], []
    for r in range(runs):
        res = engine.run(model, guide, swaps, answer, rng_key=jax.random.PRNGKey(seed + r))
        lz.append(float(res.log_marginal))
        ess.append(float(res.ess) / engine.num_particles)
        resampled.append(int(np.asarray(res.stats["resampled"]).sum()))
    a = np.array(lz, np.float64)
    ratio = np.exp(a - a.max())
    return {"log_z": float(np.log(ratio.mean()) + a.max()),
            "se": float(ratio.std(ddof=1) / (math.sqrt(runs) * ratio.mean())) if runs > 1 else float("nan"),
            "log_z_runs": lz, "ess_fraction": float(np.mean(ess)), "resampled": float(np.mean(resampled))}


def run(quick: bool = False, seed: int = 0) -> dict:
    n, runs = (256, 8) if quick else (1024, 16)
    swaps = jnp.asarray(VOCAB.encode("AB BC AC AB"), jnp.int32)
    answer = jnp.asarray(VOCAB.id("A"), jnp.int32)  # the ball is under B: the LM got it wrong
    T = int(swaps.shape[0])
    lm = tracker_lm()
    model, verified, twisted = WhichCup(lm, T), WhichCup(lm, T, "factor"), WhichCup(lm, T, "twist")
    guide = Proposal(tracker_lm(skip=0.2), T)  # a guide LM that skips thinking more often than the model
    out: dict = {"question": VOCAB.decode(np.asarray(swaps).tolist()), "answer": VOCAB.decode([int(answer)]),
                 "num_particles": n, "runs": runs}
    t0 = time.perf_counter()
    out["exact"] = {"plain": exact(model, swaps, answer), "factor": exact(verified, swaps, answer),
                    "twist": exact(twisted, swaps, answer)}

    # compilation: the first run compiles; a fresh engine object with the same configuration reuses it
    t1 = time.perf_counter()
    jax.block_until_ready(ptn.infer.SMC(n).run(model, None, swaps, answer).log_weights)
    t2 = time.perf_counter()
    jax.block_until_ready(ptn.infer.SMC(n).run(model, None, swaps, answer, rng_key=jax.random.PRNGKey(1)).log_weights)
    t3 = time.perf_counter()
    out["compile_s"], out["rerun_fresh_engine_s"] = t2 - t1, t3 - t2

    est = {
        "IS, bootstrap": estimate(ptn.infer.Importance(n), model, None, swaps, answer, runs, seed),
        "SMC, bootstrap": estimate(ptn.infer.SMC(n), model, None, swaps, answer, runs, seed),
        "IS, guide": estimate(ptn.infer.Importance(n), model, guide, swaps, answer, runs, seed),
        "SMC, guide": estimate(ptn.infer.SMC(n), model, guide, swaps, answer, runs, seed),
        "SMC, twist": estimate(ptn.infer.SMC(n), twisted, None, swaps, answer, runs, seed),
        "IS, factor": estimate(ptn.infer.Importance(n), verified, None, swaps, answer, runs, seed),
        "SMC, factor": estimate(ptn.infer.SMC(n), verified, None, swaps, answer, runs, seed),
    }
    out["results"] = {k: {**e, "exact": out["exact"]["factor" if "factor" in k else "plain"]} for k, e in est.items()}

    class Misnamed(Proposal):  # the site check: a guide whose latent sites differ from the model's is an error
        def step(self, state, t, swaps, answer):
            lm = state["lm"]
            lm.extend(swaps[t])
            lm.extend(ptn.sample("thinking", lm.segment(stop=END, max_tokens=2)))
            return jnp.broadcast_to(t == swaps.shape[0] - 1, (lm.n,))

    try:
        ptn.infer.SMC(8).run(model, Misnamed(lm, T), swaps, answer)
    except SiteMismatchError as e:
        out["site_check"] = str(e)
    out["seconds"] = time.perf_counter() - t0
    return out


def report(out: dict) -> None:
    print(f"question: swaps {out['question']}; the LM answered {out['answer']} (the ball is under B)")
    print(f"{out['runs']} runs x {out['num_particles']} particles per engine: log of the mean Z-hat over the runs, "
          "SE across them\n")
    print(f"{'engine':16s} {'log Z-hat':>9s} {'SE':>7s} {'exact':>8s} {'ESS/n':>6s} {'resampled':>9s}")
    for name, r in out["results"].items():
        print(f"{name:16s} {r['log_z']:9.4f} {r['se']:7.4f} {r['exact']:8.4f} {r['ess_fraction']:6.2f} "
              f"{r['resampled']:9.1f}")
    print(f"\nexact log Z: plain {out['exact']['plain']:.4f}, factor {out['exact']['factor']:.4f}, twist "
          f"{out['exact']['twist']:.4f} (the twist leaves the target)")
    print(f"SMC compile (first run) {out['compile_s']:.2f} s; a fresh engine object, same configuration "
          f"{out['rerun_fresh_engine_s']:.3f} s (no recompilation)")
    print("\nthe site check, for a guide that names its site 'thinking':\n  " + out.get("site_check", "-"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer particles and runs")
    ap.add_argument("--json", help="write the numbers to this JSON file")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    out = run(quick=a.quick, seed=a.seed)
    report(out)
    if a.json:
        with open(a.json, "w") as f:
            out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            json.dump(out, f, indent=1)
    print(f"\ndone in {out['seconds']:.1f} s")
    return out


if __name__ == "__main__":
    main()
