"""The program side of :func:`~ppl_thought.inference.decoding.decode` (docs/inference.md, "decode"): engine runs
of a program and its guide on the program's own arguments, with sites fixed to given values, and the rows they
give (outputs, latents, which rows were still active at each output).

:class:`_ProgramRun` runs R particles (``sample_particles`` with a partial guide: the guide proposes the prompt's
latents, the program draws the rest) and forms the weights p/q of (3.2), (3.14) and Algorithm 2 in one place,
:func:`_log_weights`; :class:`_Condition` fixes sites (an output becomes an observation: (3.2) on x y);
:func:`_stream_program` steps one particle through the Program protocol ((3.13)).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyro.poutine as poutine
import torch
from pyro.distributions import TorchDistribution
from pyro.poutine.messenger import Messenger

from ppl_thought.errors import ConfigError, ProgramError
from ppl_thought.guides.base import as_step_guide
from ppl_thought.inference.particles import (
    engine_device,
    find_max_plate_nesting,
    latent_sites,
    output_sites,
    particle_frame_dim,
    particle_plate,
    require_program,
    run_step,
    sample_particles,
)
from ppl_thought.inference.resampling import log_ratio
from ppl_thought.program import OUTPUT, Program, as_done, is_output, is_program
from ppl_thought.vocab import PAD_ID


def _log_weights(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """log w = log P^{<=|z|}(z) - log Q(z | x): the weights of (3.2), (3.14) and Algorithm 2; -inf never NaN
    (:func:`~ppl_thought.inference.resampling.log_ratio`).

    Every decoding method forms its weights here (the tests replace it with wrong weights to check that they
    would notice).
    """
    return log_ratio(log_p, log_q)



_FIXED_OUTPUT = "_pt_fixed_output"  # the infer key of an output site that _Condition made an observation


class _Condition(Messenger):
    """Fix sites of a program to given values, rows leading ``[R, ...]`` (moved to the particle dim ``dim`` at
    the site): output sites become observations (their log-probability enters the weights, (3.2) on x y) and
    latent sites are observed too (scored, not drawn)."""

    def __init__(self, data: dict, dim: int):
        super().__init__()
        self.data, self.dim = data, dim

    def _pyro_sample(self, msg) -> None:
        v = self.data.get(msg["name"])
        if v is None or msg["is_observed"]:
            return
        ev = len(msg["fn"].event_shape)
        msg["value"] = v.movedim(0, v.ndim - ev + self.dim)
        msg["is_observed"] = True
        if is_output(msg):
            msg["infer"] = {**msg["infer"], OUTPUT: False, _FIXED_OUTPUT: True}


class _Conditioned:
    """``program`` with the sites in ``data`` fixed (:class:`_Condition`); a Pyro model for the engines."""

    def __init__(self, program, data: dict, dim: int):
        self.program, self.data, self.dim = program, data, dim
        self.max_plate_nesting = getattr(program, "max_plate_nesting", None)

    @property
    def device(self):
        """The program's device (the engines make the particle plate there)."""
        return getattr(self.program, "device", None)

    def __call__(self, *args, **kwargs):
        with _Condition(self.data, self.dim):
            return self.program(*args, **kwargs)


def _rows(site) -> torch.Tensor:
    """A site's value with the particle dim leading ``[R, ...]``."""
    d = particle_frame_dim(site)
    v = torch.as_tensor(site["value"])
    if d is None:
        raise ConfigError(f"site {site['name']!r} is outside the particle plate: a decoded program's outputs and "
                          "latents must carry the particles (sample them inside pt.particles()'s batch)")
    ev = len(site["fn"].event_shape)
    v = v.movedim(v.ndim - ev + d, 0)
    return v


def _active(site, R: int) -> torch.Tensor:
    """``[R]`` bool: the rows whose program had not finished at this site (its particle mask)."""
    v = torch.as_tensor(site["value"])
    m = site.get("mask")
    if m is None or m is True:
        return torch.ones(R, dtype=torch.bool, device=v.device)
    if m is False:
        return torch.zeros(R, dtype=torch.bool, device=v.device)
    bs = site["fn"].batch_shape
    m = torch.broadcast_to(torch.as_tensor(m, device=v.device), bs)
    m = m.movedim(len(bs) + particle_frame_dim(site), 0)
    return m.reshape(R, -1).all(-1)


