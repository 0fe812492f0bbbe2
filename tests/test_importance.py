"""Importance sampling (3.2), (3.4), Remark 3.4, (3.7)/Remark 3.5 against exact enumeration."""

from __future__ import annotations

import math

import pyro
import pyro.infer
import pytest
import torch
from engine_helpers import VOCAB, ExactPosterior, LiftingSampler, pause_model, tabular

from ppl_thought.distributions import LMSequence
from ppl_thought.errors import ZeroWeightsError
from ppl_thought.inference import Importance
from ppl_thought.lm.tabular import Tabular
from ppl_thought.models import SlowThinking
from ppl_thought.projections import PauseToThink, QueryResponse
from ppl_thought.projections.automaton import Automaton, AutomatonBuilder

X = "ab"


def explanatory(model):
    """An x-reading sampler: a trigram LM prompted with x <explain> (Fig 5.5), decoded under the lifting."""
    lm = tabular(len(VOCAB), 11, order=3, scale=1.0)
    return LiftingSampler(lm, model, prompt=lambda x: torch.cat([x, torch.tensor([VOCAB.id("<explain>")])]))


def chi2(model, sampler, x) -> float:
    """chi2(Q_*(.|x) || Q(.|x)) by enumeration of the lifting."""
    post = model.exact_posterior(x)
    lq = sampler.log_prob(post.support, model.x_ids(x))
    return float(torch.exp(2 * post.log_probs - lq).sum() - 1)


def test_exact_posterior_guide_gives_exact_log_marginal():
    model = pause_model(0)
    exact = model.exact_log_prob(X)
    for fast in (True, False):
        torch.manual_seed(0)
        r = Importance(64, fast=fast).run(model, ExactPosterior(model), X)
        assert float(r.log_weights.std()) < 1e-5  # constant weights: the zero-variance sampler of (3.4)
        assert float(r.log_marginal) == pytest.approx(float(exact), abs=1e-5)
        assert float(r.log_marginal_stderr) < 1e-5
        assert float(r.ess) == pytest.approx(64, rel=1e-4)


def test_fast_path_equals_trace_path(device):
    model = pause_model(1)
    model.prior.to(device)
    guide = LiftingSampler(tabular(len(VOCAB), 5).to(device), model)
    torch.manual_seed(3)
    fast = Importance(128, fast=True).run(model, guide, X)
    torch.manual_seed(3)
    traced = Importance(128, fast=False, max_plate_nesting=0).run(model, guide, X)
    assert torch.equal(fast.samples["z"], traced.samples["z"])
    assert torch.allclose(fast.log_weights, traced.log_weights, atol=1e-5)
    assert float(fast.log_marginal) == pytest.approx(float(traced.log_marginal), abs=1e-5)


@pytest.mark.parametrize("which", ["causal", "explanatory"])
def test_estimator_is_unbiased(which):
    """E[p_n] = p (3.2): the mean of p_n / p over many seeds lies in its confidence interval."""
    model = pause_model(2)
    sampler = LiftingSampler(model.prior, model) if which == "causal" else explanatory(model)
    exact = float(model.exact_log_prob(X))
    torch.manual_seed(0)
    reps, n = 400, 8
    r = Importance(reps * n).run(model, sampler, X)  # i.i.d. particles: split into reps runs of n
    ratio = torch.exp(torch.logsumexp(r.log_weights.reshape(reps, n), -1) - math.log(n) - exact).double()
    mean, se = float(ratio.mean()), float(ratio.std() / math.sqrt(reps))
    assert abs(mean - 1) < 4 * se + 1e-3, (mean, se)
    # and the engine itself on separate runs
    runs = torch.stack([Importance(n).run(model, sampler, X).log_marginal for _ in range(100)])
    ratio = torch.exp(runs - exact).double()
    assert abs(float(ratio.mean()) - 1) < 4 * float(ratio.std() / 10) + 1e-3


def test_scaling_law_chi2():
    """(3.4): n MSE(p_n) / p^2 = chi2(Q_* || Q) for every n, within 20%."""
    model = pause_model(2)
    sampler = explanatory(model)
    c2 = chi2(model, sampler, X)
    assert 0.05 < c2 < 10
    exact = float(model.exact_log_prob(X))
    torch.manual_seed(1)
    total = 2**17
    lw = Importance(total).run(model, sampler, X).log_weights
    for n in (16, 64, 256, 1024):
        p_n = torch.exp(torch.logsumexp(lw.reshape(-1, n), -1) - math.log(n) - exact).double()
        scaled = n * float(((p_n - 1) ** 2).mean())
        assert scaled == pytest.approx(c2, rel=0.2), (n, scaled, c2)


def test_stderr_and_diagnostics():
    model = pause_model(2)
    sampler = LiftingSampler(model.prior, model)
    torch.manual_seed(2)
    r = Importance(2000).run(model, sampler, X)
    exact = float(model.exact_log_prob(X))
    assert abs(float(r.log_marginal) - exact) < 4 * float(r.log_marginal_stderr)
    assert 0 < float(r.stats["ess"]) <= 2000
    assert isinstance(r.stats["khat"], float)  # arviz PSIS; few distinct weights here (discrete support)
    assert r.samples["z"].shape[0] == 2000


