"""pt.lm.HuggingFace: a transformers causal LM as a ppl_thought LM, on tiny models built in process
(tests/hf_models.py; nothing is downloaded).

Checked against the model itself: LMSequence log-probabilities equal the HF model's teacher-forced
log-softmax; cached, reordered, expanded and ragged (``valid``) forwards equal plain full runs; caches
are values. Checked against exact answers: every guide family is a law on the lifting (its
probabilities sum to 1 by enumeration), Importance and SMC estimate log Z of a slow-thinking model and
of the lipogram race program within a few standard errors of exact enumeration.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import subprocess
import sys
from pathlib import Path

import hf_models as H  # skips the module without transformers
import pyro
import pytest
import torch

from ppl_thought.distributions import LMSequence
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.errors import MalformedSequenceError, MissingDependencyError, UnknownTokenError, VocabularyError
from ppl_thought.guides import Causal, Explanatory, Identity, Inquisitive, Posterior, Predictive
from ppl_thought.inference import SMC, Importance
from ppl_thought.lm import GatedLM, HuggingFace, KVCache
from ppl_thought.models import SlowThinking
from ppl_thought.projections import PauseToThink, token_texts
from ppl_thought.training import SVI, OneSampler, SamplerPolicyGradient, Sum
from ppl_thought.vocab import BOS_ID, EOS_ID, EXPLAIN_ID, PAD_ID, THINK_ID, Vocab


def finite_close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> None:
    """Same -inf pattern, finite entries within atol."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb)
    assert (a[fa] - b[fb]).abs().max().item() <= atol


def ids(lm: HuggingFace, text: str) -> torch.Tensor:
    return torch.tensor([BOS_ID] + lm.vocab.encode(text))[None]


@pytest.fixture(scope="module")
def lm() -> HuggingFace:
    return H.shared_byte_level()


# ------------------------------------------------------------------------------------------ vocabulary
def test_vocab_maps_specials_and_round_trips_text(lm):
    v, tok = lm.vocab, lm.tokenizer
    hf = tok.get_vocab()
    assert v.hf_ids[BOS_ID] == v.hf_ids[EOS_ID] == hf["<|endoftext|>"]  # GPT-2: one token for both
    assert [v.hf_ids[i] for i in (THINK_ID, THINK_ID + 1, EXPLAIN_ID)] == [hf[m] for m in ("<think>", "</think>",
                                                                                        "<explain>")]
    assert v.hf_ids[PAD_ID] == -1 and v.library_ids[hf["<|endoftext|>"]] == EOS_ID
    assert sorted(v.hf_ids[1:].tolist()) == sorted([*range(len(tok)), hf["<|endoftext|>"]])  # every HF id
    text = "hello there, the lazy fox <think>jumps</think> over<explain>zq!"
    enc = v.encode(text)
    assert enc == v.library_ids[tok.encode(text, add_special_tokens=False)].tolist()
    assert v.decode(enc) == text
    assert enc[enc.index(THINK_ID) + 1 :].count(THINK_ID + 1) == 1 and EXPLAIN_ID in enc
    assert v.decode([PAD_ID] + enc + [PAD_ID]) == text
    assert v.tokenize("hello") == [v.token(i) for i in v.encode("hello")]
    assert v.encode(["<s>", v.token(v.encode("hello")[0])]) == [THINK_ID, v.encode("hello")[0]]
    assert isinstance(v, Vocab) and len(v) == lm.vocab_size == len(tok) + 2  # + <pad>, + the shared bos/eos


def test_markers_are_added_once_and_embeddings_grow():
    tok = H.train_bpe_tokenizer(H.TEXTS, 300)
    model = H.random_gpt2(len(tok))
    first = HuggingFace(model, tok, add_markers=True)
    size, rows = len(tok), model.get_input_embeddings().num_embeddings
    assert size == 303 and rows == 303 and model.lm_head.weight.shape[0] == 303
    second = HuggingFace(model, tok)  # the tokenizer has the markers now: nothing added, nothing resized
    assert len(tok) == size and model.get_input_embeddings().num_embeddings == rows
    assert second.vocab == first.vocab
    bare = H.train_bpe_tokenizer(H.TEXTS, 300)
    with pytest.raises(VocabularyError, match="add_markers=True"):
        Vocab.from_tokenizer(bare)
    assert len(bare) == 300
    with pytest.raises(VocabularyError, match="bos/eos"):
        Vocab.from_tokenizer(bare, think="<|endoftext|>", add_markers=True)
    with pytest.raises(VocabularyError, match="not a tokenizer"):
        Vocab.from_tokenizer(object())
    with pytest.raises(VocabularyError, match="saved with its tokenizer"):
        first.vocab.to_dict()


