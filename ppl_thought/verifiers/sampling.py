"""Verifier-assisted generation: rejection sampling (Def 3.1.4) and tokenwise rejection sampling (Def 3.1.5).

Every engine here takes a token-level program, ``run(program, guide, *args)``: any program whose
:meth:`~ppl_thought.program.Program.one_token_step` declares its step as one token of one LM (the oracle O of
Def 3.1.1) under a token automaton, whose language is the constraint set ``A`` (``pt.models.Constrained``,
:class:`~ppl_thought.verifiers.VerifiedLM`, a user's own program); the target is p_O(s) 1(s in A). They read
only the :class:`~ppl_thought.program.OneTokenStep` (a program without one gets a ConfigError naming the method);
``guide`` must be ``None`` (each algorithm has its own proposal). ``run(lm, verifier, prompt=None,
generator=None)`` is sugar for ``run(VerifiedLM(lm, verifier, prompt), None, generator=generator)``: ``A``
given by a :class:`~ppl_thought.verifiers.ProcessVerifier` with a fixed length ``N`` (``A subset Sigma^N``).
Batched over samples: every row is a particle, the only Python loops are over token positions (and, for
tokenwise rejection, over rounds of re-proposals of the rows still rejected at the current position).

Oracle calls are counted as the thesis counts them (Def 3.1.1, Def 3.1.6): one call of O returns
one sample of the next token given a prefix, so a proposed token is one LM call and a complete
string of length N costs N calls. A verifier call is one evaluation of V (Def 3.1.3 / membership
in A). ``Result.stats`` holds the totals ``lm_calls`` and ``verifier_calls``, and the calls spent on
each returned sample (``lm_calls_per_sample``, ``verifier_calls_per_sample`` ``[n]``), whose means
estimate the oracle complexities of Prop 3.1.1 (``2^D D`` and ``2 D`` on its example).
"""

from __future__ import annotations

from typing import Any

import torch

from ppl_thought.checks import integer as check_count  # the one home of the check
from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.distributions.token_rule import token_step
from ppl_thought.errors import ConfigError, SamplingBudgetError, UnsatisfiableConstraintError, ZeroWeightsError
from ppl_thought.inference.resampling import check_scheme
from ppl_thought.inference.result import Result
from ppl_thought.inference.smc import SMC
from ppl_thought.lm.base import lm_device
from ppl_thought.program import OneTokenStep, is_program
from ppl_thought.validation import checked
from ppl_thought.verifiers.program import TokenSteps, VerifiedLM
from ppl_thought.vocab import PAD_ID

__all__ = ["RejectionSampling", "TokenwiseRejection", "VerifierSMC", "SamplingBudgetError",
           "UnsatisfiableConstraintError"]


def _is_lm(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module) and not is_program(obj)


def token_program(program: Any, guide: Any, args: tuple, kwargs: dict, generator: torch.Generator | None,
                  engine: str) -> tuple[OneTokenStep, Any, torch.Generator | None, Any]:
    """(the program's :class:`OneTokenStep`, the prompt ids, the generator, the program) of ``run(program, guide,
    *args, **kwargs)``, with the sugar ``run(lm, verifier, prompt=None, generator=None)`` ->
    ``VerifiedLM(lm, verifier, prompt)``; a :class:`ConfigError` for a guide (the engine has its own proposal)."""
    if _is_lm(program):
        if len(args) > 2 or kwargs.keys() - {"prompt"}:
            raise ConfigError(f"{engine}.run(lm, verifier, prompt=None, generator=None) takes at most a prompt and a "
                              f"generator after the verifier, got {len(args)} more arguments and {sorted(kwargs)}")
        prompt = kwargs.get("prompt", args[0] if args else None)
        generator = args[1] if len(args) > 1 else generator
        program, guide, args, kwargs = VerifiedLM(program, guide, prompt), None, (), {}
    if guide is not None:
        raise ConfigError(f"{engine} draws by its own proposal: guide must be None, got {type(guide).__name__}")
    spec = OneTokenStep.of(program, engine)
    return spec, spec.prompt_ids(args, kwargs), generator, program


def _check_spec(engine: str, spec: OneTokenStep, num: int, max_len: int) -> None:
    check_count("num_samples", num)
    check_count("max_len", max_len)
    if spec.max_tokens != max_len:
        raise ConfigError(f"{engine}(max_len={max_len}) but the program draws max_tokens={spec.max_tokens} tokens (a "
                          f"verifier decides strings of its length N: build the engine with max_len=N)")
    if spec.rule.vocab_size != spec.lm.vocab_size:
        raise ConfigError(f"the constraint has {spec.rule.vocab_size} token columns but the LM has "
                          f"vocab_size={spec.lm.vocab_size}")


