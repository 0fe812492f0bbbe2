"""Sites scored without torch's clamp on ``probs=`` (issue 41, item 6).

torch turns a ``probs=`` parametrisation into logits with ``probs_to_logits``, which clamps the probabilities to
``[eps, 1 - eps]`` (eps = 1.19e-7 in float32): ``Categorical(probs=p).log_prob(v)`` gives log(eps) = -15.94 for
p_v = 1.29e-12, where log p_v = -27.38, and -15.94 (not -inf) for p_v = 0. NumPyro does not clamp, so a peer's
model translated literally is silently wrong (the HMM of tests/test_numeric_edges.py: log Z off by tens of nats).

:func:`unclamped` is what the verbs ``pt.sample`` / ``pt.observe`` do with a site's distribution: a
``Categorical``, ``OneHotCategorical`` or ``Bernoulli`` built with ``probs=`` (alone, expanded, or under
``Independent``) is scored exactly, log p_v = log(probs[v]) (the same law and samples; its class is a subclass
whose ``log_prob`` reads ``probs`` without the clamp); another distribution that clamps ``probs=`` (``Binomial``,
``Geometric``, ``NegativeBinomial``, ``Multinomial``) is passed on with a warning naming the site, once per site.
No host synchronisation: the rule reads the parametrisation, never the values.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch.distributions import Bernoulli, Categorical, Independent, OneHotCategorical

__all__ = ["unclamped"]

#: distributions whose log_prob goes through torch's clamped probs_to_logits when built with probs= and that have
#: no exact form here: flagged once per site
_FLAGGED = tuple(getattr(torch.distributions, n) for n in ("Binomial", "Geometric", "NegativeBinomial",
                                                           "Multinomial"))
_EXACT: dict[type, type] = {}
_WARNED: set[str] = set()


def _categorical_log_prob(self, value: torch.Tensor) -> torch.Tensor:
    """log p_v = log probs[v], exact: -inf for p_v = 0, log(1.29e-12) = -27.38 (not the clamp's -15.94)."""
    if self._validate_args:
        self._validate_sample(value)
    value = value.long().unsqueeze(-1)
    value, probs = torch.broadcast_tensors(value, self.probs)
    return probs.gather(-1, value[..., :1]).squeeze(-1).log()


def _one_hot_log_prob(self, value: torch.Tensor) -> torch.Tensor:
    if self._validate_args:
        self._validate_sample(value)
    logp = self.probs.log()
    return torch.where(value > 0, value * logp, torch.zeros_like(logp)).sum(-1)


def _bernoulli_log_prob(self, value: torch.Tensor) -> torch.Tensor:
    """log p for value 1, log(1 - p) for value 0, exact (log1p): -inf where the value has probability 0."""
    if self._validate_args:
        self._validate_sample(value)
    value, probs = torch.broadcast_tensors(value, self.probs)
    return torch.where(value > 0, probs.log(), torch.log1p(-probs))


_LOG_PROBS = ((OneHotCategorical, _one_hot_log_prob), (Categorical, _categorical_log_prob),
              (Bernoulli, _bernoulli_log_prob))


def _exact_class(cls: type) -> type | None:
    sub = _EXACT.get(cls)
    if sub is None and cls not in _EXACT:
        for base, log_prob in _LOG_PROBS:
            if issubclass(cls, base):
                sub = type(f"Unclamped{cls.__name__}", (cls,), {"log_prob": log_prob, "__module__": __name__})
                break
        _EXACT[cls] = sub
    return sub


def _by_probs(fn) -> bool:
    """Built with ``probs=`` (torch keeps the given parameter as ``_param``; the other one is computed lazily)."""
    if isinstance(fn, OneHotCategorical):  # its law is the Categorical it holds
        return _by_probs(fn._categorical)
    d = fn.__dict__
    if "_param" in d:
        return d["_param"] is d.get("probs")
    return "probs" in d and "logits" not in d


def unclamped(fn, site: str):
    """``fn`` scored exactly where torch would clamp its ``probs=`` (see the module docstring), else ``fn``
    itself; a clamping distribution with no exact form here is returned with a warning naming ``site`` (once)."""
    if isinstance(fn, Independent):
        inner = unclamped(fn.base_dist, site)
        if inner is fn.base_dist:
            return fn
        out = copy.copy(fn)
        out.base_dist = inner
        return out
    if not isinstance(fn, (Categorical, Bernoulli, OneHotCategorical, *_FLAGGED)) or not _by_probs(fn):
        return fn
    sub = _exact_class(type(fn))
    if sub is None:
        if site not in _WARNED:
            _WARNED.add(site)
            warnings.warn(f"site {site!r}: {type(fn).__name__}(probs=...) is scored by torch with the probabilities "
                          "clamped to [1.19e-7, 1 - 1.19e-7] (float32 eps): a smaller probability gets log 1.19e-7 = "
                          "-15.9 instead of its own log; build it with logits= (e.g. logits=probs.log()) to score it "
                          "exactly", stacklevel=3)
        return fn
    out = copy.copy(fn)
    out.__class__ = sub
    return out
