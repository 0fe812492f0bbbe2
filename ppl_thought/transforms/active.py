"""Active lifting (Section 6) as a poutine handler: a learned sampler Q, latent prior P and generator G
in place of a fixed projection.

The static theory starts from a projection Proj and derives its lifting; active lifting lets the
sampler Q be the free variable (Def 6.1) and the projection emerge (Remark 6.1). An active lifting
model is the tuple (X, Omega, Q, P, G) of the summary of Section 6.6, and Section 6.6 implements the
three parts by ONE autoregressive LM read in three formats (``<s>`` and ``</s>`` are the library's
thought markers, ``<think>``/``</think>`` of a HuggingFace tokenizer):

=============  ===========================  ====================================================
part           the LM reads                 and decodes
=============  ===========================  ====================================================
sampler Q      ``<bos> x <s>``              z in Omega^T: Q^{<=T}(z | x) = prod_t Q(z_t | x, z_<t) (6.1)
latent P       ``<bos> <s>``                z: P = Q(. | emptyset), the "Q on X + {emptyset}" of 6.1
generator G    ``<bos> z_<=t </s>``         x: G^{<=t}(x | z_<=t), a continuation decoder (6.13), 6.6
=============  ===========================  ====================================================

Latent sequences have the fixed cut-off length T (``latent_len``, "a large and uniform cutoff
length T" of 6.6) and use only the latent tokens Omega (``latent_tokens``); x uses the observable
tokens Sigma (with ``<eos>``). Logits are masked to the part's alphabet before the softmax (Def 2.8).

:class:`ActiveLift` is a Pyro Messenger. Applied to a plain LM program with an observed sequence
site ``"x"`` it draws the latent site ``"z"`` from P and makes ``"x"`` a draw of G(. | z), so the
lifted program is the generative model (6.13), X ~ G(. | Z), Z ~ P; :meth:`ActiveLift.guide` is the
sampler Q as a Pyro guide with the site ``"z"``. Every engine of the library runs on the pair (the
importance weights are P(z) G(x | z) / Q(z | x), the t = T term of (6.17)). The prefix quantities
the objectives of Section 6 need (log P^{<=t}, log Q^{<=t}, log G^{<=t} for every t) come from one
teacher-forced pass each: :meth:`ActiveLift.prior_log_probs`, :meth:`ActiveLift.sampler_log_probs`,
:meth:`ActiveLift.generator_log_probs`; the objectives live in :mod:`ppl_thought.training.active`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import pyro
import torch
from pyro.poutine.messenger import Messenger

from ppl_thought.checks import integer, latent_token_ids
from ppl_thought.distributions.lm_sequence import LMSequence, concat
from ppl_thought.distributions.lm_state import masked_log_softmax
from ppl_thought.errors import ActiveLiftError, MalformedSequenceError
from ppl_thought.lm.base import as_id_batch, lm_device
from ppl_thought.projections.automaton import AutomatonBuilder
from ppl_thought.validation import ArrayLike, checked
from ppl_thought.vocab import BOS_ID, END_THINK_ID, EOS_ID, PAD_ID, THINK_ID, Vocab

__all__ = ["ActiveLift", "score_continuation"]


@checked
def score_continuation(lm: torch.nn.Module, context: torch.Tensor, cont: torch.Tensor,
                       allowed: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities ``[B, L]`` of the right-padded rows ``cont`` after the right-padded rows
    ``context`` (which start with ``<bos>``), the logits masked to ``allowed`` ``[V]`` (Def 2.8): one
    teacher-forced pass. Padding positions of ``cont`` get 0; a token outside ``allowed`` gets ``-inf``.

    Rows that read the same tokens are computed once (``torch.unique`` over the LM inputs; for a one-token
    continuation the inputs are the context alone, so every x after the same context shares one row): the
    particles of a sampler that has become deterministic (Remark 6.1) cost one row, not n.
    """
    B, L = cont.shape
    device = context.device
    if L == 0 or B == 0:
        return torch.zeros(B, L, device=device)
    inputs = concat(context, cont[:, :-1])
    clen = (context != PAD_ID).sum(-1)
    key = torch.cat([clen[:, None], inputs], 1)  # the same tokens with another context length are another row
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    uniq = uniq[:, 1:]
    first = torch.full((uniq.shape[0],), B, dtype=torch.long, device=device).scatter_reduce(
        0, inverse, torch.arange(B, device=device), "amin")
    clen = clen[first]
    logits, _ = lm(uniq)
    pos = ((clen - 1)[:, None] + torch.arange(L, device=device)).clamp_max(logits.shape[1] - 1)
    logits = logits.gather(1, pos[..., None].expand(uniq.shape[0], L, logits.shape[-1]))
    lsm = masked_log_softmax(logits, allowed.to(device))[inverse]  # [B, L, V]
    lp = lsm.gather(-1, cont[..., None]).squeeze(-1)
    return torch.where(cont != PAD_ID, lp, torch.zeros_like(lp))


