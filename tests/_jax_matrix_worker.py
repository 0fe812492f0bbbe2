"""The JAX half of tests/test_program_matrix_backends.py, run in a subprocess with torch and pyro blocked:
``python tests/_jax_matrix_worker.py SPEC.npz CELLS.json OUT.json``.

SPEC holds the LM tables the torch side built (the same weights on both backends); CELLS lists
``[model_kind, guide_kind, engine, n, seeds]``; OUT gets, per cell, the log Z-hat of every seed and the
delta-method SE of each Importance run (Importance: (3.2); SMC: the generic engine core over
``ptn.Program``s, SlowThinking as ``model.program(x)`` with ``guide.program(x)``). A decode cell
(``engine = "decode:METHOD"``, model ``"hmm_decode"``: the user's HMM with a prompt of 3 observations and 2
output steps) gets ``ptn.infer.decode``'s output tokens, and for ``best_of_k`` every candidate and its score."""

import json
import os
import sys

sys.modules["torch"] = None  # the JAX side must not need torch or pyro
sys.modules["pyro"] = None
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as nd  # noqa: E402

import ppl_thought.numpyro as ptn  # noqa: E402
from ppl_thought.errors import ZeroWeightsError  # noqa: E402
from ppl_thought.numpyro.dist import LMState, TokenRule  # noqa: E402
from ppl_thought.projections import PauseToThink, QueryResponse, SparseThoughts  # noqa: E402
from ppl_thought.projections.automaton import Automaton  # noqa: E402
from ppl_thought.vocab import Vocab  # noqa: E402

VOCAB = Vocab(["a", "b"])
V = len(VOCAB)
A, B, STOP = VOCAB.id("a"), VOCAB.id("b"), VOCAB.id("</s>")
THOUGHT = Automaton(next_state=[[0 if v in (A, B, STOP) else -1 for v in range(V)]], final=[False], emitted=[0],
                    start=0)


def slow_thinking(kind: str, spec):
    if kind == "pause":
        proj, x = PauseToThink(VOCAB, max_thought_len=2), "a b a"
    elif kind == "sparse":
        proj, x = SparseThoughts(VOCAB, thought_len=1, positions=[0, 2]), "a b a"
    else:
        proj, x = QueryResponse(VOCAB, max_thought_len=1), "a <eos> b"
    return ptn.models.SlowThinking(ptn.lm.Tabular.from_numpy(spec["tab0"]), proj), x


def slow_thinking_guide(name: str, model, spec):
    proj = model.projection
    lm = {k: ptn.lm.Tabular.from_numpy(spec[f"tab{k}"]) for k in (3, 4, 5)}
    return {"identity": lambda: ptn.guides.Identity(model),
            "predictive": lambda: ptn.guides.Predictive(lm[3], proj),
            "causal": lambda: ptn.guides.Causal(lm[4], proj),
            "explanatory": lambda: ptn.guides.Explanatory(lm[5], proj),
            "posterior": lambda: ptn.guides.Posterior(model), "bootstrap": lambda: None}[name]()


class HMM(ptn.Program):
    """Def 2.2 as a program: z_t ~ A[z_{t-1}] (lambda at t = 0), x_t ~ B[z_t] observed."""

    def __init__(self, A_, B_, lam, T: int):
        self.A, self.B, self.lam, self.max_steps = jnp.asarray(A_), jnp.asarray(B_), jnp.asarray(lam), T

    def init(self, state, x):
        state["z"] = jnp.zeros(ptn.particles(), jnp.int32)

    def step(self, state, t, x):
        probs = jnp.where(t == 0, self.lam[None], self.A[state["z"]])
        z = ptn.sample("z", nd.Categorical(probs=probs))
        ptn.observe("x", nd.Categorical(probs=self.B[z]), x[t])
        state["z"] = z
        return jnp.broadcast_to(t == x.shape[0] - 1, z.shape)


