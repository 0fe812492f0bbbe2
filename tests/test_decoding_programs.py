"""Decoding over any ``pt.Program`` (the prompt is what it observes, the continuation its output sites) against the
exact predictive law computed by enumeration, for two user-written programs:

* ``QuestionThoughtAnswer``: question (observed) -> thought (latent, 3 values) -> answer tokens (the first one
  observed, the next ones outputs, ``<eos>`` = 2 ends the answer);
* ``HMMProgram``: a 3-state HMM whose first 3 observations are the prompt and the last 2 are outputs.

Each method is run with a guide program (deliberately poor: it prefers the thoughts / states the posterior finds
unlikely; the HMM's guide proposes the prompt's states only, the program draws the rest) and with ``guide=None``
(the program proposes). The bounds are those of the theory: Prop 3.1 ((3.12) is exact with the posterior as
guide), Prop 3.3 ((3.14): TV <= sqrt((6 chi2 + 2) / n)), Prop G.2 ((G.1)), plus about two standard deviations of
sampling noise. ``test_wrong_weights_fail`` replaces the weights p/q by uniform ones and shows that the same
checks then fail (the decoder would follow the proposal, not the posterior).
"""

from __future__ import annotations

import itertools
import math

import pyro.distributions as dist
import pytest
import torch

import ppl_thought as pt
from ppl_thought.inference import decoding_program
from ppl_thought.inference.decoding import decode

EOS = 2


# ---------------------------------------------------------------------------------------------- the programs
class QuestionThoughtAnswer(pt.Program):
    """question q -> thought z -> answer tokens a_0 a_1 a_2 (each from PA[z], <eos> = 2 ends the answer)."""

    PQ = torch.tensor([0.5, 0.5])
    PZ = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    PA = torch.tensor([[0.1, 0.8, 0.1], [0.8, 0.1, 0.1], [0.3, 0.3, 0.4]])
    L = 3

    def init(self, state, q, answer):
        state["z"] = torch.zeros(pt.particles(), dtype=torch.long)

    def step(self, state, t, q, answer):
        n = pt.particles()
        if t == 0:
            pt.observe("question", dist.Categorical(self.PQ).expand([n]), q.expand(n))
            state["z"] = pt.sample("thought", dist.Categorical(self.PZ[q]).expand([n]))
            return None
        i = t - 1
        a = pt.observe(f"answer_{i}", dist.Categorical(self.PA[state["z"]]), answer[i].expand(n) if i < len(answer)
                       else None)
        return (a == EOS) | torch.tensor(i + 1 == self.L)

    def enumerate_sites(self, q, answer):
        """Every configuration of the latent and output sites (for method='exact')."""
        outs = [f"answer_{i}" for i in range(len(answer), self.L)]
        rows = list(itertools.product(range(3), *[range(3)] * len(outs)))
        cols = torch.tensor(rows).T
        return {"thought": cols[0], **{o: cols[j + 1] for j, o in enumerate(outs)}}


class ThoughtGuide(pt.Program):
    """Proposes the thought from a fixed table (the prompt's only latent)."""

    def __init__(self, probs):
        self.probs = torch.as_tensor(probs)

    def step(self, state, t, q, answer):
        if t == 0:
            pt.sample("thought", dist.Categorical(self.probs).expand([pt.particles()]))
        return torch.ones(pt.particles(), dtype=torch.bool)


class HMMProgram(pt.Program):
    """z_t ~ A[z_{t-1}], x_t ~ B[z_t] for t < T; x_t is observed for t < len(x) and an output after."""

    A = torch.tensor([[0.8, 0.15, 0.05], [0.1, 0.8, 0.1], [0.05, 0.15, 0.8]])
    B = torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]])
    PI = torch.tensor([1 / 3, 1 / 3, 1 / 3])

    def init(self, state, x, T):
        state["z"] = torch.zeros(pt.particles(), dtype=torch.long)

    def step(self, state, t, x, T):
        n = pt.particles()
        probs = self.PI.expand(n, 3) if t == 0 else self.A[state["z"]]
        z = pt.sample(f"z_{t}", dist.Categorical(probs))
        state["z"] = z
        pt.observe(f"x_{t}", dist.Categorical(self.B[z]), x[t].expand(n) if t < len(x) else None)
        return torch.ones(n, dtype=torch.bool) if t + 1 == T else None

    def enumerate_sites(self, x, T):
        names = [f"z_{t}" for t in range(T)] + [f"x_{t}" for t in range(len(x), T)]
        cols = torch.tensor(list(itertools.product(range(3), repeat=len(names)))).T
        return dict(zip(names, cols))


