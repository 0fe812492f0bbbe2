"""SlowThinking = Proj # P_f: exact likelihood (2.22) and posterior (2.24) against brute force."""

import itertools
import math

import numpy as np
import pyro
import pytest
import torch

import ppl_thought as pt
from ppl_thought.distributions import LMSequence
from ppl_thought.errors import NotInImageError, TooLargeToEnumerateError
from ppl_thought.lm.tabular import Tabular
from ppl_thought.models import SlowThinking
from ppl_thought.projections import (
    FirstTokenSwitch,
    Identity,
    PauseToThink,
    Product,
    QueryResponse,
    SparseThoughts,
)
from ppl_thought.vocab import Vocab

VOCAB = Vocab(["a", "b"])


def tabular(vocab_size, seed, order=2, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return Tabular(order, vocab_size, torch.randn((vocab_size,) * order, generator=g) * scale, trainable=False)


def projections():
    prod = Product.build(["a", "b"], ["u", "v"])
    return {
        "identity": Identity(VOCAB),
        "product": prod,
        "pause": PauseToThink(VOCAB, max_thought_len=2),
        "sparse": SparseThoughts(VOCAB, thought_len=1, positions=[0, 2]),
        "query_response": QueryResponse(VOCAB, max_thought_len=1),
        "switch": FirstTokenSwitch(VOCAB, repeat_token="a"),
    }


def step_by_step_log_prob(lm, projection, z, n):
    """Independent of LMSequence: one full forward per step, masks from domain(n) row by row."""
    dom = projection.domain(n)
    state, ctx, total = dom.start, [1], 0.0
    for tok in z:
        logits = lm(torch.tensor([ctx]))[0][0, -1].detach().double()
        allowed = torch.as_tensor(dom.allowed[state])
        logits[~allowed] = -math.inf
        total += float(torch.log_softmax(logits, -1)[tok])
        state = int(dom.next_state[state, tok])
        ctx.append(tok)
    assert dom.final[state]
    return total


@pytest.mark.parametrize("name", list(projections()))
def test_exact_log_prob_is_brute_force_sum_and_normalised(name):
    proj = projections()[name]
    lm = tabular(len(proj.vocab), seed=hash(name) % 1000, order=3)
    model = SlowThinking(lm, proj)
    sigma = proj.observable_ids
    for n in (1, 2, 3):
        total = []
        for xs in itertools.product(sigma.tolist(), repeat=n):
            lp = float(model.exact_log_prob(np.array(xs)))
            assert not math.isnan(lp)
            total.append(lp)
            if n <= 2 and math.isfinite(lp):
                brute = [step_by_step_log_prob(lm, proj, z, n) for z in proj.enumerate_lifting(np.array(xs))]
                assert abs(float(np.logaddexp.reduce(brute)) - lp) < 1e-5
        # (2.22) sums to one over Sigma^n: the liftings of distinct x of equal length are disjoint
        assert abs(float(np.exp(np.logaddexp.reduce(total))) - 1.0) < 1e-5, (name, n)


def independent_pause_liftings(x, c, ordinary):
    """PauseToThink liftings from the definition (Ex 2.3), without automata."""
    thoughts = [()] + [("<s>",) + y + ("</s>",) for L in range(1, c + 1) for y in itertools.product(ordinary, repeat=L)]
    return {sum((t + (a,) for t, a in zip(ts, x)), ()) for ts in itertools.product(thoughts, repeat=len(x))}


def test_pause_lifting_matches_definition_and_samples_project_to_x():
    proj = PauseToThink(VOCAB, max_thought_len=2)
    x = ["a", "<eos>"]
    ref = independent_pause_liftings(tuple(x), 2, ("a", "b"))
    got = {tuple(VOCAB.token(i) for i in z) for z in proj.enumerate_lifting(x)}
    assert got == ref
    lm = tabular(len(VOCAB), 3)
    d = LMSequence(lm, constraint=proj.lifting(x), vocab=VOCAB)
    torch.manual_seed(0)
    zs = d.sample((300,))
    for z in zs:
        assert proj.project(z[z != 0]).tolist() == VOCAB.encode(x)


@pytest.mark.parametrize("name", list(projections()))
def test_every_sample_under_the_lifting_projects_to_x(name):
    proj = projections()[name]
    lm = tabular(len(proj.vocab), 7)
    sigma = proj.observable_ids
    x = np.array([sigma[-1], sigma[0], sigma[-1]])
    if name == "switch":
        x = np.array([sigma[-1], sigma[-1]])
    lift = proj.lifting(x)
    d = LMSequence(lm, constraint=lift)
    torch.manual_seed(1)
    zs = d.sample((200,))
    assert all(lift.accepts(z[z != 0].numpy()) for z in zs)
    if name != "switch":  # FirstTokenSwitch's Proj^{<w}(a...) is infinite (truncated to a horizon)
        assert all(proj.project(z[z != 0])[: len(x)].tolist() == x.tolist() for z in zs)


def test_exact_posterior_matches_enumeration_and_model_trace():
    proj = PauseToThink(VOCAB, max_thought_len=1)
    lm = tabular(len(VOCAB), 11)
    model = SlowThinking(lm, proj)
    x = "a b"
    post = model.exact_posterior(x)
    assert abs(float(post.probs.sum()) - 1) < 1e-6
    assert len(post.support) == len(proj.enumerate_lifting(x))
    # the model's joint log-density at z equals log P(z) for z in the lifting, and -inf elsewhere
    for row, lj in zip(post.support, post.log_joint):
        tr = pyro.poutine.trace(pyro.poutine.condition(model, data={"z": row})).get_trace(x)
        assert abs(float(tr.log_prob_sum()) - float(lj)) < 1e-5
    wrong = proj.enumerate_lifting("a a")[0]
    z = torch.zeros(post.support.shape[1], dtype=torch.long)
    z[: len(wrong)] = torch.tensor(wrong)
    tr = pyro.poutine.trace(pyro.poutine.condition(model, data={"z": z})).get_trace(x)
    assert torch.isneginf(tr.log_prob_sum())
    torch.manual_seed(0)
    counts = torch.zeros(len(post.support))
    for s in post.sample(4000):
        counts[(post.support == s).all(-1).nonzero()[0, 0]] += 1
    assert ((counts / 4000 - post.probs).abs() < 4 * (post.probs * (1 - post.probs) / 4000).sqrt() + 1e-3).all()


def test_generation_and_particle_plate():
    proj = PauseToThink(VOCAB, max_thought_len=2)
    model = SlowThinking(tabular(len(VOCAB), 5), proj)

    def batched():
        with pyro.plate("particles", 16):
            return model(None, length=3)

    torch.manual_seed(0)
    tr = pyro.poutine.trace(batched).get_trace()
    z, x = tr.nodes["z"]["value"], tr.nodes["x"]["value"]
    assert z.shape[0] == 16 and x.shape == (16, 3)
    for zi, xi in zip(z, x):
        assert proj.project(zi[zi != 0]).tolist() == xi.tolist()
    assert torch.isfinite(tr.log_prob_sum())


def test_bad_input():
    proj = PauseToThink(VOCAB, max_thought_len=1)
    model = SlowThinking(tabular(len(VOCAB), 2), proj)
    with pytest.raises(pt.errors.UnknownTokenError):
        model.exact_log_prob("a q")
    # <s> is not observable: x is outside the image of Proj -> -inf, and no posterior
    assert torch.isneginf(model.exact_log_prob(["a", "<s>"]))
    with pytest.raises(NotInImageError):
        model.exact_posterior(["a", "<s>"])
    big = SlowThinking(tabular(len(VOCAB), 2), PauseToThink(VOCAB, max_thought_len=3))
    with pytest.raises(TooLargeToEnumerateError, match="Importance"):
        big.exact_log_prob("a b a b a b", limit=1000)
    with pytest.raises(ValueError, match="vocab_size"):
        SlowThinking(Tabular(2, 3), proj)
    assert float(model.exact_log_prob([])) == 0.0


def test_pad_sequences_refuses_text_floats_short_lengths_and_unknown_devices():
    """Found by the public sweep: pad_sequences('x') reached torch ('too many dimensions 'str''); float ids were
    cast silently, a length shorter than a sequence failed inside the copy, device='x' was torch's RuntimeError."""
    from ppl_thought.errors import ConfigError, MalformedSequenceError

    with pytest.raises(MalformedSequenceError, match="seqs must be a list"):
        pt.models.pad_sequences("x")
    with pytest.raises(MalformedSequenceError, match="string"):
        pt.models.pad_sequences(["ab"])
    with pytest.raises(MalformedSequenceError, match="integer token ids"):
        pt.models.pad_sequences([[6.5, 7.0]])
    with pytest.raises(ConfigError, match="length=1 is shorter"):
        pt.models.pad_sequences([[6, 7]], length=1)
    with pytest.raises(ConfigError, match="device"):
        pt.models.pad_sequences([[6, 7]], device="x")
    assert pt.models.pad_sequences([[6, 7], [8]], length=3).tolist() == [[6, 7, 0], [8, 0, 0]]
    assert pt.models.pad_sequences([torch.tensor([6]), np.array([7, 8])]).tolist() == [[6, 0], [7, 8]]
