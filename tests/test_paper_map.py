"""docs/paper-map.md has a row for every numbered item of the five seed papers (issue 31, "paper-map has a row for
every numbered item of the five seeds").

The numbered items are extracted from the seed texts by regular expressions; each must be named in the "Paper"
column of a row in that seed's part of docs/paper-map.md (the headings that name the seed's file), and every row
there must carry an honest status (done / partial / missing / out of scope) and a place. The extraction is kept
in ``docs/seed-items.json`` (``python tests/test_paper_map.py --write``), so the paper-map checks run in a
checkout without the seed texts; with the seeds at hand a test checks the file is current.

Numbering per seed (as the extracted texts print it):

- slow-thinking-active-perception.txt: chapter.number ("Definition 2.8", "Theorem 3.1", "Table 3.1",
  "Figure 5.5"), appendix letter.number ("Lemma G.1", "Figure L.2"), algorithms 1-3 (App. G); other works are
  cited as "[92, Theorem 15.6]" or "Theorem 5.2.1 of [178]".
- data-training-inference-thesis.txt: chapter.section.number ("Definition 3.2.1", "Theorem 2.2.3",
  "Corollary 4.1.1"), tables and figures chapter.number ("Table 3.13", "Figure 2.21"); Chapter 3's
  "Algorithm 1" and "Algorithm 2" are numbered within the chapter.
- latent-thought-models.txt: flat ("Algorithm 1", "Table 4", "Figure 11"); equations (1)-(8).
- next-token-long-range.txt: flat ("Lemma 18", "Theorem 3", "Definition 7", "Def. 2", "Algorithm 2"), figures
  section.number ("Figure 2.3").
- cot-or-loop.txt: section.number ("Theorem 5.13", "Definition 4.9"), appendix letter.number ("Definition C.4",
  "Lemma E.3"), flat figures and table ("Figure 2", "Table 1").

Kinds extracted: Definition, Lemma, Theorem, Proposition, Corollary, Algorithm, Table, Figure (with the
abbreviations Def., Thm., Prop., Cor., Alg., Fig.). Remarks, Examples, Assumptions and Claims are not required
(several rows name them anyway). Numbered equations are not extracted: the rows cite the ones the library
implements.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAPER_MAP = ROOT / "docs" / "paper-map.md"
SEEDS = (
    "slow-thinking-active-perception.txt",
    "data-training-inference-thesis.txt",
    "latent-thought-models.txt",
    "next-token-long-range.txt",
    "cot-or-loop.txt",
)


def _seed_dir() -> Path | None:
    for d in (os.environ.get("PPL_THOUGHT_SEEDS"), ROOT.parent / "shared" / "seeds", ROOT / "shared" / "seeds"):
        if d and all((Path(d) / s).is_file() for s in SEEDS):
            return Path(d)
    return None


KINDS = {
    "definition": "Definition", "definitions": "Definition", "def": "Definition", "defs": "Definition",
    "lemma": "Lemma", "lemmas": "Lemma", "lem": "Lemma",
    "theorem": "Theorem", "theorems": "Theorem", "thm": "Theorem", "thms": "Theorem",
    "proposition": "Proposition", "propositions": "Proposition", "prop": "Proposition", "props": "Proposition",
    "corollary": "Corollary", "corollaries": "Corollary", "cor": "Corollary", "cors": "Corollary",
    "algorithm": "Algorithm", "algorithms": "Algorithm", "alg": "Algorithm", "algs": "Algorithm",
    "table": "Table", "tables": "Table",
    "figure": "Figure", "figures": "Figure", "fig": "Figure", "figs": "Figure",
}
_KW = "|".join(sorted(KINDS, key=len, reverse=True))
NUM = r"(?:[A-Z]\.)?\d+(?:\.\d+)*"
# one mention in a seed: "Theorem 5.13", "Def. 2", "Lemma G.1"
# (capitalised, on one line: "definitions.\n1.1 Language models" is a heading; a letter suffix is a panel: "2.11c")
_KW_CAP = "|".join(k.capitalize() for k in sorted(KINDS, key=len, reverse=True))
_ONE = rf"{NUM}[a-z]?\b(?!\.\d)"
MENTION = re.compile(rf"\b(?P<kw>{_KW_CAP})\.?[ \t\xa0]+(?P<list>{_ONE}(?:[ \t\xa0]*(?:,|and|-|–)[ \t\xa0]*{_ONE})*)")
# a reference in paper-map's Paper column: "Defs 3.1.3-3.1.5", "Lemmas 13, 14, 16", "Thm 2.1, 2.3", "Def 5.1 / C.4"
REFERENCE = re.compile(rf"\b(?P<kw>{_KW})\.?\s+(?P<list>{NUM}(?:\s*(?:-|–|,|/|and)\s*{NUM}\b(?!\)))*)", re.I)
# a mention that cites another work: "[92, Theorem 15.6]", "[160, Corollary 3.34]", "Theorem 5.2.1 of [178]"
CITED_BEFORE = re.compile(r"\[\s*\d+(?:\s*,\s*\d+)*\s*,\s*(?:[^\]]{0,40}\s)?$")
CITED_AFTER = re.compile(r"^\s*(?:of|in)\s+(?:\[\d|\(?[A-Z][a-z]+(?:\s+et\s+al\.|\s+&|\s+and|\s+\())")

# Mentions in the seeds that are not numbered items of that paper, each with why.
EXCLUDED: dict[str, dict[str, str]] = {
    "slow-thinking-active-perception.txt": {
        "Theorem 97": "table of contents: 'Proof of the Separation Theorems' on page 97",
        "Algorithm 103": "table of contents: 'Unbiased Decoding Algorithm' on page 103",
        "Theorem 5.4.1": "'Theorems 5.4.1 and 5.4.7 (for simplified GAN)' of [178], cited in Section 2",
        "Theorem 5.3.6": "'Theorem 5.3.6 (for Flow Matching)' of [178], cited in Section 2",
        "Theorem 5.4.7": "'Theorems 5.4.1 and 5.4.7 (for simplified GAN)' of [178], cited in Section 2",
        "Proposition 6.2.3": "'Proposition 6.2.3 for Flow Matching' of [178], cited in Section 2",
        "Proposition 5.4.5": "'Proposition 5.4.5 and Lemma 5.4.9 for a simplified GAN model' of [178], cited",
        "Lemma 5.4.9": "'Proposition 5.4.5 and Lemma 5.4.9 for a simplified GAN model' of [178], cited",
    },
    "data-training-inference-thesis.txt": {
        "Theorem 5.23": "Van der Vaart (2000), Theorem 5.23, cited (Lemma 4.3.9)",
        "Definition 4.1": "a footnote of Section 4.1's 'Defined analogously as in Definition 4.1.': the section, "
                          "not a numbered definition (the chapter's definitions are 4.1.x)",
    },
    "latent-thought-models.txt": {},
    "next-token-long-range.txt": {},
    "cot-or-loop.txt": {},
}


def canonical(kind: str, num: str) -> str:
    return f"{KINDS[kind.lower()]} {num}"


def seed_items(text: str) -> set[str]:
    """The numbered items a seed mentions other than as a citation of another work."""
    out = set()
    for m in MENTION.finditer(text):
        if CITED_BEFORE.search(text[max(0, m.start() - 60):m.start()]) or CITED_AFTER.match(text[m.end():]):
            continue
        out |= {canonical(m["kw"], n) for n in _numbers(re.sub(r"(\d)[a-z]\b", r"\1", m["list"]))}
    return out


def _expand(a: str, b: str) -> list[str]:
    pa, pb = a.split("."), b.split(".")
    if len(pb) < len(pa):  # "4.10-13": b replaces the last components of a
        pb = pa[: len(pa) - len(pb)] + pb
    if len(pa) == len(pb) and pa[:-1] == pb[:-1] and pa[-1].isdigit() and pb[-1].isdigit() \
            and int(pa[-1]) <= int(pb[-1]):
        return [".".join(pa[:-1] + [str(i)]) for i in range(int(pa[-1]), int(pb[-1]) + 1)]
    return [a, b]


def _numbers(listed: str) -> list[str]:
    """ "4.10-4.13, 5.1 and C.4" -> the numbers, ranges expanded."""
    parts = re.split(r"\s*(,|/|and|-|–)\s*", listed.strip())
    nums, i = [parts[0]], 1
    while i + 1 < len(parts):
        sep, nxt = parts[i], parts[i + 1]
        if sep in "-–":
            nums[-1:] = _expand(nums[-1], nxt)
        else:
            nums.append(nxt)
        i += 2
    return nums


def referenced_items(cell: str) -> set[str]:
    """Items a Paper cell names, ranges expanded: "Lemmas 7-11" -> Lemma 7, ..., Lemma 11."""
    return {canonical(m["kw"], n) for m in REFERENCE.finditer(cell) for n in _numbers(m["list"])}


def sections(text: str) -> dict[str, list[list[str]]]:
    """Seed file -> the table rows (cells) under every heading that names it, up to the next heading."""
    out: dict[str, list[list[str]]] = {s: [] for s in SEEDS}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            current = [s for s in SEEDS if s in line]
        elif line.startswith("|") and current:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if cells and not set(cells[0]) <= set("-: ") and cells[0] not in ("Concept", "Feature"):
                for s in current:
                    out[s].append(cells)
    return out


MANIFEST = ROOT / "docs" / "seed-items.json"


def extracted(seed_dir: Path) -> dict[str, list[str]]:
    """Seed file -> its numbered items (:func:`seed_items`), sorted: what ``docs/seed-items.json`` keeps."""
    return {s: sorted(seed_items((seed_dir / s).read_text(encoding="utf-8"))) for s in SEEDS}


def manifest() -> dict[str, set[str]]:
    """The committed extraction (``python tests/test_paper_map.py --write`` with the seeds at hand), so the
    paper-map checks run in a checkout without the seed texts; a test with the seeds checks it is current."""
    return {s: set(v) for s, v in json.loads(MANIFEST.read_text(encoding="utf-8")).items()}


def missing_items(items: dict[str, set[str]], paper_map: str) -> dict[str, list[str]]:
    rows = sections(paper_map)
    out = {}
    for s in SEEDS:
        named = set().union(*(referenced_items(r[1]) for r in rows[s] if len(r) > 1)) if rows[s] else set()
        out[s] = sorted(set(items[s]) - set(EXCLUDED[s]) - named)
    return out


STATUS = re.compile(r"^(done|partial|missing|out of scope)\b")


def test_every_seed_has_a_section_and_every_row_a_status_and_a_place():
    rows = sections(PAPER_MAP.read_text(encoding="utf-8"))
    for s in SEEDS:
        assert rows[s], f"docs/paper-map.md has no heading naming {s}"
        for r in rows[s]:
            assert len(r) == 4, f"{s}: a row needs 4 cells (Concept | Paper | Status | Where): {r}"
            assert STATUS.match(r[2]), f"{s}: row {r[0]!r}: status {r[2][:40]!r} is not one of {STATUS.pattern}"
            assert r[3], f"{s}: row {r[0]!r} says nowhere where it lives (write - when nothing exists)"
            if r[2].startswith(("missing", "out of scope")):
                assert ":" in r[2] or "(" in r[2], f"{s}: row {r[0]!r}: say why it is {r[2]!r}"


def test_reference_parser():
    assert referenced_items("Defs 3.1.3-3.1.5, Props 3.1.1-3.1.2") == {
        "Definition 3.1.3", "Definition 3.1.4", "Definition 3.1.5", "Proposition 3.1.1", "Proposition 3.1.2"}
    assert referenced_items("Lemmas 13, 14, 16 and Alg. 1-3") == {
        "Lemma 13", "Lemma 14", "Lemma 16", "Algorithm 1", "Algorithm 2", "Algorithm 3"}
    assert referenced_items("Def 5.1 / C.4, Prop 5.12 (8), Thm 2.1, 2.3, (E.1)") == {
        "Definition 5.1", "Definition C.4", "Proposition 5.12", "Theorem 2.1", "Theorem 2.3"}
    assert referenced_items("Thms 4.10-4.13; Fig. 1, 4; Table 3.1, (3.4)") == {
        "Theorem 4.10", "Theorem 4.11", "Theorem 4.12", "Theorem 4.13", "Figure 1", "Figure 4", "Table 3.1"}


def test_seed_extraction_keeps_items_and_drops_citations():
    assert seed_items("By Theorem 5.13 and Lemma G.1 (see Def. 2), Table 3.1.") == {
        "Theorem 5.13", "Lemma G.1", "Definition 2", "Table 3.1"}
    assert seed_items("by [92, Theorem 15.6] and [160, Corollary 3.34]; this is Theorem 5.2.1 of [178].") == set()
    assert seed_items("Theorem 1 of Pensia et al. (2020), Theorem 1 in (Liu et al., 2023a), Theorem 3.3 in Li et al."
                      " (2024)") == set()
    assert seed_items("Theorems\n\nE.1 Part I; definitions.\n1.1 Language models; Figures 2.11c and 2.11d") == {
        "Figure 2.11"}
    assert seed_items("shown in Figures 2.14 and 2.16. By Lemmas 7-9, Theorem 2.1, we") == {
        "Figure 2.14", "Figure 2.16", "Lemma 7", "Lemma 8", "Lemma 9", "Theorem 2.1"}


@pytest.fixture(scope="module")
def seed_dir() -> Path:
    d = _seed_dir()
    if d is None:
        pytest.skip("the seed texts are not here (set PPL_THOUGHT_SEEDS or check out ../shared/seeds)")
    return d


def test_the_seeds_have_the_items_this_test_expects(seed_dir):
    """The extraction finds each seed's landmark items (so an empty extraction cannot pass), and every
    exclusion is still mentioned in its seed (a stale exclusion is removed)."""
    landmarks = {
        "slow-thinking-active-perception.txt": {"Lemma 2.1", "Definition 2.8", "Algorithm 3", "Figure L.2"},
        "data-training-inference-thesis.txt": {"Definition 3.2.1", "Table 3.1", "Algorithm 2", "Theorem 4.1.4"},
        "latent-thought-models.txt": {"Algorithm 1", "Figure 1", "Table 4"},
        "next-token-long-range.txt": {"Lemma 1", "Lemma 18", "Theorem 3", "Algorithm 1"},
        "cot-or-loop.txt": {"Theorem 5.13", "Lemma 5.11", "Definition C.4", "Table 1"},
    }
    for s in SEEDS:
        text = (seed_dir / s).read_text(encoding="utf-8")
        items = seed_items(text)
        assert landmarks[s] <= items, (s, landmarks[s] - items)
        for name in EXCLUDED[s]:
            assert name in items, f"{s}: exclusion {name} is no longer extracted: remove it"


def test_the_committed_manifest_is_the_seeds_extraction(seed_dir):
    assert {s: set(v) for s, v in extracted(seed_dir).items()} == manifest(), \
        "docs/seed-items.json is stale: python tests/test_paper_map.py --write"


def test_paper_map_names_every_numbered_item_of_every_seed():
    missing = missing_items(manifest(), PAPER_MAP.read_text(encoding="utf-8"))
    assert not any(missing.values()), "docs/paper-map.md lacks rows for: " + "; ".join(
        f"{s}: {', '.join(m)}" for s, m in missing.items() if m)


def test_deleting_a_row_is_caught():
    text, items = PAPER_MAP.read_text(encoding="utf-8"), manifest()
    assert not any(missing_items(items, text).values())
    for s, probe in (("cot-or-loop.txt", "Theorem 5.13"), ("data-training-inference-thesis.txt", "Definition 3.2.1"),
                     ("next-token-long-range.txt", "Lemma 18")):
        rows = [line for line in text.splitlines() if line.startswith("|") and probe in referenced_items(line)]
        assert rows, probe
        scratch = "\n".join(line for line in text.splitlines() if line not in rows)
        assert probe in missing_items(items, scratch)[s]


def test_paper_map_names_only_items_its_seed_has():
    """The reverse check: an item named in a seed's section exists in that seed (a wrong number, or a section
    number read as an item: "Def 2.8, 5.6.2" names a Definition 5.6.2, so write "Sec 5.6.2")."""
    rows, items = sections(PAPER_MAP.read_text(encoding="utf-8")), manifest()
    for s in SEEDS:
        named = set().union(*(referenced_items(r[1]) for r in rows[s]))
        unknown = named - items[s]
        assert not unknown, f"docs/paper-map.md names items that {s} does not have: {sorted(unknown)}"


if __name__ == "__main__":  # python tests/test_paper_map.py --write: refresh docs/seed-items.json from the seeds
    import sys

    d = _seed_dir()
    if "--write" not in sys.argv or d is None:
        raise SystemExit("usage: python tests/test_paper_map.py --write (with the seeds at ../shared/seeds or "
                         "PPL_THOUGHT_SEEDS)")
    MANIFEST.write_text(json.dumps(extracted(d), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {MANIFEST}")
