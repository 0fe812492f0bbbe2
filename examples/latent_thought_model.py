"""Latent Thought Model vs an equal-window autoregressive Transformer on a mixture of Markov chains.

The experiment lives in the library (``ppl_thought.experiments.latent_thought``: dual-rate learning, Algorithm 1,
Eq. 5; ELBO-perplexity by fast steps T; the importance-weighted bound; Langevin posterior sampling, Eq. 4);
this script runs it:

    python examples/latent_thought_model.py [--quick] [--json FILE] [--out DIR] [--seed S]
"""

from ppl_thought.experiments.latent_thought import main

if __name__ == "__main__":
    raise SystemExit(main())
