"""The A5 separation (Theorems 2.1/2.3, App. E.1), at small scale.

    python -m ppl_thought.experiments.a5 [--quick] [--seed S] [--json FILE]

Part 2, Theorems 2.1/2.3 on the A5 "cups and ball" HMM (App. E.1): a plain Transformer and a
latent model Proj # P_f (Product projection, Ex 2.2, with a hidden alphabet; P_f a Transformer of
the same width and depth over the pair tokens) trained on the same sequences. The latent model is
trained EM-like: particles from sequential Monte Carlo over the lifting (the library's
:class:`~ppl_thought.inference.smc.SMC`, one group per sequence, over :class:`A5Program`: the causal
sampler of (3.33), P_f decoded under the lifting, resampling when the ESS drops) and the
self-normalised gradient of (3.17). Its test loss is the SMC estimate of -log (Proj # P_f)(x)
(an unbiased estimate of the likelihood, Lemma 2.1). Excess losses are measured against the exact
cross-entropy by the forward algorithm (3.1), on held-out sequences longer than the training ones.
"""


from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from tqdm.auto import tqdm

from ppl_thought.data.a5 import OBSERVABLE_TOKENS, a5_hmm
from ppl_thought.distributions.lm_state import masked_log_softmax
from ppl_thought.experiments.common import run_alone, score, set_lr, standard_error
from ppl_thought.inference.smc import SMC
from ppl_thought.lm import Transformer
from ppl_thought.program import Program, particle_groups, particles
from ppl_thought.projections import Product
from ppl_thought.training.trainer import clip_joint_, cosine_lr


@dataclass
class A5Config:
    """Sizes of the A5 experiment (both models share them)."""

    train_len: int = 32
    test_len: int = 128
    steps: int = 800
    batch: int = 16
    particles: int = 16  # SMC particles for training and test
    hidden: int = 5  # |Gamma|
    lr: float = 3e-3  # peak; cosine schedule of App. L (5% warm-up, decay to 10%) for both models
    clip: float = 1.0
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    num_test: int = 64
    eval_every: int = 100

    @classmethod
    def quick(cls) -> A5Config:
        """The sizes of ``ppl-thought demo --quick``."""
        return cls(train_len=24, test_len=96, steps=250, particles=16, num_test=32, eval_every=50)



# ====================================================================== A5
class A5Program(Program):
    """Proj # P_f on the A5 HMM as a step-wise program over S observation sequences ``x [S, T]`` at once
    (``SMC(n, groups=S)``: row r explains sequence r // n, :func:`~ppl_thought.program.particle_groups`).

    Step t is segment t of the lifting of the Product projection (Lemma 2.1, one pair token
    (x_t, g)): the hidden symbol g is sampled (site ``f"z_{t}"``) from P_f restricted to the candidates
    (x_t, g) and renormalised (the causal sampler (3.33)), and ``pyro.factor(f"x_{t}", ...)`` adds
    log sum_g P_f((x_t, g) | z_<t) under the domain-masked P_f (Def 2.8). Run with ``guide=None``
    (bootstrap) the incremental weight is exactly that factor: the fully-adapted SMC for (2.22).
    State: the next-token logits ``[rows, V]`` and the KV cache (reordered by the engine).
    """

    def __init__(self, latent: A5Latent):
        self.lm, self.pairs, self.domain, self.bos_id = latent.lm, latent.pairs, latent.domain, latent.vocab.bos_id

    def init(self, state: dict, x: torch.Tensor) -> None:
        """Encode ``<bos>`` for every row."""
        bos = torch.full((particles(), 1), self.bos_id, dtype=torch.long, device=self.pairs.device)
        logits, state["cache"] = self.lm(bos)
        state["logits"] = logits[:, -1]

    def step(self, state: dict, t: int, x: torch.Tensor) -> torch.Tensor | None:
        """Sample the hidden symbol of x_t, weigh by P_f(x_t | z_<t), feed the pair token."""
        n = particles() // particle_groups()
        lp = masked_log_softmax(state["logits"], self.domain)  # [rows, V]
        cand = self.pairs[x[:, t]].repeat_interleave(n, 0)  # [rows, |Gamma|]: the lifting of x_t
        lpc = lp.gather(1, cand)
        g = pyro.sample(f"z_{t}", dist.Categorical(logits=lpc))
        pyro.factor(f"x_{t}", torch.logsumexp(lpc, 1))  # log P_f(x_t | z_<t)
        if t == x.shape[1] - 1:
            return torch.ones(cand.shape[0], dtype=torch.bool, device=cand.device)
        logits, state["cache"] = self.lm(cand.gather(1, g[:, None]), state["cache"])
        state["logits"] = logits[:, -1]
        return None


