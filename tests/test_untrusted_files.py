"""Loading never trusts the file (issue 32, item 2): every damaged or hostile checkpoint and saved result is a
CheckpointError that names the damage, on the torch and the JAX side; loads are all-or-nothing; loaded
models are in eval mode; ``ppl-thought diagnose`` answers a damaged folder with one line and exit code 2.

Each test here failed at 60fef74 (a followed symlink, a rewired weight, a silent cast, NaN weights, a
RecursionError, a KeyError, a merged key, a half-overwritten Trainer, a model in train mode, a traceback).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ppl_thought as pt
from ppl_thought import io as ptio
from ppl_thought.errors import ArgumentTypeError, CheckpointError

V = 8


def small(seed: int = 0, **options) -> pt.lm.Transformer:
    torch.manual_seed(seed)
    return pt.lm.Transformer(V, d_model=8, n_layers=1, n_heads=2, max_len=16, **options)


def tensors_of(path):
    """(state as stored, metadata) of a checkpoint's tensors file."""
    from safetensors import safe_open

    name = json.loads((path / "config.json").read_text())["tensors"]["file"]
    with safe_open(str(path / name), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def rewrite(path, state, metadata=None, config=None) -> None:
    """Replace a checkpoint's tensors file (and its config's name and SHA-256): a consistent but hostile folder."""
    header = json.loads((path / "config.json").read_text())
    if metadata is None:
        metadata = tensors_of(path)[1]
    os.unlink(path / header["tensors"]["file"])
    tmp = path / "model.hostile.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    header["tensors"] = {"file": tmp.name, "sha256": hashlib.sha256(tmp.read_bytes()).hexdigest()}
    if config is not None:
        header["config"] = config
    (path / "config.json").write_text(json.dumps(header))


def loaders(path):
    """Both Transformer loaders (the JAX one if jax is installed)."""
    out = [("torch", lambda **kw: pt.lm.Transformer.load(path, **kw))]
    try:
        import ppl_thought.numpyro as ptn

        out.append(("jax", lambda **kw: ptn.lm.Transformer.load(path, **kw)))
    except ImportError:  # pragma: no cover - jax is a dependency of the test environment
        pass
    return out


def test_a_tensors_file_that_links_out_of_the_folder_is_refused(tmp_path):
    outside = small(seed=1).save(tmp_path / "elsewhere")
    path = small().save(tmp_path / "ck")
    header = json.loads((path / "config.json").read_text())
    target = outside / json.loads((outside / "config.json").read_text())["tensors"]["file"]
    (path / header["tensors"]["file"]).unlink()
    os.symlink(target, path / header["tensors"]["file"])
    header["tensors"]["sha256"] = hashlib.sha256(target.read_bytes()).hexdigest()
    (path / "config.json").write_text(json.dumps(header))
    for _side, load in loaders(path):
        with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
            load()
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        ptio.load_checkpoint(path)
    # a config.json that is a link out of the folder as well
    other = tmp_path / "ck2"
    other.mkdir()
    os.symlink(path / "config.json", other / "config.json")
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        ptio.load_checkpoint(other)
    # a link inside the folder is a file of the folder
    inside = tmp_path / "ck3"
    small().save(inside)
    name = json.loads((inside / "config.json").read_text())["tensors"]["file"]
    os.rename(inside / name, inside / "real.safetensors")
    os.symlink("real.safetensors", inside / name)
    assert pt.lm.Transformer.load(inside).vocab_size == V


def test_a_tensors_file_that_is_no_regular_file_is_refused_without_reading_it(tmp_path):
    path = small().save(tmp_path / "ck")
    name = json.loads((path / "config.json").read_text())["tensors"]["file"]
    (path / name).unlink()
    os.mkfifo(path / name)  # reading a FIFO would block forever
    with pytest.raises(CheckpointError, match="not a regular file"):
        pt.lm.Transformer.load(path)


def test_an_alias_cannot_rewire_one_weight_to_another(tmp_path):
    untied = small(tie_embeddings=False)
    path = untied.save(tmp_path / "ck")
    state, meta = tensors_of(path)
    # 1. an alias that names a stored tensor: lm_head.weight would be replaced by embed.weight
    rewrite(path, state, {**meta, "ppl_thought.aliases": json.dumps({"lm_head.weight": "embed.weight"})})
    for _side, load in loaders(path):
        with pytest.raises(CheckpointError, match="stored themselves"):
            load()
    # 2. lm_head dropped and tied to the embedding although the config says tie_embeddings=False
    rewrite(path, {k: v for k, v in state.items() if k != "lm_head.weight"},
            {**meta, "ppl_thought.aliases": json.dumps({"lm_head.weight": "embed.weight"})})
    for _side, load in loaders(path):
        with pytest.raises(CheckpointError, match="tie_embeddings=False"):
            load()
    # 3. an alias to a name that is not stored
    rewrite(path, state, {**meta, "ppl_thought.aliases": json.dumps({"x": "nope"})})
    with pytest.raises(CheckpointError, match="not stored"):
        ptio.load_checkpoint(path)
    # 4. a tied model whose file stores both names (the last one loaded would win)
    tied = small().save(tmp_path / "tied")
    st, md = tensors_of(tied)
    rewrite(tied, {**st, "lm_head.weight": torch.zeros_like(st["embed.weight"])},
            {**md, "ppl_thought.aliases": "{}"})
    for _side, load in loaders(tied):
        with pytest.raises(CheckpointError, match="tie_embeddings=True"):
            load()


def test_unknown_metadata_is_refused(tmp_path):
    path = small().save(tmp_path / "ck")
    state, meta = tensors_of(path)
    rewrite(path, state, {**meta, "torch.hook": "evil"})
    for _side, load in loaders(path):
        with pytest.raises(CheckpointError, match="metadata"):
            load()


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_or_bool_weights_are_refused_not_cast(tmp_path, dtype):
    path = small().save(tmp_path / "ck")
    state, meta = tensors_of(path)
    state["norm.weight"] = torch.ones_like(state["norm.weight"], dtype=dtype)
    rewrite(path, state, meta)
    for _side, load in loaders(path):
        with pytest.raises(CheckpointError, match="norm.weight.*not as a float type"):
            load()


def test_nonfinite_weights_are_refused_unless_allowed(tmp_path):
    path = small().save(tmp_path / "ck")
    state, meta = tensors_of(path)
    state["embed.weight"] = torch.full_like(state["embed.weight"], float("nan"))
    rewrite(path, state, meta)
    for _side, load in loaders(path):
        with pytest.raises(CheckpointError, match=r"embed.weight.*NaN or inf.*allow_nonfinite=True"):
            load()
        model = load(allow_nonfinite=True)  # for debugging: loads as it is
        assert model.vocab_size == V


def test_a_vocabulary_of_another_size_than_the_model_is_refused(tmp_path):
    path = small().save(tmp_path / "ck", vocab=pt.Vocab([f"t{i}" for i in range(V - 6)]))
    header = json.loads((path / "config.json").read_text())
    header["config"]["vocab"]["tokens"] += ["a", "b"]  # 10 ids for a model of 8
    (path / "config.json").write_text(json.dumps(header))
    for _side, load in loaders(path):
        with pytest.raises(CheckpointError, match="vocabulary has 10 ids.*vocab_size is 8"):
            load()
    with pytest.raises(CheckpointError, match="10 ids"):
        pt.lm.Transformer.load_vocab(path)
    header["config"]["vocab"] = {"tokens": "abc", "specials": []}
    (path / "config.json").write_text(json.dumps(header))
    with pytest.raises(CheckpointError, match="vocabulary cannot be read"):
        pt.lm.Transformer.load(path)


@pytest.mark.parametrize("where", ["config", "extra"])
def test_a_deeply_nested_config_is_a_checkpoint_error_not_a_recursion_error(tmp_path, where):
    path = small().save(tmp_path / "ck")
    text = (path / "config.json").read_text()
    header = json.loads(text)
    deep = "[" * 100_000 + "]" * 100_000
    text = json.dumps({**header, where: "@@"}).replace('"@@"', deep)
    (path / "config.json").write_text(text)
    for _side, load in loaders(path):
        with pytest.raises(CheckpointError, match="nested 100001 levels"):
            load()
    with pytest.raises(CheckpointError, match="nested"):
        pt.infer.load_result(path)
    # and nothing that deep is written in the first place
    nested: list = []
    for _ in range(200):
        nested = [nested]
    with pytest.raises(CheckpointError, match="nested"):
        ptio.save_checkpoint(tmp_path / "deep", {"w": torch.ones(1)}, {"a": nested})
    assert not (tmp_path / "deep" / "config.json").exists()


def test_loaded_models_are_in_eval_mode(tmp_path):
    model = small(dropout=0.1).train()
    path = model.save(tmp_path / "ck")
    loaded = pt.lm.Transformer.load(path)
    assert not loaded.training and not any(m.training for m in loaded.modules())
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(x)[0], loaded(x)[0])  # no dropout


