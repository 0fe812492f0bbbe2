"""The projection Proj: Omega^w -> Sigma^w of the static theory (Section 2.6) on finite sequences.

A concrete projection supplies three things: ``_project_one`` (the prefix projection
Proj^{<w} of Def 2.6 on a latent string in its domain), ``domain`` (an automaton for
Dom(Proj^{<w}), whose masks are the admissible next tokens Phi^{<=1} of (2.26)) and ``lifting``
(an automaton that accepts exactly Proj^{-1}_{<w}(x), Prop 2.3). Everything else here is
derived from those: batching, enumeration, the segment decomposition of Lemma 2.1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ppl_thought import checks
from ppl_thought.errors import MalformedSequenceError, NotInDomainError, NotInImageError
from ppl_thought.projections.arrays import host_array
from ppl_thought.projections.automaton import Automaton
from ppl_thought.validation import ArrayLike, checked
from ppl_thought.vocab import Vocab


def as_id_array(seq, vocab: Vocab, what: str = "sequence", unpad: bool = False) -> np.ndarray:
    """A 1-D int64 array of ids from a string, a list of token strings or ids, an array or a tensor.

    ``unpad=True`` drops right padding (``<pad>`` at the end): a padded row means its tokens (the models'
    and guides' observations); by default every id is kept.
    """
    if isinstance(seq, str):
        a = np.asarray(vocab.encode(seq), dtype=np.int64)
    elif isinstance(seq, (list, tuple)) and seq and isinstance(seq[0], str):
        a = np.asarray(vocab.encode(list(seq)), dtype=np.int64)
    else:
        try:
            a = np.asarray(host_array(seq))
        except (TypeError, ValueError):  # ragged nested lists, objects numpy cannot hold
            raise MalformedSequenceError(f"{what} must be a 1-D array of integer ids, got {seq!r}"[:300]) from None
        if a.size == 0:
            return np.zeros(0, dtype=np.int64)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise MalformedSequenceError(
                f"{what} must be a 1-D array of integer ids, got shape {a.shape} {a.dtype}"
            )
        vocab.check_ids(a, what)
        a = a.astype(np.int64)
    if unpad:
        real = np.flatnonzero(a != vocab.pad_id)
        a = a[: real[-1] + 1] if real.size else a[:0]
    return a


@checked
class Projection(ABC):
    """Base class of projections (Section 2.6). Subclasses set ``is_disentangled`` (Def 3.5)."""

    #: Def 3.5: the next-segment map Phi_x(z, a) depends only on the observable context x.
    is_disentangled: bool = True

    def __init__(self, vocab: Vocab):
        checks.instance(f"{type(self).__name__}: vocab", vocab, Vocab, "a pt.Vocab")
        self.vocab = vocab

    # ------------------------------------------------------------ what subclasses implement
    @abstractmethod
    def _project_one(self, z: np.ndarray) -> np.ndarray:
        """Proj^{<w}(z) for one latent string z in Dom(Proj^{<w}); raise NotInDomainError otherwise."""

    @abstractmethod
    def domain(self, num_observed: int | None = None) -> Automaton:
        """An automaton for Dom(Proj^{<w}) whose masks give Phi^{<=1} of (2.26) (Def 2.8).

        With ``num_observed = n`` its final states are the latent prefixes that have just
        determined n observable tokens: the strings it accepts are exactly the union of the
        liftings of all x in Sigma^n, so sampling the masked prior until a final state draws z
        with probability P^{<=|z|}(z) and Proj^{<w}(z) ~ (Proj # P)^{<=n} ((2.22)).

        With ``num_observed=None`` the automaton has no final state and ``max_len`` is None; a
        finite automaton cannot count the observables of unbounded strings, so its ``emitted``
        is 0 throughout (use ``num_observed=n`` for the counts).
        """

    @abstractmethod
    def _lifting(self, x: np.ndarray) -> Automaton:
        """The lifting automaton of a validated observable string x."""

    # ------------------------------------------------------------ observable / latent sets
    @property
    def observable_ids(self) -> np.ndarray:
        """Sigma as token ids."""
        return self.vocab.observable_ids

    @property
    def latent_ids(self) -> np.ndarray:
        """Omega as token ids."""
        return self.vocab.latent_ids

    # ------------------------------------------------------------ derived API
    def lifting(self, x: ArrayLike) -> Automaton:
        """An automaton accepting exactly Proj^{-1}_{<w}(x) (Prop 2.3, Def 2.3).

        Raises :class:`NotInImageError` when x contains a non-observable token or is otherwise
        outside the image of Proj (its lifting would be empty).
        """
        xa = as_id_array(x, self.vocab, "observation x")
        bad = ~np.isin(xa, self.observable_ids)
        if bad.any():
            toks = [self.vocab.token(int(i)) for i in xa[bad][:5]]
            sigma = [self.vocab.token(int(i)) for i in self.observable_ids[:12]]
            more = ", ..." if len(self.observable_ids) > 12 else ""
            raise NotInImageError(
                f"observation x contains non-observable tokens {toks}; the observable vocabulary Sigma of "
                f"{type(self).__name__} is {sigma}{more}"
            )
        key = xa.tobytes()
        cache = self.__dict__.setdefault("_lifting_cache", {})
        auto = cache.get(key)
        if auto is None:
            self._check_image(xa)
            auto = self._lifting(xa)
            if len(cache) >= 512:  # liftings are immutable: keep the recent ones (and their device tables)
                cache.clear()
            cache[key] = auto
        return auto

    def _check_image(self, x: np.ndarray) -> None:  # noqa: B027 (optional hook)
        """Raise NotInImageError if x is not a prefix of any sequence in the image of Proj."""

    def project(self, z: ArrayLike | int | float):  # a scalar: the rows of a list batch reach as_id_array's message
        """Proj^{<w}(z) (Def 2.6), batched.

        ``z`` is one latent string (1-D ids, a string, or token strings) -> 1-D int64 array; or a
        batch: a 2-D array/tensor padded with ``<pad>`` on the right, or a list of 1-D strings ->
        a list of 1-D arrays. Raises :class:`NotInDomainError` for a string outside Dom(Proj^{<w}).
        """
        a = host_array(z)
        if isinstance(a, np.ndarray) and a.ndim == 2:
            return [self.project(row[row != self.vocab.pad_id]) for row in a]
        if isinstance(z, list) and z and not isinstance(z[0], (str, int, np.integer)):
            return [self.project(row) for row in z]
        za = as_id_array(z, self.vocab, "latent z")
        return self._project_one(za)

    def _check_latent_is_observable(self, z: np.ndarray) -> None:
        """For projections with Omega = Sigma: raise NotInDomainError naming the first latent token that is not."""
        bad = ~np.isin(z, self.observable_ids)
        if bad.any():
            i = int(np.argmax(bad))
            raise NotInDomainError(
                f"{type(self).__name__}: token {self.vocab.token(int(z[i]))!r} at position {i} of z is not in "
                "Omega = Sigma (the ordinary tokens and <eos>)"
            )

    def in_domain(self, z: ArrayLike) -> bool:
        """Whether z is in Dom(Proj^{<w}), i.e. a prefix of some sequence in Dom(Proj)."""
        dom = self.__dict__.get("_prefix_domain")
        if dom is None:  # Dom(Proj^{<w}) does not change (projections are immutable, as the lifting cache assumes)
            dom = self.__dict__["_prefix_domain"] = self.domain()
        return dom.admits_prefix(as_id_array(z, self.vocab, "latent z"))

    def enumerate_lifting(self, x: ArrayLike, limit: int = 100_000) -> list[tuple[int, ...]]:
        """All z in Proj^{-1}_{<w}(x), for small x (TooLargeToEnumerateError past ``limit``)."""
        return self.lifting(x).enumerate(limit=limit)

    def segments(self, z: ArrayLike, x: ArrayLike | None = None) -> list[tuple[int, ...]]:
        """The unique decomposition z = z^(1) ... z^(|x|), z^(t) in Phi_{x<t}(z^(<t), x_t) (Lemma 2.1).

        ``x`` defaults to Proj^{<w}(z), truncated to the tokens that z's lifting fixes. A segment
        may be empty when one latent token determines several observable ones (Remark 2.8).
        """
        za = as_id_array(z, self.vocab, "latent z")
        xa = self._project_one(za) if x is None else as_id_array(x, self.vocab, "observation x")
        lift = self.lifting(xa)
        states = lift.run(za)
        if states[-1] < 0 or not lift.final[states[-1]]:
            raise NotInDomainError(
                f"z = {self.vocab.decode(za)!r} is not in the lifting of x = {self.vocab.decode(xa)!r}"
            )
        em = lift.num_emitted(states)  # emitted after each prefix, len(z) + 1 entries
        out: list[tuple[int, ...]] = []
        start = 0
        for t in range(1, len(xa) + 1):
            end = int(np.argmax(em >= t))  # first prefix length that fixes x_t
            end = max(end, start)
            out.append(tuple(int(v) for v in za[start:end]))
            start = end
        if start != len(za):  # trailing tokens belong to the last segment
            out[-1] = out[-1] + tuple(int(v) for v in za[start:])
        return out

    def next_segments(self, x: ArrayLike, z: ArrayLike, a: int, limit: int = 100_000):
        """Phi_x(z, a) of (2.20) by enumeration: the strings s with zs in the lifting of xa."""
        xa = np.concatenate([as_id_array(x, self.vocab), [a]]).astype(np.int64)
        za = tuple(int(v) for v in as_id_array(z, self.vocab))
        n = len(za)
        return sorted(w[n:] for w in self.enumerate_lifting(xa, limit=limit) if w[:n] == za)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.vocab!r})"
