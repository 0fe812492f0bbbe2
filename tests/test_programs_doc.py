"""The first program of docs/programs.md, run as the page shows it, against the exact p(answer | question).

The page's code blocks are executed as they are (so the page cannot drift from the library); the exact answer
enumerates every thought the program can write (two tokens at most) by running the program itself on all of
them as particles (``poutine.condition``), as examples/custom_program.py does.
"""

from __future__ import annotations

import itertools
import math
import pathlib
import re

import pyro
import pyro.poutine as poutine
import torch

from ppl_thought.vocab import PAD_ID

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "programs.md"


def doc_blocks() -> list[str]:
    text = DOC.read_text()
    first = text[: text.index("## Writing your own program")]
    return re.findall(r"```python\n(.*?)```", first, flags=re.S)


def run_page() -> dict:
    ns: dict = {}
    pyro.set_rng_seed(0)
    program, usage = doc_blocks()
    exec(program, ns)  # noqa: S102 - the page's own code
    with torch.no_grad():
        exec(usage.replace("512", "4000").replace("res = pt.infer.SMC", "res_smc = pt.infer.SMC"), ns)  # noqa: S102
    return ns


def exact_log_z(ns) -> float:
    """log p(answer | question): the program run on every thought it can write (the stop token, or two tokens
    the first of which is not the stop token), all at once as particles."""
    model, q, a = ns["Think"](ns["lm"], end=7), ns["q"], ns["a"]
    toks = range(2, 8)  # what an LMState generates from a vocabulary of 8 (not <pad>, <bos>)
    thoughts = [[7]] + [[x, y] for x, y in itertools.product(toks, toks) if x != 7]  # 31 thoughts
    data = {"thought": torch.tensor([t + [PAD_ID] * (2 - len(t)) for t in thoughts])}

    def run():
        with pyro.plate("particles", len(thoughts)):
            model(q, a)

    with torch.no_grad():
        tr = poutine.trace(poutine.condition(run, data=data)).get_trace()
        tr.compute_log_prob()
    log_prior = tr.nodes["thought"]["log_prob"]
    assert abs(float(torch.logsumexp(log_prior, 0))) < 1e-4, "the enumeration misses thoughts"
    log_joint = sum(s["log_prob"] for s in tr.nodes.values() if s["type"] == "sample")
    return float(torch.logsumexp(log_joint, 0))


def test_first_program_matches_the_exact_answer():
    ns = run_page()
    exact = exact_log_z(ns)
    for name in ("res", "res_smc"):  # Importance, SMC
        res = ns[name]
        se = float(res.log_marginal_stderr) if res.log_marginal_stderr is not None else 0.05
        assert abs(float(res.log_marginal) - exact) < 3 * se + 0.02, (float(res.log_marginal), exact, se)
    assert math.isfinite(exact)
    assert ns["out"].outputs["answer"].shape == (1,)  # decode: the answer the program generated
