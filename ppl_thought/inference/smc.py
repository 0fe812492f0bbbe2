"""Sequential Monte Carlo over the steps of any program (Lemma 2.1 for slow-thinking models), with
adaptive resampling and twists written in the program (``pt.twist``): one loop, two step kernels.

A latent z in the lifting of x decomposes uniquely as z = z^(1) ... z^(|x|) with z^(t) in
Phi_{x<t}(z^(<t), x_t) (Lemma 2.1): :class:`~ppl_thought.models.SlowThinking` is a
:class:`~ppl_thought.program.Program` whose step t samples segment z^(t) (site ``f"z_{t}"``) and
checks x_t. Any other program works the same way: the engine only sees the sites of each step.

The loop (:meth:`SMC._run`, :meth:`SMC._step`) is written once and owns the SMC arithmetic of (2.22):

    init -> for t: the kernel's step (incremental log weights w_t, finished flags, twist)
                -> weight update, finished particles frozen (:meth:`SMC._weigh`)
                -> ESS per group -> resampling decision (ESS < threshold * n and not all finished)
                -> resampling (:meth:`SMC._resample`: ancestors, resampled weights set to their mean)
                -> the kernel reorders its state -> records (ESS, flags, ancestry)
         until every particle has finished -> Result (Z-hat = prod_t (1/n) sum_i W_{t-1}^i w_t^i)

A kernel says how a step is produced and where the loop's decisions are taken (its ``sync`` policy):

* :class:`GenericKernel` (``backend="generic"``): Pyro traces of the model's and the guide's step
  (:func:`~ppl_thought.inference.particles.run_step`), the contract checks, and one host sync per step
  (``sync=True``: errors raised at the step, only the groups that need it draw ancestors). The particles of a
  step decode their segments in one lockstep loop (:class:`~ppl_thought.distributions.lm_state.LMState`: a
  particle that ended its segment waits, feeding nothing), and only then are weights updated and particles
  resampled (KV caches gathered with ``cache.reorder``).
* :class:`~ppl_thought.inference.static_smc.StaticRunner` (``backend="static"``): the step derived from the
  program's :meth:`~ppl_thought.program.Program.one_token_step` (token step + static decoder step), every buffer
  on the device, decisions taken on the device (``sync=False``: records and error flags in device buffers, one
  sync at the end), the whole step of the loop captured as a CUDA graph on CUDA.
"""

from __future__ import annotations

from typing import Any

import pyro.poutine as poutine
import torch

from ppl_thought import checks
from ppl_thought.checks import fraction, integer
from ppl_thought.contract import (
    arg_versions,
    as_done,
    check_args,
    check_state,
    freeze_finished,
    program_name,
    snapshot_state,
    step_bound,
)
from ppl_thought.distributions.lm_state import LMState
from ppl_thought.errors import (
    ConfigError,
    NotInImageError,
    NumericalError,
    ProgramError,
    ZeroWeightsError,
    describe_proposal,
    zero_weights_message,
)
from ppl_thought.guides.base import as_step_guide
from ppl_thought.inference.importance import log_marginal_stderr, not_in_image_result
from ppl_thought.inference.particles import (
    check_compatible,
    check_particle_memory,
    check_steps,
    engine_device,
    infinite_sites,
    particle_plate,
    require_program,
    run_step,
)
from ppl_thought.inference.resampling import RESAMPLING, check_scheme, resample, resample_groups
from ppl_thought.inference.result import Result
from ppl_thought.inference.smc_loop import LoopState, Proposal
from ppl_thought.inference.static_smc import static_kernel
from ppl_thought.program import reorder_state
from ppl_thought.validation import checked
from ppl_thought.weights import effective_sample_size, log_mean_exp

#: how a run's steps are produced: Pyro traces of any program, or the static one-token step (inference/static_smc.py)
BACKENDS = ("generic", "static")