@dataclass
class _Draws:
    """The output (and latent) sites of one engine run, rows leading; ``active`` per output site."""

    outputs: dict
    active: dict
    latents: dict

    @staticmethod
    def of(trace, R: int) -> _Draws:
        outs = output_sites(trace)
        return _Draws({k: _rows(s) for k, s in outs.items()}, {k: _active(s, R) for k, s in outs.items()},
                      {k: _rows(s) for k, s in latent_sites(trace).items()})

    def select(self, idx: torch.Tensor) -> _Draws:
        pick = {}
        for name in ("outputs", "active", "latents"):
            pick[name] = {k: v[idx.to(v.device)] for k, v in getattr(self, name).items()}
        return _Draws(**pick)


def _tokens(draws: _Draws) -> torch.Tensor | None:
    """The outputs as ``[S, m]`` token ids (-1 where not active) when each is one integer per sample."""
    vals = list(draws.outputs.values())
    if not vals or any(v.ndim != 1 or torch.is_floating_point(v) or v.dtype == torch.bool for v in vals):
        return None
    t = torch.stack([v.long() for v in vals], 1)
    act = torch.stack([draws.active[k].to(t.device) for k in draws.outputs], 1)
    return t.masked_fill(~act, -1)


class _ProgramRun:
    """One program, guide and arguments: engine runs of R particles (``sample_particles`` with a partial guide)."""

    def __init__(self, program, guide, args: tuple, kwargs: dict):
        self.program, self.guide, self.args, self.kwargs = program, guide, args, kwargs
        self.depth = find_max_plate_nesting(program, guide, args, kwargs)
        self.dim = -(self.depth + 1)
        self.device = engine_device(program, guide, args, kwargs)

    def run(self, R: int, data: dict | None = None, guide=True):
        """Particles of R rows; ``data`` ``{site: [R, ...]}`` fixes sites (outputs become observations). ``guide``:
        True (the run's guide), False (none: the program proposes), or another guide (Algorithm 2's guide of the
        grown prompt, :meth:`grown_guide`)."""
        model = _Conditioned(self.program, data, self.dim) if data else self.program
        g = self.guide if guide is True else (guide or None)
        with torch.no_grad(), poutine.block():
            return sample_particles(model, g, R, *self.args,
                                    max_plate_nesting=self.depth, partial_guide=True, **self.kwargs)

    def grown_guide(self, decoded: list):
        """The guide of the prompt grown by the ``decoded`` outputs (Algorithm 2's Z^(t) ~ Q(. | X^(t))): the
        program's protocol method ``grown_prompt_guide(guide, decoded, *args, **kwargs)`` (docs/programs.md) when it
        offers one and it gives a guide, else True (the run's guide, proposing the prompt's latents from the
        program's arguments alone)."""
        grow = getattr(self.program, "grown_prompt_guide", None)
        g = grow(self.guide, decoded, *self.args, **self.kwargs) if callable(grow) and self.guide is not None else None
        return True if g is None else g

    def weights(self, p) -> torch.Tensor:
        """log w = log p - log q per particle: the weights of (3.2), (3.14) and Algorithm 2 (:func:`_log_weights`)."""
        return _log_weights(p.log_p, p.log_q.to(p.log_p.device))


def _finish_mismatch(trace, R: int, expected: dict, complete: bool, device=None) -> torch.Tensor:
    """``[R]`` bool: rows whose program finished elsewhere than the fixed outputs say (weight 0).

    ``expected`` ``{site: bool [R]}``: whether each fixed output site was drawn (the program had not finished).
    ``complete``: the fixed outputs are a whole continuation, so a row still active at a further output site
    does not match either."""
    dev = next(iter(expected.values())).device if expected else device
    bad = torch.zeros(R, dtype=torch.bool, device=dev)
    for name, want in expected.items():
        site = trace.nodes.get(name)
        got = _active(site, R).to(want.device) if site is not None else torch.zeros_like(want)
        bad = bad | (got != want)
    if complete:
        for site in output_sites(trace).values():
            bad = bad | _active(site, R).to(bad.device)
    return bad



class _WholeGuide(Program):
    """A guide given as a plain Pyro function, run whole in ``init`` (it proposes the sites the program samples
    in its ``init``, e.g. the prompt's lifting ``"z"`` of ``SlowThinking.continuation``)."""

    def __init__(self, guide):
        self.guide = guide

    def init(self, state: dict, *args, **kwargs) -> None:
        self.guide(*args, **kwargs)

    def step(self, state: dict, t: int, *args, **kwargs):
        return None


def _step_guide(guide):
    """The guide as a program streaming can step: programs (and ``None``) as they are, a plain Pyro function
    run whole in ``init`` (:class:`_WholeGuide`), anything else by ``as_step_guide``."""
    if guide is None or is_program(guide) or isinstance(guide, TorchDistribution) or not callable(guide):
        return as_step_guide(guide)
    return _WholeGuide(guide)


