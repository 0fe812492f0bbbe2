"""Sampler families (Def 3.1) as NumPyro guides for the site ``"z"`` (torch twin: ppl_thought/guides).

Every sampler Q(. | x) is supported exactly on the lifting of x and offers ``guide(x)`` (a NumPyro guide
sampling ``"z"``), ``dist(x)`` (the NumPyro distribution of that site), ``sample_with_log_prob(key, x, n)``,
``log_prob(z, x)``, ``proposal(x)`` (the LM, parameters, prompt and token rule it decodes with) and, for SMC,
``program(x)`` (:class:`SamplerProgram`: Q segment by segment, Lemma 2.1).

- :class:`Identity` (3.30) / :class:`Predictive` (Def 3.7): the thought decision with the next observable
  marginalised (the emission substitution of (3.29)), then x_t forced (:class:`MarginalRule`).
- :class:`Causal` (3.33): the LM decoded under the lifting automaton with the masked softmax (Def 2.8).
- :class:`Explanatory` (Def 3.9, Section 5.6.2): the prompt ``x <explain> [mode tag]``, then the lifting.
- :class:`Posterior`: Q_* of (2.24) by enumeration (a table over the lifting).
- :class:`Inquisitive`: Q_bullet of (3.22) by enumeration, P(z) ||grad_theta log P(z)|| (a table, as Posterior).
- :class:`HMMGuide` (defined with the HMM in ppl_thought/numpyro/models/hmm.py): the step-wise guides of
  ``ptn.models.HMM``, the exact posterior (backward messages) and the filtering proposal, as programs.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.distributions import Distribution, constraints

from ppl_thought.checks import integer
from ppl_thought.errors import ConfigError, MalformedSequenceError, UnknownTokenError
from ppl_thought.numpyro.boundary import (
    Array,
    ArrayLike,
    Key,
    SupportsTokenRule,
    as_array,
    as_numpy,
    checked_jax,
    refuse_nan,
)
from ppl_thought.numpyro.distributions import (
    NEG_INF,
    LMSequence,
    TokenRule,
    check_ids,
    const,
    masked_log_softmax,
    tables,
)
from ppl_thought.numpyro.inquisitive import inquisitive_table
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.numpyro.lm_state import LMState
from ppl_thought.numpyro.models.hmm import HMMGuide, HMMGuideProgram
from ppl_thought.numpyro.params import param_tree
from ppl_thought.numpyro.program import Program, particles, sample
from ppl_thought.projections.automaton import Automaton
from ppl_thought.projections.base import Projection, as_id_array
from ppl_thought.projections.substitution import emission_substitution
from ppl_thought.validation import per_token
from ppl_thought.vocab import EXPLAIN_ID, PAD_ID


class _ProposalFields(NamedTuple):
    lm: LM | None
    params: Any
    prompt: np.ndarray
    rule: Any
    max_len: int


@checked_jax
class Proposal(_ProposalFields):
    """What a sampler decodes with: ``lm`` (None for table samplers), its ``params``, a shared ``prompt``, the
    token ``rule`` and the event length ``max_len`` (SMC steps it segment by segment). Made by a sampler's
    :meth:`Sampler.proposal`; built by hand, its fields are checked: an LM or None, 1-D integer ids, a token rule,
    an integer length >= 0 (:class:`~ppl_thought.errors.ConfigError` naming the field), parameters without NaN
    (:class:`~ppl_thought.errors.NumericalError`)."""

    __slots__ = ()

    def __new__(cls, lm: LM | None, params: Any, prompt: ArrayLike, rule: SupportsTokenRule,
                max_len: int) -> Proposal:
        if lm is not None and not isinstance(lm, LM):
            raise ConfigError(f"Proposal: lm must be a ptn LM or None, got {type(lm).__name__}")
        if not isinstance(rule, SupportsTokenRule):
            raise ConfigError(f"Proposal: rule must be a token rule (start, log_probs, step, is_final), got "
                              f"{type(rule).__name__}")
        p = as_numpy("prompt", prompt, where="Proposal")
        if p.ndim != 1 or (p.size and not np.issubdtype(p.dtype, np.integer)):
            raise MalformedSequenceError(f"Proposal: prompt must be 1-D integer ids, got {p.dtype} {p.shape}")
        refuse_nan("Proposal", {"params": params})
        if params is not None:
            refuse_nan("Proposal", {f"params leaf {i}": leaf for i, leaf in enumerate(jax.tree.leaves(params))})
        return super().__new__(cls, lm, params, prompt, rule, integer("max_len", max_len, minimum=0))


@runtime_checkable
class SupportsSlowThinking(Protocol):
    """What :class:`Identity` reads of its model (``ptn.models.SlowThinking``): ``prior``, ``projection``, ``name``,
    ``prior_params()``."""

    prior: LM
    projection: Projection
    name: str

    def prior_params(self) -> Any: ...


@runtime_checkable
class SupportsExactPosterior(Protocol):
    """What :class:`Posterior` reads of its model: ``projection`` and ``exact_posterior(x, limit)``."""

    projection: Projection

    def exact_posterior(self, x: Any, limit: int = ...) -> Any: ...


@checked_jax
class Sampler:
    """Base class of the NumPyro samplers Q(z | x) (Def 3.1). Subclasses implement :meth:`dist`."""

    site = "z"
    projection: Projection

    def _cache(self) -> dict:
        c = self.__dict__.get("_automata")
        if c is None or len(c) > 256:
            c = self.__dict__["_automata"] = {}
        return c

    def x_ids(self, x: ArrayLike | str) -> np.ndarray:
        xa = as_id_array(np.asarray(x) if isinstance(x, jax.Array) else x, self.projection.vocab,
                         "observation x", unpad=True)
        self.lifting(xa)  # NotInImageError naming the problem
        return xa

    def lifting(self, x: ArrayLike) -> Automaton:
        xa = np.asarray(x, np.int64)
        key = ("lift", tuple(xa.tolist()))
        c = self._cache()
        if key not in c:
            c[key] = self.projection.lifting(xa)
        return c[key]

    def domain(self, n: int) -> Automaton:
        key = ("dom", int(n))
        c = self._cache()
        if key not in c:
            c[key] = self.projection.domain(int(n))
        return c[key]

    def event_length(self, x: ArrayLike) -> int:
        """L = ``projection.domain(|x|).max_len``: the event length of the model's site ``"z"``."""
        L = self.domain(len(x)).max_len
        if L is None:
            raise ConfigError(f"{type(self.projection).__name__}.domain({len(x)}) is unbounded: no event length")
        return int(L)

    def params(self) -> Any:
        """The parameters the sampler decodes with (``numpyro.param`` sites when trainable, inside a trace)."""
        return None

    def dist(self, x: ArrayLike, params: Any = None) -> Distribution:
        raise NotImplementedError

    def __call__(self, x: ArrayLike | str | None = None, *args: Any, **kwargs: Any) -> Any:
        """The NumPyro guide: samples the site ``"z"``."""
        if x is None:
            raise ConfigError("a guide needs the observation x")
        return numpyro.sample(self.site, self.dist(self.x_ids(x), self.params()))

    guide = __call__

    @per_token
    def sample_with_log_prob(self, key: Key, x: ArrayLike | str, n: int) -> tuple[jax.Array, jax.Array]:
        """n draws Z ~ Q(. | x) (one batched decoding) and log Q(Z | x)."""
        d = self.dist(self.x_ids(x))
        z, inter = d.sample_with_intermediates(key, (int(n),))
        return z, d.log_prob(z, inter)

    @per_token
    def log_prob(self, z: ArrayLike, x: ArrayLike | str) -> jax.Array:
        """log Q(z | x) ``[n]``: -inf outside the lifting of x, never NaN."""
        xa = self.x_ids(x)
        zz = check_ids(z, len(self.projection.vocab), self.event_length(xa), "latent z")
        zz = jnp.asarray(zz)
        zz = zz[None] if zz.ndim == 1 else zz
        if zz.shape[-1] < self.event_length(xa):
            zz = jnp.pad(zz, ((0, 0), (0, self.event_length(xa) - zz.shape[-1])))
        return self.dist(xa).log_prob(zz)

    def proposal(self, x: ArrayLike, params: Any = None) -> Proposal:
        raise NotImplementedError(f"{type(self).__name__} has no step-wise form")

    def as_program(self, x: ArrayLike | str) -> SamplerProgram:
        """The engines' protocol method (the guide of ``SlowThinking.as_program(x)`` in ``ptn.infer.SMC``):
        :meth:`program`."""
        return self.program(x)

    def program(self, x: ArrayLike | str) -> SamplerProgram:
        """Q(. | x) as a :class:`~ppl_thought.numpyro.program.Program` that proposes the segments of Lemma 2.1
        (site ``"z"``, ``[n, L]`` per step): the guide of ``SlowThinking.program(x)`` in ``ptn.infer.SMC``.
        Cached per x (a compiled run is keyed by the program object)."""
        xa = self.x_ids(x)
        key = ("program", tuple(xa.tolist()))
        c = self._cache()
        if key not in c:
            c[key] = SamplerProgram(self, xa)
        return c[key]


