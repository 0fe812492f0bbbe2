"""The Transformer's checkpoint schema: its constructor arguments, its state-dict names and shapes, and the checks
a loaded config must pass against the tensors stored next to it (docs/architecture.md, "Rules that keep it right").
One description for both backends: ``pt.lm.Transformer.load`` and ``ptn.lm.Transformer`` read it. Split from
:mod:`ppl_thought.checkpoint` (the file format)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from ppl_thought import schemas
from ppl_thought.checkpoint import read_checkpoint
from ppl_thought.errors import CheckpointError, ConfigError, SchemaError

# -------------------------------------------------------------------------- Transformer checkpoints

#: the constructor arguments of both Transformers (``pt.lm.Transformer`` and ``ptn.lm.Transformer``), with
#: their defaults: the keys a Transformer checkpoint's config may hold besides "class" and "vocab"
TRANSFORMER_ARGS: dict[str, object] = {
    "vocab_size": None, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": None, "max_len": 2048,
    "window": None, "cross_attention": False, "d_latent": None, "rope_base": 10000.0, "dropout": 0.0,
    "tie_embeddings": True,
}


def transformer_sizes(config: Mapping) -> dict:
    """Every constructor argument (defaults filled in, ``d_ff`` and ``d_latent`` resolved) of a Transformer
    config, checked the way the constructor checks them: ``ValueError`` naming the problem."""
    c = {**TRANSFORMER_ARGS, **config}
    if c["vocab_size"] is None:
        raise ConfigError("vocab_size is required")
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
        if isinstance(c[k], bool) or not isinstance(c[k], int) or c[k] < 1:
            raise ConfigError(f"{k}={c[k]!r} is not a positive integer")
    if c["d_model"] % c["n_heads"] or (c["d_model"] // c["n_heads"]) % 2:
        raise ConfigError(f"d_model / n_heads must be an even integer (RoPE), got {c['d_model']} / {c['n_heads']}")
    if c["window"] is not None and (not isinstance(c["window"], int) or c["window"] < 1):
        raise ConfigError(f"window must be >= 1, got {c['window']!r}")
    if c["d_latent"] is not None and not c["cross_attention"]:
        raise ConfigError("d_latent is only used with cross_attention=True")
    c["d_ff"] = c["d_ff"] if c["d_ff"] is not None else 8 * math.ceil(8 * c["d_model"] / 3 / 8)
    c["d_latent"] = (c["d_latent"] or c["d_model"]) if c["cross_attention"] else None
    c["cross_attention"], c["tie_embeddings"] = bool(c["cross_attention"]), bool(c["tie_embeddings"])
    c["rope_base"], c["dropout"] = float(c["rope_base"]), float(c["dropout"])
    return c


def transformer_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """The state-dict names and shapes of a Transformer (torch naming, ``Linear`` weights ``[out, in]``).

    The one description of the tensors of a Transformer checkpoint: ``ptn.lm.Transformer`` reads its
    parameters by these names, and a test checks them against ``pt.lm.Transformer.state_dict()``."""
    c = transformer_sizes(config)
    D, F, V = c["d_model"], c["d_ff"], c["vocab_size"]
    shapes = {"embed.weight": (V, D)}
    for i in range(c["n_layers"]):
        b = f"blocks.{i}."
        shapes.update({b + "attn_norm.weight": (D,), b + "attn.qkv.weight": (3 * D, D), b + "attn.out.weight": (D, D)})
        if c["cross_attention"]:
            shapes.update({b + "cross_norm.weight": (D,), b + "cross.q.weight": (D, D),
                           b + "cross.kv.weight": (2 * D, c["d_latent"]), b + "cross.out.weight": (D, D)})
        shapes.update({b + "mlp_norm.weight": (D,), b + "mlp.gate_up.weight": (2 * F, D),
                       b + "mlp.down.weight": (D, F)})
    shapes.update({"norm.weight": (D,), "lm_head.weight": (V, D)})
    return shapes


def saved_transformer_vocab(path: str | Path) -> dict | None:
    """The vocabulary dict a Transformer checkpoint was saved with (``save(..., vocab=...)``), checked against the
    model's config and stored shapes, or None: read from the config and the tensors file's header, no tensor
    decoded (both backends' ``Transformer.load_vocab``)."""
    raw = read_checkpoint(path)
    config = raw.header["config"]
    if not isinstance(config, dict) or "vocab" not in config:
        return None
    check_transformer_config(path, config, raw.shapes, raw.aliases)  # the vocabulary fits the model
    return config["vocab"]


def check_transformer_config(path, config, saved: Mapping[str, tuple[int, ...]],
                             aliases: Mapping[str, str] | None = None) -> dict:
    """The constructor arguments of a Transformer checkpoint, checked against the saved tensor shapes.

    The config is first checked against :data:`ppl_thought.schemas.TRANSFORMER` (its format version; every
    constructor argument present, typed and in range: a config without ``n_heads`` or ``rope_base`` is refused,
    never built with the constructor's default). A config that does not describe the saved tensors (keys that
    are no constructor argument, sizes that are not positive integers, another depth, width or tensor shape
    than saved, a saved vocabulary of another size than ``vocab_size``) raises
    :class:`~ppl_thought.errors.CheckpointError` naming it, before anything is allocated. ``aliases`` (the
    tensors file's ``{alias: stored name}``) must be exactly the tied LM head of a ``tie_embeddings`` model and
    nothing for an untied one. Shared by the torch and the JAX loader: the same checkpoint is accepted or
    refused, with the same message, by both.
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: the config of a Transformer checkpoint is a JSON object, got {config!r}")
    schemas.check(schemas.TRANSFORMER, config, path)  # version, every argument present and typed: no defaults
    config = dict(config)
    config.pop(schemas.TRANSFORMER.version_key, None)
    vocab = config.pop("vocab", None)
    if vocab is not None:
        _check_saved_vocab(path, vocab, config.get("vocab_size"))
    if config.pop("class", "Transformer") != "Transformer":
        raise CheckpointError(f"{path} is not a Transformer checkpoint")
    unknown = sorted(set(config) - set(TRANSFORMER_ARGS))
    if unknown or "vocab_size" not in config:
        raise CheckpointError(f"{path}: the config " + (f"has keys {unknown} that are not Transformer arguments"
                                                         if unknown else "lacks vocab_size"))
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
        v = config.get(k, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointError(f"{path}: config {k}={v!r} is not a positive integer")
    # depth and width from the tensors first: a corrupted n_layers would describe that many blocks
    blocks = {k.split(".")[1] for k in saved if k.startswith("blocks.")}
    embed = saved.get("embed.weight")
    want = (config["vocab_size"], config.get("d_model", TRANSFORMER_ARGS["d_model"]))
    n_layers = config.get("n_layers", TRANSFORMER_ARGS["n_layers"])
    if len(blocks) != n_layers or embed is None or tuple(embed) != want:
        raise CheckpointError(
            f"{path}: the config (n_layers={n_layers}, vocab_size, d_model = {want}) does not "
            f"describe the saved tensors ({len(blocks)} blocks, embed.weight "
            f"{None if embed is None else tuple(embed)})")
    try:
        expected = transformer_shapes(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: the config cannot build a Transformer: {e}") from None
    saved = {k: tuple(v) for k, v in saved.items()}
    if expected != saved:
        bad = sorted(set(expected) ^ set(saved)) + sorted(k for k in set(expected) & set(saved)
                                                          if expected[k] != saved[k])
        raise CheckpointError(f"{path}: the saved tensors do not match the config (missing, unexpected or "
                              f"of another shape: {bad[:5]})")
    if aliases is not None:
        tied = ({"lm_head.weight": "embed.weight"}, {"embed.weight": "lm_head.weight"})
        ok = dict(aliases) in tied if config.get("tie_embeddings", True) else not aliases
        if not ok:
            raise CheckpointError(f"{path}: the tensors file ties {dict(aliases)} but the config has "
                                  f"tie_embeddings={config.get('tie_embeddings', True)} (a Transformer ties only "
                                  "lm_head.weight to embed.weight): refused")
    return config


def _check_saved_vocab(path, vocab, vocab_size) -> None:
    """A vocabulary saved with a model (``Vocab.to_dict``) must build and have ``vocab_size`` ids."""
    from ppl_thought.errors import PPLThoughtError
    from ppl_thought.vocab import Vocab

    try:
        schemas.check(schemas.VOCAB, vocab, path)
        size = len(Vocab.from_dict(vocab))
    except (TypeError, ValueError, PPLThoughtError) as e:
        raise SchemaError(f"{path}: the saved vocabulary cannot be read: {e}"[:300]) from None
    if size != vocab_size:
        raise CheckpointError(f"{path}: the saved vocabulary has {size} ids, the config's vocab_size is "
                              f"{vocab_size}: refused (token ids would be read as other tokens)")
