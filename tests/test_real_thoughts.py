"""The real-model thought experiment (ppl_thought/experiments/real_thoughts.py) against exact answers.

On a tiny GPT-2 built in process (the same programs run on SmolLM2 in the example and the demo), with thoughts
of one token the marginal (5.7)

    p(answer | question) = sum_v P(v | question) P(answer | question, v, "</think> The answer is")

is a sum over the vocabulary, computed here by one batched forward pass. SMC with the predictive sampler (the
model proposes) and with the explanatory sampler (the same LM, prompted with the answer) must both estimate it
without bias: mean Z-hat / Z within 3 standard errors of 1 over seeds. A program that forgets to score the
thought under P (only Q is divided out) fails that bound.
"""

from __future__ import annotations

import math

import pyro
import pyro.poutine as poutine
import pytest
import torch

pytest.importorskip("transformers")

import ppl_thought as pt  # noqa: E402
from ppl_thought.distributions import LMState  # noqa: E402
from ppl_thought.experiments import real_thoughts as rt  # noqa: E402
from ppl_thought.lm.huggingface import random_gpt2, train_bpe_tokenizer  # noqa: E402
from ppl_thought.vocab import BOS_ID  # noqa: E402


class ShortPrompts(rt.Prompts):
    SYSTEM = "Be brief."


