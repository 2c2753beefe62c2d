"""The one sampler's draws in C++, for leapfrog's C++ ops that draw inside a loop (model/native_draft.py's
sampled chains, spec_decode/verify/native.py's chain verification and seeded matching): bitwise the
Python functions they mirror; and the op that computes seeded positions' noise rows (``noise_rows``).

``inverse_cdf_row`` is sampler.inverse_cdf_draw of one row as plain loops rather than eight ATen calls (each
a dispatch, an allocation and, at 8192 columns, maybe a parallel region: some 15 us of a
decode step per draw on a 2-vCPU EPYC, more with the caches cold after the weights' streaming).
The loops compute what ATen computes: ``mass.double().cumsum(-1)`` is a sequential float64 sum
on CPU (ATen's cumulative kernel accumulates in float64 in column order), so summing again in
the same order gives the same partial sums; the total is the last of them; ``minimum`` and
``nextafter`` are exact; ``searchsorted(right=True)`` is the upper bound, a binary search for the
first partial sum above t, as ``std::upper_bound`` (a NaN t finds none in both)."""

from __future__ import annotations

import torch
from torch import Tensor

from leapfrog.utils import env_off
from leapfrog.utils.cpp import OpLibrary

#: sampler.inverse_cdf_draw of one row: ``inverse_cdf_row(mass, V, w)``, mass [V]
#: contiguous, non-negative (any type convertible to double), w in [0, 1) -> the token
INVERSE_CDF_DRAW_CPP = r"""
template <typename scalar_t>
int64_t inverse_cdf_row(const scalar_t* mass, int64_t V, double w) {
  thread_local std::vector<double> cdf;                                        // [V] the partial sums
  cdf.resize(V);
  double c = 0;
  for (int64_t i = 0; i < V; ++i) cdf[i] = c += static_cast<double>(mass[i]);
  const double total = cdf[V - 1];
  const double top = std::nextafter(total, 0.0);
  const double t = std::isnan(total) ? total : std::min(w * total, top);       // (at::minimum: NaN wins)
  // searchsorted(right=True): the first partial sum above t (none: V, clamped to V - 1)
  const int64_t i = std::upper_bound(cdf.begin(), cdf.end(), t) - cdf.begin();
  return std::min(i, V - 1);
}
"""

#: sampler.race_top of one row: ``race_top_row(p, e, vid, V, k, val, idx)`` writes the k largest
#: p[v] / E[v] (float64: a float32 p promotes exactly, as ATen's p / e; e null: E = 1, the argmax
#: of p; ``vid`` non-null: E's column of p's column v is vid[v], a draft vocabulary's target ids)
#: best first into val [k] and their columns into idx [k], the earliest of equal values first (k = 1:
#: torch.argmax's first maximum). p, e contiguous, non-negative finite p, positive finite E. By blocks:
#: the quotients and their maximum in vector code, a block searched only where its maximum would
#: enter the top k (ATen's p / e over [N, V] float64 joined, then topk, took some 9 ms for 96 rows
#: of 8192 where this takes 0.4 ms, stop 115).
RACE_TOP_CPP = r"""
template <typename scalar_t>
void race_top_row(const scalar_t* p, const double* e, const int64_t* vid, int64_t V, int64_t k, double* val,
                  int64_t* idx) {
  for (int64_t i = 0; i < k; ++i) {
    val[i] = -1;
    idx[i] = -1;
  }
  constexpr int64_t W = 256;
  double r[W];
  for (int64_t v0 = 0; v0 < V; v0 += W) {
    const int64_t n = std::min(W, V - v0);
    const scalar_t* pb = p + v0;
    double m = -1;
    if (e && vid) {
      const int64_t* ib = vid + v0;
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < n; ++i) {
        r[i] = static_cast<double>(pb[i]) / e[ib[i]];
        m = std::max(m, r[i]);
      }
    } else if (e) {
      const double* eb = e + v0;
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < n; ++i) {
        r[i] = static_cast<double>(pb[i]) / eb[i];
        m = std::max(m, r[i]);
      }
    } else {
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < n; ++i) {
        r[i] = static_cast<double>(pb[i]);
        m = std::max(m, r[i]);
      }
    }
    if (!(m > val[k - 1])) continue;                                          // (nothing here enters)
    for (int64_t i = 0; i < n; ++i) {
      if (!(r[i] > val[k - 1])) continue;
      int64_t j = k - 1;                                                       // insert, after its equals
      for (; j > 0 && r[i] > val[j - 1]; --j) {
        val[j] = val[j - 1];
        idx[j] = idx[j - 1];
      }
      val[j] = r[i];
      idx[j] = v0 + i;
    }
  }
}
"""

