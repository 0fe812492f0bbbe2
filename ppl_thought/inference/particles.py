"""The one particles primitive every engine uses (docs/architecture.md, "Engines").

Particles are a batch dimension: a model and its guide run ONCE for all ``n`` particles under
``pyro.plate("particles", n, dim=-(max_plate_nesting + 1))``, the model replayed on the guide's
latent values, and each particle's log weight is read off the two traces,

    log w_i = sum_{model sites} log p_i  -  sum_{guide latent sites} log q_i,

(for a slow-thinking model S_i = log P^{<=|Z_i|}(Z_i) - log Q(Z_i | x) of the estimator (3.2)).
With ``guide=None`` the model's own sample statements propose (the bootstrap): the latent
factors cancel and log w_i is the sum over the observed sites and factors.

* :func:`sample_particles` runs whole traces (Importance, the SVI objectives);
* :func:`run_step` runs one step of a :class:`~ppl_thought.program.Program` and its guide (SMC).

Before weighting, :func:`check_sites` makes sure the guide samples exactly the model's latent
sites (names and shapes): a guide that misses a latent site lets the model draw it from its
prior, one that samples a site the model does not have is ignored by the model; both make the
weights silently wrong, so both are errors that name the site.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyro
import pyro.poutine as poutine
import torch
from pyro.distributions.util import scale_and_mask
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from ppl_thought import checks
from ppl_thought.contract import PARTICLES, arg_versions, as_twist, check_args, program_name, site_batch_error
from ppl_thought.errors import ChunkMismatchError, ConfigError, DeviceMismatchError, ProgramError, SiteMismatchError
from ppl_thought.inference.resampling import log_ratio
from ppl_thought.lm.base import lm_device
from ppl_thought.program import is_output, is_program
from ppl_thought.resources import check_particles
from ppl_thought.twists import collect_twists

__all__ = [
    "PARTICLES", "Particles", "StepOutput", "check_compatible", "check_sites", "check_steps", "engine_device",
    "find_max_plate_nesting", "infinite_sites", "latent_sites", "log_ratio", "output_sites", "per_particle",
    "program_device", "projection_definition", "run_step", "sample_particles", "token_space_size",
]


# ---------------------------------------------------------------------------------------------- sites
def latent_sites(trace) -> dict[str, dict]:
    """The latent (not observed, not subsample, not output) sample sites of a trace, by name."""
    return {k: s for k, s in trace.nodes.items()
            if s["type"] == "sample" and not s["is_observed"] and not site_is_subsample(s) and not is_output(s)}


def output_sites(trace) -> dict[str, dict]:
    """The output sites of a trace (``pt.observe(name, fn, None)``: drawn by the program, out of the weights)."""
    return {k: s for k, s in trace.nodes.items() if s["type"] == "sample" and is_output(s)}


def _site_shape(site) -> tuple[torch.Size, bool]:
    fn = site["fn"]
    ragged = bool(getattr(fn, "ragged_event", False) or getattr(getattr(fn, "base_dist", None), "ragged_event", False))
    return fn.batch_shape + fn.event_shape, ragged


class OutputNames(Messenger):
    """Records the names of the output sites a model runs (entered inside ``poutine.replay``, it sees a site
    before replay overwrites its ``infer`` with the guide's, which hides the output mark)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def _pyro_sample(self, msg) -> None:
        if is_output(msg):
            self.names.add(msg["name"])


def check_sites(model_trace, guide_trace, where: str = "", partial: bool = False, outputs=()) -> None:
    """Raise :class:`SiteMismatchError` unless the guide samples exactly the model's latent sites.

    Names must agree; shapes (batch + event) must agree, except the event width of ragged
    sequence sites (``Segment``: segments have different lengths). ``partial=True`` (decoding, (3.12)):
    the guide may leave latent sites to the model, which draws them itself (see :func:`sample_particles`).
    ``outputs``: the model's output sites (:class:`OutputNames`; under replay a guide's site hides the mark).
    """
    at = f" {where}" if where else ""
    m, g = latent_sites(model_trace), latent_sites(guide_trace)
    # under replay the model's copy of a guide site is marked by the guide's value; a model latent
    # the guide did not sample was drawn from the model's own prior
    missing = sorted(k for k in m if k not in g)
    extra = sorted(k for k in g if k not in model_trace.nodes)
    observed = sorted(k for k in g if k in model_trace.nodes and model_trace.nodes[k]["is_observed"])
    outputs = sorted(k for k in g if k in model_trace.nodes and (is_output(model_trace.nodes[k]) or k in outputs))
    if outputs:
        raise SiteMismatchError(f"the guide samples site(s) {outputs}{at} that the model generates itself "
                                "(pt.observe(name, fn, None)): a guide proposes latents only")
    if missing and not partial:
        raise SiteMismatchError(
            f"the guide does not sample the model's latent site(s) {missing}{at}: the model would draw them from "
            f"its prior and the importance weights would be wrong (guide samples {sorted(g)}, model latents "
            f"{sorted(m)})")
    if extra:
        raise SiteMismatchError(
            f"the guide samples site(s) {extra}{at} that the model does not have (model latents {sorted(m)}): "
            "check the site names (one name per step, e.g. f'z_{t}')")
    if observed:
        raise SiteMismatchError(f"the guide samples site(s) {observed}{at} that the model observes")
    for k in g:
        gshape, gragged = _site_shape(g[k])
        mshape, mragged = _site_shape(model_trace.nodes[k])
        if gragged or mragged:
            nb = len(model_trace.nodes[k]["fn"].batch_shape)
            if tuple(gshape[:nb]) != tuple(mshape[:nb]):
                raise SiteMismatchError(f"site {k!r}{at}: the guide's batch shape {tuple(gshape[:nb])} differs "
                                        f"from the model's {tuple(mshape[:nb])}")
        elif tuple(gshape) != tuple(mshape):
            raise SiteMismatchError(f"site {k!r}{at}: the guide samples shape {tuple(gshape)}, the model's "
                                    f"distribution has shape {tuple(mshape)}")


def program_device(obj) -> torch.device | None:
    """The torch device a model or guide computes on: its ``device`` attribute (:attr:`Program.device
    <ppl_thought.program.Program.device>`, a sampler's, an LM's), that of a bound method's object, else
    ``None`` (a plain Pyro function: the engine then reads its data's device)."""
    if obj is None:
        return None
    if isinstance(obj, torch.nn.Module):
        return lm_device(obj)
    owner = getattr(obj, "__self__", None)  # a bound method (e.g. ``ltm.conditioned_model``): its object's
    if owner is not None and owner is not obj:
        return program_device(owner)
    try:
        dev = getattr(obj, "device", None)
    except Exception:  # noqa: BLE001 - a property that cannot answer says nothing
        dev = None
    return dev if isinstance(dev, torch.device) else None


def engine_device(model, guide=None, args: tuple = (), kwargs: dict | None = None) -> torch.device | None:
    """The device an engine runs ``model`` and ``guide`` on: the one they say (:func:`program_device`), else
    that of the first tensor among the data ``args`` / ``kwargs`` (a plain Pyro function's data), else ``None``.

    Raises :class:`DeviceMismatchError` naming both devices when model and guide live on different devices
    (before torch fails inside a forward pass with "Expected all tensors to be on the same device").
    """
    md, gd = program_device(model), program_device(guide)
    if md is not None and gd is not None and not _same_device(md, gd):
        raise DeviceMismatchError(
            f"the model {type(model).__name__} is on device {md} but the guide {type(guide).__name__} is on "
            f"device {gd}: move both to one device (e.g. lm.to({str(md)!r}) for the guide's LM)")
    if md is not None or gd is not None:
        return md if md is not None else gd
    for v in list(args) + list((kwargs or {}).values()):
        if isinstance(v, torch.Tensor):
            return v.device
    return None


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.index == b.index or a.type != "cuda":
        return a.index == b.index or a.type == "cpu"
    cur = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)


