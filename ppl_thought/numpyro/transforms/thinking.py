"""How thoughts stay in context on the JAX side (torch twin: ppl_thought/transforms/thinking.py): :class:`Forgetful`
(Def 5.1, (5.5)-(5.8)), :class:`ForgetfulLM`, :class:`Persistent` and :class:`Ubiquitous` (Section 5.6.1)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.errors import TransformError
from ppl_thought.numpyro.boundary import Array, checked_jax
from ppl_thought.numpyro.distributions import LMSequence
from ppl_thought.numpyro.handlers import ProjectionLift
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.numpyro.transforms.base import Transform, _mark, _rebuild, _RunCheck
from ppl_thought.projections.pause import PauseToThink
from ppl_thought.validation import per_token
from ppl_thought.vocab import END_THINK_ID, EXPLAIN_ID, PAD_ID, THINK_ID, Vocab

__all__ = ["Forgetful", "ForgetfulLM", "Persistent", "Ubiquitous", "forgetful_keep"]


# ---------------------------------------------------------------------------------------------- Forgetful
@checked_jax
def forgetful_keep(tokens: Array, upto: Array) -> jax.Array:
    """``[B, T, M]``: which tokens of ``tokens [B, M]`` the LM reads after position ``upto [B, T]`` under Def 5.1:
    the positions ``<= upto`` that are observable or belong to the thought opened by the last ``<s>`` at or before
    ``upto`` (every earlier thought block ``<s> ... </s>`` deleted), never ``<pad>``. The torch ``_keep``."""
    tokens, upto = jnp.asarray(tokens), jnp.asarray(upto)
    s, e = tokens == THINK_ID, tokens == END_THINK_ID
    cs, ce = jnp.cumsum(s, 1), jnp.cumsum(e, 1)
    inside = (cs - ce + e) > 0  # a token of a thought block, delimiters included
    j = jnp.take_along_axis(cs, upto, 1)  # [B, T]: the segment of position upto (its number of <s>)
    start = (cs[:, None, :] < j[:, :, None]).sum(-1)  # the position of the j-th <s> (0 for j = 0)
    m = jnp.arange(tokens.shape[1])
    keep = (m[None, None, :] >= start[:, :, None]) | ~inside[:, None, :]
    return keep & (m[None, None, :] <= upto[:, :, None]) & (tokens != PAD_ID)[:, None, :]


@checked_jax
class ForgetfulLM(LM):
    """A JAX LM read through the forgetful context of Def 5.1 (torch twin: ``pt.transforms.ForgetfulLM``): the
    log-probabilities after position m are the wrapped LM's after the tokens up to m with every thought before
    the last ``<s>`` (at or before m) deleted, encoded from scratch (positions renumbered, as DeepSeek-R1 does).

    Its cache keeps the tokens fed so far (``{"tokens": [B, M], "length": [B]}``); ``apply`` runs the wrapped LM
    once on ``[B * T, M]`` packed contexts (one per new token), so it jits and vmaps like any LM.
    """

    def __init__(self, lm: LM):
        if isinstance(lm, ForgetfulLM):
            lm = lm.lm
        self.lm = lm
        self.vocab_size = int(lm.vocab_size)

    @property
    def params(self) -> Any:
        return self.lm.params

    @per_token
    def init_cache(self, batch: int, max_len: int) -> dict:
        return {"tokens": jnp.full((int(batch), int(max_len)), PAD_ID, jnp.int32),
                "length": jnp.zeros(int(batch), jnp.int32)}

    @per_token
    def apply(self, params: Any, cache: Any, tokens: Any, valid: Any = None,
              latents: Any = None) -> tuple[jax.Array, Any]:
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape
        valid = jnp.ones((B, T), bool) if valid is None else jnp.asarray(valid, bool)
        hist, length = cache["tokens"], cache["length"]
        M = hist.shape[1]
        pos = length[:, None] + jnp.cumsum(valid, 1) - 1  # where each valid token goes (an invalid one: the last)
        rows = jnp.arange(B)[:, None]
        hist = hist.at[rows, jnp.where(valid, pos, M)].set(tokens, mode="drop")
        upto = jnp.clip(pos, 0, M - 1)
        keep = forgetful_keep(hist, upto)  # [B, T, M]
        count = keep.sum(-1)
        order = jnp.argsort(~keep, axis=-1, stable=True)  # the kept positions first, in order
        packed = jnp.take_along_axis(jnp.broadcast_to(hist[:, None, :], keep.shape), order, -1)
        inner_valid = jnp.arange(M)[None, None, :] < count[..., None]
        packed = jnp.where(inner_valid, packed, PAD_ID).reshape(B * T, M)
        lat = None if latents is None else jnp.repeat(jnp.asarray(latents), T, 0)
        logp, _ = self.lm.apply(params, self.lm.init_cache(B * T, M), packed, valid=inner_valid.reshape(B * T, M),
                                latents=lat)
        last = jnp.maximum(count.reshape(B * T) - 1, 0)
        out = logp[jnp.arange(B * T), last].reshape(B, T, -1)
        return out, {"tokens": hist, "length": length + valid.sum(1)}

    def __repr__(self) -> str:
        return f"ForgetfulLM({self.lm!r})"


@checked_jax
class Forgetful(Transform):
    """Def 5.1 / (5.5): every sequence site's LM reads the forgetful context (:class:`ForgetfulLM`), so when a
    later segment is encoded the earlier thoughts are gone:

        P^{<=|z|+|y x|}(y^(T+1) x^(T+1) | z) = P(y^(T+1) x^(T+1) | Proj^{<w}(z))          (5.5)

    With the query/response projection the likelihood of a conversation is then the product over rounds of (5.8).
    Acts on every ``LMSequence`` site (whole view) and every :func:`~ppl_thought.numpyro.transforms.sequence_start`
    of a ``ptn.Program`` (step view: the state is built on the forgetful reading of the site's LM); the order with
    :class:`ProjectionLift` does not matter.
    """

    def __init__(self, fn: Callable[..., Any] | None = None) -> None:
        super().__init__(fn)
        self._wrapped: dict[int, ForgetfulLM] = {}

    def wrap(self, lm: LM) -> ForgetfulLM:
        """The forgetful reading of ``lm`` (one wrapper per LM, so compiled code sees the same object)."""
        if isinstance(lm, ForgetfulLM):
            return lm
        if id(lm) not in self._wrapped:
            self._wrapped[id(lm)] = ForgetfulLM(lm)
        return self._wrapped[id(lm)]

    def act(self, msg: dict) -> None:
        fn = msg["fn"]
        if isinstance(fn, LMSequence):
            self._acted()
            _mark(msg, "forgetful", msg["name"])
            if not isinstance(fn.lm, ForgetfulLM):
                msg["fn"] = _rebuild(fn, self.wrap(fn.lm))

    def act_start(self, msg: dict) -> None:
        dist = msg["args"][0]
        self._acted()
        _mark(msg, "forgetful", msg["site"])
        if not isinstance(dist.lm, ForgetfulLM):  # a fresh wrapper: no memo of a traced copy of the LM survives
            msg["args"] = (_rebuild(dist, ForgetfulLM(dist.lm)),) + tuple(msg["args"][1:])


@checked_jax
class Persistent(Transform):
    """Section 5.6.1: thoughts stay in context, each may act on everything after it (the default parametrisation
    of Def 2.8, made explicit). It changes no number; it refuses a site that a :class:`Forgetful` also acts on."""

    def act(self, msg: dict) -> None:
        fn = msg["fn"]
        if isinstance(fn, LMSequence):
            self._acted()
            if isinstance(fn.lm, ForgetfulLM):
                raise TransformError(f"site {msg['name']!r} is both forgetful and persistent: Persistent() and "
                                     "Forgetful() say opposite things about earlier thoughts; apply one of them")
            _mark(msg, "persistent", msg["name"])

    def act_start(self, msg: dict) -> None:
        self._acted()
        if isinstance(msg["args"][0].lm, ForgetfulLM):
            raise TransformError(f"site {msg['site']!r} is both forgetful and persistent: Persistent() and "
                                 "Forgetful() say opposite things about earlier thoughts; apply one of them")
        _mark(msg, "persistent", msg["site"])


# ---------------------------------------------------------------------------------------------- Ubiquitous
@checked_jax
class Ubiquitous(_RunCheck, ProjectionLift):
    """Section 5.6.1: thoughts may be inserted anywhere in the text, before any observable token: the lifting of
    the pause-to-think projection (5.1) with thoughts of 1..``max_thought_len`` tokens (torch twin:
    ``pt.transforms.Ubiquitous``). Its sampler is the explanatory one of 5.6.2 / Fig 5.5,
    ``ptn.guides.Explanatory(lm, ub.projection)``, reading ``x <explain>`` (:meth:`explain_prompt`)."""

    def __init__(self, vocab: Vocab, max_thought_len: int, site: str = "x", latent: str = "z", *,
                 fn: Callable[..., Any] | None = None):
        if site == latent:
            raise TransformError(f"the latent site needs its own name (site and latent are both {site!r})")
        super().__init__(fn, PauseToThink(vocab, max_thought_len), site, latent)
        self._met, self._seen, self._runs = False, [], 0

    @property
    def needs(self) -> str:  # type: ignore[override]
        return (f"the token-sequence site {self.site!r} (numpyro.sample({self.site!r}, ptn.dist.LMSequence(lm, ...), "
                "obs=x)); name the model's site with site=")

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample":
            return
        self._record(msg)
        if msg["name"] == self.site:
            if not isinstance(msg["fn"], LMSequence):
                raise TransformError(f"{self!r} cannot act on site {self.site!r}: it is a {type(msg['fn']).__name__}"
                                     f", and the transform needs {self.needs}")
            if msg["fn"].vocab_size != len(self.projection.vocab):
                raise TransformError(f"site {self.site!r}: its LM has vocab_size {msg['fn'].vocab_size}, the "
                                     f"projection's vocabulary {len(self.projection.vocab)} tokens")
            self._acted()
        super().process_message(msg)

    @staticmethod
    def explain_prompt(x: Any) -> np.ndarray:
        """The sampler's prompt ``x <explain>`` of Fig 5.5 (1-D ids)."""
        return np.concatenate([np.asarray(x, np.int64).reshape(-1), [EXPLAIN_ID]])

    def __repr__(self) -> str:
        return f"Ubiquitous(max_thought_len={self.projection.max_thought_len})"
