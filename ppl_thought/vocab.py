"""Token strings <-> ids with the reserved specials of the static theory (Sections 2.2, 2.4, 5.1).

Observable vocabulary Sigma = the ordinary tokens plus ``<eos>``; latent vocabulary
Omega = Sigma plus ``<s>`` and ``</s>`` (Ex 2.3, (5.1)). ``<bos>`` is context only and is
never generated; ``<pad>`` fills padded token arrays; ``<explain>`` separates the observation
from the thought in the explanatory format "x <explain> z" (Section 5.6.2, Fig 5.5).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ppl_thought.errors import MalformedSequenceError, UnknownTokenError, VocabularyError

PAD, BOS, EOS, THINK, END_THINK, EXPLAIN = "<pad>", "<bos>", "<eos>", "<s>", "</s>", "<explain>"
RESERVED: tuple[str, ...] = (PAD, BOS, EOS, THINK, END_THINK, EXPLAIN)
DEFAULT: tuple[str, ...] = RESERVED
#: the ids of the reserved specials, the same in every Vocab (the one home of these numbers)
PAD_ID, BOS_ID, EOS_ID, THINK_ID, END_THINK_ID, EXPLAIN_ID = range(len(RESERVED))


class Vocab:
    """A vocabulary: reserved specials first (ids 0..5), then extra specials, then ordinary tokens.

    ``Vocab(["a", "b"])`` has ids ``<pad>=0 <bos>=1 <eos>=2 <s>=3 </s>=4 <explain>=5 a=6 b=7``.
    Extra specials (``specials=DEFAULT + ("<q>",)``) are neither observable nor latent tokens:
    they are context markers such as mode tags (Fig 5.2).

    Strings are encoded by splitting on whitespace and then matching the longest token at each
    position, so ``"ab<s>c</s>"`` works for a character vocabulary and ``"the cat"`` for a word one.
    """

    def __init__(self, tokens: Iterable[str], specials: Sequence[str] = DEFAULT):
        tokens = list(tokens)
        specials = list(specials)
        for sp in specials:
            if not isinstance(sp, str) or not sp or any(c.isspace() for c in sp):
                raise VocabularyError(f"special token {sp!r} must be a non-empty string without whitespace")
        dup = sorted({sp for sp in specials if specials.count(sp) > 1})
        if dup:
            raise VocabularyError(f"special token(s) {dup} appear more than once")
        extra = [s for s in specials if s not in RESERVED]
        names = list(RESERVED) + extra
        seen: set[str] = set(names)
        for t in tokens:
            if not isinstance(t, str) or not t or any(c.isspace() for c in t):
                raise VocabularyError(f"vocabulary token {t!r} must be a non-empty string without whitespace")
            if t in seen:
                raise VocabularyError(f"vocabulary token {t!r} appears twice (or clashes with a special)")
            seen.add(t)
            names.append(t)
        if not tokens:
            raise VocabularyError("a vocabulary needs at least one ordinary token")
        self._tokens: list[str] = names
        self._ids: dict[str, int] = {t: i for i, t in enumerate(names)}
        self.specials: tuple[str, ...] = tuple(RESERVED) + tuple(extra)
        self.num_specials = len(self.specials)
        self._max_token_len = max(len(t) for t in names)
        # single characters decode without spaces, unless one is "<": then a run of ordinary tokens could
        # spell a special ("<", "s", ">" -> "<s>") and decode -> encode would not round-trip
        self._separator = "" if all(len(t) == 1 for t in tokens) and "<" not in tokens else " "

    # ----------------------------------------------------------------- ids of the specials
    pad_id = property(lambda self: PAD_ID)
    bos_id = property(lambda self: BOS_ID)
    eos_id = property(lambda self: EOS_ID)
    think_id = property(lambda self: THINK_ID)  # <s>
    end_think_id = property(lambda self: END_THINK_ID)  # </s>
    explain_id = property(lambda self: EXPLAIN_ID)

    @property
    def ordinary_ids(self) -> np.ndarray:
        """Ids of the ordinary (non-special) tokens."""
        return np.arange(self.num_specials, len(self), dtype=np.int64)

    @property
    def observable_ids(self) -> np.ndarray:
        """Sigma: the ordinary tokens and ``<eos>``."""
        return np.concatenate([[self.eos_id], self.ordinary_ids]).astype(np.int64)

    @property
    def latent_ids(self) -> np.ndarray:
        """Omega = Sigma + {<s>, </s>}."""
        return np.concatenate([self.observable_ids, [self.think_id, self.end_think_id]]).astype(np.int64)

    @property
    def tokens(self) -> list[str]:
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, token: object) -> bool:
        return token in self._ids

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and other._tokens == self._tokens

    def __hash__(self) -> int:
        return hash(tuple(self._tokens))

    def __repr__(self) -> str:
        ordinary = self._tokens[self.num_specials :]
        shown = ordinary if len(ordinary) <= 12 else ordinary[:10] + ["..."]
        return f"Vocab({len(self)} ids; ordinary={shown})"

    # ----------------------------------------------------------------- lookups
    def id(self, token: str) -> int:
        """The id of one token string; :class:`UnknownTokenError` if it is not in the vocabulary."""
        try:
            return self._ids[token]
        except KeyError:
            raise UnknownTokenError(
                f"token {token!r} is not in the vocabulary ({len(self)} tokens: {self._preview()})"
            ) from None

    def token(self, i: int) -> str:
        if not 0 <= int(i) < len(self):
            raise UnknownTokenError(f"token id {int(i)} is outside the vocabulary [0, {len(self)})")
        return self._tokens[int(i)]

    def _preview(self) -> str:
        t = self._tokens
        return ", ".join(map(repr, t[:12])) + (", ..." if len(t) > 12 else "")

    def tokenize(self, text: str) -> list[str]:
        """Split a string into tokens: whitespace separates, then longest match at each position."""
        out: list[str] = []
        for chunk in text.split():
            i = 0
            while i < len(chunk):
                for L in range(min(self._max_token_len, len(chunk) - i), 0, -1):
                    if chunk[i : i + L] in self._ids:
                        out.append(chunk[i : i + L])
                        i += L
                        break
                else:
                    raise UnknownTokenError(
                        f"cannot tokenize {chunk!r} at position {i} ({chunk[i:]!r}): no vocabulary token "
                        f"matches; tokens are {self._preview()}"
                    )
        return out

    def encode(self, text: str | Sequence[str]) -> list[int]:
        """A string (tokenized by :meth:`tokenize`) or a list of token strings -> list of ids."""
        if isinstance(text, str):
            return [self._ids[t] for t in self.tokenize(text)]
        return [self.id(t) for t in text]

    def decode(self, ids: Iterable[int], skip_pad: bool = True) -> str:
        """Ids (one 1-D sequence of integers) -> string; padding is dropped unless ``skip_pad=False``."""
        parts = []
        try:
            items = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            flat = np.asarray(items)
        except (TypeError, ValueError):  # not a sequence, or a ragged one
            items, flat = None, np.asarray(None)
        if flat.size == 0 and flat.ndim == 1:
            return ""
        # numpy would read True as id 1
        booleans = isinstance(items, list) and any(isinstance(i, bool | np.bool_) for i in items)
        if flat.ndim != 1 or booleans or flat.dtype == np.bool_ or not np.issubdtype(flat.dtype, np.integer):
            raise MalformedSequenceError(f"decode takes one 1-D sequence of integer token ids, got {flat.dtype} "
                                         f"values of shape {flat.shape}")
        for i in flat:
            if skip_pad and i == self.pad_id:
                continue
            parts.append(self.token(int(i)))
        return self._separator.join(parts)

    def check_ids(self, ids, what: str = "token ids") -> None:
        """Raise :class:`UnknownTokenError` if any id is outside [0, len(vocab))."""
        a = np.asarray(ids.detach().cpu() if hasattr(ids, "detach") else ids)
        if a.size and (a.min() < 0 or a.max() >= len(self)):
            bad = a[(a < 0) | (a >= len(self))].ravel()[:5].tolist()
            raise UnknownTokenError(f"{what} contain ids {bad} outside the vocabulary [0, {len(self)})")

    # ----------------------------------------------------------------- persistence
    def to_dict(self) -> dict:
        return {"tokens": self._tokens[self.num_specials :], "specials": list(self.specials)}

    @classmethod
    def from_dict(cls, d: dict) -> Vocab:
        return cls(d["tokens"], specials=tuple(d["specials"]))
