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

import pyro
import torch
from torch import nn

from ppl_thought import checks
from ppl_thought.distributions.lm_sequence import LMSequence, concat
from ppl_thought.distributions.lm_state import LMState, chunk_size
from ppl_thought.errors import ArgumentTypeError, ConfigError, UnknownTokenError
from ppl_thought.guides.base import Sampler
from ppl_thought.lm.base import lm_device
from ppl_thought.lm.gated import GatedLM
from ppl_thought.projections.base import Projection
from ppl_thought.validation import checked
from ppl_thought.vocab import EXPLAIN_ID, Vocab


class _LMSampler(Sampler):
    """A sampler that is an LMSequence under the lifting automaton of x, after a prompt."""

    def __init__(self, lm: nn.Module, projection: Projection, name: str, chunk: int = 0):
        checks.lm(f"{type(self).__name__}: lm", lm)
        checks.has_attributes(f"{type(self).__name__}: projection", projection, ("vocab", "lifting", "domain"),
                              "a pt.projections projection (the model's)")
        if int(lm.vocab_size) != len(projection.vocab):
            raise ConfigError(f"LM vocab_size {lm.vocab_size} != projection vocabulary size {len(projection.vocab)}")
        self.lm = lm
        self.projection = projection
        self.name = name
        self.chunk = chunk_size(chunk)

    def prompt(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long, device=x.device)

    def seq(self, x: torch.Tensor) -> LMSequence:
        """Q(. | x) as an :class:`LMSequence` (masked, batched, KV-cached)."""
        lift = self.lifting(x)
        return LMSequence(self.lm, prompt=self.prompt(x), constraint=lift, max_len=self.event_length(x),
                          vocab=self.projection.vocab, chunk=self.chunk)

    def _register(self) -> None:
        if any(p.requires_grad for p in self.lm.parameters()):
            pyro.module(self.name, self.lm)

    def step_state(self, x: torch.Tensor, n: int) -> LMState:
        """Q(. | x) for ``n`` rows as an :class:`LMState`, decoded segment by segment (SMC)."""
        return LMState.start(self.lm, n, prompt=self.prompt(x), rule=self.token_rule(x), max_len=self.event_length(x),
                             chunk=self.chunk)

    def _sample(self, x, n):
        return self.seq(x).sample_with_log_prob((n,))

    def _log_prob(self, z, x):
        return self.seq(x).log_prob(z)

    def _token_log_probs(self, z, x):
        return self.seq(x).step_log_probs(z)[0]


@checked
class Causal(_LMSampler):
    """The causal sampler of (3.33), Def 3.8: ``LMSequence(lm, constraint=projection.lifting(x))``.

    The LM reads only the latent prefix; the masked softmax at each step renormalises over the
    tokens admissible in the lifting, so the segment that produces x_t depends on x_t (unlike
    :class:`~.Predictive`) but not on x_>t. ``chunk > 0``: chunked encoding of the forced tokens (see
    :class:`Explanatory`).
    """

    def __init__(self, lm: nn.Module, projection: Projection, name: str = "causal_lm", chunk: int = 0):
        super().__init__(lm, projection, name, chunk)


@checked
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
        chunk: chunked encoding (end of 5.6.2): runs of up to ``chunk`` forced tokens (the text between sparse
            thoughts) are fed to the LM in one pass when sampling (:class:`~ppl_thought.distributions.LMState`);
            same samples and log Q as token by token (``chunk=0``, the default).
    """

    def __init__(self, lm: nn.Module, projection: Projection, mode_tag: str | None = None,
                 gating: bool | GatedLM = False, name: str = "explanatory_lm", chunk: int = 0):
        if gating is True:
            lm = GatedLM(lm)
        elif isinstance(gating, GatedLM):
            lm = gating
        super().__init__(lm, projection, name, chunk)
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


# ---------------------------------------------------------------------- program view
@checked
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
                raise ArgumentTypeError(f"explanatory_guide: keyword argument {key!r} is missing")
            return kwargs[key]
        try:
            return args[key]
        except IndexError:
            raise ArgumentTypeError(f"explanatory_guide: positional argument {key} is missing") from None

    def _ids(t):
        if isinstance(t, str) or (isinstance(t, (list, tuple)) and t and isinstance(t[0], str)):
            return torch.tensor(vocab.encode(t), dtype=torch.long, device=lm_device(lm))
        return torch.as_tensor(t, dtype=torch.long, device=lm_device(lm))

    def guide(*args, **kwargs):
        raw = _arg(args, kwargs, observed)
        if raw is None:
            raise ConfigError(
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
