"""The type layer on the JAX side (ppl_thought/numpyro/boundary.py, issue 32) and the boundary defects it fixes.

Every public ``ptn`` callable hints all of its parameters and is checked from Python; while JAX traces
(``jit`` / ``vmap`` / ``lax.scan``) no check runs (the per-step methods are never wrapped, the rest call the plain
function). Each family of recorded defects (benchmarks/results/robustness_public.json at b9208a0) has a test
here: ``None`` or a wrong type where a model / LM / array goes (an ``AttributeError`` or JAX's ``TypeError`` from
inside before), ``rng_key`` / ``key`` types, NaN in ``ptn.guides.Proposal`` and ``ptn.infer.LangevinState``
(returned silently before), ``factor(+inf)`` (log Z-hat ``inf`` from SMC before).
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import (  # noqa: E402
    ArgumentTypeError,
    ConfigError,
    DiagnosticError,
    MalformedSequenceError,
    NumericalError,
)
from ppl_thought.numpyro import distributions as pnd  # noqa: E402
from ppl_thought.numpyro.boundary import tracing  # noqa: E402
from ppl_thought.numpyro.infer import resampling  # noqa: E402
from ppl_thought.projections import PauseToThink  # noqa: E402
from ppl_thought.validation import ENABLED, checked, resolve_all  # noqa: E402
from ppl_thought.vocab import Vocab  # noqa: E402

pytestmark = pytest.mark.skipif(not ENABLED, reason="PPL_THOUGHT_TYPECHECK=0 turns the type layer off")

SUBPACKAGES = ("dist", "guides", "handlers", "infer", "lm", "models", "transforms", "verifiers")


def _modules():
    yield "ptn", ptn
    for name in SUBPACKAGES:
        yield f"ptn.{name}", importlib.import_module(getattr(ptn, name).__name__)


def _public_callables():
    """(qualified name, function, owning class or None) of every public ptn callable: the functions in ``ptn.__all__``
    and its subpackages' ``__all__`` and, of their classes, ``__init__``, ``__new__`` (NamedTuples), ``__call__``
    and the public, static and class methods defined in the class."""
    for where, mod in _modules():
        for attr in mod.__all__:
            obj = getattr(mod, attr)
            if not str(getattr(obj, "__module__", "")).startswith("ppl_thought"):
                continue
            if inspect.isfunction(obj):
                yield f"{where}.{attr}", obj, None
            elif inspect.isclass(obj) and not issubclass(obj, BaseException):
                for key, value in vars(obj).items():
                    if key.startswith("_") and key not in ("__init__", "__new__", "__call__"):
                        continue
                    fn = value.__func__ if isinstance(value, staticmethod | classmethod) else value
                    if isinstance(value, property):
                        continue
                    if inspect.isfunction(fn):
                        yield f"{where}.{attr}.{key}", fn, obj


def _unhinted(fn) -> list[str]:
    sig = inspect.signature(fn)
    return [p for p, q in sig.parameters.items() if p not in ("self", "cls") and p not in fn.__annotations__
            and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]


def test_every_public_parameter_has_a_hint():
    """A parameter without a hint is one the type layer cannot check: every public ptn callable hints all of its
    parameters (self / cls, *args / **kwargs aside)."""
    missing, seen = [], 0
    for where, fn, _ in _public_callables():
        seen += 1
        if gaps := _unhinted(fn):
            missing.append(f"{where}: {', '.join(gaps)}")
    assert seen >= 150  # 166 public ptn callables when this test was written
    assert missing == [], "\n".join(missing)


def test_the_hint_check_sees_a_missing_hint():
    def f(a: int, b, *args, c: str = "", **kwargs):
        return a

    assert _unhinted(f) == ["b"]


def test_every_public_hint_compiles_and_is_checked():
    """beartype compiled every hint (nothing left in UNCHECKED), and every public ptn callable with hinted
    parameters is the checked one, except the per-step methods marked ``@per_token`` at their definition."""
    checked_count = 0
    for where, fn, _ in _public_callables():
        name = where.rsplit(".", 1)[-1]
        if getattr(fn, "__ppl_thought_per_token__", False) or name == "__new__" or \
                not set(fn.__annotations__) - {"return"}:
            continue
        assert getattr(fn, "__ppl_thought_checked__", False), f"{where} is not checked"
        checked_count += 1
    assert checked_count >= 90
    assert {k: v for k, v in resolve_all().items() if ".numpyro." in k} == {}


def test_the_jax_side_is_checked_with_its_tracing_predicate():
    """Every checked public ptn function and method defined on the JAX side is ``@checked_jax`` (it runs plain
    while JAX traces), never the torch side's ``@checked``: its wrapper reads ``skip_while``."""
    seen = 0
    for where, fn, _ in _public_callables():
        if getattr(fn, "__ppl_thought_checked__", False) and ".numpyro." in fn.__module__:
            assert "skip_while" in fn.__code__.co_freevars, f"{where} is checked without the tracing predicate"
            seen += 1
    assert seen >= 90


