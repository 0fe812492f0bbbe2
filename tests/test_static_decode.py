"""The static KV cache (ppl_thought/lm/static_cache.py) and SMC's static backend (inference/static_smc.py).

Ground truths: the dynamic KVCache's logits (bitwise, in eager mode), the generic SMC engine (bitwise the same
particles, weights and log Z-hat when no step resamples: the same uniforms, the same arithmetic), and the exact
mass of a constraint's language by enumeration (log Z-hat unbiased with resampling, where the random streams of
the two engines differ). Tests that need CUDA are skipped without it.
"""

from __future__ import annotations

import math

import pyro
import pytest
import torch

import ppl_thought as pt
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.inference import SMC
from ppl_thought.lm.static_cache import StaticKVCache, StaticTransformer, static_decoder, static_forward
from ppl_thought.program import OneTokenStep
from ppl_thought.projections import CharDFA, token_automaton, token_texts
from ppl_thought.projections.automaton import AutomatonBuilder
from ppl_thought.vocab import BOS_ID, EOS_ID

VOCAB = pt.Vocab(["a", "b", "e", "ab", "be"])
L = 4
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def model(scale: float = 8.0, device="cpu") -> pt.lm.Transformer:
    """A tiny Transformer whose next-token law depends on the context (a scaled, untied LM head)."""
    torch.manual_seed(0)
    lm = pt.lm.Transformer(len(VOCAB), d_model=32, n_layers=2, n_heads=4, max_len=64, tie_embeddings=False)
    with torch.no_grad():
        lm.lm_head.weight.mul_(scale)
    return lm.eval().to(device)


def no_e():
    return token_automaton(CharDFA.lipogram("e"), token_texts(VOCAB))


def exact_log_mass(lm, auto, prompt: list[int], T: int) -> float:
    """log P_LM(the first T tokens after the prompt are an e-free text ended by <eos>, or e-free and cut at T):
    a sum over every admitted prefix, each scored by one forward pass of its whole context (no cache)."""
    free = pt.distributions.lm_state.generated_tokens(lm.vocab_size)
    allowed, nxt, final = auto.allowed, auto.next_state, auto.final  # numpy [S, V], [S, V], [S]
    total = 0.0
    frontier = [([], auto.start, 0.0)]  # (tokens, automaton state, log-prob)
    while frontier:
        toks, s, lp = frontier.pop()
        with torch.no_grad():
            logits, _ = lm(torch.tensor([[BOS_ID] + prompt + toks]))
        logq = logits[0, -1].double().masked_fill(~free, float("-inf")).log_softmax(-1)
        for tok in allowed[s].nonzero()[0].tolist():
            s2, lp2 = int(nxt[s, tok]), lp + float(logq[tok])
            ended = tok == EOS_ID or bool(final[s2]) or len(toks) + 1 == T
            if ended:
                total += math.exp(lp2)
            else:
                frontier.append((toks + [tok], s2, lp2))
    return math.log(total)


# ------------------------------------------------------------------------------------------------ the cache
def test_static_cache_gives_bitwise_the_dynamic_logits_also_after_reorder():
    lm = model()
    ctx = torch.tensor([BOS_ID] + VOCAB.encode(["a", "b", "ab"]))
    n = 6
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for full in (False, True):
            dec = StaticTransformer(lm, n, 20)
            dec.full = full
            first = dec.start(ctx)
            logits, kv = lm(ctx[None])
            kv = kv.expand(n)
            assert torch.equal(first, logits[:, -1].expand(n, -1))
            for t in range(10):
                tok = torch.randint(2, lm.vocab_size, (n,), generator=g)
                a = dec.step(tok)
                b, kv = lm.step(tok, kv)
                if full:  # the whole buffer under a length mask: more (exactly zero) terms in the sums
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
                else:
                    assert torch.equal(a, b), (t, (a - b).abs().max())
                if t % 3 == 1:  # resampling: repeated rows
                    idx = torch.randint(0, n, (n,), generator=g)
                    addresses = [k.data_ptr() for k in dec.cache.keys]
                    dec.reorder(idx)
                    kv = kv.reorder(idx)
                    assert [k.data_ptr() for k in dec.cache.keys] == addresses  # in place: a graph keeps them


