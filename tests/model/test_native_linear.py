"""The few-row bf16 linear kernel (model/native_linear.py): values, row invariance, errors, graphs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leapfrog.model.native_linear import NativeLinear, bf16_exact, kernel_isa, native_linear_supported, pack_weight

BF16 = torch.bfloat16
needs_kernel = pytest.mark.skipif(not native_linear_supported(BF16, "cpu"),
                                  reason="needs AVX-512 BF16 or AVX2 and a C++ compiler (and LEAPFROG_NATIVE_LINEAR "
                                         "unset)")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("block", [32, 16])
def test_pack_weight_layout(block):
    """Blocks of 32 columns (the AVX-512 build) or 16 (AVX2), a k-pair of each column side by side."""
    w = torch.arange(40 * 6, dtype=torch.float32).view(40, 6).to(BF16)  # exact in bf16 (< 256)
    p = pack_weight(w, block)
    nb = -(-40 // block)
    assert p.shape == (nb, 3, block, 2)
    for n in (0, 15, 16, 17, 31, 32, 39):
        for j in range(3):
            assert torch.equal(p[n // block, j, n % block], w[n, 2 * j:2 * j + 2])
    assert not p[-1, :, 40 - (nb - 1) * block:].any()  # columns past 40 are padding


@needs_kernel
def test_default_block_is_the_builds():
    """NativeLinear packs with the loaded build's block width, which the op checks."""
    expected = {"avx512_bf16": 32, "avx2": 16}[kernel_isa()]
    lin = NativeLinear(torch.randn(40, 8).to(BF16), None)
    assert lin.packed.shape == (-(-40 // expected), 4, expected, 2)
    other = pack_weight(torch.randn(40, 8).to(BF16), 48 - expected)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.leapfrog_gemm.linear_bf16(torch.randn(2, 8), other, None, 40)


@needs_kernel
@pytest.mark.parametrize("n,k,bias", [(64, 32, False), (50, 30, True), (96, 1408, True), (33, 6, False),
                                      (8, 2, True)])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 8, 9, 21])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_matches_float64_reference(n, k, bias, rows, dtype):
    """bf16 rows: float32 sums rounded once to bf16; float32 rows (an LM head's): the bf16
    weights widened, float32 products and sums, float32 out."""
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=g).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if bias else None
    x = torch.randn(rows, k, generator=g).to(dtype)
    y = NativeLinear(w, b)(x)
    assert y.shape == (rows, n) and y.dtype == dtype
    ref = _reference(x, w, b)
    # within an ulp of the output dtype of the largest term's scale
    ulp = 2 ** -7 if dtype == BF16 else 2 ** -22
    tol = (x.double().abs() @ w.double().abs().t() + (b.double().abs() if bias else 0)) * ulp + 1e-6
    assert bool(((y.double() - ref).abs() <= tol).all())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17])
