"""``pt.Program``: the step-wise program protocol every engine speaks (docs/architecture.md, "How a program is
written").

A program is Pyro's ``SMCFilter`` protocol, batched over particles::

    class Program(pt.Program):
        def init(self, state, *args, **kwargs): ...          # set up state (tensors [n, ...], LM states)
        def step(self, state, t, *args, **kwargs): ...       # ordinary Pyro code for step t = 0, 1, ...
            # return None to go on, or a bool tensor [n] marking the particles that are finished

Both methods are ordinary Pyro code (``pyro.sample``, ``pyro.sample(..., obs=...)``, ``pyro.factor``)
that an engine runs once for all particles under a particle plate. ``state`` is a dict the engine
owns: its entries are tensors ``[num_particles, ...]`` or objects with ``reorder(index)`` (KV-cached LM
states, :class:`~ppl_thought.distributions.LMState`), and the engine reorders every entry after
resampling. Site names must be unique across steps (``f"z_{t}"``). The rest of the contract (site batch
shapes ``[n]``, frozen finished particles, read-only arguments) and its checks: :mod:`ppl_thought.contract`.

``pt.twist(log_psi)`` inside a step sets a potential log psi_t ``[n]`` on the particles (LLaMPPL's
idea): SMC multiplies the incremental weight by psi_t / psi_{t-1} and divides the last potential out
when a particle finishes, so Z-hat stays unbiased for the untwisted program whatever psi is (the
twist only moves variance). Run as a plain Pyro function (Importance, SVI, ``pyro.infer.Predictive``)
the twists cancel, so they are not applied at all.

A program is also a plain Pyro model: ``program(*args)`` runs ``init`` and every step in one trace,
with the batch of the enclosing particle plate (:func:`particles`), masking each finished particle's
later sites.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyro
import pyro.poutine as poutine
import torch
from pyro.poutine.runtime import _PYRO_STACK

from ppl_thought import checks
from ppl_thought.contract import (  # noqa: F401 -- the contract's names, re-exported where programs live
    PARTICLES,
    SHARED_SCALARS,
    SiteContract,
    arg_versions,
    as_done,
    as_twist,
    check_args,
    check_state,
    freeze_finished,
    program_name,
    site_batch_error,
    snapshot_state,
    step_bound,
)
from ppl_thought.errors import PPLThoughtError, ProgramError
from ppl_thought.lm.base import lm_device
from ppl_thought.projections.token_lift import check_tokenizer
from ppl_thought.twists import current as current_twists
from ppl_thought.validation import not_checked

__all__ = ["OUTPUT", "PARTICLES", "PARTICLE_PLATES", "OneTokenStep", "Program", "Shared", "SiteContract",
           "arg_versions", "as_done", "as_twist", "check_args", "check_state", "factor", "freeze_finished",
           "is_output", "observe", "particle_frame", "particle_groups", "particles", "program_name", "reorder_state",
           "sample", "site_batch_error", "snapshot_state", "step_bound", "twist"]


# ---------------------------------------------------------------------------------------------- the four verbs
#: the ``infer`` key that marks an output site: ``pt.observe(name, fn, None)``, a value the program generates
OUTPUT = "output"


def _check_site(verb: str, name, fn) -> None:
    """The site name and distribution of a verb (docs/architecture.md, "Validation at the boundary"): a
    :class:`ProgramError` naming the argument, the value and what is expected, where Pyro would fail later with
    ``'NoneType' object is not callable`` or an AttributeError. Two ``isinstance`` checks: cheap enough for a
    call per step."""
    if not isinstance(name, str):
        raise ProgramError(f"pt.{verb}: name must be a site name (a str), got {type(name).__name__} {name!r}"[:300])
    if not isinstance(fn, torch.distributions.Distribution | pyro.distributions.Distribution):
        raise ProgramError(f"pt.{verb}({name!r}, fn): fn must be a distribution (a pyro.distributions or "
                           f"torch.distributions instance, e.g. pt.dist.LMSequence), got {type(fn).__name__} "
                           f"{fn!r}"[:300])


def _as_tensor(verb: str, what: str, value, name: str) -> torch.Tensor:
    """``torch.as_tensor(value)``, or a :class:`ProgramError` naming the argument for what torch cannot read
    (``None``, a string, an object)."""
    if isinstance(value, str | bytes):
        raise ProgramError(f"pt.{verb}({name!r}, ...): {what} must be a tensor or a number, got "
                           f"{type(value).__name__} {value!r}"[:300])
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ProgramError(f"pt.{verb}({name!r}, ...): {what} must be a tensor or a number, got "
                           f"{type(value).__name__} {value!r} ({type(e).__name__}: {e})"[:300]) from None


def _site_error(verb: str, name: str, e: ValueError) -> ProgramError:
    """A bare ``ValueError`` of Pyro's or torch's argument validation at a site (a NaN log factor, an observed
    value outside the support) as a :class:`ProgramError` naming the verb and the site (the verbs re-raise the
    library's own errors unchanged; a ``try`` costs nothing when nothing is raised)."""
    return ProgramError(f"pt.{verb}({name!r}, ...): {e}"[:500])


@not_checked("a step verb: called once per site per step inside every engine")
def sample(name: str, fn, **kwargs) -> torch.Tensor:
    """A latent site: ``pyro.sample(name, fn, **kwargs)`` (a guide proposes it; without one the program does).

    ``pt.sample``, :func:`observe`, :func:`factor` and :func:`twist` are the four verbs of a program; they are
    Pyro's primitives under the names of the theory, so Pyro code and Pyro handlers keep working on them.
    ``name`` must be a str and ``fn`` a distribution (:class:`~ppl_thought.errors.ProgramError` otherwise).
    A ``Categorical`` / ``OneHotCategorical`` / ``Bernoulli`` built with ``probs=`` is scored exactly (torch clamps
    its probabilities at float32 eps), other clamping ``probs=`` sites are flagged once with a warning
    (:mod:`ppl_thought.distributions.unclamped`).
    """
    _check_site("sample", name, fn)
    fn = unclamped(fn, name)  # probs= scored exactly, not at torch's clamp (distributions/unclamped.py)
    try:
        return pyro.sample(name, fn, **kwargs)
    except ValueError as e:
        if isinstance(e, PPLThoughtError):
            raise
        raise _site_error("sample", name, e) from e


@not_checked("a step verb: called once per site per step inside every engine")
def observe(name: str, fn, value) -> torch.Tensor:
    """Condition on data: ``pyro.sample(name, fn, obs=value)``; its log-probability enters every weight.

    ``value=None`` makes the site an *output*: the program draws it from ``fn`` (no guide proposes it and its
    log-probability is left out of the weights, where p/q cancels), engines return it in ``Result.samples``
    and decoding reads it (the continuation of a prompt, (3.12)). So one program both scores data and
    generates it: ``pt.observe(f"x_{t}", d, x[t] if t < len(x) else None)``.
    """
    _check_site("observe", name, fn)
    fn = unclamped(fn, name)  # probs= scored exactly, not at torch's clamp (distributions/unclamped.py)
    if value is None:
        try:
            return pyro.sample(name, fn, infer={OUTPUT: True})
        except ValueError as e:
            if isinstance(e, PPLThoughtError):
                raise
            raise _site_error("observe", name, e) from e
    v = _as_tensor("observe", "value", value, name)
    # one value for every particle: broadcast it over the batch (a ragged sequence site keeps its own width)
    shape = tuple(fn.batch_shape) + (tuple(v.shape[-1:]) if getattr(fn, "ragged_event", False) and fn.event_shape
                                      else tuple(fn.event_shape))
    if v.shape != shape:
        try:
            v = v.expand(shape)
        except RuntimeError:
            pass  # the distribution's own check names the problem
    try:
        return pyro.sample(name, fn, obs=v)
    except ValueError as e:
        if isinstance(e, PPLThoughtError):
            raise
        raise _site_error("observe", name, e) from e


@not_checked("a step verb: called once per step inside every engine")
def factor(name: str, log_factor) -> None:
    """Multiply the program's density by exp(log_factor) ``[n]`` (``pyro.factor``): a hard constraint is
    ``torch.where(ok, 0., -inf)``, a soft one any log-potential. Unlike :func:`twist` it changes the target.
    ``name`` must be a str and ``log_factor`` a real tensor or number (:class:`~ppl_thought.errors.ProgramError`
    otherwise; a bool or integer factor is read as a float)."""
    if not isinstance(name, str):
        raise ProgramError(f"pt.factor: name must be a site name (a str), got {type(name).__name__} {name!r}"[:300])
    lf = _as_tensor("factor", "log_factor", log_factor, name)
    if not lf.is_floating_point():
        if lf.is_complex():
            raise ProgramError(f"pt.factor({name!r}, ...): log_factor must be real, got dtype {lf.dtype}")
        lf = lf.to(torch.get_default_dtype())
    try:
        pyro.factor(name, lf)
    except ValueError as e:
        if isinstance(e, PPLThoughtError):
            raise
        raise _site_error("factor", name, e) from e


def is_output(site: dict) -> bool:
    """Whether a trace site is an output (:func:`observe` with ``value=None``)."""
    return bool((site.get("infer") or {}).get(OUTPUT, False))


# ---------------------------------------------------------------------------------------------- twists
@not_checked("a step verb: called once per step inside every engine")
def twist(log_psi) -> None:
    """Set the potential log psi_t ``[n]`` of the particles at this step (SMC adds it now, removes it later).

    Several calls in one step add up. Outside an engine that steps the program (e.g. Importance,
    which runs whole traces) the potential cancels and nothing is done.
    """
    collector = current_twists()
    if collector is None:
        return
    lp = torch.as_tensor(log_psi)
    if torch.is_floating_point(lp) and torch.isnan(lp).any():
        raise ProgramError("pt.twist got NaN: a twist is a log-potential, -inf is allowed, NaN is not")
    collector.add(lp)


# ---------------------------------------------------------------------------------------------- plates
#: plates that batch whole runs of a program: ours, and those of pyro's vectorised ELBOs / Importance
#: (``vectorize_particles=True``) and ``Predictive(parallel=True)``
PARTICLE_PLATES = (PARTICLES, "num_particles_vectorized", "_num_predictive_samples")


def particle_frame():
    """The innermost enclosing particle plate (:data:`PARTICLE_PLATES`), or None."""
    for frame in reversed(_PYRO_STACK):
        if getattr(frame, "name", None) in PARTICLE_PLATES and hasattr(frame, "size"):
            return frame
    return None


@not_checked("a step verb: read once per step inside every engine")
def particles() -> int:
    """The number of particles of the enclosing particle plate (``pyro.plate("particles", n)``, or the
    plate of a vectorised Pyro ELBO / ``Predictive(parallel=True)``), else 1."""
    frame = particle_frame()
    return 1 if frame is None else int(frame.size)


@not_checked("a step verb: read once per step inside every engine")
def particle_groups() -> int:
    """The number G of independent particle groups of the enclosing particle plate, else 1.

    Inside ``SMC(n, groups=G)`` the plate has ``G * n`` rows and row ``r`` belongs to group ``r // n``
    (G independent SMC runs batched into one, e.g. one per observation sequence): a program maps its
    rows to its data with ``x.repeat_interleave(pt.particles() // pt.particle_groups(), 0)``. Every
    other engine (and a plain plate) runs one group.
    """
    frame = particle_frame()
    return 1 if frame is None else int(getattr(frame, "groups", 1))


# ---------------------------------------------------------------------------------------------- state
@not_checked("a state entry the engines build and reorder once per step")
class Shared:
    """A state entry shared by every particle (a lifting automaton, a table): resampling leaves it alone.

    ``state["lift"] = pt.Shared(automaton)``; read it back with ``state["lift"].value``.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def reorder(self, index: torch.Tensor) -> Shared:
        return self

    def __repr__(self) -> str:
        return f"Shared({self.value!r})"


def reorder_state(state: dict, index: torch.Tensor, n: int) -> None:
    """Gather every entry of ``state`` by the ancestor ``index`` (in place): tensors ``[n, ...]`` by
    indexing, objects by their ``reorder(index)`` (its return value replaces the entry if not None),
    dicts entry by entry, shared scalars (0-dim tensors, Python scalars) left alone. The engines check
    the entries at the end of each step (:func:`~ppl_thought.contract.check_state`, which refuses lists
    and tuples), so anything else here is an error naming the key."""
    for key in list(state):
        state[key] = _reorder(state[key], index, n, key)


def _reorder(v: Any, index: torch.Tensor, n: int, key: str):
    if isinstance(v, torch.Tensor):
        if v.ndim == 0:
            return v
        if v.shape[0] != n:
            raise ProgramError(f"state[{key!r}] is a tensor of shape {tuple(v.shape)}: state tensors must be "
                               f"[num_particles={n}, ...] so that resampling can reorder them (keep shared "
                               "constants on the program object)")
        return v[index.to(v.device)]
    if hasattr(v, "reorder"):
        out = v.reorder(index)
        return v if out is None else out
    if isinstance(v, dict):
        return {k: _reorder(w, index, n, f"{key}.{k}") for k, w in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_reorder(w, index, n, f"{key}[{i}]") for i, w in enumerate(v))
    if v is None or isinstance(v, (int, float, str, bool)):
        return v
    raise ProgramError(f"state[{key!r}] of type {type(v).__name__} cannot be reordered after resampling: "
                       "store tensors [num_particles, ...] or objects with reorder(index)")


# ---------------------------------------------------------------------------------------------- program
@dataclass(frozen=True)
class OneTokenStep:
    """The one protocol between a token-level program and the token-level engines: "my step is one token of one LM
    under a token automaton" (:meth:`Program.one_token_step`; docs/architecture.md, "Engines"). Every engine that
    needs a token-level program reads only this: ``SMC(backend="static")`` (inference/static_smc.py), greedy and
    beam search (inference/search.py) and the verifier engines (``pt.verifiers``). Step t of such a program:

        log w_t = log_mass(logits, s, done)      the step's weight ``[n]`` (0 for ended rows), a pyro.factor
        z_t ~ masked softmax of ``rule`` (Def 2.8), the rule state advanced (``token_step``)
        a row ends in a final state of ``rule``, after a token in ``stop_ids``, or after ``max_tokens`` tokens

    With the default ``log_mass`` (``None``: :meth:`mass`, the LM's mass on the admitted tokens, the factor log Z_t
    of Section 3.3) the program's unnormalised density is p_LM(z) 1[z admitted by ``rule``], its normaliser
    Z = P_LM(A): the target of every engine above (``pt.models.Constrained`` and ``pt.verifiers.VerifiedLM`` are
    such programs). The program's own ``step`` must do exactly this (the engines give the same law as running it).

    Attributes:
        lm: the LM (``lm(tokens) -> (logits, cache)``) whose next-token logits are read.
        rule: the :class:`~ppl_thought.distributions.TokenRule` of the automaton (the constraint A).
        max_tokens: the most tokens a particle draws (the number of steps).
        stop_ids: token ids after which a particle ends (default ``<eos>``).
        log_mass: ``log_mass(logits [n, V], s [n], done [n]) -> [n]``, the step's log weight; ``None``: :meth:`mass`.
        twist: the program's twist (``pt.twist`` on the token prefix), if any; the static backend runs none.
        prompt: ``prompt(*args, **kwargs) -> ids [P] | None``: the prompt token ids from the run's arguments;
            ``None``: the run's first positional argument, or its ``prompt=`` keyword, or no prompt.
    """

    lm: Any
    rule: Any
    max_tokens: int
    stop_ids: tuple[int, ...] = (2,)  # EOS_ID (ppl_thought.vocab)
    log_mass: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    twist: Callable[[torch.Tensor], torch.Tensor] | None = None
    prompt: Callable[..., Any] | None = None

    @staticmethod
    def of(program: Any, engine: str) -> OneTokenStep:
        """``program.one_token_step()``, or a :class:`~ppl_thought.errors.ConfigError` for ``engine`` that names the
        method to implement (the one check every token-level engine runs)."""
        spec = checks.one_token_step(program, engine, OneTokenStep,
                                     "pt.models.Constrained and pt.verifiers.VerifiedLM")
        name = type(program).__name__
        check_tokenizer(getattr(spec.rule, "constraint", None), spec.lm, f"{engine} on {name}")
        return spec

    def prompt_ids(self, args: tuple, kwargs: dict) -> Any:
        """The prompt token ids of a run on ``*args, **kwargs`` (see ``prompt``)."""
        if self.prompt is not None:
            return self.prompt(*args, **kwargs)
        return kwargs["prompt"] if "prompt" in kwargs else (args[0] if args else None)

    def mass(self, logits: torch.Tensor, s: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """The step's log weight ``[n]``: ``log_mass`` if given, else log Z_t, the log of the LM's mass on the tokens
        ``rule`` admits in states ``s`` over its mass on every token it may generate (Def 2.8's normaliser; -inf, not
        NaN, where it can generate none); 0 for ended rows."""
        if self.log_mass is not None:
            return self.log_mass(logits, s, done)
        free = self.__dict__.get("_free")
        if free is None:
            free = type(self.rule)(None, self.rule.vocab_size)
            object.__setattr__(self, "_free", free)
        log_z = log_mass_ratio(self.rule, free, logits, s)  # exact for huge logits; kept for the draw
        return torch.where(done, torch.zeros_like(log_z), log_z)

    def stop_tensor(self, device: Any) -> torch.Tensor:
        """``stop_ids`` as a long tensor on ``device`` (kept per device)."""
        key = f"_stops_{device}"
        t = self.__dict__.get(key)
        if t is None:
            t = torch.tensor(self.stop_ids, dtype=torch.long, device=device)
            object.__setattr__(self, key, t)
        return t

    def ends(self, tok: torch.Tensor, s_new: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(finished, ended) ``[n]`` after ``tok`` took rows to states ``s_new`` with ``lengths`` tokens: finished in a
        final state of ``rule`` or after a stop id (the string is complete), ended: finished or ``max_tokens`` reached
        (the row draws no more)."""
        tabs = self.rule.end_tables(None, s_new.device)  # one gather when the rule's state is one automaton state
        final = self.rule.is_final(s_new) if tabs is None else tabs[1][s_new]
        done = final | torch.isin(tok, self.stop_tensor(tok.device))
        return done, done | (lengths >= self.max_tokens)


@not_checked("the step protocol's base class: users subclass it, engines call its methods per step")
class Program:
    """Base class of step-wise programs (see the module docstring).

    Class attributes an engine reads:

    * ``max_plate_nesting``: plates the program uses itself inside a step (the particle plate goes
      left of them); 0 by default.
    * ``max_steps``: a bound on the number of steps (engines raise past it), an int >= 1; ``None``: the
      engine's bound.
    """

    max_plate_nesting: int = 0
    max_steps: int | None = None

    def __init_subclass__(cls, **kwargs) -> None:
        """A class attribute ``max_steps`` must be None or an int >= 1 (checked where the class is written; an
        instance's, e.g. set in ``init`` from the data, is checked by the engines, :func:`step_bound`)."""
        super().__init_subclass__(**kwargs)
        v = cls.__dict__.get("max_steps")
        if v is not None and not isinstance(v, property) and (
                isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral) or v < 1):
            raise ProgramError(f"{cls.__name__}.max_steps must be an integer >= 1 (the most steps a run may take) "
                               f"or None, got {type(v).__name__} {v!r}"[:300])

    @property
    def device(self) -> torch.device | None:
        """The device the program computes on; engines make their particle plate and weights there.

        Set it (``program.device = "cuda"``) or let it follow the program's LMs: by default it is the device
        of the first ``torch.nn.Module`` stored on the program, else that of a program stored on it (a guide
        wrapping its model), else ``None`` (the engine then uses its data's device, or the CPU).
        """
        dev = self.__dict__.get("_device")
        if dev is not None:
            return dev
        inner = None
        for v in vars(self).values():
            if isinstance(v, torch.nn.Module):
                return lm_device(v)
            if inner is None and isinstance(v, Program) and v is not self:
                inner = v
        return None if inner is None else inner.device

    @device.setter
    def device(self, value) -> None:
        self._device = None if value is None else torch.device(value)

    def init(self, state: dict, *args, **kwargs) -> None:
        """Set up ``state`` before step 0 (may sample sites; default: nothing)."""

    def step(self, state: dict, t: int, *args, **kwargs):
        """Step ``t``: Pyro code for all particles at once; return None or finished flags ``[n]``."""
        raise NotImplementedError(f"{type(self).__name__} must define step(self, state, t, *args, **kwargs)")

    def outputs(self, state: dict, *args, **kwargs) -> dict:
        """Extra values for ``Result.samples`` read from the final state (default: none)."""
        return {}

    def one_token_step(self) -> OneTokenStep | None:
        """The program's step as one token of one LM under a token automaton (:class:`OneTokenStep`): the one protocol
        method every token-level engine reads (``SMC(backend="static")``, which runs it as one fixed step on a static
        KV cache; ``pt.infer.greedy`` / ``beam_search``; the verifier engines of ``pt.verifiers``). ``None`` (the
        default): not such a program (those engines then raise a ConfigError naming this method)."""
        return None

    # -- as a plain Pyro model -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Run ``init`` and every step in one trace (Importance, SVI, ``pyro.infer.Predictive``)."""
        return run_whole(self, *args, **kwargs)


