"""ModelRunner: one forward over a ragged batch of sequence chunks, for targets and drafts.

Each chunk is a sequence's new tokens written to cache columns ``start, start + 1, ...``.
Chunks are padded to ``[B, S]``; padding writes to the cache's scratch row, so no sequence's
cache is realigned or copied.

Trees (``SeqChunk.parents``): token i's parent is token ``parents[i]`` of the same chunk (-1 =
the sequence's last cached token). Token i sits at position ``start + depth(i)`` (a chain's
positions are its columns) and attends to the cached prefix (columns < start) and to its
ancestors and itself only. Example: tokens [r, a, b, c] with parents [-1, 0, 0, 1] (r the
root, a and b its children, c a child of a) at start 10: columns 10..13, positions
[10, 11, 11, 12]; c sees columns 0..9, 10, 11, 13. After verification the accepted path's
columns are made contiguous with ``KVCache.move_cols`` (kv/cache.py).

``batch_invariant=True`` puts the model in batch-invariant mode (model/llama.py) and builds
per-token attention metadata: a token's logits are then bitwise the same whatever chunks run
with it, so greedy output with speculation equals output without, and any batch equals alone.

The fast path (``compile``, model/compiled.py): forwards that fit a warmed ``[batch, tokens]``
bucket run as a compiled graph, padded up to the bucket with scratch-row sequences and tokens;
the rest (prompt chunks, larger trees) run eagerly. Drafters also get ``draft_chain``: a greedy
chain of K tokens in one compiled graph (CompiledChain), and EAGLE heads ``draft_tree``: a greedy
dynamic tree in one graph (CompiledTree).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from leapfrog.attention.metadata import AttnMeta, build_attn_meta
from leapfrog.attention.native import load_native_attention
from leapfrog.kv.cache import KVCache
from leapfrog.model.compiled import (Bucket, ChainOutput, CompiledChain, CompiledDecodeSteps, CompiledForward,
                                     CompiledEagleRound, CompiledSampledChain, CompiledSpecRound, CompiledTree,
                                     DecodeStepsOutput, EAGER_MASK_BYTES, RoundRace, SampledChainOutput, TreeOutput)
from leapfrog.model.graph_inputs import GraphInputs
from leapfrog.model.native_draft import NativeLlamaForward
from leapfrog.utils import env_off

#: the largest batch whose speculation rounds run with sampled requests (compile_spec_round), and
#: the most bytes of race noise (float64, steps x (K + 1) x V per sequence) such a batch may take
SAMPLED_ROUNDS_MAX_BATCH = 8
SAMPLED_ROUNDS_MAX_NOISE_BYTES = 256 << 20
#: eager chunks of at most this many tokens per sequence call the C++ attention op (longer prefill:
#: SDPA). The op measured faster up to 512-token prefill chunks too (bf16, 8 heads x 64: 256 tokens
#: 1.2 ms against 1.5, 512 tokens 4.0 against 5.0), but its mask is chunk x max_model_len wide.
NATIVE_EAGER_TOKENS = 256
#: per device type, what one more eager forward costs in token rows of a prefill (split_by_length):
#: mostly reading every weight once more. CPU: a one-token eager step of the built-in target costs
#: about 19 prefill rows (7 ms against 0.37 ms a row, float32, Zen 3), of a 110M Llama about 6 (estimated);
#: CUDA: an 8B or 1B model's weights take about as long to read as 180-200 rows take to compute.
SPLIT_FORWARD_TOKENS = {"cpu": 32, "cuda": 256}


_EAGER_ARENAS = 16   # eager drafting loops' input buffers kept (ModelRunner._fill)


def _first(out: Any, n: int) -> Any:
    """A fused graph's output dataclass (ChainOutput, SampledChainOutput, TreeOutput,
    DecodeStepsOutput) cut to its first ``n`` sequences (the rest padded the bucket); None stays None."""
    return None if out is None else type(out)(*(None if (x := getattr(out, f.name)) is None else x[:n]
                                                for f in fields(out)))


@dataclass
class SpecRoundsOutput:
    drafts: Tensor     # [batch, rounds, K] long: each round's draft chain
    target: Tensor     # [batch, rounds, K + 1] long: the target's token at each verified row
    top: Tensor        # [batch, rounds, K + 1] float32: its logit (the host checks that it is finite)
    state: tuple[Tensor, ...]   # the next round's input per sequence (the drafter's to keep)


@dataclass
class SeqChunk:
    row: int               # KV cache row
    start: int             # cache column of token_ids[0]
    token_ids: list[int]
    num_logits: int        # logits wanted for the last num_logits tokens (0 = none)
    parents: list[int] | None = None     # tree: parent index per token (-1 = the cached prefix); None = chain
    features: Tensor | None = None       # [len(token_ids), F] extra per-token input (EAGLE heads)
    # A tree grown over several forwards (an EAGLE head expanding level by level): the prefix
    # every token sees is columns [0, context) (default: start), each token also sees the
    # columns ``extra_cols[i]`` (its ancestors written by earlier forwards), and its position is
    # ``first_pos[i]`` plus its depth inside this chunk (default: start).
    context: int | None = None
    extra_cols: list[list[int]] | None = None
    first_pos: list[int] | None = None

    @property
    def is_tree(self) -> bool:
        return self.parents is not None or self.extra_cols is not None or self.context is not None

    def positions(self) -> list[int]:
        if not self.is_tree:
            return list(range(self.start, self.start + len(self.token_ids)))
        parents = self.parents if self.parents is not None else [-1] * len(self.token_ids)
        pos: list[int] = []
        for i, p in enumerate(parents):
            base = self.start if self.first_pos is None else self.first_pos[i]
            pos.append(base if p < 0 else pos[p] + 1)
        return pos


@dataclass
class StepOutput:
    logits: Tensor         # [sum(num_logits), V] float32
    hidden: Tensor | None  # [sum(len(token_ids)), F] per real token, chunk by chunk (when asked; "logits_rows": [sum(num_logits), F])
    # compiled graphs: each logits row's largest logit and its token ([sum(num_logits)] each,
    # as logits.max(-1)), for greedy verification; None from eager forwards
    top: tuple[Tensor, Tensor] | None = None


class ModelRunner:
    def __init__(self, model: Any, num_rows: int, max_model_len: int, batch_invariant: bool = False,
                 kv: KVCache | None = None) -> None:
        """``kv``: another runner's cache of the same model, rows and length to run on (engines
        sharing it run one at a time: LLMEngine ``share_kv_cache``), else a cache of its own."""
        a = getattr(model, "shard_args", model.args)   # a tensor-parallel rank caches its KV heads only
        self.model = model
        self.batch_invariant = batch_invariant
        if batch_invariant:
            model.make_batch_invariant()
        self.device = model.device
        self.kv = kv if kv is not None else KVCache(a.num_hidden_layers, num_rows, max_model_len,
                                                     a.num_key_value_heads, a.head_dim, model.dtype, self.device)
        self.graphs: list[CompiledForward] = []   # compiled forwards (per feature width)
        self.chain: CompiledChain | None = None    # fused greedy chain drafting (drafters)
        self.tree: CompiledTree | None = None      # fused greedy tree drafting (EAGLE heads)
        self.sampled_chain: CompiledSampledChain | None = None   # fused sampled chain drafting (EAGLE heads)
        self.multi_step: CompiledDecodeSteps | None = None        # multi-step decode (targets)
        self.round: CompiledSpecRound | None = None               # multi-step speculation's round (targets)
        self.sampled_round: CompiledSpecRound | None = None       # its twin for batches with sampled requests
        # eager forwards call the C++ attention op (_native_attention; None: not built yet)
        plain = self.device.type == "cpu" and model.dtype in (torch.float32, torch.bfloat16, torch.float16)
        wanted = plain and not batch_invariant and not env_off("LEAPFROG_NATIVE_ATTENTION")
        self._native: bool | None = None if wanted else False
        # eager decode/verify forwards of a Llama model as one C++ call (_native_forward): False until
        # looked up, then the op's arguments or None (also None at once under LEAPFROG_NATIVE_FORWARD=0)
        self._native_fwd: NativeLlamaForward | None | bool = None if env_off("LEAPFROG_NATIVE_FORWARD") else False
        # a compiled graph's logits are checked for float16 overflow (check_logits), only in fp16
        # models (the check's dtype lookup alone cost 10 us per step, once the graph had run)
        self._fp16 = model.dtype == torch.float16
        self._cols: Tensor | None = None   # (_columns)
        # compiled calls' inputs written into persistent tensors per bucket (model/graph_inputs.py):
        # CPU chains without a sliding window; LEAPFROG_GRAPH_INPUTS=0 makes them fresh every call
        self._arena_ok = (self.device.type == "cpu" and model.args.sliding_window is None
                          and not env_off("LEAPFROG_GRAPH_INPUTS"))
        self._arenas: dict[tuple[int, int], GraphInputs] = {}
        #: the eager drafting loops' (every shape its own: the latest _EAGER_ARENAS, least recent out)
        self._eager_arenas: OrderedDict[tuple[int, int], GraphInputs] = OrderedDict()
        #: what one more eager forward costs, in token rows (step: chunks of very different lengths
        #: run in several forwards where padding them to the longest costs more; 0: never split)
        self.split_tokens = SPLIT_FORWARD_TOKENS.get(self.device.type, 0)

    @property
    def compiled(self) -> CompiledForward | None:
        """The compiled forward without features (a target's, a draft model's), if any."""
        return next((g for g in self.graphs if g.feature_width is None), None)

    def compile(self, buckets: list[Bucket], aux_layers: tuple[int, ...] = (), progress: bool = True,
                feature_width: int | None = None) -> float:
        """Compile the decode/verify forward for these buckets (model/compiled.py); the model's
        linear layers must be plain ``nn.Linear`` (not oneDNN-packed). ``feature_width``: for
        chunks with features of that width (EAGLE heads; call once per width). -> seconds taken."""
        self._check_compilable()
        g = CompiledForward(self.model, self.kv, buckets, aux_layers, feature_width)
        self.graphs.append(g)
        return g.warm_up(progress)

    def compile_chain(self, buckets: list[Bucket], steps: int, feature_width: int | None = None,
                      next_width: int | None = None, vocab: Tensor | None = None, progress: bool = True,
                      compile: bool = True) -> float:
        """Compile greedy chain drafting of ``steps`` tokens as one graph per bucket
        (model/compiled.py CompiledChain; ``draft_chain`` runs it; ``vocab``: its picks over an
        EAGLE-3 head's own vocabulary, CompiledChain.vocab; ``compile=False``: the same loop run
        eagerly). -> seconds taken."""
        if compile:
            self._check_compilable()
        self.chain = CompiledChain(self.model, self.kv, buckets, steps, feature_width, next_width, vocab, compile)
        return self.chain.warm_up(progress)

    def compile_sampled_chain(self, buckets: list[Bucket], steps: int, want: int, logit_scale: float = 1.0,
                              feature_width: int | None = None, next_width: int | None = None,
                              vocab: Tensor | None = None, progress: bool = True, compile: bool = True) -> float:
        """Compile sampled chain drafting (model/compiled.py CompiledSampledChain; ``draft_sampled_chain``
        runs it; ``vocab``: its steps over an EAGLE-3 head's own vocabulary, ascending;
        ``compile=False``: eagerly). -> seconds taken."""
        if compile:
            self._check_compilable()
        self.sampled_chain = CompiledSampledChain(self.model, self.kv, buckets, steps, want, logit_scale,
                                                  feature_width, next_width, vocab, compile)
        return self.sampled_chain.warm_up(progress)

    def compile_tree(self, buckets: list[Bucket], steps: int, topk: int, nodes: int, feature_width: int | None = None,
                     next_width: int | None = None, progress: bool = True, compile: bool = True) -> float:
        """Compile greedy dynamic tree drafting (``steps`` levels, ``topk`` children per frontier
        node, the best ``nodes`` kept) as one graph per bucket (model/compiled.py CompiledTree;
        ``draft_tree`` runs it; ``compile=False``: eagerly). -> seconds taken."""
        if compile:
            self._check_compilable()
        self.tree = CompiledTree(self.model, self.kv, buckets, steps, topk, nodes, feature_width, next_width, compile)
        return self.tree.warm_up(progress)

    def compile_multi_step(self, buckets: list[Bucket], steps: int, states: str | tuple[int, ...] | None = None,
                           progress: bool = True) -> float:
        """Compile multi-step decode of ``steps`` tokens as one graph per bucket (model/compiled.py
        CompiledDecodeSteps; ``decode_steps`` runs it; ``states``: also every step's state, as
        ``step``'s ``hidden``). -> seconds taken."""
        self._check_compilable()
        self.multi_step = CompiledDecodeSteps(self.model, self.kv, buckets, steps, states)
        return self.multi_step.warm_up(progress)

    def compile_spec_round(self, draft: "ModelRunner", buckets: list[Bucket], k: int, steps: int,
                           progress: bool = True) -> float:
        """Compile a speculation round of ``k`` drafts by ``draft``'s model as one graph per bucket
        (model/compiled.py CompiledSpecRound; ``spec_rounds`` runs up to ``steps`` rounds of it):
        greedy rounds, and sampled rounds for the buckets of at most SAMPLED_ROUNDS_MAX_BATCH
        sequences whose race noise (steps x (k + 1) x V float64 per sequence, drawn on the host
        each engine step) fits SAMPLED_ROUNDS_MAX_NOISE_BYTES; none fits: no sampled rounds
        (sampled steps run one round). -> seconds."""
        self._check_compilable()
        draft._check_compilable()
        eagle = getattr(draft.model, "kind", None) in ("eagle", "eagle3")
        kind = CompiledEagleRound if eagle else CompiledSpecRound
        self.round = kind(self.model, self.kv, draft.model, draft.kv, buckets, k)
        took = self.round.warm_up(progress)
        positions = steps * (k + 1)
        per_seq = positions * self.model.args.vocab_size * 8
        small = [b for b in buckets if b.batch <= SAMPLED_ROUNDS_MAX_BATCH
                 and b.batch * per_seq <= SAMPLED_ROUNDS_MAX_NOISE_BYTES]
        if small:
            self.sampled_round = kind(self.model, self.kv, draft.model, draft.kv, small, k, positions)
            took += self.sampled_round.warm_up(progress)
        return took

    def fits_spec_rounds(self, cols: list[int], sampled: bool = False) -> int:
        """How many rounds ``spec_rounds`` can run for sequences whose newest tokens are at ``cols``
        (``sampled``: in the sampled rounds' graph): 0 when no warmed graph fits the batch, else as
        many as keep every round's columns inside the cache (each advances at most K + 1)."""
        g = self.sampled_round if sampled else self.round
        if g is None or g.bucket_for(len(cols), g.k + 1, 1) is None:
            return 0
        fit = (self.kv.max_model_len - max(*cols, 2)) // (g.k + 1)   # (padding starts at column <= 2)
        return max(0, fit if g.positions is None else min(fit, g.positions // (g.k + 1)))

    @torch.inference_mode()
    def spec_rounds(self, rows: list[int], state: tuple[Tensor, ...], cols: list[int], rounds: int,
                    race: RoundRace | None = None) -> SpecRoundsOutput:
        """``rounds`` rounds of multi-step speculation (``rounds`` <= fits_spec_rounds(cols)) for
        sequences in cache ``rows`` whose newest tokens (not yet in the target's cache) are at
        ``cols``; ``state``: the first round's input per sequence, as the drafter gives it
        (CompiledSpecRound: the tokens at col - 1 and col; CompiledEagleRound: the head's pending
        positions), each round's graph fed the last one's outputs; ``race``: for batches with
        sampled requests, the randomness of the tokens after ``cols`` (model/compiled.py
        RoundRace, on the runner's device). -> every round's drafts and the target's token
        (argmax, the race's winner, or rejection sampling's), and the state after the last round."""
        g = self.round if race is None else self.sampled_round
        assert g is not None and 0 < rounds <= self.fits_spec_rounds(cols, race is not None)
        bucket = g.bucket_for(len(rows), g.k + 1, 1)
        assert bucket is not None
        pad = bucket.batch - len(rows)
        # (the host work here is paid once per ``rounds`` rounds, but on caches the graphs flush:
        # each op costs 5-20 us, so no op is made for nothing)
        state = tuple(x.to(self.device) for x in state) if self.device.type != "cpu" else state
        state = g.pad(state, pad) if pad else state
        rows_t = torch.tensor(rows + [self.kv.scratch_row] * pad, device=self.device)
        extra = () if race is None else g.race_args(race, torch.tensor(cols, device=self.device), pad)
        flats = g.rounds((*state, rows_t, *extra), rounds)
        n = len(rows)
        drafts, target, top = (torch.stack([f[i] for f in flats], 1) for i in range(3))
        state = tuple(flats[-1][i] for i in g.carried)
        if pad:
            drafts, target, top, state = drafts[:n], target[:n], top[:n], tuple(x[:n] for x in state)
        return SpecRoundsOutput(drafts, target, top, state)

    def graph_seconds(self) -> float:
        """Seconds spent inside compiled graphs so far (their direct calls: model/compiled.py)."""
        fused = (self.chain, self.sampled_chain, self.tree, self.multi_step, self.round, self.sampled_round)
        fwds = [*self.graphs, *(g for g in fused if g is not None)]
        return sum(d.seconds for g in fwds for d in g.direct.values())

    def _check_compilable(self) -> None:
        if self.batch_invariant:
            raise ValueError("batch-invariant mode runs eagerly (its kernels are chosen per row tile)")

    @torch.inference_mode()
    def draft_chain(self, chunks: list[SeqChunk], steps: int, min_confidence: float | None = None
                    ) -> ChainOutput | None:
        """Greedy chains of ``steps`` tokens after each chunk, fused in one compiled graph: each
        chunk's pending tokens (chains, ``num_logits`` 1), then ``steps - 1`` tokens each fed
        the previous argmax (and an EAGLE head's own previous state). -> tokens and log q
        [len(chunks), steps or more (a compiled graph runs all its own)] in chunk order, or None
        when no warmed chain graph fits (the caller drafts step by step). ``min_confidence``
        (eagerly): no step runs after every chain's path confidence (the product of its q) is
        below it, so fewer than ``steps`` columns may come back."""
        c = self.chain
        if c is None or steps > c.steps:
            return None
        return _first(self._fused_chain(c, chunks, steps, min_confidence=min_confidence), len(chunks))

    def fits_decode_steps(self, chunks: list[SeqChunk]) -> bool:
        """Whether ``decode_steps`` has a warmed graph for these chunks (the batch, and the last
        step's column inside the cache): callers check before drawing the steps' randomness."""
        g = self.multi_step
        return g is not None and self._fused_bucket(g, chunks, g.steps - 1) is not None

    @torch.inference_mode()
    def decode_steps(self, chunks: list[SeqChunk], temperature: Tensor, sampled: Tensor,
                     e: Tensor, stream: Tensor, w: Tensor) -> DecodeStepsOutput | None:
        """The multi-step graph's ``steps`` tokens after each one-token chunk, each fed to the next
        (model/compiled.py CompiledDecodeSteps): temperature [n], sampled [n] bool (False: the argmax
        of the raw logits), e [n, steps, V] float64 the race's exponentials (-log U) of seeded
        sampled rows, stream [n] bool the unseeded sampled rows, which draw by inverse CDF with
        w [n, steps] float64, all on the runner's device. -> None when no warmed graph fits
        (``fits_decode_steps``)."""
        g = self.multi_step
        if g is None:
            return None
        return _first(self._fused(g, chunks, g.steps - 1, (temperature, sampled, e, stream, w)), len(chunks))

    def fits_sampled_chain(self, chunks: list[SeqChunk]) -> bool:
        """Whether ``draft_sampled_chain`` has a warmed graph for these chunks: callers check
        before drawing the chains' randomness."""
        c = self.sampled_chain
        return c is not None and self._fused_bucket(c, chunks, c.steps - 1) is not None

    @torch.inference_mode()
    def draft_sampled_chain(self, chunks: list[SeqChunk], temperature: Tensor, sampled: Tensor,
                            e: Tensor, stream: Tensor, w: Tensor,
                            steps: int | None = None) -> SampledChainOutput | None:
        """Chains of the sampled graph's ``steps`` tokens after each chunk (as ``draft_chain``):
        temperature [n], sampled [n] bool (False: the argmax), e [n, steps, V] float64 the race's
        exponentials of seeded rows (sampler.exponentials; where the chain runs in C++, their
        noise keys [n, steps, 2] int64, sampler.noise_keys), stream [n] bool the unseeded rows,
        which draw by inverse CDF with w [n, steps] float64, all on the runner's device; ``steps``:
        the tokens wanted (default the graph's; an eager chain runs just those). -> per chunk, or
        None when no graph fits."""
        c = self.sampled_chain
        if c is None or (steps or 0) > c.steps:
            return None
        return _first(self._fused_chain(c, chunks, steps or c.steps, (temperature, sampled, e, stream, w)),
                      len(chunks))

    @torch.inference_mode()
    def draft_tree(self, chunks: list[SeqChunk]) -> TreeOutput | None:
        """Greedy dynamic draft trees after each chunk (its pending tokens, as ``draft_chain``),
        grown and reranked in one compiled graph (model/compiled.py CompiledTree). -> the best
        nodes per chunk, or None when no warmed tree graph fits."""
        t = self.tree
        if t is None:
            return None
        out = self._fused(t, chunks, t.tree_cols)
        return _first(out, len(chunks))

    def _fused_bucket(self, g: CompiledChain, chunks: list[SeqChunk], after: int) -> Bucket | None:
        """The bucket of fused graph ``g`` that chunks' pending tokens run in (``after``: cache
        columns it writes past the chunks), or None when nothing fits."""
        if any(ch.is_tree for ch in chunks):
            return None
        width = {None if ch.features is None else ch.features.shape[-1] for ch in chunks}
        if width != {g.feature_width}:
            return None
        kv_len = max(ch.start + len(ch.token_ids) for ch in chunks)
        if kv_len + after > self.kv.max_model_len:
            return None
        return g.bucket_for(len(chunks), max(len(ch.token_ids) for ch in chunks), kv_len)

    def _fused_chain(self, c: CompiledChain, chunks: list[SeqChunk], steps: int,
                     extra: tuple[Tensor, ...] = (), min_confidence: float | None = None) -> Any:
        """A fused chain for drafts of ``steps`` tokens (``_fused``): a compiled graph runs all of
        its own steps, an eager loop just those (a chain of 2 from a depth-5 head: 2 head forwards,
        not 5, and with ``min_confidence`` none after every chain's confidence fell below it); the
        last one's cache column must fit."""
        run = c.steps if c.compiled else steps
        return self._fused(c, chunks, run - 1, extra, None if run == c.steps else run,
                           None if c.compiled else min_confidence)

    def _fused(self, g: CompiledChain, chunks: list[SeqChunk], after: int, extra: tuple[Tensor, ...] = (),
               steps: int | None = None, min_confidence: float | None = None) -> Any:
        """Run a fused drafting graph over chunks' pending tokens, padded to its bucket; ``after``:
        cache columns it writes past the chunks; ``extra``: per-chunk inputs [n, ...] after the
        graph's own (padding rows repeat the first); ``steps``, ``min_confidence``: an eager
        chain's steps this call and stopping confidence (``_fused_chain``; padding rows stop at
        once). -> its output, or None when nothing fits."""
        bucket = self._fused_bucket(g, chunks, after)
        if bucket is None:
            return None
        full = chunks + [SeqChunk(self.kv.scratch_row, 0, [0], 1)] * (bucket.batch - len(chunks))
        if self._arena_ok:   # (_fused_bucket took chains only)
            tok, posn, meta, last, col = self._fill(full, bucket.tokens, eager=not g.compiled)
        else:
            kv_len = max(ch.start + len(ch.token_ids) for ch in chunks)
            tok, posn, meta = self._inputs(full, bucket.tokens, kv_len, graph=True)
            last = torch.tensor([len(ch.token_ids) - 1 for ch in full], device=self.device)
            col = torch.tensor([ch.start + len(ch.token_ids) for ch in full], device=self.device)
        feats = self._pad_features(full, bucket.tokens) if g.feature_width is not None else None
        pad = bucket.batch - len(chunks)
        extra = tuple(torch.cat([x, x[:1].expand(pad, *x.shape[1:])]) if pad else x for x in extra)
        kw: dict[str, Any] = {} if steps is None else {"steps": steps}
        if min_confidence is not None:
            kw["stop"] = torch.full((bucket.batch,), math.inf, dtype=torch.float64, device=self.device)   # [bucket]
            kw["stop"][:len(chunks)] = math.log(min_confidence)
        return g(tok, posn, meta, feats, last, col, *extra, **kw)

    def move_cols(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy a row's KV columns ``src`` to ``dst`` (an accepted tree path made contiguous)."""
        self.kv.move_cols(row, src, dst)

    def run(self, chunks: list[SeqChunk]) -> Tensor:
        """-> logits [sum(num_logits), V] float32, chunk by chunk in order."""
        return self.step(chunks).logits

    @torch.inference_mode()
    def step(self, chunks: list[SeqChunk], hidden: str | tuple[int, ...] | None = None) -> StepOutput:
        """One forward. ``hidden`` asks for a state of every real token as well: "hidden" (the
        forward contract's ``hidden``: a target's final-norm state, what EAGLE-1 reads; an EAGLE
        head's output state, fed back at its next draft step), or a tuple of layer indices
        (their residual-stream outputs concatenated: EAGLE-3's low/middle/high features);
        "logits_rows": the "hidden" state of the logits rows only (an EAGLE head catching up on
        a prompt). Eager forwards that read no other token's state run the model's last layer
        past attention for those rows alone (``keep_rows``: LlamaModel, EagleHead).

        Chunks of very different lengths (prompts prefilled together) are padded to the longest;
        where that padding costs more than further forwards would (``split_by_length``), the
        chunks run in several eager forwards of similar lengths, and their outputs come back in
        the chunks' order as from one."""
        groups = None if len(chunks) < 2 or self.split_tokens <= 0 else split_by_length(
            [len(c.token_ids) for c in chunks], self.split_tokens)
        if (groups is None or len(groups) < 2
                or self._bucket(chunks, hidden, max(c.start + len(c.token_ids) for c in chunks)) is not None):
            return self._forward(chunks, hidden)
        outs = [self._forward([chunks[i] for i in g], hidden) for g in groups]
        return _merge(chunks, groups, outs, hidden)

    def _forward(self, chunks: list[SeqChunk], hidden: str | tuple[int, ...] | None) -> StepOutput:
        kv_len = max(c.start + len(c.token_ids) for c in chunks)
        bucket = self._bucket(chunks, hidden, kv_len)
        if bucket is not None:  # padding sequences: one token on the scratch row, never read
            chunks = chunks + [SeqChunk(self.kv.scratch_row, 0, [0], 0)] * (bucket[1].batch - len(chunks))
        B = len(chunks)
        S = max(max(len(c.token_ids) for c in chunks), bucket[1].tokens if bucket is not None else 0)
        tok, posn, meta = self._inputs(chunks, S, kv_len, graph=bucket is not None)
        has_features = any(c.features is not None for c in chunks)
        rows = [b * S + i for b, c in enumerate(chunks)
                for i in range(len(c.token_ids) - c.num_logits, len(c.token_ids))]
        g = None
        kept = False
        if bucket is not None:
            g = bucket[0](tok, posn, meta, self._pad_features(chunks, S) if has_features else None)
            out_hidden, out_aux = g.hidden, g.aux
        else:
            # only the logits rows' hidden states are read (prefill): the last layer's MLP runs for them alone
            kept = hidden in (None, "logits_rows") and len(rows) < B * S and getattr(self.model, "keeps_rows", False)
            native = None if kept or has_features or not meta.native else self._native_forward()
            if native is not None:   # (decode and verify chunks: every row read)
                out_hidden, out_aux = native.hidden(tok, posn, meta, self.kv, hidden if isinstance(hidden, tuple) else ())
            else:
                kwargs = {}
                if has_features:
                    kwargs["features"] = self._pad_features(chunks, S)
                if isinstance(hidden, tuple):
                    kwargs["aux_layers"] = hidden
                if kept:
                    kwargs["keep_rows"] = torch.tensor(rows, dtype=torch.long, device=self.device)
                out = self.model(token_ids=tok, positions=posn, kv=self.kv, attn=meta, **kwargs)
                out_hidden, out_aux = out.hidden, out.aux
        read = None   # the logits rows' states [len(rows), D] (kept: all the last layer computed)
        if g is None or hidden == "logits_rows":   # (a graph's logits come with it)
            D = out_hidden.shape[-1]
            read = out_hidden.reshape(len(rows), D) if kept else (
                _take(out_hidden.reshape(B * S, D), rows) if rows else out_hidden.new_empty(0, D))
        feats = None
        if hidden == "logits_rows":
            feats = read
        elif hidden is not None:
            src = out_hidden if hidden == "hidden" else torch.cat(out_aux, dim=-1)
            if len(rows) == B * S:   # every row real (decode, unpadded verify): all of them, a view
                feats = src.reshape(B * S, -1)
            else:
                feats = _take(src.reshape(B * S, -1),
                              [b * S + i for b, c in enumerate(chunks) for i in range(len(c.token_ids))])
        if not rows:
            return StepOutput(torch.empty(0, self.model.args.vocab_size), feats)
        if g is not None:
            logits = _take(g.logits, rows)
            if self._fp16:
                self.model.check_logits(logits)
            return StepOutput(logits.cpu(), feats, (_take(g.top, rows).cpu(), _take(g.top_ids, rows).cpu()))
        return StepOutput(self.model.compute_logits(read).cpu(), feats)

    def _inputs(self, chunks: list[SeqChunk], S: int, kv_len: int, graph: bool) -> tuple[Tensor, Tensor, AttnMeta]:
        """Padded token ids and positions [B, S] and the attention metadata (``graph``: for a
        compiled graph, as wide as the cache)."""
        native = not graph and S <= NATIVE_EAGER_TOKENS and self._native_attention()
        if (self._arena_ok and (graph or (native and len(chunks) * S * self.kv.max_model_len <= EAGER_MASK_BYTES))
                and not any(c.is_tree for c in chunks)):
            # (an eager forward through the C++ attention op takes a graph's inputs, as wide as the
            # cache: written into an eager arena, plain decode's step at batch 1 spent 62 us here
            # making them fresh, against 37 in a compiled graph's)
            tok, posn, meta = self._fill(chunks, S, eager=not graph)[:3]
            meta.native = native
            return tok, posn, meta
        cols = [list(range(c.start, c.start + len(c.token_ids))) for c in chunks]
        pos = [c.positions() for c in chunks]
        tokens = [c.token_ids + [0] * (S - len(c.token_ids)) for c in chunks]
        positions = [p + [0] * (S - len(p)) for p in pos]
        tree = None
        if any(c.is_tree for c in chunks):
            tree = self._tree_mask(chunks, pos, kv_len, S)
        meta = build_attn_meta([c.row for c in chunks], cols, self.kv.scratch_row, self.device,
                               self.model.args.sliding_window, tree_mask=tree, per_token=self.batch_invariant,
                               pad_to=S, graph_width=self.kv.max_model_len if graph or native else None,
                               columns=self._columns())
        meta.native = native
        tok = torch.tensor(tokens, dtype=torch.long, device=self.device)
        posn = torch.tensor(positions, dtype=torch.long, device=self.device)
        return tok, posn, meta

    def _fill(self, chunks: list[SeqChunk], S: int,
              eager: bool = False) -> tuple[Tensor, Tensor, AttnMeta, Tensor, Tensor]:
        """Chains padded to a [len(chunks), S] graph bucket, written into that bucket's persistent
        inputs (model/graph_inputs.py) -> token ids, positions, metadata, last index, next column.
        ``eager``: an eager call (a drafting loop's, or an eager forward through the C++ attention
        op: ``_inputs``), whose every (batch, tokens) shape is its own bucket: only the latest
        _EAGER_ARENAS shapes keep theirs (each holds a batch x tokens x
        max_model_len mask: all of them, 80 MB at 4k context, 0.6 GB at 32k; each at most
        model/compiled.py EAGER_MASK_BYTES or 256 tokens' worth)."""
        key = (len(chunks), S)
        arenas = self._eager_arenas if eager else self._arenas
        a = arenas.get(key)
        if a is None:
            a = arenas[key] = GraphInputs(len(chunks), S, self.kv.max_model_len, self.kv.scratch_row)
            if eager and len(arenas) > _EAGER_ARENAS:
                self._eager_arenas.popitem(last=False)
        elif eager:
            self._eager_arenas.move_to_end(key)
        return a.fill([c.row for c in chunks], [c.start for c in chunks], [c.token_ids for c in chunks])

    def _columns(self) -> Tensor:
        """arange(max_model_len) on the device: the cache's columns, for graph masks (made once)."""
        if self._cols is None:
            self._cols = torch.arange(self.kv.max_model_len, device=self.device)
        return self._cols

    def _native_attention(self) -> bool:
        """Whether eager forwards call the compiled graphs' C++ attention op (attention/native.py)
        for decode, verify and tree chunks: on CPU in float32, bf16 or fp16, not in batch-invariant
        mode (its per-token path), unless ``LEAPFROG_NATIVE_ATTENTION=0``; built on first use. Against ATen's SDPA
        it takes a third of the time for a few tokens and is row-invariant (a token verified among
        drafts gets bitwise its one-token attention); long prefill chunks keep SDPA. (The
        environment is read when the runner is made.)"""
        if self._native is None:
            self._native = load_native_attention()
        return self._native

    def _native_forward(self) -> NativeLlamaForward | None:
        """The model's eager forward as one C++ call (model/native_draft.py ``llama_hidden``: the
        same ops in the same order as LlamaModel.forward, without its hundred-odd Python calls a
        step), for chunks whose attention runs through the C++ op and whose every row is read
        (decode, verification, a drafter's catch-up): a Llama model packed on the bf16 few-row
        kernel with the native norm/RoPE ops, on CPU, no tensor parallelism, not batch-invariant
        (NativeLlamaForward.for_model); ``LEAPFROG_NATIVE_FORWARD=0`` (read when the runner is
        made) keeps the Python forward. Looked up once."""
        if self._native_fwd is False:
            self._native_fwd = NativeLlamaForward.for_model(self.model, switch=None)   # (read in __init__)
        return self._native_fwd

    def _bucket(self, chunks: list[SeqChunk], hidden: str | tuple[int, ...] | None,
                kv_len: int) -> tuple[CompiledForward, Bucket] | None:
        """The compiled graph and bucket this forward runs in, or None (eager)."""
        width = {None if c.features is None else c.features.shape[-1] for c in chunks}
        if len(width) != 1:
            return None
        for g in self.graphs:
            if g.feature_width not in width:
                continue
            if isinstance(hidden, tuple) and hidden != g.aux_layers:
                return None
            b = g.bucket_for(len(chunks), max(len(c.token_ids) for c in chunks), kv_len)
            return None if b is None else (g, b)
        return None

    def _pad_features(self, chunks: list[SeqChunk], S: int) -> Tensor:
        if len(chunks) == 1 and (f := chunks[0].features) is not None and f.shape[0] == S \
                and f.dtype == self.model.dtype and f.device == self.device and f.is_contiguous():
            return f[None]   # [1, S, F]: nothing to pad (a batch-1 eager step: ~40 us of zeros and a copy)
        F = next(c.features for c in chunks if c.features is not None).shape[-1]
        out = torch.zeros(len(chunks), S, F, dtype=self.model.dtype, device=self.device)  # [B, S, F]
        for b, c in enumerate(chunks):
            if c.features is not None:
                out[b, :len(c.token_ids)] = c.features.to(out.dtype)
        return out

    def _tree_mask(self, chunks: list[SeqChunk], pos: list[list[int]], kv_len: int, S: int) -> Tensor:
        """[B, S, kv_len] bool: prefix columns (inside the sliding window, by position) plus the
        token's ancestors and itself; padding tokens see column 0 only."""
        mask = torch.zeros(len(chunks), S, kv_len, dtype=torch.bool)
        window = self.model.args.sliding_window
        for b, c in enumerate(chunks):
            n = len(c.token_ids)
            if c.parents is not None:
                parents = c.parents
            else:
                parents = [-1] * n if c.extra_cols is not None else list(range(-1, n - 1))
            anc = [[False] * n for _ in range(n)]  # anc[i][j]: j is i or an ancestor of i
            for i, p in enumerate(parents):
                if p >= 0:
                    anc[i][:] = anc[p]
                anc[i][i] = True
            mask[b, :n, c.start:c.start + n] = torch.tensor(anc)
            ctx = c.start if c.context is None else c.context
            mask[b, :n, :ctx] = True
            for i, extra in enumerate(c.extra_cols or ()):
                for j in extra:  # with a parent in this chunk, the parent's extra columns count too
                    mask[b, [k for k in range(n) if anc[k][i]], j] = True
            if window is not None:  # keys more than window - 1 positions back are out of sight
                if c.extra_cols is not None:
                    raise NotImplementedError("multi-forward trees with a sliding window")
                q = torch.tensor(pos[b])[:, None]
                kpos = torch.cat([torch.arange(c.start), torch.tensor(pos[b])])[None, :]
                mask[b, :n, :c.start + n] &= kpos > q - window
            mask[b, n:, 0] = True
        return mask.to(self.device)


def split_by_length(lengths: list[int], forward_tokens: int) -> list[list[int]]:
    """Chunks of these token counts, padded to the longest in one forward, grouped for the fewest
    padded rows plus ``forward_tokens`` rows' worth of cost per further forward (what one more
    forward costs on this device, mostly reading the weights once more, counted in token rows):
    the lengths sorted, then the cheapest split into runs of neighbours, cut only between
    different lengths (dynamic programming over the d distinct lengths, O(d^2)). -> each
    forward's chunk indices, longest first; one group where padding costs less than a further
    forward."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i])
    if n * max(lengths, default=0) - sum(lengths) <= forward_tokens:   # (decode and verify steps)
        return [order] if n else []   # a split saves at most the padding, and costs more
    starts = [j for j in range(n) if j == 0 or lengths[order[j]] != lengths[order[j - 1]]] + [n]
    d = len(starts) - 1
    best = [0.0] + [float("inf")] * d   # best[b]: cost of the chunks before distinct length b
    cut = [0] * (d + 1)
    for b in range(1, d + 1):
        for a in range(b):   # one forward of the chunks of distinct lengths a..b-1, padded to a's
            c = best[a] + forward_tokens * (a > 0) + (starts[b] - starts[a]) * lengths[order[starts[a]]]
            if c < best[b]:
                best[b], cut[b] = c, a
    groups, b = [], d
    while b > 0:
        groups.append(order[starts[cut[b]]:starts[b]])
        b = cut[b]
    return groups[::-1]


def _merge(chunks: list[SeqChunk], groups: list[list[int]], outs: list[StepOutput],
           hidden: str | tuple[int, ...] | None) -> StepOutput:
    """Eager forwards over groups of the chunks -> one StepOutput in the chunks' order (the
    logits rows and hidden states of chunk after chunk, as one forward gives them)."""
    logits: list[Tensor | None] = [None] * len(chunks)
    feats: list[Tensor | None] = [None] * len(chunks)
    for g, out in zip(groups, outs):
        li = fi = 0
        for i in g:
            n_log = chunks[i].num_logits
            logits[i] = out.logits[li:li + n_log]
            li += n_log
            if out.hidden is not None:
                n_f = n_log if hidden == "logits_rows" else len(chunks[i].token_ids)
                feats[i] = out.hidden[fi:fi + n_f]
                fi += n_f
    return StepOutput(torch.cat(logits), None if outs[0].hidden is None else torch.cat(feats))


def _take(flat: Tensor, rows: list[int]) -> Tensor:
    """flat[rows], a view when the rows are contiguous."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return flat[rows[0]:rows[0] + len(rows)]
    return flat[torch.tensor(rows, device=flat.device)]
