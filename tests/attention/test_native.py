"""The C++ attention op of compiled graphs (attention/native.py): the Python op's results to
float rounding, the same cache writes, row invariance (a token's output does not depend on what
runs with it), and clear errors for out-of-range indices."""

from __future__ import annotations

import pytest
import torch

from leapfrog.attention.native import load_native_attention
from leapfrog.model.compiled import can_compile

pytestmark = pytest.mark.skipif(can_compile(torch.device("cpu")) is not None, reason="no C++ compiler")

ML = 64
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def native():
    assert load_native_attention(), "the native attention op did not build"
    return torch.ops.leapfrog_native.cached_attention


def _case(dtype, B, S, H, hkv, D, L, seed):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    caches = [rand(B + 2, hkv, ML, D) for _ in range(2)]
    q, k, v = rand(B, S, H, D), rand(B, S, hkv, D), rand(B, S, hkv, D)
    rows = torch.arange(B).flip(0)  # rows out of order
    write_rows = rows.repeat_interleave(S)
    write_rows[-1] = B + 1 if S > 1 else write_rows[-1]  # a padding token on the scratch row
    write_cols = torch.arange(L - S, L).repeat(B)
    mask = torch.zeros(B, 1, S, ML, dtype=torch.bool)
    mask[..., :L] = torch.rand(B, 1, S, L, generator=g) > 0.3
    mask[..., 0] = True
    mask[..., L:] = seed % 2 == 1   # columns past kv_len are never read, whatever the mask says there
    return q, k, v, caches, rows, write_rows, write_cols, mask, torch.tensor(L)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, S, hkv, D", [(1, 1, 4, 16), (1, 5, 4, 16), (3, 1, 2, 32), (3, 5, 2, 16), (2, 3, 4, 12)])
