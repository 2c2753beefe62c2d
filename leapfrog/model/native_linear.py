"""A few-row bf16-weight linear for CPUs with AVX-512 BF16 or AVX2: ``torch.ops.leapfrog_gemm.linear_bf16``.

Decode and speculative verification multiply 1-16 rows by every weight of the model, so the
product is bound by how fast the weights stream from memory. oneDNN (the eager ``PackedLinear``)
and inductor's GEMMs reach 17-40 GB/s on those shapes here, and oneDNN's cost grows with the rows
(6 rows cost 1.7-2x one row); the machine reads about 44 GB/s.

The kernel: the weight [N, K] is packed once, at load, into blocks of 32 output columns laid out
for ``vdpbf16ps`` (``pack_weight``: [N/32, K/2, 32, 2], the two bf16 of a k-pair side by side),
so one 64-byte load holds a k-pair for 16 columns and no horizontal sums are needed. Each block
streams once through the registers of up to 8 bf16 rows (6 float32 rows) at a time (further rows
reuse it from cache); blocks are split over PyTorch's intra-op threads. Products are exact (bf16 x
bf16 fits float32), sums are float32 (two partial sums per column: k-pairs 0, 2, 4, ... and 1, 3,
5, ..., added at the end), then the bias in float32, then one rounding to bf16 (nearest-even),
or none (``f32_out``: a bf16 model's LM head, whose logits stay float32). Float32 rows (a float32
model's LM head): the bf16 weights widened to float32 in registers, fused multiply-adds, float32
out. (At 17 rows the LM head of the built-in target took 0.46 ms with bf16 rows against 0.78 ms
with float32 rows: vdpbf16ps does 32 multiply-adds per instruction, an FMA 16.)

Row invariance: a row's result depends only on that row and the weights: the summation order is
fixed by K alone, whatever the number of rows, the batch or the thread count. A token verified
among drafts gets bitwise what it gets when decoded alone (tests/model/test_native_linear.py).

Measured (2 threads, AVX-512 EPYC, built-in target's layer shapes): the op alone, weights
cycling through L3, 1 row 133 us per layer against inductor's 162 and oneDNN's 316-470; 6 rows
164 us against inductor's 279. Inside the compiled target step (profiled, all weights streaming
from memory): one token, a layer's four linears 216 us against inductor's 223 (both about 29
GB/s, the memory's pace); five tokens, still 213 us, and the whole verify step 2.60 ms against
3.74 ms with inductor's GEMMs.

AVX2 (no bf16 dot product, 16 vector registers): float32 rows only (bf16 rows are widened to
float32 first and the float32 sums rounded once to bf16), 8-lane fused multiply-adds, each k's
product added in k order (even and odd k into the same accumulator). Its blocks are 16 columns wide
(``BLOCK_COLUMNS``; ``pack_weight`` packs for the loaded build): a k-pair of a block is one 64-byte
line, a block one contiguous run, and a tile of up to 6 rows x 16 columns keeps its 12 sums, the
widened weights and a broadcast in the 16 registers without spilling (the first build's 3 rows x 32
columns spilled 8 of its 12 sums to the stack every k-pair). One row runs over 4 blocks at once
and two rows over 2 (8 independent sums, so the multiply-adds do not wait on each other); more than
6 rows run in tiles of 6, 5 or 4 and one of 2 (8: 4 + 4), over chunks of blocks that stay in L2
between tiles. Tiles of 4 to 6 rows are written with every loop unrolled (``tile_f32_unrolled``):
in the general form GCC still kept a stack copy of the sums and stored all of them every k-pair.
Same sums in the same order as the first build, so the same bits (checked side by side).
On AVX2 this is what float32 models use too: a bf16 checkpoint run in float32 (``dtype="auto"``
picks float32 where bf16 is emulated) has float32 weights that are all bf16 values, so the kernel
reads them as bf16 (exact) and multiplies float32 rows in float32, at half the bytes of a float32
linear (``NativeLinear.fits``). Measured (2 threads, AVX2 EPYC, the built-in target's 24 decoder
linears and its head, weights from memory): one row 2.1 ms against 7.4 ms for ``F.linear`` in
float32 (22.5 of the machine's ~25 GB/s), five rows 3.6 ms against 19.2 with the first build; the
16-column build against the first, interleaved (``benchmarks/linear_bench.py --dtype float32
--other``, Zen 3), before the unrolled tiles: 3 rows 0.91x the time, 4 rows 0.85x, 5 rows 0.89x,
8 rows 0.93x, but 6 and 16 rows 1.04x; one row the same within the noise. The unrolled tiles
against that: 4 rows 0.90x, 5 rows 0.76x, 8 rows 0.88x, 16 rows 0.78x, 1, 3 and 6 rows the same.
The unrolled 6-row tile (one pass over the weights) against the 4 + 2 tiles before it: 6 rows
0.84x the time (2.71 against 3.25 ms; an EAGLE chain of 5 verifies 6 tokens), 12 rows 0.97x, 16
rows 0.97x, 1-5 rows unchanged.

Software prefetch (``PREFETCH``, per build; ``kernel_source``). AVX2: 2 KiB ahead into L1 (4 and 8
KiB, and into L2, all timed the same within 2 %, 1-6 float32 rows, Zen 3). AVX-512: 4 KiB ahead
into L2 (``_MM_HINT_T1``). Against 1 KiB ahead into L1, the first choice, the built-in target's
linears streaming from memory (47 MB, 2 threads, medians of 40 interleaved rounds, three runs) took
0.79-0.91x the time for one row and 0.92-0.93x for six. A target larger than the last-level cache that runs beside a drafter model
prefetches non-temporally instead (``NativeLinear.stream``, ``set_streaming``): its weights then
pass through without evicting the drafter's, which stay cached from one draft step to the next
(an EAGLE-3 head or a small draft model is re-read at every draft step). Only products of up to
8 rows (6 float32 rows) stream: with more, further row tiles re-read each block from cache, and a
block (K x 64 bytes) can outgrow L1, where the default prefetch keeps it in L2. Same arithmetic
either way (tested bitwise). Only the AVX-512 build streams: the AVX2 build's float32 rows keep
its one hint, as a variant prefetching with ``_MM_HINT_NTA`` (``load_variant``) measured no
different on a Zen 3 VM (the head's and the host path's data were evicted alike).

The same build holds an int8-weight op, ``linear_int8`` (quant.Int8Linear's kernel: weight-only
int8 targets and drafters): weights packed by ``pack_int8`` in blocks of 16 output columns, 16
bytes per input k; AVX2 code in both builds: each k's 16 weights sign-extended and converted to
float32 in registers, one fused multiply-add per row and weight in k order (one sum per column,
whatever the rows or threads: row-invariant), the per-column scale and the bias applied to each
sum at the end. One or two rows run over two blocks at once (four blocks at once need 8 sums, 8
widened weights and a broadcast: more than the 16 registers; two at once took 0.6-0.7x its time
for one row), up to four rows per tile; one software prefetch per 64-byte line (four k's). Measured (2 threads, AVX2
EPYC, one row): the EAGLE-3 head's linears from memory 0.64x the bf16 kernel's time on the same
weights, from cache 0.81x; the built-in target with int8 layers, compiled, 1.26-1.40x the float model's
tokens/s, where PyTorch's ``_weight_int8pack_mm`` made it 0.15-0.16x (benchmarks/quant_bench.py).

AMX (CPUs with AMX-BF16, such as Intel Xeons since Sapphire Rapids; ``kernel_amx``): the
AVX-512 BF16 build gets a second path for bf16 rows (``_AMX``): the same packed blocks, read as
B tiles of 16 k-pairs x 16 columns (a k-pair of 16 columns is 64 bytes, at a row stride of 128),
up to 16 rows per A tile and two A tiles per pass over the weights (up to 32 rows: tiles of 16 and
the rest; more: rows zero-padded to whole tiles of 16; K zero-padded to a multiple of 32),
tdpbf16ps into float32 C tiles, then the bias and one rounding as above. Every bf16-row product of the process takes it (other bits than the vdpbf16ps tiles: the
two builds are each row invariant, not equal), float32 rows keep the fused multiply-adds.
``LEAPFROG_AMX=0`` builds without it. No software prefetch: the tile loads read runs of 2 KiB,
which the hardware prefetcher follows (the 4 KiB T1 prefetch took 1.10x the time for one row and
1.18x for six). Measured (2 threads, an AMX Xeon with 480 MB of L3, the built-in target's
linears, weights from memory, ``benchmarks/linear_bench.py --rows 1 2 4 6 8 16 32``): against the
vdpbf16ps build 0.93x the time for one row (44 GB/s, the machine's copy bandwidth), 0.84x for
two, 0.66x for six, 0.58x for eight, 0.34x for 16 and 0.24x for 32 rows; one to six rows take
the same time (1.06-1.10 ms for 47 MB). oneDNN's bf16 matmul, which uses AMX too, took 2.4-3.0 ms
at every row count.

The AMX build also holds ``linear_w8a8`` (quant.W8A8Linear: ``quantization`` / ``draft_quantization``
"w8a8"; on CPUs with AMX-INT8 here, with VNNI or AVX2 below: ``w8a8_supported``): weights quantized to int8 per output column and
packed by ``pack_w8a8`` in blocks of 32 columns, a k-quad of a block 128 bytes (so 16 k-quads of 16
columns are one B tile of 64 k's for ``tdpbssd``, the same geometry as the bf16 blocks), K
zero-padded to a multiple of 64; each row quantized on the fly (16 lanes at a time: its max |x|,
then x * 127 / max rounded half to even), int8 x int8 products summed exactly in int32 on the tiles,
then float(sum) * (row scale * column scale) + bias in float32 and one rounding. Exact integer sums
make the result independent of the order, the rows and the threads (bitwise
``quant.w8a8_reference``). Measured (2 threads, the AMX Xeon, the built-in EAGLE-3 head's five
linears of a draft level: 4.2 MB of int8 against 8.4 MB of bf16): one row 63 us against 178 us for
the bf16 tiles, six rows 74 against 182, 16 rows 95 against 213.

Without the AMX-INT8 tiles (AMD Zen 4 and later, Intel Cooper Lake; or Linux not lending the tile
state) every AVX-512 BF16 build sums the same products with AVX-512 VNNI (``v8_range``):
``vpdpbusd`` multiplies unsigned by signed bytes, so each row is offset to q + 128 (``q8_unsigned``)
and each column subtracts 128 x its weights' sum, taken by the same instruction on bytes of 128
while the block's first row tile streams it. The sums are the same exact int32 values, so the bits
are the tiles' (K up to 65536: the offset rows' sums must stay in int32). Up to 8 rows per pass over
a block, two 16-column sums per row in registers, one software prefetch 4 KiB ahead into L2 per
k-quad. Measured (2 threads, a 2-vCPU AVX-512 EPYC, the head's five linears of a level, one call
each): one row 74 us against 105 us for the vdpbf16ps tiles, four rows 84 against 129, eight rows
174 against 206, 16 rows 268 against 365; 8192 x 2048 from memory 163 against 363 us. About 4.5 us
of each call is the op's fixed cost (the row's quantization, the buffers, the threads).

The AVX2 build holds ``linear_w8a8`` too (``_Q8_AVX2``, every CPU without AVX-512 BF16 that runs the
AVX2 build: ``w8a8_supported``), on
the same packed weights and with the same rows' quantization and epilogue, so the same bits (no
VNNI there): 32 bytes of a k-quad (8 columns x 4 k's) against the row's four int8 broadcast,
``vpmaddubsw`` on |w| (unsigned) and the row's values carrying w's signs (``vpsignb``; a pair's
sum at most 2 x 127 x 127, so never saturated), then ``vpmaddwd`` by ones into the column's int32
sum; two rows per pass over a block. Sign-extending the weights to 16-bit lanes for ``vpmaddwd``
instead took 1.27x the time from L3 and 1.45x from L2 (single thread, Zen 3). Measured (2-vCPU AVX2
EPYC, Zen 3, float32 rows, one call each, the EAGLE-3 head's five linears of a level and its fc):
one row 159 us against 234 us for the bf16 kernel's float32 rows, six rows 521 against 657; its
4096 x 512 LM head alone one row 49 against 101 us (single thread 68 against 147). The head's
chain of 5 drafts in 1.97 ms against 2.32 (``step_bench.py``), the same tokens a step to 0.5 %.

It is built once per instruction set with ``torch.utils.cpp_extension.load_inline`` (about 20 s,
cached under ``TORCH_EXTENSIONS_DIR``) for the CPU's best (``/proc/cpuinfo``: AVX-512 BF16, else
AVX2 with FMA); elsewhere, or if the build fails (logged), callers keep their other linears;
``LEAPFROG_NATIVE_LINEAR=0`` turns it off, and ``ATEN_CPU_CAPABILITY`` capping PyTorch's kernels
below an instruction set caps ours too.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor, nn

from leapfrog.utils import env_off
from leapfrog.utils.cpp import load_inline, with_namespace

log = logging.getLogger("leapfrog.model")

#: output columns per packed block, per instruction set: AVX-512 BF16 32 (a 64-byte load holds a
#: k-pair of 16 columns for vdpbf16ps), AVX2 16 (one 64-byte line a k-pair: a block streams as
#: one contiguous run, and 5 float32 rows x 16 columns fit the 16 ymm registers)
BLOCK_COLUMNS = {"avx512_bf16": 32, "avx2": 16}
#: output columns per block of the int8-weight op (both builds: AVX2 code)
INT8_BLOCK_COLUMNS = 16

_HEADER = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#ifndef LEAPFROG_AMX
#define LEAPFROG_AMX 0   // the AMX tiles for bf16 rows (kernel_source's amx)
#endif
#ifndef LEAPFROG_W8A8
#define LEAPFROG_W8A8 0  // linear_w8a8: the AVX-512 BF16 build (VNNI, and AMX-INT8 with amx)
#endif
#ifndef LEAPFROG_W8A8_AVX2
#define LEAPFROG_W8A8_AVX2 0  // linear_w8a8: the AVX2 build (vpmaddubsw)
#endif

constexpr int64_t W8_BLOCK = 32;   // output columns per packed int8 block of linear_w8a8 (pack_w8a8)
constexpr int64_t Q8_K = 64;       // linear_w8a8's K is zero-padded to a multiple (one AMX B tile's 16 k-quads)

"""