# ---------------------------------------------------------------------------------------------- never while tracing
def _vocab():
    return Vocab(["a", "b"])


def _model(V=None):
    v = _vocab() if V is None else V
    proj = PauseToThink(v, max_thought_len=1)
    rng = np.random.default_rng(0)
    return ptn.models.SlowThinking(ptn.lm.Tabular(2, len(v), rng.normal(size=(len(v), len(v)))), proj)


class _Calls:
    """Records every call of a beartype-generated checking wrapper of a ptn callable, and whether JAX was tracing
    then. (The framework-free layers both sides share, projections and vocabularies, keep their checks: they
    run on concrete Python / NumPy values when a model builds an automaton at trace time.)"""

    def __init__(self):
        self.traced: list[str] = []
        self.eager = 0

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith("<@beartype(ppl_thought.numpyro."):
            if tracing():
                self.traced.append(frame.f_code.co_filename)
            else:
                self.eager += 1


def _record(fn):
    calls = _Calls()
    sys.setprofile(calls)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_no_check_runs_while_jax_traces(request):
    """SMC and Importance over SlowThinking with the guides (step-wise programs: LMState, Segment, token rules
    inside lax.scan / while_loop), the whole-trace model under vmap, SVI with ELBO and MALA: the checks run at the
    boundary (eager calls seen) and never while JAX traces. Every compile runs under the profile hook (slow: ~40 s
    of CPU in all, most of it XLA compiling the engines' programs): by default SMC with no guide (the step runner
    and resampling) and Importance with the Causal guide (the same step runner, a guide program); ``--slow`` adds
    SMC with the Causal, Posterior and Identity guides (that step runner with those guide programs, resampled)."""
    model = _model()
    x = ["a", "b"]
    more = request.config.getoption("--slow")

    def work():
        ptn.infer.SMC(16).run(model, None, x, rng_key=1)
        if more:
            ptn.infer.SMC(16).run(model, ptn.guides.Causal(model.prior, model.projection), x, rng_key=2)
            ptn.infer.SMC(16).run(model, ptn.guides.Posterior(model), x, rng_key=3)
            ptn.infer.SMC(16).run(model, ptn.guides.Identity(model), x, rng_key=4)
        ptn.infer.Importance(16).run(model, ptn.guides.Causal(model.prior, model.projection), x, rng_key=5)
        lifted = ptn.ProjectionLift(lambda x=None: numpyro.sample(
            "x", ptn.dist.LMSequence(model.prior, max_len=len(x)), obs=x), model.projection)
        ptn.infer.Importance(8).run(lifted, ptn.guides.Posterior(model), np.asarray(model.x_ids(x)), rng_key=6)
        svi = numpyro.infer.SVI(model, ptn.guides.Causal(model.prior, model.projection, name="g"),
                                numpyro.optim.Adam(1e-2), ptn.infer.ELBO(4))
        svi.run(jax.random.PRNGKey(0), 2, x, progress_bar=False)

        def normal():
            numpyro.sample("w", nd.Normal(0.0, 1.0))

        mcmc = numpyro.infer.MCMC(ptn.infer.MALA(normal), num_warmup=5, num_samples=5, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(0))

    calls = _record(work)
    assert calls.eager >= 10  # the engines' run, the guides' and models' constructors were checked
    assert calls.traced == [], sorted(set(calls.traced))


