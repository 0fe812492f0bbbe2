"""CNF formulas tabulated over all 2^m assignments: exact counts of satisfying completions of every prefix
(the self-reducible relation of cot-or-loop.txt, Definition 5.1 / C.4; Proposition 5.12's next-token law (8) is a
ratio of these counts). The weak chain-of-thought that samples from them is :mod:`ppl_thought.data.self_reducible`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ppl_thought.errors import (
    ConfigError,
    MalformedSequenceError,
    TooLargeToEnumerateError,
    UnsatisfiableConstraintError,
)
from ppl_thought.validation import checked

__all__ = ["CNF", "MAX_VARIABLES", "assignment_bits", "random_cnf"]


#: Largest number of variables :class:`CNF` tabulates (``2^20`` assignments).
MAX_VARIABLES = 20


def assignment_bits(m: int, device: torch.device | None = None) -> torch.Tensor:
    """Every assignment of m Boolean variables, ``[2^m, m]`` (row k is k in binary, most significant bit first)."""
    """All ``2^m`` assignments as a ``[2^m, m]`` bool table; row ``a`` has ``y_1`` as its most significant bit."""
    a = torch.arange(2**m, device=device)
    shifts = torch.arange(m - 1, -1, -1, device=device)
    return ((a.unsqueeze(-1) >> shifts) & 1).bool()


@checked
class CNF:
    """A CNF formula over ``m`` Boolean variables with exact counts of satisfying completions.

    ``clauses`` are sequences of nonzero DIMACS literals: ``+v`` is ``y_v = 1`` and ``-v`` is
    ``y_v = 0`` for ``v`` in ``1..m``. The formula is evaluated once on all ``2^m`` assignments (a loop
    over clauses, vectorised over assignments) and the counts of every prefix at every depth are
    kept, so :meth:`count` and :meth:`relative_counts` are table look-ups (Definition C.4 with
    ``sigma = 1``; Proposition 5.12, equation (8)).
    """

    def __init__(self, clauses: Sequence[Sequence[int]], m: int, device: torch.device | str | None = None) -> None:
        if isinstance(m, bool) or m < 1:
            raise ConfigError(f"CNF needs a positive integer number of variables m, got {m!r}")
        if m > MAX_VARIABLES:
            raise TooLargeToEnumerateError(
                f"CNF tabulates all 2^m assignments; m = {m} exceeds the limit m <= {MAX_VARIABLES}")
        self.m = m
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.clauses: tuple[tuple[int, ...], ...] = tuple(self._check_clause(c, m) for c in clauses)
        bits = assignment_bits(m, self.device)
        sat = torch.ones(2**m, dtype=torch.bool, device=self.device)
        for clause in self.clauses:
            var = torch.tensor([abs(lit) - 1 for lit in clause], device=self.device)
            sign = torch.tensor([lit > 0 for lit in clause], device=self.device)
            sat &= (bits[:, var] == sign).any(-1)
        self.satisfied = sat
        #: ``counts[i][j]``: satisfying completions of the length-i prefix whose bits read j (MSB first).
        self.counts: list[torch.Tensor] = [
            sat.view(2**i, 2 ** (m - i)).sum(-1) for i in range(m + 1)
        ]

    @staticmethod
    def _check_clause(clause: Sequence[int], m: int) -> tuple[int, ...]:
        lits = tuple(clause)
        if not lits:
            raise ConfigError("a CNF clause must have at least one literal (an empty clause is always false)")
        for lit in lits:
            if isinstance(lit, bool) or not isinstance(lit, int) or lit == 0 or abs(lit) > m:
                raise ConfigError(f"clause {lits}: literal {lit!r} is not a nonzero integer in [-{m}, {m}]")
        return lits

    def __repr__(self) -> str:
        return f"CNF(m={self.m}, clauses={len(self.clauses)}, solutions={self.num_solutions})"

    @property
    def num_solutions(self) -> int:
        """``|R(x)|``, the number of satisfying assignments."""
        return int(self.counts[0][0])

    def solutions(self) -> torch.Tensor:
        """The satisfying assignments as a ``[|R(x)|, m]`` 0/1 int64 tensor, in lexicographic order."""
        return assignment_bits(self.m, self.device)[self.satisfied].long()

    def prefix_index(self, prefixes: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Row index (bits read MSB first) of each prefix in a ``[..., i]`` 0/1 array; ``[...]`` int64."""
        y = torch.as_tensor(prefixes, device=self.device)
        if y.dtype == torch.bool:
            y = y.long()
        if y.dim() == 0:
            raise MalformedSequenceError("a prefix must be an array of shape [..., i], got a scalar")
        if y.is_floating_point() or y.is_complex():
            raise MalformedSequenceError(f"prefixes must be 0/1 integers, got dtype {y.dtype}")
        i = y.shape[-1]
        if i > self.m:
            raise MalformedSequenceError(f"prefix length {i} exceeds the number of variables m = {self.m}")
        if y.numel() and not ((y == 0) | (y == 1)).all():
            raise MalformedSequenceError("prefix values must be 0 or 1")
        weights = 2 ** torch.arange(i - 1, -1, -1, device=self.device)
        return (y.long() * weights).sum(-1)

    def count(self, prefixes: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Exact number of satisfying completions of each prefix ``y_<i`` (``[..., i]`` -> ``[...]`` int64)."""
        y = torch.as_tensor(prefixes, device=self.device)
        idx = self.prefix_index(y)
        return self.counts[y.shape[-1]][idx]

    def relative_counts(self, prefixes: torch.Tensor | Sequence[int], dead: str = "raise") -> torch.Tensor:
        """``p(y_i | y_<i)`` of the uniform law over ``R(x)`` by relative counting (Proposition 5.12, (8)).

        ``prefixes`` is ``[..., i]`` with ``i < m``; the result is ``[..., 2]`` (float64, entries for
        ``y_i = 0, 1``). A *dead* prefix (no satisfying completion) has no conditional law: ``dead="raise"``
        raises :class:`UnsatisfiableConstraintError`, ``dead="uniform"`` returns ``(1/2, 1/2)`` there.
        """
        y = torch.as_tensor(prefixes, device=self.device)
        if y.dim() >= 1 and y.shape[-1] >= self.m:
            raise MalformedSequenceError(
                f"relative_counts needs a prefix shorter than m = {self.m} (there is no next variable), "
                f"got length {y.shape[-1]}")
        idx = self.prefix_index(y)
        if dead == "raise":
            total = self.counts[y.shape[-1]][idx]
            if (total == 0).any():
                bad = y.reshape(-1, y.shape[-1])[(total == 0).reshape(-1)][0].tolist()
                raise UnsatisfiableConstraintError(
                    f"prefix {bad} has no satisfying completion: p(. | y_<i) is undefined")
        return self.level_table(y.shape[-1], dead="uniform")[idx]

    def level_table(self, i: int, dead: str = "uniform") -> torch.Tensor:
        """``p(. | y_<i)`` for all ``2^i`` prefixes of length ``i`` at once: ``[2^i, 2]`` float64 (equation (8))."""
        if not 0 <= i < self.m:
            raise ConfigError(f"prefix length must be in [0, {self.m}), got {i}")
        if dead not in ("raise", "uniform"):
            raise ConfigError(f"dead must be 'raise' or 'uniform', got {dead!r}")
        child = self.counts[i + 1].view(2**i, 2).to(torch.float64)
        total = self.counts[i].to(torch.float64).unsqueeze(-1)
        if dead == "raise" and (total == 0).any():
            raise UnsatisfiableConstraintError(f"some prefixes of length {i} have no satisfying completion")
        return torch.where(total > 0, child / total.clamp_min(1), torch.full_like(child, 0.5))

    def log_uniform(self) -> torch.Tensor:
        """``log p(y)`` of the uniform law over ``R(x)`` for all ``2^m`` assignments (``-inf`` outside)."""
        n = self.num_solutions
        if n == 0:
            raise UnsatisfiableConstraintError("the formula has no satisfying assignment: the uniform law is undefined")
        out = torch.full((2**self.m,), -math.inf, dtype=torch.float64, device=self.device)
        out[self.satisfied] = -math.log(n)
        return out


@checked
def random_cnf(m: int, k: int, num_clauses: int, seed: int = 0, max_tries: int = 1000,
               device: torch.device | str | None = None) -> CNF:
    """A satisfiable random k-CNF: ``num_clauses`` clauses, each over ``k`` distinct variables with random signs.

    Instances are drawn with ``torch.Generator().manual_seed(seed)`` until one has a solution
    (at most ``max_tries``; then :class:`UnsatisfiableConstraintError`).
    """
    for name, v in (("m", m), ("k", k), ("max_tries", max_tries)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"random_cnf needs a positive integer {name}, got {v!r}")
    if isinstance(num_clauses, bool) or num_clauses < 0:
        raise ConfigError(f"random_cnf needs a non-negative integer num_clauses, got {num_clauses!r}")
    if k > m:
        raise ConfigError(f"clause width k = {k} exceeds the number of variables m = {m}")
    if m > MAX_VARIABLES:
        raise TooLargeToEnumerateError(f"m = {m} exceeds the limit m <= {MAX_VARIABLES}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_tries):
        var = torch.rand(num_clauses, m, generator=gen).argsort(-1)[:, :k] + 1
        sign = torch.randint(0, 2, (num_clauses, k), generator=gen) * 2 - 1
        cnf = CNF((var * sign).tolist(), m, device=device)
        if cnf.num_solutions > 0:
            return cnf
    raise UnsatisfiableConstraintError(
        f"no satisfiable {k}-CNF with m = {m} and {num_clauses} clauses in {max_tries} draws (seed {seed}); "
        "use fewer clauses")
