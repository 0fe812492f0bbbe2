"""``ptn.Program``: the step-wise program protocol of ``pt.Program`` written in NumPyro primitives
(docs/architecture.md, "One protocol, two backends"; torch twin: ppl_thought/program.py).

A program::

    class MyProgram(ptn.Program):
        max_steps = 4                                  # the number of steps the compiled loop runs at most
        def init(self, state, *args): ...              # set up state: arrays [n, ...] or pytrees of them
        def step(self, state, t, *args): ...           # NumPyro code for step t (a traced int32 scalar)
            # return None to go on, or a bool array [n] marking the particles that are finished

Both methods run once for all particles inside ``numpyro.plate("particles", n)`` (``ptn.particles()`` is n).
The engine (``ptn.infer.SMC`` / ``ptn.infer.Importance``) compiles the whole run: ``init``, then a
``lax.scan`` over ``max_steps`` steps, so every step has the same sites (names do not depend on t; the engine
stacks a site's values over steps) and leaves ``state`` with the same structure and shapes. The verbs are
NumPyro's primitives under the names of the theory: :func:`sample` (latent), :func:`observe` (data; ``None``:
an output), :func:`factor` (a log-potential in the target) and :func:`twist` (a potential SMC adds and later
removes; it leaves the target).

The contract the engines check while tracing (docs/numpyro.md, "The program contract"; a ``ProgramError`` naming
the program, the step and the site or entry): every site's batch shape is exactly ``[n]`` plus the dims of the
plates the program declares (``max_plate_nesting``); twists and finished flags are ``[n]``; every leaf of
``state`` is an array with leading dim n (dicts, lists, tuples and pytrees of them are fine; no Python scalars);
``max_steps`` is an integer >= 1. An object that is not a program may implement ``as_program(*args)``, the
program it stands for with the arguments bound in it (``SlowThinking``, the samplers of ``ptn.guides``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpyro
from numpyro.distributions import Distribution
from numpyro.primitives import _PYRO_STACK, Messenger

from ppl_thought.checks import integer, one_token_step
from ppl_thought.errors import ConfigError, NumericalError, ProgramError
from ppl_thought.numpyro.boundary import ArrayLike, as_array, checked_jax, tracing
from ppl_thought.twists import current as current_twists
from ppl_thought.validation import per_token
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["OUTPUT", "PARTICLES", "OneTokenStep", "Program", "factor", "is_output", "is_program", "observe",
           "particles", "run_whole_trace", "sample", "twist"]

PARTICLES = "particles"
#: the ``infer`` key that marks an output site (``observe(name, fn, None)``): drawn by the program, out of weights
OUTPUT = "output"


@checked_jax
def sample(name: str, fn: Distribution, **kwargs: Any) -> Any:
    """A latent site: ``numpyro.sample(name, fn)`` (a guide proposes it; without one the program does)."""
    return numpyro.sample(name, fn, **kwargs)


@checked_jax
def observe(name: str, fn: Distribution, value: ArrayLike | None) -> Any:
    """Condition on data: ``numpyro.sample(name, fn, obs=value)`` (in every weight). ``value=None`` makes the site
    an *output*: drawn from ``fn``, left out of the weights, returned in ``Result.samples``. A value shared by
    every particle (a scalar, one sequence) is broadcast over the particle plate."""
    if value is None:
        return numpyro.sample(name, fn, infer={OUTPUT: True})
    v = as_array("value", value, where=f"observe({name!r})")
    shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
    if v.shape != shape:
        try:
            v = jnp.broadcast_to(v, shape)
        except ValueError:
            pass  # the distribution's own check names the problem
    return numpyro.sample(name, fn, obs=v)


@checked_jax
def factor(name: str, log_factor: ArrayLike) -> None:
    """Multiply the program's density by exp(log_factor) ``[n]`` (``numpyro.factor``); ``-inf``: a hard
    constraint. Unlike :func:`twist` it changes the target. A log-factor of ``+inf`` or NaN has no probability
    (log Z-hat would be ``inf``, the ESS NaN): a concrete one raises :class:`~ppl_thought.errors.NumericalError`
    here; a traced one (inside an engine's compiled run) is caught by the engine, which raises the same error
    naming the site (``Importance`` / ``SMC``: never a log Z-hat of ``inf``)."""
    v = as_array("log_factor", log_factor, where=f"factor({name!r})")
    if not tracing() and not isinstance(v, jax.core.Tracer) and jnp.issubdtype(v.dtype, jnp.inexact):
        bad = jnp.isnan(v) | jnp.isposinf(v)
        if bool(bad.any()):
            raise NumericalError(f"factor({name!r}): log_factor holds {'NaN' if bool(jnp.isnan(v).any()) else '+inf'}"
                                 "; a log-potential must be finite or -inf (a hard constraint)")
    numpyro.factor(name, v)


@checked_jax
def is_output(site: dict[str, Any]) -> bool:
    return bool((site.get("infer") or {}).get(OUTPUT, False))


# ---------------------------------------------------------------------------------------------- twists
@checked_jax
def twist(log_psi: ArrayLike) -> None:
    """Set the potential log psi_t ``[n]`` of the particles at this step: SMC multiplies the incremental weight
    by psi_t / psi_{t-1} and divides the last potential out when a particle finishes, so Z-hat stays unbiased
    for the untwisted program (docs/programs.md, "Verifiers"). Several calls in a step add up; outside SMC
    (Importance, a plain trace) nothing is done."""
    collector = current_twists()
    if collector is not None:
        v = as_array("log_psi", log_psi, jnp.float32, "twist")
        n = particles()
        if tuple(v.shape) != (n,):
            raise ProgramError(f"ptn.twist(log_psi): log_psi has shape {tuple(v.shape)}; a twist is one potential "
                               f"per particle, shape [num_particles] = ({n},) exactly")
        collector.add(v)


# ---------------------------------------------------------------------------------------------- plates
@checked_jax
def particles() -> int:
    """The number of particles of the enclosing ``numpyro.plate("particles", n)``, else 1."""
    for frame in reversed(_PYRO_STACK):
        if getattr(frame, "name", None) == PARTICLES and hasattr(frame, "size"):
            return int(frame.size)
    return 1


# ---------------------------------------------------------------------------------------------- program
@checked_jax
class Program:
    """Base class of JAX step-wise programs (see the module docstring).

    Class attributes an engine reads: ``max_steps`` (the length of the compiled step loop; ``None``: the
    engine's ``max_steps``) and ``max_plate_nesting`` (plates the program opens inside a step; 0).
    """

    max_plate_nesting: int = 0
    max_steps: int | None = None

    @per_token
    def init(self, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """Set up ``state`` before step 0 (may sample sites; default: nothing)."""

    @per_token
    def step(self, state: dict[str, Any], t: Any, *args: Any, **kwargs: Any) -> Any:
        """Step ``t`` (a traced int32 scalar): NumPyro code for all particles; return None or a bool array [n]."""
        raise NotImplementedError(f"{type(self).__name__} must define step(self, state, t, *args, **kwargs)")

    @per_token
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        """The program as one whole-trace NumPyro model with one particle (``init`` and ``max_steps`` steps; step
        t's sites are ``f"{name}_{t}"`` when ``max_steps > 1``): what ``numpyro.infer.SVI`` traces and what
        ``ptn.infer.MALA`` / ``ULA`` take the potential from (run_whole_trace)."""
        run_whole_trace(self, args, kwargs)

    def outputs(self, state: dict[str, Any], *args: Any, **kwargs: Any) -> dict:
        """Extra values for ``Result.samples`` read from the final state (default: none)."""
        return {}


@checked_jax
def is_program(obj: Any) -> bool:
    """A ``ptn.Program`` or an object with ``init`` and ``step`` (duck typing, as on the torch side)."""
    return isinstance(obj, Program) or (callable(getattr(obj, "init", None)) and callable(getattr(obj, "step", None))
                                        and not isinstance(obj, type))


def as_done(done: Any, n: int) -> jax.Array | None:
    """A step's return value as a bool array ``[n]`` (``None``: nobody finished this step); any other shape (a
    scalar included: ``jnp.broadcast_to(flag, (n,))`` says "every particle") is a :class:`ProgramError`."""
    if done is None:
        return None
    d = jnp.asarray(done)
    if d.dtype != jnp.bool_:
        raise ProgramError(f"step must return None or a bool array [num_particles], got dtype {d.dtype}")
    if d.shape != (n,):
        raise ProgramError(f"step returned finished flags of shape {tuple(d.shape)}; expected ({n},) exactly "
                           f"(one flag per particle; jnp.broadcast_to(flag, ({n},)) for one flag for all)")
    return d


class _StepNames(Messenger):
    """Renames every site ``name`` of step t to ``f"{name}_{t}"`` (a whole trace has unique site names)."""

    def __init__(self, t: int):
        self.t = t
        super().__init__()

    def process_message(self, msg):
        if msg.get("type") in ("sample", "deterministic") and msg.get("name") is not None:
            msg["name"] = f"{msg['name']}_{self.t}"


@checked_jax
def run_whole_trace(program: Any, args: tuple = (), kwargs: dict | None = None) -> None:
    """Run ``program`` as one whole-trace NumPyro model with one particle (``Program.__call__``; what
    ``numpyro.infer.SVI`` traces for parameters and ``ptn.infer.MALA`` / ``ULA`` take the potential from):
    ``init``, then ``max_steps`` steps (t a concrete int32) inside ``numpyro.plate("particles", 1)``. Sites keep
    their names when ``max_steps == 1``; step t's are ``f"{name}_{t}"`` otherwise. After the step that finishes the
    particle, later steps' sites are masked (``numpyro.handlers.mask``: they add nothing to the log joint) and the
    state keeps its rows."""
    kwargs = kwargs or {}
    T = getattr(program, "max_steps", None)
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ProgramError(f"{type(program).__name__}.max_steps = {T!r}: a program run as one trace (SVI, MALA) "
                           "unrolls max_steps steps; set the class attribute max_steps to an integer >= 1")
    depth = int(getattr(program, "max_plate_nesting", 0) or 0)
    state: dict = {}
    with numpyro.plate(PARTICLES, 1, dim=-(depth + 1)):
        program.init(state, *args, **kwargs)
        finished = jnp.zeros(1, bool)
        for t in range(T):
            new = jax.tree.map(lambda a: a, state)
            with numpyro.handlers.mask(mask=(~finished).reshape((1,) + (1,) * depth)):
                if T > 1:
                    with _StepNames(t):
                        done = program.step(new, jnp.int32(t), *args, **kwargs)
                else:
                    done = program.step(new, jnp.int32(t), *args, **kwargs)
            state = jax.tree.map(lambda old, nw, f=finished: jnp.where(f.reshape((1,) * jnp.ndim(nw)), old, nw)
                                 if jnp.ndim(nw) else nw, state, new)
            d = as_done(done, 1)
            finished = finished if d is None else finished | d


# ---------------------------------------------------------------------------------------------- token-level programs
@checked_jax
class OneTokenStep:
    """The protocol between a token-level ``ptn.Program`` and the token-level engines (the twin of
    ``ppl_thought.program.OneTokenStep``; docs/verifiers.md, "Token-level programs"): "my step is one token of one
    LM under a token automaton", returned by ``program.one_token_step()``. Step t of such a program:

        log w_t = log Z_t(s), the LM's mass on the tokens ``rule`` admits (0 for ended rows), a factor
        z_t ~ masked softmax of ``rule`` (Def 2.8), the rule state advanced (``token_step``)
        a row ends in a final state of ``rule``, after a token in ``stop_ids``, or after ``max_tokens`` tokens

    so the program's unnormalised density is p_LM(z) 1[z admitted by ``rule``] and its normaliser Z = P_LM(A): the
    target of ``ptn.verifiers``' engines.

    Attributes:
        lm: the JAX LM (:class:`~ppl_thought.numpyro.lm.base.LM`) whose next-token log-probabilities are read.
        rule: the :class:`~ppl_thought.numpyro.distributions.TokenRule` of the automaton (the constraint A).
        max_tokens: the most tokens a particle draws (the number of steps).
        stop_ids: token ids after which a particle ends (default ``<eos>``).
        prompt: 1-D prompt ids shared by every row, a callable ``prompt(*args, **kwargs) -> ids | None`` reading the
            run's arguments, or ``None``: the run's first positional argument, its ``prompt=`` keyword, or none.
    """

    def __init__(self, lm: Any, rule: Any, max_tokens: int, stop_ids: tuple[int, ...] = (2,),
                 prompt: Any = None):
        self.lm, self.rule = lm, rule
        self.max_tokens = integer("max_tokens", max_tokens, minimum=0)
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.prompt = prompt

    @staticmethod
    def of(program: Any, engine: str) -> OneTokenStep:
        """``program.one_token_step()``, or a :class:`~ppl_thought.errors.ConfigError` for ``engine`` that names the
        method to implement."""
        spec = one_token_step(program, engine, OneTokenStep, "ptn.verifiers.VerifiedLM")
        name = type(program).__name__
        if int(getattr(spec.rule, "vocab_size", -1)) != int(spec.lm.vocab_size):
            raise ConfigError(f"{name}.one_token_step(): the rule has {getattr(spec.rule, 'vocab_size', None)} token "
                              f"columns but the LM has vocab_size={spec.lm.vocab_size}")
        return spec

    def prompt_ids(self, args: tuple, kwargs: dict) -> Any:
        """The prompt token ids of a run on ``*args, **kwargs`` (see ``prompt``)."""
        if callable(self.prompt):
            return self.prompt(*args, **kwargs)
        if self.prompt is not None:
            return self.prompt
        return kwargs["prompt"] if "prompt" in kwargs else (args[0] if args else None)

    @per_token
    def mass(self, logp: Any, s: Any, done: Any) -> jax.Array:
        """The step's log weight ``[n]``: log Z_t, the log of the LM's mass on the tokens ``rule`` admits in states
        ``s`` over its mass on every token it may generate (Def 2.8's normaliser; -inf, never NaN, where it admits
        none); 0 for ended rows."""
        free = jnp.ones(logp.shape[-1], bool).at[PAD_ID].set(False).at[BOS_ID].set(False)
        admitted = jax.nn.logsumexp(jnp.where(self.rule.mask(s) & free, logp, -jnp.inf), -1)
        log_z = admitted - jax.nn.logsumexp(jnp.where(free, logp, -jnp.inf), -1)
        return jnp.where(done, 0.0, log_z)

    @per_token
    def ends(self, tok: Any, s_new: Any, lengths: Any) -> tuple[jax.Array, jax.Array]:
        """(finished, ended) ``[n]`` after ``tok`` took rows to states ``s_new`` with ``lengths`` tokens: finished in a
        final state of ``rule`` or after a stop id, ended: finished or ``max_tokens`` reached."""
        done = self.rule.is_final(s_new) | jnp.isin(tok, jnp.asarray(self.stop_ids, jnp.int32))
        return done, done | (lengths >= self.max_tokens)
