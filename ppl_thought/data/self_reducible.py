"""Self-reducible sampling with a weak chain-of-thought (cot-or-loop.txt, Section 5 and Appendix D).

The relation
------------
``R(x)`` is the set of satisfying assignments ``y = y_1 .. y_m`` in ``{0, 1}^m`` of a CNF formula ``x``
over ``m`` Boolean variables. It is self-reducible in the sense of Definition 5.1 / C.4 with
``sigma(x) = 1``: fixing ``y_1`` leaves a CNF over the remaining variables (the subproblem
``psi(x, y_1)``), and so on. :class:`CNF` tabulates the formula once over all ``2^m`` assignments
(``m <= 20``; tested up to 14) and answers every count exactly: ``count(y_<i)`` is the number of
satisfying completions of the partial assignment ``y_<i`` (the size of the subproblem
``|R(psi(x, y_<i))|``).

Proposition 5.12 (Fig. 2): the next-token law of the uniform distribution ``p`` over ``R(x)`` is a
relative count,

    p(y_i | y_<i) = count(y_<i y_i) / count(y_<i),                                     (8)

so along any solution ``y``, ``prod_i p(y_i | y_<i) = 1 / |R(x)|`` (counting = sampling, Theorem 5.4 /
C.5 of Jerrum, Valiant and Vazirani).

The weak CoT (Definition 5.10)
------------------------------
For a prefix ``y_<i`` each reasoning path ``r ~ pi(. | x, y_<i)`` yields a prediction ``pi^(t)`` of the
next-token law. :class:`WeakCoT` makes a path *good* with probability ``1/2 + gamma`` and *bad*
otherwise. A good path's prediction is drawn uniformly (in probability coordinates) from the
cross-entropy ball

    { pi : L_CE(x, y_<i, r) - H(p(. | y_<i)) = KL(p(. | y_<i) || pi) <= alpha },            (5)

i.e. ``alpha`` bounds the *excess* cross-entropy of equation (4) over the irreducible entropy of
``p`` (the paper's bound ``L_CE <= alpha`` cannot hold for ``alpha < H(p)``; its proof, (55), only uses
``KL <= L_CE``). The ball over ``{0, 1}`` is an interval ``[lo, hi]`` of ``pi(1)``, found by bisection.
Where ``p`` is deterministic (one branch has no solution) a good path may still put up to
``1 - exp(-alpha)`` on the dead branch. A bad path is adversarial: ``bad="flip"`` predicts the
flipped law ``pi(1) = p(0)``; ``bad="extreme"`` puts all mass on the less likely token.

Self-consistency (Lemma 5.11, equation (6))
-------------------------------------------
The consensus of ``T`` independent paths is the coordinate-wise median

    pi*(y) = median(pi^(1)(y), ..., pi^(T)(y))  for each y,                              (6)

renormalised (:func:`coordinatewise_median`; even ``T`` averages the two middle values). The
autoregressive sampler ``q_T`` draws ``y_i`` from a fresh consensus at every prefix (Assumptions 5.8,
5.9), so its next-token law is ``q_T(y_i | y_<i) = E[pi*(y_i)]``. For a binary vocabulary the median
of ``pi(0) = 1 - pi(1)`` is ``1 - median(pi(1))``, so no renormalisation is needed, and the mean of the
median order statistic has a closed form (:meth:`WeakCoT.consensus_mean`): with ``F`` the CDF of one
path's ``pi(1)`` (piecewise linear plus one jump at the bad value),

    E[X_(k)] = int_0^1 P(Bin(T, F(x)) < k) dx,   int_0^u P(Bin(T, t) < k) dt = E[min(Bin(T+1, u), k)] / (T + 1),

so ``q_T`` is computed exactly over all ``2^m`` assignments (:func:`sampler_log_law`) and compared in total
variation with the uniform law over ``R(x)`` (mass outside ``R(x)`` counts, :func:`total_variation`).

The bound (Lemma 5.11 with Pinsker, (56), and Hoeffding, (60)): if more than ``T/2`` paths are good
the median lies in the good interval, ``|pi*(1) - p(1)| <= sqrt(alpha / 2)``; the majority is bad with
probability at most ``exp(-2 T gamma^2)``. Summing the per-prefix errors along ``p`` (the hybrid
argument),

    TV(q_T, p) <= m (sqrt(alpha / 2) + exp(-2 T gamma^2))                                (Lemma 5.11 bound)

and :func:`tv_bound` also gives the sharper version with the exact good interval and binomial tail.

Theorem 5.13's rejection step (:func:`rejection_log_law`, :func:`rejection_sample`)
-------------------------------------------------------------------------------------
The proof of Theorem 5.13 (Appendix D.3, after (66)) turns the approximate sampler into an exact one by
rejection, as in Jerrum, Valiant and Vazirani:

    draw y ~ pi(. | x);  if y not in R(x), reject;  else accept with probability p(y | x) / (beta pi(y | x)),
    beta = e^{1/2},  and repeat, at most N times (error source (2), N = O(beta^2 log(2 / eps)), (68)).

The proposal ``pi`` is the self-consistent sampler of Lemma 5.11, and ``pi(y | x)`` is its probability of ``y``:
``q_T(y) = prod_i q_T(y_i | y_<i)`` with ``q_T(. | y_<i) = E[pi*]``, the law of the token it emits at each
prefix (:func:`sampler_log_law`). This is the probability the identity (67) needs (the proposal's own law of
``y``), and it makes the output law exact: one trial emits an accepted ``y`` with probability
``a(y) = min(q_T(y), p(y) / beta)`` on ``R(x)`` (the acceptance is clipped at 1 where ``q_T(y) < p(y) / beta``,
i.e. where the Lemma-5.11 estimates of (62)-(66) fail, error source (1)), and 0 outside. With ``A = sum_y a(y)``
and at most ``N`` trials, the algorithm returns the first accepted ``y``, or the ``N``-th proposal if all were
rejected (so it always returns an assignment; that fallback is where error source (2) lands):

    out(y) = a(y) (1 - (1 - A)^N) / A + (1 - A)^{N - 1} (q_T(y) - a(y)).

Where every solution has ``q_T(y) >= p(y) / beta``, ``a(y) = 1 / (beta |R(x)|)`` is constant, (67), and the
accepted part of ``out`` is exactly uniform: the O(sqrt(alpha)) floor of Lemma 5.11 is gone and only the
clipped solutions and the fallback mass ``(1 - A)^N`` remain. ``p(y | x) = 1 / |R(x)|`` needs the count;
``log_count`` may pass an estimate (e.g. from :func:`count_by_sampling`); a wrong count only rescales ``A`` and
the clipping threshold. (Using the *random* consensus product ``prod_i pi*_i(y_i)`` of one draw in the
acceptance instead gives, per trial, ``E[min(prod_i pi*_i(y_i), p(y) / beta)] <= a(y)`` by Jensen, since
``E[prod_i pi*_i(y_i)] = q_T(y)``; that law has no product form and is not computed here.)

Counting by sampling (:func:`count_by_sampling`): the sampler records the consensus probability of
every token it draws; along a drawn solution, ``-sum_i log pi*(y_i | y_<i)`` estimates ``log |R(x)|``.
:func:`self_reducible_curve` reports the total variation and the mean absolute log-count error per T.

Example::

    from ppl_thought.data.self_reducible import WeakCoT, random_cnf, sampler_log_law, total_variation
    cnf = random_cnf(m=12, k=3, num_clauses=40, seed=0)
    model = WeakCoT(alpha=0.01, gamma=0.25)
    [total_variation(cnf, sampler_log_law(cnf, model, T)) for T in (1, 5, 33)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ppl_thought import checks
from ppl_thought.data.cnf import CNF, MAX_VARIABLES, assignment_bits, random_cnf  # noqa: F401  (CNF's home is data/cnf.py)
from ppl_thought.errors import (
    ConfigError,
    MalformedSequenceError,
    SamplingBudgetError,
)
from ppl_thought.validation import checked

_DTYPE = torch.float64


@checked
def coordinatewise_median(predictions: torch.Tensor) -> torch.Tensor:
    """Consensus of ``T`` predicted distributions by the coordinate-wise median, renormalised (Lemma 5.11, (6)).

    ``predictions`` is ``[..., T, V]``; the result is ``[..., V]``. For even ``T`` the median is the
    average of the two middle values. A consensus whose medians are all zero (possible for ``V > 2``)
    is replaced by the uniform law.
    """
    if predictions.dim() < 2 or predictions.shape[-2] < 1 or predictions.shape[-1] < 1:
        raise MalformedSequenceError(f"predictions must be [..., T, V] with T, V >= 1, got {tuple(predictions.shape)}")
    T = predictions.shape[-2]
    s = predictions.sort(dim=-2).values
    med = 0.5 * (s[..., (T - 1) // 2, :] + s[..., T // 2, :])
    total = med.sum(-1, keepdim=True)
    uniform = torch.full_like(med, 1.0 / med.shape[-1])
    return torch.where(total > 0, med / torch.where(total > 0, total, torch.ones_like(total)), uniform)


def _kl_bernoulli(p1: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``KL(Bern(p1) || Bern(x))`` with ``0 log 0 = 0`` (``+inf`` where x puts no mass on a possible token)."""
    p0 = 1 - p1
    return (torch.xlogy(p1, p1) - torch.xlogy(p1, x)) + (torch.xlogy(p0, p0) - torch.xlogy(p0, 1 - x))


