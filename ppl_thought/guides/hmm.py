"""Step-wise guides for hidden Markov models: the exact posterior (backward algorithm) and the filtering proposal.

:meth:`HMMGuide.posterior(hmm) <HMMGuide.posterior>` and :meth:`HMMGuide.filtering(hmm) <HMMGuide.filtering>` build an
:class:`HMMGuide`; both are programs with the model's sites ``z_t`` (Def 2.2 step by step).
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch

from ppl_thought.errors import ConfigError
from ppl_thought.models.hmm import DTYPE, HMM, all_done, prior_logits
from ppl_thought.program import Program, run_whole
from ppl_thought.validation import ArrayLike, checked, per_token

__all__ = ["HMMGuide"]


@checked
class HMMGuide(Program):
    """A step-wise guide for :class:`~ppl_thought.models.HMM` sampling exactly the sites ``z_0 .. z_{T-1}``
    (no x sites).

    ``backward=True``: ``q(z_t | z_{t-1}) = P(z_t | z_{t-1}, x)`` (:meth:`posterior`);
    ``backward=False``: ``q(z_t | z_{t-1}) = P(z_t | z_{t-1}, x_t)`` (:meth:`filtering`).
    Called as ``guide(x)`` with the model's arguments (x is required). Where no hidden state
    can explain the observations from ``z_{t-1}`` on (the conditional is undefined: P(x) = 0 or
    a path the posterior never reaches), it falls back to the prior row ``A[z_{t-1}]`` (``lam``),
    so nothing is NaN and the model's weight is ``-inf`` there. Sites and shapes as the model's
    ``z_t``; log-probs float64.
    """

    max_plate_nesting = 0

    def __init__(self, hmm: HMM, backward: bool):
        self.hmm = hmm
        self.backward = bool(backward)
        self._key: torch.Tensor | None = None
        self._score: torch.Tensor | None = None

    @classmethod
    def posterior(cls, hmm: HMM) -> HMMGuide:
        """The exact posterior as a step-wise guide: ``z_t ~ P(z_t | z_{t-1}, x_0 .. x_{T-1})``.

        By the backward algorithm, ``P(z_t | z_{t-1}, x) ∝ A[z_{t-1}, z_t] B[z_t, x_t] beta_t(z_t)``
        (``lam`` instead of ``A[z_{t-1}]`` at t = 0), so every importance weight p(z, x) / q(z)
        equals ``P(x)`` (the forward algorithm's (3.1)): the zero-variance proposal.
        """
        return cls(hmm, backward=True)

    @classmethod
    def filtering(cls, hmm: HMM) -> HMMGuide:
        """The locally optimal SMC proposal ``z_t ~ P(z_t | z_{t-1}, x_t) ∝ A[z_{t-1}, z_t] B[z_t, x_t]``.

        It looks at the current observation only (no backward messages); the incremental SMC
        weight is then ``P(x_t | z_{t-1}) = sum_z A[z_{t-1}, z] B[z, x_t]``.
        """
        return cls(hmm, backward=False)

    def __repr__(self) -> str:
        return f"HMMGuide({self.hmm!r}, {'posterior' if self.backward else 'filtering'})"

    def __call__(self, x: ArrayLike | None = None, length: int | None = None) -> dict:
        """Run the guide as one Pyro trace (sites ``z_0 .. z_{T-1}``); returns the final state."""
        return run_whole(self, x=x, length=length)

    def _scores(self, x) -> torch.Tensor:
        """``log B[:, x_t] (+ log beta_t)`` for each t: ``[T, |Omega|]`` (cached for the current x)."""
        if x is None:
            raise ConfigError(f"{self!r} proposes hidden states given the observations: call it with x")
        xt = torch.as_tensor(x)
        if self._key is not None and self._key.shape == xt.shape and torch.equal(self._key, xt.to(self._key.device)):
            return self._score
        T = self.hmm.program_length(x, None)
        xb = self.hmm.check_x(x)[0][0]
        score = self.hmm.log_B.T[xb] if T else torch.zeros(0, self.hmm.num_states, dtype=DTYPE,
                                                           device=self.hmm.device)
        if self.backward and T:
            score = score + self.hmm.backward(xb)
        self._key, self._score = xt.detach().clone(), score
        return score

    @per_token
    def init(self, state: dict, x: ArrayLike | None = None, length: int | None = None) -> None:
        """Compute the per-step scores for x (backward messages for the posterior) and set ``max_steps = T``."""
        self.max_steps = max(1, self.hmm.program_length(x, length))
        self._scores(x)

    @per_token
    def step(self, state: dict, t: int, x: ArrayLike | None = None, length: int | None = None) -> torch.Tensor | None:
        """Sample ``z_t`` from the proposal given ``state["z"] = z_{t-1}``; all-True flags at t = T - 1."""
        score = self._scores(x)
        T = score.shape[0]
        if t >= T:
            return all_done(self.hmm.device)
        prior = prior_logits(self.hmm, state, t)
        logits = prior + score[t]
        dead = torch.isneginf(logits).all(-1, keepdim=True)  # nothing explains x from here: use the prior
        logits = torch.where(dead, prior, logits)
        z = pyro.sample(f"z_{t}", dist.Categorical(logits=logits))
        state["z"] = z
        return all_done(self.hmm.device) if t == T - 1 else None