class HMMPromptGuide(pt.Program):
    """Proposes the prompt's states z_t (t < len(x)) independently from a fixed table; the program draws the rest."""

    def __init__(self, probs):
        self.probs = torch.as_tensor(probs)

    def step(self, state, t, x, T):
        if t < len(x):
            pt.sample(f"z_{t}", dist.Categorical(self.probs).expand([pt.particles()]))
        return torch.ones(pt.particles(), dtype=torch.bool) if t + 1 == T else None


# ---------------------------------------------------------------------------------------------- exact answers
Q_ARGS = (torch.tensor(0), torch.tensor([0]))
H_ARGS = (torch.tensor([1, 1, 1]), 5)


def qta_posterior(q=0, a0=0) -> torch.Tensor:
    m = QuestionThoughtAnswer
    w = m.PZ[q] * m.PA[:, a0]
    return (w / w.sum()).double()


def qta_law(latent: torch.Tensor) -> dict:
    """Law of (answer_1, answer_2) (None: not drawn, the answer had ended) when the thought follows ``latent``."""
    PA = QuestionThoughtAnswer.PA.double()
    law: dict = {}
    for z in range(3):
        for a1 in range(3):
            if a1 == EOS:
                law[(a1, None)] = law.get((a1, None), 0.0) + float(latent[z] * PA[z, a1])
                continue
            for a2 in range(3):
                law[(a1, a2)] = law.get((a1, a2), 0.0) + float(latent[z] * PA[z, a1] * PA[z, a2])
    return law


def hmm_prompt_posterior(x=(1, 1, 1)) -> torch.Tensor:
    """p(z_0, z_1, z_2 | x) over the 27 configurations (row-major), by enumeration."""
    m = HMMProgram
    A, B, PI = m.A.double(), m.B.double(), m.PI.double()
    p = torch.zeros(27, dtype=torch.float64)
    for i, (a, b, c) in enumerate(itertools.product(range(3), repeat=3)):
        p[i] = PI[a] * B[a, x[0]] * A[a, b] * B[b, x[1]] * A[b, c] * B[c, x[2]]
    return p / p.sum()


def hmm_law(prompt_states: torch.Tensor) -> dict:
    """Law of (x_3, x_4) when (z_0, z_1, z_2) follows ``prompt_states`` [27] and the program continues."""
    A, B = HMMProgram.A.double(), HMMProgram.B.double()
    last = prompt_states.view(3, 3, 3).sum((0, 1))  # z_2
    law = {}
    for x3, x4 in itertools.product(range(3), repeat=2):
        law[(x3, x4)] = float(sum(last[c] * A[c, d] * B[d, x3] * A[d, e] * B[e, x4]
                                  for c in range(3) for d in range(3) for e in range(3)))
    return law


def hmm_guide_states(probs) -> torch.Tensor:
    q = torch.as_tensor(probs, dtype=torch.float64)
    return torch.tensor([float(q[a] * q[b] * q[c]) for a, b, c in itertools.product(range(3), repeat=3)],
                        dtype=torch.float64)


QTA_PRIOR = QuestionThoughtAnswer.PZ[0].double()
QTA_GUIDE = [0.7, 0.1, 0.2]  # prefers thought 0; the posterior prefers thought 1
HMM_GUIDE = [0.3, 0.4, 0.3]  # under-weights state 1, the posterior's (chi2 12)


def hmm_prior_states() -> torch.Tensor:
    m = HMMProgram
    A, PI = m.A.double(), m.PI.double()
    return torch.tensor([float(PI[a] * A[a, b] * A[b, c]) for a, b, c in itertools.product(range(3), repeat=3)],
                        dtype=torch.float64)


def case(name: str, guided: bool):
    """(program, guide, args, output site names, exact predictive law, law of the proposal's latents, the exact
    posterior of the prompt's latents)."""
    if name == "qta":
        post = qta_posterior()
        prop = torch.tensor(QTA_GUIDE, dtype=torch.float64) if guided else QTA_PRIOR
        guide = ThoughtGuide(QTA_GUIDE) if guided else None
        return QuestionThoughtAnswer(), guide, Q_ARGS, ["answer_1", "answer_2"], qta_law(post), prop, post
    post = hmm_prompt_posterior()
    prop = hmm_guide_states(HMM_GUIDE) if guided else hmm_prior_states()
    guide = HMMPromptGuide(HMM_GUIDE) if guided else None
    return HMMProgram(), guide, H_ARGS, ["x_3", "x_4"], hmm_law(post), prop, post


def direct_law(name: str, latent: torch.Tensor) -> dict:
    return qta_law(latent) if name == "qta" else hmm_law(latent)