def check_compatible(model, guide) -> None:
    """Refuse a guide built on another vocabulary or projection than the model's: its sequences would be
    read with other token ids or another lifting, and the weights would be meaningless numbers; a guide whose
    LM draws token ids over another vocabulary size than the model's (part of the posterior could not be
    proposed, or the guide would propose ids the model reads as other tokens); and a guide on another device
    than the model's (:class:`DeviceMismatchError` naming both). Every refusal is a
    :class:`SiteMismatchError` naming what differs, whatever the two objects have computed before (cached
    liftings are not part of a projection's definition)."""
    checks.callable_arg("model", model, "a Pyro model or a pt.Program")
    if guide is None:
        return
    if isinstance(guide, str | bytes | numbers.Number):  # other objects: each engine says what a guide must be
        raise ConfigError(f"guide must be a Pyro guide, a pt.Program, an LMSequence, or None (the model's prior "
                          f"proposes), got {type(guide).__name__} {guide!r}"[:300])
    engine_device(model, guide)
    mn, gn = token_space_size(model), token_space_size(guide)
    if mn is not None and gn is not None and mn != gn:
        raise SiteMismatchError(f"the guide draws token ids over a vocabulary of {gn} ids, the model over {mn}: "
                                "token ids would mean different tokens (or some of the model's tokens could not be "
                                "proposed); build the guide's LM on the model's Vocab")
    mp, gp = getattr(model, "projection", None), getattr(guide, "projection", None)
    if mp is None or gp is None or mp is gp:
        return
    if type(mp) is not type(gp):
        raise SiteMismatchError(f"the guide is built on a {type(gp).__name__} projection, the model on a "
                                f"{type(mp).__name__}: build both on the same projection")
    mv, gv = getattr(mp, "vocab", None), getattr(gp, "vocab", None)
    if mv is not None and gv is not None and mv != gv:
        raise SiteMismatchError(f"the guide's vocabulary ({len(gv)} tokens) is not the model's ({len(mv)} tokens): "
                                "token ids would mean different tokens; build both on the same Vocab")
    md, gd = projection_definition(mp), projection_definition(gp)
    differ = sorted(k for k in md.keys() | gd.keys() if k not in md or k not in gd or _differs(md[k], gd[k]))
    if differ:
        raise SiteMismatchError(f"the guide's {type(gp).__name__} differs from the model's in {differ}: "
                                "the liftings differ; build both on the same projection")


