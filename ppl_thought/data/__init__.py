"""Synthetic tasks with exact answers (ARCHITECTURE.md, ``data/``)."""

from ppl_thought.data.a5 import A5Task, a5_hmm
from ppl_thought.data.dyck import DyckTask
from ppl_thought.data.query_response import PermutationChoiceTask, permutation_choice_task

__all__ = ["A5Task", "DyckTask", "PermutationChoiceTask", "a5_hmm", "permutation_choice_task"]
