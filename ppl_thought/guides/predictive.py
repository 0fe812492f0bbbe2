"""The identity sampler (3.30) and predictive samplers (Def 3.7) for disentangled projections.

For a disentangled Proj (Def 3.5, (3.29)) a lifting is z = ((s_t, x_t))_t with s_t in S(x_<t).
The identity sampler draws each segment s_t from the thought distribution that marginalises
the next observable token,

    P(s_t | ((s_tau, x_tau))_{tau<t}) = sum_{a in Sigma} P([... (s_t, a)]) / sum_{s, a} P([... (s, a)]),

and then forces x_t. Token by token this is the prior decoded under the *domain* mask (Def 2.8)
where every token that would emit an observable a is redirected onto the token that emits
x_t in the same segment slot, and the probabilities of the tokens so merged are added:

- Identity, PauseToThink, SparseThoughts, QueryResponse: the emitting tokens are the
  observables themselves; all of Sigma is merged onto x_t, so P(no thought) = sum_a P(a | prefix);
- Product (Ex 2.2): the pair (a, y) is redirected onto (x_t, y), so P(y) = sum_a P((a, y)).

This is *not* decoding under the lifting automaton with a masked softmax, which renormalises
<s> against x_t alone and so depends on x_t (the causal sampler (3.33), :class:`~.Causal`).
The decision to think before x_t here sees only x_<t and earlier segments: the sampler is
predictive (Def 3.7); with the prior as LM it is Q_id (3.30).
"""

from __future__ import annotations

import pyro
import torch

from ppl_thought.distributions.lm_state import LMState, TokenRule
from ppl_thought.distributions.token_rule import token_step
from ppl_thought.errors import ConfigError
from ppl_thought.guides.base import Sampler
from ppl_thought.lm.base import lm_device
from ppl_thought.models.slow_thinking import SlowThinking
from ppl_thought.projections.automaton import Automaton
from ppl_thought.projections.base import Projection
from ppl_thought.projections.substitution import emission_substitution
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import BOS_ID, PAD_ID


