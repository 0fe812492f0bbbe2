"""The program x guide x engine matrix on both backends against the same exact answers (issue 29).

The torch side builds the models of tests/test_program_matrix.py (SlowThinking with PauseToThink, SparseThoughts and
QueryResponse; the HMM, on the JAX side both ``ptn.models.HMM.program`` with ``ptn.guides.HMMGuide`` and the user's
HMM program of tests/test_numpyro_program.py; the user program with two latent sequence sites per step) and their
exact answers (enumeration of the lifting (2.22), the forward algorithm (3.1), enumeration of every latent
configuration). The JAX side (tests/_jax_matrix_worker.py) runs in a subprocess with torch and pyro blocked, loads
the same LM tables, and runs Importance and SMC (the generic engine core: SlowThinking as ``model.program(x)``, its
guide as ``guide.program(x)``) for every guide family the JAX side has (the torch-only Inquisitive sampler is left
out), over fixed seeds. Each cell passes the torch matrix's bound (``check_unbiased``: mean Z-hat / Z within 3 SE of
1, and one Importance run within 3 delta-method SE); a JAX guide that forgets one proposal factor fails that bound
(Importance and SMC). Without ``--slow`` the cells are the PauseToThink row less Causal and Explanatory (the
guide family of Predictive) and Identity (the guide-program path of Posterior and Predictive), two HMM cells (the
library's HMM with HMMGuide.posterior, the user's HMM with its filtering guide) and one user cell.

Decode cells (issue 40): ``pt.infer.decode`` and ``ptn.infer.decode`` on the user's HMM written as a decoding
program (the first 3 observations the prompt, the last 2 outputs; the same A, B, lambda on both backends), against
the exact laws by enumeration of the 3^5 state paths. ``best_of_k`` with a guide that proposes every path once
(K = 243 particles, a point mass each) scores each candidate y by exactly log p(prompt, y) - log K (within 1e-5 of
the enumeration; on both backends, of each other on a shared candidate) and picks the best one; ``resampling``
(3.14) with that guide draws from the exact predictive law p(y | prompt) and ``direct`` (3.12) without a guide from
the prior predictive law, each within two standard deviations of sampling noise. Without ``--slow`` only the torch
side's best-of-K runs (each JAX decode cell is two XLA compiles; the default run keeps its CPU time); ``--slow``
runs all three on both backends.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("pyro.distributions")
pytest.importorskip("jax")
pytest.importorskip("numpyro")

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("torch_matrix", ROOT / "tests" / "test_program_matrix.py")
M = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(M)

JAX_GUIDES = ["identity", "predictive", "causal", "explanatory", "posterior", "bootstrap"]
FULL = [(m, g) for m in ("pause", "sparse", "query_response") for g in JAX_GUIDES] + \
       [("hmm", "posterior"), ("hmm", "filtering"), ("hmm", "bootstrap"), ("hmm_user", "filtering"),
        ("hmm_user", "bootstrap"), ("user", "user_guide"), ("user", "bootstrap")]
# the default run: each cell costs two XLA compiles (Importance, SMC; the seeds after the first are ~10 ms), so
# Predictive stands for the three LM guides (Causal and Explanatory run with --slow); Identity (the model's prior
# program as the guide) runs the same guide-program path as Posterior and Predictive (and its weights are checked
# exactly against torch by default in tests/test_numpyro_backend.py); ptn.guides.HMMGuide.filtering is the class
# of HMMGuide.posterior in another configuration (the filtering proposal of a program runs by default as the user's
# HMMFilter): both with --slow
QUICK = [("pause", g) for g in JAX_GUIDES if g not in ("causal", "explanatory", "identity")] + \
        [("hmm", "posterior"), ("hmm_user", "filtering"), ("user", "user_guide")]
WRONG = ("user", "wrong")  # a guide that forgets one proposal factor: the same bound must fail
# decode cells [model, guide, "decode:METHOD", n, num_samples]: by default the torch side's exact best-of-K (the
# JAX side's two XLA compiles per cell would make the default run slower); with --slow every cell on both backends
DECODE_T, DECODE_P = 5, 3
DECODE_QUICK = [["hmm_decode", "enumerate", "decode:best_of_k", 3 ** DECODE_T, 1]]
DECODE_SLOW = DECODE_QUICK + [["hmm_decode", "enumerate", "decode:resampling", 3 ** DECODE_T, 1000],
                              ["hmm_decode", "none", "decode:direct", 1, 2000]]
PATHS = np.array(list(itertools.product(range(3), repeat=DECODE_T)), np.int64)  # every state path z_0 .. z_4


class TorchHMMDecode(M.pt.Program):
    """The user HMM as a decoding program on the torch side: x_t observed for t < len(x) (the prompt), an output
    after (``pt.observe(name, d, None)``), T steps."""

    def __init__(self, hmm, T: int):
        self.A, self.B, self.lam, self.T = hmm.A, hmm.B, hmm.lam, T

    def init(self, state, x):
        state["z"] = torch.zeros(M.pt.particles(), dtype=torch.long)

    def step(self, state, t, x):
        n = M.pt.particles()
        probs = self.lam.expand(n, 3) if t == 0 else self.A[state["z"]]
        z = M.pt.sample(f"z_{t}", dist.Categorical(probs))
        state["z"] = z
        M.pt.observe(f"x_{t}", dist.Categorical(self.B[z]), x[t].expand(n) if t < len(x) else None)
        return torch.ones(n, dtype=torch.bool) if t + 1 == self.T else None


class TorchEnumerateZ(M.pt.Program):
    """Particle i proposes the path ``PATHS[i % K]`` (a point mass: log q = 0)."""

    def step(self, state, t, x):
        n = M.pt.particles()
        z = torch.as_tensor(PATHS)[torch.arange(n) % len(PATHS), t]
        M.pt.sample(f"z_{t}", dist.Categorical(torch.nn.functional.one_hot(z, 3).double()))
        return torch.ones(n, dtype=torch.bool) if t + 1 == DECODE_T else None


def decode_exact() -> tuple[dict, dict, dict]:
    """(log p(prompt, y), the predictive law p(y | prompt), the prior predictive law of y) by enumeration of the
    state paths, y = (x_3, x_4) the outputs, the prompt the first 3 observations of the matrix's x."""
    hmm, hx = M.hmm()
    A, B, lam = (a.double().numpy() for a in (hmm.A, hmm.B, hmm.lam))
    x = hx.numpy()[:DECODE_P]
    joint, prior = {}, {}
    for y in itertools.product(range(2), repeat=DECODE_T - DECODE_P):
        obs = np.concatenate([x, y])
        j = pr = 0.0
        for z in PATHS:
            pz = lam[z[0]] * np.prod([A[z[t - 1], z[t]] for t in range(1, DECODE_T)])
            j += pz * np.prod([B[z[t], obs[t]] for t in range(DECODE_T)])
            pr += pz * np.prod([B[z[t], obs[t]] for t in range(DECODE_P, DECODE_T)])
        joint[y], prior[y] = math.log(j), pr
    z = sum(math.exp(v) for v in joint.values())
    return joint, {y: math.exp(v) / z for y, v in joint.items()}, prior


