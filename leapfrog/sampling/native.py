"""The one sampler's draws in C++, for leapfrog's C++ ops that draw inside a loop (model/native_draft.py's
sampled chains, spec_decode/verify/native.py's chain verification): bitwise the Python functions
they mirror.

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
