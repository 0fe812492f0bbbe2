"""NaN in -> an error, never NaN out (issue 32, item 3), on the torch and the JAX side.

Each test failed at 60fef74: chi2_from_weights, kl_from_weights, psis_khat, effective_sample_size and
to_inference_data returned NaN (or a posterior) for NaN log weights; log_marginal_stderr was NaN for one
particle and its gradient NaN for equal weights; pyro.factor(+inf) / numpyro.factor(+inf) gave log Z-hat = inf
and ESS NaN; rng_key=0 on the JAX side was JAX's own TypeError.
"""

from __future__ import annotations

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import ppl_thought as pt
from ppl_thought.diagnostics import chi2_from_weights, kl_from_weights, psis_khat, to_inference_data
from ppl_thought.errors import DiagnosticError, NumericalError, PPLThoughtError
from ppl_thought.inference.importance import log_marginal_stderr
from ppl_thought.weights import effective_sample_size

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.numpyro.infer import log_marginal_stderr as jax_stderr  # noqa: E402
from ppl_thought.numpyro.infer.resampling import effective_sample_size as jax_ess  # noqa: E402
from ppl_thought.numpyro.inference_data import to_inference_data as jax_to_inference_data  # noqa: E402

NAN, INF = float("nan"), float("inf")


def _weights(bad: float) -> torch.Tensor:
    lw = torch.linspace(-3.0, 0.0, 40)
    lw[7] = bad
    return lw


@pytest.mark.parametrize("bad", [NAN, INF])
def test_statistics_of_nan_or_plus_inf_weights_raise(bad):
    lw = _weights(bad)
    for name, fn in [("chi2_from_weights", chi2_from_weights), ("kl_from_weights", kl_from_weights),
                     ("psis", psis_khat), ("effective_sample_size", effective_sample_size)]:
        with pytest.raises(DiagnosticError, match="NaN|\\+inf"):
            fn(lw)
        with pytest.raises(DiagnosticError, match="NaN|\\+inf"):
            fn(lw.reshape(4, 10)) if name in ("psis", "effective_sample_size") else fn(lw.numpy())
    with pytest.raises(DiagnosticError, match="effective_sample_size"):
        jax_ess(jnp.asarray(lw.numpy()))
    r = pt.infer.Result(samples={"z": torch.arange(40.0)}, log_weights=lw, log_marginal=torch.tensor(0.0),
                        engine="Importance")
    for attr in ("ess", "pareto_k", "psis_log_weights"):
        with pytest.raises(DiagnosticError):
            getattr(r, attr)
    # the engines' per-step calls skip the check (they check once per step / run themselves)
    assert math.isnan(float(effective_sample_size(_weights(NAN), check=False)))


def test_divergences_of_no_nonzero_weight_raise_instead_of_nan():
    for lw in (torch.full((5,), -INF), torch.zeros(0)):
        with pytest.raises(DiagnosticError, match="no nonzero weight"):
            chi2_from_weights(lw)
        with pytest.raises(DiagnosticError, match="no nonzero weight"):
            kl_from_weights(lw)
    # valid weights still give the closed form: w = (1, 3) -> chi2 = n sum w^2 / (sum w)^2 - 1 = 2 * 10 / 16 - 1
    assert chi2_from_weights(torch.log(torch.tensor([1.0, 3.0]))) == pytest.approx(0.25)


@pytest.mark.parametrize("bad", [NAN, INF])
def test_to_inference_data_refuses_nan_weights_on_both_sides(bad):
    lw = _weights(bad)
    r = pt.infer.Result(samples={"z": torch.arange(40.0)}, log_weights=lw, log_marginal=torch.tensor(0.0),
                        engine="Importance")
    with pytest.raises(DiagnosticError, match="to_inference_data"):
        to_inference_data(r)
    jr = ptn.infer.Result(samples={"z": jnp.arange(40.0)}, log_weights=jnp.asarray(lw.numpy()),
                          log_marginal=jnp.asarray(0.0), engine="Importance")
    with pytest.raises(DiagnosticError, match="to_inference_data"):
        jax_to_inference_data(jr)
    good = pt.infer.Result(samples={"z": torch.arange(40.0)}, log_weights=torch.linspace(-3.0, 0.0, 40),
                           log_marginal=torch.tensor(NAN), engine="Importance")
    with pytest.raises(DiagnosticError, match="log_marginal is NaN"):
        to_inference_data(good)


