"""The "cups and ball" HMM of App. E.1: composing permutations of A_5 (Theorem 2.1, (E.1)).

The data
--------
Two permutations of the alternating group A_5 act on the five cups ``{1, ..., 5}``:
``sigma_0 = (1 2)(3 4)`` and ``sigma_1 = (1 3 5)`` (cycle notation); ``sigma_2`` is the identity.
They generate all of A_5 (order 60), a non-solvable group, so the composition function

    F(i_1, ..., i_t) = sigma_{i_t} o ... o sigma_{i_1}(1)                         (E.1)

(where the ball is after the swaps ``i_1 .. i_t``, starting under cup 1) is NC^1-complete to
compute (Lemma E.1): no bounded-depth Transformer predicts it (Theorem 2.1), while a bigram
latent model over (observation, hidden state) pairs does exactly (Theorem 2.3).

The HMM (Def 2.2) that embeds (E.1) has hidden states ``(v, w)`` in ``{1..5} x {0, 1, 2}``:
``v`` is the ball's cup and ``w`` says what the step shows. From ``(v, w)`` it moves to
``(sigma_w(v), w')``, with ``w' = 0, 1, 2`` drawn with probabilities
``((1 - r)/2, (1 - r)/2, r)``; the first state is ``(1, w')`` with the same law. Emissions are
deterministic: ``w in {0, 1}`` shows the permutation symbol ``s<w>`` (that swap is then applied
to the ball), ``w = 2`` reveals the cup ``v``. ``r = reveal_prob`` is the knob for how often
the ball is revealed; the paper's HMM is ``r = 1/2`` (probabilities 1/4, 1/4, 1/2).

Observations are indices into ``OBSERVABLE_TOKENS = ("1", "2", "3", "4", "5", "s0", "s1")``:
index ``v - 1`` reveals cup ``v``, index 5 is ``s0`` and index 6 is ``s1``. So a sequence reads
like ``s1 s0 3 s1 5 s0 ...``, and every revealed cup equals F of the swaps shown before it.

Given the observations the hidden path is determined (``w_t`` is read off ``x_t`` and ``v_t`` is
F of the earlier swaps), so ``-log P(x) = sum_t -log P(w_t)`` and the entropy rate is exactly
the entropy of the ``w`` law, ``H(r) = -(1 - r) log((1 - r)/2) - r log r`` nats per token;
:attr:`A5Task.entropy_rate` gives it and the forward algorithm (3.1) reproduces it per sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ppl_thought import checks
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.models.hmm import HMM, EntropyEstimate
from ppl_thought.models.hmm_lifting import slow_thinking_parts
from ppl_thought.validation import ArrayLike, checked, per_token
from ppl_thought.vocab import Vocab

#: Permutations of {1..5} as tuples ``p`` with ``p[v - 1] = sigma(v)``.
SIGMA_0: tuple[int, ...] = (2, 1, 4, 3, 5)  # (1 2)(3 4)
SIGMA_1: tuple[int, ...] = (3, 2, 5, 4, 1)  # (1 3 5)
SIGMA_2: tuple[int, ...] = (1, 2, 3, 4, 5)  # identity
SIGMAS: tuple[tuple[int, ...], ...] = (SIGMA_0, SIGMA_1, SIGMA_2)

OBSERVABLE_TOKENS: tuple[str, ...] = ("1", "2", "3", "4", "5", "s0", "s1")
HIDDEN_NAMES: tuple[str, ...] = tuple(f"v{v}w{w}" for v in range(1, 6) for w in range(3))
SWAP_INDEX: tuple[int, int] = (5, 6)  # observation indices of s0, s1


def compose(*perms: Sequence[int]) -> tuple[int, ...]:
    """``compose(p, q) = p o q`` (apply q first) for permutations of {1..n} in one-line form."""
    n = len(perms[0])
    out = tuple(range(1, n + 1))
    for p in reversed(perms):
        out = tuple(p[v - 1] for v in out)
    return out


def hidden_index(v: int, w: int) -> int:
    """Index of the hidden state ``(v, w)`` in ``HIDDEN_NAMES`` (v in 1..5, w in 0..2)."""
    if not (1 <= v <= 5 and 0 <= w <= 2):
        raise ConfigError(f"hidden state (v, w) = ({v}, {w}) outside {{1..5}} x {{0, 1, 2}}")
    return (v - 1) * 3 + w


def hidden_state(index: int) -> tuple[int, int]:
    """The pair ``(v, w)`` of a hidden-state index."""
    if not 0 <= index < 15:
        raise ConfigError(f"hidden-state index {index} outside [0, 15)")
    return index // 3 + 1, index % 3


def _w_law(reveal_prob: float) -> tuple[float, float, float]:
    r = reveal_prob
    return ((1 - r) / 2, (1 - r) / 2, r)


def _build_hmm(reveal_prob: float) -> HMM:
    pw = torch.tensor(_w_law(reveal_prob), dtype=torch.float64)
    A = torch.zeros(15, 15, dtype=torch.float64)
    B = torch.zeros(15, 7, dtype=torch.float64)
    for v in range(1, 6):
        for w in range(3):
            i = hidden_index(v, w)
            nv = SIGMAS[w][v - 1]
            for w2 in range(3):
                A[i, hidden_index(nv, w2)] = pw[w2]
            B[i, SWAP_INDEX[w] if w < 2 else v - 1] = 1.0
    lam = torch.zeros(15, dtype=torch.float64)
    for w in range(3):
        lam[hidden_index(1, w)] = pw[w]
    return HMM(A, B, lam, observable_tokens=OBSERVABLE_TOKENS, hidden_names=HIDDEN_NAMES)


@checked
@dataclass(frozen=True)
class A5Task:
    """The App. E.1 HMM with its exact answers; build it with :func:`a5_hmm`.

    Attributes:
        reveal_prob: r, the probability that a step reveals the ball's cup.
        hmm: the :class:`~ppl_thought.models.hmm.HMM` (15 hidden states, 7 observations).
        vocab: the observable vocabulary ``Vocab(OBSERVABLE_TOKENS)``; observation index i is
            vocabulary id ``i + vocab.num_specials`` (:meth:`to_vocab_ids`).
    """

    reveal_prob: float
    hmm: HMM = field(repr=False)
    vocab: Vocab = field(repr=False)
    observable_tokens: tuple[str, ...] = OBSERVABLE_TOKENS
    hidden_names: tuple[str, ...] = HIDDEN_NAMES

    # ------------------------------------------------------------------ the composition (E.1)
    @staticmethod
    def F(bits: Sequence[int]) -> int:
        """``F(i_1, ..., i_t) = sigma_{i_t} o ... o sigma_{i_1}(1)`` (E.1): where the ball ends up."""
        v = 1
        for b in bits:
            b = int(b)
            if b not in (0, 1):
                raise ConfigError(f"F takes bits in {{0, 1}}, got {b}")
            v = SIGMAS[b][v - 1]
        return v

    def swaps(self, x: ArrayLike) -> list[int]:
        """The bits ``i_1 i_2 ...`` of the swap symbols ``s0``/``s1`` in one observation sequence."""
        xa = self._indices(x)
        if xa.ndim != 1:
            raise MalformedSequenceError(f"swaps takes one sequence [T], got shape {tuple(xa.shape)}")
        return [int(a) - SWAP_INDEX[0] for a in xa.tolist() if a in SWAP_INDEX]

    def ball_position(self, x: ArrayLike) -> torch.Tensor:
        """``v_t = F(swaps among x_{<t})`` for every t: the cup a reveal at step t must show.

        ``[T]`` or ``[N, T]`` LongTensor with values 1..5 (vectorised over sequences).
        """
        xa = self._indices(x)
        single = xa.ndim == 1
        xb = xa[None] if single else xa
        table = torch.tensor(SIGMAS, dtype=torch.long)  # [3, 5]: table[w, v-1] = sigma_w(v)
        w = torch.full_like(xb, 2)
        w[xb == SWAP_INDEX[0]] = 0
        w[xb == SWAP_INDEX[1]] = 1
        v = torch.ones(xb.shape[0], dtype=torch.long)
        out = torch.empty_like(xb)
        for t in range(xb.shape[1]):
            out[:, t] = v
            v = table[w[:, t], v - 1]
        return out[0] if single else out

    # ------------------------------------------------------------------ data
    @per_token
    def sample(
        self,
        num_sequences: int,
        length: int,
        generator: torch.Generator | None = None,
        return_hidden: bool = False,
    ):
        """Observation index sequences ``[num_sequences, length]`` (and the hidden indices if asked)."""
        z, x = self.hmm.sample(num_sequences, length, generator=generator)
        return (z, x) if return_hidden else x

    def to_vocab_ids(self, x: ArrayLike) -> torch.Tensor:
        """Observation indices -> ids of :attr:`vocab` (for an LM over the observable tokens)."""
        return self._indices(x) + self.vocab.num_specials

    def from_vocab_ids(self, ids: ArrayLike) -> torch.Tensor:
        """Ids of :attr:`vocab` -> observation indices."""
        t = torch.as_tensor(ids).long() - self.vocab.num_specials
        if t.numel() and (t.min() < 0 or t.max() >= len(self.observable_tokens)):
            raise MalformedSequenceError("ids contain tokens that are not A5 observations (specials?)")
        return t

    def decode(self, x: ArrayLike) -> str:
        """One observation sequence as text, e.g. ``"s1 s0 3 s1 5"``."""
        return " ".join(self.observable_tokens[int(a)] for a in self._indices(x).reshape(-1).tolist())

    def encode(self, text: str) -> torch.Tensor:
        """Text like ``"s1 s0 3"`` -> observation indices."""
        return self.from_vocab_ids(torch.tensor(self.vocab.encode(text), dtype=torch.long))

    def _indices(self, x) -> torch.Tensor:
        t = torch.as_tensor(x).detach().to("cpu", torch.long)
        if t.numel() and (t.min() < 0 or t.max() >= len(self.observable_tokens)):
            raise MalformedSequenceError(f"A5 observations are indices in [0, {len(self.observable_tokens)})")
        return t

    # ------------------------------------------------------------------ exact answers
    def log_prob_by_tracking(self, x: ArrayLike) -> torch.Tensor:
        """``log P(x)`` by tracking the ball step by step (the chain computation of Section 2.5).

        Each step contributes ``log P(w_t)``; a reveal that disagrees with F of the swaps so far
        makes x impossible (``-inf``). An independent check of the forward algorithm.
        """
        xa = self._indices(x)
        single = xa.ndim == 1
        xb = xa[None] if single else xa
        logw = torch.tensor([math.log(p) if p > 0 else -math.inf for p in _w_law(self.reveal_prob)],
                            dtype=torch.float64)
        w = torch.full_like(xb, 2)
        w[xb == SWAP_INDEX[0]] = 0
        w[xb == SWAP_INDEX[1]] = 1
        lp = logw[w].sum(-1)
        wrong = ((w == 2) & (xb + 1 != self.ball_position(xb))).any(-1)
        lp = torch.where(wrong, torch.full_like(lp, -math.inf), lp)
        return lp[0] if single else lp

    def exact_cross_entropy(self, x: ArrayLike) -> float:
        """Exact per-token cross-entropy (nats) of held-out sequences by the forward algorithm (3.1)."""
        return self.hmm.cross_entropy(self._indices(x))

    @property
    def entropy_rate(self) -> float:
        """The exact entropy rate (nats per token): the entropy of the step law ((1-r)/2, (1-r)/2, r)."""
        return -sum(p * math.log(p) for p in _w_law(self.reveal_prob) if p > 0)

    def entropy_rate_estimate(
        self, length: int = 128, num_sequences: int = 256, generator: torch.Generator | None = None
    ) -> EntropyEstimate:
        """Monte-Carlo estimate of the entropy rate from sampled sequences (forward algorithm)."""
        return self.hmm.entropy_rate_estimate(length, num_sequences, generator=generator)

    def as_slow_thinking_parts(self, sep: str = "|"):
        """``(Product projection, Tabular prior)`` with ``Proj # P = P_{A,B,lam}`` exactly (Theorem 2.3)."""
        return slow_thinking_parts(self.hmm, sep=sep)


@checked
def a5_hmm(reveal_prob: float = 0.5) -> A5Task:
    """The "cups and ball" HMM of App. E.1 (proof of Theorem 2.1), built on (E.1).

    ``reveal_prob`` r in [0, 1] is the probability that a step reveals the ball's cup instead of
    showing (and applying) a swap; each swap ``s0``, ``s1`` has probability (1 - r)/2. The paper
    uses r = 1/2. See the module docstring for the data format.
    """
    r = checks.fraction("reveal_prob", reveal_prob)  # a ConfigError for NaN, +-inf, a bool or outside [0, 1]
    return A5Task(reveal_prob=r, hmm=_build_hmm(r), vocab=Vocab(OBSERVABLE_TOKENS))
