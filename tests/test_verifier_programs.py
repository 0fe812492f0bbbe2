"""The verifier engines as programs x guides x engines, against exact answers (thesis Defs 3.1.2-3.1.5;
the issue "One engine core: every engine runs every program").

Programs: :class:`VerifiedLM` (the LM restricted to A, p_O(s) 1(s in A)) on a Tabular bigram and on a tiny
Transformer built here; a user-written program (its own LM-with-constraint steps: ``LMState.next_token``,
the process verifier called on the padded prefix, ``pyro.factor``). Guides: ``None`` (bootstrap,
``proposal="lm"``), :class:`LocallyOptimalProposal` (``"masked"``), :class:`WeightedRejectionProposal`
(``"rejection"``). Engines: ``pt.infer.SMC`` and ``pt.infer.Importance`` (the programs as whole traces).

Exact answers enumerate every string of Sigma^N under the LM itself: Z = P_O(A) and the restricted law.
Checks per cell, with fixed seeds (48; 240 with --slow): over seeds, mean(Z-hat / Z) within 3 standard
errors of 1 (Z-hat unbiased); and the law: the ratio estimator sum_r Z-hat_r W_r(E) / sum_r Z-hat_r of
P(E | A) (numerator and denominator unbiased) within 3.5 delta-method standard errors of the exact value,
for E = the strings of A with a given first token. ``test_forgetting_the_local_mass_fails`` shows that a
masked proposal that drops its local-mass weight (tokenwise rejection's law with weight 1) fails both
checks, and ``test_naive_rejection_weight_fails`` that 1 / K instead of 1 / (K - 1) fails the first.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pyro
import pytest
import torch
from test_verifiers import ALPHABET, BRACKETS, bracket_lm

import ppl_thought as pt
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.errors import ProgramError, ZeroWeightsError
from ppl_thought.verifiers import ProcessVerifier, dyck
from ppl_thought.verifiers.program import (
    LocallyOptimalProposal,
    NextToken,
    VerifiedLM,
    WeightedRejectionProposal,
    _RejectionDraw,
)
from ppl_thought.verifiers.sampling import VerifierSMC
from ppl_thought.vocab import BOS_ID, PAD_ID

OPEN = BRACKETS.id("(")


def seeds(request, fast: int, slow: int) -> range:
    return range(slow if request.config.getoption("--slow") else fast)


# ---------------------------------------------------------------------------------------------- exact answers
def exact(lm, ver: ProcessVerifier, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(every string of A ``[|A|, N]``, log p_O(s) ``[|A|]``): all of ALPHABET^N scored by the LM in one
    teacher-forced batch (the law O(. | s) of Def 3.1.1: softmax without <pad> and <bos>), kept if in A.
    Strings with other tokens (specials) are never in A (the Dyck automaton rejects them)."""
    S = torch.tensor(list(itertools.product(ALPHABET, repeat=N)))
    ctx = torch.cat([torch.full((len(S), 1), BOS_ID), S], 1)
    with torch.no_grad():
        logits, _ = lm(ctx)
    lp = TokenRule(None, lm.vocab_size).log_probs(logits[:, :-1].float(), torch.zeros(len(S), N, dtype=torch.long))
    lp = lp.gather(-1, S[..., None]).squeeze(-1).double().sum(-1)
    ok = ver.accepts(S)
    return S[ok], lp[ok]


def tiny_transformer() -> pt.lm.Transformer:
    torch.manual_seed(0)
    return pt.lm.Transformer(len(BRACKETS), d_model=16, n_layers=1, n_heads=2, max_len=16).requires_grad_(False)


def task(kind: str):
    """(lm, verifier, N, n particles for the bootstrap): Dyck_{2,2} strings of length N."""
    if kind == "transformer":  # P_O(A) = 0.002: the bootstrap needs many particles
        lm, N, boot = tiny_transformer(), 4, 1500
    else:
        lm, N, boot = bracket_lm(), 6, 200
    return lm, ProcessVerifier(dyck(2, 2, BRACKETS), N), N, boot


