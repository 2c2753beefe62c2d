"""The compiled graphs' attention op in C++: ``torch.ops.leapfrog_native.cached_attention``.

Same contract as the Python op ``torch.ops.leapfrog.cached_attention`` (attention/backend.py):
write the new k/v to the cache, attend over the first ``kv_len`` columns of each sequence's row
with the mask, scale 1/sqrt(Dh). On CPU each sequence reads only up to its own last visible
column: a ragged batch costs the sum of its rows' lengths, not batch size x the longest
(benchmarks/attention_bench.py). A compiled graph calls it once per layer, and from C++ the
call costs no Python frames. Eager forwards on CPU call it too for chunks of a few tokens per
sequence (model/runner.py ``_native_attention``: decode, verification, trees); longer prefill
chunks take SDPA.

On CPU it is a direct kernel (``attend_cpu``): one work item per (sequence, KV head), split
over PyTorch's intra-op threads, its queries (tokens x heads sharing that KV head) reading each
column once; keys and values are read in place from the sequence's cache row
(no gathered copy for a batch, no padded query for a lone half-precision token), queries in place
(a verify chunk's q is a strided view of the fused qkv projection), and accumulated in
float32: scores q.k, a max pass, then exp and the weighted sum of values in column order.

Row invariance: a token's output depends only on its query, the columns its mask lets it see and
their contents. The dot product runs over Dh in the vector's fixed lanes (16 with AVX-512, 8 with
AVX2) reduced in ATen's fixed tree, and the value sum
goes column by column, whatever the batch size, the number of tokens per sequence, the padding or
``kv_len``. A token verified among drafts therefore gets bitwise the attention it gets when
decoded alone (tests/attention/test_native.py). SDPA blocks its loops by the batch's shape, so
the Python op has no such guarantee; the two agree to float rounding.

Keys and values are read in blocks of one vector's width of columns (16 with AVX-512), converted
to float32 once per block for all the work item's queries, and a full block's scores are reduced
together (``reduce_block``: the one-column reduction's very tree, vertically; a query's result is
bitwise the same whichever block its columns fall in, tested).

Measured on the built-in target's shapes (bf16, 8 heads x 64, 2 threads, AVX-512), per layer:
ATen's SDPA path (this op before) 53 us for one token over 100 columns, 78 us for 6 tokens over
200; this kernel 18 and 64 us (the README's fast-path section has the table). Column blocks
(AVX-512 Zen 4, the op alone): 1 / 5 / 16 / 32 tokens over 133 columns 17 / 44 / 122 / 179 us
before, 12 / 24 / 48 / 91 us with them. A full block's scaling, masking and running max are
vectorized on AVX2 too (``scale_mask_block``; it was the scalar loop there): float32, 8 heads x
64, 2 threads, Zen 3, the op alone against the scalar build, interleaved, same bits: 6 tokens over
166 columns 54 / 65 / 65 us against 59 / 72 / 71 (three runs), one token 20 / 32 / 30 against 21 / 33 / 30.

While it works on a block, the op asks for the next block's cache lines (``prefetch_block``): at
long contexts the keys and values come from the last-level cache, and the hardware's prefetch fell
behind (the built-in target's shape, bf16, 12 layers' caches in turn: 8 tokens over 1900 columns
0.90-0.92x the time, one token 0.94-0.97x, a batch of 16 x 5 tokens over 200 columns 0.79-0.85x;
``benchmarks/attention_bench.py --prefetch-ab``, against the build without it, ``attention_source``).

On CUDA the op calls ATen (index_put_ and SDPA).

It is built once with ``torch.utils.cpp_extension.load_inline`` (utils/cpp.py; about 20 s on 2 cores, cached
under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``, one build per CPU
instruction set) when the fast path is first compiled; if it cannot be built, graphs call the
Python op instead (logged).
"""

from __future__ import annotations

import logging
import threading

import torch

from leapfrog.utils.cpp import build_inline, with_namespace

log = logging.getLogger("leapfrog.attention")

_SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
using at::indexing::Slice;

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t MAX_VECS = 32;   // head_dim up to 32 vectors (512 with AVX-512, 256 with AVX2)

