"""A query/response task with a hidden choice: a natural instance of Example 5.1 for Section 7.

The data
--------
A query is ``q = (q_1, ..., q_k)``, k symbols drawn uniformly from an alphabet of m letters.
A hidden choice ``c`` (the "method", like the Archimedes method of Example 5.1) is drawn uniformly
from ``{0, ..., C - 1}``, independently of q. The response applies the method -- the c-th of C
fixed substitutions sigma_c of the alphabet, letter by letter -- and ends by naming it with the
token ``M<c>``:

    r = (sigma_c(q_1), ..., sigma_c(q_k), M<c>),    c ~ Uniform{0..C-1}             (demo.md, (D.1))

so that

    p(r | q) = #{c : r = (sigma_c(q), M<c>)} / C   (= 1/C or 0)                     (D.2)

is known exactly (:meth:`PermutationChoiceTask.exact_log_prob`). The query does not determine c,
so a thought that names the method (the bridging thought of Example 5.1) has a broad posterior
given the query alone (uniform over C methods) and a sharp one given query and response (the one
method named at its end). Fast thinking must track, token by token, the set of methods consistent
with the response prefix (a letter pair (q_j, r_j) rules out the substitutions that disagree);
with the thought, each response token is a table lookup ``sigma_y(q_j)`` and the final name a copy.
The exact conditional entropy ``H(R | Q) = log C`` (the floor of any model's test loss) is also
computed by enumerating all m^k queries (:meth:`conditional_entropy`).

In the library's format (Section 5.1, :class:`~ppl_thought.projections.QueryResponse`) the
observation is ``q <eos> r <eos>`` and the latent sequence ``q <eos> <s> y </s> r <eos>``; a
thought y is ordinary tokens (the demo restricts them to method names, ``Sec7Config.thought_alphabet``):
nothing tells the sampler which name to write, it has to discover that from the reward (7.2).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.validation import ArrayLike, checked, per_token
from ppl_thought.vocab import Vocab

LETTERS = "abcdefghijklmnopqrstuvwxyz"


@checked
@dataclass(frozen=True)
class PermutationChoiceTask:
    """The task (D.1): response = query permuted by one of C hidden methods, then the method's name.
    Build with :func:`permutation_choice_task`.

    Token indices: ``0..m-1`` are the letters, ``m..m+C-1`` the method names ``M0..M{C-1}``;
    index i is vocabulary id ``i + vocab.num_specials`` (:meth:`letter_ids`).

    Attributes:
        alphabet: the m letters of queries and responses.
        query_len: k (responses have k + 1 tokens: k letters and a method name).
        perms: ``[C, m]`` int64, ``perms[c, a] = sigma_c(a)``: distinct substitutions of the letters.
        vocab: ``Vocab(alphabet + method names)``.
    """

    alphabet: tuple[str, ...]
    query_len: int
    perms: np.ndarray = field(repr=False)
    vocab: Vocab = field(repr=False)
    methods: tuple[str, ...] = ()

    @property
    def num_choices(self) -> int:
        """C, the number of hidden choices."""
        return int(self.perms.shape[0])

    @property
    def m(self) -> int:
        return len(self.alphabet)

    # ------------------------------------------------------------------ data
    @per_token
    def sample(self, num: int, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, c, r)``: queries ``[num, k]``, choices ``[num]``, responses ``[num, k + 1]`` (token indices)."""
        if num < 0:
            raise ConfigError(f"num must be >= 0, got {num}")
        q = torch.randint(self.m, (num, self.query_len), generator=generator)
        c = torch.randint(self.num_choices, (num,), generator=generator)
        perms = torch.as_tensor(self.perms)
        r = torch.cat([torch.gather(perms[c], 1, q), (self.m + c)[:, None]], 1)
        return q, c, r

    def letter_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Token indices (letters, then method names) -> vocabulary ids."""
        return torch.as_tensor(idx).long() + self.vocab.num_specials

    # ------------------------------------------------------------------ exact answers
    def _check(self, q: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, r = torch.as_tensor(q).long(), torch.as_tensor(r).long()
        k = self.query_len
        if q.shape[-1] != k or r.shape[-1] != k + 1 or q.shape[:-1] != r.shape[:-1]:
            raise MalformedSequenceError(
                f"queries must have shape [..., {k}] and responses [..., {k + 1}] (k letters and a method "
                f"name), got {tuple(q.shape)} and {tuple(r.shape)}")
        if q.numel() and (q.min() < 0 or q.max() >= self.m):
            raise MalformedSequenceError(f"query letters must be indices in [0, {self.m})")
        if r.numel() and (r.min() < 0 or r.max() >= self.m + self.num_choices):
            raise MalformedSequenceError(f"response tokens must be indices in [0, {self.m + self.num_choices})")
        return q, r

    def _fits(self, q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``[..., C]`` bool: does method c produce r from q (D.1)?"""
        applied = torch.as_tensor(self.perms).T[q]  # [..., k, C]: sigma_c(q_j)
        body = (applied.transpose(-1, -2) == r[..., None, :-1]).all(-1)
        return body & (r[..., -1:] == self.m + torch.arange(self.num_choices))

    def exact_log_prob(self, q: ArrayLike, r: ArrayLike) -> torch.Tensor:
        """log p(r | q) of (D.2), float64, shape ``q.shape[:-1]``; ``-inf`` (never NaN) when no choice fits."""
        q, r = self._check(q, r)
        count = self._fits(q, r).sum(-1).double()
        return torch.log(count) - math.log(self.num_choices)

    def posterior_choices(self, q: ArrayLike, r: ArrayLike) -> torch.Tensor:
        """p(c | q, r) ``[..., C]``: uniform over the methods that produce r from q (the sharp posterior)."""
        q, r = self._check(q, r)
        fits = self._fits(q, r).double()
        tot = fits.sum(-1, keepdim=True)
        return torch.where(tot > 0, fits / tot.clamp_min(1), torch.zeros_like(fits))

    def conditional_entropy(self) -> float:
        """H(R | Q) in nats per example, exactly, by enumerating all m^k queries (D.2)."""
        qs = torch.tensor(list(itertools.product(range(self.m), repeat=self.query_len)), dtype=torch.long)
        perms = torch.as_tensor(self.perms)
        names = (self.m + torch.arange(self.num_choices)).expand(qs.shape[0], -1)[..., None]
        resp = torch.cat([perms.T[qs].transpose(-1, -2), names], -1)  # [N, C, k + 1]: the response of each choice
        # p(r_c | q) = (number of choices giving the same response) / C
        same = (resp.unsqueeze(1) == resp.unsqueeze(2)).all(-1).sum(-1).double()  # [N, C]
        return float(-(torch.log(same / self.num_choices)).mean(-1).mean())

    def entropy_floor_per_token(self) -> float:
        """H(R | Q) / (k + 2): the floor of the test loss per response token (k letters, name, ``<eos>``)."""
        return self.conditional_entropy() / (self.query_len + 2)


