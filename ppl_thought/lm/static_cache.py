"""A preallocated (static) KV cache and single-token decoders over it, for captured decode steps (docs/gpu.md).

A CUDA graph replays fixed kernels on fixed addresses, so a decode step that is captured once may not
allocate, slice by a length that changes, or read a Python number that changes. The dynamic
:class:`~ppl_thought.lm.kv_cache.KVCache` does all three (it appends, grows and returns new caches on
``reorder``). Here everything is fixed from the start:

* :class:`StaticKVCache`: keys/values ``[B, H, max_len + 1, Dh]`` per layer of the library
  :class:`~ppl_thought.lm.transformer.Transformer`, per-row lengths ``[B]`` (a device tensor, advanced
  in place), new entries written with ``scatter_`` at each row's own position, attention through a
  length mask (key j is visible to a query of row b at position p iff j <= p), ``reorder(index)`` an
  in-place ``index_select`` into the same buffers. The last slot takes the writes of ``valid=False``
  tokens (never attended to). Eager code attends over the slots written so far (``span``, a host
  number that needs no sync: every call writes the same number of slots in every row), which gives
  bitwise the logits of the dynamic cache; a captured step attends over the whole buffer
  (``full=True``): the same numbers up to float rounding (the masked keys add exact zeros, but the
  reductions run over more terms in another order).
* :class:`StaticTransformer` and :class:`StaticHuggingFace`: the decoders the captured SMC step uses
  (``ppl_thought/inference/static_smc.py``): ``start(ctx)`` encodes a prompt once through the LM's
  ordinary (dynamic) path and copies its keys/values into every row of the static buffers,
  ``step(tokens [B]) -> logits [B, V]`` (float32 library logits) runs one token on the static cache,
  ``reorder(index)`` gathers rows in place. For a HuggingFace model the buffers are transformers'
  own ``StaticCache`` (``index_copy_`` at a position tensor; rows in lockstep), fed with explicit
  ``position_ids`` and a 4-D attention mask over the whole buffer.

No method reads a tensor back to the host (no ``.item()``, ``bool(tensor)``, ``.tolist()``), so a step
may be captured with ``torch.cuda.CUDAGraph``.
"""

from __future__ import annotations

import torch

from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.lm.base import TOKEN_DTYPES, describe
from ppl_thought.lm.huggingface import HuggingFace
from ppl_thought.lm.kv_cache import KVCache
from ppl_thought.lm.transformer import Transformer
from ppl_thought.vocab import BOS_ID

__all__ = ["StaticKVCache", "StaticTransformer", "StaticHuggingFace", "static_decoder"]


