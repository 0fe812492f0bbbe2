"""KVCache.with_room: a hint of the positions still to come sizes the buffers of gathers and reallocations; the
values never depend on it (bitwise equal logits with and without it, also past the hint)."""

from __future__ import annotations

import torch

from ppl_thought.lm import Transformer
from ppl_thought.lm.base import with_room


def _run(cache, model, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        tok = torch.randint(2, model.vocab_size, (cache.batch_size, 1), generator=g)
        logits, cache = model(tok, cache=cache)
        out.append(logits)
        if i == 2:
            cache = cache.reorder(torch.tensor([1, 0, 0]))
    return torch.cat(out, 1), cache


def test_a_room_hint_sizes_buffers_and_never_changes_values():
    torch.manual_seed(0)
    model = Transformer(8, d_model=16, n_layers=2, n_heads=2).eval()
    with torch.no_grad():
        _, prompt = model(torch.tensor([[1, 3, 4]]))
        plain = prompt.expand(3)
        hinted = with_room(prompt, 4)
        assert prompt.room is None and hinted.room == 4 and hinted is not prompt
        small = hinted.expand(3)
        assert small._storage.capacity == 3 + 4 and plain._storage.capacity == 3 + 64
        a, ca = _run(plain, model, 9)  # 9 > 4 appends: past the hint the buffers grow as without one
        b, cb = _run(small, model, 9)
    assert torch.equal(a, b)
    assert ca.length == cb.length == 12 and cb.room == 0
    assert with_room(None, 3) is None  # a cache without the method (or none) is left as it is