_AVX512_BF16 = r"""
#define LEAPFROG_BF16_ROWS 1   // bf16 rows: vdpbf16ps
#define LEAPFROG_F32_RANGE 0   // float32 rows: TILES_F32 per block, below

namespace {

constexpr int64_t BLOCK = 32;     // output columns per packed block (two 16-lane vectors)
constexpr int64_t ROWS = 8;       // bf16 rows per register tile: 8 x 4 accumulators
constexpr int64_t ROWS_F32 = 6;   // float32 rows per tile: 6 x 4 accumulators + 4 widened weights
constexpr int64_t PREFETCH = @PREFETCH@;   // bf16 elements ahead in the weight stream (kernel_source)

// The weight stream's software prefetch: kernel_source's hint, or with STREAM non-temporal (a
// model larger than the last-level cache: its weights pass through without evicting what stays,
// such as a drafter's weights; NativeLinear.stream)
template <bool STREAM>
inline void prefetch(const uint16_t* p) {
  if constexpr (STREAM) _mm_prefetch((const char*)p, _MM_HINT_NTA);
  else @PREFETCH_CALL@;
}

inline __m512i pair(const uint16_t* p) {   // a k-pair of one row broadcast to the 16 lanes
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

inline __mmask16 lanes(int64_t k) {   // the first k of 16 lanes
  return k >= 16 ? (__mmask16)0xFFFF : k <= 0 ? (__mmask16)0 : (__mmask16)((1u << k) - 1);
}

// A block's epilogue: the two partial sums of each half added, then the bias (float32); the
// lanes of the block's valid columns (cols of 32).
struct Block {
  __mmask16 lo_mask, hi_mask;
  __m512 b_lo, b_hi;
  bool has_bias;
  Block(const float* bias, int64_t cols)
      : lo_mask(lanes(cols)), hi_mask(lanes(cols - 16)), has_bias(bias != nullptr) {
    b_lo = bias ? _mm512_maskz_loadu_ps(lo_mask, bias) : _mm512_setzero_ps();
    b_hi = bias ? _mm512_maskz_loadu_ps(hi_mask, bias + 16) : _mm512_setzero_ps();
  }
  __m512 lo(__m512 a, __m512 b) const { return sum(a, b, b_lo); }
  __m512 hi(__m512 a, __m512 b) const { return sum(a, b, b_hi); }
  __m512 sum(__m512 a, __m512 b, __m512 bias) const {
    const __m512 s = _mm512_add_ps(a, b);
    return has_bias ? _mm512_add_ps(s, bias) : s;
  }
};

// A tile's four accumulators per row (two partial sums for each half of the block), zeroed.
template <int M>
inline void zero(__m512 (&c0)[M], __m512 (&c1)[M], __m512 (&c2)[M], __m512 (&c3)[M]) {
  for (int m = 0; m < M; ++m) {
    c0[m] = _mm512_setzero_ps(); c1[m] = _mm512_setzero_ps();
    c2[m] = _mm512_setzero_ps(); c3[m] = _mm512_setzero_ps();
  }
}

inline __m512 dot(__m512 acc, __m512i a, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)w);
}

// C[m, 0:cols] = A[m, :] . block + bias for m < M.  A: bf16 rows (stride lda); blk: one packed
// block [K2][32][2]; C: bf16 (stride ldc), or float32 with F32OUT (the sums not rounded: an LM
// head's logits); cols <= 32 valid columns of the block.
template <int M, bool F32OUT, bool STREAM>
void tile(const uint16_t* A, int64_t lda, const uint16_t* blk, int64_t K2, const float* bias,
          void* Cv, int64_t ldc, int64_t cols) {
  __m512 c0[M], c1[M], c2[M], c3[M];
  zero(c0, c1, c2, c3);
  int64_t kk = 0;
  for (; kk + 2 <= K2; kk += 2) {
    const uint16_t* w = blk + kk * 2 * BLOCK;
    prefetch<STREAM>(w + PREFETCH);
    prefetch<STREAM>(w + PREFETCH + 32);
    prefetch<STREAM>(w + PREFETCH + 64);
    prefetch<STREAM>(w + PREFETCH + 96);
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 32);
    const __m512i w2 = _mm512_loadu_si512(w + 64), w3 = _mm512_loadu_si512(w + 96);
    for (int m = 0; m < M; ++m) {
      const __m512i a = pair(A + m * lda + 2 * kk), b = pair(A + m * lda + 2 * kk + 2);
      c0[m] = dot(c0[m], a, w0); c1[m] = dot(c1[m], a, w1);
      c2[m] = dot(c2[m], b, w2); c3[m] = dot(c3[m], b, w3);
    }
  }
  if (kk < K2) {   // an odd number of k-pairs: the last one
    const uint16_t* w = blk + kk * 2 * BLOCK;
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 32);
    for (int m = 0; m < M; ++m) {
      const __m512i a = pair(A + m * lda + 2 * kk);
      c0[m] = dot(c0[m], a, w0); c1[m] = dot(c1[m], a, w1);
    }
  }
  const Block o(bias, cols);
  for (int m = 0; m < M; ++m) {
    if constexpr (F32OUT) {
      float* C = static_cast<float*>(Cv) + m * ldc;
      _mm512_mask_storeu_ps(C, o.lo_mask, o.lo(c0[m], c2[m]));
      _mm512_mask_storeu_ps(C + 16, o.hi_mask, o.hi(c1[m], c3[m]));
    } else {
      uint16_t* C = static_cast<uint16_t*>(Cv) + m * ldc;
      _mm256_mask_storeu_epi16(C, o.lo_mask, (__m256i)_mm512_cvtneps_pbh(o.lo(c0[m], c2[m])));
      _mm256_mask_storeu_epi16(C + 16, o.hi_mask, (__m256i)_mm512_cvtneps_pbh(o.hi(c1[m], c3[m])));
    }
  }
}

// C[m, 0:cols] = A[m, :] . block + bias for m < M, float32 rows: the bf16 weights widened to
// float32 in registers (exact), products and sums in float32 (fused multiply-adds). Partial sums:
// even k into c0/c1, odd k into c2/c3, added at the end.
template <int M, bool STREAM>
void tile_f32(const float* A, int64_t lda, const uint16_t* blk, int64_t K2, const float* bias,
              float* C, int64_t ldc, int64_t cols) {
  __m512 c0[M], c1[M], c2[M], c3[M];
  zero(c0, c1, c2, c3);
  const __m512i high = _mm512_set1_epi32((int32_t)0xFFFF0000u);
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* w = blk + kk * 2 * BLOCK;
    prefetch<STREAM>(w + PREFETCH);
    prefetch<STREAM>(w + PREFETCH + 32);
    const __m512i v0 = _mm512_loadu_si512(w), v1 = _mm512_loadu_si512(w + 32);
    const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));   // w[c, 2kk], c < 16
    const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));   // c >= 16
    const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high));  // w[c, 2kk + 1]
    const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_set1_ps(A[m * lda + 2 * kk]), b = _mm512_set1_ps(A[m * lda + 2 * kk + 1]);
      c0[m] = _mm512_fmadd_ps(a, e0, c0[m]); c1[m] = _mm512_fmadd_ps(a, e1, c1[m]);
      c2[m] = _mm512_fmadd_ps(b, o0, c2[m]); c3[m] = _mm512_fmadd_ps(b, o1, c3[m]);
    }
  }
  const Block o(bias, cols);
  for (int m = 0; m < M; ++m) {
    _mm512_mask_storeu_ps(C + m * ldc, o.lo_mask, o.lo(c0[m], c2[m]));
    _mm512_mask_storeu_ps(C + m * ldc + 16, o.hi_mask, o.hi(c1[m], c3[m]));
  }
}

using Tile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, void*, int64_t, int64_t);
#define LEAPFROG_TILES(F, S) \
  {nullptr, tile<1, F, S>, tile<2, F, S>, tile<3, F, S>, tile<4, F, S>, tile<5, F, S>, tile<6, F, S>, \
   tile<7, F, S>, tile<8, F, S>}
constexpr Tile TILES[2][2][ROWS + 1] = {   // [STREAM][F32OUT][rows]
    {LEAPFROG_TILES(false, false), LEAPFROG_TILES(true, false)},
    {LEAPFROG_TILES(false, true), LEAPFROG_TILES(true, true)}};
using TileF32 = void (*)(const float*, int64_t, const uint16_t*, int64_t, const float*, float*, int64_t, int64_t);
#define LEAPFROG_TILES_F32(S) \
  {nullptr, tile_f32<1, S>, tile_f32<2, S>, tile_f32<3, S>, tile_f32<4, S>, tile_f32<5, S>, tile_f32<6, S>}
constexpr TileF32 TILES_F32[2][ROWS_F32 + 1] = {LEAPFROG_TILES_F32(false), LEAPFROG_TILES_F32(true)};  // [STREAM][rows]

}  // namespace
"""