def test_static_cache_per_row_lengths_match_the_ragged_dynamic_cache():
    """Tokens with valid=False take no position and are never attended to (scratch slot): rows at their own
    lengths give the dynamic cache's ragged logits (up to float rounding: the key layouts differ)."""
    lm = model()
    n = 4
    ctx = torch.tensor([[BOS_ID] + VOCAB.encode(["a", "b"])]).expand(n, -1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        logits, kv = lm(ctx)
        static = StaticKVCache.from_cache(kv, n, 16)
        for _ in range(6):
            tok = torch.randint(2, lm.vocab_size, (n, 1), generator=g)
            valid = torch.rand(n, 1, generator=g) < 0.6
            valid[0] = True
            a = static_forward(lm, tok, static, valid)
            b, kv = lm(tok, kv, valid=valid)
            torch.testing.assert_close(a[valid[:, 0]], b[valid[:, 0]], rtol=0, atol=1e-5)
            assert torch.isfinite(a).all()
        assert torch.equal(static.lengths, kv.positions)


def test_static_cache_refuses_what_it_cannot_hold():
    lm = model()
    with pytest.raises(ConfigError, match="window"):
        StaticTransformer(pt.lm.Transformer(len(VOCAB), d_model=16, n_layers=1, n_heads=2, window=3), 2, 8)
    with pytest.raises(ConfigError, match="Tabular"):
        static_decoder(pt.lm.Tabular(2, len(VOCAB), torch.zeros(len(VOCAB), len(VOCAB))), 2, 8)
    dec = StaticTransformer(lm, 2, 4)
    with torch.no_grad():
        dec.start(torch.tensor([BOS_ID, 6, 7]))
        dec.step(torch.tensor([6, 6]))
        with pytest.raises(MalformedSequenceError, match="max_len=4"):
            dec.step(torch.tensor([6, 6]))
        with pytest.raises(MalformedSequenceError, match="1-D integer index"):
            dec.reorder(torch.tensor([0.0, 1.0]))


def test_hf_static_cache_matches_the_adapter():
    pytest.importorskip("transformers")
    from ppl_thought.lm.huggingface import HuggingFace, random_gpt2, train_bpe_tokenizer
    from ppl_thought.lm.static_cache import StaticHuggingFace

    tok = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, 300)
    lm = HuggingFace(random_gpt2(len(tok), n_layer=2, n_embd=64, n_head=2), tok)
    ctx = torch.tensor([BOS_ID] + lm.vocab.encode("the quick")[:4])
    n = 5
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        dec = StaticHuggingFace(lm, n, len(ctx) + 8)
        first = dec.start(ctx)
        logits, kv = lm(ctx[None])
        kv = kv.expand(n)
        assert torch.equal(first, logits[:, -1].expand(n, -1))
        for t in range(8):
            ids = torch.randint(7, lm.vocab_size, (n,), generator=g)
            a = dec.step(ids)
            b, kv = lm.step(ids, kv)
            assert torch.equal(torch.isfinite(a), torch.isfinite(b))
            fin = torch.isfinite(b)
            torch.testing.assert_close(a[fin], b[fin], rtol=0, atol=1e-5)
            if t % 3 == 1:
                idx = torch.randint(0, n, (n,), generator=g)
                dec.reorder(idx)
                kv = kv.reorder(idx)


# ------------------------------------------------------------------------------------------------ SMC
def _both(program, prompt, n, **kw):
    pyro.set_rng_seed(3)
    g = SMC(n, **kw).run(program, None, prompt)
    pyro.set_rng_seed(3)
    s = SMC(n, backend="static", **kw).run(program, None, prompt)
    return g, s


def _assert_same(g, s):
    assert sorted(g.samples) == sorted(s.samples)
    for k in g.samples:
        assert torch.equal(g.samples[k], s.samples[k]), k
    assert torch.equal(g.log_weights, s.log_weights)
    assert torch.equal(g.log_marginal, s.log_marginal)
    assert torch.equal(g.ancestry, s.ancestry)
    assert g.stats["ess"] == s.stats["ess"] and g.stats["resampled"] == s.stats["resampled"]
    assert g.stats["steps"] == s.stats["steps"]


