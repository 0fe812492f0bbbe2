"""Registering a trainable LM with Pyro's param store, so that SVI trains it without a ``pyro.module`` call in
the user's program (used by :class:`~ppl_thought.distributions.LMSequence` and ``LMState.start``)."""

from __future__ import annotations

import pyro
import torch
from pyro.params.param_store import module_from_param_with_module_name, param_with_module_name

from ppl_thought.program import pyro_module
from ppl_thought.validation import checked

__all__ = ["register_lm"]


@checked
def register_lm(lm: torch.nn.Module, name: str | None = None) -> str | None:
    """Register a trainable LM with Pyro's param store, as ``pyro.module(name, lm)`` would; return its name.

    What a user program would write before using ``lm`` in a model or guide: inside a Pyro call the
    parameters become ``param`` sites of the trace, so that SVI trains them. Parameters already in the
    param store (found by identity, e.g. registered by a ``pyro.module`` of the user's, of the LM or of a
    module holding it) are used under the names they have there, so the same LM is never registered
    twice. Otherwise the LM is registered as ``name``, by default ``f"lm_{type(lm).__name__}"`` with a
    suffix ``_1``, ``_2``, ... when a different module holds that name. An LM without parameters that
    require gradients (frozen) is not registered: ``None``.
    """
    params = dict(lm.named_parameters()) if isinstance(lm, torch.nn.Module) else {}
    trainable = {k: p for k, p in params.items() if p.requires_grad}
    if not trainable:
        return None
    store = pyro.get_param_store()
    mine = {id(p): k for k, p in trainable.items()}
    known: dict[str, str] = {}  # LM parameter name -> its name in the store
    for key, value in store._params.items():
        if id(value) in mine:
            known.setdefault(mine[id(value)], key)
    if len(known) == len(trainable):  # registered already: read them again, under their names
        for k, p in trainable.items():
            pyro.param(known[k], p)
        return module_from_param_with_module_name(next(iter(known.values())))
    if name is None:
        base, i = f"lm_{type(lm).__name__}", 0
        name = base
        while _held_by_another(store, name, mine):
            i += 1
            name = f"{base}_{i}"
    if not known:
        pyro_module(name, lm)  # its trainable parameters only: a frozen weight is never a param site
        return name
    for k, p in trainable.items():  # some registered (a shared part): the rest under ``name``
        pyro.param(known.get(k, param_with_module_name(name, k)), p)
    return name


def _held_by_another(store, name: str, mine: dict) -> bool:
    prefix = param_with_module_name(name, "")
    return any(key.startswith(prefix) and id(value) not in mine for key, value in store._params.items())
