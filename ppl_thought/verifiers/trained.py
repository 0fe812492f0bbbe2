"""A trained, imperfect process verifier: the single-linear-layer verifier of thesis Section 3.2.1.2.

The thesis collects the strings on which the trained LM made a mistake, cut right after the first error
(a rule-based parser finds it: :func:`first_errors`), and as many correct strings of the same lengths; a linear
layer (a ``d x 2`` matrix) on the LM's last-layer-last-position representation learns to tell them apart
(label 0: error, 1: correct). :class:`LinearProbeVerifier` is that verifier: it never reads the grammar, only
the LM's features, so it errs where the features do not separate the classes. Called on right-padded prefixes
``[m, L]`` it returns bool ``[m]`` (``True``: accept), the protocol of
:class:`~ppl_thought.verifiers.TokenwiseBacktracking`.
"""

from __future__ import annotations

import torch

from ppl_thought.checks import integer as check_count
from ppl_thought.errors import ConfigError, MalformedSequenceError
from ppl_thought.lm.base import lm_device
from ppl_thought.validation import checked
from ppl_thought.verifiers.process import ProcessVerifier
from ppl_thought.vocab import BOS_ID, PAD_ID

__all__ = ["LinearProbeVerifier", "first_errors"]


@checked
def first_errors(verifier: ProcessVerifier, strings: torch.Tensor) -> torch.Tensor:
    """The rule-based error parser of Section 3.2.1.2: for each right-padded row ``[n, L]`` the index of its first
    token after which the prefix can no longer be completed in A (``V(s_{1:i+1}) = 0``, Def 3.1.3), or -1 when
    every prefix of the row is completable. Batched over rows, one automaton step per position."""
    strings = torch.as_tensor(strings)
    if strings.ndim != 2:
        raise MalformedSequenceError(f"strings must be token ids [n, L], got shape {tuple(strings.shape)}")
    strings = strings.long()
    n, L = strings.shape
    aut = verifier.automaton
    states = aut.start_states(n, strings.device)
    first = torch.full((n,), -1, dtype=torch.long, device=strings.device)
    for i in range(L):  # a loop over positions, batched over rows
        tok = strings[:, i]
        states = aut.advance(states, tok)
        bad = (tok != PAD_ID) & ~verifier.from_states(states, i + 1) & (first < 0)
        first = torch.where(bad, torch.full_like(first, i), first)
    return first


def _norm_features(lm: torch.nn.Module, prefixes: torch.Tensor) -> torch.Tensor:
    """The LM's last-layer representation (its final norm's output) at the last token of each right-padded row."""
    norm = getattr(lm, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ConfigError(f"LinearProbeVerifier reads the output of the LM's final norm `lm.norm`; "
                          f"{type(lm).__name__} has none")
    dev = lm_device(lm)
    prefixes = torch.as_tensor(prefixes, device=dev).long()
    if prefixes.ndim != 2:
        raise MalformedSequenceError(f"prefixes must be token ids [m, L], got shape {tuple(prefixes.shape)}")
    m = prefixes.shape[0]
    ctx = torch.cat([torch.full((m, 1), BOS_ID, dtype=torch.long, device=dev), prefixes], 1)
    lengths = (prefixes != PAD_ID).sum(-1)  # the last token sits at position `lengths` of ctx
    out: dict[str, torch.Tensor] = {}
    handle = norm.register_forward_hook(lambda _m, _i, o: out.__setitem__("h", o))
    try:
        with torch.no_grad():
            lm(ctx)
    finally:
        handle.remove()
    h = out["h"]
    return h[torch.arange(m, device=dev), lengths].float()


@checked
class LinearProbeVerifier:
    """Section 3.2.1.2's verifier V: one linear layer ``W [d, 2]`` (and a bias) on the LM's last-layer
    representation of the last position; ``V(s) = 1`` iff the "correct" logit wins.

    Build it with :meth:`fit` from error strings (each cut right after its first error) and correct strings
    of the same lengths. ``__call__(prefixes [m, L])`` -> bool ``[m]``.
    """

    def __init__(self, lm: torch.nn.Module, layer: torch.nn.Linear):
        if layer.out_features != 2:
            raise ConfigError(f"LinearProbeVerifier needs a torch.nn.Linear with 2 outputs, got {layer!r}")
        self.lm, self.layer = lm, layer

    @classmethod
    def fit(cls, lm: torch.nn.Module, errors: torch.Tensor, correct: torch.Tensor, val_fraction: float = 90 / 882,
            steps: int = 500, lr: float = 1e-2, weight_decay: float = 1e-3,
            seed: int = 0) -> tuple[LinearProbeVerifier, dict]:
        """Train V by full-batch cross-entropy (AdamW) on ``errors`` (label 0) and ``correct`` (label 1), both
        right-padded ``[n, L]``; a random ``val_fraction`` of the pooled strings is held out (the thesis: 90 of
        882). Returns the verifier and ``{"train_accuracy", "val_accuracy", "n_train", "n_val"}``."""
        steps = check_count("steps", steps)
        if not 0.0 <= float(val_fraction) < 1.0:
            raise ConfigError(f"val_fraction must lie in [0, 1), got {val_fraction!r}")
        errors, correct = torch.as_tensor(errors), torch.as_tensor(correct)
        if errors.ndim != 2 or correct.ndim != 2 or len(errors) == 0 or len(correct) == 0:
            raise ConfigError(f"errors and correct must be non-empty token ids [n, L], got shapes "
                              f"{tuple(errors.shape)} and {tuple(correct.shape)}")
        width = max(errors.shape[1], correct.shape[1])
        pad = lambda x: torch.nn.functional.pad(x.long(), (0, width - x.shape[1]), value=PAD_ID)  # noqa: E731
        x = torch.cat([pad(errors), pad(correct)])
        dev = lm_device(lm)
        y = torch.cat([torch.zeros(len(errors), dtype=torch.long), torch.ones(len(correct), dtype=torch.long)]).to(dev)
        feats = _norm_features(lm, x)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(x), generator=g).to(dev)
        n_val = int(round(float(val_fraction) * len(x)))
        val, train = perm[:n_val], perm[n_val:]
        torch.manual_seed(seed)
        layer = torch.nn.Linear(feats.shape[1], 2).to(dev)
        opt = torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=weight_decay)
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(layer(feats[train]), y[train])
            opt.zero_grad()
            loss.backward()
            opt.step()
        layer.requires_grad_(False)
        with torch.no_grad():
            pred = layer(feats).argmax(-1)
        acc = lambda idx: float((pred[idx] == y[idx]).float().mean()) if len(idx) else float("nan")  # noqa: E731
        return cls(lm, layer), {"train_accuracy": acc(train), "val_accuracy": acc(val),
                                "n_train": int(len(train)), "n_val": int(n_val)}

    def __call__(self, prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.layer(_norm_features(self.lm, prefixes)).argmax(-1) == 1
