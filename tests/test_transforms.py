"""pt.transforms against exact answers: ProjectionLift = SlowThinking on every projection (enumeration, the same
Importance / SMC numbers with the same seed); Forgetful's likelihood is the product of (5.8) over rounds;
Persistent / Ubiquitous; composition under every engine, the order that does not matter and the one that does."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pyro
import pytest
import torch

import ppl_thought as pt
from ppl_thought.distributions import LMSequence
from ppl_thought.errors import ArgumentTypeError, TransformError
from ppl_thought.transforms import (
    Forgetful,
    ForgetfulLM,
    Persistent,
    ProjectionLift,
    Ubiquitous,
    compose,
    exact_log_prob,
    forgetful_context,
)

VOCAB = pt.Vocab(["a", "b"])
V = len(VOCAB)


def tab(seed: int, vocab_size: int = V, order: int = 3, scale: float = 1.5) -> pt.lm.Tabular:
    g = torch.Generator().manual_seed(seed)
    return pt.lm.Tabular(order, vocab_size, torch.randn((vocab_size,) * order, generator=g) * scale, trainable=False)


def tiny_transformer(seed: int, vocab_size: int = V) -> pt.lm.Transformer:
    torch.manual_seed(seed)
    lm = pt.lm.Transformer(vocab_size, d_model=16, n_layers=2, n_heads=2, max_len=64)
    with torch.no_grad():  # a random network with sharp logits: thoughts matter to what follows
        lm.lm_head.weight.mul_(4.0)
    return lm.eval()


def projections() -> dict:
    prod = pt.projections.Product.build(["a", "b"], ["u", "v"])
    return {
        "identity": pt.projections.Identity(VOCAB),
        "product": prod,
        "pause": pt.projections.PauseToThink(VOCAB, max_thought_len=2),
        "sparse": pt.projections.SparseThoughts(VOCAB, thought_len=1, positions=[0, 2]),
        "query_response": pt.projections.QueryResponse(VOCAB, max_thought_len=1),
        "switch": pt.projections.FirstTokenSwitch(VOCAB, repeat_token="a"),
    }


def plain_function(lm, vocab):
    """What a user writes: an LM program with one sequence site "x" (no thoughts, no projection)."""
    def lm_program(x):
        return pyro.sample("x", LMSequence(lm, max_len=len(x), vocab=vocab), obs=x)
    return lm_program


# ---------------------------------------------------------------------------------------------- ProjectionLift
@pytest.mark.parametrize("name", list(projections()))
def test_projection_lift_equals_slow_thinking_exactly(name):
    """Proj # P_f three ways: SlowThinking's enumeration (z_dist.log_prob), ProjectionLift on a plain Pyro function
    and on PlainLM (both scored through their traces with z conditioned on the whole lifting): (2.22) to 1e-6 on
    every x of length 1..3 (x outside the image: -inf all three)."""
    proj = projections()[name]
    lm = tab(sum(map(ord, name)) % 97, len(proj.vocab))
    slow = pt.models.SlowThinking(lm, proj)
    lifted_fn = ProjectionLift(proj)(plain_function(lm, proj.vocab))
    lifted_prog = ProjectionLift(proj)(pt.models.PlainLM(lm, proj.vocab))
    assert lifted_fn.projection is proj and lifted_prog.projection is proj
    for n in (1, 2, 3):
        for xs in itertools.product(proj.observable_ids.tolist(), repeat=n):
            x = torch.tensor(xs)
            a = float(slow.exact_log_prob(x))
            b = float(exact_log_prob(lifted_fn, x))
            c = float(exact_log_prob(lifted_prog, x))
            if math.isinf(a):
                assert math.isinf(b) and math.isinf(c), (name, xs)
            else:
                assert abs(a - b) < 1e-6 and abs(a - c) < 1e-6, (name, xs, a, b, c)


@pytest.mark.parametrize("name", ["pause", "sparse", "query_response", "product"])
def test_same_importance_and_smc_numbers_with_the_same_seed(name):
    proj = projections()[name]
    lm = tab(3, len(proj.vocab))
    x = torch.tensor(proj.observable_ids[[0, 1, 0]])
    slow = pt.models.SlowThinking(lm, proj)
    guide = pt.guides.Causal(tab(4, len(proj.vocab), scale=0.5), proj)
    runs = []
    for model in (slow, ProjectionLift(proj)(plain_function(lm, proj.vocab)),
                  ProjectionLift(proj)(pt.models.PlainLM(lm, proj.vocab))):
        pyro.set_rng_seed(11)
        runs.append(pt.infer.Importance(16).run(model, guide, x))
    for r in runs[1:]:
        assert torch.equal(r.log_weights, runs[0].log_weights)
        assert torch.equal(r.samples["z"], runs[0].samples["z"])
    smc = []
    for model in (slow, ProjectionLift(proj)(pt.models.PlainLM(lm, proj.vocab))):
        for g in (guide, pt.guides.Predictive(tab(5, len(proj.vocab), scale=0.5), proj)):
            pyro.set_rng_seed(5)
            smc.append(pt.infer.SMC(16, ess_threshold=0.9).run(model, g, x))
    for a, b in ((smc[0], smc[2]), (smc[1], smc[3])):
        assert torch.equal(a.log_weights, b.log_weights) and torch.equal(a.log_marginal, b.log_marginal)
        assert torch.equal(a.samples["z"], b.samples["z"]) and torch.equal(a.ancestry, b.ancestry)


def test_projection_lift_generates_and_rejects_bad_input():
    proj = projections()["pause"]
    model = ProjectionLift(proj)(pt.models.PlainLM(tab(1), VOCAB))
    pyro.set_rng_seed(0)
    tr = pyro.poutine.trace(model).get_trace(None, length=3)
    z, x = tr.nodes["z"]["value"], tr.nodes["x"]["value"]
    assert proj.project(z[z != 0]).tolist() == x.tolist() and len(x) == 3
    with pytest.raises(ArgumentTypeError, match="projection"):
        ProjectionLift("not a projection")
    with pytest.raises(TransformError):
        ProjectionLift(proj, site="x", latent="x")
    with pytest.raises(TransformError):  # an LM over another vocabulary
        exact_log_prob(ProjectionLift(proj)(plain_function(tab(1, V + 2), None)), torch.tensor([6]))


# ---------------------------------------------------------------------------------------------- Forgetful
def test_forgetful_context_deletes_earlier_thoughts_only():
    ids = VOCAB.encode("<bos> a <s> b </s> a <s> a")
    ctx = forgetful_context(torch.tensor([ids]))[0].tolist()
    assert ctx == VOCAB.encode("<bos> a a <s> a")
    ids = VOCAB.encode("<bos> a <s> b </s> a b")  # the current (last) thought stays until the next one starts
    assert forgetful_context(torch.tensor([ids]))[0].tolist() == ids


def test_forgetful_lm_logits_are_the_lm_on_the_forgetful_context():
    lm = tiny_transformer(0)
    f = ForgetfulLM(lm)
    rows = [VOCAB.encode("<bos> a <eos> <s> b </s> a <eos> <s> a </s> b"), VOCAB.encode("<bos> b <s> a </s> <s> b")]
    L = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (L - len(r)) for r in rows])
    out, _ = f(tokens)
    for i, r in enumerate(rows):
        for m in range(len(r)):
            ctx = forgetful_context(torch.tensor([r[: m + 1]]))
            ref = lm(ctx)[0][0, -1]
            assert torch.allclose(out[i, m], ref, atol=1e-5), (i, m)


def round_sums(lm, proj, x: list[int]) -> float:
    """(5.7)/(5.8), computed from the LM directly: with forgetful thoughts after each query of a conversation,
    log p(x) = log P(x_q^(1)) + sum_t log sum_{y in T} P_f(y x_r^(t) x_q^(t+1) | observable context -> ...):
    one sum over T per round. Masks from the domain automaton (Def 2.8), one forward per token."""
    vocab, c = proj.vocab, proj.max_thought_len
    dom = proj.domain(len(x))
    thoughts = [[vocab.think_id, *y, vocab.end_think_id] for k in range(c + 1)
                for y in itertools.product(vocab.ordinary_ids.tolist(), repeat=k)]
    # split x into the first query and the segments after each query's <eos>
    ends = [i for i, a in enumerate(x) if a == vocab.eos_id][0::2]  # the <eos> of each query
    cuts = [e + 1 for e in ends if e + 1 < len(x)]
    pieces = [x[: cuts[0]]] + [x[a:b] for a, b in zip(cuts, cuts[1:] + [len(x)])] if cuts else [x]

    def seg_log_prob(obs_ctx, seg, state):
        total, ctx = 0.0, [vocab.bos_id] + obs_ctx
        for tok in seg:
            logits = lm(torch.tensor([ctx]))[0][0, -1].detach().double()
            allowed = torch.as_tensor(dom.allowed[state])
            logits[~allowed] = -math.inf
            total += float(torch.log_softmax(logits, -1)[tok])
            state = int(dom.next_state[state, tok])
            ctx.append(tok)
        return total, state

    lp, state = seg_log_prob([], pieces[0], dom.start)
    obs = list(pieces[0])
    for piece in pieces[1:]:
        terms, states = [], []
        for y in thoughts:
            v, s = seg_log_prob(obs, y + piece, state)
            terms.append(v)
            states.append(s)
        lp += float(np.logaddexp.reduce(terms))
        state = states[0]  # the automaton's phase after a round does not depend on the thought
        obs += piece
    return lp


@pytest.mark.parametrize("text", ["a <eos> b <eos> a <eos> b", "b a <eos> a <eos> b <eos> a b", "a <eos> b"])
def test_forgetful_likelihood_is_the_product_of_per_round_sums(text):
    """Def 5.1: with earlier thoughts forgotten, the enumeration over T^T of the whole lifting (the transformed
    model's trace, z conditioned on every lifting) equals the product over rounds of sums over T, (5.7)-(5.8);
    the persistent model (same LM) gives another number, which the per-round formula does not reproduce."""
    proj = pt.projections.QueryResponse(VOCAB, max_thought_len=1)
    lm = tiny_transformer(1)
    x = VOCAB.encode(text)
    forgetful = Forgetful()(ProjectionLift(proj)(pt.models.PlainLM(lm, VOCAB)))
    exact = float(exact_log_prob(forgetful, torch.tensor(x)))
    assert abs(exact - round_sums(lm, proj, x)) < 1e-5
    rounds = text.count("<eos>") // 2 + 1
    if rounds >= 2:
        persistent = float(pt.models.SlowThinking(lm, proj).exact_log_prob(torch.tensor(x)))
        assert abs(persistent - exact) > 1e-4  # the earlier thought matters to a persistent latent


def test_forgetful_order_with_projection_lift_does_not_matter_and_runs_every_engine(request):
    proj = pt.projections.QueryResponse(VOCAB, max_thought_len=1)
    lm = tiny_transformer(2)
    x = torch.tensor(VOCAB.encode("a <eos> b <eos> a <eos> b"))
    a = Forgetful()(ProjectionLift(proj)(pt.models.PlainLM(lm, VOCAB)))
    b = ProjectionLift(proj)(Forgetful()(pt.models.PlainLM(lm, VOCAB)))
    assert abs(float(exact_log_prob(a, x)) - float(exact_log_prob(b, x))) < 1e-6
    guide = pt.guides.Causal(tab(6, scale=0.5), proj)
    for engine in (pt.infer.Importance(16), pt.infer.SMC(16)):
        ra, rb = [], []
        for model, out in ((a, ra), (b, rb)):
            pyro.set_rng_seed(3)
            out.append(engine.run(model, guide, x))
        assert torch.equal(ra[0].log_weights, rb[0].log_weights)


# ---------------------------------------------------------------------------------------------- Persistent, Ubiquitous
def test_persistent_is_the_default_and_refuses_forgetful():
    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=1)
    lm = tiny_transformer(3)
    x = torch.tensor(VOCAB.encode("a b a"))
    plain = ProjectionLift(proj)(pt.models.PlainLM(lm, VOCAB))
    persistent = Persistent()(plain)
    assert float(exact_log_prob(persistent, x)) == float(exact_log_prob(plain, x))
    pyro.set_rng_seed(0)
    r1 = pt.infer.SMC(8).run(persistent, None, x)
    pyro.set_rng_seed(0)
    r2 = pt.infer.SMC(8).run(plain, None, x)
    assert torch.equal(r1.log_weights, r2.log_weights)
    for model in (Persistent()(Forgetful()(plain)), Forgetful()(Persistent()(plain))):
        with pytest.raises(TransformError, match="forgetful"):
            exact_log_prob(model, x)


def test_ubiquitous_lets_thoughts_stand_anywhere_with_the_explanatory_sampler():
    """5.6.1: under Ubiquitous a thought may precede any token (the lifting of QueryResponse allows one only after a
    query); its sampler reads "x <explain>" (Fig 5.5) and is supported exactly on the lifting: Importance with it
    is exact in expectation and its per-particle weights sum to the enumerated p(x) over the support."""
    lm = tab(8)
    ub = Ubiquitous(VOCAB, max_thought_len=1)
    model = ub(pt.models.PlainLM(lm, VOCAB))
    x = torch.tensor(VOCAB.encode("a <eos> b"))
    qr = pt.projections.QueryResponse(VOCAB, max_thought_len=1)
    assert len(ub.projection.enumerate_lifting(x)) > len(qr.enumerate_lifting(x))
    z_before_first = VOCAB.encode("<s> a </s> a <eos> b")  # a thought before the first token: ubiquitous only
    assert tuple(z_before_first) in set(ub.projection.enumerate_lifting(x))
    sampler = pt.guides.Explanatory(tab(9, scale=0.5), ub.projection)
    assert sampler.prompt(x).tolist() == ub.explain_prompt(x).tolist() == x.tolist() + [VOCAB.explain_id]
    exact = float(exact_log_prob(model, x))
    assert exact == pytest.approx(float(pt.models.SlowThinking(lm, ub.projection).exact_log_prob(x)), abs=1e-6)
    est = []
    for seed in range(8):
        pyro.set_rng_seed(seed)
        est.append(float(pt.infer.Importance(64).run(model, sampler, x).log_marginal))
    z_hat = np.exp(np.array(est) - exact)
    assert abs(z_hat.mean() - 1) < 3 * z_hat.std(ddof=1) / np.sqrt(len(z_hat)) + 0.02


# ---------------------------------------------------------------------------------------------- composition
def test_compose_is_nesting():
    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=1)
    f, p = Forgetful(), ProjectionLift(proj)
    a = compose(f, p)(pt.models.PlainLM(tab(1), VOCAB))
    assert a.transforms == [f, p] and isinstance(a.base, pt.models.PlainLM)
    with pytest.raises(ArgumentTypeError, match="transforms"):
        compose(f, "x")


# ---------------------------------------------------------------------------------------------- CostAware
def _cost_setup(weight: float = 0.5):
    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=1)
    g = torch.Generator().manual_seed(4)
    prior = pt.lm.Tabular(2, V, torch.randn(V, V, generator=g), trainable=True)
    return proj, prior, torch.tensor(VOCAB.encode("a b"))


def exact_cost_loss(prior, proj, x, weight: float, entropy: float = 0.0) -> torch.Tensor:
    """(5.27) exactly: C(theta) T*(theta) with C = -log (Proj # P)(x) - H~ (2.22) and T* = E_{Q_*}[1 + w |Z|]."""
    model = pt.models.SlowThinking(prior, proj)
    lifting = proj.enumerate_lifting(x)
    support = pt.models.pad_sequences(lifting, model.z_dist(len(x)).max_len)
    lp = model.z_dist(len(x)).log_prob(support)
    log_px = torch.logsumexp(lp, 0)
    post = torch.exp(lp - log_px)
    tau = 1.0 + weight * torch.tensor([float(len(z)) for z in lifting])
    return (-log_px - entropy) * (post * tau).sum()


def test_exact_cost_gradient_matches_finite_differences():
    proj, prior, x = _cost_setup()
    (p,) = list(prior.parameters())
    loss = exact_cost_loss(prior, proj, x, 0.5, entropy=0.3)
    (grad,) = torch.autograd.grad(loss, [p])
    eps = 1e-2  # central differences: O(eps^2) error, float32 rounding ~1e-5 at this eps
    for idx in [(6, 6), (6, 3), (3, 7), (1, 6), (4, 7)]:
        with torch.no_grad():
            p[idx] += eps
            up = float(exact_cost_loss(prior, proj, x, 0.5, entropy=0.3))
            p[idx] -= 2 * eps
            down = float(exact_cost_loss(prior, proj, x, 0.5, entropy=0.3))
            p[idx] += eps
        assert abs((up - down) / (2 * eps) - float(grad[idx])) < 1e-3 * (1 + abs(float(grad[idx]))), idx


class _NoCovariance(pt.transforms.CostAware):
    """A wrong estimator of grad T*: the covariance term of 5.6.3 dropped (grad of sum w tau log P only)."""

    def estimate(self, log_p, log_w, lengths):
        t_s, _ = super().estimate(log_p, log_w, lengths)
        w = torch.softmax(log_w.detach(), 0)
        return t_s, (w * self.tau(lengths) * log_p).sum()


def _mean_estimated_gradient(cost, seeds, n: int):
    proj, prior, x = _cost_setup()
    (p,) = list(prior.parameters())
    inner = pt.models.SlowThinking(prior, proj)
    model = cost(inner)
    guide = pt.guides.Posterior(inner)
    objective = pt.train.OneSampler(num_particles=n)
    grads = []
    for seed in seeds:
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        surr = objective.differentiable_loss(model, guide, x)
        grads.append(torch.autograd.grad(surr, [p])[0].detach().clone())
    exact = torch.autograd.grad(exact_cost_loss(prior, proj, x, cost.weight), [p])[0]
    return torch.stack(grads), exact


def test_cost_aware_gradient_estimator_mean_matches_exact_gradient(request):
    """5.6.3 with the exact posterior sampler (Q = Q_*): the mean of the estimated gradient of
    C_s (T~* + D(T_s - T~*)) over seeds equals grad (C T*) (enumeration) within 4 standard errors plus the
    O(1/n) bias of the self-normalised ratio; dropping the covariance term of grad T* fails the same bound."""
    seeds = range(120 if request.config.getoption("--slow") else 40)
    grads, exact = _mean_estimated_gradient(pt.transforms.CostAware(0.5), seeds, n=64)
    mean, se = grads.mean(0), grads.std(0) / math.sqrt(len(grads))
    bound = 4 * se + 0.03 * exact.abs().max()
    assert ((mean - exact).abs() <= bound).all(), ((mean - exact).abs() / bound).max()
    wrong, _ = _mean_estimated_gradient(_NoCovariance(0.5), seeds, n=64)
    assert ((wrong.mean(0) - exact).abs() > 4 * wrong.std(0) / math.sqrt(len(wrong)) + 0.03 * exact.abs().max()).any()


@pytest.mark.parametrize("objective", ["one", "two", "r1", "sampler", "sum"])
def test_cost_aware_runs_under_every_svi_objective(objective):
    proj, prior, x = _cost_setup()
    inner = pt.models.SlowThinking(prior, proj)
    model = pt.transforms.CostAware(0.5, entropy=0.1)(inner)
    q = pt.guides.Causal(pt.lm.Tabular(2, V, torch.zeros(V, V), trainable=True), proj)
    obj = {"one": lambda: pt.train.OneSampler(4), "two": lambda: pt.train.TwoSampler(pt.guides.Identity(inner), 4),
           "r1": lambda: pt.train.R1Zero(4), "sampler": lambda: pt.train.SamplerPolicyGradient(4),
           "sum": lambda: pt.train.Sum(pt.train.OneSampler(4), pt.train.SamplerPolicyGradient(4))}[objective]()
    guide = pt.guides.Identity(inner) if objective == "r1" else q
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    plain_value = obj.loss(inner, guide, x)
    pyro.set_rng_seed(0)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), obj)
    losses = [svi.step(x) for _ in range(2)]
    assert all(math.isfinite(v) for v in losses)
    assert obj.last_stats["time"] >= 1.0 and obj.last_stats["cross_entropy"] == pytest.approx(plain_value - 0.1,
                                                                                              abs=5.0)


