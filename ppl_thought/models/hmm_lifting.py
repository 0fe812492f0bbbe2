"""Theorem 2.3 (proof in App. E.2): every HMM is ``Proj # P_f`` with a bigram latent model.

Latent tokens are pairs ``(x, z)`` of an observation and a hidden state (Example 2.2, the
:class:`~ppl_thought.projections.Product` projection), Proj keeps the observation, and the latent model
is the Markov chain of the pairs, an exact :class:`~ppl_thought.lm.Tabular` bigram LM.
"""

from __future__ import annotations

import torch

from ppl_thought.lm.tabular import Tabular
from ppl_thought.models.hmm import DTYPE, HMM
from ppl_thought.models.slow_thinking import SlowThinking
from ppl_thought.projections.product import Product
from ppl_thought.validation import checked
from ppl_thought.vocab import BOS_ID

__all__ = ["hmm_as_slow_thinking", "slow_thinking_parts"]


@checked
def slow_thinking_parts(hmm: HMM, observable_tokens: list[str] | None = None, hidden_names: list[str] | None = None,
                        sep: str = "|", trainable: bool = False) -> tuple[Product, Tabular]:
    """The HMM as ``Proj # P_f`` with a bigram latent prior (Theorem 2.3, proof in App. E.2).

    Returns ``(projection, prior)``: ``projection = Product.build(observable, hidden, sep)``
    (Example 2.2: latent tokens are the pairs ``f"{a}{sep}{g}"`` of an observation ``a`` and a
    hidden state ``g``; Proj keeps ``a``) and ``prior``, an exact order-2
    :class:`~ppl_thought.lm.tabular.Tabular` LM over the product vocabulary whose next-token
    law is the Markov chain of the pairs:

    - after ``<bos>``: ``P((a, g)) = lam[g] B[g, a]``;
    - after ``(a, g)``: ``P((a', g')) = A[g, g'] B[g', a']`` (it does not depend on ``a``).

    (The formula for P^O printed in App. E.2 is garbled; these are the laws the proof needs.)
    Every other next token (observable-only tokens, specials, impossible pairs) has logit
    ``-inf``. Contexts that never occur (observable-only tokens, specials other than ``<bos>``)
    get the ``<bos>`` row, so no row is all ``-inf`` and nothing becomes NaN. Hence
    ``Proj # P = P_{A,B,lam}``: summing the prior over the lifting of x gives the forward
    algorithm's ``P(x)``.

    Names default to the ones given to the HMM at construction.
    """
    obs = hmm.check_names(observable_tokens, hmm.num_observations, "x", "observable_tokens") \
        if observable_tokens is not None else list(hmm.observable_tokens)
    hid = hmm.check_names(hidden_names, hmm.num_states, "h", "hidden_names") \
        if hidden_names is not None else list(hmm.hidden_names)
    product = Product.build(list(obs), list(hid), sep=sep)
    V = len(product.vocab)
    pair = torch.tensor([[product.pair_id(a, g) for g in hid] for a in obs], dtype=torch.long)  # [K, S]
    K, S = pair.shape
    logits = torch.full((V, V), float("-inf"), dtype=DTYPE)
    # row (a, g), column (a', g'): log A[g, g'] + log B[g', a']   (independent of a)
    step = hmm.log_A[:, :, None] + hmm.log_B[None, :, :]  # [g, g', a']
    rows = pair[:, :, None, None].expand(K, S, K, S)  # (a, g, a', g')
    cols = pair[None, None, :, :].expand(K, S, K, S)
    vals = step.permute(0, 2, 1)[None].expand(K, S, K, S)  # [a, g, a', g'] <- step[g, g', a']
    logits[rows.reshape(-1), cols.reshape(-1)] = vals.reshape(-1)
    logits[BOS_ID, pair.reshape(-1)] = (hmm.log_lam[None, :] + hmm.log_B.T).reshape(-1)
    never = torch.isneginf(logits).all(dim=-1)
    logits[never] = logits[BOS_ID].clone()
    prior = Tabular(2, V, logits.to(torch.get_default_dtype()), trainable=trainable)
    return product, prior


@checked
def hmm_as_slow_thinking(hmm: HMM, **kwargs) -> SlowThinking:
    """The HMM as ``pt.models.SlowThinking(prior, projection)`` (Theorem 2.3) from :func:`slow_thinking_parts`
    (``kwargs`` go there); its exact marginal likelihood is the forward algorithm's P(x)."""
    projection, prior = slow_thinking_parts(hmm, **kwargs)
    return SlowThinking(prior, projection)
