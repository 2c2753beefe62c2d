"""Weight-only int8/int4 quantization (model/quant.py): kernels against the pure reference, the
quantized model against a float model holding the dequantized weights, and the engine options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leapfrog import LLM, SamplingParams
from leapfrog.config import EngineConfig
from leapfrog.errors import ConfigError
from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.native_linear import native_int8_supported
from leapfrog.model.quant import (QUANT_LINEARS, Int4Linear, Int8Linear, check_quantization, int4_group_size,
                                  quantize_int4, quantize_int8, quantized_bytes, reference_weight)
from tests.conftest import prompts_of

CPU = torch.device("cpu")


def _w8a8() -> bool:
    from leapfrog.model.native_linear import w8a8_supported
    return w8a8_supported()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_kernel_matches_reference_weight(method, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 256, generator=g) * 0.05).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(2, rows, 256, generator=g).to(dtype)
    lin = QUANT_LINEARS[method](w, b)
    y = lin(x)
    assert y.shape == (2, rows, 96) and y.dtype == dtype
    ref = F.linear(x.float(), reference_weight(method, w), b.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)


def test_quantization_error_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127  # the largest weight of a row maps to 127
    assert bool(((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all())
    q4, sz = quantize_int4(w, 32)  # sz [G, N, 2]
    assert sz.shape == (4, 64, 2) and int(q4.min()) == 0 and int(q4.max()) == 15
    step = sz[..., 0].t().repeat_interleave(32, dim=1)  # [N, K]
    assert bool(((reference_weight("int4", w, 32) - w).abs() <= step / 2 + 1e-5).all())
    # int4's error is ~16x int8's on the same weights
    assert (reference_weight("int4", w) - w).abs().mean() > 5 * (reference_weight("int8", w) - w).abs().mean()


def test_int4_group_size_and_bytes():
    assert int4_group_size(512) == 32 and int4_group_size(1408) == 32 and int4_group_size(64 * 3) == 32
    with pytest.raises(ConfigError, match="int4 group size"):
        int4_group_size(24)
    w = torch.randn(128, 256)
    assert quantized_bytes(Int8Linear(w, None)) == 128 * 256 + 128 * 4
    assert quantized_bytes(Int4Linear(w, None)) == 128 * 256 // 2 + (256 // 32) * 128 * 2 * 4


def test_check_quantization_refuses_unknown_method():
    check_quantization(None, torch.float32, CPU)
    check_quantization("int8", torch.bfloat16, CPU)
    with pytest.raises(ConfigError, match="must be one of"):
        check_quantization("int3", torch.float32, CPU)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_is_the_dequantized_float_model(llama_dir, method):
    """The loaded quantized model computes what a float model with the reference weights computes."""
    ckpt = read_checkpoint(llama_dir)
    quant = load_model(ckpt, torch.float32, CPU, 64, quantization=method)
    ref = load_model(ckpt, torch.float32, CPU, 64)
    n = 0
    for lq, lr in zip(quant.layers, ref.layers):
        for name in ("wqkv", "wo", "w13", "w2"):
            assert isinstance(getattr(lq, name), QUANT_LINEARS[method])
            lin = getattr(lr, name)
            lin.weight.data = reference_weight(method, lin.weight)
            n += 1
    assert n == 4 * len(ref.layers)
    ids = torch.tensor([[5, 9, 11, 3, 40, 7]])
    pos = torch.arange(6)[None]
    with torch.no_grad():
        hq, hr = quant(ids, pos).hidden, ref(ids, pos).hidden
        unquantized = load_model(ckpt, torch.float32, CPU, 64)(ids, pos).hidden
    torch.testing.assert_close(hq, hr, atol=1e-4, rtol=1e-4)
    assert (hq - unquantized).abs().max() > 1e-3  # quantization did change the model


@pytest.mark.parametrize("quant, spec", [
    ("int8", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
    ("int4", {"method": "draft_model", "model": "self", "draft_quantization": "int4", "num_speculative_tokens": 4}),
    (None, {"method": "draft_model", "model": "self", "draft_quantization": "int8", "num_speculative_tokens": 4}),
    pytest.param("w8a8", {"method": "draft_model", "model": "self", "num_speculative_tokens": 3},
                 marks=pytest.mark.skipif(not _w8a8(), reason="w8a8 needs leapfrog's native CPU kernel")),
    pytest.param(None, {"method": "draft_model", "model": "self", "draft_quantization": "w8a8",
                        "num_speculative_tokens": 3},
                 marks=pytest.mark.skipif(not _w8a8(), reason="w8a8 needs leapfrog's native CPU kernel")),
])
def test_greedy_speculation_on_a_quantized_target_is_lossless(llama_dir, tokenizer, quant, spec):
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 5)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=4, quantization=quant)
    plain = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(speculative_config=spec, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == plain
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0
    if spec["method"] == "draft_model":  # a quantized copy of the target agrees with it most of the time
        assert m["acceptance_rate"] > 0.5


def test_self_draft_shares_the_embedding(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=64, max_num_seqs=2,
              speculative_config={"method": "draft_model", "model": "self", "draft_quantization": "int4",
                                  "num_speculative_tokens": 2})
    draft = llm.engine.proposer.model
    assert draft.embed is llm.engine.model.embed
    assert isinstance(draft.layers[0].w13, Int4Linear) and isinstance(draft.head.proj, Int4Linear)
    assert not isinstance(llm.engine.model.layers[0].w13, (Int4Linear, Int8Linear))  # the target stays float


@pytest.mark.parametrize("kw, match", [
    (dict(quantization="int3"), "quantization='int3'"),
    (dict(quantization="int4", batch_invariant=True), "batch_invariant"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_quantization": "int4"}),
     "draft_quantization applies to methods 'draft_model', 'eagle'"),
    (dict(speculative_config={"method": "draft_model", "model": "self", "num_speculative_tokens": 2,
                              "draft_quantization": "fp8"}), "draft_quantization"),
    (dict(speculative_config={"method": "eagle", "model": "self", "num_speculative_tokens": 2}), "'self'"),
])
def test_bad_quantization_options(llama_dir, kw, match):
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(llama_dir), max_model_len=64, **kw)


def test_engine_config_field():
    assert EngineConfig(model="x", quantization="int4").quantization == "int4"
    with pytest.raises(ConfigError):
        EngineConfig(model="x", quantization=8)


@pytest.mark.parametrize("n_out", [12, 40])
def test_int4_pads_output_features_to_the_kernels_multiple(n_out):
    w = torch.randn(n_out, 64)
    x = torch.randn(3, 64)
    lin = Int4Linear(w, None)
    assert lin.padded == -n_out % 16
    torch.testing.assert_close(lin(x), F.linear(x, reference_weight("int4", w)), atol=1e-4, rtol=1e-4)


def test_int8_batch_invariant_needs_the_row_invariant_op(llama_dir, monkeypatch):
    """batch_invariant=True with int8 runs on leapfrog's int8 op (rows independent of the batch);
    where it cannot serve, a clear error instead of PyTorch's kernel, which is not row-invariant."""
    from leapfrog.model import native_linear
    monkeypatch.setattr(native_linear, "native_int8_supported", lambda device: False)
    with pytest.raises(ConfigError, match="int8 op"):
        LLM(model=str(llama_dir), max_model_len=64, quantization="int8", batch_invariant=True)


