"""Verifier-guided generation that may erase tokens: Algorithm 1 and VGB (thesis Ch. 3, Sections 3.2-3.3).

* :class:`TokenwiseBacktracking` is Algorithm 1, tokenwise rejection sampling with backtracking: sample a
  token, ask the process verifier about the new prefix, and on a rejection (while the backtrack quota
  ``Q`` lasts) erase the last ``B`` tokens and redo those positions greedily (argmax).
* :class:`VGB` is Algorithm 2, value-guided sampling with stochastic backtracking: a lazy random walk on
  the tree of partial generations that moves to a child ``y o a`` with weight ``pi_ref(a | y) V(y o a)``
  and to the parent with weight ``V(y)``, the Sinclair-Jerrum walk generalised.

Both take a token-level program, ``run(program, guide=None, *args)``: any program whose
:meth:`~ppl_thought.program.Program.one_token_step` declares one token of one LM per step (the engines read the LM,
``max_tokens`` (D, the horizon H), ``stop_ids`` and the prompt from it). ``guide`` is the verifier (Algorithm 1) or
the value function (VGB): a :class:`~ppl_thought.verifiers.ProcessVerifier` or a callable on right-padded prefixes;
``None``: the program's own rule, as the process verifier of its automaton for strings of ``max_tokens`` tokens
(for :class:`~ppl_thought.verifiers.VerifiedLM`, its verifier). ``run(lm, verifier, prompt=None, ...)`` is sugar for
``run(Constrained(lm, None, max_len), verifier, prompt, ...)``.

Both are batched over rows (every row is an independent sample or chain). Rows sit at different
depths of the tree and move both ways, so the next-token distribution of each row is read with one
teacher-forced pass over its current prefix (right padding is harmless for a causal LM: position
``i`` never attends to later ones). That costs O(|prefix|) per step instead of the O(1) of a KV cache;
a per-row cache crop is future work. Oracle calls are counted as in Def 3.1.1 / 3.1.6: one next-token
query of the LM is one call, one evaluation of the verifier or value function on one prefix is one call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ppl_thought.checks import integer as check_count
from ppl_thought.distributions.lm_state import generated_tokens, masked_log_softmax, nucleus
from ppl_thought.distributions.token_rule import token_step
from ppl_thought.errors import ConfigError, SamplingBudgetError, UnsatisfiableConstraintError
from ppl_thought.inference.result import Result
from ppl_thought.lm.base import lm_device
from ppl_thought.lm.tabular import Tabular
from ppl_thought.program import OneTokenStep, is_program
from ppl_thought.validation import checked
from ppl_thought.verifiers.process import ProcessVerifier
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["TokenwiseBacktracking", "VGB", "TabularValue"]

Verifier = ProcessVerifier | Callable[[torch.Tensor], torch.Tensor]


class PrefixRows:
    """``n`` rows of a prefix tree walk: ``<bos> + prompt + y`` with ``y`` right-padded to ``horizon``.

    ``tokens[:, :horizon]`` is the generated part (``<pad>`` after each row's length), ``lengths`` the
    depth |y| of each row in the tree.
    """

    def __init__(self, lm: torch.nn.Module, n: int, horizon: int, prompt: torch.Tensor | None):
        self.lm, self.n, self.horizon = lm, n, horizon
        dev = lm_device(lm)
        head = torch.tensor([BOS_ID], device=dev)
        if prompt is not None:
            prompt = torch.as_tensor(prompt, dtype=torch.long, device=dev)
            if prompt.ndim != 1:
                raise ConfigError(f"prompt must be 1-D token ids shared by every row, got shape {tuple(prompt.shape)}")
            head = torch.cat([head, prompt])
        self.head = head  # [P]
        self.tokens = torch.full((n, horizon), PAD_ID, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(n, dtype=torch.long, device=dev)
        self.floor = torch.zeros(n, dtype=torch.long, device=dev)  # pop never goes below it
        self.mask = generated_tokens(lm.vocab_size, dev)

    def start_at(self, prefixes: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Start every row at its own right-padded prefix ``[n, P]`` (``P <= horizon``); rows never erase their
        first ``keep [n]`` tokens (default: the whole prefix)."""
        prefixes = torch.as_tensor(prefixes, dtype=torch.long, device=self.tokens.device)
        if prefixes.ndim != 2 or prefixes.shape[0] != self.n or prefixes.shape[1] > self.horizon:
            raise ConfigError(f"row_prompts must be right-padded token ids [num_samples={self.n}, P <= "
                              f"{self.horizon}], got shape {tuple(prefixes.shape)}")
        is_tok = prefixes != PAD_ID
        if prefixes.shape[1] > 1 and (is_tok[:, 1:] & ~is_tok[:, :-1]).any():
            raise ConfigError("row_prompts must be right-padded: a token after <pad>")
        self.tokens[:, :prefixes.shape[1]] = prefixes
        self.lengths = is_tok.sum(-1)
        if keep is None:
            self.floor = self.lengths.clone()
        else:
            keep = torch.as_tensor(keep, dtype=torch.long, device=self.tokens.device)
            if keep.shape != (self.n,) or (keep < 0).any() or (keep > self.lengths).any():
                raise ConfigError(f"keep must be [{self.n}] counts between 0 and each row's prompt length, got "
                                  f"{keep.tolist() if keep.numel() <= 8 else tuple(keep.shape)}")
            self.floor = keep.clone()

    def reset(self, rows: torch.Tensor) -> None:
        self.tokens[rows] = PAD_ID
        self.lengths[rows] = 0

    def log_probs(self, rows: torch.Tensor) -> torch.Tensor:
        """log pi_ref(. | prompt, y) ``[len(rows), V]`` (float32) for the current prefix of each row."""
        m = rows.shape[0]
        width = self.horizon  # static width: no host sync for the longest row
        ctx = torch.cat([self.head.expand(m, -1), self.tokens[rows, :width]], 1)
        with torch.no_grad():
            logits, _ = self.lm(ctx)
        at = (self.head.shape[0] - 1 + self.lengths[rows])[:, None, None].expand(m, 1, logits.shape[-1])
        return masked_log_softmax(logits.gather(1, at)[:, 0], self.mask.expand(m, -1))

    def push(self, rows: torch.Tensor, tok: torch.Tensor) -> None:
        self.tokens[rows, self.lengths[rows]] = tok
        self.lengths[rows] += 1

    def pop(self, rows: torch.Tensor, k: int | torch.Tensor = 1) -> None:
        """Erase the last ``k`` tokens of each row (fewer if the row is shorter)."""
        new = torch.maximum(self.lengths[rows] - k, self.floor[rows])
        cols = torch.arange(self.horizon, device=self.tokens.device)
        erase = cols[None, :] >= new[:, None]
        self.tokens[rows] = torch.where(erase, torch.full_like(self.tokens[rows], PAD_ID), self.tokens[rows])
        self.lengths[rows] = new

    def prefixes(self, rows: torch.Tensor) -> torch.Tensor:
        return self.tokens[rows]


def _check_lm_verifier(lm, verifier, horizon: int, what: str) -> None:
    if not isinstance(lm, torch.nn.Module) or not hasattr(lm, "vocab_size"):
        raise ConfigError(f"{what} needs an LM (a torch.nn.Module with vocab_size), got {type(lm).__name__}")
    if isinstance(verifier, ProcessVerifier):
        if verifier.automaton.vocab_size != lm.vocab_size:
            raise ConfigError(f"the verifier's automaton has {verifier.automaton.vocab_size} token columns but the "
                              f"LM has vocab_size={lm.vocab_size}")
        if verifier.length is not None and verifier.length != horizon:
            raise ConfigError(f"the verifier decides strings of length {verifier.length} but the horizon is {horizon}")
    elif not callable(verifier):
        raise ConfigError(f"{what} needs a ProcessVerifier or a callable on right-padded prefixes [m, L], "
                          f"got {type(verifier).__name__}")


def _token_program(program: Any, guide: Any, args: tuple, kwargs: dict, horizon: int,
                   engine: str) -> tuple[OneTokenStep, Any, Any]:
    """(the program's :class:`OneTokenStep`, the verifier or value, the prompt ids) of ``run(program, guide, *args,
    **kwargs)``; ``run(lm, verifier, prompt)`` is sugar for ``run(Constrained(lm, None, horizon), verifier, prompt)``.
    ``guide=None``: the process verifier of the program's rule for strings of ``max_tokens`` tokens."""
    if isinstance(program, torch.nn.Module) and not is_program(program):
        from ppl_thought.models.constrained import Constrained  # (models sit above the verifiers' pieces)

        if not hasattr(program, "vocab_size"):
            raise ConfigError(f"{engine} needs a token-level program or an LM (a torch.nn.Module with vocab_size), "
                              f"got {type(program).__name__}")
        _check_lm_verifier(program, guide, horizon, engine)
        program = Constrained(program, None, horizon)
    spec = OneTokenStep.of(program, engine)
    if spec.max_tokens != horizon:
        raise ConfigError(f"{engine} was built for strings of {horizon} tokens but {type(program).__name__} draws "
                          f"max_tokens={spec.max_tokens}")
    if guide is None:
        auto = spec.rule.constraint
        if auto is None:
            raise ConfigError(f"{engine} needs a verifier: {type(program).__name__}'s rule has no automaton; pass one "
                              "as the guide (a ProcessVerifier or a callable on right-padded prefixes)")
        guide = ProcessVerifier(auto, length=horizon)  # (a length_automaton's own reach already fixes the length)
    else:
        _check_lm_verifier(spec.lm, guide, horizon, engine)
    return spec, guide, spec.prompt_ids(args, kwargs)


@checked
class TokenwiseBacktracking:
    """Algorithm 1 of the thesis: tokenwise rejection sampling with backtracking (quota ``Q``, stride ``B``).

    For each row, while |s| < D and s does not end in ``<eos>``: sample ``t ~ O(prompt o s)`` and append
    it; if the row's quota is positive and ``V(prompt o s) = 0``, erase the last ``B`` tokens
    (``s <- s_{1:|s|-B}``, the empty string if |s| < B), spend one unit of quota and redo ``B`` positions
    greedily, each the argmax of O (the lowest id among ties; fewer when |s| would pass D or an ``<eos>``
    is produced). The verifier is not asked about the greedy tokens (lines 9-11), and not at all once the
    quota is spent (the short-circuit of line 6). With ``quota=0`` this is plain sampling from O; ``top_p < 1``
    samples line 4 from the nucleus of O instead (Table 3.3 combines both).

    A heuristic: even with a perfect process verifier its outputs are neither guaranteed to lie in A (the
    quota may run out) nor distributed as the restricted law; tests compare it with an exact enumeration
    of the algorithm as written.

    Args:
        num_samples: rows, one sample each.
        max_len: D, the length of a complete string.
        quota: Q >= 0, backtracks allowed per row.
        stride: B >= 1, tokens erased per backtrack.

    ``run(lm, verifier, prompt=None, generator=None, row_prompts=None, keep=None)``: ``verifier`` is
    a :class:`~ppl_thought.verifiers.ProcessVerifier` or any callable mapping right-padded prefixes
    ``[m, D]`` to bool ``[m]`` (a trained, imperfect verifier). Returns a :class:`Result` with
    ``samples[site]`` ``[num_samples, D]`` and ``stats``: ``lm_calls``, ``verifier_calls`` (totals) and per
    sample (``lm_calls_per_sample``, ``verifier_calls_per_sample``, ``backtracks_per_sample``).

    Per-row prompts (Table 3.3 completes a different prompt in every row): ``row_prompts`` ``[num_samples, P]``
    right-padded (``prompt`` must then be ``None``). Each row starts at its prompt ``x`` and ``D`` is the length
    of the whole string ``x o s``: the verifier is asked about ``x o s`` and the samples are the whole strings.
    Erasures stop at the prompt (``s <- s_{1:|s|-B}`` erases generated tokens only); ``keep [num_samples]``
    lowers that floor to the first ``keep`` tokens of each row, for prompts that end with tokens the model
    generated (the error-inducing prefixes of Sections 3.2.1.3-3.2.1.4: the OOD prompt, kept, then the
    model's own tokens up to its error, which a backtrack may erase).
    """

    def __init__(self, num_samples: int, max_len: int, quota: int = 4, stride: int = 4, top_p: float = 1.0,
                 site: str = "z"):
        if not 0.0 < float(top_p) <= 1.0:
            raise ConfigError(f"top_p must lie in (0, 1], got {top_p!r}")
        self.top_p = float(top_p)
        self.num_samples = check_count("num_samples", num_samples)
        self.max_len = check_count("max_len", max_len)
        self.quota = check_count("quota", quota, 0)
        self.stride = check_count("stride", stride)
        self.site = site

    def run(self, program: Any, guide: Verifier | None = None, *args: Any, generator: torch.Generator | None = None,
            row_prompts: torch.Tensor | None = None, keep: torch.Tensor | None = None, **kwargs: Any) -> Result:
        """Algorithm 1 on the token-level ``program`` run on ``*args, **kwargs`` with the verifier ``guide`` (module
        docstring); ``run(lm, verifier, prompt=None, generator=None, row_prompts=None, keep=None)``: the sugar."""
        if isinstance(program, torch.nn.Module) and not is_program(program) and len(args) > 1:
            generator, args = args[1], args[:1]
        spec, verifier, prompt = _token_program(program, guide, args, kwargs, self.max_len, "TokenwiseBacktracking")
        lm, stops = spec.lm, spec.stop_tensor(lm_device(spec.lm))
        n, D, B = self.num_samples, self.max_len, self.stride
        if row_prompts is not None and prompt is not None:
            raise ConfigError("give either prompt (shared by every row) or row_prompts (one per row), not both")
        rows = PrefixRows(lm, n, D, prompt)
        if row_prompts is not None:
            rows.start_at(row_prompts, keep)
        elif keep is not None:
            raise ConfigError("keep needs row_prompts")
        dev = rows.tokens.device
        quota = torch.full((n,), self.quota, dtype=torch.long, device=dev)
        lm_calls = torch.zeros(n, dtype=torch.long, device=dev)
        ver_calls = torch.zeros(n, dtype=torch.long, device=dev)
        backtracks = torch.zeros(n, dtype=torch.long, device=dev)
        ended = torch.zeros(n, dtype=torch.bool, device=dev)  # the last token is <eos>
        for _ in range(D):  # each round adds at least one token to every active row
            active = torch.nonzero((rows.lengths < D) & ~ended).squeeze(-1)
            if active.numel() == 0:
                break
            # line 4: t ~ O(prompt o s) (its nucleus with top_p < 1), no automaton (the verifier is asked below)
            tok = token_step(None, None, None, generator=generator,
                             log_probs=nucleus(rows.log_probs(active), self.top_p)).token
            rows.push(active, tok)
            lm_calls[active] += 1
            ended[active] = torch.isin(tok, stops)
            ask = active[quota[active] > 0]
            if ask.numel() == 0:
                continue
            ok = torch.as_tensor(verifier(rows.prefixes(ask)), device=dev).bool()
            ver_calls[ask] += 1
            bad = ask[~ok]
            if bad.numel() == 0:
                continue
            rows.pop(bad, B)
            quota[bad] -= 1
            backtracks[bad] += 1
            ended[bad] = False
            for _ in range(B):  # lines 9-11: redo the erased positions greedily
                redo = bad[(rows.lengths[bad] < D) & ~ended[bad]]
                if redo.numel() == 0:
                    break
                tok = rows.log_probs(redo).argmax(-1)
                rows.push(redo, tok)
                lm_calls[redo] += 1
                ended[redo] = torch.isin(tok, stops)
        stats = {
            "lm_calls": int(lm_calls.sum()),
            "verifier_calls": int(ver_calls.sum()),
            "lm_calls_per_sample": lm_calls,
            "verifier_calls_per_sample": ver_calls,
            "backtracks_per_sample": backtracks,
        }
        return Result(samples={self.site: rows.tokens.clone()}, stats=stats, engine="TokenwiseBacktracking")


@checked
class VGB:
    """Algorithm 2 of the thesis: value-guided sampling with stochastic backtracking (Section 3.3.1).

    Each row is a lazy random walk on the tree of partial generations ``y`` of length ``<= H``. From
    ``y`` of depth ``h`` it stays with probability 1/2, and otherwise moves to a neighbour drawn from

        p(parent y_{1:h-1})  proportional to  V(y)                       (0 at the root),
        p(child y o a)       proportional to  pi_ref(a | x, y) V(y o a)  (0 at depth H).

    **Guarantee.** The walk is reversible with respect to ``mu(y) proportional to pi_ref(y) Z(y)``, where
    ``Z(y)`` is the total weight of the moves out of ``y`` (check detailed balance on an edge u -> u o a:
    ``mu(u) pi_ref(a|u) V(u o a) / Z(u) = mu(u o a) V(u o a) / Z(u o a)``). At a leaf ``Z(y) = V(y)``, so
    when the value at complete strings is the exact outcome reward ``tau`` (Algorithm 2, line 2), the
    stationary law restricted to the leaves is ``pi_ref(y) tau(y)``, the target ``pi*`` **whatever the
    values at inner nodes** (property (3) of Section 3.3.1; the Sinclair-Jerrum walk when ``pi_ref`` is
    uniform and ``tau`` binary). The values at inner nodes only set the mixing speed and the mass on
    leaves (Omega(1/H) for good values). Exact at stationarity: with a finite ``num_steps`` from the root
    the output is approximately ``pi*``, the error vanishing as the walk mixes.

    Outputs (``output=``): ``"uniform"`` (the analysed version: the node at a uniformly drawn step
    ``i in [1, T]``; if it is not a leaf the row's walk is re-run, at most ``max_restarts`` times),
    ``"final"`` (the node at step T, re-run if not a leaf) and ``"first_leaf"`` (the empirical version:
    stop at the first leaf reached; fast, not covered by the guarantee).

    ``run(lm, value, prompt=None, generator=None)``: ``value`` is a
    :class:`~ppl_thought.verifiers.ProcessVerifier` with ``length=H`` (V = 1 on completable prefixes; at
    the leaves exactly membership in A), or a callable mapping right-padded prefixes ``[m, H]`` to
    non-negative values ``[m]`` (an approximate value function; at complete strings it should be the
    outcome reward). Returns a :class:`Result` with ``samples[site]`` ``[num_samples, H]`` and ``stats``:
    ``lm_calls`` (one per walk step of a non-leaf row), ``value_calls`` (prefixes evaluated: the current
    node and each child), ``steps_per_sample``, ``restarts_per_sample``, ``backtracks`` (moves to a parent).
    """

    def __init__(self, num_samples: int, horizon: int, num_steps: int, output: str = "uniform",
                 max_restarts: int = 1000, site: str = "z"):
        self.num_samples = check_count("num_samples", num_samples)
        self.horizon = check_count("horizon", horizon)
        self.num_steps = check_count("num_steps", num_steps)
        if output not in ("uniform", "final", "first_leaf"):
            raise ConfigError(f"output must be 'uniform', 'final' or 'first_leaf', got {output!r}")
        self.output = output
        self.max_restarts = check_count("max_restarts", max_restarts)
        self.site = site

    # ------------------------------------------------------------------ values
    def _values(self, value: Verifier, rows: PrefixRows, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(V(y) ``[m]``, V(y o a) ``[m, V]``) for the rows ``idx`` (children of leaves are 0)."""
        H = self.horizon
        pref = rows.prefixes(idx)
        lengths = rows.lengths[idx]
        Vsz = rows.lm.vocab_size
        if isinstance(value, ProcessVerifier):
            states, _ = value.states(pref)
            here = value.from_states(states, lengths).float()
            table = value.automaton.device_table("table", pref.device)  # [S + 1, V], row -1 = dead
            child_states = table[states]
            kids = value.from_states(child_states.reshape(-1), (lengths + 1).repeat_interleave(Vsz)).float()
            kids = kids.reshape(-1, Vsz)
        else:
            here = torch.as_tensor(value(pref), device=pref.device).float()
            m = idx.shape[0]
            child = pref.repeat_interleave(Vsz, 0)  # [m * V, H]
            at = lengths.clamp(max=H - 1).repeat_interleave(Vsz)
            child[torch.arange(m * Vsz, device=pref.device), at] = torch.arange(Vsz, device=pref.device).repeat(m)
            kids = torch.as_tensor(value(child), device=pref.device).float().reshape(m, Vsz)
        kids = kids.masked_fill((lengths >= H)[:, None], 0.0)
        kids = kids.masked_fill(~rows.mask, 0.0)
        if (here < 0).any() or (kids < 0).any() or torch.isnan(here).any() or torch.isnan(kids).any():
            raise ConfigError("a value function must return non-negative numbers (no NaN)")
        return here, kids

    def run(self, program: Any, guide: Verifier | None = None, *args: Any, generator: torch.Generator | None = None,
            **kwargs: Any) -> Result:
        """Algorithm 2 on the token-level ``program`` run on ``*args, **kwargs`` with the value function ``guide``
        (module docstring); ``run(lm, value, prompt=None, generator=None)``: the sugar."""
        if isinstance(program, torch.nn.Module) and not is_program(program) and len(args) > 1:
            generator, args = args[1], args[:1]
        spec, value, prompt = _token_program(program, guide, args, kwargs, self.horizon, "VGB")
        lm = spec.lm
        n, H, T = self.num_samples, self.horizon, self.num_steps
        rows = PrefixRows(lm, n, H, prompt)
        dev = rows.tokens.device
        root = torch.zeros(1, dtype=torch.long, device=dev)
        _, kids0 = self._values(value, rows, root)
        if not bool((kids0 * rows.log_probs(root).exp()).sum() > 0):
            raise UnsatisfiableConstraintError("every child of the root has value 0 under the LM (FAIL)")
        out = torch.full((n, H), PAD_ID, dtype=torch.long, device=dev)
        lm_calls = torch.zeros(n, dtype=torch.long, device=dev)
        value_calls = torch.zeros(n, dtype=torch.long, device=dev)
        steps = torch.zeros(n, dtype=torch.long, device=dev)
        restarts = torch.zeros(n, dtype=torch.long, device=dev)
        backtracks = torch.zeros(n, dtype=torch.long, device=dev)
        pending = torch.arange(n, device=dev)
        for _ in range(self.max_restarts + 1):
            rows.reset(pending)
            m = pending.shape[0]
            pick = torch.randint(1, T + 1, (m,), generator=generator, device=dev) if self.output == "uniform" \
                else torch.full((m,), T, device=dev)
            chosen = torch.full((m, H), PAD_ID, dtype=torch.long, device=dev)
            chosen_leaf = torch.zeros(m, dtype=torch.bool, device=dev)
            walking = torch.ones(m, dtype=torch.bool, device=dev)
            for t in range(1, T + 1):
                if self.output != "first_leaf":
                    walking = pick >= t  # a row stops walking after its drawn step
                if not bool(walking.any()):
                    break
                idx = pending[walking]
                here, kids = self._values(value, rows, idx)
                inner = rows.lengths[idx] < H
                pi = torch.zeros_like(kids)
                if bool(inner.any()):
                    pi[inner] = rows.log_probs(idx[inner]).exp()
                lm_calls[idx] += inner.long()
                value_calls[idx] += 1 + inner.long() * (rows.mask.sum())
                up = here.masked_fill(rows.lengths[idx] == 0, 0.0)
                w = torch.cat([up[:, None], pi * kids], 1)
                lazy = torch.rand(idx.shape[0], generator=generator, device=dev) < 0.5
                move = ~lazy & (w.sum(-1) > 0)
                # the walk's move as a token step over {parent} + Sigma (index 0: up, a + 1: child y o a) drawn from
                # its weights as they are; a row of weight 0 (its draw clamped) does not move
                choice = token_step(None, None, None, generator=generator, probs=w).token
                go_up, go_down = move & (choice == 0), move & (choice > 0)
                rows.pop(idx[go_up], 1)
                rows.push(idx[go_down], choice[go_down] - 1)
                backtracks[idx[go_up]] += 1
                steps[idx] += 1
                leaf = rows.lengths[idx] == H
                local = torch.nonzero(walking).squeeze(-1)
                if self.output == "first_leaf":
                    hit = local[leaf]
                    chosen[hit] = rows.tokens[idx[leaf]]
                    chosen_leaf[hit] = True
                    walking[hit] = False
                else:
                    now = pick[local] == t
                    chosen[local[now]] = rows.tokens[idx[now]]
                    chosen_leaf[local[now]] = leaf[now]
            out[pending[chosen_leaf]] = chosen[chosen_leaf]
            pending = pending[~chosen_leaf]
            if pending.numel() == 0:
                break
            restarts[pending] += 1
        else:
            raise SamplingBudgetError(f"VGB: {pending.numel()} rows drew no leaf in {self.max_restarts + 1} walks of "
                                      f"{T} steps; raise num_steps or max_restarts")
        stats = {
            "lm_calls": int(lm_calls.sum()),
            "value_calls": int(value_calls.sum()),
            "lm_calls_per_sample": lm_calls,
            "value_calls_per_sample": value_calls,
            "steps_per_sample": steps,
            "restarts_per_sample": restarts,
            "backtracks": int(backtracks.sum()),
        }
        return Result(samples={self.site: out}, stats=stats, engine="VGB")


@checked
class TabularValue:
    """The exact value function ``V*(y) = P_O(y o Y in A | y)`` of a Tabular LM under a length-N constraint.

    ``V*`` is what VGB's value oracle approximates (Section 3.3: value functions generalise the counting
    oracles of the Sinclair-Jerrum walk); with it the walk's stationary mass is 2 P(A) at every inner depth and
    P(A) at the root and at the leaves, so the leaves get 1/(2H) of it.
    Computed by dynamic programming over (remaining length, automaton state,
    LM context) for unigram and bigram tables:

        V_0(q, c) = 1(q final),    V_r(q, c) = sum_a O(a | c) V_{r-1}(delta(q, a), a)

    (``delta`` the automaton's transition, 0 past a dead state). A call maps right-padded prefixes
    ``[m, N]`` to ``V_{N - |y|}(state(y), last token of y or <bos>)`` ``[m]``.
    """

    def __init__(self, lm: Tabular, verifier: ProcessVerifier):
        if lm.order > 2:
            raise ConfigError("TabularValue needs a unigram or bigram Tabular LM (order 1 or 2)")
        if verifier.length is None:
            raise ConfigError("TabularValue needs a ProcessVerifier with a length N")
        if verifier.automaton.vocab_size != lm.vocab_size:
            raise ConfigError("the verifier's automaton and the LM have different vocabularies")
        self.verifier = verifier
        N, aut = verifier.length, verifier.automaton
        V = lm.vocab_size
        with torch.no_grad():
            logits = lm.logits.detach().double().cpu()
        if lm.order == 1:
            logits = logits.expand(V, V)
        mask = generated_tokens(V, "cpu")
        p = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)  # [context, next]
        nxt = torch.as_tensor(aut.next_state)  # [S, V]
        dead = nxt < 0
        tables = [torch.as_tensor(aut.final, dtype=torch.float64)[:, None].expand(-1, V).clone()]
        for _ in range(N):
            prev = tables[-1]  # [S, context]
            g = prev[nxt.clamp(min=0), torch.arange(V)[None, :]].masked_fill(dead, 0.0)  # [S, a]
            tables.append(g @ p.T)  # [S, context]
        self._tables = torch.stack(tables)  # [N + 1, S, V]
        self._cache: dict[str, torch.Tensor] = {}

    def __call__(self, prefixes: torch.Tensor) -> torch.Tensor:
        states, lengths = self.verifier.states(prefixes)
        key = str(prefixes.device)
        if key not in self._cache:
            self._cache[key] = self._tables.to(prefixes.device, torch.float32)
        tab = self._cache[key]
        N = self.verifier.length
        last = prefixes.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
        ctx = torch.where(lengths > 0, last, torch.full_like(last, BOS_ID))
        r = N - lengths
        ok = (states >= 0) & (r >= 0)
        val = tab[r.clamp(0, N), states.clamp(min=0), ctx]
        return torch.where(ok, val, torch.zeros_like(val))