def token_space_size(program) -> int | None:
    """The number of token ids a model or guide draws its sequences over: its projection's vocabulary size,
    else its LM's ``vocab_size`` (``lm``, or ``prior`` for a slow-thinking model); ``None`` when it says
    neither (a plain Pyro function, an HMM)."""
    proj = getattr(program, "projection", None)
    if proj is not None and getattr(proj, "vocab", None) is not None:
        return len(proj.vocab)
    for name in ("lm", "prior"):
        size = getattr(getattr(program, name, None), "vocab_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


def check_particle_memory(who: str, num_particles: int, groups: int = 1, program=None, device=None) -> None:
    """Refuse, before anything is allocated, an engine whose particles cannot fit in memory
    (:func:`ppl_thought.resources.check_particles`, a :class:`~ppl_thought.errors.ResourceError`): called by the
    SMC constructor (no program yet) and callable at a run's start with the program, whose token vocabulary
    (:func:`token_space_size`) then counts too (one row of next-token log-probabilities per particle)."""
    vocab = None if program is None else token_space_size(program)
    check_particles(who, num_particles, groups, vocab, device)


def projection_definition(proj) -> dict:
    """What defines a projection, for comparing two of them: ``proj.definition()`` when it has one, else its
    public attributes (private ones such as ``_lifting_cache`` are caches that depend on what was computed)."""
    define = getattr(proj, "definition", None)
    if callable(define):
        return dict(define())
    return {k: v for k, v in vars(proj).items() if not k.startswith("_")}


def check_steps(model, guide) -> None:
    """SMC's check that the guide's steps end where the model's do: a model built with chunked encoding
    (``chunk > 0``: forced segments join the step before them, end of 5.6.2) needs a guide built the same way,
    and the other way round (:class:`~ppl_thought.errors.ChunkMismatchError` otherwise). Guides whose steps are
    not known before ``init`` (``chunk`` is None or absent on a program without a projection) are not checked."""
    if guide is None or getattr(model, "projection", None) is None or getattr(guide, "projection", None) is None:
        return
    mc, gc = getattr(model, "chunk", 0), getattr(guide, "chunk", 0)
    if mc is None or gc is None or bool(mc) == bool(gc):
        return
    which = (f"the model encodes forced segments in chunks (chunk={mc}) and the guide steps token by token" if mc
             else f"the guide encodes forced segments in chunks (chunk={gc}) and the model steps token by token")
    raise ChunkMismatchError(f"SMC: {which}, so their steps end at different observables; build both with the "
                             "same chunk (SlowThinking(prior, proj, chunk=C) with Causal(lm, proj, chunk=C))")


def _differs(a, b) -> bool:
    """Whether two attribute values differ; arrays and tensors by shape and values, and values that cannot be
    compared count as different (the same object is never different), so the answer never depends on luck."""
    if a is b:
        return False
    if isinstance(a, torch.Tensor | np.ndarray) or isinstance(b, torch.Tensor | np.ndarray):
        try:
            a_, b_ = (np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v) for v in (a, b))
        except (TypeError, ValueError, RuntimeError):
            return True
        return a_.shape != b_.shape or not bool(np.array_equal(a_, b_))
    try:
        return not bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values cannot be shown equal: refuse rather than guess
        return True


