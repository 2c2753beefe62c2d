"""Eager drafting loops as one C++ call each (EAGLE-3 heads, draft models): ``torch.ops.leapfrog_draft``.

Eagerly, a head forward (EagleHead.forward, then its own LM head) is some 25 operator calls
through Python: embedding, fc, three norms, the concatenation, five linears, two rotations, the
cached attention, two residual adds, silu * up, and the modules and metadata around them; the
drafting loops around it (model/compiled.py CompiledChain, CompiledSampledChain, CompiledTree run
eagerly) add the picks, masks and tree bookkeeping, some 10-30 more per level. Measured on the
built-in head (bf16, batch 1, 2-vCPU AVX-512 EPYC): about 0.45 ms a chain level, of which the
kernels are under 0.2 ms. These ops make the same computations, in the same order, on the same
tensors, from C++: the linears and the cached attention through the dispatcher (about a
microsecond each; leapfrog's kernels, model/native_linear.py and attention/native.py), and a
layer's small steps (the embedding rows and the two input norms into one buffer, the rotation of q
and k in place from the tables, each residual add with the norm after it, silu * up, the final
norm of the logits rows) as model/native_ops.py's row kernels compiled in here, with the chain's
per-step columns, mask and kv_len written by the host; so the drafts are bitwise the Python
loops' (tests/model/test_native_draft.py), and the KV cache is read and written by the same
attention op the compiled graphs call, with the loops' masks and columns. Fusing the small steps
(stop 80, 2-vCPU AMX Xeon, the built-in head, one row): a chain level 277 -> 240 us, of which the
five linears stream the head's 8.4 MB of bf16 weights from L3 in about 185 us.

One forward (the ops' building block, C++ ``eagle3_forward``)::

    tok [B, S], features [B, S, F], pos [B, S], mask [B, 1, S, W], the cache rows and columns,
    kv_len, at [N] (empty: every row) -> hidden [B, S, H], logits [N or B * S, Vd] float32

    e = embed[tok] (the head's dtype); x = fc(features) if F != H else features
    hn = hidden_norm(x); (x = hn if norm_before_residual)
    q, k, v = wqkv(cat[input_layernorm(e), hn]); q, k = rope(q, k) at pos
    o = cached_attention(q, k, v) (writes k/v at write_rows/write_cols, reads what mask allows)
    x = x + wo(o); hidden = x + w2(silu_mul(w13(post_attention_layernorm(x))))
    logits = lm_head(norm(hidden[at] in float32) in the LM head's row dtype), float32

The ops, each the loop of a CompiledForward subclass with the first forward's arguments:

    eagle3_chain          CompiledChain._chain: greedy chains -> tokens, log q [B, steps]
    eagle3_sampled_chain  CompiledSampledChain._sampled_chain: sampled chains (the race, inverse-CDF
                          draws) -> tokens, log q, shares [B, steps], q [B, steps, Vd]
    eagle3_tree           CompiledTree._tree: greedy dynamic trees (EAGLE-2) -> TreeOutput's tensors
    llama_chain           CompiledChain._chain of a draft model (LlamaModel.forward's layers, the
                          float32 final norm, its LM head): greedy chains -> tokens, log q [B, steps]

Where they apply (``NativeHeadForward.for_head``, ``NativeLlamaForward.for_model``): an EAGLE-3
head or a draft model packed for inference on CPU with the native norm/RoPE ops and every linear,
fc and the LM head included, on the bf16 few-row kernel (NativeLinear: bf16 weights, or float32
weights of bf16 values), the built-in head's and draft's case. A draft model drafts its greedy
chains so (spec_decode/proposers/draft_model.py; sampled requests draft one forward per token as
before). Elsewhere (EAGLE-1, quantized or other linears, CUDA, compiled graphs) the Python loops
run.
``LEAPFROG_NATIVE_DRAFTS=0`` (read at load) turns them off. Built once like the other ops
(utils/cpp.py, about 15 s, cached under ``TORCH_EXTENSIONS_DIR``); if it cannot be built the
Python loops serve (logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from leapfrog.utils import env_off
from leapfrog.model.native_ops import ROW_KERNELS_CPP
from leapfrog.sampling.native import INVERSE_CDF_DRAW_CPP, NOISE_CPP, RACE_KEY_CPP, RACE_TOP_CPP
from leapfrog.utils.cpp import OpLibrary

log = logging.getLogger("leapfrog.model")

if TYPE_CHECKING:
    from leapfrog.attention.metadata import AttnMeta
    from leapfrog.kv.cache import KVCache

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <vector>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

namespace {
using at::Tensor;
""" + ROW_KERNELS_CPP + r"""

// ---- a decoder layer's small steps on contiguous rows, fused (model/native_ops.py's row kernels:
// each bitwise the op, or chain of ops, it stands for; no dispatch, one allocation per result) ----

#define DISPATCH_ROWS(dt, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "rows", __VA_ARGS__)

// EagleHead's first steps: cat[input_layernorm(embed[tok]), hidden_norm(x)] -> [.., 2H]. ``e``: the
// embedding rows (``idx`` their indices; null: e holds one row per token), x [.., H] in e's dtype
Tensor head_input(const Tensor& e, const int64_t* idx, const Tensor& x, const Tensor& n0, const Tensor& n1,
                  double eps) {
  const int64_t H = x.size(-1), R = x.numel() / H;
  TORCH_CHECK(e.dim() == 2 && e.size(1) == H && e.scalar_type() == x.scalar_type() && e.is_contiguous(),
              "head_input: embedding rows [V, H] in the head's dtype");
  for (int64_t r = 0; idx && r < R; ++r)
    TORCH_CHECK(idx[r] >= 0 && idx[r] < e.size(0), "head_input: token id ", idx[r], " out of the embedding's ",
                e.size(0), " rows");
  TORCH_CHECK(idx || e.size(0) == R, "head_input: one embedding row per token");
  auto shape = x.sizes().vec();
  shape.back() = 2 * H;
  Tensor xc = x.contiguous(), a = at::empty(shape, x.options());
  DISPATCH_ROWS(x.scalar_type(), [&] {
    const scalar_t* ep = e.data_ptr<scalar_t>();
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* ap = a.data_ptr<scalar_t>();
    with_norm_weight<scalar_t>(n0, H, [&](auto w0) {
      with_norm_weight<scalar_t>(n1, H, [&](auto w1) {
        row_chunks(R, H, 16384, [&](int64_t r0, int64_t r1) {
          std::vector<float> buf(H);
          for (int64_t r = r0; r < r1; ++r) {
            rms_row(ep + (idx ? idx[r] : r) * H, w0, ap + r * 2 * H, H, (float)eps, buf.data());
            rms_row(xp + r * H, w1, ap + r * 2 * H + H, H, (float)eps, buf.data());
          }
        });
      });
    });
  });
  return a;
}

// rope of q and k in place in qkv [.., (heads + 2 kv_heads) Dh] contiguous (v untouched), each row at
// its position of ``pos`` in the tables [P, Dh] (float32 or the rows' dtype; rounded to it first)
static void rope_qk(Tensor& qkv, const Tensor& pos, const Tensor& cos_t, const Tensor& sin_t, int64_t heads,
             int64_t kv_heads, int64_t Dh) {
  TORCH_CHECK(qkv.is_contiguous() && cos_t.is_contiguous() && sin_t.is_contiguous() &&
              cos_t.scalar_type() == sin_t.scalar_type(), "rope_qk: contiguous rows and tables");
  const int64_t W = qkv.size(-1), R = qkv.numel() / W, P = cos_t.size(0);
  TORCH_CHECK(W == (heads + 2 * kv_heads) * Dh && cos_t.dim() == 2 && cos_t.size(1) == Dh &&
              sin_t.sizes() == cos_t.sizes(), "rope_qk: rows of (heads + 2 kv_heads) x head_dim, tables [P, head_dim]");
  Tensor p = pos.to(at::kLong).contiguous();
  const int64_t* pp = p.data_ptr<int64_t>();
  TORCH_CHECK(p.numel() == R, "rope_qk: a position per row");
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(pp[r] >= 0 && pp[r] < P, "rope_qk: position out of the tables");
  DISPATCH_ROWS(qkv.scalar_type(), [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    auto run = [&](auto* c, auto* sn) {
      row_chunks(R, (heads + kv_heads) * Dh, 4096, [&](int64_t r0, int64_t r1) {
        std::vector<scalar_t> tmp(Dh);
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t h = 0; h < heads + kv_heads; ++h) {
            scalar_t* x = base + r * W + h * Dh;
            std::copy(x, x + Dh, tmp.begin());
            rope_head(tmp.data(), c + pp[r] * Dh, sn + pp[r] * Dh, x, Dh);
          }
        }
      });
    };
    if (cos_t.scalar_type() == at::kFloat) run(cos_t.data_ptr<float>(), sin_t.data_ptr<float>());
    else {
      TORCH_CHECK(cos_t.scalar_type() == qkv.scalar_type(), "rope_qk: float32 tables or the rows' dtype");
      run(cos_t.data_ptr<scalar_t>(), sin_t.data_ptr<scalar_t>());
    }
  });
}

// a layer's qkv [B, S, (heads + 2 kv_heads) Dh] -> q, k rotated in place at ``pos`` and v, as
// [B, S, heads or kv_heads, Dh] views of it (what the cached attention op takes)
std::tuple<Tensor, Tensor, Tensor> rotated_qkv(Tensor& qkv, const Tensor& pos, const Tensor& cos_t,
                                               const Tensor& sin_t, int64_t heads, int64_t kv_heads, int64_t Dh) {
  rope_qk(qkv, pos, cos_t, sin_t, heads, kv_heads, Dh);
  const int64_t B = qkv.size(0), S = qkv.size(1), q_size = heads * Dh, kv_size = kv_heads * Dh;
  return {qkv.narrow(-1, 0, q_size).view({B, S, heads, Dh}),
          qkv.narrow(-1, q_size, kv_size).view({B, S, kv_heads, Dh}),
          qkv.narrow(-1, q_size + kv_size, kv_size).view({B, S, kv_heads, Dh})};
}

// x + y rounded to their dtype (Tensor.add), and the sum's rms_norm with w when given -> (sum, norm)
std::pair<Tensor, Tensor> add_norm(const Tensor& x, const Tensor& y, const Tensor* w, double eps) {
  const int64_t H = x.size(-1), R = x.numel() / H;
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type(), "add_norm: alike rows");
  Tensor xc = x.contiguous(), yc = y.contiguous(), s = at::empty(x.sizes(), x.options());
  Tensor n = w ? at::empty(x.sizes(), x.options()) : Tensor();
  DISPATCH_ROWS(x.scalar_type(), [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* yp = yc.data_ptr<scalar_t>();
    scalar_t* sp = s.data_ptr<scalar_t>();
    scalar_t* np = w ? n.data_ptr<scalar_t>() : nullptr;
    auto rows = [&](auto wp) {
      row_chunks(R, H, 16384, [&](int64_t r0, int64_t r1) {
        std::vector<float> buf(H);
        for (int64_t i = r0 * H; i < r1 * H; ++i)
          sp[i] = static_cast<scalar_t>(static_cast<float>(xp[i]) + static_cast<float>(yp[i]));
        if (np)
          for (int64_t r = r0; r < r1; ++r) rms_row(sp + r * H, wp, np + r * H, H, (float)eps, buf.data());
      });
    };
    if (w) with_norm_weight<scalar_t>(*w, H, rows);
    else rows(static_cast<const float*>(nullptr));
  });
  return {s, n};
}

// silu(gate) * up of [.., 2I] rows (the silu_mul op)
Tensor silu_mul(const Tensor& gu) {
  const int64_t I = gu.size(-1) / 2, R = gu.numel() / (2 * I);
  auto shape = gu.sizes().vec();
  shape.back() = I;
  Tensor x = gu.contiguous(), y = at::empty(shape, gu.options());
  DISPATCH_ROWS(gu.scalar_type(), [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    row_chunks(R, I, 16384, [&](int64_t r0, int64_t r1) {
      std::vector<float> g(I);
      for (int64_t r = r0; r < r1; ++r) silu_mul_row(xp + r * 2 * I, xp + r * 2 * I + I, yp + r * I, I, g.data());
    });
  });
  return y;
}

// the final norm in float32 of rows ``at`` of x [R, H] (empty: all), ``w`` float32 -> [N, H] in
// ``out`` (``rms_norm(x[at].float(), w).to(out)``)
Tensor final_norm(const Tensor& x, const Tensor& at, const Tensor& w, double eps, at::ScalarType out) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == x.size(-1),
              "final_norm: a float32 weight [H]");
  const int64_t H = x.size(-1), R = x.numel() / H, N = at.numel() ? at.numel() : R;
  Tensor xc = x.contiguous(), wc = w.contiguous(), ac = at.numel() ? at.to(at::kLong).contiguous() : at;
  Tensor y = at::empty({N, H}, x.options().dtype(out));
  const int64_t* ap = at.numel() ? ac.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; ap && i < N; ++i) TORCH_CHECK(ap[i] >= 0 && ap[i] < R, "final_norm: row out of range");
  DISPATCH_ROWS(x.scalar_type(), [&] {
    using T = scalar_t;
    const T* xp = xc.data_ptr<T>();
    row_chunks(N, H, 16384, [&](int64_t i0, int64_t i1) {
      std::vector<float> row(H), res(H);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = ap ? ap[i] : i;
        for (int64_t j = 0; j < H; ++j) row[j] = static_cast<float>(xp[r * H + j]);
        rms_row(row.data(), wc.data_ptr<float>(), res.data(), H, (float)eps, nullptr);
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out, "final_norm_out", [&] {
          scalar_t* yp = y.data_ptr<scalar_t>() + i * H;
          for (int64_t j = 0; j < H; ++j) yp[j] = static_cast<scalar_t>(res[j]);
        });
      }
    });
  });
  return y;
}

// the other leapfrog ops, called through the dispatcher (their libraries are loaded first)
const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t, bool, bool)>&
linear_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_gemm::linear_bf16", "")
      .typed<Tensor(const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t, bool, bool)>();
  return op;
}
const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&,
                                      int64_t, bool)>&
w8a8_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_gemm::linear_w8a8", "")
      .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t, bool)>();
  return op;
}
// the linear of a packed weight with the ops' bias convention (an empty tensor for none): bf16
// blocks (linear_bf16), or int8 blocks with their float32 ``scale`` (linear_w8a8: quant.W8A8Linear)
Tensor packed_linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& scale, int64_t n,
                     bool f32_out, bool stream) {
  const auto b = bias.numel() ? c10::optional<Tensor>(bias) : c10::nullopt;
  if (w.scalar_type() == at::kChar) return w8a8_op().call(x, w, scale, b, n, f32_out);
  return linear_op().call(x, w, b, n, f32_out, stream);
}
const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)>& norm_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_ops::rms_norm", "")
      .typed<Tensor(const Tensor&, const Tensor&, double)>();
  return op;
}
// Tensor.max(-1) of float32 rows, the same values and indices (model/native_ops.py row_max)
const c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&)>& row_max_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_ops::row_max", "")
      .typed<std::tuple<Tensor, Tensor>(const Tensor&)>();
  return op;
}
using AttnSig = Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&,
                       const Tensor&, const Tensor&, const Tensor&, const Tensor&);
const c10::TypedOperatorHandle<AttnSig>& attention_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_native::cached_attention", "")
      .typed<AttnSig>();
  return op;
}

// sizes: [n_qkv, n_o, n_13, n_2, n_head, n_fc, heads, kv_heads, head_dim, f32_out of the LM head,
//         stream mask (bit i: weights[i] streamed), LM head rows in bf16]
std::tuple<Tensor, Tensor> eagle3_forward(
    const Tensor& tok, const Tensor& features, const Tensor& pos, const Tensor& mask, const Tensor& rows,
    const Tensor& write_rows, const Tensor& write_cols, const Tensor& kv_len, const Tensor& at,
    Tensor& k_cache, Tensor& v_cache, const Tensor& embed, const Tensor& cos_table, const Tensor& sin_table,
    at::TensorList norms, at::TensorList weights, at::TensorList biases, at::TensorList scales, at::IntArrayRef sizes,
    double eps, bool norm_before_residual) {
  TORCH_CHECK(norms.size() == 4 && weights.size() == 6 && biases.size() == 6 && scales.size() == 6 && sizes.size() == 12,
              "eagle3_forward: 4 norms, 6 weights, 6 biases, 6 scales and 12 sizes");
  const int64_t B = tok.size(0), S = tok.size(1), H = sizes[1];
  const int64_t heads = sizes[6], kv_heads = sizes[7], Dh = sizes[8];
  const int64_t q_size = heads * Dh;
  auto linear = [&](const Tensor& x, int i, bool f32_out) {
    return packed_linear(x, weights[i], biases[i], scales[i], sizes[i], f32_out, ((sizes[10] >> i) & 1) != 0);
  };
  // EagleHead.forward: the head's dtype is its norms'
  const auto dt = norms[0].scalar_type();
  const int64_t R = B * S;
  Tensor f = features.to(dt);
  Tensor x = f.size(-1) == H ? f : linear(f, 5, false);                         // fc on target features
  // EagleLayer.forward, form "eagle3": a = cat[input_layernorm(embed[tok]), hn = hidden_norm(x)]
  Tensor t = tok.to(at::kLong).contiguous();
  Tensor a = embed.scalar_type() == dt && embed.is_contiguous()
      ? head_input(embed, t.data_ptr<int64_t>(), x, norms[0], norms[1], eps)
      : head_input(at::embedding(embed, t).to(dt).reshape({R, H}), nullptr, x, norms[0], norms[1], eps);   // [B, S, 2H]
  if (norm_before_residual) x = a.narrow(-1, H, H).contiguous();
  Tensor qkv = linear(a, 0, false);                                            // [B, S, q + 2 kv]
  auto [q, k, v] = rotated_qkv(qkv, pos, cos_table, sin_table, heads, kv_heads, Dh);
  Tensor o = attention_op().call(q, k, v, k_cache, v_cache, rows, write_rows, write_cols, mask, kv_len);
  // DecoderLayer._after_attention
  auto [x1, g] = add_norm(x, linear(o.reshape({B, S, q_size}), 1, false), &norms[2], eps);
  x = add_norm(x1, linear(silu_mul(linear(g, 2, false)), 3, false), nullptr, eps).first;   // [B, S, H]
  // CompiledForward._forward's logits rows, EagleHead.compute_draft_logits: norm in float32, then
  // LogitsHead (rows in its dtype, float32 logits)
  Tensor n = final_norm(x.view({R, H}), at, norms[3], eps, sizes[11] ? at::kBFloat16 : at::kFloat);
  Tensor logits = linear(n, 4, sizes[9] != 0).to(at::kFloat);
  return {x, logits};
}
// sampler.inverse_cdf_draw and sampler.race_top of one row (sampling/native.py)
""" + INVERSE_CDF_DRAW_CPP + NOISE_CPP + RACE_TOP_CPP + RACE_KEY_CPP + r"""

// CompiledChain._steps: the first forward over each sequence's pending tokens (``last``: the last
// real one's index), then steps - 1 one-token forwards, each fed the previous pick (``pick(logits,
// j)`` -> the token and what the step returns with it; mapped to target ids by ``vocab`` when
// given) at the next column and its output state -> tokens [B, steps] (target ids), then each of
// the picks' outputs stacked [B, steps, ...]. ``stop`` [B] float64 (empty: none): a row's chain
// may stop once its path log confidence (the float64 sum of the picks' first outputs, log q of
// the greedy pick) is below its stop; the loop stops early, fewer than steps columns, once every
// row's has (CompiledChain._steps and spec_decode/draft.py chain_length: the same sums and test)
template <typename Forward, typename Pick>
std::vector<Tensor> chain_loop(
    Forward forward, const Tensor& tok, const Tensor& features, const Tensor& pos, const Tensor& mask,
    const Tensor& rows, const Tensor& write_rows, const Tensor& write_cols, const Tensor& kv_len, const Tensor& last,
    const Tensor& col, int64_t steps, const Tensor& vocab, int64_t window, const Tensor& stop, Pick pick) {
  TORCH_CHECK(steps >= 1, "a drafting chain drafts at least one token");
  const int64_t B = tok.size(0), S = tok.size(1);
  Tensor at = at::arange(B, last.options()).mul(S).add(last);                  // [B] rows of the last tokens
  auto [hidden, logits] = forward(tok, features, pos, mask, write_rows, write_cols, kv_len,
                                  S > 1 ? at : at.new_empty({0}));
  const int64_t H = hidden.size(-1);
  Tensor h = hidden.reshape({B * S, H}).index({at});                           // [B, H]
  // each step's inputs written in place by the host (a handful of ATen calls a step cost more
  // than the head's attention): its column c, the mask (compiled.causal_mask: c - window < column
  // <= c) and kv_len = max c + 1
  const int64_t W = mask.size(-1);
  TORCH_CHECK(col.numel() == B && (!stop.numel() || stop.numel() == B), "drafting chain: col and stop [B]");
  Tensor cc = col.to(at::kLong).contiguous();
  const int64_t* c0 = cc.data_ptr<int64_t>();
  Tensor vc = vocab.numel() ? vocab.to(at::kLong).contiguous() : vocab;
  Tensor sc = stop.numel() ? stop.to(at::kDouble).contiguous() : stop;
  std::vector<double> path(B, 0.0);                                            // [B] path log confidence
  std::vector<Tensor> toks;
  std::vector<std::vector<Tensor>> outs;
  for (int64_t j = 0; j < steps; ++j) {
    auto [picked, out] = pick(logits, j);
    Tensor x = Tensor(picked).to(at::kLong).contiguous();
    TORCH_CHECK(x.numel() == B && Tensor(out[0]).numel() == B, "drafting chain: a pick per sequence");
    if (vc.numel()) {                                                          // vocab[x]
      Tensor mapped = at::empty({B}, x.options());
      for (int64_t b = 0; b < B; ++b) {
        const int64_t i = x.data_ptr<int64_t>()[b];
        TORCH_CHECK(i >= 0 && i < vc.numel(), "drafting chain: a pick outside the draft vocabulary");
        mapped.data_ptr<int64_t>()[b] = vc.data_ptr<int64_t>()[i];
      }
      x = mapped;
    }
    toks.push_back(x);
    outs.push_back(out);
    if (j == steps - 1) break;
    if (sc.numel()) {                                                          // every row's below its stop
      Tensor lq = Tensor(out[0]).to(at::kDouble).contiguous();
      bool all_below = true;
      for (int64_t b = 0; b < B; ++b) {
        path[b] += lq.data_ptr<double>()[b];
        all_below = all_below && path[b] < sc.data_ptr<double>()[b];
      }
      if (all_below) break;
    }
    Tensor c = at::empty({B}, cc.options());                                   // [B] this step's column
    Tensor m = at::empty({B, 1, 1, W}, mask.options().dtype(at::kBool));
    int64_t* cp = c.data_ptr<int64_t>();
    bool* mp = m.data_ptr<bool>();
    int64_t len = 0;
    for (int64_t b = 0; b < B; ++b) {
      cp[b] = c0[b] + j;
      len = std::max(len, cp[b] + 1);
      for (int64_t w = 0; w < W; ++w) mp[b * W + w] = w <= cp[b] && (window <= 0 || w > cp[b] - window);
    }
    std::tie(hidden, logits) = forward(x.view({B, 1}), h.view({B, 1, H}), c.view({B, 1}), m, rows, c,
                                       at::scalar_tensor(len, cc.options()), at.new_empty({0}));
    h = hidden.select(1, 0);
  }
  std::vector<Tensor> result{at::stack(toks, 1)};
  for (size_t i = 0; i < outs[0].size(); ++i) {
    std::vector<Tensor> col_i;
    for (auto& o : outs) col_i.push_back(o[i]);
    result.push_back(at::stack(col_i, 1));
  }
  return result;
}

// an EAGLE-3 head's forward as chain_loop calls it
template <typename Pick>
std::vector<Tensor> chain_steps(
    const Tensor& tok, const Tensor& features, const Tensor& pos, const Tensor& mask, const Tensor& rows,
    const Tensor& write_rows, const Tensor& write_cols, const Tensor& kv_len, const Tensor& last,
    const Tensor& col, int64_t steps, const Tensor& vocab, int64_t window, Tensor& k_cache, Tensor& v_cache,
    const Tensor& embed, const Tensor& cos_table, const Tensor& sin_table, at::TensorList norms,
    at::TensorList weights, at::TensorList biases, at::TensorList scales, at::IntArrayRef sizes, double eps,
    bool norm_before_residual, const Tensor& stop, Pick pick) {
  auto forward = [&](const Tensor& t, const Tensor& f, const Tensor& p, const Tensor& m, const Tensor& wr,
                     const Tensor& wc, const Tensor& len, const Tensor& at) {
    return eagle3_forward(t, f, p, m, rows, wr, wc, len, at, k_cache, v_cache, embed, cos_table, sin_table,
                          norms, weights, biases, scales, sizes, eps, norm_before_residual);
  };
  return chain_loop(forward, tok, features, pos, mask, rows, write_rows, write_cols, kv_len, last, col, steps,
                    vocab, window, stop, pick);
}

// the greedy pick of CompiledChain._pick: the argmax and its log q
std::pair<Tensor, std::vector<Tensor>> greedy_pick(const Tensor& logits, int64_t) {
  auto [lp, x] = row_max_op().call(at::log_softmax(logits.to(at::kFloat), -1));  // [B], [B]
  return {x, {lp}};
}

// LlamaModel.forward: the layers (as DecoderLayer), the outputs of the layers in ``aux_layers`` (the
// residual stream after them, the model's dtype), the final norm in float32 -> hidden [B, S, D]
// float32, aux. norms: per layer attention and MLP norms, then the final one (float32);
// weights/biases/outs/streams: per layer wqkv, wo, w13, w2 (then the LM head, unread here); dims:
// heads, kv_heads, head_dim, the LM head's f32_out, its rows in bf16
std::tuple<Tensor, std::vector<Tensor>> llama_hidden(
    const Tensor& tok, const Tensor& pos, const Tensor& mask, const Tensor& rows, const Tensor& write_rows,
    const Tensor& write_cols, const Tensor& kv_len, at::TensorList k_caches, at::TensorList v_caches,
    const Tensor& embed, const Tensor& cos_table, const Tensor& sin_table, at::TensorList norms,
    at::TensorList weights, at::TensorList biases, at::IntArrayRef outs, at::IntArrayRef streams,
    at::IntArrayRef dims, double eps, at::IntArrayRef aux_layers) {
  const int64_t L = k_caches.size();
  TORCH_CHECK(v_caches.size() == (size_t)L && norms.size() == (size_t)(2 * L + 1) &&
              weights.size() == (size_t)(4 * L + 1) && biases.size() == weights.size() &&
              outs.size() == weights.size() && streams.size() == weights.size() && dims.size() == 5,
              "llama_hidden: per layer 2 norms and 4 linears, then the final norm and the LM head");
  const int64_t B = tok.size(0), S = tok.size(1);
  const int64_t heads = dims[0], kv_heads = dims[1], Dh = dims[2];
  const int64_t q_size = heads * Dh;
  auto linear = [&](const Tensor& x, int64_t i) {
    return packed_linear(x, weights[i], biases[i], Tensor(), outs[i], false, streams[i] != 0);
  };
  Tensor x = at::embedding(embed, tok);                                        // [B, S, D]
  std::vector<Tensor> aux;
  Tensor h = norm_op().call(x, norms[0], eps);                                 // the first attention norm
  for (int64_t i = 0; i < L; ++i) {                                            // DecoderLayer.forward
    Tensor qkv = linear(h, 4 * i);                                             // [B, S, q + 2 kv]
    auto [q, k, v] = rotated_qkv(qkv, pos, cos_table, sin_table, heads, kv_heads, Dh);
    Tensor kc = k_caches[i], vc = v_caches[i];
    Tensor o = attention_op().call(q, k, v, kc, vc, rows, write_rows, write_cols, mask, kv_len);
    auto [x1, g] = add_norm(x, linear(o.reshape({B, S, q_size}), 4 * i + 1), &norms[2 * i + 1], eps);
    // the residual add, fused with the next layer's attention norm
    std::tie(x, h) = add_norm(x1, linear(silu_mul(linear(g, 4 * i + 2)), 4 * i + 3),
                              i + 1 < L ? &norms[2 * i + 2] : nullptr, eps);
    if (std::find(aux_layers.begin(), aux_layers.end(), i) != aux_layers.end()) aux.push_back(x);   // once
  }
  const int64_t D = x.size(-1);
  return {final_norm(x.view({B * S, D}), tok.new_empty({0}), norms[2 * L], eps, at::kFloat).view({B, S, D}),
          aux};                                                                // [B, S, D] float32
}

// llama_hidden, then CompiledForward._forward's logits rows through the LogitsHead -> hidden [B, S, D]
// float32, logits [N or B * S, V] float32
std::tuple<Tensor, Tensor> llama_forward(
    const Tensor& tok, const Tensor& pos, const Tensor& mask, const Tensor& rows, const Tensor& write_rows,
    const Tensor& write_cols, const Tensor& kv_len, const Tensor& at, at::TensorList k_caches,
    at::TensorList v_caches, const Tensor& embed, const Tensor& cos_table, const Tensor& sin_table,
    at::TensorList norms, at::TensorList weights, at::TensorList biases, at::IntArrayRef outs,
    at::IntArrayRef streams, at::IntArrayRef dims, double eps) {
  const int64_t L = k_caches.size(), B = tok.size(0), S = tok.size(1), D = embed.size(1);
  Tensor hidden = std::get<0>(llama_hidden(tok, pos, mask, rows, write_rows, write_cols, kv_len, k_caches, v_caches,
                                           embed, cos_table, sin_table, norms, weights, biases, outs, streams, dims,
                                           eps, {}));
  Tensor rows_h = hidden.reshape({B * S, D});
  if (at.numel()) rows_h = rows_h.index({at});
  Tensor logits = packed_linear(rows_h.to(dims[4] ? at::kBFloat16 : at::kFloat), weights[4 * L], biases[4 * L], Tensor(),
                                outs[4 * L], dims[3] != 0, streams[4 * L] != 0).to(at::kFloat);
  return {hidden, logits};
}

// CompiledChain's greedy chain of a draft model (no features) -> tokens, log q [B, steps]
std::tuple<Tensor, Tensor> llama_chain(
    const Tensor& tok, const Tensor& pos, const Tensor& mask, const Tensor& rows, const Tensor& write_rows,
    const Tensor& write_cols, const Tensor& kv_len, const Tensor& last, const Tensor& col, int64_t steps,
    const Tensor& stop, int64_t window, at::TensorList k_caches, at::TensorList v_caches, const Tensor& embed, const Tensor& cos_table,
    const Tensor& sin_table, at::TensorList norms, at::TensorList weights, at::TensorList biases,
    at::IntArrayRef outs, at::IntArrayRef streams, at::IntArrayRef dims, double eps) {
  auto forward = [&](const Tensor& t, const Tensor&, const Tensor& p, const Tensor& m, const Tensor& wr,
                     const Tensor& wc, const Tensor& len, const Tensor& at) {
    return llama_forward(t, p, m, rows, wr, wc, len, at, k_caches, v_caches, embed, cos_table, sin_table, norms,
                         weights, biases, outs, streams, dims, eps);
  };
  Tensor none = last.new_empty({0});
  auto r = chain_loop(forward, tok, none, pos, mask, rows, write_rows, write_cols, kv_len, last, col, steps, none,
                      window, stop, greedy_pick);
  return {r[0], r[1]};
}

#define CHAIN_ARGS                                                                                          \
    const Tensor& tok, const Tensor& features, const Tensor& pos, const Tensor& mask, const Tensor& rows,     \
    const Tensor& write_rows, const Tensor& write_cols, const Tensor& kv_len, const Tensor& last,             \
    const Tensor& col, int64_t steps, const Tensor& vocab, int64_t window, Tensor& k_cache, Tensor& v_cache,  \
    const Tensor& embed, const Tensor& cos_table, const Tensor& sin_table, at::TensorList norms,              \
    at::TensorList weights, at::TensorList biases, at::TensorList scales, at::IntArrayRef sizes, double eps,     \
    bool norm_before_residual
#define CHAIN_CALL tok, features, pos, mask, rows, write_rows, write_cols, kv_len, last, col, steps, vocab, window, \
    k_cache, v_cache, embed, cos_table, sin_table, norms, weights, biases, scales, sizes, eps, norm_before_residual

// CompiledChain's greedy chain: each step the argmax and its log q -> tokens, log q [B, steps]
std::tuple<Tensor, Tensor> eagle3_chain(CHAIN_ARGS, const Tensor& stop) {
  auto r = chain_steps(CHAIN_CALL, stop, greedy_pick);
  return {r[0], r[1]};
}

// CompiledSampledChain's chain (its _pick): rows with ``sampled`` draw from q = softmax(logits /
// scale / T), unseeded ones (``stream``) by inverse CDF with w [B, steps] float64, seeded ones as the
// race's winner argmax q / E with E the position noise of keys [B, steps, 2] int64 (a level's row
// key, sampler.row_key, and whether it has one; E = 1 where not), computed where it can win
// (sampling/native.py race_key_row; ``race`` false: no row races, keys unread);
// the others take the argmax -> tokens, log q of the argmax (0 where every row draws by inverse CDF:
// never read there), the winner's share, q [B, steps, V]
// (spread over the target's vocabulary of V ids where ``vocab`` maps the head's own; an
// index_copy in Python cost 33 us a step)
std::tuple<Tensor, Tensor, Tensor, Tensor> eagle3_sampled_chain(
    CHAIN_ARGS, const Tensor& temperature, const Tensor& sampled, const Tensor& keys, const Tensor& stream,
    const Tensor& w, int64_t want, double scale, bool race, int64_t V) {
  // the rows' kinds, read once (tiny [B] tensors): where(sampled, where(stream, inverse CDF, race
  // or argmax), argmax) per row in a loop, the inverse CDF only where a row takes it
  Tensor sampled_c = sampled.to(at::kBool).contiguous(), stream_c = stream.to(at::kBool).contiguous();
  const bool* sam = sampled_c.data_ptr<bool>();
  const bool* str = stream_c.data_ptr<bool>();
  Tensor no_share = at::zeros({tok.size(0)}, w.options().dtype(at::kFloat));
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kDouble && w.size(0) == tok.size(0) && w.size(1) >= steps &&
              sampled.numel() == tok.size(0) && stream.numel() == tok.size(0) && temperature.numel() == tok.size(0),
              "eagle3_sampled_chain: w [B, steps] float64, sampled, stream and temperature [B]");
  auto wa = w.accessor<double, 2>();
  // every row an unseeded draw (a chat at T > 0): no row reads the argmax or its log q, so neither is
  // computed (two ATen calls a level; those rows' log q come back 0, as the proposer never reads them)
  bool all_drawn = true;
  for (int64_t b = 0; b < tok.size(0); ++b) all_drawn = all_drawn && sam[b] && str[b];
  // the head's target ids as the race reads them (checked once: E's columns)
  Tensor vocab_ids = race && vocab.numel() ? vocab.to(at::kLong).contiguous() : vocab;
  if (race && vocab.numel()) {
    const int64_t* id = vocab_ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < vocab_ids.numel(); ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < V, "eagle3_sampled_chain: vocab id out of V");
  }
  auto r = chain_steps(CHAIN_CALL, w.new_empty({0}), [&](const Tensor& logits, int64_t j) {
    Tensor lf = logits.to(at::kFloat);
    Tensor lp, greedy;
    if (all_drawn) {
      lp = no_share;   // (zeros [B] float32)
      greedy = at::empty({lf.size(0)}, lf.options().dtype(at::kLong));
    } else {
      std::tie(lp, greedy) = row_max_op().call(at::log_softmax(lf, -1));       // [B], [B]
    }
    Tensor z = scale != 1.0 ? lf.div(scale) : lf;
    Tensor q = at::softmax(z.div(temperature.view({-1, 1})), -1).contiguous();  // [B, V'] compiled.race_probs
    TORCH_CHECK(q.scalar_type() == at::kFloat, "eagle3_sampled_chain: float32 q");
    const int64_t B = q.size(0), Vq = q.size(1);
    Tensor share = no_share;
    Tensor x = all_drawn ? greedy : greedy.contiguous().clone();               // [B] (all_drawn: each row set below)
    int64_t* xs = x.data_ptr<int64_t>();
    const float* qs = q.data_ptr<float>();
    if (race) {
      // the racing rows' first finishers of q / E (sampling/native.py race_key_row through the
      // head's ids: E computed only where it can win; ATen's [B, V'] float64 gather, copy,
      // quotient and top-k cost about 2 ms a step at a batch of 16 chains of 5, stop 115, and
      // the host's [B, steps, V] rows of E 2.6 ms more, stop 116), and the winner's share of
      // them (ATen's sum, log, on the same values: the bits of _pick's); 0 for the other rows
      std::vector<int64_t> racing;
      for (int64_t b = 0; b < B; ++b)
        if (sam[b] && !str[b]) racing.push_back(b);
      const int64_t R = racing.size(), k = std::min<int64_t>(want, Vq);
      Tensor values = at::empty({R, k}, w.options());                          // [R, k] float64
      Tensor indices = at::empty({R, k}, x.options());
      const int64_t* vid = vocab_ids.numel() ? vocab_ids.data_ptr<int64_t>() : nullptr;
      TORCH_CHECK(keys.is_contiguous() && keys.dim() == 3 && keys.size(0) == B && keys.size(1) > j &&
                  keys.size(2) == 2 && keys.scalar_type() == at::kLong && k >= 1 &&
                  (vid ? vocab_ids.numel() == Vq : V == Vq),
                  "eagle3_sampled_chain: keys [B, steps, 2] contiguous int64, want >= 1");
      const int64_t* ks = keys.data_ptr<int64_t>();
      double* vs = values.data_ptr<double>();
      int64_t* is = indices.data_ptr<int64_t>();
      at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, Vq)), [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t b = racing[i];
          const int64_t* key = ks + (b * keys.size(1) + j) * 2;
          if (key[1])
            race_key_row(qs + b * Vq, static_cast<uint64_t>(key[0]), vid, Vq, k, vs + i * k, is + i * k);
          else
            race_top_row(qs + b * Vq, static_cast<const double*>(nullptr), vid, Vq, k, vs + i * k, is + i * k);
        }
      });
      for (int64_t i = 0; i < R; ++i) xs[racing[i]] = is[i * k];
      if (R) {
        Tensor won = values.select(1, 0).div(values.sum(-1)).log().to(at::kFloat);   // [R]
        share = at::zeros({B}, won.options());
        for (int64_t i = 0; i < R; ++i) share.data_ptr<float>()[racing[i]] = won.data_ptr<float>()[i];
      }
    }
    for (int64_t b = 0; b < B; ++b)
      if (sam[b] && str[b]) xs[b] = inverse_cdf_row(qs + b * Vq, Vq, wa[b][j]);
    return std::make_pair(x, std::vector<Tensor>{lp, share, q});
  });
  Tensor q = r[3];                                                             // [B, steps, Vd]
  if (vocab.numel()) {   // spread over the target's V: zeros outside the draft vocabulary
    const int64_t Vd = q.size(-1), R = q.size(0) * q.size(1);
    TORCH_CHECK(vocab.numel() == Vd && vocab.scalar_type() == at::kLong && q.scalar_type() == at::kFloat,
                "eagle3_sampled_chain: vocab [Vd] long, float32 q");
    Tensor full = at::zeros({q.size(0), q.size(1), V}, q.options());
    Tensor qc = q.contiguous(), ids = vocab.contiguous();
    const float* src = qc.data_ptr<float>();
    const int64_t* id = ids.data_ptr<int64_t>();
    float* dst = full.data_ptr<float>();
    for (int64_t i = 0; i < Vd; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < V, "eagle3_sampled_chain: vocab id out of V");
    for (int64_t row = 0; row < R; ++row)
      for (int64_t i = 0; i < Vd; ++i) dst[row * V + id[i]] = src[row * Vd + i];
    q = full;
  }
  return {r[0], r[1], r[2], q};
}
// EagleHead.spread_logits: [N, Vd] -> [N, V], -inf outside the draft vocabulary (``ids`` its target
// ids; empty: the draft vocabulary is the target's)
Tensor spread(const Tensor& logits, const Tensor& ids, int64_t V) {
  if (!ids.numel()) return logits;
  Tensor out = at::full({logits.size(0), V}, -std::numeric_limits<float>::infinity(), logits.options());
  out.index_put_({at::indexing::Slice(), ids}, logits);
  return out;
}

// CompiledTree._tree: the greedy dynamic tree (EAGLE-2) of ``steps`` levels and width ``topk``, its
// best ``nodes`` nodes -> tokens, parents, depths, ranks [B, nodes] long, scores [B, grown] float32
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> eagle3_tree(
    const Tensor& tok, const Tensor& features, const Tensor& pos, const Tensor& mask, const Tensor& rows,
    const Tensor& write_rows, const Tensor& write_cols, const Tensor& kv_len, const Tensor& last,
    const Tensor& col, int64_t steps, int64_t k, int64_t nodes, const Tensor& spread_ids, int64_t V,
    Tensor& k_cache, Tensor& v_cache, const Tensor& embed, const Tensor& cos_table, const Tensor& sin_table,
    at::TensorList norms, at::TensorList weights, at::TensorList biases, at::TensorList scales, at::IntArrayRef sizes,
    double eps, bool norm_before_residual) {
  const int64_t B = tok.size(0), S = tok.size(1), H = sizes[1], T = (steps - 1) * k;
  auto forward = [&](const Tensor& t, const Tensor& f, const Tensor& p, const Tensor& m, const Tensor& wr,
                     const Tensor& wc, const Tensor& len, const Tensor& at) {
    return eagle3_forward(t, f, p, m, rows, wr, wc, len, at, k_cache, v_cache, embed, cos_table, sin_table,
                          norms, weights, biases, scales, sizes, eps, norm_before_residual);
  };
  auto lopt = col.options();
  Tensor at = at::arange(B, lopt).mul(S).add(last);                            // [B] rows of the last tokens
  auto [hidden, logits] = forward(tok, features, pos, mask, write_rows, write_cols, kv_len,
                                  S > 1 ? at : at.new_empty({0}));
  Tensor lp = at::log_softmax(spread(logits, spread_ids, V).to(at::kFloat), -1);  // [B, V]
  auto [score, x] = lp.topk(k);                                                // [B, k] frontier, best first
  Tensor h = hidden.reshape({B * S, H}).index({at}).unsqueeze(1).expand({B, k, H});  // [B, k, H]
  Tensor ids = at::arange(k, lopt).expand({B, k});                             // [B, k] frontier node ids
  std::vector<Tensor> toks{x}, scores{score}, parents{at::full({B, k}, -1, lopt)}, depths{at::ones({B, k}, lopt)};
  Tensor anc = at::zeros({B, k, T}, col.options().dtype(at::kBool));           // [B, k, T] ancestors' columns
  Tensor cols = at::arange(mask.size(-1), lopt);                               // [W]
  Tensor slots = at::arange(k, lopt);                                          // [k]
  Tensor rel = cols.unsqueeze(0).sub(col.unsqueeze(1));                        // [B, W] column - col
  Tensor in_tree = rel.ge(0).logical_and(rel.lt(T));                           // [B, W]
  Tensor before = rel.lt(0).unsqueeze(1);                                      // [B, 1, W]
  Tensor rel_idx = rel.clamp(0, T - 1).unsqueeze(1).expand({B, k, -1});        // [B, k, W]
  Tensor write = rows.repeat_interleave(k);                                    // [B * k]
  int64_t offset = k;
  for (int64_t d = 2; d <= steps; ++d) {
    Tensor t = slots.add((d - 2) * k);                                         // [k] tree columns of the frontier
    Tensor sees = anc.logical_or(at::one_hot(t, T).to(at::kBool).unsqueeze(0));  // [B, k, T] + itself
    Tensor m = before.logical_or(sees.gather(2, rel_idx).logical_and(in_tree.unsqueeze(1)));  // [B, k, W]
    Tensor c = col.unsqueeze(1).add(t.unsqueeze(0));                           // [B, k] columns written
    Tensor p = col.add(d - 2).unsqueeze(1).expand({B, k});                     // [B, k] positions (depth)
    std::tie(hidden, logits) = forward(x, h, p, m.unsqueeze(1), write, c.reshape({-1}), c.max().add(1),
                                       at.new_empty({0}));
    Tensor clp = at::log_softmax(spread(logits, spread_ids, V).to(at::kFloat), -1).reshape({B, k, -1});
    auto [cs, cx] = clp.topk(k);                                               // [B, k, k] children
    Tensor s3 = score.unsqueeze(2);
    cs = at::minimum(s3.add(cs), s3).reshape({B, k * k});                      // path confidence <= parent's
    cx = cx.reshape({B, k * k});
    toks.push_back(cx);
    scores.push_back(cs);
    parents.push_back(ids.unsqueeze(2).expand({B, k, k}).reshape({B, k * k}));
    depths.push_back(at::full({B, k * k}, d, lopt));
    if (d == steps) break;
    Tensor best;
    std::tie(score, best) = cs.topk(k);                                        // [B, k] next frontier
    x = cx.gather(1, best);
    Tensor slot = best.div(k, "floor");                                        // [B, k] its parent's slot
    h = hidden.reshape({B, k, -1}).gather(1, slot.unsqueeze(2).expand({B, k, hidden.size(-1)}));
    anc = sees.gather(1, slot.unsqueeze(2).expand({B, k, T}));
    ids = best.add(offset);
    offset += k * k;
  }
  Tensor tok_all = at::cat(toks, 1), score_all = at::cat(scores, 1);          // [B, M]
  Tensor par_all = at::cat(parents, 1), depth_all = at::cat(depths, 1);
  auto [values, indices] = score_all.sort(/*stable=*/true, 1, /*descending=*/true);  // ties: shallower first
  Tensor top = indices.narrow(1, 0, nodes);                                    // [B, n] by confidence
  Tensor by_depth = std::get<1>(depth_all.gather(1, top).sort(/*stable=*/true, 1, false));  // [B, n]
  Tensor order = top.gather(1, by_depth);                                      // [B, n] depth, confidence
  Tensor local = at::full_like(tok_all, -1);                                   // [B, M] node -> its index
  local.scatter_(1, order, at::arange(nodes, lopt).expand({B, nodes}));
  Tensor par = par_all.gather(1, order);                                       // [B, n] global parents
  Tensor par_local = at::where(par.lt(0), par, local.gather(1, par.clamp_min(0)));
  return {tok_all.gather(1, order), par_local, depth_all.gather(1, order), by_depth, values};
}
}  // namespace

TORCH_LIBRARY(leapfrog_draft, m) {
  m.def("eagle3_chain(Tensor tok, Tensor features, Tensor pos, Tensor mask, Tensor rows, Tensor write_rows, "
        "Tensor write_cols, Tensor kv_len, Tensor last, Tensor col, int steps, Tensor vocab, int window, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor embed, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] weights, Tensor[] biases, Tensor[] scales, int[] sizes, float eps, bool norm_before_residual, Tensor stop) "
        "-> (Tensor, Tensor)");
  m.def("eagle3_sampled_chain(Tensor tok, Tensor features, Tensor pos, Tensor mask, Tensor rows, "
        "Tensor write_rows, Tensor write_cols, Tensor kv_len, Tensor last, Tensor col, int steps, Tensor vocab, "
        "int window, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor embed, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] weights, Tensor[] biases, Tensor[] scales, int[] sizes, float eps, bool norm_before_residual, "
        "Tensor temperature, Tensor sampled, Tensor keys, Tensor stream, Tensor w, int want, float scale, bool race, "
        "int V) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("llama_chain(Tensor tok, Tensor pos, Tensor mask, Tensor rows, Tensor write_rows, Tensor write_cols, "
        "Tensor kv_len, Tensor last, Tensor col, int steps, Tensor stop, int window, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor embed, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, "
        "Tensor[] biases, int[] outs, int[] streams, int[] dims, float eps) -> (Tensor, Tensor)");
  m.def("llama_hidden(Tensor tok, Tensor pos, Tensor mask, Tensor rows, Tensor write_rows, Tensor write_cols, "
        "Tensor kv_len, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor embed, Tensor cos, Tensor sin, "
        "Tensor[] norms, Tensor[] weights, Tensor[] biases, int[] outs, int[] streams, int[] dims, float eps, "
        "int[] aux_layers) -> (Tensor, Tensor[])");
  m.def("eagle3_tree(Tensor tok, Tensor features, Tensor pos, Tensor mask, Tensor rows, Tensor write_rows, "
        "Tensor write_cols, Tensor kv_len, Tensor last, Tensor col, int steps, int k, int nodes, Tensor spread_ids, "
        "int V, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor embed, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] weights, Tensor[] biases, Tensor[] scales, int[] sizes, float eps, bool norm_before_residual) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(leapfrog_draft, CPU, m) {
  m.impl("eagle3_chain", &eagle3_chain);
  m.impl("eagle3_sampled_chain", &eagle3_sampled_chain);
  m.impl("eagle3_tree", &eagle3_tree);
  m.impl("llama_chain", &llama_chain);
  m.impl("llama_hidden", &llama_hidden);
}
"""

