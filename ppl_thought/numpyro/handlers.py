"""NumPyro handlers over LM programs (the torch twin is ppl_thought/transforms): :class:`ProjectionLift`.

``ProjectionLift(projection)`` turns a plain LM program, whose sequence site ``"x"`` is an
:class:`~ppl_thought.numpyro.distributions.LMSequence` over observable tokens, into Proj # P_f (Def 2.8):
the site becomes a latent ``"z" ~ LMSequence(the same LM, constraint=projection.domain(|x|))`` followed by
the observed ``"x" ~ ProjectionDelta(projection, z)``. The lifted program has the sites and the numbers of
``ptn.models.SlowThinking(lm, projection)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpyro
from numpyro.primitives import Messenger

from ppl_thought.errors import ConfigError
from ppl_thought.numpyro.boundary import checked_jax
from ppl_thought.numpyro.distributions import LMSequence, ProjectionDelta
from ppl_thought.projections.base import Projection, as_id_array


@checked_jax
class ProjectionLift(Messenger):
    """Lift the sequence site ``site`` of an LM program through ``projection`` (Proj # P_f, Def 2.8).

    Args:
        fn: the program (or use ``ProjectionLift(projection)(fn)`` / as a context manager).
        projection: a :class:`~ppl_thought.projections.Projection`.
        site: the sequence site to lift (``"x"``); the latent site is ``latent`` (``"z"``).

    The lifted site keeps its observation; its length |x| fixes the domain automaton. Without an observation
    the plain site's ``max_len`` is taken as |x| (generation, outside jit).
    """

    def __init__(self, fn: Callable[..., Any] | Projection | None = None, projection: Projection | None = None,
                 site: str = "x", latent: str = "z"):
        if projection is None and isinstance(fn, Projection):
            fn, projection = None, fn
        if projection is None:
            raise ConfigError(f"ProjectionLift needs a Projection, got {type(projection).__name__}")
        self.projection, self.site, self.latent = projection, site, latent
        self._domains: dict = {}
        super().__init__(fn)

    def process_message(self, msg: dict[str, Any]) -> None:
        if msg["type"] != "sample" or msg["name"] != self.site:
            return
        d = msg["fn"]
        if not isinstance(d, LMSequence):
            raise ConfigError(f"ProjectionLift: site {self.site!r} must be an LMSequence, got {type(d).__name__}")
        if d.constraint is not None:
            raise ConfigError(f"ProjectionLift: site {self.site!r} is already constrained ({d.constraint.name})")
        obs = msg["value"] if msg["is_observed"] else None
        if obs is not None:
            xa = as_id_array(np.asarray(obs), self.projection.vocab, "observation x", unpad=True)
            n = len(xa)
        else:
            xa, n = None, d.max_len
        if n not in self._domains:  # one automaton (and its jnp tables) per |x|
            self._domains[n] = self.projection.domain(n)
        z = numpyro.sample(self.latent, LMSequence(d.lm, prompt=d.prompt, constraint=self._domains[n],
                                                   params=d.params, latents=d.latents))
        msg["fn"] = ProjectionDelta(self.projection, z, n)
        if xa is not None:
            msg["value"] = xa


__all__ = ["ProjectionLift"]