def test_bf16_rows_float32_out(rows):
    """f32_out: bf16 rows, float32 outputs: the bf16 output's float32 sums before their rounding
    (within float32 rounding of the float64 reference), row-invariant like the bf16 output."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(70, 96, generator=g).to(BF16), torch.randn(70, generator=g).to(BF16)
    x = torch.randn(rows, 96, generator=g).to(BF16)
    lin, lin32 = NativeLinear(w, b), NativeLinear(w, b, f32_out=True)
    y = lin32(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 70)
    tol = (x.double().abs() @ w.double().abs().t() + b.double().abs()) * 2 ** -22 + 1e-6
    assert bool(((y.double() - _reference(x, w, b)).abs() <= tol).all())
    assert torch.equal(y.to(BF16), lin(x))   # the same sums, rounded once
    assert torch.equal(torch.cat([lin32(x[i:i + 1]) for i in range(rows)]), y)


@needs_kernel
def test_batched_input_and_noncontiguous():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(70, 64, generator=g).to(BF16), torch.randn(3, 4, 128, generator=g).to(BF16)
    lin = NativeLinear(w, None)
    xs = x[..., ::2]  # a strided view
    y = lin(xs)
    assert y.shape == (3, 4, 70)
    ref = _reference(xs, w, None)
    tol = (xs.double().abs() @ w.double().abs().t()) * 2 ** -7 + 1e-6
    assert bool(((y.double() - ref).abs() <= tol).all())
    assert torch.equal(y, lin(xs.contiguous().view(12, 64)).view(3, 4, 70))


@needs_kernel
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_row_invariance(dtype):
    """A row's output is bitwise the same alone, among any number of rows, at any thread count."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(160, 1408, generator=g) * 0.05).to(BF16)
    b = torch.randn(160, generator=g).to(BF16)
    x = torch.randn(40, 1408, generator=g).to(dtype)
    lin = NativeLinear(w, b)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(40)])
    threads = torch.get_num_threads()
    try:
        for t in {1, 2, threads}:   # (2 also under pytest-xdist's one thread per worker)
            torch.set_num_threads(t)
            for size in (2, 5, 6, 8, 13, 40):
                for s in range(0, 40 - size + 1, size):
                    assert torch.equal(lin(x[s:s + size]), alone[s:s + size]), (t, size, s)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_bad_input_raises():
    lin = NativeLinear(torch.randn(32, 16).to(BF16), None)
    with pytest.raises(RuntimeError, match="bf16 or float32 input"):
        lin(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="features"):
        lin(torch.randn(2, 18).to(BF16))
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.leapfrog_gemm.linear_bf16(torch.randn(2, 16).to(BF16), torch.randn(32, 16).to(BF16), None, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.leapfrog_gemm.linear_bf16(torch.randn(2, 16).to(BF16), lin.packed, None, 40)


@needs_kernel
def test_op_registration_and_compiled_graph():
    """The op's schema and fake (meta) function agree with it (torch.library.opcheck), and a
    compiled graph calls it and gives the eager bits."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 32, generator=g).to(BF16), torch.randn(48, generator=g).to(BF16)
    x = torch.randn(5, 32, generator=g).to(BF16)
    lin = NativeLinear(w, b)
    for f32_out in (False, True):
        for stream in (False, True):
            torch.library.opcheck(torch.ops.leapfrog_gemm.linear_bf16.default,
                                  (x, lin.packed, lin.bias, 48, f32_out, stream),
                                  test_utils=("test_schema", "test_faketensor"))
    model = nn.Sequential(lin, nn.SiLU())
    for stream in (False, True):   # (the streaming prefetch inside a graph too)
        lin.stream = stream
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        with torch.inference_mode():
            assert torch.equal(compiled(x), model(x))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6, 9, 17])
def test_streaming_prefetch_gives_the_same_bits(rows):
    """NativeLinear.stream only changes the weights' prefetch: bf16 rows, float32 out and float32
    rows give bitwise what the default prefetch gives."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(100, 96, generator=g).to(BF16), torch.randn(100, generator=g).to(BF16)
    for lin, dtype in ((NativeLinear(w, b), BF16), (NativeLinear(w, b, f32_out=True), BF16),
                       (NativeLinear(w, None), torch.float32)):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        lin.stream = False
        want = lin(x)
        lin.stream = True
        assert torch.equal(lin(x), want)


@needs_kernel
def test_set_streaming_policy(monkeypatch):
    """A model's linears stream when their packed weights exceed the last-level cache, not when
    they fit, the cache size is unknown, LEAPFROG_STREAM_WEIGHTS=0, or the kernel's build does
    not stream (AVX2: its one prefetch hint)."""
    from leapfrog.model import native_linear as nl
    assert nl.kernel_streams() == (nl.kernel_isa() == "avx512_bf16")
    model = nn.Sequential(NativeLinear(torch.randn(64, 32).to(BF16), None),
                          NativeLinear(torch.randn(32, 64).to(BF16), None))   # 8 KiB packed
    size = nl.last_level_cache_bytes()   # (this machine's, from sysfs)
    assert size is None or size >= 1 << 16
    for cache, env, streams, want in ((4096, None, True, 2), (1 << 20, None, True, 0), (None, None, True, 0),
                                      (4096, "0", True, 0), (4096, None, False, 0)):
        monkeypatch.setattr(nl, "kernel_streams", lambda streams=streams: streams)
        monkeypatch.setattr(nl, "last_level_cache_bytes", lambda cache=cache: cache)
        if env is None:
            monkeypatch.delenv("LEAPFROG_STREAM_WEIGHTS", raising=False)
        else:
            monkeypatch.setenv("LEAPFROG_STREAM_WEIGHTS", env)
        assert nl.set_streaming(model) == want
        assert [m.stream for m in model] == [bool(want)] * 2


@needs_kernel
def test_target_streams_beside_a_drafter_and_stays_lossless(monkeypatch, llama_dir, draft_dir, tokenizer):
    """With a drafter model, a target larger than the cache (here: a cache of 1 KiB) streams its
    weights; greedy bf16 output is the plain engine's, token for token."""
    from leapfrog import LLM, SamplingParams
    from leapfrog.model import native_linear as nl
    monkeypatch.setattr(nl, "last_level_cache_bytes", lambda: 1024)
    monkeypatch.setattr(nl, "kernel_streams", lambda: True)   # (the AVX2 build ignores the flag: the same bits)
    prompts = ["def parse(text):", "import os\nfor name in"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=128)
    assert not any(getattr(m, "stream", False) for m in plain.engine.model.modules())
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    spec = LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=128,
               speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})
    linears = [m for m in spec.engine.model.modules() if isinstance(m, NativeLinear)]
    assert linears and all(m.stream for m in linears)
    assert not any(getattr(m, "stream", False) for m in spec.engine.proposer.runner.model.modules())
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == want