# ---------------------------------------------------------------------------------------------- saved results
def _result() -> pt.infer.Result:
    return pt.infer.Result(samples={"z": torch.arange(6.0).reshape(3, 2)}, log_weights=torch.tensor([0.0, -1.0, -2.0]),
                           log_marginal=torch.tensor(-0.5), engine="Importance")


def test_a_saved_result_whose_tree_names_a_missing_tensor_is_a_checkpoint_error(tmp_path):
    path = pt.infer.save_result(tmp_path / "r", _result())
    header = json.loads((path / "config.json").read_text())
    text = json.dumps(header).replace('"__tensor__": "result/samples/z"', '"__tensor__": "result/samples/gone"')
    assert text != json.dumps(header)
    (path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="result/samples/gone"):
        pt.infer.load_result(path)
    header["config"]["tree"] = {"__weird__": 1}
    (path / "config.json").write_text(json.dumps(header))
    with pytest.raises(CheckpointError, match="unknown kind"):
        pt.infer.load_result(path)
    header["config"]["tree"] = [1, 2]
    (path / "config.json").write_text(json.dumps(header))
    with pytest.raises(CheckpointError, match="not the fields"):
        pt.infer.load_result(path)


def test_save_result_never_stores_two_values_under_one_name(tmp_path):
    t0, t1 = torch.tensor([1.0]), torch.tensor([2.0])
    r = pt.infer.Result(samples={"a": [t0], "a/0": t1}, engine="x")
    back = pt.infer.load_result(pt.infer.save_result(tmp_path / "r", r))
    assert torch.equal(back.samples["a"][0], t0) and torch.equal(back.samples["a/0"], t1)
    r = pt.infer.Result(samples={"a%2F0": t1, "a/0": t0}, engine="x")
    back = pt.infer.load_result(pt.infer.save_result(tmp_path / "r2", r))
    assert torch.equal(back.samples["a%2F0"], t1) and torch.equal(back.samples["a/0"], t0)
    # keys that are equal as strings cannot both be kept: refused, not merged
    with pytest.raises(ArgumentTypeError, match="samples"):  # names are strings (the type layer)
        pt.infer.Result(samples={1: t0, "1": t1}, engine="x")
    res = pt.infer.Result(samples={"1": t1}, engine="x")
    res.samples[1] = t0  # put there behind the constructor's back
    with pytest.raises(CheckpointError, match="equal as strings"):
        pt.infer.save_result(tmp_path / "r3", res)


