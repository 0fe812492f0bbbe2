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
from ppl_thought.validation import ENABLED, checked, not_checked, per_token, resolve_all

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
    assert resolve_all() == {}  # each check compiles on its first call: compile them all now


def test_public_callables_are_checked():
    """Every public callable with hinted parameters is the checked one, except the per-step methods marked
    ``@per_token`` at their definition; without the layer (a plain function) this test fails."""
    seen = 0
    for where, fn in _public_callables():
        if getattr(fn, "__ppl_thought_per_token__", False) or not set(fn.__annotations__) - {"return"}:
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


# ------------------------------------------------------------------------------ the layer is visible at the definition
NUMPYRO_SUBPACKAGES = ("dist", "distributions", "guides", "handlers", "infer", "lm", "models", "program", "transforms",
                       "inference_data")


def _all_modules():
    yield importlib.import_module("ppl_thought")
    for name in (*SUBPACKAGES, "io"):
        yield importlib.import_module(f"ppl_thought.{name}")
    try:
        importlib.import_module("ppl_thought.numpyro")
    except ImportError:  # pragma: no cover -- no JAX here
        return
    yield importlib.import_module("ppl_thought.numpyro")
    for name in NUMPYRO_SUBPACKAGES:
        yield importlib.import_module(f"ppl_thought.numpyro.{name}")


def test_every_exported_name_is_decorated_or_exempt_with_a_reason():
    """Every function and class in an ``__all__`` of ``ppl_thought`` and ``ppl_thought.numpyro`` carries
    ``@checked`` / ``@checked_jax`` (a class: in its own dict) or ``@not_checked(reason)``, and the object in its
    home module is that decorated object: no second copy bound anywhere else (check_exports's rebinding is gone)."""
    import ppl_thought.validation as validation

    assert not hasattr(validation, "check_exports") and not hasattr(validation, "_HOT")
    seen, exempt = 0, {}
    for mod in _all_modules():
        for attr in getattr(mod, "__all__", ()):
            obj = getattr(mod, attr)
            home = str(getattr(obj, "__module__", ""))
            if not home.startswith("ppl_thought") or not (inspect.isfunction(obj) or inspect.isclass(obj)) or \
                    (inspect.isclass(obj) and issubclass(obj, BaseException)):
                continue
            where = f"{mod.__name__}.{attr}"
            reason = obj.__dict__.get("__ppl_thought_exempt__") if inspect.isclass(obj) else \
                getattr(obj, "__ppl_thought_exempt__", None)
            if reason is not None:
                assert isinstance(reason, str) and len(reason) > 20, f"{where}: exempt without a reason"
                exempt[where] = reason
                continue
            mark = obj.__dict__.get("__ppl_thought_checked__") if inspect.isclass(obj) else \
                getattr(obj, "__ppl_thought_checked__", False)
            assert mark, f"{where} is neither @checked nor @not_checked(reason)"
            assert getattr(importlib.import_module(home), obj.__name__) is obj, f"{where}: not its home's object"
            if inspect.isfunction(obj):
                assert checked(obj) is obj  # one wrapper: checking it again changes nothing
            seen += 1
    assert seen >= 240  # 241 decorated public names when this test was written (179 torch, 62 JAX)
    assert set(exempt) >= {"ppl_thought.Program", "ppl_thought.sample"}  # the step protocol and its verbs


def test_no_module_rebinds_the_layer_at_import():
    """No source file calls a rebinding helper or names methods to skip by string: the marks are at definitions."""
    import ast

    for path in (ROOT / "ppl_thought").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name | ast.Attribute):
                name = node.id if isinstance(node, ast.Name) else node.attr
                assert name not in ("check_exports", "check_here", "_HOT", "__ppl_thought_hot__"), \
                    f"{path.relative_to(ROOT)}:{node.lineno}: {name}"


def test_a_per_token_method_is_exempt_by_its_marker():
    """``@checked`` on a class checks ``__init__``, ``__call__`` and the public methods, not one marked
    ``@per_token``, nor a private one; a subclass's own methods are its decorator's, inherited ones stay checked."""

    @checked
    class Engine:
        def __init__(self, n: int):
            self.n = n

        def run(self, x: int) -> int:
            return x + self.n

        @per_token
        def step(self, x: int) -> int:
            return x

        def _helper(self, x: int) -> int:
            return x

    e = Engine(2)
    with pytest.raises(ArgumentTypeError, match="run"):
        e.run("1")
    with pytest.raises(ArgumentTypeError, match="__init__"):
        Engine("2")
    assert e.step("1") == "1" and e._helper("1") == "1"  # unchecked: the marker, the underscore
    assert Engine.step.__ppl_thought_per_token__ and not hasattr(Engine.step, "__wrapped__")

    @checked
    class Faster(Engine):
        def extra(self, y: float) -> float:
            return y

    with pytest.raises(ArgumentTypeError, match="run"):
        Faster(1).run("1")  # inherited: checked where it is defined
    with pytest.raises(ArgumentTypeError, match="extra"):
        Faster(1).extra("y")

    @not_checked("a class this test leaves alone on purpose")
    class Free:
        def run(self, x: int) -> int:
            return x

    assert Free().run("x") == "x"