@pytest.mark.parametrize("T", [3, 6])
def test_static_smc_is_bitwise_the_generic_engine_without_resampling(T):
    """ess_threshold=0: the same uniforms (the default generator, one per row per token), the same logits
    (eager static cache), the same weight arithmetic: identical particles, weights and log Z-hat."""
    program = pt.models.Constrained(model(), no_e(), T)
    prompt = torch.tensor(VOCAB.encode(["a", "b"]))
    g, s = _both(program, prompt, 16, ess_threshold=0.0)
    _assert_same(g, s)
    assert s.stats["mode"] == "static" and not s.stats["graphs"]
    assert len(set(s.log_weights.tolist())) > 4  # the weights differ between particles: a real check


def test_static_smc_is_bitwise_the_generic_engine_until_it_resamples():
    """With a separate resampling generator the token streams agree; the run below never resamples."""
    program = pt.models.Constrained(model(3.0), no_e(), 5)
    prompt = torch.tensor(VOCAB.encode(["a", "b"]))
    g, s = _both(program, prompt, 16, ess_threshold=0.4, generator=torch.Generator().manual_seed(0))
    assert not any(g.stats["resampled"])
    _assert_same(g, s)


@pytest.mark.parametrize("resampling", ["systematic", "multinomial"])
def test_static_smc_log_z_is_unbiased(resampling):
    """Mean of Z-hat / Z over 20 seeds within 3 SE of 1 (Z by enumeration), with resampling at most steps;
    the masked proposal without the mass factors has Z-hat = 1, more than 10 SE away."""
    lm, auto = model(), no_e()
    prompt = VOCAB.encode(["a", "b"])
    Z = math.exp(exact_log_mass(lm, auto, prompt, L))
    assert Z < 0.5
    program = pt.models.Constrained(lm, auto, L)
    engine = SMC(64, ess_threshold=0.9, resampling=resampling, backend="static")
    ratios, resampled = [], 0
    for seed in range(20):
        pyro.set_rng_seed(seed)
        res = engine.run(program, None, torch.tensor(prompt))
        ratios.append(math.exp(float(res.log_marginal)) / Z)
        resampled += sum(res.stats["resampled"])
    r = torch.tensor(ratios, dtype=torch.float64)
    se = float(r.std() / math.sqrt(len(r)))
    assert resampled >= 20
    assert abs(float(r.mean()) - 1) < 3 * se + 1e-3, (float(r.mean()), se)
    assert abs(1 / Z - 1) > 10 * se


class AtMostOneE(pt.Program):
    """A user-written one-token program (not a Constrained): the LM under a small hand-built automaton (at most
    one "e" token, then <eos>), ended also by a stop id ("ab"), weighted by its own log_mass (the admitted mass
    over the whole vocabulary's, and a penalty once the "e" is spent). It tells the static backend its step
    through the protocol method one_token_step()."""

    def __init__(self, lm, max_tokens: int):
        b = AutomatonBuilder(lm.vocab_size, "at_most_one_e")
        fresh, spent, end = b.add_state(), b.add_state(), b.add_state(final=True)
        plain = [VOCAB.id(t) for t in ("a", "b", "ab")]
        b.edge(fresh, plain, fresh)
        b.edge(fresh, [VOCAB.id("e"), VOCAB.id("be")], spent)
        b.edge(spent, plain, spent)
        b.edge(fresh, [EOS_ID], end)
        b.edge(spent, [EOS_ID], end)
        self.lm, self.max_tokens, self.max_steps = lm, max_tokens, max_tokens
        self.rule = TokenRule(b.build(), lm.vocab_size)
        self.stop_ids = (VOCAB.id("ab"),)

    def log_mass(self, logits, s, done):
        logits = logits.float()
        admitted = torch.logsumexp(logits.masked_fill(~self.rule.allowed(s), float("-inf")), -1)
        w = admitted - torch.logsumexp(logits, -1) - 0.25 * (s == 1).float()
        return torch.where(done, torch.zeros_like(w), w)

    def init(self, state, prompt=None):
        state["x"] = LMState.start(self.lm, pt.particles(), prompt=prompt, rule=self.rule, max_len=self.max_tokens,
                                   stop_ids=torch.tensor(self.stop_ids))

    def step(self, state, t, prompt=None):
        x = state["x"]
        log_w = self.log_mass(x.logits, x.s, x.done)
        tok = pyro.sample(f"x_{t}", x.next_token())
        x.extend(tok)
        pyro.factor(f"w_{t}", log_w)
        return torch.ones_like(x.done) if t + 1 == self.max_tokens else x.done.clone()

    def one_token_step(self):
        return OneTokenStep(self.lm, self.rule, self.max_tokens, self.stop_ids, self.log_mass)


