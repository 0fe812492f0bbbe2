"""The coding experiment of Section 6.3 and its remedies (issue 30, item 4), against exact answers: Huffman's
expected length, (6.12) on hand cases, the prefix-freeness checker, H(X | Z_<=t) by enumeration, the exact
posterior decoder against marginalisation, the entropy-annealing gradient against the enumerated gradient, the
restart selection by the training objective."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from ppl_thought.errors import ConfigError, PPLThoughtError
from ppl_thought.experiments.active_coding import (
    CodingConfig,
    code_objective,
    conditional_entropies,
    entropy_surrogate,
    entropy_weight,
    exact_log_posterior,
    greedy_codes,
    huffman_code,
    is_prefix_free,
    run_active_coding,
    select_restart,
    summarize_variant,
)
from ppl_thought.lm import Transformer
from ppl_thought.transforms.active import ActiveLift
from ppl_thought.vocab import Vocab


def _h(*p: float) -> float:
    return float(-sum(x * math.log2(x) for x in p if x > 0))


def _expected_length(p, codes) -> float:
    return float(np.dot(p, [len(c) for c in codes]))


# ---------------------------------------------------------------------------------------------- codes
def test_huffman_expected_length_hand_cases():
    # dyadic: Huffman = the Shannon lengths -log2 p, expected length = entropy
    p = np.array([0.5, 0.25, 0.125, 0.125])
    assert sorted(len(c) for c in huffman_code(p)) == [1, 2, 3, 3]
    assert _expected_length(p, huffman_code(p)) == pytest.approx(1.75)
    # the textbook case: 2.2 bits whichever tie is broken; Shannon's ceil(-log2 p) code gives 2.8 (a wrong coder)
    p = np.array([0.4, 0.2, 0.2, 0.1, 0.1])
    codes = huffman_code(p)
    assert is_prefix_free(codes) and _expected_length(p, codes) == pytest.approx(2.2)
    shannon = float(np.dot(p, np.ceil(-np.log2(p))))
    assert shannon == pytest.approx(2.8) and abs(shannon - 2.2) > 0.5
    with pytest.raises(ConfigError, match="p must be"):
        huffman_code(np.array([1.0]))


def test_code_objective_hand_cases():
    p = np.array([0.6, 0.3, 0.1])
    # t = 0: H(P_*); t = 1: only the prefix "1" is ambiguous (mass 0.4, split 0.75 / 0.25); t = 2: none
    expected = _h(0.6, 0.3, 0.1) + 0.4 * _h(0.75, 0.25)
    assert code_objective(p, ["0", "10", "11"]) == pytest.approx(expected, abs=1e-12)
    # another tree on the same P_*: the likely symbol deep costs more
    assert code_objective(p, ["11", "10", "0"]) == pytest.approx(_h(0.6, 0.3, 0.1) + 0.9 * _h(2 / 3, 1 / 3))
    assert code_objective(np.array([0.5, 0.5]), ["0", "1"]) == pytest.approx(1.0)


def test_prefix_freeness_checker():
    assert is_prefix_free(["0", "10", "11"])
    assert is_prefix_free(["00", "01", "1"])
    assert not is_prefix_free(["0", "01"])  # a word is a prefix of another
    assert not is_prefix_free(["01", "0"])  # in either order
    assert not is_prefix_free(["1", "1"])  # equal words
    assert not is_prefix_free(["", "0"])  # the empty word prefixes everything


# ---------------------------------------------------------------------------------------------- H(X | Z) by enumeration
def _table(words: list[str], T: int) -> torch.Tensor:
    """Q(z | x) of a deterministic encoder z(x) = word padded with 0s to length T, as an [N, 2^T] table."""
    q = torch.zeros(len(words), 2 ** T, dtype=torch.float64)
    for i, w in enumerate(words):
        q[i, int(w.ljust(T, "0"), 2)] = 1.0
    return q


def test_conditional_entropies_of_a_deterministic_code_equal_612():
    rng = np.random.default_rng(1)
    p = rng.uniform(size=6)
    p /= p.sum()
    codes = huffman_code(p)
    T = max(len(c) for c in codes) + 1
    ce = conditional_entropies(_table(codes, T), p)
    assert len(ce) == T + 1 and ce[0] == pytest.approx(_h(*p))
    # for a prefix-free code, padding with 0s (not blanks) leaves every term of (6.12) unchanged
    assert sum(ce) == pytest.approx(code_objective(p, codes), abs=1e-12)
    assert ce[-1] == pytest.approx(0.0, abs=1e-12)
    # a code with a collision: x0 and x1 share a word; H(X | Z_<=T) is what is left of their split
    collide = [codes[1]] + codes[1:]
    ce = conditional_entropies(_table(collide, T), p)
    pa, pb = p[0], p[1]
    assert ce[-1] == pytest.approx((pa + pb) * _h(pa / (pa + pb), pb / (pa + pb)), abs=1e-12)


def test_conditional_entropies_of_a_noisy_channel():
    # N = 2, T = 1, uniform P_*, Q flips the bit with probability e: H(X | Z_1) = h(e) (a binary symmetric channel)
    for e in (0.0, 0.1, 0.3, 0.5):
        q = torch.tensor([[1 - e, e], [e, 1 - e]], dtype=torch.float64)
        ce = conditional_entropies(q, np.array([0.5, 0.5]))
        assert ce == pytest.approx([1.0, _h(e, 1 - e)], abs=1e-12)
    # Q independent of x: nothing is learned at any t
    q = torch.full((3, 4), 0.25, dtype=torch.float64)
    p = np.array([0.2, 0.3, 0.5])
    assert conditional_entropies(q, p) == pytest.approx([_h(*p)] * 3, abs=1e-12)
    with pytest.raises(ConfigError, match=r"\[N, 2\^T\]"):
        conditional_entropies(torch.ones(2, 3), np.array([0.5, 0.5]))


def test_greedy_codes_hand_case():
    T = 2
    q = torch.zeros(3, 4, dtype=torch.float64)
    q[0] = torch.tensor([0.9, 0.1, 0.0, 0.0])  # x0 -> "00"
    q[1] = torch.tensor([0.1, 0.6, 0.3, 0.0])  # x1 -> "0" first (0.7), then "01"
    q[2] = torch.tensor([0.0, 0.2, 0.5, 0.3])  # x2 -> "1" (0.8), then "10"
    greedy, codes, mass = greedy_codes(q)
    assert greedy == ["00", "01", "10"]
    assert codes == ["00", "01", "1"]  # x2's first token already tells it apart
    assert mass == pytest.approx([0.9, 0.6, 0.8])
    assert T == 2


# ---------------------------------------------------------------------------------------------- a tiny lift
def _lift(N: int, T: int, seed: int = 0) -> tuple[ActiveLift, torch.Tensor]:
    torch.manual_seed(seed)
    vocab = Vocab(["0", "1"] + [f"x{i}" for i in range(N)])
    lm = Transformer(len(vocab), d_model=16, n_layers=1, n_heads=2, max_len=T + 4)
    with torch.no_grad():
        for name, prm in lm.named_parameters():
            if not name.endswith("norm.weight"):
                prm.normal_(0.0, 1.0)  # a Q that depends on x (as in the experiment)
    lift = ActiveLift(lm, vocab, latent_len=T, latent_tokens=["0", "1"], max_x_len=1)
    return lift, torch.tensor([[vocab.id(f"x{i}")] for i in range(N)])


def _all_z(lift: ActiveLift) -> torch.Tensor:
    omega = lift.omega.nonzero().flatten().tolist()
    return torch.tensor(list(itertools.product(omega, repeat=lift.latent_len)), dtype=torch.long)


def test_exact_posterior_decoder_against_marginalisation():
    N, T = 3, 3
    lift, x_ids = _lift(N, T)
    p_star = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    zs = _all_z(lift)  # [8, T]
    with torch.no_grad():
        # Q(z | x) of whole sequences, then Q(z_<=t | x) by summing the completions (no per-token product used)
        full = torch.stack([lift.sampler_log_probs(zs, x_ids[i:i + 1].expand(len(zs), 1)).sum(-1) for i in range(N)])
        full = full.double().exp()  # [N, 8]
        B = len(zs) * N
        z = zs.repeat(N, 1)
        xi = torch.arange(N).repeat_interleave(len(zs))
        got = exact_log_posterior(lift, z, xi, x_ids, p_star.log().float()).double()  # [B, T + 1]
    assert got.shape == (B, T + 1) and torch.isfinite(got).all()
    for t in range(T + 1):
        pref = full.view(N, 2 ** t, 2 ** (T - t)).sum(-1)  # [N, prefixes]
        post = p_star[:, None] * pref / (p_star[:, None] * pref).sum(0, keepdim=True)
        idx = torch.tensor([int("".join(str(int(b == zs.max())) for b in row[:t]) or "0", 2) for row in z])
        want = post[xi, idx].log()
        assert torch.allclose(got[:, t], want, atol=2e-5), t
    assert torch.allclose(got[:, 0], p_star[xi].log(), atol=1e-6)  # t = 0: the prior P_*
    # a decoder that forgets P_* (uniform prior over the symbols) is a different posterior: the check can fail
    wrong = exact_log_posterior(lift, z, xi, x_ids, torch.full((N,), -math.log(N))).double()
    assert (wrong[:, T] - got[:, T]).abs().max() > 0.1


def test_exact_decoder_value_is_the_610_objective():
    """The exact decoder's Monte-Carlo value sum_t E[-log P_*(x | Z_<=t)] estimates (6.10) of the enumeration."""
    N, T = 3, 3
    lift, x_ids = _lift(N, T, seed=2)
    p_star = np.array([0.5, 0.3, 0.2])
    zs = _all_z(lift)
    with torch.no_grad():
        q = torch.stack([lift.sampler_log_probs(zs, x_ids[i:i + 1].expand(len(zs), 1)).sum(-1) for i in range(N)])
        exact = sum(conditional_entropies(q.double().exp(), p_star)) * math.log(2)  # nats
        n = 4000
        torch.manual_seed(0)
        z = lift.sampler(x_ids).sample((n,)).reshape(n * N, T)
        xi = torch.arange(N).repeat(n)
        lp = exact_log_posterior(lift, z, xi, x_ids, torch.as_tensor(p_star).log().float())
        per_x = (-lp.sum(-1)).view(n, N).double()
    est = float((torch.as_tensor(p_star) * per_x.mean(0)).sum())
    se = float(torch.sqrt((torch.as_tensor(p_star) ** 2 * per_x.var(0) / n).sum()))
    assert abs(est - exact) < 4 * se + 1e-6
    # without the P_*-weighting of the average, the estimate is off by far more than its error
    assert abs(float(per_x.mean()) - exact) > 10 * se


