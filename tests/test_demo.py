"""The demo (Section 7 and A5): task likelihoods against brute force, the batched losses against the
library objectives, the SMC estimate against enumeration, and a tiny end-to-end run."""

import itertools
import json
import math
import os

import numpy as np
import pytest
import torch

from ppl_thought.data.a5 import a5_hmm
from ppl_thought.data.query_response import permutation_choice_task
from ppl_thought.demo import run_demo
from ppl_thought.errors import MalformedSequenceError
from ppl_thought.experiments.a5 import A5Config, A5Latent
from ppl_thought.experiments.sec7 import Sec7Config, causal_gaps, latent_surrogate, sampler_surrogate
from ppl_thought.training.objectives import OneSampler, Particles, SamplerPolicyGradient


def _brute_p(task, q, r):
    """p(r | q) by running every method: (1/C) sum_c [r == (sigma_c(q_1..q_k), M<c>)]."""
    hits = 0
    for c in range(task.num_choices):
        resp = tuple(int(task.perms[c][a]) for a in q) + (task.m + c,)
        hits += resp == tuple(r)
    return hits / task.num_choices


def _responses(task):
    return [body + (name,) for body in itertools.product(range(task.m), repeat=task.query_len)
            for name in range(task.m, task.m + task.num_choices)]


def test_permutation_task_exact_log_prob_matches_brute_force():
    task = permutation_choice_task(m=3, query_len=3, num_choices=4, seed=1)
    rs = _responses(task)
    for q in itertools.product(range(3), repeat=3):
        qt = torch.tensor([q] * len(rs))
        lp = task.exact_log_prob(qt, torch.tensor(rs))
        brute = torch.tensor([_brute_p(task, q, r) for r in rs], dtype=torch.float64)
        assert torch.allclose(lp.exp(), brute)
        assert math.isclose(float(lp.exp().sum()), 1.0, rel_tol=1e-12)
        assert not torch.isnan(lp).any() and torch.isneginf(lp[brute == 0]).all()


def test_permutation_task_entropy_and_samples():
    task = permutation_choice_task(m=3, query_len=3, num_choices=4, seed=1)
    h = 0.0
    for q in itertools.product(range(3), repeat=3):
        for r in _responses(task):
            p = _brute_p(task, q, r)
            if p > 0:
                h -= p * math.log(p)
    assert math.isclose(task.conditional_entropy(), h / 27, rel_tol=1e-10)
    assert math.isclose(task.conditional_entropy(), math.log(4), rel_tol=1e-10)  # the name identifies c
    q, c, r = task.sample(200, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(task.exact_log_prob(q, r)).all()
    post = task.posterior_choices(q, r)
    assert torch.allclose(post.sum(-1), torch.ones(200, dtype=torch.float64))
    assert (post[torch.arange(200), c] > 0).all()  # the true choice is always in the sharp posterior
    with pytest.raises(MalformedSequenceError):
        task.exact_log_prob(q[:, :2], r[:, :2])


def test_default_sec7_task_exact_likelihood_matches_brute_force():
    """The task of the default demo (Sec7Config: m=4, k=2, C=8): (D.2) and H(R | Q) = log C by brute force."""
    cfg = Sec7Config()
    task = permutation_choice_task(cfg.m, cfg.query_len, cfg.num_choices, seed=0)
    rs = _responses(task)
    h = 0.0
    for q in itertools.product(range(task.m), repeat=task.query_len):
        lp = task.exact_log_prob(torch.tensor([q] * len(rs)), torch.tensor(rs))
        brute = torch.tensor([_brute_p(task, q, r) for r in rs], dtype=torch.float64)
        assert torch.allclose(lp.exp(), brute) and math.isclose(float(brute.sum()), 1.0, rel_tol=1e-12)
        h -= float((brute[brute > 0] * brute[brute > 0].log()).sum())
    n_q = task.m ** task.query_len
    assert math.isclose(task.conditional_entropy(), h / n_q, rel_tol=1e-10)
    assert math.isclose(task.entropy_floor_per_token(), math.log(cfg.num_choices) / (cfg.query_len + 2), rel_tol=1e-10)
    # the query does not determine the choice (broad prior), query + response do (sharp posterior)
    q, c, r = task.sample(64, generator=torch.Generator().manual_seed(1))
    post = task.posterior_choices(q, r)
    assert torch.equal(post.argmax(-1), c) and torch.allclose(post.max(-1).values, torch.ones(64, dtype=torch.float64))


def test_a5_exact_log_prob_matches_brute_force_over_hidden_paths():
    task = a5_hmm(0.5)
    x = task.sample(4, 3, generator=torch.Generator().manual_seed(2))
    hmm = task.hmm
    A, B, lam = hmm.A, hmm.B, hmm.lam
    for row in x:
        tot = 0.0
        for path in itertools.product(range(15), repeat=3):
            p = float(lam[path[0]] * B[path[0], row[0]])
            for t in (1, 2):
                p *= float(A[path[t - 1], path[t]] * B[path[t], row[t]])
            tot += p
        assert math.isclose(float(hmm.log_prob(row)), math.log(tot), rel_tol=1e-9)


def test_batched_losses_match_library_objectives():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 8, generator=g, requires_grad=True)
    lq = torch.randn(3, 8, generator=g, requires_grad=True)
    s1 = latent_surrogate(lp, lq).sum() + sampler_surrogate(lp, lq).sum()
    s1.backward()
    g1 = (lp.grad.clone(), lq.grad.clone())
    lp.grad, lq.grad = None, None
    s2 = 0.0
    for b in range(3):
        s2 = s2 + OneSampler(8).from_particles(Particles(lp[b], lq[b].detach(), {}))[1]
        s2 = s2 + SamplerPolicyGradient(8).from_particles(Particles(lp[b].detach(), lq[b], {}))[1]
    s2.backward()
    assert torch.allclose(g1[0], lp.grad, atol=1e-6) and torch.allclose(g1[1], lq.grad, atol=1e-6)
    gap = causal_gaps(lp.detach() - 1.0, lp.detach(), lq.detach())
    assert gap.shape == (3,) and torch.isfinite(gap).all()
    # impossible particles (log P = -inf) get weight 0, never NaN
    lp2 = torch.tensor([[0.0, float("-inf")]], requires_grad=True)
    v = latent_surrogate(lp2, torch.zeros(1, 2))
    v.sum().backward()
    assert torch.isfinite(v).all() and not torch.isnan(lp2.grad).any()