def run_whole(program: Program, *args, max_steps: int = 10_000, **kwargs) -> dict:
    """Run a program from start to finish as one Pyro trace, masking the sites of finished particles.

    Returns the final state. Twists are not applied (they cancel over a whole run). Checks the contract as
    SMC does (docs/architecture.md, "The contract"): site batch shapes (:class:`SiteContract`), finished flags,
    state entries (:func:`check_state`), ``max_steps`` (:func:`step_bound`) and the caller's arguments
    (:func:`check_args`); a finished particle's state is frozen (:func:`freeze_finished`).
    """
    n = particles()
    who = program_name(program)
    versions = arg_versions(args, kwargs)
    state: dict = {}
    with SiteContract(who, "in init"):
        program.init(state, *args, **kwargs)
    check_state(state, n, who, "in init")
    check_args(versions, who, "in init")
    finished = None
    bound = step_bound(program, max_steps, who)
    t = 0
    while True:
        if t >= bound:
            raise ProgramError(f"{who} did not finish within max_steps={bound} steps")
        where = f"in step {t}"
        before = snapshot_state(state) if finished is not None else None
        with _masked(finished), SiteContract(who, where):
            done = as_done(program.step(state, t, *args, **kwargs), n, None, who, where)
        check_state(state, n, who, where)
        check_args(versions, who, where)
        if finished is not None:
            freeze_finished(before, state, finished)
        if done is not None:
            finished = done if finished is None else finished | done.to(finished.device)
            if bool(finished.all()):
                return state
        t += 1


