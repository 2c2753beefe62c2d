"""RMSNorm, RoPE and the MLP's silu * up as single C++ ops for eager CPU forwards, and the row
maxima of logits (``row_max``, greedy verification and picks): ``torch.ops.leapfrog_ops``.

An eager forward spends a good share of a step outside its matrix products on small functions
that ATen runs as chains of tensor ops: ``F.rms_norm`` (pow, mean, add, rsqrt, mul, mul, cast:
each a dispatch and an allocation), ``apply_rope`` (two slices, neg, cat, two muls, add) and the
MLP's ``silu(gate) * up`` (chunk, silu, mul). For a decode step their tensors hold a few thousand
elements, so the dispatches are the cost. Measured warm on a 2-vCPU Zen 3 (float32, the built-in
target's shapes, 2 threads): one norm of one token 34 us, of 64 tokens 72 us; the rotation of one
token's q and k 56 us, of 64 tokens 113 us; silu * up 17 and 115 us. A decoder layer has two
norms, one rotation and one silu * up, so one eager decode step of the 6-layer target spent about
0.85 ms of its ~6.8 ms in them. Here each is one op call.

Numerics:
- ``rope(x [B, S, H, D], cos [B, S, 1, D], sin)`` -> ``x * cos + rotate_half(x) * sin``
  (rotate_half(x) = cat(-x2, x1)), each product and the sum rounded to x's dtype as ATen rounds
  them (products and sum in float32, then to bf16/fp16 by round-to-nearest-even; built with
  ``-ffp-contract=off``, so no fused multiply-add merges a product into the sum): bitwise
  ``apply_rope``'s result (tests/model/test_native_ops.py).
- ``silu_mul(gate_up [..., 2I])`` -> ``silu(gate) * up``: bitwise ATen's result for each row
  (ATen's silu takes a row's elements two of its vectors at a time with Sleef's exp and the rest
  with std::exp; the same split here, and the same roundings). Row-invariant, where ATen's split
  of a large batch over threads can cut a row (model/llama.py ``_silu_mul``).
- ``rms_norm(x [..., D], weight [D], eps)`` -> ``(x * rsqrt(mean(x^2) + eps)) * weight`` in
  float32, rounded once to x's dtype, as ``F.rms_norm`` computes it; the sum of squares runs in
  a fixed order (one vector of lanes over the row, its lanes reduced in ATen's fixed tree, then
  the tail), so it can differ from ATen's in the last bits, and a row's result depends only on
  that row (row invariance: a token verified among drafts is normalized bitwise as when decoded
  alone, in any batch, with any thread count).

Used by models packed for inference on CPU (``pack_for_inference`` sets their layers'
``native_ops``), outside ``torch.compile`` (graphs fuse these themselves) and without autograd
(training keeps ATen's differentiable functions). Built once per CPU instruction set with
``load_inline`` (utils/cpp.py, with a generic build where the compiler refuses the set's flags;
20-60 s, cached under ``TORCH_EXTENSIONS_DIR``) at the first such load; if the
build fails (logged), or with ``LEAPFROG_NATIVE_OPS=0`` (read at load), forwards keep ATen's
functions.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from leapfrog.utils import env_off
from leapfrog.utils.cpp import build_inline

log = logging.getLogger("leapfrog.model")

#: The row kernels of these ops as C++ templates on raw pointers, shared with the drafting ops
#: (model/native_draft.py fuses them into its forwards: the same arithmetic, so the same bits).
#: Needs <ATen/cpu/vec/vec.h>, <ATen/Parallel.h>, <cmath>, <vector> and the same instruction-set
#: flags (the lane count fixes the sum of squares' order).
ROW_KERNELS_CPP = r"""
using at::vec::Vectorized;

// f(r0, r1) over rows [0, R) split over PyTorch's threads, at least ``work`` elements a chunk (a few
// rows stay on the calling thread: waking a worker costs more than it saves); each row is computed
// alone, so the split changes no bit
template <typename F>
static void row_chunks(int64_t R, int64_t row_elems, int64_t work, F f) {
  at::parallel_for(0, R, std::max<int64_t>(1, work / std::max<int64_t>(row_elems, 1)), f);
}

