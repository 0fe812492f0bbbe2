"""Latent Thought Model vs an equal-window autoregressive Transformer on a mixture of Markov chains.

Data with an exact perplexity: each sequence picks one of C Markov chains (uniformly) over a small
vocabulary and runs it for N steps, so log p(x) = logsumexp_c [log(1/C) + log p(x | chain c)] exactly.
The decoders see only a window of k tokens (k small relative to N), so the plain autoregressive model
cannot tell which chain it is in beyond what its receptive field shows; the LTM's latent thoughts z
(Sec 2.1, latent-thought-models.txt) can carry the chain identity over the whole sequence.

Both models get the same data, the same mini-batches, the same number of decoder updates and the same
slow learning-rate schedule. The LTM is trained by dual-rate learning (Algorithm 1, Eq. 5) and evaluated
by its ELBO-perplexity after T fast steps for T in {0, 1, 2, 4, 8, 16}, by the importance-weighted
bound (K samples), and with Langevin posterior sampling (Eq. 4) on a subset of sequences.

    python -m ppl_thought.experiments.latent_thought [--quick] [--json FILE] [--out DIR]
    python examples/latent_thought_model.py [--quick] [--json FILE] [--out DIR]   (the same)

``--sweep`` runs the *training-time* study instead (:func:`run_sweep`, docs/latent-thought.md, "Training-time
sweep, learners and generation"): separate trainings with T_fast in {0, 2, 4, 8, 16} and with two values of
N_z at equal budget (the same batches, the same number of decoder updates), the three learners of the paper's
ablation (dual-rate VB, Langevin MLE, an amortised VAE encoder) at equal budget, and generation (Eq. 6-8)
scored by the exact data law:

    python -m ppl_thought.experiments.latent_thought --sweep [--quick] --json FILE
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ppl_thought import provenance as pv
from ppl_thought.data.markov_mixture import MarkovMixture
from ppl_thought.experiments.common import provenance
from ppl_thought.guides import AmortizedGaussianEncoder
from ppl_thought.io import atomic_write_json
from ppl_thought.lm.transformer import Transformer
from ppl_thought.models import LatentThought
from ppl_thought.training import DualRateTrainer, LangevinTrainer, VAETrainer, langevin_evaluate, slow_lr_schedule

__all__ = ["LTMConfig", "SweepConfig", "ar_log_likelihood", "main", "plot", "run_latent_thought", "run_sweep",
           "score_continuations", "score_samples", "sweep_tables"]


@dataclass
class LTMConfig:
    """Sizes of the run: the field defaults are the quick sizes (:meth:`quick`), :meth:`full` the full run."""

    vocab_size: int = 12
    num_chains: int = 4
    seq_len: int = 32
    concentration: float = 0.3  # Dirichlet concentration of the transition rows (small: distinct chains)
    window: int = 2
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    n_z: int = 4
    d_latent: int = 16
    train_size: int = 4096
    eval_size: int = 128
    batch_size: int = 32
    steps: int = 400
    inner_steps: int = 8
    slow_lr: float = 3e-3
    slow_lr_min: float = 3e-4
    warmup: int = 20
    eval_T: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8, 16])
    iw_samples: int = 256
    langevin_sequences: int = 8
    langevin_steps: int = 150
    langevin_warmup: int = 150
    langevin_chains: int = 2
    seed: int = 0

    @classmethod
    def quick(cls) -> LTMConfig:
        """A few minutes on 2 CPU cores."""
        return cls()

    @classmethod
    def full(cls) -> LTMConfig:
        """The full run (``python -m ppl_thought.experiments.latent_thought``)."""
        return cls(steps=1500, inner_steps=16, train_size=16384, eval_size=512, iw_samples=1024,
                   langevin_sequences=32, langevin_steps=400, langevin_warmup=300, langevin_chains=4)

    @classmethod
    def tiny(cls) -> LTMConfig:
        """Seconds: the test's sizes."""
        return cls(vocab_size=5, num_chains=2, seq_len=8, d_model=16, n_heads=2, n_z=2, d_latent=4, train_size=64,
                   eval_size=8, batch_size=8, steps=3, inner_steps=2, warmup=0, eval_T=[0, 2], iw_samples=8,
                   langevin_sequences=1, langevin_steps=5, langevin_warmup=5, langevin_chains=1)