@needs_kernel
def test_models_use_it_in_bf16(llama_dir):
    """A bf16 model packed for inference (eager) or for compiled graphs runs its decoder linears
    through the kernel, and its logits stay those of the unpacked model to bf16 rounding."""
    from leapfrog.model.loader import load_model, read_checkpoint
    ckpt = read_checkpoint(llama_dir)
    ids, pos = torch.tensor([[5, 9, 13, 2, 7, 11]]), torch.arange(6)[None]
    ref_model = load_model(ckpt, BF16, torch.device("cpu"), 64)
    with torch.inference_mode():
        ref = ref_model.compute_logits(ref_model(ids, pos).hidden[0])
    for pack_layers in (True, False):
        model = load_model(ckpt, BF16, torch.device("cpu"), 64)
        model.pack_for_inference(pack_layers=pack_layers)
        kinds = {type(m).__name__ for m in model.layers.modules()}
        assert "NativeLinear" in kinds and "Linear" not in kinds and "PackedLinear" not in kinds
        assert type(model.head.proj).__name__ == "NativeLinear" and model.head.in_dtype == BF16
        # the head: the hidden state rounded to bf16, exact products summed in float32, float32 logits
        h = torch.randn(3, ref_model.args.hidden_size)
        w = ref_model.lm_head.weight if ref_model.lm_head is not None else ref_model.embed.weight
        logits = model.head(h)
        assert logits.dtype == torch.float32
        assert torch.allclose(logits, h.to(BF16).float() @ w.float().t(), rtol=1e-5, atol=1e-5)
        assert not torch.equal(logits, logits.to(BF16).float())   # not rounded to bf16
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos).hidden[0])
        assert (logits - ref).abs().max() < 0.05 * ref.abs().max()
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@needs_kernel
def test_bf16_head_rows_switch(monkeypatch):
    """A bf16 target's head reads bf16 rows (float32 logits); LEAPFROG_BF16_HEAD_ROWS=0 keeps
    float32 rows (the hidden state not rounded); a draft's half-precision head is unaffected."""
    from leapfrog.model.llama import LogitsHead
    g = torch.Generator().manual_seed(4)
    w, h = torch.randn(64, 32, generator=g).to(BF16), torch.randn(3, 32, generator=g)
    assert LogitsHead(w).in_dtype == BF16
    assert torch.allclose(LogitsHead(w)(h), h.to(BF16).float() @ w.float().t(), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("LEAPFROG_BF16_HEAD_ROWS", "0")
    head = LogitsHead(w)
    assert head.in_dtype == torch.float32 and head(h).dtype == torch.float32
    assert torch.allclose(head(h), h @ w.float().t(), rtol=1e-5, atol=1e-5)
    assert LogitsHead(w, fp32=False)(h).dtype == torch.float32 and LogitsHead(w, fp32=False).in_dtype == BF16


def test_kill_switch(monkeypatch):
    """LEAPFROG_NATIVE_LINEAR=0 (or false/off) keeps the kernel out of newly packed models."""
    w = torch.randn(64, 32).to(BF16)
    for value in ("0", "off", "False"):
        monkeypatch.setenv("LEAPFROG_NATIVE_LINEAR", value)
        assert not native_linear_supported(BF16, "cpu") and not NativeLinear.fits(w)
    monkeypatch.setenv("LEAPFROG_NATIVE_LINEAR", "0")
    from leapfrog.model.packed import can_pack, inference_linear
    want = "PackedLinear" if can_pack(BF16, torch.device("cpu")) else "Linear"   # (oneDNN bf16: AVX-512 only)
    assert type(inference_linear(w, None)).__name__ == want


def test_only_bf16_cpu_weights_fit():
    """float32 weights with values bf16 cannot hold, fp16 weights, odd or empty input widths never
    take the kernel."""
    assert not NativeLinear.fits(torch.randn(64, 32))
    assert not NativeLinear.fits(torch.randn(64, 32).half())
    assert not NativeLinear.fits(torch.randn(64, 33).to(BF16))
    assert not NativeLinear.fits(torch.randn(0, 32).to(BF16))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_float32_weights_of_bf16_values(rows):
    """A bf16 checkpoint run in float32: its float32 weights are bf16 values, so the kernel serves
    them (read as bf16, exactly) with float32 rows: float32 products and sums, float32 out, row
    by row what one row alone gives."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 96, generator=g).to(BF16).float()
    b = torch.randn(80, generator=g)   # (a float32 bias is added in float32 as it is)
    assert bf16_exact(w) and not bf16_exact(w + 1e-3) and NativeLinear.fits(w)
    x = torch.randn(rows, 96, generator=g)
    lin = NativeLinear(w, b)
    y = lin(x)
    assert y.dtype == torch.float32
    tol = (x.double().abs() @ w.double().abs().t() + b.double().abs()) * 2 ** -22 + 1e-6
    assert bool(((y.double() - _reference(x, w, b)).abs() <= tol).all())
    assert torch.equal(y, torch.cat([lin(x[i:i + 1]) for i in range(rows)]))


@needs_kernel
def test_float32_models_of_bf16_values_use_it(tmp_path, llama_dir):
    """A checkpoint saved in bf16 and loaded in float32 runs its decoder linears and its head
    through the kernel, with the unpacked float32 model's logits (float32 rounding apart)."""
    from leapfrog.demo import save_random_llama
    from leapfrog.model.loader import load_model, read_checkpoint
    d = save_random_llama(tmp_path / "bf16", None, seed=3, dtype="bfloat16", vocab_size=128)
    ckpt = read_checkpoint(d)
    ids, pos = torch.tensor([[5, 9, 13, 2, 7, 11]]), torch.arange(6)[None]
    ref_model = load_model(ckpt, torch.float32, torch.device("cpu"), 64)
    with torch.inference_mode():
        ref = ref_model.compute_logits(ref_model(ids, pos).hidden[0])
    model = load_model(ckpt, torch.float32, torch.device("cpu"), 64)
    model.pack_for_inference()
    kinds = {type(m).__name__ for m in model.layers.modules()}
    assert "NativeLinear" in kinds and "PackedLinear" not in kinds
    assert type(model.head.proj).__name__ == "NativeLinear"
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, pos).hidden[0])
    assert logits.dtype == torch.float32 and torch.allclose(logits, ref, rtol=1e-4, atol=1e-4)
    # a float32 checkpoint of values bf16 cannot hold keeps oneDNN's float32 linears
    fp32 = load_model(read_checkpoint(llama_dir), torch.float32, torch.device("cpu"), 64)
    fp32.pack_for_inference()
    assert "NativeLinear" not in {type(m).__name__ for m in fp32.layers.modules()}


