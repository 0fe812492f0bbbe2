"""Transformer and KVCache: cached decoding equals recomputation, windows, latents, checkpoints, errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

import ppl_thought.io as ptio
from ppl_thought.errors import MalformedSequenceError, UnknownTokenError
from ppl_thought.lm import KVCache, Transformer
from ppl_thought.lm.base import LMCache
from ppl_thought.lm.base import step as protocol_step

V, D, L, H, NZ = 11, 16, 2, 2, 3
ATOL = 1e-5

# name -> (constructor options, latents: None | "layer" ([B, L, N_z, d_latent]) | "shared" ([B, N_z, d_latent]))
CASES = {
    "plain": ({}, None),
    "window": ({"window": 3}, None),
    "cross_layer": ({"cross_attention": True, "d_latent": 6}, "layer"),
    "cross_shared": ({"cross_attention": True}, "shared"),
    "window_cross": ({"window": 4, "cross_attention": True}, "layer"),
}
GRAD_MODES = {"no_grad": torch.no_grad, "grad": torch.enable_grad, "inference": torch.inference_mode}


def make_model(seed: int = 0, n_layers: int = L, max_len: int = 64, **options) -> Transformer:
    """A tiny model with weights large enough that every token visibly moves the logits."""
    torch.manual_seed(seed)
    model = Transformer(V, d_model=D, n_layers=n_layers, n_heads=H, max_len=max_len, **options).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.4)
    return model


def make_latents(model: Transformer, kind: str | None, batch: int, seed: int = 1) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(seed)
    if kind == "layer":
        return torch.randn(batch, model.n_layers, NZ, model.d_latent, generator=g)
    if kind == "shared":
        return torch.randn(batch, NZ, model.d_latent, generator=g)
    return None


def setup(case: str, batch: int = 3, T: int = 13, seed: int = 0):
    options, kind = CASES[case]
    model = make_model(seed, **options)
    tokens = torch.randint(V, (batch, T), generator=torch.Generator().manual_seed(seed + 7))
    return model, tokens, make_latents(model, kind, batch)


def decode_in_chunks(model, tokens, latents, sizes, cache=None):
    """Logits of ``tokens`` fed in chunks of ``sizes`` (a size of 1 goes through ``step``)."""
    out, i = [], 0
    for n in sizes:
        if n == 1:
            logits, cache = model.step(tokens[:, i], cache, latents=latents)
            out.append(logits[:, None])
        else:
            logits, cache = model(tokens[:, i:i + n], cache, latents=latents)
            out.append(logits)
        i += n
    assert i == tokens.shape[1]
    return torch.cat(out, dim=1), cache


def assert_close(a, b, atol=ATOL):
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= atol, (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------------------------
# Cached decoding equals recomputation
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("case", CASES)
def test_incremental_decoding_matches_full_forward(case, mode, device):
    model, tokens, latents = setup(case)
    model, tokens = model.to(device), tokens.to(device)
    latents = latents.to(device) if latents is not None else None
    full, full_cache = model(tokens, latents=latents)
    with GRAD_MODES[mode]():
        one_by_one, c1 = decode_in_chunks(model, tokens, latents, [1] * 13)
        chunks, c2 = decode_in_chunks(model, tokens, latents, [2, 1, 5, 1, 4])
    assert_close(one_by_one, full)
    assert_close(chunks, full)
    assert c1.length == c2.length == full_cache.length == 13
    window = model.window
    expected_cached = 13 if window is None else window - 1  # a window cache keeps only what it needs
    for cache in (c1, c2, full_cache):
        assert cache.num_cached == expected_cached
        assert cache.keys[0].shape == (3, H, expected_cached, D // H) == cache.values[-1].shape


@pytest.mark.parametrize("case", CASES)
def test_batched_equals_rows_computed_separately(case):
    model, tokens, latents = setup(case, batch=4)
    with torch.no_grad():
        full, _ = model(tokens, latents=latents)
        chunked, _ = decode_in_chunks(model, tokens, latents, [6, 1, 6])
        for b in range(4):
            row_latents = None if latents is None else latents[b:b + 1]
            row, _ = model(tokens[b:b + 1], latents=row_latents)
            assert_close(full[b:b + 1], row)
            assert_close(chunked[b:b + 1], row)


@pytest.mark.parametrize("mode", ["no_grad", "grad"])
@pytest.mark.parametrize("case", CASES)
def test_reorder_and_expand_continue_like_recomputation(case, mode):
    model, tokens, latents = setup(case, batch=3, T=12)
    prefix = tokens[:, :7]
    for how, index in (("reorder", torch.tensor([2, 0, 0, 1, 2])),
                       ("expand", torch.arange(3).repeat_interleave(2))):
        with GRAD_MODES[mode]():
            _, cache = model(prefix, latents=latents)
            cache = cache.reorder(index) if how == "reorder" else cache.expand(2)
            assert cache.batch_size == len(index) and cache.length == 7
            new_latents = None if latents is None else latents[index]
            cont = torch.randint(V, (len(index), 5), generator=torch.Generator().manual_seed(3))
            logits, cache = decode_in_chunks(model, cont, new_latents, [1, 3, 1], cache)
        full, _ = model(torch.cat([prefix[index], cont], dim=1), latents=new_latents)
        assert_close(logits, full[:, 7:])


# ---------------------------------------------------------------------------------------------------------
# Ragged rows: valid=False tokens are skipped (SMC particles waiting at a segment boundary)
# ---------------------------------------------------------------------------------------------------------

RAGGED_CASES = ["plain", "cross_layer", "cross_shared"]  # valid masks need window=None


def random_valid(batch: int, T: int, seed: int, p: float = 0.4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, T, generator=g) >= p


def decode_ragged(model, tokens, valid, latents, sizes, cache=None):
    """Like ``decode_in_chunks`` with a valid mask (a size of 1 goes through ``step``)."""
    out, i = [], 0
    for n in sizes:
        if n == 1:
            logits, cache = model.step(tokens[:, i], cache, latents=latents, valid=valid[:, i])
            out.append(logits[:, None])
        else:
            logits, cache = model(tokens[:, i:i + n], cache, latents=latents, valid=valid[:, i:i + n])
            out.append(logits)
        i += n
    return torch.cat(out, dim=1), cache


def assert_rows_match_recomputation(model, tokens, valid, latents, logits):
    """Each row's logits at its valid steps equal those of the row run alone on its valid tokens."""
    for b in range(tokens.shape[0]):
        if not valid[b].any():
            continue
        row_latents = None if latents is None else latents[b:b + 1]
        ref, _ = model(tokens[b:b + 1, valid[b]], latents=row_latents)
        assert_close(logits[b, valid[b]], ref[0])