# ---------------------------------------------------------------------------------------------- entropy annealing
def test_entropy_weight_schedule():
    assert entropy_weight(1, 100, 2.0, 0.5) == 2.0
    assert entropy_weight(26, 100, 2.0, 0.5) == pytest.approx(1.0)
    assert entropy_weight(51, 100, 2.0, 0.5) == 0.0 and entropy_weight(100, 100, 2.0, 0.5) == 0.0
    w = [entropy_weight(s, 100, 1.0, 0.5) for s in range(1, 101)]
    assert all(b <= a for a, b in zip(w, w[1:]))


def test_entropy_surrogate_gradient_is_unbiased():
    """grad of -beta sum_x P_*(x) H(Q(. | x)) by enumeration against the mean surrogate gradient; dropping the
    score-function part (the per-token entropies' pathwise gradient alone) is biased and fails the same check."""
    N, T, beta = 2, 3, 0.7
    lift, x_ids = _lift(N, T, seed=3)
    w = torch.tensor([0.7, 0.3])
    params = list(lift.lm.parameters())
    zs = _all_z(lift)
    lq = torch.stack([lift.sampler_log_probs(zs, x_ids[i:i + 1].expand(len(zs), 1)).sum(-1) for i in range(N)])
    H = -(lq.exp() * lq).sum(-1)  # [N] entropies of Q(. | x), enumerated
    exact = torch.autograd.grad(-beta * (w * H).sum(), params)
    exact = torch.cat([g.flatten() for g in exact])

    n = 6000
    torch.manual_seed(0)
    with torch.no_grad():
        z = lift.sampler(x_ids).sample((n,)).reshape(n * N, T)
    steps = lift.sampler_log_probs(z, x_ids.repeat(n, 1)).view(n, N, T).transpose(0, 1)  # [N, n, T]
    est = torch.cat([g.flatten() for g in torch.autograd.grad(entropy_surrogate(steps, beta, w), params,
                                                                retain_graph=True)])
    from ppl_thought.experiments.active_coding import _token_entropies

    pathwise_only = -beta * (w * _token_entropies(steps).sum(-1).mean(-1)).sum()
    bad = torch.cat([g.flatten() for g in torch.autograd.grad(pathwise_only, params)])
    rel = float((est - exact).norm() / exact.norm())
    rel_bad = float((bad - exact).norm() / exact.norm())
    assert rel < 0.03, rel  # Monte-Carlo error of n = 6000 particles: about 1 / sqrt(n) of the scale
    assert rel_bad > 0.1 and rel_bad > 10 * rel, (rel, rel_bad)


