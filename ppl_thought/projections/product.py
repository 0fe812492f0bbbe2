"""The product-space projection of Example 2.2: Omega = Sigma x Gamma, Proj drops Gamma."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ppl_thought.errors import ConfigError, NotInDomainError, UnknownTokenError, VocabularyError
from ppl_thought.projections.automaton import DEAD
from ppl_thought.projections.base import Projection
from ppl_thought.projections.phase_tables import PhaseMachine, phase_tables
from ppl_thought.validation import checked
from ppl_thought.vocab import EOS, Vocab


@checked
class Product(PhaseMachine, Projection):
    """Ex 2.2: Omega = Sigma x Gamma and Proj: ((x_t, y_t))_t -> (x_t)_t.

    Each latent token is a vocabulary token named ``f"{a}{sep}{g}"`` for an observable token
    ``a`` (a token string, ``"<eos>"`` allowed) and a hidden value ``g`` in Gamma. Dom(Proj) =
    Omega^w, the lifting of x is {((x_t, y_t))_{t<=|x|} : y in Gamma^{|x|}} and the next-segment
    map Phi(z, a) = {(a, y) : y in Gamma} does not depend on z, so Proj is disentangled (Def 3.5).
    Every x in Sigma* is in the image.

    ``Product.build(observable, hidden)`` makes a matching vocabulary.
    """

    is_disentangled = True

    def __init__(self, vocab: Vocab, observable: Sequence[str], hidden: Sequence[str], sep: str = "|"):
        super().__init__(vocab)
        observable, hidden = list(observable), list(hidden)
        _check_names(observable, hidden, sep)
        for a in observable:
            if a in vocab.specials and a != EOS:
                raise VocabularyError(f"Product: observable token {a!r} is a special; use ordinary tokens "
                                 "or <eos>")
        self.observable: list[str] = observable
        self.hidden: list[str] = hidden
        self.sep = sep
        self._obs = np.array([vocab.id(a) for a in observable], dtype=np.int64)
        try:
            pairs = [[vocab.id(f"{a}{sep}{g}") for g in hidden] for a in observable]
            self._pairs = np.array(pairs, dtype=np.int64)
        except UnknownTokenError as e:
            raise UnknownTokenError(f"Product: the vocabulary lacks a pair token ({e}); "
                                    "build it with Product.build(observable, hidden)") from None
        if np.isin(self._pairs, self._obs).any():
            raise VocabularyError("Product: a pair token coincides with an observable token")
        V = len(vocab)
        self._to_obs = np.full(V, DEAD, dtype=np.int64)
        self._to_hidden = np.full(V, DEAD, dtype=np.int64)
        self._to_obs[self._pairs] = self._obs[:, None]
        self._to_hidden[self._pairs] = np.arange(len(hidden))[None, :]
        nxt, em = phase_tables(1, V)
        nxt[0, self._pairs.ravel()] = 0
        em[0, self._pairs.ravel()] = self._to_obs[self._pairs.ravel()]
        self._tables = (nxt, em)

    @classmethod
    def build(cls, observable: list[str], hidden: list[str], sep: str = "|") -> Product:
        """A vocabulary with the observable tokens and every pair token ``a{sep}g``, and the projection."""
        observable, hidden = list(observable), list(hidden)
        _check_names(observable, hidden, sep)
        ordinary = [a for a in observable if a != EOS]
        pairs = [f"{a}{sep}{g}" for a in observable for g in hidden]
        return cls(Vocab(ordinary + pairs), observable, hidden, sep)

    # ------------------------------------------------------------------ vocabularies
    @property
    def observable_ids(self) -> np.ndarray:
        """Sigma: the ids of the observable tokens, in the order given."""
        return self._obs.copy()

    @property
    def latent_ids(self) -> np.ndarray:
        """Omega = Sigma x Gamma: the ids of the pair tokens, observable-major."""
        return self._pairs.ravel().copy()

    @property
    def latent_to_observable(self) -> np.ndarray:
        """int64 ``[V]``: the observable id of each pair token (``-1`` for other ids)."""
        return self._to_obs.copy()

    @property
    def latent_to_hidden(self) -> np.ndarray:
        """int64 ``[V]``: the index in ``hidden`` of each pair token (``-1`` for other ids)."""
        return self._to_hidden.copy()

    @property
    def pair_table(self) -> np.ndarray:
        """int64 ``[|Sigma|, |Gamma|]``: the id of the latent token (a, g), observable index by hidden index."""
        return self._pairs

    def pair_id(self, a: str | int, g: str | int) -> int:
        """The id of the latent token (a, g); ``a`` a token string or id, ``g`` a hidden value or index."""
        ai = self.vocab.id(a) if isinstance(a, str) else int(a)
        rows = np.nonzero(self._obs == ai)[0]
        if rows.size == 0:
            raise UnknownTokenError(f"Product: {a!r} is not an observable token; Sigma = {self.observable}")
        if isinstance(g, str):
            if g not in self.hidden:
                raise UnknownTokenError(f"Product: {g!r} is not a hidden value; Gamma = {self.hidden}")
            gi = self.hidden.index(g)
        else:
            gi = int(g)
            if not 0 <= gi < len(self.hidden):
                raise UnknownTokenError(f"Product: hidden index {gi} outside [0, {len(self.hidden)})")
        return int(self._pairs[rows[0], gi])

    # ------------------------------------------------------------------ the projection
    def _project_one(self, z: np.ndarray) -> np.ndarray:
        out = self._to_obs[z]
        if (out < 0).any():
            i = int(np.argmax(out < 0))
            raise NotInDomainError(
                f"Product: token {self.vocab.token(int(z[i]))!r} at position {i} of z is not a pair token "
                f"'a{self.sep}g' (a in Sigma, g in Gamma)"
            )
        return out

    def __repr__(self) -> str:
        return f"Product(Sigma={self.observable}, Gamma={self.hidden}, sep={self.sep!r})"


def _check_names(observable: list[str], hidden: list[str], sep: str) -> None:
    if len(observable) < 2:
        raise ConfigError("Product needs at least two observable tokens (with one, Proj^{<w} of the empty "
                         "string would already be the whole infinite sequence)")
    if len(set(observable)) != len(observable):
        raise VocabularyError(f"Product: observable tokens repeat: {observable}")
    if not hidden or len(set(hidden)) != len(hidden):
        raise VocabularyError(f"Product: hidden values must be non-empty and distinct, got {hidden}")
    if not isinstance(sep, str) or not sep or any(c.isspace() for c in sep):
        raise VocabularyError(f"Product: separator {sep!r} must be a non-empty string without whitespace")
    for g in hidden:
        if not isinstance(g, str) or not g or any(c.isspace() for c in g):
            raise VocabularyError(f"Product: hidden value {g!r} must be a non-empty string without whitespace")
