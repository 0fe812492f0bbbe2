"""Trainer: joint gradient clipping (App. L), metrics, checkpoints that resume bit for bit."""

import functools
import json

import pyro
import pytest
import torch
from _training_fixtures import X, exact_nll, problem

from ppl_thought.training import OneSampler, SamplerPolicyGradient, Sum, Trainer, clip_joint_


@pytest.fixture(autouse=True)
def _clean():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def test_joint_clipping_clips_the_joint_norm():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    norm = clip_joint_([a, b], 1.0)
    assert norm == pytest.approx(5.0)
    torch.testing.assert_close(a.grad, torch.tensor([0.6, 0.0]))  # v / ||v||, not each part to norm 1
    torch.testing.assert_close(b.grad, torch.tensor([0.8]))
    a.grad, b.grad = torch.tensor([0.3, 0.0]), torch.tensor([0.4])
    assert clip_joint_([a, b], 1.0) == pytest.approx(0.5)
    torch.testing.assert_close(b.grad, torch.tensor([0.4]))  # under the bound: untouched
    with pytest.raises(ValueError):
        clip_joint_([a, b], 0.0)


def _trainer(tmp=None, every=0, seed_init=0):
    prior, q, model, guide = problem(seed_init, seed_init + 1)
    return Trainer(model, guide, Sum(OneSampler(8), SamplerPolicyGradient(8)), {"prior": prior, "sampler": q},
                   optimizer=functools.partial(torch.optim.Adam, lr=0.1), clip_norm=0.5, batch_size=2,
                   checkpoint_dir=tmp, checkpoint_every=every, progress=False)


def test_trainer_clips_jointly_records_metrics_and_learns():
    t = _trainer()
    nll0 = float(exact_nll(t.model).detach())
    torch.manual_seed(0)
    hist = t.fit([X], num_steps=15)
    assert len(hist) == 15 and t.step_count == 15
    m = hist[0]
    for k in ("loss", "grad_norm", "grad_norm/prior", "grad_norm/sampler", "clipped", "lr"):
        assert k in m
    assert m["grad_norm"] == pytest.approx((m["grad_norm/prior"] ** 2 + m["grad_norm/sampler"] ** 2) ** 0.5, rel=1e-5)
    assert any(h["clipped"] for h in hist)
    assert float(exact_nll(t.model).detach()) < nll0 - 0.3


def test_checkpoint_resume_reproduces_uninterrupted_run(tmp_path):
    torch.manual_seed(123)
    full = _trainer()
    full.fit([X, X], num_steps=6)

    torch.manual_seed(123)
    first = _trainer(tmp_path / "ck", every=3)
    first.fit([X, X], num_steps=3)
    path = Trainer.latest_checkpoint(tmp_path / "ck")
    assert path is not None and path.name == "step-00000003"
    assert (path / json.loads((path / "config.json").read_text())["tensors"]["file"]).is_file()
    assert json.loads((path / "config.json").read_text())["config"]["modules"] == ["prior", "sampler"]
    torch.manual_seed(999)  # the RNG state must come from the checkpoint, not from here
    resumed = _trainer(seed_init=7).load(path)  # different initial weights, overwritten by the checkpoint
    assert resumed.step_count == 3 and len(resumed.history) == 3
    resumed.fit([X, X], num_steps=6)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    for name in ("prior", "sampler"):
        assert torch.equal(resumed.modules[name].logits, full.modules[name].logits)
    assert torch.equal(resumed.optimizer.state_dict()["state"][0]["exp_avg"],
                       full.optimizer.state_dict()["state"][0]["exp_avg"])


def test_trainer_bad_input(tmp_path):
    prior, q, model, guide = problem()
    with pytest.raises(ValueError, match="modules"):
        Trainer(model, guide, OneSampler(2), {})
    with pytest.raises(TypeError, match="Module"):
        Trainer(model, guide, OneSampler(2), {"prior": "x"})
    with pytest.raises(TypeError, match="ELBO"):
        Trainer(model, guide, object(), {"prior": prior})
    with pytest.raises(ValueError, match="clip_norm"):
        Trainer(model, guide, OneSampler(2), {"prior": prior}, clip_norm=-1)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        Trainer(model, guide, OneSampler(2), {"prior": prior}, checkpoint_every=2)
    t = Trainer(model, guide, OneSampler(2), {"prior": prior}, progress=False)
    with pytest.raises(ValueError, match="empty"):
        t.fit([], 2)
    with pytest.raises(FileNotFoundError):
        t.load(tmp_path / "nothing")
    t.save(tmp_path / "c")
    other = Trainer(model, guide, OneSampler(2), {"prior": prior, "sampler": q}, progress=False)
    with pytest.raises(ValueError, match="modules"):
        other.load(tmp_path / "c")


def test_item_streams_make_the_samples_a_function_of_the_place_in_the_run(tmp_path):
    """seed=: item j of step t sees the stream item_seed(seed, t, j), whatever else was drawn before: the same
    losses after drawing from the global stream in between, and a resumed run repeats the uninterrupted one."""
    from ppl_thought.training.trainer import item_seed

    assert len({item_seed(0, t, j) for t in range(20) for j in range(20)}) == 400
    assert item_seed(0, 3, 1) == item_seed(0, 3, 1) != item_seed(1, 3, 1)

    def run(every=0, draw=False, seed=5):
        prior, q, model, guide = problem(0, 1)
        t = Trainer(model, guide, Sum(OneSampler(8), SamplerPolicyGradient(8)), {"prior": prior, "sampler": q},
                    optimizer=functools.partial(torch.optim.Adam, lr=0.1), batch_size=2, progress=False, seed=seed,
                    checkpoint_dir=tmp_path / "ck" if every else None, checkpoint_every=every)
        t.fit([X, X], num_steps=4, callback=(lambda tr, m: torch.rand(7)) if draw else None)
        return t

    a, b = run(), run(draw=True)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    assert [h["loss"] for h in run(seed=6).history] != [h["loss"] for h in a.history]
    run(every=2)
    torch.manual_seed(321)
    prior, q, model, guide = problem(3, 4)
    resumed = Trainer(model, guide, Sum(OneSampler(8), SamplerPolicyGradient(8)), {"prior": prior, "sampler": q},
                      optimizer=functools.partial(torch.optim.Adam, lr=0.1), batch_size=2, progress=False, seed=5)
    resumed.load(tmp_path / "ck" / "step-00000002").fit([X, X], num_steps=4)
    assert resumed.history == a.history


def test_trainer_distributed_arguments():
    from ppl_thought.errors import ConfigError

    prior, q, model, guide = problem()
    with pytest.raises(ConfigError, match="process group"):
        Trainer(model, guide, OneSampler(2), {"prior": prior}, distributed=True)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="seed"):
            Trainer(model, guide, OneSampler(2), {"prior": prior}, seed=bad)
    t = Trainer(model, guide, OneSampler(2), {"prior": prior}, progress=False)
    assert (t.distributed, t.rank, t.world_size) == (False, 0, 1)