def test_the_tracing_probe_sees_a_check_inside_jit():
    """The recorder of the test above would see a check that runs while tracing (a checked function without
    ``skip_while`` called inside jit), and the JAX side's version calls the plain function there."""

    def double(a: jax.Array) -> jax.Array:
        return 2 * a

    double.__module__ = "ppl_thought.numpyro.test"
    double.__qualname__ = "double"
    plain = checked(double)
    calls = _record(lambda: jax.jit(lambda a: plain(a))(jnp.ones(2)))
    assert calls.traced, "a check inside jit was not seen"
    quiet = checked(lambda a: 3 * a)  # no hints: not wrapped at all
    assert quiet(2) == 6

    def triple(a: jax.Array) -> jax.Array:
        return 3 * a

    triple.__module__ = "ppl_thought.numpyro.test"
    triple.__qualname__ = "triple"
    skipping = checked(triple, skip_while=tracing)
    calls = _record(lambda: jax.jit(lambda a: skipping(a))(jnp.ones(2)))
    assert calls.traced == []
    with pytest.raises(ArgumentTypeError, match="triple"):
        skipping("x")


# ---------------------------------------------------------------------------------------------- the defect families
NONE_WHERE_A_MODEL_OR_LM_GOES = {
    "SlowThinking(None, proj)": lambda p: ptn.models.SlowThinking(None, p),
    "Causal(None, proj)": lambda p: ptn.guides.Causal(None, p),
    "Explanatory(None, proj)": lambda p: ptn.guides.Explanatory(None, p),
    "Predictive(None, proj)": lambda p: ptn.guides.Predictive(None, p),
    "Identity(None)": lambda p: ptn.guides.Identity(None),
    "Posterior(None)": lambda p: ptn.guides.Posterior(None),
    "LMSequence(None)": lambda p: ptn.dist.LMSequence(None, max_len=3),
    "LatentThought(None, 2)": lambda p: ptn.models.LatentThought(None, 2),
    "LMState.start(None, 4)": lambda p: ptn.dist.LMState.start(None, 4),
    "NextToken(None)": lambda p: ptn.dist.NextToken(None),
    "Segment(None, [], 2)": lambda p: ptn.dist.Segment(None, [], 2),
    "SamplerProgram(None, x)": lambda p: ptn.guides.SamplerProgram(None, [2]),
    "Tables(None)": lambda p: pnd.Tables(None),
    "tables(lambda)": lambda p: ptn.dist.tables(lambda: None),
    "TokenRule(None, None)": lambda p: ptn.dist.TokenRule(None, None),
    "ProjectionDelta(None, z, 1)": lambda p: ptn.dist.ProjectionDelta(None, [[2]], 1),
    "MarginalRule(None, ...)": lambda p: ptn.guides.MarginalRule(None, None, None, [2]),
    "lifting_state(None, s)": lambda p: ptn.guides.lifting_state(None, 0),
    "Transformer(None)": lambda p: ptn.lm.Transformer(None),
    "decode(dict as the LM)": lambda p: ptn.dist.decode(jax.random.PRNGKey(0), {}, None, None, 1, [], 2, []),
    "encode(None)": lambda p: pnd.encode(None, None, [], 1, 1),
    "teacher_forced(None)": lambda p: ptn.dist.teacher_forced(None, None, [], jnp.zeros((1, 2), jnp.int32)),
    "score(None as the rule)": lambda p: pnd.score(None, jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), jnp.int32),
                                                         2, []),
}


