"""The slow-thinking model Proj # P_f as a Pyro program (Sections 2.6.3, 3.7).

``SlowThinking(prior, projection)`` is the model of the projection view (docs/architecture.md):
the latent site ``z ~ LMSequence(prior, constraint=projection.domain(|x|))`` draws a latent
prefix from the masked prior P_f (Def 2.8) until it determines |x| observable tokens, and the
observed site ``x ~ Proj(z)`` is a delta. Its marginal likelihood is (2.22) and its posterior
over z is Q_* of (2.24); both are available exactly by enumeration for small models.

It is also a :class:`~ppl_thought.program.Program` (SMC's view): step t samples the segment
z^(t) of Lemma 2.1 at site ``f"z_{t}"`` (P_f masked to the domain, Def 2.8, until x_{t+1} is
determined) and checks that it emits x_t (observed site ``f"x_{t}"``: 0 or -inf). The product of the
step laws is the law of ``"z"``, so both views have the same joint.

Both views are :class:`~ppl_thought.transforms.ProjectionLift` applied to the plain LM program
:class:`~ppl_thought.models.PlainLM`: ``SlowThinking(prior, proj)`` is ``ProjectionLift(proj)(PlainLM(prior,
vocab))`` with the exact answers below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyro.distributions as pdist
import torch

from ppl_thought import checks
from ppl_thought.distributions.lm_sequence import LMSequence
from ppl_thought.distributions.lm_state import LMState, TokenRule, left_pack
from ppl_thought.distributions.projected import ProjectionDelta
from ppl_thought.errors import (
    ArgumentTypeError,
    ConfigError,
    MalformedSequenceError,
    NotDisentangledError,
    NotInImageError,
    SiteMismatchError,
    TooLargeToEnumerateError,
)
from ppl_thought.lm.base import lm_device
from ppl_thought.models.plain import PlainLM
from ppl_thought.program import Program, observe, particles
from ppl_thought.program import sample as pt_sample
from ppl_thought.projections.base import Projection, as_id_array
from ppl_thought.projections.substitution import emission_substitution
from ppl_thought.transforms.base import Transformed
from ppl_thought.transforms.projection_lift import ProjectionLift
from ppl_thought.validation import ArrayLike, SupportsSampleWithLogProb, checked, per_token
from ppl_thought.vocab import PAD_ID


@checked
def pad_sequences(seqs: Sequence[ArrayLike], length: int | None = None, pad_id: int = PAD_ID,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """A list of 1-D id sequences -> a right-padded LongTensor ``[len(seqs), length]`` (built on the host,
    then moved to ``device`` in one copy). Text, floats, a ``length`` shorter than a sequence or a device torch
    does not know: a :class:`~ppl_thought.errors.PPLThoughtError` naming the argument."""
    if isinstance(seqs, str | bytes):
        raise MalformedSequenceError(f"seqs must be a list of token-id sequences, got {type(seqs).__name__} "
                                     f"{seqs!r}"[:300] + ": encode text first (vocab.encode)")
    for i, s in enumerate(seqs):
        checks.token_ids(f"seqs[{i}]", s)
        if getattr(s, "ndim", 1) != 1:
            raise MalformedSequenceError(f"seqs[{i}] must be a 1-D sequence of token ids, got shape "
                                         f"{tuple(s.shape)}")
    length = checks.optional_integer("length", length, 0)
    pad_id = checks.integer("pad_id", pad_id, 0)
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ConfigError(f"device must be a torch device ('cpu', 'cuda', 'cuda:0', ...), got {device!r} "
                              f"({e})"[:300]) from None
    L = max((len(s) for s in seqs), default=0) if length is None else length
    longest = max((len(s) for s in seqs), default=0)
    if longest > L:
        raise ConfigError(f"length={L} is shorter than the longest sequence ({longest} ids)")
    out = torch.full((len(seqs), L), pad_id, dtype=torch.long, device="cpu")
    for i, s in enumerate(seqs):
        if len(s):
            out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long, device="cpu")
    return out if device is None else out.to(device)


@checked
@dataclass
class EnumeratedPosterior:
    """The exact posterior Q_*(z | x) of (2.24) over the enumerated lifting of x.

    ``support`` is ``[K, L]`` right-padded latent sequences; ``log_probs`` ``[K]`` are log Q_*(z | x)
    (they log-sum-exp to 0); ``log_marginal`` is log (Proj # P)^{<=|x|}(x) of (2.22).
    """

    support: torch.Tensor
    log_probs: torch.Tensor
    log_marginal: torch.Tensor
    log_joint: torch.Tensor

    @property
    def probs(self) -> torch.Tensor:
        return self.log_probs.exp()

    @per_token
    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        idx = torch.multinomial(self.probs, n, replacement=True, generator=generator)
        return self.support[idx]

    def as_dict(self) -> dict[tuple[int, ...], float]:
        return {tuple(int(t) for t in row if t != PAD_ID): float(p) for row, p in zip(self.support, self.probs)}


@checked
class SlowThinking(Transformed):
    """The Pyro model of Proj # P_f with latent site ``"z"`` and observed site ``"x"``.

    Args:
        prior: the latent LM P_f (a :mod:`ppl_thought.lm` module over the projection's vocabulary).
        projection: a :class:`~ppl_thought.projections.Projection`.
        chunk: chunked encoding for sparse thoughts (end of Section 5.6.2; ``0``: token by token): runs of up to
            ``chunk`` forced tokens are encoded in one pass, and SMC steps begin only where a thought may start
            (:class:`~ppl_thought.transforms.ProjectionLift`). Same law; pair it with a guide built with the
            same ``chunk``.

    Call it as a Pyro model: ``model(x)`` with x a string, token list or 1-D LongTensor
    (observed), or ``model(None, length=n)`` to generate. Under a particle plate the z site
    carries the batch.

    It is ``ProjectionLift(projection)(PlainLM(prior, vocab))``: the plain LM program under the lifting
    transform (:mod:`ppl_thought.transforms`), the one home of the lifting, with the exact answers
    (enumeration) added here.
    """

    def __init__(self, prior: torch.nn.Module, projection: Projection, chunk: int = 0):
        checks.lm("SlowThinking: prior", prior)
        checks.has_attributes("SlowThinking: projection", projection, ("vocab", "lifting", "domain"),
                              "a pt.projections projection (PauseToThink, QueryResponse, SparseThoughts, ...)")
        if int(prior.vocab_size) != len(projection.vocab):
            raise ConfigError(
                f"prior vocab_size {prior.vocab_size} != projection vocabulary size {len(projection.vocab)}"
            )
        plain = PlainLM(prior, projection.vocab, module_name="prior", state_key="z")
        super().__init__(plain, ProjectionLift(projection, chunk=chunk))
        self.prior = prior
        self.projection = projection
        self.vocab = projection.vocab

    # ------------------------------------------------------------------ the program
    def x_ids(self, x: ArrayLike) -> torch.Tensor:
        """x as a 1-D LongTensor of ids on the prior's device (accepts text, token strings, ids)."""
        return torch.as_tensor(as_id_array(x, self.vocab, "observation x", unpad=True), dtype=torch.long,
                               device=self.device)

    @property
    def device(self) -> torch.device:
        """The prior's device: where the program's tensors are made."""
        return lm_device(self.prior)

    def z_dist(self, num_observed: int) -> LMSequence:
        """P_f masked to Dom(Proj) (Def 2.8), stopped once ``num_observed`` tokens are determined."""
        return self.transform.latent_dist(self.inner.x_dist(num_observed), num_observed)

    model = Transformed.__call__

    # ------------------------------------------------------------------ decoding (docs/programs.md, protocol methods)
    def continuation(self, max_new_tokens: int = 8, stop_at_eos: bool = True) -> Continuation:
        """The program that ``pt.infer.decode`` runs for Proj # P_f: the prompt x observed, then up to
        ``max_new_tokens`` new observables as output sites (:class:`Continuation`)."""
        return Continuation(self, max_new_tokens, stop_at_eos)

    # ------------------------------------------------------------------ the sampler fast path
    def sampler_weights(self, sampler: SupportsSampleWithLogProb, x: ArrayLike,
                        n: int) -> tuple[dict, torch.Tensor, dict]:
        """Importance's fast path (the protocol of :class:`~ppl_thought.inference.Importance`, docs/architecture.md,
        "Engines"): n particles of (3.2) from a sampler guide (``sample_with_log_prob(x, n)``, Def 3.1) without
        tracing: z and log Q(z | x) in one decoding loop, log P^{<=|z|}(z) by one teacher-forced pass, and the
        observation's delta log 1{Proj(z) = x}.

        Returns ``(samples {"z": [n, L]}, log weights [n], extra)`` with ``extra`` the ``log_p``, ``log_q`` and
        ``log_likelihood`` ``[n]`` the traced path reports; log w = log p - log q, -inf (never NaN) where p = 0.
        Raises :class:`~ppl_thought.errors.NotInImageError` for x outside the image of Proj.
        """

        xt = self.x_ids(x)
        self.projection.lifting(xt)  # NotInImageError for x outside the image
        dist = self.z_dist(len(xt))
        with torch.no_grad():
            z, log_q = sampler.sample_with_log_prob(xt, n)
            z = _pad_to(z, dist.max_len)
            log_p = dist.log_prob(z)
            log_lik = ProjectionDelta(self.projection, z, len(xt)).log_prob(xt)
            log_p = log_p + log_lik
        log_w = torch.where(torch.isneginf(log_p), torch.full_like(log_p, float("-inf")), log_p - log_q)
        return {"z": z}, log_w, {"log_p": log_p, "log_q": log_q, "log_likelihood": log_lik.expand(n)}

    def conditional_weights(self, sampler: SupportsSampleWithLogProb, x: ArrayLike, y: ArrayLike, n: int,
                            shared: bool = True) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """The weights of (3.7) for ``Importance.conditional_log_prob`` (the protocol method of docs/programs.md):
        ``(samples {"z": [n, L]}, log w of p_n(xy) [n], log w of q_n(x) [n])``, -inf (never NaN) where p = 0.

        ``shared=False``: W_i ~ Q(. | xy) and independent Z_i ~ Q(. | x) (:meth:`sampler_weights` on each, the
        plain (3.7)). ``shared=True`` (Remark 3.5): Z_i = the prefix of W_i in the lifting of x (Lemma 2.1), with
        log Q(Z_i | x) the sum of the sampler's token log-probabilities over Z_i (``sampler.token_log_probs(z,
        x)`` or ``sampler.dist(x)``). Raises :class:`~ppl_thought.errors.NotInImageError` for xy outside the image.
        """
        xt, yt = self.x_ids(x), self.x_ids(y)
        xy = torch.cat([xt, yt])
        self.projection.lifting(xy)  # NotInImageError for xy outside the image
        if not shared:
            samples, log_w_xy, _ = self.sampler_weights(sampler, xy, n)
            _, log_w_x, _ = self.sampler_weights(sampler, xt, n)
            return samples, log_w_xy, log_w_x
        dist_xy = self.z_dist(len(xy))
        with torch.no_grad():
            w, lq_w = sampler.sample_with_log_prob(xy, n)
            w = _pad_to(w, dist_xy.max_len)
            p_steps, complete = dist_xy.step_log_probs(w)
            lp_w = torch.where(complete, p_steps.sum(-1), torch.full((n,), float("-inf"), device=p_steps.device))
            log_w_xy = torch.where(torch.isneginf(lp_w), lp_w, lp_w - lq_w)
            k = lifted_prefix_length(self.projection.lifting(xt), w)
            q_steps = _sampler_step_log_probs(sampler, w, xy)
            inside = torch.arange(w.shape[-1], device=w.device)[None] < k[:, None]
            lp_z = torch.where(inside, p_steps, torch.zeros_like(p_steps)).sum(-1)
            lq_z = torch.where(inside, q_steps, torch.zeros_like(q_steps)).sum(-1)
            log_w_x = torch.where(torch.isneginf(lp_z), lp_z, lp_z - lq_z)
        return {"z": w}, log_w_xy, log_w_x

    # ------------------------------------------------------------------ exact answers
    def enumerate_log_joint(self, x: ArrayLike, limit: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
        """(support ``[K, L]``, log P^{<=|z|}(z) ``[K]``) for every z in the lifting of x."""
        xt = self.x_ids(x)
        try:
            lifting = self.projection.enumerate_lifting(xt.cpu().numpy(), limit=limit)
        except TooLargeToEnumerateError as e:
            raise TooLargeToEnumerateError(
                f"exact computation for |x| = {len(xt)} needs the whole lifting: {e}. Use an engine "
                "(pt.infer.Importance / SMC) for long observations"
            ) from None
        dist = self.z_dist(len(xt))
        support = pad_sequences(lifting, dist.max_len, device=self.device)
        with torch.no_grad():
            lp = torch.cat([dist.log_prob(chunk) for chunk in support.split(4096)]) if len(support) else \
                torch.zeros(0, device=self.device)
        return support, lp

    def exact_log_prob(self, x: ArrayLike, limit: int = 20_000) -> torch.Tensor:
        """log (Proj # P)^{<=|x|}(x) = log sum_{z in lifting(x)} P^{<=|z|}(z), equation (2.22).

        ``-inf`` for x outside the image of Proj. Raises TooLargeToEnumerateError when the
        lifting has more than ``limit`` sequences.
        """
        try:
            _, lp = self.enumerate_log_joint(x, limit)
        except NotInImageError:
            return torch.tensor(float("-inf"), device=self.device)
        return torch.logsumexp(lp, 0) if len(lp) else torch.tensor(float("-inf"), device=self.device)

    def exact_posterior(self, x: ArrayLike, limit: int = 20_000) -> EnumeratedPosterior:
        """Q_*(z | x) = P^{<=|z|}(z) / (Proj # P)^{<=|x|}(x) on the lifting of x, equation (2.24)."""
        support, lp = self.enumerate_log_joint(x, limit)
        logz = torch.logsumexp(lp, 0) if len(lp) else torch.tensor(float("-inf"), device=self.device)
        if not torch.isfinite(logz):
            raise NotInImageError(
                f"x = {self.vocab.decode(self.x_ids(x))!r} has probability 0 under Proj # P: no posterior"
            )
        return EnumeratedPosterior(support, lp - logz, logz, lp)

    def exact_log_probs_all(self, n: int, limit: int = 20_000) -> dict[tuple[int, ...], float]:
        """log (Proj # P)(x) for every x in Sigma^n (a check that (2.22) sums to 1)."""
        sigma = self.projection.observable_ids
        if len(sigma) ** n > limit:
            raise TooLargeToEnumerateError(f"|Sigma|^n = {len(sigma) ** n} over limit {limit}")
        out = {}
        for xs in np.array(np.meshgrid(*[sigma] * n, indexing="ij")).reshape(n, -1).T if n else [np.zeros(0, int)]:
            out[tuple(int(v) for v in xs)] = float(self.exact_log_prob(xs.astype(np.int64)))
        return out

    def __repr__(self) -> str:
        return f"SlowThinking(prior={type(self.prior).__name__}, projection={self.projection!r})"


def _pad_to(z: torch.Tensor, length: int) -> torch.Tensor:
    """``z [..., S]`` right-padded (or cut, if only ``<pad>`` is cut) to the model's event length."""
    if z.shape[-1] == length:
        return z
    if z.shape[-1] > length:
        if (z[..., length:] != PAD_ID).any():
            raise SiteMismatchError(f"sampled z of length {z.shape[-1]} exceeds the model's z length {length}")
        return z[..., :length]
    pad = torch.full(z.shape[:-1] + (length - z.shape[-1],), PAD_ID, dtype=z.dtype, device=z.device)
    return torch.cat([z, pad], -1)


# ---------------------------------------------------------------------------------------------- decoding's view
def start_lifted(model: SlowThinking, z0: torch.Tensor, num_observed: int | torch.Tensor,
                 total: int) -> tuple[LMState, torch.Tensor]:
    """An LMState of ``z0.shape[0]`` rows under Dom(Proj) stopped at ``total`` observables (Def 2.8), with the
    prompt liftings ``z0 [n, L0]`` (right-padded) teacher-forced as one segment ``until_emitted=num_observed``.

    Returns the state (ready to continue P(. | [Z0]), (3.12)) and log P^{<=|z0|}(z0) ``[n]``: the numerator of the
    weights (3.2) / (3.14), -inf where z0 breaks the domain or does not end where the segment must.
    """
    z0 = torch.as_tensor(z0, dtype=torch.long, device=model.device)
    state = start_lifted_state(model, z0.shape[0], total)
    until = num_observed.to(state.device) if isinstance(num_observed, torch.Tensor) else int(num_observed)
    log_p = state.segment(until_emitted=until).log_prob(z0)
    state.extend(z0)
    return state, log_p


class Continuation(Program):
    """``decode``'s program for Proj # P_f (docs/inference.md, "decode"): ``continuation(x)`` observes the prompt
    and generates up to ``max_new_tokens`` observables after it, one per step.

    * ``init``: site ``"z"``, the prompt's lifting Z0 ~ P_f masked to Dom(Proj) until |x| observables are
      determined (one segment of an LMState under ``domain(|x| + max_new_tokens)``, Def 2.8; a guide such as
      ``pt.guides.Causal`` proposes it, its log-probability is P^{<=|Z0|}(Z0) of the weights (3.14) / Algorithm 2),
      and the observed site ``"x"``: log 1{Proj(Z0) = x} (Prop 2.3).
    * step t: site ``f"s_{t + 1}"``, the next segment S ~ P(. | Z^(t) -> next segment) (Def 2.5: until one more
      observable is determined, (3.13)), and the output ``f"y_{t + 1}"``, the observable it determines (a delta).
      A row finishes after ``max_new_tokens`` outputs, or (``stop_at_eos``) after the output ``<eos>``.

    It offers ``next_output_law`` (Algorithm 1 of App. G, exact by enumeration: ``decode(..., method="exact")``)
    and ``output_values`` (the observables, in ``projection.observable_ids`` order), the protocol methods of
    docs/programs.md.
    """

    def __init__(self, model: SlowThinking, max_new_tokens: int = 8, stop_at_eos: bool = True):
        self.model = model
        self.max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 0)
        self.stop_at_eos = bool(stop_at_eos)
        self.max_steps = self.max_new_tokens + 1
        self._alg1: dict[tuple[int, ...], dict[tuple[int, ...], float]] = {}  # Algorithm 1's line-8 cache

    @property
    def device(self) -> torch.device:
        return self.model.device

    def init(self, state: dict, x: ArrayLike) -> None:
        m, n = self.model, particles()
        xt = m.x_ids(x)
        N = len(xt)
        m.projection.lifting(xt)  # NotInImageError for a prompt outside the image
        lm = start_lifted_state(m, n, N + self.max_new_tokens)
        z = pt_sample("z", lm.segment(until_emitted=N))
        if z.ndim == 1:  # a guide traced outside the particle plate (the engines' look-ahead for plates): one row
            z = z[None]
        lm.extend(z)
        observe("x", ProjectionDelta(m.projection, z, N), xt.expand(n, N))
        state["lm"], state["stopped"] = lm, torch.zeros(n, dtype=torch.bool, device=lm.device)

    def step(self, state: dict, t: int, x: ArrayLike):
        m, lm, stopped = self.model, state["lm"], state["stopped"]
        N = int(self.model.x_ids(x).shape[0])
        if self.max_new_tokens == 0:
            return torch.ones_like(stopped)
        j = N + t + 1
        target = torch.where(stopped, torch.full_like(stopped, -1, dtype=torch.long),
                             torch.full_like(stopped, j, dtype=torch.long))
        seg = pt_sample(f"s_{t + 1}", lm.segment(until_emitted=target))
        lm.extend(seg)
        y = next_observable(m, lm, seg, j)
        V = int(m.prior.vocab_size)
        delta = torch.full((lm.n, V), -math.inf, device=lm.device).scatter_(1, y[:, None], 0.0)
        y = observe(f"y_{t + 1}", pdist.Categorical(logits=delta), None)
        if self.stop_at_eos:
            state["stopped"] = stopped = stopped | (y == m.vocab.eos_id)
        return stopped | torch.tensor(t + 1 >= self.max_new_tokens, device=stopped.device)

    def grown_prompt_guide(self, guide, decoded: list, x: ArrayLike):
        """Protocol method (Algorithm 2 of App. G, docs/programs.md): a guide for this program conditioned on the
        ``decoded`` outputs y_1 .. y_t that proposes Z^(t) ~ Q(. | X^(t)) from the grown prompt X^(t) = x y_1 .. y_t,
        instead of Z0 ~ Q(. | x) followed by the prior's segments (which match the decoded outputs only by chance,
        so that most particles get weight 0). One draw of ``guide.sample_with_log_prob(X^(t), n)`` (the lifting of
        X^(t), Prop 2.3) is split at the points where |x|, |x| + 1, ... observables are determined (Def 2.5, the
        domain automaton's counts, one pass over the positions for all rows) into the sites ``"z"`` and ``"s_1"`` ..
        ``"s_t"``; ``"z"`` carries log Q(Z^(t) | X^(t)), the segments are deltas, so that log p - log q is the weight
        P(Z^(t)) 1{Proj(Z^(t)) = X^(t)} / Q(Z^(t) | X^(t)) of Algorithm 2. ``None`` (the engine's plain guide) when
        nothing was decoded or the guide has no ``sample_with_log_prob``."""
        draw = getattr(guide, "sample_with_log_prob", None)
        if not decoded or not callable(draw):
            return None
        m = self.model
        xt = m.x_ids(x)
        X = torch.cat([xt, torch.as_tensor([int(v) for v in decoded], dtype=torch.long, device=xt.device)])
        N, t = int(xt.shape[0]), len(decoded)
        dom = m.projection.domain(N + self.max_new_tokens)

        def grown(*args, **kwargs):
            n = particles()
            Z, lq = draw(X, n)
            Z = torch.as_tensor(Z, device=self.device).long()
            for name, value in zip(["z"] + [f"s_{k}" for k in range(1, t + 1)], split_segments(dom, Z, N, t)):
                pt_sample(name, pdist.Delta(value, log_density=lq.to(value.device) if name == "z" else 0.0,
                                            event_dim=1))

        return grown

    def output_values(self, x: ArrayLike) -> torch.Tensor:
        """Protocol method: the values an output site takes, Sigma in ``projection.observable_ids`` order."""
        return torch.as_tensor(self.model.projection.observable_ids, dtype=torch.long, device=self.model.device)

    def next_output_law(self, decoded: list, x: ArrayLike) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """Protocol method, Algorithm 1 of App. G (lines 4-6, with the cache of line 8): the exact law of the next
        output given the ``decoded`` ones, ``(site, values [|Sigma|], probs [|Sigma|])``; ``None`` once the
        program has finished (``max_new_tokens`` outputs, or ``<eos>`` with ``stop_at_eos``)."""
        dec = [int(v) for v in decoded]
        if len(dec) >= self.max_new_tokens or (self.stop_at_eos and dec and dec[-1] == self.model.vocab.eos_id):
            return None
        xt = self.model.x_ids(x)
        X = torch.cat([xt, torch.tensor(dec, dtype=torch.long, device=xt.device)])
        key = tuple(int(a) for a in X)
        cache = self._alg1.pop(key, None)
        if cache is None:
            cache = algorithm1_cache(self.model, X)
        p, terms = algorithm1_step(self.model, X, cache)
        if len(self._alg1) > 4096:
            self._alg1.clear()
        for a, t in terms.items():
            self._alg1[key + (a,)] = t  # line 8: the cache of each possible next prompt X a
        return f"y_{len(dec) + 1}", self.output_values(x), p


def start_lifted_state(model: SlowThinking, n: int, total: int) -> LMState:
    """An empty LMState of n rows under Dom(Proj) stopped at ``total`` observables (Def 2.8)."""
    dom = model.projection.domain(int(total))
    return LMState.start(model.prior, n, rule=TokenRule(dom, model.prior.vocab_size),
                         max_len=dom.max_len if dom.max_len is not None else 1 << 30)


def split_segments(dom, Z: torch.Tensor, N: int, t: int) -> list[torch.Tensor]:
    """Right-padded rows ``Z [n, L]`` of Dom(Proj) cut where N, N + 1, ..., N + t - 1 observables are determined
    (Def 2.5: a segment ends at the token that determines one more observable; counts of the automaton ``dom``):
    the prefix until N observables, then t segments of one more observable each (``[n, L_k]`` right-padded, at least
    one column). Tokens after the (N + t)-th observable join the last segment. Vectorised over rows (one pass over
    the positions)."""
    n, L = Z.shape
    step, emitted = dom.device_table("advance", Z), dom.device_table("emitted", Z)
    s = dom.start_states(n, Z.device)
    before = torch.empty_like(Z)
    for i in range(L):  # observables determined before each token
        before[:, i] = emitted[s]
        s = step[s, Z[:, i]]
    which = (before - N + 1).clamp_(0, t)  # 0: the prefix; k: segment k
    out = []
    for k in range(t + 1):
        part = left_pack(torch.where(which == k, Z, PAD_ID))
        width = max(int((part != PAD_ID).sum(-1).max()) if n else 0, 1)
        out.append(part[:, :width])
    return out


def next_observable(model: SlowThinking, lm: LMState, seg: torch.Tensor, j: int) -> torch.Tensor:
    """``[n]``: observable j - 1 (0-based) of Proj(z) per row after the segment ``seg`` that ends where j
    observables are determined (Def 2.5), ``<pad>`` where a row has fewer: one batched lookup. For a disentangled
    projection (Def 3.5) the token that ends the segment emits the observable (:func:`emitting_observables`); rows
    whose state has j observables but whose segment does not end in an emitting token (not the case for the
    projections of the library) and projections that are not disentangled take the host projection
    (:func:`observable_at`)."""
    table = emitting_observables(model.projection, lm.device)
    if table is None:
        return observable_at(model, lm.tokens, j - 1)
    seg = seg if seg.ndim == 2 else seg[:, None]
    width = (seg != PAD_ID).sum(-1)
    last = seg.gather(1, (width - 1).clamp(min=0)[:, None]).squeeze(1)
    y = table[last]
    has = lm.rule.num_emitted(lm.s) >= j
    fits = (width > 0) & (y >= 0)
    if bool((has & ~fits).any()):  # one host sync per output
        return observable_at(model, lm.tokens, j - 1)
    return torch.where(has, y, PAD_ID)


_EMITTING: dict = {}


def emitting_observables(projection: Projection, device) -> torch.Tensor | None:
    """``[V]`` long: the observable an emitting token determines (-1 for the others), from the emission map of (3.29)
    (:func:`~ppl_thought.projections.substitution.emission_substitution`: ``sub[v, a] = v`` where v emits a), cached
    per projection and device; None for a projection that is not disentangled (Def 3.5)."""
    key = (id(projection), str(device))
    hit = _EMITTING.get(key)
    if hit is not None and hit[0] is projection:
        return hit[1]
    if not getattr(projection, "is_disentangled", False):
        return None
    try:
        sub = emission_substitution(projection)
    except NotDisentangledError:
        return None
    V = sub.shape[0]
    own = sub == np.arange(V)[:, None]
    table = torch.as_tensor(np.where(own.any(1), own.argmax(1), -1), dtype=torch.long, device=device)
    if len(_EMITTING) > 64:
        _EMITTING.clear()
    _EMITTING[key] = (projection, table)
    return table


def observable_at(model: SlowThinking, z: torch.Tensor, i: int) -> torch.Tensor:
    """``[n]``: observable i of Proj(z) per row (Def 2.6, the projection's batched host projection), ``<pad>``
    where a row has fewer."""
    xs = model.projection.project(z.cpu())
    return torch.tensor([int(r[i]) if len(r) > i else PAD_ID for r in xs], dtype=torch.long, device=z.device)


def algorithm1_cache(model: SlowThinking, xt: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Line 2 of Algorithm 1: {P^{<=|z|}(z) : z in Proj^{-1}_{<w}(x)} (log values, P(z) > 0 only)."""
    support, lp = model.enumerate_log_joint(xt)
    return {tuple(int(t) for t in row if t != PAD_ID): float(v) for row, v in zip(support, lp) if v > -math.inf}


def algorithm1_step(model: SlowThinking, xt: torch.Tensor,
                    cache: dict) -> tuple[torch.Tensor, dict[int, dict[tuple[int, ...], float]]]:
    """Lines 4-6 of Algorithm 1: p(a | X) = sum_z Q_*(z | X) P(Phi_X(z, a) | z), and the terms of line 8.

    Phi_X(z, a) is enumerated from the lifting of Xa; every P^{<=|zs|}(s | z) of line 4 is the log-probability
    of the segment s of the LMState started at z (one teacher-forced pass for all (z, s)).
    """
    proj = model.projection
    sigma = [int(a) for a in proj.observable_ids]
    keys = list(cache)
    index = {key: i for i, key in enumerate(keys)}
    lpz = torch.tensor([cache[key] for key in keys], dtype=torch.float64, device="cpu")  # host: enumeration
    post = torch.softmax(lpz, 0)  # line 5
    zi, segs, ai, zss = [], [], [], []
    for j, a in enumerate(sigma):
        try:
            lift = proj.lifting(torch.cat([xt.cpu(), torch.tensor([a], device="cpu")]))
        except NotInImageError:
            continue
        for zs in lift.enumerate():
            # the lifting of X is prefix-free: exactly one prefix of zs is in it (Lemma 2.1)
            cut = next((c for c in range(len(zs), -1, -1) if zs[:c] in index), None)
            if cut is None:
                continue
            zi.append(index[zs[:cut]])
            segs.append(zs[cut:])
            ai.append(j)
            zss.append(zs)
    p = torch.zeros(len(sigma), dtype=torch.float64, device="cpu")
    new_terms: dict[int, dict[tuple[int, ...], float]] = {a: {} for a in sigma}
    if zi:
        N = len(xt)
        with torch.no_grad():
            state, _ = start_lifted(model, pad_sequences(keys, device=model.device), N, N + 1)
            state.reorder(torch.tensor(zi, device=state.device))
            lp_s = state.segment(until_emitted=N + 1).log_prob(pad_sequences(segs, device=state.device))  # line 4
        lp_s = lp_s.double().cpu()
        zi_t, ai_t = torch.tensor(zi, device="cpu"), torch.tensor(ai, device="cpu")
        ok = ~torch.isneginf(lp_s)
        p.index_add_(0, ai_t[ok], post[zi_t[ok]] * lp_s[ok].exp())  # line 6
        lp_zs = lpz[zi_t] + lp_s  # line 8: P(zs) = P(z) P(s | z)
        for zs, j, v, good in zip(zss, ai, lp_zs.tolist(), ok.tolist()):
            if good:
                new_terms[sigma[j]][zs] = v
    return (p / p.sum()).float().to(model.device), new_terms


def lifted_prefix_length(lifting, w: torch.Tensor) -> torch.Tensor:
    """Length ``[n]`` of the shortest prefix of each row of ``w [n, L]`` that the automaton accepts (its first
    final state): the z of a sample of Q(. | xy) restricted to x (Remark 3.5). Raises
    :class:`SiteMismatchError` if a row has none."""
    table = lifting.device_table("table", w.device)
    n, L = w.shape
    s = lifting.start_states(n, w.device)
    k = torch.where(lifting.is_final(s), torch.zeros(n, dtype=torch.long, device=w.device),
                    torch.full((n,), -1, device=w.device))
    for i in range(L):
        s = table[s, w[:, i]]
        k = torch.where((k < 0) & lifting.is_final(s), torch.full_like(k, i + 1), k)
    if (k < 0).any():
        raise SiteMismatchError("a sample of Q(. | xy) has no prefix in the lifting of x: the sampler is not "
                         "supported on the lifting of xy")
    return k


def _sampler_step_log_probs(sampler, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """log Q(z_i | z_<i, x) ``[n, L]`` (every library guide has ``token_log_probs``)."""
    if hasattr(sampler, "token_log_probs"):
        return sampler.token_log_probs(z, x)
    for name in ("dist", "seq"):
        if callable(getattr(sampler, name, None)):
            dist = getattr(sampler, name)(x)
            return dist.step_log_probs(_pad_to(z, dist.max_len))[0][..., : z.shape[-1]]
    raise ArgumentTypeError("the shared-sample estimator of Remark 3.5 needs the sampler's token probabilities: give "
                            "it token_log_probs(z, x) -> [n, L] or dist(x) -> LMSequence; or use shared=False")
