"""Algorithm 1 (tokenwise rejection with backtracking), VGB and the exact SMC / weighted-rejection baselines
(thesis Ch. 3, Sections 3.2-3.3) against exact answers on enumerable tasks.

The LMs are Tabular tables, so every law is enumerable: the restricted distribution p(s) ~ 1(s in A) p_O(s),
the locally renormalised law of tokenwise rejection (Prop 3.1.2), and the law of Algorithm 1 as written,
enumerated branch by branch.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from test_verifiers import (
    ALPHABET,
    BITS,
    ONE,
    ZERO,
    chi2_pvalue,
    counts_of,
    dyck_task,
    has_a_zero,
    restricted,
    seq_log_prob,
    tokenwise_law,
    uniform_bits_lm,
)

from ppl_thought.errors import ConfigError, UnsatisfiableConstraintError
from ppl_thought.projections.automaton import AutomatonBuilder
from ppl_thought.verifiers import VGB, ProcessVerifier, TokenwiseBacktracking, TokenwiseRejection, VerifierSMC
from ppl_thought.verifiers.backtracking import TabularValue
from ppl_thought.vocab import PAD_ID


def algorithm1_law(lm, ver: ProcessVerifier, D: int, Q: int, B: int) -> dict[tuple[int, ...], float]:
    """The output law of Algorithm 1 enumerated as written (lines 2-14), branch by branch."""

    def p_next(s: tuple[int, ...]) -> dict[int, float]:
        return {t: math.exp(seq_log_prob(lm, s + (t,)) - seq_log_prob(lm, s)) for t in ALPHABET}

    def V(s: tuple[int, ...]) -> bool:
        return bool(ver(torch.tensor([list(s) + [PAD_ID] * (D - len(s))]))[0])

    out: dict[tuple[int, ...], float] = defaultdict(float)

    def go(s: tuple[int, ...], q: int, w: float) -> None:
        if len(s) == D:
            out[s] += w
            return
        for t, pt in p_next(s).items():
            s2 = s + (t,)
            if q > 0 and not V(s2):
                s3 = s2[: max(len(s2) - B, 0)]
                for _ in range(B):
                    if len(s3) == D:
                        break
                    nxt = p_next(s3)
                    s3 = s3 + (max(nxt, key=lambda a: (nxt[a], -a)),)  # argmax, lowest id among ties
                go(s3, q - 1, w * pt)
            else:
                go(s2, q, w * pt)

    go((), Q, 1.0)
    return dict(out)


def law_counts(z: torch.Tensor, law: dict) -> tuple[np.ndarray, np.ndarray]:
    keys = sorted(law)
    index = {s: j for j, s in enumerate(keys)}
    c = np.zeros(len(keys))
    for row in z.tolist():
        c[index[tuple(row)]] += 1  # a KeyError would be an output the algorithm cannot produce
    return c, np.array([law[k] for k in keys])


# ---------------------------------------------------------------------------------------------- Algorithm 1
@pytest.mark.parametrize("Q,B", [(0, 1), (1, 2), (2, 1)])
def test_algorithm1_samples_its_enumerated_law(Q, B):
    """The batched engine draws from the law of Algorithm 1 as written (chi-square against the enumeration);
    Q = 0 is plain sampling from the LM. The law with backtracking differs from the LM's: the engine run with
    the wrong quota fails the test."""
    lm, ver, A = dyck_task(4)
    law = algorithm1_law(lm, ver, 4, Q, B)
    assert abs(sum(law.values()) - 1) < 1e-9
    torch.manual_seed(10 + Q)
    res = TokenwiseBacktracking(3000, 4, quota=Q, stride=B).run(lm, ver)
    z = res.samples["z"]
    assert z.shape == (3000, 4)
    stat, pval = chi2_pvalue(*law_counts(z, law))
    assert pval > 1e-3, (stat, pval)
    # call accounting of Def 3.1.1 / 3.1.6: D sampled tokens + B greedy tokens per backtrack
    bt = res.stats["backtracks_per_sample"]
    assert (res.stats["lm_calls_per_sample"] <= 4 + bt * B).all() and (res.stats["lm_calls_per_sample"] >= 4).all()
    assert (bt <= Q).all() and res.stats["lm_calls"] == int(res.stats["lm_calls_per_sample"].sum())
    if Q == 0:
        assert res.stats["verifier_calls"] == 0
    else:
        wrong = algorithm1_law(lm, ver, 4, 0, B)  # plain sampling: measurably different from backtracking
        keys = sorted(set(law) | set(wrong))
        c = np.array([float((z == torch.tensor(k)).all(-1).sum()) for k in keys])
        _, pval_w = chi2_pvalue(c, np.array([wrong.get(k, 1e-12) for k in keys]))
        assert pval_w < 1e-6, pval_w


def test_algorithm1_backtracking_raises_accuracy():
    """With a perfect process verifier, backtracking lifts the fraction of outputs in A (the thesis's claim,
    Section 3.2.1.5) from the LM's P(A) to exactly the enumerated value for the given quota."""
    lm, ver, A = dyck_task(6)
    p_A = sum(math.exp(seq_log_prob(lm, s)) for s in A)
    torch.manual_seed(3)
    acc = {Q: float(ver.accepts(TokenwiseBacktracking(2000, 6, quota=Q, stride=2).run(lm, ver).samples["z"])
                    .float().mean()) for Q in (0, 4)}
    se = math.sqrt(0.25 / 2000)
    assert abs(acc[0] - p_A) < 4 * se, (acc, p_A)
    assert acc[4] > acc[0] + 10 * se, acc


