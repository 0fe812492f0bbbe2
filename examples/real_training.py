"""Teach SmolLM2 to think: SFT vs latent training with the predictive / explanatory sampler, LoRA adapters.

    python examples/real_training.py --quick --json benchmarks/results/real_training_quick.json
    python examples/real_training.py --device cuda --dtype bf16 --json real_training.json

The experiment lives in :mod:`ppl_thought.experiments.real_training` (its docstring explains the task, the three
trainings and the numbers); docs/training.md, "Training a real model", shows the table.
"""

from ppl_thought.experiments.real_training import main

if __name__ == "__main__":
    main()
