"""ppl_thought: language models with latent thoughts as probabilistic programs."""
