"""The compiled fast path against eager forwards, side by side in one run (issue: cut the cost of a step).

Contenders, each one LLM loaded once and run in interleaved rounds (A B C D A B C D ...), batch 1
(``--batch-size B``: the prompts decoded B at a time, max_num_seqs B), greedy (or sampled:
``--temperature``, ``--request-seed``), on the demo's held-out standard-library code: no
speculation, draft_model K=4 (the demo draft), the built-in EAGLE-3 head drafting greedy
chains of 5 and dynamic trees (``--trees``, default depth 5, top 4, 16 nodes), each eager
(``enforce_eager=True``) and compiled (``enforce_eager=False``: drafts are fused chain and tree
graphs), and compiled no speculation, draft_model and the eagle3 chain with ``--steps`` decode
steps (speculation rounds) per engine step (multi-step decode, ``num_scheduler_steps``; default 8,
1: no such contenders). ``--head-too HEAD ...`` runs other EAGLE-3 heads' contenders beside the
built-in one's, ``--eagle-depth 5 6`` chains of several lengths.
Per contender: median tokens/s over rounds, the median of per-round ratios
to eager no-speculation, on how many prompts its output (greedy, or seeded) equals eager
no-speculation's and that of no speculation on the same path (bf16 compiled and eager graphs round
differently), and its start-up time (compiling
included). Then the
verify-cost curve of the target, t(S)/t(1) for one forward step over S new tokens at context 128,
eager and compiled (compiled: S = 2..K+1 all run in the K+1 bucket). "outside graphs": the share of
decode time not spent inside compiled graphs (the engine, drafting glue, eager forwards: 100 % when eager; the issue's
goal for the step's time outside the model forward is 5 %).

    python benchmarks/fastpath_bench.py [--num-prompts 8] [--max-tokens 96] [--rounds 3] [--out fastpath.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from unittest.mock import patch

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import DEMO_DIR
from leapfrog.model.loader import load_tokenizer
from leapfrog.model.runner import SeqChunk
from leapfrog.train.distill import heldout_prompts


@dataclass(frozen=True)
class Contender:
    base: str                   # its name without the head's tag (what --only matches)
    spec: dict | None           # speculative_config (None: no speculation)
    eager: bool                 # enforce_eager
    steps: int = 1              # num_scheduler_steps
    tag: str = ""               # ", head N" for the N-th EAGLE-3 head (N >= 2), else ""

    @property
    def name(self) -> str:
        return self.base + self.tag


def contenders(draft: str, k: int, heads: Sequence[str], depths: Sequence[int],
               trees: Sequence[tuple[int, int, int]] = ((5, 4, 16),), steps: int = 1) -> list[Contender]:
    """heads: EAGLE-3 heads (the contenders of the second and later ones are tagged ", head N",
    N their place from 2); depths: their greedy chains' lengths; trees: EAGLE-3 dynamic trees as
    (depth, topk, nodes) (eager and compiled contenders each); steps > 1: also compiled none,
    draft_model and the eagle3 chains with that many decode steps (speculation rounds) per engine
    step (num_scheduler_steps)."""
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    out = [Contender("none eager", None, True), Contender("none compiled", None, False)]
    if steps > 1:
        out.append(Contender(f"none compiled {steps} steps", None, False, steps))
    out += [Contender(f"draft_model K={k} eager", spec, True), Contender(f"draft_model K={k} compiled", spec, False)]
    if steps > 1:
        out.append(Contender(f"draft_model K={k} compiled {steps} steps", spec, False, steps))
    for i, head in enumerate(heads):
        tag = f", head {i + 1}" if i else ""
        for depth in depths:
            eagle = {"method": "eagle3", "model": head, "num_speculative_tokens": depth, "eagle_topk": 1}
            out += [Contender(f"eagle3 chain {depth} eager", eagle, True, tag=tag),
                    Contender(f"eagle3 chain {depth} compiled", eagle, False, tag=tag)]
            if steps > 1:
                out.append(Contender(f"eagle3 chain {depth} compiled {steps} steps", eagle, False, steps, tag))
        for d, topk, n in trees:
            tree = {"method": "eagle3", "model": head, "num_speculative_tokens": d, "eagle_topk": topk,
                    "num_draft_tokens": n}
            name = f"eagle3 tree {d}x{topk}/{n}"
            out += [Contender(f"{name} eager", tree, True, tag=tag),
                    Contender(f"{name} compiled", tree, False, tag=tag)]
    return out


def with_draft_variants(kept: Sequence[Contender], variants: Sequence[tuple[str, str]]) -> list[Contender]:
    """Each contender, then (for speculative ones) a copy per ``variants`` entry (key, value) with
    that speculative_config setting, e.g. ("draft_dtype", "bfloat16") or ("draft_quantization",
    "int8") (tagged ", draft VALUE"), side by side in each round.

    >>> [c.name for c in with_draft_variants([Contender("none compiled", None, False),
    ...     Contender("eagle3 chain 5 compiled", {"method": "eagle3"}, False)],
    ...     [("draft_dtype", "bfloat16"), ("draft_quantization", "int8")])]
    ['none compiled', 'eagle3 chain 5 compiled', 'eagle3 chain 5 compiled, draft bfloat16', 'eagle3 chain 5 compiled, draft int8']
    """
    out = []
    for c in kept:
        out.append(c)
        if c.spec is not None:
            out += [replace(c, spec={**c.spec, key: v}, tag=f"{c.tag}, draft {v}") for key, v in variants]
    return out


def tree_arg(text: str) -> tuple[int, int, int]:
    """"DEPTHxTOPKxNODES" -> (depth, topk, nodes); argparse shows the error for anything else."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected DEPTHxTOPKxNODES with positive integers, e.g. 5x4x16, got {text!r}")
    d, topk, n = (int(p) for p in parts)
    return d, topk, n