def test_log_marginal_stderr_is_zero_for_equal_weights_and_never_nan():
    for value in (0.0, -3.0, -700.0):
        lw = torch.full((6,), value)
        assert float(log_marginal_stderr(lw)) == 0.0
        assert float(jax_stderr(jnp.full((6,), value))) == 0.0
        x = lw.clone().requires_grad_(True)
        log_marginal_stderr(x).backward()
        assert torch.isfinite(x.grad).all()  # sqrt'(0) was inf: a NaN gradient
        assert np.isfinite(np.asarray(jax.grad(jax_stderr)(jnp.full((6,), value)))).all()
    # the delta method on unequal weights is unchanged: w = (1, 3): sd 1.414 / (sqrt 2 * mean 2) = 0.5
    assert float(log_marginal_stderr(torch.log(torch.tensor([1.0, 3.0])))) == pytest.approx(0.5)
    assert float(jax_stderr(jnp.log(jnp.array([1.0, 3.0])))) == pytest.approx(0.5, rel=1e-5)
    # one particle or every weight zero: no estimate of the spread, inf (was NaN)
    for lw in (torch.zeros(1), torch.full((4,), -INF)):
        assert float(log_marginal_stderr(lw)) == INF
        assert float(jax_stderr(jnp.asarray(lw.numpy()))) == INF
    # engines: one particle of a model with one latent
    def model(x=None):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.3))

    assert float(pt.infer.Importance(1).run(model, None, None).log_marginal_stderr) == INF
    res = pt.infer.Importance(1, log_normal_correction=True).run(model, None, None)
    assert not math.isnan(float(res.log_marginal_stderr))


# ---------------------------------------------------------------------------------------------- factor(+inf)
def test_pyro_factor_plus_inf_is_an_error_naming_the_site():
    def model(x=None):
        pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.factor("boom", torch.tensor(INF))

    with pytest.raises(NumericalError, match="'boom'"):
        pt.infer.Importance(8).run(model, None, None)

    class Prog(pt.Program):
        max_plate_nesting = 0

        def init(self, state, x=None):
            pass

        def step(self, state, t, x=None):
            z = pyro.sample(f"z_{t}", dist.Normal(0.0, 1.0))
            pyro.factor(f"f_{t}", torch.full_like(z, INF) if t == 1 else torch.zeros_like(z))
            return torch.full_like(z, t >= 2, dtype=torch.bool)

    with pytest.raises(NumericalError, match="step 1.*'f_1'"):
        pt.infer.SMC(8).run(Prog(), None, None)


def test_numpyro_factor_plus_inf_is_an_error_naming_the_site():
    def model(x=None):
        numpyro.sample("z", nd.Normal(0.0, 1.0))
        numpyro.factor("boom", jnp.inf)

    with pytest.raises(NumericalError, match="'boom'"):
        ptn.infer.Importance(8).run(model, None, None)


# ---------------------------------------------------------------------------------------------- rng_key
def test_an_int_rng_key_is_a_seed_and_anything_else_a_clear_error():
    def model(x=None):
        z = numpyro.sample("z", nd.Normal(0.0, 1.0))
        numpyro.sample("x", nd.Normal(z, 1.0), obs=0.3)

    eng = ptn.infer.Importance(16)
    a = eng.run(model, None, None, rng_key=0)
    b = eng.run(model, None, None, rng_key=jax.random.PRNGKey(0))
    c = eng.run(model, None, None, rng_key=np.int64(3))
    d = eng.run(model, None, None, rng_key=jax.random.PRNGKey(3))
    assert np.array_equal(np.asarray(a.log_weights), np.asarray(b.log_weights))
    assert np.array_equal(np.asarray(c.log_weights), np.asarray(d.log_weights))
    assert not np.array_equal(np.asarray(a.log_weights), np.asarray(c.log_weights))
    for bad in ("0", 1.5, True, jnp.zeros(3, jnp.uint32)):
        # a string or a float is refused by the type layer, a bool or a wrong-shaped key by the engine's own check
        with pytest.raises(PPLThoughtError, match="rng_key must be a JAX PRNG key|parameter rng_key="):
            eng.run(model, None, None, rng_key=bad)


def test_an_int_rng_key_runs_the_jax_smc():
    from ppl_thought.projections import PauseToThink
    from ppl_thought.vocab import Vocab

    vocab = Vocab(["a", "b"])
    rng = np.random.default_rng(0)
    lm = ptn.lm.Tabular.from_numpy(rng.normal(size=(len(vocab),) * 2 + (len(vocab),)).astype(np.float32))
    model = ptn.models.SlowThinking(lm, PauseToThink(vocab, max_thought_len=1))
    x = np.array(vocab.encode("ab"))
    a = ptn.infer.SMC(8).run(model, None, x, rng_key=2)
    b = ptn.infer.SMC(8).run(model, None, x, rng_key=jax.random.PRNGKey(2))
    assert np.array_equal(np.asarray(a.log_weights), np.asarray(b.log_weights))
    with pytest.raises(PPLThoughtError, match="rng_key"):
        ptn.infer.SMC(8).run(model, None, x, rng_key="2")
