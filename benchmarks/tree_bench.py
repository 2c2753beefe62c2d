"""Tree speculation and EAGLE on the built-in pair, side by side in one run (issue: tree speculation).

Contenders (interleaved by ``leapfrog bench``: A B C ... A B C ...): no speculation, draft_model
K=4 (the demo draft), ngram K=4, the built-in EAGLE-3 head as a chain (eagle_topk 1), as a fixed
dynamic tree (EAGLE-2: depth 5, top-4 per level, best 16 nodes verified) and with the tree size
chosen by goodput (num_draft_tokens "auto"), draft_model with an adaptive K (index 5), and chains
that end where the drafter's path confidence falls below 0.3 (``min_draft_confidence``): the
EAGLE-3 head's up to 10 deep (index 6) and the draft model's up to 8 (index 7). ``--compare-head
HEAD`` adds another EAGLE-3 head (a retrained one) as the chain of 5 (index 8) and the chain up to
10 with c = 0.3 (index 9), to compare heads in one interleaved run. ``--eagle-depths 7`` adds the head's
chain of 7 (the built-in default on AVX-512 BF16 CPUs: ``leapfrog.demo.demo_chain_depth``) after those,
``--auto-depths 7`` the head's "auto" tree sizes at depth 7 after those; with ``--compare-head``, the
other head's chains at ``--eagle-depths`` and "auto" sizes at ``--auto-depths`` come after those
(heads compared on the built-in default and its adaptive sizes). ``--continuous``: continuous
batching (all prompts to each engine in one call, at most the batch size running; default: static
batches of the batch size).
``--head-quantization w8a8`` adds, last, each EAGLE-3 contender of the heads (2, 3, 4, 6, the
``--eagle-depths`` chains and the ``--auto-depths`` sizes, and the ``--compare-head``'s) once more
with that ``draft_quantization``
(w8a8: the head's linears in int8 weights and rows, the built-in default on AMX-INT8, AVX-512 VNNI and AVX2 CPUs:
``leapfrog.demo.demo_draft_quantization``).
Prompts: code the models never trained on, either the demo's held-out standard-library files
(``--source heldout``, default) or third-party files from this Python's site-packages
(``--source site-packages``). ``--twin I`` adds a second engine of contender I, identical, loaded
last, and prints how far the two measured apart per cell (the noise floor of comparing one engine
per setting: each LLM holds its own copy of the weights, unless the contenders share the target).

Every contender runs on no speculation's loaded target (``--share-target``; by default where the
engine allows it, ``leapfrog bench``'s default too: not a target that streams its weights;
``--no-share-target``: each engine its own copy). With a copy each, the interleaving itself
costs every engine a cold start per batch: measured at batch 1 (stop 96, AMX Xeon, the chain of 7
alternated prompt by prompt with no speculation's engine), its first three steps took 4.3 / 4.0 /
3.3 ms against 3.0 (+2.6 ms a prompt, 3-4 % of its time; none's first steps +1.4 ms, under 1 % of
its longer run), about 0.5 ms with one shared copy: the other engine's copy had taken the
last-level cache. A server runs one copy; so the shared target measures what a user gets, and the
interleaving no longer charges the shorter run more.

    python benchmarks/tree_bench.py --out bench_tree [--temperatures 0 0.7] [--batch-sizes 1 4 16 32] \
        [--no-enforce-eager]

Prints the table (tokens/s, speedup over none with its 95 % interval, acceptance, mean accepted
tokens per step) and writes ``tree_summary.json`` + the bench CSV/plots to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from leapfrog.bench.runner import adaptive_vs_fixed, format_adaptive, format_table, run_bench
from leapfrog.bench.workloads import WorkloadItem
from leapfrog.demo import DEMO_DIR
from leapfrog.entrypoints.argtypes import share
from leapfrog.model.loader import load_tokenizer
from leapfrog.train.corpus import Document
from leapfrog.train.distill import heldout_prompts

SITE_PACKAGES = ("tqdm", "click", "packaging", "pydantic", "starlette", "jinja2", "hypothesis", "fastapi")


def site_package_documents(limit_files: int = 60) -> list[Document]:
    root = Path(sysconfig.get_paths()["purelib"])
    docs = []
    for pkg in SITE_PACKAGES:
        for f in sorted((root / pkg).rglob("*.py"))[: limit_files // len(SITE_PACKAGES) + 1]:
            text = f.read_text(encoding="utf-8", errors="replace")
            if len(text) > 2000:
                docs.append(Document(str(f.relative_to(root)), text))
    if not docs:
        raise SystemExit(f"no third-party Python files found under {root}")
    return docs


def contenders(draft: str, head: str, k: int, compare_head: str | None = None,
               depths: list[int] = (), head_quantization: str | None = None,
               auto_depths: list[int] = ()) -> list[dict]:
    e3 = {"method": "eagle3", "model": head}

    def at_depths(model: str) -> list[dict]:   # a head's chains at ``depths``, then its "auto" sizes at ``auto_depths``
        e = {"method": "eagle3", "model": model}
        return [{**e, "num_speculative_tokens": d, "eagle_topk": 1} for d in depths] + [
            {**e, "num_speculative_tokens": d, "eagle_topk": 4, "num_draft_tokens": "auto"} for d in auto_depths]

    other = [] if compare_head is None else [
        {"method": "eagle3", "model": compare_head, "num_speculative_tokens": 5, "eagle_topk": 1},
        {"method": "eagle3", "model": compare_head, "num_speculative_tokens": 10, "eagle_topk": 1,
         "min_draft_confidence": 0.3}]
    specs = [
        {"method": "draft_model", "model": draft, "num_speculative_tokens": k},
        {"method": "ngram", "num_speculative_tokens": k},
        {**e3, "num_speculative_tokens": 5, "eagle_topk": 1},
        {**e3, "num_speculative_tokens": 5, "eagle_topk": 4, "num_draft_tokens": 16},
        {**e3, "num_speculative_tokens": 5, "eagle_topk": 4, "num_draft_tokens": "auto"},
        {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "adaptive": True},
        {**e3, "num_speculative_tokens": 10, "eagle_topk": 1, "min_draft_confidence": 0.3},
        {"method": "draft_model", "model": draft, "num_speculative_tokens": 8, "min_draft_confidence": 0.3},
    ] + other + at_depths(head)
    if compare_head is not None:   # (the other head at the same depths: heads compared on the default chain)
        specs += at_depths(compare_head)
    if head_quantization:
        specs += [{**s, "draft_quantization": head_quantization} for s in specs
                  if s["method"] == "eagle3" and s["model"] in (head, compare_head)]
    return specs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--draft", default=str(DEMO_DIR / "draft"))
    ap.add_argument("--head", default=str(DEMO_DIR / "eagle3"),
                    help='the EAGLE-3 head; "random": a random head of the target\'s shape (gpu_bench.py '
                         "random_head, std 0.2), which accepts almost nothing: what a contender costs where "
                         "drafting cannot pay")
    ap.add_argument("--compare-head", default=None,
                    help="another EAGLE-3 head: adds its chain of 5 (index 8) and its chain up to 10, c = 0.3 (9), "
                         "its chains at --eagle-depths and its \"auto\" sizes at --auto-depths (after the head's); "
                         "--head-quantization quantizes its contenders too")
    ap.add_argument("--source", default="heldout", choices=["heldout", "site-packages"])
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="K of draft_model and ngram")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--continuous", action="store_true",
                    help="continuous batching: all prompts to each engine in one call, at most the batch size "
                         "running at a time (default: static batches of the batch size, one after another)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eagle-depths", nargs="*", type=int, default=[],
                    help="more chains of the head at these depths (the built-in default's 7 on AVX-512 BF16 "
                         "CPUs): indices after the others (from 8, or 10 with --compare-head)")
    ap.add_argument("--auto-depths", nargs="*", type=int, default=[],
                    help="\"auto\" tree sizes of the head (top 4) at these depths: indices after --eagle-depths'")
    ap.add_argument("--head-quantization", default=None, choices=["int8", "int4", "w8a8"],
                    help="adds the head's contenders once more with this draft_quantization (indices last)")
    ap.add_argument("--only", nargs="*", default=None, help="contender indices to keep (0..7, 8 and 9 with --compare-head, "
                    "then --eagle-depths', --auto-depths' and --head-quantization's; none always runs)")
    ap.add_argument("--twin", type=int, default=None,
                    help="a second, identical engine of this contender (an index of --only's list, or of all "
                         "without --only), loaded last: how far two engines of one setting differ in this run "
                         "(with --no-share-target each LLM holds its own weights: identical ones measured 2-8 %% apart "
                         "with their own, 0-6 %% sharing the target), the noise floor of the adaptive goal's "
                         "comparison; left out of that comparison")
    ap.add_argument("--share-target", action=argparse.BooleanOptionalAction, default=None,
                    help="every contender on one loaded copy of the target's weights (run_bench share_target); "
                         "default: shared where the engine allows it, else that contender its own copy (logged)")
    ap.add_argument("--request-seed", type=int, default=None,
                    help="seed the requests (item i: this + i): sampled ones are verified by matching")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-enforce-eager: every contender on the compiled fast path (fused draft chains and trees)")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="with --no-enforce-eager: decode steps (speculation rounds) per engine step for none and "
                         "the contenders that can run rounds (draft_model, the chain, auto); others run one round")
    ap.add_argument("--greedy-share", type=share, default=0.0,
                    help="a mixed load: in the cells of a temperature above 0 this share of the requests runs greedy")
    ap.add_argument("--out", default="bench_tree")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))   # (the scripts beside this one: demo_bench, gpu_bench)

    tok = load_tokenizer(args.target)
    if args.source == "heldout":
        from demo_bench import heldout_documents
        docs = heldout_documents(DEMO_DIR if args.target == str(DEMO_DIR / "target") else Path(args.target).parent)
    else:
        docs = site_package_documents()
    prompts = heldout_prompts(tok, docs, args.num_prompts, prompt_tokens=args.prompt_tokens)
    items = [WorkloadItem(f"code-{args.source}", p, None, str(i)) for i, p in enumerate(prompts)]
    if args.head == "random":
        from gpu_bench import random_head
        args.head = str(random_head(Path(args.target), Path(tempfile.mkdtemp(prefix="lf-random-head-")), 0.2))
    specs = contenders(args.draft, args.head, args.k, args.compare_head, args.eagle_depths, args.head_quantization,
                       args.auto_depths)
    if args.only is not None:
        if bad := [i for i in args.only if not 0 <= int(i) < len(specs)]:
            raise SystemExit(f"--only {' '.join(bad)}: contenders are 0..{len(specs) - 1}"
                             + ("" if args.compare_head else " (8 and 9 need --compare-head)"))
        specs = [specs[int(i)] for i in args.only]
    if args.twin is not None:
        if not 0 <= args.twin < len(specs):
            raise SystemExit(f"--twin {args.twin}: contenders are 0..{len(specs) - 1}")
        specs = specs + [dict(specs[args.twin])]
    res = run_bench(args.target, specs, items, temperatures=args.temperatures, max_tokens=args.max_tokens,
                    batch_sizes=args.batch_sizes, repeats=args.repeats, warmup=1, out_dir=args.out,
                    dtype=args.dtype, threads=args.threads, request_seed=args.request_seed,
                    enforce_eager=args.enforce_eager, num_scheduler_steps=args.num_scheduler_steps,
                    continuous=args.continuous, share_target=args.share_target, greedy_share=args.greedy_share)
    print(format_table(res))
    names = list(res.contenders)
    twin = names[-1] if args.twin is not None else None   # (the last engine loaded)
    goal = adaptive_vs_fixed(res.rows, {n: c for n, c in res.contenders.items() if n != twin})
    if goal:
        print("\n" + format_adaptive(goal))
    twins = []
    if twin is not None:
        first = next(n for n, c in res.contenders.items() if c == res.contenders[twin] and n != twin)
        by = {(r["contender"], r["temperature"], r["batch_size"]): r["speedup"] for r in res.rows
              if r["category"] == "all"}
        twins = [{"temperature": t, "batch_size": b, "contender": first, "twin": twin,
                  "twin_over_first": by[(twin, t, b)] / by[(first, t, b)]}
                 for (n, t, b) in by if n == first and by[(n, t, b)] and by.get((twin, t, b))]
        print(f"\nTwo identical engines of {first}: the second's speedup over the first's, per cell: "
              + ", ".join(f"T {x['temperature']:g} batch {x['batch_size']}: {x['twin_over_first']:.3f}" for x in twins))
    rows = [{k: r[k] for k in ("contender", "temperature", "batch_size", "tokens_per_s", "speedup", "speedup_ci_low",
                               "speedup_ci_high", "acceptance_rate", "mean_acceptance_length", "equal_rate")
             if k in r} for r in res.rows if r["category"] == "all"]
    summary = {"source": args.source, "num_prompts": len(items), "max_tokens": args.max_tokens,
               "dtype": res.settings["resolved_dtype"], "threads": args.threads, "enforce_eager": args.enforce_eager,
               "num_scheduler_steps": args.num_scheduler_steps, "multi_step": res.settings["multi_step"],
               "continuous": args.continuous, "greedy_share": args.greedy_share,
               "share_target": res.settings["share_target"], "own_target": res.settings["own_target"],
               "contenders": res.contenders, "rows": rows, "adaptive_goal": goal, "twins": twins}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tree_summary.json").write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
