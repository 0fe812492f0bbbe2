"""Training loop for P and Q together: joint gradient clipping (App. L), metrics, exact-resume checkpoints.

``Trainer(model, guide, objective, modules={"prior": prior, "sampler": q})`` builds ONE torch optimizer
over the parameters of every module (App. L: "wrap the parameters of the latent model and sampler into
one optimizer") and clips the joint gradient v_latent (+) v_sampler to
v / max(1, ||v|| / clip_norm) instead of clipping each part on its own.

Checkpoints (:mod:`ppl_thought.training.checkpoints`, the mixin :class:`Trainer` inherits) are directories written by
:func:`ppl_thought.io.save_checkpoint` (safetensors + JSON,
atomic writes, no pickle) holding the module weights, the optimizer state (tensors in safetensors,
scalars and param groups in JSON), the torch / numpy / Python RNG states, the step count and the
metrics history, so that ``Trainer.load(path)`` followed by ``fit`` reproduces an uninterrupted run
bit for bit (same device, same library versions).

Several processes (``torchrun --nproc-per-node N``, a ``torch.distributed`` process group; gloo on CPU):
the Trainer finds the initialised group (or takes ``distributed=True``), broadcasts rank 0's weights,
gives each rank its slice of every global batch, and averages the gradients over the global batch with
one all-reduce per step, so that W processes take the optimiser steps one process would take on the same
global batch (see :class:`Trainer`, "Distributed training").
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pyro.infer import ELBO

from ppl_thought.errors import ArgumentTypeError, ConfigError
from ppl_thought.training.checkpoints import FORMAT as FORMAT
from ppl_thought.training.checkpoints import Checkpoints
from ppl_thought.validation import checked, per_token


@checked
def clip_joint_(params: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Clip the gradients of ``params`` (all models together) to ``v / max(1, ||v|| / max_norm)`` (App. L).

    Returns the joint norm ||v|| before clipping (``inf``/NaN norms are returned and the gradients
    are left as they are, so the caller can skip the step). ``max_norm=None`` only measures.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads]))
    if max_norm is not None and torch.isfinite(norm):
        if max_norm <= 0:
            raise ConfigError(f"max_norm must be > 0, got {max_norm}")
        scale = min(1.0, float(max_norm) / (float(norm) + 1e-12)) if float(norm) > max_norm else 1.0
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
    return float(norm)


@checked
def cosine_lr(peak: float, step: int, total: int, warmup: float = 0.05, floor: float = 0.1) -> float:
    """The learning-rate schedule of App. L: linear warm-up from 0 to ``peak`` over the first
    ``warmup`` fraction of ``total`` steps, then a cosine decay to ``floor * peak`` at the last step.
    ``step`` counts from 0."""
    if total < 1 or not 0 <= step < total:
        raise ConfigError(f"step must lie in [0, total), got step={step}, total={total}")
    if not 0.0 <= warmup < 1.0 or not 0.0 <= floor <= 1.0:
        raise ConfigError(f"warmup must lie in [0, 1) and floor in [0, 1], got {warmup} and {floor}")
    w = int(warmup * total)
    if step < w:
        return peak * (step + 1) / w
    progress = (step - w) / max(1, total - 1 - w)
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _unique_params(modules: Mapping[str, torch.nn.Module]) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for m in modules.values():
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def item_seed(seed: int, step: int, index: int) -> int:
    """The torch seed of item ``index`` of the global batch of step ``step`` (both from 0) under ``seed``.

    A hash of the three numbers (numpy's ``SeedSequence``), 64 bits: a function of where the item sits in
    the run, not of the process that computes it. (torch's CPU generator, mt19937, keeps the low 32 bits:
    two of k items share a stream with probability about k^2 / 2^33.)
    """
    words = np.random.SeedSequence([int(seed), int(step), int(index)]).generate_state(2, dtype=np.uint32)
    return int(words[0]) | (int(words[1]) << 32)


def _shard(batch_size: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s slice of a global batch: items ``[rank B / W, (rank + 1) B / W)`` (sizes differ by <= 1)."""
    return range(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)


@checked
class Trainer(Checkpoints):
    """Train ``model``/``guide`` with a particle objective, clipping the joint gradient of all modules.

    Args:
        model, guide: Pyro programs (e.g. ``SlowThinking`` and a sampler guide).
        objective: a ``pyro.infer.ELBO`` with ``loss_and_grads`` (e.g. ``Sum(OneSampler(8),
            SamplerPolicyGradient(8))``: (3.17) for P and (3.25) for Q).
        modules: name -> ``nn.Module`` whose parameters are trained and checkpointed (P, Q, Q^boxminus).
        optimizer: ``params -> torch.optim.Optimizer`` (e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)``);
            defaults to Adam(lr=1e-2). One optimizer over all modules (App. L).
        clip_norm: the joint clip norm (App. L uses 1.0); ``None`` disables clipping.
        batch_size: data items per step, over all processes (the global batch); their gradients are
            averaged (B in (3.16), (3.25)).
        checkpoint_dir, checkpoint_every: write ``checkpoint_dir/step-XXXXXXXX`` every so many steps.
        progress: show a tqdm progress bar (rank 0 only).
        seed: ``None`` (default): the objective draws from the process's global torch RNG. An int: item j
            of the global batch of step t is computed under its own torch stream, seeded with
            :func:`item_seed` (seed, t, j), so the samples depend on where an item sits in the run, not
            on the process (or the number of processes) that computes it.
        distributed: ``None`` (default): train on every process of the initialised default
            ``torch.distributed`` process group if there is one with more than one process; ``True``:
            require one; ``False``: train alone even inside a process group.

    ``fit(dataset, num_steps)`` trains until ``self.step_count == num_steps`` (so a resumed trainer
    continues where it stopped); dataset items are a tuple of model arguments, a dict of keyword
    arguments, or a single argument, visited in order (item ``(step * batch_size + j) % len(dataset)``).
    ``history`` is a list of per-step metric dicts (loss, joint and per-module grad norms, objective stats).

    **Distributed training** (run the same script on W processes, e.g. ``torchrun --nproc-per-node W``,
    after ``torch.distributed.init_process_group("gloo")``; every process builds the same Trainer and calls
    the same ``fit``/``save``/``load``):

    * at construction rank 0's module weights (parameters and buffers) are broadcast to every rank, and
      the ranks check that they agree on batch size, seed, modules and parameter shapes;
    * rank r computes items ``[r B / W, (r + 1) B / W)`` of every global batch (fit reads only those from
      ``dataset``), accumulating the sum of their gradients; then ONE all-reduce per step sums the
      gradients (and which parameters got one) over the ranks, and every rank divides by B. That is
      the single-process gradient (1/B) sum_j g_j of the same global batch, up to the order of the float
      additions; the loss and the objective's statistics are averaged the same way, so every rank holds
      the same metrics, clips the same joint norm and takes the same optimiser step (the weights stay
      equal without further communication);
    * only rank 0 writes checkpoints; the others wait for it (a broadcast that also carries rank 0's
      failure, so that every rank raises instead of hanging); ``save`` is collective;
    * with ``seed`` given, item j of step t sees the same random numbers on any number of processes: the
      guide's samples, hence the losses and the gradients, equal single-process training with that seed
      to float tolerance, and a resumed run repeats an uninterrupted one bit for bit. With
      ``seed=None`` each rank draws from its own global stream (seed it with ``seed + rank``: ranks that
      share a stream draw the same samples for different items, and a warning says so); training is then
      equal to single-process training *in distribution* only, and checkpoints keep every rank's RNG
      state so that a resume on the same number of processes is still exact.

    Why an all-reduce of the accumulated gradients rather than ``DistributedDataParallel``: DDP
    synchronises gradients in autograd hooks that its own ``forward`` arms, but a Pyro program calls its
    LMs directly inside the model and the guide (``pyro.module`` only registers the very same parameter
    tensors in the param store; it wraps nothing), so the DDP wrapper's ``forward`` is never the one that
    runs. Making it so needs the whole objective as one ``nn.Module`` (Pyro's ``module_local_params``
    mode, a global change of how ``pyro.module``/``pyro.param`` behave). The Trainer also runs several
    backward passes per step (one per item) and objectives like :class:`Inquisitive` take per-particle
    gradients with ``torch.autograd.grad``, which DDP would have to be kept out of (``no_sync``); modules
    may share parameters (R1-Zero's identity sampler is P itself) or leave some without a gradient in a
    step. Reducing once, after the local backward passes, over the Trainer's own parameter list (the
    tensors the optimizer updates and the param store refers to) is exact in all these cases and costs one
    collective per step.
    """

    def __init__(self, model: Callable, guide: Callable, objective: ELBO, modules: Mapping[str, torch.nn.Module],
                 optimizer: Callable[[list], torch.optim.Optimizer] | None = None, clip_norm: float | None = 1.0,
                 batch_size: int = 1, checkpoint_dir: str | Path | None = None, checkpoint_every: int = 0,
                 progress: bool = True, seed: int | None = None, distributed: bool | None = None):
        if not modules:
            raise ConfigError("modules must be a non-empty dict name -> torch.nn.Module")
        for name, m in modules.items():
            if not isinstance(m, torch.nn.Module):
                raise ArgumentTypeError(f"modules[{name!r}] is not a torch.nn.Module: {m!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ConfigError(f"clip_norm must be > 0 or None, got {clip_norm}")
        if isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        if checkpoint_every and checkpoint_dir is None:
            raise ConfigError("checkpoint_every needs checkpoint_dir")
        if seed is not None and (isinstance(seed, bool) or seed < 0):
            raise ConfigError(f"seed must be None or a non-negative int, got {seed!r}")
        self.model, self.guide, self.objective = model, guide, objective
        self.modules = dict(modules)
        self.params = _unique_params(self.modules)
        if not self.params:
            raise ConfigError("the modules have no trainable parameters")
        factory = optimizer if optimizer is not None else (lambda ps: torch.optim.Adam(ps, lr=1e-2))
        self.optimizer = factory(self.params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ArgumentTypeError(f"optimizer(params) must return a torch.optim.Optimizer, got {self.optimizer!r}")
        self.clip_norm, self.batch_size, self.seed = clip_norm, batch_size, seed
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every, self.progress = int(checkpoint_every), progress
        self.step_count = 0
        self.history: list[dict[str, Any]] = []
        self.checkpoints_written: list[Path] = []  # by this process (rank 0 only, when distributed)
        self.distributed, self.rank, self.world_size = self._process_group(distributed)
        if self.distributed:
            self._agree()
            self._broadcast_weights()

    # ------------------------------------------------------------------ processes
    @staticmethod
    def _process_group(distributed: bool | None) -> tuple[bool, int, int]:
        ready = dist.is_available() and dist.is_initialized()
        if distributed is None:
            distributed = ready and dist.get_world_size() > 1
        elif distributed and not ready:
            raise ConfigError("distributed=True needs an initialised torch.distributed process group: "
                              "torch.distributed.init_process_group('gloo') (run under torchrun)")
        if not distributed:
            return False, 0, 1
        return True, dist.get_rank(), dist.get_world_size()

    def _comm_device(self) -> torch.device:
        """Where collectives take their tensors: the current CUDA device under NCCL, else the CPU."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_gather_json(self, obj) -> list:
        """``obj`` of every rank (rank order), sent as JSON bytes in tensors (no pickle)."""
        dev = self._comm_device()
        data = torch.tensor(list(json.dumps(obj).encode("utf-8")), dtype=torch.uint8, device=dev)
        size = torch.tensor([data.numel()], device=dev)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        width = int(max(int(n) for n in sizes))
        padded = torch.zeros(width, dtype=torch.uint8, device=dev)
        padded[: data.numel()] = data
        out = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(out, padded)
        return [json.loads(bytes(t[: int(n)].tolist()).decode("utf-8")) for t, n in zip(out, sizes)]

    def _agree(self) -> None:
        """Every rank must train the same thing; ranks sharing one RNG stream under seed=None get a warning."""
        mine = {"batch_size": self.batch_size, "seed": self.seed, "modules": sorted(self.modules),
                "shapes": [list(p.shape) for p in self.params], "optimizer": type(self.optimizer).__name__,
                "clip_norm": self.clip_norm, "checkpoint_every": self.checkpoint_every}
        rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
        every = self._all_gather_json({"config": mine, "rng": rng})
        for r, other in enumerate(every):
            diff = sorted(k for k in mine if other["config"][k] != mine[k])
            if diff:
                raise ConfigError(f"rank {r} builds its Trainer with other {', '.join(diff)} than rank {self.rank} "
                                  f"({ {k: other['config'][k] for k in diff} } vs { {k: mine[k] for k in diff} }): "
                                  "every process must train the same modules with the same settings")
        if self.seed is None and len({o["rng"] for o in every}) < len(every):
            warnings.warn("two ranks start from the same torch RNG state and seed=None: they would draw the same "
                          "samples for different items; call torch.manual_seed(seed + rank) on each, or pass "
                          "seed= to the Trainer", stacklevel=3)

    @torch.no_grad()
    def _broadcast_weights(self) -> None:
        dev = self._comm_device()
        for m in self.modules.values():
            for t in m.state_dict(keep_vars=True).values():
                t = t.data if isinstance(t, torch.nn.Parameter) else t
                buf = t.to(dev)
                dist.broadcast(buf, src=0)
                if buf is not t:
                    t.copy_(buf)

    def _all_reduce_grads(self) -> None:
        """Sum each parameter's gradient over the ranks (one all-reduce per dtype, with a flag per parameter
        saying whether some rank has a gradient: a parameter no rank reached keeps ``grad = None``)."""
        dev = self._comm_device()
        groups: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault(p.dtype, []).append(p)
        for dtype, ps in groups.items():
            flags = torch.tensor([p.grad is not None for p in ps], dtype=dtype, device=dev)
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dev)
                              for p in ps] + [flags])
            dist.all_reduce(flat)
            flags = flat[-len(ps):].tolist()
            at = 0
            for p, flag in zip(ps, flags):
                g = flat[at:at + p.numel()].view_as(p).to(p.device)
                at += p.numel()
                p.grad = g.clone() if flag > 0 else None

    # ------------------------------------------------------------------ steps
    @staticmethod
    def _call_args(item) -> tuple[tuple, dict]:
        if isinstance(item, tuple):
            return item, {}
        if isinstance(item, dict):
            return (), item
        return (item,), {}

    def _module_norms(self) -> dict[str, float]:
        out = {}
        for name, m in self.modules.items():
            gs = [p.grad for p in m.parameters() if p.grad is not None]
            out[f"grad_norm/{name}"] = float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in gs]))) if gs else 0.0
        return out

    def _rng_devices(self) -> list[int]:
        return list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else []

    def _loss_and_grads(self, index: int, item) -> float:
        args, kwargs = self._call_args(item)
        if self.seed is None:
            return float(self.objective.loss_and_grads(self.model, self.guide, *args, **kwargs))
        with torch.random.fork_rng(devices=self._rng_devices()):
            torch.manual_seed(item_seed(self.seed, self.step_count, index))
            return float(self.objective.loss_and_grads(self.model, self.guide, *args, **kwargs))

    @per_token
    def step(self, batch: Sequence) -> dict[str, Any]:
        """One optimiser step on the global batch ``batch`` (a list of data items; the same list on every
        rank, each computing its slice): gradients averaged, joint clipping, update."""
        if len(batch) == 0:
            raise ConfigError("empty batch")
        mine = _shard(len(batch), self.rank, self.world_size)
        return self._step([(j, batch[j]) for j in mine], len(batch))

    def _step(self, items: list[tuple[int, Any]], batch_size: int) -> dict[str, Any]:
        """The step on this rank's ``items`` (index in the global batch, item) of a global batch of ``batch_size``."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, stats = 0.0, {}
        for j, item in items:
            loss_sum += self._loss_and_grads(j, item)
            for k, v in getattr(self.objective, "last_stats", {}).items():
                stats.setdefault(k, []).append(v)
        sums = {k: [math.fsum(v), len(v)] for k, v in stats.items()}
        if self.distributed:
            self._all_reduce_grads()
            every = self._all_gather_json({"loss": loss_sum, "stats": sums})
            loss_sum = math.fsum(e["loss"] for e in every)
            sums = {}
            for e in every:
                for k, (total, count) in e["stats"].items():
                    sums[k] = [sums.get(k, [0.0, 0])[0] + total, sums.get(k, [0.0, 0])[1] + count]
        if batch_size > 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(batch_size)
        metrics: dict[str, Any] = {"step": self.step_count + 1, "loss": loss_sum / batch_size}
        metrics.update(self._module_norms())
        norm = clip_joint_(self.params, self.clip_norm)
        metrics["grad_norm"] = norm
        metrics["clipped"] = bool(self.clip_norm is not None and norm > self.clip_norm)
        if math.isfinite(norm):
            self.optimizer.step()
            metrics["skipped"] = False
        else:  # a non-finite gradient would poison the parameters: skip the update, keep the record
            metrics["skipped"] = True
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics.update({k: total / count for k, (total, count) in sums.items()})
        self.step_count += 1
        self.history.append(metrics)
        return metrics

    def fit(self, dataset: Sequence, num_steps: int,
            callback: Callable[[Trainer, dict[str, Any]], object] | None = None) -> list[dict[str, Any]]:
        """Train until ``step_count == num_steps``; returns the full metrics history.

        ``callback(trainer, metrics)`` runs after every step (and its checkpoint), on every rank: e.g. to
        set the learning rate of the next step (:func:`cosine_lr`) or to log.
        """
        if len(dataset) == 0:
            raise ConfigError("empty dataset")
        if isinstance(num_steps, bool) or num_steps < 0:
            raise ConfigError(f"num_steps must be a non-negative int, got {num_steps!r}")
        from tqdm.auto import tqdm

        bar = tqdm(total=num_steps, initial=min(self.step_count, num_steps),
                   disable=not self.progress or self.rank != 0, desc="train")
        mine = _shard(self.batch_size, self.rank, self.world_size)
        try:
            while self.step_count < num_steps:
                start = self.step_count * self.batch_size
                m = self._step([(j, dataset[(start + j) % len(dataset)]) for j in mine], self.batch_size)
                bar.update(1)
                if self.progress and self.rank == 0:
                    bar.set_postfix(loss=f"{m['loss']:.4g}", gnorm=f"{m['grad_norm']:.3g}")
                if self.checkpoint_every and self.step_count % self.checkpoint_every == 0:
                    self.save(self.checkpoint_dir / f"step-{self.step_count:08d}")
                if callback is not None:
                    callback(self, m)
        finally:
            bar.close()
        return self.history