def test_kernel_isa(monkeypatch):
    """The build follows the CPU, and ATEN_CPU_CAPABILITY caps it as it caps PyTorch's kernels."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    best = kernel_isa()
    assert best in ("avx512_bf16", "avx2", None)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert kernel_isa() is None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert kernel_isa() == (None if best is None else "avx2")


def test_kernel_source_prefetch_and_namespace():
    """The engine's source carries the default prefetch; variants change only the prefetch and the
    op's namespace, and bad settings are refused."""
    from leapfrog.model import native_linear as nl
    for isa, (nbytes, hint) in nl.PREFETCH.items():
        default, flags = nl.kernel_source(isa)
        assert (default, flags) == nl._BUILDS[isa]
        assert f"PREFETCH = {nbytes // 2};" in default and f"_MM_HINT_{hint}" in default
        assert "@PREFETCH" not in default
        off, _ = nl.kernel_source(isa, 1024, "none", namespace="lf_test_ns")
        assert "_mm_prefetch((const char*)(p)" not in off and "PREFETCH = 512;" in off
        assert "TORCH_LIBRARY(lf_test_ns," in off and "TORCH_LIBRARY_IMPL(lf_test_ns," in off
        assert "leapfrog_gemm" not in off   # (else loading it would clash with the engine's op)
        for bad in ({"hint": "L1"}, {"prefetch_bytes": 0}, {"prefetch_bytes": 7}):
            with pytest.raises(ValueError):
                nl.kernel_source(isa, **bad)


