"""ppl_thought.numpyro: the JAX / NumPyro backend (never imports torch or pyro).

    import ppl_thought.numpyro as ptn
    ptn.lm          # JAX LMs: Transformer (loads the torch side's checkpoints), the LM protocol, reorder
    ptn.models      # NumPyro programs (LatentThought)
    ptn.infer       # engines (ULA / MALA as numpyro MCMC kernels)

Subpackages are imported on first use.
"""

from __future__ import annotations

import importlib

_SUBMODULES = {"lm": "ppl_thought.numpyro.lm", "models": "ppl_thought.numpyro.models",
               "infer": "ppl_thought.numpyro.infer"}

__all__ = list(_SUBMODULES)


def __getattr__(name: str):
    if name in _SUBMODULES:
        mod = importlib.import_module(_SUBMODULES[name])
        globals()[name] = mod
        return mod
    raise AttributeError(f"module 'ppl_thought.numpyro' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES))
