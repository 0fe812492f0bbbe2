"""JAX compilation keyed by what the compiled run depends on (docs/numpyro.md, "Compilation"; issue 40 item 2): a
new program instance of the same class compiles nothing, even with other LM weights (they are arguments of the
compiled run, not constants: each instance gets its own exact answer); a Python scalar and the JAX array it
becomes share one compile; new shapes and new configurations compile once more and ``ptn.compile_stats()`` and
the ``ppl_thought.numpyro`` logger say why."""

import logging
import os
import pathlib
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.numpyro.infer.compiled import Fingerprint  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import custom_program_numpyro as ex  # noqa: E402

SWAPS = jnp.asarray(ex.VOCAB.encode("AB BC"), jnp.int32)
ANSWER = jnp.asarray(ex.VOCAB.id("A"), jnp.int32)


def compiles() -> int:
    return ptn.compile_stats()["count"]


class Coin(ptn.Program):
    """z ~ Bernoulli(p) (p: a JAX array attribute), y ~ Bernoulli(q[z]) observed: p(y=1) = p q1 + (1-p) q0; the
    guide is the exact posterior, so every weight is p(y) and log Z-hat is exact."""

    max_steps = 1

    def __init__(self, p: float, q: tuple[float, float]):
        self.p, self.q = jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32)

    def step(self, state, t, y):
        n = ptn.particles()
        z = ptn.sample("z", nd.Bernoulli(probs=jnp.full(n, self.p)))
        ptn.observe("y", nd.Bernoulli(probs=self.q[z]), y)
        return jnp.ones(n, bool)


class CoinPosterior(ptn.Program):
    max_steps = 1

    def __init__(self, coin: Coin, y: int):
        joint = np.array([(1 - coin.p) * (coin.q[0] if y else 1 - coin.q[0]), coin.p * (coin.q[1] if y else
                                                                                     1 - coin.q[1])])
        self.post1 = jnp.asarray(joint[1] / joint.sum(), jnp.float32)

    def step(self, state, t, y):
        n = ptn.particles()
        ptn.sample("z", nd.Bernoulli(probs=jnp.full(n, self.post1)))
        return jnp.ones(n, bool)


def coin_log_z(p: float, q: tuple[float, float], y: int) -> float:
    py1 = p * q[1] + (1 - p) * q[0]
    return float(np.log(py1 if y else 1 - py1))


@pytest.mark.parametrize("engine", ["IS", "SMC"])
def test_new_instances_with_other_tables_share_one_compile_and_keep_their_answers(engine):
    """Two instances of one class with different JAX arrays (and guides with different posteriors): one
    compile between them, each log Z-hat exact (the posterior guide: every weight is p(y))."""
    eng = (lambda: ptn.infer.Importance(16)) if engine == "IS" else (lambda: ptn.infer.SMC(16, ess_threshold=0.5))
    cases = [(0.3, (0.2, 0.9)), (0.7, (0.6, 0.1)), (0.5, (0.5, 0.99))]
    got = []
    for i, (p, q) in enumerate(cases):
        coin = Coin(p, q)
        before = compiles()
        res = eng().run(coin, CoinPosterior(coin, 1), 1, rng_key=i)
        if i:
            assert compiles() == before, ptn.compile_stats()["compiles"][-1]
        got.append(float(res.log_marginal))
        np.testing.assert_allclose(np.asarray(res.log_weights), coin_log_z(p, q, 1), atol=1e-5)
    assert len({round(g, 4) for g in got}) == 3  # three answers: nothing was baked into the compiled run


def test_new_lm_weights_are_arguments_not_constants():
    """The question -> thought -> answer program with another LM (other weights, same shapes): no compile, and
    log Z by exhaustive enumeration differs as the weights do and equals the torch program's enumeration."""
    torch = pytest.importorskip("torch")
    import custom_program as tex

    swaps_t, answer_t = torch.tensor(ex.VOCAB.encode("AB BC")), torch.tensor(ex.VOCAB.id("A"))
    exact = {}
    for i, err in enumerate((0.1, 0.3)):
        before = compiles()
        exact[err] = ex.exact(ex.WhichCup(ex.tracker_lm(err=err), 2), SWAPS, ANSWER)
        if i:
            assert compiles() == before  # a new WhichCup, a new Enumerate guide, a new LM: the same compiled run
        torch_exact = tex.exact(tex.WhichCup(tex.tracker_lm(err=err)), swaps_t, answer_t)[0]
        assert abs(exact[err] - torch_exact) < 1e-4, (err, exact[err], torch_exact)
    assert abs(exact[0.1] - exact[0.3]) > 0.05, exact


