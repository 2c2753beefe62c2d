"""Decode on a GPU against its memory-bandwidth roofline, and speculation on it (batch 1, greedy).

A Llama shape (``--shape``: 1B, 3B or 8B, the Llama 3 family's dims and 128256-token vocabulary)
is built from a config.json alone with random weights (``load_format="dummy"``), or a real
checkpoint is given (``--model``; the built-in target by default with ``--shape demo``). Every
contender decodes the same prompts in interleaved rounds, one prompt at a time:

  eager       no speculation, eager forwards (enforce_eager=True)
  graphs      no speculation, the fast path: compiled forwards replayed as CUDA graphs
  ngram       n-gram lookup (prompt lookup) K drafts, graphs
  self-int4   quantized self-draft (the target's own weights in int4) K drafts, graphs
  draft       draft_model ``--draft`` K drafts, graphs (real checkpoints only)
  steps       no speculation, ``--steps`` decode steps per engine step in one graph (num_scheduler_steps)
  eagle3      EAGLE-3 head ``--head``, a 5-deep chain (the built-in default), graphs
  eagle3-tree EAGLE-3 head, an EAGLE-2 dynamic tree (depth 5, top-4, 16 nodes), graphs
  eagle3-rounds  EAGLE-3 chain, ``--steps`` speculation rounds per engine step
  eagle3-auto EAGLE-3 head, depth 5, top-4, the tree size chosen by goodput per batch size from the
              graphs' measured verify costs (``"num_draft_tokens": "auto"``; none among the sizes)
  graphs-1max, steps-1max  graphs and steps compiled with every argmax in one reduction (the
              graphs' split argmax, model/compiled.py ``first_max``, turned off): its A/B in one run

The EAGLE-3 head is the built-in one with ``--shape demo``; on a dummy shape a random head of the
shape (drafting over the first 32000 ids) is written first, so it accepts almost nothing and its
contenders show the cost of drafting and verifying, not a trained head's gain.

The roofline: a decode step must read every weight the forward uses once (the LM head, not the
embedding table, unless they are tied) plus the KV cache it attends over; at the bandwidth a large
device-to-device copy reaches (bytes read + written, measured here first) that is the fastest a
step can be. "of roofline" = roofline step time / measured time per token (plain decode), and the
same against the card's datasheet bandwidth where the card is known.

Random weights (``--init-std``, 0.2 by default: peaked next-token distributions, where Hugging
Face's 0.02 leaves them near-flat) make a chaotic network: its int4 copy and n-gram lookup accept
almost nothing, so speculation on a dummy shape shows its cost, not what a trained model would
accept. "same as graphs" counts prompts whose tokens equal plain graphs' token for token (bf16:
different kernel shapes can flip a near-tie, and a random deep network amplifies rounding).
After the rounds, the plain decode step (graphs) and the steps contender's token are split into
the graph's replay on the GPU and the time outside it, with the kernels of one plain step, and
the verify-cost curve: each captured target graph's replay time, t(batch, tokens) / t(1, 1),
over every contender's graphs.

    python benchmarks/gpu_bench.py --shape 8B [--contenders eager,graphs,ngram,self-int4] \\
        [--num-prompts 8] [--max-tokens 128] [--rounds 3] [--out gpu.json]
    python benchmarks/gpu_bench.py --shape demo --contenders eager,graphs,draft,ngram
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import DEMO_DIR

#: Llama 3 family shapes: hidden, layers, heads, kv heads, intermediate, tied embeddings
SHAPES = {"1B": (2048, 16, 32, 8, 8192, True), "3B": (3072, 28, 24, 8, 8192, True),
          "8B": (4096, 32, 32, 8, 14336, False)}
#: datasheet memory bandwidth, bytes/s, by a substring of the device name
DATASHEET = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12}
ALL = ["eager", "graphs", "ngram", "self-int4", "draft", "steps", "eagle3", "eagle3-tree", "eagle3-rounds",
       "eagle3-auto", "graphs-1max", "steps-1max"]
ONE_MAX = "-1max"   # the suffix of a contender whose graphs take every argmax in one reduction
EAGLE = ("eagle3", "eagle3-tree", "eagle3-rounds", "eagle3-auto")


def shape_dir(name: str, workdir: Path, std: float) -> Path:
    """A config.json of a Llama shape (no weights: loaded with load_format="dummy", normal(0, std))."""
    hidden, layers, heads, kv_heads, inter, tied = SHAPES[name]
    path = workdir / f"llama-{name}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "intermediate_size": inter, "vocab_size": 128256, "tie_word_embeddings": tied,
           "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
           "hidden_act": "silu", "initializer_range": std, "bos_token_id": 128000, "eos_token_id": 128001,
           "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def random_head(target: Path, out: Path, std: float) -> Path:
    """A random EAGLE-3 head for the model at ``target`` (bf16, drafting over the first 32000 ids, or
    the whole vocabulary where it is shorter), written in the release layout the engine loads: a
    drafter that accepts almost nothing."""
    from leapfrog.model.args import LlamaArgs
    from leapfrog.model.eagle import init_eagle_head, save_eagle_head
    args = LlamaArgs.from_hf_config(json.loads((target / "config.json").read_text()))
    head = init_eagle_head("eagle3", args, draft_vocab_size=min(args.vocab_size, 32000), init_std=std,
                           dtype=torch.bfloat16)
    return save_eagle_head(head, out)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read and written (median of 20)."""
    n = int(gib * 2**30) // 2
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    times = []
    for i in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def step_bytes(llm: LLM, max_model_len: int) -> int:
    """Bytes a plain bf16 decode step reads, from the model's shape: every decoder weight, the final
    norm and the LM head (not the embedding table: one row of it is read), plus the KV cache over
    the whole graph width (on CUDA the compiled attention reads max_model_len columns)."""
    a = llm.engine.model.args
    d, hd = a.hidden_size, a.head_dim
    layer = d * hd * (2 * a.num_attention_heads + 2 * a.num_key_value_heads) + 3 * d * a.intermediate_size + 2 * d
    weights = a.num_hidden_layers * layer + d + a.vocab_size * d
    kv = 2 * a.num_hidden_layers * a.num_key_value_heads * hd * max_model_len
    return 2 * (weights + kv)


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0   # decode forwards of the target (a multi-step graph counts each of its steps)
    outputs: list[list[int]] = field(default_factory=list)


