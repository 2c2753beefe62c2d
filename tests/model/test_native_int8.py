"""The int8-weight op of model/native_linear.py (``leapfrog_gemm.linear_int8``, behind
quant.Int8Linear): values against the float64 reference, row invariance, bf16 rows, errors,
the compiled graph, and the fallback to PyTorch's kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leapfrog.model import native_linear
from leapfrog.model.native_linear import INT8_BLOCK_COLUMNS, native_int8_supported, pack_int8
from leapfrog.model.quant import Int8Linear, quantize_int8, reference_weight

needs_op = pytest.mark.skipif(not native_int8_supported("cpu"),
                              reason="needs AVX2 and a C++ compiler (and LEAPFROG_NATIVE_LINEAR unset)")


def test_pack_int8_layout():
    """Blocks of 16 columns; block b, input k holds q[16 b : 16 b + 16, k]; zeros past N."""
    q = (torch.arange(20 * 5) % 251 - 125).to(torch.int8).view(20, 5)
    p = pack_int8(q)
    assert p.shape == (2, 5, INT8_BLOCK_COLUMNS) and p.dtype == torch.int8
    for n in (0, 7, 15, 16, 19):
        assert torch.equal(p[n // 16, :, n % 16], q[n])
    assert not p[1, :, 4:].any()


def _op(x, q, s, b, n):
    return torch.ops.leapfrog_gemm.linear_int8(x, pack_int8(q), s, b, n)


@needs_op
@pytest.mark.parametrize("n, k", [(16, 32), (50, 64), (768, 512), (17, 33), (4096, 512)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(n, k, rows, bias):
    g = torch.Generator().manual_seed(n + k + rows)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    q, s = quantize_int8(w)
    ref = F.linear(x.double(), q.double() * s.double()[:, None], None if b is None else b.double())
    y = _op(x, q, s, b, n)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y.double(), ref, atol=1e-4 * k ** 0.5, rtol=1e-5)


@needs_op
def test_row_invariance():
    """A row's result does not depend on the other rows of the call (tiles of 1-4 rows, blocks in
    pairs or one at a time): bitwise the same as alone."""
    g = torch.Generator().manual_seed(0)
    q, s = quantize_int8(torch.randn(200, 96, generator=g))
    x = torch.randn(11, 96, generator=g)
    whole = _op(x, q, s, None, 200)
    for i in range(11):
        assert torch.equal(_op(x[i:i + 1], q, s, None, 200), whole[i:i + 1])
    assert torch.equal(_op(x[3:6], q, s, None, 200), whole[3:6])


@needs_op
def test_bf16_and_batched_noncontiguous_input():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g)
    q, s = quantize_int8(w)
    x = torch.randn(2, 3, 128, generator=g)[..., ::2]   # [2, 3, 64], not contiguous
    y = _op(x, q, s, None, 40)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, _op(x.contiguous().view(6, 64), q, s, None, 40).view(2, 3, 40))
    yb = _op(x.to(torch.bfloat16), q, s, None, 40)
    assert yb.dtype == torch.bfloat16   # widened, float32 sums, rounded once
    torch.testing.assert_close(yb, _op(x.to(torch.bfloat16).float(), q, s, None, 40).to(torch.bfloat16))


@needs_op
def test_bad_input_raises():
    q, s = quantize_int8(torch.randn(32, 16))
    p = pack_int8(q)
    op = torch.ops.leapfrog_gemm.linear_int8
    with pytest.raises(RuntimeError, match="features"):
        op(torch.randn(2, 18), p, s, None, 32)
    with pytest.raises(RuntimeError, match="packed by pack_int8"):
        op(torch.randn(2, 16), q, s, None, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(torch.randn(2, 16), p, s, None, 40)
    with pytest.raises(RuntimeError, match="scale"):
        op(torch.randn(2, 16), p, s[:8], None, 32)
    with pytest.raises(RuntimeError, match="input"):
        op(torch.randn(2, 16, dtype=torch.float64), p, s, None, 32)


@needs_op
def test_op_registration_and_compiled_graph():
    """Schema and fake function agree with the op (opcheck); a compiled graph calls it and gives
    the eager bits."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    lin = Int8Linear(w, b)
    assert lin.native
    x = torch.randn(5, 32, generator=g)
    torch.library.opcheck(torch.ops.leapfrog_gemm.linear_int8.default, (x, lin.qweight, lin.scale_f32, lin.bias_f32, 48),
                          test_utils=("test_schema", "test_faketensor"))
    model = nn.Sequential(lin, nn.SiLU())
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x), model(x))


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_uses_the_op_and_agrees_with_pytorchs_kernel(monkeypatch, dtype):
    """Int8Linear runs the op where it is available and PyTorch's ``_weight_int8pack_mm``
    otherwise; both compute with the reference weight (float rounding apart)."""
    g = torch.Generator().manual_seed(4)
    w, b, x = (torch.randn(64, 96, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype),
               torch.randn(3, 96, generator=g).to(dtype))
    ours = Int8Linear(w, b)
    monkeypatch.setattr(native_linear, "native_int8_supported", lambda device: False)
    theirs = Int8Linear(w, b)
    assert ours.native and not theirs.native and theirs.qweight.shape == (64, 96)
    ref = F.linear(x.float(), reference_weight("int8", w), b.float())
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(ours(x).float(), ref, **tol)
    torch.testing.assert_close(theirs(x).float(), ref, **tol)
    assert ours(x).dtype == theirs(x).dtype == dtype
    assert ours.weight_bytes() == 64 * 96 + 64 * 4                  # (the op reads float32 scales)
    assert theirs.weight_bytes() == 64 * 96 + 64 * w.element_size()
