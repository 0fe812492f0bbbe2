"""The LM conditioned on a verifier's constraint set as a ``ptn.Program``, and its proposals (thesis Defs
3.1.2-3.1.5; torch twin: ppl_thought/verifiers/program.py, whose docstring derives every weight below).

:class:`VerifiedLM` is the restricted distribution p(s) proportional to p_O(s) 1(s in A) (Section 3.1.1) for a
length-N :class:`~ppl_thought.numpyro.verifiers.ProcessVerifier`: step i draws token s_i (site ``site``, the same
name at every step: the engines stack it, ``samples[site]`` is ``[n, N]``) and adds a factor (site
``f"{site}_ok"``) that keeps the density p_O(s) V(s_<=i), so every engine (``ptn.infer.SMC``, ``Importance``) has
Z = P_O(A) as its normaliser. How the program draws its token (``draw``):

* ``"lm"``: t ~ O(. | s), factor log V(s o t) (0 or -inf): the bootstrap;
* ``"masked"``: t ~ the locally optimal proposal O(t | s) V(s o t) / Z_V(s) (Def 3.1.5's law), factor log Z_V(s),
  the local mass that tokenwise rejection forgets (Prop 3.1.2);
* ``"rejection"``: weighted rejection (AWRS): propose t ~ O until two proposals are admitted (K in all), keep the
  first, factor -log(K - 1): an unbiased estimate of Z_V(s), so the particles stay properly weighted.

:class:`TokenSteps` is the same step for any token-level program (its ``one_token_step()``,
:class:`~ppl_thought.numpyro.program.OneTokenStep`), and :class:`LocallyOptimalProposal` the masked law as a guide
of ``VerifiedLM(draw="lm")`` (weights p / q = Z_V(s)). Particles are a batch dimension: one ``token_step`` draws the
token of every row; the automaton is stepped for all rows at once by one gather in its table; the rejection rounds
are a ``lax.while_loop`` over rounds (every still-pending row proposes in each round) inside the compiled step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from numpyro.distributions import Distribution, constraints

from ppl_thought.checks import integer
from ppl_thought.errors import ConfigError, ProgramError, UnsatisfiableConstraintError
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.distributions import NEG_INF, TokenRule, token_step
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.numpyro.lm_state import LMState
from ppl_thought.numpyro.program import OneTokenStep, Program, factor, particles, sample
from ppl_thought.numpyro.verifiers.process import as_verifier
from ppl_thought.projections.constraints import length_automaton
from ppl_thought.validation import per_token
from ppl_thought.vocab import PAD_ID

__all__ = ["DRAWS", "LocallyOptimalProposal", "TokenSteps", "VerifiedLM"]

#: how a program draws its token; ``"tokenwise"`` (Def 3.1.5: propose from O until one token is admitted, no
#: factor) is the biased law :class:`~ppl_thought.numpyro.verifiers.TokenwiseRejection` runs, not the target's
DRAWS = ("lm", "masked", "rejection")
_ALL_DRAWS = (*DRAWS, "tokenwise", "proposal")


def _inactive(lq: jax.Array, done: jax.Array) -> jax.Array:
    """``lq [n, V]`` with the ended rows' law all on ``<pad>``."""
    pad = jnp.full(lq.shape[-1:], NEG_INF).at[PAD_ID].set(0.0)
    return jnp.where(done[:, None], pad, lq)


class _Token(Distribution):
    """One token per row from log-probabilities ``[n, V]``, drawn by the one token step (value int32 ``[n]``)."""

    arg_constraints: dict = {}
    support = constraints.nonnegative_integer
    is_discrete = True

    def __init__(self, log_probs: jax.Array, free: TokenRule):
        self.q, self.free = log_probs, free
        super().__init__((log_probs.shape[0],), (), validate_args=False)

    @per_token
    def sample(self, key: Any, sample_shape: tuple = ()) -> jax.Array:
        if sample_shape:
            raise ProgramError("a verifier program draws one token per particle row (sample_shape must be ())")
        n = self.q.shape[0]
        return token_step(self.free, None, jnp.zeros(n, jnp.int32), key=key, log_probs=self.q).token

    @per_token
    def log_prob(self, value: Any, intermediates: Any = None) -> jax.Array:
        v = jnp.broadcast_to(jnp.asarray(value, jnp.int32), self.q.shape[:1])
        ok = (v >= 0) & (v < self.q.shape[-1])
        return jnp.where(ok, jnp.take_along_axis(self.q, jnp.clip(v, 0, self.q.shape[-1] - 1)[:, None], -1)[:, 0],
                         NEG_INF)