template <typename T>
inline Vec load_f(const T* p) {   // Vec::size() elements as float32
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// exp of each lane: -inf (a masked column) gives 0 and NaN stays NaN (exp_u20 alone clamps it to
// a finite value, which would hide a model's overflow from the engine's non-finite checks).
inline Vec exp_lanes(const Vec& d) {
  return Vec::blendv(Vec::blendv(d.exp_u20(), Vec(0.f), d == Vec(-INFINITY)), d, d != d);
}

// x[l] = exp(x[l] - mx) for l < n, vectorized (ATen's exp_u20, as its CPU flash attention uses).
// Elementwise, so a column's weight does not depend on n.
inline void exp_shifted(float* x, float mx, int64_t n) {
  const Vec vmx(mx);
  for (int64_t l = 0; l < n; l += Vec::size()) {
    const int64_t c = std::min<int64_t>(Vec::size(), n - l);   // the last block may be partial
    exp_lanes(Vec::loadu(x + l, c) - vmx).store(x + l, c);
  }
}

// src [B, S, Hkv, Dh] (strides st[0..2] of its first three dims, Dh contiguous) ->
// cache[write_rows[i], :, write_cols[i]] for token i = b * S + s (cache [rows + 1, Hkv, ML, Dh]).
// A verify chunk's values are a strided view of the fused qkv projection: read in place.
template <typename T>
void write_cache(const T* src, const int64_t* st, T* cache, const int64_t* wr, const int64_t* wc, int64_t B,
                 int64_t S, int64_t Hkv, int64_t Dh, int64_t ML) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t i = b * S + s;
      for (int64_t h = 0; h < Hkv; ++h)
        std::memcpy(cache + ((wr[i] * Hkv + h) * ML + wc[i]) * Dh, src + b * st[0] + s * st[1] + h * st[2],
                    Dh * sizeof(T));
    }
}

// Column blocks: keys and values are read BL columns at a time (converted to float32 once per
// block, then shared by every query of the work item), and BL scores are reduced at once:
// reduce_block sums each of BL vectors over its lanes with exactly vec_reduce_all's tree (ATen's
// VecReduceAllSIMD: lanes i ^ 8, then i ^ 4, i ^ 2, i ^ 1 with AVX-512; i ^ 4, i ^ 2, i ^ 1 with
// AVX2), only vertically: the same additions of the same pairs, so a column's score is bitwise
// what the one-column reduction gives (the tail of fewer than BL columns still takes that one).
// One query's reduction took ~20 dependent cycles per column; BL of them at once cost about
// 2 BL shuffles and BL adds in all.
#if defined(CPU_CAPABILITY_AVX512)
#define LEAPFROG_BLOCK_REDUCE 1
inline Vec reduce_block(const Vec* a) {   // a[s] holds column slot_col(s); lane c of the result = column c
  __m512 b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m) {   // lanes i and i ^ 8: two columns per vector, 8 lanes each
    const __m512 x = a[2 * m], y = a[2 * m + 1];
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int m = 0; m < 4; ++m)     // i ^ 4: four columns, 4 lanes each
    c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m)     // i ^ 2: eight columns, 2 lanes each
    d[m] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0xEE));
  return Vec(_mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD)));  // i ^ 1
}
constexpr int slot_col(int s) { return 4 * (s & 3) + (s >> 2); }
#elif defined(CPU_CAPABILITY_AVX2)
#define LEAPFROG_BLOCK_REDUCE 1
inline Vec reduce_block(const Vec* a) {
  __m256 b[4], c[2];
  for (int m = 0; m < 4; ++m) {   // lanes i and i ^ 4: two columns per vector
    const __m256 x = a[2 * m], y = a[2 * m + 1];
    b[m] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  }
  for (int m = 0; m < 2; ++m)     // i ^ 2
    c[m] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * m], b[2 * m + 1], 0x44),
                         _mm256_shuffle_ps(b[2 * m], b[2 * m + 1], 0xEE));
  return Vec(_mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD)));  // i ^ 1
}
constexpr int slot_col(int s) { return 4 * (s & 1) + (s >> 1); }
#else
#define LEAPFROG_BLOCK_REDUCE 0
#endif
constexpr int BL = Vec::size();   // columns per block

