"""Token strings <-> ids with the reserved specials of the static theory (Sections 2.2, 2.4, 5.1).

Observable vocabulary Sigma = the ordinary tokens plus ``<eos>``; latent vocabulary
Omega = Sigma plus ``<s>`` and ``</s>`` (Ex 2.3, (5.1)). ``<bos>`` is context only and is
never generated; ``<pad>`` fills padded token arrays; ``<explain>`` separates the observation
from the thought in the explanatory format "x <explain> z" (Section 5.6.2, Fig 5.5).

:class:`TokenizerVocab` (``Vocab.from_tokenizer(tokenizer)``) is the vocabulary of a HuggingFace-style
tokenizer with the same reserved ids: text goes through the tokenizer both ways.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ppl_thought import checks
from ppl_thought.errors import MalformedSequenceError, UnknownTokenError, VocabularyError
from ppl_thought.validation import ArrayLike, SupportsArray, checked

PAD, BOS, EOS, THINK, END_THINK, EXPLAIN = "<pad>", "<bos>", "<eos>", "<s>", "</s>", "<explain>"
RESERVED: tuple[str, ...] = (PAD, BOS, EOS, THINK, END_THINK, EXPLAIN)
DEFAULT: tuple[str, ...] = RESERVED
#: the ids of the reserved specials, the same in every Vocab (the one home of these numbers)
PAD_ID, BOS_ID, EOS_ID, THINK_ID, END_THINK_ID, EXPLAIN_ID = range(len(RESERVED))


@checked
class Vocab:
    """A vocabulary: reserved specials first (ids 0..5), then extra specials, then ordinary tokens.

    ``Vocab(["a", "b"])`` has ids ``<pad>=0 <bos>=1 <eos>=2 <s>=3 </s>=4 <explain>=5 a=6 b=7``.
    Extra specials (``specials=DEFAULT + ("<q>",)``) are neither observable nor latent tokens:
    they are context markers such as mode tags (Fig 5.2).

    Strings are encoded by splitting on whitespace and then matching the longest token at each
    position, so ``"ab<s>c</s>"`` works for a character vocabulary and ``"the cat"`` for a word one.
    """

    def __init__(self, tokens: Iterable[str], specials: Sequence[str] = DEFAULT):
        for what, value in (("tokens", tokens), ("specials", specials)):
            if isinstance(value, str):
                raise VocabularyError(f"{what} must be a list of token strings, got the string {value!r} (it would "
                                      f"be read as {len(value)} one-character tokens): write [{value!r}]")
            if value is None or not isinstance(value, Iterable):
                raise VocabularyError(f"{what} must be a list of token strings, got {value!r}")
        try:  # an Iterable by its type that cannot be iterated (a 0-d tensor or array)
            tokens = list(tokens)
            specials = list(specials)
        except TypeError as e:
            raise VocabularyError(f"tokens and specials must be lists of token strings, got tokens={tokens!r}, "
                                  f"specials={specials!r} ({e})"[:300]) from None
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

    def token(self, i: int | SupportsArray) -> str:
        """The token string of one id: an integer in [0, len(vocab)) (a float or a bool is refused, not
        truncated: ``token(1.5)`` is a :class:`MalformedSequenceError`, not ``'<bos>'``)."""
        return self._tokens[checks.token_id("token id", i, len(self))]

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

    def decode(self, ids: ArrayLike | Iterable[int], skip_pad: bool = True) -> str:
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
        """Raise :class:`UnknownTokenError` if any id is outside [0, len(vocab)), and
        :class:`MalformedSequenceError` for ids held as floats, bools or strings (``[6.5]`` is not token 6)."""
        checks.token_ids(what, ids)
        a = np.asarray(ids.detach().cpu() if hasattr(ids, "detach") else ids)
        if a.size:
            checks.id_dtype(what, a.dtype)
        if a.size and (a.min() < 0 or a.max() >= len(self)):
            bad = a[(a < 0) | (a >= len(self))].ravel()[:5].tolist()
            raise UnknownTokenError(f"{what} contain ids {bad} outside the vocabulary [0, {len(self)})")

    # ----------------------------------------------------------------- persistence
    def to_dict(self) -> dict:
        return {"tokens": self._tokens[self.num_specials :], "specials": list(self.specials)}

    @classmethod
    def from_dict(cls, d: dict) -> Vocab:
        return cls(d["tokens"], specials=tuple(d["specials"]))

    @classmethod
    def from_tokenizer(cls, tokenizer, *, think: str = "<think>", end_think: str = "</think>",
                       explain: str = "<explain>", bos: str | None = None, eos: str | None = None,
                       add_markers: bool = False, text_markers: bool = False) -> TokenizerVocab:
        """The :class:`TokenizerVocab` of a HuggingFace-style tokenizer (see there for the id mapping)."""
        return TokenizerVocab(tokenizer, think=think, end_think=end_think, explain=explain, bos=bos, eos=eos,
                              add_markers=add_markers, text_markers=text_markers)


class TokenizerVocab(Vocab):
    """The vocabulary of a HuggingFace-style tokenizer, with the reserved specials at their usual ids.

    The tokenizer is duck-typed: ``get_vocab()`` (token string -> id), ``encode(text,
    add_special_tokens=False)``, ``decode(ids, skip_special_tokens=False)``, ``bos_token`` /
    ``eos_token`` and, when markers are added, ``add_tokens(tokens, special_tokens=True)``
    (``transformers`` tokenizers have all of them). Library ids ("ids") and the tokenizer's ids
    ("HF ids") correspond as follows:

    ===============  ==========================================================================
    library token    HF token
    ===============  ==========================================================================
    ``<pad>`` (0)    none (never fed to the model as a real token, never generated)
    ``<bos>`` (1)    ``bos`` (default: the tokenizer's bos token, else its eos token)
    ``<eos>`` (2)    ``eos`` (default: the tokenizer's eos token); GPT-2: ``<|endoftext|>``, the
                     same HF token as ``<bos>``
    ``<s>`` (3)      ``think`` (default ``"<think>"``)
    ``</s>`` (4)     ``end_think`` (default ``"</think>"``)
    ``<explain>``    ``explain`` (default ``"<explain>"``)
    extra specials   the tokenizer's other special tokens (``<unk>``, ``<|im_start|>``, ...), in HF id
                     order: context markers, neither observable nor latent tokens
    ordinary tokens  every other HF token, in HF id order, named by its token string
                     (``"Ġworld"`` for byte-level BPE)
    ===============  ==========================================================================

    The thought markers get HF strings of their own because a tokenizer's ``"<s>"`` may already mean
    something else (Llama's ``<s>`` is its bos token). A tokenizer that has them already (Qwen3 has
    ``<think>`` and ``</think>``) is used as it is. Markers the tokenizer lacks are, by choice (never
    silently; docs/huggingface.md, "Thought markers"):

    * ``add_markers=True``: added to the tokenizer as special tokens (its ``add_tokens``; the model's
      embeddings must then grow to match, which ``pt.lm.HuggingFace(..., add_markers=True)`` does);
    * ``text_markers=True``: plain text. The library id (``<s>`` ...) then has no HF token
      (``hf_ids`` -1, listed in :attr:`text_marker_ids`): it is never generated and never fed to the
      model; a program marks thoughts with the marker's *text*, which the tokenizer splits into
      ordinary tokens (SmolLM2: ``"<think>"`` is ``<``, ``think``, ``>``) and which character
      automata (``CharDFA``, ``token_automaton``) read across token boundaries like any other text;
    * neither: :class:`~ppl_thought.errors.VocabularyError` naming both options.

    An HF token string equal to a reserved name it is not mapped to (a tokenizer's own ``"<pad>"``) is
    renamed ``"hf:<pad>"``.

    Text goes through the tokenizer both ways: ``encode(text)`` is ``tokenizer.encode(text,
    add_special_tokens=False)`` mapped to library ids, and ``decode(ids)`` is ``tokenizer.decode`` of
    the HF ids (``<pad>`` skipped), so ``decode(encode(text)) == text`` whenever the tokenizer round
    trips. Lists of token strings are looked up by name as in :class:`Vocab`.

    Attributes:
        tokenizer: the tokenizer.
        hf_ids: int64 ``[len(vocab)]``, the HF id of each library id (-1 for ``<pad>``).
        library_ids: int64 ``[number of HF ids]``, the library id of each HF id (-1 for holes in the
            tokenizer's id range); an HF id that is both bos and eos maps to ``<eos>``.
        text_marker_ids: the library ids of the markers kept as plain text (no HF token), ``()`` unless
            ``text_markers=True`` and the tokenizer lacks some marker.
        added_markers: the marker strings this vocabulary added to the tokenizer (``add_markers=True``).
    """

    def __init__(self, tokenizer, *, think: str = "<think>", end_think: str = "</think>",
                 explain: str = "<explain>", bos: str | None = None, eos: str | None = None,
                 add_markers: bool = False, text_markers: bool = False):
        for method in ("get_vocab", "encode", "decode"):
            if not callable(getattr(tokenizer, method, None)):
                raise VocabularyError(f"{type(tokenizer).__name__} is not a tokenizer: it has no {method}() "
                                      "(a transformers tokenizer is expected)")
        markers = {"think": think, "end_think": end_think, "explain": explain}
        for what, m in markers.items():
            if not isinstance(m, str) or not m:
                raise VocabularyError(f"{what} must be a non-empty token string, got {m!r}")
        if len(set(markers.values())) != 3:
            raise VocabularyError(f"the thought markers must be three different strings, got {markers}")
        hf_vocab = dict(tokenizer.get_vocab())
        missing = [m for m in markers.values() if m not in hf_vocab]
        new_markers: list[str] = []
        if missing and add_markers:
            tokenizer.add_tokens(missing, special_tokens=True)
            new_markers = list(missing)
            hf_vocab = dict(tokenizer.get_vocab())
            still = [m for m in missing if m not in hf_vocab]
            if still:
                raise VocabularyError(f"the tokenizer did not add the marker token(s) {still}")
        elif missing and not text_markers:
            raise VocabularyError(
                f"the tokenizer has no token(s) {missing} for the thought markers <s>, </s>, <explain>: pass "
                "add_markers=True to add them (then grow the model's embeddings; pt.lm.HuggingFace does both), "
                "text_markers=True to keep them as plain text, or name tokens it has with think=, end_think=, "
                "explain=")
        eos = eos if eos is not None else getattr(tokenizer, "eos_token", None)
        bos = bos if bos is not None else (getattr(tokenizer, "bos_token", None) or eos)
        if eos is None:
            raise VocabularyError("the tokenizer has no eos token: name the HF token that plays <eos> with eos=")
        for what, tok in (("bos", bos), ("eos", eos)):
            if str(tok) not in hf_vocab:
                raise VocabularyError(f"{what} token {str(tok)!r} is not in the tokenizer's vocabulary")
        bos, eos = str(bos), str(eos)
        clash = {what: m for what, m in markers.items() if m in (bos, eos)}
        if clash:
            raise VocabularyError(f"thought marker(s) {clash} are the tokenizer's bos/eos token ({bos!r}/{eos!r}): "
                                  "choose other strings, e.g. the defaults <think>, </think>, <explain>")

        size = max(hf_vocab.values()) + 1
        reserved_hf = {BOS_ID: hf_vocab[bos], EOS_ID: hf_vocab[eos]}
        marker_ids = {THINK_ID: think, END_THINK_ID: end_think, EXPLAIN_ID: explain}
        reserved_hf.update({lib: hf_vocab[m] for lib, m in marker_ids.items() if m in hf_vocab})
        text_ids = tuple(lib for lib, m in marker_ids.items() if m not in hf_vocab)
        taken = set(reserved_hf.values())
        names = [None] * size
        for tok, i in hf_vocab.items():
            names[i] = tok
        special_ids = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or []}
        for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                special_ids.add(int(i))
        extra_hf = [i for i in range(size) if names[i] is not None and i in special_ids and i not in taken]
        ordinary_hf = [i for i in range(size) if names[i] is not None and i not in special_ids and i not in taken]
        if not ordinary_hf:
            raise VocabularyError("the tokenizer has no ordinary tokens")

        def name(i: int) -> str:
            return f"hf:{names[i]}" if names[i] in RESERVED else names[i]

        extra = [name(i) for i in extra_hf]
        self._tokens = list(RESERVED) + extra + [name(i) for i in ordinary_hf]
        self._ids = {t: i for i, t in enumerate(self._tokens)}
        if len(self._ids) != len(self._tokens):
            dup = sorted({t for t in self._tokens if self._tokens.count(t) > 1})[:5]
            raise VocabularyError(f"token name(s) {dup} appear twice in the tokenizer's vocabulary")
        self.specials = tuple(RESERVED) + tuple(extra)
        self.num_specials = len(self.specials)
        self._max_token_len = max(len(t) for t in self._tokens)
        self._separator = ""
        self.tokenizer = tokenizer
        hf_ids = np.full(len(self._tokens), -1, dtype=np.int64)
        for lib, hf in reserved_hf.items():
            hf_ids[lib] = hf
        hf_ids[len(RESERVED):] = np.asarray(extra_hf + ordinary_hf, dtype=np.int64)
        library_ids = np.full(size, -1, dtype=np.int64)
        order = np.arange(len(self._tokens))
        # later writes win: <eos> is written after <bos>, so a shared bos/eos HF id reads back as <eos>
        mapped = hf_ids >= 0
        mapped[PAD_ID] = False
        library_ids[hf_ids[mapped]] = order[mapped]
        library_ids[reserved_hf[EOS_ID]] = EOS_ID
        self.hf_ids, self.library_ids = hf_ids, library_ids
        self.markers = (think, end_think, explain)
        self.text_marker_ids: tuple[int, ...] = text_ids
        self.added_markers: tuple[str, ...] = tuple(new_markers)
        self.hf_bos, self.hf_eos = bos, eos

    def __repr__(self) -> str:
        return (f"TokenizerVocab({len(self)} ids over {type(self.tokenizer).__name__} with {len(self.library_ids)} "
                f"HF ids; <bos>={self.hf_bos!r}, <eos>={self.hf_eos!r}, markers={self.markers})")

    def tokenize(self, text: str) -> list[str]:
        """The library token names of ``text`` as the tokenizer splits it."""
        return [self._tokens[i] for i in self.encode(text)]

    def encode(self, text: str | Sequence[str]) -> list[int]:
        """Text -> library ids through ``tokenizer.encode(text, add_special_tokens=False)``; a list of token
        names -> their ids."""
        if not isinstance(text, str):
            return super().encode(text)
        hf = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        if hf.size and (hf.min() < 0 or hf.max() >= len(self.library_ids) or (self.library_ids[hf] < 0).any()):
            raise UnknownTokenError(f"the tokenizer gave ids outside its own vocabulary for {text[:40]!r}")
        return self.library_ids[hf].tolist()

    def decode(self, ids: ArrayLike | Iterable[int], skip_pad: bool = True) -> str:
        """Library ids -> text through ``tokenizer.decode`` (``<pad>`` dropped, or written ``"<pad>"`` with
        ``skip_pad=False``)."""
        flat = np.asarray(list(ids) if not hasattr(ids, "tolist") else ids.tolist(), dtype=np.int64).ravel()
        self.check_ids(flat)
        parts, run = [], []
        for i in flat.tolist():
            if i == PAD_ID:
                if not skip_pad:
                    parts.append(self._hf_decode(run))
                    parts.append(PAD)
                    run = []
                continue
            if self.hf_ids[i] < 0:  # a plain-text marker: its text
                parts.append(self._hf_decode(run))
                parts.append(self.markers[i - THINK_ID])
                run = []
                continue
            run.append(int(self.hf_ids[i]))
        parts.append(self._hf_decode(run))
        return "".join(parts)

    def _hf_decode(self, hf_ids: list[int]) -> str:
        if not hf_ids:
            return ""
        try:
            return self.tokenizer.decode(hf_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except TypeError:  # a tokenizer without these keywords
            return self.tokenizer.decode(hf_ids)

    def to_dict(self) -> dict:
        raise VocabularyError("a TokenizerVocab is saved with its tokenizer (tokenizer.save_pretrained), "
                              "not as a token list")
