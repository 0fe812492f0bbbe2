"""Minimum-length regular coding (Section 6.3): active lifting learns a code, compared with Huffman's.

    python -m ppl_thought.experiments.active_coding [--quick] [--seed S] [--json FILE]

For each N, a random P_* over N elements (uniform in [0, 1]^N, normalised, as in Figure 6.1 right) and
Omega = {0, 1}. One Transformer plays the sampler Q (``x <s> z``), the latent model P (``<s> z``) and the
decoder G (``z </s> x``) of an :class:`~ppl_thought.transforms.ActiveLift` with latent sequences of cut-off
length T. Q and G are trained on the coding objective (6.10), min_{Q,G} sum_{t=0}^T E[-log G(x | Z_<=t)]
(the decoder G plays P_*(x | z_<=t)), and P on (6.6), with the library's estimator
(:func:`~ppl_thought.training.active.active_terms`: score function with reward-to-go and a leave-one-out
baseline for Q, pathwise for P and G). Every x is in every batch, weighted by P_*(x); n particles each.

Evaluation is exact, by enumerating Omega^T for every x:

* ``learned_objective``: (6.10) of the trained Q, sum_{t=0}^T H(X | Z_<=t) in bits, with the true posterior
  P_*(x | z_<=t) = P_*(x) Q(z_<=t | x) / Q_*(z_<=t) (not the decoder's estimate);
* the code Q settles on: Q's greedy decoding z^g(x), cut at the first t where its prefix is no other x's
  (the shortest identifying prefix); ``learned_length`` is its expected length and ``learned_code_objective``
  its (6.12) value; ``prefix_free`` says whether the cut codes form a prefix-free code (they do whenever the
  greedy sequences are distinct; checked pair by pair);
* determinism (Remark 6.1): ``h_x_given_z`` = H(X | Z_<=T) in nats, and ``q_max_mass`` = Q's mass on the
  code of x (the P_*-weighted mean; ``q_max_mass_min`` the least over x);
* Huffman's code (written here): its (6.12) value ``huffman_objective`` and expected length
  ``huffman_length``; ``entropy`` = H(P_*) in bits, the bound on expected length; ``objective_lower_bound``
  = sum_t max(H - t, 0), a bound on (6.10) (each binary token removes at most one bit).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from ppl_thought.experiments.common import run_alone, set_lr
from ppl_thought.lm import Transformer
from ppl_thought.training.active import active_terms
from ppl_thought.training.trainer import clip_joint_, cosine_lr
from ppl_thought.transforms.active import ActiveLift
from ppl_thought.vocab import Vocab

__all__ = ["CodingConfig", "code_objective", "huffman_code", "run_active_coding", "plot_coding", "main"]


@dataclass
class CodingConfig:
    """Sizes of the minimum-length coding experiment."""

    sizes: tuple[int, ...] = (8, 16, 32)
    steps: int = 500
    particles: int = 16  # n latent sequences per x per step
    lr: float = 1e-3  # peak; cosine schedule (5% warm-up, decay to 10%)
    clip: float = 1.0
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    extra_len: int = 0  # T = 2 ceil(log2 N) + extra_len
    init_scale: float = 1.0  # std of every weight at init (see train_one)
    steps_per_size: dict = field(default_factory=dict)  # N -> steps, overriding ``steps``

    @classmethod
    def quick(cls) -> CodingConfig:
        """N = 8 only, small enough for CI."""
        return cls(sizes=(8,), steps=200)

    def latent_len(self, N: int) -> int:
        return 2 * math.ceil(math.log2(N)) + self.extra_len


# ====================================================================== codes
def huffman_code(p: np.ndarray) -> list[str]:
    """A binary Huffman code of the distribution ``p`` (Figure 6.1 left): ``codes[i]`` is the code word of i."""
    p = np.asarray(p, dtype=float)
    if p.ndim != 1 or len(p) < 2 or (p < 0).any():
        raise ValueError(f"huffman_code needs a distribution over at least 2 elements, got {p!r}")
    heap = [(float(pi), i, (i,)) for i, pi in enumerate(p)]
    heapq.heapify(heap)
    codes = [""] * len(p)
    counter = len(p)
    while len(heap) > 1:
        p0, _, a = heapq.heappop(heap)
        p1, _, b = heapq.heappop(heap)
        for i in a:
            codes[i] = "0" + codes[i]
        for i in b:
            codes[i] = "1" + codes[i]
        heapq.heappush(heap, (p0 + p1, counter, a + b))
        counter += 1
    return codes


def is_prefix_free(codes: list[str]) -> bool:
    """Whether no code word is a prefix of another (distinct words, Section 6.3's definition of a coding)."""
    return all(not b.startswith(a) for a, b in itertools.permutations(codes, 2))


def code_objective(p: np.ndarray, codes: list[str]) -> float:
    """(6.12) of a code in bits: sum_{t >= 0} E_{X ~ P_*}[-log2 P_*(X | z(X)_<=t)], z(x) = c(x) padded with blanks,
    P_*(. | w) = law(X | w is a prefix of z(X)) (6.11)."""
    p = np.asarray(p, dtype=float)
    total = 0.0
    for t in range(max(len(c) for c in codes) + 1):
        prefix: dict[str, float] = {}
        keys = [c[:t] if len(c) >= t else c + "#" * (t - len(c)) for c in codes]
        for k, pi in zip(keys, p):
            prefix[k] = prefix.get(k, 0.0) + pi
        total += float(sum(pi * -math.log2(pi / prefix[k]) for k, pi in zip(keys, p) if pi > 0))
    return total


# ====================================================================== exact evaluation of a trained Q
@torch.no_grad()
def evaluate(lift: ActiveLift, p_star: np.ndarray, x_ids: torch.Tensor) -> dict:
    """Exact (6.10), determinism and the learned code by enumerating Omega^T for every x (see the module doc)."""
    N, T = len(p_star), lift.latent_len
    omega = lift.omega.nonzero().flatten().tolist()  # [id("0"), id("1")]
    zs = torch.tensor(list(itertools.product(omega, repeat=T)), dtype=torch.long)  # [2^T, T], first token major
    M = zs.shape[0]
    logq = torch.empty(N, M, dtype=torch.float64)
    chunk = max(1, 16384 // N)
    for s in range(0, M, chunk):
        zc = zs[s:s + chunk]
        rows = zc.repeat(N, 1)
        xr = x_ids.repeat_interleave(zc.shape[0], 0)
        logq[:, s:s + chunk] = lift.sampler_log_probs(rows, xr).sum(-1).double().view(N, -1)
    q = logq.exp()
    q = q / q.sum(1, keepdim=True)  # exact up to float rounding
    ps = torch.as_tensor(p_star, dtype=torch.float64)
    cond = []  # H(X | Z_<=t) in bits, t = 0..T
    for t in range(T + 1):
        qt = q.view(N, 2 ** t, 2 ** (T - t)).sum(-1)  # Q^{<=t}(prefix | x)
        joint = ps[:, None] * qt
        marg = joint.sum(0, keepdim=True)
        post = torch.where(joint > 0, joint / marg, torch.ones_like(joint))
        cond.append(float(-(joint * torch.log2(post)).sum()))
    # the prior P against Q_* (6.6)
    logp = torch.cat([lift.prior_log_probs(zs[s:s + 16384]).sum(-1).double() for s in range(0, M, 16384)])
    q_star = (ps[:, None] * q).sum(0)
    pos = q_star > 0
    kl = float((q_star[pos] * (q_star[pos].log() - logp[pos])).sum())
    # the code Q settles on: greedy decoding, cut at the shortest identifying prefix
    greedy: list[str] = []
    mass = []
    for i in range(N):
        word = ""
        for t in range(T):
            qt = q[i].view(2 ** (t + 1), 2 ** (T - t - 1)).sum(-1)
            idx = int(word, 2) * 2 if word else 0
            a, b = float(qt[idx]), float(qt[idx + 1])
            bit = "0" if a >= b else "1"
            word += bit
        greedy.append(word)
    codes = []
    for i in range(N):
        L = T
        for t in range(T + 1):
            if all(greedy[j][:t] != greedy[i][:t] for j in range(N) if j != i):
                L = t
                break
        codes.append(greedy[i][:L])
        qt = q[i].view(2 ** L, 2 ** (T - L)).sum(-1)
        lq = float(qt[int(codes[i], 2) if codes[i] else 0])
        mass.append(lq)
    mass = np.array(mass)
    distinct = len(set(greedy)) == N
    return {
        "learned_objective": float(sum(cond)),
        "conditional_entropies_bits": cond,
        "h_x_given_z": cond[-1] * math.log(2),
        "learned_codes": codes,
        "learned_length": float(np.dot(p_star, [len(c) for c in codes])),
        "learned_code_objective": code_objective(p_star, codes) if distinct else float("nan"),
        "prefix_free": bool(distinct and is_prefix_free(codes)),
        "q_max_mass": float(np.dot(p_star, mass)),
        "q_max_mass_min": float(mass.min()),
        "prior_kl_nats": kl,
    }


# ====================================================================== training
def train_one(N: int, cfg: CodingConfig, seed: int, progress: bool = True) -> dict:
    """Draw P_* over N elements, train Q, P, G on (6.10) / (6.6), evaluate exactly, compare with Huffman."""
    rng = np.random.default_rng(seed * 1000 + N)
    u = rng.uniform(0.0, 1.0, N)
    p_star = u / u.sum()
    T = cfg.latent_len(N)
    vocab = Vocab(["0", "1"] + [f"x{i}" for i in range(N)])
    torch.manual_seed(seed * 1000 + N)
    lm = Transformer(len(vocab), d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, max_len=T + 4)
    # The GPT-2 init (std 0.02) starts Q almost independent of x: a stationary point of I(X; Z) (its gradient
    # vanishes at independence), where the score function has nothing to follow and the run stays at the
    # useless code (observed: H(X | Z) = H(P_*) after 400 steps). A wider init starts Q at a random stochastic
    # code instead, and training improves it.
    with torch.no_grad():
        for name, prm in lm.named_parameters():
            if not name.endswith("norm.weight"):
                prm.normal_(0.0, cfg.init_scale)
    lift = ActiveLift(lm, vocab, latent_len=T, latent_tokens=["0", "1"], max_x_len=1)
    x_ids = torch.tensor([[vocab.id(f"x{i}")] for i in range(N)])  # [N, 1]
    weights = torch.as_tensor(p_star, dtype=torch.float32)
    n = cfg.particles
    x_rows = x_ids.repeat(n, 1)  # particle-major rows [n N, 1]
    params = list(lm.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr)
    steps = int(cfg.steps_per_size.get(N, cfg.steps))
    curve = []
    t0 = time.time()
    with tqdm(total=steps, desc=f"active coding N={N}", disable=not progress) as bar:
        for step in range(1, steps + 1):
            set_lr(opt, cosine_lr(cfg.lr, step - 1, steps))
            with torch.no_grad():
                z = lift.sampler(x_ids).sample((n,)).reshape(n * N, T)  # Z ~ Q(. | x), every x, n each
            lq = lift.sampler_log_probs(z, x_rows)
            lp = lift.prior_log_probs(z)
            lg = lift.generator_log_probs(x_rows, z)

            def per_x(a: torch.Tensor) -> torch.Tensor:  # [n N, k] -> [N, n, k]
                return a.view(n, N, -1).transpose(0, 1)

            value, surr = active_terms("coding", per_x(lq), per_x(lp), per_x(lg), weights=weights)
            opt.zero_grad()
            surr.backward()
            clip_joint_(params, cfg.clip)
            opt.step()
            bar.update(1)
            if step % max(1, steps // 10) == 0 or step == steps:
                bits = float(value) / math.log(2)
                curve.append({"step": step, "decoder_objective_bits": bits})
                bar.set_postfix({"(6.10) bits": f"{bits:.3f}"})
    secs = time.time() - t0
    res = evaluate(lift, p_star, x_ids)
    huff = huffman_code(p_star)
    H = float(-(p_star * np.log2(p_star)).sum())
    res.update({
        "huffman_objective": code_objective(p_star, huff),
        "huffman_length": float(np.dot(p_star, [len(c) for c in huff])),
        "huffman_codes": huff,
        "entropy": H,
        "objective_lower_bound": float(sum(max(H - t, 0.0) for t in range(int(math.ceil(H)) + 1))),
        "latent_len": T,
        "steps": steps,
        "seconds": round(secs, 1),
        "curve": curve,
        "p_star": p_star.tolist(),
    })
    res["relative_gap"] = res["learned_objective"] / res["huffman_objective"] - 1.0
    res["within_5_percent"] = bool(res["learned_objective"] <= 1.05 * res["huffman_objective"])
    res["deterministic"] = bool(res["h_x_given_z"] < 0.01)
    return res


def run_active_coding(cfg: CodingConfig, seed: int = 0, progress: bool = True) -> dict:
    """Train and evaluate for every N of ``cfg.sizes``: ``{"coding": {"<N>": {...}}, "config": ..., ...}``."""
    t0 = time.time()
    coding = {str(N): train_one(N, cfg, seed, progress) for N in cfg.sizes}
    return {
        "coding": coding,
        "config": asdict(cfg),
        "seed": seed,
        "criteria": {N: {"within_5_percent": r["within_5_percent"], "h_x_given_z_below_0.01_nats": r["deterministic"]}
                     for N, r in coding.items()},
        "total_seconds": round(time.time() - t0, 1),
    }


def plot_coding(res: dict, path: str) -> None:
    """Figure 6.1 (right) from our runs: (6.12) against expected code length, learned and Huffman, per N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = sorted(res["coding"].items(), key=lambda kv: int(kv[0]))
    fig, ax = plt.subplots(figsize=(5, 4))
    cmap = plt.get_cmap("viridis")
    for k, (N, r) in enumerate(items):
        c = cmap(k / max(1, len(items) - 1))
        ax.scatter(r["huffman_length"], r["huffman_objective"], marker="o", color=c, s=50,
                   label="Huffman" if k == 0 else None)
        ax.scatter(r["learned_length"], r["learned_objective"], marker="x", color=c, s=60,
                   label="active lifting (learned Q)" if k == 0 else None)
        ax.annotate(f"N={N}", (r["huffman_length"], r["huffman_objective"]), textcoords="offset points",
                    xytext=(6, -10), fontsize=8)
    lo = min(min(r["huffman_length"], r["learned_length"]) for _, r in items) - 0.3
    hi = max(max(r["huffman_length"], r["learned_length"]) for _, r in items) + 0.3
    ax.plot([lo, hi], [lo, hi], ls=":", color="grey", lw=1, label="y = x")
    ax.set_xlabel("expected code length E|c(X)| (bits)")
    ax.set_ylabel("(6.12): sum_t E[-log2 P*(X | z_<=t)] (bits)")
    ax.set_title("Minimum-length coding (Fig. 6.1 right)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run alone: ``python -m ppl_thought.experiments.active_coding [--quick] [--seed S] [--json FILE]`` (one torch
    thread: the models are tiny, and more threads only contend on a shared machine)."""
    torch.set_num_threads(1)
    return run_alone(__doc__, run_active_coding, CodingConfig, argv)


if __name__ == "__main__":
    raise SystemExit(main())
