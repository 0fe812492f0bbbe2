"""Property-based robustness suite (hypothesis): bad input to every public entry point gets a clear error.

Each *family* below draws inputs for one entry point (Vocab, encode/decode, projections' lifting/project,
LMSequence arguments and log_prob values, Importance/SMC arguments, Tabular logits, Transformer.load on
corrupted folders, checkpoint configs) and says, by an oracle written from the documented contract (not from
the code under test), whether an input is bad. Then:

* a bad input must raise a :class:`ppl_thought.errors.PPLThoughtError` whose message names the problem (a
  phrase of the family), never NaN, never a value, never a bare torch / numpy / Python exception;
* a valid input must return, and every log-probability it gives is finite or -inf (never NaN), with the
  family's exact checks (round trips, liftings that project back, sampled log-probs that score back).

The CLI gets random argument lists: every one ends with exit status 0 or 2 and no traceback.

``benchmarks/robustness.py`` runs the same families (fixed seed, ``derandomize``) and adds their bad inputs
to its table's counts. Examples per family: 25 by default, 300 with ``--slow`` (the ``slow`` hypothesis
profile, see conftest.py).
"""

from __future__ import annotations

import contextlib
import io as _io
import json
import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ppl_thought as pt
from ppl_thought.errors import PPLThoughtError, ZeroWeightsError
from ppl_thought.vocab import EOS_ID, PAD_ID, RESERVED

VOCAB = pt.Vocab(["a", "b"])
V = len(VOCAB)
CRASH_TYPES = (RuntimeError, IndexError, KeyError, AttributeError, ZeroDivisionError, AssertionError, TypeError,
               ValueError, OverflowError, MemoryError, NotImplementedError)


# ---------------------------------------------------------------------------------------------- the harness
@dataclass
class Case:
    """One input: ``bad`` (by the oracle), the call, the phrase a bad input's message must match (a regex), and
    for a valid input a check of its answer (raises AssertionError when wrong)."""

    bad: bool
    call: Callable[[], Any]
    phrase: str = ""
    check: Callable[[Any], None] | None = None
    allowed: tuple[type[PPLThoughtError], ...] = field(default_factory=tuple)  # library errors a valid input may get


def _nan_in(out) -> bool:
    if isinstance(out, torch.Tensor):
        return bool(out.is_floating_point() and torch.isnan(out).any())
    if isinstance(out, tuple | list):
        return any(_nan_in(o) for o in out)
    if isinstance(out, float):
        return math.isnan(out)
    return False


def outcome(case: Case) -> tuple[str, str]:
    """``(answer, message)``. For a bad input the answer is ``clear`` / ``unclear`` / ``silent`` / ``crash`` (as in
    benchmarks/robustness.py); for a valid input ``ok`` or ``wrong`` (refused, NaN, or a failed check)."""
    try:
        with torch.no_grad():
            out = case.call()
    except PPLThoughtError as e:
        msg = f"{type(e).__name__}: {e}"[:200]
        if case.bad:
            return ("clear" if re.search(case.phrase, str(e), re.IGNORECASE) else "unclear"), msg
        return ("ok" if isinstance(e, case.allowed) else "wrong"), msg
    except CRASH_TYPES as e:
        return ("crash" if case.bad else "wrong"), f"{type(e).__name__}: {e}"[:200]
    except Exception as e:  # noqa: BLE001 - any other exception type is an answer, but not the library's
        return ("unclear" if case.bad else "wrong"), f"{type(e).__name__}: {e}"[:200]
    if case.bad:
        return "silent", ("NaN" if _nan_in(out) else f"returned {type(out).__name__}")
    if _nan_in(out):
        return "wrong", "NaN"
    if case.check is not None:
        try:
            case.check(out)
        except AssertionError as e:
            return "wrong", f"check failed: {e}"[:200]
    return "ok", ""


def _is_int(v) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def _finite_or_minus_inf(lp: torch.Tensor) -> None:
    assert not torch.isnan(lp).any() and not torch.isposinf(lp).any() and (lp <= 1e-5).all(), lp


# ---------------------------------------------------------------------------------------------- families
def _vocab_build(inp) -> Case:
    tokens, extra = inp
    specials = list(RESERVED) + extra
    ok_sp = all(isinstance(s, str) and s and not any(c.isspace() for c in s) for s in specials) \
        and len(set(specials)) == len(specials)
    ok_tok = len(tokens) > 0 and all(isinstance(t, str) and t and not any(c.isspace() for c in t) for t in tokens) \
        and len(set(tokens)) == len(tokens) and not set(tokens) & set(specials)

    def check(v: pt.Vocab) -> None:
        ids = list(range(len(v)))
        assert v.encode(v.decode(ids, skip_pad=False)) == ids, (v.tokens, v.decode(ids, skip_pad=False))
        for t in tokens:
            assert v.token(v.id(t)) == t

    return Case(not (ok_sp and ok_tok), lambda: pt.Vocab(tokens, specials=specials),
                r"token|special|vocabulary", check)


