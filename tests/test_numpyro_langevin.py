"""ptn.infer.MALA / ULA as numpyro MCMC kernels, and ptn.models.LatentThought (latent-thought-models.txt, Eq. 1, 4).

MALA is checked on the conjugate Gaussian case against the closed-form posterior, as tests/test_langevin.py
does on the torch side (same model, same bounds of K_SE Monte-Carlo standard errors with ArviZ's ESS); ULA
with a large fixed step shows that the same bounds catch a biased sampler. The LatentThought likelihood
equals the torch model's on the same decoder checkpoint.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", False)
import jax.numpy as jnp  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import DiscreteLatentError, ProgramError  # noqa: E402

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")
    import arviz as az

K_SE = 4.0  # width of the bounds in Monte-Carlo standard errors

# z ~ N(mu0, S0), y_i | z ~ N(z, Sy): the posterior is N(mu_post, S_post) with
# S_post = (S0^-1 + n Sy^-1)^-1 and mu_post = S_post (S0^-1 mu0 + Sy^-1 sum_i y_i)   (tests/test_langevin.py)
MU0 = np.array([0.0, 1.0])
S0 = np.array([[1.0, 0.6], [0.6, 2.0]])
SY = np.array([[1.0, -0.3], [-0.3, 0.5]])
Y = np.array([[0.5, 0.2], [1.0, -0.3], [0.2, 0.4]])
L0, LY = np.linalg.cholesky(S0), np.linalg.cholesky(SY)


def gaussian_model(y):
    prior = dist.MultivariateNormal(jnp.asarray(MU0, jnp.float32), scale_tril=jnp.asarray(L0, jnp.float32))
    z = numpyro.sample("z", prior)
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.MultivariateNormal(z, scale_tril=jnp.asarray(LY, jnp.float32)), obs=y)


def gaussian_posterior(y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    precision = np.linalg.inv(S0) + y.shape[0] * np.linalg.inv(SY)
    cov = np.linalg.inv(precision)
    return cov @ (np.linalg.solve(S0, MU0) + np.linalg.solve(SY, y.sum(0))), cov, precision


def mcse_checks(draws: np.ndarray, mean: np.ndarray, var: np.ndarray) -> tuple[bool, bool]:
    """Whether the mean and the variance of each coordinate of ``draws`` ([chains, draws, d]) agree with
    ``mean`` and ``var`` within K_SE Monte-Carlo standard errors (sd / sqrt(ArviZ ESS of the averaged quantity))."""
    ok_mean, ok_var = True, True
    for j in range(draws.shape[-1]):
        x = np.asarray(draws[..., j], np.float64)
        for target, f, name in ((mean[j], x, "mean"), (var[j], (x - mean[j]) ** 2, "var")):
            ok = abs(f.mean() - target) < K_SE * f.std() / math.sqrt(az.ess(f, method="mean"))
            if name == "mean":
                ok_mean &= bool(ok)
            else:
                ok_var &= bool(ok)
    return ok_mean, ok_var


def run(kernel, seed: int, num_warmup: int, num_samples: int) -> MCMC:
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, num_chains=4, chain_method="vectorized",
                progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), jnp.asarray(Y, jnp.float32),
             extra_fields=("accept_prob", "step_size", "diverging", "potential_energy"))
    return mcmc


def test_mala_recovers_gaussian_posterior_and_converts_to_arviz():
    mean, cov, _ = gaussian_posterior(Y)
    mcmc = run(ptn.infer.MALA(gaussian_model), seed=0, num_warmup=300, num_samples=1000)
    z = np.asarray(mcmc.get_samples(group_by_chain=True)["z"])
    assert z.shape == (4, 1000, 2)
    extra = mcmc.get_extra_fields(group_by_chain=True)
    assert not np.asarray(extra["diverging"]).any()
    step = np.asarray(extra["step_size"])  # after warmup: the adapted step, constant along each chain
    assert (step == step[:, :1]).all() and (step != 0.1).all()

    assert mcse_checks(z, mean, np.diag(cov)) == (True, True)
    for j in range(2):
        assert az.rhat(z[..., j]) < 1.02
    assert abs(np.cov(z.reshape(-1, 2).T)[0, 1] - cov[0, 1]) < 0.02
    assert abs(float(np.mean(extra["accept_prob"])) - 0.57) < 0.08

    idata = az.from_numpyro(mcmc)
    assert idata.posterior["z"].shape == (4, 1000, 2)
    assert "diverging" in idata.sample_stats and "y" in idata.observed_data
    np.testing.assert_allclose(az.summary(idata, var_names=["z"])["mean"].to_numpy(), z.reshape(-1, 2).mean(0),
                               atol=1e-2)


def test_ula_large_step_is_biased_and_mala_is_not():
    """With a fixed step s = 0.8 / lambda_max(P), ULA's stationary law is N(m, (P - s P^2/2)^-1): the MCSE
    bounds reject its variances (they match ULA's own biased covariance instead), MALA with the same step
    passes them."""
    mean, cov, precision = gaussian_posterior(Y)
    step = 0.8 / np.linalg.eigvalsh(precision).max()
    ula_cov = np.linalg.inv(precision - step * precision @ precision / 2)
    common = dict(step_size=step, adapt_step_size=False)

    ula = run(ptn.infer.ULA(gaussian_model, **common), seed=1, num_warmup=100, num_samples=600)
    z_ula = np.asarray(ula.get_samples(group_by_chain=True)["z"])
    ok_mean, ok_var = mcse_checks(z_ula, mean, np.diag(cov))
    assert ok_mean and not ok_var  # unbiased mean, biased variance: the bound detects it
    assert mcse_checks(z_ula, mean, np.diag(ula_cov)) == (True, True)
    assert np.allclose(ula.get_extra_fields()["step_size"], step)
    assert 0.0 < float(np.mean(ula.get_extra_fields()["accept_prob"])) < 1.0  # MALA's, recorded not used

    mala = run(ptn.infer.MALA(gaussian_model, **common), seed=1, num_warmup=100, num_samples=600)
    assert mcse_checks(np.asarray(mala.get_samples(group_by_chain=True)["z"]), mean, np.diag(cov)) == (True, True)


def test_discrete_latents_are_refused():
    def model():
        numpyro.sample("k", dist.Bernoulli(0.3))

    with pytest.raises(DiscreteLatentError, match="k"):
        MCMC(ptn.infer.MALA(model), num_warmup=1, num_samples=1, progress_bar=False).run(jax.random.PRNGKey(0))


class GaussianProgram(ptn.Program):
    """The conjugate Gaussian as a user's program: z ~ N(MU0, S0) in init, one observation y_t ~ N(z, SY) per
    step (max_steps = 3: the whole trace names them y_0, y_1, y_2)."""

    max_steps = 3

    def init(self, state, y):
        n = ptn.particles()
        prior = dist.MultivariateNormal(jnp.asarray(MU0, jnp.float32), scale_tril=jnp.asarray(L0, jnp.float32))
        state["z"] = ptn.sample("z", prior.expand((n,)))

    def step(self, state, t, y):
        ptn.observe("y", dist.MultivariateNormal(state["z"], scale_tril=jnp.asarray(LY, jnp.float32)), y[t])
        return jnp.broadcast_to(t == self.max_steps - 1, (ptn.particles(),))


def test_mala_on_a_program_recovers_the_posterior_and_ula_with_a_large_step_fails_the_same_bounds():
    """MALA(program): the potential is -log joint of the program's whole trace (init and every step); on the
    conjugate Gaussian its means and variances are within K_SE MCSE of the closed form, where ULA with a large
    fixed step fails the variance bound (the same bounds have power on a program too)."""
    mean, cov, precision = gaussian_posterior(Y)
    tr = numpyro.handlers.trace(numpyro.handlers.seed(GaussianProgram(), 0)).get_trace(jnp.asarray(Y, jnp.float32))
    assert [k for k, s in tr.items() if s["type"] == "sample"] == ["z", "y_0", "y_1", "y_2"]
    mala = run(ptn.infer.MALA(GaussianProgram()), seed=0, num_warmup=300, num_samples=1000)
    z = np.asarray(mala.get_samples(group_by_chain=True)["z"]).reshape(4, 1000, 2)  # one particle: [.., 1, 2]
    assert mcse_checks(z, mean, np.diag(cov)) == (True, True)
    step = 0.8 / np.linalg.eigvalsh(precision).max()
    ula = run(ptn.infer.ULA(GaussianProgram(), step_size=step, adapt_step_size=False), seed=1, num_warmup=100,
              num_samples=600)
    z_ula = np.asarray(ula.get_samples(group_by_chain=True)["z"]).reshape(4, 600, 2)
    assert mcse_checks(z_ula, mean, np.diag(cov))[1] is False


def test_programs_with_discrete_latents_or_outputs_are_refused_naming_the_site():
    class Coin(ptn.Program):
        max_steps = 1

        def step(self, state, t):
            ptn.sample("coin", dist.Bernoulli(jnp.full((ptn.particles(),), 0.3)))
            return jnp.ones(ptn.particles(), bool)

    class Drawn(ptn.Program):
        max_steps = 1

        def step(self, state, t):
            mu = ptn.sample("mu", dist.Normal(jnp.zeros(ptn.particles()), 1.0))
            ptn.observe("next", dist.Normal(mu, 1.0), None)
            return jnp.ones(ptn.particles(), bool)

    with pytest.raises(DiscreteLatentError, match="coin"):
        MCMC(ptn.infer.MALA(Coin()), num_warmup=1, num_samples=1, progress_bar=False).run(jax.random.PRNGKey(0))
    with pytest.raises(ProgramError, match="next"):
        MCMC(ptn.infer.ULA(Drawn()), num_warmup=1, num_samples=1, progress_bar=False).run(jax.random.PRNGKey(0))


# ---------------------------------------------------------------------------------------------------------
# LatentThought
# ---------------------------------------------------------------------------------------------------------


def test_latent_thought_likelihood_equals_torch_and_mala_samples_its_posterior(tmp_path):
    torch = pytest.importorskip("torch")
    from ppl_thought.models.latent_thought import LatentThought as TorchLTM

    torch.manual_seed(0)
    ltm = TorchLTM(vocab_size=7, d_model=16, n_layers=2, n_heads=2, n_z=3, window=3, max_len=16, pad_id=0).eval()
    with torch.no_grad():
        for p in ltm.parameters():
            p.normal_(0.0, 0.4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 7, (3, 8), generator=g)
    tokens[2, 5:] = 0  # padding
    z = torch.randn(3, *ltm.latent_shape, generator=g)
    with torch.no_grad():
        ref = ltm.log_likelihood(tokens, z).numpy()

    jltm = ptn.models.LatentThought(ptn.lm.Transformer.load(ltm.decoder.save(tmp_path / "decoder")), n_z=3, pad_id=0)
    assert jltm.latent_shape == ltm.latent_shape
    jt = jnp.asarray(tokens.numpy())
    ours = jltm.log_likelihood(jltm.params, jt, jnp.asarray(z.numpy()))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)

    # the NumPyro program's log joint is log N(z; 0, I) + log p(x | z)
    log_joint, _ = numpyro.infer.util.log_density(jltm.model, (jt,), {}, {"z": jnp.asarray(z.numpy())})
    prior = -0.5 * float((z ** 2).sum()) - 0.5 * z.numel() * math.log(2 * math.pi)
    np.testing.assert_allclose(float(log_joint), prior + ref.sum(), rtol=1e-5)

    # posterior sampling of z (Eq. 4) runs jitted through the Transformer: finite, moving, adapted
    mcmc = MCMC(ptn.infer.MALA(jltm.model), num_warmup=30, num_samples=20, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), jt, extra_fields=("accept_prob", "potential_energy"))
    zs = np.asarray(mcmc.get_samples()["z"])
    assert zs.shape == (20, 3, *ltm.latent_shape) and np.isfinite(zs).all()
    assert np.isfinite(np.asarray(mcmc.get_extra_fields()["potential_energy"])).all()
    assert 0.2 < float(np.mean(mcmc.get_extra_fields()["accept_prob"])) < 0.95