#: A seeded position's noise (sampler.py ``position_noise``), computed where it is read: row key
#: r = sampler.row_key(key, position) (uint64), column v's uniform U = ((h >> 12) + 0.5) 2^-52 with h
#: = mix64(r + (v + 1) G) (splitmix64's stream from r: U in [2^-53, 1 - 2^-53], never 0 or 1), and
#: E = -log U by ``neg_log``: frexp (by the bits: U is normal), then log m = 2 atanh(s) as an odd series in s = (m - 1) / (m + 1),
#: a fixed sequence of IEEE float64 operations that sampler.py's torch twin runs op for op (no FMA:
#: every library that includes this builds with -ffp-contract=off), so the C++ and torch rows are
#: the same bits on any device. Relative error under 5e-16 against a correctly rounded log.
NOISE_CPP = r"""
namespace noise {
constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL;
inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
inline double uniform(uint64_t r, uint64_t v) {
  return (static_cast<double>(mix64(r + (v + 1) * GOLDEN) >> 12) + 0.5) * 0x1p-52;
}
// 1 / (2n + 1), n = 11 .. 0 (sampler.py _SERIES, Horner's order)
constexpr double SERIES[12] = {1.0 / 23, 1.0 / 21, 1.0 / 19, 1.0 / 17, 1.0 / 15, 1.0 / 13,
                               1.0 / 11, 1.0 / 9,  1.0 / 7,  1.0 / 5,  1.0 / 3,  1.0};
constexpr double SQRT_HALF = 0.7071067811865476;
constexpr double LN2 = 0.6931471805599453;
// (frexp by the bits, so that the loop vectorizes: u is normal here, in [2^-53, 1))
inline double neg_log(double u) {
  uint64_t bits;
  std::memcpy(&bits, &u, sizeof bits);
  int64_t x = static_cast<int64_t>((bits >> 52) & 0x7FF) - 1022;              // u = m 2^x, m in [0.5, 1)
  bits = (bits & 0x000FFFFFFFFFFFFFULL) | 0x3FE0000000000000ULL;
  double m;
  std::memcpy(&m, &bits, sizeof m);
  const bool small = m < SQRT_HALF;
  m = small ? m * 2.0 : m;
  x = small ? x - 1 : x;
  const double s = (m - 1.0) / (m + 1.0);
  const double z = s * s;
  double poly = SERIES[0];
  for (int i = 1; i < 12; ++i) poly = poly * z + SERIES[i];
  const double t = s * poly;
  return -(static_cast<double>(x) * LN2 + (t + t));
}
}  // namespace noise
"""

