"""Active lifting (Section 6): the ActiveLift transform, the estimators of (6.7), (6.10), (6.15)-(6.19) against
enumeration, encoding (6.17)/(6.18), conditional encoding and decoding (6.20)-(6.22), the coding experiment of 6.3.

Unbiasedness tests: the exact expectation enumerates every z in Omega^T (and every x); the Monte-Carlo mean of
R independent replicates of the estimator is compared along a few fixed directions with a bound of 4 standard
errors; one wrong estimator (no reward-to-go) is shown to miss by many standard errors.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pyro
import pytest
import torch

import ppl_thought as pt
from ppl_thought.errors import ActiveLiftError, MalformedSequenceError, PPLThoughtError
from ppl_thought.lm import Transformer
from ppl_thought.training.active import (
    ActiveLifting,
    ConditionalSamplerLoss,
    GeneratorLoss,
    MinimumLengthCoding,
    active_terms,
    conditional_decode,
    conditional_encode,
    encode,
    prefix_sums,
    reward_to_go,
)
from ppl_thought.transforms import ActiveLift, score_continuation

T = 2
VOCAB = pt.Vocab(["0", "1", "a", "b"])
OMEGA = ["0", "1"]


def _lm(seed: int, scale: float = 0.6) -> Transformer:
    torch.manual_seed(seed)
    lm = Transformer(len(VOCAB), d_model=8, n_layers=1, n_heads=2, max_len=16)
    with torch.no_grad():  # far from uniform, so that the gradients are not tiny
        for p in lm.parameters():
            p.normal_(0.0, scale)
    return lm


def _lift(separate: bool = True, T: int = T, max_x_len: int = 3) -> ActiveLift:
    if separate:
        return ActiveLift(_lm(0), VOCAB, T, OMEGA, max_x_len=max_x_len, prior_lm=_lm(1), generator_lm=_lm(2))
    return ActiveLift(_lm(0), VOCAB, T, OMEGA, max_x_len=max_x_len)


def _all_z(lift: ActiveLift) -> torch.Tensor:
    ids = [VOCAB.id(t) for t in OMEGA]
    return torch.tensor(list(itertools.product(ids, repeat=lift.latent_len)))


XS = torch.tensor([[VOCAB.id("a"), VOCAB.id("<eos>")], [VOCAB.id("b"), VOCAB.id("<eos>")],
                   [VOCAB.id("a"), VOCAB.id("b")]])
PSTAR = torch.tensor([0.5, 0.3, 0.2])


def _exact_objective(kind: str, lift: ActiveLift) -> torch.Tensor:
    """sum_x P_*(x) sum_z Q(z|x) sum_t r_t(z, x) by enumeration (with gradients to every part)."""
    zs = _all_z(lift)
    total = torch.zeros(())
    for x, w in zip(XS, PSTAR):
        lq = lift.sampler_log_probs(zs, x)
        lp = lift.prior_log_probs(zs)
        lg = lift.generator_log_probs(x, zs)
        LQ, LP = prefix_sums(lq), prefix_sums(lp)
        r = {"min_max": LP - LQ, "coding": -lg, "active": LP - LQ - lg}[kind]
        total = total + w * (LQ[:, -1].exp() * r.sum(-1)).sum()
    return total


def _grads(lift: ActiveLift) -> dict[str, torch.Tensor]:
    out = {}
    for role, m in (("Q", lift.lm), ("P", lift.prior_lm), ("G", lift.generator_lm)):
        out[role] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                               for p in m.parameters()])
    return out


def _zero(lift: ActiveLift) -> None:
    for m in (lift.lm, lift.prior_lm, lift.generator_lm):
        m.zero_grad(set_to_none=True)


def _wrong_surrogate(kind, lq, lp, lg, weights):
    """A WRONG estimator: token s credited with its own term r_s only (no reward-to-go), LOO baseline."""
    LQ, LP = prefix_sums(lq), prefix_sums(lp)
    r = {"min_max": LP - LQ, "coding": -lg, "active": LP - LQ - lg}[kind].detach()[..., 1:]
    n = r.shape[-2]
    a = (r - r.mean(-2, keepdim=True)) * n / (n - 1)
    return ((a * lq).sum(-1).mean(-1) * weights).sum()


def _replicates(kind: str, lift: ActiveLift, R: int, n: int, wrong: bool = False) -> dict[str, torch.Tensor]:
    rows = {"Q": [], "P": [], "G": []}
    x_rows = XS.repeat(n, 1)
    N = XS.shape[0]
    for _ in range(R):
        _zero(lift)
        with torch.no_grad():
            z = lift.sampler(XS).sample((n,)).reshape(n * N, -1)
        per_x = lambda a: a.view(n, N, -1).transpose(0, 1)  # noqa: E731
        lq = per_x(lift.sampler_log_probs(z, x_rows))
        lp = per_x(lift.prior_log_probs(z))
        lg = per_x(lift.generator_log_probs(x_rows, z))
        if wrong:
            surr = _wrong_surrogate(kind, lq, lp, lg, PSTAR)
        else:
            _, surr = active_terms(kind, lq, lp, lg, weights=PSTAR, fit_prior=False)
        surr.backward()
        for k, g in _grads(lift).items():
            rows[k].append(g)
    return {k: torch.stack(v) for k, v in rows.items()}


def _max_z_score(samples: torch.Tensor, exact: torch.Tensor, seed: int = 0) -> float:
    """Largest |mean - exact| / SE along the exact gradient's direction and 3 fixed random directions."""
    g = torch.Generator().manual_seed(seed)
    dirs = [exact / exact.norm()] + [torch.randn(exact.shape, generator=g) for _ in range(3)]
    worst = 0.0
    for d in dirs:
        proj = samples @ d
        se = proj.std() / math.sqrt(len(proj))
        worst = max(worst, float((proj.mean() - exact @ d).abs() / se))
    return worst


