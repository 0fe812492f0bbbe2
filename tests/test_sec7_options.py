"""Section 7 at fidelity (App. L): the gating of the explanatory sampler, joint vs separate clipping (Fig L.2),
and the multi-seed summary with its bootstrap over seeds. Hand-computed values throughout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ppl_thought.data.query_response import permutation_choice_task
from ppl_thought.errors import ConfigError, PPLThoughtError
from ppl_thought.experiments.sec7 import (
    Sec7,
    Sec7Config,
    bootstrap_relative_improvement,
    clip_gradients_,
    gate_mix,
    summarize_seeds,
)
from ppl_thought.lm.gated import gate_mlp


def test_gate_mix_hand_computed():
    """(L.1)/(L.2) with a fresh gate (last layer weight 0, bias [2, -2]): p_fast = sigmoid(4) = 0.98201379,
    p_slow = 0.01798621, whatever the features."""
    gate = gate_mlp(2)
    f = torch.randn(1, 2)
    fast, slow = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    mixed = gate_mix(gate, f, f, fast, slow)
    assert torch.allclose(mixed, torch.tensor([[0.98201379, 3 * 0.01798621]]), atol=1e-6)
    with torch.no_grad():  # bias [0, 0]: an even mixture
        gate[-1].bias.zero_()
    assert torch.allclose(gate_mix(gate, f, f, fast, slow), torch.tensor([[0.5, 1.5]]), atol=1e-6)


def _grads(a: list[float], b: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    p, q = torch.zeros(len(a), requires_grad=True), torch.zeros(len(b), requires_grad=True)
    p.grad, q.grad = torch.tensor(a), torch.tensor(b)
    return p, q


def test_clipping_joint_vs_separate_hand_computed():
    """App. L: v_latent = (3, 0), v_sampler = (0, 4). Joint: ||v|| = 5, both scaled by 1/5 -> (0.6, 0), (0, 0.8).
    Separate: each scaled to norm 1 -> (1, 0), (0, 1)."""
    p, q = _grads([3.0, 0.0], [0.0, 4.0])
    assert clip_gradients_([[p], [q]], 1.0, "joint") == pytest.approx([5.0])
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.0])) and torch.allclose(q.grad, torch.tensor([0.0, 0.8]))
    p, q = _grads([3.0, 0.0], [0.0, 4.0])
    assert clip_gradients_([[p], [q]], 1.0, "separate") == pytest.approx([3.0, 4.0])
    assert torch.allclose(p.grad, torch.tensor([1.0, 0.0])) and torch.allclose(q.grad, torch.tensor([0.0, 1.0]))
    p, q = _grads([0.3, 0.0], [0.0, 0.4])  # below the threshold both leave the gradients alone
    clip_gradients_([[p], [q]], 1.0, "separate")
    assert torch.allclose(p.grad, torch.tensor([0.3, 0.0])) and torch.allclose(q.grad, torch.tensor([0.0, 0.4]))
    with pytest.raises(ConfigError, match="clipping mode must be 'joint' or 'separate'.*'both'"):
        clip_gradients_([[p]], 1.0, "both")


def test_config_defaults_follow_the_paper_and_bad_values_are_named():
    c = Sec7Config()
    assert c.gating and c.gate_sampler and c.clipping == "joint"
    with pytest.raises(PPLThoughtError, match=r"Sec7Config.clipping must be .*got 'sep'"):
        Sec7Config(clipping="sep")
    with pytest.raises(PPLThoughtError, match=r"Sec7Config.thought_alphabet .*got 'words'"):
        Sec7Config(thought_alphabet="words")


def _tiny(**kw) -> tuple[Sec7, object]:
    task = permutation_choice_task(m=3, query_len=2, num_choices=3)
    cfg = Sec7Config(m=3, query_len=2, num_choices=3, d_model=16, n_layers=1, n_heads=2, pretrain_steps=0, **kw)
    return Sec7(task, cfg, seed=0), task


def test_explanatory_sampler_gate_mixes_predictive_and_explanatory_formats():
    """App. L: the gated explanatory sampler's logits are p_fast * Q(x <s>) + p_slow * Q(x x_r <explain> <s>),
    so a fresh gate starts it as (almost) the predictive sampler; without a gate it reads the explanatory
    format alone; the predictive sampler is never gated."""
    exp, task = _tiny()
    Q = exp._lm()
    with torch.no_grad():
        Q.embed.weight.mul_(4.0)  # make the two formats' distributions differ clearly
    q, _, r = task.sample(6, generator=torch.Generator().manual_seed(1))
    empty = q[:, :0]
    with torch.no_grad():
        plain = exp.q_logits(Q, q, r, empty)[:, -1]
        pred = exp.q_logits(Q, q, None, empty)[:, -1]
        Q.gate = gate_mlp(16)
        gated = exp.q_logits(Q, q, r, empty)[:, -1]
        assert torch.equal(exp.q_logits(Q, q, None, empty)[:, -1], pred)
        direct_slow, _ = Q(exp._sampler_prompt(q, r))
        direct_fast, _ = Q(exp._sampler_prompt(q, None))
    assert torch.allclose(plain, direct_slow[:, -1]) and torch.allclose(pred, direct_fast[:, -1])
    p_slow = torch.sigmoid(torch.tensor(-4.0))
    assert torch.allclose(gated, (1 - p_slow) * pred + p_slow * plain, atol=1e-5)

    def tv(a, b):
        from ppl_thought.distributions.lm_state import masked_log_softmax
        pa, pb = masked_log_softmax(a, exp.thought).exp(), masked_log_softmax(b, exp.thought).exp()
        return float((pa - pb).abs().sum(-1).max() / 2)

    assert tv(gated, pred) < 0.5 * tv(plain, pred)  # the gate pulls the sampler to the predictive one
    # the log Q of particles uses the same logits, at every thought length
    y = torch.tensor([[exp.vocab.id(task.methods[0])]] * 6)
    lq = exp.log_q(Q, q, r, y)
    from ppl_thought.distributions.lm_state import masked_log_softmax
    assert torch.allclose(lq, masked_log_softmax(gated, exp.thought).gather(-1, y).squeeze(-1), atol=1e-5)


def test_training_options_gate_the_right_networks_and_clip_as_asked():
    """gate_sampler gives only the explanatory sampler a gate; gating=False none. With a small clip
    threshold joint and separate clipping train differently; with clipping inactive they agree exactly."""
    def train(method, **kw):
        exp, task = _tiny(steps=2, batch=4, eval_every=2, num_eval_curve=4, n=3, **kw)
        q, _, r = task.sample(16, generator=torch.Generator().manual_seed(2))
        from tqdm.auto import tqdm
        with tqdm(disable=True) as bar:
            return exp.train(method, (q, r), (q[:4], r[:4]), bar)["nets"]

    nets = train("expl")
    assert hasattr(nets[0], "gate") and hasattr(nets[1], "gate")
    nets = train("pred")
    assert hasattr(nets[0], "gate") and not hasattr(nets[1], "gate")
    nets = train("expl", gating=False, gate_sampler=False)
    assert not hasattr(nets[0], "gate") and not hasattr(nets[1], "gate")

    def flat(nets):
        return torch.cat([p.detach().reshape(-1) for n in nets for p in n.parameters()])

    joint, sep = flat(train("expl", clip=1e-3)), flat(train("expl", clip=1e-3, clipping="separate"))
    assert not torch.allclose(joint, sep)
    joint, sep = flat(train("expl", clip=1e9)), flat(train("expl", clip=1e9, clipping="separate"))
    assert torch.equal(joint, sep)


def test_bootstrap_relative_improvement_two_seeds_enumerated():
    """Seeds with gains (pred, expl) = (1, 2) and (3, 2): the 4 equally likely resamples have mean predictive gain
    1, 2, 2, 3 and ratios 2/1 - 1 = 1, 0, 0, 2/3 - 1 = -1/3; the point value is 2/2 - 1 = 0."""
    res = bootstrap_relative_improvement(np.array([1.0, 3.0]), np.array([2.0, 2.0]), resamples=20000, seed=0)
    assert res["relative_improvement"] == 0.0
    assert res["ci95"] == pytest.approx([-1 / 3, 1.0])
    assert res["share_gain_pred_nonpositive"] == 0.0
    assert res["difference_ci95"] == pytest.approx([-1.0, 1.0])
    # identical seeds: no spread; negative predictive gains are counted
    res = bootstrap_relative_improvement(np.array([-0.1, -0.1, -0.1]), np.array([0.2, 0.2, 0.2]), resamples=100)
    assert res["ci95"] == pytest.approx([-3.0, -3.0]) and res["share_gain_pred_nonpositive"] == 1.0
    with pytest.raises(ConfigError, match="same length >= 2"):
        bootstrap_relative_improvement(np.array([1.0]), np.array([1.0]))


def test_summarize_seeds_standard_errors_across_seeds():
    rows = [{"seed": s, "L_fast": f, "L_pred": p, "L_expl": e, "gain_pred": f - p, "gain_expl": f - e,
             "causal_gap": 0.5, "causal_gap_pred": 0.0, "thought_choice_mutual_information": 2.0}
            for s, (f, p, e) in enumerate([(1.0, 0.9, 0.5), (1.0, 1.1, 0.7), (1.0, 0.8, 0.6)])]
    out = summarize_seeds(rows, resamples=200)
    # gain_pred per seed 0.1, -0.1, 0.2: mean 1/15, sd = sqrt(((1/30)^2 + (1/6)^2 + (2/15)^2) / 2)
    sd = math.sqrt(((0.1 - 1 / 15) ** 2 + (-0.1 - 1 / 15) ** 2 + (0.2 - 1 / 15) ** 2) / 2)
    assert out["gain_pred"]["mean"] == pytest.approx(1 / 15)
    assert out["gain_pred"]["se"] == pytest.approx(sd / math.sqrt(3))
    assert out["gain_expl"]["mean"] == pytest.approx(0.4)
    assert out["relative_improvement"]["relative_improvement"] == pytest.approx(0.4 / (1 / 15) - 1)
    assert out["seeds_expl_beats_pred"] == 3 and out["seeds_gain_pred_positive"] == 2


@pytest.mark.filterwarnings("ignore:Section 7 base model:RuntimeWarning")
def test_multi_seed_run_split_over_processes_equals_one_run(tmp_path):
    """run_seeds: each (seed, n) replicate depends only on its seed and n, so runs split by n and by seed and
    merged give the rows of one run; the JSON has the three losses, both gains and the causal gap."""
    import json

    from ppl_thought.experiments.sec7 import main, merge_seed_runs, run_seeds

    cfg = Sec7Config(m=3, query_len=2, num_choices=3, d_model=16, n_layers=1, n_heads=2, pretrain_steps=20,
                     steps=3, batch=4, eval_every=3, num_eval_curve=8, num_test=16)
    whole = run_seeds(cfg, seeds=2, ns=(2, 3), progress=False)
    parts = [run_seeds(cfg, seeds=2, ns=(2,), progress=False), run_seeds(cfg, seeds=1, ns=(3,), progress=False),
             run_seeds(cfg, seeds=1, ns=(3,), seed=1, progress=False)]  # task and test set from task_seed 0
    merged = merge_seed_runs(parts)
    for n in ("2", "3"):
        for a, b in zip(whole["runs"][n], merged["runs"][n], strict=True):
            for key in ("L_fast", "L_pred", "L_expl", "gain_pred", "gain_expl", "causal_gap", "causal_gap_pred"):
                assert a[key] == b[key], (n, a["seed"], key)
        assert merged["summary"][n]["gain_expl"]["mean"] == pytest.approx(whole["summary"][n]["gain_expl"]["mean"])
    assert merged["config"]["seeds"] == [0, 1] and merged["config"]["ns"] == [2, 3]
    with pytest.raises(ConfigError, match="seed 0 at n = 2 appears twice"):
        merge_seed_runs([parts[0], parts[0]])
    # the command line writes the same JSON
    f = tmp_path / "s.json"
    import ppl_thought.experiments.sec7 as sec7

    orig = sec7.Sec7Config
    sec7.Sec7Config = lambda: cfg  # noqa: E731  (the tiny sizes through the real command line)
    try:
        assert main(["--seeds", "2", "--n", "2", "--json", str(f)]) == 0
    finally:
        sec7.Sec7Config = orig
    saved = json.loads(f.read_text())
    assert [r["L_expl"] for r in saved["runs"]["2"]] == [r["L_expl"] for r in whole["runs"]["2"]]
    assert saved["command"].endswith("--json " + str(f)) and "commit" in saved and saved["seconds"] > 0



def test_permutation_choice_task_refuses_a_bad_count_with_a_config_error():
    """Found by the public sweep: num_choices=-1 (and m outside [2, ...]) raised a bare ValueError."""
    with pytest.raises(ConfigError, match="num_choices must lie in \\[1, 3!\\]"):
        permutation_choice_task(m=3, query_len=2, num_choices=-1)
    with pytest.raises(ConfigError, match="m must lie"):
        permutation_choice_task(m=1, query_len=2, num_choices=1)
    with pytest.raises(ValueError):  # still a ValueError for callers that catch that
        permutation_choice_task(m=3, query_len=2, num_choices=7)
