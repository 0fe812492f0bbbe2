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
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pyro.infer import ELBO

from ppl_thought.io import load_checkpoint, save_checkpoint

FORMAT = "ppl_thought.trainer/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def clip_joint_(params: Sequence[torch.Tensor], max_norm: float | None) -> float:
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
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        scale = min(1.0, float(max_norm) / (float(norm) + 1e-12)) if float(norm) > max_norm else 1.0
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
    return float(norm)


def cosine_lr(peak: float, step: int, total: int, warmup: float = 0.05, floor: float = 0.1) -> float:
    """The learning-rate schedule of App. L: linear warm-up from 0 to ``peak`` over the first
    ``warmup`` fraction of ``total`` steps, then a cosine decay to ``floor * peak`` at the last step.
    ``step`` counts from 0."""
    if total < 1 or not 0 <= step < total:
        raise ValueError(f"step must lie in [0, total), got step={step}, total={total}")
    if not 0.0 <= warmup < 1.0 or not 0.0 <= floor <= 1.0:
        raise ValueError(f"warmup must lie in [0, 1) and floor in [0, 1], got {warmup} and {floor}")
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
        batch_size: data items per step; their gradients are averaged (B in (3.16), (3.25)).
        checkpoint_dir, checkpoint_every: write ``checkpoint_dir/step-XXXXXXXX`` every so many steps.
        progress: show a tqdm progress bar.

    ``fit(dataset, num_steps)`` trains until ``self.step_count == num_steps`` (so a resumed trainer
    continues where it stopped); dataset items are a tuple of model arguments, a dict of keyword
    arguments, or a single argument, visited in order (item ``(step * batch_size + j) % len(dataset)``).
    ``history`` is a list of per-step metric dicts (loss, joint and per-module grad norms, objective stats).
    """

    def __init__(self, model: Callable, guide: Callable, objective: ELBO, modules: Mapping[str, torch.nn.Module],
                 optimizer: Callable[[list], torch.optim.Optimizer] | None = None, clip_norm: float | None = 1.0,
                 batch_size: int = 1, checkpoint_dir: str | Path | None = None, checkpoint_every: int = 0,
                 progress: bool = True):
        if not hasattr(objective, "loss_and_grads"):
            raise TypeError(f"objective must be a pyro.infer.ELBO with loss_and_grads, got {objective!r}")
        if not isinstance(modules, Mapping) or not modules:
            raise ValueError("modules must be a non-empty dict name -> torch.nn.Module")
        for name, m in modules.items():
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"modules[{name!r}] is not a torch.nn.Module: {m!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 or None, got {clip_norm}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if checkpoint_every and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        self.model, self.guide, self.objective = model, guide, objective
        self.modules = dict(modules)
        self.params = _unique_params(self.modules)
        if not self.params:
            raise ValueError("the modules have no trainable parameters")
        factory = optimizer if optimizer is not None else (lambda ps: torch.optim.Adam(ps, lr=1e-2))
        self.optimizer = factory(self.params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer, got {self.optimizer!r}")
        self.clip_norm, self.batch_size = clip_norm, batch_size
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every, self.progress = int(checkpoint_every), progress
        self.step_count = 0
        self.history: list[dict[str, Any]] = []

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

    def step(self, batch: Sequence) -> dict[str, Any]:
        """One optimiser step on a list of data items (gradients averaged, joint clipping, update)."""
        if len(batch) == 0:
            raise ValueError("empty batch")
        self.optimizer.zero_grad(set_to_none=True)
        losses, stats = [], {}
        for item in batch:
            args, kwargs = self._call_args(item)
            losses.append(float(self.objective.loss_and_grads(self.model, self.guide, *args, **kwargs)))
            for k, v in getattr(self.objective, "last_stats", {}).items():
                stats.setdefault(k, []).append(v)
        if len(batch) > 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(len(batch))
        metrics: dict[str, Any] = {"step": self.step_count + 1, "loss": sum(losses) / len(losses)}
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
        metrics.update({k: sum(v) / len(v) for k, v in stats.items()})
        self.step_count += 1
        self.history.append(metrics)
        return metrics

    def fit(self, dataset: Sequence, num_steps: int) -> list[dict[str, Any]]:
        """Train until ``step_count == num_steps``; returns the full metrics history."""
        if len(dataset) == 0:
            raise ValueError("empty dataset")
        if not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}")
        from tqdm.auto import tqdm

        bar = tqdm(total=num_steps, initial=min(self.step_count, num_steps), disable=not self.progress,
                   desc="train")
        try:
            while self.step_count < num_steps:
                start = self.step_count * self.batch_size
                batch = [dataset[(start + j) % len(dataset)] for j in range(self.batch_size)]
                m = self.step(batch)
                bar.update(1)
                if self.progress:
                    bar.set_postfix(loss=f"{m['loss']:.4g}", gnorm=f"{m['grad_norm']:.3g}")
                if self.checkpoint_every and self.step_count % self.checkpoint_every == 0:
                    self.save(self.checkpoint_dir / f"step-{self.step_count:08d}")
        finally:
            bar.close()
        return self.history

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> tuple[dict[str, torch.Tensor], dict, dict]:
        """(tensors, config, extra) of a checkpoint: everything needed to resume exactly."""
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
        tensors["rng/torch"] = torch.get_rng_state()
        np_state = np.random.get_state()
        tensors["rng/numpy"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
        py_state = random.getstate()
        extra = {
            "format": FORMAT,
            "step_count": self.step_count,
            "history": self.history,
            "optim": {"param_groups": osd["param_groups"], "scalars": scalars,
                      "state_keys": {str(i): sorted(st) for i, st in osd["state"].items()}},
            "rng": {"numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
                    "python": [py_state[0], list(py_state[1]), py_state[2]]},
        }
        config = {"modules": sorted(self.modules), "optimizer": type(self.optimizer).__name__,
                  "clip_norm": self.clip_norm, "batch_size": self.batch_size,
                  "objective": type(self.objective).__name__}
        return tensors, config, extra

    def save(self, path: str | Path) -> Path:
        """Write a checkpoint directory (atomic files, safetensors + JSON, no pickle)."""
        tensors, config, extra = self.state()
        return save_checkpoint(path, tensors, config, extra)

    def load(self, path: str | Path) -> Trainer:
        """Restore weights, optimizer state, RNG states, step count and history from ``path``."""
        tensors, config, extra = load_checkpoint(path)
        if extra.get("format") != FORMAT:
            raise ValueError(f"{path} is not a Trainer checkpoint ({FORMAT})")
        if sorted(config["modules"]) != sorted(self.modules):
            raise ValueError(f"checkpoint modules {config['modules']} != trainer modules {sorted(self.modules)}")
        if config["optimizer"] != type(self.optimizer).__name__:
            raise ValueError(f"checkpoint optimizer {config['optimizer']} != {type(self.optimizer).__name__}")
        for name, m in self.modules.items():
            prefix = f"module/{name}/"
            sd = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            m.load_state_dict(sd, strict=True)
        state: dict[int, dict[str, Any]] = {}
        for idx, keys in extra["optim"]["state_keys"].items():
            st = {}
            for k in keys:
                if f"optim/{idx}/{k}" in tensors:
                    st[k] = tensors[f"optim/{idx}/{k}"]
                else:
                    st[k] = extra["optim"]["scalars"][idx][k]
            state[int(idx)] = st
        self.optimizer.load_state_dict({"state": state, "param_groups": extra["optim"]["param_groups"]})
        torch.set_rng_state(tensors["rng/torch"])
        name, pos, has_gauss, cached = extra["rng"]["numpy"]
        np.random.set_state((name, tensors["rng/numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
        v, internal, gauss = extra["rng"]["python"]
        random.setstate((v, tuple(internal), gauss))
        self.step_count = int(extra["step_count"])
        self.history = list(extra["history"])
        return self

    @staticmethod
    def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
        """The ``step-XXXXXXXX`` directory with the highest step that holds a complete checkpoint."""
        d = Path(checkpoint_dir)
        if not d.is_dir():
            return None
        found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_DIR.match(p.name))
                 and (p / "config.json").is_file()]
        return max(found)[1] if found else None