def _alphabet_automaton(vocab_size: int, ids: torch.Tensor, name: str):
    b = AutomatonBuilder(vocab_size, name)
    s = b.add_state()
    b.edge(s, ids.cpu().numpy(), s)
    return b.build()


@checked
class ActiveLift(Messenger):
    """Active lifting (Section 6): the sampler Q, the latent prior P and the generator G of one LM (6.6).

    Args:
        lm: the LM that plays Q (``x <s> z``), P (``<s> z``) and G (``z </s> x``), Section 6.6.
        vocab: its vocabulary.
        latent_len: T, the cut-off length of the latent sequences (6.1), 6.6.
        latent_tokens: Omega, the tokens z is made of (strings or ids); default: the ordinary tokens.
        max_x_len: the longest x the generator decodes (a complete x ends with ``<eos>`` or has this length).
        prior_lm, generator_lm: separate LMs for P and G (default: ``lm``; the tests use separate ones to
            check each player's gradient on its own).
        site: the observed sequence site of the program that becomes X ~ G(. | Z).
        latent_site: the name of the latent site Z.

    As a handler, ``ActiveLift(...)(program)`` turns the program's site ``site`` into the lifted model
    X ~ G(. | Z), Z ~ P of (6.13) (the site keeps its observation); ``lift.guide`` samples Z ~ Q(. | x).
    """

    def __init__(self, lm: torch.nn.Module, vocab: Vocab, latent_len: int,
                 latent_tokens: Sequence[str | int] | None = None, max_x_len: int = 16, *,
                 prior_lm: torch.nn.Module | None = None, generator_lm: torch.nn.Module | None = None,
                 site: str = "x", latent_site: str = "z"):
        super().__init__()
        self.lm, self.vocab = lm, vocab
        self.prior_lm = prior_lm if prior_lm is not None else lm
        self.generator_lm = generator_lm if generator_lm is not None else lm
        for role, m in (("lm", self.lm), ("prior_lm", self.prior_lm), ("generator_lm", self.generator_lm)):
            if int(getattr(m, "vocab_size", -1)) != len(vocab):
                raise ActiveLiftError(f"{role} has vocab_size {getattr(m, 'vocab_size', None)}, the vocabulary "
                                      f"{len(vocab)} tokens")
        self.latent_len = integer("latent_len", latent_len, minimum=1)
        self.max_x_len = integer("max_x_len", max_x_len, minimum=1)
        omega = latent_token_ids(vocab, latent_tokens)  # Omega, Section 6.1
        self.site, self.latent_site = site, latent_site
        V = len(vocab)
        self.omega = torch.zeros(V, dtype=torch.bool)
        self.omega[omega] = True
        self.sigma = torch.zeros(V, dtype=torch.bool)
        self.sigma[torch.as_tensor(vocab.observable_ids)] = True
        self._omega_auto = _alphabet_automaton(V, self.omega.nonzero().flatten(), "Omega^T")
        self._sigma_auto = _alphabet_automaton(V, self.sigma.nonzero().flatten(), "Sigma*")
        self._met = False  # whether the current run met the site ``site`` (refused at its end otherwise)
        self._seen: list[str] = []  # the run's sequence sites, for that message
        self._runs = 0

    # ------------------------------------------------------------------ inputs
    def _device(self) -> torch.device:
        return lm_device(self.lm)

    def as_ids(self, x: ArrayLike, what: str = "x") -> torch.Tensor:
        """x as right-padded ids ``[B, L]`` on the LM's device (text, a 1-D or a 2-D LongTensor)."""
        if isinstance(x, str):
            x = self.vocab.encode(x)
        t = as_id_batch(x, what)
        self.vocab.check_ids(t, what)
        nonpad = t != PAD_ID
        if t.shape[-1] and (nonpad[:, 1:] & ~nonpad[:, :-1]).any():
            raise MalformedSequenceError(f"padding inside {what}: <pad> must only fill the end of a row")
        return t.to(self._device())

    def _latents(self, z) -> torch.Tensor:
        z = torch.as_tensor(z).long().to(self._device())
        z = z[None] if z.ndim == 1 else z
        if z.ndim != 2 or z.shape[-1] != self.latent_len:
            raise MalformedSequenceError(f"z must be [B, T] with T = latent_len = {self.latent_len}, got shape "
                                         f"{tuple(z.shape)}")
        if not self.omega.to(z.device)[z].all():
            raise ActiveLiftError("z contains tokens outside Omega (latent_tokens)")
        return z

    def _column(self, B: int, token: int) -> torch.Tensor:
        return torch.full((B, 1), token, dtype=torch.long, device=self._device())

    # ------------------------------------------------------------------ the three parts as distributions
    def sampler(self, x: ArrayLike) -> LMSequence:
        """Q^{<=T}(. | x) (6.1): the LM after ``x <s>``, masked to Omega; batch shape ``[B]`` for ``[B, L]`` x
        (``()`` for a 1-D x)."""
        xi = self.as_ids(x)
        prompt = concat(xi, self._column(xi.shape[0], THINK_ID))
        if torch.as_tensor(x).ndim == 1 or isinstance(x, str):
            prompt = prompt[0]
        return LMSequence(self.lm, prompt=prompt, constraint=self._omega_auto, max_len=self.latent_len)

    def prior(self) -> LMSequence:
        """P^{<=T} (6.6): the LM after ``<s>`` alone (Q with x = emptyset, Section 6.1), masked to Omega."""
        prompt = torch.tensor([THINK_ID], dtype=torch.long, device=self._device())
        return LMSequence(self.prior_lm, prompt=prompt, constraint=self._omega_auto, max_len=self.latent_len)

    def generator(self, z: ArrayLike) -> LMSequence:
        """G(. | z) (6.13): the LM after ``z </s>``, decoding x over Sigma until ``<eos>`` (or ``max_x_len``)."""
        zi = self._latents(z)
        prompt = torch.cat([zi, self._column(zi.shape[0], END_THINK_ID)], 1)
        if torch.as_tensor(z).ndim == 1:
            prompt = prompt[0]
        return LMSequence(self.generator_lm, prompt=prompt, constraint=self._sigma_auto, stop=EOS_ID,
                          max_len=self.max_x_len)

    def guide(self, x: ArrayLike, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The sampler Q as a Pyro guide: samples the site ``latent_site`` from Q^{<=T}(. | x)."""
        return pyro.sample(self.latent_site, self.sampler(x))

    def model(self, x: ArrayLike | None, *args: Any, **kwargs: Any):
        """The lifted model (6.13) on its own: Z ~ P, X ~ G(. | Z) observed at ``x`` (None: generated)."""
        obs = None if x is None else self.as_ids(x)[0]
        z = pyro.sample(self.latent_site, self.prior())
        return pyro.sample(self.site, self.generator(z), obs=obs)

    # ------------------------------------------------------------------ the handler
    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:  # type: ignore[override]
        """The lifted model: ``fn`` run under the handler, refused (:class:`ActiveLiftError`) at the end of a run
        that never met the sequence site ``site``."""
        if not callable(fn):
            raise ActiveLiftError(f"ActiveLift applies to a Pyro model (a function or a pt.Program), got "
                                  f"{type(fn).__name__}")

        @functools.wraps(fn)
        def lifted(*args: Any, **kwargs: Any):
            if self._runs == 0:
                self._met, self._seen = False, []
            self._runs += 1
            try:
                with self:
                    out = fn(*args, **kwargs)
            finally:
                self._runs -= 1
            if self._runs == 0 and not self._met:
                seen = ", ".join(repr(s) for s in self._seen) or "none"
                raise ActiveLiftError(f"ActiveLift cannot act on this model: it needs the observed token-sequence "
                                      f"site {self.site!r} (pyro.sample({self.site!r}, LMSequence(lm, ...), obs=x)); "
                                      f"the model's run met none (its sequence sites: {seen}); name it with site=")
            return out

        return lifted

    def _pyro_sample(self, msg: dict) -> None:
        if isinstance(msg["fn"], LMSequence) and msg["name"] not in self._seen and len(self._seen) < 16:
            self._seen.append(msg["name"])
        if msg["name"] != self.site or msg.get("_active_lifted"):
            return
        if not isinstance(msg["fn"], LMSequence):
            raise ActiveLiftError(f"ActiveLift cannot act on site {self.site!r}: it is a {type(msg['fn']).__name__}, "
                                  f"and active lifting needs a token-sequence site (pyro.sample({self.site!r}, "
                                  "LMSequence(lm, ...), obs=x)) to make X ~ G(. | Z)")
        self._met = True
        msg["_active_lifted"] = True
        z = pyro.sample(self.latent_site, self.prior())
        msg["fn"] = self.generator(z)
        if msg["value"] is not None and msg["is_observed"]:
            msg["value"] = self.as_ids(msg["value"])[0]

    # ------------------------------------------------------------------ prefix quantities (one pass each)
    def sampler_log_probs(self, z: ArrayLike, x: ArrayLike) -> torch.Tensor:
        """``[B, T]``: log Q(z_t | x, z_<t) of (6.1), one teacher-forced pass over ``<bos> x <s> z``.
        ``x`` is ``[B, L]`` (or one row shared by the B latents)."""
        zi = self._latents(z)
        xi = self.as_ids(x)
        xi = xi.expand(zi.shape[0], -1) if xi.shape[0] == 1 else xi
        ctx = concat(self._column(xi.shape[0], BOS_ID), xi, self._column(xi.shape[0], THINK_ID))
        return score_continuation(self.lm, ctx, zi, self.omega)

    def prior_log_probs(self, z: ArrayLike) -> torch.Tensor:
        """``[B, T]``: log P(z_t | z_<t), one pass over ``<bos> <s> z``."""
        zi = self._latents(z)
        ctx = torch.cat([self._column(zi.shape[0], BOS_ID), self._column(zi.shape[0], THINK_ID)], 1)
        return score_continuation(self.prior_lm, ctx, zi, self.omega)

    def generator_log_probs(self, x: ArrayLike, z: ArrayLike) -> torch.Tensor:
        """``[B, T + 1]``: log G^{<=t}(x | z_<=t) for t = 0..T (column t reads the first t latent tokens).

        The teacher-forced sum of log G over the tokens of x, i.e. log G([x] | z_<=t), the probability that
        G's output starts with x (6.21); for a complete x (ending with ``<eos>``, or of length ``max_x_len``)
        it is G(x | z_<=t). The T + 1 contexts ``<bos> z_<=t </s>`` are rows of one batched pass.
        """
        zi = self._latents(z)
        xi = self.as_ids(x)
        B, T = zi.shape
        xi = xi.expand(B, -1) if xi.shape[0] == 1 else xi
        if xi.shape[0] != B:
            raise MalformedSequenceError(f"{xi.shape[0]} rows of x for {B} latent sequences")
        if (xi != PAD_ID).sum(-1).max() > self.max_x_len:
            raise MalformedSequenceError(f"x is longer than max_x_len = {self.max_x_len}")
        t = torch.arange(T + 1, device=zi.device)
        keep = torch.arange(T, device=zi.device)[None, :] < t[:, None]  # [T+1, T]: z_<=t
        zt = torch.where(keep[None], zi[:, None, :], torch.full_like(zi[:, None, :], PAD_ID))  # [B, T+1, T]
        rows = zt.reshape(B * (T + 1), T)
        ctx = concat(self._column(rows.shape[0], BOS_ID), rows, self._column(rows.shape[0], END_THINK_ID))
        cont = xi.repeat_interleave(T + 1, 0)
        lp = score_continuation(self.generator_lm, ctx, cont, self.sigma)
        return lp.sum(-1).reshape(B, T + 1)

    def __repr__(self) -> str:
        return (f"ActiveLift(T={self.latent_len}, |Omega|={int(self.omega.sum())}, max_x_len={self.max_x_len}, "
                f"site={self.site!r}, latent_site={self.latent_site!r})")
