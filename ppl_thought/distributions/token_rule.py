"""Token rules: which next token is admissible after each prefix (Def 2.8), as per-device tables.

:class:`TokenRule` steps the automaton of a constraint (a domain Dom(Proj), a lifting of x) for all rows at
once: the 0 / -inf bias of the masked softmax log softmax(f~(z_<i)) of Def 2.8, the advance of the automaton
state, segment ends (``end_tables``) and the forced runs of chunked encoding (end of Section 5.6.2). The
tables come from the automaton's numpy tables (``Automaton.device_table``), cached per device. Also the
small token-array helpers every decoding path shares, the inverse-CDF draw (:func:`sample_categorical`) and
the one token step every sampler runs (:func:`token_step`: masked softmax, draw, automaton advance, end flags;
docs/architecture.md).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from ppl_thought import checks
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.projections.automaton import Automaton, forced_runs
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["MaskedLaw", "TokenRule", "TokenStep", "chunk_size", "generated_tokens", "left_pack", "log_mass_ratio",
           "masked_log_softmax",
           "nucleus", "per_row", "sample_categorical", "skip_draws", "supports_valid", "token_step", "trim_padding",
           "upcast"]


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits (bfloat16, float16) as float32, others as they are: every log-softmax, log weight,
    log Z-hat and ESS is computed in float32 or better (a bf16 log-probability has 8 bits of mantissa)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def supports_valid(lm: torch.nn.Module) -> bool:
    """Whether ``lm.forward`` takes the per-token ``valid`` mask (``valid_mask_supported`` decides if set)."""
    flag = getattr(lm, "valid_mask_supported", None)
    if flag is not None:
        return bool(flag)
    try:
        return "valid" in inspect.signature(lm.forward).parameters
    except (TypeError, ValueError):
        return False


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log softmax over admissible tokens (Def 2.8), float32; rows with none admissible are all -inf, never NaN."""
    masked = logits.float().masked_fill(~mask, float("-inf"))
    dead = torch.isneginf(masked.amax(-1, keepdim=True))  # NaN logits stay NaN (amax of NaN is NaN)
    return torch.where(dead, torch.full_like(masked, float("-inf")), masked.log_softmax(-1))