_vocab_build_inputs = st.one_of(
    st.tuples(  # mostly bad: empty, whitespace, duplicate, non-string tokens and specials
        st.lists(st.one_of(st.text(alphabet="ab<>/s \t", max_size=3), st.integers(-2, 2), st.none()), max_size=4),
        st.lists(st.one_of(st.text(alphabet="<x>/ ", max_size=4), st.integers(0, 3)), max_size=2)),
    st.tuples(  # mostly valid, with tokens that spell parts of specials ("<", "s>", "</"): the round trip
        st.lists(st.text(alphabet="ab<>/sx", min_size=1, max_size=3), min_size=1, max_size=4, unique=True),
        st.lists(st.sampled_from(["<x>", "<q>", "<y>"]), max_size=1)))

_TOKEN_RE = re.compile(r"\s*(?:(?:<pad>|<bos>|<eos>|<s>|</s>|<explain>|a|b)\s*)*")


def _vocab_encode(text: str) -> Case:
    def check(ids) -> None:
        assert VOCAB.encode(VOCAB.decode(ids, skip_pad=False)) == ids

    return Case(_TOKEN_RE.fullmatch(text) is None, lambda: VOCAB.encode(text), r"tokenize|token", check)


def _vocab_decode(ids) -> Case:
    flat = list(np.asarray(ids, dtype=object).ravel()) if isinstance(ids, np.ndarray) else ids
    good = all(_is_int(i) and 0 <= i < V for i in flat) and (not isinstance(ids, np.ndarray) or ids.ndim <= 1)

    def check(text: str) -> None:
        assert VOCAB.encode(text) == [int(i) for i in flat if i != PAD_ID]

    return Case(not good, lambda: VOCAB.decode(ids), r"id|token|integer", check)


_vocab_decode_inputs = st.one_of(
    st.lists(st.one_of(st.integers(-3, 11), st.floats(allow_nan=True), st.text(max_size=2), st.booleans()),
             max_size=5),
    hnp.arrays(st.sampled_from([np.int64, np.float32]), hnp.array_shapes(min_dims=1, max_dims=2, max_side=3),
               elements=st.integers(-1, 9)))

PROJECTIONS = {"pause": pt.projections.PauseToThink(VOCAB, max_thought_len=1),
               "identity": pt.projections.Identity(VOCAB),
               "query_response": pt.projections.QueryResponse(VOCAB, max_thought_len=1)}

_id_sequences = st.one_of(
    st.lists(st.integers(-2, V + 1), max_size=4),
    st.lists(st.floats(-1, 9), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=2), min_size=1, max_size=2),
    st.sampled_from(["ab", "a<eos>", "zz", "a <s>", ""]),
)


def _as_ids(seq) -> list[int] | None:
    """The ids of a 1-D integer sequence (text encoded), None if it is not one (or has unknown tokens)."""
    if isinstance(seq, str):
        return VOCAB.encode(seq) if _TOKEN_RE.fullmatch(seq) else None
    if all(_is_int(v) for v in seq):
        return [int(v) for v in seq]
    return None


def _lifting(inp) -> Case:
    name, x = inp
    proj = PROJECTIONS[name]
    ids = _as_ids(x)
    # every string of observable tokens is a prefix of each of these projections' images (<eos> included)
    good = ids is not None and all(i in set(VOCAB.observable_ids.tolist()) for i in ids)

    def check(auto) -> None:
        zs = auto.enumerate(limit=10_000)
        assert zs, "empty lifting"
        for z in zs:
            assert proj.project(np.asarray(z, dtype=np.int64)).tolist() == ids, (z, ids)

    return Case(not good, lambda: proj.lifting(x), r"observ|image|token|ids?\b|sequence|integer|1-D", check)


def _project(inp) -> Case:
    name, z = inp
    proj = PROJECTIONS[name]
    batch = isinstance(z, list) and bool(z) and all(isinstance(r, list) for r in z)  # a list of 1-D strings
    rows = [_as_ids(r) for r in z] if batch else [_as_ids(z)]
    good = all(r is not None and all(0 <= i < V for i in r) for r in rows)

    def check(x) -> None:
        for xi in (x if batch else [x]):
            assert set(np.asarray(xi).tolist()) <= set(VOCAB.observable_ids.tolist())

    return Case(not good, lambda: proj.project(z), r"token|ids?\b|integer|1-D|domain|outside",
                check, allowed=(pt.errors.NotInDomainError,))


