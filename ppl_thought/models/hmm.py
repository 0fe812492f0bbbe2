"""Hidden Markov models (Def 2.2), their forward algorithm (3.1) and Theorem 2.3's slow-thinking form.

An HMM ``(A, B, lam)`` over hidden states Omega and observations Sigma draws
``Z_1 ~ lam``, ``Z_{t+1} ~ A[Z_t]``, ``X_t ~ B[Z_t]`` (Def 2.2); ``P_{A,B,lam}`` is the law of
``(X_t)``. Observations are integer indices into Sigma (``0 .. |Sigma| - 1``), hidden states
integer indices into Omega; names (token strings) are only needed for the slow-thinking form.

Everything exact here is computed by the forward algorithm, the Markov case of (3.1):
``P(x_{<=t}) = lam^T diag(B[:, x_1]) A diag(B[:, x_2]) ... A diag(B[:, x_t]) 1``, in
``O(T |Omega|^2)`` operations per sequence, batched over sequences. The recursion carries the
filtered law ``P(Z_t | x_{<=t})`` and accumulates ``log P(x_{<=t})`` as a sum of the logs of
the one-step normalisers ``P(x_t | x_{<t})``, so it works in log space without underflow; an
impossible observation gives ``-inf`` (never NaN) and keeps it.

Theorem 2.3 (proof in App. E.2) writes every HMM as ``Proj # P_f`` with a bigram latent model:
latent tokens are pairs ``(x, z)`` of an observation and a hidden state (Example 2.2, the
:class:`~ppl_thought.projections.product.Product` projection), Proj keeps the observation, and
the latent model is the Markov chain of the pairs,
``P((x', z') | (x, z)) = A[z, z'] B[z', x']`` and ``P((x, z) | <bos>) = lam[z] B[z, x]``.
:func:`ppl_thought.models.hmm_lifting.slow_thinking_parts` builds it as an exact
:class:`~ppl_thought.lm.tabular.Tabular` bigram LM.

The HMM is also a Pyro program and a :class:`~ppl_thought.program.Program` (Def 2.2 step by step):
``hmm(x)`` observes ``x [T]``, ``hmm(length=T)`` generates. Step ``t`` samples the hidden site
``f"z_{t}" ~ Categorical(lam if t == 0 else A[z_{t-1}])`` and the emission
``f"x_{t}" ~ Categorical(B[z_t])`` (observed when x is given); site log-probs are float64 and
``-inf`` (never NaN) where A, B or lam has a zero. ``pt.guides.HMMGuide.posterior(hmm)`` (backward
algorithm: the exact ``P(z_t | z_{t-1}, x)``, zero-variance importance weights) and
``pt.guides.HMMGuide.filtering(hmm)`` (the locally optimal SMC proposal ``P(z_t | z_{t-1}, x_t)``) are
programs with the same sites ``z_t``; ``guide=None`` (the prior) is the bootstrap proposal.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import pyro
import pyro.distributions as dist
import torch

from ppl_thought import checks
from ppl_thought.errors import ConfigError, MalformedSequenceError, TooLargeToEnumerateError, UnknownTokenError
from ppl_thought.program import Program, particle_frame, particles, run_whole
from ppl_thought.projections.product import Product
from ppl_thought.validation import ArrayLike, checked, per_token

DTYPE = torch.float64
_NEG_INF = float("-inf")


class EntropyEstimate(NamedTuple):
    """A Monte-Carlo estimate of a per-token entropy (nats) with its standard error."""

    estimate: float
    stderr: float
    num_sequences: int
    length: int


def _as_stochastic(name: str, value, shape: tuple[int, ...] | None, atol: float) -> torch.Tensor:
    """Validate a probability vector (1-D) or a row-stochastic matrix (2-D); float64, rows renormalised.

    The result keeps ``value``'s autograd graph (no detach): tables computed from parameters give gradients
    of every exact answer (the forward algorithm (3.1)) and of the program's site log-probs."""
    checks.numeric_array(f"HMM {name}", value, expects="a probability table (a tensor, an array or nested lists of "
                         "numbers)")
    t = torch.as_tensor(value).to("cpu", DTYPE)
    want_ndim = 1 if name == "lam" else 2
    if t.ndim != want_ndim:
        raise ConfigError(f"HMM {name} must be {want_ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ConfigError(f"HMM {name} must have shape {shape}, got {tuple(t.shape)}")
    if t.numel() == 0:
        raise ConfigError(f"HMM {name} is empty (shape {tuple(t.shape)})")
    rows = t.reshape(-1, t.shape[-1])
    bad = ~torch.isfinite(rows)
    if bad.any():
        i, j = (int(v) for v in bad.nonzero()[0])
        where = f"{name}[{i}, {j}]" if t.ndim == 2 else f"{name}[{j}]"
        raise ConfigError(f"HMM {where} = {rows[i, j].item()} is not a finite number")
    neg = rows < 0
    if neg.any():
        i, j = (int(v) for v in neg.nonzero()[0])
        where = f"{name}[{i}, {j}]" if t.ndim == 2 else f"{name}[{j}]"
        raise ConfigError(f"HMM {where} = {rows[i, j].item():.6g} is negative; probabilities must be >= 0")
    sums = rows.sum(-1)
    off = (sums - 1).abs() > atol
    if off.any():
        i = int(off.nonzero()[0, 0])
        what = f"row {i} of {name}" if t.ndim == 2 else name
        raise ConfigError(f"{what} sums to {sums[i].item():.6g}, not 1: {name} must be "
                         f"{'row-stochastic' if t.ndim == 2 else 'a probability vector'} (Def 2.2)")
    return (rows / sums[:, None]).reshape(t.shape)


def _safe_log(p: torch.Tensor) -> torch.Tensor:
    """log with log(0) = -inf and no warning."""
    return torch.where(p > 0, p.clamp_min(torch.finfo(p.dtype).tiny).log(), torch.full_like(p, _NEG_INF))


def _particle_batch_shape() -> tuple[int, ...]:
    """The batch shape of one value per particle, right-aligned with the particle plate's dim.

    ``(n,)`` under ``pyro.plate("particles", n, dim=-1)``, ``(n, 1)`` at ``dim=-2``, ...; ``()``
    outside a (vectorised) particle plate.
    """
    frame = particle_frame()
    if frame is None or getattr(frame, "dim", None) is None:
        return ()
    return (int(frame.size),) + (1,) * (-int(frame.dim) - 1)


def all_done(device: torch.device | str = "cpu") -> torch.Tensor:
    """Finished flags ``[n]`` for every particle (the last step), on ``device`` (the HMM's)."""
    return torch.ones(particles(), dtype=torch.bool, device=device)


def prior_logits(hmm: HMM, state: dict, t: int) -> torch.Tensor:
    """Logits of ``P(Z_t | Z_{t-1})``: ``log lam`` expanded to the particles at t = 0, else ``log A[z_{t-1}]``."""
    if t == 0:
        return hmm.log_lam.expand(_particle_batch_shape() + (hmm.num_states,))
    return hmm.log_A[state["z"]]


@checked
class HMM(Program):
    """A hidden Markov model ``(A, B, lam)`` (Def 2.2).

    Args:
        A: ``[|Omega|, |Omega|]`` row-stochastic transition matrix, ``A[z, z'] = P(Z_{t+1}=z' | Z_t=z)``.
        B: ``[|Omega|, |Sigma|]`` row-stochastic emission matrix, ``B[z, x] = P(X_t=x | Z_t=z)``.
        lam: ``[|Omega|]`` initial distribution of ``Z_1``.
        observable_tokens: optional names of the observations (token strings, no whitespace),
            used by :func:`~ppl_thought.models.hmm_lifting.slow_thinking_parts`; default ``"x0", "x1", ...``.
        hidden_names: optional names of the hidden states; default ``"h0", "h1", ...``.
        atol: tolerance on row sums; rows within it are renormalised exactly.

    Observation sequences ``x`` are LongTensors of indices in ``[0, |Sigma|)``, either one
    sequence ``[T]`` or a batch ``[N, T]``; results then have no batch dimension or ``[N]``.
    All computations run in float64, on the CPU unless the HMM is moved with :meth:`to` (its tables, the
    program's sites and every exact answer then live on that device). Tables computed from parameters keep
    their autograd graph: :meth:`log_prob` (the forward algorithm (3.1)) and the program's site log-probs are
    differentiable in them, so a parametrised HMM can be fitted or its parameters sampled by Langevin dynamics.

    As a Pyro program (:class:`~ppl_thought.program.Program`, max_plate_nesting 0):
    ``hmm(x=None, length=None)`` runs :meth:`init` and every :meth:`step` in one trace and
    returns the final state. Sites per step ``t = 0 .. T-1``: ``f"z_{t}"`` (hidden state,
    LongTensor) and ``f"x_{t}"`` (emission; observed ``x[t]`` when x is given), both with batch
    shape ``[n]`` under ``pyro.plate("particles", n)`` (``[n, 1, ..]`` when that plate sits at a
    dim left of -1; the batch of any other enclosing plate, e.g. ``Predictive(parallel=True)``,
    likewise) and batch shape ``()`` outside every plate. ``state["z"]`` holds the current hidden
    state with the site's shape. The sum of the site log-probs of one particle is
    :meth:`log_joint` of its path; every site log-prob is float64, ``-inf`` on zero entries of
    A, B or lam (never NaN).
    """

    max_plate_nesting = 0

    def __init__(
        self,
        A: ArrayLike,
        B: ArrayLike,
        lam: ArrayLike,
        *,
        observable_tokens: Sequence[str] | None = None,
        hidden_names: Sequence[str] | None = None,
        atol: float = 1e-6,
    ):
        A = _as_stochastic("A", A, None, atol)
        S = A.shape[0]
        if A.shape[1] != S:
            raise ConfigError(f"HMM A must be square [|Omega|, |Omega|], got shape {tuple(A.shape)}")
        B = _as_stochastic("B", B, None, atol)
        if B.shape[0] != S:
            raise ConfigError(f"HMM B must have |Omega| = {S} rows (one per hidden state), "
                             f"got shape {tuple(B.shape)}")
        lam = _as_stochastic("lam", lam, (S,), atol)
        self.A, self.B, self.lam = A, B, lam
        self.log_A, self.log_B, self.log_lam = _safe_log(A), _safe_log(B), _safe_log(lam)
        K = B.shape[1]
        self.observable_tokens = self.check_names(observable_tokens, K, "x", "observable_tokens")
        self.hidden_names = self.check_names(hidden_names, S, "h", "hidden_names")

    @property
    def device(self) -> torch.device:
        """Where the tables live (CPU unless moved with :meth:`to`)."""
        return self.A.device

    def to(self, device: torch.device | str) -> HMM:
        """Move the tables (A, B, lam and their logs) to ``device``, in place; returns the HMM."""
        for name in ("A", "B", "lam", "log_A", "log_B", "log_lam"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    @staticmethod
    def check_names(names: Sequence[str] | None, n: int, prefix: str, what: str) -> list[str]:
        if names is None:
            return [f"{prefix}{i}" for i in range(n)]
        names = [str(s) for s in names]
        if len(names) != n:
            raise ConfigError(f"{what} has {len(names)} names but the HMM has {n}")
        if len(set(names)) != n:
            raise ConfigError(f"{what} contains duplicates: {names}")
        return names

    # ------------------------------------------------------------------ sizes
    @property
    def num_states(self) -> int:
        """|Omega|, the number of hidden states."""
        return self.A.shape[0]

    @property
    def num_observations(self) -> int:
        """|Sigma|, the number of observation symbols."""
        return self.B.shape[1]

    def __repr__(self) -> str:
        return f"HMM(|Omega|={self.num_states}, |Sigma|={self.num_observations})"

    # ------------------------------------------------------------------ input checking
    def check_x(self, x: ArrayLike, what: str = "observations x") -> tuple[torch.Tensor, bool]:
        """x -> (LongTensor [N, T], whether the input was a single 1-D sequence)."""
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x)
        if x.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            if x.numel() == 0:
                x = x.long()
            else:
                raise MalformedSequenceError(
                    f"{what} must hold integer observation indices, got dtype {x.dtype}")
        if x.ndim not in (1, 2):
            raise MalformedSequenceError(f"{what} must be [T] or [N, T], got shape {tuple(x.shape)}")
        single = x.ndim == 1
        x = x.detach().to(self.device, torch.long)
        if single:
            x = x[None]
        K = self.num_observations
        if x.numel() and (x.min() < 0 or x.max() >= K):
            bad = x[(x < 0) | (x >= K)][:5].tolist()
            raise UnknownTokenError(f"{what} contain indices {bad} outside the observation set [0, {K})")
        return x, single

    # ------------------------------------------------------------------ forward algorithm (3.1)
    def _forward(self, x: torch.Tensor, want_filter: bool = False, want_predictive: bool = False):
        """The forward recursion on a checked batch ``x [N, T]``.

        Returns ``log P(x_{<=t})`` ``[N, T]`` and optionally the filtered laws
        ``P(Z_t | x_{<=t})`` ``[N, T, |Omega|]`` and the predictive laws
        ``P(X_{t+1} | x_{<=t})`` ``[N, T + 1, |Sigma|]`` (zero rows after an impossible prefix).
        """
        N, T = x.shape
        S = self.num_states
        B_T = self.B.T.contiguous()  # [K, S]: emission likelihood of each symbol
        prior = self.lam.expand(N, S)  # P(Z_t | x_{<t}): the one-step prediction of the hidden state
        dev = self.device
        log_p = torch.zeros(N, dtype=DTYPE, device=dev)
        prefix = torch.empty(N, T, dtype=DTYPE, device=dev)
        filt = torch.empty(N, T, S, dtype=DTYPE, device=dev) if want_filter else None
        pred = torch.empty(N, T + 1, self.num_observations, dtype=DTYPE, device=dev) if want_predictive else None
        for t in range(T):
            if want_predictive:
                pred[:, t] = prior @ self.B
            joint = prior * B_T[x[:, t]]  # P(Z_t = z, x_t | x_{<t})
            c = joint.sum(-1)  # P(x_t | x_{<t})
            log_p = log_p + _safe_log(c)
            prefix[:, t] = log_p
            post = joint / torch.where(c > 0, c, torch.ones_like(c))[:, None]  # zero row once impossible
            if want_filter:
                filt[:, t] = post
            prior = post @ self.A
        if want_predictive:
            pred[:, T] = prior @ self.B
        return prefix, filt, pred

    @per_token
    def log_prob(self, x: ArrayLike) -> torch.Tensor:
        """``log P_{A,B,lam}(x_1 .. x_T)`` (Def 2.2) by the forward algorithm (3.1).

        ``x``: ``[T]`` -> 0-d tensor, or ``[N, T]`` -> ``[N]``. ``-inf`` for impossible sequences
        (never NaN); ``0`` for the empty sequence. ``O(N T |Omega|^2)``.
        """
        xb, single = self.check_x(x)
        if xb.shape[1] == 0:
            out = torch.zeros(xb.shape[0], dtype=DTYPE, device=self.device)
        else:
            out = self._forward(xb)[0][:, -1]
        return out[0] if single else out

    def prefix_log_probs(self, x: ArrayLike) -> torch.Tensor:
        """``log P(x_{<=t})`` for t = 1..T: ``[T]`` or ``[N, T]`` (the marginal of every prefix)."""
        xb, single = self.check_x(x)
        out = self._forward(xb)[0]
        return out[0] if single else out

    def filter(self, x: ArrayLike) -> torch.Tensor:
        """The filtered laws ``P(Z_t | x_{<=t})`` for t = 1..T: ``[T, |Omega|]`` or ``[N, T, |Omega|]``.

        After an impossible prefix (P(x_{<=t}) = 0) the conditional law is undefined and the
        row is all zeros.
        """
        xb, single = self.check_x(x)
        out = self._forward(xb, want_filter=True)[1]
        return out[0] if single else out

    def predictive(self, x: ArrayLike) -> torch.Tensor:
        """Next-observation laws ``P(X_{t+1} | x_{<=t})`` for t = 0..T: ``[(N,) T+1, |Sigma|]``.

        Row 0 is ``lam B`` (nothing observed yet); row t follows the prefix of length t, so
        ``predictive(x)[t, x[t]] = P(x_{t+1} | x_{<=t})``. Rows after an impossible prefix are zeros.
        """
        xb, single = self.check_x(x)
        out = self._forward(xb, want_predictive=True)[2]
        return out[0] if single else out

    # ------------------------------------------------------------------ cross-entropy / entropy rate
    def per_token_nll(self, x: ArrayLike) -> torch.Tensor:
        """``-log P(x) / T`` (nats per token) of each sequence: ``[N]`` (or 0-d for one sequence)."""
        xb, single = self.check_x(x)
        T = xb.shape[1]
        if T == 0:
            raise MalformedSequenceError("per-token cross-entropy needs sequences of length >= 1")
        out = -self.log_prob(xb) / T
        return out[0] if single else out

    def cross_entropy(self, x: ArrayLike) -> float:
        """Exact per-token cross-entropy of held-out sequences: the mean over sequences of ``-log P(x)/T``.

        This is the loss a model of the observations can reach at best on these sequences
        (``inf`` if some sequence is impossible under the HMM).
        """
        return float(self.per_token_nll(x).mean())

    def entropy_rate_estimate(
        self,
        length: int = 256,
        num_sequences: int = 256,
        burn_in: int = 0,
        generator: torch.Generator | None = None,
    ) -> EntropyEstimate:
        """Monte-Carlo estimate of the entropy rate ``lim_T H(X_{1:T}) / T`` (nats per token).

        Samples ``num_sequences`` sequences of ``length`` tokens and averages the exact
        conditional log-loss of the tokens after ``burn_in``:
        ``-(log P(x_{<=T}) - log P(x_{<=burn_in})) / (T - burn_in)``. Its expectation is
        ``H(X_{b+1:T} | X_{<=b}) / (T - b)``, an upper bound that decreases to the entropy rate as
        ``b`` grows (for a stationary chain); the standard error is over sequences.
        """
        if not 0 <= burn_in < length:
            raise ConfigError(f"need 0 <= burn_in < length, got burn_in={burn_in}, length={length}")
        if num_sequences < 2:
            raise ConfigError("entropy_rate_estimate needs num_sequences >= 2 for a standard error")
        _, x = self.sample(num_sequences, length, generator=generator)
        prefix = self._forward(x)[0]
        tail = prefix[:, -1] - (prefix[:, burn_in - 1] if burn_in > 0 else 0.0)
        nll = -tail / (length - burn_in)
        return EntropyEstimate(float(nll.mean()), float(nll.std() / math.sqrt(num_sequences)),
                               num_sequences, length)

    # ------------------------------------------------------------------ joint law and brute force
    def log_joint(self, z: ArrayLike, x: ArrayLike) -> torch.Tensor:
        """``log P(Z = z, X = x) = log lam[z_1] + sum log A[z_t, z_{t+1}] + sum log B[z_t, x_t]``.

        ``z`` and ``x`` of the same shape ``[T]`` or ``[N, T]``.
        """
        xb, single = self.check_x(x)
        zb = torch.as_tensor(z).detach().to(self.device, torch.long)
        zb = zb[None] if zb.ndim == 1 else zb
        if zb.shape != xb.shape:
            raise MalformedSequenceError(f"z has shape {tuple(zb.shape)} but x has {tuple(xb.shape)}")
        if zb.numel() and (zb.min() < 0 or zb.max() >= self.num_states):
            raise UnknownTokenError(f"hidden states must lie in [0, {self.num_states})")
        out = self._log_joint(zb, xb)
        return out[0] if single else out

    def _log_joint(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if z.shape[1] == 0:
            return torch.zeros(z.shape[0], dtype=DTYPE, device=self.device)
        out = self.log_lam[z[:, 0]] + self.log_B[z, x].sum(-1)
        if z.shape[1] > 1:
            out = out + self.log_A[z[:, :-1], z[:, 1:]].sum(-1)
        return out

    def brute_force_log_prob(self, x: ArrayLike, limit: int = 1_000_000) -> torch.Tensor:
        """``log P(x)`` by summing ``P(z, x)`` over all ``|Omega|^T`` hidden paths (Def 2.2), for tests.

        Raises :class:`TooLargeToEnumerateError` when ``|Omega|^T`` exceeds ``limit``.
        """
        xb, single = self.check_x(x)
        N, T = xb.shape
        S = self.num_states
        if S**T > limit:
            raise TooLargeToEnumerateError(
                f"brute force over |Omega|^T = {S}^{T} = {S**T} hidden paths exceeds limit={limit}; "
                "use log_prob (the forward algorithm) instead"
            )
        if T == 0:
            out = torch.zeros(N, dtype=DTYPE, device=self.device)
            return out[0] if single else out
        paths = torch.tensor(list(itertools.product(range(S), repeat=T)), dtype=torch.long, device=self.device)
        out = torch.full((N,), _NEG_INF, dtype=DTYPE, device=self.device)
        chunk = max(1, 2**20 // max(1, N * max(T, 1)))
        for start in range(0, paths.shape[0], chunk):
            p = paths[start : start + chunk]  # [P, T]
            P = p.shape[0]
            lj = self._log_joint(p[None].expand(N, P, T).reshape(N * P, T),
                                 xb[:, None].expand(N, P, T).reshape(N * P, T)).reshape(N, P)
            out = torch.logsumexp(torch.cat([out[:, None], lj], dim=1), dim=1)
        return out[0] if single else out

    # ------------------------------------------------------------------ sampling
    @per_token
    def sample(
        self, num_sequences: int, length: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw ``(hidden, observed)``, both LongTensors ``[num_sequences, length]`` (Def 2.2).

        Vectorised over sequences (one categorical draw per time step for all rows).
        """
        if num_sequences < 0 or length < 0:
            raise ConfigError(f"num_sequences and length must be >= 0, got {num_sequences}, {length}")
        N, T = int(num_sequences), int(length)
        z = torch.empty(N, T, dtype=torch.long, device=self.device)
        if N == 0 or T == 0:
            return z, torch.empty(N, T, dtype=torch.long, device=self.device)
        z[:, 0] = torch.multinomial(self.lam.expand(N, -1), 1, replacement=True, generator=generator)[:, 0]
        for t in range(1, T):
            z[:, t] = torch.multinomial(self.A[z[:, t - 1]], 1, generator=generator)[:, 0]
        x = torch.multinomial(self.B[z.reshape(-1)], 1, generator=generator).reshape(N, T)
        return z, x

    # ------------------------------------------------------------------ backward algorithm
    def backward(self, x: ArrayLike) -> torch.Tensor:
        """Backward messages ``log beta_t(z) = log P(x_{t+1} .. x_{T-1} | Z_t = z)``: ``[(N,) T, |Omega|]``.

        The right-to-left twin of the forward algorithm (3.1), in log space:
        ``beta_{T-1} = 1``, ``beta_t(z) = sum_{z'} A[z, z'] B[z', x_{t+1}] beta_{t+1}(z')``, so
        ``P(x) = sum_z lam[z] B[z, x_0] beta_0(z)``. ``-inf`` (never NaN) where the rest of x
        cannot follow ``Z_t = z``. ``O(N T |Omega|^2)``.
        """
        xb, single = self.check_x(x)
        N, T = xb.shape
        out = torch.zeros(N, T, self.num_states, dtype=DTYPE, device=self.device)
        log_B_T = self.log_B.T  # [K, S]
        for t in range(T - 2, -1, -1):
            nxt = log_B_T[xb[:, t + 1]] + out[:, t + 1]  # [N, S']: log B[z', x_{t+1}] + log beta_{t+1}(z')
            out[:, t] = torch.logsumexp(self.log_A[None] + nxt[:, None, :], dim=-1)
        return out[0] if single else out

    # ------------------------------------------------------------------ the Pyro program (Def 2.2)
    def program_length(self, x: ArrayLike | None, length: int | None) -> int:
        """T from ``x [T]`` or ``length`` (checked; x must be one sequence)."""
        if x is None:
            return checks.generation_length(length)
        xb, single = self.check_x(x)
        if not single:
            raise MalformedSequenceError(
                f"the HMM program observes one sequence x [T], got shape {tuple(xb.shape)}; "
                "batch sequences with an outer loop or use log_prob for exact batched answers")
        T = xb.shape[1]
        if length is not None and int(length) != T:
            raise ConfigError(f"length={length} but x has {T} observations")
        return T

    def __call__(self, x: ArrayLike | None = None, length: int | None = None) -> dict:
        """Run the HMM as one Pyro trace: ``hmm(x)`` observes ``x [T]``, ``hmm(length=T)`` generates.

        Sites ``z_0 .. z_{T-1}`` and ``x_0 .. x_{T-1}`` (see the class docstring for shapes);
        returns the final state ``{"z": Z_{T-1}}``.
        """
        return run_whole(self, x=x, length=length)

    @per_token
    def init(self, state: dict, x: ArrayLike | None = None, length: int | None = None) -> None:
        """Check x / length and set ``max_steps = T`` (``1`` for T = 0: one empty step); samples nothing.

        ``max_steps`` is per call (T depends on x), so read it after ``init``, as
        :func:`~ppl_thought.program.run_whole` does.
        """
        self.max_steps = max(1, self.program_length(x, length))

    @per_token
    def step(self, state: dict, t: int, x: ArrayLike | None = None, length: int | None = None) -> torch.Tensor | None:
        """Step t of Def 2.2: ``z_t ~ lam`` (t = 0) or ``A[z_{t-1}]``, then ``x_t ~ B[z_t]`` (observed if x given).

        Returns all-True finished flags ``[n]`` at ``t = T - 1`` (immediately, sampling nothing,
        when T = 0), else None.
        """
        T = len(x) if x is not None else int(length)
        if t >= T:
            return all_done(self.device)
        z = pyro.sample(f"z_{t}", dist.Categorical(logits=prior_logits(self, state, t)))
        state["z"] = z
        emit = dist.Categorical(logits=self.log_B[z])
        obs = None
        if x is not None:
            obs = torch.as_tensor(x[t]).to(self.device, torch.long).expand(emit.batch_shape)
        pyro.sample(f"x_{t}", emit, obs=obs)
        return all_done(self.device) if t == T - 1 else None

    def observation_ids(
        self, projection: Product, observable_tokens: list[str] | None = None
    ) -> torch.Tensor:
        """The vocabulary id of each observation index in a product projection's vocabulary: ``[|Sigma|]``.

        ``observation_ids(product)[x]`` turns an index sequence x into the id sequence that the
        slow-thinking model of :func:`~ppl_thought.models.hmm_lifting.slow_thinking_parts` observes (pass the same
        ``observable_tokens`` as there if you overrode them).
        """
        names = self.observable_tokens if observable_tokens is None else list(observable_tokens)
        return torch.tensor([projection.vocab.id(a) for a in names], dtype=torch.long)