def test_a5_latent_smc_is_unbiased_against_enumeration():
    cfg = A5Config(hidden=2, d_model=16, n_layers=1, n_heads=2, particles=8, train_len=3, test_len=3)
    lat = A5Latent(cfg, seed=0)
    task = a5_hmm(0.5)
    x = task.sample(1, 3, generator=torch.Generator().manual_seed(3))
    # exact log (Proj # P_f)(x) (2.22): enumerate the lifting G^T
    pairs = lat.pairs[x[0]]  # [T, G]
    zs = torch.tensor([[int(pairs[t, g]) for t, g in enumerate(gs)] for gs in itertools.product(range(2), repeat=3)])
    z = torch.cat([torch.full((len(zs), 1), lat.vocab.bos_id), zs], 1)
    with torch.no_grad():
        logits, _ = lat.lm(z[:, :-1])
        lp = logits.masked_fill(~lat.domain, float("-inf")).log_softmax(-1).gather(-1, z[:, 1:, None]).sum((1, 2))
    exact = float(torch.logsumexp(lp, 0))
    g = torch.Generator().manual_seed(0)
    reps = torch.cat([lat.smc(x.repeat(50, 1), 8, generator=g)[2] for _ in range(4)])
    est = float(torch.logsumexp(reps, 0) - math.log(len(reps)))
    assert abs(est - exact) < 0.05