def ar_log_likelihood(model: Transformer, x: torch.Tensor, bos: int) -> torch.Tensor:
    """log p(x) per row of a plain autoregressive Transformer fed ``<bos>`` (id ``bos``) then x, (2.13)."""
    inputs = torch.cat([torch.full_like(x[:, :1], bos), x[:, :-1]], 1)
    logits, _ = model(inputs)
    logp = torch.log_softmax(logits[..., :bos], -1)
    return logp.gather(-1, x[..., None])[..., 0].sum(-1)


def run_latent_thought(cfg: LTMConfig, out_dir: str | None = None, progress: bool = True) -> dict:
    """Train both models on the same data and measure everything; returns the JSON-able results."""
    t0 = time.time()
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    data = MarkovMixture(cfg.vocab_size, cfg.num_chains, cfg.concentration, gen)
    train = data.sample(cfg.train_size, cfg.seq_len, gen)
    test = data.sample(cfg.eval_size, cfg.seq_len, gen)
    n_tokens = test.numel()
    exact_ppl = math.exp(-float(data.log_prob(test).sum()) / n_tokens)
    order = [torch.randint(0, cfg.train_size, (cfg.batch_size,), generator=gen) for _ in range(cfg.steps)]

    ltm = LatentThought(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_z, window=cfg.window,
                        d_latent=cfg.d_latent, max_len=cfg.seq_len)
    ar = Transformer(cfg.vocab_size + 1, cfg.d_model, cfg.n_layers, cfg.n_heads, max_len=cfg.seq_len,
                     window=cfg.window)

    # LTM: dual-rate learning (Algorithm 1).
    t = time.time()
    # the committed runs' inner schedule (constant; the trainer's default is the paper's cosine)
    trainer = DualRateTrainer(ltm, cfg.steps, cfg.inner_steps, slow_lr=cfg.slow_lr, slow_lr_min=cfg.slow_lr_min,
                              warmup_steps=cfg.warmup, inner_schedule="constant", progress=progress)
    trainer.fit(train[i] for i in order)
    ltm_train_s = time.time() - t

    # AR baseline: same batches, same number of decoder updates, same optimiser and schedule.
    t = time.time()
    opt = torch.optim.AdamW(ar.parameters(), lr=cfg.slow_lr, betas=(0.9, 0.95), weight_decay=0.0)
    for step, idx in enumerate(order):
        for g in opt.param_groups:
            g["lr"] = slow_lr_schedule(step, cfg.steps, cfg.slow_lr, cfg.slow_lr_min, cfg.warmup)
        x = train[idx]
        loss = -ar_log_likelihood(ar, x, cfg.vocab_size).sum() / x.numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ar.parameters(), 1.0)
        opt.step()
    ar_train_s = time.time() - t
    with torch.no_grad():
        ar_ppl = math.exp(-float(ar_log_likelihood(ar, test, cfg.vocab_size).sum()) / n_tokens)

    # LTM evaluation: ELBO-perplexity by T, then the IW bound after the largest T.
    t = time.time()
    fast_lr = trainer.current_fast_lr()
    elbo_by_T = {}
    for T in cfg.eval_T:
        torch.manual_seed(cfg.seed + 1000 + T)
        elbo_by_T[str(T)] = ltm.evaluate(test, num_steps=T, lr=fast_lr, elbo_samples=16)["elbo_ppl"]
    T_max = max(cfg.eval_T)
    torch.manual_seed(cfg.seed + 2000)
    final = ltm.evaluate(test, num_steps=T_max, lr=fast_lr, elbo_samples=16, iw_samples=cfg.iw_samples)
    eval_s = time.time() - t

    # Langevin (Eq. 4) vs variational Bayes on the same subset of test sequences.
    t = time.time()
    sub = test[:cfg.langevin_sequences]
    lang = langevin_evaluate(ltm, sub, iw_samples=cfg.iw_samples, num_steps=cfg.langevin_steps,
                                 warmup_steps=cfg.langevin_warmup, num_chains=cfg.langevin_chains, seed=cfg.seed)
    torch.manual_seed(cfg.seed + 3000)
    vb_sub = ltm.evaluate(sub, num_steps=T_max, lr=fast_lr, elbo_samples=16, iw_samples=cfg.iw_samples)
    exact_sub = math.exp(-float(data.log_prob(sub).sum()) / sub.numel())
    langevin_s = time.time() - t

    results = {
        "exact_ppl": exact_ppl,
        "ar_window_ppl": ar_ppl,
        "ltm_ppl": final["iw_ppl"],
        "ltm_elbo_ppl": final["elbo_ppl"],
        "elbo_ppl_by_T": elbo_by_T,
        "langevin_ppl": lang["ppl"],
        "langevin_mean_accept_prob": lang["mean_accept_prob"],
        "vb_iw_ppl_langevin_subset": vb_sub["iw_ppl"],
        "vb_elbo_ppl_langevin_subset": vb_sub["elbo_ppl"],
        "exact_ppl_langevin_subset": exact_sub,
        "ltm_parameters": ltm.decoder.num_parameters(),
        "ar_parameters": ar.num_parameters(),
        "receptive_field": ar.receptive_field,
        "train_final": trainer.history[-1] if trainer.history else {},
        "timings_s": {"ltm_train": ltm_train_s, "ar_train": ar_train_s, "ltm_eval": eval_s,
                      "langevin": langevin_s, "total": time.time() - t0},
        "config": asdict(cfg),
    }
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        results["plot"] = plot(results, os.path.join(out_dir, "ltm_ppl_vs_T.png"))
    return results