def test_llama_style_tokenizer_keeps_its_s_for_bos():
    lm = H.llama()
    v, hf = lm.vocab, lm.tokenizer.get_vocab()
    assert v.hf_ids[BOS_ID] == hf["<s>"] and v.hf_ids[EOS_ID] == hf["</s>"]
    assert v.hf_ids[THINK_ID] == hf["<think>"]  # the library's <s> is not Llama's <s>
    assert "hf:<pad>" in v.specials and "<unk>" in v.specials  # the tokenizer's other specials: context only
    assert not set(v.ordinary_ids.tolist()) & {v.id("<unk>"), v.id("hf:<pad>")}
    assert v.encode("<s>hi</s>")[0] == BOS_ID and v.encode("<s>hi</s>")[-1] == EOS_ID


def test_from_pretrained_reads_a_local_folder(tmp_path):
    lm = H.byte_level(0)
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    again = HuggingFace.from_pretrained(str(tmp_path), model_kwargs={"attn_implementation": "sdpa"})
    assert again.vocab == lm.vocab and len(again.tokenizer) == len(lm.tokenizer)  # markers saved, not re-added
    x = ids(lm, "hello there")
    with torch.no_grad():
        finite_close(again(x)[0], lm(x)[0], 1e-6)  # from_pretrained gives an eval-mode model
    dist = LMSequence(again, prompt=again.vocab.encode("Once upon"), stop="<eos>", vocab=again.vocab, max_len=5)
    z, _ = dist.sample_with_log_prob((2,))
    assert all(isinstance(again.vocab.decode(row), str) for row in z)


def test_missing_transformers_is_a_clear_error(monkeypatch):
    tok = H.byte_tokenizer()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependencyError, match=r"ppl-thought\[hf\]"):
        HuggingFace(torch.nn.Linear(1, 1), tok)
    assert issubclass(MissingDependencyError, ImportError)
    # a fresh interpreter without transformers imports the library and the adapter's module
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['tokenizers'] = None\n"
            "import ppl_thought as pt, torch\n"
            "from ppl_thought.errors import MissingDependencyError\n"
            "class Tok:  # what the adapter reads of a tokenizer (the hint), without transformers to build one\n"
            "    def get_vocab(self): return {}\n    def encode(self, *a, **k): return []\n"
            "    def decode(self, *a, **k): return ''\n"
            "try:\n    pt.lm.HuggingFace(torch.nn.Linear(1, 1), Tok())\n"
            "except MissingDependencyError as e:\n    print('ok', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0 and out.stdout.startswith("ok") and "[hf]" in out.stdout, out.stderr[-2000:]