def test_native_op_matches_python_op(native, dtype, B, S, hkv, D):
    """D = 12 is not a multiple of the kernel's lanes: the op takes its ATen path then."""
    q, k, v, caches, rows, write_rows, write_cols, mask, kv_len = _case(dtype, B, S, 4, hkv, D, 40, B * 10 + S)
    ref_caches = [c.clone() for c in caches]
    ref = torch.ops.leapfrog.cached_attention(q, k, v, *ref_caches, rows, write_rows, write_cols, mask, kv_len)
    out = native(q, k, v, *caches, rows, write_rows, write_cols, mask, kv_len)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches))  # the same cache writes
    assert torch.equal(caches[0][write_rows[0], :, write_cols[0]], k[0, 0])  # the new keys are in the cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_op_reads_strided_queries_keys_and_values(native, dtype):
    """q, k and v as the model passes them for a verify chunk: strided views of one fused qkv
    projection [B, S, q + 2 kv]. The op reads q and writes k and v to the cache in place: the same
    cache and output (contiguous) as from contiguous copies."""
    B, S, H, hkv, D = 2, 5, 4, 2, 16
    q, k, v, caches, rows, write_rows, write_cols, mask, kv_len = _case(dtype, B, S, H, hkv, D, 40, 11)
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)   # [B, S, (H + 2 hkv) D]
    qs, ks, vs = qkv.split((H * D, hkv * D, hkv * D), dim=-1)
    qs, ks, vs = qs.view(B, S, H, D), ks.view(B, S, hkv, D), vs.view(B, S, hkv, D)
    assert not qs.is_contiguous() and not ks.is_contiguous() and not vs.is_contiguous()
    c1, c2 = [c.clone() for c in caches], [c.clone() for c in caches]
    strided = native(qs, ks, vs, *c1, rows, write_rows, write_cols, mask, kv_len)
    dense = native(q, k, v, *c2, rows, write_rows, write_cols, mask, kv_len)
    assert strided.is_contiguous() and strided.shape == q.shape
    assert torch.equal(strided, dense) and all(torch.equal(a, b) for a, b in zip(c1, c2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_op_is_row_invariant(native, dtype):
    """A decode token alone (S = 1, kv_len = its own length) gets bitwise the output it gets as the
    first token of a 5-token verify chunk, in a batch of 3 with a longer kv_len and other rows."""
    g = torch.Generator().manual_seed(7)
    H, hkv, D, start = 4, 2, 32, 20

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    caches = [rand(4, hkv, ML, D) for _ in range(2)]
    q5, k5, v5 = rand(1, 5, H, D), rand(1, 5, hkv, D), rand(1, 5, hkv, D)
    # alone: the first token at column `start` of row 1, seeing columns 0..start
    c1 = [c.clone() for c in caches]
    mask1 = torch.zeros(1, 1, 1, ML, dtype=torch.bool)
    mask1[..., :start + 1] = True
    alone = native(q5[:, :1], k5[:, :1], v5[:, :1], *c1, torch.tensor([1]), torch.tensor([1]),
                   torch.tensor([start]), mask1, torch.tensor(start + 1))
    # in a batch: rows 2, 1, 0 with 5 tokens each, causal over the chunk; row 1 is our sequence
    B = 3
    qb, kb, vb = rand(B, 5, H, D), rand(B, 5, hkv, D), rand(B, 5, hkv, D)
    qb[1], kb[1], vb[1] = q5[0], k5[0], v5[0]
    rows = torch.tensor([2, 1, 0])
    mask = torch.zeros(B, 1, 5, ML, dtype=torch.bool)
    for i in range(5):
        mask[:, 0, i, :start + i + 1] = True
    c2 = [c.clone() for c in caches]
    batch = native(qb, kb, vb, *c2, rows, rows.repeat_interleave(5), torch.arange(start, start + 5).repeat(B),
                   mask, torch.tensor(start + 5))
    assert torch.equal(batch[1:2, :1], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_op_ragged_batch_reads_each_row_to_its_own_length(native, dtype):
    """A ragged batch (drafts accepted unevenly, continuous batching): kv_len is the longest
    row's, and each row reads only up to its own last visible column. Every row's tokens get
    bitwise the output they get alone with kv_len their own length, including a row whose own
    length ends inside a column block and one that ends on a block's edge."""
    g = torch.Generator().manual_seed(3)
    H, hkv, D, S = 4, 2, 32, 2

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    lengths = [9, 50, 32, 23]   # columns each row sees (its S tokens end there)
    B = len(lengths)
    caches = [rand(B + 1, hkv, ML, D) for _ in range(2)]
    q, k, v = rand(B, S, H, D), rand(B, S, hkv, D), rand(B, S, hkv, D)
    rows = torch.tensor([3, 0, 2, 1])
    mask = torch.zeros(B, 1, S, ML, dtype=torch.bool)
    for b, n in enumerate(lengths):
        for i in range(S):
            mask[b, 0, i, :n - S + i + 1] = torch.rand(n - S + i + 1, generator=g) > 0.25
            mask[b, 0, i, n - S + i] = True   # its own column
    cols = torch.cat([torch.arange(n - S, n) for n in lengths])
    c = [x.clone() for x in caches]
    batch = native(q, k, v, *c, rows, rows.repeat_interleave(S), cols, mask, torch.tensor(max(lengths)))
    for b, n in enumerate(lengths):
        c = [x.clone() for x in caches]
        alone = native(q[b:b + 1], k[b:b + 1], v[b:b + 1], *c, rows[b:b + 1], rows[b:b + 1].repeat_interleave(S),
                       torch.arange(n - S, n), mask[b:b + 1], torch.tensor(n))
        assert torch.equal(batch[b:b + 1], alone), f"row {b} (length {n})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64, 128, 48])
def test_native_op_full_blocks_reduce_as_the_tail(native, dtype, D):
    """The kernel reads keys in blocks of 8 or 16 columns (the vector's lanes) and reduces a full
    block's scores at once, a shorter tail column by column: the same query, seeing the same
    columns (a mask with gaps), gets bitwise the same output whether kv_len puts its last
    columns in the tail (21, 35) or in full blocks (32, 48, 64). D = 48 takes the kernel's
    generic head-dim path."""
    g = torch.Generator().manual_seed(D)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    H = hkv = 2
    caches = [rand(1, hkv, ML, D) for _ in range(2)]
    q, k, v = rand(1, 1, H, D), rand(1, 1, hkv, D), rand(1, 1, hkv, D)
    for visible in (21, 35):
        mask = torch.zeros(1, 1, 1, ML, dtype=torch.bool)
        mask[..., :visible] = torch.rand(visible, generator=g) > 0.2
        mask[..., visible - 1] = True   # its own column (written below)
        outs = []
        for kv_len in sorted({visible, 32, 48, 64} - set(range(visible))):
            c = [x.clone() for x in caches]
            outs.append(native(q, k, v, *c, torch.tensor([0]), torch.tensor([0]), torch.tensor([visible - 1]),
                               mask, torch.tensor(kv_len)))
        assert len(outs) >= 3 and all(torch.equal(o, outs[0]) for o in outs[1:])


def test_native_op_fully_masked_query_gives_zeros(native):
    """As SDPA: a query that sees no column (none in the engine's masks) gets zeros, not NaN."""
    q, k, v, caches, rows, write_rows, write_cols, mask, kv_len = _case(torch.float32, 1, 2, 4, 4, 16, 40, 1)
    mask[0, 0, 1] = False
    out = native(q, k, v, *caches, rows, write_rows, write_cols, mask, kv_len)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1])) and out[0, 0].abs().sum() > 0


def test_native_op_propagates_nan(native):
    """A non-finite key (a model's overflow) gives NaN, as SDPA, for the engine's checks to catch."""
    q, k, v, caches, rows, write_rows, write_cols, mask, kv_len = _case(torch.float32, 1, 1, 4, 4, 16, 40, 2)
    caches[0][rows[0], :, 3] = float("nan")
    out = native(q, k, v, *caches, rows, write_rows, write_cols, mask, kv_len)
    assert torch.isnan(out).all() == bool(mask[0, 0, 0, 3])
    mask[0, 0, 0, 3] = True
    assert torch.isnan(native(q, k, v, *caches, rows, write_rows, write_cols, mask, kv_len)).all()


