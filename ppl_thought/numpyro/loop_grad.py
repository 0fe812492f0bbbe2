"""Reverse-mode gradients through the JAX side's early-stopping loops (docs/numpyro.md, "Gradients through loops").

A ``lax.while_loop`` that stops once every row has ended (a segment sampler, chunked decoding, ``extend``'s feed) is
what makes sampling cheap, and reverse mode refuses it. Each such loop has a twin: the same function of its
differentiable inputs written without the loop, given what the loop drew (one teacher-forced pass over the drawn
tokens). :func:`loop_with_one_pass_gradient` runs the loop and differentiates the twin: the gradient of log Q of a
sampled sequence is the score-function term of (3.25) / (6.19) whatever loop drew it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["loop_with_one_pass_gradient"]


def loop_with_one_pass_gradient(loop: Callable, twin: Callable, *diff: Any) -> Any:
    """``loop(*diff) = (y, aux)``, whose reverse-mode derivative is that of ``y = twin(*diff, aux)``: the same
    function written without a ``lax.while_loop``, e.g. one teacher-forced pass over the tokens the loop drew
    (``aux``: what has no derivative, such as those tokens). Sampling and scoring run the loop alone (the forward
    path is unchanged); only a reverse-mode gradient traces and runs the twin. Every array the loop reads goes in
    ``diff`` (closing over a traced array leaks it out of the custom rule); integer and key inputs get zero
    cotangents. Forward mode (``jax.jvp``) is not defined through it (a ``jax.custom_vjp``). Returns ``y`` when the
    loop's ``aux`` is ``()``, else ``(y, aux)``."""

    @jax.custom_vjp
    def run(*d):
        return loop(*d)

    def fwd(*d):
        out = loop(*d)
        return out, (d, out[1])

    def bwd(res, ct):
        d, aux = res
        _, vjp = jax.vjp(lambda *a: twin(*a, aux), *d)
        return vjp(ct[0])

    run.defvjp(fwd, bwd)
    y, aux = run(*diff)
    return y if isinstance(aux, tuple) and not aux else (y, aux)
