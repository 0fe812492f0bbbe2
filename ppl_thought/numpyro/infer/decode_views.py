"""The program side of :func:`~ppl_thought.numpyro.infer.decode.decode` (torch twin:
ppl_thought/inference/decoding_program.py): the *decoding view* of a program and of its guide, which the generic
engine core (:mod:`ppl_thought.numpyro.infer.steps`) runs like any other pair of programs, and the compiled step of
streaming decoding.

The view of a program runs its ``init`` / ``step`` unchanged and adds, at trace time (nothing here runs per token
outside the compiled code):

* **where each output was drawn.** An output site ``s`` (``ptn.observe(s, d, None)``) of step t is *active* for
  a particle that had not finished before step t and whose site is not masked (``numpyro.handlers.mask``: a JAX
  program masks the sites a traced ``t`` turns off, e.g. an output before the end of the prompt). The view records
  it as an extra output site ``"_pt_active/s"`` (``"_pt_active_init/s"`` for a site of ``init``), a ``Delta`` out
  of the weights; its own state entry ``"_pt_decode_done"`` (frozen with the rest once a particle finished) says
  which particles had finished.
* **partial guides.** A guide proposes the prompt's latents; a latent site of the program that the guide's step
  does not sample (the continuation's latents) is drawn by the program and left out of the weights, like an
  output (the torch side's ``partial_guide``). The guide's view records the names its step proposed, the
  program's view reads them in the same trace (the engine traces the guide's step first).
* **conditioning on outputs** (best-of-K, (3.2) on x y): with ``conditioned=(site, ...)`` the view takes, after
  the program's arguments, each site's values ``[R, T, ...]`` (``[R, ...]`` for a site of ``init``) and active
  flags, and the last step with an active output ``[R]``; the output becomes an observation (in the weights) and
  a particle that draws an output where its candidate has none, or the other way round, or finishes before the
  candidate's last output, gets weight 0 (``numpyro.factor`` of -inf).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as nd
from numpyro.distributions.distribution import MaskedDistribution
from numpyro.primitives import Messenger

from ppl_thought.errors import ConfigError, ProgramError, SiteMismatchError
from ppl_thought.numpyro.infer.compiled import Fingerprint, as_traced_arg, explain, record_compile, record_hit
from ppl_thought.numpyro.infer.steps import (
    _TRACER_ERRORS,
    StepEngine,
    _check_state,
    _read_only,
    _run_step,
    _same_structure,
    _static_key,
)
from ppl_thought.numpyro.program import OUTPUT, Program, as_done, is_program, particles

ACTIVE = "_pt_active/"  # prefix of the recorded active flags of a step's output site
ACTIVE_INIT = "_pt_active_init/"  # ... of an output site of init
DONE = "_pt_decode_done"  # the view's state entry: the particle had finished
CONTINUATION = "_pt_continuation"  # infer key: a latent the guide does not propose, drawn by the program


def _mask_of(fn: Any, n: int) -> jax.Array:
    """``[n]`` bool: the rows of a site that its masks (``numpyro.handlers.mask``) leave on."""
    m = jnp.ones((), bool)
    while isinstance(fn, MaskedDistribution):
        m = m & jnp.asarray(fn._mask, bool)
        fn = fn.base_dist
    m = jnp.broadcast_to(m, tuple(fn.batch_shape))
    return m.reshape(n, -1).any(-1) if m.ndim else jnp.broadcast_to(m, (n,))


class _Proposed(Messenger):
    """Records the names of the latent sites a guide's step samples."""

    def __init__(self, names: set):
        super().__init__()
        self.names = names

    def process_message(self, msg) -> None:
        if msg["type"] == "sample" and not msg["is_observed"]:
            self.names.add(msg["name"])