// f(w) with a norm's weight [D] as rms_norm reads it for rows of T: in its own dtype when that is
// T's or float32 (each element widened to float32 as weight.float() would: exact, so a
// half-precision model's norms cast nothing per call), else converted to float32 first
template <typename T, typename F>
static void with_norm_weight(const at::Tensor& w, int64_t D, F f) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D, "norm weight of shape ", w.sizes(), " for rows of ", D);
  if (w.scalar_type() == at::kFloat) f(w.contiguous().data_ptr<float>());
  else if (w.scalar_type() == c10::CppTypeToScalarType<T>::value) f(w.contiguous().data_ptr<T>());
  else f(w.to(at::kFloat).contiguous().data_ptr<float>());
}

// sum of squares of a float32 row: one vector of lanes in element order, lanes reduced in
// ATen's fixed tree, then the tail in order (the same for a row whatever else is computed)
static float sum_squares(const float* x, int64_t n) {
  using V = Vectorized<float>;
  int64_t i = 0;
  float s = 0.f;
  if (n >= V::size()) {
    V acc(0.f);
    for (; i + V::size() <= n; i += V::size()) {
      V v = V::loadu(x + i);
      acc = acc + v * v;
    }
    s = at::vec::vec_reduce_all<float>([](V& a, V& b) { return a + b; }, acc);
  }
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// one row of rms_norm: xr [D] -> yr [D] (``buf``: D floats of scratch where T is not float32)
template <typename T, typename W>
static inline void rms_row(const T* xr, const W* w, T* yr, int64_t D, float eps, float* buf) {
  const float* xf;
  if constexpr (std::is_same<T, float>::value) {
    xf = xr;
  } else {
    for (int64_t i = 0; i < D; ++i) buf[i] = static_cast<float>(xr[i]);
    xf = buf;
  }
  float mean = sum_squares(xf, D) / static_cast<float>(D);
  float inv = 1.f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < D; ++i) {
    float v = xf[i] * inv;
    yr[i] = static_cast<T>(v * static_cast<float>(w[i]));
  }
}

template <typename T, typename W>
static void rms_rows(const T* x, const W* w, T* y, int64_t rows, int64_t D, float eps) {
  row_chunks(rows, D, 16384, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(std::is_same<T, float>::value ? 0 : D);
    for (int64_t r = r0; r < r1; ++r) rms_row<T, W>(x + r * D, w, y + r * D, D, eps, buf.data());
  });
}

// one head's rotation: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to T as
// ATen's ops round them; cos/sin rows of type C are first rounded to T (``table[pos].to(T)``).
// xp and yp must not overlap.
template <typename T, typename C>
static inline void rope_head(const T* xp, const C* c, const C* sn, T* yp, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    float xi = static_cast<float>(xp[i]);
    float rot = i < half ? -static_cast<float>(xp[i + half]) : static_cast<float>(xp[i - half]);
    T a = static_cast<T>(xi * static_cast<float>(static_cast<T>(c[i])));
    T r = static_cast<T>(rot * static_cast<float>(static_cast<T>(sn[i])));
    yp[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(r));
  }
}

template <typename T>
static void rope_rows(const T* x, int64_t sb, int64_t ss, int64_t sh, const T* cos, const T* sin, T* y,
                      int64_t B, int64_t S, int64_t H, int64_t D) {
  row_chunks(B * S, H * D, 4096, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t b = t / S, s = t % S;
      for (int64_t h = 0; h < H; ++h)
        rope_head<T, T>(x + b * sb + s * ss + h * sh, cos + t * D, sin + t * D, y + (t * H + h) * D, D);
    }
  });
}

// silu(gate) * up of one row: ATen's silu runs a row's elements two of its vectors at a time with
// the vector formula (Sleef's exp) and the rest with the scalar one (std::exp), rounding to T; the
// product is rounded to T: the same split and roundings here. ``g``: I floats of scratch.
template <typename T>
static inline void silu_mul_row(const T* gr, const T* ur, T* yr, int64_t I, float* g) {
  using V = Vectorized<float>;
  const int64_t nvec = I / (2 * Vectorized<T>::size()) * (2 * Vectorized<T>::size());
  for (int64_t i = 0; i < I; ++i) g[i] = static_cast<float>(gr[i]);
  int64_t i = 0;
  for (; i + V::size() <= nvec; i += V::size()) {
    V gv = V::loadu(g + i);
    (gv / (V(1.f) + gv.neg().exp())).store(g + i);
  }
  for (; i < I; ++i) g[i] = g[i] / (1.f + std::exp(-g[i]));
  for (int64_t j = 0; j < I; ++j) {
    T s = static_cast<T>(g[j]);
    yr[j] = static_cast<T>(static_cast<float>(s) * static_cast<float>(ur[j]));
  }
}