@pytest.mark.skipif(not native_int8_supported("cpu"), reason="needs leapfrog's int8 op (AVX2 and a C++ compiler)")
def test_int8_batch_invariant_greedy_alone_equals_batched(llama_dir, tokenizer):
    """An int8 target in batch-invariant mode: each prompt's greedy tokens alone equal those in a
    batch of 5 with speculation (ngram drafts and verification rows in the same forwards)."""
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 5)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=128, max_num_seqs=5, quantization="int8",
              batch_invariant=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1})
    assert isinstance(llm.engine.model.layers[0].w13, Int8Linear) and llm.engine.model.layers[0].w13.row_invariant
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone


# ---------------------------------------------------- w8a8 (AVX2, AVX-512 VNNI or AMX-INT8)

needs_w8a8 = pytest.mark.skipif(not _w8a8(), reason="w8a8 needs leapfrog's native CPU kernel")


def test_pack_w8a8_layout():
    """Block b, k-quad j, column c holds q[32 b + c, 4 j : 4 j + 4]; zeros past N and K (K to 64)."""
    from leapfrog.model.native_linear import pack_w8a8
    q = torch.randint(-127, 128, (40, 70), dtype=torch.int8)
    p = pack_w8a8(q)
    assert p.shape == (2, 32, 32, 4) and p.dtype == torch.int8
    assert torch.equal(p[1, 3, 5], q[37, 12:16]) and torch.equal(p[0, 17, 31], q[31, 68:70].new_tensor(
        [*q[31, 68:70].tolist(), 0, 0]))
    assert not p[1, :, 8:].any() and not p[:, 18:].any()   # columns 40-63, k's 72-127


