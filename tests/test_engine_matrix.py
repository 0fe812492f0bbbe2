"""Every engine the library exports, on a user's own programs, against exact answers (issue 39, item 5).

The claim of README.md and docs/programs.md is "every engine takes a program". This file holds it to that: it
enumerates the names exported by ``pt.infer``, ``pt.verifiers`` and ``ptn.infer``, and every name is either an
engine with cells here (each cell runs it on a program written in this file or in tests/test_token_programs.py,
the way a user writes one, and compares with an exact answer), an engine that does not take programs yet
(``NOT_ON_PROGRAMS``: a test that runs it on a program and expects it to fail, so the entry must go once it runs,
and the docs list it apart), or not an engine (``NOT_ENGINES``, with the reason). A new export that is none of
these fails ``test_every_export_is_accounted_for``.

Programs:
* ``PlanThenAnswer`` (torch) / ``JaxPlanThenAnswer``: a plan z ~ Bernoulli(0.3), a question q ~ Cat(Q[z])
  (observed) and an answer a ~ Cat(A[z]) (observed, or an output the program draws). Exact: log p(q, a) and the
  predictive p(a | q), by enumerating z.
* ``NoDoubleC`` (tests/test_token_programs.py): a token-level program (one token of a bigram per step under a
  token automaton). Exact: P_O(A), the restricted law, the locally renormalised law, the argmax, by enumerating
  all strings.
* ``PlanGuide``: a guide program with one learnable logit, trained by ``pt.train.SVI`` (3.25). Exact: the
  posterior p(z | q, a).
* ``GaussianMean`` (torch) / a NumPyro model: mu ~ N(0, 1), y_i ~ N(mu, 0.5) observed. Exact: the conjugate
  posterior.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import pathlib

import pyro
import pyro.distributions as dist
import pytest
import torch

import ppl_thought as pt
import ppl_thought.verifiers as ptv

ROOT = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("token_programs", ROOT / "test_token_programs.py")
TP = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TP)

PLAN = 0.3
Q_LOGITS = torch.tensor([[1.0, 0.0, -1.0], [-1.0, 0.5, 1.5]])  # q | z
A_LOGITS = torch.tensor([[2.0, 0.0, -2.0], [-1.0, 1.0, 0.0]])  # a | z
Q_OBS, A_OBS = 2, 0


def exact_plan_then_answer() -> tuple[float, torch.Tensor]:
    """(log p(q, a), p(a' | q) for a' in 0..2), by enumerating the plan z."""
    prior = torch.tensor([1 - PLAN, PLAN], dtype=torch.float64).log()
    lq = torch.log_softmax(Q_LOGITS.double(), -1)[:, Q_OBS]
    la = torch.log_softmax(A_LOGITS.double(), -1)
    log_joint = prior + lq + la[:, A_OBS]
    post_z = torch.softmax(prior + lq, 0)
    return float(torch.logsumexp(log_joint, 0)), (post_z[:, None] * la.exp()).sum(0)


class PlanThenAnswer(pt.Program):
    """A user's program: plan, question, answer; ``answer=None`` makes the answer an output."""

    max_steps = 1

    def step(self, state, t, question, answer=None):
        n = pt.particles()
        z = pt.sample("plan", dist.Bernoulli(torch.full((n,), PLAN))).long()
        pt.observe("question", dist.Categorical(logits=Q_LOGITS[z]), question.expand(n))
        pt.observe("answer", dist.Categorical(logits=A_LOGITS[z]), None if answer is None else answer.expand(n))
        return torch.ones(n, dtype=torch.bool)

    def output_values(self, *args, **kwargs) -> torch.Tensor:  # protocol method: the order of the answer's law
        return torch.arange(3)


Y = torch.tensor([0.8, 1.4, 0.3])
SIGMA = 0.5


def gaussian_posterior() -> tuple[float, float]:
    prec = 1.0 + len(Y) / SIGMA**2
    return float(Y.sum() / SIGMA**2 / prec), 1.0 / math.sqrt(prec)


class GaussianMean(pt.Program):
    """A user's program with a continuous latent: mu ~ N(0, 1), y_i ~ N(mu, sigma) observed (one step)."""

    max_steps = 1

    def step(self, state, t, y):
        n = pt.particles()
        mu = pt.sample("mu", dist.Normal(torch.zeros(n), 1.0))
        pt.factor("y", dist.Normal(mu[:, None], SIGMA).log_prob(y).sum(-1))
        return torch.ones(n, dtype=torch.bool)


def _within(estimate, exact: float, se: float, k: float = 4.0, what: str = "") -> None:
    assert abs(float(estimate) - exact) < k * se + 1e-9, f"{what}: {float(estimate):.4f} vs exact {exact:.4f} (SE {se})"


# ---------------------------------------------------------------------------------------------- torch cells
def importance_general():
    log_z, _ = exact_plan_then_answer()
    torch.manual_seed(0)
    res = pt.infer.Importance(4000).run(PlanThenAnswer(), None, torch.tensor(Q_OBS), torch.tensor(A_OBS))
    _within(res.log_marginal, log_z, float(res.log_marginal_stderr), what="Importance")


def importance_token(setup):
    lm, program, A, probs, log_z = setup
    torch.manual_seed(1)
    res = pt.infer.Importance(4000).run(program, None)
    _within(res.log_marginal, log_z, float(res.log_marginal_stderr), what="Importance on NoDoubleC")


def smc_general():
    log_z, _ = exact_plan_then_answer()
    zs = []
    for seed in range(20):
        torch.manual_seed(seed)
        zs.append(float(pt.infer.SMC(256).run(PlanThenAnswer(), None, torch.tensor(Q_OBS),
                                              torch.tensor(A_OBS)).log_marginal))
    ratio = torch.tensor(zs, dtype=torch.float64).sub(log_z).exp()  # Z-hat / Z: unbiased, mean 1
    _within(ratio.mean(), 1.0, float(ratio.std()) / math.sqrt(len(zs)), k=3.0, what="SMC Z-hat / Z")


def decode_general():
    _, pred = exact_plan_then_answer()
    torch.manual_seed(2)
    out = pt.infer.decode(PlanThenAnswer(), None, torch.tensor(Q_OBS), method="resampling", n=64, num_samples=2000)
    a = out.outputs["answer"].reshape(-1)
    freq = torch.stack([(a == v).double().mean() for v in range(3)])
    se = (pred * (1 - pred) / len(a)).sqrt()
    assert float(((freq - pred).abs() / se).max()) < 4.5, (freq, pred)


def next_token_distribution_general():
    _, pred = exact_plan_then_answer()
    torch.manual_seed(3)
    law = pt.infer.next_token_distribution(PlanThenAnswer(), None, torch.tensor(Q_OBS), n=2000)
    assert torch.allclose(law.double(), pred, atol=0.05), (law, pred)


def langevin_general():
    mean, sd = gaussian_posterior()
    res = pt.infer.Langevin(num_steps=600, warmup_steps=200, num_chains=2, seed=0).run(GaussianMean(), None, Y)
    mu = res.samples["mu"].flatten()
    assert abs(float(mu.mean()) - mean) < 0.1 and abs(float(mu.std()) - sd) < 0.08, (float(mu.mean()), mean)


class PlanGuide(pt.Program):
    """A user's guide program for PlanThenAnswer: the plan from a Bernoulli with one learnable logit."""

    max_steps = 1

    def step(self, state, t, question, answer=None):
        logit = pyro.param("plan_logit", torch.tensor(0.0))
        pt.sample("plan", dist.Bernoulli(logits=logit.expand(pt.particles())))
        return torch.ones(pt.particles(), dtype=torch.bool)


def svi_general():
    """pt.train.SVI with the sampler objective (3.25) trains the guide to the exact posterior p(z | q, a), where
    the weights are constant: log Z-hat = log p(q, a) with zero spread."""
    log_z, _ = exact_plan_then_answer()
    prior = torch.tensor([1 - PLAN, PLAN], dtype=torch.float64).log()
    log_joint = prior + torch.log_softmax(Q_LOGITS.double(), -1)[:, Q_OBS] + torch.log_softmax(A_LOGITS.double(),
                                                                                                 -1)[:, A_OBS]
    post = float(torch.softmax(log_joint, 0)[1])
    pyro.clear_param_store()
    torch.manual_seed(0)
    res = pt.train.SVI(pt.train.SamplerPolicyGradient(32), {"lr": 0.1}).run(
        PlanThenAnswer(), PlanGuide(), torch.tensor(Q_OBS), torch.tensor(A_OBS), num_steps=300)
    got = float(torch.sigmoid(pyro.param("plan_logit").detach()))
    pyro.clear_param_store()
    assert abs(got - post) < 0.02, (got, post)
    assert abs(float(res.log_marginal) - log_z) < 0.01


def _token(name: str) -> str:
    """A cell that lives in tests/test_token_programs.py (run there, once per suite run; checked to exist here):
    the engine on the user's token-level program against its exact answer."""
    return f"test_token_programs.py::{name}"


TORCH_CELLS = {
    "pt.infer.Importance": [importance_general, importance_token],
    "pt.infer.SMC": [smc_general, _token("test_the_exact_answers_are_those_of_the_users_own_program"),
                     _token("test_static_smc_runs_the_users_program")],
    "pt.infer.decode": [decode_general],
    "pt.infer.next_token_distribution": [next_token_distribution_general],
    "pt.infer.Langevin": [langevin_general],
    "pt.train.SVI": [svi_general],
    "pt.infer.greedy": [_token("test_greedy_and_beam_search_find_the_exact_argmax")],
    "pt.infer.beam_search": [_token("test_greedy_and_beam_search_find_the_exact_argmax")],
    "pt.verifiers.RejectionSampling": [_token("test_rejection_sampling_draws_the_restricted_law")],
    "pt.verifiers.TokenwiseRejection": [_token("test_tokenwise_rejection_draws_the_locally_renormalised_law")],
    "pt.verifiers.VerifierSMC": [_token("test_verifier_smc_estimates_z_and_weights_the_restricted_law")],
    "pt.verifiers.TokenwiseBacktracking": [
        _token("test_backtracking_without_quota_is_the_lm_and_with_quota_moves_into_a")],
    "pt.verifiers.VGB": [_token("test_vgb_samples_the_restricted_law")],
}

NOT_ENGINES = {
    "pt.infer.LangevinKernel": "the Pyro MCMC kernel that pt.infer.Langevin runs (its cells cover it)",
    "pt.infer.Decoded": "the result type of decode",
    "pt.infer.Result": "the result type of every engine",
    "pt.infer.save_result": "file I/O of a Result",
    "pt.infer.load_result": "file I/O of a Result",
    "pt.infer.resample": "the resampler (an engine's part, tested against its exact law in test_smc.py)",
    "pt.infer.RESAMPLING": "the resampling schemes' names",
    "pt.verifiers.LinearProbeVerifier": "a verifier (thesis Section 3.2.1.2), an argument of the engines",
    "pt.verifiers.ProcessVerifier": "a verifier (Def 3.1.3), an argument of the engines",
    "pt.verifiers.TabularValue": "a value function, VGB's argument",
    "pt.verifiers.VerifiedLM": "a program (the LM restricted to a verifier's set): the engines' input",
    "pt.verifiers.LocallyOptimalProposal": "a guide program (VerifierSMC's proposal)",
    "pt.verifiers.WeightedRejectionProposal": "a guide program (VerifierSMC's proposal)",
    "pt.verifiers.TokenSteps": "the guide program VerifierSMC builds from any token-level program",
    "pt.verifiers.NextToken": "a distribution (one token of an LM)",
    "pt.verifiers.dyck": "builds a Dyck automaton",
    "pt.verifiers.first_errors": "a helper of the trained verifier",
    "pt.verifiers.length_automaton": "builds an automaton",
    "pt.verifiers.verifier_factor": "a program verb (the verifier's factor)",
    "ptn.infer.Result": "the result type of every engine",
    "ptn.infer.Decoded": "the result type of decode",
    "ptn.infer.LangevinState": "the state type of MALA / ULA",
    "ptn.infer.log_marginal_stderr": "a statistic of weights",
    "ptn.verifiers.ProcessVerifier": "a verifier (Def 3.1.3), an argument of the engines",
    "ptn.verifiers.as_verifier": "wraps a verifier for the engines",
    "ptn.verifiers.VerifiedLM": "a program (the LM restricted to a verifier's set): the engines' input",
    "ptn.verifiers.LocallyOptimalProposal": "a guide program (VerifierSMC's proposal)",
    "ptn.verifiers.TokenSteps": "the guide program VerifierSMC builds from any token-level program",
    "ptn.verifiers.DRAWS": "VerifiedLM's draw modes' names",
    "ptn.verifiers.dyck": "builds a Dyck automaton",
}


@pytest.fixture(scope="module")
def token_setup():
    lm = TP.bigram()
    A, probs, log_z = TP.exact(lm)
    return lm, TP.NoDoubleC(lm), A, probs, log_z


def _exports() -> set[str]:
    names = {f"pt.infer.{n}" for n in pt.infer.__all__} | {f"pt.verifiers.{n}" for n in ptv.__all__}
    names.add("pt.train.SVI")  # the SVI engine (pt.train's other names are its objectives)
    try:
        import ppl_thought.numpyro.infer as ni
    except ImportError:  # the torch side alone
        return names
    import ppl_thought.numpyro.verifiers as nv

    return names | {f"ptn.infer.{n}" for n in ni.__all__} | {f"ptn.verifiers.{n}" for n in nv.__all__}


def test_every_export_is_accounted_for():
    """Each exported name is an engine with cells, a listed gap, or not an engine (and nothing listed is stale)."""
    listed = set(TORCH_CELLS) | set(JAX_CELLS) | set(NOT_ON_PROGRAMS) | set(NOT_ENGINES)
    exported = _exports()
    assert exported - listed == set(), f"exported engines without a matrix entry: {sorted(exported - listed)}"
    assert listed - exported == set(), f"matrix entries for names no longer exported: {sorted(listed - exported)}"
    assert not (set(TORCH_CELLS) | set(JAX_CELLS)) & set(NOT_ON_PROGRAMS)


@pytest.mark.parametrize("engine,i", [(e, i) for e, cells in TORCH_CELLS.items() for i in range(len(cells))])
def test_torch_engine_on_user_programs(engine, i, token_setup):
    cell = TORCH_CELLS[engine][i]
    if isinstance(cell, str):  # lives in test_token_programs.py: it must be a test there, which that file runs
        fn = getattr(TP, cell.split("::")[1], None)
        assert callable(fn) and fn.__name__.startswith("test_"), f"{engine}: no cell {cell}"
        return
    cell(token_setup) if inspect.signature(cell).parameters else cell()


# ---------------------------------------------------------------------------------------------- JAX cells
def _jax():
    jax = pytest.importorskip("jax")
    pytest.importorskip("numpyro")
    import jax.numpy as jnp
    import numpyro.distributions as nd

    import ppl_thought.numpyro as ptn

    return jax, jnp, nd, ptn


def _jax_program():
    jax, jnp, nd, ptn = _jax()

    class JaxPlanThenAnswer(ptn.Program):
        max_steps = 1

        def step(self, state, t, question, answer):
            n = ptn.particles()
            z = ptn.sample("plan", nd.Bernoulli(jnp.full((n,), PLAN))).astype(jnp.int32)
            ptn.observe("question", nd.Categorical(logits=jnp.asarray(Q_LOGITS.numpy())[z]), question)
            ptn.observe("answer", nd.Categorical(logits=jnp.asarray(A_LOGITS.numpy())[z]), answer)
            return jnp.ones(n, bool)

    return JaxPlanThenAnswer()


def jax_importance_general():
    jax, jnp, nd, ptn = _jax()
    log_z, _ = exact_plan_then_answer()
    res = ptn.infer.Importance(4000).run(_jax_program(), None, jnp.int32(Q_OBS), jnp.int32(A_OBS), rng_key=0)
    _within(res.log_marginal, log_z, float(res.log_marginal_stderr), what="ptn Importance")


def jax_smc_general():
    jax, jnp, nd, ptn = _jax()
    log_z, _ = exact_plan_then_answer()
    prog = _jax_program()
    zs = [float(ptn.infer.SMC(256).run(prog, None, jnp.int32(Q_OBS), jnp.int32(A_OBS), rng_key=s).log_marginal)
          for s in range(20)]
    ratio = torch.tensor(zs, dtype=torch.float64).sub(log_z).exp()
    _within(ratio.mean(), 1.0, float(ratio.std()) / math.sqrt(len(zs)), k=3.0, what="ptn SMC Z-hat / Z")


def jax_decode_general():
    """ptn.infer.decode (3.14) on the user's plan-then-answer program whose answer is an output: the decoded
    answers follow the exact predictive law p(answer | question) (the torch cell's check)."""
    jax, jnp, nd, ptn = _jax()
    _, pred = exact_plan_then_answer()

    class JaxPlanThenAnswerOut(ptn.Program):
        max_steps = 1

        def step(self, state, t, question):
            n = ptn.particles()
            z = ptn.sample("plan", nd.Bernoulli(jnp.full((n,), PLAN))).astype(jnp.int32)
            ptn.observe("question", nd.Categorical(logits=jnp.asarray(Q_LOGITS.numpy())[z]), question)
            ptn.observe("answer", nd.Categorical(logits=jnp.asarray(A_LOGITS.numpy())[z]), None)
            return jnp.ones(n, bool)

    out = ptn.infer.decode(JaxPlanThenAnswerOut(), None, jnp.int32(Q_OBS), method="resampling", n=64,
                           num_samples=2000, rng_key=2)
    a = torch.as_tensor(jax.device_get(out.outputs["answer"]).tolist()).reshape(-1)
    freq = torch.stack([(a == v).double().mean() for v in range(3)])
    se = (pred * (1 - pred) / len(a)).sqrt()
    assert float(((freq - pred).abs() / se).max()) < 4.5, (freq, pred)


def _mala_on_program(kernel: str):
    """MALA / ULA on a program with a continuous latent (its whole trace is the potential): the conjugate
    posterior's mean within 0.1 and sd within 0.08."""
    jax, jnp, nd, ptn = _jax()
    from numpyro.infer import MCMC

    class JaxGaussianMean(ptn.Program):
        max_steps = 1

        def step(self, state, t, y):
            n = ptn.particles()
            mu = ptn.sample("mu", nd.Normal(jnp.zeros(n), 1.0))
            ptn.factor("y", nd.Normal(mu[:, None], SIGMA).log_prob(y).sum(-1))
            return jnp.ones(n, bool)

    mcmc = MCMC(getattr(ptn.infer, kernel)(JaxGaussianMean()), num_warmup=200, num_samples=600, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), jnp.asarray(Y.numpy()))
    mu = torch.as_tensor(mcmc.get_samples()["mu"].tolist()).flatten()
    mean, sd = gaussian_posterior()
    assert abs(float(mu.mean()) - mean) < 0.1 and abs(float(mu.std()) - sd) < 0.08, (kernel, float(mu.mean()))


