"""The plain LM program x ~ P_f (2.13): the program that the transforms of :mod:`ppl_thought.transforms` act on.

``PlainLM(lm, vocab)`` is an autoregressive LM over the observable vocabulary Sigma as a Pyro program with
one sequence site ``"x"``:

* whole view (``model(x)``): ``pyro.sample("x", LMSequence(lm, constraint=Identity(vocab).domain(|x|)), obs=x)``,
  the masked softmax of Def 2.8 restricted to Sigma (the identity projection, Ex 2.1);
* step view (SMC): the LM state of the site (:func:`~ppl_thought.transforms.sequence_start`) and one
  segment per step, ``pyro.sample(f"x_{t}", state.segment(until_emitted=t + 1), obs=x_t)``, each step
  extending the state with the value its site returns.

Under :class:`~ppl_thought.transforms.ProjectionLift` the same code is Proj # P_f: the site's LM is masked to
Dom(Proj) and each observed token becomes the latent segment z^(t) that emits it (Lemma 2.1), so
``ProjectionLift(proj)(PlainLM(lm, vocab))`` is :class:`~ppl_thought.models.SlowThinking`.
"""

from __future__ import annotations

import pyro
import torch

from ppl_thought import checks
from ppl_thought.distributions.lm_sequence import LMSequence
from ppl_thought.errors import ConfigError, ProgramError
from ppl_thought.lm.base import lm_device
from ppl_thought.program import Program, Shared, particles, pyro_module
from ppl_thought.projections.base import as_id_array
from ppl_thought.projections.identity import Identity
from ppl_thought.transforms.base import sequence_start
from ppl_thought.validation import ArrayLike, checked, per_token
from ppl_thought.vocab import Vocab

__all__ = ["PlainLM"]


@checked
class PlainLM(Program):
    """x ~ P_f: an LM over Sigma as a Pyro program with the sequence site ``site`` (default ``"x"``).

    Args:
        lm: any ppl_thought LM over ``vocab``.
        vocab: the vocabulary (Sigma = its ordinary tokens and ``<eos>``).
        site: the name of the sequence site (the step sites are ``f"{site}_{t}"``).
        module_name: the name the LM's trainable parameters are registered under (``pyro.module``; a frozen LM
            registers nothing).
        state_key: where the step view keeps the site's LM state in ``state`` (default: ``site``).

    ``model(x)`` observes x (text, token strings or 1-D ids); ``model(None, length=n)`` generates n tokens.
    """

    def __init__(self, lm: torch.nn.Module, vocab: Vocab, site: str = "x", module_name: str = "lm",
                 state_key: str | None = None):
        checks.lm("PlainLM: lm", lm)
        checks.instance("PlainLM: vocab", vocab, Vocab, "a pt.Vocab")
        if int(lm.vocab_size) != len(vocab):
            raise ConfigError(f"LM vocab_size {lm.vocab_size} != vocabulary size {len(vocab)}")
        self.lm = lm
        self.vocab = vocab
        self.site = site
        self.module_name = module_name
        self.state_key = site if state_key is None else state_key
        self.identity = Identity(vocab)
        self._domains: dict = {}

    def x_ids(self, x: ArrayLike) -> torch.Tensor:
        """x as a 1-D LongTensor of ids on the LM's device (accepts text, token strings, ids; right padding
        dropped)."""
        return torch.as_tensor(as_id_array(x, self.vocab, "observation x", unpad=True), dtype=torch.long,
                               device=lm_device(self.lm))

    def x_dist(self, num_observed: int) -> LMSequence:
        """P_f masked to Sigma (Def 2.8 with the identity projection), ``num_observed`` tokens long."""
        n = int(num_observed)
        if n not in self._domains:
            if len(self._domains) > 64:
                self._domains.clear()
            self._domains[n] = self.identity.domain(n)
        return LMSequence(self.lm, constraint=self._domains[n], vocab=self.vocab)

    # ------------------------------------------------------------------ whole view
    def __call__(self, x: ArrayLike | None = None, length: int | None = None):
        if x is None and length is None:
            raise ConfigError("give the observation x, or length= to generate")
        xt = self.x_ids(x) if x is not None else None
        n = len(xt) if xt is not None else int(length)
        pyro_module(self.module_name, self.lm)  # frozen weights are never param sites
        return pyro.sample(self.site, self.x_dist(n), obs=xt)

    model = __call__

    # ------------------------------------------------------------------ step view
    @per_token
    def init(self, state: dict, x: ArrayLike | None = None, length: int | None = None) -> None:
        if x is None:
            raise ProgramError(f"the step-wise {type(self).__name__} program needs the observation x "
                               "(SMC conditions on it)")

        xt = self.x_ids(x)
        pyro_module(self.module_name, self.lm)  # frozen weights are never param sites
        state[self.state_key] = sequence_start(self.site, self.x_dist(len(xt)), particles(), observed=xt)
        state[f"{self.site}:observed"] = Shared(xt)
        # where the steps end (observable counts): one token each, unless a transform set them at sequence_start
        # (ProjectionLift(proj, chunk=C): the forced segments join the step before them, end of 5.6.2)
        state.setdefault(f"{self.site}:step_ends", Shared(tuple(range(1, len(xt) + 1))))

    @per_token
    def step(self, state: dict, t: int, x: ArrayLike | None = None, length: int | None = None):
        """The segment that emits x_t (one token of x here; the latent segment z^(t) under ProjectionLift), or
        the tokens up to ``state[f"{site}:step_ends"][t]`` when a transform set coarser steps."""
        xt = state[f"{self.site}:observed"].value
        ends = state[f"{self.site}:step_ends"].value
        st = state[self.state_key]
        last = t + 1 >= len(ends)
        lo, hi = (ends[t - 1] if t else 0), (len(xt) if last else ends[t])
        obs = xt[lo:hi].to(st.device).reshape(1, -1).expand(st.n, hi - lo)  # [n, 0] for x = ""
        seg = pyro.sample(f"{self.site}_{t}", st.segment(until_emitted=None if last else hi), obs=obs)
        st.extend(seg)
        return torch.ones(st.n, dtype=torch.bool, device=st.device) if last else None

    def __repr__(self) -> str:
        return f"PlainLM(lm={type(self.lm).__name__}, vocab={len(self.vocab)} tokens)"