#: thought word -> (its prior frequency in training, the answer it leads to): thoughts that matter
THOUGHTS = {" carry": (4, 27), " tens": (3, 37), " ones": (2, 28), " guess": (1, 26)}
QUESTION = "What is 12 + 15?"


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer GPT-2 trained for a few seconds on ``question <think> w</think> The answer is answer(w)`` (w drawn
    4:3:2:1), so that P(answer | question, thought) depends on the thought (a random GPT-2's barely does), and on
    the explanatory prompt followed by the thought that explains the answer shown, so that Q != P."""
    import random

    rng = random.Random(0)
    texts = [f"{QUESTION} <think>{w}</think> The answer is {a}" for w, (_, a) in THOUGHTS.items()]
    tok = train_bpe_tokenizer(texts * 10, 300)
    lm = pt.lm.HuggingFace(random_gpt2(len(tok), n_layer=2, n_embd=32, n_head=2, seed=1), tok)
    prompts = ShortPrompts(lm)
    data = []
    for w, (freq, a) in THOUGHTS.items():
        rest = lm.vocab.encode(w) + prompts.close.tolist()
        data += [torch.tensor([BOS_ID] + prompts.model_prompt(QUESTION).tolist() + rest
                              + prompts.answer(a).tolist())] * freq
        # the explanatory prompt (the answer shown) is followed by the thought that explains it
        data += [torch.tensor([BOS_ID] + prompts.explanatory_prompt(QUESTION, a).tolist() + rest)] * 2
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    torch.manual_seed(0)
    lm.train()
    for _ in range(60):
        batch = torch.nn.utils.rnn.pad_sequence(rng.sample(data, 8), batch_first=True, padding_value=0)
        logits, _ = lm(batch[:, :-1])
        target = batch[:, 1:].masked_fill(batch[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return lm.eval(), prompts


def exact_log_z(lm, prompts: rt.Prompts, question: str, answer: int) -> float:
    """log sum over one-token thoughts v of P(v | prompt) P(answer | prompt v close), by enumeration."""
    prompt = prompts.model_prompt(question)
    ans = prompts.answer(answer)
    ctx = torch.cat([torch.tensor([BOS_ID]), prompt])
    V = lm.vocab_size
    with torch.no_grad():
        first = torch.log_softmax(lm(ctx[None])[0][0, -1], -1)  # P(v | prompt); -inf for <pad>, <bos>
        vs = torch.arange(V)[torch.isfinite(first)]  # <eos> too: it ends the thought, the program goes on
        rows = torch.cat([ctx.expand(len(vs), -1), vs[:, None], prompts.close.expand(len(vs), -1),
                          ans.expand(len(vs), -1)], 1)
        logp = torch.log_softmax(lm(rows)[0], -1)
        A = len(ans)
        targets = rows[:, -A:]
        ll = logp[:, -A - 1:-1].gather(-1, targets[..., None])[..., 0].sum(-1)
    return float(torch.logsumexp(first[vs] + ll, 0))


def smc_estimates(lm, prompts, question, answer, method: str, seeds: range, n: int = 16) -> torch.Tensor:
    model = rt.ThoughtThenAnswer(lm, prompts, max_thought=1)
    guide = None if method == "predictive" else rt.ExplanatorySampler(
        lm, prompts, 1, prompts.explanatory_prompt(question, answer))
    out = []
    with torch.no_grad():
        for s in seeds:
            pyro.set_rng_seed(s)
            r = pt.infer.SMC(n, ess_threshold=0.5).run(model, guide, prompts.model_prompt(question),
                                                        prompts.answer(answer))
            out.append(float(r.log_marginal))
    return torch.tensor(out, dtype=torch.float64)


def unbiased(log_z: torch.Tensor, exact: float) -> tuple[bool, str]:
    """mean Z-hat / Z within 3 SE of 1, and the log of the pooled estimate within 3 of its SEs of log Z (the second
    catches heavy-tailed overestimates whose SE is as large as their mean)."""
    ratio = torch.exp(log_z - exact)
    mean, se = float(ratio.mean()), float(ratio.std()) / math.sqrt(len(ratio))
    ok = abs(mean - 1) <= 3 * se + 1e-9 and abs(math.log(mean)) <= 3 * se / mean + 1e-9
    return ok, f"mean Z-hat/Z {mean:.4f} +- {se:.4f}"


def test_problems_have_their_answer_among_four_candidates():
    ps = rt.problems(9, seed=3)
    assert len(ps) == 9
    for p in ps:
        assert p.answer in p.candidates and len(set(p.candidates)) == 4 and min(p.candidates) > 0
        if p.question.startswith("What is"):
            a, op, b = p.question[len("What is "):-1].split()
            assert p.answer == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert [p.question for p in rt.problems(9, seed=3)] == [p.question for p in ps]  # seeded


@pytest.mark.parametrize("method", ["predictive", "explanatory"])
def test_smc_estimates_the_marginal_over_thoughts(tiny, method, request):
    lm, prompts = tiny
    q, a = QUESTION, 27
    exact = exact_log_z(lm, prompts, q, a)
    seeds = range(60 if request.config.getoption("--slow") else 24)
    log_z = smc_estimates(lm, prompts, q, a, method, seeds)
    ok, msg = unbiased(log_z, exact)
    assert ok, f"{method}: {msg} (exact log Z {exact:.4f})"


class ForgetsThePrior(rt.ThoughtThenAnswer):
    """A wrong weight: the thought's P(thought | question) is left out (masked), only Q is divided out."""

    def step(self, state, t, prompt, answer):
        with poutine.mask(mask=torch.tensor(t != 0)):
            return super().step(state, t, prompt, answer)


def test_a_wrong_weight_fails_the_bound(tiny):
    """The bound has teeth: SMC with the explanatory sampler on a program whose thought is not scored by P."""
    lm, prompts = tiny
    q, a = QUESTION, 27
    exact = exact_log_z(lm, prompts, q, a)
    model = ForgetsThePrior(lm, prompts, max_thought=1)
    guide = rt.ExplanatorySampler(lm, prompts, 1, prompts.explanatory_prompt(q, a))
    out = []
    with torch.no_grad():
        for s in range(24):
            pyro.set_rng_seed(s)
            r = pt.infer.SMC(16).run(model, guide, prompts.model_prompt(q), prompts.answer(a))
            out.append(float(r.log_marginal))
    ok, msg = unbiased(torch.tensor(out, dtype=torch.float64), exact)
    assert not ok, f"the wrong estimator passed: {msg}"


def test_direct_scoring_is_the_model_without_thought(tiny):
    lm, prompts = tiny
    ans = prompts.answer(27)
    ctx = torch.cat([torch.tensor([BOS_ID]), prompts.direct_prompt(QUESTION), ans])
    with torch.no_grad():
        logp = torch.log_softmax(lm(ctx[None])[0][0], -1)
        want = float(logp[-len(ans) - 1:-1].gather(-1, ans[:, None]).sum())
        st = LMState.start(lm, 1, prompt=prompts.direct_prompt(QUESTION))
        got = float(st.segment(max_tokens=len(ans)).log_prob(ans[None]))
    assert abs(got - want) < 1e-4


def test_run_reports_every_method(tiny):
    lm, _ = tiny
    out = rt.run(quick=True, k=2, particles=4, max_thought=2, lm=lm, progress=False)
    for m in ("direct", "predictive", "explanatory"):
        assert 0.0 <= out[m]["accuracy"] <= 1.0 and math.isfinite(out[m]["log_z"])
    for m in ("predictive", "explanatory"):
        assert 0 < out[m]["ess"] <= 1.0 + 1e-5 and "mean" in out["arviz"][m]
    assert len(out["rows"]) == 2 * 4


@pytest.mark.parametrize("kwargs", [{"k": 0}, {"particles": -1}, {"max_thought": 0}, {"k": 1.5}])
def test_run_refuses_sizes_that_are_not_positive_integers(tiny, kwargs):
    lm, _ = tiny
    with pytest.raises(pt.errors.ConfigError):
        rt.run(quick=True, lm=lm, progress=False, **kwargs)