# ------------------------------------------------------------------------------------------ forward
def test_log_prob_equals_hf_teacher_forced(lm):
    """log P(z) under LMSequence = sum_i log_softmax(HF logits)[z_i] of the model's own run, within 1e-5
    (our float32 against the HF logits' exact log-softmax; per token, and summed over 6 tokens: a total
    near -35 is as far as float32 summation keeps 1e-5)."""
    prompt = lm.vocab.encode("the quick brown")
    n, L = 12, 6
    dist = LMSequence(lm, prompt=prompt, max_len=L)
    torch.manual_seed(0)
    z, lp = dist.sample_with_log_prob((n,))
    with torch.no_grad():
        lp2 = dist.log_prob(z)
        steps, complete = dist.step_log_probs(z)
        inputs = lm.to_hf(torch.cat([torch.tensor([BOS_ID] + prompt).expand(n, -1), z[:, :-1]], 1))
        logq = torch.log_softmax(lm.model(input_ids=inputs).logits.double(), -1)[:, len(prompt):]
        ref_steps = logq.gather(-1, lm.to_hf(z)[..., None]).squeeze(-1)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all() and complete.all()
    assert (steps.double() - ref_steps).abs().max() < 1e-5
    ref = ref_steps.sum(-1)
    assert (lp.double() - ref).abs().max() < 1e-5 and (lp2.double() - ref).abs().max() < 1e-5, (lp, ref)
    # under a constraint: the model's softmax renormalised over the admitted tokens (Def 2.8)
    race = load_race()
    auto = race.lipogram_constraint(token_texts(lm.vocab))
    cdist = LMSequence(lm, prompt=prompt, constraint=auto, max_len=L)
    zc, lpc = cdist.sample_with_log_prob((8,))
    allowed_hf = torch.zeros(len(lm.tokenizer), dtype=torch.bool)
    allowed_hf[lm.to_hf(torch.as_tensor(auto.allowed[0].nonzero()[0]))] = True
    with torch.no_grad():
        inputs = lm.to_hf(torch.cat([torch.tensor([BOS_ID] + prompt).expand(8, -1), zc[:, :-1]], 1))
        logits = lm.model(input_ids=inputs).logits.double()[:, len(prompt):]
        logq = torch.log_softmax(logits.masked_fill(~allowed_hf, -math.inf), -1)
        # a row ends with <eos> (the lifted automaton's final state), <pad> after it: no terms there
        ref = logq.gather(-1, lm.to_hf(zc)[..., None]).squeeze(-1).masked_fill(zc == PAD_ID, 0)
        ref = ref.sum(-1)
    assert (lpc.double() - ref).abs().max() < 1e-5, (lpc, ref)
    assert all(not set("eE") & set(lm.vocab.decode(row[row != EOS_ID])) for row in zc)


@pytest.mark.parametrize("grad", [False, True])
def test_cached_chunks_equal_a_full_run(lm, grad):
    x = ids(lm, "hello there the quick brown fox jumps").expand(2, -1)
    with torch.set_grad_enabled(grad):
        full, _ = lm(x)
        cache, parts = None, []
        for a, b in [(0, 3), (3, 4), (4, 9), (9, x.shape[1])]:  # chunks, then single steps
            out, cache = lm(x[:, a:b], cache=cache)
            parts.append(out)
        assert cache.length == x.shape[1]
        finite_close(torch.cat(parts, 1).detach(), full.detach(), 1e-5)
    assert full.dtype == torch.float32 and torch.isneginf(full[..., PAD_ID]).all()
    assert torch.isneginf(full[..., BOS_ID]).all() and torch.isfinite(full[..., EOS_ID]).all()


def test_reorder_and_expand_equal_fresh_runs(lm):
    a, b = ids(lm, "hello world"), ids(lm, "lazy dog ok")
    L = min(a.shape[1], b.shape[1])
    x = torch.cat([a[:, :L], b[:, :L]])
    nxt = torch.tensor([[lm.vocab.encode("fox")[0]]])
    with torch.no_grad():
        _, cache = lm(x)
        index = torch.tensor([1, 1, 0, 1, 0])  # repeated indices: resampling
        out, _ = lm(nxt.expand(5, -1), cache=cache.reorder(index))
        ref, _ = lm(torch.cat([x, nxt.expand(2, -1)], 1))
        finite_close(out[:, 0], ref[index, -1])
        _, c1 = lm(a)
        out, c3 = lm(nxt.expand(3, -1), cache=c1.expand(3))
        ref, _ = lm(torch.cat([a, nxt], 1))
        finite_close(out[:, 0], ref[:, -1].expand(3, -1))
        assert c3.batch_size == 3 and c3.length == a.shape[1] + 1
    with pytest.raises(MalformedSequenceError, match="1-D integer index"):
        cache.reorder(torch.tensor([[0]]))


