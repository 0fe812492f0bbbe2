"""The program contract on the torch engines (docs/architecture.md, "The contract"; issue 39, item 2).

Each violation gets a clear ProgramError naming the program, the step and the site or entry. For the
violations that used to give a wrong answer silently (site batch shapes, lists in the state, the in-place
freeze, writes into the caller's arguments), a test shows what the old engines returned (the numbers
measured at 2c2398b are in the test docstrings) and that a program keeping the contract gets the exact
answer, computed by enumeration.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import ppl_thought as pt
from ppl_thought.errors import ConfigError, PPLThoughtError, ProgramError
from ppl_thought.inference import SMC, Importance
from ppl_thought.program import run_whole

# two independent steps: z_t ~ Bernoulli(P[t]), x_t ~ Bernoulli(0.8 if z_t else 0.1), x observed
P = (0.3, 0.6)
X = torch.tensor([1.0, 0.0])


def exact_log_z(x: torch.Tensor = X) -> float:
    """log p(x) by enumerating z_0, z_1 (4 configurations)."""
    total = 0.0
    for t, p in enumerate(P):
        like = [0.1, 0.8]  # P(x_t = 1 | z_t)
        total += math.log(sum(pz * (like[z] if x[t] > 0 else 1 - like[z]) for z, pz in ((0, 1 - p), (1, p))))
    return total


class Coins(pt.Program):
    """The contract kept: every site has batch shape [n]."""

    shape = "n"  # how z_0's parameters are shaped: "n", "n1" ([n, 1]) or "2n" ([2, n])

    def step(self, state, t, x):
        n = pt.particles()
        if t == 0 and self.shape == "n1":
            probs = torch.full((n, 1), P[t])
        elif t == 0 and self.shape == "2n":
            probs = torch.full((2, n), P[t])
        else:
            probs = torch.full((n,), P[t])
        z = pt.sample(f"z_{t}", dist.Bernoulli(probs))
        pt.observe(f"x_{t}", dist.Bernoulli(0.1 + 0.7 * z), x[t])
        return torch.full((n,), t == len(P) - 1)


class CoinsN1(Coins):
    shape = "n1"


class Coins2N(Coins):
    shape = "2n"


ENGINES = {"SMC": lambda: SMC(2000, ess_threshold=0.5), "Importance": lambda: Importance(2000)}


# ---------------------------------------------------------------------------------------------- 1. site shapes
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_site_batch_shape_n_gives_exact_log_z(engine):
    torch.manual_seed(0)
    res = ENGINES[engine]().run(Coins(), None, X)
    assert abs(float(res.log_marginal) - exact_log_z()) < 0.05


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("program", [CoinsN1, Coins2N])
def test_site_batch_shape_refused(engine, program):
    """At 2c2398b Pyro's particle plate broadcast z_0 ``[n, 1]`` to ``[n, n]`` (and took ``[2, n]`` as it
    was), and the engines summed n (or 2) copies of every particle's log-probability: with n = 2000,
    CoinsN1 gave SMC log Z = -3214.04 and Importance -3213.41, Coins2N -3.08 under both (two copies), where
    the exact value is -1.91."""
    torch.manual_seed(0)
    with pytest.raises(ProgramError, match=rf"{program.__name__} in step 0: site 'z_0' has batch shape"):
        ENGINES[engine]().run(program(), None, X)


class Plated(pt.Program):
    """A program that declares one plate of its own: sites [n, 3] inside ``pyro.plate("obs", 3)`` keep the
    contract; ``plated=False`` draws the same [n, 3] without the plate (a batch dim that is no plate)."""

    max_plate_nesting = 1

    def __init__(self, plated: bool = True):
        self.plated = plated

    def step(self, state, t, y):
        n = pt.particles()
        mu = pt.sample("mu", dist.Normal(torch.zeros(n, 1), 1.0))
        if self.plated:
            with pyro.plate("obs", 3, dim=-1):
                pt.observe("y", dist.Normal(mu, 1.0), y)
        else:
            pt.observe("y", dist.Normal(mu.expand(n, 3), 1.0), y)
        return torch.ones(n, dtype=torch.bool)


def test_declared_plate_dims_pass_and_undeclared_batch_dims_refused():
    """log p(y) for mu ~ N(0, 1), y_i ~ N(mu, 1) iid is a Gaussian in closed form: cov = I + 11^T."""
    y = torch.tensor([0.5, -0.2, 1.0])
    exact = float(dist.MultivariateNormal(torch.zeros(3), torch.eye(3) + torch.ones(3, 3)).log_prob(y))
    torch.manual_seed(1)
    res = Importance(4000).run(Plated(), None, y)
    assert abs(float(res.log_marginal) - exact) < 4 * float(res.log_marginal_stderr) + 0.01
    with pytest.raises(ProgramError, match=r"Plated in step 0: site 'y' has batch shape \(8, 3\)"):
        Importance(8).run(Plated(plated=False), None, y)


def test_plain_pyro_model_site_shape_refused():
    """A plain Pyro function (no steps) is checked where its log-probabilities are read."""

    def model(x):
        n = pt.particles()
        z = pyro.sample("z", dist.Bernoulli(torch.full((n, 1), 0.3)))
        pyro.sample("x", dist.Bernoulli(0.1 + 0.7 * z), obs=x)

    with pytest.raises(ProgramError, match=r"model: site 'z' has batch shape \(16, 16\)"):
        Importance(16).run(model, None, torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------- 2. twists, flags
class Twisted(Coins):
    twist_shape = "n+1"

    def step(self, state, t, x):
        done = super().step(state, t, x)
        n = pt.particles()
        pt.twist(torch.zeros(n + 1) if self.twist_shape == "n+1" else torch.zeros(2, n))
        return done


class Twisted2N(Twisted):
    twist_shape = "2n"


@pytest.mark.parametrize("program", [Twisted, Twisted2N])
def test_twist_shape_refused(program):
    """At 2c2398b a twist of shape [n + 1] or [2, n] crashed inside smc.py with a torch expand error."""
    with pytest.raises(ProgramError, match=rf"{program.__name__} in step 0: pt.twist got a potential of shape"):
        SMC(8).run(program(), None, X)


class BadFlags(Coins):
    def step(self, state, t, x):
        super().step(state, t, x)
        return torch.zeros(2, pt.particles(), dtype=torch.bool)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_finished_flags_shape_refused(engine):
    with pytest.raises(ProgramError, match=r"BadFlags in step 0: step returned finished flags of shape \(2, "):
        ENGINES[engine]().run(BadFlags(), None, X)


# ---------------------------------------------------------------------------------------------- 3. state entries
class Remember(pt.Program):
    """Keeps each particle's z_0 in the state and observes it again at step 1 (x_1 = z_0 exactly): resampling
    must move the remembered value with its particle. ``store`` is how z_0 is kept."""

    store = "tensor"

    def step(self, state, t, x):
        n = pt.particles()
        if t == 0:
            state["count"] = state.get("count", 0) + 1  # a Python int: one step counter shared by every particle
            z = pt.sample("z_0", dist.Bernoulli(torch.full((n,), 0.5)))
            pt.observe("x_0", dist.Bernoulli(0.1 + 0.8 * z), x[0])
            state["z"] = z.tolist() if self.store == "list" else z
            return None
        z = torch.as_tensor(state["z"])
        pt.observe("x_1", dist.Bernoulli(0.05 + 0.9 * z), x[1])
        return torch.ones(n, dtype=torch.bool)


class RememberList(Remember):
    store = "list"


def test_state_tensor_is_reordered_and_exact():
    """p(x) = sum_z 0.5 p(x_0 | z) p(x_1 | z); every particle resampled after step 0 (ess_threshold=1)."""
    x = torch.tensor([1.0, 1.0])
    exact = math.log(0.5 * 0.9 * 0.95 + 0.5 * 0.1 * 0.05)
    torch.manual_seed(2)
    res = SMC(4000, ess_threshold=1.0).run(Remember(), None, x)
    assert res.stats["resampled"][0]
    assert abs(float(res.log_marginal) - exact) < 0.03


def test_state_list_refused():
    """At 2c2398b a list in the state was silently left in place at resampling (its ints have no particle dim),
    so particles read another particle's z_0: with 4000 particles SMC gave log Z = -1.35 where the exact value
    is -0.84."""
    with pytest.raises(ProgramError, match=r"RememberList in step 0: state\['z'\] is a list"):
        SMC(16).run(RememberList(), None, torch.tensor([1.0, 1.0]))
    with pytest.raises(ProgramError, match=r"RememberList in step 0: state\['z'\] is a list"):
        Importance(16).run(RememberList(), None, torch.tensor([1.0, 1.0]))


class BadEntry(pt.Program):
    entry = "short"

    def init(self, state, x):
        n = pt.particles()
        state["ok"] = {"s": torch.zeros(n), "length": 3, "table": pt.Shared([1, 2])}
        if self.entry == "short":
            state["w"] = torch.zeros(n - 1)
        elif self.entry == "dict":
            state["w"] = {"ids": [0] * n}

    def step(self, state, t, x):
        return torch.ones(pt.particles(), dtype=torch.bool)


class BadEntryDict(BadEntry):
    entry = "dict"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_state_entries_refused(engine):
    with pytest.raises(ProgramError, match=r"BadEntry in init: state\['w'\] is a tensor of shape \(1999,\)"):
        ENGINES[engine]().run(BadEntry(), None, X)
    with pytest.raises(ProgramError, match=r"BadEntryDict in init: state\['w'\]\['ids'\] is a list"):
        ENGINES[engine]().run(BadEntryDict(), None, X)


# ---------------------------------------------------------------------------------------------- 4. freezing
class Counter(pt.Program):
    """Particle i finishes after step i % 3; ``count`` counts the steps a particle ran, written in place
    (``+=``) or not: a finished particle's state keeps the value it had when it finished, so count = i % 3 + 1
    either way."""

    in_place = True

    def init(self, state):
        state["count"] = torch.zeros(pt.particles())

    def step(self, state, t):
        n = pt.particles()
        if self.in_place:
            state["count"] += 1
        else:
            state["count"] = state["count"] + 1
        pt.factor(f"f_{t}", torch.zeros(n))
        return torch.arange(n) % 3 == t


class CounterCopy(Counter):
    in_place = False

    def outputs(self, state):
        return {"count": state["count"]}


class CounterInPlace(Counter):
    def outputs(self, state):
        return {"count": state["count"]}


@pytest.mark.parametrize("program", [CounterInPlace, CounterCopy])
def test_finished_state_frozen_in_place_or_not(program):
    """At 2c2398b ``state["count"] += 1`` kept counting on finished particles (count 3 for every particle under
    SMC and run_whole), while ``state["count"] = state["count"] + 1`` stopped (count i % 3 + 1)."""
    n = 6
    want = (torch.arange(n) % 3 + 1).float()
    res = SMC(n, ess_threshold=0.0).run(program(), None)
    assert torch.equal(res.samples["count"], want)
    with pyro.plate("particles", n):
        state = run_whole(program())
    assert torch.equal(state["count"], want)


# ---------------------------------------------------------------------------------------------- 5. guides
class ObservingGuide(pt.Program):
    def step(self, state, t, x):
        n = pt.particles()
        pt.observe(f"z_{t}", dist.Bernoulli(torch.full((n,), 0.5)), torch.ones(n))
        return torch.full((n,), t == len(P) - 1)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_guide_observing_a_latent_refused(engine):
    """At 2c2398b Pyro's replay crashed with ``RuntimeError: site z_0 must be sampled in trace`` (and a dump of
    the trace's shapes)."""
    with pytest.raises(ProgramError, match=r"Coins.*the guide observes site 'z_0'"):
        ENGINES[engine]().run(Coins(), ObservingGuide(), X)


