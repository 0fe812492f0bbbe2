"""A small causal Transformer with a KV cache, meant to be read in one sitting (ARCHITECTURE.md, "lm/").

    tokens -> embedding -> n_layers x Block -> RMSNorm -> LM head (tied to the embedding) -> logits

    Block:  x = x + SelfAttention(RMSNorm(x))            causal, RoPE on q/k, optional sliding window
            x = x + CrossAttention(RMSNorm(x), z_l)      only with cross_attention=True (LTM, Sec 2.1)
            x = x + SwiGLU(RMSNorm(x))

``forward(tokens [B, T], cache=None, latents=None, valid=None) -> (logits [B, T, V], cache)`` follows
the LM protocol of ``ppl_thought.lm.base``: the logits after position i are the next-token logits
f(x_{<=i}), and passing the returned cache back continues the same rows at position ``cache.length``.

Ragged rows (``valid`` bool ``[B, T]``): a token with ``valid=False`` is a placeholder. No later query
attends to it, it does not advance its row's RoPE position, and its own logits are unspecified, so
each row computes exactly what it would on its valid tokens alone (SMC particles waiting at a segment
boundary, :class:`~ppl_thought.distributions.lm_state.LMState`). The cache then keeps a per-row
key-validity mask and per-row
positions; attention uses an explicit boolean mask. Not supported with a sliding window.

Sliding window (``window=k``): position i attends to positions i-k+1 .. i in every layer, so the
cache keeps only the last k-1 keys/values per layer. Stacking L such layers gives a receptive field
of L(k-1)+1 tokens (``Transformer.receptive_field``); only a one-layer model sees exactly k tokens.

Cross-attention (Latent Thought Models, Sec 2.1): layer l reads a set of latent vectors z_l
(keys and values from z_l, queries from the token stream, no RoPE), so
p(x | z) = prod_n p(x_n | z, x_{<n}) (eq. 1). Gradients flow to the latents.

Speed: under ``torch.no_grad()`` / ``torch.inference_mode()`` the cache preallocates its buffers and
appends in place (at least doubling capacity, with room for 64 more positions, when full; a gathered
cache has room for 64 more; a window cache compacts to its last k-1 entries when
full), and it keeps the projected keys/values of the latents. With gradients enabled it is purely
functional (``torch.cat``), so autograd never sees an in-place write.
"""

from __future__ import annotations

import math
import operator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ppl_thought.errors import MalformedSequenceError
from ppl_thought.lm.base import TOKEN_DTYPES, check_token_ids, describe, one_token

# ---------------------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------------------


def ragged_rows(cache: KVCache, valid: torch.Tensor | None, B: int, T: int, device):
    """Positions and attention mask of ``T`` new tokens after ``cache`` when some token (new or cached) is
    invalid, and the cache's per-row state after them.

    Returns ``(positions [B, T], mask [B, 1, T, n_cached + T], (key_valid [B, n_cached + T], next [B]))``:
    a token's position is the number of valid tokens of its row before it; the mask (True = attend)
    allows the causal keys that are valid, plus each query's own key (so an invalid query still attends
    to something: its output is finite, if meaningless); ``next`` is each row's next position. Shared by
    :class:`Transformer` and :class:`~ppl_thought.lm.huggingface.HuggingFace`.
    """
    n = cache.num_cached
    if valid is None:
        valid = torch.ones(B, T, dtype=torch.bool, device=device)
    old_valid = cache.key_valid
    if old_valid is None:
        old_valid = torch.ones(B, n, dtype=torch.bool, device=device)
    pos0 = cache.positions
    if pos0 is None:
        pos0 = torch.full((B,), cache.length, dtype=torch.long, device=device)
    counts = valid.long().cumsum(1)
    positions = pos0[:, None] + counts - valid.long()  # [B, T]: valid tokens before this one
    key_valid = torch.cat([old_valid, valid], dim=1)  # [B, n + T]
    q = torch.arange(n, n + T, device=device)[:, None]
    k = torch.arange(n + T, device=device)[None, :]
    mask = (k <= q) & (key_valid[:, None, :] | (k == q))  # [B, T, n + T]
    return positions, mask[:, None], (key_valid, pos0 + valid.sum(1))


