"""Weight-only quantization of linear layers: ``quantization="int8" | "int4"`` (vLLM's name).

Decode and verification read every weight once per step for a handful of rows, so their cost is
the bytes of weight streamed; storing weights in 8 or 4 bits cuts those bytes 2-4x against bf16
(4-8x against fp32). Activations stay in the model's dtype; PyTorch's weight-only kernels
dequantize on the fly and accumulate in float32.

int8  per output channel, symmetric: w[n, k] ~= q[n, k] * s[n], q in [-127, 127],
      s[n] = max_k |w[n, k]| / 127.  Kernels: leapfrog's ``linear_int8`` on AVX2 / AVX-512 CPUs
      (model/native_linear.py; on a 2-vCPU AVX2 EPYC PyTorch's took 15x its time for an EAGLE
      head's linears), else ``aten._weight_int8pack_mm(x, q, s)``.
w8a8  the weights quantized as for int8 (per output channel), and each row of activations quantized on the fly
      to int8 (per row, symmetric: x[m, k] ~= p[m, k] * a[m], a[m] = max_k |x[m, k]| / 127, p
      rounded half to even); the int8 products summed exactly in int32, then
      y = float(sum) * (a[m] * s[n]) + bias. Kernel: leapfrog's ``linear_w8a8`` (model/native_linear.py):
      in its AVX-512 BF16 build on the AMX-INT8 tiles (Intel Xeon since Sapphire Rapids), else
      with AVX-512 VNNI (AMD Zen 4 and later, Intel Cooper Lake); in its AVX2 build with
      vpmaddubsw (AMD Zen 2/3, Intel since Haswell); the same bits every way; elsewhere a ConfigError.
      Rounding the activations too makes it coarser than int8 (for drafters: the built-in EAGLE-3
      head drafted 5.26 tokens a step against 5.30 in bf16), and with bf16 rows a step reads
      half the bytes and multiplies at the tiles' pace: the head's five linears, one row, 63 against
      178 us for the bf16 kernel (six rows 74 against 182, 16 rows 95 against 213); with VNNI on a
      2-vCPU AVX-512 EPYC 74 against 105 us (8 rows 174 against 206, 16 rows 268 against 365).
int4  per group of ``group_size`` input features, asymmetric (the tinygemm convention shared by
      PyTorch's CPU and CUDA int4 kernels): w[n, k] ~= (q[n, k] - 8) * s[g, n] + z[g, n] with
      g = k // group_size, q in [0, 15], s = (max - min) / 15, z = min + 8 s over the group.
      Kernels: ``aten._weight_int4pack_mm_for_cpu`` (CPU) and ``aten._weight_int4pack_mm``
      (CUDA, bf16 activations), on weights repacked once into the kernel's layout.

Quantization replaces the decoder layers' linears (q/k/v/o, gate/up/down). The embedding and,
for a target, the LM head stay in the model's dtype: logits are what verification compares, and
the head is read in float32 (model/llama.py ``LogitsHead``). A quantized model is a different
model: speculation is lossless relative to it (greedy output with speculation is the quantized
target's own greedy output), not relative to the unquantized checkpoint.

``reference_weight`` gives a layer's effective weight from the pure quantize/dequantize functions;
tests check every kernel against ``F.linear`` with it (tests/model/test_quant.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leapfrog.errors import ConfigError

QUANT_METHODS = ("int8", "int4", "w8a8")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels accept
INT4_GROUP_SIZE = 32                   # preferred (finer groups: closer to the float weights)
_INT4_INNER_K_TILES = 8                # CUDA packing parameter (K must divide by 16 * it)


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (q [N, K] int8, scale [N] float32): w ~= q * scale[:, None]."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (q [N, K] int32 in [0, 15], scale_zero [K / group_size, N, 2] float32)."""
    w = w.detach().float()
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)  # [N, G]
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    scale_zero = torch.stack([scale, lo + 8 * scale], dim=2).transpose(0, 1).contiguous()
    return q.view(n, k), scale_zero