#: race_top_row's result (the k largest p[v] / E[v], E a seeded position's noise) with E computed
#: only where it can matter: ``race_key_row(p, r, vid, V, k, val, idx)``, r the position's row key,
#: vid as race_top_row's. 1 - U <= -log U <= (1 - U) / U bound each quotient; columns whose upper
#: bound p / (1 - U) falls below the k-th largest lower bound p U / (1 - U) (with a 1e-9 margin for
#: rounding) cannot finish in the top k nor tie there, so only the others get their log and their
#: exact quotient, in column order, inserted as race_top_row inserts (a handful of columns at a
#: peaked p; where fewer than k have p > 0, every column with p > 0). Bitwise race_top_row over
#: ``noise_rows``, for finite non-negative p (as race_top_row's; a NaN column is never taken).
RACE_KEY_CPP = r"""
template <typename scalar_t>
void race_key_row(const scalar_t* p, uint64_t r, const int64_t* vid, int64_t V, int64_t k, double* val,
                  int64_t* idx) {
  constexpr int64_t W = 256;
  thread_local std::vector<double> ub;                                         // [V] upper bounds
  ub.resize(V);
  std::vector<double> low(k, -1.0);                                            // the k largest lower bounds
  const int64_t nb = (V + W - 1) / W;
  thread_local std::vector<double> block_ub;                                   // [blocks] their maxima
  block_ub.resize(nb);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t v0 = b * W, n = std::min(W, V - v0);
    double lb[W];
    double mu = -1, ml = -1;
#pragma omp simd reduction(max : mu, ml)
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t col = vid ? static_cast<uint64_t>(vid[v0 + i]) : static_cast<uint64_t>(v0 + i);
      const double u = noise::uniform(r, col);
      const double pv = static_cast<double>(p[v0 + i]);
      const double hi = pv / (1.0 - u);
      ub[v0 + i] = hi;
      lb[i] = hi * u;
      mu = std::max(mu, hi);
      ml = std::max(ml, lb[i]);
    }
    block_ub[b] = mu;
    if (!(ml > low[k - 1])) continue;
    for (int64_t i = 0; i < n; ++i) {
      if (!(lb[i] > low[k - 1])) continue;
      int64_t j = k - 1;
      for (; j > 0 && lb[i] > low[j - 1]; --j) low[j] = low[j - 1];
      low[j] = lb[i];
    }
  }
  const double bar = low[k - 1] * (1 - 1e-9);                                  // (-1: every column)
  for (int64_t i = 0; i < k; ++i) {
    val[i] = -1;
    idx[i] = -1;
  }
  for (int64_t b = 0; b < nb; ++b) {
    if (!(block_ub[b] * (1 + 1e-9) >= bar)) continue;
    const int64_t v0 = b * W, n = std::min(W, V - v0);
    for (int64_t i = 0; i < n; ++i) {
      if (!(ub[v0 + i] * (1 + 1e-9) >= bar)) continue;
      const uint64_t col = vid ? static_cast<uint64_t>(vid[v0 + i]) : static_cast<uint64_t>(v0 + i);
      const double pv = static_cast<double>(p[v0 + i]);                       // (p = 0: 0 whatever E is)
      const double q = pv == 0 ? pv : pv / noise::neg_log(noise::uniform(r, col));
      if (!(q > val[k - 1])) continue;
      int64_t j = k - 1;                                                       // insert, after its equals
      for (; j > 0 && q > val[j - 1]; --j) {
        val[j] = val[j - 1];
        idx[j] = idx[j - 1];
      }
      val[j] = q;
      idx[j] = v0 + i;
    }
  }
}
"""

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <vector>

namespace {
""" + NOISE_CPP + RACE_TOP_CPP + RACE_KEY_CPP + r"""
using at::Tensor;

// sampler.race_top's first k finishers per row of p [N, V] (float32 or float64), keys [N, 2] int64
// (sampler.noise_keys: a row key and whether the row has one): keyed rows race under their row
// key's noise (race_key_row), the others take the top k of p (E = 1) -> values [N, k] float64,
// columns [N, k] long
std::tuple<Tensor, Tensor> race_rows(const Tensor& p, const Tensor& keys, int64_t k) {
  TORCH_CHECK(p.dim() == 2 && p.size(1) > 0 && keys.dim() == 2 && keys.size(0) == p.size(0) &&
              keys.size(1) == 2 && keys.scalar_type() == at::kLong && k >= 1 && k <= p.size(1),
              "race_rows: p [N, V], keys [N, 2] int64, 1 <= k <= V");
  TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble, "race_rows: float32 or float64 p");
  Tensor pc = p.contiguous(), kc = keys.contiguous();
  const int64_t N = pc.size(0), V = pc.size(1);
  Tensor val = at::empty({N, k}, pc.options().dtype(at::kDouble));
  Tensor idx = at::empty({N, k}, pc.options().dtype(at::kLong));
  const int64_t* K = kc.data_ptr<int64_t>();
  double* VA = val.data_ptr<double>();
  int64_t* IX = idx.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(pc.scalar_type(), "race_rows", [&] {
    const scalar_t* P = pc.data_ptr<scalar_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, 32768 / V), [&](int64_t lo, int64_t hi) {
      for (int64_t n = lo; n < hi; ++n) {
        if (K[2 * n + 1])
          race_key_row(P + n * V, static_cast<uint64_t>(K[2 * n]), static_cast<const int64_t*>(nullptr), V, k,
                       VA + n * k, IX + n * k);
        else
          race_top_row(P + n * V, static_cast<const double*>(nullptr), static_cast<const int64_t*>(nullptr),
                       V, k, VA + n * k, IX + n * k);
      }
    });
  });
  return {val, idx};
}