# ---------------------------------------------------------------------------------------------- a user program
class BracketWriter(pt.Program):
    """What a user writes: one token per step from the LM (the library's LMState), the process verifier
    asked about the whole padded prefix, and its verdict as a factor. The same sites as VerifiedLM(site="tok")."""

    def __init__(self, lm, verifier: ProcessVerifier):
        self.lm, self.verifier, self.max_steps = lm, verifier, verifier.length

    def init(self, state):
        state["x"] = LMState.start(self.lm, pt.particles(), max_len=self.verifier.length)

    def step(self, state, t):
        x = state["x"]
        tok = pyro.sample(f"tok_{t}", x.next_token())
        x.extend(tok)
        prefix = torch.cat([x.tokens, torch.full((x.n, self.verifier.length - x.tokens.shape[1]), PAD_ID)], 1)
        pyro.factor(f"tok_ok_{t}", torch.log(self.verifier(prefix).float()))
        return torch.ones(x.n, dtype=torch.bool) if t + 1 == self.verifier.length else None

    def outputs(self, state):
        return {"tok": state["x"].tokens}


def build(program: str, proposal: str):
    kind = "transformer" if program == "transformer" else "tabular"
    lm, ver, N, boot = task(kind)
    site = "tok" if program == "user" else "z"
    model = BracketWriter(lm, ver) if program == "user" else VerifiedLM(lm, ver, site=site)
    guide = {"lm": None, "masked": LocallyOptimalProposal, "rejection": WeightedRejectionProposal}[proposal]
    guide = guide(lm, ver, site=site) if guide is not None else None
    return model, guide, exact(lm, ver, N), site, (boot if proposal == "lm" else 200)


# ---------------------------------------------------------------------------------------------- checks
def runs(engine: str, model, guide, site: str, seeds_, n: int):
    """Per seed: (log Z-hat, strings [n, N], normalised weights [n]); Z-hat = 0 (every weight zero) is a
    legitimate draw of the estimator: (-inf, None, None)."""
    out = []
    for seed in seeds_:
        torch.manual_seed(seed)
        pyro.set_rng_seed(seed)
        try:
            r = pt.infer.SMC(n).run(model, guide) if engine == "SMC" else pt.infer.Importance(n).run(model, guide)
        except ZeroWeightsError:
            out.append((float("-inf"), None, None))
            continue
        z = r.samples[site] if site in r.samples else torch.stack([r.samples[f"{site}_{i}"] for i in
                                                                     range(len(r.samples))], 1)
        out.append((float(r.log_marginal), z, torch.softmax(r.log_weights.double(), -1)))
    return out


def check_z(results, log_z: float, what: str) -> None:
    """mean(Z-hat / Z) within 3 standard errors of 1."""
    ratio = np.exp(np.array([r[0] for r in results]) - log_z)
    se = ratio.std(ddof=1) / math.sqrt(len(ratio))
    assert abs(ratio.mean() - 1) <= 3 * se + 1e-9, f"{what}: mean Z-hat / Z = {ratio.mean():.4f} +- {se:.4f}"


def check_law(results, A: torch.Tensor, lp: torch.Tensor, what: str, prefix: int = 1) -> None:
    """Properly weighted for the restricted law: for every bin E of A (the strings sharing their first
    ``prefix`` tokens), the ratio estimator sum_r Z-hat_r W_r(E) / sum_r Z-hat_r of P(E | A) (both sums
    unbiased: SMC's unnormalised measure, so its bias is O(1 / runs) whatever the number of particles) is
    within 3.5 delta-method standard errors of the exact P(E | A). Coarse bins (the first token by default):
    on bins of small mass the rejection proposal's heavy-tailed weights make the delta-method SE unreliable
    (prefix=2 on the Transformer: 2 of 10 blocks of 48 seeds failed; prefix=1: none)."""
    p = torch.exp(lp - torch.logsumexp(lp, 0)).numpy()
    bins = sorted({tuple(s[:prefix]) for s in A.tolist()})
    of = np.array([bins.index(tuple(s[:prefix])) for s in A.tolist()])
    target = np.array([p[of == b].sum() for b in range(len(bins))])
    zh, m = [], []
    for log_zh, z, w in results:
        row = np.zeros(len(bins))
        if z is not None:
            assert all(tuple(s[:prefix]) in bins for s in z[w > 0].tolist()), f"{what}: a weighted string outside A"
            key = z[:, :prefix].tolist()
            for b, e in enumerate(bins):
                row[b] = float(w[torch.tensor([tuple(k) == e for k in key])].sum())
        zh.append(math.exp(log_zh))
        m.append(math.exp(log_zh) * row)
    zh, m = np.array(zh), np.array(m)
    R = len(zh)
    est = m.mean(0) / zh.mean()
    resid = (m - est[None] * zh[:, None]) / zh.mean()  # delta method for a ratio of means
    se = resid.std(0, ddof=1) / math.sqrt(R)
    bad = np.abs(est - target) > 3.5 * se + 1e-9
    assert not bad.any(), \
        f"{what}: P(E | A) per bin {np.round(est, 4)} vs exact {np.round(target, 4)} (SE {np.round(se, 4)})"


