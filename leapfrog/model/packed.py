"""oneDNN-packed linear layers for CPU inference.

``F.linear`` on CPU goes to MKL's GEMM, which is poor for the few-row products that decode
and speculative verification are made of. oneDNN with the weight reordered once into its
blocked layout (what torch.compile's CPU backend does) is 1.5-4x faster for 1-16 rows on the
machines we measured (benchmarks/decode_bench.py prints the verify-cost curve), and equal for
long prefills. Packing needs oneDNN support for the dtype (fp32 always; bf16 only on CPUs with
AVX-512 or AVX-NE-CONVERT); anything else keeps ``nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_BATCH_HINT = 16  # layout tuned for verify-sized products; any row count works


class PackedLinear(nn.Module):
    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 8, dtype=dtype)
        x = torch.randn(2, 8, dtype=dtype)
        y = PackedLinear(w, None)(x)
        return bool(torch.allclose(y.float(), (x.float() @ w.float().t()), atol=1e-2, rtol=1e-2))
    except RuntimeError:
        return False


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under ``module`` by a PackedLinear (inference only). -> count."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            n += 1
        else:
            n += pack_linears(child)
    return n