def test_log_normal_correction():
    model = pause_model(2)
    exact = float(model.exact_log_prob(X))
    torch.manual_seed(0)
    r = Importance(64, log_normal_correction=True).run(model, ExactPosterior(model), X)
    assert float(r.log_marginal) == pytest.approx(exact, abs=1e-5)
    r = Importance(4000, log_normal_correction=True).run(model, LiftingSampler(model.prior, model), X)
    assert "log_marginal_iid" in r.stats
    assert abs(float(r.log_marginal) - exact) < 0.3  # the log-normal model is only approximate
    assert float(r.log_marginal) != float(r.stats["log_marginal_iid"])


def test_conditional_shared_and_independent():
    """(3.7) and Remark 3.5: both estimate log p(y | x); the shared variant has the smaller bias."""
    model = pause_model(3)
    sampler = explanatory(model)
    x, y = "a", "b"
    exact = float(model.exact_log_prob("ab") - model.exact_log_prob("a"))
    torch.manual_seed(4)
    imp = Importance(32)
    shared = torch.stack([imp.conditional_log_prob(model, sampler, x, y).log_marginal for _ in range(150)])
    indep = torch.stack([imp.conditional_log_prob(model, sampler, x, y, shared=False).log_marginal
                         for _ in range(150)])
    for est in (shared, indep):
        assert abs(float(torch.exp(est - exact).mean()) - 1) < 0.1
    with torch.no_grad():
        big = imp.__class__(4000).conditional_log_prob(model, sampler, x, y).log_marginal
    assert float(big) == pytest.approx(exact, abs=0.1)


def test_conditional_bias_3_8_shared_removes_it():
    """(3.8): with independent samples, p_n / q_n overestimates p_* / q_* by chi2(Q_*(.|x) || Q(.|x)) / n in
    relative terms (+ O(n^-2)); Remark 3.5's shared prefixes (positively correlated p and q) remove most of it.

    R = 4000 estimators of n = 16 pairs each, drawn as one batch of the model's ``conditional_weights`` (the
    weights Importance.conditional_log_prob averages; pairs are i.i.d., so rows of 16 are independent estimators).
    Here chi2 / n = 0.082; measured: independent 0.075 +- 0.009, shared -0.004 +- 0.004. The checks fail on a
    wrong estimator both ways: had ``shared=False`` reused the prefixes (the bug fixed in 1be2d3c's series), its
    bias would be ~0 and miss chi2 / n; had ``shared=True`` drawn independent prefixes, its bias would be ~chi2 / n.
    """
    model = pause_model(3)
    sampler = explanatory(model)
    x, y = "a", "b"
    exact = float(model.exact_log_prob("ab") - model.exact_log_prob("a"))
    n, R = 16, 4000
    predicted = chi2(model, sampler, x) / n
    bias = {}
    for shared in (False, True):
        torch.manual_seed(0)
        _, lw_xy, lw_x = model.conditional_weights(sampler, x, y, n * R, shared)
        est = torch.logsumexp(lw_xy.double().view(R, n), 1) - torch.logsumexp(lw_x.double().view(R, n), 1)
        ratio = torch.exp(est - exact)
        bias[shared] = (float(ratio.mean()) - 1, float(ratio.std()) / math.sqrt(R))
    (b_ind, se_ind), (b_sh, se_sh) = bias[False], bias[True]
    assert abs(b_ind - predicted) < 4 * se_ind + 2 * predicted ** 2, (b_ind, se_ind, predicted)
    assert b_ind > 4 * se_ind  # a real, positive bias
    assert abs(b_sh) < 4 * se_sh + 0.005, (b_sh, se_sh)
    assert abs(b_sh) < b_ind / 3


def test_agrees_with_pyro_importance():
    model = pause_model(2)
    guide = LiftingSampler(tabular(len(VOCAB), 5), model)
    exact = float(model.exact_log_prob(X))
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    pi = pyro.infer.Importance(model, guide, num_samples=300).run(X)
    lw_pyro = torch.stack([torch.as_tensor(w) for w in pi.log_weights])
    torch.manual_seed(1)
    ours = Importance(300, fast=False).run(model, guide, X)
    se = float(ours.log_marginal_stderr)
    assert abs(float(pi.get_log_normalizer()) - exact) < 5 * se
    assert abs(float(ours.log_marginal) - exact) < 5 * se
    # trace by trace: pyro's weight of each sample equals ours for the same z
    zs = torch.stack([tr.nodes["z"]["value"] for tr in pi.exec_traces])
    dist = model.z_dist(2)
    ours_w = dist.log_prob(zs) - guide.log_prob(zs, model.x_ids(X))
    assert torch.allclose(ours_w, lw_pyro, atol=1e-4)


