"""How thoughts stay in context: :class:`Forgetful` (Def 5.1, (5.5)-(5.8)), :class:`Persistent` and
:class:`Ubiquitous` (Section 5.6.1).

A thought is a block ``<s> ... </s>`` of the latent sequence. Under the default parametrisation (Def 2.8)
the LM reads every earlier token, thoughts included: *persistent* thinking. A *forgetful* latent (Def 5.1)
reads, whenever a token of the segment y^(T) x^(T) is scored, the observable context x^(<T) with every
earlier thought deleted ("the earlier thoughts are always set to y^(t) = empty when the context is input to
f", the text after (5.5)); the current thought stays until the next one starts. This is what DeepSeek-R1
does: delete the earlier thoughts, discard the KV cache, encode the conversation from scratch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ppl_thought import checks
from ppl_thought.distributions.lm_sequence import LMSequence
from ppl_thought.distributions.lm_state import left_pack, trim_padding
from ppl_thought.errors import MalformedSequenceError, TransformError
from ppl_thought.lm.base import LMCache
from ppl_thought.projections.pause import PauseToThink
from ppl_thought.transforms.base import Transform, rebuild
from ppl_thought.transforms.projection_lift import ProjectionLift
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import END_THINK_ID, EXPLAIN_ID, PAD_ID, THINK_ID, Vocab

__all__ = ["Forgetful", "ForgetfulLM", "Persistent", "Ubiquitous", "forgetful_context"]


@checked
def forgetful_context(tokens: torch.Tensor) -> torch.Tensor:
    """The context a forgetful latent reads after the last token of each row (Def 5.1): every thought block
    ``<s> ... </s>`` before the last ``<s>`` deleted, right-padded ``[n, L']``. For one row, the input that
    :class:`ForgetfulLM` gives the LM for its last position. ``tokens`` must be integer ids ``[n, L]``
    (:class:`~ppl_thought.errors.MalformedSequenceError` otherwise)."""
    checks.id_dtype("tokens", tokens.dtype)
    if tokens.ndim != 2:
        raise MalformedSequenceError(f"tokens must be right-padded token ids [n, L], got shape {tuple(tokens.shape)}")
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    keep = _keep(tokens)
    last = _segment_ids(tokens)[:, -1:] if tokens.shape[1] else torch.zeros(tokens.shape[0], 1, dtype=torch.long)
    k = keep.gather(1, last[:, :, None].expand(-1, 1, tokens.shape[1])).squeeze(1)
    return trim_padding(left_pack(torch.where(k, tokens, torch.full_like(tokens, PAD_ID))))


def _segment_ids(tokens: torch.Tensor) -> torch.Tensor:
    """j(m) = the number of ``<s>`` at positions <= m: the segment whose context position m is read in."""
    return torch.cumsum((tokens == THINK_ID).long(), 1)


def _keep(tokens: torch.Tensor) -> torch.Tensor:
    """``[n, J + 1, L]``: which tokens the context of segment j keeps (all observable ones, the thoughts from
    its own ``<s>`` on, never ``<pad>``). Segment 0 is the text before the first thought."""
    n, L = tokens.shape
    s, e = tokens == THINK_ID, tokens == END_THINK_ID
    cs, ce = torch.cumsum(s.long(), 1), torch.cumsum(e.long(), 1)
    inside = (cs - ce + e.long()) > 0  # a token of a thought block, delimiters included
    J = int(cs[:, -1].max()) if L else 0  # one host sync per call
    j = torch.arange(J + 1, device=tokens.device)
    start = (cs[:, None, :] < j[None, :, None]).sum(-1)  # [n, J+1]: the position of the j-th <s> (0 for j = 0)
    m = torch.arange(L, device=tokens.device)
    keep = (m[None, None, :] >= start[:, :, None]) | ~inside[:, None, :]
    return keep & (tokens != PAD_ID)[:, None, :]


@checked
class ForgetfulLM(nn.Module):
    """An LM read through the forgetful context of Def 5.1: the logits after position m are the wrapped LM's
    logits after the tokens up to m with every thought before the last ``<s>`` (at or before m) deleted
    (positions renumbered: the context is encoded from scratch, as DeepSeek-R1 does).

    One forward pass of the wrapped LM on ``[n * (J + 1), L]`` rows per call (J = the most thoughts in a
    row): one row per segment, all segments at once. It keeps no cache (``LMState`` runs it in recompute
    mode): a new thought changes the context of everything after it.
    """

    valid_mask_supported = False

    def __init__(self, lm: nn.Module):
        super().__init__()
        if isinstance(lm, ForgetfulLM):
            lm = lm.lm
        self.lm = lm
        self.vocab_size = int(lm.vocab_size)
        if hasattr(lm, "max_len"):
            self.max_len = lm.max_len

    @per_token
    def forward(self, tokens: torch.Tensor, cache: LMCache | None = None, **kwargs: Any):
        if cache is not None:
            raise TransformError("ForgetfulLM keeps no cache: feed the whole context (recompute mode)")
        n, L = tokens.shape
        if L == 0 or not bool(((tokens == THINK_ID) | (tokens == END_THINK_ID)).any()):
            return self.lm(tokens, **kwargs)[0], None
        keep = _keep(tokens)
        J1 = keep.shape[1]
        rows = torch.where(keep, tokens[:, None, :], torch.full_like(tokens[:, None, :], PAD_ID))
        packed = trim_padding(left_pack(rows.reshape(n * J1, L)))
        kw = {k: (v.repeat_interleave(J1, 0) if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n else v)
              for k, v in kwargs.items()}
        logits, _ = self.lm(packed, **kw)
        V = logits.shape[-1]
        pos = (torch.cumsum(keep.long(), -1) - 1).clamp(min=0)  # [n, J+1, L]: where token m sits in row j
        seg = _segment_ids(tokens)  # [n, L]
        p = pos.gather(1, seg[:, None, :]).squeeze(1)  # [n, L]
        row = torch.arange(n, device=tokens.device)[:, None] * J1 + seg
        out = logits[row.reshape(-1), p.reshape(-1)].reshape(n, L, V)
        return out, None

    def __repr__(self) -> str:
        return f"ForgetfulLM({type(self.lm).__name__})"


_MODE = "thinking"


def _mark(msg, mode: str, site: str) -> None:
    other = msg["infer"].get(_MODE)
    if other is not None and other != mode:
        raise TransformError(f"site {site!r} is both {other} and {mode}: Persistent() and Forgetful() say "
                             "opposite things about earlier thoughts; apply one of them")
    msg["infer"][_MODE] = mode


@checked
class Forgetful(Transform):
    """Def 5.1 / (5.5): every sequence site's LM reads the forgetful context (:class:`ForgetfulLM`), so when a
    later segment is encoded the earlier thoughts are gone:

        P^{<=|z|+|y x|}(y^(T+1) x^(T+1) | z) = P(y^(T+1) x^(T+1) | Proj^{<w}(z))          (5.5)

    for the thought-opening segments. With the query/response projection (where a thought follows every
    query) the likelihood of a conversation is then the product over rounds of (5.8),
    sum_{y in T} P(y | x -> T) P(x_r | x y -> Sigma_box), a sum over T per round instead of over T^T.
    Acts on every ``LMSequence`` site (whole view) and every :func:`~ppl_thought.transforms.sequence_start`
    (step view); the order with :class:`ProjectionLift` does not matter.
    """

    def __init__(self) -> None:
        super().__init__()
        self._wrapped: dict[int, ForgetfulLM] = {}

    def wrap(self, lm: nn.Module) -> ForgetfulLM:
        if isinstance(lm, ForgetfulLM):
            return lm
        if id(lm) not in self._wrapped:
            self._wrapped[id(lm)] = ForgetfulLM(lm)
        return self._wrapped[id(lm)]

    def _pyro_sample(self, msg) -> None:
        fn = msg["fn"]
        if isinstance(fn, LMSequence):
            self._acted()
            _mark(msg, "forgetful", msg["name"])
            if not isinstance(fn.lm, ForgetfulLM):
                msg["fn"] = rebuild(fn, lm=self.wrap(fn.lm))

    def _pyro_sequence_start(self, msg) -> None:
        dist = msg["args"][0]
        self._acted()
        _mark(msg, "forgetful", msg["name"])
        if not isinstance(dist.lm, ForgetfulLM):
            msg["args"] = (rebuild(dist, lm=self.wrap(dist.lm)),) + tuple(msg["args"][1:])


@checked
class Persistent(Transform):
    """Section 5.6.1: thoughts stay in context, each one may act on everything after it (the default
    parametrisation of Def 2.8, made explicit). It changes no number; it refuses a site that a
    :class:`Forgetful` also acts on."""

    def _pyro_sample(self, msg) -> None:
        fn = msg["fn"]
        if isinstance(fn, LMSequence):
            self._acted()
            if isinstance(fn.lm, ForgetfulLM):
                raise TransformError(f"site {msg['name']!r} is both forgetful and persistent: Persistent() and "
                                     "Forgetful() say opposite things about earlier thoughts; apply one of them")
            _mark(msg, "persistent", msg["name"])

    def _pyro_sequence_start(self, msg) -> None:
        self._acted()
        if isinstance(msg["args"][0].lm, ForgetfulLM):
            raise TransformError(f"site {msg['name']!r} is both forgetful and persistent: apply one of them")
        _mark(msg, "persistent", msg["name"])


@checked
class Ubiquitous(ProjectionLift):
    """Section 5.6.1: thoughts may be inserted anywhere in the text, before any observable token (not only
    between a query and its response): the lifting of the pause-to-think projection (5.1) with thoughts of
    1..``max_thought_len`` tokens, over the site's vocabulary.

    Its sampler is the explanatory one of Section 5.6.2 / Fig 5.5, ``pt.guides.Explanatory(lm,
    ub.projection)``: it reads the prompt ``x <explain>`` (:meth:`explain_prompt`) and decodes Z under the
    lifting automaton of x (the masks Phi^{<=1} listed in 5.6.2), so every thought may depend on all of x.
    """

    def __init__(self, vocab: Vocab, max_thought_len: int, site: str = "x", latent: str = "z"):
        super().__init__(PauseToThink(vocab, max_thought_len), site, latent)

    @staticmethod
    def explain_prompt(x: torch.Tensor) -> torch.Tensor:
        """The sampler's prompt ``x <explain>`` of Fig 5.5 (1-D ids)."""
        return torch.cat([torch.as_tensor(x, dtype=torch.long), torch.tensor([EXPLAIN_ID])])

    def __repr__(self) -> str:
        return f"Ubiquitous(max_thought_len={self.projection.max_thought_len})"
