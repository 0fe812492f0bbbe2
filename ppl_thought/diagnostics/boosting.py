"""Boosting an LM by a next-k-token distinguisher (next-token-long-range.txt, Lemmas 1-2, (1.3)-(1.5),
Theorem 3 of App. A, Algorithm 1).

Conventions (0-indexed; the paper counts from 1). Documents are strings x in Sigma^n over the alphabet
Sigma = {0, .., V-1}. A *next-token model* is a callable ``model(tokens [B, t], start=0) -> [B, t + 1 - start, V]``
giving ``log q(. | tokens[:, :j])`` for j = start..t (Def 1; t < n). A *next-k-token distinguisher* (Def 2) is
``d(s, tokens [B, s + k]) -> [B]`` in {0, 1}: it reads the prefix x_{<s} and the window x_{s..s+k-1}, for a
window start s in {0, .., n - k} (N = n - k + 1 starts). Its advantage (1.2) is

    a_{p,q}(d) = (1/N) sum_s E_{x_{<s} ~ p} [ E_{y ~ p^k(.|x_{<s})} d(s, x_{<s} y)
                                             - E_{y ~ q^k(.|x_{<s})} d(s, x_{<s} y) ]

with p the data and q the model; the sign is p minus q, so that reweighting q by exp(+eps d) helps when a > 0
(:func:`~ppl_thought.diagnostics.distinguish.k_token_advantage` reports model minus held-out, the opposite sign).

Theorem 3 (App. A): |a| <= sqrt(min(k, N) KL(p || q) / (2 N)): each window start is a TV distance, Pinsker and
Jensen, and each token position lies in at most min(k, N) windows (:func:`kl_advantage_bound`).

Lemma 1 (the statement's symbols are lost in the seed's text; this is its proof in Section 2.4.1, re-derived).
Group the starts by offset, I_m = {s : s = m mod k}, n_m = |I_m|, a_m the mean per-start advantage over I_m;
alpha is the n_m-weighted mean of the a_m, so some m has a_m >= alpha. The windows of I_m are disjoint blocks;
the boosted text law (1.3) reweights each block's conditional law by exp(eps d):

    q'(x) = q(x) prod_{s in I_m} exp(eps d(s, x_{<s+k})) / Z_s(x_{<s}),   Z_s(u) = E_{y ~ q^k(.|u)} exp(eps d(s, u y)).

Exactly, KL(p||q) - KL(p||q') = sum_{s in I_m} E_p[eps d - log Z_s] (:func:`boosted_log_ratio`), and with
log Z <= Z - 1, e^eps <= 1 + eps + eps^2 (eps <= 1) this is >= n_m (eps a_m - eps^2) >= n_m alpha^2 / 4 at
eps = alpha / 2; n_m >= N / (2k) (n_m >= 1 if N < 2k, n_m >= floor(N / k) >= N / (2k) otherwise) gives

    KL(p || q') <= KL(p || q) - alpha^2 N / (8 k)                              (:func:`lemma1_kl_decrease`).

Lemma 2 / (1.4)-(1.5): the same law token by token. For t inside the block [s, s + k) of a start s in I_m,

    q'(x_t | x_{<t}) = sum_{y: y_1 = x_t} q(y | x_{<t}) e^{eps d(s, x_{<t} y)}
                       / sum_y q(y | x_{<t}) e^{eps d(s, x_{<t} y)},

y ranging over Sigma^{s+k-t} (the rest of the block); outside the blocks q' = q (:class:`Boosted`). So the
per-token log loss (1.1) falls by at least alpha^2 N / (8 k n).

Algorithm 1 (the self-boosting size schedule of Section 3 and Lemma 4): :func:`self_boosting_schedule`.
Everything here enumerates Sigma^k (or Sigma^n for the exact checks): particles/strings are batch rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ppl_thought.checks import integer, real
from ppl_thought.errors import DiagnosticError, MalformedSequenceError, TooLargeToEnumerateError
from ppl_thought.validation import checked

NextTokenModel = Callable[..., torch.Tensor]
Distinguisher = Callable[[int, torch.Tensor], torch.Tensor]

DTYPE = torch.float64
MAX_ENUMERATION = 1 << 22


# ---------------------------------------------------------------------------------------------- models
class TabularText:
    """An explicit LM over Sigma^n (Def 1): one row of next-token logits for every prefix of length < n.

    ``logits[j]`` has shape ``[V ** j, V]``; the row of a prefix u of length j is its base-V number
    (u_0 most significant). Every text law over Sigma^n with full support is one of these; the exact checks
    of this module use it.
    """

    def __init__(self, logits: list[torch.Tensor]):
        if not logits:
            raise DiagnosticError("TabularText needs logits for at least one position, got an empty list")
        V = int(logits[0].shape[-1])
        for j, row in enumerate(logits):
            if tuple(row.shape) != (V ** j, V):
                raise DiagnosticError(f"TabularText logits[{j}] must have shape {(V ** j, V)}, got {tuple(row.shape)}")
            if torch.isnan(row).any() or torch.isposinf(row).any():
                raise DiagnosticError(f"TabularText logits[{j}] contain NaN or +inf")
        self.vocab_size, self.length = V, len(logits)
        self.log_probs = [torch.log_softmax(row.to(DTYPE), -1) for row in logits]

    @classmethod
    def random(cls, vocab_size: int, length: int, scale: float = 1.0,
               generator: torch.Generator | None = None) -> TabularText:
        """Logits ``scale * N(0, 1)`` for every prefix of length < ``length``."""
        V, n = integer("vocab_size", vocab_size), integer("length", length)
        return cls([scale * torch.randn(V ** j, V, generator=generator, dtype=DTYPE) for j in range(n)])

    def __call__(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        tokens = _check_tokens(tokens, self.vocab_size)
        B, t = tokens.shape
        if t >= self.length:
            raise MalformedSequenceError(f"TabularText of length {self.length} has no next token after {t} tokens")
        out, idx = [], torch.zeros(B, dtype=torch.long)
        for j in range(t + 1):
            if j >= start:
                out.append(self.log_probs[j][idx])
            if j < t:
                idx = idx * self.vocab_size + tokens[:, j]
        return torch.stack(out, 1)


def lm_next_token_model(lm: torch.nn.Module, alphabet_ids: torch.Tensor, bos_id: int) -> NextTokenModel:
    """A :mod:`ppl_thought.lm` module as a next-token model over Sigma = ``alphabet_ids`` (vocabulary ids of
    the V document tokens): ``<bos>`` first, the LM's law renormalised to Sigma (masked softmax, Def 1)."""
    alphabet_ids = torch.as_tensor(alphabet_ids, dtype=torch.long)
    V = len(alphabet_ids)

    @torch.no_grad()
    def model(tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        tokens = _check_tokens(tokens, V)
        dev = alphabet_ids.device
        ids = torch.cat([torch.full((tokens.shape[0], 1), int(bos_id), dtype=torch.long, device=dev),
                         alphabet_ids[tokens.to(dev)]], 1)
        logits, _ = lm(ids)
        return torch.log_softmax(logits[:, start:, alphabet_ids].to(DTYPE), -1)

    model.vocab_size = V
    return model


def _check_tokens(tokens: torch.Tensor, V: int) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise MalformedSequenceError(f"tokens must be a LongTensor [B, t], got {getattr(tokens, 'shape', tokens)!r}")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= V):
        raise MalformedSequenceError(f"tokens must lie in the alphabet [0, {V})")
    return tokens.long()


