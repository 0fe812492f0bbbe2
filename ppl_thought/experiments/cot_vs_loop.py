"""To CoT or to loop (cot-or-loop.txt): a looped Transformer vs chain-of-thought, and Theorem 5.13's rejection step.

    python -m ppl_thought.experiments.cot_vs_loop [--quick] [--seed S] [--json FILE]

Part 1, Section 4 (parallel computation, Theorems 4.4 / 4.7): a computation graph (Definition 4.1) with exact
labels, computed by the generator (:class:`TreeTask`): ``trees`` complete binary trees of depth ``depth`` over
leaves in ``Z_k``, every internal node one fixed random table ``f(left, right)``, the outputs the roots. With the
defaults (2 trees of depth 2, 8 leaves) the graph has depth 2 and 6 internal nodes, 4 of them not outputs. Two
models with *the same parameters* (one :class:`~ppl_thought.lm.looped.Looped` block, same width, heads, positions
and vocabulary; only the attention mask differs) are trained on the same stream of fresh random inputs:

* **loop** (Definition 2.2): the sequence is the graph itself, the leaves followed by one placeholder per
  internal node in level order; full attention; ``T`` loops; the loss is the cross-entropy of every internal
  node's value at its own position after ``T`` loops; the answer is read at the output positions.
* **cot** (Definition 2.1): a causal decoder (the same block, one pass per token) reads the leaves and writes
  ``T`` thought tokens, the values of the first ``T`` internal nodes in topological (level) order, then the
  outputs; trained by teacher forcing on thoughts and outputs, evaluated by greedy decoding.

Accuracy is the fraction of held-out inputs whose outputs are all right (``chance``: always answering the most
frequent output pair). Theorem 4.7 says loops proportional to the depth suffice (here ``T = 2``) and Theorem 4.4 that
CoT needs steps proportional to the size (here ``T = 4`` thoughts); the accuracy vs ``T`` is an empirical
illustration at this scale, not a proof (Theorems 4.10-4.13 are complexity-class statements, not tested here).

Part 2, Section 5 (approximate sampling, Lemma 5.11 and Theorem 5.13): the exact total variation to the uniform
law over the solutions of small random 3-CNFs of the self-consistent weak-CoT sampler ``q_T`` (Lemma 5.11) and of
Theorem 5.13's rejection step on top of it (:func:`~ppl_thought.data.self_reducible.rejection_log_law`), vs the
number ``T`` of reasoning paths.

JSON: ``{"parallel": {"loop": {"<T>": acc}, "cot": {"<T>": acc}, ...}, "sampling": {"lemma_5_11": {"<T>": tv},
"thm_5_13": {"<T>": tv}, ...}, "seconds": s, "commit": sha}``.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ppl_thought import checks
from ppl_thought.data.self_reducible import (
    SQRT_E,
    WeakCoT,
    random_cnf,
    rejection_log_law,
    sampler_log_law,
    total_variation,
    tv_bound,
)
from ppl_thought.errors import ConfigError
from ppl_thought.experiments.common import run_alone, set_lr
from ppl_thought.lm.base import ids_checked
from ppl_thought.lm.looped import Looped
from ppl_thought.training.trainer import cosine_lr


class TreeTask:
    """Evaluation of a forest of complete binary computation trees (Definition 4.1) with exact labels.

    ``trees`` trees of depth ``depth`` over ``trees * 2^depth`` leaves with values in ``Z_k``. Internal nodes are
    numbered in level order after the leaves (all level-1 nodes, then level 2, ...); the outputs are the
    ``trees`` roots, last. Every internal node is ``f(left, right)`` for one fixed table ``f: Z_k x Z_k -> Z_k``
    drawn from ``seed`` with no constant row or column (it depends on both children). A Latin square (where one
    child tells nothing about the output) left the loss at ``log k`` for 600 steps in our runs: no gradient signal
    until both children are read, as for parity. Token ids: values ``0 .. k-1`` and the placeholder ``k``.
    """

    def __init__(self, depth: int = 2, k: int = 4, seed: int = 0, trees: int = 2):
        self.depth = checks.integer("TreeTask: depth", depth)
        self.k = checks.integer("TreeTask: k", k, 2)
        self.trees = checks.integer("TreeTask: trees", trees)
        self.n_leaves = self.trees * 2**self.depth
        self.n_internal = self.n_leaves - self.trees
        self.length = self.n_leaves + self.n_internal
        self.pad = self.k
        self.vocab_size = self.k + 1
        g = torch.Generator().manual_seed(seed)
        while True:
            table = torch.randint(0, self.k, (self.k, self.k), generator=g)
            rows_vary = bool((table != table[:, :1]).any(1).all())
            cols_vary = bool((table != table[:1, :]).any(0).all())
            if rows_vary and cols_vary:
                break
        self.table = table
        left, right, nxt, level = [], [], self.n_leaves, list(range(self.n_leaves))
        while len(level) > self.trees:
            parents = []
            for i in range(0, len(level), 2):
                left.append(level[i])
                right.append(level[i + 1])
                parents.append(nxt)
                nxt += 1
            level = parents
        self.left, self.right = torch.tensor(left), torch.tensor(right)

    @property
    def max_thoughts(self) -> int:
        """Internal nodes that are not outputs: the CoT of Theorem 4.4 writes all of them before the answer."""
        return self.n_internal - self.trees

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``[n, length]`` node values: random leaves and every internal node computed exactly (level order)."""
        nodes = torch.empty(n, self.length, dtype=torch.long)
        nodes[:, :self.n_leaves] = torch.randint(0, self.k, (n, self.n_leaves), generator=generator)
        for j in range(self.n_internal):  # a loop over graph nodes, vectorised over the n inputs
            nodes[:, self.n_leaves + j] = self.table[nodes[:, self.left[j]], nodes[:, self.right[j]]]
        return nodes

    def loop_input(self, nodes: torch.Tensor) -> torch.Tensor:
        """The looped model's input: the leaves, then a placeholder at every internal node's position."""
        x = nodes.clone()
        x[:, self.n_leaves:] = self.pad
        return x

    def cot_sequence(self, nodes: torch.Tensor, T: int) -> torch.Tensor:
        """The CoT sequence: leaves, the first ``T`` internal nodes in level order (thoughts), the outputs (answer)."""
        if isinstance(T, bool) or not isinstance(T, int) or not 0 <= T <= self.max_thoughts:
            raise ConfigError(f"CoT thought count T must be an integer in [0, {self.max_thoughts}] (the internal "
                              f"nodes that are not outputs), got {T!r}")
        return torch.cat([nodes[:, :self.n_leaves + T], nodes[:, -self.trees:]], 1)


