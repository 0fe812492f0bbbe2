"""Small helpers the experiments share: teacher-forced scores under a mask, the learning rate, standard errors."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable

import numpy as np
import torch

from ppl_thought.distributions.lm_state import masked_log_softmax
from ppl_thought.io import atomic_write_json
from ppl_thought.provenance import stamped
from ppl_thought.provenance import start as start_record

__all__ = ["score", "set_lr", "standard_error", "run_alone", "provenance", "start_record", "stamped"]


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
    """The commit, dirty flag and machine of :mod:`ppl_thought.provenance` (its one home; a JSON's full record,
    with the command, load and seconds, is ``ppl_thought.provenance.record`` / ``finish``)."""
    from ppl_thought import provenance as _provenance

    return {**_provenance.source(), "machine": _provenance.machine()}


def run_alone(doc: str, run: Callable, config_cls, argv: list[str] | None = None) -> int:
    """The command line of one experiment: ``--quick`` (``config_cls.quick()``, the demo's quick sizes), ``--seed``,
    ``--json FILE``; prints the results (the demo's plots and ArviZ files are ``ppl-thought demo``'s job)."""

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the sizes of ``ppl-thought demo --quick``")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    from ppl_thought import provenance as _provenance

    script = getattr(sys.modules.get(run.__module__), "__file__", None) or run.__module__
    rec = _provenance.record([script, *(sys.argv[1:] if argv is None else argv)])
    res = run(config_cls.quick() if args.quick else config_cls(), args.seed, progress=True)
    res.pop("_arrays", None)
    res[_provenance.KEY] = _provenance.finish(rec)
    text = json.dumps(res, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o), indent=1)
    if args.json:
        atomic_write_json(args.json, json.loads(text))
    print(text)
    return 0
