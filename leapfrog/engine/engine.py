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

import random
import time
from typing import Any

import torch

from leapfrog.config import EngineConfig
from leapfrog.engine.detokenizer import Detokenizer
from leapfrog.engine.request import Request
from leapfrog.errors import RequestError
from leapfrog.kv.manager import KVManager
from leapfrog.model.loader import load_model, load_tokenizer, read_checkpoint, resolve_dtype
from leapfrog.model.runner import ModelRunner, SeqChunk
from leapfrog.outputs import RequestOutput, SpecMetrics
from leapfrog.sampling import sampler
from leapfrog.sampling_params import SamplingParams
from leapfrog.scheduler.scheduler import Scheduler
from leapfrog.spec.draft import DraftBatch
from leapfrog.spec.verify.greedy import greedy_accept
from leapfrog.spec.verify.rejection import rejection_accept
from leapfrog.spec.verify.result import AcceptanceResult


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        ckpt = read_checkpoint(config.model)
        self.checkpoint = ckpt
        self.dtype = resolve_dtype(config.dtype, ckpt, self.device)
        self.max_model_len = config.max_model_len or min(ckpt.args.max_position_embeddings, 4096)
        self.model = load_model(ckpt, self.dtype, self.device, self.max_model_len, config.allow_pickle,
                                pack=True)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or ckpt.path)
        self.eos_ids = ckpt.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer is not None and self.tokenizer.eos_token_id is not None
            else ())
        self.vocab_size = ckpt.args.vocab_size
        self.kv = KVManager(config.max_num_seqs, self.max_model_len)
        self.runner = ModelRunner(self.model, config.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._seed_rng = random.Random(config.seed)
        self.spec_metrics = SpecMetrics()
        self.proposer: Any = None
        self.spec_controller: Any = None
        if config.speculative_config is not None:
            from leapfrog.spec.setup import build_speculation
            self.proposer, self.spec_controller = build_speculation(config.speculative_config, self)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int] | None,
                    params: SamplingParams, index: int = 0,
                    num_speculative_tokens: int | None = None) -> Request:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        if prompt_ids is None:
            if prompt is None:
                raise RequestError("a request needs a prompt string or prompt_token_ids")
            if self.tokenizer is None:
                raise RequestError("text prompts need a tokenizer (skip_tokenizer_init=True was set)")
            prompt_ids = self.tokenizer.encode(prompt)
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                               "(the prompt plus at least one new token must fit)")
        room = self.max_model_len - len(prompt_ids)
        if params.max_tokens is not None:
            self.kv.check_fits(len(prompt_ids) + params.max_tokens)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        gen = torch.Generator().manual_seed(seed + index if params.seed is not None else seed)
        detok = None
        if self.tokenizer is not None:
            detok = Detokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop_strings,
                                params.include_stop_str_in_output)
        req = Request(request_id, prompt, prompt_ids, params, gen, detok, self.eos_ids,
                      max_tokens=min(params.max_tokens or room, room), index=index,
                      num_speculative_tokens=num_speculative_tokens)
        req.metrics.num_prompt_tokens = len(prompt_ids)
        self.requests[request_id] = req
        self.scheduler.add(req)
        if self.proposer is not None:
            self.proposer.start(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.finish_reason = "abort"
        return self._finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        updated: list[Request] = []
        if sched.prefill:
            updated += self._prefill(sched.prefill)
        if sched.decode:
            self._decode(sched.decode)
            updated += sched.decode
        return [self._output(r) for r in updated]

    def _prefill(self, work: list[tuple[Request, int]]) -> list[Request]:
        chunks, done = [], []
        for req, n in work:
            last = req.num_computed + n == len(req.prompt_ids)
            ids = req.prompt_ids[req.num_computed:req.num_computed + n]
            chunks.append(SeqChunk(req.row, req.num_computed, ids, 1 if last else 0))
            if last:
                done.append(req)
        logits = self.runner.run(chunks)
        for req, n in work:
            self._commit(req, req.num_computed + n)
        if done:
            result = self.accept(done, logits, DraftBatch.empty(len(done)))
            for req, ids in zip(done, result.output_ids):
                req.metrics.first_token_time = time.monotonic()
                self._append(req, ids)
        return done

    def _decode(self, reqs: list[Request]) -> None:
        drafts = DraftBatch.empty(len(reqs))
        t0 = time.perf_counter()
        if self.proposer is not None:
            ks = self.spec_controller.choose(reqs)
            if any(ks):
                drafts = self.proposer.propose(reqs, ks)
        t_draft = time.perf_counter() - t0
        draft_lists = drafts.lists()
        chunks = [SeqChunk(r.row, r.num_computed, [r.output_ids[-1]] + d, len(d) + 1)
                  for r, d in zip(reqs, draft_lists)]
        t1 = time.perf_counter()
        logits = self.runner.run(chunks)
        result = self.accept(reqs, logits, drafts)
        t_verify = time.perf_counter() - t1
        for req, n_draft, n_acc in zip(reqs, drafts.num_draft, result.num_accepted):
            self._commit(req, req.num_computed + 1 + n_acc)   # rollback of rejected = not advancing
            req.metrics.num_target_forwards += 1
            req.metrics.spec.record(n_draft, n_acc)
            self.spec_metrics.record(n_draft, n_acc)
        if self.proposer is not None:
            self.proposer.on_verified(reqs, drafts, result)
            self.spec_controller.observe(reqs, drafts, result, t_draft, t_verify)
        for req, ids in zip(reqs, result.output_ids):
            self._append(req, ids)

    def accept(self, reqs: list[Request], logits: torch.Tensor, drafts: DraftBatch) -> AcceptanceResult:
        """Verify drafts with the target's logits [T + B, V] (row layout: spec/verify/rejection.py)."""
        draft_lists = drafts.lists()
        specs = [r.row_spec(d[:j]) for r, d in zip(reqs, draft_lists) for j in range(len(d) + 1)]
        rows = sampler.build_rows(specs, self.vocab_size)
        flat_drafts = drafts.token_ids.tolist()
        if rows.all_greedy:
            return greedy_accept(sampler.greedy_tokens(logits, rows).tolist(), flat_drafts, drafts.num_draft)
        p = sampler.probs(logits, rows)  # [T + B, V]
        u = torch.cat([sampler.uniforms(len(d), r.generator) if not r.params.greedy
                       else torch.zeros(len(d)) for r, d in zip(reqs, draft_lists)]) if drafts.total else \
            torch.empty(0)
        outcome = rejection_accept(p, drafts.draft_probs, drafts.token_ids, drafts.num_draft, u)
        final = sampler.sample(outcome.final_probs, [r.generator for r in reqs]).tolist()
        outputs = [d[:n] + [f] for d, n, f in zip(draft_lists, outcome.num_accepted, final)]
        return AcceptanceResult(outcome.num_accepted, outputs, list(drafts.num_draft))

    # ------------------------------------------------------------------ bookkeeping
    def _commit(self, req: Request, length: int) -> None:
        req.num_computed = length
        self.kv.set_length(req.row, length)

    def _append(self, req: Request, token_ids: list[int]) -> None:
        """Append verified tokens one by one, ending at the first stop (the rest are dropped)."""
        p = req.params
        for t in token_ids:
            req.output_ids.append(t)
            req.metrics.num_generated_tokens += 1
            n = len(req.output_ids)
            if t in req.stop_ids:  # never sampled before min_tokens: the sampler suppresses them
                req.finish_reason = "stop"
                req.stop_reason = t if t in (p.stop_token_ids or ()) else None
            elif req.detok is not None:
                matched = req.detok.add(t, check_stop=n >= p.min_tokens)
                if matched is not None:
                    req.finish_reason, req.stop_reason = "stop", matched
            if req.finish_reason is None and (n >= req.max_tokens or req.num_tokens >= self.max_model_len):
                req.finish_reason = "length"
            if req.finish_reason is not None:
                self._finish(req)
                return

    def _finish(self, req: Request) -> RequestOutput:
        req.metrics.finished_time = time.monotonic()
        if self.proposer is not None:
            self.proposer.finish(req)
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, [req.completion()],
                             req.finish_reason is not None, req.metrics)

    def get_metrics(self) -> dict:
        return self.spec_metrics.to_dict()
