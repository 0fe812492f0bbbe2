"""NumPyro distributions over token sequences (the JAX twin of ppl_thought/distributions): :class:`LMSequence`
(an LM decoded under a token automaton, Def 2.8) and :class:`ProjectionDelta` (x = Proj(z)).

The automata are the projections' numpy tables (:class:`~ppl_thought.projections.Automaton`), read with
``jnp.asarray``: :func:`tables` adds the dead row (index ``-1`` wraps onto it, so a dead state stays dead)
and forbids ``<pad>`` and ``<bos>``. A *token rule* (:class:`TokenRule` and the guides' rules) turns the LM's
next-token log-probabilities and a rule state into the masked law of the next token; one decoding loop
(:func:`decode`, a ``lax.scan`` over positions with every particle a row of the batch and the KV cache
carried) samples, and one teacher-forced pass (:func:`score`) scores; both, and the LMState sites, take every
token through one token step (:func:`token_step`: masked softmax, draw, automaton advance, end flags). All are
pure functions of arrays: they run under ``jit``, ``vmap`` and ``grad``.

Log-probabilities follow the masked parametrisation log softmax(f~(z_<i))_{z_i} of Def 2.8; a sequence's is
their sum, (2.13) and (2.22). ``-inf`` outside the domain, never NaN.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import Distribution, constraints

from ppl_thought.checks import integer
from ppl_thought.errors import ConfigError, MalformedSequenceError, NotInImageError, UnknownTokenError
from ppl_thought.numpyro.boundary import Array, ArrayLike, Key, SupportsTokenRule, as_array, checked_jax
from ppl_thought.numpyro.ids import check_ids, pad_to, prompt_ids
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.numpyro.loop_grad import loop_with_one_pass_gradient
from ppl_thought.numpyro.prompts import encode, prompt_array
from ppl_thought.projections.automaton import Automaton, forced_runs
from ppl_thought.projections.base import Projection
from ppl_thought.projections.token_lift import check_tokenizer
from ppl_thought.validation import per_token
from ppl_thought.vocab import BOS_ID, PAD_ID, Vocab

#: the public names (``token_step`` / ``TokenStep``, the backend's one token step, are internal: every sampler and
#: scorer here steps through them)
__all__ = ["NEG_INF", "LMSequence", "ProjectionDelta", "Tables", "TokenRule", "check_ids", "const", "decode",
           "decode_chunked", "encode", "masked_log_softmax", "pad_to", "sample_token", "score", "tables",
           "teacher_forced", "tree_where"]

NEG_INF = -jnp.inf


@checked_jax
def const(a: ArrayLike, dtype: Any = None) -> jax.Array:
    """A concrete jnp array even when called while a function is being traced (cached tables are built once
    and outlive any trace)."""
    with jax.ensure_compile_time_eval():
        return as_array("a", a, dtype, "const")


# ---------------------------------------------------------------------------------------------- automaton tables
@checked_jax
class Tables:
    """jnp views of an :class:`Automaton`: ``table [S+1, V]`` (the last row is the dead state, ``-1``),
    ``allowed [S+1, V]`` (admissible next tokens Phi^{<=1} of (2.26), never ``<pad>``/``<bos>``),
    ``final [S+1]``, ``emitted [S+1]`` (dead: ``-1``), ``start``, ``max_len``."""

    def __init__(self, automaton: Automaton):
        t = np.concatenate([automaton.next_state, np.full((1, automaton.vocab_size), -1)], 0)
        allowed = t >= 0
        allowed[:, PAD_ID] = False
        allowed[:, BOS_ID] = False
        self.automaton = automaton
        self.table = const(t, jnp.int32)
        self.allowed = const(allowed)
        self.final = const(np.concatenate([automaton.final, [False]]))
        self.emitted = const(np.concatenate([automaton.emitted, [-1]]), jnp.int32)
        self.start = int(automaton.start)
        self.max_len = automaton.max_len
        self.num_states = automaton.num_states

    @per_token
    def step(self, s: Any, tok: Any) -> Any:
        return self.table[s, tok]

    @per_token
    def advance(self, s: Any, tok: Any) -> Any:
        """:meth:`step`, except that ``<pad>`` keeps the state (right-padded rows)."""
        return jnp.where(tok == PAD_ID, s, self.table[s, tok])


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@checked_jax
def tables(automaton: Automaton) -> Tables:
    """The (cached) :class:`Tables` of an automaton."""
    t = _TABLES.get(automaton)
    if t is None:
        t = _TABLES[automaton] = Tables(automaton)
    return t


@checked_jax
def masked_log_softmax(logp: Array, mask: Array) -> jax.Array:
    """log softmax over admissible tokens (Def 2.8); rows with none admissible are all -inf, never NaN."""
    x = jnp.where(mask, logp, NEG_INF)
    dead = ~jnp.any(mask & (logp > NEG_INF), -1, keepdims=True)
    out = jax.nn.log_softmax(jnp.where(dead, 0.0, x), -1)
    return jnp.where(dead | ~mask, NEG_INF, out)


@checked_jax
def tree_where(cond: Array, a: Any, b: Any) -> Any:
    """``where(cond, a, b)`` leaf by leaf, ``cond [n]`` broadcast over each leaf's trailing axes (leaves: arrays
    with the rows on axis 0)."""
    def where(u, v):
        u, v = as_array("a", u, where="tree_where"), as_array("b", v, where="tree_where")
        if cond.ndim != 1:
            raise MalformedSequenceError(f"tree_where: cond must be [n] (one flag per row), got shape "
                                         f"{tuple(cond.shape)}")
        return jnp.where(cond.reshape(cond.shape + (1,) * (u.ndim - 1)), u, v)

    if jax.tree.structure(a) != jax.tree.structure(b):
        raise MalformedSequenceError(f"tree_where: a and b must have the same tree structure, got "
                                     f"{jax.tree.structure(a)} and {jax.tree.structure(b)}")
    return jax.tree.map(where, a, b)


# ---------------------------------------------------------------------------------------------- token rules
@checked_jax
class TokenRule:
    """The masked softmax of Def 2.8 under an automaton (or none: every token but ``<pad>``/``<bos>``).

    A rule's state is a pytree with the rows on axis 0; here one automaton state per row.
    """

    def __init__(self, constraint: Automaton | None, vocab_size: int):
        self.constraint = constraint
        self.vocab_size = integer("vocab_size", vocab_size, minimum=2)
        if constraint is not None and constraint.vocab_size != self.vocab_size:
            raise ConfigError(f"TokenRule: the constraint automaton has {constraint.vocab_size} token columns, "
                              f"vocab_size is {self.vocab_size}")
        self.t = tables(constraint) if constraint is not None else None
        free = np.ones(self.vocab_size, bool)
        free[[PAD_ID, BOS_ID]] = False
        self._free = const(free)

    @per_token
    def start(self, n: int) -> jax.Array:
        return jnp.full((n,), self.t.start if self.t is not None else 0, dtype=jnp.int32)

    @per_token
    def mask(self, s: Any) -> jax.Array:
        return self.t.allowed[s] if self.t is not None else jnp.broadcast_to(self._free, s.shape + self._free.shape)

    @per_token
    def log_probs(self, logp: jax.Array, s: Any) -> jax.Array:
        """log Q(next token | state) ``[n, V]``: the LM's log-probabilities masked and renormalised."""
        return masked_log_softmax(logp, self.mask(s))

    @per_token
    def step(self, s: Any, tok: Any) -> Any:
        return self.t.table[s, tok] if self.t is not None else s

    @per_token
    def is_final(self, s: Any) -> jax.Array:
        return self.t.final[s] if self.t is not None else jnp.zeros(s.shape, bool)

    @per_token
    def num_emitted(self, s: Any) -> jax.Array:
        if self.t is None:
            raise MalformedSequenceError("counting observables needs a constraint automaton")
        return self.t.emitted[s]


