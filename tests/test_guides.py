"""Guide families (Def 3.1): identity (3.30), predictive (Def 3.7), causal (3.33), explanatory
(5.6.2), posterior (2.24), inquisitive (3.22) against exact enumeration; Pyro integration;
chi^2 diagnostics; the sampler hierarchy (Prop 3.5)."""

import importlib.util
import math
import pathlib

import numpy as np
import pyro
import pytest
import torch

from ppl_thought.diagnostics import chi2, chi2_from_weights, kl
from ppl_thought.distributions import LMSequence, concat
from ppl_thought.errors import NotDisentangledError, NotInImageError
from ppl_thought.guides import (
    Causal,
    Explanatory,
    Identity,
    Inquisitive,
    Posterior,
    Predictive,
    SamplerDistribution,
    explanatory_guide,
)
from ppl_thought.lm import GatedLM, Tabular
from ppl_thought.models import SlowThinking
from ppl_thought.projections import FirstTokenSwitch, PauseToThink, Product, QueryResponse, SparseThoughts
from ppl_thought.projections import Identity as IdentityProj
from ppl_thought.vocab import DEFAULT, Vocab

V2 = Vocab(["a", "b"])


def tab(V, seed, order=2, trainable=False, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return Tabular(order, V, torch.randn((V,) * order, generator=g) * scale, trainable=trainable)


def cases():
    prod = Product.build(["a", "b"], ["u", "v"])
    return {
        "pause": (PauseToThink(V2, 1), "ab"),
        "product": (prod, "ab"),
        "query_response": (QueryResponse(V2, 1), ["a", "<eos>", "b"]),
        "sparse": (SparseThoughts(V2, 1, [0, 1]), "ab"),
        "identity": (IdentityProj(V2), "ab"),
    }


def make_guide(kind, model):
    proj, V = model.projection, len(model.vocab)
    if kind == "identity":
        return Identity(model)
    if kind == "predictive":
        return Predictive(tab(V, 11), proj)
    if kind == "causal":
        return Causal(tab(V, 12), proj)
    if kind == "explanatory":
        return Explanatory(tab(V, 13, order=3), proj)
    if kind == "explanatory_gated":
        g = GatedLM(tab(V, 14, order=3))
        torch.nn.init.normal_(g.gate[-1].weight, std=1.0)  # a non-trivial gate
        return Explanatory(g, proj)
    if kind == "posterior":
        return Posterior(model)
    if kind == "inquisitive":
        return Inquisitive(model)
    if kind == "inquisitive_centered":
        return Inquisitive(model, centered=True)
    raise KeyError(kind)


KINDS = ["identity", "predictive", "causal", "explanatory", "explanatory_gated", "posterior", "inquisitive",
         "inquisitive_centered"]


def model_for(proj, seed=0):
    return SlowThinking(tab(len(proj.vocab), seed, trainable=True), proj)


@pytest.mark.parametrize("pname", list(cases()))
@pytest.mark.parametrize("kind", KINDS)
def test_sampler_is_a_law_on_the_lifting(pname, kind, device):
    torch.manual_seed(0)
    proj, x = cases()[pname]
    model = model_for(proj)
    q = make_guide(kind, model)
    model.prior.to(device)
    for lm in (getattr(q, "lm", None),):
        if lm is not None:
            lm.to(device)
    support, _ = model.enumerate_log_joint(x)
    with torch.no_grad():
        lq = q.log_prob(support, x)
    assert not torch.isnan(lq).any() and lq.device.type == device.type
    assert abs(float(lq.exp().sum()) - 1.0) < 1e-5
    n = 1500
    z, lz = q.sample_with_log_prob(x, n)
    assert z.shape == (n, proj.domain(len(model.x_ids(x))).max_len)
    lift = proj.lifting(x)
    assert all(lift.accepts(row[row != 0].cpu().numpy()) for row in z[:50])
    with torch.no_grad():
        assert torch.allclose(lz, q.log_prob(z, x), atol=1e-5)
    z, support, lq = z.cpu(), support.cpu(), lq.cpu()
    # frequencies match exp(log_prob): 5-sigma binomial bounds
    counts = (z[:, None, :] == support[None]).all(-1).sum(0).double()
    assert int(counts.sum()) == n
    p = lq.double().exp()
    sd = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 5 * sd + 2).all(), (counts, n * p)


