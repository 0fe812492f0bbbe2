"""Diagnostics: sampler quality (chi^2, KL; Table 3.1)."""

from ppl_thought.diagnostics.sampler_quality import chi2, chi2_from_weights, kl

__all__ = ["chi2", "chi2_from_weights", "kl"]