def graph_seconds(llm: LLM) -> float:
    """Seconds the LLM's target and drafter spent inside compiled graphs so far."""
    runners = [llm.engine.runner, getattr(llm.engine.proposer, "runner", None)]
    return sum(r.graph_seconds() for r in runners if r is not None)


def run_once(llm: LLM, prompts: list[str], max_tokens: int, temperature: float = 0.0,
             request_seed: int | None = None, batch_size: int = 1) -> tuple[float, list[list[int]], float]:
    """-> tokens/s, the outputs, and the share of decode time spent outside compiled graphs
    (engine work, drafting glue, eager forwards; 1.0 when eager). ``request_seed``: prompt i's
    request is seeded with request_seed + i (its output then depends on nothing but the target).
    ``batch_size``: the prompts go in groups of that many, one generate call each (the LLM's
    max_num_seqs)."""
    n, outs, t, decode = 0, [], 0.0, 0.0
    g0 = graph_seconds(llm)
    for i in range(0, len(prompts), batch_size):
        group = prompts[i:i + batch_size]
        sps = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                              seed=None if request_seed is None else request_seed + i + j) for j in range(len(group))]
        t0 = time.perf_counter()
        rs = llm.generate(group, sps, use_tqdm=False)
        t += time.perf_counter() - t0
        # the first tokens come from the (eager) prefills
        decode += max(r.metrics.finished_time for r in rs) - min(r.metrics.first_token_time for r in rs)
        for r in rs:
            n += len(r.outputs[0].token_ids)
            outs.append(list(r.outputs[0].token_ids))
    return n / t, outs, 1.0 - (graph_seconds(llm) - g0) / max(decode, 1e-9)


NO_KERNEL = ", no bf16 kernel"   # the name suffix of a contender loaded with the linear kernel off


def env_variants(no_kernel: bool, env_too: Sequence[str]) -> list[tuple[str, dict[str, str]]]:
    """The load-time variants every contender runs in: (name suffix, environment at load); the
    first is as the environment is."""
    out: list[tuple[str, dict[str, str]]] = [("", {})]
    if no_kernel:
        out.append((NO_KERNEL, {"LEAPFROG_NATIVE_LINEAR": "0"}))
    for item in env_too:
        var, sep, value = item.partition("=")
        if not sep or not var:
            raise SystemExit(f"--env-too takes VAR=VALUE, got {item!r}")
        out.append((f", {var}={value}", {var: value}))
    return out


def _variant(name: str, suffixes: Sequence[str]) -> str:
    """The contender's variant suffix (one of ``suffixes``, or "")."""
    return next((s for s in suffixes if s and name.endswith(s)), "")


def _same(a: list[list[int]], b: list[list[int]]) -> str:
    """'k/n' prompts whose tokens are identical."""
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


CURVE_CONTEXT = 128   # the context length the verify-cost curve is measured at