def _jax_plan_guide():
    jax, jnp, nd, ptn = _jax()
    import numpyro

    class JaxPlanGuide(ptn.Program):
        max_steps = 1

        def step(self, state, t, question, answer):
            logit = numpyro.param("plan_logit", jnp.zeros(()))
            ptn.sample("plan", nd.Bernoulli(logits=jnp.broadcast_to(logit, (ptn.particles(),))))
            return jnp.ones(ptn.particles(), bool)

    return JaxPlanGuide()


def _svi_on_program(loss: str, tol: float):
    """numpyro.infer.SVI(program, guide program, Adam, loss) trains the guide to the exact posterior p(z | q, a)."""
    jax, jnp, nd, ptn = _jax()
    import numpyro
    from numpyro.infer import SVI

    prior = torch.tensor([1 - PLAN, PLAN], dtype=torch.float64).log()
    log_joint = prior + torch.log_softmax(Q_LOGITS.double(), -1)[:, Q_OBS] + torch.log_softmax(A_LOGITS.double(),
                                                                                                 -1)[:, A_OBS]
    post = float(torch.softmax(log_joint, 0)[1])
    svi = SVI(_jax_program(), _jax_plan_guide(), numpyro.optim.Adam(0.1 if loss != "ELBO" else 0.05),
              getattr(ptn.infer, loss)(32))
    res = svi.run(jax.random.PRNGKey(0), 300, jnp.int32(Q_OBS), jnp.int32(A_OBS), progress_bar=False)
    got = float(jax.nn.sigmoid(res.params["plan_logit"]))
    assert abs(got - post) < tol, (loss, got, post)


