"""The gated LM of App. L: an LM finetuned into an explanatory sampler without forgetting how to be P_f.

:class:`GatedLM` wraps any LM of this package (``forward(tokens, cache=None) -> (logits, cache)``) and mixes
the logits of a slow stream (the whole input ``x <explain> z``) and a fast stream (``z`` alone) with a
learned gate, (L.1)-(L.2). :class:`ppl_thought.guides.Explanatory` decodes with it like with any LM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ppl_thought.errors import MalformedSequenceError
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import BOS_ID, EXPLAIN_ID

__all__ = ["GatedCache", "GatedLM", "gate_mlp"]


@checked
@dataclass
class GatedCache:
    """Caches of the slow stream (full input) and the fast stream (after ``<explain>``)."""

    slow: object
    fast: object | None
    length: int

    @property
    def batch_size(self) -> int:
        return self.slow.batch_size

    @per_token
    def reorder(self, index: torch.Tensor) -> GatedCache:
        return GatedCache(self.slow.reorder(index), self.fast.reorder(index) if self.fast is not None else None,
                          self.length)

    @per_token
    def expand(self, n: int) -> GatedCache:
        return GatedCache(self.slow.expand(n), self.fast.expand(n) if self.fast is not None else None, self.length)


def gate_mlp(d: int) -> nn.Module:
    """The gate MLP of (L.2): 3 layers with SiLU, 2d -> 2d -> 2d -> 2 (logits of p_fast, p_slow), the last
    layer with weight 0 and bias [2, -2], so p_slow = sigmoid(-4) < 0.02 at initialisation."""
    mlp = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.SiLU(), nn.Linear(2 * d, 2 * d), nn.SiLU(), nn.Linear(2 * d, 2))
    nn.init.zeros_(mlp[-1].weight)
    with torch.no_grad():
        mlp[-1].bias.copy_(torch.tensor([2.0, -2.0]))
    return mlp


@checked
class GatedLM(nn.Module):
    """The gating trick of App. L around any LM f, for finetuning it into an explanatory sampler.

    On an input ``<bos> c <explain> z`` the *slow* stream is f on the whole input and the *fast*
    stream is f on ``<bos> z`` (the format without the explanatory context c = x; a mode tag
    right after ``<explain>`` stays in both streams).
    After ``<explain>`` the logits are (L.1)

        p_fast * f_post(fast) + p_slow * f_post(slow),
        [p_fast, p_slow] = softmax(MLP(f_pre(fast) (+) f_pre(slow)))                     (L.2)

    with a 3-layer SiLU MLP (input 2d, hidden 2d, output 2) whose last layer has weight 0 and
    bias [2, -2], so p_slow = sigmoid(-4) < 0.02 at initialisation and the sampler starts as the
    LM reading z alone. f_pre is ``features(tokens)`` if given (the features before the
    unembedding; our LM protocol does not expose them), otherwise the log-softmax of the
    logits (d = vocab_size). Inputs without ``<explain>`` pass through to f unchanged (the LM
    playing P_f). The ``<explain>`` token must sit at the same position in every row.
    """

    def __init__(self, lm: nn.Module, features: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 feature_dim: int | None = None, explain_id: int = EXPLAIN_ID):
        super().__init__()
        self.lm = lm
        self.vocab_size = int(lm.vocab_size)
        self.features = features
        d = int(feature_dim) if feature_dim is not None else self.vocab_size
        self.explain_id = explain_id
        self.gate = gate_mlp(d)

    def _pre(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.features is not None:
            return self.features(tokens)
        return torch.log_softmax(logits.float().masked_fill(torch.isneginf(logits), -1e9), -1)

    def gates(self, pre_fast: torch.Tensor, pre_slow: torch.Tensor) -> torch.Tensor:
        """``[..., 2]`` = (p_fast, p_slow) of (L.2)."""
        return torch.softmax(self.gate(torch.cat([pre_fast, pre_slow], -1)), -1)

    def _mix(self, fast_tokens, fast_logits, slow_tokens, slow_logits):
        g = self.gates(self._pre(fast_tokens, fast_logits), self._pre(slow_tokens, slow_logits))
        pf, ps = g[..., :1], g[..., 1:]
        # (L.1) mixes logits; a -inf logit in either stream stays -inf (never NaN)
        neg = torch.isneginf(fast_logits) | torch.isneginf(slow_logits)
        mixed = pf * fast_logits.masked_fill(neg, 0.0) + ps * slow_logits.masked_fill(neg, 0.0)
        return mixed.masked_fill(neg, float("-inf"))

    @per_token
    def forward(self, tokens: torch.Tensor, cache: GatedCache | None = None):
        B, T = tokens.shape
        slow_logits, slow_cache = self.lm(tokens, cache=cache.slow if cache is not None else None)
        start = cache.length if cache is not None else 0
        if cache is not None and cache.fast is not None:  # the fast stream is running
            fast_logits, fast_cache = self.lm(tokens, cache=cache.fast)
            out = self._mix(tokens, fast_logits, tokens, slow_logits)
            return out, GatedCache(slow_cache, fast_cache, start + T)
        hit = tokens == self.explain_id
        if not hit.any():
            return slow_logits, GatedCache(slow_cache, None, start + T)
        pos = hit.float().argmax(-1)
        if not (pos == pos[0]).all() or not hit.any(-1).all():
            raise MalformedSequenceError("GatedLM: <explain> must sit at the same position in every row")
        e = int(pos[0])
        fast_in = torch.cat([torch.full((B, 1), BOS_ID, dtype=torch.long, device=tokens.device),
                             tokens[:, e + 1:]], 1)
        fast_logits, fast_cache = self.lm(fast_in)
        out = slow_logits.clone()
        out[:, e:] = self._mix(fast_in, fast_logits, tokens[:, e:], slow_logits[:, e:])
        return out, GatedCache(slow_cache, fast_cache, start + T)