# ---------------------------------------------------------------------------------------------- VGB
def test_vgb_leaves_follow_the_restricted_law_and_tokenwise_does_not():
    """Prop 3.1.2's task (uniform oracle, A = strings of length 3 with a 0): VGB's output (a uniformly drawn
    step, re-run if not a leaf) is uniform on A (chi-square), as its guarantee says; tokenwise rejection
    fails the same test (it gives 110 mass 1/4 instead of 1/7)."""
    D = 3
    lm, ver = uniform_bits_lm(), ProcessVerifier(has_a_zero(), D)
    A = [s for s in itertools.product([ZERO, ONE], repeat=D) if ZERO in s]
    uniform = np.full(len(A), 1 / len(A))
    torch.manual_seed(0)
    res = VGB(3000, D, num_steps=40).run(lm, ver)
    stat, pval = chi2_pvalue(counts_of(res.samples["z"], A), uniform)
    assert pval > 1e-3, (stat, pval)
    assert res.stats["backtracks"] > 0 and res.stats["lm_calls"] > 0
    torch.manual_seed(0)
    tok = TokenwiseRejection(3000, D).run(lm, ver).samples["z"]
    _, pval_t = chi2_pvalue(counts_of(tok, A), uniform)
    assert pval_t < 1e-8, pval_t


def test_tabular_value_is_the_probability_of_completion():
    """V*(y) by dynamic programming equals the enumerated P_O(y o Y in A) / P_O(y) on every prefix."""
    lm, ver, A = dyck_task(4)
    value = TabularValue(lm, ver)
    prefixes = [()] + [s[:i] for s in itertools.product(ALPHABET, repeat=4) for i in range(1, 5)]
    prefixes = sorted(set(prefixes))
    got = value(torch.tensor([list(y) + [PAD_ID] * (4 - len(y)) for y in prefixes]))
    for y, v in zip(prefixes, got.tolist()):
        num = sum(math.exp(seq_log_prob(lm, s)) for s in A if s[: len(y)] == y)
        assert abs(v - num / math.exp(seq_log_prob(lm, y))) < 1e-5, (y, v)