def torch_decode_cell(guide_kind: str, method: str, n: int, samples: int) -> dict:
    hmm, hx = M.hmm()
    torch.manual_seed(7)
    M.pyro.set_rng_seed(7)
    guide = TorchEnumerateZ() if guide_kind == "enumerate" else None
    out = M.pt.infer.decode(TorchHMMDecode(hmm, DECODE_T), guide, hx[:DECODE_P], method=method, n=n,
                            num_samples=samples, k=4)
    cell = {"tokens": out.tokens.tolist()}
    if method == "best_of_k":
        cell["candidates"] = out.stats["candidate_tokens"].tolist()
        cell["scores"] = [float(v) for v in out.stats["scores"]]
    return cell


def check_decode(key: str, cell: dict, backend: str) -> None:
    """A decode cell of one backend against the exact answers (module docstring)."""
    joint, predictive, prior = decode_exact()
    method = key.split("|")[2][7:]
    if method == "best_of_k":
        cands = [tuple(int(v) for v in c) for c in cell["candidates"]]
        for c, score in zip(cands, cell["scores"]):
            assert abs(score + math.log(len(PATHS)) - joint[c]) < 1e-5, (backend, key, c, score, joint[c])
        best = max(range(len(cands)), key=lambda i: cell["scores"][i])
        assert tuple(cell["tokens"][0]) == cands[best], (backend, key)
        return
    want = predictive if method == "resampling" else prior
    rows = [tuple(int(v) for v in r) for r in cell["tokens"]]
    got = {y: rows.count(y) / len(rows) for y in want}
    noise = 0.5 * sum(2 * math.sqrt(p * (1 - p) / len(rows)) for p in want.values()) + 0.01
    assert 0.5 * sum(abs(got[y] - want[y]) for y in want) < noise, (backend, key, got, want)


