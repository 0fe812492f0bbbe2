"""``ptn.transforms``: the model transforms of ``pt.transforms`` as NumPyro handlers (torch: ppl_thought/transforms).

Each transform is a :class:`numpyro.primitives.Messenger` acting on the *sequence sites* of a program, the
``numpyro.sample(name, ptn.dist.LMSequence(lm, ...), obs=...)`` sites (the whole view), with the torch
constructor arguments and numbers:

- :class:`ProjectionLift` (Def 2.8, (2.22)): a plain LM program becomes Proj # P_f (ptn.handlers, re-exported);
- :class:`Forgetful` (Def 5.1, (5.5)-(5.8)): earlier thoughts leave the context when a new thought starts
  (the site's LM is read through :class:`ForgetfulLM`);
- :class:`Persistent` / :class:`Ubiquitous` (5.6.1): thoughts stay in context / may stand anywhere in the text;
- :class:`CostAware` ((5.26)-(5.27), 5.6.3): records the latent lengths |Z| and holds the estimators of 5.6.3;
- :class:`ActiveLift` (Section 6, ppl_thought/numpyro/active.py): a learned sampler Q, latent prior P and
  generator G in one LM in place of a fixed projection (the model X ~ G(. | Z), Z ~ P of (6.13));
- :func:`compose`: ``compose(A, B, C)(model) == A(B(C(model)))``.

Apply one as on the torch side, ``Forgetful()(ProjectionLift(proj)(model))``, or as NumPyro handlers are applied,
``Forgetful(fn=model)`` / ``with Forgetful(): ...``. Calling a transform on a model returns a new handler bound to
that model (the transform itself stays unbound, so one transform may be applied to several models). A run of a
bound transform that met nothing it acts on raises :class:`~ppl_thought.errors.TransformError` naming what it
needs and the sequence sites the run had (the torch checks of issue 41). Step-wise ``ptn.Program`` states
(``ptn.dist.LMState``) are not sequence sites: a program whose steps sample none is refused the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.primitives import Messenger

from ppl_thought.errors import TransformError
from ppl_thought.numpyro.boundary import Array, ArrayLike, checked_jax
from ppl_thought.numpyro.distributions import LMSequence
from ppl_thought.numpyro.handlers import ProjectionLift
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.projections.pause import PauseToThink
from ppl_thought.validation import per_token
from ppl_thought.vocab import END_THINK_ID, EXPLAIN_ID, PAD_ID, THINK_ID, Vocab

__all__ = ["ActiveLift", "CostAware", "Forgetful", "ForgetfulLM", "GeneratorSequence", "Persistent", "ProjectionLift",
           "Transform", "Ubiquitous", "compose", "forgetful_keep", "latent_lengths"]

_MODE = "thinking"


# ---------------------------------------------------------------------------------------------- the machinery
class _RunCheck:
    """Binding and the refusal of a run that met nothing (shared by :class:`Transform` and :class:`Ubiquitous`)."""

    needs = "a sequence site: numpyro.sample(name, ptn.dist.LMSequence(lm, ...))"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``T(model)`` (unbound ``T``, one callable argument): a copy of ``T`` bound to ``model``. A bound
        transform runs its model under the handler and refuses the run if it met nothing it acts on."""
        if self.fn is None:
            if len(args) != 1 or kwargs or not callable(args[0]):
                raise TransformError(f"{self!r} is applied to a model (a callable): {self!r}(model)")
            bound = copy.copy(self)
            bound.fn = args[0]
            return bound
        outer = getattr(self, "_runs", 0) == 0
        if outer:
            self._met, self._seen = False, []
        self._runs = getattr(self, "_runs", 0) + 1
        try:
            with self:
                out = self.fn(*args, **kwargs)
        finally:
            self._runs -= 1
        if outer:
            self.check_met()
        return out

    def _record(self, msg: dict) -> None:
        """Note a sequence site of the run (for the refusal's message)."""
        seen = self.__dict__.setdefault("_seen", [])
        if msg["type"] == "sample" and isinstance(msg["fn"], LMSequence) and msg["name"] not in seen \
                and len(seen) < 16:
            seen.append(msg["name"])

    def _acted(self) -> None:
        self._met = True

    def check_met(self) -> None:
        """Refuse a run that met nothing the transform acts on: a :class:`TransformError` naming what it needs
        and the sequence sites of the run (the torch ``Transform.check_met``)."""
        if not getattr(self, "_met", False):
            seen = ", ".join(repr(s) for s in getattr(self, "_seen", [])) or "none"
            raise TransformError(f"{self!r} cannot act on this model: it needs {self.needs}; the model's run met "
                                 f"none (its sequence sites: {seen})")