# ---------------------------------------------------------------------------------------------- Trainer
def _trainer(seed: int = 0):
    import functools

    from _training_fixtures import problem

    from ppl_thought.training import OneSampler, Trainer

    prior, q, model, guide = problem(seed, seed + 1)
    return Trainer(model, guide, OneSampler(4), {"prior": prior, "sampler": q},
                   optimizer=functools.partial(torch.optim.Adam, lr=0.1), progress=False)


def test_trainer_load_is_all_or_nothing(tmp_path):
    """At 60fef74 Trainer.load wrote each module's weights as it went and failed on the damaged one after
    overwriting the others."""
    import pyro

    pyro.clear_param_store()
    src = _trainer(0)
    path = src.save(tmp_path / "ck")
    state, meta = tensors_of(path)
    # damage the last module tensor of the file: a loader that overwrites as it goes has changed the others
    last = sorted(k for k in state if k.startswith("module/") and state[k].is_floating_point())[-1]
    good = state[last]
    dst = _trainer(1)
    snapshot = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in dst.modules.items()}

    def unchanged() -> bool:
        return all(torch.equal(snapshot[n][k], v) for n, m in dst.modules.items() for k, v in m.state_dict().items())

    assert not all(torch.equal(snapshot[n][k], src.modules[n].state_dict()[k]) for n in snapshot for k in snapshot[n])
    for bad, phrase in [(torch.ones(good.numel() + 1), "has shape"),
                        (torch.full_like(good, float("inf")), "NaN or inf"),
                        (torch.ones(good.shape, dtype=torch.int64), "refused, not cast")]:
        state[last] = bad
        rewrite(path, state, meta)
        with pytest.raises(CheckpointError, match=phrase):
            dst.load(path)
        assert unchanged(), phrase
    state[last] = good
    rewrite(path, state, meta)
    dst.load(path)
    assert all(torch.equal(src.modules[n].state_dict()[k], v) for n, m in dst.modules.items()
               for k, v in m.state_dict().items())
    pyro.clear_param_store()


