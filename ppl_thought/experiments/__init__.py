"""Experiments: one module per experiment, each built only from library parts and runnable on its own
(``python -m ppl_thought.experiments.<name> --quick``). ``ppl-thought demo`` chooses, runs and reports them."""