def test_log_prob_outside_lifting_is_minus_inf_not_nan():
    proj, x = cases()["pause"]
    model = model_for(proj)
    other, _ = model.enumerate_log_joint("ba")
    for kind in KINDS:
        with torch.no_grad():
            lq = make_guide(kind, model).log_prob(other, x)
        assert torch.isneginf(lq).all(), kind


def test_identity_marginalises_the_next_observable():
    """P(no thought before x_1) = sum_{a in Sigma} P(a | <bos>) under the domain mask, not renormalised
    against x_1 alone (docs/architecture.md, "Guides")."""
    proj = PauseToThink(V2, 1)
    model = model_for(proj, seed=3)
    logits = model.prior.logits.detach()[1]  # after <bos>
    allowed = torch.zeros(len(V2), dtype=torch.bool)
    allowed[list(V2.observable_ids) + [V2.think_id]] = True
    p = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1)
    p_plain = p[V2.observable_ids].sum()
    q = Identity(model)
    with torch.no_grad():
        lq = q.log_prob(torch.tensor([[V2.id("a")]]), "a")
    assert torch.isclose(lq.exp()[0], p_plain, atol=1e-6)
    causal = Causal(model.prior, proj)  # masked softmax under the lifting: renormalised over {<s>, a}
    with torch.no_grad():
        lc = causal.log_prob(torch.tensor([[V2.id("a")]]), "a")
    assert torch.isclose(lc.exp()[0], p[V2.id("a")] / (p[V2.id("a")] + p[V2.think_id]), atol=1e-6)


def test_identity_product_merges_hidden_values():
    proj, _ = cases()["product"]
    model = model_for(proj, seed=4)
    logits = model.prior.logits.detach()[1]
    allowed = torch.zeros(len(proj.vocab), dtype=torch.bool)
    allowed[proj.latent_ids] = True
    p = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1)
    with torch.no_grad():
        lq = Identity(model).log_prob(torch.tensor([[proj.pair_id("b", "u")]]), "b")
    want = p[proj.pair_id("a", "u")] + p[proj.pair_id("b", "u")]
    assert torch.isclose(lq.exp()[0], want, atol=1e-6)


def test_non_disentangled_projection_raises():
    proj = FirstTokenSwitch(V2, "a", horizon=3)
    model = model_for(proj)
    with pytest.raises(NotDisentangledError, match="not disentangled"):
        Identity(model)
    with pytest.raises(NotDisentangledError):
        Predictive(tab(len(V2), 1), proj)


def test_bad_observation_names_the_problem():
    model = model_for(PauseToThink(V2, 1))
    with pytest.raises(NotInImageError, match="non-observable"):
        Identity(model).sample(["a", "<s>"], 2)