def _tab(seed: int = 0, order: int = 2) -> pt.lm.Tabular:
    g = torch.Generator().manual_seed(seed)
    return pt.lm.Tabular(order, V, torch.randn((V,) * order, generator=g), trainable=False)


_TAB = _tab()


def _lmsequence_args(inp) -> Case:
    max_len, stop, prompt, constrained = inp
    constraint = PROJECTIONS["pause"].domain(2) if constrained else None
    ok_len = (_is_int(max_len) and max_len >= 0) or (max_len is None and constrained)
    stops = [] if stop is None else (stop if isinstance(stop, list) else [stop])
    ok_stop = all((_is_int(s) and 0 <= s < V) or (isinstance(s, str) and s in VOCAB) for s in stops)
    ok_prompt = prompt is None or (_as_ids(prompt) is not None and all(0 <= i < V for i in _as_ids(prompt)))

    def call():
        seq = pt.dist.LMSequence(_TAB, prompt=prompt, constraint=constraint, stop=stop, max_len=max_len,
                                 vocab=VOCAB)
        z, lp = seq.sample_with_log_prob((3,))
        return z, lp, seq.log_prob(z)

    def check(out) -> None:
        z, lp, lp2 = out
        _finite_or_minus_inf(lp)
        torch.testing.assert_close(lp, lp2, atol=1e-5, rtol=1e-5)

    return Case(not (ok_len and ok_stop and ok_prompt), call, r"max_len|stop|prompt|token|ids?\b|integer|length",
                check)


_lmsequence_args_inputs = st.tuples(
    st.one_of(st.integers(-2, 5), st.floats(-1, 5), st.none(), st.booleans(), st.sampled_from(["3", "x"])),
    st.one_of(st.none(), st.integers(-2, V + 1), st.sampled_from(["<eos>", "</s>", "zz", ""]),
              st.lists(st.integers(-1, V), max_size=2), st.floats(0, 3)),
    st.one_of(st.none(), st.lists(st.integers(-1, V), max_size=3), st.sampled_from(["ab", "zz", ""]),
              st.lists(st.floats(0, 3), min_size=1, max_size=2)),
    st.booleans())

_SEQ = pt.dist.LMSequence(_TAB, max_len=4, stop=EOS_ID)


def _lmsequence_log_prob(value) -> Case:
    a = np.asarray(value)
    good = a.ndim >= 1 and np.issubdtype(a.dtype, np.integer) and a.dtype != np.bool_
    if good and a.size:
        good = a.min() >= 0 and a.max() < V
        nonpad = a != PAD_ID
        good = good and not (nonpad[..., 1:] & ~nonpad[..., :-1]).any() and nonpad.sum(-1).max() <= 4

    def check(lp) -> None:
        assert lp.shape == a.shape[:-1], (lp.shape, a.shape)
        _finite_or_minus_inf(lp)

    return Case(not good, lambda: _SEQ.log_prob(torch.as_tensor(value)),
                r"integer|pad|max_len|ids?\b|outside|sequence|dimension", check)


_shapes = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=6)
_lmsequence_values = st.one_of(
    hnp.arrays(st.sampled_from([np.int64, np.int32, np.uint8]), _shapes,
               elements=st.integers(0, 1) | st.integers(0, V + 1) | st.just(PAD_ID)),
    hnp.arrays(np.int64, _shapes, elements=st.integers(-2, V - 1)),
    hnp.arrays(np.float32, _shapes, elements=st.integers(0, V - 1).map(float)),
    hnp.arrays(np.bool_, _shapes))


def _model():
    return pt.models.SlowThinking(_TAB, PROJECTIONS["pause"])


def _engine_args(inp) -> Case:
    kind, n, ess, resampling, groups = inp
    ok = _is_int(n) and n >= 1
    if kind == "smc":
        ok = ok and isinstance(ess, int | float) and not isinstance(ess, bool) and 0 <= ess <= 1 \
            and resampling in ("multinomial", "stratified", "systematic", "residual") and _is_int(groups) \
            and groups == 1

    def call():
        if kind == "smc":
            engine = pt.infer.SMC(n, ess_threshold=ess, resampling=resampling, groups=groups)
        else:
            engine = pt.infer.Importance(n)
        return engine.run(_model(), None, "ab").log_marginal

    return Case(not ok, call, r"num_particles|ess_threshold|resampling|groups", _finite_or_minus_inf,
                allowed=(ZeroWeightsError,))