def nucleus(log_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus (top-p) truncation (Holtzman et al., 2020): keep the smallest set of most probable tokens whose
    mass reaches ``top_p`` and renormalise; rows ``[..., V]`` of log-probabilities in, the same out (-inf
    outside the nucleus). ``top_p = 1`` returns the input. The most probable token is always kept."""
    if top_p >= 1.0:
        return log_probs
    sorted_lp, order = torch.sort(log_probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_lp.exp(), -1) - sorted_lp.exp()  # mass of the tokens ranked above
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return masked_log_softmax(log_probs, keep & ~torch.isneginf(log_probs))


def generated_tokens(vocab_size: int, device=None) -> torch.Tensor:
    """Bool ``[vocab_size]``: the tokens an LM may generate, every id but ``<pad>`` and ``<bos>`` (context only,
    Section 2.2): the unconstrained row of :class:`TokenRule`'s table."""
    return TokenRule(None, vocab_size).allowed(torch.zeros(1, dtype=torch.long, device=device))[0]


# ---------------------------------------------------------------------------------------------- helpers
_LOWEST = torch.finfo(torch.float32).min


class MaskedLaw(NamedTuple):
    """Def 2.8's masked softmax of one (logits, state) pair in the form a draw and a weight read it
    (:meth:`TokenRule.masked_law`)."""

    #: ``[n, V]`` float32 (float64 for float64 logits): exp(logit_v - max admitted logit) for the admitted tokens,
    #: 0 elsewhere (an all-zero row has no admitted token); proportional to the masked softmax
    weights: torch.Tensor
    #: ``[n]`` log sum over the admitted tokens of exp(logit): the masked softmax's log normaliser (-inf: none)
    log_norm: torch.Tensor
    #: ``[n]`` the shift of ``weights`` (the largest admitted logit; 0 where it is not finite) and ``[n]`` log sum of
    #: ``weights``: log_norm = shift + log_sum, kept apart so that a token's log-probability
    #: (logit - shift) - log_sum stays exact where log_norm cannot (tied logits of 1e30: log_norm = 1e30 in float32)
    shift: torch.Tensor | None = None
    log_sum: torch.Tensor | None = None


def log_mass_ratio(rule: TokenRule, free: TokenRule, logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """log Z_t ``[n]`` = log Z_rule(s) - log Z_free(s): the log of the LM's mass on the tokens ``rule`` admits in
    states ``s`` over its mass on those ``free`` admits (Def 2.8's normalisers; the factor of Section 3.3), taken as
    (shift_rule - shift_free) + (log_sum_rule - log_sum_free) so that it stays exact for huge logits (two tied
    logits of 1e30, one admitted: -log 2, not 0); -inf (never NaN) where ``free`` admits no token."""
    sa, la = rule.log_normaliser_parts(logits, s)  # the rule's law first: its draw reads it again (kept)
    sf, lf = free.log_normaliser_parts(logits, s)
    log_z = (sa - sf) + (la - lf)
    return torch.where(torch.isneginf(lf), lf, log_z)


def _law_key(logits: torch.Tensor, s: torch.Tensor) -> tuple | None:
    """What identifies a (logits, state) pair while neither changes: the tensors (weakly) and their version
    counters. None where there is none to read (inference-mode tensors keep no version counter)."""
    if logits.is_inference() or s.is_inference():
        return None
    return weakref.ref(logits), logits._version, weakref.ref(s), s._version


def _same_key(a: tuple, b: tuple) -> bool:
    return a[0]() is b[0]() is not None and a[1] == b[1] and a[2]() is b[2]() is not None and a[3] == b[3]


@checked
class TokenRule:
    """Next-token log-probabilities from logits under an automaton constraint: the masked softmax of Def 2.8.

    The rule's state is one automaton state per row (``[n]`` long). ``<pad>`` and ``<bos>`` are never
    generated. Subclasses (the identity / predictive samplers' rule (3.30)) override
    :meth:`log_probs` and may keep a wider state ``[n, k]``.
    """

    def __init__(self, constraint: Automaton | None, vocab_size: int):
        self.constraint = constraint
        self.vocab_size = int(vocab_size)
        self._tables: dict[tuple, torch.Tensor] = {}
        self._law_memo: tuple | None = None  # (key, MaskedLaw) of the last masked_law call (see masked_law)

    def _table(self, what: str, device, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Per-device tables over automaton states (the last row is the dead state): ``allowed`` [S+1, V],
        ``bias`` (0 / -inf) [S+1, V]; and ``-inf``, a 0-d tensor of ``dtype``."""
        if what == "-inf":
            key = (what, str(device), dtype)
            if key not in self._tables:
                self._tables[key] = torch.tensor(float("-inf"), dtype=dtype, device=device)
            return self._tables[key]
        key = (what, str(device))
        table = self._tables.get(key)
        if table is None:
            if self.constraint is None:
                allowed = torch.ones(1, self.vocab_size, dtype=torch.bool, device=device)
            else:
                allowed = (self.constraint.device_table("table", device) >= 0).clone()
            allowed[:, PAD_ID] = False
            allowed[:, BOS_ID] = False
            self._tables[("allowed", str(device))] = allowed
            zero = torch.zeros((), device=device)
            self._tables[("bias", str(device))] = torch.where(allowed, zero, zero - float("inf"))
            table = self._tables[key]
        return table

    @per_token
    def allowed(self, s: torch.Tensor) -> torch.Tensor:
        table = self._table("allowed", s.device)
        return table.expand(s.shape[0], -1) if self.constraint is None else table[s]

    def start(self, n: int, device: torch.device | str | None) -> torch.Tensor:
        if self.constraint is None:
            return torch.zeros(n, dtype=torch.long, device=device)
        return self.constraint.start_states(n, device)

    @per_token
    def log_probs(self, logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """log softmax of the logits plus the state's 0 / -inf bias (Def 2.8), float32; a row with no
        admissible token is all -inf (never NaN)."""
        bias = self._table("bias", s.device)
        x = logits.float() + (bias if self.constraint is None else bias[s])
        # (faster than log_softmax for small vocabularies on CPU); the largest logit subtracted first, so that the
        # normaliser of huge tied logits keeps its log 2 (1e30 + log 2 is 1e30 in float32; not finite: shift by 0);
        # an all -inf row has normaliser -inf: clamped to the lowest float it leaves the row -inf instead of NaN
        x = x - x.amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
        return x - torch.logsumexp(x, -1, keepdim=True).clamp(min=_LOWEST)

    @per_token
    def masked_law(self, logits: torch.Tensor, s: torch.Tensor, *, take: bool = False) -> MaskedLaw:
        """The masked softmax of Def 2.8 for rows ``logits [n, V]`` in states ``s``, as the draw and the weight need
        it: unnormalised weights and the log normaliser log Z(s) = log sum_{v admitted in s} exp(logit_v), in one
        pass with one ``[n, V]`` buffer (no log-probability table; :meth:`log_probs` is the same law as a table).

        Computed once per (logits, state) pair: the result is kept until either tensor changes (their version
        counters) or another pair is asked for, so a program that weights a step by the mass of the admitted
        tokens (``Constrained.log_mass``, the factors log Z_t of Section 3.3) and then draws the token from the
        same law (:func:`token_step`) pays for one pass. The weights live in a buffer the rule reuses: read them
        before the rule's next ``masked_law``. ``take=True`` hands them to the caller, who may then change them in
        place (the draw does), and forgets them. Only the plain rule of this class has it
        (subclasses with their own :meth:`log_probs` do not), and only without gradients."""
        key = _law_key(logits, s)
        law = self._kept_law(key) or self._compute_law(logits, s)
        self._law_memo = None if take or key is None else (key, law)
        return law

    def _kept_law(self, key: tuple | None) -> MaskedLaw | None:
        """The law :meth:`masked_law` kept, when it was computed for the pair ``key`` names."""
        memo = self._law_memo
        return memo[1] if key is not None and memo is not None and _same_key(memo[0], key) else None

    @per_token
    def log_normaliser(self, logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``[n]`` log Z(s), the log normaliser of :meth:`masked_law` (the kept law's when it is there). Without a
        constraint the admitted tokens are every id but ``<pad>`` (0) and ``<bos>`` (1), a slice of the logits: the
        sum is taken in a scratch buffer the rule keeps, and no weights are kept."""
        shift, log_sum = self.log_normaliser_parts(logits, s)
        return shift + log_sum

    @per_token
    def log_normaliser_parts(self, logits: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shift [n], log_sum [n])`` with log Z(s) = shift + log_sum (:meth:`log_normaliser`): the largest admitted
        logit (0 where not finite) and the log sum of exp(logit - shift), apart, for differences of normalisers
        that stay exact with huge logits (:func:`log_mass_ratio`)."""
        kept = self._kept_law(_law_key(logits, s))
        if kept is None and (self.constraint is not None or logits.requires_grad and torch.is_grad_enabled()):
            kept = self.masked_law(logits, s)
        if kept is not None:
            return kept.shift, kept.log_sum
        x = upcast(logits)[..., BOS_ID + 1:]  # every generated token (PAD_ID, BOS_ID = 0, 1)
        m = x.amax(-1, keepdim=True).nan_to_num_(0.0, 0.0, 0.0)  # not finite: shift by 0
        return m.squeeze(-1), torch.sub(x, m, out=self._buffer("scratch", x)).exp_().sum(-1).log()

    def _compute_law(self, logits: torch.Tensor, s: torch.Tensor) -> MaskedLaw:
        x = upcast(logits)
        allowed = self._table("allowed", s.device)
        allowed = allowed if self.constraint is None else allowed[s]  # [1, V] broadcast or [n, V]
        w = self._buffer("law", x)  # masked logits, then their weights, in place
        torch.where(allowed, x, self._table("-inf", x.device, x.dtype), out=w)
        m = w.amax(-1, keepdim=True)
        shift = m.nan_to_num(0.0, 0.0, 0.0)
        w.sub_(shift).exp_()  # a dead row (m = -inf) all 0; not finite m: shift by 0
        shift, log_sum = shift.squeeze(-1), w.sum(-1).log()
        return MaskedLaw(w, shift + log_sum, shift, log_sum)

    def _buffer(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """A contiguous ``[n, V]`` buffer shaped like ``x`` (the weights of :meth:`masked_law`, the scratch of
        :meth:`log_normaliser`): kept by the rule under ``name`` and reused (a fresh ``[n, V]`` tensor per token
        costs as much as the softmax, its pages faulted in anew), grown to the most rows asked for; a fresh tensor
        where gradients flow."""
        if x.requires_grad and torch.is_grad_enabled() or x.ndim != 2:
            return torch.empty_like(x, memory_format=torch.contiguous_format)
        key = (name, x.dtype, str(x.device))
        buf = self._tables.get(key)
        if buf is None or buf.shape[0] < x.shape[0] or buf.shape[1] != x.shape[1]:
            buf = self._tables[key] = torch.empty(max(x.shape[0], 0 if buf is None else buf.shape[0]), x.shape[1],
                                                  dtype=x.dtype, device=x.device)
        return buf[: x.shape[0]]

    @per_token
    def inactive_row(self, device: torch.device | str | None) -> torch.Tensor:
        """``[1, V]`` (default float dtype): all the mass on ``<pad>``, the law an inactive row draws from in
        :func:`token_step` (cached per device)."""
        key = ("inactive", device, torch.get_default_dtype())  # (not str(device): read at every token)
        row = self._tables.get(key)
        if row is None:
            row = self._tables[key] = _pad_row(self.vocab_size, device)
        return row

    @per_token
    def step(self, s: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return s if self.constraint is None else self.constraint.step(s, tok)

    @per_token
    def advance(self, s: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """:meth:`step`, except that rows reading ``<pad>`` keep their state (right-padded batches)."""
        if self.constraint is None:
            return s
        if type(self).step is TokenRule.step and hasattr(self.constraint, "advance"):
            return self.constraint.advance(s, tok)
        return torch.where(per_row(tok != PAD_ID, s), self.step(s, tok), s)

    @per_token
    def is_final(self, s: torch.Tensor) -> torch.Tensor:
        if self.constraint is None:
            return torch.zeros(s.shape[0], dtype=torch.bool, device=s.device)
        return self.constraint.is_final(s)

    @per_token
    def num_emitted(self, s: torch.Tensor) -> torch.Tensor:
        if self.constraint is None:
            raise MalformedSequenceError("until_emitted needs a constraint automaton that counts observables")
        return self.constraint.num_emitted(s)

    @per_token
    def end_tables(self, until: int | None,
                   device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Bool tables over states (last row: dead): (a segment that must reach ``until`` observables
        ends here, the sequence ends here). ``None`` for rules whose state is not one automaton state
        (subclasses): the engine then asks ``is_final`` / ``num_emitted``."""
        if type(self).is_final is not TokenRule.is_final or type(self).num_emitted is not TokenRule.num_emitted:
            return None
        key = ("ends", until, str(device))
        tabs = self._tables.get(key)
        if tabs is None:
            if self.constraint is None:
                final = torch.zeros(1, dtype=torch.bool, device=device)
                if until is not None:
                    return None
                seg = final
            else:
                final = self.constraint.device_table("final", device)
                seg = final if until is None else final | (self.constraint.device_table("emitted", device) >= until)
            tabs = (seg, final)
            self._tables[key] = tabs
        return tabs

    @per_token
    def forced_runs(self, until: int | None, stop_ids: torch.Tensor, limit: int, device: torch.device | str | None):
        """Per-state tables of the *forced runs* of chunked encoding (end of Section 5.6.2), or ``None`` for rules
        that are not one automaton state per row with the masked softmax of Def 2.8 (subclasses).

        A token is forced in a state when it is the only admissible one there: the masked softmax gives it
        probability 1 (log-probability 0) whatever the logits, so no decoding decision is made. From each
        state the run follows forced tokens for at most ``limit`` tokens and stops before a token that would
        end the segment (``until`` observables emitted, a final state) or the sequence, or that is a stop id;
        the sampling loop then feeds the run in one pass of the LM. Returns (run length ``[S + 1]`` long,
        tokens ``[S + 1, limit]`` (``<pad>`` past the run), states ``[S + 1, limit + 1]``: the state before each
        run token and after the run (held once the run stops)); the last row is the dead state (no run).
        Cached per (until, stop ids, limit, device).
        """
        if (self.constraint is None or type(self).log_probs is not TokenRule.log_probs
                or type(self).step is not TokenRule.step or self.end_tables(until, device) is None):
            return None
        stops = tuple(int(t) for t in stop_ids.reshape(-1).tolist())
        key = ("forced", until, stops, int(limit), str(device))
        tabs = self._tables.get(key)
        if tabs is None:
            tabs = self._tables[key] = _forced_runs(self.constraint, self.vocab_size, until, stops, int(limit), device)
        return tabs


def _forced_runs(auto, vocab_size: int, until: int | None, stops: tuple, limit: int, device):
    """The tables of :meth:`TokenRule.forced_runs` (numpy, :func:`~ppl_thought.projections.automaton.forced_runs`,
    shared with the JAX side) on ``device``."""
    return tuple(torch.as_tensor(a, device=device) for a in forced_runs(auto, until, stops, limit))


def per_row(mask: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A per-row mask ``[n]`` shaped to broadcast against a per-row state ``s [n, ...]``."""
    return mask.reshape((-1,) + (1,) * (s.ndim - 1))


def chunk_size(chunk) -> int:
    """The ``chunk`` option: a non-negative int (0: token by token)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int | np.integer) or chunk < 0:
        raise ConfigError(f"chunk must be a non-negative int (the longest run of forced tokens encoded in one "
                          f"pass; 0: token by token), got {chunk!r}")
    return int(chunk)


@checked
def trim_padding(tokens: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """Drop the padding columns that every row has (right-padded [..., L] -> [..., L']). One host sync.
    ``tokens`` must hold integer ids (:class:`~ppl_thought.errors.MalformedSequenceError` for floats or bools)."""
    checks.id_dtype("tokens", tokens.dtype)
    if tokens.ndim == 0:
        raise MalformedSequenceError(f"tokens must be right-padded token ids [..., L], got a 0-d tensor {tokens!r}")
    if tokens.shape[-1] == 0:
        return tokens
    used = (tokens != pad_id).reshape(-1, tokens.shape[-1]).any(0)
    n = int(used.nonzero().max()) + 1 if used.any() else 0
    return tokens[..., :n]


def left_pack(t: torch.Tensor) -> torch.Tensor:
    """Move ``<pad>`` to the end of each row keeping the order of the other tokens."""
    keep = t != PAD_ID
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    return torch.gather(t, -1, order)


# ---------------------------------------------------------------------------------------------- the token step
def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs [n, V]`` (unnormalised, non-negative) by inversion: the first index
    whose cumulative mass exceeds u * total, u ~ U[0, 1). An index of mass 0 is never drawn (its
    cumulative mass equals the previous one), and u * total is kept below the total, so a row with
    positive mass draws in range; a row of zero mass draws V (callers test for it); float64 rows are
    drawn in float64. One uniform per
    row: a few times cheaper than ``torch.multinomial`` on CPU for small vocabularies, and one pass over
    the row for large ones."""
    return _invert(probs.cumsum(-1), generator)


def _draw_in_place(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """:func:`sample_categorical` of weights the caller owns: their cumulative sums are taken in place (no second
    ``[n, V]`` buffer); the same draw on the same stream."""
    return _invert(probs.cumsum_(-1), generator)


def _invert(cdf: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    # u * total' with total' = total (1 - 2^-22) < total after rounding, and u < 1: u * total' <= total'
    # (a relative 2^-22 of the last index's mass is given to the earlier ones). The draw is the number of
    # cumulative masses <= u (a binary search: cdf is non-decreasing); V for a row of zero mass.
    below = cdf[:, -1:] * (1.0 - 2.0 ** -22)
    u = torch.rand(below.shape, generator=generator, device=cdf.device, dtype=cdf.dtype) * below
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def skip_draws(n: int, steps: int, generator: torch.Generator | None, device, dtype: torch.dtype) -> None:
    """Draw (and drop) the uniforms that ``steps`` calls of :func:`sample_categorical` on ``n`` rows of ``dtype``
    would draw: a sampler that skips token steps whose outcome is known (the forced runs of chunked encoding,
    end of Section 5.6.2) keeps the random stream of the token-by-token loop."""
    for _ in range(steps):
        torch.rand((n, 1), generator=generator, device=device, dtype=dtype)


class TokenStep(NamedTuple):
    """What :func:`token_step` returns (every field per row, ``[n]``). ``log_prob`` and ``going`` are computed
    when read (a caller that needs neither, e.g. the static SMC step, pays for neither)."""

    #: the drawn token (long); ``<pad>`` for inactive rows; a dead row's draw (V) clamped to V - 1
    token: torch.Tensor
    #: the rule state after the token (``rule.advance``: inactive rows read ``<pad>`` and keep theirs); the
    #: given state when there is no rule
    state: torch.Tensor | None
    #: a row whose law has no token of positive mass (no admissible token; inactive rows never are)
    dead: torch.Tensor
    #: the previous done flags or the active rows whose sequence ended at this token (None without ``ends``)
    done: torch.Tensor | None
    #: the rows whose segment ends at this token (any row; None without ``ends``)
    segment_end: torch.Tensor | None
    #: the law drawn from, ``[n, V]`` log-probabilities (None when only weights ``probs`` were given, and when
    #: the draw read the rule's :class:`MaskedLaw`, which has no table: see ``log_norm``)
    log_q: torch.Tensor | None
    #: the active rows (None: all)
    active: torch.Tensor | None
    #: with a :class:`MaskedLaw` draw: the logits ``[n, V]`` and the law's log normaliser ``[n]``, whence the
    #: draw's log-probability logit(token) - log Z (Def 2.8)
    logits: torch.Tensor | None = None
    log_norm: torch.Tensor | None = None
    #: the law's shift and log sum (:class:`MaskedLaw`), whence logit(token) - log Z exactly: (logit - shift) - log_sum
    shift: torch.Tensor | None = None
    log_sum: torch.Tensor | None = None

    @property
    def log_prob(self) -> torch.Tensor | None:
        """log q(token) ``[n]`` of the draw, the step's term of (2.13) (0 for inactive rows; -inf for a dead row,
        never NaN); None when only weights were given."""
        if self.log_q is not None:
            lp = self.log_q.gather(-1, self.token[:, None]).squeeze(-1)
        elif self.log_norm is not None:
            lp = upcast(self.logits.gather(-1, self.token[:, None]).squeeze(-1))
            lp = lp - self.log_norm if self.shift is None else (lp - self.shift) - self.log_sum
            lp = lp.masked_fill_(self.dead, float("-inf"))  # (dead rows are active)
        else:
            return None
        return lp if self.active is None else torch.where(self.active, lp, 0.0)

    @property
    def draw_dtype(self) -> torch.dtype:
        """The dtype of the uniform the draw used (:func:`skip_draws` keeps the stream with it)."""
        return (self.log_q if self.log_q is not None else self.log_norm).dtype

    @property
    def going(self) -> torch.Tensor | None:
        """The active rows whose segment goes on after this token (None without ``ends``)."""
        if self.segment_end is None:
            return None
        return ~self.segment_end if self.active is None else self.active > self.segment_end  # (bools: a & ~b)


def _pad_row(V: int, device) -> torch.Tensor:
    row = torch.zeros(1, V, device=device)
    row[0, PAD_ID] = 1.0
    return row


Ends = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def token_step(rule: TokenRule | None, logits: torch.Tensor | None, state: torch.Tensor | None,
               active: torch.Tensor | None = None, generator: torch.Generator | None = None, *,
               log_probs: torch.Tensor | None = None, probs: torch.Tensor | None = None,
               ends: Ends | None = None, done: torch.Tensor | None = None) -> TokenStep:
    """One token for every row: the masked softmax of Def 2.8, one inverse-CDF draw per row
    (:func:`sample_categorical`), the automaton advance and the end flags (docs/architecture.md, "Sequence
    sites"). The one token step of every sampler (the segment loop, the static SMC step, the verifier engines).

    Args:
        rule: the token rule whose state ``state`` is stepped (``rule.advance``) and, unless ``log_probs`` is
            given, whose masked softmax log softmax(f~(z_<i)) (Def 2.8) of ``logits [n, V]`` is the law drawn from.
            ``None``: no automaton (``state`` is returned as it is).
        active: bool ``[n]`` or None (all active): inactive rows draw ``<pad>`` (from :meth:`TokenRule.inactive_row`,
            so that every row draws its one uniform: the random stream does not depend on which rows are active),
            get log-probability 0 and keep their state.
        generator: the draws' generator (default: torch's).
        log_probs: ``[n, V]`` the law to draw from when it is not the rule's (a nucleus, the LM's own law while
            a verifier's automaton is stepped); the draw's log-probability is read from it.
        probs: ``[n, V']`` unnormalised non-negative weights drawn from as they are (no ``exp``: a sampler whose
            weights are not log-probabilities, e.g. VGB's walk moves, or that reuses ``exp(log q)`` on a subset of
            rows); overrides the law of ``log_probs`` / ``rule`` for the draw.
        ends: ``ends(token, new_state)`` -> the rows whose segment ends after the token, or (segment ends,
            sequence ends) when the two differ (``None``: no end flags).
        done: the rows whose sequence had ended before (``None``: none); ``TokenStep.done`` adds the active rows
            whose sequence ends at this token.

    Random stream: exactly one uniform per row, in the row order, from ``generator``.
    """
    log_norm = law = None
    if probs is None and log_probs is None and _reads_law(rule, logits):
        law = rule.masked_law(logits, state, take=True)  # Def 2.8's weights, ours to change in place
        log_norm, V = law.log_norm, law.weights.shape[-1]
        tok = _draw_in_place(law.weights, generator)  # every row draws its uniform; inactive rows' draws are dropped
        # no token of positive mass <=> log Z = -inf (a row with mass has a weight exp(0) = 1; NaN logits: NaN, not
        # dead, reported downstream)
        dead = torch.isneginf(log_norm)
        if active is not None:  # inactive rows read <pad> (as drawn from inactive_row), never dead
            dead &= active
            tok = torch.where(active, tok.clamp_(max=V - 1), PAD_ID)
        else:
            tok = tok.clamp_(max=V - 1)
    else:
        if probs is None:
            if log_probs is None:
                log_probs = rule.log_probs(logits, state)
            probs = log_probs.exp()
            if active is not None:
                inactive = rule.inactive_row(probs.device) if rule is not None else _pad_row(probs.shape[-1],
                                                                                              probs.device)
                probs = torch.where(active[:, None], probs, inactive)
        tok = sample_categorical(probs, generator)
        V = probs.shape[-1]
        dead = tok == V
        tok = tok.clamp_(max=V - 1)
    new_state = rule.advance(state, tok) if rule is not None and state is not None else state
    new_done = seg_end = None
    if ends is not None:
        out = ends(tok, new_state)
        seg_end, seq_end = out if isinstance(out, tuple) else (out, out)
        ended = seq_end if active is None else active & seq_end
        new_done = ended if done is None else done | ended
    return TokenStep(tok, new_state, dead, new_done, seg_end, log_probs, active,
                     logits if log_norm is not None else None, log_norm, *((law.shift, law.log_sum) if law else ()))


def _reads_law(rule: TokenRule | None, logits: torch.Tensor | None) -> bool:
    """Whether :func:`token_step` draws from the rule's :class:`MaskedLaw` (the plain masked softmax of Def 2.8,
    no gradient to keep) rather than from a log-probability table."""
    return (rule is not None and logits is not None and type(rule).log_probs is TokenRule.log_probs
            and not (logits.requires_grad and torch.is_grad_enabled()))
