"""Single-stream (batch 1) greedy decode speed: leapfrog vs Hugging Face transformers ``generate``.

Both run the same random-init Llama checkpoints (llama2.c "stories" shapes, vocab 32000) in
one process, with the same torch thread count, no speculation. Per (shape, dtype): load both,
warm each up once, then alternate rounds A B A B ... and report median tokens/s (128 new
tokens from a 16-token prompt by default; the time includes the prompt's prefill) and the
ratio leapfrog / transformers. It also checks whether the two produce the same greedy tokens,
and measures leapfrog's verify-cost curve: the time of one target forward over s = 1..16 new
tokens at context depth 128, relative to s = 1 (the cost a speculative verify step pays).

Run from the repository root:

    python benchmarks/decode_bench.py                       # all shapes, fp32 + bf16, 3 rounds
    python benchmarks/decode_bench.py --shapes 15M --rounds 1 --max-tokens 32   # quick check

Results are printed as markdown tables and written to --out (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # name: (dim, layers, heads, intermediate)
    "15M": (288, 6, 6, 768),
    "42M": (512, 8, 8, 1376),
    "110M": (768, 12, 12, 2048),
}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LF_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
VOCAB, MAX_POS, PROMPT_LEN, VERIFY_DEPTH, VERIFY_MAX_S = 32000, 1024, 16, 128, 16


def make_checkpoints(workdir: Path, shapes: list[str]) -> dict[str, Path]:
    from leapfrog.demo import build_tokenizer, save_random_llama, stdlib_sample_text

    tok = build_tokenizer(stdlib_sample_text(), 512)  # token ids are passed directly: size is moot
    paths = {}
    for name in shapes:
        dim, layers, heads, inter = SHAPES[name]
        path = workdir / f"stories{name}"
        if not (path / "config.json").is_file():
            save_random_llama(path, tok, seed=0, dtype="float32", vocab_size=VOCAB, hidden_size=dim,
                              intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=heads, max_position_embeddings=MAX_POS)
        paths[name] = path
    return paths


def load_leapfrog(path: Path, dtype: str):
    from leapfrog import LLM
    return LLM(model=str(path), dtype=LF_DTYPES[dtype], speculative_config=None, max_num_seqs=1,
               max_model_len=MAX_POS)


def load_hf(path: Path, dtype: str):
    from transformers import AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype])
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=TORCH_DTYPES[dtype])
    model.eval()
    # Never stop on EOS (like leapfrog's ignore_eos), without min_new_tokens' EOS-suppression,
    # so the greedy tokens stay comparable.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run_leapfrog(llm, prompt: list[int], n: int) -> tuple[float, list[int]]:
    from leapfrog import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, list(out[0].outputs[0].token_ids)


def run_hf(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)
        dt = time.perf_counter() - t0
    return dt, out[0, len(prompt):].tolist()


def bench_decode(path: Path, dtype: str, args, prompt: list[int]) -> dict:
    llm, hf = load_leapfrog(path, dtype), load_hf(path, dtype)
    _, lf_ids = run_leapfrog(llm, prompt, args.max_tokens)  # warm-up (and the greedy check)
    _, hf_ids = run_hf(hf, prompt, args.max_tokens)
    lf_t, hf_t = [], []
    for _ in range(args.rounds):
        lf_t.append(run_leapfrog(llm, prompt, args.max_tokens)[0])
        hf_t.append(run_hf(hf, prompt, args.max_tokens)[0])
    first_diff = next((i for i, (a, b) in enumerate(zip(lf_ids, hf_ids)) if a != b), None)
    lf_tps, hf_tps = args.max_tokens / statistics.median(lf_t), args.max_tokens / statistics.median(hf_t)
    del llm, hf
    gc.collect()
    return {"leapfrog_tok_s": lf_tps, "transformers_tok_s": hf_tps, "ratio": lf_tps / hf_tps,
            "leapfrog_times_s": lf_t, "transformers_times_s": hf_t,
            "greedy_match": lf_ids == hf_ids and len(lf_ids) == args.max_tokens,
            "first_mismatch": first_diff}


def verify_curve(path: Path, dtype: str, repeats: int) -> list[float]:
    from leapfrog.model.runner import SeqChunk
    llm = load_leapfrog(path, dtype)
    runner = llm.engine.runner
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (VERIFY_DEPTH + VERIFY_MAX_S,), generator=g).tolist()
    runner.run([SeqChunk(0, 0, ids[:VERIFY_DEPTH], 0)])  # fill columns 0..127
    new = ids[VERIFY_DEPTH:]
    for s in (1, VERIFY_MAX_S):  # warm-up
        runner.run([SeqChunk(0, VERIFY_DEPTH, new[:s], s)])
    ts: list[list[float]] = [[] for _ in range(VERIFY_MAX_S)]
    for _ in range(repeats):  # s innermost: a slow spell of the machine hits every s alike
        for s in range(1, VERIFY_MAX_S + 1):
            t0 = time.perf_counter()
            runner.run([SeqChunk(0, VERIFY_DEPTH, new[:s], s)])
            ts[s - 1].append(time.perf_counter() - t0)
    del llm
    gc.collect()
    return [statistics.median(t) for t in ts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=list(TORCH_DTYPES), choices=list(TORCH_DTYPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--verify-repeats", type=int, default=9)
    ap.add_argument("--workdir", type=Path, default=None, help="checkpoint dir (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=Path("bench_out/decode_bench.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        paths = make_checkpoints(workdir, args.shapes)
        decode = []
        for shape in args.shapes:
            for dtype in args.dtypes:
                r = bench_decode(paths[shape], dtype, args, prompt)
                decode.append({"shape": shape, "dtype": dtype, **r})
                print(f"[decode] stories{shape} {dtype}: leapfrog {r['leapfrog_tok_s']:.1f} tok/s, "
                      f"transformers {r['transformers_tok_s']:.1f} tok/s", flush=True)
        verify = {}
        for shape in [s for s in ("110M", "15M") if s in args.shapes]:
            for dtype in args.dtypes:
                t = verify_curve(paths[shape], dtype, args.verify_repeats)
                verify[f"{shape}/{dtype}"] = {"t1_ms": t[0] * 1e3, "rel": [x / t[0] for x in t]}

    lines = [f"Decode, batch 1, {args.max_tokens} new tokens from a {PROMPT_LEN}-token prompt, "
             f"{args.threads} threads, median of {args.rounds} rounds", "",
             "| shape | dtype | leapfrog tok/s | transformers tok/s | ratio | greedy ids equal |",
             "|---|---|---:|---:|---:|---|"]
    for r in decode:
        eq = "yes" if r["greedy_match"] else f"no (first diff at {r['first_mismatch']})"
        lines.append(f"| stories{r['shape']} | {r['dtype']} | {r['leapfrog_tok_s']:.1f} | "
                     f"{r['transformers_tok_s']:.1f} | {r['ratio']:.2f} | {eq} |")
    noisy = [f"stories{r['shape']}/{r['dtype']} {who}" for r in decode for who in ("leapfrog", "transformers")
             if max(r[f"{who}_times_s"]) > 1.3 * min(r[f"{who}_times_s"])]
    if noisy:
        lines += ["", "warning: round times vary by >30% (noisy machine?): " + ", ".join(noisy)]
    if verify:
        keys = list(verify)
        lines += ["", f"Verify cost: one leapfrog target forward over s new tokens at depth {VERIFY_DEPTH}, "
                  f"t(s)/t(1), median of {args.verify_repeats}", "",
                  "| s | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
        lines.append("| t(1) ms | " + " | ".join(f"{verify[k]['t1_ms']:.2f}" for k in keys) + " |")
        for s in range(VERIFY_MAX_S):
            lines.append(f"| {s + 1} | " + " | ".join(f"{verify[k]['rel'][s]:.2f}" for k in keys) + " |")
    print("\n" + "\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": args.threads,
            "rounds": args.rounds, "max_tokens": args.max_tokens, "prompt_len": PROMPT_LEN,
            "machine": platform.machine(), "processor": platform.processor()}
    args.out.write_text(json.dumps({"meta": meta, "decode": decode, "verify": verify}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
