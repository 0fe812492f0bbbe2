"""The collector of ``twist`` calls (docs/architecture.md, "One protocol, two backends"): an engine that steps
a program installs one around each step (:func:`collect_twists`) and reads the summed log psi_t of that step;
the backends' ``twist`` verbs (``pt.twist``, ``ptn.twist``) add to the innermost one (:func:`current`).
Framework-free, so the torch and the JAX program modules share it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["TwistCollector", "collect_twists", "current"]


class TwistCollector:
    """Receives the ``twist`` calls of one step: ``log_psi`` is their sum (``None`` when none was made)."""

    def __init__(self) -> None:
        self.log_psi: Any = None

    def add(self, log_psi) -> None:
        self.log_psi = log_psi if self.log_psi is None else self.log_psi + log_psi


_STACK: list[TwistCollector] = []


@contextmanager
def collect_twists() -> Iterator[TwistCollector]:
    """Collect the potentials ``twist`` sets while the body runs (engines only)."""
    c = TwistCollector()
    _STACK.append(c)
    try:
        yield c
    finally:
        _STACK.pop()


def current() -> TwistCollector | None:
    """The innermost collector, or ``None`` outside an engine that steps a program (the twist then cancels)."""
    return _STACK[-1] if _STACK else None
