"""Speculative sampling of chains as one C++ call (``torch.ops.leapfrog_verify.chain_rejection``), and
seeded requests' matching races (``race_match``).

A verify step of unseeded, temperature-only sampled requests (a chat's temperature 0.7) ran some
40 tensor operations through Python around a handful of small kernels: the target's processed
distributions (sampler.temperature_probs), the acceptance tests and the residual of the first
rejection (verify/rejection.py ``rejection_accept``) and the final draw by inverse CDF
(sampler.sample): about 0.6 ms of a 5.7 ms step of the built-in EAGLE-3 chain at T = 0.7 on a
2-vCPU EPYC, where the kernels take well under 0.1 ms. The op calls ATen for the kernels whose
summation order decides bits (the softmax, a residual's sum) and for the finiteness check (p's
row sums), and does the rest in plain loops (the final draws over threads in large batches)
that compute the same float32 and float64 values (sampling/native.py for the inverse CDF): its
tokens are bitwise the Python path's (tests/spec_decode/test_native_verify.py; the rejected
rows' residuals are summed as one [R, V] tensor, as there: ATen sums a lone [1, V] row of 32768
columns or more in per-thread chunks, other bits). In the engine a step's verification went from
0.35 to 0.17 ms (the built-in chain at T = 0.7, stop 77; the small ATen calls cost 3-7x their
warm-cache time there, after the weights' streaming). The uniforms are drawn by the caller
from each request's generator as the Python path draws them (the acceptance tests' first, then
the final draw's), so the randomness is the same too; where a row of p is not finite (or the op
fails) the caller puts the generators back before raising, as the Python path raises before
drawing. Plain decode's sampled steps draw through it too (chains of no drafts: the softmax, the
check and the draw; 0.17-0.20 -> 0.12-0.14 ms a step at T = 0.7 in step_bench, stop 77).

    p = softmax(logits / T)                           [T + B, V] (rows of request b: start_b .. start_b + k_b)
    ok = all rows of p finite (else the caller raises the Python path's error)
    accept_t = u_t < p(x_t) / q(x_t)                  (q None: point masses, q(x) = 1)
    n_b = leading accepted drafts of request b
    final_b = p at row start_b + n_b; after a rejection norm(max(p - q, 0)) there (q None: p without
              the rejected token), p itself where that has no mass
    token_b = inverse-CDF draw from final_b with w_b  (sampler.inverse_cdf_draw)

The library's second op, ``race_match``, serves seeded (and greedy) requests, verified by matching
(verify/greedy.py, verify/tree.py): it walks each request's drafts from the root and races only
the rows the walk reads (sampler.sample's race, argmax_v p(v) / E(v) in float64 with E the
position noise of each row's key, computed only at the columns that can win, sampling/native.py
race_key_row; the first of equal maxima as torch.argmax), so the rows past a request's first
mismatch, and the siblings off its path, are never raced. The Python race
over every verified row ([N, V] float64 joined, divided and reduced by ATen) took some 9 ms at
a batch of 16 seeded chains of 5 (96 rows of 8192) where the op takes 0.4-0.5 ms (stop 115).

    tokens[row] = argmax_v p[row, v] / E_row[v]     (no key: argmax_v p[row, v])
                  for the rows on each request's accepted path and the row after it; -1 elsewhere

Built once like the other C++ ops (utils/cpp.py, about 10 s, cached); where it cannot be built
the Python path serves. ``LEAPFROG_NATIVE_VERIFY=0`` turns both ops off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from leapfrog.sampling.native import (INVERSE_CDF_DRAW_CPP, NOISE_CPP, RACE_KEY_CPP, RACE_TOP_CPP,
                                      native_noise_enabled)
from leapfrog.utils.cpp import OpLibrary

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace {
using at::Tensor;

// sampler.inverse_cdf_draw and sampler.race_top of one row (sampling/native.py)
""" + INVERSE_CDF_DRAW_CPP + NOISE_CPP + RACE_TOP_CPP + RACE_KEY_CPP + r"""

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
  TORCH_CHECK(temperature.dim() == 1 && temperature.scalar_type() == at::kFloat,
              "chain_rejection: temperature [T + B] float32");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && u.scalar_type() == at::kFloat && w.scalar_type() == at::kDouble &&
              draft_ids.scalar_type() == at::kLong && (!q.numel() || q.scalar_type() == at::kFloat),
              "chain_rejection: float32 logits, q and u, float64 w, long drafts");
  const int64_t V = logits.size(1);
  auto longs = logits.options().dtype(at::kLong);
  // sampler.temperature_probs (no greedy rows): the one parallel kernel, ATen's
  Tensor p = at::softmax(logits.div(temperature.unsqueeze(1)), -1).contiguous();  // [N, V]
  const float* P = p.data_ptr<float>();
  // sampler._finite's check: a row of p is not finite iff its sum is not (softmax gives [0, 1] or NaN)
  const bool bad = !at::isfinite(p.sum(-1)).all().item<bool>();
  if (bad) return {at::scalar_tensor(false, logits.options().dtype(at::kBool)), at::empty({0}, longs),
                   at::empty({0}, longs)};
  Tensor qc = q.numel() ? q.contiguous() : q;
  const float* Q = q.numel() ? qc.data_ptr<float>() : nullptr;
  Tensor dc = draft_ids.contiguous(), uc = u.contiguous(), wc = w.contiguous();
  const int64_t* X = dc.data_ptr<int64_t>();
  const float* U = uc.data_ptr<float>();
  const double* W = wc.data_ptr<double>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(X[t] >= 0 && X[t] < V, "chain_rejection: a draft id out of the vocabulary");
  // verify/rejection.py rejection_accept: accept_t = u_t < p(x_t) / q(x_t) in float32, as there
  Tensor n_out = at::empty({B}, longs), tok_out = at::empty({B}, longs);
  int64_t* N_ = n_out.data_ptr<int64_t>();
  int64_t* Y = tok_out.data_ptr<int64_t>();
  std::vector<int64_t> final_row(B), rejected, residual_of;                    // p's row of each final draw
  int64_t t = 0, start = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t k = num_draft[b];
    int64_t n = 0;
    while (n < k) {
      const int64_t x = X[t + n];
      const float px = P[(start + n) * V + x], qx = Q ? Q[(t + n) * V + x] : 1.0f;
      if (!(U[t + n] < px / qx)) break;
      ++n;
    }
    N_[b] = n;
    final_row[b] = start + n;
    if (n < k) {
      rejected.push_back(b);
      residual_of.push_back(t + n);
    }
    t += k;
    start += k + 1;
  }
  // the rejected rows' residuals norm(max(p - q, 0)) (point masses: p without the rejected token),
  // p itself where that has no mass; summed by ATen as one [R, V] tensor, as the Python path sums
  // them (a [1, V] row is summed in per-thread chunks from 32768 columns on: other bits)
  const int64_t R = rejected.size();
  Tensor resid = at::empty({R, V}, p.options());                               // [R, V]
  float* Rs = resid.data_ptr<float>();
  for (int64_t i = 0; i < R; ++i) {
    const float* row = P + final_row[rejected[i]] * V;
    float* out = Rs + i * V;
    if (Q) {
      const float* qrow = Q + residual_of[i] * V;
      for (int64_t v = 0; v < V; ++v) out[v] = std::max(row[v] - qrow[v], 0.0f);
    } else {
      std::memcpy(out, row, V * sizeof(float));
      out[X[residual_of[i]]] = 0.0f;
    }
  }
  Tensor mass_t = R ? resid.sum(-1).contiguous() : resid;                      // [R]
  const float* M = R ? mass_t.data_ptr<float>() : nullptr;
  std::vector<int64_t> rejected_at(B, -1);                                     // b -> its residual's row, or -1
  for (int64_t i = 0; i < R; ++i) rejected_at[rejected[i]] = i;
  // the final draws, rows over threads from 65536 elements on (a batch of 8 at 8192: each draw is
  // a sequential float64 sum of its row, as ATen's cumsum, which splits rows over threads too)
  at::parallel_for(0, B, std::max<int64_t>(1, 65536 / V), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const float* row = P + final_row[b] * V;                                 // the bonus token's row of p
      const int64_t i = rejected_at[b];
      if (i >= 0 && M[i] > 0) {
        float* out = Rs + i * V;
        const float d = std::max(M[i], 1e-30f);
        for (int64_t v = 0; v < V; ++v) out[v] = out[v] / d;
        row = out;
      }
      Y[b] = inverse_cdf_row(row, V, W[b]);
    }
  });
  return {at::scalar_tensor(true, logits.options().dtype(at::kBool)), n_out, tok_out};
}

// verify/greedy.py and verify/tree.py's matching of seeded (and greedy) requests, racing only
// the rows the walk reads: -> tokens [T + B] long, the target's token at each raced row, -1 at
// the others (the rows past a request's first mismatch, and siblings' rows off its path)
Tensor race_match(const Tensor& p, const Tensor& keys, const Tensor& draft_ids, const Tensor& parents,
                  at::IntArrayRef num_draft) {
  const int64_t B = num_draft.size(), T = draft_ids.size(0), N = T + B;
  int64_t drafted = 0;
  for (int64_t k : num_draft) {
    TORCH_CHECK(k >= 0, "race_match: negative draft count");
    drafted += k;
  }
  TORCH_CHECK(p.dim() == 2 && p.size(0) == N && p.scalar_type() == at::kFloat && drafted == T &&
              keys.dim() == 2 && keys.size(0) == N && keys.size(1) == 2 && keys.scalar_type() == at::kLong &&
              draft_ids.dim() == 1 && parents.dim() == 1 &&
              parents.size(0) == T && draft_ids.scalar_type() == at::kLong && parents.scalar_type() == at::kLong,
              "race_match: p [T + B, V] float32, keys [T + B, 2] int64, drafts and parents [T] long, "
              "sum(num_draft) == T");
  const int64_t V = p.size(1);
  TORCH_CHECK(V > 0, "race_match: an empty vocabulary");
  Tensor pc = p.contiguous(), dc = draft_ids.contiguous(), pa = parents.contiguous(), kc = keys.contiguous();
  const int64_t* KEY = kc.data_ptr<int64_t>();                                // [N, 2] (sampler.noise_keys)
  const float* P = pc.data_ptr<float>();
  const int64_t* X = dc.data_ptr<int64_t>();
  const int64_t* PAR = pa.data_ptr<int64_t>();
  std::vector<int64_t> row0(B), flat0(B);                                      // s_b and o_b (verify/tree.py)
  for (int64_t b = 0, r = 0, t = 0; b < B; ++b) {
    row0[b] = r;
    flat0[b] = t;
    for (int64_t j = 0; j < num_draft[b]; ++j)
      TORCH_CHECK(PAR[t + j] >= -1 && PAR[t + j] < j, "race_match: a parent after its child");
    r += num_draft[b] + 1;
    t += num_draft[b];
  }
  Tensor out = at::full({N}, -1, p.options().dtype(at::kLong));
  int64_t* Y = out.data_ptr<int64_t>();
  // sampler.sample's race: argmax_v p[v] / E[v], E the row's position noise (sampling/native.py
  // race_key_row, k = 1: E only where it can win), or argmax p (E = 1: greedy rows)
  auto race = [&](int64_t row) {
    double best;
    int64_t arg;
    if (KEY[2 * row + 1])
      race_key_row(P + row * V, static_cast<uint64_t>(KEY[2 * row]), static_cast<const int64_t*>(nullptr), V, 1,
                   &best, &arg);
    else
      race_top_row(P + row * V, static_cast<const double*>(nullptr), static_cast<const int64_t*>(nullptr), V, 1,
                   &best, &arg);
    return arg;
  };
  at::parallel_for(0, B, std::max<int64_t>(1, 32768 / V), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t s = row0[b], o = flat0[b], k = num_draft[b];
      int64_t cur = -1;                                                        // the root
      while (true) {
        const int64_t row = s + 1 + cur, tok = race(row);
        Y[row] = tok;
        int64_t next = -1;                                                     // cur's child drafting tok
        for (int64_t j = cur + 1; j < k && next < 0; ++j)
          if (PAR[o + j] == cur && X[o + j] == tok) next = j;
        if (next < 0) break;
        cur = next;
      }
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(leapfrog_verify, m) {
  m.def("chain_rejection(Tensor logits, Tensor temperature, Tensor q, Tensor draft_ids, int[] num_draft, "
        "Tensor u, Tensor w) -> (Tensor, Tensor, Tensor)");
  m.def("race_match(Tensor p, Tensor keys, Tensor draft_ids, Tensor parents, int[] num_draft) -> Tensor");
}
TORCH_LIBRARY_IMPL(leapfrog_verify, CPU, m) {
  m.impl("chain_rejection", &chain_rejection);
  m.impl("race_match", &race_match);
}
"""

