"""Load generator for the OpenAI server: speculation on vs off, side by side, one process.

Two leapfrog servers on 127.0.0.1 share one random-init checkpoint (the stories110M layer shape
by default, with the vocabulary of a 1024-token BPE tokenizer, so that every generated token
decodes to text and streamed chunks time real tokens); one runs adaptive speculation, the other none. For each concurrency level, the same
prompts (Spec-Bench questions from ../shared/data, or synthetic ones) are replayed through
streaming /v1/completions by N concurrent clients, first against one server, then the other
(alternating which goes first). Reported per level and contender: throughput (tokens/s),
TTFT p50/p99, inter-token latency p50/p99, acceptance; ratios on vs off. Inter-token latency is
per request (latency - TTFT) / (tokens - 1), vLLM's TPOT (a speculative step streams several
tokens in one chunk, so chunk gaps would not be per token).
Plots (PNG) of throughput and ITL against concurrency.

Random weights make a real drafter's acceptance meaningless, so by default the drafter is an
*oracle* that knows each prompt's greedy continuation and corrupts each drafted token with
probability 1 - alpha (``--proposer ngram`` uses prompt lookup instead).

    python benchmarks/serve_bench.py --concurrency 1 4 16 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_bench import SHAPES  # noqa: E402
from spec_bench import SCRIPT, OracleProposer  # noqa: E402  (registers "oracle_bench")

from leapfrog import LLM, SamplingParams  # noqa: E402
from leapfrog.config import EngineConfig  # noqa: E402
from leapfrog.engine.engine import LLMEngine  # noqa: E402
from leapfrog.entrypoints.openai.api_server import build_app  # noqa: E402


def load_prompts(data: Path, n: int, tok) -> list[list[int]]:
    f = data / "spec_bench" / "question.jsonl"
    if f.is_file():
        texts = [json.loads(ln)["turns"][0] for ln in f.read_text().splitlines()]
    else:
        texts = [f"Question {i}: explain topic number {i} in detail." for i in range(n)]
    random.Random(0).shuffle(texts)
    return [tok.encode(t)[:96] for t in texts[:n]]


async def client_run(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    ttft, itl, tokens, spec = [], [], 0, {"num_draft_tokens": 0, "num_accepted_tokens": 0}
    queue = list(prompts)

    async def worker(h: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            p = queue.pop()
            body = {"model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first_at = None
            async with h.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first_at is None:
                        first_at = time.perf_counter()
                        ttft.append(first_at - t0)
                    if chunk.get("usage"):
                        u = chunk["usage"]
                        tokens += u["completion_tokens"]
                        for k in spec:
                            spec[k] += u["speculative"][k]
                        if u["completion_tokens"] > 1:
                            itl.append((time.perf_counter() - first_at) / (u["completion_tokens"] - 1))

    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as h:
        await asyncio.gather(*[worker(h) for _ in range(concurrency)])
    wall = time.perf_counter() - t
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)  # noqa: E731
    return dict(throughput=tokens / wall, ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), itl_p50=pct(itl, 50),
                itl_p99=pct(itl, 99), acceptance=spec["num_accepted_tokens"] / max(1, spec["num_draft_tokens"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="110M", choices=["15M", "42M", "110M"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--proposer", default="oracle", choices=["oracle", "ngram"])
    ap.add_argument("--alpha", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: max(8, 2 x concurrency)")
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_out/serve_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from leapfrog.entrypoints.openai.server_thread import ServerThread

    from leapfrog.demo import build_tokenizer, save_random_llama, stdlib_sample_text
    path = Path(args.workdir or tempfile.mkdtemp(prefix="lf-serve-")) / f"serve{args.shape}"
    if not (path / "config.json").is_file():
        dim, layers, heads, inter = SHAPES[args.shape]
        save_random_llama(path, build_tokenizer(stdlib_sample_text(), 1024), seed=0, hidden_size=dim,
                          intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=heads, max_position_embeddings=1024)
    ref = LLM(model=str(path), dtype=args.dtype, speculative_config=None, max_model_len=512)
    prompts_all = load_prompts(Path(args.data), max(args.concurrency) * 2, ref.get_tokenizer())
    outs = ref.generate([{"prompt_token_ids": p} for p in prompts_all],
                        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts_all, outs):
        SCRIPT[tuple(p)] = o.outputs[0].token_ids
    OracleProposer.alpha = args.alpha
    method = {"method": "oracle_bench"} if args.proposer == "oracle" else {"method": "ngram"}
    spec = {**method, "num_speculative_tokens": args.k, "adaptive": True}
    servers = {}
    for name, sc in (("spec", spec), ("base", None)):
        eng = LLMEngine(EngineConfig(model=str(path), dtype=args.dtype, max_model_len=512,
                                     max_num_seqs=args.max_num_seqs, speculative_config=sc))
        servers[name] = ServerThread(build_app(eng, "m", max_waiting=10_000)).__enter__()
    rows = []
    try:
        for i, c in enumerate(args.concurrency):
            n = args.requests_per_level or max(8, 2 * c)
            prompts = prompts_all[:n]
            order = ["spec", "base"] if i % 2 == 0 else ["base", "spec"]
            res = {name: asyncio.run(client_run(servers[name].url, prompts, c, args.max_tokens)) for name in order}
            row = {"concurrency": c, "requests": n}
            for name in ("spec", "base"):
                row.update({f"{name}_{k}": v for k, v in res[name].items()})
            row["throughput_ratio"] = row["spec_throughput"] / row["base_throughput"]
            row["itl_p50_gain"] = row["base_itl_p50"] / max(row["spec_itl_p50"], 1e-9)
            rows.append(row)
            print(f"c={c}: throughput {row['spec_throughput']:.1f} vs {row['base_throughput']:.1f} tok/s "
                  f"({row['throughput_ratio']:.2f}x), ITL p50 {row['spec_itl_p50'] * 1e3:.1f} vs "
                  f"{row['base_itl_p50'] * 1e3:.1f} ms ({row['itl_p50_gain']:.2f}x better), "
                  f"acceptance {row['spec_acceptance']:.2f}", flush=True)
    finally:
        for s in servers.values():
            s.__exit__(None, None, None)
    cols = ["concurrency", "spec_throughput", "base_throughput", "throughput_ratio", "spec_itl_p50", "base_itl_p50",
            "itl_p50_gain", "spec_itl_p99", "base_itl_p99", "spec_ttft_p50", "base_ttft_p50", "spec_acceptance"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    cs = [r["concurrency"] for r in rows]
    for name in ("spec", "base"):
        ax[0].plot(cs, [r[f"{name}_throughput"] for r in rows], "o-", label=name)
        ax[1].plot(cs, [r[f"{name}_itl_p50"] * 1e3 for r in rows], "o-", label=name)
    ax[0].set(xscale="log", xlabel="concurrency", ylabel="tokens/s", title="throughput")
    ax[1].set(xscale="log", xlabel="concurrency", ylabel="ms", title="inter-token latency p50")
    for a in ax:
        a.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