def chi2(post: torch.Tensor, prop: torch.Tensor) -> float:
    """chi2(Q_* || Q) of the prompt's latents."""
    return float((post**2 / prop).sum() - 1)


# ---------------------------------------------------------------------------------------------- laws and bounds
def outcomes(out, names) -> list[tuple]:
    act = out.stats["active"]
    rows = []
    for s in range(next(iter(out.outputs.values())).shape[0]):
        rows.append(tuple(int(out.outputs[k][s]) if k in out.outputs and bool(act[k][s]) else None for k in names))
    return rows


def empirical(rows: list[tuple]) -> dict:
    law: dict = {}
    for r in rows:
        law[r] = law.get(r, 0.0) + 1.0 / len(rows)
    return law


def tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def noise_tv(p: dict, S: int) -> float:
    """About two standard deviations of the TV between ``p`` and the empirical law of S draws, plus 0.01."""
    return 0.5 * sum(2 * math.sqrt(v * (1 - v) / S) for v in p.values()) + 0.01


CASES = [(m, g) for m in ("qta", "hmm") for g in (True, False)]
IDS = [f"{m}-{'guide' if g else 'none'}" for m, g in CASES]


# ---------------------------------------------------------------------------------------------- (3.12), (3.13)
@pytest.mark.parametrize(("name", "guided"), CASES, ids=IDS)
def test_direct_is_the_law_of_312(name, guided):
    """(3.12): the outputs follow int P(. | [z]) dQ(z | x) exactly (the guide's law for the prompt's latents, the
    program for the rest); with the posterior as guide this is the exact predictive law (Prop 3.1)."""
    program, guide, args, names, exact, prop, post = case(name, guided)
    S = 3000
    torch.manual_seed(0)
    out = decode(program, guide, *args, method="direct", num_samples=S)
    want = direct_law(name, prop)
    emp = empirical(outcomes(out, names))
    assert tv(emp, want) < noise_tv(want, S)
    assert tv(want, exact) > 3 * noise_tv(want, S)  # the prompt's latents matter: Q != Q_* shows


def test_direct_with_the_posterior_guide_is_exact():
    program, _, args, names, exact, _, post = case("qta", True)
    S = 3000
    torch.manual_seed(1)
    out = decode(program, ThoughtGuide(post.float()), *args, method="direct", num_samples=S)
    assert tv(empirical(outcomes(out, names)), exact) < noise_tv(exact, S)


@pytest.mark.parametrize("name", ["qta", "hmm"])
def test_streaming_yields_outputs_step_by_step(name):
    """(3.13): the stream yields (site, value) as the program's steps draw them, in order, and stops when the
    program finishes; with the posterior as guide its law is the exact predictive law (Prop 3.2)."""
    program, _, args, names, exact, _, post = case(name, True)
    guide = ThoughtGuide(post.float()) if name == "qta" else None
    if name == "hmm":  # the bootstrap's law is the prior's: compare with (3.12) for the prior
        exact = direct_law(name, hmm_prior_states())
    torch.manual_seed(2)
    rows = []
    S = 600
    for _ in range(S):
        got = list(decode(program, guide, *args, method="streaming"))
        sites = [s for s, _ in got]
        assert sites == names[: len(sites)] and len(sites) >= 1
        vals = [int(v) for _, v in got]
        if name == "qta":  # the answer ends at <eos> or after its last token
            assert (len(vals) == 2) or vals[-1] == EOS
        rows.append(tuple(vals) + (None,) * (len(names) - len(vals)))
    assert tv(empirical(rows), exact) < noise_tv(exact, S)


def test_streaming_is_lazy():
    """The stream draws step by step: the first output comes before the program has run its later steps."""
    calls = []

    class Counting(HMMProgram):
        def step(self, state, t, x, T):
            calls.append(t)
            return super().step(state, t, x, T)

    it = decode(Counting(), None, *H_ARGS, method="streaming")
    site, _ = next(it)
    assert site == "x_3" and max(calls) == 3
    assert [s for s, _ in it] == ["x_4"] and max(calls) == 4


# ---------------------------------------------------------------------------------------------- (3.14)
def resampling_check(name, guided, n=1024, S=1000, seed=3):
    program, guide, args, names, exact, prop, post = case(name, guided)
    torch.manual_seed(seed)
    out = decode(program, guide, *args, method="resampling", n=n, num_samples=S)
    err = tv(empirical(outcomes(out, names)), exact)
    bound = math.sqrt((6 * chi2(post, prop) + 2) / n) + noise_tv(exact, S)
    return err, bound


