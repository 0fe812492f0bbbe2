"""Model transforms as effect handlers, in the style of ``pyro.poutine`` (docs/architecture.md, "Transforms").

A transform is one small :class:`pyro.poutine.messenger.Messenger` with one job. It changes what the
*sequence sites* of a program mean:

* whole view: a ``pyro.sample(name, LMSequence(lm, ...), obs=...)`` site (a plain Pyro function, or
  the ``__call__`` of a program such as :class:`~ppl_thought.models.PlainLM`);
* step view: the LM state a :class:`~ppl_thought.program.Program` starts with :func:`sequence_start`
  (an effect, so that a transform can change the LM and its token rule before the state is built)
  and the segments it samples from that state at the sites ``f"{name}_{t}"``.

``T(model)`` applies a transform: to a plain function it returns a function that runs under the
handler (like ``poutine.trace(fn)``); to a ``pt.Program`` it returns a :class:`Transformed` program whose
``__call__``, ``init``, ``step`` and ``outputs`` run the inner program's under the handler, so every
engine (Importance, SMC, SVI, decoding) runs the result. Transforms compose by nesting,
``CostAware(w)(Forgetful()(ProjectionLift(proj)(lm_program)))``, or with :func:`compose`.

A transform that keeps per-particle data (the lifting automaton's states of :class:`ProjectionLift`)
keeps it in the program's ``state`` under its own key, so the engine reorders it after resampling.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import effectful

from ppl_thought.distributions.lm_sequence import LMSequence
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.errors import TransformError
from ppl_thought.program import Program, is_program, run_whole
from ppl_thought.validation import checked, per_token

__all__ = ["Transform", "Transformed", "TransformedFunction", "compose", "rebuild", "sequence_start"]


# ---------------------------------------------------------------------------------------------- the step effect
def _start(dist: LMSequence, n: int, observed: torch.Tensor | None = None, rule: TokenRule | None = None) -> LMState:
    """The LM state of ``n`` rows at the start of the sequence site ``dist`` (``rule`` overrides its token rule)."""
    return LMState.encode(dist.lm, int(n), dist.prompt if dist.prompt.numel() else None,
                           rule if rule is not None else dist.rule, dist.max_len, dist.stop_ids, dist.lm_kwargs,
                           dist.device, dist.chunk)


_start_effect = effectful(_start, type="sequence_start")


@checked
def sequence_start(name: str, dist: LMSequence, n: int, observed: torch.Tensor | None = None) -> LMState:
    """Start the step view of the sequence site ``name`` (the site ``pyro.sample(name, dist)`` of the
    whole view): an :class:`LMState` of ``n`` rows that the program then steps with
    ``pyro.sample(f"{name}_{t}", state.segment(...), obs=...)``.

    It is a Pyro effect (type ``"sequence_start"``): transforms change ``dist`` (its LM, its automaton)
    before the state is built; ``observed`` is the site's observation (1-D ids), which a transform may
    read (:class:`~ppl_thought.transforms.ProjectionLift` builds the lifting of x from it).
    """
    return _start_effect(dist, n, observed=observed, name=name)


@checked
def rebuild(dist: LMSequence, **changes: Any) -> LMSequence:
    """A copy of the sequence distribution with some of its arguments changed (``lm``, ``constraint``,
    ``max_len``, ``prompt``, ``lm_kwargs``, ``chunk``): what a transform does to a site."""
    args = {"lm": dist.lm, "prompt": dist.prompt, "constraint": dist.constraint, "stop": dist.stop_ids,
            "max_len": dist.max_len, "vocab": dist.vocab, "batch_shape": dist.batch_shape,
            "lm_kwargs": dist.lm_kwargs, "name": dist.lm_name, "chunk": dist.chunk}
    unknown = set(changes) - set(args)
    if unknown:
        raise TransformError(f"rebuild: unknown LMSequence arguments {sorted(unknown)}")
    args.update(changes)
    if "constraint" in changes and "max_len" not in changes and args["constraint"] is not None:
        args["max_len"] = args["constraint"].max_len
    if "prompt" in changes and args["prompt"] is not None and torch.as_tensor(args["prompt"]).ndim <= 1:
        args["batch_shape"] = dist.batch_shape
    return LMSequence(**args)


# ---------------------------------------------------------------------------------------------- transforms
@checked
class Transform(Messenger):
    """Base class of the model transforms: a Messenger that is also applied by calling it on a model.

    Subclasses handle ``_pyro_sample`` (sequence sites) and ``_pyro_sequence_start`` (step views) and may
    define :meth:`outputs` (extra values for ``Result.samples``) and :attr:`provides` (attributes the
    transformed model exposes, e.g. ``projection``).
    """

    _keys = itertools.count()

    #: what the transform acts on: the end of the message of a run that met nothing of it (:meth:`check_met`)
    needs = "a sequence site: pyro.sample(name, LMSequence(lm, ...)) or sequence_start(name, ...)"

    def __init__(self) -> None:
        super().__init__()
        self._state: dict | None = None
        self.key = f"_transform{next(Transform._keys)}"
        self._met = False  # whether the current run met a site the transform acts on
        self._seen: list[str] = []  # the run's sequence sites (for the message when it met none)
        self._runs = 0  # whole-view runs in progress (nested calls check once, at the outermost)

    # -- applying --------------------------------------------------------------------------------------
    def __call__(self, model: Callable[..., Any]):  # type: ignore[override]
        """Apply the transform: a :class:`Transformed` program for a ``pt.Program``, a handled function
        (:class:`TransformedFunction`) for a plain Pyro function."""
        if is_program(model):
            return Transformed(model, self)
        return TransformedFunction(model, self)

    @property
    def provides(self) -> dict[str, Any]:
        """Attributes the transformed model exposes (``model.projection`` after a ProjectionLift)."""
        return {}

    # -- per-particle state ----------------------------------------------------------------------------
    @contextmanager
    def bound(self, state: dict | None) -> Iterator[Transform]:
        """Run the handler with the program's ``state`` at hand (init / step of a Transformed program)."""
        old = self._state
        self._state = state
        try:
            with self:
                yield self
        finally:
            self._state = old

    @property
    def state(self) -> dict | None:
        return self._state

    # -- refusing a model it cannot act on ---------------------------------------------------------------
    def _process_message(self, msg) -> None:
        if self._runs or self._state is not None:
            is_seq = msg["type"] == "sequence_start" or (msg["type"] == "sample" and isinstance(msg["fn"], LMSequence))
            if is_seq and msg["name"] not in self._seen and len(self._seen) < 16:
                self._seen.append(msg["name"])
        super()._process_message(msg)

    def _acted(self) -> None:
        """Record that this run met a site the transform acts on."""
        self._met = True

    def _reset(self) -> None:
        self._met = False
        self._seen = []

    def check_met(self) -> None:
        """Refuse a run that met nothing the transform acts on (a :class:`TransformError` naming what it needs and
        the sequence sites the model has): called at the end of a whole-view run and of the first step."""
        if not self._met:
            seen = ", ".join(repr(s) for s in self._seen) or "none"
            raise TransformError(f"{self!r} cannot act on this model: it needs {self.needs}; the model's run met "
                                 f"none (its sequence sites: {seen})")

    @contextmanager
    def run(self) -> Iterator[Transform]:
        """One whole-view run of a transformed model: :meth:`check_met` at its end (the outermost of nested runs)."""
        if self._runs == 0:
            self._reset()
        self._runs += 1
        try:
            yield self
        finally:
            self._runs -= 1
        if self._runs == 0:
            self.check_met()

    def outputs(self, state: dict) -> dict:
        """Extra ``Result.samples`` entries read from the final state (default: none)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@checked
class Transformed(Program):
    """A ``pt.Program`` run under a transform: ``init``, ``step``, ``outputs`` and the whole-trace call of
    ``inner`` under ``transform`` (see the module docstring). Attributes not found here are looked up in
    the transform's :attr:`~Transform.provides`, then in the inner program (``prior``, ``vocab``, ...)."""

    def __init__(self, inner: Program, transform: Transform):
        self.inner = inner
        self.transform = transform
        self.max_plate_nesting = getattr(inner, "max_plate_nesting", 0)
        self.max_steps = getattr(inner, "max_steps", None)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("inner", "transform"):
            raise AttributeError(name)
        provided = self.transform.provides
        if name in provided:
            return provided[name]
        return getattr(self.inner, name)

    @property
    def transforms(self) -> list[Transform]:
        """The transforms from the outermost in."""
        inner = self.inner.transforms if isinstance(self.inner, Transformed) else []
        return [self.transform, *inner]

    @property
    def base(self) -> Program:
        """The untransformed program."""
        return self.inner.base if isinstance(self.inner, Transformed) else self.inner

    def __call__(self, *args, **kwargs):
        """The whole-trace view: the base program's own ``__call__`` (e.g. one sequence site) under every
        transform, or, for a program without one, ``init`` and every step in one trace."""
        if type(self.base).__call__ is Program.__call__:
            return run_whole(self, *args, **kwargs)
        with self.transform.run(), self.transform.bound(None):
            return self.inner(*args, **kwargs)

    @per_token
    def init(self, state: dict, *args, **kwargs) -> None:
        if self.transform._runs == 0:
            self.transform._reset()
        with self.transform.bound(state):
            self.inner.init(state, *args, **kwargs)

    @per_token
    def step(self, state: dict, t: int, *args, **kwargs):
        with self.transform.bound(state):
            out = self.inner.step(state, t, *args, **kwargs)
        if self.transform._runs == 0 and hasattr(t, "__index__") and t.__index__() == 0:
            self.transform.check_met()  # the sequence sites start in init or the first step
        return out

    def outputs(self, state: dict, *args, **kwargs) -> dict:
        out = dict(self.inner.outputs(state, *args, **kwargs))
        out.update(self.transform.outputs(state))
        return out

    def __repr__(self) -> str:
        return f"{self.transform!r}({self.inner!r})"


@checked
class TransformedFunction:
    """A plain Pyro function run under a transform (the whole view only: Importance, SVI, Predictive)."""

    def __init__(self, fn: Callable, transform: Transform):
        self.fn = fn
        self.transform = transform

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("fn", "transform"):
            raise AttributeError(name)
        provided = self.transform.provides
        if name in provided:
            return provided[name]
        return getattr(self.fn, name)

    def __call__(self, *args, **kwargs):
        with self.transform.run(), self.transform.bound(None):
            return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.transform!r}({getattr(self.fn, '__name__', self.fn)!r})"


@checked
def compose(*transforms: Transform) -> Callable:
    """``compose(A, B, C)(model) == A(B(C(model)))``: the last transform is applied first (innermost)."""
    for t in transforms:
        if not isinstance(t, Transform):
            raise TransformError(f"compose takes transforms, got {type(t).__name__}")

    def apply(model):
        for t in reversed(transforms):
            model = t(model)
        return model

    return apply