def enumerate_strings(vocab_size: int, length: int, device: torch.device | str | None = None,
                      limit: int = MAX_ENUMERATION) -> torch.Tensor:
    """All of Sigma^length in base-V order: ``[V ** length, length]``."""
    V, L = integer("vocab_size", vocab_size), integer("length", length, 0)
    if V ** L > limit:
        raise TooLargeToEnumerateError(f"Sigma^{L} with |Sigma| = {V} has {V ** L} strings, more than limit = {limit}")
    digits = torch.arange(V ** L, device=device)[:, None] // (V ** torch.arange(L - 1, -1, -1, device=device))
    return digits % V


def sequence_log_prob(model: NextTokenModel, x: torch.Tensor) -> torch.Tensor:
    """``log q(x)`` ``[B]`` (Def 1: the product of the next-token probabilities)."""
    if x.shape[1] == 0:
        return torch.zeros(x.shape[0], dtype=DTYPE, device=x.device)
    lp = model(x[:, :-1])
    return lp.gather(-1, x[:, :, None].to(lp.device)).squeeze(-1).sum(-1)


def window_log_prob(model: NextTokenModel, prefix: torch.Tensor, k: int, vocab_size: int) -> torch.Tensor:
    """``log q^k(y | prefix)`` for every y in Sigma^k (base-V order): ``[B, V ** k]``."""
    B, s = prefix.shape
    Y = enumerate_strings(vocab_size, k, prefix.device)
    rows = torch.cat([prefix.repeat_interleave(len(Y), 0), Y.repeat(B, 1)], 1)  # [B V^k, s + k]
    lp = model(rows[:, :-1], start=s)  # [B V^k, k, V]
    return lp.gather(-1, rows[:, s:, None].to(lp.device)).squeeze(-1).sum(-1).view(B, len(Y))


