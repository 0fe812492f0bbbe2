"""A small causal Transformer with a KV cache, meant to be read in one sitting (docs/architecture.md, "The layers").

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

The KV cache (reused across steps, reordered on resampling, preallocated without gradients) is
:class:`~ppl_thought.lm.kv_cache.KVCache`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ppl_thought import checks
from ppl_thought.checkpoint import check_finite, check_float_dtypes
from ppl_thought.errors import CheckpointError, ConfigError, MalformedSequenceError, VocabularyError
from ppl_thought.io import load_checkpoint_raw, nonfinite_names, save_checkpoint
from ppl_thought.lm.base import check_token_ids, describe, one_token
from ppl_thought.lm.kv_cache import KVCache, check_positions, ragged_rows
from ppl_thought.resources import check_transformer
from ppl_thought.schemas import TRANSFORMER
from ppl_thought.transformer_checkpoint import check_transformer_config, saved_transformer_vocab
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import Vocab

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
        k, v = cache.store(layer, k, v)  # [B, H, T_cached + T, Dh]
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


@checked
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
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                            ("n_heads", n_heads), ("max_len", max_len)):
            checks.integer(f"Transformer: {name}", value)
        checks.optional_integer("Transformer: d_ff", d_ff)
        checks.optional_integer("Transformer: window", window)
        checks.optional_integer("Transformer: d_latent", d_latent)
        checks.real("Transformer: rope_base", rope_base, 0.0, open_min=True)
        checks.real("Transformer: dropout", dropout, 0.0, 1.0, open_max=True)
        if vocab_size < 1 or d_model < 1 or n_layers < 1 or n_heads < 1 or max_len < 1:
            raise ConfigError("vocab_size, d_model, n_layers, n_heads and max_len must be positive")
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ConfigError(f"d_model / n_heads must be an even integer (RoPE), got {d_model} / {n_heads}")
        if window is not None and window < 1:
            raise ConfigError(f"window must be >= 1, got {window}")
        if d_latent is not None and not cross_attention:
            raise ConfigError("d_latent is only used with cross_attention=True")
        self.vocab_size = vocab_size
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.d_ff = d_ff if d_ff is not None else 8 * math.ceil(8 * d_model / 3 / 8)
        self.max_len, self.window, self.rope_base = max_len, window, float(rope_base)
        self.cross_attention = bool(cross_attention)
        self.d_latent = (d_latent or d_model) if cross_attention else None
        self.dropout, self.tie_embeddings = float(dropout), bool(tie_embeddings)
        check_transformer("Transformer", self.config())  # up front: never the allocator's error (resources.py)
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

    @per_token
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
            cache = KVCache.empty(self.n_layers, self.window)
        start = cache.length
        if valid is None and not cache.ragged:
            mask, causal = self._attention_mask(cache.num_cached, start, T, tokens.device)
            cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
            rows = None
        else:
            mask, causal, cos, sin, rows = self._ragged_attention(cache, valid, B, T, tokens.device)

        new = cache.append(T, self.max_len)
        x = self.drop(self.embed(tokens))
        for block in self.blocks:
            x = block(x, cos, sin, mask, causal, new, None if latent_kv is None else latent_kv[block.index])
        logits = self.lm_head(self.norm(x))
        new = new.finish(T, latent_kv, latents)
        return logits, (new if rows is None else new.with_rows(*rows))

    @per_token
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
        if cache is not None and (kept := cache.latent_projections(latents)) is not None:
            return kept
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

    def save(self, path: str | Path, extra: dict | None = None, vocab: Vocab | None = None) -> Path:
        """Write a checkpoint directory (safetensors + JSON config, atomically; see ``ppl_thought.io``).

        ``vocab`` (a :class:`~ppl_thought.vocab.Vocab` of ``vocab_size`` ids) is saved with the model, so
        that its ids can be read back as tokens: ``Transformer.load_vocab(path)``."""

        config = {"class": "Transformer", "format": TRANSFORMER.version, **self.config()}
        if vocab is not None:
            if len(vocab) != self.vocab_size:
                raise VocabularyError(f"the vocabulary has {len(vocab)} ids, the model {self.vocab_size}")
            config["vocab"] = vocab.to_dict()
        return save_checkpoint(path, self, config, extra)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", *,
             allow_nonfinite: bool = False) -> Transformer:
        """Rebuild a model written by ``save`` (no pickle), in eval mode.

        The files are not trusted (:func:`ppl_thought.checkpoint.read_checkpoint`): a config that does not
        describe the saved tensors (keys that are no constructor argument, sizes that are not positive
        integers, another depth, width or tensor shape than saved, a saved vocabulary of another size), tied
        weights other than the LM head of a ``tie_embeddings`` model, weights stored as another type than a
        float, and weights holding NaN or inf (unless ``allow_nonfinite=True``, for debugging) raise
        :class:`~ppl_thought.errors.CheckpointError` naming it, checked before the model is built
        (:func:`ppl_thought.transformer_checkpoint.check_transformer_config`).
        """

        state, raw = load_checkpoint_raw(path, device=device)
        # the torch-free check shared with ptn.lm.Transformer.load (one home for the format)
        config = check_transformer_config(path, raw.header["config"], raw.shapes, raw.aliases)
        check_float_dtypes(path, raw.dtypes)
        check_finite(path, nonfinite_names(state), allow_nonfinite)
        try:
            model = cls(**config).to(device)
        except (TypeError, ValueError, RuntimeError, MemoryError) as e:  # e.g. RoPE tables for an absurd max_len
            raise CheckpointError(f"{path}: the config cannot build a Transformer here: {e}"[:500]) from None
        model.load_state_dict(state)
        return model.eval()

    @staticmethod
    def load_vocab(path: str | Path):
        """The :class:`~ppl_thought.vocab.Vocab` saved with a model (``save(..., vocab=...)``), or None."""

        vocab = saved_transformer_vocab(path)
        return None if vocab is None else Vocab.from_dict(vocab)


#: positions of spare room a preallocated (non-window) cache buffer gets at least when it is (re)allocated
