"""``leapfrog`` command line: ``leapfrog generate`` (flags named as vLLM's)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from leapfrog.entrypoints.argtypes import (non_empty, nonneg_float, nonneg_int, output_dir, output_file, port,
                                          positive_float, positive_int, share)
from leapfrog.errors import ConfigError, LeapfrogError
from leapfrog.utils import env_off, freeze_heap


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt or a file of prompts")
    p.add_argument("prompt", nargs="?", help="prompt text (default: a Python snippet)")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: the built-in demo model)")
    p.add_argument("--prompts-file", default=None, help="a text file, one prompt per line (or JSONL with 'prompt')")
    _add_engine_args(p)
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; "none" turns it off')
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="also run without speculation and print the speedup (default: on for the built-in demo model)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the most likely (0 = off)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most")
    p.add_argument("--min-tokens", type=int, default=0, help="EOS and stop token ids are suppressed before this")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=None, help="token ids that end the output")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help=">1 discourages repeated tokens (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from tokens already generated")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted once per earlier occurrence")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by generate and serve."""
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and compute dtype (auto: the checkpoint's)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--seed", type=int, default=0,
                   help="engine seed: the random streams of requests that carry no seed of their own (vLLM's --seed)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length, prompt + output (default: the model's, at most 4096)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (KV cache rows)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every token's logits bitwise independent of the batch: greedy output with speculation "
                        "equals without and any batch equals alone, in bf16 too (slower)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-enforce-eager compiles the decode/verify forwards of the target and of a draft model "
                        "at start-up (the fast path; 10-30 s per graph on 2 CPU cores)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps per engine step, as one compiled graph (with --no-enforce-eager; "
                        "with a draft_model or EAGLE chains, that many speculation rounds, a graph each, back to back; "
                        "tokens arrive that many steps at a time)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8"],
                   help="quantization of the target's decoder layers at load: weight-only int8/int4, or w8a8 "
                        "(int8 weights and rows, x86 CPUs with AVX2); speculation stays lossless relative to the "
                        "quantized target")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone (measure a model shape without its files)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the target over N processes (spawned here; under torchrun, one per rank: rank 0 "
                        "serves, the others compute). Eager only; drafters run on rank 0")


def _torchrun_worker(args) -> int | None:
    """Under torchrun every process runs the same command: ranks > 0 become tensor-parallel
    workers here (-> their exit code); rank 0 (and any run outside torchrun) gets None and goes on."""
    from leapfrog.parallel.group import launched_by_torchrun
    if args.tensor_parallel_size <= 1 or not launched_by_torchrun() or int(os.environ["RANK"]) == 0:
        return None
    from leapfrog.config import resolve_device
    from leapfrog.parallel.worker import run_worker
    return run_worker(args.tensor_parallel_size, int(os.environ["RANK"]), str(resolve_device(args.device)))


def _read_prompts(args) -> list[str | dict]:
    """--prompts-file's prompts (token-id lines as LLM.generate's prompt dicts), or --prompt."""
    if args.prompts_file:
        from leapfrog.entrypoints.prompts_file import read_prompts
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in read_prompts(args.prompts_file)]
    return [args.prompt if args.prompt is not None else "def quicksort(arr):"]


def _spec_arg(text: str | None, validate: bool = True):
    """--speculative-config's text -> (the dict or None, whether it was given); ``validate``: as a
    speculative_config, before any model loads (bench's contenders carry keys of their own)."""
    if text is None:
        return None, False
    if text.strip().lower() in ("none", "null"):   # (null: as JSON writes None)
        return None, True

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:   # (json.loads kept the last silently)
        keys = [k for k, _ in pairs]
        if (twice := next((k for k in keys if keys.count(k) > 1), None)) is not None:
            raise LeapfrogError(f"--speculative-config gives {twice!r} twice")
        return dict(pairs)

    try:
        spec = json.loads(text, object_pairs_hook=no_repeats)
    except json.JSONDecodeError as e:
        raise LeapfrogError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise LeapfrogError(f"--speculative-config must be a JSON object or none, got {text!r}")
    if validate:   # its own errors before any model loads (minutes, for a large one)
        from leapfrog.spec_decode.config import SpeculativeConfig
        SpeculativeConfig.from_dict(spec)
    return spec, True


