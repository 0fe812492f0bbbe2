"""A small regular-expression parser: pattern -> syntax tree over character sets (numpy only).

The supported syntax is the regular core of Python's :mod:`re`, with the same meaning under
``re.fullmatch`` (the whole string must match):

- literals, ``.`` (any character but ``\\n``), escapes ``\\d \\D \\w \\W \\s \\S`` (Unicode, as in
  ``re``), ``\\n \\t \\r \\f \\v \\a \\0 \\xhh \\uhhhh \\Uhhhhhhhh \\N{name}``, and an escaped
  punctuation or space character standing for itself (``\\. \\* \\\\ \\-``);
- character classes ``[abc]``, ranges ``[a-z]``, negation ``[^...]``, escapes inside classes
  (``\\b`` is backspace there, as in ``re``); ``]`` first in a class and ``-`` first or last are
  literal;
- concatenation, alternation ``|`` (empty branches allowed), groups ``( )`` and ``(?: )``;
- quantifiers ``*``, ``+``, ``?``, ``{m}``, ``{m,}``, ``{,n}``, ``{m,n}``, each optionally lazy
  (``*?``: the same strings under full matching). A ``{`` that does not start a quantifier is a
  literal, as in ``re``.

Anchors (``^ $ \\A \\Z \\b \\B``), backreferences, lookarounds, inline flags and possessive
quantifiers are not regular or not supported: they raise :class:`~ppl_thought.errors.PatternError`,
as do malformed patterns (the message names the problem and its position).

A character set is a tuple of disjoint, sorted, non-adjacent inclusive code-point intervals
``((lo, hi), ...)``. The tree's nodes are tuples: ``("set", intervals)``, ``("cat", [nodes])``,
``("alt", [nodes])``, ``("rep", node, min, max_or_None)``.
"""

from __future__ import annotations

import unicodedata
from functools import cache

import numpy as np

from ppl_thought.errors import PatternError

MAX_CODE = 0x10FFFF
#: the largest repetition count ``{m,n}`` accepted (the automaton grows linearly in it)
MAX_REPEAT = 1000

Intervals = tuple[tuple[int, int], ...]

__all__ = ["MAX_CODE", "MAX_REPEAT", "Intervals", "parse", "char_set", "union", "complement", "unicode_class"]


# ---------------------------------------------------------------------------------------------- sets
def union(*sets: Intervals) -> Intervals:
    """The union of interval sets, normalised (sorted, disjoint, adjacent intervals merged)."""
    ivs = sorted(iv for s in sets for iv in s)
    out: list[list[int]] = []
    for lo, hi in ivs:
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def complement(s: Intervals) -> Intervals:
    """Every code point in [0, MAX_CODE] outside ``s`` (``s`` normalised)."""
    out = []
    nxt = 0
    for lo, hi in s:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE:
        out.append((nxt, MAX_CODE))
    return tuple(out)


def char_set(chars: str) -> Intervals:
    """The set of the given characters."""
    return union(*[((ord(c), ord(c)),) for c in chars])


def _runs(flags: np.ndarray) -> Intervals:
    """Intervals of the True runs of a bool vector indexed by code point."""
    d = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    starts, ends = np.nonzero(d == 1)[0], np.nonzero(d == -1)[0] - 1
    return tuple(zip(starts.tolist(), ends.tolist(), strict=True))


@cache
def unicode_class(name: str) -> Intervals:
    """``\\d`` (Unicode decimal digits, ``str.isdecimal``), ``\\w`` (``str.isalnum`` or ``_``) or ``\\s``
    (``str.isspace``): the classes ``re`` uses for ``str`` patterns. Computed once (about 0.1 s each)."""
    every = "".join(map(chr, range(MAX_CODE + 1)))
    test = {"d": str.isdecimal, "w": lambda c: c.isalnum() or c == "_", "s": str.isspace}[name]
    return _runs(np.fromiter(map(test, every), dtype=bool, count=len(every)))


