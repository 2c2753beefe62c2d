"""leapfrog against its peers on one checkpoint, side by side in interleaved rounds (batch 1, greedy).

Contenders (``--contenders``, comma-separated; default: all that can run here):
  leapfrog          no speculation, eager, the checkpoint's dtype (``--dtype``)
  leapfrog-compiled no speculation, compiled fast path (enforce_eager=False)
  leapfrog-steps    no speculation, compiled, ``--steps`` decode steps per engine step (num_scheduler_steps)
  leapfrog-draft    draft_model K (``--draft``), compiled
  leapfrog-draft-steps  draft_model K, compiled, ``--steps`` speculation rounds per engine step
  leapfrog-self     quantized self-draft K (int4 copy of the target), compiled
  leapfrog-eagle3   EAGLE-3 head (``--head``) drafting greedy chains of ``--eagle-depth``, compiled
  leapfrog-eagle3-steps  the same, ``--steps`` speculation rounds per engine step
  leapfrog-draft-eager, leapfrog-eagle3-eager  draft_model K and the EAGLE-3 chain eagerly (the
                    default path: enforce_eager=True, each step's drafting one C++ call)
  leapfrog-eagle3-w8a8-eager  the eager chain with the head's linears in w8a8 (the built-in
                    default on AMX-INT8 and AVX-512 VNNI CPUs, and on AVX2 ones with a float32 target)
  leapfrog-int8     no speculation, int8 weight-only target, compiled (a different model: listed apart)
  transformers      ``generate``, float32 (its fast CPU path)
  llama.cpp         ``llama-completion`` on the GGUF of the same checkpoint (``--target-gguf``)
  llama.cpp-draft   ``llama-speculative`` with the draft's GGUF (``--draft-gguf``), same K
The llama.cpp contenders run when a build is given: ``--llama-cpp DIR`` (its ``build/bin``) or the
environment variable ``LLAMA_CPP_BIN``. How to build it here and convert checkpoints to GGUF:
README "Peers" (the recipe of the project's PEERS notes).

Each round runs every contender over every prompt (a prompt at a time), in the same order; the
table reports the median over rounds of decode tokens/s and of the per-round ratio to llama.cpp's
plain decode (or to leapfrog's when llama.cpp is not given). Decode tokens/s excludes the prompt:
leapfrog (n - 1) / (last token - first token) per request, llama.cpp its own ``eval time`` (plain)
and ``decoded N tokens in T s`` (speculative); transformers has no first-token time here, so its
figure includes the prompt (a few percent at 128 tokens).

    python benchmarks/peers_bench.py --llama-cpp ~/llama.cpp/build/bin \\
        --target-gguf target-bf16.gguf --draft-gguf draft-bf16.gguf [--num-prompts 12] [--max-tokens 128]
    python benchmarks/peers_bench.py --shape 110M --target-gguf s110m-bf16.gguf ...   # random 110M shape
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import DEMO_DIR
from leapfrog.model.loader import load_tokenizer
from leapfrog.train.distill import heldout_prompts

ALL = ["llama.cpp", "llama.cpp-draft", "leapfrog", "leapfrog-compiled", "leapfrog-steps", "leapfrog-draft",
       "leapfrog-draft-steps", "leapfrog-self", "leapfrog-eagle3", "leapfrog-eagle3-steps", "leapfrog-draft-eager",
       "leapfrog-eagle3-eager", "leapfrog-eagle3-w8a8-eager", "leapfrog-int8",
       "transformers"]
SHAPES = {"110M": (768, 12, 12, 2048)}  # dim, layers, heads, intermediate (stories110M)


@dataclass
class Run:
    tokens: int = 0        # decode tokens (after the first)
    seconds: float = 0.0   # decode time
    outputs: list[str] = field(default_factory=list)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class LeapfrogContender:
    def __init__(self, target: str, dtype: str, max_len: int, **kw) -> None:
        t0 = time.perf_counter()
        self.llm = LLM(model=target, dtype=dtype, max_num_seqs=1, max_model_len=max_len, **kw)
        self.startup = time.perf_counter() - t0

    def run(self, prompts: list[str], max_tokens: int) -> Run:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        r = Run()
        for p in prompts:
            o = self.llm.generate([p], sp, use_tqdm=False)[0]
            m = o.metrics
            r.tokens += m.num_generated_tokens - 1
            r.seconds += m.finished_time - m.first_token_time
            r.outputs.append(o.outputs[0].text)
        return r


class TransformersContender:
    def __init__(self, target: str, max_len: int) -> None:
        from leapfrog.bench.hf_backend import HFGenerator, HFMode
        t0 = time.perf_counter()
        self.gen = HFGenerator(target, HFMode("plain"), torch.float32, torch.device("cpu"), ())
        self.tok = load_tokenizer(target)
        self.startup = time.perf_counter() - t0

    def run(self, prompts: list[str], max_tokens: int) -> Run:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        r = Run()
        for p in prompts:
            ids = self.tok(p, add_special_tokens=False)["input_ids"]
            o = self.gen.generate([{"prompt_token_ids": ids, "prompt": p}], sp)[0]
            r.tokens += len(o.outputs[0].token_ids)
            r.seconds += o.metrics.finished_time - o.metrics.arrival_time
            r.outputs.append(self.tok.decode(o.outputs[0].token_ids))
        return r


_EVAL = re.compile(r"(?:common_perf_print|llama_perf_context_print):\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds")


class LlamaCppContender:
    """llama.cpp's own tools, one process per prompt (the model loads in milliseconds)."""

    def __init__(self, bin_dir: Path, target_gguf: str, threads: int, draft_gguf: str | None = None,
                 k: int = 4) -> None:
        self.bin, self.threads, self.target, self.draft, self.k = bin_dir, threads, target_gguf, draft_gguf, k
        self.startup = 0.0
        self.tmp = Path(tempfile.mkdtemp(prefix="lf-peers-"))

    def command(self, prompt_file: Path, max_tokens: int) -> list[str]:
        common = ["-f", str(prompt_file), "-n", str(max_tokens), "--temp", "0", "--top-k", "1", "-s", "0",
                  "-t", str(self.threads), "--ignore-eos"]
        if self.draft is None:
            return [str(self.bin / "llama-completion"), "-m", self.target, *common, "-no-cnv",
                    "--no-display-prompt", "--simple-io"]
        return [str(self.bin / "llama-speculative"), "-m", self.target, "-md", self.draft, "-td", str(self.threads),
                "--spec-draft-n-max", str(self.k), *common]

    def run(self, prompts: list[str], max_tokens: int) -> Run:
        r = Run()
        for i, p in enumerate(prompts):
            f = self.tmp / f"prompt{i}.txt"
            f.write_text(p, encoding="utf-8")
            proc = subprocess.run(self.command(f, max_tokens), capture_output=True, text=True, timeout=600)
            log = proc.stdout + proc.stderr
            if proc.returncode != 0:
                raise RuntimeError(f"{self.command(f, max_tokens)[0]} failed ({proc.returncode}):\n{log[-2000:]}")
            if self.draft is None:
                m = _EVAL.findall(log)
                if not m:
                    raise RuntimeError(f"no 'eval time' line in llama-completion's output:\n{log[-2000:]}")
                ms, runs = m[-1]
                r.tokens += int(runs)
                r.seconds += float(ms) / 1e3
            else:
                m = _DECODED.findall(log)
                if not m:
                    raise RuntimeError(f"no 'decoded N tokens' line in llama-speculative's output:\n{log[-2000:]}")
                n, s = m[-1]
                r.tokens += int(n) - 1   # its count includes the first token, sampled from the prompt
                r.seconds += float(s)
            r.outputs.append(proc.stdout)
        return r