# ---------------------------------------------------------------------------------------------- weights
def particle_frame_dim(site) -> int | None:
    for f in site["cond_indep_stack"]:
        if f.name == PARTICLES:
            return f.dim
    return None


def site_log_prob(site) -> torch.Tensor:
    """The site's scaled and masked log-probability, computed once (as ``Trace.compute_log_prob`` stores
    it, without its per-site sums and warnings: the engines check the weights themselves)."""
    lp = site.get("log_prob")
    if lp is None:
        lp = site["fn"].log_prob(site["value"], *site["args"], **site["kwargs"])
        site["unscaled_log_prob"] = lp
        lp = scale_and_mask(lp, site["scale"], site["mask"])
        site["log_prob"] = lp
    return lp


def per_particle(trace, n: int, which: str = "all", device=None, skip=(), who: str = "",
                 where: str = "") -> torch.Tensor:
    """Sum of site log-probs per particle ``[n]`` (``which``: "all", "observed" or "latent"; the sites named in
    ``skip`` are left out).

    A site inside the particle plate is summed over every dim but the plate's; a site outside it
    (a global) adds its total to every particle. Keeps the graph (for the SVI objectives).
    Every site read must keep the batch-shape contract (:func:`~ppl_thought.contract.site_batch_error`;
    a :class:`ProgramError` naming ``who``, ``where`` and the site otherwise), so no engine weighs a site
    that Pyro's plate broadcast to ``[n, n]``.
    """
    total = None
    for site in trace.nodes.values():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        err = site_batch_error(site, who, where)
        if err is not None:
            raise err
        if is_output(site) or site["name"] in skip:
            continue  # an output is drawn from the program itself: its p / q cancels
        if which == "observed" and not site["is_observed"]:
            continue
        if which == "latent" and site["is_observed"]:
            continue
        lp = torch.as_tensor(site_log_prob(site))
        dim = particle_frame_dim(site)
        if dim is not None and lp.ndim == -dim and lp.shape[0] == n:  # the particle dim leftmost
            lp = lp if lp.ndim == 1 else lp.reshape(n, -1).sum(-1)
        elif dim is not None and lp.ndim >= -dim and lp.shape[dim] in (1, n):
            lp = torch.movedim(lp, lp.ndim + dim, 0)
            lp = lp.expand((n,) + lp.shape[1:]).reshape(n, -1).sum(-1)
        else:
            lp = lp.sum().expand(n)
        lp = lp.float() if lp.dtype in (torch.float16, torch.bfloat16) else lp
        total = lp if total is None else total.to(lp.device) + lp
    if total is None:
        total = torch.zeros(n, device=device)
    return total


def infinite_sites(*traces) -> list[str]:
    """The sample sites (``pyro.factor`` included) of ``traces`` whose log-probability holds NaN or +inf, by
    name: the error path of an engine whose weights came out NaN or +inf (looked up once, after the check)."""
    out = []
    for tr in traces:
        if tr is None:
            continue
        for name, site in tr.nodes.items():
            if site["type"] != "sample" or site_is_subsample(site):
                continue
            lp = torch.as_tensor(site_log_prob(site))
            if lp.is_floating_point() and bool((torch.isnan(lp) | torch.isposinf(lp)).any()):
                out.append(repr(name))
    return sorted(set(out))


