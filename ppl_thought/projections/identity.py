"""The identity projection of Example 2.1: Omega = Sigma, Proj = id."""

from __future__ import annotations

import numpy as np

from ppl_thought.projections.base import Projection
from ppl_thought.projections.phase_tables import PhaseMachine, phase_tables, set_edges
from ppl_thought.validation import checked
from ppl_thought.vocab import Vocab


@checked
class Identity(PhaseMachine, Projection):
    """Ex 2.1: Omega = Sigma and Proj = id.

    The lifting is ``x -> {x}`` and the next-segment map is Phi_x(z, a) = {a}, so
    (Proj # P)^{<=t}(x_t | x_{<t}) is the classical autoregression (2.25). Every x in Sigma* is
    in the image, and Dom(Proj) = Sigma^w: any observable token is admissible after any prefix.
    """

    is_disentangled = True

    def __init__(self, vocab: Vocab):
        super().__init__(vocab)
        nxt, em = phase_tables(1, len(vocab))
        set_edges(nxt, em, 0, vocab.observable_ids, 0, emitting=True)
        self._tables = (nxt, em)

    @property
    def latent_ids(self) -> np.ndarray:
        """Omega = Sigma (Ex 2.1)."""
        return self.observable_ids

    def _project_one(self, z: np.ndarray) -> np.ndarray:
        self._check_latent_is_observable(z)
        return z.astype(np.int64, copy=True)