@dataclass
class CotVsLoopConfig:
    """Sizes of the experiment (both models share them)."""

    depth: int = 2
    trees: int = 2
    k: int = 4
    T_values: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    d_model: int = 32
    n_heads: int = 2
    steps: int = 1200
    batch: int = 64
    lr: float = 3e-3  # 1e-2 left the looped model at 44% (T=2) after 500 steps; 3e-3 reaches 100% in 300
    num_test: int = 4000
    # Part 2
    sampling_T: list[int] = field(default_factory=lambda: [1, 3, 5, 9, 17, 33])
    m: int = 12
    alpha: float = 0.01
    gamma: float = 0.25
    num_formulas: int = 8
    trials: int = 16
    beta: float = SQRT_E

    @classmethod
    def quick(cls) -> CotVsLoopConfig:
        """Under about two minutes on one CPU core."""
        return cls(T_values=[1, 2, 4], steps=400, num_test=2000, num_formulas=2)


def _train(model: Looped, loss_fn, cfg: CotVsLoopConfig, task: TreeTask, g: torch.Generator, desc: str,
           progress: bool) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    loss = torch.zeros(())
    with ids_checked(), tqdm(total=cfg.steps, desc=desc, disable=not progress, leave=False) as bar:
        for step in range(cfg.steps):
            set_lr(opt, cosine_lr(cfg.lr, step, cfg.steps))
            loss = loss_fn(model, task.sample(cfg.batch, g))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            bar.update(1)
    return float(loss.detach())


def loop_loss(T: int, task: TreeTask):
    def fn(model: Looped, nodes: torch.Tensor) -> torch.Tensor:
        logits = model(task.loop_input(nodes), T)[:, task.n_leaves:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), nodes[:, task.n_leaves:].reshape(-1))
    return fn


def cot_loss(T: int, task: TreeTask):
    def fn(model: Looped, nodes: torch.Tensor) -> torch.Tensor:
        seq = task.cot_sequence(nodes, T)
        logits = model(seq[:, :-1], 1)[:, task.n_leaves - 1:]  # predictions of the thoughts and the answer
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, task.n_leaves:].reshape(-1))
    return fn


@torch.no_grad()
def loop_accuracy(model: Looped, task: TreeTask, nodes: torch.Tensor, T: int) -> float:
    """Fraction of inputs whose outputs (the roots) are all read correctly after ``T`` loops."""
    pred = model(task.loop_input(nodes), T)[:, -task.trees:, :task.k].argmax(-1)
    return float((pred == nodes[:, -task.trees:]).all(1).double().mean())