# -- the training-time sweep, the learners and generation (issue 30 item 3) ------------------------------------

@dataclass
class SweepConfig:
    """Sizes of :func:`run_sweep`: the field defaults are the quick sizes (<= 15 CPU minutes on one thread)."""

    vocab_size: int = 12
    num_chains: int = 4
    seq_len: int = 32
    concentration: float = 0.3
    window: int = 2
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    d_latent: int = 16
    n_z: int = 4  # N_z of the T_fast sweep and of the learners
    train_size: int = 4096
    eval_size: int = 128
    batch_size: int = 32
    steps: int = 300  # decoder updates of every training run (equal budget)
    slow_lr: float = 3e-3
    slow_lr_min: float = 3e-4
    warmup: int = 20
    T_fast: list[int] = field(default_factory=lambda: [0, 2, 4, 8, 16])
    n_z_values: list[int] = field(default_factory=lambda: [1, 4])
    learner_T: int = 8  # inner steps of the VB and Langevin learners and of the N_z runs
    langevin_step_size: float = 0.03
    encoder_hidden: int = 64
    eval_T: int = 16  # the common evaluation: T_eval fast steps, then the IW bound
    iw_samples: int = 64
    prefix_len: int = 16
    seed: int = 0

    @classmethod
    def quick(cls) -> SweepConfig:
        return cls()

    @classmethod
    def full(cls) -> SweepConfig:
        return cls(steps=1500, train_size=16384, eval_size=512, iw_samples=256)

    @classmethod
    def tiny(cls) -> SweepConfig:
        """Seconds: the test's sizes."""
        return cls(vocab_size=5, num_chains=2, seq_len=8, d_model=16, n_heads=2, d_latent=4, n_z=2, train_size=64,
                   eval_size=8, batch_size=8, steps=2, warmup=0, T_fast=[0, 2], n_z_values=[1, 2], learner_T=2,
                   eval_T=2, iw_samples=4, prefix_len=4)