@checked
class MarginalizedDecoder(Sampler):
    """Decode an LM under the domain mask, merging 'emit any a' onto x_t (the rule of (3.30)).

    ``lm`` reads ``<bos> z_<i`` (the latent prefix only, never x_>=t before it is forced).
    Batched over particles with the LM's KV cache; no loop over particles or vocabulary.
    """

    def __init__(self, lm: torch.nn.Module, projection: Projection, name: str = "predictive_lm"):
        if int(lm.vocab_size) != len(projection.vocab):
            raise ConfigError(f"LM vocab_size {lm.vocab_size} != projection vocabulary size {len(projection.vocab)}")
        self.lm = lm
        self.projection = projection
        self.name = name
        self._sub = torch.as_tensor(emission_substitution(projection))

    def _register(self) -> None:
        if any(p.requires_grad for p in self.lm.parameters()):
            pyro.module(self.name, self.lm)

    def _device(self) -> torch.device:
        return lm_device(self.lm)

    @per_token
    def step_log_probs(self, logits: torch.Tensor, sD: torch.Tensor, sL: torch.Tensor, x: torch.Tensor, D: Automaton,
                       lift: Automaton) -> torch.Tensor:
        """log Q(next token | prefix) ``[N, V]`` for rows in domain state sD / lifting state sL.

        p = softmax of the logits masked to Dom(Proj) (Def 2.8); the mass of every emitting token
        v is moved to ``sub[v, x_t]``; the result is restricted to the lifting mask and renormalised
        (a no-op for a disentangled Proj). Rows whose lifting state is dead or final give -inf.
        """
        N, V = logits.shape
        dev = logits.device
        mD = D.mask(sD).clone()
        mD[:, PAD_ID] = False
        mD[:, BOS_ID] = False
        masked = logits.masked_fill(~mD, float("-inf"))
        mx = masked.max(-1, keepdim=True).values
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        p = torch.exp(masked - mx)  # unnormalised, stable
        nxt = D.device_table("table", dev)[sD]  # [N, V]
        em = D.device_table("emitted", dev)
        emitting = mD & (em[nxt] > em[sD][:, None])
        t = lift.num_emitted(sL).clamp(0, max(len(x) - 1, 0))
        xt = x.to(dev)[t] if len(x) else torch.zeros(N, dtype=torch.long, device=dev)
        sub = self._sub.to(dev)[:, xt].T  # [N, V]: sub[v, x_t]
        ar = torch.arange(V, device=dev).expand(N, V)
        tgt = torch.where(emitting, sub, ar)
        tgt = torch.where(tgt < 0, torch.full_like(tgt, V), tgt)  # no substitute: drop the mass
        q = torch.zeros(N, V + 1, dtype=p.dtype, device=dev).scatter_add(1, tgt, p)[:, :V]
        q = q * lift.mask(sL).to(q.dtype)
        tot = q.sum(-1, keepdim=True)
        ok = tot > 0
        logq = torch.where(ok & (q > 0), torch.log(torch.where(q > 0, q, torch.ones_like(q))) -
                           torch.log(torch.where(ok, tot, torch.ones_like(tot))), torch.full_like(q, float("-inf")))
        return logq

    def step_state(self, x: torch.Tensor, n: int) -> LMState:
        """The rule (3.30) for ``n`` rows as an :class:`LMState` (state: domain and lifting states), decoded
        segment by segment (SMC)."""
        key = ("marginal_rule", tuple(x.tolist()))
        cache = self._automata()
        if key not in cache:
            cache[key] = MarginalizedRule(self, x, self.domain(len(x)), self.lifting(x))
        return LMState.start(self.lm, n, rule=cache[key], max_len=int(self.domain(len(x)).max_len))

    def _sample(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self._device()
        D, lift = self.domain(len(x)), self.lifting(x)
        L = int(D.max_len)
        z = torch.full((n, L), PAD_ID, dtype=torch.long, device=dev)
        lp = torch.zeros(n, device=dev)
        if n == 0:
            return z, lp
        with torch.no_grad():
            logits, cache = self.lm(torch.tensor([[BOS_ID]], device=dev))
            logits, cache = logits[:, -1].expand(n, -1), cache.expand(n)
            sD, sL = D.start_states(n, dev), lift.start_states(n, dev)
            done = lift.is_final(sL)
            for i in range(L):
                if done.all():
                    break
                logq = self.step_log_probs(logits.float(), sD, sL, x, D, lift)
                active = ~done
                step = token_step(None, None, None, active, log_probs=logq)  # ended rows draw <pad>
                tok = step.token
                lp = lp + step.log_prob
                z[:, i] = tok
                sD = torch.where(active, D.step(sD, tok), sD)
                sL = torch.where(active, lift.step(sL, tok), sL)
                done = done | lift.is_final(sL)
                feed = torch.where(active, tok, torch.full_like(tok, BOS_ID))
                logits, cache = self.lm(feed[:, None], cache=cache)
                logits = logits[:, -1]
        return z, lp

    def _teacher_forced(self, z: torch.Tensor, x: torch.Tensor):
        """One teacher-forced pass of the LM; the automata are run along the L positions.
        Returns (per-token log Q [n, L] (0 on padding), whether z is a complete lifting [n])."""
        dev = self._device()
        z = z.to(dev)
        n, L = z.shape
        D, lift = self.domain(len(x)), self.lifting(x)
        inputs = torch.cat([torch.full((n, 1), BOS_ID, dtype=torch.long, device=dev), z[:, :-1]], 1)
        logits, _ = self.lm(inputs)
        sD = torch.empty(n, L + 1, dtype=torch.long, device=dev)
        sL = torch.empty_like(sD)
        sD[:, 0], sL[:, 0] = D.start, lift.start
        for i in range(L):
            tok = z[:, i]
            pad = tok == PAD_ID
            sD[:, i + 1] = torch.where(pad, sD[:, i], D.step(sD[:, i], tok))
            sL[:, i + 1] = torch.where(pad, sL[:, i], lift.step(sL[:, i], tok))
        lengths = (z != PAD_ID).sum(-1)
        logq = self.step_log_probs(logits.reshape(n * L, -1).float(), sD[:, :L].reshape(-1),
                                   sL[:, :L].reshape(-1), x, D, lift).reshape(n, L, -1)
        step = logq.gather(-1, z[..., None]).squeeze(-1)
        inside = torch.arange(L, device=dev)[None] < lengths[:, None]
        step = torch.where(inside, step, torch.zeros_like(step))
        padded_ok = ((z != PAD_ID) == inside).all(-1)  # no <pad> inside the sequence
        end_state = sL.gather(1, lengths[:, None]).squeeze(1)
        ok = padded_ok & lift.is_final(end_state)
        # the sequence must stop at its first final state
        fin_before = lift.is_final(sL[:, :L].clamp(min=-1)) & inside
        ok = ok & ~fin_before.any(-1)
        return step, ok

    def _log_prob(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        step, ok = self._teacher_forced(z, x)
        total = step.sum(-1)
        return torch.where(ok, total, torch.full_like(total, float("-inf")))

    def _token_log_probs(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._teacher_forced(z, x)[0]


class MarginalizedRule(TokenRule):
    """The next-token rule of (3.30) for :class:`LMState`: state ``[n, 2]`` = (domain state, lifting state)."""

    def __init__(self, decoder: MarginalizedDecoder, x: torch.Tensor, D: Automaton, lift: Automaton):
        super().__init__(lift, len(decoder.projection.vocab))
        self.decoder, self.x, self.D, self.lift = decoder, x, D, lift

    def start(self, n: int, device) -> torch.Tensor:
        return torch.stack([self.D.start_states(n, device), self.lift.start_states(n, device)], -1)

    def log_probs(self, logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.decoder.step_log_probs(logits.float(), s[:, 0], s[:, 1], self.x, self.D, self.lift)

    def step(self, s: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.D.step(s[:, 0], tok), self.lift.step(s[:, 1], tok)], -1)

    def is_final(self, s: torch.Tensor) -> torch.Tensor:
        return self.lift.is_final(s[:, 1])

    def num_emitted(self, s: torch.Tensor) -> torch.Tensor:
        return self.lift.num_emitted(s[:, 1])


@checked
class Identity(MarginalizedDecoder):
    """The identity sampler Q_id of (3.30), Def 3.6: the model's own prior decoded with the next
    observable token marginalised out of each thought decision, then x_t forced.

    ``Identity(model)`` for a :class:`~ppl_thought.models.SlowThinking` model (needs a
    disentangled projection, Def 3.5; :class:`~ppl_thought.errors.NotDisentangledError` otherwise).
    Its log-probabilities carry gradients to the prior (the prior is not registered with Pyro here:
    the model registers it).
    """

    def __init__(self, model: SlowThinking):
        super().__init__(model.prior, model.projection, name="prior")
        self.model = model

    def _register(self) -> None:  # the model owns the prior
        pass


@checked
class Predictive(MarginalizedDecoder):
    """A predictive sampler (Def 3.7) with its own trainable LM: the same decision rule as
    :class:`Identity` ((3.30) with ``lm`` in place of P), so the segment before x_t is drawn
    from ``lm`` reading only x_<t and earlier segments (S_<=t independent of x_>=t, (3.31)).
    """

    def __init__(self, lm: torch.nn.Module, projection: Projection, name: str = "predictive_lm"):
        super().__init__(lm, projection, name=name)
