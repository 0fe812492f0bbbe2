"""Up-front resource checks: the memory a call needs, estimated from its arguments, against the machine's limit
(docs/architecture.md, "Resources").

Engines, language models, projections and automata call :func:`check_bytes` where the size becomes known (an
engine's constructor, a model's constructor, an automaton's build: never per token), with an estimate from the
helpers below. An estimate above the limit raises :class:`~ppl_thought.errors.ResourceError` naming the argument,
the estimate and the limit, before anything is allocated. The estimates are lower bounds of what the call
allocates (the buffers it cannot do without), so a refused call could not have run; the layered token
automaton's is the bound of its table (states that can reach acceptance, times the layers they can occupy).

The limit is the memory available to this process: ``MemAvailable`` of ``/proc/meminfo`` (or ``psutil``'s
``virtual_memory().available``, or the OS's free pages, where that file is missing); for a CUDA device, the
device's free memory as torch reports it (only when torch is already imported: this module imports no
framework). The environment variable ``PPL_THOUGHT_MAX_BYTES`` overrides it: a number of bytes (``"8e9"``,
``"8000000000"``) is the limit in place of the machine's, ``"unlimited"`` turns the checks off.
:func:`ppl_thought.checks.allocation` (a tensor's bytes, at an engine's run) reads the same limit.

Base layer: numpy-free, no torch, no jax.
"""

from __future__ import annotations

import math
import os
import sys

from ppl_thought.errors import ConfigError, ResourceError

#: the environment variable that overrides the machine's limit
ENV = "PPL_THOUGHT_MAX_BYTES"
#: bytes every particle needs at least, whatever the program: its log weight, its ancestor index, its running
#: log-probability and one drawn value (8 bytes each)
PARTICLE_BYTES = 32


def _env_limit() -> float | None:
    """The limit ``PPL_THOUGHT_MAX_BYTES`` sets (``inf`` for "unlimited"), or None where it is not set."""
    text = os.environ.get(ENV)
    if text is None or not text.strip():
        return None
    if text.strip().lower() in ("unlimited", "inf", "none", "off"):
        return math.inf
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"the environment variable {ENV}={text!r} is not a number of bytes > 0 nor 'unlimited'")
    return value


def available_bytes(device: object = None) -> float:
    """The memory available for a call on ``device`` (None or a CPU: the machine's RAM; a CUDA device: its free
    memory), or ``PPL_THOUGHT_MAX_BYTES`` where set (module docstring). ``inf`` where nothing can be measured."""
    env = _env_limit()
    if env is not None:
        return env
    kind = str(getattr(device, "type", device) or "cpu")
    torch = sys.modules.get("torch")
    if kind.startswith("cuda") and torch is not None:
        try:
            return float(torch.cuda.mem_get_info(device)[0])
        except Exception:  # noqa: BLE001 - no usable CUDA here: the host's memory is what is left to measure
            pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil missing or unsupported here: the OS's count of free pages
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES")) * float(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def _human(n: float) -> str:
    if not math.isfinite(n):
        return str(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} EiB"  # pragma: no cover


def check_bytes(estimate: float, who: str, argument: str, device: object = None, fix: str | None = None) -> None:
    """Refuse (:class:`ResourceError`) a call of ``who`` whose ``estimate`` (bytes) exceeds what is available on
    ``device`` (:func:`available_bytes`), naming ``argument`` (e.g. ``"num_particles=1099511627776"``), the
    estimate, the limit and the override; ``fix`` says what to change (default: a smaller ``argument``)."""
    limit = available_bytes(device)
    if estimate > limit:
        where = f" ({ENV})" if os.environ.get(ENV) is not None else "" if device is None else f" on {device}"
        raise ResourceError(
            f"{who}: {argument} needs at least {_human(estimate)} of memory, more than the {_human(limit)} "
            f"available{where}; refused before allocating. Use {fix or 'a smaller ' + argument.split('=')[0]}, or "
            f"set the environment variable {ENV} to a number of bytes (or 'unlimited') if you know the call fits")


# -------------------------------------------------------------------------------------------- estimates


def particle_bytes(num_particles: int, groups: int = 1, vocab_size: int | None = None,
                   dtype_bytes: int = 4) -> float:
    """Bytes ``groups * num_particles`` particles need at least: :data:`PARTICLE_BYTES` each, plus one row of
    next-token log-probabilities (``vocab_size`` floats of ``dtype_bytes``) each where the vocabulary is known."""
    per = PARTICLE_BYTES + (vocab_size or 0) * dtype_bytes
    return float(num_particles) * float(groups) * per


def transformer_bytes(vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int, max_len: int,
                      tie_embeddings: bool = True, dtype_bytes: int = 4) -> float:
    """Bytes a Transformer's constructor allocates at least: its weights (embedding, LM head unless tied, per
    layer attention ``4 d^2`` and gated MLP ``3 d d_ff``, norms) and its RoPE tables (cos and sin,
    ``max_len x head_dim / 2`` each, computed in float64)."""
    d, head_dim = float(d_model), float(d_model) / float(n_heads)
    weights = vocab_size * d * (1 if tie_embeddings else 2) + n_layers * (4 * d * d + 3 * d * d_ff + 2 * d) + d
    rope = float(max_len) * head_dim / 2 * (2 * dtype_bytes + 8)
    return weights * dtype_bytes + rope


def check_particles(who: str, num_particles: int, groups: int = 1, vocab_size: int | None = None,
                    device: object = None) -> None:
    """:func:`check_bytes` for an engine of ``groups x num_particles`` particles (:func:`particle_bytes`): at its
    constructor (the vocabulary unknown yet) and, where the engine knows the program's vocabulary, at its run."""
    argument = f"num_particles={num_particles}" + ("" if groups == 1 else f" (x groups={groups})")
    check_bytes(particle_bytes(num_particles, groups, vocab_size), who, argument, device)


def check_transformer(who: str, config: dict, device: object = None) -> None:
    """:func:`check_bytes` for a Transformer's constructor arguments (``config``: every argument, ``d_ff``
    resolved), naming the argument that weighs most: ``max_len`` (the RoPE tables) or the weights' sizes."""
    c = config
    total = transformer_bytes(c["vocab_size"], c["d_model"], c["n_layers"], c["n_heads"], c["d_ff"], c["max_len"],
                              c.get("tie_embeddings", True))
    rope = float(c["max_len"]) * c["d_model"] / c["n_heads"] / 2 * 16
    argument = (f"max_len={c['max_len']}" if rope >= total / 2 else
                f"vocab_size={c['vocab_size']}, d_model={c['d_model']}, n_layers={c['n_layers']}, d_ff={c['d_ff']}")
    check_bytes(total, who, argument, device)


def kv_cache_bytes(n_layers: int, batch: int, n_heads: int, length: int, head_dim: int,
                   dtype_bytes: int = 4) -> float:
    """Bytes of a key-value cache: ``layers x 2 (keys, values) x batch x heads x length x head_dim x dtype``."""
    return float(n_layers) * 2 * batch * n_heads * length * head_dim * dtype_bytes


def automaton_bytes(num_states: float, vocab_size: int) -> float:
    """Bytes of an automaton's transition table (``int64 [states, vocab]``) with its per-state flags."""
    return float(num_states) * (float(vocab_size) * 8 + 9)


__all__ = ["ENV", "PARTICLE_BYTES", "automaton_bytes", "available_bytes", "check_bytes", "check_particles",
           "check_transformer", "kv_cache_bytes", "particle_bytes", "transformer_bytes"]
