"""The next segment of every row of an :class:`~ppl_thought.distributions.lm_state.LMState` as a Pyro
distribution: the lockstep sampling loop (one decoding loop for every engine, guide and program), each token through
:func:`~ppl_thought.distributions.token_rule.token_step`; the teacher-forced scoring pass is in scoring.py. Step
log-probabilities are log softmax(f~(z_<i))_{z_i} of Def 2.8, summed over the
segment as in (2.13).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought import checks
from ppl_thought.distributions.scoring import append_rows, check_no_nan, teacher_force
from ppl_thought.distributions.token_rule import (  # sample_categorical: re-exported from its old home
    TokenStep,
    left_pack,
    sample_categorical,
    skip_draws,
    token_step,
    trim_padding,
)
from ppl_thought.errors import MalformedSequenceError, UnsatisfiableConstraintError
from ppl_thought.lm.base import match_rows, with_room
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["STATE_KEYS", "Segment", "check_no_nan", "sample_categorical"]


#: the fields of an LMState that a segment's sampling or scoring pass produces (``LMState.snapshot``)
STATE_KEYS = ("logits", "cache", "context", "s", "tokens", "lengths", "log_prob", "done")


@dataclass(slots=True)
class _Loop:
    """The state of :meth:`Segment._decode`'s sampling loop: the live rows (``rows``: their indices among the
    ``n``, None while all are live) and their per-row quantities, the current step's token and flags, and the
    results gathered so far (``full``: every row's, written when rows are dropped; ``blocks``: (rows, token
    columns) per stretch of live rows)."""

    rows: torch.Tensor | None
    logits: torch.Tensor
    cache: Any
    context: torch.Tensor | None
    s: torch.Tensor
    lengths: torch.Tensor
    done: torch.Tensor
    count: torch.Tensor
    lp: torch.Tensor
    active: torch.Tensor  # rows drawing a token at this step (their segment goes on)
    until: torch.Tensor | None
    kw: dict
    len_bound: int  # host bound on the lengths
    chunk_dead: torch.Tensor  # a forced token had probability 0 (chunked encoding)
    tok: torch.Tensor | None = None  # this step's token
    still: torch.Tensor | None = None  # active rows whose segment goes on after this step
    need: torch.Tensor | None = None  # rows whose logits after this step will be read
    r: torch.Tensor | None = None  # this step's forced run lengths (chunked encoding)
    full: dict = field(default_factory=dict)
    blocks: list = field(default_factory=list)
    cols: list = field(default_factory=list)
    ragged_cols: bool = False  # a chunk gave rows runs of different lengths: <pad> inside columns


class _Flags(NamedTuple):
    """A sampling step's decisions, read from the device in one host sync (:meth:`Segment._host_flags`)."""

    dead: bool
    any_need: bool
    any_still: bool
    n_done: int
    n_need: int
    all_valid: bool
    all_need: bool
    R: int  # the longest forced run after this step's tokens (0: none, or no chunks)
    aligned: bool  # every row that is not done has a run of length R
    aligned_still: bool  # every row whose segment goes on has a run of length R


class _Run(NamedTuple):
    """The forced runs after a step's tokens (:meth:`Segment._forced_run`), ``[m, R]`` each."""

    in_run: torch.Tensor
    toks: torch.Tensor
    before: torch.Tensor  # the rule state before each run token
    feed: torch.Tensor  # what is fed: the run tokens, <bos> past a row's run