class HMMFilter(HMM):
    """The locally optimal proposal q(z_t | z_{t-1}, x_t) proportional to A[z_{t-1}, z_t] B[z_t, x_t]."""

    def step(self, state, t, x):
        prior = jnp.where(t == 0, self.lam[None], self.A[state["z"]])
        w = prior * self.B[:, x[t]][None]
        state["z"] = ptn.sample("z", nd.Categorical(probs=w / w.sum(-1, keepdims=True)))
        return jnp.broadcast_to(t == x.shape[0] - 1, state["z"].shape)


class PlanThinkAnswer(ptn.Program):
    """The torch matrix's user program (tests/test_program_matrix.py) in NumPyro: per step a one-token plan and a
    thought of up to two tokens from a thinker LM, then the answer x_t from a speaker LM that read them."""

    def __init__(self, thinker, speaker, T: int):
        self.thinker, self.speaker, self.max_steps = thinker, speaker, T

    def init(self, state, x):
        n = ptn.particles()
        state["think"] = LMState.start(self.thinker, n, rule=TokenRule(THOUGHT, V), max_len=3 * self.max_steps)
        state["speak"] = LMState.start(self.speaker, n, max_len=4 * self.max_steps)

    def step(self, state, t, x):
        think, speak = state["think"], state["speak"]
        plan = ptn.sample("plan", think.segment(max_tokens=1))
        think.extend(plan)
        speak.extend(plan)
        thought = ptn.sample("thought", think.segment(stop=STOP, max_tokens=2))
        think.extend(thought)
        speak.extend(thought)
        speak.extend(ptn.observe("x", speak.next_token(), x[t]))
        return jnp.broadcast_to(t == x.shape[0] - 1, (speak.n,))


class PlanThinkGuide(PlanThinkAnswer):
    def init(self, state, x):
        state["think"] = LMState.start(self.thinker, ptn.particles(), rule=TokenRule(THOUGHT, V),
                                       max_len=3 * self.max_steps)

    def step(self, state, t, x):
        think = state["think"]
        think.extend(ptn.sample("plan", think.segment(max_tokens=1)))
        think.extend(ptn.sample("thought", think.segment(stop=STOP, max_tokens=2)))
        return jnp.broadcast_to(t == x.shape[0] - 1, (think.n,))


class DropsOneProposalTerm(PlanThinkGuide):
    """A deliberately wrong weight: the guide's thought at step 0 is sampled but not scored (log q = 0)."""

    def step(self, state, t, x):
        think = state["think"]
        think.extend(ptn.sample("plan", think.segment(max_tokens=1)))
        with numpyro.handlers.mask(mask=t != 0):
            think.extend(ptn.sample("thought", think.segment(stop=STOP, max_tokens=2)))
        return jnp.broadcast_to(t == x.shape[0] - 1, (think.n,))


class HMMDecode(HMM):
    """The user HMM as a decoding program: x_t observed for t < len(x) (the prompt), an output ``"y"`` after
    (``ptn.observe(..., None)``, masked before the end of the prompt), ``max_steps`` steps in all."""

    def step(self, state, t, x):
        probs = jnp.where(t == 0, self.lam[None], self.A[state["z"]])
        z = ptn.sample("z", nd.Categorical(probs=probs))
        state["z"] = z
        P = x.shape[0]
        d = nd.Categorical(probs=self.B[z])
        with numpyro.handlers.mask(mask=t < P):
            ptn.observe("x", d, x[jnp.minimum(t, P - 1)])
        with numpyro.handlers.mask(mask=t >= P):
            ptn.observe("y", d, None)
        return jnp.broadcast_to(t == self.max_steps - 1, z.shape)


class EnumerateZ(ptn.Program):
    """A guide proposing the state path ``table[i % K]`` to particle i (a point mass: log q = 0), so the log weights
    of K particles (or of any multiple of K) are log p(x, z_k) for every path z_k once: best-of-K's scores are then
    exact, log p(x y) - log K."""

    def __init__(self, table):
        self.table = jnp.asarray(table, jnp.int32)  # [K, T]
        self.max_steps = int(self.table.shape[1])

    def step(self, state, t, x):
        n = ptn.particles()
        z = self.table[jnp.arange(n) % self.table.shape[0], t]
        ptn.sample("z", nd.Categorical(probs=jax.nn.one_hot(z, 3)))


