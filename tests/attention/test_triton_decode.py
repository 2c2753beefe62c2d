"""The CUDA graphs' attention kernel (attention/triton_decode.py) against SDPA: on a GPU, and on
the CPU through Triton's interpreter (``TRITON_INTERPRET=1``) wherever Triton is installed, so
the kernel's indexing, masking and online softmax are checked without a GPU. The interpreter
runs float32 only: it computes bfloat16 wrong (errors of 1e8 on kernels that pass on an H100)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

#: (batch, tokens, heads, KV heads, head dim, cache rows, cache width, kv_len)
SHAPES = [(1, 1, 32, 8, 128, 3, 512, 70), (2, 5, 4, 4, 32, 4, 96, 33), (3, 2, 6, 2, 64, 5, 64, 64)]


def check_decode_attention(dtype: torch.dtype, shape: tuple, device: str, write: bool = False) -> None:
    """The kernel (rows read in place, kv_len columns, the mask applied) equals SDPA over the
    gathered rows' first kv_len columns; fully masked (padding) queries give zeros. ``write``:
    the kernel writes the step's new keys and values first (each sequence's S tokens at the last
    S columns below kv_len, the padding query's at a row no sequence reads), and the cache it
    leaves equals kv/cache.py's index writes."""
    from leapfrog.attention.metadata import AttnMeta
    from leapfrog.attention.triton_decode import decode_attention
    from leapfrog.kv.cache import write_layer
    B, S, H, Hkv, D, R, W, L = shape
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(B, S, H, D, generator=g, device=device).to(dtype)
    kc = torch.randn(R, Hkv, W, D, generator=g, device=device).to(dtype)
    vc = torch.randn(R, Hkv, W, D, generator=g, device=device).to(dtype)
    perm = torch.randperm(R, generator=g, device=device)
    rows = perm[:B]
    mask = torch.rand(B, 1, S, W, generator=g, device=device) < 0.6
    mask[..., L:] = False
    mask[0, 0, S - 1, :] = False   # a padding query
    mask[0, 0, S - 1, 0] = S == 1  # (a lone query keeps one column)
    new = None
    if write:
        # k, v strided as the model's (a slice of a packed projection)
        kv = torch.randn(B, S, 2, Hkv, D, generator=g, device=device).to(dtype)
        wrows = rows.repeat_interleave(S)
        wrows[S - 1] = perm[-1]   # the padding query's token: a scratch row
        wcols = torch.arange(L - S, L, device=device).repeat(B)
        index = torch.stack([wrows, wcols], 1)   # write rows and columns strided too (the op takes any strides)
        new = (kv[:, :, 0], kv[:, :, 1], index[:, 0], index[:, 1])
        want_k, want_v = kc.clone(), vc.clone()
        write_layer(want_k, want_v, AttnMeta(rows, wrows, wcols, L, None), new[0], new[1])
    out = decode_attention(q, kc, vc, rows, mask, torch.tensor(L, device=device), new).float()
    if write:
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v), (dtype, shape)
    G = H // Hkv
    keys = kc[rows][:, :, :L].float().repeat_interleave(G, 1)
    vals = vc[rows][:, :, :L].float().repeat_interleave(G, 1)
    m = mask[..., :L]
    ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), keys, vals, attn_mask=m).transpose(1, 2)
    real = m.any(-1)[:, 0]   # [B, S]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = ((out - ref)[real].norm() / ref[real].norm()).item()
    assert err < tol, (dtype, shape, err)
    assert torch.all(out[~real] == 0), (dtype, shape)


def check_write_outside_the_cache(device: str) -> None:
    """A write slot outside the cache (a column past its width, a row past its rows) writes
    nothing, where the slots inside are written."""
    from leapfrog.attention.triton_decode import decode_attention
    R, Hkv, W, D = 3, 2, 16, 32
    kc, vc = torch.zeros(R, Hkv, W, D, device=device), torch.zeros(R, Hkv, W, D, device=device)
    k = v = torch.ones(1, 3, Hkv, D, device=device)
    mask = torch.zeros(1, 1, 3, W, dtype=torch.bool, device=device)
    mask[..., 0] = True
    decode_attention(torch.ones(1, 3, Hkv, D, device=device), kc, vc, torch.tensor([1], device=device), mask,
                     torch.tensor(4, device=device),
                     (k, v, torch.tensor([1, 1, R], device=device), torch.tensor([2, W, 3], device=device)))
    written = (kc != 0).any(-1).any(1)   # [R, W]
    assert written.nonzero().tolist() == [[1, 2]] and torch.equal(kc, vc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_decode_attention_writes_nothing_outside_the_cache():
    check_write_outside_the_cache("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_triton_decode_attention_matches_sdpa(dtype, shape, write):
    check_decode_attention(dtype, shape, "cuda", write)


def test_triton_decode_attention_matches_sdpa_in_the_interpreter():
    """The same check on the CPU, every shape, in a fresh process: the interpreter is chosen when
    the kernel is defined, so TRITON_INTERPRET must be set before the module is imported."""
    pytest.importorskip("triton")
    code = ("import torch\n"
            "from tests.attention.test_triton_decode import SHAPES, check_decode_attention, check_write_outside_the_cache\n"
            "for s in SHAPES:\n for w in (False, True): check_decode_attention(torch.float32, s, 'cpu', w)\n"
            "check_write_outside_the_cache('cpu')\nprint('checked', len(SHAPES))")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0 and f"checked {len(SHAPES)}" in r.stdout, r.stderr[-3000:]
