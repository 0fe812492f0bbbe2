"""``ProjectionLift(proj)``: a plain LM program becomes Proj # P_f (Sections 2.6.3, 3.7; Def 2.8, Lemma 2.1).

The one home of the static lifting: :class:`~ppl_thought.models.SlowThinking` is this transform applied to
the plain LM program :class:`~ppl_thought.models.PlainLM`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pyro
import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought.distributions.lm_sequence import LMSequence
from ppl_thought.distributions.lm_state import LMState, Segment, TokenRule, chunk_size
from ppl_thought.distributions.projected import ProjectionDelta
from ppl_thought.errors import NotInImageError, TransformError
from ppl_thought.program import Shared
from ppl_thought.projections.automaton import Automaton, step_ends
from ppl_thought.projections.base import Projection, as_id_array
from ppl_thought.transforms.base import Transform, rebuild
from ppl_thought.validation import ArrayLike, checked, per_token
from ppl_thought.vocab import PAD_ID

__all__ = ["ProjectionLift", "SegmentCheck", "enumerate_log_joint", "exact_log_prob"]


@checked
class SegmentCheck(TorchDistribution):
    """The observed site x_t of a lifted step: log 1{the latent segment z^(t) emits x_t}, 0 or -inf per row.

    Its value is the latent segment (what the program extends its LM state with); the log-probability is
    the check computed when the segment was drawn (the lifting automaton of x, Prop 2.3), whatever value
    it is asked about.
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)
    ragged_event = True

    def __init__(self, log_factor: torch.Tensor, validate_args: bool | None = None):
        self.log_factor = log_factor
        super().__init__(log_factor.shape, torch.Size([1]), validate_args=False)

    @per_token
    def expand(self, batch_shape: Sequence[int], _instance: SegmentCheck | None = None):
        batch_shape = torch.Size(batch_shape)
        return self if batch_shape == self.batch_shape else SegmentCheck(self.log_factor.expand(batch_shape))

    @per_token
    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return self.log_factor

    @per_token
    def sample(self, sample_shape: Sequence[int] = ()):  # pragma: no cover - the site is always observed
        raise TransformError("a lifted observation site is observed; it has nothing to sample")


_STEP = re.compile(r"^(.*)_(\d+)$")