// q . k over head_dim: lanes u * Vec::size() + i summed over u in order (FMAs), then the lanes
// in vec_reduce_all's tree.
inline float dot_col(const float* qj, const float* k, int64_t nv) {
  Vec a = Vec::loadu(qj) * Vec::loadu(k);
  for (int64_t u = 1; u < nv; ++u)
    a = at::vec::fmadd(Vec::loadu(qj + u * Vec::size()), Vec::loadu(k + u * Vec::size()), a);
  return at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, a);
}

// sj[c] = q . k_c for the BL columns of a block (kb [BL, NV * Vec::size()] float32): per column
// dot_col's arithmetic, NV known to the compiler (the query and the BL sums stay in registers).
template <int NV>
inline void dots_block(const float* qj, const float* kb, float* sj) {
#if LEAPFROG_BLOCK_REDUCE
  constexpr int D = NV * Vec::size();
  Vec qv[NV], a[BL];
  for (int u = 0; u < NV; ++u) qv[u] = Vec::loadu(qj + u * Vec::size());
  for (int s = 0; s < BL; ++s) {
    const float* k = kb + slot_col(s) * D;
    Vec x = qv[0] * Vec::loadu(k);
    for (int u = 1; u < NV; ++u) x = at::vec::fmadd(qv[u], Vec::loadu(k + u * Vec::size()), x);
    a[s] = x;
  }
  reduce_block(a).store(sj);
#else
  for (int c = 0; c < BL; ++c) sj[c] = dot_col(qj, kb + c * NV * Vec::size(), NV);
#endif
}

// sj[c] = visible ? sj[c] * scale : -inf for columns c < n -> max(m, the visible scores) (a NaN
// score is skipped: std::max(m, NaN) = m); the running max in a register (through memory, each
// column waited on the last one's store).
inline float scale_mask(float* sj, const bool* vj, int64_t n, float scale, float m) {
  for (int64_t c = 0; c < n; ++c) {
    const float sc = vj[c] ? sj[c] * scale : -INFINITY;
    if (vj[c]) m = std::max(m, sc);
    sj[c] = sc;
  }
  return m;
}

// scale_mask over a full block of BL columns, vectorized (the same arithmetic; the max is exact, so
// its order does not matter: only the sign of a zero maximum can differ, and x - 0 = x - (-0) for
// every x but a zero, whose exp is 1 either way).
inline float scale_mask_block(float* sj, const bool* vj, float scale, float m) {
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 mk = _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vj)), _mm_set1_epi8(1));
  const __m512 sc = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), mk, _mm512_loadu_ps(sj), _mm512_set1_ps(scale));
  _mm512_storeu_ps(sj, sc);
  const __m512 vm = _mm512_set1_ps(m);
  return _mm512_reduce_max_ps(_mm512_mask_max_ps(vm, mk, sc, vm));   // vmaxps(NaN, m) = m
#elif defined(CPU_CAPABILITY_AVX2)
  // 8 bools (0 or 1) -> lanes all ones where visible (the scalar loop took ~8 dependent steps a block)
  const __m256i vis = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vj)));
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(vis, _mm256_setzero_si256()));
  const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_mul_ps(_mm256_loadu_ps(sj), _mm256_set1_ps(scale)),
                                     keep);
  _mm256_storeu_ps(sj, sc);
  const __m256 vm = _mm256_set1_ps(m);
  const __m256 x = _mm256_blendv_ps(vm, _mm256_max_ps(sc, vm), keep);   // vmaxps(NaN, m) = m; masked: m
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
  return scale_mask(sj, vj, BL, scale, m);
#endif
}

