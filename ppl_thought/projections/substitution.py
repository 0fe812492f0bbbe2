"""The emission substitution of the identity / predictive samplers (3.29)-(3.30): a numpy table both backends
read (ppl_thought.guides.predictive on torch, ppl_thought.numpyro.guides on JAX)."""

from __future__ import annotations

import numpy as np

from ppl_thought.errors import NotDisentangledError
from ppl_thought.projections.base import Projection
from ppl_thought.projections.product import Product
from ppl_thought.validation import checked


@checked
def emission_substitution(projection: Projection) -> np.ndarray:
    """int64 ``[V, V]``: ``sub[v, a]`` is the token that takes the segment slot of the emitting
    token v but emits the observable a (``-1`` if none); the map behind (3.29).

    A projection may define ``emission_substitution()`` itself; otherwise Product pairs (a, y)
    map to (x, y), and for the other disentangled projections the emitting tokens must be the
    observables themselves (checked on ``domain(2)``). Raises :class:`NotDisentangledError`
    for a projection that is not disentangled (Def 3.5), e.g. FirstTokenSwitch (Remark 2.8).
    """
    if not getattr(projection, "is_disentangled", False):
        raise NotDisentangledError(
            f"{type(projection).__name__} is not disentangled (Def 3.5): its next-segment map depends on the "
            "latent prefix, so the identity/predictive samplers (3.30), Def 3.7 are undefined; use Causal, "
            "Explanatory or Posterior"
        )
    hook = getattr(projection, "emission_substitution", None)
    if callable(hook):
        return np.asarray(hook(), dtype=np.int64)
    V = len(projection.vocab)
    sub = np.full((V, V), -1, dtype=np.int64)
    obs = projection.observable_ids
    if isinstance(projection, Product):
        to_obs, to_hid = projection.latent_to_observable, projection.latent_to_hidden
        pairs = projection.latent_ids
        for a_idx, a in enumerate(obs):
            sub[pairs, a] = projection.pair_table[a_idx, to_hid[pairs]]
        assert (to_obs[pairs] >= 0).all()
        return sub
    d = projection.domain(2)
    cur = np.repeat(d.emitted[:, None], V, 1)
    nxt = d.next_state
    emitting = (nxt >= 0) & (np.where(nxt >= 0, d.emitted[np.maximum(nxt, 0)], 0) > cur)
    toks = np.unique(np.nonzero(emitting)[1])
    if not np.isin(toks, obs).all():
        raise NotDisentangledError(
            f"{type(projection).__name__}: emitting tokens are not the observables themselves; define "
            "projection.emission_substitution() -> [V, V] (the map of (3.29)) to use identity/predictive samplers"
        )
    sub[np.ix_(obs, obs)] = np.broadcast_to(obs[None, :], (len(obs), len(obs)))
    return sub