# ---------------------------------------------------------------------------------------------- 6. max_steps
def test_max_steps_must_be_an_integer():
    """At 2c2398b ``max_steps = 2.5`` was accepted (a run bounded by it took its 2 steps)."""
    with pytest.raises(ProgramError, match=r"Half.max_steps must be an integer >= 1.*2.5"):
        type("Half", (Coins,), {"max_steps": 2.5})

    class SetInInit(Coins):
        def init(self, state, x):
            self.max_steps = 0

    for engine in sorted(ENGINES):
        with pytest.raises(ProgramError, match=r"SetInInit.max_steps must be an integer >= 1.*got int 0"):
            ENGINES[engine]().run(SetInInit(), None, X)
    with pytest.raises(PPLThoughtError, match="max_steps"):  # the engine argument: the type layer, or the check
        SMC(8, max_steps=2.5)
    with pytest.raises(ConfigError, match="max_steps must be an integer >= 1"):
        SMC(8, max_steps=0)


# ---------------------------------------------------------------------------------------------- 7. arguments
class Mutating(Coins):
    def step(self, state, t, x):
        done = super().step(state, t, x)
        if t == 1:
            x.mul_(0.5)
        return done


class MutatingDict(Coins):
    def step(self, state, t, data):
        done = super().step(state, t, data["x"])
        data["x"].add_(1.0)
        return done


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_writing_into_an_argument_refused(engine):
    """At 2c2398b the step's ``x.mul_(0.5)`` changed the caller's tensor and ``Result.observed`` silently
    (SMC: x = [1, 0] came back as [0.5, 0]; Importance failed at site x_0 with a support error, because the
    trace's x_0 is a view of the written x)."""
    x = X.clone()
    with pytest.raises(ProgramError, match=r"Mutating in step 1: the program wrote in place into the caller's "
                                           r"argument 0"):
        ENGINES[engine]().run(Mutating(), None, x)
    with pytest.raises(ProgramError, match=r"MutatingDict in step 0: .* argument 0\['x'\]"):
        ENGINES[engine]().run(MutatingDict(), None, {"x": X.clone()})
    x = X.clone()
    ENGINES[engine]().run(Coins(), None, x)
    assert torch.equal(x, X)