// acc += p_c * v_c and sum += p_c over the block's visible columns c < nb in column order
// (vb [nb, NV * Vec::size()] float32), the accumulators in registers.
template <int NV>
inline void values_block(const float* pj, const bool* vj, const float* vb, int64_t nb, float* aj, float& sum) {
  constexpr int D = NV * Vec::size();
  Vec a[NV];
  for (int u = 0; u < NV; ++u) a[u] = Vec::loadu(aj + u * Vec::size());
  float s = sum;
  for (int64_t c = 0; c < nb; ++c) {
    if (!vj[c]) continue;
    s += pj[c];
    const Vec vp(pj[c]);
    for (int u = 0; u < NV; ++u) a[u] = at::vec::fmadd(vp, Vec::loadu(vb + c * D + u * Vec::size()), a[u]);
  }
  for (int u = 0; u < NV; ++u) a[u].store(aj + u * Vec::size());
  sum = s;
}

// The same for any head_dim (nv vectors): the accumulators through memory.
inline void values_block_any(const float* pj, const bool* vj, const float* vb, int64_t nb, int64_t nv, float* aj,
                             float& sum) {
  const int64_t D = nv * Vec::size();
  for (int64_t c = 0; c < nb; ++c) {
    if (!vj[c]) continue;
    sum += pj[c];
    const Vec vp(pj[c]);
    for (int64_t u = 0; u < nv; ++u)
      at::vec::fmadd(vp, Vec::loadu(vb + c * D + u * Vec::size()), Vec::loadu(aj + u * Vec::size()))
          .store(aj + u * Vec::size());
  }
}

// Ask for the cache lines of [p, p + bytes) (the next column block's keys or values) ahead of their
// use: a block's columns are read in order, but the hardware's own prefetch did not keep up with
// the L3 (measured: the built-in target's attention shape, bf16, 12 layers' caches in turn, 1900
// columns: 8 queries 427-519 -> 360-376 us a layer, one query 121-134 -> 113-120 us). Only the
// lines of columns the row reads; values are not touched.
#ifndef LEAPFROG_ATTN_PREFETCH
#define LEAPFROG_ATTN_PREFETCH 1   // (0: the variant without, attention_source)
#endif
inline void prefetch_block(const void* p, int64_t bytes) {
#if LEAPFROG_ATTN_PREFETCH
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
#else
  (void)p, (void)bytes;
#endif
}

