"""The Dyck sandbox of thesis Section 3.2.1: bounded-depth Dyck strings of a fixed length, in and out of distribution.

Dyck_{k,D} (equation (2.37)) strings of length ``N`` are generated left to right: open a bracket with
probability ``p_open`` while the depth is below ``D`` and the remaining length still allows every open
bracket to close, otherwise close the top one. An opened bracket has type ``t`` with probability
``type_probs[t]``. The thesis makes prompts *out of distribution* by an unbalanced bracket-type law
(Section 3.6: "unbalanced bracket type probability"): training strings favour type 0, OOD prefixes type 1.

:meth:`DyckTask.completions` enumerates every valid completion of a prefix, so the exact constrained
distribution of an LM given a prompt is computable on small cases.

:class:`DyckDistribution` is the thesis' own law D_Dyck of Definition 3.2.1 (two bracket types ``[ ] ( )``,
parameters ``p`` and ``q``), the law the thesis trains on (``p = 0.2``) and draws its OOD prompts from
(``p = 0.8``, Section 3.2.1.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ppl_thought import checks
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.projections.automaton import Automaton
from ppl_thought.validation import checked, per_token
from ppl_thought.verifiers.process import ProcessVerifier, dyck
from ppl_thought.vocab import Vocab

__all__ = ["DyckDistribution", "DyckTask"]

_OPEN, _CLOSE = "([{<", ")]}>"


#: the largest Dyck automaton DyckTask builds (a bigger depth is refused before any state is made)
MAX_DYCK_STATES = 1_000_000


@checked
@dataclass
class DyckTask:
    """Dyck_{k,D} strings of length ``N`` over a vocabulary of ``2k`` bracket tokens."""

    k: int = 2
    D: int = 4
    N: int = 16
    p_open: float = 0.5

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 4:
            raise ConfigError(f"DyckTask supports 1..4 bracket types, got k={self.k}")
        if self.N % 2 or self.N < 2 or self.D < 1:
            raise ConfigError(f"DyckTask needs an even length N >= 2 and a depth D >= 1, got N={self.N}, D={self.D}")
        states, width = 1, 1  # the automaton's states: the stacks of depth <= D, 1 + k + ... + k^D of them
        for _ in range(self.D):
            width *= self.k
            states += width
            if states > MAX_DYCK_STATES:
                raise ConfigError(f"DyckTask: depth D={self.D} with k={self.k} bracket types needs an automaton of "
                                  f"more than {MAX_DYCK_STATES} states (1 + k + ... + k^D); strings of length "
                                  f"N={self.N} never go deeper than N/2 = {self.N // 2}")
        self.vocab = Vocab([c for t in range(self.k) for c in (_OPEN[t], _CLOSE[t])])
        self.pairs = [(self.vocab.id(_OPEN[t]), self.vocab.id(_CLOSE[t])) for t in range(self.k)]
        self.automaton: Automaton = dyck(self.k, self.D, self.vocab)

    # ------------------------------------------------------------------ sampling
    @per_token
    def sample(self, n: int, type_probs: Sequence[float] | None = None, length: int | None = None,
               seed: int = 0) -> torch.Tensor:
        """``n`` strings ``[n, length]`` (default ``N``): prefixes of valid length-N Dyck strings, generated
        left to right (module docstring); ``type_probs`` defaults to uniform over the ``k`` types."""
        L = self.N if length is None else int(length)
        probs = np.full(self.k, 1 / self.k) if type_probs is None else np.asarray(type_probs, dtype=float)
        if probs.shape != (self.k,) or (probs < 0).any() or not np.isclose(probs.sum(), 1):
            raise ConfigError(f"type_probs must be {self.k} probabilities summing to 1, got {type_probs!r}")
        rng = np.random.default_rng(seed)
        opens = np.array([o for o, _ in self.pairs])
        closes = np.array([c for _, c in self.pairs])
        out = np.zeros((n, L), dtype=np.int64)
        stack = np.zeros((n, self.D), dtype=np.int64)  # bracket types on the stack
        depth = np.zeros(n, dtype=np.int64)
        rows = np.arange(n)
        for i in range(L):  # a loop over positions, vectorised over strings
            remaining = self.N - i
            can_open = (depth < self.D) & (depth + 1 <= remaining - 1)
            must_open = depth == 0
            do_open = must_open | (can_open & (rng.random(n) < self.p_open))
            t = rng.choice(self.k, size=n, p=probs)
            top = stack[rows, np.maximum(depth - 1, 0)]
            out[:, i] = np.where(do_open, opens[t], closes[top])
            stack[rows[do_open], depth[do_open]] = t[do_open]
            depth = depth + np.where(do_open, 1, -1)
        return torch.as_tensor(out)

    # ------------------------------------------------------------------ exact answers
    def state_after(self, prefix: Sequence[int]) -> int:
        """The Dyck automaton's state after ``prefix`` (-1 if the prefix is not a Dyck prefix)."""
        return int(self.automaton.run(np.asarray(prefix, dtype=np.int64))[-1])

    def verifier(self, prefix: Sequence[int]) -> ProcessVerifier:
        """The perfect process verifier (Def 3.1.3) of the completions of ``prefix`` to a length-N Dyck string."""
        q = self.state_after(prefix)
        if q < 0:
            raise ConfigError("the prompt is not a prefix of a Dyck string")
        return ProcessVerifier(replace(self.automaton, start=q), length=self.N - len(prefix))

    def completions(self, prefix: Sequence[int]) -> torch.Tensor:
        """Every completion ``[C, N - |prefix|]`` making ``prefix`` a length-N string of Dyck_{k,D}."""
        ver = self.verifier(prefix)
        L = self.N - len(prefix)
        aut = ver.automaton
        frontier = [((), aut.start)]
        for i in range(L):
            nxt = []
            for s, q in frontier:
                for a in np.nonzero(aut.next_state[q] >= 0)[0]:
                    q2 = int(aut.next_state[q, a])
                    if bool(ver.from_states(torch.tensor([q2]), i + 1)[0]):
                        nxt.append((s + (int(a),), q2))
            frontier = nxt
        return torch.tensor([s for s, _ in frontier], dtype=torch.long).reshape(len(frontier), L)


