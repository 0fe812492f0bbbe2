"""The KV cache of the library's LMs: keys and values per layer, reused across steps and reordered on resampling.

docs/architecture.md, "Rules that make it fast": one cache per batch of particles; resampling gathers it along
the batch with ``index_select`` (:meth:`KVCache.reorder`), prompt sharing repeats rows (:meth:`KVCache.expand`).
:class:`~ppl_thought.lm.transformer.Transformer` and :class:`~ppl_thought.lm.huggingface.HuggingFace` both
write into it through the same three calls: :meth:`KVCache.append` (a successor with room for ``n`` new
positions), :meth:`KVCache.store` (one layer's new keys/values) and :meth:`KVCache.finish`.

Caches are values: a forward pass never changes the cache it is given, so one prefix may be continued several
ways. Under ``torch.no_grad()`` / ``torch.inference_mode()`` the cache preallocates its buffers and appends in
place (at least doubling capacity, with room for 64 more positions, when full; a gathered cache has room for 64
more; a window cache compacts to its last k-1 entries when full). With gradients enabled it is purely
functional (``torch.cat``), so autograd never sees an in-place write.

The owner of a cache may say how many positions are still to come (:meth:`KVCache.with_room`: a sampler knows its
``max_len``): buffers are then (re)allocated with that much room (when below 64) instead of 64. A gather writes every
row's block of a fresh buffer, ``[B, H, capacity, Dh]``, so with small heads every page of it is faulted in: a
buffer sized to what is used is that much less memory to fault in per resampling (``benchmarks/engines.py``).
A wrong hint costs speed, never correctness: past it, appends grow the buffers as without one.

Ragged rows (SMC particles waiting at a segment boundary): after a ``valid`` mask with a False entry the cache
keeps a per-row key-validity mask and per-row positions; :func:`ragged_rows` computes positions and the
attention mask of new tokens, :func:`check_positions` the position limit.
"""

from __future__ import annotations

import operator

import torch

from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.lm.base import TOKEN_DTYPES, describe
from ppl_thought.validation import checked, per_token

__all__ = ["KVCache", "check_positions", "ragged_rows", "writable"]


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