_AVX2 = r"""
#define LEAPFROG_BF16_ROWS 0   // bf16 rows are widened to float32 first (no bf16 dot product)
#define LEAPFROG_F32_RANGE 1   // float32 rows: f32_range serves each thread's blocks

namespace {

constexpr int64_t BLOCK = 16;      // output columns per packed block: two 8-lane vectors, one 64-byte line a k-pair
constexpr int64_t ROWS_F32 = 6;    // float32 rows per tile: 6 x 2 accumulators (16 ymm registers in all)
constexpr int64_t ROWS = ROWS_F32;
constexpr int64_t PREFETCH = @PREFETCH@;   // bf16 elements ahead in each block's weight stream (kernel_source)

inline void prefetch(const uint16_t* p) { @PREFETCH_CALL@; }   // kernel_source's hint

// C[m, 0:cols] = A[m, :] . W + bias for m < M over NB consecutive blocks (blk: the first; cols:
// the columns kept, at most NB x BLOCK). Each k-pair's weights are widened to float32 in registers
// (exact: even k = the low bf16 shifted up, odd k = the high one masked), then per row and 8-column
// vector one fused multiply-add for k = 2kk and one for 2kk + 1 into the same accumulator: per
// column one sum, k in order, whatever M and NB (row invariance); the bias (float32) last.
// H: rows' broadcasts held across the vectors (M <= 2, several blocks: more independent sums);
// else each parity's vectors held across the rows (M <= 5, one block).
template <int M, int NB, bool H>
void tile_f32(const float* A, int64_t lda, const uint16_t* blk, int64_t K2, const float* bias,
              float* C, int64_t ldc, int64_t cols) {
  constexpr int V = NB * 2;                // 8-lane column vectors
  const int64_t bstride = K2 * 2 * BLOCK;  // elements from one block to the next
  __m256 c[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) c[m][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32((int32_t)0xFFFF0000u);
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* w = blk + kk * 2 * BLOCK;
    for (int b = 0; b < NB; ++b) prefetch(w + b * bstride + PREFETCH);
    if constexpr (H) {
      __m256 a[M], b[M];
      for (int m = 0; m < M; ++m) {
        a[m] = _mm256_broadcast_ss(A + m * lda + 2 * kk);
        b[m] = _mm256_broadcast_ss(A + m * lda + 2 * kk + 1);
      }
      for (int v = 0; v < V; ++v) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + (v / 2) * bstride + 16 * (v % 2)));
        const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        for (int m = 0; m < M; ++m) c[m][v] = _mm256_fmadd_ps(a[m], e, c[m][v]);
        const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
        for (int m = 0; m < M; ++m) c[m][v] = _mm256_fmadd_ps(b[m], o, c[m][v]);
      }
    } else {
      __m256 x[V];
      for (int v = 0; v < V; ++v)
        x[v] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_loadu_si256((const __m256i*)(w + (v / 2) * bstride + 16 * (v % 2))), 16));
      for (int m = 0; m < M; ++m) {
        const __m256 a = _mm256_broadcast_ss(A + m * lda + 2 * kk);
        for (int v = 0; v < V; ++v) c[m][v] = _mm256_fmadd_ps(a, x[v], c[m][v]);
      }
      for (int v = 0; v < V; ++v)
        x[v] = _mm256_castsi256_ps(_mm256_and_si256(
            _mm256_loadu_si256((const __m256i*)(w + (v / 2) * bstride + 16 * (v % 2))), high));
      for (int m = 0; m < M; ++m) {
        const __m256 b = _mm256_broadcast_ss(A + m * lda + 2 * kk + 1);
        for (int v = 0; v < V; ++v) c[m][v] = _mm256_fmadd_ps(b, x[v], c[m][v]);
      }
    }
  }
  alignas(32) float bb[NB * BLOCK] = {0}, out[NB * BLOCK];
  if (bias != nullptr) std::memcpy(bb, bias, cols * sizeof(float));
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < V; ++v) _mm256_store_ps(out + 8 * v, _mm256_add_ps(c[m][v], _mm256_load_ps(bb + 8 * v)));
    std::memcpy(C + m * ldc, out, cols * sizeof(float));
  }
}

// tile_f32<M, 1, false> for tiles of 4 to 6 rows with every loop unrolled, so that the sums live
// in registers only: as written above, GCC keeps a copy of c[][] on the stack for these and stores
// every sum to it on each k-pair (the epilogue's loops index it); unrolled, 5 rows took 0.74-0.79x
// the time. Six rows' 12 sums, two widened weights and a broadcast take 15 of the 16 registers:
// their odd k's are widened by two shifts instead of a mask held in a register (one 6-row pass
// over the weights took 0.84x the time of the 4 + 2 tiles before it). (Unrolled the same way,
// tiles of 1-3 rows ran 1.05-1.4x slower, for reasons not found: they keep the form above.) Same
// sums in the same order.
#define UNROLL _Pragma("GCC unroll 16")
template <int M>
void tile_f32_unrolled(const float* A, int64_t lda, const uint16_t* blk, int64_t K2, const float* bias,
                       float* C, int64_t ldc, int64_t cols) {
  __m256 c[M][2];
  UNROLL for (int m = 0; m < M; ++m) c[m][0] = c[m][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32((int32_t)0xFFFF0000u);
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* w = blk + kk * 2 * BLOCK;
    prefetch(w + PREFETCH);
    const __m256i w0 = _mm256_loadu_si256((const __m256i*)w), w1 = _mm256_loadu_si256((const __m256i*)(w + 16));
    __m256 x0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), x1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    UNROLL for (int m = 0; m < M; ++m) {
      const __m256 a = _mm256_broadcast_ss(A + m * lda + 2 * kk);
      c[m][0] = _mm256_fmadd_ps(a, x0, c[m][0]);
      c[m][1] = _mm256_fmadd_ps(a, x1, c[m][1]);
    }
    if constexpr (M >= 6) {   // 12 sums: the odd k's by two shifts, freeing the mask's register
      x0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(w0, 16), 16));
      x1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(w1, 16), 16));
    } else {
      x0 = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
      x1 = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
    }
    UNROLL for (int m = 0; m < M; ++m) {
      const __m256 b = _mm256_broadcast_ss(A + m * lda + 2 * kk + 1);
      c[m][0] = _mm256_fmadd_ps(b, x0, c[m][0]);
      c[m][1] = _mm256_fmadd_ps(b, x1, c[m][1]);
    }
  }
  alignas(32) float bb[BLOCK] = {0}, out[M][BLOCK];
  if (bias != nullptr) std::memcpy(bb, bias, cols * sizeof(float));
  UNROLL for (int m = 0; m < M; ++m) {
    _mm256_store_ps(out[m], _mm256_add_ps(c[m][0], _mm256_load_ps(bb)));
    _mm256_store_ps(out[m] + 8, _mm256_add_ps(c[m][1], _mm256_load_ps(bb + 8)));
  }
  for (int m = 0; m < M; ++m) std::memcpy(C + m * ldc, out[m], cols * sizeof(float));
}

// M rows over blocks [b0, b1): NB blocks per tile while they last, then one
template <int M, int NB, bool H>
void rows_over(const float* A, int64_t K, const uint16_t* W, int64_t K2, int64_t b0, int64_t b1,
               const float* bp, float* C, int64_t n) {
  int64_t b = b0;
  if constexpr (M >= 4) {   // (NB = 1; the general tile_f32 is not instantiated for these)
    for (; b < b1; ++b)
      tile_f32_unrolled<M>(A, K, W + b * K2 * 2 * BLOCK, K2, bp ? bp + b * BLOCK : nullptr, C + b * BLOCK, n,
                           std::min<int64_t>(BLOCK, n - b * BLOCK));
  } else {
    for (; b + NB <= b1; b += NB)
      tile_f32<M, NB, H>(A, K, W + b * K2 * 2 * BLOCK, K2, bp ? bp + b * BLOCK : nullptr, C + b * BLOCK, n,
                         std::min<int64_t>(NB * BLOCK, n - b * BLOCK));
    for (; b < b1; ++b)
      tile_f32<M, 1, H>(A, K, W + b * K2 * 2 * BLOCK, K2, bp ? bp + b * BLOCK : nullptr, C + b * BLOCK, n,
                        std::min<int64_t>(BLOCK, n - b * BLOCK));
  }
}

// float32 rows [M, K] x blocks [b0, b1) -> C[:, 16 b0 : 16 b1]: up to 6 rows in one tile, more in
// tiles of 6, 5 or 4 and one of 2 where needed, never 3 or 1 beside others (their few sums wait on
// each other: 7 rows run as 5 + 2, 8 as 4 + 4 (6 + 2 took 1.04x the time), 9 as 5 + 4, 16 as
// 6 + 6 + 4); with several tiles, blocks in chunks of about
// 256 KiB, each chunk through every tile while it stays in L2 (each weight read once from memory)
void f32_range(const float* A, int64_t M, int64_t K, const uint16_t* W, int64_t K2, int64_t b0, int64_t b1,
               const float* bp, float* C, int64_t n) {
  const int64_t chunk = M <= ROWS_F32 ? b1 - b0 : std::max<int64_t>(4, (256 << 10) / (K2 * 4 * BLOCK));
  for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
    const int64_t c1 = std::min(b1, c0 + chunk);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t rest = M - m0;
      const int64_t r = rest <= ROWS_F32 ? rest : rest == 8 ? 4 : (rest == 7 || rest == 9) ? 5 : ROWS_F32;
      const float* At = A + m0 * K;
      float* Ct = C + m0 * n;
      switch (r) {
        case 1: rows_over<1, 4, true>(At, K, W, K2, c0, c1, bp, Ct, n); break;
        case 2: rows_over<2, 2, true>(At, K, W, K2, c0, c1, bp, Ct, n); break;
        case 3: rows_over<3, 1, false>(At, K, W, K2, c0, c1, bp, Ct, n); break;
        case 4: rows_over<4, 1, false>(At, K, W, K2, c0, c1, bp, Ct, n); break;
        case 5: rows_over<5, 1, false>(At, K, W, K2, c0, c1, bp, Ct, n); break;
        default: rows_over<6, 1, false>(At, K, W, K2, c0, c1, bp, Ct, n); break;
      }
      m0 += r;
    }
  }
}

}  // namespace
"""


