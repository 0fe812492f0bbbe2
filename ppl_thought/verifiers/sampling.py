"""Verifier-assisted generation: rejection sampling (Def 3.1.4) and tokenwise rejection sampling (Def 3.1.5).

Both engines draw from an LM (the autoregressive oracle O of Def 3.1.1) under a constraint set ``A``
given by a :class:`~ppl_thought.verifiers.ProcessVerifier` with a fixed length ``N``
(``A subset Sigma^N``), batched over samples: every row is a particle, the only Python loops are
over token positions (and, for tokenwise rejection, over rounds of re-proposals of the rows still
rejected at the current position).

Oracle calls are counted as the thesis counts them (Def 3.1.1, Def 3.1.6): one call of O returns
one sample of the next token given a prefix, so a proposed token is one LM call and a complete
string of length N costs N calls. A verifier call is one evaluation of V (Def 3.1.3 / membership
in A). ``Result.stats`` holds the totals ``lm_calls`` and ``verifier_calls``, and the calls spent on
each returned sample (``lm_calls_per_sample``, ``verifier_calls_per_sample`` ``[n]``), whose means
estimate the oracle complexities of Prop 3.1.1 (``2^D D`` and ``2 D`` on its example).
"""

from __future__ import annotations

import torch

from ppl_thought.checks import integer as check_count  # the one home of the check
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.distributions.token_rule import token_step
from ppl_thought.errors import ConfigError, SamplingBudgetError, UnsatisfiableConstraintError, ZeroWeightsError
from ppl_thought.inference.resampling import check_scheme
from ppl_thought.inference.result import Result
from ppl_thought.inference.smc import SMC
from ppl_thought.lm.base import lm_device
from ppl_thought.program import Program
from ppl_thought.validation import checked
from ppl_thought.verifiers.process import ProcessVerifier
from ppl_thought.verifiers.program import VerifiedLM

__all__ = ["RejectionSampling", "TokenwiseRejection", "VerifierSMC", "SamplingBudgetError",
           "UnsatisfiableConstraintError"]


def start_states(verifier: ProcessVerifier, n: int, device) -> torch.Tensor:
    """The constraint automaton's start state for ``n`` rows; FAIL (Def 3.1.2) if the verifier rejects ``()``."""
    q = verifier.automaton.start_states(n, device)
    if not bool(verifier.from_states(q[:1], 0)):
        raise UnsatisfiableConstraintError(f"{verifier} rejects the empty prefix: A has no string (FAIL)")
    return q


def _check_common(num_samples, max_len, verifier, lm) -> None:
    check_count("num_samples", num_samples)
    check_count("max_len", max_len)
    if not isinstance(verifier, ProcessVerifier):
        raise ConfigError(f"expected a ProcessVerifier, got {type(verifier).__name__}")
    if verifier.length != max_len:
        raise ConfigError(f"the verifier decides strings of length {verifier.length} but max_len={max_len}: "
                          f"build it as ProcessVerifier(automaton, length={max_len})")
    if verifier.automaton.vocab_size != lm.vocab_size:
        raise ConfigError(f"the constraint automaton has {verifier.automaton.vocab_size} token columns but the LM "
                          f"has vocab_size={lm.vocab_size}")


