"""Importance sampling, the estimator (3.2), as one jitted ``vmap`` over particles (torch twin:
ppl_thought/inference/importance.py).

Each particle runs the guide under ``seed`` and ``trace``, the model is replayed on the guide's values, and
log w = log p(every model site) - log q(every guide site). For a slow-thinking model this is
S_i = log P^{<=|Z_i|}(Z_i) - log Q(Z_i | x) and log p_n = logsumexp(S) - log n (3.2) is unbiased for p on the
probability scale, with variance p^2 chi2(Q_* || Q) / n (3.4). ``guide=None`` proposes from the model itself.
"""

from __future__ import annotations

import functools
import time
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.handlers import replay, seed, trace

from ppl_thought.checks import integer
from ppl_thought.errors import (
    ConfigError,
    NotInImageError,
    NumericalError,
    ProgramError,
    SiteMismatchError,
    ZeroWeightsError,
    describe_proposal,
    zero_weights_message,
)
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.infer.compiled import (
    Fingerprint,
    arg_names,
    as_traced_arg,
    explain,
    record_compile,
    record_hit,
)
from ppl_thought.numpyro.infer.resampling import effective_sample_size, log_mean_exp, prng_key
from ppl_thought.numpyro.infer.result import Result, log_marginal_stderr
from ppl_thought.numpyro.infer.steps import _TRACER_ERRORS, StepEngine, _read_only, as_programs, program_result
from ppl_thought.numpyro.program import is_program
from ppl_thought.resources import check_particles


def site_log_prob(site: dict) -> jax.Array:
    """The summed log-density of one sample site (its intermediates reused when the sampler left them)."""
    fn, value = site["fn"], site["value"]
    lp = fn.log_prob(value, site["intermediates"]) if site.get("intermediates") else fn.log_prob(value)
    if site.get("scale") is not None:
        lp = site["scale"] * lp
    return jnp.sum(lp)


def log_weight_fn(model, guide, args: tuple, kwargs: dict):
    """``key -> (log w, log p, log q, latent values)`` for one particle (vmap it over keys)."""

    def one(key):
        kq, kp = jax.random.split(key)
        if guide is None:
            m_tr = trace(seed(model, kq)).get_trace(*args, **kwargs)
            log_p = sum((site_log_prob(s) for s in m_tr.values() if s["type"] == "sample" and s["is_observed"]),
                        jnp.zeros(()))
            values = {k: s["value"] for k, s in m_tr.items() if s["type"] == "sample" and not s["is_observed"]}
            return log_p, log_p, jnp.zeros(()), values
        g_tr = trace(seed(guide, kq)).get_trace(*args, **kwargs)
        m_tr = trace(replay(seed(model, kp), trace={k: s for k, s in g_tr.items() if not s.get("is_observed")})
                     ).get_trace(*args, **kwargs)
        latent = {k for k, s in m_tr.items() if s["type"] == "sample" and not s["is_observed"]}
        observed = sorted(k for k in latent if k in g_tr and g_tr[k]["type"] == "sample" and g_tr[k]["is_observed"])
        if observed:
            raise ProgramError(f"the guide {getattr(guide, '__name__', type(guide).__name__)} observes site "
                               f"{observed[0]!r}, a latent site of the model: a guide proposes the model's latent "
                               "sites (numpyro.sample without obs=); condition on data in the model")
        proposed = {k for k, s in g_tr.items() if s["type"] == "sample" and not s["is_observed"]}
        if not latent <= proposed:
            raise SiteMismatchError(f"the guide does not propose the model's latent sites {sorted(latent - proposed)}")
        log_q = sum((site_log_prob(s) for s in g_tr.values() if s["type"] == "sample" and not s["is_observed"]),
                    jnp.zeros(()))
        log_p = sum((site_log_prob(s) for s in m_tr.values() if s["type"] == "sample"), jnp.zeros(()))
        values = {k: g_tr[k]["value"] for k in sorted(proposed)}
        return jnp.where(jnp.isneginf(log_p), -jnp.inf, log_p - log_q), log_p, log_q, values

    return one


def infinite_sites(model, guide, args: tuple, kwargs: dict, key: jax.Array) -> list[str]:
    """The sites (``numpyro.factor`` included) whose log-probability is +inf in the particle drawn with ``key``
    (the same traces as :func:`log_weight_fn`, run once, eagerly: the error path of a run, never per particle)."""
    kq, kp = jax.random.split(key)
    traces = []
    if guide is None:
        traces.append(("model", trace(seed(model, kq)).get_trace(*args, **kwargs)))
    else:
        g_tr = trace(seed(guide, kq)).get_trace(*args, **kwargs)
        traces += [("guide", g_tr), ("model", trace(replay(seed(model, kp), trace=g_tr)).get_trace(*args, **kwargs))]
    return [f"{k!r} ({who})" for who, tr in traces for k, s in tr.items()
            if s["type"] == "sample" and bool(jnp.isposinf(site_log_prob(s)))]