@checked
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

    @per_token
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
        self.room: int | None = None  # positions still to come (a hint, see with_room); None: unknown

    @per_token
    def latent_projections(self, latents: torch.Tensor) -> list | None:
        """The cross-attention keys/values kept for ``latents`` (the same tensor, unmodified, no gradients),
        or None: computed once per sequence of steps that pass the same latents back."""
        if self._latents is latents and self._latents_version == latents._version and not torch.is_grad_enabled():
            return self._cross
        return None

    @property
    def ragged(self) -> bool:
        """Whether some cached token was invalid (rows may sit at different positions)."""
        return self.key_valid is not None

    @per_token
    def with_rows(self, key_valid: torch.Tensor | None, positions: torch.Tensor | None) -> KVCache:
        self.key_valid, self.positions = key_valid, positions
        return self

    @per_token
    def with_room(self, room: int | None) -> KVCache:
        """This cache (the same entries, a new object: the given one is left as it is) with a hint of how many
        positions will still be appended to its rows (``None``: unknown). A hint below 64 sizes its gathers
        (:meth:`reorder`, :meth:`expand`) and reallocations: room for that many appends instead of 64. Caches
        appended from it carry the rest of the hint. Only allocation sizes depend on it: past the hint, appends
        grow the buffers as without one."""
        out = KVCache(self._storage, self._start, self._end, self.length, self.window)
        out._cross, out._latents, out._latents_version = self._cross, self._latents, self._latents_version
        out.key_valid, out.positions = self.key_valid, self.positions
        out.room = None if room is None else max(operator.index(room), 0)
        return out

    def _room_after(self, n: int) -> int | None:
        """The hint of a successor that appends ``n`` positions."""
        return None if self.room is None else max(self.room - n, 0)

    def _small_room(self, room: int | None) -> bool:
        """Whether a hint of ``room`` positions to come sizes a (re)allocated buffer: a hint below :data:`_ROOM`
        (a larger one, or none, gives the default growth), never for a window cache (it compacts when full)."""
        return room is not None and 0 < room < _ROOM and self.window is None

    @classmethod
    @per_token
    def empty(cls, n_layers: int, window: int | None) -> KVCache:
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

    @per_token
    def reorder(self, index: torch.Tensor) -> KVCache:
        """Row ``i`` of the result is row ``index[i]`` of this cache (``index_select`` on the batch)."""
        index = torch.as_tensor(index, device=self._storage.keys[0].device)
        if index.ndim != 1 or index.dtype not in TOKEN_DTYPES:
            raise MalformedSequenceError(f"reorder needs a 1-D integer index, got {describe(index)}")
        return self._gather(index)

    @per_token
    def expand(self, n: int) -> KVCache:
        """Each row repeated ``n`` times (``repeat_interleave``): rows ``i*n .. i*n+n-1`` are row i."""
        n = operator.index(n)
        if n < 1:
            raise ConfigError(f"expand needs n >= 1, got {n}")
        device = self._storage.keys[0].device
        return self._gather(torch.arange(self.batch_size, device=device).repeat_interleave(n))

    def _gather(self, index: torch.Tensor) -> KVCache:
        old = self._storage
        n = self.num_cached
        # keep the room left for appends, and make some where there is none (a prompt's cache expanded to
        # n particles): a reallocation copies everything. With a hint, exactly the room it asks for: the gather
        # writes into every row's block of the new buffer, so each of its pages is faulted in (small heads)
        if self._small_room(self.room):
            capacity = n + self.room
        else:
            capacity = max(old.capacity - self._start, n + (_ROOM if self.window is None else 0))
        # With gradients, entries on the autograd graph stay on it (an out-of-place gather, no spare room). Then every
        # buffer is gathered so and the storage is functional (filled=None): a model whose first layer's keys need
        # no gradient but later ones do (LoRA on q_proj / v_proj; frozen embeddings and k_proj) would otherwise get
        # spare room in layer 0 only, and a later in-place append (checked on layer 0) would write the other
        # layers' new entries past their ends, where nothing is kept (the keys one short of the mask).
        functional = torch.is_grad_enabled() and any(b.requires_grad for b in (*old.keys, *old.values))
        keys, values = [], []
        for buffers, out in ((old.keys, keys), (old.values, values)):
            for buf in buffers:
                if functional:
                    out.append(buf[:, :, self._start:self._end].index_select(0, index))
                    continue
                new = buf.new_empty((len(index), buf.shape[1], capacity, buf.shape[3]))
                torch.index_select(buf[:, :, self._start:self._end], 0, index, out=new[:, :, :n])
                out.append(new)
        # The cached latent projections belong to the old rows: drop them; the caller passes the
        # reordered latents next time.
        out = KVCache(_Storage(keys, values, None if functional else n), 0, n, self.length, self.window)
        out.room = self.room
        if self.ragged:
            out.with_rows(self.key_valid.index_select(0, index), self.positions.index_select(0, index))
        return out

    # -- writing (a model's forward pass: append, then store per layer, then finish) ------------------

    @per_token
    def append(self, n: int, capacity_limit: int) -> KVCache:
        """A successor cache ready to receive ``n`` new entries per layer through :meth:`store`."""
        old, kept = self._storage, self.num_cached
        fresh = old.keys[0] is None
        if fresh or torch.is_grad_enabled() or not self.preallocate:
            # Functional: store concatenates onto views of the old entries.
            keys = [None] * self.num_layers if fresh else list(self.keys)
            values = [None] * self.num_layers if fresh else list(self.values)
            new = KVCache(_Storage(keys, values, None), 0, kept + n, self.length, self.window)
            new.room = self._room_after(n)
            return new.with_rows(self.key_valid, self.positions)
        if old.filled == self._end and self._end + n <= old.capacity and writable(old.keys[0]):
            old.filled = self._end + n  # in place: this cache is the only one that reaches the frontier
            new = KVCache(old, self._start, self._end + n, self.length, self.window)
            new.room = self._room_after(n)
            return new.with_rows(self.key_valid, self.positions)
        # Reallocate (full, branched from, or built with gradients): copy the kept entries to the front
        # of a buffer with room to grow. A window cache keeps <= window-1 entries, so this compacts it.
        # Room: what the hint has left after these n (at most _ROOM), else _ROOM and at least doubling;
        # a window cache stays within 2 (window - 1) + n
        after = self._room_after(n)
        if self._small_room(after):
            capacity = min(kept + n + after, max(capacity_limit, kept + n))
        else:
            room = _ROOM if self.window is None else 0
            capacity = min(max(2 * (kept + n), kept + n + room), max(capacity_limit, kept + n))
        keys, values = [], []
        for buffers, out in ((old.keys, keys), (old.values, values)):
            for buf in buffers:
                new = buf.new_empty((buf.shape[0], buf.shape[1], capacity, buf.shape[3]))
                new[:, :, :kept] = buf[:, :, self._start:self._end]
                out.append(new)
        new = KVCache(_Storage(keys, values, kept + n), 0, kept + n, self.length, self.window)
        new.room = after
        return new.with_rows(self.key_valid, self.positions)

    @per_token
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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

    @per_token
    def finish(self, n: int, cross: list | None, latents: torch.Tensor | None) -> KVCache:
        """After the forward pass: count the new positions and forget entries outside the window."""
        self.length += n
        if self.window is not None:
            self._start = max(self._start, self._end - (self.window - 1))
        if cross is not None and not torch.is_grad_enabled():
            self._cross, self._latents, self._latents_version = cross, latents, latents._version
        return self


_ROOM = 64


def writable(buffer: torch.Tensor) -> bool:
    """May we write into this buffer without disturbing autograd or inference mode?"""
    return not buffer.requires_grad and (torch.is_inference_mode_enabled() or not buffer.is_inference())


