"""Synthetic tasks with exact answers (docs/architecture.md, "The layers")."""

from ppl_thought.data.a5 import A5Task, a5_hmm
from ppl_thought.data.dyck import DyckDistribution, DyckTask
from ppl_thought.data.query_response import PermutationChoiceTask, permutation_choice_task
from ppl_thought.data.self_reducible import (
    CNF,
    WeakCoT,
    coordinatewise_median,
    random_cnf,
    self_reducible_curve,
)

__all__ = [
    "CNF",
    "A5Task",
    "DyckDistribution",
    "DyckTask",
    "PermutationChoiceTask",
    "WeakCoT",
    "a5_hmm",
    "coordinatewise_median",
    "permutation_choice_task",
    "random_cnf",
    "self_reducible_curve",
]