def summarise(log_w: jax.Array, what: str, sites=None, proposal: str = "the proposal") -> dict[str, Any]:
    """log Z-hat (3.2), its delta-method SE, ESS; NumericalError on NaN or +inf (naming the sites of +inf
    log-probability when ``sites(i)`` can find them for particle i), ZeroWeightsError naming ``proposal`` if every
    weight is 0 (errors.zero_weights_message, the one rule of both backends)."""
    if bool(jnp.isnan(log_w).any()):
        raise NumericalError(f"{what}: NaN log weights (a model or guide log-probability is NaN)")
    if bool(jnp.isposinf(log_w).any()):
        i = int(jnp.argmax(jnp.isposinf(log_w)))
        named = sites(i) if sites is not None else []
        where = f" at site(s) {', '.join(named)}" if named else ""
        raise NumericalError(f"{what}: a log-probability of +inf{where} (e.g. numpyro.factor(name, +inf)): the "
                             "weights would be +inf, log Z-hat inf and the ESS NaN")
    if bool(jnp.isneginf(log_w).all()):
        raise ZeroWeightsError(zero_weights_message(what, log_w.shape[-1], proposal))
    return {"log_marginal": log_mean_exp(log_w), "log_marginal_stderr": log_marginal_stderr(log_w),
            "ess": effective_sample_size(log_w)}


def not_in_image_result(message: str, n: int, engine: str, observed: dict) -> Result:
    """p(x) = 0 exactly (x outside the image of Proj): log Z-hat = -inf, every weight zero, with a warning."""
    warnings.warn(message, stacklevel=3)
    return Result(samples={}, log_weights=jnp.full((n,), -jnp.inf), log_marginal=jnp.asarray(-jnp.inf),
                  log_marginal_stderr=jnp.asarray(0.0), stats={"message": message}, observed=observed, engine=engine)


#: compiled whole-trace weight functions, shared by every Importance object and every model instance of the same
#: configuration (keyed as in :mod:`ppl_thought.numpyro.infer.compiled`; the arguments by value: the automata are
#: built from them)
_COMPILED: OrderedDict = OrderedDict()
_CONSTANT_MODE: set = set()


def _normalised(a: Any) -> Any:
    """A whole-trace argument as the engine hands it to the model and keys it: scalars and arrays as read-only
    numpy arrays of JAX's canonical dtype (``3`` and ``jnp.array(3)`` are the same ``int32[]``)."""
    if isinstance(a, (bool, int, float, np.ndarray, np.generic, jax.Array)) and not isinstance(a, str):
        return _read_only(np.array(as_traced_arg(a)))
    return _read_only(a)


