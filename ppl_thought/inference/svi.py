"""The SVI engine: ``pt.infer.SVI(objective, optimizer).run(model, guide, *data, num_steps=...)``.

A thin layer over :class:`pyro.infer.SVI` (the objectives of :mod:`ppl_thought.inference.objectives`
are :class:`pyro.infer.ELBO` subclasses, so Pyro's own ``Trace_ELBO`` etc. work too). ``run`` returns a
:class:`~ppl_thought.inference.result.Result` whose ``stats["losses"]`` holds one loss per step and,
for particle objectives, a final batch of weighted guide samples with the estimate (3.2) of log p(x).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pyro
import pyro.optim
import torch
from pyro.infer import ELBO
from pyro.optim import PyroOptim

from ppl_thought.inference.objectives import ParticleObjective
from ppl_thought.inference.result import Result, log_mean_exp


def _log_marginal_stderr(log_w: torch.Tensor) -> torch.Tensor:
    """Delta-method standard error of log p_n: std(w) / (sqrt(n) mean(w)); inf if every weight is 0."""
    m = log_w.max()
    if not torch.isfinite(m):
        return torch.tensor(float("inf"))
    w = torch.exp(log_w - m)
    return w.std(correction=1) / (math.sqrt(len(w)) * w.mean()) if len(w) > 1 else torch.tensor(float("nan"))


def _warn_if_distributed() -> None:
    """SVI steps this process's param store alone: under a process group of several processes each would train
    its own copy. Say so (the Trainer is the multi-process path)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import warnings

        warnings.warn("pt.infer.SVI trains on this process alone (no gradient all-reduce): with "
                      f"{dist.get_world_size()} processes each trains its own copy. Use pt.infer.Trainer, which "
                      "averages the gradients over the process group", stacklevel=3)


class SVI:
    """Stochastic variational inference / training with any ``pyro.infer.ELBO`` objective.

    Args:
        objective: e.g. :class:`~ppl_thought.inference.objectives.OneSampler` (3.17),
            ``Sum(OneSampler(n), SamplerPolicyGradient(n))`` ((3.17) + (3.25)), or ``pyro.infer.Trace_ELBO()``.
        optimizer: a ``pyro.optim`` optimizer, or a dict of Adam arguments (``{"lr": 1e-2}``).

    Parameters are those the model and guide register with ``pyro.module`` / ``pyro.param`` (the
    global Pyro param store). For joint gradient clipping (App. L), checkpoints and metrics use
    :class:`~ppl_thought.inference.trainer.Trainer`.
    """

    def __init__(self, objective: ELBO, optimizer: PyroOptim | dict):
        if not isinstance(objective, ELBO):
            raise TypeError(f"objective must be a pyro.infer.ELBO (e.g. pt.infer.OneSampler), got {objective!r}")
        if isinstance(optimizer, dict):
            optimizer = pyro.optim.Adam(optimizer)
        if not isinstance(optimizer, PyroOptim):
            raise TypeError(f"optimizer must be a pyro.optim optimizer or a dict of Adam arguments, got {optimizer!r}")
        self.objective = objective
        self.optimizer = optimizer
        self._svi: dict[tuple[int, int], pyro.infer.SVI] = {}

    def _inner(self, model: Callable, guide: Callable) -> pyro.infer.SVI:
        key = (id(model), id(guide))
        if key not in self._svi:
            self._svi[key] = pyro.infer.SVI(model, guide, self.optimizer, loss=self.objective)
        return self._svi[key]

    def step(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """One optimisation step; returns the objective's loss estimate."""
        return float(self._inner(model, guide).step(*args, **kwargs))

    def evaluate_loss(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        return float(self.objective.loss(model, guide, *args, **kwargs))

    def run(self, model: Callable, guide: Callable, *data, num_steps: int = 100, progress: bool = False,
            **kwargs) -> Result:
        """Run ``num_steps`` steps on ``model(*data)`` / ``guide(*data)``; losses in ``stats["losses"]``."""
        if not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}")
        if not callable(model) or not callable(guide):
            raise TypeError("SVI.run needs a callable model and guide")
        _warn_if_distributed()
        from tqdm.auto import tqdm

        losses = []
        bar = tqdm(range(num_steps), disable=not progress, desc="SVI")
        for _ in bar:
            losses.append(self.step(model, guide, *data, **kwargs))
            if progress:
                bar.set_postfix(loss=f"{losses[-1]:.4g}")
        stats = {"losses": torch.tensor(losses), "objective": type(self.objective).__name__}
        result = Result(samples={}, stats=stats, observed={"args": data}, engine="SVI")
        if isinstance(self.objective, ParticleObjective):
            with torch.no_grad():
                pt = self.objective.particles(model, guide, *data, **kwargs)
            log_w = pt.log_w
            result.samples = {k: v.detach() for k, v in pt.values.items()}
            result.log_weights = log_w
            result.log_marginal = log_mean_exp(log_w, 0)
            result.log_marginal_stderr = _log_marginal_stderr(log_w)
        return result