def verify_curve(llm: LLM, sizes: list[int], ctx: int = CURVE_CONTEXT, n: int = 30, rounds: int = 20) -> dict[int, float]:
    """ms per target forward step over S new tokens at context ``ctx`` (row 0, rewritten each
    time): ``rounds`` interleaved rounds of ``n`` steps per size (S = 1, 2, ... , 1, 2, ...: the
    machine's drifts hit every size alike), the median per size."""
    r = llm.engine.runner
    times: dict[int, list[float]] = {s: [] for s in sizes}
    for _ in range(rounds):
        for s in sizes:
            chunk = [SeqChunk(0, ctx, [5] * s, s)]
            for _ in range(3):
                r.step(chunk)
            t0 = time.perf_counter()
            for _ in range(n):
                r.step(chunk)
            times[s].append((time.perf_counter() - t0) / n * 1e3)
    return {s: statistics.median(t) for s, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--draft", default=str(DEMO_DIR / "draft"))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--head", default=str(DEMO_DIR / "eagle3"), help="EAGLE-3 head (greedy chain contenders)")
    ap.add_argument("--head-too", nargs="*", default=[], metavar="HEAD",
                    help="more EAGLE-3 heads, run as the first one's contenders (named ', head 2', ...): "
                         "a retrained head against the built-in one in the same rounds")
    ap.add_argument("--eagle-depth", type=int, nargs="+", default=[5], help="the eagle3 chains' lengths")
    ap.add_argument("--trees", nargs="*", default=[(5, 4, 16)], type=tree_arg,
                    help="EAGLE-3 dynamic tree contenders as DEPTHxTOPKxNODES (default 5x4x16)")
    ap.add_argument("--steps", type=int, default=8,
                    help="decode steps per engine step of the multi-step contender (1: no such contender)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="names to keep (none eager always runs; --head-too heads' contenders by these names)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--curve-rounds", type=int, default=20,
                    help="interleaved rounds of the verify-cost curve (30 steps per size each)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    ap.add_argument("--request-seed", type=int, default=None,
                    help="seed prompt i's request with this + i (sampled outputs comparable across contenders)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1,
                    help="sequences decoded together (max_num_seqs; the prompts go in groups of this many)")
    ap.add_argument("--out", default="fastpath.json")
    ap.add_argument("--no-kernel-too", action="store_true",
                    help="also run each contender with the bf16 linear kernel off (LEAPFROG_NATIVE_LINEAR=0)")
    ap.add_argument("--draft-dtype-too", nargs="*", default=[], metavar="DTYPE",
                    help="also run each speculative contender with its drafter in DTYPE (draft_dtype), e.g. "
                         "bfloat16 beside a float32 target")
    ap.add_argument("--draft-quantization-too", nargs="*", default=[], metavar="METHOD",
                    help="also run each speculative contender with its drafter quantized (draft_quantization), "
                         "e.g. int8")
    ap.add_argument("--env-too", nargs="*", default=[], metavar="VAR=VALUE",
                    help="also run each contender loaded with this environment setting, e.g. "
                         "LEAPFROG_BF16_HEAD_ROWS=0 (a bf16 target's LM head on float32 rows)")
    args = ap.parse_args()
    if args.batch_size < 1:
        ap.error(f"--batch-size must be at least 1, got {args.batch_size}")
    torch.set_num_threads(args.threads)

    sys.path.insert(0, str(Path(__file__).parent))
    from demo_bench import heldout_documents
    tok = load_tokenizer(args.target)
    docs = heldout_documents(DEMO_DIR if args.target == str(DEMO_DIR / "target") else Path(args.target).parent)
    prompts = heldout_prompts(tok, docs, args.num_prompts, prompt_tokens=args.prompt_tokens)
    # (room for the verify-cost curve too: K + 1 new tokens at context CURVE_CONTEXT)
    max_len = max(args.prompt_tokens + args.max_tokens + 2 * args.k + 8, CURVE_CONTEXT + args.k + 1)

    llms, startup = {}, {}
    kept = [c for c in contenders(args.draft, args.k, [args.head, *args.head_too], args.eagle_depth, args.trees,
                                  args.steps)
            if args.only is None or c.base == "none eager" or c.base in args.only]
    kept = with_draft_variants(kept, [("draft_dtype", dt) for dt in args.draft_dtype_too]
                               + [("draft_quantization", q) for q in args.draft_quantization_too])
    envs = env_variants(args.no_kernel_too, args.env_too)
    suffixes = [suffix for suffix, _ in envs]
    # a contender's variants side by side in each round (the machine's pace drifts within a round)
    for c, (suffix, env) in [(c, v) for c in kept for v in envs]:
        name = c.name + suffix
        t0 = time.perf_counter()
        with patch.dict(os.environ, env):   # read when the model is loaded and packed
            llms[name] = LLM(model=args.target, dtype=args.dtype, speculative_config=c.spec,
                             max_num_seqs=args.batch_size, max_model_len=max_len, enforce_eager=c.eager,
                             num_scheduler_steps=c.steps)
        startup[name] = time.perf_counter() - t0
        run_once(llms[name], prompts[:1], 8)  # warm-up
        print(f"[fastpath] loaded {name} in {startup[name]:.1f} s", file=sys.stderr)

    speeds: dict[str, list[float]] = {n: [] for n in llms}
    ratios: dict[str, list[float]] = {n: [] for n in llms}
    outside: dict[str, list[float]] = {n: [] for n in llms}
    outputs: dict[str, list[list[int]]] = {}
    for rnd in range(args.rounds):
        for name, llm in llms.items():
            tps, outputs[name], out_share = run_once(llm, prompts, args.max_tokens, args.temperature,
                                                     args.request_seed, args.batch_size)
            speeds[name].append(tps)
            outside[name].append(out_share)
        base = speeds["none eager"][-1]
        for name in llms:
            ratios[name].append(speeds[name][-1] / base)
        print(f"[fastpath] round {rnd + 1}: " + ", ".join(f"{n} {s[-1]:.0f}" for n, s in speeds.items()),
              file=sys.stderr)

    sizes = list(range(1, args.k + 2))
    curves = {}
    for name in [n for n in llms if n.startswith("draft_model")]:  # buckets 1 and K + 1 when compiled
        c = verify_curve(llms[name], sizes, rounds=args.curve_rounds)
        label = ("compiled" if "compiled" in name else "eager") + _variant(name, suffixes)
        curves[label + " ms"] = {s: round(c[s], 3) for s in sizes}
        curves[label + " t(S)/t(1)"] = {s: round(c[s] / c[1], 2) for s in sizes}

    rows = []
    print("| contender | tokens/s | vs eager none | vs its own none | mean accepted per step | "
          "same tokens as eager none | as its own none | outside graphs | start-up s |")
    print("|---|---:|---:|---:|---:|---|---|---:|---:|")
    for name in llms:
        suffix = _variant(name, suffixes)
        own_none = ("none compiled" if "compiled" in name else "none eager") + suffix
        row = {"contender": name, "tokens_per_s": round(statistics.median(speeds[name]), 1),
               "speedup": round(statistics.median(ratios[name]), 2),   # all against eager none (kernel on)
               "identical": _same(outputs[name], outputs["none eager" + suffix]),
               "identical_own_none": _same(outputs[name], outputs.get(own_none, outputs["none eager"])),
               "outside_graphs": round(statistics.median(outside[name]), 3),
               "startup_s": round(startup[name], 1)}
        if own_none in ratios:   # per-round ratio to no speculation on the same path
            row["speedup_own_none"] = round(statistics.median(a / b for a, b in zip(ratios[name], ratios[own_none])), 2)
        mal = llms[name].get_metrics().get("mean_acceptance_length")
        row["mean_accepted"] = None if mal is None else round(mal, 2)
        rows.append(row)
        own = f"{row['speedup_own_none']:.2f}x" if "speedup_own_none" in row else "-"
        print(f"| {name} | {row['tokens_per_s']} | {row['speedup']:.2f}x | {own} | {row['mean_accepted'] or '-'} | "
              f"{row['identical']} | {row['identical_own_none']} | {100 * row['outside_graphs']:.0f} % | "
              f"{row['startup_s']} |")
    if curves:   # (measured on the draft_model contenders' runners: none kept, no table)
        print("\ntarget step over S new tokens at context 128 (compiled: S padded up to the K+1 bucket):")
        print("| | " + " | ".join(f"S={s}" for s in sizes) + " |")
        print("|---|" + "---:|" * len(sizes))
        for name, c in curves.items():
            print(f"| {name} | " + " | ".join(str(c[s]) for s in sizes) + " |")
    summary = {"dtype": str(llms["none eager"].engine.dtype), "threads": args.threads, "rounds": args.rounds,
               "temperature": args.temperature, "request_seed": args.request_seed,
               "num_prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows, "verify_ms": curves}
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