@contextmanager
def one_reduction_argmax() -> Iterator[None]:
    """Graphs compiled inside take every argmax in one reduction: model/compiled.py ``first_max``
    splits none (its ``SPLIT_MAX_AT`` is read while a graph is traced, and graphs compile when an
    LLM is made)."""
    from leapfrog.model import compiled
    old = compiled.SPLIT_MAX_AT
    compiled.SPLIT_MAX_AT = sys.maxsize
    try:
        yield
    finally:
        compiled.SPLIT_MAX_AT = old


class Contender:
    def __init__(self, name: str, model: str, dummy: bool, max_len: int, spec: dict | None,
                 enforce_eager: bool, steps: int = 1) -> None:
        t0 = time.perf_counter()
        self.name = name
        with one_reduction_argmax() if name.endswith(ONE_MAX) else nullcontext():
            self.llm = LLM(model=model, dtype="bfloat16", device="cuda", max_num_seqs=1, max_model_len=max_len,
                           enforce_eager=enforce_eager, speculative_config=spec, num_scheduler_steps=steps,
                           load_format="dummy" if dummy else "auto", skip_tokenizer_init=dummy)
        self.startup = time.perf_counter() - t0

    def run(self, prompts: list[list[int]], max_tokens: int) -> Run:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        r = Run()
        for ids in prompts:
            o = self.llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
            m = o.metrics
            r.tokens += m.num_generated_tokens - 1
            r.seconds += m.finished_time - m.first_token_time
            r.forwards += m.num_target_forwards   # (decode forwards only: not the prefill)
            r.outputs.append(list(o.outputs[0].token_ids))
        return r