@pytest.mark.parametrize("case", sorted(NONE_WHERE_A_MODEL_OR_LM_GOES))
def test_none_where_a_model_or_lm_goes_is_a_type_error_naming_it(case):
    """Before: AttributeError ('NoneType' object has no attribute 'vocab_size' / 'prior' / 'lm' ...) or a
    ``TypeError`` from int(None) inside the library."""
    with pytest.raises(ArgumentTypeError) as e:
        NONE_WHERE_A_MODEL_OR_LM_GOES[case](PauseToThink(_vocab(), max_thought_len=1))
    assert "None" in str(e.value) or "function" in str(e.value) or "dict" in str(e.value), str(e.value)


ARRAYS = {  # a wrong array argument: before, JAX's TypeError or an AttributeError from inside
    "const(None)": (lambda: pnd.const(None), ArgumentTypeError),
    "const(mixed list)": (lambda: pnd.const([1.5, "a"]), ArgumentTypeError),
    "masked_log_softmax(None, None)": (lambda: ptn.dist.masked_log_softmax(None, None), ArgumentTypeError),
    "masked_log_softmax(list, int)": (lambda: ptn.dist.masked_log_softmax([0.0], -1), ArgumentTypeError),
    "pad_to(None, 3)": (lambda: ptn.dist.pad_to(None, 3), ArgumentTypeError),
    "pad_to(z, -1)": (lambda: ptn.dist.pad_to(jnp.zeros((1, 2), jnp.int32), -1), ConfigError),
    "tree_where(float, ...)": (lambda: pnd.tree_where(math.inf, 1.5, 0), ArgumentTypeError),
    "tree_where(two trees)": (lambda: pnd.tree_where(np.array([True]), [1.5, "a"], "x"), MalformedSequenceError),
    "sample_token(None, ...)": (lambda: pnd.sample_token(None, None, None), ArgumentTypeError),
    "check_ids(ids, object())": (lambda: ptn.dist.check_ids([1], object(), 3), ArgumentTypeError),
    "check_ids(text)": (lambda: ptn.dist.check_ids("ab", 4, 3), ArgumentTypeError),
    "TableDistribution(None, None)": (lambda: ptn.guides.TableDistribution(None, None), ArgumentTypeError),
    "TableDistribution(NaN log-probs)": (lambda: ptn.guides.TableDistribution(np.array([[2]]), np.array([np.nan])),
                                         MalformedSequenceError),
    "log_mean_exp(None)": (lambda: resampling.log_mean_exp(None), ArgumentTypeError),
    "log_mean_exp(empty)": (lambda: resampling.log_mean_exp(np.zeros(0)), DiagnosticError),
    "effective_sample_size(axis=inf)": (lambda: resampling.effective_sample_size(np.zeros(3), axis=math.inf),
                                        ArgumentTypeError),
    "log_marginal_stderr('x')": (lambda: ptn.infer.log_marginal_stderr("x"), ArgumentTypeError),
    "log_marginal_stderr(NaN)": (lambda: ptn.infer.log_marginal_stderr(np.array([0.0, np.nan])), DiagnosticError),
    "systematic_resample(key, None)": (lambda: resampling.systematic_resample(jax.random.PRNGKey(0), None),
                                       ArgumentTypeError),
    "systematic_resample(size=-1)": (lambda: resampling.systematic_resample(jax.random.PRNGKey(0), np.zeros(3), -1),
                                     DiagnosticError),
    "reorder(-1, True)": (lambda: ptn.lm.reorder(-1, True), ArgumentTypeError),
    "reorder(a string cache)": (lambda: ptn.lm.reorder("x", np.array([0])), MalformedSequenceError),
    "HMM(text tables)": (lambda: ptn.models.HMM("x", b"\x00", 1.5), ArgumentTypeError),
}


