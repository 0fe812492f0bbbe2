"""``ptn.verifiers`` (the JAX verifier engines, docs/numpyro.md and docs/verifiers.md) against exact enumeration.

The task: a random bigram LM over four brackets and the Dyck_{2,2} strings of length 4 (Def 3.1.2, (2.37)); all
4^4 strings are enumerated, giving the restricted law p(s) ~ p_O(s) 1(s in A) (Section 3.1.1), Z = P_O(A), the
law of tokenwise rejection q(s) = prod_i O(s_i | s_<i) V(s_<=i) / Z_V(s_<i) (Prop 3.1.2) and the locally optimal
proposal's weight log p_O(s) - log q(s) = sum_i log Z_V(s_<i) of every string. Checked: rejection sampling has the
restricted law (chi-square), tokenwise rejection its own biased law and not the restricted one (the wrong
estimator fails), VerifierSMC's weights are the enumerated ones string by string and its weighted law is the
restricted law (masked and weighted-rejection proposals), while the same particles with uniform weights (the
estimator without Z_V) fail the bound; VerifiedLM with LocallyOptimalProposal under ptn.infer.SMC has the same
weights; the torch and JAX engines give the same weights within 1e-5 and the same verifier decisions.
"""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax.numpy as jnp  # noqa: E402
from scipy.stats import chisquare  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import ConfigError, UnsatisfiableConstraintError  # noqa: E402
from ppl_thought.vocab import Vocab  # noqa: E402

VOCAB = Vocab(["(", ")", "[", "]"])
V, N, D = len(VOCAB), 4, 2
BR = VOCAB.encode("( ) [ ]")
OPEN, CLOSE = {BR[0]: 0, BR[2]: 1}, {BR[1]: 0, BR[3]: 1}


def _logits(seed: int = 3) -> np.ndarray:
    logits = np.full((V, V), -np.inf, np.float32)
    logits[:, BR] = np.random.default_rng(seed).normal(size=(V, 4)) * 1.5
    return logits


LOGITS = _logits()


def _in_dyck(s) -> bool:
    stack = []
    for tok in s:
        if tok in OPEN:
            if len(stack) == D:
                return False
            stack.append(OPEN[tok])
        elif not stack or stack.pop() != CLOSE[tok]:
            return False
    return not stack


def _exact():
    """Every string of BR^N: p_O, membership, the tokenwise law q and log Z_V summed along the string."""
    lp = LOGITS - np.logaddexp.reduce(LOGITS, -1, keepdims=True)
    strings = [tuple(s) for s in itertools.product(BR, repeat=N)]
    inA = np.array([_in_dyck(s) for s in strings])
    ok_prefix = {s[:i] for s, a in zip(strings, inA) if a for i in range(N + 1)}  # V(prefix) = 1
    log_po, log_q = np.zeros(len(strings)), np.zeros(len(strings))
    for j, s in enumerate(strings):
        prev = 1  # <bos>
        for i, tok in enumerate(s):
            log_po[j] += lp[prev, tok]
            admitted = [t for t in BR if s[:i] + (t,) in ok_prefix]
            if s[: i + 1] in ok_prefix:
                log_q[j] += lp[prev, tok] - np.logaddexp.reduce(lp[prev, admitted])
            else:
                log_q[j] = -np.inf
            prev = tok
    p = np.where(inA, np.exp(log_po), 0.0)
    return strings, inA, p.sum(), p / p.sum(), np.where(inA, np.exp(log_q), 0.0), log_po - log_q


STRINGS, IN_A, Z, P, Q, LOG_W = _exact()
INDEX = {s: i for i, s in enumerate(STRINGS)}


def _index(z) -> np.ndarray:
    return np.array([INDEX[tuple(int(t) for t in row)] for row in np.asarray(z)])


def _counts(z) -> np.ndarray:
    return np.bincount(_index(z), minlength=len(STRINGS)).astype(float)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square over the strings of positive probability, pooling those of expected count < 5 (a sample
    outside the support gives p = 0)."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = probs * counts.sum()
    big = exp >= 5
    c = np.append(counts[big], counts[~big & (probs > 0)].sum())
    e = np.append(exp[big], exp[~big & (probs > 0)].sum())
    keep = e > 0
    return float(chisquare(c[keep], e[keep] * c[keep].sum() / e[keep].sum()).pvalue)


