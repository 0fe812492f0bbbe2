"""Sequential Monte Carlo for Proj # P_f, segment by segment (Lemma 2.1), compiled end to end (torch twin:
ppl_thought/inference/smc.py).

A latent z in the lifting of x decomposes uniquely as z = z^(1) ... z^(|x|) (Lemma 2.1). Step t draws segment
z^(t) for every particle from the proposal (the guide's token rule, or the prior masked to Dom(Proj) for
bootstrap SMC) in a ``lax.while_loop`` of lockstep token steps (a particle that reached the end of its segment
waits, feeding nothing), and multiplies its weight by

    w_t = P(z^(t) | z^(<t)) / Q(z^(t) | z^(<t), x) * 1[z^(<=t) emits x_{<=t}]

(the model's masked prior over the proposal, and the check of the observed site). When the ESS falls under
``ess_threshold * n`` the particles are resampled (systematic) and every piece of state, the KV caches
included, is gathered by the ancestor indices (``lm.base.reorder``); the decision is taken on device
(``lax.cond``). The outer loop over segments is a ``lax.scan``; the whole run is one ``jit``, and
``groups=G`` runs G independent SMCs as one ``vmap``. Z-hat = prod_t (1/n) sum_i W_{t-1}^i w_t^i is unbiased.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppl_thought.checks import fraction, integer
from ppl_thought.errors import ConfigError, NotInImageError, NumericalError, ZeroWeightsError
from ppl_thought.numpyro.distributions import NEG_INF, TokenRule, encode, sample_token, tables, tree_where
from ppl_thought.numpyro.infer.importance import Importance, not_in_image_result
from ppl_thought.numpyro.infer.resampling import effective_sample_size, log_mean_exp, prng_key, systematic_resample
from ppl_thought.numpyro.infer.result import Result, log_marginal_stderr
from ppl_thought.numpyro.infer.steps import StepEngine, program_result
from ppl_thought.numpyro.lm.base import reorder
from ppl_thought.numpyro.program import is_program


def _take(q: jax.Array, tok: jax.Array) -> jax.Array:
    return jnp.take_along_axis(q, tok[:, None], -1)[:, 0]


class SMC(StepEngine):
    """SMC over the steps of any :class:`~ppl_thought.numpyro.program.Program` (the generic engine core,
    :mod:`ppl_thought.numpyro.infer.steps`), and over the segments of a
    :class:`~ppl_thought.numpyro.models.SlowThinking` model (Lemma 2.1).

    Args:
        num_particles: n.
        ess_threshold: resample when ESS / n falls under it (0: never, 1: at every step but the last).
        groups: G independent runs (``vmap`` over keys); ``log_marginal`` is then ``[G]`` and
            ``stats["log_marginal_pooled"]`` (with ``stats["log_marginal_pooled_stderr"]``, the delta method
            over the G unbiased estimates) pools them. SlowThinking only.
        max_steps: the length of the compiled step loop for programs without a ``max_steps`` attribute.

    ``run(program, guide, *args, rng_key=key, static=()) -> Result`` for a ``ptn.Program`` (guide: a program
    with the same steps and latent sites, or ``None``: the bootstrap): ``samples`` (a step site ``[n, steps, ...]``,
    an init site ``[n, ...]``, plus ``program.outputs(state)``), final ``log_weights``, ``log_marginal``,
    ``ancestry [steps, n]``, ``stats["ess"]`` / ``["resampled"]`` per step, ``stats["steps"]``. Arguments are
    traced (new data of the same shapes reuses the compiled run); ``static`` lists the indices of arguments
    that must be concrete (their values key the compiled run).

    ``run(model, guide, x, rng_key=key) -> Result``: ``samples["z"] [n, L]``, final ``log_weights``,
    ``log_marginal``, ``ancestry [|x|, n]``, ``stats["ess"]`` / ``["resampled"]`` per step. The guide is
    ``None`` (bootstrap: the masked prior proposes) or a sampler of :mod:`ppl_thought.numpyro.guides`
    (``proposal(x)``). ``log_marginal_stderr`` is the delta method on the final weights when no step
    resampled (then it is importance sampling), else ``None``: use ``groups``.
    """

    def __init__(self, num_particles: int, ess_threshold: float = 0.5, groups: int = 1, max_steps: int = 64):
        self.num_particles = integer("num_particles", num_particles)
        self.ess_threshold = fraction("ess_threshold", ess_threshold)
        self.groups = integer("groups", groups)
        self.max_steps = integer("max_steps", max_steps)
        self._compiled: dict = {}

    # ------------------------------------------------------------------ the compiled run
    def _build(self, model, guide, xa: np.ndarray):
        T = len(xa)
        n = self.num_particles
        dom = model.domain(T)
        D = tables(dom)
        Lf = tables(model.projection.lifting(xa))
        L = int(dom.max_len)
        V = model.prior.vocab_size
        rule_p = TokenRule(dom, V)
        prop = guide.proposal(xa) if guide is not None else None
        if prop is not None and prop.max_len != L:
            raise ConfigError(f"the guide's event length {prop.max_len} differs from the model's {L}")
        threshold = self.ess_threshold
        empty = np.zeros(0, np.int64)

        def run(key, p_params, q_params):
            p_logp, p_cache = encode(model.prior, p_params, empty, n, L)
            st = {"p_logp": p_logp, "p_cache": p_cache, "sD": rule_p.start(n), "sL": jnp.full((n,), Lf.start),
                  "toks": jnp.zeros((n, L), jnp.int32), "length": jnp.zeros((n,), jnp.int32)}
            if prop is not None:
                st["q_logp"], st["q_cache"] = (encode(prop.lm, q_params, prop.prompt, n, L) if prop.lm is not None
                                               else (jnp.zeros((n, V)), jnp.zeros((n, 0))))
                st["q_s"] = prop.rule.start(n)

            def seg_end(st, t):
                last = t == T - 1
                reached = jnp.where(last, D.final[st["sD"]], D.emitted[st["sD"]] >= t + 1)
                return reached | (st["sD"] < 0) | (st["length"] >= L)

            def token_step(carry):
                st, key, i, inc, active, t = carry
                key, k = jax.random.split(key)
                plp = rule_p.log_probs(st["p_logp"], st["sD"])
                if prop is None:
                    tok = sample_token(k, plp, ~active)
                    ok = jnp.isfinite(_take(plp, tok))
                    step = jnp.where(ok, 0.0, NEG_INF)
                else:
                    qlp = prop.rule.log_probs(st["q_logp"], st["q_s"])
                    tok = sample_token(k, qlp, ~active)
                    lq, lp = _take(qlp, tok), _take(plp, tok)
                    ok = jnp.isfinite(lq) & jnp.isfinite(lp)
                    step = jnp.where(ok, lp - jnp.where(ok, lq, 0.0), NEG_INF)
                inc = inc + jnp.where(active, step, 0.0)
                new = dict(st)
                new["sD"] = jnp.where(active, rule_p.step(st["sD"], tok), st["sD"])
                new["sL"] = jnp.where(active, Lf.table[st["sL"], tok], st["sL"])
                rows = jnp.arange(n)
                pos = jnp.clip(st["length"], 0, L - 1)
                new["toks"] = st["toks"].at[rows, pos].set(jnp.where(active, tok, st["toks"][rows, pos]))
                new["length"] = st["length"] + active
                feed = jnp.where(active, tok, 1)[:, None]
                lp_next, new["p_cache"] = model.prior.apply(p_params, st["p_cache"], feed, valid=active[:, None])
                new["p_logp"] = jnp.where(active[:, None], lp_next[:, 0], st["p_logp"])
                if prop is not None:
                    new["q_s"] = tree_where(active, prop.rule.step(st["q_s"], tok), st["q_s"])
                    if prop.lm is not None:
                        lq_next, new["q_cache"] = prop.lm.apply(q_params, st["q_cache"], feed, valid=active[:, None])
                        new["q_logp"] = jnp.where(active[:, None], lq_next[:, 0], st["q_logp"])
                active = active & ok & ~seg_end(new, t)
                return new, key, i + 1, inc, active, t

            def segment(carry, t):
                st, lw, key = carry
                key, k_seg, k_res = jax.random.split(key, 3)
                active = ~seg_end(st, t)
                st, _, _, inc, _, _ = jax.lax.while_loop(
                    lambda c: c[4].any() & (c[2] < L), token_step,
                    (st, k_seg, jnp.zeros((), jnp.int32), jnp.zeros(n), active, t))
                last = t == T - 1
                sL = st["sL"]
                emits = jnp.where(last, Lf.final[sL], Lf.emitted[sL] >= t + 1) & (sL >= 0)  # 1[x_{<=t} emitted]
                lw = lw + inc + jnp.where(emits, 0.0, NEG_INF)
                ess = effective_sample_size(lw)
                alive = ~jnp.isneginf(lw).all()
                flag = (ess < threshold * n) & ~last & alive

                def move(args):  # the adaptive-resampling move: ancestors, gathered state, weights at their mean
                    st, lw = args
                    idx = systematic_resample(k_res, lw)
                    return reorder(st, idx), jnp.full_like(lw, log_mean_exp(lw)), idx

                def keep(args):
                    st, lw = args
                    return st, lw, jnp.arange(n)

                st, lw, idx = jax.lax.cond(flag, move, keep, (st, lw))
                return (st, lw, key), (ess, flag, idx)

            (st, lw, _), (ess, flags, anc) = jax.lax.scan(segment, (st, jnp.zeros(n), key), jnp.arange(T))
            return st["toks"], lw, log_mean_exp(lw), ess, flags, anc

        return jax.jit(jax.vmap(run, in_axes=(0, None, None)))

    def run(self, model, guide, *args, rng_key: jax.Array | int | None = None, static: tuple = ()) -> Result:
        """Run SMC; see the class docstring. ``rng_key``: a ``jax.random.PRNGKey`` or an int seed
        (``PRNGKey(seed)``); default ``PRNGKey(0)``."""
        if is_program(model):
            if self.groups != 1:
                raise ConfigError("SMC(groups=G > 1) runs SlowThinking only; for a ptn.Program run G seeds "
                                  "(the compiled run is reused)")
            out = self._program_run(model, guide, args, prng_key(rng_key), static, self.ess_threshold, "SMC")
            return program_result(out, "SMC", args)
        if len(args) != 1:
            raise ConfigError(f"SMC.run(model, guide, x) on {type(model).__name__} takes one observation x, got "
                              f"{len(args)} arguments (a ptn.Program takes any)")
        return self._run_slow_thinking(model, guide, args[0], rng_key)

    def _run_slow_thinking(self, model, guide, x, rng_key) -> Result:
        """Run G x n particles through the |x| segments; see the class docstring."""
        xa = model.x_ids(x)
        n, G = self.num_particles, self.groups
        observed = {"x": xa}
        if len(xa) == 0:  # one (empty) step: importance sampling
            return Importance(n).run(model, guide, xa, rng_key=rng_key)
        try:
            key = (id(model), id(guide), xa.tobytes())
            if key not in self._compiled:
                if len(self._compiled) > 32:
                    self._compiled.clear()
                self._compiled[key] = self._build(model, guide, xa)
            fn = self._compiled[key]
        except NotInImageError as e:
            return not_in_image_result(f"log p(x) = -inf: {e}", n, "SMC", observed)
        rng_key = prng_key(rng_key)  # an int seed is accepted: PRNGKey(seed)
        q_params = guide.proposal(xa).params if guide is not None else None
        toks, lw, logz, ess, flags, anc = fn(jax.random.split(rng_key, G), model.prior.params, q_params)
        if bool(jnp.isnan(lw).any()):
            raise NumericalError("SMC: NaN log weights")
        if bool(jnp.isneginf(lw).all(-1).any()):
            raise ZeroWeightsError("SMC: every particle of a run has weight zero (the proposal left the lifting of x)")
        resampled = bool(flags.any())
        stats: dict[str, Any] = {"ess": ess if G > 1 else ess[0], "resampled": flags if G > 1 else flags[0],
                                 "steps": len(xa)}
        if G > 1:
            stats["log_marginal_pooled"] = log_mean_exp(logz)
            stats["log_marginal_pooled_stderr"] = log_marginal_stderr(logz)
        one = G == 1
        return Result(samples={"z": toks[0] if one else toks}, log_weights=lw[0] if one else lw,
                      log_marginal=logz[0] if one else logz,
                      log_marginal_stderr=(None if resampled else (log_marginal_stderr(lw[0]) if one else
                                                                   jax.vmap(log_marginal_stderr)(lw))),
                      ancestry=anc[0] if one else anc, stats=stats, observed=observed, engine="SMC")


__all__ = ["SMC", "systematic_resample"]
