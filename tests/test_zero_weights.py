"""The one zero-weight rule (docs/architecture.md, "Rules that keep it right"), every engine on both backends:
(a) an observation outside the image of Proj gives log Z-hat = -inf exactly, with a warning, guided or bootstrap;
(b) a guide that proposes only values of probability 0 raises ZeroWeightsError naming that guide;
(c) bootstrap (no guide) on data the prior never produces raises ZeroWeightsError naming the model's prior,
never "the guide"."""

from __future__ import annotations

import os

import pyro
import pyro.distributions as dist
import pytest
import torch
from engine_helpers import VOCAB, LiftingSampler, pause_model, tabular

from ppl_thought.errors import ZeroWeightsError, describe_proposal, zero_weights_message
from ppl_thought.inference import SMC, Importance
from ppl_thought.lm.tabular import Tabular
from ppl_thought.models import SlowThinking
from ppl_thought.projections import PauseToThink

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

OUTSIDE = torch.tensor([VOCAB.id("a"), VOCAB.id("<s>")])  # <s> is not observable: lifting empty, p(x) = 0


def no_b_logits(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(VOCAB), len(VOCAB), generator=g)
    logits[:, VOCAB.id("b")] = float("-inf")  # the prior never emits "b": p("ab") = 0, x still in the image
    return logits


def no_b_model() -> SlowThinking:
    return SlowThinking(Tabular(2, len(VOCAB), no_b_logits(), trainable=False), PauseToThink(VOCAB, 1))


# ---------------------------------------------------------------------------------------------- the message
def test_the_message_names_what_proposed():
    assert describe_proposal(None).startswith("the model's own prior")
    assert describe_proposal(no_b_model) == "the guide no_b_model"
    assert describe_proposal(LiftingSampler(tabular(len(VOCAB), 1), pause_model())) == "the guide LiftingSampler"
    boot = zero_weights_message("Importance", 8, describe_proposal(None), sites=["'x' (model)"])
    assert "all 8 particle weights are zero" in boot and "guide LiftingSampler" not in boot
    assert "'x' (model)" in boot and "the guide" not in boot.split(":", 1)[1].split(";")[0]
    guided = zero_weights_message("SMC", 4, "the guide G", where="after step 2 of M")
    assert "after step 2 of M" in guided and "the guide G proposed only values" in guided


# ---------------------------------------------------------------------------------------------- torch
@pytest.mark.parametrize("engine", ["Importance", "SMC"])
@pytest.mark.parametrize("guided", [True, False])
def test_torch_outside_the_image_is_minus_inf(engine, guided):
    torch.manual_seed(0)
    model = pause_model(0)
    guide = LiftingSampler(model.prior, model) if guided else None
    eng = Importance(16) if engine == "Importance" else SMC(16)
    with pytest.warns(UserWarning, match="log p\\(x\\) = -inf"):
        r = eng.run(model, guide, OUTSIDE)
    assert torch.isneginf(r.log_marginal) and torch.isneginf(r.log_weights).all()
    assert torch.isneginf(model.exact_log_prob(OUTSIDE))  # the exact answer


@pytest.mark.parametrize("engine", ["Importance", "SMC"])
def test_torch_guide_proposing_only_impossible_values_names_the_guide(engine):
    torch.manual_seed(0)
    model = no_b_model()
    assert torch.isneginf(model.exact_log_prob("ab"))
    guide = LiftingSampler(tabular(len(VOCAB), 1), model)
    eng = Importance(32) if engine == "Importance" else SMC(32)
    with pytest.raises(ZeroWeightsError, match="all 32 particle weights are zero") as e:
        eng.run(model, guide, "ab")
    assert "the guide LiftingSampler proposed only values" in str(e.value)
    assert "prior" not in str(e.value)


@pytest.mark.parametrize("engine", ["Importance", "SMC"])
def test_torch_bootstrap_on_impossible_data_names_the_prior(engine):
    torch.manual_seed(0)
    model = no_b_model()
    eng = Importance(32) if engine == "Importance" else SMC(32)
    with pytest.raises(ZeroWeightsError, match="the model's own prior \\(no guide: bootstrap\\)") as e:
        eng.run(model, None, "ab")
    assert "the guide" not in str(e.value) and "log p(x) = -inf is the answer" in str(e.value)


