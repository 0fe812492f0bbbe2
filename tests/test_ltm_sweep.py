"""The LTM training-time sweep, its learners and generation (latent-thought-models.txt Sec 2.2-2.3, Eq. 4-8):
the exact data law against enumeration, the generation sampler against its exact law, the inner loops'
mechanics, the VAE's ELBO against a direct computation, and the sweep's JSON."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chi2

from ppl_thought.data.markov_mixture import MarkovMixture
from ppl_thought.errors import ConfigError, MalformedSequenceError, PPLThoughtError
from ppl_thought.experiments.latent_thought import SweepConfig, run_sweep, score_continuations, score_samples
from ppl_thought.guides import AmortizedGaussianEncoder
from ppl_thought.models import LatentThought
from ppl_thought.training import DualRateTrainer, LangevinTrainer, VAETrainer, langevin_latents


def _mixture(V: int = 3, C: int = 2, seed: int = 0) -> MarkovMixture:
    return MarkovMixture(V, C, 0.5, torch.Generator().manual_seed(seed))


def _brute_chain_probs(data: MarkovMixture, seq: tuple[int, ...], start: int | None = None) -> list[float]:
    """p(seq | chain c) for each chain by explicit products of the probability tables (no log-space, no batching)."""
    init, trans = data.log_init.exp().tolist(), data.log_trans.exp().tolist()
    out = []
    for c in range(data.C):
        p = init[c][seq[0]] if start is None else trans[c][start][seq[0]]
        for a, b in zip(seq[:-1], seq[1:]):
            p *= trans[c][a][b]
        out.append(p)
    return out


def _seqs(V: int, n: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(V), repeat=n)))


def _ltm(seed: int = 0, **kw) -> LatentThought:
    torch.manual_seed(seed)
    args = dict(vocab_size=3, d_model=16, n_layers=2, n_heads=2, n_z=2, window=2, d_latent=4, max_len=8)
    args.update(kw)
    return LatentThought(**args)


def _sharpen(ltm: LatentThought, factor: float = 20.0) -> None:
    """Logits of order 1 that depend on z (a fresh init is near-uniform and nearly ignores z)."""
    with torch.no_grad():
        ltm.decoder.embed.weight.mul_(50.0)
        for block in ltm.decoder.blocks:
            block.cross.kv.weight.mul_(factor)
            block.cross.out.weight.mul_(factor)


# -- the exact data law ---------------------------------------------------------------------------------------

def test_exact_perplexity_chain_posterior_and_continuation_law_against_enumeration():
    data = _mixture(3, 2)
    xs = _seqs(3, 4)
    brute = [_brute_chain_probs(data, tuple(x.tolist())) for x in xs]
    p_x = torch.tensor([sum(b) / data.C for b in brute], dtype=torch.float64)
    assert torch.allclose(data.log_prob(xs).double().exp(), p_x, rtol=1e-5)
    assert p_x.sum().item() == pytest.approx(1.0, abs=1e-6)
    post = torch.tensor([[bc / sum(b) for bc in b] for b in brute], dtype=torch.float64)
    assert torch.allclose(data.chain_log_posterior(xs).double().exp(), post, atol=1e-5)
    # p(y | x) = p(x y) / p(x) from the enumerated joint over length-4 sequences, prefix 2 + continuation 2
    joint = dict(zip(map(tuple, xs.tolist()), p_x.tolist()))
    prefixes = _seqs(3, 2)
    for px in prefixes.tolist():
        p_prefix = sum(v for k, v in joint.items() if list(k[:2]) == px)
        ys = _seqs(3, 2)
        got = data.conditional_log_prob(torch.tensor([px] * len(ys)), ys).double().exp()
        want = torch.tensor([joint[tuple(px + y)] / p_prefix for y in ys.tolist()], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-4), (px, got, want)
        assert got.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_sample_continuation_follows_the_exact_conditional_law():
    data = _mixture(3, 2, seed=1)
    prefix = torch.tensor([[0, 2, 1]]).repeat(8000, 1)
    y = data.sample_continuation(prefix, 2, torch.Generator().manual_seed(0))
    counts = torch.bincount(y[:, 0] * 3 + y[:, 1], minlength=9).double()
    law = data.conditional_log_prob(prefix[:9], _seqs(3, 2)).double().exp()
    stat = float(((counts - 8000 * law) ** 2 / (8000 * law)).sum())
    assert stat < chi2.ppf(0.999, 8), stat
    # a sampler that ignores the prefix's chain posterior (uniform chain) is rejected by the same test
    chain = torch.randint(0, 2, (8000,), generator=torch.Generator().manual_seed(0))
    first = torch.multinomial(data.log_trans[chain, 1].exp(), 1, generator=torch.Generator().manual_seed(1))[:, 0]
    second = torch.multinomial(data.log_trans[chain, first].exp(), 1, generator=torch.Generator().manual_seed(2))[:, 0]
    wrong = torch.bincount(first * 3 + second, minlength=9).double()
    assert float(((wrong - 8000 * law) ** 2 / (8000 * law)).sum()) > chi2.ppf(0.999, 8)


def test_generation_scorers_against_enumeration():
    data = _mixture(3, 2, seed=2)
    g = torch.Generator().manual_seed(3)
    prefix, cont = torch.randint(0, 3, (6, 3), generator=g), torch.randint(0, 3, (6, 2), generator=g)
    out = score_continuations(data, prefix, cont)
    logp, same, on_prefix = 0.0, 0.0, 0.0
    for x, y in zip(prefix.tolist(), cont.tolist()):
        bx = _brute_chain_probs(data, tuple(x))
        by = _brute_chain_probs(data, tuple(y), start=x[-1])
        logp += math.log(sum(a * b for a, b in zip(bx, by)) / sum(bx))
        cx = max(range(data.C), key=lambda c: bx[c])
        same += float(max(range(data.C), key=lambda c: by[c]) == cx)
        on_prefix += by[cx] / sum(by)
    assert out["data_logp_per_token"] == pytest.approx(logp / cont.numel(), rel=1e-5)
    assert out["same_chain"] == pytest.approx(same / 6) and out["prefix_chain_posterior"] == pytest.approx(
        on_prefix / 6, rel=1e-5)
    xs = torch.tensor([[0, 0, 1, 1], [2, 2, 2, 2]])
    s = score_samples(data, xs)
    want = sum(math.log(sum(_brute_chain_probs(data, tuple(x))) / data.C) for x in xs.tolist()) / 8
    assert s["data_logp_per_token"] == pytest.approx(want, rel=1e-5)
    assert s["token_entropy"] == pytest.approx(math.log(2) / 2)  # ln 2 for the first row, 0 for the second


def test_markov_mixture_rejects_bad_input():
    data = _mixture()
    with pytest.raises(MalformedSequenceError, match="prefix"):
        data.conditional_log_prob(torch.tensor([[0, 5]]), torch.tensor([[1]]))
    with pytest.raises(PPLThoughtError, match="same number of rows"):
        data.conditional_log_prob(torch.tensor([[0, 1]]), torch.tensor([[1], [2]]))
    with pytest.raises(MalformedSequenceError, match=r"x must be a LongTensor \[B, N\]"):
        data.log_prob(torch.tensor([0.5, 1.0]))


# -- generation (Eq. 6-8) -------------------------------------------------------------------------------------

def test_generate_follows_the_teacher_forced_law():
    ltm = _ltm()
    _sharpen(ltm)
    z = torch.randn(1, *ltm.latent_shape, generator=torch.Generator().manual_seed(4))
    m = 6000
    xs = _seqs(3, 3)
    law = ltm.log_likelihood(xs, z.expand(27, *ltm.latent_shape)).detach().double().exp()
    assert law.sum().item() == pytest.approx(1.0, abs=1e-4)
    out = ltm.generate(z.expand(m, *ltm.latent_shape), 3, generator=torch.Generator().manual_seed(5))
    counts = torch.bincount(out[:, 0] * 9 + out[:, 1] * 3 + out[:, 2], minlength=27).double()
    keep = law * m > 5
    stat = float(((counts[keep] - m * law[keep]) ** 2 / (m * law[keep])).sum())
    assert stat < chi2.ppf(0.999, int(keep.sum()) - 1), stat
    # with a prefix: the prefix is kept and the continuation follows p(y | x, z) = p(x y | z) / p(x | z)
    prefix = torch.tensor([[2]]).repeat(m, 1)
    out = ltm.generate(z.expand(m, *ltm.latent_shape), 2, prefix, torch.Generator().manual_seed(6))
    assert (out[:, 0] == 2).all() and out.shape == (m, 3)
    full = torch.cat([torch.full((9, 1), 2), _seqs(3, 2)], 1)
    cond = ltm.log_likelihood(full, z.expand(9, *ltm.latent_shape)).detach().double().exp()
    cond = cond / cond.sum()
    counts = torch.bincount(out[:, 1] * 3 + out[:, 2], minlength=9).double()
    stat = float(((counts - m * cond) ** 2 / (m * cond)).sum())
    assert stat < chi2.ppf(0.999, 8), stat
    with pytest.raises(MalformedSequenceError, match="num_tokens"):
        ltm.generate(z, -1)
    with pytest.raises(MalformedSequenceError, match="max_len"):
        ltm.generate(z, 9)


# -- the inner loops ------------------------------------------------------------------------------------------

def _count_decoder_calls(ltm: LatentThought) -> list[int]:
    calls = [0]
    ltm.decoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("T", [0, 3])
def test_inner_loop_cost_and_T_fast_zero_means_no_update(T: int):
    x = torch.randint(0, 3, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x, dtype=torch.bool)
    ltm = _ltm()
    calls = _count_decoder_calls(ltm)
    trainer = DualRateTrainer(ltm, 10, T, progress=False)
    torch.manual_seed(0)
    z, kl = trainer.posterior(x, mask, 0.3)
    assert calls[0] == T  # one decoder forward per fast step, none when T_fast = 0
    if T == 0:
        torch.manual_seed(0)
        assert torch.equal(z[0], torch.randn(4, *ltm.latent_shape)) and torch.equal(kl, torch.zeros(4))
    else:
        assert (kl > 0).all()
    ltm = _ltm()
    calls = _count_decoder_calls(ltm)
    z0 = torch.randn(4, *ltm.latent_shape)
    z = langevin_latents(ltm, x, num_steps=T, step_size=0.1, z0=z0)
    assert calls[0] == T and torch.equal(z, z0) == (T == 0)


def test_langevin_step_is_eq4():
    ltm = _ltm()
    _sharpen(ltm)
    x = torch.randint(0, 3, (3, 5), generator=torch.Generator().manual_seed(1))
    z0 = torch.randn(3, *ltm.latent_shape, generator=torch.Generator().manual_seed(2))
    s = 0.05
    z1 = langevin_latents(ltm, x, num_steps=1, step_size=s, z0=z0, generator=torch.Generator().manual_seed(3))
    zz = z0.clone().requires_grad_(True)
    logp = ltm.log_likelihood(x, zz) + torch.distributions.Normal(0.0, 1.0).log_prob(zz).flatten(1).sum(-1)
    (grad,) = torch.autograd.grad(logp.sum(), zz)
    eps = torch.randn(z0.shape, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(z1, z0 + s * grad + math.sqrt(2 * s) * eps, atol=1e-5)
    assert grad.abs().max() > 1.0  # the likelihood term matters here, not only the prior's -z
    for p in ltm.decoder.parameters():
        assert p.grad is None and p.requires_grad
    with pytest.raises(ConfigError, match="step_size must be > 0"):
        langevin_latents(ltm, x, num_steps=1, step_size=0.0)
    with pytest.raises(ConfigError, match="step_size must be > 0"):
        LangevinTrainer(ltm, 5, 2, step_size=-1.0, progress=False)
    with pytest.raises(ConfigError, match="hidden >= 1"):
        AmortizedGaussianEncoder(3, ltm.latent_shape, hidden=0)


def test_langevin_on_a_flat_likelihood_has_the_closed_form_ula_variance():
    """With a decoder that ignores z the target is N(0, I) and Eq. 4 is the AR(1) z' = (1 - s) z + sqrt(2s) eps:
    from z0 ~ N(0, 1), Var z_T = a^(2T) + v (1 - a^(2T)) with a = 1 - s, v = 2s / (1 - a^2) = 1 / (1 - s/2)."""
    ltm = _ltm()
    with torch.no_grad():
        for block in ltm.decoder.blocks:
            block.cross.out.weight.zero_()
    x = torch.randint(0, 3, (1024, 4), generator=torch.Generator().manual_seed(0))
    s, T = 0.5, 3
    z = langevin_latents(ltm, x, num_steps=T, step_size=s, generator=torch.Generator().manual_seed(1))
    a = 1.0 - s
    want = a ** (2 * T) + (1.0 - a ** (2 * T)) / (1.0 - s / 2.0)  # 1.328; the exact posterior would give 1
    n = z.numel()
    se = want * math.sqrt(2.0 / n)
    assert abs(z.var().item() - want) < 4 * se, (z.var().item(), want, se)
    assert abs(z.mean().item()) < 4 * math.sqrt(want / n)


# -- the learners ---------------------------------------------------------------------------------------------

def test_vae_elbo_equals_a_direct_computation_and_trains_the_encoder():
    ltm = _ltm()
    enc = AmortizedGaussianEncoder(3, ltm.latent_shape, hidden=8)
    with torch.no_grad():
        enc.mlp[-1].weight.normal_(0.0, 0.5)
    x = torch.tensor([[0, 1, 2, 2], [1, 1, 0, 2]])
    # the encoder by hand: mean of the pair embeddings (<bos> = 3 before the first token), then the MLP
    rows = []
    for seq in x.tolist():
        pairs = [(3 if n == 0 else seq[n - 1]) * 3 + seq[n] for n in range(len(seq))]
        rows.append(torch.stack([enc.pairs.weight[p] for p in pairs]).mean(0))
    loc, log_var = enc.mlp(torch.stack(rows)).chunk(2, -1)
    q = torch.distributions.Normal(loc, (0.5 * log_var).exp())
    eps = torch.randn(loc.shape, generator=torch.Generator().manual_seed(7))
    z = (loc + (0.5 * log_var).exp() * eps).reshape(2, *ltm.latent_shape)
    kl = torch.distributions.kl_divergence(q, torch.distributions.Normal(0.0, 1.0)).sum(-1)
    direct = ltm.log_likelihood(x, z) - kl
    guide = enc(x)
    assert torch.allclose(guide.loc.flatten(1), loc, atol=1e-6) and torch.allclose(guide.kl_to_prior(), kl, atol=1e-5)
    torch.manual_seed(7)
    assert torch.allclose(ltm.elbo(x, guide), direct, atol=1e-4)
    # the trainer's loss is -ELBO per token at the parameters before its step, and the step moves phi and beta
    trainer = VAETrainer(ltm, enc, 5, progress=False)
    before = [p.detach().clone() for p in trainer.trained_parameters()]
    torch.manual_seed(7)
    metrics = trainer.step(x)
    assert metrics["loss"] == pytest.approx(-direct.sum().item() / x.numel(), rel=1e-5)
    moved = [not torch.equal(b, p) for b, p in zip(before, trainer.trained_parameters())]
    n_dec = len(list(ltm.decoder.parameters()))
    assert any(moved[:n_dec]) and any(moved[n_dec:])
    with pytest.raises(MalformedSequenceError, match="tokens must lie"):
        enc(torch.tensor([[0, 3]]))


def test_langevin_trainer_loss_is_the_mle_term_at_the_langevin_sample():
    ltm = _ltm()
    x = torch.randint(0, 3, (4, 6), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(11)
    z = langevin_latents(ltm, x, num_steps=2, step_size=0.05)
    want = -ltm.log_likelihood(x, z).sum().item() / x.numel()
    trainer = LangevinTrainer(ltm, 5, 2, step_size=0.05, progress=False)
    torch.manual_seed(11)
    metrics = trainer.step(x)
    assert metrics["loss"] == pytest.approx(want, rel=1e-5) and metrics["kl_per_token"] == 0.0


# -- the sweep ------------------------------------------------------------------------------------------------

def test_sweep_tiny_json_shape_and_equal_budget():
    cfg = SweepConfig.tiny()
    res = run_sweep(cfg, progress=False)
    assert set(res["sweep"]["T_fast"]) == {"0", "2"} and set(res["sweep"]["N_z"]) == {"1", "2"}
    assert set(res["learners"]) == {"vb", "langevin", "vae"}
    every = [*res["sweep"]["T_fast"].values(), *res["sweep"]["N_z"].values(), *res["learners"].values()]
    for run in every:
        assert run["decoder_updates"] == cfg.steps  # equal budget
        assert run["exact_ppl"] == res["exact_ppl"]
        for k in ("ppl", "elbo_ppl_Teval", "iw_ppl"):
            assert math.isfinite(run[k]) and run[k] >= 1.0
    assert res["sweep"]["T_fast"]["0"]["train_final"]["kl_per_token"] == 0.0  # T_fast = 0: q stays the prior
    assert res["sweep"]["T_fast"]["2"]["train_final"]["kl_per_token"] > 0.0
    assert "amortised_elbo_ppl" in res["learners"]["vae"]
    for name in ("vb", "langevin", "vae"):
        gen = res["generation"][name]
        assert set(gen) == {"posterior_continuation", "prior_z_continuation", "prior_samples"}
        assert 0.0 <= gen["posterior_continuation"]["same_chain"] <= 1.0
    assert {"commit", "machine", "seconds", "config"} <= set(res)


def test_documented_sweep_tables_equal_the_committed_json():
    import json
    from pathlib import Path

    from ppl_thought.experiments.latent_thought import sweep_tables

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs/latent-thought.md").read_text()
    for name in ("ltm_sweep_quick.json", "ltm_sweep_quick_seed1.json"):
        results = json.loads((root / "benchmarks/results" / name).read_text())
        assert sweep_tables(results) in doc, name
