"""oneDNN-packed linear layers for CPU inference, and row tiling for batch invariance.

``F.linear`` on CPU goes to MKL's GEMM, which is poor for the few-row products that decode
and speculative verification are made of. oneDNN with the weight reordered once into its
blocked layout (what torch.compile's CPU backend does) is 1.5-4x faster for 1-16 rows on the
machines we measured (benchmarks/decode_bench.py prints the verify-cost curve), and equal for
long prefills. Packing needs oneDNN support for the dtype (fp32 always; bf16 only on CPUs with
AVX-512 or AVX-NE-CONVERT); anything else keeps ``nn.Linear``.

Batch invariance (``RowTiled``): a GEMM kernel picks its blocking from the shape, so the same
row can come out with different rounding when it is multiplied alone or among M rows
(measured here: bf16 and fp32 with 1408 input features take another kernel for 1 row than
for 2-64 rows). ``RowTiled`` cuts the rows into tiles of ``min_rows..max_rows`` rows (a
shorter last tile is padded with zero rows up to ``min_rows``) where the pair was chosen for
this shape by an empirical self-check: every tile size in the range must give each row
bitwise what the ``min_rows`` call gives. The kernel choice is a deterministic function of
(shape, dtype, thread count), not of the values, so a check on synthetic data of the same
shape holds for the real weights; the data are built so that any change of summation order
shows even after rounding to bf16 (products that cancel in pairs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_BATCH_HINT = 16  # layout tuned for verify-sized products; any row count works
_CHECK_MAX_ROWS = 32  # largest tile the self-check tries
_CHECK_ROWS = 64  # rows of synthetic input per check


class PackedLinear(nn.Module):
    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN packs and runs linears of this dtype here (tried once per dtype and device)."""
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
    """Replace every nn.Linear under ``module`` by its ``inference_linear`` (inference only). -> count."""
    return replace_linears(module, inference_linear)


def inference_linear(weight: Tensor, bias: Tensor | None) -> nn.Module:
    """The fastest inference linear we have for this weight on CPU: the bf16 few-row kernel
    (model/native_linear.py; AVX-512 BF16 or AVX2, row-invariant) where it serves, else oneDNN-packed
    where oneDNN takes the dtype, else a plain linear."""
    from leapfrog.model.native_linear import NativeLinear
    if NativeLinear.fits(weight):
        return NativeLinear(weight, bias)
    return PackedLinear(weight, bias) if can_pack(weight.dtype, weight.device) else linear_like(weight, bias)


def native_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under ``module`` by its ``graph_linear`` (inference only). -> count."""
    return replace_linears(module, graph_linear)


def graph_linear(weight: Tensor, bias: Tensor | None) -> nn.Module:
    """A linear for compiled graphs: the bf16 few-row kernel where it serves (an op in the graphs,
    run eagerly for prefill), else a plain nn.Linear over the same tensors for inductor to prepack."""
    from leapfrog.model.native_linear import NativeLinear
    return NativeLinear(weight, bias) if NativeLinear.fits(weight) else linear_like(weight, bias)


def replace_linears(module: nn.Module, make: Callable[[Tensor, Tensor | None], nn.Module]) -> int:
    """Replace every nn.Linear under ``module`` by ``make(weight, bias)``. -> count."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child.weight, child.bias))
            n += 1
        else:
            n += replace_linears(child, make)
    return n


# ---------------------------------------------------------------------------- batch invariance

class RowTiled(nn.Module):
    """``inner`` applied to the rows of x in tiles whose sizes all give bitwise the same row
    results (see the module docstring), so a row's output does not depend on how many other
    rows came with it.

    Worked example (min_rows 2, max_rows 32, 70 rows): tiles [0:32], [32:64], [64:70]; a
    single row r is run as [r, 0] and row 0 of the result kept.
    """

    def __init__(self, inner: nn.Module, same_kind: Callable[[Tensor, Tensor | None], nn.Module]) -> None:
        super().__init__()
        self.inner = inner
        self._same_kind = same_kind
        self._key = _shape_key(inner)
        self._threads = -1
        self.min_rows = self.max_rows = 1
        self._refresh()

    def _refresh(self) -> None:
        # Kernels are chosen per thread count too: re-check when it changed (memoized per shape).
        self._threads = torch.get_num_threads()
        self.min_rows, self.max_rows = row_tile(self._same_kind, *self._key)

    def forward(self, x: Tensor) -> Tensor:
        if torch.get_num_threads() != self._threads:
            self._refresh()
        rows = x.reshape(-1, x.shape[-1])
        n, lo, hi = rows.shape[0], self.min_rows, self.max_rows
        if lo <= n <= hi:  # one tile (decode, verify): no copies
            y = self.inner(rows)
        elif n < lo:
            y = self.inner(F.pad(rows, (0, 0, 0, lo - n)))[:n]
        else:
            y = torch.cat([self.forward(rows[s:s + hi]) for s in range(0, n, hi)])
        return y.view(*x.shape[:-1], y.shape[-1])