def score_samples(data: MarkovMixture, x: torch.Tensor) -> dict[str, float]:
    """Unconditional samples (Eq. 8) scored by the exact data law: the mean exact log p(x) per token, its
    perplexity exp(-that) (the generative perplexity with the true law as the judge), and the mean empirical
    token entropy of a sequence (nats; a collapsed sampler repeating a few tokens scores low)."""
    logp = data.log_prob(x)
    counts = torch.nn.functional.one_hot(x, data.V).sum(1).double()
    freq = counts / counts.sum(-1, keepdim=True)
    entropy = -(torch.where(freq > 0, freq * freq.log(), torch.zeros_like(freq))).sum(-1)
    per_token = float(logp.sum()) / x.numel()
    return {"data_logp_per_token": per_token, "data_ppl": math.exp(-per_token),
            "token_entropy": float(entropy.mean()), "num_sequences": int(x.shape[0])}


def score_continuations(data: MarkovMixture, prefix: torch.Tensor, continuation: torch.Tensor) -> dict[str, float]:
    """Continuations y of prefixes x (Eq. 6-7) scored by the exact data law.

    * ``data_logp_per_token``: sum over rows of log p(y | x) (exact, :meth:`MarkovMixture.conditional_log_prob`)
      over the number of continuation tokens;
    * ``same_chain``: the share of rows whose continuation alone, scored from the prefix's last token, has
      its most probable chain, argmax_c p(y | c, x_last), equal to the prefix's, argmax_c p(c | x);
    * ``prefix_chain_posterior``: the mean posterior probability of the prefix's most probable chain given
      the continuation alone (uniform prior over chains): 1 when y says plainly it stayed in x's chain.
    """
    cond = data.conditional_log_prob(prefix, continuation)
    prefix_chain = data.chain_log_posterior(prefix).argmax(-1)
    cont_post = torch.log_softmax(data.chain_log_likelihood(continuation, prefix[:, -1]), 0).T  # [B, C]
    same = (cont_post.argmax(-1) == prefix_chain).double()
    on_prefix = cont_post.gather(-1, prefix_chain[:, None])[:, 0].exp()
    per_token = float(cond.sum()) / continuation.numel()
    return {"data_logp_per_token": per_token, "data_ppl": math.exp(-per_token), "same_chain": float(same.mean()),
            "prefix_chain_posterior": float(on_prefix.mean()), "num_sequences": int(prefix.shape[0])}


def _ppl(total_logp: float, n_tokens: int) -> float:
    return math.exp(-total_logp / n_tokens)


def train_ar_baseline(cfg: Any, train: torch.Tensor, test: torch.Tensor, order: Any, seed: int) -> float:
    """The windowed autoregressive Transformer, the no-latent reference: the LTM's window, batches (``order``),
    slow-rate schedule and clipping; returns its test negative log-likelihood in nats per token."""
    torch.manual_seed(seed)
    ar = Transformer(cfg.vocab_size + 1, cfg.d_model, cfg.n_layers, cfg.n_heads, max_len=cfg.seq_len, window=cfg.window)
    opt = torch.optim.AdamW(ar.parameters(), lr=cfg.slow_lr, betas=(0.9, 0.95), weight_decay=0.0)
    for step, idx in enumerate(order):
        for g in opt.param_groups:
            g["lr"] = slow_lr_schedule(step, cfg.steps, cfg.slow_lr, cfg.slow_lr_min, cfg.warmup)
        loss = -ar_log_likelihood(ar, train[idx], cfg.vocab_size).sum() / train[idx].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ar.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        return -float(ar_log_likelihood(ar, test, cfg.vocab_size).sum()) / test.numel()