class _Rounds(_Token):
    """Rejection rounds from O (Defs 3.1.4-3.1.5, AWRS): every pending row proposes t ~ O(. | s) per round (one token
    step), a proposal admitted by ``rule`` in state ``s`` counts; a row stops at ``need`` admitted proposals (1:
    tokenwise rejection, 2: weighted rejection) or after ``max_tries``. The value is the first admitted token;
    :attr:`drawn` holds (K proposals ``[n]``, finished within the budget ``[n]``). Its density is defined only at its
    own draw: the site is drawn by the program (a guide cannot propose it)."""

    def __init__(self, log_o: jax.Array, free: TokenRule, rule: Any, s: Any, done: jax.Array, need: int,
                 max_tries: int):
        super().__init__(log_o, free)
        self.rule, self.s, self.done, self.need, self.max_tries = rule, s, done, need, max_tries
        self.drawn: tuple[jax.Array, jax.Array] | None = None

    @per_token
    def sample(self, key: Any, sample_shape: tuple = ()) -> jax.Array:
        if sample_shape:
            raise ProgramError("a verifier program draws one token per particle row (sample_shape must be ())")
        n = self.q.shape[0]
        admitted = self.rule.mask(self.s)  # [n, V]: V(s o t) for every t, one gather

        def body(c):
            r, first, got, tries = c
            pending = got < self.need
            prop = token_step(self.rule, None, self.s, pending, jax.random.fold_in(key, r), log_probs=self.q)
            ok = pending & jnp.take_along_axis(admitted, prop.token[:, None], -1)[:, 0]
            first = jnp.where(ok & (got == 0), prop.token, first)
            return r + 1, first, got + ok, tries + pending

        got0 = jnp.where(self.done, self.need, 0).astype(jnp.int32)
        init = (jnp.zeros((), jnp.int32), jnp.full((n,), PAD_ID, jnp.int32), got0, jnp.where(self.done, 2, 0))
        _, first, got, tries = jax.lax.while_loop(lambda c: (c[0] < self.max_tries) & (c[2] < self.need).any(),
                                                  body, init)
        self.drawn = (tries.astype(jnp.int32), got >= self.need)
        return first


@per_token
def _start(spec: OneTokenStep, prompt: Any, n: int) -> dict:
    free = TokenRule(None, int(spec.lm.vocab_size))
    s = spec.rule.start(n)
    return {"x": LMState.start(spec.lm, n, prompt=prompt, rule=free, max_len=spec.max_tokens), "q": s,
            "done": spec.rule.is_final(s) | (spec.max_tokens == 0), "lengths": jnp.zeros(n, jnp.int32),
            "tokens": jnp.full((n, max(spec.max_tokens, 1)), PAD_ID, jnp.int32), "calls": jnp.zeros(n, jnp.int32),
            "total": jnp.zeros(n, jnp.int32), "budget": jnp.zeros(n, bool)}


