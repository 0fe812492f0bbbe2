"""Sequential Monte Carlo over the steps of a program, compiled end to end (torch twin:
ppl_thought/inference/smc.py).

Every run goes through the one generic engine core (:mod:`ppl_thought.numpyro.infer.steps`): a
:class:`~ppl_thought.numpyro.program.Program` and its guide program step in lockstep, step t multiplies each
particle's weight by p(sites of step t) / q(latent sites of step t), the particles are resampled (systematic) when
the ESS falls under ``ess_threshold * n``, decided on the device, and Z-hat = prod_t (1/n) sum_i W_{t-1}^i w_t^i
is unbiased. The slow-thinking model Proj # P_f is one such program (``SlowThinking.as_program(x)``, the protocol
method the engine calls on a model that is not itself a program): step t draws the segment z^(t) of Lemma 2.1 from
the guide's program (``Sampler.as_program(x)``: causal, explanatory,
predictive / identity, the exact posterior; or, with ``guide=None``, the masked prior itself, the bootstrap), and
its weight is

    w_t = P(z^(t) | z^(<t)) / Q(z^(t) | z^(<t), x) * 1[z^(<=t) emits x_{<=t}].

``groups=G`` runs G independent SMCs as one ``vmap`` of the compiled run.
"""

from __future__ import annotations

from typing import Any

import jax

from ppl_thought.checks import fraction, integer
from ppl_thought.errors import NotInImageError, describe_proposal
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.infer.importance import not_in_image_result
from ppl_thought.numpyro.infer.resampling import prng_key
from ppl_thought.numpyro.infer.result import Result
from ppl_thought.numpyro.infer.steps import StepEngine, as_programs, program_result
from ppl_thought.resources import check_particles


@checked_jax
class SMC(StepEngine):
    """SMC over the steps of any :class:`~ppl_thought.numpyro.program.Program` (the generic engine core,
    :mod:`ppl_thought.numpyro.infer.steps`); a model that is not a program runs as ``model.as_program(*args)``
    (a :class:`~ppl_thought.numpyro.models.SlowThinking` model: the segments of Lemma 2.1), its guide as
    ``guide.as_program(*args)``.

    Args:
        num_particles: n.
        ess_threshold: resample when ESS / n falls under it (0: never, 1: at every step but the last).
        groups: G independent runs (``vmap`` over keys of the one compiled run); ``log_marginal`` is then ``[G]``,
            ``log_weights [G, n]``, ``ancestry [G, steps, n]``, every sample ``[G, n, ...]``, and
            ``stats["log_marginal_pooled"]`` (with ``stats["log_marginal_pooled_stderr"]``, the delta method
            over the G unbiased estimates) pools them.
        max_steps: the length of the compiled step loop for programs without a ``max_steps`` attribute.

    ``run(program, guide, *args, rng_key=key, static=()) -> Result`` for a ``ptn.Program`` (guide: a program
    with the same steps and latent sites, or ``None``: the bootstrap): ``samples`` (a step site ``[n, steps, ...]``,
    an init site ``[n, ...]``, plus ``program.outputs(state)``), final ``log_weights``, ``log_marginal``,
    ``ancestry [steps, n]``, ``stats["ess"]`` / ``["resampled"]`` per step, ``stats["steps"]``. Arguments are
    traced (new data of the same shapes reuses the compiled run; a Python scalar is the array it becomes);
    ``static`` lists the indices of arguments that must be concrete (their values key the compiled run). A new
    program instance of the same class and configuration reuses the compiled run too, whatever its JAX arrays
    hold (docs/numpyro.md, "Compilation"; ``ptn.compile_stats()``).

    ``run(model, guide, *args, ...)`` for an object that is not a program but implements the protocol method
    ``as_program(*args) -> ptn.Program`` (``ptn.models.SlowThinking``, the samplers of
    :mod:`ppl_thought.numpyro.guides`; any user class may): the engine runs ``model.as_program(*args)`` with
    ``guide.as_program(*args)`` (or a guide program, or ``None``) and no arguments
    (:func:`~ppl_thought.numpyro.infer.steps.as_programs`); for SlowThinking that is ``samples["z"] [n, L]`` (the
    whole latent sequence), ``ancestry [|x|, n]``. ``log_marginal_stderr`` is the delta method on the final
    weights when no step resampled (then it is importance sampling), else ``None``: use ``groups``.
    """

    def __init__(self, num_particles: int, ess_threshold: float = 0.5, groups: int = 1, max_steps: int = 64):
        self.num_particles = integer("num_particles", num_particles)
        self.ess_threshold = fraction("ess_threshold", ess_threshold)
        self.groups = integer("groups", groups)
        self.max_steps = integer("max_steps", max_steps)
        check_particles("ptn.infer.SMC", self.num_particles, self.groups)  # before jit: never an OverflowError

    def run(self, model: Any, guide: Any, *args: Any, rng_key: jax.Array | int | None = None,
            static: tuple = ()) -> Result:
        """Run SMC; see the class docstring. ``rng_key``: a ``jax.random.PRNGKey`` or an int seed
        (``PRNGKey(seed)``); default ``PRNGKey(0)``."""
        key = prng_key(rng_key)  # an int seed is accepted: PRNGKey(seed)
        try:
            model, guide, run_args, observed = as_programs(model, guide, args, "SMC")
        except NotInImageError as e:  # as_program says the arguments have probability 0
            return not_in_image_result(f"log p(x) = -inf: {e}", self.num_particles, "SMC", {"args": args})
        out = self._program_run(model, guide, run_args, key, static if run_args else (), self.ess_threshold, "SMC")
        out["proposal"] = describe_proposal(guide)  # named by a ZeroWeightsError (the one rule, errors.py)
        return program_result(out, "SMC", run_args, observed)


__all__ = ["SMC"]
