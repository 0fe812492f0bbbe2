"""Latent Thought Models (latent-thought-models.txt, Sec 2.1-2.2, Algorithm 1, Eq. 4 and 5)."""

from __future__ import annotations

import math
from pathlib import Path

import pyro
import pytest
import torch

from ppl_thought.errors import MalformedSequenceError
from ppl_thought.guides import LocalGaussianGuide
from ppl_thought.models import LatentThought
from ppl_thought.training import DualRateTrainer, langevin_evaluate, langevin_posterior


def _ltm(seed: int = 0, **kw) -> LatentThought:
    torch.manual_seed(seed)
    args = dict(vocab_size=6, d_model=16, n_layers=2, n_heads=2, n_z=2, window=2, d_latent=4, max_len=16)
    args.update(kw)
    return LatentThought(**args)


def _sharpen(ltm: LatentThought, factor: float) -> None:
    """Make the decoder depend strongly on z (a random init gives near-uniform logits that ignore z)."""
    with torch.no_grad():
        ltm.decoder.embed.weight.mul_(50.0)  # tied LM head: logits of order 1, not 0.02
        for block in ltm.decoder.blocks:
            block.cross.kv.weight.mul_(factor)
            block.cross.out.weight.mul_(factor)


def test_log_likelihood_matches_incremental_decoding():
    ltm = _ltm()
    x = torch.randint(0, 6, (3, 7))
    z = torch.randn(4, 3, *ltm.latent_shape)  # 4 samples of z per sequence
    ll = ltm.log_likelihood(x, z).detach()
    assert ll.shape == (4, 3)
    for s in range(4):
        for b in range(3):
            cache, tok, total = None, torch.tensor([ltm.bos_id]), 0.0
            for n in range(7):
                logits, cache = ltm.decoder.step(tok, cache, latents=z[s, b:b + 1])
                total += torch.log_softmax(logits[0, :6], -1)[x[b, n]].item()
                tok = x[b, n:n + 1]
            assert ll[s, b].item() == pytest.approx(total, abs=1e-4)
    # one sequence, z without the batch dimension
    assert torch.allclose(ltm.log_likelihood(x[1], z[:, 1]), ll[:, 1], atol=1e-5)


def test_padding_mask_and_errors():
    ltm = _ltm(pad_id=0)
    x = torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]])
    z = torch.randn(2, *ltm.latent_shape)
    lp = ltm.token_log_probs(x, z)
    assert (lp[0, 3:] == 0).all() and (lp[1] < 0).all()
    assert ltm.log_likelihood(x[:1, :3], z[:1]).item() == pytest.approx(ltm.log_likelihood(x, z)[0].item(), abs=1e-5)
    with pytest.raises(MalformedSequenceError):
        ltm.log_likelihood(x, torch.randn(2, 3, 3))
    with pytest.raises(MalformedSequenceError):
        ltm.log_likelihood(torch.tensor([[7, 1]]), torch.randn(1, *ltm.latent_shape))
    with pytest.raises(ValueError):
        _ltm(n_z=0)


def test_pyro_model_sites_and_trace_elbo_agree():
    ltm = _ltm()
    x = torch.randint(0, 6, (3, 5))
    tr = pyro.poutine.trace(ltm.model).get_trace(x)
    assert tr.nodes["z"]["value"].shape == (3, *ltm.latent_shape)
    assert tr.nodes["x"]["is_observed"]
    assert "ltm_decoder$$$embed.weight" in pyro.get_param_store().keys()
    tr.compute_log_prob()
    z = tr.nodes["z"]["value"]
    assert torch.allclose(tr.nodes["x"]["log_prob"], ltm.log_likelihood(x, z), atol=1e-5)
    guide = ltm.fit_local(x, num_steps=3)
    torch.manual_seed(1)
    elbo_pyro = -pyro.infer.Trace_ELBO(num_particles=400, vectorize_particles=True,
                                       ).loss(ltm.model, guide, x)
    ours = ltm.elbo(x, guide, num_samples=400, detach_guide=True).sum().item()
    assert elbo_pyro == pytest.approx(ours, abs=0.5)
    pyro.clear_param_store()