# ---------------------------------------------------------------------------------------------- composition
def test_composed_transforms_run_every_engine_and_commute(request):
    """CostAware(w)(Forgetful()(ProjectionLift(proj)(lm_program))) under Importance, SMC and SVI; every order of
    the three gives the same numbers (exact, Importance and SMC with the same seed); a second lifting is refused."""
    proj = pt.projections.QueryResponse(VOCAB, max_thought_len=1)
    lm = tiny_transformer(4)
    x = torch.tensor(VOCAB.encode("a <eos> b <eos> a"))
    orders = [
        lambda p: pt.transforms.CostAware(0.2)(Forgetful()(ProjectionLift(proj)(p))),
        lambda p: Forgetful()(pt.transforms.CostAware(0.2)(ProjectionLift(proj)(p))),
        lambda p: ProjectionLift(proj)(Forgetful()(pt.transforms.CostAware(0.2)(p))),
        lambda p: compose(ProjectionLift(proj), pt.transforms.CostAware(0.2), Forgetful())(p),
    ]
    models = [make(pt.models.PlainLM(lm, VOCAB)) for make in orders]
    assert all(m.projection is proj and m.cost_aware.weight == 0.2 for m in models)
    exact = [float(exact_log_prob(m, x)) for m in models]
    assert max(exact) - min(exact) < 1e-6
    guide = pt.guides.Causal(tab(2, scale=0.5), proj)
    for engine in (pt.infer.Importance(32), pt.infer.SMC(32)):
        res = []
        for m in models:
            pyro.set_rng_seed(9)
            res.append(engine.run(m, guide, x))
        assert all(torch.equal(r.log_weights, res[0].log_weights) for r in res)
    est = []
    for seed in range(6):
        pyro.set_rng_seed(seed)
        est.append(float(pt.infer.SMC(64).run(models[0], guide, x).log_marginal))
    z = np.exp(np.array(est) - exact[0])
    assert abs(z.mean() - 1) < 3 * z.std(ddof=1) / np.sqrt(len(z)) + 0.05
    pyro.clear_param_store()
    q = pt.guides.Causal(pt.lm.Tabular(2, V, torch.zeros(V, V), trainable=True), proj)
    svi = pt.train.SVI(pt.train.OneSampler(4), pyro.optim.Adam({"lr": 0.01}))
    r = svi.run(models[0], q, x, num_steps=2)
    assert all(math.isfinite(v) for v in r.stats["losses"])
    with pytest.raises(TransformError, match="lifted already"):
        ProjectionLift(pt.projections.PauseToThink(VOCAB, 1))(models[0])