def test_a_python_scalar_and_its_array_share_one_compile():
    """``3`` and ``jnp.array(3)`` (and numpy's int64) are the same int32[] argument: one compile, one answer."""
    coin = Coin(0.3, (0.2, 0.9))
    guide = CoinPosterior(coin, 1)
    ptn.infer.SMC(8).run(coin, guide, 1)
    before = compiles()
    outs = [float(ptn.infer.SMC(8).run(coin, guide, y, rng_key=2).log_marginal)
            for y in (1, jnp.array(1), np.int64(1), jnp.asarray(1, jnp.int32), np.asarray(1))]
    assert compiles() == before and len(set(outs)) == 1
    assert abs(outs[0] - coin_log_z(0.3, (0.2, 0.9), 1)) < 1e-5


class Walk(ptn.Program):
    """A random walk on 3 states observed with noise, as many steps as x has entries (finished flags)."""

    max_steps = 6

    def __init__(self):
        self.A = jnp.asarray([[0.8, 0.1, 0.1], [0.2, 0.6, 0.2], [0.1, 0.3, 0.6]], jnp.float32)
        self.B = jnp.asarray([[0.9, 0.1], [0.3, 0.7], [0.5, 0.5]], jnp.float32)

    def init(self, state, x):
        state["z"] = jnp.zeros(ptn.particles(), jnp.int32)

    def step(self, state, t, x):
        z = ptn.sample("z", nd.Categorical(probs=self.A[state["z"]]))
        ptn.observe("x", nd.Categorical(probs=self.B[z]), x[t])
        state["z"] = z
        return jnp.broadcast_to(t == x.shape[0] - 1, z.shape)


def walk_log_z(x) -> float:
    A, B = np.asarray(Walk().A, np.float64), np.asarray(Walk().B, np.float64)
    alpha = np.eye(3)[0]
    for xt in x:
        alpha = (alpha @ A) * B[:, xt]
    return float(np.log(alpha.sum()))


def test_new_shapes_compile_once_and_say_why(caplog):
    """x of another length: one compile, recorded as "new shapes (x: (4,) int32)" and logged; the same length
    again: none. Results stay exact (Importance over all 3^T paths with an enumerating guide is too big here, so:
    within 3 SE of the forward algorithm over seeds)."""
    eng = ptn.infer.Importance(2000)
    x5, x4 = jnp.asarray([0, 1, 1, 0, 1], jnp.int32), jnp.asarray([1, 1, 0, 0], jnp.int32)
    eng.run(Walk(), None, x5)
    before = compiles()
    with caplog.at_level(logging.INFO, logger="ppl_thought.numpyro"):
        res = eng.run(Walk(), None, x4, rng_key=3)
    assert compiles() == before + 1
    why = ptn.compile_stats()["compiles"][-1]
    assert why["engine"] == "Importance" and why["program"] == "Walk" and why["why"] == "new shapes (x: (4,) int32)"
    assert any("new shapes (x: (4,) int32)" in r.getMessage() and r.name == "ppl_thought.numpyro"
               for r in caplog.records)
    assert abs(float(res.log_marginal) - walk_log_z([1, 1, 0, 0])) < 3 * float(res.log_marginal_stderr)
    res2 = eng.run(Walk(), None, jnp.asarray([0, 0, 0, 1], jnp.int32), rng_key=4)
    assert compiles() == before + 1
    assert abs(float(res2.log_marginal) - walk_log_z([0, 0, 0, 1])) < 3 * float(res2.log_marginal_stderr)


def test_a_new_configuration_compiles_and_names_the_attribute():
    lm = ex.tracker_lm()
    ptn.infer.SMC(8).run(ex.WhichCup(lm, 2), None, SWAPS, ANSWER)
    before = compiles()
    ptn.infer.SMC(8).run(ex.WhichCup(lm, 2, "factor"), None, SWAPS, ANSWER)
    assert compiles() == before + 1
    assert ptn.compile_stats()["compiles"][-1]["why"] == "new configuration (check)"
    ptn.infer.SMC(16).run(ex.WhichCup(lm, 2, "factor"), None, SWAPS, ANSWER)
    assert ptn.compile_stats()["compiles"][-1]["why"] == "new engine configuration (num_particles 8 -> 16)"


