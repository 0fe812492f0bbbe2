"""LMSequence: masked decoding (Def 2.8), teacher-forced scoring, padding and errors."""

import itertools
import math

import numpy as np
import pyro
import pyro.distributions as pdist
import pytest
import torch

from ppl_thought.distributions import LMSequence, LMState, concat, register_lm
from ppl_thought.errors import MalformedSequenceError, UnknownTokenError
from ppl_thought.lm.tabular import Tabular
from ppl_thought.projections.automaton import AutomatonBuilder
from ppl_thought.vocab import Vocab

VOCAB = Vocab(["a", "b", "c"])
V = len(VOCAB)
A, B, C = VOCAB.encode(["a", "b", "c"])


def bigram(seed=0, order=2):
    g = torch.Generator().manual_seed(seed)
    return Tabular(order, V, torch.randn((V,) * order, generator=g) * 1.5)


def small_language():
    """Strings over {a, b, c}: 'a' then any of {b, c} up to twice, then 'c' ends; or just 'b'."""
    b = AutomatonBuilder(V, "toy")
    s0 = b.add_state()
    s1 = b.add_state()
    s2 = b.add_state()
    s3 = b.add_state()
    fin = b.add_state(final=True)
    b.edge(s0, [A], s1)
    b.edge(s0, [B], fin)
    b.edge(s1, [B], s2)
    b.edge(s1, [C], fin)
    b.edge(s2, [B, C], s3)
    b.edge(s2, [A], fin)
    b.edge(s3, [A], fin)
    return b.build(max_len=4)


def manual_log_prob(lm, prompt, z, automaton=None):
    """Independent reference: sum over steps of log softmax of masked logits, one forward per step."""
    ctx = [VOCAB.bos_id] + list(prompt)
    state = automaton.start if automaton is not None else None
    total = 0.0
    for tok in z:
        logits, _ = lm(torch.tensor([ctx]))
        lg = logits[0, -1].clone()
        allowed = torch.ones(V, dtype=torch.bool)
        allowed[[VOCAB.pad_id, VOCAB.bos_id]] = False
        if automaton is not None:
            allowed &= torch.as_tensor(automaton.allowed[state])
        lg[~allowed] = -math.inf
        total += float(torch.log_softmax(lg.detach(), -1)[tok])
        if automaton is not None:
            state = int(automaton.next_state[state, tok])
        ctx.append(tok)
    return total


def test_log_prob_of_samples_equals_sum_of_masked_steps(device):
    lm, aut = bigram(), small_language()
    d = LMSequence(bigram().to(device), prompt=[A, C], constraint=aut, vocab=VOCAB)
    torch.manual_seed(0)
    z, lp = d.sample_with_log_prob((50,))
    assert z.shape == (50, 4) and z.device.type == lp.device.type == device.type
    lp_tf = d.log_prob(z.clone()).detach()
    assert torch.allclose(lp, lp_tf, atol=1e-5)
    z, lp_tf = z.cpu(), lp_tf.cpu()
    for row, l in zip(z[:10], lp_tf[:10]):
        toks = [int(t) for t in row if t != VOCAB.pad_id]
        assert aut.accepts(toks)
        assert abs(manual_log_prob(lm, [A, C], toks, aut) - float(l)) < 1e-5


def test_probabilities_sum_to_one_and_sampling_frequencies_match():
    lm, aut = bigram(1), small_language()
    d = LMSequence(lm, constraint=aut)
    lang = aut.enumerate()
    vals = torch.zeros(len(lang), 4, dtype=torch.long)
    for i, s in enumerate(lang):
        vals[i, : len(s)] = torch.tensor(s)
    p = d.log_prob(vals).exp()
    assert abs(float(p.detach().sum()) - 1) < 1e-5
    torch.manual_seed(1)
    n = 20000
    z = d.sample((n,))
    counts = torch.stack([(z == v).all(-1).sum() for v in vals]).double()
    # every draw is in the language, and the frequencies are within 4.5 binomial sigma
    assert int(counts.sum()) == n
    sigma = torch.sqrt(n * p.double() * (1 - p.double()))
    assert ((counts - n * p.double()).abs() <= 4.5 * sigma + 1).all()


