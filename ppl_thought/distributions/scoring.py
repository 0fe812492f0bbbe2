"""The teacher-forced scoring pass of a :class:`~ppl_thought.distributions.segment.Segment`: a given segment of every
row checked, fed to the LM in one pass, and scored by the masked step log-probabilities log softmax(f~(z_<i))_{z_i}
of Def 2.8 summed as in (2.13) (the sampling loop is in segment.py; both write the same post-state).
"""

from __future__ import annotations

import torch

from ppl_thought.distributions.token_rule import per_row
from ppl_thought.errors import MalformedSequenceError, NumericalError
from ppl_thought.vocab import PAD_ID

__all__ = ["append_rows", "check_no_nan", "check_value", "teacher_force"]


def check_value(seg, value) -> torch.Tensor:
    """``value`` as ``[n, S]`` long token ids, checked (a segment the Segment sampled passes as it is);
    :class:`MalformedSequenceError` for malformed values."""
    base = seg.base
    sampled_vocab = getattr(value, "_pt_sampled_vocab", None)
    if sampled_vocab is not None and sampled_vocab <= base.lm.vocab_size and value.ndim == 2 \
            and value.shape[0] == base.n:
        return value  # a segment a Segment sampled: ids in range, no <pad> inside a row
    v = torch.as_tensor(value, device=base.device)
    if v.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise MalformedSequenceError(f"segments must hold integer token ids, got dtype {v.dtype}")
    v = v.long()
    if v.ndim == 1 and v.shape[0] == base.n:  # one token per row
        v = v[:, None]
    elif seg.scalar:
        raise MalformedSequenceError(f"a next token for {base.n} rows must be [{base.n}], got {tuple(v.shape)}")
    if v.ndim != 2 or v.shape[0] != base.n:
        raise MalformedSequenceError(f"a segment for {base.n} rows must be [{base.n}, S], got {tuple(v.shape)}")
    if v.numel() and (v.min() < 0 or v.max() >= base.lm.vocab_size):
        raise MalformedSequenceError(f"segment ids outside the vocabulary [0, {base.lm.vocab_size})")
    present = v != PAD_ID
    if v.shape[1] and (present[:, 1:] & ~present[:, :-1]).any():
        raise MalformedSequenceError("padding inside a segment: <pad> must only fill the end of a row")
    return v