def check_positions(cache: KVCache | None, valid: torch.Tensor | None, T: int, limit: int, what: str) -> None:
    """Every row's positions stay below ``limit`` after ``T`` new tokens. Tokens with ``valid=False`` (padding of
    ragged rows) take cache slots but no position, so the bound is on each row's valid tokens, not on the slots;
    the per-row count (one host sync) is only read when the slots exceed ``limit``. ``what`` names the limit."""
    length = cache.length if cache is not None else 0
    if length + T <= limit:
        return
    if valid is None and (cache is None or cache.positions is None):
        raise MalformedSequenceError(f"{length} cached + {T} new positions exceed {what}={limit}")
    pos0 = cache.positions if cache is not None and cache.positions is not None else length
    real = int((pos0 + (valid.sum(1) if valid is not None else T)).max())
    if real > limit:
        raise MalformedSequenceError(f"a row of {real} positions (cached and new, padding not counted) "
                                     f"exceeds {what}={limit}")


class _Storage:
    """Key/value buffers ``[B, H, capacity, Dh]`` per layer, shared by the caches that read them.

    ``filled`` is the end of the furthest write. Entries before it are never written again, so a cache
    may append in place only when its own end is ``filled``; a cache branching from an earlier point
    (two continuations of one prefix) copies instead of overwriting its sibling's entries.
    ``filled=None`` marks buffers without spare room, extended by ``torch.cat`` (with gradients).
    """

    __slots__ = ("keys", "values", "filled")

    def __init__(self, keys: list, values: list, filled: int | None):
        self.keys, self.values, self.filled = keys, values, filled

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