@needs_kernel
@pytest.mark.slow
def test_prefetch_variant_gives_the_same_bits():
    """A prefetch variant (load_variant, which benchmarks/linear_bench.py times) is the same
    arithmetic under its own namespace: bitwise the engine's kernel."""
    from leapfrog.model.native_linear import load_variant
    op = load_variant(2048, "NTA", "leapfrog_gemm_test_variant")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 96, generator=g).to(BF16)
    lin = NativeLinear(w, None)
    for rows in (1, 6, 9):
        for dtype in (BF16, torch.float32):
            x = torch.randn(rows, 96, generator=g).to(dtype)
            assert torch.equal(op(x, lin.packed, None, 100, False), lin(x))


def test_kernel_amx(monkeypatch):
    """AMX tiles where the CPU lists AMX-BF16 and AMX-TILE beside AVX-512 BF16, unless
    LEAPFROG_AMX=0 or ATEN_CPU_CAPABILITY caps the build below AVX-512."""
    from leapfrog.model import native_linear as nl
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("LEAPFROG_AMX", raising=False)
    amx = {"avx2", "fma", "avx512_bf16", "amx_bf16", "amx_tile"}
    for flags, want in [(amx, True), (amx - {"amx_tile"}, False), (amx - {"avx512_bf16"}, False),
                        ({"avx2", "fma"}, False)]:
        monkeypatch.setattr(nl, "cpu_flags", lambda flags=flags: flags)
        assert nl.kernel_amx() is want, flags
    monkeypatch.setattr(nl, "cpu_flags", lambda: amx)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert nl.kernel_isa() == "avx2" and not nl.kernel_amx()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setenv("LEAPFROG_AMX", "0")
    assert nl.kernel_isa() == "avx512_bf16" and not nl.kernel_amx()


