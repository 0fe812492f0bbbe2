"""The array frameworks that the numpy tables of projections are lent to, without importing any of them.

Projections and their token automata are numpy (docs/architecture.md, "The layers": both backends read the same
tables). A table is handed to a batch of states in the states' own framework and on their device:
torch tensors for the torch side, jax arrays for the JAX side. This module recognises an array (or a
torch device) by the module its type lives in, so ``ppl_thought.projections`` imports neither torch nor
jax: a framework is only used once a caller hands over one of its arrays, and then it is loaded already.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ppl_thought.errors import DeviceMismatchError

__all__ = ["as_framework_array", "framework_of", "host_array", "table_key"]


def framework_of(x: Any) -> str | None:
    """``"torch"`` for a torch tensor or device, ``"jax"`` for a jax array or tracer, ``None`` otherwise."""
    root = type(x).__module__.partition(".")[0]
    if root == "torch":
        return "torch"
    if root in ("jax", "jaxlib"):
        return "jax"
    return None


def _torch_device(like: Any):
    torch = sys.modules["torch"]
    if isinstance(like, torch.device):
        return like
    if isinstance(like, str):
        return torch.device(like)
    return like.device


def table_key(like: Any) -> tuple[str, str] | None:
    """The per-device cache key of the framework array ``like`` asks for (``None``: plain numpy).

    A string names a torch device (``"cuda:0"``); it needs torch to be imported already.
    """
    if isinstance(like, str):
        if "torch" not in sys.modules:
            raise DeviceMismatchError(f"device {like!r} names a torch device, but torch is not imported")
        return ("torch", str(_torch_device(like)))
    fw = framework_of(like)
    if fw == "torch":
        return ("torch", str(_torch_device(like)))
    if fw == "jax":
        return ("jax", "default")
    return None


def as_framework_array(a: np.ndarray, key: tuple[str, str]) -> Any:
    """``a`` as an array of the framework and device in ``key`` (see :func:`table_key`)."""
    fw, dev = key
    if fw == "torch":
        return sys.modules["torch"].as_tensor(a, device=dev)
    return sys.modules["jax.numpy"].asarray(a)  # loaded with jax, which made the array handed over


def host_array(x: Any) -> Any:
    """A torch tensor or jax array as a numpy array on the host; anything else unchanged."""
    fw = framework_of(x)
    if fw == "torch":
        return x.detach().cpu().numpy()
    if fw == "jax":
        return np.asarray(x)
    return x
