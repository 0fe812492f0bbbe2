"""Sequential Monte Carlo over the steps of any program (Lemma 2.1 for slow-thinking models), with
adaptive resampling and twists written in the program (``pt.twist``).

A latent z in the lifting of x decomposes uniquely as z = z^(1) ... z^(|x|) with z^(t) in
Phi_{x<t}(z^(<t), x_t) (Lemma 2.1): :class:`~ppl_thought.models.SlowThinking` is a
:class:`~ppl_thought.program.Program` whose step t samples segment z^(t) (site ``f"z_{t}"``) and
checks x_t. Any other program works the same way: the engine only sees the sites of each step.
The particles of a step decode their segments in one lockstep loop
(:class:`~ppl_thought.distributions.lm_state.LMState`: a particle that ended its segment waits,
feeding nothing), and only then are weights updated and particles resampled (KV caches gathered
with ``cache.reorder``). The one-step runner and the site check live in
:mod:`ppl_thought.inference.particles`.
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
    check_steps,
    engine_device,
    infinite_sites,
    particle_plate,
    require_program,
    run_step,
)
from ppl_thought.inference.resampling import RESAMPLING, check_scheme, resample, resample_groups
from ppl_thought.inference.result import Result
from ppl_thought.inference.static_smc import run_static
from ppl_thought.program import reorder_state
from ppl_thought.validation import checked
from ppl_thought.weights import effective_sample_size, log_mean_exp

#: how a run is executed: Pyro traces of any program, or the static one-token step (inference/static_smc.py)
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
        backend: ``"generic"`` (default: any program, through Pyro traces) or ``"static"``: for programs whose
            step is one LM token under a token automaton (:class:`~ppl_thought.models.Constrained`), the
            per-token work (LM step on a static KV cache, mask, sampling, weight update, resampling decided
            and gathered on the device) as one fixed step with no host sync until the end
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

    def run(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> Result:  # require_program checks it
        """Run SMC over the steps of ``model``; see the class docstring."""
        require_program(model, "model")
        if self.backend == "static":

            return run_static(self, model, guide, args, kwargs)
        check_compatible(model, guide)
        check_steps(model, guide)
        guide = as_step_guide(guide)
        require_program(guide, "guide")
        try:
            with torch.no_grad(), poutine.block():
                return self._run(model, guide, args, kwargs)
        except NotInImageError as e:
            res = not_in_image_result(f"log p(x) = -inf: {e}", self.num_particles * self.groups, "SMC",
                                       {"args": args, "kwargs": kwargs})
            if self.groups > 1:
                res.log_weights = res.log_weights.view(self.groups, self.num_particles)
                res.log_marginal = res.log_marginal.expand(self.groups)
            return res

    def _run(self, model, guide, args, kwargs) -> Result:
        n, G = self.num_particles, self.groups
        N = G * n  # rows: group g holds rows g*n .. g*n + n - 1
        depth = max(int(getattr(model, "max_plate_nesting", 0) or 0),
                    int(getattr(guide, "max_plate_nesting", 0) or 0) if guide is not None else 0)
        dim = -(depth + 1)
        device = engine_device(model, guide, args, kwargs)
        plate = particle_plate(N, dim, G, device)
        sm: dict = {}
        sg: dict = {}
        name = program_name(model)
        gname = f"the guide {program_name(guide)} of {name}"
        versions = arg_versions(args, kwargs)  # engines never write into the caller's tensors (check_args)
        out = run_step(lambda: model.init(sm, *args, **kwargs),
                       (lambda: guide.init(sg, *args, **kwargs)) if guide is not None else None, N, dim, "in init",
                       plate, device, who=name, check=lambda: self._check(sm, sg, N, versions, name, gname, "in init"))
        lw = out.log_w.clone()
        dev = lw.device if device is None else device
        lw = lw.to(dev)
        # read after init: a program may set its number of steps from the data there
        bound = step_bound(model, self.max_steps, name)
        values: dict[str, list] = {}
        seen: dict[str, str] = {}
        self._record(values, seen, out.values, "init")
        finished = torch.zeros(N, dtype=torch.bool, device=dev)
        any_finished = twisted = False  # host copies, updated at the one sync of each step
        prev_psi = torch.zeros(N, device=dev)
        ancestry, ess_hist, resampled = [], [], []
        token_steps = out.token_steps
        t = 0
        while True:
            if t >= bound:
                raise ProgramError(f"{name} did not finish within max_steps={bound} steps (return a bool tensor "
                                   "[num_particles] from step to mark finished particles)")
            # a finished particle's state keeps its values however the step writes it (in place or not)
            before = (snapshot_state(sm), snapshot_state(sg)) if any_finished else None
            where = f"in step {t}"
            out = run_step(lambda t=t: model.step(sm, t, *args, **kwargs),
                           (lambda t=t: guide.step(sg, t, *args, **kwargs)) if guide is not None else None,
                           N, dim, where, plate, dev, who=name,
                           check=lambda w=where: self._check(sm, sg, N, versions, name, gname, w))
            if before is not None:
                freeze_finished(before[0], sm, finished)
                freeze_finished(before[1], sg, finished)
            self._record(values, seen, out.values, f"step {t}")
            token_steps += out.token_steps
            done = as_done(out.done, N, dev, name, where)
            inc = torch.where(finished, torch.zeros_like(out.log_w), out.log_w.to(dev))
            now_done = finished | done if done is not None else finished
            twisted = twisted or out.log_psi is not None
            if twisted:  # the twist telescopes (pt.twist): add psi_t - psi_{t-1}; 0 once a particle is done
                psi = prev_psi if out.log_psi is None else torch.as_tensor(out.log_psi, device=dev).float().expand(N)
                psi = torch.where(now_done, torch.zeros_like(psi), psi)
                delta = torch.where(torch.isneginf(prev_psi), torch.zeros_like(psi), psi - prev_psi)
                inc = torch.where(torch.isneginf(inc), inc, inc + delta)
                prev_psi = psi
            lw = lw + inc
            finished = now_done
            lwg = lw.view(G, n)
            ess = effective_sample_size(lwg, check=False)  # [G]; checked in the step's one sync
            # the one host sync of the step
            host = torch.cat([torch.stack([(torch.isnan(lw) | torch.isposinf(lw)).any().float(),
                                           finished.all().float(), finished.any().float()]),
                              torch.isneginf(lwg).all(-1).float(), ess.float()]).tolist()
            has_nan, all_done, any_finished = host[0] > 0, host[1] > 0, host[2] > 0
            zero, ess_g = host[3:3 + G], host[3 + G:]
            if has_nan:
                named = infinite_sites(*out.traces)
                where = f" at site(s) {', '.join(named)}" if named else ""
                raise NumericalError(f"NaN or +inf weights after step {t} of {name}: a twist or log-probability "
                                     f"is NaN or +inf{where} (e.g. pyro.factor(name, +inf))")
            out.traces = ()  # checked: the step's traces (and the caches their sites hold) go before resampling
            if any(zero):
                raise ZeroWeightsError(self._zero_message(zero, t, name, guide))
            need = [not all_done and e < self.ess_threshold * n for e in ess_g]
            if any(need):
                idx, lw = self._resample(lw, need, dev)
                reorder_state(sm, idx, N)
                reorder_state(sg, idx, N)
                for entries in values.values():
                    for j, (v, d) in enumerate(entries):
                        if d is not None:
                            entries[j] = (v.index_select(d, idx.to(v.device)), d)
                finished, prev_psi = finished[idx], prev_psi[idx]
                ancestry.append(idx)
            else:
                ancestry.append(torch.arange(N, device=dev))
            ess_hist.append(ess_g[0] if G == 1 else ess_g)
            resampled.append(need[0] if G == 1 else need)
            t += 1
            if all_done:
                break
        samples = {k: (v.movedim(d, 0) if d is not None else v) for k, [(v, d)] in values.items()}
        samples.update(model.outputs(sm, *args, **kwargs))
        lw_out = lw if G == 1 else lw.view(G, n)
        any_resampled = any(r if G == 1 else any(r) for r in resampled)
        return Result(
            samples=samples, log_weights=lw_out, log_marginal=log_mean_exp(lw_out),
            log_marginal_stderr=log_marginal_stderr(lw_out) if not any_resampled else None,
            ancestry=torch.stack(ancestry), observed={"args": args, "kwargs": kwargs}, engine="SMC",
            stats={"ess": ess_hist, "resampled": resampled, "steps": t, "token_steps": token_steps,
                   "particle_steps": token_steps * N, "mode": _decoding_mode(sm), "groups": G},
        )

    def _resample(self, lw: torch.Tensor, need: list[bool], dev) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ancestors ``[G * n]`` and new log weights: each group in ``need`` resamples within its own rows
        (:func:`~ppl_thought.inference.resampling.resample_groups`; the tests override this to show that a
        wrong move fails)."""
        return resample_groups(lw, need, self.groups, self.resampling, self.generator)

    def _zero_message(self, zero: list, t: int, name: str, guide: Any = None) -> str:
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


def _decoding_mode(state: dict) -> str | None:
    for v in state.values():
        if isinstance(v, LMState):
            return "valid" if v.context is None else "recompute"
    return None


__all__ = ["SMC", "RESAMPLING", "resample"]  # resample, RESAMPLING: defined in inference/resampling.py
