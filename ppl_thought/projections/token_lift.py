"""Character automata lifted to token automata: constraints over any tokenizer (numpy only).

A language model generates token ids; a constraint such as a regular expression, a lipogram or a
bounded-depth Dyck language is defined over characters. :func:`token_automaton` turns a
:class:`~ppl_thought.projections.char_dfa.CharDFA` into a token
:class:`~ppl_thought.projections.automaton.Automaton` whose mask (2.26) admits exactly the tokens that
keep the decoded text a prefix of an accepted string, so the masked softmax of Def 2.8 (``LMSequence``,
``LMState``, every engine) constrains generation over a BPE vocabulary unchanged.

Definition (the lifting). Let ``text(i)`` be the decoded string of token id ``i`` and, for a token
sequence ``z``, ``text(z)`` the concatenation. With ``delta*`` the DFA's transition function extended to
strings, the lifted transition is

    next_state[q, i] = delta*(q, text(i))   if the walk stays alive (and can still finish), else -1,

so a token sequence ``z`` followed by ``<eos>`` is accepted iff ``text(z)`` is in the character language
(and, with ``max_len``, ``|z| + 1 <= max_len``); ``<eos>`` is admissible exactly in accepting states and
leads to the one final state, where decoding stops. The automaton is trimmed: a token is admissible
only if some continuation (over this vocabulary, within ``max_len``) reaches ``<eos>``, so no decoding
row ever runs into a state with an empty mask.

The table is built vectorised: the admissible token strings become a char-class matrix ``[V, Lmax]``
(sorted by length), cut into chunks of k characters, and all (state, token) pairs of a breadth-first
frontier of states are stepped one chunk at a time with one numpy gather from a table of the state after
each k-character chunk; only states reachable from the start get rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ppl_thought.errors import ConfigError, TokenizerMismatchError, UnsatisfiableConstraintError
from ppl_thought.projections.automaton import DEAD, Automaton
from ppl_thought.projections.char_dfa import CharDFA
from ppl_thought.resources import automaton_bytes, check_bytes
from ppl_thought.validation import checked
from ppl_thought.vocab import BOS_ID, EOS_ID, PAD_ID, Vocab

__all__ = ["token_automaton", "token_texts"]


@checked
def token_texts(vocab: Vocab, *, keep_fragments: bool = False) -> list[str | None]:
    """The decoded text of each id of a vocabulary, for :func:`token_automaton`: ``None`` for the specials
    (``<pad>``, ``<eos>``, ...), ``vocab.decode([i])`` for the ordinary tokens (the token string for a
    character :class:`~ppl_thought.vocab.Vocab`, the tokenizer's decoded text for a tokenizer's vocabulary).

    The constraint reads the concatenation of these texts. Two tokenizer facts make a per-token text differ
    from its share of the decoded sequence: byte-level BPE tokens holding part of a multi-byte character
    decode alone to U+FFFD; by default (``keep_fragments=False``) they are never admissible, so the
    constraint can never be broken through them (characters split across tokens are then unreachable).
    SentencePiece tokenizers drop a token's leading space when it is decoded alone: for them, build the list
    yourself (e.g. from ``convert_ids_to_tokens`` with ``"\u2581"`` replaced by a space).
    """
    out: list[str | None] = [None] * len(vocab)
    for i in range(vocab.num_specials, len(vocab)):  # set-up, once per vocabulary
        t = vocab.decode([i])
        out[i] = None if "\ufffd" in t and not keep_fragments else t
    return out


def _allow_mask(allow, V: int) -> np.ndarray:
    if allow is None:
        return np.ones(V, dtype=bool)
    a = np.asarray(allow)
    if a.dtype == bool:
        if a.shape != (V,):
            raise ConfigError(f"allow as a bool mask must have shape ({V},), got {a.shape}")
        return a.copy()
    a = np.asarray(list(allow) if not isinstance(allow, np.ndarray) else allow).ravel()
    if a.size and (not np.issubdtype(a.dtype, np.integer) or a.min() < 0 or a.max() >= V):
        raise ConfigError(f"allow must be a bool mask [V] or token ids in [0, {V})")
    mask = np.zeros(V, dtype=bool)
    mask[a.astype(np.int64)] = True
    return mask


def _class_matrix(dfa: CharDFA, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(char classes ``[n, Lmax]`` int, lengths ``[n]``) of the strings, without a Python loop over them:
    numpy's fixed-width unicode array viewed as code points."""
    n = len(texts)
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=n)
    width = int(lengths.max()) if n else 0
    if width == 0:
        return np.zeros((n, 0), dtype=np.int64), lengths
    codes = np.array(texts, dtype=f"<U{width}").view(np.uint32).reshape(n, width)
    # positions past a string's end read 0 (numpy pads with NUL); they are never stepped
    return dfa.classify(codes), lengths


