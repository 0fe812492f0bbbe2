"""A user's own token-level program through every token-level engine, against exact answers (issue 39, item 1).

The program is written here as a user would: a ``pt.Program`` over a ``pt.lm.Tabular`` bigram whose step draws one
token under a hand-built token automaton (strings of exactly T tokens over {a, b, c} with no "cc"; states count the
position, so the automaton is final exactly at T) and weights it by the LM's mass on the admitted tokens. It declares
its step with ``one_token_step()`` and nothing else: no Constrained, no VerifiedLM. Every token-level engine runs it:
``SMC(backend="static")``, RejectionSampling, TokenwiseRejection, VerifierSMC (three proposals),
TokenwiseBacktracking, VGB, greedy and beam search.

Exact answers enumerate every string of T generable tokens under the LM's own law p_O (softmax without <pad> and
<bos>): Z = P_O(A), the restricted law p_O(z) 1(z in A) / Z, tokenwise rejection's locally renormalised law
(Prop 3.1.2), and the argmax of the search score over A. Fixed seeds; laws are checked per string within 4.5
binomial standard errors, Z-hat within 3 to 4 standard errors.
"""

from __future__ import annotations

import itertools

import pyro
import pytest
import torch

import ppl_thought as pt
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.errors import ConfigError
from ppl_thought.program import OneTokenStep
from ppl_thought.projections.automaton import AutomatonBuilder
from ppl_thought.verifiers import (
    VGB,
    ProcessVerifier,
    RejectionSampling,
    TokenwiseBacktracking,
    TokenwiseRejection,
    VerifiedLM,
    VerifierSMC,
)
from ppl_thought.vocab import BOS_ID, PAD_ID

ABC = pt.Vocab(["a", "b", "c"])
A_, B_, C_ = ABC.id("a"), ABC.id("b"), ABC.id("c")
T = 4


def tiny_transformer() -> pt.lm.Transformer:
    torch.manual_seed(0)
    return pt.lm.Transformer(len(ABC), d_model=16, n_layers=1, n_heads=2, max_len=16).requires_grad_(False)


def bigram() -> pt.lm.Tabular:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(len(ABC), len(ABC), generator=g)
    logits[:, 2:ABC.num_specials] -= 1.5  # <eos> and the other specials: possible but less likely
    return pt.lm.Tabular(2, len(ABC), logits=logits, trainable=False)


def no_cc(positions: int | None):
    """The token automaton of "no two c in a row" over {a, b, c}: with ``positions`` it also counts the tokens and is
    final exactly after that many; without, two states, both final."""
    b = AutomatonBuilder(len(ABC), "no_cc")
    if positions is None:
        free, after_c = b.add_state(final=True), b.add_state(final=True)
        b.edge(free, [A_, B_], free)
        b.edge(after_c, [A_, B_], free)
        b.edge(free, [C_], after_c)
        return b.build()
    st = {(i, c): b.add_state(final=i == positions) for i in range(positions + 1) for c in (0, 1)}
    for i in range(positions):
        for c in (0, 1):
            b.edge(st[i, c], [A_, B_], st[i + 1, 0])
            if not c:
                b.edge(st[i, c], [C_], st[i + 1, 1])
    return b.build(start=st[0, 0])


class NoDoubleC(pt.Program):
    """A user's token-level program: p_O(z) 1[z in A], A = {a, b, c}^T without "cc", one token per step."""

    def __init__(self, lm, max_tokens: int = T):
        self.lm, self.max_tokens, self.max_steps = lm, max_tokens, max_tokens
        self.rule = TokenRule(no_cc(max_tokens), lm.vocab_size)

    def one_token_step(self) -> OneTokenStep:
        return OneTokenStep(self.lm, self.rule, self.max_tokens, stop_ids=())  # the default weight: log Z_t

    def init(self, state, prompt=None):
        state["x"] = LMState.start(self.lm, pt.particles(), prompt=prompt, rule=self.rule, max_len=self.max_tokens,
                                   stop_ids=torch.zeros(0, dtype=torch.long))

    def step(self, state, t, prompt=None):
        x = state["x"]
        log_z = self.one_token_step().mass(x.logits, x.s, x.done)
        tok = pyro.sample(f"x_{t}", x.next_token())
        x.extend(tok)
        pyro.factor(f"mass_{t}", log_z)
        return torch.ones_like(x.done) if t + 1 == self.max_tokens else x.done.clone()


