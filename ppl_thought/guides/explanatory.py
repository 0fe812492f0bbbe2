"""Causal (3.33) and explanatory (Section 5.6.2, Def 3.9) samplers, the gating of App. L, and the
program-view helper :func:`explanatory_guide`.

- :class:`Causal`: an LM decoded under the lifting automaton of x with the masked softmax
  (Def 2.8): ``LMSequence(lm, constraint=projection.lifting(x))``. Before x_t the choice between
  a thought and x_t is renormalised over the admissible tokens, so the segment z^(t) depends
  on x_t, but never on x_>t: a causal sampler in the form (3.33).
- :class:`Explanatory`: the prompt "x <explain>" (optionally with a mode tag, Fig 5.2) and
  then z decoded under the lifting automaton (Fig 5.5): every token of z may read all of x.
- :class:`GatedLM`: the gating trick of App. L, (L.1)-(L.2), as a wrapper around any LM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyro
import torch
from torch import nn

from ppl_thought.distributions.lm_sequence import LMSequence, concat
from ppl_thought.distributions.lm_state import LMState
from ppl_thought.errors import UnknownTokenError
from ppl_thought.guides.base import Sampler
from ppl_thought.lm.base import lm_device
from ppl_thought.projections.base import Projection
from ppl_thought.vocab import BOS_ID, EXPLAIN_ID, Vocab


class _LMSampler(Sampler):
    """A sampler that is an LMSequence under the lifting automaton of x, after a prompt."""

    def __init__(self, lm: nn.Module, projection: Projection, name: str):
        if int(lm.vocab_size) != len(projection.vocab):
            raise ValueError(f"LM vocab_size {lm.vocab_size} != projection vocabulary size {len(projection.vocab)}")
        self.lm = lm
        self.projection = projection
        self.name = name

    def prompt(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long, device=x.device)

    def seq(self, x: torch.Tensor) -> LMSequence:
        """Q(. | x) as an :class:`LMSequence` (masked, batched, KV-cached)."""
        lift = self.lifting(x)
        return LMSequence(self.lm, prompt=self.prompt(x), constraint=lift, max_len=self.event_length(x),
                          vocab=self.projection.vocab)

    def _register(self) -> None:
        if any(p.requires_grad for p in self.lm.parameters()):
            pyro.module(self.name, self.lm)

    def step_state(self, x: torch.Tensor, n: int) -> LMState:
        """Q(. | x) for ``n`` rows as an :class:`LMState`, decoded segment by segment (SMC)."""
        return LMState.start(self.lm, n, prompt=self.prompt(x), rule=self.token_rule(x), max_len=self.event_length(x))

    def _sample(self, x, n):
        return self.seq(x).sample_with_log_prob((n,))

    def _log_prob(self, z, x):
        return self.seq(x).log_prob(z)

    def _token_log_probs(self, z, x):
        return self.seq(x).step_log_probs(z)[0]


class Causal(_LMSampler):
    """The causal sampler of (3.33), Def 3.8: ``LMSequence(lm, constraint=projection.lifting(x))``.

    The LM reads only the latent prefix; the masked softmax at each step renormalises over the
    tokens admissible in the lifting, so the segment that produces x_t depends on x_t (unlike
    :class:`~.Predictive`) but not on x_>t.
    """

    def __init__(self, lm: nn.Module, projection: Projection, name: str = "causal_lm"):
        super().__init__(lm, projection, name)


class Explanatory(_LMSampler):
    """The explanatory sampler of Section 5.6.2 (Def 3.9): prompt ``x <explain> [mode_tag]``, then
    z decoded under the lifting automaton of x (Fig 5.5), so each token of z may depend on all of x.

    Args:
        lm: any LM over the projection's vocabulary (it may be the prior itself: the same
            network plays P_f on the prompt z and the sampler on "x <explain> z", Section 5.3).
        mode_tag: an extra special token (e.g. ``"<infer>"`` / ``"<train>"``, Fig 5.2) put right after
            ``<explain>`` (where Fig 5.2 writes "Inference/Train mode") so two samplers share one LM.
        gating: ``True`` wraps ``lm`` in :class:`GatedLM` (App. L) for finetuning a plain LM; or
            pass a ready :class:`GatedLM`. With gating the sampler starts close to the LM reading z
            alone and learns to use x through the gate.
    """

    def __init__(self, lm: nn.Module, projection: Projection, mode_tag: str | None = None,
                 gating: bool | GatedLM = False, name: str = "explanatory_lm"):
        if gating is True:
            lm = GatedLM(lm)
        elif isinstance(gating, GatedLM):
            lm = gating
        super().__init__(lm, projection, name)
        v = projection.vocab
        self.mode_tag = mode_tag
        self._tag: list[int] = []
        if mode_tag is not None:
            if mode_tag not in v.specials:
                raise UnknownTokenError(
                    f"mode tag {mode_tag!r} must be an extra special of the vocabulary (Vocab(..., "
                    f"specials=DEFAULT + ({mode_tag!r},))); specials are {list(v.specials)}"
                )
            self._tag = [v.id(mode_tag)]

    def prompt(self, x: torch.Tensor) -> torch.Tensor:
        """``x <explain> [mode_tag]`` (Section 5.6.2; the tag after ``<explain>`` as in Fig 5.2)."""
        return torch.cat([x.long(), torch.tensor([EXPLAIN_ID] + self._tag, dtype=torch.long, device=x.device)])


# ---------------------------------------------------------------------- gating (App. L)
@dataclass
class GatedCache:
    """Caches of the slow stream (full input) and the fast stream (after ``<explain>``)."""

    slow: object
    fast: object | None
    length: int

    @property
    def batch_size(self) -> int:
        return self.slow.batch_size

    def reorder(self, index: torch.Tensor) -> GatedCache:
        return GatedCache(self.slow.reorder(index), self.fast.reorder(index) if self.fast is not None else None,
                          self.length)

    def expand(self, n: int) -> GatedCache:
        return GatedCache(self.slow.expand(n), self.fast.expand(n) if self.fast is not None else None, self.length)


def gate_mlp(d: int) -> nn.Module:
    """The gate MLP of (L.2): 3 layers with SiLU, 2d -> 2d -> 2d -> 2 (logits of p_fast, p_slow), the last
    layer with weight 0 and bias [2, -2], so p_slow = sigmoid(-4) < 0.02 at initialisation."""
    mlp = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.SiLU(), nn.Linear(2 * d, 2 * d), nn.SiLU(), nn.Linear(2 * d, 2))
    nn.init.zeros_(mlp[-1].weight)
    with torch.no_grad():
        mlp[-1].bias.copy_(torch.tensor([2.0, -2.0]))
    return mlp


class GatedLM(nn.Module):
    """The gating trick of App. L around any LM f, for finetuning it into an explanatory sampler.

    On an input ``<bos> c <explain> z`` the *slow* stream is f on the whole input and the *fast*
    stream is f on ``<bos> z`` (the format without the explanatory context c = x; a mode tag
    right after ``<explain>`` stays in both streams).
    After ``<explain>`` the logits are (L.1)

        p_fast * f_post(fast) + p_slow * f_post(slow),
        [p_fast, p_slow] = softmax(MLP(f_pre(fast) (+) f_pre(slow)))                     (L.2)

    with a 3-layer SiLU MLP (input 2d, hidden 2d, output 2) whose last layer has weight 0 and
    bias [2, -2], so p_slow = sigmoid(-4) < 0.02 at initialisation and the sampler starts as the
    LM reading z alone. f_pre is ``features(tokens)`` if given (the features before the
    unembedding; our LM protocol does not expose them), otherwise the log-softmax of the
    logits (d = vocab_size). Inputs without ``<explain>`` pass through to f unchanged (the LM
    playing P_f). The ``<explain>`` token must sit at the same position in every row.
    """

    def __init__(self, lm: nn.Module, features: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 feature_dim: int | None = None, explain_id: int = EXPLAIN_ID):
        super().__init__()
        self.lm = lm
        self.vocab_size = int(lm.vocab_size)
        self.features = features
        d = int(feature_dim) if feature_dim is not None else self.vocab_size
        self.explain_id = explain_id
        self.gate = gate_mlp(d)

    def _pre(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.features is not None:
            return self.features(tokens)
        return torch.log_softmax(logits.float().masked_fill(torch.isneginf(logits), -1e9), -1)

    def gates(self, pre_fast: torch.Tensor, pre_slow: torch.Tensor) -> torch.Tensor:
        """``[..., 2]`` = (p_fast, p_slow) of (L.2)."""
        return torch.softmax(self.gate(torch.cat([pre_fast, pre_slow], -1)), -1)

    def _mix(self, fast_tokens, fast_logits, slow_tokens, slow_logits):
        g = self.gates(self._pre(fast_tokens, fast_logits), self._pre(slow_tokens, slow_logits))
        pf, ps = g[..., :1], g[..., 1:]
        # (L.1) mixes logits; a -inf logit in either stream stays -inf (never NaN)
        neg = torch.isneginf(fast_logits) | torch.isneginf(slow_logits)
        mixed = pf * fast_logits.masked_fill(neg, 0.0) + ps * slow_logits.masked_fill(neg, 0.0)
        return mixed.masked_fill(neg, float("-inf"))

    def forward(self, tokens: torch.Tensor, cache: GatedCache | None = None):
        B, T = tokens.shape
        slow_logits, slow_cache = self.lm(tokens, cache=cache.slow if cache is not None else None)
        start = cache.length if cache is not None else 0
        if cache is not None and cache.fast is not None:  # the fast stream is running
            fast_logits, fast_cache = self.lm(tokens, cache=cache.fast)
            out = self._mix(tokens, fast_logits, tokens, slow_logits)
            return out, GatedCache(slow_cache, fast_cache, start + T)
        hit = tokens == self.explain_id
        if not hit.any():
            return slow_logits, GatedCache(slow_cache, None, start + T)
        pos = hit.float().argmax(-1)
        if not (pos == pos[0]).all() or not hit.any(-1).all():
            raise ValueError("GatedLM: <explain> must sit at the same position in every row")
        e = int(pos[0])
        fast_in = torch.cat([torch.full((B, 1), BOS_ID, dtype=torch.long, device=tokens.device),
                             tokens[:, e + 1:]], 1)
        fast_logits, fast_cache = self.lm(fast_in)
        out = slow_logits.clone()
        out[:, e:] = self._mix(fast_in, fast_logits, tokens[:, e:], slow_logits[:, e:])
        return out, GatedCache(slow_cache, fast_cache, start + T)


# ---------------------------------------------------------------------- program view
def explanatory_guide(
    lm: nn.Module,
    site: str,
    *,
    vocab: Vocab,
    observed: int | str = -1,
    context: int | str | None = 0,
    stop: str | int | None = "</s>",
    max_len: int = 16,
    mode_tag: str | None = None,
    name: str = "explanatory_lm",
) -> Callable:
    """Turn any LM into an explanatory guide for the LMSequence site ``site`` of a user program.

    The returned ``guide(*args, **kwargs)`` takes the program's own arguments, reads the
    observed answer (argument ``observed``: a position or a keyword name) and the context
    (argument ``context``, e.g. the question, or None) and samples ``site`` from
    ``LMSequence(lm, prompt=answer <explain> [mode_tag] context, stop=stop, max_len=max_len)``:
    the format "x <explain> z" of Section 5.6.2 with z continuing the context, so the thought may
    read the answer it explains (Def 3.9, Example 5.1). Batched prompts (``[n, P]`` padded) work.
    """
    tag = [vocab.id(mode_tag)] if mode_tag is not None else []

    def _arg(args, kwargs, key):
        if isinstance(key, str):
            if key not in kwargs:
                raise TypeError(f"explanatory_guide: keyword argument {key!r} is missing")
            return kwargs[key]
        try:
            return args[key]
        except IndexError:
            raise TypeError(f"explanatory_guide: positional argument {key} is missing") from None

    def _ids(t):
        if isinstance(t, str) or (isinstance(t, (list, tuple)) and t and isinstance(t[0], str)):
            return torch.tensor(vocab.encode(t), dtype=torch.long, device=lm_device(lm))
        return torch.as_tensor(t, dtype=torch.long, device=lm_device(lm))

    def guide(*args, **kwargs):
        raw = _arg(args, kwargs, observed)
        if raw is None:
            raise ValueError(
                f"explanatory_guide: the observed answer (argument {observed!r}) is None, but an explanatory guide "
                "reads it (Def 3.9). Pass it, e.g. pyro.infer.Predictive(model, guide=guide, ...)(question, answer); "
                "to generate answers use Predictive(model) without this guide")
        ans = _ids(raw)
        parts = [ans, torch.tensor([EXPLAIN_ID] + tag, dtype=torch.long, device=ans.device)]
        if context is not None:
            parts.append(_ids(_arg(args, kwargs, context)))
        prompt = concat(*parts)
        if any(p.requires_grad for p in lm.parameters()):
            pyro.module(name, lm)
        return pyro.sample(site, LMSequence(lm, prompt=prompt, stop=stop, max_len=max_len, vocab=vocab))

    return guide
