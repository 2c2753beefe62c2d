"""Weight-only int8 targets side by side: the float model, ``quantization="int8"`` on leapfrog's
int8-weight op (model/native_linear.py ``linear_int8``) and on PyTorch's ``_weight_int8pack_mm``
(the op switched off at load), in interleaved rounds on the demo's held-out code, batch 1, greedy.
Prints tokens/s, the median of per-round ratios to the float model, and whether the two int8
contenders made the same tokens (they compute with the same weights; float rounding apart).

    python benchmarks/quant_bench.py [--enforce-eager] [--num-prompts 4] [--max-tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from unittest.mock import patch

import torch

from leapfrog import LLM
from leapfrog.demo import DEMO_DIR
from leapfrog.model import native_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--enforce-eager", action="store_true", help="eager forwards (default: compiled graphs)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from demo_bench import heldout_documents
    from fastpath_bench import heldout_prompts, load_tokenizer, run_once

    tok = load_tokenizer(args.target)
    docs = heldout_documents(DEMO_DIR if args.target == str(DEMO_DIR / "target") else Path(args.target).parent)
    prompts = heldout_prompts(tok, docs, args.num_prompts, prompt_tokens=args.prompt_tokens)
    max_len = args.prompt_tokens + args.max_tokens + 16
    llms = {}
    real = native_linear.native_int8_supported
    for name, quant, op in [("float", None, True), ("int8, leapfrog op", "int8", True),
                            ("int8, PyTorch kernel", "int8", False)]:
        with patch.object(native_linear, "native_int8_supported", lambda device, _op=op: _op and real(device)):
            llms[name] = LLM(model=args.target, dtype=args.dtype, quantization=quant, max_num_seqs=1,
                             max_model_len=max_len, enforce_eager=args.enforce_eager)
        run_once(llms[name], prompts[:1], 8)   # warm-up
        print(f"[quant] loaded {name}", file=sys.stderr)
    speeds: dict[str, list[float]] = {n: [] for n in llms}
    outs = {}
    for rnd in range(args.rounds):
        for name, llm in llms.items():
            tps, outs[name], _ = run_once(llm, prompts, args.max_tokens)
            speeds[name].append(tps)
        print(f"[quant] round {rnd + 1}: " + ", ".join(f"{n} {s[-1]:.0f}" for n, s in speeds.items()), file=sys.stderr)
    same = sum(a == b for a, b in zip(outs["int8, leapfrog op"], outs["int8, PyTorch kernel"]))
    print(f"{'compiled' if not args.enforce_eager else 'eager'}, batch 1, {args.num_prompts} prompts x "
          f"{args.max_tokens} tokens, {args.rounds} rounds")
    print("| contender | tokens/s | vs float |")
    print("|---|---:|---:|")
    for name in llms:
        ratio = statistics.median(a / b for a, b in zip(speeds[name], speeds["float"]))
        print(f"| {name} | {statistics.median(speeds[name]):.1f} | {ratio:.2f}x |")
    print(f"the two int8 contenders made the same tokens on {same}/{len(prompts)} prompts")


if __name__ == "__main__":
    main()