ANY_BUT_NEWLINE: Intervals = complement(char_set("\n"))
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_HEX = "0123456789abcdefABCDEF"
_OCT = "01234567"


# ---------------------------------------------------------------------------------------------- parser
class _Parser:
    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise PatternError(f"a pattern must be a str, got {type(pattern).__name__}")
        self.p = pattern
        self.i = 0

    def error(self, msg: str, pos: int | None = None):
        return PatternError(msg, self.p, self.i if pos is None else pos)

    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.p[j] if j < len(self.p) else None

    # alternation: seq ('|' seq)*
    def parse_alt(self, depth: int):
        branches = [self.parse_seq(depth)]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.parse_seq(depth))
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def parse_seq(self, depth: int):
        items = []
        while (c := self.peek()) is not None and c != "|" and not (c == ")" and depth > 0):
            if c == ")":
                raise self.error("unbalanced parenthesis")
            start = self.i
            atom = self.parse_atom(depth)
            items.append(self.parse_quantifiers(atom, start))
        return items[0] if len(items) == 1 else ("cat", items)

    def parse_atom(self, depth: int):
        c = self.p[self.i]
        if c == "(":
            open_at = self.i
            self.i += 1
            if self.peek() == "?":
                if self.peek(1) != ":":
                    raise self.error("group extensions (?...) other than (?:...) are not supported "
                                     "(lookarounds, inline flags and named groups are not regular or not handled)")
                self.i += 2
            node = self.parse_alt(depth + 1)
            if self.peek() != ")":
                raise self.error("missing ), unterminated subpattern", open_at)
            self.i += 1
            return node
        if c == "[":
            return ("set", self.parse_class())
        if c == ".":
            self.i += 1
            return ("set", ANY_BUT_NEWLINE)
        if c in "^$":
            raise self.error(f"anchor {c!r} is not supported: the pattern always matches the whole string")
        if c in "*+?" or (c == "{" and self._quantifier_at(self.i) is not None):
            raise self.error("nothing to repeat")
        if c == "\\":
            return ("set", self.parse_escape(in_class=False))
        self.i += 1
        return ("set", char_set(c))

    def _quantifier_at(self, j: int) -> tuple[int, int | None, int] | None:
        """(min, max, end) if a ``{m,n}`` quantifier starts at ``j``, else None (then ``{`` is a literal)."""
        p = self.p
        if j >= len(p) or p[j] != "{":
            return None
        k = j + 1
        lo_s = ""
        while k < len(p) and p[k].isdigit() and p[k].isascii():
            lo_s += p[k]
            k += 1
        comma = k < len(p) and p[k] == ","
        hi_s = ""
        if comma:
            k += 1
            while k < len(p) and p[k].isdigit() and p[k].isascii():
                hi_s += p[k]
                k += 1
        if k >= len(p) or p[k] != "}" or not (lo_s or comma):  # not "}"-terminated, or "{}"
            return None
        lo = int(lo_s) if lo_s else 0
        hi = (int(hi_s) if hi_s else None) if comma else lo
        return lo, hi, k + 1

    def parse_quantifiers(self, atom, start: int):
        c = self.peek()
        if c is None:
            return atom
        if c in "*+?":
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            self.i += 1
        else:
            q = self._quantifier_at(self.i)
            if q is None:
                return atom
            lo, hi, end = q
            if hi is not None and lo > hi:
                raise self.error("min repeat greater than max repeat", self.i + 1)
            if max(lo, hi or 0) > MAX_REPEAT:
                raise self.error(f"repetition count over {MAX_REPEAT} (the automaton would be too large)", self.i + 1)
            self.i = end
        nxt = self.peek()
        if nxt == "?":  # lazy: the same set of strings under full matching
            self.i += 1
        elif nxt == "+":
            raise self.error("possessive quantifiers are not supported (they are not plain regular operators)")
        if (n2 := self.peek()) is not None and (n2 in "*+?" or self._quantifier_at(self.i) is not None):
            raise self.error("multiple repeat")
        return ("rep", atom, lo, hi)

    # ------------------------------------------------------------------ escapes and classes
    def _hex(self, n: int, start: int) -> int:
        digits = self.p[self.i : self.i + n]
        if len(digits) < n or any(d not in _HEX for d in digits):
            raise self.error(f"incomplete escape {self.p[start:self.i + n]}", start)
        self.i += n
        code = int(digits, 16)
        if code > MAX_CODE:
            raise self.error(f"bad escape {self.p[start:self.i]} (beyond U+10FFFF)", start)
        return code

    def parse_escape(self, in_class: bool) -> Intervals:
        """The set of one escape (``self.i`` at the backslash)."""
        start = self.i
        self.i += 1
        c = self.peek()
        if c is None:
            raise self.error("bad escape (end of pattern)", start)
        self.i += 1
        if c in "dws":
            return unicode_class(c)
        if c in "DWS":
            return complement(unicode_class(c.lower()))
        if c in _SIMPLE_ESCAPES:
            return char_set(_SIMPLE_ESCAPES[c])
        if c == "b" and in_class:
            return char_set("\b")
        if c == "x":
            return ((code := self._hex(2, start), code),)
        if c == "u":
            return ((code := self._hex(4, start), code),)
        if c == "U":
            return ((code := self._hex(8, start), code),)
        if c == "N":
            if self.peek() != "{" or "}" not in self.p[self.i :]:
                raise self.error("missing {name} after \\N", start)
            end = self.p.index("}", self.i)
            name = self.p[self.i + 1 : end]
            try:
                ch = unicodedata.lookup(name)
            except KeyError:
                raise self.error(f"undefined character name {name!r}", start) from None
            self.i = end + 1
            return char_set(ch)
        if c == "0":
            k = 0
            while k < 2 and (d := self.peek()) is not None and d in _OCT:
                self.i += 1
                k += 1
            return ((code := int(self.p[start + 1 : self.i], 8), code),)
        if c.isdigit():
            raise self.error("backreferences and octal escapes other than \\0 are not supported "
                             "(backreferences are not regular)", start)
        if c in "AZbB":
            raise self.error(f"\\{c} (an anchor or word boundary) is not supported", start)
        if c.isascii() and c.isalpha():
            raise self.error(f"bad escape \\{c}", start)
        return char_set(c)

    def parse_class(self) -> Intervals:
        """A ``[...]`` class (``self.i`` at the ``[``)."""
        start = self.i
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        parts: list[Intervals] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character set", start)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            item_at = self.i
            lo_set, lo_single = self._class_item()
            if self.peek() == "-" and self.peek(1) not in (None, "]"):
                self.i += 1
                hi_set, hi_single = self._class_item()
                if not (lo_single and hi_single) or lo_set[0][0] > hi_set[0][0]:
                    raise self.error(f"bad character range {self.p[item_at:self.i]}", item_at)
                parts.append(((lo_set[0][0], hi_set[0][0]),))
            else:
                parts.append(lo_set)
        s = union(*parts)
        return complement(s) if negate else s

    def _class_item(self) -> tuple[Intervals, bool]:
        """One element of a class: (its set, whether it is a single character)."""
        c = self.p[self.i]
        if c == "\\":
            s = self.parse_escape(in_class=True)
            return s, len(s) == 1 and s[0][0] == s[0][1]
        self.i += 1
        return char_set(c), True


def parse(pattern: str):
    """The syntax tree of ``pattern`` (see the module docstring); :class:`PatternError` if malformed."""
    parser = _Parser(pattern)
    try:
        node = parser.parse_alt(0)
    except RecursionError:
        raise PatternError("groups nested too deeply", pattern) from None
    if parser.i != len(pattern):  # only a stray ")" stops the top level early
        raise parser.error("unbalanced parenthesis")
    return node
