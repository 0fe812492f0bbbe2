"""JAX engines: Importance (3.2) and SMC (Lemma 2.1) compiled with vmap / lax.scan / jit, decoding (``decode``:
(3.12)-(3.14), best-of-K, streaming; :class:`Decoded`), the ELBO objective for
``numpyro.infer.SVI``, the :class:`Result` they return, ULA / MALA (Langevin over continuous thoughts) as
``numpyro.infer.MCMC`` kernels, and active lifting inference ((6.17)-(6.22): :func:`encode`,
:func:`conditional_encode`, :func:`conditional_decode`). What users call, only: the statistics and the resampler
the engines are built from (``effective_sample_size``, ``log_mean_exp``, ``systematic_resample``) stay importable from
:mod:`ppl_thought.numpyro.infer.resampling`; ``ptn.compile_stats()`` says when and why a run compiled."""

from ppl_thought.numpyro.infer.active_inference import conditional_decode, conditional_encode, encode
from ppl_thought.numpyro.infer.decode_methods import Decoded, decode
from ppl_thought.numpyro.infer.importance import Importance
from ppl_thought.numpyro.infer.langevin import MALA, ULA, LangevinState
from ppl_thought.numpyro.infer.objectives import GRPO, OneSampler, R1Zero, SamplerPolicyGradient, TwoSampler
from ppl_thought.numpyro.infer.objectives_active import (
    ActiveGenerative,
    ActiveLifting,
    ConditionalSamplerLoss,
    GeneratorLoss,
    MinimumLengthCoding,
)
from ppl_thought.numpyro.infer.objectives_more import SFT, Inquisitive, SeparatePolicy, Sum
from ppl_thought.numpyro.infer.result import Result, log_marginal_stderr
from ppl_thought.numpyro.infer.smc import SMC
from ppl_thought.numpyro.infer.svi import ELBO

__all__ = ["ELBO", "GRPO", "MALA", "SFT", "SMC", "ULA", "ActiveGenerative", "ActiveLifting", "ConditionalSamplerLoss",
           "Decoded", "GeneratorLoss", "Importance", "Inquisitive", "LangevinState", "MinimumLengthCoding",
           "OneSampler", "R1Zero", "Result", "SamplerPolicyGradient", "SeparatePolicy", "Sum", "TwoSampler",
           "conditional_decode", "conditional_encode", "decode", "encode", "log_marginal_stderr"]
