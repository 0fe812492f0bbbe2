"""Algorithm 2 of App. G given the grown prompt: after outputs y_1 .. y_t have been decoded, the guide proposes
Z^(t) ~ Q(. | X^(t)) from X^(t) = x y_1 .. y_t (``Continuation.grown_prompt_guide``), not Z0 ~ Q(. | x) followed by the
prior's segments (which match the decoded outputs only by chance). Checked against enumeration on a tiny Tabular
model: with the exact posterior Q_*(. | X^(t)) as the guide every weight is (Proj # P)(X^(t)); with a poor sampler
(G.1) still averages to the exact next-output law, and the effective sample size grows."""

from __future__ import annotations

import math

import torch
from engine_helpers import VOCAB, ExactPosterior, LiftingSampler, contrary_lm, thinking_model

from ppl_thought.inference.decoding_methods import _algorithm2_step
from ppl_thought.inference.decoding_program import _ProgramRun
from ppl_thought.models.slow_thinking import split_segments

X = "a"


def _run(guide, max_new_tokens: int = 2):
    model = thinking_model()
    return model, _ProgramRun(model.continuation(max_new_tokens=max_new_tokens), guide(model), (X,), {})


def _fixed(decoded):
    return {f"y_{k + 1}": torch.tensor([d]) for k, d in enumerate(decoded)}


def _ess(lw: torch.Tensor) -> float:
    w = torch.softmax(lw.double(), 0)
    return float(1.0 / (w ** 2).sum())


def test_with_the_exact_posterior_every_weight_is_the_grown_prompt_probability():
    model, run = _run(ExactPosterior)
    b = int(VOCAB.id("b"))
    grown = torch.cat([model.x_ids(X), torch.tensor([b])])
    exact = float(model.exact_log_prob(grown))  # log (Proj # P)(x b), by enumeration
    torch.manual_seed(0)
    n = 32
    data = {k: v.expand(n) for k, v in _fixed([b]).items()}
    lw = run.weights(run.run(n, data, guide=run.grown_guide([b])))
    assert torch.allclose(lw.double(), torch.full((n,), exact, dtype=torch.float64), atol=1e-4), (lw, exact)
    plain = run.weights(run.run(n, data))  # Z0 ~ Q_*(. | x), then the prior's segment: weight 0 unless it emits b
    assert bool(torch.isneginf(plain).any()) and _ess(plain) < n - 1


def test_split_segments_cuts_where_observables_are_determined():
    model = thinking_model()
    v = VOCAB
    a, b, s, e = v.id("a"), v.id("b"), v.think_id, v.end_think_id
    Z = torch.tensor([[a, s, b, e, b, a, 0], [a, b, s, a, a, e, a]])
    dom = model.projection.domain(4)
    z, s1, s2 = split_segments(dom, Z, 1, 2)
    assert z.tolist() == [[a], [a]]
    assert s1.tolist() == [[s, b, e, b], [b, 0, 0, 0]]
    assert s2.tolist() == [[a, 0, 0, 0, 0], [s, a, a, e, a]]


def test_algorithm2_given_the_grown_prompt_matches_enumeration_with_fewer_particles():
    model, run = _run(lambda m: LiftingSampler(contrary_lm(), m))
    b = int(VOCAB.id("b"))
    sigma = torch.as_tensor(model.projection.observable_ids)
    grown = torch.cat([model.x_ids(X), torch.tensor([b])])
    base = float(model.exact_log_prob(grown))
    exact = torch.tensor([math.exp(float(model.exact_log_prob(torch.cat([grown, torch.tensor([int(a)])]))) - base)
                          for a in sigma], dtype=torch.float64)
    torch.manual_seed(3)
    n, R = 32, 40
    ests, ess_grown, ess_plain = [], [], []
    data = {k: v.expand(n) for k, v in _fixed([b]).items()}
    for _ in range(R):
        _, p, finished, values = _algorithm2_step(run, n, _fixed([b]))
        est = torch.zeros(len(sigma), dtype=torch.float64)
        for j in range(len(p)):
            if not finished[j]:
                est[int((sigma == values[j]).nonzero()[0, 0])] += p[j]
        ests.append(est)
        ess_grown.append(_ess(run.weights(run.run(n, data, guide=run.grown_guide([b])))))
        ess_plain.append(_ess(run.weights(run.run(n, data))))
    est = torch.stack(ests)
    err = float((est.mean(0) - exact).abs().max())
    assert err < 4 * float(est.std(0).max()) / math.sqrt(R) + 0.01, err
    assert sum(ess_grown) > 2.5 * sum(ess_plain), (sum(ess_grown) / R, sum(ess_plain) / R)


def test_the_batched_next_observable_is_the_host_projection(monkeypatch):
    """Continuation.step reads each row's new observable with one batched lookup (the emitting token's observable,
    Def 3.5); it equals observable j - 1 of Proj(z) by the host projection, <pad> for rows that stopped."""
    from engine_helpers import pause_model

    import ppl_thought.models.slow_thinking as st
    from ppl_thought.inference import decode

    seen = []
    batched = st.next_observable

    def both(model, lm, seg, j):
        y = batched(model, lm, seg, j)
        assert torch.equal(y, st.observable_at(model, lm.tokens, j - 1))
        seen.append(int((y != 0).sum()))
        return y

    monkeypatch.setattr(st, "next_observable", both)
    torch.manual_seed(5)
    for model in (thinking_model(), pause_model()):
        decode(model, LiftingSampler(contrary_lm(), model), X, method="direct", max_new_tokens=4, num_samples=64)
    assert len(seen) >= 8 and sum(seen) > 0
    assert st.emitting_observables(thinking_model().projection, "cpu").tolist()[VOCAB.id("a")] == VOCAB.id("a")