def test_a5_latent_smc_is_grouped_library_smc_over_a5_program():
    """A5Latent.smc is pt.infer.SMC(groups=S) over A5Program: paths in the lifting of each row, one
    independent group per row (log Z-hat = log mean of the row's final weights), ancestors in their row."""
    import ppl_thought as pt
    from ppl_thought.experiments.a5 import A5Program

    cfg = A5Config(hidden=3, d_model=16, n_layers=1, n_heads=2, particles=4, train_len=6, test_len=6)
    lat = A5Latent(cfg, seed=0)
    x = a5_hmm(0.5).sample(3, 6, generator=torch.Generator().manual_seed(4))
    paths, logw, logz = lat.smc(x, 4, ess_threshold=1.0, generator=torch.Generator().manual_seed(0))
    assert paths.shape == (3, 4, 6) and logw.shape == (3, 4) and logz.shape == (3,)
    assert (paths[..., None] == lat.pairs[x][:, None]).any(-1).all()  # z_t in the lifting of x_t
    assert torch.allclose(torch.logsumexp(logw, 1) - math.log(4), logz, atol=1e-5)
    torch.manual_seed(1)
    res = pt.infer.SMC(4, ess_threshold=1.0, resampling="multinomial", groups=3).run(A5Program(lat), None, x)
    assert any(any(r) for r in res.stats["resampled"])
    assert torch.equal(res.ancestry // 4, (torch.arange(12) // 4).expand(6, 12))
    one = lat.smc(x[:1], 4)  # S = 1: the plain engine, same shapes
    assert one[0].shape == (1, 4, 6) and one[1].shape == (1, 4) and one[2].shape == (1,)


def test_a5_latent_is_the_library_model_and_its_smc_agrees_with_pt_infer_smc():
    """The demo's SMC (grouped pt.infer.SMC over A5Program, bootstrap, fully adapted) estimates the same
    (2.22) as SlowThinking(P_f, Product) with the causal guide (3.33): the same exact log-likelihood,
    the same estimate."""
    import ppl_thought as pt
    from ppl_thought.data.a5 import OBSERVABLE_TOKENS

    cfg = A5Config(hidden=2, d_model=16, n_layers=1, n_heads=2, particles=8, train_len=3, test_len=3)
    lat = A5Latent(cfg, seed=0)
    lat.lm.eval()
    x = a5_hmm(0.5).sample(1, 3, generator=torch.Generator().manual_seed(3))
    model = pt.models.SlowThinking(lat.lm, lat.projection)
    x_text = " ".join(OBSERVABLE_TOKENS[int(i)] for i in x[0])
    exact = float(model.exact_log_prob(x_text))
    g = torch.Generator().manual_seed(0)
    demo = torch.cat([lat.smc(x.repeat(50, 1), 8, generator=g)[2] for _ in range(2)])
    torch.manual_seed(0)
    lib = torch.stack([pt.infer.SMC(8).run(model, pt.guides.Causal(lat.lm, lat.projection), x_text).log_marginal
                       for _ in range(60)])
    for reps in (demo, lib):
        assert abs(float(torch.logsumexp(reps, 0) - math.log(len(reps))) - exact) < 0.05


def test_tiny_end_to_end_demo_writes_json(tmp_path):
    c7 = Sec7Config(m=3, query_len=3, num_choices=3, n=4, steps=4, batch=4, d_model=16, n_layers=1, n_heads=2,
                    num_test=16, eval_every=2, num_eval_curve=8, pretrain_steps=2, seeds=2)
    ca5 = A5Config(train_len=4, test_len=8, steps=2, batch=2, particles=4, hidden=2, d_model=16, n_layers=1,
                   n_heads=2, num_test=4, eval_every=1)
    with pytest.warns(RuntimeWarning, match="pretraining target"):  # 2 pretraining steps are not enough
        res = run_demo(out=str(tmp_path), quick=True, seed=0, n=4, sec7_config=c7, a5_config=ca5, progress=False,
                       parts=("sec7", "a5"))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["commit"]) == 40 and "dirty" in saved and saved["seconds"] > 0  # where the numbers come from
    for key in ("L_fast", "L_pred", "L_expl", "L_fast_se", "L_pred_se", "L_expl_se", "relative_improvement",
                "causal_gap", "causal_gap_curve", "test_loss_curve"):
        assert key in saved["sec7"], key
    for key in ("plain_excess_nats", "latent_excess_nats", "exact_cross_entropy_nats"):
        assert key in saved["a5"] and np.isfinite(saved["a5"][key]), key
    assert np.isfinite(res["sec7"]["L_expl"])
    # two replicates, averaged: the pooled losses are the means of the per-seed ones
    per = saved["sec7"]["per_seed"]
    assert saved["sec7"]["seeds"] == [0, 1] and len(per) == 2 and len(saved["sec7"]["criterion_per_seed"]) == 2
    for m in ("fast", "pred", "expl"):
        assert math.isclose(saved["sec7"][f"L_{m}"], np.mean([p[f"L_{m}"] for p in per]), rel_tol=1e-9)
    assert per[0]["base_model"]["steps"] == 2 and per[0]["L_fast"] != per[1]["L_fast"]
    assert len(saved["sec7"]["test_loss_curve"]["expl"]) == 2  # steps 2 and 4
    assert (tmp_path / "sec7_fig7_1.png").exists() and (tmp_path / "a5_excess.png").exists()
    ncs = sorted(f for f in res["files"] if f.endswith(".nc"))
    assert [os.path.basename(f) for f in ncs] == ["a5_excess.nc", "sec7_expl_particles.nc", "sec7_pred_particles.nc"]
    from ppl_thought.diagnostics import diagnose

    for f in ncs:  # `ppl-thought diagnose` reads every file the demo writes, as one of ours
        text, plots = diagnose(f, out=tmp_path / "diag")
        assert "note:" not in text and plots and all(p.is_file() for p in plots), f
    check_demo_files(ncs, num_test=16, n=4)
    from ppl_thought.arviz_compat import group_dataset
    from ppl_thought.diagnostics.inference_data import load_inference_data

    parts = group_dataset(load_inference_data(ncs[1]), "particles")  # two seeds: a dimension of their own
    assert parts["log_weight"].dims == ("chain", "draw", "seed", "example") and parts.sizes["seed"] == 2
    with pytest.raises(ValueError):
        run_demo(out=str(tmp_path), n=1)
    with pytest.raises(ValueError, match="seeds"):
        run_demo(out=str(tmp_path), seeds=0)


