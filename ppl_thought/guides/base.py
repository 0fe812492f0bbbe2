"""The sampler protocol of Def 3.1 and its Pyro face (docs/architecture.md, "Guides").

A sampler Q maps an observation x to a law Q(. | x) supported on the lifting Proj^{-1}_{<w}(x)
(Def 3.1). Every sampler in :mod:`ppl_thought.guides` offers

- ``sample(x, n) -> LongTensor [n, L]``: n latent sequences, right-padded with ``<pad>`` to the
  event length L = ``projection.domain(len(x)).max_len`` of the model's site ``"z"``;
- ``sample_with_log_prob(x, n) -> (z, log Q(z | x))``;
- ``log_prob(z, x) -> [n]``: log Q(z | x), ``-inf`` outside the lifting (never NaN);
- ``__call__(x)``: a Pyro guide sampling the site ``"z"`` from :class:`SamplerDistribution`;
- ``init(state, x)`` / ``step(state, t, x)``: the same law as a :class:`~ppl_thought.program.Program`
  whose step t samples segment t of the lifting (Lemma 2.1) at site ``f"z_{t}"``, the guide of
  :class:`~ppl_thought.models.SlowThinking`'s steps (SMC). Q(z | x) is the product of the segment
  laws, so a whole trace of the steps and ``__call__`` give the same law.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import pyro
import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought.distributions.lm_sequence import LMSequence
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.errors import ArgumentTypeError, ConfigError, MalformedSequenceError
from ppl_thought.lm.base import as_id_batch, lm_device
from ppl_thought.program import Program, Shared, is_program, particles
from ppl_thought.projections.automaton import Automaton, step_ends
from ppl_thought.projections.base import Projection, as_id_array
from ppl_thought.validation import ArrayLike, checked, per_token
from ppl_thought.vocab import PAD_ID


@checked
class Sampler(Program, ABC):
    """Base class of samplers Q(z | x) (Def 3.1). Subclasses implement ``_sample`` and ``_log_prob``,
    and ``step_state(x, n)`` (the batched state the segments are drawn from) for the step-wise face."""

    projection: Projection
    site: str = "z"
    max_plate_nesting = 0

    # ------------------------------------------------------------------ helpers
    def _automata(self) -> dict:
        cache = self.__dict__.get("_automata_cache")
        if cache is None or len(cache) > 256:
            cache = self.__dict__["_automata_cache"] = {}
        return cache

    def lifting(self, x: ArrayLike) -> Automaton:
        """The lifting automaton of x (Prop 2.3), cached per x; NotInImageError names bad input."""
        xa = as_id_array(x, self.projection.vocab, "observation x", unpad=True)
        key = ("lift", tuple(xa.tolist()))
        cache = self._automata()
        if key not in cache:
            cache[key] = self.projection.lifting(xa)
        return cache[key]

    def domain(self, n: int) -> Automaton:
        """``projection.domain(n)``, cached."""
        key = ("dom", int(n))
        cache = self._automata()
        if key not in cache:
            cache[key] = self.projection.domain(int(n))
        return cache[key]

    @property
    def device(self) -> torch.device:
        """Where the sampler's tensors are made: its LM's device (``self.lm``), else its model's prior's, else CPU."""
        for lm in (getattr(self, "lm", None), getattr(getattr(self, "model", None), "prior", None)):
            if isinstance(lm, torch.nn.Module):
                return lm_device(lm)
        return torch.device("cpu")

    def x_ids(self, x: ArrayLike) -> torch.Tensor:
        """x as a 1-D LongTensor of ids on the sampler's device (text, token strings, ids); non-observable
        tokens raise."""
        xa = as_id_array(x, self.projection.vocab, "observation x", unpad=True)
        self.lifting(xa)  # NotInImageError naming the problem
        return torch.as_tensor(xa, dtype=torch.long, device=self.device)

    def event_length(self, x: ArrayLike) -> int:
        """L = ``projection.domain(|x|).max_len``: the event length of the model's site ``"z"``."""
        n = len(self.x_ids(x))
        L = self.domain(n).max_len
        if L is None:
            raise ConfigError(f"{type(self.projection).__name__}.domain({n}) is unbounded: no event length")
        return int(L)

    def _check_z(self, z, L: int) -> torch.Tensor:
        z = as_id_batch(z, "latent sequences", None if isinstance(z, torch.Tensor) else self.device)
        if z.shape[-1] > L:
            if (z[:, L:] != PAD_ID).any():
                raise MalformedSequenceError(f"latent sequence longer than the event length {L}")
            z = z[:, :L]
        elif z.shape[-1] < L:
            z = torch.cat([z, torch.full((z.shape[0], L - z.shape[-1]), PAD_ID, dtype=torch.long, device=z.device)], -1)
        V = len(self.projection.vocab)
        if z.numel() and (z.min() < 0 or z.max() >= V):
            raise MalformedSequenceError(f"latent sequences contain ids outside the vocabulary [0, {V})")
        return z

    # ------------------------------------------------------------------ the protocol
    @abstractmethod
    def _sample(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z [n, L], log Q(z | x) [n])`` for a validated x."""

    @abstractmethod
    def _log_prob(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """log Q(z | x) ``[n]`` for validated ``z [n, L]``."""

    @per_token
    def sample_with_log_prob(self, x: ArrayLike, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n draws Z ~ Q(. | x) (one batched decoding, no loop over particles) and log Q(Z | x)."""
        xt = self.x_ids(x)
        if int(n) < 0:
            raise ConfigError(f"number of samples must be >= 0, got {n}")
        return self._sample(xt, int(n))

    @per_token
    def sample(self, x: ArrayLike, n: int) -> torch.Tensor:
        """n latent sequences ``[n, L]`` drawn from Q(. | x), right-padded with ``<pad>``."""
        return self.sample_with_log_prob(x, n)[0]

    @per_token
    def log_prob(self, z: ArrayLike, x: ArrayLike) -> torch.Tensor:
        """log Q(z | x) ``[n]`` (Def 3.1): ``-inf`` for z outside the lifting of x, never NaN."""
        xt = self.x_ids(x)
        zt = self._check_z(z, self.event_length(xt))
        if zt.shape[0] == 0:
            return torch.zeros(0, device=zt.device)
        return self._log_prob(zt, xt)

    def token_log_probs(self, z: ArrayLike, x: ArrayLike) -> torch.Tensor:
        """log Q(z_i | z_<i, x) ``[n, L]`` for ``z [n, L]`` (0 on padding): the factors of log Q(z | x)
        (the shared-sample estimator of Remark 3.5 needs them)."""
        xt = self.x_ids(x)
        zt = self._check_z(z, self.event_length(xt))
        return self._token_log_probs(zt, xt)

    def _token_log_probs(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not give token probabilities")

    def distribution(self, x: ArrayLike) -> SamplerDistribution:
        return SamplerDistribution(self, x)

    def _register(self) -> None:  # noqa: B027 (optional hook)
        """Register trainable modules with Pyro's param store (overridden by LM-based samplers)."""

    def __call__(self, x: ArrayLike | None = None, *args: Any, **kwargs: Any):
        """The Pyro guide: samples the site ``"z"`` (batch from an enclosing particle plate)."""
        if x is None:
            raise ConfigError("a guide needs the observation x")
        self._register()
        return pyro.sample(self.site, SamplerDistribution(self, x))

    guide = __call__

    # ------------------------------------------------------------------ the step-wise face (SMC)
    def step_state(self, x: torch.Tensor, n: int):
        """An object with ``segment(until_emitted=k)`` (a distribution over the next segment of each
        of ``n`` rows), ``extend(value)`` and ``reorder(index)``: Q decoded segment by segment."""
        raise NotImplementedError(f"{type(self).__name__} has no step-wise form")

    def token_rule(self, x: torch.Tensor) -> TokenRule:
        """The masked softmax under the lifting of x (Def 2.8), cached per x (its tables per device)."""
        key = ("rule", tuple(x.tolist()))
        cache = self._automata()
        if key not in cache:
            cache[key] = TokenRule(self.lifting(x), len(self.projection.vocab))
        return cache[key]

    @per_token
    def init(self, state: dict, x: ArrayLike | None = None, *args: Any, **kwargs: Any) -> None:
        if x is None:
            raise ConfigError("a guide needs the observation x")
        self._register()
        xt = self.x_ids(x)
        state["q"] = self.step_state(xt, particles())
        state["num_observed"] = len(xt)
        state["step_ends"] = Shared(step_ends(self.lifting(xt), chunked=bool(getattr(self, "chunk", 0))))

    @per_token
    def step(self, state: dict, t: int, x: ArrayLike | None = None, *args: Any, **kwargs: Any):
        """Segment t of the lifting (Lemma 2.1): until x_{t+1} is determined; the last one until the end.
        With chunked encoding (``chunk > 0``) step t runs until ``step_ends[t]`` observables are determined
        (:func:`~ppl_thought.projections.automaton.step_ends`: the forced segments that follow a step join it)."""
        q = state["q"]
        ends = state["step_ends"].value if "step_ends" in state else tuple(range(1, state["num_observed"] + 1))
        last = t + 1 >= len(ends)
        seg = pyro.sample(f"{self.site}_{t}", q.segment(until_emitted=None if last else ends[t]))
        q.extend(seg)
        return torch.ones(seg.shape[0], dtype=torch.bool, device=seg.device) if last else None


def num_observed(lifting: Automaton) -> int:
    """|x| read off the lifting automaton of x: the observables its final states have emitted (0 if none)."""
    final = lifting.emitted[lifting.final]
    return int(final.max()) if len(final) else 0


def segment_end(t: int, num_observed: int) -> int | None:
    """``until_emitted`` of step t: segment t ends once t + 1 observables are determined; the last
    segment ends at a final state of the automaton (None)."""
    return t + 1 if t + 1 < num_observed else None


class SequenceGuide(Program):
    """A guide given as ``x -> LMSequence`` under the lifting of x, decoded segment by segment.

    Wraps an :class:`LMSequence` or any object with ``dist(x)`` / ``seq(x)`` returning one (the
    lifting automaton is its constraint), so that SMC can step it.
    """

    def __init__(self, make, site: str = "z"):
        self.make = make
        self.site = site

    def init(self, state: dict, x=None, *args, **kwargs) -> None:
        seq = self.make(x)
        if not isinstance(seq, LMSequence) or seq.constraint is None:
            raise ArgumentTypeError("a sequence guide must give an LMSequence constrained to the lifting of x")
        auto = seq.constraint
        state["q"] = LMState.start(seq.lm, particles(), prompt=seq.prompt, rule=TokenRule(auto, seq.vocab_size),
                                   max_len=seq.max_len, stop_ids=seq.stop_ids, lm_kwargs=seq.lm_kwargs, chunk=seq.chunk)
        state["num_observed"] = num_observed(auto)
        state["step_ends"] = Shared(step_ends(auto, chunked=bool(seq.chunk)))

    step = Sampler.step


def as_step_guide(guide):
    """``guide`` as a program SMC can step: programs and None as they are; LMSequences and objects with
    ``dist(x)`` / ``seq(x)`` wrapped in :class:`SequenceGuide`; anything else unchanged (SMC then says
    what is missing)."""
    if guide is None or is_program(guide):
        return guide
    if isinstance(guide, LMSequence):
        return SequenceGuide(lambda x: guide)
    for name in ("dist", "seq"):
        if callable(getattr(guide, name, None)):
            return SequenceGuide(getattr(guide, name))
    return guide


@checked
class SamplerDistribution(TorchDistribution):
    """Q(. | x) as a Pyro distribution over ``[*batch, L]`` latent arrays.

    ``sample(shape)`` draws ``prod(shape + batch_shape)`` sequences in one batched call of the
    sampler and caches their log Q, so ``log_prob`` of the value just sampled costs nothing
    (as :class:`~ppl_thought.distributions.LMSequence` does).
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)
    has_rsample = False

    def __init__(self, sampler: Sampler, x: ArrayLike, batch_shape: Sequence[int] = (),
                 validate_args: bool | None = None):
        self.sampler = sampler
        self.x = sampler.x_ids(x)
        self.L = sampler.event_length(self.x)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        super().__init__(torch.Size(batch_shape), torch.Size([self.L]), validate_args=validate_args)

    @per_token
    def expand(self, batch_shape: Sequence[int], _instance: SamplerDistribution | None = None):
        new = self._get_checked_instance(SamplerDistribution, _instance)
        new.sampler, new.x, new.L, new._last = self.sampler, self.x, self.L, None
        TorchDistribution.__init__(new, torch.Size(batch_shape), self.event_shape, validate_args=False)
        return new

    @per_token
    def sample(self, sample_shape: Sequence[int] = ()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.batch_shape
        n = int(shape.numel())
        z, lq = self.sampler._sample(self.x, n)
        z, lq = z.reshape(shape + (self.L,)), lq.reshape(shape)
        self._last = (z, lq)
        return z

    @per_token
    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._last is not None and value is self._last[0] and not torch.is_grad_enabled():
            return self._last[1]
        if self._last is not None and value is self._last[0] and not _needs_grad(self.sampler):
            return self._last[1]
        value = torch.as_tensor(value, device=value.device if isinstance(value, torch.Tensor) else self.x.device)
        batch = value.shape[:-1]
        flat = self.sampler._check_z(value.reshape(-1, value.shape[-1]), self.L)
        lp = self.sampler._log_prob(flat, self.x) if flat.shape[0] else torch.zeros(0, device=flat.device)
        return lp.reshape(batch)


def _needs_grad(sampler: Sampler) -> bool:
    mods = [m for m in vars(sampler).values() if isinstance(m, torch.nn.Module)]
    return any(p.requires_grad for m in mods for p in m.parameters())