# ---------------------------------------------------------------------------------------------- exact answers
def strings() -> torch.Tensor:
    """Every string of T generable tokens (all ids but <pad> and <bos>) ``[7^T, T]``."""
    gen = [i for i in range(len(ABC)) if i not in (PAD_ID, BOS_ID)]
    return torch.tensor(list(itertools.product(gen, repeat=T)))


def in_a(S: torch.Tensor) -> torch.Tensor:
    letters = (S >= A_).all(1)
    cc = ((S[:, 1:] == C_) & (S[:, :-1] == C_)).any(1)
    return letters & ~cc


def next_logits(lm, S: torch.Tensor) -> torch.Tensor:
    """``[K, T, V]`` the LM's next-token logits before each token of the strings ``S`` (one teacher-forced pass)."""
    with torch.no_grad():
        logits, _ = lm(torch.cat([torch.full((len(S), 1), BOS_ID), S], 1))
    return logits[:, :-1].double()


def step_log_probs(lm, S: torch.Tensor, full: bool = False) -> torch.Tensor:
    """``[K, T]`` log p(z_t | z_<t): the LM's own law (softmax without <pad> and <bos>), or with ``full`` the search's
    "model" score (the log-softmax over the whole row)."""
    logits = next_logits(lm, S)
    if not full:
        logits[..., PAD_ID] = logits[..., BOS_ID] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, S[..., None])[..., 0]


def exact(lm):
    S = strings()
    ok = in_a(S)
    lp = step_log_probs(lm, S).sum(1)
    A, lpA = S[ok], lp[ok]
    log_z = float(torch.logsumexp(lpA, 0))
    return A, torch.exp(lpA - log_z), log_z


def tokenwise_law(lm, A: torch.Tensor) -> torch.Tensor:
    """q(z) = prod_t p(z_t | z_<t) / Z_t(z_<t), Z_t the mass of the admitted next tokens (Prop 3.1.2)."""
    logits = next_logits(lm, A)
    logits[..., PAD_ID] = logits[..., BOS_ID] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    admitted = torch.zeros_like(lp, dtype=torch.bool)
    admitted[..., [A_, B_]] = True
    admitted[..., C_] = torch.cat([torch.ones(len(A), 1, dtype=torch.bool), A[:, :-1] != C_], 1)
    log_zt = torch.logsumexp(lp.masked_fill(~admitted, float("-inf")), -1)
    return (lp.gather(-1, A[..., None])[..., 0] - log_zt).sum(1).exp()


def check_law(samples: torch.Tensor, A: torch.Tensor, probs: torch.Tensor, what: str, k: float = 4.5) -> None:
    n = samples.shape[0]
    match = (samples[:, None, :] == A[None]).all(-1)  # [n, |A|]
    assert bool(match.any(1).all()), f"{what}: samples outside A"
    freq = match.double().mean(0)
    se = torch.sqrt(probs * (1 - probs) / n) + 1.0 / n
    worst = float(((freq - probs).abs() / se).max())
    assert worst < k, f"{what}: a string's frequency is {worst:.1f} standard errors from its exact probability"


@pytest.fixture(scope="module")
def setup():
    lm = bigram()
    A, probs, log_z = exact(lm)
    return lm, NoDoubleC(lm), A, probs, log_z


def test_the_exact_answers_are_those_of_the_users_own_program(setup):
    """The generic engine on the user's program (its own Pyro step): log Z-hat within 4 SE of log P_O(A)."""
    lm, program, A, probs, log_z = setup
    assert len(A) == 60 and 0.05 < float(torch.tensor(log_z).exp()) < 0.9
    torch.manual_seed(0)
    res = pt.infer.SMC(4000, ess_threshold=0.0).run(program, None)
    assert abs(float(res.log_marginal) - log_z) < 4 * float(res.log_marginal_stderr)