@checked
class ProjectionLift(Transform):
    """Proj # P_f from a plain LM program: the sequence site ``site`` becomes a latent site ``latent`` drawn
    from its LM masked to Dom(Proj) (Def 2.8), and its observation becomes the projection of the latent.

    * Whole view: at ``pyro.sample(site, LMSequence(lm, ...), obs=x)`` the transform draws
      ``z = pyro.sample(latent, LMSequence(lm, constraint=proj.domain(|x|)))`` (the same LM, prompt and
      keyword arguments) and observes x under ``ProjectionDelta(proj, z, |x|)``: log 1{z in the lifting of
      x}. The joint is P_f^{<=|z|}(z) 1{Proj(z) = x}, whose marginal is (2.22).
    * Step view (:func:`~ppl_thought.transforms.sequence_start`): the site's LM state is started under the
      domain automaton; at the observed step site ``f"{site}_{t}"`` the transform draws the segment
      z^(t) of Lemma 2.1 at ``f"{latent}_{t}"`` (until x_{t+1} is determined, or the end of the lifting at
      the last step), checks with the lifting automaton of x that it emits x_t (0 or -inf), and returns
      z^(t) as the site's value, so the program extends its state with the latent segment. The product of
      the step laws is the law of ``latent``: both views have the same joint.
    * ``chunk = C > 0``: chunked encoding for sparse thoughts (end of Section 5.6.2). The latent site's LM
      state encodes runs of up to C forced tokens in one pass when it samples (:class:`LMState`), and the step
      view joins every forced segment of the lifting (the text between two thoughts) to the step before it
      (:func:`~ppl_thought.projections.automaton.step_ends`, written to ``state[f"{site}:step_ends"]``), so a
      step begins only where a thought may start. Same joint; SMC resamples at those steps only. Run it
      with a guide built with the same ``chunk`` (``pt.guides.Causal(lm, proj, chunk=C)``).

    ``model.projection`` of the transformed model is ``projection`` (the guides and engines read it), and
    ``model.chunk`` is ``chunk``.
    """

    def __init__(self, projection: Projection, site: str = "x", latent: str = "z", chunk: int = 0):
        super().__init__()
        self.chunk = chunk_size(chunk)
        if site == latent:
            raise TransformError(f"the latent site needs its own name (site and latent are both {site!r})")
        self.projection = projection
        self.site = site
        self.latent = latent
        self._domains: dict[int, tuple[Automaton, TokenRule]] = {}

    @property
    def needs(self) -> str:  # type: ignore[override]
        """What the transform acts on (the message of :meth:`~Transform.check_met`)."""
        return (f"the token-sequence site {self.site!r} (pyro.sample({self.site!r}, LMSequence(lm, ...), obs=x), or "
                f"sequence_start({self.site!r}, ...) in a step-wise program); name the model's site with site=")

    @property
    def provides(self) -> dict:
        return {"projection": self.projection, "chunk": self.chunk}

    def __call__(self, model: Callable[..., Any]):
        """Lift ``model``; a model that already has a projection is refused: the innermost lifting would take
        the site and this one would find no LM site left (liftings do not commute, nor stack)."""
        have = getattr(model, "projection", None)
        if have is not None:
            raise TransformError(f"the model is lifted already (by {have!r}); a second lifting of site {self.site!r} "
                                 "would find no LM site: build one projection for both (e.g. a product automaton)")
        return super().__call__(model)

    # ------------------------------------------------------------------ the lifted law
    def domain(self, num_observed: int) -> tuple[Automaton, TokenRule]:
        """The domain automaton of Dom(Proj) fixing ``num_observed`` tokens and its token rule (cached)."""
        n = int(num_observed)
        if n not in self._domains:
            if len(self._domains) > 256:
                self._domains.clear()
            dom = self.projection.domain(n)
            self._domains[n] = (dom, TokenRule(dom, len(self.projection.vocab)))
        return self._domains[n]

    def latent_dist(self, dist: LMSequence, num_observed: int) -> LMSequence:
        """The site's LM masked to Dom(Proj) (Def 2.8), stopped once ``num_observed`` tokens are determined."""
        if dist.vocab_size != len(self.projection.vocab):
            raise TransformError(f"site {self.site!r}: its LM has vocab_size {dist.vocab_size}, the projection's "
                                 f"vocabulary {len(self.projection.vocab)} tokens")
        return rebuild(dist, constraint=self.domain(num_observed)[0], vocab=self.projection.vocab, stop=None,
                       chunk=self.chunk or dist.chunk)

    # ------------------------------------------------------------------ whole view
    def _pyro_sample(self, msg) -> None:
        if msg["infer"].get("_pt_lifted"):
            return
        fn = msg["fn"]
        if msg["name"] == self.site:
            if not isinstance(fn, LMSequence):
                raise TransformError(f"{self!r} cannot act on site {self.site!r}: it is a {type(fn).__name__}, and "
                                     f"the transform needs {self.needs}")
            self._acted()
            self._lift_site(msg, fn)
            return
        if msg["is_observed"] and isinstance(fn, Segment) and getattr(fn.base, "_pt_lift", None) == self.key:
            m = _STEP.match(msg["name"] or "")
            if m is None or m.group(1) != self.site:
                return
            self._lift_step(msg, fn, int(m.group(2)))

    def _lift_site(self, msg, fn: LMSequence) -> None:
        obs = msg["value"] if msg["is_observed"] else None
        n = int(torch.as_tensor(obs).shape[-1]) if obs is not None else int(fn.max_len)
        if obs is not None and torch.as_tensor(obs).ndim == 1:  # NotInImageError for x outside the image: p(x) = 0
            self.projection.lifting(obs)  # exactly, an answer (-inf) for every engine, bootstrap included
        z = pyro.sample(self.latent, self.latent_dist(fn, n))
        msg["fn"] = ProjectionDelta(self.projection, z, n)
        msg["infer"]["_pt_lifted"] = True

    # ------------------------------------------------------------------ step view
    def _pyro_sequence_start(self, msg) -> None:
        if msg["name"] != self.site or msg["infer"].get("_pt_lifted"):
            return
        dist, n = msg["args"]
        self._acted()
        observed = msg["kwargs"].get("observed")
        if observed is None:
            raise TransformError(f"ProjectionLift: the step view of site {self.site!r} needs its observation "
                                 "(sequence_start(..., observed=x))")
        if self.state is None:
            raise TransformError("ProjectionLift: a step view runs inside a Transformed program's init/step")
        lift = self.projection.lifting(observed)  # NotInImageError for x outside the image
        T = int(len(observed))
        msg["args"] = (self.latent_dist(dist, T), n)
        msg["kwargs"]["rule"] = self.domain(T)[1]
        msg["infer"]["_pt_lifted"] = True
        self.state[self.key] = {"s": lift.start_states(int(n), dist.device), "num_observed": T,
                                "lifting": Shared(lift)}
        self.state[f"{self.site}:step_ends"] = Shared(step_ends(lift, chunked=bool(self.chunk)))

    def _pyro_post_sequence_start(self, msg) -> None:
        if msg["name"] == self.site and isinstance(msg["value"], LMState) and self.key in (self.state or {}):
            msg["value"]._pt_lift = self.key

    def _lift_step(self, msg, fn: Segment, t: int) -> None:
        entry = self.state[self.key]
        st = fn.base
        ends = self.state[f"{self.site}:step_ends"].value
        last = t + 1 >= len(ends)
        seg = pyro.sample(f"{self.latent}_{t}", st.segment(until_emitted=None if last else ends[t]))
        lift = entry["lifting"].value
        s = entry["s"]
        for j in range(seg.shape[-1]):
            s = lift.advance(s, seg[:, j])
        entry["s"] = s
        ok = lift.is_final(s) if last else lift.num_emitted(s) >= ends[t]
        msg["fn"] = SegmentCheck(ok.float().log())  # 0 / -inf
        msg["value"] = seg
        msg["infer"]["_pt_lifted"] = True

    def outputs(self, state: dict) -> dict:
        """``{latent: [n, L]}``: the whole latent sequences, padded to the event length of the latent site."""
        for v in state.values():
            if isinstance(v, LMState) and getattr(v, "_pt_lift", None) == self.key:
                z = torch.full((v.n, v.max_len), PAD_ID, dtype=torch.long, device=v.device)
                z[:, : v.tokens.shape[1]] = v.tokens[:, : v.max_len]
                return {self.latent: z}
        return {}

    def __repr__(self) -> str:
        return f"ProjectionLift({self.projection!r})"


