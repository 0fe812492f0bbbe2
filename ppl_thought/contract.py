"""The program contract (docs/architecture.md, "The contract"): what a :class:`~ppl_thought.program.Program`
promises an engine, and the checks the torch engines run at the end of ``init`` and of every step (``run_whole``
for whole traces, ``SMC`` step by step, ``per_particle`` wherever a site's log-probability is weighed).

Each refusal is a :class:`~ppl_thought.errors.ProgramError` that starts with the program's name and the step
(``"Coins in step 0: site 'z_0' has batch shape (64, 64); ..."``). The checks read types, shapes and version
counters only: O(sites + state entries + tensor arguments) per step, no host sync, nothing per token.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

import numpy as np
import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from ppl_thought.errors import ProgramError

#: the name of the particle plate every engine runs a program under (``pyro.plate(PARTICLES, n)``)
PARTICLES = "particles"

__all__ = ["PARTICLES", "SHARED_SCALARS", "SiteContract", "arg_versions", "as_done", "as_twist", "check_args",
           "check_state", "freeze_finished", "program_name", "site_batch_error", "snapshot_state", "step_bound"]


# ---------------------------------------------------------------------------------------------- steps
def as_done(done, n: int, device=None, who: str = "", where: str = "") -> torch.Tensor | None:
    """A step's return value as a bool tensor ``[n]`` (``None``: nobody finished; a 0-dim bool: the same flag for
    every particle). Anything else is a :class:`ProgramError` naming the program ``who`` and the step ``where``."""
    if done is None:
        return None
    at = _at(who, where)
    if isinstance(done, torch.Tensor):  # a tensor on another device: torch's own error (a device bug, not a shape)
        d = done.to(device) if device is not None else done
    else:
        try:
            d = torch.as_tensor(done, device=device)
        except (TypeError, ValueError, RuntimeError):
            raise ProgramError(f"{at}step must return None or a bool tensor [num_particles={n}], got "
                               f"{type(done).__name__} {done!r}"[:300]) from None
    if d.dtype != torch.bool:
        raise ProgramError(f"{at}step must return None or a bool tensor [num_particles={n}], got dtype {d.dtype}")
    if d.ndim == 0:
        d = d.expand(n)
    if d.shape != (n,):
        raise ProgramError(f"{at}step returned finished flags of shape {tuple(d.shape)}; expected ({n},) "
                           "(one flag per particle)")
    return d


def as_twist(log_psi, n: int, who: str = "", where: str = "") -> torch.Tensor | None:
    """The summed ``pt.twist`` potential of a step as a tensor ``[n]`` (a 0-dim potential is the same for every
    particle); any other shape (``[n + 1]``, ``[2, n]``, ``[n, 1]``) is a :class:`ProgramError` naming the
    program and the step (metadata only: no host sync)."""
    if log_psi is None:
        return None
    lp = torch.as_tensor(log_psi)
    if lp.ndim == 0:
        return lp.expand(n)
    if lp.shape != (n,):
        raise ProgramError(f"{_at(who, where)}pt.twist got a potential of shape {tuple(lp.shape)}; expected ({n},) "
                           "(one log psi per particle)")
    return lp


def _at(who: str, where: str) -> str:
    """``"Prog in step 3: "``: the prefix of a contract error naming the program and the step."""
    parts = [p for p in (who, where) if p]
    return (" ".join(parts) + ": ") if parts else ""


def program_name(obj) -> str:
    """A model's or a program's name for error messages: its class name (a function's own name)."""
    if obj is None:
        return "None"
    if isinstance(obj, type) or inspect.isfunction(obj) or inspect.ismethod(obj):
        return obj.__name__
    return type(obj).__name__


def step_bound(program, default: int, who: str | None = None) -> int:
    """The number of steps an engine allows ``program``: its ``max_steps`` (read after ``init``: a program may set
    it from the data), else the engine's ``default``. Either must be an int >= 1 (a numpy integer counts; a float
    such as 2.5, a bool or 0 is a :class:`ProgramError` naming the program)."""
    v = getattr(program, "max_steps", None)
    src = f"{who or program_name(program)}.max_steps"
    if v is None:
        v, src = default, "the engine's max_steps"
    if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral) or v < 1:
        raise ProgramError(f"{src} must be an integer >= 1 (the most steps a run may take) or None, got "
                           f"{type(v).__name__} {v!r}"[:300])
    return int(v)