_LIBRARY = OpLibrary("leapfrog_native_verify", _SOURCE, ["-O3", "-fopenmp-simd", "-ffp-contract=off"],
                     "native verification ops (about 10 s)", "verifying in Python", isa=True)


def native_verify_enabled() -> bool:
    """Whether the ops may serve (``LEAPFROG_NATIVE_VERIFY=0`` turns them off, with the native noise
    op: one switch, sampling/native.py ``native_noise_enabled``); read when an engine is built."""
    return native_noise_enabled()


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
    p is not finite."""
    ok, n, tok = torch.ops.leapfrog_verify.chain_rejection(
        logits, temperatures, torch.empty(0) if q is None else q.float(), draft_ids, num_draft, u, w)
    if not bool(ok):
        return None
    return ChainDraw(n.tolist(), tok.tolist())


def race_match(p: Tensor, keys: Tensor, draft_ids: Tensor, parents: Tensor,
               num_draft: list[int]) -> list[int]:
    """The target's tokens [T + B] for matching (verify/greedy.py, verify/tree.py) of seeded and
    greedy requests, raced only where the walk from each root reads them: p [T + B, V] float32
    on the CPU, ``keys`` [T + B, 2] int64 each row's noise key (sampler.noise_keys; a row without
    one: E = 1, the argmax), ``parents`` [T] local (chains: -1, 0, 1, ...) -> -1 at the rows not
    raced."""
    return torch.ops.leapfrog_verify.race_match(p, keys, draft_ids, parents, num_draft).tolist()
