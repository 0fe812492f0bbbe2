"""LM parameters as NumPyro ``param`` sites: a pytree registered leaf by leaf, so SVI trains any LM's params."""

from __future__ import annotations

from typing import Any

import jax
import numpyro


def param_tree(name: str, tree: Any) -> Any:
    """``numpyro.param`` for every leaf of ``tree`` (sites ``f"{name}/{i}"``); the pytree of their current values."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [numpyro.param(f"{name}/{i}", leaf) for i, leaf in enumerate(leaves)])