class KVCache:
    """The keys and values of every self-attention layer for a batch of rows (LM protocol, lm/base.py).

    ``keys[l]`` / ``values[l]`` are ``[B, H, T_cached, Dh]`` (RoPE already applied to the keys).
    ``length`` counts every position consumed, also those a window cache no longer keeps
    (``T_cached = min(length, window - 1)`` then). The cache also keeps the projected latents of the
    cross-attention layers when computed without gradients, and reuses them while the same latents
    tensor is passed back.

    Caches are values: ``forward`` never changes the cache it is given, so one prefix may be
    continued several ways. ``reorder`` and ``expand`` return new caches.

    After a ``valid`` mask with a False entry, ``key_valid`` (bool ``[B, T_cached]``) says which cached
    keys may be attended to and ``positions`` (long ``[B]``) is each row's next RoPE position (its
    number of valid tokens); both are None while every token was valid (all rows at ``length``).
    """

    #: Append in place into preallocated buffers when gradients are off. ``False`` makes every
    #: append a ``torch.cat`` (for benchmarks and debugging).
    preallocate: bool = True

    def __init__(self, storage: _Storage, start: int, end: int, length: int, window: int | None):
        self._storage = storage
        self._start, self._end = start, end  # the valid entries are buffer[:, :, start:end]
        self.length = length
        self.window = window
        self._cross = None  # per layer (k, v) of the latents, or None
        self._latents = None  # the tensor _cross was computed from
        self._latents_version = None
        self.key_valid: torch.Tensor | None = None  # [B, T_cached] bool, None while all valid
        self.positions: torch.Tensor | None = None  # [B] long, None while every row is at ``length``

    @property
    def ragged(self) -> bool:
        """Whether some cached token was invalid (rows may sit at different positions)."""
        return self.key_valid is not None

    def _with_rows(self, key_valid: torch.Tensor | None, positions: torch.Tensor | None) -> KVCache:
        self.key_valid, self.positions = key_valid, positions
        return self

    @classmethod
    def _empty(cls, n_layers: int, window: int | None) -> KVCache:
        return cls(_Storage([None] * n_layers, [None] * n_layers, None), 0, 0, 0, window)

    # -- reading --------------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self._storage.keys[0].shape[0]

    @property
    def num_layers(self) -> int:
        return len(self._storage.keys)

    @property
    def num_cached(self) -> int:
        """Positions whose keys/values are kept (``min(length, window - 1)`` for a window cache)."""
        return self._end - self._start

    @property
    def keys(self) -> tuple[torch.Tensor, ...]:
        """Per layer ``[B, H, T_cached, Dh]``."""
        return tuple(k[:, :, self._start:self._end] for k in self._storage.keys)

    @property
    def values(self) -> tuple[torch.Tensor, ...]:
        """Per layer ``[B, H, T_cached, Dh]``."""
        return tuple(v[:, :, self._start:self._end] for v in self._storage.values)

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, num_layers={self.num_layers}, length={self.length}, "
                f"num_cached={self.num_cached}, window={self.window})")

    # -- rows: SMC resampling and prompt sharing ------------------------------------------------------

    def reorder(self, index: torch.Tensor) -> KVCache:
        """Row ``i`` of the result is row ``index[i]`` of this cache (``index_select`` on the batch)."""
        index = torch.as_tensor(index, device=self._storage.keys[0].device)
        if index.ndim != 1 or index.dtype not in TOKEN_DTYPES:
            raise MalformedSequenceError(f"reorder needs a 1-D integer index, got {describe(index)}")
        return self._gather(index)

    def expand(self, n: int) -> KVCache:
        """Each row repeated ``n`` times (``repeat_interleave``): rows ``i*n .. i*n+n-1`` are row i."""
        n = operator.index(n)
        if n < 1:
            raise ValueError(f"expand needs n >= 1, got {n}")
        device = self._storage.keys[0].device
        return self._gather(torch.arange(self.batch_size, device=device).repeat_interleave(n))

    def _gather(self, index: torch.Tensor) -> KVCache:
        old = self._storage
        n = self.num_cached
        # keep the room left for appends, and make some where there is none (a prompt's cache expanded to
        # n particles): memory that is never written costs nothing on CPU, a reallocation copies everything
        capacity = max(old.capacity - self._start, n + (_ROOM if self.window is None else 0))
        keys, values = [], []
        for buffers, out in ((old.keys, keys), (old.values, values)):
            for buf in buffers:
                if torch.is_grad_enabled() and buf.requires_grad:  # stay on the autograd graph
                    out.append(buf[:, :, self._start:self._end].index_select(0, index))
                    continue
                new = buf.new_empty((len(index), buf.shape[1], capacity, buf.shape[3]))
                torch.index_select(buf[:, :, self._start:self._end], 0, index, out=new[:, :, :n])
                out.append(new)
        # The cached latent projections belong to the old rows: drop them; the caller passes the
        # reordered latents next time.
        out = KVCache(_Storage(keys, values, n), 0, n, self.length, self.window)
        if self.ragged:
            out._with_rows(self.key_valid.index_select(0, index), self.positions.index_select(0, index))
        return out

    # -- writing (used by Transformer.forward) --------------------------------------------------------

    def _append(self, n: int, capacity_limit: int) -> KVCache:
        """A successor cache ready to receive ``n`` new entries per layer through ``_store``."""
        old, kept = self._storage, self.num_cached
        fresh = old.keys[0] is None
        if fresh or torch.is_grad_enabled() or not self.preallocate:
            # Functional: _store concatenates onto views of the old entries.
            keys = [None] * self.num_layers if fresh else list(self.keys)
            values = [None] * self.num_layers if fresh else list(self.values)
            new = KVCache(_Storage(keys, values, None), 0, kept + n, self.length, self.window)
            return new._with_rows(self.key_valid, self.positions)
        if old.filled == self._end and self._end + n <= old.capacity and _writable(old.keys[0]):
            old.filled = self._end + n  # in place: this cache is the only one that reaches the frontier
            new = KVCache(old, self._start, self._end + n, self.length, self.window)
            return new._with_rows(self.key_valid, self.positions)
        # Reallocate (full, branched from, or built with gradients): copy the kept entries to the front
        # of a buffer with room to grow. A window cache keeps <= window-1 entries, so this compacts it.
        room = _ROOM if self.window is None else 0  # a window cache stays within 2 (window - 1) + n
        capacity = min(max(2 * (kept + n), kept + n + room), max(capacity_limit, kept + n))
        keys, values = [], []
        for buffers, out in ((old.keys, keys), (old.values, values)):
            for buf in buffers:
                new = buf.new_empty((buf.shape[0], buf.shape[1], capacity, buf.shape[3]))
                new[:, :, :kept] = buf[:, :, self._start:self._end]
                out.append(new)
        new = KVCache(_Storage(keys, values, kept + n), 0, kept + n, self.length, self.window)
        return new._with_rows(self.key_valid, self.positions)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's ``k, v`` ``[B, H, n, Dh]`` of one layer; return all the keys/values it may see."""
        s = self._storage
        if s.filled is None:  # functional
            s.keys[layer] = k if s.keys[layer] is None else torch.cat([s.keys[layer], k], dim=2)
            s.values[layer] = v if s.values[layer] is None else torch.cat([s.values[layer], v], dim=2)
            return s.keys[layer], s.values[layer]
        n = k.shape[2]
        s.keys[layer][:, :, self._end - n:self._end] = k
        s.values[layer][:, :, self._end - n:self._end] = v
        return s.keys[layer][:, :, self._start:self._end], s.values[layer][:, :, self._start:self._end]

    def _finish(self, n: int, cross: list | None, latents: torch.Tensor | None) -> KVCache:
        """After the forward pass: count the new positions and forget entries outside the window."""
        self.length += n
        if self.window is not None:
            self._start = max(self._start, self._end - (self.window - 1))
        if cross is not None and not torch.is_grad_enabled():
            self._cross, self._latents, self._latents_version = cross, latents, latents._version
        return self