# ---------------------------------------------------------------------------------------------- plates
def find_max_plate_nesting(model, guide, args: tuple = (), kwargs: dict | None = None) -> int:
    """The plates model and guide use themselves (the particle plate goes left of them).

    A program (or any object) declaring ``max_plate_nesting`` is believed; otherwise model and guide
    are traced once, outside any particle plate.
    """
    kwargs = kwargs or {}
    declared = [getattr(f, "max_plate_nesting", None) for f in (model, guide) if f is not None]
    if declared and all(d is not None for d in declared):
        return int(max(declared))
    depth = 0
    # a look-ahead trace must not move the random streams (runs stay reproducible, checkpoints resume)
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad(), poutine.block():
        tr = []
        if guide is not None:
            gtr = poutine.trace(guide).get_trace(*args, **kwargs)
            tr.append(gtr)
            tr.append(poutine.trace(poutine.replay(model, trace=gtr)).get_trace(*args, **kwargs))
        else:
            tr.append(poutine.trace(model).get_trace(*args, **kwargs))
    for t in tr:
        for site in t.nodes.values():
            if site["type"] == "sample":
                for f in site["cond_indep_stack"]:
                    if f.vectorized and f.dim is not None:
                        depth = max(depth, -f.dim)
    return depth


def particle_plate(n: int, dim: int, groups: int = 1, device: torch.device | None = None) -> pyro.plate:
    """The particle plate; one instance may be entered at every step of a run (Pyro plates are reusable).

    ``groups``: the plate's ``n`` rows are ``groups`` blocks of ``n // groups`` particles (grouped SMC);
    programs read it with :func:`~ppl_thought.program.particle_groups`. ``device``: where the plate's
    index tensor is made (the model's device; ``None``: Pyro's default).
    """
    plate = pyro.plate(PARTICLES, n, dim=dim, device=device)
    if groups != 1:
        plate.groups = int(groups)
    return plate


def _in_plate(fn: Callable, n: int, dim: int, plate: pyro.plate | None = None, device=None) -> Callable:
    def wrapped(*args, **kwargs):
        with plate if plate is not None else particle_plate(n, dim, device=device):
            return fn(*args, **kwargs)
    return wrapped


# ---------------------------------------------------------------------------------------------- whole traces
@dataclass
class Particles:
    """One batch of particles from whole traces: ``log_p``, ``log_q`` ``[n]`` (with their graphs when
    run under grad), ``log_likelihood`` (observed sites only), latent ``values`` and the traces."""

    log_p: torch.Tensor
    log_q: torch.Tensor
    values: dict[str, torch.Tensor]
    model_trace: Any = None
    guide_trace: Any = None
    params: list[torch.Tensor] = field(default_factory=list)  # parameters of the model only (theta)
    log_likelihood: torch.Tensor | None = None

    @property
    def log_w(self) -> torch.Tensor:
        """Log importance weights log p(z, x) - log Q(z | x), detached; -inf where p = 0."""
        return log_ratio(self.log_p.detach(), self.log_q.detach())

    @property
    def n(self) -> int:
        return int(self.log_p.shape[0])


def _param_tensor(v: torch.Tensor) -> torch.Tensor:
    u = getattr(v, "unconstrained", None)
    return u() if callable(u) else v