# ---------------------------------------------------------------------------------------------- diagnose
def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ppl_thought.cli", "diagnose", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_diagnose_answers_damaged_folders_and_a_file_as_out_with_one_line(tmp_path, capsys):
    """Each damage through ``cli.main`` in-process, and the deepest one (a config nested 50 000 levels) once more
    through the installed command's path, ``python -m ppl_thought.cli``, in a real subprocess (its exit status and
    stderr as a shell sees them; each one costs seconds of imports)."""
    from ppl_thought import cli

    good = pt.infer.save_result(tmp_path / "good", _result())
    damaged = pt.infer.save_result(tmp_path / "bad", _result())
    header = json.loads((damaged / "config.json").read_text())
    (damaged / "config.json").write_text(
        json.dumps(header).replace('"__tensor__": "result/samples/z"', '"__tensor__": "nope"'))
    deep = pt.infer.save_result(tmp_path / "deep", _result())
    (deep / "config.json").write_text('{"format": ' + "[" * 50_000 + "]" * 50_000 + "}")
    gone = pt.infer.save_result(tmp_path / "gone", _result())
    (gone / json.loads((gone / "config.json").read_text())["tensors"]["file"]).unlink()
    a_file = tmp_path / "plots.txt"
    a_file.write_text("x")

    def check(args, code, err, phrase):
        assert code == 2, (args, err[-500:])
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-500:]
        assert err.startswith("ppl-thought diagnose:") and phrase in err, err

    r = _cli(deep)
    check((deep,), r.returncode, r.stderr, "nested")
    cases = [((damaged,), "nope"), ((deep,), "nested"), ((gone,), "missing"), ((good, "--out", a_file), "is a file")]
    for args, phrase in cases:
        capsys.readouterr()
        try:
            code = cli.main(["diagnose", *map(str, args)])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        check(args, code, capsys.readouterr().err, phrase)


def test_numpy_side_reads_the_same_checks(tmp_path):
    """ppl_thought.checkpoint.load_numpy (torch-free) refuses what io.load_checkpoint refuses."""
    from ppl_thought.checkpoint import load_numpy

    path = ptio.save_checkpoint(tmp_path / "ck", {"w": torch.ones(2)}, {})
    state, meta = tensors_of(path)
    rewrite(path, state, {**meta, "other": "x"})
    for load in (load_numpy, ptio.load_checkpoint):
        with pytest.raises(CheckpointError, match="metadata"):
            load(path)
    rewrite(path, state, meta)
    assert np.array_equal(load_numpy(path)[0]["w"], np.ones(2, np.float32))
