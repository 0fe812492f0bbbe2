"""Hidden Markov models (Def 2.2) in JAX: the forward algorithm (3.1) as a ``lax.scan``, the backward messages,
the NumPyro program and Theorem 2.3's slow-thinking form (torch twin: ppl_thought/models/hmm.py).

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

from ppl_thought.checks import integer
from ppl_thought.errors import ConfigError, MalformedSequenceError, UnknownTokenError
from ppl_thought.numpyro.boundary import ArrayLike, Key, as_numpy
from ppl_thought.vocab import BOS_ID


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