# ---------------------------------------------------------------------------------------------- the matrix
CELLS = [(p, g) for p in ("tabular", "transformer", "user") for g in ("lm", "masked", "rejection")]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["SMC", "Importance"])
@pytest.mark.parametrize(("program", "proposal"), CELLS, ids=[f"{p}-{g}" for p, g in CELLS])
def test_verifier_matrix(request, program, proposal, engine):
    """Every verifier program under every proposal and engine: Z-hat unbiased for P_O(A), the weighted particles
    properly weighted for the restricted law (exact answers by enumeration of Sigma^N)."""
    model, guide, (A, lp), site, n = build(program, proposal)
    log_z = float(torch.logsumexp(lp, 0))
    with torch.no_grad():
        results = runs(engine, model, guide, site, seeds(request, 48, 240), n)
    assert sum(r[1] is not None for r in results) >= 0.75 * len(results)
    check_z(results, log_z, f"{program} x {proposal} x {engine}")
    check_law(results, A, lp, f"{program} x {proposal} x {engine}")


# ---------------------------------------------------------------------------------------------- wrong weights
class _ScoredAs(NextToken):
    """Draws from ``log_probs`` but scores under ``score`` (the wrong density)."""

    def __init__(self, log_probs, score):
        super().__init__(log_probs)
        self.score = score

    def log_prob(self, value):
        return self.score.gather(-1, value.long()[:, None])[:, 0]


class ForgetsLocalMass(LocallyOptimalProposal):
    """The classic mistake: tokens from the masked law, weighed as if drawn from the LM (weight 1, not Z_V(s)):
    tokenwise rejection's law (Prop 3.1.2) passed off as the restricted law."""

    def step(self, state, t, *args, **kwargs):
        d = _ScoredAs(self.local_log_probs(state, t), self.log_next(state))
        return self.advance(state, t, pyro.sample(f"{self.site}_{t}", d))


class _NaiveDraw(_RejectionDraw):
    def log_prob(self, value):
        log_k_minus_1 = super().log_prob(value) - NextToken.log_prob(self, value)
        return NextToken.log_prob(self, value) + torch.log(log_k_minus_1.exp() + 1)  # log O(t | s) + log K


class NaiveRejection(WeightedRejectionProposal):
    """Weighted rejection with the naive weight 1 / K instead of 1 / (K - 1)."""

    def step(self, state, t, *args, **kwargs):
        return self.advance(state, t, pyro.sample(f"{self.site}_{t}", _NaiveDraw(self, state, t)))


def test_forgetting_the_local_mass_fails(request):
    """The checks have teeth: the masked proposal without its local-mass weight gives Z-hat = 1 (not P_O(A) =
    0.05) and the locally renormalised law of Prop 3.1.2 (measured: P(first token "(" | A) 0.643 +- 0.005
    against the exact 0.670); both checks fail. The correct guide passes them on the same seeds."""
    lm, ver, N, _ = task("tabular")
    A, lp = exact(lm, ver, N)
    log_z = float(torch.logsumexp(lp, 0))
    model = VerifiedLM(lm, ver)
    with torch.no_grad():
        wrong = runs("SMC", model, ForgetsLocalMass(lm, ver), "z", seeds(request, 48, 240), 200)
        right = runs("SMC", model, LocallyOptimalProposal(lm, ver), "z", seeds(request, 48, 240), 200)
    check_z(right, log_z, "right")
    check_law(right, A, lp, "right")
    with pytest.raises(AssertionError, match="mean Z-hat"):
        check_z(wrong, log_z, "wrong")
    with pytest.raises(AssertionError, match="per bin"):
        check_law(wrong, A, lp, "wrong")


def test_naive_rejection_weight_fails(request):
    """1 / K (the naive acceptance-rate weight) underestimates Z_V(s): Z-hat is biased low and the check fails;
    1 / (K - 1) passes on the same seeds."""
    lm, ver, N, _ = task("tabular")
    _, lp = exact(lm, ver, N)
    log_z = float(torch.logsumexp(lp, 0))
    model = VerifiedLM(lm, ver)

    with torch.no_grad():
        right = runs("SMC", model, WeightedRejectionProposal(lm, ver), "z", seeds(request, 48, 240), 200)
        naive = runs("SMC", model, NaiveRejection(lm, ver), "z", seeds(request, 48, 240), 200)
    check_z(right, log_z, "1/(K-1)")
    with pytest.raises(AssertionError, match="mean Z-hat"):
        check_z(naive, log_z, "1/K")


