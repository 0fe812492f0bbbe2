"""The tokenizer check on the JAX side (issue 41, item 6): a token automaton built from another tokenizer's texts
of the same size is refused where it meets a JAX LM whose vocabulary is known (``lm.vocab``, which
``ptn.lm.Transformer.load`` reads from the checkpoint, or ``LMSequence(vocab=...)``), with the torch side's error
class and message; one built for this vocabulary passes; without the check the LM writes strings outside the
constraint (the silent old answer). The case mirrors tests/test_numeric_edges.py's torch test."""

import dataclasses
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import numpy as np  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import ConfigError, TokenizerMismatchError  # noqa: E402
from ppl_thought.projections import CharDFA, token_automaton, token_texts  # noqa: E402
from ppl_thought.vocab import Vocab  # noqa: E402

OURS, OTHER = Vocab(["a", "e", "x"]), Vocab(["e", "a", "x"])  # same size, the texts of "a" and "e" swapped
NO_E = CharDFA.lipogram("e")
N = 6


@pytest.fixture(scope="module")
def automata():
    foreign = token_automaton(NO_E, token_texts(OTHER))
    own = token_automaton(NO_E, token_texts(OURS))
    assert foreign.tokenizer != own.tokenizer and foreign.vocab_size == own.vocab_size == len(OURS)
    return foreign, own


def _lm(vocab=None):
    lm = ptn.lm.Tabular(1, len(OURS), np.zeros(len(OURS), np.float32))  # every admissible token equally likely
    lm.vocab = vocab
    return lm


def test_an_automaton_from_another_tokenizers_texts_is_refused_where_it_meets_a_jax_lm(automata):
    foreign, own = automata
    with pytest.raises(TokenizerMismatchError, match="another tokenizer") as e:
        ptn.dist.LMSequence(_lm(OURS), constraint=foreign, max_len=N)
    assert isinstance(e.value, ConfigError) and "token_texts(lm.vocab)" in str(e.value)
    assert "ptn.dist.LMSequence" in str(e.value)
    # an LM without a vocabulary, the vocabulary given to the distribution: the same check
    with pytest.raises(TokenizerMismatchError, match=r"LMSequence \(its vocab=\)"):
        ptn.dist.LMSequence(_lm(), constraint=foreign, max_len=N, vocab=OURS)
    assert ptn.dist.LMSequence(_lm(OURS), constraint=own, max_len=N).constraint is own
    assert ptn.dist.LMSequence(_lm(), constraint=own, max_len=N, vocab=OURS).constraint is own
    # nothing to compare: no vocabulary anywhere, or an automaton built from a table (no fingerprint)
    assert ptn.dist.LMSequence(_lm(), constraint=foreign, max_len=N).constraint is foreign
    unchecked = dataclasses.replace(foreign, tokenizer=None)
    d = ptn.dist.LMSequence(_lm(OURS), constraint=unchecked, max_len=N)
    # the silent old answer: the unchecked foreign automaton lets the LM write "e" (its id is "a" in OTHER)
    z = np.asarray(d.sample(jax.random.PRNGKey(0), (64,)))
    assert (z == OURS.id("e")).any()
    # the accepted automaton keeps the constraint: no "e" in 64 draws, and every draw scores finitely
    d = ptn.dist.LMSequence(_lm(OURS), constraint=own, max_len=N)
    z = d.sample(jax.random.PRNGKey(0), (64,))
    assert not (np.asarray(z) == OURS.id("e")).any()
    assert np.isfinite(np.asarray(d.log_prob(z))).all()


def test_fragment_texts_pass_as_on_torch():
    v = Vocab(["a", "b"])
    auto = token_automaton(CharDFA.lipogram("b"), token_texts(v, keep_fragments=True))
    lm = ptn.lm.Tabular(1, len(v), np.zeros(len(v), np.float32))
    lm.vocab = v
    assert ptn.dist.LMSequence(lm, constraint=auto, max_len=4).constraint is auto


def test_a_loaded_transformer_carries_its_vocabulary(tmp_path, automata):
    foreign, own = automata
    lm = ptn.lm.Transformer(len(OURS), d_model=8, n_layers=1, n_heads=2, max_len=16)
    assert lm.vocab is None
    lm.save(tmp_path / "with", vocab=OURS)
    lm.save(tmp_path / "without")
    loaded = ptn.lm.Transformer.load(tmp_path / "with")
    assert loaded.vocab is not None and loaded.vocab.to_dict() == OURS.to_dict()
    with pytest.raises(TokenizerMismatchError, match="another tokenizer"):
        ptn.dist.LMSequence(loaded, constraint=foreign, max_len=N)
    assert ptn.dist.LMSequence(loaded, constraint=own, max_len=N).constraint is own
    assert ptn.lm.Transformer.load(tmp_path / "without").vocab is None
    # saved again without naming it, the vocabulary it was loaded with is kept
    loaded.save(tmp_path / "again")
    assert ptn.lm.Transformer.load_vocab(tmp_path / "again").to_dict() == OURS.to_dict()


def test_a_torch_checkpoint_loads_with_its_vocabulary(tmp_path, automata):
    torch = pytest.importorskip("torch")
    import ppl_thought as pt

    foreign, _ = automata
    torch.manual_seed(0)
    pt.lm.Transformer(len(OURS), d_model=8, n_layers=1, n_heads=2, max_len=16).save(tmp_path / "t", vocab=OURS)
    with pytest.raises(TokenizerMismatchError, match="another tokenizer"):
        ptn.dist.LMSequence(ptn.lm.Transformer.load(tmp_path / "t"), constraint=foreign, max_len=N)
