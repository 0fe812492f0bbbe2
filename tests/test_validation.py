"""The type layer at the public boundary (ppl_thought/validation.py, issue 32 item 1).

Each case below was a silent wrong answer or a raw error from deep inside torch before the layer: a float
token id read as ``<bos>``, a float thought length, a float attention window, a string particle count, ``None``
as the prior. Now each is an :class:`ArgumentTypeError` (a ``PPLThoughtError`` and a ``TypeError``) that names
the callable, the argument, the value and the declared type.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ppl_thought as pt
from ppl_thought.errors import ArgumentTypeError, PPLThoughtError
from ppl_thought.validation import ENABLED, UNCHECKED, checked

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("data", "diagnostics", "distributions", "guides", "inference", "lm", "models", "projections",
               "training", "transforms", "verifiers")

pytestmark = pytest.mark.skipif(not ENABLED, reason="PPL_THOUGHT_TYPECHECK=0 turns the type layer off")


def _vocab():
    return pt.Vocab(["a", "b", "c"])


CASES = {
    "float token id": (lambda: _vocab().token(1.5), "Vocab.token", "i=1.5"),
    "float thought length": (lambda: pt.projections.PauseToThink(_vocab(), 1.5), "PauseToThink.__init__",
                             "max_thought_len=1.5"),
    "float window": (lambda: pt.lm.Transformer(8, window=2.5), "Transformer.__init__", "window=2.5"),
    "string particle count": (lambda: pt.infer.SMC("64"), "SMC.__init__", "num_particles='64'"),
    "None as the prior": (lambda: pt.models.SlowThinking(None, pt.projections.Identity(_vocab())),
                          "SlowThinking.__init__", "prior="),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_types_at_the_boundary_name_the_argument(case):
    call, where, what = CASES[case]
    with pytest.raises(ArgumentTypeError) as e:
        call()
    assert isinstance(e.value, PPLThoughtError) and isinstance(e.value, TypeError)
    assert where in str(e.value) and what in str(e.value), str(e.value)


def test_numbers_of_any_framework_still_count_as_numbers():
    """The numeric tower: a NumPy integer is an ``int``, an ``int`` or a NumPy float is a ``float``."""
    v = _vocab()
    assert v.token(np.int64(v.id("a"))) == "a"
    assert pt.infer.SMC(np.int64(8)).num_particles == 8
    pt.lm.Transformer(np.int64(8), d_model=16, n_layers=1, n_heads=2, window=np.int32(4))

    @checked
    def f(x: float) -> float:
        return x

    assert f(3) == 3 and f(np.float32(0.5)) == 0.5
    with pytest.raises(ArgumentTypeError):
        f("0.5")


def test_every_public_hint_compiles():
    """beartype understood every hint of every public callable (a hint it cannot compile would leave that callable
    unchecked, silently)."""
    for name in SUBPACKAGES:
        mod = importlib.import_module(f"ppl_thought.{name}")
        for attr in mod.__all__:
            getattr(mod, attr)
    assert UNCHECKED == {}


def test_public_callables_are_checked():
    """Every public callable with hinted parameters is the checked one, except the per-step methods the layer
    leaves alone on purpose (``validation._HOT``); without the layer (a plain function) this test fails."""
    from ppl_thought.validation import _HOT

    seen = 0
    for where, fn in _public_callables():
        if where.rsplit(".", 1)[-1] in _HOT or not set(fn.__annotations__) - {"return"}:
            continue
        assert getattr(fn, "__ppl_thought_checked__", False), f"{where} is not checked"
        seen += 1
    assert seen >= 360  # 373 checked public callables when this test was written


def test_the_layer_turns_off_with_the_environment():
    code = ("import ppl_thought as pt; from ppl_thought.validation import ENABLED; assert not ENABLED; "
            "pt.infer.SMC(8); print(type(pt.Vocab(['a']).token).__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PPL_THOUGHT_TYPECHECK": "0", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "method"


def test_a_tensor_id_passes_the_type_layer_and_meets_the_value_check():
    """A 0-d tensor is an id to the type layer (an array); the value check still refuses a float one."""
    v = _vocab()
    assert v.token(torch.tensor(v.id("b"))) == "b"
    with pytest.raises(PPLThoughtError, match="integer"):
        v.token(torch.tensor(1.5))


def _public_callables():
    """(qualified name, function) of every callable the type layer checks: the functions in a subpackage's
    ``__all__`` and, of its classes, ``__init__``, ``__call__``, the public methods, static and class methods."""
    for name in SUBPACKAGES:
        mod = importlib.import_module(f"ppl_thought.{name}")
        for attr in mod.__all__:
            obj = getattr(mod, attr)
            if not str(getattr(obj, "__module__", "")).startswith("ppl_thought"):
                continue
            if inspect.isfunction(obj):
                yield f"ppl_thought.{name}.{attr}", obj
            elif inspect.isclass(obj) and not issubclass(obj, BaseException):
                for key, value in vars(obj).items():
                    if key.startswith("_") and key not in ("__init__", "__call__"):
                        continue
                    fn = value.__func__ if isinstance(value, staticmethod | classmethod) else value
                    if inspect.isfunction(fn):
                        yield f"ppl_thought.{name}.{attr}.{key}", fn


def _unhinted(fn) -> list[str]:
    """The parameters of ``fn`` without a hint (``self`` / ``cls`` and ``*args`` / ``**kwargs`` aside)."""
    sig = inspect.signature(fn)
    return [p for p, q in sig.parameters.items() if p not in ("self", "cls") and p not in fn.__annotations__
            and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]


def test_every_public_parameter_has_a_hint():
    """A parameter without a hint is a parameter the type layer cannot check: every public callable hints all
    of its parameters, so a wrong type anywhere at the boundary is an ArgumentTypeError naming it."""
    missing, seen = [], 0
    for where, fn in _public_callables():
        seen += 1
        if gaps := _unhinted(fn):
            missing.append(f"{where}: {', '.join(gaps)}")
    assert seen >= 480  # 492 public callables when this test was written (147 of them had unhinted parameters)
    assert missing == [], "\n".join(missing)


def test_the_hint_check_sees_a_missing_hint():
    """The check above is not vacuous: a function with one unhinted parameter is reported, a hinted one is not."""

    def half(x: int, y, *args, **kwargs) -> int:
        return x

    def full(x: int, y: str = "", *args: int) -> int:
        return x

    assert _unhinted(half) == ["y"] and _unhinted(full) == []
    assert _unhinted(checked(half)) == ["y"]  # read through the layer's wrapper too


def test_a_0d_array_where_a_sequence_is_hinted_is_an_argument_type_error():
    """Found by the public sweep: beartype sizes an ``Iterable[str]`` argument with len(), which a 0-d tensor or
    array answers with a bare TypeError (``pt.Vocab(torch.tensor(nan))``). The layer names the argument now; an
    error of the function's own body passes unchanged."""
    for bad in (torch.tensor(float("nan")), np.array(1.0)):
        with pytest.raises(ArgumentTypeError, match="tokens="):
            pt.Vocab(bad)
    with pytest.raises(pt.errors.VocabularyError, match="twice"):
        pt.Vocab(["a", "a"])  # the body's own error, not rewritten
    assert len(pt.Vocab(np.array(["a", "b"]))) == len(pt.Vocab(["a", "b"]))
    with pytest.raises(TypeError, match="missing 1 required positional argument") as info:
        pt.Vocab()  # a call that does not bind keeps Python's own error
    assert not isinstance(info.value, PPLThoughtError)


