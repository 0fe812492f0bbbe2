"""An LM conditioned on a token automaton's language, as a step-wise program (Def 2.8 and the SMC of Section 3.3).

Masked decoding (``LMSequence(lm, constraint=A)``) draws from the *locally* renormalised law
q(z) = prod_t p(z_t | z_<t) 1[z_t admitted] / Z_t, which is not the LM conditioned on A: it forgets the
factors Z_t, the LM's mass on the admitted tokens at each step (on the library's test model the two laws are
far apart in total variation, docs/constraints.md). :class:`Constrained` is the conditioned law as a
``pt.Program``: each step draws the next token from the masked law and adds the factor log Z_t, so the
program's density is p(z) 1[z in A] and every engine (Importance, SMC with ``guide=None``) weights its
particles by prod_t Z_t = p(z) / q(z); exp(log Z-hat) estimates P_LM(A), the mass of the language.
"""

from __future__ import annotations

from collections.abc import Callable

import pyro
import torch

from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.distributions.token_rule import log_mass_ratio
from ppl_thought.errors import ConfigError
from ppl_thought.lm.base import lm_device
from ppl_thought.program import OneTokenStep, Program, particles, twist
from ppl_thought.projections.automaton import Automaton
from ppl_thought.projections.token_lift import check_tokenizer
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import EOS_ID

__all__ = ["Constrained"]


@checked
class Constrained(Program):
    """``p(z | z in A)``: an LM restricted to the language of a token automaton, one token per step.

    Args:
        lm: any ppl_thought LM (``pt.lm.Transformer``, ``pt.lm.Tabular``, ``pt.lm.HuggingFace``).
        constraint: a token :class:`~ppl_thought.projections.Automaton` over the LM's ids, e.g.
            ``token_automaton(CharDFA.lipogram("e"), token_texts(vocab))``. Decoding stops in a final state
            (after ``<eos>`` for a lifted character automaton). ``None``: no constraint (the LM itself, ending
            after ``<eos>`` or ``max_tokens``; the sugar of the search and backtracking engines builds it).
        max_tokens: the most tokens a particle draws; a particle still running then is cut there (the target
            is then the law of the first ``max_tokens`` tokens restricted to prefixes of A).
        twist: optional ``twist(tokens [n, t]) -> log psi [n]``, a potential on the prefix that SMC adds at
            each step and removes at the next (``pt.twist``): it steers resampling without changing the
            target (a lookahead guess of how the prefix will fare), e.g. a preference for short words.
            ``twist="lookahead"`` is the one-step lookahead psi_t = Z_{t+1}, the LM's mass on the tokens the
            automaton admits next (read off the logits the step already computed, no extra forward pass): the
            incremental weight Z_t psi_t / psi_{t-1} becomes Z_{t+1}, so SMC resamples on how much mass the
            particle's next step keeps (the fully adapted particle filter of Section 3.3; Z-hat stays unbiased).

    ``run(prompt)``: ``prompt`` holds 1-D token ids shared by every particle (encoded once, the cache
    expanded). Sites ``x_0, x_1, ...`` hold one token per particle per step; ``mass_t`` holds log Z_t.
    Without a twist, ``pt.infer.SMC(n, backend="static")`` runs it as one fixed step per token on a static KV
    cache, captured as a CUDA graph on a GPU (inference/static_smc.py, docs/gpu.md); both paths weight a step
    with :meth:`log_mass`.
    """

    def __init__(self, lm: torch.nn.Module, constraint: Automaton | None, max_tokens: int,
                 twist: Callable[[torch.Tensor], torch.Tensor] | str | None = None):
        if constraint is not None and not isinstance(constraint, Automaton):
            raise ConfigError(f"Constrained needs a token Automaton (or None: the LM itself), got "
                              f"{type(constraint).__name__}")
        if constraint is not None and constraint.vocab_size != lm.vocab_size:
            raise ConfigError(f"the constraint has {constraint.vocab_size} token columns but the LM has "
                              f"vocab_size={lm.vocab_size}")
        check_tokenizer(constraint, lm, "Constrained")  # an automaton of another tokenizer's texts: refused
        if isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if twist is not None and not callable(twist) and twist != "lookahead":
            raise ConfigError(f"twist must be a callable on token prefixes or 'lookahead', got {twist!r}")
        self.lm, self.constraint, self.max_tokens, self.twist = lm, constraint, max_tokens, twist
        self.max_steps = max_tokens
        self.rule = TokenRule(constraint, lm.vocab_size)
        self.free = TokenRule(None, lm.vocab_size)  # the LM's own law: every token but <pad> and <bos>
        self.stop_ids = (EOS_ID,)  # a particle ends after <eos> (or in a final state, or after max_tokens)

    @per_token
    def init(self, state: dict, prompt: torch.Tensor | None = None) -> None:
        state["x"] = LMState.start(self.lm, particles(), prompt=prompt, rule=self.rule, max_len=self.max_tokens,
                                   stop_ids=torch.tensor(self.stop_ids, device=lm_device(self.lm)))

    @per_token
    def log_mass(self, logits: torch.Tensor, s: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """log Z_t ``[n]``: the log of the LM's mass on the tokens the automaton admits in states ``s``, over its
        mass on the tokens it may generate at all (Def 2.8's normaliser); 0 for ended rows (factor 1).
        The weight of one step, shared by :meth:`step` and the static SMC path (inference/static_smc.py)."""
        log_z = log_mass_ratio(self.rule, self.free, logits, s)  # exact for huge logits; kept for the draw
        return torch.where(done, torch.zeros_like(log_z), log_z)

    def one_token_step(self) -> OneTokenStep:
        """This program's step for every token-level engine (the static SMC backend, greedy and beam search, the
        verifier engines): one token of ``lm`` under the constraint's masked softmax (Def 2.8), weighted by
        :meth:`log_mass`, ended by ``<eos>``, a final state or ``max_tokens``; the prompt is the run's argument."""
        return OneTokenStep(self.lm, self.rule, self.max_tokens, self.stop_ids, self.log_mass, self.twist)

    @per_token
    def step(self, state: dict, t: int, prompt: torch.Tensor | None = None):
        x = state["x"]
        log_z = self.log_mass(x.logits, x.s, x.done)
        tok = pyro.sample(f"x_{t}", x.next_token())
        x.extend(tok)
        pyro.factor(f"mass_{t}", log_z)
        if self.twist == "lookahead":
            twist(self.log_mass(x.logits, x.s, x.done))  # log Z_{t+1}: 0 for ended rows
        elif self.twist is not None:
            twist(self.twist(x.tokens))
        return torch.ones_like(x.done) if t + 1 == self.max_tokens else x.done.clone()
