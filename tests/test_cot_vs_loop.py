"""cot-or-loop: the looped Transformer (Section 4), Theorem 5.13's rejection step (Appendix D.3), the experiment."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from scipy import stats

import ppl_thought as pt
import ppl_thought.data.self_reducible as sr
from ppl_thought.data.self_reducible import (
    SQRT_E,
    WeakCoT,
    random_cnf,
    rejection_acceptance,
    rejection_log_law,
    rejection_sample,
    sampler_log_law,
    total_variation,
)
from ppl_thought.errors import ConfigError, MalformedSequenceError, PPLThoughtError
from ppl_thought.lm.looped import Looped

# ---------------------------------------------------------------------------------------------- Looped


def _model(causal: bool = False, n_layers: int = 1) -> Looped:
    torch.manual_seed(0)
    return Looped(7, d_model=32, n_layers=n_layers, n_heads=2, max_len=12, causal=causal).double()


def test_exported():
    assert pt.lm.Looped is Looped


@pytest.mark.parametrize("n_layers", [1, 2])
def test_one_loop_is_one_plain_application_of_the_stack(n_layers):
    m = _model(n_layers=n_layers)
    x = torch.randint(0, 7, (3, 10), generator=torch.Generator().manual_seed(1))
    e = m.embed(x) + m.pos.weight[:10]
    cos, sin = m.rope_cos[:10], m.rope_sin[:10]
    h = e
    for block in m.blocks:  # one pass of the stack, written out with the library's Block
        h = block(h, cos, sin, None, False, sr_nocache(), None)
    want = m.lm_head(m.norm(h))
    assert torch.equal(m(x, 1), want)
    assert torch.equal(m.hidden(x, 1), h)


def sr_nocache():
    from ppl_thought.lm.looped import _NoCache
    return _NoCache


def test_loops_apply_the_same_stack_with_the_input_injected():
    m = _model()
    x = torch.randint(0, 7, (2, 9), generator=torch.Generator().manual_seed(2))
    e = m.embed_input(x)
    h = m.step(e)
    for _ in range(3):
        h = m.step(h + e)
    assert torch.equal(m.hidden(x, 4), h)
    # without the injection the states differ: the injected input is used
    no_inj = m.step(m.step(m.step(m.step(e))))
    assert torch.equal(m.hidden(x, 4, inject=False), no_inj)
    assert (m.hidden(x, 4) - no_inj).abs().max() > 1e-3


def test_input_injection_carries_the_input_to_later_loops():
    """Changing the injected input of a later loop changes the output: a model that ignored the injection would
    give ``f^T(e)`` from ``h_1`` alone, and this difference would be zero."""
    m = _model()
    x = torch.randint(0, 7, (2, 9), generator=torch.Generator().manual_seed(3))
    e = m.embed_input(x)
    h1 = m.step(e)
    e2 = e + 0.5 * torch.randn(e.shape, generator=torch.Generator().manual_seed(4), dtype=e.dtype)
    assert (m.step(h1 + e) - m.step(h1 + e2)).abs().max() > 1e-3
    # the gradient of the T-loop output reaches the embedding through every loop's injection
    m.zero_grad()
    m.hidden(x, 3).sum().backward()
    g_inj = m.pos.weight.grad.clone()
    m.zero_grad()
    m.hidden(x, 3, inject=False).sum().backward()
    assert (g_inj - m.pos.weight.grad).abs().max() > 1e-6


def test_causal_looped_is_causal_and_T_changes_the_output():
    m = _model(causal=True)
    x = torch.randint(0, 7, (2, 8), generator=torch.Generator().manual_seed(5))
    y = x.clone()
    y[:, 5:] = (y[:, 5:] + 1) % 7
    assert torch.allclose(m(x, 2)[:, :5], m(y, 2)[:, :5], atol=1e-12)
    assert (m(x, 1) - m(x, 3)).abs().max() > 1e-6
    m2 = _model(causal=False)
    assert (m2(x, 2)[:, :5] - m2(y, 2)[:, :5]).abs().max() > 1e-6  # full attention sees the future


def test_looped_bad_input():
    m = _model()
    with pytest.raises(PPLThoughtError, match="T"):
        m(torch.zeros(1, 3, dtype=torch.long), 0)
    with pytest.raises(MalformedSequenceError, match="max_len"):
        m(torch.zeros(1, 13, dtype=torch.long), 1)
    with pytest.raises(PPLThoughtError, match="vocabulary"):
        m(torch.full((1, 3), 7, dtype=torch.long), 1)
    with pytest.raises(MalformedSequenceError, match="LongTensor"):
        m(torch.zeros(3, dtype=torch.long), 1)
    with pytest.raises(ConfigError, match="d_model"):
        Looped(5, d_model=30, n_heads=4)


# ------------------------------------------------------------------------- Theorem 5.13's rejection step


def _enumerated_q(cnf, model, T):
    """q_T(y) of every assignment: the product along y of the sampler's next-token law, one prefix at a time."""
    laws = {}
    for i in range(cnf.m):
        for prefix in itertools.product((0, 1), repeat=i):
            p = cnf.relative_counts(torch.tensor(prefix, dtype=torch.long), dead="uniform")
            laws[prefix] = model.consensus_mean(p, T).tolist()
    q = {}
    for y in itertools.product((0, 1), repeat=cnf.m):
        prob = 1.0
        for i in range(cnf.m):
            prob *= laws[y[:i]][y[i]]
        q[y] = prob
    return q