// sampler.position_noise's rows: keys [N] int64 (row keys, uint64 bits) -> [N, V] float64 U, or
// E = -log U where ``exponential``
Tensor noise_rows(const Tensor& keys, int64_t V, bool exponential) {
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && V > 0,
              "noise_rows: keys [N] int64, V > 0");
  Tensor kc = keys.contiguous();
  const int64_t N = kc.size(0);
  Tensor out = at::empty({N, V}, kc.options().dtype(at::kDouble));
  const int64_t* K = kc.data_ptr<int64_t>();
  double* O = out.data_ptr<double>();
  at::parallel_for(0, N, std::max<int64_t>(1, 32768 / V), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const uint64_t r = static_cast<uint64_t>(K[n]);
      double* o = O + n * V;
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) o[v] = noise::uniform(r, static_cast<uint64_t>(v));
      if (exponential) {
#pragma omp simd
        for (int64_t v = 0; v < V; ++v) o[v] = noise::neg_log(o[v]);
      }
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(leapfrog_sampling, m) {
  m.def("noise_rows(Tensor keys, int V, bool exponential) -> Tensor");
  m.def("race_rows(Tensor p, Tensor keys, int k) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(leapfrog_sampling, CPU, m) {
  m.impl("noise_rows", &noise_rows);
  m.impl("race_rows", &race_rows);
}
"""

_LIBRARY = OpLibrary("leapfrog_native_sampling", _SOURCE, ["-O3", "-fopenmp-simd", "-ffp-contract=off"],
                     "native noise op (about 10 s)", "seeded noise is computed by torch", isa=True)


def native_noise_enabled() -> bool:
    """Whether the op may serve: ``LEAPFROG_NATIVE_VERIFY=0`` turns it off with the verify ops, the
    one switch of both libraries (spec_decode/verify/native.py ``native_verify_enabled`` reads it
    here); read at each call."""
    return not env_off("LEAPFROG_NATIVE_VERIFY")


def load_native_noise() -> bool:
    """Build (once, cached on disk) and load the op -> whether it is available."""
    return native_noise_enabled() and _LIBRARY.available()


_loading: list[object] = []   # (the background load started: noise_op_loaded)


def noise_op_loaded() -> bool:
    """Whether the op is loaded; the first call that finds it not starts loading it in the
    background (built once, cached on disk; the torch twin computes the same rows meanwhile).
    Asked only where a row of noise is computed or raced outside the C++ ops that race by key
    (the verify op, the EAGLE chain loop): a draft model's seeded proposals, the Python drafters'
    races, the graphs' rows. Loaded at a seeded request's arrival, the op cost an EAGLE chain's
    first drafting steps the CPU it took (at batch 1 "auto" then weighed them dear and turned
    speculation off for its first request)."""
    if _LIBRARY.loaded():
        return True
    if not _loading and native_noise_enabled():
        from leapfrog.utils.cpp import build_ahead
        _loading.extend(build_ahead([_LIBRARY.available]))
    return False


def noise_rows(keys: Tensor, vocab_size: int, exponential: bool) -> Tensor:
    """[N, V] float64 CPU: the rows of row keys ``keys`` [N] int64 (sampler.position_noise)."""
    return torch.ops.leapfrog_sampling.noise_rows(keys, vocab_size, exponential)


def race_rows(p: Tensor, keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """sampler.race_top's k first finishers per row of p [N, V] on the CPU, keyed rows of ``keys``
    [N, 2] int64 (sampler.noise_keys) under their row key's noise, the others the top k of p ->
    values [N, k] float64, columns [N, k] long."""
    return torch.ops.leapfrog_sampling.race_rows(p, keys, k)
