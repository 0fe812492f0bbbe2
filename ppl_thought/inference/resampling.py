"""The one home of resampling and of the log-weight algebra every torch engine uses (docs/architecture.md,
"Engines").

* :func:`resample`: ancestor indices from normalised weights, four unbiased schemes (multinomial,
  stratified, systematic, residual), batched over groups ``[G, n]``;
* :func:`ancestors`: the same from *log* weights (softmax in float64 first);
* :func:`resample_groups`: one adaptive-resampling move of SMC over G groups of n particles: the groups
  that need it draw ancestors within their own rows and their weights become their mean weight, so
  prod_t of the mean incremental weights stays Z-hat ((2.22) unbiased). ``need`` is a host list (the
  generic engine: only those groups draw) or a bool tensor ``[G]`` decided on the device (the static
  engine: every group draws, ``torch.where`` keeps the others; no host sync);
* :func:`log_ratio`: log w = log p - log q, -inf (never NaN) where p = 0: the weights of (3.2), (3.14),
  Algorithm 2 and every step of SMC;
* :func:`log_mean_exp` (estimator (3.2)) and :func:`effective_sample_size`, defined once in
  :mod:`ppl_thought.weights` (the lowest torch layer, so that models can average weights too) and
  re-exported here.

No other module draws ancestor indices (``tests/test_layout.py`` checks it). The JAX backend has its own
copy in :mod:`ppl_thought.numpyro.infer.resampling`: the two sides import without each other.
"""

from __future__ import annotations

import torch

from ppl_thought.errors import ConfigError
from ppl_thought.validation import checked
from ppl_thought.weights import effective_sample_size, log_mean_exp

__all__ = ["RESAMPLING", "ancestors", "effective_sample_size", "log_mean_exp", "log_ratio", "resample",
           "resample_groups"]

#: the resampling schemes; each has E[#offspring_i] = n * w_i
RESAMPLING = ("multinomial", "stratified", "systematic", "residual")


def check_scheme(method: str) -> str:
    """``method`` if it names a scheme, else a :class:`~ppl_thought.errors.ConfigError` listing them."""
    if not isinstance(method, str) or method not in RESAMPLING:
        raise ConfigError(f"unknown resampling scheme {method!r}; choose one of {RESAMPLING}")
    return method


