"""Pyro distributions over token sequences given an autoregressive LM (ARCHITECTURE.md, "Sequence sites").

:class:`LMSequence` is the site every slow-thinking program is made of. It draws a batch of
sequences in one KV-cached decoding loop (particles are the batch) with the automaton mask
applied to the logits before the softmax (Def 2.8), and scores sequences with one
teacher-forced pass: log P(z) = sum_i log softmax(f~(z_<i))_{z_i}, the prefix probability
P^{<=|z|}(z) of (2.13)/(2.22) under the masked parametrization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought.errors import MalformedSequenceError, UnknownTokenError
from ppl_thought.lm.base import match_rows
from ppl_thought.projections.automaton import Automaton
from ppl_thought.vocab import Vocab

PAD_ID, BOS_ID = 0, 1  # fixed by ppl_thought.vocab


def _ids(seq, vocab: Vocab | None, what: str) -> torch.Tensor:
    if isinstance(seq, str) or (isinstance(seq, (list, tuple)) and seq and isinstance(seq[0], str)):
        if vocab is None:
            raise ValueError(f"{what} is given as text; pass vocab= to LMSequence")
        return torch.tensor(vocab.encode(seq), dtype=torch.long)
    t = torch.as_tensor(seq)
    if t.numel() == 0:
        return torch.zeros(t.shape[:-1] + (0,) if t.ndim else (0,), dtype=torch.long)
    if t.dtype in (torch.float16, torch.float32, torch.float64, torch.bool):
        raise MalformedSequenceError(f"{what} must hold integer token ids, got dtype {t.dtype}")
    return t.long()


def trim_padding(tokens: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """Drop the padding columns that every row has (right-padded [..., L] -> [..., L'])."""
    if tokens.shape[-1] == 0:
        return tokens
    used = (tokens != pad_id).reshape(-1, tokens.shape[-1]).any(0)
    n = int(used.nonzero().max()) + 1 if used.any() else 0
    return tokens[..., :n]


def concat(*parts: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """Concatenate right-padded token arrays row by row, keeping the result right-padded.

    ``concat(question, thought)`` for a prompt built from a sampled (padded) thought: padding
    inside a row would otherwise sit between the parts.
    """
    parts = [torch.as_tensor(p, dtype=torch.long) for p in parts]
    batch = torch.broadcast_shapes(*[p.shape[:-1] for p in parts])
    parts = [p.expand(batch + p.shape[-1:]) for p in parts]
    cat = torch.cat(parts, dim=-1)
    keep = cat != pad_id
    # stable sort moving pads to the end, preserving the order of real tokens
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    return trim_padding(torch.gather(cat, -1, order), pad_id)


@dataclass
class DecodeState:
    """Where a batch of partial sequences stands (the segment protocol: init / extend / reorder).

    ``tokens`` ``[n, t]`` right-padded; ``lengths`` ``[n]``; ``auto`` automaton states ``[n]``;
    ``done`` rows that reached a stop token, a final state or ``max_len``; ``log_prob`` the
    masked log-probability of each row so far; ``logits`` the next-token logits; ``cache``
    the LM cache (``None`` on the slow ragged-prompt path).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    auto: torch.Tensor
    done: torch.Tensor
    log_prob: torch.Tensor
    logits: torch.Tensor
    cache: object
    context: torch.Tensor | None = None  # full inputs, ragged path only

    def reorder(self, index: torch.Tensor) -> DecodeState:
        """Gather rows (resampling): every per-row tensor and the KV cache by ``index``."""
        return DecodeState(
            self.tokens[index], self.lengths[index], self.auto[index], self.done[index],
            self.log_prob[index], self.logits[index],
            self.cache.reorder(index) if self.cache is not None else None,
            self.context[index] if self.context is not None else None,
        )


class LMSequence(TorchDistribution):
    """A distribution over token sequences: an LM decoded under an automaton constraint (Def 2.8).

    Args:
        lm: an autoregressive LM (``forward(tokens, cache=None, **kw) -> (logits, cache)``).
        prompt: context after ``<bos>``: 1-D ids shared by every row, or ``[*batch, P]``
            right-padded ids (one prompt per row), or text (with ``vocab``).
        constraint: an :class:`~ppl_thought.projections.Automaton`; logits of inadmissible tokens
            are set to ``-inf`` before the softmax, and reaching a final state ends the sequence.
        stop: token(s) that end a sequence (included in it), e.g. ``"</s>"`` or ``"<eos>"``.
        max_len: the event length; sequences are right-padded with ``<pad>`` to it. Defaults to
            ``constraint.max_len``. A sequence that reaches ``max_len`` without a stop is a
            complete outcome (its probability is that of the prefix).
        vocab: needed for text prompts and stop strings.
        lm_kwargs: extra keyword arguments of ``lm.forward`` (e.g. ``latents`` for cross-attention).

    ``<pad>`` and ``<bos>`` are never generated. Values are LongTensors ``[*batch, max_len]``.
    ``log_prob`` is ``-inf`` (never NaN) for sequences outside the constraint, incomplete
    sequences and sequences continuing past their end; malformed input (ids outside the
    vocabulary, padding in the middle, too long) raises an error naming the problem.
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)
    has_rsample = False

    def __init__(
        self,
        lm: torch.nn.Module,
        prompt=None,
        constraint: Automaton | None = None,
        stop: str | int | Sequence[str | int] | None = None,
        max_len: int | None = None,
        vocab: Vocab | None = None,
        batch_shape: torch.Size | tuple = (),
        lm_kwargs: dict | None = None,
        validate_args: bool | None = None,
    ):
        self.lm = lm
        self.vocab = vocab
        self.vocab_size = int(lm.vocab_size)
        if vocab is not None and len(vocab) != self.vocab_size:
            raise ValueError(f"vocab has {len(vocab)} tokens but the LM has vocab_size {self.vocab_size}")
        self.prompt = _ids(prompt if prompt is not None else [], vocab, "prompt")
        self._check_range(self.prompt, "prompt")
        if constraint is not None and constraint.vocab_size != self.vocab_size:
            raise ValueError(
                f"constraint automaton has {constraint.vocab_size} token columns, LM has {self.vocab_size}"
            )
        self.constraint = constraint
        self.stop_ids = self._stop_ids(stop)
        if max_len is None:
            if constraint is None or constraint.max_len is None:
                raise ValueError("LMSequence needs max_len (the constraint does not bound the length)")
            max_len = constraint.max_len
        if max_len < 0:
            raise ValueError(f"max_len must be >= 0, got {max_len}")
        self.max_len = int(max_len)
        self.lm_kwargs = dict(lm_kwargs or {})
        batch_shape = torch.Size(batch_shape)
        if self.prompt.ndim > 1:
            batch_shape = torch.broadcast_shapes(batch_shape, self.prompt.shape[:-1])
        super().__init__(batch_shape, torch.Size([self.max_len]), validate_args=validate_args)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._allowed: dict[str, torch.Tensor] = {}  # device -> admissible-token table

    # ------------------------------------------------------------------ set-up helpers
    def _stop_ids(self, stop) -> torch.Tensor:
        if stop is None:
            return torch.zeros(0, dtype=torch.long)
        items = [stop] if isinstance(stop, (str, int)) else list(stop)
        out = []
        for s in items:
            if isinstance(s, str):
                if self.vocab is None:
                    raise ValueError(f"stop token {s!r} given as text; pass vocab= to LMSequence")
                out.append(self.vocab.id(s))
            else:
                out.append(int(s))
        t = torch.tensor(out, dtype=torch.long)
        self._check_range(t, "stop tokens")
        return t

    def _check_range(self, t: torch.Tensor, what: str) -> None:
        if t.numel() and (t.min() < 0 or t.max() >= self.vocab_size):
            bad = t[(t < 0) | (t >= self.vocab_size)][:5].tolist()
            raise UnknownTokenError(f"{what} contain ids {bad} outside the vocabulary [0, {self.vocab_size})")

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(LMSequence, _instance)
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_batch_shape"})
        new._last = None
        TorchDistribution.__init__(new, torch.Size(batch_shape), self.event_shape, validate_args=False)
        return new

    def _device(self) -> torch.device:
        p = next(iter(self.lm.parameters()), None)
        if p is None:
            p = next(iter(self.lm.buffers()), None)
        return p.device if p is not None else torch.device("cpu")

    def _mask(self, auto: torch.Tensor) -> torch.Tensor:
        """Admissible next tokens ``[n, V]``: the constraint's mask (2.26), never <pad>/<bos>.

        One gather from a cached ``[S + 1, V]`` table (the last row is the dead state).
        """
        key = str(auto.device)
        table = self._allowed.get(key)
        if table is None:
            if self.constraint is None:
                table = torch.ones(1, self.vocab_size, dtype=torch.bool, device=auto.device)
            else:
                table = self.constraint.torch_table(auto.device) >= 0
            table = table.clone()
            table[:, PAD_ID] = False
            table[:, BOS_ID] = False
            self._allowed[key] = table
        if self.constraint is None:
            return table.expand(auto.shape[0], -1)
        return table[auto]

    def _ends(self, tok: torch.Tensor, auto: torch.Tensor) -> torch.Tensor:
        if len(self.stop_ids):
            ends = torch.isin(tok, self.stop_ids.to(tok.device))
        else:
            ends = torch.zeros(tok.shape, dtype=torch.bool, device=tok.device)
        if self.constraint is not None:
            ends = ends | self.constraint.is_final(auto)
        return ends

    # ------------------------------------------------------------------ segment protocol
    def _rows_prompt(self, n: int, device) -> torch.Tensor:
        """Per-row prompts ``[n, P]`` right-padded (for batched prompts)."""
        p = self.prompt.to(device)
        return p.reshape(-1, p.shape[-1]).repeat_interleave(n // max(1, p.reshape(-1, p.shape[-1]).shape[0]), 0)

    def init(self, n: int) -> DecodeState:
        """Encode ``<bos> + prompt`` once and share it among ``n`` rows (``cache.expand``)."""
        device = self._device()
        auto0 = (
            self.constraint.start_states(n, device) if self.constraint is not None
            else torch.zeros(n, dtype=torch.long, device=device)
        )
        empty = torch.zeros(n, 0, dtype=torch.long, device=device)
        zeros = torch.zeros(n, dtype=torch.long, device=device)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        if self.constraint is not None:
            done = self.constraint.is_final(auto0)
        if self.max_len == 0:
            done = torch.ones_like(done)
        lp = torch.zeros(n, device=device)
        if self.prompt.ndim <= 1:
            ctx = torch.cat([torch.tensor([BOS_ID], device=device), self.prompt.to(device)])[None]
            logits, cache = self.lm(ctx, **self.lm_kwargs_for(1))
            return DecodeState(empty, zeros, auto0, done, lp, logits[:, -1].expand(n, -1), cache.expand(n))
        # ragged prompts: rows may have prompts of different lengths; recompute without a cache
        rows = self._rows_prompt(n, device)
        if rows.shape[0] != n:
            raise MalformedSequenceError(f"{rows.shape[0]} prompts for {n} rows")
        ctx = concat(torch.full((n, 1), BOS_ID, device=device), rows)
        plen = (ctx != PAD_ID).sum(-1)
        if (plen == plen[0]).all():
            logits, cache = self.lm(ctx, **self.lm_kwargs_for(n))
            return DecodeState(empty, zeros, auto0, done, lp, logits[:, -1], cache)
        logits, _ = self.lm(ctx, **self.lm_kwargs_for(n))
        last = logits[torch.arange(n, device=device), plen - 1]
        return DecodeState(empty, zeros, auto0, done, lp, last, None, ctx)

    def lm_kwargs_for(self, n: int) -> dict:
        """LM keyword arguments with batched tensors (e.g. latents) matched to ``n`` rows."""
        return match_rows(self.lm_kwargs, n)

    def extend(self, state: DecodeState, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> DecodeState:
        """Append one token per row (``tokens [n]``; ignored for finished rows), scoring it.

        The step log-probability log softmax(f~)_{token} of Def 2.8 is added to ``log_prob``;
        tokens outside the mask give ``-inf``. ``mask`` is ``self._mask(state.auto)`` if the caller
        has it already. When every row is finished after this token, the LM is not run again.
        """
        n = tokens.shape[0]
        active = ~state.done
        mask = self._mask(state.auto) if mask is None else mask
        masked = state.logits.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(masked, -1)
        tok_logit = masked.gather(-1, tokens[:, None]).squeeze(-1)
        step_lp = torch.where(torch.isneginf(tok_logit), torch.full_like(lse, float("-inf")), tok_logit - lse)
        tok = torch.where(active, tokens, torch.full_like(tokens, PAD_ID))
        new_auto = state.auto
        if self.constraint is not None:
            new_auto = torch.where(active, self.constraint.step(state.auto, tok), state.auto)
        lp = state.log_prob + torch.where(active, step_lp, torch.zeros_like(step_lp))
        lengths = state.lengths + active.long()
        toks = torch.cat([state.tokens, tok[:, None]], dim=1)
        done = state.done | (active & self._ends(tok, new_auto)) | (lengths >= self.max_len)
        if bool(done.all()):  # nothing will read the next logits
            return DecodeState(toks, lengths, new_auto, done, lp, state.logits, state.cache, state.context)
        if state.cache is not None:
            feed = torch.where(active, tok, torch.full_like(tok, BOS_ID))  # finished rows feed a dummy
            nxt, cache = self.lm(feed[:, None], cache=state.cache, **self.lm_kwargs_for(n))
            return DecodeState(toks, lengths, new_auto, done, lp, nxt[:, -1], cache)
        ctx = concat(state.context, tok[:, None])
        full, _ = self.lm(ctx, **self.lm_kwargs_for(n))
        plen = (ctx != PAD_ID).sum(-1)
        nxt = full[torch.arange(n, device=ctx.device), plen - 1]
        return DecodeState(toks, lengths, new_auto, done, lp, nxt, None, ctx)

    def reorder(self, state: DecodeState, index: torch.Tensor) -> DecodeState:
        return state.reorder(index)

    def draw(self, state: DecodeState, generator: torch.Generator | None = None,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """Sample one next token per row from the masked softmax (Def 2.8)."""
        mask = self._mask(state.auto) if mask is None else mask
        masked = state.logits.float().masked_fill(~mask, float("-inf"))
        dead = torch.isneginf(masked).all(-1) & ~state.done
        if dead.any():
            raise ValueError(
                f"{int(dead.sum())} rows have no admissible token of positive probability: the LM gives "
                "probability 0 to every token the constraint allows"
            )
        masked = torch.where(state.done[:, None], torch.zeros_like(masked), masked)
        probs = torch.softmax(masked, -1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    def decode(self, n: int, state: DecodeState | None = None,
               generator: torch.Generator | None = None) -> DecodeState:
        """Sample tokens for every unfinished row until each ends (stop token, final state, max_len).

        Finished rows are written out and dropped from the batch (their KV cache rows too) once
        a quarter of the batch has finished, so late steps only pay for live rows. The returned
        state has every row finished and no cache.
        """
        state = self.init(n) if state is None else state
        n = state.done.shape[0]
        device = state.done.device
        rows = torch.arange(n, device=device)
        out_tok = torch.full((n, self.max_len), PAD_ID, dtype=torch.long, device=device)
        out_len = torch.zeros(n, dtype=torch.long, device=device)
        out_auto = state.auto.clone()
        out_lp = torch.zeros(n, dtype=state.log_prob.dtype, device=device)

        def flush(st: DecodeState, which: torch.Tensor) -> None:
            idx = rows[which]
            out_tok[idx, : st.tokens.shape[1]] = st.tokens[which]
            out_len[idx], out_auto[idx], out_lp[idx] = st.lengths[which], st.auto[which], st.log_prob[which]

        with torch.no_grad():
            while not bool(state.done.all()):
                if state.cache is not None and float(state.done.float().mean()) > 0.25:
                    flush(state, state.done)
                    keep = (~state.done).nonzero().squeeze(-1)
                    state, rows = state.reorder(keep), rows[keep]
                mask = self._mask(state.auto)
                state = self.extend(state, self.draw(state, generator, mask), mask)
            flush(state, torch.ones_like(state.done))
        return DecodeState(out_tok[:, : int(out_len.max()) if n else 0], out_len, out_auto,
                           torch.ones(n, dtype=torch.bool, device=device), out_lp, state.logits[:0], None)

    # ------------------------------------------------------------------ Distribution API
    def sample_with_log_prob(self, sample_shape=(), generator: torch.Generator | None = None):
        """Draw sequences and their log-probabilities in one batched decoding loop."""
        shape = torch.Size(sample_shape) + self.batch_shape
        n = int(torch.Size(shape).numel())
        with torch.no_grad():
            state = self.decode(n, generator=generator)
        z = torch.full((n, self.max_len), PAD_ID, dtype=torch.long, device=state.tokens.device)
        z[:, : state.tokens.shape[1]] = state.tokens
        z = z.reshape(shape + (self.max_len,))
        lp = state.log_prob.reshape(shape)
        return z, lp

    def sample(self, sample_shape=()) -> torch.Tensor:
        z, lp = self.sample_with_log_prob(sample_shape)
        self._last = (z, lp)
        return z

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """log P(value): one teacher-forced pass, the masked step log-probabilities summed (Def 2.8)."""
        if self._last is not None and value is self._last[0] and not self._needs_grad():
            return self._last[1]
        value = self._check_value(value)
        if self.prompt.ndim > 1:  # one prompt per row: broadcast the value over the prompts' batch
            value = value.expand(torch.broadcast_shapes(value.shape[:-1], self.prompt.shape[:-1]) + value.shape[-1:])
        batch = value.shape[:-1]
        device = self._device()
        if value.numel() == 0:  # no rows, or empty sequences: complete iff the start is final
            empty_ok = self.constraint is None or bool(self.constraint.final[self.constraint.start])
            return torch.full(batch, 0.0 if empty_ok or self.max_len == 0 else float("-inf"), device=device)
        flat = value.reshape(-1, value.shape[-1]).to(device)
        n, L = flat.shape
        if self.prompt.ndim <= 1:
            ctx = torch.cat([torch.tensor([BOS_ID], device=device), self.prompt.to(device)])
            inputs = torch.cat([ctx.expand(n, -1), flat[:, :-1]], dim=1)
            logits, _ = self.lm(inputs, **self.lm_kwargs_for(n))
            logits = logits[:, ctx.shape[0] - 1 :]
        else:
            rows = self._rows_prompt(n, device)
            ctx = concat(torch.full((n, 1), BOS_ID, device=device), rows)
            plen = (ctx != PAD_ID).sum(-1)
            inputs = concat(ctx, flat[:, :-1])
            logits, _ = self.lm(inputs, **self.lm_kwargs_for(n))
            pos = (plen - 1)[:, None] + torch.arange(L, device=device)
            logits = logits.gather(1, pos[..., None].expand(n, L, logits.shape[-1]))
        return self._score(flat, logits).reshape(batch)

    def _needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.lm.parameters())

    def _check_value(self, value) -> torch.Tensor:
        value = torch.as_tensor(value)
        if value.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise MalformedSequenceError(f"LMSequence values must be integer token ids, got {value.dtype}")
        value = value.long()
        if value.ndim == 0:
            raise MalformedSequenceError("LMSequence values must have a sequence dimension")
        if value.shape[-1] > self.max_len:
            extra = value[..., self.max_len :]
            if (extra != PAD_ID).any():
                raise MalformedSequenceError(
                    f"sequence of length {value.shape[-1]} is over max_len={self.max_len}"
                )
            value = value[..., : self.max_len]
        self._check_range(value, "sequence")
        nonpad = value != PAD_ID
        if value.shape[-1] and (nonpad[..., 1:] & ~nonpad[..., :-1]).any():
            raise MalformedSequenceError("padding inside a sequence: <pad> must only fill the end of a row")
        return value

    def _score(self, z: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Masked step log-probabilities of right-padded rows ``z [n, L]`` given logits ``[n, L, V]``, summed."""
        steps, complete = self._steps(z, logits)
        lp = steps.sum(-1)
        return torch.where(complete, lp, torch.full_like(lp, float("-inf")))

    def step_log_probs(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token masked log-probabilities ``[..., L]`` (0 on padding) and completeness ``[...]``.

        The prefix sums are log P(z_{<=k}) (Def 2.8), e.g. the marginal Q(z | x) = int Q(zs | xy) ds
        of Remark 3.5 restricted to the first |z| tokens. One teacher-forced pass.
        """
        value = self._check_value(value)
        if self.prompt.ndim > 1:  # one prompt per row: broadcast the value over the prompts' batch
            value = value.expand(torch.broadcast_shapes(value.shape[:-1], self.prompt.shape[:-1]) + value.shape[-1:])
        batch = value.shape[:-1]
        device = self._device()
        flat = value.reshape(-1, value.shape[-1]).to(device)
        n, L = flat.shape
        if L == 0 or n == 0:
            return torch.zeros(batch + (L,), device=device), torch.ones(batch, dtype=torch.bool, device=device)
        if self.prompt.ndim > 1:
            raise NotImplementedError("step_log_probs supports a prompt shared by every row")
        ctx = torch.cat([torch.tensor([BOS_ID], device=device), self.prompt.to(device)])
        inputs = torch.cat([ctx.expand(n, -1), flat[:, :-1]], dim=1)
        logits, _ = self.lm(inputs, **self.lm_kwargs_for(n))
        steps, complete = self._steps(flat, logits[:, ctx.shape[0] - 1 :])
        return steps.reshape(batch + (L,)), complete.reshape(batch)

    def _steps(self, z: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, L = z.shape
        lengths = (z != PAD_ID).sum(-1)
        # automaton states before each token; sequential in L, vectorised over rows
        auto = torch.empty(n, L + 1, dtype=torch.long, device=z.device)
        auto[:, 0] = self.constraint.start if self.constraint is not None else 0
        if self.constraint is not None:
            table = self.constraint.torch_table(z.device)
            for i in range(L):
                auto[:, i + 1] = table[auto[:, i], z[:, i]]
        else:
            auto.zero_()
        mask = self._mask(auto[:, :L].reshape(-1)).reshape(n, L, -1)
        masked = logits.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(masked, -1)
        tok_logit = masked.gather(-1, z[..., None]).squeeze(-1)
        step = torch.where(torch.isneginf(tok_logit), torch.full_like(lse, float("-inf")), tok_logit - lse)
        pos = torch.arange(L, device=z.device)
        inside = pos[None] < lengths[:, None]
        steps = torch.where(inside, step, torch.zeros_like(step))
        # completeness: the first end (stop token or final state) must be the last token
        ends = self._ends(z, auto[:, 1:]) & inside
        if self.constraint is not None:
            ends = ends | (self.constraint.is_final(auto[:, 0])[:, None] & (pos[None] == -1))
        first_end = torch.where(ends.any(-1), ends.float().argmax(-1), torch.full_like(lengths, L))
        start_final = (
            self.constraint.is_final(auto[:, 0]) if self.constraint is not None
            else torch.zeros(n, dtype=torch.bool, device=z.device)
        )
        complete = torch.where(
            start_final, lengths == 0,
            torch.where(ends.any(-1), first_end == lengths - 1, lengths == self.max_len),
        )
        return steps, complete

    def __repr__(self) -> str:
        c = self.constraint.name if self.constraint is not None else None
        return (f"LMSequence(lm={type(self.lm).__name__}, prompt_len={self.prompt.shape[-1]}, constraint={c}, "
                f"stop={self.stop_ids.tolist()}, max_len={self.max_len}, batch_shape={tuple(self.batch_shape)})")