def _binomial_pmf(n: int, u: torch.Tensor) -> torch.Tensor:
    """``P(Bin(n, u) = j)`` for ``j = 0..n``: ``[..., n + 1]`` (exact at u = 0 and u = 1)."""
    j = torch.arange(n + 1, dtype=u.dtype, device=u.device)
    log_binom = torch.lgamma(torch.tensor(n + 1.0, dtype=u.dtype, device=u.device)) - torch.lgamma(j + 1) \
        - torch.lgamma(n - j + 1)
    uu = u.unsqueeze(-1)
    return torch.exp(log_binom + torch.xlogy(j, uu) + torch.xlogy(n - j, 1 - uu))


def _order_stat_antiderivative(u: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """``H_k(u) = int_0^u P(Bin(T, t) < k) dt = E[min(Bin(T + 1, u), k)] / (T + 1)``."""
    pmf = _binomial_pmf(T + 1, u)
    j = torch.arange(T + 2, dtype=u.dtype, device=u.device)
    return (pmf * j.clamp(max=k)).sum(-1) / (T + 1)


@checked
class WeakCoT:
    """A binary-vocabulary chain-of-thought model with (alpha, gamma)-weak token-wise learning (Definition 5.10).

    Given the target law ``p(. | x, y_<i)`` of a prefix (a ``[..., 2]`` tensor), each reasoning path is
    *good* with probability ``1/2 + gamma`` and then predicts ``pi(1)`` uniformly from the interval
    ``[lo, hi] = {pi(1) : KL(p || pi) <= alpha}`` (``alpha`` bounds the excess cross-entropy of (4)-(5));
    otherwise it is *bad*: ``bad="flip"`` predicts ``pi(1) = p(0)``, ``bad="extreme"`` puts all mass on the
    less likely token (``pi(1) = 1`` if ``p(1) < 1/2``, else ``0``). Definition 5.10 has
    ``gamma in (0, 1/2)``; ``gamma in [-1/2, 0]`` is accepted to show the median failing without the margin.
    """

    def __init__(self, alpha: float, gamma: float, bad: str = "flip") -> None:
        alpha, gamma = float(alpha), float(gamma)
        if not (alpha > 0 and math.isfinite(alpha)):
            raise ConfigError(f"alpha (the excess cross-entropy budget of Definition 5.10) must be > 0, got {alpha}")
        if not -0.5 <= gamma <= 0.5:
            raise ConfigError(f"gamma must be in [-1/2, 1/2] (good-path probability 1/2 + gamma), got {gamma}")
        if bad not in ("flip", "extreme"):
            raise ConfigError(f"bad must be 'flip' or 'extreme', got {bad!r}")
        self.alpha, self.gamma, self.bad = alpha, gamma, bad

    def __repr__(self) -> str:
        return f"WeakCoT(alpha={self.alpha}, gamma={self.gamma}, bad={self.bad!r})"

    @property
    def good_probability(self) -> float:
        """``1/2 + gamma``, the probability that a path is good (equation (5))."""
        return 0.5 + self.gamma

    @staticmethod
    def _p1(p: torch.Tensor) -> torch.Tensor:
        if p.dim() < 1 or p.shape[-1] != 2:
            raise MalformedSequenceError(
                f"WeakCoT needs target laws over {{0, 1}} of shape [..., 2], got {tuple(p.shape)}")
        if not p.is_floating_point() or torch.isnan(p).any() or (p < 0).any() or (p > 1).any():
            raise MalformedSequenceError("target laws must be floating-point probabilities in [0, 1]")
        return p[..., 1].to(_DTYPE)

    def good_interval(self, p: torch.Tensor, iters: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)``: the interval of ``pi(1)`` with ``KL(p || pi) <= alpha`` (bisection, float64, ``[...]``)."""
        p1 = self._p1(p)
        alpha = self.alpha
        # lower side: KL decreases on [0, p1]; keep b feasible, a infeasible.
        a, b = torch.zeros_like(p1), p1.clone()
        for _ in range(iters):
            mid = 0.5 * (a + b)
            over = _kl_bernoulli(p1, mid) > alpha
            a, b = torch.where(over, mid, a), torch.where(over, b, mid)
        lo = torch.where(_kl_bernoulli(p1, torch.zeros_like(p1)) <= alpha, torch.zeros_like(p1), b)
        # upper side: KL increases on [p1, 1].
        a, b = p1.clone(), torch.ones_like(p1)
        for _ in range(iters):
            mid = 0.5 * (a + b)
            over = _kl_bernoulli(p1, mid) > alpha
            a, b = torch.where(over, a, mid), torch.where(over, mid, b)
        hi = torch.where(_kl_bernoulli(p1, torch.ones_like(p1)) <= alpha, torch.ones_like(p1), a)
        return lo, hi

    def bad_value(self, p: torch.Tensor) -> torch.Tensor:
        """``pi(1)`` predicted by a bad path (``[...]``)."""
        p1 = self._p1(p)
        if self.bad == "flip":
            return 1 - p1
        return (p1 < 0.5).to(_DTYPE)

    def sample_paths(self, p: torch.Tensor, T: int, generator: torch.Generator | None = None,
                     num_samples: int | None = None) -> torch.Tensor:
        """Predictions ``pi^(1..T)`` of ``T`` independent reasoning paths per prefix (Assumption 5.9): ``[..., T, 2]``.

        ``num_samples`` draws that many independent sets of ``T`` paths at once: ``[num_samples, ..., T, 2]``.
        """
        _check_T(T)
        lo, hi = self.good_interval(p)
        bad = self.bad_value(p)
        if num_samples is not None:
            if isinstance(num_samples, bool) or num_samples < 1:
                raise ConfigError(f"num_samples must be a positive integer, got {num_samples!r}")
            lo, hi, bad = (v.expand(num_samples, *v.shape) for v in (lo, hi, bad))
        return self.draw_paths(lo, hi, bad, T, generator)

    def draw_paths(self, lo: torch.Tensor, hi: torch.Tensor, bad: torch.Tensor, T: int,
                   generator: torch.Generator | None) -> torch.Tensor:
        """T paths' predictions pi^(t)(1) ``[..., T]`` for prefixes whose good interval is ``[lo, hi]`` and bad
        value ``bad`` (Definition 5.10): good with probability 1/2 + gamma, uniform in the interval, else bad."""
        shape = (*lo.shape, T)
        u = torch.rand(shape, generator=generator, dtype=_DTYPE, device=lo.device)
        good = torch.rand(shape, generator=generator, dtype=_DTYPE, device=lo.device) < self.good_probability
        pi1 = torch.where(good, lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * u, bad.unsqueeze(-1).expand(shape))
        return torch.stack([1 - pi1, pi1], dim=-1)

    def consensus(self, p: torch.Tensor, T: int, generator: torch.Generator | None = None,
                  num_samples: int | None = None) -> torch.Tensor:
        """One random self-consistent prediction per prefix: the median (6) of ``T`` fresh paths, ``[..., 2]``
        (``[num_samples, ..., 2]`` with ``num_samples``)."""
        return coordinatewise_median(self.sample_paths(p, T, generator, num_samples))

    def consensus_mean(self, p: torch.Tensor, T: int) -> torch.Tensor:
        """``E[pi*]``, the mean of the normalised coordinate-wise median (6) over ``T`` paths, in closed form.

        This is the sampler's next-token law ``q_T(. | y_<i)``. One path's ``pi(1)`` has CDF
        ``F(x) = (1/2 + gamma) G(x) + (1/2 - gamma) 1[x >= bad]`` with ``G`` uniform on ``[lo, hi]``; the
        median is the order statistic ``X_(k)``, ``k = (T + 1) / 2`` (even ``T``: the mean of ``k = T/2`` and
        ``T/2 + 1``), and ``E[X_(k)] = int_0^1 P(Bin(T, F(x)) < k) dx``, integrated exactly on the pieces
        where ``F`` is linear via ``int_0^u P(Bin(T, t) < k) dt = E[min(Bin(T + 1, u), k)] / (T + 1)``.
        """
        _check_T(T)
        lo, hi = self.good_interval(p)
        bad = self.bad_value(p)
        g = self.good_probability
        width = (hi - lo).clamp_min(torch.finfo(_DTYPE).tiny)
        knots = torch.stack([torch.zeros_like(lo), lo, hi, bad, torch.ones_like(lo)], dim=-1).sort(-1).values
        x0, x1 = knots[..., :-1], knots[..., 1:]  # [..., 4] pieces
        mid = 0.5 * (x0 + x1)
        jump = (1 - g) * (mid >= bad.unsqueeze(-1)).to(_DTYPE)

        def cdf_good(x: torch.Tensor) -> torch.Tensor:
            return ((x - lo.unsqueeze(-1)) / width.unsqueeze(-1)).clamp(0, 1)

        u0, u1 = g * cdf_good(x0) + jump, g * cdf_good(x1) + jump
        length = x1 - x0
        du = u1 - u0
        ks = [(T + 1) // 2] if T % 2 else [T // 2, T // 2 + 1]
        mean = torch.zeros_like(lo)
        for k in ks:
            steep = du > 1e-9
            h_mid = _order_stat_tail(0.5 * (u0 + u1), T, k)
            exact = length * (_order_stat_antiderivative(u1, T, k) - _order_stat_antiderivative(u0, T, k)) \
                / torch.where(steep, du, torch.ones_like(du))
            mean = mean + torch.where(steep, exact, length * h_mid).sum(-1)
        q1 = (mean / len(ks)).clamp(0, 1)
        return torch.stack([1 - q1, q1], dim=-1)


def _order_stat_tail(u: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """``P(Bin(T, u) < k)``."""
    return _binomial_pmf(T, u)[..., :k].sum(-1)


def _check_T(T: int) -> None:
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ConfigError(f"the number of reasoning paths T must be a positive integer, got {T!r}")


def _all_prefix_laws(cnf: CNF) -> torch.Tensor:
    """``p(. | y_<i)`` for every prefix of every length ``0..m-1``, concatenated by level: ``[2^m - 1, 2]``."""
    return torch.cat([cnf.level_table(i, dead="uniform") for i in range(cnf.m)], dim=0)


def _chain_log_law(cnf: CNF, next_law: torch.Tensor) -> torch.Tensor:
    """``log q(y)`` over all ``2^m`` assignments from next-token laws of all prefixes (``[2^m - 1, 2]``, by level)."""
    log_next = torch.log(next_law)
    logq = torch.zeros(1, dtype=_DTYPE, device=next_law.device)
    start = 0
    for i in range(cnf.m):
        level = log_next[start:start + 2**i]
        logq = (logq.unsqueeze(-1) + level).reshape(-1)
        start += 2**i
    return logq


def sampler_log_law(cnf: CNF, model: WeakCoT, T: int) -> torch.Tensor:
    """``log q_T(y)`` for all ``2^m`` assignments: the autoregressive sampler with median-of-T consensus (6).

    ``q_T(y) = prod_i q_T(y_i | y_<i)`` with ``q_T(. | y_<i) = E[pi*]`` (:meth:`WeakCoT.consensus_mean`), exact.
    At dead prefixes the target law is taken as ``(1/2, 1/2)``; this only moves mass among non-solutions.
    """
    return _chain_log_law(cnf, model.consensus_mean(_all_prefix_laws(cnf), T))


def total_variation(cnf: CNF, log_q: torch.Tensor) -> float:
    """``TV(q, p) = 1/2 sum_y |q(y) - p(y)|``, ``p`` uniform over ``R(x)``; mass of ``q`` outside ``R(x)`` counts."""
    if log_q.shape != (2**cnf.m,):
        raise MalformedSequenceError(f"log_q must have shape [2^m] = [{2**cnf.m}], got {tuple(log_q.shape)}")
    return float(0.5 * (log_q.exp() - cnf.log_uniform().exp()).abs().sum())


def tv_bound(cnf: CNF, model: WeakCoT, T: int, sharp: bool = False) -> float:
    """Upper bound on ``TV(q_T, p)`` from Lemma 5.11 and the hybrid argument ``TV <= sum_i E_p[TV_i]``.

    ``sharp=False``: ``m (sqrt(alpha / 2) + exp(-2 T gamma^2))`` (Pinsker (56), Hoeffding (60)).
    ``sharp=True``: per prefix, ``(1 - P_bad) max(p(1) - lo, hi - p(1)) + P_bad`` with the exact good interval and
    ``P_bad = P(Bin(T, 1/2 + gamma) <= T/2)``, averaged over prefixes drawn from ``p``. Needs ``gamma > 0``.
    """
    _check_T(T)
    if model.gamma <= 0:
        raise ConfigError(f"Lemma 5.11 needs a weak-learning margin gamma > 0, got {model.gamma}")
    if not sharp:
        return cnf.m * (math.sqrt(model.alpha / 2) + math.exp(-2 * T * model.gamma**2))
    g = torch.tensor(model.good_probability, dtype=_DTYPE)
    p_bad = float(_binomial_pmf(T, g)[: T // 2 + 1].sum())
    total = 0.0
    for i in range(cnf.m):
        p = cnf.level_table(i, dead="uniform")
        lo, hi = model.good_interval(p)
        width = torch.maximum(p[:, 1] - lo, hi - p[:, 1])
        per_prefix = (1 - p_bad) * width + p_bad
        weight = cnf.counts[i].to(_DTYPE) / cnf.num_solutions  # p(y_<i)
        total += float((weight * per_prefix).sum())
    return total


SQRT_E = math.exp(0.5)  # beta of Theorem 5.13's proof, (66)


def _check_rejection_args(beta: float, trials: int) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (math.isfinite(beta) and beta >= 1):
        raise ConfigError(f"beta (the ratio band of Theorem 5.13, (66)) must be a finite real >= 1, got {beta!r}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ConfigError(f"trials (N of Theorem 5.13, (68)) must be a positive integer, got {trials!r}")
    return float(beta)


def _log_p_target(cnf: CNF, log_count: float | None) -> float:
    """``log p(y | x)`` on ``R(x)`` as the acceptance rule uses it: ``-log |R(x)|`` or ``-log_count``."""
    if log_count is None:
        return -math.log(cnf.num_solutions)
    if isinstance(log_count, bool) or not isinstance(log_count, (int, float)) or not math.isfinite(log_count):
        raise ConfigError(f"log_count (an estimate of log |R(x)|) must be a finite real, got {log_count!r}")
    return -float(log_count)


def rejection_acceptance(cnf: CNF, log_q: torch.Tensor, beta: float = SQRT_E,
                         log_count: float | None = None) -> torch.Tensor:
    """Acceptance probability of every assignment in Theorem 5.13's rejection step: ``[2^m]`` float64.

    ``0`` outside ``R(x)``; ``min(1, p(y | x) / (beta q(y)))`` on ``R(x)``, where ``q = exp(log_q)`` is the
    proposal's law (``1`` where ``q(y) = 0``: such ``y`` is never proposed).
    """
    beta = _check_rejection_args(beta, 1)
    if log_q.shape != (2**cnf.m,):
        raise MalformedSequenceError(f"log_q must have shape [2^m] = [{2**cnf.m}], got {tuple(log_q.shape)}")
    if torch.isnan(log_q).any():
        raise MalformedSequenceError("log_q has NaN entries")
    log_ratio = _log_p_target(cnf, log_count) - math.log(beta) - log_q.to(_DTYPE)  # +inf where q = 0
    acc = torch.exp(log_ratio.clamp(max=0.0))
    return torch.where(cnf.satisfied, acc, torch.zeros_like(acc))


def rejection_log_law(cnf: CNF, model: WeakCoT, T: int, beta: float = SQRT_E, trials: int = 16,
                      log_count: float | None = None, proposal_log_law: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``log out(y)`` for all ``2^m`` assignments: Theorem 5.13's rejection step on the Lemma-5.11 sampler, exact.

    The proposal is ``q_T`` (:func:`sampler_log_law`, or ``proposal_log_law`` if given); one trial accepts ``y``
    with probability :func:`rejection_acceptance`; at most ``trials`` trials, then the last proposal is returned:
    ``out(y) = a(y) (1 - (1 - A)^N) / A + (1 - A)^{N-1} (q(y) - a(y))`` with ``a = q * acceptance``,
    ``A = sum a`` (module docstring). Compare with :func:`total_variation`.
    """
    beta = _check_rejection_args(beta, trials)
    _check_T(T)
    log_q = sampler_log_law(cnf, model, T) if proposal_log_law is None else proposal_log_law.to(_DTYPE)
    acc = rejection_acceptance(cnf, log_q, beta, log_count)
    q = log_q.exp()
    a = q * acc
    A = float(a.sum())
    miss = min(max(1.0 - A, 0.0), 1.0)  # A <= sum q = 1 up to rounding
    geometric = trials if A <= 0 else (1.0 - miss**trials) / A  # sum_{n < N} (1 - A)^n
    out = a * geometric + miss ** (trials - 1) * (q - a).clamp_min(0.0)
    return torch.log(out)


def rejection_sample(cnf: CNF, model: WeakCoT, T: int, n: int, beta: float = SQRT_E, trials: int = 16,
                     generator: torch.Generator | None = None, log_count: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``n`` outputs of Theorem 5.13's rejection step (the algorithm itself, vectorised over ``n``).

    Each trial draws ``y`` from ``q_T`` by :func:`sample` (fresh paths and consensus at every prefix), accepts it
    with probability ``min(1, p(y) / (beta q_T(y)))`` on ``R(x)`` (``q_T(y)`` from :func:`sampler_log_law`), and
    rows still waiting after ``trials`` trials keep their last proposal. Returns ``(y [n, m] int64,
    accepted [n] bool)``; the law of ``y`` is :func:`rejection_log_law`.
    """
    beta = _check_rejection_args(beta, trials)
    _check_T(T)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"rejection_sample needs a positive integer n, got {n!r}")
    acc_table = rejection_acceptance(cnf, sampler_log_law(cnf, model, T), beta, log_count)
    out = torch.zeros(n, cnf.m, dtype=torch.long, device=cnf.device)
    done = torch.zeros(n, dtype=torch.bool, device=cnf.device)
    for _ in range(trials):
        y, _ = sample(cnf, model, T, n, generator)
        u = torch.rand(n, generator=generator, dtype=_DTYPE, device=cnf.device)
        take = ~done
        out[take] = y[take]
        done = done | (u < acc_table[cnf.prefix_index(y)])
    return out, done


def sample(cnf: CNF, model: WeakCoT, T: int, n: int, generator: torch.Generator | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``n`` sequences from ``q_T``: at every prefix, ``T`` fresh paths, consensus (6), one token.

    Returns ``(y, log_prob)``: ``y`` is ``[n, m]`` int64 and ``log_prob[j] = sum_i log pi*_j(y_i | y_<i)``, the log
    probability of the drawn token under the (random) consensus used to draw it. Vectorised over ``n``;
    the loop is over the ``m`` positions.
    """
    _check_T(T)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"sample needs a positive integer n, got {n!r}")
    laws = _all_prefix_laws(cnf)  # path laws of every prefix, computed once; row 2^i - 1 + j is prefix j of length i
    lo, hi = model.good_interval(laws)
    bad = model.bad_value(laws)
    idx = torch.zeros(n, dtype=torch.long, device=cnf.device)
    log_prob = torch.zeros(n, dtype=_DTYPE, device=cnf.device)
    for i in range(cnf.m):
        row = idx + (2**i - 1)
        pi = coordinatewise_median(model.draw_paths(lo[row], hi[row], bad[row], T, generator))
        u = torch.rand(n, generator=generator, dtype=_DTYPE, device=cnf.device)
        y = (u < pi[:, 1]).long()
        log_prob = log_prob + torch.log(pi.gather(-1, y.unsqueeze(-1)).squeeze(-1))
        idx = 2 * idx + y
    shifts = torch.arange(cnf.m - 1, -1, -1, device=cnf.device)
    return (idx.unsqueeze(-1) >> shifts) & 1, log_prob


def count_by_sampling(cnf: CNF, model: WeakCoT, T: int, n: int, generator: torch.Generator | None = None,
                      max_draws: int = 1_000_000) -> torch.Tensor:
    """Estimates of ``log |R(x)|`` by counting = sampling: ``-sum_i log pi*(y_i | y_<i)`` along sampled solutions.

    Sequences are drawn from ``q_T`` (:func:`sample`) in batches until ``n`` of them satisfy the formula;
    with exact next-token laws (8) every estimate would equal ``log |R(x)|``. Returns ``[n]`` float64.
    Raises :class:`SamplingBudgetError` if ``max_draws`` sequences give fewer than ``n`` solutions.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"count_by_sampling needs a positive integer n, got {n!r}")
    kept: list[torch.Tensor] = []
    have, drawn = 0, 0
    while have < n:
        if drawn >= max_draws:
            raise SamplingBudgetError(
                f"count_by_sampling drew {drawn} sequences from q_{T} and only {have} of the {n} requested were "
                "solutions; raise max_draws or T")
        batch = min(max(2 * (n - have), 256), max_draws - drawn)
        y, log_prob = sample(cnf, model, T, batch, generator)
        ok = cnf.satisfied[cnf.prefix_index(y)]
        kept.append(-log_prob[ok])
        have += int(ok.sum())
        drawn += batch
    return torch.cat(kept)[:n]


def expected_log_count_error(cnf: CNF, log_q: torch.Tensor) -> float:
    """``E_{y ~ q | R(x)} |-log q(y) - log |R(x)||``: the counting error of the sampler's own next-token law, exact."""
    sat = cnf.satisfied
    lq = log_q[sat]
    w = torch.softmax(lq, dim=0)
    return float((w * (-lq - math.log(cnf.num_solutions)).abs()).sum())


@checked
def self_reducible_curve(T_values: Sequence[int], m: int = 12, alpha: float = 0.01, gamma: float = 0.25,
                         seed: int = 0, quick: bool = False, k: int = 3, clause_ratio: float = 3.0,
                         bad: str = "flip", num_formulas: int | None = None, n_count: int | None = None
                         ) -> dict[str, list]:
    """TV of the self-consistent sampler ``q_T`` to the uniform law over ``R(x)``, and the counting error, vs T.

    Averages over ``num_formulas`` random satisfiable k-CNFs (``round(clause_ratio * m)`` clauses, seeds
    ``seed, seed + 1, ...``; default 8, quick 2) under one :class:`WeakCoT`. ``tv`` is exact
    (:func:`sampler_log_law`); ``log_count_error`` is the mean of ``|estimate - log |R(x)||`` over ``n_count``
    solutions drawn by :func:`count_by_sampling` (default 2000, quick 500). Returns
    ``{"T": [...], "tv": [...], "log_count_error": [...]}``.
    """
    if isinstance(T_values, str | bytes) or getattr(T_values, "ndim", 1) != 1:
        raise ConfigError(f"T_values must be a 1-D list of positive integers, got {T_values!r}"[:300])
    if hasattr(T_values, "dtype"):
        checks.id_dtype("T_values", T_values.dtype)  # integers only: 2.5 reasoning paths is not 2
        T_values = T_values.tolist()
    Ts = []
    for i, T in enumerate(T_values):
        if getattr(T, "ndim", None) == 0 and hasattr(T, "dtype"):  # a 0-d integer tensor or array
            checks.id_dtype(f"T_values[{i}]", T.dtype)
            T = T.item()
        Ts.append(checks.integer(f"T_values[{i}] (a number of reasoning paths T)", T, 1))
    if not Ts:
        raise ConfigError("T_values is empty: name at least one number of reasoning paths T")
    model = WeakCoT(alpha, gamma, bad)
    num_formulas = num_formulas if num_formulas is not None else (2 if quick else 8)
    n_count = n_count if n_count is not None else (500 if quick else 2000)
    num_clauses = int(round(clause_ratio * m))
    tv = torch.zeros(len(Ts), dtype=_DTYPE)
    err = torch.zeros(len(Ts), dtype=_DTYPE)
    gen = torch.Generator().manual_seed(seed)
    for f in range(num_formulas):
        cnf = random_cnf(m, k, num_clauses, seed=seed + f)
        log_r = math.log(cnf.num_solutions)
        for j, T in enumerate(Ts):
            tv[j] += total_variation(cnf, sampler_log_law(cnf, model, T))
            est = count_by_sampling(cnf, model, T, n_count, gen)
            err[j] += (est - log_r).abs().mean()
    return {"T": Ts, "tv": (tv / num_formulas).tolist(), "log_count_error": (err / num_formulas).tolist()}