_TILES: dict[tuple, tuple[int, int]] = {}  # memo of row_tile: a pure function of its key


def _shape_key(m: nn.Module) -> tuple:
    """What the kernel choice depends on, besides the thread count: kind, shape, dtype, device."""
    w = m.packed if isinstance(m, PackedLinear) else m.weight
    return (type(m).__name__, m.out_features, m.in_features, w.dtype, str(w.device), m.bias is not None)


def row_tile(same_kind: Callable[[Tensor, Tensor | None], nn.Module], kind: str, n_out: int,
             n_in: int, dtype: torch.dtype, device: str, has_bias: bool) -> tuple[int, int]:
    """(min_rows, max_rows) for a linear of this shape: every tile size in the range gives each
    row bitwise what a ``min_rows``-row call gives. Tries min_rows 1, 2, 4, 8 and keeps the
    widest range per padded row; (1, 1) (one row per call) always qualifies."""
    key = (kind, n_out, n_in, dtype, device, has_bias, torch.get_num_threads())
    if key not in _TILES:
        g = torch.Generator().manual_seed(0)
        w, x = _cancelling_data(n_out, n_in, _CHECK_ROWS, g)
        b = torch.randn(n_out, generator=g) if has_bias else None
        lin = same_kind(w.to(dtype=dtype, device=device), None if b is None else b.to(dtype=dtype, device=device))
        x = x.to(dtype=dtype, device=device)
        best = (1, 1)
        with torch.inference_mode():
            for m0 in (1, 2, 4, 8):
                hi = _largest_tile(lin, x, m0)
                if hi >= m0 and hi / m0 > best[1] / best[0]:
                    best = (m0, hi)
                if best[1] == _CHECK_MAX_ROWS:
                    break
        _TILES[key] = best
    return _TILES[key]


def _cancelling_data(n_out: int, n_in: int, rows: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Weights [n_out, n_in] and inputs [rows, n_in] whose products cancel in pairs (column
    j + h repeats column j's input against almost its negated weight): the exact dot product
    is small while partial sums are large, so any change of summation order changes the result
    by far more than an ulp of it."""
    h = n_in // 2
    w = torch.randn(n_out, n_in, generator=g) * 256
    w[:, h:2 * h] = -w[:, :h] + torch.randn(n_out, h, generator=g)
    x = torch.randn(rows, n_in, generator=g)
    x[:, h:2 * h] = x[:, :h]
    return w, x


def _largest_tile(lin: nn.Module, x: Tensor, m0: int) -> int:
    """Largest T <= _CHECK_MAX_ROWS such that every tile of m0..T rows gives each row what an
    m0-row call (the row, then zero rows) gives; m0 - 1 if even m0 rows are not consistent."""
    pad = x.new_zeros(m0 - 1, x.shape[1])
    ref = torch.cat([lin(torch.cat([x[i:i + 1], pad]))[:1] for i in range(x.shape[0])])
    for n in range(1, m0):  # a short tile padded to m0 rows (rows at positions 0..n-1)
        if not torch.equal(lin(torch.cat([x[:n], x.new_zeros(m0 - n, x.shape[1])]))[:n], ref[:n]):
            return m0 - 1
    for size in range(m0, _CHECK_MAX_ROWS + 1):
        for s in range(0, x.shape[0] - size + 1, size):
            if not torch.equal(lin(x[s:s + size]), ref[s:s + size]):
                return size - 1
    return _CHECK_MAX_ROWS


def linear_like(weight: Tensor, bias: Tensor | None) -> nn.Module:
    """An nn.Linear over these tensors (shared, not copied)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return lin


def tile_linears(module: nn.Module) -> int:
    """Wrap every PackedLinear / nn.Linear under ``module`` in a RowTiled (batch-invariant
    inference). -> count."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, (PackedLinear, nn.Linear)):
            setattr(module, name, row_tiled(child))
            n += 1
        elif not isinstance(child, RowTiled):
            n += tile_linears(child)
    return n


def row_tiled(m: nn.Module) -> RowTiled:
    """m: a PackedLinear, an nn.Linear, or any linear module built as ``type(m)(weight, bias)``
    with ``weight``, ``bias``, ``in_features`` and ``out_features`` attributes."""
    return RowTiled(m, linear_like if isinstance(m, nn.Linear) else type(m))