def test_inner_loop_does_not_touch_decoder():
    ltm = _ltm()
    x = torch.randint(0, 6, (4, 6))
    before = {k: v.detach().clone() for k, v in ltm.decoder.state_dict().items()}
    guide = ltm.fit_local(x, num_steps=5, lr=0.3)
    for k, v in ltm.decoder.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p in ltm.decoder.parameters():
        assert p.grad is None and p.requires_grad
    assert not torch.equal(guide.loc, torch.zeros_like(guide.loc))  # the local parameters did move
    # the slow step (Algorithm 1, line 15) does change the decoder
    trainer = DualRateTrainer(ltm, total_steps=1, inner_steps=2, slow_lr=1e-2, progress=False)
    m = trainer.step(x)
    assert math.isfinite(m["loss"]) and m["fast_lr"] == pytest.approx(0.3)
    assert any(not torch.equal(v, before[k]) for k, v in ltm.decoder.state_dict().items())


def _grid_log_marginal(ltm: LatentThought, x: torch.Tensor) -> float:
    """log p(x) = log int N(z; 0, 1) p(x | z) dz for a 1-D z, by the trapezoid rule on [-10, 10]."""
    grid = torch.linspace(-10, 10, 4001)
    z = grid.view(-1, 1, 1, 1, 1)
    with torch.no_grad():
        f = ltm.log_likelihood(x, z)[:, 0] + torch.distributions.Normal(0, 1).log_prob(grid)
    dz = (grid[1] - grid[0]).item()
    w = torch.full_like(grid, math.log(dz))
    w[0] = w[-1] = math.log(dz / 2)
    return torch.logsumexp(f + w, 0).item()


def test_elbo_and_iw_bound_lower_bound_exact_log_marginal():
    ltm = _ltm(n_layers=1, n_z=1, d_latent=1)
    _sharpen(ltm, 8.0)
    torch.manual_seed(3)
    x = torch.randint(0, 6, (1, 8))
    exact = _grid_log_marginal(ltm, x)
    guide = ltm.fit_local(x, num_steps=30, lr=0.1)
    elbo = ltm.elbo(x, guide, num_samples=4000, detach_guide=True).item()
    iw = ltm.iw_bound(x, guide.distribution(detach=True), 4000).item()
    assert elbo <= exact + 0.02
    assert elbo <= iw + 0.02
    assert iw == pytest.approx(exact, abs=0.05)
    # the prior as proposal: IW with many samples still converges to the same integral
    prior = LocalGaussianGuide.init(1, ltm.latent_shape).distribution(detach=True)
    assert ltm.iw_bound(x, prior, 20000).item() == pytest.approx(exact, abs=0.1)
    # the engine agrees with the model's bound (Importance with the fitted guide)
    try:
        from ppl_thought.inference.importance import Importance
    except ImportError:  # pragma: no cover - engine being written elsewhere
        return
    res = Importance(4000).run(ltm.model, guide, x)
    assert float(res.log_marginal) == pytest.approx(exact, abs=0.05)
    pyro.clear_param_store()


def test_elbo_improves_with_inner_steps():
    ltm = _ltm()
    _sharpen(ltm, 30.0)
    torch.manual_seed(5)
    x = torch.randint(0, 6, (8, 10))
    elbos = {}
    for T in (0, 2, 8, 16):
        torch.manual_seed(7)
        guide = ltm.fit_local(x, num_steps=T, lr=0.3)
        elbos[T] = ltm.elbo(x, guide, num_samples=256, detach_guide=True).sum().item()
    assert elbos[2] > elbos[0] and elbos[8] > elbos[2] and elbos[16] > elbos[0] + 1.0, elbos


def _scalar_latent_ltm() -> tuple[LatentThought, torch.Tensor, float, float]:
    """An LTM with one scalar latent (one layer, N_z = 1, d = 1) whose decoder depends strongly on z, a sequence,
    and the exact posterior mean and sd of z by quadrature: p(z | x) proportional to N(z; 0, 1) p(x | z) on a grid
    of 2401 points over [-6, 6] (the prior's mass outside is 2e-9)."""
    ltm = _ltm(1, vocab_size=4, d_model=8, n_layers=1, n_heads=2, n_z=1, d_latent=1)
    with torch.no_grad():
        ltm.decoder.embed.weight.mul_(30.0)
        for block in ltm.decoder.blocks:
            block.cross.kv.weight.mul_(300.0)
    x = torch.tensor([0, 1, 1, 2, 3, 1, 0, 2])
    grid = torch.linspace(-6, 6, 2401)
    with torch.no_grad():
        log_lik = ltm.log_likelihood(x, grid.reshape(-1, 1, 1, 1))
        log_post = log_lik + torch.distributions.Normal(0.0, 1.0).log_prob(grid)
    w = torch.softmax(log_post.double(), 0)
    mean = float((w * grid).sum())
    return ltm, x, mean, float((w * (grid - mean) ** 2).sum().sqrt())