def test_ragged_rows_equal_unpadded_runs(lm):
    """valid=False tokens are skipped: each row computes what it would on its valid tokens alone, and
    so does every later step (positions and the attention mask live in the cache)."""
    x = ids(lm, "she sells sea shells by the sea shore")[:, :10]
    valid = torch.tensor([[True, False, True, True, False, True],
                          [True] * 6,
                          [False, False, True, False, True, True]])
    later = torch.tensor([[lm.vocab.encode("dog")[0]]] * 3)
    for impl in ("sdpa", "eager"):
        m = lm if impl == "sdpa" else H.byte_level(0, attn_implementation="eager")
        with torch.no_grad():
            _, c = m(x[:, :4])
            out, c2 = m(x[:, 4:10].expand(3, -1), cache=c.expand(3), valid=valid)
            out2, c3 = m(later, cache=c2)
            out3, _ = m(later, cache=c3.reorder(torch.tensor([2, 2, 0])))
            assert c2.ragged and c2.positions.tolist() == [4 + int(r.sum()) for r in valid]
            kept = []
            for r in range(3):
                row = x[0, :4].tolist() + [t for t, ok in zip(x[0, 4:10].tolist(), valid[r].tolist()) if ok]
                kept.append(row)
                ref, _ = m(torch.tensor([row + [later[0, 0].item()] * 2]))
                finite_close(out[r, valid[r]], ref[0, 4:len(row)])
                finite_close(out2[r, 0], ref[0, len(row)])
            for r, src in enumerate([2, 2, 0]):
                ref, _ = m(torch.tensor([kept[src] + [later[0, 0].item()] * 2]))
                finite_close(out3[r, 0], ref[0, -1])


def test_ragged_rope_model_equals_unpadded_runs():
    lm = H.llama()
    x = ids(lm, "hello there quick fox jumps")[:, :8]
    valid = torch.tensor([[True, False, True, True], [False, True, False, True]])
    with torch.no_grad():
        _, c = lm(x[:, :4])
        out, c2 = lm(x[:, 4:8].expand(2, -1), cache=c.expand(2), valid=valid)
        nxt, _ = lm(x[:, :1].expand(2, -1), cache=c2)
        for r in range(2):
            row = x[0, :4].tolist() + [t for t, ok in zip(x[0, 4:8].tolist(), valid[r].tolist()) if ok]
            ref, _ = lm(torch.tensor([row + [x[0, 0].item()]]))
            finite_close(out[r, valid[r]], ref[0, 4:len(row)])
            finite_close(nxt[r, 0], ref[0, -1])


def test_sliding_window_model_decodes_in_recompute_mode():
    """Sliding-window layers: the cache keeps every key and the model's own (index-based) window mask is
    exact for dense rows; ragged rows are refused, so LMState re-runs contexts instead (exact, slower)."""
    lm = H.mistral()
    assert lm.sliding and not lm.valid_mask_supported
    x = ids(lm, "hello there the quick brown fox jumps")
    with torch.no_grad():
        full, _ = lm(x)
        cache, parts = None, []
        for a, b in [(0, 3), (3, 4), (4, 9), (9, x.shape[1])]:
            out, cache = lm(x[:, a:b], cache=cache)
            parts.append(out)
        finite_close(torch.cat(parts, 1), full)
        finite_close(full, lm.library_logits(lm.model(input_ids=lm.to_hf(x)).logits), 1e-6)
        with pytest.raises(NotImplementedError, match="sliding"):
            lm(x[:, :2], valid=torch.tensor([[True, False]]))
    state = LMState.start(lm, 3, prompt=torch.tensor(lm.vocab.encode("the")), max_len=5,
                          stop_ids=torch.tensor([EOS_ID]))
    assert state.mode == "recompute"
    seg = state.segment(max_tokens=3)
    v, lp = seg.sample_with_log_prob()
    assert torch.allclose(seg.log_prob(v), lp, atol=1e-5)