def site_batch_error(site, who: str = "", where: str = "") -> ProgramError | None:
    """The contract on a site's batch shape (docs/architecture.md, "The contract"): a sample, observe or factor
    site inside the particle plate has batch shape exactly ``[n]`` followed by one dim per plate the program
    declares (``max_plate_nesting``), each the size of a plate the site is in or 1; event dims come after.

    Pyro's plate broadcasts a distribution of batch shape ``[n, 1]`` to ``[n, n]`` (and accepts ``[2, n]``): the
    engine would then sum n (or 2) copies of each particle's log-probability into its weight. Returns the
    :class:`ProgramError` naming the program ``who``, the step ``where`` and the site, or ``None`` when the site
    keeps the contract (and for a site outside the particle plate, a subsample site, or one Pyro enumerates).
    Reads shapes only (host metadata), O(plates) per site."""
    dim, size, plates = None, 0, {}
    for f in site["cond_indep_stack"]:
        if f.name == PARTICLES:
            dim, size = f.dim, f.size
        elif f.vectorized and f.dim is not None:
            plates[f.dim] = f.size
    if dim is None or (site.get("infer") or {}).get("enumerate") == "parallel":
        return None
    fn = site["fn"]
    shape = tuple(getattr(fn, "batch_shape", ()))
    depth = -dim
    if len(shape) == depth and shape[0] == size and all(
            s == 1 or plates.get(j - depth) == s for j, s in enumerate(shape[1:], 1)):
        return None
    declared = depth - 1
    want = f"({size},)" if declared == 0 else f"({size}, <{declared} dim(s) of the program's own plates>)"
    return ProgramError(
        f"{_at(who, where)}site {site['name']!r} has batch shape {shape}; the contract is batch shape {want} "
        f"(one row per particle, then the max_plate_nesting={declared} dims of plates the program declares; event "
        f"dims after them). Pyro's particle plate broadcast the distribution to this shape, so the weight would "
        f"sum several copies of a particle's log-probability: size the distribution's parameters [n] (e.g. "
        f"torch.full((n,), p), not (n, 1)), or move a per-particle vector into the event with .to_event(1)")


class SiteContract(Messenger):
    """Checks :func:`site_batch_error` at every sample site as the program runs (after the particle plate has
    broadcast it), so the error names the step; :func:`run_whole` enters one per step."""

    def __init__(self, who: str, where: str) -> None:
        super().__init__()
        self.who, self.where = who, where

    def _pyro_post_sample(self, msg) -> None:
        if not site_is_subsample(msg):
            err = site_batch_error(msg, self.who, self.where)
            if err is not None:
                raise err


# ---------------------------------------------------------------------------------------------- state
#: Python values a state entry may hold: shared by every particle (a step counter, a length), never reordered
#: or frozen; keep per-particle values in tensors [n, ...]
SHARED_SCALARS = (type(None), bool, int, float, str, numbers.Number)


def check_state(state: dict, n: int, who: str = "", where: str = "") -> None:
    """The contract on ``state`` (docs/architecture.md, "The contract"), checked at the end of ``init`` and of
    every step, so the error names the step that wrote the entry. An entry is

    * a tensor ``[n, ...]`` (one row per particle: resampling gathers it, a finished particle's rows are frozen),
    * an object with ``reorder(index)`` (an :class:`~ppl_thought.distributions.LMState`, a KV cache,
      :class:`Shared`),
    * a Python scalar (None, bool, int, float, str) or a 0-dim tensor: one value shared by every particle (a
      step counter), never reordered nor frozen,
    * or a dict of such entries.

    A list or tuple (resampling could not tell its per-particle rows from a shared list: a list of n ints was
    silently not reordered), a tensor whose leading dim is not n, or any other object is a
    :class:`ProgramError` naming the program, the step and the entry. Reads types and shapes only (no sync)."""
    for key, v in state.items():
        _check_entry(v, n, f"state[{key!r}]", who, where)