def test_forgetful_context_refuses_float_or_1d_tokens():
    """Found by the public sweep: forgetful_context(zeros(0)) unpacked a 1-D shape (a bare ValueError), and float
    tokens were cast to ids silently."""
    from ppl_thought.errors import MalformedSequenceError

    with pytest.raises(MalformedSequenceError, match="integer token ids"):
        forgetful_context(torch.zeros(0))
    with pytest.raises(MalformedSequenceError, match="\\[n, L\\]"):
        forgetful_context(torch.tensor([6, 7]))
    assert forgetful_context(torch.tensor([[6, 7]])).tolist() == [[6, 7]]


# ---------------------------------------------------------------------------------------------- refusals
def normal_model(x):
    """A model without a sequence site: what no transform of this module can act on."""
    return pyro.sample("x", pyro.distributions.Normal(0.0, 1.0), obs=torch.tensor(0.3))


class CountingLM(pt.models.PlainLM):
    """PlainLM that counts its steps (the refusal comes at the end of the first one)."""

    steps = 0

    def step(self, state, t, *args, **kwargs):
        CountingLM.steps += 1
        return super().step(state, t, *args, **kwargs)


def test_projection_lift_refuses_a_site_the_model_does_not_have():
    """ProjectionLift(site="nope") ran and returned log p(x) of the unlifted LM (Importance and SMC alike): now a
    TransformError naming the site and the model's sequence sites, at the end of the run (whole view) or of the
    first step (step view, SMC)."""
    proj, lm, x = projections()["pause"], tab(1), torch.tensor(VOCAB.encode("a b a"))
    for lift in (ProjectionLift(proj, site="nope"), Ubiquitous(VOCAB, 2, site="nope")):
        for run in (lambda m: pt.infer.Importance(4).run(m, None, x),
                    lambda m: exact_log_prob(m, x), lambda m: pyro.poutine.trace(m).get_trace(x)):
            with pytest.raises(TransformError, match=r"'nope'.*sequence sites: 'x'"):
                run(lift(pt.models.PlainLM(lm, VOCAB)))
        with pytest.raises(TransformError, match=r"'nope'"):
            run(lift(plain_function(lm, VOCAB)))
        CountingLM.steps = 0
        with pytest.raises(TransformError, match=r"needs the token-sequence site 'nope'"):
            pt.infer.SMC(4).run(lift(CountingLM(lm, VOCAB)), None, x)
        assert CountingLM.steps == 1  # refused at the first step, not after the whole run