def test_caches_are_values(lm):
    """A forward never changes the cache it was given: one prefix continued two ways, then the first way
    again, gives the first answer again (in place appends copy when they would overwrite a sibling)."""
    x = ids(lm, "the lazy dog")
    a, b = torch.tensor([[lm.vocab.encode("fox")[0]]]), torch.tensor([[lm.vocab.encode("sun")[0]]])
    with torch.no_grad():
        _, c = lm(x)
        keys = [k.clone() for k in c.keys]
        la, ca = lm(a, cache=c)
        la2, _ = lm(a, cache=ca)  # grows ca in place
        lb, cb = lm(b, cache=c)   # branches from c: must not overwrite ca's entries
        la3, _ = lm(a, cache=ca)
        assert c.length == x.shape[1] and all(torch.equal(k, k0) for k, k0 in zip(c.keys, keys))
        finite_close(la3, la2, 0.0)
        ref, _ = lm(torch.cat([x, b], 1))
        finite_close(lb[:, 0], ref[:, -1])
        assert not torch.equal(la, lb)


def test_bad_input_names_the_problem(lm):
    with pytest.raises(UnknownTokenError, match="outside the vocabulary"):
        lm(torch.tensor([[1, lm.vocab_size]]))
    with pytest.raises(MalformedSequenceError, match="LongTensor"):
        lm(torch.tensor([1.0, 2.0]))
    _, c = lm(torch.tensor([[1, 7]]))
    with pytest.raises(MalformedSequenceError, match="rows"):
        lm(torch.tensor([[7], [7]]), cache=c)
    with pytest.raises(MalformedSequenceError, match="max_position_embeddings"):
        lm(torch.ones(1, 300, dtype=torch.long))
    with pytest.raises(MalformedSequenceError, match="valid must be"):
        lm(torch.tensor([[1, 7]]), valid=torch.ones(1, 3, dtype=torch.bool))


def test_bfloat16_model_gives_float32_log_probs():
    lm = H.byte_level(0)
    prompt = lm.vocab.encode("hello")
    z, lp32 = LMSequence(lm, prompt=prompt, max_len=6).sample_with_log_prob((4,))
    lm.model.to(torch.bfloat16)
    dist = LMSequence(lm, prompt=prompt, max_len=6)
    with torch.no_grad():
        lp16 = dist.log_prob(z)
        logits, _ = lm(ids(lm, "hello"))
    assert logits.dtype == torch.float32 and lp16.dtype == torch.float32
    assert (lp16 - lp32).abs().max() < 0.2  # bf16 weights: close, not equal
    z2, lp = dist.sample_with_log_prob((4,))
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()


def test_decoding_loop_runs_in_valid_mode(lm):
    """LMState uses the KV cache with ragged rows (not the recompute fallback): the prompt is encoded
    once and shared, segments end at different lengths, and sampled values score the same."""
    state = LMState.start(lm, 6, prompt=torch.tensor(lm.vocab.encode("the quick")), max_len=8,
                          stop_ids=torch.tensor([EOS_ID]))
    assert state.mode == "valid" and state.cache.batch_size == 6
    seg = state.segment(stop=lm.vocab.encode("e"), max_tokens=4)
    torch.manual_seed(1)
    v, lp = seg.sample_with_log_prob()
    assert torch.allclose(seg.log_prob(v), lp, atol=1e-5)
    state.extend(v)
    seg2 = state.segment(max_tokens=3)
    v2, lp2 = seg2.sample_with_log_prob()
    assert torch.allclose(seg2.log_prob(v2), lp2, atol=1e-5)


# ------------------------------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def thinking():
    """SlowThinking(HF prior, PauseToThink(vocab, 1)) over the 7-token character BPE; x has 2 tokens, so
    the lifting has (1 + 7)^2 = 64 latent sequences."""
    prior = H.small(0)
    proj = PauseToThink(prior.vocab, 1)
    model = SlowThinking(prior, proj)
    x = prior.vocab.encode(["a", "ba"])
    return model, x


def make_guide(kind: str, model: SlowThinking):
    proj = model.projection
    if kind == "identity":
        return Identity(model)
    if kind == "predictive":
        return Predictive(H.small(11), proj)
    if kind == "causal":
        return Causal(H.small(12), proj)
    if kind == "explanatory":
        return Explanatory(H.small(13), proj)
    if kind == "explanatory_gated":
        g = GatedLM(H.small(14))
        torch.nn.init.normal_(g.gate[-1].weight, std=1.0)
        return Explanatory(g, proj)
    if kind == "posterior":
        return Posterior(model)
    if kind == "inquisitive":
        return Inquisitive(model)
    raise KeyError(kind)