_engine_inputs = st.tuples(
    st.sampled_from(["smc", "importance"]),
    st.one_of(st.integers(-2, 8), st.floats(-1, 5), st.booleans(), st.sampled_from(["4", None, float("nan")])),
    st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0, 1, "0.5", None, True, float("nan")])),
    st.sampled_from(["systematic", "multinomial", "stratified", "residual", "foo", 3]),
    st.one_of(st.integers(-1, 1), st.sampled_from([1.0, True, "1"])))


def _tabular(inp) -> Case:
    order, logits = inp
    ok = _is_int(order) and order >= 1 and isinstance(logits, np.ndarray) and logits.shape == (V,) * order
    if ok:
        ok = not np.isnan(logits).any() and not np.isposinf(logits).any() and not np.isneginf(logits).all(-1).any()

    def call():
        tab = pt.lm.Tabular(order, V, torch.as_tensor(logits) if isinstance(logits, np.ndarray) else logits)
        seq = pt.dist.LMSequence(tab, constraint=PROJECTIONS["pause"].domain(2))
        support = PROJECTIONS["pause"].domain(2).enumerate(limit=10_000)
        z = torch.tensor([list(s) + [PAD_ID] * (seq.max_len - len(s)) for s in support])
        return seq.log_prob(z)

    def check(lp) -> None:
        _finite_or_minus_inf(lp)
        assert float(torch.logsumexp(lp, 0)) <= 1e-4  # a distribution over the domain: total mass <= 1

    return Case(not ok, call, r"logits|order|shape|NaN|inf|vocab_size", check)


_float_elements = st.floats(-3, 3) | st.sampled_from([float("nan"), float("inf"), float("-inf")])
_tabular_inputs = st.one_of(
    st.tuples(st.just(2), hnp.arrays(np.float32, (V, V), elements=_float_elements)),
    st.tuples(st.sampled_from([1, 2]), hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=2, max_side=V),
                                                  elements=st.floats(-1, 1))),
    st.tuples(st.sampled_from([0, -1, 2.0, "2", None, True]), st.just(np.zeros((V, V), np.float32))))


# corrupted checkpoint folders: a Transformer's, then one change that breaks it (the tensors file keeps a
# valid SHA-256, so only the loader's own checks can catch it)
_TF_CONFIG = {"vocab_size": V, "d_model": 8, "n_layers": 1, "n_heads": 2, "max_len": 8}


def _saved_transformer(folder: Path, config_change=None, tensor_change=None) -> Path:
    torch.manual_seed(0)
    tf = pt.lm.Transformer(**_TF_CONFIG)
    config = {"class": "Transformer", **tf.config()}
    state = {k: v.clone() for k, v in tf.state_dict().items()}
    if config_change is not None:
        config = config_change(config)
    if tensor_change is not None:
        state = tensor_change(state)
    return pt.io.save_checkpoint(folder, state, config)


_INT_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "max_len")


def _transformer_load(inp) -> Case:
    kind, key, value = inp

    def config_change(c):
        c = dict(c)
        if kind == "drop":
            c.pop(key)
        elif kind == "set":
            c[key] = value
        elif kind == "unknown":
            c["extra_knob"] = value
        return c

    def tensor_change(s):
        s = dict(s)
        name = sorted(s)[int(value) % len(s)] if _is_int(value) else sorted(s)[0]
        if kind == "drop_tensor":
            s.pop(name)
        elif kind == "reshape_tensor":
            s[name] = torch.zeros(s[name].numel() + 1)
        elif kind == "extra_tensor":
            s["blocks.9.mystery"] = torch.zeros(2)
        return s

    def call():
        with tempfile.TemporaryDirectory() as d:
            path = _saved_transformer(Path(d) / "m", config_change if kind in ("drop", "set", "unknown") else None,
                                      tensor_change if kind.endswith("tensor") else None)
            return pt.lm.Transformer.load(path)

    return Case(True, call, r"checkpoint|config|tensor|shape|key|Transformer|vocab_size|d_model|n_heads|max_len")


def _bad_value(key):
    """A value of ``key`` that no Transformer can have (so the case is bad whatever the draw)."""
    return st.one_of(st.integers(-3, 0), st.sampled_from([None, "8", 2.5, [8], 10 ** 12, True]))