def _weighted_tv(z, log_w) -> float:
    w = np.asarray(jax.nn.softmax(jnp.asarray(log_w)))
    law = np.bincount(_index(z), weights=w, minlength=len(STRINGS))
    return 0.5 * float(np.abs(law - P).sum())


@pytest.fixture(scope="module")
def task():
    lm = ptn.lm.Tabular(2, V, LOGITS)
    return lm, ptn.verifiers.ProcessVerifier(ptn.verifiers.dyck(2, D, VOCAB), N)


def test_the_enumerated_task_has_a_biased_tokenwise_law():
    """The premise of the checks below: 8 strings in A, tokenwise rejection's law far from the restricted law."""
    assert IN_A.sum() == 8 and 0.01 < Z < 0.5
    assert 0.5 * np.abs(P - Q).sum() > 0.1


def test_rejection_sampling_has_the_restricted_law(task):
    res = ptn.verifiers.RejectionSampling(3000, N, batch_size=2048).run(*task, rng_key=0)
    z = res.samples["z"]
    assert z.shape == (3000, N)
    assert _chi2_pvalue(_counts(z), P) > 1e-3
    se = math.sqrt(Z * (1 - Z) / res.stats["strings_generated"])
    assert abs(res.stats["acceptance_rate"] - Z) < 4 * se
    per = np.asarray(res.stats["lm_calls_per_sample"])  # N / P_O(A) calls per sample (geometric number of strings)
    assert per.sum() == res.stats["lm_calls"] and abs(per.mean() - N / Z) < 4 * per.std() / math.sqrt(per.size)


def test_tokenwise_rejection_has_its_own_biased_law(task):
    """Def 3.1.5 / Prop 3.1.2: the law q of locally renormalised conditionals; the restricted law fails (the wrong
    estimator, as an exact sampler of p, is caught)."""
    res = ptn.verifiers.TokenwiseRejection(3000, N).run(*task, rng_key=1)
    counts = _counts(res.samples["z"])
    assert _chi2_pvalue(counts, Q) > 1e-3
    assert _chi2_pvalue(counts, P) < 1e-6
    calls = np.asarray(res.stats["lm_calls_per_sample"])
    assert calls.min() >= N and res.stats["lm_calls"] == calls.sum()


def test_verifier_smc_weights_are_exact_and_its_law_is_the_restricted_one(task):
    res = ptn.verifiers.VerifierSMC(4000, N, proposal="masked", ess_threshold=0.0).run(*task, rng_key=2)
    z, lw = res.samples["z"], np.asarray(res.log_weights)
    np.testing.assert_allclose(lw, LOG_W[_index(z)], atol=1e-5)  # sum_i log Z_V(s_<i), string by string
    assert _weighted_tv(z, lw) < 0.03
    assert abs(float(res.log_marginal) - math.log(Z)) < 4 * float(res.log_marginal_stderr) + 1e-6
    # the estimator without the local masses (uniform weights: tokenwise rejection's law) fails the same bound
    assert _weighted_tv(z, np.zeros_like(lw)) > 0.08
    assert res.stats["lm_calls"] == 4000 * N and res.stats["verifier_calls"] == 4000 * N * V


def test_verifier_smc_weighted_rejection_with_resampling(task):
    res = ptn.verifiers.VerifierSMC(4000, N, proposal="rejection", ess_threshold=0.5).run(*task, rng_key=3)
    z, lw = res.samples["z"], np.asarray(res.log_weights)
    assert IN_A[_index(z)].all()
    assert _weighted_tv(z, lw) < 0.04
    assert abs(float(res.log_marginal) - math.log(Z)) < 0.1
    assert res.stats["lm_calls"] >= 4000 * N


def test_verified_lm_with_the_locally_optimal_proposal_under_smc(task):
    """VerifiedLM(draw="lm") as the model, LocallyOptimalProposal as the guide: p / q = Z_V at each step."""
    lm, ver = task
    res = ptn.infer.SMC(2000, ess_threshold=0.0).run(ptn.verifiers.VerifiedLM(lm, ver),
                                                      ptn.verifiers.LocallyOptimalProposal(lm, ver), rng_key=4)
    z, lw = res.samples["z"], np.asarray(res.log_weights)
    assert z.shape == (2000, N)
    np.testing.assert_allclose(lw, LOG_W[_index(z)], atol=1e-5)
    assert _weighted_tv(z, lw) < 0.04