class _Outputs(Messenger):
    """Inside the program's view: marks the latents the guide did not propose as drawn by the program, records
    the mask of every output site and, when conditioning, fixes output sites to the given values."""

    def __init__(self, proposed: set | None, data: dict, t: Any):
        super().__init__()
        self.proposed, self.data, self.t = proposed, data, t
        self.masks: dict = {}

    def process_message(self, msg) -> None:
        if msg["type"] != "sample" or msg["is_observed"]:
            return
        infer = msg.get("infer") or {}
        if not infer.get(OUTPUT, False):
            if self.proposed is not None and msg["name"] not in self.proposed:
                msg["infer"] = {**infer, OUTPUT: True, CONTINUATION: True}
            return
        if infer.get(CONTINUATION, False):
            return
        if self.proposed is not None and msg["name"] in self.proposed:
            # checked here: numpyro's replay would copy the guide's infer onto the site and make it a latent
            raise SiteMismatchError(f"the guide samples {msg['name']!r}, which the program has as an output "
                                    "(ptn.observe(name, d, None)): a guide proposes the prompt's latent sites only; "
                                    "the program draws its outputs")
        n = particles()
        self.masks[msg["name"]] = _mask_of(msg["fn"], n)
        got = self.data.get(msg["name"])
        if got is not None:
            value = got[0] if self.t is None else jnp.take(got[0], self.t, axis=1)
            msg["value"] = value.reshape(tuple(msg["fn"].batch_shape) + tuple(msg["fn"].event_shape))
            msg["is_observed"] = True
            msg["infer"] = {**infer, OUTPUT: False}


def _record_active(name: str, active: jax.Array, depth: int, init: bool) -> None:
    v = active.astype(jnp.int32).reshape((-1,) + (1,) * depth)
    numpyro.sample((ACTIVE_INIT if init else ACTIVE) + name, nd.Delta(v), infer={OUTPUT: True})


class DecodingView(Program):
    """A program as :func:`decode` runs it (module docstring). ``view_of(program, guided, conditioned)`` makes
    one; its class carries the program's class name, so the engine's errors and ``ptn.compile_stats()`` name the
    user's program."""

    def __init__(self, program: Any, guided: bool, conditioned: tuple, shared: dict):
        self.program, self.guided, self.conditioned = program, guided, tuple(conditioned)
        self.max_steps = getattr(program, "max_steps", None)
        self.max_plate_nesting = int(getattr(program, "max_plate_nesting", 0) or 0)
        self._sites_cache = shared  # the guide's proposals at trace time (not configuration: skipped by the key)

    def _split(self, args: tuple) -> tuple[tuple, dict, Any]:
        k = len(self.conditioned)
        if not k:
            return args, {}, None
        user, extra = args[:-(2 * k + 1)], args[-(2 * k + 1):]
        data = {name: (extra[2 * i], extra[2 * i + 1]) for i, name in enumerate(self.conditioned)}
        return user, data, extra[-1]

    def _run(self, fn, state: dict, t: Any, args: tuple) -> Any:
        user, data, last = self._split(args)
        proposed = self._sites_cache.get("proposed", set()) if self.guided else None
        n = particles()
        prev = state.get(DONE, jnp.zeros(n, bool))
        sub = {k: v for k, v in state.items() if k != DONE}
        rec = _Outputs(proposed, data, t)
        with rec:
            done = fn(sub, *user) if t is None else fn(sub, t, *user)
        depth = self.max_plate_nesting
        d = as_done(done, n) if t is not None else None
        for name, mask in rec.masks.items():
            active = mask & ~prev
            if name in data:  # conditioned: the particle draws here exactly where its candidate did
                want = data[name][1].astype(bool)
                want = want if t is None else jnp.take(want, t, axis=1)
                numpyro.factor(f"_pt_match/{name}", jnp.where(active == want.reshape(n), 0.0, -jnp.inf))
            _record_active(name, active, depth, t is None)
        if last is not None and d is not None:  # finished before the candidate's last output: weight 0
            numpyro.factor("_pt_match_end", jnp.where(d & ~prev & (last > t), -jnp.inf, 0.0))
        state.clear()
        state.update(sub)
        state[DONE] = prev if d is None else prev | d
        return done

    def init(self, state: dict, *args: Any) -> None:
        self._run(self.program.init, state, None, args)

    def step(self, state: dict, t: Any, *args: Any) -> Any:
        return self._run(self.program.step, state, t, args)

    def outputs(self, state: dict, *args: Any) -> dict:
        out = getattr(self.program, "outputs", None)
        user = self._split(args)[0]
        return out({k: v for k, v in state.items() if k != DONE}, *user) if callable(out) else {}