_transformer_inputs = st.one_of(
    # every argument is required (ppl_thought/schemas.py): a dropped one is refused, never defaulted
    st.tuples(st.just("drop"), st.sampled_from(_INT_KEYS + ("rope_base", "d_ff", "tie_embeddings")), st.none()),
    st.sampled_from(_INT_KEYS).flatmap(lambda k: st.tuples(st.just("set"), st.just(k), _bad_value(k))),
    st.tuples(st.just("set"), st.just("class"), st.sampled_from(["GPT", 3, None])),
    st.tuples(st.just("set"), st.just("n_heads"), st.just(3)),  # d_model 8 is not a multiple of 3
    st.tuples(st.just("unknown"), st.just(""), st.integers(0, 3)),
    st.tuples(st.sampled_from(["drop_tensor", "reshape_tensor", "extra_tensor"]), st.just(""), st.integers(0, 20)))

_json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4),
                            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                            max_leaves=6)


def _checkpoint_header(inp) -> Case:
    kind, path_key, value = inp

    def call():
        with tempfile.TemporaryDirectory() as d:
            path = pt.io.save_checkpoint(Path(d) / "ck", {"w": torch.ones(2)}, {"a": 1})
            cfg = path / "config.json"
            header = json.loads(cfg.read_text())
            if kind == "replace":
                text = json.dumps(value)
            elif kind == "raw":
                text = value
            else:  # set one field of the header (nested: tensors.file / tensors.sha256)
                node = header
                *parents, last = path_key.split(".")
                for p in parents:
                    node = node[p]
                node[last] = value
                text = json.dumps(header)
            cfg.write_text(text)
            return pt.io.load_checkpoint(path)

    return Case(True, call, r"checkpoint|JSON|lacks|tensors|format|config|file|match")


_checkpoint_inputs = st.one_of(
    st.tuples(st.just("replace"), st.just(""), _json_values),
    st.tuples(st.just("raw"), st.just(""), st.text(max_size=8).filter(lambda t: t.strip() != "")),
    st.tuples(st.just("set"), st.sampled_from(["format", "tensors.file", "tensors.sha256", "tensors"]),
              _json_values.filter(lambda v: v is not None) | st.sampled_from(["../x.safetensors", "/etc/passwd",
                                                                                "model.safetensors", "a" * 64])))


FAMILIES: dict[str, tuple[st.SearchStrategy, Callable[[Any], Case]]] = {
    "vocab: build": (_vocab_build_inputs, _vocab_build),
    "vocab: encode": (st.text(alphabet="ab<>/sepx z\n", max_size=8), _vocab_encode),
    "vocab: decode": (_vocab_decode_inputs, _vocab_decode),
    "projection: lifting": (st.tuples(st.sampled_from(sorted(PROJECTIONS)), _id_sequences), _lifting),
    "projection: project": (st.tuples(st.sampled_from(sorted(PROJECTIONS)), _id_sequences), _project),
    "lmsequence: arguments": (_lmsequence_args_inputs, _lmsequence_args),
    "lmsequence: log_prob values": (_lmsequence_values, _lmsequence_log_prob),
    "engines: arguments": (_engine_inputs, _engine_args),
    "tabular: logits": (_tabular_inputs, _tabular),
    "transformer: load a corrupted folder": (_transformer_inputs, _transformer_load),
    "checkpoint: corrupted config": (_checkpoint_inputs, _checkpoint_header),
}