def torch_side() -> tuple[dict, dict]:
    """(the LM tables and data for the JAX side, the torch side's exact log p(x) per model kind)."""
    spec = {f"tab{k}": M.tab(k, scale=0.4 if k in (3, 4, 5, 8) else 1.2, order=2 if k in (6, 8) else 3)
            .logits.detach().numpy() for k in (3, 4, 5, 6, 7, 8)}
    spec["tab0"] = M.tab(0).logits.detach().numpy()
    exact = {}
    for kind in ("pause", "sparse", "query_response"):
        model, x = M.slow_thinking(kind)
        exact[kind] = float(model.exact_log_prob(x))
    hmm, hx = M.hmm()
    spec.update(hmm_A=hmm.A.numpy(), hmm_B=hmm.B.numpy(), hmm_lam=hmm.lam.numpy(), hmm_x=hx.numpy())
    exact["hmm"] = exact["hmm_user"] = float(hmm.log_prob(hx))
    user, ux = M.user_program()
    spec["user_x"] = ux.numpy()
    exact["user"] = M.user_exact_log_prob(user, ux)
    spec.update(decode_T=np.int64(DECODE_T), decode_P=np.int64(DECODE_P), decode_paths=PATHS)
    return spec, exact


def particles(model_kind: str, guide_kind: str) -> int:
    """A bootstrap from the prior mostly misses x: 1024. The user guide's weights are heavy-tailed (n * SE^2 of
    log Z-hat, an estimate of chi2(p || q), is about 26 at n = 4096), so 64 particles give a mean Z-hat over 32
    seeds that sits low by several of its own, underestimated, SEs: 256."""
    if guide_kind == "bootstrap" and not model_kind.startswith("hmm"):
        return 1024
    return 256 if guide_kind in ("user_guide", "wrong") else 64


