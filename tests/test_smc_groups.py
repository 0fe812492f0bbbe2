"""Grouped SMC (``SMC(n, groups=G)``): G independent SMC runs batched into G*n rows.

Each group's Z-hat must be the estimate of a separate run on that group's data, (2.22) per group:
checked against the forward algorithm for G different HMM observation sequences (mean Z-hat/Z within
3 standard errors of 1 for every group, and the pooled log Z-hat against log Z), and a deliberately
wrong engine (resampling across groups with weights normalised over all rows) fails that very bound.
``groups=1`` is the plain engine (same numbers, same random stream).
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import ppl_thought as pt
from ppl_thought.errors import ConfigError, PPLThoughtError, ZeroWeightsError
from ppl_thought.inference import SMC
from ppl_thought.inference.resampling import resample
from ppl_thought.weights import log_mean_exp

A_ = torch.tensor([[0.7, 0.3, 0.0], [0.1, 0.6, 0.3], [0.4, 0.2, 0.4]])
B_ = torch.tensor([[0.9, 0.1], [0.3, 0.7], [0.5, 0.5]])
LAM = torch.tensor([0.5, 0.3, 0.2])
# G = 4 observation sequences of one length, with very different likelihoods (log Z from -2.5 to -5.0)
X = torch.tensor([[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0], [1, 0, 1, 0, 1, 1]])
N_PART, SEEDS = 16, 60


class GroupedHMM(pt.Program):
    """The HMM (Def 2.2) as a program over G observation sequences ``x [G, T]`` at once: row r of the
    particle plate explains sequence r // n (``pt.particle_groups()``); bootstrap proposal z_t ~ A."""

    def __init__(self, hmm: pt.models.HMM):
        self.hmm = hmm
        self.seen_groups: list[int] = []

    def init(self, state, x):
        self.seen_groups.append(pt.particle_groups())

    def step(self, state, t, x):
        n = pt.particles() // pt.particle_groups()
        xt = x[:, t].repeat_interleave(n, 0)  # [G * n]: the observation of each row's group
        logits = self.hmm.log_lam.expand(pt.particles(), -1) if t == 0 else self.hmm.log_A[state["z"]]
        z = pyro.sample(f"z_{t}", dist.Categorical(logits=logits))
        pyro.sample(f"x_{t}", dist.Categorical(logits=self.hmm.log_B[z]), obs=xt)
        state["z"] = z
        return torch.tensor(t == x.shape[1] - 1)


def hmm_program() -> tuple[GroupedHMM, torch.Tensor]:
    hmm = pt.models.HMM(A_, B_, LAM)
    return GroupedHMM(hmm), hmm.log_prob(X).double()  # exact log p(x) per group, forward algorithm (3.1)


class AcrossGroups(SMC):
    """A wrong grouped SMC: resamples all G*n rows together with weights normalised over all rows (the
    groups' estimates leak into each other)."""

    def _resample(self, lw, need, dev):
        idx = resample(torch.softmax(lw, 0), self.resampling, self.generator).to(dev)
        return idx, log_mean_exp(lw).expand(lw.shape[0]).clone()


def grouped_estimates(engine=SMC, seeds=range(SEEDS), **kw) -> torch.Tensor:
    """log Z-hat ``[seeds, G]`` of grouped runs."""
    model, _ = hmm_program()
    out = []
    for s in seeds:
        torch.manual_seed(s)
        g = torch.Generator().manual_seed(1000 + s)
        out.append(engine(N_PART, groups=len(X), generator=g, **kw).run(model, None, X).log_marginal.double())
    return torch.stack(out)


def within_bounds(log_z: torch.Tensor, exact: torch.Tensor) -> list[bool]:
    """Per group: mean Z-hat/Z within 3 SE of 1, and log of the pooled Z-hat within 3 SE (delta method) of
    log Z (the check of tests/test_program_matrix.py, per group)."""
    ok = []
    for g in range(log_z.shape[1]):
        ratio = torch.exp(log_z[:, g] - exact[g])
        m, se = float(ratio.mean()), float(ratio.std()) / math.sqrt(len(ratio))
        ok.append(abs(m - 1) <= 3 * se + 1e-6 and abs(math.log(m)) <= 3 * se / m + 1e-6)
    return ok


@pytest.mark.parametrize("scheme", ["systematic", "multinomial"])
def test_grouped_z_hat_is_each_groups_own_estimate(scheme):
    _, exact = hmm_program()
    log_z = grouped_estimates(resampling=scheme, ess_threshold=0.7)
    assert log_z.shape == (SEEDS, len(X)) and torch.isfinite(log_z).all()
    assert within_bounds(log_z, exact) == [True] * len(X)
    # the groups are different problems: their estimates are far apart, each near its own log Z
    assert (log_z.mean(0) - exact).abs().max() < 0.3 and float(exact.max() - exact.min()) > 2


