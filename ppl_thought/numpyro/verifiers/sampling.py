"""Verifier-assisted generation on the JAX side: rejection sampling (Def 3.1.4), tokenwise rejection sampling (Def
3.1.5) and SMC with a verifier (torch twin: ppl_thought/verifiers/sampling.py; docs/verifiers.md).

Every engine takes a token-level program, ``run(program, guide=None, *args, rng_key=...)``: any ``ptn.Program``
whose ``one_token_step()`` returns a :class:`~ppl_thought.numpyro.program.OneTokenStep` (:class:`VerifiedLM`, a
user's own program); the target is p_O(s) 1(s in A). ``run(lm, verifier, prompt=None)`` is sugar for
``run(VerifiedLM(lm, verifier, prompt), None)``. Each is a compiled run of the generic engine core
(``ptn.infer.SMC``'s, so compiled runs are cached by what they depend on and counted by ``ptn.compile_stats()``) over
the program's step drawn by the engine's proposal (:class:`~ppl_thought.numpyro.verifiers.TokenSteps`), all rows a
batch:

* :class:`RejectionSampling`: batches of ``batch_size`` whole strings from O (``draw="lm"``, weights 1(s in A));
  the batches are a host loop (their number is random), each batch one compiled run, one host read per batch;
* :class:`TokenwiseRejection`: one compiled run of ``num_samples`` rows, each position a ``lax.while_loop`` of
  rounds in which every still-rejected row proposes again (``draw="tokenwise"``);
* :class:`VerifierSMC`: ``ptn.infer.SMC`` on the program drawn by ``proposal`` (``"lm"``, ``"masked"``,
  ``"rejection"``), resampling decided on the device.

Oracle calls are counted as the thesis counts them (Def 3.1.1, Def 3.1.6): a proposed token is one LM call and one
verifier call; ``Result.stats`` holds ``lm_calls``, ``verifier_calls`` and the calls per returned sample.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.checks import fraction, integer
from ppl_thought.errors import ConfigError, SamplingBudgetError, UnsatisfiableConstraintError, ZeroWeightsError
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.infer.resampling import prng_key
from ppl_thought.numpyro.infer.result import Result
from ppl_thought.numpyro.infer.smc import SMC
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.numpyro.program import OneTokenStep
from ppl_thought.numpyro.verifiers.program import DRAWS, TokenSteps, VerifiedLM

__all__ = ["RejectionSampling", "TokenwiseRejection", "VerifierSMC"]


def token_program(program: Any, guide: Any, args: tuple, kwargs: dict, engine: str) -> tuple[OneTokenStep, Any]:
    """(the program's :class:`OneTokenStep`, the prompt ids) of ``run(program, guide, *args, **kwargs)``, with the
    sugar ``run(lm, verifier, prompt=None)`` -> ``VerifiedLM(lm, verifier, prompt)``; a ConfigError for a guide."""
    if isinstance(program, LM):
        if len(args) > 1 or kwargs.keys() - {"prompt"}:
            raise ConfigError(f"{engine}.run(lm, verifier, prompt=None) takes at most a prompt after the verifier, got "
                              f"{len(args)} more arguments and {sorted(kwargs)}")
        prompt = kwargs.get("prompt", args[0] if args else None)
        program, guide, args, kwargs = VerifiedLM(program, guide, prompt), None, (), {}
    if guide is not None:
        raise ConfigError(f"{engine} draws by its own proposal: guide must be None, got {type(guide).__name__}")
    spec = OneTokenStep.of(program, engine)
    return spec, spec.prompt_ids(args, kwargs)


def _check_spec(engine: str, spec: OneTokenStep, num: int, max_len: int) -> None:
    if spec.max_tokens != max_len:
        raise ConfigError(f"{engine}(max_len={max_len}) but the program draws max_tokens={spec.max_tokens} tokens (a "
                          f"verifier decides strings of its length N: build the engine with max_len=N)")


def _check_satisfiable(spec: OneTokenStep) -> None:
    """FAIL (Def 3.1.2) when the rule admits nothing from its start state and the empty string is not in A (read on
    the host from the rule's tables before any run)."""
    s = spec.rule.start(1)
    if not bool(spec.rule.mask(s).any() | spec.rule.is_final(s).any()):
        name = getattr(getattr(spec.rule, "constraint", None), "name", "the constraint")
        raise UnsatisfiableConstraintError(f"{name}: the constraint admits no string (FAIL)")


def _run(model: TokenSteps, n: int, key: jax.Array, threshold: float, engine: str) -> dict:
    """One compiled run of ``model`` (bootstrap: the program draws) through the generic engine core."""
    return SMC(n, ess_threshold=threshold)._program_run(model, None, (), key, (), threshold, engine)


@checked_jax
class RejectionSampling:
    """Rejection sampling with an outcome verifier (Def 3.1.4), compiled: batches of ``batch_size`` whole strings
    drawn from the LM, each string checked once it is complete, until ``num_samples`` are accepted. The samples are
    i.i.d. from exactly the restricted distribution p(s) proportional to 1(s in A) p_O(s) (Section 3.1.1).

    Costs are those of the sequential algorithm that stops at the ``num_samples``-th acceptance (as on the torch
    side): each string costs its length in LM calls and one verifier call; on Prop 3.1.1's task the LM calls per
    sample are ``2^D D``. ``Result.samples[site]`` ``[num_samples, max_len]``, no weights; ``stats``: ``lm_calls``,
    ``verifier_calls``, ``lm_calls_per_sample``, ``verifier_calls_per_sample``, ``acceptance_rate``,
    ``strings_generated``.
    """

    def __init__(self, num_samples: int, max_len: int, batch_size: int | None = None, max_rounds: int = 10_000,
                 site: str = "z"):
        self.num_samples = integer("num_samples", num_samples)
        self.max_len = integer("max_len", max_len)
        self.batch_size = integer("batch_size", batch_size) if batch_size is not None else self.num_samples
        self.max_rounds = integer("max_rounds", max_rounds)
        self.site = site

    def run(self, program: Any, guide: Any = None, *args: Any, rng_key: jax.Array | int | None = None,
            **kwargs: Any) -> Result:
        """Rejection sampling of the token-level ``program`` (``guide=None``); or ``run(lm, verifier, prompt=None)``.
        ``rng_key``: a PRNG key or an int seed (default ``PRNGKey(0)``)."""
        spec, prompt = token_program(program, guide, args, kwargs, "RejectionSampling")
        _check_spec("RejectionSampling", spec, self.num_samples, self.max_len)
        model = TokenSteps(spec, prompt, self.site, draw="lm", stats=True)
        key, n = prng_key(rng_key), self.num_samples
        kept, gaps = [], []
        since_last = np.zeros(2, np.int64)  # strings and tokens after the last accepted one
        total = np.zeros(2, np.int64)
        have = 0
        for _ in range(self.max_rounds):  # a host loop over batches: their number is random
            key, k = jax.random.split(key)
            out = _run(model, self.batch_size, k, 0.0, "RejectionSampling")
            ok = np.isfinite(np.asarray(out["log_weights"]))  # the outcome verifier's call: s in A
            lengths = np.asarray(out["samples"]["lengths"], np.int64)
            cost = np.cumsum(np.stack([np.ones_like(lengths), lengths], 1), 0)  # [B, 2]
            idx = np.flatnonzero(ok)[: n - have]
            if idx.size:
                at = cost[idx]
                gap = np.diff(at, axis=0, prepend=np.zeros((1, 2), np.int64))
                gap[0] += since_last
                gaps.append(gap)
                kept.append(np.asarray(out["samples"][self.site])[idx])
                have += idx.size
            if have == n:
                total += cost[idx[-1]]
                break
            total += cost[-1]
            since_last = since_last + cost[-1] if not idx.size else cost[-1] - cost[idx[-1]]
        else:
            raise SamplingBudgetError(f"RejectionSampling: {have} of {n} samples accepted after {self.max_rounds} "
                                      f"rounds of {self.batch_size} strings; raise max_rounds or batch_size")
        g = np.concatenate(gaps)
        stats = {"lm_calls": int(total[1]), "verifier_calls": int(total[0]),
                 "lm_calls_per_sample": jnp.asarray(g[:, 1]), "verifier_calls_per_sample": jnp.asarray(g[:, 0]),
                 "strings_generated": int(total[0]), "acceptance_rate": n / int(total[0])}
        return Result(samples={self.site: jnp.asarray(np.concatenate(kept))}, stats=stats, engine="RejectionSampling")


@checked_jax
class TokenwiseRejection:
    """Tokenwise rejection sampling with a process verifier (Def 3.1.5), compiled: at each position every row
    proposes t ~ O(. | s) until V(s o t) = 1, in rounds (a ``lax.while_loop``) of all still-rejected rows.

    **Biased**: the samples follow the product of locally renormalised conditionals
    q(s) = prod_i O(s_i | s_<i) V(s_<=i) / Z_V(s_<i), not the restricted law (Prop 3.1.2). Each proposal is one LM
    call and one verifier call (``2 D`` LM calls per sample on Prop 3.1.1's task). ``Result.samples[site]``
    ``[num_samples, max_len]``, no weights; ``stats``: ``lm_calls``, ``verifier_calls``, ``lm_calls_per_sample``,
    ``verifier_calls_per_sample``. Raises :class:`UnsatisfiableConstraintError` if nothing is admitted from the
    start, :class:`SamplingBudgetError` if a row is still rejected after ``max_tries`` proposals at one position.
    """

    def __init__(self, num_samples: int, max_len: int, max_tries: int = 10_000, site: str = "z"):
        self.num_samples = integer("num_samples", num_samples)
        self.max_len = integer("max_len", max_len)
        self.max_tries = integer("max_tries", max_tries)
        self.site = site

    def run(self, program: Any, guide: Any = None, *args: Any, rng_key: jax.Array | int | None = None,
            **kwargs: Any) -> Result:
        """Tokenwise rejection on the token-level ``program`` (``guide=None``); or ``run(lm, verifier, prompt)``."""
        spec, prompt = token_program(program, guide, args, kwargs, "TokenwiseRejection")
        _check_spec("TokenwiseRejection", spec, self.num_samples, self.max_len)
        _check_satisfiable(spec)
        model = TokenSteps(spec, prompt, self.site, draw="tokenwise", max_tries=max(self.max_tries, 2), stats=True)
        out = _run(model, self.num_samples, prng_key(rng_key), 0.0, "TokenwiseRejection")
        s = out["samples"]
        if bool(s["budget"].any()):
            raise SamplingBudgetError(f"tokenwise rejection: {int(s['budget'].sum())} rows were still rejected after "
                                      f"{self.max_tries} proposals at one position (an LM with no mass on any "
                                      "admitted token)")
        calls = s["calls"]
        stats = {"lm_calls": int(calls.sum()), "verifier_calls": int(calls.sum()), "lm_calls_per_sample": calls,
                 "verifier_calls_per_sample": calls}
        return Result(samples={self.site: s[self.site]}, stats=stats, engine="TokenwiseRejection")


@checked_jax
class VerifierSMC:
    """SMC with a verifier: ``ptn.infer.SMC`` on the token-level program's step drawn by ``proposal``
    (:class:`~ppl_thought.numpyro.verifiers.TokenSteps`; for :class:`VerifiedLM` the law of
    ``VerifiedLM(draw=proposal)``): ``"lm"`` (bootstrap, weights V), ``"masked"`` (the locally optimal proposal,
    weights Z_V: what tokenwise rejection forgets) or ``"rejection"`` (AWRS: propose until two acceptances, weight
    1 / (K - 1)). Properly weighted for the restricted law; exp(log Z-hat) unbiased for P_O(A).

    ``stats`` adds ``lm_calls`` and ``verifier_calls`` (``"lm"``: n N and n N; ``"masked"``: n N and n N V, every
    token checked; ``"rejection"``: every proposal made, as on the torch side) and ``proposal``.
    """

    def __init__(self, num_particles: int, max_len: int, proposal: str = "masked", ess_threshold: float = 0.5,
                 max_tries: int = 10_000, site: str = "z"):
        self.num_particles = integer("num_particles", num_particles)
        self.max_len = integer("max_len", max_len)
        if proposal not in DRAWS:
            raise ConfigError(f"proposal must be 'lm', 'masked' or 'rejection', got {proposal!r}")
        self.proposal = proposal
        self.ess_threshold = fraction("ess_threshold", ess_threshold)
        self.max_tries = integer("max_tries", max_tries, minimum=2)
        self.site = site

    def program(self, program: Any, guide: Any = None, *args: Any, **kwargs: Any) -> TokenSteps:
        """The program :meth:`run` gives ``ptn.infer.SMC`` (with ``guide=None``): the program's step drawn by the
        proposal. Same arguments as :meth:`run`."""
        spec, prompt = token_program(program, guide, args, kwargs, "VerifierSMC")
        _check_spec("VerifierSMC", spec, self.num_particles, self.max_len)
        return TokenSteps(spec, prompt, self.site, draw=self.proposal, max_tries=self.max_tries, stats=True)

    def run(self, program: Any, guide: Any = None, *args: Any, rng_key: jax.Array | int | None = None,
            **kwargs: Any) -> Result:
        """SMC on the token-level ``program`` (``guide=None``: the proposal is ``proposal=``); or ``run(lm, verifier,
        prompt=None)``."""
        model = self.program(program, guide, *args, **kwargs)
        try:
            res = SMC(self.num_particles, ess_threshold=self.ess_threshold).run(model, None, rng_key=rng_key)
        except ZeroWeightsError as e:
            raise ZeroWeightsError(f"VerifierSMC(proposal={self.proposal!r}): {e}; use proposal='masked' or more "
                                   "particles") from None
        extra = {k: res.samples.pop(k) for k in ("lengths", "calls", "budget", "total")}
        if bool(extra["budget"].any()):
            raise SamplingBudgetError(f"weighted rejection: {int(extra['budget'].sum())} rows had fewer than two "
                                      f"admitted proposals after {self.max_tries} at one position")
        n, L, V = self.num_particles, self.max_len, int(model.spec.lm.vocab_size)
        if self.proposal == "rejection":
            lm_calls = ver_calls = int(extra["total"].max())  # every proposal, discarded particles' included
        else:
            lm_calls, ver_calls = n * L, n * L * (V if self.proposal == "masked" else 1)
        res.engine = "VerifierSMC"
        res.stats.update({"lm_calls": lm_calls, "verifier_calls": ver_calls, "proposal": self.proposal,
                          "resampled": [i for i, r in enumerate(np.asarray(res.stats["resampled"])) if r]})
        return res
