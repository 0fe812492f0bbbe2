"""Exact-resume checkpoints of :class:`~ppl_thought.training.trainer.Trainer` (the mixin it inherits).

A checkpoint is a directory written by :func:`ppl_thought.io.save_checkpoint` (safetensors + JSON, atomic
writes, no pickle) holding the module weights, the optimizer state (tensors in safetensors, scalars and param
groups in JSON), the torch / numpy / Python RNG states of every rank, the step count and the metrics history, so
that ``Trainer.load(path)`` followed by ``fit`` reproduces an uninterrupted run bit for bit (same device, same
library versions).
"""

from __future__ import annotations

import copy
import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppl_thought import schemas
from ppl_thought.checkpoint import check_finite
from ppl_thought.errors import CheckpointError, SchemaError
from ppl_thought.io import load_checkpoint_raw, nonfinite_names, save_checkpoint

FORMAT = schemas.TRAINER_EXTRA.version  # "ppl_thought.trainer/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class Checkpoints:
    """Checkpoint methods of :class:`~ppl_thought.training.trainer.Trainer`: :meth:`state`, :meth:`save`,
    :meth:`load` and :meth:`latest_checkpoint` (they read and write the trainer's modules, optimizer, RNGs, step
    and history)."""

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

    def load(self, path: str | Path, *, allow_nonfinite: bool = False) -> Checkpoints:
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
        if not isinstance(extra, dict) or extra.get("format") != FORMAT or not isinstance(config, dict):
            raise SchemaError(f"{path} is not a Trainer checkpoint ({FORMAT})")
        schemas.check(schemas.TRAINER_EXTRA, extra, path)  # every key and its type, nothing filled in
        schemas.check(schemas.TRAINER_CONFIG, config, path)
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