@checked_jax
class Transform(_RunCheck, Messenger):
    """Base class of the JAX transforms: a NumPyro Messenger on sequence sites, applied by calling it on a model
    (torch twin: ``pt.transforms.Transform``). Subclasses implement :meth:`act` (a message of a sample site)."""

    def __init__(self, fn: Callable[..., Any] | None = None) -> None:
        super().__init__(fn)
        self._met, self._seen, self._runs = False, [], 0

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "sample":
            self._record(msg)
            self.act(msg)

    def act(self, msg: dict) -> None:
        """Handle one sample site (default: nothing)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@checked_jax
def compose(*transforms: Transform | ProjectionLift) -> Callable[[Callable[..., Any]], Any]:
    """``compose(A, B, C)(model) == A(B(C(model)))``: the last transform is applied first (innermost)."""
    for t in transforms:
        if not isinstance(t, (Transform, ProjectionLift)):
            raise TransformError(f"compose takes transforms, got {type(t).__name__}")

    def apply(model: Callable[..., Any]) -> Any:
        for t in reversed(transforms):
            model = t(model)
        return model

    return apply


def _rebuild(d: LMSequence, lm: LM) -> LMSequence:
    """A copy of the sequence distribution ``d`` reading ``lm`` (same prompt, rule, params, shapes)."""
    new = copy.copy(d)
    new.lm = lm
    return new


def _mark(msg: dict, mode: str) -> None:
    other = msg["infer"].get(_MODE)
    if other is not None and other != mode:
        raise TransformError(f"site {msg['name']!r} is both {other} and {mode}: Persistent() and Forgetful() say "
                             "opposite things about earlier thoughts; apply one of them")
    msg["infer"][_MODE] = mode


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
    Acts on every ``LMSequence`` site; the order with :class:`ProjectionLift` does not matter.
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
            _mark(msg, "forgetful")
            if not isinstance(fn.lm, ForgetfulLM):
                msg["fn"] = _rebuild(fn, self.wrap(fn.lm))


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
            _mark(msg, "persistent")


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


# ---------------------------------------------------------------------------------------------- CostAware
@checked_jax
def latent_lengths(trace: dict, n: int) -> jax.Array:
    """|Z_i| ``[n]``: the tokens of every latent (unobserved) sequence site of a NumPyro trace, per particle (the
    torch ``pt.transforms.latent_lengths``)."""
    total = jnp.zeros(int(n))
    for site in trace.values():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        fn = getattr(site["fn"], "base_dist", site["fn"])
        if not isinstance(fn, LMSequence):
            continue
        v = jnp.asarray(site["value"])
        counts = (v != PAD_ID).reshape(-1, v.shape[-1]).sum(-1).astype(jnp.float32)
        if counts.shape[0] != n:
            counts = counts.reshape(n, -1).sum(-1) if counts.size % n == 0 else jnp.broadcast_to(counts.sum(), (n,))
        total = total + counts
    return total


@checked_jax
class CostAware(Transform):
    """The cost-aware objective (5.26)-(5.27) of Section 5.6.3 (torch twin: ``pt.transforms.CostAware``):
    tau(l) = 1 + weight * l (or ``tau``), and the one-sampler estimators

        T_s = (1/n) sum_i tau(|Z_i|),
        T~*_s = sum_i w_i tau(|Z_i|) log P(Z_i) - (sum_i w_i tau(|Z_i|)) (sum_i w_i log P(Z_i)),

    w_i the self-normalised importance weights; the loss C_s (T~*_s + D(T_s - T~*_s)) has value C_s T_s and
    gradient T_s grad C_s + C_s grad T~*_s (:meth:`loss`, C_s = L_n - H~(P_*)). The model's distribution is
    unchanged: engines run the transformed model as the inner one; the handler records each latent sequence
    site's lengths in ``msg["infer"]["latent_tokens"]``.

    Args:
        weight: the cost of one latent token relative to the fixed cost of a sequence (finite, >= 0).
        entropy: the estimate H~(P_*) subtracted from the cross entropy (4.1) (default 0).
        tau: a cost function of the latent lengths ``[n] -> [n]`` in place of 1 + weight * l.
    """

    needs = ("a latent sequence site whose length it prices (an unobserved LMSequence, e.g. the thoughts z of "
             "ProjectionLift(proj)(model)); a model without latent thoughts has nothing to cost")

    def __init__(self, weight: float, entropy: float = 0.0, tau: Callable[[Any], Any] | None = None, *,
                 fn: Callable[..., Any] | None = None):
        super().__init__(fn)
        w = float(weight)
        if not w >= 0 or w == float("inf"):
            raise TransformError(f"CostAware weight must be a finite number >= 0 (cost per latent token), "
                                 f"got {weight!r}")
        self.weight = w
        self.entropy = float(entropy)
        self._tau = tau

    def tau(self, lengths: ArrayLike) -> jax.Array:
        """tau(|Z|): the time cost of latent sequences of these lengths."""
        lengths = jnp.asarray(lengths, jnp.float32)
        return jnp.asarray(self._tau(lengths)) if self._tau is not None else 1.0 + self.weight * lengths

    def act(self, msg: dict) -> None:
        if not msg["is_observed"] and isinstance(getattr(msg["fn"], "base_dist", msg["fn"]), LMSequence):
            self._acted()

    def postprocess_message(self, msg: dict) -> None:
        if msg["type"] == "sample" and not msg["is_observed"] and \
                isinstance(getattr(msg["fn"], "base_dist", msg["fn"]), LMSequence):
            msg["infer"]["latent_tokens"] = (jnp.asarray(msg["value"]) != PAD_ID).sum(-1)

    def estimate(self, log_p: Array, log_w: Array, lengths: Array) -> tuple[jax.Array, jax.Array]:
        """(T_s, T~*_s) of one batch: ``log_p`` = log P(Z_i) (differentiable), ``log_w`` = log q_i (held fixed),
        ``lengths`` = |Z_i|. -inf weights and log-probabilities drop out (never NaN)."""
        log_p = jnp.asarray(log_p)
        tau = self.tau(lengths).astype(log_p.dtype)
        lw = jax.lax.stop_gradient(jnp.asarray(log_w))
        lse = jax.scipy.special.logsumexp(lw, 0)
        w = jnp.where(jnp.isfinite(lse), jnp.exp(lw - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
        finite = jnp.isfinite(log_p) & (w > 0)
        lp = jnp.where(finite, log_p, 0.0)
        wt = w * tau
        t_tilde = (wt * lp).sum() - jax.lax.stop_gradient(wt.sum()) * (w * lp).sum()
        return tau.mean(), t_tilde

    def loss(self, cross_entropy: ArrayLike, surrogate: ArrayLike, log_p: Array, log_w: Array,
             lengths: Array) -> tuple[jax.Array, jax.Array]:
        """(value C_s T_s, surrogate T_s * surrogate + C_s T~*_s) of (5.27) from an objective's loss value L_n
        (``cross_entropy``) and its differentiable ``surrogate`` (the torch ``CostAware.surrogate``)."""
        t_s, t_tilde = self.estimate(log_p, log_w, lengths)
        c_s = jax.lax.stop_gradient(jnp.asarray(cross_entropy)) - self.entropy
        return c_s * jax.lax.stop_gradient(t_s), jax.lax.stop_gradient(t_s) * surrogate + c_s * t_tilde

    def __repr__(self) -> str:
        return f"CostAware(weight={self.weight})"


from ppl_thought.numpyro.active import ActiveLift, GeneratorSequence  # noqa: E402  (active.py builds on _RunCheck)