def cmd_generate(args) -> int:
    from leapfrog import LLM, SamplingParams

    spec, given = _spec_arg(args.speculative_config)
    prompts = _read_prompts(args)
    sp = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        min_p=args.min_p, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                        stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty)
    if (code := _torchrun_worker(args)) is not None:
        return code
    common = dict(tokenizer=args.tokenizer, dtype=args.dtype, seed=args.seed, device=args.device,
                  tensor_parallel_size=args.tensor_parallel_size,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  batch_invariant=args.batch_invariant, enforce_eager=args.enforce_eager,
                  quantization=args.quantization, load_format=args.load_format,
                  num_scheduler_steps=args.num_scheduler_steps)
    model = args.model
    if model is None:
        from leapfrog.demo import default_model
        model, default_spec = default_model(args.dtype, getattr(args, "device", "auto"))
        if not given:
            spec = default_spec
        if args.compare is None:
            args.compare = True
        print(f"[leapfrog] no --model given: using the built-in default model at {model}", file=sys.stderr)
    llm = LLM(model=model, speculative_config=spec, **common)
    # the warm-up takes the run's settings (others would load ops the run never uses)
    warm = dataclasses.replace(sp, max_tokens=4, min_tokens=min(sp.min_tokens, 4))
    if args.compare:   # time both runs warm
        llm.generate(prompts[:1], warm, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    n_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
    for o in outs:
        for c in o.outputs:
            print(f"{o.prompt if o.prompt is not None else ''}{c.text}")
            print(f"--- [{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    line = f"[leapfrog] {n_tok} tokens in {dt:.2f}s = {n_tok / dt:.1f} tokens/s"
    from leapfrog.outputs import SpecMetrics
    spec_m = SpecMetrics()
    for o in outs:
        spec_m.merge(o.metrics.spec)
    m = spec_m.to_dict()
    if spec is not None and m["num_draft_tokens"]:
        line += (f" | speculation {spec.get('method')}: acceptance rate {m['acceptance_rate']:.2f}, "
                 f"mean acceptance length {m['mean_acceptance_length']:.2f}")
    print(line)
    llm.close()   # tensor-parallel workers: one group at a time
    from leapfrog.parallel.group import launched_by_torchrun
    if args.compare and spec is not None and not (args.tensor_parallel_size > 1 and launched_by_torchrun()):
        with LLM(model=model, speculative_config=None, **common) as base:   # torchrun's workers served one engine
            base.generate(prompts[:1], warm, use_tqdm=False)  # warm-up
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
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8000, help="port to listen on")
    p.add_argument("--max-waiting", type=positive_int, default=256, help="queued requests beyond this get 503")
    _add_engine_args(p)
    p.add_argument("--speculative-config", default=None,
                   help="JSON, e.g. '{\"method\": \"suffix\", \"num_speculative_tokens\": 24}' (default with the "
                        "built-in model: its EAGLE-3 head, a chain of 7 on AVX-512 BF16 CPUs, else 5); 'none' turns "
                        "speculation off")
    p.add_argument("--api-key", default=None, type=non_empty,
                   help="require 'Authorization: Bearer KEY' (or set LEAPFROG_API_KEY)")
    p.add_argument("--served-model-name", default=None, type=non_empty,
                   help="the model name clients send (default: the model argument; 'leapfrog-default' for the "
                        "built-in model)")
    p.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
                   help="what logprobs report: the target's raw distribution (default) or the processed one the "
                        "sampler draws from")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: prompts must be token ids (/v1/completions), no chat, no stop strings")


