"""SMC whose per-token work is one fixed step on a static KV cache, captured as a CUDA graph on a GPU
(``pt.infer.SMC(n, backend="static")``; docs/gpu.md).

The generic engine runs a program's step through Pyro (a trace per step) and reads a few numbers back
to the host at every step (resampling decision, NaN and zero-weight checks, whether everyone has
finished). On a GPU at small models that sets the pace, not the arithmetic. Programs whose step is one
token of one LM under a token automaton need none of that; they say so with
:meth:`Program.one_token_step() <ppl_thought.program.Program.one_token_step>`, which returns the step's
parts (:class:`~ppl_thought.program.OneTokenStep`: lm, rule, max_tokens, stop_ids, log_mass;
:class:`~ppl_thought.models.Constrained` is one; no isinstance test of a model class). A step is

    logits -> log Z_t = spec.log_mass(logits, s, done)         (the step's weight, e.g. Constrained's)
           -> token_step (distributions/token_rule.py): token ~ masked softmax (Def 2.8), inverse CDF
              with one uniform per row, automaton state, done flags; length
           -> LM step on the static cache (lm/static_cache.py) -> next logits
           -> log W += log Z_t; ESS; resampling decided on the device:
              idx = where(ESS < threshold * n and not all done, ancestors, identity); every buffer
              (KV cache, logits, states, tokens, weights) gathered by idx in place

with the same arithmetic as the generic engine, SMC with adaptive resampling ((2.22): Z-hat =
prod_t (1/n) sum_i W_{t-1}^i w_t^i, the weights of a resampled step set to their mean). The
automaton tables are moved to the device once (``TokenRule``'s per-device tables). Nothing is read back
to the host until the last step: the per-step ESS, resampling flags, ancestors and error flags (no
admissible token, NaN weights, all weights zero) are written into device buffers and read once at
the end, when the errors are raised. The price of deciding on the device is that the gather runs at
every step (with the identity index when nobody resamples) and that the resampling uniform is drawn
at every step (unless ``ess_threshold=0``).

On CUDA (``graphs=None`` or ``True``) the step is captured once in a ``torch.cuda.CUDAGraph`` (the
static cache then attends over its whole buffer) and replayed ``max_tokens`` times; the captured
runner is kept on the engine and reused by later runs with the same program, particle count and
prompt length. On CPU the same step runs eagerly (attention over the slots written so far), and the
run gives bitwise the particles, weights and log Z-hat of the generic engine while no resampling
happens (the same uniforms from the default generator, the same arithmetic); with resampling the
random streams differ (the generic engine draws the resampling uniform only when it resamples) and
the two agree in distribution (tests/test_static_decode.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ppl_thought.distributions.token_rule import token_step
from ppl_thought.errors import (
    ConfigError,
    NumericalError,
    UnsatisfiableConstraintError,
    ZeroWeightsError,
    describe_proposal,
    zero_weights_message,
)
from ppl_thought.inference.importance import log_marginal_stderr
from ppl_thought.inference.resampling import effective_sample_size, resample_groups
from ppl_thought.inference.result import Result, log_mean_exp
from ppl_thought.lm.base import lm_device
from ppl_thought.lm.static_cache import bos_context, static_decoder
from ppl_thought.program import OneTokenStep, Program

__all__ = ["StaticRunner", "run_static", "check_static_program"]

#: resampling schemes the static path runs on the device (residual resampling has data-dependent shapes)
STATIC_RESAMPLING = ("systematic", "stratified", "multinomial")


def check_static_program(model: Any) -> OneTokenStep:
    """The program's one-token step (:meth:`OneTokenStep.of <ppl_thought.program.OneTokenStep.of>`: a
    :class:`~ppl_thought.errors.ConfigError` naming ``one_token_step()`` when it has none), checked for what the static
    path cannot run: a twist, extra outputs."""
    name = type(model).__name__
    spec = OneTokenStep.of(model, "SMC(backend='static') (else use backend='generic')")
    if spec.twist is not None:
        raise ConfigError(f"SMC(backend='static') does not run twists ({name} has one: a twist reads the growing "
                          "token prefix, which a captured step cannot): use backend='generic'")
    if isinstance(model, Program) and type(model).outputs is not Program.outputs:
        raise ConfigError(f"{name} defines outputs(state), which the static path does not build: use "
                          "backend='generic'")
    return spec


class StaticRunner:
    """The buffers and the one-token step of a static SMC run of ``n`` particles of ``model`` (whose step is
    ``spec``, :meth:`~ppl_thought.program.Program.one_token_step`) after a prompt of ``prompt_len`` tokens (see the
    module docstring). ``run(prompt)`` returns the host-side results."""

    def __init__(self, model, n: int, prompt_len: int, ess_threshold: float, resampling: str,
                 generator: torch.Generator | None, graphs: bool | None, spec: OneTokenStep | None = None):
        if resampling not in STATIC_RESAMPLING:
            raise ConfigError(f"SMC(backend='static') resamples with one of {STATIC_RESAMPLING}, not {resampling!r}")
        self.model, self.n, self.prompt_len = model, int(n), int(prompt_len)
        self.spec = spec = check_static_program(model) if spec is None else spec
        lm, rule = spec.lm, spec.rule
        dev = lm_device(lm)
        self.device = dev
        if graphs is None:
            graphs = dev.type == "cuda"
        if graphs and dev.type != "cuda":
            raise ConfigError(f"graphs=True captures CUDA graphs; the model is on {dev}")
        if generator is not None and generator.device.type != dev.type:
            raise ConfigError(f"the resampling generator is on {generator.device}, the model on {dev}: pass a "
                              "generator on the model's device")
        self.graphs = bool(graphs)
        self.threshold, self.resampling, self.generator = float(ess_threshold), resampling, generator
        T = self.T = int(spec.max_tokens)
        self.V = V = int(lm.vocab_size)
        # slots: <bos> + prompt, then one token fed per step (the last one's logits are never read)
        self.decoder = static_decoder(lm, self.n, self.prompt_len + 1 + T)
        self.rule = rule
        self.ar = torch.arange(self.n, device=dev)
        # the state of the run (written in place by the step)
        self.s0 = rule.start(self.n, dev)
        self.logits = torch.zeros(self.n, V, device=dev)
        self.s = self.s0.clone()
        self.lengths = torch.zeros(self.n, dtype=torch.long, device=dev)
        self.done = torch.zeros(self.n, dtype=torch.bool, device=dev)
        self.finished = torch.zeros(self.n, dtype=torch.bool, device=dev)
        self.lw = torch.zeros(self.n, device=dev)
        self.tokens = torch.zeros(self.n, T, dtype=torch.long, device=dev)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        # per-step records, read once at the end
        self.ess = torch.zeros(T, device=dev)
        self.resampled = torch.zeros(T, dtype=torch.bool, device=dev)
        self.ancestry = torch.zeros(T, self.n, dtype=torch.long, device=dev)
        self.flags = torch.zeros(T, 4, dtype=torch.bool, device=dev)  # dead row, NaN weight, all zero, all done
        self.graph = None

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> None:
        """One token for every particle; every buffer updated in place (no host sync)."""
        rule, n, T = self.rule, self.n, self.T
        logits, s, done = self.logits, self.s, self.done
        active = ~done
        log_z = self.spec.mass(logits, s, done)  # the step's weight (default: the mass factor log Z_t)
        lengths = self.lengths + active.long()
        step = token_step(rule, logits, s, active, ends=partial(self._ends, lengths=lengths), done=done)  # Def 2.8
        tok, s_new, dead, done_new = step.token, step.state, step.dead, step.done  # <pad> for ended rows
        new_logits = self.decoder.step(tok)
        finished = self.finished | done_new | (self.t == T - 1)
        lw = self.lw + torch.where(self.finished, torch.zeros_like(log_z), log_z)
        ess = effective_sample_size(lw, check=False)  # no host sync in a captured step
        all_done = finished.all()
        t1 = self.t
        if self.threshold > 0:
            need = (ess < self.threshold * n) & ~all_done  # decided on the device
            idx, lw = resample_groups(lw, need.reshape(1), 1, self.resampling, self.generator, inverse_cdf=True)
            self.decoder.reorder(idx)
        else:
            need = torch.zeros((), dtype=torch.bool, device=self.device)
            idx = self.ar
        self.tokens.index_copy_(1, t1, tok[:, None])
        self.tokens.copy_(self.tokens.index_select(0, idx))
        self.logits.copy_(new_logits.index_select(0, idx))
        self.s.copy_(s_new.index_select(0, idx))
        self.lengths.copy_(lengths.index_select(0, idx))
        self.done.copy_(done_new.index_select(0, idx))
        self.finished.copy_(finished.index_select(0, idx))
        self.lw.copy_(lw)
        self.ess.index_copy_(0, t1, ess.reshape(1))
        self.resampled.index_copy_(0, t1, need.reshape(1))
        self.ancestry.index_copy_(0, t1, idx[None])
        flags = torch.stack([dead.any(), torch.isnan(lw).any(), torch.isneginf(lw).all(), all_done])
        self.flags.index_copy_(0, t1, flags[None])
        self.t.add_(1)

    def _ends(self, tok: torch.Tensor, s_new: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Where a particle's sequence ends after ``tok``: the program's own :meth:`OneTokenStep.ends` (a final state,
        a stop id, ``max_tokens`` tokens)."""
        return self.spec.ends(tok, s_new, lengths)[1]

    # -- running --------------------------------------------------------------------------------------
    def _reset(self, ctx: torch.Tensor) -> None:
        """Encode the prompt into the static cache and set every buffer to the start of a run, in place."""
        self.logits.copy_(self.decoder.start(ctx))
        self.s.copy_(self.s0)
        self.lengths.zero_()
        self.done.copy_(self.rule.is_final(self.s0) | (self.T == 0))
        self.finished.zero_()
        self.lw.zero_()
        self.tokens.zero_()
        self.t.zero_()
        for buf in (self.ess, self.resampled, self.ancestry, self.flags):
            buf.zero_()

    def _capture(self, ctx: torch.Tensor) -> None:
        """Warm up on a side stream and capture :meth:`step` in a CUDA graph (on buffers reset afterwards)."""
        self.decoder.full = True
        self._reset(ctx)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self._reset(ctx)
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None and hasattr(graph, "register_generator_state"):
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph):
            self.step()
        self.graph = graph

    def run(self, prompt: torch.Tensor | None) -> dict:
        """One SMC run from ``prompt``; host-side results (one sync, at the end)."""
        ctx = bos_context(prompt, self.device)
        if ctx.shape[0] != self.prompt_len + 1:
            raise ConfigError(f"this runner was built for prompts of {self.prompt_len} tokens, got {ctx.shape[0] - 1}")
        if self.graphs and self.graph is None:
            self._capture(ctx)
        self._reset(ctx)
        if self.graphs:
            for _ in range(self.T):
                self.graph.replay()
        else:
            for _ in range(self.T):
                self.step()
                if self.device.type == "cpu" and bool(self.flags[int(self.t) - 1, 3]):  # free on the host
                    break
        return self._collect()

    def _collect(self) -> dict:
        flags = self.flags.cpu()
        done_at = flags[:, 3].nonzero()
        steps = int(done_at[0]) + 1 if len(done_at) else self.T
        name = type(self.model).__name__
        for t in range(steps):
            dead, nan, zero = (bool(x) for x in flags[t, :3])
            if dead:
                raise UnsatisfiableConstraintError(f"rows have no admissible token of positive probability at step {t} "
                                                   f"of {name}: the LM gives probability 0 to every token the "
                                                   "constraint allows")
            if nan:
                raise NumericalError(f"NaN weights after step {t} of {name} (a log-probability is NaN or +inf)")
            if zero:
                raise ZeroWeightsError(zero_weights_message("SMC", self.n, describe_proposal(None),
                                                            where=f"after step {t} of {name}"))
        return {"tokens": self.tokens[:, :steps].clone(), "log_weights": self.lw.clone(), "steps": steps,
                "ess": self.ess[:steps].tolist(), "resampled": [bool(r) for r in self.resampled[:steps].tolist()],
                "ancestry": self.ancestry[:steps].clone()}


