"""Chunked encoding on the JAX side (end of Section 5.6.2): ``ptn.dist.LMSequence(..., chunk=C)`` feeds a drawn token
and the run of forced tokens after it in one LM pass (``ppl_thought/numpyro/distributions.py``, ``decode_chunked``).

Checked against the token-by-token distribution (``chunk=0``) and against enumeration, on a sparse-thought lifting
(Ex 2.4: the text between thoughts is forced, the thoughts' lengths vary, so rows stand at their own positions): the
log-probability the chunked sampler returns for each sample equals the teacher-forced ``log_prob`` of ``chunk=0``
(Tabular LM: within 1e-5; a small Transformer, whose KV cache takes ragged multi-token passes: within 1e-4), and the
samples pass a chi-square against the exact law of all 3^6 liftings. The forced-run tables are the numpy ones the
torch side reads (one function, ``projections.automaton.forced_runs``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax.numpy as jnp  # noqa: E402
from scipy.stats import chisquare  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import ConfigError  # noqa: E402
from ppl_thought.projections import SparseThoughts  # noqa: E402
from ppl_thought.projections.automaton import forced_runs  # noqa: E402
from ppl_thought.vocab import Vocab  # noqa: E402

VOCAB = Vocab(["a", "b", "c"])
V = len(VOCAB)
X = np.array(VOCAB.encode("a b c a b b c a c a b a"))
LIFT = SparseThoughts(VOCAB, 2, positions=[0, 5, 9]).lifting(X)
L = LIFT.max_len


@pytest.fixture(scope="module")
def tabular():
    return ptn.lm.Tabular(2, V, np.random.default_rng(0).normal(size=(V, V)))


def test_forced_runs_are_the_text_between_thoughts():
    """After a thought's </s>, x_0 .. x_4 and the <s> of the next thought are forced: one run of 6 tokens."""
    run_len, toks, states = forced_runs(LIFT, None, (), 64)
    z = LIFT.enumerate(limit=1000)[0]
    path = LIFT.run(np.asarray(z))
    i = z.index(VOCAB.end_think_id) + 1  # the state after the first </s>
    s = int(path[i])
    assert int(run_len[s]) == 6 and toks[s, :6].tolist() == list(z[i:i + 6]) and states[s, 6] == path[i + 6]
    assert int(run_len[int(path[1])]) == 0  # a thought token is a decision: no run


def test_chunked_samples_have_the_token_by_token_log_probs_and_the_exact_law(tabular):
    chunked = ptn.dist.LMSequence(tabular, constraint=LIFT, max_len=L, chunk=8)
    plain = ptn.dist.LMSequence(tabular, constraint=LIFT, max_len=L)
    z, lp = jax.jit(lambda k: chunked.sample_with_log_prob(k, (4000,)))(jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(plain.log_prob(z)), atol=1e-5)
    assert np.isfinite(np.asarray(lp)).all()
    # the law: every lifting of x enumerated, its probability under chunk=0
    all_z = np.array([list(s) + [0] * (L - len(s)) for s in LIFT.enumerate(limit=1000)])
    probs = np.exp(np.asarray(plain.log_prob(jnp.asarray(all_z)), np.float64))
    assert len(all_z) == 729 and abs(probs.sum() - 1) < 1e-4
    index = {tuple(r): i for i, r in enumerate(all_z.tolist())}
    counts = np.bincount([index[tuple(r)] for r in np.asarray(z).tolist()], minlength=len(all_z))
    exp = probs / probs.sum() * counts.sum()
    big = exp >= 5
    c, e = np.append(counts[big], counts[~big].sum()), np.append(exp[big], exp[~big].sum())
    assert chisquare(c, e * c.sum() / e.sum()).pvalue > 1e-3


def test_chunked_transformer_matches_token_by_token():
    lm = ptn.lm.Transformer(V, d_model=16, n_layers=2, n_heads=2, key=jax.random.PRNGKey(1))
    chunked = ptn.dist.LMSequence(lm, constraint=LIFT, max_len=L, chunk=4)
    z, lp = jax.jit(lambda k: chunked.sample_with_log_prob(k, (64,)))(jax.random.PRNGKey(2))
    plain = ptn.dist.LMSequence(lm, constraint=LIFT, max_len=L)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(plain.log_prob(z)), atol=1e-4)


def test_chunk_must_be_a_non_negative_int(tabular):
    with pytest.raises(ConfigError, match="chunk"):
        ptn.dist.LMSequence(tabular, constraint=LIFT, max_len=L, chunk=-1)
    with pytest.raises(ConfigError, match="chunk"):
        ptn.dist.LMSequence(tabular, constraint=LIFT, max_len=L, chunk=True)


def test_chunked_sampling_takes_per_row_prompts(tabular):
    """Per-row prompts ``[B, P]`` (right-padded) through the chunked loop: batch shape B, and each sample's returned
    log-probability is the token-by-token ``log_prob`` under its own row's prompt."""
    from ppl_thought.vocab import PAD_ID

    prompts = np.array([[VOCAB.id("a"), VOCAB.id("b")], [VOCAB.id("c"), PAD_ID]])
    chunked = ptn.dist.LMSequence(tabular, prompt=prompts, constraint=LIFT, max_len=L, chunk=8)
    plain = ptn.dist.LMSequence(tabular, prompt=prompts, constraint=LIFT, max_len=L)
    z, lp = chunked.sample_with_log_prob(jax.random.PRNGKey(1), (50,))
    assert z.shape == (50, 2, L) and lp.shape == (50, 2)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(plain.log_prob(z)), atol=1e-5)
    rows_differ = np.abs(np.asarray(plain.log_prob(z[:, ::-1])) - np.asarray(lp)).max()
    assert rows_differ > 1e-3  # the prompts matter: the other row's prompt scores the same z differently


def test_the_chunked_samplers_log_q_has_the_teacher_forced_gradient(tabular):
    """Reverse mode through the chunked loop (a ``lax.while_loop``, which JAX cannot differentiate; ``loop_grad``
    differentiates one teacher-forced pass over the draws instead): d sum log Q / d logits of the sampler's own log Q
    (eager and compiled) equals the gradient of ``chunk=0``'s ``log_prob`` of the same draws within 1e-5, and not
    that of other draws (the comparison is sharp)."""
    key, other = jax.random.PRNGKey(5), jax.random.PRNGKey(6)

    def sampled(params, k=key):
        d = ptn.dist.LMSequence(tabular, constraint=LIFT, max_len=L, chunk=8, params=params)
        z, lp = d.sample_with_log_prob(k, (64,))
        return lp.sum(), z

    def scored(params, z):
        return ptn.dist.LMSequence(tabular, constraint=LIFT, max_len=L, params=params).log_prob(z).sum()

    for grad in (jax.grad(sampled, has_aux=True), jax.jit(jax.grad(sampled, has_aux=True))):
        g, z = grad(tabular.params)
        want = jax.grad(scored)(tabular.params, z)
        np.testing.assert_allclose(np.asarray(g["logits"]), np.asarray(want["logits"]), atol=1e-5)
        assert np.abs(np.asarray(want["logits"])).max() > 1.0
    _, z_other = sampled(tabular.params, other)
    off = np.asarray(jax.grad(scored)(tabular.params, z_other)["logits"]) - np.asarray(g["logits"])
    assert np.abs(off).max() > 0.5
