"""``ppl-thought reproduce`` (issue 42, item 2): the registry, --list, --only on a tiny command, the table JSON,
the verdict rules, and one-line errors with status 2. The real reproductions are not run here."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ppl_thought import cli
from ppl_thought import reproduce as rp

# a tiny "experiment": writes {"value": V} to the JSON named after --json
TINY = ("import json, sys; json.dump({'value': float(sys.argv[1])}, open(sys.argv[3], 'w'))")


def _tiny(name: str, value: str, path: str) -> rp.Reproduction:
    return rp.Reproduction(
        name, f"claim {name}", "paper figure", ("python", "-c", TINY, value, "--json", path), path,
        ours=lambda d: f"value {d['value']:.2f}",
        verdict=lambda d: "reproduced" if d["value"] > 1 else "direction only" if d["value"] > 0 else "contradicted",
        rule="value above 1", scale="tiny", minutes=0.01)


@pytest.fixture
def fake_checkout(tmp_path, monkeypatch):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    registry = (_tiny("tiny", "2.5", "benchmarks/results/tiny.json"),
                _tiny("other", "-1", "benchmarks/results/other.json"),
                replace(_tiny("broken", "1", "benchmarks/results/broken.json"),
                        command=("python", "-c", "import sys; sys.exit(3)")))  # a command that fails
    monkeypatch.setattr(rp, "ROOT", tmp_path)
    monkeypatch.setattr(rp, "REGISTRY", registry)
    return tmp_path


def test_list_prints_every_entry_and_runs_nothing(capsys):
    assert cli.main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for r in rp.REGISTRY:
        assert f"{r.name} (about" in out and " ".join(r.command) in out and r.rule in out
    assert {r.name for r in rp.REGISTRY} >= {"sec7", "ltm", "a5", "dyck"}
    assert len({r.name for r in rp.REGISTRY}) == len(rp.REGISTRY)  # names are unique


def test_only_runs_one_entry_writes_the_json_and_the_table(fake_checkout, capsys):
    assert cli.main(["reproduce", "--quick", "--only", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "[1/1] tiny: python -c" in out and "[1/1] tiny: done in" in out
    assert json.loads((fake_checkout / "benchmarks/results/tiny.json").read_text()) == {"value": 2.5}
    assert not (fake_checkout / "benchmarks/results/other.json").exists()  # --only: the other entries do not run
    table = json.loads((fake_checkout / rp.OUT_JSON).read_text())
    rows = {r["name"]: r for r in table["rows"]}
    assert table["ran"] == ["tiny"] and table["provenance"]["command"] == "ppl-thought reproduce --quick --only tiny"
    assert rows["tiny"]["ours"] == "value 2.50" and rows["tiny"]["verdict"] == "reproduced"
    assert rows["tiny"]["seconds"] >= 0
    assert rows["other"]["verdict"] == "not run" and "seconds" not in rows["other"]
    assert "| claim tiny (`tiny`) | paper figure | value 2.50 | tiny | **reproduced** |" in out  # the printed table
    assert "| claim other (`other`) | paper figure | - | tiny | **not run** |" in out


def test_a_failing_command_is_not_run_with_its_exit_status(fake_checkout, capsys):
    assert cli.main(["reproduce", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "[3/3] broken: failed (3)" in out
    rows = {r["name"]: r for r in json.loads((fake_checkout / rp.OUT_JSON).read_text())["rows"]}
    assert rows["broken"]["verdict"] == "not run" and "exit status 3" in rows["broken"]["ours"]
    assert rows["other"]["verdict"] == "contradicted" and rows["tiny"]["verdict"] == "reproduced"


@pytest.mark.parametrize("argv, words", [
    (["reproduce", "--quick", "--only", "nope"], "unknown reproduction 'nope'; choose from tiny, other, broken"),
    (["reproduce"], "add --quick"),
])
def test_bad_arguments_are_one_line_and_status_2(fake_checkout, capsys, argv, words):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ppl-thought reproduce: error: ") and words in err
    assert not (fake_checkout / rp.OUT_JSON).exists()  # nothing ran


def test_outside_a_checkout_it_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rp, "ROOT", tmp_path)
    assert cli.main(["reproduce", "--quick"]) == 2
    assert "not a checkout" in capsys.readouterr().err


def test_verdict_rules_on_hand_made_results():
    """Each rule of the registry on values where the answer is known: a falling / rising / mixed LTM sweep, a
    Section 7 interval above 0 / around 0 / below 0, the A5 ratio."""
    by = {r.name: r for r in rp.REGISTRY}

    def ltm(mean, se, per_seed):
        """benchmarks/ltm_tsweep.py's table: T_fast 4 and 16 (cosine arm) against T_fast = 0."""
        row = {"seeds": [0, 1], "common_iw_ppl": {"mean": 6.0}, "per_seed_iw_nats_vs_T0": per_seed,
               "iw_nats_vs_T0_per_sequence": {"mean": mean, "se": se, "n": 256}}
        return {"table": {"constant": {"0": {"common_iw_ppl": {"mean": 6.8}}},
                          "cosine": {"4": {**row, "iw_nats_vs_T0_per_sequence": {"mean": 9.0, "se": 0.1, "n": 256}},
                                     "16": row}}}

    assert by["ltm"].verdict(ltm(-0.156, 0.01, [-0.15, -0.16])) == "reproduced"  # the committed sweep's T_fast 16
    assert by["ltm"].verdict(ltm(-0.156, 0.01, [-0.3, 0.01])) == "direction only"  # one seed the other way
    assert by["ltm"].verdict(ltm(-0.01, 0.01, [-0.01, -0.01])) == "direction only"  # within 2 s.e.
    assert by["ltm"].verdict(ltm(0.006, 0.01, [0.01, 0.002])) == "contradicted"
    assert "T_fast 16 - 0: -0.156 ± 0.010 nats/token (2 seeds x 128 sequences" in by["ltm"].ours(
        ltm(-0.156, 0.01, [-0.15, -0.16]))  # the largest T_fast, not T_fast 4

    def sec7(mean, lo, hi):
        return {"summary": {"8": {"gain_difference": {"mean": mean}, "seeds": [0, 1, 2],
                                  "relative_improvement": {"difference_ci95": [lo, hi]}}}}

    assert by["sec7"].verdict(sec7(0.1, 0.01, 0.2)) == "reproduced"
    assert by["sec7"].verdict(sec7(0.05, -0.01, 0.2)) == "direction only"
    assert by["sec7"].verdict(sec7(-0.05, -0.1, 0.01)) == "contradicted"
    assert "[-0.100, +0.010]" in by["sec7"].ours(sec7(-0.05, -0.1, 0.01))
    assert by["a5"].verdict({"plain_excess_nats": 0.61, "latent_excess_nats": 0.2}) == "reproduced"
    assert by["a5"].verdict({"plain_excess_nats": 0.5, "latent_excess_nats": 0.2}) == "direction only"
    assert by["a5"].verdict({"plain_excess_nats": 0.2, "latent_excess_nats": 0.5}) == "contradicted"


