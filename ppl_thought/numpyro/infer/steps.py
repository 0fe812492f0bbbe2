"""The one JAX engine core over any :class:`~ppl_thought.numpyro.program.Program`: SMC (and Importance, the same run
without resampling) compiled as one function (docs/architecture.md, "One protocol, two backends"; torch twin:
ppl_thought/inference/smc.py).

At step t every particle runs the guide's step (or, with ``guide=None``, the model's own sample statements: the
bootstrap) under ``numpyro.handlers.seed`` and ``trace`` inside ``numpyro.plate("particles", n)``, then the
model's step replayed on the guide's values, and gets the incremental weight

    w_t^i = p(sites of step t) / q(latent sites of step t) * psi_t^i / psi_{t-1}^i

(psi: the ``ptn.twist`` potential; a finishing particle divides its last one out). Z-hat = prod_t (1/n)
sum_i W_{t-1}^i w_t^i is unbiased ((2.22) for a slow-thinking program): when the ESS falls under
``ess_threshold * n`` the particles are resampled (systematic) and every leaf of both programs' ``state`` is
gathered by the ancestors, their weights set to the mean. The step loop is a ``lax.while_loop`` of at most
``max_steps`` steps that stops once every particle finished; finished particles get weight 0 and frozen state.
No ``lax.cond`` sits on the state's path (XLA copies every operand of a conditional, LM caches included, even
through the branch that returns them unchanged): a step without resampling gathers by the identity, so freezing
and resampling are one fused pass over the state. The whole run (init, steps, resampling decisions, the
lineage of every recorded site) is one ``jax.jit``; compiled runs are cached at module level by what the run depends on
(:mod:`ppl_thought.numpyro.infer.compiled`: the program's and guide's classes and configuration, their JAX
arrays by shape, passed in as arguments; argument shapes; static arguments by value; the engine's
configuration), never by object identity, so a new program instance of the same class and a fresh engine
object reuse them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.handlers import seed, trace

from ppl_thought.errors import (
    ConcreteValueError,
    ConfigError,
    NumericalError,
    ProgramError,
    SiteMismatchError,
    ZeroWeightsError,
    zero_weights_message,
)
from ppl_thought.numpyro.infer.compiled import (
    Fingerprint,
    arg_names,
    as_traced_arg,
    explain,
    record_compile,
    record_hit,
)
from ppl_thought.numpyro.infer.resampling import effective_sample_size, log_mean_exp, systematic_resample
from ppl_thought.numpyro.infer.result import Result, log_marginal_stderr
from ppl_thought.numpyro.program import PARTICLES, as_done, is_output, is_program
from ppl_thought.twists import collect_twists

__all__ = ["StepEngine", "as_programs", "clear_cache", "compilations", "program_result"]

#: how many times a run was traced (= compiled); tests read it through :func:`compilations`
_TRACES = [0]
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 64
#: (engine type, engine, model class, guide class) whose programs read an attribute concretely while traced:
#: compiled with every array a constant keyed by value
_CONSTANT_MODE: set = set()

_TRACER_ERRORS = tuple(getattr(jax.errors, n) for n in ("TracerArrayConversionError", "ConcretizationTypeError",
                                                         "TracerBoolConversionError", "TracerIntegerConversionError")
                       if hasattr(jax.errors, n))


def compilations() -> int:
    """How many program runs were traced and compiled in this process (a cache hit adds nothing)."""
    return _TRACES[0]


def clear_cache() -> None:
    """Forget every compiled program run."""
    _CACHE.clear()


class _StepOut(NamedTuple):
    log_w: jax.Array  # [n]
    values: dict  # latent and output site values of the step, [n, ...]
    done: jax.Array | None
    log_psi: jax.Array | None


def _site_log_prob(site: dict, n: int, depth: int) -> jax.Array:
    """A site's log-density per particle ``[n]``: summed over the program's own plates (right of the particle dim)."""
    fn, value = site["fn"], site["value"]
    lp = fn.log_prob(value, site["intermediates"]) if site.get("intermediates") else fn.log_prob(value)
    if site.get("scale") is not None:
        lp = site["scale"] * lp
    lp = jnp.asarray(lp)
    if depth:
        lp = jnp.reshape(lp, (1,) * max(0, depth + 1 - lp.ndim) + lp.shape)
        lp = lp.sum(tuple(range(lp.ndim - depth, lp.ndim)))
    lp = jnp.reshape(lp, (-1,) + lp.shape[-1:]).sum(0) if lp.ndim > 1 else lp
    return jnp.broadcast_to(lp, (n,))


def _latent(site: dict) -> bool:
    return site["type"] == "sample" and not site["is_observed"] and not is_output(site)


def _plate_shape(site: dict, n: int, depth: int) -> tuple:
    """The batch shape the contract asks of a site: ``[n]`` at the particle dim ``-(depth + 1)``, the size of each
    plate of the program that encloses it at that plate's dim, 1 elsewhere (NumPyro's plate broadcasting)."""
    shape = [1] * (depth + 1)
    for frame in site.get("cond_indep_stack") or ():
        if frame.dim is not None and -(depth + 1) <= frame.dim < 0:
            shape[frame.dim] = frame.size
    return tuple(shape)


def _check_sites(tr: dict, who: str, n: int, depth: int, at: str) -> None:
    """Every sample site (``factor`` and ``observe`` included) has batch shape exactly :func:`_plate_shape`:
    a distribution of batch shape ``[n, 1]`` is broadcast by the particle plate to ``[n, n]`` and every particle
    would be weighed by n terms (a wrong log Z-hat, silently). Shapes are static: the check costs nothing at run
    time."""
    for k, s in tr.items():
        if s["type"] != "sample":
            continue
        batch, want = tuple(s["fn"].batch_shape), _plate_shape(s, n, depth)
        if batch == want:
            continue
        outside = [f.name for f in s.get("cond_indep_stack") or () if f.dim is not None and f.dim < -(depth + 1)]
        hint = (f"it sits in plate(s) {outside} outside the max_plate_nesting={depth} the program declares: set "
                "the class attribute max_plate_nesting to the number of plates a step opens" if outside else
                f"the particle plate broadcasts a distribution of batch shape [n, 1] (or [1, n], or an extra dim) "
                f"to {batch}, and each particle's weight would sum {int(np.prod(batch)) // n} terms instead of one: "
                f"give the distribution's parameters the batch shape [n] = ({n},) (a Python scalar or a [1] "
                "parameter broadcasts), move vector dims to the event (.to_event(1)), or open a numpyro.plate for "
                "them and declare max_plate_nesting")
        raise ProgramError(f"{at}: site {k!r} of {who} has batch shape {batch}; a site's batch shape must be exactly "
                           f"{want} ([num_particles={n}] plus the dims of the plates the program declares, "
                           f"max_plate_nesting={depth}; event dims after them): {hint}")


def _run_step(model_fn, guide_fn, key, n: int, depth: int, where: str, name: str = "the program") -> _StepOut:
    """One step (or init) of model and guide for all particles, traced; weights and the contract's checks of
    sites, twists and finished flags (static shapes: checked while tracing, free at run time)."""
    kq, kp = jax.random.split(key)
    at = f"{name}.{where.split()[-1]}"

    def plated(fn):
        def f():
            with numpyro.plate(PARTICLES, n, dim=-(depth + 1)):
                return fn()
        return f

    g_tr = None
    try:
        if guide_fn is not None:
            g_tr = trace(seed(plated(guide_fn), kq)).get_trace()
        with collect_twists() as tw:
            if g_tr is None:
                m_tr = trace(seed(plated(model_fn), kp))
            else:  # the guide's observed sites are not replayed: a latent site it observes is refused below
                m_tr = trace(_replay_values(seed(plated(model_fn), kp),
                                            {k: s for k, s in g_tr.items() if not s.get("is_observed")}))
            done = m_tr()
            m_tr = m_tr.trace
    except ProgramError as e:  # e.g. ptn.twist of the wrong shape: say which program and step
        if str(e).startswith(at):
            raise
        raise ProgramError(f"{at}: {e}") from e
    for tr, who in ((m_tr, "the model"), (g_tr or {}, "the guide")):
        traced = [k for k in tr if "Tracer" in k or "Traced<" in k]  # str() of a tracer, by JAX version
        if traced:
            raise ProgramError(f"{who} names a site {traced[0]!r} {where} from a traced value (e.g. f'thought_{{t}}'): "
                               "in a JAX program t is traced and every step has the same sites; name it without t "
                               "(the engine stacks a step site's values over steps: samples[name] is [n, steps, ...])")
    sites = {k: s for k, s in m_tr.items() if s["type"] == "sample"}
    latent = [k for k, s in sites.items() if _latent(s)]
    _check_sites(m_tr, name, n, depth, at)
    if g_tr is not None:
        observed = [k for k in latent if k in g_tr and g_tr[k]["type"] == "sample" and g_tr[k]["is_observed"]]
        if observed:
            raise ProgramError(f"{at}: the guide observes site {observed[0]!r}, a latent site of {name}: a guide "
                               "proposes the model's latent sites (ptn.sample / numpyro.sample without obs=); "
                               "condition on data in the model (ptn.observe), not in the guide")
        _check_sites(g_tr, "the guide", n, depth, at)
    log_w = jnp.zeros(n)
    if g_tr is not None:
        proposed = [k for k, s in g_tr.items() if s["type"] == "sample" and not s["is_observed"]]
        missing = [k for k in latent if k not in proposed]
        extra = [k for k in proposed if k not in latent]
        if missing:
            raise SiteMismatchError(
                f"the guide does not sample the model's latent site(s) {missing} {where}: the model would draw them "
                f"from its prior and the weights would be wrong (guide samples {proposed}, model latents {latent}); "
                f"add numpyro.sample({missing[0]!r}, ...) to the guide's {where.split()[-1]}")
        if extra:
            outs = [k for k in extra if k in sites]
            raise SiteMismatchError(
                f"the guide samples {extra} {where}, which the model " +
                (f"has as outputs or observations ({outs}): the guide proposes latent sites only"
                 if outs else f"does not sample (model latents {latent}): rename or drop them in the guide"))
        for k in latent:
            gs, ms = g_tr[k], sites[k]
            shape = tuple(ms["fn"].batch_shape) + tuple(ms["fn"].event_shape)
            if jnp.shape(gs["value"]) != shape:
                raise SiteMismatchError(f"site {k!r} {where}: the guide's value has shape {jnp.shape(gs['value'])}, "
                                        f"the model's distribution {shape}")
            log_w = log_w - _site_log_prob(gs, n, depth)
    for s in sites.values():
        if is_output(s) or (g_tr is None and _latent(s)):
            continue
        log_w = log_w + _site_log_prob(s, n, depth)
    values = {k: s["value"] for k, s in sites.items() if not s["is_observed"]}
    log_psi = tw.log_psi
    if log_psi is not None and jnp.shape(log_psi) != (n,):
        raise ProgramError(f"{at}: the twist log psi has shape {tuple(jnp.shape(log_psi))}; a twist is one "
                           f"potential per particle, shape ({n},) exactly")
    try:
        return _StepOut(log_w, values, as_done(done, n), log_psi)
    except ProgramError as e:
        raise ProgramError(f"{at}: {e}") from e


class _replay_values(numpyro.primitives.Messenger):
    """``numpyro.handlers.replay`` less its copy of the guide's ``infer``: a latent site of the model takes the
    guide's value, and an output site (``ptn.observe(name, fn, None)``) stays the model's own draw with its output
    flag, so a guide that samples it is refused by the site check (NumPyro's replay copies the guide's ``infer``
    over the model's: the output flag was lost, and the output's log p - log q entered the weights silently)."""

    def __init__(self, fn: Any, guide_trace: dict):
        super().__init__(fn)
        self.guide_trace = guide_trace

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "sample" and msg["name"] in self.guide_trace and not msg["is_observed"] \
                and not is_output(msg):
            msg["value"] = self.guide_trace[msg["name"]]["value"]


def _check_state(state: Any, n: int, who: str, where: str = "init") -> None:
    """The contract on a program's state: a dict whose every leaf (through dicts, lists, tuples and registered
    pytrees such as ``LMState``) is an array with leading dim n, so that resampling gathers every entry by the
    ancestors and a finished particle's rows freeze. A Python scalar or a 0-d array (shared by every particle)
    would be neither gathered nor frozen: refused, as is any leaf that is not an array."""
    if not isinstance(state, dict):
        raise ProgramError(f"{who}.{where}: state is a {type(state).__name__}; it is a dict (assign its entries, "
                           "state['name'] = ..., do not rebind it)")
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        entry = f"state{jax.tree_util.keystr(path)}"
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise ProgramError(f"{who}.{where}: {entry} is a {type(leaf).__name__} ({leaf!r:.40}); every state "
                               f"entry is an array [num_particles={n}, ...] or a pytree of them (dict, list, tuple, "
                               f"LMState): a per-particle value as jnp.full(({n},), value), a constant shared by "
                               "every particle as an attribute of the program")
        shape = tuple(jnp.shape(leaf))
        if not shape or shape[0] != n:
            raise ProgramError(f"{who}.{where}: {entry} has shape {shape}; state arrays are [num_particles={n}, ...] "
                               "so that resampling gathers them and a finished particle's rows freeze (keep "
                               "constants shared by every particle on the program object)")


def _freeze(finished: jax.Array, old, new):
    """Keep the state rows of finished particles as they were before the step."""
    def f(a, b):
        if not jnp.ndim(b):
            return b
        return jnp.where(finished.reshape(finished.shape + (1,) * (jnp.ndim(b) - 1)), a, b)
    return jax.tree.map(f, old, new)


def _gather(tree, idx: jax.Array, n: int):
    return jax.tree.map(lambda a: a[idx] if jnp.ndim(a) and jnp.shape(a)[0] == n else a, tree)


def _same_structure(before: dict, after: dict, who: str, t_desc: str) -> None:
    sb, sa = jax.tree.structure(before), jax.tree.structure(after)
    if sb != sa:
        raise ProgramError(f"{who}.step changed the structure or shapes of its state ({t_desc}): keys "
                           f"{sorted(before)} -> {sorted(after)}, {sb} -> {sa}; a JAX program keeps every state "
                           "entry across steps (no new keys, no appends to a list: preallocate buffers in init)")
    flat_b = jax.tree_util.tree_flatten_with_path(before)[0]
    for (path, a), b in zip(flat_b, jax.tree.leaves(after)):
        if (jnp.shape(a), jnp.result_type(a)) != (jnp.shape(b), jnp.result_type(b)):
            raise ProgramError(f"{who}.step changed the structure or shapes of its state ({t_desc}): "
                               f"state{jax.tree_util.keystr(path)} from "
                               f"{jnp.result_type(a)}{list(jnp.shape(a))} to {jnp.result_type(b)}"
                               f"{list(jnp.shape(b))}; a JAX program keeps every state entry's shape and dtype across "
                               "steps (size LM states with max_len= at start, preallocate buffers in init)")


def as_programs(model: Any, guide: Any, args: tuple, engine: str) -> tuple[Any, Any, tuple, dict]:
    """``(model, guide, run_args, observed)`` for an engine called as ``run(model, guide, *args)``: a program
    (``init`` / ``step``) runs as it is, with ``args``. An object that is not a program may implement the protocol
    method ``as_program(*args) -> ptn.Program``, the program it stands for given these arguments (bound in it):
    the engine then runs ``model.as_program(*args)`` with no arguments, and a guide that is not a program is bound
    the same way (``guide.as_program(*args)``). ``as_program`` may raise ``NotInImageError`` when the arguments
    have probability 0 (the engine then returns log Z-hat = -inf), or return ``None`` when no program binds them
    (a ``ConfigError`` here). No model class is special-cased."""
    observed = {"args": args}
    if is_program(model):
        if guide is not None and not is_program(guide) and callable(getattr(guide, "as_program", None)):
            raise ConfigError(f"{engine}: the model {type(model).__name__} is a program run with the arguments, so the "
                              f"guide must be a program too (or None), got {type(guide).__name__}: pass "
                              "guide.as_program(*args) with a model bound the same way, or a guide program")
        return model, guide, args, observed
    bind = getattr(model, "as_program", None)
    if not callable(bind) or isinstance(model, type):
        raise ConfigError(f"{engine} runs a ptn.Program (init / step) or an object with the protocol method "
                          f"as_program(*args) -> ptn.Program (ptn.models.SlowThinking has one), got "
                          f"{type(model).__name__}: write the model as a ptn.Program (docs/programs.md), add "
                          "as_program to it, or run a whole-trace NumPyro model with ptn.infer.Importance")
    program = bind(*args)
    if program is None:
        raise ConfigError(f"{type(model).__name__}.as_program{args!r:.60} returned None: it has no program for these "
                          f"arguments (e.g. generation without data); {engine} runs a program")
    if not is_program(program):
        raise ProgramError(f"{type(model).__name__}.as_program returned a {type(program).__name__}, not a "
                           "ptn.Program (an object with init and step)")
    if guide is not None and not is_program(guide):
        gbind = getattr(guide, "as_program", None)
        if not callable(gbind):
            raise ConfigError(f"{engine}: the guide of {type(model).__name__} must be a ptn.Program, an object with "
                              f"as_program(*args) (a sampler of ptn.guides) or None, got {type(guide).__name__}")
        guide = gbind(*args)
    return program, guide, (), observed


class StepEngine:
    """What SMC and Importance share over programs: configuration, the compiled-run cache and the call."""

    def _program_run(self, model, guide, args: tuple, rng_key, static: tuple, threshold: float,
                     engine: str) -> dict:
        if not is_program(model):
            raise ConfigError(f"{engine}: model must be a ptn.Program here, got {type(model).__name__}")
        if guide is not None and not is_program(guide):
            raise SiteMismatchError(f"{engine}: the guide of a ptn.Program must be a ptn.Program with the same steps "
                                    f"and latent sites (or None: the bootstrap), got {type(guide).__name__}")
        n = self.num_particles
        T = getattr(model, "max_steps", None)
        if T is None:
            T = self.max_steps
        elif isinstance(T, (bool, np.bool_)) or not isinstance(T, (int, np.integer)) or T < 1:
            raise ProgramError(f"{type(model).__name__}.max_steps = {T!r}: the length of the compiled step loop is an "
                               "integer >= 1 (or None: the engine's max_steps=)")
        T = int(T)
        static = tuple(sorted({int(i) % max(len(args), 1) for i in static})) if args else ()
        dyn, stat = [], []
        for i, a in enumerate(args):
            if i in static or a is None or isinstance(a, str):
                stat.append((i, _static_key(a), _read_only(a)))
            else:
                dyn.append((i, as_traced_arg(a)))
        depth = max(int(getattr(model, "max_plate_nesting", 0) or 0),
                    int(getattr(guide, "max_plate_nesting", 0) or 0) if guide is not None else 0)
        groups = int(getattr(self, "groups", 1))
        classes = (type(self), engine, type(model), type(guide))
        constants = classes in _CONSTANT_MODE
        fp = Fingerprint((model, guide), trace_arrays=not constants)
        names = arg_names(getattr(model, "step", None), 2, len(args))
        parts = {"engine": (("num_particles", n), ("ess_threshold", float(threshold)), ("max_steps", T),
                            ("max_plate_nesting", depth), ("groups", groups)),
                 "mode": constants, "program": fp.parts[0], "guide": fp.parts[1],
                 "shapes": tuple((names[i], tuple(a.shape), str(a.dtype)) for i, a in dyn),
                 "static": (len(args), tuple((i, k) for i, k, _ in stat))}
        key = (classes, fp.key, tuple(parts.items()))
        hit = _CACHE.get(key)
        first = hit is None
        if first:
            consts = {i: a for i, _, a in stat}
            fn = self._build_program(fp, n, T, threshold, depth, len(args), consts, [i for i, _ in dyn],
                                     type(model).__name__)
            fn = jax.jit(fn if groups == 1 else jax.vmap(fn, in_axes=(0, None, None)))  # G runs: one vmap
            previous = next((h[2] for h in reversed(_CACHE.values()) if h[1] == classes), None)
            hit = (fn, classes, parts)
            _CACHE[key] = hit
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
            record_hit()
        rng = jax.random.PRNGKey(0) if rng_key is None else rng_key
        if groups != 1:
            rng = jax.random.split(rng, groups)
        try:
            start = time.perf_counter()
            out = hit[0](rng, fp.arrays, tuple(a for _, a in dyn))
            if first:
                jax.block_until_ready(out)
                record_compile(engine, type(model).__name__, type(guide).__name__, explain(previous, parts),
                               time.perf_counter() - start)
        except _TRACER_ERRORS as e:
            _CACHE.pop(key, None)
            if first and not constants and fp.arrays:
                # an attribute read concretely while traced: compile this class with its arrays as constants
                _CONSTANT_MODE.add(classes)
                try:
                    return self._program_run(model, guide, args, rng_key, static, threshold, engine)
                except BaseException:
                    _CONSTANT_MODE.discard(classes)  # not an attribute: the arguments' error below
                    raise
            raise ConcreteValueError(
                f"{type(model).__name__} (or its guide) needs a concrete value where the compiled run has a traced "
                f"one ({type(e).__name__}). Arguments are traced: pass the ones that must be concrete (e.g. what "
                f"an automaton is built from) with static=(index, ...) in run(...), "
                f"e.g. {engine}(...).run(model, guide, *args, static=(0,)); t is traced too: index arrays with it "
                "(x[t]) rather than int(t), and choose with jnp.where / mask sites with numpyro.handlers.mask "
                "instead of a Python if on traced values") from e
        except ValueError as e:
            _CACHE.pop(key, None)
            if "read-only" in str(e):  # numpy's refusal to write into a static argument's read-only copy
                raise ProgramError(f"{type(model).__name__} (or its guide) writes into one of its arguments ({e}): "
                                   "an engine never changes the caller's arguments, and a static argument is "
                                   "passed as a read-only copy; compute a new array (y = x * 0.5) instead of "
                                   "writing in place (x *= 0.5)") from e
            raise
        except BaseException:
            _CACHE.pop(key, None)
            raise
        done = bool(jnp.all(out["all_done"]))
        if not done:
            raise ProgramError(f"{type(model).__name__} did not finish within max_steps={T} steps: return a bool array "
                               "[num_particles] from step marking finished particles, and set the class attribute "
                               "max_steps (or the engine's max_steps=) to the number of steps it needs")
        return out

    def _build_program(self, fp: Fingerprint, n: int, T: int, threshold: float, depth: int, nargs: int,
                       consts: dict, dyn_idx: list, name: str):
        """The function to jit: ``(key, arrays, traced args) -> outputs``; ``arrays`` are the JAX arrays of the
        model and guide (their parameters, tables), which it rebuilds them around (:class:`Fingerprint`)."""
        drop = self._weigh

        def run(key, arrays, dyn):
            _TRACES[0] += 1
            args = [None] * nargs
            for i, a in consts.items():
                args[i] = a
            for i, a in zip(dyn_idx, dyn):
                args[i] = a
            model, guide = fp.rebuild(arrays)
            return self._trace_run(model, guide, n, T, threshold, depth, tuple(args), key, name, drop)

        return run

    def _weigh(self, inc: jax.Array, t: jax.Array) -> jax.Array:
        """The incremental log weight of step t as the engine adds it (the tests override this to show that a
        wrong weight fails the statistical checks)."""
        return inc

    def _trace_run(self, model, guide, n, T, threshold, depth, args, key, name, weigh):
        sm: dict = {}
        sg: dict = {}
        key, k0 = jax.random.split(key)
        init = _run_step(lambda: model.init(sm, *args), (lambda: guide.init(sg, *args)) if guide is not None else None,
                         k0, n, depth, "in init", name)
        _check_state(sm, n, name)
        _check_state(sg, n, f"the guide {type(guide).__name__}")
        lw0 = init.log_w
        finished0 = jnp.zeros(n, bool) if init.done is None else init.done

        def one(sm, sg, t, k):
            # fresh containers all the way down (an LMState extends itself in place): the old state stays intact
            # for the rows of finished particles (_freeze)
            sm2, sg2 = jax.tree.map(lambda a: a, sm), jax.tree.map(lambda a: a, sg)
            out = _run_step(lambda: model.step(sm2, t, *args),
                            (lambda: guide.step(sg2, t, *args)) if guide is not None else None,
                            k, n, depth, "in step", name)
            _same_structure(sm, sm2, name, "model")
            _same_structure(sg, sg2, "the guide", "guide")
            return sm2, sg2, out

        # shapes of a step's outputs, for the branch that skips a step once every particle finished
        shapes = jax.eval_shape(lambda sm, sg, k: one(sm, sg, jnp.zeros((), jnp.int32), k)[2], sm, sg, key)
        twisted = shapes.log_psi is not None
        has_done = shapes.done is not None
        clash = sorted(set(init.values) & set(shapes.values))
        if clash:
            raise ProgramError(f"site(s) {clash} are sampled in init and again in step: site names must differ")

        def body(carry):
            # one step for every particle: no lax.cond around it (a conditional's outputs are new buffers, so
            # XLA copies every state leaf, LM caches included, through an untaken branch); the loop itself
            # stops once every particle finished (a while_loop, not a scan over max_steps)
            t, sm, sg, lw, finished, prev_psi, key, bufs = carry
            key, ks, kr = jax.random.split(key, 3)
            sm2, sg2, out = one(sm, sg, t, ks)
            done = out.done if has_done else jnp.zeros(n, bool)
            now_done = finished | done
            inc = jnp.where(finished, 0.0, weigh(out.log_w, t))
            psi = prev_psi
            if twisted:
                psi = jnp.broadcast_to(jnp.asarray(out.log_psi, jnp.float32), (n,))
                psi = jnp.where(now_done, 0.0, psi)
                delta = jnp.where(jnp.isneginf(prev_psi) | finished, 0.0, psi - prev_psi)
                inc = jnp.where(jnp.isneginf(inc), inc, inc + delta)
            lw = lw + inc
            ess = effective_sample_size(lw, check=False)
            alive = ~jnp.isneginf(lw).all()
            flag = (ess < threshold * n) & ~now_done.all() & alive
            if threshold > 0:
                # the ancestors decided on the device; the identity where no resampling: then the gather below
                # is the one pass over the state that freezing the finished rows needs anyway
                idx = jnp.where(flag, systematic_resample(kr, lw), jnp.arange(n))
                lw = jnp.where(flag, jnp.full_like(lw, log_mean_exp(lw)), lw)
                psi, now_done = psi[idx], now_done[idx]
            else:
                idx = jnp.arange(n)
            # finished particles keep their state (frozen), then every row follows its ancestor: one fused pass
            sm = _gather(_freeze(finished, sm, sm2), idx, n) if threshold > 0 else _freeze(finished, sm, sm2)
            sg = _gather(_freeze(finished, sg, sg2), idx, n) if threshold > 0 else _freeze(finished, sg, sg2)
            vals, esss, flags, ancs = bufs
            vals = jax.tree.map(lambda b, v: b.at[t].set(v), vals, out.values)
            bufs = (vals, esss.at[t].set(ess), flags.at[t].set(flag), ancs.at[t].set(idx))
            return t + 1, sm, sg, lw, now_done, psi, key, bufs

        bufs0 = (jax.tree.map(lambda s: jnp.zeros((T,) + tuple(s.shape), s.dtype), shapes.values),
                 jnp.zeros(T), jnp.zeros(T, bool), jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (T, n)))
        carry = (jnp.zeros((), jnp.int32), sm, sg, lw0, finished0, jnp.zeros(n), key, bufs0)
        steps, sm, sg, lw, finished, _, _, (values, ess, flags, anc) = jax.lax.while_loop(
            lambda c: (c[0] < T) & ~c[4].all(), body, carry)
        ran = jnp.arange(T) < steps
        ess = jnp.where(ran, ess, effective_sample_size(lw, check=False))  # steps not run: the final weights' ESS

        def back(idx, inp):  # the lineage of every final particle: values of step t at its ancestor then
            vals, a = inp
            idx = a[idx]
            return idx, jax.tree.map(lambda v: v[idx] if jnp.ndim(v) and v.shape[0] == n else v, vals)

        _, values = jax.lax.scan(back, jnp.arange(n), (values, anc), reverse=True)
        comp = jax.lax.fori_loop(0, T, lambda t, idx: anc[T - 1 - t][idx], jnp.arange(n))  # init's lineage
        init_values = _gather(init.values, comp, n)
        samples = {k: jnp.moveaxis(v, 0, 1) if jnp.ndim(v) >= 2 else v for k, v in values.items()}
        samples.update(init_values)
        samples.update(model.outputs(sm, *args) if hasattr(model, "outputs") else {})
        return {"log_weights": lw, "log_marginal": log_mean_exp(lw), "samples": samples, "ess": ess,
                "resampled": flags, "ancestry": anc, "steps": ran.sum(), "all_done": finished.all()}


def program_result(out: dict, engine: str, args: tuple, observed: dict | None = None) -> Result:
    """The :class:`Result` of a compiled program run (:mod:`ppl_thought.numpyro.infer.steps`); a grouped run
    (``SMC(groups=G)``: every output with a leading ``[G]``) adds the pooled estimate of the G runs."""
    lw = out["log_weights"]
    grouped = lw.ndim == 2
    if bool(jnp.isnan(lw).any()):
        raise NumericalError(f"{engine}: NaN log weights (a log-probability, factor or twist is NaN)")
    if bool(jnp.isposinf(lw).any()):
        raise NumericalError(f"{engine}: a log weight of +inf (a log-probability or factor of +inf, e.g. "
                             "numpyro.factor(name, +inf) or ptn.factor(name, +inf) in a step): log Z-hat would be "
                             "inf and the ESS NaN; a log-potential must be finite or -inf")
    if bool(jnp.isneginf(lw).all(-1).any()):
        raise ZeroWeightsError(zero_weights_message(engine, lw.shape[-1], out.get("proposal", "the proposal"),
                                                    group="of a group " if grouped else ""))
    resampled = bool(out["resampled"].any())
    stats: dict[str, Any] = {"ess": out["ess"], "resampled": out["resampled"], "steps": int(jnp.max(out["steps"]))}
    logz = out["log_marginal"]
    if grouped:
        stats["log_marginal_pooled"] = log_mean_exp(logz)
        stats["log_marginal_pooled_stderr"] = log_marginal_stderr(logz)
    se = None if resampled else (jax.vmap(log_marginal_stderr)(lw) if grouped else log_marginal_stderr(lw))
    return Result(samples=out["samples"], log_weights=lw, log_marginal=logz, log_marginal_stderr=se,
                  ancestry=out["ancestry"], stats=stats, observed={"args": args} if observed is None else observed,
                  engine=engine)


def _read_only(a: Any) -> Any:
    """A static numpy argument as a read-only copy: a program that writes into it in place (at trace time) gets
    numpy's error (turned into a ProgramError) instead of changing the caller's array."""
    if isinstance(a, np.ndarray):
        a = a.copy()
        a.setflags(write=False)
    return a


def _static_key(a: Any):
    if a is None or isinstance(a, (bool, int, float, str)):
        return (type(a).__name__, a)
    arr = np.asarray(a)
    return ("array", arr.shape, str(arr.dtype), arr.tobytes())