def test_stop_tokens_without_constraint_sum_to_one():
    lm = bigram(2)
    d = LMSequence(lm, stop="c", max_len=3, vocab=VOCAB)
    ordinary = [VOCAB.eos_id, VOCAB.think_id, VOCAB.end_think_id, VOCAB.explain_id, A, B, C]
    seqs = []
    for L in range(1, 4):
        for s in itertools.product(ordinary, repeat=L):
            if C in s[:-1]:
                continue
            if L < 3 and s[-1] != C:
                continue
            seqs.append(list(s) + [0] * (3 - L))
    lp = d.log_prob(torch.tensor(seqs))
    assert abs(float(torch.logsumexp(lp.detach(), 0).exp()) - 1) < 1e-5


def test_minus_inf_outside_constraint_never_nan():
    lm, aut = bigram(3), small_language()
    d = LMSequence(lm, constraint=aut)
    bad = torch.tensor([
        [C, 0, 0, 0],  # C not admissible at the start
        [A, 0, 0, 0],  # incomplete: not a final state
        [B, A, 0, 0],  # continues after its end
        [0, 0, 0, 0],  # empty but the start is not final
    ])
    lp = d.log_prob(bad)
    assert torch.isneginf(lp).all() and not torch.isnan(lp).any()


def test_minus_inf_logits_in_the_lm_give_minus_inf_not_nan():
    logits = torch.zeros(V, V)
    logits[:, B] = -math.inf  # the LM never emits b
    lm = Tabular(2, V, logits)
    d = LMSequence(lm, constraint=small_language())
    lp = d.log_prob(torch.tensor([[B, 0, 0, 0], [A, C, 0, 0]]))
    assert torch.isneginf(lp[0]) and torch.isfinite(lp[1])


def test_errors_name_the_problem():
    lm, aut = bigram(), small_language()
    d = LMSequence(lm, constraint=aut)
    with pytest.raises(UnknownTokenError, match="outside the vocabulary"):
        d.log_prob(torch.tensor([[A, 99, 0, 0]]))
    with pytest.raises(MalformedSequenceError, match="padding inside"):
        d.log_prob(torch.tensor([[A, 0, C, 0]]))
    with pytest.raises(MalformedSequenceError, match="over max_len"):
        d.log_prob(torch.tensor([[A, B, B, A, C]]))
    with pytest.raises(MalformedSequenceError, match="integer"):
        d.log_prob(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="max_len"):
        LMSequence(lm, stop=C)
    with pytest.raises(UnknownTokenError):
        LMSequence(lm, prompt=[7, 100], max_len=2)
    with pytest.raises(UnknownTokenError, match="not in the vocabulary"):
        LMSequence(lm, stop="zz", max_len=2, vocab=VOCAB)


def test_pyro_site_under_a_plate_and_expand():
    lm, aut = bigram(4), small_language()

    def model():
        with pyro.plate("particles", 7):
            return pyro.sample("z", LMSequence(lm, constraint=aut))

    tr = pyro.poutine.trace(model).get_trace()
    tr.compute_log_prob()
    site = tr.nodes["z"]
    assert site["value"].shape == (7, 4)
    ref = LMSequence(lm, constraint=aut).log_prob(site["value"].clone())
    assert torch.allclose(site["log_prob"], ref, atol=1e-5)


def test_ragged_prompts_match_per_row_prompts():
    lm = bigram(5, order=3)
    prompts = torch.tensor([[A, B, C], [B, 0, 0], [C, A, 0]])
    d = LMSequence(lm, prompt=prompts, stop="c", max_len=3, vocab=VOCAB)
    torch.manual_seed(0)
    z, lp = d.sample_with_log_prob()
    assert z.shape == (3, 3)
    for i in range(3):
        p = [int(t) for t in prompts[i] if t != 0]
        di = LMSequence(lm, prompt=p, stop="c", max_len=3, vocab=VOCAB)
        assert torch.allclose(di.log_prob(z[i : i + 1]), lp[i : i + 1], atol=1e-5)
        assert torch.allclose(di.log_prob(z[i : i + 1]), d.log_prob(z)[i : i + 1], atol=1e-5)