@checked
class RejectionSampling:
    """Rejection sampling with an outcome verifier (Def 3.1.4).

    Draw whole strings of length ``max_len`` from the LM, ``batch_size`` at a time, run the verifier
    on each complete string, keep the accepted ones, and repeat until ``num_samples`` are accepted.
    The samples are i.i.d. from **exactly** the LM conditioned on the constraint set, the restricted
    distribution ``p(s) proportional to 1(s in A) p_O(s)`` of Section 3.1.1.

    Costs are those of the sequential algorithm that generates the same i.i.d. strings one by one and
    stops at the ``num_samples``-th acceptance (strings drawn after it in the last batch are not
    counted): each string costs ``max_len`` LM calls (Def 3.1.1) and one verifier call. On the task
    of Prop 3.1.1 (uniform oracle on {0,1}^D, A = {0^D}) the expected LM calls per sample are
    ``2^D D`` (Prop 3.1.1 (1)).

    Returns a :class:`Result` with ``samples[site]`` ``[num_samples, max_len]``, no weights, and
    ``stats``: ``lm_calls``, ``verifier_calls`` (totals), ``lm_calls_per_sample``,
    ``verifier_calls_per_sample`` (``[num_samples]``), ``acceptance_rate``, ``strings_generated``.
    """

    def __init__(self, num_samples: int, max_len: int, batch_size: int | None = None, max_rounds: int = 10_000,
                 site: str = "z"):
        self.num_samples = num_samples
        self.max_len = max_len
        self.batch_size = check_count("batch_size", batch_size) if batch_size is not None else num_samples
        self.max_rounds = check_count("max_rounds", max_rounds)
        self.site = site

    def run(self, lm: torch.nn.Module, verifier: ProcessVerifier, prompt: torch.Tensor | None = None,
            generator: torch.Generator | None = None) -> Result:
        _check_common(self.num_samples, self.max_len, verifier, lm)
        dev = lm_device(lm)
        L, n = self.max_len, self.num_samples
        kept: list[torch.Tensor] = []
        gaps: list[torch.Tensor] = []  # strings generated up to and including each accepted one
        since_last = 0  # strings generated after the last accepted one
        total_strings = 0
        have = 0
        for _ in range(self.max_rounds):
            state = LMState.start(lm, self.batch_size, prompt=prompt, max_len=L, device=dev)
            z, _ = state.segment().sample_with_log_prob(generator)
            if z.shape[1] < L:
                z = torch.cat([z, z.new_zeros(z.shape[0], L - z.shape[1])], 1)
            ok = verifier.accepts(z)
            idx = torch.nonzero(ok).squeeze(-1)[: n - have]
            if idx.numel():
                pos = idx + 1  # 1-based position of each accepted string in this batch
                gap = torch.diff(pos, prepend=pos.new_zeros(1))
                gap[0] += since_last
                gaps.append(gap)
                kept.append(z[idx])
                have += idx.numel()
            if have == n:
                total_strings += int(idx[-1]) + 1
                break
            total_strings += self.batch_size
            since_last = since_last + self.batch_size if not idx.numel() else self.batch_size - int(idx[-1]) - 1
        else:
            raise SamplingBudgetError(f"RejectionSampling: {have} of {n} samples accepted after {self.max_rounds} "
                                      f"rounds of {self.batch_size} strings; raise max_rounds or batch_size")
        strings_per_sample = torch.cat(gaps)
        stats = {
            "lm_calls": total_strings * L,
            "verifier_calls": total_strings,
            "lm_calls_per_sample": strings_per_sample * L,
            "verifier_calls_per_sample": strings_per_sample,
            "strings_generated": total_strings,
            "acceptance_rate": n / total_strings,
        }
        return Result(samples={self.site: torch.cat(kept)}, stats=stats, engine="RejectionSampling")