def test_the_whole_trace_importance_path_keys_by_configuration_too():
    """SlowThinking as a whole-trace NumPyro model: a new model object with another prior (same shapes) reuses
    the compiled run, and each estimate is within 3 SE of its exact log p(x) (enumeration)."""
    from ppl_thought.projections import PauseToThink

    vocab = ex.VOCAB
    proj = PauseToThink(vocab, max_thought_len=1)
    x = np.array(vocab.encode("A"))
    models = [ptn.models.SlowThinking(ptn.lm.Tabular(2, len(vocab), np.random.default_rng(s).normal(
        size=(len(vocab),) * 2)), proj) for s in range(2)]
    ptn.infer.Importance(4000).run(models[0], None, x)
    before = compiles()
    est = []
    for m in models:
        res = ptn.infer.Importance(4000).run(m, None, x, rng_key=5)
        est.append(float(res.log_marginal))
        assert abs(est[-1] - float(m.exact_log_prob(x))) < 3 * float(res.log_marginal_stderr) + 1e-4
    assert compiles() == before and abs(est[0] - est[1]) > 0.05


def test_a_cache_hit_of_the_whole_trace_path_neither_retraces_nor_recompiles(monkeypatch):
    """A whole-trace model run again (another seed, another instance of the same configuration) calls the compiled
    function it stored exactly as the first run did: JAX traces the weight function once in three runs (a
    keyword call on the hit path was a second trace and a second XLA compile of the whole run), and each run's
    weights are the exact p(y = 1) of the coin (no guide: the prior proposes, w = p(y | z))."""
    from ppl_thought.numpyro.infer import importance

    traced = []
    inner = importance.log_weight_fn
    monkeypatch.setattr(importance, "log_weight_fn", lambda *a: traced.append(1) or inner(*a))

    class Flip:
        def __init__(self, p: float):
            self.p = jnp.asarray(p, jnp.float32)

        def __call__(self, y):
            z = numpyro.sample("z", nd.Bernoulli(probs=self.p))
            numpyro.sample("y", nd.Bernoulli(probs=jnp.where(z == 1, 0.9, 0.2)), obs=y)

    before = compiles()
    for seed, p in enumerate((0.25, 0.25, 0.6)):
        res = ptn.infer.Importance(8).run(Flip(p), None, 1, rng_key=seed)
        z = np.asarray(res.samples["z"])
        np.testing.assert_allclose(np.asarray(res.log_weights), np.log(np.where(z == 1, 0.9, 0.2)), atol=1e-6)
    assert compiles() - before <= 1 and len(traced) == 1, (len(traced), ptn.compile_stats()["compiles"][-1:])


def test_the_fingerprint_keys_arrays_by_shape_and_values_by_value():
    class Holder:
        def __init__(self, table, scale, name="h"):
            self.table, self.scale, self.name = table, scale, name
            self._lookup_cache = {"anything": object()}  # a memo table: not configuration

    a, b = Holder(jnp.zeros(3), 2), Holder(jnp.ones(3), 2)
    fa, fb = Fingerprint((a,)), Fingerprint((b,))
    assert fa.key == fb.key and len(fa.arrays) == 1
    assert Fingerprint((Holder(jnp.ones(4), 2),)).key != fa.key  # new shape
    assert Fingerprint((Holder(jnp.ones(3), 3),)).key != fa.key  # new configuration
    assert Fingerprint((Holder(np.ones(3), 2),)).key != Fingerprint((Holder(np.zeros(3), 2),)).key  # numpy: value
    assert Fingerprint((Holder(jnp.ones(3), 2),), trace_arrays=False).key != \
        Fingerprint((Holder(jnp.zeros(3), 2),), trace_arrays=False).key
    (rebuilt,) = fa.rebuild([jnp.full(3, 7.0)])
    assert rebuilt is not a and float(rebuilt.table[0]) == 7.0 and float(a.table[0]) == 0.0 and rebuilt.scale == 2
    shared = Holder(jnp.zeros(2), 1)
    pair = Fingerprint((Holder(shared, 1), Holder(shared, 1)))
    m1, m2 = pair.rebuild([jnp.ones(2)])
    assert m1.table is m2.table  # an object shared by model and guide stays shared