// q [B, S, H, Dh] -> out [B, S, H, Dh]. One work item per (sequence b, KV head): its S x group
// queries share each block of key and value columns as it is loaded. Per query: scores q.k
// (float32 FMAs over head_dim in Vec lanes, then ATen's fixed reduction tree) times 1/sqrt(Dh);
// the max; exp; then the sum of weights and of weighted values column by column. Nothing in a
// query's arithmetic depends on the other queries, S, B or L (a full block and the tail reduce
// alike): its result is row-invariant.
template <typename T>
void attend_cpu(const T* q, const int64_t* qst, const T* kc, const T* vc, T* out, const int64_t* rows,
                const bool* mask, int64_t B, int64_t S, int64_t H, int64_t Hkv, int64_t Dh, int64_t ML, int64_t L) {
  const int64_t group = H / Hkv, nq = S * group, nv = Dh / Vec::size(), Lc = std::max<int64_t>(L, 1);
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  at::parallel_for(0, B * Hkv, 1, [&, scale](int64_t begin, int64_t end) {   // scale by value: a register
    std::vector<float> qf(nq * Dh), acc(nq * Dh), score(nq * Lc), mx(nq), sum(nq), blk(BL * Dh);
    std::vector<const bool*> vis(nq);
    // a block of BL key (value) columns [l0, l0 + nb) as float32 rows of Dh: float32 caches are
    // read in place, others converted once into blk (a cache row's columns are contiguous, so
    // the block is nb * Dh contiguous values; one flat loop with its bounds in registers)
    auto load_block = [&blk, Dh](const T* src, int64_t l0, int64_t nb, int64_t end) -> const float* {
      // the next block's lines asked for now, if it is read (prefetch_block; ``end``: the row's
      // extent): the block's own work hides their wait
      if (l0 + BL < end) prefetch_block(src + (l0 + BL) * Dh, std::min<int64_t>(BL, end - l0 - BL) * Dh * sizeof(T));
      if constexpr (std::is_same_v<T, float>) {
        return src + l0 * Dh;
      } else {
        const T* from = src + l0 * Dh;
        float* to = blk.data();
        const int64_t n = nb * Dh;
        for (int64_t i = 0; i < n; i += Vec::size()) load_f(from + i).store(to + i);
        return to;
      }
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, hk = item % Hkv;
      const int64_t base = (rows[b] * Hkv + hk) * ML * Dh;
      const T* K = kc + base;
      const T* V = vc + base;
      for (int64_t j = 0; j < nq; ++j) {   // query j: token s = j / group, head hk * group + j % group
        const int64_t s = j / group, h = hk * group + j % group;
        const T* qi = q + b * qst[0] + s * qst[1] + h * qst[2];   // (q's strides: a view of the fused qkv)
        for (int64_t d = 0; d < Dh; ++d) qf[j * Dh + d] = static_cast<float>(qi[d]);
        vis[j] = mask + (b * S + s) * ML;
        mx[j] = -INFINITY;
      }
      // this sequence's own extent: its tokens' last visible column + 1. kv_len is the batch's
      // longest sequence's; past a shorter one's columns everything is masked, and leaving those
      // columns out changes nothing a query computes (masked columns add nothing, full and tail
      // blocks reduce alike), while reading them made every sequence of a ragged batch (drafts
      // accepted unevenly, continuous batching) pay for the longest one's keys and values
      int64_t Li = 0;
      for (int64_t s = 0; s < S; ++s) {
        const bool* row = mask + (b * S + s) * ML;
        for (int64_t c = L; c > Li; --c)
          if (row[c - 1]) { Li = c; break; }
      }
      for (int64_t l0 = 0; l0 < Li; l0 += BL) {
        const int64_t nb = std::min<int64_t>(BL, Li - l0);
        const float* kb = load_block(K, l0, nb, Li);
        for (int64_t j = 0; j < nq; ++j) {
          const float* qj = qf.data() + j * Dh;
          float* sj = score.data() + j * Lc + l0;
          if (nb == BL && nv == 4) dots_block<4>(qj, kb, sj);
          else if (nb == BL && nv == 8) dots_block<8>(qj, kb, sj);
          else if (nb == BL && nv == 2) dots_block<2>(qj, kb, sj);
          else for (int64_t c = 0; c < nb; ++c) sj[c] = dot_col(qj, kb + c * Dh, nv);
          const bool* vj = vis[j] + l0;
          mx[j] = nb == BL ? scale_mask_block(sj, vj, scale, mx[j]) : scale_mask(sj, vj, nb, scale, mx[j]);
        }
      }
      for (int64_t j = 0; j < nq; ++j) exp_shifted(score.data() + j * Lc, mx[j], Li);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t l0 = 0; l0 < Li; l0 += BL) {
        const int64_t nb = std::min<int64_t>(BL, Li - l0);
        const float* vb = load_block(V, l0, nb, Li);
        for (int64_t j = 0; j < nq; ++j) {
          const float* pj = score.data() + j * Lc + l0;
          const bool* vj = vis[j] + l0;
          float* aj = acc.data() + j * Dh;
          if (nv == 4) values_block<4>(pj, vj, vb, nb, aj, sum[j]);
          else if (nv == 8) values_block<8>(pj, vj, vb, nb, aj, sum[j]);
          else values_block_any(pj, vj, vb, nb, nv, aj, sum[j]);
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t s = j / group, h = hk * group + j % group;
        const float inv = sum[j] > 0.f ? 1.f / sum[j] : 0.f;   // no visible column: zeros, as SDPA gives
        T* o = out + ((b * S + s) * H + h) * Dh;
        for (int64_t d = 0; d < Dh; ++d) o[d] = static_cast<T>(acc[j * Dh + d] * inv);
      }
    }
  });
}

// t: contiguous int64 (a few values: a plain loop, no reduction kernels)
void check_index(const at::Tensor& t, int64_t bound, const char* what) {
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < bound, "cached_attention: ", what, " ", p[i], " out of range [0, ", bound, ")");
}

}  // namespace