# ---------------------------------------------------------------------------------------------- site names
class CoinsOneName(pt.Program):
    """Coins written with the one naming rule of both backends: ``"z"`` and ``"x"`` at every step (as a JAX program
    must name them), docs/architecture.md, "Site names"."""

    def step(self, state, t, x):
        n = pt.particles()
        z = pt.sample("z", dist.Bernoulli(torch.full((n,), P[t])))
        pt.observe("x", dist.Bernoulli(0.1 + 0.7 * z), x[t])
        return torch.full((n,), t == len(P) - 1)


def test_one_name_at_every_step_is_stacked_and_weighs_like_per_step_names(engine="SMC"):
    """The same program with ``"z"`` at every step and with ``f"z_{t}"``: the same particles and weights under one
    seed (so the same exact log Z), and ``samples["z"]`` is the per-step sites stacked, ``[n, steps]`` (resampling
    re-indexes every step's entry: the rows stay whole particles)."""
    torch.manual_seed(0)
    per_step = ENGINES[engine]().run(Coins(), None, X)
    torch.manual_seed(0)
    one_name = ENGINES[engine]().run(CoinsOneName(), None, X)
    assert torch.equal(one_name.log_weights, per_step.log_weights)
    assert one_name.samples["z"].shape == (2000, 2)
    assert torch.equal(one_name.samples["z"], torch.stack([per_step.samples["z_0"], per_step.samples["z_1"]], 1))
    assert abs(float(one_name.log_marginal) - exact_log_z()) < 0.05


def test_a_whole_trace_engine_names_the_fix_for_one_name_at_every_step():
    """Importance runs a program as one Pyro trace: ``"z"`` at every step collides there; the error says so, names
    the two ways out, and does not print Pyro's trace-shape table."""
    with pytest.raises(ProgramError, match="one Pyro trace") as e:
        Importance(16).run(CoinsOneName(), None, X)
    assert "f'z_{t}'" in str(e.value) and "pt.infer.SMC" in str(e.value) and "Trace Shapes" not in str(e.value)
