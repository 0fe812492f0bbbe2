"""The NumPyro backend against the torch side and exact answers: exact_log_prob (2.22) on every projection,
per-sequence LMSequence log_prob (Def 2.8), the HMM forward algorithm (3.1), IS (3.2) and SMC log Z-hat within 3
standard errors of the exact answer, ProjectionLift = SlowThinking, SVI's ELBO, the ArviZ converter, and the
import boundary (no torch on the JAX side, no jax on the torch side)."""

import ast
import itertools
import math
import os
import pathlib
import subprocess
import sys

import pytest

# XLA's cheap backend passes: these tests compile many small programs (3x faster compiles on a loaded CPU)
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import torch  # noqa: E402
from numpyro.handlers import seed, substitute, trace  # noqa: E402

import ppl_thought as pt  # noqa: E402
import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import MalformedSequenceError, NotDisentangledError, UnknownTokenError  # noqa: E402
from ppl_thought.projections import (  # noqa: E402
    CharDFA,
    FirstTokenSwitch,
    Identity,
    PauseToThink,
    Product,
    QueryResponse,
    SparseThoughts,
    token_automaton,
    token_texts,
)
from ppl_thought.vocab import Vocab  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB = Vocab(["a", "b"])


def torch_tabular(V, seed_, order=3, scale=1.5):
    g = torch.Generator().manual_seed(seed_)
    return pt.lm.Tabular(order, V, torch.randn((V,) * order, generator=g) * scale, trainable=False)


def both(V, seed_, order=3):
    """The same table on both sides: the torch Tabular, and the JAX one loaded from its exported logits."""
    t = torch_tabular(V, seed_, order)
    return t, ptn.lm.Tabular.from_numpy(t.logits.detach().numpy())


def projections():
    return {
        "identity": Identity(VOCAB),
        "product": Product.build(["a", "b"], ["u", "v"]),
        "pause": PauseToThink(VOCAB, max_thought_len=2),
        "sparse": SparseThoughts(VOCAB, thought_len=1, positions=[0, 2]),
        "query_response": QueryResponse(VOCAB, max_thought_len=1),
        "switch": FirstTokenSwitch(VOCAB, repeat_token="a"),
    }


# ---------------------------------------------------------------------------------------------- LM parity
@pytest.mark.parametrize("order", [1, 2, 3])
def test_tabular_apply_matches_torch_with_ragged_valid_rows(order):
    t, j = both(len(VOCAB), 3, order)
    rng = np.random.default_rng(order)
    toks = rng.integers(2, len(VOCAB), size=(4, 6))
    valid = rng.random((4, 6)) < 0.7
    tl, _ = t(torch.as_tensor(toks), valid=torch.as_tensor(valid))
    jl, cache = j.apply(j.params, j.init_cache(4, 6), toks, valid=valid)
    assert np.abs(torch.log_softmax(tl, -1).numpy() - np.asarray(jl)).max() < 1e-5
    # incremental == whole: feed the same tokens one at a time through the cache
    c = j.init_cache(4, 6)
    for i in range(6):
        step, c = j.apply(j.params, c, toks[:, i : i + 1], valid=valid[:, i : i + 1])
        assert np.abs(np.asarray(step[:, 0]) - np.asarray(jl[:, i])).max() < 1e-6
    picked = np.asarray(ptn.lm.reorder(cache, jnp.array([3, 0]))["context"])
    assert (picked == np.asarray(cache["context"])[[3, 0]]).all()


# ---------------------------------------------------------------------------------------------- (2.22) parity
@pytest.mark.parametrize("name", list(projections()))
def test_exact_log_prob_equals_torch_on_every_projection(name):
    proj = projections()[name]
    t, j = both(len(proj.vocab), sum(map(ord, name)) % 97)
    tm, jm = pt.models.SlowThinking(t, proj), ptn.models.SlowThinking(j, proj)
    sigma = proj.observable_ids.tolist()
    worst, total = 0.0, {1: [], 2: []}
    for n in (1, 2):
        for xs in itertools.product(sigma, repeat=n):
            x = np.array(xs)
            a, b = float(tm.exact_log_prob(x)), float(jm.exact_log_prob(x))
            assert not math.isnan(b)
            assert (a == b == -math.inf) or abs(a - b) < 1e-5, (name, xs, a, b)
            if math.isfinite(a):
                worst = max(worst, abs(a - b))
            total[n].append(b)
    for n, lps in total.items():  # (2.22) sums to one over Sigma^n on the JAX side too
        assert abs(float(np.exp(np.logaddexp.reduce(np.array(lps)))) - 1.0) < 1e-4, (name, n)