def test_io_is_under_the_type_layer_and_checks_what_it_writes(tmp_path, monkeypatch):
    """pt.io has an __all__ and the type layer; save_checkpoint refuses a state that is not names -> tensors and a
    config JSON cannot hold before writing anything; nonfinite_names refuses a non-mapping (was AttributeError)."""
    from ppl_thought.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    assert set(pt.io.__all__) == {"load_checkpoint", "load_checkpoint_raw", "nonfinite_names", "save_checkpoint"}
    with pytest.raises(ArgumentTypeError, match="path"):
        pt.io.save_checkpoint(None, {"w": torch.ones(1)}, {})
    with pytest.raises(ArgumentTypeError, match="module"):
        pt.io.save_checkpoint("ck", {"w": 1.5}, {})
    with pytest.raises(ArgumentTypeError, match="config"):
        pt.io.save_checkpoint("ck", {"w": torch.ones(1)}, 1.5)
    with pytest.raises(ConfigError, match="config must be JSON-serialisable"):
        pt.io.save_checkpoint("ck", {"w": torch.ones(1)}, {"a": object()})
    assert not Path("ck").exists()  # nothing written for a refused call
    for bad in (None, b"\x00", {"w": 1}):
        with pytest.raises(ConfigError, match="state"):
            pt.io.nonfinite_names(bad)
    assert pt.io.nonfinite_names({"a": torch.ones(2), "b": torch.tensor([float("nan")])}) == ["b"]


def test_io_round_trip_still_works_under_the_layer(tmp_path):
    path = pt.io.save_checkpoint(tmp_path / "ck", {"w": torch.arange(3.0)}, {"a": 1}, {"e": [1, 2]})
    state, config, extra = pt.io.load_checkpoint(str(path))
    assert torch.equal(state["w"], torch.arange(3.0)) and config == {"a": 1} and extra == {"e": [1, 2]}