# ---------------------------------------------------------------------------------------------- static SMC
def test_static_smc_runs_the_users_program():
    """The static backend needs a static KV cache (a Transformer): the same user program over a tiny Transformer."""
    lm = tiny_transformer()
    program = NoDoubleC(lm)
    A, probs, log_z = exact(lm)
    torch.manual_seed(1)
    res = pt.infer.SMC(4000, backend="static", ess_threshold=0.0).run(program, None)
    assert res.stats["mode"] == "static"
    assert abs(float(res.log_marginal) - log_z) < 4 * float(res.log_marginal_stderr)
    # with resampling: Z-hat unbiased over seeds (mean within 3 SE of Z)
    z = []
    for seed in range(40):
        torch.manual_seed(100 + seed)
        z.append(float(pt.infer.SMC(64, backend="static", ess_threshold=0.9).run(program, None).log_marginal))
    ratio = torch.tensor(z, dtype=torch.float64).sub(log_z).exp()
    assert abs(float(ratio.mean()) - 1) < 3 * float(ratio.std()) / len(z) ** 0.5 + 1e-3


# ---------------------------------------------------------------------------------------------- verifier engines
def test_rejection_sampling_draws_the_restricted_law(setup):
    lm, program, A, probs, _ = setup
    torch.manual_seed(2)
    res = RejectionSampling(3000, T, batch_size=4096).run(program)
    check_law(res.samples["z"], A, probs, "RejectionSampling")
    assert res.stats["lm_calls"] == T * res.stats["strings_generated"]


def test_tokenwise_rejection_draws_the_locally_renormalised_law(setup):
    lm, program, A, probs, _ = setup
    torch.manual_seed(3)
    z = TokenwiseRejection(3000, T).run(program).samples["z"]
    q = tokenwise_law(lm, A)
    check_law(z, A, q, "TokenwiseRejection")
    assert float((q - probs).abs().sum()) > 0.05  # the two laws differ (Prop 3.1.2): the check can tell


@pytest.mark.parametrize("proposal", ["lm", "masked", "rejection"])
def test_verifier_smc_estimates_z_and_weights_the_restricted_law(setup, proposal):
    lm, program, A, probs, log_z = setup
    zs, first = [], []
    for seed in range(30):
        res = VerifierSMC(200, T, proposal=proposal).run(program, None, generator=torch.Generator().manual_seed(seed))
        zs.append(float(res.log_marginal))
        w = torch.softmax(res.log_weights.double(), 0)
        first.append(float(w[res.samples["z"][:, 0] == C_].sum()))
        assert in_a(res.samples["z"][res.log_weights > float("-inf")]).all()
    ratio = torch.tensor(zs, dtype=torch.float64).sub(log_z).exp()
    assert abs(float(ratio.mean()) - 1) < 3 * float(ratio.std()) / len(zs) ** 0.5 + 1e-3
    exact_first = float(probs[A[:, 0] == C_].sum())
    f = torch.tensor(first)
    assert abs(float(f.mean()) - exact_first) < 4 * float(f.std()) / len(first) ** 0.5 + 0.01


def test_verifier_smc_on_the_users_program_is_the_sugar_on_the_same_language(setup):
    """run(lm, verifier) builds VerifiedLM, whose one_token_step() has the verifier's automaton (x position) as its
    rule: the same language as the user's program, so the same draws and weights from the same generator."""
    lm, program, A, probs, log_z = setup
    ver = ProcessVerifier(no_cc(None), length=T)
    a = VerifierSMC(300, T).run(program, None, generator=torch.Generator().manual_seed(4))
    b = VerifierSMC(300, T).run(lm, ver, None, torch.Generator().manual_seed(4))
    assert torch.equal(a.samples["z"], b.samples["z"]) and torch.allclose(a.log_weights, b.log_weights)


