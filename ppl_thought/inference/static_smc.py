"""The static step kernel of SMC: programs whose step is one token of one LM, run on a static KV cache with every
decision on the device, the loop's step captured as a CUDA graph on a GPU (``pt.infer.SMC(n, backend="static")``;
docs/gpu.md).

There is one SMC loop (:meth:`SMC._run <ppl_thought.inference.smc.SMC._run>`: weights, ESS, resampling decision,
resampling, records; (2.22): Z-hat = prod_t (1/n) sum_i W_{t-1}^i w_t^i, the weights of a resampled step set to
their mean, finished particles frozen). The generic kernel produces a step through Pyro (a trace per step) and the
loop reads a few numbers back to the host at every step; on a GPU at small models that sets the pace, not the
arithmetic. Programs whose step is one token of one LM under a token automaton need none of that; they say so
with :meth:`Program.one_token_step() <ppl_thought.program.Program.one_token_step>`, which returns the step's
parts (:class:`~ppl_thought.program.OneTokenStep`: lm, rule, max_tokens, stop_ids, log_mass;
:class:`~ppl_thought.models.Constrained` is one; no isinstance test of a model class). This module derives the
step from it (:class:`StaticRunner`, the kernel):

    logits -> log Z_t = spec.log_mass(logits, s, done)         (the step's weight, e.g. Constrained's)
           -> token_step (distributions/token_rule.py): token ~ masked softmax (Def 2.8), inverse CDF
              with one uniform per row, automaton state, done flags; length
           -> LM step on the static cache (lm/static_cache.py) -> next logits

and the loop, under the kernel's device policy (``sync = False``), adds log Z_t to log W, computes the ESS and
decides resampling on the device: idx = where(ESS < threshold * n and not all done, ancestors, identity); the
kernel then gathers every buffer (KV cache, logits, states, tokens) by idx in place. The automaton tables are
moved to the device once (``TokenRule``'s per-device tables). Nothing is read back to the host until the last
step: the per-step ESS, resampling flags, ancestors and error flags (no admissible token, NaN weights, all
weights zero) are written into the loop's device buffers (:class:`~ppl_thought.inference.smc_loop.LoopState`)
and read once at the end, when the errors are raised. The price of deciding on the device is that the gather
runs at every step (with the identity index when nobody resamples) and that the resampling uniform is drawn at
every step (unless ``ess_threshold=0``).

On CUDA (``graphs=None`` or ``True``) the loop's whole step (this kernel's step and the loop's arithmetic) is
captured once in a ``torch.cuda.CUDAGraph`` (the static cache then attends over its whole buffer) and replayed
``max_tokens`` times; the runner, its loop state and its graph are kept on the engine and reused by later runs
with the same program, particle count and prompt length. On CPU the same step runs eagerly (attention over the
slots written so far), and the run gives bitwise the particles, weights and log Z-hat of the generic kernel while
no resampling happens (the same uniforms from the default generator, the same loop); with resampling the random
streams differ (the generic kernel draws the resampling uniform only when it resamples) and the two agree in
distribution (tests/test_static_decode.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ppl_thought.distributions.token_rule import token_step
from ppl_thought.errors import ConfigError, UnsatisfiableConstraintError
from ppl_thought.inference.smc_loop import Proposal
from ppl_thought.lm.base import lm_device
from ppl_thought.lm.static_cache import bos_context, static_decoder
from ppl_thought.program import OneTokenStep, Program

__all__ = ["StaticRunner", "static_kernel", "check_static_program"]

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
    """The static kernel of :meth:`SMC._run <ppl_thought.inference.smc.SMC._run>` (the one SMC loop): the buffers and
    the one-token step of ``n`` particles of ``model`` (whose step is ``spec``,
    :meth:`~ppl_thought.program.Program.one_token_step`) after a prompt of ``prompt_len`` tokens (see the module
    docstring). It produces a step (:meth:`propose`), reorders its buffers (:meth:`reorder`) and captures the loop's
    step as a CUDA graph (:meth:`compile`); the weights, ESS, resampling and records are the loop's (device policy,
    ``sync = False``: its :class:`~ppl_thought.inference.smc.LoopState` is ``self.loop``, kept with the graph)."""

    sync = False

    def __init__(self, model, n: int, prompt_len: int, ess_threshold: float, resampling: str,
                 generator: torch.Generator | None, graphs: bool | None, spec: OneTokenStep | None = None):
        if resampling not in STATIC_RESAMPLING:
            raise ConfigError(f"SMC(backend='static') resamples with one of {STATIC_RESAMPLING}, not {resampling!r}")
        self.model, self.n, self.prompt_len = model, int(n), int(prompt_len)
        self.name = type(model).__name__
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
        self.generator = generator
        T = self.T = int(spec.max_tokens)
        self.V = V = int(lm.vocab_size)
        # slots: <bos> + prompt, then one token fed per step (the last one's logits are never read)
        self.decoder = static_decoder(lm, self.n, self.prompt_len + 1 + T)
        self.rule = rule
        # the kernel's state (written in place)
        self.s0 = rule.start(self.n, dev)
        self.logits = torch.zeros(self.n, V, device=dev)
        self.s = self.s0.clone()
        self.lengths = torch.zeros(self.n, dtype=torch.long, device=dev)
        self.done = torch.zeros(self.n, dtype=torch.bool, device=dev)
        self.tokens = torch.zeros(self.n, T, dtype=torch.long, device=dev)
        self.new: tuple = ()  # the step's new values, written by reorder
        self.graph = None
        self.loop = None  # the loop's state (LoopState, device policy), made by SMC._run on the first run
        self.ctx: torch.Tensor | None = None
        self.args: tuple = ()
        self.kwargs: dict = {}

    # -- the step -------------------------------------------------------------------------------------
    def propose(self, st) -> Any:
        """One token for every particle (no host sync): the step's weight ``log_mass`` and finished flags for the loop;
        the new token, logits, automaton states, lengths and end flags kept for :meth:`reorder`."""
        logits, s, done = self.logits, self.s, self.done
        active = ~done
        log_z = self.spec.mass(logits, s, done)  # the step's weight (default: the mass factor log Z_t)
        lengths = self.lengths + active.long()
        step = token_step(self.rule, logits, s, active, ends=partial(self._ends, lengths=lengths), done=done)  # Def 2.8
        tok = step.token  # <pad> for ended rows
        self.tokens.index_copy_(1, st.t, tok[:, None])
        self.new = (self.decoder.step(tok), step.state, lengths, step.done)
        return Proposal(log_z, step.done | (st.t == self.T - 1), flag=step.dead.any())

    def reorder(self, idx: torch.Tensor | None) -> None:
        """Write the step's new values into the buffers, gathered by the ancestors ``idx`` (None: the loop never
        resamples, ``ess_threshold=0``); the static KV cache reordered in place."""
        new_logits, s_new, lengths, done_new = self.new
        self.new = ()
        if idx is None:
            pairs = ((self.logits, new_logits), (self.s, s_new), (self.lengths, lengths), (self.done, done_new))
            for buf, v in pairs:
                buf.copy_(v)
            return
        self.decoder.reorder(idx)
        self.tokens.copy_(self.tokens.index_select(0, idx))
        for buf, v in ((self.logits, new_logits), (self.s, s_new), (self.lengths, lengths), (self.done, done_new)):
            buf.copy_(v.index_select(0, idx))

    def _ends(self, tok: torch.Tensor, s_new: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Where a particle's sequence ends after ``tok``: the program's own :meth:`OneTokenStep.ends` (a final state,
        a stop id, ``max_tokens`` tokens)."""
        return self.spec.ends(tok, s_new, lengths)[1]

    def flag_error(self, t: int) -> Exception:
        return UnsatisfiableConstraintError(f"rows have no admissible token of positive probability at step {t} of "
                                            f"{self.name}: the LM gives probability 0 to every token the constraint "
                                            "allows")

    # -- running --------------------------------------------------------------------------------------
    def bind(self, prompt: torch.Tensor | None, args: tuple, kwargs: dict) -> StaticRunner:
        """Set the prompt (and the run's arguments, for ``Result.observed``) of the next run."""
        ctx = bos_context(prompt, self.device)
        if ctx.shape[0] != self.prompt_len + 1:
            raise ConfigError(f"this runner was built for prompts of {self.prompt_len} tokens, got {ctx.shape[0] - 1}")
        self.ctx, self.args, self.kwargs = ctx, args, kwargs
        return self

    def bound(self) -> int:
        return self.T

    def start(self) -> None:
        self._reset(self.ctx)

    def _reset(self, ctx: torch.Tensor) -> None:
        """Encode the prompt into the static cache and set every buffer (the kernel's and the loop's) to the start of
        a run, in place."""
        self.logits.copy_(self.decoder.start(ctx))
        self.s.copy_(self.s0)
        self.lengths.zero_()
        self.done.copy_(self.rule.is_final(self.s0) | (self.T == 0))
        self.tokens.zero_()
        if self.loop is not None:
            self.loop.reset()

    def compile(self, body):
        """The loop's step as run: ``body`` eagerly, or (``graphs``) the replay of its CUDA graph, captured once
        (:meth:`_capture`) and reused by later runs with the same program, particle count and prompt length."""
        if not self.graphs:
            return body
        if self.graph is None:
            self._capture(body, self.ctx)
        return self.graph.replay

    def _capture(self, body, ctx: torch.Tensor) -> None:
        """Warm up on a side stream and capture the loop's step ``body`` in a CUDA graph (on buffers reset
        afterwards)."""
        self.decoder.full = True
        self._reset(ctx)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        self._reset(ctx)
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None and hasattr(graph, "register_generator_state"):
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph):
            body()
        self.graph = graph

    def samples(self, steps: int) -> dict:
        tokens = self.tokens[:, :steps].clone()
        return {f"x_{t}": tokens[:, t] for t in range(steps)}

    def stats(self, steps: int) -> dict:
        return {"token_steps": steps, "particle_steps": steps * self.n, "mode": "static", "graphs": self.graphs}


def static_kernel(smc, model, guide, args: tuple, kwargs: dict) -> StaticRunner:
    """The static kernel of ``smc.run(model, guide, *args, **kwargs)`` with ``backend="static"``: checked, kept on the
    engine per (program, particle count, prompt length) (the program by identity: the entry holds it, so its id
    cannot be reused while the entry lives) and bound to the run's prompt."""

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
    key = (id(model), smc.num_particles, plen)
    runners = smc.__dict__.setdefault("_static_runners", {})
    entry = runners.get(key)
    if entry is None or entry[0] is not model:
        entry = (model, StaticRunner(model, smc.num_particles, plen, smc.ess_threshold, smc.resampling,
                                     smc.generator, smc.graphs, spec))
        runners[key] = entry
    return entry[1].bind(prompt, args, kwargs)
