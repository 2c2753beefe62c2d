"""The C++ attention op of compiled graphs (attention/native.py) is bitwise the Python op."""

from __future__ import annotations

import pytest
import torch

from leapfrog.attention.native import load_native_attention
from leapfrog.model.compiled import can_compile

pytestmark = pytest.mark.skipif(can_compile(torch.device("cpu")) is not None, reason="no C++ compiler")

ML = 64


@pytest.fixture(scope="module")
def native():
    assert load_native_attention(), "the native attention op did not build"
    return torch.ops.leapfrog_native.cached_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, S, hkv", [(1, 1, 4), (1, 5, 4), (3, 1, 2), (3, 5, 2)])
def test_native_op_equals_python_op(native, dtype, B, S, hkv):
    g = torch.Generator().manual_seed(B * 10 + S)
    H, D, L = 4, 16, 40

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    caches = [rand(B + 2, hkv, ML, D) for _ in range(2)]
    q, k, v = rand(B, S, H, D), rand(B, S, hkv, D), rand(B, S, hkv, D)
    rows = torch.arange(B).flip(0)  # rows out of order: the gather path
    write_rows = rows.repeat_interleave(S)
    write_rows[-1] = B + 1 if S > 1 else write_rows[-1]  # a padding token on the scratch row
    write_cols = torch.arange(L - S, L).repeat(B)
    mask = torch.zeros(B, 1, S, ML, dtype=torch.bool)
    mask[..., :L] = torch.rand(B, 1, S, L, generator=g) > 0.3
    mask[..., 0] = True
    kv_len = torch.tensor(L)
    ref_caches = [c.clone() for c in caches]
    ref = torch.ops.leapfrog.cached_attention(q, k, v, *ref_caches, rows, write_rows, write_cols, mask, kv_len)
    out = native(q, k, v, *caches, rows, write_rows, write_cols, mask, kv_len)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches))  # the same cache writes
    assert torch.equal(caches[0][write_rows[0], :, write_cols[0]], k[0, 0])  # the new keys are in the cache
