"""The machinery of ``ptn.transforms`` (torch twin: ppl_thought/transforms/base.py): binding a transform to a model,
the refusal of a run that met nothing it acts on, :class:`Transform`, :class:`Transformed`, :func:`compose` and the
step view's effect :func:`sequence_start`.

A transform acts on the *sequence sites* of a program:

* whole view: a ``numpyro.sample(name, ptn.dist.LMSequence(lm, ...), obs=...)`` site;
* step view: the :class:`~ppl_thought.numpyro.lm_state.LMState` a ``ptn.Program`` starts with
  :func:`sequence_start` (an effect, so that a transform changes the site's LM or token rule before the state is
  built) and the segments / tokens it then samples from that state.

``T(program)`` for a ``ptn.Program`` is a :class:`Transformed` program whose ``init``, ``step`` and ``outputs`` run
the inner program's under ``T``, so every engine (Importance, SMC, decoding, SVI through the whole-trace call)
runs it; ``T(fn)`` for a plain NumPyro function is ``T`` bound to it (a Messenger with ``fn``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from numpyro.primitives import Messenger, apply_stack

from ppl_thought.errors import TransformError
from ppl_thought.numpyro.boundary import ArrayLike, checked_jax
from ppl_thought.numpyro.distributions import LMSequence
from ppl_thought.numpyro.handlers import ProjectionLift
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.numpyro.lm_state import LMState
from ppl_thought.numpyro.program import Program, is_program, run_whole_trace
from ppl_thought.validation import per_token

__all__ = ["SEQUENCE_START", "Transform", "Transformed", "compose", "sequence_start"]

_MODE = "thinking"
#: the message type of :func:`sequence_start` (the torch effect's ``"sequence_start"``)
SEQUENCE_START = "sequence_start"


# ---------------------------------------------------------------------------------------------- the step effect
def _start(dist: LMSequence, n: int, observed: Any = None) -> LMState:
    """The LM state of ``n`` rows at the start of the sequence site ``dist``: its LM, prompt, token rule and
    length bound."""
    prompt = dist.prompt if dist.prompt.size else None
    return LMState.start(dist.lm, n, prompt=prompt, rule=dist.rule, max_len=dist.max_len)


@checked_jax
def sequence_start(name: str, dist: LMSequence, n: int, observed: ArrayLike | None = None) -> LMState:
    """Start the step view of the sequence site ``name`` (the site ``numpyro.sample(name, dist)`` of the whole view):
    an :class:`~ppl_thought.numpyro.lm_state.LMState` of ``n`` rows (its LM, prompt, token rule ``dist.rule`` and
    room ``dist.max_len``) that the program then steps with ``ptn.sample(..., state.segment(...))``,
    ``state.next_token()`` and ``state.extend(...)`` (the torch ``pt.transforms.sequence_start``).

    It is an effect (a NumPyro message of type ``"sequence_start"``, left out of traces): the transforms change
    ``dist`` before the state is built (:class:`~ppl_thought.numpyro.transforms.Forgetful` reads its LM through
    the forgetful context of Def 5.1) or note the site (``Persistent``); ``observed`` is the site's observation, for
    a transform that reads it. Outside any transform it is ``LMState.start(dist.lm, n, dist.prompt,
    rule=dist.rule, max_len=dist.max_len)``."""
    if not isinstance(dist, LMSequence):
        raise TransformError(f"sequence_start({name!r}, ...) takes a ptn.dist.LMSequence (the site's law in the whole "
                             f"view), got {type(dist).__name__}")
    msg = {"type": SEQUENCE_START, "site": str(name), "fn": _start, "args": (dist, int(n)),
           "kwargs": {"observed": observed}, "value": None, "infer": {}, "stop": False, "cond_indep_stack": []}
    apply_stack(msg)
    return msg["value"]


# ---------------------------------------------------------------------------------------------- the machinery
class _RunCheck:
    """Binding and the refusal of a run that met nothing (shared by :class:`Transform` and :class:`Ubiquitous`).

    The run's bookkeeping (whether it met a site, the sequence sites it had, nesting) lives in the memo dict
    ``_check_cache``, which the compile fingerprint skips (ppl_thought/numpyro/infer/compiled.py): a run does not
    change the transform's configuration, so the next run reuses the compiled function."""

    needs = ("a sequence site: numpyro.sample(name, ptn.dist.LMSequence(lm, ...)) or "
             "ptn.transforms.sequence_start(name, ...) in a ptn.Program")

    def _book(self) -> dict:
        return self.__dict__.setdefault("_check_cache", {"met": False, "seen": [], "runs": 0, "pending": False})

    _met = property(lambda self: self._book()["met"], lambda self, v: self._book().__setitem__("met", v))
    _seen = property(lambda self: self._book()["seen"], lambda self, v: self._book().__setitem__("seen", v))
    _runs = property(lambda self: self._book()["runs"], lambda self, v: self._book().__setitem__("runs", v))

    def _copy(self) -> Any:
        new = copy.copy(self)
        new.__dict__.pop("_check_cache", None)  # its own runs
        new._met, new._seen, new._runs = False, [], 0
        return new

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``T(model)`` (unbound ``T``, one callable argument): a copy of ``T`` bound to ``model``, or for a
        ``ptn.Program`` a :class:`Transformed` program. A bound transform runs its model under the handler and
        refuses the run if it met nothing it acts on."""
        if self.fn is None:
            if len(args) != 1 or kwargs or not callable(args[0]) and not is_program(args[0]):
                raise TransformError(f"{self!r} is applied to a model (a callable): {self!r}(model)")
            if is_program(args[0]):
                return Transformed(args[0], self._copy())
            bound = self._copy()
            bound.fn = args[0]
            return bound
        outer = getattr(self, "_runs", 0) == 0
        if outer:
            self._met, self._seen = False, []
        self._runs = getattr(self, "_runs", 0) + 1
        try:
            with self:
                out = self.fn(*args, **kwargs)
        finally:
            self._runs -= 1
        if outer:
            self.check_met()
        return out

    def _record(self, msg: dict) -> None:
        """Note a sequence site of the run (for the refusal's message)."""
        seen = self._seen
        if msg["type"] == SEQUENCE_START:
            name = msg["site"]
        elif msg["type"] == "sample" and isinstance(msg["fn"], LMSequence):
            name = msg["name"]
        else:
            return
        if name not in seen and len(seen) < 16:
            seen.append(name)

    def _begin_steps(self) -> None:
        """A step-view run starts (``init`` of a :class:`Transformed` program): check after its first step."""
        if not self._runs:
            self._met, self._seen = False, []
            self._book()["pending"] = True

    def _after_step(self) -> None:
        """The first step after ``init`` has run (traced): the sequence sites start in ``init`` or that step."""
        book = self._book()
        if book["pending"] and not self._runs:
            book["pending"] = False
            self.check_met()

    def _acted(self) -> None:
        self._met = True

    def check_met(self) -> None:
        """Refuse a run that met nothing the transform acts on: a :class:`TransformError` naming what it needs
        and the sequence sites of the run (the torch ``Transform.check_met``)."""
        if not getattr(self, "_met", False):
            seen = ", ".join(repr(s) for s in getattr(self, "_seen", [])) or "none"
            raise TransformError(f"{self!r} cannot act on this model: it needs {self.needs}; the model's run met "
                                 f"none (its sequence sites: {seen})")


@checked_jax
class Transform(_RunCheck, Messenger):
    """Base class of the JAX transforms: a NumPyro Messenger on sequence sites, applied by calling it on a model
    (torch twin: ``pt.transforms.Transform``). Subclasses implement :meth:`act` (a message of a sample site)."""

    def __init__(self, fn: Callable[..., Any] | None = None) -> None:
        super().__init__(fn)
        self._met, self._seen, self._runs = False, [], 0

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "sample":
            self._record(msg)
            self.act(msg)
        elif msg["type"] == SEQUENCE_START:
            self._record(msg)
            self.act_start(msg)

    def act(self, msg: dict) -> None:
        """Handle one sample site (default: nothing)."""

    def act_start(self, msg: dict) -> None:
        """Handle one :func:`sequence_start` (the step view; default: nothing). ``msg["args"][0]`` is the site's
        ``LMSequence`` (replace it to change what the state is built from), ``msg["site"]`` its name."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@checked_jax
class Transformed(Program):
    """A ``ptn.Program`` run under a transform (torch twin: ``pt.transforms.Transformed``): ``init``, ``step`` and
    ``outputs`` of ``inner`` under ``transform``, so the engines run it as any program; the whole-trace call
    (SVI, MALA) runs ``init`` and the steps as one trace. A run whose ``init`` and first step met nothing the
    transform acts on is a :class:`~ppl_thought.errors.TransformError` (checked while the engine traces the
    program, so a compiled run that is reused is not checked again). Other attributes are the inner program's."""

    def __init__(self, inner: Any, transform: _RunCheck):
        self.inner = inner
        self.transform = transform
        self.max_plate_nesting = getattr(inner, "max_plate_nesting", 0)
        self.max_steps = getattr(inner, "max_steps", None)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("inner", "transform"):
            raise AttributeError(name)
        value = getattr(self.inner, name)
        if name == "continuation" and callable(value):  # the decoders' view stays under the transform
            return lambda **options: Transformed(value(**options), self.transform._copy())
        return value

    @property
    def base(self) -> Any:
        """The untransformed program."""
        return self.inner.base if isinstance(self.inner, Transformed) else self.inner

    @per_token
    def init(self, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self.transform._begin_steps()
        with self.transform:
            self.inner.init(state, *args, **kwargs)

    @per_token
    def step(self, state: dict[str, Any], t: Any, *args: Any, **kwargs: Any) -> Any:
        with self.transform:
            out = self.inner.step(state, t, *args, **kwargs)
        self.transform._after_step()
        return out

    def outputs(self, state: dict[str, Any], *args: Any, **kwargs: Any) -> dict:
        return self.inner.outputs(state, *args, **kwargs)

    @per_token
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The whole-trace view: ``init`` and ``max_steps`` steps in one trace (``Program.__call__``), or the base
        program's own ``__call__`` under the transform when it has one."""
        if type(self.base).__call__ is Program.__call__:
            return run_whole_trace(self, args, kwargs)
        bound = self.transform._copy()
        bound.fn = self.inner
        return bound(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.transform!r}({self.inner!r})"


@checked_jax
def compose(*transforms: Transform | ProjectionLift) -> Callable[[Callable[..., Any]], Any]:
    """``compose(A, B, C)(model) == A(B(C(model)))``: the last transform is applied first (innermost)."""
    for t in transforms:
        if not isinstance(t, (Transform, ProjectionLift)):
            raise TransformError(f"compose takes transforms, got {type(t).__name__}")

    def apply(model: Callable[..., Any]) -> Any:
        for t in reversed(transforms):
            model = t(model)
        return model

    return apply


def _rebuild(d: LMSequence, lm: LM) -> LMSequence:
    """A copy of the sequence distribution ``d`` reading ``lm`` (same prompt, rule, params, shapes)."""
    new = copy.copy(d)
    new.lm = lm
    return new


def _mark(msg: dict, mode: str, site: str) -> None:
    other = msg["infer"].get(_MODE)
    if other is not None and other != mode:
        raise TransformError(f"site {site!r} is both {other} and {mode}: Persistent() and Forgetful() say "
                             "opposite things about earlier thoughts; apply one of them")
    msg["infer"][_MODE] = mode
