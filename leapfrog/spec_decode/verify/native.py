"""Speculative sampling of chains as one C++ call (``torch.ops.leapfrog_verify.chain_rejection``).

A verify step of unseeded, temperature-only sampled requests (a chat's temperature 0.7) ran some
40 tensor operations through Python around a handful of small kernels: the target's processed
distributions (sampler.temperature_probs), the acceptance tests and the residual of the first
rejection (verify/rejection.py ``rejection_accept``) and the final draw by inverse CDF
(sampler.sample): about 0.6 ms of a 5.7 ms step of the built-in EAGLE-3 chain at T = 0.7 on a
2-vCPU EPYC, where the kernels take well under 0.1 ms. The op makes the same ATen calls, in the
same order, on the same tensors, so its tokens are bitwise the Python path's
(tests/spec_decode/test_native_verify.py); the uniforms are drawn by the caller from each request's
generator as the Python path draws them (the acceptance tests' first, then the final draw's), so
the randomness is the same too.

    p = softmax(logits / T)                           [T + B, V] (rows of request b: start_b .. start_b + k_b)
    ok = all rows of p finite (else the caller takes the Python path, which raises)
    accept_t = u_t < p(x_t) / q(x_t)                  (q None: point masses, q(x) = 1)
    n_b = leading accepted drafts of request b
    final_b = p at row start_b + n_b; after a rejection norm(max(p - q, 0)) there (q None: p without
              the rejected token), p itself where that has no mass
    token_b = inverse-CDF draw from final_b with w_b  (sampler.inverse_cdf_draw)

Built once like the other C++ ops (utils/cpp.py, about 10 s, cached); where it cannot be built
the Python path serves. ``LEAPFROG_NATIVE_VERIFY=0`` turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from leapfrog.sampling.native import INVERSE_CDF_DRAW_CPP
from leapfrog.utils import env_off
from leapfrog.utils.cpp import OpLibrary

_SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>

namespace {
using at::Tensor;

// sampler.inverse_cdf_draw (sampling/native.py)
""" + INVERSE_CDF_DRAW_CPP + r"""

// the module docstring: -> ok [] bool, num_accepted [B] long, tokens [B] long
std::tuple<Tensor, Tensor, Tensor> chain_rejection(
    const Tensor& logits, const Tensor& temperature, const Tensor& q, const Tensor& draft_ids,
    at::IntArrayRef num_draft, const Tensor& u, const Tensor& w) {
  const int64_t B = num_draft.size(), T = draft_ids.size(0);
  int64_t drafted = 0;
  for (int64_t k : num_draft) {
    TORCH_CHECK(k >= 0, "chain_rejection: negative draft count");
    drafted += k;
  }
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == T + B && drafted == T && u.numel() == T && w.numel() == B &&
              temperature.numel() == T + B && (!q.numel() || (q.dim() == 2 && q.size(0) == T &&
                                                                q.size(1) == logits.size(1))),
              "chain_rejection: logits [T + B, V], temperature [T + B], q [T, V] or empty, drafts and u [T], "
              "w [B], sum(num_draft) == T");
  auto longs = logits.options().dtype(at::kLong);
  // sampler.temperature_probs (no greedy rows) and _finite's check
  Tensor p = at::softmax(logits.div(temperature.unsqueeze(1)), -1);             // [N, V]
  Tensor ok = at::isfinite(p.sum(-1)).all();
  if (!ok.item<bool>()) return {ok, at::empty({0}, longs), at::empty({0}, longs)};
  // verify/rejection.py rejection_accept
  std::vector<int64_t> starts, rows;
  int64_t s = 0;
  for (int64_t b = 0; b < B; ++b) {
    starts.push_back(s);
    for (int64_t j = 0; j < num_draft[b]; ++j) rows.push_back(s + j);
    s += num_draft[b] + 1;
  }
  std::vector<uint8_t> accept;
  if (T) {
    Tensor draft_rows = at::tensor(rows, longs);
    Tensor p_x = p.index({draft_rows, draft_ids});                               // [T]
    Tensor q_x = q.numel() ? q.index({at::arange(T, longs), draft_ids}) : at::ones_like(p_x);
    Tensor a = u.lt(p_x.div(q_x)).to(at::kByte).contiguous();
    accept.assign(a.data_ptr<uint8_t>(), a.data_ptr<uint8_t>() + T);
  }
  std::vector<int64_t> num_accepted, final_rows, rejected, residual_of;
  int64_t t = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t k = num_draft[b];
    int64_t n = 0;
    while (n < k && accept[t + n]) ++n;
    num_accepted.push_back(n);
    final_rows.push_back(starts[b] + n);
    if (n < k) {
      rejected.push_back(b);
      residual_of.push_back(t + n);
    }
    t += k;
  }
  Tensor final_p = p.index({at::tensor(final_rows, longs)}).clone();           // [B, V]
  if (!rejected.empty()) {
    Tensor which = at::tensor(rejected, longs), idx = at::tensor(residual_of, longs);
    Tensor rows_p = final_p.index({which});
    Tensor resid = q.numel() ? rows_p.sub(q.index({idx})).clamp_min(0)
                             : rows_p.scatter(1, draft_ids.index({idx}).unsqueeze(1), 0.0);
    Tensor mass = resid.sum(-1, true);
    final_p.index_put_({which}, at::where(mass.gt(0), resid.div(mass.clamp_min(1e-30)), rows_p));
  }
  // sampler.sample of unseeded rows
  return {ok, at::tensor(num_accepted, longs), inverse_cdf_draw(final_p, w)};
}
}  // namespace

TORCH_LIBRARY(leapfrog_verify, m) {
  m.def("chain_rejection(Tensor logits, Tensor temperature, Tensor q, Tensor draft_ids, int[] num_draft, "
        "Tensor u, Tensor w) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(leapfrog_verify, CPU, m) {
  m.impl("chain_rejection", &chain_rejection);
}
"""

