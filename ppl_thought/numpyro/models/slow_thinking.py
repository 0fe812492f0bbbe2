"""The slow-thinking model Proj # P_f as a NumPyro program (Sections 2.6.3, 3.7; torch twin:
ppl_thought/models/slow_thinking.py).

``SlowThinking(prior, projection)(x)`` samples the latent site ``"z" ~ LMSequence(prior,
constraint=projection.domain(|x|))`` (the prior masked to Dom(Proj), Def 2.8) and observes ``"x" ~
ProjectionDelta(projection, z)``. Its marginal likelihood is (2.22), its posterior Q_* of (2.24); both exactly
by enumeration of the lifting for small models (:meth:`SlowThinking.exact_log_prob`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro

from ppl_thought.errors import ConfigError, NotInImageError, TooLargeToEnumerateError
from ppl_thought.numpyro.boundary import ArrayLike, checked_jax
from ppl_thought.numpyro.distributions import NEG_INF, LMSequence, ProjectionDelta, TokenRule, tables
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.numpyro.params import param_tree
from ppl_thought.numpyro.program import Program, factor, particles, sample
from ppl_thought.numpyro.transforms.base import sequence_start
from ppl_thought.projections.automaton import Automaton
from ppl_thought.projections.base import Projection, as_id_array
from ppl_thought.vocab import PAD_ID


def pad_sequences(seqs: Sequence[Any], length: int | None = None) -> np.ndarray:
    """A list of 1-D id sequences -> a right-padded int32 array ``[len(seqs), length]``."""
    L = max((len(s) for s in seqs), default=0) if length is None else int(length)
    out = np.full((len(seqs), L), PAD_ID, np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


@checked_jax
@dataclass
class EnumeratedPosterior:
    """Q_*(z | x) of (2.24) on the enumerated lifting: ``support [K, L]``, ``log_probs [K]`` (log-sum-exp 0),
    ``log_marginal`` = log (Proj # P)^{<=|x|}(x) of (2.22), ``log_joint [K]`` = log P^{<=|z|}(z)."""

    support: np.ndarray
    log_probs: jax.Array
    log_marginal: jax.Array
    log_joint: jax.Array


@checked_jax
class SlowThinking:
    """The NumPyro model of Proj # P_f with latent site ``"z"`` and observed site ``"x"``.

    Args:
        prior: the latent LM P_f (a JAX :class:`~ppl_thought.numpyro.lm.base.LM` over the projection's vocabulary).
        projection: a :class:`~ppl_thought.projections.Projection` (shared with the torch side).
        learn_prior: register the prior's parameters as ``numpyro.param`` sites ``"prior/i"`` (SVI trains them);
            by default they are constants.

    ``model(x)`` with x text, token strings or 1-D ids (concrete: the automata are built from its length and,
    for the observed site, its tokens); ``model(None, length=n)`` generates.
    """

    def __init__(self, prior: LM, projection: Projection, learn_prior: bool = False, name: str = "prior"):
        if int(prior.vocab_size) != len(projection.vocab):
            raise ConfigError(f"prior vocab_size {prior.vocab_size} != projection vocabulary size "
                              f"{len(projection.vocab)}")
        self.prior = prior
        self.projection = projection
        self.vocab = projection.vocab
        self.learn_prior = bool(learn_prior)
        self.name = name
        self._domains: dict[int, Automaton] = {}

    def x_ids(self, x: ArrayLike | str) -> np.ndarray:
        """x as 1-D int64 ids (text, token strings, ids; right padding dropped)."""
        return as_id_array(np.asarray(x) if isinstance(x, jax.Array) else x, self.vocab, "observation x", unpad=True)

    def domain(self, n: int) -> Automaton:
        """``projection.domain(n)``, cached (its jnp tables are cached with it)."""
        if n not in self._domains:
            self._domains[n] = self.projection.domain(int(n))
        return self._domains[n]

    def prior_params(self) -> Any:
        return param_tree(self.name, self.prior.params) if self.learn_prior else self.prior.params

    def z_dist(self, num_observed: int, params: Any = None) -> LMSequence:
        """P_f masked to Dom(Proj) (Def 2.8), stopped once ``num_observed`` tokens are determined."""
        return LMSequence(self.prior, constraint=self.domain(num_observed), vocab=self.vocab,
                          params=self.prior.params if params is None else params)

    def __call__(self, x: ArrayLike | str | None = None, length: int | None = None) -> Any:
        if x is None and length is None:
            raise ConfigError("give the observation x, or length= to generate")
        xa = self.x_ids(x) if x is not None else None
        n = len(xa) if xa is not None else int(length)
        z = numpyro.sample("z", self.z_dist(n, self.prior_params()))
        return numpyro.sample("x", ProjectionDelta(self.projection, z, n), obs=xa)

    model = __call__

    def program(self, x: ArrayLike | str) -> SlowThinkingProgram:
        """This model for the observation ``x`` as a :class:`~ppl_thought.numpyro.program.Program` whose step t
        samples the segment z^(t) of Lemma 2.1 (site ``"z"``) and checks x_t (site ``"x"``, a factor 0 / -inf):
        what the generic engines (``ptn.infer.SMC`` / ``Importance``) run. Cached per x (a compiled run is keyed
        by the program object, so running the same x again does not recompile)."""
        xa = self.x_ids(x)
        cache = self.__dict__.setdefault("_programs", {})
        key = tuple(xa.tolist())
        if key not in cache:
            if len(cache) >= 64:
                cache.clear()
            cache[key] = SlowThinkingProgram(self, xa)
        return cache[key]

    def as_program(self, x: ArrayLike | str | None = None, length: int | None = None) -> SlowThinkingProgram | None:
        """The engines' protocol method (``ptn.infer.SMC(n).run(model, guide, x)`` runs ``model.as_program(x)``
        with ``guide.as_program(x)``, docs/architecture.md "One protocol, two backends"): :meth:`program` for an
        observation x (``NotInImageError`` when x is outside the image of Proj); ``None`` when generating
        (``x=None``: no program binds it)."""
        return None if x is None else self.program(x)

    # ------------------------------------------------------------------ exact answers
    def enumerate_log_joint(self, x: ArrayLike | str, limit: int = 20_000) -> tuple[np.ndarray, jax.Array]:
        """(support ``[K, L]``, log P^{<=|z|}(z) ``[K]``) over the lifting of x (one jitted teacher-forced pass)."""
        xa = self.x_ids(x)
        try:
            lifting = self.projection.enumerate_lifting(xa, limit=limit)
        except TooLargeToEnumerateError as e:
            raise TooLargeToEnumerateError(
                f"exact computation for |x| = {len(xa)} needs the whole lifting: {e}. Use an engine "
                "(ptn.infer.Importance / SMC) for long observations") from None
        n = len(xa)
        dist = self.z_dist(n)
        support = pad_sequences(lifting, dist.max_len)
        K = len(support)
        if not K:
            return support, jnp.zeros(0)
        fns = self.__dict__.setdefault("_log_prob_fns", {})
        if n not in fns:  # one compiled scorer per |x| (its domain automaton); rows padded to a power of 2
            fns[n] = jax.jit(lambda params, z, d=dist: d.log_prob(z) if params is None else
                             LMSequence(d.lm, constraint=d.constraint, max_len=d.max_len, params=params).log_prob(z))
        rows = np.full((1 << (K - 1).bit_length(), support.shape[1]), PAD_ID, np.int32)
        rows[:K] = support
        return support, fns[n](self.prior.params, jnp.asarray(rows))[:K]

    def exact_log_prob(self, x: ArrayLike | str, limit: int = 20_000) -> jax.Array:
        """log (Proj # P)^{<=|x|}(x) = log sum_{z in lifting(x)} P^{<=|z|}(z), equation (2.22); -inf outside the
        image of Proj."""
        try:
            _, lp = self.enumerate_log_joint(x, limit)
        except NotInImageError:
            return jnp.asarray(-jnp.inf)
        return jax.scipy.special.logsumexp(lp) if lp.shape[0] else jnp.asarray(-jnp.inf)

    def exact_posterior(self, x: ArrayLike | str, limit: int = 20_000) -> EnumeratedPosterior:
        """Q_*(z | x) = P^{<=|z|}(z) / (Proj # P)^{<=|x|}(x) on the lifting of x, equation (2.24)."""
        support, lp = self.enumerate_log_joint(x, limit)
        logz = jax.scipy.special.logsumexp(lp) if lp.shape[0] else jnp.asarray(-jnp.inf)
        if not np.isfinite(float(logz)):
            raise NotInImageError(f"x = {self.vocab.decode(self.x_ids(x))!r} has probability 0 under Proj # P")
        return EnumeratedPosterior(support, lp - logz, logz, lp)

    def __repr__(self) -> str:
        return f"SlowThinking(prior={type(self.prior).__name__}, projection={self.projection!r})"


class SlowThinkingProgram(Program):
    """Proj # P_f for one observation x as a step-wise program (Lemma 2.1; torch twin: SlowThinking's ``step``).

    ``init`` starts the prior's :class:`~ppl_thought.numpyro.lm_state.LMState` under the domain automaton
    Dom(Proj) of |x| (the masked prior of Def 2.8) and the lifting automaton Proj^{-1}(x) (Prop 2.3); step t
    samples the segment z^(t) (``"z"``, ``[n, L]`` right-padded: the masked prior decodes until the domain automaton
    has emitted x_{t+1}'s position, or reaches a final state at the last step), extends the state with it, advances
    the lifting automaton and adds the factor ``"x"``: 0 if z^(<=t) emits x_{<=t}, else -inf. So the product of
    the steps' weights is P^{<=|z|}(z) 1[Proj(z) = x] and Z = (Proj # P)^{<=|x|}(x), (2.22). x is a constant of
    the program (its automata are numpy tables built from it): one program per observation. The state also
    collects the whole latent sequence (``"toks" [n, L]``, the segments joined): :meth:`outputs` returns it as
    ``"z"``, so ``Result.samples["z"]`` is ``[n, L]`` as for the whole-trace model.
    """

    def __init__(self, model: SlowThinking, x: ArrayLike | str):
        xa = model.x_ids(x)
        if len(xa) == 0:
            raise ConfigError("SlowThinking.program needs a non-empty observation x (one step per token)")
        self.model, self.xa = model, xa
        self.max_steps = len(xa)
        self.domain = model.domain(len(xa))
        self.rule = TokenRule(self.domain, model.prior.vocab_size)
        self.lift = tables(model.projection.lifting(xa))  # NotInImageError: p(x) = 0
        self.max_len = int(self.domain.max_len)

    def init(self, state: dict[str, Any]) -> None:
        n = particles()
        # the step view's effect (transforms such as Forgetful act on it): LMState.start of z's law, Dom(Proj) masked
        state["lm"] = sequence_start("z", self.model.z_dist(len(self.xa)), n)
        state["lift"] = jnp.full((n,), self.lift.start, jnp.int32)
        state["toks"] = jnp.full((n, self.max_len), PAD_ID, jnp.int32)
        state["length"] = jnp.zeros((n,), jnp.int32)

    def step(self, state: dict[str, Any], t: Any) -> jax.Array:
        lm, D, Lf = state["lm"], self.rule.t, self.lift
        last = t == self.max_steps - 1

        def until(s):
            return jnp.where(last, D.final[s], D.emitted[s] >= t + 1) | (s < 0)

        z = sample("z", lm.segment(max_tokens=self.max_len, until=until))
        lm.extend(z)
        s_l = state["lift"]
        for j in range(self.max_len):
            s_l = Lf.advance(s_l, z[:, j])
        state["lift"] = s_l
        keep = jnp.cumprod(z != PAD_ID, axis=1).astype(bool)  # the segment's tokens (it is right-padded)
        cols = jnp.where(keep, state["length"][:, None] + jnp.arange(self.max_len)[None], self.max_len)
        rows = jnp.arange(lm.n)[:, None]
        state["toks"] = state["toks"].at[rows, cols].set(z, mode="drop")
        state["length"] = state["length"] + keep.sum(1)
        emits = jnp.where(last, Lf.final[s_l], Lf.emitted[s_l] >= t + 1) & (s_l >= 0)
        factor("x", jnp.where(emits, 0.0, NEG_INF))
        return jnp.broadcast_to(last, (lm.n,))

    def outputs(self, state: dict[str, Any]) -> dict:
        """The whole latent z ``[n, L]`` (right-padded): the segments of every particle joined."""
        return {"z": state["toks"]}
