"""The k-token advantage of a next-k-token distinguisher (next-token-long-range.txt, Def 2, Eq 1.2).

A next-k-token distinguisher d(prefix, window) in {0, 1} reads a prefix and the k-token window that
follows it. Its advantage between the training distribution p and a model q (Eq 1.2) is

    a(d) = E_{prefix ~ p} [ E_{y ~ q(.|prefix)} d(prefix, y_{1:k}) - E_{y ~ p(.|prefix)} d(prefix, y_{1:k}) ],

averaged over prefixes (positions) of documents from p. Given, for each of N prefixes, one held-out
continuation (from p) and one model continuation (from q), :func:`k_token_advantage` estimates a(d)
by the paired mean of d(prefix, model) - d(prefix, held-out) with a normal confidence interval.

App. A (Theorem 3, Pinsker's inequality) bounds |a(d)| <= sqrt(min(k, W) n (L - H) / (2 W)) for documents of
n tokens with W = n - k + 1 window starts, where L is the model's next-token log loss per token on p and H the
entropy rate of p (so n (L - H) = KL(p || q), in nats): :func:`advantage_bound`. The boosting construction of
Lemmas 1-2 is in :mod:`ppl_thought.diagnostics.boosting`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ppl_thought.distributions.token_rule import token_step
from ppl_thought.errors import ConfigError, DiagnosticError
from ppl_thought.validation import ArrayLike, FloatOrNaN, checked


@checked
@dataclass
class KTokenAdvantage:
    """The estimated advantage (Eq 1.2) with its standard error and a ``level`` confidence interval."""

    advantage: float
    stderr: float
    ci_low: float
    ci_high: float
    n: int
    k: int
    level: float
    bound: FloatOrNaN = math.nan  # Theorem 3 (App. A, :func:`advantage_bound`) when the entropy rate is known

    @property
    def covers_zero(self) -> bool:
        return self.ci_low <= 0.0 <= self.ci_high


def _normal_quantile(level: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(0.5 + level / 2))


@checked
def advantage_bound(k: int, loss: float, entropy_rate: float, n: int | None = None) -> float:
    """Theorem 3 (App. A) on |advantage| of any next-k-token distinguisher, from per-token rates.

    ``loss`` L: next-token log loss per token (nats) of the model on documents of p; ``entropy_rate`` H
    (nats per token), so KL(p || q) = n (L - H) for documents of n tokens. With N = n - k + 1 window starts,
    Theorem 3 gives sqrt(min(k, N) n (L - H) / (2 N)) (:func:`~ppl_thought.diagnostics.boosting.kl_advantage_bound`).
    ``n=None``: sqrt(k (L - H) / 2), which is that bound for a single window (n = k) and its limit for
    n -> infinity; for finite n > k it is too small by sqrt(n / N) (a test shows it failing), so pass ``n``.
    L - H < 0 can only come from estimation noise in L; it is clipped to 0.
    """
    if isinstance(k, bool) or k < 1:
        raise ConfigError(f"k must be an integer >= 1, got {k!r}")
    if n is not None and (isinstance(n, bool) or n < k):
        raise ConfigError(f"n (the document length) must be an integer >= k = {k}, got {n!r}")
    if not (math.isfinite(loss) and math.isfinite(entropy_rate)):
        return math.inf
    rate = max(0.0, loss - entropy_rate)
    if n is None:
        return math.sqrt(k * rate / 2)
    N = n - k + 1
    return math.sqrt(min(k, N) * n * rate / (2 * N))


@checked
def k_token_advantage(distinguisher: Callable, prefixes: ArrayLike, held_out: ArrayLike, model: ArrayLike, k: int,
                      level: float = 0.95, loss: float | None = None,
                      entropy_rate: float | None = None, doc_len: int | None = None) -> KTokenAdvantage:
    """Paired estimate of the advantage (Eq 1.2) of ``distinguisher`` between model and held-out continuations.

    Args:
        distinguisher: ``d(prefix, window) -> bool/0/1`` on one prefix and one k-token window, or on batches
            (``[N, t]`` prefixes and ``[N, k]`` windows, returning ``[N]``) when ``prefixes`` is a tensor.
        prefixes: N prefixes drawn from the data (any sequences; a ``[N, t]`` tensor for batched use).
        held_out: N continuations from the data distribution p (at least k tokens each).
        model: N continuations from the model q given the same prefixes.
        k: the window length; only the first k tokens of each continuation are shown to ``distinguisher``.
        level: confidence level of the normal interval advantage +- z * stderr.
        loss, entropy_rate: when both are given, ``bound`` = :func:`advantage_bound` ``(k, L, H, doc_len)``
            (Theorem 3, App. A); ``doc_len`` n is the length of the documents the prefixes were cut from.
    """
    N = len(prefixes)
    if not (N == len(held_out) == len(model)):
        raise DiagnosticError(f"prefixes, held_out and model must pair up; got lengths {N}, {len(held_out)}, "
                              f"{len(model)}")
    if N < 2:
        raise ConfigError("k_token_advantage needs at least 2 prefixes")
    if not 0 < level < 1:
        raise ConfigError(f"level must be in (0, 1), got {level}")
    if isinstance(prefixes, torch.Tensor):
        h = torch.as_tensor(held_out)[:, :k]
        m = torch.as_tensor(model)[:, :k]
        if h.shape[-1] < k or m.shape[-1] < k:
            raise DiagnosticError(f"continuations need at least k = {k} tokens")
        dm = np.asarray(torch.as_tensor(distinguisher(prefixes, m)).double().reshape(-1))
        dh = np.asarray(torch.as_tensor(distinguisher(prefixes, h)).double().reshape(-1))
    else:
        for c in list(held_out) + list(model):
            if len(c) < k:
                raise DiagnosticError(f"a continuation has {len(c)} < k = {k} tokens")
        dm = np.array([float(distinguisher(p, c[:k])) for p, c in zip(prefixes, model)])
        dh = np.array([float(distinguisher(p, c[:k])) for p, c in zip(prefixes, held_out)])
    if not (np.isin(dm, (0.0, 1.0)).all() and np.isin(dh, (0.0, 1.0)).all()):
        raise DiagnosticError("a distinguisher (Def 2) must return 0 or 1")
    diff = dm - dh
    adv = float(diff.mean())
    se = float(diff.std(ddof=1) / math.sqrt(N))
    z = _normal_quantile(level)
    known = loss is not None and entropy_rate is not None
    bound = advantage_bound(k, loss, entropy_rate, doc_len) if known else math.nan
    return KTokenAdvantage(advantage=adv, stderr=se, ci_low=adv - z * se, ci_high=adv + z * se, n=N, k=int(k),
                           level=float(level), bound=bound)


@checked
@torch.no_grad()
def sample_continuations(lm: torch.nn.Module, prefixes: torch.Tensor, k: int,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """k tokens from ``lm`` after each row of ``prefixes`` ``[N, t]`` (plain ancestral sampling, each token by
    :func:`~ppl_thought.distributions.token_rule.token_step`, the one token step) -> ``[N, k]``.

    ``lm(tokens) -> (logits, cache)`` as every :mod:`ppl_thought.lm` module; the prefix should start with
    ``<bos>`` when the LM expects it.
    """
    toks = prefixes.long()
    out = []
    for _ in range(int(k)):
        logits, _ = lm(toks)
        law = torch.log_softmax(logits[:, -1].double(), -1)  # the LM's own law, every token
        nxt = token_step(None, None, None, generator=generator, log_probs=law).token[:, None]  # the one token step
        out.append(nxt)
        toks = torch.cat([toks, nxt], 1)
    return torch.cat(out, 1) if out else torch.zeros(len(prefixes), 0, dtype=torch.long)


__all__ = ["KTokenAdvantage", "advantage_bound", "k_token_advantage", "sample_continuations"]
