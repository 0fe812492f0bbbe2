"""The Transformer of ``pt.lm.Transformer`` in plain ``jax.numpy``: one set of weights, two frameworks.

    tokens -> embedding -> n_layers x Block -> RMSNorm -> LM head (tied to the embedding) -> log-softmax

    Block:  x = x + SelfAttention(RMSNorm(x))            causal, RoPE on q/k, optional sliding window
            x = x + CrossAttention(RMSNorm(x), z_l)      only with cross_attention=True (LTM, Sec 2.1)
            x = x + SwiGLU(RMSNorm(x))

The architecture, the constructor arguments and the checkpoint (safetensors + JSON,
:mod:`ppl_thought.checkpoint`) are those of the torch model, so ``ptn.lm.Transformer.load(path)`` reads
what ``pt.lm.Transformer.save(path)`` wrote, without torch, and the per-token log-probabilities agree
within 1e-5 in float32 (tests/test_numpyro_transformer.py). The first token of a sequence is the
caller's (``<bos>``, ``ppl_thought.vocab.BOS_ID``, as on the torch side).

Parameters are a pytree (``model.params``) passed explicitly to the pure function ``apply`` (the JAX LM
protocol of ``ppl_thought.numpyro.lm.base``); linear weights are stored ``[in, out]`` (torch's transposed).

The KV cache works under ``jit``: static shapes, preallocated to ``max_len`` slots per row::

    cache = {"keys": (L x [B, H, S, Dh]), "values": (L x [B, H, S, Dh]), "positions": int32 [B]}

every leaf with the batch on axis 0 (``reorder(cache, index)`` resamples it). A row's valid tokens sit at
the slots of their positions: slot j holds the row's token at position j, ``positions[b]`` counts the
row's valid tokens so far. A token with ``valid=False`` is not written and takes no position (its output
is finite but meaningless), so ragged rows need no bookkeeping beyond ``positions``, and the sliding
window (``j > p - window``) works for them too (the torch model refuses ragged rows under a window).
Attention reads all S slots with a mask, so a step costs O(S): size the cache to what the rows need.

Precision: every matmul runs at ``jax.lax.Precision.HIGHEST`` (:data:`PRECISION`). On CPU that is what
float32 does anyway; on GPUs JAX's default would use TF32 / bf16 passes, whose ~1e-3 relative error
breaks the 1e-5 parity with torch. Set ``ptn.lm.transformer.PRECISION = "default"`` for speed over parity.

Dropout is a training-time option of the torch model; here it is kept in the config (checkpoints
round-trip) and never applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.checkpoint import (
    check_finite,
    check_float_dtypes,
    load_numpy_raw,
    save_numpy,
)
from ppl_thought.errors import MalformedSequenceError, UnknownTokenError, VocabularyError
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.lm.base import LM
from ppl_thought.resources import check_bytes, check_transformer, kv_cache_bytes
from ppl_thought.schemas import TRANSFORMER
from ppl_thought.transformer_checkpoint import (
    check_transformer_config,
    saved_transformer_vocab,
    transformer_shapes,
    transformer_sizes,
)
from ppl_thought.validation import per_token
from ppl_thought.vocab import Vocab

#: matmul precision of every projection and attention product (see the module docstring)
PRECISION: str | jax.lax.Precision = jax.lax.Precision.HIGHEST

# ---------------------------------------------------------------------------------------------------------
# Layers: pure functions of (params, inputs)
# ---------------------------------------------------------------------------------------------------------


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` with ``w [in, out]`` at :data:`PRECISION`."""
    return jnp.matmul(x, w, precision=PRECISION)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * weight (``torch.nn.functional.rms_norm``)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_tables(head_dim: int, max_len: int, base: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of position * base^(-2i/head_dim), each ``[max_len, head_dim // 2]`` (RoFormer).

    Computed in float64 by numpy and rounded to float32, exactly as the torch model does."""
    inv_freq = base ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return jnp.asarray(np.cos(angles).astype(np.float32)), jnp.asarray(np.sin(angles).astype(np.float32))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the pairs (x_i, x_{i + Dh/2}) of ``x [B, H, T, Dh]`` by the angles ``cos, sin [B, 1, T, Dh/2]``."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(Dh)) v for ``q [B, H, T, Dh]``, ``k, v [B, H, S, Dh]`` -> ``[B, T, H * Dh]``;
    ``mask [B, T, S]`` (True = attend) must leave every query at least one key. (Heads before positions, as
    the cache stores them: the products are batched matmuls, with no transpose of the cache.)"""
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k, precision=PRECISION) / np.sqrt(q.shape[-1]).astype(np.float32)
    if mask is not None:
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
    y = jnp.einsum("bhts,bhsd->bthd", jax.nn.softmax(scores, axis=-1), v, precision=PRECISION)
    return y.reshape(*y.shape[:2], -1)


def swiglu(x: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)), gate and up in one matmul."""
    gate, up = jnp.split(linear(x, gate_up), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, down)


# ---------------------------------------------------------------------------------------------------------
# Parameters: torch state-dict names <-> the pytree
# ---------------------------------------------------------------------------------------------------------

#: pytree name of each block tensor -> its torch state-dict suffix (Linear weights are transposed)
_BLOCK_TENSORS = {"attn_norm": "attn_norm.weight", "qkv": "attn.qkv.weight", "out": "attn.out.weight",
                  "cross_norm": "cross_norm.weight", "cross_q": "cross.q.weight", "cross_kv": "cross.kv.weight",
                  "cross_out": "cross.out.weight", "mlp_norm": "mlp_norm.weight", "gate_up": "mlp.gate_up.weight",
                  "down": "mlp.down.weight"}


def params_from_state(state: dict[str, np.ndarray], config: dict) -> dict:
    """The parameter pytree of a torch state dict (the names of
    :func:`ppl_thought.transformer_checkpoint.transformer_shapes`)."""
    def get(name: str) -> jax.Array:
        a = np.asarray(state[name], dtype=np.float32)
        return jnp.asarray(a.T if a.ndim == 2 and not name.endswith("embed.weight") else a)

    blocks = []
    for i in range(config["n_layers"]):
        names = {k: f"blocks.{i}.{s}" for k, s in _BLOCK_TENSORS.items()}
        blocks.append({k: get(n) for k, n in names.items() if n in state})
    params = {"embed": get("embed.weight"), "blocks": blocks, "norm": get("norm.weight")}
    if not config["tie_embeddings"]:
        params["lm_head"] = get("lm_head.weight")
    return params


def state_from_params(params: dict) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The torch state dict of a parameter pytree, and its aliases (the tied LM head)."""
    def put(a) -> np.ndarray:
        a = np.asarray(a, dtype=np.float32)
        return np.ascontiguousarray(a.T if a.ndim == 2 else a)

    state = {"embed.weight": np.asarray(params["embed"], dtype=np.float32)}
    for i, block in enumerate(params["blocks"]):
        state.update({f"blocks.{i}.{_BLOCK_TENSORS[k]}": put(a) for k, a in block.items()})
    state["norm.weight"] = put(params["norm"])
    if "lm_head" in params:
        return {**state, "lm_head.weight": put(params["lm_head"])}, {}
    return state, {"lm_head.weight": "embed.weight"}


