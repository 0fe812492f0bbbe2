"""Langevin posterior sampling of continuous latents: ULA and MALA (docs/architecture.md, "Engines").

The latent-thought model samples its posterior p(z | x) with Langevin dynamics
(latent-thought-models.txt, Eq. 4)::

    z^{tau+1} = z^tau + s grad_z log p(z^tau | x) + sqrt(2 s) eps^tau,   eps^tau ~ N(0, I).

With the potential energy U(z) = -log p(x, z) (so grad U = -grad log p(z | x)) one step is::

    z' = z - s grad U(z) + sqrt(2 s) xi,                                  xi ~ N(0, I)     (ULA)

The unadjusted Langevin algorithm (ULA) always moves to z' and is biased for any s > 0 (its
stationary law is not the posterior; for a Gaussian target with precision P its covariance is
(P - s P^2 / 2)^{-1}). The Metropolis-adjusted Langevin algorithm (MALA; Besag 1994, Roberts &
Tweedie 1996) keeps the same proposal q(z' | z) = N(z' ; z - s grad U(z), 2 s I) and accepts z'
with probability::

    alpha(z, z') = min(1, exp(-U(z')) q(z | z') / (exp(-U(z)) q(z' | z))),
    log q(z' | z) = -||z' - z + s grad U(z)||^2 / (4 s) + const,

which makes the posterior exactly invariant. Both run in Pyro's unconstrained space: U is Pyro's
potential function from :func:`pyro.infer.mcmc.util.initialize_model` (log joint of the model plus
the log |Jacobian| of the transforms of constrained sites), so any Pyro model with continuous
latent sites works; samples come back in the constrained space.

The step size s is adapted during warmup by dual averaging (Hoffman & Gelman 2014, Pyro's
:class:`~pyro.ops.dual_averaging.DualAveraging`) on log s toward a target acceptance probability:
0.57 for MALA (the optimal MALA rate of Roberts & Rosenthal 1998), 0.99 for ULA, which adapts with the
MALA acceptance probability computed but not used. ULA needs the higher target because nothing corrects
its bias: on a Gaussian target with precision P its stationary sd is sd_post (1 - s P / 2)^{-1/2}, and the
step that gives a MALA acceptance of 0.57 in one dimension has s P ~ 1.9, near ULA's stability limit
s P = 2 (sd 6x too large). At 0.99 the adapted step has s P ~ 0.17 in one dimension (sd about 4% too
large, less in more dimensions, where the same acceptance needs a smaller step); MALA is exact.

Chains. Pyro's ``MCMC`` with ``num_chains > 1`` starts one process per chain whenever the machine
has more CPUs than chains, which needs picklable models and pays a process start-up per run;
with too few CPUs it falls back to sequential chains with a warning. :class:`Langevin`
therefore runs each chain as its own single-chain ``MCMC`` in this process, one after the other,
with a fresh kernel (so each chain adapts its own step size) and, when ``seed`` is given, its own
torch seed drawn from ``seed`` (:meth:`Langevin.chain_seeds`), set inside
:func:`torch.random.fork_rng` so that the caller's global RNG state is left untouched. That is
deterministic, works for any model (closures, ``nn.Module`` s, CUDA tensors) and costs nothing
extra for models this small; vectorising chains inside the kernel would require every model to
broadcast over a chain dimension.
"""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pyro
import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from pyro.infer.mcmc import MCMC
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from pyro.infer.mcmc.util import initialize_model
from pyro.ops.dual_averaging import DualAveraging
from pyro.ops.integrator import potential_grad
from pyro.poutine import block, trace
from pyro.poutine.subsample_messenger import _Subsample
from pyro.util import optional

from ppl_thought.errors import ArgumentTypeError, ConfigError, DiscreteLatentError, NumericalError
from ppl_thought.inference.result import Result
from ppl_thought.validation import checked, per_token

__all__ = ["MALA_TARGET_ACCEPT", "ULA_TARGET_ACCEPT", "DiscreteLatentError", "Langevin", "LangevinKernel",
           "default_target_accept"]

Params = dict[str, torch.Tensor]

