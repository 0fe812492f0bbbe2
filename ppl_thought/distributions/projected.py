"""The observed site x ~ Proj(z): a deterministic (delta) distribution given latent sequences."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

from ppl_thought.errors import MalformedSequenceError, NotInImageError
from ppl_thought.projections.base import Projection
from ppl_thought.validation import checked, per_token
from ppl_thought.vocab import PAD_ID


@checked
class ProjectionDelta(TorchDistribution):
    """x = Proj^{<w}(z) restricted to |x| = n: ``log_prob(x)`` is 0 if z lies in the lifting of x, else -inf.

    z in Proj^{-1}_{<w}(x) (Prop 2.3) is checked by running the lifting automaton of x over all
    rows of z at once, so scoring is vectorised over particles. ``sample()`` projects each row.
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.nonnegative_integer, 1)

    def __init__(self, projection: Projection, z: torch.Tensor, num_observed: int, validate_args: bool | None = None):
        self.projection = projection
        self.z = z
        self.num_observed = int(num_observed)
        super().__init__(z.shape[:-1], torch.Size([self.num_observed]), validate_args=validate_args)

    @per_token
    def expand(self, batch_shape: Sequence[int], _instance: ProjectionDelta | None = None):
        z = self.z.expand(torch.Size(batch_shape) + self.z.shape[-1:])
        return ProjectionDelta(self.projection, z, self.num_observed)

    @per_token
    def sample(self, sample_shape: Sequence[int] = ()) -> torch.Tensor:
        flat = self.z.reshape(-1, self.z.shape[-1])
        xs = self.projection.project(flat.cpu().numpy()) if flat.shape[0] else []
        out = torch.full((flat.shape[0], self.num_observed), PAD_ID, dtype=torch.long, device="cpu")
        for i, x in enumerate(xs):
            x = np.asarray(x)[: self.num_observed]
            out[i, : len(x)] = torch.as_tensor(x, device="cpu")
        out = out.reshape(self.z.shape[:-1] + (self.num_observed,)).to(self.z.device)
        return out.expand(torch.Size(sample_shape) + out.shape)

    @per_token
    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(x, device=x.device if isinstance(x, torch.Tensor) else self.z.device)
        if x.shape[-1] != self.num_observed:
            raise MalformedSequenceError(f"observed x has length {x.shape[-1]}, the model was built for "
                                         f"{self.num_observed}")
        xs = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (also for the empty observation)
        if not (xs == xs[:1]).all():
            return self._log_prob_rows(x)
        try:
            lift = self.projection.lifting(xs[0].cpu().numpy())
        except NotInImageError:
            shape = torch.broadcast_shapes(x.shape[:-1], self.batch_shape)
            return torch.full(shape, float("-inf"), device=self.z.device)
        z = self.z
        s = torch.full(z.shape[:-1], lift.start, dtype=torch.long, device=z.device)
        for i in range(z.shape[-1]):
            s = lift.advance(s, z[..., i])  # <pad> keeps the state
        lp = lift.is_final(s).float().log()  # 0 / -inf
        return lp.expand(torch.broadcast_shapes(x.shape[:-1], self.batch_shape))

    def _log_prob_rows(self, x: torch.Tensor) -> torch.Tensor:
        shape = torch.broadcast_shapes(x.shape[:-1], self.batch_shape)
        xs = x.expand(shape + x.shape[-1:]).reshape(math.prod(shape), x.shape[-1])
        zs = self.z.expand(shape + self.z.shape[-1:]).reshape(math.prod(shape), self.z.shape[-1])
        out = torch.empty(xs.shape[0], device=self.z.device)
        for i in range(xs.shape[0]):
            out[i] = ProjectionDelta(self.projection, zs[i : i + 1], self.num_observed).log_prob(xs[i])[0]
        return out.reshape(shape)