def test_vgb_is_exact_on_dyck_whatever_the_inner_values():
    """Property (3) of Section 3.3.1: with the exact outcome reward at the leaves, the leaves' stationary law is
    pi* whatever the values at inner nodes. Checked on Dyck with the exact value function and on Prop 3.1.2's
    task with arbitrary positive inner values: both pass a chi-square against the restricted law."""
    lm, ver, A = dyck_task(4)
    torch.manual_seed(1)
    res = VGB(1200, 4, num_steps=30).run(lm, TabularValue(lm, ver))
    stat, pval = chi2_pvalue(counts_of(res.samples["z"], A), restricted(lm, A))
    assert pval > 1e-3, (stat, pval)
    # leaves hold 1/(2H) of the stationary mass under V* (the walk's weight out of an inner node is 2 V*(y));
    # the draw at a uniform step of 30 is a leaf about 1 time in 10. Measured with the binary verifier as
    # value instead: about 37 re-runs per sample (leaves then hold only P(A)-proportional mass).
    assert float(res.stats["restarts_per_sample"].float().mean()) < 15

    D = 3
    bits, has0 = uniform_bits_lm(), ProcessVerifier(has_a_zero(), D)
    # arbitrary inner values (not V*): with these the walk mixes in 40 steps (the exact law of the node at a uniform
    # step <= 40, computed from the 15-node transition matrix: TV 0.003 from uniform on the leaves, leaf 12% of
    # steps), and a wrong walk moves the leaf law far (parent weight 1 instead of V(y): TV 0.31; children weighted
    # by pi alone: TV 0.24, each a chi-square excess of about 200 at 800 samples). The former values
    # [0.3, 5.0, 0.7, 2.0] needed 200 steps (7x the walk steps) and moved those wrong walks by a TV of 0.02 only.
    weights = torch.tensor([1.0, 0.3, 3.0, 0.5])

    def arbitrary(prefixes: torch.Tensor) -> torch.Tensor:
        n_tok = (prefixes != PAD_ID).sum(-1)
        inner = weights[(prefixes[:, 0] == ONE).long() * 2 + (n_tok % 2)]
        return torch.where(n_tok == D, has0.accepts(prefixes).float(), inner)

    B3 = [s for s in itertools.product([ZERO, ONE], repeat=D) if ZERO in s]
    torch.manual_seed(2)
    res = VGB(800, D, num_steps=40).run(bits, arbitrary)
    stat, pval = chi2_pvalue(counts_of(res.samples["z"], B3), np.full(len(B3), 1 / len(B3)))
    assert pval > 1e-3, (stat, pval)
    # the first-leaf variant (the thesis's empirical version) returns strings of A too
    first = VGB(100, 4, num_steps=60, output="first_leaf").run(lm, ver).samples["z"]
    assert ver.accepts(first).all()


def test_vgb_and_backtracking_refuse_bad_input():
    lm, ver, _ = dyck_task(4)
    with pytest.raises(ConfigError, match="output"):
        VGB(10, 4, 10, output="last")
    with pytest.raises(ConfigError, match="horizon"):
        VGB(10, 5, 10).run(lm, ver)
    with pytest.raises(ConfigError, match="quota"):
        TokenwiseBacktracking(10, 4, quota=-1)
    with pytest.raises(ConfigError, match="non-negative"):
        VGB(10, 4, 10).run(lm, lambda pre: -torch.ones(pre.shape[0]))
    b = AutomatonBuilder(len(BITS), "empty")
    b.add_state()
    with pytest.raises(UnsatisfiableConstraintError):
        VGB(10, 3, 10).run(uniform_bits_lm(), ProcessVerifier(b.build(), 3))


