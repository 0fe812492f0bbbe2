"""Decoding (3.12)-(3.14), Algorithms 1-2 of App. G and best-of-K against exact enumeration."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import VOCAB, ExactPosterior, LiftingSampler, pause_model, tabular

from ppl_thought.inference import decode, next_token_distribution

X = "ab"


def exact_next(model, x):
    sigma = model.projection.observable_ids
    base = float(model.exact_log_prob(x))
    xt = model.x_ids(x)
    return torch.tensor([math.exp(float(model.exact_log_prob(torch.cat([xt, torch.tensor([int(a)])]))) - base)
                         for a in sigma])


def chi2(model, sampler, x):
    post = model.exact_posterior(x)
    return float(torch.exp(2 * post.log_probs - sampler.log_prob(post.support, model.x_ids(x))).sum() - 1)


def test_algorithm1_equals_enumeration():
    model = pause_model(2)
    p = next_token_distribution(model, None, X, method="exact")
    assert torch.allclose(p, exact_next(model, X).float(), atol=1e-5)
    torch.manual_seed(0)
    out = decode(model, None, X, method="exact", max_new_tokens=2)
    probs = out.stats["next_token_probs"]
    x2 = torch.cat([model.x_ids(X), out.tokens[0, :1]])
    assert torch.allclose(probs[1], exact_next(model, x2).float(), atol=1e-5)  # the line-8 cache is right


def test_algorithm2_unbiased():
    model = pause_model(2)
    exact = exact_next(model, X).float()
    torch.manual_seed(1)
    sampler = LiftingSampler(tabular(len(VOCAB), 5), model)
    est = torch.stack([next_token_distribution(model, sampler, X, n=8) for _ in range(200)])
    se = est.std(0) / math.sqrt(len(est))
    assert (est.mean(0) - exact).abs().max() < 4 * se.max() + 0.01
    # with the exact posterior the weights are constant and (G.1) is exactly unbiased
    est = torch.stack([next_token_distribution(model, ExactPosterior(model), X, n=8) for _ in range(200)])
    assert ((est.mean(0) - exact).abs() < 4 * est.std(0) / math.sqrt(200) + 1e-3).all()
    out = decode(model, sampler, X, method="unbiased", n=8, max_new_tokens=2)
    assert out.tokens.shape == (1, 2)


@pytest.mark.parametrize("method,n", [("resampling", 4), ("resampling", 16), ("direct", 1)])
def test_next_token_tv(method, n):
    """Prop 3.3 (resampling) and Prop 3.1 (direct): empirical next-token law vs the exact (Proj # P)(. | x)."""
    model = pause_model(2)
    sampler = LiftingSampler(tabular(len(VOCAB), 5), model)
    exact = exact_next(model, X)
    torch.manual_seed(2)
    S = 3000
    out = decode(model, sampler, X, method=method, n=n, max_new_tokens=1, num_samples=S)
    sigma = torch.as_tensor(model.projection.observable_ids)
    emp = (out.tokens[:, 0:1] == sigma[None]).double().mean(0)
    tv = 0.5 * float((emp - exact).abs().sum())
    noise = 0.5 * float((2 * (exact * (1 - exact) / S).sqrt()).sum()) + 0.01
    if method == "resampling":
        bound = math.sqrt((6 * chi2(model, sampler, X) + 2) / n)
        assert tv < bound + noise
    # with the exact posterior the direct method is exact (KL(Q_*||Q) = 0 in Prop 3.1)
    out = decode(model, ExactPosterior(model), X, method=method, n=n, max_new_tokens=1, num_samples=S)
    emp = (out.tokens[:, 0:1] == sigma[None]).double().mean(0)
    assert 0.5 * float((emp - exact).abs().sum()) < 2 * noise


def test_streaming_matches_projection():
    model = pause_model(2)
    torch.manual_seed(3)
    toks = list(decode(model, LiftingSampler(model.prior, model), X, method="streaming", max_new_tokens=4))
    assert 1 <= len(toks) <= 4
    assert all(t in set(model.projection.observable_ids.tolist()) for t in toks)
    if len(toks) < 4:
        assert toks[-1] == VOCAB.eos_id


def test_best_of_k_picks_highest_score():
    model = pause_model(2)
    torch.manual_seed(4)
    out = decode(model, ExactPosterior(model), X, method="best_of_k", n=8, k=5, max_new_tokens=2)
    scores = out.stats["scores"]
    assert torch.equal(out.tokens[0], out.stats["candidates"][int(torch.argmax(scores))])


def test_bad_method_and_prompt():
    model = pause_model(0)
    with pytest.raises(ValueError, match="unknown decoding method"):
        decode(model, None, X, method="beam")
    from ppl_thought.errors import NotInImageError

    with pytest.raises(NotInImageError):
        decode(model, None, torch.tensor([VOCAB.id("<s>")]), method="direct")