_Q8 = r"""
// ---- W8A8 (int8 rows x int8 weights: quant.W8A8Linear, linear_w8a8), the AVX-512 BF16 build: the
// rows' quantization and the epilogue, shared by the AMX-INT8 tiles (_AMX: q8_range) and the
// AVX-512 VNNI dot products (v8_range, below). Weights packed by pack_w8a8: [N/32, Kp/4, 32, 4] int8
// (K zero-padded to Kp, a multiple of 64): a k-quad of a block's 32 columns is 128 bytes, the four
// int8 of one column's k-quad side by side (the layout of both tdpbssd's B tiles and vpdpbusd's
// second operand). Sums in int32: exact, whatever the order, so a row's result depends on that row
// and the weights only, and both paths give the same bits (quant.w8a8_reference).
namespace {


// One row quantized: q[k] = round-half-even(x[k] * (127 / max |x|)) in [-127, 127] (zeros past K, and
// for an all-zero row or one so small that 127 / max |x| overflows) -> its scale max |x| / 127 (or 0), float32 throughout (quant.w8a8_reference); 16
// lanes at a time (the max is exact in any order, the rest is per element). A row holding a NaN or
// an infinity gets scale NaN (zeros in q): its outputs are NaN, as the float product's would be.
template <typename T>
float q8_row(const T* x, int64_t K, int8_t* q, int64_t Kp) {
  auto load = [x](int64_t k, __mmask16 m) -> __m512 {
    if constexpr (std::is_same_v<T, float>) {
      return _mm512_maskz_loadu_ps(m, x + k);
    } else {   // bf16: the high half of a float32
      const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + k));
      return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    }
  };
  __m512 mx = _mm512_setzero_ps();
  __mmask16 nan = 0;   // (maxps drops a NaN operand: they are counted apart)
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = _mm512_abs_ps(load(k, lanes(K - k)));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  const float amax = _mm512_reduce_max_ps(mx);
  std::memset(q, 0, Kp);
  if (nan || !std::isfinite(amax)) return std::numeric_limits<float>::quiet_NaN();
  if (!(amax > 0.f) || !std::isfinite(127.f / amax)) return 0.f;   // (under 127 / FLT_MAX: as zeros)
  const __m512 inv = _mm512_set1_ps(127.f / amax);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = lanes(K - k);
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load(k, m), inv));   // nearest-even (MXCSR default)
    _mm_mask_storeu_epi8(q + k, m, _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi)));
  }
  return amax / 127.f;
}

// A block's epilogue: y[m, n] = float(sum) * (sa[m] * sw[n]) + bias[n] in float32, then rounded once
// to bf16 (or stored as float32 with f32_out); the lanes of the block's valid columns
struct Q8Epilogue {
  __mmask16 lo_mask, hi_mask;
  __m512 sw_lo, sw_hi, b_lo, b_hi;
  bool has_bias, f32_out;
  Q8Epilogue(const float* sw, const float* bp, int64_t nb, int64_t n, bool f32)
      : has_bias(bp != nullptr), f32_out(f32) {
    const int64_t cols = std::min<int64_t>(BLOCK, n - nb * BLOCK);
    lo_mask = lanes(cols);
    hi_mask = lanes(cols - 16);
    sw_lo = _mm512_maskz_loadu_ps(lo_mask, sw + nb * BLOCK);
    sw_hi = _mm512_maskz_loadu_ps(hi_mask, sw + nb * BLOCK + 16);
    b_lo = bp ? _mm512_maskz_loadu_ps(lo_mask, bp + nb * BLOCK) : _mm512_setzero_ps();
    b_hi = bp ? _mm512_maskz_loadu_ps(hi_mask, bp + nb * BLOCK + 16) : _mm512_setzero_ps();
  }
  // one row's 32 int32 sums (low, high 16 columns) with its scale sa, to element offset at of C
  void store(__m512i sum_lo, __m512i sum_hi, float sa, void* Cv, int64_t at) const {
    const __m512 s = _mm512_set1_ps(sa);
    __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(sum_lo), _mm512_mul_ps(s, sw_lo));
    __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(sum_hi), _mm512_mul_ps(s, sw_hi));
    if (has_bias) {   // (the product rounded before the bias: no fused multiply-add, as the reference)
      asm volatile("" : "+v"(lo), "+v"(hi));
      lo = _mm512_add_ps(lo, b_lo);
      hi = _mm512_add_ps(hi, b_hi);
    }
    if (f32_out) {
      float* C = static_cast<float*>(Cv) + at;
      _mm512_mask_storeu_ps(C, lo_mask, lo);
      _mm512_mask_storeu_ps(C + 16, hi_mask, hi);
    } else {
      uint16_t* C = static_cast<uint16_t*>(Cv) + at;
      _mm256_mask_storeu_epi16(C, lo_mask, (__m256i)_mm512_cvtneps_pbh(lo));
      _mm256_mask_storeu_epi16(C + 16, hi_mask, (__m256i)_mm512_cvtneps_pbh(hi));
    }
  }
};

// AVX-512 VNNI (no AMX-INT8, or no tile state lent): vpdpbusd multiplies unsigned by signed bytes,
// so the rows come offset by 128 (U = q ^ 0x80 = q + 128 in [1, 255]: q8_unsigned) and each column
// subtracts 128 x its weights' sum, taken by the same instruction on bytes of 128 in the block's
// first row tile: sum_k q w = sum_k U w - 128 sum_k w, exact in int32 (|sum| < Kp x 255 x 127, so
// Kp <= 65536: linear_w8a8 checks). Up to V8_ROWS rows per pass over a block (2 sums each, in
// registers), k-quads in order.
constexpr int64_t V8_ROWS = 8;
constexpr int64_t V8_AHEAD = 4096;   // bytes ahead in the block's stream (software prefetch into L2)

void q8_unsigned(int8_t* q, int64_t n) {   // q + 128 as unsigned bytes, in place
  for (int64_t k = 0; k < n; k += 64) {
    const __mmask64 m = n - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n - k)) - 1);
    _mm512_mask_storeu_epi8(q + k, m, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, q + k), _mm512_set1_epi8((char)0x80)));
  }
}

template <int R, bool COMP>
void v8_tile(const uint8_t* U, int64_t Kp, const int8_t* blk, const float* sa, const Q8Epilogue& e,
             __m512i* comp, void* Cv, int64_t at, int64_t n) {
  __m512i c[R][2], k_lo = _mm512_setzero_si512(), k_hi = _mm512_setzero_si512();
  _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) c[m][0] = c[m][1] = _mm512_setzero_si512();
  const __m512i offset = _mm512_set1_epi8((char)0x80);
  for (int64_t j = 0; j < Kp / 4; ++j) {
    const int8_t* w = blk + j * 4 * BLOCK;
    _mm_prefetch((const char*)(w + V8_AHEAD), _MM_HINT_T1);
    const __m512i w_lo = _mm512_loadu_si512(w), w_hi = _mm512_loadu_si512(w + 64);   // (a view may be unaligned)
    if constexpr (COMP) {
      k_lo = _mm512_dpbusd_epi32(k_lo, offset, w_lo);
      k_hi = _mm512_dpbusd_epi32(k_hi, offset, w_hi);
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {
      int32_t v;
      std::memcpy(&v, U + m * Kp + 4 * j, sizeof v);
      const __m512i a = _mm512_set1_epi32(v);
      c[m][0] = _mm512_dpbusd_epi32(c[m][0], a, w_lo);
      c[m][1] = _mm512_dpbusd_epi32(c[m][1], a, w_hi);
    }
  }
  if constexpr (COMP) { comp[0] = k_lo; comp[1] = k_hi; }
  _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m)
    e.store(_mm512_sub_epi32(c[m][0], comp[0]), _mm512_sub_epi32(c[m][1], comp[1]), sa[m], Cv, at + m * n);
}

template <bool COMP>
void v8_rows(int64_t R, const uint8_t* U, int64_t Kp, const int8_t* blk, const float* sa, const Q8Epilogue& e,
             __m512i* comp, void* Cv, int64_t at, int64_t n) {
  switch (R) {
    case 1: v8_tile<1, COMP>(U, Kp, blk, sa, e, comp, Cv, at, n); break;
    case 2: v8_tile<2, COMP>(U, Kp, blk, sa, e, comp, Cv, at, n); break;
    case 3: v8_tile<3, COMP>(U, Kp, blk, sa, e, comp, Cv, at, n); break;
    case 4: v8_tile<4, COMP>(U, Kp, blk, sa, e, comp, Cv, at, n); break;
    case 5: v8_tile<5, COMP>(U, Kp, blk, sa, e, comp, Cv, at, n); break;
    case 6: v8_tile<6, COMP>(U, Kp, blk, sa, e, comp, Cv, at, n); break;
    case 7: v8_tile<7, COMP>(U, Kp, blk, sa, e, comp, Cv, at, n); break;
    default: v8_tile<8, COMP>(U, Kp, blk, sa, e, comp, Cv, at, n); break;
  }
}

// rows U [M, Kp] (q8_unsigned) on blocks [b0, b1) of this thread, each block once from memory for
// all rows (further row tiles re-read it from cache)
void v8_range(const uint8_t* U, const float* sa, int64_t M, int64_t Kp, const int8_t* W, int64_t b0, int64_t b1,
              const float* sw, const float* bp, void* Cv, int64_t n, bool f32_out) {
  for (int64_t nb = b0; nb < b1; ++nb) {
    const int8_t* blk = W + nb * Kp * BLOCK;
    const Q8Epilogue e(sw, bp, nb, n, f32_out);
    __m512i comp[2];
    for (int64_t m0 = 0; m0 < M; m0 += V8_ROWS) {
      const int64_t R = std::min(V8_ROWS, M - m0);
      if (m0 == 0) v8_rows<true>(R, U, Kp, blk, sa, e, comp, Cv, nb * BLOCK, n);
      else v8_rows<false>(R, U + m0 * Kp, Kp, blk, sa + m0, e, comp, Cv, m0 * n + nb * BLOCK, n);
    }
  }
}

}  // namespace
"""

_Q8_AVX2 = r"""
// ---- W8A8 (int8 rows x int8 weights: quant.W8A8Linear, linear_w8a8), the AVX2 build (no VNNI):
// the same weights packed by pack_w8a8 ([N/32, Kp/4, 32, 4] int8: a k-quad of a block's 32
// columns is 128 bytes, one column's four int8 side by side), the same rows' quantization and the
// same epilogue as the AVX-512 build (quant.w8a8_reference: the same bits). 32 bytes of a k-quad
// (8 columns x 4 k's) against the row's four int8 broadcast to the 8 lanes: vpmaddubsw multiplies
// |w| (unsigned) by the row's values with w's signs (vpsignb) and adds pairs into int16 (|a pair|
// <= 2 x 127 x 127 = 32258: never saturates), vpmaddwd by ones adds the two pairs of a column into
// int32, added to the column's sum. Every product and sum is exact (a column's sum at most Kp x
// 16129, Kp <= 65536), so the order does not matter: the result depends on the row and the weights
// only. Two rows per pass over a block (8 sums, the weights' absolute values shared), one left over.
namespace {

// One float32 row quantized as q8_row: q[k] = round-half-even(x[k] * (127 / max |x|)) in [-127, 127]
// (zeros past K, and for an all-zero row or one under 127 / FLT_MAX) -> its scale, float32 throughout; a row holding a
// NaN or an infinity gets scale NaN (zeros in q): NaN outputs
float q8_row8(const float* x, int64_t K, int8_t* q, int64_t Kp) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  int nan = 0;   // (maxps drops a NaN operand: they are counted apart)
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + k), absmask);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  alignas(32) float lane[8];
  _mm256_store_ps(lane, mx);
  float amax = 0.f;
  for (int i = 0; i < 8; ++i) amax = std::max(amax, lane[i]);
  for (; k < K; ++k) {
    const float v = std::fabs(x[k]);
    if (std::isnan(v)) nan = 1;
    else amax = std::max(amax, v);
  }
  std::memset(q, 0, Kp);
  if (nan || !std::isfinite(amax)) return std::numeric_limits<float>::quiet_NaN();
  if (!(amax > 0.f) || !std::isfinite(127.f / amax)) return 0.f;   // (under 127 / FLT_MAX: as zeros)
  const float inv_s = 127.f / amax;
  const __m256 inv = _mm256_set1_ps(inv_s);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (k = 0; k + 8 <= K; k += 8) {
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), inv));   // nearest-even (MXCSR default)
    v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i*)(q + k), _mm_packs_epi16(h, h));
  }
  for (; k < K; ++k) q[k] = (int8_t)std::min(127.f, std::max(-127.f, std::nearbyint(x[k] * inv_s)));
  return amax / 127.f;
}

// S[m, 0:32] = int32 sums of rows A[m] (int8, stride Kp) against one block, m < R (R <= 2: 4 R
// sums, R broadcasts, a weight vector, its absolute values and ones in the 16 registers)
template <int R>
void w2_tile(const int8_t* A, int64_t Kp, const int8_t* blk, int32_t* S) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i c[R][4];
  _Pragma("GCC unroll 2") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 4") for (int h = 0; h < 4; ++h) c[m][h] = _mm256_setzero_si256();
  for (int64_t j = 0; j < Kp / 4; ++j) {
    const int8_t* w = blk + j * 4 * W8_BLOCK;
    __m256i a[R];
    _Pragma("GCC unroll 2") for (int m = 0; m < R; ++m) {
      int32_t v;
      std::memcpy(&v, A + m * Kp + 4 * j, sizeof v);
      a[m] = _mm256_set1_epi32(v);
    }
    _Pragma("GCC unroll 4") for (int h = 0; h < 4; ++h) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + 32 * h)), aw = _mm256_abs_epi8(wv);
      _Pragma("GCC unroll 2") for (int m = 0; m < R; ++m)
        c[m][h] = _mm256_add_epi32(c[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(a[m], wv)), ones));
    }
  }
  _Pragma("GCC unroll 2") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 4") for (int h = 0; h < 4; ++h)
      _mm256_storeu_si256((__m256i*)(S + m * W8_BLOCK + 8 * h), c[m][h]);
}

// one row's 32 int32 sums S with its scale sa: y = float(sum) * (sa * sw) + bias (float32, the
// product rounded before the bias: no fused multiply-add, as the reference), cols to C
void w2_store(const int32_t* S, float sa, const float* sw, const float* bb, float* C, int64_t cols) {
  alignas(32) float out[W8_BLOCK];
  const __m256 s = _mm256_set1_ps(sa);
  for (int v = 0; v < W8_BLOCK / 8; ++v) {
    __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(S + 8 * v))),
                             _mm256_mul_ps(s, _mm256_load_ps(sw + 8 * v)));
    if (bb != nullptr) {
      asm volatile("" : "+x"(y));
      y = _mm256_add_ps(y, _mm256_load_ps(bb + 8 * v));
    }
    _mm256_store_ps(out + 8 * v, y);
  }
  std::memcpy(C, out, cols * sizeof(float));
}

// rows A [M, Kp] (int8, q8_row8) with scales sa on blocks [b0, b1) of this thread, two rows a pass
// over a block (read once from memory, then from cache), one left over; C [M, n] float32
void w2_range(const int8_t* A, const float* sa, int64_t M, int64_t Kp, const int8_t* W, int64_t b0, int64_t b1,
              const float* sw, const float* bp, float* C, int64_t n) {
  alignas(32) int32_t S[2 * W8_BLOCK];
  alignas(32) float swb[W8_BLOCK], bbb[W8_BLOCK];
  for (int64_t nb = b0; nb < b1; ++nb) {
    const int8_t* blk = W + nb * Kp * W8_BLOCK;
    const int64_t cols = std::min<int64_t>(W8_BLOCK, n - nb * W8_BLOCK);
    std::memset(swb, 0, sizeof swb);
    std::memset(bbb, 0, sizeof bbb);
    std::memcpy(swb, sw + nb * W8_BLOCK, cols * sizeof(float));
    if (bp != nullptr) std::memcpy(bbb, bp + nb * W8_BLOCK, cols * sizeof(float));
    const float* bb = bp != nullptr ? bbb : nullptr;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
      w2_tile<2>(A + m * Kp, Kp, blk, S);
      w2_store(S, sa[m], swb, bb, C + m * n + nb * W8_BLOCK, cols);
      w2_store(S + W8_BLOCK, sa[m + 1], swb, bb, C + (m + 1) * n + nb * W8_BLOCK, cols);
    }
    if (m < M) {
      w2_tile<1>(A + m * Kp, Kp, blk, S);
      w2_store(S, sa[m], swb, bb, C + m * n + nb * W8_BLOCK, cols);
    }
  }
}

}  // namespace
"""