@pytest.mark.parametrize(("name", "guided"), CASES, ids=IDS)
def test_resampling_prop33(name, guided):
    """(3.14): TV(exact predictive, law of the decoded outputs) <= sqrt((6 chi2 + 2) / n) (Prop 3.3) + noise."""
    err, bound = resampling_check(name, guided)
    assert err < bound, f"TV {err:.3f} vs bound {bound:.3f}"


# ---------------------------------------------------------------------------------------------- Algorithm 1
@pytest.mark.parametrize("name", ["qta", "hmm"])
def test_exact_is_the_predictive_law(name):
    """Exact decoding (enumeration of the program's sites): its law is the predictive law to 1e-6, and its
    samples pass a chi-square test against it."""
    program, _, args, names, exact, _, _ = case(name, False)
    torch.manual_seed(4)
    S = 2000
    out = decode(program, None, *args, method="exact", num_samples=S)
    law = out.stats["output_law"]
    got = {}
    for i in range(law["probs"].shape[0]):
        key = tuple(int(law["support"][k][i]) if bool(law["active"][k][i]) else None for k in names)
        got[key] = float(law["probs"][i])
    assert set(got) == {k for k, v in exact.items() if v > 0}
    assert max(abs(got[k] - exact[k]) for k in got) < 1e-6
    emp = empirical(outcomes(out, names))
    stat = sum((S * emp.get(k, 0.0) - S * p) ** 2 / (S * p) for k, p in exact.items())
    dof = len(exact) - 1
    assert stat < dof + 4 * math.sqrt(2 * dof)  # about the 0.999 quantile of chi2(dof) for these dof


def test_exact_needs_enumerate_sites():
    class NoEnum(HMMProgram):
        enumerate_sites = None

    with pytest.raises(pt.errors.ConfigError, match="enumerate_sites"):
        decode(NoEnum(), None, *H_ARGS, method="exact")

    class Partial(HMMProgram):
        def enumerate_sites(self, x, T):
            sites = super().enumerate_sites(x, T)
            return {k: v for k, v in sites.items() if k != "z_4"}

    with pytest.raises(pt.errors.ConfigError, match="z_4"):
        decode(Partial(), None, *H_ARGS, method="exact")


# ---------------------------------------------------------------------------------------------- Algorithm 2
def unbiased_check(name, guided, n=256, S=250, seed=5):
    program, guide, args, names, exact, prop, post = case(name, guided)
    torch.manual_seed(seed)
    out = decode(program, guide, *args, method="unbiased", n=n, num_samples=S)
    err = tv(empirical(outcomes(out, names)), exact)
    return err, noise_tv(exact, S) + len(names) * chi2(post, prop) / n, out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "guided"), CASES, ids=IDS)
def test_unbiased_algorithm2(name, guided, request):
    """Algorithm 2 (fresh particles per output, m_i continuations, (G.1)): the decoded law is within the noise
    and the O(chi2 / n) bias of the self-normalised (G.1) (App. G, after Prop G.2), chi2 / n per output, of the
    exact predictive law. ``hmm-guide`` (the costliest cell) runs with ``--slow``: ``qta-guide`` still runs the
    guided path of the same runner by default and ``hmm-none`` the HMM program."""
    if (name, guided) == ("hmm", True) and not request.config.getoption("--slow"):
        pytest.skip("hmm-guide runs with --slow (qta-guide and hmm-none cover its paths)")
    err, bound, out = unbiased_check(name, guided)
    assert err < bound, f"TV {err:.3f} vs bound {bound:.3f}"
    assert all(abs(float(p.sum()) - 1) < 1e-5 for p in out.stats["next_output_probs"])


# ---------------------------------------------------------------------------------------------- best of K
def exact_joint(name: str, outs: tuple) -> float:
    """log p(prompt, outputs) by enumeration."""
    if name == "qta":
        m = QuestionThoughtAnswer
        a = [0] + [v for v in outs if v is not None]
        return math.log(sum(float(m.PQ[0] * m.PZ[0, z] * torch.prod(m.PA[z, a])) for z in range(3)))
    m = HMMProgram
    x = [1, 1, 1] + list(outs)
    total = 0.0
    for zs in itertools.product(range(3), repeat=5):
        p = m.PI[zs[0]] * m.B[zs[0], x[0]]
        for t in range(1, 5):
            p = p * m.A[zs[t - 1], zs[t]] * m.B[zs[t], x[t]]
        total += float(p)
    return math.log(total)


