"""Pyro distributions over token sequences given an autoregressive LM (docs/architecture.md, "Sequence sites").

:class:`LMSequence` is the site every slow-thinking program is made of. It draws a batch of
sequences through the one decoding loop, :class:`~ppl_thought.distributions.lm_state.LMState`
(``LMSequence.start(n).segment()``: one KV-cached lockstep loop, particles are the batch), with the
automaton mask applied to the logits before the softmax (Def 2.8), and scores sequences with one
teacher-forced pass: log P(z) = sum_i log softmax(f~(z_<i))_{z_i}, the prefix probability
P^{<=|z|}(z) of (2.13)/(2.22) under the masked parametrization.

A trainable LM is registered with Pyro when the distribution is built (:func:`register_lm`), so that
SVI trains it without a ``pyro.module`` call in the user's program.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought import checks
from ppl_thought.checks import integer
from ppl_thought.distributions.lm_state import LMState, TokenRule, check_no_nan, chunk_size, trim_padding, upcast
from ppl_thought.distributions.registry import register_lm
from ppl_thought.errors import ConfigError, MalformedSequenceError, UnknownTokenError
from ppl_thought.lm.base import lm_device, match_rows
from ppl_thought.projections.automaton import Automaton
from ppl_thought.projections.token_lift import check_tokenizer
from ppl_thought.validation import ArrayLike, checked, per_token
from ppl_thought.vocab import BOS_ID, PAD_ID, Vocab


def _ids(seq, vocab: Vocab | None, what: str, device=None) -> torch.Tensor:
    """Token ids of ``seq`` (text with ``vocab``, ids, a tensor) as a LongTensor on ``device`` (CPU if None)."""
    device = torch.device("cpu") if device is None else device
    if isinstance(seq, str) or (isinstance(seq, (list, tuple)) and seq and isinstance(seq[0], str)):
        if vocab is None:
            raise ConfigError(f"{what} is given as text; pass vocab= to LMSequence")
        return torch.tensor(vocab.encode(seq), dtype=torch.long, device=device)
    t = torch.as_tensor(seq, device=device)
    if t.numel() == 0:
        return torch.zeros(t.shape[:-1] + (0,) if t.ndim else (0,), dtype=torch.long, device=device)
    if t.dtype in (torch.float16, torch.float32, torch.float64, torch.bool):
        raise MalformedSequenceError(f"{what} must hold integer token ids, got dtype {t.dtype}")
    return t.long()


@checked
def concat(*parts: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """Concatenate right-padded token arrays row by row, keeping the result right-padded.

    ``concat(question, thought)`` for a prompt built from a sampled (padded) thought: padding
    inside a row would otherwise sit between the parts. At least one part; every part token ids (not floats,
    bools or text) and ``pad_id`` a non-negative integer (:class:`~ppl_thought.errors.PPLThoughtError` otherwise).
    """
    if not parts:
        raise ConfigError("concat needs at least one token array, got none")
    pad_id = checks.integer("pad_id", pad_id, 0)
    for i, p in enumerate(parts):
        checks.token_ids(f"concat: part {i}", p)
    dev = next((p.device for p in parts if isinstance(p, torch.Tensor)), torch.device("cpu"))
    parts = [torch.as_tensor(p, dtype=torch.long, device=dev) for p in parts]
    batch = torch.broadcast_shapes(*[p.shape[:-1] for p in parts])
    parts = [p.expand(batch + p.shape[-1:]) for p in parts]
    cat = torch.cat(parts, dim=-1)
    keep = cat != pad_id
    # stable sort moving pads to the end, preserving the order of real tokens
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    return trim_padding(torch.gather(cat, -1, order), pad_id)


@checked
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
        name: the name a trainable ``lm`` is registered under with ``pyro.module`` (:func:`register_lm`;
            by default the name its parameters have in the param store, else one derived from its type).
            Frozen LMs are not registered.
        chunk: chunked encoding (end of Section 5.6.2) when sampling: runs of up to ``chunk`` forced tokens
            (the one token the constraint admits, e.g. the text between sparse thoughts under a lifting) are
            fed to the LM in one pass instead of one decoding step each; same samples and log-probabilities
            as ``chunk=0`` (token by token, the default). See :class:`LMState`.

    ``<pad>`` and ``<bos>`` are never generated. Values are LongTensors ``[*batch, max_len]``.
    ``log_prob`` is ``-inf`` (never NaN) for sequences outside the constraint, incomplete
    sequences and sequences continuing past their end; malformed input (ids outside the
    vocabulary, padding in the middle, too long) raises an error naming the problem.

    Sampling runs the one decoding loop: :meth:`start` gives the :class:`LMState` of ``n`` rows and its
    segment that ends with the sequence is sampled. Rows are laid out ``sample_shape + batch_shape``
    (flattened); a batched prompt is expanded to ``batch_shape`` and repeated over the sample shape.
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)
    has_rsample = False

    def __init__(
        self,
        lm: torch.nn.Module,
        prompt: ArrayLike | None = None,
        constraint: Automaton | None = None,
        stop: str | int | Sequence[str | int] | torch.Tensor | None = None,
        max_len: int | None = None,
        vocab: Vocab | None = None,
        batch_shape: torch.Size | tuple = (),
        lm_kwargs: dict | None = None,
        validate_args: bool | None = None,
        *,
        name: str | None = None,
        chunk: int = 0,
    ):
        self.lm = lm
        self.chunk = chunk_size(chunk)
        self.vocab = vocab
        self.vocab_size = int(lm.vocab_size)
        if vocab is not None and len(vocab) != self.vocab_size:
            raise ConfigError(f"vocab has {len(vocab)} tokens but the LM has vocab_size {self.vocab_size}")
        # right padding of the prompt (columns that are <pad> in every row) is not context: dropped
        self.prompt = trim_padding(_ids(prompt if prompt is not None else [], vocab, "prompt", lm_device(lm)))
        self._check_range(self.prompt, "prompt")
        if constraint is not None and constraint.vocab_size != self.vocab_size:
            raise ConfigError(
                f"constraint automaton has {constraint.vocab_size} token columns, LM has {self.vocab_size}"
            )
        for owner, where in ((lm, "LMSequence"), (self, "LMSequence (its vocab=)")):
            check_tokenizer(constraint, owner, where)  # lm.vocab / vocab=: an automaton of other texts is refused
        self.constraint = constraint
        self.stop_ids = self._stop_ids(stop)
        if max_len is None:
            if constraint is None or constraint.max_len is None:
                raise ConfigError("LMSequence needs max_len (the constraint does not bound the length)")
            max_len = constraint.max_len
        self.max_len = integer("max_len", max_len, minimum=0)
        self.lm_kwargs = dict(lm_kwargs or {})
        batch_shape = torch.Size(batch_shape)
        if self.prompt.ndim > 1:
            batch_shape = torch.broadcast_shapes(batch_shape, self.prompt.shape[:-1])
        super().__init__(batch_shape, torch.Size([self.max_len]), validate_args=validate_args)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rule = TokenRule(constraint, self.vocab_size)  # the masked softmax of Def 2.8
        self.lm_name = register_lm(lm, name)

    # ------------------------------------------------------------------ set-up helpers
    def _stop_ids(self, stop) -> torch.Tensor:
        if stop is None:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        items = list(stop) if isinstance(stop, list | tuple | torch.Tensor) else [stop]
        out = []
        for s in items:
            if isinstance(s, str):
                if self.vocab is None:
                    raise ConfigError(f"stop token {s!r} given as text; pass vocab= to LMSequence")
                out.append(self.vocab.id(s))
            else:
                out.append(integer("a stop token id", s.item() if isinstance(s, torch.Tensor) else s, minimum=0))
        t = torch.tensor(out, dtype=torch.long, device=self.device)
        self._check_range(t, "stop tokens")
        return t

    def _check_range(self, t: torch.Tensor, what: str) -> None:
        if t.numel() and (t.min() < 0 or t.max() >= self.vocab_size):
            bad = t[(t < 0) | (t >= self.vocab_size)][:5].tolist()
            raise UnknownTokenError(f"{what} contain ids {bad} outside the vocabulary [0, {self.vocab_size})")

    @per_token
    def expand(self, batch_shape: Sequence[int], _instance: LMSequence | None = None):
        new = self._get_checked_instance(LMSequence, _instance)
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_batch_shape"})
        new._last = None
        TorchDistribution.__init__(new, torch.Size(batch_shape), self.event_shape, validate_args=False)
        return new

    @property
    def device(self) -> torch.device:
        """The LM's device: where samples, masks and log-probabilities are made."""
        return lm_device(self.lm)

    def _mask(self, auto: torch.Tensor) -> torch.Tensor:
        """Admissible next tokens ``[n, V]``: the constraint's mask (2.26), never <pad>/<bos>.

        One gather from a cached ``[S + 1, V]`` table (the last row is the dead state).
        """
        return self.rule.allowed(auto)

    def _ends(self, tok: torch.Tensor, auto: torch.Tensor) -> torch.Tensor:
        if len(self.stop_ids):
            ends = torch.isin(tok, self.stop_ids.to(tok.device))
        else:
            ends = torch.zeros(tok.shape, dtype=torch.bool, device=tok.device)
        if self.constraint is not None:
            ends = ends | self.constraint.is_final(auto)
        return ends

    # ------------------------------------------------------------------ the decoding loop
    def _prompt_rows(self, batch: torch.Size, n: int) -> torch.Tensor:
        """Per-row prompts ``[n, P]`` right-padded: the batched prompt expanded to ``batch`` and repeated
        over the leading (sample) rows; row ``i`` of the ``n`` has prompt ``i % batch.numel()``."""
        p = self.prompt.to(self.device)
        rows = p.expand(batch + p.shape[-1:]).reshape(-1, p.shape[-1])
        if rows.shape[0] == 0 or n % rows.shape[0]:
            raise MalformedSequenceError(f"{rows.shape[0]} prompts for {n} rows")
        return rows.repeat(n // rows.shape[0], 1)

    def start(self, n: int | None = None) -> LMState:
        """The :class:`LMState` of ``n`` rows (default: the batch) at the start of the sequence: ``<bos> +
        prompt`` encoded (a shared prompt once, its cache expanded), under this distribution's constraint,
        stop tokens, ``max_len`` and ``lm_kwargs``. ``start(n).segment()`` is this distribution, sampled."""
        n = self.batch_shape.numel() if n is None else int(n)
        prompt = self._prompt_rows(self.batch_shape, n) if self.prompt.ndim > 1 else self.prompt
        return LMState.encode(self.lm, n, prompt, self.rule, self.max_len, self.stop_ids, self.lm_kwargs,
                               self.device, self.chunk)

    @per_token
    def lm_kwargs_for(self, n: int) -> dict:
        """LM keyword arguments with batched tensors (e.g. latents) matched to ``n`` rows."""
        return match_rows(self.lm_kwargs, n)

    # ------------------------------------------------------------------ Distribution API
    @per_token
    def sample_with_log_prob(self, sample_shape: Sequence[int] = (), generator: torch.Generator | None = None):
        """Draw sequences and their log-probabilities in one batched decoding loop: the segment of
        :meth:`start` that ends with the sequence (stop token, final state or ``max_len``), right-padded
        to ``max_len``."""
        sample_shape = (sample_shape,) if isinstance(sample_shape, int) and not isinstance(sample_shape, bool) \
            else tuple(sample_shape)
        for d in sample_shape:
            checks.integer(f"sample_shape {sample_shape}: each size", d, minimum=0)
        shape = torch.Size(sample_shape) + self.batch_shape
        n = shape.numel()
        device = self.device
        # the padded output [n, max_len] (int64) and the first step's logits and log-probabilities [n, V] (fp32)
        checks.allocation(f"LMSequence.sample of {n} sequences of max_len {self.max_len}",
                          n * (8 * self.max_len + 2 * 4 * self.vocab_size), device)
        z = torch.full((n, self.max_len), PAD_ID, dtype=torch.long, device=device)
        lp = torch.zeros(n, device=device)
        if n:
            value, lp = self.start(n).segment().sample_with_log_prob(generator)
            z[:, : value.shape[1]] = value
        return z.reshape(shape + (self.max_len,)), lp.reshape(shape)

    @per_token
    def sample(self, sample_shape: Sequence[int] = ()) -> torch.Tensor:
        z, lp = self.sample_with_log_prob(sample_shape)
        self._last = (z, lp)
        return z

    @per_token
    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """log P(value): one teacher-forced pass, the masked step log-probabilities summed (Def 2.8)."""
        if self._last is not None and value is self._last[0] and not self._needs_grad():
            return self._last[1]
        value = self._check_value(value)
        if self.prompt.ndim > 1:  # one prompt per row: broadcast the value over the prompts' batch
            value = value.expand(torch.broadcast_shapes(value.shape[:-1], self.prompt.shape[:-1]) + value.shape[-1:])
        batch = value.shape[:-1]
        device = self.device
        # padding columns (<pad> in every row) are no tokens: the LM never reads them, so a value padded
        # wider than the LM's context is scored as long as its rows fit
        flat = trim_padding(value.reshape(batch.numel(), value.shape[-1]).to(device))
        if flat.numel() == 0:  # no rows, or empty sequences: complete iff the start is final
            empty_ok = self.constraint is None or bool(self.constraint.final[self.constraint.start])
            return torch.full(batch, 0.0 if empty_ok or self.max_len == 0 else float("-inf"), device=device)
        n, L = flat.shape
        if self.prompt.ndim <= 1:
            ctx = torch.cat([torch.tensor([BOS_ID], device=device), self.prompt.to(device)])
            inputs = torch.cat([ctx.expand(n, -1), flat[:, :-1]], dim=1)
            logits, _ = self.lm(inputs, **self.lm_kwargs_for(n))
            logits = logits[:, ctx.shape[0] - 1 :]
        else:
            rows = self._prompt_rows(batch, n)
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
        value = torch.as_tensor(value, device=value.device if isinstance(value, torch.Tensor) else self.device)
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
        check_no_nan(lp, self.lm)
        return torch.where(complete, lp, torch.full_like(lp, float("-inf")))

    @per_token
    def step_log_probs(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token masked log-probabilities ``[..., L]`` (0 on padding) and completeness ``[...]``.

        The prefix sums are log P(z_{<=k}) (Def 2.8), e.g. the marginal Q(z | x) = int Q(zs | xy) ds
        of Remark 3.5 restricted to the first |z| tokens. One teacher-forced pass.
        """
        value = self._check_value(value)
        if self.prompt.ndim > 1:  # one prompt per row: broadcast the value over the prompts' batch
            value = value.expand(torch.broadcast_shapes(value.shape[:-1], self.prompt.shape[:-1]) + value.shape[-1:])
        batch = value.shape[:-1]
        device = self.device
        width = value.shape[-1]
        flat = trim_padding(value.reshape(batch.numel(), width).to(device))  # padding columns: no LM positions
        n, L = flat.shape
        if L == 0 or n == 0:  # empty rows: complete iff the start is final (as in log_prob)
            complete = (self._steps(flat, torch.zeros(n, 0, self.vocab_size, device=device))[1] if n
                        else torch.zeros(0, dtype=torch.bool, device=device))
            return torch.zeros(batch + (width,), device=device), complete.reshape(batch)
        if self.prompt.ndim > 1:
            raise NotImplementedError("step_log_probs supports a prompt shared by every row")
        ctx = torch.cat([torch.tensor([BOS_ID], device=device), self.prompt.to(device)])
        inputs = torch.cat([ctx.expand(n, -1), flat[:, :-1]], dim=1)
        logits, _ = self.lm(inputs, **self.lm_kwargs_for(n))
        steps, complete = self._steps(flat, logits[:, ctx.shape[0] - 1 :])
        steps = torch.nn.functional.pad(steps, (0, width - L))
        return steps.reshape(batch + (width,)), complete.reshape(batch)

    def _steps(self, z: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, L = z.shape
        lengths = (z != PAD_ID).sum(-1)
        # automaton states before each token; sequential in L, vectorised over rows
        auto = torch.empty(n, L + 1, dtype=torch.long, device=z.device)
        auto[:, 0] = self.constraint.start if self.constraint is not None else 0
        if self.constraint is not None:
            table = self.constraint.device_table("table", z.device)
            for i in range(L):
                auto[:, i + 1] = table[auto[:, i], z[:, i]]
        else:
            auto.zero_()
        mask = self._mask(auto[:, :L].reshape(-1)).reshape(n, L, -1)
        masked = upcast(logits).masked_fill(~mask, float("-inf"))  # float32 for half-precision LMs
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