_AMX = r"""
// ---- AMX (Advanced Matrix Extensions) for bf16 rows, in the AVX-512 BF16 build where the CPU has
// AMX-BF16 (kernel_amx). The same packed blocks: a k-pair of 16 columns is 64 bytes, so 16 k-pairs
// of a block's low (high) 16 columns are one B tile of 16 rows x 64 bytes at a row stride of 128
// bytes, in the layout tdpbf16ps wants (two bf16 of a k-pair side by side). A tiles hold 32 k's of
// up to 16 rows (the rows copied into a buffer, K zero-padded to a multiple of 32, and past 32 rows
// the rows to whole tiles); C tiles one row's 16 float32 sums. Per block: C_lo, C_hi += A . B_lo, A . B_hi for every 32 k's in order, then the bias
// in float32 and one rounding (Block). A row's sums depend on that row and the weights only
// (the tile's rows are independent; the k order is fixed by K): row invariant, as the vdpbf16ps
// tiles are, but with other bits than theirs, so a process uses one or the other for every product
// (amx_ready: the kernel's permission to use the tile registers, asked once).
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t AMX_ROWS = 16;   // rows per A tile
constexpr int64_t AMX_K = 32;      // k's per A tile (16 k-pairs: one B tile's rows)

bool amx_ready() {   // Linux: a process must ask for the tile data state before using it
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles: 0, 1 = C (low, high columns) of A tile 4; 2, 3 = B (low, high); 5, 6 = C of A tile 7
inline TileConfig amx_config(int64_t rows, int64_t rows2) {
  TileConfig c;
  for (int t : {0, 1, 4}) { c.rows[t] = (uint8_t)rows; c.colsb[t] = 64; }
  for (int t : {5, 6, 7}) { c.rows[t] = (uint8_t)rows2; c.colsb[t] = 64; }
  for (int t : {2, 3}) { c.rows[t] = 16; c.colsb[t] = 64; }
  return c;
}

// one A tile (up to 16 rows): 4 and 7 hold A, 2, 3 and 5, 6 the B tiles double-buffered (amx_block)
inline TileConfig amx_config_one(int64_t rows) {
  TileConfig c;
  for (int t : {0, 1, 4, 7}) { c.rows[t] = (uint8_t)rows; c.colsb[t] = 64; }
  for (int t : {2, 3, 5, 6}) { c.rows[t] = 16; c.colsb[t] = 64; }
  return c;
}

// The tiles for M rows: up to 32 rows, the A tiles hold 16 and the rest (17 rows cost 16 + 1, not
// 32: a tree of 16 nodes verifies 17); more: tiles of 16, the rows zero-padded to whole tiles
// (amx_padded_rows). Every tile is 64 bytes wide (16 float32 or int32 sums, 32 bf16 or 64 int8 k's).
inline TileConfig amx_rows_config(int64_t M) {
  return M <= AMX_ROWS ? amx_config_one(M) : M <= 2 * AMX_ROWS ? amx_config(AMX_ROWS, M - AMX_ROWS)
                                                               : amx_config(AMX_ROWS, AMX_ROWS);
}
inline int64_t amx_padded_rows(int64_t M) {
  return M <= 2 * AMX_ROWS ? M : (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
}

// The weight stream's software prefetch: none by default (the tile loads read 2 KiB runs, which
// the hardware prefetcher follows: one row 0.91x and six rows 0.85x the time with the AVX-512
// build's 4 KiB T1 prefetch, linear_bench.py), non-temporal for a streaming target (NativeLinear.stream)
template <bool STREAM>
inline void amx_prefetch(const uint16_t* p) {   // a B chunk's 2 KiB, PREFETCH elements ahead
  if constexpr (STREAM)
    for (int i = 0; i < 32; ++i) _mm_prefetch((const char*)(p + 32 * i), _MM_HINT_NTA);
}

// One chunk of 16 k-pairs: B tiles from b (row stride 128 bytes), A tiles' 32 k's from a (row stride
// lda bytes; the second A tile 16 rows further), into the C tiles
template <int NA>
inline void amx_chunk(const uint16_t* b, const uint16_t* a, int64_t Kp, int64_t lda) {
  _tile_loadd(2, b, 128);
  _tile_loadd(3, b + 32, 128);
  _tile_loadd(4, a, lda);
  _tile_dpbf16ps(0, 4, 2);
  _tile_dpbf16ps(1, 4, 3);
  if constexpr (NA == 2) {
    _tile_loadd(7, a + AMX_ROWS * Kp, lda);
    _tile_dpbf16ps(5, 7, 2);
    _tile_dpbf16ps(6, 7, 3);
  }
}

// C[m, block] for the rows of one (NA = 1) or two (NA = 2) A tiles: A [rows, Kp] bf16 (Kp a
// multiple of 32, zero-padded), blk one packed block [K2][32][2], tail: its last K2 % 16 k-pairs
// zero-padded to 16 (or null); out: [NA * 16][BLOCK] float32 sums
template <int NA, bool STREAM>
void amx_block(const uint16_t* A, int64_t Kp, const uint16_t* blk, int64_t K2, const uint16_t* tail,
               float* out) {
  const int64_t full = K2 / 16, lda = Kp * 2;
  constexpr int64_t CHUNK = 16 * 2 * BLOCK;   // elements of a chunk of 16 k-pairs
  _tile_zero(0); _tile_zero(1);
  if constexpr (NA == 2) {
    _tile_zero(5); _tile_zero(6);
    for (int64_t kc = 0; kc < full; ++kc) {
      const uint16_t* b = blk + kc * CHUNK;
      amx_prefetch<STREAM>(b + PREFETCH);
      amx_chunk<NA>(b, A + kc * AMX_K, Kp, lda);
    }
  } else {   // one A tile: the B tiles double-buffered (2, 3 and 5, 6; A in 4 and 7), so the next
             // chunk's loads need not wait for the products reading the last ones; same order of sums
    int64_t kc = 0;
    if (full > 0) { _tile_loadd(2, blk, 128); _tile_loadd(3, blk + 32, 128); }
    for (; kc + 2 <= full; kc += 2) {
      const uint16_t* b = blk + (kc + 1) * CHUNK;
      amx_prefetch<STREAM>(b + PREFETCH);
      _tile_loadd(5, b, 128);
      _tile_loadd(6, b + 32, 128);
      _tile_loadd(4, A + kc * AMX_K, lda);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 4, 3);
      if (kc + 2 < full) {
        amx_prefetch<STREAM>(b + CHUNK + PREFETCH);
        _tile_loadd(2, b + CHUNK, 128);
        _tile_loadd(3, b + CHUNK + 32, 128);
      }
      _tile_loadd(7, A + (kc + 1) * AMX_K, lda);
      _tile_dpbf16ps(0, 7, 5);
      _tile_dpbf16ps(1, 7, 6);
    }
    if (kc < full) {   // an odd number of chunks: the last one, already in 2, 3
      _tile_loadd(4, A + kc * AMX_K, lda);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 4, 3);
    }
  }
  if (tail != nullptr) amx_chunk<NA>(tail, A + full * AMX_K, Kp, lda);
  _tile_stored(0, out, BLOCK * 4);
  _tile_stored(1, out + 16, BLOCK * 4);
  if constexpr (NA == 2) {
    _tile_stored(5, out + AMX_ROWS * BLOCK, BLOCK * 4);
    _tile_stored(6, out + AMX_ROWS * BLOCK + 16, BLOCK * 4);
  }
}

using AmxBlock = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, float*);
constexpr AmxBlock AMX_BLOCKS[2][2] = {   // [STREAM][two A tiles]
    {amx_block<1, false>, amx_block<2, false>}, {amx_block<1, true>, amx_block<2, true>}};

// bf16 rows x blocks [b0, b1) on this thread: every 32 rows (two A tiles) once through each block,
// the block from memory for the first 32, from cache for the rest
void amx_range(const uint16_t* A, int64_t M, int64_t Mp, int64_t Kp, const uint16_t* W, int64_t K2, int64_t b0,
               int64_t b1, const float* bp, void* Cv, int64_t n, bool f32_out, bool stream) {
  const TileConfig cfg = amx_rows_config(M);
  _tile_loadconfig(&cfg);
  alignas(64) float out[2 * AMX_ROWS][BLOCK];
  alignas(64) uint16_t tail[16 * 2 * BLOCK];
  const int64_t rem = K2 % 16;
  for (int64_t nb = b0; nb < b1; ++nb) {
    const uint16_t* blk = W + nb * K2 * 2 * BLOCK;
    const int64_t cols = std::min<int64_t>(BLOCK, n - nb * BLOCK);
    const Block o(bp ? bp + nb * BLOCK : nullptr, cols);
    const uint16_t* t = nullptr;
    if (rem) {
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, blk + (K2 - rem) * 2 * BLOCK, rem * 2 * BLOCK * 2);
      t = tail;
    }
    for (int64_t m0 = 0; m0 < Mp; m0 += 2 * AMX_ROWS) {
      AMX_BLOCKS[stream][Mp - m0 > AMX_ROWS](A + m0 * Kp, Kp, blk, K2, t, &out[0][0]);
      const __m512 zero = _mm512_setzero_ps();
      for (int64_t m = m0; m < std::min(M, m0 + 2 * AMX_ROWS); ++m) {
        const float* s = out[m - m0];
        const __m512 lo = o.lo(_mm512_load_ps(s), zero), hi = o.hi(_mm512_load_ps(s + 16), zero);
        if (f32_out) {
          float* C = static_cast<float*>(Cv) + m * n + nb * BLOCK;
          _mm512_mask_storeu_ps(C, o.lo_mask, lo);
          _mm512_mask_storeu_ps(C + 16, o.hi_mask, hi);
        } else {
          uint16_t* C = static_cast<uint16_t*>(Cv) + m * n + nb * BLOCK;
          _mm256_mask_storeu_epi16(C, o.lo_mask, (__m256i)_mm512_cvtneps_pbh(lo));
          _mm256_mask_storeu_epi16(C + 16, o.hi_mask, (__m256i)_mm512_cvtneps_pbh(hi));
        }
      }
    }
  }
  _tile_release();
}

// ---- AMX-INT8: int8 rows x int8 weights (W8A8 linears: quant.W8A8Linear, linear_w8a8) ----
// Weights packed by pack_w8a8: [N/32, Kp/4, 32, 4] int8 (K zero-padded to Kp, a multiple of 64):
// a k-quad of a block's 32 columns is 128 bytes, so 16 k-quads of its low (high) 16 columns are one
// B tile of 16 rows x 64 bytes at a row stride of 128, the layout tdpbssd wants (the four int8 of
// a k-quad side by side). A tiles: 64 int8 k's of up to 16 rows. Sums in int32: exact, whatever
// the order, so a row's result depends on that row and the weights only (Q8_K: _HEADER).

// C[m, block] int32 for the rows of one (NA = 1) or two (NA = 2) A tiles: A [rows, Kp] int8, blk one
// packed block [Kp/4][32][4]; out: [NA * 16][BLOCK] int32 sums
template <int NA>
void q8_block(const int8_t* A, int64_t Kp, const int8_t* blk, int32_t* out) {
  const int64_t chunks = Kp / Q8_K;
  _tile_zero(0); _tile_zero(1);
  if constexpr (NA == 2) { _tile_zero(5); _tile_zero(6); }
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const int8_t* b = blk + kc * 16 * 4 * BLOCK;
    _tile_loadd(2, b, 128);
    _tile_loadd(3, b + 64, 128);
    _tile_loadd(4, A + kc * Q8_K, Kp);
    _tile_dpbssd(0, 4, 2);
    _tile_dpbssd(1, 4, 3);
    if constexpr (NA == 2) {
      _tile_loadd(7, A + AMX_ROWS * Kp + kc * Q8_K, Kp);
      _tile_dpbssd(5, 7, 2);
      _tile_dpbssd(6, 7, 3);
    }
  }
  _tile_stored(0, out, BLOCK * 4);
  _tile_stored(1, out + 16, BLOCK * 4);
  if constexpr (NA == 2) {
    _tile_stored(5, out + AMX_ROWS * BLOCK, BLOCK * 4);
    _tile_stored(6, out + AMX_ROWS * BLOCK + 16, BLOCK * 4);
  }
}

// rows [M, K] quantized into A [Mp, Kp] on blocks [b0, b1) of this thread: y[m, n] = float(sum) *
// (sa[m] * sw[n]) + bias[n], in float32, then rounded once to bf16 (or float32 with f32_out)
void q8_range(const int8_t* A, const float* sa, int64_t M, int64_t Mp, int64_t Kp, const int8_t* W, int64_t b0,
              int64_t b1, const float* sw, const float* bp, void* Cv, int64_t n, bool f32_out) {
  const TileConfig cfg = amx_rows_config(M);
  _tile_loadconfig(&cfg);
  alignas(64) int32_t out[2 * AMX_ROWS][BLOCK];
  for (int64_t nb = b0; nb < b1; ++nb) {
    const int8_t* blk = W + nb * Kp * BLOCK;
    const Q8Epilogue e(sw, bp, nb, n, f32_out);
    for (int64_t m0 = 0; m0 < Mp; m0 += 2 * AMX_ROWS) {
      if (Mp - m0 > AMX_ROWS) q8_block<2>(A + m0 * Kp, Kp, blk, &out[0][0]);
      else q8_block<1>(A + m0 * Kp, Kp, blk, &out[0][0]);
      for (int64_t m = m0; m < std::min(M, m0 + 2 * AMX_ROWS); ++m)
        e.store(_mm512_load_si512(out[m - m0]), _mm512_load_si512(out[m - m0] + 16), sa[m], Cv, m * n + nb * BLOCK);
    }
  }
  _tile_release();
}

}  // namespace
"""

