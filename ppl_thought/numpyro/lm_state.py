"""``ptn.dist.LMState``: the sequence sites of a JAX program over a batch of particles, with a fixed-size cache so
that a step traces (docs/architecture.md, "Sequence sites" and "One protocol, two backends"; torch twin:
ppl_thought/distributions/lm_state.py).

``LMState.start(lm, n, prompt, rule=None, max_len=...)`` encodes ``<bos> + prompt`` once for ``n`` rows into a
cache with room for ``max_len`` more tokens per row (a Transformer's KV cache ``[n, H, S, Dh]``; a Tabular LM's
context). Its sites:

* ``state.next_token()``: a NumPyro distribution over one token per row ``[n]``;
* ``state.segment(stop=ids, max_tokens=k)``: a distribution over the next segment of every row, ``[n, k]``
  right-padded with ``<pad>``: sampled in one lockstep ``lax.while_loop`` of at most k tokens that stops once every
  row ended (the cache carried; reverse mode differentiates it through its one-pass form,
  :func:`~ppl_thought.numpyro.loop_grad.loop_with_one_pass_gradient`),
  scored by one teacher-forced pass from the current cache. A segment ends at a ``stop`` token (included), in a final
  state of the rule, or after ``k`` tokens;
* ``state.extend(value)``: feed a token ``[n]`` / a segment ``[n, k]`` (padding skipped) / one shared token to
  every row: what the LM reads, and what it wrote.

Log-probabilities are the masked softmax of Def 2.8 under the state's rule (default: every token but ``<pad>`` and
``<bos>``); a segment's is the sum of its tokens', (2.13); ``-inf`` for an incomplete segment or tokens after
its end, never NaN. The state is a pytree (its arrays have the rows on axis 0), so engines carry it through
``lax.scan`` and gather it by ancestors after resampling; ``extend`` replaces its arrays (the object is the
program's, inside one trace). The LM's parameters are ``lm.params``: the engines pass every JAX array of a
program, its LMs' parameters included, as arguments of the compiled run and trace copies of the objects rebuilt
around them (:mod:`ppl_thought.numpyro.infer.compiled`), so new parameters, or a new LM of the same shapes, do not
recompile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import Distribution, constraints

from ppl_thought.checks import integer
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.numpyro.boundary import ArrayLike, SupportsTokenRule, checked_jax
from ppl_thought.numpyro.distributions import NEG_INF, TokenRule, token_step, tree_where
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.numpyro.loop_grad import loop_with_one_pass_gradient
from ppl_thought.numpyro.prompts import encode, prompt_array
from ppl_thought.validation import per_token
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["LMState", "NextToken", "Segment"]

# ---------------------------------------------------------------------------------------------- helpers
def _stop_array(stop) -> np.ndarray:
    if stop is None:
        return np.zeros(0, np.int32)
    if isinstance(stop, str):
        raise ConfigError(f"stop takes token ids (an LMState has no vocabulary), got the string {stop!r}: "
                          "pass vocab.id(...)")
    a = np.atleast_1d(np.asarray(stop))
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ConfigError(f"stop takes integer token ids, got {a.dtype}")
    return a.astype(np.int32)


def _take(q: jax.Array, tok: jax.Array) -> jax.Array:
    return jnp.take_along_axis(q, tok[:, None], -1)[:, 0]


def _ids(value, n: int, what: str) -> jax.Array:
    """``value`` as int32 ``[n, S]``: a shared token, tokens ``[n]``, a shared sequence ``[S]`` is not allowed
    (ambiguous with ``[n]``): give ``[1, S]`` or ``[n, S]``."""
    v = jnp.asarray(value)
    if not jnp.issubdtype(v.dtype, jnp.integer):
        raise MalformedSequenceError(f"{what} takes integer token ids, got dtype {v.dtype}")
    if v.ndim == 0:
        v = jnp.broadcast_to(v, (n,))
    if v.ndim == 1:
        if v.shape[0] != n:
            raise MalformedSequenceError(f"{what} got tokens of shape {v.shape}: expected [{n}] (one per row), "
                                         f"[1, S] or [{n}, S]")
        v = v[:, None]
    if v.ndim != 2 or v.shape[0] not in (1, n):
        raise MalformedSequenceError(f"{what} got shape {v.shape}: expected [{n}], [1, S] or [{n}, S]")
    return jnp.broadcast_to(v, (n, v.shape[1])).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------- LMState
@checked_jax
class LMState:
    """A batch of ``n`` LM contexts with a fixed-size cache (see the module docstring).

    Pytree children: ``logp [n, V]`` (the next-token log-probabilities), ``cache`` (the LM's), ``rule_state``
    (the rule's state, rows on axis 0). Static: the LM, the rule, the cache room.
    """

    # the constructor is the pytree's unflatten (JAX calls it with placeholders); start() is the checked entry
    @per_token
    def __init__(self, lm: Any, rule: Any, logp: Any, cache: Any, rule_state: Any, room: Any):
        self.lm, self.rule, self.room = lm, rule, room
        self.logp, self.cache, self.rule_state = logp, cache, rule_state

    # -- pytree ------------------------------------------------------------------------------------------
    @per_token
    def tree_flatten(self) -> tuple[tuple, tuple]:
        return (self.logp, self.cache, self.rule_state), (self.lm, self.rule, self.room)

    @classmethod
    @per_token
    def tree_unflatten(cls, aux: tuple, children: Any) -> LMState:
        lm, rule, room = aux
        return cls(lm, rule, *children, room)

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def start(cls, lm: LM, n: int, prompt: ArrayLike | None = None, rule: SupportsTokenRule | None = None,
              max_len: int = 64) -> LMState:
        """Encode ``<bos> + prompt`` for ``n`` rows, with room for ``max_len`` more tokens per row. ``prompt``: 1-D ids
        shared by every row, or per-row prompts ``[n, P]`` right-padded with ``<pad>`` (``[r, P]`` with r dividing n
        gives each prompt to n / r consecutive rows, as on the torch side); concrete or traced (its shape is
        static). A padded row feeds nothing at its padding (``valid=False``: no cache slot, no position), so each
        row's state is the state of its own prompt alone. ``rule``: a
        :class:`~ppl_thought.numpyro.distributions.TokenRule` the LM's sampling is masked by (Def 2.8); it reads
        every token the state is extended with."""
        n = integer("n (the number of rows: ptn.particles())", n)
        room = integer("max_len", max_len, minimum=0)
        V = int(lm.vocab_size)
        rule = TokenRule(None, V) if rule is None else rule
        if not all(callable(getattr(rule, m, None)) for m in ("start", "log_probs", "step", "is_final")) \
                or int(getattr(rule, "vocab_size", V)) != V:
            raise ConfigError(f"rule must be a ptn.dist.TokenRule over the LM's {V} tokens (or a rule with start, "
                              f"log_probs, step and is_final over them), got {rule!r}")
        logp, cache = encode(lm, lm.params, prompt_array(prompt, V, "prompt"), n, room)  # the one home of prompts
        return cls(lm, rule, logp, cache, rule.start(n), room)

    @property
    def n(self) -> int:
        """The number of rows."""
        return int(self.logp.shape[0])

    # -- sites ---------------------------------------------------------------------------------------------
    @per_token
    def next_token(self) -> NextToken:
        """The law of the next token of every row, ``[n]`` (the rule's masked softmax)."""
        return NextToken(self)

    @per_token
    def segment(self, stop: int | Sequence[int] | None = None, max_tokens: int = 16,
                until: Callable[[Any], Any] | None = None) -> Segment:
        """The law of the next segment of every row, ``[n, max_tokens]`` right-padded (see the module docstring).
        ``until(rule_state) -> bool [n]``: the segment also ends (or is empty) where it holds, e.g. once the domain
        automaton has emitted the next observation (the segments of Lemma 2.1)."""
        return Segment(self, _stop_array(stop), integer("max_tokens", max_tokens), until)

    @per_token
    def extend(self, value: Any) -> LMState:
        """Feed ``value`` (a token, tokens ``[n]``, or segments ``[n, S]`` right-padded with ``<pad>``) to every row;
        returns the state (updated in place)."""
        sampled = self.__dict__.pop("_sampled", None)
        if sampled is not None and sampled[0] is value and sampled[1] is self.cache:
            # the segment this state just sampled: its decoding loop already fed these tokens (no second LM pass)
            self.logp, self.cache, self.rule_state = sampled[2:]
            return self
        v = _ids(value, self.n, "LMState.extend")
        if v.shape[1] == 0:
            return self
        valid = jnp.cumprod(v != PAD_ID, axis=1).astype(bool)  # the tokens before the first <pad>
        logp, cache = _feed(self.lm, self.lm.params, self.cache, v, valid)
        # a segment site scored afterwards (the engine weighs the value a guide proposed) reads these outputs
        self._extended = (value, self.cache, logp)
        count = valid.sum(1)
        last = jnp.take_along_axis(logp, jnp.clip(count - 1, 0)[:, None, None], 1)[:, 0]
        self.logp = jnp.where((count > 0)[:, None], last, self.logp)
        self.cache = cache

        def adv(s, inp):
            tok, ok = inp
            return tree_where(ok, self.rule.step(s, tok), s), None

        self.rule_state, _ = jax.lax.scan(adv, self.rule_state, (v.T, valid.T))
        return self

    @per_token
    def log_probs(self) -> jax.Array:
        """log P(next token) ``[n, V]`` under the rule (Def 2.8)."""
        return self.rule.log_probs(self.logp, self.rule_state)

    def __repr__(self) -> str:
        return f"ptn.dist.LMState(lm={type(self.lm).__name__}, n={self.n}, room={self.room})"


jax.tree_util.register_pytree_node(LMState, LMState.tree_flatten, LMState.tree_unflatten)


def _feed(lm: LM, params: Any, cache: Any, v: jax.Array, valid: jax.Array) -> tuple[jax.Array, Any]:
    """``lm.apply(params, cache, v, valid)`` for right-padded rows ``v [n, K]`` (``valid`` a prefix mask), one
    column at a time while some row still has a token there: the cost follows the longest row, not the bound K.

    A segment site is ``[n, K]`` with K the bound of a whole latent sequence (``SlowThinking.program``: L), while
    a segment of Lemma 2.1 holds a few tokens; one teacher-forced pass over all K columns cost K times the LM
    work of the tokens it feeds. Token by token, each call continues every row from its cache exactly as one
    pass does (a False token is written nowhere and takes no position), so the outputs are the same; the
    columns after the longest row keep the log-probabilities 0 (no consumer reads them: :meth:`Segment.log_prob`
    uses those before each row's end). ``K = 1`` is one call. Reverse mode (SVI on a program whose model's LM
    is trained) differentiates the same function in its one-pass form
    (:func:`~ppl_thought.numpyro.loop_grad.loop_with_one_pass_gradient`)."""
    if v.shape[1] == 1:
        return lm.apply(params, cache, v, valid=valid)
    n, K = v.shape

    def loop(params, cache, v, valid):
        width = valid.sum(1).max()

        def body(c):
            i, cache, out = c
            tok = jax.lax.dynamic_slice_in_dim(v, i, 1, axis=1)
            ok = jax.lax.dynamic_slice_in_dim(valid, i, 1, axis=1)
            lp, cache = lm.apply(params, cache, tok, valid=ok)
            return i + 1, cache, jax.lax.dynamic_update_slice_in_dim(out, lp.astype(out.dtype), i, axis=1)

        out0 = jnp.zeros((n, K, int(lm.vocab_size)), jnp.float32)
        _, cache, out = jax.lax.while_loop(lambda c: c[0] < width, body, (jnp.zeros((), jnp.int32), cache, out0))
        return (out, cache), ()

    def one_pass(params, cache, v, valid, _):
        out, cache = lm.apply(params, cache, v, valid=valid)
        used = jnp.arange(K) < valid.sum(1).max()  # the loop leaves the columns after the longest row at 0
        return jnp.where(used[None, :, None], out.astype(jnp.float32), 0.0), cache

    # every array an argument (a custom_vjp must not close over values of the trace it is differentiated in)
    return loop_with_one_pass_gradient(loop, one_pass, params, cache, v, valid)


# ---------------------------------------------------------------------------------------------- the sites
@checked_jax
class NextToken(Distribution):
    """One token per row from the state's masked next-token law: value int32 ``[n]``."""

    arg_constraints: dict = {}
    support = constraints.nonnegative_integer
    is_discrete = True

    def __init__(self, state: LMState, validate_args: bool | None = None):
        self.state = state
        self.q = state.log_probs()
        super().__init__((state.n,), (), validate_args=validate_args)

    @per_token
    def sample(self, key: Any, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        if sample_shape:
            raise ConfigError("NextToken draws one token per row (sample_shape must be ())")
        st = self.state
        return token_step(st.rule, st.logp, st.rule_state, key=key, log_probs=self.q).token

    @per_token
    def log_prob(self, value: Any, intermediates: Any = None) -> jax.Array:
        v = jnp.broadcast_to(jnp.asarray(value, jnp.int32), (self.state.n,))
        ok = (v >= 0) & (v < self.q.shape[-1])
        return jnp.where(ok, _take(self.q, jnp.clip(v, 0, self.q.shape[-1] - 1)), NEG_INF)


@checked_jax
class Segment(Distribution):
    """The next segment of every row, ``[n, max_tokens]`` right-padded with ``<pad>`` (see the module docstring)."""

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)
    is_discrete = True

    def __init__(self, state: LMState, stop_ids: ArrayLike, max_tokens: int,
                 until: Callable[[Any], Any] | None = None, validate_args: bool | None = None):
        stop_ids, max_tokens = _stop_array(stop_ids), integer("max_tokens", max_tokens, minimum=0)
        # a snapshot: the program extends its state after the site, the engine scores the site afterwards
        self.state = LMState(state.lm, state.rule, state.logp, state.cache, state.rule_state, state.room)
        self.origin = state  # its extend reuses this site's LM pass (sampled) or gives it its own (scored)
        self.stop_ids, self.max_tokens, self.until = stop_ids, max_tokens, until
        super().__init__((state.n,), (max_tokens,), validate_args=validate_args)

    def _ends(self, tok, s) -> jax.Array:
        return jnp.isin(tok, jnp.asarray(self.stop_ids)) | self._done(s)

    def _done(self, s) -> jax.Array:
        """Whether a row in rule state ``s`` has ended its segment (a final state, or ``until``)."""
        d = self.state.rule.is_final(s)
        return d if self.until is None else d | jnp.asarray(self.until(s), bool)

    @per_token
    def sample_with_intermediates(self, key: Any, sample_shape: tuple[int, ...] = ()) -> tuple[jax.Array, list]:
        if sample_shape:
            raise ConfigError("Segment draws one segment per row (sample_shape must be ())")
        st, n, K = self.state, self.state.n, self.max_tokens
        lm, rule, params = st.lm, st.rule, st.lm.params
        done0 = self._done(st.rule_state) | (K == 0)

        if K == 0:
            return jnp.zeros((n, 0), jnp.int32), [jnp.zeros(n)]
        keys = jax.random.split(key, K)

        def loop(params, logp0, cache0, s0, done0, keys):
            def body(carry):
                i, logp, cache, s, done, lq, toks = carry
                step = token_step(rule, logp, s, ~done, keys[i], ends=self._ends)  # Def 2.8: draw, advance, ends
                tok = step.token
                nlogp, cache = lm.apply(params, cache, jnp.where(done, BOS_ID, tok)[:, None], valid=~done[:, None])
                logp = jnp.where(done[:, None], logp, nlogp[:, 0])
                return i + 1, logp, cache, step.state, done | step.ends, lq + step.log_prob, toks.at[i].set(tok)

            # a while loop, not a scan over K: it stops once every row's segment ended (a segment is often far
            # shorter than its bound K, e.g. one step of Lemma 2.1 against the whole latent length L)
            init = (jnp.zeros((), jnp.int32), logp0, cache0, s0, done0, jnp.zeros(n),
                    jnp.full((K, n), PAD_ID, jnp.int32))
            _, logp, cache, s, _, lq, toks = jax.lax.while_loop(lambda c: (c[0] < K) & ~c[4].all(), body, init)
            return (lq, logp, cache), (toks.T, s)

        def one_pass(params, logp0, cache0, s0, done0, keys, aux):
            """The loop's (log Q, final logp, final cache) as a function of the parameters and the state, the
            drawn tokens given: one teacher-forced pass over them (the reverse-mode twin, see loop_grad)."""
            z, _ = aux
            fed = jnp.cumprod(z != PAD_ID, axis=1).astype(bool)
            out, cache = lm.apply(params, cache0, z, valid=fed)
            logps = jnp.concatenate([logp0[:, None], out[:, :-1]], 1)

            def body(s, inp):
                lp_i, tok, ok = inp
                step = token_step(rule, lp_i, s, ok, token=tok)
                return step.state, step.log_prob

            _, steps = jax.lax.scan(body, s0, (jnp.swapaxes(logps, 0, 1), z.T, fed.T))
            count = fed.sum(1)
            last = jnp.take_along_axis(out, jnp.clip(count - 1, 0)[:, None, None], 1)[:, 0]
            return steps.sum(0), jnp.where((count > 0)[:, None], last, logp0), cache

        (lq, logp, cache), (z, s) = loop_with_one_pass_gradient(loop, one_pass, params, st.logp, st.cache,
                                                                st.rule_state, done0, keys)
        self.origin._sampled = (z, st.cache, logp, cache, s)  # extend(z) takes the loop's final state
        return z, [lq]

    @per_token
    def sample(self, key: Any, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        return self.sample_with_intermediates(key, sample_shape)[0]

    @per_token
    def log_prob(self, value: Any, intermediates: Any = None) -> jax.Array:
        """The masked log-probability of each row's segment (one teacher-forced pass from the current cache);
        ``-inf`` if it is incomplete, goes on after its end, or holds a forbidden token."""
        if intermediates:
            return intermediates[0]
        st, n, K = self.state, self.state.n, self.max_tokens
        v = jnp.broadcast_to(jnp.asarray(value, jnp.int32), (n, K))
        nonpad = v != PAD_ID
        prefix = jnp.cumprod(nonpad, axis=1).astype(bool)
        length = prefix.sum(1)
        gap = (nonpad & ~prefix).any(1)  # a token after <pad>: not a right-padded segment
        ext = self.origin.__dict__.get("_extended")
        if K > 1 and ext is not None and ext[0] is value and ext[1] is st.cache:
            logps = jnp.concatenate([st.logp[:, None], ext[2][:, :-1]], 1)  # the pass extend(value) made
        elif K > 1:
            out, _ = st.lm.apply(st.lm.params, st.cache, v[:, :-1], valid=prefix[:, :-1])
            logps = jnp.concatenate([st.logp[:, None], out], 1)
        else:
            logps = st.logp[:, None]
        rule = st.rule

        def body(s, inp):
            lp_i, tok, ok = inp
            step = token_step(rule, lp_i, s, ok, token=tok, ends=self._ends)  # the given token through the step
            return step.state, (step.log_prob, step.ends & ok)

        _, (steps, ends) = jax.lax.scan(body, st.rule_state, (jnp.swapaxes(logps, 0, 1), v.T, prefix.T))
        steps, ends = steps.T, ends.T
        any_end = ends.any(1)
        first_end = jnp.where(any_end, jnp.argmax(ends, 1), K)
        start_final = self._done(st.rule_state)
        complete = jnp.where(start_final, length == 0,
                             jnp.where(any_end, first_end == length - 1, length == K)) & ~gap
        return jnp.where(complete, steps.sum(1), NEG_INF)