def test_token_entropies_of_a_certain_token_are_zero_not_nan():
    from ppl_thought.experiments.active_coding import _token_entropies

    lq = torch.tensor([0.0, -1e-9, math.log(0.5), math.log(0.9), -30.0], requires_grad=True)
    h = _token_entropies(lq)
    want = torch.tensor([0.0, 0.0, math.log(2), -(0.9 * math.log(0.9) + 0.1 * math.log(0.1)), 0.0])
    assert torch.allclose(h, want, atol=2e-5)
    h.sum().backward()
    assert torch.isfinite(lq.grad).all()


# ---------------------------------------------------------------------------------------------- restarts
def _run(restart: int, train: float, learned: float, h: float) -> dict:
    huff = 10.0
    return {"restart": restart, "train_objective_bits": train, "learned_objective": learned, "relative_gap":
            learned / huff - 1, "h_x_given_z": h, "prefix_free": h < 0.01, "learned_length": 3.0,
            "within_5_percent": learned <= 1.05 * huff, "deterministic": h < 0.01,
            "goal": learned <= 1.05 * huff and h < 0.01, "seconds": 1.0, "cpu_seconds": 1.0,
            "huffman_objective": huff, "huffman_length": 3.0, "learned_code_objective": learned,
            "decoder": "exact", "entropy_annealing": True}


