"""Chunked encoding for sparse thoughts (end of Section 5.6.2): runs of forced tokens fed to the LM in one pass.

The chunked path must give the numbers of the token-by-token path: the same samples and log-probabilities
for the same seed where the rows stay in lockstep (SparseThoughts: every particle is at the same place of
the lifting), and, where runs of different lengths put the rows at their own positions (PauseToThink: a
ragged batch, so the random stream is consumed differently), the same log-probability of every sample and
the same law, checked against the exact law by enumeration of the lifting.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ppl_thought as pt
from ppl_thought.distributions.lm_state import TokenRule
from ppl_thought.errors import ArgumentTypeError, ChunkMismatchError, ConfigError
from ppl_thought.projections import PauseToThink, SparseThoughts
from ppl_thought.projections.automaton import step_ends

VOCAB = pt.Vocab(["a", "b", "c"])
V = len(VOCAB)
X = torch.tensor(VOCAB.encode("a b c a b b c a c a b a"))
SPARSE = SparseThoughts(VOCAB, 2, positions=[0, 5, 9])


def _tabular(seed: int = 0) -> pt.lm.Tabular:
    g = torch.Generator().manual_seed(seed)
    return pt.lm.Tabular(2, V, torch.randn(V, V, generator=g))


def _transformer(seed: int = 0) -> pt.lm.Transformer:
    torch.manual_seed(seed)
    return pt.lm.Transformer(V, d_model=16, n_layers=2, n_heads=2)


LMS = {"tabular": _tabular, "transformer": _transformer}


def _same_lp(a: torch.Tensor, b: torch.Tensor, lm_name: str) -> None:
    """Bitwise for the table LM (its logits do not depend on how the tokens were fed); a multi-token pass of a
    Transformer may round differently from one-token passes: 1e-5."""
    if lm_name == "tabular":
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- the tables
def test_forced_runs_follow_the_text_between_thoughts():
    lift = SPARSE.lifting(X)
    rule = TokenRule(lift, V)
    run_len, toks, states = rule.forced_runs(None, torch.zeros(0, dtype=torch.long), 64, "cpu")
    z = lift.enumerate(limit=1000)[0]  # one of the 3^6 liftings: <s> y y </s> a b c a b <s> ...
    path = lift.run(np.asarray(z))
    i = z.index(VOCAB.end_think_id)  # after the first </s>: the run is x_0..x_4 and the <s> before x_5
    s = int(path[i])  # the state before </s>: forced </s>, then x_0 .. x_4, then <s>
    assert int(run_len[s]) == 7
    assert toks[s, :7].tolist() == list(z[i:i + 7])
    assert int(states[s, 7]) == int(path[i + 7])
    # a thought token is a free decision: no run
    assert int(run_len[int(path[1])]) == 0
    # a segment end stops the run: until 3 observables emitted, the run from the same state stops after x_1
    run3 = rule.forced_runs(3, torch.zeros(0, dtype=torch.long), 64, "cpu")[0]
    assert int(run3[s]) == 3  # </s> x_0 x_1 (x_2 would end the segment)
    # the limit caps it
    assert int(rule.forced_runs(None, torch.zeros(0, dtype=torch.long), 4, "cpu")[0][s]) == 4


def test_step_ends():
    assert step_ends(SPARSE.lifting(X), chunked=True) == (5, 9, 12)
    assert step_ends(SPARSE.lifting(X)) == tuple(range(1, 13))
    pause = PauseToThink(VOCAB, 2)
    assert step_ends(pause.lifting(X), chunked=True) == tuple(range(1, 13))  # a thought may start anywhere
    assert step_ends(SparseThoughts(VOCAB, 1, positions=[]).lifting(X), chunked=True) == (12,)


def test_bad_chunk_is_refused():
    with pytest.raises(ConfigError, match="chunk"):
        pt.guides.Causal(_tabular(), SPARSE, chunk=-1)
    with pytest.raises(ArgumentTypeError, match="chunk"):
        pt.dist.LMSequence(_tabular(), max_len=3, chunk=1.5)


# ---------------------------------------------------------------------------------------------- same numbers
@pytest.mark.parametrize("lm_name", ["tabular", "transformer"])
@pytest.mark.parametrize("guide_cls", [pt.guides.Causal, pt.guides.Explanatory])
def test_sparse_sampler_same_samples_and_log_probs(lm_name, guide_cls):
    lm = LMS[lm_name]()
    out = {}
    for chunk in (0, 3, 64):
        torch.manual_seed(1)
        out[chunk] = guide_cls(lm, SPARSE, chunk=chunk).sample_with_log_prob(X, 16)
    for chunk in (3, 64):
        assert torch.equal(out[chunk][0], out[0][0])
        _same_lp(out[chunk][1], out[0][1], lm_name)
    z, lq = out[64]
    assert torch.isfinite(lq).all()
    torch.testing.assert_close(guide_cls(lm, SPARSE).log_prob(z, X), lq, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lm_name", ["tabular", "transformer"])
@pytest.mark.parametrize("guide_cls", [pt.guides.Causal, pt.guides.Explanatory])
def test_sparse_importance_and_smc_same_numbers(lm_name, guide_cls):
    """The prior P = SlowThinking under Importance and SMC (no resampling: the same random stream) with a
    lifting-decoded guide: token by token and chunked give the same particles and weights; chunked SMC
    runs 3 steps (one per thought) instead of |x| = 12."""
    lm = LMS[lm_name]()
    res = {}
    for chunk in (0, 64):
        model, guide = pt.models.SlowThinking(lm, SPARSE, chunk=chunk), guide_cls(lm, SPARSE, chunk=chunk)
        torch.manual_seed(3)
        imp = pt.infer.Importance(16).run(model, guide, X)
        torch.manual_seed(3)
        smc = pt.infer.SMC(16, ess_threshold=0.0).run(model, guide, X)
        res[chunk] = (imp, smc)
    (i0, s0), (i1, s1) = res[0], res[64]
    assert torch.equal(i0.samples["z"], i1.samples["z"])
    _same_lp(i0.log_weights, i1.log_weights, lm_name)
    assert torch.equal(s0.samples["z"], s1.samples["z"])
    torch.testing.assert_close(s0.log_weights, s1.log_weights, atol=1e-5, rtol=0)  # sums in another order
    assert (s0.stats["steps"], s1.stats["steps"]) == (12, 3)


@pytest.mark.parametrize("lm_name", ["tabular", "transformer"])
def test_pause_ragged_rows_score_like_token_by_token(lm_name):
    """PauseToThink: forced runs are `</s> x_t` or `</s>` alone, so rows get runs of different lengths (ragged
    rows through the LM's `valid` mask). Every sample is a lifting of x and its log Q is the token-by-token
    law's (the teacher-forced score of the same sequence)."""
    lm = LMS[lm_name]()
    pause = PauseToThink(VOCAB, 2)
    g = pt.guides.Causal(lm, pause, chunk=8)
    torch.manual_seed(0)
    z, lq = g.sample_with_log_prob(X, 64)
    assert torch.isfinite(lq).all()
    assert (z == VOCAB.think_id).any()  # thoughts were drawn: the runs were ragged
    for row in z[:8]:
        r = row[row != VOCAB.pad_id]
        assert torch.equal(torch.as_tensor(pause.project(r)), X)
    torch.testing.assert_close(pt.guides.Causal(lm, pause).log_prob(z, X), lq, atol=1e-5, rtol=0)
    torch.manual_seed(0)
    z_smc = pt.infer.SMC(32, ess_threshold=0.0).run(pt.models.SlowThinking(lm, pause, chunk=8), g, X)
    assert torch.isfinite(z_smc.log_weights).all()


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit, cells with expected count < 5 pooled (scipy-free: regularised
    upper incomplete gamma via torch)."""
    n = counts.sum()
    exp = probs * n
    order = np.argsort(exp)
    c, e = counts[order], exp[order]
    small = np.cumsum(e) < 5
    pooled_c, pooled_e = np.r_[c[small].sum(), c[~small]], np.r_[e[small].sum(), e[~small]]
    keep = pooled_e > 0
    stat = float((((pooled_c - pooled_e) ** 2) / pooled_e)[keep].sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _law_counts(sampler, x, n: int, seed: int):
    lifting = sampler.projection.enumerate_lifting(x)
    L = sampler.event_length(x)
    support = torch.zeros(len(lifting), L, dtype=torch.long)
    for i, zz in enumerate(lifting):
        support[i, : len(zz)] = torch.as_tensor(zz)
    probs = sampler.log_prob(support, x).detach().exp().double().numpy()  # the token-by-token law, teacher forced
    torch.manual_seed(seed)
    z = sampler.sample(x, n)
    index = {tuple(r.tolist()): i for i, r in enumerate(support)}
    counts = np.bincount([index[tuple(r.tolist())] for r in z], minlength=len(lifting))
    return counts, probs


def test_pause_chunked_law_equals_exact_law():
    """Where the random stream differs (ragged rows) the chunked sampler draws from the exact token-by-token
    law Q(z | x) (enumerated over the 64 liftings): chi-square p > 0.001 at 4000 draws, while the same test
    rejects the law of another LM (the test has power)."""
    lm = _tabular(0)
    pause = PauseToThink(VOCAB, 1)
    x = torch.tensor(VOCAB.encode("a c b"))
    chunked = pt.guides.Causal(lm, pause, chunk=8)
    counts, probs = _law_counts(chunked, x, 4000, seed=11)
    assert abs(probs.sum() - 1) < 1e-5
    assert _chi2_pvalue(counts, probs) > 1e-3
    other = pt.guides.Causal(_tabular(5), pause)
    _, wrong = _law_counts(other, x, 1, seed=0)
    assert _chi2_pvalue(counts, wrong) < 1e-6


def test_chunked_smc_log_z_within_3_se():
    """Chunked SMC with resampling (steps only where a thought may start) is unbiased for the exact p(x)
    (2.22) by enumeration: 48 independent runs (groups) of 16 particles, mean Z-hat / Z within 3 SE of 1; a
    Z off by 25% would be outside (the bound has power: 48 groups gave SE 0.10, too wide to tell 1 from 1.25,
    so 320 groups: SE about 0.04)."""
    lm = _tabular(2)
    proj = SparseThoughts(VOCAB, 1, positions=[0, 3, 5])
    x = torch.tensor(VOCAB.encode("a b c a b c"))
    model = pt.models.SlowThinking(lm, proj, chunk=16)
    exact = float(model.exact_log_prob(x))
    torch.manual_seed(0)
    res = pt.infer.SMC(16, ess_threshold=0.9, groups=320).run(model, pt.guides.Causal(_tabular(3), proj, chunk=16), x)
    assert any(any(r) for r in res.stats["resampled"])
    assert res.stats["steps"] == 3
    ratio = (res.log_marginal.double() - exact).exp()
    mean, se = float(ratio.mean()), float(ratio.std() / math.sqrt(len(ratio)))
    assert abs(mean - 1) < 3 * se
    assert abs(mean - 1.25) > 3 * se and abs(mean - 0.75) > 3 * se


def test_mismatched_steps_are_refused():
    lm = _tabular()
    with pytest.raises(ChunkMismatchError, match="same chunk"):
        pt.infer.SMC(4).run(pt.models.SlowThinking(lm, SPARSE, chunk=8), pt.guides.Causal(lm, SPARSE), X)
    with pytest.raises(ChunkMismatchError, match="guide encodes"):
        pt.infer.SMC(4).run(pt.models.SlowThinking(lm, SPARSE), pt.guides.Causal(lm, SPARSE, chunk=8), X)


def test_dead_forced_token_raises_like_token_by_token():
    """A forced token to which the LM gives probability 0 (a -inf logit) is an error on both paths."""
    logits = torch.zeros(V, V)
    logits[VOCAB.id("a"), VOCAB.id("b")] = float("-inf")
    lm = pt.lm.Tabular(2, V, logits)
    proj = SparseThoughts(VOCAB, 1, positions=[0])
    x = torch.tensor(VOCAB.encode("c a b c"))
    for chunk in (0, 8):
        with pytest.raises(ValueError, match="no admissible token of positive probability"):
            pt.guides.Causal(lm, proj, chunk=chunk).sample(x, 4)


def test_benchmark_quick(tmp_path: Path):
    out = tmp_path / "chunked.json"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "benchmarks" / "chunked_encoding.py"), "--quick", "--json", str(out)],
                   check=True, timeout=60, cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    import json

    data = json.loads(out.read_text())
    for engine in ("importance", "smc"):
        r = data["results"][engine]
        assert r["token_by_token"]["tokens_per_s"] > 0 and r["chunked"]["tokens_per_s"] > 0
        assert r["same_log_weights"] is True
