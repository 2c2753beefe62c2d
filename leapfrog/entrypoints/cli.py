"""``leapfrog`` command line: ``leapfrog generate`` (flags named as vLLM's)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from leapfrog.errors import LeapfrogError


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt or a file of prompts")
    p.add_argument("prompt", nargs="?", help="prompt text (default: a Python snippet)")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: the built-in demo model)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--prompts-file", default=None, help="a text file, one prompt per line (or JSONL with 'prompt')")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; "none" turns it off')
    p.add_argument("--compare", action="store_true", help="also run without speculation and print the speedup")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1)


def _read_prompts(args) -> list[str]:
    if args.prompts_file:
        lines = [ln for ln in open(args.prompts_file, encoding="utf-8").read().splitlines() if ln.strip()]
        out = []
        for ln in lines:
            if ln.lstrip().startswith("{"):
                out.append(json.loads(ln)["prompt"])
            else:
                out.append(ln.replace("\\n", "\n"))
        return out
    return [args.prompt if args.prompt is not None else "def quicksort(arr):"]


def _spec_arg(text: str | None):
    if text is None:
        return None, False
    if text.strip().lower() == "none":
        return None, True
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise LeapfrogError(f"--speculative-config is not valid JSON: {e}") from None
    return spec, True


def cmd_generate(args) -> int:
    from leapfrog import LLM, SamplingParams

    spec, given = _spec_arg(args.speculative_config)
    prompts = _read_prompts(args)
    sp = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                        stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty)
    common = dict(tokenizer=args.tokenizer, dtype=args.dtype, seed=args.seed, device=args.device,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    model = args.model
    if model is None:
        from leapfrog.demo import default_model
        model, default_spec = default_model()
        if not given:
            spec = default_spec
        print(f"[leapfrog] no --model given: using the built-in default model at {model}", file=sys.stderr)
    llm = LLM(model=model, speculative_config=spec, **common)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    n_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
    for o in outs:
        for c in o.outputs:
            print(f"{o.prompt}{c.text}")
            print(f"--- [{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    line = f"[leapfrog] {n_tok} tokens in {dt:.2f}s = {n_tok / dt:.1f} tokens/s"
    m = llm.get_metrics()
    if spec is not None and m["num_draft_tokens"]:
        line += (f" | speculation {spec.get('method')}: acceptance rate {m['acceptance_rate']:.2f}, "
                 f"mean acceptance length {m['mean_acceptance_length']:.2f}")
    print(line)
    if args.compare and spec is not None:
        base = LLM(model=model, speculative_config=None, **common)
        base.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        t1 = time.perf_counter()
        base_outs = base.generate(prompts, sp, use_tqdm=False)
        bt = time.perf_counter() - t1
        bn = sum(len(c.token_ids) for o in base_outs for c in o.outputs)
        same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, base_outs))
        print(f"[leapfrog] without speculation: {bn / bt:.1f} tokens/s; speedup {(n_tok / dt) / (bn / bt):.2f}x"
              + (f"; identical output: {same}" if sp.temperature == 0 else ""))
    return 0


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model", nargs="?", default=None, help="HF directory or hub id (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond this get 503")
    p.add_argument("--speculative-config", default=None)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set LEAPFROG_API_KEY)")
    p.add_argument("--served-model-name", default=None)


def cmd_serve(args) -> int:
    import os

    import uvicorn

    from leapfrog.config import EngineConfig
    from leapfrog.engine.engine import LLMEngine
    from leapfrog.entrypoints.openai.api_server import build_app

    spec, given = _spec_arg(args.speculative_config)
    model = args.model
    if model is None:
        from leapfrog.demo import default_model
        model, default_spec = default_model()
        spec = spec if given else default_spec
    engine = LLMEngine(EngineConfig(model=str(model), tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                                    seed=args.seed, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                    speculative_config=spec))
    name = args.served_model_name or (args.model or "leapfrog-default")
    api_key = args.api_key or os.environ.get("LEAPFROG_API_KEY") or None
    app = build_app(engine, name, api_key=api_key, max_waiting=args.max_waiting)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=10)
    return 0


def _check_parser(sub) -> None:
    from leapfrog.entrypoints.check import add_arguments
    p = sub.add_parser("check", help="prove that speculation does not change the output (greedy + sampling)")
    add_arguments(p)


def cmd_check(args) -> int:
    from leapfrog.entrypoints.check import cmd_check as run
    return run(args)


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speculation (speedup, acceptance, latency) on your own workload")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: the built-in demo model)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--speculative-config", action="append", default=None,
                   help='JSON (repeatable), e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                        '"none" (no speculation) is always a contender')
    p.add_argument("--workload", action="extend", nargs="+", default=None,
                   help="JSONL workload (repeatable): Spec-Bench/MT-bench/EAGLE question.jsonl, HumanEval, GSM8K, "
                        "EditEval, or your own with 'prompt' or 'messages' (+ optional 'category')")
    p.add_argument("--limit", type=int, default=None, help="at most N items per category of each workload")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out", help="folder for bench.json, bench.csv and the plots")
    p.add_argument("--no-plots", action="store_true")


def cmd_bench(args) -> int:
    from leapfrog.bench.runner import format_recommendation, format_table, run_bench
    from leapfrog.bench.workloads import WorkloadItem, load_workload

    specs = []
    for text in args.speculative_config or []:
        spec, _ = _spec_arg(text)
        if spec is not None and not isinstance(spec, dict):
            raise LeapfrogError(f"--speculative-config must be a JSON object or none, got {text!r}")
        specs.append(spec)
    if args.limit is not None and args.limit < 1:
        raise LeapfrogError("--limit must be >= 1")
    items = []
    for path in args.workload or []:
        items += load_workload(path, args.limit)
    model = args.model
    if model is None:
        from leapfrog.demo import default_model
        model, default_spec = default_model()
        if not specs:
            specs = [default_spec]
        print(f"[leapfrog] no --model given: using the built-in default model at {model}", file=sys.stderr)
    if not args.workload:
        from leapfrog.entrypoints.check import DEFAULT_PROMPTS
        items = [WorkloadItem("default", p, None, str(i)) for i, p in enumerate(DEFAULT_PROMPTS[:args.limit])]
    if not any(s is not None for s in specs):
        raise LeapfrogError("leapfrog bench needs at least one --speculative-config to compare with none")
    res = run_bench(str(model), specs, items, temperatures=args.temperature, max_tokens=args.max_tokens,
                    batch_sizes=args.batch_size, repeats=args.repeats, warmup=args.warmup, out_dir=args.out,
                    dtype=args.dtype, threads=args.threads, tokenizer=args.tokenizer, seed=args.seed,
                    max_model_len=args.max_model_len, plots=not args.no_plots)
    print(format_table(res))
    print()
    print(format_recommendation(res))
    print(f"\n[leapfrog bench] wrote {', '.join(res.files.values())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="leapfrog", description="speculative-decoding LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _check_parser(sub)
    _bench_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "check":
            return cmd_check(args)
        if args.command == "bench":
            return cmd_bench(args)
    except (LeapfrogError, OSError) as e:
        print(f"leapfrog: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
