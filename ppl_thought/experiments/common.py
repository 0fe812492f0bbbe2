"""Small helpers the experiments share: teacher-forced scores under a mask, the learning rate, standard errors."""

from __future__ import annotations

import math

import numpy as np
import torch

from ppl_thought.distributions.lm_state import masked_log_softmax

__all__ = ["score", "set_lr", "standard_error"]


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