def cmd_serve(args) -> int:
    import uvicorn

    from leapfrog.config import EngineConfig
    from leapfrog.engine.engine import LLMEngine
    from leapfrog.entrypoints.openai.api_server import LeapfrogServer, build_app

    if (code := _torchrun_worker(args)) is not None:
        return code
    spec, given = _spec_arg(args.speculative_config)
    env_key = os.environ.get("LEAPFROG_API_KEY")
    if env_key is not None and not env_key.strip() and args.api_key is None:
        raise LeapfrogError("LEAPFROG_API_KEY is set but empty: unset it to serve without a key, or give a key")
    _check_listen(args.host, args.port)   # before the model loads (minutes, for a large one)
    model = args.model
    if model is None:
        from leapfrog.demo import default_model
        model, default_spec = default_model(args.dtype, getattr(args, "device", "auto"))
        spec = spec if given else default_spec
    engine = LLMEngine(EngineConfig(tensor_parallel_size=args.tensor_parallel_size, model=str(model),
                                    tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                                    seed=args.seed, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                    speculative_config=spec, batch_invariant=args.batch_invariant,
                                    enforce_eager=args.enforce_eager, quantization=args.quantization,
                                    load_format=args.load_format, skip_tokenizer_init=args.skip_tokenizer_init,
                                    logprobs_mode=args.logprobs_mode,
                                    num_scheduler_steps=args.num_scheduler_steps))
    engine.expect_sampled_requests()
    name = args.served_model_name or (args.model or "leapfrog-default")
    api_key = args.api_key or os.environ.get("LEAPFROG_API_KEY") or None
    app = build_app(engine, name, api_key=api_key, max_waiting=args.max_waiting)
    if not env_off("LEAPFROG_FREEZE_GC"):   # the start-up heap out of the collector's scans (utils.freeze_heap)
        frozen = freeze_heap()
        print(f"[leapfrog serve] froze {frozen.objects} start-up objects out of the garbage collector's scans "
              f"(a full collection took {frozen.collect_s * 1e3:.0f} ms; LEAPFROG_FREEZE_GC=0 keeps them)",
              file=sys.stderr)
    server = LeapfrogServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=5))
    died: list[str] = []

    def worker_died(why: str) -> None:   # a tensor-parallel rank is gone: end every request, exit with an error
        died.append(why)
        app.state.engine.begin_shutdown()
        server.should_exit = True   # (not handle_exit: uvicorn would re-raise that signal and hide the code)

    engine.on_worker_death = worker_died
    try:
        server.run()
    finally:
        engine.close()
    if died:
        print(f"[leapfrog serve] {died[0]}; the server stopped", file=sys.stderr)
        return 1
    return 0