def run_static(smc, model, guide, args: tuple, kwargs: dict):
    """``SMC.run`` with ``backend="static"``: a :class:`~ppl_thought.inference.result.Result` like the generic
    engine's (sites ``x_t``, final log weights, log Z-hat, ancestry, per-step ESS and resampling flags)."""

    if guide is not None:
        raise ConfigError("SMC(backend='static') proposes from the program itself (guide=None)")
    if smc.groups != 1:
        raise ConfigError("SMC(backend='static') runs one particle group (groups=1)")
    spec = check_static_program(model)
    if spec.prompt is None and (len(args) > 1 or set(kwargs) - {"prompt"} or (args and "prompt" in kwargs)):
        raise ConfigError(f"SMC(backend='static') runs {type(model).__name__}(prompt) with one prompt argument (or "
                          "give OneTokenStep(prompt=...) to read it from the run's arguments)")
    prompt = spec.prompt_ids(args, kwargs)
    plen = 0 if prompt is None else int(torch.as_tensor(prompt).reshape(-1).shape[0])
    key = (id(model), plen)
    runners = smc.__dict__.setdefault("_static_runners", {})
    entry = runners.get(key)
    if entry is None or entry[0] is not model:
        entry = (model, StaticRunner(model, smc.num_particles, plen, smc.ess_threshold, smc.resampling,
                                     smc.generator, smc.graphs, spec))
        runners[key] = entry
    runner = entry[1]
    with torch.no_grad():
        out = runner.run(prompt)
    lw, steps = out["log_weights"], out["steps"]
    samples = {f"x_{t}": out["tokens"][:, t] for t in range(steps)}
    any_resampled = any(out["resampled"])
    return Result(samples=samples, log_weights=lw, log_marginal=log_mean_exp(lw),
                  log_marginal_stderr=log_marginal_stderr(lw) if not any_resampled else None,
                  ancestry=out["ancestry"], observed={"args": args, "kwargs": kwargs}, engine="SMC",
                  stats={"ess": out["ess"], "resampled": out["resampled"], "steps": steps, "token_steps": steps,
                         "particle_steps": steps * smc.num_particles, "mode": "static", "groups": 1,
                         "graphs": runner.graphs})
