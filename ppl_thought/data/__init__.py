"""Synthetic tasks with exact answers (ARCHITECTURE.md, ``data/``)."""

from ppl_thought.data.a5 import A5Task, a5_hmm

__all__ = ["A5Task", "a5_hmm"]