_LIBRARY = OpLibrary("leapfrog_native_verify", _SOURCE, ["-O2"], "native chain verification op (about 10 s)",
                     "verifying in Python")


def native_verify_enabled() -> bool:
    """Whether the op may serve (LEAPFROG_NATIVE_VERIFY=0 turns it off); read when an engine is built."""
    return not env_off("LEAPFROG_NATIVE_VERIFY")


def load_native_verify() -> bool:
    """Build (once, cached on disk; at the first step that can use it) and load the op -> whether it
    is available."""
    return _LIBRARY.available()


@dataclass
class ChainDraw:
    num_accepted: list[int]   # [B]
    tokens: list[int]         # [B] each request's final token (recovered or bonus)


def chain_rejection(logits: Tensor, temperatures: Tensor, q: Tensor | None, draft_ids: Tensor,
                    num_draft: list[int], u: Tensor, w: Tensor) -> ChainDraw | None:
    """Speculative sampling of chains (module docstring) on CPU logits [T + B, V] float32:
    ``temperatures`` [T + B] float32 per target row, q [T, V] (None: point masses), the drafts [T],
    the acceptance tests' uniforms u [T] and the final draws' w [B] float64. -> None when a row of
    p is not finite (``finite_rows`` tells beforehand, without drawing the uniforms)."""
    ok, n, tok = torch.ops.leapfrog_verify.chain_rejection(
        logits, temperatures, torch.empty(0) if q is None else q, draft_ids, num_draft, u, w)
    if not bool(ok):
        return None
    return ChainDraw(n.tolist(), tok.tolist())


def finite_rows(logits: Tensor, temperatures: Tensor) -> bool:
    """Whether every row of softmax(logits / T) is finite, from each row's max alone: the max
    propagates NaN, and when max / T is finite every other l / T is at most it, so exp(l / T - max / T)
    and the row's sum are finite (an all -inf row has max -inf). ``amax``, not ``max(-1)``: the
    values alone, vectorised (7 against 27 us on [6, 8192] here; both propagate NaN)."""
    return bool(torch.isfinite(logits.amax(-1) / temperatures).all())