def sample_particles(model: Callable, guide: Callable | None, n: int, *args, max_plate_nesting: int | None = None,
                     partial_guide: bool = False, **kwargs) -> Particles:
    """Run ``guide`` once for ``n`` particles under the particle plate, replay ``model`` on it and weigh.

    ``guide=None``: the model proposes its own latents (bootstrap; log q = its latent log-probs).
    Raises :class:`SiteMismatchError` when the guide's latent sites are not exactly the model's.

    ``partial_guide=True`` (decoding, (3.12)-(3.14)): the guide may propose only some latent sites (those of
    the prompt); the model draws the others itself, from its own conditional law given everything before
    them, so their p / q cancels like an output's: ``log_p`` sums the observed sites and the guide's
    latents, ``log_q`` the guide's latents (0 without a guide), and log w = log_p - log_q is still the
    importance weight of the whole trace.
    """
    check_compatible(model, guide)
    dev = engine_device(model, guide, args, kwargs)
    depth = find_max_plate_nesting(model, guide, args, kwargs) if max_plate_nesting is None else max_plate_nesting
    dim = -(int(depth) + 1)
    who, gwho = program_name(model), f"the guide {program_name(guide)}"
    versions = arg_versions(args, kwargs)
    try:
        marks = OutputNames()
        if guide is not None:
            gtr = poutine.trace(_in_plate(guide, n, dim, device=dev)).get_trace(*args, **kwargs)
            mtr = poutine.trace(poutine.replay(marks(_in_plate(model, n, dim, device=dev)), trace=gtr)).get_trace(
                *args, **kwargs)
        else:
            mtr = poutine.trace(_in_plate(model, n, dim, device=dev)).get_trace(*args, **kwargs)
            gtr = None
    except RuntimeError as e:
        raise _duplicate_site_error(e, who) from None
    check_args(versions, who)  # a plain Pyro function's writes (a program's are named with their step)
    if gtr is not None:
        log_q = per_particle(gtr, n, "latent", dev, who=gwho)  # the contract on the guide's sites first
        check_sites(mtr, gtr, partial=partial_guide, outputs=marks.names)
        gtr.compute_log_prob()
    mtr.compute_log_prob()
    drawn = _drawn_by_model(mtr, gtr) if partial_guide else ()
    log_p = per_particle(mtr, n, device=dev, skip=drawn, who=who)
    if gtr is None:
        log_q = torch.zeros_like(log_p) if partial_guide else per_particle(mtr, n, "latent", dev, who=who)
    log_lik = per_particle(mtr, n, "observed", dev, who=who)
    source = gtr if gtr is not None and not partial_guide else mtr
    values = {k: s["value"] for k, s in latent_sites(source).items()}
    values.update({k: s["value"] for k, s in output_sites(mtr).items()})
    guide_params = set()
    if gtr is not None:
        guide_params = {id(_param_tensor(s["value"])) for s in gtr.nodes.values() if s["type"] == "param"}
    params = [_param_tensor(s["value"]) for s in mtr.nodes.values()
              if s["type"] == "param" and id(_param_tensor(s["value"])) not in guide_params]
    return Particles(log_p, log_q.to(log_p.device), values, mtr, gtr, params, log_lik.to(log_p.device))


def _drawn_by_model(model_trace, guide_trace) -> frozenset:
    """The model's latent sites the guide did not propose (drawn by the model itself; ``partial_guide``)."""
    g = guide_trace.nodes if guide_trace is not None else {}
    return frozenset(k for k in latent_sites(model_trace) if k not in g)


def _duplicate_site_error(e: RuntimeError, who: str = "", where: str = "") -> Exception:
    """A Pyro ``RuntimeError`` raised while tracing a model on its guide, as the :class:`ProgramError` that names
    the program, the step and the site: two sites of one name, or a guide that observes (``obs=``) a site the
    model samples (Pyro's replay: ``site z_0 must be sampled in trace``)."""
    msg = str(e)
    at = " ".join(p for p in (who, where) if p)
    at = f"{at}: " if at else ""
    if "Multiple" in msg and "sites named" in msg:
        return ProgramError(f"{at}{msg}. Site names must be unique per step of a program: name them by the step, "
                            "e.g. pyro.sample(f'z_{t}', ...)")
    m = _REPLAY_OBSERVED.search(msg)
    if m is not None:
        return ProgramError(f"{at}the guide observes site {m.group(1)!r} (obs=...), which the model samples as a "
                            "latent: a guide proposes the model's latent sites (pt.sample), it may not observe "
                            "them; sample the site in the guide, or leave it out (the model's prior proposes it)")
    return e


#: Pyro's replay error for a guide site that is not sampled (observed) but is a latent of the model
_REPLAY_OBSERVED = re.compile(r"site (.+) must be sampled in trace")