# ---------------------------------------------------------------------------------------------- any token program
@checked_jax
class TokenSteps(Program):
    """The program a :class:`~ppl_thought.numpyro.program.OneTokenStep` describes, drawing its tokens by ``draw``
    (what :class:`~ppl_thought.numpyro.verifiers.VerifierSMC` runs on any token-level program; see the module
    docstring). The target is the spec's p(z) 1[z admitted by ``spec.rule``]. Ended rows draw ``<pad>`` with weight
    1. ``samples[site]`` holds the strings ``[n, max_tokens]`` (``<pad>`` after each end); with ``stats=True`` also
    ``samples["lengths"]``, ``["calls"]`` (proposals from O along the particle's lineage), ``["total"]`` (every
    proposal of the run so far, the same in each row; its maximum is the run's count) and ``["budget"]`` (a
    rejection round ran out of ``max_tries``)."""

    max_plate_nesting = 0

    def __init__(self, spec: OneTokenStep, prompt: Any = None, site: str = "z", draw: str = "masked",
                 max_tries: int = 10_000, stats: bool = False):
        if draw not in _ALL_DRAWS:
            raise ConfigError(f"draw must be one of {DRAWS}, got {draw!r}")
        if not isinstance(site, str) or not site:
            raise ConfigError(f"site must be a non-empty string, got {site!r}")
        self.spec, self.site, self.draw, self.stats = spec, site, draw, bool(stats)
        self.prompt = None if prompt is None else jnp.asarray(prompt, jnp.int32)
        self.max_tries = integer("max_tries", max_tries, minimum=2)
        self.lm, self.max_steps = spec.lm, max(int(spec.max_tokens), 1)
        self.free = TokenRule(None, int(spec.lm.vocab_size))  # O: every token but <pad> and <bos>

    @per_token
    def init(self, state: dict, *args: Any, **kwargs: Any) -> None:
        state.update(_start(self.spec, self.prompt, particles()))

    @per_token
    def step(self, state: dict, t: Any, *args: Any, **kwargs: Any) -> jax.Array:
        x, s, done, spec = state["x"], state["q"], state["done"], self.spec
        log_o = _inactive(x.log_probs(), done)  # O(. | s), Def 3.1.1
        prev_calls = state["calls"]
        calls = prev_calls + (~done)
        budget = state["budget"]
        if self.draw == "lm":  # t ~ O(. | s), factor 1[t admitted]
            tok = sample(self.site, _Token(log_o, self.free))
            ok = jnp.take_along_axis(spec.rule.mask(s), tok[:, None], -1)[:, 0] | done
            factor(f"{self.site}_ok", jnp.where(ok, 0.0, NEG_INF))
        elif self.draw in ("masked", "proposal"):  # t ~ masked softmax (Def 2.8); factor log Z_t (not as a guide)
            tok = sample(self.site, _Token(_inactive(spec.rule.log_probs(x.logp, s), done), self.free))
            if self.draw == "masked":
                factor(f"{self.site}_ok", spec.mass(x.logp, s, done))
        else:  # rounds of proposals from O: the first admitted token (tokenwise), weighted by 1 / (K - 1) (AWRS)
            need = 1 if self.draw == "tokenwise" else 2
            d = _Rounds(log_o, self.free, spec.rule, s, done, need, self.max_tries)
            tok = sample(self.site, d)
            if d.drawn is None:
                raise ProgramError(f"{type(self).__name__}(draw={self.draw!r}) draws its own tokens by rejection "
                                   "rounds: its site cannot be proposed by a guide or replayed")
            tries, within = d.drawn
            calls = prev_calls + jnp.where(done, 0, tries)
            budget = budget | ~within
            if need == 2:
                log_k1 = jnp.log(jnp.maximum(tries - 1, 1).astype(jnp.float32))
                factor(f"{self.site}_ok", jnp.where(within, -log_k1, NEG_INF))
        active = ~done
        lengths = state["lengths"] + active
        s_new = jnp.where(active, spec.rule.step(s, tok), s)
        _, ended = spec.ends(tok, s_new, lengths)
        state["q"], state["lengths"], state["calls"], state["budget"] = s_new, lengths, calls, budget
        # every proposal of every particle so far, the same in every row (so resampling keeps it; the rows still
        # running at the end hold the whole run's count)
        state["total"] = jnp.broadcast_to(state["total"] + (calls - prev_calls).sum(), done.shape)
        state["tokens"] = state["tokens"].at[:, t].set(jnp.where(active, tok, PAD_ID))
        state["done"] = new_done = done | (active & ended)
        x.extend(jnp.where(active, tok, PAD_ID))  # one LM pass (ended rows feed nothing)
        return new_done

    def outputs(self, state: dict, *args: Any, **kwargs: Any) -> dict:
        """``{site: tokens [n, max_tokens]}`` (``<pad>`` after each string's end), and the counts with ``stats``."""
        out = {self.site: state["tokens"][:, : self.spec.max_tokens]}
        if self.stats:
            out.update(lengths=state["lengths"], calls=state["calls"], budget=state["budget"], total=state["total"])
        return out

    def one_token_step(self) -> OneTokenStep:
        """The program's step as one token of the LM (:class:`~ppl_thought.numpyro.program.OneTokenStep`)."""
        return self.spec