@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("case", RAGGED_CASES)
def test_invalid_tokens_are_skipped_like_recomputing_each_row(case, mode):
    for seed in range(3):
        model, tokens, latents = setup(case, batch=5, T=14, seed=seed)
        valid = random_valid(5, 14, seed)
        valid[0] = True  # one row never pauses
        valid[1, :3] = False  # one row starts paused
        with GRAD_MODES[mode]():
            full, c0 = model(tokens, latents=latents, valid=valid)
            steps, c1 = decode_ragged(model, tokens, valid, latents, [1] * 14)
            chunks, c2 = decode_ragged(model, tokens, valid, latents, [3, 1, 1, 5, 2, 1, 1])
            dense_cont, _ = decode_ragged(model, tokens, torch.ones_like(valid), latents, [1] * 14)
        with torch.no_grad():
            for logits in (full, steps, chunks):
                assert torch.isfinite(logits).all()  # unspecified, but never NaN
                assert_rows_match_recomputation(model, tokens, valid, latents, logits)
        for cache in (c0, c1, c2):
            assert cache.length == 14 and cache.ragged
            assert torch.equal(cache.positions, valid.sum(1)) and torch.equal(cache.key_valid, valid)
        assert_close(dense_cont, model(tokens, latents=latents)[0])


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_ragged_cache_continues_densely_and_after_reorder_and_expand(case):
    model, tokens, latents = setup(case, batch=3, T=12, seed=4)
    valid = random_valid(3, 12, 5)
    with torch.no_grad():
        _, cache = decode_ragged(model, tokens[:, :7], valid[:, :7], latents, [4, 1, 1, 1])
        for how, index in (("reorder", torch.tensor([2, 0, 0, 1, 2])),
                           ("expand", torch.arange(3).repeat_interleave(2))):
            c = cache.reorder(index) if how == "reorder" else cache.expand(2)
            assert torch.equal(c.positions, cache.positions[index]) and c.length == 7
            new_latents = None if latents is None else latents[index]
            cont = torch.randint(V, (len(index), 5), generator=torch.Generator().manual_seed(3))
            for cont_valid in (random_valid(len(index), 5, 6), torch.ones(len(index), 5, dtype=torch.bool)):
                logits, _ = decode_ragged(model, cont, cont_valid, new_latents, [1, 3, 1], c)
                all_tokens = torch.cat([tokens[:, :7][index], cont], dim=1)
                all_valid = torch.cat([valid[:, :7][index], cont_valid], dim=1)
                padded = torch.cat([torch.zeros(len(index), 7, V), logits], dim=1)
                mask = all_valid.clone()
                mask[:, :7] = False  # compare only the continuation
                for b in range(len(index)):
                    row_latents = None if new_latents is None else new_latents[b:b + 1]
                    ref, _ = model(all_tokens[b:b + 1, all_valid[b]], latents=row_latents)
                    keep = mask[b][all_valid[b]]
                    assert_close(padded[b, mask[b]], ref[0, keep])
            # valid=None on a ragged cache continues each row at its own position
            logits, _ = model(cont, c, latents=new_latents)
            for b in range(len(index)):
                row_latents = None if new_latents is None else new_latents[b:b + 1]
                row = torch.cat([tokens[index[b], :7][valid[index[b], :7]], cont[b]])[None]
                ref, _ = model(row, latents=row_latents)
                assert_close(logits[b], ref[0, -5:])


