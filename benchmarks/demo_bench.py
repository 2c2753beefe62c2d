"""The built-in demo pair, measured on held-out standard-library files (issue: demo model family).

One run, side by side:
  * held-out bits per byte of the target and of the draft (transformers forward, fp32);
  * single stream (batch 1), temperature 0, K = 4: no speculation vs draft_model (the demo draft)
    vs ngram, interleaved by ``leapfrog bench`` (A B C A B C ...), reporting speedup, acceptance
    rate and mean acceptance length; with ``--backend transformers`` also transformers' generate,
    assisted generation with the same draft and prompt lookup on the same checkpoints.

The held-out files are the ones the training run held out (``training_record.json`` in the
model folder), read from this Python's standard library.

    python benchmarks/demo_bench.py --out bench_demo [--backend transformers] [--num-prompts 24]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from leapfrog.bench.edits import heldout_documents  # noqa: F401  (the other benchmarks import it from here)
from leapfrog.bench.runner import format_peers, format_table, run_bench
from leapfrog.bench.workloads import WorkloadItem
from leapfrog.demo import DEMO_DIR
from leapfrog.model.loader import load_tokenizer
from leapfrog.train.distill import heldout_prompts
from leapfrog.train.evaluate import bits_per_byte


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--draft", default=str(DEMO_DIR / "draft"))
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bpb-bytes", type=int, default=300_000, help="held-out bytes scored for bits per byte")
    ap.add_argument("--backend", action="append", default=None, choices=["transformers"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench_demo")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers as tf

    tok = load_tokenizer(args.target)
    held = heldout_documents(DEMO_DIR if args.target == str(DEMO_DIR / "target") else Path(args.target).parent)
    bpb = {}
    for name, path in (("target", args.target), ("draft", args.draft)):
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        bpb[name] = bits_per_byte(model, tok, held, max_bytes=args.bpb_bytes)
        print(f"[demo_bench] {name}: held-out {bpb[name]:.3f} bits per byte")
        del model
    prompts = heldout_prompts(tok, held, args.num_prompts, prompt_tokens=args.prompt_tokens)
    items = [WorkloadItem("stdlib-heldout", p, None, str(i)) for i, p in enumerate(prompts)]
    specs = [{"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k},
             {"method": "ngram", "num_speculative_tokens": args.k}]
    res = run_bench(args.target, specs, items, temperatures=[0.0], max_tokens=args.max_tokens, batch_sizes=[1],
                    repeats=args.repeats, warmup=1, out_dir=args.out, dtype="auto",
                    backends=["leapfrog", *(args.backend or [])])
    print(format_table(res))
    if res.peer_ratios:
        print(format_peers(res))
    dm, ng = res.row(f"draft_model-k{args.k}"), res.row(f"ngram-k{args.k}")
    summary = {
        "heldout_bits_per_byte": bpb, "num_prompts": len(items), "max_tokens": args.max_tokens, "k": args.k,
        "dtype": res.settings["resolved_dtype"], "threads": torch.get_num_threads(),
        "none_tokens_per_s": res.row("none")["tokens_per_s"],
        "draft_model": {key: dm[key] for key in ("tokens_per_s", "speedup", "speedup_ci_low", "speedup_ci_high",
                                                 "acceptance_rate", "mean_acceptance_length", "equal_rate",
                                                 "acceptance_by_position")},
        "ngram": {key: ng[key] for key in ("tokens_per_s", "speedup", "speedup_ci_low", "speedup_ci_high",
                                           "acceptance_rate", "mean_acceptance_length", "equal_rate")},
        "transformers": {r["transformers"] + " vs " + r["leapfrog"]: r["ratio"] for r in res.peer_ratios
                         if r["category"] == "all"},
        "transformers_tokens_per_s": {n: res.row(n)["tokens_per_s"] for n in res.contenders if n.startswith("hf-")},
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "demo_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
