"""The sampler hierarchy on a model whose posterior is not causal (Section 3.6, Prop 3.5, Example 3.3).

Model (Example 3.3 in miniature): SparseThoughts with one thought ``<s> y </s>`` (one token,
y in {a, b}) before x_1, then x_1 x_2 in Sigma = {<eos>, a, b}. The prior draws y uniformly,
x_1 uniformly and independently of y, and copies y into x_2 with probability 0.9. So the
posterior Q_*(y | x) depends on x_2, which comes *after* the segment z^(1) = <s> y </s> x_1:
Q_* is not causal (Def 3.8). Any causal sampler must choose y from x_1 alone, and since x_1 is
independent of y the best one cannot do better than a fixed law over y: chi^2 stays bounded
away from 0 (Prop 3.5; about 0.8 here, the chi^2 of the uniform law over y). An explanatory sampler
("x <explain> z", Section 5.6.2) reads x_2 and can match Q_*.

Both samplers are order-4 Tabular LMs fitted by minimising the exact reverse KL
sum_x p(x) KL(Q(.|x) || Q_*(.|x)) by full enumeration of the liftings.

    python examples/sampler_hierarchy.py [--quick] [--json FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os

import torch

from ppl_thought import provenance as pv
from ppl_thought.diagnostics import chi2
from ppl_thought.guides import Causal, Explanatory, Identity, Posterior
from ppl_thought.lm import Tabular
from ppl_thought.models import SlowThinking
from ppl_thought.projections import SparseThoughts
from ppl_thought.vocab import Vocab


def build_model() -> SlowThinking:
    """The non-causal-posterior model described in the module docstring."""
    v = Vocab(["a", "b"])
    proj = SparseThoughts(v, thought_len=1, positions=[0])
    V = len(v)
    logits = torch.zeros((V,) * 4)
    sigma = v.observable_ids.tolist()
    end = v.end_think_id
    for y in v.ordinary_ids.tolist():
        for x1 in sigma:
            row = torch.full((V,), math.log(0.05))
            row[y] = math.log(0.9)
            logits[y, end, x1] = row
    return SlowThinking(Tabular(4, V, logits, trainable=False), proj)


def fit(sampler, model, xs, weights, targets, steps: int, lr: float = 0.2) -> list[float]:
    """Minimise sum_x p(x) KL(Q(.|x) || Q_*(.|x)) exactly; returns the loss curve."""
    opt = torch.optim.Adam(sampler.lm.parameters(), lr=lr)
    curve = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.zeros(())
        for x, w, (support, lq_star) in zip(xs, weights, targets):
            lq = sampler.log_prob(support, x)
            loss = loss + w * (lq.exp() * (lq - lq_star)).sum()
        loss.backward()
        opt.step()
        curve.append(float(loss.detach()))
    return curve


def run(steps: int = 300, seed: int = 0) -> dict:
    """Fit the best causal and an explanatory sampler; chi^2(Q_* || Q) per x and summaries."""
    torch.manual_seed(seed)
    model = build_model()
    v = model.vocab
    V = len(v)
    sigma = v.observable_ids.tolist()
    xs = [torch.tensor(p) for p in itertools.product(sigma, repeat=2)]
    post = Posterior(model)
    targets = [post.table(x) for x in xs]
    weights = torch.stack([model.exact_log_prob(x) for x in xs]).exp()
    weights = weights / weights.sum()
    # both samplers start from the same random table (zeros would start the causal one at its optimum,
    # the uniform law over y, and its curve would not move)
    init = torch.randn((V,) * 4, generator=torch.Generator().manual_seed(seed))
    causal = Causal(Tabular(4, V, init), model.projection)
    expl = Explanatory(Tabular(4, V, init), model.projection)
    curves = {"causal": fit(causal, model, xs, weights, targets, steps),
              "explanatory": fit(expl, model, xs, weights, targets, steps)}
    ident = Identity(model)
    out: dict = {"x": [v.decode(x) for x in xs], "weights": weights.tolist(), "chi2": {}, "curves": curves}
    for name, s in (("identity", ident), ("causal", causal), ("explanatory", expl)):
        vals = [chi2(post, s, model=model, x=x) for x in xs]
        out["chi2"][name] = {"per_x": vals, "max": max(vals), "mean": float(torch.tensor(vals) @ weights)}
    # chi2 of the explanatory sampler reaches rounding level; floor it at 1e-12 for the ratio
    out["ratio_max"] = out["chi2"]["causal"]["max"] / max(out["chi2"]["explanatory"]["max"], 1e-12)
    return out


def plot(res: dict, out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    names = list(res["chi2"])
    ax[0].bar(names, [max(res["chi2"][n]["max"], 1e-8) for n in names], color=["gray", "tab:blue", "tab:red"])
    ax[0].set_yscale("log")
    ax[0].set_ylabel("max_x chi2(Q_* || Q)")
    ax[0].set_title("sampler hierarchy (Prop 3.5)")
    for n, c in res["curves"].items():
        ax[1].plot(c, label=n)
    ax[1].set_yscale("log")
    ax[1].set_xlabel("Adam step")
    ax[1].set_ylabel("E_x KL(Q || Q_*)")
    ax[1].legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "sampler_hierarchy.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer optimisation steps")
    ap.add_argument("--json", help="write the numbers to this JSON file")
    ap.add_argument("--out", help="write a PNG plot into this directory")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    res = run(steps=120 if a.quick else 400, seed=a.seed)
    for n, c in res["chi2"].items():
        print(f"{n:12s} max_x chi2 = {c['max']:.3e}   E_x chi2 = {c['mean']:.3e}")
    print(f"ratio causal / explanatory (max over x) = {res['ratio_max']:.3g}")
    if a.json:
        with open(a.json, "w") as f:
            res[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            json.dump(res, f, indent=1)
    if a.out:
        print("plot:", plot(res, a.out))
    return res


if __name__ == "__main__":
    main()
