"""The next segment of every row of an :class:`~ppl_thought.distributions.lm_state.LMState` as a Pyro
distribution: the lockstep sampling loop (one decoding loop for every engine, guide and program) and the
teacher-forced scoring pass. Step log-probabilities are log softmax(f~(z_<i))_{z_i} of Def 2.8, summed over the
segment as in (2.13).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought.distributions.token_rule import left_pack, per_row, trim_padding
from ppl_thought.errors import MalformedSequenceError, NumericalError
from ppl_thought.lm.base import match_rows
from ppl_thought.vocab import BOS_ID, PAD_ID

if TYPE_CHECKING:
    from ppl_thought.distributions.lm_state import LMState

__all__ = ["STATE_KEYS", "Segment", "check_no_nan", "sample_categorical"]


#: the fields of an LMState that a segment's sampling or scoring pass produces (``LMState.snapshot``)
STATE_KEYS = ("logits", "cache", "context", "s", "tokens", "lengths", "log_prob", "done")


class Segment(TorchDistribution):
    """The next segment of every row of an :class:`LMState` as a Pyro distribution.

    Values are ``[n, S]`` right-padded token arrays (``[n]`` for ``next_token``); the width S is that
    of the value (segments are ragged: ``ragged_event = True`` tells the engines' site check not to
    compare the width). ``log_prob`` is the sum of the masked step log-probabilities of Def 2.8 over
    the segment, log softmax(f~(z_<i))_{z_i} summed as in (2.13); ``-inf`` where the segment breaks the
    constraint or does not end where it must. Malformed values (not integer, wrong shape, ids outside
    the vocabulary, ``<pad>`` inside a row) raise :class:`MalformedSequenceError`.
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)
    has_rsample = False
    ragged_event = True

    #: the sampling loop goes on with the live rows only (the KV cache gathered with ``cache.reorder``)
    #: once more than this fraction of the rows it steps have ended their sequence
    drop_fraction: float = 0.25

    def __init__(self, lm_state: LMState, until_emitted=None, stop=None, max_tokens: int | None = None,
                 scalar: bool = False, open_end: bool = False, validate_args=None):
        self.base = lm_state
        self.snap = lm_state.snapshot()
        self.base_version = lm_state.version
        self.until_emitted = until_emitted
        self.stop_ids = lm_state.stop_ids if stop is None else _as_ids(stop, lm_state.device)
        # host-side facts the per-token loop reads (no tensor work per token)
        self._until_t = None if until_emitted is None else torch.as_tensor(until_emitted, device=lm_state.device)
        self._base_stops = lm_state.stop_ids.numel() > 0
        self._own_stops = self.stop_ids.numel() > 0 and self.stop_ids is not lm_state.stop_ids
        self.max_tokens = max_tokens
        self._end_tables = None  # per-state end tables of the rule for this segment (False: not available)
        self.scalar = scalar
        self.open_end = open_end
        self._memo: list[tuple[torch.Tensor, dict, bool]] = []  # (value, post-state with _step_lp, with grad)
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
    def _until(self) -> torch.Tensor | None:
        return self._until_t

    def _ends(self, tok, s, count, lengths, until, len_bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the segment ends, the sequence ends) after token ``tok`` led to rule state ``s``; ``len_bound``
        (host int, optional) bounds ``lengths``: below ``max_len`` the length test is skipped."""
        base, rule = self.base, self.base.rule
        tabs = self._end_tables
        if tabs is None:
            scalar = until is None or until.ndim == 0
            tabs = rule.end_tables(None if until is None else int(until), s.device) if scalar else None
            self._end_tables = tabs if tabs is not None else False
        if tabs:
            idx = s if rule.constraint is not None else torch.zeros_like(s)
            seq_state, seg_state = tabs[1][idx], tabs[0][idx]  # any shape of s: [n] or [n, S]
        else:
            seq_state = rule.is_final(s)
            seg_state = seq_state if until is None else seq_state | (rule.num_emitted(s) >= until)
        seq = seq_state if len_bound is not None and len_bound < base.max_len else seq_state | (lengths >= base.max_len)
        if self._base_stops:
            seq = seq | torch.isin(tok, base.stop_ids)
        seg = seq | seg_state
        if self._own_stops:
            seg = seg | torch.isin(tok, self.stop_ids)
        if self.max_tokens is not None:
            seg = seg | (count >= self.max_tokens)
        return seg, seq

    def _start_active(self) -> torch.Tensor:
        snap = self.snap
        active = ~snap["done"]
        until = self._until()
        if until is not None:
            active = active & (self.base.rule.num_emitted(snap["s"]) < until)
        return active

    # ------------------------------------------------------------------ sampling: the decoding loop
    def sample(self, sample_shape=()) -> torch.Tensor:
        if torch.Size(sample_shape) != torch.Size():
            raise MalformedSequenceError("a Segment draws one segment per row; use the particle plate for more")
        return self.sample_with_log_prob()[0]

    def sample_with_log_prob(self, generator: torch.Generator | None = None):
        """Sample the segment of every row in one lockstep loop, one LM step per token; return
        (value, log-probability ``[n]``).

        Rows whose segment has ended wait (fed with ``valid=False``) so that their cache and next-token
        logits are those after their segment. Rows whose sequence has ended are fed a dummy token as
        valid while the rows are in lockstep (their cache is never read again, and an all-valid batch takes
        the LM's dense path), and nothing once the rows sit at their own positions (a ragged cache: a dummy
        would take a position past the row's end, and the LM's max_len counts positions); once
        more than :attr:`drop_fraction` of the stepped rows have ended their sequence, the loop goes on
        with the other rows only (``cache.reorder``), and the results are scattered back. Then the
        post-state's cache is gathered back to ``n`` rows only when it is used (``extend``).
        """
        base, snap = self.base, self.snap
        n, dev = base.n, base.device
        valid_mode = snap["context"] is None
        with torch.no_grad():
            active = self._start_active()
            value = torch.zeros(n, 0, dtype=torch.long, device=dev)
            post = {**snap, "_step_lp": torch.zeros(n, device=dev)}
            if n and bool(active.any()):
                value, post = self._decode(active, generator, valid_mode)
        out = value[:, 0] if self.scalar and value.shape[1] else value
        if self.scalar and value.shape[1] == 0:
            out = torch.zeros(n, dtype=torch.long, device=dev)
        self._memo.append((out, post, False))
        out._pt_sampled_vocab = base.lm.vocab_size  # well formed by construction (see _check)
        return out, post["_step_lp"]

    def _decode(self, active, generator, valid_mode):
        base, snap = self.base, self.snap
        rule, n, dev = base.rule, base.n, base.device
        V = base.lm.vocab_size
        pad_row = torch.zeros(1, V, device=dev)
        pad_row[0, PAD_ID] = 1.0
        # the live rows (all of them until some are dropped) and their per-row quantities
        rows = None  # indices of the live rows among the n, None while all are live
        logits, cache, context, s = snap["logits"], snap["cache"], snap["context"], snap["s"]
        lengths, done = snap["lengths"], snap["done"]
        count = torch.zeros(n, dtype=torch.long, device=dev)
        lp = torch.zeros(n, device=dev)
        until = self._until()
        kw = match_rows(base.lm_kwargs, n)
        len_bound = int(lengths.max())  # host bound on the lengths (one sync per segment)
        full: dict[str, torch.Tensor] = {}  # per-row results of every row, written when rows are dropped
        blocks: list[tuple[torch.Tensor | None, list[torch.Tensor]]] = []  # (rows, token columns)
        cols: list[torch.Tensor] = []
        runs = self._forced_runs(until)  # chunked encoding (end of 5.6.2): None when off or not available
        ragged_cols = False  # a chunk gave rows runs of different lengths: <pad> inside columns, packed at the end
        chunk_dead = torch.zeros((), dtype=torch.bool, device=dev)

        def write_back() -> None:
            live = {"logits": logits, "s": s, "lengths": lengths, "done": done, "lp": lp}
            for k, v in live.items():
                if rows is None:
                    full[k] = v.clone()
                else:
                    full[k][rows] = v.to(full[k].dtype)

        while True:
            logq = rule.log_probs(logits, s)
            probs = torch.where(active[:, None], logq.exp(), pad_row)
            tok = sample_categorical(probs, generator)  # <pad> where not active
            dead = tok == V  # an active row with no admissible token of positive probability
            tok = tok.clamp_(max=V - 1)
            lp = lp + logq.gather(-1, tok[:, None]).squeeze(-1).masked_fill_(~active, 0.0)
            s = rule.advance(s, tok)  # inactive rows drew <pad>
            lengths = lengths + active.long()
            if self.max_tokens is not None:
                count = count + active.long()
            cols.append(tok)
            len_bound += 1
            seg_end, seq_end = self._ends(tok, s, count, lengths, until, len_bound)
            done = done | (active & seq_end)
            still = active & ~seg_end
            need = active & ~done  # rows whose logits after this token will be read
            feed_all = (active | done).all() if valid_mode else need.all()
            flags = [dead.any(), need.any(), still.any(), done.sum(), feed_all, need.all()]
            if runs is not None:
                # the forced run after this token, for the rows whose segment goes on: it never ends the
                # segment nor the sequence (the tables stop before that), nor reaches max_len / max_tokens
                r = torch.where(still, runs[0][s], torch.zeros_like(s))
                r = torch.minimum(r, base.max_len - 1 - lengths).clamp_(min=0)
                if self.max_tokens is not None:
                    r = torch.minimum(r, self.max_tokens - 1 - count).clamp_(min=0)
                r_max = r.max()
                flags += [r_max, ((r == r_max) | done).all(), ((r == r_max) | ~still).all()]
            # the one host sync of the step
            host = torch.stack([f.long() for f in flags]).tolist()
            is_dead, any_need, any_still, n_done, all_valid, all_need = host[:6]
            R, aligned, aligned_still = host[6:] if runs is not None else (0, True, True)
            if is_dead:
                raise ValueError(f"{int(dead.sum())} rows have no admissible token of positive probability: "
                                 "the LM gives probability 0 to every token the constraint allows")
            m = done.shape[0]
            if any_still and n_done > self.drop_fraction * m:
                # go on with the rows whose sequence goes on (waiting rows included)
                write_back()
                blocks.append((rows, cols))
                cols = []
                keep = (~done).nonzero().squeeze(-1)
                rows = keep if rows is None else rows[keep]
                logits, s, lengths, done, lp = logits[keep], s[keep], lengths[keep], done[keep], lp[keep]
                count, active, still, need, tok = count[keep], active[keep], still[keep], need[keep], tok[keep]
                if runs is not None:
                    r = r[keep]
                if until is not None and until.ndim:
                    until = until[keep]
                cache = cache.reorder(keep) if cache is not None else None
                if context is not None:
                    context = context[keep]
                    context = context[:, : int((context != PAD_ID).sum(-1).max())]
                kw = {k: (v[keep] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == m else v)
                      for k, v in kw.items()}
                all_valid = bool(active.all())  # no row left has ended its sequence
                all_need = bool(need.all())
            # the block each row feeds: its token (where it is read), then its forced run (R columns)
            if R:
                m = tok.shape[0]
                in_run = torch.arange(R, device=dev)[None] < r[:, None]  # [m, R]
                run_states = runs[2][s]  # [m, limit + 1]: the state before each run token, then held
                run_toks = torch.where(in_run, runs[1][s][:, :R], torch.zeros_like(in_run, dtype=torch.long))
                before = run_states[:, :R]
                s = run_states.gather(1, r[:, None]).squeeze(1)
                lengths = lengths + r
                if self.max_tokens is not None:
                    count = count + r
                len_bound += R
                for j in range(R):  # the uniforms the token-by-token loop draws for these steps (unused there:
                    torch.rand((m, 1), generator=generator, device=dev, dtype=probs.dtype)  # forced tokens)
                    cols.append(run_toks[:, j])
                ragged_cols = ragged_cols or not aligned_still
                run_feed = torch.where(in_run, run_toks, torch.full_like(run_toks, BOS_ID))
            if all_need and (not R or aligned):  # every row goes on: feed its token as it is, take every row's logits
                block = tok[:, None] if not R else torch.cat([tok[:, None], run_feed], 1)
                fl, cache, context = base.feed(cache, context, block, None, kw)
                last = fl[:, -1]
                if R:
                    lp, chunk_dead = self._score_run(fl, before, run_toks, in_run, lp, chunk_dead)
                logits = last.to(logits.dtype)
            elif any_need:
                # the next logits of the rows that go on (also the post-state, for rows whose segment ended)
                if valid_mode:
                    feed = torch.where(active, tok, torch.full_like(tok, BOS_ID))
                    if all_valid and not getattr(cache, "ragged", False) and (not R or aligned):
                        valid = None  # rows in lockstep: the dense path; ended rows' dummies are never read
                    else:  # rows at their own positions: an ended row is fed nothing (no position past its end)
                        valid = need if getattr(cache, "ragged", False) else active | done
                else:
                    feed, valid = tok, (None if all_valid and (not R or aligned) else need)
                if R:
                    feed = torch.cat([feed[:, None], run_feed], 1)
                    if valid is not None:
                        valid = torch.cat([valid[:, None], in_run & valid[:, None]], 1)
                else:
                    feed = feed[:, None]
                    valid = None if valid is None else valid[:, None]
                fl, cache, context = base.feed(cache, context, feed, valid, kw)
                if R:
                    lp, chunk_dead = self._score_run(fl, before, run_toks, in_run, lp, chunk_dead)
                    last = fl.gather(1, r[:, None, None].expand(-1, 1, fl.shape[-1])).squeeze(1)
                else:
                    last = fl[:, -1]
                logits = torch.where(need[:, None], last.to(logits.dtype), logits)
            if not any_still:
                break
            active = still
        if runs is not None and bool(chunk_dead):  # one more host sync per segment, with chunks only
            raise ValueError("rows have no admissible token of positive probability: the LM gives probability "
                             "0 to a forced token (the only one the constraint allows)")
        blocks.append((rows, cols))
        value = torch.zeros(n, sum(len(c) for _, c in blocks), dtype=torch.long, device=dev)
        at = 0
        for r_, c in blocks:
            if c:
                block = torch.stack(c, 1)
                if r_ is None:
                    value[:, at:at + len(c)] = block
                else:
                    value[r_, at:at + len(c)] = block
                at += len(c)
        if ragged_cols:  # runs of different lengths left <pad> inside rows: pack each row's tokens to the left
            value = trim_padding(left_pack(value))
        post = {"cache": cache, "context": context, "tokens": _append(snap["tokens"], snap["lengths"], value)}
        if rows is None:
            post.update(logits=logits, s=s, lengths=lengths, done=done, _step_lp=lp)
        else:
            write_back()
            post.update(logits=full["logits"], s=full["s"], lengths=full["lengths"], done=full["done"],
                        _step_lp=full["lp"])
            src = torch.zeros(n, dtype=torch.long, device=dev)  # ended rows: any live row's cache
            src[rows] = torch.arange(len(rows), device=dev)
            post["_src"] = src
        check_no_nan(post["_step_lp"], base.lm)
        post["log_prob"] = snap["log_prob"] + post["_step_lp"]
        return value, post

    def _forced_runs(self, until):
        """The rule's forced-run tables for this segment (chunked encoding), or None (``chunk=0``, per-row
        ``until``, rules without automaton tables)."""
        base = self.base
        if not base.chunk or (until is not None and until.ndim):
            return None
        stops = self.stop_ids if not self._base_stops else torch.cat([self.stop_ids, base.stop_ids])
        return base.rule.forced_runs(None if until is None else int(until), stops, base.chunk, base.device)

    def _score_run(self, fl, before, run_toks, in_run, lp, dead):
        """Add the forced run tokens' log-probabilities to ``lp``: the masked softmax (Def 2.8) at each run
        position from the chunk's logits (``fl[:, j]`` precede run token j), exactly 0 for a forced token with a
        finite logit, as in the token-by-token loop (NaN stays NaN for :func:`check_no_nan`). Also returns
        ``dead``: whether a run token has log-probability -inf (the LM gives 0 to the one admissible token)."""
        m, R = run_toks.shape
        logq = self.base.rule.log_probs(fl[:, :R].reshape(m * R, -1), before.reshape(m * R))
        tl = logq.gather(-1, run_toks.reshape(m * R, 1)).reshape(m, R)
        tl = torch.where(in_run, tl, torch.zeros_like(tl))
        return lp + tl.sum(-1), dead | torch.isneginf(tl).any()

    # ------------------------------------------------------------------ scoring: one teacher-forced pass
    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """The segment's log-probability ``[n]``: the masked step log-probabilities (Def 2.8) summed (2.13)."""
        post = self._lookup(value)[1]
        return (post if post is not None else self._advance(value))["_step_lp"]

    def _knows(self, value) -> bool:
        return self.base_version == self.base.version and any(v is value for v, _, _ in self._memo)

    def _advance(self, value: torch.Tensor) -> dict:
        """The state after appending ``value`` (memoised by identity) with ``_step_lp`` its log-probability."""
        i, post = self._lookup(value)
        if post is None:
            post = self._teacher_force(value)
            self._memo.append((value, post, _needs_grad(self.base.lm)))
        elif "_src" in post:  # rows were dropped while sampling: gather the cache back to n rows
            post = _gathered(post)
            self._memo[i] = (value, post, self._memo[i][2])
        return post

    def _lookup(self, value) -> tuple[int, dict | None]:
        """The memoised post-state of ``value`` (by identity; one computed with gradients if they are needed)."""
        grad = _needs_grad(self.base.lm)
        for i, (v, post, g) in enumerate(self._memo):
            if v is value and (g or not grad):
                return i, post
        return -1, None

    def _check(self, value) -> torch.Tensor:
        base = self.base
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
        elif self.scalar:
            raise MalformedSequenceError(f"a next token for {base.n} rows must be [{base.n}], got {tuple(v.shape)}")
        if v.ndim != 2 or v.shape[0] != base.n:
            raise MalformedSequenceError(f"a segment for {base.n} rows must be [{base.n}, S], got {tuple(v.shape)}")
        if v.numel() and (v.min() < 0 or v.max() >= base.lm.vocab_size):
            raise MalformedSequenceError(f"segment ids outside the vocabulary [0, {base.lm.vocab_size})")
        present = v != PAD_ID
        if v.shape[1] and (present[:, 1:] & ~present[:, :-1]).any():
            raise MalformedSequenceError("padding inside a segment: <pad> must only fill the end of a row")
        return v

    def _teacher_force(self, value: torch.Tensor) -> dict:
        base, snap = self.base, self.snap
        rule = base.rule
        v = self._check(value)
        n, S = v.shape
        dev = base.device
        present = v != PAD_ID
        seg_len = present.sum(-1)
        until = self._until()
        start_active = self._start_active()
        # step the rule along the segment: states before each token, vectorised over rows
        s = snap["s"]
        states = []
        lengths = snap["lengths"]
        count = torch.zeros(n, dtype=torch.long, device=dev)
        ended = ~start_active  # the segment has ended (or the sequence, for an open segment)
        ok = ~(ended & (seg_len > 0))
        if not self.open_end:
            ok = ok & ~(start_active & (seg_len == 0))
        done = snap["done"]
        tabs = self._end_tables
        if tabs is None:
            scalar = until is None or until.ndim == 0
            tabs = rule.end_tables(None if until is None else int(until), dev) if scalar else None
            self._end_tables = tabs if tabs is not None else False
        if tabs and S:
            # table rules: step the states along the segment, then every end test at once on [n, S]
            for j in range(S):
                states.append(s)
                s = rule.advance(s, v[:, j])
            after = torch.stack(states[1:] + [s], 1)
            cum = torch.cumsum(present.long(), 1)
            seg_end, seq_end = self._ends(v, after, cum, lengths[:, None] + cum, until, int(lengths.max()) + S)
            seg_end, seq_end = seg_end & present, seq_end & present
            lengths = lengths + seg_len
            done = done | seq_end.any(-1)
            end_at = seq_end if self.open_end else seg_end
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
            seg_end, seq_end = self._ends(tok, s, count, lengths, until)
            done = done | (inside & seq_end)
            ended = ended | (inside & (seq_end if self.open_end else seg_end))
        if not self.open_end:
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
                "tokens": _append(snap["tokens"], snap["lengths"], v), "lengths": lengths,
                "log_prob": snap["log_prob"] + step_lp, "done": done, "_step_lp": step_lp}


