"""The one decoding loop: a batched, KV-cached LM state stepped segment by segment (docs/architecture.md,
"Sequence sites").

:class:`LMState` is where ``n`` partial sequences of one LM stand: next-token logits, the KV cache,
the token rule's state (the automaton of Def 2.8), the tokens so far and whether each row has ended.
Programs keep it in their ``state`` dict; the engine reorders it after resampling (``reorder``).

* ``lm_state.segment(until_emitted=t)`` (or ``stop=...``, ``max_tokens=...``) is a Pyro distribution
  :class:`Segment` over the next segment of every row: it samples all rows in one lockstep decoding
  loop (rows that reach the end of their segment wait, feeding nothing), and scores a given segment
  with one teacher-forced forward pass of the chunk (``valid`` mask for ragged rows).
* ``lm_state.next_token()`` is the one-token segment with event shape ``()``.
* ``lm_state.extend(value)`` appends a segment (in place). It reuses the forward pass the segment
  already ran to sample or score that very value, so a step costs one pass of the LM per token.

The same loop samples whole sequences (:meth:`LMSequence.sample`, the segment that ends with the
sequence) and the lifting-decoded guides. Step log-probabilities follow the masked parametrisation
log softmax(f~(z_<i))_{z_i} of Def 2.8; a sequence's log-probability is their sum, (2.13).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ppl_thought import checks
from ppl_thought.distributions.registry import register_lm
from ppl_thought.distributions.segment import STATE_KEYS, Segment, check_no_nan
from ppl_thought.distributions.token_rule import (
    TokenRule,
    chunk_size,
    generated_tokens,
    left_pack,
    masked_log_softmax,
    nucleus,
    sample_categorical,
    supports_valid,
    trim_padding,
    upcast,
)
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.lm.base import LMCache, ids_checked, lm_device, match_rows, with_room
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import BOS_ID, PAD_ID

# LMState's module is where programs meet the decoding loop: the token rule and the segment are re-exported
__all__ = ["LMState", "Segment", "TokenRule", "check_no_nan", "chunk_size", "generated_tokens", "left_pack",
           "masked_log_softmax", "nucleus", "sample_categorical", "supports_valid", "trim_padding", "upcast"]


@checked
class LMState:
    """``n`` partial sequences of one LM (see the module docstring). Mutable: ``extend`` and ``reorder``
    change it in place (and return it).

    Build one with :meth:`LMSequence.start` (``LMSequence(lm, prompt, constraint, ...).start(n)``) or
    :meth:`LMState.start`. The next-token logits and the LM cache of a row that has ended (``done``) are
    unspecified: nothing reads them again.
    """

    def __init__(self, lm: torch.nn.Module, rule: TokenRule, max_len: int, stop_ids: torch.Tensor,
                 lm_kwargs: dict | None, logits: torch.Tensor, cache: LMCache | None, rule_state: torch.Tensor,
                 context: torch.Tensor | None = None, chunk: int = 0):
        self.lm = lm
        self.chunk = chunk_size(chunk)
        self.rule = rule
        self.max_len = int(max_len)
        self.stop_ids = stop_ids.to(logits.device)
        self.lm_kwargs = dict(lm_kwargs or {})
        self.logits = logits  # [n, V]: next-token logits
        self.cache = cache  # LM cache (valid mode) or None (recompute mode: ``context`` holds the inputs)
        self.context = context
        self.s = rule_state
        n = logits.shape[0]
        dev = logits.device
        self.tokens = torch.zeros(n, 0, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(n, dtype=torch.long, device=dev)
        self.log_prob = torch.zeros(n, device=dev)
        self.done = rule.is_final(rule_state) | (self.max_len == 0)
        self.version = 0  # bumped by every change: segments made before a change are stale
        self._segments: list[Segment] = []  # segments of the current version, newest last

    # ------------------------------------------------------------------ construction
    @classmethod
    def start(cls, lm: torch.nn.Module, n: int, prompt: torch.Tensor | Sequence[int] | str | None = None,
              rule: TokenRule | None = None,
              max_len: int = 1 << 30, stop_ids: torch.Tensor | Sequence[int] | None = None,
              lm_kwargs: dict | None = None, device: torch.device | str | None = None, name: str | None = None,
              chunk: int = 0) -> LMState:
        """Encode ``<bos> + prompt`` (1-D, shared: encoded once and expanded; or ``[n, P]`` right-padded;
        ``[r, P]`` with r dividing n gives each prompt to n / r consecutive rows). A ``str`` passes the type
        layer only to be refused with the advice to encode it (``vocab.encode``).

        ``chunk = C > 0`` turns on chunked encoding (end of Section 5.6.2): while sampling, a run of up to C
        forced tokens (the only admissible token of their automaton state, e.g. the text between two sparse
        thoughts under the lifting of x) is fed to the LM in one pass with the token before it, instead of
        one decoding step per token. The samples and log-probabilities are those of ``chunk=0`` (token by
        token): see :meth:`Segment.sample_with_log_prob`.

        A trainable ``lm`` is registered with ``pyro.module`` (:func:`~ppl_thought.distributions.register_lm`;
        ``name`` or a name derived from its type) unless its parameters are in the param store already
        under another name, which is then used.
        """
        cls._check_arguments(lm, n, prompt)
        register_lm(lm, name)
        return cls.encode(lm, n, prompt, rule, max_len, stop_ids, lm_kwargs, device, chunk)

    @staticmethod
    def _check_arguments(lm, n, prompt) -> None:
        """The LM is a callable module with a vocab_size, n a positive integer, the prompt token ids (a string is
        refused: LMState has no vocabulary to encode it with; floats are not truncated to ids)."""
        checks.callable_arg("lm", lm, "a ppl_thought LM (pt.lm.Transformer, pt.lm.Tabular, pt.lm.HuggingFace)")
        if not isinstance(getattr(lm, "vocab_size", None), numbers.Integral):
            raise ConfigError(f"lm must be a ppl_thought LM with an integer vocab_size, got {type(lm).__name__}")
        checks.integer("n (the number of rows)", n, minimum=0)
        if prompt is not None:
            checks.token_ids("prompt", prompt, vocab_hint="an LM state (and pt.models.Constrained) has no "
                             "vocabulary to encode text with: encode it first, e.g. torch.tensor(vocab.encode(text)) "
                             "or the tokenizer's encode")

    @classmethod
    def encode(cls, lm: torch.nn.Module, n: int, prompt: torch.Tensor | Sequence[int] | None = None,
               rule: TokenRule | None = None,
               max_len: int = 1 << 30, stop_ids: torch.Tensor | Sequence[int] | None = None,
               lm_kwargs: dict | None = None, device: torch.device | str | None = None, chunk: int = 0) -> LMState:
        """:meth:`start` for an LM registered already (no ``pyro.module`` call): what a distribution or a
        transform that registered its LM at its own site uses."""
        state = cls._encode_prompt(lm, n, prompt, rule, max_len, stop_ids, lm_kwargs, device)
        state.chunk = chunk_size(chunk)
        return state

    @classmethod
    def _encode_prompt(cls, lm, n: int, prompt, rule, max_len, stop_ids, lm_kwargs, device) -> LMState:
        cls._check_arguments(lm, n, prompt)
        device = device if device is not None else lm_device(lm)
        # every step holds the rows' logits and masked log-probabilities [n, V] (fp32): refuse, before the first
        # allocation, a number of rows the device cannot hold (instead of a raw allocator error or swapping)
        checks.allocation(f"{n} rows (particles) over a vocabulary of {lm.vocab_size}", n * 2 * 4 * int(lm.vocab_size),
                          device)
        rule = rule if rule is not None else TokenRule(None, lm.vocab_size)
        stop_ids = stop_ids.to(device) if stop_ids is not None else torch.zeros(0, dtype=torch.long, device=device)
        prompt = torch.zeros(0, dtype=torch.long, device=device) if prompt is None else \
            torch.as_tensor(prompt, dtype=torch.long, device=device)
        valid_mode = supports_valid(lm)
        s0 = rule.start(n, device)
        if prompt.ndim <= 1:
            ctx = torch.cat([torch.tensor([BOS_ID], device=device), prompt])[None]
            logits, cache = lm(ctx, **match_rows(lm_kwargs or {}, 1))
            if valid_mode:  # the n rows' cache, with room for the max_len tokens to come (a hint: KVCache.with_room)
                cache = with_room(cache, max_len).expand(n)
                return cls(lm, rule, max_len, stop_ids, lm_kwargs, logits[:, -1].expand(n, -1), cache, s0)
            return cls(lm, rule, max_len, stop_ids, lm_kwargs, logits[:, -1].expand(n, -1), None, s0,
                       ctx.expand(n, -1))
        rows = prompt.reshape(-1, prompt.shape[-1])
        if rows.shape[0] != n:
            rows = rows.repeat_interleave(n // rows.shape[0], 0) if n % rows.shape[0] == 0 else rows
        if rows.shape[0] != n:
            raise MalformedSequenceError(f"{rows.shape[0]} prompts for {n} rows")
        # right padding is no context: packed to the end of each row, columns of <pad> only dropped
        ctx = trim_padding(left_pack(torch.cat([torch.full((n, 1), BOS_ID, device=device), rows], 1)))
        plen = (ctx != PAD_ID).sum(-1)
        ar = torch.arange(n, device=device)
        kw = match_rows(lm_kwargs or {}, n)
        if valid_mode:
            logits, cache = lm(ctx, valid=ctx != PAD_ID, **kw)
            return cls(lm, rule, max_len, stop_ids, lm_kwargs, logits[ar, plen - 1], cache, s0)
        logits, _ = lm(ctx, **kw)
        return cls(lm, rule, max_len, stop_ids, lm_kwargs, logits[ar, plen - 1], None, s0, ctx)

    @property
    def n(self) -> int:
        return self.logits.shape[0]

    @property
    def device(self) -> torch.device:
        return self.logits.device

    @property
    def mode(self) -> str:
        """``"valid"`` (KV cache, ragged rows through ``valid`` masks) or ``"recompute"`` (contexts rerun)."""
        return "valid" if self.context is None else "recompute"

    def __repr__(self) -> str:
        return (f"LMState(n={self.n}, lm={type(self.lm).__name__}, max_len={self.max_len}, mode={self.mode}"
                + (f", chunk={self.chunk})" if self.chunk else ")"))

    # ------------------------------------------------------------------ distributions over what comes next
    @per_token
    def segment(self, until_emitted: int | torch.Tensor | None = None,
                stop: str | int | Sequence[str | int] | torch.Tensor | None = None, max_tokens: int | None = None,
                name_hint: str = "") -> Segment:
        """The next segment of every row: tokens until (first of) the constraint has emitted
        ``until_emitted`` observables, a stop token (``stop`` ids, or else the state's own stop ids), a
        final state of the constraint, ``max_tokens`` tokens, or ``max_len``. The state's own stop ids
        always end the sequence, hence the segment. Rows already ended give an empty segment
        (log-probability 0)."""
        seg = Segment(self, until_emitted, stop, max_tokens)
        self._segments.append(seg)
        return seg

    @per_token
    def next_token(self) -> Segment:
        """The next token of every row (event shape ``()``; ``<pad>`` for ended rows)."""
        seg = Segment(self, None, None, 1, scalar=True)
        self._segments.append(seg)
        return seg

    # ------------------------------------------------------------------ changing the state
    @per_token
    def extend(self, value: torch.Tensor) -> LMState:
        """Append a segment ``[n, S]`` (or one token ``[n]``) to every row, in place; returns self.

        The value is scored under the segment of this state that sampled or scored it (by identity),
        else under the newest segment made since the last change; without one, under an open segment
        (no end required, tokens after the end of a sequence score -inf). The forward pass that
        segment already ran is reused.
        """
        seg = next((s for s in reversed(self._segments) if s._knows(value)), None)
        if seg is None:
            seg = self._segments[-1] if self._segments else Segment(self, open_end=True)
        self._adopt(seg._advance(value))
        return self

    @per_token
    def reorder(self, index: torch.Tensor) -> LMState:
        """Row i becomes row ``index[i]`` (resampling); the KV cache is gathered with ``cache.reorder``."""
        index = index.to(self.device)
        self.logits = self.logits[index]
        self.cache = self.cache.reorder(index) if self.cache is not None else None
        self.context = self.context[index] if self.context is not None else None
        self.s, self.tokens, self.lengths = self.s[index], self.tokens[index], self.lengths[index]
        self.log_prob, self.done = self.log_prob[index], self.done[index]
        self._changed()
        return self

    def _changed(self) -> None:
        self.version += 1
        self._segments = []

    def _adopt(self, post: dict) -> None:
        for k in STATE_KEYS:
            setattr(self, k, post[k])
        self._changed()

    @per_token
    def snapshot(self) -> dict:
        return {k: getattr(self, k) for k in STATE_KEYS}

    # ------------------------------------------------------------------ feeding the LM
    @per_token
    def feed(self, cache: LMCache | None, context: torch.Tensor | None, toks: torch.Tensor, valid: torch.Tensor | None,
             kw: dict | None = None):
        """Feed ``toks [n, S]`` (only where ``valid``; ``None``: everywhere) after ``cache`` (valid mode) or
        ``context`` (recompute mode); return (logits after each position [n, S, V], cache, context)."""
        with ids_checked():  # sampled ids (below vocab_size) or a segment checked by Segment._check: no sync
            return self.feed_checked(cache, context, toks, valid, kw)

    @per_token
    def feed_checked(self, cache: LMCache | None, context: torch.Tensor | None, toks: torch.Tensor,
                     valid: torch.Tensor | None, kw: dict | None):
        n, S = toks.shape
        kw = match_rows(self.lm_kwargs, n) if kw is None else kw
        if context is None:
            if valid is None:
                logits, cache = self.lm(toks, cache=cache, **kw)
            else:
                feed = torch.where(valid, toks, torch.full_like(toks, BOS_ID))
                logits, cache = self.lm(feed, cache=cache, valid=valid, **kw)
            return logits, cache, None
        if valid is None:
            valid = torch.ones_like(toks, dtype=torch.bool)
        ctx = left_pack(torch.cat([context, torch.where(valid, toks, torch.zeros_like(toks))], 1))
        if ctx.shape[1] > getattr(self.lm, "max_len", ctx.shape[1]):  # padding columns only (no sync otherwise)
            ctx = trim_padding(ctx)
        plen0 = (context != PAD_ID).sum(-1)
        full, _ = self.lm(ctx, **kw)
        pos = (plen0 - 1)[:, None] + torch.cumsum(valid.long(), 1)
        logits = full.gather(1, pos.clamp(min=0)[..., None].expand(n, S, full.shape[-1]))
        return logits, None, ctx
