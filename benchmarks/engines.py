"""Engine benchmarks: ours vs pyro.infer.Importance, sampling vs bare forward, SMC throughput on
SlowThinking (Tabular and Transformer priors) and on a user-written ``pt.Program`` with the same
Transformer prior, particles and steps (generic must not mean slow).

    python benchmarks/engines.py [--quick] [--json FILE] [--only {importance,sampling,smc}]

Figures are ratios measured in one run (docs/architecture.md). One torch thread.
"""

from __future__ import annotations

import argparse
import json
import time

import pyro
import pyro.infer
import torch

import ppl_thought as pt
from ppl_thought import provenance as pv
from ppl_thought.distributions import LMSequence
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.inference import SMC, Importance
from ppl_thought.lm import Tabular, Transformer
from ppl_thought.models import SlowThinking
from ppl_thought.projections import PauseToThink
from ppl_thought.vocab import Vocab


class CausalSampler:
    """An LM decoded under the lifting of x (sampler and Pyro guide)."""

    def __init__(self, lm, model):
        self.lm, self.model = lm, model

    def dist(self, x):
        x = self.model.x_ids(x)
        return LMSequence(self.lm, constraint=self.model.projection.lifting(x),
                          max_len=self.model.z_dist(len(x)).max_len)

    def sample_with_log_prob(self, x, n):
        return self.dist(x).sample_with_log_prob((n,))

    def __call__(self, x):
        return pyro.sample("z", self.dist(x))


class UserPauseProgram(pt.Program):
    """What a user writes for "think before each token": one segment of the prior per observed token,
    then a check that the segment emitted that token (a factor). Same law as SlowThinking."""

    def __init__(self, lm, projection):
        self.lm, self.projection = lm, projection

    def init(self, state, x):
        n, T = pt.particles(), len(x)
        domain = self.projection.domain(T)
        state["z"] = LMState.start(self.lm, n, rule=TokenRule(domain, self.lm.vocab_size), max_len=domain.max_len)
        state["lifting"] = pt.Shared(self.projection.lifting(x))
        state["s"] = state["lifting"].value.start_states(n, state["z"].device)

    def step(self, state, t, x):
        last = t + 1 == len(x)
        seg = pyro.sample(f"z_{t}", state["z"].segment(until_emitted=None if last else t + 1))
        state["z"].extend(seg)
        lift, s = state["lifting"].value, state["s"]
        for j in range(seg.shape[1]):
            s = torch.where(seg[:, j] > 0, lift.step(s, seg[:, j]), s)
        state["s"] = s
        ok = lift.is_final(s) if last else lift.num_emitted(s) > t
        pyro.factor(f"x_{t}", torch.where(ok, 0.0, float("-inf")))
        return torch.ones_like(ok) if last else None


def once(fn):
    """Seconds of one run of ``fn``."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timed(fn, reps):
    """Best of ``reps`` runs after one warm-up: robust to other load on a shared machine."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=("importance", "sampling", "smc"), default=None,
                    help="run one workload only (e.g. sampling: LMSequence sampling vs the bare forward loop)")
    args = ap.parse_args()
    run_record = pv.record(pv.script(__file__, None))  # before the run: the code that runs
    run = (lambda name: args.only in (None, name))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab = Vocab(["a", "b", "c", "d"])
    V = len(vocab)
    proj = PauseToThink(vocab, max_thought_len=2)
    prior = Transformer(V, d_model=32, n_layers=2, n_heads=2).eval()
    q_lm = Transformer(V, d_model=32, n_layers=2, n_heads=2).eval()
    model = SlowThinking(prior, proj)
    guide = CausalSampler(q_lm, model)
    x = "abcd" if args.quick else "abcdabcd"
    n = 256
    reps = 1 if args.quick else 3
    out: dict = {"num_particles": n, "x_len": len(x)}

    if run("importance"):
        with torch.no_grad():
            t_ours = timed(lambda: Importance(n).run(model, guide, x), reps)
            t_ours_traced = timed(lambda: Importance(n, fast=False).run(model, guide, x), reps)
            t_pyro = timed(lambda: pyro.infer.Importance(model, guide, num_samples=n).run(x), 1)
        out.update(importance_s=t_ours, importance_traced_s=t_ours_traced, pyro_importance_s=t_pyro,
                   is_speedup_vs_pyro_importance=t_pyro / t_ours,
                   is_traced_speedup_vs_pyro_importance=t_pyro / t_ours_traced)

    # sampling vs a bare incremental forward loop (same batch, same number of steps)
    if run("sampling"):
        B, steps = 256, 16
        dist = LMSequence(prior, constraint=proj.domain(steps // 2), max_len=steps)

        def sample():
            z, _ = dist.sample_with_log_prob((B,))
            return z

        with torch.no_grad():
            z = sample()
            ntok = int((z != 0).sum())
            L = z.shape[1]

            def bare():
                logits, cache = prior(torch.ones(B, 1, dtype=torch.long))
                for i in range(L):
                    logits, cache = prior(z[:, i : i + 1].clamp(min=2), cache=cache)

            # interleaved rounds (best of each, round 0 warms up), as for SMC below: a burst of other load on a
            # shared machine lands on both loops, not on one of them (timed one after the other, the quick
            # ratio spread 0.57-1.04 between runs of one commit)
            t_sample = t_bare = float("inf")
            for rnd in range(1 + 10 * reps):
                t_s, t_b = once(sample), once(bare)
                if rnd:
                    t_sample, t_bare = min(t_sample, t_s), min(t_bare, t_b)
        # ntok counts the tokens sampled (not <pad>), the forward loop B * L positions: the fraction is at most
        # ntok / (B * L) (sampling_fraction_ceiling) when sampling costs what the bare loop does
        out.update(sampling_tokens_per_s=ntok / t_sample, forward_tokens_per_s=B * L / t_bare,
                   sampling_fraction_of_forward=(ntok / t_sample) / (B * L / t_bare),
                   sampling_fraction_ceiling=ntok / (B * L))

    # SMC throughput (particle-steps = particles x lockstep token steps). The three runs are timed in
    # interleaved rounds (best of each), so the program / SlowThinking ratio is measured under the same load.
    if run("smc"):
        tab = Tabular(2, V, torch.randn(V, V), trainable=False)
        tmodel = SlowThinking(tab, proj)
        tguide = CausalSampler(Tabular(2, V, torch.randn(V, V), trainable=False), tmodel)
        user = UserPauseProgram(prior, proj)  # same Transformer prior, proposal, particles and steps
        configs = {"tabular": (tmodel, tguide, x), "transformer": (model, guide, x),
                   "program_transformer": (user, guide, model.x_ids(x))}
        results, best = {}, dict.fromkeys(configs, float("inf"))
        for rnd in range(1 + 10 * reps):  # round 0 warms up
            for name, (m, g, obs) in configs.items():
                t0 = time.perf_counter()
                results[name] = SMC(n).run(m, g, obs)
                if rnd:
                    best[name] = min(best[name], time.perf_counter() - t0)
        for name in configs:
            out[f"smc_{name}_particle_steps_per_s"] = results[name].stats["particle_steps"] / best[name]
            if name != "program_transformer":
                out[f"smc_{name}_mode"] = results[name].stats["mode"]
        out["smc_program_vs_slow_thinking_transformer"] = (out["smc_program_transformer_particle_steps_per_s"]
                                                           / out["smc_transformer_particle_steps_per_s"])
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