def check_no_nan(log_prob: torch.Tensor, lm) -> None:
    """Raise :class:`NumericalError` if a log-probability the LM gave is NaN (one host sync per segment)."""
    if bool(torch.isnan(log_prob.detach()).any()):
        bad = [n for n, p in lm.named_parameters() if not torch.isfinite(p.detach()).all()] \
            if isinstance(lm, torch.nn.Module) else []
        where = f": non-finite parameters {bad[:5]}" if bad else " (NaN logits)"
        raise NumericalError(f"{type(lm).__name__} gave NaN log-probabilities{where}")


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs [n, V]`` (unnormalised, non-negative) by inversion: the first index
    whose cumulative mass exceeds u * total, u ~ U[0, 1). An index of mass 0 is never drawn (its
    cumulative mass equals the previous one), and u * total is kept below the total, so a row with
    positive mass draws in range; a row of zero mass draws V (callers test for it); float64 rows are
    drawn in float64. One uniform per
    row: a few times cheaper than ``torch.multinomial`` on CPU for small vocabularies, and one pass over
    the row for large ones."""
    cdf = probs.cumsum(-1)
    # u * total' with total' = total (1 - 2^-22) < total after rounding, and u < 1: u * total' <= total'
    # (a relative 2^-22 of the last index's mass is given to the earlier ones)
    below = cdf[:, -1:] * (1.0 - 2.0 ** -22)
    u = torch.rand(below.shape, generator=generator, device=probs.device, dtype=cdf.dtype) * below
    return (cdf <= u).sum(-1)


def _gathered(post: dict) -> dict:
    """A post-state sampled on fewer rows made whole: the cache (or contexts) gathered back to every row
    (rows that ended their sequence get another row's: nothing reads them)."""
    post = dict(post)
    src = post.pop("_src")
    if post["cache"] is not None:
        post["cache"] = post["cache"].reorder(src)
    if post["context"] is not None:
        post["context"] = post["context"][src]
    return post


def _needs_grad(lm) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for p in lm.parameters())


def _as_ids(stop, device=None) -> torch.Tensor:
    if isinstance(stop, torch.Tensor):
        items = stop.reshape(-1).tolist()
    else:
        items = [stop] if isinstance(stop, (int, str)) else list(stop)
    bad = [s for s in items if isinstance(s, str) or isinstance(s, float)]
    if bad:
        raise MalformedSequenceError(f"stop takes token ids, got {bad!r}: an LMState knows ids, not strings; "
                                     f"use vocab.id({bad[0]!r})")
    return torch.tensor([int(s) for s in items], dtype=torch.long, device=device)


def _append(tokens: torch.Tensor, lengths: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
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