# ---------------------------------------------------------------------------------------------- SMC / AWRS
@pytest.mark.parametrize("proposal", ["lm", "masked", "rejection"])
def test_verifier_smc_is_properly_weighted(proposal):
    """SMC with the verifier as twist: the weighted particles' law is the restricted distribution (total
    variation below 0.04, averaged over 8 runs of 4000 particles; measured 0.007-0.016, where the
    unweighted tokenwise law is more than 0.1 away) and
    exp(log Z-hat) is unbiased for P_O(A) (mean of 30 runs within 3 standard errors). The AWRS-style weight
    1/(K-1) is what makes "rejection" unbiased: the naive 1/K fails the same check (measured: mean 0.78 x Z)."""
    lm, ver, A = dyck_task(6)
    p = restricted(lm, A)
    Z = sum(math.exp(seq_log_prob(lm, s)) for s in A)
    q = tokenwise_law(lm, A, ALPHABET)
    assert 0.5 * np.abs(q - p).sum() > 0.1
    index = {s: j for j, s in enumerate(A)}
    est = np.zeros(len(A))
    runs = 8
    for seed in range(runs):  # the law of the weighted particles, averaged over runs (SMC's own variance)
        torch.manual_seed(7 + seed)
        res = VerifierSMC(4000, 6, proposal=proposal).run(lm, ver)
        w = torch.softmax(res.log_weights, 0)
        z = res.samples["z"]
        alive = w > 0
        assert ver.accepts(z[alive]).all()
        for row, wi in zip(z[alive].tolist(), w[alive].tolist()):
            est[index[tuple(row)]] += wi / runs
    tv = 0.5 * np.abs(est - p).sum()
    assert tv < 0.04, tv
    zs = []
    for seed in range(30):
        torch.manual_seed(100 + seed)
        zs.append(math.exp(float(VerifierSMC(200, 6, proposal=proposal).run(lm, ver).log_marginal)))
    zs = np.array(zs)
    se = zs.std(ddof=1) / math.sqrt(len(zs))
    assert abs(zs.mean() - Z) < 3 * se + 1e-12, (zs.mean(), Z, se)
    if proposal == "masked":
        assert se < 0.02 * Z  # the locally optimal proposal: low variance


# ---------------------------------------------------------------------------------------------- the Dyck sandbox
def test_dyck_task_samples_and_completions_are_exact():
    """DyckTask strings are Dyck_{k,D} prefixes with the requested type law; completions() is every valid
    completion (checked against brute force over all 4^L strings)."""
    from ppl_thought.data import DyckTask

    task = DyckTask(k=2, D=2, N=8)
    z = task.sample(500, (0.9, 0.1), seed=0)
    full = ProcessVerifier(task.automaton, 8)
    assert full.accepts(z).all()
    opens = torch.tensor([o for o, _ in task.pairs])
    frac0 = float((z == opens[0]).sum() / torch.isin(z, opens).sum())
    assert abs(frac0 - 0.9) < 0.03
    prefix = task.sample(1, seed=3, length=3)[0].tolist()
    got = {tuple(c) for c in task.completions(prefix).tolist()}
    toks = [t for p in task.pairs for t in p]
    brute = {c for c in itertools.product(toks, repeat=5) if full.accepts(torch.tensor([prefix + list(c)]))[0]}
    assert got == brute and got


def test_nucleus_keeps_the_smallest_top_set():
    from ppl_thought.distributions.lm_state import nucleus

    lp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]]))
    out = nucleus(lp, 0.8).exp()
    assert torch.allclose(out[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(out[1], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(nucleus(lp, 1.0), lp)


def test_verifier_experiment_runs_on_a_tiny_model():
    """The experiment's comparison on an untrained tiny model: every method gives the keys, the exact baselines
    (smc, awrs) and tokenwise never leave Dyck, and plain sampling's TV is the largest."""
    from ppl_thought.data import DyckTask
    from ppl_thought.experiments.verifiers import METHODS, compare_methods, train_dyck_lm

    task = DyckTask(k=2, D=2, N=8)
    lm = train_dyck_lm(task, steps=5, batch=16)
    prompts = task.sample(1, (0.2, 0.8), length=4, seed=1)
    table, floor = compare_methods(lm, task, prompts, n=100)
    assert set(table) == set(METHODS) and 0 <= floor < 1
    for m in ("tokenwise", "smc", "awrs", "vgb"):
        assert table[m]["accuracy"] == pytest.approx(1.0), m
    assert table["sample"]["tv"] >= max(table[m]["tv"] for m in ("smc", "awrs"))