@checked
class SMC:
    """Sequential Monte Carlo over the steps of any :class:`~ppl_thought.program.Program` (SMCFilter's
    protocol, batched), unbiased estimate of p(data) ((2.22) for a slow-thinking model).

    At step t every particle runs the guide's step (or, with ``guide=None``, the model's own sample
    statements: bootstrap SMC), then the model's step replayed on the guide's values, and gets the
    incremental weight

        w_t^i = p(sites of step t) / q(latent sites of step t) * psi_t^i / psi_{t-1}^i,

    where psi_t is the potential the model set with ``pt.twist`` (1 when it set none); a particle that
    finishes divides its last potential out, so Z-hat = prod_t (1/n) sum_i W_{t-1}^i w_t^i is unbiased
    for the untwisted program whatever psi is. For a slow-thinking model a step is one segment of
    the lifting (Lemma 2.1). When the ESS falls under ``ess_threshold * n`` the particles are
    resampled (multinomial, stratified, systematic or residual: each unbiased in the offspring
    counts) and every entry of the programs' ``state`` is reordered (KV caches by ``reorder``).

    Args:
        num_particles: n.
        ess_threshold: resample when ESS / n falls under it (0: never, 1: always).
        resampling: ``"systematic"`` (default), ``"stratified"``, ``"multinomial"`` or ``"residual"``.
        generator: a ``torch.Generator`` for resampling.
        max_steps: a bound on the number of steps for programs without ``max_steps``.
        groups: G independent SMC runs of ``num_particles`` particles each, batched into one run of
            ``G * num_particles`` rows (row r belongs to group ``r // num_particles``; the particle plate
            has ``G * num_particles`` rows and ``pt.particle_groups()`` is G inside it, so a program maps
            rows to its observations, e.g. ``x.repeat_interleave(n, 0)`` for x ``[G, ...]``). Weights,
            ESS and resampling are per group (only the groups whose ESS is under the threshold
            resample, ancestors from their own group), so each group's Z-hat is exactly the estimate
            of a separate run on its data.
        backend: ``"generic"`` (default: any program, its steps through Pyro traces) or ``"static"``: for
            programs whose step is one LM token under a token automaton (any program with
            :meth:`~ppl_thought.program.Program.one_token_step`, e.g. :class:`~ppl_thought.models.Constrained`),
            the same loop with the step derived from that protocol (LM step on a static KV cache, mask, sampling)
            and every decision taken on the device, no host sync until the end
            (:mod:`ppl_thought.inference.static_smc`, docs/gpu.md); ``guide=None``, ``groups=1``, no twist.
        graphs: with ``backend="static"``, capture that step as a CUDA graph (default: when the model is on
            CUDA); on CPU the step runs eagerly.

    ``run(model, guide, *args, **kwargs) -> Result``: ``samples`` (every latent site, particles leading,
    plus ``model.outputs(state)``, e.g. ``"z"`` for SlowThinking), final ``log_weights``,
    ``log_marginal`` (log Z-hat), ``ancestry [steps, n]``, ``stats["ess"]`` per step,
    ``stats["resampled"]``, ``stats["token_steps"]`` / ``["particle_steps"]`` (lockstep decoding steps).
    ``guide`` is a Program with the same steps, a sampler with ``dist(x) -> LMSequence`` decoded under
    the lifting (wrapped step-wise), or ``None``. With ``groups=G > 1``: samples keep the ``G * n`` rows
    leading (``.view(G, n, ...)`` splits them), ``log_weights`` is ``[G, n]`` (so ``Result.ess`` and
    ``normalized_weights`` are per group), ``log_marginal`` ``[G]``, ``ancestry [steps, G * n]`` (global
    rows), ``stats["ess"]`` / ``stats["resampled"]`` a list per step of G-lists.
    """

    def __init__(self, num_particles: int, ess_threshold: float = 0.5, resampling: str = "systematic",
                 generator: torch.Generator | None = None, max_steps: int = 10_000, groups: int = 1,
                 backend: str = "generic", graphs: bool | None = None):
        try:
            g = integer("groups", groups)
        except ConfigError:
            raise ConfigError(f"groups must be a positive int (the number of independent particle groups), "
                              f"got {groups!r}") from None
        check_scheme(resampling)
        self.num_particles = integer("num_particles", num_particles)
        self.ess_threshold = fraction("ess_threshold (a fraction of num_particles)", ess_threshold)
        self.resampling = resampling
        if generator is not None:
            checks.instance("generator", generator, torch.Generator, "a torch.Generator or None")
        self.generator = generator
        self.max_steps = integer("max_steps", max_steps)
        self.groups = g
        if backend not in BACKENDS:
            raise ConfigError(f"unknown SMC backend {backend!r}; choose one of {BACKENDS}")
        if graphs and backend != "static":
            raise ConfigError("graphs=True needs backend='static' (the captured step is the static path's)")
        self.backend, self.graphs = backend, graphs
        check_particle_memory("SMC", self.num_particles, self.groups)  # up front: never the allocator's error

    def run(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> Result:  # require_program checks it
        """Run SMC over the steps of ``model``; see the class docstring."""
        require_program(model, "model")
        if self.backend == "static":
            kernel = static_kernel(self, model, guide, args, kwargs)
            with torch.no_grad():
                return self._run(kernel)
        check_compatible(model, guide)
        check_steps(model, guide)
        guide = as_step_guide(guide)
        require_program(guide, "guide")
        try:
            with torch.no_grad(), poutine.block():
                return self._run(GenericKernel(self, model, guide, args, kwargs))
        except NotInImageError as e:
            res = not_in_image_result(f"log p(x) = -inf: {e}", self.num_particles * self.groups, "SMC",
                                       {"args": args, "kwargs": kwargs})
            if self.groups > 1:
                res.log_weights = res.log_weights.view(self.groups, self.num_particles)
                res.log_marginal = res.log_marginal.expand(self.groups)
            return res

    # -- the one loop ---------------------------------------------------------------------------------
    def _run(self, kernel: Any) -> Result:
        """The SMC loop of every backend: ``kernel.start()`` (init; the loop state, :class:`LoopState`), then
        :meth:`_step` until every particle has finished (at most ``kernel.bound()`` steps), then the Result."""
        n, G = self.num_particles, self.groups
        if kernel.loop is None and not kernel.sync:  # a device kernel keeps its buffers (a graph captured them)
            kernel.loop = LoopState(n * G, G, kernel.device, sync=False, steps=kernel.bound())
        step = kernel.compile(lambda: self._step(kernel, kernel.loop))  # the static kernel on CUDA: a graph replay
        kernel.start()
        st = kernel.loop
        bound = kernel.bound()  # read after init: a program may set its number of steps from the data there
        for t in range(bound):
            step()
            if st.stopped(t):
                break
        else:
            if st.sync and not st.all_done:
                raise ProgramError(f"{kernel.name} did not finish within max_steps={bound} steps (return a bool tensor "
                                   "[num_particles] from step to mark finished particles)")
        steps, ess, resampled, ancestry = self._records(st, kernel)
        lw = st.lw if st.sync else st.lw.clone()  # a device kernel's buffers are the next run's
        lw_out = lw if G == 1 else lw.view(G, n)
        any_resampled = any(r if G == 1 else any(r) for r in resampled)
        return Result(
            samples=kernel.samples(steps), log_weights=lw_out, log_marginal=log_mean_exp(lw_out),
            log_marginal_stderr=log_marginal_stderr(lw_out) if not any_resampled else None,
            ancestry=ancestry, observed={"args": kernel.args, "kwargs": kernel.kwargs}, engine="SMC",
            stats={"ess": ess, "resampled": resampled, "steps": steps, "groups": G, **kernel.stats(steps)},
        )

    def _step(self, kernel: Any, st: LoopState) -> None:
        """One step of the loop, the same arithmetic for every kernel: the kernel's step, :meth:`_weigh`, the ESS of
        each group, the resampling decision (ESS < ``ess_threshold * n`` and not every particle finished),
        :meth:`_resample`, the kernel's reorder and the records. ``st.sync``: the decisions are read in one host sync
        (errors raised now, only the groups that need it draw); else they stay on the device (every step draws the
        resampling uniforms unless ``ess_threshold=0``, the identity rows kept by ``torch.where``; errors flagged)."""
        n, G = self.num_particles, self.groups
        out = kernel.propose(st)
        lw, finished, psi = self._weigh(st, out)
        lwg = lw.view(G, n)
        ess = effective_sample_size(lwg, check=False).float()  # [G]; checked below
        all_done = finished.all()
        need = (ess.double() < self.ess_threshold * n) & ~all_done  # [G]
        nan = (torch.isnan(lw) | torch.isposinf(lw)).any()
        zero = torch.isneginf(lwg).all(-1)
        idx = None
        if st.sync:  # the one host sync of the step
            host = torch.cat([torch.stack([nan, all_done, finished.any()]).float(), zero.float(), need.float(),
                              ess]).tolist()
            st.all_done, st.any_finished = host[1] > 0, host[2] > 0
            zero_h, need_h = [z > 0 for z in host[3:3 + G]], [x > 0 for x in host[3 + G:3 + 2 * G]]
            ess_h = host[3 + 2 * G:]
            if host[0] > 0:
                named = infinite_sites(*out.traces)
                at = f" at site(s) {', '.join(named)}" if named else ""
                raise NumericalError(f"NaN or +inf weights after step {st.t} of {kernel.name}: a twist or "
                                     f"log-probability is NaN or +inf{at} (e.g. pyro.factor(name, +inf))")
            out.traces = ()  # checked: the step's traces (and the caches their sites hold) go before resampling
            if any(zero_h):
                raise ZeroWeightsError(self._zero_message(zero_h, st.t, kernel.name, getattr(kernel, "guide", None)))
            if any(need_h):
                idx, lw = self._resample(lw, need_h, st.device)
        elif self.ess_threshold > 0:  # decided on the device: identity ancestors in the groups that keep their rows
            idx, lw = self._resample(lw, need, st.device)
        kernel.reorder(idx)
        if idx is not None:
            finished = finished[idx]
            psi = psi[idx] if psi is not None else None
        if st.sync:
            st.lw, st.finished = lw, finished
            if psi is not None:
                st.prev_psi = psi
            st.ess.append(ess_h[0] if G == 1 else ess_h)
            st.resampled.append(need_h[0] if G == 1 else need_h)
            st.ancestry.append(idx if idx is not None else torch.arange(n * G, device=st.device))
            st.t += 1
            return
        t = st.t
        st.lw.copy_(lw)
        st.finished.copy_(finished)
        st.ess.index_copy_(0, t, ess[None])
        st.resampled.index_copy_(0, t, need[None])
        st.ancestry.index_copy_(0, t, (st.ar if idx is None else idx)[None])
        flag = torch.zeros((), dtype=torch.bool, device=st.device) if out.flag is None else out.flag
        st.flags.index_copy_(0, t, torch.cat([torch.stack([flag, nan, all_done]), zero])[None])
        st.t.add_(1)

    def _weigh(self, st: LoopState, out: Proposal) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The weight update of every kernel: log W_t = log W_{t-1} + log w_t, with w_t = 1 for particles that had
        already finished (they are frozen), and the twist telescoped (``pt.twist``: add psi_t - psi_{t-1}; psi = 0
        once a particle is done), so prod_t (1/n) sum_i W_{t-1}^i w_t^i is Z-hat of (2.22). Returns the new log
        weights, finished flags and potentials (None while no twist was set); the tests override it to show that a
        wrong rule fails on both backends."""
        inc = torch.where(st.finished, torch.zeros_like(out.log_w), out.log_w)
        now_done = st.finished | out.done if out.done is not None else st.finished
        st.twisted = st.twisted or out.log_psi is not None
        psi = None
        if st.twisted:
            prev = st.prev_psi
            psi = prev if out.log_psi is None else torch.as_tensor(out.log_psi, device=st.device).float().expand(st.N)
            psi = torch.where(now_done, torch.zeros_like(psi), psi)
            delta = torch.where(torch.isneginf(prev), torch.zeros_like(psi), psi - prev)
            inc = torch.where(torch.isneginf(inc), inc, inc + delta)
        return st.lw + inc, now_done, psi

    def _records(self, st: LoopState, kernel: Any) -> tuple[int, list, list, torch.Tensor]:
        """(steps, ESS per step, resampled per step, ancestry ``[steps, N]``); on the device policy the one sync of the
        run, which raises the errors its steps flagged (in step order)."""
        G = self.groups
        if st.sync:
            return st.t, st.ess, st.resampled, torch.stack(st.ancestry)
        flags = st.flags.cpu()
        done_at = flags[:, 2].nonzero()
        steps = int(done_at[0]) + 1 if len(done_at) else flags.shape[0]
        for t in range(steps):
            if flags[t, 0]:
                raise kernel.flag_error(t)
            if flags[t, 1]:
                raise NumericalError(f"NaN or +inf weights after step {t} of {kernel.name} (a log-probability is NaN "
                                     "or +inf)")
            if flags[t, 3:].any():
                raise ZeroWeightsError(self._zero_message(flags[t, 3:].tolist(), t, kernel.name,
                                                           getattr(kernel, "guide", None)))
        ess, resampled = st.ess[:steps].tolist(), st.resampled[:steps].tolist()
        if G == 1:
            ess, resampled = [e[0] for e in ess], [r[0] for r in resampled]
        return steps, ess, resampled, st.ancestry[:steps].clone()

    def _resample(self, lw: torch.Tensor, need: list[bool] | torch.Tensor, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ancestors ``[G * n]`` and new log weights: each group in ``need`` resamples within its own rows
        (:func:`~ppl_thought.inference.resampling.resample_groups`; the tests override this to show that a
        wrong move fails). ``need`` a host list (host policy) or a bool tensor ``[G]`` decided on the device (device
        policy: fixed shapes, multinomial by inverse CDF, no host sync)."""
        return resample_groups(lw, need, self.groups, self.resampling, self.generator,
                               inverse_cdf=isinstance(need, torch.Tensor))

    def _zero_message(self, zero: list, t: int, name: str, guide: Any = None) -> str:
        """The one zero-weight message (:func:`~ppl_thought.errors.zero_weights_message`), naming the guide or the
        bootstrap and, in a grouped run, the group."""
        n, where, q = self.num_particles, f"after step {t} of {name}", describe_proposal(guide)
        if self.groups == 1:
            return zero_weights_message("SMC", n, q, where=where)
        bad = [g for g, z in enumerate(zero) if z]
        return zero_weights_message("SMC", n, q, where=where, group=f"of group {bad[0]} (rows {bad[0] * n}.."
                                    f"{bad[0] * n + n - 1}" + (f"; also groups {bad[1:]}" if len(bad) > 1 else "")
                                    + f") of {self.groups} ")

    @staticmethod
    def _check(sm: dict, sg: dict, N: int, versions: list, name: str, gname: str, where: str) -> None:
        """The contract at the end of ``init`` and of each step (docs/architecture.md, "The contract"): the state
        entries of model and guide (:func:`~ppl_thought.contract.check_state`) and the caller's arguments
        (:func:`~ppl_thought.contract.check_args`); types, shapes and version counters only, no host sync."""
        check_state(sm, N, name, where)
        check_state(sg, N, gname, where)
        check_args(versions, name, where)

    @staticmethod
    def _record(values: dict, seen: dict, new: dict, where: str) -> None:
        for k, vd in new.items():
            if k in seen:
                raise ProgramError(f"site {k!r} is sampled in {seen[k]} and again in {where}: site names must be "
                                   "unique across the steps of a program, e.g. pyro.sample(f'z_{t}', ...)")
            seen[k] = where
            values[k] = [vd]


class GenericKernel:
    """The step kernel of SMC for any program (``backend="generic"``): the guide's step (or the model's own sample
    statements) and the model's step replayed on it, through Pyro traces
    (:func:`~ppl_thought.inference.particles.run_step`: the site contract), the state and argument checks, finished
    particles' state frozen; the host policy (``sync=True``: one host sync per step, in :meth:`SMC._step`)."""

    sync = True

    def __init__(self, smc: SMC, model: Any, guide: Any, args: tuple, kwargs: dict):
        self.model, self.guide, self.args, self.kwargs = model, guide, args, kwargs
        self.N = N = smc.num_particles * smc.groups  # rows: group g holds rows g*n .. g*n + n - 1
        self.max_steps = smc.max_steps
        depth = max(int(getattr(model, "max_plate_nesting", 0) or 0),
                    int(getattr(guide, "max_plate_nesting", 0) or 0) if guide is not None else 0)
        self.dim = -(depth + 1)
        self.device = engine_device(model, guide, args, kwargs)
        self.plate = particle_plate(N, self.dim, smc.groups, self.device)
        self.G = smc.groups
        self.sm: dict = {}
        self.sg: dict = {}
        self.name = program_name(model)
        self.gname = f"the guide {program_name(guide)} of {self.name}"
        self.versions = arg_versions(args, kwargs)  # engines never write into the caller's tensors (check_args)
        self.values: dict[str, list] = {}
        self.seen: dict[str, str] = {}
        self.token_steps = 0
        self.loop: LoopState | None = None

    def compile(self, body):
        return body

    def _check(self, where: str) -> None:
        SMC._check(self.sm, self.sg, self.N, self.versions, self.name, self.gname, where)

    def start(self) -> None:
        """``init`` of model and guide; the loop state on the engine's device, with init's log weights."""
        model, guide, args, kwargs, sm, sg = self.model, self.guide, self.args, self.kwargs, self.sm, self.sg
        out = run_step(lambda: model.init(sm, *args, **kwargs),
                       (lambda: guide.init(sg, *args, **kwargs)) if guide is not None else None, self.N, self.dim,
                       "in init", self.plate, self.device, who=self.name, check=lambda: self._check("in init"))
        lw = out.log_w.clone()
        dev = lw.device if self.device is None else self.device
        self.device = dev
        self.loop = LoopState(self.N, self.G, dev, sync=True)
        self.loop.lw = lw.to(dev)
        SMC._record(self.values, self.seen, out.values, "init")
        self.token_steps = out.token_steps

    def bound(self) -> int:
        return step_bound(self.model, self.max_steps, self.name)

    def propose(self, st: LoopState) -> Proposal:
        model, guide, args, kwargs, sm, sg, t = self.model, self.guide, self.args, self.kwargs, self.sm, self.sg, st.t
        # a finished particle's state keeps its values however the step writes it (in place or not)
        before = (snapshot_state(sm), snapshot_state(sg)) if st.any_finished else None
        where = f"in step {t}"
        out = run_step(lambda: model.step(sm, t, *args, **kwargs),
                       (lambda: guide.step(sg, t, *args, **kwargs)) if guide is not None else None,
                       self.N, self.dim, where, self.plate, st.device, who=self.name,
                       check=lambda: self._check(where))
        if before is not None:
            freeze_finished(before[0], sm, st.finished)
            freeze_finished(before[1], sg, st.finished)
        SMC._record(self.values, self.seen, out.values, f"step {t}")
        self.token_steps += out.token_steps
        done = as_done(out.done, self.N, st.device, self.name, where)
        return Proposal(out.log_w.to(st.device), done, out.log_psi, traces=out.traces)

    def reorder(self, idx: torch.Tensor | None) -> None:
        """Every entry of the programs' states and the recorded site values, gathered by the ancestors ``idx``."""
        if idx is None:
            return
        reorder_state(self.sm, idx, self.N)
        reorder_state(self.sg, idx, self.N)
        for entries in self.values.values():
            for j, (v, d) in enumerate(entries):
                if d is not None:
                    entries[j] = (v.index_select(d, idx.to(v.device)), d)

    def samples(self, steps: int) -> dict:
        samples = {k: (v.movedim(d, 0) if d is not None else v) for k, [(v, d)] in self.values.items()}
        samples.update(self.model.outputs(self.sm, *self.args, **self.kwargs))
        return samples

    def stats(self, steps: int) -> dict:
        return {"token_steps": self.token_steps, "particle_steps": self.token_steps * self.N,
                "mode": _decoding_mode(self.sm)}


def _decoding_mode(state: dict) -> str | None:
    for v in state.values():
        if isinstance(v, LMState):
            return "valid" if v.context is None else "recompute"
    return None


__all__ = ["SMC", "RESAMPLING", "resample"]  # resample, RESAMPLING: defined in inference/resampling.py
