"""LMState / Segment: the one decoding loop (segment sampling vs teacher-forced scoring, Def 2.8, (2.13))."""

import pytest
import torch
from scipy.stats import chi2
from torch import nn

from ppl_thought.distributions import LMSequence, LMState, Segment, TokenRule, concat
from ppl_thought.distributions.lm_state import masked_log_softmax
from ppl_thought.errors import MalformedSequenceError
from ppl_thought.lm import Tabular, Transformer
from ppl_thought.projections import PauseToThink
from ppl_thought.vocab import Vocab

VOCAB = Vocab(["a", "b"])
V = len(VOCAB)
PROJ = PauseToThink(VOCAB, max_thought_len=2)
EOS, THINK, END_THINK = VOCAB.eos_id, VOCAB.think_id, VOCAB.end_think_id
A, B = VOCAB.encode(["a", "b"])


class Recompute(nn.Module):
    """An LM without ``valid`` in ``forward`` that ignores the cache and reruns its input (recompute mode)."""

    valid_mask_supported = False

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.vocab_size = lm.vocab_size

    def forward(self, tokens, cache=None):
        return self.lm(tokens)[0], None


def make_lm(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind.startswith("tabular"):
        lm = Tabular(2, V, torch.randn(V, V) * 1.5, trainable=False)
    else:
        lm = Transformer(V, d_model=16, n_layers=2, n_heads=2, max_len=64).eval()
        for p in lm.parameters():
            p.requires_grad_(False)
    return Recompute(lm) if kind.endswith("recompute") else lm


KINDS = ["tabular", "tabular-recompute", "transformer", "transformer-recompute"]


def padded(tokens: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(tokens.shape[0], width, dtype=torch.long)
    out[:, : tokens.shape[1]] = tokens
    return out


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_segments_sample_and_score_alike_and_sum_to_the_sequence(kind, drop, monkeypatch):
    """Sampled segment log-probs = teacher-forced ones; their sum = LMSequence.log_prob of the concatenation.

    ``<eos>`` is a stop token, so rows end at different segments; ``drop`` makes the loop drop ended rows
    at once (the KV cache gathered to the live rows), then ``extend`` gathers it back."""
    monkeypatch.setattr(Segment, "drop_fraction", 0.0 if drop else 1.0)
    lm, T, n = make_lm(kind), 4, 48
    D = PROJ.domain(T)
    assert LMState.start(lm, 2).mode == ("recompute" if kind.endswith("recompute") else "valid")
    stop = torch.tensor([EOS])
    st = LMState.start(lm, n, rule=TokenRule(D, V), max_len=D.max_len, stop_ids=stop)
    shadow = LMState.start(lm, n, rule=TokenRule(D, V), max_len=D.max_len, stop_ids=stop)  # teacher-forced only
    gen = torch.Generator().manual_seed(1)
    total = torch.zeros(n)
    for t in range(T):
        seg = st.segment(until_emitted=t + 1)
        v, lp = seg.sample_with_log_prob(gen)
        assert seg.log_prob(v) is lp or torch.equal(seg.log_prob(v), lp)  # memoised by identity
        tf = shadow.segment(until_emitted=t + 1).log_prob(v.clone())
        assert torch.allclose(lp, tf, atol=1e-5)
        assert torch.isfinite(lp).all()
        total += lp
        st.extend(v)
        shadow.extend(v.clone())
        live = ~st.done
        assert torch.equal(st.done, shadow.done) and torch.equal(st.tokens, shadow.tokens)
        assert torch.allclose(st.logits[live].float(), shadow.logits[live].float(), atol=1e-5)
    assert st.done.all() and (st.tokens == EOS).any()
    seq = LMSequence(lm, constraint=D, stop=EOS)
    ref = seq.log_prob(padded(st.tokens, D.max_len))
    assert torch.allclose(total, ref, atol=1e-4) and torch.allclose(st.log_prob, ref, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_whole_sequence_segment_is_lmsequence(kind):
    lm, D = make_lm(kind, 1), PROJ.domain(3)
    d = LMSequence(lm, prompt=[A, B], constraint=D, stop=EOS)
    z, lp = d.sample_with_log_prob((40,))
    assert z.shape == (40, D.max_len)
    assert torch.allclose(lp, d.log_prob(z.clone()), atol=1e-5)
    st = d.start(40)
    v, lp2 = st.segment().sample_with_log_prob()
    assert torch.allclose(lp2, d.log_prob(padded(v, D.max_len)), atol=1e-5)
    st.extend(v)
    assert st.done.all()


@pytest.mark.parametrize("kind", ["tabular", "transformer", "transformer-recompute"])
def test_reorder_after_extend_is_building_from_reordered_rows(kind):
    lm, D, n = make_lm(kind, 2), PROJ.domain(3), 8
    rule = TokenRule(D, V)
    st = LMState.start(lm, n, prompt=[B], rule=rule, max_len=D.max_len)
    v, _ = st.segment(until_emitted=1).sample_with_log_prob(torch.Generator().manual_seed(3))
    st.extend(v)
    idx = torch.tensor([3, 3, 0, 7, 1, 1, 6, 2])
    st.reorder(idx)
    ref = LMState.start(lm, n, prompt=[B], rule=rule, max_len=D.max_len).extend(v[idx].clone())
    for k in ("tokens", "lengths", "s", "done"):
        assert torch.equal(getattr(st, k), getattr(ref, k)), k
    assert torch.allclose(st.log_prob, ref.log_prob, atol=1e-5)
    assert torch.allclose(st.logits.float(), ref.logits.float(), atol=1e-5)
    # the next segment scores alike on both, sampled on one and teacher-forced on the other
    w, lw = st.segment(until_emitted=2).sample_with_log_prob(torch.Generator().manual_seed(4))
    assert torch.allclose(lw, ref.segment(until_emitted=2).log_prob(w.clone()), atol=1e-5)


def test_next_token_frequencies_match_the_masked_softmax():
    lm, D, n = make_lm("transformer", 5), PROJ.domain(2), 20000
    rule = TokenRule(D, V)
    st = LMState.start(lm, n, prompt=[A, B, A], rule=rule, max_len=D.max_len)
    st.extend(torch.full((n,), THINK))  # inside a thought: ordinary tokens only, no </s> yet
    torch.manual_seed(6)
    tok = st.next_token().sample()
    assert tok.shape == (n,)
    p = masked_log_softmax(st.logits[:1], rule.allowed(st.s[:1]))[0].exp().double()
    counts = torch.bincount(tok, minlength=V).double()
    assert (counts[p == 0] == 0).all()
    support = p > 0
    assert int(support.sum()) == 2  # a and b
    stat = float(((counts[support] - n * p[support]) ** 2 / (n * p[support])).sum())
    assert stat < chi2.ppf(0.999, int(support.sum()) - 1)


@pytest.mark.parametrize("kind", ["tabular", "tabular-recompute"])
def test_malformed_values_raise(kind):
    lm, D, n = make_lm(kind), PROJ.domain(2), 3
    st = LMState.start(lm, n, rule=TokenRule(D, V), max_len=D.max_len)
    seg = st.segment(until_emitted=1)
    with pytest.raises(MalformedSequenceError, match="outside the vocabulary"):
        seg.log_prob(torch.tensor([[A], [99], [B]]))
    with pytest.raises(MalformedSequenceError, match="outside the vocabulary"):
        seg.log_prob(torch.tensor([[A], [-1], [B]]))
    with pytest.raises(MalformedSequenceError, match=r"\[3, S\]"):
        seg.log_prob(torch.tensor([[A], [B]]))
    with pytest.raises(MalformedSequenceError, match=r"\[3, S\]"):
        seg.log_prob(torch.zeros(3, 1, 1, dtype=torch.long))
    with pytest.raises(MalformedSequenceError, match="padding inside"):
        seg.log_prob(torch.tensor([[THINK, 0, A], [A, 0, 0], [B, 0, 0]]))
    with pytest.raises(MalformedSequenceError, match="integer"):
        seg.log_prob(torch.zeros(3, 1))
    with pytest.raises(MalformedSequenceError, match=r"\[3\]"):
        st.next_token().log_prob(torch.tensor([[A, B]] * 3))
    with pytest.raises(MalformedSequenceError, match="padding inside"):  # no segment: an open one
        LMState.start(lm, n, max_len=4).extend(torch.tensor([[0, A], [A, 0], [B, 0]]))


def test_segments_that_do_not_end_where_they_must_are_minus_inf():
    lm, D = make_lm("tabular"), PROJ.domain(2)
    st = LMState.start(lm, 5, rule=TokenRule(D, V), max_len=D.max_len)
    seg = st.segment(until_emitted=1)
    lp = seg.log_prob(torch.tensor([
        [A, 0, 0, 0, 0],  # ends after one observable: fine
        [THINK, A, END_THINK, B, 0],  # a thought, then the observable: fine
        [THINK, A, END_THINK, 0, 0],  # stops before the observable
        [A, B, 0, 0, 0],  # goes on past the end of the segment
        [0, 0, 0, 0, 0],  # an active row with an empty segment
    ]))
    assert torch.isfinite(lp[:2]).all() and torch.isneginf(lp[2:]).all() and not torch.isnan(lp).any()
    # the token after a whole sequence, and a thought token where only observables are admissible
    st.extend(torch.tensor([[A, B]] * 5))
    assert st.done.all()
    lp = st.segment(until_emitted=3).log_prob(torch.tensor([[A]] * 4 + [[0]]))
    assert torch.isneginf(lp[:4]).all() and lp[4] == 0


def test_the_state_stop_token_ends_the_segment_whatever_its_stop():
    """A row that samples a stop token of the state has ended its sequence, also in a segment with
    another ``stop``: nothing follows it, and a value that goes on is -inf."""
    lm, n = make_lm("tabular", 7), 400
    st = LMState.start(lm, n, max_len=6, stop_ids=torch.tensor([EOS]))
    seg = st.segment(stop=[B])
    v, lp = seg.sample_with_log_prob(torch.Generator().manual_seed(0))
    is_eos = v == EOS
    assert is_eos.any()
    after = torch.cumsum(is_eos.long(), 1) - is_eos.long() > 0  # positions after an <eos>
    assert (v[after] == 0).all()
    st.extend(v)
    assert torch.equal(st.done, is_eos.any(1) | (st.lengths >= 6))
    lp = LMState.start(lm, 2, max_len=6, stop_ids=torch.tensor([EOS])).segment(stop=[B]).log_prob(
        torch.tensor([[EOS, A, B], [A, A, B]]))
    assert torch.isneginf(lp[0]) and torch.isfinite(lp[1])


def test_minus_inf_history_does_not_make_nan():
    """A row whose earlier tokens had probability 0 keeps -inf; the next segment's log-prob is its own."""
    logits = torch.randn(V, V)
    logits[:, B] = float("-inf")  # the LM never emits b
    lm = Tabular(2, V, logits, trainable=False)
    st = LMState.start(lm, 3, max_len=8).extend(torch.tensor([[A], [B], [A]]))  # no segment: an open one
    assert torch.isfinite(st.log_prob[[0, 2]]).all() and torch.isneginf(st.log_prob[1])
    seg = st.segment(max_tokens=2)
    v, lp = seg.sample_with_log_prob()
    assert torch.isfinite(lp).all() and torch.isfinite(seg.log_prob(v)).all()
    st.extend(v)
    assert not torch.isnan(st.log_prob).any() and torch.isneginf(st.log_prob[1])


def test_open_extend_scores_a_prefix_like_step_log_probs():
    lm, D = make_lm("transformer", 8), PROJ.domain(3)
    d = LMSequence(lm, constraint=D)
    z = torch.tensor([[THINK, A, END_THINK, B, A, 0, 0], [A, THINK, B, B, END_THINK, A, 0]])
    steps, _ = d.step_log_probs(padded(z, D.max_len))
    st = d.start(2)
    st.extend(z[:, :4])  # cut anywhere: no end is required
    assert torch.allclose(st.log_prob, steps[:, :4].sum(-1), atol=1e-5)
    st.extend(z[:, 4:])
    assert torch.allclose(st.log_prob, steps.sum(-1), atol=1e-5)


def test_extend_uses_the_segment_that_made_the_value():
    lm, D = make_lm("tabular", 9), PROJ.domain(3)
    st = LMState.start(lm, 16, rule=TokenRule(D, V), max_len=D.max_len)
    seg = st.segment(until_emitted=1)
    v = seg.sample()
    st.next_token()  # a later distribution of the same state must not score v
    lp = seg.log_prob(v)
    st.extend(v)
    assert torch.allclose(st.log_prob, lp) and torch.isfinite(lp).all()


def test_batched_prompts_with_a_sample_shape_keep_their_rows():
    lm = make_lm("tabular", 10)
    prompts = torch.tensor([[A, B], [B, 0]])
    d = LMSequence(lm, prompt=prompts, stop=EOS, max_len=3)
    z, lp = d.sample_with_log_prob((5,))
    assert z.shape == (5, 2, 3) and lp.shape == (5, 2)
    for b, p in enumerate([[A, B], [B]]):
        ref = LMSequence(lm, prompt=p, stop=EOS, max_len=3).log_prob(z[:, b].clone())
        assert torch.allclose(lp[:, b], ref, atol=1e-5)
    assert torch.allclose(d.log_prob(z.clone()), lp, atol=1e-5)
    assert concat(prompts, z[0]).shape[0] == 2


def test_sample_categorical_is_exact_and_never_draws_mass_zero():
    """Inversion sampling: frequencies match the probabilities (chi-square), an index of mass 0 is
    never drawn, unnormalised rows are fine, and a row of zero mass draws V (the caller's dead-row test).
    A sampler that ignored the cumulative mass (uniform over the support) fails the same chi-square."""
    from ppl_thought.distributions.lm_state import sample_categorical

    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    N = 100_000
    draws = sample_categorical((3.0 * p).expand(N, -1), g)  # unnormalised
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[p == 0].sum() == 0
    expected = N * p[p > 0].double()
    stat = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(0.999, 2)
    uniform = N / 3 * torch.ones(3, dtype=torch.float64)
    assert float(((uniform - expected) ** 2 / expected).sum()) > chi2.ppf(0.999, 2)
    tiny = torch.tensor([[0.0, 0.0, 0.0, 1e-30]]).expand(1000, -1)
    assert sample_categorical(tiny, g).eq(3).all()
    assert sample_categorical(torch.zeros(2, 5), g).eq(5).all()


def test_token_step_is_the_masked_draw_with_one_uniform_per_row():
    """token_step (Def 2.8): active rows draw from the rule's masked softmax by inversion with one uniform each
    (the same token as sample_categorical on the same stream), inactive rows draw <pad>, keep their state and
    score 0, the rule state advances, the end flags follow ``ends``, a row with no admissible token is dead, and
    the old import paths of sample_categorical still work."""
    from ppl_thought.distributions import segment
    from ppl_thought.distributions.token_rule import sample_categorical, token_step
    from ppl_thought.vocab import PAD_ID

    assert segment.sample_categorical is sample_categorical
    auto = PROJ.lifting("ab")
    rule = TokenRule(auto, V)
    n = 200
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, V, generator=g)
    s = rule.start(n, "cpu")
    active = torch.rand(n, generator=g) < 0.7
    done = torch.zeros(n, dtype=torch.bool)
    step = token_step(rule, logits, s, active, torch.Generator().manual_seed(5),
                      ends=lambda tok, s2: (tok == A, rule.is_final(s2)), done=done)
    logq = rule.log_probs(logits, s)
    ref = sample_categorical(logq.exp(), torch.Generator().manual_seed(5))
    assert torch.equal(step.token[active], ref[active])
    assert step.token[~active].eq(PAD_ID).all() and torch.equal(step.state[~active], s[~active])
    assert torch.equal(step.state[active], auto.step(s[active], ref[active]))
    assert torch.equal(step.log_prob[active], logq[active].gather(1, ref[active, None])[:, 0])
    assert step.log_prob[~active].eq(0).all() and torch.isfinite(step.log_prob).all()
    assert not step.dead.any()
    assert torch.equal(step.going, active & (step.token != A))
    assert torch.equal(step.done, active & rule.is_final(step.state))
    blocked = torch.full((2, V), float("-inf"))  # no token of positive mass: dead, token clamped in range
    dead = token_step(None, None, None, generator=g, log_probs=blocked)
    assert dead.dead.all() and dead.token.lt(V).all() and dead.state is None and dead.done is None


def test_automaton_advance_keeps_the_state_on_pad():
    vocab = Vocab(["a", "b"])
    auto = PauseToThink(vocab, max_thought_len=1).lifting("ab")
    V = len(vocab)
    s = torch.arange(-1, auto.num_states).repeat_interleave(V)
    tok = torch.arange(V).repeat(auto.num_states + 1)
    adv, step = auto.advance(s, tok), auto.step(s, tok)
    pad = tok == 0
    assert torch.equal(adv[~pad], step[~pad])
    assert torch.equal(adv[pad], s[pad])  # a live state stays, the dead state (-1) stays dead


def test_stop_given_as_a_string_names_the_fix():
    lm = Tabular(2, 6, torch.zeros(6, 6), trainable=False)
    st = LMState.start(lm, 3, max_len=4)
    with pytest.raises(MalformedSequenceError, match=r"vocab.id\('</s>'\)"):
        st.segment(stop="</s>")
    assert st.segment(stop=torch.tensor([4])).stop_ids.tolist() == [4]


def test_concat_trim_padding_and_segment_refuse_bad_input_by_name():
    """Found by the public sweep: concat() with no part reached torch.cat (a bare ValueError), trim_padding of a
    float tensor returned it (NaN included), Segment(None) failed with an AttributeError inside."""
    import ppl_thought as pt
    from ppl_thought.errors import ConfigError

    with pytest.raises(ConfigError, match="at least one"):
        concat()
    with pytest.raises(ConfigError, match="pad_id"):
        concat(torch.tensor([6, 7]), pad_id=-1)
    with pytest.raises(MalformedSequenceError, match="integer token ids"):
        concat(torch.tensor([6.5, 7.0]))
    with pytest.raises(pt.errors.ArgumentTypeError, match="parts"):
        concat("ab")
    assert concat(torch.tensor([[6, 0]]), torch.tensor([[7, 8]])).tolist() == [[6, 7, 8]]
    with pytest.raises(MalformedSequenceError, match="integer token ids"):
        pt.dist.trim_padding(torch.full((2, 3), float("nan")))
    assert pt.dist.trim_padding(torch.tensor([[6, 0, 0], [7, 8, 0]])).tolist() == [[6, 0], [7, 8]]
    for bad in (None, object(), "x"):
        with pytest.raises(ConfigError, match="lm_state must be an LMState"):
            Segment(bad)


def test_masked_law_is_the_masked_softmax_computed_once_per_logits_and_state():
    """TokenRule.masked_law (Def 2.8 as weights + log normaliser): weights proportional to exp(log_probs), log Z
    equal to the logsumexp of the admitted logits, a row with no admitted token all 0 with log Z = -inf; kept for
    the same (logits, state) pair (one pass for the mass factor and the draw), recomputed once either tensor
    changes in place, forgotten by take=True; inference-mode tensors work (nothing kept). The plain rule's
    log_normaliser without a constraint is the logsumexp over every id but <pad> and <bos>."""
    from ppl_thought.vocab import BOS_ID, PAD_ID

    rule = TokenRule(PROJ.lifting("ab"), V)
    g = torch.Generator().manual_seed(1)
    n = 64
    logits = 3 * torch.randn(n, V, generator=g)
    s = rule.start(n, "cpu")
    s[::5] = PROJ.lifting("ab").num_states  # the dead state: nothing admitted
    law = rule.masked_law(logits, s)
    logq = rule.log_probs(logits, s)
    live = ~torch.isneginf(logq).all(-1)
    assert not live[::5].any() and live.sum() == n - len(range(0, n, 5))
    probs = law.weights / law.weights.sum(-1, keepdim=True)
    assert torch.allclose(probs[live], logq[live].exp(), atol=1e-6)
    assert law.weights[~live].eq(0).all() and torch.isneginf(law.log_norm[~live]).all()
    admitted = torch.logsumexp(logits.masked_fill(~rule.allowed(s), float("-inf")), -1)
    assert torch.allclose(law.log_norm[live], admitted[live], atol=1e-5)
    assert not torch.isnan(law.log_norm).any()
    assert rule.masked_law(logits, s) is law  # kept
    logits[0, 7] += 1.0  # changed in place: recomputed
    again = rule.masked_law(logits, s)
    assert again is not law and rule.masked_law(logits, s) is again
    assert rule.masked_law(logits, s, take=True) is again and rule.masked_law(logits, s) is not again
    with torch.inference_mode():
        x, st = logits.clone(), s.clone()
        a, b = rule.masked_law(x, st).log_norm.clone(), rule.masked_law(x, st).log_norm
    assert torch.allclose(a[live], b[live])
    free = TokenRule(None, V)
    ref = torch.logsumexp(logits[:, BOS_ID + 1:], -1)
    assert torch.allclose(free.log_normaliser(logits, s), ref, atol=1e-5)
    assert {PAD_ID, BOS_ID} == {0, 1}  # the slice free.log_normaliser reads
    assert torch.isneginf(free.log_normaliser(torch.full((2, V), float("-inf")), s[:2])).all()


def test_token_step_from_the_kept_law_draws_and_scores_like_the_table():
    """The draw from the kept masked law (no [n, V] log-probability table, weights changed in place) gives the
    same tokens, log-probabilities and dead rows as the table path on the same random stream; with gradients
    on, token_step reads the table and the draw's log-probability has a gradient."""
    from ppl_thought.distributions.token_rule import token_step

    rule = TokenRule(PROJ.lifting("ab"), V)
    n = 300
    g = torch.Generator().manual_seed(2)
    logits = 2 * torch.randn(n, V, generator=g)
    s = rule.start(n, "cpu")
    s[::7] = PROJ.lifting("ab").num_states
    active = torch.rand(n, generator=g) < 0.8
    kept = rule.masked_law(logits, s)  # as Constrained.log_mass leaves it
    fast = token_step(rule, logits, s, active, torch.Generator().manual_seed(9))
    assert fast.log_q is None and fast.log_norm is not None and kept.weights.data_ptr() is not None
    table = token_step(rule, logits, s, active, torch.Generator().manual_seed(9), log_probs=rule.log_probs(logits, s))
    assert torch.equal(fast.token, table.token) and torch.equal(fast.dead, table.dead)
    assert fast.dead.sum() == (active & (s == PROJ.lifting("ab").num_states)).sum() > 0
    finite = torch.isfinite(table.log_prob)
    assert torch.equal(finite, torch.isfinite(fast.log_prob))
    assert torch.allclose(fast.log_prob[finite], table.log_prob[finite], atol=1e-5)
    assert fast.log_prob[~active].eq(0).all() and not torch.isnan(fast.log_prob).any()
    leaf = logits.clone().requires_grad_()
    graded = token_step(rule, leaf, s, active, torch.Generator().manual_seed(9))
    assert graded.log_q is not None and torch.equal(graded.token, table.token)
    graded.log_prob[active & ~fast.dead].sum().backward()
    scored = active & ~fast.dead  # (a dead row's table, all -inf, has a NaN gradient: logsumexp's, as before)
    assert torch.isfinite(leaf.grad[scored]).all() and leaf.grad[scored].abs().sum() > 0
