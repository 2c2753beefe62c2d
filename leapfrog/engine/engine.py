"""LLMEngine: requests in, one engine step at a time, RequestOutputs out.

One step (STYLE "one engine step"):
  1. schedule: admit waiting requests into KV rows, pick prompt chunks and decoders;
  2. prefill: compute prompt chunks; a finished prompt yields its first token (0 drafts);
  3. propose: drafts for decoding requests (0 drafts is legal and is plain decode);
  4. verify forward: target over [last token + drafts] for the whole ragged batch;
  5. accept: greedy match or lossless rejection sampling, final token from the one sampler;
  6. commit/rollback KV: a request's cache length becomes old + 1 + accepted;
  7. feedback to the proposer, then outputs: append tokens, stops, detokenize, free finished.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import threading
import time
from typing import Any, Callable

import torch

from leapfrog.attention.native import load_native_attention
from leapfrog.config import EngineConfig
from leapfrog.detokenizer import Detokenizer, StopStrings
from leapfrog.errors import CacheBusy, ConfigError, NotShareable, RequestError
from leapfrog.kv.manager import KVManager
from leapfrog.model.compiled import RoundRace, can_compile, make_buckets
from leapfrog.model.loader import check_tokenizer_vocab, load_model, load_tokenizer, read_checkpoint, resolve_dtype
from leapfrog.model.native_draft import load_native_draft
from leapfrog.model.native_linear import load_native_linear, set_streaming, would_stream
from leapfrog.model.native_ops import load_native_ops, row_max
from leapfrog.model.quant import check_batch_invariant_quantization, check_quantization
from leapfrog.model.runner import ModelRunner, SeqChunk
from leapfrog.outputs import IterationStats, Logprob, PositionLogprobs, RequestOutput, SpecMetrics
from leapfrog.request import Prepared, Request, stop_ids_of
from leapfrog.sampling import logprobs as lp, sampler
from leapfrog.sampling.grammar import GrammarCompiler, GrammarState
from leapfrog.sampling.sampler import BadWords
from leapfrog.sampling_params import SamplingParams, token_ids_ok
from leapfrog.scheduler.scheduler import Scheduler
from leapfrog.spec_decode.adaptive import cap_drafts, mostly_sampled
from leapfrog.spec_decode.config import EAGLE_METHODS
from leapfrog.spec_decode.draft import DraftBatch, depths, path_to
from leapfrog.spec_decode.native_confidence import load_native_confidence, native_confidence_enabled
from leapfrog.spec_decode.proposers.prediction import MAX_DRAFT as MAX_PREDICTION_DRAFT, PredictionProposer
from leapfrog.spec_decode.verify.greedy import greedy_accept
from leapfrog.spec_decode.verify.native import (chain_rejection, load_native_verify,
                                                native_verify_enabled, race_match)
from leapfrog.spec_decode.verify.rejection import rejection_accept
from leapfrog.spec_decode.verify.result import AcceptanceResult
from leapfrog.spec_decode.verify.tree import tree_match_accept, tree_rejection_accept
from leapfrog.utils import env_off
from leapfrog.utils.cpp import build_ahead

log = logging.getLogger("leapfrog.engine")


def _check_kv_fits(args: Any, max_num_seqs: int, max_model_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
    """ConfigError before anything is allocated when the target's KV cache alone (max_num_seqs + 1
    rows of max_model_len columns, keys and values, every layer) exceeds the device's memory:
    otherwise the allocation fails deep inside, or the OOM killer ends the process."""
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * dtype.itemsize
    need = (max_num_seqs + 1) * max_model_len * per_token
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
    if need > have:
        raise ConfigError(f"max_num_seqs={max_num_seqs} x max_model_len={max_model_len} needs "
                          f"{need / 2**30:.1f} GiB of KV cache ({per_token} bytes per token), more than this "
                          f"{device.type} device's {have / 2**30:.1f} GiB; lower max_num_seqs or max_model_len")


_STREAMING_SHARE = ("share_target_with: the target streams its weights past the cache beside a drafter (it is "
                    "larger than the last-level cache), which would change every engine that shares it; "
                    "load a copy per engine, or set LEAPFROG_STREAM_WEIGHTS=0 (no streaming) for all of them")


def check_shareable(owner: LLMEngine, engine: LLMEngine) -> None:
    """Refuse (NotShareable, a ConfigError) to run ``engine`` on ``owner``'s target model unless it is the one
    ``engine`` would load and use: the same checkpoint directory, dtype, device, quantization,
    ``load_format`` (and seed, for dummy weights), eager or compiled, batch-invariant or not, no
    tensor parallelism, and a context no longer than the owner's (its RoPE tables). Engines then
    differ only in speculation, scheduling limits and their own KV caches: one copy of the
    weights in memory, and (benchmarks) no difference of weight placement between the
    engines compared; eagerly, that is (compiled graphs, enforce_eager=False, freeze and prepack
    their own copy of the weights in each engine). A target that streams its weights beside a
    drafter (model/native_linear.py ``set_streaming``) is not shared."""
    mine, theirs = _target_identity(engine), _target_identity(owner)
    differ = [f"{k} {v} (the owner's: {theirs.get(k)})" for k, v in mine.items() if v != theirs.get(k)]
    if differ:
        raise NotShareable("share_target_with: the engines would not load the same target: " + "; ".join(differ))
    if engine.config.tensor_parallel_size > 1:
        raise NotShareable("share_target_with: not with tensor parallelism (each rank holds its own shard)")
    if engine.max_model_len > owner.max_model_len:
        raise NotShareable(f"share_target_with: max_model_len {engine.max_model_len} is longer than the owner's "
                          f"{owner.max_model_len} (the model's RoPE tables are the owner's length)")
    if any(getattr(m, "stream", False) for m in owner.model.modules()):
        raise NotShareable(_STREAMING_SHARE)


def _check_cache_shareable(owner: LLMEngine | None, engine: LLMEngine) -> None:
    """Refuse (NotShareable) to run ``engine`` on ``owner``'s KV cache unless it shares the owner's
    target (``check_shareable``) with the same rows and length."""
    if owner is None:
        raise NotShareable("share_kv_cache: only with share_target_with (the cache of that engine's target)")
    mine = (engine.config.max_num_seqs, engine.max_model_len)
    theirs = (owner.config.max_num_seqs, owner.max_model_len)
    if mine != theirs:
        raise NotShareable(f"share_kv_cache: max_num_seqs and max_model_len {mine} differ from the owner's {theirs}")


def _target_identity(e: LLMEngine) -> dict[str, Any]:
    """What decides the target model an engine loads and how it runs it (``check_shareable``)."""
    c = e.config
    out = {"checkpoint": e.checkpoint.path.resolve(), "dtype": e.dtype, "device": _device(e.device),
           "quantization": c.quantization, "load_format": c.load_format, "enforce_eager": c.enforce_eager,
           "batch_invariant": c.batch_invariant, "tensor_parallel_size": c.tensor_parallel_size}
    if c.load_format == "dummy":   # (random weights from the seed)
        out["seed"] = c.seed
    return out


def _device(d: torch.device) -> torch.device:
    """``d`` with its index ("cuda" is the current CUDA device: the same as "cuda:0" there)."""
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


class LLMEngine:
    def __init__(self, config: EngineConfig, share_target_with: LLMEngine | None = None,
                 share_kv_cache: bool = False) -> None:
        """``share_target_with``: run on that engine's loaded target model (the same tensors) rather
        than loading a copy; see ``check_shareable`` for what must match. ``share_kv_cache``: its
        target's KV cache too (the same max_num_seqs and max_model_len), the engines running one
        at a time: one that steps while the other has unfinished requests raises CacheBusy
        (benchmarks: contenders then differ only in their settings, not in where their caches'
        pages landed: ``leapfrog bench``)."""
        self.config = config
        self.device = config.torch_device()
        ckpt = read_checkpoint(config.model)
        self.checkpoint = ckpt
        self.dtype = resolve_dtype(config.dtype, ckpt, self.device)
        mpe = ckpt.args.context_len
        scaled = "" if mpe == ckpt.args.max_position_embeddings else f" x linear rope factor {ckpt.args.rope.factor:g}"
        if config.max_model_len is not None and config.max_model_len > mpe:
            raise ConfigError(f"max_model_len={config.max_model_len} is larger than the model's context, "
                              f"{mpe} (max_position_embeddings in {ckpt.path / 'config.json'}{scaled}); positions "
                              "beyond it were never trained (use max_model_len <= that)")
        self.max_model_len = config.max_model_len or min(mpe, 4096)
        _check_kv_fits(ckpt.args, config.max_num_seqs, self.max_model_len, self.dtype, self.device)
        if not config.enforce_eager and (why := can_compile(self.device)):
            raise ConfigError(f"enforce_eager=False: cannot compile here: {why}; use enforce_eager=True")
        if config.batch_invariant:
            check_batch_invariant_quantization(config.quantization, self.device)
        check_quantization(config.quantization, self.dtype, self.device)
        if share_target_with is not None:   # (before any worker or op is started for a target not loaded)
            check_shareable(share_target_with, self)
        if share_kv_cache:
            _check_cache_shareable(share_target_with, self)
        # (the tokenizer before the weights, workers and ops: one of another model is refused at once)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or ckpt.path)
        if self.tokenizer is not None:
            check_tokenizer_vocab(self.tokenizer, ckpt.args.vocab_size, str(config.tokenizer or ckpt.path))
        self._build_ops_ahead(ckpt)
        #: tensor parallelism (parallel/): this rank's group and the worker processes it spawned
        self.tp: Any = None
        self._workers: Any = None
        #: called (from a watchdog thread) with the reason when a tensor-parallel worker dies
        self.on_worker_death: Callable[[str], None] | None = None
        if config.tensor_parallel_size > 1:
            self._start_tp(ckpt)
        try:
            # Compiled graphs freeze plain linear layers themselves; eager forwards use oneDNN-packed ones.
            if share_target_with is not None:
                self.model = share_target_with.model
            else:
                self.model = load_model(ckpt, self.dtype, self.device, self.max_model_len, config.allow_pickle,
                                        pack=config.enforce_eager, quantization=config.quantization, tp=self.tp,
                                        load_format=config.load_format, seed=config.seed)
                if not config.enforce_eager:
                    self.model.pack_for_inference(pack_layers=False)
            self.eos_ids = ckpt.eos_token_ids or (
                (self.tokenizer.eos_token_id,) if self.tokenizer is not None and self.tokenizer.eos_token_id is not None
                else ())
            self.vocab_size = ckpt.args.vocab_size
            self.kv = KVManager(config.max_num_seqs, self.max_model_len)
            if self.tp is not None:
                from leapfrog.parallel.worker import TPModelRunner
                self.runner: ModelRunner = TPModelRunner(self.model, config.max_num_seqs, self.max_model_len, self.tp)
            else:
                self.runner = ModelRunner(self.model, config.max_num_seqs, self.max_model_len,
                                          batch_invariant=config.batch_invariant,
                                          kv=share_target_with.runner.kv if share_kv_cache else None)
            self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
            self.requests: dict[str, Request] = {}
            self._seed_rng = random.Random(config.seed)
            self.spec_metrics = SpecMetrics()
            self.iteration = IterationStats()   # the last step's (read by the server's /metrics after each step)
            self.proposer: Any = None
            #: drafts for requests that carry a prediction (SamplingParams.prediction), whatever the config
            self.predictor = PredictionProposer()
            self._grammars: Any = None   # structured outputs' GrammarCompiler, built at the first such request
            self._grammar_lock = threading.Lock()
            self._ones: torch.Tensor | None = None   # multi-step decode's noise of greedy-only steps (_no_noise)
            #: test-only fault injection: called with the requests of every sampling call; raising
            #: there simulates a failure in one request's sampling (tests/engine/test_isolation.py)
            self.fault_injector: Callable[[list[Request]], None] | None = None
            self._failed: list[RequestOutput] = []   # outputs of requests that failed this step
            self.spec_controller: Any = None
            if config.speculative_config is not None:
                from leapfrog.spec_decode.setup import build_speculation
                self.proposer, self.spec_controller = build_speculation(config.speculative_config, self)
                if getattr(self.proposer, "runner", None) is not None:
                    # a drafter model: a target larger than the cache streams its weights past it,
                    # so the drafter's stay cached between draft steps (model/native_linear.py)
                    if share_target_with is not None and would_stream(self.model):
                        raise NotShareable(_STREAMING_SHARE)
                    n = set_streaming(self.model)
                    if n:
                        log.info("target weights stream non-temporally (%d linears) beside the drafter", n)
            #: which target states the proposer reads (EAGLE: "hidden" or aux layers), else None
            self._target_states = getattr(self.proposer, "target_states", None)
            #: chains of unseeded temperature-only requests verified, and their tokens drawn (plain
            #: decode too: chains of none), by one C++ call, and seeded requests' rows raced by
            #: another (on CPU: spec_decode/verify/native.py; LEAPFROG_NATIVE_VERIFY=0, read here,
            #: turns them off)
            self._native_verify = self.device.type == "cpu" and native_verify_enabled()
            self._sampled_seen = False   # whether a sampled request came (the op's build starts then)
            if not config.enforce_eager:
                self._compile()
        except BaseException:
            self.close()   # tensor-parallel workers must not outlive a failed start
            raise

    def _start_tp(self, ckpt) -> None:
        """Start (spawn on this machine) or join (torchrun) the tensor-parallel group, then send
        the workers what to load. Spawned ranks share this process's threads equally."""
        from leapfrog.parallel.group import connect, launched_by_torchrun, make_group
        from leapfrog.parallel.shard import check_divisible
        from leapfrog.parallel.worker import WorkerSpec, spawn_workers
        size = self.config.tensor_parallel_size
        check_divisible(ckpt.args, size)
        spec = WorkerSpec(str(ckpt.path), str(self.dtype).removeprefix("torch."), str(self.device),
                          self.max_model_len, self.config.max_num_seqs, size, self.config.allow_pickle)
        if launched_by_torchrun():
            if int(os.environ["RANK"]) != 0:
                raise ConfigError("LLMEngine runs on rank 0 only; the other torchrun ranks run "
                                  "leapfrog.parallel.worker.run_worker (`leapfrog serve` does this itself)")
            connect(size, 0, self.device)
        else:
            threads = max(1, torch.get_num_threads() // size)
            self._workers, addr, port = spawn_workers(spec, threads)
            torch.set_num_threads(threads)
            log.info("tensor parallelism: %d ranks on this machine, %d thread(s) each", size, threads)
            try:
                connect(size, 0, self.device, addr, port)
            except BaseException:
                self._workers.join(1)
                raise
        self.tp = make_group(ckpt.args, size, self.device)
        shm = None
        if self._workers is not None and self.device.type == "cpu":   # all ranks here: shared memory
            from dataclasses import replace

            from leapfrog.parallel.shm import ShmChannel
            try:
                shm = ShmChannel(size, 0, alive=self.tp.check_alive)
                spec = replace(spec, shm_name=shm.name)
            except OSError as e:   # no /dev/shm, or too small: gloo carries everything (slower)
                log.warning("tensor parallelism: no shared-memory segment (%s); collectives go through gloo", e)
        self.tp.broadcast(spec)
        self.tp.shm = shm
        if self._workers is not None:
            self._workers.watch(self.tp, lambda why: self.on_worker_death and self.on_worker_death(why))

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (no-op without TP)."""
        if self.tp is None:
            if self._workers is not None:   # spawned, but the group never formed
                self._workers.join(1)
            return
        import torch.distributed as dist
        from leapfrog.parallel.worker import stop_workers
        try:
            stop_workers(self.tp)
        except Exception:  # noqa: BLE001 - a dead group: the workers are gone or exit on the closed sockets
            log.warning("tensor-parallel workers did not take the stop command")
        if self._workers is not None:
            self._workers.join()
        if self.tp.shm is not None:
            self.tp.shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.tp = None

    def _compile(self) -> None:
        """Compile the decode/verify graphs of the target and of a draft model (model/compiled.py):
        batch sizes 1, 2, 4, ... max_num_seqs, 1 token per sequence and 1 + the most drafts; with
        "auto" tree sizes also 1 + the depth, 8, 16 and 32 nodes (below the most), so that a small
        tree is not verified padded to the largest one; with a fixed dynamic tree also 1 + the
        depth (unseeded sampled requests draft chains whatever the tree: proposers/eagle.py)."""
        per_seq = [1]
        if self.spec_controller is not None:
            cfg = self.spec_controller.cfg
            most = cfg.draft_budget
            if cfg.auto_tree:   # (no tree verifies more candidates than it grows)
                most = min(most, cfg.tree_candidates)
                per_seq += [1 + n for n in (cfg.num_speculative_tokens, 8, 16, 32) if n < most]
            elif cfg.tree and cfg.speculative_token_tree is None and cfg.num_speculative_tokens < most:
                per_seq.append(1 + cfg.num_speculative_tokens)
            per_seq.append(1 + most)
        buckets = make_buckets(self.config.max_num_seqs, per_seq)
        aux = self._target_states if isinstance(self._target_states, tuple) else ()
        self.runner.compile(buckets, aux)
        steps = self.config.num_scheduler_steps
        ctl = self.spec_controller
        # multi-step decode: without speculation, and where the controller may turn it off (an
        # adaptive size, or disable_by_batch_size), handing an EAGLE head the target's states
        if steps > 1 and (self.proposer is None or ctl.cfg.adaptive or ctl.cfg.auto_tree
                          or ctl.cfg.disable_by_batch_size is not None):
            self.runner.compile_multi_step(make_buckets(self.config.max_num_seqs, [1]), steps, self._target_states)
        if hasattr(self.proposer, "compile"):
            self.proposer.compile()
        if steps > 1 and self.proposer is not None:   # (EngineConfig admits draft models and EAGLE chains only)
            k = self.spec_controller.cfg.num_speculative_tokens   # (K, or the depth: the chain of "auto" sizes)
            self.runner.compile_spec_round(self.proposer.runner, make_buckets(self.config.max_num_seqs, [k + 1]), k,
                                           steps)
            ctl.round_k = k
            ctl.round_sizes = (k,) + ((0,) if self.runner.multi_step is not None else ())

    def _build_ops_ahead(self, ckpt: Any) -> None:
        """On CPU, start building the C++ op libraries this engine will likely load, in the order it
        first needs them (utils/cpp.py ``build_ahead``): on a machine that has not built them yet
        they compile side by side while the weights load, not one after another on first use. A
        guess from the configuration (each library still decides where it serves): a wrong guess
        costs one background build, cached for later runs; a library missed is built on first use,
        as before. The verify op is left to its first sampled step: building it ahead would
        slow the first run of greedy requests, which never load it."""
        cfg = self.config
        if self.device.type != "cpu" or cfg.tensor_parallel_size > 1:
            return
        loaders: list[Callable[[], bool]] = []
        if self.dtype != torch.float16 and not env_off("LEAPFROG_NATIVE_LINEAR"):   # (packing asks for it)
            loaders.append(load_native_linear)
        if not env_off("LEAPFROG_NATIVE_OPS"):
            loaders.append(load_native_ops)
        if not cfg.enforce_eager or not (cfg.batch_invariant or env_off("LEAPFROG_NATIVE_ATTENTION")):
            loaders.append(load_native_attention)
        # the one-call forwards and drafting loops: bf16 weights (or float32 ones of bf16 values) on
        # the few-row kernel, eager, the attention op; the target's own unless quantized
        on_kernel = self.dtype == torch.bfloat16 or (self.dtype == torch.float32
                                                     and ckpt.config_dtype == torch.bfloat16)
        spec = cfg.speculative_config or {}
        method = spec.get("method")
        if (on_kernel and cfg.enforce_eager and not cfg.batch_invariant and len(loaders) == 3
                and ((cfg.quantization is None and not env_off("LEAPFROG_NATIVE_FORWARD"))
                     or (method in ("eagle3", "draft_model") and not env_off("LEAPFROG_NATIVE_DRAFTS")))):
            loaders.append(load_native_draft)
        if native_confidence_enabled() and method in EAGLE_METHODS and (spec.get("num_draft_tokens") == "auto"
                                                                        or spec.get("adaptive")):
            loaders.append(load_native_confidence)   # ("auto" tree sizes' controller, spec_decode/native_confidence.py)
        build_ahead(loaders)   # (not spec_decode/verify/native.py's op: greedy runs never load it)

    def expect_sampled_requests(self) -> None:
        """The caller will send sampled requests (a server: the OpenAI API's default temperature is 1):
        on CPU, build the sampled-chain verify op (which draws plain decode's tokens too) ahead,
        rather than at the first sampled decode step (7-10 s on a fresh machine; seeded requests'
        rows are raced by it too). Called by the engine itself at the first sampled request too
        (its prefill runs meanwhile)."""
        self._sampled_seen = True
        if self._native_verify:   # (CPU logits: the op verifies chains and draws tokens)
            build_ahead([load_native_verify])

    # ------------------------------------------------------------------ requests
    def prepare(self, params: SamplingParams) -> Prepared:
        """``params`` checked (again: a field set after construction is validated) against this
        model and tokenizer, and their lists built: bad words tokenized, stop strings indexed, a
        text prediction tokenized. Pass the result to ``add_request`` in place of the params to
        do this once for several requests (n choices, many prompts). Safe on any thread: the
        server prepares on its tokenizer's thread (100k bad words take 9 s to tokenize)."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        # validated; the requests keep this copy, with lists of their own (a caller changing its
        # lists after this would skip the vocabulary checks and leave the rule tensors stale)
        params = dataclasses.replace(params, **{k: dict(v) if isinstance(v, dict) else list(v) for k in _LIST_FIELDS
                                                if isinstance(v := getattr(params, k), (list, tuple, dict))})
        self._check_params(params)
        stop_ids = stop_ids_of(params, self.eos_ids)
        stop_set = frozenset(stop_ids)
        if params.min_tokens and len(stop_set) >= self.vocab_size:
            raise RequestError("stop_token_ids and EOS cover the whole vocabulary, so min_tokens leaves no token "
                               "to generate", param="min_tokens")
        bad_words = self.encode_bad_words(params)
        if params.allowed_token_ids is not None:
            never = set(bad_words.always) | (stop_set if params.min_tokens else set())
            if never.issuperset(params.allowed_token_ids):
                raise RequestError("every one of allowed_token_ids is banned (by a one-token bad word, or as a stop "
                                   "token under min_tokens): no token is left to generate", param="allowed_token_ids")
        stops = StopStrings(params.stop_strings) if self.tokenizer is not None else None
        return Prepared(params, self, bad_words, stops, self._prediction_ids(params), stop_ids, stop_set)

    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int] | None,
                    params: SamplingParams | Prepared, index: int = 0,
                    num_speculative_tokens: int | None = None, grammar: GrammarState | None = None,
                    arrival_time: float | None = None) -> Request:
        """``params``: a SamplingParams, or ``prepare(params)``'s result (checked once for every
        request that passes it: the server's choices and prompts, ``LLM.generate``'s). ``index``:
        the choice's index (n > 1): its seed is ``params.seed + index``. ``grammar``: the matcher
        ``compile_grammar(params)`` built for this request (elsewhere, ahead of time); compiled
        here when not given. ``arrival_time`` (time.monotonic()): when
        the request arrived, if before this call (the server's, before it tokenized the prompt
        and compiled the grammar: TTFT and queue time count them, as vLLM's do); default now."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        if isinstance(params, Prepared):
            if params.owner is not self:
                raise RequestError("these params were prepared by another engine: prepare them with this one")
            prepared = params
        else:
            prepared = self.prepare(params)
        params = prepared.params
        if prompt_ids is None:
            prompt_ids = self.encode_prompt(prompt)
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        self._check_vocab(prompt_ids, "prompt")
        trunc = params.truncate_prompt_tokens
        if trunc is not None:   # -1: the last tokens that fit beside max_tokens (one new token if unset)
            keep = self.max_model_len - (params.max_tokens or 1) if trunc == -1 else trunc
            if keep < 1:
                raise RequestError(f"truncate_prompt_tokens=-1 with max_tokens={params.max_tokens} leaves no room for "
                                   f"the prompt (max_model_len {self.max_model_len})", param="truncate_prompt_tokens")
            if keep > self.max_model_len - 1:
                raise RequestError(f"truncate_prompt_tokens={trunc} is larger than the context allows "
                                   f"({self.max_model_len - 1}: the prompt plus one new token)",
                                   param="truncate_prompt_tokens")
            if len(prompt_ids) > keep:
                prompt_ids = prompt_ids[len(prompt_ids) - keep:]
                prompt = self.tokenizer.decode(prompt_ids) if self.tokenizer is not None else None
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                               "(the prompt plus at least one new token must fit)")
        room = self.max_model_len - len(prompt_ids)
        prediction_ids = prepared.prediction_ids
        if prediction_ids is not None and len(prediction_ids) > room:
            raise RequestError(f"the prediction has {len(prediction_ids)} tokens but at most {room} new tokens fit "
                               f"after the prompt (max_model_len {self.max_model_len})", param="prediction")
        if params.max_tokens is not None:
            self.kv.check_fits(len(prompt_ids) + params.max_tokens)
        if num_speculative_tokens is not None and (isinstance(num_speculative_tokens, bool) or
                                                   not isinstance(num_speculative_tokens, int)
                                                   or num_speculative_tokens < 0):
            raise RequestError(f"num_speculative_tokens={num_speculative_tokens!r}: must be an integer >= 0",
                               param="num_speculative_tokens")
        # Seeded requests draw from counter-based noise keyed by (seed, position): see sampling/sampler.py.
        key = sampler.seed_key(params.seed + index) if params.seed is not None else None
        gen = torch.Generator().manual_seed(self._seed_rng.getrandbits(63))
        detok = None
        if self.tokenizer is not None:
            detok = Detokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, prepared.stops,
                                params.include_stop_str_in_output)
        if params.structured_outputs is None:
            grammar = None
        elif grammar is None or grammar.num_consumed:
            grammar = self.compile_grammar(params)
        req = Request(request_id, prompt, prompt_ids, params, gen, detok, self.eos_ids,
                      max_tokens=min(params.max_tokens or room, room), index=index,
                      num_speculative_tokens=num_speculative_tokens, seed_key=key,
                      prediction_ids=None if prediction_ids is None else list(prediction_ids),
                      bad_words=prepared.bad_words, shared_rules=prepared.rules, stop_ids=prepared.stop_ids,
                      stop_set=prepared.stop_set, grammar=grammar)
        req.metrics.num_prompt_tokens = len(prompt_ids)
        if arrival_time is not None:
            req.metrics.arrival_time = arrival_time
        self.requests[request_id] = req
        self.scheduler.add(req)
        if req.sampled and not self._sampled_seen:   # (its prefill runs while the op builds)
            self.expect_sampled_requests()
        proposer = self._proposer_of(req)
        if proposer is not None:
            proposer.start(req)
        return req

    def encode_prompt(self, prompt: str | None) -> list[int]:
        """A text prompt's token ids, as ``add_request`` encodes it. Safe on any thread: the
        server encodes here, off the engine's thread (a 2.5 MB prompt takes about 4 s), and
        passes the text and the ids to ``add_request``."""
        if prompt is None:
            raise RequestError("a request needs a prompt string or prompt_token_ids")
        if self.tokenizer is None:
            raise RequestError("text prompts need a tokenizer (skip_tokenizer_init=True was set); "
                               "pass prompt_token_ids")
        if not isinstance(prompt, str):
            raise RequestError(f"a prompt must be a string, got {type(prompt).__name__}")
        return self._encode(prompt, "prompt")

    def encode_prediction(self, text: str) -> list[int]:
        """A text prediction's token ids, as ``add_request`` encodes it; safe on any thread (the
        server encodes here: up to 4 MB of text on the engine's thread would stall every request)."""
        return self._encode(text, "prediction", add_special_tokens=False)

    def compile_grammar(self, params: SamplingParams) -> GrammarState | None:
        """The matcher of ``params.structured_outputs`` (None without one), compiled with its first
        mask computed. Safe on any thread: the server compiles here, off the engine's thread (a
        large JSON schema takes a second, the first grammar of a process a few), and passes the
        result to ``add_request(grammar=...)``; a bad constraint is a RequestError."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer (skip_tokenizer_init=True was set)",
                               param="structured_outputs")
        if params.allowed_token_ids is not None or params.bad_words:
            # their bans could leave no token the grammar allows (found by fuzzing): refused
            raise RequestError("structured outputs with allowed_token_ids or bad_words are not supported "
                               "(together they can leave no token to generate)", param="structured_outputs")
        with self._grammar_lock:   # the tokenizer's llguidance view is built once
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars.matcher(params.structured_outputs)

    def _prediction_ids(self, params: SamplingParams) -> tuple[int, ...] | None:
        """The prediction's token ids, checked against the vocabulary (add_request checks that
        they fit the context)."""
        pred = params.prediction
        if pred is None:
            return None
        if isinstance(pred, str):
            if self.tokenizer is None:
                raise RequestError("a text prediction needs a tokenizer (skip_tokenizer_init=True was set); "
                                   "pass its token ids", param="prediction")
            ids = self.encode_prediction(pred)
        else:
            ids = list(pred)
        self._check_vocab(ids, "prediction")
        return tuple(ids)

    def encode_bad_words(self, params: SamplingParams) -> BadWords:
        """Each bad word as token ids, as written and (when that tokenizes into as many tokens,
        starting differently) with a leading space: a word inside text usually follows one.
        Safe on any thread: the server encodes here, off the engine's thread (100k words take
        about 9 s; the 4 MiB body holds 400k), and passes them to ``add_request``."""
        if not params.bad_words:
            return BadWords()
        if self.tokenizer is None:
            raise RequestError("bad_words needs a tokenizer (skip_tokenizer_init=True was set)", param="bad_words")
        out: list[tuple[int, ...]] = []
        for word in params.bad_words:
            plain = tuple(self._encode(word, "bad_words", add_special_tokens=False))
            spaced = tuple(self._encode(" " + word.lstrip(), "bad_words", add_special_tokens=False))
            out.append(plain)
            if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
                out.append(spaced)
        return BadWords(tuple(out))

    def _encode(self, text: str, what: str, **kw) -> list[int]:
        """``text`` (the request's ``what``: "prompt" or "prediction") tokenized; a tokenizer
        failure (e.g. a lone UTF-16 surrogate) is the input's fault: a RequestError."""
        try:
            return list(self.tokenizer.encode(text, **kw))
        except Exception as e:  # noqa: BLE001 - the input's fault
            param = None if what == "prompt" else what
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as u:   # (the tokenizer's own message names its Rust types)
                raise RequestError(f"could not tokenize the {what}: it is not valid Unicode text (a lone UTF-16 "
                                   f"surrogate {text[u.start]!r} at character {u.start})", param=param) from None
            except (AttributeError, TypeError):
                pass
            raise RequestError(f"could not tokenize the {what}: {type(e).__name__}: {e}", param=param) from None

    def _check_vocab(self, ids: list[int], what: str) -> None:
        if token_ids_ok(ids, self.vocab_size):
            return
        bad = next(t for t in ids if not token_ids_ok((t,), self.vocab_size))
        raise RequestError(f"{what} token id {bad!r} is outside the vocabulary [0, {self.vocab_size})",
                           param=None if what == "prompt" else what)

    def _proposer_of(self, req: Request) -> Any:
        """Who drafts for this request: its prediction if it has one, else the configured proposer."""
        return self.predictor if req.prediction_ids is not None else self.proposer

    def _non_finite_logits(self) -> FloatingPointError:
        """The error of a step whose logits hold NaN or infinity, with the likely cause for the dtype."""
        why = ("fp16 overflow? try bfloat16 or float32" if self.dtype == torch.float16
               else "NaN or infinite weights in the checkpoint, or activations past the dtype's range?")
        return FloatingPointError(f"non-finite logits from the model ({why})")

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: ids against this model's vocabulary, stop
        strings against the tokenizer."""
        self._check_vocab(list(params.stop_token_ids or ()), "stop_token_ids")
        self._check_vocab(list(params.logit_bias or ()), "logit_bias")
        self._check_vocab(list(params.allowed_token_ids or ()), "allowed_token_ids")
        if params.stop_strings and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (skip_tokenizer_init=True was set); "
                               "use stop_token_ids instead", param="stop")

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.finish_reason = "abort"
        return self._finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step. Isolation by construction: the step first computes everything for the
        whole batch (KV writes beyond committed lengths and proposer state are the only side
        effects, both redone safely), then commits request by request. If the batched compute
        raises, every scheduled request is retried alone; one that still fails ends with
        finish_reason "error" and the others go on as if nothing happened (with seeded and
        greedy requests their output is the same: their randomness is keyed by position).

        ``final_only``: outputs of the requests that finished (or failed) in this step only, for
        callers that read nothing else (``LLM.generate``, vLLM's FINAL_ONLY output kind): running
        requests' text is then not decoded every step (detokenizer.py)."""
        kv = self.runner.kv
        if kv.holder is not self:   # (engines sharing the cache run one at a time: share_kv_cache)
            if kv.holder is not None and kv.holder.has_unfinished():
                raise CacheBusy("this engine shares its KV cache with another (share_kv_cache) that has "
                                "unfinished requests: engines sharing a cache run one at a time")
            kv.holder = self
        sched = self.scheduler.schedule()
        self.iteration = IterationStats()
        self._failed = []
        updated: list[Request] = []
        if sched.prefill:
            updated += self._isolated(self._prefill, sched.prefill, lambda w: w[0])
        if sched.decode:
            updated += self._isolated(self._decode, sched.decode, lambda r: r)
        outs: list[RequestOutput] = []
        for r in updated:
            if r.finish_reason != "error" and not (final_only and r.finish_reason is None):
                self._guarded(r, lambda r=r: outs.append(self._output(r)))
        failed, self._failed = self._failed, []
        return failed + outs

    def _isolated(self, phase: Callable[[list], list[Request]], work: list, req_of: Callable) -> list[Request]:
        """Run a phase (prefill or decode) over the batch; if its compute raises, run each request
        alone, and end those that fail again with finish_reason "error"."""
        try:
            return phase(work)
        except Exception as exc:  # noqa: BLE001 - isolated below
            if len(work) == 1:
                self._fail(req_of(work[0]), exc)
                return []
            log.warning("engine %s failed for a batch of %d; retrying each request alone (%s: %s)",
                        phase.__name__.strip("_"), len(work), type(exc).__name__, exc)
        if phase == self._decode:
            for req in work:  # the failed batch may have left draft state half-advanced
                self._reset_proposer(req)
        updated: list[Request] = []
        for item in work:
            if req_of(item).finish_reason is not None:
                continue
            try:
                updated += phase([item])
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                self._fail(req_of(item), exc)
        return updated

    def _reset_proposer(self, req: Request) -> None:
        """Forget a request's draft state the failed step may have half-advanced; the proposer
        rebuilds it (from the tokens, or what it keeps of the committed target states: EAGLE)."""
        proposer = self._proposer_of(req)
        if proposer is None:
            return
        try:
            reset = getattr(proposer, "reset", None)
            if reset is not None:
                reset(req)
            else:
                proposer.finish(req)
                proposer.start(req)
        except Exception as exc:  # noqa: BLE001
            self._fail(req, exc)

    def _fail(self, req: Request, exc: BaseException) -> None:
        if isinstance(exc, RequestError):   # the request's own fault (a grammar past its limits): no traceback
            log.warning("request %s failed: %s: %s", req.request_id, type(exc).__name__, exc)
        else:
            log.error("request %s failed: %s: %s", req.request_id, type(exc).__name__, exc, exc_info=exc)
        req.finish_reason = "error"
        req.error = exc
        self._failed.append(self._finish(req))

    def _prefill(self, work: list[tuple[Request, int]]) -> list[Request]:
        # compute (no request state changes until every request's result is known)
        chunks, done, last_rows, prompt_lps = [], [], [], []
        row = 0
        now = time.monotonic()
        for req, n in work:
            c = req.num_computed
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            last = c + n == len(req.prompt_ids)
            # logits rows: every position for prompt_logprobs, else the last prompt token's
            want = n if req.params.prompt_logprobs is not None else int(last)
            chunks.append(SeqChunk(req.row, c, req.prompt_ids[c:c + n], want))
            if req.params.prompt_logprobs is not None:
                # rows row.. predict prompt tokens c + 1 .. (the last row predicts the first output)
                prompt_lps.append((req, row, req.prompt_ids[c + 1:c + 1 + n - int(last)]))
            if last:
                done.append(req)
                last_rows.append(row + want - 1)
            row += want
        # (the prompts' target states: not while speculation is off at this batch size, as for
        # the drafter's prefill below; an EAGLE head reads zeros for them: EagleProposer._ready)
        off = self.spec_controller is not None and self._drafting_off()   # (decided once: the batch may shrink below)
        hidden = self._target_states
        if hidden is not None and off and all(self._proposer_of(r) is self.proposer for r, _ in work):
            hidden = None
        out = self.runner.step(chunks, hidden=hidden)
        logits = out.logits if len(last_rows) == out.logits.shape[0] else out.logits[last_rows]
        result = self.accept(done, logits, DraftBatch.empty(len(done))) if done else None
        prompt_values = [self._prompt_logprobs(req, out.logits[r0:r0 + len(toks)], toks)
                         for req, r0, toks in prompt_lps]
        # commit, request by request (from here on nothing raises for the batch: see _decode)
        for (req, _, _), entries in zip(prompt_lps, prompt_values):
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]
            req.prompt_logprobs += entries
        o = 0
        for req, n in work:
            states = None if out.hidden is None else out.hidden[o:o + n]
            self._guarded(req, self._commit, req, req.num_computed + n, None, states)
            o += n
            self.iteration.num_prompt_tokens += n
        if result is not None:
            now = time.monotonic()
            for b, (req, ids) in enumerate(zip(done, result.output_ids)):
                req.metrics.first_token_time = now
                if req.request_id in self.requests:
                    self._guarded(req, self._append, req, ids, result.logprobs[b] if result.logprobs else None)
            running = [r for r in done if r.request_id in self.requests]
            if self._drafters_prefill(running, off):   # (the caller gets the first token when the step returns)
                now = time.monotonic()
                for req in running:
                    req.metrics.first_token_time = req.metrics.last_token_time = now
        return done

    def _drafters_prefill(self, reqs: list[Request], off: bool) -> bool:
        """Drafters that run their own forward over the prompt (a draft model, an EAGLE head) do it
        now, in the step that prefilled the target, as vLLM and SGLang run the draft's prefill with
        the target's: else the first decode step pays for it (a spike in inter-token latency, and
        host work outside the decode graphs). Not while the speculation controller drafts nothing
        at this batch size (``off``: ``_drafting_off`` as the step began, when the target's states
        of the prompts were left uncaptured for it): the drafter catches up when it drafts again
        (an EAGLE head on zero features for those prompts: EagleProposer._ready). A failure resets
        the drafter's state for these requests, which then catch up while decoding. -> whether any
        drafter ran."""
        ran = False
        for proposer, idx in self._groups(reqs):
            prefill = getattr(proposer, "prefill", None)
            if prefill is None or (proposer is self.proposer and off):
                continue   # (no drafting at this batch size for now: it catches up when it drafts again)
            sub = [reqs[i] for i in idx]
            if proposer is self.proposer:   # (a prompt past the speculative max_model_len never drafts)
                sub = [r for r in sub if len(r.prompt_ids) < self.spec_controller.max_model_len - 1]
                if not sub:
                    continue
            ran = True
            try:
                prefill(sub)
            except Exception:  # noqa: BLE001 - the drafter restarts these requests from scratch
                log.exception("drafter prefill failed; resetting its state for %d requests", len(sub))
                for req in sub:
                    self._reset_proposer(req)
        return ran

    def _drafting_off(self) -> bool:
        """Whether the speculation controller drafts nothing at the running batch's size for now
        (SpecController.drafting_off)."""
        running = self.scheduler.running
        return self.spec_controller.drafting_off(len(running), sampled=mostly_sampled(running))

    def _decode(self, reqs: list[Request]) -> list[Request]:
        # compute: propose (each request's proposer), verify forward, accept
        groups = self._groups(reqs)
        if not groups and self.runner.multi_step is not None and self._decode_steps(reqs):
            return reqs
        parts = []
        t_step = time.perf_counter()   # the whole step (the controller's t_host: what is neither below)
        t_draft = 0.0   # the configured proposer's drafting time (what the K controller weighs)
        subs = []   # each group's requests (the controller's ``observe`` gets the list it chose for)
        # a plain step the controller promised (spec_decode/adaptive.py ``leased``): no choosing, no drafts
        leased = self.spec_controller is not None and self.spec_controller.leased(reqs)
        for proposer, idx in groups:
            sub = [reqs[i] for i in idx]
            subs.append(sub)
            if proposer is self.predictor:
                ks = [cap_drafts(r, MAX_PREDICTION_DRAFT, self.max_model_len) for r in sub]
            elif leased:
                ks = [0] * len(sub)
            else:   # the controller sizes drafts by the whole running batch (predictions included)
                ks = self.spec_controller.choose(sub, batch_size=len(reqs),
                                                 context=float(sum(r.num_computed for r in reqs)))
                if len(sub) == len(reqs) and self.runner.round is not None and self._spec_rounds(reqs, ks):
                    return reqs
                if len(sub) == len(reqs) and not any(ks) and self._plain_steps(reqs):
                    return reqs
            t0 = time.perf_counter()
            # ("auto" tree sizes: where greedy chains of the chosen size stop drafting, EAGLE only)
            stop = self.spec_controller.stop_confidence if proposer is self.proposer else None
            kw = {} if stop is None else {"stop_confidence": stop}
            parts.append((idx, proposer.propose(sub, ks, **kw) if any(ks) else DraftBatch.empty(len(sub))))
            if proposer is self.proposer:
                t_draft = time.perf_counter() - t0
        drafts = DraftBatch.merge(parts, len(reqs)) if parts else DraftBatch.empty(len(reqs))
        draft_lists = drafts.lists()
        tree = drafts.is_tree
        parent_lists = drafts.parent_lists() if tree else [None] * len(reqs)
        chunks = [SeqChunk(r.row, r.num_computed, [r.output_ids[-1]] + d, len(d) + 1,
                           parents=None if ps is None else [-1] + [q + 1 for q in ps])
                  for r, d, ps in zip(reqs, draft_lists, parent_lists)]
        t1 = time.perf_counter()
        out = self.runner.step(chunks, hidden=self._capture(leased, groups, reqs))
        result = self.accept(reqs, out.logits, drafts, out.top)
        t_verify = time.perf_counter() - t1
        # commit / roll back, then feedback and outputs. From here on nothing may raise for the
        # batch: a retry would verify again on advanced state. Every step is per request or caught.
        o = 0
        hidden = out.hidden
        if hidden is not None and not drafts.total and hasattr(self.proposer, "on_plain_states"):
            # a plain step: its states go to the drafter as one [B, F] tensor, not a row per request
            own = next((idx for p, idx in groups if p is self.proposer), [])
            mine = [reqs[i] for i in own] if len(own) < len(reqs) else reqs
            try:
                if own:
                    self.proposer.on_plain_states(mine, hidden if len(own) == len(reqs) else hidden[own])
            except Exception:  # noqa: BLE001 - the proposer restarts these requests from scratch
                log.exception("proposer state hand-over failed; resetting its state for %d requests", len(mine))
                for req in mine:
                    self._reset_proposer(req)
            hidden = None
        for b, (req, n_draft, n_acc) in enumerate(zip(reqs, drafts.num_draft, result.num_accepted)):
            path = result.accepted(b)
            states = None   # the committed tokens' target states: a chain's are rows o..o+n_acc, a view
            if hidden is not None:   # (runner.step's states are a fresh tensor, never a graph's buffer)
                states = out.hidden[[o] + [o + 1 + j for j in path]] if tree else out.hidden[o:o + 1 + n_acc]
            self._guarded(req, self._commit, req, req.num_computed + 1 + n_acc, path if tree else None, states)
            o += n_draft + 1
            req.metrics.num_target_forwards += 1
            levels = max(depths(parent_lists[b]), default=0) if tree else n_draft
            req.metrics.spec.record(n_draft, n_acc, levels)
            self.spec_metrics.record(n_draft, n_acc, levels)
        told = None   # (the controller hears of the step when it is over: t_step)
        for (proposer, idx), (_, part), sub in zip(groups, parts, subs):
            sub_result = result if len(idx) == len(reqs) else result.select(idx)   # (idx ascending: all of them)
            try:
                proposer.on_verified(sub, part, sub_result)
            except Exception:  # noqa: BLE001 - the proposer restarts these requests from scratch
                log.exception("proposer feedback failed; resetting its state for %d requests", len(sub))
                for req in sub:
                    self._reset_proposer(req)
            if proposer is self.proposer:
                told = (sub, part, sub_result)
        for b, (req, ids) in enumerate(zip(reqs, result.output_ids)):
            if req.request_id in self.requests:
                self._guarded(req, self._append, req, ids, result.logprobs[b] if result.logprobs else None)
        if leased:
            self._tell_controller(self.spec_controller.lease_step, t_verify, time.perf_counter() - t_step - t_verify)
        elif told is not None:
            self._tell_controller(self.spec_controller.observe, *told, t_draft, t_verify, batch_size=len(reqs),
                                  verify_tokens=max(drafts.num_draft, default=0) + 1,
                                  t_step=time.perf_counter() - t_step)
        return reqs

    def _capture(self, leased: bool, groups: list[tuple[Any, list[int]]], reqs: list[Request]) -> Any:
        """The target states a decode step hands the drafter (``runner.step``'s ``hidden``): none
        on a leased step followed by another leased one, where nothing drafts now or next step
        (``SpecController.lease_continues``; no caller-supplied predictions in the batch; no request
        that ends at its max_tokens this step: the batch shrinks, the lease ends, and the others may
        draft next, from this step's states, the root's feature). An EAGLE
        head reads zeros for the positions it was not given (EagleProposer._ready): lossless,
        and it accepted about as much as with every feature, except for a few percent less in the
        first steps after the gap (docs/eagle-measurements.md, stop 105). At a batch of 16 at
        T = 0.7, where "auto" drafts nothing for hundreds of steps, capturing every step had cost
        about 2 % of a plain step (eager and native forwards; a compiled target graph computes
        its aux layers either way, and only their hand-over is saved)."""
        if (leased and self._target_states is not None and self.spec_controller.lease_continues()
                and all(p is self.proposer for p, _ in groups)
                and all(r.max_tokens - len(r.output_ids) > 1 for r in reqs)):
            return None
        return self._target_states

    def _decode_steps(self, reqs: list[Request]) -> bool:
        """Multi-step decode (EngineConfig.num_scheduler_steps): when every request is greedy on the
        raw logits or samples with temperature only, without logprobs, the compiled graph decodes
        ``num_scheduler_steps`` tokens for each, each drawn as a one-token step would draw it (the
        argmax, or the sampler's race with the randomness of that output position: its noise when
        seeded, the next draws of its generator when not). -> False when the step must run one
        token at a time instead (nothing done)."""
        if not all((r.raw_argmax or r.temperature_only) and r.params.logprobs is None for r in reqs):
            return False
        if self.fault_injector is not None:
            self.fault_injector(reqs)
        steps, dev = self.runner.multi_step.steps, self.device
        chunks = [SeqChunk(r.row, r.num_computed, [r.output_ids[-1]], 1) for r in reqs]
        if not self.runner.fits_decode_steps(chunks):
            return False   # (before any randomness is drawn: the step runs one token at a time)
        drawn = [not r.params.greedy for r in reqs]
        temperature = self._race_temperatures(reqs, drawn)
        # seeded rows race with their positions' noise, unseeded ones take one uniform per step
        # from their stream (sampler.sample: the draws one-token steps make)
        stream = [d and r.seed_key is None for r, d in zip(reqs, drawn)]
        if any(d and not s for d, s in zip(drawn, stream)):
            rngs = [r.rng(j) if d and not s else None for r, d, s in zip(reqs, drawn, stream) for j in range(steps)]
            e = sampler.exponentials(rngs, self.vocab_size, dev).view(len(reqs), steps, -1)
        else:
            e = self._no_noise(len(reqs), steps)
        w = sampler.stream_rows([r.generator if s else None for r, s in zip(reqs, stream)], [steps] * len(reqs),
                                steps, dev)
        out = self.runner.decode_steps(chunks, temperature, torch.tensor(drawn, device=dev), e,
                                       torch.tensor(stream, device=dev), w)
        if out is None:
            raise RuntimeError("multi-step decode: no graph for a step its bucket check admitted")
        if not all(map(math.isfinite, out.logits.flatten().tolist())):
            raise self._non_finite_logits()
        for b, (req, ids) in enumerate(zip(reqs, out.tokens.tolist())):
            # the cache holds the input token and all but the last new one; tokens past a stop are dropped
            self._guarded(req, self._commit, req, req.num_computed + steps, None,
                          None if out.states is None else out.states[b])
            req.metrics.num_target_forwards += steps
            if req.request_id in self.requests:
                self._guarded(req, self._append, req, ids)
        return True

    def _plain_steps(self, reqs: list[Request]) -> bool:
        """A step the controller runs without drafts, as multi-step decode where the engine has it
        (num_scheduler_steps with an adaptive size or disable_by_batch_size), timed for the
        controller. -> False when it must run one token (nothing done)."""
        ctl = self.spec_controller
        if self.runner.multi_step is None or not ctl.plain_steps_ready(len(reqs)):
            return False
        t0 = time.perf_counter()
        if not self._decode_steps(reqs):
            return False
        self._tell_controller(ctl.observe_rounds, len(reqs), self.runner.multi_step.steps, time.perf_counter() - t0,
                              size=0, committed={r.request_id: 0 for r in reqs})
        return True

    def _tell_controller(self, observe: Callable, *args, **kwargs) -> None:
        """Hand the speculation controller a step's measurements; a failure there only costs the
        choice of K (logged), never the batch."""
        try:
            observe(*args, **kwargs)
        except Exception:  # noqa: BLE001 - only the choice of K suffers
            log.exception("speculation controller update failed")

    def _spec_rounds(self, reqs: list[Request], ks: list[int]) -> bool:
        """Multi-step speculation (num_scheduler_steps with a draft model or EAGLE chains): when
        every request is greedy on the raw logits or samples with temperature only, without
        logprobs, and drafts the configured K, up to ``num_scheduler_steps`` rounds of draft,
        verify and accept run for each, one compiled graph per round fed the last one's outputs
        (model/compiled.py CompiledSpecRound, CompiledEagleRound; the drafter gives the first
        round's state and keeps the last one's; no more rounds than the cache has room for, or
        than the longest request has tokens left to make), and each round is accepted here by
        matching (verify/greedy.py) against the target's token at every row, which the graph
        picked: its argmax; for a seeded request the sampler's race winner under p with the noise
        of that output position, its drafts drawn with the same noise; for an unseeded one the
        accepted drafts and then rejection sampling's token (drawn with three uniforms per
        position from its generator; model/compiled.py CompiledSpecRound). The rounds' tokens
        are committed and appended in order at once (tokens past a stop are dropped), and each
        round that made a kept token counts as a verification. -> False when the step must run
        one round instead (nothing done)."""
        g = self.runner.round
        if any(k != g.k for k in ks) or not all((r.raw_argmax or r.temperature_only) and r.params.logprobs is None
                                                for r in reqs):
            return False
        cols = [r.num_computed for r in reqs]   # each newest token's column (not yet in the target's cache)
        if any(r.num_tokens != c + 1 for r, c in zip(reqs, cols)):
            return False
        drawn = [not r.params.greedy for r in reqs]
        rounds = min(self.config.num_scheduler_steps, self.runner.fits_spec_rounds(cols, any(drawn)),
                     max(map(_rounds_wanted, reqs)), rounds_under(self.spec_controller.max_model_len, cols, g.k))
        if rounds < 2:
            return False
        t0 = time.perf_counter()
        state = self.proposer.round_state(reqs, g.k)   # (after its catch-up) the first round's input
        if state is None:
            return False
        if self.fault_injector is not None:
            self.fault_injector(reqs)
        race = self._round_noise(reqs, drawn, rounds * (g.k + 1)) if any(drawn) else None
        out = self.runner.spec_rounds([r.row for r in reqs], state, cols, rounds, race)
        if not all(map(math.isfinite, out.top.flatten().tolist())):
            raise self._non_finite_logits()
        accepted = drafted = rejected = 0
        last = {}   # request -> the last round's tokens (what its drafter catches up on next)
        for req, drafts, target in zip(reqs, out.drafts.tolist(), out.target.tolist()):
            results = [greedy_accept(t, d, [g.k]) for d, t in zip(drafts, target)]
            last[req.request_id] = len(results[-1].output_ids[0])
            ids = [x for res in results for x in res.output_ids[0]]
            self._guarded(req, self._commit, req, req.num_computed + len(ids))
            before = len(req.output_ids)
            if req.request_id in self.requests:   # (one append: the text of all rounds' tokens at once)
                self._guarded(req, self._append, req, ids)
            kept = len(req.output_ids) - before   # up to a stop or max_tokens: later rounds are dropped
            for res in results:
                if kept <= 0:
                    break
                n = res.num_accepted[0]
                req.metrics.num_target_forwards += 1
                req.metrics.spec.record(g.k, n, g.k)
                self.spec_metrics.record(g.k, n, g.k)
                accepted, drafted, rejected = accepted + n, drafted + g.k, rejected + (n < g.k)
                kept -= n + 1
        for b, req in enumerate(reqs):
            if req.request_id in self.requests:
                self._guarded(req, self.proposer.after_rounds, req, tuple(x[b] for x in out.state))
        # (an adaptive K or "auto" tree size weighs the rounds by their measured time per round)
        self._tell_controller(self.spec_controller.observe_rounds, len(reqs), rounds, time.perf_counter() - t0,
                              accepted, drafted, rejected=rejected, committed=last)
        return True

    def _round_noise(self, reqs: list[Request], drawn: list[bool], n: int) -> RoundRace:
        """Sampled speculation rounds' randomness (runner ``spec_rounds``) for each request's next
        ``n`` output positions: a seeded request's race uniforms (its position noise: verified by
        matching, its output is the one without speculation), an unseeded one's three uniforms per
        position from its generator (verified by rejection sampling). The race's uniforms of
        rows that do not race are exp(-1) (unread), and None where none does; the graph takes their
        exponentials -log U."""
        P, V, dev = self.runner.sampled_round.positions, self.vocab_size, self.device
        reject = [d and r.seed_key is None for r, d in zip(reqs, drawn)]
        e = None   # (no row races: the graph's own buffer of unread exponentials)
        if not all(r == d for r, d in zip(reject, drawn)):
            races = [d and not x for d, x in zip(drawn, reject)]
            rngs = [r.rng(j) if c and j < n else None for r, c in zip(reqs, races) for j in range(P)]
            e = sampler.exponentials(rngs, V, dev).view(len(reqs), P, V)
        w = sampler.stream_rows([r.generator if x else None for r, x in zip(reqs, reject)], [3 * n] * len(reqs),
                                3 * P, dev).view(len(reqs), P, 3)
        return RoundRace(self._race_temperatures(reqs, drawn), torch.tensor(drawn, device=dev), e,
                         torch.tensor(reject, device=dev), w)

    def _race_temperatures(self, reqs: list[Request], drawn: list[bool]) -> torch.Tensor:
        """[len(reqs)] float32 temperatures of the graphs' races (1 for rows that do not draw)."""
        return torch.tensor([r.params.temperature if d else 1.0 for r, d in zip(reqs, drawn)],
                            dtype=torch.float32, device=self.device)

    def _no_noise(self, batch: int, steps: int) -> torch.Tensor:
        """[batch, steps, V] float64 exponentials of multi-steps where no row races (greedy and
        unseeded rows: ignored), a view of one buffer made at the first such step."""
        if self._ones is None:
            self._ones = torch.ones(self.config.max_num_seqs, steps, self.vocab_size, dtype=torch.float64,
                                    device=self.device)
        return self._ones[:batch]

    def _groups(self, reqs: list[Request]) -> list[tuple[Any, list[int]]]:
        """(proposer, indices into reqs) for each proposer that drafts for some of reqs."""
        if self.proposer is not None and all(r.prediction_ids is None for r in reqs):   # (the usual batch)
            return [(self.proposer, list(range(len(reqs))))] if reqs else []
        by: dict[int, tuple[Any, list[int]]] = {}
        for i, r in enumerate(reqs):
            p = self._proposer_of(r)
            if p is not None:
                by.setdefault(id(p), (p, []))[1].append(i)
        return list(by.values())

    def _guarded(self, req: Request, fn, *args) -> None:
        """Per-request bookkeeping after the batch's compute: a failure ends this request only."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            if req.request_id in self.requests:
                self._fail(req, exc)
            else:
                log.exception("request %s: bookkeeping failed after it finished", req.request_id)

    def accept(self, reqs: list[Request], logits: torch.Tensor, drafts: DraftBatch,
               top: tuple[torch.Tensor, torch.Tensor] | None = None) -> AcceptanceResult:
        """Verify (``verify``), then the log-probabilities of every output token of the requests
        that ask for them: from the target's row of that token (the verify forward's, for
        accepted drafts), per the engine's logprobs_mode (sampling/logprobs.py)."""
        result = self.verify(reqs, logits, drafts, top)
        if any(r.params.logprobs is not None for r in reqs):
            result.logprobs = self._output_logprobs(reqs, logits, drafts, result)
        return result

    def _output_logprobs(self, reqs: list[Request], logits: torch.Tensor, drafts: DraftBatch,
                         result: AcceptanceResult) -> list[list[PositionLogprobs] | None]:
        o = drafts.offsets()
        idx, toks, ks, specs, owner = [], [], [], [], []
        for b, r in enumerate(reqs):
            if r.params.logprobs is None:
                continue
            base = o[b] + b                     # request b's root row (its drafts follow, spec_decode/draft.py)
            out = result.output_ids[b]
            idx += [base] + [base + 1 + j for j in result.accepted(b)]
            toks += out
            ks += [r.params.logprobs] * len(out)
            specs += [r.row_spec(out[:i]) for i in range(len(out))]
            owner += [b] * len(out)
        mode = self.config.logprobs_mode
        entries = lp.gather(lp.values(logits[idx], mode, specs), toks, ks)
        per: list[list[PositionLogprobs] | None] = [None] * len(reqs)
        for b, e in zip(owner, entries):
            if per[b] is None:
                per[b] = []
            per[b].append(self._position(e))
        return per

    def _prompt_logprobs(self, req: Request, logits: torch.Tensor, token_ids: list[int]) -> list[PositionLogprobs]:
        """logits [n, V]: the rows that predict prompt tokens ``token_ids`` (raw family of the mode)."""
        mode = "raw_logits" if self.config.logprobs_mode.endswith("logits") else "raw_logprobs"
        k = req.params.prompt_logprobs
        return [self._position(e) for e in lp.gather(lp.values(logits, mode), token_ids, [k] * len(token_ids))]

    def _position(self, e: "lp.TokenLogprobs") -> PositionLogprobs:
        """The chosen token first, then the top k (once each), with their text."""
        text = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        out = {e.token_id: Logprob(e.value, e.rank, text(e.token_id))}
        for rank, (t, v) in enumerate(e.top, 1):
            if t not in out:
                out[t] = Logprob(v, rank, text(t))
        return out

    def verify(self, reqs: list[Request], logits: torch.Tensor, drafts: DraftBatch,
               top: tuple[torch.Tensor, torch.Tensor] | None = None) -> AcceptanceResult:
        """Verify drafts with the target's logits [T + B, V] (row layout: spec_decode/draft.py);
        ``top``: ``logits.max(-1)`` when the compiled graph computed it (runner StepOutput.top).

        Greedy and seeded requests are verified by matching (verify/greedy.py, verify/tree.py):
        the target's own token at every row (argmax, or the seeded draw keyed by position) is
        computed, and drafts are accepted while they equal it. Unseeded sampled requests use
        lossless rejection sampling (verify/rejection.py; recursive rejection sampling over
        sibling drafts for trees, verify/tree.py). All kinds mix in one batch, chains and trees."""
        if self.fault_injector is not None:
            self.fault_injector(reqs)
        tree = drafts.is_tree
        draft_lists = drafts.lists()
        parent_lists = drafts.parent_lists()

        def match(target: list[int], sub: DraftBatch, sub_parents: list[int]) -> AcceptanceResult:
            if tree:
                return tree_match_accept(target, sub.token_ids.tolist(), sub_parents, sub.num_draft)
            return greedy_accept(target, sub.token_ids.tolist(), sub.num_draft)

        def checked(values: torch.Tensor, target: torch.Tensor) -> list[int]:
            # max propagates NaN and +inf, so checking the chosen logits finds any non-finite row
            # (isfinite over the whole [N, V] cost 70 us per step here)
            if not all(map(math.isfinite, values.tolist())):
                raise self._non_finite_logits()
            return target.tolist()

        flat_parents = [p for ps in parent_lists for p in ps]
        if all(r.raw_argmax for r in reqs):   # nothing processes the logits: no sampler rows to build
            return match(checked(*(top if top is not None else row_max(logits))), drafts, flat_parents)
        if (self._native_verify and not tree and logits.dtype == torch.float32   # (_native_verify: CPU logits)
                and (drafts.draft_probs is None or drafts.draft_probs.dtype != torch.float64)   # (no float64 q)
                and all(r.unseeded_sampled and r.temperature_only for r in reqs) and load_native_verify()):
            # (a chat's batch: rejection sampling of chains, or plain decode's draws, as one C++ call,
            # bitwise this Python path)
            return self._verify_chains_natively(reqs, logits, drafts, draft_lists)
        row_depth = [d for ps in parent_lists for d in (0, *depths(ps))]   # per target row
        if all(r.raw_argmax or r.temperature_only for r in reqs):   # only temperatures: no sampler rows
            p = sampler.temperature_probs(logits, [None if r.params.greedy else r.params.temperature
                                                   for r, d in zip(reqs, draft_lists) for _ in range(len(d) + 1)])
        else:
            specs = []
            for r, d, ps in zip(reqs, draft_lists, parent_lists):
                specs.append(r.row_spec())
                specs += [r.row_spec([d[i] for i in path_to(ps, j)] if tree else d[:j + 1]) for j in range(len(d))]
            rows = sampler.build_rows(specs, self.vocab_size)
            if rows.all_greedy:
                target = sampler.greedy_tokens(logits, rows)
                return match(checked(logits.gather(1, target[:, None]).flatten(), target), drafts, flat_parents)
            p = sampler.probs(logits, rows)  # [T + B, V]
        B = len(reqs)
        o = drafts.offsets()  # request b's drafts are o[b]..o[b+1]-1; its target rows o[b]+b..o[b+1]+b

        def rows_of(bs: list[int]) -> list[int]:
            return [i for b in bs for i in range(o[b] + b, o[b + 1] + b + 1)]

        def p_of(bs: list[int]) -> torch.Tensor:
            return p if len(bs) == B else p[rows_of(bs)]

        matched = [b for b in range(B) if reqs[b].params.greedy or reqs[b].seed_key is not None]
        other = [b for b in range(B) if not (reqs[b].params.greedy or reqs[b].seed_key is not None)]
        num_accepted, outputs, nodes = [0] * B, [[] for _ in range(B)], [[] for _ in range(B)]
        if matched:
            sub = drafts.select(matched)
            sub_parents = [q for b in matched for q in parent_lists[b]]
            rngs = [reqs[b].rng(row_depth[i]) for b in matched for i in rows_of([b])]
            p_m = p_of(matched)
            if self._native_verify and p_m.dtype == torch.float32 and load_native_verify():
                # (one C++ call racing only the rows the match reads: the rows past a mismatch
                # are never raced; the Python race over every row took about 9 ms for a batch
                # of 16 seeded chains of 5, the op 0.4-0.5)
                target = race_match(p_m, sampler.noise_keys(rngs),
                                    sub.token_ids, torch.tensor(sub_parents, dtype=torch.long), sub.num_draft)
            else:
                target = sampler.sample(p_m, rngs).tolist()
            res = match(target, sub, sub_parents)
            for i, b in enumerate(matched):
                num_accepted[b], outputs[b], nodes[b] = res.num_accepted[i], res.output_ids[i], res.accepted(i)
        if other and not any(drafts.num_draft[b] for b in other):   # nothing to verify: draw from p
            final = sampler.sample(p_of(other), [reqs[b].generator for b in other]).tolist()
            for j, b in enumerate(other):
                outputs[b] = [final[j]]
        elif other:
            sub = drafts.select(other)
            u = torch.cat([sampler.uniforms(drafts.num_draft[b], reqs[b].generator, p.device) for b in other])
            if tree:
                outcome = tree_rejection_accept(p_of(other), sub.draft_probs, sub.token_ids,
                                                [q for b in other for q in parent_lists[b]], sub.num_draft, u)
                paths = outcome.accepted_nodes
            else:
                outcome = rejection_accept(p_of(other), sub.draft_probs, sub.token_ids, sub.num_draft, u)
                paths = [list(range(n)) for n in outcome.num_accepted]
            final = sampler.sample(outcome.final_probs, [reqs[b].generator for b in other]).tolist()
            for j, b in enumerate(other):
                num_accepted[b], nodes[b] = len(paths[j]), paths[j]
                outputs[b] = [draft_lists[b][i] for i in paths[j]] + [final[j]]
        return AcceptanceResult(num_accepted, outputs, list(drafts.num_draft), nodes if tree else [])

    def _verify_chains_natively(self, reqs: list[Request], logits: torch.Tensor, drafts: DraftBatch,
                       draft_lists: list[list[int]]) -> AcceptanceResult:
        """``verify`` of chains of unseeded temperature-only requests by spec_decode/verify/native.py's
        op, with the uniforms the Python path draws from each request's generator, in its order
        (the acceptance tests', then the final draws')."""
        temps = [r.params.temperature for r, d in zip(reqs, draft_lists) for _ in range(len(d) + 1)]
        states = [r.generator.get_state() for r in reqs]
        try:
            u = (torch.cat([sampler.uniforms(n, r.generator) for r, n in zip(reqs, drafts.num_draft)])
                 if drafts.total else torch.empty(0))   # (plain decode: no acceptance tests)
            w = sampler.stream_uniforms([r.generator for r in reqs])
            draw = chain_rejection(logits, torch.tensor(temps, dtype=torch.float32), drafts.draft_probs,
                                   drafts.token_ids, list(drafts.num_draft), u, w)
            if draw is None:   # a row of p is not finite
                sampler.temperature_probs(logits, temps)   # raises, naming the rows
                raise FloatingPointError("non-finite probabilities (non-finite logits?)")
        except BaseException:
            # the Python path raises before it draws: the streams go back to where they were, so a
            # batch's retry (request by request) draws what it would have
            for r, s in zip(reqs, states):
                r.generator.set_state(s)
            raise
        outputs = [d[:n] + [x] for d, n, x in zip(draft_lists, draw.num_accepted, draw.tokens)]
        return AcceptanceResult(draw.num_accepted, outputs, list(drafts.num_draft), [])

    # ------------------------------------------------------------------ bookkeeping
    def _commit(self, req: Request, length: int, tree_path: list[int] | None = None,
                states: torch.Tensor | None = None) -> None:
        """The request's cache now holds ``length`` tokens. After a tree verification the
        accepted nodes' columns (draft j was written at column num_computed + 1 + j) move to
        follow the root. ``states`` [n, F]: the target's states of the committed tokens from
        column num_computed on, for proposers that read them (EAGLE)."""
        c = req.num_computed
        if tree_path:
            self.runner.move_cols(req.row, [c + 1 + j for j in tree_path],
                                  list(range(c + 1, c + 1 + len(tree_path))))
        if states is not None and self._proposer_of(req) is self.proposer:
            self.proposer.on_target_states(req, c, states)
        req.num_computed = length
        self.kv.set_length(req.row, length)

    def _append(self, req: Request, token_ids: list[int], logprobs: list[PositionLogprobs] | None = None) -> None:
        """Append verified tokens (and their logprobs) one by one, ending at the first stop (the
        rest are dropped). Without stop strings the text of the step's tokens is decoded at once
        (Detokenizer.add_many: two tokenizer calls per step, not per token)."""
        p = req.params
        m, now = req.metrics, time.monotonic()
        if m.last_token_time is not None:
            self.iteration.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        detok = req.detok
        at_once = detok is not None and not detok.stop
        text_ids: list[int] = []   # (at_once) the tokens whose text is due
        for i, t in enumerate(token_ids):
            req.output_ids.append(t)
            self.iteration.num_generation_tokens += 1
            if logprobs is not None:
                if req.output_logprobs is None:
                    req.output_logprobs = []
                req.output_logprobs.append(logprobs[i])
                req.cumulative_logprob += logprobs[i][t].logprob
            req.metrics.num_generated_tokens += 1
            n = len(req.output_ids)
            if req.grammar is not None and t not in req.stop_set:
                req.grammar.advance(t)
            if t in req.stop_set:  # never sampled before min_tokens: the sampler suppresses them
                if p.include_stop_str_in_output and detok is not None:
                    # its text (vLLM; none for special tokens when skipped)
                    text_ids.append(t) if at_once else detok.add(t, check_stop=False)
                req.finish_reason = "stop"
                req.stop_reason = t if t in (p.stop_token_ids or ()) else None
            elif at_once:
                text_ids.append(t)
            elif detok is not None:
                matched = detok.add(t, check_stop=n > p.min_tokens)   # (as vLLM: from token min_tokens + 1)
                if matched is not None:
                    req.finish_reason, req.stop_reason = "stop", matched
            if req.finish_reason is None and req.grammar is not None and req.grammar.finished:
                req.finish_reason = "stop"   # the grammar admits nothing more (the rest of a step is dropped)
            if req.finish_reason is None and (n >= req.max_tokens or req.num_tokens >= self.max_model_len):
                req.finish_reason = "length"
            if req.finish_reason is not None:
                break
        if text_ids:
            detok.add_many(text_ids)
        if req.finish_reason is not None:
            self._finish(req)

    def _finish(self, req: Request) -> RequestOutput:
        req.metrics.finished_time = time.monotonic()
        proposer = self._proposer_of(req)
        if proposer is not None:
            try:
                proposer.finish(req)
            except Exception:  # noqa: BLE001 - the request ends anyway; its row is freed below
                log.exception("proposer.finish failed for request %s", req.request_id)
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, [req.completion()],
                             req.finish_reason is not None, req.metrics, error=req.error,
                             prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs))

    def get_metrics(self) -> dict:
        return self.spec_metrics.to_dict()


#: SamplingParams' fields that hold lists (or a dict), copied by ``LLMEngine.prepare``
_LIST_FIELDS = ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "prediction")


def rounds_under(limit: int, cols: list[int], k: int) -> int:
    """How many rounds of k drafts keep every draft at a position under ``limit`` (the speculative
    max_model_len) for sequences whose newest tokens sit at ``cols``: a round advances a sequence
    at most k + 1 columns, its drafts k columns past its newest token."""
    return max(0, (limit - max(cols)) // (k + 1))


def _rounds_wanted(req: Request) -> int:
    """Speculation rounds a request is expected to need to reach its max_tokens, at the tokens per
    round it has had so far (at least one each): rounds past its end would be computed and dropped."""
    if req.params.max_tokens is None:
        return 1 << 30
    m = req.metrics.spec
    per_round = 1 + m.num_accepted_tokens / m.num_drafts if m.num_drafts else 1.0
    return max(1, math.ceil((req.params.max_tokens - len(req.output_ids)) / per_round))
