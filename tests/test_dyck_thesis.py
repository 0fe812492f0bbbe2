"""The thesis' Dyck sandbox (data-training-inference thesis, Section 3.2.1): the law of Definition 3.2.1 against
exact enumeration, the trained (imperfect) verifier of Section 3.2.1.2, Algorithm 1 on per-row prompts with an
exact statement, and the schema of the Tables 3.1-3.3 experiment."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_verifiers import chi2_pvalue

from ppl_thought.data import DyckDistribution
from ppl_thought.errors import ConfigError, MalformedSequenceError, PPLThoughtError
from ppl_thought.experiments import dyck_thesis
from ppl_thought.verifiers import LinearProbeVerifier, TokenwiseBacktracking, first_errors
from ppl_thought.vocab import BOS_ID, PAD_ID

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- Definition 3.2.1
def definition_weight(w: str, D: int, p: float, q: float, close_le: bool = False) -> float:
    """Equations (3.3)-(3.4) read literally on a bracket string (0 outside the prefix set): the depth is read
    after each token. ``close_le`` is the seed's printed ``d(w_{1:i}) <= D - i`` for the close factor (wrong:
    vacuous); the default is the strict reading that matches Remark 3.2.1."""
    stack: list[str] = []
    weight = 1.0
    for i, c in enumerate(w, start=1):
        if c in "[(":
            stack.append(c)
            d = len(stack)
            if d > D - i:
                return 0.0
            sq = c == "["
            weight *= (p if sq else 1 - p) if d == 1 else (p * q if sq else (1 - p) * q)
        else:
            if not stack or stack.pop() != {"]": "[", ")": "("}[c]:
                return 0.0
            d = len(stack)
            if d < D - i or (close_le and d <= D - i):
                weight *= 1 - q
    return weight


def enumerate_law(dist: DyckDistribution, N: int, **kw) -> tuple[torch.Tensor, np.ndarray]:
    """Every string of Sigma^N as ids ``[4^N, N]`` and its normalised definition weight."""
    chars = "[]()"
    strings = ["".join(t) for t in itertools.product(chars, repeat=N)]
    ids = torch.tensor([[dist.vocab.id(c) for c in s] for s in strings])
    w = np.array([definition_weight(s, dist.D, dist.p, dist.q, **kw) for s in strings])
    return ids, w / w.sum()


@pytest.mark.parametrize("N", [8, 5])
def test_log_prob_equals_the_definition_by_enumeration(N):
    dist = DyckDistribution(D=8, p=0.3, q=0.6)
    ids, law = enumerate_law(dist, N)
    lp = dist.log_prob(ids).numpy()
    assert np.isneginf(lp[law == 0]).all()
    assert np.abs(np.exp(lp) - law).max() < 1e-12
    # the support is the prefix set Dyck_N of the exact process verifier
    assert (dist.is_valid(ids).numpy() == (law > 0)).all()
    # the seed's literal "<=" is a different law on complete strings (and the same on none of them)
    _, wrong = enumerate_law(dist, N, close_le=True)
    if N == 8:
        assert np.abs(wrong - law).max() > 1e-3


@pytest.mark.parametrize("N", [8, 5])
def test_sampler_draws_the_definition(N):
    """Chi-square of 100000 draws against the enumerated law; the same draws fail the literal-"<=" law and a law
    with p and 1 - p swapped."""
    dist = DyckDistribution(D=8, p=0.3, q=0.6)
    ids, law = enumerate_law(dist, N)
    z = dist.sample(100_000, length=N, seed=3)
    index = {tuple(r): j for j, r in enumerate(ids.tolist())}
    counts = np.bincount([index[tuple(r)] for r in z.tolist()], minlength=len(ids)).astype(float)
    keep = law > 0
    assert counts[~keep].sum() == 0
    _, pval = chi2_pvalue(counts[keep], law[keep])
    assert pval > 1e-3
    wrongs = [enumerate_law(DyckDistribution(D=8, p=0.7, q=0.6), N)[1]]
    if N == 8:
        wrongs.append(enumerate_law(dist, N, close_le=True)[1])
    for wrong in wrongs:
        _, pw = chi2_pvalue(counts[keep], np.maximum(wrong[keep], 1e-12) / np.maximum(wrong[keep], 1e-12).sum())
        assert pw < 1e-6


def test_conditionals_sum_to_one_and_forced_closes():
    dist = DyckDistribution(D=10)
    z = dist.sample(500, seed=1)
    probs = dist.next_token_probs(z)  # [n, D + 1, V]
    assert torch.allclose(probs[:, :-1].sum(-1), torch.ones(500, 10, dtype=torch.float64))
    assert (probs[:, -1] == 0).all()
    # Remark 3.2.1: at depth D - i + 1 the close is forced (probability 1)
    x = torch.tensor([[dist.vocab.id(c) for c in "[[[[["]])
    assert dist.next_token_probs(x)[0, 5, dist.vocab.id("]")] == 1.0
    # an invalid prefix has no continuation and log-probability -inf, never NaN
    bad = torch.tensor([[dist.vocab.id(c) for c in "[)"]])
    assert dist.next_token_probs(bad)[0, 2].sum() == 0
    assert dist.log_prob(bad).isneginf().all()


def test_bad_arguments_name_what_they_got():
    for kw, word in (({"D": 7}, "D"), ({"D": 0}, "D"), ({"p": 1.0}, "p"), ({"q": 0.0}, "q"), ({"p": "a"}, "p")):
        with pytest.raises(ConfigError, match=word):
            DyckDistribution(**kw)
    dist = DyckDistribution(D=8)
    with pytest.raises(ConfigError, match="length"):
        dist.sample(3, length=9)
    with pytest.raises(ConfigError, match="n"):
        dist.sample(0)
    with pytest.raises(MalformedSequenceError, match="strings"):
        dist.log_prob(torch.zeros(2, 9, dtype=torch.long))
    assert issubclass(ConfigError, PPLThoughtError)


# ---------------------------------------------------------------------------------------------- Algorithm 1
class NoisyOracle(torch.nn.Module):
    """An LM whose next-token law is ``(1 - eps)`` D_Dyck's conditional + ``eps`` uniform over the 4 brackets:
    its argmax is always a valid bracket, its samples are not."""

    def __init__(self, dist: DyckDistribution, eps: float):
        super().__init__()
        self.dist, self.eps = dist, eps
        self.vocab_size = len(dist.vocab)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # so lm_device finds a device

    def forward(self, tokens, cache=None):
        x = tokens[:, 1:].clone()  # drop <bos>; <pad> after the prefix is never read at the gathered positions
        x[x == PAD_ID] = self.dist.vocab.id("[")
        probs = self.dist.next_token_probs(x)[:, :tokens.shape[1]]
        brackets = torch.zeros(self.vocab_size, dtype=torch.float64)
        brackets[[self.dist.vocab.id(c) for c in "[]()"]] = 0.25
        mix = (1 - self.eps) * probs + self.eps * brackets
        return mix.log().float(), None


def test_algorithm1_with_exact_verifier_makes_no_error_when_argmax_is_valid():
    """Exact statement: if the LM's argmax is always a valid token and Q >= D - |x| (Algorithm 1 runs at most
    D - |x| rounds, each with one verifier call), Algorithm 1 with the exact process verifier never errs:
    every sampled token is checked and every greedy redo is valid. Q = 0 and an accept-all verifier do err."""
    dist = DyckDistribution(D=12, p=0.2, q=0.5)
    lm = NoisyOracle(dist, eps=0.3)
    g = torch.Generator().manual_seed(0)
    full = dist.with_p(0.8).sample(400, length=8, seed=g)
    lengths = torch.randint(4, 9, (400,), generator=g)
    prompts = torch.where(torch.arange(8)[None] < lengths[:, None], full, torch.full_like(full, PAD_ID))

    def errors(Q, ver):
        z = TokenwiseBacktracking(400, 12, quota=Q, stride=3).run(lm, ver, row_prompts=prompts,
                                                                   generator=torch.Generator().manual_seed(1))
        z = z.samples["z"]
        assert (z[:, :4] == prompts[:, :4]).all()  # the prompt is never erased
        return int((~dist.is_valid(z)).sum())

    assert errors(8, dist.verifier) == 0
    assert errors(0, dist.verifier) > 50
    assert errors(8, lambda s: torch.ones(s.shape[0], dtype=torch.bool)) > 50


def test_row_prompts_keep_and_errors():
    dist = DyckDistribution(D=8)
    lm = NoisyOracle(dist, eps=0.2)
    prompts = dist.sample(6, length=5, seed=0)
    never = lambda s: torch.zeros(s.shape[0], dtype=torch.bool)  # noqa: E731
    keep = torch.tensor([0, 1, 2, 3, 4, 5])
    z = TokenwiseBacktracking(6, 8, quota=1, stride=8).run(lm, never, row_prompts=prompts, keep=keep).samples["z"]
    # stride 8 erases down to `keep`; the redo is greedy and the LM's argmax valid, so rows are valid strings
    assert dist.is_valid(z).all()
    for i in range(6):
        assert (z[i, :i] == prompts[i, :i]).all()
    alg = TokenwiseBacktracking(6, 8, quota=1, stride=2)
    with pytest.raises(ConfigError, match="either prompt"):
        alg.run(lm, never, prompt=torch.tensor([6]), row_prompts=prompts)
    with pytest.raises(ConfigError, match="keep needs row_prompts"):
        alg.run(lm, never, keep=keep)
    with pytest.raises(ConfigError, match="keep"):
        alg.run(lm, never, row_prompts=prompts, keep=torch.full((6,), 6))
    with pytest.raises(ConfigError, match="row_prompts"):
        alg.run(lm, never, row_prompts=torch.zeros(5, 3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------- the trained verifier
def test_first_errors_is_the_first_uncompletable_prefix():
    dist = DyckDistribution(D=8)
    rows = ["[()]()()", "[(])()()", "(((())))", "((((()))", "[]]"]
    ids = [[dist.vocab.id(c) for c in r] + [PAD_ID] * (8 - len(r)) for r in rows]
    # "((((" at i = 3 leaves depth 4 with 4 positions left: completable; "(((((" is not
    assert first_errors(dist.verifier, torch.tensor(ids)).tolist() == [-1, 2, -1, 4, 2]


@pytest.fixture(scope="module")
def tiny_lm():
    """A 2-layer Transformer briefly trained on D_Dyck (D = 12): good in distribution, wrong on OOD prompts."""
    dist = DyckDistribution(D=12, p=0.2, q=0.5)
    cfg = dyck_thesis.DyckThesisConfig(D=12, prompt_min=7, prompt_max=11, d_model=32, train_steps=150,
                                       batch=64, n_errors=150, collect_batch=600, table_repeats=1,
                                       unseen_prompts=200)
    return dist, cfg, dyck_thesis.train_lm(dist, cfg)


def test_trained_verifier_beats_chance_and_is_imperfect(tiny_lm):
    dist, cfg, lm = tiny_lm
    data = dyck_thesis.collect_verifier_data(lm, dist, cfg, torch.Generator().manual_seed(5))
    err, cor = data["errors"], data["correct"]
    assert len(err) == cfg.n_errors and len(cor) == len(err)
    # the error strings end at their first error; the correct ones are valid prefixes of the same lengths
    lengths = (err != PAD_ID).sum(-1)
    assert (first_errors(dist.verifier, err) == lengths - 1).all()
    assert dist.is_valid(cor).all() and ((cor != PAD_ID).sum(-1) == lengths).all()
    ver, fit = LinearProbeVerifier.fit(lm, err, cor, val_fraction=0.3, seed=0)
    # balanced classes: chance is 0.5 with standard error 0.5 / sqrt(n_val); ask for 3 standard errors above it
    above_chance = 0.5 + 3 * 0.5 / math.sqrt(fit["n_val"])
    assert fit["val_accuracy"] > above_chance
    # the same probe trained on shuffled labels stays within chance: the check can fail
    perm = torch.randperm(len(err) * 2, generator=torch.Generator().manual_seed(0))
    pool = torch.cat([err, cor])[perm]
    _, shuffled = LinearProbeVerifier.fit(lm, pool[:len(err)], pool[len(err):], val_fraction=0.3, seed=0)
    assert shuffled["val_accuracy"] < above_chance
    # imperfect: against the exact verifier on fresh prefixes, right mostly but not always
    fresh = torch.cat([dyck_thesis.collect_verifier_data(lm, dist, cfg, torch.Generator().manual_seed(9))[k]
                       for k in ("errors", "correct")])
    agree = float((ver(fresh) == dist.is_valid(fresh)).float().mean())
    assert 0.6 < agree < 1.0
    with pytest.raises(ConfigError, match="val_fraction"):
        LinearProbeVerifier.fit(lm, err, cor, val_fraction=1.0)


def test_linear_probe_reads_the_lm_features(tiny_lm):
    """V is a function of the LM's last-position representation: the same prefix padded differently, or read
    through the features of the full context, gives the same decision."""
    dist, _, lm = tiny_lm
    x = dist.with_p(0.8).sample(50, length=9, seed=2)
    layer = torch.nn.Linear(lm.d_model, 2)
    ver = LinearProbeVerifier(lm, layer)
    padded = torch.nn.functional.pad(x, (0, 3), value=PAD_ID)
    assert torch.equal(ver(x), ver(padded))
    out = {}
    h = lm.norm.register_forward_hook(lambda _m, _i, o: out.__setitem__("h", o))
    with torch.no_grad():
        lm(torch.cat([torch.full((50, 1), BOS_ID), x], 1))
    h.remove()
    assert torch.equal(ver(x), layer(out["h"][:, -1]).argmax(-1) == 1)
    with pytest.raises(ConfigError, match="2 outputs"):
        LinearProbeVerifier(lm, torch.nn.Linear(lm.d_model, 3))


# ---------------------------------------------------------------------------------------------- Tables 3.1-3.3
def check_schema(res: dict) -> None:
    th, us = res["thesis"], res["ours"]
    assert th["table_3_3"]["top_p=1.0"]["Q=0,B=0"]["errors"] == 461.8
    assert th["table_3_3"]["top_p=1.0"]["Q=4,B=4"]["errors"] == 200.0
    assert th["table_3_2"]["Q=4,B=6"] == 0.921 and th["table_3_1"]["nucleus_0.9"] == 0.331
    assert set(us["table_3_1"]) == set(th["table_3_1"]) - {"source"}
    assert set(us["table_3_2"]) == set(th["table_3_2"])
    for row in list(us["table_3_1"].values()) + list(us["table_3_2"].values()):
        assert 0.0 <= row["mean"] <= 1.0 and len(row["runs"]) == res["setup"]["table_repeats"]
    for tp in ("top_p=0.9", "top_p=1.0"):
        assert set(us["table_3_3"][tp]) == {"Q=0,B=0", "Q=4,B=4", "Q=4,B=4,exact_verifier"}
        for row in us["table_3_3"][tp].values():
            assert 0 <= row["mean"] <= us["table_3_3"]["prompts"]
            assert math.isclose(row["errors_per_10000"], row["mean"] * 10000 / us["table_3_3"]["prompts"])
    v = us["verifier"]
    for k in ("train_accuracy", "val_accuracy", "accuracy_vs_exact_on_its_data"):
        assert 0.0 <= v[k] <= 1.0
    assert 0.0 <= v["audit_table_3_3"]["accuracy_vs_exact"] <= 1.0 and v["audit_table_3_3"]["calls"] > 0
    assert 0.0 <= us["ood_accuracy_nucleus_0.9"] <= 1.0


def test_tables_schema_on_a_tiny_run():
    cfg = dyck_thesis.DyckThesisConfig(D=12, prompt_min=7, prompt_max=11, d_model=32, train_steps=60, batch=32,
                                       n_errors=40, collect_batch=200, table_repeats=2, unseen_prompts=100)
    res = dyck_thesis.run(cfg=cfg)
    check_schema(res)
    json.dumps(res)
    # the exact verifier with Q = 4 never does worse than no verifier by more than noise on the same prompts
    t3 = res["ours"]["table_3_3"]["top_p=1.0"]
    assert t3["Q=4,B=4,exact_verifier"]["mean"] < t3["Q=0,B=0"]["mean"]


def test_config_errors_name_the_argument():
    with pytest.raises(ConfigError, match="prompt_max"):
        dyck_thesis.DyckThesisConfig(D=12, prompt_min=7, prompt_max=12)
    with pytest.raises(ConfigError, match="unseen_prompts"):
        dyck_thesis.DyckThesisConfig(unseen_prompts=0)
    with pytest.raises(ConfigError, match="p_ood"):
        dyck_thesis.DyckThesisConfig(p_ood=1.0)


def test_committed_quick_json_has_the_schema():
    path = ROOT / "benchmarks" / "results" / "dyck_thesis_quick.json"
    res = json.loads(path.read_text())
    check_schema(res["thesis_tables"])
    assert res["thesis_tables"]["setup"]["quick"] is True