def test_torch_and_jax_give_the_same_weights_and_decisions(task):
    torch = pytest.importorskip("torch")
    import ppl_thought as pt

    lm_t = pt.lm.Tabular(2, V, torch.as_tensor(LOGITS))
    ver_t = pt.verifiers.ProcessVerifier(pt.verifiers.dyck(2, D, VOCAB), N)
    res = pt.verifiers.VerifierSMC(2000, N, proposal="masked", ess_threshold=0.0).run(
        lm_t, ver_t, None, torch.Generator().manual_seed(0))
    z_t, lw_t = res.samples["z"].numpy(), res.log_weights.numpy()
    np.testing.assert_allclose(lw_t, LOG_W[_index(z_t)], atol=1e-5)
    # the JAX weights of the same strings (the previous test's run is cached: the same compiled function)
    lm, ver = task
    out = ptn.infer.SMC(2000, ess_threshold=0.0).run(ptn.verifiers.VerifiedLM(lm, ver),
                                                      ptn.verifiers.LocallyOptimalProposal(lm, ver), rng_key=4)
    by_string = dict(zip(map(tuple, np.asarray(out.samples["z"]).tolist()), np.asarray(out.log_weights)))
    common = [(lw, by_string[tuple(row)]) for row, lw in zip(z_t.tolist(), lw_t) if tuple(row) in by_string]
    assert len(common) > 1000
    a, b = np.array(common).T
    np.testing.assert_allclose(a, b, atol=1e-5)
    # one verifier, two backends: V(s) on every prefix of every length, and the torch verifier used by the JAX side
    prefixes = np.array([list(s[:k]) + [0] * (N - k) for s in STRINGS for k in range(N + 1)])
    np.testing.assert_array_equal(np.asarray(ver(prefixes)), ver_t(torch.as_tensor(prefixes)).numpy())
    np.testing.assert_array_equal(np.asarray(ptn.verifiers.as_verifier(ver_t).accepts(prefixes)),
                                  ver_t.accepts(torch.as_tensor(prefixes)).numpy())


def test_the_engines_refuse_what_they_cannot_run(task):
    lm, ver = task
    with pytest.raises(ConfigError, match="guide must be None"):
        ptn.verifiers.TokenwiseRejection(8, N).run(ptn.verifiers.VerifiedLM(lm, ver), ver)
    with pytest.raises(ConfigError, match="one_token_step"):
        ptn.verifiers.VerifierSMC(8, N).run(object())
    with pytest.raises(ConfigError, match="max_tokens=4"):
        ptn.verifiers.RejectionSampling(8, N + 1).run(lm, ver)
    with pytest.raises(ConfigError, match="no length"):
        ptn.verifiers.VerifiedLM(lm, ptn.verifiers.ProcessVerifier(ver.automaton))
    with pytest.raises(UnsatisfiableConstraintError):  # Dyck strings have even length: A is empty for N = 3
        ptn.verifiers.VerifiedLM(lm, ptn.verifiers.ProcessVerifier(ver.automaton, 3))
    with pytest.raises(ConfigError, match="draw"):
        ptn.verifiers.VerifiedLM(lm, ver, draw="tokenwise")


def test_a_users_token_program_runs_through_the_engines(task):
    """Any ptn.Program with one_token_step() is a token-level program: a user's program declaring the same step
    (the LM under the length-N Dyck automaton) gets tokenwise rejection's draws of VerifiedLM, from the same compiled
    run (no compile: the run is keyed by the step's configuration, not by the program object)."""
    from ppl_thought.numpyro.program import OneTokenStep
    from ppl_thought.projections.constraints import length_automaton

    lm, ver = task

    class Brackets(ptn.Program):
        max_steps = N

        def one_token_step(self):
            return OneTokenStep(lm, ptn.dist.TokenRule(length_automaton(ver.automaton, N), V), N, ())

    mine = ptn.verifiers.TokenwiseRejection(3000, N).run(Brackets(), rng_key=1)
    before = ptn.compile_stats()["count"]
    ours = ptn.verifiers.TokenwiseRejection(3000, N).run(Brackets(), rng_key=1)
    assert ptn.compile_stats()["count"] == before
    np.testing.assert_array_equal(np.asarray(mine.samples["z"]), np.asarray(ours.samples["z"]))
    assert _chi2_pvalue(_counts(mine.samples["z"]), Q) > 1e-3