# (model/native_ops.py's flags: its row kernels, compiled in here, must round alike)
_LIBRARY = OpLibrary("leapfrog_native_draft", _SOURCE, ["-O3", "-ffp-contract=off"],
                     "native drafting and forward ops (about 20 s)", "drafters draft and eager forwards run in Python",
                     isa=True)


def load_native_draft() -> bool:
    """Build (once, cached on disk) and load the ops. -> whether they are available: built, and for
    the same instruction set as model/native_ops.py's ops (the row kernels both compile must use
    the same vector lanes to round alike; one of the two built generic: the Python loops serve)."""
    from leapfrog.model.native_ops import native_ops_build
    if not _LIBRARY.available():
        return False
    ops = native_ops_build()
    if ops != _LIBRARY.build:
        if not _MISMATCH:
            _MISMATCH.append(True)
            log.warning("native drafting ops built for %s, the norm/RoPE ops for %s: drafters and eager forwards "
                        "run in Python", _LIBRARY.build, ops)
        return False
    return True


_MISMATCH: list[bool] = []   # (warned once)


def _on_the_kernel(linears: list[torch.nn.Module], logits_head: torch.nn.Module, w8a8: bool = False) -> bool:
    """Whether a drafter's ``linears`` (its LM head's projection among them) all run the bf16 few-row
    kernel (NativeLinear; with ``w8a8``, or the int8-row one: quant.W8A8Linear), its LogitsHead takes
    bf16 or float32 rows, and the ops are built."""
    from leapfrog.model.native_linear import NativeLinear
    from leapfrog.model.quant import W8A8Linear
    kinds = (NativeLinear, W8A8Linear) if w8a8 else NativeLinear
    return (all(isinstance(m, kinds) for m in linears)
            and logits_head.in_dtype in (torch.bfloat16, torch.float32) and load_native_draft())


