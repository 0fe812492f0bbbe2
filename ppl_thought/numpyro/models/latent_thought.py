"""Latent Thought Models as a NumPyro program (latent-thought-models.txt, Sec 2.1, Eq. 1 and 4).

The generative program, as ``pt.models.LatentThought`` on the torch side::

    z = (z_1, ..., z_L) ~ N(0, I),        z_l in R^{N_z x d_latent} cross-attended by decoder layer l
    x_n | z, x_{n-k:n-1} ~ Categorical(softmax(f_beta(x_{n-k:n-1}, z)))       (Eq. 1, window k)

The decoder f_beta is a :class:`ppl_thought.numpyro.lm.Transformer` with ``cross_attention=True`` (and
optionally a window) over ``vocab_size + 1`` ids: the extra id ``vocab_size`` is the begin-of-sequence
input, never a target (the next-token softmax runs over the ``vocab_size`` real ids only). The torch
model's decoder checkpoint (``ltm.decoder.save(path)``) loads here with ``ptn.lm.Transformer.load(path)``.

Posterior sampling of z (Eq. 4): ``numpyro.infer.MCMC(ptn.infer.MALA(ltm.model), ...)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from ppl_thought.checks import integer, optional_integer
from ppl_thought.errors import MalformedSequenceError
from ppl_thought.numpyro.boundary import Array, as_array, checked_jax
from ppl_thought.numpyro.lm.transformer import Transformer

__all__ = ["LatentThought"]


@checked_jax
class LatentThought:
    """A Latent Thought Model: z ~ N(0, I) per sequence, x | z by a cross-attending decoder (Sec 2.1).

    Args:
        decoder: a cross-attention :class:`~ppl_thought.numpyro.lm.Transformer` with ``vocab_size + 1``
            ids (the last one is ``<bos>``), e.g. ``ptn.lm.Transformer.load`` of ``pt``'s ``ltm.decoder``.
        n_z: latent vectors per decoder layer (N_z of Sec 2.4); z has shape ``[n_layers, n_z, d_latent]``.
        pad_id: if set, positions holding it are padding (not scored) unless an explicit mask is given.
    """

    def __init__(self, decoder: Transformer, n_z: int, pad_id: int | None = None):
        n_z, pad_id = integer("n_z", n_z), optional_integer("pad_id", pad_id, minimum=0)
        if not decoder.cross_attention:
            raise MalformedSequenceError("a LatentThought decoder needs cross_attention=True")
        if n_z < 1:
            raise MalformedSequenceError(f"n_z (latent vectors per layer) must be >= 1, got {n_z}")
        self.decoder, self.n_z, self.pad_id = decoder, n_z, pad_id
        self.vocab_size = decoder.vocab_size - 1
        self.bos_id = self.vocab_size
        self.params = decoder.params

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(n_layers, n_z, d_latent)``: the event shape of z."""
        return (self.decoder.n_layers, self.n_z, self.decoder.d_latent)

    def _mask(self, tokens: jax.Array, mask: jax.Array | None) -> jax.Array:
        tokens = as_array("tokens", tokens, where="LatentThought")
        mask = None if mask is None else as_array("mask", mask, where="LatentThought")
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.shape[1] < 1:
            raise MalformedSequenceError(f"tokens must be an integer array [B, N] with N >= 1, got "
                                         f"{tokens.dtype} {tuple(tokens.shape)}")
        if mask is None:
            return tokens != self.pad_id if self.pad_id is not None else jnp.ones(tokens.shape, bool)
        if mask.shape != tokens.shape:
            raise MalformedSequenceError(f"mask shape {tuple(mask.shape)} != tokens shape {tuple(tokens.shape)}")
        return mask.astype(bool)

    def token_log_probs(self, params: Any, tokens: Array, z: Array, mask: Array | None = None) -> jax.Array:
        """log p(x_n | z, x_{<n}) per position ``[B, N]`` (Eq. 1), teacher-forced from ``<bos>``; padding gives 0.

        ``tokens [B, N]``, ``z [B, n_layers, n_z, d_latent]`` (B may be 1 in z)."""
        mask = self._mask(tokens, mask)
        B, N = tokens.shape
        tokens = jnp.where(mask, tokens, 0)
        inputs = jnp.concatenate([jnp.full((B, 1), self.bos_id, tokens.dtype), tokens[:, :-1]], axis=1)
        log_probs, _ = self.decoder.apply(params, self.decoder.init_cache(B, N), inputs, latents=z)
        # renormalise over the real ids: <bos> is an input only (the torch model's softmax over vocab_size)
        log_probs = jax.nn.log_softmax(log_probs[..., :self.vocab_size], axis=-1)
        lp = jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]
        return jnp.where(mask, lp, 0.0)

    def log_likelihood(self, params: Any, tokens: Array, z: Array, mask: Array | None = None) -> jax.Array:
        """log p_beta(x | z) = sum_n log p(x_n | z, x_{n-k:n-1}) (Eq. 1) per sequence ``[B]``."""
        return self.token_log_probs(params, tokens, z, mask).sum(-1)

    def model(self, tokens: Array, mask: Array | None = None) -> Any:
        """The NumPyro program: ``z ~ N(0, I)`` (site ``"z"``, event ``[L, N_z, d]``) per sequence in the plate
        ``"sequences"``, and the observed site ``"x"``: log p(x | z) of Eq. 1 over the sequence, masked by
        padding, as a factor-like categorical sequence. The decoder is fixed (its ``params``)."""
        mask = self._mask(tokens, mask)
        B = tokens.shape[0]
        with numpyro.plate("sequences", B):
            z = numpyro.sample("z", dist.Normal(jnp.zeros(self.latent_shape), 1.0).to_event(3))
            numpyro.sample("x", _Sequence(self, z, mask), obs=tokens)
        return z


class _Sequence(dist.Distribution):
    """p(x | z) of one token sequence per batch row (Eq. 1): ``log_prob`` only (observed site)."""

    def __init__(self, ltm: LatentThought, z: jax.Array, mask: jax.Array):
        self.ltm, self.z, self.mask = ltm, z, mask
        super().__init__(batch_shape=z.shape[:-3], event_shape=mask.shape[-1:])

    @property
    def support(self):
        return dist.constraints.integer_interval(0, self.ltm.vocab_size - 1)

    def log_prob(self, value: jax.Array) -> jax.Array:
        return self.ltm.log_likelihood(self.ltm.params, value, self.z, self.mask)
