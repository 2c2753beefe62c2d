"""One EAGLE-3 draft level as one C++ call: ``torch.ops.leapfrog_head.eagle3_level``.

Eagerly, a head level (EagleHead.forward for one token per sequence, then its own LM head) is
some 25 operator calls through Python: embedding, three norms, the concatenation, five linears,
two rotations, the cached attention and its mask, two residual adds, silu * up, and the modules
and metadata around them. Measured on the built-in head (bf16, batch 1, 2-vCPU AVX-512 EPYC):
about 0.45 ms a level, of which the kernels are about 0.2 ms; the rest is Python and dispatch,
paid five times per drafted chain. This op makes the same calls, in the same order, on the same
tensors, from C++ through the dispatcher (about a microsecond each): the kernels are leapfrog's
own (model/native_linear.py, model/native_ops.py, attention/native.py) and ATen's, so a level's
outputs are bitwise those of the Python forward (tests/model/test_native_head.py), and the KV
cache is read and written by the same attention op the compiled graphs call.

    eagle3_level(tok [B] long, h [B, H], col [B] long, rows [B] long, k_cache, v_cache,
                 cols [W] long, embed [V, H], cos [P, Dh], sin [P, Dh], norms, weights, biases,
                 sizes, eps, norm_before_residual, window) -> (hidden [B, H], logits [B, Vd] float32)

    e = embed[tok] (in h's dtype); x = h; hn = hidden_norm(x); (x = hn if norm_before_residual)
    q, k, v = wqkv(cat[input_layernorm(e), hn]); q, k = rope(q, k) at position col
    o = attention(q, k, v) writing k/v at (rows, col), reading columns <= col (and > col - window)
    x = x + wo(o); hidden = x + w2(silu_mul(w13(post_attention_layernorm(x))))
    logits = lm_head(norm(hidden in float32) in the head's row dtype), float32

Where it applies (``NativeHeadLevel.for_head``): an EAGLE-3 head packed for inference on CPU with
the native norm/RoPE ops and every linear, its LM head included, on the bf16 few-row kernel
(NativeLinear: bf16 weights, or float32 weights of bf16 values). Elsewhere (EAGLE-1, other
linears, CUDA) the Python forward runs. ``LEAPFROG_NATIVE_HEAD=0`` (read at load) turns it off.
Built once like the other ops (utils/cpp.py, about 15 s, cached under ``TORCH_EXTENSIONS_DIR``);
if it cannot be built the Python forward serves (logged).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from leapfrog.utils import env_off
from leapfrog.utils.cpp import load_inline

log = logging.getLogger("leapfrog.model")

_SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace {
using at::Tensor;

// the other leapfrog ops, called through the dispatcher (their libraries are loaded first)
const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t, bool, bool)>&
linear_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_gemm::linear_bf16", "")
      .typed<Tensor(const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t, bool, bool)>();
  return op;
}
const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)>& norm_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_ops::rms_norm", "")
      .typed<Tensor(const Tensor&, const Tensor&, double)>();
  return op;
}
const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&)>& rope_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_ops::rope", "")
      .typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>();
  return op;
}
const c10::TypedOperatorHandle<Tensor(const Tensor&)>& silu_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_ops::silu_mul", "")
      .typed<Tensor(const Tensor&)>();
  return op;
}
using AttnSig = Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&,
                       const Tensor&, const Tensor&, const Tensor&, const Tensor&);
const c10::TypedOperatorHandle<AttnSig>& attention_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("leapfrog_native::cached_attention", "")
      .typed<AttnSig>();
  return op;
}

// sizes: [n_qkv, n_o, n_13, n_2, n_head, heads, kv_heads, head_dim, f32_out of the LM head,
//         stream mask (bit i: weights[i] streamed), LM head rows in bf16]
std::tuple<Tensor, Tensor> eagle3_level(
    const Tensor& tok, const Tensor& h, const Tensor& col, const Tensor& rows, Tensor& k_cache,
    Tensor& v_cache, const Tensor& cols, const Tensor& embed, const Tensor& cos_table,
    const Tensor& sin_table, at::TensorList norms, at::TensorList weights, at::TensorList biases,
    at::IntArrayRef sizes, double eps, bool norm_before_residual, int64_t window) {
  TORCH_CHECK(norms.size() == 4 && weights.size() == 5 && biases.size() == 5 && sizes.size() == 11,
              "eagle3_level: 4 norms, 5 weights, 5 biases and 11 sizes");
  const int64_t B = tok.size(0), H = h.size(-1);
  const int64_t heads = sizes[5], kv_heads = sizes[6], Dh = sizes[7];
  const int64_t q_size = heads * Dh, kv_size = kv_heads * Dh;
  auto bias = [&](int i) -> c10::optional<Tensor> {
    return biases[i].numel() ? c10::optional<Tensor>(biases[i]) : c10::nullopt;
  };
  auto linear = [&](const Tensor& x, int i, bool f32_out) {
    return linear_op().call(x, weights[i], bias(i), sizes[i], f32_out, ((sizes[9] >> i) & 1) != 0);
  };
  const auto dt = h.scalar_type();
  // EagleHead.forward (one token per sequence, the previous level's state as the feature)
  Tensor e = at::embedding(embed, tok.view({B, 1})).to(dt);                   // [B, 1, H]
  Tensor x = h.view({B, 1, H}).to(dt);
  Tensor cos = cos_table.index_select(0, col).to(dt).view({B, 1, 1, Dh});
  Tensor sin = sin_table.index_select(0, col).to(dt).view({B, 1, 1, Dh});
  // EagleLayer.forward, form "eagle3"
  Tensor hn = norm_op().call(x, norms[1], eps);
  if (norm_before_residual) x = hn;
  Tensor a = at::cat({norm_op().call(e, norms[0], eps), hn}, -1);             // [B, 1, 2H]
  auto qkv = linear(a, 0, false).split_with_sizes({q_size, kv_size, kv_size}, -1);
  Tensor q = rope_op().call(qkv[0].view({B, 1, heads, Dh}), cos, sin);
  Tensor k = rope_op().call(qkv[1].view({B, 1, kv_heads, Dh}), cos, sin);
  Tensor v = qkv[2].view({B, 1, kv_heads, Dh});
  // compiled.causal_mask: [B, 1, 1, W]
  Tensor c = col.view({B, 1, 1});
  Tensor m = cols.view({1, 1, -1}).le(c);
  if (window > 0) m.logical_and_(cols.view({1, 1, -1}).gt(c - window));
  m = m.unsqueeze(1);
  Tensor kv_len = col.max().add(1);
  Tensor o = attention_op().call(q, k, v, k_cache, v_cache, rows, rows, col, m, kv_len);  // [B, 1, Hq, Dh]
  // DecoderLayer._after_attention
  x = x.add(linear(o.reshape({B, 1, q_size}), 1, false));
  Tensor g = norm_op().call(x, norms[2], eps);
  x = x.add(linear(silu_op().call(linear(g, 2, false)), 3, false));           // [B, 1, H]
  // EagleHead.compute_draft_logits: norm in float32, then LogitsHead (rows in its dtype)
  Tensor hidden = x.reshape({B, H});
  Tensor f = norm_op().call(hidden.to(at::kFloat), norms[3], eps);
  Tensor logits = linear(f.to(sizes[10] ? at::kBFloat16 : at::kFloat), 4, sizes[8] != 0).to(at::kFloat);
  return {x.select(1, 0), logits};
}
}  // namespace

TORCH_LIBRARY(leapfrog_head, m) {
  m.def("eagle3_level(Tensor tok, Tensor h, Tensor col, Tensor rows, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor cols, Tensor embed, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, Tensor[] biases, "
        "int[] sizes, float eps, bool norm_before_residual, int window) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(leapfrog_head, CPU, m) { m.impl("eagle3_level", &eagle3_level); }
"""