def test_projection_view_equals_program_view():
    """QueryResponse as SlowThinking (projection view) and as a user Pyro program give the same weights."""
    c = 1
    proj = QueryResponse(VOCAB, max_thought_len=c)
    V = len(VOCAB)
    lm = tabular(V, 7)
    model = SlowThinking(lm, proj)
    q, r = VOCAB.encode(["a", "<eos>"]), VOCAB.encode(["b", "a", "<eos>"])
    x = torch.tensor(q + r)
    sigma = AutomatonBuilder(V, "sigma")
    s0 = sigma.add_state()
    sigma.edge(s0, VOCAB.observable_ids, s0)
    sigma_auto = sigma.build()
    th = AutomatonBuilder(V, "thought")
    states = [th.add_state() for _ in range(c + 1)]
    end = th.add_state(final=True)
    for k in range(c + 1):
        if k < c:
            th.edge(states[k], VOCAB.ordinary_ids, states[k + 1])
        th.edge(states[k], [VOCAB.id("</s>")], end)
    thought_auto: Automaton = th.build(max_len=c + 1)
    qt, rt = torch.tensor(q), torch.tensor(r)
    think = torch.tensor([VOCAB.id("<s>")])

    def program(question, answer):
        pyro.sample("query", LMSequence(lm, constraint=sigma_auto, stop="<eos>", max_len=len(question),
                                        vocab=VOCAB), obs=question)
        thought = pyro.sample("thought", LMSequence(lm, prompt=torch.cat([question, think]), constraint=thought_auto,
                                                    vocab=VOCAB))
        prompt = torch.cat([question.expand(thought.shape[:-1] + question.shape), think.expand(
            thought.shape[:-1] + (1,)), thought], -1)
        pyro.sample("answer", LMSequence(lm, prompt=prompt, constraint=sigma_auto, stop="<eos>",
                                         max_len=len(answer), vocab=VOCAB),
                    obs=answer.expand(thought.shape[:-1] + answer.shape))

    guide_lm = tabular(V, 8)

    def guide(question, answer):
        pyro.sample("thought", LMSequence(guide_lm, prompt=torch.cat([question, think]), constraint=thought_auto,
                                          vocab=VOCAB))

    torch.manual_seed(0)
    prog = Importance(200).run(program, guide, qt, rt)
    thoughts = prog.samples["thought"]
    # the same latent sequences in the projection view: z = q <s> thought r
    n = thoughts.shape[0]
    from ppl_thought.distributions.lm_sequence import concat

    z = concat(qt.expand(n, -1), think.expand(n, 1), thoughts, rt.expand(n, -1))
    dist = model.z_dist(len(x))
    z = torch.cat([z, torch.zeros(n, dist.max_len - z.shape[1], dtype=torch.long)], 1)
    gd = LMSequence(guide_lm, prompt=torch.cat([qt, think]), constraint=thought_auto, vocab=VOCAB)
    log_w = dist.log_prob(z) - gd.log_prob(thoughts)
    assert torch.allclose(log_w, prog.log_weights, atol=1e-4)
    exact = float(model.exact_log_prob(x))
    assert abs(float(prog.log_marginal) - exact) < 5 * float(prog.log_marginal_stderr) + 1e-4


def test_x_outside_image_is_minus_inf_with_message():
    model = pause_model(0)
    bad = [VOCAB.id("a"), VOCAB.id("<s>")]
    assert torch.isneginf(model.exact_log_prob(bad))
    with pytest.warns(UserWarning, match="not|observable"):
        r = Importance(16).run(model, LiftingSampler(model.prior, model), torch.tensor(bad))
    assert torch.isneginf(r.log_marginal) and not torch.isnan(r.log_marginal)
    assert "message" in r.stats


def test_all_zero_weights_raise():
    V = len(VOCAB)
    logits = torch.randn(V, V)
    logits[:, VOCAB.id("b")] = float("-inf")  # the prior never emits "b"
    model = SlowThinking(Tabular(2, V, logits, trainable=False), PauseToThink(VOCAB, 1))
    assert torch.isneginf(model.exact_log_prob("ab"))
    with pytest.raises(ZeroWeightsError, match="all 32 particle weights are zero"):
        Importance(32).run(model, LiftingSampler(tabular(V, 1), model), "ab")


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_particles"):
        Importance(0)


def test_result_repr_is_short_and_summary_lists_sites_and_stats():
    """repr(result) stays under 1 KB however big the result (it printed 18 KB); summary() has the detail."""
    from ppl_thought.inference.result import Result

    samples = {f"thought_{t}": torch.zeros(5000, 40, dtype=torch.long) for t in range(30)}
    r = Result(samples=samples, log_weights=torch.randn(5000), log_marginal=torch.tensor(-3.25),
               log_marginal_stderr=torch.tensor(0.125), stats={"khat": 0.41, "ess": list(range(30))},
               engine="SMC")
    text = repr(r)
    assert len(text) < 1024 and "SMC" in text and "5000 particles" in text and "-3.25 +- 0.12" in text
    assert "Pareto k 0.41" in text and "thought_0" in text and "(30 sites)" in text
    full = r.summary()
    assert "thought_29: (5000, 40) torch.int64" in full and "stats.ess: 30 values" in full
    grouped = Result(samples={}, log_weights=torch.zeros(4, 8), log_marginal=torch.zeros(4), engine="SMC")
    assert "8 particles x 4 groups" in repr(grouped)