def run_sweep(cfg: SweepConfig, progress: bool = True) -> dict:
    """The training-time study: every run is a separate training from the same initialisation on the same
    batches with the same number of decoder updates (``cfg.steps``); returns the JSON-able results.

    Each VB run is evaluated by its *own* ELBO-perplexity (``ppl``: T_fast fast steps at test time, as trained)
    and by the common evaluation (``elbo_ppl_Teval``: ``eval_T`` fast steps; ``iw_ppl``: the IW bound with
    ``iw_samples`` draws from that q), next to the data's exact perplexity ``exact_ppl``.
    """
    t0, cpu0 = time.time(), time.process_time()
    gen = torch.Generator().manual_seed(cfg.seed)
    data = MarkovMixture(cfg.vocab_size, cfg.num_chains, cfg.concentration, gen)
    train = data.sample(cfg.train_size, cfg.seq_len, gen)
    test = data.sample(cfg.eval_size, cfg.seq_len, gen)
    n_tokens = test.numel()
    exact_ppl = _ppl(float(data.log_prob(test).sum()), n_tokens)
    order = [torch.randint(0, cfg.train_size, (cfg.batch_size,), generator=gen) for _ in range(cfg.steps)]
    runs: dict[tuple, dict] = {}

    def new_ltm(n_z: int) -> LatentThought:
        torch.manual_seed(cfg.seed)  # the same initial decoder for every run of one N_z
        return LatentThought(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, n_z, window=cfg.window,
                             d_latent=cfg.d_latent, max_len=cfg.seq_len)

    def train_run(learner: str, T: int, n_z: int) -> dict:
        key = (learner, T, n_z)
        if key in runs:
            return runs[key]
        ltm = new_ltm(n_z)
        common = dict(slow_lr=cfg.slow_lr, slow_lr_min=cfg.slow_lr_min, warmup_steps=cfg.warmup, progress=progress)
        encoder = None
        if learner == "vb":
            # the committed constant-rate sweep (ltm_sweep_quick*.json; benchmarks/ltm_tsweep.py runs both schedules)
            trainer = DualRateTrainer(ltm, cfg.steps, T, inner_schedule="constant", **common)
        elif learner == "langevin":
            trainer = LangevinTrainer(ltm, cfg.steps, T, step_size=cfg.langevin_step_size, **common)
        else:
            encoder = AmortizedGaussianEncoder(cfg.vocab_size, ltm.latent_shape, cfg.encoder_hidden)
            trainer = VAETrainer(ltm, encoder, cfg.steps, **common)
        torch.manual_seed(cfg.seed + 1)
        t, cpu = time.time(), time.process_time()
        trainer.fit(train[i] for i in order)
        train_s, train_cpu = time.time() - t, time.process_time() - cpu
        t, cpu = time.time(), time.process_time()
        fast_lr = trainer.current_fast_lr()
        res: dict = {"learner": learner, "T_fast": T, "n_z": n_z, "decoder_updates": trainer.step_count}
        torch.manual_seed(cfg.seed + 2)
        own = ltm.evaluate(test, num_steps=T, lr=fast_lr, elbo_samples=16)
        torch.manual_seed(cfg.seed + 3)
        common_eval = ltm.evaluate(test, num_steps=cfg.eval_T, lr=fast_lr, elbo_samples=16, iw_samples=cfg.iw_samples)
        res.update(ppl=own["elbo_ppl"], elbo_ppl_Teval=common_eval["elbo_ppl"], iw_ppl=common_eval["iw_ppl"],
                   exact_ppl=exact_ppl)
        if encoder is not None:
            with torch.no_grad():
                torch.manual_seed(cfg.seed + 4)
                q = encoder(test)
                amortised = float(ltm.elbo(test, q, num_samples=16).sum())
                res.update(amortised_elbo_ppl=_ppl(amortised, n_tokens),
                           amortised_kl_per_token=float(q.kl_to_prior().sum()) / n_tokens)
        res["train_final"] = trainer.history[-1] if trainer.history else {}
        res["seconds"] = {"train": train_s, "eval": time.time() - t}
        res["cpu_seconds"] = {"train": train_cpu, "eval": time.process_time() - cpu}
        runs[key] = {"result": res, "ltm": ltm, "fast_lr": fast_lr}
        return runs[key]

    sweep_T = {str(T): train_run("vb", T, cfg.n_z)["result"] for T in cfg.T_fast}
    sweep_nz = {str(n): train_run("vb", cfg.learner_T, n)["result"] for n in cfg.n_z_values}
    learners = {name: train_run(name, cfg.learner_T, cfg.n_z)["result"] for name in ("vb", "langevin", "vae")}

    # AR baseline with the same window, batches and schedule (the no-latent reference).
    ar_ppl = math.exp(train_ar_baseline(cfg, train, test, order, cfg.seed))

    # Generation (Eq. 6-8), scored by the exact data law, for each learner's model.
    t = time.time()
    g2 = torch.Generator().manual_seed(cfg.seed + 5)
    prefix, cont_len = test[:, :cfg.prefix_len], cfg.seq_len - cfg.prefix_len
    generation: dict = {"prefix_len": cfg.prefix_len, "continuation_len": cont_len, "reference": {
        "true_continuation": score_continuations(data, prefix, test[:, cfg.prefix_len:]),
        "exact_continuation": score_continuations(data, prefix, data.sample_continuation(prefix, cont_len, g2)),
        "exact_samples": score_samples(data, data.sample(cfg.eval_size, cfg.seq_len, g2)),
        "uniform_samples": score_samples(data, torch.randint(0, cfg.vocab_size, test.shape, generator=g2))}}
    for name in ("vb", "langevin", "vae"):
        run = runs[(name, cfg.learner_T, cfg.n_z)]
        ltm = run["ltm"]
        torch.manual_seed(cfg.seed + 6)
        guide = ltm.fit_local(prefix, num_steps=cfg.eval_T, lr=run["fast_lr"])
        z_post = guide.distribution(detach=True).sample()
        shape = (prefix.shape[0], *ltm.latent_shape)
        z_prior = torch.randn(shape, generator=g2)
        z_prior2 = torch.randn(shape, generator=g2)
        generation[name] = {
            "posterior_continuation": score_continuations(
                data, prefix, ltm.generate(z_post, cont_len, prefix, g2)[:, cfg.prefix_len:]),
            "prior_z_continuation": score_continuations(
                data, prefix, ltm.generate(z_prior, cont_len, prefix, g2)[:, cfg.prefix_len:]),
            "prior_samples": score_samples(data, ltm.generate(z_prior2, cfg.seq_len, None, g2))}
    generation["seconds"] = time.time() - t

    return {"sweep": {"T_fast": sweep_T, "N_z": sweep_nz}, "learners": learners, "generation": generation,
            "exact_ppl": exact_ppl, "ar_window_ppl": ar_ppl, "config": asdict(cfg), **provenance(),
            "seconds": time.time() - t0, "cpu_seconds": time.process_time() - cpu0}


