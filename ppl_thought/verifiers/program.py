"""The LM conditioned on a verifier's constraint set, as a step-wise program, and its proposals as guides
(thesis Defs 3.1.2-3.1.5; docs/architecture.md, "How a program is written" and "Engines").

The constrained-generation task (Def 3.1.2) is (Sigma, A, O): the oracle O is an LM (Def 3.1.1) and
``A subset Sigma^N`` is decided by the perfect process verifier V of Def 3.1.3
(:class:`~ppl_thought.verifiers.ProcessVerifier`). :class:`VerifiedLM` is the restricted distribution

    p(s) proportional to p_O(s) 1(s in A)        (Section 3.1.1)

written as a :class:`~ppl_thought.program.Program`: step i draws token s_i from O(. | s_<i) (site
``f"{site}_{i}"``) and adds the factor ``log V(s_<=i)`` (0 or -inf; site ``f"{site}_ok_{i}"``). Since V is
monotone (V(s o t) = 1 implies V(s) = 1) and V = 1(. in A) on strings of length N, the product of the
factors up to step i is V(s_<=i): the program's unnormalised density after i steps is gamma_i(s) = p_O(s)
V(s), and after N steps p_O(s) 1(s in A), whose normaliser is Z = P_O(A). Every engine runs it:
``pt.infer.SMC`` with ``guide=None`` is the bootstrap filter (incremental weight V(s o t)); Importance runs
it as one trace (rejection sampling's weights 1(s in A)). The proposals are guides with the same sites:

* :class:`LocallyOptimalProposal` (``proposal="masked"``): t ~ O(. | s) restricted to the tokens the verifier
  accepts, renormalised: the law tokenwise rejection samples (Def 3.1.5). The engine's weight p / q is
  the local mass Z_V(s) = sum_t O(t | s) V(s o t), the factor by which tokenwise rejection is biased
  (Prop 3.1.2), here put back.
* :class:`WeightedRejectionProposal` (``proposal="rejection"``): for verifiers asked about one proposed
  token at a time. Propose t ~ O(. | s) until two are accepted (K proposals in all); the first accepted
  token is an exact draw from the masked law, and 1 / (K - 1) is an unbiased estimate of Z_V(s) (the
  minimum-variance unbiased estimator of a success probability from negative-binomial sampling),
  independent of which token was accepted. In the guide protocol the proposal's density at its own draw
  is the *random* density q-hat(t) = O(t | s) (K - 1) (a pseudo-marginal density: E[1 / q-hat(t) | t] =
  Z_V(s) / O(t | s) = 1 / q(t) for the masked law q), so the engine's p / q-hat = 1 / (K - 1) and the
  particles stay properly weighted. This is the one special case of the protocol here: the site's
  ``log_prob`` is defined only at the value it drew (asking it to score another value is an error).

:class:`~ppl_thought.verifiers.VerifierSMC` runs ``SMC(TokenSteps(program.one_token_step(), draw=proposal))`` (for
``VerifiedLM``: the law of ``VerifiedLM(draw=proposal)``; :func:`length_automaton` is its rule) and adds the oracle-call
counts of Def 3.1.6. Particles are a batch dimension: no loop over particles or the vocabulary; the
LM state is KV-cached and stays on the LM's device; a step adds no host sync (the rejection proposal's
rounds test whether rows are still pending, one sync per round, as tokenwise rejection does).
"""

from __future__ import annotations

from collections.abc import Sequence

import pyro
import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.distributions.token_rule import token_step
from ppl_thought.errors import (
    ConfigError,
    ProgramError,
    SamplingBudgetError,
    UnsatisfiableConstraintError,
)
from ppl_thought.lm.base import lm_device
from ppl_thought.program import OneTokenStep, Program, particles
from ppl_thought.projections.automaton import Automaton
from ppl_thought.projections.constraints import length_automaton as constraint_automaton
from ppl_thought.validation import checked, per_token
from ppl_thought.verifiers.process import ProcessVerifier
from ppl_thought.vocab import PAD_ID

DRAWS = ("lm", "masked", "rejection")
__all__ = ["DRAWS", "LocallyOptimalProposal", "NextToken", "TokenSteps", "VerifiedLM", "WeightedRejectionProposal",
           "length_automaton", "verifier_factor"]