def test_concat_moves_padding_to_the_end():
    q = torch.tensor([[A, B], [A, 0]])
    t = torch.tensor([[C, 0, 0], [B, C, 0]])
    assert concat(q, t).tolist() == [[A, B, C], [A, B, C]]
    assert concat(torch.tensor([[A, 0]]), torch.tensor([[0, 0]])).tolist() == [[A]]


def test_text_prompt_and_program_view():
    lm = bigram(6)

    def cot(question):
        thought = pyro.sample("thought", LMSequence(lm, prompt=question, stop="</s>", max_len=4, vocab=VOCAB))
        return thought

    tr = pyro.poutine.trace(cot).get_trace("a b")
    z = tr.nodes["thought"]["value"]
    assert z.shape == (4,)
    assert np.isfinite(float(tr.log_prob_sum().detach()))
    assert isinstance(tr.nodes["thought"]["fn"], pdist.TorchDistribution)


def test_unbatched_value_broadcasts_over_batched_prompts():
    lm = bigram(8)
    prompts = torch.tensor([[A, B], [B, 0]])
    d = LMSequence(lm, prompt=prompts, stop="c", max_len=2, vocab=VOCAB)
    z = torch.tensor([A, C])
    lp = d.log_prob(z)
    assert lp.shape == (2,)
    for i, p in enumerate([[A, B], [B]]):
        assert torch.allclose(LMSequence(lm, prompt=p, stop="c", max_len=2, vocab=VOCAB).log_prob(z), lp[i])


# ---------------------------------------------------------------------------------------------- registration
def test_an_lm_in_a_user_program_is_trained_by_svi_without_pyro_module():
    pyro.clear_param_store()
    lm, aut = bigram(11), small_language()
    before = lm.logits.detach().clone()
    target = torch.tensor([A, B, B, A])  # a rare word of the language

    def model():
        pyro.sample("z", LMSequence(lm, constraint=aut), obs=target)

    def guide():
        pass

    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), pyro.infer.Trace_ELBO())
    losses = [svi.step() for _ in range(30)]
    assert not torch.equal(lm.logits.detach(), before)
    assert losses[-1] < losses[0] - 1.0
    # every call reads the parameters again (param sites), not only the first one
    tr = pyro.poutine.trace(model).get_trace()
    assert "lm_Tabular$$$logits" in tr.nodes and tr.nodes["lm_Tabular$$$logits"]["type"] == "param"
    pyro.clear_param_store()


def test_registration_names():
    pyro.clear_param_store()
    lm1, lm2, aut = bigram(12), bigram(13), small_language()
    assert LMSequence(lm1, constraint=aut).lm_name == "lm_Tabular"
    assert LMSequence(lm2, constraint=aut).lm_name == "lm_Tabular_1"  # a different LM: another name
    assert LMSequence(lm1, constraint=aut).lm_name == "lm_Tabular"  # the same LM: the same name
    assert register_lm(lm2) == "lm_Tabular_1"
    assert sorted(pyro.get_param_store().keys()) == ["lm_Tabular$$$logits", "lm_Tabular_1$$$logits"]
    frozen = Tabular(2, V, torch.zeros(V, V), trainable=False)
    assert LMSequence(frozen, constraint=aut).lm_name is None and register_lm(frozen) is None
    lm3 = bigram(14)
    pyro.module("prior", lm3)  # the user's own registration is kept
    assert LMSequence(lm3, constraint=aut).lm_name == "prior"
    assert LMSequence(bigram(15), constraint=aut, name="q").lm_name == "q"
    assert LMState.start(bigram(16), 2, max_len=2, name="q2") is not None
    assert len(pyro.get_param_store().keys()) == 5 and "q2$$$logits" in pyro.get_param_store().keys()
    pyro.clear_param_store()