@pytest.mark.parametrize("case", sorted(ARRAYS))
def test_a_wrong_array_argument_is_a_library_error(case):
    call, error = ARRAYS[case]
    with pytest.raises(error):
        call()


def test_valid_arrays_of_numpy_jax_and_lists_still_pass():
    """The array hints admit JAX arrays, NumPy arrays and Python lists (where ``jnp.asarray`` reads them)."""
    for lw in ([0.0, -1.0, -2.0], np.array([0.0, -1.0, -2.0]), jnp.array([0.0, -1.0, -2.0])):
        expected = math.log(np.mean(np.exp([0.0, -1.0, -2.0])))
        assert abs(float(resampling.log_mean_exp(np.asarray(lw))) - expected) < 1e-6
    assert ptn.dist.check_ids([[2, 3, 0]], 4, 3).tolist() == [[2, 3, 0]]
    assert pnd.const([1, 2]).tolist() == [1, 2]
    assert ptn.dist.pad_to(jnp.asarray([[2, 3]], jnp.int32), 4).tolist() == [[2, 3, 0, 0]]
    idx = resampling.systematic_resample(jax.random.PRNGKey(0), np.log(np.array([0.5, 0.5, 1e-30])))
    assert set(np.asarray(idx).tolist()) <= {0, 1}


def test_rng_key_types():
    """An int seed is a key (as ``PRNGKey(seed)``) for the engines and ``HMM.sample``; anything else is a
    ConfigError naming the argument (before: JAX's own TypeError from ``HMM.sample(0, ...)``)."""
    model = _model()
    a = ptn.infer.SMC(8).run(model, None, ["a"], rng_key=3)
    b = ptn.infer.SMC(8).run(model, None, ["a"], rng_key=jax.random.PRNGKey(3))
    assert np.array_equal(np.asarray(a.log_weights), np.asarray(b.log_weights))
    for bad in ("0", 1.5, True, np.zeros(3)):
        with pytest.raises(ConfigError, match="rng_key"):
            ptn.infer.SMC(8).run(model, None, ["a"], rng_key=bad)
    hmm = ptn.models.HMM(np.eye(2) * 0.5 + 0.25, np.full((2, 3), 1 / 3), [0.5, 0.5])
    z0, x0 = hmm.sample(0, 4, 3)
    z1, x1 = hmm.sample(jax.random.PRNGKey(0), 4, 3)
    assert np.array_equal(np.asarray(x0), np.asarray(x1)) and x0.shape == (4, 3)
    with pytest.raises(ConfigError, match="key"):
        hmm.sample("0", 4, 3)
    with pytest.raises(ConfigError, match="num_sequences"):
        hmm.sample(0, 1.5, 3)


def test_nan_in_a_proposal_is_refused():
    """Before: ``Proposal('', 0, object(), 1.5, nan)`` came back holding NaN."""
    model = _model()
    good = ptn.guides.Causal(model.prior, model.projection).proposal(np.array([2]))
    assert ptn.guides.Proposal(*good) == good
    with pytest.raises(ConfigError, match="max_len"):
        ptn.guides.Proposal(good.lm, good.params, good.prompt, good.rule, math.nan)
    with pytest.raises(NumericalError, match="params"):
        ptn.guides.Proposal(good.lm, {"logits": np.full((2, 2), np.nan)}, good.prompt, good.rule, 3)
    with pytest.raises(ConfigError, match="lm"):
        ptn.guides.Proposal("", 0, good.prompt, good.rule, 3)
    with pytest.raises(ConfigError, match="rule"):
        ptn.guides.Proposal(None, None, good.prompt, object(), 3)


