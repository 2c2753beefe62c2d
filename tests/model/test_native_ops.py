"""The C++ norm and RoPE ops of eager CPU forwards (model/native_ops.py): RoPE bitwise ATen's
formula, RMSNorm within float rounding of F.rms_norm and row-invariant, both off under autograd."""

import pytest
import torch
import torch.nn.functional as F

from leapfrog.model.native_ops import load_native_ops, rms_norm
from leapfrog.model.rope import apply_rope

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="native ops not buildable here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def aten_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 8, 64), (2, 6, 2, 64), (1, 64, 4, 128), (3, 5, 3, 10)])
def test_rope_is_bitwise_aten(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    B, S, H, D = shape
    # q as a view of a fused projection (strided rows), as decoder layers pass it
    fused = torch.randn(B, S, H * D + 7, generator=g).to(dtype)
    x = fused[..., 3:3 + H * D].view(B, S, H, D)
    angles = torch.rand(B, S, 1, D, generator=g) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    with torch.inference_mode():
        got = apply_rope(x, cos, sin, native=True)
        ref = aten_rope(x, cos, sin)
    assert got.dtype == dtype and got.shape == (B, S, H, D)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [512, 64, 13])
def test_rms_norm_matches_aten(dtype, D):
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(3, 7, D, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(D, generator=g) / 4).to(dtype)
    with torch.inference_mode():
        got = torch.ops.leapfrog_ops.rms_norm(x, w, 1e-6)
        ref = F.rms_norm(x, (D,), w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:   # the same reduction within a float's rounding, not just "close"
        assert (got - ref).abs().max() <= 4 * torch.finfo(torch.float32).eps * ref.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_any_weight_dtype_as_its_float32_value(dtype):
    """The op reads a weight of x's dtype in place (no cast per call) and a weight of another
    dtype through float32: bitwise what the float32 copy of the weight gives."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 96, generator=g) * 2).to(dtype)
    w32 = (1 + torch.randn(96, generator=g) / 4).to(dtype).float()   # exactly representable in dtype
    with torch.inference_mode():
        ref = torch.ops.leapfrog_ops.rms_norm(x, w32, 1e-6)
        for wd in DTYPES:
            w = w32.to(wd)
            if torch.equal(w.float(), w32):
                assert torch.equal(torch.ops.leapfrog_ops.rms_norm(x, w, 1e-6), ref), wd
        strided = torch.stack([w32, w32], 1).to(dtype)[:, 0]   # [96], stride 2: read through .contiguous()
        assert not strided.is_contiguous() and torch.equal(torch.ops.leapfrog_ops.rms_norm(x, strided, 1e-6), ref)


def test_rms_norm_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 512, generator=g)
    w = torch.randn(512, generator=g)
    with torch.inference_mode():
        whole = rms_norm(x, w, 1e-5, native=True)
        for r in (0, 17, 63):
            assert torch.equal(rms_norm(x[r:r + 1], w, 1e-5, native=True), whole[r:r + 1])
        assert torch.equal(rms_norm(x[5:11], w, 1e-5, native=True), whole[5:11])


def test_autograd_keeps_aten():
    x = torch.randn(2, 4, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = rms_norm(x, w, 1e-6, native=True)
    y.sum().backward()   # the native op has no backward: only ATen's could get here
    assert x.grad is not None and w.grad is not None


def test_packed_models_use_the_ops_and_match_aten(monkeypatch):
    """pack_for_inference turns them on (LEAPFROG_NATIVE_OPS=0 keeps ATen's); an eager forward
    with them gives ATen's logits to float rounding and the same argmax."""
    from leapfrog.model.args import LlamaArgs
    from leapfrog.model.llama import LlamaModel
    args = LlamaArgs(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaModel(args).eval()
    assert not model.native_ops and not any(layer.native_ops for layer in model.layers)  # training: ATen
    model.pack_for_inference()
    assert model.native_ops and all(layer.native_ops for layer in model.layers)
    tok = torch.randint(0, 97, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    with torch.inference_mode():
        got = model.compute_logits(model(tok, pos).hidden.reshape(18, -1))
        for m in model.modules():
            if hasattr(m, "native_ops"):
                m.native_ops = False
        ref = model.compute_logits(model(tok, pos).hidden.reshape(18, -1))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    monkeypatch.setenv("LEAPFROG_NATIVE_OPS", "0")
    off = LlamaModel(args).eval()
    off.pack_for_inference()
    assert not off.native_ops and not any(layer.native_ops for layer in off.layers)


def test_rope_broadcast_tables_take_aten():
    """cos/sin shared across the batch ([1, S, 1, D]) are not the op's contract: ATen serves them."""
    x = torch.randn(3, 4, 2, 8)
    angles = torch.rand(1, 4, 1, 8)
    with torch.inference_mode():
        got = apply_rope(x, angles.cos(), angles.sin(), native=True)
    assert torch.equal(got, aten_rope(x, angles.cos(), angles.sin()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1408, 704, 10, 37])
def test_silu_mul_is_bitwise_aten(dtype, inter):
    """silu(gate) * up as one op: ATen's bits for each row (its vector/scalar split, its roundings)."""
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(2, 5, 2 * inter, generator=g) * 4).to(dtype)
    with torch.inference_mode():
        gate, up = gate_up.chunk(2, dim=-1)
        ref = torch.cat([F.silu(gate[b, s]) * up[b, s] for b in range(2) for s in range(5)]).view(2, 5, inter)
        got = torch.ops.leapfrog_ops.silu_mul(gate_up)
    assert got.dtype == dtype and torch.equal(got, ref)


@pytest.mark.parametrize("V", [1, 5, 16, 17, 100, 4096, 8193])
def test_row_max_is_tensor_max(V):
    """row_max gives Tensor.max(-1)'s values (bit for bit) and indices: the first of equal maxima,
    the first NaN of a row with NaN, -inf rows, signed zeros, rows shorter than a vector, and a
    transposed (non-contiguous) input."""
    from leapfrog.model.native_ops import row_max
    g = torch.Generator().manual_seed(V)
    x = torch.randn(3, V, generator=g)
    nan = x.clone()
    nan[1, V // 2] = float("nan")
    nan[1, V - 1] = float("nan")
    zeros = torch.zeros(3, V)
    zeros[:, ::2] = -0.0
    inf = x.clone()
    inf[:, 0] = inf[:, -1] = float("inf")
    signs = torch.full((3, V), -1.0)   # zero maxima of either sign first: the element's own bits back
    signs[0, 0], signs[1, 0] = 0.0, -0.0
    signs[0, V // 2], signs[1, V // 2], signs[2, V - 1] = -0.0, 0.0, -0.0
    for c in (x, (x * 2).round(), nan, zeros, signs, inf, torch.full((3, V), -float("inf")),
              torch.randn(V, 3, generator=g).t()):
        got, ref = row_max(c), c.max(dim=-1)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0].view(torch.int32), ref[0].view(torch.int32))
    assert torch.ops.leapfrog_ops.row_max(x)[1].tolist() == x.max(-1)[1].tolist()   # (the op itself served)