def test_projection_lift_refuses_a_site_that_is_not_a_sequence():
    """ProjectionLift on a Normal site returned the Normal's log-density: now refused when the site is met."""
    proj = projections()["pause"]
    with pytest.raises(TransformError, match=r"site 'x': it is a Normal.*LMSequence"):
        pt.infer.Importance(4).run(ProjectionLift(proj)(normal_model), None, None)
    with pytest.raises(TransformError, match=r"site 'x': it is a Normal"):
        pyro.poutine.trace(Ubiquitous(VOCAB, 2)(normal_model)).get_trace(None)


@pytest.mark.parametrize("transform", [Forgetful, Persistent])
def test_thinking_transforms_refuse_a_model_without_a_sequence_site(transform):
    """Forgetful() / Persistent() on a model with no sequence site ran and returned a number."""
    with pytest.raises(TransformError, match=r"needs a sequence site.*sequence sites: none"):
        pt.infer.Importance(4).run(transform()(normal_model), None, None)
    x = torch.tensor(VOCAB.encode("a b"))
    res = pt.infer.Importance(4).run(transform()(pt.models.PlainLM(tab(1), VOCAB)), None, x)  # a sequence site
    assert torch.isfinite(res.log_marginal)


def test_cost_aware_refuses_a_model_without_latent_thoughts():
    """CostAware on the plain LM (no latent sequence) priced nothing; refused in both views. With a lifting it
    runs, also when the engine conditions the latent (exact enumeration)."""
    lm, x = tab(1), torch.tensor(VOCAB.encode("a b"))
    for run in (lambda m: pt.infer.Importance(4).run(m, None, x), lambda m: pt.infer.SMC(4).run(m, None, x)):
        with pytest.raises(TransformError, match="latent sequence site"):
            run(pt.transforms.CostAware(0.1)(pt.models.PlainLM(lm, VOCAB)))
    lifted = pt.transforms.CostAware(0.1)(ProjectionLift(projections()["pause"])(pt.models.PlainLM(lm, VOCAB)))
    assert math.isfinite(float(exact_log_prob(lifted, x)))


