"""The one sampler's draws in C++, for leapfrog's C++ ops that draw inside a loop (model/native_draft.py's
sampled chains, spec_decode/verify/native.py's chain verification): the same ATen calls, in the same
order, as the Python functions they mirror, so the draws are bitwise theirs."""

#: sampler.inverse_cdf_draw: mass [B, V] (non-negative), w [B] float64 -> [B] long
INVERSE_CDF_DRAW_CPP = r"""
Tensor inverse_cdf_draw(const Tensor& mass, const Tensor& w) {
  Tensor cdf = mass.to(at::kDouble).cumsum(-1);
  Tensor total = cdf.narrow(-1, cdf.size(-1) - 1, 1);
  Tensor t = at::minimum(w.unsqueeze(-1).mul(total), at::nextafter(total, at::zeros_like(total)));
  return at::searchsorted(cdf, t, false, /*right=*/true).select(-1, 0).clamp_max(mass.size(-1) - 1);
}
"""