class StaticKVCache:
    """Keys and values of every self-attention layer in fixed buffers ``[B, H, max_len + 1, Dh]``.

    Args:
        keys, values: per layer ``[B, H, max_len + 1, Dh]`` buffers (the last slot is scratch).
        lengths: long ``[B]``: each row's next position (its number of valid tokens).
        span: a host bound on ``lengths`` (slots written so far); eager attention reads ``[0, span)``.

    Build one with :meth:`empty` or :meth:`from_cache` (a prompt encoded by the dynamic path).
    ``reorder`` and the forward writes change it in place; its tensors keep their addresses for its life.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: torch.Tensor, span: int):
        self.keys, self.values, self.lengths = keys, values, lengths
        self.span = int(span)
        #: attend over every slot (a captured step: static shapes) instead of ``[0, span)`` (eager: bitwise
        #: the dynamic cache's numbers)
        self.full = False
        self._write: torch.Tensor | None = None  # [B, 1, T, 1] slot of each new entry, set by ``positions``

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def empty(cls, n_layers: int, batch: int, heads: int, max_len: int, head_dim: int,
              dtype: torch.dtype = torch.float32, device=None) -> StaticKVCache:
        """Zeroed buffers (zeros keep unwritten slots finite: a masked key times 0 is 0, never NaN)."""
        shape = (batch, heads, max_len + 1, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        return cls(keys, values, torch.zeros(batch, dtype=torch.long, device=device), 0)

    @classmethod
    def from_cache(cls, cache: KVCache, batch: int, max_len: int) -> StaticKVCache:
        """A static cache of ``batch`` rows holding a dynamic cache's entries (1 row: repeated to every row)."""
        _, H, _, D = cache.keys[0].shape
        out = cls.empty(cache.num_layers, batch, H, max_len, D, dtype=cache.keys[0].dtype, device=cache.keys[0].device)
        out.load(cache)
        return out

    def load(self, cache: KVCache) -> StaticKVCache:
        """Copy a dynamic cache's entries into these buffers in place (1 row repeated, or one row per row)."""
        if not isinstance(cache, KVCache) or cache.window is not None or cache.ragged:
            raise MalformedSequenceError(f"a static cache loads a dense KVCache without a window, got {cache!r}")
        if cache.num_layers != self.num_layers:
            raise MalformedSequenceError(f"{cache} has {cache.num_layers} layers, the static cache {self.num_layers}")
        n = cache.num_cached
        if n > self.max_len:
            raise MalformedSequenceError(f"{n} cached positions exceed the static cache's max_len={self.max_len}")
        if cache.batch_size not in (1, self.batch_size):
            raise MalformedSequenceError(f"{cache} has {cache.batch_size} rows; the static cache {self.batch_size}")
        for dst, src in zip(self.keys + self.values, cache.keys + cache.values):
            dst[:, :, :n].copy_(src)  # a 1-row cache broadcasts to every row
        self.lengths.fill_(n)
        self.span = n
        return self

    # -- facts ----------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def max_len(self) -> int:
        """The most positions a row may have (the buffers have one scratch slot more)."""
        return self.keys[0].shape[2] - 1

    @property
    def length(self) -> int:
        """Slots written so far in every row (LM cache protocol); per-row lengths are :attr:`lengths`."""
        return self.span

    def __repr__(self) -> str:
        return (f"StaticKVCache(batch_size={self.batch_size}, num_layers={self.num_layers}, max_len={self.max_len}, "
                f"span={self.span}, full={self.full})")

    # -- rows -----------------------------------------------------------------------------------------
    def reorder(self, index: torch.Tensor) -> StaticKVCache:
        """Row ``i`` becomes row ``index[i]``, in place (``index_select`` into the same buffers); returns self."""
        if not isinstance(index, torch.Tensor) or index.ndim != 1 or index.dtype not in TOKEN_DTYPES \
                or index.shape[0] != self.batch_size:
            raise MalformedSequenceError(f"reorder needs a 1-D integer index of {self.batch_size} rows, got "
                                         f"{describe(index)}")
        for buf in self.keys + self.values:
            buf.copy_(buf.index_select(0, index))
        self.lengths.copy_(self.lengths.index_select(0, index))
        return self

    def expand(self, n: int) -> StaticKVCache:
        """A new static cache with each row repeated ``n`` times (rows ``i*n .. i*n+n-1`` are row i)."""
        index = torch.arange(self.batch_size, device=self.lengths.device).repeat_interleave(int(n))
        keys = [k.index_select(0, index) for k in self.keys]
        values = [v.index_select(0, index) for v in self.values]
        return StaticKVCache(keys, values, self.lengths.index_select(0, index), self.span)

    # -- the forward pass (Transformer blocks call ``store``) ----------------------------------------
    def positions(self, T: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[B, T]`` of ``T`` new tokens and the attention mask ``[B, 1, T, K]`` (True = attend),
        K = the slots read; prepares the writes of :meth:`store`. ``valid`` (bool ``[B, T]``): a token with
        False is written to the scratch slot and takes no position (its own output is unspecified)."""
        if self.span + T > self.max_len:
            raise MalformedSequenceError(f"{self.span} cached + {T} new positions exceed the static cache's "
                                         f"max_len={self.max_len}")
        dev = self.lengths.device
        if valid is None:
            pos = self.lengths[:, None] + torch.arange(T, device=dev)[None]
            write = pos
        else:
            counts = valid.long().cumsum(1)
            pos = self.lengths[:, None] + counts - valid.long()
            write = torch.where(valid, pos, torch.full_like(pos, self.max_len))
        K = self.max_len + 1 if self.full else self.span + T
        keys = torch.arange(K, device=dev)
        mask = keys[None, None, :] <= pos[:, :, None]  # [B, T, K]: causal within the row's own positions
        if valid is not None:  # a valid query never sees the scratch slot; an invalid one sees its row (finite)
            mask = mask & (keys < self.max_len)
        self._write = write[:, None, :, None]
        self._valid = valid
        return pos, mask[:, None]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's ``k, v [B, H, T, Dh]`` at each row's positions; return the slots attention reads."""
        index = self._write.expand(k.shape)
        self.keys[layer].scatter_(2, index, k)
        self.values[layer].scatter_(2, index, v)
        K = self.max_len + 1 if self.full else self.span + k.shape[2]
        return self.keys[layer][:, :, :K], self.values[layer][:, :, :K]

    def _advance(self, T: int) -> None:
        """After a forward pass: each row's length grows by its valid tokens (in place)."""
        if self._valid is None:
            self.lengths.add_(T)
        else:
            self.lengths.add_(self._valid.long().sum(1))
        self.span += T
        self._write = self._valid = None


def static_forward(model: Transformer, tokens: torch.Tensor, cache: StaticKVCache,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`Transformer.forward` on a static cache: logits ``[B, T, V]`` after each token; the cache is
    written and advanced in place. Same blocks, RoPE at each row's own positions, the cache's length mask."""
    B, T = tokens.shape
    if cache.batch_size != B:
        raise MalformedSequenceError(f"the static cache holds {cache.batch_size} rows but tokens have {B}")
    pos, mask = cache.positions(T, valid)
    pos = pos.clamp(max=model.max_len - 1)  # a scratch write of a full row sits past the table: never read
    cos, sin = model.rope_cos[pos][:, None], model.rope_sin[pos][:, None]
    x = model.drop(model.embed(tokens))
    for block in model.blocks:
        x = block(x, cos, sin, mask, False, cache, None)
    cache._advance(T)
    return model.lm_head(model.norm(x))


# ---------------------------------------------------------------------------------------------------------
# Decoders: one token per row per step on a static cache
# ---------------------------------------------------------------------------------------------------------


class StaticTransformer:
    """Single-token decoding of ``batch`` rows of a library :class:`Transformer` on a :class:`StaticKVCache`.

    ``start(ctx)`` encodes ``ctx [P]`` (``<bos>`` included) once with the model's ordinary forward (so
    the prompt's logits are the generic path's) and loads its keys/values into every row;
    ``step(tokens [B])`` -> float32 logits ``[B, V]``; ``reorder(index)`` in place. ``full=True`` makes
    attention read the whole buffer (set before capturing a step in a CUDA graph).
    """

    def __init__(self, lm: Transformer, batch: int, max_len: int):
        if not isinstance(lm, Transformer):
            raise ConfigError(f"StaticTransformer needs a pt.lm.Transformer, got {type(lm).__name__}")
        if lm.window is not None or lm.cross_attention:
            raise ConfigError("the static cache supports Transformers without a sliding window or cross-attention "
                              f"(window={lm.window}, cross_attention={lm.cross_attention})")
        if max_len > lm.max_len + 1:  # one position more than the model's: the last token fed is never read
            raise ConfigError(f"a static cache of {max_len} positions exceeds the model's max_len={lm.max_len}")
        self.lm, self.batch, self.max_len = lm, int(batch), int(max_len)
        p = next(iter(lm.parameters()))
        self.cache = StaticKVCache.empty(lm.n_layers, self.batch, lm.n_heads, self.max_len, lm.d_model // lm.n_heads,
                                         dtype=p.dtype, device=p.device)

    @property
    def full(self) -> bool:
        return self.cache.full

    @full.setter
    def full(self, value: bool) -> None:
        self.cache.full = bool(value)

    def start(self, ctx: torch.Tensor) -> torch.Tensor:
        logits, kv = self.lm(ctx[None])
        self.cache.load(kv)
        return logits[:, -1].float().expand(self.batch, -1)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return static_forward(self.lm, tokens[:, None], self.cache)[:, 0].float()

    def reorder(self, index: torch.Tensor) -> None:
        self.cache.reorder(index)

    def rewind(self, length: int) -> None:
        """Forget every entry after ``length`` (host number; no sync): rows restart from a loaded prompt."""
        self.cache.lengths.fill_(length)
        self.cache.span = int(length)


class StaticHuggingFace:
    """Single-token decoding of ``batch`` rows of a :class:`~ppl_thought.lm.huggingface.HuggingFace` adapter on
    transformers' ``StaticCache`` (rows in lockstep: one position shared by every row).

    ``start(ctx)`` encodes ``ctx [P]`` once through the adapter (the generic path) and copies its keys/values
    into every row of the ``StaticCache``; ``step(tokens [B])`` feeds the model with ``position_ids`` from a
    device position tensor and a 4-D additive mask over the whole buffer (transformers uses a 4-D mask as
    given), and returns float32 library logits ``[B, V]``; ``reorder(index)`` gathers the layers' buffers in
    place. The position tensor and each layer's ``cumulative_length`` advance in place.
    """

    def __init__(self, lm, batch: int, max_len: int):
        from transformers.cache_utils import StaticCache


        if not isinstance(lm, HuggingFace):
            raise ConfigError(f"StaticHuggingFace needs a pt.lm.HuggingFace adapter, got {type(lm).__name__}")
        if lm.sliding:
            raise ConfigError("the static decoder supports HuggingFace models without sliding-window layers")
        if lm.max_positions is not None and max_len > lm.max_positions + 1:
            raise ConfigError(f"a static cache of {max_len} positions exceeds the model's "
                              f"max_position_embeddings={lm.max_positions}")
        self.lm, self.batch, self.max_len = lm, int(batch), int(max_len)
        self.cache = StaticCache(config=lm.model.config, max_cache_len=self.max_len)
        p = next(iter(lm.model.parameters()))
        self.dtype, self.device = p.dtype, p.device
        self.position = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._slots = torch.arange(self.max_len, device=self.device)
        self._lowest = torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)
        self.full = True  # transformers' static layers always return the whole buffer

    def start(self, ctx: torch.Tensor) -> torch.Tensor:
        logits, kv = self.lm(ctx[None])
        if not self.cache.layers[0].is_initialized:
            _, H, _, D = kv.keys[0].shape
            self.cache.early_initialization(self.batch, H, D, kv.keys[0].dtype, kv.keys[0].device)
        n = kv.num_cached
        if n >= self.max_len:
            raise MalformedSequenceError(f"a prompt of {n} positions leaves no room in a static cache of "
                                         f"{self.max_len} slots")
        for layer, k, v in zip(self.cache.layers, kv.keys, kv.values):
            layer.keys[:, :, :n].copy_(k)
            layer.values[:, :, :n].copy_(v)
            layer.cumulative_length.fill_(n)
        self.position.fill_(n)
        return logits[:, -1].float().expand(self.batch, -1)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens [B]`` at the shared position (the cache must have room: ``max_len`` slots are written
        at most); float32 library logits ``[B, V]``."""
        mask = torch.where(self._slots <= self.position[0], self._zero, self._lowest)[None, None, None, :]
        pos = self.position if self.lm.max_positions is None else self.position.clamp(max=self.lm.max_positions - 1)
        out = self.lm.model(input_ids=self.lm.to_hf(tokens)[:, None], past_key_values=self.cache,
                            attention_mask=mask, position_ids=pos.expand(tokens.shape[0], 1), use_cache=True)
        self.position.add_(1)
        return self.lm.library_logits(out.logits[:, -1])

    def reorder(self, index: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.keys.copy_(layer.keys.index_select(0, index))
            layer.values.copy_(layer.values.index_select(0, index))

    def rewind(self, length: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)
        self.position.fill_(length)


def static_decoder(lm, batch: int, max_len: int):
    """The static decoder of ``lm``: :class:`StaticTransformer` or :class:`StaticHuggingFace`; another LM is a
    :class:`~ppl_thought.errors.ConfigError` naming it."""
    if isinstance(lm, Transformer):
        return StaticTransformer(lm, batch, max_len)
    if type(lm).__name__ == "HuggingFace":
        return StaticHuggingFace(lm, batch, max_len)
    raise ConfigError(f"the static decoder supports pt.lm.Transformer and pt.lm.HuggingFace, not {type(lm).__name__} "
                      "(use the generic path)")


def bos_context(prompt: torch.Tensor | None, device) -> torch.Tensor:
    """``<bos> + prompt`` as a 1-D LongTensor on ``device`` (the context every row starts from)."""
    prompt = torch.zeros(0, dtype=torch.long) if prompt is None else torch.as_tensor(prompt, dtype=torch.long)
    if prompt.ndim > 1:
        raise MalformedSequenceError(f"the static decoder takes one prompt shared by every row (1-D ids), got "
                                     f"{describe(prompt)}")
    return torch.cat([torch.tensor([BOS_ID]), prompt.cpu()]).to(device)