_INT8 = r"""
// ---- int8 weights, float32 rows (weight-only int8 linears of targets and drafters: quant.Int8Linear) ----
// AVX2 + FMA (both builds). w [ceil(N/16), K, 16] int8 (pack_int8): block b, input k holds
// q[16 b : 16 b + 16, k], 16 bytes; scale [N] float32. C[m, n] = (sum_k A[m, k] q[n, k]) * scale[n]
// + bias[n]: each int8 widened to float32 in registers (exact), one fused multiply-add per k in k
// order into one sum per column, whatever the rows, the tile or the thread (row invariance).
namespace {

constexpr int64_t I8_BLOCK = 16;   // output columns per block: two 8-lane vectors, 16 bytes a k
constexpr int64_t I8_ROWS = 4;     // rows per tile: 4 x 2 sums (one or two rows: 2 blocks at once)
constexpr int64_t I8_AHEAD = 2048; // bytes ahead in each block's stream (software prefetch into L1)

#define I8_UNROLL _Pragma("GCC unroll 16")
template <int M, int NB>
void i8_tile(const float* A, int64_t lda, const int8_t* blk, int64_t K, const float* scale, const float* bias,
             float* C, int64_t ldc, int64_t cols) {
  constexpr int V = NB * 2;               // sums per row; with V widened weights and a broadcast, <= 16 registers
  const int64_t bstride = K * I8_BLOCK;   // bytes from one block to the next
  __m256 c[M][V];
  I8_UNROLL for (int m = 0; m < M; ++m)
    I8_UNROLL for (int v = 0; v < V; ++v) c[m][v] = _mm256_setzero_ps();
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    const int8_t* w = blk + k * I8_BLOCK;
    __m256 x[V];
    I8_UNROLL for (int v = 0; v < V; ++v)
      x[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64((const __m128i*)(w + (v / 2) * bstride + 8 * (v % 2)))));
    I8_UNROLL for (int m = 0; m < M; ++m) {
      const __m256 a = _mm256_broadcast_ss(A + m * lda + k);
      I8_UNROLL for (int v = 0; v < V; ++v) c[m][v] = _mm256_fmadd_ps(a, x[v], c[m][v]);
    }
  };
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {   // four k's a 64-byte line of each block: one prefetch per line
    I8_UNROLL for (int b = 0; b < NB; ++b)
      _mm_prefetch((const char*)(blk + k * I8_BLOCK + b * bstride + I8_AHEAD), _MM_HINT_T0);
    I8_UNROLL for (int j = 0; j < 4; ++j) step(k + j);
  }
  for (; k < K; ++k) step(k);
  alignas(32) float sc[NB * I8_BLOCK] = {0}, bb[NB * I8_BLOCK] = {0}, out[M][NB * I8_BLOCK];
  std::memcpy(sc, scale, cols * sizeof(float));
  if (bias != nullptr) std::memcpy(bb, bias, cols * sizeof(float));
  I8_UNROLL for (int m = 0; m < M; ++m)
    I8_UNROLL for (int v = 0; v < V; ++v)
      _mm256_store_ps(out[m] + 8 * v, _mm256_fmadd_ps(c[m][v], _mm256_load_ps(sc + 8 * v), _mm256_load_ps(bb + 8 * v)));
  for (int m = 0; m < M; ++m) std::memcpy(C + m * ldc, out[m], cols * sizeof(float));
}

// M rows over blocks [b0, b1): NB blocks per tile while they last, then one at a time
template <int M, int NB>
void i8_rows(const float* A, int64_t K, const int8_t* W, int64_t b0, int64_t b1, const float* sp,
             const float* bp, float* C, int64_t n) {
  int64_t b = b0;
  for (; b + NB <= b1; b += NB)
    i8_tile<M, NB>(A, K, W + b * K * I8_BLOCK, K, sp + b * I8_BLOCK, bp ? bp + b * I8_BLOCK : nullptr,
                   C + b * I8_BLOCK, n, std::min<int64_t>(NB * I8_BLOCK, n - b * I8_BLOCK));
  for (; b < b1; ++b)
    i8_tile<M, 1>(A, K, W + b * K * I8_BLOCK, K, sp + b * I8_BLOCK, bp ? bp + b * I8_BLOCK : nullptr,
                  C + b * I8_BLOCK, n, std::min<int64_t>(I8_BLOCK, n - b * I8_BLOCK));
}

void i8_range(const float* A, int64_t M, int64_t K, const int8_t* W, int64_t b0, int64_t b1, const float* sp,
              const float* bp, float* C, int64_t n) {
  for (int64_t m0 = 0; m0 < M; m0 += I8_ROWS) {
    const float* At = A + m0 * K;
    float* Ct = C + m0 * n;
    switch (std::min<int64_t>(I8_ROWS, M - m0)) {
      case 1: i8_rows<1, 2>(At, K, W, b0, b1, sp, bp, Ct, n); break;
      case 2: i8_rows<2, 2>(At, K, W, b0, b1, sp, bp, Ct, n); break;
      case 3: i8_rows<3, 1>(At, K, W, b0, b1, sp, bp, Ct, n); break;
      default: i8_rows<4, 1>(At, K, W, b0, b1, sp, bp, Ct, n); break;
    }
  }
}

}  // namespace

// x [..., K] float32 or bf16 (widened; the result rounded back once), w [ceil(N/16), K, 16] int8
// (pack_int8), scale [N] float32, bias [N] or None -> [..., N] in x's dtype
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_int8: CPU tensors only");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 3 && w.size(2) == I8_BLOCK && w.is_contiguous(),
              "linear_int8: the weight must be packed by pack_int8, got ", w.scalar_type(), " ", w.sizes());
  const int64_t nblocks = w.size(0), K = w.size(1);
  TORCH_CHECK(K > 0 && nblocks > 0, "linear_int8: empty weight");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "linear_int8: input has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(n > (nblocks - 1) * I8_BLOCK && n <= nblocks * I8_BLOCK, "linear_int8: ", n,
              " output features do not fit ", nblocks, " packed blocks");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n, "linear_int8: scale of shape ", scale.sizes(), " for ", n,
              " outputs");
  if (x.scalar_type() != at::kFloat) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                "linear_int8: float32, bf16 or float16 input, got ", x.scalar_type());
    return linear_int8(x.to(at::kFloat), w, scale, bias, n).to(x.scalar_type());
  }
  const at::Tensor s = scale.to(at::kFloat).contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_int8: bias of shape ", bias->sizes(), " for ", n,
                " outputs");
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  const int64_t M = xc.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::detail::empty_cpu(shape, at::kFloat, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  if (M == 0) return out;
  const float* A = xc.data_ptr<float>();
  const int8_t* W = reinterpret_cast<const int8_t*>(w.data_ptr());
  const float* sp = s.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* C = out.data_ptr<float>();
  // at least ~32 KiB of weights per thread: smaller products run on the calling thread
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (K * I8_BLOCK));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) { i8_range(A, M, K, W, b0, b1, sp, bp, C, n); });
  return out;
}
"""