class GuideView(Program):
    """A guide program as :func:`decode` runs it: its steps unchanged, the names they propose recorded for the
    program's view, the conditioning arguments dropped."""

    def __init__(self, guide: Any, extra: int, shared: dict):
        self.guide, self.extra = guide, extra
        self.max_steps = getattr(guide, "max_steps", None)
        self.max_plate_nesting = int(getattr(guide, "max_plate_nesting", 0) or 0)
        self._sites_cache = shared

    def _run(self, fn, state: dict, t: Any, args: tuple) -> Any:
        user = args[:len(args) - self.extra] if self.extra else args
        names: set = set()
        self._sites_cache["proposed"] = names
        with _Proposed(names):
            return fn(state, *user) if t is None else fn(state, t, *user)

    def init(self, state: dict, *args: Any) -> None:
        self._run(self.guide.init, state, None, args)

    def step(self, state: dict, t: Any, *args: Any) -> Any:
        return self._run(self.guide.step, state, t, args)


_VIEW_CLASSES: dict = {}


def _named(base: type, cls: type) -> type:
    """A subclass of ``base`` named after ``cls`` (one per class: the compile cache keys views by class)."""
    key = (base, cls)
    if key not in _VIEW_CLASSES:
        _VIEW_CLASSES[key] = type(cls.__name__, (base,), {"__module__": base.__module__})
    return _VIEW_CLASSES[key]


def views(program: Any, guide: Any, conditioned: tuple = ()) -> tuple[DecodingView, GuideView | None]:
    """The decoding views of a program and its guide (a program or ``None``: the program proposes)."""
    if not is_program(program):
        raise ConfigError(f"decode runs a ptn.Program (init / step), got {type(program).__name__}")
    if guide is not None and not is_program(guide):
        raise SiteMismatchError(f"decode: the guide of a ptn.Program must be a ptn.Program with the same steps "
                                f"(proposing the prompt's latents) or None (the program proposes), got "
                                f"{type(guide).__name__}")
    shared: dict = {}
    view = _named(DecodingView, type(program))(program, guide is not None, conditioned, shared)
    gview = None if guide is None else _named(GuideView, type(guide))(guide, 2 * len(conditioned) + 1
                                                                        if conditioned else 0, shared)
    return view, gview


class Runner(StepEngine):
    """The engine core (SMC without resampling, or with it: ``ess_threshold``) over decoding views: ``groups``
    independent runs of ``num_particles``, one compiled ``vmap``; cached like every engine run
    (:mod:`ppl_thought.numpyro.infer.compiled`)."""

    def __init__(self, num_particles: int, groups: int = 1, max_steps: int = 64):
        self.num_particles, self.groups, self.max_steps = num_particles, groups, max_steps

    def run(self, view: DecodingView, gview: GuideView | None, args: tuple, key: jax.Array, static: tuple,
            threshold: float, engine: str) -> dict:
        return self._program_run(view, gview, args, key, static, threshold, engine)


# ---------------------------------------------------------------------------------------------- streaming
_STREAM: dict = {}


