"""Time one speculation round's compiled graph (model/compiled.py CompiledEagleRound: K drafts by
an EAGLE head, the target's verification and acceptance) in isolation, greedy and sampled, at a
realistic context length: the graph-level view of what the engine's rounds cost, without the
drift of whole generate runs (the VM's pace moves 10-30 % between processes, and a graph change
of a few percent disappears in it).

``--other PATH``: also build the same rounds from another checkout's ``compiled.py`` (for example
``git worktree add /tmp/base main`` and ``--other /tmp/base/leapfrog/model/compiled.py``), on the
same models and caches, and time both in interleaved repetitions: per-repetition ratios this/other.

    python benchmarks/round_bench.py --reps 30
    python benchmarks/round_bench.py --other /tmp/base/leapfrog/model/compiled.py

``--k 5 6 7``: rounds of several chain depths over the same models and caches (the first K's from the
engine, the others built beside it), interleaved: the per-round cost curve t_round(K) / t_round(K0)
that, with the tokens per round each depth accepts (``fastpath_bench.py --eagle-depth``), decides the
depth: a deeper chain pays when its tokens per round grow by more than its round's cost.

    python benchmarks/round_bench.py --k 5 6 7 8

``--profile``: also split the greedy round's time by op (torch.profiler, op self time per round): each
linear by its weight (named from the target and the head; one packed shape can be several layers'), the
attention op, and the rest (inductor's fused kernels and the wrapper) as the round's wall time minus
the ops'. It says where a round goes: weights streamed by the target, weights the head reads from cache,
or the small kernels between them.

    python benchmarks/round_bench.py --profile

Every contender runs the round with the same inputs each time (one sequence whose newest token is at
``--col``; zero tokens and features: the arithmetic does not depend on the values). Sampled rounds
verify by rejection sampling (an unseeded request: ``reject``) or by the race (a seeded one).
Medians of ``--reps`` repetitions of ``--calls`` calls each.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from leapfrog import LLM
from leapfrog.demo import DEMO_DIR
from leapfrog.model.compiled import Bucket, CompiledEagleRound


def load_other(path: str):
    """Another checkout's model/compiled.py as its own module (the rest of the package is this one's)."""
    spec = importlib.util.spec_from_file_location("other_compiled", path)
    if spec is None or spec.loader is None:
        sys.exit(f"round_bench: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["other_compiled"] = mod   # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def race_inputs(g, start, temperature: float, reject: bool, exponentials: bool) -> tuple:
    """A sampled round's six race inputs for one sequence. ``exponentials``: the graph takes E = -log U
    (this checkout); else the uniforms U (checkouts before the race's logarithms moved to the host)."""
    P, V = g.positions, g.model.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    if reject:   # (no row races: the unread value)
        noise = torch.ones(1, P, V, dtype=torch.float64) if exponentials else \
            torch.full((1, P, V), 0.36787944117144233, dtype=torch.float64)
    else:
        u = torch.rand(1, P, V, dtype=torch.float64, generator=gen).clamp_(min=1e-300)
        noise = -torch.log(u) if exponentials else u
    w = torch.rand(1, P, 3, dtype=torch.float64, generator=gen)
    return (torch.full((1,), temperature), torch.ones(1, dtype=torch.bool), noise, (start + g.k + 1).clone(),
            torch.tensor([reject]), w)


def rounds_of(cls, g, k: int, positions: int, batch: int) -> tuple:
    """Greedy and sampled rounds of ``cls`` (a CompiledEagleRound) with K = ``k`` over the models and
    caches of the engine's rounds ``g``, warmed for ``batch`` sequences."""
    greedy = cls(g.model, g.kv, g.draft.model, g.draft.kv, [Bucket(batch, k + 1)], k)
    sampled = cls(g.model, g.kv, g.draft.model, g.draft.kv, [Bucket(batch, k + 1)], k, positions)
    greedy.warm_up(False)
    sampled.warm_up(False)
    return greedy, sampled


def weight_names(g) -> dict[tuple[int, ...], list[str]]:
    """The packed weight shapes of the round's linears (leapfrog's ops) -> the layers that have them."""
    names: dict[tuple[int, ...], list[str]] = {}
    for owner, model in (("target", g.model), ("head", g.draft.model)):
        for name, m in model.named_modules():
            w = getattr(m, "packed", getattr(m, "qweight", None))   # (bf16 kernel's, int8 op's)
            if isinstance(w, torch.Tensor) and w.dim() >= 3:
                entry = owner + " " + ".".join(p for p in name.split(".") if not p.isdigit())
                layers = names.setdefault(tuple(w.shape), [])
                if entry not in layers:
                    layers.append(entry)
    return names


def print_profile(g, call_args: tuple, calls: int) -> None:
    """The greedy round's op self times per round (``--profile``), linears by weight and row count,
    against the wall time of as many greedy rounds back to back, unprofiled."""
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(calls):
            g._serve(call_args)
        round_us = (time.perf_counter() - t0) / calls * 1e6
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(calls):
                g._serve(call_args)
    names = weight_names(g)
    rows, ops_us = [], 0.0
    for e in prof.key_averages(group_by_input_shape=True):
        us = e.self_cpu_time_total / calls
        if not e.key.startswith(("leapfrog_gemm::", "leapfrog_native::")):
            continue
        ops_us += us
        shapes = e.input_shapes
        what = f"queries {shapes[0]}" if "attention" in e.key else \
            " / ".join(names.get(tuple(shapes[1]), ["?"])) + f", {shapes[0][:-1]} rows"
        rows.append((us, e.key.split("::")[1], what, e.count / calls))
    print(f"\nwhere the greedy round goes ({calls} rounds back to back: {round_us:.0f} us per round unprofiled):")
    print("| op | weight, rows | calls per round | us per round | share |")
    print("|---|---|---:|---:|---:|")
    for us, op, what, n in sorted(rows, reverse=True):
        print(f"| {op} | {what} | {n:.0f} | {us:.0f} | {us / round_us:.0%} |")
    rest = max(round_us - ops_us, 0.0)
    print(f"| rest | inductor's fused kernels, the wrapper, the host | | {rest:.0f} | {rest / round_us:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--head", default=str(DEMO_DIR / "eagle3"), help="an EAGLE-3 head")
    ap.add_argument("--k", type=int, nargs="+", default=[5],
                    help="drafts per round (the chain's depth); several: each depth's rounds, interleaved")
    ap.add_argument("--col", type=int, default=120, help="the newest token's column (context length)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--other", default=None, metavar="COMPILED_PY", help="another checkout's model/compiled.py")
    ap.add_argument("--profile", action="store_true", help="split the greedy round's time by op and weight")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.other and len(args.k) > 1:
        ap.error("--other compares one depth: give one --k")
    k0 = args.k[0]
    llm = LLM(model=args.target, dtype="auto", enforce_eager=False, num_scheduler_steps=2, max_num_seqs=1,
              max_model_len=max(256, args.col + 4 * (max(args.k) + 1)),
              speculative_config={"method": "eagle3", "model": args.head, "num_speculative_tokens": k0,
                                  "eagle_topk": 1})
    runner = llm.engine.runner
    g, gs = runner.round, runner.sampled_round
    if g is None or gs is None:
        sys.exit("round_bench: no speculation rounds were compiled (the fast path needs AVX-512 or CUDA here?)")
    b = g.warmed[0]
    dev = g.kv.k[0].device
    builds = {"this" if len(args.k) == 1 else f"K={k0}": (g, gs, True)}
    if args.other:
        mod = load_other(args.other)
        og, ogs = rounds_of(mod.CompiledEagleRound, g, k0, gs.positions, b.batch)
        builds["other"] = (og, ogs, hasattr(ogs, "_unread_e"))
    for k in args.k[1:]:   # (the race's positions: the engine's rounds per step x K + 1)
        builds[f"K={k}"] = (*rounds_of(CompiledEagleRound, g, k, gs.positions // (k0 + 1) * (k + 1), b.batch), True)
    cases = {}
    for name, (greedy, sampled, exponentials) in builds.items():
        args_k = greedy._warm_args(greedy.warmed[0], args.col, dev, g.kv.scratch_row)   # tokens .. rows
        cases[f"greedy, {name}"] = (greedy, args_k)
        for kind, reject in (("rejection", True), ("race", False)):
            cases[f"sampled {kind}, {name}"] = (sampled, (*args_k, *race_inputs(sampled, args_k[3], args.temperature,
                                                                                reject, exponentials)))
    times: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for graph, call_args in cases.values():
            for _ in range(args.calls):
                graph._serve(call_args)
        for _ in range(args.reps):
            for name, (graph, call_args) in cases.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    graph._serve(call_args)
                times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    print(f"one round (K={' '.join(map(str, args.k))}, column {args.col}, {args.threads} threads, {g.model.dtype}); "
          f"medians of {args.reps} x {args.calls} calls:")
    print("| round | us per round | vs greedy |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        ref = statistics.median(times["greedy, " + name.split(", ")[-1]])
        print(f"| {name} | {statistics.median(ts):.0f} | {statistics.median(ts) / ref:.2f}x |")
    if len(args.k) > 1:
        print(f"\nthe round's cost against K={k0}'s, per repetition (median [min, max]):")
        for k in args.k[1:]:
            for kind in ("greedy", "sampled rejection", "sampled race"):
                rs = [x / y for x, y in zip(times[f"{kind}, K={k}"], times[f"{kind}, K={k0}"])]
                print(f"  K={k}, {kind}: {statistics.median(rs):.3f} [{min(rs):.3f}, {max(rs):.3f}]")
    if args.profile:
        print_profile(g, cases[next(iter(cases))][1], args.reps * args.calls)
    if args.other:
        print("\nthis / other, per repetition (median [min, max]):")
        for kind in ("greedy", "sampled rejection", "sampled race"):
            rs = [a / b for a, b in zip(times[f"{kind}, this"], times[f"{kind}, other"])]
            print(f"  {kind}: {statistics.median(rs):.3f} [{min(rs):.3f}, {max(rs):.3f}]")


if __name__ == "__main__":
    main()