def _stream_program(program, guide, args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(3.13) for a program: one particle, stepped through the Program protocol (``init``, then ``step(state, t,
    ...)`` until it returns finished flags; the guide's ``init`` / ``step`` propose the prompt's latents, the
    program draws the rest, :func:`~ppl_thought.inference.particles.run_step`); each step's outputs are yielded as
    ``(site, value)`` as soon as that step has drawn them (the value without the particle dim)."""

    require_program(program, "model")
    guide = _step_guide(guide)
    require_program(guide, "guide")
    depth = find_max_plate_nesting(program, guide, args, kwargs)
    dim = -(depth + 1)
    dev = engine_device(program, guide, args, kwargs)
    plate = particle_plate(1, dim, device=dev)
    sm: dict = {}
    sg: dict = {}
    bound = program.max_steps if getattr(program, "max_steps", None) is not None else 10_000
    t = -1
    while True:
        if t >= bound:
            raise ProgramError(f"{type(program).__name__} did not finish within max_steps={bound} steps")
        if t < 0:
            mf, gf = (lambda: program.init(sm, *args, **kwargs)), (lambda: guide.init(sg, *args, **kwargs))
        else:
            mf = (lambda t=t: program.step(sm, t, *args, **kwargs))
            gf = (lambda t=t: guide.step(sg, t, *args, **kwargs))
        with torch.no_grad(), poutine.block():
            out = run_step(mf, gf if guide is not None else None, 1, dim, "in init" if t < 0 else f"in step {t}",
                           plate, dev, partial_guide=True)
        for name in out.outputs:
            v, d = out.values[name]
            yield name, (v.movedim(d, 0)[0] if d is not None else v)
        if t >= 0:
            done = as_done(out.done, 1, dev)
            if done is not None and bool(done.all()):
                return
        t += 1


def _collect(outs: list[dict]) -> _Draws:
    """Samples decoded one at a time (possibly of different lengths) as one :class:`_Draws` (rows leading)."""
    order: list[str] = []
    for o in outs:
        order += [k for k in o if k not in order]
    values, active = {}, {}
    for k in order:
        like = next(o[k] for o in outs if k in o)
        values[k] = torch.cat([o[k] if k in o else torch.zeros_like(like) for o in outs])
        active[k] = torch.tensor([k in o for o in outs], dtype=torch.bool, device=like.device)
    return _Draws(values, active, {})


def _keys(values: dict, act: dict, names: list) -> torch.Tensor:
    """``[R, D]`` float64 rows identifying each row's values at ``names`` (a site after the finish counts as absent)."""
    cols = []
    for k in names:
        v = values[k].reshape(values[k].shape[0], -1).double()
        a = act[k][:, None].to(v.device)
        cols += [a.double(), torch.where(a, v, torch.zeros((), dtype=torch.float64, device=v.device))]
    return torch.cat(cols, 1)


def _first_of_each(key: torch.Tensor) -> torch.Tensor:
    """The first row index of each distinct row of ``key``, in ``torch.unique``'s order."""
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)
    pos = torch.arange(key.shape[0], device=key.device)
    first = torch.full((uniq.shape[0],), key.shape[0], dtype=torch.long, device=key.device)
    return first.scatter_reduce_(0, inv, pos, "amin")


def _joined(latents: dict) -> torch.Tensor | None:
    """``z [S, L]``: the latents joined in program order when every one is a right-padded token segment
    ``[S, L_t]`` (an LMState's prompt lifting and next segments, e.g. SlowThinking's continuation), ``<pad>``
    moved to the end of each row; else ``None``."""
    vals = list(latents.values())
    if not vals or any(v.ndim != 2 or torch.is_floating_point(v) or v.dtype == torch.bool for v in vals):
        return None
    z = torch.cat([v.long() for v in vals], 1)
    order = torch.argsort((z == PAD_ID).to(torch.int8), dim=1, stable=True)
    return z.gather(1, order)


def _on_values(values: torch.Tensor, got: torch.Tensor, finished: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``[U]`` the probabilities ``p`` of the (unfinished) values ``got`` placed at their rows of ``values``."""
    dev = p.device
    a = values.reshape(values.shape[0], -1).to(dev).double()
    b = got.reshape(got.shape[0], -1).to(dev).double()
    match = (a[:, None, :] == b[None, :, :]).all(-1) & ~finished.to(dev)[None]  # [U, G]
    return (match.double() * p.double()[None]).sum(1).float()