@checked
@dataclass
class DyckDistribution:
    """The Dyck distribution D_Dyck of Definition 3.2.1 over Dyck_D, strings of length ``D`` over ``[ ] ( )``.

    With ``d(w_{1:i})`` the depth (open minus close brackets) after ``i`` tokens, equations (3.3)-(3.4) give

        P(w_{1:N})  proportional to  p^{#[ at depth 1} (1-p)^{#( at depth 1} (pq)^{#[ at depth > 1}
                                     ((1-p)q)^{#( at depth > 1} (1-q)^{#closes with d(w_{1:i}) < D - i},

    the depths read after the token. Remark 3.2.1 reads it as an autoregressive process, and this class draws
    from that process: at depth 0 open ``[`` / ``(`` with probability ``p`` / ``1 - p``; at depth ``D - i + 1``
    before position ``i`` (every remaining position must close) close the top bracket with probability 1;
    otherwise open ``[`` with ``pq``, ``(`` with ``(1-p) q`` and close the top bracket with ``1 - q``. Its
    conditionals sum to one, so the prefix law on Dyck_N (``N <= D``) is the product itself and "proportional
    to" is an equality. The close factor counts the *unforced* closes, ``d(w_{1:i}) < D - i``; the seed prints
    ``<=``, but every valid prefix has ``d(w_{1:i}) <= D - i``, so that condition would be vacuous and the law it
    defines (normalised on Dyck_D) differs from the autoregressive process of Remark 3.2.1
    (tests/test_dyck_thesis.py shows the difference).

    Args:
        D: length of a complete string (even, >= 2); the depth is at most ``D / 2``.
        p: the weight of ``[`` against ``(`` (the thesis trains with 0.2; its OOD prompts use 0.8).
        q: the weight of opening against closing when both are allowed (0.5 in the thesis).
    """

    D: int = 32
    p: float = 0.2
    q: float = 0.5

    def __post_init__(self) -> None:
        self.D = checks.integer("DyckDistribution: D", self.D, 2)
        if self.D % 2:
            raise ConfigError(f"DyckDistribution: D must be even (a length of balanced strings), got {self.D}")
        self.p = checks.real("DyckDistribution: p", self.p, 0.0, 1.0, open_min=True, open_max=True)
        self.q = checks.real("DyckDistribution: q", self.q, 0.0, 1.0, open_min=True, open_max=True)
        self.vocab = Vocab(["[", "]", "(", ")"])
        self.square = (self.vocab.id("["), self.vocab.id("]"))
        self.round = (self.vocab.id("("), self.vocab.id(")"))
        self.automaton: Automaton = dyck(2, self.D // 2, self.vocab)
        #: the perfect process verifier (Def 3.1.3) of Dyck_D, on right-padded prefixes ``[n, <= D]``
        self.verifier = ProcessVerifier(self.automaton, length=self.D)

    def with_p(self, p: float) -> DyckDistribution:
        """The same law with another ``p`` (the thesis' OOD prompts: ``with_p(0.8)``)."""
        return replace(self, p=p)

    # ------------------------------------------------------------------ the conditionals of Remark 3.2.1
    def _step(self, depth: torch.Tensor, top: torch.Tensor, i: int) -> torch.Tensor:
        """P(w_{i+1} = . | w_{1:i}) ``[n, V]`` from the depth and the top bracket (0 = ``[``, 1 = ``(``) after
        ``i`` tokens; all zeros where nothing is allowed (a dead prefix, or ``i = D``)."""
        n = depth.shape[0]
        V = len(self.vocab)
        out = torch.zeros(n, V, dtype=torch.float64, device=depth.device)
        remaining = self.D - i
        alive = (depth >= 0) & (depth <= remaining) & (remaining > 0)
        at0 = alive & (depth == 0)
        forced = alive & (depth > 0) & (depth == remaining)
        free = alive & (depth > 0) & (depth < remaining)
        (so, sc), (ro, rc) = self.square, self.round
        p, q = self.p, self.q
        f = at0.double()  # float64 weights (a Python scalar in torch.where would round to float32)
        out[:, so] = f * p + free.double() * (p * q)
        out[:, ro] = f * (1 - p) + free.double() * ((1 - p) * q)
        close_p = forced.double() + free.double() * (1 - q)
        out[:, sc] = close_p * (top == 0)
        out[:, rc] = close_p * (top == 1)
        return out

    def _advance(self, tok: torch.Tensor, depth: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
        """Read ``tok [n]`` into (``depth``, ``stack``) in place; a token that breaks Dyck sets depth to -1."""
        (so, sc), (ro, rc) = self.square, self.round
        rows = torch.arange(tok.shape[0], device=tok.device)
        alive = depth >= 0
        is_open = (tok == so) | (tok == ro)
        kind = torch.where((tok == so) | (tok == sc), 0, torch.where((tok == ro) | (tok == rc), 1, -1))
        top = stack[rows, (depth - 1).clamp(min=0)]
        ok_close = ~is_open & (kind >= 0) & (depth > 0) & (top == kind)
        ok_open = is_open & (depth < stack.shape[1])
        stack[rows[alive & ok_open], depth[alive & ok_open]] = kind[alive & ok_open]
        new = torch.where(ok_open, depth + 1, torch.where(ok_close, depth - 1, torch.full_like(depth, -1)))
        depth.copy_(torch.where(alive, new, depth))
        return depth

    def _top(self, depth: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(depth.shape[0], device=depth.device)
        return torch.where(depth > 0, stack[rows, (depth - 1).clamp(min=0)], torch.full_like(depth, -1))

    def _check_strings(self, strings: torch.Tensor) -> torch.Tensor:
        strings = torch.as_tensor(strings)
        if strings.ndim != 2 or strings.dtype not in (torch.int64, torch.int32) or strings.shape[1] > self.D:
            raise MalformedSequenceError(f"DyckDistribution: strings must be integer token ids [n, N] with N <= "
                                         f"D = {self.D}, got shape {tuple(strings.shape)} and dtype {strings.dtype}")
        return strings.long()

    def next_token_probs(self, strings: torch.Tensor) -> torch.Tensor:
        """P(w_{i+1} = . | w_{1:i}) for i = 0..N: ``[n, N + 1, V]`` (float64) for strings ``[n, N]``; a row is
        all zeros after a prefix outside Dyck_i and at ``i = D``."""
        strings = self._check_strings(strings)
        n, N = strings.shape
        depth = torch.zeros(n, dtype=torch.long, device=strings.device)
        stack = torch.zeros(n, self.D // 2 + 1, dtype=torch.long, device=strings.device)
        steps = []
        for i in range(N + 1):  # a loop over positions, batched over rows
            steps.append(self._step(depth, self._top(depth, stack), i))
            if i < N:
                self._advance(strings[:, i], depth, stack)
        return torch.stack(steps, 1)

    @per_token
    def log_prob(self, strings: torch.Tensor) -> torch.Tensor:
        """log P(w_{1:N}) ``[n]`` under Definition 3.2.1 (float64; ``-inf`` outside the prefix set Dyck_N)."""
        strings = self._check_strings(strings)
        probs = self.next_token_probs(strings)[:, :-1]  # [n, N, V]
        tok = probs.gather(2, strings[:, :, None])[..., 0]
        return tok.log().sum(-1)

    @per_token
    def sample(self, n: int, length: int | None = None, seed: int | torch.Generator = 0) -> torch.Tensor:
        """``n`` strings ``[n, length]`` (default ``D``) drawn from the prefix law on Dyck_length by the
        autoregressive process of Remark 3.2.1; ``seed`` is an int or a ``torch.Generator``."""
        n = checks.integer("DyckDistribution.sample: n", n)
        L = self.D if length is None else checks.integer("DyckDistribution.sample: length", length, 0)
        if L > self.D:
            raise ConfigError(f"DyckDistribution.sample: length must be at most D = {self.D}, got {L}")
        g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(int(seed))
        out = torch.zeros(n, L, dtype=torch.long)
        depth = torch.zeros(n, dtype=torch.long)
        stack = torch.zeros(n, self.D // 2 + 1, dtype=torch.long)
        for i in range(L):  # a loop over positions, batched over rows
            probs = self._step(depth, self._top(depth, stack), i)
            tok = torch.multinomial(probs, 1, generator=g)[:, 0]
            out[:, i] = tok
            self._advance(tok, depth, stack)
        return out

    def is_valid(self, strings: torch.Tensor) -> torch.Tensor:
        """Whether each right-padded row ``[n, <= D]`` is a prefix of a string of Dyck_D (its length-``D``
        rows: members of Dyck_D), by the exact process verifier."""
        return self.verifier(self._check_strings(strings))