def test_the_library_marks_its_per_token_methods():
    """The per-step methods of the library's classes carry the marker and stay plain functions."""
    for cls, name in ((pt.lm.Transformer, "forward"), (pt.lm.Transformer, "step"), (pt.dist.LMSequence, "log_prob"),
                      (pt.projections.Automaton, "mask")):
        fn = vars(cls)[name]
        assert getattr(fn, "__ppl_thought_per_token__", False), f"{cls.__name__}.{name}"
        assert not getattr(fn, "__ppl_thought_checked__", False)
    assert getattr(vars(pt.lm.Transformer)["__init__"], "__ppl_thought_checked__", False)


def test_a_hint_naming_what_is_defined_later_is_read_at_the_first_call():
    """The check compiles on the first call, so a hint may name a class defined after the function (the module
    is complete by then); the body's own TypeError passes unchanged, the check's is an ArgumentTypeError."""
    ns: dict = {}
    exec("from __future__ import annotations\n"
         "def f(x: Later) -> int:\n"
         "    raise TypeError('from the body')\n"
         "class Later:\n"
         "    pass\n", ns)
    f = checked(ns["f"])
    with pytest.raises(TypeError, match="from the body") as info:
        f(ns["Later"]())
    assert not isinstance(info.value, PPLThoughtError)
    with pytest.raises(ArgumentTypeError, match="x="):
        f(1)


# ------------------------------------------------------------------------------ every raise a user meets names a class
#: (file, enclosing function) -> why a bare builtin exception is right there
BARE_RAISES_ALLOWED = {
    ("ppl_thought/demo.py", "json_default"): "json.dumps's default= hook must raise TypeError for a value it cannot "
                                             "encode (json's protocol, not a user's error)",
}


def _bare_raises(root: Path = ROOT):
    import ast

    for path in sorted((root / "ppl_thought").rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in ("ValueError", "TypeError", "RuntimeError"):
                up = parents.get(node)
                while up is not None and not isinstance(up, ast.FunctionDef | ast.AsyncFunctionDef):
                    up = parents.get(up)
                yield str(path.relative_to(root)), getattr(up, "name", "<module>"), node.lineno, exc.id


def test_no_bare_builtin_raise_outside_the_allow_list():
    """Every raise a user can reach is a PPLThoughtError subclass (ppl_thought/errors.py): a bare ValueError /
    TypeError / RuntimeError only where BARE_RAISES_ALLOWED says why."""
    found = list(_bare_raises())
    bad = [f"{f}:{line} {exc} in {fn}()" for f, fn, line, exc in found if (f, fn) not in BARE_RAISES_ALLOWED]
    assert bad == [], "\n".join(bad)
    assert {(f, fn) for f, fn, _, _ in found} == set(BARE_RAISES_ALLOWED)  # no stale entry


def test_the_raise_scan_sees_a_bare_raise(tmp_path):
    """The scan above is not vacuous: a module with bare raises (called or not, nested) is reported."""
    (tmp_path / "ppl_thought").mkdir()
    (tmp_path / "ppl_thought" / "m.py").write_text(
        "def f(x):\n    if x:\n        raise ValueError('x')\n    raise TypeError\n"
        "def g():\n    raise ConfigError('fine')\n")
    assert sorted(_bare_raises(tmp_path)) == [("ppl_thought/m.py", "f", 3, "ValueError"),
                                              ("ppl_thought/m.py", "f", 4, "TypeError")]


def test_numeric_array_formats_the_value_only_for_its_message():
    """checks.numeric_array runs on every Automaton build (each program run): it reads dtypes and numbers, and
    formats the value (a repr of an array costs more than the check) only when it raises, naming the value."""
    from ppl_thought import checks
    from ppl_thought.errors import ConfigError

    class Counted(list):
        reprs = 0

        def __repr__(self) -> str:
            Counted.reprs += 1
            return super().__repr__()

    checks.numeric_array("table", Counted([[0.5, 1.0], [2.0, 3.0]]))
    checks.numeric_array("table", Counted([torch.zeros(2), np.ones(3)]))
    assert Counted.reprs == 0
    with pytest.raises(ConfigError, match=r"table must be .*got Counted \[1\.5, 'a'\]"):
        checks.numeric_array("table", Counted([1.5, "a"]))
    assert Counted.reprs == 1