# ---------------------------------------------------------------------------------------------- the loops
@checked_jax
def sample_token(key: Key, q: Array, done: Array) -> jax.Array:
    """One categorical draw per row from log-probabilities ``q [n, V]`` (``<pad>`` for finished rows)."""
    if q.ndim != 2 or done.shape != q.shape[:1]:
        raise MalformedSequenceError(f"sample_token takes q [n, V] and done [n], got shapes {tuple(q.shape)} and "
                                     f"{tuple(done.shape)}")
    safe = jnp.where(done[:, None], 0.0, q)
    return jnp.where(done, PAD_ID, jax.random.categorical(key, safe, -1)).astype(jnp.int32)


class TokenStep(NamedTuple):
    """What :func:`token_step` returns, every field per row (``[n]``; ``state`` a pytree with the rows on axis 0)."""

    #: int32: the drawn token (the given one when scoring); ``<pad>`` for inactive rows when drawing
    token: jax.Array
    #: the rule state after the token (inactive rows keep theirs)
    state: Any
    #: log Q(token | state) of Def 2.8 (0 for inactive rows; -inf outside the rule's support, never NaN)
    log_prob: jax.Array
    #: ``ends(token, state)``: the rows whose segment ends at this token (None without ``ends``)
    ends: jax.Array | None