#: bounds on the k-character transition table [S + 1, (C + 1)^k] the walker steps with
MAX_CHUNK_COLUMNS = 4096
MAX_CHUNK_ENTRIES = 1 << 24


class _Walker:
    """Steps every (state, token) pair of a set of DFA states through the admissible tokens' strings.

    The walk reads ``k`` characters per gather: ``table_k[s, code]`` is the state after the k-character
    chunk ``code`` (base ``C + 1`` digits, first character most significant), with an extra class ``C``
    that keeps the state so that strings pad to a multiple of ``k``. ``k`` is the largest with
    ``(C + 1)^k <= MAX_CHUNK_COLUMNS`` and ``(S + 1) (C + 1)^k <= MAX_CHUNK_ENTRIES`` (at least 1)."""

    def __init__(self, dfa: CharDFA, ids: np.ndarray, texts: list[str], V: int):
        S, C = dfa.delta.shape
        Cp = C + 1  # class C: padding, keeps the state
        self.S, self.V = S, V
        classes, lengths = _class_matrix(dfa, texts)
        width = classes.shape[1]
        k = 1
        while (k < width and Cp ** (k + 1) <= MAX_CHUNK_COLUMNS
               and (S + 1) * Cp ** (k + 1) <= MAX_CHUNK_ENTRIES):
            k += 1
        dtype = np.int32 if (S + 1) * Cp**k < 2**31 else np.int64
        # one character: dead is state S, a sink row; the padding column keeps every state
        t1 = np.concatenate([np.where(dfa.delta >= 0, dfa.delta, S), np.full((1, C), S)], 0)
        t1 = np.concatenate([t1, np.arange(S + 1)[:, None]], 1)
        tk = t1
        for _ in range(k - 1):  # table_{j+1}[s, a * Cp + b] = t1[table_j[s, a], b]
            tk = t1[tk].reshape(S + 1, -1)
        self.flat = tk.astype(dtype).ravel()
        self.cols = Cp**k
        # chunk codes [n, ceil(width / k)], past a string's end the padding class
        chunks = -(-width // k) if width else 0
        padded = np.full((len(texts), chunks * k), C, dtype=np.int64)
        if width:
            padded[:, :width] = np.where(np.arange(width)[None] < lengths[:, None], classes, C)
        codes = np.zeros((len(texts), chunks), dtype=np.int64)
        for j in range(k):  # a loop over the k characters of a chunk
            codes = codes * Cp + padded[:, j::k]
        order = np.argsort(-lengths, kind="stable")  # longest first: chunk g steps a prefix of the columns
        self.ids = ids[order]
        self.codes = codes[order].astype(dtype)
        self.active = [int((lengths > g * k).sum()) for g in range(chunks)]
        self.dtype = dtype

    def rows(self, states: np.ndarray) -> np.ndarray:
        """``[len(states), V]``: the DFA state after each token's string (``S`` = dead or inadmissible)."""
        st = np.repeat(states.astype(self.dtype)[:, None], len(self.ids), 1)
        cols = self.cols
        for g, n in enumerate(self.active):  # a loop over chunks of character positions only
            st[:, :n] = self.flat[st[:, :n] * cols + self.codes[None, :n, g]]
        out = np.full((len(states), self.V), self.S, dtype=self.dtype)
        out[:, self.ids] = st
        return out


def _edges(T: np.ndarray, block: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (source, target) state pairs of the transitions ``T [R, V]`` (-1 dead), by scattering
    blocks of rows into a bool [block, R] matrix."""
    R = T.shape[0]
    src, dst = [], []
    for b in range(0, R, block):  # a loop over blocks of states (one block below 256 states)
        rows = T[b:b + block]
        hit = np.zeros((rows.shape[0], R + 1), dtype=bool)
        hit[np.arange(rows.shape[0])[:, None], rows] = True  # dead (-1) marks the last column, dropped
        s, d = np.nonzero(hit[:, :R])
        src.append(s + b)
        dst.append(d)
    return np.concatenate(src), np.concatenate(dst)


def _distances(edges: tuple[np.ndarray, np.ndarray], goal: np.ndarray) -> np.ndarray:
    """Fewest tokens from each state to a ``goal`` state (``inf`` where none is reachable): breadth-first
    backwards over the edges."""
    src, dst = edges
    dist = np.where(goal, 0.0, np.inf)
    frontier = goal.copy()
    d = 0
    while frontier.any():
        d += 1
        new = np.zeros_like(frontier)
        new[src[frontier[dst]]] = True
        new &= np.isinf(dist)
        dist[new] = d
        frontier = new
    return dist


def _reachable(edges: tuple[np.ndarray, np.ndarray], R: int, start: int = 0) -> np.ndarray:
    src, dst = edges
    seen = np.zeros(R, dtype=bool)
    seen[start] = True
    frontier = seen.copy()
    while frontier.any():
        new = np.zeros(R, dtype=bool)
        new[dst[frontier[src]]] = True
        frontier = new & ~seen
        seen |= new
    return seen


def _longest_path(edges: tuple[np.ndarray, np.ndarray], R: int) -> int | None:
    """The most edges on a path, or ``None`` if the graph has a cycle (Kahn's algorithm by layers)."""
    src, dst = edges
    alive = np.ones(R, dtype=bool)
    height = 0
    while alive.any():
        live_out = np.bincount(src[alive[dst] & alive[src]], minlength=R)
        sinks = alive & (live_out == 0)
        if not sinks.any():
            return None
        alive &= ~sinks
        height += 1
    return height - 1


@checked
def token_automaton(dfa: CharDFA, token_text: Sequence[str | None], *, eos_id: int | None = EOS_ID,
                    allow: np.ndarray | Iterable[int] | None = None, max_len: int | None = None) -> Automaton:
    """Lift a character automaton to the token vocabulary (see the module docstring for the definition).

    Args:
        dfa: the character language.
        token_text: the decoded string of each token id (length V, the LM's vocabulary size); ``None``
            for ids that are never admissible (specials). ``<pad>`` and ``<bos>`` must be ``None``; the
            entry of ``eos_id`` is ignored. A token whose text is empty keeps the state.
            For a library ``Vocab``: :func:`token_texts`.
        eos_id: the end token: admissible in accepting states, it leads to the final state (decoding
            stops). ``None``: no end token; the final states are the accepting ones and tokens stay
            admissible there (for a fixed-length :class:`~ppl_thought.verifiers.ProcessVerifier`, Def 3.1.3).
        allow: a bool mask ``[V]`` or ids: tokens outside it are never admissible.
        max_len: a bound on the number of tokens, ``<eos>`` included: states then count tokens, and a
            token is admissible only if ``<eos>`` can still come within the bound. The automaton's
            ``max_len`` is this bound, or without it the longest accepted sequence when the lifted language
            is finite (``None`` otherwise).

    Returns:
        An :class:`Automaton` over ``V`` token columns (``emitted`` is 0: a constraint, not a lifting).

    Raises:
        ConfigError: bad arguments (a text for ``<pad>`` / ``<bos>``, ``eos_id`` out of range, ...).
        UnsatisfiableConstraintError: no token sequence over this vocabulary (within ``max_len``) spells
            an accepted string.
    """
    if isinstance(token_text, str):
        raise ConfigError("token_text must be a sequence with the decoded string (or None) of each token id")
    token_text = list(token_text)
    V = len(token_text)
    if eos_id is not None and (isinstance(eos_id, bool) or eos_id < 0 or eos_id in (PAD_ID, BOS_ID)):
        raise ConfigError(f"eos_id must be a token id other than <pad> / <bos>, or None; got {eos_id!r}")
    if V <= max(PAD_ID, BOS_ID, 0 if eos_id is None else eos_id):
        raise ConfigError(f"token_text has {V} entries: too few for the reserved ids (<pad>={PAD_ID}, "
                          f"<bos>={BOS_ID}, eos_id={eos_id})")
    kinds = set(map(type, token_text))
    if not kinds <= {str, type(None)}:
        bad = sorted(k.__name__ for k in kinds - {str, type(None)})
        raise ConfigError(f"token_text entries must be str or None, got {bad}")
    for rid, what in ((PAD_ID, "<pad>"), (BOS_ID, "<bos>")):
        if token_text[rid] is not None:
            raise ConfigError(f"token_text[{rid}] is {token_text[rid]!r} but id {rid} is {what}, which is never "
                              "generated: give None for special ids (token_texts(vocab) does)")
    if max_len is not None and (isinstance(max_len, bool) or max_len < 0):
        raise ConfigError(f"max_len must be a non-negative int or None, got {max_len!r}")
    ok = _allow_mask(allow, V) & np.fromiter((t is not None for t in token_text), dtype=bool, count=V)
    ok[[PAD_ID, BOS_ID]] = False
    if eos_id is not None:
        ok[eos_id] = False
    ids = np.nonzero(ok)[0]
    walker = _Walker(dfa, ids, [token_text[i] for i in ids.tolist()], V)

    # breadth-first over the DFA states reachable by whole tokens: one vectorised walk per frontier
    S = dfa.num_states
    row_of = np.full(S + 1, DEAD, dtype=np.int64)  # DFA state -> row; the dead state S -> -1
    blocks, states = [], []
    frontier = np.array([dfa.start])
    while frontier.size:
        row_of[frontier] = np.arange(len(states), len(states) + len(frontier))
        states.extend(frontier.tolist())
        T = walker.rows(frontier)
        blocks.append(T)
        hit = np.zeros(S + 1, dtype=bool)
        hit[T.ravel()] = True
        hit[S] = False
        frontier = np.nonzero(hit & (row_of[:S + 1] < 0))[0]
    reached = np.array(states)
    T = row_of[np.concatenate(blocks, 0)]  # [R, V] transitions between reached states, -1 dead
    accepting = dfa.accepting[reached]
    edges = _edges(T)
    dist = _distances(edges, accepting)  # fewest tokens to an accepting state
    tail = 0 if eos_id is None else 1  # the <eos> token
    name = f"tokens({dfa.name}, V={V}{'' if max_len is None else f', max_len={max_len}'})"
    if not np.isfinite(dist[0]) or (max_len is not None and dist[0] + tail > max_len):
        raise UnsatisfiableConstraintError(
            f"no token sequence over this vocabulary{'' if max_len is None else f' of at most {max_len} tokens'} "
            f"spells a string of {dfa.name}" + ("" if eos_id is None else " followed by <eos>"))
    if max_len is None:
        auto = _unbounded(T, edges, accepting, dist, eos_id, name)
    else:
        check_bytes(_layered_bytes(T, edges, dist, int(max_len)), "token_automaton", f"max_len={max_len}")
        auto = _layered(T, edges, accepting, dist, eos_id, int(max_len), name)
    object.__setattr__(auto, "tokenizer", texts_fingerprint(token_text))  # checked where it meets an LM
    return auto


def texts_fingerprint(token_text: Sequence[str | None]) -> str:
    """The fingerprint of a list of token texts (``None`` for specials): 16 hex digits of a SHA-256 over the
    texts in id order, what :func:`token_automaton` records in ``Automaton.tokenizer``."""
    h = hashlib.sha256()
    for t in token_text:
        h.update(b"\x00" if t is None else t.encode("utf-8", "surrogatepass") + b"\x1f")
    return h.hexdigest()[:16]


_PRINTS: dict[int, tuple[Any, frozenset[str]]] = {}


def vocab_fingerprints(vocab: Vocab) -> frozenset[str]:
    """The fingerprints an automaton built for ``vocab`` carries: of ``token_texts(vocab)`` with and without
    ``keep_fragments`` (each id decoded once per vocabulary; kept while the vocabulary lives)."""
    hit = _PRINTS.get(id(vocab))
    if hit is not None and hit[0] is vocab:
        return hit[1]
    kept = token_texts(vocab, keep_fragments=True)
    dropped = [None if t is not None and "\ufffd" in t else t for t in kept]
    prints = frozenset((texts_fingerprint(kept), texts_fingerprint(dropped)))
    if len(_PRINTS) > 16:
        _PRINTS.clear()
    _PRINTS[id(vocab)] = (vocab, prints)
    return prints


def check_tokenizer(automaton: Any, lm: Any, where: str) -> None:
    """Refuse a token automaton built from another tokenizer's texts than ``lm``'s vocabulary (``lm.vocab``, a
    :class:`~ppl_thought.vocab.Vocab`): :class:`TokenizerMismatchError`. Nothing to compare (no fingerprint on the
    automaton, no vocabulary on the LM, or sizes that differ: that check is the caller's) passes."""
    fp, vocab = getattr(automaton, "tokenizer", None), getattr(lm, "vocab", None)
    if fp is None or not isinstance(vocab, Vocab) or len(vocab) != getattr(automaton, "vocab_size", -1):
        return
    prints = vocab_fingerprints(vocab)
    if fp not in prints:
        raise TokenizerMismatchError(
            f"{where}: the token automaton {automaton.name!r} was built from the token texts of another tokenizer "
            f"(fingerprint {fp}) than the LM's vocabulary ({' / '.join(sorted(prints))}); both have {len(vocab)} "
            "tokens, but it admits tokens by their texts in the other tokenizer, so the LM would write strings "
            "outside the constraint. Rebuild it with token_automaton(dfa, token_texts(lm.vocab)); if its texts are "
            "right for this tokenizer (e.g. SentencePiece pieces with '\u2581' as a space), drop the check with "
            "dataclasses.replace(automaton, tokenizer=None)")


def _layered_bytes(T, edges, dist, M: int) -> float:
    """The bytes of :func:`_layered`'s table, bounded before building it: each of the K rows that can reach
    acceptance (reachable through such rows) is a state of at most ``min(M, longest path) + 1`` layers."""
    R, V = T.shape
    src, dst = edges
    good = np.isfinite(dist)
    inner = good[src] & good[dst]
    keep = np.nonzero(_reachable((src[inner], dst[inner]), R))[0]
    new_id = np.full(R, DEAD, dtype=np.int64)
    new_id[keep] = np.arange(len(keep))
    s2, d2 = new_id[src[inner]], new_id[dst[inner]]
    kept = (s2 >= 0) & (d2 >= 0)
    longest = _longest_path((s2[kept], d2[kept]), len(keep))
    return automaton_bytes(len(keep) * (min(M, M if longest is None else longest) + 1) + 1, V)


def _unbounded(T, edges, accepting, dist, eos_id, name) -> Automaton:
    """Rows: the states that can reach acceptance, reachable from the start through such states."""
    R, V = T.shape
    good = np.isfinite(dist)
    src, dst = edges
    inner = good[src] & good[dst]
    keep = np.nonzero(_reachable((src[inner], dst[inner]), R))[0]
    K = len(keep)
    # renumbering with a trailing -1: indexing it with a dead entry (-1) reads -1
    new_id = np.full(R + 1, DEAD, dtype=np.int64)
    new_id[keep] = np.arange(K)
    F = K if eos_id is not None else None  # the final state after <eos>
    table = np.empty((K + (F is not None), V), dtype=np.int64)
    np.take(new_id, T if K == R else T[keep], out=table[:K])
    acc = accepting[keep]
    s2, d2 = new_id[src], new_id[dst]
    kept = (s2 >= 0) & (d2 >= 0)
    longest = _longest_path((s2[kept], d2[kept]), K)
    if F is None:
        return Automaton(table, acc, np.zeros(K, np.int64), 0, longest, name)
    table[F] = DEAD
    table[np.nonzero(acc)[0], eos_id] = F
    final = np.zeros(K + 1, dtype=bool)
    final[F] = True
    return Automaton(table, final, np.zeros(K + 1, np.int64), 0, None if longest is None else longest + 1, name)


def _layered(T, edges, accepting, dist, eos_id, M: int, name) -> Automaton:
    """States (q, r): DFA row q after r tokens, alive iff r + dist[q] (+ 1 for <eos>) <= M."""
    R, V = T.shape
    tail = 0 if eos_id is None else 1
    src, dst = edges
    layers = [np.array([0])]
    for r in range(1, M + 1):  # a loop over token positions, vectorised over the state graph's edges
        prev = np.zeros(R, dtype=bool)
        prev[layers[-1]] = True
        nxt = np.zeros(R, dtype=bool)
        nxt[dst[prev[src]]] = True
        layers.append(np.nonzero(nxt & (dist + r + tail <= M))[0])
    offsets = np.cumsum([0] + [len(x) for x in layers])
    n_states = int(offsets[-1]) + (1 if eos_id is not None else 0)
    table = np.empty((n_states, V), dtype=np.int64)
    table[offsets[M]:] = DEAD
    final = np.zeros(n_states, dtype=bool)
    for r, layer in enumerate(layers):
        rows = slice(offsets[r], offsets[r + 1])
        if r < M:  # ids of the next layer, with a trailing -1 that dead entries (-1) read
            lid = np.full(R + 1, DEAD, dtype=np.int64)
            lid[layers[r + 1]] = offsets[r + 1] + np.arange(len(layers[r + 1]))
            np.take(lid, T[layer], out=table[rows])
        if eos_id is None:
            final[rows] = accepting[layer]
        elif r < M:
            table[offsets[r] + np.nonzero(accepting[layer])[0], eos_id] = n_states - 1
    if eos_id is not None:
        final[-1] = True
    return Automaton(table, final, np.zeros(n_states, np.int64), 0, M, name)