class _LMSampler(Sampler):
    """An LM decoded under the lifting of x after a prompt; its parameters trainable under ``name``."""

    def __init__(self, lm: LM, projection: Projection, name: str, trainable: bool = True):
        if int(lm.vocab_size) != len(projection.vocab):
            raise ConfigError(f"LM vocab_size {lm.vocab_size} != projection vocabulary size {len(projection.vocab)}")
        self.lm, self.projection, self.name, self.trainable = lm, projection, name, bool(trainable)

    def params(self) -> Any:
        return param_tree(self.name, self.lm.params) if self.trainable else self.lm.params

    def prompt(self, x: ArrayLike) -> np.ndarray:
        return np.zeros(0, np.int64)

    def rule(self, x: ArrayLike) -> SupportsTokenRule:
        key = ("rule", tuple(x.tolist()))
        c = self._cache()
        if key not in c:
            c[key] = TokenRule(self.lifting(x), len(self.projection.vocab))
        return c[key]

    def dist(self, x: ArrayLike, params: Any = None) -> LMSequence:
        x = np.asarray(x, np.int64)
        return LMSequence(self.lm, prompt=self.prompt(x), constraint=self.lifting(x), max_len=self.event_length(x),
                          params=params, rule=self.rule(x))

    def proposal(self, x: ArrayLike, params: Any = None) -> Proposal:
        x = np.asarray(x, np.int64)
        return Proposal(self.lm, self.lm.params if params is None else params, self.prompt(x), self.rule(x),
                        self.event_length(x))