def test_a_json_without_the_result_is_not_run(tmp_path):
    r = _tiny("tiny", "1", "x.json")
    (tmp_path / "x.json").write_text(json.dumps({"something": "else"}))
    (row,) = rp.table_rows(tmp_path, [r])
    assert row["verdict"] == "not run" and "KeyError" in row["ours"]


def test_the_committed_table_is_the_registry():
    """reproduce_quick.json has one row per registry entry, in order, and its verdicts are among the four."""
    d = json.loads((Path(rp.ROOT) / rp.OUT_JSON).read_text())
    assert [r["name"] for r in d["rows"]] == [r.name for r in rp.REGISTRY]
    assert {r["verdict"] for r in d["rows"]} <= set(rp.VERDICTS)
    assert d["provenance"]["commit"] and d["provenance"]["command"].startswith("ppl-thought reproduce")


def test_the_python_of_a_command_is_this_interpreter():
    assert rp._argv(("python", "-m", "x"))[0] == sys.executable
    assert rp._argv(("ppl-thought", "demo"))[-1] == "demo"


def test_a_partial_json_shows_its_numbers_and_no_verdict(tmp_path):
    """A run stopped before its last replicate (sec7 writes ``"partial": true`` after each seed) is not run."""
    r = _tiny("tiny", "1", "x.json")
    (tmp_path / "x.json").write_text(json.dumps({"value": 2.0, "partial": True}))
    (row,) = rp.table_rows(tmp_path, [r])
    assert row["verdict"] == "not run" and row["ours"] == "partial run, stopped early: value 2.00"
    (tmp_path / "x.json").write_text(json.dumps({"value": 2.0, "partial": False}))
    assert rp.table_rows(tmp_path, [r])[0]["verdict"] == "reproduced"