def _objectives(name: str, file: str = "test_numpyro_objectives.py"):
    """A cell that lives in ``tests/{file}`` (run there): the loss on the user's program or on the enumerable
    problem against its exact expectation; checked to exist here."""

    def cell():
        text = (ROOT / file).read_text()
        assert f"def {name}(" in text, f"no cell {name} in {file}"

    cell.__name__ = name
    return cell


_MORE, _ACTIVE = "test_numpyro_objectives_more.py", "test_numpyro_objectives_active.py"
_ACTIVE_INF = "test_numpyro_active_inference.py"
_VERIF = "test_numpyro_verifiers.py"
JAX_CELLS = {
    "ptn.infer.Importance": [jax_importance_general],
    "ptn.infer.SMC": [jax_smc_general],
    "ptn.infer.MALA": [lambda: _mala_on_program("MALA")],
    "ptn.infer.ULA": [lambda: _mala_on_program("ULA")],
    "ptn.infer.ELBO": [lambda: _svi_on_program("ELBO", 0.05)],
    "ptn.infer.SamplerPolicyGradient": [lambda: _svi_on_program("SamplerPolicyGradient", 0.02)],
    "ptn.infer.OneSampler": [_objectives("test_one_and_two_sampler_are_unbiased_for_the_marginal_gradient_with_the_"
                                         "exact_sampler")],
    "ptn.infer.TwoSampler": [_objectives("test_two_sampler_surrogate_draws_both_batches_from_programs")],
    "ptn.infer.R1Zero": [_objectives("test_r1zero_with_and_without_baseline_against_the_exact_expectations")],
    "ptn.infer.GRPO": [_objectives("test_grpo_gradient_matches_the_formula_written_by_hand")],
    "ptn.infer.decode": [jax_decode_general],
    "ptn.infer.SFT": [_objectives("test_sft_on_guide_samples_is_unbiased_for_the_expected_nll_and_does_not_train_the_"
                                  "guide", _MORE)],
    "ptn.infer.Sum": [_objectives("test_sum_is_the_weighted_sum_of_the_exact_targets", _MORE)],
    "ptn.infer.SeparatePolicy": [_objectives("test_separate_policy_is_unbiased_for_the_policy_gradient_and_matches_"
                                             "the_sampler_formula", _MORE)],
    "ptn.infer.Inquisitive": [_objectives("test_inquisitive_is_unbiased_for_the_reverse_kl_to_the_inquisitive_"
                                          "sampler_and_equals_torch", _MORE)],
    **{f"ptn.infer.{name}": [_objectives("test_active_losses_are_unbiased_for_the_enumerated_objective", _ACTIVE)]
       for name in ("ActiveLifting", "MinimumLengthCoding", "GeneratorLoss", "ActiveGenerative")},
    "ptn.infer.ConditionalSamplerLoss": [_objectives("test_conditional_sampler_loss_is_the_enumerated_cross_entropy",
                                                     _ACTIVE)],
    # active lifting inference (6.17)-(6.22) on an ActiveLift (its model is the lift, not a ptn.Program)
    "ptn.infer.encode": [_objectives("test_encode_is_exactly_unbiased_and_equals_torch_on_the_same_particles",
                                     _ACTIVE_INF), _objectives("test_encode_compiled_runs_draw_from_q_and_reuse_one_"
                                                               "compile", _ACTIVE_INF)],
    "ptn.infer.conditional_encode": [_objectives("test_conditional_encode_is_consistent_and_its_weights_equal_torch",
                                                 _ACTIVE_INF)],
    "ptn.infer.conditional_decode": [_objectives("test_conditional_decode_laws_against_enumeration", _ACTIVE_INF)],
    # the JAX verifier engines (ptn.verifiers) on a VerifiedLM and on a user's token-level program, against the
    # enumerated restricted law, the locally renormalised law and Z (and torch's weights on the same draws)
    "ptn.verifiers.RejectionSampling": [_objectives("test_rejection_sampling_has_the_restricted_law", _VERIF)],
    "ptn.verifiers.TokenwiseRejection": [_objectives("test_tokenwise_rejection_has_its_own_biased_law", _VERIF),
                                         _objectives("test_a_users_token_program_runs_through_the_engines", _VERIF)],
    "ptn.verifiers.VerifierSMC": [_objectives("test_verifier_smc_weights_are_exact_and_its_law_is_the_restricted_one",
                                              _VERIF),
                                  _objectives("test_torch_and_jax_give_the_same_weights_and_decisions", _VERIF)],
}

#: engines that do not run a program yet: each is tried on a program and must fail; when one starts to run, its
#: test fails and the engine moves to the cells above (and to the README's list). Empty since issue 40 (SVI losses,
#: MALA / ULA on programs).
NOT_ON_PROGRAMS: dict = {}


@pytest.mark.parametrize("engine,i", [(e, i) for e, cells in JAX_CELLS.items() for i in range(len(cells))])
def test_jax_engine_on_user_programs(engine, i):
    JAX_CELLS[engine][i]()


@pytest.mark.parametrize("engine", sorted(NOT_ON_PROGRAMS))
def test_engines_that_do_not_take_programs_yet(engine):
    """These run NumPyro models, not ``ptn.Program`` s (docs/numpyro.md): a program is refused today."""
    with pytest.raises(Exception):  # noqa: B017 -- whatever the engine raises; the point is that it does not run
        NOT_ON_PROGRAMS[engine]()