def token_step(rule: SupportsTokenRule, logp: Array, s: Any, active: Array | None = None, key: Key | None = None, *,
               token: Array | None = None, log_probs: Array | None = None,
               ends: Callable[[Any, Any], Any] | None = None) -> TokenStep:
    """The one token step of the JAX backend (the twin of the torch ``token_step``): the masked law
    ``rule.log_probs`` = log softmax(f~(z_<i)) of Def 2.8 of the LM's next-token log-probabilities ``logp [n, V]``
    in rule state ``s``, one categorical draw per row from ``key`` (:func:`sample_token`; or, scoring, the given
    ``token [n]``), the draw's log-probability (the step's term of (2.13)), the rule's advance and the end flags.
    Every sampler and scorer of the backend steps through it (:func:`decode`, :func:`score`, the LMState sites).

    ``active`` bool ``[n]`` (None: all): inactive rows draw ``<pad>``, get log-probability 0 and keep their state.
    ``log_probs``: the masked law ``rule.log_probs(logp, s)`` when the caller has it already (``logp`` unread).
    ``ends(token, new_state)`` -> bool ``[n]``: where the segment ends. Pure and jit-friendly (no host sync).
    """
    q = rule.log_probs(logp, s) if log_probs is None else log_probs
    n = q.shape[0]
    on = jnp.ones(n, bool) if active is None else active
    if token is None:
        token = sample_token(key, q, ~on)
    tok = jnp.asarray(token, jnp.int32)
    lp = jnp.where(on, jnp.take_along_axis(q, jnp.clip(tok, 0, q.shape[-1] - 1)[:, None], -1)[:, 0], 0.0)
    s1 = rule.step(s, tok) if active is None else tree_where(on, rule.step(s, tok), s)
    return TokenStep(tok, s1, lp, None if ends is None else ends(tok, s1))


@checked_jax
def decode(key: Key, lm: LM, params: Any, rule: SupportsTokenRule, n: int, prompt: ArrayLike, max_len: int,
           stop_ids: ArrayLike, latents: Any = None) -> tuple[jax.Array, jax.Array]:
    """Sample ``n`` sequences in one batched, KV-cached loop under ``rule``: ``(z int32 [n, max_len], log Q [n])``.

    Every row draws from ``rule.log_probs`` until a stop token, a final state of the rule or ``max_len``;
    finished rows feed nothing (``valid=False``) and are padded with ``<pad>``. ``lax.scan`` over positions.
    """
    n, max_len = integer("n", n, minimum=0), integer("max_len", max_len, minimum=0)
    stops = jnp.asarray(prompt_ids(stop_ids, lm.vocab_size, "stop_ids"), jnp.int32)
    logp, cache = encode(lm, params, prompt, n, max_len, latents)
    s = rule.start(n)
    done = rule.is_final(s) | (max_len == 0)

    def ends(tok, s1):
        return jnp.isin(tok, stops) | rule.is_final(s1)

    def body(carry, k):
        logp, cache, s, done, lp = carry
        step = token_step(rule, logp, s, ~done, k, ends=ends)
        tok = step.token
        feed = jnp.where(done, BOS_ID, tok)
        nlogp, cache = lm.apply(params, cache, feed[:, None], valid=~done[:, None], latents=latents)
        return (nlogp[:, 0], cache, step.state, done | step.ends, lp + step.log_prob), tok

    init = (logp, cache, s, done, jnp.zeros(n, jnp.float32))
    (_, _, _, _, lp), toks = jax.lax.scan(body, init, jax.random.split(key, max_len))
    return toks.T.reshape(n, max_len), lp