def _d_values(d: Distinguisher, s: int, tokens: torch.Tensor) -> torch.Tensor:
    v = torch.as_tensor(d(s, tokens)).reshape(-1)
    if v.shape[0] != tokens.shape[0]:
        raise DiagnosticError(f"distinguisher returned {v.shape[0]} values for {tokens.shape[0]} windows")
    v = v.to(DTYPE)
    if not ((v == 0) | (v == 1)).all():
        raise DiagnosticError("a distinguisher (Def 2) must return 0 or 1 for every window")
    return v


def window_terms(p: NextTokenModel, q: NextTokenModel, d: Distinguisher, prefix: torch.Tensor, k: int,
                 vocab_size: int) -> torch.Tensor:
    """The inner term of (1.2) for each prefix (window start s = ``prefix.shape[1]``):
    ``E_{p^k} d - E_{q^k} d`` ``[B]``. A prefix impossible under p has no p-window law; its term is 0."""
    B, s = prefix.shape
    Y = enumerate_strings(vocab_size, k, prefix.device)
    rows = torch.cat([prefix.repeat_interleave(len(Y), 0), Y.repeat(B, 1)], 1)
    dv = _d_values(d, s, rows).view(B, len(Y))
    pw = window_log_prob(p, prefix, k, vocab_size).exp().nan_to_num(0.0)
    qw = window_log_prob(q, prefix, k, vocab_size).exp()
    return (pw * dv).sum(-1) - (qw.to(dv.device) * dv).sum(-1)


def exact_window_advantages(p: NextTokenModel, q: NextTokenModel, d: Distinguisher, vocab_size: int, n: int,
                            k: int) -> torch.Tensor:
    """Per-start advantages ``[n - k + 1]`` of (1.2), exactly: every prefix x_{<s} enumerated, weighted by p."""
    n, k = integer("n", n), integer("k", k)
    if k > n:
        raise DiagnosticError(f"the window k = {k} is longer than the document n = {n}")
    out = []
    for s in range(n - k + 1):
        pre = enumerate_strings(vocab_size, s)
        w = sequence_log_prob(p, pre).exp()
        out.append((w * window_terms(p, q, d, pre, k, vocab_size)).sum())
    return torch.stack(out)


def offset_starts(n: int, k: int, m: int) -> list[int]:
    """I_m: the window starts s = m, m + k, m + 2k, .. <= n - k (disjoint blocks, Lemma 1's proof)."""
    return list(range(m, n - k + 1, k))


def best_offset(per_start: torch.Tensor, k: int, sign: float = 1.0) -> tuple[int, float, int]:
    """``(m, a_m, n_m)``: the offset whose starts have the largest mean advantage (a_m >= alpha, Lemma 1).

    ``sign = -1`` picks the most negative mean instead: boosting with eps < 0 is boosting the complement 1 - d,
    whose advantage is -a (the paper's "without loss of generality a >= 0")."""
    N = per_start.shape[0]
    best = None
    for m in range(min(k, N)):
        idx = list(range(m, N, k))
        a = float(per_start[idx].mean())
        if best is None or sign * a > sign * best[1]:
            best = (m, a, len(idx))
    return best


