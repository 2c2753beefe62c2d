"""The CPU attention op on ragged batches, side by side in one run (attention/native.py).

A batch's ``kv_len`` is its longest sequence's. Each work item (sequence, KV head) reads its
sequence's columns only up to its own last visible one, so a ragged batch (one long prompt among
short ones under continuous batching, drafts accepted unevenly) costs about the sum of its rows'
own lengths, not batch size x the longest. Contenders, each the op alone on the built-in target's
attention shape (bf16, 8 heads x 64, the cache 2048 columns wide), timed in interleaved rounds:

- ``uniform-short``: every row at the short length,
- ``ragged``: every row short but one at the long length (kv_len the long one),
- ``uniform-long``: every row at the long length (what ``ragged`` cost when every row read up to
  kv_len).

Reported: microseconds per call (median over rounds) and each one's ratio to ``uniform-long``.
Measured (2-vCPU AMX Xeon, batch 16, 64 and 400 columns): 60 / 111 / 430 us (0.14 / 0.26 / 1.00);
in a run of the op before rows read only their own columns, 87 / 515 / 526 us. End to end (none,
batch 8, continuous batching of 4 prompts of 1024 tokens among 28 of 64, 128 tokens each): 2.0 s
against 2.6-2.9 s before.

    python benchmarks/attention_bench.py [--batch 16] [--short 64] [--long 400] [--rounds 5]

``--prefetch-ab``: the op (its software prefetch of the next column block) against a build
without it, interleaved, on ``--tokens`` queries a sequence over ``--long`` columns, each call on
the next of ``--layers`` caches (a model's layers: the caches leave the CPU's private caches, as
in a forward). Measured (2-vCPU AMX Xeon, bf16, batch 1, 12 layers, three runs): 8 tokens over
1900 columns 365-381 us a layer against 429-517 without (a verification of 7 drafts at a long
context); one token 109-116 against 128-133; 8 tokens over 500 columns 101-107 against 108-111.

    python benchmarks/attention_bench.py --prefetch-ab --batch 1 --tokens 8 --long 1900 --layers 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leapfrog.attention.native import load_native_attention, load_variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--long", type=int, default=400)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=200, help="calls per contender and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefetch-ab", action="store_true",
                    help="the op against a build without its software prefetch, on --tokens queries over --long columns")
    ap.add_argument("--tokens", type=int, default=1, help="--prefetch-ab: queries a sequence (drafts + 1)")
    ap.add_argument("--layers", type=int, default=12, help="--prefetch-ab: caches called in turn (a model's layers)")
    args = ap.parse_args()
    if not args.short <= args.long <= args.max_len:
        raise SystemExit("need --short <= --long <= --max-len")
    torch.set_num_threads(args.threads)
    if not load_native_attention():
        raise SystemExit("the native attention op did not build (no C++ compiler?)")
    op = torch.ops.leapfrog_native.cached_attention
    if args.prefetch_ab:
        prefetch_ab(args, op)
        return
    B, dt = args.batch, torch.bfloat16
    caches = [torch.randn(B + 1, args.kv_heads, args.max_len, args.head_dim).to(dt) for _ in range(2)]
    q = torch.randn(B, 1, args.heads, args.head_dim).to(dt)
    k, v = (torch.randn(B, 1, args.kv_heads, args.head_dim).to(dt) for _ in range(2))
    rows = torch.arange(B)

    def inputs(lengths: list[int]) -> tuple:
        mask = torch.zeros(B, 1, 1, args.max_len, dtype=torch.bool)
        for b, n in enumerate(lengths):
            mask[b, 0, 0, :n] = True
        return rows, rows, torch.tensor([n - 1 for n in lengths]), mask, torch.tensor(max(lengths))

    contenders = {"uniform-short": inputs([args.short] * B),
                  "ragged": inputs([args.short] * (B - 1) + [args.long]),
                  "uniform-long": inputs([args.long] * B)}
    times = interleaved({name: (lambda i, meta=meta: op(q, k, v, *caches, *meta)) for name, meta in contenders.items()},
                        args.rounds, args.calls)
    report(times, "uniform-long", f"batch {B}, short {args.short}, long {args.long} columns, {args.heads} heads x "
           f"{args.head_dim}, bf16, {args.threads} threads")


def interleaved(contenders: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """Microseconds per call of each contender (name -> f(i), i the call's index), per round:
    ``rounds`` rounds after a warm-up one, the contenders' order reversed every other round."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds + 1):
        for name, f in (contenders.items() if r % 2 else reversed(contenders.items())):
            for i in range(10):
                f(i)
            t0 = time.perf_counter()
            for i in range(calls):
                f(i)
            if r:   # (round 0 warms up)
                times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return times


def report(times: dict[str, list[float]], ref_name: str, header: str) -> None:
    """Each contender's median microseconds per call (one layer) and its ratio to ``ref_name``'s."""
    ref = statistics.median(times[ref_name])
    print(header)
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:14s} {med:8.1f} us   {med / ref:5.2f}x {ref_name}")


def prefetch_ab(args: argparse.Namespace, op) -> None:
    """--prefetch-ab: the engine's op and the build without the prefetch, interleaved."""
    variant = load_variant(prefetch=False, namespace="leapfrog_attn_bench")
    B, S, n, dt = args.batch, args.tokens, args.long, torch.bfloat16
    if n < S:
        raise SystemExit("need --long >= --tokens")
    layers = [[torch.randn(B + 1, args.kv_heads, args.max_len, args.head_dim).to(dt) for _ in range(2)]
              for _ in range(args.layers)]
    q = torch.randn(B, S, args.heads, args.head_dim).to(dt)
    k, v = (torch.randn(B, S, args.kv_heads, args.head_dim).to(dt) for _ in range(2))
    mask = torch.zeros(B, 1, S, args.max_len, dtype=torch.bool)
    for s in range(S):   # token s sees the columns up to its own (a chain's causal mask)
        mask[:, 0, s, :n - S + 1 + s] = True
    rows = torch.arange(B)
    cols = torch.tensor([n - S + s for _ in range(B) for s in range(S)])
    meta = (rows, rows.repeat_interleave(S), cols, mask, torch.tensor(n))
    times = interleaved({name: (lambda i, f=f: f(q, k, v, *layers[i % args.layers], *meta))
                         for name, f in (("prefetch", op), ("no-prefetch", variant))}, args.rounds, args.calls)
    report(times, "no-prefetch", f"batch {B}, {S} tokens over {n} columns, {args.heads} heads x {args.head_dim}, "
           f"bf16, {args.layers} layers' caches in turn, {args.threads} threads")


if __name__ == "__main__":
    main()