@checked
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

    def __init__(self, lm_state: Any, until_emitted: int | torch.Tensor | None = None,
                 stop: str | int | Sequence[str | int] | torch.Tensor | None = None, max_tokens: int | None = None,
                 scalar: bool = False, open_end: bool = False, validate_args: bool | None = None):
        checks.has_attributes("lm_state", lm_state, ("snapshot", "version", "stop_ids", "device"),
                              "an LMState (pt.dist.LMState.start(lm, n, ...))")
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

    @per_token
    def expand(self, batch_shape: Sequence[int], _instance: Segment | None = None):
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
            seq_state = tabs[1][idx]  # any shape of s: [n] or [n, S]
            seg_state = seq_state if tabs[0] is tabs[1] else tabs[0][idx]
        else:
            seq_state = rule.is_final(s)
            seg_state = seq_state if until is None else seq_state | (rule.num_emitted(s) >= until)
        seq = seq_state if len_bound is not None and len_bound < base.max_len else seq_state | (lengths >= base.max_len)
        if self._base_stops:
            seq = seq | torch.isin(tok, base.stop_ids)
        seg = seq if seq is seg_state else seq | seg_state
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
    @per_token
    def sample(self, sample_shape: Sequence[int] = ()) -> torch.Tensor:
        if torch.Size(sample_shape) != torch.Size():
            raise MalformedSequenceError("a Segment draws one segment per row; use the particle plate for more")
        return self.sample_with_log_prob()[0]

    @per_token
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
        out._pt_sampled_vocab = base.lm.vocab_size  # well formed by construction (see scoring.check_value)
        return out, post["_step_lp"]

    def _decode(self, active, generator, valid_mode):
        """The lockstep sampling loop of :meth:`sample_with_log_prob` on the rows ``active`` (the steps of a
        segment, Lemma 2.1), one iteration per token: draw every live row's token from the masked softmax of
        Def 2.8 (:meth:`_draw`), read the step's flags in one host sync (:meth:`_host_flags`), go on with the
        rows whose sequence goes on once enough have ended (:meth:`_drop_ended`), take the forced run after the
        token when chunking (:meth:`_forced_run`, end of Section 5.6.2), feed the LM (:meth:`_feed`). Then the
        value and the post-state (:meth:`_finish`). Returns (value ``[n, S]``, post-state dict)."""
        loop = self._loop_start(active)
        runs = self._forced_runs(loop.until)  # chunked encoding (end of 5.6.2): None when off or not available
        while True:
            step = self._draw(loop, generator)
            flags = self._host_flags(loop, step, runs, valid_mode)
            if flags.dead:
                raise UnsatisfiableConstraintError(f"{int(step.dead.sum())} rows have no admissible token of positive "
                                                   "probability: the LM gives probability 0 to every token the "
                                                   "constraint allows")
            if flags.any_still and flags.n_done > self.drop_fraction * loop.done.shape[0]:
                flags = self._drop_ended(loop, flags)
            run = self._forced_run(loop, runs, flags.R, flags.aligned_still, generator, step.draw_dtype) \
                if flags.R else None
            self._feed(loop, flags, run, valid_mode)
            if not flags.any_still:
                break
            loop.active = loop.still
        return self._finish(loop, runs)

    def _loop_start(self, active) -> _Loop:
        """The sampling loop's state at the start of the segment: every row live, the snapshot's quantities."""
        base, snap = self.base, self.snap
        n, dev = base.n, base.device
        # host bounds on the lengths (one sync per segment): the loop feeds at most max_len - shortest positions,
        # the room its cache's gathers need (a hint, KVCache.with_room)
        shortest, longest = torch.stack(torch.aminmax(snap["lengths"])).tolist()
        return _Loop(rows=None, logits=snap["logits"], cache=with_room(snap["cache"], base.max_len - shortest),
                     context=snap["context"], s=snap["s"],
                     lengths=snap["lengths"], done=snap["done"], count=torch.zeros(n, dtype=torch.long, device=dev),
                     lp=torch.zeros(n, device=dev), active=active, until=self._until(),
                     kw=match_rows(base.lm_kwargs, n), len_bound=longest,
                     chunk_dead=torch.zeros((), dtype=torch.bool, device=dev))

    def _draw(self, loop: _Loop, generator) -> TokenStep:
        """One token for every live row (:func:`~ppl_thought.distributions.token_rule.token_step`): drawn from the
        masked softmax log softmax(f~(z_<i)) of Def 2.8 (``<pad>`` for rows whose segment has ended), its
        log-probability added to the segment's (2.13), the rule state advanced, and where the segment and the
        sequence end (:meth:`_ends`: the segments of Lemma 2.1 end in a state of the constraint, at a stop id or
        after ``max_tokens``). Updates ``loop`` (token, rule state, lengths, done, the rows that go on)."""
        lengths = loop.lengths + loop.active  # (long + bool: long)
        count = loop.count + loop.active if self.max_tokens is not None else loop.count
        loop.len_bound += 1
        ends = partial(self._ends, count=count, lengths=lengths, until=loop.until, len_bound=loop.len_bound)
        step = token_step(self.base.rule, loop.logits, loop.s, loop.active, generator, ends=ends, done=loop.done)
        loop.lp = loop.lp + step.log_prob
        loop.tok, loop.s, loop.lengths, loop.count, loop.done, loop.still = (
            step.token, step.state, lengths, count, step.done, step.going)
        loop.need = loop.active > loop.done  # rows whose logits after this token will be read (bools: a & ~b)
        loop.cols.append(step.token)
        return step

    def _host_flags(self, loop: _Loop, step: TokenStep, runs, valid_mode: bool) -> _Flags:
        """The step's decisions, read in its one host sync: a dead row, rows to feed, rows that go on, rows that
        ended their sequence, whether every row is fed as it is; with chunks (end of 5.6.2) the length ``r`` of
        each row's forced run after its token (``loop.r``), the longest ``R`` and whether the runs are aligned."""
        base = self.base
        done, still, need = loop.done, loop.still, loop.need
        # per-row flags counted in one reduction: any <=> count > 0, all <=> count == rows. The rows fed as they are
        # (valid mode: active or done; else: need) are counted from these: need and done are disjoint, and
        # active | done = need | done
        flags = [torch.stack([step.dead, need, still, done]).sum(1)]
        if runs is not None:
            # the forced run after this token, for the rows whose segment goes on: it never ends the
            # segment nor the sequence (the tables stop before that), nor reaches max_len / max_tokens
            s, lengths = loop.s, loop.lengths
            r = torch.where(still, runs[0][s], torch.zeros_like(s))
            r = torch.minimum(r, base.max_len - 1 - lengths).clamp_(min=0)
            if self.max_tokens is not None:
                r = torch.minimum(r, self.max_tokens - 1 - loop.count).clamp_(min=0)
            r_max = r.max()
            loop.r = r
            flags.append(torch.stack([r_max, ((r == r_max) | done).all().long(), ((r == r_max) | ~still).all().long()]))
        host = (torch.cat(flags) if runs is not None else flags[0]).tolist()  # the one host sync of the step
        m = done.shape[0]
        R, aligned, aligned_still = host[4:] if runs is not None else (0, True, True)
        fed = host[1] + host[3] if valid_mode else host[1]
        return _Flags(host[0] > 0, host[1] > 0, host[2] > 0, host[3], host[1], fed == m, host[1] == m, R,
                      bool(aligned), bool(aligned_still))

    def _drop_ended(self, loop: _Loop, flags: _Flags) -> _Flags:
        """Go on with the rows whose sequence goes on (waiting rows included): the results of every row so far are
        written back (:meth:`_write_back`), and every per-row quantity, the KV cache (``cache.reorder``), the
        contexts and the LM keyword arguments keep the live rows only. Returns the flags of the rows kept."""
        m = loop.done.shape[0]
        self._write_back(loop)
        loop.blocks.append((loop.rows, loop.cols))
        loop.cols = []
        keep = (~loop.done).nonzero().squeeze(-1)
        loop.rows = keep if loop.rows is None else loop.rows[keep]
        for name in ("logits", "s", "lengths", "done", "lp", "count", "active", "still", "need", "tok"):
            setattr(loop, name, getattr(loop, name)[keep])
        if loop.r is not None:
            loop.r = loop.r[keep]
        if loop.until is not None and loop.until.ndim:
            loop.until = loop.until[keep]
        loop.cache = loop.cache.reorder(keep) if loop.cache is not None else None
        if loop.context is not None:
            context = loop.context[keep]
            loop.context = context[:, : int((context != PAD_ID).sum(-1).max())]
        loop.kw = {k: (v[keep] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == m else v)
                   for k, v in loop.kw.items()}
        # no row left has ended its sequence: the rows kept are fed as they are iff each is active (need, as none
        # is done), counted before the drop (no host sync)
        every = flags.n_need == m - flags.n_done
        return flags._replace(all_valid=every, all_need=every)

    def _write_back(self, loop: _Loop) -> None:
        """Write the live rows' results (logits, rule state, lengths, done, log-probability) into ``loop.full``,
        the per-row results of every row (all of them the first time)."""
        live = {"logits": loop.logits, "s": loop.s, "lengths": loop.lengths, "done": loop.done, "lp": loop.lp}
        for k, v in live.items():
            if loop.rows is None:
                loop.full[k] = v.clone()
            else:
                loop.full[k][loop.rows] = v.to(loop.full[k].dtype)

    def _forced_run(self, loop: _Loop, runs, R: int, aligned_still: bool, generator, dtype) -> _Run:
        """The forced run after each row's token (chunked encoding, end of Section 5.6.2): ``loop.r`` tokens that
        the constraint allows alone, taken from the rule's tables without drawing. The rule state, lengths and
        counts move past the run; the uniforms the token-by-token loop would draw for these steps are skipped
        (:func:`~ppl_thought.distributions.token_rule.skip_draws`), so the random stream is that loop's."""
        s, r = loop.s, loop.r
        m = s.shape[0]
        in_run = torch.arange(R, device=s.device)[None] < r[:, None]  # [m, R]
        run_states = runs[2][s]  # [m, limit + 1]: the state before each run token, then held
        run_toks = torch.where(in_run, runs[1][s][:, :R], torch.zeros_like(in_run, dtype=torch.long))
        loop.s = run_states.gather(1, r[:, None]).squeeze(1)
        loop.lengths = loop.lengths + r
        if self.max_tokens is not None:
            loop.count = loop.count + r
        loop.len_bound += R
        skip_draws(m, R, generator, s.device, dtype)  # forced tokens: the loop's draws, unused
        loop.cols.extend(run_toks[:, j] for j in range(R))
        loop.ragged_cols = loop.ragged_cols or not aligned_still
        run_feed = torch.where(in_run, run_toks, torch.full_like(run_toks, BOS_ID))
        return _Run(in_run, run_toks, run_states[:, :R], run_feed)

    def _feed(self, loop: _Loop, flags: _Flags, run: _Run | None, valid_mode: bool) -> None:
        """Feed each live row's block (its token where it is read, then its forced run) to the LM in one pass and
        keep the next-token logits of the rows that go on; rows in lockstep take the LM's dense path. The forced
        run tokens are scored from the chunk's logits (:meth:`_score_run`, Def 2.8)."""
        base = self.base
        tok, need, active, done = loop.tok, loop.need, loop.active, loop.done
        aligned = run is None or flags.aligned
        if flags.all_need and aligned:  # every row goes on: feed its token as it is, take every row's logits
            block = tok[:, None] if run is None else torch.cat([tok[:, None], run.feed], 1)
            fl, loop.cache, loop.context = base.feed(loop.cache, loop.context, block, None, loop.kw)
            last = fl[:, -1]
            if run is not None:
                loop.lp, loop.chunk_dead = self._score_run(fl, run.before, run.toks, run.in_run, loop.lp,
                                                           loop.chunk_dead)
            loop.logits = last.to(loop.logits.dtype)
        elif flags.any_need:
            # the next logits of the rows that go on (also the post-state, for rows whose segment ended)
            ragged = getattr(loop.cache, "ragged", False)
            if valid_mode:
                feed = torch.where(active, tok, BOS_ID)
                if flags.all_valid and not ragged and aligned:
                    valid = None  # rows in lockstep: the dense path; ended rows' dummies are never read
                else:  # rows at their own positions: an ended row is fed nothing (no position past its end)
                    valid = need if ragged else active | done
            else:
                feed, valid = tok, (None if flags.all_valid and aligned else need)
            if run is not None:
                feed = torch.cat([feed[:, None], run.feed], 1)
                if valid is not None:
                    valid = torch.cat([valid[:, None], run.in_run & valid[:, None]], 1)
            else:
                feed = feed[:, None]
                valid = None if valid is None else valid[:, None]
            fl, loop.cache, loop.context = base.feed(loop.cache, loop.context, feed, valid, loop.kw)
            if run is not None:
                loop.lp, loop.chunk_dead = self._score_run(fl, run.before, run.toks, run.in_run, loop.lp,
                                                           loop.chunk_dead)
                last = fl.gather(1, loop.r[:, None, None].expand(-1, 1, fl.shape[-1])).squeeze(1)
            else:
                last = fl[:, -1]
            loop.logits = torch.where(need[:, None], last.to(loop.logits.dtype), loop.logits)

    def _finish(self, loop: _Loop, runs) -> tuple[torch.Tensor, dict]:
        """The sampled value ``[n, S]`` (the token columns of every block of rows, scattered back to the ``n``
        rows; rows left-packed when forced runs of different lengths left ``<pad>`` inside them) and the
        post-state, whose cache is gathered back to ``n`` rows only when it is used (``_src``)."""
        base, snap = self.base, self.snap
        n, dev = base.n, base.device
        if runs is not None and bool(loop.chunk_dead):  # one more host sync per segment, with chunks only
            raise UnsatisfiableConstraintError("rows have no admissible token of positive probability: the LM gives "
                                               "probability 0 to a forced token (the only one the constraint allows)")
        blocks = loop.blocks + [(loop.rows, loop.cols)]
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
        if loop.ragged_cols:  # runs of different lengths left <pad> inside rows: pack each row's tokens to the left
            value = trim_padding(left_pack(value))
        # the room hint of this loop ends with it (rows that waited took slots but no tokens: later resamplings and
        # segments size their buffers afresh)
        post = {"cache": with_room(loop.cache, None), "context": loop.context,
                "tokens": append_rows(snap["tokens"], snap["lengths"], value)}
        if loop.rows is None:
            post.update(logits=loop.logits, s=loop.s, lengths=loop.lengths, done=loop.done, _step_lp=loop.lp)
        else:
            self._write_back(loop)
            full = loop.full
            post.update(logits=full["logits"], s=full["s"], lengths=full["lengths"], done=full["done"],
                        _step_lp=full["lp"])
            src = torch.zeros(n, dtype=torch.long, device=dev)  # ended rows: any live row's cache
            src[loop.rows] = torch.arange(len(loop.rows), device=dev)
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
    @per_token
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
            post = teacher_force(self, value)
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
