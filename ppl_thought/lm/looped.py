"""A looped Transformer: one small stack of blocks applied T times with input injection (cot-or-loop.txt, Section 4).

    e      = embed(x) + pos                              the embedded input (WE + PE of Definition A.2)
    h_0    = 0
    h_{k+1} = f(h_k + e)        k = 0 .. T-1            f: ``n_layers`` pre-norm blocks (Definition A.3)
    logits = head(RMSNorm(h_T))                          [B, L, V], one prediction per position (Definition 2.2)

``f`` is a stack of the library's :class:`~ppl_thought.lm.transformer.Block` (self-attention with RoPE, SwiGLU),
the same block a :class:`~ppl_thought.lm.transformer.Transformer` layer uses, so a looped model and a plain one of
the same ``d_model``/``n_heads``/``d_ff`` have the same parameters per block. The number of loops ``T`` is an
argument of :meth:`Looped.forward`, not of the model: one set of weights runs at any depth (Section 2.2: the
number of loops is the looped model's step count).

Input injection: Definition A.3 writes ``f^{k+1} = f(f^k + PE(., k))`` with ``f^0 = WE(x)``; here the whole
embedded input ``e = WE(x) + PE`` is added before every application of ``f`` (the re-injection of Section 4's
looped models, so that the input is not lost as the hidden state is refined), and ``h_0 = 0``, so that ``T = 1``
is exactly one plain application of the stack to the embedded input. There is no loop-dependent encoding
``PE(., k)``: the tasks of :mod:`ppl_thought.experiments.cot_vs_loop` place every node of the computation graph at
its own position, so each node reads fixed positions at every loop (Theorem 4.7's layer-wise simulation).

``causal=False`` (the default) is the looped model of Definition 2.2 (full attention, a fixed-length sequence
of internal states, the answer read at the output positions). ``causal=True`` with ``T = 1`` is an ordinary
causal decoder with learned absolute positions: :mod:`~ppl_thought.experiments.cot_vs_loop` uses it as the
chain-of-thought model of Definition 2.1 with exactly the same parameters as the looped one. There is no KV
cache: every loop re-reads the whole sequence, so ``forward`` returns the logits alone.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ppl_thought import checks
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.lm.base import check_token_ids
from ppl_thought.lm.transformer import Block, RMSNorm, rope_tables
from ppl_thought.validation import checked, per_token

__all__ = ["Looped"]


class _NoCache:
    """What :class:`Block` stores keys and values into when nothing is cached: it hands them straight back."""

    @staticmethod
    def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


@checked
class Looped(nn.Module):
    """A block stack of fixed depth applied ``T`` times with input injection (cot-or-loop Section 4, Def. 2.2 / A.3).

    Args:
        vocab_size: number of token ids.
        d_model, n_layers, n_heads: width, depth of the looped stack (``n_layers`` blocks per loop), heads.
        d_ff: SwiGLU hidden width (default 8/3 d_model rounded up to a multiple of 8, as in ``Transformer``).
        max_len: number of learned absolute positions (and RoPE table length).
        causal: causal attention (a chain-of-thought decoder when run with ``T = 1``); default full attention.
        tie_embeddings: the output head is the token embedding matrix.
    """

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 1, n_heads: int = 4,
                 d_ff: int | None = None, max_len: int = 64, causal: bool = False, tie_embeddings: bool = True):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                            ("n_heads", n_heads), ("max_len", max_len)):
            checks.integer(f"Looped: {name}", value)
        checks.optional_integer("Looped: d_ff", d_ff)
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ConfigError(f"Looped: d_model / n_heads must be an even integer (RoPE), got {d_model} / {n_heads}")
        self.vocab_size, self.d_model, self.n_layers, self.n_heads = vocab_size, d_model, n_layers, n_heads
        self.d_ff = d_ff if d_ff is not None else 8 * math.ceil(8 * d_model / 3 / 8)
        self.max_len, self.causal, self.tie_embeddings = max_len, bool(causal), bool(tie_embeddings)
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(i, d_model, n_heads, self.d_ff, 0.0, None) for i in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(d_model // n_heads, max_len, 10000.0)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():  # GPT-2 init, as Transformer._init_weights
            if not name.endswith("norm.weight"):
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("out.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def num_parameters(self) -> int:
        """Number of parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    def config(self) -> dict:
        return {"vocab_size": self.vocab_size, "d_model": self.d_model, "n_layers": self.n_layers,
                "n_heads": self.n_heads, "d_ff": self.d_ff, "max_len": self.max_len, "causal": self.causal,
                "tie_embeddings": self.tie_embeddings}

    def embed_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """``e = WE(x) + PE``: ``[B, L, d_model]``, the term injected before every loop."""
        L = tokens.shape[1]
        return self.embed(tokens) + self.pos(torch.arange(L, device=tokens.device))

    @per_token
    def step(self, h: torch.Tensor) -> torch.Tensor:
        """One application of the stack ``f`` to hidden states ``h [B, L, d_model]``."""
        L = h.shape[1]
        cos, sin = self.rope_cos[:L], self.rope_sin[:L]
        causal = self.causal and L > 1
        for block in self.blocks:
            h = block(h, cos, sin, None, causal, _NoCache, None)
        return h

    def hidden(self, tokens: torch.Tensor, T: int, inject: bool = True) -> torch.Tensor:
        """``h_T`` after ``T`` loops, ``[B, L, d_model]``. ``inject=False`` drops the injection after the first loop
        (``h_{k+1} = f(h_k)``, ``h_1 = f(e)``): the ablation that shows the injected input is used."""
        checks.integer("Looped: T (number of loops)", T)
        self._check(tokens)
        e = self.embed_input(tokens)
        h = self.step(e)
        for _ in range(T - 1):
            h = self.step(h + e if inject else h)
        return h

    @per_token
    def forward(self, tokens: torch.Tensor, T: int = 1, inject: bool = True) -> torch.Tensor:
        """Logits ``[B, L, vocab_size]`` after ``T`` loops (per position; for ``causal=True``, next-token logits)."""
        return self.lm_head(self.norm(self.hidden(tokens, T, inject)))

    def _check(self, tokens: torch.Tensor) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise MalformedSequenceError(f"Looped: tokens must be a LongTensor [B, L], got {type(tokens).__name__} "
                                         f"of shape {tuple(getattr(tokens, 'shape', ()))}")
        if tokens.shape[1] < 1 or tokens.shape[1] > self.max_len:
            raise MalformedSequenceError(f"Looped: sequence length must be in [1, max_len={self.max_len}], "
                                         f"got {tokens.shape[1]}")
        check_token_ids(tokens, self.vocab_size)