# ================================================================================= the transform
def test_transform_formats_and_importance_match_enumeration():
    torch.manual_seed(0)
    lift = _lift(separate=False)
    x = XS[0]

    def program(x):
        return pyro.sample("x", pt.dist.LMSequence(lift.lm, max_len=3), obs=x)

    lifted = lift(program)
    gtr = pyro.poutine.trace(lift.guide).get_trace(x)
    z = gtr.nodes["z"]["value"]
    mtr = pyro.poutine.trace(pyro.poutine.replay(lifted, trace=gtr)).get_trace(x)
    assert set(k for k, s in mtr.nodes.items() if s["type"] == "sample") == {"z", "x"}
    # the trace's log-probs are the prefix quantities at t = T (one LM, three formats)
    assert torch.allclose(mtr.nodes["z"]["fn"].log_prob(z), lift.prior_log_probs(z).sum(), atol=1e-5)
    assert torch.allclose(mtr.nodes["x"]["fn"].log_prob(x), lift.generator_log_probs(x, z)[0, -1], atol=1e-5)
    assert torch.allclose(gtr.nodes["z"]["fn"].log_prob(z), lift.sampler_log_probs(z, x).sum(), atol=1e-5)
    # Importance on the lifted model estimates P_model(x) = sum_z P(z) G(x | z)
    zs = _all_z(lift)
    with torch.no_grad():
        exact = torch.logsumexp(lift.prior_log_probs(zs).sum(-1) + lift.generator_log_probs(x, zs)[:, -1], 0)
        res = pt.infer.Importance(400).run(lifted, lift.guide, x)
        assert abs(float(res.log_marginal) - float(exact)) < 4 * float(res.log_marginal_stderr) + 1e-3
        # Q is a law on Omega^T, P too, and G(. | z) over complete x of length <= max_x_len sums to <= 1
        lq = lift.sampler_log_probs(zs, x).sum(-1)
        assert abs(float(lq.exp().sum()) - 1) < 1e-5
        assert abs(float(lift.prior_log_probs(zs).sum(-1).exp().sum()) - 1) < 1e-5