def _enumerated_law(cnf, q, beta, trials, rule):
    """The algorithm of Appendix D.3 run symbolically, in plain Python over all assignments and trials.

    ``rule(q, p, beta)`` is the acceptance probability of a proposed solution. Trial n is reached with probability
    ``wait``; it returns y if y is accepted, and the last trial returns its proposal either way.
    """
    p = 1.0 / cnf.num_solutions
    acc = {y: (rule(q[y], p, beta) if bool(cnf.satisfied[cnf.prefix_index(list(y))]) else 0.0) for y in q}
    out = dict.fromkeys(q, 0.0)
    wait = 1.0
    for n in range(trials):
        for y in q:
            out[y] += wait * q[y] * acc[y]
            if n == trials - 1:
                out[y] += wait * q[y] * (1.0 - acc[y])
        wait *= 1.0 - sum(q[y] * acc[y] for y in q)
    return torch.tensor([out[y] for y in itertools.product((0, 1), repeat=cnf.m)], dtype=torch.float64)


def THEOREM(q, p, beta):  # accept with probability p(y) / (beta pi(y)), clipped at 1
    return min(1.0, p / (beta * q)) if q > 0 else 1.0


WRONG_RULES = {
    "accept every solution": lambda q, p, beta: 1.0,
    "ratio inverted": lambda q, p, beta: min(1.0, q / (beta * p)),
    "no beta": lambda q, p, beta: min(1.0, p / q),
}


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_law_matches_the_algorithm_enumerated(seed):
    cnf = random_cnf(6, 3, 8, seed=seed)
    assert cnf.num_solutions >= 10
    model = WeakCoT(0.05, 0.2)
    for T, trials in ((1, 1), (5, 4)):
        want = _enumerated_law(cnf, _enumerated_q(cnf, model, T), SQRT_E, trials, THEOREM)
        got = rejection_log_law(cnf, model, T, trials=trials).exp()
        assert torch.allclose(got, want, atol=1e-12, rtol=0)
        assert abs(float(got.sum()) - 1) < 1e-12
    # the enumerated laws of wrong acceptance rules are far from it: an implementation using one fails above
    q5 = _enumerated_q(cnf, model, 5)
    for name, rule in WRONG_RULES.items():
        wrong = _enumerated_law(cnf, q5, SQRT_E, 4, rule)
        assert (wrong - want).abs().max() > 1e-3, name


@pytest.mark.parametrize("name", list(WRONG_RULES))
def test_a_wrong_acceptance_rule_fails_the_enumeration_check(monkeypatch, name):
    cnf = random_cnf(6, 3, 8, seed=0)
    model = WeakCoT(0.05, 0.2)
    want = _enumerated_law(cnf, _enumerated_q(cnf, model, 5), SQRT_E, 4, THEOREM)
    rule = WRONG_RULES[name]

    def wrong_acceptance(cnf, log_q, beta=SQRT_E, log_count=None):
        q = log_q.exp().tolist()
        p = 1.0 / cnf.num_solutions
        acc = [rule(qi, p, beta) if (s and qi > 0) else (1.0 if s else 0.0) for qi, s in
               zip(q, cnf.satisfied.tolist(), strict=True)]
        return torch.tensor(acc, dtype=torch.float64)

    monkeypatch.setattr(sr, "rejection_acceptance", wrong_acceptance)
    got = sr.rejection_log_law(cnf, model, 5, trials=4).exp()
    assert not torch.allclose(got, want, atol=1e-6, rtol=0)