@checked_jax
def decode_chunked(key: Key, lm: LM, params: Any, rule: Any, n: int, prompt: ArrayLike, max_len: int,
                   stop_ids: ArrayLike, chunk: int, latents: Any = None) -> tuple[jax.Array, jax.Array]:
    """Sample ``n`` sequences under ``rule`` with chunked encoding (end of Section 5.6.2): ``(z int32 [n, max_len],
    log Q [n])``, the law and log Q of :func:`decode` (to which rules not over an automaton and ``chunk = 0`` go).
    A token is *forced* where it is the only admissible one (Def 2.8's masked softmax gives it probability 1, or 0
    if the LM gives it no mass): each turn of a ``lax.while_loop`` (stopping once every row ended) draws one token
    and feeds it with the run of up to ``chunk`` forced tokens after it (``forced_runs``, the numpy tables both
    backends read) in one ``lm.apply`` of ``1 + chunk`` columns; a forced token adds 0 to log Q, or -inf where the
    LM gives it probability 0. Reverse mode differentiates log Q by one teacher-forced pass (``loop_grad``)."""
    n, max_len = integer("n", n, minimum=0), integer("max_len", max_len, minimum=0)
    C = integer("chunk", chunk, minimum=0)
    if C == 0 or type(rule) is not TokenRule or rule.t is None:
        return decode(key, lm, params, rule, n, prompt, max_len, stop_ids, latents)
    stops_np = prompt_ids(stop_ids, lm.vocab_size, "stop_ids")
    run_len, run_toks, run_states = (const(a, jnp.int32) for a in
                                     forced_runs(rule.constraint, None, tuple(int(t) for t in stops_np), C))
    stops = jnp.asarray(stops_np, jnp.int32)
    rows, cols = jnp.arange(n), jnp.arange(C)

    def ends(tok, s1):
        return jnp.isin(tok, stops) | rule.is_final(s1)

    def loop(params, key, prompt, latents):
        logp, cache = encode(lm, params, prompt, n, max_len, latents)
        s = rule.start(n)
        done = rule.is_final(s) | (max_len == 0)

        def body(c):
            i, key, logp, cache, s, done, pos, z, lq = c
            key, k = jax.random.split(key)
            step = token_step(rule, logp, s, ~done, k, ends=ends)  # the decision: draw, advance, ends (Def 2.8)
            tok, s1 = step.token, step.state
            pos1 = pos + (~done)
            fin = done | step.ends | (pos1 >= max_len)
            r = jnp.where(fin, 0, jnp.minimum(run_len[s1], max_len - pos1))  # the forced run after the token
            rt = run_toks[s1]  # [n, C]
            in_run = cols[None] < r[:, None]
            feed = jnp.concatenate([jnp.where(done, BOS_ID, tok)[:, None], jnp.where(in_run, rt, PAD_ID)], 1)
            valid = jnp.concatenate([~done[:, None], in_run], 1)
            out, cache = lm.apply(params, cache, feed, valid=valid, latents=latents)  # one pass: token and run
            forced = jnp.take_along_axis(out[:, :C], rt[..., None], -1)[..., 0]  # column j precedes run token j
            lq = lq + step.log_prob + jnp.where((in_run & jnp.isneginf(forced)).any(1), NEG_INF, 0.0)
            logp = jnp.where(done[:, None], logp, out[rows, r])
            z = z.at[rows, jnp.where(done, max_len, pos)].set(tok, mode="drop")
            z = z.at[rows[:, None], jnp.where(in_run, pos1[:, None] + cols[None], max_len)].set(rt, mode="drop")
            s2 = jnp.where(fin, s1, run_states[s1, r])
            pos2 = pos1 + r
            return i + 1, key, logp, cache, s2, fin | (pos2 >= max_len), pos2, z, lq

        init = (jnp.zeros((), jnp.int32), key, logp, cache, s, done, jnp.zeros(n, jnp.int32),
                jnp.full((n, max_len), PAD_ID, jnp.int32), jnp.zeros(n, jnp.float32))
        out = jax.lax.while_loop(lambda c: (c[0] < max_len) & ~c[5].all(), body, init)
        return out[8], out[7]

    def one_pass(params, key, prompt, latents, z):  # reverse mode: log Q of the draws by one teacher-forced pass
        return score(rule, teacher_forced(lm, params, prompt, z, latents), z, max_len, stops_np)[0].sum(-1)

    run = loop if n == 0 or max_len == 0 else (lambda *a: loop_with_one_pass_gradient(loop, one_pass, *a))
    lq, z = run(params, key, prompt_array(prompt, lm.vocab_size), latents)
    return z, lq