def check_demo_files(paths, num_test: int | None = None, n: int | None = None) -> None:
    """Every ArviZ file of the demo: ``az.summary`` reads it, ``chain`` and ``draw`` lead every variable of its
    ``posterior`` (one chain; per-example results a dimension of their own, never "chain"), weighted particles are
    a ``particles`` group with their ``log_weight``, and a thought is text or a number with a meaning."""
    from ppl_thought.arviz_compat import group_dataset, group_names, import_arviz
    from ppl_thought.diagnostics.inference_data import load_inference_data

    az = import_arviz()
    for f in paths:
        idata = load_inference_data(f)
        post = group_dataset(idata, "posterior")
        for name, v in post.data_vars.items():
            assert v.dims[:2] == ("chain", "draw") and v.sizes["chain"] == 1, (f, name, v.dims)
            assert np.isfinite(np.asarray(v)).all(), (f, name)
        summary = az.summary(idata, kind="stats")
        assert len(summary) > 0 and np.isfinite(summary["mean"].to_numpy()).all(), f
        assert group_dataset(idata, "posterior").attrs["inference_library"] == "ppl_thought"
        if "particles" in os.path.basename(f) or "real_thoughts" in os.path.basename(f):
            unit = "example" if "sec7" in os.path.basename(f) else "problem"
            parts = group_dataset(idata, "particles")
            assert parts["log_weight"].dims[:2] == ("chain", "draw") and parts["log_weight"].dims[-1] == unit, f
            if num_test is not None and unit == "example":
                assert parts.sizes[unit] == num_test and parts.sizes["draw"] == n
            assert "particles_text" in group_names(idata) and "posterior_text" in group_names(idata)
            text = np.asarray(group_dataset(idata, "particles_text")["thought"])
            assert text.dtype.kind in "UO" and text.shape == parts["log_weight"].shape
            if unit == "example":  # 0/1: does the thought name the example's hidden method
                assert set(np.unique(np.asarray(post["thought_names_method"]))) <= {0.0, 1.0}
                loss = group_dataset(idata, "observed_data")["test_loss_per_token"]
                assert loss.dims[-1] == "example" and "chain" not in loss.dims


def test_demo_arviz_writers_on_tiny_inputs(tmp_path):
    """The writer of the real-model part's files (the part itself needs SmolLM2), on hand-made particles: the
    resample follows the weights (a particle of weight 0 is never drawn)."""
    from ppl_thought.demo import _arviz

    rng = np.random.default_rng(0)
    lw = rng.normal(size=(3, 5))
    lw[:, 0] = -np.inf  # impossible particles
    real = {m: {"log_weights": lw, "thought_length": np.arange(15).reshape(3, 5) % 4,
                "thought_text": np.array([[f"t{i}{j}" for j in range(5)] for i in range(3)]),
                "log_z": np.array([-1.0, -2.0, -3.0])} for m in ("predictive", "explanatory")}
    paths = _arviz({}, {"real": real}, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["real_thoughts_explanatory.nc",
                                                          "real_thoughts_predictive.nc"]
    check_demo_files(paths)
    from ppl_thought.arviz_compat import group_dataset
    from ppl_thought.diagnostics.inference_data import load_inference_data

    idata = load_inference_data(paths[0])
    drawn = np.asarray(group_dataset(idata, "posterior_text")["thought"])[0]  # [draw, problem]
    assert not any(f"t{i}0" in drawn[:, i] for i in range(3))
    assert set(np.asarray(group_dataset(idata, "posterior")["thought_length"]).ravel()) <= {0, 1, 2, 3}


def test_sec7_formats_follow_query_response_projection():
    from ppl_thought.experiments.sec7 import Sec7

    cfg = Sec7Config(m=3, query_len=3, num_choices=3, d_model=16, n_layers=1, n_heads=2)
    task = permutation_choice_task(m=3, query_len=3, num_choices=3)
    exp = Sec7(task, cfg, seed=0)
    q, c, r = task.sample(4, generator=torch.Generator().manual_seed(0))
    y = task.letter_ids(task.m + c)[:, None]
    z, x = exp._latent(q, y, r), exp._obs(q, r)
    for zi, xi in zip(z, x):  # Proj deletes the thought <s> y </s> (Section 5.1); <bos> is context only
        assert exp.projection.project(zi[1:].numpy()).tolist() == xi[1:].tolist()


def test_cosine_lr_follows_app_l_schedule():
    from ppl_thought.training import cosine_lr

    lrs = [cosine_lr(1.0, s, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.2) and lrs[4] == pytest.approx(1.0)  # 5 warm-up steps: 0.2 .. 1.0
    assert lrs[-1] == pytest.approx(0.1)  # decays to 10% of the peak at the last step
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # monotone after the warm-up
    assert cosine_lr(2.0, 52, 100) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5), rel=0.03)  # half-way
    with pytest.raises(ValueError):
        cosine_lr(1.0, 100, 100)


