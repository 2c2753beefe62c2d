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


def test_pack_weight_layout():
    w = torch.arange(40 * 6, dtype=torch.float32).view(40, 6).to(BF16)  # exact in bf16 (< 256)
    p = pack_weight(w)
    assert p.shape == (2, 3, 32, 2)
    for n in (0, 17, 31, 32, 39):
        for j in range(3):
            assert torch.equal(p[n // 32, j, n % 32], w[n, 2 * j:2 * j + 2])
    assert not p[1, :, 8:].any()  # columns 40..63 are padding


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
        for t in {1, threads}:
            torch.set_num_threads(t)
            for size in (2, 5, 8, 13, 40):
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
        torch.library.opcheck(torch.ops.leapfrog_gemm.linear_bf16.default, (x, lin.packed, lin.bias, 48, f32_out),
                              test_utils=("test_schema", "test_faketensor"))
    model = nn.Sequential(lin, nn.SiLU())
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x), model(x))


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
