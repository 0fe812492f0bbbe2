"""Seconds to lift character automata to a 50,000-token vocabulary with ``token_automaton``.

The vocabulary is random strings of 1..12 characters (printable ASCII, with one string in 20 holding
a non-ASCII letter), the ids 0..5 being the library's specials. Cases: the lipogram "no letter e"
(1 DFA state), a regular expression of a few dozen states (capitalised words), bounded-depth Dyck
over three bracket types with free text between brackets (40 states), and the intersection of the
last two with the lipogram; each also with ``max_len=32`` (states count tokens); and, to show how the cost grows
with the reachable states, Dyck at depth 6 (one build, ``deep``). Reported: the build
seconds (best of N, and the first build's; without ``max_len`` also with one character per gather instead of
the k-character chunk table, to measure what the chunks save), the DFA and token-automaton state counts,
the table's size, the mean admissible tokens per state.

    python benchmarks/token_automata.py [--quick] [--json FILE] [--vocab N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

import ppl_thought.projections.token_lift as lift
from ppl_thought import provenance as pv
from ppl_thought.projections import CharDFA, token_automaton
from ppl_thought.vocab import RESERVED

REGEX = r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,4}[.!?]"


def random_vocab(n: int, seed: int = 0) -> list[str | None]:
    rng = np.random.default_rng(seed)
    ascii_chars = np.array([chr(c) for c in range(32, 127)])
    extra = np.array(list("éüßñçøΩжπ"))
    lengths = rng.integers(1, 13, size=n)
    out: list[str | None] = [None] * len(RESERVED)
    for length in lengths.tolist():  # building the test input, not the measured code
        chars = rng.choice(ascii_chars, size=length)
        if rng.random() < 0.05:
            chars[rng.integers(length)] = rng.choice(extra)
        out.append("".join(chars))
    return out


def time_build(dfa: CharDFA, texts: list[str | None], repeats: int, **kw) -> tuple[float, float, object]:
    """(first build's seconds, best of ``repeats``, the automaton)."""
    times, auto = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        auto = token_automaton(dfa, texts, **kw)
        times.append(time.perf_counter() - t0)
    return times[0], min(times), auto


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat (a smoke run)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--vocab", type=int, default=50_000, help="number of random token strings")
    parser.add_argument("--repeats", type=int, default=None, help="best of N builds (default 3, quick 1)")
    parser.add_argument("--deep-depth", type=int, default=6,
                        help="depth of the bracket language of the one-build scaling case (0: skip it)")
    args = parser.parse_args()
    run_record = pv.record(pv.script(__file__, None))  # before the run: the code that runs
    repeats = args.repeats or (1 if args.quick else 3)
    texts = random_vocab(args.vocab)

    t0 = time.perf_counter()
    lipo = CharDFA.lipogram("e")
    regex = CharDFA.from_regex(REGEX)
    dyck = CharDFA.dyck("()[]{}", depth=3, ignore_other=True)
    dyck_lipo = dyck & lipo
    compile_s = time.perf_counter() - t0
    cases = {"lipogram": lipo, "regex": regex, "dyck": dyck, "dyck_and_lipogram": dyck_lipo}
    results = {}
    for name, dfa in cases.items():
        for max_len in (None, 32):
            first, secs, auto = time_build(dfa, texts, repeats, max_len=max_len)
            key = name if max_len is None else f"{name}_max_len_32"
            results[key] = {
                "build_s": round(secs, 4),
                "first_build_s": round(first, 4),
                "table_mb": round(auto.next_state.nbytes / 2**20, 1),
                "dfa_states": dfa.num_states,
                "char_classes": dfa.num_classes,
                "token_states": auto.num_states,
                "mean_admissible_tokens": round(float(auto.allowed.sum(1).mean()), 1),
            }
            if max_len is None:  # the same build reading one character per gather (no chunk table)
                chunk = lift.MAX_CHUNK_COLUMNS
                lift.MAX_CHUNK_COLUMNS = 1
                try:
                    results[key]["build_s_one_char_per_gather"] = round(time_build(dfa, texts, repeats)[1], 4)
                finally:
                    lift.MAX_CHUNK_COLUMNS = chunk
            print(f"{key:28s} build {secs:7.3f} s (first {first:6.3f} s)   DFA {dfa.num_states:3d} states -> "
                  f"{auto.num_states:5d} token states, {results[key]['mean_admissible_tokens']:8.1f} admissible "
                  "tokens per state")
    deep = {}
    if args.deep_depth:  # how the build grows with the reachable states: one build, too slow to repeat
        deep_dfa = CharDFA.dyck("()[]{}", depth=args.deep_depth, ignore_other=True)
        secs, _, auto = time_build(deep_dfa, texts, 1)
        deep = {"depth": args.deep_depth, "dfa_states": deep_dfa.num_states, "token_states": auto.num_states,
                "build_s": round(secs, 4), "table_mb": round(auto.next_state.nbytes / 2**20, 1)}
        print(f"dyck depth {args.deep_depth:<17d} build {secs:7.3f} s (one build)   "
              f"DFA {deep_dfa.num_states} states -> {auto.num_states} token states")
    out = {
        "vocab": args.vocab + len(RESERVED),
        "token_lengths": [1, 12],
        "regex": REGEX,
        "compile_all_dfas_s": round(compile_s, 4),
        "repeats": repeats,
        "cases": results,
        "deep": deep,
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "processor": platform.machine(),
                    "cpus": os.cpu_count(), "load_average_1min_at_end": round(os.getloadavg()[0], 2)},
    }
    if args.json:
        with open(args.json, "w") as f:
            out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