_CHUNK = 1 << 20  # init_params draws at most this many normals per call


def init_params(key: jax.Array, config: dict) -> dict:
    """GPT-2 init, as the torch model: N(0, 0.02), residual output projections scaled by 1/sqrt(branches),
    norms 1 (same law, not the same draws)."""
    shapes = transformer_shapes(config)
    branches = config["n_layers"] * (3 if config["cross_attention"] else 2)
    sizes = [int(np.prod(shape)) for shape in shapes.values()]
    total = sum(sizes)
    if total <= _CHUNK:
        noise = np.asarray(jax.random.normal(key, (total,), jnp.float32))  # one draw, cut into tensors
    else:  # big models (a large vocabulary): fixed-size draws, one compiled shape instead of one per model size
        noise = np.concatenate([np.asarray(jax.random.normal(jax.random.fold_in(key, i), (_CHUNK,), jnp.float32))
                                for i in range(-(-total // _CHUNK))])[:total]
    state, offset = {}, 0
    for (name, shape), size in zip(shapes.items(), sizes):
        std = 0.02 / np.sqrt(branches) if name.endswith(("out.weight", "down.weight")) else 0.02
        state[name] = (np.ones(shape, np.float32) if name.endswith("norm.weight")
                       else std * noise[offset:offset + size].reshape(shape))
        offset += size
    if config["tie_embeddings"]:
        state["lm_head.weight"] = state["embed.weight"]
    return params_from_state(state, config)


# ---------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------


@checked_jax
class Transformer(LM):
    """Causal decoder LM: RoPE, pre-norm RMSNorm, SwiGLU, tied embeddings, optional window and latents.

    The constructor arguments are those of ``pt.lm.Transformer`` (see there); ``params`` (a pytree as
    :func:`params_from_state` makes) or ``key`` (a PRNG key for the GPT-2 init, default ``PRNGKey(0)``)
    give the weights. ``Transformer.load(path)`` reads a checkpoint of either side.
    """

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 d_ff: int | None = None, max_len: int = 2048, window: int | None = None,
                 cross_attention: bool = False, d_latent: int | None = None, rope_base: float = 10000.0,
                 dropout: float = 0.0, tie_embeddings: bool = True, *, params: dict | None = None,
                 key: jax.Array | None = None):
        c = transformer_sizes(dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                                   d_ff=d_ff, max_len=max_len, window=window, cross_attention=cross_attention,
                                   d_latent=d_latent, rope_base=rope_base, dropout=dropout,
                                   tie_embeddings=tie_embeddings))
        check_transformer("ptn.lm.Transformer", c)  # up front: never the allocator's error (resources.py)
        self._config = c
        self.vocab_size, self.d_model, self.n_layers, self.n_heads = vocab_size, d_model, n_layers, n_heads
        self.d_ff, self.max_len, self.window, self.rope_base = c["d_ff"], max_len, window, c["rope_base"]
        self.cross_attention, self.d_latent = c["cross_attention"], c["d_latent"]
        self.dropout, self.tie_embeddings = c["dropout"], c["tie_embeddings"]
        self.head_dim = d_model // n_heads
        self.rope_cos, self.rope_sin = rope_tables(self.head_dim, max_len, self.rope_base)
        # apply checks its inputs in Python, then runs this: eager calls compile once per shape instead of
        # op by op; inside a caller's jit it is inlined
        self._forward = jax.jit(self._forward_impl)
        self.params = params if params is not None else init_params(
            key if key is not None else jax.random.PRNGKey(0), c)

    def config(self) -> dict:
        """The constructor arguments, JSON-serialisable (the same dict as ``pt.lm.Transformer.config()``)."""
        return dict(self._config)

    @property
    def receptive_field(self) -> int | None:
        """How many tokens (the current one included) the log-probs can depend on: n_layers*(window-1)+1."""
        return None if self.window is None else self.n_layers * (self.window - 1) + 1

    def __repr__(self) -> str:
        return "ptn.lm.Transformer(" + ", ".join(f"{k}={v!r}" for k, v in self._config.items()) + ")"

    # -- cache ----------------------------------------------------------------------------------------

    @per_token
    def init_cache(self, batch: int, max_len: int | None = None) -> dict:
        """An empty cache of ``batch`` rows with ``max_len`` slots each (default: the model's ``max_len``).

        Slots are positions: a row holds at most ``max_len`` valid tokens."""
        S = self.max_len if max_len is None else int(max_len)
        if batch < 1 or not 1 <= S <= self.max_len:
            raise MalformedSequenceError(f"init_cache needs batch >= 1 and 1 <= max_len <= {self.max_len} "
                                         f"(the model's RoPE tables), got batch={batch}, max_len={max_len}")
        check_bytes(kv_cache_bytes(self.n_layers, batch, self.n_heads, S, self.head_dim), "init_cache",
                    f"batch={batch} (x max_len={S})")  # once per cache, before allocating (resources.py)

        def zeros() -> jax.Array:  # a buffer per leaf: a jitted step may donate (update in place) each one
            return jnp.zeros((batch, self.n_heads, S, self.head_dim), jnp.float32)

        return {"keys": tuple(zeros() for _ in range(self.n_layers)),
                "values": tuple(zeros() for _ in range(self.n_layers)),
                "positions": jnp.zeros((batch,), jnp.int32)}

    # -- forward --------------------------------------------------------------------------------------

    @per_token
    def apply(self, params: dict, cache: dict, tokens: jax.Array, valid: jax.Array | None = None,
              latents: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Next-token log-probs ``float32 [B, T, vocab_size]`` after each of ``tokens int [B, T]``, and the cache.

        Args:
            params: the parameter pytree (``self.params``, or a transformed copy: ``apply`` is pure).
            cache: from :meth:`init_cache` or an earlier ``apply`` of the same rows (left unchanged).
            tokens: ids in ``[0, vocab_size)``; they continue each row at its ``positions``.
            valid: optional bool ``[B, T]``; a False token is not written, takes no position and is not
                attended to; its own output row is finite but meaningless.
            latents: with ``cross_attention=True``, ``[B, n_layers, N_z, d_latent]`` (layer l reads
                ``latents[:, l]``) or ``[B, N_z, d_latent]`` (shared by all layers); B may be 1.

        Eagerly, ids outside the vocabulary and rows longer than the cache raise
        :class:`~ppl_thought.errors.UnknownTokenError` / :class:`~ppl_thought.errors.MalformedSequenceError`;
        under ``jit`` (values unknown at trace time) the affected rows come out NaN instead of silently
        wrong.
        """
        B, T, S = self._check(cache, tokens, valid, latents)
        if valid is None:
            valid = jnp.ones((B, T), bool)
        return self._forward(params, cache, jnp.asarray(tokens), valid, latents)

    def _forward_impl(self, params: dict, cache: dict, tokens: jax.Array, valid: jax.Array,
                      latents: jax.Array | None) -> tuple[jax.Array, dict]:
        """The computation of :meth:`apply` after its checks (compiled once per shape by ``jit``)."""
        B, T = tokens.shape
        S = cache["keys"][0].shape[2]
        pos0 = cache["positions"]
        count = valid.astype(jnp.int32)
        positions = pos0[:, None] + jnp.cumsum(count, axis=1) - count  # [B, T]: valid tokens before each
        new_positions = pos0 + count.sum(1)
        slots = jnp.where(valid, positions, S)  # an invalid token is written nowhere (slot S is dropped)
        # masks over the S slots: slot j holds position j; an invalid query sits at its row's next position
        # (clamped into the cache), so it always sees at least its own slot and its output stays finite
        q_pos = jnp.minimum(positions, S - 1)[:, :, None]
        j = jnp.arange(S)[None, None, :]
        mask = j <= q_pos
        if self.window is not None:
            mask &= j > q_pos - self.window
        rope = jnp.minimum(positions, self.max_len - 1)
        cos, sin = self.rope_cos[rope][:, None], self.rope_sin[rope][:, None]  # [B, 1, T, Dh/2]

        x = jnp.take(params["embed"], tokens, axis=0, mode="fill", fill_value=jnp.nan)  # NaN for bad ids
        rows = jnp.arange(B)[:, None]
        keys, values = [], []
        for i, block in enumerate(params["blocks"]):
            # self-attention: write this call's keys/values at their slots, attend over the whole cache
            q, k, v = jnp.split(linear(rms_norm(x, block["attn_norm"]), block["qkv"]), 3, axis=-1)
            q, k, v = (a.reshape(B, T, self.n_heads, self.head_dim).transpose(0, 2, 1, 3) for a in (q, k, v))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            # [B, H, S, Dh][rows, :, slots] is [B, T, H, Dh] (advanced indices first)
            k_all = cache["keys"][i].at[rows, :, slots].set(k.transpose(0, 2, 1, 3), mode="drop")
            v_all = cache["values"][i].at[rows, :, slots].set(v.transpose(0, 2, 1, 3), mode="drop")
            keys.append(k_all)
            values.append(v_all)
            x = x + linear(attention(q, k_all, v_all, mask), block["out"])
            if self.cross_attention:
                x = x + self._cross(block, rms_norm(x, block["cross_norm"]), self._layer_latents(latents, i, B))
            x = x + swiglu(rms_norm(x, block["mlp_norm"]), block["gate_up"], block["down"])
        x = rms_norm(x, params["norm"])
        logits = linear(x, params["lm_head"]) if "lm_head" in params else linear(x, params["embed"].T)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        overflow = new_positions > S  # a valid token found no slot: poison the row rather than drop it
        log_probs = jnp.where(overflow[:, None, None], jnp.nan, log_probs)
        return log_probs, {"keys": tuple(keys), "values": tuple(values), "positions": new_positions}

    @per_token
    def step(self, params: dict, cache: dict, tokens: jax.Array, valid: jax.Array | None = None,
             latents: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """One incremental step: ``tokens [B]`` (``valid [B]`` optional) -> ``(log_probs [B, V], cache)``."""
        if getattr(tokens, "ndim", None) != 1:
            raise MalformedSequenceError(f"step takes tokens [B], got {_describe(tokens)}")
        if valid is not None:
            if getattr(valid, "ndim", None) != 1:
                raise MalformedSequenceError(f"step takes valid [B], got {_describe(valid)}")
            valid = valid[:, None]
        log_probs, cache = self.apply(params, cache, tokens[:, None], valid, latents)
        return log_probs[:, 0], cache

    def _cross(self, block: dict, x: jax.Array, z: jax.Array) -> jax.Array:
        """Cross-attention (LTM Sec 2.1): queries from the tokens, keys/values from ``z [B, N_z, d_latent]``."""
        B, T, _ = x.shape
        q = linear(x, block["cross_q"]).reshape(B, T, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k, v = jnp.split(linear(z, block["cross_kv"]), 2, axis=-1)
        k, v = (a.reshape(*z.shape[:2], self.n_heads, self.head_dim).transpose(0, 2, 1, 3) for a in (k, v))
        k, v = (jnp.broadcast_to(a, (B, *a.shape[1:])) for a in (k, v))
        return linear(attention(q, k, v), block["cross_out"])

    @staticmethod
    def _layer_latents(latents: jax.Array, layer: int, B: int) -> jax.Array:
        return latents[:, layer] if latents.ndim == 4 else latents

    def _check(self, cache, tokens, valid, latents) -> tuple[int, int, int]:
        """Shapes (static, so also under ``jit``) and, when the values are known, ids and row lengths."""
        if not hasattr(tokens, "dtype") or tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise MalformedSequenceError(f"tokens must be an integer array [B, T], got {_describe(tokens)}")
        B, T = tokens.shape
        if not isinstance(cache, dict) or set(cache) != {"keys", "values", "positions"} \
                or len(cache["keys"]) != self.n_layers \
                or cache["keys"][0].shape[1::2] != (self.n_heads, self.head_dim):
            raise MalformedSequenceError("cache was not made by this model's init_cache "
                                         f"(n_layers={self.n_layers}, n_heads={self.n_heads})")
        if cache["positions"].shape != (B,):
            raise MalformedSequenceError(f"cache holds {cache['positions'].shape[0]} rows but tokens have {B}")
        S = cache["keys"][0].shape[2]
        if valid is not None and (getattr(valid, "shape", None) != (B, T) or valid.dtype != jnp.bool_):
            raise MalformedSequenceError(f"valid must be a bool array [B, T] = [{B}, {T}], got {_describe(valid)}")
        if not self.cross_attention:
            if latents is not None:
                raise MalformedSequenceError("latents given to a Transformer without cross_attention")
        else:
            expected = f"[B, {self.n_layers}, N_z, {self.d_latent}] or [B, N_z, {self.d_latent}]"
            if latents is None:
                raise MalformedSequenceError(f"cross_attention=True needs latents {expected}")
            if (not hasattr(latents, "dtype") or not jnp.issubdtype(latents.dtype, jnp.floating)
                    or latents.ndim not in (3, 4) or latents.shape[-1] != self.d_latent or latents.shape[-2] < 1
                    or (latents.ndim == 4 and latents.shape[1] != self.n_layers) or latents.shape[0] not in (1, B)):
                raise MalformedSequenceError(f"latents must be a float array {expected} with B={B} (or 1), "
                                             f"got {_describe(latents)}")
        ids = _concrete(tokens)
        if ids is not None and ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab_size:
                raise UnknownTokenError(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                                        f"[0, {self.vocab_size})")
        pos = _concrete(cache["positions"])
        ok = _concrete(valid) if valid is not None else np.ones((B, T), bool)
        if pos is not None and ok is not None and B and int((pos + ok.sum(1)).max()) > S:
            raise MalformedSequenceError(f"a row of {int((pos + ok.sum(1)).max())} positions (cached and new, "
                                         f"padding not counted) exceeds the cache's max_len={S}")
        return B, T, S

    # -- checkpoints ----------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, *, allow_nonfinite: bool = False) -> Transformer:
        """Read a checkpoint written by ``pt.lm.Transformer.save`` (or :meth:`save`), without torch.

        The same checks and errors as the torch loader (:func:`ppl_thought.checkpoint.read_checkpoint`,
        :func:`ppl_thought.transformer_checkpoint.check_transformer_config`): a missing folder raises
        :class:`~ppl_thought.errors.MissingCheckpointError`; a config that does not describe the tensors, a
        tensors file that fails its SHA-256, aliases other than the tied LM head, weights that are not
        floats, or NaN / inf weights (unless ``allow_nonfinite=True``, for debugging) a
        :class:`~ppl_thought.errors.CheckpointError`."""
        state, raw = load_numpy_raw(path)
        config = check_transformer_config(path, raw.header["config"], raw.shapes, raw.aliases)
        check_float_dtypes(path, raw.dtypes)
        check_finite(path, [k for k, v in state.items() if v.size and not np.isfinite(v).all()], allow_nonfinite)
        c = transformer_sizes(config)
        lm = cls(**config, params=params_from_state(state, c))
        saved = raw.header["config"].get("vocab")  # the tokenizer it was saved with: automata are checked against it
        lm.vocab = None if saved is None else Vocab.from_dict(saved)
        return lm

    def save(self, path: str | Path, extra: dict | None = None, vocab: Vocab | None = None) -> Path:
        """Write the checkpoint ``pt.lm.Transformer.load`` reads (the same files the torch side writes); ``vocab``
        defaults to ``self.vocab`` (the one it was loaded with)."""
        config = {"class": "Transformer", "format": TRANSFORMER.version, **self.config()}
        vocab = self.vocab if vocab is None else vocab
        if vocab is not None:
            if len(vocab) != self.vocab_size:
                raise VocabularyError(f"the vocabulary has {len(vocab)} ids, the model {self.vocab_size}")
            config["vocab"] = vocab.to_dict()
        state, aliases = state_from_params(self.params)
        return save_numpy(path, state, config, extra, aliases)

    @staticmethod
    def load_vocab(path: str | Path):
        """The :class:`~ppl_thought.vocab.Vocab` saved with a model (``save(..., vocab=...)``), or None."""
        from ppl_thought.vocab import Vocab

        vocab = saved_transformer_vocab(path)
        return None if vocab is None else Vocab.from_dict(vocab)


def _concrete(x) -> np.ndarray | None:
    """``x`` as a numpy array, or None while tracing (values unknown under ``jit`` / ``grad``)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _describe(x: Any) -> str:
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"{x.dtype} array of shape {tuple(x.shape)}"
    return type(x).__name__