def test_kernel_source_amx():
    """The AMX build is the AVX-512 BF16 build with the tile path compiled in (and its flags)."""
    from leapfrog.model import native_linear as nl
    source, flags = nl.kernel_source("avx512_bf16", amx=True)
    assert (source, flags) == nl._BUILDS["avx512_bf16_amx"]
    assert source.startswith("#define LEAPFROG_AMX 1") and "_tile_dpbf16ps" in source
    assert {"-mamx-tile", "-mamx-bf16"} <= set(flags)
    plain, plain_flags = nl._BUILDS["avx512_bf16"]
    assert "_tile_dpbf16ps" not in plain and "-mamx-bf16" not in plain_flags
    with pytest.raises(ValueError):
        nl.kernel_source("avx2", amx=True)


def _amx_in_use() -> bool:
    from leapfrog.model.native_linear import amx_in_use
    return native_linear_supported(BF16, "cpu") and amx_in_use()


needs_amx = pytest.mark.skipif(not _amx_in_use(), reason="needs AMX-BF16 (and LEAPFROG_AMX unset)")


@needs_amx
@pytest.mark.parametrize("n,k", [(100, 90), (64, 64), (33, 544)])
def test_amx_tiles_values_and_row_invariance(n, k):
    """The AMX path (bf16 rows): whole and partial A tiles (1-16 rows; 17-32, a tile of 16 and one of
    the rest; past 32, tiles of 16 padded with zero rows, in passes of two), K not a multiple of a tile's 32 (the zero-padded tail),
    N not a multiple of a block; float32 sums within a bf16 rounding of the float64 reference, and
    each row's bits those it gets alone."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(BF16)
    b = torch.randn(n, generator=g)
    lin = NativeLinear(w, b)
    head = NativeLinear(w, b, f32_out=True)
    x = torch.randn(40, k, generator=g).to(BF16)
    alone = [lin(x[i:i + 1]) for i in range(40)]
    alone32 = [head(x[i:i + 1]) for i in range(40)]
    for rows in (1, 3, 16, 17, 31, 32, 33, 40):
        ref = _reference(x[:rows], w, b)
        y, y32 = lin(x[:rows]), head(x[:rows])
        assert torch.allclose(y32.double(), ref, rtol=1e-5, atol=1e-4), rows
        assert torch.equal(y, y32.to(BF16)), rows   # one rounding of the same sums
        assert torch.equal(y, torch.cat(alone[:rows])) and torch.equal(y32, torch.cat(alone32[:rows])), rows


@needs_amx
@pytest.mark.slow
def test_amx_and_vdpbf16ps_builds_agree_to_rounding():
    """The build without the tiles (LEAPFROG_AMX=0's, load_variant(amx=False)) sums the same
    products in another order: equal to within float32 rounding of the terms' scale, and not
    bitwise (so the tiles really ran)."""
    from leapfrog.model.native_linear import PREFETCH, load_variant
    op = load_variant(*PREFETCH["avx512_bf16"], "leapfrog_gemm_test_noamx", amx=False)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 512, generator=g).to(BF16)
    head = NativeLinear(w, None, f32_out=True)
    differ = 0
    for rows in (1, 6, 17):
        x = torch.randn(rows, 512, generator=g).to(BF16)
        tiles, plain = head(x), op(x, head.packed, None, 300, True)
        tol = (x.double().abs() @ w.double().abs().t()) * 2 ** -20 + 1e-6   # 8 float32 ulps of the terms' sum
        assert bool(((tiles.double() - plain.double()).abs() <= tol).all()), rows
        differ += int((tiles != plain).sum())
    assert differ > 0
