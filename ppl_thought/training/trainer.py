"""Training loop for P and Q together: joint gradient clipping (App. L), metrics, exact-resume checkpoints.

``Trainer(model, guide, objective, modules={"prior": prior, "sampler": q})`` builds ONE torch optimizer
over the parameters of every module (App. L: "wrap the parameters of the latent model and sampler into
one optimizer") and clips the joint gradient v_latent (+) v_sampler to
v / max(1, ||v|| / clip_norm) instead of clipping each part on its own.

Checkpoints are directories written by :func:`ppl_thought.io.save_checkpoint` (safetensors + JSON,
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

import copy
import hashlib
import json
import math
import random
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pyro.infer import ELBO

from ppl_thought.checkpoint import check_finite
from ppl_thought.errors import ArgumentTypeError, CheckpointError, ConfigError
from ppl_thought.io import load_checkpoint_raw, nonfinite_names, save_checkpoint
from ppl_thought.validation import checked, per_token

FORMAT = "ppl_thought.trainer/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")


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
class Trainer:
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

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def _rng_state() -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(torch state, numpy key array, JSON rest) of this process's global RNGs."""
        np_state = np.random.get_state()
        py_state = random.getstate()
        return (torch.get_rng_state(), torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
                {"numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
                 "python": [py_state[0], list(py_state[1]), py_state[2]]})

    @staticmethod
    def _set_rng_state(torch_state: torch.Tensor, np_key: torch.Tensor, rest: dict) -> None:
        torch.set_rng_state(torch_state)
        name, pos, has_gauss, cached = rest["numpy"]
        np.random.set_state((name, np_key.numpy().astype(np.uint32), pos, has_gauss, cached))
        v, internal, gauss = rest["python"]
        random.setstate((v, tuple(internal), gauss))

    def state(self) -> tuple[dict[str, torch.Tensor], dict, dict]:
        """(tensors, config, extra) of a checkpoint: everything needed to resume exactly (this process's
        RNG states; :meth:`save` adds the other ranks')."""
        tensors: dict[str, torch.Tensor] = {}
        for name, m in self.modules.items():
            for k, v in m.state_dict().items():
                tensors[f"module/{name}/{k}"] = v.detach().clone()
        osd = self.optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for idx, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim/{idx}/{k}"] = v.detach().clone()
                else:
                    scalars.setdefault(str(idx), {})[k] = v
        tensors["rng/torch"], tensors["rng/numpy"], rng = self._rng_state()
        extra = {
            "format": FORMAT,
            "step_count": self.step_count,
            "history": self.history,
            "optim": {"param_groups": osd["param_groups"], "scalars": scalars,
                      "state_keys": {str(i): sorted(st) for i, st in osd["state"].items()}},
            "rng": rng,
        }
        config = {"modules": sorted(self.modules), "optimizer": type(self.optimizer).__name__,
                  "clip_norm": self.clip_norm, "batch_size": self.batch_size,
                  "objective": type(self.objective).__name__, "seed": self.seed, "world_size": self.world_size}
        return tensors, config, extra

    def save(self, path: str | Path) -> Path:
        """Write a checkpoint directory (atomic files, safetensors + JSON, no pickle).

        Distributed: collective (call it on every rank); rank 0 writes, with every rank's RNG states, and
        the others wait until the folder is complete (or raise :class:`CheckpointError` if rank 0 failed).
        """
        path = Path(path)
        tensors, config, extra = self.state()
        if not self.distributed:
            out = save_checkpoint(path, tensors, config, extra)
            self.checkpoints_written.append(out)
            return out
        torch_state, np_key, rng = self._rng_state()
        every = self._all_gather_json({"torch": torch_state.tolist(), "numpy_key": np_key.tolist(), "rest": rng})
        error = None
        if self.rank == 0:
            for r, e in enumerate(every[1:], start=1):
                tensors[f"rng/{r}/torch"] = torch.tensor(e["torch"], dtype=torch.uint8)
                tensors[f"rng/{r}/numpy"] = torch.tensor(e["numpy_key"], dtype=torch.int64)
            extra["rng_ranks"] = {str(r): e["rest"] for r, e in enumerate(every) if r > 0}
            try:
                save_checkpoint(path, tensors, config, extra)
                self.checkpoints_written.append(path)
            except Exception as e:  # noqa: BLE001 - told to every rank, then raised here as it is
                error = e
        # the barrier: every rank waits for rank 0's word (JSON in tensors, no pickle), a failure included
        told = self._all_gather_json(None if error is None else f"{type(error).__name__}: {error}")[0]
        if error is not None:
            raise error
        if told is not None:
            raise CheckpointError(f"rank 0 could not write the checkpoint {path}: {told}")
        return path

    def load(self, path: str | Path, *, allow_nonfinite: bool = False) -> Trainer:
        """Restore weights, optimizer state, RNG states, step count and history from ``path`` (every rank
        reads the folder; rank r restores its own RNG states when the checkpoint has them).

        All or nothing: the whole checkpoint is checked first (modules, tensor names, shapes and dtypes, the
        optimizer's groups and state, the RNG states; weights and optimizer state holding NaN or inf unless
        ``allow_nonfinite=True``) and a failure while restoring puts the trainer back as it was; either way a
        damaged checkpoint raises :class:`~ppl_thought.errors.CheckpointError` naming the damage, and the
        trainer is unchanged."""
        try:
            plan = self._load_plan(path, allow_nonfinite)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise CheckpointError(f"{path} is a damaged Trainer checkpoint: {type(e).__name__}: {e}"[:400]) from None
        tensors, config, extra, module_states, optim_state, rng = plan
        backup = ({n: {k: v.detach().clone() for k, v in m.state_dict().items()} for n, m in self.modules.items()},
                  copy.deepcopy(self.optimizer.state_dict()), self._rng_state())
        try:
            for name, m in self.modules.items():
                m.load_state_dict(module_states[name], strict=True)
            self.optimizer.load_state_dict(optim_state)
            if rng is not None:
                self._set_rng_state(*rng)
        except Exception as e:
            for name, m in self.modules.items():
                m.load_state_dict(backup[0][name], strict=True)
            self.optimizer.load_state_dict(backup[1])
            self._set_rng_state(*backup[2])
            raise CheckpointError(f"{path} could not be restored (the trainer is unchanged): "
                                  f"{type(e).__name__}: {e}"[:400]) from None
        if rng is None and self.rank != 0 and self.seed is None:
            warnings.warn(f"{path} holds no RNG state for rank {self.rank} (written by {config.get('world_size', 1)} "
                          "process(es)): this rank goes on from its current stream, so the run does not repeat an "
                          "uninterrupted one (pass seed= for streams that do not depend on the processes)",
                          stacklevel=2)
        saved_seed = config.get("seed")
        if saved_seed != self.seed:
            warnings.warn(f"{path} was trained with seed={saved_seed}, this Trainer has seed={self.seed}: the "
                          "resumed run draws other samples than the interrupted one would have", stacklevel=2)
        self.step_count = int(extra["step_count"])
        self.history = list(extra["history"])
        return self

    def _load_plan(self, path: str | Path, allow_nonfinite: bool):
        """Everything :meth:`load` restores, read and checked, nothing changed yet."""
        tensors, raw = load_checkpoint_raw(path)
        config, extra = raw.header["config"], raw.header["extra"]
        if extra.get("format") != FORMAT or not isinstance(config, dict):
            raise CheckpointError(f"{path} is not a Trainer checkpoint ({FORMAT})")
        if not isinstance(config.get("modules"), list) or sorted(map(str, config["modules"])) != sorted(self.modules):
            raise CheckpointError(f"checkpoint modules {config.get('modules')} != trainer modules "
                                  f"{sorted(self.modules)}")
        if config.get("optimizer") != type(self.optimizer).__name__:
            raise CheckpointError(f"checkpoint optimizer {config.get('optimizer')} != {type(self.optimizer).__name__}")
        if isinstance(extra.get("step_count"), bool) or not isinstance(extra.get("step_count"), int) \
                or extra["step_count"] < 0 or not isinstance(extra.get("history"), list):
            raise CheckpointError(f"{path}: step_count must be an integer >= 0 and history a list, got "
                                  f"{extra.get('step_count')!r} and a {type(extra.get('history')).__name__}")
        nonfinite: list[str] = []
        module_states = {}
        for name, m in self.modules.items():
            prefix = f"module/{name}/"
            sd = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            own = m.state_dict()
            if set(sd) != set(own):
                bad = sorted(set(sd) ^ set(own))
                raise CheckpointError(f"{path}: module {name!r}: the saved tensors differ from the module's in "
                                      f"{bad[:5]} (missing or unexpected)")
            for k, v in sd.items():
                want = own[k]
                if tuple(v.shape) != tuple(want.shape):
                    raise CheckpointError(f"{path}: module {name!r}: {k} has shape {tuple(v.shape)}, the module's "
                                          f"{tuple(want.shape)}")
                if want.is_floating_point() != v.is_floating_point() or (not want.is_floating_point()
                                                                         and v.dtype != want.dtype):
                    raise CheckpointError(f"{path}: module {name!r}: {k} is stored as {v.dtype}, the module holds "
                                          f"{want.dtype}: refused, not cast")
            nonfinite += [prefix + k for k in nonfinite_names(sd)]
            module_states[name] = sd
        optim = extra.get("optim")
        if not isinstance(optim, dict) or not all(isinstance(optim.get(k), t) for k, t in
                                                  (("param_groups", list), ("state_keys", dict), ("scalars", dict))):
            raise CheckpointError(f"{path}: the optimizer state lacks param_groups, state_keys or scalars")
        groups = optim["param_groups"]
        mine = self.optimizer.param_groups
        if len(groups) != len(mine) or any(not isinstance(g, dict) or not isinstance(g.get("params"), list)
                                           or len(g["params"]) != len(own["params"]) for g, own in zip(groups, mine)):
            raise CheckpointError(f"{path}: the optimizer's parameter groups do not match this trainer's "
                                  f"({[len(g['params']) for g in self.optimizer.param_groups]} parameters per group)")
        params = {pid: p for g, own in zip(groups, mine) for pid, p in zip(g["params"], own["params"])}
        state: dict[int, dict[str, Any]] = {}
        for idx, keys in optim["state_keys"].items():
            if int(idx) not in params or not isinstance(keys, list):
                raise CheckpointError(f"{path}: optimizer state for parameter {idx!r}, which no group holds")
            st = {}
            for k in keys:
                if f"optim/{idx}/{k}" in tensors:
                    v = tensors[f"optim/{idx}/{k}"]
                    p = params[int(idx)]
                    if v.ndim and tuple(v.shape) != tuple(p.shape):
                        raise CheckpointError(f"{path}: optimizer state {k} of parameter {idx} has shape "
                                              f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
                    if v.is_floating_point() and v.numel() and not bool(torch.isfinite(v).all()):
                        nonfinite.append(f"optim/{idx}/{k}")
                    st[k] = v
                else:
                    st[k] = optim["scalars"][idx][k]
            state[int(idx)] = st
        check_finite(path, nonfinite, allow_nonfinite)
        rng = None
        if self.rank == 0:
            rng = (tensors["rng/torch"], tensors["rng/numpy"], extra["rng"])
        elif f"rng/{self.rank}/torch" in tensors:
            rng = (tensors[f"rng/{self.rank}/torch"], tensors[f"rng/{self.rank}/numpy"],
                   extra["rng_ranks"][str(self.rank)])
        if rng is not None:
            want = torch.get_rng_state()
            if rng[0].dtype != want.dtype or rng[0].shape != want.shape or rng[1].dtype != torch.int64 \
                    or tuple(rng[1].shape) != (624,):
                raise CheckpointError(f"{path}: the saved RNG states are not torch's and numpy's "
                                      f"({rng[0].dtype} {tuple(rng[0].shape)}, {rng[1].dtype} {tuple(rng[1].shape)})")
        return tensors, config, extra, module_states, {"state": state, "param_groups": groups}, rng

    @staticmethod
    def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
        """The ``step-XXXXXXXX`` directory with the highest step that holds a complete checkpoint."""
        d = Path(checkpoint_dir)
        if not d.is_dir():
            return None
        found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_DIR.match(p.name))
                 and (p / "config.json").is_file()]
        return max(found)[1] if found else None
