"""The table of the inquisitive sampler Q_bullet of (3.22), Def 3.2, on the JAX side (torch twin:
``ppl_thought/guides/exact.py``, ``Inquisitive``): the per-sequence gradients grad_theta log P_f^{<=|z|}(z) of every z
in the enumerated lifting of x, as one ``jax.jacrev`` of the batched log-probabilities in the prior's parameters
(one compiled function per |x|, rows padded to a power of two), and the normalised weights
P(z) ||grad log P(z)|| (or the distance to the mean gradient: Remark 3.7, ``centered``). The guide is
:class:`ppl_thought.numpyro.guides.Inquisitive`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.errors import ConfigError, NotInImageError
from ppl_thought.vocab import PAD_ID


def per_sequence_gradients(model: Any, x: np.ndarray, limit: int) -> tuple[np.ndarray, jax.Array, jax.Array]:
    """(support ``[K, L]``, log P(z) ``[K]``, flattened grad_theta log P(z) ``[K, D]``) over the lifting of x;
    theta = every floating leaf of ``model.prior.params`` (rows with P(z) = 0 get a zero gradient)."""
    params = model.prior.params
    leaves = [v for v in jax.tree_util.tree_leaves(params) if jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating)]
    if not leaves:
        raise ConfigError("Inquisitive: the prior has no parameters; Q_bullet (3.22) needs theta")
    support, lp = model.enumerate_log_joint(x, limit=limit)
    K = support.shape[0]
    if K == 0:
        raise NotInImageError("x has an empty lifting: no inquisitive sampler")
    n = len(x)
    fns = model.__dict__.setdefault("_inquisitive_jacobian_cache", {})
    if n not in fns:  # one compiled Jacobian per |x| (its domain automaton)
        dist = model.z_dist(n)

        def log_p(p, rows):
            return type(dist)(dist.lm, constraint=dist.constraint, max_len=dist.max_len, params=p).log_prob(rows)

        def jac(p, rows):
            out = log_p(p, rows)
            grads = jax.jacrev(log_p)(p, rows)
            flat = [g.reshape(rows.shape[0], -1) for g in jax.tree_util.tree_leaves(grads)
                    if jnp.issubdtype(g.dtype, jnp.floating)]
            return out, jnp.concatenate(flat, 1)

        fns[n] = jax.jit(jac)
    rows = np.full((1 << (K - 1).bit_length(), support.shape[1]), PAD_ID, np.int32)
    rows[:K] = support
    lp, G = fns[n](params, jnp.asarray(rows))
    lp, G = lp[:K], G[:K]
    ok = jnp.isfinite(lp)
    return support, lp, jnp.where(ok[:, None], G, 0.0)


def inquisitive_table(model: Any, x: np.ndarray, centered: bool, limit: int) -> tuple[np.ndarray, jax.Array]:
    """(support ``[K, L]``, log Q_bullet(z | x) ``[K]``) of (3.22): log P(z) + log ||g(z)|| normalised, with
    g(z) = grad_theta log P(z), or g(z) - E_{Q_*}[g] with ``centered`` (Remark 3.7, read as the distance to the mean
    gradient grad log p(x), the torch reading). When every norm vanishes (3.22) is 0/0: Q_* (2.24) instead."""
    support, lp, G = per_sequence_gradients(model, x, limit)
    if not bool(jnp.isfinite(lp).any()):
        raise NotInImageError("x has probability 0 under the model: no inquisitive sampler")
    if centered:
        q = jax.nn.softmax(lp)
        G = G - (q[:, None] * G).sum(0, keepdims=True)
    norm = jnp.sqrt((G * G).sum(-1))
    logw = jnp.where(norm > 0, lp + jnp.log(jnp.where(norm > 0, norm, 1.0)), -jnp.inf)
    lz = jax.scipy.special.logsumexp(logw)
    if not bool(jnp.isfinite(lz)):
        return support, lp - jax.scipy.special.logsumexp(lp)
    return support, logw - lz
