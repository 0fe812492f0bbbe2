"""An n-gram LM with an explicit logits table, for exact computations (docs/architecture.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ppl_thought import checks
from ppl_thought.checks import integer
from ppl_thought.errors import ConfigError, MalformedSequenceError, UnknownTokenError
from ppl_thought.lm.base import ids_are_checked
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import BOS_ID


@checked
@dataclass
class TabularCache:
    """The last ``order - 1`` tokens of each row (``<bos>``-padded) and the positions consumed."""

    context: torch.Tensor  # [B, order - 1]
    length: int

    @property
    def batch_size(self) -> int:
        return self.context.shape[0]

    @per_token
    def reorder(self, index: torch.Tensor) -> TabularCache:
        return TabularCache(self.context.index_select(0, index.to(self.context.device)), self.length)

    @per_token
    def expand(self, n: int) -> TabularCache:
        return TabularCache(self.context.repeat_interleave(n, dim=0), self.length)


@checked
class Tabular(nn.Module):
    """n-gram LM: ``logits[c_1, ..., c_{n-1}, next]``; order 2 is a bigram ``logits[prev, next]``.

    The logits after position i are read at the last ``order - 1`` tokens up to and including i,
    padded on the left with ``<bos>``; so the first token after ``<bos>`` is conditioned on
    ``<bos>`` (P_f^{+1}(. | z) = softmax(f(z)), (2.13)). Entries may be ``-inf`` (forbidden
    transitions). The table is a trainable parameter unless ``trainable=False``.
    """

    def __init__(self, order: int, vocab_size: int, logits: torch.Tensor | None = None, trainable: bool = True):
        super().__init__()
        order, vocab_size = integer("order", order), integer("vocab_size", vocab_size)
        shape = (vocab_size,) * order
        # the table holds V^order logits: refused by size before anything is allocated (checks.allocation)
        if order * math.log2(vocab_size) > 60:
            raise ConfigError(f"Tabular(order={order}, vocab_size={vocab_size}) would hold {vocab_size}^{order} "
                              "logits (more than 2^60): use a smaller order or vocabulary")
        numel = vocab_size ** order
        checks.allocation(f"Tabular(order={order}, vocab_size={vocab_size}): a table of {vocab_size}^{order} "
                          "logits", numel * torch.finfo(torch.get_default_dtype()).bits // 8)
        if logits is None:
            logits = torch.zeros(shape)
        logits = torch.as_tensor(logits, dtype=torch.get_default_dtype())
        if tuple(logits.shape) != shape:
            raise ConfigError(f"Tabular(order={order}, vocab_size={vocab_size}) needs logits of shape {shape}, "
                             f"got {tuple(logits.shape)}")
        if torch.isnan(logits).any() or torch.isposinf(logits).any():
            raise MalformedSequenceError("Tabular logits contain NaN or +inf (a logit may be -inf: a forbidden "
                                         "transition; +inf has no probability)")
        if torch.isneginf(logits).all(dim=-1).any():
            raise ConfigError("some context of the Tabular logits has every next token at -inf")
        self.order = order
        self.vocab_size = vocab_size
        if trainable:
            self.logits = nn.Parameter(logits.clone())
        else:
            self.register_buffer("logits", logits.clone())

    def _check(self, tokens: torch.Tensor) -> None:
        if tokens.ndim != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise MalformedSequenceError(
                f"tokens must be a LongTensor [B, T], got {tuple(tokens.shape)} {tokens.dtype}"
            )
        if tokens.numel() and not ids_are_checked() and not _in_range(tokens, self.vocab_size):
            raise UnknownTokenError(f"token ids must lie in [0, {self.vocab_size})")

    @per_token
    def forward(self, tokens: torch.Tensor, cache: TabularCache | None = None,
                valid: torch.Tensor | None = None):
        """``tokens [B, T]`` -> ``(logits [B, T, V], cache)``.

        ``valid`` (bool ``[B, T]``, optional): invalid tokens are not read, the context of their row
        does not change, and their logits are those of the unchanged context. A row of SMC that
        waits at a segment boundary feeds a dummy token with ``valid=False`` (ragged batches in
        lockstep).
        """
        self._check(tokens)
        if valid is not None:
            return self._forward_valid(tokens, cache, valid)
        B, T = tokens.shape
        k = self.order - 1
        if cache is None:
            ctx = torch.full((B, k), BOS_ID, dtype=torch.long, device=tokens.device)
            length = 0
        else:
            if cache.batch_size != B:
                raise MalformedSequenceError(f"cache holds {cache.batch_size} rows but tokens have {B}")
            ctx, length = cache.context, cache.length
        full = torch.cat([ctx, tokens.long()], dim=1)  # [B, k + T]
        if k == 0:
            logits = self.logits.expand(B, T, self.vocab_size)
        else:
            idx = full.unfold(1, k, 1)[:, 1:]  # windows ending at each new token: [B, T, k]
            logits = self.logits[tuple(idx.unbind(-1))]
        return logits, TabularCache(full[:, full.shape[1] - k :], length + T)

    def _forward_valid(self, tokens: torch.Tensor, cache: TabularCache | None, valid: torch.Tensor):
        B, T = tokens.shape
        if valid.shape != tokens.shape:
            raise MalformedSequenceError(f"valid has shape {tuple(valid.shape)}, tokens {tuple(tokens.shape)}")
        k = self.order - 1
        if cache is None:
            ctx = torch.full((B, k), BOS_ID, dtype=torch.long, device=tokens.device)
            length = 0
        else:
            ctx, length = cache.context, cache.length
        if k > 0 and T == 1:  # one token per row (decoding): no loop, no stack
            shifted = torch.cat([ctx[:, 1:], tokens.long()], dim=1) if k > 1 else tokens.long()
            ctx = torch.where(valid, shifted, ctx)
            return self.logits[tuple(ctx.unbind(-1))][:, None], TabularCache(ctx, length + 1)
        if k == 1:  # bigram: the context at i is the last valid token up to i (one cummax, no loop)
            pos = torch.arange(T, device=tokens.device).expand(B, T)
            last = torch.where(valid, pos, torch.full_like(pos, -1)).cummax(1).values
            prev = torch.where(last >= 0, tokens.long().gather(1, last.clamp(min=0)), ctx)
            return self.logits[prev], TabularCache(prev[:, -1:], length + T)
        out = []
        for i in range(T):
            if k > 0:
                shifted = torch.cat([ctx[:, 1:], tokens[:, i : i + 1].long()], dim=1)
                ctx = torch.where(valid[:, i : i + 1], shifted, ctx)
                out.append(self.logits[tuple(ctx.unbind(-1))])
            else:
                out.append(self.logits.expand(B, self.vocab_size))
        return torch.stack(out, 1), TabularCache(ctx, length + T)


def _in_range(tokens: torch.Tensor, vocab_size: int) -> bool:
    lo, hi = torch.aminmax(tokens)
    return bool((lo >= 0) & (hi < vocab_size))  # one host sync
