"""The machinery of ``ptn.transforms`` (torch twin: ppl_thought/transforms/base.py): binding a transform to a model,
the refusal of a run that met nothing it acts on, :class:`Transform`, :func:`compose`."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from numpyro.primitives import Messenger

from ppl_thought.errors import TransformError
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.distributions import LMSequence
from ppl_thought.numpyro.handlers import ProjectionLift
from ppl_thought.numpyro.lm.base import LM

__all__ = ["Transform", "compose"]

_MODE = "thinking"


# ---------------------------------------------------------------------------------------------- the machinery
class _RunCheck:
    """Binding and the refusal of a run that met nothing (shared by :class:`Transform` and :class:`Ubiquitous`)."""

    needs = "a sequence site: numpyro.sample(name, ptn.dist.LMSequence(lm, ...))"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``T(model)`` (unbound ``T``, one callable argument): a copy of ``T`` bound to ``model``. A bound
        transform runs its model under the handler and refuses the run if it met nothing it acts on."""
        if self.fn is None:
            if len(args) != 1 or kwargs or not callable(args[0]):
                raise TransformError(f"{self!r} is applied to a model (a callable): {self!r}(model)")
            bound = copy.copy(self)
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
        seen = self.__dict__.setdefault("_seen", [])
        if msg["type"] == "sample" and isinstance(msg["fn"], LMSequence) and msg["name"] not in seen \
                and len(seen) < 16:
            seen.append(msg["name"])

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

    def act(self, msg: dict) -> None:
        """Handle one sample site (default: nothing)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


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


def _mark(msg: dict, mode: str) -> None:
    other = msg["infer"].get(_MODE)
    if other is not None and other != mode:
        raise TransformError(f"site {msg['name']!r} is both {other} and {mode}: Persistent() and Forgetful() say "
                             "opposite things about earlier thoughts; apply one of them")
    msg["infer"][_MODE] = mode