def first_segment_marginal(q, proj, x, drop_observable=False):
    model_support = proj.enumerate_lifting(x)
    L = max(len(z) for z in model_support)
    z = torch.zeros(len(model_support), L, dtype=torch.long)
    for i, s in enumerate(model_support):
        z[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        p = q.log_prob(z, x).exp()
    out: dict = {}
    for s, pi in zip(model_support, p):
        seg = proj.segments(s, x)[0]
        key = seg[:-1] if drop_observable else seg
        out[key] = out.get(key, 0.0) + float(pi)
    return out


def test_causality_of_predictive_and_causal():
    proj = PauseToThink(V2, 1)
    V = len(V2)
    pred, caus = Predictive(tab(V, 5), proj), Causal(tab(V, 6), proj)
    for q in (pred, caus):  # z^(1) does not depend on x_2 (Def 3.8)
        m1, m2 = first_segment_marginal(q, proj, "aa"), first_segment_marginal(q, proj, "ab")
        assert m1.keys() == m2.keys() and all(abs(m1[k] - m2[k]) < 1e-6 for k in m1)
    # predictive: the first thought S_1 does not depend on x_1 either (Def 3.7) ...
    m1 = first_segment_marginal(pred, proj, "aa", drop_observable=True)
    m2 = first_segment_marginal(pred, proj, "ba", drop_observable=True)
    assert all(abs(m1[k] - m2[k]) < 1e-6 for k in m1)
    # ... but the causal sampler's does (the masked softmax renormalises <s> against x_1)
    m1 = first_segment_marginal(caus, proj, "aa", drop_observable=True)
    m2 = first_segment_marginal(caus, proj, "ba", drop_observable=True)
    assert max(abs(m1[k] - m2[k]) for k in m1) > 1e-3


def test_explanatory_first_segment_depends_on_the_future():
    proj = PauseToThink(V2, 1)
    V = len(V2)
    logits = torch.zeros((V,) * 3)
    a, b = V2.id("a"), V2.id("b")
    logits[b, 5, V2.think_id] = 3.0  # x ends in b: think before x_1
    logits[a, 5, V2.think_id] = -3.0
    q = Explanatory(Tabular(3, V, logits), proj)
    m1, m2 = first_segment_marginal(q, proj, "aa"), first_segment_marginal(q, proj, "ab")
    assert max(abs(m1.get(k, 0) - m2.get(k, 0)) for k in set(m1) | set(m2)) > 0.3


def test_posterior_is_exact_and_weights_are_constant():
    proj, x = cases()["pause"]
    model = model_for(proj)
    post = model.exact_posterior(x)
    q = Posterior(model)
    with torch.no_grad():
        assert torch.allclose(q.log_prob(post.support, x), post.log_probs, atol=1e-6)
        z = q.sample(x, 64)
        logw = model.z_dist(2).log_prob(z) - q.log_prob(z, x)
    assert torch.allclose(logw, post.log_marginal.expand(64), atol=1e-5)
    assert chi2(post.log_probs, q.log_prob(post.support, x)) < 1e-6
    assert chi2_from_weights(logw) < 1e-6


@pytest.mark.parametrize("centered", [False, True])
def test_inquisitive_matches_brute_force(centered):
    proj, x = cases()["pause"]
    model = model_for(proj, seed=7)
    support, _ = model.enumerate_log_joint(x)
    lp, grads = [], []
    for z in support:  # independent: a fresh distribution and one backward pass per z
        model.prior.zero_grad()
        l = LMSequence(model.prior, constraint=proj.domain(2)).log_prob(z[None])[0]
        l.backward()
        lp.append(float(l.detach()))
        grads.append(model.prior.logits.grad.detach().reshape(-1).clone())
    lp, G = torch.tensor(lp, dtype=torch.float64), torch.stack(grads).double()
    if centered:
        G = G - (torch.softmax(lp, 0)[:, None] * G).sum(0)
    w = lp.exp() * G.norm(dim=-1)
    want = (w / w.sum()).log()
    with torch.no_grad():
        got = Inquisitive(model, centered=centered).log_prob(support, x)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert chi2(want, model.exact_posterior(x).log_probs) > 1e-4  # Q_bullet != Q_* here


@pytest.mark.parametrize("kind", ["identity", "predictive", "explanatory", "posterior"])
def test_pyro_guide_in_a_plate_lines_up_with_the_model(kind):
    proj, x = cases()["pause"]
    model = model_for(proj)
    q = make_guide(kind, model)
    pyro.clear_param_store()

    def guide(x):
        with pyro.plate("particles", 16, dim=-1):
            return q(x)

    def mdl(x):
        with pyro.plate("particles", 16, dim=-1):
            return model(x)

    gtr = pyro.poutine.trace(guide).get_trace(x)
    site = gtr.nodes["z"]
    assert site["value"].shape == (16, proj.domain(2).max_len)
    assert isinstance(site["fn"], SamplerDistribution)
    with torch.no_grad():
        assert torch.allclose(site["fn"].log_prob(site["value"]), q.log_prob(site["value"], x), atol=1e-5)
    mtr = pyro.poutine.trace(pyro.poutine.replay(mdl, trace=gtr)).get_trace(x)
    mtr.compute_log_prob()
    gtr.compute_log_prob()
    logw = mtr.nodes["z"]["log_prob"] + mtr.nodes["x"]["log_prob"] - gtr.nodes["z"]["log_prob"]
    assert torch.isfinite(logw).all()
    if kind == "posterior":
        assert torch.allclose(logw, model.exact_log_prob(x).expand(16), atol=1e-5)


def test_predictive_log_prob_is_differentiable():
    proj, x = cases()["pause"]
    q = Predictive(tab(len(V2), 2, trainable=True), proj)
    support = torch.as_tensor(model_for(proj).enumerate_log_joint(x)[0])
    lq = q.log_prob(support, x)
    (lq.exp() * lq).sum().backward()
    assert torch.isfinite(q.lm.logits.grad).all() and q.lm.logits.grad.abs().sum() > 0


def test_gated_lm_starts_fast_and_passes_through():
    lm = tab(len(V2), 3, order=3)
    g = GatedLM(lm)
    toks = torch.tensor([[1, 6, 7, 5, 3, 6]])
    out, _ = g(toks)
    ref, _ = lm(toks)
    fast, _ = lm(torch.tensor([[1, 3, 6]]))
    assert torch.allclose(out[:, :3], ref[:, :3])  # before <explain>: the plain LM (playing P_f)
    gate = torch.sigmoid(torch.tensor(-4.0))
    assert torch.allclose(out[:, 3:], (1 - gate) * fast + gate * ref[:, 3:], atol=1e-5)
    plain, _ = g(torch.tensor([[1, 6, 7]]))
    assert torch.allclose(plain, lm(torch.tensor([[1, 6, 7]]))[0])


def test_mode_tags_share_one_lm():
    v = Vocab(["a", "b"], specials=DEFAULT + ("<infer>", "<train>"))
    proj = PauseToThink(v, 1)
    lm = tab(len(v), 9, order=4)
    qi, qt = Explanatory(lm, proj, mode_tag="<infer>"), Explanatory(lm, proj, mode_tag="<train>")
    support = torch.as_tensor(SlowThinking(lm, proj).enumerate_log_joint("ab")[0])
    with torch.no_grad():
        li, lt = qi.log_prob(support, "ab"), qt.log_prob(support, "ab")
    assert torch.isclose(li.exp().sum(), torch.tensor(1.0), atol=1e-5)
    assert not torch.allclose(li, lt)
    with pytest.raises(ValueError, match="mode tag"):
        Explanatory(lm, proj, mode_tag="<nope>")


def test_program_view_explanatory_guide():
    v = Vocab(["a", "b"])
    lm = tab(len(v), 21, order=3)
    sampler_lm = tab(len(v), 22, order=3)
    q = torch.tensor(v.encode("ab"))
    answer = torch.tensor(v.encode(["b", "<eos>"]))

    def cot(q, answer=None):
        with pyro.plate("p", 32, dim=-1):
            thought = pyro.sample("thought", LMSequence(lm, prompt=q, stop="</s>", max_len=4, vocab=v))
            pyro.sample("answer", LMSequence(lm, prompt=concat(q, thought), stop="<eos>", max_len=2, vocab=v),
                        obs=answer.expand(32, -1))  # LMSequence with batched prompts needs a batched obs

    g = explanatory_guide(sampler_lm, "thought", vocab=v, observed="answer", context=0, max_len=4)

    def guide(q, answer=None):
        with pyro.plate("p", 32, dim=-1):
            g(q, answer=answer)

    gtr = pyro.poutine.trace(guide).get_trace(q, answer=answer)
    mtr = pyro.poutine.trace(pyro.poutine.replay(cot, trace=gtr)).get_trace(q, answer=answer)
    mtr.compute_log_prob()
    gtr.compute_log_prob()
    logw = mtr.nodes["thought"]["log_prob"] + mtr.nodes["answer"]["log_prob"] - gtr.nodes["thought"]["log_prob"]
    assert torch.isfinite(logw).all()
    want = LMSequence(sampler_lm, prompt=concat(answer, torch.tensor([5]), q), stop="</s>", max_len=4,
                      vocab=v).log_prob(gtr.nodes["thought"]["value"])
    assert torch.allclose(gtr.nodes["thought"]["log_prob"], want, atol=1e-5)

    # pyro.infer.Predictive with the explanatory guide: thoughts from the guide, the answer it explains
    out = pyro.infer.Predictive(cot, guide=guide, num_samples=3)(q, answer=answer)
    assert out["thought"].shape == (3, 32, 4) and (out["answer"] == answer).all()
    with pytest.raises(ValueError, match="observed answer"):
        pyro.infer.Predictive(cot, guide=guide, num_samples=2)(q)


def test_predictive_works_with_every_guide_family():
    """pyro.infer.Predictive(model, guide=...) draws z from every library guide and x = Proj(z) from the model."""
    proj, x = cases()["pause"]
    model = model_for(proj)
    lm = tab(len(proj.vocab), 31, order=3)
    for guide in (Identity(model), Predictive(lm, proj), Causal(lm, proj), Explanatory(lm, proj), Posterior(model),
                  Inquisitive(model)):
        out = pyro.infer.Predictive(model, guide=guide, num_samples=4)(x)
        assert (out["x"] == model.x_ids(x)).all(), type(guide).__name__
        assert torch.isfinite(guide.log_prob(out["z"], x)).all(), type(guide).__name__


def test_chi2_kl_diagnostics():
    p = torch.tensor([0.5, 0.3, 0.2]).log()
    q = torch.tensor([0.2, 0.3, 0.5]).log()
    assert chi2(p, p) == pytest.approx(0.0, abs=1e-9)
    assert chi2(p, q) == pytest.approx(0.25 / 0.2 + 0.09 / 0.3 + 0.04 / 0.5 - 1, rel=1e-6)
    assert kl(p, q) == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-6)
    assert chi2(p, torch.tensor([0.0, 1.0, 0.0]).log()) == math.inf
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(q.exp(), 20000, replacement=True, generator=g)
    assert chi2_from_weights((p - q)[idx]) == pytest.approx(chi2(p, q), rel=0.1)
    proj, x = cases()["pause"]
    model = model_for(proj)
    post, ident = Posterior(model), Identity(model)
    exact = model.exact_posterior(x).log_probs
    with torch.no_grad():
        lq = ident.log_prob(model.exact_posterior(x).support, x)
    assert chi2(post, ident, model=model, x=x) == pytest.approx(chi2(exact, lq), rel=1e-5)


