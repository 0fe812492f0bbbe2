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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ppl_thought import checks
from ppl_thought.distributions.lm_sequence import LMSequence
from ppl_thought.distributions.projected import ProjectionDelta
from ppl_thought.errors import (
    ConfigError,
    MalformedSequenceError,
    NotInImageError,
    SiteMismatchError,
    TooLargeToEnumerateError,
)
from ppl_thought.lm.base import lm_device
from ppl_thought.models.plain import PlainLM
from ppl_thought.projections.base import Projection, as_id_array
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