def test_restarts_select_by_the_training_objective_never_the_test_metric():
    runs = [_run(0, 12.0, 10.2, 0.0), _run(1, 11.0, 11.5, 0.2), _run(2, 11.5, 10.0, 0.0)]
    # restart 1 has the least training objective; restart 2 the best evaluated (6.10): 1 is kept
    assert select_restart(runs)["restart"] == 1
    s = summarize_variant(runs)
    assert s["selected_restart"] == 1 and s["learned_objective"] == 11.5 and not s["goal"]
    assert s["restarts_within_5pct"] == pytest.approx(2 / 3) and s["restarts_goal"] == pytest.approx(2 / 3)
    assert s["restarts_deterministic"] == pytest.approx(2 / 3) and len(s["restarts"]) == 3
    assert s["cpu_seconds"] == 3.0


def test_config_errors_name_the_argument():
    for kw, name in (({"variants": ("exact", "greedy")}, "variants"), ({"restarts": 0}, "restarts"),
                     ({"entropy_start": -1.0}, "entropy_start"), ({"entropy_until": 0.0}, "entropy_until"),
                     ({"particles": 1}, "particles"), ({"sizes": (1,)}, "sizes")):
        with pytest.raises(ConfigError, match=name) as e:
            CodingConfig(**kw)
        assert isinstance(e.value, PPLThoughtError)


def test_run_reports_every_variant_and_the_restart_shares():
    cfg = CodingConfig(sizes=(4,), steps=12, restarts=2, variants=("learned", "exact+anneal"), particles=4)
    res = run_active_coding(cfg, seed=0, progress=False)
    r = res["coding"]["4"]
    assert r["variant"] == "learned" and 0 <= r["restarts_within_5pct"] <= 1
    assert set(r["remedies"]) == {"learned", "exact+anneal"}
    for s in r["remedies"].values():
        assert len(s["restarts"]) == 2 and s["selected_restart"] == select_restart(s["restarts"])["restart"]
        assert s["restarts_within_5pct"] == sum(x["within_5_percent"] for x in s["restarts"]) / 2
        assert s["learned_objective"] >= r["objective_lower_bound"] - 1e-6
    assert set(res["criteria"]["4"]) >= {"within_5_percent", "h_x_given_z_below_0.01_nats", "restarts_within_5pct",
                                         "goal_reached_by"}
    assert "machine" in res and "total_seconds" in res and res["total_cpu_seconds"] > 0
