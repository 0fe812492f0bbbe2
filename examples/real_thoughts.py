"""Latent thoughts on a real LM: question -> <think> thought </think> -> answer on SmolLM2-135M-Instruct.

    python examples/real_thoughts.py [--quick] [--problems 12] [--particles 16] [--json FILE] [--plot FILE]

The programs and the experiment live in :mod:`ppl_thought.experiments.real_thoughts` (its docstring explains
the model, the two samplers and the numbers); ``ppl-thought demo`` runs the same comparison as its third part.
"""

from ppl_thought.experiments.real_thoughts import main

if __name__ == "__main__":
    main()