def replay_ms(graph: torch.cuda.CUDAGraph, n: int) -> float:
    """Milliseconds per replay of a captured CUDA graph: CUDA events around n replays, after n // 10."""
    for _ in range(max(n // 10, 1)):
        graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        graph.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def forward_kernels(llm: LLM, prompt: list[int], n: int = 8, cuda: bool = True) -> list[tuple[str, float, float]]:
    """The kernels of one plain decode step (its forward, or the graph's replay, with the step's
    input copies and sampling), as the profiler sees them: a request is prefilled, then n engine
    steps of plain one-token decoding run under the profiler. Rows (kernel, ms, calls) per step,
    the 15 largest by time: CUDA time on the GPU, self CPU time with ``cuda=False``."""
    from torch.profiler import ProfilerActivity, profile
    eng = llm.engine
    if eng.proposer is not None or eng.runner.multi_step is not None:
        raise ValueError("forward_kernels profiles plain one-token steps: no speculation, no multi-step decode")
    req = eng.add_request("forward-kernels", None, prompt, SamplingParams(temperature=0.0, max_tokens=n + 2,
                                                                           ignore_eos=True))
    try:
        eng.step()   # the prefill (and the first token)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                eng.step()
            if cuda:
                torch.cuda.synchronize()
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.abort("forward-kernels")   # (nothing when it ended)
    if req.finish_reason != "length":
        raise RuntimeError(f"the profiled request ended with {req.finish_reason!r}")
    rows = [(ev.key, (ev.device_time_total if cuda else ev.self_cpu_time_total) / n / 1e3, ev.count / n)
            for ev in prof.key_averages()]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])[:15]


def step_anatomy(llm: LLM, runs: list[Run], prompt: list[int] | None) -> dict | None:
    """A plain decode step split: the [1, 1] graph's replay time on the GPU (CUDA events, 50
    replays; the multi-step graph's over its steps, for the steps contender) against the measured
    time per token; and, with ``prompt``, the kernels of one forward (profiler)."""
    runner = llm.engine.runner
    multi = runner.multi_step
    g = multi if multi is not None else runner.compiled
    r = g.replays.get((1, 1)) if g is not None else None
    if r is None:
        return None
    replay = replay_ms(r.graph, 50) / (multi.steps if multi is not None else 1)
    step = 1e3 / statistics.median(x.tokens / x.seconds for x in runs)
    return {"step_ms": step, "replay_ms": replay, "outside_ms": step - replay,
            "kernels": forward_kernels(llm, prompt) if prompt is not None else []}