# ---------------------------------------------------------------------------------------------- frozen models
def test_an_error_inside_a_program_over_a_frozen_lm_names_no_weight(recwarn):
    """A frozen (requires_grad False) LM in training mode: PlainLM's ``pyro.module`` warned once per weight and a
    partly frozen one listed its frozen weights; an error raised inside ``step`` now shows no weight's name."""

    class Failing(pt.models.PlainLM):
        def step(self, state, t, *args, **kwargs):
            raise pt.errors.ProgramError("boom inside step")

    pyro.clear_param_store()
    lm = pt.lm.Transformer(V, d_model=8, n_layers=1, n_heads=2, max_len=16)  # training mode
    names = [k for k, _ in lm.named_parameters()]
    x = torch.tensor(VOCAB.encode("a b"))
    lm.requires_grad_(False)
    with pytest.raises(pt.errors.ProgramError) as e:
        pt.infer.SMC(2).run(Failing(lm, VOCAB), None, x)
    text = str(e.value) + " ".join(str(w.message) for w in recwarn.list)
    assert "boom inside step" in str(e.value) and not any(n in text for n in names), text
    lm.embed.requires_grad_(True)  # partly frozen: only the trainable weight is a param site
    tr = pyro.poutine.trace(pt.models.PlainLM(lm, VOCAB)).get_trace(x)
    params = [k for k, s in tr.nodes.items() if s["type"] == "param"]
    assert params == ["lm$$$embed.weight"], params
    assert not any("requires_grad" in str(w.message) for w in recwarn.list)
    pyro.clear_param_store()
