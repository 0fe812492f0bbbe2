"""The SVI engine: ``pt.train.SVI(objective, optimizer).run(model, guide, *data, num_steps=...)``.

A thin layer over :class:`pyro.infer.SVI` (the objectives of :mod:`ppl_thought.training.objectives`
are :class:`pyro.infer.ELBO` subclasses, so Pyro's own ``Trace_ELBO`` etc. work too). ``run`` returns a
:class:`~ppl_thought.inference.result.Result` whose ``stats["losses"]`` holds one loss per step,
``stats["params"]`` the value of each small parameter after every step and, for particle objectives (or
any objective with ``num_samples``), a final batch of weighted guide samples with the estimate (3.2) of
log p(x). ``pt.diagnostics.to_inference_data`` puts the trajectory in ``sample_stats`` (draw = step).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pyro
import pyro.optim
import pyro.poutine as poutine
import torch
from pyro.infer import ELBO
from pyro.optim import PyroOptim

from ppl_thought.errors import ConfigError
from ppl_thought.inference.particles import latent_sites, sample_particles
from ppl_thought.inference.result import Result
from ppl_thought.training.objectives import ParticleObjective
from ppl_thought.validation import checked, per_token
from ppl_thought.weights import log_mean_exp


def _log_marginal_stderr(log_w: torch.Tensor) -> torch.Tensor:
    """Delta-method standard error of log p_n: std(w) / (sqrt(n) mean(w)); 0 for equal weights; inf if every
    weight is 0 or there is one weight (no estimate of the spread)."""
    m = log_w.max()
    if not torch.isfinite(m):
        return torch.tensor(float("inf"), device=log_w.device)
    w = torch.exp(log_w - m)
    if len(w) < 2:  # no estimate of the spread from one weight: inf, never NaN
        return torch.tensor(float("inf"), device=w.device)
    return w.std(correction=1) / (math.sqrt(len(w)) * w.mean())


def _no_latents_guide(*args, **kwargs) -> None:
    """The guide of a model without latent sites (SVI with ``guide=None``): it samples nothing."""
    return None


def _warn_if_distributed() -> None:
    """SVI steps this process's param store alone: under a process group of several processes each would train
    its own copy. Say so (the Trainer is the multi-process path)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import warnings

        warnings.warn("pt.train.SVI trains on this process alone (no gradient all-reduce): with "
                      f"{dist.get_world_size()} processes each trains its own copy. Use pt.train.Trainer, which "
                      "averages the gradients over the process group", stacklevel=3)


