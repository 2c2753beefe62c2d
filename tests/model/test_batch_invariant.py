"""Batch-invariant mode, piece by piece (bf16, tiny random models): a token's logits computed
alone equal (bitwise) the logits computed with drafts after it, with other sequences and
prompt chunks in the batch, or as the end of a prompt chunk. Also the float32 LM head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leapfrog.attention.metadata import build_attn_meta
from leapfrog.errors import ConfigError
from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.packed import PackedLinear, can_pack, row_tile, row_tiled
from leapfrog.model.runner import ModelRunner, SeqChunk
from tests.conftest import CONFIGS, prompts_of

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory, tokenizer):
    """An MLP 1408 wide: oneDNN's kernel for the 1408-feature down projection rounds a row
    alone differently from 2+ rows, so without the mode this model's logits do depend on the
    batch (measured: k = 7 cases differ)."""
    from leapfrog.demo import save_random_llama
    return save_random_llama(tmp_path_factory.mktemp("wide"), tokenizer, seed=3, hidden_size=128,
                             intermediate_size=1408, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.02)


def _runner(path, dtype=BF16, invariant=True, quantization=None) -> ModelRunner:
    model = load_model(read_checkpoint(path), dtype, torch.device("cpu"), 512, pack=True, quantization=quantization)
    return ModelRunner(model, num_rows=4, max_model_len=512, batch_invariant=invariant)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", [*CONFIGS, "wide", "wide int8"])
def test_token_logits_do_not_depend_on_the_batch(model_dirs, wide_dir, name):
    """("wide int8": an int8 target on leapfrog's int8 op, whose rows are independent by construction.)"""
    if name == "wide int8":
        from leapfrog.model.native_linear import native_int8_supported
        if not native_int8_supported("cpu"):
            pytest.skip("needs leapfrog's int8 op (AVX2 and a C++ compiler)")
    r = _runner(model_dirs[name] if name in CONFIGS else wide_dir, quantization="int8" if "int8" in name else None)
    prompt, other, third = _tokens(40, 0), _tokens(23, 1), _tokens(60, 2)
    r.run([SeqChunk(0, 0, prompt, 0), SeqChunk(1, 0, other, 0)])  # rows 0 and 1 hold a context
    t, c = 17, len(prompt)  # the token under test: t at column c of row 0
    drafts = _tokens(16, 3)
    alone = r.run([SeqChunk(0, c, [t], 1)])[0]
    cases = {
        "with K drafts after it": lambda k: r.run([SeqChunk(0, c, [t] + drafts[:k], k + 1)])[0],
        "with other sequences (decode + verify + prefill chunk)": lambda k: r.run([
            SeqChunk(1, len(other), drafts[:k + 1], k + 1),
            SeqChunk(0, c, [t] + drafts[:k], k + 1),
            SeqChunk(2, 0, third[:20 + k], 1)])[k + 1],
        "as the last token of a prompt chunk": lambda k: r.run([SeqChunk(0, c - k - 1, prompt[c - k - 1:] + [t], 1)])[0],
    }
    for what, logits_of in cases.items():
        for k in (1, 3, 4, 7, 12):
            got = logits_of(k)
            assert torch.equal(got, alone), (what, k, (got - alone).abs().max())
    assert torch.equal(r.run([SeqChunk(0, c, [t], 1)])[0], alone)  # the cache was left as it was


def test_sliding_window_and_gqa_in_invariant_mode(model_dirs):
    """Mistral with a small sliding window: each token sees its own window only."""
    from dataclasses import replace
    r = _runner(model_dirs["mistral"])
    r.model.args = replace(r.model.args, sliding_window=8)
    ctx = _tokens(30, 4)
    r.run([SeqChunk(0, 0, ctx, 0)])
    alone = r.run([SeqChunk(0, 30, [5], 1)])[0]
    batched = r.run([SeqChunk(1, 0, _tokens(12, 5), 1), SeqChunk(0, 30, [5, 6, 7], 3)])
    assert torch.equal(batched[1], alone)
    meta = build_attn_meta([0], [[30, 31]], 4, "cpu", sliding_window=8, per_token=True)
    assert [c for *_, c in meta.token_cols] == [slice(23, 31), slice(24, 32)]


def test_invariant_mode_matches_normal_mode_closely(llama_dir):
    """The mode changes rounding only, not the math."""
    prompt = _tokens(30, 6)
    a = _runner(llama_dir, invariant=True).run([SeqChunk(0, 0, prompt, 5)])
    b = _runner(llama_dir, invariant=False).run([SeqChunk(0, 0, prompt, 5)])
    assert (a - b).abs().max() <= 0.05 * b.abs().max()


def test_tree_mask_columns_in_invariant_mode():
    tree = torch.zeros(1, 3, 8, dtype=torch.bool)
    tree[0, :, :5] = True          # prefix columns 0..4
    tree[0, 0, 5] = True           # node 0 at column 5
    tree[0, 1, [5, 6]] = True      # node 1: child of node 0
    tree[0, 2, [5, 7]] = True      # node 2: another child of node 0
    meta = build_attn_meta([0], [[5, 6, 7]], 4, "cpu", tree_mask=tree, per_token=True)
    cols = [c for *_, c in meta.token_cols]
    assert cols[0] == slice(0, 6) and cols[1] == slice(0, 7)
    assert cols[2].tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert meta.mask is None


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("n_out,n_in", [(96, 64), (64, 1408), (200, 1030)])
def test_row_tiled_linear_rows_equal_alone(dtype, n_out, n_in):
    """Including 1408 input features, where oneDNN takes another kernel for 1 row than for 2+."""
    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    g = torch.Generator().manual_seed(0)
    lin = PackedLinear((torch.randn(n_out, n_in, generator=g) * 0.05).to(dtype), None)
    tiled = row_tiled(lin)
    m0, hi = row_tile(PackedLinear, "PackedLinear", n_out, n_in, dtype, "cpu", False)
    assert (tiled.min_rows, tiled.max_rows) == (m0, hi) and 1 <= m0 <= hi
    x = torch.randn(75, n_in, generator=g).to(dtype)
    alone = torch.cat([tiled(x[i:i + 1]) for i in range(75)])
    for m in (2, 3, 5, 16, 17, 33, 75):
        assert torch.equal(tiled(x[:m]), alone[:m]), m
    assert torch.equal(tiled(x[:6].view(2, 3, n_in)), alone[:6].view(2, 3, n_out))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_row_wise_ops_do_not_depend_on_the_row_count(dtype, llama_dir):
    """rms_norm, RoPE, embedding lookups and the tiled silu*up: row r of an M-row call equals
    the 1-row call (odd widths give vector loops a scalar tail)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(70, 1377 * 2, generator=g) * 3).to(dtype)
    w = (torch.rand(1377 * 2, generator=g) + 0.5).to(dtype)
    model = load_model(read_checkpoint(llama_dir), dtype, torch.device("cpu"), 512, pack=True)
    model.make_batch_invariant()
    layer = model.layers[0]
    layer.act_tile_rows = max(1, 16384 // 1377)
    cos, sin = model.rope_cos[:70].to(dtype), model.rope_sin[:70].to(dtype)
    from leapfrog.model.rope import apply_rope
    ops = {
        "rms_norm": lambda t: F.rms_norm(t, (t.shape[-1],), w, 1e-6),
        "rms_norm fp32": lambda t: F.rms_norm(t.float(), (t.shape[-1],), w.float(), 1e-6),
        "silu*up": layer._silu_mul,
    }
    from leapfrog.model.native_ops import load_native_ops, rms_norm
    if load_native_ops():   # what packed models run eagerly on CPU (model/native_ops.py)
        ops["rms_norm native"] = lambda t: rms_norm(t, w, 1e-6, native=True)
    for name, op in ops.items():
        alone = torch.cat([op(x[i:i + 1]) for i in range(70)])
        for m in (2, 13, 24, 70):
            assert torch.equal(op(x[:m]), alone[:m]), (name, m)
    hd = model.args.head_dim
    q = x[:, :8 * hd].reshape(70, 1, 8, hd)
    rope_alone = torch.cat([apply_rope(q[i:i + 1], cos[i:i + 1, None, None], sin[i:i + 1, None, None])
                            for i in range(70)])
    assert torch.equal(apply_rope(q, cos[:, None, None], sin[:, None, None]), rope_alone)
    assert torch.equal(apply_rope(q, cos[:, None, None], sin[:, None, None], native=True), rope_alone)


def test_model_refuses_padded_metadata_in_invariant_mode(llama_dir):
    r = _runner(llama_dir)
    meta = build_attn_meta([0], [[0, 1]], r.kv.scratch_row, "cpu")
    with pytest.raises(ValueError, match="per-token"):
        r.model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), r.kv, meta)


# ---------------------------------------------------------------------------- float32 logits

@pytest.mark.parametrize("pack", [True, False])
def test_logits_are_float32_accumulated_for_bf16_weights(llama_dir, pack):
    model = load_model(read_checkpoint(llama_dir), BF16, torch.device("cpu"), 512, pack=pack)
    w = model.embed.weight  # tied: the head reads the (bf16) embedding
    ids = torch.tensor([_tokens(12, 9)])
    hidden = model(ids, torch.arange(ids.shape[1])[None]).hidden[0]
    assert hidden.dtype == torch.float32
    logits = model.compute_logits(hidden)
    # the head's rows: float32, or the hidden state rounded to bf16 (the CPU kernel, as on CUDA)
    rows = hidden if model.head is None or model.head.in_dtype == torch.float32 else hidden.to(BF16)
    ref = rows.double() @ w.double().t()
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert not torch.equal(logits, logits.to(BF16).float())  # not rounded to bf16
    # and a bf16-valued hidden state gives exactly the float32 sum of exact bf16 products
    hb = hidden.to(BF16)
    assert torch.allclose(model.compute_logits(hb).double(), hb.double() @ w.double().t(), rtol=1e-6,
                          atol=1e-6 * ref.abs().max().item())


def test_fp16_overflow_is_a_clear_error(llama_dir):
    model = load_model(read_checkpoint(llama_dir), torch.float16, torch.device("cpu"), 512, pack=True)
    with torch.no_grad():
        model.layers[-1].mlp_norm.fill_(1e4)  # the MLP's gate * up overflows fp16's 65504
    ids = torch.tensor([[1, 2, 3]])
    hidden = model(ids, torch.arange(3)[None]).hidden[0]
    with pytest.raises(ConfigError, match="float16 overflow.*bfloat16"):
        model.compute_logits(hidden)


def test_fp16_model_gives_finite_float32_logits(llama_dir, tokenizer):
    model = load_model(read_checkpoint(llama_dir), torch.float16, torch.device("cpu"), 512, pack=True)
    ids = torch.tensor([prompts_of(tokenizer, 1)[0]])
    logits = model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]).hidden[0])
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())


def test_half_precision_head_for_drafts(llama_dir):
    """pack_for_inference(fp32_head=False): the head stays in the weights' dtype (drafts)."""
    model = load_model(read_checkpoint(llama_dir), BF16, torch.device("cpu"), 512)
    model.pack_for_inference(fp32_head=False)
    ids = torch.tensor([_tokens(12, 9)])
    logits = model.compute_logits(model(ids, torch.arange(12)[None]).hidden[0])
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.to(BF16).float())
    model.make_batch_invariant()  # the half head can be row-tiled too
    h = model(ids, torch.arange(12)[None]).hidden[0]
    assert torch.equal(model.compute_logits(h)[3:4], model.compute_logits(h[3:4]))