def test_sec7_base_model_stops_early_at_its_target():
    from ppl_thought.experiments.sec7 import Sec7

    task = permutation_choice_task(m=3, query_len=2, num_choices=2)
    cfg = Sec7Config(m=3, query_len=2, num_choices=2, d_model=16, n_layers=1, n_heads=2, pretrain_steps=400,
                     pretrain_target=100.0)
    exp = Sec7(task, cfg, seed=0)
    base = exp.base()
    assert exp.base_info["steps"] == 250 and exp.base_info["response_loss_given_method"] < 100.0
    assert exp.base() is base  # built once, shared by every method
    cfg.pretrain_target = 0.0  # unreachable: runs to the maximum and says so
    exp2 = Sec7(task, cfg, seed=0)
    with pytest.warns(RuntimeWarning, match="did not reach its pretraining target"):
        exp2.base()
    assert exp2.base_info["steps"] == 400 and not exp2.base_info["reached_target"]


def test_sec7_gating_trick_starts_as_fast_thinking_and_mixes_logits():
    """(L.1)/(L.2): a fresh gate gives p_slow = sigmoid(-4) exactly, and the response logits are
    p_fast * f(x x_r) + p_slow * f(x <s> y </s> x_r); without a gate P reads the latent format only."""
    from ppl_thought.distributions.lm_state import masked_log_softmax as _masked_log_softmax
    from ppl_thought.experiments.sec7 import Sec7
    from ppl_thought.lm.gated import gate_mlp

    task = permutation_choice_task(m=3, query_len=2, num_choices=3)
    cfg = Sec7Config(m=3, query_len=2, num_choices=3, d_model=16, n_layers=1, n_heads=2, pretrain_steps=0)
    exp = Sec7(task, cfg, seed=0)
    P = exp._lm()
    q, c, r = task.sample(5, generator=torch.Generator().manual_seed(0))
    y = task.letter_ids(task.m + c)[:, None]
    k = task.query_len
    with torch.no_grad():
        _, lp_r_plain = exp.log_p_parts(P, q, y, r)
        P.gate = gate_mlp(cfg.d_model)
        lp_y, lp_r = exp.log_p_parts(P, q, y, r)
        slow, _ = P(exp._latent(q, y, r)[:, :-1])
        fast, _ = P(exp._obs(q, r)[:, :-1])
    p_slow = torch.sigmoid(torch.tensor(-4.0))
    mixed = (1 - p_slow) * fast[:, k + 1:] + p_slow * slow[:, k + 4:]
    target = exp._obs(q, r)[:, k + 2:]
    want = _masked_log_softmax(mixed, exp.sigma).gather(-1, target[..., None]).squeeze(-1).sum(-1)
    assert torch.allclose(lp_r, want, atol=1e-5) and not torch.allclose(lp_r, lp_r_plain)
    assert torch.isfinite(lp_y).all() and sum(p.numel() for p in P.gate.parameters()) > 0


@pytest.mark.parametrize("name", ["sec7", "a5", "verifiers"])
def test_each_experiment_has_its_own_command_line(name, capsys):
    """``python -m ppl_thought.experiments.<name> --help`` works (the experiments run without the demo)."""
    import importlib

    mod = importlib.import_module(f"ppl_thought.experiments.{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out