KINDS = ["identity", "predictive", "causal", "explanatory", "explanatory_gated", "posterior", "inquisitive"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_guide_is_a_law_on_the_lifting_and_weights_are_exact(thinking, kind, device):
    """Each guide's probabilities sum to 1 over the enumerated lifting; its samples score what they were
    drawn with; Importance with it estimates log Z within 4 standard errors of exact enumeration."""
    model, x = thinking
    q = make_guide(kind, model)
    model.prior.to(device)
    if getattr(q, "lm", None) is not None:
        q.lm.to(device)
    support, _ = model.enumerate_log_joint(x)
    assert support.shape[0] == 64
    with torch.no_grad():
        lq = q.log_prob(support, x)
    assert not torch.isnan(lq).any() and abs(lq.exp().sum().item() - 1) < 1e-5
    pyro.set_rng_seed(0)
    z, lz = q.sample_with_log_prob(x, 64)
    with torch.no_grad():
        assert torch.allclose(lz, q.log_prob(z, x), atol=1e-5)
        res = Importance(400).run(model, q, x)
    exact = model.exact_log_prob(x).item()
    err, se = abs(res.log_marginal.item() - exact), res.log_marginal_stderr.item()
    model.prior.to("cpu")  # the module-scoped fixture is shared
    assert err <= 4 * se + 1e-4 and se < 0.15, (kind, err, se)


@pytest.mark.parametrize("engine", ["importance", "smc"])
def test_engines_match_exact_log_z(thinking, engine):
    """log Z-hat of Importance and SMC (resampling after every segment) with an HF causal guide, the log of
    the mean Z-hat of 4 runs of 2000 particles, against exact enumeration (2.22): the bound (0.06, about 4
    standard errors) is far inside the error of a wrong weight (dropping q's correction moves log Z by
    more than 1)."""
    model, x = thinking
    guide = Causal(H.small(12), model.projection)
    exact = model.exact_log_prob(x).item()
    est = []
    for seed in range(4):
        pyro.set_rng_seed(seed)
        with torch.no_grad():
            res = (Importance(2000) if engine == "importance" else SMC(2000, ess_threshold=1.0)).run(model, guide, x)
        est.append(res.log_marginal.item())
    mean = torch.tensor(est).exp().mean().log().item()
    assert abs(mean - exact) < 0.06, (est, exact)
    if engine == "smc":
        assert res.stats["mode"] == "valid" and all(res.stats["resampled"][:-1])


def load_race():
    path = Path(__file__).parent.parent / "benchmarks" / "llamppl_race.py"
    spec = importlib.util.spec_from_file_location("llamppl_race", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_race_program_estimates_the_lipogram_mass_exactly():
    """The benchmark's SMC program (masked proposal, factor = admitted mass, resampling at ESS n/2) on a
    tiny model: Z-hat = P(the LM writes no 'c' in 3 tokens or before <eos>) against enumeration of every
    admitted sequence under the unmasked LM."""
    race = load_race()
    lm = H.small(3, n_embd=16)
    auto = race.lipogram_constraint(token_texts(lm.vocab), letter="c")
    admitted = race.admitted_ids(auto).tolist()
    assert [lm.vocab.token(i) for i in admitted] == ["<eos>", "a", "b", "ab", "ba"]
    prompt = torch.tensor(lm.vocab.encode("ab"))
    T = 3
    seqs = []
    for k in range(1, T + 1):
        for s in itertools.product(admitted, repeat=k):
            if EOS_ID in s[:-1] or (k < T and s[-1] != EOS_ID):
                continue
            seqs.append(list(s) + [PAD_ID] * (T - k))
    p = LMSequence(lm, prompt=prompt, stop=EOS_ID, max_len=T)
    with torch.no_grad():
        exact = torch.logsumexp(p.log_prob(torch.tensor(seqs)), 0).item()
    assert -3.0 < exact < -0.05  # the constraint matters
    program = race.Lipogram(lm, auto, T)
    est = []
    for seed in range(4):
        pyro.set_rng_seed(seed)
        with torch.no_grad():
            res = SMC(1000, ess_threshold=1.0).run(program, None, prompt)  # resample (reorder caches) every step
        assert res.stats["mode"] == "valid" and res.stats["resampled"][1]  # (step 0's weights are all equal)
        est.append(res.log_marginal.item())
    mean = torch.tensor(est).exp().mean().log().item()
    assert abs(mean - exact) < 0.05, (est, exact)  # about 4 standard errors; without the factor: 1.65 off


def test_smc_encodes_the_prompt_once_and_never_re_encodes():
    """Through the whole SMC run of the race program (resampling at every step), the HF model reads the
    prompt once (one row) and then one token per live particle per step: resampling gathers caches."""
    race = load_race()
    lm = H.byte_level(0)
    seen = []
    hook = lm.model.register_forward_pre_hook(lambda mod, args, kw: seen.append(tuple(kw["input_ids"].shape)),
                                              with_kwargs=True)
    prompt = torch.tensor(lm.vocab.encode("the quick brown fox"))
    n, T = 32, 6
    with torch.no_grad():
        pyro.set_rng_seed(0)
        program = race.Lipogram(lm, race.lipogram_constraint(token_texts(lm.vocab)), T)
        res = SMC(n, ess_threshold=1.0).run(program, None, prompt)
    hook.remove()
    assert seen[0] == (1, 1 + len(prompt)) and sum(res.stats["resampled"]) >= T - 2
    assert all(shape[1] == 1 and shape[0] <= n for shape in seen[1:]) and len(seen) <= T


def test_svi_step_changes_the_guides_hf_parameters():
    prior = H.small(0)
    model = SlowThinking(prior, PauseToThink(prior.vocab, 1))
    x = prior.vocab.encode(["a", "ba"])
    pyro.clear_param_store()
    guide_lm = H.small(21)
    guide = Causal(guide_lm, model.projection)
    before = {k: p.detach().clone() for k, p in guide_lm.named_parameters()}
    svi = SVI(Sum(OneSampler(8), SamplerPolicyGradient(8)), {"lr": 0.05})  # (3.17) + (3.25): trains P and Q
    losses = [svi.step(model, guide, x) for _ in range(2)]
    assert all(math.isfinite(v) for v in losses)
    changed = [k for k, p in guide_lm.named_parameters() if not torch.equal(p.detach(), before[k])]
    assert any("wte" in k for k in changed) and any(".h.0." in k for k in changed)
    prior_params = {id(p) for p in model.prior.parameters()}
    assert not prior_params & {id(p) for p in guide_lm.parameters()}


def test_cache_is_the_library_kvcache(lm):
    _, c = lm(ids(lm, "hi"))
    assert isinstance(c, KVCache) and c.num_layers == 2 and lm.valid_mask_supported
    rule = TokenRule(None, lm.vocab_size)
    assert rule.allowed(torch.zeros(1, dtype=torch.long))[0, EOS_ID]


def test_library_logits_copy_blocks_equal_the_gather(lm):
    """library_logits copies the HF logits block by block (the library order is the HF order in a few blocks):
    the same as one gather over the vocabulary, -inf where the library id has no HF logit; a mapping of many
    blocks falls back to the gather."""
    from ppl_thought.lm.huggingface import _copy_runs

    hf = torch.randn(3, 2, lm.model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    assert lm._output_runs is not None and len(lm._output_runs) <= 8
    blocks = lm.library_logits(hf)
    ref = hf.index_select(-1, lm._hf_output).index_fill_(-1, lm._no_logit, float("-inf"))
    assert blocks.dtype == torch.float32 and torch.equal(blocks, ref)
    assert torch.isneginf(blocks[..., PAD_ID]).all() and torch.isneginf(blocks[..., BOS_ID]).all()
    assert _copy_runs([0, 1, 2, 0, 5, 6], {3}) == ((0, 0, 3), (4, 5, 2))
    assert _copy_runs(list(range(100, 0, -1)), set(), most=64) is None
    bf = lm.library_logits(hf.bfloat16())
    assert bf.dtype == torch.float32 and torch.equal(bf, ref.bfloat16().float())