@checked_jax
def teacher_forced(lm: LM, params: Any, prompt: ArrayLike, z: Array, latents: Any = None) -> jax.Array:
    """The LM's next-token log-probabilities at each position of ``z [n, L]``: ``[n, L, V]`` (one pass; with
    per-row prompts ``[r, P]``, :func:`encode`'s rule, two: the prompts, then z)."""
    if z.ndim != 2 or not jnp.issubdtype(z.dtype, jnp.integer) or z.shape[0] == 0:
        raise MalformedSequenceError(f"teacher_forced takes integer token ids z [n >= 1, L], got {z.dtype} "
                                     f"{tuple(z.shape)}")
    n, L = z.shape
    p = prompt_array(prompt, lm.vocab_size)
    if p.ndim == 2:  # per-row prompts: each row's prompt encoded alone (encode), then z fed after it
        logp, cache = encode(lm, params, p, n, L, latents)
        if L == 1:
            return logp[:, None]
        out, _ = lm.apply(params, cache, z[:, : L - 1].astype(jnp.int32), latents=latents)
        return jnp.concatenate([logp[:, None], out], 1)
    ctx = jnp.concatenate([jnp.full((1,), BOS_ID, jnp.int32), jnp.asarray(p, jnp.int32)])
    inputs = jnp.concatenate([jnp.broadcast_to(ctx, (n, ctx.shape[0])),
                              z[:, : max(L - 1, 0)].astype(jnp.int32)], 1)
    cache = lm.init_cache(n, inputs.shape[1])
    logp, _ = lm.apply(params, cache, inputs, latents=latents)
    return logp[:, ctx.shape[0] - 1:]