@torch.no_grad()
def cot_accuracy(model: Looped, task: TreeTask, nodes: torch.Tensor, T: int) -> float:
    """Fraction of inputs whose answer (all outputs) is right after greedy decoding of ``T`` thoughts and the answer."""
    seq = nodes[:, :task.n_leaves]
    with ids_checked():
        for _ in range(T + task.trees):
            nxt = model(seq, 1)[:, -1, :task.k].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return float((seq[:, -task.trees:] == nodes[:, -task.trees:]).all(1).double().mean())


def _chance(outputs: torch.Tensor) -> float:
    """Accuracy of always answering the most frequent output tuple of the test set."""
    _, counts = torch.unique(outputs, dim=0, return_counts=True)
    return float(counts.max() / outputs.shape[0])


def run_parallel(cfg: CotVsLoopConfig, seed: int = 0, progress: bool = True) -> dict:
    """Part 1: answer accuracy of a looped model (T loops) and a CoT model (T thoughts), same parameters, vs T."""
    task = TreeTask(cfg.depth, cfg.k, seed, cfg.trees)
    for T in cfg.T_values:
        checks.integer("T_values entry", T)
        task.cot_sequence(task.sample(1), T)  # range check
    test = task.sample(cfg.num_test, torch.Generator().manual_seed(10_000 + seed))
    out: dict = {"loop": {}, "cot": {}, "params": {}, "final_train_loss": {"loop": {}, "cot": {}},
                 "task": {"depth": task.depth, "size": task.n_internal, "outputs": task.trees, "k": task.k,
                          "leaves": task.n_leaves, "table": task.table.tolist()},
                 "chance": _chance(test[:, -task.trees:])}
    runs = [(kind, T) for T in cfg.T_values for kind in ("loop", "cot")]
    with tqdm(total=len(runs), desc="cot_vs_loop: training", disable=not progress) as bar:
        for kind, T in runs:
            torch.manual_seed(seed)
            model = Looped(task.vocab_size, cfg.d_model, 1, cfg.n_heads, max_len=task.length, causal=kind == "cot")
            g = torch.Generator().manual_seed(seed + 1)  # the same training inputs for every run
            loss_fn = loop_loss(T, task) if kind == "loop" else cot_loss(T, task)
            out["final_train_loss"][kind][str(T)] = _train(model, loss_fn, cfg, task, g, f"{kind} T={T}", progress)
            acc = loop_accuracy if kind == "loop" else cot_accuracy
            out[kind][str(T)] = acc(model.eval(), task, test, T)
            out["params"][kind] = model.num_parameters()
            bar.set_postfix({"run": f"{kind} T={T}", "acc": f"{out[kind][str(T)]:.3f}"})
            bar.update(1)
    return out


def run_sampling(cfg: CotVsLoopConfig, seed: int = 0) -> dict:
    """Part 2: exact TV to uniform of the Lemma-5.11 sampler and of Theorem 5.13's rejection step, vs T."""
    model = WeakCoT(cfg.alpha, cfg.gamma)
    lemma = {str(T): 0.0 for T in cfg.sampling_T}
    thm = {str(T): 0.0 for T in cfg.sampling_T}
    bound = {str(T): 0.0 for T in cfg.sampling_T}
    for f in range(cfg.num_formulas):
        cnf = random_cnf(cfg.m, 3, 3 * cfg.m, seed=seed + f)
        for T in cfg.sampling_T:
            lemma[str(T)] += total_variation(cnf, sampler_log_law(cnf, model, T)) / cfg.num_formulas
            law = rejection_log_law(cnf, model, T, beta=cfg.beta, trials=cfg.trials)
            thm[str(T)] += total_variation(cnf, law) / cfg.num_formulas
            bound[str(T)] += tv_bound(cnf, model, T, sharp=True) / cfg.num_formulas
    return {"lemma_5_11": lemma, "thm_5_13": thm, "lemma_5_11_sharp_bound": bound,
            "setting": {"m": cfg.m, "alpha": cfg.alpha, "gamma": cfg.gamma, "formulas": cfg.num_formulas,
                        "clauses": 3 * cfg.m, "trials": cfg.trials, "beta": cfg.beta}}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_cot_vs_loop(cfg: CotVsLoopConfig, seed: int = 0, progress: bool = True) -> dict:
    """Both parts; ``seconds`` is the wall time of the whole run."""
    t0 = time.time()
    res = {"config": asdict(cfg), "parallel": run_parallel(cfg, seed, progress), "sampling": run_sampling(cfg, seed)}
    res["seconds"] = round(time.time() - t0, 1)
    res["commit"] = _commit()
    return res


def main(argv: list[str] | None = None) -> int:
    """``python -m ppl_thought.experiments.cot_vs_loop [--quick] [--seed S] [--json FILE]``."""
    return run_alone(__doc__, run_cot_vs_loop, CotVsLoopConfig, argv)


if __name__ == "__main__":
    raise SystemExit(main())