def test_score_continuation_dedup_equals_plain_pass():
    lift = _lift(separate=False)
    lm = lift.lm
    ctx = torch.tensor([[1, 6, 3], [1, 3, 0], [1, 6, 3], [1, 6, 3]])
    cont = torch.tensor([[6, 7], [6, 0], [6, 7], [7, 6]])
    lp = score_continuation(lm, ctx, cont, torch.ones(len(VOCAB), dtype=torch.bool))
    for i in range(4):
        c = ctx[i][ctx[i] != 0]
        y = cont[i][cont[i] != 0]
        logits, _ = lm(torch.cat([c, y[:-1]])[None])
        ref = logits[0, len(c) - 1:].log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)
        assert torch.allclose(lp[i, :len(y)], ref, atol=1e-5)
        assert (lp[i, len(y):] == 0).all()


def test_generator_prefix_columns():
    lift = _lift()
    z = _all_z(lift)
    lg = lift.generator_log_probs(XS[0], z)
    assert lg.shape == (z.shape[0], T + 1)
    assert torch.allclose(lg[:, 0], lg[0, 0].expand(z.shape[0]))  # t = 0 reads no latent token
    for t in range(1, T + 1):  # column t depends on z_<=t only
        same = (z[:, :t][:, None] == z[:, :t][None]).all(-1)
        assert torch.allclose(lg[:, t][:, None].expand_as(same)[same], lg[:, t][None].expand_as(same)[same])