def test_torch_plain_pyro_models_name_the_guide_or_the_prior_and_the_dead_site():
    def model(x):
        z = pyro.sample("z", dist.Categorical(logits=torch.tensor([0.0, 0.0, float("-inf")])))
        table = torch.stack([torch.tensor([0.0, float("-inf")])] * 3)
        pyro.sample("x", dist.Categorical(logits=table[z.long()]), obs=x)

    def impossible_guide(x):
        pyro.sample("z", dist.Delta(torch.tensor(2.0)).to_event(0))  # the model gives z = 2 probability 0

    torch.manual_seed(0)
    with pytest.raises(ZeroWeightsError, match="the guide impossible_guide proposed only") as e:
        Importance(8, fast=False, max_plate_nesting=0).run(model, impossible_guide, torch.tensor(0))
    assert "'z' (model)" in str(e.value)
    with pytest.raises(ZeroWeightsError, match="own prior") as e:  # x = 1 has probability 0 under every z
        Importance(8, fast=False, max_plate_nesting=0).run(model, None, torch.tensor(1))
    assert "'x' (model)" in str(e.value) and "the guide" not in str(e.value)
    r = Importance(8, fast=False, max_plate_nesting=0).run(model, None, torch.tensor(0))  # possible: no error
    assert float(r.log_marginal) == pytest.approx(0.0, abs=1e-6)  # p(x = 0) = 1 exactly


# ---------------------------------------------------------------------------------------------- JAX
jax = pytest.importorskip("jax")
numpyro = pytest.importorskip("numpyro")
import jax.numpy as jnp  # noqa: E402
import numpyro.distributions as ndist  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402


def jax_model(logits):
    return ptn.models.SlowThinking(ptn.lm.Tabular.from_numpy(logits.numpy()), PauseToThink(VOCAB, 1))


@pytest.mark.parametrize("engine", ["Importance", "SMC"])
@pytest.mark.parametrize("guided", [True, False])
def test_jax_outside_the_image_is_minus_inf(engine, guided):
    model = jax_model(torch.randn(len(VOCAB), len(VOCAB), generator=torch.Generator().manual_seed(0)))
    guide = ptn.guides.Posterior(model) if guided and engine == "Importance" else None
    eng = ptn.infer.Importance(8) if engine == "Importance" else ptn.infer.SMC(8)
    with pytest.warns(UserWarning, match="log p\\(x\\) = -inf"):
        r = eng.run(model, guide, OUTSIDE.numpy(), rng_key=0)
    assert bool(jnp.isneginf(r.log_marginal)) and bool(jnp.isneginf(r.log_weights).all())


@pytest.mark.parametrize("engine", ["Importance", "SMC"])
def test_jax_bootstrap_on_impossible_data_names_the_prior(engine):
    model = jax_model(no_b_logits())
    x = torch.tensor([VOCAB.id("a"), VOCAB.id("b")]).numpy()
    eng = ptn.infer.Importance(16) if engine == "Importance" else ptn.infer.SMC(16)
    with pytest.raises(ZeroWeightsError, match="own prior") as e:
        eng.run(model, None, x, rng_key=0)
    assert "the guide" not in str(e.value) and "the proposal" not in str(e.value)


def test_jax_plain_models_name_the_guide_or_the_prior():
    def model(x):
        z = numpyro.sample("z", ndist.Categorical(logits=jnp.array([0.0, 0.0, -jnp.inf])))
        numpyro.sample("x", ndist.Categorical(logits=jnp.array([[0.0, -jnp.inf]] * 3)[z]), obs=x)

    def impossible_guide(x):
        numpyro.sample("z", ndist.Delta(jnp.array(2)))

    with pytest.raises(ZeroWeightsError, match="the guide impossible_guide proposed only"):
        ptn.infer.Importance(8).run(model, impossible_guide, 0, rng_key=0)
    with pytest.raises(ZeroWeightsError, match="own prior") as e:
        ptn.infer.Importance(8).run(model, None, 1, rng_key=0)
    assert "the guide" not in str(e.value)
    r = ptn.infer.Importance(8).run(model, None, 0, rng_key=0)
    assert float(r.log_marginal) == pytest.approx(0.0, abs=1e-6)