def test_matrix_on_both_backends_against_the_same_exact_answers(request, tmp_path):
    slow = request.config.getoption("--slow")
    cells = FULL if slow else QUICK
    seeds = 240 if slow else 32
    spec, exact = torch_side()
    np.savez(tmp_path / "spec.npz", **spec)
    todo = [[m, g, e, particles(m, g), seeds] for m, g in [*cells, WRONG] for e in ("Importance", "SMC")]
    decode_cells = DECODE_SLOW if slow else DECODE_QUICK
    jax_decode = DECODE_SLOW if slow else []  # two XLA compiles per decode cell: the JAX side with --slow
    todo += jax_decode
    (tmp_path / "cells.json").write_text(json.dumps(todo))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "_jax_matrix_worker.py"), str(tmp_path / "spec.npz"),
                        str(tmp_path / "cells.json"), str(tmp_path / "out.json")], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=3000)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out) == len(todo)
    torch_decoded = {}
    for m, g, e, n, s in decode_cells:  # the torch side of the decode cells, in this process
        key = f"{m}|{g}|{e}"
        torch_decoded[key] = torch_decode_cell(g, e[7:], n, s)
        check_decode(key, torch_decoded[key], "torch")
        if key not in out:
            continue
        check_decode(key, out[key], "JAX")
        if e == "decode:best_of_k":  # both exact: a candidate both drew has the same score within 1e-5
            jax_scores = {tuple(c): v for c, v in zip(out[key]["candidates"], out[key]["scores"])}
            t_cell = torch_decoded[key]
            shared = [(v, jax_scores[tuple(c)]) for c, v in zip(t_cell["candidates"], t_cell["scores"])
                      if tuple(c) in jax_scores]
            assert shared and all(abs(a - b) < 1e-5 for a, b in shared), (key, shared)
    for key, cell in out.items():
        model_kind, guide_kind, engine = key.split("|")
        if engine.startswith("decode:"):
            continue
        log_z = torch.tensor(cell["log_z"], dtype=torch.float64)
        ses = torch.tensor(cell["ses"], dtype=torch.float64)
        if cell["jax_exact"] is not None:  # the JAX enumeration agrees with the torch one
            assert abs(cell["jax_exact"] - exact[model_kind]) < 1e-5, key
        assert not torch.isnan(log_z).any() and torch.isfinite(log_z).double().mean() > 0.9, key
        if guide_kind == "wrong":  # the bound has teeth on the JAX side too
            with pytest.raises(AssertionError):
                M.check_unbiased(log_z, exact[model_kind], ses, f"JAX {key}")
            continue
        M.check_unbiased(log_z, exact[model_kind], ses, f"JAX {key}")
        if guide_kind == "posterior" and (model_kind != "hmm" or engine == "Importance"):
            # the zero-variance proposal: Z-hat = Z exactly on the JAX side too (the HMM's step-wise posterior
            # only for whole traces: its per-step weights vary until the last step, as on the torch side)
            assert torch.allclose(log_z, torch.full_like(log_z, exact[model_kind]), atol=1e-4), key


def test_one_site_naming_rule_the_torch_helpers_stack_a_name_sampled_at_every_step():
    """docs/architecture.md, "Site names": ``"z"`` at every step (the JAX rule) is ``samples["z"] [n, steps]`` on
    the torch side too (ppl_thought/inference/result.py's helpers, for SMC to call); ``z_{t}`` stays per step;
    a name of init sampled in a step, a name that skips a step, or one whose shape changes is an error."""
    from ppl_thought.errors import ProgramError
    from ppl_thought.inference.result import record_sites, stacked_samples

    values, seen = {}, {}
    record_sites(values, seen, {"c": (torch.tensor([7, 8]), 0)}, None)
    for t in range(3):
        record_sites(values, seen, {"z": (torch.tensor([t, 10 + t]), 0), f"w_{t}": (torch.tensor([[t, -t]]), 1)}, t)
    samples = stacked_samples(values)
    assert samples["z"].tolist() == [[0, 1, 2], [10, 11, 12]] and samples["c"].tolist() == [7, 8]
    assert samples["w_1"].tolist() == [[1], [-1]]  # particle dim 1 moved to the front, one step: as it is
    with pytest.raises(ProgramError, match="init and again"):
        record_sites(values, seen, {"c": (torch.tensor([1, 2]), 0)}, 3)
    with pytest.raises(ProgramError, match="not in the steps between"):
        record_sites(values, seen, {"z": (torch.tensor([1, 2]), 0)}, 4)
    v2, s2 = {}, {}
    record_sites(v2, s2, {"seg": (torch.zeros(2, 3), 0)}, 0)
    record_sites(v2, s2, {"seg": (torch.zeros(2, 4), 0)}, 1)
    with pytest.raises(ProgramError, match="one shape"):
        stacked_samples(v2)