def best_of_k_regret(name, guided, reps=25):
    program, guide, args, names, _, _, _ = case(name, guided)
    torch.manual_seed(6)
    regret, cache = [], {}
    for _ in range(reps):
        out = decode(program, guide, *args, method="best_of_k", n=256, k=4)
        cand = out.stats["candidates"]
        act = out.stats["candidate_active"]
        keys = [tuple(int(cand[k][i]) if bool(act[k][i]) else None for k in names) for i in range(4)]
        ex = torch.tensor([cache.setdefault(key, exact_joint(name, key)) for key in keys])
        best = int(torch.argmax(out.stats["scores"]))
        assert outcomes(out, names)[0] == keys[best]
        regret.append(float(ex.max() - ex[best]))
    return sum(regret) / len(regret)


@pytest.mark.parametrize(("name", "guided"), CASES, ids=IDS)
def test_best_of_k_regret(name, guided):
    """Best-of-K picks the candidate with the largest exact p(prompt, y) up to a mean regret of 0.1 nats."""
    assert best_of_k_regret(name, guided) < 0.1


# ---------------------------------------------------------------------------------------------- wrong weights
@pytest.mark.slow
def test_wrong_weights_fail(monkeypatch, request):
    """With uniform weights instead of p/q, resampling follows the proposal ((3.12)'s law), Algorithm 2 estimates
    the proposal's predictive law and best-of-K scores every candidate alike: the same checks fail. By default
    each method is checked on ``qta-guide`` (the same runner as every other cell); ``--slow`` adds (3.14) on
    ``qta-none`` and ``hmm-none`` and Algorithm 2 on ``hmm-guide``."""
    monkeypatch.setattr(decoding_program, "_log_weights", lambda log_p, log_q: torch.zeros_like(log_q))
    slow = request.config.getoption("--slow")
    # hmm-guide is left out of the (3.14) check: its chi2 (12) makes Prop 3.3's bound at n = 1024 (0.36) looser
    # than the proposal's own error (TV 0.26), so that check has no teeth there
    for name, guided in [("qta", True), ("qta", False), ("hmm", False)][:3 if slow else 1]:
        err, bound = resampling_check(name, guided)
        assert err > bound, f"{name}: uniform weights passed the (3.14) check: TV {err:.3f} vs {bound:.3f}"
    for name, guided in [("qta", True), ("hmm", True)][:2 if slow else 1]:
        err, bound, _ = unbiased_check(name, guided)
        assert err > bound, f"{name}: uniform weights passed the Algorithm 2 check: TV {err:.3f} vs {bound:.3f}"
    assert best_of_k_regret("qta", True) > 0.1


# ---------------------------------------------------------------------------------------------- API
def test_decoded_fields_and_tokens():
    """outputs in program order, [num_samples] each; tokens [S, m] with -1 after the answer ended."""
    torch.manual_seed(7)
    out = decode(QuestionThoughtAnswer(), ThoughtGuide(QTA_GUIDE), *Q_ARGS, method="resampling", n=8,
                 num_samples=200)
    assert list(out.outputs) == ["answer_1", "answer_2"] and out.method == "resampling"
    assert out.tokens.shape == (200, 2) and set(out.latents) == {"thought"}
    ended = out.tokens[:, 0] == EOS
    assert ended.any() and (out.tokens[ended, 1] == -1).all() and (out.tokens[~ended, 1] >= 0).all()
    assert torch.equal(out.stats["active"]["answer_2"], ~ended)


def test_guide_sampling_an_output_is_refused():
    class Greedy(ThoughtGuide):
        def step(self, state, t, q, answer):
            if t == 0:
                pt.sample("thought", dist.Categorical(self.probs).expand([pt.particles()]))
                pt.sample("answer_1", dist.Categorical(self.probs).expand([pt.particles()]))
            return torch.ones(pt.particles(), dtype=torch.bool)

    for method in ("direct", "resampling", "best_of_k", "unbiased"):
        with pytest.raises(pt.errors.SiteMismatchError, match="answer_1"):
            decode(QuestionThoughtAnswer(), Greedy(QTA_GUIDE), *Q_ARGS, method=method, n=4)
    with pytest.raises(pt.errors.SiteMismatchError, match="answer_1"):
        list(decode(QuestionThoughtAnswer(), Greedy(QTA_GUIDE), *Q_ARGS, method="streaming"))


def test_token_keywords_are_refused_for_programs():
    with pytest.raises(pt.errors.ConfigError, match="horizon"):
        decode(HMMProgram(), None, *H_ARGS, method="direct", max_new_tokens=3)
    with pytest.raises(pt.errors.ConfigError, match="unknown decoding method"):
        decode(HMMProgram(), None, *H_ARGS, method="beam")