def teacher_force(seg, value: torch.Tensor) -> dict:
    """The post-state of the segment ``value`` and its log-probability ``_step_lp`` ``[n]`` in one teacher-forced
    pass: the masked step log-probabilities of Def 2.8 summed as in (2.13); ``-inf`` where the segment breaks the
    constraint or does not end where it must."""
    base, snap = seg.base, seg.snap
    rule = base.rule
    v = check_value(seg, value)
    n, S = v.shape
    dev = base.device
    present = v != PAD_ID
    seg_len = present.sum(-1)
    until = seg._until()
    start_active = seg._start_active()
    # step the rule along the segment: states before each token, vectorised over rows
    s = snap["s"]
    states = []
    lengths = snap["lengths"]
    count = torch.zeros(n, dtype=torch.long, device=dev)
    ended = ~start_active  # the segment has ended (or the sequence, for an open segment)
    ok = ~(ended & (seg_len > 0))
    if not seg.open_end:
        ok = ok & ~(start_active & (seg_len == 0))
    done = snap["done"]
    tabs = seg._end_tables
    if tabs is None:
        scalar = until is None or until.ndim == 0
        tabs = rule.end_tables(None if until is None else int(until), dev) if scalar else None
        seg._end_tables = tabs if tabs is not None else False
    if tabs and S:
        # table rules: step the states along the segment, then every end test at once on [n, S]
        for j in range(S):
            states.append(s)
            s = rule.advance(s, v[:, j])
        after = torch.stack(states[1:] + [s], 1)
        cum = torch.cumsum(present.long(), 1)
        seg_end, seq_end = seg._ends(v, after, cum, lengths[:, None] + cum, until, int(lengths.max()) + S)
        seg_end, seq_end = seg_end & present, seq_end & present
        lengths = lengths + seg_len
        done = done | seq_end.any(-1)
        end_at = seq_end if seg.open_end else seg_end
        before = (torch.cumsum(end_at.long(), 1) - end_at.long()) > 0  # an end before this token
        ok = ok & ~(present & (before | ended[:, None])).any(-1)
        ended = ended | end_at.any(-1)
    for j in range(0 if tabs else S):
        tok = v[:, j]
        inside = present[:, j]
        ok = ok & ~(inside & ended)  # a token after the segment's end
        states.append(s)
        s = torch.where(per_row(inside, s), rule.step(s, tok), s)
        lengths = lengths + inside.long()
        count = count + inside.long()
        seg_end, seq_end = seg._ends(tok, s, count, lengths, until)
        done = done | (inside & seq_end)
        ended = ended | (inside & (seq_end if seg.open_end else seg_end))
    if not seg.open_end:
        ok = ok & (ended | ~(start_active & (seg_len > 0)))  # a segment must reach its end
    if S == 0:
        step_lp = torch.zeros(n, device=dev)
        logits_after, cache, context = snap["logits"], snap["cache"], snap["context"]
    else:
        # the last token of a sequence that ends here is scored but not fed: nothing reads the logits after
        # it, and feeding it would need one position more than the sequence has (a spurious max_len error)
        last = torch.arange(S, device=dev)[None] == (seg_len - 1)[:, None]
        last_of_seq = (done & ~snap["done"])[:, None] & last
        out, cache, context = base.feed(snap["cache"], snap["context"], v, present & ~last_of_seq)
        prev = torch.cat([snap["logits"][:, None].to(out.dtype), out[:, :-1]], 1)  # logits before each token
        st = torch.stack(states, 1)
        logq = rule.log_probs(prev.reshape(n * S, -1), st.reshape((n * S,) + st.shape[2:])).reshape(n, S, -1)
        tl = logq.gather(-1, v[..., None]).squeeze(-1)
        step_lp = torch.where(present, tl, torch.zeros_like(tl)).sum(-1)
        last = (seg_len - 1).clamp(min=0)
        after = out[torch.arange(n, device=dev), last]
        logits_after = torch.where((seg_len > 0)[:, None], after, snap["logits"].to(after.dtype))
    check_no_nan(step_lp, base.lm)
    step_lp = torch.where(ok, step_lp, torch.full_like(step_lp, float("-inf")))
    return {"logits": logits_after, "cache": cache, "context": context, "s": s,
            "tokens": append_rows(snap["tokens"], snap["lengths"], v), "lengths": lengths,
            "log_prob": snap["log_prob"] + step_lp, "done": done, "_step_lp": step_lp}


def check_no_nan(log_prob: torch.Tensor, lm) -> None:
    """Raise :class:`NumericalError` if a log-probability the LM gave is NaN (one host sync per segment)."""
    if bool(torch.isnan(log_prob.detach()).any()):
        bad = [n for n, p in lm.named_parameters() if not torch.isfinite(p.detach()).all()] \
            if isinstance(lm, torch.nn.Module) else []
        where = f": non-finite parameters {bad[:5]}" if bad else " (NaN logits)"
        raise NumericalError(f"{type(lm).__name__} gave NaN log-probabilities{where}")


def append_rows(tokens: torch.Tensor, lengths: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Right-padded rows ``tokens`` (``lengths``) followed by the right-padded ``seg`` rows."""
    if seg.shape[1] == 0:
        return tokens
    if tokens.shape[1] == 0:
        return seg
    n, S = seg.shape
    width = tokens.shape[1] + S
    out = torch.zeros(n, width + 1, dtype=tokens.dtype, device=tokens.device)
    out[:, : tokens.shape[1]] = tokens
    pos = lengths[:, None] + torch.arange(S, device=seg.device)[None]
    out.scatter_(1, torch.where(seg != PAD_ID, pos, torch.full_like(pos, width)), seg)  # pads go to a spare column
    used = int((lengths + (seg != PAD_ID).sum(-1)).max())  # one host sync per segment
    return out[:, :used]