_MIN_STEP_SIZE = 1e-10
_MAX_STEP_SIZE = 1e10
# A step whose log acceptance ratio is below -_MAX_LOG_RATIO (or not finite) is counted as a
# divergence, as Pyro's HMC does with an energy error above 1000.
_MAX_LOG_RATIO = 1000.0
#: The default acceptance target of step adaptation: MALA's optimal rate (Roberts & Rosenthal 1998) ...
MALA_TARGET_ACCEPT = 0.57
#: ... and ULA's, high enough that ULA's uncorrected bias stays small in one dimension (module docstring).
ULA_TARGET_ACCEPT = 0.99


def default_target_accept(adjust: bool) -> float:
    """The acceptance target step adaptation aims at by default: 0.57 for MALA, 0.99 for ULA."""
    return MALA_TARGET_ACCEPT if adjust else ULA_TARGET_ACCEPT



def discrete_latent_sites(model: Callable, *args: Any, **kwargs: Any) -> list[str]:
    """Names of the unobserved sample sites of ``model(*args, **kwargs)`` with discrete support.

    The model is run once under :func:`pyro.poutine.trace` (blocked, so no outer handler sees it).
    Subsample sites of ``pyro.plate`` are not latents and are skipped.
    """
    with block():
        tr = trace(model).get_trace(*args, **kwargs)
    names = []
    for name, site in tr.nodes.items():
        if site["type"] != "sample" or site["is_observed"] or isinstance(site["fn"], _Subsample):
            continue
        fn = site["fn"]
        if getattr(fn, "has_enumerate_support", False) or fn.support.is_discrete:
            names.append(name)
    return names


def _sq_norm(params: Params) -> torch.Tensor:
    return sum(v.pow(2).sum() for v in params.values())


def _all_finite(pe: torch.Tensor, grads: Params) -> bool:
    return bool(torch.isfinite(pe)) and all(bool(torch.isfinite(g).all()) for g in grads.values())


