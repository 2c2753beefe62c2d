"""The compiled graphs' attention op in C++: ``torch.ops.leapfrog_native.cached_attention``.

Same contract and same ATen calls as the Python op ``torch.ops.leapfrog.cached_attention``
(attention/backend.py): write the new k/v to the cache, read the first ``kv_len`` columns of the
batch's rows, SDPA with the mask (a lone half-precision CPU query run as two rows). A compiled
graph calls this op once per layer; from C++ the call costs no Python frames (measured on the
built-in target's shapes, 2 threads: 80 against 118 us per layer for a bf16 decode token, 268
against 412 for 3 sequences x 5 tokens), and its results are bitwise the Python op's
(tests/attention/test_native.py).

It is built once with ``torch.utils.cpp_extension.load_inline`` (about 20 s on 2 cores, cached
under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) when the fast path is
first compiled; if it cannot be built, graphs call the Python op instead (logged).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("leapfrog.attention")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/ATen.h>
using at::indexing::Slice;

// q [B, S, H, Dh]; k, v [B, S, Hkv, Dh]; caches [rows + 1, Hkv, max_len, Dh]; rows [B];
// write_rows, write_cols [B*S]; mask [B, 1, S, max_len] bool; kv_len [] int64 -> [B, S, H, Dh]
at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                            const at::Tensor& write_rows, const at::Tensor& write_cols,
                            const at::Tensor& mask, const at::Tensor& kv_len) {
  const int64_t L = kv_len.item<int64_t>();
  k_cache.index_put_({write_rows, Slice(), write_cols}, k.flatten(0, 1));
  v_cache.index_put_({write_rows, Slice(), write_cols}, v.flatten(0, 1));
  at::Tensor keys, values;
  if (rows.numel() == 1) {  // one row: a view
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
    o = at::scaled_dot_product_attention(at::cat({qt, qt}, 2), keys, values, m.expand({-1, -1, 2, -1}),
                                         0.0, false, std::nullopt, gqa).slice(2, 0, 1);
  } else {
    o = at::scaled_dot_product_attention(qt, keys, values, m, 0.0, false, std::nullopt, gqa);
  }
  return o.transpose(1, 2).contiguous();
}

TORCH_LIBRARY(leapfrog_native, m) {
  m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor rows, Tensor write_rows, Tensor write_cols, Tensor mask, Tensor kv_len) -> Tensor");
}
TORCH_LIBRARY_IMPL(leapfrog_native, CPU, m) { m.impl("cached_attention", &cached_attention); }
TORCH_LIBRARY_IMPL(leapfrog_native, CUDA, m) { m.impl("cached_attention", &cached_attention); }
"""

_STATE: dict[str, bool] = {}  # memo of load_native_attention (the op is process-wide once loaded)


def load_native_attention() -> bool:
    """Build (once, cached on disk) and load the C++ op. -> whether it is available."""
    if "ok" not in _STATE:
        try:
            from torch.utils.cpp_extension import load_inline
            log.info("loading leapfrog's native attention op (built once, about 20 s)")
            load_inline("leapfrog_native_attention", cpp_sources=_SOURCE, is_python_module=False,
                        extra_cflags=["-O2"])
            torch.library.register_fake("leapfrog_native::cached_attention")(_fake)
            _STATE["ok"] = True
        except Exception as e:  # noqa: BLE001 - no compiler, headers, ...: the Python op serves
            log.warning("native attention op unavailable (%s: %s); compiled graphs call the Python op",
                        type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            _STATE["ok"] = False
    return _STATE["ok"]


def _fake(q, k, v, k_cache, v_cache, rows, write_rows, write_cols, mask, kv_len):
    return torch.empty_like(q)