# ---------------------------------------------------------------------------------------------- exact answers
@checked
def enumerate_log_joint(model: Callable[..., Any], x: ArrayLike, latent: str = "z",
                        limit: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
    """(support ``[K, L]``, log p(z, x) ``[K]``) over every z in the lifting of x, for any model with a
    projection (``model.projection``, e.g. one transformed by :class:`ProjectionLift`): the model's whole
    view run ONCE with the latent site conditioned on all K liftings under a particle plate (2.22)."""
    import pyro.poutine as poutine


    proj = getattr(model, "projection", None)
    if proj is None:
        raise TransformError("exact answers need a model with a projection (apply ProjectionLift)")
    xa = as_id_array(x, proj.vocab, "observation x", unpad=True)
    lifting = proj.enumerate_lifting(xa, limit=limit)
    K = len(lifting)
    L = max((len(z) for z in lifting), default=0)
    support = torch.full((K, L), PAD_ID, dtype=torch.long)
    for i, z in enumerate(lifting):
        support[i, : len(z)] = torch.as_tensor(z, dtype=torch.long)
    if K == 0:
        return support, torch.zeros(0)
    xt = torch.as_tensor(xa, dtype=torch.long)
    with torch.no_grad(), poutine.block():
        def run():
            with pyro.plate("particles", K, dim=-1):
                return model(xt)
        tr = poutine.trace(poutine.condition(run, data={latent: support})).get_trace()
        tr.compute_log_prob()
        total = torch.zeros(K)
        for site in tr.nodes.values():
            if site["type"] == "sample":
                lp = torch.as_tensor(site["log_prob"])  # [K] inside the plate (one row per lifting)
                total = total + (lp if lp.ndim else lp.expand(K))
        return support, total


@checked
def exact_log_prob(model: Callable[..., Any], x: ArrayLike, latent: str = "z", limit: int = 20_000) -> torch.Tensor:
    """log p(x) = log sum_{z in lifting(x)} p(z, x) by enumeration (2.22) for a transformed model; ``-inf``
    outside the image of the projection."""

    try:
        _, lp = enumerate_log_joint(model, x, latent, limit)
    except NotInImageError:
        return torch.tensor(float("-inf"))
    return torch.logsumexp(lp, 0) if len(lp) else torch.tensor(float("-inf"))
