"""Inference with an active lifting model (Section 6), compiled: :func:`encode` (6.17)/(6.18),
:func:`conditional_encode` (6.22) and :func:`conditional_decode` (6.20)/(6.21) for a
:class:`~ppl_thought.numpyro.transforms.ActiveLift` (torch twins: ``ppl_thought/training/active.py``, same names,
arguments and numbers on the same latents).

With Z ~ Q^{<=T}(. | x) and its prefixes Z_<=t (t = 0..T), lp_t = log P^{<=t}(Z_<=t), lq_t = log Q^{<=t}(Z_<=t | x),
lg_t = log G^{<=t}(x | Z_<=t) (``lp_0 = lq_0 = 0``). Each function is one ``jax.jit`` of its whole run (the draws
of Q, the teacher-forced passes, the resampling and G's decoding), with every particle a row of the batch. A
compiled run is cached by what it depends on (:mod:`ppl_thought.numpyro.infer.compiled`): the LMs' classes and
shapes (their parameters are arguments, so new weights or a new ``ActiveLift`` of the same configuration reuse
it), the configuration (T, Omega, Sigma, ``max_x_len``, particle counts) and the length of x (x itself is an
argument); never an object's identity. ``ptn.compile_stats()`` lists each compile.
"""

from __future__ import annotations

import collections
import copy
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.checks import integer
from ppl_thought.errors import ActiveLiftError
from ppl_thought.numpyro.boundary import ArrayLike, Key, checked_jax
from ppl_thought.numpyro.distributions import LMSequence
from ppl_thought.numpyro.infer.compiled import Fingerprint, explain, record_compile, record_hit
from ppl_thought.numpyro.infer.resampling import prng_key
from ppl_thought.numpyro.transforms.active import ActiveLift
from ppl_thought.vocab import END_THINK_ID, EOS_ID

__all__ = ["conditional_decode", "conditional_encode", "encode"]

_COMPILED: collections.OrderedDict = collections.OrderedDict()
_ROLES = ("lm", "prior_lm", "generator_lm")