def test_acceptance_rule_by_hand():
    cnf = pt.data.CNF([[1, 2]], 2)  # solutions 01, 10, 11; p = 1/3
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    acc = rejection_acceptance(cnf, q.log(), beta=2.0)
    want = torch.tensor([0.0, min(1, (1 / 3) / (2 * 0.2)), min(1, (1 / 3) / (2 * 0.3)), min(1, (1 / 3) / (2 * 0.4))],
                        dtype=torch.float64)
    assert torch.allclose(acc, want, atol=1e-15)
    # q(y) = 0: never proposed, acceptance 1 (no NaN); outside R(x): 0
    acc0 = rejection_acceptance(cnf, torch.tensor([0.0, 0.0, 0.5, 0.5], dtype=torch.float64).log())
    assert acc0.tolist()[:2] == [0.0, 1.0] and not torch.isnan(acc0).any()


def test_inside_the_beta_band_the_accepted_part_is_exactly_uniform():
    """(67): if every solution has q(y) >= p(y) / beta, each is accepted with probability 1 / (beta |R|) per trial,
    so out(y) is the same on every solution; with enough trials TV is the fallback mass only."""
    cnf = random_cnf(6, 3, 14, seed=3)
    log_q = sampler_log_law(cnf, WeakCoT(1e-4, 0.45), 33)
    ratio = (log_q[cnf.satisfied] + math.log(cnf.num_solutions)).exp()
    assert float(ratio.min()) >= 1 / SQRT_E  # the premise (66) holds here
    for trials in (1, 3, 30):
        out = rejection_log_law(cnf, WeakCoT(1e-4, 0.45), 33, trials=trials).exp()
        A = 1 / SQRT_E * float(ratio.numel()) / cnf.num_solutions
        accepted = (1 - (1 - A) ** trials) / A / (SQRT_E * cnf.num_solutions)
        fallback = (1 - A) ** (trials - 1) * (log_q.exp() - log_q.exp() * rejection_acceptance(cnf, log_q))
        assert torch.allclose(out, accepted * cnf.satisfied + fallback, atol=1e-14)
    assert total_variation(cnf, rejection_log_law(cnf, WeakCoT(1e-4, 0.45), 33, trials=30)) < 1e-9


def _chi2_pvalue(law, counts, n):
    keep = law * n >= 5
    obs, exp = counts[keep], law[keep] * n
    if (law[~keep] > 0).any():
        obs = torch.cat([obs, counts[~keep].sum().unsqueeze(0)])
        exp = torch.cat([exp, (law[~keep] * n).sum().unsqueeze(0)])
    return stats.chisquare(obs.numpy(), exp.numpy() * float(obs.sum()) / float(exp.sum())).pvalue


