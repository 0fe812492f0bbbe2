"""``ptn.transforms.ActiveLift``: active lifting (Section 6) as a NumPyro handler (torch twin:
ppl_thought/transforms/active.py, whose module docstring describes the three formats of Section 6.6).

One LM (or three) plays the sampler Q (``<bos> x <s> z``, (6.1)), the latent prior P (``<bos> <s> z``) and the
generator G (``<bos> z </s> x``, (6.13)). Applied to a program with an observed sequence site ``"x"`` the handler
draws ``"z"`` from P and makes ``"x"`` a draw of G(. | z): the lifted model X ~ G(. | Z), Z ~ P of (6.13), with
:meth:`ActiveLift.guide` = Q. On the JAX side a prompt is shared by every row, so x is one sequence (1-D); z may be
traced (the generator reads it as a per-row context, :class:`GeneratorSequence`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.distributions import Distribution, constraints
from numpyro.primitives import Messenger

from ppl_thought.checks import integer, latent_token_ids
from ppl_thought.errors import ActiveLiftError, MalformedSequenceError
from ppl_thought.numpyro.boundary import ArrayLike, Key, as_numpy, checked_jax
from ppl_thought.numpyro.distributions import NEG_INF, LMSequence, TokenRule, score, token_step
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.numpyro.transforms.base import _RunCheck
from ppl_thought.projections.automaton import AutomatonBuilder
from ppl_thought.validation import per_token
from ppl_thought.vocab import BOS_ID, END_THINK_ID, EOS_ID, PAD_ID, THINK_ID, Vocab

__all__ = ["ActiveLift", "GeneratorSequence"]


def _alphabet_automaton(vocab_size: int, ids: np.ndarray, name: str):
    b = AutomatonBuilder(vocab_size, name)
    s = b.add_state()
    b.edge(s, ids, s)
    return b.build()


@checked_jax
class GeneratorSequence(Distribution):
    """G(. | z) of (6.13): ``lm`` after ``<bos> z </s>`` (z ``[*batch, T]``, may be traced: one context per row),
    decoding x over the rule's alphabet until ``<eos>`` or ``max_len``. ``log_prob`` is one teacher-forced pass
    (``-inf`` for an incomplete x, never NaN); ``sample`` one ``lax.scan`` over positions."""

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)

    def __init__(self, lm: LM, z: Any, rule: TokenRule, max_len: int, params: Any = None,
                 validate_args: bool | None = None):
        self.lm, self.rule, self.max_len = lm, rule, integer("max_len", max_len, minimum=1)
        self.z = jnp.asarray(z, jnp.int32)
        self.params = lm.params if params is None else params
        super().__init__(tuple(self.z.shape[:-1]), (self.max_len,), validate_args=validate_args)

    def _context(self) -> jax.Array:
        zf = self.z.reshape((int(np.prod(self.z.shape[:-1])), self.z.shape[-1]))  # (-1, 0) is ambiguous for t = 0
        n = zf.shape[0]
        return jnp.concatenate([jnp.full((n, 1), BOS_ID, jnp.int32), zf, jnp.full((n, 1), END_THINK_ID, jnp.int32)], 1)

    @per_token
    def step_log_probs(self, value: Any) -> tuple[jax.Array, jax.Array]:
        """Per-token masked log-probabilities of x ``[n, L]`` (0 on padding) and completeness ``[n]`` (rows of the
        flattened batch): one teacher-forced pass over ``<bos> z </s> x``."""
        ctx = self._context()
        n, c = ctx.shape
        x = jnp.broadcast_to(jnp.asarray(value, jnp.int32), self.batch_shape + (jnp.shape(value)[-1],))
        x = x.reshape((-1, x.shape[-1]))
        x = jnp.broadcast_to(x, (n, x.shape[-1]))
        L = x.shape[1]
        inputs = jnp.concatenate([ctx, x[:, : max(L - 1, 0)]], 1)
        logp, _ = self.lm.apply(self.params, self.lm.init_cache(n, inputs.shape[1]), inputs)
        return score(self.rule, logp[:, c - 1:], x, self.max_len, np.array([EOS_ID]))

    @per_token
    def log_prob(self, value: Any, intermediates: Any = None) -> jax.Array:
        """log G(x | z) (6.13): the masked step log-probabilities of x summed; ``-inf`` if x is incomplete."""
        steps, complete = self.step_log_probs(value)
        return jnp.where(complete, steps.sum(-1), NEG_INF).reshape(self.batch_shape)

    @per_token
    def sample(self, key: Key, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        if sample_shape:
            raise MalformedSequenceError("GeneratorSequence draws one x per z (sample_shape must be ())")
        ctx = self._context()
        n, c = ctx.shape
        logp, cache = self.lm.apply(self.params, self.lm.init_cache(n, c + self.max_len), ctx)
        s = self.rule.start(n)

        def body(carry, k):
            logp, cache, s, done = carry
            step = token_step(self.rule, logp, s, ~done, k, ends=lambda tok, s1: tok == EOS_ID)
            nlogp, cache = self.lm.apply(self.params, cache, jnp.where(done, BOS_ID, step.token)[:, None],
                                         valid=~done[:, None])
            return (nlogp[:, 0], cache, step.state, done | step.ends), step.token

        _, toks = jax.lax.scan(body, (logp[:, -1], cache, s, jnp.zeros(n, bool)), jax.random.split(key, self.max_len))
        return toks.T.reshape(self.batch_shape + (self.max_len,))


@checked_jax
class ActiveLift(_RunCheck, Messenger):
    """Active lifting (Section 6): the sampler Q, the latent prior P and the generator G of one LM (6.6), with the
    torch constructor arguments (``lm, vocab, latent_len, latent_tokens, max_x_len, prior_lm, generator_lm, site,
    latent_site``). ``ActiveLift(...)(program)`` makes the program's site ``site`` the lifted model X ~ G(. | Z),
    Z ~ P of (6.13); ``lift.guide`` samples Z ~ Q^{<=T}(. | x) (6.1). A run without the site is an
    :class:`~ppl_thought.errors.ActiveLiftError` naming it and the run's sequence sites."""

    def __init__(self, lm: LM, vocab: Vocab, latent_len: int, latent_tokens: Sequence[str | int] | None = None,
                 max_x_len: int = 16, *, prior_lm: LM | None = None, generator_lm: LM | None = None,
                 site: str = "x", latent_site: str = "z", fn: Callable[..., Any] | None = None):
        super().__init__(fn)
        self.lm, self.vocab = lm, vocab
        self.prior_lm = prior_lm if prior_lm is not None else lm
        self.generator_lm = generator_lm if generator_lm is not None else lm
        for role, m in (("lm", self.lm), ("prior_lm", self.prior_lm), ("generator_lm", self.generator_lm)):
            if int(m.vocab_size) != len(vocab):
                raise ActiveLiftError(f"{role} has vocab_size {m.vocab_size}, the vocabulary {len(vocab)} tokens")
        self.latent_len = integer("latent_len", latent_len, minimum=1)
        self.max_x_len = integer("max_x_len", max_x_len, minimum=1)
        omega = latent_token_ids(vocab, latent_tokens)  # Omega, Section 6.1
        self.site, self.latent_site = site, latent_site
        V = len(vocab)
        self.omega_ids = np.array(sorted(set(omega)), np.int64)
        self._omega_auto = _alphabet_automaton(V, self.omega_ids, "Omega^T")
        self._sigma_auto = _alphabet_automaton(V, np.asarray(vocab.observable_ids), "Sigma*")
        self._sigma_rule = TokenRule(self._sigma_auto, V)
        self._met, self._seen, self._runs = False, [], 0

    needs = "the observed token-sequence site"

    def check_met(self) -> None:
        if not self._met:
            seen = ", ".join(repr(s) for s in self._seen) or "none"
            raise ActiveLiftError(f"ActiveLift cannot act on this model: it needs the observed token-sequence site "
                                  f"{self.site!r} (numpyro.sample({self.site!r}, ptn.dist.LMSequence(lm, ...), obs=x));"
                                  f" the model's run met none (its sequence sites: {seen}); name it with site=")

    # ------------------------------------------------------------------ the three parts
    def _x(self, x: ArrayLike) -> np.ndarray:
        a = as_numpy("x", self.vocab.encode(x) if isinstance(x, str) else x, where="ActiveLift")
        if a.ndim != 1:
            raise MalformedSequenceError(f"x must be one sequence of ids (1-D) on the JAX side, got shape {a.shape}")
        self.vocab.check_ids(a, "x")
        return a[a != PAD_ID].astype(np.int64)

    def _rows(self, x: ArrayLike) -> np.ndarray | jax.Array:
        """x as right-padded rows ``[B, L]``: a 2-D array (one x per row), or a traced 1-D / 2-D x (its values
        unread: the engines' compiled runs); checked when concrete."""
        if isinstance(x, jax.core.Tracer):
            if x.ndim not in (1, 2):
                raise MalformedSequenceError(f"x must be 1-D or [B, L] ids, got shape {tuple(x.shape)}")
            return (x[None] if x.ndim == 1 else x).astype(jnp.int32)
        a = as_numpy("x", x, where="ActiveLift")
        if a.ndim != 2:
            raise MalformedSequenceError(f"x must be [B, L] right-padded ids here, got shape {a.shape}")
        self.vocab.check_ids(a, "x")
        real = a != PAD_ID
        if a.shape[1] and (real[:, 1:] & ~real[:, :-1]).any():
            raise MalformedSequenceError("padding inside x: <pad> must only fill the end of a row")
        return a.astype(np.int64)

    def _per_row(self, x: ArrayLike) -> bool:
        return isinstance(x, jax.core.Tracer) or (not isinstance(x, str) and np.ndim(x) == 2)

    def sampler(self, x: ArrayLike) -> LMSequence:
        """Q^{<=T}(. | x) (6.1): the LM after ``x <s>``, masked to Omega. A 1-D x (or text) gives batch shape
        ``()``; per-row x ``[B, L]`` right-padded with ``<pad>`` gives batch ``[B]``, row b the LM after
        ``x_b <s>`` (per-row prompts: each row equals the 1-D sampler of its x, :func:`~ppl_thought.numpyro.
        distributions.encode`); a traced x is read as per-row rows ``[1, L]``."""
        if not self._per_row(x):
            return LMSequence(self.lm, prompt=np.concatenate([self._x(x), [THINK_ID]]), constraint=self._omega_auto,
                              max_len=self.latent_len)
        rows = self._rows(x)
        xp = jnp if isinstance(rows, jax.Array) else np
        B = rows.shape[0]
        padded = xp.concatenate([rows, xp.full((B, 1), PAD_ID, rows.dtype)], 1)
        length = (rows != PAD_ID).sum(1)
        think = xp.arange(rows.shape[1] + 1)[None] == length[:, None]  # <s> right after each row's last token
        prompt = xp.where(think, THINK_ID, padded)
        return LMSequence(self.lm, prompt=prompt, constraint=self._omega_auto, max_len=self.latent_len)

    def prior(self) -> LMSequence:
        """P^{<=T} (6.6): the LM after ``<s>`` alone (Q with x = emptyset), masked to Omega."""
        return LMSequence(self.prior_lm, prompt=np.array([THINK_ID]), constraint=self._omega_auto,
                          max_len=self.latent_len)

    def generator(self, z: Any) -> GeneratorSequence:
        """G(. | z) (6.13): the LM after ``z </s>``, decoding x over Sigma until ``<eos>`` (or ``max_x_len``)."""
        return GeneratorSequence(self.generator_lm, z, self._sigma_rule, self.max_x_len)

    def guide(self, x: ArrayLike, *args: Any, **kwargs: Any) -> Any:
        """The sampler Q as a NumPyro guide: samples the site ``latent_site`` from Q^{<=T}(. | x)."""
        return numpyro.sample(self.latent_site, self.sampler(x))

    def model(self, x: ArrayLike | None, *args: Any, **kwargs: Any) -> Any:
        """The lifted model (6.13) on its own: Z ~ P, X ~ G(. | Z) observed at ``x`` (None: generated)."""
        z = numpyro.sample(self.latent_site, self.prior())
        return numpyro.sample(self.site, self.generator(z), obs=None if x is None else self._x(x))

    # ------------------------------------------------------------------ prefix quantities (one pass each)
    def _z(self, z: Any) -> jax.Array:
        z = jnp.asarray(z, jnp.int32)
        z = z[None] if z.ndim == 1 else z
        if z.ndim != 2 or z.shape[-1] != self.latent_len:
            raise MalformedSequenceError(f"z must be [B, T] with T = latent_len = {self.latent_len}, got shape "
                                         f"{tuple(z.shape)}")
        return z

    def sampler_log_probs(self, z: ArrayLike, x: ArrayLike) -> jax.Array:
        """``[B, T]``: log Q(z_t | x, z_<t) of (6.1), one teacher-forced pass over ``<bos> x <s> z``. ``x``: one
        sequence shared by the B latents, or per-row ``[B, L]`` right-padded (or ``[1, L]``)."""
        zi = self._z(z)
        steps = self.sampler(x).step_log_probs(zi)[0]
        return steps.reshape((-1, zi.shape[-1])) if steps.ndim > 2 else steps

    def prior_log_probs(self, z: ArrayLike) -> jax.Array:
        """``[B, T]``: log P(z_t | z_<t), one pass over ``<bos> <s> z``."""
        return self.prior().step_log_probs(self._z(z))[0]

    def generator_log_probs(self, x: ArrayLike, z: ArrayLike) -> jax.Array:
        """``[B, T + 1]``: log G^{<=t}(x | z_<=t) for t = 0..T (column t reads the first t latent tokens): the
        teacher-forced sum of log G over the tokens of x, log G([x] | z_<=t) of (6.21). ``x``: one sequence, or
        per-row ``[B, L]`` right-padded (or ``[1, L]``)."""
        zi = self._z(z)
        xa = self._rows(x) if self._per_row(x) else self._x(x)
        if not isinstance(xa, jax.core.Tracer):
            if int((np.asarray(xa) != PAD_ID).sum(-1).max(initial=0)) > self.max_x_len:
                raise MalformedSequenceError(f"x is longer than max_x_len = {self.max_x_len}")
            if xa.ndim == 2 and xa.shape[0] not in (1, zi.shape[0]):
                raise MalformedSequenceError(f"{xa.shape[0]} rows of x for {zi.shape[0]} latent sequences")
        cols = [GeneratorSequence(self.generator_lm, zi[:, :t], self._sigma_rule, self.max_x_len)
                .step_log_probs(xa)[0].sum(-1) for t in range(self.latent_len + 1)]  # T + 1 prefixes, not particles
        return jnp.stack(cols, 1)

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample":
            return
        self._record(msg)
        if msg["name"] != self.site or isinstance(msg["fn"], GeneratorSequence):
            return
        if not isinstance(msg["fn"], LMSequence):
            raise ActiveLiftError(f"ActiveLift cannot act on site {self.site!r}: it is a {type(msg['fn']).__name__}, "
                                  f"and active lifting needs a token-sequence site (numpyro.sample({self.site!r}, "
                                  "ptn.dist.LMSequence(lm, ...), obs=x)) to make X ~ G(. | Z)")
        self._acted()
        z = numpyro.sample(self.latent_site, self.prior())
        msg["fn"] = self.generator(z)
        if msg["is_observed"]:
            msg["value"] = self._x(msg["value"])

    def __repr__(self) -> str:
        return (f"ActiveLift(T={self.latent_len}, |Omega|={len(self.omega_ids)}, max_x_len={self.max_x_len}, "
                f"site={self.site!r}, latent_site={self.latent_site!r})")