# ------------------------------------------------------------------------------------------ the cores (pure)
def log_weights(lift: ActiveLift, z: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(log P(z_t | z_<t) [n, T], log Q(z_t | x, z_<t) [n, T], log G^{<=t}(x | z_<=t) [n, T + 1])`` of latents
    ``z [n, T]`` and one x (1-D): one teacher-forced pass each (the torch ``_log_weights``)."""
    return lift.prior_log_probs(z), lift.sampler_log_probs(z, x), lift.generator_log_probs(x, z)


def encode_from(lift: ActiveLift, x: jax.Array, z: jax.Array, incremental: bool = True) -> jax.Array:
    """``[T + 1]`` log p_{t,n} of :func:`encode` from given particles ``z [n, T]`` (draws of Q^{<=T}(. | x))."""
    lp, lq, lg = log_weights(lift, z, x)
    if incremental:  # (6.18): log q_t = log q_{t-1} + log P(Z_t | Z_<t) + g(x, Z_<=t) - log Q(Z_t | x, Z_<t)
        g = jnp.diff(lg, axis=-1, prepend=jnp.zeros_like(lg[:, :1]))
        log_q = jnp.cumsum(g + jnp.pad(lp - lq, ((0, 0), (1, 0))), -1)
    else:  # (6.17)
        log_q = jnp.pad(jnp.cumsum(lp - lq, -1), ((0, 0), (1, 0))) + lg
    return jax.scipy.special.logsumexp(log_q, 0) - math.log(z.shape[0])


def whole_log_weights(lift: ActiveLift, z: jax.Array, x: jax.Array) -> jax.Array:
    """``[n]``: log G([x] | z) + log P(z) - log Q(z | x), the t = T weight of (6.17), (6.21), (6.22)."""
    lp, lq, lg = log_weights(lift, z, x)
    return lp.sum(-1) - lq.sum(-1) + lg[:, -1]


def _draw(lift: ActiveLift, key: jax.Array, x: jax.Array, n: int) -> jax.Array:
    return lift.sampler(x).sample(key, (n,)).reshape((n, lift.latent_len))  # x traced: batch [1]


# ------------------------------------------------------------------------------------------ compiled runs
def _compiled(name: str, lift: ActiveLift, config: tuple, fn: Callable[..., Any], data: tuple) -> Callable:
    """``fn(lift, key, *data)`` jitted and cached by the LMs' fingerprint, ``config`` and the shapes of
    ``data``: returns ``key -> fn(...)``."""
    lms = tuple(getattr(lift, r) for r in _ROLES)
    fp = Fingerprint(lms)  # shared LMs stay shared; their arrays are the compiled function's arguments
    lift_cfg = (type(lift), lift.latent_len, lift.max_x_len, tuple(lift.omega_ids.tolist()),
                tuple(np.asarray(lift.vocab.observable_ids).tolist()), len(lift.vocab))
    shapes = tuple((f"arg {i}", tuple(np.shape(d)), str(d.dtype)) for i, d in enumerate(data))
    parts = {"engine": config, "program": (lift_cfg, fp.parts), "guide": None, "shapes": shapes, "mode": False,
             "static": None}
    key = (name, lift_cfg, fp.key, config, shapes)
    hit = _COMPILED.get(key)
    if hit is not None:
        _COMPILED.move_to_end(key)
        record_hit()
        return lambda k: hit[0](fp.arrays, k, *data)

    def run(arrays, k, *args):
        new = copy.copy(lift)
        for role, m in zip(_ROLES, fp.rebuild(arrays)):
            setattr(new, role, m)
        return fn(new, k, *args)

    jitted = jax.jit(run)
    previous = next((h[1] for kk, h in reversed(_COMPILED.items()) if kk[0] == name), None)

    def first(k):
        start = time.perf_counter()
        out = jax.block_until_ready(jitted(fp.arrays, k, *data))
        _COMPILED[key] = (jitted, parts)
        while len(_COMPILED) > 32:
            _COMPILED.popitem(last=False)
        record_compile(name, type(lms[0]).__name__, "None", explain(previous, parts), time.perf_counter() - start)
        return out

    return first


def _ids(lift: ActiveLift, x: ArrayLike | str) -> jax.Array:
    return jnp.asarray(lift._x(x), jnp.int32)  # 1-D, checked, padding dropped


@checked_jax
def encode(lift: ActiveLift, x: ArrayLike | str, num_particles: int, incremental: bool = True,
           rng_key: Key | int | None = None) -> jax.Array:
    """Unconditional encoding along the time axis: ``[T + 1]`` log p_{t,n}, t = 0..T, estimates of
    log P_model(x) = log sum_z P^{<=t}(z) G^{<=t}(x | z) from one set of n particles Z^(i) ~ Q^{<=T}(. | x).

    ``incremental=False`` is (6.17): p_{t,n} = (1/n) sum_i P^{<=t}(Z^(i)) G^{<=t}(x | Z^(i)) / Q^{<=t}(Z^(i) | x).
    ``incremental=True`` is (6.18) (the same numbers, built step by step; the torch docstring gives the reading
    of the printed formula). p_{t,n} is unbiased for P_model^{<=t}(x) (not its log). One compiled run."""
    n = integer("num_particles", num_particles, minimum=1)
    inc = bool(incremental)

    def fn(lf, k, xs):
        return encode_from(lf, xs, _draw(lf, k, xs, n), inc)

    xs = _ids(lift, x)
    return _compiled("ActiveLift encode (6.17)-(6.18)", lift, (("num_particles", n), ("incremental", inc)), fn,
                     (xs,))(prng_key(rng_key))


@checked_jax
def conditional_encode(lift: ActiveLift, x_q: ArrayLike | str, x_r: ArrayLike | str, num_particles: int,
                       rng_key: Key | int | None = None) -> jax.Array:
    """Conditional encoding (6.22): an estimate of log P_model(x_q x_r | [x_q]),

        p_n = [(1/n) sum_i G(x_q x_r | Z_i) P(Z_i) / Q(Z_i | x_q x_r)]
              / [(1/n) sum_i G([x_q] | Z~_i) P(Z~_i) / Q(Z~_i | x_q)]

    with Z_i ~ Q(. | x_q x_r), Z~_i ~ Q(. | x_q). Numerator and denominator are unbiased for P_model(x_q x_r) and
    P_model([x_q]); the ratio is consistent. x_q x_r should be complete (end with ``<eos>``). One compiled run."""
    n = integer("num_particles", num_particles, minimum=1)
    q, r = _ids(lift, x_q), _ids(lift, x_r)
    full = jnp.concatenate([q, r])
    lift._x(np.asarray(full))  # checked whole (ids, length)

    def fn(lf, k, full, q):
        k1, k2 = jax.random.split(k)
        num = jax.scipy.special.logsumexp(whole_log_weights(lf, _draw(lf, k1, full, n), full))
        den = jax.scipy.special.logsumexp(whole_log_weights(lf, _draw(lf, k2, q, n), q))
        return num - den

    return _compiled("ActiveLift conditional_encode (6.22)", lift, (("num_particles", n),), fn,
                     (full, q))(prng_key(rng_key))


@checked_jax
def conditional_decode(lift: ActiveLift, x: ArrayLike | str, num_samples: int = 1, num_particles: int = 1,
                       resample: bool = True, rng_key: Key | int | None = None) -> jax.Array:
    """Conditional decoding given a prompt x: ``[num_samples, max_x_len]`` right-padded texts X = x X'.

    ``resample=False`` or ``num_particles=1`` is (6.20): Z ~ Q(. | x), X ~ G(. | Z) continuing x (G reads
    ``z </s> x``, a per-row prompt, and decodes X'). ``resample=True`` is (6.21): n particles Z^(i) ~ Q(. | x) per
    sample, I ~ Categorical(p) with p_i proportional to G([x] | Z^(i)) P(Z^(i)) / Q(Z^(i) | x), then
    X ~ G(. | Z^(I)); its law approaches P_model(. | [x]) as n grows (the bound after (6.21)). One compiled run."""
    m = integer("num_samples", num_samples, minimum=1)
    n = integer("num_particles", num_particles, minimum=1)
    xs = _ids(lift, x)
    L = int(xs.shape[0])
    if L >= lift.max_x_len or (L and int(xs[-1]) == EOS_ID):
        raise ActiveLiftError(f"the prompt must be shorter than max_x_len = {lift.max_x_len} and not end with <eos>")
    res = bool(resample) and n > 1

    def resample_and_decode(lf, k, xs):
        k1, k2, k3 = jax.random.split(k, 3)
        z = _draw(lf, k1, xs, m * n)
        if res:
            logw = whole_log_weights(lf, z, xs).reshape(m, n)
            idx = jax.random.categorical(k2, logw, -1)
            z = z.reshape(m, n, -1)[jnp.arange(m), idx]
        else:
            z = z.reshape(m, n, -1)[:, 0]
        rows = jnp.broadcast_to(xs, (m, L))
        prompt = jnp.concatenate([z.astype(jnp.int32), jnp.full((m, 1), END_THINK_ID, jnp.int32), rows], 1)
        cont = LMSequence(lf.generator_lm, prompt=prompt, constraint=lf._sigma_auto, stop=EOS_ID,
                          max_len=lf.max_x_len - L).sample(k3)
        return jnp.concatenate([rows, cont], 1)

    return _compiled("ActiveLift conditional_decode (6.20)-(6.21)", lift,
                     (("num_samples", m), ("num_particles", n), ("resample", res)), resample_and_decode,
                     (xs,))(prng_key(rng_key))