class A5Latent:
    """Proj # P_f on the A5 HMM: Product projection (Ex 2.2) with hidden alphabet Gamma, P_f a Transformer."""

    def __init__(self, cfg: A5Config, seed: int):
        self.cfg = cfg
        self.projection = Product.build(list(OBSERVABLE_TOKENS), [f"h{i}" for i in range(cfg.hidden)])
        v = self.projection.vocab
        self.vocab = v
        self.pairs = torch.tensor([[self.projection.pair_id(a, g) for g in range(cfg.hidden)]
                                   for a in OBSERVABLE_TOKENS])  # [7, G]
        self.domain = torch.zeros(len(v), dtype=torch.bool)  # Dom(Proj): pair tokens
        self.domain[self.pairs.reshape(-1)] = True
        torch.manual_seed(seed)
        self.lm = Transformer(len(v), d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                              max_len=max(cfg.test_len, cfg.train_len) + 2)

    def smc(self, x: torch.Tensor, n: int, ess_threshold: float = 0.5,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SMC over the lifting of each row of ``x`` [S, T] (Lemma 2.1): the library's
        :class:`~ppl_thought.inference.smc.SMC` with ``groups=S`` (one independent run of ``n`` particles
        per sequence, batched) over :class:`A5Program`, bootstrap, multinomial resampling when a
        sequence's ESS falls under ``ess_threshold * n``. The proposal is P_f decoded under the lifting
        (3.33) and the incremental weight sum_g P_f((x_t, g) | z_<t) (fully adapted). ``generator``
        drives the resampling; the proposals use torch's global generator. Returns (paths [S, n, T]
        of pair tokens, final log-weights [S, n], log Z_hat [S]) -- log Z_hat estimates
        log (Proj # P_f)(x) (2.22); the log-weights carry the running estimate, so
        log_mean_exp(logw[s]) = log Z_hat[s]."""
        S, T = x.shape
        x = x.to(self.pairs.device)
        res = SMC(n, ess_threshold=ess_threshold, resampling="multinomial", generator=generator,
                  groups=S).run(A5Program(self), None, x)
        g = torch.stack([res.samples[f"z_{t}"] for t in range(T)], 1)  # [S * n, T] hidden symbols
        cand = self.pairs[x].repeat_interleave(n, 0)  # [S * n, T, |Gamma|]
        paths = cand.gather(-1, g[..., None]).view(S, n, T)
        return paths, res.log_weights.view(S, n), res.log_marginal.view(S)

    def train_step(self, x: torch.Tensor, opt, params, generator=None) -> float:
        """One EM-like step: SMC particles, then the self-normalised gradient of (3.17):
        -sum_i w_i grad log P_f(Z_i), normalised per token."""
        S, T = x.shape
        n = self.cfg.particles
        paths, logw, logz = self.smc(x, n, generator=generator)
        w = torch.softmax(logw, 1)
        z = torch.cat([torch.full((S * n, 1), self.vocab.bos_id, dtype=torch.long), paths.view(S * n, T)], 1)
        lp = score(self.lm, z, 1, self.domain).sum(-1).view(S, n)
        opt.zero_grad()
        loss = -(w * lp).sum(1).mean() / T
        loss.backward()
        clip_joint_(params, self.cfg.clip)
        opt.step()
        return float(-logz.mean() / T)

    def nll_per_token(self, x: torch.Tensor, generator=None) -> np.ndarray:
        """-log Z_hat / T per sequence (SMC estimate of -log (Proj # P_f)(x) per token)."""
        out = []
        for s in range(0, x.shape[0], 16):
            _, _, logz = self.smc(x[s:s + 16], self.cfg.particles, generator=generator)
            out.append(-logz / x.shape[1])
        return torch.cat(out).double().numpy()


def _plain_nll(lm, vocab_bos: int, x_ids: torch.Tensor) -> np.ndarray:
    z = torch.cat([torch.full((x_ids.shape[0], 1), vocab_bos, dtype=torch.long), x_ids], 1)
    allowed = torch.ones(lm.vocab_size, dtype=torch.bool)
    with torch.no_grad():
        return (-score(lm, z, 1, allowed).sum(-1) / x_ids.shape[1]).double().numpy()


def run_a5(cfg: A5Config, seed: int = 0, progress: bool = True) -> dict:
    """Part 2: plain Transformer vs Proj # P_f on the A5 HMM; excess loss over the exact entropy (3.1)."""
    task = a5_hmm(0.5)
    g = torch.Generator().manual_seed(seed + 1)
    x_test = task.sample(cfg.num_test, cfg.test_len, generator=g)
    x_test_short = task.sample(cfg.num_test, cfg.train_len, generator=g)
    exact = task.hmm.log_prob(x_test).double().numpy() / -cfg.test_len
    exact_short = task.hmm.log_prob(x_test_short).double().numpy() / -cfg.train_len
    torch.manual_seed(seed)
    plain = Transformer(len(task.vocab), d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                        max_len=cfg.test_len + 2)
    latent = A5Latent(cfg, seed)
    opt_p = torch.optim.Adam(plain.parameters(), lr=cfg.lr)
    params_l = list(latent.lm.parameters())
    opt_l = torch.optim.Adam(params_l, lr=cfg.lr)
    bos = task.vocab.bos_id
    allowed = torch.ones(len(task.vocab), dtype=torch.bool)
    curve = []
    t0 = time.time()
    secs = {"plain": 0.0, "latent": 0.0}
    with tqdm(total=cfg.steps, desc="A5: plain Transformer / Proj # P_f", disable=not progress) as bar:
        for step in range(1, cfg.steps + 1):
            x = task.sample(cfg.batch, cfg.train_len, generator=g)  # the same batch for both models
            for opt in (opt_p, opt_l):  # the same schedule for both (App. L)
                set_lr(opt, cosine_lr(cfg.lr, step - 1, cfg.steps))
            t = time.time()
            ids = task.to_vocab_ids(x)
            z = torch.cat([torch.full((cfg.batch, 1), bos, dtype=torch.long), ids], 1)
            opt_p.zero_grad()
            lp = -score(plain, z, 1, allowed).sum(-1).mean() / cfg.train_len
            lp.backward()
            clip_joint_(list(plain.parameters()), cfg.clip)
            opt_p.step()
            t1 = time.time()
            ll = latent.train_step(x, opt_l, params_l, generator=g)
            secs["plain"] += t1 - t
            secs["latent"] += time.time() - t1
            bar.update(1)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                pe = float(_plain_nll(plain, bos, task.to_vocab_ids(x_test_short)).mean() - exact_short.mean())
                le = float(latent.nll_per_token(x_test_short[:16], generator=g).mean() - exact_short[:16].mean())
                curve.append({"step": step, "plain_train_loss": float(lp.detach()), "latent_train_loss": ll,
                              "plain_excess_short": pe, "latent_excess_short": le})
                bar.set_postfix({"plain": f"{pe:.3f}", "latent": f"{le:.3f}"})
    plain_nll = _plain_nll(plain, bos, task.to_vocab_ids(x_test))
    latent_nll = latent.nll_per_token(x_test, generator=g)
    pex, lex = plain_nll - exact, latent_nll - exact
    short_p = _plain_nll(plain, bos, task.to_vocab_ids(x_test_short)) - exact_short
    short_l = latent.nll_per_token(x_test_short, generator=g) - exact_short
    res = {
        "config": asdict(cfg),
        "exact_cross_entropy_nats": float(exact.mean()), "entropy_rate_nats": task.entropy_rate,
        "plain_excess_nats": float(pex.mean()), "plain_excess_se": standard_error(pex),
        "latent_excess_nats": float(lex.mean()), "latent_excess_se": standard_error(lex),
        "plain_excess_train_len": float(short_p.mean()), "latent_excess_train_len": float(short_l.mean()),
        "ratio_plain_over_latent": float(pex.mean() / lex.mean()) if lex.mean() > 0 else float("inf"),
        "num_params": {"plain": sum(p.numel() for p in plain.parameters()), "latent": sum(p.numel() for p in params_l)},
        "curve": curve,
        "seconds": {k: round(v, 1) for k, v in secs.items()},
        "total_seconds": round(time.time() - t0, 1),
    }
    res["criterion_latent_3x_below_plain"] = bool(lex.mean() * 3 <= pex.mean())
    res["_arrays"] = {"plain_excess": pex, "latent_excess": lex}
    return res


def main(argv: list[str] | None = None) -> int:
    """Run this experiment alone: ``python -m ppl_thought.experiments.a5 [--quick] [--seed S] [--json FILE]``."""
    return run_alone(__doc__, run_a5, A5Config, argv)


if __name__ == "__main__":
    raise SystemExit(main())
