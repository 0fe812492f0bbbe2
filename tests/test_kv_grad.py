"""A KV cache whose layers differ in being on the autograd graph (a model partly frozen: LoRA on q_proj / v_proj,
frozen embeddings and first layer) gathered with gradients on, then appended without (the sampling loop under
the particle plate of an SVI step). Every layer's new entries must be kept: before the fix, the gather gave spare
room to the layers off the graph only, and an in-place append, checked on layer 0, wrote the other layers' new
entries past their ends (issue 43: a mask [2, 1, 1, 18] for 16 keys inside transformers' sdpa attention)."""

from __future__ import annotations

import torch

from ppl_thought.lm import Transformer
from ppl_thought.lm.kv_cache import KVCache


def test_mixed_gradient_layers_keep_every_new_entry():
    w = torch.ones(1, requires_grad=True)
    new = KVCache.empty(2, None).append(4, 1 << 20)
    new.store(0, torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2))  # layer 0: off the graph
    k1_prompt = torch.randn(1, 1, 4, 2)
    new.store(1, k1_prompt * w, torch.randn(1, 1, 4, 2) * w)  # layer 1: on it
    cache = new.finish(4, None, None).expand(3)
    with torch.no_grad():
        nxt = cache.append(1, 1 << 20)
        k0, v0 = nxt.store(0, torch.full((3, 1, 1, 2), 7.0), torch.full((3, 1, 1, 2), 8.0))
        k1, v1 = nxt.store(1, torch.full((3, 1, 1, 2), 9.0), torch.full((3, 1, 1, 2), 10.0))
        nxt = nxt.finish(1, None, None)
    assert nxt.num_cached == 5
    for t, last in ((k0, 7.0), (v0, 8.0), (k1, 9.0), (v1, 10.0)):
        assert t.shape == (3, 1, 5, 2)
        assert torch.equal(t[:, :, 4], torch.full((3, 1, 2), last))
    assert all(k.shape[2] == 5 for k in nxt.keys) and all(v.shape[2] == 5 for v in nxt.values)
    with torch.enable_grad():
        grads = torch.autograd.grad(cache.keys[1].sum(), w)  # the gathered entries stay on the graph
    torch.testing.assert_close(grads[0], 3 * k1_prompt.sum().reshape(1))


def test_partly_frozen_transformer_decodes_as_a_full_forward():
    """The library's own Transformer with its embeddings and first block frozen: a prompt encoded with gradients,
    expanded to 3 rows, then decoded token by token without gradients gives the logits of one full forward."""
    torch.manual_seed(0)
    model = Transformer(10, d_model=16, n_layers=3, n_heads=2).eval()
    for name, p in model.named_parameters():
        if not name.startswith(("blocks.1", "blocks.2", "layers.1", "layers.2")):
            p.requires_grad_(False)
    assert any(p.requires_grad for p in model.parameters())
    prompt = torch.tensor([[1, 3, 4, 5]])
    _, cache = model(prompt)
    cache = cache.expand(3)
    steps = torch.tensor([[2, 6, 7], [8, 2, 9], [3, 3, 4]])
    with torch.no_grad():
        out = []
        for j in range(steps.shape[1]):
            logits, cache = model(steps[:, j:j + 1], cache=cache)
            out.append(logits[:, 0])
        full, _ = model(torch.cat([prompt.expand(3, -1), steps], 1))
    torch.testing.assert_close(torch.stack(out, 1), full[:, prompt.shape[1]:], rtol=1e-5, atol=1e-5)