# ---------------------------------------------------------------------------------------------- the program
def _task(lm: Any, verifier: Any, prompt: Any) -> tuple[Any, OneTokenStep]:
    """(the JAX verifier, the step) of the task (Def 3.1.2) of ``lm`` and a length-N ``verifier``; a ConfigError
    unless it is well formed, UnsatisfiableConstraintError when A is empty (FAIL)."""
    if not isinstance(lm, LM):
        raise ConfigError(f"expected a JAX LM (ptn.lm.Tabular, ptn.lm.Transformer), got {type(lm).__name__}")
    ver = as_verifier(verifier)
    if ver.length is None:
        raise ConfigError(f"{ver} has no length: the verifier programs decide A subset Sigma^N; build it as "
                          "ProcessVerifier(automaton, length=N)")
    if ver.automaton.vocab_size != lm.vocab_size:
        raise ConfigError(f"the constraint automaton has {ver.automaton.vocab_size} token columns but the LM has "
                          f"vocab_size={lm.vocab_size}")
    if not bool(ver._reach[ver.length, ver.automaton.start]):  # host tables: no sync, no trace
        raise UnsatisfiableConstraintError(f"{ver} rejects the empty prefix: A has no string (FAIL)")
    rule = TokenRule(length_automaton(ver.automaton, ver.length, ver._reach), int(lm.vocab_size))
    return ver, OneTokenStep(lm, rule, ver.length, (), prompt=prompt)


@checked_jax
class VerifiedLM(TokenSteps):
    """p(s) proportional to p_O(s) 1(s in A): a JAX LM restricted to the constraint set of a length-N process
    verifier (Def 3.1.2, Def 3.1.3, Section 3.1.1), one token per step, as a ``ptn.Program`` (module docstring).

    Args:
        lm: the oracle O (``ptn.lm.Tabular``, ``ptn.lm.Transformer``).
        verifier: a :class:`~ppl_thought.numpyro.verifiers.ProcessVerifier` with a length N (or a
            ``pt.verifiers.ProcessVerifier``: its automaton is the same numpy table).
        prompt: 1-D token ids shared by every particle, or None.
        site: the token site (``samples[site]``: the strings ``[n, N]``) and ``f"{site}_ok"`` (the factor).
        draw: ``"lm"``, ``"masked"`` or ``"rejection"`` (module docstring): the same target, Z and law.
        max_tries: proposals per row and position for ``draw="rejection"``; a row that has not had two admitted
            proposals by then gets weight 0 and ``samples["budget"]`` (with ``stats``) marks it.

    Under ``ptn.infer.SMC(n).run(VerifiedLM(...), guide)``, ``exp(log_marginal)`` is unbiased for P_O(A) with
    ``guide=None`` or :class:`LocallyOptimalProposal` (built on the same LM, verifier, prompt and site). The
    constructor raises :class:`~ppl_thought.errors.UnsatisfiableConstraintError` when A is empty.
    """

    def __init__(self, lm: LM, verifier: Any, prompt: Any = None, site: str = "z", draw: str = "lm",
                 max_tries: int = 10_000, stats: bool = False):
        if draw not in DRAWS:
            raise ConfigError(f"draw must be one of {DRAWS}, got {draw!r}")
        self.verifier, spec = _task(lm, verifier, prompt)
        super().__init__(spec, prompt, site, draw, max_tries, stats)


@checked_jax
class LocallyOptimalProposal(TokenSteps):
    """The locally optimal proposal of :class:`VerifiedLM` as a guide program: token i from
    q(t | s) = O(t | s) V(s o t) / Z_V(s), the law of tokenwise rejection (Def 3.1.5). With the model
    ``VerifiedLM(draw="lm")`` the engine's weight p / q is Z_V(s) = sum_t O(t | s) V(s o t), the local mass that
    tokenwise rejection forgets (Prop 3.1.2). Same arguments as :class:`VerifiedLM` (its own LM state: two LM passes
    a token, the guide's and the model's)."""

    def __init__(self, lm: LM, verifier: Any, prompt: Any = None, site: str = "z"):
        self.verifier, spec = _task(lm, verifier, prompt)
        super().__init__(spec, prompt, site, "proposal")
