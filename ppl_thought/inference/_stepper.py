"""Batched incremental decoding over ragged rows with per-row pausing (SMC, decoding).

Particles of SMC finish their segments at different token counts while a batched KV cache
advances in lockstep. :class:`Stepper` feeds one token per row per call; rows that are not
``active`` (waiting at a segment boundary, or finished) keep their next-token logits and
their LM context unchanged. Two modes, chosen from the LM:

* ``valid`` mode, for LMs whose ``forward`` takes ``valid`` (``Tabular``, ``Transformer`` with
  ``window=None``): the whole batch is fed one token per call with the KV cache and ``valid=active``,
  so an inactive row's dummy token neither changes its context nor is attended to.
* ``recompute`` mode, for any other LM: each row's context is kept right-padded and the LM is
  rerun on it (no cache: quadratic in the length, but exact for every LM).
"""

from __future__ import annotations

import inspect

import torch

from ppl_thought.distributions.lm_sequence import BOS_ID, PAD_ID
from ppl_thought.lm.base import match_rows


def supports_valid(lm: torch.nn.Module) -> bool:
    """Whether ``lm.forward`` accepts the per-token ``valid`` mask.

    An LM whose support depends on its configuration says so with a ``valid_mask_supported``
    attribute (the Transformer: only without a sliding window); otherwise the signature decides.
    """
    flag = getattr(lm, "valid_mask_supported", None)
    if flag is not None:
        return bool(flag)
    try:
        return "valid" in inspect.signature(lm.forward).parameters
    except (TypeError, ValueError):
        return False


def context_rows(prompt: torch.Tensor, z: torch.Tensor | None, n: int) -> torch.Tensor:
    """``<bos> + prompt + z`` per row, right-padded ``[n, T]`` (``z`` right-padded ``[n, L]`` or None)."""
    prompt = torch.as_tensor(prompt, dtype=torch.long)
    p = prompt.reshape(-1, prompt.shape[-1]) if prompt.ndim > 1 else prompt[None]
    if p.shape[0] != n:
        p = p.expand(n, -1) if p.shape[0] == 1 else p.repeat_interleave(n // p.shape[0], 0)
    bos = torch.full((n, 1), BOS_ID, dtype=torch.long)
    parts = [bos, p] + ([z] if z is not None else [])
    cat = torch.cat(parts, dim=1)
    keep = cat != PAD_ID
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    out = torch.gather(cat, -1, order)
    used = (out != PAD_ID).any(0)
    return out[:, : int(used.nonzero().max()) + 1]


class Stepper:
    """One LM decoding ``n`` ragged rows in lockstep; ``logits [n, V]`` are the next-token logits."""

    def __init__(self, lm: torch.nn.Module, lm_kwargs: dict | None = None, mode: str | None = None):
        self.lm = lm
        self.lm_kwargs = dict(lm_kwargs or {})
        self.mode = mode or ("valid" if supports_valid(lm) else "recompute")
        self.cache = None
        self.ctx: torch.Tensor | None = None
        self.plen: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def _kw(self, n: int) -> dict:
        return match_rows(self.lm_kwargs, n)

    def start(self, ctx: torch.Tensor) -> Stepper:
        """Encode right-padded contexts ``[n, T]`` (each starting with ``<bos>``)."""
        n = ctx.shape[0]
        plen = (ctx != PAD_ID).sum(-1)
        rows = torch.arange(n, device=ctx.device)
        if self.mode == "valid":
            if bool((ctx == ctx[:1]).all()):
                logits, cache = self.lm(ctx[:1], **self._kw(1))
                self.cache = cache.expand(n)
                self.logits = logits[:, -1].expand(n, -1).clone()
            elif bool((plen == plen[0]).all()):
                logits, self.cache = self.lm(ctx, **self._kw(n))
                self.logits = logits[:, -1]
            else:
                logits, self.cache = self.lm(ctx, valid=ctx != PAD_ID, **self._kw(n))
                self.logits = logits[rows, plen - 1]
        else:
            self.ctx, self.plen = ctx, plen
            logits, _ = self.lm(ctx, **self._kw(n))
            self.logits = logits[rows, plen - 1]
        return self

    def feed(self, tok: torch.Tensor, active: torch.Tensor) -> None:
        """Read ``tok [n]`` in the ``active`` rows; the others stay as they are."""
        n = tok.shape[0]
        if not bool(active.any()):
            return
        if self.mode == "valid":
            feed = torch.where(active, tok, torch.full_like(tok, BOS_ID))
            if bool(active.all()):
                logits, self.cache = self.lm(feed[:, None], cache=self.cache, **self._kw(n))
            else:
                logits, self.cache = self.lm(feed[:, None], cache=self.cache, valid=active[:, None], **self._kw(n))
            self.logits = torch.where(active[:, None], logits[:, -1], self.logits)
            return
        ctx, plen = self.ctx, self.plen
        if int(plen.max()) >= ctx.shape[1]:
            ctx = torch.cat([ctx, torch.full((n, 1), PAD_ID, dtype=ctx.dtype, device=ctx.device)], 1)
        rows = torch.arange(n, device=ctx.device)
        ctx = ctx.clone()
        ctx[rows[active], plen[active]] = tok[active]
        plen = plen + active.long()
        width = int(plen.max())
        self.ctx, self.plen = ctx[:, :width], plen
        logits, _ = self.lm(self.ctx, **self._kw(n))
        self.logits = torch.where(active[:, None], logits[rows, plen - 1], self.logits)

    def reorder(self, index: torch.Tensor) -> None:
        """Gather rows (resampling): the KV cache with ``cache.reorder`` or the contexts."""
        self.logits = self.logits[index]
        if self.mode == "valid":
            self.cache = self.cache.reorder(index)
        else:
            self.ctx, self.plen = self.ctx[index], self.plen[index]


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log softmax over admissible tokens (Def 2.8); rows with no admissible token are all -inf, never NaN."""
    masked = logits.float().masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(masked, -1, keepdim=True)
    return torch.where(torch.isneginf(lse), torch.full_like(masked, float("-inf")), masked - lse)