@checked_jax
class Importance(StepEngine):
    """Vectorised importance sampling, estimator (3.2): ``Importance(n).run(model, guide, *args, rng_key=key)``.

    The per-particle trace (guide, then the model replayed on it) is ``vmap``-ed over ``n`` keys and ``jit``-ed;
    the observation is a constant of the compiled function (the automata are built from it), so a new x
    compiles anew; the compiled function is kept at module level per model and guide class and configuration
    (their JAX arrays, e.g. LM parameters, are arguments: a new instance with other weights reuses it) and
    argument values (``3`` and ``jnp.array(3)`` alike), so a fresh ``Importance`` object reuses it
    (docs/numpyro.md, "Compilation").

    A model that is a plain NumPyro model (a callable) runs as whole traces even when it also implements the
    protocol method ``as_program(*args)`` (``ptn.models.SlowThinking``); the engine only binds it first, so that
    data of probability 0 exactly (``as_program`` raises ``NotInImageError``) gives log Z-hat = -inf with a
    warning, as under SMC. A :class:`~ppl_thought.numpyro.program.Program` runs through the generic step engine
    (:mod:`ppl_thought.numpyro.infer.steps`) without resampling: ``run(program, guide, *args, rng_key=key,
    static=())``, the same weights as whole traces (its arguments traced, ``static`` as for SMC).
    Returns a :class:`Result`: ``log_weights [n]``, ``log_marginal``, ``log_marginal_stderr`` (delta method),
    ``samples`` (the guide's latent sites), ``stats`` with ``ess``, ``log_p``, ``log_q``.
    """

    def __init__(self, num_particles: int, max_steps: int = 64):
        self.num_particles = integer("num_particles", num_particles)
        self.max_steps = integer("max_steps", max_steps)
        check_particles("ptn.infer.Importance", self.num_particles)  # before jit: never the allocator's error

    def compiled(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> Callable:
        """The compiled ``keys [n, 2] -> (log w, log p, log q, values)`` for these arguments: cached by the
        model's and guide's classes and configuration (their JAX arrays by shape: passed in as arguments) and
        the arguments by value, never by object identity (:mod:`ppl_thought.numpyro.infer.compiled`)."""
        args = tuple(_normalised(a) for a in args)  # the model is traced on copies: never the caller's
        kwargs = {k: _normalised(v) for k, v in kwargs.items()}
        classes = (type(model) if not isinstance(model, types.FunctionType) else model,
                   type(guide) if not isinstance(guide, types.FunctionType) else guide)
        constants = classes in _CONSTANT_MODE
        fp = Fingerprint((model, guide), trace_arrays=not constants)
        data = Fingerprint((args, kwargs), trace_arrays=False)
        names = arg_names(model, 0, len(args))
        parts = {"engine": (("num_particles", self.num_particles),), "mode": constants, "program": fp.parts[0],
                 "guide": fp.parts[1], "shapes": tuple((names[i], tuple(np.shape(a)), str(getattr(a, "dtype", "")))
                                                      for i, a in enumerate(args)), "static": data.key}
        key = (classes, fp.key, data.key)
        hit = _COMPILED.get(key)
        if hit is not None:
            _COMPILED.move_to_end(key)
            record_hit()
            jitted_hit, arrays = hit[0], fp.arrays  # called as ``first`` called it: positionally (jit keys a
            return lambda keys: jitted_hit(keys, arrays)  # keyword argument apart: a retrace and a second compile)

        def weights(keys, arrays):
            m, g = fp.rebuild(arrays)
            return jax.vmap(log_weight_fn(m, g, args, kwargs))(keys)

        jitted = jax.jit(weights)
        previous = next((h[2] for h in reversed(_COMPILED.values()) if h[1] == classes), None)
        name = getattr(model, "__name__", type(model).__name__)
        gname = getattr(guide, "__name__", type(guide).__name__)

        def first(keys, arrays):  # the first call compiles: timed, recorded; an attribute read concretely
            start = time.perf_counter()  # while traced sends the class to constants mode
            try:
                out = jax.block_until_ready(jitted(keys, arrays))
            except _TRACER_ERRORS:
                _COMPILED.pop(key, None)
                if constants or not arrays:
                    raise
                _CONSTANT_MODE.add(classes)
                try:
                    return self.compiled(model, guide, *args, **kwargs)(keys)
                except BaseException:
                    _CONSTANT_MODE.discard(classes)
                    raise
            except BaseException:
                _COMPILED.pop(key, None)
                raise
            _COMPILED[key] = (jitted, classes, parts)
            while len(_COMPILED) > 32:
                _COMPILED.popitem(last=False)
            record_compile("Importance", name, gname, explain(previous, parts), time.perf_counter() - start)
            return out

        return functools.partial(first, arrays=fp.arrays)

    def run(self, model: Any, guide: Any, *args: Any, rng_key: jax.Array | int | None = None, static: tuple = (),
            **kwargs: Any) -> Result:
        """Draw n particles from the guide, weight them by p/q, and estimate log p(data) by (3.2).

        ``rng_key``: a ``jax.random.PRNGKey`` or an int seed (``PRNGKey(seed)``); default ``PRNGKey(0)``."""
        if is_program(model) or (not callable(model) and callable(getattr(model, "as_program", None))):
            model, guide, args, observed = as_programs(model, guide, args, "Importance")
            if kwargs:
                raise ConfigError(f"Importance.run on a ptn.Program takes positional arguments only, got "
                                  f"{sorted(kwargs)}")
            out = self._program_run(model, guide, args, prng_key(rng_key), static if args else (), 0.0, "Importance")
            out["proposal"] = describe_proposal(guide)  # named by a ZeroWeightsError (the one rule, errors.py)
            return program_result(out, "Importance", args, observed)
        n = self.num_particles
        observed = {"args": args, "kwargs": kwargs}
        key = prng_key(rng_key)  # an int seed is accepted: PRNGKey(seed)
        try:
            bind = getattr(model, "as_program", None)
            if callable(bind) and not isinstance(model, type):
                bind(*args, **kwargs)  # the protocol's as_program raises NotInImageError where p(data) = 0
            log_w, log_p, log_q, values = self.compiled(model, guide, *args, **kwargs)(jax.random.split(key, n))
        except NotInImageError as e:
            return not_in_image_result(f"log p(x) = -inf: {e}", n, "Importance", observed)
        args_c, kwargs_c = tuple(_normalised(a) for a in args), {k: _normalised(v) for k, v in kwargs.items()}
        stats = summarise(log_w, "Importance", lambda i: infinite_sites(model, guide, args_c, kwargs_c,
                                                                        jax.random.split(key, n)[i]),
                          describe_proposal(guide))
        return Result(samples=dict(values), log_weights=log_w, log_marginal=stats.pop("log_marginal"),
                      log_marginal_stderr=stats.pop("log_marginal_stderr"),
                      stats={**stats, "log_p": log_p, "log_q": log_q}, observed=observed, engine="Importance")