// The same contract through ATen calls (CUDA, and CPU head dims the kernel does not take):
// index_put_, then SDPA over the rows' first kv_len columns.
at::Tensor cached_attention_aten(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                                 const at::Tensor& write_rows, const at::Tensor& write_cols,
                                 const at::Tensor& mask, const at::Tensor& kv_len) {
  // On CUDA nothing is read on the host (the op runs inside CUDA graphs): the whole width, masked.
  const int64_t L = k_cache.is_cuda() ? mask.size(3) : kv_len.item<int64_t>();
  k_cache.index_put_({write_rows, Slice(), write_cols}, k.flatten(0, 1));
  v_cache.index_put_({write_rows, Slice(), write_cols}, v.flatten(0, 1));
  at::Tensor keys, values;
  if (rows.numel() == 1 && k_cache.is_cpu()) {  // one row: a view
    const int64_t r = rows.item<int64_t>();
    keys = k_cache.slice(0, r, r + 1).slice(2, 0, L);
    values = v_cache.slice(0, r, r + 1).slice(2, 0, L);
  } else {
    keys = k_cache.slice(2, 0, L).index_select(0, rows);
    values = v_cache.slice(2, 0, L).index_select(0, rows);
  }
  at::Tensor m = mask.slice(3, 0, L);
  at::Tensor qt = q.transpose(1, 2);
  const bool gqa = q.size(2) != k.size(2);
  at::Tensor o;
  if (qt.size(2) == 1 && qt.is_cpu() && (qt.scalar_type() == at::kBFloat16 || qt.scalar_type() == at::kHalf)) {
    // a lone half-precision CPU query runs as two rows (attention/backend.py: the one-row path is slower)
    o = at::scaled_dot_product_attention(at::cat({qt, qt}, 2), keys, values, m.expand({-1, -1, 2, -1}),
                                         0.0, false, std::nullopt, gqa).slice(2, 0, 1);
  } else {
    o = at::scaled_dot_product_attention(qt, keys, values, m, 0.0, false, std::nullopt, gqa);
  }
  return o.transpose(1, 2).contiguous();
}