def test_sampler_hierarchy_gap():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "sampler_hierarchy.py"
    spec = importlib.util.spec_from_file_location("sampler_hierarchy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.run(steps=100)
    c, e = res["chi2"]["causal"]["max"], res["chi2"]["explanatory"]["max"]
    assert c > 0.5  # bounded away from 0 (Prop 3.5; 0.80 for the best fixed law)
    assert e * 10 <= c
    assert np.isfinite(res["chi2"]["identity"]["max"])


def test_table_samplers_refuse_what_is_not_a_slow_thinking_model():
    """Found by the public sweep: Posterior(None) failed with AttributeError ('NoneType' object has no attribute
    'projection'): Posterior inherits its constructor, which the type layer does not wrap, so it checks itself."""
    from ppl_thought.errors import ConfigError

    for bad in (None, torch.zeros(0), "model"):
        with pytest.raises(ConfigError, match="model must be a pt.models.SlowThinking"):
            Posterior(bad)
        with pytest.raises(ConfigError, match="model"):  # its own constructor: the type layer's ArgumentTypeError
            Inquisitive(bad)
    proj, _ = cases()["pause"]
    model = model_for(proj)
    with pytest.raises(ConfigError, match="limit"):
        Posterior(model, limit=1.5)
    assert Posterior(model, limit=100).limit == 100