def run_family(name: str, max_examples: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """``[(input repr, answer, message)]`` of ``max_examples`` derandomized draws (benchmarks/robustness.py)."""
    from hypothesis import HealthCheck, Phase, settings

    strategy, make = FAMILIES[name]
    rows: list[tuple[str, str, str]] = []

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(inp):
        rows.append((repr(inp)[:120], *outcome(make(inp))))

    collect()
    return rows


# ---------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_bad_input_gets_a_clear_error_and_valid_input_a_finite_answer(name):
    strategy, make = FAMILIES[name]

    @given(strategy)
    def prop(inp):
        case = make(inp)
        answer, msg = outcome(case)
        assert answer in ("clear", "ok"), (("bad" if case.bad else "valid"), answer, msg)

    prop()


def _cli_tokens():
    pool = ["demo", "info", "diagnose", "--n", "0", "-1", "3", "x", "--seeds", "--threads", "--parts", "sec7", "a5",
            "foo", "--quick", "--out", "--json", "--seed", "1.5", "--version", "-h", "/nonexistent/file.nc", "dmeo"]
    return st.lists(st.sampled_from(pool), max_size=5)


@given(_cli_tokens())
def test_the_cli_answers_any_arguments_with_a_status_never_a_traceback(argv):
    from ppl_thought import cli, demo

    stdout, stderr = _io.StringIO(), _io.StringIO()
    original = demo.run_demo
    demo.run_demo = lambda **kw: {"stub": True}  # a valid command line would start the real job
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = cli.main(argv)
            except SystemExit as e:
                code = e.code
    finally:
        demo.run_demo = original
    assert code in (0, 2, None), (argv, code, stderr.getvalue()[-500:])
    assert "Traceback" not in stderr.getvalue()


def test_the_families_find_bad_inputs_and_valid_ones():
    """The oracles are not vacuous: a derandomized run of every family draws bad inputs, and valid ones where the
    family has them."""
    for name in FAMILIES:
        rows = run_family(name, 25)
        answers = {a for _, a, _ in rows}
        assert answers & {"clear", "unclear", "silent", "crash"}, name
        if name not in ("transformer: load a corrupted folder", "checkpoint: corrupted config"):
            assert answers & {"ok", "wrong"}, name


# ---------------------------------------------------------------------------------------------- every public callable
# Discovered, not listed: every callable in ``pt.__all__``, in the ``__all__`` of each subpackage it names (modules
# without ``__all__``, pt.io: their public functions), in ``ptn.__all__`` and its subpackages' ``__all__``. Exception
# classes, abstract base classes and protocols are left out of the count (not entry points one calls). Each example
# calls one with its required arguments drawn from a pool of wrong types, sizes and values (and, half the time, one
# optional argument too), under a timeout; the answer must be a PPLThoughtError ("clear") or a returned value
# without NaN ("valid"). "silent": a value holding NaN came back; "unclear": a ValueError / TypeError raised by the
# library's own code (not its error classes); "crash": any other exception, or the timeout (a hang). A draw with no
# argument at all (a callable whose arguments all have defaults) holds no bad input and is not called.
# Examples per callable: 3 by default, 20 with --slow; benchmarks/robustness.py --public writes the counts.
PUBLIC_TIMEOUT_S = 3.0
PUBLIC_EXAMPLES = 3
PUBLIC_EXAMPLES_SLOW = 20

_BAD_VALUES: list[tuple[str, Callable[[], Any]]] = [
    ("None", lambda: None), ("'x'", lambda: "x"), ("''", lambda: ""), ("1.5", lambda: 1.5), ("-1", lambda: -1),
    ("0", lambda: 0), ("True", lambda: True), ("nan", lambda: float("nan")), ("inf", lambda: float("inf")),
    ("10**5", lambda: 10 ** 5), ("[]", lambda: []), ("[1.5, 'a']", lambda: [1.5, "a"]), ("{}", lambda: {}),
    ("object()", lambda: object()), ("tensor(nan)", lambda: torch.tensor(float("nan"))),
    ("zeros(0)", lambda: torch.zeros(0)), ("full((2,3), nan)", lambda: torch.full((2, 3), float("nan"))),
    ("tensor([-1])", lambda: torch.tensor([-1])), ("array([[1.5]])", lambda: np.array([[1.5]])),
    ("b'\\x00'", lambda: b"\x00"), ("lambda: None", lambda: (lambda *a, **k: None)),
]


class _Timeout(BaseException):  # noqa: N818 - not an Exception: a library's `except Exception` cannot swallow it
    """The per-call timeout (SIGALRM)."""


def _public_modules() -> list[tuple[str, Any]]:
    import importlib
    import inspect

    import ppl_thought.numpyro as ptn

    out = [("pt", pt)]
    for name in pt.__all__:
        obj = getattr(pt, name)
        if inspect.ismodule(obj):
            out.append((f"pt.{name}", obj))
    out.append(("ptn", ptn))
    for name in ptn.__all__:
        obj = getattr(ptn, name)
        if inspect.ismodule(obj):
            out.append((f"ptn.{name}", importlib.import_module(obj.__name__)))
    return out


def public_callables() -> dict[str, Callable]:
    """``{qualified name: callable}``, one entry per distinct object (aliases such as pt.dist / pt.distributions
    and pt.infer / pt.inference count once, under the first name)."""
    import inspect

    seen: dict[int, str] = {}
    out: dict[str, Callable] = {}
    for mod_name, mod in _public_modules():
        names = getattr(mod, "__all__", None)
        if names is None:
            names = [n for n in dir(mod) if not n.startswith("_")
                     and getattr(getattr(mod, n), "__module__", "") == mod.__name__]
        for n in names:
            obj = getattr(mod, n, None)
            if obj is None or inspect.ismodule(obj) or not callable(obj):
                continue
            if isinstance(obj, type) and (issubclass(obj, BaseException) or inspect.isabstract(obj)
                                          or getattr(obj, "_is_protocol", False)):
                continue  # exceptions, abstract bases and protocols: not entry points one calls
            if id(obj) in seen:
                continue
            seen[id(obj)] = f"{mod_name}.{n}"
            out[f"{mod_name}.{n}"] = obj
    return out


def _parameters(fn) -> tuple[list[str], list[str], list[str]]:
    """(required positional, required keyword-only, optional names) of ``fn`` (a class: its constructor)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [], [], []
    pos, kw, opt = [], [], []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            (kw if p.kind == p.KEYWORD_ONLY else pos).append(p.name)
        else:
            opt.append(p.name)
    return pos, kw, opt


def _has_nan(out, depth: int = 0) -> bool:
    if depth > 3:
        return False
    if isinstance(out, torch.Tensor):
        return bool(out.is_floating_point() and out.numel() and torch.isnan(out.detach()).any())
    if isinstance(out, np.ndarray):
        return bool(np.issubdtype(out.dtype, np.floating) and np.isnan(out).any())
    if isinstance(out, float):
        return math.isnan(out)
    if isinstance(out, tuple | list):
        return any(_has_nan(o, depth + 1) for o in out[:50])
    if isinstance(out, dict):
        return any(_has_nan(o, depth + 1) for o in list(out.values())[:50])
    return False


def public_call(fn, draw: tuple[list[int], tuple[str, int] | None],
                timeout: float = PUBLIC_TIMEOUT_S) -> tuple[str, str, str]:
    """Call ``fn`` with the drawn bad values: ``(inputs, answer, message)``, answer clear / valid / silent / crash."""
    import signal

    pos, kw, opt = _parameters(fn)
    picks, optional = draw
    values = [(_BAD_VALUES[i % len(_BAD_VALUES)]) for i in picks]
    optional_pick = None
    if optional is not None and opt:
        optional_pick = (opt[optional[0] % len(opt)], _BAD_VALUES[optional[1] % len(_BAD_VALUES)])

    def arguments():  # fresh values for each call (a call may have changed them)
        a = [values[j][1]() for j in range(len(pos))]
        k = {name: values[len(pos) + j][1]() for j, name in enumerate(kw)}
        if optional_pick is not None:
            k[optional_pick[0]] = optional_pick[1][1]()
        return a, k

    shown = [values[j][0] for j in range(len(pos))] + [f"{n}={values[len(pos) + j][0]}" for j, n in enumerate(kw)]
    if optional_pick is not None:
        shown.append(f"{optional_pick[0]}={optional_pick[1][0]}")
    inputs = f"({', '.join(shown)})"
    if not shown:
        return inputs, "valid", "no argument drawn: not called"
    _warm_imports()

    def alarm(signum, frame):
        raise _Timeout()

    # a timeout is retried once with 10x the time (fresh arguments): on a loaded machine a first JAX call can take
    # more than `timeout` (ptn.lm.Transformer(10**5): 7 s at load 15, 1 s after); a hang is no answer either time
    for limit in (timeout, 10 * timeout):
        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            args, kwargs = arguments()
            with torch.no_grad(), contextlib.redirect_stdout(_io.StringIO()), \
                    contextlib.redirect_stderr(_io.StringIO()):
                out = fn(*args, **kwargs)
                if _has_nan(out):
                    return inputs, "silent", f"returned {type(out).__name__} holding NaN"
                return inputs, "valid", f"returned {type(out).__name__}"
        except _Timeout:
            continue
        except PPLThoughtError as e:
            return inputs, "clear", f"{type(e).__name__}: {e}"[:160]
        except Exception as e:  # noqa: BLE001 - every other exception is the answer being classified
            return inputs, ("unclear" if _raised_by_library(e) else "crash"), f"{type(e).__name__}: {e}"[:160]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            _reset_global_state()
    return inputs, "crash", f"no answer within {10 * timeout:g} s (a hang)"


def _raised_by_library(e: Exception) -> bool:
    """A ValueError / TypeError whose raising frame is ppl_thought's own code (a message, but not its error class)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return isinstance(e, ValueError | TypeError) and tb is not None \
        and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(Path(pt.__file__).resolve().parent)


_WARM: list[bool] = []


def _warm_imports() -> None:
    """Import ArviZ and transformers once before the timed calls (a first import takes seconds on a busy machine:
    slow, not a hang)."""
    if not _WARM:
        import importlib

        for name in ("arviz", "transformers"):
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        _WARM.append(True)


def _reset_global_state() -> None:
    import pyro

    pyro.clear_param_store()


def _draws(fn):
    pos, kw, _ = _parameters(fn)
    idx = st.integers(0, len(_BAD_VALUES) - 1)
    return st.tuples(st.lists(idx, min_size=len(pos) + len(kw), max_size=len(pos) + len(kw)),
                     st.one_of(st.none(), st.tuples(st.integers(0, 63), idx)))


def run_public(name: str, fn, max_examples: int) -> list[tuple[str, str, str]]:
    """``[(inputs, answer, message)]`` of ``max_examples`` derandomized draws for one public callable."""
    import zlib

    from hypothesis import HealthCheck, Phase, seed, settings

    rows: list[tuple[str, str, str]] = []

    @seed(zlib.crc32(name.encode()))  # the same draws on every run, one sequence per callable
    @settings(max_examples=max_examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_draws(fn))
    def collect(draw):
        rows.append(public_call(fn, draw))

    collect()
    return rows


PUBLIC = public_callables()
PUBLIC_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "robustness_public.json"


def _known_defects(slow: bool = False) -> dict[str, str]:
    """``{callable: answer}`` of the callables benchmarks/robustness.py --public found a crash, an unclear error or
    a silent NaN in (the defects left to fix, listed in its JSON; the 20-draw run for ``slow``): the suite fails on
    any other callable that answers so."""
    data = json.loads(PUBLIC_RESULTS.read_text())["public_callables_slow" if slow else "public_callables"]
    return {name: row["worst"] for name, row in data["by_callable"].items()
            if row["worst"] in ("crash", "unclear", "silent")}


def _worst(rows) -> str:
    answers = {a for _, a, _ in rows}
    return next(a for a in ("crash", "unclear", "silent", "clear", "valid") if a in answers) if answers else "valid"


def _check_public(name: str, examples: int, tmp_path, monkeypatch, slow: bool = False) -> None:
    monkeypatch.chdir(tmp_path)  # a path drawn as "x" writes (if anything) into the test's own folder
    rows = run_public(name, PUBLIC[name], examples)
    known = _known_defects(slow)
    worst = _worst(rows)
    hangs = [r for r in rows if "a hang" in r[2] and r[0] != "()"]
    assert not hangs, hangs  # no bad input may hang, known defect or not
    if worst in ("crash", "unclear", "silent"):
        assert name in known, (f"{name}: a {worst} answer to bad input, not among the recorded defects "
                               f"(benchmarks/results/robustness_public.json)", [r for r in rows if r[1] == worst][:3])


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_callable_answers_bad_input_with_a_library_error_or_a_valid_result(name, tmp_path, monkeypatch):
    _check_public(name, PUBLIC_EXAMPLES, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_callable_bigger_run(name, tmp_path, monkeypatch, request):
    if not request.config.getoption("--slow"):
        pytest.skip("the bigger run: pytest --slow")
    _check_public(name, PUBLIC_EXAMPLES_SLOW, tmp_path, monkeypatch, slow=True)


def test_the_public_callables_are_discovered_and_the_recorded_defects_are_real():
    """Discovery finds the engines, the conversion of both backends and the io functions; every recorded defect
    names a callable that still exists (a renamed or removed one must leave the list)."""
    for name in ("pt.Vocab", "pt.infer.SMC", "pt.diagnostics.to_inference_data", "ptn.to_inference_data",
                 "pt.io.load_checkpoint", "ptn.infer.SMC"):
        assert name in PUBLIC, name
    assert set(_known_defects()) <= set(PUBLIC) and set(_known_defects(slow=True)) <= set(PUBLIC)
    data = json.loads(PUBLIC_RESULTS.read_text())["public_callables"]
    assert data["covered"] == len(PUBLIC) == data["total"]


def test_dyck_task_refuses_a_depth_whose_automaton_would_not_fit():
    """Found by the 20-draw sweep: DyckTask(D=10**5) built 2^(D+1) automaton states (no answer within 3 s). Now
    refused by size before any state is made; depths up to the largest that fits still build."""
    import time

    t = time.perf_counter()
    with pytest.raises(pt.errors.ConfigError, match="D=100000"):
        pt.data.DyckTask(D=10 ** 5)
    assert time.perf_counter() - t < 1.0
    assert pt.data.DyckTask(D=12).D == 12  # 2^13 - 1 states
    with pytest.raises(pt.errors.ConfigError, match="states"):
        pt.data.DyckTask(D=20)  # 2^21 - 1 > 10^6