def test_native_op_refuses_out_of_range_indices(native):
    q, k, v, caches, rows, write_rows, write_cols, mask, kv_len = _case(torch.float32, 1, 1, 4, 4, 16, 40, 0)
    with pytest.raises(RuntimeError, match="write_cols"):
        native(q, k, v, *caches, rows, write_rows, torch.tensor([ML]), mask, kv_len)
    with pytest.raises(RuntimeError, match="rows"):
        native(q, k, v, *caches, torch.tensor([99]), write_rows, write_cols, mask, kv_len)
    with pytest.raises(RuntimeError, match="kv_len"):
        native(q, k, v, *caches, rows, write_rows, write_cols, mask, torch.tensor(ML + 1))
    with pytest.raises(RuntimeError, match="caches"):
        native(q, k, v[:, :, :2], *caches, rows, write_rows, write_cols, mask, kv_len)
    with pytest.raises(RuntimeError, match="caches"):
        native(q, k, v, caches[0], caches[1][:, :, :32], rows, write_rows, write_cols, mask, kv_len)


@pytest.mark.parametrize("which", ["native", "python"])
def test_attention_ops_share_metadata_buffers_in_graphs(which, request):
    """Both attention ops (this C++ one; the Python one of attention/backend.py, which CUDA graphs
    use) are flexible_layout: a compiled graph that computes the metadata itself (rounds graphs:
    masks and write columns from ``col``) passes every layer the same buffers instead of a
    recomputed copy each (6 x a [6, 2048] mask per verify). Their inputs may then come strided: the
    compiled calls give the eager ones' outputs and cache writes bitwise."""
    import leapfrog.attention.backend  # noqa: F401  (registers torch.ops.leapfrog.cached_attention)
    from leapfrog.model.compiled import INDUCTOR_OPTIONS, causal_mask
    op = request.getfixturevalue("native") if which == "native" else torch.ops.leapfrog.cached_attention
    assert torch.Tag.flexible_layout in op.default.tags
    H, hkv, D, K = 4, 2, 16, 3

    def layers(qt, col, rows, c0, c1, c2, c3):   # qt [B, H, S, D]: the queries come transposed
        vq = col[:, None] + torch.arange(K + 1)                                   # [B, K + 1]
        mask = causal_mask(torch.arange(ML), vq, None)                            # [B, 1, K + 1, ML]
        wr, wc, L = rows.repeat_interleave(K + 1), vq.flatten(), col.max() + K + 1
        q = qt.transpose(1, 2)                                                    # [B, S, H, D] strided
        kv = q[:, :, :hkv]
        o = op(q, kv, kv, c0, c1, rows, wr, wc, mask, L)
        return op(o, o[:, :, :hkv], o[:, :, hkv:], c2, c3, rows, wr, wc, mask, L)

    g = torch.Generator().manual_seed(0)
    qt = torch.randn(2, H, K + 1, D, generator=g)
    col, rows = torch.tensor([7, 20]), torch.tensor([1, 0])
    caches = [torch.randn(3, hkv, ML, D, generator=g) for _ in range(4)]
    ref_caches = [c.clone() for c in caches]
    ref = layers(qt, col, rows, *ref_caches)
    opts = {k: v for k, v in INDUCTOR_OPTIONS.items() if "autotune" not in k}
    with torch._inductor.config.patch(opts):
        out = torch.compile(layers, fullgraph=True, dynamic=False)(qt, col, rows, *caches)
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(caches, ref_caches))


def test_the_prefetch_changes_no_value(native):
    """The software prefetch of the next column block (attention/native.py ``prefetch_block``) only
    asks for cache lines: the op without it (``attention_source(prefetch=False)``, the variant
    benchmarks/attention_bench.py ``--prefetch-ab`` times) gives bitwise the same outputs and cache
    writes, over many blocks and a partial last one."""
    from leapfrog.attention.native import attention_source, load_variant
    assert "LEAPFROG_ATTN_PREFETCH 0" in attention_source(prefetch=False) and \
        "TORCH_LIBRARY(leapfrog_attn_test," in attention_source(True, "leapfrog_attn_test")
    without = load_variant(prefetch=False, namespace="leapfrog_attn_test")
    for dtype in (torch.float32, torch.bfloat16):
        for B, S in ((1, 1), (1, 8), (3, 5)):
            q, k, v, caches, rows, write_rows, write_cols, mask, kv_len = _case(dtype, B, S, 4, 2, 64, ML - 3, S)
            other = [c.clone() for c in caches]
            out = native(q, k, v, *caches, rows, write_rows, write_cols, mask, kv_len)
            ref = without(q, k, v, *other, rows, write_rows, write_cols, mask, kv_len)
            assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(caches, other))
