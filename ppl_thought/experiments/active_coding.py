"""Minimum-length regular coding (Section 6.3): active lifting learns a code, compared with Huffman's.

    python -m ppl_thought.experiments.active_coding [--quick] [--seed S] [--json FILE]

For each N, a random P_* over N elements (uniform in [0, 1]^N, normalised, as in Figure 6.1 right) and
Omega = {0, 1}. One Transformer plays the sampler Q (``x <s> z``), the latent model P (``<s> z``) and the
decoder G (``z </s> x``) of an :class:`~ppl_thought.transforms.ActiveLift` with latent sequences of cut-off
length T. Q and G are trained on the coding objective (6.10), min_{Q,G} sum_{t=0}^T E[-log G(x | Z_<=t)]
(the decoder G plays P_*(x | z_<=t)), and P on (6.6), with the library's estimator
(:func:`~ppl_thought.training.active.active_terms`: score function with reward-to-go and a leave-one-out
baseline for Q, pathwise for P and G). Every x is in every batch, weighted by P_*(x); n particles each.

The remedies for the local optima of the plain run (docs/active-lifting.md), each a *variant* of the run:

* ``exact`` decoder: the learned G is replaced by the exact posterior of (6.10),
  P_*(x | z_<=t) = P_*(x) Q(z_<=t | x) / sum_x' P_*(x') Q(z_<=t | x') (:func:`exact_log_posterior`,
  enumeration over the N symbols for every particle); the rewards of Q are then -log P_*(x | Z_<=t) and the
  value is the Monte-Carlo estimate of (6.10) itself. (Its pathwise part, E[-grad log P_*(x | Z_<=t)], has mean
  0: it is E[-grad log Q(Z_<=t | x)] + E[grad log Q_*(Z_<=t)], two score means; the estimator leaves it out.)
* ``+anneal``: entropy annealing, (6.10) - beta_s H(Q(. | x)) averaged over x ~ P_*, with
  H(Q(. | x)) = E[sum_t H(Q(. | x, Z_<t))] (chain rule) and beta_s falling linearly from
  beta_0 = ``entropy_start`` x beta_c at the first step to 0 at the fraction ``entropy_until`` of the steps
  (:func:`entropy_weight`); its gradient is the pathwise gradient of the per-token entropies plus the score
  function with those entropies as rewards (:func:`entropy_surrogate`). The scale beta_c (:func:`entropy_scale`)
  = ((T + 1) H(P_*) - sum_t max(H(P_*) - t, 0)) / (T log 2) in nats per nat is where the uniform Q (value
  (T + 1) H(P_*) - beta T log 2) beats every deterministic code (value >= the lower bound): above it the
  annealing starts from the trivial, fully random sampler, as deterministic annealing does.
* restarts: R independent initialisations (``restarts``) on the same P_*; the run kept is the one with the
  least *training* objective (the value the run optimises, averaged over its last 10% of steps), never the
  evaluated (6.10); ``restarts_within_5pct`` is the share of the R restarts whose evaluated (6.10) is within
  5% of Huffman's.

Evaluation is exact, by enumerating Omega^T for every x:

* ``learned_objective``: (6.10) of the trained Q, sum_{t=0}^T H(X | Z_<=t) in bits, with the true posterior
  P_*(x | z_<=t) = P_*(x) Q(z_<=t | x) / Q_*(z_<=t) (not the decoder's estimate), :func:`conditional_entropies`;
* the code Q settles on: Q's greedy decoding z^g(x), cut at the first t where its prefix is no other x's
  (the shortest identifying prefix), :func:`greedy_codes`; ``learned_length`` is its expected length and
  ``learned_code_objective`` its (6.12) value; ``prefix_free`` says whether the cut codes form a prefix-free
  code (they do whenever the greedy sequences are distinct; checked pair by pair);
* determinism (Remark 6.1): ``h_x_given_z`` = H(X | Z_<=T) in nats, and ``q_max_mass`` = Q's mass on the
  code of x (the P_*-weighted mean; ``q_max_mass_min`` the least over x);
* Huffman's code (written here): its (6.12) value ``huffman_objective`` and expected length
  ``huffman_length``; ``entropy`` = H(P_*) in bits, the bound on expected length; ``objective_lower_bound``
  = sum_t max(H - t, 0), a bound on (6.10) (each binary token removes at most one bit).

The goal of issue 30: (6.10) within 5% of Huffman's (6.12) and H(X | Z) < 0.01 nats at N = 8 and 16.
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

from ppl_thought.errors import ConfigError
from ppl_thought.experiments.common import provenance, set_lr, stamped, start_record
from ppl_thought.lm import Transformer
from ppl_thought.training.active import active_terms, prefix_sums, score_function_surrogate
from ppl_thought.training.trainer import clip_joint_, cosine_lr
from ppl_thought.transforms.active import ActiveLift
from ppl_thought.vocab import Vocab

__all__ = ["CodingConfig", "VARIANTS", "code_objective", "conditional_entropies", "draw_p_star", "entropy_surrogate",
           "entropy_scale", "entropy_weight", "exact_log_posterior", "greedy_codes", "huffman_code", "is_prefix_free",
           "run_active_coding", "select_restart", "summarize_variant", "plot_coding", "main"]

# variant -> (decoder, entropy annealing)
VARIANTS: dict[str, tuple[str, bool]] = {
    "learned": ("learned", False), "learned+anneal": ("learned", True),
    "exact": ("exact", False), "exact+anneal": ("exact", True),
}


@dataclass
class CodingConfig:
    """Sizes of the minimum-length coding experiment and the remedies tried (module docstring)."""

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
    workers: int = 1  # processes for the runs (each one torch thread; the results do not depend on it)
    variants: tuple[str, ...] = ("learned", "learned+anneal", "exact", "exact+anneal")  # keys of VARIANTS
    restarts: int = 4  # R independent initialisations per variant and N
    entropy_start: float = 1.25  # beta at the first step of an annealed run, in units of entropy_scale(p, T)
    entropy_until: float = 0.5  # the fraction of the steps at which beta reaches 0

    def __post_init__(self) -> None:
        self.sizes = tuple(self.sizes)
        self.variants = tuple(self.variants)
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ConfigError(f"CodingConfig.variants must be a non-empty subset of {sorted(VARIANTS)}, got "
                              f"{self.variants!r}")
        if any(not isinstance(N, int) or N < 2 for N in self.sizes) or not self.sizes:
            raise ConfigError(f"CodingConfig.sizes must be integers >= 2, got {self.sizes!r}")
        if not isinstance(self.restarts, int) or self.restarts < 1:
            raise ConfigError(f"CodingConfig.restarts must be an integer >= 1, got {self.restarts!r}")
        if not isinstance(self.particles, int) or self.particles < 2:
            raise ConfigError(f"CodingConfig.particles must be an integer >= 2 (leave-one-out baseline), got "
                              f"{self.particles!r}")
        if not math.isfinite(self.entropy_start) or self.entropy_start < 0:
            raise ConfigError(f"CodingConfig.entropy_start must be a finite number >= 0, got {self.entropy_start!r}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(f"CodingConfig.steps must be an integer >= 1, got {self.steps!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"CodingConfig.workers must be an integer >= 1, got {self.workers!r}")
        if not 0 < self.entropy_until <= 1:
            raise ConfigError(f"CodingConfig.entropy_until must be in (0, 1], got {self.entropy_until!r}")

    @classmethod
    def quick(cls) -> CodingConfig:
        """The committed run (``benchmarks/results/active_coding.json``): N = 8 and 16, every variant, 3 restarts."""
        return cls(sizes=(8, 16), steps=300, restarts=3, workers=2)

    @classmethod
    def smoke(cls) -> CodingConfig:
        """N = 8, one restart of the plain run and of both remedies together, few steps: for the tests."""
        return cls(sizes=(8,), steps=40, restarts=1, variants=("learned", "exact+anneal"))

    def latent_len(self, N: int) -> int:
        return 2 * math.ceil(math.log2(N)) + self.extra_len


# ====================================================================== codes
def huffman_code(p: np.ndarray) -> list[str]:
    """A binary Huffman code of the distribution ``p`` (Figure 6.1 left): ``codes[i]`` is the code word of i."""
    p = np.asarray(p, dtype=float)
    if p.ndim != 1 or len(p) < 2 or (p < 0).any():
        raise ConfigError(f"huffman_code: p must be a 1-D distribution over at least 2 elements, got {p!r}")
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


# ====================================================================== exact quantities
def conditional_entropies(q: torch.Tensor, p_star: np.ndarray | torch.Tensor) -> list[float]:
    """H(X | Z_<=t) in bits for t = 0..T, (X, Z) ~ P_* (x) Q (the terms of (6.10)), by enumeration.

    ``q`` is ``[N, 2^T]``: Q(z | x) over Omega^T = {0, 1}^T, z in binary order (first token major). The
    prefix law Q(z_<=t | x) sums the 2^(T - t) completions of each prefix; the posterior is
    P_*(x | z_<=t) = P_*(x) Q(z_<=t | x) / Q_*(z_<=t) (Section 6.1, (6.2)).
    """
    q = torch.as_tensor(q, dtype=torch.float64)
    ps = torch.as_tensor(p_star, dtype=torch.float64)
    N, M = q.shape
    T = int(round(math.log2(M)))
    if 2 ** T != M or ps.shape != (N,):
        raise ConfigError(f"conditional_entropies: q must be [N, 2^T] and p_star [N], got {tuple(q.shape)} and "
                          f"{tuple(ps.shape)}")
    out = []
    for t in range(T + 1):
        qt = q.view(N, 2 ** t, 2 ** (T - t)).sum(-1)  # Q^{<=t}(prefix | x)
        joint = ps[:, None] * qt
        marg = joint.sum(0, keepdim=True)
        post = torch.where(joint > 0, joint / marg, torch.ones_like(joint))
        out.append(float(-(joint * torch.log2(post)).sum()))
    return out


def greedy_codes(q: torch.Tensor) -> tuple[list[str], list[str], np.ndarray]:
    """The code Q settles on: (greedy words, cut codes, Q's mass on each cut code).

    ``q`` as in :func:`conditional_entropies`. The greedy word of x follows the likelier token of the prefix
    law Q(z_<=t | x) at every step; its cut code is its shortest prefix that no other x's greedy word shares
    (the whole word when one does).
    """
    q = torch.as_tensor(q, dtype=torch.float64)
    N, M = q.shape
    T = int(round(math.log2(M)))
    greedy = []
    for i in range(N):
        word = ""
        for t in range(T):
            qt = q[i].view(2 ** (t + 1), 2 ** (T - t - 1)).sum(-1)
            idx = int(word, 2) * 2 if word else 0
            word += "0" if float(qt[idx]) >= float(qt[idx + 1]) else "1"
        greedy.append(word)
    codes, mass = [], []
    for i in range(N):
        L = next((t for t in range(T + 1) if all(greedy[j][:t] != greedy[i][:t] for j in range(N) if j != i)), T)
        codes.append(greedy[i][:L])
        qt = q[i].view(2 ** L, 2 ** (T - L)).sum(-1)
        mass.append(float(qt[int(codes[i], 2) if codes[i] else 0]))
    return greedy, codes, np.array(mass)


def exact_log_posterior(lift: ActiveLift, z: torch.Tensor, x_index: torch.Tensor, x_ids: torch.Tensor,
                        log_p_star: torch.Tensor) -> torch.Tensor:
    """``[B, T + 1]``: log P_*(x_b | z_b,<=t), t = 0..T, the exact posterior of (6.10) by enumerating the N symbols.

    P_*(x | z_<=t) = P_*(x) Q^{<=t}(z_<=t | x) / sum_x' P_*(x') Q^{<=t}(z_<=t | x')  (Section 6.1, (6.2)-(6.3)),
    with Q^{<=t} the product (6.1) of the per-token laws. ``z`` ``[B, T]`` latents, ``x_index`` ``[B]`` the
    symbol each row is scored for, ``x_ids`` ``[N, L]`` the N symbols, ``log_p_star`` ``[N]``. One
    teacher-forced pass of Q over the B N pairs (rows shared between pairs are computed once).
    """
    B, T = z.shape
    N = x_ids.shape[0]
    lq = lift.sampler_log_probs(z.repeat_interleave(N, 0), x_ids.repeat(B, 1)).view(B, N, T)
    joint = log_p_star.to(lq)[None, :, None] + prefix_sums(lq)  # [B, N, T + 1]
    own = joint.gather(1, x_index.view(B, 1, 1).expand(B, 1, T + 1)).squeeze(1)
    return own - torch.logsumexp(joint, 1)


def entropy_scale(p_star: np.ndarray, T: int) -> float:
    """beta_c = ((T + 1) H - sum_t max(H - t, 0)) / T with H = H(P_*) in bits (a ratio: the same in nats): the
    entropy weight above which the uniform Q, whose (6.10) - beta H(Q) is (T + 1) H - beta T (bits), beats every
    deterministic code (whose (6.10) is at least sum_t max(H - t, 0), each binary token removing at most a bit)."""
    p = np.asarray(p_star, dtype=float)
    H = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
    bound = sum(max(H - t, 0.0) for t in range(T + 1))
    return ((T + 1) * H - bound) / T


def entropy_weight(step: int, steps: int, start: float, until: float) -> float:
    """beta_s of entropy annealing: ``start`` at step 1, falling linearly to 0 at step ``until * steps``, then 0."""
    end = max(1.0, until * steps)
    return float(start * max(0.0, 1.0 - (step - 1) / end))


def _token_entropies(log_q_steps: torch.Tensor) -> torch.Tensor:
    """Per-token entropies H(Q(. | x, Z_<t)) ``[..., T]`` of a binary Omega from the log-probability of the drawn
    token: with p = Q(Z_t | ...), the other token has 1 - p, H = -p log p - (1 - p) log(1 - p). Clamped just below
    log 1 so that a certain token gives H = 0 (not NaN) with gradient 0."""
    lq = log_q_steps.clamp(max=-1e-6)
    p = lq.exp()
    return -(p * lq + (1 - p) * torch.log(-torch.expm1(lq)))


def entropy_surrogate(log_q_steps: torch.Tensor, beta: float, weights: torch.Tensor) -> torch.Tensor:
    """A scalar whose gradient is an unbiased estimate of grad_Q [-beta sum_x w_x H(Q(. | x))] (entropy annealing).

    ``log_q_steps`` ``[N, n, T]``: log Q(Z_t | x, Z_<t) of n particles Z ~ Q(. | x) per x (binary Omega), with
    gradients; ``weights`` ``[N]`` = P_*(x). By the chain rule H(Q(. | x)) = E[sum_t H_t(Z_<t)], H_t the entropy of
    the t-th token's law; its gradient is E[sum_t grad H_t] (pathwise) + E[sum_t H_t grad log Q(Z_<t | x)]
    (score function; H_t is the reward of the prefix Z_<=t-1, with the leave-one-out baseline).
    """
    ent = _token_entropies(log_q_steps)  # [N, n, T]
    rewards = torch.nn.functional.pad(-beta * ent.detach(), (0, 1))  # H_t at prefix index t - 1; none at T
    pathwise = -beta * (weights.to(ent) * ent.sum(-1).mean(-1)).sum()
    return score_function_surrogate(rewards, log_q_steps, True, weights) + pathwise


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
    cond = conditional_entropies(q, ps)
    # the prior P against Q_* (6.6)
    logp = torch.cat([lift.prior_log_probs(zs[s:s + 16384]).sum(-1).double() for s in range(0, M, 16384)])
    q_star = (ps[:, None] * q).sum(0)
    pos = q_star > 0
    kl = float((q_star[pos] * (q_star[pos].log() - logp[pos])).sum())
    greedy, codes, mass = greedy_codes(q)
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
def draw_p_star(N: int, seed: int) -> np.ndarray:
    """P_* of the run (seed, N): uniform in [0, 1]^N, normalised (Figure 6.1 right); the same for every restart."""
    u = np.random.default_rng(seed * 1000 + N).uniform(0.0, 1.0, N)
    return u / u.sum()


def train_one(N: int, cfg: CodingConfig, seed: int, progress: bool = True, variant: str = "learned",
              restart: int = 0) -> dict:
    """Draw P_* over N elements, train Q, P (and G) on (6.10) / (6.6) in one ``variant`` of :data:`VARIANTS`
    from initialisation ``restart``, evaluate exactly, compare with Huffman."""
    if variant not in VARIANTS:
        raise ConfigError(f"train_one: variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    decoder, anneal = VARIANTS[variant]
    p_star = draw_p_star(N, seed)
    T = cfg.latent_len(N)
    vocab = Vocab(["0", "1"] + [f"x{i}" for i in range(N)])
    torch.manual_seed(seed * 1000 + N + 100_003 * restart)  # restart 0: the initialisation of the plain run
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
    beta0 = cfg.entropy_start * entropy_scale(p_star, T)
    weights = torch.as_tensor(p_star, dtype=torch.float32)
    log_ps = weights.log()
    n = cfg.particles
    x_rows = x_ids.repeat(n, 1)  # particle-major rows [n N, 1]
    x_index = torch.arange(N).repeat(n)  # the symbol of each row
    params = list(lm.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr)
    steps = int(cfg.steps_per_size.get(N, cfg.steps))
    tail = max(1, steps // 10)  # the training objective of a run: its mean value over the last 10% of steps
    tail_sum = torch.zeros(())
    curve = []

    def per_x(a: torch.Tensor) -> torch.Tensor:  # [n N, k] -> [N, n, k]
        return a.view(n, N, -1).transpose(0, 1)

    t0, c0 = time.time(), time.process_time()
    with tqdm(total=steps, desc=f"active coding N={N} {variant} r{restart}", disable=not progress) as bar:
        for step in range(1, steps + 1):
            set_lr(opt, cosine_lr(cfg.lr, step - 1, steps))
            beta = entropy_weight(step, steps, beta0, cfg.entropy_until) if anneal else 0.0
            with torch.no_grad():
                z = lift.sampler(x_ids).sample((n,)).reshape(n * N, T)  # Z ~ Q(. | x), every x, n each
                if decoder == "exact":
                    lg = exact_log_posterior(lift, z, x_index, x_ids, log_ps)
            lq = lift.sampler_log_probs(z, x_rows)
            lp = lift.prior_log_probs(z)
            if decoder == "learned":
                lg = lift.generator_log_probs(x_rows, z)
            value, surr = active_terms("coding", per_x(lq), per_x(lp), per_x(lg), weights=weights)
            if beta > 0:
                surr = surr + entropy_surrogate(per_x(lq), beta, weights)
            opt.zero_grad()
            surr.backward()
            clip_joint_(params, cfg.clip)
            opt.step()
            if step > steps - tail:
                tail_sum = tail_sum + value.detach()
            bar.update(1)
            if step % max(1, steps // 10) == 0 or step == steps:
                bits = float(value) / math.log(2)
                curve.append({"step": step, "decoder_objective_bits": bits, "entropy_weight": beta})
                bar.set_postfix({"(6.10) bits": f"{bits:.3f}"})
    res = evaluate(lift, p_star, x_ids)
    secs, cpu = time.time() - t0, time.process_time() - c0
    huff = huffman_code(p_star)
    H = float(-(p_star * np.log2(p_star)).sum())
    res.update({
        "variant": variant,
        "decoder": decoder,
        "entropy_annealing": anneal,
        "restart": restart,
        "train_objective_bits": float(tail_sum) / tail / math.log(2),
        "entropy_start_nats": beta0 if anneal else 0.0,
        "huffman_objective": code_objective(p_star, huff),
        "huffman_length": float(np.dot(p_star, [len(c) for c in huff])),
        "huffman_codes": huff,
        "entropy": H,
        "objective_lower_bound": float(sum(max(H - t, 0.0) for t in range(int(math.ceil(H)) + 1))),
        "latent_len": T,
        "steps": steps,
        "seconds": round(secs, 1),  # wall, training and evaluation
        "cpu_seconds": round(cpu, 1),  # CPU time of this process (one torch thread: the cost on one core)
        "curve": curve,
        "p_star": p_star.tolist(),
    })
    res["relative_gap"] = res["learned_objective"] / res["huffman_objective"] - 1.0
    res["within_5_percent"] = bool(res["learned_objective"] <= 1.05 * res["huffman_objective"])
    res["deterministic"] = bool(res["h_x_given_z"] < 0.01)
    res["goal"] = res["within_5_percent"] and res["deterministic"]
    return res


_RESTART_KEYS = ("restart", "train_objective_bits", "learned_objective", "relative_gap", "h_x_given_z",
                 "prefix_free", "learned_length", "within_5_percent", "deterministic", "goal", "seconds", "cpu_seconds")
_SUMMARY_KEYS = ("learned_objective", "huffman_objective", "relative_gap", "h_x_given_z", "prefix_free",
                 "learned_length", "huffman_length", "learned_code_objective", "within_5_percent", "deterministic",
                 "goal", "train_objective_bits")


def select_restart(runs: list[dict]) -> dict:
    """The run of least training objective (``train_objective_bits``; ties: the first), never the evaluated metric."""
    return min(runs, key=lambda r: (r["train_objective_bits"], r["restart"]))


def summarize_variant(runs: list[dict]) -> dict:
    """One variant at one N over its restarts: the selected run's numbers and the shares over the restarts."""
    best = select_restart(runs)
    R = len(runs)
    out = {k: best[k] for k in _SUMMARY_KEYS}
    out.update({
        "decoder": best["decoder"],
        "entropy_annealing": best["entropy_annealing"],
        "selected_restart": best["restart"],
        "selected_by": "least training objective (mean over the last 10% of steps)",
        "restarts_within_5pct": sum(r["within_5_percent"] for r in runs) / R,
        "restarts_deterministic": sum(r["deterministic"] for r in runs) / R,
        "restarts_goal": sum(r["goal"] for r in runs) / R,
        "restarts_prefix_free": sum(r["prefix_free"] for r in runs) / R,
        "restarts": [{k: r[k] for k in _RESTART_KEYS} for r in runs],
        "seconds": round(sum(r["seconds"] for r in runs), 1),
        "cpu_seconds": round(sum(r["cpu_seconds"] for r in runs), 1),
    })
    return out


def _train_job(N: int, cfg: CodingConfig, seed: int, variant: str, restart: int) -> dict:
    torch.set_num_threads(1)
    return train_one(N, cfg, seed, False, variant, restart)


def run_active_coding(cfg: CodingConfig, seed: int = 0, progress: bool = True) -> dict:
    """Train and evaluate every variant, restart and N of ``cfg``.

    ``{"coding": {"<N>": {...}}, "criteria": ..., "config": ..., ...}``: ``coding[N]`` is the selected restart
    of the first variant (the plain run, ``"learned"``, by default) with every field of the evaluation, its
    ``restarts_within_5pct`` and ``remedies``: every variant's :func:`summarize_variant`.
    """
    source = provenance()
    t0, c0 = time.time(), time.process_time()
    coding = {}
    jobs = [(N, v, r) for N in cfg.sizes for v in cfg.variants for r in range(cfg.restarts)]
    if cfg.workers > 1:  # separate processes (spawned: no forked torch state), one torch thread each
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(cfg.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_train_job, N, cfg, seed, v, r) for N, v, r in jobs]
            done = {job: f.result() for job, f in zip(jobs, futures)}
        cpu_total = sum(d["cpu_seconds"] for d in done.values())
    else:
        done = {(N, v, r): train_one(N, cfg, seed, progress, v, r) for N, v, r in jobs}
        cpu_total = None
    for N in cfg.sizes:
        runs = {v: [done[(N, v, r)] for r in range(cfg.restarts)] for v in cfg.variants}
        remedies = {v: summarize_variant(rs) for v, rs in runs.items()}
        main_v = cfg.variants[0]
        entry = dict(select_restart(runs[main_v]))
        entry["restarts_within_5pct"] = remedies[main_v]["restarts_within_5pct"]
        entry["remedies"] = remedies
        coding[str(N)] = entry
    criteria = {N: {"within_5_percent": r["within_5_percent"], "h_x_given_z_below_0.01_nats": r["deterministic"],
                    "restarts_within_5pct": r["restarts_within_5pct"],
                    "goal_reached_by": [v for v, s in r["remedies"].items() if s["goal"]]}
                for N, r in coding.items()}
    return {
        "coding": coding,
        "config": asdict(cfg),
        "seed": seed,
        "criteria": criteria,
        "total_seconds": round(time.time() - t0, 1),
        "total_cpu_seconds": round(time.process_time() - c0 if cpu_total is None else cpu_total, 1),
        **source,
    }