@checked
class SVI:
    """Stochastic variational inference / training with any ``pyro.infer.ELBO`` objective.

    Args:
        objective: e.g. :class:`~ppl_thought.training.objectives.OneSampler` (3.17),
            ``Sum(OneSampler(n), SamplerPolicyGradient(n))`` ((3.17) + (3.25)), or ``pyro.infer.Trace_ELBO()``.
        optimizer: a ``pyro.optim`` optimizer, or a dict of Adam arguments (``{"lr": 1e-2}``).

    Parameters are those the model and guide register with ``pyro.module`` / ``pyro.param`` (the
    global Pyro param store). For joint gradient clipping (App. L), checkpoints and metrics use
    :class:`~ppl_thought.training.trainer.Trainer`.
    """

    def __init__(self, objective: ELBO, optimizer: PyroOptim | dict):
        if isinstance(optimizer, dict):
            optimizer = pyro.optim.Adam(optimizer)
        self.objective = objective
        self.optimizer = optimizer
        self._svi: dict[tuple[int, int], pyro.infer.SVI] = {}
        self._latent_names: dict[int, tuple[Callable, list[str]]] = {}

    def _inner(self, model: Callable, guide: Callable) -> pyro.infer.SVI:
        key = (id(model), id(guide))
        if key not in self._svi:
            self._svi[key] = pyro.infer.SVI(model, guide, self.optimizer, loss=self.objective)
        return self._svi[key]

    @per_token
    def step(self, model: Callable, guide: Callable | None, *args, **kwargs) -> float:
        """One optimisation step; returns the objective's loss estimate (``guide=None``: see :meth:`run`)."""
        guide = self.resolve_guide(model, guide, args, kwargs)
        return float(self._inner(model, guide).step(*args, **kwargs))

    def resolve_guide(self, model: Callable, guide: Callable | None, args: tuple = (), kwargs: dict | None = None
                      ) -> Callable:
        """The guide SVI fits: ``guide`` itself, or for ``guide=None`` the empty guide when ``model(*args)`` has
        no latent sample site (maximum likelihood of the model's parameters: the ELBO is then log p(x) exactly).

        Importance and SMC read ``guide=None`` as "the model's prior proposes"; SVI has nothing to fit in that
        case, and an ELBO with the prior standing in for a guide would score log p(x, z) without its -log q(z)
        term. So a model with latent sites and ``guide=None`` is refused with a :class:`ConfigError` naming the
        sites and the fix (a guide for them) instead of a silent wrong objective. The model is traced once per
        model object to find its latent sites."""
        if guide is not None:
            return guide
        known = self._latent_names.get(id(model))
        if known is None or known[0] is not model:
            with poutine.block(), torch.no_grad():
                tr = poutine.trace(model).get_trace(*args, **(kwargs or {}))
            known = self._latent_names[id(model)] = (model, sorted(latent_sites(tr)))
        names = known[1]
        if names:
            shown = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
            raise ConfigError(
                f"guide=None: SVI fits a guide, and this model has latent sites ({shown}) that need one. Pass a "
                "guide that samples them: e.g. pt.guides.Causal(lm, model.projection) or pt.guides.Explanatory(...) "
                "for latent token sequences, pyro.infer.autoguide.AutoNormal(model) for continuous latents "
                "(guide=None is accepted only for a model without latent sites: maximum likelihood)")
        return _no_latents_guide

    def _traced_step(self, model: Callable, guide: Callable, args, kwargs) -> tuple[float, list[str]]:
        """One step, and the names of the parameters it used (a param-only trace around it)."""
        with poutine.trace(param_only=True) as tr:
            loss = self.step(model, guide, *args, **kwargs)
        return loss, [name for name, site in tr.trace.nodes.items() if site["type"] == "param"]

    def evaluate_loss(self, model: Callable, guide: Callable | None, *args, **kwargs) -> float:
        guide = self.resolve_guide(model, guide, args, kwargs)
        return float(self.objective.loss(model, guide, *args, **kwargs))

    def run(self, model: Callable, guide: Callable | None, *data, num_steps: int = 100, progress: bool = False,
            num_samples: int | None = None, record_params: int = 256, **kwargs) -> Result:
        """Run ``num_steps`` steps on ``model(*data)`` / ``guide(*data)``.

        ``guide=None`` fits a model without latent sites by maximum likelihood; a model with latent sites
        needs a guide (:meth:`resolve_guide`: a :class:`ConfigError` naming the sites and the fix).

        Returns a Result with ``stats["losses"]`` ``[num_steps]`` (the objective's loss per step; for an
        ELBO objective -loss is the ELBO estimate), ``stats["params"]`` ``{name: [num_steps, ...]}``: the
        constrained value after each step of every parameter the steps used that has at most
        ``record_params`` elements (0: none; a network's weight matrices are not copied every step), and
        ``stats["objective"]``. With ``num_samples`` (default: the particle objective's own batch; none for
        other objectives such as ``pyro.infer.Trace_ELBO``) a final batch of guide samples weighted by
        p/q, importance sampling (3.2) with the fitted guide: ``samples``, ``log_weights``, ``log_marginal``,
        ``stats["log_p"]``, ``["log_q"]``, ``["log_likelihood"]``.
        """
        if isinstance(num_steps, bool) or num_steps < 0:
            raise ConfigError(f"num_steps must be a non-negative int, got {num_steps!r}")
        if num_samples is not None and (isinstance(num_samples, bool)
                                        or num_samples < 1):
            raise ConfigError(f"num_samples must be a positive int (guide samples after the last step), got "
                              f"{num_samples!r}")
        if record_params < 0:
            raise ConfigError(f"record_params must be a non-negative int (max elements of a recorded parameter), "
                              f"got {record_params!r}")
        guide = self.resolve_guide(model, guide, data, kwargs)
        _warn_if_distributed()
        from tqdm.auto import tqdm

        losses: list[float] = []
        trace: dict[str, list[torch.Tensor]] = {}
        store = pyro.get_param_store()
        bar = tqdm(range(num_steps), disable=not progress, desc="SVI")
        for i in bar:
            loss, names = self._traced_step(model, guide, data, kwargs)
            losses.append(loss)
            for name in names:
                if name in store and store[name].numel() <= record_params:
                    trace.setdefault(name, [None] * i).append(store[name].detach().clone())
            if progress:
                bar.set_postfix(loss=f"{losses[-1]:.4g}")
        params = {}
        for name, values in trace.items():
            values += [None] * (num_steps - len(values))  # a parameter first used after step 0: NaN before
            ref = next(v for v in values if v is not None)
            params[name] = torch.stack([v if v is not None else torch.full_like(ref, float("nan"))
                                        for v in values])
        stats = {"losses": torch.tensor(losses, device="cpu"),  # host floats (one per step)
                 "objective": type(self.objective).__name__, "params": params}
        result = Result(samples={}, stats=stats, observed={"args": data, "kwargs": kwargs}, engine="SVI")
        if num_samples is None and not isinstance(self.objective, ParticleObjective):
            return result
        with torch.no_grad():
            if isinstance(self.objective, ParticleObjective):
                pt = self.objective.particles(model, guide, *data, num_particles=num_samples, **kwargs)
            else:
                pt = sample_particles(model, guide, num_samples, *data, **kwargs)
        log_w = pt.log_w
        result.samples = {k: v.detach() for k, v in pt.values.items()}
        result.log_weights = log_w
        result.log_marginal = log_mean_exp(log_w, 0)
        result.log_marginal_stderr = _log_marginal_stderr(log_w)
        stats.update(log_p=pt.log_p.detach(), log_q=pt.log_q.detach())
        if pt.log_likelihood is not None:
            stats["log_likelihood"] = pt.log_likelihood.detach()
        return result