@checked
def permutation_choice_task(m: int = 4, query_len: int = 2, num_choices: int = 4,
                            seed: int = 0) -> PermutationChoiceTask:
    """The task (D.1) with m letters, queries of length k = ``query_len`` and C = ``num_choices``
    methods: distinct random substitutions of the letters (fixed by ``seed``; the first is the
    identity) named ``M0 .. M{C-1}``.
    """
    if not 2 <= m <= len(LETTERS):
        raise ConfigError(f"m must lie in [2, {len(LETTERS)}], got {m}")
    if query_len < 1:
        raise ConfigError(f"query_len must be >= 1, got {query_len}")
    if not 1 <= num_choices <= math.factorial(m):
        raise ConfigError(f"num_choices must lie in [1, {m}!], got {num_choices}")
    rng = np.random.default_rng(seed)
    perms = [tuple(range(m))]
    while len(perms) < num_choices:
        p = tuple(int(i) for i in rng.permutation(m))
        if p not in perms:
            perms.append(p)
    alphabet = tuple(LETTERS[:m])
    methods = tuple(f"M{i}" for i in range(num_choices))
    return PermutationChoiceTask(alphabet=alphabet, query_len=query_len, perms=np.array(perms, dtype=np.int64),
                                 vocab=Vocab(list(alphabet) + list(methods)), methods=methods)
