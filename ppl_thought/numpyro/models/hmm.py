"""Hidden Markov models (Def 2.2) in JAX: the forward algorithm (3.1) as a ``lax.scan``, the backward messages,
the NumPyro program (whole-trace, and step-wise as a ``ptn.Program``: :meth:`HMM.program`), its step-wise guides
(:class:`HMMGuide`: the exact posterior by the backward messages, the filtering proposal) and Theorem 2.3's
slow-thinking form (torch twins: ppl_thought/models/hmm.py, ppl_thought/guides/hmm.py).

Observations are indices into Sigma (``0 .. |Sigma| - 1``), hidden states indices into Omega. The forward
recursion carries the filtered law P(Z_t | x_{<=t}) and accumulates log P(x_{<=t}) as the sum of the logs of
the one-step normalisers P(x_t | x_{<t}); an impossible observation gives -inf (never NaN) and keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

from ppl_thought.checks import generation_length, integer
from ppl_thought.errors import ConfigError, MalformedSequenceError, UnknownTokenError
from ppl_thought.numpyro.boundary import ArrayLike, Key, as_numpy, checked_jax
from ppl_thought.numpyro.program import Program, observe, particles, sample
from ppl_thought.validation import per_token
from ppl_thought.vocab import BOS_ID

__all__ = ["HMM", "HMMGuide", "HMMGuideProgram", "HMMProgram"]


def _stochastic(name: str, value: ArrayLike, ndim: int, atol: float) -> np.ndarray:
    a = as_numpy(name, value, where="HMM")
    if a.dtype.kind not in "biuf":
        raise ConfigError(f"HMM {name} must hold probabilities (numbers), got dtype {a.dtype}")
    a = a.astype(np.float64)
    if a.ndim != ndim or a.size == 0:
        raise ConfigError(f"HMM {name} must be a non-empty {ndim}-D array, got shape {a.shape}")
    if not np.isfinite(a).all() or (a < 0).any():
        raise ConfigError(f"HMM {name} must hold finite probabilities >= 0")
    sums = a.sum(-1, keepdims=True)
    if (np.abs(sums - 1) > atol).any():
        raise ConfigError(f"HMM {name} must be {'row-stochastic' if ndim == 2 else 'a probability vector'} "
                          "(Def 2.2): a row does not sum to 1")
    return a / sums


def _log(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p)


@checked_jax
class HMM:
    """A hidden Markov model ``(A, B, lam)`` (Def 2.2): ``A [|Omega|, |Omega|]``, ``B [|Omega|, |Sigma|]``,
    ``lam [|Omega|]``. Computations in float32 (JAX's default), in log space where it matters.

    As a NumPyro program ``hmm(x)`` / ``hmm(length=T)``: sites ``z_t ~ Categorical(lam or A[z_{t-1}])`` and
    ``x_t ~ Categorical(B[z_t])`` (observed when x is given), as on the torch side.
    """

    def __init__(self, A: ArrayLike, B: ArrayLike, lam: ArrayLike, *, observable_tokens: Sequence[str] | None = None,
                 hidden_names: Sequence[str] | None = None, atol: float = 1e-6):
        A = _stochastic("A", A, 2, atol)
        if A.shape[0] != A.shape[1]:
            raise ConfigError(f"HMM A must be square, got shape {A.shape}")
        B = _stochastic("B", B, 2, atol)
        if B.shape[0] != A.shape[0]:
            raise ConfigError(f"HMM B must have |Omega| = {A.shape[0]} rows, got shape {B.shape}")
        lam = _stochastic("lam", lam, 1, atol)
        if lam.shape != (A.shape[0],):
            raise ConfigError(f"HMM lam must have shape ({A.shape[0]},), got {lam.shape}")
        self.A_np, self.B_np, self.lam_np = A, B, lam
        self.A, self.B, self.lam = (jnp.asarray(v, jnp.float32) for v in (A, B, lam))
        self.log_A, self.log_B, self.log_lam = (jnp.asarray(_log(v), jnp.float32) for v in (A, B, lam))
        S, K = B.shape
        self.observable_tokens = list(observable_tokens) if observable_tokens else [f"x{i}" for i in range(K)]
        self.hidden_names = list(hidden_names) if hidden_names else [f"h{i}" for i in range(S)]

    @property
    def num_states(self) -> int:
        return self.A.shape[0]

    @property
    def num_observations(self) -> int:
        return self.B.shape[1]

    def _check_x(self, x) -> tuple[jax.Array, bool]:
        a = np.asarray(x)
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise MalformedSequenceError(f"observations x must hold integer indices, got dtype {a.dtype}")
        if a.ndim not in (1, 2):
            raise MalformedSequenceError(f"observations x must be [T] or [N, T], got shape {a.shape}")
        if a.size and (a.min() < 0 or a.max() >= self.num_observations):
            raise UnknownTokenError(f"observations x contain indices outside [0, {self.num_observations})")
        single = a.ndim == 1
        return jnp.asarray(a.reshape(1, -1) if single else a, jnp.int32), single

    # ------------------------------------------------------------------ forward algorithm (3.1)
    def prefix_log_probs(self, x: ArrayLike) -> jax.Array:
        """log P(x_{<=t}) for t = 1..T: ``[T]`` or ``[N, T]``, by the forward recursion (3.1) (``lax.scan``)."""
        xb, single = self._check_x(x)
        out = _forward(self.A, self.B, self.lam, xb)
        return out[0] if single else out

    @per_token
    def log_prob(self, x: ArrayLike) -> jax.Array:
        """log P_{A,B,lam}(x_1 .. x_T) (Def 2.2) by the forward algorithm (3.1); 0 for T = 0, -inf if impossible."""
        xb, single = self._check_x(x)
        out = jnp.zeros(xb.shape[0]) if xb.shape[1] == 0 else _forward(self.A, self.B, self.lam, xb)[:, -1]
        return out[0] if single else out

    def backward(self, x: ArrayLike) -> jax.Array:
        """log beta_t(z) = log P(x_{t+1} .. x_{T-1} | Z_t = z): ``[(N,) T, |Omega|]`` (right-to-left twin of (3.1))."""
        xb, single = self._check_x(x)
        N, T = xb.shape
        lBT = self.log_B.T

        def body(beta, xt1):
            nxt = lBT[xt1] + beta  # [N, S']: log B[z', x_{t+1}] + log beta_{t+1}(z')
            b = jax.scipy.special.logsumexp(self.log_A[None] + nxt[:, None, :], -1)
            return b, b

        last = jnp.zeros((N, self.num_states))
        if T == 0:
            out = jnp.zeros((N, 0, self.num_states))
        else:
            _, outs = jax.lax.scan(body, last, xb[:, 1:].T[::-1])  # beta_{T-2} .. beta_0
            out = jnp.swapaxes(jnp.concatenate([outs[::-1], last[None]], 0), 0, 1)
        return out[0] if single else out

    def log_joint(self, z: ArrayLike, x: ArrayLike) -> jax.Array:
        """log lam[z_1] + sum log A[z_t, z_{t+1}] + sum log B[z_t, x_t], for ``z``, ``x`` of the same shape."""
        xb, single = self._check_x(x)
        zb = jnp.asarray(np.asarray(z).reshape(xb.shape), jnp.int32)
        out = self.log_lam[zb[:, 0]] + self.log_B[zb, xb].sum(-1)
        out = out + self.log_A[zb[:, :-1], zb[:, 1:]].sum(-1)
        return out[0] if single else out

    @per_token
    def sample(self, key: Key | int, num_sequences: int, length: int) -> tuple[jax.Array, jax.Array]:
        """``(hidden, observed)``, int32 ``[num_sequences, length]`` (Def 2.2); one ``lax.scan`` over time.
        ``key``: a PRNG key or an int seed (as the engines' ``rng_key``)."""
        from ppl_thought.numpyro.infer.resampling import prng_key

        key = prng_key(key, "key")
        num_sequences, length = integer("num_sequences", num_sequences), integer("length", length)
        k0, kz, kx = jax.random.split(key, 3)
        z0 = jax.random.categorical(k0, self.log_lam, shape=(num_sequences,))

        def body(z, k):
            z1 = jax.random.categorical(k, self.log_A[z])
            return z1, z1

        _, zs = jax.lax.scan(body, z0, jax.random.split(kz, max(length - 1, 0)))
        z = jnp.concatenate([z0[:, None], zs.T], 1)[:, :length]
        x = jax.random.categorical(kx, self.log_B[z])
        return z, x

    # ------------------------------------------------------------------ the NumPyro program
    def __call__(self, x: ArrayLike | None = None, length: int | None = None) -> Any:
        """Sites ``z_0 .. z_{T-1}`` and ``x_0 .. x_{T-1}`` (Def 2.2 step by step); returns the last hidden state."""
        if x is None and length is None:
            raise ConfigError("give the observations x, or length= to generate")
        xs = None if x is None else self._check_x(x)[0][0]
        T = int(length) if x is None else int(xs.shape[0])
        z = None
        for t in range(T):
            logits = self.log_lam if t == 0 else self.log_A[z]
            z = numpyro.sample(f"z_{t}", dist.Categorical(logits=logits))
            numpyro.sample(f"x_{t}", dist.Categorical(logits=self.log_B[z]), obs=None if xs is None else xs[t])
        return z

    def posterior_guide(self) -> Callable[..., Any]:
        """The exact posterior as a guide, z_t ~ P(z_t | z_{t-1}, x) ∝ A[z_{t-1}, z_t] B[z_t, x_t] beta_t(z_t)
        (backward algorithm): every importance weight equals P(x) of (3.1)."""
        hmm = self

        def guide(x=None, length=None):
            with jax.ensure_compile_time_eval():
                xs = hmm._check_x(x)[0][0]
                beta = hmm.backward(np.asarray(xs))
            z = None
            for t in range(xs.shape[0]):
                prior = hmm.log_lam if t == 0 else hmm.log_A[z]
                z = numpyro.sample(f"z_{t}", dist.Categorical(logits=prior + hmm.log_B[:, xs[t]] + beta[t]))
            return z

        return guide

    # ------------------------------------------------------------------ the step-wise program
    def program(self, x: ArrayLike | None = None, length: int | None = None) -> HMMProgram:
        """Def 2.2 as a :class:`~ppl_thought.numpyro.program.Program` of ``T`` steps (T from x or ``length``), run
        with the observations as its argument: ``ptn.infer.SMC(n).run(hmm.program(x), guide, x)`` (or ``None``
        to generate). x is traced, so new observations of the same length reuse the compiled run; the program
        object is cached per T (a compiled run is keyed by it)."""
        T = self.program_length(x, length)
        cache = self.__dict__.setdefault("_programs", {})
        if T not in cache:
            cache[T] = HMMProgram(self, T)
        return cache[T]

    def program_length(self, x: ArrayLike | None, length: int | None) -> int:
        """T from one sequence ``x [T]`` or ``length`` (checked as on the torch side)."""
        if x is None:
            return generation_length(length)
        if isinstance(x, jax.core.Tracer):
            raise ConfigError("HMM.program(x) reads the length of x: build the program outside jit (the run traces "
                              "x itself)")
        xb, single = self._check_x(x)
        if not single:
            raise MalformedSequenceError(f"the HMM program observes one sequence x [T], got shape {tuple(xb.shape)}; "
                                         "batch sequences with an outer loop or use log_prob for exact answers")
        T = int(xb.shape[1])
        if length is not None and int(length) != T:
            raise ConfigError(f"length={length} but x has {T} observations")
        return T

    # ------------------------------------------------------------------ Theorem 2.3
    def as_slow_thinking_parts(self, sep: str = "|") -> tuple[Any, Any]:
        """``(Product projection, JAX Tabular bigram prior)`` with Proj # P = P_{A,B,lam} (Theorem 2.3, App. E.2):
        after ``<bos>`` P((a, g)) = lam[g] B[g, a]; after (a, g) P((a', g')) = A[g, g'] B[g', a']."""
        from ppl_thought.numpyro.lm.tabular import Tabular
        from ppl_thought.projections.product import Product

        obs, hid = list(self.observable_tokens), list(self.hidden_names)
        product = Product.build(obs, hid, sep=sep)
        V = len(product.vocab)
        pair = np.array([[product.pair_id(a, g) for g in hid] for a in obs])  # [K, S]
        lA, lB, llam = _log(self.A_np), _log(self.B_np), _log(self.lam_np)
        logits = np.full((V, V), -np.inf)
        K, S = pair.shape
        rows = np.broadcast_to(pair[:, :, None, None], (K, S, K, S))  # (a, g, a', g')
        cols = np.broadcast_to(pair[None, None, :, :], (K, S, K, S))
        logits[rows, cols] = lA[None, :, None, :] + lB.T[None, None, :, :]  # log A[g, g'] + log B[g', a']
        logits[BOS_ID, pair.reshape(-1)] = (llam[None, :] + lB.T).reshape(-1)
        never = np.isneginf(logits).all(-1)
        logits[never] = logits[BOS_ID]
        return product, Tabular(2, V, logits.astype(np.float32))


def _forward(A, B, lam, x: jax.Array) -> jax.Array:
    """log P(x_{<=t}) ``[N, T]`` for x ``[N, T]``: the scaled forward recursion (3.1)."""
    N = x.shape[0]
    BT = B.T

    def body(carry, xt):
        prior, log_p = carry
        joint = prior * BT[xt]  # P(Z_t = z, x_t | x_{<t})
        c = joint.sum(-1)
        log_p = log_p + jnp.where(c > 0, jnp.log(jnp.where(c > 0, c, 1.0)), -jnp.inf)
        post = joint / jnp.where(c > 0, c, 1.0)[:, None]
        return (post @ A, log_p), log_p

    _, out = jax.lax.scan(body, (jnp.broadcast_to(lam, (N, lam.shape[0])), jnp.zeros(N)), x.T)
    return out.T



def _backward_log(log_A: jax.Array, log_B: jax.Array, x: jax.Array) -> jax.Array:
    """log beta_t(z) = log P(x_{t+1} .. x_{T-1} | Z_t = z), ``[T, |Omega|]``, for one traced sequence ``x [T]`` (the
    backward recursion, right-to-left twin of (3.1); :meth:`HMM.backward` for concrete batches)."""
    def body(beta, xt1):
        b = jax.scipy.special.logsumexp(log_A + (log_B[:, xt1] + beta)[None, :], -1)
        return b, b

    last = jnp.zeros(log_A.shape[0], log_A.dtype)
    _, outs = jax.lax.scan(body, last, x[1:], reverse=True)  # beta_0 .. beta_{T-2}
    return jnp.concatenate([outs, last[None]], 0)


def _done(t, T: int, n: int) -> jax.Array:
    return jnp.broadcast_to(t >= T - 1, (n,))


@checked_jax
class HMMProgram(Program):
    """Def 2.2 as a step-wise ``ptn.Program`` (torch twin: ``pt.models.HMM``'s ``init`` / ``step``): step t samples
    ``"z" ~ Categorical(lam)`` (t = 0) or ``Categorical(A[z_{t-1}])`` and ``"x" ~ Categorical(B[z_t])``, observed
    ``x[t]`` (an output site when the run's x is ``None``). The torch side names the sites ``z_{t}`` / ``x_{t}``;
    in a compiled run t is traced, so every step has the sites ``"z"`` and ``"x"`` and the engine stacks them:
    ``Result.samples["z"]`` is ``[n, T]``. ``state["z"]``: the current hidden state ``[n]``. The product of the
    steps' densities is :meth:`HMM.log_joint` of the path, so Z = P(x) of the forward algorithm (3.1). T = 0: one
    step that samples nothing and finishes (Z = 1). Build it with :meth:`HMM.program`.
    """

    def __init__(self, hmm: HMM, T: int):
        self.hmm, self.T = hmm, int(T)
        self.max_steps = max(1, self.T)

    @per_token
    def init(self, state: dict, x: ArrayLike | None = None) -> None:
        state["z"] = jnp.zeros(particles(), jnp.int32)

    @per_token
    def step(self, state: dict, t: Any, x: ArrayLike | None = None) -> jax.Array:
        n = particles()
        if self.T == 0:
            return jnp.ones(n, bool)
        h = self.hmm
        z = sample("z", dist.Categorical(logits=jnp.where(t == 0, h.log_lam[None], h.log_A[state["z"]])))
        state["z"] = z
        observe("x", dist.Categorical(logits=h.log_B[z]), None if x is None else jnp.asarray(x)[t])
        return _done(t, self.T, n)

    def __repr__(self) -> str:
        return f"HMMProgram(T={self.T})"


@checked_jax
class HMMGuide:
    """Step-wise guides for :class:`HMM` (torch twin: ``pt.guides.HMMGuide``): proposals of the hidden states
    given the observations, sampling exactly the model's latent sites.

    :meth:`posterior`: ``q(z_t | z_{t-1}) = P(z_t | z_{t-1}, x) ∝ A[z_{t-1}, z_t] B[z_t, x_t] beta_t(z_t)`` (``lam``
    at t = 0; beta the backward messages): the exact posterior, so every weight p(z, x) / q(z) equals P(x) of
    (3.1). :meth:`filtering`: ``q(z_t | z_{t-1}) = P(z_t | z_{t-1}, x_t) ∝ A[z_{t-1}, z_t] B[z_t, x_t]``, the locally
    optimal SMC proposal (incremental weight P(x_t | z_{t-1})). Where nothing explains the observations from
    ``z_{t-1}`` on, both fall back to the prior row (the model's weight is then -inf, never NaN).

    ``guide.program(x)`` is the ``ptn.Program`` for SMC / Importance over :meth:`HMM.program`; ``guide(x)`` the
    whole-trace guide of the whole-trace model ``hmm(x)`` (sites ``z_0 .. z_{T-1}``).
    """

    def __init__(self, hmm: HMM, backward: bool):
        self.hmm, self.backward = hmm, bool(backward)

    @classmethod
    def posterior(cls, hmm: HMM) -> HMMGuide:
        """The exact posterior P(z_t | z_{t-1}, x) (backward algorithm): the zero-variance proposal."""
        return cls(hmm, backward=True)

    @classmethod
    def filtering(cls, hmm: HMM) -> HMMGuide:
        """The locally optimal proposal P(z_t | z_{t-1}, x_t) (the current observation only)."""
        return cls(hmm, backward=False)

    def __repr__(self) -> str:
        return f"HMMGuide({'posterior' if self.backward else 'filtering'})"

    def scores(self, x: jax.Array) -> jax.Array:
        """``log B[:, x_t] (+ log beta_t)`` for each t: ``[T, |Omega|]`` (traceable in x)."""
        x = jnp.asarray(x, jnp.int32)
        score = self.hmm.log_B.T[x]
        return score + _backward_log(self.hmm.log_A, self.hmm.log_B, x) if self.backward else score

    def logits(self, prior: jax.Array, score: jax.Array) -> jax.Array:
        """The proposal's logits from the prior row(s) and a step's score (the prior where nothing explains x)."""
        logits = prior + score
        return jnp.where(jnp.isneginf(logits).all(-1, keepdims=True), prior, logits)

    def program(self, x: ArrayLike | None = None, length: int | None = None) -> HMMGuideProgram:
        """The guide as a ``ptn.Program`` with :meth:`HMM.program`'s steps and latent site ``"z"`` (run with x)."""
        T = self.hmm.program_length(x, length)
        cache = self.__dict__.setdefault("_programs", {})
        if T not in cache:
            cache[T] = HMMGuideProgram(self, T)
        return cache[T]

    def __call__(self, x: ArrayLike | None = None, length: int | None = None) -> jax.Array | None:
        """The whole-trace guide (sites ``z_0 .. z_{T-1}``) of ``hmm(x)``; returns the last hidden state."""
        if x is None:
            raise ConfigError(f"{self!r} proposes hidden states given the observations: call it with x")
        xs = self.hmm._check_x(x)[0][0]
        score = self.scores(xs)
        z = None
        for t in range(xs.shape[0]):
            prior = self.hmm.log_lam if t == 0 else self.hmm.log_A[z]
            z = numpyro.sample(f"z_{t}", dist.Categorical(logits=self.logits(prior, score[t])))
        return z


@checked_jax
class HMMGuideProgram(Program):
    """An :class:`HMMGuide` as a step-wise ``ptn.Program`` (torch twin: ``HMMGuide.init`` / ``step``): ``init`` puts
    the per-step scores of x (``log B[:, x_t]``, plus the backward messages for the posterior) in the state (``[n, T,
    |Omega|]``: state arrays carry the particle axis), step t samples ``"z"`` from the proposal given ``state["z"]``.
    """

    def __init__(self, guide: HMMGuide, T: int):
        self.guide, self.T = guide, int(T)
        self.max_steps = max(1, self.T)

    @per_token
    def init(self, state: dict, x: ArrayLike | None = None) -> None:
        if x is None:
            raise ConfigError(f"{self.guide!r} proposes hidden states given the observations: run it with x")
        n = particles()
        state["z"] = jnp.zeros(n, jnp.int32)
        if self.T:
            score = self.guide.scores(x)
            state["score"] = jnp.broadcast_to(score, (n,) + score.shape)

    @per_token
    def step(self, state: dict, t: Any, x: ArrayLike | None = None) -> jax.Array:
        n = particles()
        if self.T == 0:
            return jnp.ones(n, bool)
        h = self.guide.hmm
        prior = jnp.where(t == 0, h.log_lam[None], h.log_A[state["z"]])
        score = jax.lax.dynamic_index_in_dim(state["score"], t, axis=1, keepdims=False)
        state["z"] = sample("z", dist.Categorical(logits=self.guide.logits(prior, score)))
        return _done(t, self.T, n)

    def __repr__(self) -> str:
        return f"HMMGuideProgram({self.guide!r}, T={self.T})"
