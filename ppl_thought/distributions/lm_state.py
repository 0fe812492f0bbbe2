"""The one decoding loop: a batched, KV-cached LM state stepped segment by segment (ARCHITECTURE.md,
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

import inspect
from collections.abc import Callable

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought.errors import MalformedSequenceError
from ppl_thought.lm.base import match_rows

PAD_ID, BOS_ID = 0, 1

__all__ = ["LMState", "Segment", "TokenRule", "supports_valid", "masked_log_softmax"]


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
    lse = torch.logsumexp(masked, -1, keepdim=True)
    return torch.where(torch.isneginf(lse), torch.full_like(masked, float("-inf")), masked - lse)


class TokenRule:
    """Next-token log-probabilities from logits under an automaton constraint: the masked softmax of Def 2.8.

    The rule's state is one automaton state per row (``[n]`` long). ``<pad>`` and ``<bos>`` are never
    generated. Subclasses (the identity / predictive samplers' rule (3.30)) override
    :meth:`log_probs` and may keep a wider state ``[n, k]``.
    """

    def __init__(self, constraint, vocab_size: int):
        self.constraint = constraint
        self.vocab_size = int(vocab_size)
        self._tables: dict[str, torch.Tensor] = {}

    def allowed(self, s: torch.Tensor) -> torch.Tensor:
        key = str(s.device)
        table = self._tables.get(key)
        if table is None:
            if self.constraint is None:
                table = torch.ones(1, self.vocab_size, dtype=torch.bool, device=s.device)
            else:
                table = (self.constraint.torch_table(s.device) >= 0).clone()
            table[:, PAD_ID] = False
            table[:, BOS_ID] = False
            self._tables[key] = table
        return table.expand(s.shape[0], -1) if self.constraint is None else table[s]

    def start(self, n: int, device) -> torch.Tensor:
        if self.constraint is None:
            return torch.zeros(n, dtype=torch.long, device=device)
        return self.constraint.start_states(n, device)

    def log_probs(self, logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return masked_log_softmax(logits, self.allowed(s))

    def step(self, s: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return s if self.constraint is None else self.constraint.step(s, tok)

    def is_final(self, s: torch.Tensor) -> torch.Tensor:
        if self.constraint is None:
            return torch.zeros(s.shape[0], dtype=torch.bool, device=s.device)
        return self.constraint.is_final(s)

    def num_emitted(self, s: torch.Tensor) -> torch.Tensor:
        if self.constraint is None:
            raise MalformedSequenceError("until_emitted needs a constraint automaton that counts observables")
        return self.constraint.num_emitted(s)


class LMState:
    """``n`` partial sequences of one LM (see the module docstring). Mutable: ``extend`` and ``reorder``
    change it in place (and return it).

    Build one with :meth:`LMSequence.start` (``LMSequence(lm, prompt, constraint, ...).start(n)``) or
    :meth:`LMState.start`.
    """

    def __init__(self, lm, rule: TokenRule, max_len: int, stop_ids: torch.Tensor, lm_kwargs: dict | None,
                 logits: torch.Tensor, cache, rule_state: torch.Tensor, context: torch.Tensor | None = None):
        self.lm = lm
        self.rule = rule
        self.max_len = int(max_len)
        self.stop_ids = stop_ids
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
        self._pending: Segment | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def start(cls, lm, n: int, prompt: torch.Tensor | None = None, rule: TokenRule | None = None,
              max_len: int = 1 << 30, stop_ids: torch.Tensor | None = None, lm_kwargs: dict | None = None,
              device=None) -> LMState:
        """Encode ``<bos> + prompt`` (1-D, shared: encoded once and expanded; or ``[n, P]`` right-padded)."""
        device = device if device is not None else _device(lm)
        rule = rule if rule is not None else TokenRule(None, lm.vocab_size)
        stop_ids = stop_ids if stop_ids is not None else torch.zeros(0, dtype=torch.long)
        prompt = torch.zeros(0, dtype=torch.long) if prompt is None else torch.as_tensor(prompt, dtype=torch.long)
        prompt = prompt.to(device)
        valid_mode = supports_valid(lm)
        s0 = rule.start(n, device)
        if prompt.ndim <= 1:
            ctx = torch.cat([torch.tensor([BOS_ID], device=device), prompt])[None]
            logits, cache = lm(ctx, **match_rows(lm_kwargs or {}, 1))
            if valid_mode:
                return cls(lm, rule, max_len, stop_ids, lm_kwargs, logits[:, -1].expand(n, -1), cache.expand(n), s0)
            return cls(lm, rule, max_len, stop_ids, lm_kwargs, logits[:, -1].expand(n, -1), None, s0,
                       ctx.expand(n, -1))
        rows = prompt.reshape(-1, prompt.shape[-1])
        if rows.shape[0] != n:
            rows = rows.repeat_interleave(n // rows.shape[0], 0) if n % rows.shape[0] == 0 else rows
        if rows.shape[0] != n:
            raise MalformedSequenceError(f"{rows.shape[0]} prompts for {n} rows")
        ctx = _left_pack(torch.cat([torch.full((n, 1), BOS_ID, device=device), rows], 1))
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

    def __repr__(self) -> str:
        return (f"LMState(n={self.n}, lm={type(self.lm).__name__}, max_len={self.max_len}, "
                f"mode={'valid' if self.context is None else 'recompute'})")

    # ------------------------------------------------------------------ distributions over what comes next
    def segment(self, until_emitted: int | torch.Tensor | None = None, stop=None, max_tokens: int | None = None,
                name_hint: str = "") -> Segment:
        """The next segment of every row: tokens until (first of) the constraint has emitted
        ``until_emitted`` observables, a stop token (``stop`` ids, or the state's own stop ids), a final
        state of the constraint, ``max_tokens`` tokens, or ``max_len``. Rows already ended give an empty
        segment (log-probability 0)."""
        seg = Segment(self, until_emitted, stop, max_tokens)
        self._pending = seg
        return seg

    def next_token(self) -> Segment:
        """The next token of every row (event shape ``()``; ``<pad>`` for ended rows)."""
        seg = Segment(self, None, None, 1, scalar=True)
        self._pending = seg
        return seg

    # ------------------------------------------------------------------ changing the state
    def extend(self, value: torch.Tensor) -> LMState:
        """Append a segment ``[n, S]`` (or one token ``[n]``) to every row, in place; returns self."""
        seg = self._pending
        if seg is None or seg.base_version is not self._version_key():
            seg = Segment(self, None, None, None)
        post = seg._advance(value)
        self._adopt(post)
        return self

    def reorder(self, index: torch.Tensor) -> LMState:
        """Row i becomes row ``index[i]`` (resampling); the KV cache is gathered with ``cache.reorder``."""
        index = index.to(self.device)
        self.logits = self.logits[index]
        self.cache = self.cache.reorder(index) if self.cache is not None else None
        self.context = self.context[index] if self.context is not None else None
        self.s, self.tokens, self.lengths = self.s[index], self.tokens[index], self.lengths[index]
        self.log_prob, self.done = self.log_prob[index], self.done[index]
        self._pending = None
        return self

    def _version_key(self):
        return self.cache if self.cache is not None else self.context

    def _adopt(self, post: dict) -> None:
        for k, v in post.items():
            if not k.startswith("_"):
                setattr(self, k, v)
        self._pending = None

    def snapshot(self) -> dict:
        return {k: getattr(self, k) for k in ("logits", "cache", "context", "s", "tokens", "lengths", "log_prob",
                                              "done")}

    # ------------------------------------------------------------------ feeding the LM
    def _feed(self, snap: dict, toks: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, object, object]:
        """Feed ``toks [n, S]`` (only where ``valid``); return (logits after each position [n, S, V], cache,
        context)."""
        n, S = toks.shape
        kw = match_rows(self.lm_kwargs, n)
        if snap["context"] is None:
            feed = torch.where(valid, toks, torch.full_like(toks, BOS_ID))
            if bool(valid.all()):
                logits, cache = self.lm(feed, cache=snap["cache"], **kw)
            else:
                logits, cache = self.lm(feed, cache=snap["cache"], valid=valid, **kw)
            return logits, cache, None
        ctx = _left_pack(torch.cat([snap["context"], torch.where(valid, toks, torch.zeros_like(toks))], 1))
        plen0 = (snap["context"] != PAD_ID).sum(-1)
        full, _ = self.lm(ctx, **kw)
        pos = (plen0 - 1)[:, None] + torch.cumsum(valid.long(), 1)
        logits = full.gather(1, pos.clamp(min=0)[..., None].expand(n, S, full.shape[-1]))
        return logits, None, ctx


class Segment(TorchDistribution):
    """The next segment of every row of an :class:`LMState` as a Pyro distribution.

    Values are ``[n, S]`` right-padded token arrays (``[n]`` for ``next_token``); the width S is that
    of the value (segments are ragged: ``ragged_event = True`` tells the engines' site check not to
    compare the width). ``log_prob`` is the sum of the masked step log-probabilities of Def 2.8 over
    the segment; ``-inf`` where the segment breaks the constraint or does not end where it must.
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)
    has_rsample = False
    ragged_event = True

    def __init__(self, lm_state: LMState, until_emitted=None, stop=None, max_tokens: int | None = None,
                 scalar: bool = False, validate_args=None):
        self.base = lm_state
        self.snap = lm_state.snapshot()
        self.base_version = lm_state._version_key()
        self.until_emitted = until_emitted
        self.stop_ids = (lm_state.stop_ids if stop is None else _as_ids(stop)).to(lm_state.device)
        self.max_tokens = max_tokens
        self.scalar = scalar
        self._memo: list[tuple[torch.Tensor, dict, bool]] = []  # (value, post-state, with grad)
        width = 1 if scalar else (max_tokens if max_tokens is not None else max(lm_state.max_len, 1))
        event = () if scalar else (width,)
        super().__init__(torch.Size([lm_state.n]), torch.Size(event), validate_args=False)

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        if batch_shape != self.batch_shape:
            raise MalformedSequenceError(
                f"a Segment of an LMState with {self.base.n} rows cannot take batch shape {tuple(batch_shape)}: "
                "start the LMState with pt.particles() rows inside the particle plate")
        return self

    # ------------------------------------------------------------------ where a segment ends
    def _ends(self, tok: torch.Tensor, s: torch.Tensor, count: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        rule = self.base.rule
        ends = rule.is_final(s) | (lengths >= self.base.max_len)
        if len(self.stop_ids):
            ends = ends | torch.isin(tok, self.stop_ids)
        if self.until_emitted is not None:
            ends = ends | (rule.num_emitted(s) >= torch.as_tensor(self.until_emitted, device=s.device))
        if self.max_tokens is not None:
            ends = ends | (count >= self.max_tokens)
        return ends

    def _start_active(self) -> torch.Tensor:
        snap = self.snap
        active = ~snap["done"]
        if self.until_emitted is not None:
            active = active & (self.base.rule.num_emitted(snap["s"])
                               < torch.as_tensor(self.until_emitted, device=snap["s"].device))
        return active

    # ------------------------------------------------------------------ sampling: the decoding loop
    def sample(self, sample_shape=()) -> torch.Tensor:
        if torch.Size(sample_shape) != torch.Size():
            raise MalformedSequenceError("a Segment draws one segment per row; use the particle plate for more")
        return self.sample_with_log_prob()[0]

    def sample_with_log_prob(self, generator: torch.Generator | None = None):
        base, snap = self.base, dict(self.snap)
        rule = base.rule
        n = base.n
        dev = base.device
        active = self._start_active()
        logits, cache, context, s = snap["logits"], snap["cache"], snap["context"], snap["s"]
        lengths, count = snap["lengths"].clone(), torch.zeros(n, dtype=torch.long, device=dev)
        lp = torch.zeros(n, device=dev)
        cols: list[torch.Tensor] = []
        done = snap["done"]
        with torch.no_grad():
            while bool(active.any()):
                logq = rule.log_probs(logits, s)
                dead = torch.isneginf(logq).all(-1) & active
                if bool(dead.any()):
                    raise ValueError(f"{int(dead.sum())} rows have no admissible token of positive probability: "
                                     "the LM gives probability 0 to every token the constraint allows")
                probs = torch.where(active[:, None], logq.exp(), torch.zeros_like(logq))
                probs[:, PAD_ID] = torch.where(active, probs[:, PAD_ID], torch.ones_like(probs[:, PAD_ID]))
                tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                tok = torch.where(active, tok, torch.full_like(tok, PAD_ID))
                lp = lp + torch.where(active, logq.gather(-1, tok[:, None]).squeeze(-1), torch.zeros_like(lp))
                s = torch.where(_col(active, s), rule.step(s, tok), s)
                lengths = lengths + active.long()
                count = count + active.long()
                cols.append(tok)
                ended = active & self._ends(tok, s, count, lengths)
                done = done | (active & (rule.is_final(s) | (lengths >= base.max_len)))
                if len(base.stop_ids):
                    done = done | (ended & torch.isin(tok, base.stop_ids.to(dev)))
                still = active & ~ended
                if bool(still.any()) or True:
                    # feed the token so the next logits (and the post-state) are ready
                    fl, cache, context = base._feed({"cache": cache, "context": context}, tok[:, None], active[:, None])
                    logits = torch.where(active[:, None], fl[:, -1], logits)
                active = still
        value = torch.stack(cols, 1) if cols else torch.zeros(n, 0, dtype=torch.long, device=dev)
        post = {"logits": logits, "cache": cache, "context": context, "s": s,
                "tokens": _append(snap["tokens"], snap["lengths"], value), "lengths": lengths,
                "log_prob": snap["log_prob"] + lp, "done": done}
        out = value[:, 0] if self.scalar else value
        if self.scalar and value.shape[1] == 0:
            out = torch.zeros(n, dtype=torch.long, device=dev)
        post["_step_lp"] = lp
        self._memo.append((out, post, False))
        return out, lp

    # ------------------------------------------------------------------ scoring: one teacher-forced pass
    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return self._advance(value)["_step_lp"]

    def _advance(self, value: torch.Tensor) -> dict:
        """The state after appending ``value`` (memoised by identity) with ``_step_lp`` its log-probability
        (recomputed with a graph when the LM is trained and the memo has none)."""
        grad = _needs_grad(self.base.lm)
        for v, post, g in self._memo:
            if v is value and (g or not grad):
                return post
        post = self._teacher_force(value)
        self._memo.append((value, post, grad))
        return post

    def _teacher_force(self, value: torch.Tensor) -> dict:
        base, snap = self.base, self.snap
        rule = base.rule
        v = torch.as_tensor(value, device=base.device)
        if v.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise MalformedSequenceError(f"segments must hold integer token ids, got dtype {v.dtype}")
        v = v.long()
        if self.scalar or v.ndim == 1:
            v = v.reshape(-1, 1)
        if v.ndim != 2 or v.shape[0] != base.n:
            raise MalformedSequenceError(f"a segment for {base.n} rows must be [{base.n}, S], got {tuple(value.shape)}")
        if v.numel() and (v.min() < 0 or v.max() >= base.lm.vocab_size):
            raise MalformedSequenceError(f"segment ids outside the vocabulary [0, {base.lm.vocab_size})")
        n, S = v.shape
        dev = base.device
        present = v != PAD_ID
        seg_len = present.sum(-1)
        contiguous = (torch.cumsum(present.long(), 1) == torch.arange(1, S + 1, device=dev)) | ~present
        ok = contiguous.all(-1) & ~(snap["done"] & (seg_len > 0))
        # step the rule along the segment: states before each token, vectorised over rows
        s = snap["s"]
        states = []
        lengths = snap["lengths"].clone()
        count = torch.zeros(n, dtype=torch.long, device=dev)
        ended = ~self._start_active()
        ok = ok & ~(ended & (seg_len > 0))
        for j in range(S):
            tok = v[:, j]
            inside = present[:, j]
            ok = ok & ~(inside & ended)  # a token after the segment's end
            states.append(s)
            s = torch.where(_col(inside, s), rule.step(s, tok), s)
            lengths = lengths + inside.long()
            count = count + inside.long()
            ended = ended | (inside & self._ends(tok, s, count, lengths))
        must_end = self._start_active() & (seg_len > 0)
        ok = ok & (ended | ~must_end) & ~(self._start_active() & (seg_len == 0))
        if S == 0:
            step_lp = torch.zeros(n, device=dev)
            logits_after, cache, context = snap["logits"], snap["cache"], snap["context"]
        else:
            out, cache, context = base._feed(snap, v, present)
            prev = torch.cat([snap["logits"][:, None].to(out.dtype), out[:, :-1]], 1)  # logits before each token
            st = torch.stack(states, 1)
            logq = rule.log_probs(prev.reshape(n * S, -1), st.reshape((n * S,) + st.shape[2:])).reshape(n, S, -1)
            tl = logq.gather(-1, v[..., None]).squeeze(-1)
            step_lp = torch.where(present, tl, torch.zeros_like(tl)).sum(-1)
            last = (seg_len - 1).clamp(min=0)
            after = out[torch.arange(n, device=dev), last]
            logits_after = torch.where((seg_len > 0)[:, None], after, snap["logits"].to(after.dtype))
        step_lp = torch.where(ok, step_lp, torch.full_like(step_lp, float("-inf")))
        done = snap["done"] | rule.is_final(s) | (lengths >= base.max_len)
        if len(base.stop_ids) and S:
            last_tok = v.gather(1, (seg_len - 1).clamp(min=0)[:, None]).squeeze(1)
            done = done | ((seg_len > 0) & torch.isin(last_tok, base.stop_ids.to(dev)))
        return {"logits": logits_after, "cache": cache, "context": context, "s": s,
                "tokens": _append(snap["tokens"], snap["lengths"], v), "lengths": lengths,
                "log_prob": snap["log_prob"] + step_lp, "done": done, "_step_lp": step_lp}


# ---------------------------------------------------------------------------------------------- helpers
def _col(mask: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return mask.reshape((-1,) + (1,) * (s.ndim - 1))


def _device(lm) -> torch.device:
    for t in list(lm.parameters())[:1] + list(lm.buffers())[:1]:
        return t.device
    return torch.device("cpu")


def _needs_grad(lm) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for p in lm.parameters())


def _as_ids(stop) -> torch.Tensor:
    items = [stop] if isinstance(stop, int) else list(stop)
    return torch.tensor([int(s) for s in items], dtype=torch.long)


def _left_pack(t: torch.Tensor) -> torch.Tensor:
    """Move ``<pad>`` to the end of each row keeping the order of the other tokens."""
    keep = t != PAD_ID
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    return torch.gather(t, -1, order)


def _append(tokens: torch.Tensor, lengths: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Right-padded rows ``tokens`` (``lengths``) followed by the right-padded ``seg`` rows."""
    if seg.shape[1] == 0:
        return tokens
    if tokens.shape[1] == 0:
        return seg
    return _left_pack(torch.cat([tokens, seg], 1))


Potential = Callable[[torch.Tensor], torch.Tensor]