@checked_jax
class Causal(_LMSampler):
    """The causal sampler (3.33), Def 3.8: ``LMSequence(lm, constraint=projection.lifting(x))``; the masked softmax
    renormalises a thought against x_t, so segment t depends on x_t but never on x_>t."""

    def __init__(self, lm: LM, projection: Projection, name: str = "causal_lm", trainable: bool = True):
        super().__init__(lm, projection, name, trainable)


@checked_jax
class Explanatory(_LMSampler):
    """The explanatory sampler (Def 3.9, Section 5.6.2): prompt ``x <explain> [mode_tag]`` (Fig 5.5, 5.2), then z
    decoded under the lifting automaton of x, so each token of z may read all of x."""

    def __init__(self, lm: LM, projection: Projection, mode_tag: str | None = None, name: str = "explanatory_lm",
                 trainable: bool = True):
        super().__init__(lm, projection, name, trainable)
        v = projection.vocab
        self.mode_tag = mode_tag
        if mode_tag is not None and mode_tag not in v.specials:
            raise UnknownTokenError(f"mode tag {mode_tag!r} must be an extra special of the vocabulary; specials "
                                    f"are {list(v.specials)}")
        self._tag = [] if mode_tag is None else [v.id(mode_tag)]

    def prompt(self, x: ArrayLike) -> np.ndarray:
        return np.concatenate([np.asarray(x, np.int64), [EXPLAIN_ID], self._tag]).astype(np.int64)