def test_resampling_across_groups_fails_the_bound():
    _, exact = hmm_program()
    log_z = grouped_estimates(AcrossGroups, resampling="systematic", ess_threshold=0.7)
    assert not all(within_bounds(log_z, exact))
    assert (log_z.mean(0) - exact).abs().max() > 1  # the low-likelihood group borrows the others' weights


def test_grouped_equals_separate_runs_in_law_and_keeps_ancestors_in_their_group():
    """The grouped engine against G separate runs: the same estimator, so the same mean log Z-hat per
    group up to Monte Carlo error; and no ancestor ever crosses a group."""
    model, exact = hmm_program()
    grouped = grouped_estimates(resampling="stratified", ess_threshold=0.7, seeds=range(40))
    separate = []
    for s in range(40):
        torch.manual_seed(s)
        separate.append(torch.cat([SMC(N_PART, resampling="stratified", ess_threshold=0.7).run(
            model, None, X[g:g + 1]).log_marginal.double().view(1) for g in range(len(X))]))
    separate = torch.stack(separate)
    se = ((grouped.var(0) + separate.var(0)) / 40).sqrt()
    assert ((grouped.mean(0) - separate.mean(0)).abs() <= 4 * se + 1e-6).all()
    assert within_bounds(separate, exact) == [True] * len(X)
    torch.manual_seed(0)
    res = SMC(N_PART, groups=len(X), ess_threshold=0.7, resampling="stratified").run(model, None, X)
    rows = torch.arange(len(X) * N_PART)
    assert res.ancestry.shape == (X.shape[1], len(rows))
    assert torch.equal(res.ancestry // N_PART, (rows // N_PART).expand_as(res.ancestry))
    assert res.log_weights.shape == (len(X), N_PART) and res.log_marginal.shape == (len(X),)
    assert res.ess.shape == (len(X),) and res.normalized_weights.shape == (len(X), N_PART)
    assert res.samples["z_0"].shape == (len(X) * N_PART,)
    assert len(res.stats["ess"]) == X.shape[1] and all(len(e) == len(X) for e in res.stats["ess"])
    assert all(len(r) == len(X) for r in res.stats["resampled"])
    # a group that did not resample at a step keeps its rows
    for step, flags in enumerate(res.stats["resampled"]):
        for g, flag in enumerate(flags):
            if not flag:
                own = rows[g * N_PART:(g + 1) * N_PART]
                assert torch.equal(res.ancestry[step, g * N_PART:(g + 1) * N_PART], own)
    assert any(not all(f) and any(f) for f in res.stats["resampled"])  # some steps resample only some groups
    assert model.seen_groups[-1] == len(X)


def test_groups_one_is_the_plain_engine():
    model, _ = hmm_program()
    x = X[2:3]
    runs = []
    for kw in ({}, {"groups": 1}):
        torch.manual_seed(7)
        g = torch.Generator().manual_seed(8)
        runs.append(SMC(N_PART, ess_threshold=0.9, generator=g, **kw).run(model, None, x))
    a, b = runs
    assert torch.equal(a.log_weights, b.log_weights) and torch.equal(a.log_marginal, b.log_marginal)
    assert torch.equal(a.ancestry, b.ancestry) and a.stats["ess"] == b.stats["ess"]
    assert a.stats["resampled"] == b.stats["resampled"] and any(a.stats["resampled"])
    assert all(torch.equal(a.samples[k], b.samples[k]) for k in a.samples)
    assert a.log_weights.shape == (N_PART,) and a.log_marginal.shape == ()
    assert model.seen_groups[-2:] == [1, 1] and pt.particle_groups() == 1


@pytest.mark.parametrize("scheme", ["systematic", "stratified", "multinomial", "residual"])
def test_batched_resampling_offspring_means(scheme):
    g = torch.Generator().manual_seed(0)
    w = torch.softmax(torch.randn(3, 8, generator=g) * 2, -1)
    counts = torch.zeros(3, 8, dtype=torch.float64)
    reps = 3000
    for _ in range(reps):
        idx = resample(w, scheme, g)
        assert idx.shape == (3, 8) and int(idx.min()) >= 0 and int(idx.max()) < 8
        counts += torch.nn.functional.one_hot(idx, 8).sum(1)
    assert torch.allclose(counts / reps, 8 * w.double(), atol=0.1)


def test_groups_errors():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="groups must be a positive int|parameter groups="):
            SMC(4, groups=bad)
    assert issubclass(ConfigError, PPLThoughtError) and issubclass(ConfigError, ValueError)

    class DeadGroup(pt.Program):
        def step(self, state, t, x):
            n = pt.particles() // pt.particle_groups()
            dead = (torch.arange(pt.particles()) // n) == 2
            pyro.factor(f"x_{t}", torch.where(dead, torch.tensor(float("-inf")), torch.tensor(0.0)))
            return torch.tensor(True)

    with pytest.raises(ZeroWeightsError, match="group 2 "):
        SMC(4, groups=3).run(DeadGroup(), None, X[:3])
