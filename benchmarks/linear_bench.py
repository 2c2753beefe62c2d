"""Weight streaming of few-row linears against this machine's memory bandwidth (issue 12, item 3).

Decode and verification multiply 1-16 rows by every weight of the model, so a step's linears
cost what reading their weights costs. This script streams the linears of a checkpoint's shapes
(its config.json: every decoder layer's qkv, o, gate_up and down, then the LM head; random bf16
weights) through each contender for M rows, over and over, so the weights come from memory as
they do in a step once the set is larger than the last-level cache. Contenders are interleaved
in a fresh random order every round (this machine's pace drifts), and each reports its median
GB/s and the median of its per-round time ratios against the first contender.

Contenders: leapfrog's bf16 kernel as the engine builds it (``NativeLinear``; on CPUs with
AMX-BF16 its bf16 rows run on the tile registers, and the same build without them, vdpbf16ps only,
is timed beside it unless ``--no-amx-variant``), its software prefetch variants (``--prefetch
HINT:BYTES``, each built under its own op namespace: about 20 s each, once; on AMX CPUs built
without the tiles, whose path prefetches nothing), and ``torch.nn.functional.linear`` in bf16
(oneDNN). References for the machine's limit: ``torch.sum`` over a 256 MB float32 tensor (a read) and a 64 MB copy (read + write).

    python benchmarks/linear_bench.py                              # built-in target, 1 and 6 rows
    python benchmarks/linear_bench.py --prefetch T0:1024 none:4096 --rounds 40
    python benchmarks/linear_bench.py --target PATH --rows 1 4 8 --out linear.json
    python benchmarks/linear_bench.py --dtype float32 --rows 1 5 --other OLD/leapfrog/model/native_linear.py

``--dtype float32`` feeds float32 rows (what a float32 model's linears get: on AVX2 CPUs
``dtype="auto"`` runs bf16 checkpoints in float32, and the kernel reads their weights as bf16).
``--other FILE`` builds another checkout's kernel (its ``native_linear.py``) for this CPU under its
own op namespace, packs the weights its way, and times it beside this one's, interleaved: the
A/B for a kernel change, where separate processes drift 10-30 % here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from leapfrog.demo import DEMO_DIR
from leapfrog.errors import LeapfrogError
from leapfrog.model import native_linear as nl
from leapfrog.model.args import LlamaArgs
from leapfrog.model.loader import read_checkpoint
from leapfrog.utils.cpp import load_inline


@dataclass
class Contender:
    name: str
    linear: Callable[[torch.Tensor, int], torch.Tensor]   # (rows [M, K], weight index) -> [M, N]


def linear_shapes(args: LlamaArgs, layers: int | None) -> list[tuple[int, int]]:
    """[(N, K)] of a checkpoint's linears: per layer qkv, o, gate_up, down; the LM head."""
    h, hd = args.hidden_size, args.head_dim
    layer = [((args.num_attention_heads + 2 * args.num_key_value_heads) * hd, h),
             (h, args.num_attention_heads * hd), (2 * args.intermediate_size, h), (h, args.intermediate_size)]
    return layer * (layers or args.num_hidden_layers) + [(args.vocab_size, h)]


def reference_bandwidth(reps: int = 10) -> dict[str, float]:
    """GB/s of torch.sum over 256 MB (read) and of a 64 MB copy (read + write bytes)."""
    big = torch.randn(64 << 20)
    src, dst = torch.randn(16 << 20), torch.empty(16 << 20)
    out = {}
    for name, fn, nbytes in (("torch.sum 256 MB (read)", big.sum, big.numel() * 4),
                             ("copy 64 MB (read + write)", lambda: dst.copy_(src), 2 * src.numel() * 4)):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