def lemma1_kl_decrease(alpha: float, n: int, k: int) -> float:
    """Lemma 1's guaranteed fall of KL(p || .), nats per document: alpha^2 (n - k + 1) / (8 k)."""
    return alpha ** 2 * (n - k + 1) / (8 * k)


def kl_advantage_bound(kl: float, n: int, k: int) -> float:
    """Theorem 3 (App. A): |a(d)| <= sqrt(min(k, N) KL(p || q) / (2 N)), N = n - k + 1, KL in nats per document."""
    n, k = integer("n", n), integer("k", k)
    if k > n:
        raise DiagnosticError(f"the window k = {k} is longer than the document n = {n}")
    N = n - k + 1
    return math.sqrt(min(k, N) * max(0.0, float(kl)) / (2 * N))


# ---------------------------------------------------------------------------------------------- boosting
@checked
class Boosted:
    """The boosted next-token model q' of Lemma 2, (1.4): q reweighted on the blocks of I_m by exp(eps d).

    ``boosted(tokens [B, t], start=0) -> [B, t + 1 - start, V]`` like any next-token model. Inside a block the
    numerator and denominator of (1.4) enumerate the rest of the block (V^{s+k-t} strings) as batch rows of one
    call of q; rows that share a prefix are computed once.
    """

    def __init__(self, q: NextTokenModel, d: Distinguisher, k: int, n: int, offset: int, eps: float,
                 vocab_size: int):
        self.q, self.d = q, d
        self.k, self.n, self.vocab_size = integer("k", k), integer("n", n), integer("vocab_size", vocab_size)
        if self.k > self.n:
            raise DiagnosticError(f"the window k = {k} is longer than the document n = {n}")
        self.offset = integer("offset", offset, 0)
        if self.offset >= min(self.k, self.n - self.k + 1):
            raise DiagnosticError(f"offset must lie in [0, {min(self.k, self.n - self.k + 1)}), got {offset}")
        self.eps = real("eps", eps)
        self.starts = offset_starts(self.n, self.k, self.offset)

    def block_start(self, t: int) -> int | None:
        """The start s in I_m of the block holding position t, or None when q' = q there."""
        if t < self.offset:
            return None
        s = self.offset + (t - self.offset) // self.k * self.k
        return s if s in self.starts else None

    def _in_block(self, prefix: torch.Tensor, s: int) -> torch.Tensor:
        """log q'(. | prefix) [B, V] for a prefix of length t in the block of start s, by (1.4)."""
        uniq, inv = torch.unique(prefix, dim=0, return_inverse=True) if prefix.shape[1] else \
            (prefix[:1], torch.zeros(prefix.shape[0], dtype=torch.long, device=prefix.device))
        U, t = uniq.shape
        r = s + self.k - t
        Y = enumerate_strings(self.vocab_size, r, prefix.device)
        rows = torch.cat([uniq.repeat_interleave(len(Y), 0), Y.repeat(U, 1)], 1)  # [U V^r, s + k]
        lq = self.q(rows[:, :-1], start=t)
        lq = lq.gather(-1, rows[:, t:, None].to(lq.device)).squeeze(-1).sum(-1)  # log q(y | prefix)
        logw = (lq + self.eps * _d_values(self.d, s, rows).to(lq.device)).view(U, self.vocab_size, -1)
        num = torch.logsumexp(logw, -1)  # [U, V]: y_1 = v
        return (num - torch.logsumexp(num, -1, keepdim=True))[inv.to(num.device)]

    def __call__(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        tokens = _check_tokens(tokens, self.vocab_size)
        t_max = tokens.shape[1]
        if t_max >= self.n:
            raise MalformedSequenceError(f"documents have n = {self.n} tokens; no next token after {t_max}")
        base = self.q(tokens, start=start)
        cols = []
        for t in range(start, t_max + 1):
            s = self.block_start(t)
            cols.append(base[:, t - start] if s is None else self._in_block(tokens[:, :t], s))
        return torch.stack(cols, 1)


def boosted_log_ratio(q: NextTokenModel, d: Distinguisher, k: int, offset: int, eps: float, x: torch.Tensor,
                      vocab_size: int) -> torch.Tensor:
    """``log q'(x) - log q(x)`` by (1.3): sum over s in I_m of eps d(s, x_{<s+k}) - log Z_s(x_{<s}); ``[B]``.

    Its mean over documents from p is KL(p||q) - KL(p||q') (the identity in Lemma 1's proof)."""
    n = x.shape[1]
    out = 0.0
    for s in offset_starts(n, k, offset):
        pre = x[:, :s]
        Y = enumerate_strings(vocab_size, k, x.device)
        rows = torch.cat([pre.repeat_interleave(len(Y), 0), Y.repeat(x.shape[0], 1)], 1)
        dy = _d_values(d, s, rows).view(x.shape[0], len(Y))
        logz = torch.logsumexp(window_log_prob(q, pre, k, vocab_size) + eps * dy, -1)
        out = out + eps * _d_values(d, s, x[:, :s + k]).to(logz.device) - logz
    return out if isinstance(out, torch.Tensor) else torch.zeros(x.shape[0], dtype=DTYPE, device=x.device)


@checked
@dataclass
class BoostingReport:
    """Lemma 1 on a pair (p, q) small enough to enumerate Sigma^n; KL in nats per document."""

    n: int
    k: int
    alpha: float  # a_{p,q}(d) (1.2)
    per_start: list[float]  # advantage of each start s
    offset: int  # m
    a_m: float
    n_m: int
    eps: float
    kl_before: float
    kl_after: float
    kl_decrease: float  # KL(p||q) - KL(p||q')
    identity: float  # sum_{s in I_m} E_p[eps d - log Z_s], equal to kl_decrease
    proof_bound: float  # n_m (eps a_m - eps^2): the bound before the choice of eps (valid for |eps| <= 1)
    lemma1_bound: float  # alpha^2 (n - k + 1) / (8 k)
    alpha_after: float
    per_start_after: list[float]
    chain_vs_text_max_abs: float  # max |log q'(x) by (1.4) - by (1.3)| over Sigma^n
    total_mass: float  # sum over Sigma^n of q'(x)
    theorem3_before: float = field(default=math.nan)  # sqrt(min(k, N) KL / (2N)) before boosting
    theorem3_after: float = field(default=math.nan)


@checked
def exact_boosting(p: NextTokenModel, q: NextTokenModel, d: Distinguisher, vocab_size: int, n: int, k: int,
                   eps: float | None = None, offset: int | None = None) -> BoostingReport:
    """Lemmas 1-2 by enumeration of Sigma^n: the advantage, the offset m, the boosted model (1.4) and its law
    checked against (1.3), the exact KL fall next to the lemma's bound, and the advantage after boosting.

    ``eps`` defaults to alpha / 2 and ``offset`` to the best one (Lemma 1's proof); a negative alpha boosts
    the complement of d (eps < 0, the offset with the most negative mean).
    """
    n, k, V = integer("n", n), integer("k", k), integer("vocab_size", vocab_size)
    X = enumerate_strings(V, n)
    lp, lq = sequence_log_prob(p, X), sequence_log_prob(q, X)
    P = lp.exp()

    def kl_to(lr: torch.Tensor) -> float:  # KL(p || r) over Sigma^n; +inf if r misses mass of p, never NaN
        return float(torch.where(P > 0, P * (lp - lr), torch.zeros_like(P)).sum())

    kl_q = kl_to(lq)
    per = exact_window_advantages(p, q, d, V, n, k)
    alpha = float(per.mean())
    m, a_m, n_m = best_offset(per, k, 1.0 if alpha >= 0 else -1.0)
    if offset is not None:
        m = integer("offset", offset, 0)
        idx = list(range(m, per.shape[0], k))
        a_m, n_m = float(per[idx].mean()), len(idx)
    e = alpha / 2 if eps is None else real("eps", eps)
    qb = Boosted(q, d, k, n, m, e, V)
    lqb = sequence_log_prob(qb, X)
    ratio = boosted_log_ratio(q, d, k, m, e, X, V)
    per_after = exact_window_advantages(p, qb, d, V, n, k)
    kl_b = kl_to(lqb)
    return BoostingReport(
        n=n, k=k, alpha=alpha, per_start=per.tolist(), offset=m, a_m=a_m, n_m=n_m, eps=e,
        kl_before=kl_q, kl_after=kl_b, kl_decrease=kl_q - kl_b, identity=float((P * ratio).sum()),
        proof_bound=n_m * (e * a_m - e * e), lemma1_bound=lemma1_kl_decrease(alpha, n, k),
        alpha_after=float(per_after.mean()), per_start_after=per_after.tolist(),
        chain_vs_text_max_abs=float((lqb - (lq + ratio)).abs().max()), total_mass=float(lqb.exp().sum()),
        theorem3_before=kl_advantage_bound(kl_q, n, k), theorem3_after=kl_advantage_bound(kl_b, n, k))


# ---------------------------------------------------------------------------------------------- Algorithm 1
@dataclass
class SelfBoostingRun:
    """What Algorithm 1 tried: the first index i0, the losses L_i of the models trained at i0, i0 + 1, ..,
    and the output index (the first i with L_i - L_{i+1} <= threshold)."""

    start: int
    indices: list[int]
    losses: list[float]
    output: int
    threshold: float


def self_boosting_threshold(eps: float, n: int, k: int) -> float:
    """The per-token loss fall that a distinguisher of advantage eps forces (Lemma 2):
    eps^2 (n - k + 1) / (8 k n). Algorithm 1 stops when one step in size gains less (Lemma 4)."""
    eps, n, k = real("eps", eps, 0.0, 1.0, open_min=True), integer("n", n), integer("k", k)
    if k > n:
        raise DiagnosticError(f"the window k = {k} is longer than the document n = {n}")
    return eps ** 2 * (n - k + 1) / (8 * k * n)


@checked
def self_boosting_schedule(train: Callable[[int], float], threshold: float, num_indices: int,
                           generator: torch.Generator | None = None, max_tries: int = 64) -> SelfBoostingRun:
    """Algorithm 1 (Section 3; Lemma 4): draw i0 uniformly from {1, .., num_indices}, train at i0, i0 + 1, ..
    (``train(i)`` returns the minimised per-token loss of the size-i model) and output the first i whose
    successor lowers the loss by at most ``threshold``. Since the loss is >= 0 and starts at most at
    L_1, fewer than L_1 / threshold indices can be followed by a larger fall (Lemma 4), so a start drawn from
    ``num_indices >= 10 L_1 / threshold`` indices stops after two sizes with probability >= 0.9.
    """
    threshold = real("threshold", threshold, 0.0, open_min=True)
    num_indices = integer("num_indices", num_indices)
    i0 = int(torch.randint(1, num_indices + 1, (1,), generator=generator))
    idx, losses = [i0], [float(train(i0))]
    while True:
        if len(idx) > max_tries:
            raise DiagnosticError(f"Algorithm 1 did not stop within max_tries = {max_tries} sizes "
                                  f"(losses {losses[-3:]}, threshold {threshold})")
        i = idx[-1] + 1
        idx.append(i)
        losses.append(float(train(i)))
        if losses[-2] - losses[-1] <= threshold:
            return SelfBoostingRun(start=i0, indices=idx, losses=losses, output=idx[-2], threshold=threshold)


__all__ = [
    "Boosted",
    "BoostingReport",
    "SelfBoostingRun",
    "TabularText",
    "best_offset",
    "boosted_log_ratio",
    "enumerate_strings",
    "exact_boosting",
    "exact_window_advantages",
    "kl_advantage_bound",
    "lemma1_kl_decrease",
    "lm_next_token_model",
    "offset_starts",
    "self_boosting_schedule",
    "self_boosting_threshold",
    "sequence_log_prob",
    "window_log_prob",
    "window_terms",
]