def _check_listen(host: str, port: int) -> None:
    """--host/--port the server can listen on, found out now rather than after the model loaded."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
            sock.bind(addr)
    except OSError as e:
        raise LeapfrogError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def _check_parser(sub) -> None:
    from leapfrog.entrypoints.check import add_arguments
    p = sub.add_parser("check", help="prove that speculation does not change the output (greedy + sampling)",
                       epilog="exit code: 0 pass, 1 fail, 2 bad input, 3 nothing tested (no token drafted)")
    add_arguments(p)


def cmd_check(args) -> int:
    from leapfrog.entrypoints.check import cmd_check as run
    return run(args)


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speculation (speedup, acceptance, latency) on your own workload")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: the built-in demo model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    p.add_argument("--speculative-config", action="append", default=None,
                   help='JSON (repeatable), e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                        '"none" (no speculation) is always a contender')
    p.add_argument("--workload", action="extend", nargs="+", default=None,
                   help="JSONL workload (repeatable): Spec-Bench/MT-bench/EAGLE question.jsonl, HumanEval, GSM8K, "
                        "EditEval, or your own with 'prompt' or 'messages' (+ optional 'category'); or a built-in "
                        "one made from the built-in model's held-out files: 'rewrite' (with predictions), "
                        "'rewrite-shown' (the same with the original shown in the prompt) or "
                        "'variations' (functions repeated with renamed arguments)")
    p.add_argument("--limit", type=int, default=None, help="at most N items per category of each workload")
    p.add_argument("--temperature", type=nonneg_float, nargs="+", default=[0.0],
                   help="temperatures to measure (0 = greedy)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="concurrent requests to measure")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved rounds per contender (95%% intervals need at least 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per contender first")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and compute dtype (auto: the checkpoint's)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's, <= 4096)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (sampled requests)")
    p.add_argument("--request-seed", type=int, default=None,
                   help="seed every request (item i: this + i): sampled outputs comparable across contenders, "
                        "verified by matching (default: unseeded, rejection sampling)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-enforce-eager measures every contender on the compiled fast path (compiled at load)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="with --no-enforce-eager: decode steps (speculation rounds) per engine step for none and "
                        "every contender that can run rounds (draft models, EAGLE chains, 'auto' tree sizes)")
    p.add_argument("--continuous", action="store_true",
                   help="continuous batching: each category's items in one call, at most --batch-size running at a "
                        "time (default: static batches of --batch-size, one after another)")
    p.add_argument("--greedy-share", type=share, default=0.0,
                   help="a mixed load: in the cells of a --temperature above 0 this share of the requests runs "
                        "greedy (spread evenly through the workload), the rest sampled")
    p.add_argument("--share-target", action=argparse.BooleanOptionalAction, default=None,
                   help="every contender runs on one loaded copy of the target's weights (no speculation's), as one "
                        "server's engine does (default: where the engine allows it; --no-share-target: a copy each, "
                        "which can measure apart by several per cent even when identical, and each starts cold "
                        "after the others' batches)")
    p.add_argument("--out", default="bench_out", type=output_dir, help="folder for bench.json, bench.csv and the plots")
    p.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    p.add_argument("--backend", action="append", default=None, choices=["leapfrog", "transformers"],
                   help="transformers: also run each config's transformers counterpart (generate, assisted "
                        "generation with the same draft, prompt lookup) in the same interleaved rounds")


def cmd_bench(args) -> int:
    from leapfrog.bench.runner import format_peers, format_recommendation, format_table, run_bench
    from leapfrog.bench.workloads import WorkloadItem, load_workload

    specs = []
    for text in args.speculative_config or []:
        specs.append(_spec_arg(text, validate=False)[0])
    if args.limit is not None and args.limit < 1:
        raise LeapfrogError("--limit must be >= 1")
    from leapfrog.bench.edits import BUILTIN, builtin_workload
    from leapfrog.demo import DEMO_DIR
    items = []
    for path in args.workload or []:
        if path in BUILTIN and not Path(path).exists():
            items += builtin_workload(path, DEMO_DIR, args.limit, args.seed)
        else:
            items += load_workload(path, args.limit)
    model = args.model
    if model is None:
        from leapfrog.demo import default_model
        model, default_spec = default_model(args.dtype, getattr(args, "device", "auto"))
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
                    max_model_len=args.max_model_len, plots=not args.no_plots,
                    backends=["leapfrog", *(args.backend or [])], request_seed=args.request_seed,
                    enforce_eager=args.enforce_eager, num_scheduler_steps=args.num_scheduler_steps,
                    continuous=args.continuous, share_target=args.share_target, greedy_share=args.greedy_share)
    print(format_table(res))
    if res.peer_ratios:
        print()
        print(format_peers(res))
    print()
    print(format_recommendation(res))
    print(f"\n[leapfrog bench] wrote {', '.join(res.files.values())}")
    return 0


def _train_draft_parser(sub) -> None:
    p = sub.add_parser("train-draft", help="train a drafter for a target: a small draft model (same tokenizer) "
                                           "or an EAGLE-1/EAGLE-3 head")
    p.add_argument("target", help="target checkpoint: HF directory or hub id")
    p.add_argument("--method", default="draft_model", choices=["draft_model", "eagle", "eagle3"],
                   help="draft_model: distil a small Llama; eagle / eagle3: train an EAGLE-1 / EAGLE-3 head on the "
                        "target's features (EAGLE-3 with training-time test)")
    p.add_argument("--corpus", required=True,
                   help="training text: a file, a directory of text files, or JSONL ('text', 'prompt' or 'messages'; "
                        "EAGLE also 'token_ids', for targets without a tokenizer)")
    p.add_argument("--out", required=True, type=output_dir, help="output directory (an HF checkpoint that draft_model loads, or the "
                                                "EAGLE head that method eagle/eagle3 loads)")
    p.add_argument("--data-mode", default="corpus", choices=["corpus", "generate"],
                   help="corpus: the target's distributions on your text; generate: on the target's own "
                        "continuations of your texts used as prompts (self-distillation)")
    p.add_argument("--init-draft", default=None,
                   help="fine-tune this draft checkpoint (draft_model) or EAGLE head (eagle / eagle3: its shape and "
                        "draft vocabulary are kept) instead of starting from scratch")
    p.add_argument("--hidden-size", type=positive_int, default=None, help="draft_model: the draft's shape (default 256)")
    p.add_argument("--intermediate-size", type=positive_int, default=None, help="draft_model: the draft's shape (default 512)")
    p.add_argument("--num-layers", type=positive_int, default=None, help="draft_model: the draft's shape (default 2)")
    p.add_argument("--num-heads", type=positive_int, default=None, help="draft_model: the draft's shape (default 4)")
    p.add_argument("--num-kv-heads", type=positive_int, default=None, help="draft_model (default: --num-heads)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--ce-weight", type=nonneg_float, default=None,
                   help="draft_model: add this x cross-entropy on the data's tokens (default 0)")
    e = p.add_argument_group("EAGLE (--method eagle / eagle3)")
    e.add_argument("--ttt-steps", type=int, default=None,
                   help="draft steps unrolled per batch (training-time test; default: eagle 1, eagle3 4)")
    e.add_argument("--draft-vocab-size", type=positive_int, default=None,
                   help="eagle3: the most frequent training tokens the head drafts from (default: half the "
                        "vocabulary, at most 32000; all of one up to 1024)")
    e.add_argument("--head-intermediate-size", type=positive_int, default=None, help="the head's MLP width (default: the "
                                                                           "target's)")
    e.add_argument("--head-kv-heads", type=positive_int, default=None, help="the head's KV heads (default: the target's)")
    e.add_argument("--calibration", default=None, choices=["greedy", "none"],
                   help="eagle3: after training, scale the draft logits so that the tree's path confidences "
                        "predict greedy (temperature 0) acceptance (default); none: keep the KL-trained q")
    e.add_argument("--eagle-topk", type=positive_int, default=None,
                   help="eagle_topk of the acceptance test and of the hint (default 4)")
    e.add_argument("--resume", action="store_true",
                   help="continue the training checkpoint in --checkpoint-dir (an EAGLE run refuses to overwrite one "
                        "without it; draft_model always resumes)")
    p.add_argument("--heldout-fraction", type=float, default=0.05, help="files held out for evaluation")
    p.add_argument("--gen-tokens", type=int, default=128, help="generate mode: tokens per continuation")
    p.add_argument("--gen-temperature", type=float, nargs="+", default=[1.0],
                   help="generate mode: 0 = greedy continuations; several values: a mix, the prompts shared evenly "
                        "among them at random (seeded); repeat a value to weight it")
    p.add_argument("--gen-prompt-tokens", type=int, default=32, help="generate mode: prompt length in tokens")
    p.add_argument("--gen-prompts-per-doc", type=int, default=1, help="generate mode: prompts cut from each document")
    p.add_argument("--eval-prompts", type=nonneg_int, default=16, help="held-out prompts for the acceptance test (0: skip)")
    p.add_argument("--eval-k", type=positive_int, default=None,
                   help="num_speculative_tokens of the acceptance test and the hint (default: draft_model 4, EAGLE 5)")
    p.add_argument("--eval-max-tokens", type=positive_int, default=64, help="tokens generated per held-out prompt")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--bf16", default="auto", choices=["auto", "on", "off"],
                   help="bf16 autocast: auto = on for CUDA and CPUs with native bf16")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, type=output_dir,
                   help="default: OUT.ckpt; draft_model resumes from it, EAGLE with --resume")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--json", default=None, type=output_file, help="also write the summary to this file")


def cmd_train_draft(args) -> int:
    from leapfrog.spec_decode.config import MAX_SPECULATIVE_TOKENS
    from leapfrog.train.loop import TrainConfig

    # a flag the method never reads is refused, not ignored; so are shape flags with a draft to fine-tune
    head_shape = {"--draft-vocab-size": args.draft_vocab_size, "--head-intermediate-size": args.head_intermediate_size,
                  "--head-kv-heads": args.head_kv_heads}
    draft_shape = {"--hidden-size": args.hidden_size, "--intermediate-size": args.intermediate_size,
                   "--num-layers": args.num_layers, "--num-heads": args.num_heads, "--num-kv-heads": args.num_kv_heads}
    eagle_only = {"--ttt-steps": args.ttt_steps, **head_shape, "--eagle-topk": args.eagle_topk,
                  "--calibration": args.calibration}
    draft_only = {**draft_shape, "--ce-weight": args.ce_weight}
    if args.method == "draft_model":
        unread, own_shape, why = eagle_only, draft_shape, "EAGLE options; add --method eagle3 (or eagle)"
    else:
        unread, own_shape, why = draft_only, head_shape, ("--method draft_model options (an EAGLE head takes the "
                                                          "target's shape; see --head-intermediate-size and "
                                                          "--head-kv-heads)")
    if given := [k for k, v in unread.items() if v is not None]:
        raise LeapfrogError(f"{', '.join(given)}: {why}")
    if args.init_draft is not None and (given := [k for k, v in own_shape.items() if v is not None]):
        raise LeapfrogError(f"{', '.join(given)}: --init-draft {args.init_draft} keeps its own shape")
    if args.method == "eagle" and (args.draft_vocab_size is not None or args.calibration is not None):
        raise LeapfrogError("--draft-vocab-size and --calibration are EAGLE-3 options (an EAGLE-1 head drafts over "
                            "the whole vocabulary); add --method eagle3")
    if args.draft_vocab_size == 1:
        raise LeapfrogError("--draft-vocab-size 1: a head with one token to draft learns nothing (at least 2)")
    if args.eval_k is not None and args.eval_k > MAX_SPECULATIVE_TOKENS:
        raise LeapfrogError(f"--eval-k {args.eval_k}: at most {MAX_SPECULATIVE_TOKENS} (num_speculative_tokens)")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=args.warmup_steps, seed=args.seed, device=args.device,
                      checkpoint_every=args.checkpoint_every, eval_every=max(1, min(50, args.steps // 4)))
    if args.method != "draft_model":
        return _train_eagle(args, cfg)
    from leapfrog.train.distill import DraftShape, train_draft

    k = args.eval_k or 4
    given = {"hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
             "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_heads,
             "num_key_value_heads": args.num_kv_heads or args.num_heads}
    shape = DraftShape(**{k: v for k, v in given.items() if v is not None})
    res = train_draft(args.target, args.corpus, args.out, shape=shape, init_draft=args.init_draft,
                      train_config=cfg, data_mode=args.data_mode, ce_weight=args.ce_weight or 0.0,
                      heldout_fraction=args.heldout_fraction, gen_tokens=args.gen_tokens,
                      gen_temperature=_temperatures(args.gen_temperature), gen_prompt_tokens=args.gen_prompt_tokens,
                      gen_prompts_per_doc=args.gen_prompts_per_doc, eval_prompts=args.eval_prompts, eval_k=k,
                      eval_max_tokens=args.eval_max_tokens, save_dtype=args.save_dtype, bf16=args.bf16,
                      checkpoint_dir=args.checkpoint_dir)
    s = res.summary()
    print(f"[leapfrog train-draft] draft {s['draft_parameters']:,} parameters "
          f"({s['draft_parameters'] / s['target_parameters']:.3f} of the target), {s['steps']} steps, "
          f"{s['train_tokens']:,} tokens; held-out KL {s['heldout_kl_before']:.3f} -> {s['heldout_kl_after']:.3f}")
    if res.acceptance:
        a = res.acceptance
        print(f"[leapfrog train-draft] acceptance at K={a['k']}, temperature 0, {a['prompts']} held-out prompts: "
              f"{a['acceptance_rate']:.3f}, mean acceptance length {a['mean_acceptance_length']:.2f}")
    return _saved(res.path, {"method": "draft_model", "model": str(res.path), "num_speculative_tokens": k},
                  s, args.json)


def _temperatures(values: list[float]) -> float | tuple[float, ...]:
    return values[0] if len(values) == 1 else tuple(values)


def _train_eagle(args, cfg) -> int:
    from leapfrog.train.eagle import EagleData, EagleEval, EagleRecipe, train_eagle

    k, topk = args.eval_k or 5, args.eagle_topk or 4
    trees = ((k, topk, min(16, k * topk)), (k, 1, None)) if topk > 1 else ((k, 1, None),)
    res = train_eagle(
        args.target, args.corpus, args.out, args.method,
        recipe=EagleRecipe(ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size,
                           intermediate_size=args.head_intermediate_size, num_key_value_heads=args.head_kv_heads,
                           greedy_calibration=(args.calibration or "greedy") == "greedy"),
        train_config=cfg,
        data=EagleData(mode=args.data_mode, heldout_fraction=args.heldout_fraction, gen_tokens=args.gen_tokens,
                       gen_temperature=_temperatures(args.gen_temperature),
                       gen_prompt_tokens=args.gen_prompt_tokens, gen_prompts_per_doc=args.gen_prompts_per_doc),
        evaluation=EagleEval(prompts=args.eval_prompts, max_tokens=args.eval_max_tokens, trees=trees),
        save_dtype=args.save_dtype, bf16=args.bf16, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
        init_head=args.init_draft)
    s = res.summary()
    b, a = res.heldout_before, res.heldout_after
    print(f"[leapfrog train-draft] {args.method} head {s['head_parameters']:,} parameters "
          f"({s['head_parameters'] / s['target_parameters']:.3f} of the target), draft vocabulary "
          f"{s['draft_vocab_size']:,} ({s['draft_vocab_coverage']:.1%} of the training tokens), {s['steps']} steps, "
          f"{s['train_tokens']:,} tokens in {s['wall_time_s']:.0f}s; held-out loss {b['loss']:.3f} -> {a['loss']:.3f}, "
          f"top-1 agreement per draft step " + "/".join(f"{x:.2f}" for x in a["accuracy"]))
    if res.calibration:
        c = res.calibration
        print(f"[leapfrog train-draft] greedy calibration: draft logits x {c['scale']:.3g} "
              f"(cross-entropy to the target's argmax {c['ce_before']:.3f} -> {c['ce_after']:.3f})")
    for acc in res.acceptance:
        c = acc["speculative_config"]
        print(f"[leapfrog train-draft] temperature 0, {acc['prompts']} held-out prompts, depth "
              f"{c['num_speculative_tokens']}, eagle_topk {c['eagle_topk']}"
              + (f", {c['num_draft_tokens']} draft tokens" if "num_draft_tokens" in c else "")
              + f": acceptance rate {acc['acceptance_rate']:.3f}, mean acceptance length "
              f"{acc['mean_acceptance_length']:.2f}")
    return _saved(res.path, {"method": args.method, "model": str(res.path), "num_speculative_tokens": k,
                             "eagle_topk": topk}, s, args.json)


def _saved(path, hint: dict, summary: dict, json_path: str | None) -> int:
    """train-draft's last words: where the draft went, how to use it; the summary as JSON if asked."""
    print(f"[leapfrog train-draft] saved {path} (loss curve: {path / 'training_loss.png'}); use it with "
          f"--speculative-config '{json.dumps(hint)}'")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leapfrog", description="speculative-decoding LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _check_parser(sub)
    _bench_parser(sub)
    _train_draft_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "check":
            return cmd_check(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "train-draft":
            return cmd_train_draft(args)
    except (LeapfrogError, OSError) as e:
        print(f"leapfrog: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
