"""Section 7 of slow-thinking-active-perception (App. L, Fig 7.1), at small scale.

    python -m ppl_thought.experiments.sec7 [--quick] [--seed S] [--json FILE]
    python -m ppl_thought.experiments.sec7 --seeds 5 --n 8 16 --json FILE      (run_seeds)

Explanatory vs predictive samplers on the hidden-choice task (:mod:`ppl_thought.data.query_response`, an instance
of Example 5.1): three trainings with equal data, steps, sampling size n and network size, every network a copy of
one shared base model that can use a thought naming the method (:meth:`Sec7.pretrain`, App. L's pretrained LLM):
SFT ``-log P(x_r | x)``; latent model P + predictive sampler Q(y | x), P on (7.1) (the surrogate of
:class:`~ppl_thought.training.objectives.OneSampler`, (5.20)) and Q on the sampler loss (``Sec7Config.sampler_loss``:
(3.25)/(5.24) with a leave-one-out baseline, or (7.2) exactly as printed); the same with the explanatory sampler
Q(y | x x_r) (prompt ``x x_r <explain>``, Section 5.6.2). Test loss: (7.1) on held-out data with each method's own
sampler and n samples, per response token; the causal gap (7.3) over training. App. L at fidelity: the gating
trick (L.1)/(L.2) for P and, with its own MLP, for the explanatory sampler (:func:`gate_mix`); joint clipping of P
and Q (``clipping="separate"``: Fig L.2, :func:`clip_gradients_`). :func:`run_seeds` (``--quick``, ``--steps N``,
``--batch B``, ``--sampler-loss``) runs seeds at n = 8 and 16 with a bootstrap interval of the relative improvement.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from tqdm.auto import tqdm

from ppl_thought.data.query_response import PermutationChoiceTask, permutation_choice_task
from ppl_thought.distributions.lm_state import masked_log_softmax
from ppl_thought.distributions.token_rule import token_step
from ppl_thought.errors import ConfigError
from ppl_thought.experiments.common import provenance, run_alone, score, set_lr, stamped, standard_error, start_record
from ppl_thought.experiments.sec7_losses import (
    _logits_and_features,
    causal_gaps,
    clip_gradients_,
    gate_mix,
    latent_surrogate,
    sampler_surrogate,
)
from ppl_thought.experiments.sec7_seeds import (
    _SEED_KEYS,
    PAPER,
    _criterion,
    _mean_curves,
    _relative_improvement,
    _smooth,
    merge_seed_runs,
    mutual_information,
    summarize_seeds,
)
from ppl_thought.experiments.sec7_seeds import bootstrap_relative_improvement as bootstrap_relative_improvement
from ppl_thought.io import atomic_write_json
from ppl_thought.lm import Transformer
from ppl_thought.lm.gated import gate_mlp
from ppl_thought.projections import QueryResponse
from ppl_thought.training.trainer import clip_joint_, cosine_lr
from ppl_thought.weights import log_mean_exp


@dataclass
class Sec7Config:
    """Sizes of the Section 7 experiment (all three methods share them)."""

    m: int = 4  # letters
    query_len: int = 2  # k
    num_choices: int = 8  # C
    thought_len: int = 1  # |y|
    n: int = 8  # sampling size of (7.1)/(7.2), training and test
    steps: int = 1000  # fine-tuning steps of each method
    batch: int = 32
    lr: float = 3e-3  # peak fine-tuning learning rate (cosine schedule of App. L: 5% warm-up, decay to 10%)
    weight_decay: float = 0.1  # AdamW, as App. L
    clip: float = 1.0
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    num_test: int = 1024
    eval_every: int = 100
    num_eval_curve: int = 256
    sampler_init_scale: float = 1.0  # scales the sampler's (tied) embeddings at init: sharper initial Q
    # the shared base model (App. L fine-tunes one pretrained LM), see Sec7.pretrain; 0 = from scratch
    pretrain_steps: int = 6000  # at most this many steps ...
    pretrain_target: float = 0.005  # ... or until the held-out loss of a response given its method is below this
    pretrain_lr: float = 1e-2
    pretrain_batch: int = 32  # the base model's batch (fine-tuning uses ``batch``)
    thought_alphabet: str = "methods"  # "methods": thoughts are method names; "ordinary": any ordinary token
    seeds: int = 3  # replicates of the whole experiment (base model, data, initialisation, sampling)
    # App. L, as the paper does by default: the gating trick (L.1)/(L.2) for the latent model P of both latent
    # methods, the same trick with its own MLP for the explanatory sampler, and joint gradient clipping
    gating: bool = True  # gate P (L.1)/(L.2)
    gate_sampler: bool = True  # gate the explanatory sampler (App. L, after (L.2)); the predictive one has no x_r
    clipping: str = "joint"  # "joint": P and Q clipped as one model (App. L); "separate": each alone (Fig L.2)
    # the sampler loss: "loo" = (3.25) (leave-one-out baseline, per response token like (7.1)); "paper" = (7.2) as
    # printed: no baseline, 1/(Bn), both log terms normalised by |x_r| (so the loss by |x_r|^2). Same expectation.
    sampler_loss: str = "loo"

    def __post_init__(self) -> None:
        if self.clipping not in ("joint", "separate"):
            raise ConfigError(f"Sec7Config.clipping must be 'joint' or 'separate' (App. L, Fig L.2), "
                              f"got {self.clipping!r}")
        if self.sampler_loss not in ("loo", "paper"):
            raise ConfigError(f"Sec7Config.sampler_loss must be 'loo' ((3.25)) or 'paper' ((7.2) as printed), "
                              f"got {self.sampler_loss!r}")
        if self.thought_alphabet not in ("methods", "ordinary"):
            raise ConfigError(f"Sec7Config.thought_alphabet must be 'methods' or 'ordinary', "
                              f"got {self.thought_alphabet!r}")

    @classmethod
    def quick(cls, n: int = 8) -> Sec7Config:
        """The sizes of ``ppl-thought demo --quick``."""
        return cls(n=n, steps=300, num_test=512, eval_every=50, seeds=1)


class Sec7:
    """The three trainings of Section 7 on one :class:`PermutationChoiceTask` (see the module docstring)."""

    def __init__(self, task: PermutationChoiceTask, cfg: Sec7Config, seed: int):
        self.task, self.cfg, self.seed = task, cfg, seed
        self._base: Transformer | None = None  # the shared base model, built on first use
        v = task.vocab
        self.vocab = v
        V = len(v)
        self.sigma = torch.zeros(V, dtype=torch.bool)  # Sigma: ordinary tokens and <eos>
        self.sigma[torch.as_tensor(v.observable_ids)] = True
        self.thought = torch.zeros(V, dtype=torch.bool)  # the thought alphabet (ordinary tokens, QueryResponse)
        if cfg.thought_alphabet == "ordinary":
            self.thought[torch.as_tensor(v.ordinary_ids)] = True
        else:  # "methods" (Sec7Config checks the value)
            self.thought[[v.id(t) for t in task.methods]] = True
        self.projection = QueryResponse(v, max_thought_len=cfg.thought_len)
        k = task.query_len
        self.k = k

    def base(self, progress: bool = False) -> Transformer:
        """The shared base model (:meth:`pretrain`), built once on first use."""
        if self._base is None:
            self._base = self.pretrain(progress)
        return self._base

    def _lm(self) -> Transformer:
        """A copy of the shared base model: every network of every method starts from it."""
        return copy.deepcopy(self.base())

    def pretrain(self, progress: bool = False) -> Transformer:
        """The base model, as in App. L where every component is a copy of one pretrained LM: next-token training on
        worked solutions ``<bos> q <eos> <s> M<c> </s> sigma_c(q) <eos>`` that name the method before applying it
        (Example 5.1), loss on the solution after ``</s>`` (with the loss on every token the base sat on a plateau
        for > 6000 steps in 2 of 3 seeds). So the base can *use* a thought naming the method; nothing teaches any
        network to *produce* it, and the base never sees the fine-tuning, SFT or ``<explain>`` formats. AdamW, the
        cosine schedule of App. L at ``pretrain_lr``, stops once the held-out loss of the response letters given
        their method is below ``pretrain_target`` (checked every 250 steps), at most ``pretrain_steps`` steps;
        ``self.base_info`` keeps what happened. Paid once, for all three methods."""
        c = self.cfg
        torch.manual_seed(self.seed)
        lm = Transformer(len(self.vocab), d_model=c.d_model, n_layers=c.n_layers, n_heads=c.n_heads, max_len=64)
        self.base_info = {"steps": 0, "response_loss_given_method": None, "seconds": 0.0}
        if c.pretrain_steps <= 0:
            return lm
        t0 = time.time()
        g = torch.Generator().manual_seed(self.seed + 101)
        q_ev, _, r_ev = self.task.sample(256, generator=torch.Generator().manual_seed(self.seed + 202))
        x_ev = self._worked(q_ev, r_ev)
        opt = torch.optim.AdamW(lm.parameters(), lr=c.pretrain_lr, weight_decay=c.weight_decay)
        allowed = torch.ones(len(self.vocab), dtype=torch.bool)
        step, held_out = 0, float("nan")
        desc = f"Section 7: base model, training steps (at most; stops at held-out response loss < {c.pretrain_target})"
        with tqdm(total=c.pretrain_steps, desc=desc, disable=not progress) as bar:
            for step in range(1, c.pretrain_steps + 1):
                set_lr(opt, cosine_lr(c.pretrain_lr, step - 1, c.pretrain_steps))
                q, _, r = self.task.sample(c.pretrain_batch, generator=g)
                opt.zero_grad()
                loss = -score(lm, self._worked(q, r), self.k + 5, allowed).mean()  # the solution after </s>
                loss.backward()
                clip_joint_(list(lm.parameters()), c.clip)
                opt.step()
                bar.update(1)
                if step % 250 == 0 or step == c.pretrain_steps:
                    with torch.no_grad():  # the response letters, after <bos> q <eos> <s> M </s>
                        held_out = float(-score(lm, x_ev, self.k + 5, allowed)[:, :self.k].mean())
                    bar.set_postfix({"response|method": f"{held_out:.3f}"})
                    if held_out < c.pretrain_target:
                        bar.set_description(f"Section 7: base model, stopped at step {step}: target reached")
                        break
        self.base_info = {"steps": step, "response_loss_given_method": held_out,
                          "reached_target": bool(held_out < c.pretrain_target), "seconds": round(time.time() - t0, 1)}
        if not held_out < c.pretrain_target:
            warnings.warn(f"Section 7 base model (seed {self.seed}) did not reach its pretraining target in "
                          f"{step} steps (held-out response loss given the method {held_out:.3f} >= "
                          f"{c.pretrain_target}): it has not learned to use a thought, so this replicate cannot "
                          "show the effect of the samplers", RuntimeWarning, stacklevel=2)
        return lm

    def _worked(self, q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """A worked solution ``<bos> q <eos> <s> M<c> </s> sigma_c(q) <eos>`` for the base model."""
        return self._latent(q, self.task.letter_ids(r[:, -1:]), r[:, :-1])

    # --- formats
    def _obs(self, q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``<bos> q <eos> r <eos>`` (the observation x x_r of Section 5.1)."""
        v, B = self.vocab, q.shape[0]
        col = lambda i: torch.full((B, 1), i, dtype=torch.long)  # noqa: E731
        return torch.cat([col(v.bos_id), self.task.letter_ids(q), col(v.eos_id), self.task.letter_ids(r),
                          col(v.eos_id)], 1)

    def _latent(self, q: torch.Tensor, y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``<bos> q <eos> <s> y </s> r <eos>`` (the latent format (5.1))."""
        v, B = self.vocab, q.shape[0]
        col = lambda i: torch.full((B, 1), i, dtype=torch.long)  # noqa: E731
        return torch.cat([col(v.bos_id), self.task.letter_ids(q), col(v.eos_id), col(v.think_id), y,
                          col(v.end_think_id), self.task.letter_ids(r), col(v.eos_id)], 1)

    def _sampler_prompt(self, q: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        """Predictive: ``<bos> q <eos> <s>``; explanatory: ``<bos> q <eos> r <eos> <explain> <s>`` (Fig 5.5)."""
        v, B = self.vocab, q.shape[0]
        col = lambda i: torch.full((B, 1), i, dtype=torch.long)  # noqa: E731
        if r is None:
            return torch.cat([col(v.bos_id), self.task.letter_ids(q), col(v.eos_id), col(v.think_id)], 1)
        return torch.cat([self._obs(q, r), col(v.explain_id), col(v.think_id)], 1)

    # --- the pieces of (7.1)
    def q_logits(self, Q: torch.nn.Module, q: torch.Tensor, r: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
        """The sampler's logits at the thought positions, ``[B, |y| + 1, V]``: row j predicts thought token
        j + 1 given ``y[:, :j]`` (the last row the token after ``y``). Predictive sampler (``r is None``):
        Q on ``x <s> y``. Explanatory sampler: Q on ``x x_r <explain> <s> y``; with the gating trick
        (``Q.gate``, App. L after (L.2)) the mixture :func:`gate_mix` of Q on the predictive format (fast)
        and on the explanatory one (slow), so a fresh gate starts the explanatory sampler as a predictive one.
        The gate acts at every decoding step of (7.2) too (decoding is repeated encoding)."""
        prompt = self._sampler_prompt(q, r)
        a = prompt.shape[1] - 1
        gate = getattr(Q, "gate", None)
        if gate is None or r is None:
            logits, _ = Q(torch.cat([prompt, y], 1))
            return logits[:, a:]
        slow, f_slow = _logits_and_features(Q, torch.cat([prompt, y], 1))
        fast_prompt = self._sampler_prompt(q, None)
        b = fast_prompt.shape[1] - 1
        fast, f_fast = _logits_and_features(Q, torch.cat([fast_prompt, y], 1))
        return gate_mix(gate, f_fast[:, b:], f_slow[:, a:], fast[:, b:], slow[:, a:])

    def sample_thoughts(self, Q: torch.nn.Module, q: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        """y ~ Q(. | x) (predictive, ``r is None``) or Q(. | x x_r) exactly (no temperature, (7.2)),
        ``[B, thought_len]`` thought-token ids."""
        y = torch.zeros(q.shape[0], 0, dtype=torch.long)
        with torch.no_grad():
            for _ in range(self.cfg.thought_len):
                lq = masked_log_softmax(self.q_logits(Q, q, r, y)[:, -1], self.thought)
                y = torch.cat([y, token_step(None, None, None, log_probs=lq).token[:, None]], 1)  # the one token step
        return y

    def log_q(self, Q: torch.nn.Module, q: torch.Tensor, r: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
        """log Q(y | x) or log Q(y | x x_r), ``[B]``."""
        lq = masked_log_softmax(self.q_logits(Q, q, r, y[:, :-1]), self.thought)
        return lq.gather(-1, y[..., None]).squeeze(-1).sum(-1)

    def log_p_parts(self, P: torch.nn.Module, q, y, r) -> tuple[torch.Tensor, torch.Tensor]:
        """(log P(y | x), log P(x_r | x y)) ``[B]`` each, masked to Dom(Proj) (Def 2.8). With the gating
        trick (``P.gate``, :func:`~ppl_thought.lm.gated.gate_mlp`) the response logits are
        (L.1)/(L.2): p_fast * f(x x_r) + p_slow * f(x <s> y </s> x_r), gates from the features before the
        unembedding of both passes."""
        z = self._latent(q, y, r)
        k, L = self.k, self.cfg.thought_len
        ys, rs = k + 3, k + 4 + L  # y after <bos> q <eos> <s>; r <eos> after </s> (<s>, </s> are forced)
        gate = getattr(P, "gate", None)
        if gate is None:
            logits, _ = P(z[:, :-1])
            resp = logits[:, rs - 1:]
        else:
            logits, f_slow = _logits_and_features(P, z[:, :-1])
            fast, f_fast = _logits_and_features(P, self._obs(q, r)[:, :-1])
            resp = gate_mix(gate, f_fast[:, k + 1:], f_slow[:, rs - 1:], fast[:, k + 1:], logits[:, rs - 1:])
        lp_y = masked_log_softmax(logits[:, ys - 1: ys - 1 + L], self.thought).gather(-1, z[:, ys:ys + L, None])
        lp_r = masked_log_softmax(resp, self.sigma).gather(-1, z[:, rs:, None])
        return lp_y.squeeze(-1).sum(-1), lp_r.squeeze(-1).sum(-1)

    def particles(self, P, Q, q, r, explanatory: bool, n: int):
        """n thoughts per example from the method's sampler (7.2) and their log P, log Q ``[B, n]``."""
        B = q.shape[0]
        qn, rn = q.repeat_interleave(n, 0), r.repeat_interleave(n, 0)
        cond = rn if explanatory else None
        if self.cfg.thought_len == 1:  # one pass gives both the sample and log Q
            lq_all = masked_log_softmax(self.q_logits(Q, qn, cond, qn[:, :0])[:, -1], self.thought)
            y = token_step(None, None, None, log_probs=lq_all.detach()).token[:, None]  # the one token step
            lq = lq_all.gather(1, y).squeeze(1)
        else:
            y = self.sample_thoughts(Q, qn, cond)
            lq = self.log_q(Q, qn, cond, y)
        lp_y, lp_r = self.log_p_parts(P, qn, y, rn)
        return y.view(B, n, -1), lp_y.view(B, n), lp_r.view(B, n), lq.view(B, n)

    # --- training
    def train(self, method: str, data, test, bar) -> dict:
        """Train one method ('fast', 'pred' or 'expl') and return its curves and test results."""
        c = self.cfg
        q_all, r_all = data
        g = torch.Generator().manual_seed(self.seed + 17)
        torch.manual_seed(1000 * self.seed + {"fast": 1, "pred": 2, "expl": 3}[method])  # sampling, gate init
        P = self._lm()
        nets = [P]
        Q = None
        if method != "fast":
            if c.gating:
                P.gate = gate_mlp(c.d_model)  # a submodule of P: trained, counted and copied with it
            Q = self._lm()
            with torch.no_grad():
                Q.embed.weight.mul_(c.sampler_init_scale)
            if c.gate_sampler and method == "expl":
                Q.gate = gate_mlp(c.d_model)  # the explanatory sampler's own MLP (App. L)
            nets.append(Q)
        params = [p for net in nets for p in net.parameters()]
        opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
        curve, gap_curve, train_gap = [], [], []
        norm = self.k + 2
        for step in range(1, c.steps + 1):
            idx = torch.randint(q_all.shape[0], (c.batch,), generator=g)
            q, r = q_all[idx], r_all[idx]
            set_lr(opt, cosine_lr(c.lr, step - 1, c.steps))
            opt.zero_grad()
            if method == "fast":
                x = self._obs(q, r)
                loss = -score(P, x, self.k + 2, self.sigma).sum(-1).mean() / norm  # SFT loss
            else:
                _, lp_y, lp_r, lq = self.particles(P, Q, q, r, method == "expl", c.n)
                lp = lp_y + lp_r  # log P(y r | x), [B, n]
                if c.sampler_loss == "paper":  # (7.2): U(log P/Q) / |x_r| times log Q / |x_r|, 1/(Bn), no baseline
                    sampler = sampler_surrogate(lp, lq, "none") / norm
                else:
                    sampler = sampler_surrogate(lp, lq, "loo")
                loss = (latent_surrogate(lp, lq) + sampler).sum() / (c.batch * norm)
                gaps = causal_gaps(lp_y, lp, lq)
                train_gap.append(float(gaps.mean()) / norm)
            loss.backward()
            clip_gradients_([list(net.parameters()) for net in nets], c.clip, c.clipping)  # App. L, Fig L.2
            opt.step()
            bar.update(1)
            if step % c.eval_every == 0 or step == c.steps:
                ev = self.evaluate(method, P, Q, test, c.num_eval_curve)
                curve.append({"step": step, "test_loss": ev["loss"]})
                if ev.get("causal_gap") is not None:
                    gap_curve.append({"step": step, "causal_gap": ev["causal_gap"]})
                bar.set_postfix({method: f"{ev['loss']:.4f}"})
        final = self.evaluate(method, P, Q, test, None)
        return {"final": final, "curve": curve, "causal_gap_curve": gap_curve, "train_causal_gap": train_gap,
                "nets": nets}

    def evaluate(self, method: str, P, Q, test, limit: int | None) -> dict:
        """Test loss (7.1) per response token with n samples of the method's own sampler, per example."""
        q_all, r_all = test
        if limit is not None:
            q_all, r_all = q_all[:limit], r_all[:limit]
        norm = self.k + 2
        losses, gaps, ys, lws = [], [], [], []
        with torch.no_grad():
            for s in range(0, q_all.shape[0], 256):
                q, r = q_all[s:s + 256], r_all[s:s + 256]
                if method == "fast":
                    losses.append(-score(P, self._obs(q, r), self.k + 2, self.sigma).sum(-1) / norm)
                    continue
                y, lp_y, lp_r, lq = self.particles(P, Q, q, r, method == "expl", self.cfg.n)
                lw = lp_y + lp_r - lq
                losses.append(-log_mean_exp(lw, 1) / norm)
                gaps.append(causal_gaps(lp_y, lp_y + lp_r, lq) / norm)
                ys.append(y[..., 0])
                lws.append(lw)
        loss = torch.cat(losses).double().numpy()
        out = {"loss": float(loss.mean()), "se": standard_error(loss), "per_example": loss}
        if gaps:
            out["causal_gap"] = float(torch.cat(gaps).mean())
            out["thoughts"] = torch.cat(ys).numpy()
            out["log_weights"] = torch.cat(lws).double().numpy()
        return out


def run_sec7(cfg: Sec7Config, seed: int = 0, progress: bool = True) -> dict:
    """Part 1: the three trainings of Section 7 and their test losses (7.1), gains and causal gaps (7.3).

    ``cfg.seeds`` replicates (training seeds ``seed, seed + 1, ...``) of the whole experiment -- base
    model, data, initialisation and sampling -- on one task (built from ``seed``) and one test set.
    Losses and gains are averaged over replicates; their ``*_se`` are test-set standard errors of that
    average, and ``*_seed_sd`` the spread between replicates. ``per_seed`` keeps each replicate's numbers."""
    if cfg.seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {cfg.seeds}")
    task = permutation_choice_task(cfg.m, cfg.query_len, cfg.num_choices, seed=seed)
    q_te, c_te, r_te = task.sample(cfg.num_test, generator=torch.Generator().manual_seed(seed + 7919))
    t0 = time.time()
    reps = [_sec7_replicate(task, cfg, seed + i, (q_te, c_te, r_te), progress, f"seed {seed + i}")
            for i in range(cfg.seeds)]
    floor_ex = -task.exact_log_prob(q_te, r_te).numpy() / (cfg.query_len + 2)
    S = len(reps)
    pooled = {}  # mean over replicates of per-example quantities, and its test-set standard error
    for key in ("fast", "pred", "expl", "gain_pred", "gain_expl"):
        per = np.stack([r["_per_example"][key] for r in reps])  # [S, N]
        pooled[key] = (float(per.mean()), standard_error(per.mean(0)), float(np.std([p.mean() for p in per], ddof=1))
                       if S > 1 else 0.0)
    gain_p, gain_e = pooled["gain_pred"][0], pooled["gain_expl"][0]
    res = {
        "task": {"m": cfg.m, "query_len": cfg.query_len, "num_choices": cfg.num_choices,
                 "thought_len": cfg.thought_len, "perms": task.perms.tolist()},
        "config": asdict(cfg),
        "seeds": [r["seed"] for r in reps],
        "entropy_floor": float(floor_ex.mean()), "entropy_floor_exact": task.entropy_floor_per_token(),
        "gain_pred": gain_p, "gain_pred_se": pooled["gain_pred"][1], "gain_pred_seed_sd": pooled["gain_pred"][2],
        "gain_expl": gain_e, "gain_expl_se": pooled["gain_expl"][1], "gain_expl_seed_sd": pooled["gain_expl"][2],
        "relative_improvement": _relative_improvement(gain_p, gain_e),
        # the paper's ratio reads as "how much more the explanatory sampler gains" only if gain_pred > 0
        "relative_improvement_defined": bool(gain_p > 0),
    }
    for m in ("fast", "pred", "expl"):
        res[f"L_{m}"], res[f"L_{m}_se"], res[f"L_{m}_seed_sd"] = pooled[m]
    for key in ("causal_gap", "causal_gap_pred", "thought_choice_mutual_information"):
        res[key] = float(np.mean([r[key] for r in reps]))
    res["test_loss_curve"] = _mean_curves(reps, "test_loss_curve", "test_loss")
    res["causal_gap_curve"] = _mean_curves(reps, "causal_gap_curve", "causal_gap")
    res["criterion_expl_ge_2x_pred_and_3se"] = _criterion(gain_p, gain_e, res["gain_expl_se"])
    res["criterion_per_seed"] = [r["criterion_expl_ge_2x_pred_and_3se"] for r in reps]
    res["num_params"] = reps[0]["num_params"]
    res["per_seed"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in reps]
    res["total_seconds"] = round(time.time() - t0, 1)
    arrays = [r["_arrays"] for r in reps]
    res["_arrays"] = {k: np.concatenate([a[k] for a in arrays]) for k in arrays[0]}
    res["_arrays"]["per_example"] = {m: np.concatenate([r["_per_example"][m] for r in reps])
                                     for m in ("fast", "pred", "expl")}
    return res


def _sec7_replicate(task: PermutationChoiceTask, cfg: Sec7Config, seed: int, test, progress: bool,
                    label: str, shared: dict | None = None) -> dict:
    """One replicate of the three trainings from one shared base model (see :func:`run_sec7`).

    ``shared`` (a dict, filled on first use) carries the base model and the SFT run of this seed to the
    replicates at other sampling sizes n: neither depends on n (:func:`run_seeds`)."""
    q_te, c_te, r_te = test
    g = torch.Generator().manual_seed(seed)
    q_tr, _, r_tr = task.sample(cfg.steps * cfg.batch, generator=g)  # one fixed training set for all three
    exp = Sec7(task, cfg, seed)
    shared = {} if shared is None else shared
    runs = {}
    t0 = time.time()
    if "base" in shared:
        exp._base, exp.base_info = shared["base"], shared["base_info"]
    else:
        exp.base(progress)
        shared["base"], shared["base_info"] = exp._base, exp.base_info
    with tqdm(total=3 * cfg.steps, desc=f"Section 7, {label}: SFT / predictive / explanatory",
              disable=not progress) as bar:
        for method in ("fast", "pred", "expl"):
            if method == "fast" and "fast" in shared:
                runs[method] = shared["fast"]
                bar.update(cfg.steps)
                continue
            t = time.time()
            runs[method] = exp.train(method, (q_tr, r_tr), (q_te, r_te), bar)
            runs[method]["seconds"] = round(time.time() - t, 1)
    shared["fast"] = runs["fast"]
    Lf, Lp, Le = (runs[m]["final"] for m in ("fast", "pred", "expl"))
    d_pred = Lf["per_example"] - Lp["per_example"]
    d_expl = Lf["per_example"] - Le["per_example"]
    gain_p, gain_e = float(d_pred.mean()), float(d_expl.mean())
    res = {
        "seed": seed,
        "L_fast": Lf["loss"], "L_pred": Lp["loss"], "L_expl": Le["loss"],
        "L_fast_se": Lf["se"], "L_pred_se": Lp["se"], "L_expl_se": Le["se"],
        "gain_pred": gain_p, "gain_pred_se": standard_error(d_pred),
        "gain_expl": gain_e, "gain_expl_se": standard_error(d_expl),
        "relative_improvement": _relative_improvement(gain_p, gain_e),
        "base_model": exp.base_info,
        "causal_gap": Le.get("causal_gap"), "causal_gap_pred": Lp.get("causal_gap"),
        "causal_gap_curve": {m: runs[m]["causal_gap_curve"] for m in ("pred", "expl")},
        "test_loss_curve": {m: runs[m]["curve"] for m in ("fast", "pred", "expl")},
        "train_causal_gap": {m: _smooth(runs[m]["train_causal_gap"]) for m in ("pred", "expl")},
        # how sharp the explanatory sampler is: does its thought identify the hidden choice?
        "thought_choice_mutual_information": mutual_information(Le["thoughts"], c_te.numpy()),
        "num_params": {m: sum(p.numel() for net in runs[m]["nets"] for p in net.parameters()) for m in runs},
        "seconds": {m: runs[m]["seconds"] for m in runs},
        "total_seconds": round(time.time() - t0, 1),
    }
    res["criterion_expl_ge_2x_pred_and_3se"] = _criterion(gain_p, gain_e, res["gain_expl_se"])
    res["_per_example"] = {"fast": Lf["per_example"], "pred": Lp["per_example"], "expl": Le["per_example"],
                           "gain_pred": d_pred, "gain_expl": d_expl}
    names = np.asarray(task.vocab.tokens)  # the thoughts as text (a method name), for the demo's ArviZ files
    res["_arrays"] = {"expl_thoughts": Le["thoughts"], "expl_log_weights": Le["log_weights"],
                      "pred_thoughts": Lp["thoughts"], "pred_log_weights": Lp["log_weights"],
                      "expl_thought_text": names[Le["thoughts"]], "pred_thought_text": names[Lp["thoughts"]],
                      "true_method_token": task.letter_ids(task.m + c_te).numpy()}
    return res


def run_seeds(cfg: Sec7Config, seeds: int = 5, ns: tuple[int, ...] = (8, 16), seed: int = 0,
              progress: bool = True, task_seed: int = 0, partial: Callable[[dict], None] | None = None) -> dict:
    """The multi-seed Section 7 run (Table of Section 7 and Fig L.2, right): for seeds ``seed, ..., seed +
    seeds - 1`` and each sampling size n in ``ns``, the three trainings; per seed and n the three test losses
    (7.1), both gains and the causal gap (7.3); per n the summary across seeds (:func:`summarize_seeds`;
    standard errors and the bootstrap need >= 2 seeds; a run split over processes is pooled by
    :func:`merge_seed_runs`). ``partial``, if given, gets the result so far after every replicate (its
    ``"partial"`` is True until the last). One task and one test set (both from ``task_seed``); each seed's base
    model and SFT run are shared by its sampling sizes (neither depends on n); ``cfg.n``, ``cfg.seeds`` ignored."""
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {seeds}")
    if not ns or any(int(n) < 1 for n in ns):
        raise ConfigError(f"ns must be sampling sizes >= 1, got {ns}")
    t0 = time.time()
    source = provenance()  # at the start: the code that runs, whatever the checkout becomes meanwhile
    task = permutation_choice_task(cfg.m, cfg.query_len, cfg.num_choices, seed=task_seed)
    q_te, c_te, r_te = task.sample(cfg.num_test, generator=torch.Generator().manual_seed(task_seed + 7919))
    runs: dict[str, list[dict]] = {str(n): [] for n in ns}
    floor = -task.exact_log_prob(q_te, r_te).numpy() / (cfg.query_len + 2)

    def result(done: bool) -> dict:
        have = {k: v for k, v in runs.items() if v}
        return {
            **source,
            "config": {**{k: v for k, v in asdict(cfg).items() if k not in ("n", "seeds")},
                       "ns": [int(n) for n in ns], "seeds": [seed + i for i in range(seeds)], "task_seed": task_seed},
            "task": {"m": cfg.m, "query_len": cfg.query_len, "num_choices": cfg.num_choices,
                     "thought_len": cfg.thought_len, "perms": task.perms.tolist()},
            "entropy_floor": float(floor.mean()), "entropy_floor_exact": task.entropy_floor_per_token(),
            "paper": {k: v for k, v in PAPER.items() if k in have},
            "runs": have,
            "summary": {k: summarize_seeds(v) for k, v in have.items()},
            "seconds": round(time.time() - t0, 1),
            "partial": not done,
        }

    for i in range(seeds):
        shared: dict = {}
        for n in ns:
            rep = _sec7_replicate(task, replace(cfg, n=int(n), seeds=1), seed + i, (q_te, c_te, r_te), progress,
                                  f"seed {seed + i}, n = {n}", shared)
            runs[str(n)].append({k: rep[k] for k in _SEED_KEYS})
            if partial is not None:
                partial(result(False))
    return result(True)


def main(argv: list[str] | None = None) -> int:
    """Run this experiment alone: ``python -m ppl_thought.experiments.sec7 [--quick] [--seed S] [--json FILE]``;
    with ``--seeds S [--n 8 16] [--steps N] [--eval-every N] [--threads T]`` the multi-seed run
    (:func:`run_seeds`); ``--merge A.json B.json --json OUT`` pools runs split over processes."""
    import argparse
    import json
    import sys
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--merge", nargs="+", default=None)
    ap.add_argument("--allow-partial", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    known, rest = ap.parse_known_args(argv)
    if known.merge is not None:  # --merge A.json B.json ... --json OUT.json
        mp = argparse.ArgumentParser(description="merge multi-seed Section 7 runs")
        mp.add_argument("--json", required=True)
        margs = mp.parse_args(rest)
        res = merge_seed_runs([json.loads(open(f).read()) for f in known.merge], known.allow_partial)
        res["command"] = "python -m ppl_thought.experiments.sec7 " + " ".join(argv)
        atomic_write_json(margs.json, stamped(res, start_record(__file__, argv)))  # the merge's commit, machine
        print(json.dumps(res["summary"], indent=1))
        return 0
    if known.seeds is None:
        return run_alone(__doc__, run_sec7, Sec7Config, rest)
    ap = argparse.ArgumentParser(description="Section 7 over several seeds at several sampling sizes n")
    ap.add_argument("--seeds", type=int, required=True, help="number of seeds: seed, seed + 1, ...")
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--task-seed", type=int, default=0, help="the seed of the task and the test set")
    ap.add_argument("--n", type=int, nargs="+", default=[8, 16], help="sampling sizes (default 8 16)")
    ap.add_argument("--quick", action="store_true", help="the sizes of ``ppl-thought demo --quick``")
    ap.add_argument("--steps", type=int, default=None, help="fine-tuning steps of each method (default: config's)")
    ap.add_argument("--batch", type=int, default=None, help="fine-tuning batch (the base model keeps its own)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between test-curve points")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--sampler-loss", choices=("loo", "paper"), default=None, help="Sec7Config.sampler_loss")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = Sec7Config.quick() if args.quick else Sec7Config()
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps, eval_every=max(1, min(cfg.eval_every, args.steps)))
    if args.batch is not None:
        cfg = replace(cfg, batch=args.batch)
    if args.eval_every is not None:
        cfg = replace(cfg, eval_every=args.eval_every)
    if args.sampler_loss is not None:
        cfg = replace(cfg, sampler_loss=args.sampler_loss)
    rec = start_record(__file__, argv, args.threads)  # before the run: the code that runs, its command
    save = args.json and (lambda r: atomic_write_json(args.json, stamped(r | {"command": rec["command"]}, rec))) or None
    res = run_seeds(cfg, args.seeds, tuple(args.n), args.seed, progress=True, task_seed=args.task_seed, partial=save)
    res["command"] = rec["command"]
    if args.json:
        atomic_write_json(args.json, stamped(res, rec))  # commit, command, machine, load, seconds
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
