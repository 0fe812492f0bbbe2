"""The result every engine returns (docs/architecture.md, "Contracts")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppl_thought import checks, schemas
from ppl_thought.checkpoint import parse_json
from ppl_thought.errors import CheckpointError, DiagnosticError, PPLThoughtError, ProgramError, SchemaError
from ppl_thought.io import CONFIG_FILE, load_checkpoint, save_checkpoint
from ppl_thought.validation import ArrayLike, checked
from ppl_thought.vocab import Vocab
from ppl_thought.weights import (  # noqa: F401 (effective_sample_size, log_mean_exp: their old import path)
    check_log_weights,
    effective_sample_size,
    log_mean_exp,
)


def psis(log_w) -> tuple[torch.Tensor, torch.Tensor]:
    """Pareto-smoothed importance sampling (Vehtari, Simpson, Gelman, Yao & Gabry 2024) by ``arviz.psislw``.

    For log weights ``[..., n]`` (each row one weighted sample) returns the smoothed, normalised log
    weights (same shape, float64: the largest weights replaced by the expected order statistics of a
    generalised Pareto fit to the tail, then truncated at the largest raw weight) and the shape estimate
    k-hat ``[...]``. k-hat < 0.5: the raw weights have finite variance; 0.5-0.7: finite mean, use the
    smoothed weights; > 0.7: the estimate is unreliable whatever the smoothing. Log weights with NaN or +inf
    raise :class:`~ppl_thought.errors.DiagnosticError`.

    The numbers are ArviZ's, computed on the finite weights of each row (a ``-inf`` weight is a particle
    with probability 0: it stays ``-inf``). Two cases ArviZ reports as k = inf are named instead:
    constant weights (the exact posterior, nothing to smooth) give ``-inf``; a tail too short for the fit
    (at most 4 weights above the cutoff, e.g. fewer than ~20 particles or weights with ties) gives ``nan``
    (not available), and the weights come back unsmoothed, as ArviZ returns them.
    """
    from ppl_thought.arviz_compat import psislw

    checks.numeric_array("log_w", log_w, DiagnosticError, "log weights (a tensor, an array or a list of numbers)")
    lw = torch.as_tensor(log_w).detach().to("cpu", torch.float64)
    lw = lw.reshape(1) if lw.ndim == 0 else lw
    if lw.shape[-1] == 0:
        raise DiagnosticError(f"psis (Pareto k-hat): no log weights (shape {tuple(lw.shape)}): the fit needs at least "
                              "one weight per row")
    check_log_weights(lw, "psis (Pareto k-hat)")  # NaN or +inf: DiagnosticError, never a NaN k-hat
    rows = lw.reshape(-1, lw.shape[-1]).numpy()
    out = np.full(rows.shape, -np.inf)
    ks = np.full(rows.shape[0], np.nan)
    for g, row in enumerate(rows):  # one row per independent weighted sample (SMC groups), not per particle
        fin = np.isfinite(row)
        if not fin.any():
            continue
        x = row[fin]
        if float(x.max() - x.min()) < 1e-12:
            out[g, fin], ks[g] = -math.log(x.size), -math.inf
            continue
        smoothed, k = psislw(x)  # ArviZ's numbers, 0.x or 1.x (arviz_compat)
        out[g, fin] = smoothed
        ks[g] = float(k) if np.isfinite(k) else math.nan
    smoothed_t = torch.from_numpy(out).reshape(lw.shape)
    return smoothed_t, torch.from_numpy(ks).reshape(lw.shape[:-1])


@checked
def pareto_k(log_w: ArrayLike | float) -> float | torch.Tensor:
    """The PSIS k-hat of :func:`psis` (a float for one row of weights, a tensor ``[...]`` for several)."""
    k = psis(log_w)[1]
    return float(k) if k.ndim == 0 else k


@checked
@dataclass
class Result:
    """Weighted particles or MCMC draws.

    ``samples`` maps site names to values with particles (IS, SMC: ``[num_particles, ...]``) or
    chains x draws (MCMC: ``[num_chains, num_draws, ...]``) leading. ``log_weights`` is ``None``
    for unweighted MCMC draws. ``log_marginal`` is the estimate of log p(data) ((3.2)) with its
    delta-method standard error. ``stats`` holds engine-specific statistics (acceptance
    probabilities, step sizes, ESS per SMC step, ...); ``observed`` the data the engine saw.
    """

    samples: dict[str, Any]
    log_weights: torch.Tensor | None = None
    log_marginal: torch.Tensor | None = None
    log_marginal_stderr: torch.Tensor | None = None
    ancestry: torch.Tensor | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    engine: str = ""

    def __repr__(self) -> str:
        return _result_repr(self)

    def summary(self) -> str:
        """The one-line report, each site's shape, and the engine's statistics (printable)."""
        return _result_summary(self)

    @property
    def ess(self) -> torch.Tensor | None:
        """Importance ESS of the final weights (``None`` for MCMC results)."""
        if self.log_weights is None:
            return None
        return effective_sample_size(self.log_weights)

    @property
    def normalized_weights(self) -> torch.Tensor | None:
        if self.log_weights is None:
            return None
        return torch.softmax(self.log_weights, dim=-1)

    @property
    def pareto_k(self) -> float | torch.Tensor | None:
        """PSIS Pareto k-hat of the final weights (:func:`psis`; the engine's ``stats["khat"]`` when it
        recorded one); ``None`` for MCMC results."""
        if self.log_weights is None:
            return None
        if "khat" in self.stats:
            return self.stats["khat"]
        return pareto_k(self.log_weights)

    @property
    def psis_log_weights(self) -> torch.Tensor | None:
        """PSIS-smoothed normalised log weights (:func:`psis`, float64); ``None`` for MCMC results."""
        if self.log_weights is None:
            return None
        return psis(self.log_weights)[0]


def _short(v: Any, digits: int = 4) -> str:
    """A number, or a few numbers of a small tensor, for a one-line report."""
    if v is None:
        return "-"
    t = torch.as_tensor(v).detach().float().reshape(-1).cpu()
    vals = [f"{x:.{digits}g}" for x in t[:4].tolist()]
    return vals[0] if t.numel() == 1 else "[" + ", ".join(vals) + (", ..." if t.numel() > 4 else "") + "]"


def _result_repr(self) -> str:
    """One line, always short (well under 1 KB): engine, particles, log Z-hat +- SE, ESS, Pareto k, sites."""
    n = None if self.log_weights is None else int(self.log_weights.shape[-1])
    parts = [self.engine or "Result"]
    if n is not None:
        groups = self.log_weights.shape[:-1].numel() if self.log_weights.ndim > 1 else 1
        parts.append(f"{n} particles" + (f" x {groups} groups" if groups > 1 else ""))
    if self.log_marginal is not None:
        se = "" if self.log_marginal_stderr is None else f" +- {_short(self.log_marginal_stderr, 2)}"
        parts.append(f"log Z-hat {_short(self.log_marginal)}{se}")
    if self.log_weights is not None:
        parts.append(f"ESS {_short(effective_sample_size(self.log_weights, check=False), 3)}")
    if "khat" in self.stats:  # only what the engine recorded: a repr never runs a fit
        parts.append(f"Pareto k {_short(self.stats['khat'], 2)}")
    names = list(self.samples)
    sites = ", ".join(names[:8]) + (f", ... ({len(names)} sites)" if len(names) > 8 else "")
    return f"<{'; '.join(parts)}; sites: {sites}>"


def _result_summary(self) -> str:
    """A few lines: the one-line report, each site's shape and dtype, and the engine's statistics by name."""
    lines = [repr(self)]
    for k, v in self.samples.items():
        kind = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
        lines.append(f"  {k}: {kind}")
    for k, v in self.stats.items():
        if isinstance(v, torch.Tensor):
            text = _short(v) if v.numel() <= 4 else f"tensor {tuple(v.shape)}"
        elif isinstance(v, (list, tuple)):
            text = f"{len(v)} values" + (f", last {_short(v[-1])}" if v and isinstance(v[-1], (int, float)) else "")
        else:
            text = str(v)[:60]
        lines.append(f"  stats.{k}: {text}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- saving
RESULT_FORMAT = schemas.RESULT.version  # "ppl_thought.result/1"


def _key_part(k: str) -> str:
    """A dict key as one part of a tensor name: ``%`` and ``/`` escaped, so that ``{"a": [t]}`` (``a/0``) and
    ``{"a/0": t}`` (``a%2F0``) can never name the same tensor."""
    return k.replace("%", "%25").replace("/", "%2F")


def _encode_tree(obj, key: str, tensors: dict[str, torch.Tensor]):
    """A JSON tree for ``obj`` with tensors (and numpy arrays) moved into ``tensors`` under ``key``.

    Raises :class:`CheckpointError` for a dict whose keys collide as strings (``{1: a, "1": b}``) and for a
    tensor name already taken: never two values under one name."""
    if isinstance(obj, torch.Tensor | np.ndarray):
        if key in tensors:
            raise CheckpointError(f"save_result: two values would be stored as the tensor {key!r}")
        tensors[key] = torch.as_tensor(obj).detach().cpu()
        return {"__tensor__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        names = [str(k) for k in obj]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CheckpointError(f"save_result: the keys {dup[:5]} of a dict under {key!r} are equal as strings "
                                  f"(keys {list(obj)[:8]}): a saved result would keep one of them")
        return {"__dict__": [[str(k), _encode_tree(v, f"{key}/{_key_part(str(k))}", tensors)]
                             for k, v in obj.items()]}
    if isinstance(obj, tuple | list):
        items = [_encode_tree(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return {"__repr__": repr(obj)}  # lossy: objects JSON cannot hold are kept as their repr


class _Damaged(Exception):
    """A saved tree that does not decode (turned into a CheckpointError naming the folder)."""


def _decode_tree(obj, tensors: Mapping[str, torch.Tensor], key: str, used: set[str]):
    """The value a tree encodes (inverse of :func:`_encode_tree`): a tensor is found only under the name of its
    own place in the tree (``key``: its role, e.g. ``result/samples/z``), so that a tree pointing a sample at the
    log-weight tensor is refused; ``used`` collects the names read."""
    if isinstance(obj, list):
        return [_decode_tree(v, tensors, f"{key}/{i}", used) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            name = obj["__tensor__"]
            if not isinstance(name, str) or name not in tensors:
                raise _Damaged(f"the tree names the tensor {name!r}, which the tensors file does not hold")
            if name != key:
                raise _Damaged(f"the tree's {key} points at the tensor {name!r}, which belongs elsewhere (a value "
                               f"is stored under the name of its place in the tree: expected {key!r})")
            used.add(name)
            return tensors[name]
        if set(obj) == {"__tuple__"} and isinstance(obj["__tuple__"], list):
            return tuple(_decode_tree(v, tensors, f"{key}/{i}", used) for i, v in enumerate(obj["__tuple__"]))
        if set(obj) == {"__dict__"} and isinstance(obj["__dict__"], list):
            pairs = obj["__dict__"]
            if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
                raise _Damaged("a dict of the tree is not a list of [key, value] pairs")
            if len({p[0] for p in pairs}) != len(pairs):
                raise _Damaged("a dict of the tree holds one key twice")
            return {k: _decode_tree(v, tensors, f"{key}/{_key_part(k)}", used) for k, v in pairs}
        if set(obj) == {"__repr__"} and isinstance(obj["__repr__"], str):
            return obj["__repr__"]
        raise _Damaged(f"the tree holds an object of unknown kind (keys {sorted(obj)[:5]})")
    return obj


def _check_roles(path, fields: dict) -> None:
    """A saved Result's fields against their roles (:data:`ppl_thought.schemas.RESULT_FIELDS`): dicts where dicts
    belong, log weights a float tensor, the log marginal one number per group of weights."""
    for name in ("samples", "stats", "observed"):
        if not isinstance(fields[name], dict):
            raise SchemaError(f"{path}: damaged saved Result: {name} is a {type(fields[name]).__name__}, not a dict")
    for name in ("log_weights", "log_marginal", "log_marginal_stderr", "ancestry"):
        if fields[name] is not None and (isinstance(fields[name], bool)
                                         or not isinstance(fields[name], torch.Tensor | int | float)):
            raise SchemaError(f"{path}: damaged saved Result: {name} is a {type(fields[name]).__name__}, "
                              "not a tensor")
    lw, lz = fields["log_weights"], fields["log_marginal"]
    if isinstance(lw, torch.Tensor) and (not lw.is_floating_point() or lw.ndim == 0):
        raise SchemaError(f"{path}: damaged saved Result: log_weights is a {lw.dtype} tensor of shape "
                          f"{tuple(lw.shape)}, expected float log weights [..., particles]")
    if isinstance(lw, torch.Tensor) and isinstance(lz, torch.Tensor) and lz.numel() != lw.shape[:-1].numel():
        raise SchemaError(f"{path}: damaged saved Result: log_marginal has shape {tuple(lz.shape)}, expected one "
                          f"value per group of log_weights {tuple(lw.shape)} ({lw.shape[:-1].numel()})")


@checked
def save_result(path: str | Path, result: Result, vocab: Vocab | None = None) -> Path:
    """Write an engine :class:`Result` to directory ``path`` (with ``vocab``, a :class:`~ppl_thought.vocab.Vocab`,
    the vocabulary its token sites use: ``ppl-thought diagnose`` then shows tokens, not ids).

    Same layout and guarantees as :func:`ppl_thought.io.save_checkpoint` (safetensors for every tensor, JSON for the
    rest, atomic writes, SHA-256 check): the config records ``{"kind": "ppl_thought.result/1",
    "tree": ...}``. Values JSON cannot hold and that are not tensors are stored as their ``repr``
    (e.g. strings passed as observed data survive; arbitrary objects do not). No pickle.
    """
    tensors: dict[str, torch.Tensor] = {}
    fields = {name: getattr(result, name) for name in ("samples", "log_weights", "log_marginal",
                                                       "log_marginal_stderr", "ancestry", "stats", "observed")}
    tree = _encode_tree(fields, "result", tensors)
    config = {"kind": RESULT_FORMAT, "engine": str(result.engine), "tree": tree}
    if vocab is not None:
        config["vocab"] = vocab.to_dict()
    return save_checkpoint(path, tensors, config)


def saved_vocab(path: str | Path):
    """The :class:`~ppl_thought.vocab.Vocab` saved with a result (``save_result(..., vocab=...)``), or ``None``."""
    try:
        header = parse_json((Path(path) / CONFIG_FILE).read_bytes(), str(Path(path) / CONFIG_FILE))
        d = header["config"].get("vocab")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(d, dict):
        return None
    try:
        return Vocab.from_dict(schemas.check(schemas.VOCAB, d, path))
    except (PPLThoughtError, KeyError, TypeError, ValueError) as e:
        raise SchemaError(f"{path}: the saved vocabulary cannot be built ({e})") from None


def is_saved_result(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by :func:`save_result`."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        return False
    try:
        header = parse_json((path / CONFIG_FILE).read_bytes(), str(path / CONFIG_FILE))
    except (OSError, CheckpointError):
        return False
    return isinstance(header, dict) and isinstance(header.get("config"), dict) \
        and header["config"].get("kind") == RESULT_FORMAT


@checked
def load_result(path: str | Path):
    """Read a :class:`Result` written by :func:`save_result`."""
    state, config, _ = load_checkpoint(path)
    if not isinstance(config, dict):
        raise SchemaError(f"{path} holds a checkpoint, not a saved Result ({RESULT_FORMAT})")
    schemas.check(schemas.RESULT, config, path)  # every key and its type; the vocabulary's own schema too
    if "vocab" in config:
        schemas.check(schemas.VOCAB, config["vocab"], path)
    used: set[str] = set()
    try:
        fields = _decode_tree(config.get("tree"), state, "result", used)
    except _Damaged as e:
        raise SchemaError(f"{path}: damaged saved Result: {e}") from None
    names = schemas.RESULT_FIELDS
    if not isinstance(fields, dict) or set(fields) != set(names):
        got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
        raise SchemaError(f"{path}: damaged saved Result: its tree holds {got}, not the fields {list(names)}")
    unread = sorted(set(state) - used)
    if unread:
        raise SchemaError(f"{path}: damaged saved Result: the tensors file holds {unread[:5]}, which its tree "
                          "does not name")
    _check_roles(path, fields)
    engine = config.get("engine", "")
    return Result(engine=engine if isinstance(engine, str) else str(engine), **fields)


# ---------------------------------------------------------------------------------------------- site names
def record_sites(values: dict, seen: dict, new: dict, step: int | None) -> None:
    """Record the site values ``{name: (value, particle dim)}`` of a program's init (``step=None``) or step
    ``step`` for ``Result.samples`` (torch engines; docs/architecture.md, "Site names: one rule for both
    backends"). A name sampled at one step is kept as it is (``f"z_{t}"``, one name per step); a name sampled
    again at the next step (``"z"`` at every step, as a JAX program must write it) is recorded once more, and
    :func:`stacked_samples` stacks it over steps. Refused with a :class:`ProgramError`: a site of init sampled
    again in a step, and a name that skips steps and comes back (its values would not line up with steps).
    ``values`` maps a name to its list of ``(value, dim)`` (resampling re-indexes every entry); ``seen`` to the
    first and last step it was sampled at."""
    for k, vd in new.items():
        prev = seen.get(k)
        if prev is None:
            seen[k] = (step, step)
            values[k] = [vd]
            continue
        first, last = prev
        if last is None or step is None:
            raise ProgramError(f"site {k!r} is sampled in init and again in step {step}: a site of init has a name "
                               "of its own (site names differ between init and the steps)")
        if step != last + 1:
            raise ProgramError(f"site {k!r} is sampled in steps {first}..{last} and again in step {step}, not in the "
                               f"steps between: a site named once across steps (the rule of both backends, "
                               f"samples[{k!r}] [n, steps, ...]) is sampled at every step from its first; name a site "
                               f"that only some steps sample once per step, f'{k}_{{t}}'")
        seen[k] = (first, step)
        values[k].append(vd)


def stacked_samples(values: dict) -> dict[str, torch.Tensor]:
    """``Result.samples`` from :func:`record_sites`: particles leading; a site sampled at one step as it is,
    ``[n, ...]``; a site named the same at several steps stacked over them on dim 1, ``[n, steps, ...]`` (the
    layout of the JAX engines, whose step sites always have it)."""
    out: dict[str, torch.Tensor] = {}
    for k, entries in values.items():
        vs = [v.movedim(d, 0) if d is not None else v for v, d in entries]
        if len(vs) == 1:
            out[k] = vs[0]
            continue
        shapes = sorted({tuple(v.shape) for v in vs})
        if len(shapes) > 1:
            raise ProgramError(f"site {k!r} is named the same at {len(vs)} steps with values of shapes {shapes}: a "
                               "site stacked over steps keeps one shape (pad it to a fixed length, or name it once "
                               f"per step, f'{k}_{{t}}')")
        out[k] = torch.stack(vs, 1)
    return out