@contextmanager
def _masked(finished: torch.Tensor | None):
    if finished is None:
        yield
        return
    with poutine.mask(mask=_plate_mask(~finished)):
        yield


def _plate_mask(active: torch.Tensor) -> torch.Tensor:
    """The per-particle mask shaped for the particle plate's dim (right-aligned batch dims)."""
    frame = particle_frame()
    if frame is None or getattr(frame, "dim", None) is None:
        return active
    return active.reshape((-1,) + (1,) * (-frame.dim - 1))


def sample_site_names(trace) -> list[str]:
    return [k for k, s in trace.nodes.items() if s["type"] == "sample"]


def is_program(obj) -> bool:
    return isinstance(obj, Program) or (callable(getattr(obj, "init", None)) and callable(getattr(obj, "step", None))
                                        and not isinstance(obj, type))


def pyro_module(name: str, module: torch.nn.Module) -> None:
    """``pyro.module(name, module)`` for the trainable parameters of ``module`` only: a frozen parameter
    (``requires_grad`` False) is never a param site of the trace, and a frozen module registers nothing. Unlike
    ``pyro.module`` it names no frozen weight: Pyro warns once per frozen weight of a module in training mode, and
    lists every registered weight in the trace-shape table of an error raised inside a program."""
    from pyro.params.param_store import param_with_module_name

    for key, p in module.named_parameters():
        if p.requires_grad:
            pyro.param(param_with_module_name(name, key), p)


# imported last: ppl_thought.distributions imports this module (its registry reads pyro_module), so these names are
# bound once everything above exists, whichever of the two modules is imported first
from ppl_thought.distributions.token_rule import log_mass_ratio  # noqa: E402
from ppl_thought.distributions.unclamped import unclamped  # noqa: E402