@checked_jax
def score(rule: SupportsTokenRule, logp: Array, z: Array, max_len: int,
          stop_ids: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Per-token log Q ``[n, L]`` (0 on padding) and completeness ``[n]`` of right-padded ``z [n, L]`` given the
    LM's log-probabilities ``logp [n, L, V]`` at each position (the torch ``LMSequence._steps``)."""
    if z.ndim != 2 or logp.ndim != 3 or logp.shape[:2] != z.shape or not jnp.issubdtype(z.dtype, jnp.integer):
        raise MalformedSequenceError(f"score takes integer ids z [n, L] and logp [n, L, V], got z {z.dtype} "
                                     f"{tuple(z.shape)} and logp {tuple(logp.shape)}")
    max_len = integer("max_len", max_len, minimum=0)
    n, L = z.shape
    lengths = (z != PAD_ID).sum(-1)
    stops = jnp.asarray(prompt_ids(stop_ids, logp.shape[-1], "stop_ids"), jnp.int32)
    s0 = rule.start(n)

    def body(s, inp):
        lp_i, tok = inp
        step = token_step(rule, lp_i, s, tok != PAD_ID, token=tok, ends=lambda _, s1: rule.is_final(s1))
        return step.state, (step.log_prob, step.ends)

    _, (steps, fin) = jax.lax.scan(body, s0, (jnp.swapaxes(logp, 0, 1), z.T))
    steps, fin = steps.T, fin.T
    pos = jnp.arange(L)
    inside = pos[None] < lengths[:, None]
    steps = jnp.where(inside, steps, 0.0)
    ends = (jnp.isin(z, stops) | fin) & inside
    any_end = ends.any(-1)
    first_end = jnp.where(any_end, jnp.argmax(ends, -1), L)
    start_final = rule.is_final(s0)
    complete = jnp.where(start_final, lengths == 0,
                         jnp.where(any_end, first_end == lengths - 1, lengths == max_len))
    return steps, complete


# ---------------------------------------------------------------------------------------------- LMSequence
@checked_jax
class LMSequence(Distribution):
    """A distribution over right-padded token arrays ``[*batch, max_len]``: ``lm`` decoded under a constraint
    automaton (Def 2.8), the NumPyro twin of ``ppl_thought.distributions.LMSequence`` (same semantics).

    Args:
        lm: a JAX LM (:class:`~ppl_thought.numpyro.lm.base.LM`).
        prompt: ids (or text with ``vocab``) after ``<bos>``: 1-D, shared by every row, or ``[B, P]`` right-padded
            with ``<pad>``, one prompt per row of the batch (the batch shape becomes ``B``, broadcast with
            ``batch_shape``); a sample of shape ``[S, B]`` gives row ``(s, b)`` prompt ``b`` (the torch rule).
            Each row's numbers equal a run with its prompt alone (:func:`encode`).
        constraint: an :class:`~ppl_thought.projections.Automaton`; inadmissible logits are ``-inf`` before the
            softmax and reaching a final state ends the sequence. One built by ``token_automaton`` for another
            tokenizer's texts than ``vocab`` (or ``lm.vocab``) is a :class:`~ppl_thought.errors.TokenizerMismatchError`.
        stop: token(s) that end a sequence (included in it).
        max_len: the event length (default ``constraint.max_len``); a sequence that reaches it without a stop
            is a complete outcome.
        params: the LM's parameters (default ``lm.params``; a guide passes its ``numpyro.param`` values).
        rule: a token rule replacing the masked softmax (the guides' samplers); default ``TokenRule(constraint)``.
        latents: cross-attention inputs for ``lm.apply``.
        chunk: chunked encoding (end of Section 5.6.2) when sampling: a drawn token and the run of up to ``chunk``
            forced tokens after it (the one token the constraint admits) are fed in one pass
            (:func:`decode_chunked`); the same law and log-probabilities as ``0``.

    ``sample`` runs :func:`decode` (all rows in one ``lax.scan``; the log-probabilities come back as NumPyro
    intermediates, so a traced site is not scored twice); ``log_prob`` one teacher-forced pass. Both jit.
    ``log_prob`` is ``-inf`` (never NaN) for sequences outside the constraint, incomplete ones and ones
    continuing past their end; malformed concrete input raises an error naming the problem.
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)

    def __init__(self, lm: LM, prompt: ArrayLike | str | None = None, constraint: Automaton | None = None,
                 stop: str | int | Sequence[str | int] | None = None, max_len: int | None = None,
                 vocab: Vocab | None = None, batch_shape: tuple[int, ...] = (), *, params: Any = None,
                 rule: SupportsTokenRule | None = None, latents: Any = None, chunk: int = 0,
                 validate_args: bool | None = None):
        self.lm = lm
        self.vocab = vocab
        self.vocab_size = int(lm.vocab_size)
        if vocab is not None and len(vocab) != self.vocab_size:
            raise ConfigError(f"vocab has {len(vocab)} tokens but the LM has vocab_size {self.vocab_size}")
        if isinstance(prompt, str):
            if vocab is None:
                raise ConfigError("prompt is given as text; pass vocab= to LMSequence")
            prompt = vocab.encode(prompt)
        p = prompt_array(prompt, self.vocab_size)
        if not isinstance(p, jax.core.Tracer) and p.shape[-1]:  # right padding (<pad> in every row): dropped
            real = (np.asarray(p) != PAD_ID).reshape(-1, p.shape[-1]).any(0)
            p = p[..., : np.flatnonzero(real)[-1] + 1] if real.any() else p[..., :0]
        if p.ndim == 2:
            batch_shape = tuple(np.broadcast_shapes(tuple(batch_shape), p.shape[:1]))
        self.prompt = p
        if constraint is not None and constraint.vocab_size != self.vocab_size:
            raise ConfigError(f"constraint automaton has {constraint.vocab_size} token columns, "
                              f"LM has {self.vocab_size}")
        for owner, where in ((lm, "ptn.dist.LMSequence"), (self, "ptn.dist.LMSequence (its vocab=)")):
            check_tokenizer(constraint, owner, where)  # lm.vocab / vocab=: an automaton of other texts is refused
        self.constraint = constraint
        self.stop_ids = self._stop_ids(stop)
        if max_len is None:
            if constraint is None or constraint.max_len is None:
                raise ConfigError("LMSequence needs max_len (the constraint does not bound the length)")
            max_len = constraint.max_len
        self.max_len = integer("max_len", max_len, minimum=0)
        self.params = lm.params if params is None else params
        self.rule = rule if rule is not None else TokenRule(constraint, self.vocab_size)
        self.latents = latents
        self.chunk = integer("chunk", chunk, minimum=0)
        super().__init__(tuple(batch_shape), (self.max_len,), validate_args=validate_args)

    def _stop_ids(self, stop) -> np.ndarray:
        if stop is None:
            return np.zeros(0, np.int64)
        items = list(stop) if isinstance(stop, (list, tuple, np.ndarray)) else [stop]
        out = []
        for s in items:
            if isinstance(s, str):
                if self.vocab is None:
                    raise ConfigError(f"stop token {s!r} given as text; pass vocab= to LMSequence")
                out.append(self.vocab.id(s))
            else:
                out.append(integer("a stop token id", int(s), minimum=0))
        a = np.asarray(out, np.int64)
        if a.size and a.max() >= self.vocab_size:
            raise UnknownTokenError(f"stop tokens {a.tolist()} outside the vocabulary [0, {self.vocab_size})")
        return a

    def _prompt_rows(self, n: int) -> np.ndarray | jax.Array:
        """The prompt for ``n`` rows (a sample of ``n / B`` times the batch, flattened): a shared 1-D prompt as it
        is; per-row prompts ``[B, P]`` broadcast to the batch and tiled, row i getting prompt ``i % B`` (torch's
        ``LMSequence._prompt_rows``), as ``[n, P]``."""
        p = self.prompt
        if p.ndim < 2:
            return p
        B = int(np.prod(self.batch_shape)) if self.batch_shape else 1
        if B == 0 or n % B:
            raise MalformedSequenceError(f"{B} prompts for {n} rows")
        rows = jnp.broadcast_to(jnp.asarray(p), tuple(self.batch_shape) + p.shape[-1:]).reshape(B, p.shape[-1])
        return jnp.tile(rows, (n // B, 1))

    @per_token
    def expand(self, batch_shape: Any) -> LMSequence:
        new = object.__new__(LMSequence)
        new.__dict__.update(self.__dict__)
        Distribution.__init__(new, tuple(batch_shape), self.event_shape, validate_args=False)
        return new

    # ------------------------------------------------------------------ Distribution API
    @per_token
    def sample_with_log_prob(self, key: jax.Array, sample_shape: tuple = ()) -> tuple[jax.Array, jax.Array]:
        """Draws ``[*sample_shape, *batch, max_len]`` and their log-probabilities, in one decoding loop."""
        shape = tuple(sample_shape) + tuple(self.batch_shape)
        n = int(np.prod(shape)) if shape else 1
        if self.chunk:
            z, lp = decode_chunked(key, self.lm, self.params, self.rule, n, self._prompt_rows(n), self.max_len,
                                   self.stop_ids, self.chunk, self.latents)
        else:
            z, lp = decode(key, self.lm, self.params, self.rule, n, self._prompt_rows(n), self.max_len, self.stop_ids,
                           self.latents)
        return z.reshape(shape + (self.max_len,)), lp.reshape(shape)

    @per_token
    def sample(self, key: Key, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        return self.sample_with_log_prob(key, sample_shape)[0]

    @per_token
    def sample_with_intermediates(self, key: Key, sample_shape: tuple[int, ...] = ()) -> tuple[jax.Array, list]:
        z, lp = self.sample_with_log_prob(key, sample_shape)
        return z, [lp]

    @per_token
    def step_log_probs(self, value: Any) -> tuple[jax.Array, jax.Array]:
        """Per-token masked log-probabilities ``[..., L]`` (0 on padding) and completeness ``[...]``: the prefix
        sums are log P(z_{<=k}) (Def 2.8). One teacher-forced pass."""
        v = check_ids(value, self.vocab_size, self.max_len)
        v = jnp.asarray(v, jnp.int32)
        if self.prompt.ndim == 2:  # one prompt per row: the value broadcast over the prompts' batch
            v = jnp.broadcast_to(v, tuple(np.broadcast_shapes(v.shape[:-1], self.prompt.shape[:1])) + v.shape[-1:])
        batch = v.shape[:-1]
        flat = v.reshape((-1, v.shape[-1]))
        if flat.shape[0] == 0 or flat.shape[1] == 0:
            steps, complete = score(self.rule, jnp.zeros(flat.shape + (self.vocab_size,)), flat, self.max_len,
                                    self.stop_ids)
        else:
            logp = teacher_forced(self.lm, self.params, self._prompt_rows(flat.shape[0]), flat, self.latents)
            steps, complete = score(self.rule, logp, flat, self.max_len, self.stop_ids)
        return steps.reshape(batch + (flat.shape[1],)), complete.reshape(batch)

    @per_token
    def log_prob(self, value: Any, intermediates: Any = None) -> jax.Array:
        """log P(value): the masked step log-probabilities summed (Def 2.8, (2.13)); ``-inf`` if incomplete."""
        if intermediates:
            return intermediates[0]
        steps, complete = self.step_log_probs(value)
        return jnp.where(complete, steps.sum(-1), NEG_INF)

    def __repr__(self) -> str:
        c = self.constraint.name if self.constraint is not None else None
        return (f"LMSequence(lm={type(self.lm).__name__}, prompt_len={self.prompt.shape[-1]}, constraint={c}, "
                f"stop={self.stop_ids.tolist()}, max_len={self.max_len}, batch_shape={tuple(self.batch_shape)}"
                + (f", chunk={self.chunk})" if self.chunk else ")"))


# ---------------------------------------------------------------------------------------------- ProjectionDelta
@checked_jax
class ProjectionDelta(Distribution):
    """x = Proj^{<w}(z) restricted to |x| = n (the observed site of Proj # P_f): ``log_prob(x)`` is 0 if z lies in
    the lifting of x (Prop 2.3), else -inf, checked by running the lifting automaton over every row of z.

    The observation must be concrete (the lifting automaton is a numpy table built from it); z may be traced.
    ``sample`` projects z with the domain automaton's emitted counts (concrete z only).
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)

    def __init__(self, projection: Projection, z: ArrayLike, num_observed: int, validate_args: bool | None = None):
        self.projection = projection
        self.z = z if isinstance(z, jax.core.Tracer) else as_array("z", z, where="ProjectionDelta")
        if jnp.ndim(self.z) < 1:
            raise MalformedSequenceError(f"ProjectionDelta takes latent ids z [..., L], got shape {jnp.shape(z)}")
        self.num_observed = integer("num_observed", num_observed, minimum=0)
        super().__init__(tuple(jnp.shape(z)[:-1]), (self.num_observed,), validate_args=validate_args)

    @per_token
    def expand(self, batch_shape: Any) -> ProjectionDelta:
        z = jnp.broadcast_to(self.z, tuple(batch_shape) + jnp.shape(self.z)[-1:])
        return ProjectionDelta(self.projection, z, self.num_observed)

    @per_token
    def sample(self, key: Key, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        if isinstance(self.z, jax.core.Tracer):
            raise ConfigError("ProjectionDelta.sample projects concrete latent sequences (outside jit)")
        flat = np.asarray(self.z).reshape(-1, np.shape(self.z)[-1])
        out = np.full((flat.shape[0], self.num_observed), PAD_ID, np.int32)
        for i, row in enumerate(self.projection.project(flat) if flat.shape[0] else []):
            row = np.asarray(row)[: self.num_observed]
            out[i, : len(row)] = row
        out = jnp.asarray(out.reshape(tuple(self.batch_shape) + (self.num_observed,)))
        return jnp.broadcast_to(out, tuple(sample_shape) + out.shape)

    @per_token
    def log_prob(self, value: Any, intermediates: Any = None) -> jax.Array:
        if isinstance(value, jax.core.Tracer):
            raise ConfigError("ProjectionDelta needs the observation x as a concrete array (its lifting automaton "
                              "is built from it): close over x instead of passing it through jit")
        x = np.asarray(value)
        if x.shape[-1:] != (self.num_observed,):
            raise MalformedSequenceError(f"observed x has shape {x.shape}, the model was built for "
                                         f"{self.num_observed} tokens")
        rows = x.reshape(-1, self.num_observed)
        shape = jnp.broadcast_shapes(x.shape[:-1], tuple(self.batch_shape))
        if rows.shape[0] and not (rows == rows[:1]).all():
            raise MalformedSequenceError("ProjectionDelta scores one observation x shared by every row")
        try:
            lift = tables(self.projection.lifting(rows[0] if rows.shape[0] else x.reshape(-1)))
        except NotInImageError:
            return jnp.full(shape, NEG_INF)
        z = jnp.asarray(self.z, jnp.int32)

        def body(s, tok):
            return lift.advance(s, tok), None

        s, _ = jax.lax.scan(body, jnp.full(z.shape[:-1], lift.start, jnp.int32), jnp.moveaxis(z, -1, 0))
        return jnp.broadcast_to(jnp.where(lift.final[s], 0.0, NEG_INF), shape)