def test_static_smc_runs_a_user_program_through_the_protocol_method_bitwise_as_the_generic_engine():
    """No Constrained, no isinstance: a pt.Program whose one_token_step() describes its step runs under
    backend="static" with bitwise the particles, weights and log Z-hat of backend="generic" (no resampling)."""
    program = AtMostOneE(model(), 6)
    assert not isinstance(program, pt.models.Constrained)
    prompt = torch.tensor(VOCAB.encode(["a", "b"]))
    g, s = _both(program, prompt, 32, ess_threshold=0.0)
    _assert_same(g, s)
    assert s.stats["mode"] == "static"
    tokens = torch.stack([s.samples[f"x_{t}"] for t in range(s.stats["steps"])], 1)
    assert (tokens == VOCAB.id("ab")).any() and (tokens == EOS_ID).any()  # both ends happen: stop id, final state
    assert ((tokens == VOCAB.id("e")) | (tokens == VOCAB.id("be"))).any()  # the automaton's second state is reached
    assert len(set(s.log_weights.tolist())) > 4


class WrongWeights(SMC):
    """SMC with a wrong weight rule injected into the one loop (log W += 2 log w_t: the target p^2) and a record of
    which policy ran each step: if the static backend had a loop of its own, it would not see the change."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.policies = []

    def _weigh(self, st, out):
        self.policies.append(st.sync)
        lw, finished, psi = super()._weigh(st, out)
        return 2 * lw - st.lw, finished, psi


@pytest.mark.parametrize("user", [False, True])
def test_static_and_generic_backends_run_the_same_loop(user):
    """The weight rule lives in the one loop (SMC._weigh, called by SMC._step): injected wrong, it changes both
    backends' weights the same way (bitwise equal to each other, twice the right log weights), and each backend ran
    it once per step, the generic kernel under the host policy, the static kernel under the device policy."""
    lm = model()
    program = AtMostOneE(lm, 5) if user else pt.models.Constrained(lm, no_e(), 5)
    prompt = torch.tensor(VOCAB.encode(["a", "b"]))
    right_g, right_s = _both(program, prompt, 16, ess_threshold=0.0)
    _assert_same(right_g, right_s)
    wrong = {}
    for backend in ("generic", "static"):
        engine = WrongWeights(16, ess_threshold=0.0, backend=backend)
        pyro.set_rng_seed(3)
        wrong[backend] = engine.run(program, None, prompt)
        assert engine.policies == [backend == "generic"] * right_g.stats["steps"]
    _assert_same(wrong["generic"], wrong["static"])
    for k in right_g.samples:  # the same draws (the weights do not steer anything without resampling)
        assert torch.equal(wrong["static"].samples[k], right_s.samples[k])
    torch.testing.assert_close(wrong["static"].log_weights, 2 * right_s.log_weights)
    assert not torch.allclose(wrong["static"].log_weights, right_s.log_weights)


def test_static_runners_are_kept_per_program_particle_count_and_prompt_length():
    """The static kernel (its buffers, loop state, graph) is reused by the next run of the same program and prompt
    length, made anew for another program or prompt length; an entry holds its program (its id is not reused while
    the entry lives), and reusing it gives the same run as a fresh engine."""
    lm = model()
    a, b = pt.models.Constrained(lm, no_e(), 3), pt.models.Constrained(lm, no_e(), 3)
    engine = SMC(8, ess_threshold=0.5, backend="static")
    p2, p3 = torch.tensor(VOCAB.encode(["a", "b"])), torch.tensor(VOCAB.encode(["a", "b", "a"]))
    runs = []
    for program, prompt in ((a, p2), (a, p2), (b, p2), (a, p3)):
        torch.manual_seed(5)
        runs.append(engine.run(program, None, prompt))
    runners = engine._static_runners
    assert len(runners) == 3
    assert all(entry[0] is entry[1].model for entry in runners.values())
    assert {id(entry[0]) for entry in runners.values()} == {id(a), id(b)}
    torch.manual_seed(5)
    fresh = SMC(8, ess_threshold=0.5, backend="static").run(a, None, p2)
    for res in runs[:3]:  # a reused runner (and b's own) give exactly a fresh engine's run
        _assert_same(fresh, res)


def test_static_smc_asks_the_protocol_method_not_the_attributes():
    """A program with lm / rule / max_tokens / stop_ids / log_mass attributes but no one_token_step() (the base
    class's returns None), and an object that is not a Program at all, are refused naming the method."""

    class NoProtocol(AtMostOneE):
        def one_token_step(self):
            return pt.Program.one_token_step(self)

    class NotAProgram:
        def init(self, state, prompt=None):
            pass

        def step(self, state, t, prompt=None):
            return None

    prompt = torch.tensor(VOCAB.encode(["a"]))
    for program in (NoProtocol(model(), 3), NotAProgram()):
        with pytest.raises(ConfigError, match="one_token_step"):
            SMC(4, backend="static").run(program, None, prompt)
    assert pt.Program().one_token_step() is None


def test_static_smc_refuses_what_it_does_not_run():
    lm, auto = model(), no_e()
    prompt = torch.tensor(VOCAB.encode(["a"]))
    program = pt.models.Constrained(lm, auto, 3)
    with pytest.raises(ConfigError, match="guide=None"):
        SMC(4, backend="static").run(program, program, prompt)
    with pytest.raises(ConfigError, match="groups"):
        SMC(4, backend="static", groups=2).run(program, None, prompt)
    with pytest.raises(ConfigError, match="residual"):
        SMC(4, backend="static", resampling="residual").run(program, None, prompt)
    with pytest.raises(ConfigError, match="twist"):
        SMC(4, backend="static").run(pt.models.Constrained(lm, auto, 3, twist=lambda x: x.sum(-1).float()), None,
                                     prompt)
    with pytest.raises(ConfigError, match="Tabular"):
        tab = pt.lm.Tabular(2, len(VOCAB), torch.zeros(len(VOCAB), len(VOCAB)))
        SMC(4, backend="static").run(pt.models.Constrained(tab, auto, 3), None, prompt)
    with pytest.raises(ConfigError, match="CUDA"):
        SMC(4, backend="static", graphs=True).run(program, None, prompt)
    with pytest.raises(ConfigError, match="backend"):
        SMC(4, backend="fast")
    with pytest.raises(ConfigError, match="backend='static'"):
        SMC(4, graphs=True)


def test_static_smc_runs_a_huggingface_model_like_the_generic_engine():
    """Through transformers' StaticCache (whole-buffer attention: logits equal up to rounding): the same tokens
    and weights within 1e-5 as the generic engine when nothing resamples."""
    pytest.importorskip("transformers")
    from ppl_thought.lm.huggingface import HuggingFace, random_gpt2, train_bpe_tokenizer

    tok = train_bpe_tokenizer(["abe ab be a b e"] * 30, 8, byte_level=False, alphabet="abe")
    lm = HuggingFace(random_gpt2(len(tok), n_layer=2, n_embd=32, n_head=2), tok)
    auto = token_automaton(CharDFA.lipogram("e"), token_texts(lm.vocab))
    program = pt.models.Constrained(lm, auto, 5)
    prompt = torch.tensor(lm.vocab.encode("ab"))
    g, s = _both(program, prompt, 16, ess_threshold=0.0)
    for k in g.samples:
        assert torch.equal(g.samples[k], s.samples[k]), k
    torch.testing.assert_close(s.log_weights, g.log_weights, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ CUDA
@cuda
def test_captured_smc_is_unbiased_and_syncs_only_at_the_end():
    lm, auto = model(), no_e()
    prompt = VOCAB.encode(["a", "b"])
    Z = math.exp(exact_log_mass(lm, auto, prompt, L))
    program = pt.models.Constrained(lm.cuda(), auto, L)
    engine = SMC(64, ess_threshold=0.9, backend="static")
    ratios = []
    for seed in range(20):
        pyro.set_rng_seed(seed)
        res = engine.run(program, None, torch.tensor(prompt))
        assert res.stats["graphs"]
        ratios.append(math.exp(float(res.log_marginal)) / Z)
    r = torch.tensor(ratios, dtype=torch.float64)
    se = float(r.std() / math.sqrt(len(r)))
    assert abs(float(r.mean()) - 1) < 3 * se + 1e-3, (float(r.mean()), se)
    runner = next(iter(engine._static_runners.values()))[1]
    runner._reset(torch.tensor([BOS_ID] + prompt, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(L):
            runner.graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