@checked
class TokenwiseRejection:
    """Tokenwise rejection sampling with a process verifier (Def 3.1.5).

    At each position, propose ``t ~ O(s)`` (the LM's next-token distribution given the prefix ``s``)
    and run the process verifier on ``s o t``; repeat until ``V(s o t) = 1``, then move on. All rows
    advance together: at each position the rows still rejected re-propose in batched rounds.

    **Biased.** With a perfect process verifier every accepted string lies in ``A``, but the samples
    are *not* from the restricted distribution ``p(s) proportional to 1(s in A) p_O(s)``: each
    token is drawn from ``O(. | s)`` restricted to the completable tokens, i.e.
    ``q(s) = prod_i O(s_i | s_<i) 1(V(s_<=i)) / sum_t O(t | s_<i) 1(V(s_<i o t))``, a product of
    locally renormalised conditionals (Prop 3.1.2). On the task of Prop 3.1.2 (uniform oracle on
    {0,1}^D, A = strings with a 0) it gives ``1^{D-1} 0`` mass ``2^{-(D-1)}`` and every other string
    of ``A`` mass ``2^{-D}``, whereas the restricted distribution is uniform, ``1 / (2^D - 1)``.

    Costs (Def 3.1.6): every proposal is one LM call and one verifier call. On the task of
    Prop 3.1.1 (A = {0^D}) the expected LM calls per sample are ``2 D`` (Prop 3.1.1 (2)).

    Returns a :class:`Result` with ``samples[site]`` ``[num_samples, max_len]``, no weights, and
    ``stats``: ``lm_calls``, ``verifier_calls`` (totals), ``lm_calls_per_sample``,
    ``verifier_calls_per_sample`` (``[num_samples]``).

    Raises :class:`UnsatisfiableConstraintError` if the verifier rejects the empty prefix, and
    :class:`SamplingBudgetError` if some row is still rejected after ``max_tries`` proposals at one
    position (an LM that gives no mass to any completable token).
    """

    def __init__(self, num_samples: int, max_len: int, max_tries: int = 10_000, site: str = "z"):
        self.num_samples = num_samples
        self.max_len = max_len
        self.max_tries = check_count("max_tries", max_tries)
        self.site = site

    def run(self, lm: torch.nn.Module, verifier: ProcessVerifier, prompt: torch.Tensor | None = None,
            generator: torch.Generator | None = None) -> Result:
        _check_common(self.num_samples, self.max_len, verifier, lm)
        dev = lm_device(lm)
        n, L = self.num_samples, self.max_len
        aut = verifier.automaton
        q = start_states(verifier, n, dev)
        rule = TokenRule(None, lm.vocab_size)
        checked = TokenRule(aut, lm.vocab_size)  # the verifier's automaton, stepped by each proposal
        state = LMState.start(lm, n, prompt=prompt, rule=rule, max_len=L, device=dev)
        calls = torch.zeros(n, dtype=torch.long, device=dev)
        out = torch.zeros(n, L, dtype=torch.long, device=dev)
        for i in range(L):
            probs = torch.exp(rule.log_probs(state.logits, state.s))  # O(. | s) for every row
            tok = torch.zeros(n, dtype=torch.long, device=dev)
            pending = torch.arange(n, device=dev)
            for _ in range(self.max_tries):
                # one oracle call per pending row: the token step drawing from O (not the verifier's mask) and
                # stepping the verifier's automaton; a row of O with no mass is never accepted
                prop = token_step(checked, None, q[pending], generator=generator, probs=probs[pending])
                calls[pending] += 1
                ok = verifier.from_states(prop.state, i + 1) & ~prop.dead  # one verifier call each
                tok[pending[ok]] = prop.token[ok]
                pending = pending[~ok]
                if pending.numel() == 0:
                    break
            else:
                raise SamplingBudgetError(f"TokenwiseRejection: {pending.numel()} rows still rejected after "
                                          f"{self.max_tries} proposals at position {i}")
            q = aut.step(q, tok)
            out[:, i] = tok
            if i + 1 < L:
                state.extend(tok)
        stats = {
            "lm_calls": int(calls.sum()),
            "verifier_calls": int(calls.sum()),
            "lm_calls_per_sample": calls,
            "verifier_calls_per_sample": calls.clone(),
        }
        return Result(samples={self.site: out}, stats=stats, engine="TokenwiseRejection")