template <typename T>
static void silu_mul_rows(const T* x, T* y, int64_t rows, int64_t I) {
  row_chunks(rows, I, 16384, [&](int64_t r0, int64_t r1) {
    std::vector<float> g(I);
    for (int64_t r = r0; r < r1; ++r) silu_mul_row<T>(x + r * 2 * I, x + r * 2 * I + I, y + r * I, I, g.data());
  });
}
"""

_SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <limits>
#include <cmath>
#include <vector>
""" + ROW_KERNELS_CPP + r"""
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be [D] for x [..., D]");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  int64_t D = x.size(-1);
  int64_t rows = D == 0 ? 0 : xc.numel() / D;
  float e = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    with_norm_weight<scalar_t>(weight, D, [&](auto w) {
      rms_rows(xc.data_ptr<scalar_t>(), w, y.data_ptr<scalar_t>(), rows, D, e);
    });
  });
  return y;
}

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0, "rope: x must be [B, S, H, D] with D even "
              "and its last dimension contiguous");
  int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == B * S * D && cos.scalar_type() == x.scalar_type()
              && sin.scalar_type() == x.scalar_type(), "rope: cos and sin must be [B, S, 1, D] in x's dtype");
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor y = at::empty({B, S, H, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), x.stride(2), c.data_ptr<scalar_t>(),
                        s.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), B, S, H, D);
  });
  return y;
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: the last dimension must be even");
  at::Tensor x = gate_up.contiguous();
  int64_t I = x.size(-1) / 2;
  auto shape = x.sizes().vec();
  shape.back() = I;
  at::Tensor y = at::empty(shape, x.options());
  int64_t rows = I == 0 ? 0 : x.numel() / (2 * I);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, I);
  });
  return y;
}

// the first index i of r[0, V) with r[i] == mx (there is one), a vector of lanes at a time: the
// scalar scan took 4 us a row of 8192 (half the row on average), 22 of 27 us for a verify's 8 rows
static int64_t first_equal(const float* r, int64_t V, float mx) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 m = _mm512_set1_ps(mx);
  for (; i + 16 <= V; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i), m, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(static_cast<unsigned>(eq));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 m = _mm256_set1_ps(mx);
  for (; i + 8 <= V; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + i), m, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(static_cast<unsigned>(eq));
  }
#endif
  while (!(r[i] == mx)) ++i;
  return i;
}

// Tensor.max(-1) of float32 rows: ATen's kernel walks a row one element at a time (replace on
// !(value <= max), stop at the first NaN); here a vector pass finds the row's max (NaN-propagating)
// and a scan the first element equal to it (or the first NaN): the same value and index.
std::tuple<at::Tensor, at::Tensor> row_max_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "row_max: float32 [N, V], V > 0");
  using Vec = at::vec::Vectorized<float>;
  at::Tensor c = x.contiguous();
  const int64_t N = c.size(0), V = c.size(1);
  at::Tensor values = at::empty({N}, c.options()), indices = at::empty({N}, c.options().dtype(at::kLong));
  const float* base = c.data_ptr<float>();
  float* out_v = values.data_ptr<float>();
  int64_t* out_i = indices.data_ptr<int64_t>();
  // rows split over threads only from 262144 elements on (a verify batch of 32 x 8 rows of 8192):
  // smaller ones stay on this thread (waking the OpenMP worker costs more than it saves)
  at::parallel_for(0, N, std::max<int64_t>(1, 262144 / V), [&](int64_t lo, int64_t hi) {
  for (int64_t n = lo; n < hi; ++n) {
    const float* r = base + n * V;
    Vec m(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + Vec::size() <= V; i += Vec::size()) m = at::vec::maximum(m, Vec::loadu(r + i));
    float lanes[Vec::size()];
    m.store(lanes);
    float mx = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t k = 0; k < Vec::size(); ++k) {
      nan |= std::isnan(lanes[k]);
      mx = std::max(mx, lanes[k]);
    }
    for (; i < V; ++i) {
      nan |= std::isnan(r[i]);
      mx = std::max(mx, r[i]);
    }
    int64_t at = 0;
    if (nan) {
      while (!std::isnan(r[at])) ++at;
    } else {
      at = first_equal(r, V, mx);
    }
    out_v[n] = r[at];
    out_i[n] = at;
  }
  });
  return {values, indices};
}

TORCH_LIBRARY(leapfrog_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("row_max(Tensor x) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(leapfrog_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rope", &rope_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
  m.impl("row_max", &row_max_cpu);
}
"""