_OP = r"""

// x [..., K] bf16 or float32, w [ceil(N/BLOCK), K/2, BLOCK, 2] bf16 (pack_weight), bias [N] or None
// -> [..., N] in x's dtype, or float32 with f32_out (bf16 rows: the float32 sums not rounded)
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       int64_t n, bool f32_out, bool stream) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_bf16: CPU tensors only");
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK((f32 || x.scalar_type() == at::kBFloat16) && w.scalar_type() == at::kBFloat16,
              "linear_bf16: bf16 or float32 input and a bf16 weight, got ", x.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(w.dim() == 4 && w.size(2) == BLOCK && w.size(3) == 2 && w.is_contiguous(),
              "linear_bf16: the weight must be packed by pack_weight, got shape ", w.sizes());
  const int64_t nblocks = w.size(0), K2 = w.size(1), K = 2 * K2;
  TORCH_CHECK(K2 > 0 && nblocks > 0, "linear_bf16: empty weight");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "linear_bf16: input has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(n > (nblocks - 1) * BLOCK && n <= nblocks * BLOCK, "linear_bf16: ", n,
              " output features do not fit ", nblocks, " packed blocks");
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_bf16: bias of shape ", bias->sizes(),
                " for ", n, " outputs");
    b = bias->to(at::kFloat).contiguous();
  }
#if LEAPFROG_BF16_ROWS
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
#else   // bf16 rows: widened (exact), float32 sums, rounded once to bf16 at the end
  if (!f32) {
    const at::Tensor y = linear_bf16(x.to(at::kFloat), w, bias, n, true, stream);
    return f32_out ? y : y.to(at::kBFloat16);
  }
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
#endif
  const int64_t M = xc.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::detail::empty_cpu(shape, f32_out ? at::kFloat : x.scalar_type(), std::nullopt, std::nullopt,
                                         std::nullopt, std::nullopt);
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (M == 0) return out;
  // at least ~64 KiB of weights (per 8 rows) per thread: smaller products run on the calling thread
  const int64_t tiles = (M + ROWS - 1) / ROWS;
  // non-temporal prefetch only where one row tile reads each block: further tiles re-read the
  // block from cache, and a block (K x 64 bytes) can outgrow L1, where T1 keeps it in L2
  const bool nt = stream && M <= (f32 ? ROWS_F32 : ROWS);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (K2 * 2 * BLOCK * 2 * tiles));
#if LEAPFROG_F32_RANGE
  if (f32) {
    const float* A = xc.data_ptr<float>();
    float* C = out.data_ptr<float>();
    at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) { f32_range(A, M, K, W, K2, b0, b1, bp, C, n); });
    return out;
  }
#endif
#if LEAPFROG_AMX
  if (!f32 && amx_ready()) {   // bf16 rows through the tile registers (every product: row invariance)
    const int64_t Kp = (K + AMX_K - 1) / AMX_K * AMX_K, Mp = amx_padded_rows(M);
    at::Tensor ap = at::detail::empty_cpu({Mp, Kp}, at::kBFloat16, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
    uint16_t* Ap = reinterpret_cast<uint16_t*>(ap.data_ptr());
    const uint16_t* X = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    if (Kp == K && Mp == M) {
      std::memcpy(Ap, X, M * K * 2);
    } else {
      std::memset(Ap, 0, Mp * Kp * 2);
      for (int64_t m = 0; m < M; ++m) std::memcpy(Ap + m * Kp, X + m * K, K * 2);
    }
    const int64_t amx_grain = std::max<int64_t>(1, (64 << 10) / (K2 * 2 * BLOCK * 2));
    const bool amx_nt = stream && Mp <= 2 * AMX_ROWS;   // (one pass over each block)
    void* C = out.data_ptr();
    at::parallel_for(0, nblocks, amx_grain, [&](int64_t b0, int64_t b1) {
      amx_range(Ap, M, Mp, Kp, W, K2, b0, b1, bp, C, n, f32_out, amx_nt);
    });
    return out;
  }
#endif
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {     // each block once from memory, for all rows
      const int64_t cols = std::min<int64_t>(BLOCK, n - nb * BLOCK);
      const uint16_t* blk = W + nb * K2 * 2 * BLOCK;
      const float* bb = bp ? bp + nb * BLOCK : nullptr;
      if (f32) {
#if !LEAPFROG_F32_RANGE
        const float* A = xc.data_ptr<float>();
        float* C = out.data_ptr<float>();
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_F32)
          TILES_F32[nt][std::min<int64_t>(ROWS_F32, M - m0)](A + m0 * K, K, blk, K2, bb, C + m0 * n + nb * BLOCK,
                                                                 n, cols);
#endif
      } else {
#if LEAPFROG_BF16_ROWS
        const uint16_t* A = reinterpret_cast<const uint16_t*>(xc.data_ptr());
        char* C = static_cast<char*>(out.data_ptr());
        const int64_t esize = f32_out ? 4 : 2;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS)
          TILES[nt][f32_out][std::min<int64_t>(ROWS, M - m0)](A + m0 * K, K, blk, K2, bb,
                                                          C + (m0 * n + nb * BLOCK) * esize, n, cols);
#endif
      }
    }
  });
  return out;
}

// x [..., K] bf16 or float32, w [ceil(N/32), Kp/4, 32, 4] int8 (pack_w8a8), scale [N] float32 (the
// weights' per column), bias [N] float32 or None -> [..., N] in x's dtype, or float32 with f32_out.
// Each row quantized to int8 on the fly (q8_row, q8_row8), int32 sums on the AMX-INT8 tiles where
// this process may use them, else with AVX-512 VNNI (the AVX-512 BF16 build), or in 16-bit pairs
// (the AVX2 build: vpmaddubsw): the same bits every way
at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t n, bool f32_out) {
#if LEAPFROG_W8A8 || LEAPFROG_W8A8_AVX2
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scale.device().is_cpu() &&
              (!bias.has_value() || bias->device().is_cpu()), "linear_w8a8: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_w8a8: bf16 or float32 rows, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 4 && w.size(2) == W8_BLOCK && w.size(3) == 4 &&
              w.is_contiguous(), "linear_w8a8: the weight must be packed by pack_w8a8, got ", w.scalar_type(),
              " ", w.sizes());
  const int64_t nblocks = w.size(0), Kp = 4 * w.size(1), K = x.size(-1);
  TORCH_CHECK(K > 0 && nblocks > 0 && Kp % Q8_K == 0 && K <= Kp && K > Kp - Q8_K,
              "linear_w8a8: input has ", K, " features, the weight ", Kp, " (padded to 64)");
  TORCH_CHECK(n > (nblocks - 1) * W8_BLOCK && n <= nblocks * W8_BLOCK, "linear_w8a8: ", n,
              " output features do not fit ", nblocks, " packed blocks");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == n,
              "linear_w8a8: a float32 scale per output feature");
  at::Tensor b, sc = scale.contiguous();
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_w8a8: bias of shape ", bias->sizes(), " for ", n);
    b = bias->to(at::kFloat).contiguous();
  }
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (Kp * W8_BLOCK));   // >= 64 KiB of weights a thread
  const int8_t* W = w.data_ptr<int8_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if LEAPFROG_W8A8_AVX2
  TORCH_CHECK(Kp <= 65536, "linear_w8a8: at most 65536 input features (int32 sums), got ", K);
  if (x.scalar_type() != at::kFloat) {   // bf16 rows: widened (exact), the float32 result rounded once
    const at::Tensor y = linear_w8a8(x.to(at::kFloat), w, scale, bias, n, true);
    return f32_out ? y : y.to(at::kBFloat16);
  }
#endif
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::detail::empty_cpu(shape, f32_out ? at::kFloat : x.scalar_type(), std::nullopt, std::nullopt,
                                         std::nullopt, std::nullopt);
  if (M == 0) return out;
  void* C = out.data_ptr();
#if LEAPFROG_W8A8_AVX2
  std::vector<int8_t> A(M * Kp);
  std::vector<float> sa(M);
  const float* X = xc.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) sa[m] = q8_row8(X + m * K, K, A.data() + m * Kp, Kp);
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    w2_range(A.data(), sa.data(), M, Kp, W, b0, b1, sc.data_ptr<float>(), bp, static_cast<float*>(C), n);
  });
  return out;
#else
  const bool f32 = f32_out || x.scalar_type() == at::kFloat;   // (float32 out: float32 stores)
#if LEAPFROG_AMX
  const bool tiles = amx_ready();
  const int64_t Mp = tiles ? amx_padded_rows(M) : M;
#else
  const bool tiles = false;
  const int64_t Mp = M;
#endif
  TORCH_CHECK(tiles || Kp <= 65536, "linear_w8a8: at most 65536 input features without AMX-INT8 (int32 sums), got ", K);
  std::vector<int8_t> A(Mp * Kp, 0);
  std::vector<float> sa(Mp, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    if (x.scalar_type() == at::kFloat) sa[m] = q8_row(xc.data_ptr<float>() + m * K, K, A.data() + m * Kp, Kp);
    else sa[m] = q8_row(xc.data_ptr<at::BFloat16>() + m * K, K, A.data() + m * Kp, Kp);
  }
#if LEAPFROG_AMX
  if (tiles) {
    at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
      q8_range(A.data(), sa.data(), M, Mp, Kp, W, b0, b1, sc.data_ptr<float>(), bp, C, n, f32);
    });
    return out;
  }
#endif
  q8_unsigned(A.data(), M * Kp);   // AVX-512 VNNI: unsigned rows (v8_range)
  const uint8_t* U = reinterpret_cast<const uint8_t*>(A.data());
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    v8_range(U, sa.data(), M, Kp, W, b0, b1, sc.data_ptr<float>(), bp, C, n, f32);
  });
  return out;
#endif
#else
  TORCH_CHECK(false, "linear_w8a8: this build has no int8-row kernel");
  return x;
#endif
}

// whether bf16 rows run on the AMX tiles in this process (the build has them and Linux lent the tile state)
bool amx_active() {
#if LEAPFROG_AMX
  return amx_ready();
#else
  return false;
#endif
}

TORCH_LIBRARY(leapfrog_gemm, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias, int n, bool f32_out=False, bool stream=False) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor w, Tensor scale, Tensor? bias, int n) -> Tensor");
  m.def("linear_w8a8(Tensor x, Tensor w, Tensor scale, Tensor? bias, int n, bool f32_out=False) -> Tensor");
  m.def("amx_active() -> bool", &amx_active);
}
TORCH_LIBRARY_IMPL(leapfrog_gemm, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_w8a8", &linear_w8a8);
}
"""

#: each build's software prefetch: bytes ahead in the weight stream, and the hint (the cache level it
#: fills: "T0" L1, "T1" L2, "T2", "NTA", or "none": no software prefetch; module docstring)
PREFETCH = {"avx512_bf16": (4096, "T1"), "avx2": (2048, "T0")}
_FLAGS = {"avx512_bf16": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                          "-mavx512vnni", "-mfma", "-mavx2"],
          "avx2": ["-O3", "-mavx2", "-mfma"]}