_LOWEST = torch.finfo(torch.float32).min


# ---------------------------------------------------------------------------------------------- pieces
@checked
class NextToken(TorchDistribution):
    """One token per row from log-probabilities ``[n, V]`` (-inf: impossible), as a Pyro distribution.

    ``sample()`` draws by the one token step (:func:`~ppl_thought.distributions.token_rule.token_step`: inversion,
    one uniform per row from ``generator`` when given; a row of zero mass draws the last id, which it scores -inf);
    ``log_prob(t)``
    gathers ``log_probs[i, t_i]``. Batch shape ``[n]``, event shape ``()``.
    """

    arg_constraints: dict = {}
    support = constraints.nonnegative_integer
    has_rsample = False

    def __init__(self, log_probs: torch.Tensor, generator: torch.Generator | None = None,
                 validate_args: bool | None = None):
        self.log_probs = log_probs
        self.generator = generator
        super().__init__(batch_shape=log_probs.shape[:-1], event_shape=(), validate_args=False)

    @per_token
    def expand(self, batch_shape: Sequence[int], _instance: NextToken | None = None):
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        return NextToken(self.log_probs.expand(batch_shape + self.log_probs.shape[-1:]), self.generator)

    @per_token
    def sample(self, sample_shape: Sequence[int] = ()) -> torch.Tensor:
        if tuple(sample_shape):
            raise ProgramError("NextToken draws one token per particle row; sample_shape is not supported")
        lp = self.log_probs.reshape(-1, self.log_probs.shape[-1])
        return token_step(None, None, None, generator=self.generator, log_probs=lp).token.reshape(self.batch_shape)

    @per_token
    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        v = torch.as_tensor(value, device=self.log_probs.device).long()
        return self.log_probs.gather(-1, v.unsqueeze(-1)).squeeze(-1)


@checked
def verifier_factor(name: str, verifier: ProcessVerifier, states: torch.Tensor, length: int | torch.Tensor) -> None:
    """``pyro.factor(name, log V(s))``: the process verifier of Def 3.1.3 as a factor (0 or -inf, never NaN)
    on prefixes given by their automaton ``states [n]`` and ``length`` (their common length, or ``[n]``)."""
    ok = verifier.from_states(states, length)
    pyro.factor(name, torch.zeros(ok.shape, device=ok.device).masked_fill(~ok, float("-inf")))


def _check_task(lm, verifier) -> int:
    """N = the verifier's length; ConfigError unless the task (Def 3.1.2) is well formed for this LM."""
    if not isinstance(lm, torch.nn.Module) or not hasattr(lm, "vocab_size"):
        raise ConfigError(f"expected a ppl_thought LM (a torch module with vocab_size), got {type(lm).__name__}")
    if not isinstance(verifier, ProcessVerifier):
        raise ConfigError(f"expected a ProcessVerifier, got {type(verifier).__name__}")
    if verifier.length is None:
        raise ConfigError(f"{verifier} has no length: the verifier programs decide A subset Sigma^N; build it as "
                          "ProcessVerifier(automaton, length=N)")
    if verifier.automaton.vocab_size != lm.vocab_size:
        raise ConfigError(f"the constraint automaton has {verifier.automaton.vocab_size} token columns but the LM "
                          f"has vocab_size={lm.vocab_size}")
    return verifier.length


@checked
def length_automaton(verifier: ProcessVerifier) -> Automaton:
    """The constraint set A of a length-N process verifier (Def 3.1.3) as one token automaton: states (q, i) for the
    verifier's automaton state q after i tokens, kept where V = 1 (a string of A extends the prefix: ``reach[N - i,
    q]``), a token admitted iff V(s o t) = 1, final exactly at i = N in a final q. Its masked softmax (Def 2.8) is the
    locally optimal proposal q(t | s) = O(t | s) V(s o t) / Z_V(s) and its language is A: the rule of
    :meth:`VerifiedLM.one_token_step`. When A is empty the start state admits nothing and is not final (FAIL)."""
    if verifier.length is None:
        raise ConfigError(f"{verifier} has no length: build it as ProcessVerifier(automaton, length=N)")
    return constraint_automaton(verifier.automaton, verifier.length, verifier._reach)