def other_kernel(path: str, weights: list[torch.Tensor]) -> tuple[Callable, list[torch.Tensor]]:
    """Another checkout's kernel for this CPU, built under op namespace leapfrog_gemm_other, and
    the weights packed in its block width. -> (op, packed weights)"""
    import importlib.util
    spec = importlib.util.spec_from_file_location("leapfrog_other_native_linear", path)
    if spec is None or not Path(path).is_file():
        sys.exit(f"--other {path}: not a file")
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    isa = nl.kernel_isa()
    source, flags = other.kernel_source(isa, namespace="leapfrog_gemm_other")
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]   # (stable across runs: the build is cached)
    load_inline(f"leapfrog_gemm_other_{digest}", source, flags)
    # its block width: BLOCK_COLUMNS per build, or (older checkouts) one BLOCK
    block = getattr(other, "BLOCK_COLUMNS", {}).get(isa) or getattr(other, "BLOCK", 32)
    return torch.ops.leapfrog_gemm_other.linear_bf16, [nl.pack_weight(w, block) for w in weights]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_DIR / "target"),
                    help="a checkpoint directory or hub id (its config.json)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers to stream (default: the config's)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--prefetch", nargs="*", default=[], metavar="HINT:BYTES",
                    help="kernel variants: software prefetch hint (T0, T1, T2, NTA, none) and distance in bytes")
    ap.add_argument("--no-onednn", action="store_true", help="leave out F.linear (oneDNN)")
    ap.add_argument("--no-amx-variant", action="store_true",
                    help="on an AMX CPU, leave out the same build without the AMX tiles (vdpbf16ps only)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the rows' dtype")
    ap.add_argument("--other", default=None, metavar="FILE",
                    help="another checkout's leapfrog/model/native_linear.py, timed beside this one")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=4, help="passes over all the weights per contender and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    if not nl.load_native_linear():
        sys.exit("leapfrog's bf16 linear kernel is not available on this CPU (needs AVX-512 BF16 or AVX2)")
    try:
        shapes = linear_shapes(read_checkpoint(args.target).args, args.layers)
    except LeapfrogError as e:
        sys.exit(f"--target {args.target}: {e}")
    gen = torch.Generator().manual_seed(args.seed)
    weights = [torch.randn(n, k, generator=gen).mul_(0.02).to(torch.bfloat16) for n, k in shapes]
    nbytes = sum(w.numel() * 2 for w in weights)
    native = [nl.NativeLinear(w, None) for w in weights]
    isa = nl.kernel_isa()
    default_bytes, default_hint = nl.PREFETCH[isa]
    amx = nl.amx_in_use()
    label = (f"{isa} + AMX build, the hardware's prefetch" if amx
             else f"{isa} build, prefetch {default_hint}, {default_bytes} B")
    # every kernel contender calls its op directly, as a compiled graph does (through the module,
    # the Python call alone cost the engine's kernel 5-8 % against the variants here)
    engine_op = torch.ops.leapfrog_gemm.linear_bf16
    contenders = [Contender(f"leapfrog kernel ({label})",
                            lambda x, i: engine_op(x, native[i].packed, None, shapes[i][0], False))]
    for j, spec in enumerate(args.prefetch):
        hint, _, dist = spec.partition(":")
        try:
            nbytes_ahead = int(dist or default_bytes)
            # (the AMX path prefetches nothing, whatever the hint: its variants are the build without it)
            op = nl.load_variant(nbytes_ahead, hint, f"leapfrog_gemm_bench{j}", amx=False)
        except ValueError as e:
            sys.exit(f"--prefetch {spec}: {e}")
        contenders.append(Contender(f"leapfrog kernel{', no AMX' if amx else ''}, prefetch {hint}, "
                                    f"{nbytes_ahead} B",
                                    lambda x, i, op=op: op(x, native[i].packed, None, shapes[i][0], False)))
    if amx and not args.no_amx_variant:   # the engine's build on a CPU without AMX
        op = nl.load_variant(default_bytes, default_hint, "leapfrog_gemm_noamx", amx=False)
        contenders.append(Contender(f"leapfrog kernel ({isa} build, no AMX)",
                                    lambda x, i, op=op: op(x, native[i].packed, None, shapes[i][0], False)))
    other = None
    if args.other:
        op, packed = other_kernel(args.other, weights)
        other = Contender(f"other kernel ({args.other})", lambda x, i: op(x, packed[i], None, shapes[i][0], False))
        contenders.append(other)
    dtype = getattr(torch, args.dtype)
    if not args.no_onednn:
        dense = weights if dtype == torch.bfloat16 else [w.float() for w in weights]
        contenders.append(Contender(f"F.linear {args.dtype} (oneDNN)", lambda x, i: F.linear(x, dense[i])))

    print(f"{len(shapes)} linears, {nbytes / 1e6:.1f} MB of bf16 weights, {args.dtype} rows, {args.threads} threads, "
          f"{nl.kernel_isa()} build", file=sys.stderr)
    if other is not None:   # the same bits from both kernels? (a kernel change that keeps each sum's order keeps them)
        same = all(torch.equal(contenders[0].linear(x, i), other.linear(x, i))
                   for m in args.rows for i, (_n, k) in enumerate(shapes)
                   for x in [torch.randn(m, k, generator=gen).to(dtype)])
        print(f"this kernel and --other give the same bits on every linear and row count: {same}")
    refs = reference_bandwidth()
    rng = random.Random(args.seed)
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        for rnd in range(args.rounds):
            for m in args.rows:
                xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for _, k in shapes}}
                order = contenders[:]
                rng.shuffle(order)
                for c in order:
                    for i in range(len(shapes)):   # one untimed pass: the first touch of this round
                        c.linear(xs[shapes[i][1]], i)
                    t = time.perf_counter()
                    for _ in range(args.reps):
                        for i in range(len(shapes)):
                            c.linear(xs[shapes[i][1]], i)
                    times.setdefault((m, c.name), []).append((time.perf_counter() - t) / args.reps)
            print(f"[linear] round {rnd + 1}/{args.rounds}", file=sys.stderr)

    rows = []
    print("\n| reference | GB/s |\n|---|---:|")
    for name, gbs in refs.items():
        print(f"| {name} | {gbs:.1f} |")
    print("\n| rows | contender | ms per pass | GB/s | time vs first (median of per-round ratios, q1-q3) |")
    print("|---:|---|---:|---:|---|")
    base = contenders[0].name
    for m in args.rows:
        for c in contenders:
            ts = times[(m, c.name)]
            ratios = sorted(a / b for a, b in zip(ts, times[(m, base)]))
            med = statistics.median(ts)
            q = (ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4])
            print(f"| {m} | {c.name} | {med * 1e3:.3f} | {nbytes / med / 1e9:.1f} | "
                  f"{statistics.median(ratios):.3f} ({q[0]:.3f}-{q[1]:.3f}) |")
            rows.append({"rows": m, "contender": c.name, "ms": med * 1e3, "gb_per_s": nbytes / med / 1e9,
                         "time_ratio_median": statistics.median(ratios), "time_ratio_q1_q3": q})
    if args.out:
        Path(args.out).write_text(json.dumps({"weights_mb": nbytes / 1e6, "threads": args.threads,
                                              "reference_gb_per_s": refs, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