def test_langevin_posterior_matches_quadrature_on_a_scalar_latent():
    """Eq. 4 with the Metropolis correction (MALA) samples p(z | x) of an LTM: on a scalar latent the draws' mean and
    sd agree with quadrature (exact mean 1.45, sd 0.77: far from the prior's 0 and 1, which the bounds reject). Seeds
    0-2 gave mean 1.450 / 1.458 / 1.463 and sd 0.776 / 0.761 / 0.799 at 600 steps; the bounds are 0.2 and 0.15."""
    ltm, x, mean, sd = _scalar_latent_ltm()
    assert abs(mean - 1.454) < 0.01 and abs(sd - 0.774) < 0.01  # the quadrature itself (pins the fixture)
    res = langevin_posterior(ltm, x, num_steps=400, warmup_steps=150, num_chains=2, seed=0, step_size=0.1)
    z = res.samples["z"].flatten()
    assert abs(float(z.mean()) - mean) < 0.2 and abs(float(z.std()) - sd) < 0.15, (float(z.mean()), float(z.std()))
    assert abs(0.0 - mean) > 0.2 and abs(1.0 - sd) > 0.15  # the prior, a wrong posterior, fails the same bounds


def test_langevin_posterior_runs_and_is_finite():
    ltm = _ltm()
    x = torch.randint(0, 6, (6,))
    res = langevin_posterior(ltm, x, num_steps=15, warmup_steps=15, num_chains=2, seed=0)
    z = res.samples["z"]
    assert z.shape == (2, 15, 1, *ltm.latent_shape) and torch.isfinite(z).all()
    for p in ltm.decoder.parameters():
        assert p.grad is None and p.requires_grad
    out = langevin_evaluate(ltm, x[None], iw_samples=16, num_steps=10, warmup_steps=10, num_chains=1, seed=0)
    assert math.isfinite(out["ppl"]) and out["ppl"] > 1.0


def test_experiment_runs_tiny(tmp_path: Path):
    from ppl_thought.data.markov_mixture import MarkovMixture
    from ppl_thought.experiments.latent_thought import LTMConfig, run_latent_thought

    res = run_latent_thought(LTMConfig.tiny(), str(tmp_path), progress=False)
    for key in ("elbo_ppl_by_T", "ltm_ppl", "ar_window_ppl", "exact_ppl", "langevin_ppl"):
        assert key in res
    assert all(math.isfinite(v) for v in res["elbo_ppl_by_T"].values())
    assert res["exact_ppl"] >= 1.0 and math.isfinite(res["ltm_ppl"]) and math.isfinite(res["langevin_ppl"])
    assert Path(res["plot"]).exists()
    # exact log p(x) of the mixture sums to one over all sequences of length 2
    data = MarkovMixture(3, 2, 0.5, torch.Generator().manual_seed(0))
    xs = torch.cartesian_prod(torch.arange(3), torch.arange(3))
    assert data.log_prob(xs).exp().sum().item() == pytest.approx(1.0, abs=1e-5)


def test_fast_lr_schedule_and_latent_thought_refuse_bad_numbers_by_name():
    """Found by the public sweep: fast_lr_schedule(nan) returned NaN (min/max keep a NaN), LatentThought(n_z=-1)
    raised a bare ValueError."""
    from ppl_thought.errors import ConfigError
    from ppl_thought.training import fast_lr_schedule

    for kwargs in ({"progress": float("nan")}, {"progress": 0.5, "start": float("nan")},
                   {"progress": 0.5, "end": float("inf")}, {"progress": 0.5, "start": -0.1}):
        with pytest.raises(ConfigError, match="must be a finite number|is NaN, where a number is due"):
            fast_lr_schedule(**kwargs)
    assert fast_lr_schedule(0.0) == 0.3 and math.isclose(fast_lr_schedule(2.0), 0.34)  # progress is clamped
    with pytest.raises(ConfigError, match="n_z"):
        LatentThought(8, 16, 1, 2, -1)
    with pytest.raises(ValueError, match="vocab_size"):  # still a ValueError for callers that catch that
        LatentThought(0, 16, 1, 2, 1)