def test_bad_input_raises_clear_errors():
    lm = _lm(0)
    with pytest.raises(ActiveLiftError, match="Omega"):
        ActiveLift(lm, VOCAB, 2, ["0"])
    with pytest.raises(ActiveLiftError, match="delimit"):
        ActiveLift(lm, VOCAB, 2, ["0", "<s>"])
    with pytest.raises(ActiveLiftError, match="vocab_size"):
        ActiveLift(Transformer(5, d_model=8, n_layers=1, n_heads=2), VOCAB, 2, OMEGA)
    lift = ActiveLift(lm, VOCAB, 2, OMEGA)
    with pytest.raises(ActiveLiftError, match="outside Omega"):
        lift.prior_log_probs(torch.tensor([[VOCAB.id("a"), VOCAB.id("0")]]))
    with pytest.raises(MalformedSequenceError):
        lift.prior_log_probs(torch.tensor([[VOCAB.id("0")] * 3]))
    with pytest.raises(PPLThoughtError):
        lift.sampler_log_probs(torch.tensor([[6, 6]]), torch.tensor([0, 8]))  # padding inside x
    with pytest.raises(ActiveLiftError, match="kind"):
        active_terms("nope", torch.zeros(1, 2, 2))
    with pytest.raises(ActiveLiftError, match="at least 2 particles"):
        active_terms("min_max", torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    with pytest.raises(ActiveLiftError, match="not finite"):
        active_terms("coding", torch.zeros(1, 2, 2), log_g=torch.full((1, 2, 3), float("-inf")), fit_prior=False)


def test_reward_to_go():
    r = torch.tensor([[5.0, 1.0, 2.0, 3.0]])
    assert reward_to_go(r).tolist() == [[6.0, 5.0, 3.0]]
    assert prefix_sums(torch.tensor([[1.0, 2.0]])).tolist() == [[0.0, 1.0, 3.0]]


# ================================================================================= unbiasedness vs enumeration
@pytest.mark.parametrize("kind", ["min_max", "coding", "active"])
def test_estimators_unbiased_against_enumeration(kind):
    """(6.7), (6.10), (6.16): E[grad surrogate] = (grad_Q J, -grad_P J, grad_G J), J enumerated exactly."""
    lift = _lift()
    torch.manual_seed(1)
    _zero(lift)
    _exact_objective(kind, lift).backward()
    exact = _grads(lift)
    samples = _replicates(kind, lift, R=150, n=6)
    assert _max_z_score(samples["Q"], exact["Q"]) < 4.0
    if kind in ("min_max", "active"):
        assert _max_z_score(samples["P"], -exact["P"]) < 4.0
    if kind in ("coding", "active"):
        assert _max_z_score(samples["G"], exact["G"]) < 4.0


def test_wrong_estimator_without_reward_to_go_fails():
    """The same check rejects an estimator that credits token s with r_s only: its Q-gradient is biased."""
    lift = _lift()
    torch.manual_seed(1)
    _zero(lift)
    _exact_objective("coding", lift).backward()
    exact = _grads(lift)["Q"]
    good = _replicates("coding", lift, R=150, n=6)["Q"]
    bad = _replicates("coding", lift, R=150, n=6, wrong=True)["Q"]
    assert _max_z_score(good, exact) < 4.0
    assert _max_z_score(bad, exact) > 8.0


def test_elbo_classes_run_under_pyro_and_match_the_core():
    """ActiveLifting / MinimumLengthCoding / GeneratorLoss as pyro ELBOs: same surrogate as the tensor core on the
    same particles; SVI runs them; the (6.7) value at a fixed Q estimates the enumerated objective."""
    lift = _lift(separate=False)
    x = XS[0]
    model = lift.model
    for cls in (ActiveLifting, MinimumLengthCoding, GeneratorLoss):
        obj = cls(lift, num_particles=4)
        pyro.set_rng_seed(3)
        v1, s1 = obj.surrogate(model, lift.guide, x)
        pyro.set_rng_seed(3)
        z = obj.sample_latents(model, lift.guide, x)
        v2, s2 = active_terms(obj.kind, baseline=obj.baseline, **obj.terms(z, x))
        assert torch.allclose(v1, v2) and torch.allclose(s1, s2)
    pyro.clear_param_store()
    svi = pyro.infer.SVI(model, lift.guide, pyro.optim.Adam({"lr": 1e-3}), ActiveLifting(lift, num_particles=4))
    loss = svi.step(x)
    assert math.isfinite(loss)
    # the value is unbiased for the (6.7) objective of this x
    zs = _all_z(lift)
    with torch.no_grad():
        LQ = prefix_sums(lift.sampler_log_probs(zs, x))
        LP = prefix_sums(lift.prior_log_probs(zs))
        exact = float((LQ[:, -1].exp() * (LP - LQ).sum(-1)).sum())
        vals = torch.tensor([float(ActiveLifting(lift, num_particles=8).loss(model, lift.guide, x)) for _ in range(60)])
    assert abs(float(vals.mean()) - exact) < 4 * float(vals.std() / math.sqrt(len(vals)))


def test_conditional_sampler_loss_gradient_matches_enumeration():
    """(6.19): E_l E_{Z ~ D(Q)(.|x)}[-log Q(Z | x_<=l)], exact over l and z, against the Monte-Carlo gradient."""
    lift = _lift(separate=False)
    x = torch.tensor([VOCAB.id("a"), VOCAB.id("b"), VOCAB.id("<eos>")])
    zs = _all_z(lift)
    with torch.no_grad():
        w = lift.sampler_log_probs(zs, x).sum(-1).exp()
    lift.lm.zero_grad()
    exact_loss = sum(-(w * lift.sampler_log_probs(zs, x[:l]).sum(-1)).sum() for l in (1, 2)) / 2
    exact_loss.backward()
    exact = torch.cat([p.grad.flatten() for p in lift.lm.parameters()])
    obj = ConditionalSamplerLoss(lift, num_particles=6)
    torch.manual_seed(4)
    rows = []
    for _ in range(120):
        lift.lm.zero_grad()
        obj.differentiable_loss(None, None, x).backward()
        rows.append(torch.cat([p.grad.flatten() for p in lift.lm.parameters()]))
    assert _max_z_score(torch.stack(rows), exact) < 4.0


# ================================================================================= inference
def _exact_marginal(lift: ActiveLift, x, t: int, prefix_only: bool = False) -> float:
    zs = _all_z(lift)
    lp = prefix_sums(lift.prior_log_probs(zs))[:, t]
    lg = lift.generator_log_probs(x, zs)[:, t]
    # sum over z_<=t: every prefix appears 2^(T - t) times among the full sequences
    return float(torch.logsumexp(lp + lg, 0) - (lift.latent_len - t) * math.log(2))


@torch.no_grad()
def test_encoding_along_the_time_axis_is_unbiased():
    """(6.17) and (6.18) agree on the same particles, and p_{t,n} (not its log) is unbiased for every t."""
    lift = _lift()
    x = XS[2]
    torch.manual_seed(5)
    a = encode(lift, x, 8, incremental=True)
    torch.manual_seed(5)
    b = encode(lift, x, 8, incremental=False)
    assert torch.allclose(a, b, atol=1e-5)
    reps = torch.stack([encode(lift, x, 4) for _ in range(300)])  # [R, T+1]
    for t in range(T + 1):
        p = reps[:, t].exp()
        exact = math.exp(_exact_marginal(lift, x, t))
        assert abs(float(p.mean()) - exact) < 4 * float(p.std() / math.sqrt(len(p))) + 1e-7
    # the WRONG literal reading of (6.18), (1/n) logsumexp, is far from log P_model(x)
    wrong = torch.logsumexp(reps[:, -1] + math.log(4), 0) / 4
    assert abs(float(wrong) - _exact_marginal(lift, x, T)) > 0.5


@torch.no_grad()
def test_conditional_encoding_consistent():
    """(6.22): numerator and denominator are unbiased, so the ratio converges to P_model(x_q x_r | [x_q])."""
    lift = _lift()
    x_q = torch.tensor([VOCAB.id("a")])
    x_r = torch.tensor([VOCAB.id("b"), VOCAB.id("<eos>")])
    full = torch.cat([x_q, x_r])
    exact = _exact_marginal(lift, full, T) - _exact_marginal(lift, x_q, T)
    torch.manual_seed(6)
    est = torch.stack([conditional_encode(lift, x_q, x_r, 256) for _ in range(20)])
    assert abs(float(est.mean()) - exact) < 4 * float(est.std() / math.sqrt(len(est))) + 0.02


@torch.no_grad()
def test_conditional_decoding_laws():
    """(6.20) has the law sum_z Q(z|x) G(x'|z, x); (6.21) with many particles approaches P_model(. | [x])."""
    lift = _lift(max_x_len=2)
    x = torch.tensor([VOCAB.id("a")])
    zs = _all_z(lift)
    conts = VOCAB.observable_ids.tolist()  # X = a x', x' one token of Sigma (max_x_len = 2)
    full = torch.tensor([[x[0], c] for c in conts])
    lq = lift.sampler_log_probs(zs, x).sum(-1)
    lp = lift.prior_log_probs(zs).sum(-1)
    lg_x = lift.generator_log_probs(x, zs)[:, -1]  # log G([x] | z)
    lg_full = torch.stack([lift.generator_log_probs(f, zs)[:, -1] for f in full], 1)  # [M, 3]
    direct = (lq[:, None] + lg_full - lg_x[:, None]).logsumexp(0).exp()  # law of (6.20)
    target = (lp[:, None] + lg_full).logsumexp(0)
    target = (target - target.logsumexp(0)).exp()  # P_model(. | [x])
    torch.manual_seed(7)
    m = 3000
    for resample, n, law in ((False, 1, direct), (True, 64, target)):
        out = conditional_decode(lift, x, num_samples=m, num_particles=n, resample=resample)
        counts = torch.tensor([(out[:, 1] == c).sum() for c in conts], dtype=torch.float64)
        assert int(counts.sum()) == m and (out[:, 0] == x[0]).all()
        chi2 = float(((counts - m * law) ** 2 / (m * law)).sum())
        assert chi2 < 20.5  # chi-square(5) at 0.999
        uniform = torch.full_like(law, 1 / len(law))  # the check can fail: a wrong law is rejected
        assert float(((counts - m * uniform) ** 2 / (m * uniform)).sum()) > 100


# ================================================================================= the coding experiment (6.3)
def test_huffman_and_code_objective():
    from ppl_thought.experiments.active_coding import code_objective, huffman_code, is_prefix_free

    p = np.array([0.5, 0.25, 0.25])
    assert sorted(huffman_code(p), key=len) == ["0", "10", "11"] or sorted(len(c) for c in huffman_code(p)) == [1, 2, 2]
    assert code_objective(p, ["0", "10", "11"]) == pytest.approx(2.0)  # 1.5 (t=0) + 0.5 (t=1) + 0
    rng = np.random.default_rng(0)
    for N in (5, 8, 13):
        p = rng.uniform(size=N)
        p /= p.sum()
        codes = huffman_code(p)
        assert is_prefix_free(codes) and len(set(codes)) == N
        H = float(-(p * np.log2(p)).sum())
        L = float(np.dot(p, [len(c) for c in codes]))
        assert H <= L < H + 1
        # Huffman is optimal: no code from the Kraft-tight length sets found by brute force is shorter
        best = min(float(np.dot(p, lens)) for lens in itertools.product(range(1, N), repeat=N)
                   if abs(sum(2.0 ** -np.array(lens)) - 1) < 1e-12) if N <= 5 else L
        assert L <= best + 1e-12
    assert not is_prefix_free(["0", "01"])


def test_example_quick_runs(tmp_path):
    """``examples/active_lifting.py --smoke --json FILE --plot FILE``: keys and sanity (N = 8)."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "active_lifting.py"
    spec = importlib.util.spec_from_file_location("active_lifting_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out, png = tmp_path / "coding.json", tmp_path / "coding.png"
    assert mod.main(["--smoke", "--json", str(out), "--plot", str(png)]) == 0
    res = json.loads(out.read_text())
    assert set(res["coding"]) == {"8"}
    r = res["coding"]["8"]
    for k in ("learned_objective", "huffman_objective", "learned_length", "huffman_length", "entropy",
              "h_x_given_z", "prefix_free", "q_max_mass"):
        assert k in r
    assert isinstance(r["prefix_free"], bool)
    assert r["entropy"] <= r["huffman_length"] < r["entropy"] + 1
    # (6.10) can never beat the information bound, and H(X | Z_<=t) starts at H(P_*) and never grows
    assert r["learned_objective"] >= r["objective_lower_bound"] - 1e-6
    ce = r["conditional_entropies_bits"]
    assert ce[0] == pytest.approx(r["entropy"], abs=1e-5)
    assert all(b <= a + 1e-6 for a, b in zip(ce, ce[1:]))
    assert 0 <= r["h_x_given_z"] <= ce[0] * math.log(2) + 1e-6
    assert set(r["remedies"]) == {"learned", "exact+anneal"} and 0 <= r["restarts_within_5pct"] <= 1
    assert png.stat().st_size > 0


def test_active_lift_refuses_a_model_it_cannot_act_on():
    """ActiveLift on a model without the site ``site`` ran the model untouched (no Z, no G); on a site that is not a
    token sequence it replaced it by G. Both are now an ActiveLiftError (a TransformError) naming the site."""
    lift = _lift(separate=False)
    x = XS[0]

    def other_site(x):
        return pyro.sample("y", pt.dist.LMSequence(lift.lm, max_len=3), obs=x)

    def normal_site(x):
        return pyro.sample("x", pyro.distributions.Normal(0.0, 1.0))

    with pytest.raises(ActiveLiftError, match=r"site 'x'.*sequence sites: 'y'"):
        pyro.poutine.trace(lift(other_site)).get_trace(x)
    with pytest.raises(ActiveLiftError, match=r"site 'x': it is a Normal"):
        pyro.poutine.trace(lift(normal_site)).get_trace(x)
    assert issubclass(ActiveLiftError, pt.errors.TransformError)
    ok = ActiveLift(lift.lm, VOCAB, T, OMEGA, max_x_len=3, site="y")(other_site)
    tr = pyro.poutine.trace(ok).get_trace(x)
    assert {"z", "y"} <= set(tr.nodes)