@checked
class LangevinKernel(MCMCKernel):
    r"""One Langevin step per call: ULA (``adjust=False``) or MALA (``adjust=True``).

    Proposal (latent-thought-models.txt, Eq. 4, with U(z) = -log p(x, z) in Pyro's
    unconstrained space)::

        z' = z - s grad U(z) + sqrt(2 s) xi,   xi ~ N(0, I),

    i.e. q(z' | z) = N(z' ; z - s grad U(z), 2 s I). MALA accepts with
    ``min(1, exp(U(z) - U(z') + log q(z | z') - log q(z' | z)))``; ULA always moves (a proposal
    whose potential or gradient is not finite is refused and counted as a divergence, so a chain
    never turns into NaN). Both record that acceptance probability in :attr:`last_accept_prob`,
    and both adapt ``s`` with it during warmup.

    :param model: a Pyro model; its continuous latent sites are sampled. Models with discrete
        latent sites are refused with :class:`DiscreteLatentError` naming the sites.
    :param potential_fn: instead of ``model``, a function of a dict of unconstrained tensors
        returning the potential energy U(z); then the initial parameters must be given (e.g.
        ``MCMC(..., initial_params=...)`` or :attr:`initial_params`).
    :param step_size: the initial step size s.
    :param adjust: ``True`` for MALA (Metropolis-adjusted), ``False`` for ULA.
    :param adapt_step_size: adapt s during warmup by dual averaging on log s.
    :param target_accept: the acceptance probability the adaptation aims at; ``None`` (default): 0.57
        for MALA (its optimal rate), :data:`ULA_TARGET_ACCEPT` (0.99) for ULA: in low dimension the
        step that gives 0.57 sits near ULA's stability limit s = 2 / lambda_max(Hessian of U), where
        ULA's bias explodes (module docstring).
    :param jit_compile: trace the potential energy with the PyTorch JIT (Pyro's option).
    :param transforms: site name -> transform from the constrained to the unconstrained space;
        Pyro's automatic ``biject_to`` transforms when ``None``.
    :param init_strategy: Pyro's per-site initialisation (default: uniform in (-2, 2) in the
        unconstrained space, as HMC/NUTS).
    """

    def __init__(
        self,
        model: Callable | None = None,
        potential_fn: Callable[[Params], torch.Tensor] | None = None,
        step_size: float = 0.1,
        adjust: bool = True,
        adapt_step_size: bool = True,
        target_accept: float | None = None,
        jit_compile: bool = False,
        transforms: dict | None = None,
        *,
        init_strategy: Callable = init_to_uniform,
    ) -> None:
        target_accept = default_target_accept(adjust) if target_accept is None else target_accept
        if (model is None) == (potential_fn is None):
            raise ConfigError("LangevinKernel: give exactly one of `model` or `potential_fn`, got neither or both.")
        if not step_size > 0:
            raise ConfigError(f"LangevinKernel: step_size must be > 0, got {step_size}.")
        if not 0.0 < target_accept < 1.0:
            raise ConfigError(f"LangevinKernel: target_accept must be in (0, 1), got {target_accept}.")
        self.model = model
        self.potential_fn = potential_fn
        self.transforms = transforms
        self.adjust = adjust
        self.adapt_step_size = adapt_step_size
        self.target_accept = target_accept
        self._jit_compile = jit_compile
        self._init_strategy = init_strategy
        self._initial_step_size = float(step_size)
        self._reset()
        super().__init__()

    # ----------------------------------------------------------------------------- state
    def _reset(self) -> None:
        self.step_size = self._initial_step_size
        self._t = 0
        self._warmup_steps = 0
        self._accept_cnt = 0
        self._mean_accept_prob = 0.0
        self._divergences: list[int] = []
        self._dual_averaging: DualAveraging | None = None
        self._initial_params: Params | None = None
        self._prototype_trace = None
        self.last_accept_prob = float("nan")
        self.last_divergent = False
        self.last_proposal: Params | None = None
        self.clear_cache()

    def _cache(self, z: Params, potential_energy: torch.Tensor, z_grads: Params) -> None:
        self._z_last, self._potential_energy_last, self._z_grads_last = z, potential_energy, z_grads

    def clear_cache(self) -> None:
        self._z_last = None
        self._potential_energy_last = None
        self._z_grads_last = None

    @property
    def initial_params(self) -> Params | None:
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: Params | None) -> None:
        self._initial_params = params

    @property
    def potential_energy(self) -> torch.Tensor | None:
        """U at the chain's current state (``None`` before :meth:`setup`)."""
        return self._potential_energy_last

    # ----------------------------------------------------------------------------- setup
    def setup(self, warmup_steps: int, *args: Any, **kwargs: Any) -> None:
        """Build U and the transforms from the model (Pyro's ``initialize_model``) and initialise."""
        self._warmup_steps = warmup_steps
        if self.model is not None:
            discrete = discrete_latent_sites(self.model, *args, **kwargs)
            if discrete:
                raise DiscreteLatentError(
                    "Langevin sampling needs continuous latent sites; the model has latent "
                    f"sites with discrete support: {', '.join(repr(n) for n in discrete)}. "
                    "Observe them, marginalise them out, or use an importance/SMC engine."
                )
            init_params, potential_fn, transforms, prototype_trace = initialize_model(
                self.model,
                args,
                kwargs,
                transforms=self.transforms,
                jit_compile=self._jit_compile,
                skip_jit_warnings=True,
                init_strategy=self._init_strategy,
                initial_params=self._initial_params,
            )
            self.potential_fn = potential_fn
            self.transforms = transforms
            self._initial_params = init_params
            self._prototype_trace = prototype_trace
        if not self._initial_params:
            raise ConfigError(
                "LangevinKernel: nothing to sample. "
                + (
                    "The model has no latent sample sites."
                    if self.model is not None
                    else "With `potential_fn`, give initial_params (a dict of unconstrained tensors)."
                )
            )
        z = {k: v.detach().clone() for k, v in self._initial_params.items()}
        z_grads, pe = potential_grad(self.potential_fn, z)
        if not _all_finite(pe, z_grads):
            raise NumericalError("LangevinKernel: the potential energy or its gradient is not finite at the start.")
        self._cache(z, pe, z_grads)
        if self.adapt_step_size and warmup_steps > 0:
            self.step_size = self._find_reasonable_step_size(z, pe, z_grads)
            # Hoffman & Gelman (2014): shrink toward log(10 s0) to favour larger steps.
            self._dual_averaging = DualAveraging(prox_center=math.log(10 * self.step_size))

    def cleanup(self) -> None:
        self._reset()

    # ----------------------------------------------------------------------------- the step
    def _propose(self, z: Params, z_grads: Params, step_size: float, noise: Params) -> Params:
        """z - s grad U(z) + sqrt(2 s) xi (Eq. 4)."""
        scale = math.sqrt(2 * step_size)
        return {k: z[k] - step_size * z_grads[k] + scale * noise[k] for k in z}

    @staticmethod
    def proposal_log_density(z_to: Params, z_from: Params, grads_from: Params, step_size: float) -> torch.Tensor:
        """log q(z_to | z_from) up to its constant: -||z_to - z_from + s grad U(z_from)||^2 / (4 s)."""
        diff = {k: z_to[k] - z_from[k] + step_size * grads_from[k] for k in z_to}
        return -_sq_norm(diff) / (4 * step_size)

    def log_accept_ratio(
        self,
        z: Params,
        pe: torch.Tensor,
        grads: Params,
        z_new: Params,
        pe_new: torch.Tensor,
        grads_new: Params,
        step_size: float,
    ) -> torch.Tensor:
        """log of the MALA Metropolis-Hastings ratio U(z) - U(z') + log q(z | z') - log q(z' | z).

        ``-inf`` when U(z') or its gradient is not finite (the target has no mass there).
        """
        if not _all_finite(pe_new, grads_new):
            return pe.new_tensor(-math.inf)
        log_ratio = (
            pe
            - pe_new
            + self.proposal_log_density(z, z_new, grads_new, step_size)
            - self.proposal_log_density(z_new, z, grads, step_size)
        )
        return torch.nan_to_num(log_ratio, nan=-math.inf)

    def accept_prob(self, z: Params, z_new: Params, step_size: float | None = None) -> torch.Tensor:
        """The MALA acceptance probability min(1, ratio) of the move z -> z' (unconstrained values).

        Evaluates U and grad U at both points with the kernel's potential function (after
        :meth:`setup`, or with ``potential_fn``); ``step_size`` defaults to the current one.
        """
        if self.potential_fn is None:
            raise ConfigError("LangevinKernel.accept_prob: call setup(...) first (no potential function yet).")
        s = self.step_size if step_size is None else float(step_size)
        z = {k: v.detach().clone() for k, v in z.items()}
        z_new = {k: v.detach().clone() for k, v in z_new.items()}
        grads, pe = potential_grad(self.potential_fn, z)
        grads_new, pe_new = potential_grad(self.potential_fn, z_new)
        log_ratio = self.log_accept_ratio(z, pe, grads, z_new, pe_new, grads_new, s)
        return log_ratio.clamp(max=0.0).exp()

    def _trial(self, z: Params, pe: torch.Tensor, grads: Params, step_size: float, noise: Params):
        z_new = self._propose(z, grads, step_size, noise)
        # Distribution checks are off while adapting (wild steps are expected), as in Pyro's HMC.
        with optional(pyro.validation_enabled(False), self._t < self._warmup_steps):
            grads_new, pe_new = potential_grad(self.potential_fn, z_new)
        log_ratio = self.log_accept_ratio(z, pe, grads, z_new, pe_new, grads_new, step_size)
        return z_new, pe_new, grads_new, log_ratio

    def _find_reasonable_step_size(self, z: Params, pe: torch.Tensor, grads: Params) -> float:
        """Double or halve s until the one-step acceptance probability crosses the target.

        As Pyro's HMC does before dual averaging; the noise is drawn once and reused so the
        search is monotone in s for a fixed draw.
        """
        step_size = self.step_size
        noise = {k: torch.randn_like(v) for k, v in z.items()}
        log_target = math.log(self.target_accept)
        direction = 1 if float(self._trial(z, pe, grads, step_size, noise)[3]) > log_target else -1
        for _ in range(100):
            new = step_size * 2.0**direction
            if not _MIN_STEP_SIZE < new < _MAX_STEP_SIZE:
                break
            step_size = new
            new_direction = 1 if float(self._trial(z, pe, grads, step_size, noise)[3]) > log_target else -1
            if new_direction != direction:
                break
        return min(max(step_size, _MIN_STEP_SIZE), _MAX_STEP_SIZE)

    @per_token
    def sample(self, params: Params) -> Params:
        """One ULA or MALA transition from ``params`` (unconstrained); adapts s during warmup."""
        z, pe, grads = self._z_last, self._potential_energy_last, self._z_grads_last
        if z is None:  # cache cleared: start from the given params
            z = {k: v.detach().clone() for k, v in params.items()}
            grads, pe = potential_grad(self.potential_fn, z)
        step_size = self.step_size
        noise = {k: torch.randn_like(v) for k, v in z.items()}
        z_new, pe_new, grads_new, log_ratio = self._trial(z, pe, grads, step_size, noise)
        finite = _all_finite(pe_new, grads_new)
        accept_prob = float(log_ratio.clamp(max=0.0).exp())
        divergent = (not finite) or float(log_ratio) < -_MAX_LOG_RATIO
        if self.adjust:
            accepted = float(torch.rand((), device="cpu")) < accept_prob  # the host decides (Pyro's MCMC loop)
        else:
            accepted = finite
        if accepted:
            z, pe, grads = z_new, pe_new, grads_new
        self._cache(z, pe, grads)

        self._t += 1
        self.last_accept_prob = accept_prob
        self.last_divergent = divergent
        self.last_proposal = z_new
        if self._t <= self._warmup_steps:
            n = self._t
            if self._dual_averaging is not None:
                self._adapt(accept_prob, final=self._t == self._warmup_steps)
        else:
            n = self._t - self._warmup_steps
            self._accept_cnt += int(accepted)
            if divergent:
                self._divergences.append(n - 1)
        self._mean_accept_prob += (accept_prob - self._mean_accept_prob) / n
        return dict(z)

    def _adapt(self, accept_prob: float, final: bool) -> None:
        """Dual averaging on log s with statistic target - alpha (Hoffman & Gelman 2014, Alg. 5)."""
        self._dual_averaging.step(self.target_accept - accept_prob)
        log_step, log_step_avg = self._dual_averaging.get_state()
        log_step = log_step_avg if final else log_step
        self.step_size = min(max(math.exp(log_step), _MIN_STEP_SIZE), _MAX_STEP_SIZE)

    # ----------------------------------------------------------------------------- reporting
    def logging(self) -> OrderedDict:
        return OrderedDict([("step size", f"{self.step_size:.2e}"), ("acc. prob", f"{self._mean_accept_prob:.3f}")])

    def diagnostics(self) -> dict[str, Any]:
        n = self._t - self._warmup_steps
        return {
            "divergences": list(self._divergences),
            "acceptance rate": self._accept_cnt / n if n > 0 else float("nan"),
            "mean accept prob": self._mean_accept_prob,
            "step size": self.step_size,
        }


