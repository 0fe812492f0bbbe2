"""Up-front resource checks (issue 41, item 2; ppl_thought/resources.py): sizes that cannot fit are refused with a
ResourceError naming the argument, the estimate and the limit, before anything is allocated and fast; ordinary
sizes still run; PPL_THOUGHT_MAX_BYTES overrides the machine's limit.

At 1be2d3c each oversize case below reached the allocator (DefaultCPUAllocator / MemoryError), hung, or ended in an
OverflowError from jit."""

from __future__ import annotations

import time

import pytest
import torch

import ppl_thought as pt
from ppl_thought import resources
from ppl_thought.errors import ConfigError, ResourceError
from ppl_thought.projections import CharDFA, token_automaton
from ppl_thought.vocab import Vocab

VOCAB = Vocab(list("abc"))


def _big_texts() -> list:
    """The token texts of a 60,000-id vocabulary (a real LM's size): ids 0-2 special."""
    return [None, None, None] + [f"t{i}" for i in range(60_000 - 3)]


def _cases() -> dict:
    import ppl_thought.numpyro as ptn

    return {
        "Importance(2**40)": (lambda: pt.infer.Importance(2 ** 40), "num_particles=1099511627776"),
        "SMC(2**34)": (lambda: pt.infer.SMC(2 ** 34), "num_particles=17179869184"),
        "SMC(2**30, groups=2**6)": (lambda: pt.infer.SMC(2 ** 30, groups=2 ** 6), "groups=64"),
        "ptn.infer.SMC(2**34)": (lambda: ptn.infer.SMC(2 ** 34), "num_particles=17179869184"),
        "ptn.infer.Importance(2**40)": (lambda: ptn.infer.Importance(2 ** 40), "num_particles"),
        "Transformer(max_len=10**12)": (lambda: pt.lm.Transformer(8, max_len=10 ** 12), "max_len=1000000000000"),
        "ptn Transformer(max_len=10**12)": (lambda: ptn.lm.Transformer(8, max_len=10 ** 12), "max_len="),
        "Transformer(vocab_size=10**12)": (lambda: pt.lm.Transformer(10 ** 12), "vocab_size=1000000000000"),
        "PauseToThink.domain(10**9)": (lambda: pt.projections.PauseToThink(VOCAB, max_thought_len=2).domain(10 ** 9),
                                       "num_observed=1000000000"),
        "SparseThoughts.domain(10**9)": (lambda: pt.projections.SparseThoughts(VOCAB, thought_len=1,
                                                                              positions=[0]).domain(10 ** 9),
                                         "num_observed=1000000000"),
        "FirstTokenSwitch.domain(10**9)": (lambda: pt.projections.FirstTokenSwitch(VOCAB, "a").domain(10 ** 9),
                                           "num_observed=1000000000"),
        "token_automaton(max_len=10**6)": (lambda: token_automaton(CharDFA.from_regex("(t1)*"), _big_texts(),
                                                                   max_len=10 ** 6), "max_len=1000000"),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_oversize_arguments_are_refused_before_allocating(name, monkeypatch):
    monkeypatch.delenv(resources.ENV, raising=False)
    make, argument = _cases()[name]
    with pytest.raises(ResourceError):  # a first call compiles the type layer's checks and imports jax
        make()
    t0 = time.perf_counter()
    with pytest.raises(ResourceError) as info:
        make()
    assert time.perf_counter() - t0 < 1.0, name
    message = str(info.value)
    assert argument in message and "needs at least" in message and "available" in message, message
    assert resources.ENV in message  # the override is named
    assert isinstance(info.value, MemoryError)


def test_ordinary_sizes_still_run(monkeypatch):
    import pyro.distributions as dist

    monkeypatch.delenv(resources.ENV, raising=False)

    def model():
        pt.sample("z", dist.Bernoulli(0.25))

    res = pt.infer.Importance(1000).run(model, None)
    assert res.log_weights.shape == (1000,)
    assert pt.lm.Transformer(8, d_model=8, n_layers=1, n_heads=2, max_len=4096).rope_cos.shape == (4096, 2)
    auto = pt.projections.PauseToThink(VOCAB, max_thought_len=2).domain(50)
    assert auto.max_len is not None
    # the layered token automaton: its exact size is within the estimate, which is far below any limit
    lifted = token_automaton(CharDFA.from_regex("(t1)*"), _big_texts()[:50], max_len=20)
    est = resources.automaton_bytes(1 * 21 + 1, 50)
    assert lifted.next_state.nbytes <= est < 1e6


def test_the_estimates_are_exact_where_the_size_is_known():
    """The automaton estimate is the unrolled table's own size; the Transformer's is its parameters' bytes plus
    the RoPE tables (a lower bound of what the constructor allocates)."""
    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=2)
    lm = pt.lm.Transformer(8, d_model=8, n_layers=2, n_heads=2, max_len=64, tie_embeddings=False)
    params = sum(p.numel() for p in lm.parameters()) * 4
    rope = lm.rope_cos.numel() * 4 * 2
    est = resources.transformer_bytes(8, 8, 2, 2, lm.d_ff, 64, tie_embeddings=False)
    assert params + rope <= est <= params + rope + 64 * 2 * 8  # the float64 angles besides
    assert resources.kv_cache_bytes(2, 3, 4, 5, 6) == 2 * 2 * 3 * 4 * 5 * 6 * 4
    assert resources.particle_bytes(10, 2, vocab_size=5) == 10 * 2 * (32 + 5 * 4)
    auto = proj.domain(3)
    assert auto.next_state.shape[1] == len(VOCAB)


def test_the_environment_variable_overrides_the_limit(monkeypatch):
    monkeypatch.setenv(resources.ENV, "1e6")  # 1 MB: an ordinary Transformer no longer fits
    with pytest.raises(ResourceError, match=r"max_len=100000.*1e6|available \(PPL_THOUGHT_MAX_BYTES\)"):
        pt.lm.Transformer(8, d_model=8, n_layers=1, n_heads=2, max_len=100_000)
    with pytest.raises(ResourceError, match="num_particles=100000"):
        pt.infer.SMC(100_000)
    monkeypatch.setenv(resources.ENV, "unlimited")  # the check off: the size is the user's to answer for
    assert resources.available_bytes() == float("inf")
    pt.infer.SMC(2 ** 34)  # constructing allocates nothing
    monkeypatch.setenv(resources.ENV, "lots")
    with pytest.raises(ConfigError, match="PPL_THOUGHT_MAX_BYTES='lots'"):
        pt.infer.SMC(8)
    monkeypatch.setenv(resources.ENV, str(10 ** 15))
    pt.lm.Transformer(8, d_model=8, n_layers=1, n_heads=2, max_len=64)


def test_the_machine_limit_is_the_available_memory(monkeypatch):
    monkeypatch.delenv(resources.ENV, raising=False)
    limit = resources.available_bytes()
    assert 0 < limit < float("inf")
    assert resources.available_bytes("cpu") == limit or abs(resources.available_bytes("cpu") - limit) < 1e9
    if torch.cuda.is_available():  # the device's free memory, not the host's
        free, _ = torch.cuda.mem_get_info()
        assert abs(resources.available_bytes("cuda") - free) < 2e9