def test_rejection_sampler_draws_follow_the_exact_law():
    cnf = random_cnf(5, 3, 12, seed=1)
    model = WeakCoT(0.05, 0.2)
    law = rejection_log_law(cnf, model, 3, trials=2).exp()
    n = 20_000
    y, accepted = rejection_sample(cnf, model, 3, n, trials=2, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(cnf.prefix_index(y), minlength=32).double()
    assert _chi2_pvalue(law, counts, n) > 1e-3
    # rejected-to-the-end rows are exactly the fallback mass (1 - A)^N
    a = (sampler_log_law(cnf, model, 3).exp() * rejection_acceptance(cnf, sampler_log_law(cnf, model, 3))).sum()
    miss = float((1 - a) ** 2)
    assert abs(float((~accepted).double().mean()) - miss) < 4 * math.sqrt(miss * (1 - miss) / n)


def test_rejection_sampler_with_a_wrong_rule_fails_the_chi_square(monkeypatch):
    """The chi-square test above has power: a sampler accepting every solution fails it."""
    cnf = random_cnf(5, 3, 12, seed=1)
    model = WeakCoT(0.05, 0.2)
    law = rejection_log_law(cnf, model, 3, trials=2).exp()
    monkeypatch.setattr(sr, "rejection_acceptance", lambda cnf, log_q, beta, log_count: cnf.satisfied.double())
    n = 20_000
    y, _ = sr.rejection_sample(cnf, model, 3, n, trials=2, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(cnf.prefix_index(y), minlength=32).double()
    assert _chi2_pvalue(law, counts, n) < 1e-6


def test_rejection_step_removes_the_lemma_5_11_floor():
    """At the largest T the Lemma-5.11 sampler has levelled off at its O(sqrt(alpha)) floor; Theorem 5.13's
    rejection step on top of it is far below that floor (the setting of self_reducible_curve)."""
    model = WeakCoT(0.01, 0.25)
    for seed in (0, 1):
        cnf = random_cnf(12, 3, 36, seed=seed)
        floor = total_variation(cnf, sampler_log_law(cnf, model, 33))
        assert floor > 0.04  # the floor: it does not go to zero with T
        assert abs(floor - total_variation(cnf, sampler_log_law(cnf, model, 129))) < 0.01
        thm = total_variation(cnf, rejection_log_law(cnf, model, 33, trials=16))
        assert thm < floor / 100
        # one trial is the proposal itself: no improvement
        assert abs(total_variation(cnf, rejection_log_law(cnf, model, 33, trials=1)) - floor) < 1e-12


def test_log_count_estimate_and_bad_input():
    cnf = random_cnf(6, 3, 14, seed=0)
    model = WeakCoT(0.01, 0.25)
    exact = rejection_log_law(cnf, model, 9, trials=8)
    same = rejection_log_law(cnf, model, 9, trials=8, log_count=math.log(cnf.num_solutions))
    assert torch.equal(exact, same)
    assert not torch.isnan(rejection_log_law(cnf, model, 9, trials=8, log_count=math.log(2 * cnf.num_solutions))).any()
    with pytest.raises(ConfigError, match="beta"):
        rejection_log_law(cnf, model, 3, beta=0.5)
    with pytest.raises(ConfigError, match="trials"):
        rejection_log_law(cnf, model, 3, trials=0)
    with pytest.raises(ConfigError, match="log_count"):
        rejection_log_law(cnf, model, 3, log_count=float("nan"))
    with pytest.raises(ConfigError, match="T"):
        rejection_log_law(cnf, model, 0)
    with pytest.raises(MalformedSequenceError, match="log_q"):
        rejection_acceptance(cnf, torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ConfigError, match="n"):
        rejection_sample(cnf, model, 3, 0)


# --------------------------------------------------------------------------------------------- experiment


@pytest.mark.parametrize("depth, trees", [(3, 1), (2, 2)])
def test_tree_task_labels_are_exact(depth, trees):
    from ppl_thought.experiments.cot_vs_loop import TreeTask
    task = TreeTask(depth=depth, k=4, seed=0, trees=trees)
    nodes = task.sample(50, torch.Generator().manual_seed(0))
    f = task.table.tolist()
    n = trees * 2**depth
    for row in nodes.tolist():
        level = row[:n]
        expect = []
        while len(level) > trees:
            level = [f[level[i]][level[i + 1]] for i in range(0, len(level), 2)]
            expect += level
        assert row[n:] == expect
    assert (task.table != task.table[:, :1]).any(1).all() and (task.table != task.table[:1]).any(0).all()
    x = task.cot_sequence(nodes, 2)
    assert x.shape == (50, n + 2 + trees) and torch.equal(x[:, -trees:], nodes[:, -trees:])
    assert torch.equal(x[:, n:n + 2], nodes[:, n:n + 2])
    with pytest.raises(ConfigError, match="T"):
        task.cot_sequence(nodes, task.max_thoughts + 1)
    assert (task.loop_input(nodes)[:, n:] == task.pad).all()


def test_tiny_run_writes_the_json_schema(tmp_path):
    from ppl_thought.experiments import cot_vs_loop
    cfg = cot_vs_loop.CotVsLoopConfig(T_values=[1, 3], steps=3, batch=8, num_test=16, d_model=16, n_heads=2,
                                      sampling_T=[1, 5], m=6, num_formulas=1, trials=4)
    out = tmp_path / "r.json"
    orig = cot_vs_loop.CotVsLoopConfig.quick
    try:
        cot_vs_loop.CotVsLoopConfig.quick = classmethod(lambda cls: cfg)
        assert cot_vs_loop.main(["--quick", "--json", str(out)]) == 0
    finally:
        cot_vs_loop.CotVsLoopConfig.quick = orig
    res = json.loads(out.read_text())
    for kind in ("loop", "cot"):
        assert set(res["parallel"][kind]) == {"1", "3"}
        assert all(0 <= v <= 1 for v in res["parallel"][kind].values())
    assert res["parallel"]["params"]["loop"] == res["parallel"]["params"]["cot"]
    for key in ("lemma_5_11", "thm_5_13"):
        assert set(res["sampling"][key]) == {"1", "5"}
        assert all(0 <= v <= 1 for v in res["sampling"][key].values())
    assert isinstance(res["seconds"], float) and isinstance(res["commit"], str) and res["commit"]