# ---------------------------------------------------------------------------------------------- one step
@dataclass
class StepOutput:
    """What one step of a program (and its guide) gives the engine."""

    log_w: torch.Tensor  # [n] incremental log weight (before twists)
    log_psi: torch.Tensor | None  # [n] potential set by pt.twist in the model's step, or None
    done: Any  # the model step's return value
    values: dict[str, tuple[torch.Tensor, int]]  # latent values and the position of their particle dim
    token_steps: int  # lockstep token steps of the sequence sites (for throughput figures)
    outputs: list[str] = field(default_factory=list)  # the names among ``values`` that are output sites
    traces: tuple = ()  # (model trace, guide trace): read only when the weights come out NaN or +inf


def run_step(model_fn: Callable, guide_fn: Callable | None, n: int, dim: int, where: str,
             plate: pyro.plate | None = None, device: torch.device | None = None,
             partial_guide: bool = False, who: str = "", check: Callable[[], None] | None = None) -> StepOutput:
    """Run one step: ``guide_fn()`` (if any) under the particle plate, then ``model_fn()`` replayed on it.

    ``model_fn`` / ``guide_fn`` are closures over the program's state, ``t`` and the data; ``plate``
    (:func:`particle_plate`) is made once per run by the engine. The incremental weight is the step's
    model log-probability minus the guide's (per particle), -inf where the model's is; ``device``: where a
    step without sites puts its zero weights (the engine's device). ``who`` (the program's name) and
    ``where`` (``"in step 3"``) name the step in the contract's errors: site batch shapes (:func:`per_particle`),
    the twist ``[n]`` (:func:`~ppl_thought.contract.as_twist`), a guide observing a model latent. ``check``: the
    engine's own contract checks (state entries, the caller's arguments), run right after the step, before any
    log-probability is read (a step that wrote into an observed argument would otherwise fail there first).
    """
    try:
        gtr = None
        if guide_fn is not None:
            gt = poutine.trace(_in_plate(guide_fn, n, dim, plate))
            gt()
            gtr = gt.trace
        marks = OutputNames()
        fn = marks(_in_plate(model_fn, n, dim, plate))
        mt = poutine.trace(poutine.replay(fn, trace=gtr) if gtr is not None else fn)
        with collect_twists() as tw:
            done = mt()
        mtr = mt.trace
    except RuntimeError as e:
        raise _duplicate_site_error(e, who, where) from None
    if check is not None:
        check()
    if gtr is not None:
        log_q = per_particle(gtr, n, "latent", device, who=f"the guide of {who}" if who else "the guide",
                             where=where)
        check_sites(mtr, gtr, where, partial=partial_guide, outputs=marks.names)
    source = gtr if gtr is not None else mtr
    if gtr is not None:
        drawn = _drawn_by_model(mtr, gtr) if partial_guide else ()
        log_w = log_ratio(per_particle(mtr, n, device=device, skip=drawn, who=who, where=where), log_q)
    else:
        log_w = per_particle(mtr, n, "observed", device, who=who, where=where)
    values, token_steps = {}, 0
    outs = output_sites(mtr)
    # with a partial guide the model's trace holds every latent (the guide's replayed, and its own)
    source = latent_sites(mtr if partial_guide else source)
    for k, s in {**source, **outs}.items():
        v = s["value"]
        ev = len(s["fn"].event_shape)
        values[k] = (v, v.ndim - ev + dim if particle_frame_dim(s) is not None else None)
        if getattr(s["fn"], "ragged_event", False):
            token_steps += int(v.shape[-1]) if v.ndim > len(s["fn"].batch_shape) else 1
    psi = as_twist(tw.log_psi, n, who, where)
    return StepOutput(log_w, psi, done, values, token_steps, list(outs), (mtr, gtr))


def require_program(obj, role: str) -> None:
    """SMC needs steps: a clear error for a plain function."""
    if obj is not None and not is_program(obj):
        raise ProgramError(
            f"SMC steps through a program, but the {role} {type(obj).__name__} is a plain Pyro function (no "
            "init/step): write it as a pt.Program (init(self, state, ...), step(self, state, t, ...)); "
            "pt.infer.Importance and SVI take plain Pyro functions")