def plot_coding(res: dict, path: str) -> None:
    """Figure 6.1 (right) from our runs: (6.10)/(6.12) against expected code length, Huffman and the kept restart
    of every variant (remedy), per N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = sorted(res["coding"].items(), key=lambda kv: int(kv[0]))
    markers = {"learned": "x", "learned+anneal": "+", "exact": "^", "exact+anneal": "s"}
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    cmap = plt.get_cmap("viridis")
    pts = []
    for k, (N, r) in enumerate(items):
        c = cmap(k / max(1, len(items) - 1))
        ax.scatter(r["huffman_length"], r["huffman_objective"], marker="o", color=c, s=50,
                   label="Huffman" if k == 0 else None)
        pts.append(r["huffman_length"])
        for v, s in r.get("remedies", {"learned": r}).items():
            ax.scatter(s["learned_length"], s["learned_objective"], marker=markers.get(v, "x"), color=c, s=45,
                       facecolors="none" if markers.get(v) in ("^", "s") else None,
                       label=f"learned Q: {v}" if k == 0 else None)
            pts.append(s["learned_length"])
        ax.annotate(f"N={N}", (r["huffman_length"], r["huffman_objective"]), textcoords="offset points",
                    xytext=(6, -10), fontsize=8)
    lo, hi = min(pts) - 0.3, max(pts) + 0.3
    ax.plot([lo, hi], [lo, hi], ls=":", color="grey", lw=1, label="y = x")
    ax.set_xlabel("expected code length E|c(X)| (bits)")
    ax.set_ylabel("(6.12): sum_t E[-log2 P*(X | z_<=t)] (bits)")
    ax.set_title("Minimum-length coding (Fig. 6.1 right)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run alone: ``python -m ppl_thought.experiments.active_coding [--quick] [--seed S] [--workers W] [--json FILE]``
    (one torch thread per process: the models are tiny, and more threads only contend on a shared machine)."""
    import argparse
    import json

    from ppl_thought.io import atomic_write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the committed run: N = 8 and 16, every variant, 3 restarts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None, help="processes for the runs (default: the config's)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default: the config's)")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="the remedies to run (default: all)")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file")
    ap.add_argument("--plot", default=None, help="draw Figure 6.1 (right) from the results to this PNG")
    ap.add_argument("--from-json", default=None, help="read the results from this JSON instead of running")
    args, run_record = ap.parse_args(argv), start_record(__file__, argv)  # the record before the run
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
        if args.plot:
            plot_coding(res, args.plot)
        return 0
    torch.set_num_threads(1)
    cfg = CodingConfig.quick() if args.quick else CodingConfig()
    if args.workers is not None:
        cfg.workers = args.workers
    if args.steps is not None:
        cfg.steps = args.steps
    cfg.variants = tuple(args.variants or cfg.variants)
    cfg.__post_init__()
    res = run_active_coding(cfg, args.seed, progress=True)
    res["command"] = run_record["command"]  # the command as retyped from the repository root
    if args.json:
        atomic_write_json(args.json, stamped(res, run_record))  # commit, command, machine, load, seconds
    if args.plot:
        plot_coding(res, args.plot)
    for N, r in res["coding"].items():
        for v, s in r["remedies"].items():
            print(f"N = {N:>2} {v:>14}: (6.10) {s['learned_objective']:.3f} bits vs Huffman "
                  f"{s['huffman_objective']:.3f} "
                  f"({100 * s['relative_gap']:+.1f}%), H(X|Z) {s['h_x_given_z']:.4f} nats, prefix-free "
                  f"{s['prefix_free']}, restarts within 5%: {s['restarts_within_5pct']:.2f}")
    print(json.dumps(res["criteria"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