class _VerifierSteps(Program):
    """What the program and its proposals share: the LM rows (KV-cached, :class:`LMState`), the automaton state
    of each prefix (``state["q"]``), the tokens so far (``state["tokens"] [n, i]``), N steps."""

    max_plate_nesting = 0

    def __init__(self, lm: torch.nn.Module, verifier: ProcessVerifier, prompt: torch.Tensor | None = None,
                 site: str = "z", generator: torch.Generator | None = None):
        self.length = _check_task(lm, verifier)
        if not isinstance(site, str) or not site:
            raise ConfigError(f"site must be a non-empty string, got {site!r}")
        self.lm, self.verifier, self.prompt, self.site, self.generator = lm, verifier, prompt, site, generator
        self.max_steps = self.length
        self.rule = TokenRule(None, lm.vocab_size)  # the LM's own law: every token but <pad> and <bos>
        self.checked = TokenRule(verifier.automaton, lm.vocab_size)  # the verifier's automaton, stepped by a proposal

    @property
    def device(self) -> torch.device:
        return lm_device(self.lm)

    def init(self, state: dict, *args, **kwargs) -> None:
        n, dev = particles(), self.device
        q = self.verifier.automaton.start_states(n, dev)
        if not bool(self.verifier.from_states(q[:1], 0)):  # one sync per run
            raise UnsatisfiableConstraintError(f"{self.verifier} rejects the empty prefix: A has no string (FAIL)")
        state["x"] = LMState.start(self.lm, n, prompt=self.prompt, rule=self.rule, max_len=self.length, device=dev)
        state["q"] = q
        state["tokens"] = torch.zeros(n, 0, dtype=torch.long, device=dev)

    def log_next(self, state: dict) -> torch.Tensor:
        """log O(. | s) ``[n, V]`` (Def 3.1.1; <pad> and <bos> never generated), float32."""
        x = state["x"]
        return self.rule.log_probs(x.logits, x.s)

    def accepted(self, state: dict, t: int) -> torch.Tensor:
        """V(s o t') for every token t' ``[n, V]`` (one gather in the verifier's table: V verifier calls a row)."""
        table = self.verifier.automaton.device_table("table", state["q"])
        return self.verifier.from_states(table[state["q"]], t + 1)

    def weighted_rejection(self, probs: torch.Tensor, q: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(first accepted token ``[n]``, proposals K ``[n]``): rounds over the rows with fewer than two
        acceptances, batched over those rows."""
        n, dev = probs.shape[0], probs.device
        ver = self.verifier
        first = torch.zeros(n, dtype=torch.long, device=dev)
        accepted = torch.zeros(n, dtype=torch.long, device=dev)
        tries = torch.zeros(n, dtype=torch.long, device=dev)
        pending = torch.arange(n, device=dev)
        for _ in range(self.max_tries):
            # one oracle call per pending row, through the one token step (drawing from O, stepping the automaton)
            prop = token_step(self.checked, None, q[pending], generator=self.generator, probs=probs[pending])
            tries[pending] += 1
            ok = ver.from_states(prop.state, t + 1) & ~prop.dead
            is_first = ok & (accepted[pending] == 0)
            first[pending[is_first]] = prop.token[is_first]
            accepted[pending] += ok.long()
            pending = pending[accepted[pending] < 2]
            if pending.numel() == 0:  # the round's host sync
                break
        else:
            raise SamplingBudgetError(f"weighted rejection: {pending.numel()} rows had fewer than two accepted "
                                      f"proposals after {self.max_tries} at position {t}")
        self.calls = self.calls + tries.sum()
        return first, tries

    def advance(self, state: dict, t: int, tok: torch.Tensor):
        """Append ``tok [n]``: automaton step, token buffer, one LM pass (skipped after the last token);
        returns the finished flags of step ``t``."""
        state["q"] = self.verifier.automaton.step(state["q"], tok)
        state["tokens"] = torch.cat([state["tokens"], tok[:, None]], 1)
        n = tok.shape[0]
        if t + 1 >= self.length:
            return torch.ones(n, dtype=torch.bool, device=tok.device)
        x = state["x"]
        logits, cache, context = x.feed(x.cache, x.context, tok[:, None], None)
        x.logits, x.cache, x.context = logits[:, -1], cache, context
        return None


# ---------------------------------------------------------------------------------------------- any token program
@checked
class TokenSteps(Program):
    """The program a :class:`~ppl_thought.program.OneTokenStep` describes, drawing its tokens by one of the proposals
    of :class:`VerifiedLM` (what :class:`~ppl_thought.verifiers.VerifierSMC` runs on any token-level program).

    The target is the spec's: p(z) 1[z admitted by ``spec.rule``] (ends: a final state, a stop id, ``max_tokens``).
    Step t, for the rows still running (ended rows read ``<pad>``, weight 1):

    * ``"lm"``: t ~ O(. | s), factor 1[t admitted] (0 or -inf);
    * ``"masked"``: t ~ the rule's masked softmax (Def 2.8), factor ``spec.mass`` (log Z_t, the local mass);
    * ``"rejection"``: weighted rejection (the first of two admitted proposals t ~ O), factor 1 / (K - 1).

    Every token is drawn by the one token step (``token_step``). Sites ``f"{site}_{t}"``, ``f"{site}_ok_{t}"``;
    ``Result.samples[site]`` holds the strings ``[n, max_tokens]`` (``<pad>`` after the end).
    """

    max_plate_nesting = 0

    def __init__(self, spec: OneTokenStep, prompt: torch.Tensor | None = None, site: str = "z",
                 generator: torch.Generator | None = None, draw: str = "masked", max_tries: int = 10_000):
        if draw not in DRAWS:
            raise ConfigError(f"draw must be one of {DRAWS}, got {draw!r}")
        if not isinstance(site, str) or not site:
            raise ConfigError(f"site must be a non-empty string, got {site!r}")
        self.spec, self.prompt, self.site, self.generator = spec, prompt, site, generator
        self.draw, self.max_tries = draw, max(int(max_tries), 2)
        self.lm, self.max_steps = spec.lm, int(spec.max_tokens)
        self.free = TokenRule(None, spec.lm.vocab_size)  # O: every token but <pad> and <bos>
        self.calls = torch.zeros((), dtype=torch.long)

    @property
    def device(self) -> torch.device:
        return lm_device(self.lm)

    @per_token
    def init(self, state: dict, *args, **kwargs) -> None:
        n, dev, rule = particles(), self.device, self.spec.rule
        s = rule.start(n, dev)
        if not bool(rule.allowed(s[:1]).any() | rule.is_final(s[:1]).any()):  # one sync per run
            raise UnsatisfiableConstraintError(f"{rule.constraint}: the constraint admits no string (FAIL)")
        state["x"] = LMState.start(self.lm, n, prompt=self.prompt, rule=self.free, max_len=self.max_steps, device=dev)
        state["q"] = s
        state["done"] = rule.is_final(s) | (self.max_steps == 0)
        state["lengths"] = torch.zeros(n, dtype=torch.long, device=dev)
        state["tokens"] = torch.full((n, self.max_steps), PAD_ID, dtype=torch.long, device=dev)
        self.calls = torch.zeros((), dtype=torch.long, device=dev)

    def _inactive(self, lp: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """``lp`` with the ended rows' law all on ``<pad>``."""
        pad = torch.full_like(lp[:1], float("-inf"))
        pad[0, PAD_ID] = 0.0
        return torch.where(done[:, None], pad, lp)

    @per_token
    def step(self, state: dict, t: int, *args, **kwargs):
        x, s, done, spec = state["x"], state["q"], state["done"], self.spec
        name, ok = f"{self.site}_{t}", f"{self.site}_ok_{t}"
        if self.draw == "lm":  # t ~ O(. | s), factor 1[t admitted]
            tok = pyro.sample(name, NextToken(self._inactive(self.free.log_probs(x.logits, x.s), done), self.generator))
            admitted = spec.rule.allowed(s).gather(1, tok[:, None])[:, 0] | done
            pyro.factor(ok, torch.zeros(admitted.shape, device=s.device).masked_fill(~admitted, float("-inf")))
        elif self.draw == "masked":  # t ~ masked softmax (Def 2.8), factor log Z_t: the same density, one pass
            log_z = spec.mass(x.logits, s, done)
            tok = pyro.sample(name, NextToken(self._inactive(spec.rule.log_probs(x.logits, s), done), self.generator))
            pyro.factor(ok, log_z)
        else:  # weighted rejection: the first of two admitted proposals, factor 1 / (K - 1) (unbiased for Z_t)
            draw = _RejectionDraw(self, state, t)
            tok = pyro.sample(name, draw)
            pyro.factor(ok, -draw.log_k_minus_1)
        active = ~done
        lengths = state["lengths"] + active.long()
        s_new = spec.rule.advance(s, tok)
        _, ended = spec.ends(tok, s_new, lengths)
        state["q"], state["lengths"] = s_new, lengths
        state["tokens"] = state["tokens"].index_copy(1, torch.tensor([t], device=tok.device), tok[:, None])
        state["done"] = new_done = done | (active & ended)
        if t + 1 < self.max_steps:
            logits, cache, context = x.feed(x.cache, x.context, tok[:, None], None)
            x.logits, x.cache, x.context = logits[:, -1], cache, context
        return new_done.clone()

    # what _RejectionDraw reads
    @per_token
    def log_next(self, state: dict) -> torch.Tensor:
        """log O(. | s) ``[n, V]``; ended rows: all on ``<pad>``."""
        x = state["x"]
        return self._inactive(self.free.log_probs(x.logits, x.s), state["done"])

    @per_token
    def weighted_rejection(self, probs: torch.Tensor, q: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(first admitted token ``[n]``, proposals K ``[n]``) for the running rows (ended rows: ``<pad>``, K = 2),
        rounds over the rows with fewer than two admitted proposals, each proposal a token step of the rule."""
        n, dev, rule = probs.shape[0], probs.device, self.spec.rule
        ended = probs[:, PAD_ID] > 0  # the ended rows' law (log_next) is all on <pad>
        first = torch.full((n,), PAD_ID, dtype=torch.long, device=dev)
        accepted = torch.where(ended, 2, 0)
        tries = torch.where(ended, 2, 0)
        pending = torch.nonzero(~ended).squeeze(-1)
        for _ in range(self.max_tries):
            if pending.numel() == 0:  # the round's host sync
                break
            prop = token_step(rule, None, q[pending], generator=self.generator, probs=probs[pending])
            tries[pending] += 1
            ok = (prop.state >= 0) & ~prop.dead
            is_first = ok & (accepted[pending] == 0)
            first[pending[is_first]] = prop.token[is_first]
            accepted[pending] += ok.long()
            pending = pending[accepted[pending] < 2]
        else:
            if pending.numel():
                raise SamplingBudgetError(f"weighted rejection: {pending.numel()} rows had fewer than two admitted "
                                          f"proposals after {self.max_tries} at position {t}")
        self.calls = self.calls + (tries * (~ended)).sum()
        return first, tries

    def outputs(self, state: dict, *args, **kwargs) -> dict:
        """``{site: tokens [n, max_tokens]}`` (``<pad>`` after each string's end)."""
        return {self.site: state["tokens"]}


# ---------------------------------------------------------------------------------------------- the program
@checked
class VerifiedLM(TokenSteps):
    """p(s) proportional to p_O(s) 1(s in A): an LM restricted to the constraint set of a process verifier
    (Def 3.1.2, Def 3.1.3, Section 3.1.1), one token per step (see the module docstring).

    Args:
        lm: the oracle O (any ppl_thought LM: ``pt.lm.Tabular``, ``pt.lm.Transformer``, ``pt.lm.HuggingFace``).
        verifier: a :class:`~ppl_thought.verifiers.ProcessVerifier` with a length N (``A subset Sigma^N``).
        prompt: 1-D token ids shared by every particle (encoded once), or None.
        site: the sites are ``f"{site}_{i}"`` (token i, the LM's law) and ``f"{site}_ok_{i}"`` (the factor
            log V(s_<=i)); ``Result.samples[site]`` holds the strings ``[n, N]``.
        generator: a ``torch.Generator`` the bootstrap draws its tokens from (default: torch's).
        draw: how the program itself draws token i, each with a factor that keeps the density of the string
            p_O(s) V(s) (so the target, Z and every engine's answer are the same):

            * ``"lm"``: t ~ O(. | s), factor V(s o t) (0 or 1);
            * ``"masked"``: t ~ O(. | s) V(s o t) / Z_V(s) (the locally optimal proposal, Def 3.1.5's law), factor
              the local mass Z_V(s) (what tokenwise rejection forgets, Prop 3.1.2): q(t) Z_V = O(t) V;
            * ``"rejection"``: weighted rejection (the first of two accepted proposals t ~ O, K proposals in all),
              factor 1 / (K - 1), an unbiased estimate of Z_V(s): the same in expectation (random-weight SMC);
              the site's density is the pseudo-marginal O(t | s) (K - 1) at its own draw.

            Bootstrap SMC on ``draw="masked"`` is SMC with the locally optimal proposal in one LM pass per token
            (the law :class:`~ppl_thought.verifiers.VerifierSMC` runs); as guides of ``draw="lm"`` the same proposals
            are :class:`LocallyOptimalProposal` and :class:`WeightedRejectionProposal` (two LM passes: the guide's
            and the model's).
        max_tries: proposals per row and position for ``draw="rejection"``.

    Under ``pt.infer.SMC(n).run(VerifiedLM(...), guide)``, ``exp(log_marginal)`` is unbiased for P_O(A) and the
    weighted particles are properly weighted for the restricted distribution, with ``guide=None`` (bootstrap),
    :class:`LocallyOptimalProposal` or :class:`WeightedRejectionProposal` (built on the same LM, verifier,
    prompt and site).
    """

    def __init__(self, lm: torch.nn.Module, verifier: ProcessVerifier, prompt: torch.Tensor | None = None,
                 site: str = "z", generator: torch.Generator | None = None, draw: str = "lm",
                 max_tries: int = 10_000):
        self.length = _check_task(lm, verifier)
        if not isinstance(max_tries, int) or isinstance(max_tries, bool) or max_tries < 2:
            raise ConfigError(f"max_tries must be an integer >= 2 (two acceptances are needed), got {max_tries!r}")
        self.verifier = verifier
        rule = TokenRule(length_automaton(verifier), lm.vocab_size)  # admits t iff V(s o t) = 1; final at N
        spec = OneTokenStep(lm, rule, self.length, (), prompt=lambda *a, **k: self.prompt)
        super().__init__(spec, prompt, site, generator, draw, max_tries)

    @per_token
    def init(self, state: dict, *args, **kwargs) -> None:
        q = self.verifier.automaton.start_states(1, self.device)
        if not bool(self.verifier.from_states(q, 0)):  # one sync per run
            raise UnsatisfiableConstraintError(f"{self.verifier} rejects the empty prefix: A has no string (FAIL)")
        super().init(state, *args, **kwargs)

    def one_token_step(self) -> OneTokenStep:
        """The program's step as one token of the LM (the token-level protocol, :class:`OneTokenStep`): the verifier's
        automaton is the rule (:func:`length_automaton`: admitted tokens are those with V(s o t) = 1, final at N),
        ``max_tokens`` N, no stop token, the prompt given at construction. Every token-level engine reads it, and the
        program's own step (:class:`TokenSteps`) is that step drawn by ``draw``."""
        return self.spec


# ---------------------------------------------------------------------------------------------- proposals
@checked
class LocallyOptimalProposal(_VerifierSteps):
    """The locally optimal proposal of :class:`VerifiedLM` (``proposal="masked"``): token i from
    q(t | s) = O(t | s) V(s o t) / Z_V(s), the law of tokenwise rejection (Def 3.1.5). The engine's weight
    p / q = Z_V(s) = sum_t O(t | s) V(s o t) is the local mass that tokenwise rejection forgets (Prop 3.1.2).
    Same arguments as :class:`VerifiedLM` (the generator draws the proposals)."""

    def local_log_probs(self, state: dict, t: int) -> torch.Tensor:
        """log q(. | s) ``[n, V]``: the LM masked to the accepted tokens, renormalised (-inf rows where Z_V = 0)."""
        lq = self.log_next(state).masked_fill(~self.accepted(state, t), float("-inf"))
        return lq - torch.logsumexp(lq, -1, keepdim=True).clamp(min=_LOWEST)

    @per_token
    def step(self, state: dict, t: int, *args, **kwargs):
        tok = pyro.sample(f"{self.site}_{t}", NextToken(self.local_log_probs(state, t), self.generator))
        return self.advance(state, t, tok)


class _RejectionDraw(NextToken):
    """The weighted-rejection draw of :class:`WeightedRejectionProposal`: ``sample()`` runs the rounds;
    ``log_prob`` of the value it drew is the pseudo-marginal density log O(t | s) + log(K - 1)."""

    def __init__(self, proposal: _VerifierSteps, state: dict, t: int):
        super().__init__(proposal.log_next(state), proposal.generator)
        self.proposal, self.q, self.t = proposal, state["q"], t
        self._drawn: tuple[torch.Tensor, torch.Tensor] | None = None

    def expand(self, batch_shape: Sequence[int], _instance: _RejectionDraw | None = None):
        if torch.Size(batch_shape) != self.batch_shape:
            raise ProgramError("the weighted-rejection proposal draws one token per particle row")
        return self

    def sample(self, sample_shape: Sequence[int] = ()) -> torch.Tensor:
        if tuple(sample_shape):
            raise ProgramError("the weighted-rejection proposal draws one token per particle row")
        tok, tries = self.proposal.weighted_rejection(torch.exp(self.log_probs), self.q, self.t)
        self._drawn = (tok, torch.log((tries - 1).float()))
        return tok

    @property
    def log_k_minus_1(self) -> torch.Tensor:
        """log(K - 1) ``[n]`` of the draw (K: the proposals it took)."""
        if self._drawn is None:
            raise ProgramError("the weighted-rejection draw has not been sampled yet")
        return self._drawn[1]

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._drawn is None or value is not self._drawn[0]:
            raise ProgramError("the weighted-rejection proposal's density is a random estimate defined only at the "
                               "token it drew (its site cannot be scored on another value)")
        return super().log_prob(value) + self._drawn[1]


@checked
class WeightedRejectionProposal(_VerifierSteps):
    """Weighted rejection (AWRS style) as the proposal of :class:`VerifiedLM` (``proposal="rejection"``).

    Per row, propose t ~ O(. | s) until two proposals are accepted by the verifier (K proposals); the
    token is the first accepted one, an exact draw from the masked law, and the site's density is the random
    q-hat(t) = O(t | s) (K - 1), so the engine's weight is p / q-hat = 1 / (K - 1), unbiased for Z_V(s)
    (module docstring: E[1 / q-hat(t) | t] = 1 / q(t)). Costs 1 / Z_V times the oracle calls of
    :class:`LocallyOptimalProposal`; ``calls`` (a device tensor, reset by ``init``) counts the proposals (each one
    LM call and one verifier call, Def 3.1.6).

    Args: as :class:`VerifiedLM`, plus ``max_tries`` (proposals per row and position before
    :class:`~ppl_thought.errors.SamplingBudgetError`).
    """

    def __init__(self, lm: torch.nn.Module, verifier: ProcessVerifier, prompt: torch.Tensor | None = None,
                 site: str = "z", generator: torch.Generator | None = None, max_tries: int = 10_000):
        super().__init__(lm, verifier, prompt, site, generator)
        if isinstance(max_tries, bool) or max_tries < 2:
            raise ConfigError(f"max_tries must be an integer >= 2 (two acceptances are needed), got {max_tries!r}")
        self.max_tries = max_tries
        self.calls = torch.zeros((), dtype=torch.long)

    @per_token
    def init(self, state: dict, *args, **kwargs) -> None:
        super().init(state, *args, **kwargs)
        self.calls = torch.zeros((), dtype=torch.long, device=self.device)

    @per_token
    def step(self, state: dict, t: int, *args, **kwargs):
        tok = pyro.sample(f"{self.site}_{t}", _RejectionDraw(self, state, t))
        return self.advance(state, t, tok)
