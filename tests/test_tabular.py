"""The Tabular n-gram LM's ragged (``valid``) feeding against feeding each row's valid tokens alone."""

import pytest
import torch

from ppl_thought.lm import Tabular


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 4])
def test_valid_feeding_equals_feeding_only_the_valid_tokens(order, T):
    g = torch.Generator().manual_seed(order * 10 + T)
    V, B = 6, 32
    lm = Tabular(order, V, torch.randn((V,) * order, generator=g), trainable=False)
    prefix = torch.randint(2, V, (B, 2), generator=g)
    tokens = torch.randint(2, V, (B, T), generator=g)
    valid = torch.rand(B, T, generator=g) < 0.6
    _, cache = lm(prefix)
    logits, after = lm(tokens, cache=cache, valid=valid)
    for b in range(B):
        ctx_logits, c = lm(prefix[b : b + 1])
        last = ctx_logits[0, -1]
        for i in range(T):
            if valid[b, i]:
                out, c = lm(tokens[b : b + 1, i : i + 1], cache=c)
                last = out[0, -1]
            # an invalid token leaves the context: its logits are those of the unchanged context
            torch.testing.assert_close(logits[b, i], last)
        torch.testing.assert_close(after.context[b], c.context[0])


def test_a_table_too_large_for_memory_is_refused_before_allocating():
    """Found by the public sweep: Tabular(10**5, 10**5) reached torch's 'Storage size calculation overflowed'.
    A table larger than 2^60 entries, or than the free memory, is a ConfigError naming the sizes, before any
    allocation (the check takes no time)."""
    import time

    from ppl_thought.errors import ConfigError

    t = time.perf_counter()
    with pytest.raises(ConfigError, match="100000\\^100000"):
        Tabular(10**5, 10**5)
    with pytest.raises(ConfigError, match="more than 2\\^60"):
        Tabular(4, 10**5)  # 10^20 logits: about 2^66
    with pytest.raises(ConfigError, match="GiB"):
        Tabular(3, 10**5)  # 10^15 float32 logits: 3.6 PiB, more than any machine has free
    assert time.perf_counter() - t < 1.0
    assert Tabular(2, 5).logits.shape == (5, 5)