class TokenRows:
    """``n`` rows of a token-level program's LM (KV-cached, :class:`LMState` under O's own law) with the state of its
    rule, lengths, end flags and tokens ``[n, max_tokens]`` (``<pad>`` after each end)."""

    def __init__(self, spec: OneTokenStep, n: int, prompt: Any):
        lm, T = spec.lm, int(spec.max_tokens)
        dev = lm_device(lm)
        self.spec, self.T, self.free = spec, T, TokenRule(None, lm.vocab_size)
        self.x = LMState.start(lm, n, prompt=prompt, rule=self.free, max_len=T, device=dev)
        self.s = spec.rule.start(n, dev)
        self.done = spec.rule.is_final(self.s) | (T == 0)
        self.lengths = torch.zeros(n, dtype=torch.long, device=dev)
        self.tokens = torch.full((n, T), PAD_ID, dtype=torch.long, device=dev)

    def check_satisfiable(self) -> None:
        """FAIL (Def 3.1.2) when the rule admits nothing from its start state and the empty string is not in A."""
        rule, s = self.spec.rule, self.s[:1]
        if not bool(rule.allowed(s).any() | rule.is_final(s).any()):
            raise UnsatisfiableConstraintError(f"{rule.constraint}: the constraint admits no string (FAIL)")

    def log_free(self) -> torch.Tensor:
        """log O(. | s) ``[n, V]`` (Def 3.1.1; <pad> and <bos> never generated)."""
        return self.free.log_probs(self.x.logits, self.x.s)

    def push(self, t: int, tok: torch.Tensor, s_new: torch.Tensor) -> None:
        """Append ``tok`` (``<pad>`` on ended rows), taking the rule to ``s_new``; one LM pass (not after the last)."""
        active = ~self.done
        self.lengths += active.long()
        _, ended = self.spec.ends(tok, s_new, self.lengths)
        self.tokens[:, t] = tok
        self.s, self.done = s_new, self.done | (active & ended)
        if t + 1 < self.T:
            x = self.x
            logits, cache, context = x.feed(x.cache, x.context, tok[:, None], None)
            x.logits, x.cache, x.context = logits[:, -1], cache, context


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

    def run(self, program: Any, guide: Any = None, *args: Any, generator: torch.Generator | None = None,
            **kwargs: Any) -> Result:
        """Rejection sampling of the token-level ``program`` run on ``*args, **kwargs`` (``guide=None``); or
        ``run(lm, verifier, prompt=None, generator=None)`` (module docstring)."""
        spec, prompt, generator, _ = token_program(program, guide, args, kwargs, generator, "RejectionSampling")
        _check_spec("RejectionSampling", spec, self.num_samples, self.max_len)
        n, rule = self.num_samples, spec.rule
        kept: list[torch.Tensor] = []
        per_sample: list[torch.Tensor] = []  # (strings, tokens) generated up to and including each accepted one
        since_last = torch.zeros(2, dtype=torch.long, device="cpu")  # strings and tokens after the last accepted one
        total = torch.zeros(2, dtype=torch.long, device="cpu")
        have = 0
        for _ in range(self.max_rounds):
            rows = TokenRows(spec, self.batch_size, prompt)
            bad = torch.zeros_like(rows.done)
            for t in range(rows.T):  # whole strings from O; the rule is stepped, and asked only at the end
                active = ~rows.done
                step = token_step(rule, None, rows.s, active, generator, log_probs=rows.log_free())
                bad |= active & ~rule.allowed(rows.s).gather(1, step.token[:, None])[:, 0]
                rows.push(t, step.token, step.state)
                if bool(rows.done.all()):
                    break
            ok = ~bad  # one outcome-verifier call per string: every token admitted (s in A)
            idx = torch.nonzero(ok).squeeze(-1)[: n - have]
            cost = torch.stack([torch.ones_like(rows.lengths), rows.lengths], 1).cumsum(0).cpu()  # [B, 2]
            if idx.numel():
                at = cost[idx.cpu()]
                gap = torch.diff(at, dim=0, prepend=torch.zeros(1, 2, dtype=torch.long, device=at.device))
                gap[0] += since_last
                per_sample.append(gap)
                kept.append(rows.tokens[idx])
                have += idx.numel()
            if have == n:
                total += cost[int(idx[-1])]
                break
            total += cost[-1]
            since_last = since_last + cost[-1] if not idx.numel() else cost[-1] - cost[int(idx[-1])]
        else:
            raise SamplingBudgetError(f"RejectionSampling: {have} of {n} samples accepted after {self.max_rounds} "
                                      f"rounds of {self.batch_size} strings; raise max_rounds or batch_size")
        gaps = torch.cat(per_sample)
        stats = {
            "lm_calls": int(total[1]),
            "verifier_calls": int(total[0]),
            "lm_calls_per_sample": gaps[:, 1],
            "verifier_calls_per_sample": gaps[:, 0],
            "strings_generated": int(total[0]),
            "acceptance_rate": n / int(total[0]),
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

    def run(self, program: Any, guide: Any = None, *args: Any, generator: torch.Generator | None = None,
            **kwargs: Any) -> Result:
        """Tokenwise rejection on the token-level ``program`` run on ``*args, **kwargs`` (``guide=None``); or
        ``run(lm, verifier, prompt=None, generator=None)`` (module docstring)."""
        spec, prompt, generator, _ = token_program(program, guide, args, kwargs, generator, "TokenwiseRejection")
        _check_spec("TokenwiseRejection", spec, self.num_samples, self.max_len)
        n, rule = self.num_samples, spec.rule
        rows = TokenRows(spec, n, prompt)
        rows.check_satisfiable()
        dev = rows.tokens.device
        calls = torch.zeros(n, dtype=torch.long, device=dev)
        for i in range(rows.T):
            probs = torch.exp(rows.log_free())  # O(. | s) for every row
            tok = torch.full((n,), PAD_ID, dtype=torch.long, device=dev)
            pending = torch.nonzero(~rows.done).squeeze(-1)
            if pending.numel() == 0:
                break
            for _ in range(self.max_tries):
                # one oracle call per pending row: the token step drawing from O (not the rule's mask) and stepping
                # the rule's automaton; a row of O with no mass is never accepted
                prop = token_step(rule, None, rows.s[pending], generator=generator, probs=probs[pending])
                calls[pending] += 1
                ok = (prop.state >= 0) & ~prop.dead  # one verifier call each: V(s o t) = 1, t admitted
                tok[pending[ok]] = prop.token[ok]
                pending = pending[~ok]
                if pending.numel() == 0:
                    break
            else:
                raise SamplingBudgetError(f"TokenwiseRejection: {pending.numel()} rows still rejected after "
                                          f"{self.max_tries} proposals at position {i}")
            rows.push(i, tok, rule.advance(rows.s, tok))
        stats = {
            "lm_calls": int(calls.sum()),
            "verifier_calls": int(calls.sum()),
            "lm_calls_per_sample": calls,
            "verifier_calls_per_sample": calls.clone(),
        }
        return Result(samples={self.site: rows.tokens}, stats=stats, engine="TokenwiseRejection")


@checked
class VerifierSMC:
    """Exact baselines for verifier-guided generation: ``pt.infer.SMC`` on a token-level program (its
    :class:`~ppl_thought.program.OneTokenStep`, e.g. :class:`~ppl_thought.verifiers.program.VerifiedLM`: the LM
    restricted to A, Defs 3.1.2-3.1.3) drawing its tokens by the proposal
    (:class:`~ppl_thought.verifiers.program.TokenSteps`; for VerifiedLM the law of ``VerifiedLM(..., draw=proposal)``;
    one LM pass per token; docs/architecture.md, "Engines": one engine core).

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

    def program(self, program: Any, guide: Any = None, *args: Any, generator: torch.Generator | None = None,
                **kwargs: Any) -> tuple[TokenSteps, None]:
        """(model, guide) that :meth:`run` gives ``pt.infer.SMC``: the program's :class:`OneTokenStep` as
        :class:`~ppl_thought.verifiers.program.TokenSteps` drawing its tokens by the proposal (one LM pass per
        token), and ``None`` (the program proposes; its factors carry the weights). Same arguments as :meth:`run`."""
        spec, prompt, generator, _ = token_program(program, guide, args, kwargs, generator, "VerifierSMC")
        _check_spec("VerifierSMC", spec, self.num_particles, self.max_len)
        return TokenSteps(spec, prompt, self.site, generator, draw=self.proposal, max_tries=self.max_tries), None

    def run(self, program: Any, guide: Any = None, *args: Any, generator: torch.Generator | None = None,
            **kwargs: Any) -> Result:
        """SMC on the token-level ``program`` run on ``*args, **kwargs`` (``guide=None``: the proposal is
        ``proposal=``); or ``run(lm, verifier, prompt=None, generator=None)`` (module docstring)."""
        if _is_lm(program) and len(args) > 1:  # the sugar's generator, for SMC's resampling too
            generator = args[1]
        model, guide = self.program(program, guide, *args, generator=generator, **kwargs)
        n, L = self.num_particles, self.max_len
        smc = SMC(n, ess_threshold=self.ess_threshold, resampling=self.resample_method, generator=generator,
                  max_steps=L)
        try:
            res = smc.run(model, guide)
        except ZeroWeightsError as e:
            raise ZeroWeightsError(f"VerifierSMC(proposal={self.proposal!r}): {e}; use proposal='masked' or more "
                                   "particles") from None
        V = model.spec.lm.vocab_size
        if self.proposal == "rejection":
            lm_calls = ver_calls = int(model.calls)
        else:
            lm_calls = n * L
            ver_calls = n * L * (V if self.proposal == "masked" else 1)
        res.engine = "VerifierSMC"
        res.stats.update({
            "lm_calls": lm_calls, "verifier_calls": ver_calls,
            "ess": torch.tensor(res.stats["ess"], dtype=torch.float32),
            "resampled": [i for i, r in enumerate(res.stats["resampled"]) if r], "proposal": self.proposal,
        })
        return res
