"""The App. L pieces of Section 7's trainings (:mod:`ppl_thought.experiments.sec7`): the gating trick (L.1)/(L.2)
(:func:`gate_mix`), joint or separate gradient clipping (Fig L.2), the surrogate losses of the latent model (7.1)
and of the sampler (7.2), and the causal gap (7.3).
"""

from __future__ import annotations

import torch

from ppl_thought.errors import ConfigError, NumericalError
from ppl_thought.lm import Transformer
from ppl_thought.training.trainer import clip_joint_


def _logits_and_features(lm: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the features before the unembedding (f_post and f_pre of App. L) from one pass."""
    out = {}
    handle = lm.norm.register_forward_hook(lambda _m, _i, o: out.__setitem__("f", o))
    try:
        logits, _ = lm(tokens)
    finally:
        handle.remove()
    return logits, out["f"]


def gate_mix(gate: torch.nn.Module, f_fast: torch.Tensor, f_slow: torch.Tensor, fast: torch.Tensor,
             slow: torch.Tensor) -> torch.Tensor:
    """The gating trick of App. L: (L.1) ``p_fast * fast + p_slow * slow`` with (L.2)
    ``[p_fast, p_slow] = softmax(MLP(f_fast (+) f_slow))`` row by row, for the latent model P (fast: ``x x_r``,
    slow: ``x <s> y </s> x_r``) and for the explanatory sampler (fast: the predictive format ``x <s> y``, slow:
    the explanatory one). ``f_*`` are the features before the unembedding ``[..., d]``, ``fast``/``slow`` the
    logits ``[..., V]`` at the same rows."""
    g = torch.softmax(gate(torch.cat([f_fast, f_slow], -1)), -1)
    return g[..., :1] * fast + g[..., 1:] * slow


def clip_gradients_(groups: list[list[torch.Tensor]], max_norm: float, mode: str) -> list[float]:
    """Gradient clipping of App. L. ``mode="joint"``: all groups as one model, v / max(1, ||v|| / max_norm)
    with v = v_latent (+) v_sampler (what the paper does); ``"separate"``: each group alone,
    v_latent / max(1, ||v_latent|| / max_norm) (+) v_sampler / max(1, ||v_sampler|| / max_norm) (the
    alternative of Fig L.2, left). Returns the norm(s) before clipping (one for joint, one per group)."""
    if mode == "joint":
        return [clip_joint_([p for g in groups for p in g], max_norm)]
    if mode == "separate":
        return [clip_joint_(g, max_norm) for g in groups]
    raise ConfigError(f"clipping mode must be 'joint' or 'separate' (App. L, Fig L.2), got {mode!r}")


def latent_surrogate(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """(7.1) per example, batched ``[B, n] -> [B]``: the surrogate of
    :class:`~ppl_thought.training.objectives.OneSampler` ((3.17)/(5.20)), -sum_i w_i log P(Y_i X_r | X),
    w = softmax(log P - log Q) detached; its gradient is that of -log (1/n) sum_i P/U(Q). ``-inf``
    log P (impossible particles) get weight 0 and contribute 0, never NaN."""
    lw = (log_p - log_q).detach()
    w = torch.softmax(lw, -1).nan_to_num(0.0)
    return -(w * log_p.masked_fill(w == 0, 0.0)).sum(-1)


def sampler_surrogate(log_p: torch.Tensor, log_q: torch.Tensor, baseline: str = "loo") -> torch.Tensor:
    """The sampler's policy-gradient surrogate per example, batched ``[B, n] -> [B]``, rewards R_i = U(log P/Q).

    ``baseline="loo"`` (the default): (3.25)/(5.24) of
    :class:`~ppl_thought.training.objectives.SamplerPolicyGradient`, -1/(n-1) sum_i U(R_i - mean_j R_j) log Q(Y_i | .),
    which is the leave-one-out baseline 1/n sum_i U(R_i - mean_{j != i} R_j) log Q(Y_i | .).
    ``baseline="none"``: (7.2) as printed in Section 7, plain policy gradient, -1/n sum_i U(R_i) log Q(Y_i | .).
    Both have the expected gradient grad_psi KL(Q(.|x) || Q_*(.|x)) of Section 3.4.3 (the baseline only lowers the
    variance); ``tests/test_sec7_losses.py`` checks it by enumerating every draw on a toy."""
    rew = (log_p - log_q).detach()
    if not torch.isfinite(rew).all():
        raise NumericalError("sampler reward log P/Q is not finite: the sampler proposes thoughts outside the prior's "
                             "support")
    n = log_q.shape[-1]
    if baseline == "none":
        return -(rew * log_q).sum(-1) / n
    if baseline != "loo":
        raise ConfigError(f"sampler baseline must be 'loo' ((3.25)) or 'none' ((7.2) as printed), got {baseline!r}")
    if n < 2:
        raise ConfigError("the leave-one-out baseline of (3.25) needs n >= 2 samples per example, got n = 1; "
                          "use baseline='none' (plain (7.2))")
    adv = rew - rew.mean(-1, keepdim=True)
    return -(adv * log_q).sum(-1) / (n - 1)


def causal_gaps(log_p_y: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """(7.3) per example ``[B, n] -> [B]``: sum_i r_i p_i with r_i = log Q(Y_i | .) - log P(Y_i | X) and
    p = softmax(log P(Y_i X_r | X) - log Q(Y_i | .))."""
    with torch.no_grad():
        p = torch.softmax(log_p - log_q, -1).nan_to_num(0.0)
        return (p * (log_q - log_p_y)).masked_fill(p == 0, 0.0).sum(-1)


# ====================================================================== Section 7
