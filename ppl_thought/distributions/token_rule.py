"""Token rules: which next token is admissible after each prefix (Def 2.8), as per-device tables.

:class:`TokenRule` steps the automaton of a constraint (a domain Dom(Proj), a lifting of x) for all rows at
once: the 0 / -inf bias of the masked softmax log softmax(f~(z_<i)) of Def 2.8, the advance of the automaton
state, segment ends (``end_tables``) and the forced runs of chunked encoding (end of Section 5.6.2). The
tables come from the automaton's numpy tables (``Automaton.device_table``), cached per device. Also the
small token-array helpers every decoding path shares.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["TokenRule", "chunk_size", "generated_tokens", "left_pack", "masked_log_softmax", "nucleus", "per_row",
           "supports_valid", "trim_padding", "upcast"]


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


class TokenRule:
    """Next-token log-probabilities from logits under an automaton constraint: the masked softmax of Def 2.8.

    The rule's state is one automaton state per row (``[n]`` long). ``<pad>`` and ``<bos>`` are never
    generated. Subclasses (the identity / predictive samplers' rule (3.30)) override
    :meth:`log_probs` and may keep a wider state ``[n, k]``.
    """

    def __init__(self, constraint, vocab_size: int):
        self.constraint = constraint
        self.vocab_size = int(vocab_size)
        self._tables: dict[tuple, torch.Tensor] = {}

    def _table(self, what: str, device) -> torch.Tensor:
        """Per-device tables over automaton states (the last row is the dead state): ``allowed`` [S+1, V],
        ``bias`` (0 / -inf) [S+1, V]."""
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

    def allowed(self, s: torch.Tensor) -> torch.Tensor:
        table = self._table("allowed", s.device)
        return table.expand(s.shape[0], -1) if self.constraint is None else table[s]

    def start(self, n: int, device) -> torch.Tensor:
        if self.constraint is None:
            return torch.zeros(n, dtype=torch.long, device=device)
        return self.constraint.start_states(n, device)

    def log_probs(self, logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """log softmax of the logits plus the state's 0 / -inf bias (Def 2.8), float32; a row with no
        admissible token is all -inf (never NaN)."""
        bias = self._table("bias", s.device)
        x = logits.float() + (bias if self.constraint is None else bias[s])
        # (faster than log_softmax for small vocabularies on CPU); an all -inf row has normaliser -inf:
        # clamped to the lowest float it leaves the row -inf instead of NaN
        return x - torch.logsumexp(x, -1, keepdim=True).clamp(min=_LOWEST)

    def step(self, s: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return s if self.constraint is None else self.constraint.step(s, tok)

    def advance(self, s: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """:meth:`step`, except that rows reading ``<pad>`` keep their state (right-padded batches)."""
        if self.constraint is None:
            return s
        if type(self).step is TokenRule.step and hasattr(self.constraint, "advance"):
            return self.constraint.advance(s, tok)
        return torch.where(per_row(tok != PAD_ID, s), self.step(s, tok), s)

    def is_final(self, s: torch.Tensor) -> torch.Tensor:
        if self.constraint is None:
            return torch.zeros(s.shape[0], dtype=torch.bool, device=s.device)
        return self.constraint.is_final(s)

    def num_emitted(self, s: torch.Tensor) -> torch.Tensor:
        if self.constraint is None:
            raise MalformedSequenceError("until_emitted needs a constraint automaton that counts observables")
        return self.constraint.num_emitted(s)

    def end_tables(self, until: int | None, device) -> tuple[torch.Tensor, torch.Tensor] | None:
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

    def forced_runs(self, until: int | None, stop_ids: torch.Tensor, limit: int, device):
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
    """The tables of :meth:`TokenRule.forced_runs`, built on the host (numpy, vectorised over states)."""
    table = auto.device_table("table", None)  # [S + 1, V], the dead row all -1
    n_states = table.shape[0]
    allowed = table >= 0
    allowed[:, PAD_ID] = False
    allowed[:, BOS_ID] = False
    single = allowed.sum(1) == 1
    tok = np.where(single, allowed.argmax(1), PAD_ID)
    nxt = np.where(single, table[np.arange(n_states), tok], n_states - 1)
    final = auto.device_table("final", None)
    seg_end = final if until is None else final | (auto.device_table("emitted", None) >= until)
    safe = single & ~seg_end[nxt] & ~np.isin(tok, np.asarray(stops, dtype=np.int64))
    safe[-1] = False
    cur = np.arange(n_states)
    going = np.ones(n_states, dtype=bool)
    run_len = np.zeros(n_states, dtype=np.int64)
    toks = np.full((n_states, limit), PAD_ID, dtype=np.int64)
    states = np.empty((n_states, limit + 1), dtype=np.int64)
    states[:, 0] = cur
    for j in range(limit):
        going = going & safe[cur]
        toks[:, j] = np.where(going, tok[cur], PAD_ID)
        cur = np.where(going, nxt[cur], cur)
        run_len += going
        states[:, j + 1] = cur
    as_t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    return as_t(run_len), as_t(toks), as_t(states)


def per_row(mask: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A per-row mask ``[n]`` shaped to broadcast against a per-row state ``s [n, ...]``."""
    return mask.reshape((-1,) + (1,) * (s.ndim - 1))


def chunk_size(chunk) -> int:
    """The ``chunk`` option: a non-negative int (0: token by token)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int | np.integer) or chunk < 0:
        raise ConfigError(f"chunk must be a non-negative int (the longest run of forced tokens encoded in one "
                          f"pass; 0: token by token), got {chunk!r}")
    return int(chunk)


def trim_padding(tokens: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """Drop the padding columns that every row has (right-padded [..., L] -> [..., L']). One host sync."""
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