@pytest.mark.parametrize("case", CASES)
def test_all_valid_is_the_dense_path(case):
    model, tokens, latents = setup(case)
    with torch.no_grad():
        dense, c_dense = decode_in_chunks(model, tokens, latents, [5, 1, 7])
        ones = torch.ones_like(tokens, dtype=torch.bool)
        same, c_same = decode_ragged(model, tokens, ones, latents, [5, 1, 7])
    assert torch.equal(dense, same)
    assert not c_same.ragged and c_same.key_valid is None and c_same.positions is None
    assert c_dense.num_cached == c_same.num_cached


def test_invalid_tokens_with_a_window_are_refused():
    model, tokens, _ = setup("window")
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[1, 4] = False
    with pytest.raises(NotImplementedError, match="sliding window"):
        model(tokens, valid=valid)
    with pytest.raises(NotImplementedError, match="sliding window"):
        model.step(tokens[:, 0], valid=valid[:, 4])
    model(tokens, valid=torch.ones_like(valid))  # all valid is fine
    plain, tokens, _ = setup("plain")
    with pytest.raises(MalformedSequenceError, match="valid"):
        plain(tokens, valid=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(MalformedSequenceError, match="valid"):
        plain(tokens, valid=torch.ones_like(tokens))


@pytest.mark.parametrize("case", CASES)
def test_one_cache_continued_several_ways(case):
    """Caches are values: in-place appends never overwrite what another continuation reads."""
    model, tokens, latents = setup(case, batch=2, T=16)
    a = torch.randint(V, (2, 10), generator=torch.Generator().manual_seed(5))
    b = torch.randint(V, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, base = model(tokens[:, :5], latents=latents)
        _, base = model.step(tokens[:, 5], base, latents=latents)  # now in a buffer with room to append
        la, ca = decode_in_chunks(model, a[:, :4], latents, [1, 1, 2], base)
        lb, cb = decode_in_chunks(model, b[:, :4], latents, [1, 3], base)  # branches from the same point
        la2, _ = decode_in_chunks(model, a[:, 4:], latents, [1, 5], ca)
        lb2, _ = decode_in_chunks(model, b[:, 4:], latents, [1, 1, 4], cb)
        lt, _ = model.step(tokens[:, 6], base, latents=latents)  # the base cache is still intact
    for cont, logits in ((a, torch.cat([la, la2], 1)), (b, torch.cat([lb, lb2], 1))):
        full, _ = model(torch.cat([tokens[:, :6], cont], 1), latents=latents)
        assert_close(logits, full[:, 6:])
    full, _ = model(tokens[:, :7], latents=latents)
    assert_close(lt, full[:, 6])


def test_cache_built_in_inference_mode_continues_under_no_grad():
    model, tokens, _ = setup("plain")
    with torch.inference_mode():
        _, cache = model(tokens[:, :5])
    with torch.no_grad():
        logits, _ = decode_in_chunks(model, tokens[:, 5:], None, [1, 7], cache)
    assert_close(logits, model(tokens)[0][:, 5:])


def test_window_cache_memory_is_bounded():
    model, _, _ = setup("window")
    tokens = torch.randint(V, (2, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = None
        for t in range(60):
            _, cache = model.step(tokens[:, t], cache)
            assert cache.num_cached == min(t + 1, model.window - 1)
            assert cache._storage.capacity <= 2 * model.window
    assert cache.length == 60


# ---------------------------------------------------------------------------------------------------------
# Causality and the window
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_a_token_changes_exactly_the_logits_in_its_receptive_field(case):
    model, tokens, latents = setup(case, batch=1, T=16)
    base, _ = model(tokens, latents=latents)
    reach = model.receptive_field or 10 ** 9
    for p in (0, 5, 9):
        changed = tokens.clone()
        changed[0, p] = (changed[0, p] + 1) % V
        logits, _ = model(changed, latents=latents)
        diff = (logits - base).abs().amax(dim=-1)[0]
        for i in range(16):
            if p <= i < p + reach:
                assert diff[i] > 1e-3, (p, i)  # the model does look there
            else:
                assert diff[i] == 0, (p, i)  # earlier positions, or further back than the window reaches


def test_receptive_field_of_sliding_windows():
    assert make_model(window=4, n_layers=1).receptive_field == 4  # one layer: exactly the last k tokens
    assert make_model(window=4, n_layers=3).receptive_field == 10  # stacked: n_layers * (k - 1) + 1
    assert make_model().receptive_field is None


# ---------------------------------------------------------------------------------------------------------
# Latents
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["cross_layer", "cross_shared", "window_cross"])
def test_gradients_reach_latents_and_match_between_cached_and_full(case):
    model, tokens, latents = setup(case, batch=2)
    targets = torch.roll(tokens, -1, dims=1)

    def nll(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    z = latents.clone().requires_grad_(True)
    nll(model(tokens, latents=z)[0]).backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()
    if z.ndim == 4:  # every layer's latents are read
        assert (z.grad.abs().sum(dim=(0, 2, 3)) > 0).all()
    else:
        assert z.grad.abs().sum() > 0
    z2 = latents.clone().requires_grad_(True)
    nll(decode_in_chunks(model, tokens, z2, [1, 4, 1, 7])[0]).backward()
    assert_close(z2.grad, z.grad)


def test_latents_with_batch_one_are_shared_by_all_rows():
    model, tokens, latents = setup("cross_layer", batch=3)
    one = latents[:1]
    a, _ = model(tokens, latents=one)
    b, _ = model(tokens, latents=one.expand(3, -1, -1, -1))
    assert_close(a, b)


def test_cached_latent_projections_follow_the_latents():
    """Without gradients the cache reuses the latents' keys/values, but never for other latents."""
    model, tokens, z1 = setup("cross_layer", batch=2)
    z2 = z1 + 1.0
    with torch.no_grad():
        _, cache = model(tokens[:, :5], latents=z1)
        same, _ = model.step(tokens[:, 5], cache, latents=z1)
        other, _ = model.step(tokens[:, 5], cache, latents=z2)
        z1_changed = z1.clone()
        _, cache3 = model(tokens[:, :5], latents=z1_changed)
        z1_changed.add_(1.0)  # modified in place: the projections must be recomputed
        changed, _ = model.step(tokens[:, 5], cache3, latents=z1_changed)
    ref_same, _ = model.step(tokens[:, 5], cache, latents=z1)  # with gradients: always recomputed
    ref_other, _ = model.step(tokens[:, 5], cache, latents=z2)
    assert_close(same, ref_same)
    assert_close(other, ref_other)
    assert_close(changed, ref_other)
    assert (same - other).abs().max() > 1e-3


def test_latents_keep_their_gradient_when_continuing_a_cache_built_without_one():
    model, tokens, latents = setup("cross_shared", batch=2)
    z = latents.clone().requires_grad_(True)
    with torch.no_grad():
        _, cache = model(tokens[:, :5], latents=z)  # keeps z's projections, computed without a graph
    logits, _ = model.step(tokens[:, 5], cache, latents=z)
    logits.sum().backward()
    assert z.grad is not None and z.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------
# Parameters and the cache protocol
# ---------------------------------------------------------------------------------------------------------


def test_tied_embeddings_share_storage_and_count_once():
    tied = make_model()
    untied = make_model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()
    assert untied.num_parameters() - tied.num_parameters() == V * D
    assert tied.num_parameters() == sum(p.numel() for p in tied.parameters())
    assert tied.num_parameters(exclude_embeddings=True) == tied.num_parameters() - V * D


def test_defaults():
    model = Transformer(V)
    assert model.d_model == 64 and model.n_layers == 2 and model.n_heads == 4
    assert model.d_ff % 8 == 0 and abs(model.d_ff - 8 * 64 / 3) < 8
    assert model.vocab_size == V
    assert Transformer(V, cross_attention=True).d_latent == 64
    assert Transformer(**model.config()).config() == model.config()


def test_kv_cache_follows_the_lm_protocol():
    model, tokens, _ = setup("plain")
    _, cache = model(tokens[:, :4])
    assert isinstance(cache, LMCache) and isinstance(cache, KVCache)
    assert cache.batch_size == 3 and cache.length == 4
    a, _ = protocol_step(model, tokens[:, 4], cache)
    b, _ = model.step(tokens[:, 4], cache)
    assert_close(a, b)


def test_empty_chunk_changes_nothing():
    model, tokens, _ = setup("plain")
    _, cache = model(tokens[:, :4])
    logits, cache2 = model(tokens[:, :0], cache)
    assert logits.shape == (3, 0, V) and cache2.length == 4
    assert_close(model.step(tokens[:, 4], cache2)[0], model(tokens[:, :5])[0][:, 4])


def test_dropout_only_in_training():
    model = make_model(dropout=0.3)
    tokens = torch.randint(V, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(tokens)[0], model(tokens)[0])
    model.train()
    logits, _ = model(tokens)
    logits.sum().backward()
    assert not torch.equal(logits, model(tokens)[0])


# ---------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"window": 3}, {"cross_attention": True, "d_latent": 6},
                                     {"tie_embeddings": False, "d_ff": 24}])
def test_save_load_round_trip(tmp_path, options):
    model = make_model(**options)
    tokens = torch.randint(V, (2, 9), generator=torch.Generator().manual_seed(0))
    latents = make_latents(model, "layer" if model.cross_attention else None, 2)
    model.save(tmp_path / "ckpt", extra={"step": 3, "note": "hi"})
    loaded = Transformer.load(tmp_path / "ckpt")
    assert loaded.config() == model.config()
    assert torch.equal(loaded(tokens, latents=latents)[0], model(tokens, latents=latents)[0])
    if model.tie_embeddings:
        assert loaded.lm_head.weight is loaded.embed.weight
    state, config, extra = ptio.load_checkpoint(tmp_path / "ckpt")
    assert extra == {"step": 3, "note": "hi"} and config["class"] == "Transformer"
    assert set(state) == set(model.state_dict())


def test_checkpoint_files_are_safetensors_and_json_without_temp_files(tmp_path):
    model = make_model()
    path = model.save(tmp_path / "ckpt")
    first = json.loads((path / "config.json").read_text())["tensors"]["file"]
    make_model(seed=1).save(path)  # overwrite in place
    previous = json.loads((path / "config.json").read_text())["tensors"]["file"]
    model.save(path)  # and again
    header = json.loads((path / "config.json").read_text())
    tensors = header["tensors"]["file"]
    assert first != previous != tensors
    # the tensors file of the previous config is kept (a reader may have just read that config), older
    # ones are gone; ".lock" serialises writers
    assert sorted(os.listdir(path)) == sorted([".lock", "config.json", tensors, previous])
    make_model(seed=2).save(path)
    assert previous not in os.listdir(path) and tensors in os.listdir(path)
    assert tensors.startswith("model.") and tensors.endswith(".safetensors")
    assert header["config"]["vocab_size"] == V
    with safe_open(path / tensors, framework="pt") as f:
        assert "embed.weight" in f.keys() and "lm_head.weight" not in f.keys()  # tied: stored once
        assert json.loads(f.metadata()["ppl_thought.aliases"]) == {"lm_head.weight": "embed.weight"}


def test_interrupted_write_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    model = make_model()
    path = model.save(tmp_path / "ckpt")
    before = {name: (path / name).read_bytes() for name in os.listdir(path)}

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ptio, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        make_model(seed=1).save(path)
    assert {name: (path / name).read_bytes() for name in os.listdir(path)} == before
    with pytest.raises(TypeError):  # not JSON: nothing is written
        ptio.save_checkpoint(tmp_path / "other", model, {"bad": object()})
    assert not (tmp_path / "other").exists()


def test_load_detects_tensors_that_do_not_match_the_config(tmp_path):
    a, b = make_model(seed=0), make_model(seed=1)
    a.save(tmp_path / "a")
    b.save(tmp_path / "b")
    name_a = json.loads((tmp_path / "a" / "config.json").read_text())["tensors"]["file"]
    name_b = json.loads((tmp_path / "b" / "config.json").read_text())["tensors"]["file"]
    os.replace(tmp_path / "b" / name_b, tmp_path / "a" / name_a)
    with pytest.raises(ValueError, match="does not match"):
        Transformer.load(tmp_path / "a")
    with pytest.raises(FileNotFoundError):
        ptio.load_checkpoint(tmp_path / "missing")


def test_checkpoint_of_overlapping_views(tmp_path):
    base = torch.arange(10.0)
    state = {"whole": base, "alias": base, "head": base[:4], "tail": base[6:]}
    ptio.save_checkpoint(tmp_path / "c", state, {})
    loaded, _, _ = ptio.load_checkpoint(tmp_path / "c")
    assert loaded["alias"] is loaded["whole"]
    for name, t in state.items():
        assert torch.equal(loaded[name], t)


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


def test_bad_tokens_are_named():
    model = make_model(max_len=8)
    ok = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(UnknownTokenError, match="-1"):
        model(torch.tensor([[0, -1]]))
    with pytest.raises(UnknownTokenError, match=str(V)):
        model(torch.tensor([[0, V]]))
    with pytest.raises(MalformedSequenceError, match="LongTensor"):
        model(ok.float())
    with pytest.raises(MalformedSequenceError):
        model(ok[0])  # [T] instead of [B, T]
    with pytest.raises(MalformedSequenceError):
        model.step(ok, None)  # step takes [B]
    with pytest.raises(MalformedSequenceError, match="max_len"):
        model(torch.zeros(1, 9, dtype=torch.long))
    _, cache = model(ok)
    with pytest.raises(MalformedSequenceError, match="max_len"):
        model(torch.zeros(2, 6, dtype=torch.long), cache)
    assert model(torch.zeros(2, 5, dtype=torch.int32), cache)[0].shape == (2, 5, V)


def test_bad_cache_is_named():
    model, tokens, _ = setup("plain")
    _, cache = model(tokens[:, :4])
    with pytest.raises(MalformedSequenceError, match="rows"):
        model.step(tokens[:2, 4], cache)
    with pytest.raises(MalformedSequenceError, match="not made by this model"):
        make_model(window=3).step(tokens[:, 4], cache)
    with pytest.raises(MalformedSequenceError, match="KVCache"):
        model.step(tokens[:, 4], object())
    with pytest.raises(MalformedSequenceError):
        cache.reorder(torch.tensor([0.0, 1.0]))
    with pytest.raises(IndexError):
        cache.reorder(torch.tensor([0, 3]))
    with pytest.raises(ValueError):
        cache.expand(0)


def test_bad_latents_are_named():
    model, tokens, latents = setup("cross_layer")
    with pytest.raises(MalformedSequenceError, match="needs latents"):
        model(tokens)
    with pytest.raises(MalformedSequenceError, match="without cross_attention"):
        make_model()(tokens, latents=latents)
    bad = {"wrong n_layers": torch.randn(3, L + 1, NZ, 6), "wrong d_latent": torch.randn(3, L, NZ, 7),
           "wrong batch": torch.randn(2, L, NZ, 6), "integer": torch.zeros(3, L, NZ, 6, dtype=torch.long),
           "no vectors": torch.randn(3, L, 0, 6), "2-D": torch.randn(3, 6)}
    for name, z in bad.items():
        with pytest.raises(MalformedSequenceError, match="latents must be"):
            model(tokens, latents=z)
            pytest.fail(name)