_STATE: dict[str, bool] = {}  # memo of load_native_ops (the ops are process-wide once loaded)
_LOCK = threading.Lock()


def load_native_ops() -> bool:
    """Build (once, cached on disk) and load the ops. -> available."""
    if "ok" not in _STATE:
        with _LOCK:
            if "ok" not in _STATE:
                _STATE["ok"] = _load()
    return _STATE["ok"]


def native_ops_build() -> str | None:
    """The instruction-set build the ops loaded ("avx512", "avx2" or "generic"; None: not loaded):
    libraries that compile ROW_KERNELS_CPP must match it to round alike (model/native_draft.py)."""
    return _STATE.get("build") if load_native_ops() else None


def native_ops_wanted(device: torch.device) -> bool:
    """Whether a model packed for inference on ``device`` runs its eager norms and rotations as
    these ops: on CPU, unless ``LEAPFROG_NATIVE_OPS=0`` (read here, at load), once built."""
    return device.type == "cpu" and not env_off("LEAPFROG_NATIVE_OPS") and load_native_ops()


def _load() -> bool:
    try:
        log.info("loading leapfrog's native norm and RoPE ops (built once, about 20 s)")
        _STATE["build"] = build_inline("leapfrog_native_ops", _SOURCE, ["-O3", "-ffp-contract=off"])
        # (shapes for tracers that reach them outside torch.compile, e.g. make_fx)
        torch.library.register_fake("leapfrog_ops::rms_norm")(lambda x, weight, eps: torch.empty_like(x))
        torch.library.register_fake("leapfrog_ops::rope")(lambda x, cos, sin: x.new_empty(x.shape))
        torch.library.register_fake("leapfrog_ops::silu_mul")(
            lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)))
        torch.library.register_fake("leapfrog_ops::row_max")(
            lambda x: (x.new_empty(x.shape[0]), x.new_empty(x.shape[0], dtype=torch.long)))
        return True
    except Exception as e:  # noqa: BLE001 - no compiler, headers, ...: ATen's functions serve
        log.warning("native norm/RoPE ops unavailable (%s: %s); eager forwards use ATen's",
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return False


def use_native_ops(model: torch.nn.Module, device: torch.device) -> bool:
    """A model packed for inference: it and its layers (each with a ``native_ops`` flag) run
    their eager norms and rotations as the C++ ops where native_ops_wanted. -> whether they do."""
    on = native_ops_wanted(device)
    for m in model.modules():
        if hasattr(m, "native_ops"):
            m.native_ops = on
    return on


def usable(native: bool, *ts: Tensor) -> bool:
    """Whether a call with these tensors takes the C++ op: the model chose it at load
    (``native``; native_ops_wanted), no autograd, and not being traced by torch.compile."""
    return native and not torch.compiler.is_compiling() and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def rms_norm(x: Tensor, weight: Tensor, eps: float, native: bool = False) -> Tensor:
    """``F.rms_norm(x, (D,), weight, eps)``; one op on CPU with ``native`` (module docstring)."""
    if usable(native, x, weight):
        return torch.ops.leapfrog_ops.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def row_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x.max(dim=-1)`` of logits [N, V]: the same values and indices (the first NaN of a row if
    any, else its first maximum), as one vectorised pass and a scan on CPU float32 once the ops
    are loaded (8 rows of 8192: 12 against 75 us warm; ATen's kernel walks a row one element
    at a time), else ATen's. -> (values [N], indices [N]) (a plain tuple from the op)."""
    if (x.dim() == 2 and x.shape[-1] and x.dtype == torch.float32 and x.device.type == "cpu"
            and _STATE.get("ok") and usable(True, x)):
        return torch.ops.leapfrog_ops.row_max(x)
    return x.max(dim=-1)


def silu_mul(gate_up: Tensor, native: bool = False) -> Tensor | None:
    """``silu(gate) * up`` for ``gate_up`` [..., 2I] = [gate | up] as one op (ATen's bits for each
    row), or None where the op does not apply (the caller runs ATen's)."""
    if usable(native, gate_up):
        return torch.ops.leapfrog_ops.silu_mul(gate_up)
    return None
