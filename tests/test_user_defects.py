"""Regression tests of the defects a new user hit writing their own programs (issue 32, item 4): each test
fails on 60fef74. Guides that cannot meet their model, argument types and sizes, SVI without a guide, ULA's
default step, gradients through a parametrised HMM."""

from __future__ import annotations

import pytest
import torch

import ppl_thought as pt
from ppl_thought.errors import SiteMismatchError
from ppl_thought.lm import Tabular
from ppl_thought.projections import CharDFA, token_automaton, token_texts
from ppl_thought.vocab import EOS_ID

ENGINES = [lambda: pt.infer.Importance(64), lambda: pt.infer.SMC(64)]


# ------------------------------------------------------------------------------------------ guides meet models
def constrained(vocab: pt.Vocab, seed: int) -> pt.models.Constrained:
    g = torch.Generator().manual_seed(seed)
    lg = torch.full((len(vocab), len(vocab)), float("-inf"))
    cols = [EOS_ID] + vocab.ordinary_ids.tolist()
    lg[:, cols] = torch.randn(len(vocab), len(cols), generator=g)
    auto = token_automaton(CharDFA.lipogram("e"), token_texts(vocab))
    return pt.models.Constrained(Tabular(2, len(vocab), lg, trainable=False), auto, 4)


@pytest.mark.parametrize("engine", ENGINES)
def test_guide_lm_over_another_vocabulary_size_is_refused(engine):
    """A guide whose LM draws ids over 8 tokens for a model over 9: the model's 'c' cannot be proposed (60fef74
    returned a biased log Z-hat without a word)."""
    model = constrained(pt.Vocab(["a", "b", "c"]), 0)
    guide = constrained(pt.Vocab(["a", "b"]), 1)
    with pytest.raises(SiteMismatchError, match="vocabulary of 8 ids, the model over 9"):
        engine().run(model, guide, torch.zeros(0, dtype=torch.long))


def _pause(c: int, seed: int) -> pt.models.SlowThinking:
    vocab = pt.Vocab(["a", "b"])
    g = torch.Generator().manual_seed(seed)
    prior = Tabular(2, len(vocab), torch.randn(len(vocab), len(vocab), generator=g), trainable=False)
    return pt.models.SlowThinking(prior, pt.projections.PauseToThink(vocab, max_thought_len=c))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("used", ["neither", "model", "guide", "both"])
def test_guide_on_another_projection_is_always_the_same_error(engine, used):
    """A guide on PauseToThink(max_thought_len=1) for a model on max_thought_len=2: the same error whether or not
    either projection has computed (and cached) a lifting before; at 60fef74 a cached lifting on one side hid
    the difference and the engine returned a value."""
    model = _pause(2, 0)
    guide = pt.guides.Causal(_pause(1, 1).prior, _pause(1, 1).projection)
    if used in ("model", "both"):
        model.projection.lifting(model.x_ids("ab"))
    if used in ("guide", "both"):
        guide.projection.lifting(model.x_ids("ab"))
    with pytest.raises(SiteMismatchError, match=r"differs from the model's in \['max_thought_len'\]"):
        engine().run(model, guide, "ab")


def test_sparse_thoughts_on_other_positions_is_refused():
    """SparseThoughts keeps its positions private: two projections with other positions still differ."""
    vocab = pt.Vocab(["a", "b"])
    g = torch.Generator().manual_seed(0)
    prior = Tabular(2, len(vocab), torch.randn(len(vocab), len(vocab), generator=g), trainable=False)
    model = pt.models.SlowThinking(prior, pt.projections.SparseThoughts(vocab, 1, positions=[0]))
    guide = pt.guides.Causal(prior, pt.projections.SparseThoughts(vocab, 1, positions=[1]))
    with pytest.raises(SiteMismatchError, match="positions"):
        pt.infer.Importance(16).run(model, guide, "ab")
    same = pt.guides.Causal(prior, pt.projections.SparseThoughts(vocab, 1, positions=[0]))
    assert torch.isfinite(pt.infer.Importance(16).run(model, same, "ab").log_marginal)


# ------------------------------------------------------------------------------------------ SVI without a guide
def test_svi_without_guide_fits_a_model_without_latents_by_maximum_likelihood():
    """``SVI(...).run(model, None, x)`` (Importance and SMC take None): with no latent site the fit is maximum
    likelihood, here mu -> mean(x) exactly (60fef74 raised a TypeError)."""
    import pyro
    import pyro.distributions as dist

    pyro.clear_param_store()
    x = torch.tensor([0.3, 1.1, 2.2, -0.4])

    def model(x):
        mu = pyro.param("mu", torch.tensor(0.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x)

    res = pt.train.SVI(pyro.infer.Trace_ELBO(), {"lr": 0.1}).run(model, None, x, num_steps=300)
    assert abs(float(pyro.param("mu").detach()) - float(x.mean())) < 1e-3
    assert res.stats["losses"].shape == (300,)


def test_svi_without_guide_on_a_model_with_latents_names_the_fix():
    import pyro
    import pyro.distributions as dist

    def model(x):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    svi = pt.train.SVI(pyro.infer.Trace_ELBO(), {"lr": 0.1})
    with pytest.raises(pt.errors.ConfigError, match=r"latent sites \('z'\).*AutoNormal"):
        svi.run(model, None, torch.tensor(0.5), num_steps=2)
    with pytest.raises(pt.errors.ConfigError, match="guide must be a callable"):
        svi.run(model, "guide", torch.tensor(0.5), num_steps=2)
    with pytest.raises(pt.errors.ConfigError, match="model must be a callable"):
        svi.run(None, None, torch.tensor(0.5), num_steps=2)