def test_nan_in_a_langevin_state_is_refused_and_the_chain_still_runs():
    """Before: ``LangevinState(..., nan, ...)`` came back holding NaN. JAX rebuilds the state each step (from
    tracers and placeholders): that still works, and MALA's chain still samples N(0, 1)."""
    fields = dict(i=0, z={"w": np.zeros(1)}, potential_energy=0.5, z_grad={"w": np.zeros(1)}, step_size=0.1,
                  accept_prob=0.5, mean_accept_prob=0.5, diverging=False, adapt_state=(), rng_key=np.zeros(2))
    ptn.infer.LangevinState(**fields)
    for name, bad in (("potential_energy", math.nan), ("step_size", np.array(np.nan)),
                      ("z", {"w": np.array([0.0, np.nan])})):
        with pytest.raises(NumericalError, match=name):
            ptn.infer.LangevinState(**{**fields, name: bad})

    def normal():
        numpyro.sample("w", nd.Normal(0.0, 1.0))

    mcmc = numpyro.infer.MCMC(ptn.infer.MALA(normal), num_warmup=300, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1))
    w = np.asarray(mcmc.get_samples()["w"])
    assert abs(w.mean()) < 0.25 and abs(w.std() - 1.0) < 0.2, (w.mean(), w.std())


class _InfFactor(ptn.Program):
    max_steps = 2

    def init(self, state):
        state["z"] = jnp.zeros(ptn.particles())

    def step(self, state, t):
        ptn.sample("z", nd.Normal(jnp.zeros(ptn.particles()), 1.0))
        numpyro.factor("f", jnp.where(t == 1, jnp.inf, 0.0) * jnp.ones(ptn.particles()))
        return jnp.broadcast_to(t == 1, (ptn.particles(),))


@pytest.mark.parametrize("engine", ["SMC", "Importance"])
def test_factor_of_plus_inf_is_an_error_never_an_infinite_log_z(engine):
    """Before: SMC and Importance over a program with ``numpyro.factor(+inf)`` returned log Z-hat ``inf`` (the
    ESS NaN). Now a NumericalError naming the cause; a concrete ``ptn.factor(+inf)`` raises where it is called."""
    eng = ptn.infer.SMC(8) if engine == "SMC" else ptn.infer.Importance(8)
    with pytest.raises(NumericalError, match=r"\+inf"):
        eng.run(_InfFactor(), None)

    def whole():
        numpyro.sample("z", nd.Normal(0.0, 1.0))
        numpyro.factor("f", jnp.inf)

    with pytest.raises(NumericalError, match="'f'"):
        ptn.infer.Importance(8).run(whole, None)
    with numpyro.handlers.seed(rng_seed=0), pytest.raises(NumericalError, match=r"factor\('f'\)"):
        ptn.factor("f", math.inf)
    with numpyro.handlers.seed(rng_seed=0), pytest.raises(NumericalError, match="NaN"):
        ptn.factor("f", [0.0, math.nan])
    with numpyro.handlers.trace() as tr:
        ptn.factor("f", -math.inf)  # a hard constraint stays allowed
    assert float(tr["f"]["fn"].log_prob(0.0)) == -math.inf


def test_the_verbs_check_their_arguments_outside_a_trace():
    """Before: numpyro's ``TypeError: Invalid type for 'fn'`` and ``AttributeError: 'list' object has no attribute
    'batch_shape'``. The verbs run unchecked inside the engines' compiled loops (test above)."""
    with pytest.raises(ArgumentTypeError, match="fn"):
        ptn.sample("z", None)
    with pytest.raises(ArgumentTypeError, match="name"):
        ptn.observe(object(), [], np.full((2, 3), np.nan))
    with pytest.raises(ArgumentTypeError, match="value"):
        with numpyro.handlers.seed(rng_seed=0):
            ptn.observe("x", nd.Normal(0.0, 1.0), [1.5, "a"])
    with pytest.raises(ArgumentTypeError, match="log_factor"):
        ptn.factor("f", None)
    with numpyro.handlers.seed(rng_seed=0):
        assert float(ptn.observe("x", nd.Normal(0.0, 1.0), 0.5)) == 0.5
