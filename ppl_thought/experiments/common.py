"""Small helpers the experiments share: teacher-forced scores under a mask, the learning rate, standard errors."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
from collections.abc import Callable

import numpy as np
import torch

from ppl_thought.distributions.lm_state import masked_log_softmax
from ppl_thought.io import atomic_write_json

__all__ = ["score", "set_lr", "standard_error", "run_alone", "provenance"]


def score(lm: torch.nn.Module, tokens: torch.Tensor, start: int, allowed: torch.Tensor) -> torch.Tensor:
    """``[B, T - start]``: log-probabilities of ``tokens[:, start:]`` given their prefixes, masked to ``allowed``."""
    logits, _ = lm(tokens[:, :-1])
    lp = masked_log_softmax(logits[:, start - 1:], allowed)
    return lp.gather(-1, tokens[:, start:, None]).squeeze(-1)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def standard_error(x: np.ndarray) -> float:
    """The standard error of the mean of ``x`` (NaN for fewer than two values)."""
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


def provenance() -> dict:
    """Where a result comes from, for the JSON of a documented run: the git commit of the package's checkout
    (``dirty`` when the package's tracked files have uncommitted changes; None outside a git checkout) and the
    machine."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no", "--", "ppl_thought")  # the code, not the docs
    return {"commit": commit, "dirty": bool(status) if status is not None else None,
            "machine": {"nproc": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "python": platform.python_version(), "torch": torch.__version__}}


def run_alone(doc: str, run: Callable, config_cls, argv: list[str] | None = None) -> int:
    """The command line of one experiment: ``--quick`` (``config_cls.quick()``, the demo's quick sizes), ``--seed``,
    ``--json FILE``; prints the results (the demo's plots and ArviZ files are ``ppl-thought demo``'s job)."""

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the sizes of ``ppl-thought demo --quick``")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    res = run(config_cls.quick() if args.quick else config_cls(), args.seed, progress=True)
    res.pop("_arrays", None)
    text = json.dumps(res, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o), indent=1)
    if args.json:
        atomic_write_json(args.json, json.loads(text))
    print(text)
    return 0
