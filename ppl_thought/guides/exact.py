"""Exact samplers by enumeration of the lifting: the posterior Q_* (2.24) and the inquisitive
sampler Q_bullet (3.22), with the translation-invariant variant of Remark 3.7.

Both are tables over the enumerated lifting of x (small models only); sampling is one
``torch.multinomial`` call for all particles and scoring one row comparison against the table.
"""

from __future__ import annotations

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought import checks
from ppl_thought.errors import ConfigError, NotInImageError, ProgramError
from ppl_thought.guides.base import Sampler, num_observed
from ppl_thought.models.slow_thinking import SlowThinking
from ppl_thought.validation import ArrayLike, checked
from ppl_thought.vocab import PAD_ID


class _TableSampler(Sampler):
    """A sampler given by log-probabilities over the enumerated lifting of x (cached per x)."""

    def __init__(self, model: SlowThinking, limit: int = 20_000):
        # checked here, not only by the type layer: Posterior inherits this constructor, and the layer checks the
        # constructors a public class defines itself
        checks.instance("model", model, SlowThinking, "a pt.models.SlowThinking (its lifting is enumerated)")
        limit = checks.integer("limit", limit)
        self.model = model
        self.projection = model.projection
        self.limit = limit
        self._cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """(support ``[K, L]``, log Q(z | x) ``[K]``) over the lifting of x."""
        xt = self.x_ids(x)
        key = tuple(xt.tolist())
        if key not in self._cache:
            self._cache[key] = self._compute(xt)
        return self._cache[key]

    def clear(self) -> None:
        """Forget cached tables (call after the prior's parameters change)."""
        self._cache.clear()

    def _compute(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def step_state(self, x: torch.Tensor, n: int) -> TableState:
        """The table decoded segment by segment (SMC): Q(z^(t) | z^(<t), x) as ratios of table sums."""
        support, lq = self.table(x)
        return TableState(support, lq, self.lifting(x), n)

    def _sample(self, x, n):
        support, lq = self.table(x)
        idx = torch.multinomial(lq.exp(), n, replacement=True) if n else torch.zeros(0, dtype=torch.long,
                                                                                     device=lq.device)
        return support[idx], lq[idx]

    def _token_log_probs(self, z, x):
        """log Q(z_i | z_<i, x) as ratios of the table's prefix masses."""
        support, lq = self.table(x)
        agree = torch.cumprod((z[:, None, :] == support[None]).long(), -1).bool()  # [n, K, L]: prefix <= i agrees
        mass = torch.logsumexp(lq[None, :, None].masked_fill(~agree, float("-inf")), 1)  # [n, L]
        prev = torch.cat([torch.zeros(z.shape[0], 1, device=mass.device, dtype=mass.dtype), mass[:, :-1]], 1)
        step = torch.where(torch.isneginf(prev), torch.full_like(mass, float("-inf")), mass - prev)
        return torch.where(z != PAD_ID, step, torch.zeros_like(step))

    def _log_prob(self, z, x):
        support, lq = self.table(x)
        eq = (z[:, None, :] == support[None, :, :]).all(-1)  # [n, K]
        hit = eq.any(-1)
        return torch.where(hit, lq[eq.float().argmax(-1)], torch.full((z.shape[0],), float("-inf"), device=lq.device,
                                                                      dtype=lq.dtype))


@checked
class Posterior(_TableSampler):
    """The posterior sampler Q_*(z | x) = P^{<=|z|}(z) / (Proj # P)^{<=|x|}(x), equation (2.24),
    by enumeration (``model.exact_posterior``). Importance weights P(z)/Q_*(z) equal p(x) for every z.
    """

    def _compute(self, x):
        post = self.model.exact_posterior(x, limit=self.limit)
        return post.support, post.log_probs.detach()


@checked
class Inquisitive(_TableSampler):
    """The inquisitive sampler Q_bullet of (3.22), Def 3.2, exactly for small models:

        Q_bullet(z | x) ∝ P_f^{<=|z|}(z) * || grad_theta log P_f^{<=|z|}(z) ||,   z in lifting(x),

    theta = all trainable parameters of the prior (the norm is the Euclidean norm of the
    concatenated per-sequence gradient, so Q_bullet is parametrisation-dependent, as the text says).

    ``centered=True`` gives the translation-invariant variant of Remark 3.7. The remark writes the
    distance ||grad log P(z) - v_*(x)|| with v_*(x) = -grad log (Proj # P)(x) of (3.21); taken
    literally that is ||g(z) + gbar|| and is *not* translation invariant (g -> g + c moves it by
    2c). We read it as the distance to the mean gradient gbar = E_{Q_*}[g(z)] = grad log p(x),
    i.e. ||g(z) - gbar||, which is what "depend only on the distances ... invariant to a uniform
    translation" requires (the sign of v_* is garbled).

    When every norm vanishes (e.g. a one-element lifting with ``centered=True``), (3.22) is 0/0 and
    Q_* (2.24) is returned instead.

    Per-sequence gradients are taken in one batched vector-Jacobian call
    (``autograd.grad(..., is_grads_batched=True)``), with a loop over the enumerated support as a
    fallback for LMs that vmap cannot trace.
    """

    def __init__(self, model: SlowThinking, centered: bool = False, limit: int = 2_000):
        super().__init__(model, limit)
        self.centered = centered

    def per_sequence_gradients(self, x: ArrayLike) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(support ``[K, L]``, log P(z) ``[K]``, flattened grad_theta log P(z) ``[K, D]``)."""
        xt = self.x_ids(x)
        params = [p for p in self.model.prior.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("Inquisitive: the prior has no trainable parameters; Q_bullet (3.22) needs theta")
        support, _ = self.model.enumerate_log_joint(xt, limit=self.limit)
        dist = self.model.z_dist(len(xt))
        with torch.enable_grad():
            lp = dist.log_prob(support)
            K = lp.shape[0]
            ok = torch.isfinite(lp)
            safe = torch.where(ok, lp, torch.zeros_like(lp))
            try:
                eye = torch.eye(K, device=lp.device, dtype=lp.dtype)
                grads = torch.autograd.grad(safe, params, grad_outputs=eye, is_grads_batched=True,
                                            retain_graph=True, allow_unused=True)
                G = torch.cat([(g if g is not None else p.new_zeros((K,) + p.shape)).reshape(K, -1)
                               for g, p in zip(grads, params)], 1)
            except RuntimeError:
                rows = []
                for k in range(K):
                    gk = torch.autograd.grad(safe[k], params, retain_graph=True, allow_unused=True)
                    rows.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                           for g, p in zip(gk, params)]))
                G = torch.stack(rows)
        G = torch.where(ok[:, None], G, torch.zeros_like(G))
        return support, lp.detach(), G.detach()

    def _compute(self, x):
        support, lp, G = self.per_sequence_gradients(x)
        if not torch.isfinite(lp).any():
            raise NotInImageError("x has probability 0 under the model: no inquisitive sampler")
        if self.centered:
            q = torch.softmax(torch.where(torch.isfinite(lp), lp, torch.full_like(lp, -torch.inf)), 0)
            G = G - (q[:, None] * G).sum(0, keepdim=True)
        norm = G.norm(dim=-1)
        logw = lp + torch.log(norm)  # -inf where P(z) = 0 or the gradient vanishes
        lz = torch.logsumexp(logw, 0)
        if not torch.isfinite(lz):  # every gradient (distance) vanishes: (3.22) is 0/0; use its limit Q_*
            return support, lp - torch.logsumexp(lp, 0)
        return support, logw - lz


class TableState:
    """``n`` rows decoding a table Q over the support ``[K, L]`` segment by segment (Lemma 2.1).

    ``consistent [n, K]`` marks the support rows that agree with a row's prefix, so
    Q(z^(t) | z^(<t), x) = Q(rows agreeing with z^(<=t)) / Q(rows agreeing with z^(<t)).
    ``ends[k, j]`` is where segment j of support row k ends (j = 1 .. T; the last at the row's end).
    """

    def __init__(self, support: torch.Tensor, log_q: torch.Tensor, lift, n: int):
        self.support, self.log_q = support, log_q
        K, L = support.shape
        self.lengths_k = (support != PAD_ID).sum(-1)
        T = num_observed(lift)
        dev = support.device
        s = lift.start_states(K, support)
        emitted = torch.empty(K, L + 1, dtype=torch.long, device=dev)
        emitted[:, 0] = lift.num_emitted(s)
        for i in range(L):
            tok = support[:, i]
            s = torch.where(tok != PAD_ID, lift.step(s, tok), s)
            emitted[:, i + 1] = lift.num_emitted(s)
        ends = torch.stack([(emitted >= j).long().argmax(-1) for j in range(1, T)] + [self.lengths_k], -1) \
            if T > 0 else self.lengths_k[:, None]
        self.ends = ends  # [K, T]
        self.consistent = torch.ones(n, K, dtype=torch.bool, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)

    def segment(self, until_emitted: int | None = None) -> TableSegment:
        j = self.ends.shape[1] if until_emitted is None else int(until_emitted)
        return TableSegment(self, j - 1)

    def extend(self, value: torch.Tensor) -> TableState:
        self.consistent = self._agree(value, self.consistent, self.pos)
        self.pos = self.pos + (value != PAD_ID).sum(-1)
        return self

    def reorder(self, index: torch.Tensor) -> TableState:
        self.consistent, self.pos = self.consistent[index], self.pos[index]
        return self

    def _agree(self, value: torch.Tensor, consistent: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        v = value.reshape(value.shape[0], -1).to(self.support.device)
        L = self.support.shape[1]
        cols = self.support.T  # [L, K]
        ok = consistent.clone()
        for j in range(v.shape[1]):
            present = v[:, j] != PAD_ID
            at = pos + j
            col = cols[at.clamp(max=L - 1)]  # [n, K]
            hit = (col == v[:, j, None]) & (at < L)[:, None]
            ok = ok & (hit | ~present[:, None])
        return ok


class TableSegment(TorchDistribution):
    """Segment j of every row of a :class:`TableState` (values ``[n, S]`` right-padded, ragged)."""

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)
    ragged_event = True

    def __init__(self, state: TableState, j: int):
        self.state, self.j = state, j
        self.consistent, self.pos = state.consistent, state.pos  # the state may be extended before scoring
        super().__init__(torch.Size([state.consistent.shape[0]]), torch.Size([state.support.shape[1]]),
                         validate_args=False)

    def expand(self, batch_shape, _instance=None):
        if torch.Size(batch_shape) != self.batch_shape:
            raise ProgramError(f"a table segment has batch shape {tuple(self.batch_shape)}, not {tuple(batch_shape)}")
        return self

    def _log_mass(self, ok: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(self.state.log_q.masked_fill(~ok, float("-inf")), -1)

    def sample(self, sample_shape=()) -> torch.Tensor:
        st = self.state
        w = torch.softmax(st.log_q.masked_fill(~self.consistent, float("-inf")), -1)
        w = torch.where(torch.isnan(w), torch.full_like(w, 1.0 / w.shape[-1]), w)
        k = torch.multinomial(w, 1).squeeze(-1)
        end = st.ends[k, min(self.j, st.ends.shape[1] - 1)]
        width = int((end - self.pos).clamp(min=0).max()) if len(k) else 0
        idx = self.pos[:, None] + torch.arange(width, device=self.pos.device)[None]
        inside = idx < end[:, None]
        vals = st.support[k[:, None], idx.clamp(max=st.support.shape[1] - 1)]
        return torch.where(inside, vals, torch.full_like(vals, PAD_ID))

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        st = self.state
        after = st._agree(value, self.consistent, self.pos)
        # the segment must end where segment j of the agreeing rows ends
        n_tok = (value.reshape(value.shape[0], -1) != PAD_ID).sum(-1)
        ends_here = st.ends[:, min(self.j, st.ends.shape[1] - 1)][None] == (self.pos + n_tok)[:, None]
        before = self._log_mass(self.consistent)
        out = self._log_mass(after & ends_here) - before
        return torch.where(torch.isneginf(before), torch.full_like(out, float("-inf")), out)
