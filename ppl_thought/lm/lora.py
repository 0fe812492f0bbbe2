"""LoRA adapters on a :class:`~ppl_thought.lm.huggingface.HuggingFace` model: the trainable part of a real LM.

    lm = pt.lm.smollm2()
    pt.lm.lora(lm, r=8, alpha=16)              # in place: low-rank adapters on q_proj / v_proj, the base frozen
    pt.train.SVI(pt.train.OneSampler(8), {"lr": 1e-3}).run(model, guide, x, num_steps=100)
    pt.lm.save_lora(lm, "adapters")            # safetensors + JSON (atomic, ppl_thought.io.save_checkpoint)
    pt.lm.load_lora(fresh_lm, "adapters")      # exact round trip

A LoRA adapter (Hu et al. 2021) replaces a linear map ``W x`` of the frozen model by ``W x + (alpha / r) B A x``
with ``A [r, d_in]`` (random) and ``B [d_out, r]`` (zeros: the adapted model starts as the base model). Only
``A`` and ``B`` require gradients, so a program that uses the LM registers only them as Pyro params
(:func:`ppl_thought.distributions.register_lm` skips frozen weights): ``pt.train.SVI`` and ``pt.train.Trainer``
train the adapters with any objective of docs/training.md and leave the base weights bitwise unchanged.

The adapters are injected with the ``peft`` library (``pip install 'ppl-thought[lora]'``), which keeps the
model's own class, so :class:`~ppl_thought.lm.huggingface.HuggingFace` and its KV cache work unchanged. The
adapters take the dtype and device of the layer they adapt (bf16 on CUDA included); log-probabilities stay
float32 (the adapter's logits are).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ppl_thought.errors import CheckpointError, ConfigError, MissingDependencyError
from ppl_thought.io import load_checkpoint, save_checkpoint
from ppl_thought.lm.huggingface import HuggingFace
from ppl_thought.validation import checked

__all__ = ["load_lora", "lora", "lora_adapters", "lora_parameters", "reset_lora", "save_lora"]

#: the attention projections of Llama-style models (SmolLM2, Qwen, Llama); GPT-2 calls its one ``c_attn``
DEFAULT_TARGETS = ("q_proj", "v_proj")
_KIND = "ppl_thought.lora"


def _require_peft():
    try:
        import peft
    except ImportError as e:
        raise MissingDependencyError("pt.lm.lora needs the optional dependency 'peft': pip install "
                                     "'ppl-thought[lora]'") from e
    return peft


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@checked
def lora(lm: HuggingFace, r: int = 8, alpha: float = 16.0, target_modules: Sequence[str] = DEFAULT_TARGETS,
         dropout: float = 0.0, seed: int = 0) -> HuggingFace:
    """Add LoRA adapters of rank ``r`` and scale ``alpha / r`` to the linear layers of ``lm.model`` whose names end
    in one of ``target_modules``, in place, freeze every other weight and return ``lm``.

    ``A`` is drawn under ``torch.manual_seed(seed)`` (the global RNG is left as it was), ``B`` is zero, so the
    adapted model computes the base model's logits until it is trained. A model that has adapters already is
    refused (a :class:`ConfigError`): load them with :func:`load_lora`, or build a fresh adapter."""
    peft = _require_peft()
    if isinstance(r, bool) or r < 1:
        raise ConfigError(f"LoRA rank r must be a positive int, got {r!r}")
    if not alpha > 0 or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"LoRA needs alpha > 0 and 0 <= dropout < 1, got alpha={alpha}, dropout={dropout}")
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if not targets:
        raise ConfigError("target_modules is empty: name the linear layers to adapt (e.g. ('q_proj', 'v_proj'))")
    if lora_parameters(lm):
        raise ConfigError("this model has LoRA adapters already: pt.lm.load_lora(lm, path) replaces their values")
    leaves = {n: m for n, m in lm.model.named_modules()
              if n and isinstance(getattr(m, "weight", None), torch.Tensor) and not any(True for _ in m.children())}
    names = {n.rsplit(".", 1)[-1] for n in leaves}
    missing = sorted(set(targets) - names)
    if missing:
        raise ConfigError(f"target_modules {missing} name no layer of {type(lm.model).__name__} "
                          f"(its layers with weights: {sorted(names)})")
    # GPT-2's Conv1D stores its weight transposed (fan_in_fan_out)
    conv1d = any(type(m).__name__ == "Conv1D" for n, m in leaves.items() if n.rsplit(".", 1)[-1] in targets)
    config = peft.LoraConfig(r=int(r), lora_alpha=float(alpha), target_modules=targets, lora_dropout=float(dropout),
                             bias="none", fan_in_fan_out=conv1d)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, lm.model)
    for name, p in lm.model.named_parameters():
        p.requires_grad_(_is_adapter(name))
    lm.lora_config = {"r": int(r), "alpha": float(alpha), "target_modules": sorted(targets),
                      "dropout": float(dropout)}
    return lm


@checked
def lora_parameters(lm: HuggingFace) -> dict[str, torch.nn.Parameter]:
    """The adapter weights of ``lm`` by their names in ``lm.model`` (empty without adapters)."""
    return {n: p for n, p in lm.model.named_parameters() if _is_adapter(n)}


@checked
def save_lora(lm: HuggingFace, path: str | os.PathLike) -> Path:
    """Write the adapters of ``lm`` (their tensors, in their dtype) and their configuration to directory ``path``
    with :func:`ppl_thought.io.save_checkpoint` (safetensors + JSON, atomic). Returns the directory."""
    params = lora_parameters(lm)
    if not params:
        raise ConfigError("this model has no LoRA adapters to save: pt.lm.lora(lm, r=...) adds them")
    state = {n: p.detach().cpu() for n, p in params.items()}
    if getattr(lm, "lora_config", None) is None:
        raise ConfigError("these adapters were not added by pt.lm.lora (no lora_config): add them with pt.lm.lora")
    config = {"kind": _KIND, "model": type(lm.model).__name__, **lm.lora_config}
    return save_checkpoint(path, state, config)


@checked
def load_lora(lm: HuggingFace, path: str | os.PathLike) -> HuggingFace:
    """Read adapters written by :func:`save_lora` into ``lm`` (adding them first with the saved configuration when
    ``lm`` has none) and return ``lm``: the values are copied bit for bit, onto the adapters' device and dtype.
    A checkpoint of other adapters (another rank, other layers, another model class) raises a
    :class:`~ppl_thought.errors.CheckpointError` naming the difference."""
    state, config, _ = load_checkpoint(path)
    if config.get("kind") != _KIND:
        raise CheckpointError(f"{path} holds no LoRA adapters (config kind {config.get('kind')!r}); "
                              "write them with pt.lm.save_lora")
    if config["model"] != type(lm.model).__name__:
        raise CheckpointError(f"{path} holds adapters of a {config['model']}, this model is a "
                              f"{type(lm.model).__name__}")
    saved = {k: config[k] for k in ("r", "alpha", "target_modules", "dropout")}
    if not lora_parameters(lm):
        lora(lm, saved["r"], saved["alpha"], saved["target_modules"], saved["dropout"])
    elif getattr(lm, "lora_config", None) != saved:
        raise CheckpointError(f"{path} holds adapters {saved}, this model has {lm.lora_config}")
    params = lora_parameters(lm)
    if set(params) != set(state):
        diff = sorted(set(params) ^ set(state))[:3]
        raise CheckpointError(f"{path} does not hold the adapters of this model (e.g. {diff})")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != state[name].shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(state[name].shape)}, the model's "
                                      f"{tuple(p.shape)}")
            p.copy_(state[name].to(device=p.device, dtype=p.dtype))
    return lm


@checked
def reset_lora(lm: HuggingFace, seed: int = 0) -> HuggingFace:
    """Put the adapters of ``lm`` back to a fresh start, in place: every ``A`` drawn as :func:`lora` draws it
    (Kaiming-uniform, ``a = sqrt(5)``) from a generator seeded with ``seed``, every ``B`` zero (the base model's
    logits again). For runs that compare trainings from the same base without reloading it."""
    params = lora_parameters(lm)
    if not params:
        raise ConfigError("this model has no LoRA adapters to reset: pt.lm.lora(lm, r=...) adds them")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(params.items()):
            if ".lora_A." in name:
                fresh = torch.empty(p.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(fresh, a=5 ** 0.5, generator=gen)
                p.copy_(fresh.to(device=p.device, dtype=p.dtype))
            else:
                p.zero_()
    return lm


@checked
def lora_adapters(lm: HuggingFace) -> torch.nn.ParameterDict:
    """The adapters of ``lm`` as a module of their own (the same tensors; names with ``:`` for ``.``), for
    ``pt.train.Trainer(..., modules={"adapters": pt.lm.lora_adapters(lm)})``: the Trainer then optimises,
    all-reduces and checkpoints the adapters only, not the frozen base (135M weights for SmolLM2)."""
    params = lora_parameters(lm)
    if not params:
        raise ConfigError("this model has no LoRA adapters: pt.lm.lora(lm, r=...) adds them")
    return torch.nn.ParameterDict({n.replace(".", ":"): p for n, p in params.items()})
