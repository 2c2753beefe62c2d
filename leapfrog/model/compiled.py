"""The compiled fast path: the decode/verify forward as torch.compile graphs, one per shape bucket.

A decode or verify forward is a few hundred small ops (norms, RoPE, casts, slices, attention,
the linears); eagerly, per-op dispatch costs as much as the matrix math for a small model.
Inductor fuses the elementwise ops, freezes the weights into the graph (prepacked for its own
few-row GEMM kernels: ``max_autotune`` with the C++ GEMM template, chosen per shape by
measurement) and calls the graph through a C++ wrapper.

Shapes. A graph is compiled for a fixed ``[batch, tokens]`` bucket (``Bucket``): a forward
over ``B`` sequences of at most ``S`` new tokens runs in the smallest warmed bucket with
``batch >= B`` and ``tokens >= S``, padded like any ragged batch (padding sequences and tokens
write to the cache's scratch row and are never read). Every shape in the graph is static:
attention, the one part that depends on the context length, is one opaque op per layer
(attention/backend.py ``cached_attention``, or its C++ twin from attention/native.py when it
builds) that takes the length as a tensor and a mask as wide as the cache, so one graph serves
every context length (a symbolic length would turn inductor's few-row GEMM kernels into generic
ones: measured 2x slower). Everything else (prompt chunks, trees larger than a bucket, EAGLE
heads' static trees and sampled drafts, batch-invariant mode) runs eagerly.

Drafting (``CompiledChain``): a greedy chain of K draft tokens is one graph, the K forwards of
the drafter (a draft model, an EAGLE head fed its own states) unrolled with the argmax between
them, so drafting K tokens costs one call's framework time instead of K. ``CompiledTree`` does
the same for an EAGLE head's greedy dynamic tree (EAGLE-2: expansion level by level, reranking).
All buckets are compiled at start-up (``warm_up``), and serving never compiles: a forward
that fits no warmed bucket runs eagerly. Serving calls each warmed graph's inductor code directly
(``DirectCall``: its inputs mapped at warm-up), skipping dynamo's frame hook and AOT autograd's
wrappers, which cost 0.3-0.5 ms per call; a graph whose inputs cannot be mapped keeps them.

The drafting loops also run uncompiled (``compile=False``, enforce_eager's default for EAGLE
heads): the same function called eagerly, every bucket "warm" at once, no graphs. The model's
ops still dispatch one by one, but the proposer's per-level Python is gone.

Costs: compiling takes 10-30 s per bucket on 2 CPU cores (C++ compilation; frozen graphs are not
kept in inductor's on-disk cache), and the frozen weights are a second copy of the layers'
weights. ``enforce_eager=True`` (vLLM's name) turns the fast path off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from leapfrog.attention.metadata import AttnMeta, build_attn_meta
from leapfrog.kv.cache import KVCache
from leapfrog.model.native_draft import NativeHeadForward, NativeLlamaForward
from leapfrog.sampling.sampler import inverse_cdf_draw
from leapfrog.utils import env_off, env_on

log = logging.getLogger("leapfrog.compile")

#: inductor settings of the fast path on CPU (torch._inductor.config keys)
INDUCTOR_OPTIONS = {
    "freezing": True,                        # weights become constants, prepacked once
    "cpp_wrapper": True,                     # the graph called from C++, not Python
    "max_autotune": True,                    # GEMM kernels chosen per shape by measurement
    "max_autotune_gemm_backends": "CPP,ATEN",
    "max_autotune_report_choices_stats": False,  # keep start-up to the progress line: no per-GEMM
    "autotune_num_choices_displayed": 0,         # autotuning tables on stderr
    # no assert_size_stride in the generated C++: it checked every input and every extern op's
    # output (about 50 per target step) and built a stringstream each time, even when the check
    # passed. DirectCall matches the inputs' shapes and strides itself; leapfrog's ops return
    # contiguous outputs, as their fake kernels say (the compiled-versus-eager tests). 0.96x the
    # time of a one-token float32 step (README, "The compiled fast path"). LEAPFROG_SIZE_ASSERTS=1
    # turns them back on (read when graphs compile).
    "size_asserts": False,
}
#: on CUDA: frozen weights, Triton for the fused elementwise ops, cuBLAS for the GEMMs (autotuning
#: Triton GEMMs costs minutes per bucket, and the C++ wrapper's time is what the CUDA graph removes)
CUDA_INDUCTOR_OPTIONS = {"freezing": True}


def inductor_options(device: torch.device) -> dict:
    if device.type == "cuda":
        return CUDA_INDUCTOR_OPTIONS
    if env_on("LEAPFROG_SIZE_ASSERTS"):
        return {**INDUCTOR_OPTIONS, "size_asserts": True}
    return INDUCTOR_OPTIONS


@functools.cache
def native_ops_tag() -> str:
    """A hash of the C++ sources of leapfrog's own ops (the linear and attention kernels), put in
    torch.compile's cache keys while graphs compile (``torch.compiler.config.cache_key_tag``).
    Inductor's on-disk cache keys a graph by its ops' schemas, not their code: a graph compiled
    against an earlier build of an op was reused after the op changed, and failed inside the op
    (a test's draft chain graph hit a day-old entry and raised in ``cached_attention``)."""
    from leapfrog.attention import native
    from leapfrog.model import native_linear
    sources = [native._SOURCE, *(source for source, _flags in native_linear._BUILDS.values())]
    return "leapfrog-ops-" + hashlib.sha256("\0".join(sources).encode()).hexdigest()[:16]


@contextmanager
def compile_settings(device: torch.device) -> Iterator[None]:
    """The settings graphs compile under: inductor's options (``inductor_options``; patched, not
    torch.compile's options=, which would turn freezing off) and the ops' cache key tag."""
    with torch._inductor.config.patch(inductor_options(device)), \
            torch.compiler.config.patch(cache_key_tag=native_ops_tag()):
        yield


@dataclass
class GraphOutput:
    hidden: Tensor        # [batch, tokens, D] float32 (final norm)
    aux: list[Tensor]     # [batch, tokens, D] per aux layer
    logits: Tensor        # [batch * tokens, V] float32 (the model's head: a draft's may be half precision;
                          # ``_forward``'s ``at``: [len(at), V], those rows only)
    top: Tensor           # [rows of logits] float32: each row's largest logit (the engine's greedy verify
    top_ids: Tensor       # [rows of logits] long: and its token, the first of equal maxima: Tensor.max)


@dataclass
class DirectCall:
    """A warmed graph called straight into inductor's compiled code, without dynamo's frame
    hook and AOT autograd's runtime wrappers (measured 0.3-0.5 ms of a 2.8 ms bf16 decode call
    of the built-in target). Built at warm-up from the graph's own call (``_capture``): each of
    inductor's inputs is identified as one of the call's arguments or a KV buffer, and the outputs
    as the graph's returned tensors; if anything is not identified there is no DirectCall and the
    bucket runs through torch.compile as before. Inductor assumed the warm-up inputs' shapes,
    strides and dtypes: a call whose arguments differ takes the torch.compile path."""
    fn: Callable[[list], list]              # inductor's compiled graph: flat inputs -> flat outputs
    plan: list[int | tuple[int, str, int]]  # per input: index of a call argument, or (cache, "k" | "v", layer)
    spec: list[tuple | None]                # per call argument: (shape, stride, dtype, device), None when None
    calls: int = field(default=0)
    seconds: float = field(default=0.0)     # spent inside the graph (what the fast-path benchmark reports)

    def matches(self, args: tuple) -> bool:
        return _spec(args) == self.spec

    def __call__(self, args: tuple, caches: tuple[KVCache, ...]) -> list[Tensor]:
        return self.run(self.inputs(args, caches))

    def inputs(self, args: tuple, caches: tuple[KVCache, ...]) -> list[Tensor]:
        """Inductor's flat inputs for a call with ``args``."""
        return [args[p] if isinstance(p, int) else _buffer(caches[p[0]], p[1], p[2]) for p in self.plan]

    def run(self, inputs: list[Tensor]) -> list[Tensor]:
        """The graph on its flat inputs (inductor empties the list it is given: pass a copy to reuse one)."""
        t0 = time.perf_counter()
        out = self.fn(inputs)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


@dataclass
class GraphReplay:
    """A warmed bucket's call captured as a CUDA graph (the GPU's fast path: one launch replays
    the whole forward, where each of its kernels would cost a launch from Python). The call's
    tensors are copied into the graph's own inputs, the graph replays, and its outputs are
    copied out (the next replay overwrites them). Nothing inside reads a tensor on the host: the
    attention op takes the context length as a tensor and attends over the cache's whole width
    on CUDA (attention/backend.py ``cached_attention``)."""
    graph: torch.cuda.CUDAGraph
    inputs: tuple                           # the graph's own input tensors (None where the call has None)
    outputs: list[Tensor]                   # the graph's own output tensors
    spec: list[tuple | None]
    calls: int = field(default=0)

    def matches(self, args: tuple) -> bool:
        return _spec(args) == self.spec

    def __call__(self, args: tuple) -> list[Tensor]:
        for mine, a in zip(self.inputs, args):
            if mine is not None:
                mine.copy_(a, non_blocking=True)
        self.graph.replay()
        self.calls += 1
        return [o.clone() for o in self.outputs]


def capture_graph(call: Callable[[tuple], list[Tensor]], args: tuple, pool) -> GraphReplay:
    """Capture ``call(inputs)`` as a CUDA graph over copies of ``args`` (after two warm runs on a
    side stream, as CUDA graph capture needs); ``pool``: a memory pool shared by a model's graphs
    (they never run at the same time, and each replay's outputs are copied out)."""
    host = [i for i, a in enumerate(args) if a is not None and not a.is_cuda]
    if host:   # a graph would replay the value it had at capture
        raise ValueError(f"CUDA graph inputs must be CUDA tensors (arguments {host} are not)")
    inputs = tuple(None if a is None else a.clone() for a in args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call(inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = call(inputs)
    return GraphReplay(graph, inputs, list(outputs), _spec(args))


def _buffer(kv: KVCache, name: str, layer: int) -> Tensor:
    return (kv.k if name == "k" else kv.v)[layer]


def _spec(args: tuple) -> list[tuple | None]:
    return [None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in args]


_CAPTURE_LOCK = threading.Lock()   # one warm-up capture at a time (it patches a class attribute)


@contextmanager
def _capture() -> Iterator[list]:
    """Record every call of an inductor graph made inside: (graph, its inputs, its outputs). Any
    other graph called meanwhile (another engine's) is recorded too, and the capture then has more
    than one call: no direct call is made from it."""
    from torch._inductor.output_code import CompiledFxGraph
    calls: list = []
    with _CAPTURE_LOCK:
        call = CompiledFxGraph.__call__

        def record(graph, inputs):
            flat = list(inputs)   # the compiled code clears its input list
            out = call(graph, inputs)
            calls.append((graph, flat, out))
            return out

        CompiledFxGraph.__call__ = record
        try:
            yield calls
        finally:
            CompiledFxGraph.__call__ = call


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int    # sequences per forward (padded up to)
    tokens: int   # new tokens per sequence (padded up to)


#: the most tokens (batch x tokens per sequence) one bucket's forward takes
BUCKET_TOKENS = 256
#: an eager drafting loop's bucket (every shape its own, nothing padded: ``eager_buckets``) takes
#: more, as long as its inputs' mask (batch x tokens x max_model_len bools: ModelRunner._fill)
#: stays under this many bytes (the 16 eager arenas kept: at most 128 MiB, as 256 tokens at 32k)
EAGER_MASK_BYTES = 8 << 20
#: ... and its per-step tensors that grow with the vocabulary (the sampled chain's [batch, steps, V]
#: draws and probabilities: ``eager_buckets``' ``seq_bytes``) under this many
EAGER_STEP_BYTES = 256 << 20


def eager_buckets(max_seqs: int, tokens: int, max_model_len: int | None = None, seq_bytes: int = 0) -> list[Bucket]:
    """An eager drafting loop's buckets: every batch size up to ``max_seqs`` its own, ``tokens``
    per sequence, while batch x tokens is at most BUCKET_TOKENS or, given ``max_model_len``, its
    mask is at most EAGER_MASK_BYTES and batch x ``seq_bytes`` (what a step holds per sequence
    beyond that) at most EAGER_STEP_BYTES; larger batches draft level by level. Capped at
    BUCKET_TOKENS, a batch of 32 drafting chains of 10 (11 tokens) fell to the level-by-level
    expansion: 29 ms a step against 11 for the chain of 7's fused loop, and "auto" at depth 10 ran
    0.75x the chain of 5 there.

    >>> [len(eager_buckets(64, 11, n)) for n in (2048, 16384, 32768)], len(eager_buckets(64, 11))
    ([64, 46, 23], 23)
    >>> len(eager_buckets(64, 11, 2048, seq_bytes=16 * 10 * 131072))   # [steps, V] float64 + 2 x float32
    23
    """
    def fits(b: int) -> bool:
        if b == 1 or b * tokens <= BUCKET_TOKENS:
            return True
        return (max_model_len is not None and b * tokens * max_model_len <= EAGER_MASK_BYTES
                and b * seq_bytes <= EAGER_STEP_BYTES)
    return [Bucket(b, tokens) for b in range(1, max_seqs + 1) if fits(b)]


def make_buckets(max_seqs: int, tokens_per_seq: list[int], max_tokens: int = BUCKET_TOKENS) -> list[Bucket]:
    """Buckets for batch sizes 1, 2, 4, ... up to ``max_seqs`` and each of ``tokens_per_seq``
    (1 = plain decode, K + 1 = a verify of K drafts), at most ``max_tokens`` tokens per forward.

    >>> make_buckets(4, [1, 5])
    [Bucket(batch=1, tokens=1), Bucket(batch=1, tokens=5), Bucket(batch=2, tokens=1), Bucket(batch=2, tokens=5), \
Bucket(batch=4, tokens=1), Bucket(batch=4, tokens=5)]
    """
    batches, b = [], 1
    while b < max_seqs:
        batches.append(b)
        b *= 2
    batches.append(max_seqs)
    return sorted({Bucket(b, s) for b in batches for s in set(tokens_per_seq) if b * s <= max_tokens})


def can_compile(device: torch.device) -> str | None:
    """None when inductor can compile here, else why not (a C++ compiler is needed on CPU)."""
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler
        try:
            get_cpp_compiler()
        except Exception as e:  # noqa: BLE001 - whatever the probe raises, the reason is shown
            return f"no C++ compiler for inductor ({e})"
    return None


class CompiledForward:
    """The model's forward over a ``KVCache`` as compiled graphs, one per bucket (see the module
    docstring). ``aux_layers``: residual-stream outputs every graph also returns (EAGLE-3).
    ``feature_width``: the forward takes per-token features [B, S, F] of that width (EAGLE heads:
    F = the target's feature width when catching up, the head's own width when drafting)."""

    #: CompiledChain's ``vocab`` (None: logits over the model's whole vocabulary)
    vocab: Tensor | None = None

    def __init__(self, model: torch.nn.Module, kv: KVCache, buckets: list[Bucket],
                 aux_layers: tuple[int, ...] = (), feature_width: int | None = None, compile: bool = True) -> None:
        # (an EAGLE-1 head has no LM head of its own: it reads the target's)
        if getattr(model, "head", None) is None and getattr(model, "kind", None) != "eagle":
            raise ValueError("compile a model after pack_for_inference(pack_layers=False) (it needs its head)")
        self.model, self.kv, self.aux_layers = model, kv, aux_layers
        self.caches: tuple[KVCache, ...] = (kv,)   # every cache the graphs read and write (DirectCall)
        self.feature_width = feature_width
        from leapfrog.attention.native import load_native_attention
        # the attention op in C++ on CPU (else the Python one; on CUDA the Python one's Triton kernel;
        # eagerly, LEAPFROG_NATIVE_ATTENTION=0 picks the Python one too, as for other eager forwards)
        self.native = (kv.k[0].device.type == "cpu" and (compile or not env_off("LEAPFROG_NATIVE_ATTENTION"))
                       and load_native_attention())
        self.buckets = sorted(buckets)
        self.warmed: list[Bucket] = []
        self.direct: dict[tuple[int, int], DirectCall] = {}   # by [batch, tokens]
        self.replays: dict[tuple[int, int], GraphReplay] = {}  # CUDA graphs, by [batch, tokens]
        self._pool = None                                      # their memory pool
        # One graph per bucket, all from this one function: dynamo's per-function limit on
        # compiled variants must hold them all (targets, drafts and every engine of the process
        # share the code objects: each instance adds its own to the limit)
        self.compiled = compile
        if compile:
            limit = 4 * len(self.buckets) + 8
            torch._dynamo.config.cache_size_limit += limit
            torch._dynamo.config.accumulated_cache_size_limit += 4 * limit
        self._fn = self._wrap(self._forward)

    def _wrap(self, fn: Callable) -> Callable:
        """``fn`` as the graphs' function: compiled, or (``compile=False``: an eager fused loop,
        e.g. an EAGLE chain's K head forwards without the proposer's per-level Python) itself."""
        return torch.compile(fn, dynamic=False, fullgraph=True) if self.compiled else fn

    def _forward(self, tok: Tensor, pos: Tensor, mask: Tensor, rows: Tensor, write_rows: Tensor,
                 write_cols: Tensor, kv_len: Tensor, features: Tensor | None = None,
                 at: Tensor | None = None) -> GraphOutput:
        """``at``: the flat rows (b * tokens + s) whose logits the caller reads; None: all."""
        meta = AttnMeta(rows=rows, write_rows=write_rows, write_cols=write_cols, kv_len=mask.shape[-1],
                        mask=mask, graph_kv_len=kv_len, native=self.native)
        kwargs: dict = {"features": features} if features is not None else {}
        if self.aux_layers:
            kwargs["aux_layers"] = self.aux_layers
        out = self.model(token_ids=tok, positions=pos, kv=self.kv, attn=meta, **kwargs)
        # the LM head in the graph too, for every token (decode and verify want them all; a chain's
        # first forward only its last tokens': ``at``, a head's LM head is a third of its weights):
        # inductor's GEMM for it is faster than the eager one, and no second call is made
        h = out.hidden.reshape(-1, out.hidden.shape[-1])                                # [B*S, D]
        h = h if at is None else h[at]
        if self.vocab is None:
            logits = self.model.graph_logits(h)                                         # [B*S or len(at), V]
        else:   # (an EAGLE-3 head's own vocabulary: CompiledChain.vocab)
            logits = self.model.compute_draft_logits(h, graph=True)                     # [.., Vd]
        # greedy verification's argmax in the graph too: an ATen reduction right after the graph
        # waits for idle worker threads (measured ~80 us for one [1, 8192] row, 10 us when warm)
        top, top_ids = first_max(logits.float())                                        # [B*S], [B*S]
        return GraphOutput(out.hidden, out.aux, logits, top, top_ids)

    @property
    def max_tokens(self) -> int:
        """The most new tokens per sequence a warmed bucket takes (0: none warmed)."""
        return max((b.tokens for b in self.warmed), default=0)

    def bucket_for(self, batch: int, tokens: int, kv_len: int) -> Bucket | None:
        """The smallest warmed bucket a forward of this shape fits, or None (run eagerly). An
        eager loop (compile=False) pads nothing: the shape itself, where a warmed bucket takes it
        (its chains' catch-up forward padded to depth + 1 tokens cost a batch of 32 three times
        the rows it needed)."""
        if kv_len > self.kv.max_model_len:
            return None
        for b in self.warmed:
            if b.batch >= batch and b.tokens >= tokens:
                return b if self.compiled else Bucket(batch, tokens)
        return None

    def __call__(self, tok: Tensor, pos: Tensor, meta: AttnMeta, features: Tensor | None = None) -> GraphOutput:
        """tok, pos [batch, tokens] of a warmed bucket; meta for a graph (build_attn_meta's
        ``graph_width=max_model_len``); features [batch, tokens, feature_width] when the graph takes
        them -> the bucket's hidden states, aux states and logits."""
        return self._serve(self._args(tok, pos, meta, features))

    def _key(self, args: tuple) -> tuple[int, int]:
        """The [batch, tokens] bucket of a call's arguments."""
        return tuple(args[0].shape)

    def _serve(self, args: tuple, steps: int | None = None, stop: Tensor | None = None):
        """``steps``: an eager chain's steps this call (compile=False only: fewer than the
        graph's ``steps`` when no sequence drafts that deep; a graph always runs all of them);
        ``stop``: an eager greedy chain's stopping confidences (CompiledChain._steps)."""
        if not self.compiled:
            kw = {k: v for k, v in (("steps", steps), ("stop", stop)) if v is not None}
            return self._fn(*args, **kw)
        assert steps is None and stop is None, "a compiled chain runs all its steps"
        key = self._key(args)
        r = self.replays.get(key)
        if r is not None and r.matches(args):
            return self._unflatten(r(args))
        d = self.direct.get(key)
        if d is not None and d.matches(args):
            return self._unflatten(d(args, self.caches))
        # Every graph was compiled by warm_up: check only the guards that tell the warmed graphs
        # apart (bucket shapes, which model), not all of them (measured ~0.25 ms per call).
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self._fn(*args)

    @staticmethod
    def _args(tok: Tensor, pos: Tensor, meta: AttnMeta, features: Tensor | None, *extra: Tensor) -> tuple:
        assert meta.mask is not None and meta.graph_kv_len is not None
        return (tok, pos, meta.mask, meta.rows, meta.write_rows, meta.write_cols, meta.graph_kv_len,
                features, *extra)

    def _flatten(self, out: GraphOutput) -> list[Tensor]:
        return [out.hidden, *out.aux, out.logits, out.top, out.top_ids]

    def _unflatten(self, flat: list[Tensor]) -> GraphOutput:
        return GraphOutput(flat[0], list(flat[1:-3]), *flat[-3:])

    def _serve_chained(self, args: tuple, calls: int, carried: tuple[int, ...]) -> list[list[Tensor]]:
        """``calls`` calls in a row, each call's first ``len(carried)`` arguments the outputs at
        ``carried`` of the call before (``_flatten``'s order; the other arguments stay ``args``'s)
        -> each call's flat outputs. On a direct call the inputs are built once and only the carried
        ones change: the Python between two graphs runs on caches the graph has just flushed
        (measured 60-65 us per call through ``_serve`` against ~5 us warm), so it is kept short."""
        key, n = self._key(args), len(carried)
        d = self.direct.get(key)
        outs: list[list[Tensor]] = []
        if key not in self.replays and d is not None and d.matches(args):
            inputs = d.inputs(args, self.caches)
            slots = [[j for j, p in enumerate(d.plan) if p == i] for i in range(n)]   # where each carried arg goes
            while len(outs) < calls:
                flat = d.run(list(inputs))
                outs.append(flat)
                nxt = [flat[i] for i in carried]
                if len(outs) == 1 and _spec(tuple(nxt)) != d.spec[:n]:
                    break   # (outputs laid out unlike the warm-up's inputs: the generic calls below)
                for js, t in zip(slots, nxt):
                    for j in js:
                        inputs[j] = t
        while len(outs) < calls:
            if outs:
                args = (*(outs[-1][i] for i in carried), *args[n:])
            outs.append(self._flatten(self._serve(args)))
        return outs

    def _make_direct(self, args: tuple, calls: list, out) -> DirectCall | None:
        """The DirectCall of a graph whose one inductor call was ``calls`` (see DirectCall), checked
        to give the torch.compile call's outputs bitwise; None when it cannot be built."""
        if len(calls) != 1:
            return None
        given = [a for a in args if a is not None]
        if len({id(a) for a in given}) != len(given):   # the plan could not tell them apart
            raise ValueError(f"{type(self).__name__}: a warm-up call passes one tensor as two arguments")
        graph, inputs, raw = calls[0]
        want = self._flatten(out)
        if not isinstance(raw, (list, tuple)) or len(raw) != len(want) or any(r is not w for r, w in zip(raw, want)):
            return None
        plan: list[int | tuple[int, str, int]] = []
        for t in inputs:
            hit = [i for i, a in enumerate(args) if a is t]
            if hit:
                plan.append(hit[0])
                continue
            buf = [(c, name, layer) for c, kv in enumerate(self.caches) for layer, pair in enumerate(zip(kv.k, kv.v))
                   for name, x in zip("kv", pair) if x is t]
            if not buf:
                return None
            plan.append(buf[0])
        d = DirectCall(graph.current_callable, plan, _spec(args))
        again = d(args, self.caches)
        if any(not torch.equal(a, b) for a, b in zip(again, want)):
            return None
        d.calls, d.seconds = 0, 0.0
        return d

    @torch.inference_mode()
    def warm_up(self, progress: bool = True) -> float:
        """Compile every bucket (each run twice, at two context lengths, on the scratch row).
        -> seconds taken. Eager (``compile=False``): nothing to compile; every bucket serves."""
        if not self.compiled:
            self.warmed = list(self.buckets)
            return 0.0
        t0 = time.perf_counter()
        bar = None
        if progress:
            from leapfrog.progress import progress_bar
            bar = progress_bar(total=len(self.buckets), desc="compiling decode/verify graphs", unit="graph",
                       dynamic_ncols=True)
        dev = self.kv.k[0].device
        scratch = self.kv.scratch_row
        for b in self.buckets:
            with compile_settings(dev):
                self._warm(b, dev, scratch)
            self.warmed.append(b)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        took = time.perf_counter() - t0
        log.info("compiled %d decode/verify graphs in %.1f s", len(self.buckets), took)
        return took

    def _warm(self, b: Bucket, dev: torch.device, scratch: int) -> None:
        """Run bucket ``b`` at two context lengths on the scratch row (the second must not compile)."""
        for kv_len in (b.tokens + 1, b.tokens + 3):
            args = self._warm_args(b, kv_len, dev, scratch)
            with _capture() as calls:
                out = self._fn(*args)
        d, error = None, None
        try:  # the second run compiled nothing: its one inductor call is the bucket's graph
            d = self._make_direct(args, calls, out)
        except Exception as e:  # noqa: BLE001 - an inductor internal changed: keep the torch.compile path
            error = e
        if d is not None:
            self.direct[(b.batch, b.tokens)] = d
        else:
            log.warning("graph %s runs through torch.compile's wrappers (no direct call: slower)", b, exc_info=error)
        if dev.type == "cuda":
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            caches = self.caches
            call = (lambda a: d(a, caches)) if d is not None else (lambda a: self._flatten(self._fn(*a)))
            self.replays[(b.batch, b.tokens)] = capture_graph(call, args, self._pool)

    def _warm_args(self, b: Bucket, kv_len: int, dev: torch.device, scratch: int) -> tuple:
        """The graph's arguments for a warm-up call of bucket ``b`` ending at column kv_len - 1."""
        cols = [list(range(kv_len - b.tokens, kv_len))] * b.batch
        meta = build_attn_meta([scratch] * b.batch, cols, scratch, dev, graph_width=self.kv.max_model_len)
        tok = torch.zeros(b.batch, b.tokens, dtype=torch.long, device=dev)
        feats = None
        if self.feature_width is not None:
            feats = torch.zeros(b.batch, b.tokens, self.feature_width, dtype=self.model.dtype, device=dev)
        return self._args(tok, torch.tensor(cols, device=dev), meta, feats, *self._warm_extra(b, kv_len, dev))

    def _warm_extra(self, b: Bucket, kv_len: int, dev: torch.device) -> tuple[Tensor, ...]:
        return ()


def causal_mask(cols: Tensor, q: Tensor, window: int | None) -> Tensor:
    """A graph's attention mask built in the graph: cols [W] the cache's columns, q [B, S] each
    query's column -> [B, 1, S, W] bool, causal by column (and inside a sliding window)."""
    m = cols[None, None, :] <= q[:, :, None]                                       # [B, S, W]
    if window is not None:
        m &= cols[None, None, :] > q[:, :, None] - window
    return m[:, None]


#: rows at least this long take ``first_max``'s two reductions on CUDA
SPLIT_MAX_AT = 16384


def first_max(x: Tensor, chunks: int = 64, split: bool | None = None) -> tuple[Tensor, Tensor]:
    """x [..., V] -> (values, indices) [...]: ``Tensor.max(-1)`` (the first of equal maxima) as a
    graph computes it. On CUDA a row of ``SPLIT_MAX_AT`` or more runs as two reductions (``split``
    forces either form): inductor does not split a reduction that returns indices, so one thread
    block reads the whole row (a [1, 128256] float32 row: 22 us of an H100's 1B decode step, 1.6 %;
    the multi-step graph's race reads a float64 row more per step). The maxima of ``chunks`` slices
    come first (a block each), then the first slice holding the largest: the same value and index,
    ties and NaN included (each stage keeps the first of equal maxima, the slices are in order, and
    the padding, -inf at the end of the last slice, is never before a real element). The CPU keeps
    one reduction (the two measured no faster there)."""
    V = x.shape[-1]
    if not (split if split is not None else x.is_cuda and V >= SPLIT_MAX_AT):
        return x.max(-1)
    n = -(-V // chunks)                                                         # a slice's length
    xs = torch.nn.functional.pad(x, (0, n * chunks - V), value=float("-inf"))
    v, i = xs.view(*x.shape[:-1], chunks, n).max(-1)                            # [..., chunks]
    top, c = v.max(-1)                                                          # [...]
    return top, c * n + i.gather(-1, c[..., None])[..., 0]


def ascending(ids: Tensor) -> bool:
    """Whether target ids [Vd] are in strictly ascending order: where an inverse-CDF draw over them
    picks the token the draw over the whole vocabulary (zeros elsewhere) picks."""
    return bool((ids[1:] > ids[:-1]).all())


def race_probs(logits: Tensor, temperature: Tensor, scale: float = 1.0) -> Tensor:
    """The one sampler's distribution of a temperature-only row inside a graph (sampling/sampler.py
    ``temperature_probs``): logits [B, ..., V] float32, temperature [B] -> p = softmax(logits /
    scale / T) [B, ..., V] (``scale``: an EAGLE head's greedy calibration, which its sampled drafts
    divide out too)."""
    if scale != 1.0:
        logits = logits / scale
    return torch.softmax(logits / temperature.view(-1, *(1,) * (logits.dim() - 1)), -1)


def race_draw(logits: Tensor, temperature: Tensor, e: Tensor, scale: float = 1.0) -> Tensor:
    """The one sampler's draw inside a graph (sampling/sampler.py ``sample`` for a temperature-only
    row): e [B, ..., V] float64 the race's exponentials E = -log U -> [B, ...] long argmax_v
    p(v) / E(v), p = ``race_probs``."""
    return first_max(race_probs(logits, temperature, scale).double() / e)[1]


def rejection_tokens(p: Tensor, q: Tensor, d: Tensor, w: Tensor) -> Tensor:
    """Speculative sampling of a draft chain inside a graph (Leviathan et al. 2023; Chen et al.
    2023; verify/rejection.py on the host): p [B, K + 1, V] the target's distributions at the
    verified rows, q [B, K, V] the drafts', d [B, K] the drafts (x_j ~ q_j), w [B, K + 1, 3]
    float64 uniforms per row (1: the acceptance tests, 2: the draws) -> [B, K + 1] long: the
    accepted drafts d_1..d_n (accepted while w[j, 1] q_j(d_j) < p_j(d_j)), then at row n a draw
    from norm(max(p_n - q_n, 0)), or after K accepted drafts from p_K (later rows: that draw too,
    never read). The drawn token is never the rejected draft (max(p - q, 0) is 0 there), so
    matching the drafts against these tokens gives n back. A residual of no mass (p = q to
    rounding) draws from p. Only row n's residual is formed and searched (one V-long cumulative
    sum per sequence, not K + 1)."""
    B, K, V = d.shape[0], d.shape[1], p.shape[-1]
    pd = p[:, :K].gather(-1, d[..., None])[..., 0].double()                       # [B, K] p_j(d_j)
    qd = q.gather(-1, d[..., None])[..., 0].double()                               # [B, K] q_j(d_j)
    n = (w[:, :K, 1] * qd < pd).long().cumprod(1).sum(1, keepdim=True)            # [B, 1] accepted drafts
    pn = p.gather(1, n[:, :, None].expand(B, 1, V))[:, 0]                          # [B, V] p_n
    qn = q.gather(1, n.clamp(max=K - 1)[:, :, None].expand(B, 1, V))[:, 0]         # [B, V] q_n (n < K)
    residual = torch.where(n < K, (pn - qn).clamp(min=0), pn)                     # [B, V]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, pn)
    y = inverse_cdf_draw(residual, w[:, :, 2].gather(1, n)[:, 0])                 # [B]
    j = torch.arange(K + 1, device=d.device)
    return torch.where(j < n, torch.cat([d, y[:, None]], 1), y[:, None])


@dataclass
class ChainOutput:
    tokens: Tensor     # [batch, steps] long: the greedy chain (target vocabulary ids)
    logprobs: Tensor   # [batch, steps] float32: log q of each, under the drafter's own distribution


class CompiledChain(CompiledForward):
    """Greedy chain drafting fused into one graph per bucket (issue: drafting K tokens should cost
    the framework time of one step). The first forward runs each sequence's pending tokens (up
    to the bucket's ``tokens``, ragged; ``last[b]`` its last real one), then ``steps - 1``
    one-token forwards follow inside the same graph, each fed the previous step's argmax at the
    next column (position = column: a chain) and, with ``next_width`` set (EAGLE heads), the
    previous step's output state as its feature. No host sync, no Python, between the steps.

    The steps' attention metadata is built in the graph from ``col`` [batch] (the column of the
    first drafted token): a mask as wide as the cache, causal by column (and inside the model's
    sliding window). The caller checks that ``col + steps - 2`` fits the cache (padding
    sequences: the scratch row, columns from 1). ``next_width``: the width of the states fed
    back (the head's hidden size); None (draft models): no features after the first forward.

    ``vocab`` (set for an EAGLE-3 head with a reduced vocabulary, EagleHead.own_vocab: its chains
    and its speculation rounds' drafts): the target ids [Vd] of the head's own vocabulary; the
    steps' logits are then the head's [B, Vd] (not spread over the target's V with -inf
    elsewhere), each pick is made there (half the softmax, cumulative sum and race of a sampled
    pick) and mapped to target ids."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, buckets: list[Bucket], steps: int,
                 feature_width: int | None = None, next_width: int | None = None, vocab: Tensor | None = None,
                 compile: bool = True) -> None:
        super().__init__(model, kv, buckets, (), feature_width, compile)
        self.steps, self.next_width, self.vocab = steps, next_width, vocab
        self.window = model.args.sliding_window
        self._fn = self._wrap(self._chain)
        # eagerly, the whole chain (tree) of an EAGLE-3 head or a draft model as one C++ call
        # (model/native_draft.py)
        self.native_draft = (None if compile or not self.native
                             else NativeHeadForward.for_head(model) or NativeLlamaForward.for_model(model))

    def _chain(self, tok: Tensor, pos: Tensor, mask: Tensor, rows: Tensor, write_rows: Tensor, write_cols: Tensor,
               kv_len: Tensor, features: Tensor | None, last: Tensor, col: Tensor,
               steps: int | None = None, stop: Tensor | None = None) -> ChainOutput:
        if self.native_draft is not None and (self.vocab is not None or getattr(self.model, "identity_vocab", True)):
            # (eagerly: the whole chain from C++; over the target's vocabulary only when it is the head's)
            return ChainOutput(*self.native_draft.chain(
                tok, pos, mask, rows, write_rows, write_cols, kv_len, features, last, col,
                self.steps if steps is None else steps, self.vocab, self.window, self.kv, stop=stop))
        toks, (lps,) = self._steps(tok, pos, mask, rows, write_rows, write_cols, kv_len, features, last, col,
                                   steps=steps, stop=stop)
        return ChainOutput(toks, lps)

    def _pick(self, logits: Tensor, j: int, *pick_args: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Step j's token from its logits [B, V] -> [B] and what the graph returns with it (greedy:
        the argmax and its log q)."""
        lp, x = first_max(torch.log_softmax(logits.float(), -1))                   # [B], [B]
        return x, (lp,)

    def _steps(self, tok: Tensor, pos: Tensor, mask: Tensor, rows: Tensor, write_rows: Tensor, write_cols: Tensor,
               kv_len: Tensor, features: Tensor | None, last: Tensor, col: Tensor,
               *pick_args: Tensor, steps: int | None = None, stop: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
        """The chain: -> tokens [B, steps] and each of ``_pick``'s outputs stacked [B, steps, ...]
        (``steps``: eagerly, fewer than the graph's; see ``_serve``). ``stop`` [B] float64 (eagerly,
        greedy chains: SpeculativeConfig.min_draft_confidence): once every row's path log confidence
        (the float64 sum of its picks' log q, as spec_decode/draft.py chain_length sums them) is below
        its stop, no further step runs (fewer than ``steps`` columns; the native loop makes the same
        sums and test)."""
        steps = self.steps if steps is None else steps
        B, S = tok.shape
        at = torch.arange(B, device=tok.device) * S + last                        # [B] rows of the last tokens
        g = self._forward(tok, pos, mask, rows, write_rows, write_cols, kv_len, features, at if S > 1 else None)
        logits = g.logits                                                          # [B, V]
        h = g.hidden.reshape(B * S, -1)[at]                                        # [B, H]
        state = self._state(g, at)
        cols = torch.arange(mask.shape[-1], device=tok.device)                     # [W]
        toks, outs = [], []
        path = None                                                                # [B] path log confidence
        for j in range(steps):
            x, out = self._pick(logits, j, *pick_args)
            if self.vocab is not None:
                x = self.vocab[x]                                                  # [B] target ids
            toks.append(x)
            outs.append(out if state is None else (*out, state))
            if j == steps - 1:
                break
            if stop is not None:
                lq = out[0].double()
                path = lq if path is None else path + lq
                if bool((path < stop).all()):
                    break
            c = col + j                                                            # [B] this step's column
            m = causal_mask(cols, c[:, None], self.window)                         # [B, 1, 1, W]
            g = self._forward(x[:, None], c[:, None], m, rows, rows, c, c.max() + 1,
                              h[:, None] if self.next_width is not None else None)
            logits, h = g.logits, g.hidden[:, 0]
            state = self._state(g, None)
        return torch.stack(toks, 1), [torch.stack(o, 1) for o in zip(*outs)]

    def _state(self, g: GraphOutput, at: Tensor | None) -> Tensor | None:
        """A step's per-sequence state the graph returns beside its pick (after ``_pick``'s
        outputs), from its forward ``g`` (``at``: the rows of the first forward's last tokens):
        none for chains."""
        return None

    def __call__(self, tok: Tensor, pos: Tensor, meta: AttnMeta, features: Tensor | None,  # type: ignore[override]
                 last: Tensor, col: Tensor, steps: int | None = None, stop: Tensor | None = None) -> ChainOutput:
        return self._serve(self._args(tok, pos, meta, features, last, col), steps, stop)

    def _flatten(self, out: ChainOutput) -> list[Tensor]:  # type: ignore[override]
        return [out.tokens, out.logprobs]

    def _unflatten(self, flat: list[Tensor]) -> ChainOutput:  # type: ignore[override]
        return ChainOutput(flat[0], flat[1])

    def _warm_extra(self, b: Bucket, kv_len: int, dev: torch.device) -> tuple[Tensor, ...]:
        last = torch.full((b.batch,), b.tokens - 1, dtype=torch.long, device=dev)
        return last, torch.full((b.batch,), kv_len, dtype=torch.long, device=dev)


class RaceChain(CompiledChain):
    """CompiledChain's steps drawing from q = softmax(logits / logit_scale / T) (``race_probs``):
    sampled rows take the race's winner under q with the exponentials of their step's position
    (``race_draw``), or, rows verified by rejection sampling (``reject``), an inverse-CDF draw
    with their step's first uniform; the others the argmax. Each step also returns q [B, V].
    Traced into the graphs of sampled speculation rounds (CompiledSpecRound), which pass
    (temperature [B], sampled [B] bool, e [B, steps, V], reject [B] bool, w [B, steps, 3]) to
    ``_steps``. Never compiled on its own."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, buckets: list[Bucket], steps: int,
                 feature_width: int | None = None, next_width: int | None = None, logit_scale: float = 1.0,
                 vocab: Tensor | None = None) -> None:
        super().__init__(model, kv, buckets, steps, feature_width, next_width, vocab)
        self.logit_scale = logit_scale

    def _pick(self, logits: Tensor, j: int, *pick_args: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        temperature, sampled, e, reject, w = pick_args   # [B], [B] bool, [B, steps, V], [B] bool, [B, steps, 3]
        lf = logits.float()                                                        # [B, V'] (V' = Vd: vocab)
        q = race_probs(lf, temperature, self.logit_scale)                          # [B, V']
        ej = e[:, j] if self.vocab is None else e[:, j].index_select(-1, self.vocab)
        drawn = torch.where(reject, inverse_cdf_draw(q, w[:, j, 0]), first_max(q.double() / ej)[1])
        if self.vocab is not None:   # q over the target's vocabulary (the verification's p - q)
            q = q.new_zeros(q.shape[0], e.shape[-1]).index_copy(-1, self.vocab, q)  # [B, V]
        return torch.where(sampled, drawn, first_max(lf)[1]), (q,)


@dataclass
class DecodeStepsOutput:
    tokens: Tensor     # [batch, steps] long: each step's token (greedy rows: the argmax of the raw logits)
    logits: Tensor     # [batch, steps] float32: the step's largest logit (the host checks that it is finite)
    states: Tensor | None = None   # [batch, steps, F]: the target's state of each step's input token (EAGLE's)


class CompiledDecodeSteps(CompiledChain):
    """Multi-step decode of a target in one graph per bucket (vLLM's ``num_scheduler_steps``): the
    chain of CompiledChain, each step's token picked by the engine's own rules, so ``steps``
    tokens cost one call's framework time and one pass of the engine's bookkeeping. Greedy rows
    take the argmax of the raw float32 logits (the first of equal maxima, as ``Tensor.max``);
    sampled rows (``sampled`` True, temperature only) draw as the sampler does
    (sampling/sampler.py ``sample``) from q = softmax(logits / T): seeded rows the race's winner
    argmax q / E with E = -log U [batch, steps, V] float64 computed on the host from their position
    noise, unseeded rows (``stream``) the inverse-CDF draw with one uniform w [batch, steps]
    float64 from their generator, so a step draws the token a one-token step would. The engine uses it for
    decode steps where nothing drafts (engine/engine.py ``_decode_steps``). ``states``: the graph
    also returns the target's state of every step's input token, as ``ModelRunner.step`` does
    ("hidden": the final-norm state, EAGLE-1's; a tuple of layer ids: those layers' outputs
    concatenated, EAGLE-3's), so an EAGLE head can draft after multi-step decode."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, buckets: list[Bucket], steps: int,
                 states: str | tuple[int, ...] | None = None) -> None:
        super().__init__(model, kv, buckets, steps)
        self.aux_layers = states if isinstance(states, tuple) else ()
        self.states = states is not None
        self._fn = self._wrap(self._decode_steps)

    def _decode_steps(self, tok: Tensor, pos: Tensor, mask: Tensor, rows: Tensor, write_rows: Tensor,
                      write_cols: Tensor, kv_len: Tensor, features: Tensor | None, last: Tensor,
                      col: Tensor, temperature: Tensor, sampled: Tensor, e: Tensor, stream: Tensor,
                      w: Tensor) -> DecodeStepsOutput:
        toks, outs = self._steps(tok, pos, mask, rows, write_rows, write_cols, kv_len, features, last, col,
                                 temperature, sampled, e, stream, w)
        return DecodeStepsOutput(toks, outs[0], outs[1] if self.states else None)

    def _state(self, g: GraphOutput, at: Tensor | None) -> Tensor | None:
        if not self.states:
            return None
        f = g.hidden if not self.aux_layers else torch.cat(g.aux, -1)              # [B, S, F]
        return f.reshape(-1, f.shape[-1])[at] if at is not None else f[:, 0]       # [B, F]

    def _pick(self, logits: Tensor, j: int, *pick_args: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        temperature, sampled, e, stream, w = pick_args   # [B], [B] bool, [B, steps, V], [B] bool, [B, steps]
        lf = logits.float()
        value, greedy = first_max(lf)                                              # [B], [B]
        drawn = torch.where(stream, inverse_cdf_draw(race_probs(lf, temperature), w[:, j]),
                            race_draw(lf, temperature, e[:, j]))
        return torch.where(sampled, drawn, greedy), (value,)

    def __call__(self, tok: Tensor, pos: Tensor, meta: AttnMeta, features: Tensor | None,  # type: ignore[override]
                 last: Tensor, col: Tensor, temperature: Tensor, sampled: Tensor, e: Tensor, stream: Tensor,
                 w: Tensor) -> DecodeStepsOutput:
        return self._serve(self._args(tok, pos, meta, features, last, col, temperature, sampled, e, stream, w))

    def _flatten(self, out: DecodeStepsOutput) -> list[Tensor]:  # type: ignore[override]
        return [out.tokens, out.logits] + ([] if out.states is None else [out.states])

    def _unflatten(self, flat: list[Tensor]) -> DecodeStepsOutput:  # type: ignore[override]
        return DecodeStepsOutput(flat[0], flat[1], flat[2] if len(flat) > 2 else None)

    def _warm_extra(self, b: Bucket, kv_len: int, dev: torch.device) -> tuple[Tensor, ...]:
        V = self.model.args.vocab_size
        return (*super()._warm_extra(b, kv_len, dev), torch.full((b.batch,), 0.7, device=dev),
                torch.ones(b.batch, dtype=torch.bool, device=dev),
                -torch.log(torch.rand(b.batch, self.steps, V, dtype=torch.float64, device=dev).clamp_(min=1e-300)),
                torch.arange(b.batch, device=dev) % 2 == 1,
                torch.rand(b.batch, self.steps, dtype=torch.float64, device=dev))


@dataclass
class SampledChainOutput:
    tokens: Tensor     # [batch, steps] long: drawn (sampled rows) or the argmax (greedy rows)
    logprobs: Tensor   # [batch, steps] float32: log q of the argmax (greedy rows' scores)
    shares: Tensor     # [batch, steps] float32: log of the race winner's share of its first ``want`` (seeded rows)
    q: Tensor          # [batch, steps, V] float32: the distribution each token was drawn from


class CompiledSampledChain(CompiledChain):
    """Sampled chain drafting in one graph per bucket, the sampled twin of CompiledChain (an
    EAGLE head's chains at temperature > 0). Each step draws as the sampler does
    (sampling/sampler.py ``sample``) from q = softmax(logits / logit_scale / T): seeded rows
    the race's winner argmax q / E with the exponentials E = -log U of their position noise
    [batch, steps, V] float64 (``sampler.exponentials``: the E every race at that position
    divides by; the eager C++ chain takes their noise keys [batch, steps, 2] int64 instead,
    ``races_by_key``), unseeded rows (``stream``) the inverse-CDF draw with one uniform w [batch, steps]
    float64 of their generator, both drawn on the host and passed in, so the graph draws the
    tokens the eager drafter draws. Rows with ``sampled`` False take the argmax, as
    CompiledChain. Only temperature: requests with penalties, token rules, top-k/p or min-p
    draft eagerly.

    ``vocab`` (an EAGLE-3 head's own vocabulary, ascending target ids; CompiledChain.vocab): each
    step's softmax, race and inverse-CDF draw run over the head's Vd logits, and q is spread over
    the target's V once after the last step (the verification's p - q), not per level. In
    ascending order an inverse-CDF draw over Vd picks the token the draw over V (zeros elsewhere)
    picks, and the race's finishers are the same; the eager expansion computes such a q the same
    way (proposers/eagle.py ``_candidates``), so both draw the same tokens."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, buckets: list[Bucket], steps: int, want: int,
                 logit_scale: float = 1.0, feature_width: int | None = None, next_width: int | None = None,
                 vocab: Tensor | None = None, compile: bool = True) -> None:
        if vocab is not None and not ascending(vocab):
            raise ValueError("a sampled chain's own vocabulary must be in ascending target-id order")
        super().__init__(model, kv, buckets, steps, feature_width, next_width, vocab, compile=compile)
        self.want, self.logit_scale = want, logit_scale
        self._unread_e: Tensor | None = None   # (``unread``)
        self._no_keys = torch.zeros(0, 0, 2, dtype=torch.int64)
        self._fn = self._wrap(self._sampled_chain)

    @property
    def races_by_key(self) -> bool:
        """Whether the chain runs eagerly in C++ (model/native_draft.py), which races seeded rows
        by their noise keys (sampler.noise_keys [B, steps, 2]) in place of E [B, steps, V]."""
        return isinstance(self.native_draft, NativeHeadForward) and (self.vocab is not None
                                                                     or self.model.identity_vocab)

    def unread(self, batch: int, dev: torch.device) -> Tensor:
        """[batch, steps, V] float64 ones: the race's exponentials of a step where no row
        races (greedy and unseeded rows), rows of one buffer as large as the largest warmed
        bucket, made at the first such step (eagerly a broadcast view of one value: no buffer of
        max_num_seqs x steps x V)."""
        if not self.compiled:
            return torch.tensor(1.0, dtype=torch.float64, device=dev).expand(
                batch, self.steps, self.model.args.vocab_size)
        if self._unread_e is None:
            most = max(b.batch for b in self.warmed)
            self._unread_e = torch.ones(most, self.steps, self.model.args.vocab_size, dtype=torch.float64,
                                        device=dev)
        return self._unread_e[:batch]

    def _sampled_chain(self, tok: Tensor, pos: Tensor, mask: Tensor, rows: Tensor, write_rows: Tensor,
                       write_cols: Tensor, kv_len: Tensor, features: Tensor | None, last: Tensor, col: Tensor,
                       temperature: Tensor, sampled: Tensor, e: Tensor, stream: Tensor,
                       w: Tensor, steps: int | None = None) -> SampledChainOutput:
        # (eagerly: the whole chain from C++, over the head's own vocabulary or the target's: a head
        # whose vocabulary is not in ascending order picks over the spread logits, in Python)
        if self.races_by_key and (e.dtype == torch.int64 or e.stride(-1) == 0):
            # (e: the seeded rows' noise keys [B, steps, 2] int64, or ``unread``'s view: no race; rows
            # of E given (benchmarks/sampling_bench.py's race of unseeded rows) race in Python below)
            race = e.dtype == torch.int64
            toks, lps, shares, q = self.native_draft.sampled_chain(
                tok, pos, mask, rows, write_rows, write_cols, kv_len, features, last, col,
                self.steps if steps is None else steps, self.vocab, self.window, self.kv,
                temperature=temperature, sampled=sampled, keys=e if race else self._no_keys, stream=stream, w=w,
                want=self.want, scale=self.logit_scale, race=race, vocab_size=self.model.args.vocab_size)
            return SampledChainOutput(toks, lps, shares, q)
        toks, (lps, shares, q) = self._steps(tok, pos, mask, rows, write_rows, write_cols, kv_len, features,
                                             last, col, temperature, sampled, e, stream, w, steps=steps)
        if self.vocab is not None and q.shape[-1] != e.shape[-1]:   # [B, steps, Vd] -> [B, steps, V]
            q = q.new_zeros(*q.shape[:-1], e.shape[-1]).index_copy(-1, self.vocab, q)
        return SampledChainOutput(toks, lps, shares, q)

    def _pick(self, logits: Tensor, j: int, *pick_args: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        temperature, sampled, e, stream, w = pick_args   # [B], [B] bool, [B, steps, V], [B] bool, [B, steps]
        lf = logits.float()                                                        # [B, V'] (V' = Vd: vocab)
        lp, greedy = first_max(torch.log_softmax(lf, -1))                          # [B], [B]
        q = race_probs(lf, temperature, self.logit_scale)                          # [B, V'] as the sampler's probs
        if not self.compiled and e.stride(-1) == 0:
            # eagerly, a step where no row races (e: ``unread``'s broadcast view): no race to run
            # (about 40 us a level: V float64 quotients, a top-k), no seeded row's share
            drawn = torch.where(stream, inverse_cdf_draw(q, w[:, j]), greedy)
            return torch.where(sampled, drawn, greedy), (lp, torch.zeros_like(lp), q)
        ej = e[:, j] if self.vocab is None else e[:, j].index_select(-1, self.vocab)   # [B, V']
        top = (q.double() / ej).topk(min(self.want, q.shape[-1]), -1)  # the race's first finishers
        drawn = torch.where(stream, inverse_cdf_draw(q, w[:, j]), top.indices[:, 0])
        x = torch.where(sampled, drawn, greedy)
        # (the share of the racing rows only, as the C++ op gives it: 0 for the other rows)
        share = torch.where(sampled & ~stream, torch.log(top.values[:, 0] / top.values.sum(-1)).float(), 0.0)
        return x, (lp, share, q)

    def __call__(self, tok: Tensor, pos: Tensor, meta: AttnMeta, features: Tensor | None,  # type: ignore[override]
                 last: Tensor, col: Tensor, temperature: Tensor, sampled: Tensor, e: Tensor, stream: Tensor,
                 w: Tensor, steps: int | None = None) -> SampledChainOutput:
        return self._serve(self._args(tok, pos, meta, features, last, col, temperature, sampled, e, stream, w),
                           steps)

    def _flatten(self, out: SampledChainOutput) -> list[Tensor]:  # type: ignore[override]
        return [out.tokens, out.logprobs, out.shares, out.q]

    def _unflatten(self, flat: list[Tensor]) -> SampledChainOutput:  # type: ignore[override]
        return SampledChainOutput(*flat)

    def _warm_extra(self, b: Bucket, kv_len: int, dev: torch.device) -> tuple[Tensor, ...]:
        V = self.model.args.vocab_size
        return (*super()._warm_extra(b, kv_len, dev), torch.full((b.batch,), 0.7, device=dev),
                torch.ones(b.batch, dtype=torch.bool, device=dev),
                -torch.log(torch.rand(b.batch, self.steps, V, dtype=torch.float64, device=dev).clamp_(min=1e-300)),
                torch.arange(b.batch, device=dev) % 2 == 1,
                torch.rand(b.batch, self.steps, dtype=torch.float64, device=dev))


@dataclass
class TreeOutput:
    """A greedy dynamic draft tree per sequence (EAGLE-2), its best ``nodes`` nodes in verification
    order: depth ascending, path confidence descending within a depth (parents before children)."""
    tokens: Tensor     # [batch, nodes] long: target vocabulary ids
    parents: Tensor    # [batch, nodes] long: parent's index in this order, -1 = the root
    depths: Tensor     # [batch, nodes] long: 1 = a child of the root
    ranks: Tensor      # [batch, nodes] long: rank by path confidence (0 = the most confident)
    scores: Tensor     # [batch, grown] float32: every grown candidate's path confidence (log), best first


class CompiledTree(CompiledChain):
    """Greedy dynamic tree drafting (EAGLE-2) fused into one graph per bucket, the tree twin of
    CompiledChain: the catch-up forward, then ``steps - 1`` levels, each one forward over the
    ``topk`` frontier nodes of every sequence, then the reranking; no host sync in between.

    Level 1: the ``topk`` most likely tokens after the last caught-up position are the depth-1
    nodes and the first frontier. Level d (2..steps): the frontier's tokens run at columns
    ``col + (d - 2) * topk + i``, position ``col + d - 2`` (its depth), each fed its parent's
    output state and attending to the prefix (columns < col) and its ancestors' columns (a
    [batch, topk, tree columns] ancestor mask carried from level to level); each frontier node
    proposes its ``topk`` most likely children, scored by path confidence (sum of log q along the
    path), and the ``topk`` best of those ``topk**2`` form the next frontier. Every node grown is
    a candidate: ``topk + (steps - 1) * topk**2`` of them. Reranking keeps the ``nodes`` best by
    path confidence (a stable sort: a child never outranks its parent, so the set is closed under
    ancestors) and orders them by depth, then confidence. Same tree as the eager expansion
    (spec_decode/proposers/eagle.py) up to the order of exact ties."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, buckets: list[Bucket], steps: int, topk: int,
                 nodes: int, feature_width: int | None = None, next_width: int | None = None,
                 compile: bool = True) -> None:
        if model.args.sliding_window is not None:
            raise ValueError("fused draft trees need a drafter without a sliding window")
        if topk < 2 or steps < 2:
            raise ValueError("a fused draft tree has topk >= 2 and at least 2 levels (else: CompiledChain)")
        super().__init__(model, kv, buckets, steps, feature_width, next_width, compile=compile)
        self.topk = topk
        self.grown = topk + (steps - 1) * topk * topk
        self.nodes = min(nodes, self.grown)
        self._fn = self._wrap(self._tree)

    @property
    def tree_cols(self) -> int:
        """Cache columns the expansion writes after ``col`` (the frontier of levels 1..steps-1)."""
        return (self.steps - 1) * self.topk

    def _tree(self, tok: Tensor, pos: Tensor, mask: Tensor, rows: Tensor, write_rows: Tensor, write_cols: Tensor,
              kv_len: Tensor, features: Tensor | None, last: Tensor, col: Tensor) -> TreeOutput:
        if isinstance(self.native_draft, NativeHeadForward):   # (eagerly: the whole tree from C++)
            spread = None if self.model.identity_vocab else self.model.draft_ids
            return TreeOutput(*self.native_draft.tree(
                tok, pos, mask, rows, write_rows, write_cols, kv_len, features, last, col, self.steps, self.topk,
                self.nodes, spread, self.model.args.vocab_size, self.kv))
        B, S = tok.shape
        k, T, dev = self.topk, self.tree_cols, tok.device
        at = torch.arange(B, device=dev) * S + last                               # [B] rows of the last tokens
        g = self._forward(tok, pos, mask, rows, write_rows, write_cols, kv_len, features, at if S > 1 else None)
        lp = torch.log_softmax(g.logits.float(), -1)                              # [B, V]
        score, x = lp.topk(k)                                                     # [B, k] frontier, best first
        h = g.hidden.reshape(B * S, -1)[at][:, None].expand(B, k, -1)             # [B, k, H] their feature
        ids = torch.arange(k, device=dev).expand(B, k)                            # [B, k] frontier node ids
        toks, scores, parents = [x], [score], [torch.full((B, k), -1, dtype=torch.long, device=dev)]
        depths = [torch.ones(B, k, dtype=torch.long, device=dev)]
        anc = torch.zeros(B, k, T, dtype=torch.bool, device=dev)                 # [B, k, T] ancestors' columns
        cols = torch.arange(mask.shape[-1], device=dev)                           # [W]
        slots = torch.arange(k, device=dev)                                       # [k]
        rel = cols[None, :] - col[:, None]                                        # [B, W] column - col
        in_tree = (rel >= 0) & (rel < T)                                          # [B, W]
        offset = k
        for d in range(2, self.steps + 1):
            t = (d - 2) * k + slots                                               # [k] tree columns of the frontier
            sees = anc | torch.nn.functional.one_hot(t, T).bool()[None]           # [B, k, T] + itself
            m = (rel < 0)[:, None, :] | (sees.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(B, k, -1))
                                         & in_tree[:, None, :])                   # [B, k, W]
            c = col[:, None] + t[None, :]                                         # [B, k] columns written
            p = (col + d - 2)[:, None].expand(B, k)                               # [B, k] positions (depth)
            g = self._forward(x, p, m[:, None], rows, rows.repeat_interleave(k), c.reshape(-1), c.max() + 1,
                              h if self.next_width is not None else None)
            lp = torch.log_softmax(g.logits.float(), -1).reshape(B, k, -1)        # [B, k, V]
            cs, cx = lp.topk(k)                                                   # [B, k, k] children
            # [B, k*k] path confidence, never above the parent's (log q <= 0; kept exact so that the
            # stable sort below ranks every parent before its children)
            cs = torch.minimum(score[:, :, None] + cs, score[:, :, None]).reshape(B, k * k)
            cx = cx.reshape(B, k * k)
            toks.append(cx)
            scores.append(cs)
            parents.append(ids[:, :, None].expand(B, k, k).reshape(B, k * k))
            depths.append(torch.full((B, k * k), d, dtype=torch.long, device=dev))
            if d == self.steps:
                break
            score, best = cs.topk(k)                                              # [B, k] next frontier
            x = cx.gather(1, best)
            slot = best // k                                                      # [B, k] its parent's slot
            h = g.hidden.reshape(B, k, -1).gather(1, slot[:, :, None].expand(B, k, g.hidden.shape[-1]))
            anc = sees.gather(1, slot[:, :, None].expand(B, k, T))                # parent's ancestors + parent
            ids = offset + best
            offset += k * k
        tok_all, score_all = torch.cat(toks, 1), torch.cat(scores, 1)             # [B, M]
        par_all, depth_all = torch.cat(parents, 1), torch.cat(depths, 1)          # [B, M]
        ranked = score_all.sort(dim=1, descending=True, stable=True)                  # ties: shallower first
        n = self.nodes
        top = ranked.indices[:, :n]                                               # [B, n] by confidence
        by_depth = depth_all.gather(1, top).sort(dim=1, stable=True).indices          # [B, n]
        order = top.gather(1, by_depth)                                           # [B, n] depth, confidence
        local = torch.full_like(tok_all, -1)                                      # [B, M] node -> its index
        local.scatter_(1, order, torch.arange(n, device=dev).expand(B, n))
        par = par_all.gather(1, order)                                            # [B, n] global parents
        par_local = torch.where(par < 0, par, local.gather(1, par.clamp(min=0)))
        return TreeOutput(tok_all.gather(1, order), par_local, depth_all.gather(1, order), by_depth,
                          ranked.values)

    def _flatten(self, out: TreeOutput) -> list[Tensor]:  # type: ignore[override]
        return [out.tokens, out.parents, out.depths, out.ranks, out.scores]

    def _unflatten(self, flat: list[Tensor]) -> TreeOutput:  # type: ignore[override]
        return TreeOutput(*flat)


@dataclass
class RoundRace:
    """The randomness of a step of sampled speculation rounds (CompiledSpecRound), per sequence."""
    temperature: Tensor   # [B] float32 (1 for rows that do not draw)
    sampled: Tensor       # [B] bool: the row draws (else the argmax)
    e: Tensor | None      # [B, positions, V] float64: the race's exponentials E = -log U of the next
                          # output positions (matching; None: no row races, the graph gets ones from
                          # one buffer, and no logarithm is taken anywhere)
    reject: Tensor        # [B] bool: the row is verified by rejection sampling, with ...
    w: Tensor             # [B, positions, 3] float64: ... three uniforms per output position


@dataclass
class SpecRoundOutput:
    drafts: Tensor     # [batch, K] long: the round's draft chain (greedy, or drawn: sampled rounds)
    target: Tensor     # [batch, K + 1] long: the target's token at each verified row (argmax or race winner)
    top: Tensor        # [batch, K + 1] float32: its logit (the host checks that it is finite)
    last2: Tensor      # [batch, 2] long: the next round's input: the tokens at columns col - 1, col
    col: Tensor        # [batch] long: the next round's column (its newest token, not yet in the target's cache)


class CompiledSpecRound(CompiledForward):
    """A speculation round (draft K, verify, accept) of a draft model and its target in one
    graph per bucket, whose outputs are the next round's inputs: multi-step speculation
    (``num_scheduler_steps`` with a draft model) calls it that many times back to back, with no
    host work between the calls, so the engine's host work (inputs, sampling, bookkeeping) is paid
    once per that many rounds, and one compiled round serves any number of them.

    A round, for each sequence whose newest token ``tok`` sits at column ``col`` (not yet in the
    target's cache) after ``prev`` at ``col - 1``: the draft model's chain (CompiledChain's steps,
    over the draft's own cache) is fed [prev, tok] at columns col - 1, col (the first recomputed
    when the draft had it: always two, so the shape is fixed) and drafts d_1..d_K; the target
    verifies [tok, d_1..d_K] at columns col..col + K in one forward; n = the length of the
    drafts' prefix equal to the target's argmax at their rows; the next round starts from
    prev = the token at col + n (tok or d_n), tok = the target's argmax after it (the bonus),
    col + n + 1. Rejected drafts' cache columns are overwritten later, as after a one-round step.
    Every column and mask is computed in the graph from ``col``.

    The host gets each round's drafts and the target's argmax at every row, and accepts them as a
    one-round step would (verify/greedy.py): the output is exactly one-round speculation's, and so
    the target's greedy output. The caller checks that ``col + K`` of every round fits both caches
    (padding sequences: the scratch row from column 1; it advances at most K + 1 per round).

    Sampled rounds (``positions`` set: a second graph, for batches with temperature-only sampled
    requests) take six more inputs, the same for every round of a step (``RoundRace``):
    temperature [B], sampled [B] bool, e [B, positions, V] float64 the race's exponentials
    E = -log U (taken on the host, for the sequences that race) of the tokens at columns col0 + 1,
    col0 + 2, ..., col0 [B] (the first round's ``col``), reject [B] bool and w [B, positions, 3]
    float64, three uniforms per column. Two lossless verifications, chosen per sequence:

    - **Matching** (sampled, not ``reject``: seeded requests). The drafts and the target's token
      at every verified row are the sampler's race winners under q and p with the noise of their
      column (``race_draw``), and drafts are accepted while they equal the target's: lossless and
      drafter-invariant as a seeded request's one-round step (verify/greedy.py), so a seeded
      request's output is the one it gets without speculation.
    - **Rejection sampling** (``reject``: unseeded requests; Leviathan et al. 2023, Chen et al.
      2023, as verify/rejection.py). Draft x_j ~ q_j by inverse CDF with w[j, 0]; accepted while
      w[j, 1] q_j(x_j) < p_j(x_j); at the first rejected row j the token is drawn from
      norm(max(p_j - q_j, 0)) with w[j, 2], after K accepted drafts from p_{K+1}. It accepts
      1 - TV(p, q) per draft, more than matching's coupling, and needs three uniforms per column
      where the race needs V. A round's output depends only on its columns up to the one it ends
      at; the next round starts after it, so every decision takes fresh uniforms.

    The round returns the target's token at every row either way (rejection rows: the accepted
    drafts, then the drawn token, which never equals the rejected draft: max(p - q, 0) is 0
    there), so the host accepts every row by matching."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, draft: torch.nn.Module, draft_kv: KVCache,
                 buckets: list[Bucket], k: int, positions: int | None = None) -> None:
        if draft_kv.scratch_row != kv.scratch_row or draft_kv.max_model_len < kv.max_model_len:
            raise ValueError("multi-step speculation needs the draft's cache as wide as the target's, with the "
                             f"same rows (rows {draft_kv.scratch_row} vs {kv.scratch_row}, "
                             f"columns {draft_kv.max_model_len} vs {kv.max_model_len})")
        super().__init__(model, kv, buckets, self._target_states(draft))
        self.positions = positions
        self._unread_e: Tensor | None = None   # (``_unread``)
        self.draft = self._drafter(draft, draft_kv, k, positions is not None)   # its chain's steps, traced here
        self.caches = (kv, draft_kv)
        self.k = k
        self.window = model.args.sliding_window
        self._fn = self._wrap(self._round)

    @staticmethod
    def _target_states(draft: torch.nn.Module) -> tuple[int, ...]:
        return ()

    @staticmethod
    def _drafter(draft: torch.nn.Module, draft_kv: KVCache, k: int, sampled: bool) -> CompiledChain:
        return (RaceChain if sampled else CompiledChain)(draft, draft_kv, [], k)

    def _round(self, last2: Tensor, col: Tensor, rows: Tensor, *race: Tensor) -> SpecRoundOutput:
        """last2 [B, 2]: each sequence's tokens at columns col - 1 and col; col, rows [B]; race:
        nothing (greedy rounds) or temperature, sampled, u, col0 (sampled rounds, above)."""
        dev = last2.device
        pick = self._noise(col, race)
        dq = col[:, None] + torch.arange(2, device=dev) - 1                        # [B, 2] draft's pending columns
        d, q = self.draft._steps(last2, dq, causal_mask(self._draft_cols(dev), dq, self.draft.window), rows,
                                 rows.repeat_interleave(2), dq.flatten(), col.max() + 1, None,
                                 torch.ones_like(col), col + 1, *pick)             # [B, K], ([B, K, V] q)
        g, ids, top, n = self._verify(last2[:, 1], d, col, rows, pick, q)
        vtok = torch.cat([last2[:, 1:], d], 1)                                     # [B, K + 1]
        nxt = torch.cat([vtok.gather(1, n), ids.gather(1, n)], 1)                  # [B, 2] d_n (or tok), bonus
        return SpecRoundOutput(d, ids, top, nxt, col + n[:, 0] + 1)

    def _draft_cols(self, dev: torch.device) -> Tensor:
        return torch.arange(self.draft.kv.max_model_len, device=dev)              # [W'] the draft cache's columns

    def _noise(self, col: Tensor, race: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The picks' arguments of a round whose newest tokens are at ``col`` [B]: () for greedy
        rounds, else temperature, sampled, E [B, K + 1, V], reject and w [B, K + 1, 3] of the K + 1
        tokens the round may draw (columns col + 1 .. col + K + 1: draft j and the target's row j
        share E[:, j] and w[:, j])."""
        if not race:
            return ()
        temperature, sampled, e, col0, reject, w = race
        i = (col - col0)[:, None] + torch.arange(self.k + 1, device=col.device)   # [B, K + 1] rows of e, w
        i = i.clamp(0, e.shape[1] - 1)   # (padding sequences; real ones stay inside: the caller sizes e)
        e = e.gather(1, i[:, :, None].expand(-1, -1, e.shape[2]))                 # [B, K + 1, V]
        return temperature, sampled, e, reject, w.gather(1, i[:, :, None].expand(-1, -1, 3))

    def _verify(self, tok: Tensor, d: Tensor, col: Tensor, rows: Tensor, pick: tuple[Tensor, ...] = (),
                q: list[Tensor] | tuple = ()) -> tuple[GraphOutput, Tensor, Tensor, Tensor]:
        """The target's forward over [tok, d_1..d_K] at columns col..col + K -> its output, its token
        at every row [B, K + 1] (the argmax; with ``pick``, ``_noise``'s: the race's winner for
        sampled rows, for ``reject`` rows the accepted drafts and then the drawn token, from the
        drafts' q [B, K, V]) and the largest logit, and the accepted drafts n [B, 1]."""
        B, K, dev = d.shape[0], self.k, d.device
        cols = torch.arange(self.kv.max_model_len, device=dev)                    # [W]
        vq = col[:, None] + torch.arange(K + 1, device=dev)                        # [B, K + 1] verified columns
        g = self._forward(torch.cat([tok[:, None], d], 1), vq, causal_mask(cols, vq, self.window), rows,
                          rows.repeat_interleave(K + 1), vq.flatten(), col.max() + K + 1)
        top, ids = g.top.view(B, K + 1), g.top_ids.view(B, K + 1)                  # [B, K + 1]
        if pick:
            temperature, sampled, e, reject, w = pick
            p = race_probs(g.logits.float().view(B, K + 1, -1), temperature)       # [B, K + 1, V]
            ids = torch.where(sampled[:, None], first_max(p.double() / e)[1], ids)
            ids = torch.where(reject[:, None], rejection_tokens(p, q[0], d, w), ids)
        n = (d == ids[:, :K]).long().cumprod(1).sum(1, keepdim=True)              # [B, 1] accepted drafts
        return g, ids, top, n

    def __call__(self, *args: Tensor) -> SpecRoundOutput:  # type: ignore[override]
        """The round's state (``pad``), rows [batch] of a warmed bucket (padding: the scratch row,
        column 1) and, for sampled rounds, the race's inputs (``race_args``)."""
        return self._serve(args)

    def race_args(self, race: "RoundRace", col0: Tensor, n: int) -> tuple[Tensor, ...]:
        """A sampled round's last six inputs (above) with ``n`` padding sequences appended (greedy,
        their exponentials those of the first sequence)."""
        r = race
        e = self._unread(len(col0) + n, col0.device) if r.e is None else r.e
        if n == 0:   # (e is a few MB: not copied for nothing)
            return r.temperature, r.sampled, e, col0, r.reject, r.w
        if r.e is not None:
            e = torch.cat([e, e[:1].expand(n, *e.shape[1:])])
        return (torch.cat([r.temperature, r.temperature.new_ones(n)]), torch.cat([r.sampled, r.sampled.new_zeros(n)]),
                e, torch.cat([col0, col0.new_ones(n)]),
                torch.cat([r.reject, r.reject.new_zeros(n)]), torch.cat([r.w, r.w[:1].expand(n, *r.w.shape[1:])]))

    def _unread(self, batch: int, dev: torch.device) -> Tensor:
        """[batch, positions, V] float64 ones: the race's exponentials of a step where no sequence
        races (RoundRace.e None), rows of one buffer made at the first such step."""
        if self._unread_e is None:
            most = max(b.batch for b in self.warmed)
            self._unread_e = torch.ones(most, self.positions, self.model.args.vocab_size, dtype=torch.float64,
                                        device=dev)
        return self._unread_e[:batch]

    def _key(self, args: tuple) -> tuple[int, int]:
        return args[0].shape[0], self.k + 1

    def pad(self, state: tuple[Tensor, ...], n: int) -> tuple[Tensor, ...]:
        """A round's input state (the arguments before ``rows``) with ``n`` padding sequences
        appended: token 0 from column 1 (on the scratch row)."""
        last2, col = state
        return torch.cat([last2, last2.new_zeros(n, 2)]), torch.cat([col, col.new_ones(n)])

    #: the next round's input state: these of a round's flat outputs (``_flatten``), in ``pad``'s order
    carried: tuple[int, ...] = (3, 4)

    def rounds(self, args: tuple, n: int) -> list[list[Tensor]]:
        """``n`` rounds back to back from ``args`` (as ``__call__``'s), each fed the last one's state
        -> each round's flat outputs (``_flatten``'s order: drafts, target, top, then the state)."""
        return self._serve_chained(args, n, self.carried)

    def _flatten(self, out: SpecRoundOutput) -> list[Tensor]:  # type: ignore[override]
        return [out.drafts, out.target, out.top, out.last2, out.col]

    def _unflatten(self, flat: list[Tensor]) -> SpecRoundOutput:  # type: ignore[override]
        return SpecRoundOutput(*flat)

    def _warm_args(self, b: Bucket, kv_len: int, dev: torch.device, scratch: int) -> tuple:
        col = torch.full((b.batch,), kv_len - b.tokens, dtype=torch.long, device=dev)   # 1, then 3
        return (torch.zeros(b.batch, 2, dtype=torch.long, device=dev), col,
                torch.full((b.batch,), scratch, dtype=torch.long, device=dev), *self._warm_race(b, col))

    def _warm_race(self, b: Bucket, col: Tensor) -> tuple[Tensor, ...]:
        if self.positions is None:
            return ()
        dev, V = col.device, self.model.args.vocab_size
        e = -torch.log(torch.rand(b.batch, self.positions, V, dtype=torch.float64, device=dev).clamp_(min=1e-300))
        reject = torch.arange(b.batch, device=dev) % 2 == 1   # (both verifications run)
        return (torch.full((b.batch,), 0.7, device=dev), torch.ones(b.batch, dtype=torch.bool, device=dev),
                e, col.clone(),   # (its own tensor: DirectCall maps inputs by identity)
                reject, torch.rand(b.batch, self.positions, 3, dtype=torch.float64, device=dev))


@dataclass
class EagleRoundOutput:
    drafts: Tensor     # [batch, K] long: the round's draft chain (greedy, or drawn: sampled rounds)
    target: Tensor     # [batch, K + 1] long: the target's token at each verified row (argmax or race winner)
    top: Tensor        # [batch, K + 1] float32: its logit
    tokens: Tensor     # [batch, K + 1] long: the next round's head input: the tokens after its pending positions
    features: Tensor   # [batch, K + 1, F]: the target's features of those positions (the head's dtype)
    last: Tensor       # [batch] long: the last real pending position's index (the rest pad)
    start: Tensor      # [batch] long: the first pending position (a head cache column)


class CompiledEagleRound(CompiledSpecRound):
    """CompiledSpecRound with an EAGLE head drafting (``eagle_topk`` 1: chains): the head's input is
    its pending positions, the positions whose target features it has not yet run (``start`` ..
    ``start + last``, at most K + 1: ``tokens`` the token after each, ``features`` the target's
    feature of each); the newest token is the last of ``tokens``, at target column
    col = start + last + 1. After the target verifies [tok, d_1..d_K] with n drafts accepted, the
    next round's pending positions are col..col + n (the target's features of its verified rows
    0..n, tokens d_1..d_n and the bonus), padded to K + 1 (padding rows write head cache columns
    that the chain's own steps overwrite before reading them, or that the next round does)."""

    @staticmethod
    def _target_states(draft: torch.nn.Module) -> tuple[int, ...]:
        return tuple(draft.target_layer_ids)

    @staticmethod
    def _drafter(draft: torch.nn.Module, draft_kv: KVCache, k: int, sampled: bool) -> CompiledChain:
        width = draft.cfg.target_hidden_size if draft.kind == "eagle" else draft.cfg.feature_size
        # (picks over the head's own vocabulary; sampled: as the head's eager sampled drafts,
        # q = softmax(logits / greedy_logit_scale / T))
        if sampled:
            return RaceChain(draft, draft_kv, [], k, width, draft.args.hidden_size, draft.cfg.greedy_logit_scale,
                             draft.own_vocab)
        return CompiledChain(draft, draft_kv, [], k, width, draft.args.hidden_size, draft.own_vocab)

    def _round(self, tokens: Tensor, features: Tensor, last: Tensor, start: Tensor,  # type: ignore[override]
               rows: Tensor, *race: Tensor) -> EagleRoundOutput:
        """tokens [B, K + 1], features [B, K + 1, F], last, start, rows [B]; race: as CompiledSpecRound."""
        S, dev = tokens.shape[1], tokens.device
        hq = start[:, None] + torch.arange(S, device=dev)                          # [B, K + 1] head columns
        col = start + last + 1                                                     # [B] the newest token's column
        pick = self._noise(col, race)
        d, q = self.draft._steps(tokens, hq, causal_mask(self._draft_cols(dev), hq, self.draft.window), rows,
                                 rows.repeat_interleave(S), hq.flatten(), hq.max() + 1, features, last, col, *pick)
        tok = tokens.gather(1, last[:, None])[:, 0]                                # [B]
        g, ids, top, n = self._verify(tok, d, col, rows, pick, q)
        feats = g.hidden if not self.aux_layers else torch.cat(g.aux, -1)          # [B, K + 1, F]
        bonus = ids.gather(1, n)                                                   # [B, 1]
        nxt = torch.cat([d, bonus], 1).scatter(1, n, bonus)                        # [B, K + 1] d_1..d_n, bonus
        return EagleRoundOutput(d, ids, top, nxt, feats.to(features.dtype), n[:, 0], col)

    def pad(self, state: tuple[Tensor, ...], n: int) -> tuple[Tensor, ...]:
        tokens, features, last, start = state   # padding: one position at column 1
        return (torch.cat([tokens, tokens.new_zeros(n, tokens.shape[1])]),
                torch.cat([features, features.new_zeros(n, *features.shape[1:])]),
                torch.cat([last, last.new_zeros(n)]), torch.cat([start, start.new_ones(n)]))

    carried = (3, 4, 5, 6)   # tokens, features, last, start

    def _flatten(self, out: EagleRoundOutput) -> list[Tensor]:  # type: ignore[override]
        return [out.drafts, out.target, out.top, out.tokens, out.features, out.last, out.start]

    def _unflatten(self, flat: list[Tensor]) -> EagleRoundOutput:  # type: ignore[override]
        return EagleRoundOutput(*flat)

    def _warm_args(self, b: Bucket, kv_len: int, dev: torch.device, scratch: int) -> tuple:
        S = self.k + 1
        F = self.draft.feature_width
        start = torch.full((b.batch,), kv_len - b.tokens, dtype=torch.long, device=dev)   # 1, then 3
        return (torch.zeros(b.batch, S, dtype=torch.long, device=dev),
                torch.zeros(b.batch, S, F, dtype=self.draft.model.dtype, device=dev),
                torch.full((b.batch,), S - 1, dtype=torch.long, device=dev), start,
                torch.full((b.batch,), scratch, dtype=torch.long, device=dev), *self._warm_race(b, start + S))