def stream(view: DecodingView, gview: GuideView | None, args: tuple, key: jax.Array, static: tuple):
    """(3.13): one particle stepped by a compiled ``init`` and a compiled ``step`` (``t`` traced: one compile for
    every step), each step's active outputs yielded as ``(site, value)`` (the value without the particle dim) as
    soon as the step has drawn them; stops once the program finished."""
    name = type(view).__name__
    depth = max(view.max_plate_nesting, gview.max_plate_nesting if gview is not None else 0)
    T = view.max_steps if view.max_steps is not None else 64  # the engines' default loop length
    dyn, consts = [], {}
    for i, a in enumerate(args):
        if i in static or a is None or isinstance(a, str):
            consts[i] = _read_only(a)
        else:
            dyn.append((i, as_traced_arg(a)))
    fp = Fingerprint((view, gview))
    parts = {"engine": (("num_particles", 1), ("max_plate_nesting", depth)), "mode": False,
             "program": fp.parts[0], "guide": fp.parts[1],
             "shapes": tuple((f"arg {i}", tuple(a.shape), str(a.dtype)) for i, a in dyn),
             "static": (len(args), tuple((i, _static_key(a)) for i, a in consts.items()))}
    ckey = ((type(view), type(gview)), fp.key, tuple(parts.items()))

    def bind(dyn_vals):
        full = [None] * len(args)
        for i, a in consts.items():
            full[i] = a
        for (i, _), a in zip(dyn, dyn_vals):
            full[i] = a
        return tuple(full)

    def init_fn(k, arrays, dyn_vals):
        m, g = fp.rebuild(arrays)
        a = bind(dyn_vals)
        sm: dict = {}
        sg: dict = {}
        out = _run_step(lambda: m.init(sm, *a), (lambda: g.init(sg, *a)) if g is not None else None, k, 1, depth,
                        "in init", name)
        _check_state(sm, 1, name)
        _check_state(sg, 1, f"the guide {type(g).__name__}")
        return sm, sg, out.values

    def step_fn(sm, sg, t, k, arrays, dyn_vals):
        m, g = fp.rebuild(arrays)
        a = bind(dyn_vals)
        sm2, sg2 = jax.tree.map(lambda v: v, sm), jax.tree.map(lambda v: v, sg)
        out = _run_step(lambda: m.step(sm2, t, *a), (lambda: g.step(sg2, t, *a)) if g is not None else None, k, 1,
                        depth, "in step", name)
        _same_structure(sm, sm2, name, "model")
        _same_structure(sg, sg2, "the guide", "guide")
        done = jnp.zeros(1, bool) if out.done is None else out.done
        return sm2, sg2, out.values, done

    hit = _STREAM.get(ckey)
    first = hit is None
    if first:
        previous = next((h[2] for h in reversed(list(_STREAM.values())) if h[3] is type(view)), None)
        hit = (jax.jit(init_fn), jax.jit(step_fn), parts, type(view))
        _STREAM[ckey] = hit
    else:
        record_hit()
    jit_init, jit_step = hit[0], hit[1]
    dyn_vals = tuple(a for _, a in dyn)
    key, k0 = jax.random.split(key)
    start = time.perf_counter()
    try:
        sm, sg, values = jit_init(k0, fp.arrays, dyn_vals)
    except _TRACER_ERRORS as e:
        _STREAM.pop(ckey, None)
        raise ProgramError(f"{name} needs a concrete value where the compiled step has a traced one "
                           f"({type(e).__name__}): pass such arguments with static=(index, ...)") from e
    except BaseException:
        _STREAM.pop(ckey, None)
        raise
    yield from _active_outputs(jax.device_get(values), ACTIVE_INIT)
    for t in range(T):
        key, kt = jax.random.split(key)
        try:
            sm, sg, values, done = jit_step(sm, sg, jnp.int32(t), kt, fp.arrays, dyn_vals)
        except BaseException:
            _STREAM.pop(ckey, None)
            raise
        if first:
            record_compile("decode (streaming)", name, type(gview).__name__, explain(previous, parts),
                           time.perf_counter() - start)
            first = False
        values, done = jax.device_get((values, done))  # one host read per step: the stream's own pace
        yield from _active_outputs(values, ACTIVE)
        if bool(np.all(done)):
            return
    raise ProgramError(f"{name} did not finish within max_steps={T} steps: return a bool array [num_particles] "
                       "from step marking finished particles, and set the class attribute max_steps")


def _active_outputs(values: dict, prefix: str):
    for k, v in values.items():
        if k.startswith(prefix):
            site = k[len(prefix):]
            if bool(np.asarray(v).reshape(-1)[0]):
                yield site, jnp.asarray(np.asarray(values[site])[0])