class _LinearGaussianLTM(LatentThought):
    """An LTM whose likelihood is replaced by a conjugate one, y | z ~ N(a * z, s^2) per latent coordinate, so that
    the exact posterior is a diagonal Gaussian (precision 1 + a^2 / s^2, mean (a y / s^2) / precision) that the
    local q of Eq. 5 can match exactly: the inner loop (Algorithm 1, lines 5-11) is then checked against it."""

    y: torch.Tensor
    a: torch.Tensor
    s = 0.5

    def log_likelihood(self, tokens, z, mask=None, max_rows=4096):
        return (-0.5 * ((self.y - self.a * z) / self.s) ** 2).flatten(-3).sum(-1)


def _conjugate_ltm() -> tuple[_LinearGaussianLTM, torch.Tensor, torch.Tensor]:
    """16 sequences of the conjugate LTM and their exact posterior's mean and variance per latent coordinate."""
    ltm = _LinearGaussianLTM(3, 8, 1, 2, 2, window=2, d_latent=4, max_len=4)
    ltm.a = torch.linspace(0.1, 3.0, 8).reshape(1, 1, 2, 4)
    ltm.y = 2.0 * torch.randn(16, 1, 2, 4, generator=torch.Generator().manual_seed(0))
    prec = 1.0 + ltm.a ** 2 / ltm.s ** 2
    return ltm, (ltm.a * ltm.y / ltm.s ** 2) / prec, (1.0 / prec).expand_as(ltm.y)


def _kl_to(q, mu: torch.Tensor, var: torch.Tensor) -> float:
    """Mean over the sequences of KL(q || N(mu, var)) in nats (diagonal Gaussians, summed over coordinates)."""
    with torch.no_grad():
        v = q.log_var.exp()
        kl = 0.5 * (v / var + (q.loc - mu) ** 2 / var - 1.0 - q.log_var + var.log())
    return float(kl.flatten(1).sum(-1).mean())


def _gap_to_exact_posterior(schedule: str, steps: int, num_samples: int = 1) -> float:
    """Mean over 16 sequences of KL(q || p(z | y)) in nats after ``steps`` inner Adam steps at rate 0.34."""
    ltm, mu, var = _conjugate_ltm()
    torch.manual_seed(1)
    q = ltm.fit_local(torch.zeros(16, 4, dtype=torch.long), num_steps=steps, lr=0.34, schedule=schedule,
                      num_samples=num_samples)
    return _kl_to(q, mu, var)


@pytest.mark.parametrize("schedule", [None, "constant"])
def test_the_trainers_default_inner_loop_is_the_converging_one(schedule):
    """``DualRateTrainer``'s default inner schedule is Sec 3.2's cosine decay: its inner loop (100 steps at rate
    0.34) ends within 0.5 nats of the exact posterior; the same trainer with ``inner_schedule="constant"`` stays more
    than 1 nat away (the failing case: the default before bd5c86a)."""
    ltm, mu, var = _conjugate_ltm()
    fitted = []
    fit_local = ltm.fit_local
    ltm.fit_local = lambda *a, **k: fitted.append(fit_local(*a, **k)) or fitted[-1]
    kw = {} if schedule is None else {"inner_schedule": schedule}
    trainer = DualRateTrainer(ltm, total_steps=1, inner_steps=100, fast_lr=(0.34, 0.34), progress=False, **kw)
    torch.manual_seed(1)
    trainer.posterior(torch.zeros(16, 4, dtype=torch.long), torch.ones(16, 4, dtype=torch.bool), 0.34)
    gap = _kl_to(fitted[0], mu, var)
    assert gap < 0.5 if schedule is None else gap > 1.0


def test_inner_loop_reaches_the_exact_gaussian_posterior_only_with_a_decaying_rate():
    """Issue 42 item 3: with the fast rate held at 0.34 the inner Adam never settles (its normalised steps keep
    every coordinate moving by about the rate), so q stays a fixed distance from the exact posterior however many
    steps it takes; the cosine decay of Sec 3.2 converges. Measured: constant 100 steps 1.48 nats, cosine 100 /
    300 steps 0.30 / 0.088 nats (0.028 with 4 draws per step), over 8 latent coordinates."""
    constant = _gap_to_exact_posterior("constant", 100)
    cosine_100, cosine_300 = _gap_to_exact_posterior("cosine", 100), _gap_to_exact_posterior("cosine", 300)
    assert constant > 1.0
    assert cosine_100 < 0.5 and cosine_300 < 0.15
    assert _gap_to_exact_posterior("cosine", 300, num_samples=4) < 0.05
    assert _gap_to_exact_posterior("constant", 300) > 0.5  # more steps do not help at a constant rate