def test_w8a8_reference_rounds_rows_to_int8():
    """w8a8_reference: each row's scale is max |x| / 127, its values rounded half to even into
    [-127, 127]; an all-zero row gives the bias; the result is within the rows' and the weights'
    rounding of the float product."""
    from leapfrog.model.quant import w8a8_reference
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * 0.05
    q, s = quantize_int8(w)
    x = torch.randn(4, 96, generator=g)
    x[2] = 0
    b = torch.randn(48, generator=g)
    y = w8a8_reference(x, q, s, b, f32_out=True)
    assert torch.equal(y[2], b)
    exact = x @ w.T + b
    # per element: |x| * |w| rounding of both halves (half a step each)
    bound = (x.abs().amax(1, keepdim=True) / 127 / 2) * w.abs().sum(1) + x.abs() @ (s[:, None] / 2).expand(48, 96).T
    assert bool(((y - exact).abs() <= bound + 1e-5).all())
    assert y.dtype == torch.float32 and w8a8_reference(x.bfloat16(), q, s).dtype == torch.bfloat16


def test_w8a8_refused_where_the_kernel_does_not_serve(monkeypatch):
    """Where the w8a8 kernel does not serve, quantization='w8a8' is a ConfigError naming
    what it needs and the weight-only alternative."""
    import leapfrog.model.native_linear as nl
    monkeypatch.setattr(nl, "w8a8_supported", lambda: False)
    with pytest.raises(ConfigError, match="quantization='w8a8'.*AVX2.*use 'int8'"):
        check_quantization("w8a8", torch.bfloat16, CPU)
    with pytest.raises(ConfigError, match="speculative_config.draft_quantization='w8a8'.*AVX2"):
        check_quantization("w8a8", torch.bfloat16, CPU, "speculative_config.draft_quantization")


@needs_w8a8
@pytest.mark.parametrize("n, k", [(96, 256), (33, 200), (1408, 512), (512, 704), (40, 64), (70, 1030)])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 40])
def test_w8a8_kernel_bitwise_reference_and_row_invariant(n, k, rows):
    """linear_w8a8 gives w8a8_reference's bits (bf16 and float32 rows, bias or not, f32_out or not;
    partial blocks of columns, K not a multiple of 64, 1-16 rows in one A tile, 17-32 in two, more
    in passes), and each row the bits it gets alone."""
    from leapfrog.model.native_linear import pack_w8a8
    from leapfrog.model.quant import w8a8_reference
    g = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=g) * 0.05
    q, s = quantize_int8(w)
    p = pack_w8a8(q)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
        for bias in (None, torch.randn(n, generator=g)):
            for f32_out in (False, True):
                y = torch.ops.leapfrog_gemm.linear_w8a8(x, p, s, bias, n, f32_out)
                assert torch.equal(y, w8a8_reference(x, q, s, bias, f32_out)), (dtype, bias is None, f32_out)
                one = torch.ops.leapfrog_gemm.linear_w8a8(x[-1:], p, s, bias, n, f32_out)
                assert torch.equal(one, y[-1:])