def verify_curve(contenders: dict[str, Contender]) -> dict[str, float]:
    """Replay time (ms, CUDA events, 30 replays) of every captured bucket of the contenders' target
    graphs, by "batch x tokens" (the first contender's graph of each bucket)."""
    out: dict[str, float] = {}
    for c in contenders.values():
        g = c.llm.engine.runner.compiled
        for (b, t), r in sorted((g.replays if g is not None else {}).items()):
            if f"{b}x{t}" not in out:
                out[f"{b}x{t}"] = replay_ms(r.graph, 30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8B", choices=[*SHAPES, "demo"])
    ap.add_argument("--model", default=None, help="a real checkpoint instead of --shape (default with demo: "
                                                  "the built-in target)")
    ap.add_argument("--draft", default=str(DEMO_DIR / "draft"), help="the draft contender's checkpoint")
    ap.add_argument("--head", default=None, help="the EAGLE-3 contenders' head (default: the built-in one with "
                                                 "--shape demo, a random one on a dummy shape)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps / speculation rounds per engine step of "
                                                        "the steps and eagle3-rounds contenders")
    ap.add_argument("--contenders", default=None, help=f"comma-separated, of {','.join(ALL)}")
    ap.add_argument("-k", type=int, default=4, help="drafts per step")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-tokens", type=int, default=8,
                    help="tokens of each contender's warm-up request before the rounds (first uses of kernels and "
                         "graphs, and an adaptive contender's first probes, land there)")
    ap.add_argument("--init-std", type=float, default=0.2,
                    help="random weights' std (a dummy shape): 0.2 peaks the next-token distributions; Hugging Face's "
                         "0.02 leaves them near-flat, so any two kernels' roundings disagree on the argmax")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA device")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    dummy = args.model is None and args.shape != "demo"
    model = args.model or (str(DEMO_DIR / "target") if args.shape == "demo"
                           else str(shape_dir(args.shape, Path(tempfile.mkdtemp(prefix="lf-gpu-")), args.init_std)))
    names = args.contenders.split(",") if args.contenders else [
        n for n in ALL if not (dummy and n == "draft")]
    for n in names:
        if n not in ALL:
            raise SystemExit(f"unknown contender {n!r}; known: {', '.join(ALL)}")
        if n == "draft" and dummy:
            raise SystemExit("the draft contender needs real checkpoints (--shape demo or --model)")
        if n in EAGLE and args.model and not args.head:
            raise SystemExit(f"the {n} contender needs --head with --model")
    bw = copy_bandwidth(dev)
    sheet = next((v for k, v in DATASHEET.items() if k in name), None)
    print(f"{name}: device-to-device copy {bw / 1e12:.2f} TB/s"
          + (f" (datasheet {sheet / 1e12:.2f} TB/s)" if sheet else ""), flush=True)

    head = args.head or (str(DEMO_DIR / "eagle3") if not dummy else None)
    if head is None and any(n in EAGLE for n in names):
        head = str(random_head(Path(model), Path(model) / "eagle3-head", args.init_std))
    chain = {"method": "eagle3", "model": head, "num_speculative_tokens": 5, "eagle_topk": 1}
    k = args.k
    specs = {"eager": None, "graphs": None, "steps": None, "eagle3": chain, "eagle3-rounds": chain,
             "eagle3-tree": {**chain, "eagle_topk": 4, "num_draft_tokens": 16},
             "eagle3-auto": {**chain, "eagle_topk": 4, "num_draft_tokens": "auto"},
             "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
             "self-int4": {"method": "draft_model", "model": "self", "draft_quantization": "int4",
                           "num_speculative_tokens": k},
             "draft": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k}}
    gen = torch.Generator().manual_seed(0)
    contenders: dict[str, Contender] = {}
    for n in names:
        base = n.removesuffix(ONE_MAX)   # (a -1max contender is its base compiled another way)
        c = Contender(n, model, dummy, args.max_model_len, specs[base], enforce_eager=n == "eager",
                      steps=args.steps if base in ("steps", "eagle3-rounds") else 1)
        contenders[n] = c
        print(f"{n}: ready in {c.startup:.1f} s", flush=True)
    vocab = next(iter(contenders.values())).llm.engine.vocab_size
    prompts = [torch.randint(0, min(vocab, 32000), (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.num_prompts)]
    if args.shape == "demo" and args.model is None:   # real text for the built-in model
        import sys
        from leapfrog.model.loader import load_tokenizer
        from leapfrog.train.distill import heldout_prompts
        sys.path.insert(0, str(Path(__file__).parent))
        from demo_bench import heldout_documents
        tok = load_tokenizer(DEMO_DIR / "target")
        texts = heldout_prompts(tok, heldout_documents(DEMO_DIR), args.num_prompts, prompt_tokens=args.prompt_len)
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in texts]
    nbytes = step_bytes(next(iter(contenders.values())).llm, args.max_model_len)
    for c in contenders.values():   # warm-up: one short request each
        c.run(prompts[:1], args.warmup_tokens)
    per: dict[str, list[Run]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for n, c in contenders.items():
            per[n].append(c.run(prompts, args.max_tokens))
        print(f"round {rnd + 1}: " + ", ".join(f"{n} {per[n][-1].tokens / per[n][-1].seconds:.1f}" for n in names),
              flush=True)

    roof = bw / nbytes
    base = "graphs" if "graphs" in per else names[0]
    rows = []
    print(f"\n{args.shape if not args.model else args.model}, bf16, batch 1, {args.num_prompts} prompts x "
          f"{args.max_tokens} tokens, {args.rounds} rounds; a step reads {nbytes / 1e9:.2f} GB: roofline "
          f"{roof:.0f} tokens/s at the copy bandwidth"
          + (f", {sheet / nbytes:.0f} at the datasheet's" if sheet else ""))
    print(f"| contender | tokens/s | vs {base} | tokens/forward | of roofline (copy) | of roofline (datasheet) "
          f"| same as {base} |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        tps = [r.tokens / r.seconds for r in per[n]]
        ratio = [per[n][i].tokens / per[n][i].seconds / (per[base][i].tokens / per[base][i].seconds)
                 for i in range(args.rounds)]
        med = statistics.median(tps)
        same = sum(a == b for a, b in zip(per[n][0].outputs, per[base][0].outputs))
        spec = contenders[n].llm.engine.spec_metrics
        row = {"contender": n, "tokens_per_s": med, "vs_base": statistics.median(ratio),
               "of_roofline_copy": med / roof, "of_roofline_datasheet": med * nbytes / sheet if sheet else None,
               "same_as_base": f"{same}/{len(prompts)}", "startup_s": contenders[n].startup,
               "spec_metrics": {k2: v for k2, v in vars(spec).items() if isinstance(v, (int, float))}}
        rows.append(row)
        ds = f"{row['of_roofline_datasheet']:.0%}" if sheet else "-"
        forwards = sum(r.forwards for r in per[n])
        row["tokens_per_forward"] = sum(r.tokens for r in per[n]) / forwards if forwards else None
        per_forward = f"{row['tokens_per_forward']:.2f}" if forwards else "-"
        print(f"| {n} | {med:.1f} | {row['vs_base']:.2f} | {per_forward} | {med / roof:.0%} | {ds} | "
              f"{row['same_as_base']} |")
    anatomy = {n: step_anatomy(contenders[n].llm, per[n], prompts[0] if n == "graphs" else None)
               for n in contenders if n.removesuffix(ONE_MAX) in ("graphs", "steps")}
    for n, a in anatomy.items():
        if a is None:
            continue
        print(f"\n{n}: a token {a['step_ms']:.2f} ms, of which the decode graph's replay on the GPU "
              f"{a['replay_ms']:.2f} ms ({a['replay_ms'] / a['step_ms']:.0%}; the weights stream at "
              f"{nbytes / a['replay_ms'] / 1e9:.2f} TB/s in it); outside it {a['outside_ms']:.2f} ms")
        if a["kernels"]:
            print("kernels of one decode step (CUDA time and calls per step):")
            for k2, ms, calls in a["kernels"]:
                print(f"  {ms:8.3f} ms  x{calls:<5.1f} {k2[:100]}")
    curve = verify_curve(contenders)
    if curve:
        one = curve.get("1x1")
        print("\nverify cost: each captured target graph's replay on the GPU (batch x tokens: ms"
              + (", t / t(1x1)" if one else "") + ")")
        for key, ms in curve.items():
            print(f"  {key:>6}: {ms:.3f} ms" + (f"  {ms / one:.2f}" if one else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": name, "copy_bandwidth": bw, "datasheet": sheet,
                                              "verify_curve": curve, "step_bytes": nbytes, "shape": args.shape,
                                              "model": args.model, "settings": vars(args), "torch": torch.__version__,
                                              "rows": rows, "anatomy": anatomy}, indent=1))


if __name__ == "__main__":
    main()
