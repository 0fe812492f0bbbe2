"""Per-row prompts on the JAX side (issue 40): ``ptn.dist.LMState.start(lm, n, prompt=[r, P])`` right-padded with
``<pad>``, r dividing n (each prompt to n / r consecutive rows, the torch rule), against row-by-row runs with each
row's prompt alone (1-D, shared): the next-token laws, after ``extend`` too, for a trigram Tabular (also against
the table read by hand) and a Transformer; and a user's ``ptn.Program`` that reads per-row prompts under
``ptn.infer.Importance`` has, particle by particle, the log weight of the row-by-row program."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import ppl_thought as pt  # noqa: E402
import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import MalformedSequenceError  # noqa: E402
from ppl_thought.numpyro.dist import LMState  # noqa: E402
from ppl_thought.vocab import BOS_ID, PAD_ID, Vocab  # noqa: E402

VOCAB = Vocab(["a", "b", "c"])
V = len(VOCAB)
A, B, C = (VOCAB.id(t) for t in "abc")
PROMPTS = np.array([[A, B, C], [B, PAD_ID, PAD_ID], [C, A, PAD_ID]])  # ragged, right-padded
ANSWERS = np.array([[A, C], [B, B], [C, A]])
TABLE = np.random.default_rng(0).normal(0.0, 1.5, (V,) * 3).astype(np.float32)


def _lms(tmp_path):
    torch.manual_seed(0)
    t = pt.lm.Transformer(V, d_model=16, n_layers=2, n_heads=2, max_len=32)
    with torch.no_grad():
        t.lm_head.weight.mul_(3.0)
    return {"tabular": ptn.lm.Tabular.from_numpy(TABLE),
            "transformer": ptn.lm.Transformer.load(t.save(tmp_path / "lm"))}


def _row(i: int) -> np.ndarray:
    return PROMPTS[i][PROMPTS[i] != PAD_ID]


@pytest.mark.parametrize("which", ["tabular", "transformer"])
def test_per_row_prompts_equal_row_by_row_states(which, tmp_path):
    lm = _lms(tmp_path)[which]
    n = 6  # r = 3 prompts, 2 rows each
    st = LMState.start(lm, n, prompt=PROMPTS, max_len=3)
    rows = [LMState.start(lm, 1, prompt=_row(i // 2), max_len=3) for i in range(n)]
    np.testing.assert_allclose(np.asarray(st.logp), np.concatenate([np.asarray(r.logp) for r in rows]), atol=1e-5)
    if which == "tabular":  # the trigram read by hand: the last two tokens of <bos> + prompt
        for i in range(n):
            ctx = np.concatenate([[BOS_ID, BOS_ID], _row(i // 2)])[-2:]
            want = TABLE[ctx[0], ctx[1]] - np.log(np.exp(TABLE[ctx[0], ctx[1]]).sum())
            np.testing.assert_allclose(np.asarray(st.logp[i]), want, atol=1e-5)
    feed = np.repeat(ANSWERS, 2, 0)  # then two tokens per row
    st = st.extend(jnp.asarray(feed))
    for i, r in enumerate(rows):
        r = r.extend(jnp.asarray(feed[i:i + 1]))
        np.testing.assert_allclose(np.asarray(st.logp[i]), np.asarray(r.logp[0]), atol=1e-5)


class _Answer(ptn.Program):
    """A user's program: the LM reads its row's question (per-row prompts) and we observe a two-token answer."""

    max_steps = 1

    def __init__(self, lm, prompts: np.ndarray, answers: np.ndarray):
        self.lm, self.prompts, self.answers = lm, prompts, answers

    def init(self, state):
        state["lm"] = LMState.start(self.lm, ptn.particles(), prompt=self.prompts, max_len=2)

    def step(self, state, t):
        n = ptn.particles()
        ans = jnp.asarray(self.answers)
        ans = jnp.repeat(ans, n // ans.shape[0], 0) if ans.ndim == 2 else jnp.broadcast_to(ans, (n, ans.shape[0]))
        ptn.observe("a0", state["lm"].next_token(), ans[:, 0])
        state["lm"] = state["lm"].extend(ans[:, 0])
        ptn.observe("a1", state["lm"].next_token(), ans[:, 1])
        return jnp.ones(n, bool)


def test_a_program_with_per_row_prompts_has_the_row_by_row_log_weights(tmp_path):
    lm = _lms(tmp_path)["transformer"]
    res = ptn.infer.Importance(6).run(_Answer(lm, PROMPTS, ANSWERS), None, rng_key=jax.random.PRNGKey(0))
    for i, lw in enumerate(np.asarray(res.log_weights)):
        one = ptn.infer.Importance(1).run(_Answer(lm, _row(i // 2), ANSWERS[i // 2]), None,
                                          rng_key=jax.random.PRNGKey(0))
        assert abs(float(lw) - float(one.log_weights[0])) < 1e-5, i
    assert len(set(np.round(np.asarray(res.log_weights), 4))) == 3  # three prompts, three different answers' laws
    with pytest.raises(MalformedSequenceError, match="r dividing n = 4"):
        LMState.start(lm, 4, prompt=PROMPTS)


# ---------------------------------------------------------------------------------------------- ptn.dist.LMSequence
AUTO_LEN = 3


def _torch_lm(tmp_path):
    torch.manual_seed(0)
    t = pt.lm.Transformer(V, d_model=16, n_layers=2, n_heads=2, max_len=32)
    with torch.no_grad():
        t.lm_head.weight.mul_(3.0)
    return t, ptn.lm.Transformer.load(t.save(tmp_path / "lm_seq"))


def test_lm_sequence_with_per_row_prompts_equals_row_by_row_and_torch(tmp_path):
    """``ptn.dist.LMSequence(lm, prompt=[B, P])``: batch shape B; log_prob of every value (also broadcast over a
    sample dim) equals the one-prompt LMSequence of its row, and the torch LMSequence with the same per-row prompts
    on the same weights, within 1e-5; a sample of shape [S] puts prompt i % B on row i (torch's rule) and its
    log-probabilities are the row-by-row ones of the drawn values."""
    t, lm = _torch_lm(tmp_path)
    eos = VOCAB.id("<eos>")
    d = ptn.dist.LMSequence(lm, prompt=PROMPTS, stop=eos, max_len=AUTO_LEN)
    assert d.batch_shape == (3,)
    values = np.array([[A, eos, PAD_ID], [B, C, A], [eos, PAD_ID, PAD_ID]])
    got = np.asarray(d.log_prob(jnp.asarray(values)))
    rows = [float(ptn.dist.LMSequence(lm, prompt=_row(i), stop=eos, max_len=AUTO_LEN).log_prob(values[i]))
            for i in range(3)]
    np.testing.assert_allclose(got, rows, atol=1e-5)
    tq = pt.dist.LMSequence(t, prompt=torch.as_tensor(PROMPTS), stop=eos, max_len=AUTO_LEN)
    with torch.no_grad():
        want = tq.log_prob(torch.as_tensor(values)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    two = np.asarray(d.log_prob(jnp.asarray(np.stack([values, values]))))  # [2, 3]: broadcast over the prompts
    np.testing.assert_allclose(two, np.stack([got, got]), atol=1e-6)
    z, lp = d.sample_with_log_prob(jax.random.PRNGKey(0), (4,))
    assert z.shape == (4, 3, AUTO_LEN)
    z, lp = np.asarray(z), np.asarray(lp)
    for s in range(4):
        for b in range(3):
            one = ptn.dist.LMSequence(lm, prompt=_row(b), stop=eos, max_len=AUTO_LEN)
            assert abs(float(one.log_prob(z[s, b])) - lp[s, b]) < 1e-5, (s, b)
    with pytest.raises(MalformedSequenceError, match="padding inside"):
        ptn.dist.LMSequence(lm, prompt=np.array([[A, PAD_ID, B]]), max_len=2)


def test_lm_sequence_per_row_prompt_law_matches_row_by_row_enumeration():
    """The law of the draws of row b (a trigram Tabular, max_len 2, no stop: V^2 outcomes) is the enumerated law
    under prompt b alone: total variation under 0.05 with 4000 draws per row."""
    lm = ptn.lm.Tabular.from_numpy(TABLE)
    d = ptn.dist.LMSequence(lm, prompt=PROMPTS, max_len=2)
    z = np.asarray(d.sample(jax.random.PRNGKey(1), (4000,)))  # [4000, 3, 2]
    grid = np.array([[i, j] for i in range(V) for j in range(V) if i not in (PAD_ID, BOS_ID) and
                     j not in (PAD_ID, BOS_ID)])
    for b in range(3):
        exact = np.exp(np.asarray(ptn.dist.LMSequence(lm, prompt=_row(b), max_len=2).log_prob(jnp.asarray(grid))))
        assert abs(exact.sum() - 1) < 1e-4
        codes = z[:, b, 0] * V + z[:, b, 1]
        emp = np.array([(codes == g[0] * V + g[1]).mean() for g in grid])
        assert 0.5 * np.abs(emp - exact).sum() < 0.05, b