def sweep_tables(results: dict) -> str:
    """The Markdown tables of docs/latent-thought.md ("Training-time sweep, learners and generation"), made from
    the JSON of :func:`run_sweep` (a test checks that the documented tables equal these)."""
    f = "{:.3f}".format
    lines = [f"Exact perplexity of the test set: {f(results['exact_ppl'])}; autoregressive Transformer with the "
             f"same window: {f(results['ar_window_ppl'])}.", "",
             "| run | T_fast | N_z | own ELBO-ppl (T_eval = T_fast) | ELBO-ppl (T_eval = "
             f"{results['config']['eval_T']}) | IW ppl (K = {results['config']['iw_samples']}) | KL/token at the "
             "last step |", "|---|---|---|---|---|---|---|"]
    rows = [(f"T_fast = {k}", v) for k, v in results["sweep"]["T_fast"].items()]
    rows += [(f"N_z = {k}", v) for k, v in results["sweep"]["N_z"].items()]
    rows += [(f"learner {k}", v) for k, v in results["learners"].items()]
    for name, r in rows:
        T = "-" if r["learner"] == "vae" else r["T_fast"]
        lines.append(f"| {name} | {T} | {r['n_z']} | {f(r['ppl'])} | {f(r['elbo_ppl_Teval'])} | {f(r['iw_ppl'])} | "
                     f"{f(r['train_final'].get('kl_per_token', float('nan')))} |")
    vae = results["learners"]["vae"]
    if "amortised_elbo_ppl" in vae:
        lines += ["", f"VAE with its own encoder (one pass): ELBO-ppl {f(vae['amortised_elbo_ppl'])}, KL "
                  f"{f(vae['amortised_kl_per_token'])} nats/token."]
    gen = results["generation"]
    lines += ["", "| generator | continuation log p(y \\| x) / token | same chain | p(prefix chain \\| y) | "
              "samples: log p(x) / token | token entropy |", "|---|---|---|---|---|---|"]
    ref = gen["reference"]
    ec, tc, es = ref["exact_continuation"], ref["true_continuation"], ref["exact_samples"]
    lines.append(f"| data law (exact continuation; exact samples) | {f(ec['data_logp_per_token'])} "
                 f"| {f(ec['same_chain'])} | {f(ec['prefix_chain_posterior'])} | "
                 f"{f(es['data_logp_per_token'])} | {f(es['token_entropy'])} |")
    lines.append(f"| test set (true continuation) | {f(tc['data_logp_per_token'])} | "
                 f"{f(tc['same_chain'])} | {f(tc['prefix_chain_posterior'])} | - | - |")
    lines.append(f"| uniform tokens | - | - | - | {f(ref['uniform_samples']['data_logp_per_token'])} | "
                 f"{f(ref['uniform_samples']['token_entropy'])} |")
    for name in ("vb", "langevin", "vae"):
        g = gen[name]
        for kind, label in (("posterior_continuation", "z ~ q(z \\| x), Eq. 7"),
                            ("prior_z_continuation", "z ~ N(0, I)")):
            c = g[kind]
            samples = g["prior_samples"] if kind == "prior_z_continuation" else None
            tail = (f"{f(samples['data_logp_per_token'])} | {f(samples['token_entropy'])} |" if samples
                    else "- | - |")
            lines.append(f"| {name}, {label} | {f(c['data_logp_per_token'])} | {f(c['same_chain'])} | "
                         f"{f(c['prefix_chain_posterior'])} | {tail}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ts = [int(t) for t in results["elbo_ppl_by_T"]]
    ppl = list(results["elbo_ppl_by_T"].values())
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([max(t, 0.5) for t in Ts], ppl, "o-", label="LTM ELBO-perplexity")
    ax.axhline(results["ltm_ppl"], color="C0", ls=":", label=f"LTM IW bound (T={max(Ts)})")
    ax.axhline(results["ar_window_ppl"], color="C1", ls="--", label="AR, same window")
    ax.axhline(results["exact_ppl"], color="k", ls="-", lw=1, label="exact")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("fast inference steps T (T=0 plotted at 0.5)")
    ax.set_ylabel("perplexity")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Run alone: ``python -m ppl_thought.experiments.latent_thought [--quick] [--json FILE] [--out DIR]``."""

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores")
    parser.add_argument("--sweep", action="store_true",
                        help="the training-time sweep (T_fast, N_z), the three learners and generation (run_sweep)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--out", metavar="DIR", help="write the plot here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tables", metavar="JSON", help="print the Markdown tables of a --sweep JSON and exit")
    args = parser.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    if args.tables:
        with open(args.tables) as fh:
            print(sweep_tables(json.load(fh)), end="")
        return 0
    torch.set_num_threads(args.threads)
    if args.sweep:
        scfg = SweepConfig.quick() if args.quick else SweepConfig.full()
        scfg.seed = args.seed
        results = run_sweep(scfg)
        brief = {"T_fast": {k: {m: v[m] for m in ("ppl", "elbo_ppl_Teval", "iw_ppl")}
                            for k, v in results["sweep"]["T_fast"].items()},
                 "N_z": {k: v["iw_ppl"] for k, v in results["sweep"]["N_z"].items()},
                 "learners": {k: v["iw_ppl"] for k, v in results["learners"].items()},
                 "exact_ppl": results["exact_ppl"], "ar_window_ppl": results["ar_window_ppl"],
                 "seconds": results["seconds"], "cpu_seconds": results["cpu_seconds"]}
        print(json.dumps(brief, indent=1))
        if args.json:
            results[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            atomic_write_json(args.json, results)
        return 0
    cfg = LTMConfig.quick() if args.quick else LTMConfig.full()
    cfg.seed = args.seed
    results = run_latent_thought(cfg, args.out)
    short = {k: v for k, v in results.items() if k not in ("config", "train_final")}
    print(json.dumps(short, indent=1))
    if args.json:
        results[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
        atomic_write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