def _check_entry(v: Any, n: int, key: str, who: str, where: str) -> None:
    if isinstance(v, torch.Tensor):
        if v.ndim == 0 or v.shape[0] == n:
            return
        raise ProgramError(f"{_at(who, where)}{key} is a tensor of shape {tuple(v.shape)}: state tensors must be "
                           f"[num_particles={n}, ...] so that resampling can reorder them (keep shared constants "
                           "on the program object, or wrap them in pt.Shared)")
    if hasattr(v, "reorder") or isinstance(v, SHARED_SCALARS):
        return
    if isinstance(v, dict):
        for k, w in v.items():
            _check_entry(w, n, f"{key}[{k!r}]", who, where)
        return
    what = ("a list" if isinstance(v, list) else "a tuple" if isinstance(v, tuple)
            else f"of type {type(v).__name__}")
    raise ProgramError(f"{_at(who, where)}{key} is {what}: a state entry must be a tensor [num_particles={n}, ...] "
                       "(stack per-particle values: torch.stack / torch.tensor), an object with reorder(index) "
                       "(an LMState; pt.Shared(value) for a value every particle shares), a Python scalar shared "
                       "by every particle, or a dict of these; resampling cannot reorder it")


def snapshot_state(state: dict) -> dict:
    """What a step may overwrite of ``state`` (taken before the step while some particle is finished): a copy of
    every tensor entry ``[n, ...]`` (nested dicts entry by entry), so that :func:`freeze_finished` can restore
    the rows of finished particles however the step wrote them, in place (``state["c"] += 1``) or not."""
    out = {}
    for key, v in state.items():
        if isinstance(v, torch.Tensor) and v.ndim:
            out[key] = v.clone()
        elif isinstance(v, dict):
            out[key] = snapshot_state(v)
    return out


def freeze_finished(before: dict, after: dict, finished: torch.Tensor) -> None:
    """A finished particle's state entries keep the values they had when it finished: every tensor entry of
    ``after`` (nested dicts entry by entry) takes the rows of ``before`` (:func:`snapshot_state`) where
    ``finished`` is set, in place of ``after``'s entries. An entry the step added, or whose shape the step
    changed, is left as the step wrote it (the JAX backend's shapes are fixed, so there it cannot happen).
    One ``torch.where`` per tensor entry, no host sync."""
    for key, old in before.items():
        v = after.get(key)
        if isinstance(old, dict):
            if isinstance(v, dict):
                freeze_finished(old, v, finished)
        elif isinstance(v, torch.Tensor) and v.shape == old.shape:
            m = finished.to(v.device).reshape((-1,) + (1,) * (v.ndim - 1))
            after[key] = torch.where(m, old.to(v.device), v)



# ---------------------------------------------------------------------------------------------- arguments
def arg_versions(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor, int]]:
    """The tensors among an engine's arguments (and inside tuples, lists and dicts among them, one level deep)
    with their version counters (``tensor._version``, bumped by every in-place write): :func:`check_args`
    compares them after each step. O(arguments), no host sync."""
    out: list[tuple[str, torch.Tensor, int]] = []

    def add(label: str, v) -> None:
        if isinstance(v, torch.Tensor):
            try:
                out.append((label, v, v._version))
            except RuntimeError:  # an inference-mode tensor keeps no version counter (and cannot be written)
                pass

    named = [(f"argument {i}", f"argument {i}", a) for i, a in enumerate(args)]
    named += [(f"argument {name}=", f"argument {name}", a) for name, a in kwargs.items()]
    for label, inner, a in named:  # the argument, and tensors one level inside a tuple, list or dict
        add(label, a)
        items = enumerate(a) if isinstance(a, tuple | list) else a.items() if isinstance(a, dict) else ()
        for k, w in items:
            add(f"{inner}[{k!r}]" if isinstance(a, dict) else f"{inner}[{k}]", w)
    return out


def check_args(versions: list[tuple[str, torch.Tensor, int]], who: str = "", where: str = "") -> None:
    """Raise a :class:`ProgramError` naming the argument when a program wrote into one of the caller's tensors
    (:func:`arg_versions`): an engine never changes its caller's data (nor ``Result.observed``), so a step that
    does (``x.mul_(0.5)``) is refused."""
    for label, v, ver in versions:
        if v._version != ver:
            raise ProgramError(f"{_at(who, where)}the program wrote in place into the caller's {label} (a tensor of "
                               f"shape {tuple(v.shape)}): engines never change their arguments, and the caller's "
                               "tensor and Result.observed are now changed. Compute a new tensor instead "
                               "(x = x * 0.5, not x.mul_(0.5); x.clone() before writing into it)")