def test_T_fast_zero_trains_the_decoder_on_prior_draws_with_kl_exactly_zero():
    """Algorithm 1 with T_fast = 0: the loop of lines 7-11 is empty, q stays at its initialisation, the prior
    (mu, log sigma^2) = (0, 0), so KL = 0 and the slow step maximises E_{z ~ N(0, I)} log p(x | z) per token."""
    ltm = _ltm()
    x = torch.randint(0, 6, (4, 7), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(11)
    z = LocalGaussianGuide.init(4, ltm.latent_shape).rsample(1, detach=True)
    want = float(-ltm.log_likelihood(x, z).detach().sum() / x.numel())
    trainer = DualRateTrainer(ltm, total_steps=2, inner_steps=0, progress=False)
    torch.manual_seed(11)
    m = trainer.step(x)
    assert m["kl_per_token"] == 0.0
    assert m["loss"] == pytest.approx(want, rel=1e-6)


def test_documented_tsweep_table_equals_the_committed_json():
    """docs/latent-thought.md's inference-steps table is ``benchmarks/ltm_tsweep.py --tables`` of the committed JSON,
    which records its command and commit; the paired differences in it are recomputed from the per-run records."""
    import importlib.util
    import json

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("ltm_tsweep", root / "benchmarks/ltm_tsweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = json.loads((root / "benchmarks/results/ltm_tsweep.json").read_text())
    assert res["commit"] and res["command"]
    assert mod.tables(res) in (root / "docs/latent-thought.md").read_text()
    runs = {(r.get("arm"), r.get("T_fast"), r["seed"]): r for r in res["runs"] if "arm" in r}
    for arm, rows in res["table"].items():
        for T, row in rows.items():
            diffs = [runs[(arm, int(T), s)]["common"]["iw_nats_per_token"]
                     - runs[("constant", 0, s)]["common"]["iw_nats_per_token"] for s in row["seeds"]]
            assert row["iw_nats_vs_T0"]["mean"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-12)


def test_tsweep_quick_pairs_each_test_sequence_with_T_fast_zero(tmp_path: Path):
    """benchmarks/ltm_tsweep.py at a tiny size with the cosine arm only (as ``--quick`` runs it): T_fast = 0 still
    runs once (filed under "constant", it has no inner schedule), each run records one IW value per test sequence
    whose mean is its IW nats/token, and the pooled per-sequence paired difference equals the mean of the per-seed
    differences (equal sequence counts), with a standard error from the sequences."""
    import importlib.util
    import statistics

    from ppl_thought.experiments.latent_thought import SweepConfig

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("ltm_tsweep", root / "benchmarks/ltm_tsweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = SweepConfig(steps=3, eval_size=6, iw_samples=4, eval_T=2, train_size=64, batch_size=8, T_fast=[0, 2])
    for seed in (0, 1):
        mod.run_seed(cfg, seed, [0, 2], 2, str(tmp_path), ("cosine",), baseline=True)
    res = mod.aggregate(str(tmp_path))
    assert sorted(res["table"]) == ["constant", "cosine"] and list(res["table"]["constant"]) == ["0"]
    runs = {(r["arm"], r["T_fast"], r["seed"]): r for r in res["runs"] if "arm" in r}
    assert set(runs) == {("constant", 0, 0), ("constant", 0, 1), ("cosine", 2, 0), ("cosine", 2, 1)}
    for r in runs.values():
        per_seq = r["common"]["iw_nats_per_seq"]
        assert len(per_seq) == 6
        assert statistics.fmean(per_seq) == pytest.approx(r["common"]["iw_nats_per_token"], abs=1e-6)
    row = res["table"]["cosine"]["2"]
    diffs = [a - b for s in (0, 1) for a, b in zip(runs[("cosine", 2, s)]["common"]["iw_nats_per_seq"],
                                                   runs[("constant", 0, s)]["common"]["iw_nats_per_seq"])]
    paired = row["iw_nats_vs_T0_per_sequence"]
    assert paired["n"] == 12 and paired["mean"] == pytest.approx(statistics.fmean(row["per_seed_iw_nats_vs_T0"]),
                                                                 abs=1e-6)  # float32 sums
    assert paired["se"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(12))