def test_exact_log_prob_outside_the_image_is_minus_inf():
    t, j = both(len(VOCAB), 1)
    proj = PauseToThink(VOCAB, 1)
    x = np.array([VOCAB.id("a"), VOCAB.think_id])  # <s> is not observable: the lifting is empty
    assert float(ptn.models.SlowThinking(j, proj).exact_log_prob(x)) == -math.inf
    assert float(pt.models.SlowThinking(t, proj).exact_log_prob(x)) == -math.inf
    with pytest.warns(UserWarning, match="-inf"):
        res = ptn.infer.Importance(4).run(ptn.models.SlowThinking(j, proj), None, x)
    assert float(res.log_marginal) == -math.inf


def test_lmsequence_under_a_chardfa_token_automaton_matches_torch():
    """Token automata from a CharDFA: every accepted string scored on both sides; the language's masked mass is 1."""
    vocab = Vocab(["a", "b", "c"])
    auto = token_automaton(CharDFA.from_regex("a(b|c)*a"), token_texts(vocab), max_len=5)
    t, j = both(len(vocab), 11)
    strings = auto.enumerate()
    z = np.zeros((len(strings), auto.max_len), np.int64)
    for i, s in enumerate(strings):
        z[i, : len(s)] = s
    a = pt.dist.LMSequence(t, constraint=auto).log_prob(torch.as_tensor(z)).numpy()
    b = np.asarray(jax.jit(ptn.dist.LMSequence(j, constraint=auto).log_prob)(z))
    assert np.abs(a - b).max() < 1e-5
    assert abs(float(np.exp(np.logaddexp.reduce(b))) - 1.0) < 1e-4