@checked
class VerifierSMC:
    """Exact baselines for verifier-guided generation: ``pt.infer.SMC`` on the program
    :class:`~ppl_thought.verifiers.program.VerifiedLM` (the LM restricted to A, Defs 3.1.2-3.1.3),
    drawing its tokens by the proposal (``VerifiedLM(..., draw=proposal)``, bootstrap: one LM pass per token;
    docs/architecture.md, "Engines": one engine core).

    The target after ``i`` tokens is ``gamma_i(s) = p_O(s) V(s)`` (the LM times the perfect process
    verifier, Def 3.1.3, a factor of each step); at ``i = N`` it is ``p_O(s) 1(s in A)``, the restricted
    distribution, whose normaliser is ``Z = P_O(A)``. SMC weighs each particle by ``gamma_i / (proposal)``,
    so the weighted particles are properly weighted for the restricted distribution and
    ``exp(log_marginal)`` is an unbiased estimate of ``P_O(A)`` (SMC's estimator, resampling when the ESS
    falls below ``ess_threshold * n``). Proposals (``proposal=``; as guides of ``draw="lm"`` they are
    :class:`~ppl_thought.verifiers.program.LocallyOptimalProposal` and
    :class:`~ppl_thought.verifiers.program.WeightedRejectionProposal`, with the same answers):

    * ``"lm"``: the bootstrap filter (``guide=None``), ``t ~ O(. | s)``, incremental weight ``V(s o t)`` (0 or 1);
    * ``"masked"``: ``t ~ O(. | s)``
      restricted to completable tokens (what tokenwise rejection samples, Def 3.1.5), incremental weight the
      local normaliser ``Z_V(s) = sum_t O(t | s) V(s o t)`` computed from the verifier's table; it is exactly
      the factor by which tokenwise rejection is biased (Prop 3.1.2), here corrected by the weight;
    * ``"rejection"``: weighted
      rejection in the AWRS style, for verifiers that can only be asked about one proposed token at a time:
      propose ``t ~ O(. | s)`` until two are accepted; the first accepted token is an exact draw from the
      restricted local law, and with ``K`` proposals in all, ``1 / (K - 1)`` is an unbiased estimate of
      ``Z_V(s)`` (the minimum-variance unbiased estimator of a success probability from negative-binomial
      sampling), independent of which token was accepted. The guide's density at its draw is the random
      ``O(t | s) (K - 1)`` (pseudo-marginal; see verified_lm.py). Costs ``1 / Z_V`` times more oracle calls
      than the locally optimal proposal.

    ``generator`` draws the proposals' tokens and SMC's resampling. Returns SMC's :class:`Result`
    (``engine="VerifierSMC"``) with ``samples[site]`` ``[n, N]`` (and the per-token sites ``f"{site}_{i}"``),
    ``log_weights``, ``log_marginal`` (log Z-hat) and ``stats``: ``lm_calls``, ``verifier_calls`` (Def 3.1.6:
    a proposed token is one LM call, a verdict one verifier call), ``ess`` per step (a tensor ``[N]``),
    ``resampled`` (the steps at which it resampled), ``proposal``, and SMC's own.
    """

    def __init__(self, num_particles: int, max_len: int, proposal: str = "masked", ess_threshold: float = 0.5,
                 resample_method: str = "systematic", max_tries: int = 10_000, site: str = "z"):
        self.num_particles = check_count("num_particles", num_particles)
        self.max_len = check_count("max_len", max_len)
        if proposal not in ("lm", "masked", "rejection"):
            raise ConfigError(f"proposal must be 'lm', 'masked' or 'rejection', got {proposal!r}")
        if not 0.0 <= float(ess_threshold) <= 1.0:
            raise ConfigError(f"ess_threshold must lie in [0, 1], got {ess_threshold!r}")
        self.proposal = proposal
        self.ess_threshold = float(ess_threshold)
        self.resample_method = check_scheme(resample_method)
        self.max_tries = check_count("max_tries", max_tries)
        self.site = site

    def program(self, lm: torch.nn.Module, verifier: ProcessVerifier, prompt: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> tuple[VerifiedLM, Program | None]:
        """(model, guide) that :meth:`run` gives ``pt.infer.SMC``: :class:`VerifiedLM` drawing its tokens by the
        proposal (one LM pass per token), and ``None`` (the program proposes; its factors carry the weights)."""
        return VerifiedLM(lm, verifier, prompt, self.site, generator, draw=self.proposal,
                          max_tries=max(self.max_tries, 2)), None

    def run(self, lm: torch.nn.Module, verifier: ProcessVerifier, prompt: torch.Tensor | None = None,
            generator: torch.Generator | None = None) -> Result:
        _check_common(self.num_particles, self.max_len, verifier, lm)
        model, guide = self.program(lm, verifier, prompt, generator)
        n, L = self.num_particles, self.max_len
        smc = SMC(n, ess_threshold=self.ess_threshold, resampling=self.resample_method, generator=generator,
                  max_steps=L)
        try:
            res = smc.run(model, guide)
        except ZeroWeightsError as e:
            raise ZeroWeightsError(f"VerifierSMC(proposal={self.proposal!r}): {e}; use proposal='masked' or more "
                                   "particles") from None
        if self.proposal == "rejection":
            lm_calls = ver_calls = int(model.calls)
        else:
            lm_calls = n * L
            ver_calls = n * L * (lm.vocab_size if self.proposal == "masked" else 1)
        res.engine = "VerifierSMC"
        res.stats.update({
            "lm_calls": lm_calls, "verifier_calls": ver_calls,
            "ess": torch.tensor(res.stats["ess"], dtype=torch.float32),
            "resampled": [i for i, r in enumerate(res.stats["resampled"]) if r], "proposal": self.proposal,
        })
        return res