def _observed(model: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The data the engine saw, by the model's parameter names when they can be bound."""
    try:
        bound = inspect.signature(model).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        out: dict[str, Any] = dict(kwargs)
        if args:
            out["args"] = args
        return out
    return dict(bound.arguments)


@checked
class Langevin:
    """Langevin posterior sampling engine (latent-thought-models.txt, Eq. 4; ULA or MALA).

    Runs ``num_chains`` chains of :class:`LangevinKernel` with Pyro's :class:`~pyro.infer.mcmc.MCMC`
    (sequentially, in this process; see the module docstring), each with ``warmup_steps`` warmup
    steps (step-size adaptation) and ``num_steps`` kept draws.

    ``run(model, None, *args, **kwargs)`` returns a :class:`Result` with
    ``samples[name]``: ``[num_chains, num_steps, *site_shape]`` in the constrained space, and
    ``stats``: ``"accept_prob"`` (the MALA acceptance probability of each kept step; for ULA the
    one it would have had), ``"step_size"`` (the adapted step size), ``"divergences"`` (bool),
    ``"potential_energy"`` (U at the kept draw, unconstrained space), all ``[num_chains, num_steps]``.
    ``observed`` maps the model's parameter names to the data given. Keyword-only extras:
    ``adapt_step_size``, ``jit_compile``, ``transforms``, ``init_strategy`` (see
    :class:`LangevinKernel`, whose note on ``target_accept`` for ULA applies here).
    """

    def __init__(
        self,
        step_size: float = 0.1,
        num_steps: int = 1000,
        num_chains: int = 4,
        warmup_steps: int = 500,
        adjust: bool = True,
        target_accept: float | None = None,
        disable_progbar: bool = False,
        seed: int | None = None,
        *,
        adapt_step_size: bool = True,
        jit_compile: bool = False,
        transforms: dict | None = None,
        init_strategy: Callable = init_to_uniform,
    ) -> None:
        if num_steps < 1 or num_chains < 1 or warmup_steps < 0:
            raise ConfigError(
                f"Langevin: need num_steps >= 1, num_chains >= 1, warmup_steps >= 0; got "
                f"{num_steps}, {num_chains}, {warmup_steps}."
            )
        self.step_size = step_size
        self.num_steps = num_steps
        self.num_chains = num_chains
        self.warmup_steps = warmup_steps
        self.adjust = adjust
        self.target_accept = default_target_accept(adjust) if target_accept is None else target_accept
        self.disable_progbar = disable_progbar
        self.seed = seed
        self.adapt_step_size = adapt_step_size
        self.jit_compile = jit_compile
        self.transforms = transforms
        self.init_strategy = init_strategy

    def chain_seeds(self) -> list[int]:
        """The torch seed of each chain, drawn from ``seed`` (distinct seeds give unrelated chains)."""
        if self.seed is None:
            raise ConfigError("Langevin.chain_seeds: no seed was given.")
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, 2**62, (self.num_chains,), generator=gen, device="cpu").tolist()

    def kernel(self, model: Callable) -> LangevinKernel:
        """A fresh kernel for one chain."""
        return LangevinKernel(
            model,
            step_size=self.step_size,
            adjust=self.adjust,
            adapt_step_size=self.adapt_step_size,
            target_accept=self.target_accept,
            jit_compile=self.jit_compile,
            transforms=self.transforms,
            init_strategy=self.init_strategy,
        )

    def _run_chain(self, model: Callable, args: tuple, kwargs: dict) -> tuple[dict, dict]:
        stats: dict[str, list] = {
            "accept_prob": [],
            "step_size": [],
            "divergences": [],
            "potential_energy": [],
        }

        def record(kernel: LangevinKernel, params: Params, stage: str, i: int) -> None:
            if stage.startswith("Sample"):
                stats["accept_prob"].append(kernel.last_accept_prob)
                stats["step_size"].append(kernel.step_size)
                stats["divergences"].append(kernel.last_divergent)
                stats["potential_energy"].append(float(kernel.potential_energy))

        mcmc = MCMC(
            self.kernel(model),
            num_samples=self.num_steps,
            warmup_steps=self.warmup_steps,
            num_chains=1,
            hook_fn=record,
            disable_progbar=self.disable_progbar,
        )
        mcmc.run(*args, **kwargs)
        return mcmc.get_samples(group_by_chain=True), stats

    def run(self, model: Callable, guide: Callable | None = None, *args: Any, **kwargs: Any) -> Result:
        """Sample p(latents | data) of ``model(*args, **kwargs)``; ``guide`` must be ``None``."""
        if guide is not None:
            raise ArgumentTypeError(
                "Langevin.run takes no guide: it samples the model's posterior directly "
                "(call run(model, None, *data)); got guide="
                f"{getattr(guide, '__name__', type(guide).__name__)}."
            )
        seeds = None if self.seed is None else self.chain_seeds()
        chain_samples, chain_stats = [], []
        for chain in range(self.num_chains):
            if self.seed is None:
                samples, stats = self._run_chain(model, args, kwargs)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seeds[chain])
                    samples, stats = self._run_chain(model, args, kwargs)
            chain_samples.append(samples)
            chain_stats.append(stats)
        samples = {name: torch.cat([s[name] for s in chain_samples]) for name in chain_samples[0]}
        stats = {
            "accept_prob": torch.tensor([s["accept_prob"] for s in chain_stats], device="cpu"),
            "step_size": torch.tensor([s["step_size"] for s in chain_stats], device="cpu"),
            "divergences": torch.tensor([s["divergences"] for s in chain_stats], dtype=torch.bool, device="cpu"),
            "potential_energy": torch.tensor([s["potential_energy"] for s in chain_stats], device="cpu"),
        }
        return Result(samples=samples, stats=stats, observed=_observed(model, args, kwargs), engine="langevin")