def _scales(linears: list[torch.nn.Module]) -> list[Tensor]:
    """Each W8A8Linear's float32 weight scales, or an empty tensor (a bf16 linear)."""
    return [m.scale if m.packed.dtype == torch.int8 else torch.empty(0) for m in linears]


def _biases(linears: list[torch.nn.Module]) -> list[Tensor]:
    """Each NativeLinear's float32 bias, or an empty tensor (the ops' "no bias")."""
    return [m.bias if m.bias is not None else torch.empty(0) for m in linears]


@dataclass
class NativeHeadForward:
    """An EAGLE-3 head's weights as the ops take them (see the module docstring)."""

    embed: Tensor            # [V, H] the head's embedding, or the target's
    cos: Tensor              # [P, Dh] float32 rope tables
    sin: Tensor
    norms: list[Tensor]      # input_layernorm, hidden_norm, post_attention_layernorm, norm (float32)
    weights: list[Tensor]    # packed: wqkv, wo, w13, w2, lm_head, fc (bf16 blocks, or W8A8Linear's int8)
    biases: list[Tensor]     # each linear's float32 bias, or an empty tensor
    scales: list[Tensor]     # each W8A8Linear's float32 weight scales, or an empty tensor
    sizes: list[int]
    eps: float
    norm_before_residual: bool
    every_row: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))   # ``at`` for all rows
    no_stop: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))   # ``stop``: none

    @classmethod
    def for_head(cls, head: torch.nn.Module) -> NativeHeadForward | None:
        """The op's arguments for ``head``, or None where the op does not apply (module docstring)."""
        if (getattr(head, "kind", None) != "eagle3" or not getattr(head, "native_ops", False)
                or head.device.type != "cpu" or env_off("LEAPFROG_NATIVE_DRAFTS") or len(head.layers) != 1
                or head.head is None):
            return None
        layer, proj = head.layers[0], head.head.proj
        lins = [layer.wqkv, layer.wo, layer.w13, layer.w2, proj, head.fc]
        if not _on_the_kernel(lins, head.head, w8a8=True):
            return None
        a = head.args
        embed = head.embed.weight if head.embed is not None else head._bound().embed.weight
        stream = sum(1 << i for i, m in enumerate(lins) if m.stream)
        return cls(embed, head.rope_cos, head.rope_sin,
                   [layer.attn_norm, layer.hidden_norm, layer.mlp_norm, head.norm.float()],
                   [m.packed for m in lins], _biases(lins), _scales(lins),
                   [m.out_features for m in lins] + [a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                                                     int(proj.f32_out), stream,
                                                     int(head.head.in_dtype == torch.bfloat16)],
                   a.rms_norm_eps, head.cfg.norm_before_residual)

    def _chain_args(self, tok: Tensor, pos: Tensor, mask: Tensor, rows: Tensor, write_rows: Tensor,
                    write_cols: Tensor, kv_len: Tensor, features: Tensor, last: Tensor, col: Tensor, steps: int,
                    vocab: Tensor | None, window: int | None, kv: KVCache) -> tuple:
        return (tok, features, pos, mask, rows, write_rows, write_cols, kv_len, last, col, steps,
                self.every_row if vocab is None else vocab, window or 0, kv.k[0], kv.v[0], self.embed, self.cos,
                self.sin, self.norms, self.weights, self.biases, self.scales, self.sizes, self.eps,
                self.norm_before_residual)

    def chain(self, *args, stop: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """CompiledChain's greedy chain (its ``_steps`` and ``_pick``) in one call. ``args``: the
        first forward's (CompiledForward._forward's tok, pos [B, S], mask [B, 1, S, W], the cache
        rows and columns, features [B, S, F] the target's), then ``last`` [B] each sequence's last real token, ``col``
        [B] the first drafted token's column, ``steps`` tokens to draft, ``vocab`` the head's target
        ids (None: the target's), the head's sliding ``window``, its KV cache; ``stop`` [B] float64
        (CompiledChain._steps: the chains end once every row's path log confidence is below its
        stop) -> tokens [B, steps or fewer], log q [B, steps or fewer]."""
        return torch.ops.leapfrog_draft.eagle3_chain(*self._chain_args(*args),
                                                     self.no_stop if stop is None else stop)

    def sampled_chain(self, *args, temperature: Tensor, sampled: Tensor, keys: Tensor, stream: Tensor, w: Tensor,
                      want: int, scale: float, race: bool, vocab_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """CompiledSampledChain's chain (its ``_steps`` and ``_pick``) in one call: ``args`` as
        ``chain``'s, then the pick's (model/compiled.py), the seeded rows' noise as ``keys`` [B,
        steps, 2] int64 (each level's row key and whether it has one: sampler.noise_keys); ``race``
        False: no row races (keys unread) -> tokens, log q of the argmax, the winner's share [B,
        steps], q [B, steps, V] (spread over the target's ``vocab_size`` ids when ``vocab`` maps
        the head's)."""
        return torch.ops.leapfrog_draft.eagle3_sampled_chain(*self._chain_args(*args), temperature, sampled, keys,
                                                            stream, w, want, scale, race, vocab_size)

    def tree(self, tok: Tensor, pos: Tensor, mask: Tensor, rows: Tensor, write_rows: Tensor, write_cols: Tensor,
             kv_len: Tensor, features: Tensor, last: Tensor, col: Tensor, steps: int, topk: int, nodes: int,
             spread_ids: Tensor | None, vocab_size: int, kv: KVCache) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """CompiledTree's greedy dynamic tree (its ``_tree``) in one call: the first forward's
        arguments and ``last``, ``col`` as ``chain``'s, the tree's ``steps`` levels, ``topk`` width
        and ``nodes`` kept, ``spread_ids`` the head's target ids (its logits spread over the
        target's ``vocab_size`` ids, as the Python tree's; None: the target's vocabulary) -> tokens,
        parents, depths, ranks [B, nodes], scores [B, grown] (model/compiled.py TreeOutput)."""
        return torch.ops.leapfrog_draft.eagle3_tree(
            tok, features, pos, mask, rows, write_rows, write_cols, kv_len, last, col, steps, topk, nodes,
            self.every_row if spread_ids is None else spread_ids, vocab_size, kv.k[0], kv.v[0], self.embed,
            self.cos, self.sin, self.norms, self.weights, self.biases, self.scales, self.sizes, self.eps,
            self.norm_before_residual)


@dataclass
class NativeLlamaForward:
    """A draft model's (LlamaModel's) weights as ``llama_chain`` takes them (module docstring)."""

    embed: Tensor
    cos: Tensor
    sin: Tensor
    norms: list[Tensor]      # per layer attention and MLP norms, then the final norm (float32)
    weights: list[Tensor]    # packed: per layer wqkv, wo, w13, w2, then the LM head
    biases: list[Tensor]
    outs: list[int]
    streams: list[int]
    dims: list[int]          # heads, kv_heads, head_dim, the LM head's f32_out, its rows in bf16
    eps: float
    no_stop: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))   # ``stop``: none

    @classmethod
    def for_model(cls, model: torch.nn.Module,
                  switch: str | None = "LEAPFROG_NATIVE_DRAFTS") -> NativeLlamaForward | None:
        """The op's arguments for ``model``, or None where it does not apply: a LlamaModel packed
        for inference on CPU with the native norm/RoPE ops, every linear (its LM head too) on the
        bf16 few-row kernel, no tensor parallelism, not batch-invariant; the environment variable
        ``switch`` not "0" (None: the caller has read its own switch)."""
        from leapfrog.model.llama import LlamaModel
        if (not isinstance(model, LlamaModel) or not model.native_ops or model.device.type != "cpu"
                or model.tp is not None or model.batch_invariant or model.head is None
                or (switch is not None and env_off(switch))):
            return None
        lins = [m for layer in model.layers for m in (layer.wqkv, layer.wo, layer.w13, layer.w2)] + [model.head.proj]
        if not _on_the_kernel(lins, model.head):
            return None
        a = model.args
        norms = [w for layer in model.layers for w in (layer.attn_norm, layer.mlp_norm)] + [model.norm.float()]
        return cls(model.embed.weight, model.rope_cos, model.rope_sin, norms, [m.packed for m in lins], _biases(lins),
                   [m.out_features for m in lins], [int(m.stream) for m in lins],
                   [a.num_attention_heads, a.num_key_value_heads, a.head_dim, int(model.head.proj.f32_out),
                    int(model.head.in_dtype == torch.bfloat16)], a.rms_norm_eps)

    def hidden(self, tok: Tensor, pos: Tensor, meta: AttnMeta, kv: KVCache,
               aux_layers: tuple[int, ...] = ()) -> tuple[Tensor, list[Tensor]]:
        """LlamaModel.forward in one call (``llama_hidden``): token ids, positions [B, S] and the
        eager forward's attention metadata for the C++ attention op (``meta.native``: its rows,
        write rows and columns, the cache-wide mask and kv_len) -> hidden [B, S, D] float32, the
        outputs of the layers in ``aux_layers`` [B, S, D] each; every value bitwise the Python
        forward's (the same ops in the same order) and the cache written alike."""
        return torch.ops.leapfrog_draft.llama_hidden(
            tok, pos, meta.mask, meta.rows, meta.write_rows, meta.write_cols, meta.graph_kv_len, kv.k, kv.v,
            self.embed, self.cos, self.sin, self.norms, self.weights, self.biases, self.outs, self.streams,
            self.dims, self.eps, list(aux_layers))

    def chain(self, tok: Tensor, pos: Tensor, mask: Tensor, rows: Tensor, write_rows: Tensor, write_cols: Tensor,
              kv_len: Tensor, features: Tensor | None, last: Tensor, col: Tensor, steps: int, vocab: Tensor | None,
              window: int | None, kv: KVCache, stop: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """CompiledChain's greedy chain of a draft model in one call (``NativeHeadForward.chain``'s
        arguments; a draft has no features and drafts over the target's vocabulary) -> tokens,
        log q [B, steps or fewer]."""
        assert features is None and vocab is None
        return torch.ops.leapfrog_draft.llama_chain(
            tok, pos, mask, rows, write_rows, write_cols, kv_len, last, col, steps,
            self.no_stop if stop is None else stop, window or 0, kv.k, kv.v,
            self.embed, self.cos, self.sin, self.norms, self.weights, self.biases, self.outs, self.streams,
            self.dims, self.eps)