_STATE: dict[str, bool] = {}  # memo of load_native_head (process-wide once loaded)
_LOCK = threading.Lock()


def load_native_head() -> bool:
    """Build (once, cached on disk) and load the op. -> whether it is available."""
    with _LOCK:
        if "ok" not in _STATE:
            try:
                log.info("loading leapfrog's native EAGLE-3 level op (built once, about 15 s)")
                load_inline("leapfrog_native_head", _SOURCE, ["-O2"])
                _STATE["ok"] = True
            except Exception as e:  # noqa: BLE001 - no compiler, headers, ...: the Python forward serves
                log.warning("native EAGLE-3 level op unavailable (%s: %s); heads draft in Python",
                            type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                _STATE["ok"] = False
    return _STATE["ok"]


@dataclass
class NativeHeadLevel:
    """An EAGLE-3 head's weights as ``eagle3_level`` takes them (see the module docstring)."""

    embed: Tensor            # [V, H] the head's embedding, or the target's
    cos: Tensor              # [P, Dh] float32 rope tables
    sin: Tensor
    norms: list[Tensor]      # input_layernorm, hidden_norm, post_attention_layernorm, norm (float32)
    weights: list[Tensor]    # packed: wqkv, wo, w13, w2, lm_head
    biases: list[Tensor]     # each linear's float32 bias, or an empty tensor
    sizes: list[int]
    eps: float
    norm_before_residual: bool
    window: int              # 0: none

    @classmethod
    def for_head(cls, head: torch.nn.Module) -> NativeHeadLevel | None:
        """The op's arguments for ``head``, or None where the op does not apply (module docstring)."""
        from leapfrog.model.native_linear import NativeLinear
        if (getattr(head, "kind", None) != "eagle3" or not getattr(head, "native_ops", False)
                or head.device.type != "cpu" or env_off("LEAPFROG_NATIVE_HEAD") or len(head.layers) != 1
                or head.head is None):
            return None
        layer, proj = head.layers[0], head.head.proj
        lins = [layer.wqkv, layer.wo, layer.w13, layer.w2, proj]
        if not all(isinstance(m, NativeLinear) for m in lins) or head.head.in_dtype not in (torch.bfloat16,
                                                                                            torch.float32):
            return None
        if not load_native_head():
            return None
        a = head.args
        embed = head.embed.weight if head.embed is not None else head._bound().embed.weight
        stream = sum(1 << i for i, m in enumerate(lins) if m.stream)
        return cls(embed, head.rope_cos, head.rope_sin,
                   [layer.attn_norm, layer.hidden_norm, layer.mlp_norm, head.norm.float()],
                   [m.packed for m in lins],
                   [m.bias if m.bias is not None else torch.empty(0) for m in lins],
                   [m.out_features for m in lins] + [a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                                                     int(proj.f32_out), stream,
                                                     int(head.head.in_dtype == torch.bfloat16)],
                   a.rms_norm_eps, head.cfg.norm_before_residual, a.sliding_window or 0)

    def __call__(self, tok: Tensor, h: Tensor, col: Tensor, rows: Tensor, k_cache: Tensor, v_cache: Tensor,
                 cols: Tensor) -> tuple[Tensor, Tensor]:
        """tok [B] target ids, h [B, H] the previous level's state, col [B] the level's column (its
        position), rows [B] cache rows, cols [W] the cache's columns -> hidden [B, H], logits [B, Vd]."""
        return torch.ops.leapfrog_head.eagle3_level(
            tok, h, col, rows, k_cache, v_cache, cols, self.embed, self.cos, self.sin, self.norms, self.weights,
            self.biases, self.sizes, self.eps, self.norm_before_residual, self.window)