def log_ratio(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """log w = log p - log q with -inf (never NaN) where p = 0: the importance weight of (3.2) / (3.14)."""
    return torch.where(torch.isneginf(log_p), torch.full_like(log_p, float("-inf")), log_p - log_q)


def _uniforms(method: str, shape: tuple[int, ...], m: int, generator, device) -> torch.Tensor:
    """The sorted (stratified, systematic) or independent (multinomial) uniforms of a scheme, last dim ``m``."""
    ar = torch.arange(m, dtype=torch.float64, device=device)
    if method == "stratified":
        return (ar + torch.rand(*shape, m, generator=generator, dtype=torch.float64, device=device)) / m
    if method == "systematic":
        return (ar + torch.rand(*shape, 1, generator=generator, dtype=torch.float64, device=device)) / m
    return torch.rand(*shape, m, generator=generator, dtype=torch.float64, device=device)


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices i with CDF_{i-1} < u <= CDF_i (float64 CDF, its last entry set to 1), row by row."""
    cdf = torch.cumsum(w, -1)
    cdf[..., -1:].fill_(1.0)
    return torch.searchsorted(cdf, u).clamp(max=w.shape[-1] - 1)


@checked
def resample(weights: torch.Tensor, method: str = "systematic", generator: torch.Generator | None = None,
             size: int | None = None, inverse_cdf: bool = False) -> torch.Tensor:
    """Ancestor indices ``[size]`` (default ``n``) from normalised weights ``[n]`` (each scheme has
    E[#offspring_i] = size * w_i; systematic and stratified indices come out in particle order).

    Weights ``[G, n]`` (G groups, one resampling each, batched: one ``searchsorted`` / ``multinomial``
    for all groups; residual loops over them) give indices ``[G, size]`` into each group's own row
    (``size=1``: one particle chosen per group, e.g. the (3.14) choice of decoding).

    ``inverse_cdf=True`` draws multinomial ancestors by inverse CDF of independent uniforms instead of
    ``torch.multinomial`` (same law; fixed shapes and no host sync, for a captured step).

    Device-generic: the uniforms are drawn on the weights' device (from ``generator``, or that device's
    default generator), so no index leaves the device; a ``generator`` on another device (a CPU generator
    for CUDA weights) draws there and the indices are moved to the weights' device.
    """
    check_scheme(method)
    if generator is not None and generator.device.type != weights.device.type:
        return resample(weights.to(generator.device), method, generator, size, inverse_cdf).to(weights.device)
    if weights.ndim not in (1, 2):
        raise ConfigError(f"resample takes weights [n] or [groups, n], got shape {tuple(weights.shape)}")
    n = weights.shape[-1]
    m = n if size is None else int(size)
    dev = weights.device
    w = weights.double()
    w = w / w.sum(-1, keepdim=True)
    if method == "multinomial" and not inverse_cdf:
        return torch.multinomial(w, m, replacement=True, generator=generator)
    if method == "residual":
        if w.ndim == 2:
            return torch.stack([resample(w[g], method, generator, m) for g in range(w.shape[0])])
        counts = torch.floor(m * w).long()
        rest = m - int(counts.sum())  # one host sync per residual resampling
        base = torch.repeat_interleave(torch.arange(n, device=dev), counts)
        if rest == 0:
            return base
        res = m * w - counts
        extra = torch.multinomial(res / res.sum(), rest, replacement=True, generator=generator)
        return torch.cat([base, extra])
    return _inverse_cdf(w, _uniforms(method, tuple(w.shape[:-1]), m, generator, dev))


def ancestors(log_weights: torch.Tensor, method: str = "systematic", generator: torch.Generator | None = None,
              inverse_cdf: bool = False, size: int | None = None) -> torch.Tensor:
    """:func:`resample` from log weights ``[n]`` or ``[G, n]`` (softmax, then normalised again in float64)."""
    return resample(torch.softmax(log_weights, -1), method, generator, size, inverse_cdf)


def resample_groups(log_weights: torch.Tensor, need, num_groups: int, method: str = "systematic",
                    generator: torch.Generator | None = None,
                    inverse_cdf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One adaptive-resampling move over ``num_groups`` groups of ``n`` particles (rows ``g*n .. g*n+n-1``).

    Args:
        log_weights: ``[G * n]``.
        need: which groups resample: a list of G bools (host: only those groups draw uniforms) or a bool
            tensor ``[G]`` (device: every group draws, :func:`torch.where` keeps the groups that do not
            resample; no host sync, fixed shapes).
    Returns:
        global ancestor indices ``[G * n]`` (identity in the groups that do not resample) and the new log
        weights ``[G * n]`` (a resampled group's weights all equal its mean weight, so its product of mean
        incremental weights, Z-hat, is unchanged in expectation).
    """
    G = int(num_groups)
    N = log_weights.shape[0]
    n = N // G
    dev = log_weights.device
    lwg = log_weights.view(G, n)
    offsets = (torch.arange(G, device=dev) * n)[:, None]
    if isinstance(need, torch.Tensor):
        local = ancestors(lwg, method, generator, inverse_cdf).to(dev)
        ident = torch.arange(n, device=dev).expand(G, n)
        m = need.to(dev).reshape(G, 1)
        idx = torch.where(m, local, ident) + offsets
        new = torch.where(m, log_mean_exp(lwg)[:, None].expand(G, n), lwg)
        return idx.reshape(N), new.reshape(N)
    need = [bool(x) for x in need]
    if not any(need):
        return torch.arange(N, device=dev), log_weights.clone()
    if G == 1:  # one group: the 1-d draw
        local = ancestors(log_weights, method, generator, inverse_cdf).to(dev)
        return local, log_mean_exp(log_weights).expand(N).clone()
    if all(need):
        local = ancestors(lwg, method, generator, inverse_cdf).to(dev)
        return (local + offsets).reshape(N), log_mean_exp(lwg)[:, None].expand(G, n).reshape(N).clone()
    sel = torch.tensor([g for g in range(G) if need[g]], dtype=torch.long, device=dev)
    local = ancestors(lwg[sel], method, generator, inverse_cdf).to(dev)
    idx = torch.arange(N, device=dev).view(G, n).clone()
    idx[sel] = local + sel[:, None] * n
    new = lwg.clone()
    new[sel] = log_mean_exp(lwg[sel])[:, None].expand(-1, n)
    return idx.view(N), new.view(N)
