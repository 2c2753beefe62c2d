"""Eager prefill with the last layer pruned to the rows read, against the whole forward, side by side.

A prefill reads the logits of its prompt's last token only, so the last decoder layer's output
projection, residual and MLP are needed for that token alone (every token's keys and values are
still cached): ``LlamaModel.forward(keep_rows=...)``, which the runner passes in eager steps that
read no other token's state (model/runner.py). An EAGLE head catching up on a prompt reads none of
its output states (``EagleHead.forward(keep_rows=...)``); an EAGLE target reads every token's
features, so it runs whole. This script times the prefill of one prompt (the engine's first
token: target and drafter) per prompt length and contender (no speculation, the built-in draft
model, the built-in EAGLE-3 head), each contender's two variants interleaved in the same process
(the models' ``keeps_rows`` flags switched between repetitions, whose order alternates), and
reports the median per-repetition time ratio; it also checks that both variants give the same
first tokens.

Then ragged batches: ``--batch-sizes`` prompts of random lengths in ``--ragged-lengths`` prefilled
together (``LLM.generate``, one token each, no speculation), in eager forwards of similar lengths
(``split_by_length``: the runner's default) against one forward padded to the longest prompt
(``split_tokens = 0``), interleaved the same way.

    python benchmarks/prefill_bench.py [--lengths 64 256 1024] [--reps 12] [--methods none draft_model eagle3]
                                       [--batch-sizes 4 16] [--ragged-lengths 16 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import DEMO_DIR

SPECS = {"none": None,
         "draft_model": {"method": "draft_model", "model": str(DEMO_DIR / "draft"), "num_speculative_tokens": 4},
         "eagle3": {"method": "eagle3", "model": str(DEMO_DIR / "eagle3"), "num_speculative_tokens": 5,
                    "eagle_topk": 1}}


def prompt(n: int, vocab: int, salt: int = 0) -> dict:
    """n token ids spread over the vocabulary (no tokenizer needed), different per ``salt``."""
    return {"prompt_token_ids": [(i * 37 + salt) % (vocab - 10) + 5 for i in range(n)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--methods", nargs="+", choices=list(SPECS), default=list(SPECS))
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=4, help="tokens generated per prompt (the first one times the prefill)")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[4, 16], help="ragged batches (none: skip)")
    ap.add_argument("--ragged-lengths", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"built-in target, dtype {args.dtype}, {args.threads} threads, {args.reps} repetitions per variant")
    print("| method | prompt tokens | last layer for the rows read, ms | whole forward, ms | ratio (median per repetition) | same tokens |")
    print("|---|---:|---:|---:|---:|---|")
    for method in args.methods:
        llm = LLM(str(DEMO_DIR / "target"), enforce_eager=True, dtype=args.dtype, speculative_config=SPECS[method],
                  max_model_len=max(args.lengths) + args.new_tokens + 8)
        models = [llm.engine.runner.model]
        if method != "none":
            models = [llm.engine.proposer.runner.model] + (models if method == "draft_model" else [])
        vocab = models[-1].args.vocab_size
        for n in args.lengths:
            ids = prompt(n, vocab)
            times: dict[bool, list[float]] = {True: [], False: []}
            outs: dict[bool, list[int]] = {}
            for rep in range(args.reps + 1):
                for keep in ((True, False) if rep % 2 else (False, True)):
                    for m in models:
                        m.keeps_rows = keep
                    r = llm.generate([ids], sp, use_tqdm=False)[0]
                    outs[keep] = list(r.outputs[0].token_ids)
                    if rep:   # (the first repetition warms up)
                        times[keep].append(r.metrics.first_token_time - r.metrics.first_scheduled_time)
            ratio = statistics.median(a / b for a, b in zip(times[True], times[False]))
            print(f"| {method} | {n} | {statistics.median(times[True]) * 1e3:.1f} | "
                  f"{statistics.median(times[False]) * 1e3:.1f} | {ratio:.3f} | {outs[True] == outs[False]} |", flush=True)
        for m in models:
            m.keeps_rows = True
    if args.batch_sizes:
        ragged(args)


def ragged(args: argparse.Namespace) -> None:
    """Ragged batches' prefill: grouped by length (the default) against one padded forward."""
    lo, hi = args.ragged_lengths
    llm = LLM(str(DEMO_DIR / "target"), enforce_eager=True, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
              max_model_len=hi + 8, max_num_batched_tokens=max(args.batch_sizes) * hi)
    runner = llm.engine.runner
    split = runner.split_tokens
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    print()
    print(f"| batch | prompt tokens (sum / padded) | forwards by length, s | one padded forward, s | ratio (median per repetition) | same tokens |")
    print("|---:|---:|---:|---:|---:|---|")
    for b in args.batch_sizes:
        lengths = [rng.randint(lo, hi) for _ in range(b)]
        prompts = [prompt(n, runner.model.args.vocab_size, salt=j) for j, n in enumerate(lengths)]
        times: dict[int, list[float]] = {split: [], 0: []}
        outs: dict[int, list[list[int]]] = {}
        for rep in range(args.reps + 1):
            for v in ((split, 0) if rep % 2 else (0, split)):
                runner.split_tokens = v
                t0 = time.perf_counter()
                rs = llm.generate(prompts, sp, use_tqdm=False)
                if rep:
                    times[v].append(time.perf_counter() - t0)
                outs[v] = [list(r.outputs[0].token_ids) for r in rs]
        ratio = statistics.median(a / c for a, c in zip(times[split], times[0]))
        print(f"| {b} | {sum(lengths)} / {b * max(lengths)} | {statistics.median(times[split]):.3f} | "
              f"{statistics.median(times[0]):.3f} | {ratio:.3f} | {outs[split] == outs[0]} |", flush=True)
    runner.split_tokens = split


if __name__ == "__main__":
    main()