// q [B, S, H, Dh]; k, v [B, S, Hkv, Dh]; caches [rows + 1, Hkv, max_len, Dh]; rows [B];
// write_rows, write_cols [B*S]; mask [B, 1, S, max_len] bool; kv_len [] int64 -> [B, S, H, Dh]
at::Tensor cached_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                                const at::Tensor& write_rows, const at::Tensor& write_cols,
                                const at::Tensor& mask, const at::Tensor& kv_len) {
  if (q.size(3) % Vec::size() != 0 || q.size(3) > MAX_VECS * Vec::size())   // the kernel's lanes
    return cached_attention_aten(q, k, v, k_cache, v_cache, rows, write_rows, write_cols, mask, kv_len);
  const int64_t L = kv_len.item<int64_t>();
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), Dh = q.size(3), Hkv = k.size(2);
  const int64_t ML = k_cache.size(2);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cached_attention: caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
              k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "cached_attention: q, k, v and the caches must share a dtype");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && Hkv > 0 && Dh > 0 && H % Hkv == 0 &&
              k.sizes() == at::IntArrayRef({B, S, Hkv, Dh}) && v.sizes() == k.sizes() && k_cache.dim() == 4 &&
              k_cache.size(1) == Hkv && k_cache.size(3) == Dh && v_cache.sizes() == k_cache.sizes(),
              "cached_attention: q [B, S, H, Dh], k and v [B, S, Hkv, Dh], caches [rows, Hkv, max_len, Dh] alike");
  TORCH_CHECK(L >= 0 && L <= ML && mask.size(-1) == ML && mask.numel() == B * S * ML &&
              mask.scalar_type() == at::kBool, "cached_attention: mask [B, 1, S, max_len] bool, kv_len <= max_len");
  TORCH_CHECK(rows.numel() == B && write_rows.numel() == B * S && write_cols.numel() == B * S,
              "cached_attention: index shapes");
  const at::Tensor r = rows.to(at::kLong).contiguous(), wr = write_rows.to(at::kLong).contiguous();
  const at::Tensor wc = write_cols.to(at::kLong).contiguous(), m = mask.contiguous();
  check_index(r, k_cache.size(0), "rows");
  check_index(wr, k_cache.size(0), "write_rows");
  check_index(wc, ML, "write_cols");
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();   // read in place where Dh is contiguous
  const at::Tensor kk = k.stride(3) == 1 ? k : k.contiguous(), vv = v.stride(3) == 1 ? v : v.contiguous();
  at::Tensor out = at::empty({B, S, H, Dh}, q.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const int64_t* wrp = wr.data_ptr<int64_t>();
    const int64_t* wcp = wc.data_ptr<int64_t>();
    write_cache(kk.data_ptr<T>(), kk.strides().data(), k_cache.data_ptr<T>(), wrp, wcp, B, S, Hkv, Dh, ML);
    write_cache(vv.data_ptr<T>(), vv.strides().data(), v_cache.data_ptr<T>(), wrp, wcp, B, S, Hkv, Dh, ML);
    attend_cpu(qc.data_ptr<T>(), qc.strides().data(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), out.data_ptr<T>(),
               r.data_ptr<int64_t>(), m.data_ptr<bool>(), B, S, H, Hkv, Dh, ML, L);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "cached_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

// flexible_layout: the kernel takes any strides (it makes what it needs contiguous itself), so
// inductor passes every layer the same buffers. Under the default (needs_exact_strides) a graph
// that computes its metadata (the rounds graphs: masks, write columns from ``col``) got a fresh
// copy per call, each recomputed: 6 x [6, 2048] masks per verify, ~25 us per layer.
TORCH_LIBRARY(leapfrog_native, m) {
  m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor rows, Tensor write_rows, Tensor write_cols, Tensor mask, Tensor kv_len) -> Tensor",
        {at::Tag::flexible_layout});
}
TORCH_LIBRARY_IMPL(leapfrog_native, CPU, m) { m.impl("cached_attention", &cached_attention_cpu); }
TORCH_LIBRARY_IMPL(leapfrog_native, CUDA, m) { m.impl("cached_attention", &cached_attention_aten); }
"""

_STATE: dict[str, bool] = {}  # memo of load_native_attention (the op is process-wide once loaded)
_LOCK = threading.Lock()       # one build at a time; callers wait for its result


def load_native_attention() -> bool:
    """Build (once, cached on disk) and load the C++ op. -> whether it is available."""
    with _LOCK:
        if "ok" not in _STATE:
            _STATE["ok"] = _load()
    return _STATE["ok"]


def attention_source(prefetch: bool = True, namespace: str = "leapfrog_native") -> str:
    """The op's C++ source, with or without the software prefetch of the next column block and
    under op namespace ``namespace``: variants to time side by side (benchmarks/attention_bench.py
    ``--prefetch-ab``); the engine's op is the default."""
    source = _SOURCE if prefetch else "#define LEAPFROG_ATTN_PREFETCH 0\n" + _SOURCE
    return with_namespace(source, "leapfrog_native", namespace)


def load_variant(prefetch: bool, namespace: str):
    """Build (about 20 s, once) and load the op with or without the prefetch under ``namespace``
    (``attention_source``) -> the op."""
    build_inline(f"{namespace}_attention_{'prefetch' if prefetch else 'noprefetch'}",
                 attention_source(prefetch, namespace), ["-O3"])
    return getattr(torch.ops, namespace).cached_attention


def _load() -> bool:
    try:
        log.info("loading leapfrog's native attention op (built once, about 20 s)")
        build_inline("leapfrog_native_attention", attention_source(), ["-O3"])
        torch.library.register_fake("leapfrog_native::cached_attention")(_fake)
        return True
    except Exception as e:  # noqa: BLE001 - no compiler, headers, ...: the Python op serves
        log.warning("native attention op unavailable (%s: %s); compiled graphs call the Python op",
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return False


def _fake(q, k, v, k_cache, v_cache, rows, write_rows, write_cols, mask, kv_len):
    # contiguous, as the kernel returns it (with flexible_layout, q may come in with other strides)
    return q.new_empty(q.shape)