def test_lmsequence_log_prob_per_sequence_equals_torch_and_sampling_is_the_law():
    proj = PauseToThink(VOCAB, max_thought_len=2)
    t, j = both(len(VOCAB), 5)
    dom = proj.domain(3)
    tdist, jdist = pt.dist.LMSequence(t, constraint=dom), ptn.dist.LMSequence(j, constraint=dom)
    z, lp = jax.jit(lambda k: jdist.sample_with_log_prob(k, (256,)))(jax.random.PRNGKey(0))
    z = np.asarray(z)
    scored = np.asarray(jax.jit(jdist.log_prob)(z))
    torch_lp = tdist.log_prob(torch.tensor(z, dtype=torch.long)).numpy()
    assert np.isfinite(scored).all()
    assert np.abs(scored - np.asarray(lp)).max() < 1e-5  # the sampler's log-probs are the scorer's
    assert np.abs(scored - torch_lp).max() < 1e-5
    # torch samples scored on the JAX side; and sequences outside the domain / incomplete / too long: -inf
    tz = tdist.sample((64,))
    assert np.abs(tdist.log_prob(tz).numpy() - np.asarray(jdist.log_prob(tz.numpy()))).max() < 1e-5
    bad = z[:4].copy()
    bad[0, 0] = VOCAB.end_think_id  # </s> first: outside Dom(Proj)
    bad[1, np.argmax(bad[1] == 0) - 1] = 0  # cut: incomplete
    out = np.asarray(jdist.log_prob(bad))
    ref = tdist.log_prob(torch.as_tensor(bad, dtype=torch.long)).numpy()
    assert out[0] == -np.inf and out[1] == -np.inf and not np.isnan(out).any()
    assert np.array_equal(np.isneginf(out), np.isneginf(ref))
    # the empirical law of the samples is the scored law (chi-square on the 5 most frequent sequences)
    rows, counts = np.unique(z, axis=0, return_counts=True)
    p = np.exp(np.asarray(jdist.log_prob(rows)))
    top = np.argsort(-counts)[:5]
    expected = 256 * p[top]
    chi2 = float(((counts[top] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, chi2  # 5 cells: P(chi2_5 > 20.5) < 0.001


def test_malformed_values_raise_named_errors():
    _, j = both(len(VOCAB), 2)
    d = ptn.dist.LMSequence(j, max_len=4)
    with pytest.raises(MalformedSequenceError):
        d.log_prob(np.array([[6, 0, 7, 0]]))
    with pytest.raises(UnknownTokenError):
        d.log_prob(np.array([[6, 99, 0, 0]]))
    with pytest.raises(MalformedSequenceError):
        d.log_prob(np.array([[6, 7, 6, 7, 6]]))
    with pytest.raises(NotDisentangledError):
        ptn.guides.Identity(ptn.models.SlowThinking(both(len(VOCAB), 2)[1], FirstTokenSwitch(VOCAB, "a")))


# ---------------------------------------------------------------------------------------------- HMM (3.1)
def test_hmm_forward_backward_and_theorem_2_3_equal_torch():
    rng = np.random.default_rng(0)
    A, B, lam = rng.dirichlet(np.ones(3), 3), rng.dirichlet(np.ones(2), 3), rng.dirichlet(np.ones(3))
    A[0, 2] = 0.0
    A[0] /= A[0].sum()
    th, jh = pt.models.HMM(A, B, lam), ptn.models.HMM(A, B, lam)
    x = rng.integers(0, 2, size=(5, 7))
    assert np.abs(th.log_prob(torch.as_tensor(x)).numpy() - np.asarray(jh.log_prob(x))).max() < 1e-5
    assert np.abs(th.prefix_log_probs(torch.as_tensor(x)).numpy() - np.asarray(jh.prefix_log_probs(x))).max() < 1e-5
    tb, jb = th.backward(torch.as_tensor(x)).numpy(), np.asarray(jh.backward(x))
    assert np.abs(np.where(np.isfinite(tb), tb - jb, 0)).max() < 1e-5
    assert np.array_equal(np.isfinite(tb), np.isfinite(jb))
    assert abs(float(th.brute_force_log_prob(torch.as_tensor(x[0]))) - float(jh.log_prob(x[0]))) < 1e-5
    # Theorem 2.3: the same bigram table as the torch side, and Proj # P = P_{A,B,lam} exactly
    tproj, tprior = pt.models.slow_thinking_parts(th)
    jproj, jprior = jh.as_slow_thinking_parts()
    tl, jl = tprior.logits.numpy(), np.asarray(jprior.params["logits"])
    assert np.array_equal(np.isneginf(tl), np.isneginf(jl))
    assert np.abs(np.where(np.isfinite(tl), tl, 0) - np.where(np.isfinite(jl), jl, 0)).max() < 1e-6
    model = ptn.models.SlowThinking(jprior, jproj)
    ids = np.array([jproj.vocab.id(a) for a in jh.observable_tokens])
    for row in x[:2, :3]:
        assert abs(float(model.exact_log_prob(ids[row])) - float(jh.log_prob(row))) < 1e-5
    # the posterior guide gives zero-variance importance weights equal to P(x) (3.1)
    res = ptn.infer.Importance(16).run(jh, jh.posterior_guide(), x[0], rng_key=jax.random.PRNGKey(3))
    assert np.abs(np.asarray(res.log_weights) - float(jh.log_prob(x[0]))).max() < 1e-4


# ---------------------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def pause_model():
    proj = PauseToThink(VOCAB, max_thought_len=2)
    _, j = both(len(VOCAB), 7)
    guide_lm = ptn.lm.Tabular.from_numpy(torch_tabular(len(VOCAB), 8, order=2, scale=1.0).logits.numpy())
    model = ptn.models.SlowThinking(j, proj)
    x = np.array(VOCAB.encode("ab"))
    return model, guide_lm, x, float(model.exact_log_prob(x))


def test_importance_is_within_three_standard_errors_and_a_biased_estimator_is_not(pause_model):
    model, guide_lm, x, exact = pause_model
    guide = ptn.guides.Causal(guide_lm, model.projection)
    for s in (0, 1):
        res = ptn.infer.Importance(512).run(model, guide, x, rng_key=jax.random.PRNGKey(s))
        se = float(res.log_marginal_stderr)
        assert abs(float(res.log_marginal) - exact) < 3 * se, (s, float(res.log_marginal), exact, se)
        assert 0 < float(res.ess) <= 512
        # the biased variant: the mean log weight (an ELBO, Jensen) sits far below log p by more than 3 SE
        biased = float(jnp.mean(res.log_weights))
        assert exact - biased > 3 * se
    # the exact posterior as a guide: every weight is p(x) (zero variance)
    res = ptn.infer.Importance(8).run(model, ptn.guides.Posterior(model), x, rng_key=jax.random.PRNGKey(0))
    assert np.abs(np.asarray(res.log_weights) - exact).max() < 1e-5


@pytest.mark.parametrize("guide_name", ["identity", "causal"])
def test_smc_with_resampling_is_within_three_standard_errors(pause_model, guide_name):
    model, guide_lm, x, exact = pause_model
    guide = ptn.guides.Identity(model) if guide_name == "identity" else ptn.guides.Causal(guide_lm, model.projection)
    res = ptn.infer.SMC(64, ess_threshold=1.0, groups=8).run(model, guide, x, rng_key=jax.random.PRNGKey(4))
    assert bool(np.asarray(res.stats["resampled"]).any())  # the compiled loop did resample
    est, se = float(res.stats["log_marginal_pooled"]), float(res.stats["log_marginal_pooled_stderr"])
    assert abs(est - exact) < 3 * se, (est, exact, se)
    # a biased variant: averaging the groups' log Z-hats (Jensen: log E >= E log) is lower than the pooled one
    assert float(jnp.mean(res.log_marginal)) <= est + 1e-6
    assert res.ancestry.shape == (8, len(x), 64)
    z = np.asarray(res.samples["z"][0])
    lift = model.projection.lifting(x)
    assert all(lift.accepts(row[row != 0]) for row in z)  # every final particle lies in the lifting of x


def test_bootstrap_smc_without_resampling_is_importance_sampling(pause_model):
    model, _, x, exact = pause_model
    res = ptn.infer.SMC(512, ess_threshold=0.0).run(model, None, x, rng_key=jax.random.PRNGKey(5))
    assert not bool(np.asarray(res.stats["resampled"]).any())
    assert abs(float(res.log_marginal) - exact) < 3 * float(res.log_marginal_stderr)


def _transformer_pair(V: int, seed: int, tmp_path):
    """A tiny torch Transformer with visible weights and its JAX twin loaded from its checkpoint."""
    torch.manual_seed(seed)
    t = pt.lm.Transformer(V, d_model=16, n_layers=1, n_heads=2, max_len=64).eval()
    with torch.no_grad():
        for p in t.parameters():
            p.normal_(0.0, 0.4)
    return t, ptn.lm.Transformer.load(t.save(tmp_path / f"lm{seed}"))


@pytest.mark.parametrize("lm_kind", ["tabular", "transformer"])
def test_smc_on_slow_thinking_runs_the_generic_program_path_with_torch_parity(lm_kind, tmp_path, request):
    """SlowThinking under ptn.infer.SMC is ``model.program(x)`` with ``guide.program(x)`` (no special engine):
    with resampling off, each final particle's log weight is log P^{<=|z|}(z) - log Q(z | x), which the torch
    side computes for the same z with the same weights loaded (prior and guide LMs): equal within 1e-5 for
    every guide family (the bootstrap's weight is 0: its proposal is the masked prior). Each guide is one XLA
    compile (~7 s of CPU): with the Transformer, the default runs the bootstrap, Causal (a guide LM of its own)
    and Identity (the model as guide); Explanatory and Predictive, which differ from Causal only in the guide's
    program (checked with the tabular LMs), run with ``--slow``."""
    from ppl_thought.numpyro.infer import smc as smc_module
    from ppl_thought.numpyro.infer.steps import compilations

    source = pathlib.Path(smc_module.__file__).read_text()
    assert not hasattr(smc_module.SMC, "_run_slow_thinking") and "lax.while_loop" not in source
    proj = PauseToThink(VOCAB, max_thought_len=2)
    V = len(proj.vocab)
    if lm_kind == "tabular":
        (tp, jp), (tq, jq) = both(V, 7), both(V, 8, order=2)
    else:
        (tp, jp), (tq, jq) = _transformer_pair(V, 7, tmp_path), _transformer_pair(V, 8, tmp_path)
    tmodel, jmodel = pt.models.SlowThinking(tp, proj), ptn.models.SlowThinking(jp, proj)
    x = np.array(VOCAB.encode("ab a"))
    guides = {"bootstrap": (None, None), "causal": (pt.guides.Causal(tq, proj), ptn.guides.Causal(jq, proj)),
              "explanatory": (pt.guides.Explanatory(tq, proj), ptn.guides.Explanatory(jq, proj)),
              "predictive": (pt.guides.Predictive(tq, proj), ptn.guides.Predictive(jq, proj)),
              "identity": (pt.guides.Identity(tmodel), ptn.guides.Identity(jmodel))}
    if lm_kind == "transformer" and not request.config.getoption("--slow"):
        guides = {k: v for k, v in guides.items() if k not in ("explanatory", "predictive")}
    for name, (tg, jg) in guides.items():
        before = compilations()
        res = ptn.infer.SMC(64, ess_threshold=0.0).run(jmodel, jg, x, rng_key=jax.random.PRNGKey(1))
        assert compilations() == before + 1  # the generic engine core compiled it
        z = np.asarray(res.samples["z"])
        assert z.shape == (64, jmodel.domain(len(x)).max_len) and res.ancestry.shape == (len(x), 64)
        lw = np.asarray(res.log_weights)
        ok = np.isfinite(lw)  # every guide stays in the lifting of x; the bootstrap's misses weigh 0
        assert ok.all() if tg is not None else ok.any()
        lift = proj.lifting(x)
        assert all(lift.accepts(row[row != 0]) == bool(k) for row, k in zip(z, ok))
        z, lw = z[ok], lw[ok]
        zt = torch.as_tensor(z, dtype=torch.long)
        with torch.no_grad():
            log_p_torch = tmodel.z_dist(len(x)).log_prob(zt).numpy()
            log_q_torch = log_p_torch if tg is None else tg.log_prob(zt, x).numpy()  # bootstrap: Q = P
        assert np.isfinite(log_p_torch).all() and np.isfinite(log_q_torch).all()
        np.testing.assert_allclose(lw, log_p_torch - log_q_torch, atol=1e-5, rtol=0,
                                   err_msg=name)


def test_projection_lift_equals_slow_thinking(pause_model):
    model, guide_lm, x, exact = pause_model
    proj = model.projection

    def plain(x=None):
        numpyro.sample("x", ptn.dist.LMSequence(model.prior, max_len=len(x)), obs=x)

    lifted = ptn.ProjectionLift(plain, proj)
    post = ptn.guides.Posterior(model)
    z = post.sample_with_log_prob(jax.random.PRNGKey(0), x, 2)[0]
    for row in np.asarray(z):
        tr_a = trace(substitute(seed(lifted, 0), data={"z": row})).get_trace(x)
        tr_b = trace(substitute(seed(model, 0), data={"z": row})).get_trace(x)
        assert list(tr_a) == list(tr_b) == ["z", "x"]
        for k in ("z", "x"):
            a = tr_a[k]["fn"].log_prob(tr_a[k]["value"])
            b = tr_b[k]["fn"].log_prob(tr_b[k]["value"])
            assert abs(float(a) - float(b)) < 1e-6
    guide = ptn.guides.Causal(guide_lm, proj)
    ra = ptn.infer.Importance(64).run(lifted, guide, x, rng_key=jax.random.PRNGKey(9))
    rb = ptn.infer.Importance(64).run(model, guide, x, rng_key=jax.random.PRNGKey(9))
    assert np.abs(np.asarray(ra.log_weights) - np.asarray(rb.log_weights)).max() < 1e-5


def test_svi_with_the_elbo_raises_the_exact_elbo(pause_model):
    """numpyro.infer.SVI with ptn.infer.ELBO trains a Causal guide: its exact ELBO (enumerated) rises, and stays
    under log p(x) (the bound is tight only at Q_*)."""
    model, guide_lm, x, exact = pause_model
    guide = ptn.guides.Causal(guide_lm, model.projection)
    support, log_joint = model.enumerate_log_joint(x)

    def exact_elbo(params):
        lq = guide.dist(x, params).log_prob(support)
        return float(jnp.sum(jnp.exp(lq) * (log_joint - lq)))

    svi = numpyro.infer.SVI(model, guide, numpyro.optim.Adam(0.05), ptn.infer.ELBO(num_particles=16))
    state = svi.init(jax.random.PRNGKey(0), x)
    before = exact_elbo(jax.tree.unflatten(jax.tree.structure(guide_lm.params),
                                           [svi.get_params(state)["causal_lm/0"]]))
    update = jax.jit(lambda s: svi.update(s, x))
    for _ in range(150):
        state, loss = update(state)
    after = exact_elbo({"logits": svi.get_params(state)["causal_lm/0"]})
    assert after > before + 0.1, (before, after)
    assert after <= exact + 1e-5


def test_to_inference_data_keeps_the_weights(pause_model):
    model, guide_lm, x, exact = pause_model
    res = ptn.infer.Importance(128).run(model, ptn.guides.Causal(guide_lm, model.projection), x,
                                        rng_key=jax.random.PRNGKey(2))
    idata = ptn.to_inference_data(res)
    from ppl_thought.draws import bounded_num_draws

    assert np.allclose(idata.particles["log_weight"].values[0], np.asarray(res.log_weights))
    assert idata.posterior.sizes["draw"] == bounded_num_draws(min(float(res.ess), idata.posterior.attrs["ess"]))
    assert abs(idata.posterior.attrs["log_marginal"] - float(res.log_marginal)) < 1e-6
    # the equal-weight posterior estimates the weighted mean of the thought length
    lengths = (np.asarray(res.samples["z"]) != 0).sum(-1)
    weighted = float((np.asarray(res.normalized_weights) * lengths).sum())
    # over seeds of the resampling (one seed's 18 draws have sd ~0.7 around it): within 3 SE of the weighted mean
    means = np.array([float(ptn.to_inference_data(res, seed=s).posterior["z_length"].mean()) for s in range(24)])
    assert abs(means.mean() - weighted) < 3 * means.std(ddof=1) / math.sqrt(len(means))


# ---------------------------------------------------------------------------------------------- import boundary
def _allowed_for_the_jax_side() -> tuple[str, ...]:
    """The layers tools/import_map.py lets the JAX column import (its one home), as module prefixes."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_map
    finally:
        sys.path.pop(0)
    layers = dict(import_map.LAYERS)
    allowed = [f"ppl_thought.{p}" for layer in import_map.SIDE_LAYERS["numpyro"] for p in layers[layer]]
    return (*allowed, "ppl_thought.numpyro")


ALLOWED = _allowed_for_the_jax_side()


def test_numpyro_side_source_imports_no_torch_and_no_torch_module():
    for path in (ROOT / "ppl_thought" / "numpyro").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in ("torch", "pyro"), (path, name)
                if name.startswith("ppl_thought"):
                    assert name.startswith(ALLOWED), (path, name)


def _blocked_import(block: list[str], code: str) -> subprocess.CompletedProcess:
    prog = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in block) + code)
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def test_the_jax_side_imports_with_torch_blocked():
    shared = _blocked_import(["torch", "pyro"], "import ppl_thought.projections, ppl_thought.checkpoint")
    assert shared.returncode == 0, shared.stderr[-2000:]
    r = _blocked_import(["torch", "pyro"], "import ppl_thought.numpyro as ptn\n"
                        "ptn.lm, ptn.dist, ptn.models, ptn.guides, ptn.infer, ptn.handlers, ptn.to_inference_data\n"
                        "ptn.OneTokenStep, ptn.verifiers.VerifierSMC, ptn.verifiers.VerifiedLM, ptn.verifiers.dyck")
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_torch_side_imports_with_jax_blocked():
    r = _blocked_import(["jax", "numpyro"], "import ppl_thought as pt\n"
                        "pt.lm, pt.dist, pt.models, pt.guides, pt.infer, pt.diagnostics, pt.projections")
    assert r.returncode == 0, r.stderr[-2000:]