# ---------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_tables(head_dim: int, max_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * base^(-2i/head_dim), each ``[max_len, head_dim // 2]`` (RoFormer)."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x_i, x_{i + Dh/2}) of ``x [B, H, T, Dh]`` by the angles of its positions."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with RoPE; new keys/values go through the cache."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, cos, sin, mask, causal, cache: KVCache, layer: int) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cache._store(layer, k, v)  # [B, H, T_cached + T, Dh]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class CrossAttention(nn.Module):
    """Queries from the tokens, keys and values from latent vectors z_l (LTM Sec 2.1); no RoPE, no mask."""

    def __init__(self, d_model: int, n_heads: int, d_latent: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.kv = nn.Linear(d_latent, 2 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def project(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``z [B, N_z, d_latent]`` -> keys, values ``[B, H, N_z, Dh]``."""
        B, N, _ = z.shape
        k, v = self.kv(z).view(B, N, 2, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: self-attention, (cross-attention), MLP."""

    def __init__(self, index: int, d_model: int, n_heads: int, d_ff: int, dropout: float,
                 d_latent: int | None):
        super().__init__()
        self.index = index
        self.attn_norm = RMSNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, dropout)
        if d_latent is not None:
            self.cross_norm = RMSNorm(d_model)
            self.cross = CrossAttention(d_model, n_heads, d_latent, dropout)
        else:
            self.cross = None
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, d_ff)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, cos, sin, mask, causal, cache: KVCache, latent_kv) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin, mask, causal, cache, self.index))
        if self.cross is not None:
            x = x + self.drop(self.cross(self.cross_norm(x), *latent_kv))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    """Causal decoder LM: RoPE, pre-norm RMSNorm, SwiGLU, tied embeddings, optional window and latents.

    Args:
        vocab_size: number of token ids; ids lie in ``[0, vocab_size)``.
        d_model, n_layers, n_heads: width, depth, heads (``d_model / n_heads`` must be even, for RoPE).
        d_ff: hidden width of the SwiGLU MLP; default 8/3 d_model rounded up to a multiple of 8.
        max_len: the most positions a row may have (RoPE tables are precomputed up to it).
        window: if set to k, sliding-window attention over the last k positions (LTM Sec 2.1).
        cross_attention: add a cross-attention block per layer reading ``latents``.
        d_latent: width of the latent vectors (default ``d_model``).
        rope_base: RoPE frequency base.
        dropout: on attention weights and residual branches (training only).
        tie_embeddings: the LM head is the embedding matrix.
    """

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 d_ff: int | None = None, max_len: int = 2048, window: int | None = None,
                 cross_attention: bool = False, d_latent: int | None = None, rope_base: float = 10000.0,
                 dropout: float = 0.0, tie_embeddings: bool = True):
        super().__init__()
        if vocab_size < 1 or d_model < 1 or n_layers < 1 or n_heads < 1 or max_len < 1:
            raise ValueError("vocab_size, d_model, n_layers, n_heads and max_len must be positive")
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(f"d_model / n_heads must be an even integer (RoPE), got {d_model} / {n_heads}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if d_latent is not None and not cross_attention:
            raise ValueError("d_latent is only used with cross_attention=True")
        self.vocab_size = vocab_size
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.d_ff = d_ff if d_ff is not None else 8 * math.ceil(8 * d_model / 3 / 8)
        self.max_len, self.window, self.rope_base = max_len, window, float(rope_base)
        self.cross_attention = bool(cross_attention)
        self.d_latent = (d_latent or d_model) if cross_attention else None
        self.dropout, self.tie_embeddings = float(dropout), bool(tie_embeddings)

        self.embed = nn.Embedding(vocab_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(i, d_model, n_heads, self.d_ff, dropout, self.d_latent)
                                    for i in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(d_model // n_heads, max_len, self.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(number of branches)."""
        branches = self.n_layers * (3 if self.cross_attention else 2)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 0.02 / math.sqrt(branches) if name.endswith(("out.weight", "down.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)

    @property
    def receptive_field(self) -> int | None:
        """How many tokens (the current one included) the logits can depend on: n_layers*(window-1)+1."""
        return None if self.window is None else self.n_layers * (self.window - 1) + 1

    @property
    def valid_mask_supported(self) -> bool:
        """Whether ``forward`` accepts ``valid`` masks with False entries (only without a window).

        SMC's ``Stepper`` reads this to pick the cached "valid" mode or the exact "recompute" mode.
        """
        return self.window is None

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (tied weights counted once)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embeddings else n

    # -- forward --------------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, latents: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache]:
        """Next-token logits ``[B, T, vocab_size]`` after each position, and the cache to continue.

        Args:
            tokens: LongTensor ``[B, T]``; with ``cache`` they are positions ``cache.length ..``.
            cache: a ``KVCache`` returned by this model for the same rows (left unchanged).
            latents: with ``cross_attention=True``, ``[B, n_layers, N_z, d_latent]`` (layer l reads
                ``latents[:, l]``) or ``[B, N_z, d_latent]`` (shared by all layers); B may be 1.
            valid: optional bool ``[B, T]``. A token with ``valid=False`` is skipped by its row: no later
                query attends to it and it does not advance the row's RoPE position; its logits are
                unspecified. ``None`` (or all True) is the ordinary dense path. Needs ``window=None``.
        """
        B, T = self._check(tokens, cache)
        valid = self._check_valid(valid, B, T, tokens.device)
        check_positions(cache, valid, T, self.max_len, "max_len")
        latent_kv = self._latent_kv(latents, B, cache)
        if cache is None:
            cache = KVCache._empty(self.n_layers, self.window)
        start = cache.length
        if valid is None and not cache.ragged:
            mask, causal = self._attention_mask(cache.num_cached, start, T, tokens.device)
            cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
            rows = None
        else:
            mask, causal, cos, sin, rows = self._ragged_attention(cache, valid, B, T, tokens.device)

        new = cache._append(T, self.max_len)
        x = self.drop(self.embed(tokens))
        for block in self.blocks:
            x = block(x, cos, sin, mask, causal, new, None if latent_kv is None else latent_kv[block.index])
        logits = self.lm_head(self.norm(x))
        new = new._finish(T, latent_kv, latents)
        return logits, (new if rows is None else new._with_rows(*rows))

    def step(self, tokens: torch.Tensor, cache: KVCache | None = None, latents: torch.Tensor | None = None,
             valid: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache]:
        """One incremental step: ``tokens [B]`` (``valid [B]`` optional) -> ``(logits [B, vocab_size], cache)``."""
        tokens, valid = one_token(tokens, valid)
        logits, cache = self(tokens, cache, latents, valid=valid)
        return logits[:, 0], cache

    def _check_valid(self, valid, B: int, T: int, device) -> torch.Tensor | None:
        """``valid`` as a bool ``[B, T]`` tensor, or None when absent or all True (the dense path)."""
        if valid is None:
            return None
        valid = torch.as_tensor(valid, device=device)
        if valid.dtype != torch.bool or valid.shape != (B, T):
            raise MalformedSequenceError(f"valid must be a bool tensor [B, T] = [{B}, {T}], got {describe(valid)}")
        if bool(valid.all()):
            return None
        if self.window is not None:
            raise NotImplementedError(
                f"valid=False tokens are not supported with a sliding window (window={self.window}): "
                "ragged rows under a window are future work; use window=None, or recompute each row")
        return valid

    def _ragged_attention(self, cache: KVCache, valid: torch.Tensor | None, B: int, T: int, device):
        """Mask, RoPE tables and new per-row state when some token (new or cached) is invalid
        (:func:`ragged_rows`); RoPE uses each row's own positions, ``[B, 1, T, Dh/2]`` tables."""
        positions, mask, rows = ragged_rows(cache, valid, B, T, device)
        # an invalid token sits at its row's next position, which may be max_len for a full row (never read)
        positions = positions.clamp(max=self.max_len - 1)
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        return mask, False, cos, sin, rows

    def _attention_mask(self, n_cached: int, start: int, T: int, device) -> tuple[torch.Tensor | None, bool]:
        """Boolean mask ``[T, n_cached + T]`` (True = attend), or None with is_causal, or None alone.

        Keys cover positions ``start - n_cached .. start + T - 1``; queries ``start .. start + T - 1``.
        """
        if T == 1:  # one query may see every key it is given: the cache holds only its window
            return None, False
        if n_cached == 0 and (self.window is None or T <= self.window):
            return None, True
        q = torch.arange(start, start + T, device=device)[:, None]
        k = torch.arange(start - n_cached, start + T, device=device)[None, :]
        allowed = k <= q
        if self.window is not None:
            allowed &= k > q - self.window
        return allowed, False

    def _check(self, tokens: torch.Tensor, cache: KVCache | None) -> tuple[int, int]:
        B, T = check_token_ids(tokens, self.vocab_size)
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise MalformedSequenceError(f"cache must be a KVCache, got {type(cache).__name__}")
            if cache.num_layers != self.n_layers or cache.window != self.window:
                raise MalformedSequenceError(f"{cache} was not made by this model (n_layers={self.n_layers}, "
                                             f"window={self.window})")
            if cache.batch_size != B:
                raise MalformedSequenceError(f"cache holds {cache.batch_size} rows but tokens have {B}")
        return B, T

    def _latent_kv(self, latents: torch.Tensor | None, B: int, cache: KVCache | None) -> list | None:
        """Per layer (keys, values) ``[B, H, N_z, Dh]`` of the latents, or None without cross-attention."""
        if not self.cross_attention:
            if latents is not None:
                raise MalformedSequenceError("latents given to a Transformer without cross_attention")
            return None
        L, d = self.n_layers, self.d_latent
        expected = f"[B, {L}, N_z, {d}] or [B, N_z, {d}]"
        if latents is None:
            raise MalformedSequenceError(f"cross_attention=True needs latents {expected}")
        if (cache is not None and cache._latents is latents and cache._latents_version == latents._version
                and not torch.is_grad_enabled()):
            return cache._cross
        if (not isinstance(latents, torch.Tensor) or not latents.is_floating_point()
                or latents.ndim not in (3, 4) or latents.shape[-1] != d or latents.shape[-2] < 1
                or (latents.ndim == 4 and latents.shape[1] != L) or latents.shape[0] not in (1, B)):
            raise MalformedSequenceError(f"latents must be a float tensor {expected} with B={B} (or 1), "
                                         f"got {describe(latents)}")
        out = []
        for block in self.blocks:
            z = latents[:, block.index] if latents.ndim == 4 else latents
            k, v = block.cross.project(z)
            out.append((k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)))
        return out

    # -- checkpoints ----------------------------------------------------------------------------------

    def config(self) -> dict:
        """The constructor arguments, JSON-serialisable: ``Transformer(**model.config())`` rebuilds it."""
        return {"vocab_size": self.vocab_size, "d_model": self.d_model, "n_layers": self.n_layers,
                "n_heads": self.n_heads, "d_ff": self.d_ff, "max_len": self.max_len, "window": self.window,
                "cross_attention": self.cross_attention, "d_latent": self.d_latent,
                "rope_base": self.rope_base, "dropout": self.dropout, "tie_embeddings": self.tie_embeddings}

    def save(self, path: str | Path, extra: dict | None = None, vocab=None) -> Path:
        """Write a checkpoint directory (safetensors + JSON config, atomically; see ``ppl_thought.io``).

        ``vocab`` (a :class:`~ppl_thought.vocab.Vocab` of ``vocab_size`` ids) is saved with the model, so
        that its ids can be read back as tokens: ``Transformer.load_vocab(path)``."""
        from ppl_thought.errors import VocabularyError
        from ppl_thought.io import save_checkpoint

        config = {"class": "Transformer", **self.config()}
        if vocab is not None:
            if len(vocab) != self.vocab_size:
                raise VocabularyError(f"the vocabulary has {len(vocab)} ids, the model {self.vocab_size}")
            config["vocab"] = vocab.to_dict()
        return save_checkpoint(path, self, config, extra)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> Transformer:
        """Rebuild a model written by ``save`` (no pickle).

        A config that does not describe the saved tensors (keys that are no constructor argument, sizes that
        are not positive integers, another depth, width or tensor shape than saved) raises
        :class:`~ppl_thought.errors.CheckpointError` naming it, checked before anything is allocated
        (:func:`ppl_thought.checkpoint.check_transformer_config`).
        """
        from ppl_thought.checkpoint import check_transformer_config
        from ppl_thought.errors import CheckpointError
        from ppl_thought.io import load_checkpoint

        state, config, _ = load_checkpoint(path, device=device)
        # the torch-free check shared with ptn.lm.Transformer.load (one home for the format)
        config = check_transformer_config(path, config, {k: tuple(v.shape) for k, v in state.items()})
        try:
            model = cls(**config).to(device)
        except (TypeError, ValueError, RuntimeError, MemoryError) as e:  # e.g. RoPE tables for an absurd max_len
            raise CheckpointError(f"{path}: the config cannot build a Transformer here: {e}"[:500]) from None
        model.load_state_dict(state)
        return model

    @staticmethod
    def load_vocab(path: str | Path):
        """The :class:`~ppl_thought.vocab.Vocab` saved with a model (``save(..., vocab=...)``), or None."""
        from ppl_thought.io import load_checkpoint
        from ppl_thought.vocab import Vocab

        _, config, _ = load_checkpoint(path)
        return Vocab.from_dict(config["vocab"]) if "vocab" in config else None


#: positions of spare room a preallocated (non-window) cache buffer gets at least when it is (re)allocated
_ROOM = 64


def _writable(buffer: torch.Tensor) -> bool:
    """May we write into this buffer without disturbing autograd or inference mode?"""
    return not buffer.requires_grad and (torch.is_inference_mode_enabled() or not buffer.is_inference())