def dequantize_int4(q: Tensor, scale_zero: Tensor, group_size: int) -> Tensor:
    """The weight an int4 layer computes with: (q - 8) * scale + zero per group. -> [N, K] float32."""
    n, k = q.shape
    sz = scale_zero.float().transpose(0, 1)  # [N, G, 2]
    w = (q.float().view(n, k // group_size, group_size) - 8) * sz[..., :1] + sz[..., 1:]
    return w.view(n, k)


class Int8Linear(nn.Module):
    """Weight-only int8 linear, one scale per output channel. Built from the float weight.

    On CPUs with AVX2 (or AVX-512 BF16) and a compiler it runs leapfrog's own op
    (``leapfrog_gemm.linear_int8``, model/native_linear.py: float32 sums of float32 rows times the
    int8 weights widened in registers, scaled per column at the end; row-invariant); elsewhere, or
    with ``LEAPFROG_NATIVE_LINEAR=0``, PyTorch's ``aten._weight_int8pack_mm``. Both compute with
    ``reference_weight("int8", w)``; they differ in float rounding only."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        from leapfrog.model.native_linear import native_int8_supported, pack_int8
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_int8(weight)  # [N, K] int8, [N]
        self.scale = scale.to(weight.dtype)  # the kernels compute with the scale in the weights' dtype
        self.native = native_int8_supported(weight.device)
        self.bias = None if bias is None else bias.detach().clone()
        if self.native:   # packed for the op; scale and bias once in float32 (the op adds the bias)
            self.qweight = pack_int8(q)            # [ceil(N/16), K, 16]
            self.scale_f32 = self.scale.float()
            self.bias_f32 = None if bias is None else self.bias.float()
        else:
            self.qweight = q

    def forward(self, x: Tensor) -> Tensor:
        if self.native:
            return torch.ops.leapfrog_gemm.linear_int8(x, self.qweight, self.scale_f32, self.bias_f32,
                                                       self.out_features)   # [.., N]
        rows = x.reshape(-1, self.in_features)  # [M, K]
        y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scale)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    @property
    def row_invariant(self) -> bool:
        """Whether a row's result is the same bits whatever other rows come with it (leapfrog's op
        is, by construction; PyTorch's kernel is not checked): batch-invariant mode needs it."""
        return self.native

    def weight_bytes(self) -> int:
        """Bytes of weight one forward streams: the int8 values and the scales the kernel reads
        (float32 for leapfrog's op, the weights' dtype for PyTorch's)."""
        scale = self.scale_f32 if self.native else self.scale
        return self.out_features * self.in_features + scale.numel() * scale.element_size()


class Int4Linear(nn.Module):
    """Weight-only int4 linear, asymmetric per group of input features (module docstring)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group_size: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size or int4_group_size(self.in_features)
        # the kernels take output features in multiples of 16: zero rows pad, the output is cut
        self.padded = -self.out_features % 16
        q, scale_zero = quantize_int4(F.pad(weight, (0, 0, 0, self.padded)), self.group_size)
        self.scale_zero = scale_zero.to(weight.dtype)  # [G, N, 2]
        if weight.is_cuda:  # two 4-bit values per byte, then the kernel's tiled layout
            packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()  # [N, K / 2]
            self.packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, _INT4_INNER_K_TILES)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if self.packed.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(rows, self.packed, self.group_size, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scale_zero)
        if self.padded:
            y = y[:, :self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)  # [.., N]


def reference_weight(method: str, weight: Tensor, group_size: int | None = None) -> Tensor:
    """The float32 weight a ``method`` layer built from ``weight`` computes with (the test oracle),
    scales rounded to the weight's dtype as the layer stores them."""
    if method == "int8":
        q, s = quantize_int8(weight)
        return q.float() * s.to(weight.dtype).float()[:, None]
    if method == "w8a8":   # (the weights' half; the rows' rounding: w8a8_reference)
        q, s = quantize_int8(weight)
        return q.float() * s[:, None]
    gs = group_size or int4_group_size(weight.shape[1])
    q, sz = quantize_int4(weight, gs)
    return dequantize_int4(q, sz.to(weight.dtype), gs)


class W8A8Linear(nn.Module):
    """int8 weights (per output channel, as Int8Linear) times rows quantized to int8 on the fly (per
    row): ``linear_w8a8`` on the AMX-INT8 tiles, with AVX-512 VNNI or with AVX2's vpmaddubsw (the kernel's
    module docstring). Row-invariant: a row's
    scale and its int32 sums depend on that row alone."""

    row_invariant = True

    def __init__(self, weight: Tensor, bias: Tensor | None, f32_out: bool = False) -> None:
        super().__init__()
        from leapfrog.model.native_linear import pack_w8a8, w8a8_supported
        if not w8a8_supported():
            raise RuntimeError("W8A8Linear needs leapfrog's native linear kernel (AVX2 or AVX-512 BF16; "
                               "check_quantization)")
        self.out_features, self.in_features = weight.shape
        q, self.scale = quantize_int8(weight)   # [N, K] int8, [N] float32
        self.packed = pack_w8a8(q)              # [ceil(N/32), K/4 rounded up to 16, 32, 4]
        self.bias = None if bias is None else bias.detach().float()
        #: float32 outputs for bf16 rows (not rounded to the rows' dtype)
        self.f32_out = f32_out
        self.stream = False   # (NativeLinear's attribute, read by the native drafting ops)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:   # (the packed K is padded to 64: the op cannot tell)
            raise RuntimeError(f"W8A8Linear: input has {x.shape[-1]} features, the weight {self.in_features}")
        return torch.ops.leapfrog_gemm.linear_w8a8(x, self.packed, self.scale, self.bias, self.out_features,
                                                   self.f32_out)

    def weight_bytes(self) -> int:
        """Bytes of weight one forward streams (the padded int8 blocks and the float32 scales)."""
        return self.packed.numel() + 4 * self.scale.numel()


def w8a8_reference(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None,
                   f32_out: bool = False) -> Tensor:
    """What ``linear_w8a8`` computes, in PyTorch (the test oracle): x [M, K] bf16/float32, q [N, K]
    int8, scale [N] float32 -> [M, N] (x's dtype, or float32 with ``f32_out``), the same bits (a row
    holding a NaN or an infinity: NaN outputs)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)                                         # [M, 1]
    inv = torch.full_like(amax, 127.0) / amax                                      # (true division)
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(inv)   # (a row under 127 / FLT_MAX: as zeros)
    p = torch.where(ok, torch.round(xf * inv).clamp(-127, 127), torch.zeros_like(xf))
    a = torch.where(ok, amax / 127.0, torch.where(torch.isfinite(amax), 0.0, float("nan")))
    sums = (p.double() @ q.double().T).float()                                     # exact, then rounded
    y = sums * (a * scale[None, :].float())
    if bias is not None:
        y = y + bias.float()
    return y if f32_out else y.to(x.dtype)


QUANT_LINEARS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear}


def int4_group_size(in_features: int) -> int:
    """The preferred int4 group size that divides ``in_features``."""
    for gs in sorted(INT4_GROUP_SIZES, key=lambda g: (g != INT4_GROUP_SIZE, g)):
        if in_features % gs == 0:
            return gs
    raise ConfigError(f"quantization='int4': a layer has {in_features} input features, which no int4 group "
                      f"size {list(INT4_GROUP_SIZES)} divides; use quantization='int8'")


def check_quantization(method: str | None, dtype: torch.dtype, device: torch.device,
                       what: str = "quantization") -> None:
    """ConfigError unless ``method`` (None = off) has working kernels for ``dtype`` on ``device``:
    runs the kernel once on a small product and compares it with the float reference."""
    if method is None:
        return
    if method not in QUANT_METHODS:
        raise ConfigError(f"{what}={method!r}: must be one of {list(QUANT_METHODS)} (or None)")
    if method == "w8a8":
        from leapfrog.model.native_linear import w8a8_supported
        if dtype not in (torch.bfloat16, torch.float32):
            raise ConfigError(f"{what}='w8a8' takes bfloat16 or float32 models, not {dtype}; use another dtype, "
                              "or 'int8'")
        if torch.device(device).type != "cpu" or not w8a8_supported():
            raise ConfigError(f"{what}='w8a8' (int8 weights and rows) runs on the CPU with leapfrog's native "
                              f"linear kernel (x86 CPUs with AVX2 and FMA, a C++ compiler, LEAPFROG_NATIVE_LINEAR "
                              f"not 0); {device} here has none of it: use 'int8' (weight-only)")
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 256, generator=g).to(dtype=dtype, device=device)
        x = torch.randn(3, 256, generator=g).to(dtype=dtype, device=device)
        ref = F.linear(x.float(), reference_weight(method, w))
        ok = torch.allclose(QUANT_LINEARS[method](w, None)(x).float(), ref, atol=0.5, rtol=0.05)
    except (RuntimeError, NotImplementedError) as e:
        raise ConfigError(f"{what}={method!r}: PyTorch {torch.__version__} has no working {method} weight-only "
                          f"kernel for {dtype} on {device} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "use another dtype, or no quantization") from None
    if not ok:
        raise ConfigError(f"{what}={method!r}: the {method} kernel gives wrong results for {dtype} on {device}; "
                          "use another dtype, or no quantization")


def check_batch_invariant_quantization(method: str | None, device: torch.device) -> None:
    """ConfigError unless ``method``'s kernels give each row bitwise the same result whatever else is
    in the batch (what ``batch_invariant=True`` promises for the target): leapfrog's int8 op does;
    PyTorch's int8 and int4 kernels pick their loops by the batch's shape and do not."""
    if method == "int4":
        raise ConfigError("batch_invariant=True with quantization='int4' is not supported yet (PyTorch's int4 "
                          "kernels are not row-invariant; int8 is, on CPUs where leapfrog's int8 op serves); "
                          "drop one of them")
    if method == "int8":
        from leapfrog.model.native_linear import native_int8_supported
        if not native_int8_supported(device):
            raise ConfigError("batch_invariant=True with quantization='int8' needs leapfrog's int8 op, whose rows "
                              "do not depend on the batch (x86 CPUs with AVX2 and a C++ compiler; "
                              "LEAPFROG_NATIVE_LINEAR unset); PyTorch's int8 kernel is not row-invariant; "
                              "drop one of them")


def quantize_linears(module: nn.Module, method: str) -> int:
    """Replace every nn.Linear under ``module`` by its ``method`` weight-only version. -> count."""
    from leapfrog.model.packed import replace_linears
    return replace_linears(module, QUANT_LINEARS[method])


def quantized_bytes(module: nn.Module) -> int:
    """Bytes of weight a forward streams through ``module``'s quantized linears."""
    total = 0
    for m in module.modules():
        if isinstance(m, (Int8Linear, W8A8Linear)):
            total += m.weight_bytes()
        elif isinstance(m, Int4Linear):
            total += m.packed.numel() * m.packed.element_size() + m.scale_zero.numel() * m.scale_zero.element_size()
    return total
