"""Diagnostics (docs/architecture.md, "Contracts"): ArviZ export, sampler quality, scaling laws, causal gap,
posterior drift, k-token advantage and plots. ArviZ and matplotlib are imported on first use.

- :func:`to_inference_data` (every engine's result and ``decode``'s -> ``arviz.InferenceData``; weighted
  results as an ESS-bounded equal-weight posterior, :func:`bounded_num_draws`), :func:`psis_khat`;
- :func:`chi2`, :func:`kl`, :func:`chi2_from_weights`, :func:`kl_from_weights`, :func:`sampler_report`
  (Table 3.1, Prop 3.5);
- :func:`scaling_law` (Table 3.1: encoding (3.4), direct decoding (Prop 3.3), gradients (3.24));
- :func:`causal_gap` (7.3), :class:`CausalGapTracker`, :func:`posterior_drift` (Def 3.10, Ex 3.4);
- :func:`k_token_advantage`, :func:`advantage_bound` (next-token-long-range Def 2, Eq 1.2, App. A);
  :class:`Boosted`, :func:`exact_boosting`, :func:`self_boosting_schedule` (its Lemmas 1-2, (1.3)-(1.4), Algorithm 1);
- plots: :func:`plot_weights`, :func:`plot_scaling_law`, :func:`plot_ess`, :func:`plot_causal_gap`,
  :func:`plot_trace`; :func:`diagnose` (what ``ppl-thought diagnose`` runs).
"""

from ppl_thought.diagnostics.boosting import (
    Boosted,
    BoostingReport,
    exact_boosting,
    self_boosting_schedule,
)
from ppl_thought.diagnostics.causal import (
    CausalGapTracker,
    ZeroWeightsError,
    causal_gap,
    posterior_drift,
    posterior_drift_curve,
)
from ppl_thought.diagnostics.distinguish import (
    KTokenAdvantage,
    advantage_bound,
    k_token_advantage,
    sample_continuations,
)
from ppl_thought.diagnostics.inference_data import (
    bounded_num_draws,
    load_inference_data,
    psis_khat,
    to_inference_data,
)
from ppl_thought.diagnostics.plots import plot_causal_gap, plot_ess, plot_scaling_law, plot_trace, plot_weights
from ppl_thought.diagnostics.report import diagnose
from ppl_thought.diagnostics.sampler_quality import (
    SamplerReport,
    chi2,
    chi2_from_weights,
    kl,
    kl_from_weights,
    sampler_report,
)
from ppl_thought.diagnostics.scaling import ScalingLaw, scaling_law

__all__ = [
    "Boosted",
    "BoostingReport",
    "CausalGapTracker",
    "KTokenAdvantage",
    "SamplerReport",
    "ScalingLaw",
    "ZeroWeightsError",
    "advantage_bound",
    "bounded_num_draws",
    "causal_gap",
    "chi2",
    "chi2_from_weights",
    "diagnose",
    "exact_boosting",
    "k_token_advantage",
    "kl",
    "kl_from_weights",
    "load_inference_data",
    "plot_causal_gap",
    "plot_ess",
    "plot_scaling_law",
    "plot_trace",
    "plot_weights",
    "posterior_drift",
    "posterior_drift_curve",
    "psis_khat",
    "sample_continuations",
    "sampler_report",
    "scaling_law",
    "self_boosting_schedule",
    "to_inference_data",
]