def make_shape(name: str, workdir: Path, tokenizer_dir: str) -> str:
    """A random-init Llama of a reference shape with the demo tokenizer (saved once)."""
    from leapfrog.demo import save_random_llama
    path = workdir / f"random{name}"
    if not (path / "config.json").is_file():
        dim, layers, heads, inter = SHAPES[name]
        save_random_llama(path, load_tokenizer(tokenizer_dir), seed=0, dtype="bfloat16", vocab_size=32000,
                          hidden_size=dim, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024)
    return str(path)


def build(name: str, args, max_len: int):
    spec_draft = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    spec_self = {"method": "draft_model", "model": "self", "draft_quantization": "int4",
                 "num_speculative_tokens": args.k}
    lf = dict(target=args.target, dtype=args.dtype, max_len=max_len)
    if name == "leapfrog":
        return LeapfrogContender(**lf)
    if name == "leapfrog-compiled":
        return LeapfrogContender(**lf, enforce_eager=False)
    if name == "leapfrog-steps":
        return LeapfrogContender(**lf, enforce_eager=False, num_scheduler_steps=args.steps)
    if name == "leapfrog-draft":
        return LeapfrogContender(**lf, enforce_eager=False, speculative_config=spec_draft)
    if name == "leapfrog-draft-steps":
        return LeapfrogContender(**lf, enforce_eager=False, speculative_config=spec_draft,
                                 num_scheduler_steps=args.steps)
    if name == "leapfrog-self":
        return LeapfrogContender(**lf, enforce_eager=False, speculative_config=spec_self)
    spec_eagle = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.eagle_depth, "eagle_topk": 1}
    if name in ("leapfrog-eagle3", "leapfrog-eagle3-steps"):
        return LeapfrogContender(**lf, enforce_eager=False, speculative_config=spec_eagle,
                                 num_scheduler_steps=args.steps if name.endswith("-steps") else 1)
    if name in ("leapfrog-draft-eager", "leapfrog-eagle3-eager"):
        return LeapfrogContender(**lf, speculative_config=spec_draft if "draft" in name else spec_eagle)
    if name == "leapfrog-eagle3-w8a8-eager":
        return LeapfrogContender(**lf, speculative_config={**spec_eagle, "draft_quantization": "w8a8"})
    if name == "leapfrog-int8":
        return LeapfrogContender(**lf, enforce_eager=False, quantization="int8")
    if name == "transformers":
        return TransformersContender(args.target, max_len)
    if name == "llama.cpp":
        return LlamaCppContender(args.bin, args.target_gguf, args.threads)
    if name == "llama.cpp-draft":
        return LlamaCppContender(args.bin, args.target_gguf, args.threads, args.draft_gguf, args.k)
    raise SystemExit(f"unknown contender {name!r}; known: {', '.join(ALL)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--draft", default=str(DEMO_DIR / "draft"))
    ap.add_argument("--head", default=str(DEMO_DIR / "eagle3"), help="EAGLE-3 head of leapfrog-eagle3")
    ap.add_argument("--eagle-depth", type=int, default=5)
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="instead of --target: a random-init Llama of this shape (demo tokenizer, bf16)")
    ap.add_argument("--workdir", default=None, help="where --shape checkpoints are saved (default: a temp dir)")
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_BIN"),
                    help="llama.cpp's build/bin directory (default: $LLAMA_CPP_BIN; none: no llama.cpp contenders)")
    ap.add_argument("--target-gguf", default=None)
    ap.add_argument("--draft-gguf", default=None)
    ap.add_argument("--contenders", default=None, help=f"comma-separated subset of {','.join(ALL)}")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8,
                    help="decode steps (speculation rounds) per engine step of leapfrog-steps, "
                         "leapfrog-draft-steps and leapfrog-eagle3-steps")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="peers.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer_dir = args.target
    if args.shape:
        args.target = make_shape(args.shape, Path(args.workdir or tempfile.mkdtemp(prefix="lf-peers-")),
                                 tokenizer_dir)
    args.bin = Path(args.llama_cpp).expanduser() if args.llama_cpp else None
    from leapfrog.model.native_linear import w8a8_supported
    names = args.contenders.split(",") if args.contenders else [
        n for n in ALL if ("w8a8" not in n or w8a8_supported()) and (args.shape is None or n not in (
                                                     "leapfrog-draft", "leapfrog-draft-steps", "leapfrog-eagle3",
                                                     "leapfrog-eagle3-steps", "leapfrog-draft-eager",
                                                     "leapfrog-eagle3-eager", "leapfrog-eagle3-w8a8-eager",
                                                     "llama.cpp-draft"))]
    for n in names:
        if n.startswith("llama.cpp") and (args.bin is None or not args.target_gguf):
            print(f"[peers] skipping {n}: give --llama-cpp (or LLAMA_CPP_BIN) and --target-gguf", file=sys.stderr)
        elif n == "llama.cpp-draft" and not args.draft_gguf:
            print(f"[peers] skipping {n}: give --draft-gguf", file=sys.stderr)
    names = [n for n in names if not n.startswith("llama.cpp") or (
        args.bin is not None and args.target_gguf and (n == "llama.cpp" or args.draft_gguf))]

    sys.path.insert(0, str(Path(__file__).parent))
    from demo_bench import heldout_documents
    prompts = heldout_prompts(load_tokenizer(tokenizer_dir), heldout_documents(DEMO_DIR), args.num_prompts,
                              prompt_tokens=args.prompt_tokens)
    max_len = args.prompt_tokens + args.max_tokens + 2 * args.k + 16

    contenders = {}
    for n in names:
        contenders[n] = build(n, args, max_len)
        contenders[n].run(prompts[:1], 8)  # warm-up
        print(f"[peers] ready: {n} ({contenders[n].startup:.1f} s)", file=sys.stderr)
    base = "llama.cpp" if "llama.cpp" in contenders else names[0]
    speeds: dict[str, list[float]] = {n: [] for n in contenders}
    ratios: dict[str, list[float]] = {n: [] for n in contenders}
    last: dict[str, Run] = {}
    for rnd in range(args.rounds):
        for n, c in contenders.items():
            last[n] = c.run(prompts, args.max_tokens)
            speeds[n].append(last[n].tps)
        for n in contenders:
            ratios[n].append(speeds[n][-1] / speeds[base][-1])
        print(f"[peers] round {rnd + 1}: " + ", ".join(f"{n} {s[-1]:.0f}" for n, s in speeds.items()),
              file=sys.stderr)

    rows = [{"contender": n, "decode_tokens_per_s": round(statistics.median(speeds[n]), 1),
             f"vs_{base}": round(statistics.median(ratios[n]), 2), "startup_s": round(contenders[n].startup, 1)}
            for n in contenders]
    print(f"\n{args.target} ({args.dtype}; transformers float32), batch 1, {len(prompts)} prompts x "
          f"{args.max_tokens} tokens, {args.threads} threads, {args.rounds} interleaved rounds")
    print(f"| contender | decode tokens/s | vs {base} | start-up s |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['contender']} | {r['decode_tokens_per_s']} | {r[f'vs_{base}']:.2f} | {r['startup_s']} |")
    Path(args.out).write_text(json.dumps({"target": args.target, "dtype": args.dtype, "threads": args.threads,
                                          "rounds": args.rounds, "num_prompts": len(prompts),
                                          "max_tokens": args.max_tokens, "baseline": base, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