def kernel_source(isa: str, prefetch_bytes: int | None = None, hint: str | None = None,
                  namespace: str = "leapfrog_gemm", amx: bool = False) -> tuple[str, list[str]]:
    """The kernel's C++ source and compiler flags for ``isa`` ("avx512_bf16" or "avx2"). The
    software prefetch (default: ``PREFETCH[isa]``) and the op's namespace are parameters so that
    variants can be built and timed side by side (benchmarks/linear_bench.py); the engine uses the
    defaults, and ``amx`` where the CPU has AMX-BF16 (``kernel_amx``: bf16 rows through the tile
    registers, the avx512_bf16 build only)."""
    default_bytes, default_hint = PREFETCH[isa]
    prefetch_bytes = default_bytes if prefetch_bytes is None else prefetch_bytes
    hint = default_hint if hint is None else hint
    if hint not in ("T0", "T1", "T2", "NTA", "none"):
        raise ValueError(f"prefetch hint {hint!r}: use T0, T1, T2, NTA or none")
    if prefetch_bytes <= 0 or prefetch_bytes % 2:
        raise ValueError(f"prefetch distance {prefetch_bytes}: a positive even number of bytes")
    call = "((void)p)" if hint == "none" else f"_mm_prefetch((const char*)(p), _MM_HINT_{hint})"
    body = (_AVX512_BF16 if isa == "avx512_bf16" else _AVX2).replace("@PREFETCH@", str(prefetch_bytes // 2))
    if amx and isa != "avx512_bf16":
        raise ValueError("the AMX tiles come with the avx512_bf16 build only")
    prefix = ("#define LEAPFROG_AMX 1\n" if amx else "") + (
        "#define LEAPFROG_W8A8 1\n" if isa == "avx512_bf16" else "#define LEAPFROG_W8A8_AVX2 1\n")
    source = (prefix + _HEADER + body.replace("@PREFETCH_CALL@", call) + (_Q8 if isa == "avx512_bf16" else _Q8_AVX2)
              + (_AMX if amx else "") + _INT8 + _OP)
    source = with_namespace(source, "leapfrog_gemm", namespace)
    return source, list(_FLAGS[isa]) + (["-mamx-tile", "-mamx-bf16", "-mamx-int8"] if amx else [])


def load_variant(prefetch_bytes: int, hint: str, namespace: str, amx: bool | None = None):
    """Build and load this CPU's kernel (``kernel_isa``; ``amx``: with the AMX tiles, default as
    the engine's kernel, ``amx_in_use``) with another software prefetch under op namespace
    ``namespace`` (about 20 s, once; for timing variants side by side). -> its op."""
    isa = kernel_isa()
    if isa is None:
        raise RuntimeError("no build of the kernel runs on this CPU (needs AVX-512 BF16 or AVX2)")
    amx = amx_in_use() if amx is None else amx
    source, flags = kernel_source(isa, prefetch_bytes, hint, namespace, amx=amx)
    load_inline(f"{namespace}_{isa}{'_amx' if amx else ''}_{hint.lower()}_{prefetch_bytes}", source, flags)
    return getattr(torch.ops, namespace).linear_bf16


#: per build ("avx512_bf16", "avx2", "avx512_bf16_amx"): the kernel's source and compiler flags
_BUILDS = {**{isa: kernel_source(isa) for isa in _FLAGS}, "avx512_bf16_amx": kernel_source("avx512_bf16", amx=True)}

_STATE: dict[str, bool] = {}  # memo of load_native_linear (the op is process-wide once loaded)
_LOCK = threading.Lock()       # one build at a time; callers wait for its result


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (read once; empty where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for ln in lines:
        name, sep, value = ln.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``, read once; empty where it cannot be read)."""
    return frozenset(_cpuinfo().get("flags", "").split())


@functools.cache
def cpu_vendor_family() -> tuple[str, int | None]:
    """The CPU's vendor ("AuthenticAMD", "GenuineIntel", ...) and family number (``/proc/cpuinfo``,
    read once; ("", None) where it cannot be read)."""
    info = _cpuinfo()
    family = info.get("cpu family", "")
    return info.get("vendor_id", ""), int(family) if family.isdigit() else None


def kernel_isa() -> str | None:
    """The instruction set the kernel is built for on this CPU (``/proc/cpuinfo``): "avx512_bf16",
    else "avx2" (with FMA), else None; ATEN_CPU_CAPABILITY capping PyTorch's own kernels below
    one caps ours too ("avx2": no AVX-512; "default": none)."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if cap in ("default", "zvector"):
        return None
    flags = cpu_flags()
    if "avx512_bf16" in flags and cap != "avx2":
        return "avx512_bf16"
    return "avx2" if {"avx2", "fma"} <= flags else None


def kernel_amx() -> bool:
    """Whether the kernel multiplies bf16 rows with AMX tiles on this CPU: the avx512_bf16 build
    where ``/proc/cpuinfo`` lists AMX-BF16 and AMX-TILE, unless ``LEAPFROG_AMX=0`` (read here: for
    A/B runs; outputs differ in the last bits between the two, each row invariant)."""
    if kernel_isa() != "avx512_bf16" or env_off("LEAPFROG_AMX"):
        return False
    return {"amx_bf16", "amx_tile"} <= cpu_flags()


def load_native_linear() -> bool:
    """Build (once, cached on disk) and load the op for this CPU's instruction set. -> available."""
    with _LOCK:
        if "ok" not in _STATE:
            _STATE["isa"] = kernel_isa()
            _STATE["amx"] = _STATE["isa"] is not None and kernel_amx()
            _STATE["ok"] = _load(_STATE["isa"], _STATE["amx"])
            if not _STATE["ok"] and _STATE["amx"]:   # (a compiler without -mamx-bf16: the build without)
                _STATE["amx"] = False
                _STATE["ok"] = _load(_STATE["isa"])
    return _STATE["ok"]


def amx_in_use() -> bool:
    """Whether the loaded kernel runs bf16 rows on the AMX tiles: built with them (kernel_amx, at
    load) and lent the tile state by Linux (asked once; refused before 5.16, where the op keeps the
    vdpbf16ps tiles)."""
    return load_native_linear() and _STATE["amx"] and bool(torch.ops.leapfrog_gemm.amx_active())


def w8a8_supported() -> bool:
    """Whether ``linear_w8a8`` (int8 rows x int8 weights: quant.W8A8Linear) serves in this process:
    the AVX2 build loaded (vpmaddubsw), or the AVX-512 BF16 build on a CPU with AMX-INT8 where the
    tiles are in use (``amx_in_use``) or else with AVX-512 VNNI (``w8a8_tiles`` tells which; the
    same bits every way), unless ``LEAPFROG_NATIVE_LINEAR=0``."""
    if env_off("LEAPFROG_NATIVE_LINEAR") or not load_native_linear():
        return False
    if _STATE["isa"] == "avx2":   # (vpmaddubsw: every AVX2 build)
        return True
    # (the op takes the tiles wherever the bf16 rows do, amx_in_use: there only AMX-INT8 serves)
    return w8a8_tiles() or ("avx512_vnni" in cpu_flags() and not amx_in_use())


def w8a8_tiles() -> bool:
    """Whether ``linear_w8a8`` sums on the AMX-INT8 tiles here (else with AVX-512 VNNI)."""
    return amx_in_use() and "amx_int8" in cpu_flags()


def block_columns() -> int:
    """Output columns per packed block of the loaded build (pack_weight's default)."""
    load_native_linear()
    return BLOCK_COLUMNS[_STATE["isa"] or "avx512_bf16"]


def _load(isa: str | None, amx: bool = False) -> bool:
    if isa is None:
        return False
    build = f"{isa}_amx" if amx else isa
    try:
        log.info("loading leapfrog's bf16-weight linear kernel for %s (built once, about 20 s)", build)
        source, flags = _BUILDS[build]
        load_inline(f"leapfrog_native_linear_{build.replace('_', '')}", source, flags)
        torch.library.register_fake("leapfrog_gemm::linear_bf16")(_fake)
        torch.library.register_fake("leapfrog_gemm::linear_int8")(_fake_int8)
        torch.library.register_fake("leapfrog_gemm::linear_w8a8")(_fake_w8a8)
        return True
    except Exception as e:  # noqa: BLE001 - no compiler, old assembler, ...: other linears serve
        log.warning("bf16 linear kernel unavailable (%s: %s)%s", type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "",
                    "; trying the build without AMX" if amx else "; keeping oneDNN/inductor linears")
        return False


def _fake(x, w, bias, n, f32_out=False, stream=False):
    return x.new_empty((*x.shape[:-1], n), dtype=torch.float32 if f32_out else x.dtype)


def _fake_int8(x, w, scale, bias, n):
    return x.new_empty((*x.shape[:-1], n))


def _fake_w8a8(x, w, scale, bias, n, f32_out=False):
    return x.new_empty((*x.shape[:-1], n), dtype=torch.float32 if f32_out else x.dtype)


def native_linear_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether NativeLinear serves weights of this dtype on this device (read when a model is
    loaded: ``LEAPFROG_NATIVE_LINEAR=0`` in the environment turns the kernel off, e.g. to compare)."""
    if env_off("LEAPFROG_NATIVE_LINEAR"):
        return False
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and load_native_linear()


def native_int8_supported(device: torch.device | str) -> bool:
    """Whether the int8-weight op (``linear_int8``, built with the bf16 kernel) serves on this
    device: wherever the build serves bf16 weights (``LEAPFROG_NATIVE_LINEAR=0`` turns it off too:
    then PyTorch's int8 kernel serves)."""
    return native_linear_supported(torch.bfloat16, device)


def pack_int8(q: Tensor) -> Tensor:
    """q [N, K] int8 -> [ceil(N/16), K, 16] for ``linear_int8``: block b, input k holds
    q[16 b : 16 b + 16, k] (zeros past N)."""
    n, k = q.shape
    nb = -(-n // INT8_BLOCK_COLUMNS)
    w = torch.zeros(nb * INT8_BLOCK_COLUMNS, k, dtype=torch.int8)
    w[:n] = q.detach()
    return w.view(nb, INT8_BLOCK_COLUMNS, k).transpose(1, 2).contiguous()


def pack_w8a8(q: Tensor) -> Tensor:
    """q [N, K] int8 -> [ceil(N/32), Kp/4, 32, 4] for ``linear_w8a8`` (Kp: K rounded up to 64):
    block b, k-quad j, column c holds q[32 b + c, 4 j : 4 j + 4] (zeros past N and K)."""
    n, k = q.shape
    nb, kp = -(-n // 32), -(-k // 64) * 64
    w = torch.zeros(nb * 32, kp, dtype=torch.int8)
    w[:n, :k] = q.detach()
    return w.view(nb, 32, kp // 4, 4).permute(0, 2, 1, 3).contiguous()


def bf16_exact(weight: Tensor) -> bool:
    """Whether every value of a float32 tensor is a bf16 value (then bf16 holds it exactly)."""
    return bool(torch.equal(weight.detach().to(torch.bfloat16).float(), weight.detach()))


def last_level_cache_bytes() -> int | None:
    """The size of the CPU's largest cache (sysfs: the L3 a core shares), or None where unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]]
                         if text[-1] in "KMG" else int(text))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return max(sizes, default=None)


def would_stream(model: nn.Module) -> bool:
    """Whether ``set_streaming`` would turn streaming on for ``model`` (nothing is changed)."""
    return _streaming(model)[1]


def kernel_streams() -> bool:
    """Whether this CPU's kernel build prefetches non-temporally where asked (``NativeLinear.stream``):
    the AVX-512 build; the AVX2 build keeps its one prefetch hint (module docstring)."""
    return kernel_isa() == "avx512_bf16"


def _streaming(model: nn.Module) -> tuple[list[NativeLinear], bool]:
    """``model``'s bf16-kernel linears, and whether together they exceed the last-level cache on a
    build that streams (``kernel_streams``; unless ``LEAPFROG_STREAM_WEIGHTS=0``). Where the build
    does not stream, nothing is marked: engines may then share the target beside a drafter (on an
    AVX2 EPYC every benchmark engine had loaded its own copy for a flag its kernel ignores)."""
    linears = [m for m in model.modules() if isinstance(m, NativeLinear)]
    if not linears or not kernel_streams() or env_off("LEAPFROG_STREAM_WEIGHTS"):
        return linears, False
    cache = last_level_cache_bytes()
    total = sum(m.packed.numel() * m.packed.element_size() for m in linears)
    return linears, cache is not None and total > cache


def set_streaming(model: nn.Module) -> int:
    """Prefetch the weights of ``model``'s bf16 linears non-temporally when together they exceed
    the last-level cache (a target run beside a drafter: the target's weights pass through without
    evicting the drafter's, which then stay cached from one draft step to the next); a model that
    fits keeps the default prefetch. ``LEAPFROG_STREAM_WEIGHTS=0`` (read here) keeps it always.
    -> how many linears stream."""
    linears, on = _streaming(model)
    for m in linears:
        m.stream = on
    return len(linears) if on else 0


def pack_weight(weight: Tensor, block: int | None = None) -> Tensor:
    """weight [N, K] bf16 (K even) -> [ceil(N/B), K/2, B, 2] with B = ``block`` (default: the loaded
    build's, ``block_columns``): block b, k-pair j, column c holds weight[B b + c, 2 j : 2 j + 2]
    (zeros past N)."""
    block = block or block_columns()
    n, k = weight.shape
    assert k % 2 == 0, "K must be even"
    nb = -(-n // block)
    w = torch.zeros(nb * block, k, dtype=weight.dtype)
    w[:n] = weight.detach()
    return w.view(nb, block, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class NativeLinear(nn.Module):
    """A drop-in inference nn.Linear over the packed bf16 weight (the module docstring)."""

    row_invariant = True  # batch-invariant mode needs no RowTiled around it

    def __init__(self, weight: Tensor, bias: Tensor | None, f32_out: bool = False) -> None:
        super().__init__()
        if not load_native_linear():
            raise RuntimeError("NativeLinear needs AVX-512 BF16 or AVX2 and a C++ compiler "
                               "(see native_linear_supported)")
        self.out_features, self.in_features = weight.shape
        self.packed = pack_weight(weight.to(torch.bfloat16))   # (float32 weights: bf16 values, fits)
        # float32 once here: the kernel adds the bias in float32 (no conversion per call)
        self.bias = None if bias is None else bias.detach().float()
        #: bf16 rows give float32 outputs, the sums not rounded (an LM head's logits)
        self.f32_out = f32_out
        #: prefetch the weight non-temporally (set_streaming: a target too large for the cache,
        #: speculating with a drafter whose weights should stay cached)
        self.stream = False

    @staticmethod
    def fits(weight: Tensor) -> bool:
        """bf16 weights, or float32 weights whose values are all bf16 values (a bf16 checkpoint
        run in float32: the kernel reads them as bf16, which loses nothing, and float32 rows give
        float32 products and sums, as a float32 linear does, at half the bytes)."""
        if not (weight.dim() == 2 and weight.shape[0] > 0 and weight.shape[1] > 0 and weight.shape[1] % 2 == 0):
            return False
        if weight.dtype == torch.float32:
            return native_linear_supported(torch.bfloat16, weight.device) and bf16_exact(weight)
        return native_linear_supported(weight.dtype, weight.device)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.leapfrog_gemm.linear_bf16(x, self.packed, self.bias, self.out_features, self.f32_out,
                                                   self.stream)
