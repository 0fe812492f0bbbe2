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
resampling. Site names must be unique across steps (``f"z_{t}"``).

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

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyro
import pyro.poutine as poutine
import torch
from pyro.poutine.runtime import _PYRO_STACK

from ppl_thought.errors import PPLThoughtError, ProgramError
from ppl_thought.lm.base import lm_device
from ppl_thought.twists import current as current_twists
from ppl_thought.validation import not_checked

PARTICLES = "particles"

__all__ = ["OUTPUT", "PARTICLES", "PARTICLE_PLATES", "OneTokenStep", "Program", "Shared", "as_done", "factor",
           "freeze_finished", "is_output", "observe", "particle_frame", "particle_groups", "particles", "reorder_state",
           "sample", "twist"]


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
    """
    _check_site("sample", name, fn)
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


def as_done(done, n: int, device=None) -> torch.Tensor | None:
    """A step's return value as a bool tensor ``[n]`` (``None``: nobody finished)."""
    if done is None:
        return None
    d = torch.as_tensor(done, device=device)
    if d.dtype != torch.bool:
        raise ProgramError(f"Program.step must return None or a bool tensor [num_particles], got dtype {d.dtype}")
    if d.ndim == 0:
        d = d.expand(n)
    if d.shape != (n,):
        raise ProgramError(f"Program.step returned finished flags of shape {tuple(d.shape)}; expected ({n},) "
                           "(one flag per particle)")
    return d


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
    dicts / lists / tuples entry by entry. Anything else is an error naming the key."""
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


def freeze_finished(before: dict, after: dict, finished: torch.Tensor) -> None:
    """Keep the tensor entries of finished particles as they were before the step (in place)."""
    for key, v in after.items():
        old = before.get(key)
        if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and v.shape == old.shape and v.ndim:
            m = finished.to(v.device).reshape((-1,) + (1,) * (v.ndim - 1))
            after[key] = torch.where(m, old, v)


# ---------------------------------------------------------------------------------------------- program
@dataclass(frozen=True)
class OneTokenStep:
    """What a program whose step is one token of one LM under a token automaton tells the static SMC backend
    (:meth:`Program.one_token_step`; inference/static_smc.py, docs/architecture.md). Step t of such a program:

        log Z_t = log_mass(logits, s, done)      the step's weight ``[n]`` (0 for ended rows), a pyro.factor
        z_t ~ masked softmax of ``rule`` (Def 2.8), the rule state advanced
        a row ends in a final state of ``rule``, after a token in ``stop_ids``, or after ``max_tokens`` tokens

    (``pt.models.Constrained`` is one). The program's own ``step`` must do exactly this (the two backends give
    the same particles and weights).

    Attributes:
        lm: the LM (``lm(tokens) -> (logits, cache)``) whose next-token logits are read.
        rule: the :class:`~ppl_thought.distributions.TokenRule` of the automaton.
        max_tokens: the most tokens a particle draws (the number of steps).
        stop_ids: token ids after which a particle ends.
        log_mass: ``log_mass(logits [n, V], s [n], done [n]) -> [n]``, the step's log weight.
        twist: the program's twist (``pt.twist`` on the token prefix), if any; the static backend runs none.
    """

    lm: Any
    rule: Any
    max_tokens: int
    stop_ids: tuple[int, ...]
    log_mass: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    twist: Callable[[torch.Tensor], torch.Tensor] | None = None


@not_checked("the step protocol's base class: users subclass it, engines call its methods per step")
class Program:
    """Base class of step-wise programs (see the module docstring).

    Class attributes an engine reads:

    * ``max_plate_nesting``: plates the program uses itself inside a step (the particle plate goes
      left of them); 0 by default.
    * ``max_steps``: a bound on the number of steps (engines raise past it); ``None``: the engine's bound.
    """

    max_plate_nesting: int = 0
    max_steps: int | None = None

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
        """The program's step as one token of one LM under a token automaton (:class:`OneTokenStep`), which
        ``SMC(backend="static")`` runs as one fixed step on a static KV cache; ``None`` (the default): not such a
        program."""
        return None

    # -- as a plain Pyro model -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Run ``init`` and every step in one trace (Importance, SVI, ``pyro.infer.Predictive``)."""
        return run_whole(self, *args, **kwargs)


def run_whole(program: Program, *args, max_steps: int = 10_000, **kwargs) -> dict:
    """Run a program from start to finish as one Pyro trace, masking the sites of finished particles.

    Returns the final state. Twists are not applied (they cancel over a whole run).
    """
    n = particles()
    state: dict = {}
    program.init(state, *args, **kwargs)
    finished = None
    bound = program.max_steps if program.max_steps is not None else max_steps
    t = 0
    while True:
        if t >= bound:
            raise ProgramError(f"{type(program).__name__} did not finish within max_steps={bound} steps")
        before = dict(state) if finished is not None else None
        with _masked(finished):
            done = as_done(program.step(state, t, *args, **kwargs), n)
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
    """``pyro.module`` for a trainable module (no-op for frozen ones)."""
    if any(p.requires_grad for p in module.parameters()):
        pyro.module(name, module)