class _NoLM(LM):
    """The LM of a table sampler (:class:`Posterior`): no parameters, an empty cache, uniform log-probabilities
    (its :class:`TableRule` ignores them), so it decodes through :class:`~ppl_thought.numpyro.lm_state.LMState`."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.params: dict = {}

    def init_cache(self, batch: int, max_len: int = 0) -> dict:
        return {"none": jnp.zeros((int(batch), 0), jnp.int32)}

    def apply(self, params, cache, tokens, valid=None, latents=None):
        B, T = jnp.shape(tokens)
        return jnp.zeros((B, T, self.vocab_size)), cache


@checked_jax
def lifting_state(rule: SupportsTokenRule, s: Any) -> tuple[Any, jax.Array]:
    """(the lifting automaton's tables, its state ``[n]``) inside the state ``s`` of a sampler's token rule."""
    if isinstance(rule, TokenRule):
        if rule.t is None:
            raise ConfigError("lifting_state: this TokenRule has no constraint automaton (no lifting)")
        return rule.t, s
    if not callable(getattr(rule, "lifting_state", None)):
        raise ConfigError(f"lifting_state: {type(rule).__name__} is not a sampler's token rule (no lifting_state)")
    return rule.lifting_state(s)


@checked_jax
class SamplerProgram(Program):
    """A sampler Q(z | x) as a step-wise program (Lemma 2.1; torch twin: ``Sampler.init`` / ``Sampler.step``).

    ``init`` starts the sampler's :class:`~ppl_thought.numpyro.lm_state.LMState` (its LM after its prompt, under
    its token rule: the lifting of x for :class:`Causal` / :class:`Explanatory`, (3.30) for :class:`Identity` /
    :class:`Predictive`, the table of Q_* for :class:`Posterior`); step t samples the segment z^(t) (site
    ``"z"``, ``[n, L]``): the tokens up to the one that determines x_{t+1} (the lifting automaton has emitted
    t + 1 observables), the last segment up to a final state, and extends the state with it. The same sites
    and segment ends as ``SlowThinking.program(x)``, so SMC weighs each segment by P / Q.
    """

    def __init__(self, sampler: Sampler, x: ArrayLike | str):
        self.sampler = sampler
        x = sampler.x_ids(x)
        self.prop = sampler.proposal(x)
        self.lm = self.prop.lm if self.prop.lm is not None else _NoLM(len(sampler.projection.vocab))
        self.max_steps = len(x)
        self.max_len = int(self.prop.max_len)

    @per_token
    def init(self, state: dict[str, Any]) -> None:
        state["q"] = LMState.start(self.lm, particles(), prompt=self.prop.prompt, rule=self.prop.rule,
                                   max_len=self.max_len)

    @per_token
    def step(self, state: dict[str, Any], t: Any) -> jax.Array:
        q = state["q"]
        last = t == self.max_steps - 1

        def until(s):
            Lf, sL = lifting_state(q.rule, s)
            return jnp.where(last, Lf.final[sL], Lf.emitted[sL] >= t + 1) | (sL < 0)

        z = sample(self.sampler.site, q.segment(max_tokens=self.max_len, until=until))
        q.extend(z)
        return jnp.broadcast_to(last, (q.n,))

    def __repr__(self) -> str:
        return f"SamplerProgram({type(self.sampler).__name__}, |x|={self.max_steps})"


# ---------------------------------------------------------------------------------------------- (3.30)
@checked_jax
class MarginalRule:
    """The next-token rule of (3.30) for a disentangled Proj: the LM masked to Dom(Proj) (Def 2.8), the mass of
    every emitting token v moved onto ``sub[v, x_t]`` (3.29), restricted to the lifting and renormalised.

    State: ``(domain state [n], lifting state [n])``. The thought decision sees x_<t only (predictive, Def 3.7).
    """

    def __init__(self, projection: Projection, domain: Automaton, lifting: Automaton, x: ArrayLike):
        x = as_numpy("x", x, where="MarginalRule")
        if x.ndim != 1 or (x.size and not np.issubdtype(x.dtype, np.integer)):
            raise MalformedSequenceError(f"MarginalRule: x must be 1-D integer ids, got {x.dtype} {x.shape}")
        if domain.vocab_size != len(projection.vocab) or lifting.vocab_size != len(projection.vocab):
            raise ConfigError("MarginalRule: the domain and lifting automata must be over the projection's "
                              f"{len(projection.vocab)} tokens")
        self.D, self.Lf = tables(domain), tables(lifting)
        self.x = const(np.asarray(x, np.int32) if len(x) else np.zeros(1, np.int32))
        self.T = len(x)
        self.sub = const(emission_substitution(projection), jnp.int32)
        self.V = self.vocab_size = int(self.sub.shape[0])

    @per_token
    def start(self, n: int) -> tuple[jax.Array, jax.Array]:
        return (jnp.full((n,), self.D.start, jnp.int32), jnp.full((n,), self.Lf.start, jnp.int32))

    @per_token
    def log_probs(self, logp: jax.Array, s: Any) -> jax.Array:
        sD, sL = s
        N, V = logp.shape
        mD = self.D.allowed[sD]
        masked = jnp.where(mD, logp, NEG_INF)
        mx = masked.max(-1, keepdims=True)
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        p = jnp.where(mD, jnp.exp(masked - mx), 0.0)
        nxt = self.D.table[sD]  # [N, V]
        emitting = mD & (self.D.emitted[nxt] > self.D.emitted[sD][:, None])
        t = jnp.clip(self.Lf.emitted[sL], 0, max(self.T - 1, 0))
        sub = self.sub[:, self.x[t]].T  # [N, V]: sub[v, x_t]
        tgt = jnp.where(emitting, sub, jnp.arange(V)[None])
        tgt = jnp.where(tgt < 0, V, tgt)  # no substitute: the mass is dropped
        q = jnp.zeros((N, V + 1), p.dtype).at[jnp.arange(N)[:, None], tgt].add(p)[:, :V]
        q = q * self.Lf.allowed[sL]
        return masked_log_softmax(jnp.log(jnp.where(q > 0, q, 1.0)), q > 0)

    @per_token
    def step(self, s: Any, tok: Any) -> tuple[jax.Array, jax.Array]:
        return (self.D.table[s[0], tok], self.Lf.table[s[1], tok])

    @per_token
    def is_final(self, s: Any) -> jax.Array:
        return self.Lf.final[s[1]]

    @per_token
    def lifting_state(self, s: Any) -> tuple[Any, jax.Array]:
        return self.Lf, s[1]


@checked_jax
class Identity(_LMSampler):
    """The identity sampler Q_id of (3.30), Def 3.6: the model's prior decoded with the next observable
    marginalised out of each thought decision, then x_t forced. Needs a disentangled projection (Def 3.5)."""

    def __init__(self, model: SupportsSlowThinking):
        super().__init__(model.prior, model.projection, name=model.name, trainable=False)
        self.model = model
        emission_substitution(model.projection)  # NotDisentangledError now, not at the first draw

    def params(self) -> Any:
        return self.model.prior_params()

    def rule(self, x: ArrayLike) -> MarginalRule:
        key = ("marginal", tuple(x.tolist()))
        c = self._cache()
        if key not in c:
            c[key] = MarginalRule(self.projection, self.domain(len(x)), self.lifting(x), x)
        return c[key]


@checked_jax
class Predictive(Identity):
    """A predictive sampler (Def 3.7) with its own trainable LM: the decision rule of :class:`Identity` ((3.30)
    with ``lm`` in place of P), so the segment before x_t reads only x_<t and earlier segments (3.31)."""

    def __init__(self, lm: LM, projection: Projection, name: str = "predictive_lm", trainable: bool = True):
        _LMSampler.__init__(self, lm, projection, name, trainable)
        emission_substitution(projection)

    def params(self) -> Any:
        return _LMSampler.params(self)


# ---------------------------------------------------------------------------------------------- Q_* (2.24)
@checked_jax
class TableRule:
    """Q(next token | prefix) from a table over the lifting (ratios of prefix masses): the step-wise form of
    :class:`Posterior`. State: ``(rows of the table agreeing with the prefix [n, K], position [n], lifting state)``."""

    def __init__(self, support: Array, log_probs: Array, lifting: Automaton, vocab_size: int):
        self.V = self.vocab_size = integer("vocab_size", vocab_size, minimum=2)
        support, log_probs = _table(support, log_probs, "TableRule")
        if lifting.vocab_size != self.V:
            raise ConfigError(f"TableRule: the lifting automaton has {lifting.vocab_size} token columns, "
                              f"vocab_size is {self.V}")
        if support.size and support.max() >= self.V:
            raise UnknownTokenError(f"TableRule: support holds ids outside the vocabulary [0, {self.V})")
        self.support = const(support, jnp.int32)
        self.lq = const(log_probs)
        self.Lf = tables(lifting)

    @per_token
    def start(self, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        K = self.support.shape[0]
        return (jnp.ones((n, K), bool), jnp.zeros((n,), jnp.int32), jnp.full((n,), self.Lf.start, jnp.int32))

    @per_token
    def log_probs(self, logp: Any, s: Any) -> jax.Array:
        agree, pos, _ = s
        n, K = agree.shape
        L = self.support.shape[1]
        tok = self.support[:, jnp.clip(pos, 0, L - 1)].T  # [n, K]
        w = jnp.where(agree & (pos[:, None] < L), jnp.exp(self.lq - self.lq.max())[None], 0.0)
        q = jnp.zeros((n, self.V), w.dtype).at[jnp.arange(n)[:, None], tok].add(w)
        q = q.at[:, PAD_ID].set(0.0)
        return masked_log_softmax(jnp.log(jnp.where(q > 0, q, 1.0)), q > 0)

    @per_token
    def step(self, s: Any, tok: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        agree, pos, sL = s
        L = self.support.shape[1]
        col = self.support[:, jnp.clip(pos, 0, L - 1)].T
        return (agree & (col == tok[:, None]), pos + 1, self.Lf.table[sL, tok])

    @per_token
    def is_final(self, s: Any) -> jax.Array:
        return self.Lf.final[s[2]]

    @per_token
    def lifting_state(self, s: Any) -> tuple[Any, jax.Array]:
        return self.Lf, s[2]


def _table(support: Any, log_probs: Any, where: str) -> tuple[np.ndarray, Any]:
    """A table of Q_*: integer rows ``[K, L]`` (K >= 1) and their log-probabilities ``[K]`` (no NaN, no +inf);
    traced log-probabilities pass unread."""
    rows = as_numpy("support", support, where=where)
    if rows.ndim != 2 or rows.shape[0] == 0 or not np.issubdtype(rows.dtype, np.integer) or rows.min() < 0:
        raise MalformedSequenceError(f"{where}: support must be K >= 1 rows of token ids [K, L], got {rows.dtype} "
                                     f"{rows.shape}")
    lq = as_array("log_probs", log_probs, where=where)
    if lq.shape != rows.shape[:1] or not jnp.issubdtype(lq.dtype, jnp.floating):
        raise MalformedSequenceError(f"{where}: log_probs must be floats [K={rows.shape[0]}], got {lq.dtype} "
                                     f"{tuple(lq.shape)}")
    if not isinstance(lq, jax.core.Tracer) and (np.isnan(a := np.asarray(lq)) | np.isposinf(a)).any():
        raise MalformedSequenceError(f"{where}: log_probs hold NaN or +inf")
    return rows, lq


@checked_jax
class TableDistribution(Distribution):
    """A categorical law over the rows of ``support [K, L]`` with log-probabilities ``log_probs [K]``."""

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)

    def __init__(self, support_rows: Array, log_probs: Array, batch_shape: tuple[int, ...] = ()):
        support_rows, log_probs = _table(support_rows, log_probs, "TableDistribution")
        self.rows = jnp.asarray(support_rows, jnp.int32)
        self.lq = jnp.asarray(log_probs)
        super().__init__(tuple(batch_shape), (self.rows.shape[1],))

    @per_token
    def expand(self, batch_shape: Any) -> TableDistribution:
        return TableDistribution(self.rows, self.lq, tuple(batch_shape))

    @per_token
    def sample(self, key: Key, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        idx = jax.random.categorical(key, self.lq, shape=tuple(sample_shape) + tuple(self.batch_shape))
        return self.rows[idx]

    @per_token
    def log_prob(self, value: Any, intermediates: Any = None) -> jax.Array:
        v = jnp.asarray(value, jnp.int32)
        if v.shape[-1] != self.rows.shape[1]:
            raise MalformedSequenceError(f"latent z has {v.shape[-1]} columns, the table {self.rows.shape[1]}")
        eq = (v[..., None, :] == self.rows).all(-1)  # [..., K]
        return jnp.where(eq.any(-1), self.lq[jnp.argmax(eq, -1)], NEG_INF)


@checked_jax
class Posterior(Sampler):
    """The posterior sampler Q_*(z | x) = P^{<=|z|}(z) / (Proj # P)^{<=|x|}(x), equation (2.24), by enumeration
    (``model.exact_posterior``): every importance weight P(z) / Q_*(z) equals p(x)."""

    def __init__(self, model: SupportsExactPosterior, limit: int = 20_000):
        self.model, self.projection, self.limit = model, model.projection, integer("limit", limit)

    def table(self, x: ArrayLike) -> tuple[np.ndarray, jax.Array]:
        x = np.asarray(x, np.int64)
        key = ("table", tuple(x.tolist()))
        c = self._cache()
        if key not in c:
            with jax.ensure_compile_time_eval():  # concrete even when first asked inside a trace
                post = self.model.exact_posterior(x, self.limit)
            c[key] = (post.support, post.log_probs)
        return c[key]

    def dist(self, x: ArrayLike, params: Any = None) -> TableDistribution:
        return TableDistribution(*self.table(x))

    def proposal(self, x: ArrayLike, params: Any = None) -> Proposal:
        x = np.asarray(x, np.int64)
        support, lq = self.table(x)
        return Proposal(None, None, np.zeros(0, np.int64),
                        TableRule(support, lq, self.lifting(x), len(self.projection.vocab)), self.event_length(x))


@checked_jax
class Inquisitive(Posterior):
    """The inquisitive sampler Q_bullet of (3.22), Def 3.2, exactly for small models (torch: ``pt.guides.Inquisitive``):

        Q_bullet(z | x) ∝ P_f^{<=|z|}(z) * || grad_theta log P_f^{<=|z|}(z) ||,   z in lifting(x),

    theta = every parameter of the prior (the norm of the concatenated per-sequence gradient, one ``jax.jacrev``:
    :mod:`ppl_thought.numpyro.inquisitive`); ``centered=True`` is Remark 3.7's translation-invariant variant, the
    distance to the mean gradient. A table over the lifting like :class:`Posterior`: ``guide(x)``, ``log_prob``,
    ``program(x)`` for ``ptn.infer.Importance`` / ``SMC``. Tables are cached per x: :meth:`clear` after the prior's
    parameters change."""

    def __init__(self, model: SupportsExactPosterior, centered: bool = False, limit: int = 2_000):
        super().__init__(model, limit)
        for need in ("enumerate_log_joint", "z_dist", "prior"):
            if not hasattr(model, need):
                raise ConfigError(f"Inquisitive needs a ptn.models.SlowThinking-like model (with {need}); got "
                                  f"{type(model).__name__}")
        self.centered = bool(centered)

    def table(self, x: ArrayLike) -> tuple[np.ndarray, jax.Array]:
        x = np.asarray(x, np.int64)
        key = ("inquisitive", self.centered, tuple(x.tolist()))
        c = self._cache()
        if key not in c:
            with jax.ensure_compile_time_eval():  # concrete even when first asked inside a trace
                c[key] = inquisitive_table(self.model, x, self.centered, self.limit)
        return c[key]

    def clear(self) -> None:
        """Forget the cached tables (call after the prior's parameters change)."""
        self.__dict__.pop("_automata", None)


__all__ = ["Causal", "Explanatory", "HMMGuide", "HMMGuideProgram", "Identity", "Inquisitive", "MarginalRule",
           "Posterior", "Predictive", "Proposal", "Sampler", "SamplerProgram", "TableDistribution", "TableRule",
           "lifting_state"]