def test_backtracking_without_quota_is_the_lm_and_with_quota_moves_into_a(setup):
    """Algorithm 1 with quota 0 samples O itself (exact law of the first and last tokens); with a quota and the
    program's own rule as the process verifier (guide=None) more samples land in A."""
    lm, program, A, probs, _ = setup
    torch.manual_seed(5)
    plain = TokenwiseBacktracking(4000, T, quota=0).run(program).samples["z"]
    S = strings()
    lp = step_log_probs(lm, S).sum(1).exp()
    for col in (0, T - 1):
        vals = S[:, col].unique()
        exact_m = torch.stack([lp[S[:, col] == v].sum() for v in vals])
        check_law(plain[:, col:col + 1], vals[:, None], exact_m, f"backtracking quota 0, token {col}")
    torch.manual_seed(5)
    res = TokenwiseBacktracking(4000, T, quota=4, stride=1).run(program)
    assert float(in_a(res.samples["z"]).double().mean()) > float(in_a(plain).double().mean()) + 0.1
    assert res.stats["verifier_calls"] > 0


def test_vgb_samples_the_restricted_law(setup):
    lm, program, A, probs, _ = setup
    torch.manual_seed(6)
    res = VGB(2000, T, num_steps=60).run(program)
    check_law(res.samples["z"], A, probs, "VGB", k=5.0)


# ---------------------------------------------------------------------------------------------- search
def test_greedy_and_beam_search_find_the_exact_argmax(setup):
    lm, program, A, probs, _ = setup
    score = step_log_probs(lm, A, full=True).sum(1)  # the "model" score of every string of A
    beam = pt.infer.beam_search(program, None, width=len(A))
    assert torch.equal(beam.tokens[0], A[int(score.argmax())])
    assert torch.allclose(beam.log_prob.double(), score.sort(descending=True).values[: len(beam.log_prob)], atol=1e-4)
    assert bool(beam.finished.all())
    # greedy: the stepwise argmax of the admitted tokens
    path: list[int] = []
    for _ in range(T):
        admitted = [A_, B_] + ([] if path and path[-1] == C_ else [C_])
        row = next_logits(lm, torch.tensor([path + [A_]]))[0, -1]
        path.append(admitted[int(row[admitted].argmax())])
    g = pt.infer.greedy(program, None)
    assert g.tokens[0].tolist() == path
    # the same searches on VerifiedLM (its rule: the verifier's automaton) and through the sugar
    ver_prog = VerifiedLM(lm, ProcessVerifier(no_cc(None), length=T))
    assert torch.equal(pt.infer.beam_search(ver_prog, None, width=len(A)).tokens[0], beam.tokens[0])
    sugar = pt.infer.greedy(lm, None, constraint=no_cc(T), max_new_tokens=T)
    assert sugar.tokens[0].tolist() == path


# ---------------------------------------------------------------------------------------------- refusals
class NotTokenLevel(pt.Program):
    def step(self, state, t):
        return None


@pytest.mark.parametrize("engine", ["static", "rejection", "tokenwise", "vsmc", "backtracking", "vgb", "greedy",
                                    "beam"])
def test_a_program_without_one_token_step_is_refused_naming_it(engine):
    run = {
        "static": lambda p: pt.infer.SMC(8, backend="static").run(p, None),
        "rejection": lambda p: RejectionSampling(8, T).run(p),
        "tokenwise": lambda p: TokenwiseRejection(8, T).run(p),
        "vsmc": lambda p: VerifierSMC(8, T).run(p),
        "backtracking": lambda p: TokenwiseBacktracking(8, T).run(p),
        "vgb": lambda p: VGB(8, T, 4).run(p),
        "greedy": lambda p: pt.infer.greedy(p, None),
        "beam": lambda p: pt.infer.beam_search(p, None),
    }[engine]
    with pytest.raises(ConfigError, match=r"NotTokenLevel\.one_token_step\(\)"):
        run(NotTokenLevel())


def test_engines_with_their_own_proposal_refuse_a_guide(setup):
    lm, program, *_ = setup
    for run in (lambda: RejectionSampling(8, T).run(program, program), lambda: VerifierSMC(8, T).run(program, program),
                lambda: pt.infer.greedy(program, program)):
        with pytest.raises(ConfigError, match="guide must be None"):
            run()
    with pytest.raises(ConfigError, match="max_tokens=4"):
        TokenwiseRejection(8, T + 1).run(program)