def test_w8a8_served_by_the_avx2_build_and_the_avx512_bf16_build_with_amx_int8_or_vnni(monkeypatch):
    """w8a8_supported: the AVX2 build (vpmaddubsw), the AVX-512 BF16 build on the AMX-INT8 tiles or
    else with AVX-512 VNNI; not where bf16 rows run on tiles without AMX-INT8 (the op would take
    them), and not with LEAPFROG_NATIVE_LINEAR=0."""
    import leapfrog.model.native_linear as nl
    monkeypatch.setattr(nl, "load_native_linear", lambda: True)
    # (amx: bf16 rows on the tiles, where the op sums on them too, so a CPU without AMX-INT8 has no w8a8)
    for isa, flags, amx, want in [("avx512_bf16", {"avx512_vnni"}, False, True),
                                  ("avx512_bf16", {"amx_int8"}, True, True),
                                  ("avx512_bf16", {"amx_int8", "avx512_vnni"}, True, True),
                                  ("avx512_bf16", {"avx512_vnni"}, True, False),
                                  ("avx512_bf16", set(), False, False),
                                  ("avx2", {"avx512_vnni"}, False, True),
                                  ("avx2", set(), False, True)]:
        monkeypatch.setitem(nl._STATE, "isa", isa)
        monkeypatch.setattr(nl, "cpu_flags", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(nl, "amx_in_use", lambda amx=amx: amx)
        assert nl.w8a8_supported() is want, (isa, flags, amx)
    monkeypatch.setenv("LEAPFROG_NATIVE_LINEAR", "0")
    assert nl.w8a8_supported() is False


@needs_w8a8
@pytest.mark.parametrize("k", [3, 7, 1030])
def test_w8a8_edge_rows_bitwise_reference(k):
    """K shorter than a vector (the quantization's scalar tail only) and K = 1030 (a tail of 6): a
    NaN or an infinity in the tail makes the row NaN, an all-zero row and a row so small that
    127 / max |x| overflows float32 give the bias (both: scale 0, in the kernel and the reference),
    the other rows their bits; no rows (float32 and bf16) give an empty result."""
    from leapfrog.model.native_linear import pack_w8a8
    from leapfrog.model.quant import w8a8_reference
    g = torch.Generator().manual_seed(k)
    q, s = quantize_int8(torch.randn(40, k, generator=g) * 0.05)
    p, b = pack_w8a8(q), torch.randn(40, generator=g)
    x = torch.randn(6, k, generator=g) * 3
    x[1, -1], x[2, -1] = float("nan"), float("-inf")
    x[3] = 0
    x[4] = torch.linspace(-1, 1, k) * 2e-37   # (127 / 2e-37 overflows: as zeros)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        y = torch.ops.leapfrog_gemm.linear_w8a8(xd, p, s, b, 40, True)
        ref = w8a8_reference(xd, q, s, b, True)
        assert torch.isnan(y[1:3]).all() and torch.isnan(ref[1:3]).all(), dtype
        keep = [0, 3, 4, 5]
        assert torch.equal(y[keep], ref[keep]), dtype
        assert torch.equal(y[3], b) and torch.equal(y[4], b), dtype
        empty = torch.ops.leapfrog_gemm.linear_w8a8(xd[:0], p, s, b, 40, False)
        assert empty.shape == (0, 40) and empty.dtype == dtype


@needs_w8a8
def test_w8a8_reads_an_unaligned_packed_weight():
    """A packed weight that is a contiguous view at an odd address (not the 64-byte alignment of a
    fresh tensor) gives the same bits."""
    from leapfrog.model.native_linear import pack_w8a8
    from leapfrog.model.quant import w8a8_reference
    g = torch.Generator().manual_seed(5)
    q, s = quantize_int8(torch.randn(70, 200, generator=g))
    p = pack_w8a8(q)
    buf = torch.zeros(p.numel() + 1, dtype=torch.int8)
    odd = buf[1:].view(p.shape)
    odd.copy_(p)
    assert odd.is_contiguous() and odd.data_ptr() % 64 != 0
    x = torch.randn(3, 200, generator=g).bfloat16()
    assert torch.equal(torch.ops.leapfrog_gemm.linear_w8a8(x, odd, s, None, 70, False), w8a8_reference(x, q, s))


@needs_w8a8
def test_w8a8_sums_stay_in_int32():
    """Without the AMX-INT8 tiles the VNNI sums of unsigned rows (q + 128) can reach K x 255 x 127
    (the AVX2 build's K x 127 x 127): past 65536 input features the op refuses, where the tiles
    take it."""
    from leapfrog.model.native_linear import pack_w8a8, w8a8_tiles
    from leapfrog.model.quant import w8a8_reference
    k = 65536 + 64
    q = torch.full((32, k), 127, dtype=torch.int8)
    x = torch.ones(1, k, dtype=torch.bfloat16)
    if w8a8_tiles():
        y = torch.ops.leapfrog_gemm.linear_w8a8(x, pack_w8a8(q), torch.ones(32), None, 32, True)
        assert torch.equal(y, w8a8_reference(x, q, torch.ones(32), None, True))
    else:
        with pytest.raises(RuntimeError, match="at most 65536 input features"):
            torch.ops.leapfrog_gemm.linear_w8a8(x, pack_w8a8(q), torch.ones(32), None, 32, True)
        x, q = x[:, :65536], q[:, :65536]   # the largest sums that fit: exact
        y = torch.ops.leapfrog_gemm.linear_w8a8(x, pack_w8a8(q), torch.ones(32), None, 32, True)
        assert torch.equal(y, w8a8_reference(x, q, torch.ones(32), None, True))


@needs_w8a8
def test_w8a8_linear_and_bad_inputs():
    from leapfrog.model.quant import W8A8Linear, w8a8_reference
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(64, 128, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    lin = QUANT_LINEARS["w8a8"](w, b)
    assert isinstance(lin, W8A8Linear) and lin.row_invariant
    x = torch.randn(2, 5, 128, generator=g).bfloat16()
    q, s = quantize_int8(w)
    assert torch.equal(lin(x), w8a8_reference(x.view(10, 128), q, s, b.float()).view(2, 5, 64))
    assert quantized_bytes(lin) == 2 * 128 * 32 + 64 * 4   # (two blocks of 32 columns, K 128)
    check_quantization("w8a8", torch.bfloat16, CPU)
    with pytest.raises(ConfigError, match="w8a8' takes bfloat16 or float32 models"):
        check_quantization("w8a8", torch.float16, CPU)
    # a row holding a NaN or an infinity gives NaN outputs (as the float product would), the others theirs
    bad = x.view(10, 128).clone()
    bad[3, 7], bad[6, 0] = float("nan"), float("inf")
    y = lin(bad)
    assert torch.isnan(y[[3, 6]]).all() and not torch.isnan(y[[0, 1, 2, 4, 5, 7, 8, 9]]).any()
    assert torch.equal(y, w8a8_reference(bad, q, s, b.float())) is False   # (NaN != NaN)
    assert torch.equal(torch.nan_to_num(y, nan=7.0), torch.nan_to_num(w8a8_reference(bad, q, s, b.float()), nan=7.0))
    with pytest.raises(RuntimeError, match="input has 100 features"):
        lin(torch.randn(3, 100).bfloat16())
    with pytest.raises(RuntimeError, match="bf16 or float32 rows"):
        lin(torch.randn(3, 128).half())