def decode_cell(guide_kind: str, method: str, n: int, samples: int, spec) -> dict:
    x = jnp.asarray(spec["hmm_x"], jnp.int32)
    T, P = int(spec["decode_T"]), int(spec["decode_P"])
    model = HMMDecode(spec["hmm_A"], spec["hmm_B"], spec["hmm_lam"], T)
    guide = EnumerateZ(spec["decode_paths"]) if guide_kind == "enumerate" else None
    out = ptn.infer.decode(model, guide, x[:P], method=method, n=n, num_samples=samples, k=4, rng_key=7)
    cell = {"tokens": np.asarray(out.tokens).tolist()}
    if method == "best_of_k":
        cell["candidates"] = np.asarray(out.stats["candidate_tokens"]).tolist()
        cell["scores"] = np.asarray(out.stats["scores"]).tolist()
    return cell


def build(model_kind: str, guide_kind: str, spec):
    if model_kind == "hmm":  # ptn.models.HMM as a program, with ptn.guides.HMMGuide (posterior, filtering)
        x = jnp.asarray(spec["hmm_x"], jnp.int32)
        hmm = ptn.models.HMM(spec["hmm_A"], spec["hmm_B"], spec["hmm_lam"])
        guide = {"posterior": ptn.guides.HMMGuide.posterior, "filtering": ptn.guides.HMMGuide.filtering}.get(guide_kind)
        return hmm.program(x), (guide(hmm).program(x) if guide is not None else None), x
    if model_kind == "hmm_user":  # the user's HMM program of tests/test_numpyro_program.py
        x = jnp.asarray(spec["hmm_x"], jnp.int32)
        args = (spec["hmm_A"], spec["hmm_B"], spec["hmm_lam"], len(x))
        return HMM(*args), (HMMFilter(*args) if guide_kind == "filtering" else None), x
    if model_kind == "user":
        x = jnp.asarray(spec["user_x"], jnp.int32)
        tl = {k: ptn.lm.Tabular.from_numpy(spec[f"tab{k}"]) for k in (6, 7, 8)}
        model = PlanThinkAnswer(tl[6], tl[7], len(x))
        guide = {"user_guide": PlanThinkGuide, "wrong": DropsOneProposalTerm}.get(guide_kind)
        return model, (guide(tl[8], None, len(x)) if guide is not None else None), x
    model, x = slow_thinking(model_kind, spec)
    return model, slow_thinking_guide(guide_kind, model, spec), x


def main() -> None:
    spec = dict(np.load(sys.argv[1]))
    cells = json.load(open(sys.argv[2]))
    out, exacts = {}, {}
    for model_kind, guide_kind, engine, n, seeds in cells:
        if engine.startswith("decode:"):
            out[f"{model_kind}|{guide_kind}|{engine}"] = decode_cell(guide_kind, engine[7:], n, seeds, spec)
            continue
        model, guide, x = build(model_kind, guide_kind, spec)
        eng = ptn.infer.Importance(n) if engine == "Importance" else ptn.infer.SMC(n, ess_threshold=0.5)
        log_z, ses = [], []
        for s in range(seeds):
            try:
                r = eng.run(model, guide, x, rng_key=jax.random.PRNGKey(s))
                log_z.append(float(r.log_marginal))
                if engine == "Importance":
                    ses.append(float(r.log_marginal_stderr))
            except ZeroWeightsError:  # Z-hat = 0: a legitimate draw of the estimator
                log_z.append(float("-inf"))
                if engine == "Importance":
                    ses.append(float("inf"))
        if model_kind not in exacts:  # once per model kind (a new model instance would compile its scorer again)
            exacts[model_kind] = float(model.exact_log_prob(x)) if hasattr(model, "exact_log_prob") else None
        exact = exacts[model_kind]
        out[f"{model_kind}|{guide_kind}|{engine}"] = {"log_z": log_z, "ses": ses, "jax_exact": exact}
    assert sys.modules.get("torch") is None and sys.modules.get("pyro") is None
    json.dump(out, open(sys.argv[3], "w"))


if __name__ == "__main__":
    main()