# ---------------------------------------------------------------------------------------------- VerifierSMC
@pytest.mark.parametrize("proposal", ["lm", "masked", "rejection"])
def test_verifier_smc_is_smc_on_the_program(proposal):
    """VerifierSMC(...).run is SMC on (VerifiedLM, the proposal's guide): the same numbers from the same seed,
    and its stats (oracle calls of Def 3.1.6, ESS per step, the steps it resampled at)."""
    lm, ver, N, _ = task("tabular")
    torch.manual_seed(3)
    res = VerifierSMC(300, N, proposal=proposal).run(lm, ver)
    model, guide = VerifierSMC(300, N, proposal=proposal).program(lm, ver)
    torch.manual_seed(3)
    ref = pt.infer.SMC(300, max_steps=N).run(model, guide)
    assert torch.equal(res.samples["z"], ref.samples["z"]) and res.samples["z"].shape == (300, N)
    assert torch.allclose(res.log_weights, ref.log_weights) and float(res.log_marginal) == float(ref.log_marginal)
    assert res.engine == "VerifierSMC" and res.stats["proposal"] == proposal
    assert res.stats["ess"].shape == (N,)
    assert res.stats["resampled"] == [i for i, r in enumerate(ref.stats["resampled"]) if r]
    calls = {"lm": (300 * N, 300 * N), "masked": (300 * N, 300 * N * lm.vocab_size)}
    if proposal == "rejection":
        assert res.stats["lm_calls"] == res.stats["verifier_calls"] >= 2 * 300 * N
    else:
        assert (res.stats["lm_calls"], res.stats["verifier_calls"]) == calls[proposal]
    alive = res.log_weights > float("-inf")
    assert ver.accepts(res.samples["z"][alive]).all()


def test_verifier_smc_with_a_prompt_and_a_generator():
    """A prompt conditions the LM (encoded once); a generator makes the run reproducible without the global seed."""
    lm, ver, N, _ = task("tabular")
    prompt = torch.tensor([OPEN])
    a = VerifierSMC(100, N).run(lm, ver, prompt, torch.Generator().manual_seed(5))
    torch.manual_seed(123)
    b = VerifierSMC(100, N).run(lm, ver, prompt, torch.Generator().manual_seed(5))
    assert torch.equal(a.samples["z"], b.samples["z"]) and float(a.log_marginal) == float(b.log_marginal)
    c = VerifierSMC(100, N).run(lm, ver, None, torch.Generator().manual_seed(5))
    assert float(a.log_marginal) != float(c.log_marginal)


def test_rejection_density_is_defined_only_at_its_draw():
    lm, ver, N, _ = task("tabular")
    g = WeightedRejectionProposal(lm, ver)
    with pyro.plate("particles", 4):
        state: dict = {}
        g.init(state)
        d = _RejectionDraw(g, state, 0)
        tok = d.sample()
        assert torch.isfinite(d.log_prob(tok)).all()
        with pytest.raises(ProgramError, match="drew"):
            d.log_prob(tok.clone())


# ---------------------------------------------------------------------------------------------- Importance protocol
def test_importance_fast_path_is_a_protocol_method():
    """Importance takes the fast path for any model offering sampler_weights(guide, x, n), not for a class: a
    wrapper that is no SlowThinking gets it (same numbers as the SlowThinking it wraps), and a SlowThinking
    whose method is hidden goes through the traced path."""
    vocab = pt.Vocab(["a", "b"])
    g = torch.Generator().manual_seed(0)
    lm = pt.lm.Tabular(2, len(vocab), torch.randn(len(vocab), len(vocab), generator=g), trainable=False)
    model = pt.models.SlowThinking(lm, pt.projections.PauseToThink(vocab, max_thought_len=2))
    guide = pt.guides.Identity(model)
    calls = []

    class Wrapper:
        def __call__(self, x):
            return model(x)

        def sampler_weights(self, sampler, x, n):
            calls.append(n)
            return model.sampler_weights(sampler, x, n)

    torch.manual_seed(0)
    fast = pt.infer.Importance(16).run(Wrapper(), guide, "a b")
    torch.manual_seed(0)
    ref = pt.infer.Importance(16).run(model, guide, "a b")
    assert calls == [16] and torch.allclose(fast.log_weights, ref.log_weights)
    torch.manual_seed(0)
    traced = pt.infer.Importance(16, fast=False, max_plate_nesting=0).run(model, guide, "a b")
    assert math.isfinite(float(traced.log_marginal)) and "log_p" in traced.stats
