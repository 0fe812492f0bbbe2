"""The batched pieces of experiments/real_training.py against row-by-row computations (tiny GPT-2, exact)."""

from __future__ import annotations

import importlib.util

import pytest

# found, not imported: importing peft takes ~6 s of CPU, which every xdist worker paid while collecting
if importlib.util.find_spec("peft") is None:
    pytest.skip("could not import 'peft': pip install -e '.[lora]'", allow_module_level=True)

import torch  # noqa: E402
from hf_models import byte_level  # noqa: E402

from ppl_thought.experiments import real_training as rt  # noqa: E402
from ppl_thought.experiments.sec7_losses import gate_mix  # noqa: E402
from ppl_thought.vocab import BOS_ID, PAD_ID  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    lm = byte_level(0)
    prompts = rt.SumPrompts(lm)
    probs = rt.sum_problems(3, seed=2)
    return lm, prompts, probs


def test_sum_problems_carry_and_candidates():
    for p in rt.sum_problems(20, seed=1):
        a, b = (int(x) for x in p.question.rstrip("=").split("+"))
        assert a % 10 + b % 10 >= 10 and a + b == p.answer < 100
        assert sorted(p.candidates) == sorted([p.answer, p.answer - 10, p.answer + 1, p.answer - 1])


def test_score_equals_row_by_row(setup):
    lm, prompts, probs = setup
    torch.manual_seed(0)
    b = rt.Batches(prompts, [p for p in probs for _ in range(2)], "cpu")
    thought, _ = rt.sample_thoughts(lm, b.model, prompts.thought_end, 4)
    # rows end at their first stop token, <pad> after it
    for row in thought.tolist():
        ends = [i for i, t in enumerate(row) if t in set(prompts.thought_end.tolist())]
        if ends:
            assert all(t == PAD_ID for t in row[ends[0] + 1:])
        assert PAD_ID not in row[:ends[0] + 1 if ends else len(row)]
    with torch.no_grad():
        log_th, log_ans = rt.score(lm, b.model, thought, prompts.close, b.answer)
        for i in range(len(thought)):
            th = thought[i][thought[i] != PAD_ID]
            row = torch.cat([b.model[i], th, prompts.close, b.answer[i]])[None]
            lp = torch.log_softmax(lm(row)[0][0, :-1], -1).gather(-1, row[0, 1:, None]).squeeze(-1)
            p0, t0 = b.model.shape[1], len(th)
            c0 = p0 + t0 + len(prompts.close)
            torch.testing.assert_close(log_th[i], lp[p0 - 1:p0 - 1 + t0].sum(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(log_ans[i], lp[c0 - 1:].sum(), rtol=1e-5, atol=1e-5)
    assert b.model[0, 0] == BOS_ID


def test_gated_log_q_is_the_law_it_samples(setup):
    lm, prompts, probs = setup
    gate = rt.make_gate(lm)  # zero last layer: the even mix (L.1) of the two contexts' logits
    b = rt.Batches(prompts, probs, "cpu")
    torch.manual_seed(1)
    thought, kept = rt.sample_thoughts(lm, b.model, prompts.thought_end, 3, slow=b.explain, gate=gate)
    log_q = rt.gated_log_q(gate, kept, thought)
    assert log_q.requires_grad and torch.isfinite(log_q).all()
    f_f, f_s, l_f, l_s = kept
    mixed = 0.5 * l_f + 0.5 * l_s
    torch.testing.assert_close(gate_mix(gate, f_f, f_s, l_f, l_s), mixed)
    lp = torch.log_softmax(mixed, -1).gather(-1, thought[..., None]).squeeze(-1)
    expect = torch.where(thought != PAD_ID, lp, torch.zeros_like(lp)).sum(-1)
    torch.testing.assert_close(log_q.detach(), expect)
