"""The one sampler's draws in C++, for leapfrog's C++ ops that draw inside a loop (model/native_draft.py's
sampled chains, spec_decode/verify/native.py's chain verification and seeded matching): bitwise the
Python functions they mirror.

``inverse_cdf_row`` is sampler.inverse_cdf_draw of one row as plain loops rather than eight ATen calls (each
a dispatch, an allocation and, at 8192 columns, maybe a parallel region: some 15 us of a
decode step per draw on a 2-vCPU EPYC, more with the caches cold after the weights' streaming).
The loops compute what ATen computes: ``mass.double().cumsum(-1)`` is a sequential float64 sum
on CPU (ATen's cumulative kernel accumulates in float64 in column order), so summing again in
the same order gives the same partial sums; the total is the last of them; ``minimum`` and
``nextafter`` are exact; ``searchsorted(right=True)`` is the upper bound, a binary search for the
first partial sum above t, as ``std::upper_bound`` (a NaN t finds none in both)."""

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
