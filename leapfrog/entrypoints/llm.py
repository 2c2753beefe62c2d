"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
import os
from typing import Any, Sequence

from leapfrog.progress import progress_bar

from leapfrog.config import EngineConfig
from leapfrog.engine.engine import LLMEngine
from leapfrog.entrypoints.openai.protocol import check_messages, template_messages
from leapfrog.errors import ConfigError, EngineError, NotShareable, RequestError
from leapfrog.outputs import RequestOutput
from leapfrog.request import Prepared
from leapfrog.sampling_params import SamplingParams

PromptType = str | dict[str, Any]
#: speculative_config not given: the built-in model's default speculation where model is None
#: (an explicit None turns speculation off, as in vLLM)
_BUILT_IN_SPEC: Any = type("_BuiltInSpec", (), {"__repr__": lambda self: "<the built-in default>"})()


class LLM:
    """An offline engine.

    Args:
        model: a local Hugging Face directory or a hub id; None = the built-in demo model (with
            its default speculation unless speculative_config is given; None: no speculation).
        tokenizer: tokenizer directory or hub id (default: the model's).
        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
        seed: seeds requests that carry no seed of their own.
        speculative_config: vLLM-style dict, e.g. {"method": "ngram", "num_speculative_tokens": 4}.
        batch_invariant: every token's logits bitwise independent of the batch (greedy output
            with speculation equals without, any batch equals alone, in bf16 too; slower).
        enforce_eager: False compiles the decode/verify forwards of the target and of a draft
            model at start-up (the fast path; see EngineConfig.enforce_eager).
        quantization: "int8" or "int4": weight-only quantization of the target's decoder
            layers at load (model/quant.py); speculation is lossless relative to it.
        logprobs_mode: what SamplingParams.logprobs reports: "raw_logprobs" (default),
            "raw_logits", "processed_logprobs" or "processed_logits" (vLLM's names).
        tensor_parallel_size: shard the target over N processes (spawned on this machine, or
            the torchrun group); see EngineConfig.tensor_parallel_size. ``close()`` stops them.
        load_format: "auto" (the checkpoint's files) or "dummy" (random weights from config.json
            alone, to measure a model shape; vLLM's name).
        num_scheduler_steps: decode steps per engine step, run as one compiled graph, or with a
            draft model or EAGLE chains that many speculation rounds (needs enforce_eager=False;
            vLLM's multi-step scheduling; see EngineConfig).
        share_target_with: another LLM whose loaded target model this one runs on (the same
            tensors, no second copy in memory): engines that differ only in speculation or
            scheduling limits, e.g. settings compared side by side in one process (``leapfrog
            bench --share-target``). The checkpoint, dtype, device, quantization, load_format,
            enforce_eager and batch_invariant must be the other's, neither may use tensor
            parallelism, max_model_len may not be longer than the other's, and a target that
            streams its weights beside a drafter is not shared (ConfigError otherwise;
            LLMEngine's check_shareable); each LLM keeps its own KV cache, drafter and requests.
        share_kv_cache: with share_target_with, run on the other LLM's KV cache too (the same
            max_num_seqs and max_model_len, else ConfigError): the two then run one at a time,
            and one that steps while the other has unfinished requests raises CacheBusy. For
            settings compared side by side (``leapfrog bench``): identical engines with caches of
            their own measured up to 3-4 % apart, as their pages landed.
        max_model_len, max_num_seqs, max_num_batched_tokens, device, allow_pickle,
        skip_tokenizer_init: see EngineConfig.
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 seed: int = 0, speculative_config: dict[str, Any] | None = _BUILT_IN_SPEC, *,
                 max_model_len: int | None = None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 2048, device: str = "auto", allow_pickle: bool = False,
                 skip_tokenizer_init: bool = False, batch_invariant: bool = False,
                 enforce_eager: bool = True, quantization: str | None = None,
                 logprobs_mode: str = "raw_logprobs", tensor_parallel_size: int = 1,
                 load_format: str = "auto", num_scheduler_steps: int = 1,
                 share_target_with: "LLM | None" = None, share_kv_cache: bool = False) -> None:
        if model is None:
            from leapfrog.demo import default_model
            model, default_spec = default_model(dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
                                                str(device))
            speculative_config = default_spec if speculative_config is _BUILT_IN_SPEC else speculative_config
        elif speculative_config is _BUILT_IN_SPEC:
            speculative_config = None
        if speculative_config is not None and not isinstance(speculative_config, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(speculative_config).__name__}")
        self.config = EngineConfig(
            model=os.fspath(model) if isinstance(model, os.PathLike) else model, tokenizer=tokenizer,
            dtype=dtype, device=device, seed=seed,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, allow_pickle=allow_pickle,
            skip_tokenizer_init=skip_tokenizer_init, speculative_config=speculative_config,
            batch_invariant=batch_invariant, enforce_eager=enforce_eager, quantization=quantization,
            logprobs_mode=logprobs_mode, tensor_parallel_size=tensor_parallel_size, load_format=load_format,
            num_scheduler_steps=num_scheduler_steps)
        if share_target_with is not None and not isinstance(share_target_with, LLM):
            raise ConfigError(f"share_target_with must be an LLM, got {type(share_target_with).__name__}")
        self.engine = LLMEngine(self.config, None if share_target_with is None else share_target_with.engine,
                                share_kv_cache=share_kv_cache)
        self._ids = itertools.count()

    @classmethod
    def sharing_if_possible(cls, owner: "LLM", share_kv_cache: bool = False, **kw) -> "tuple[LLM, str | None]":
        """``LLM(share_target_with=owner, share_kv_cache=share_kv_cache, **kw)`` where that engine
        may share ``owner``'s loaded target, else ``LLM(**kw)`` with its own copy (and cache) ->
        (the LLM, why it could not share or None). Sharing is refused (NotShareable) e.g. beside a
        drafter where the target is larger than the last-level cache and streams its weights (on
        CPUs whose linear-kernel build streams: AVX-512): benchmarks and checks that only want to
        save memory take the copy, and say so."""
        refused = None
        try:
            return cls(share_target_with=owner, share_kv_cache=share_kv_cache, **kw), None
        except NotShareable as e:
            refused = str(e)
        return cls(**kw), refused   # (out of the except: the refused engine is freed before the copy loads)

    def close(self) -> None:
        """Release what outlives the object: tensor-parallel worker processes and the process group."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict:
        """Speculation counters over the engine's lifetime (vLLM definitions)."""
        return self.engine.get_metrics()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for each prompt, in order. A prompt is a string or a dict with
        "prompt_token_ids" (and optionally "prompt")."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, dict):
            raise RequestError("sampling_params must be a SamplingParams (or a list of them), got a dict: "
                               "use SamplingParams(**fields)")
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ConfigError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        bad = [type(sp).__name__ for sp in params if not isinstance(sp, SamplingParams)]
        if bad:
            raise RequestError(f"sampling_params must be SamplingParams objects, got a {bad[0]}")
        # checked again as they are now (n = 0 set after construction is a ConfigError, not an
        # IndexError below) and against the model, once per distinct object: a list repeating
        # one SamplingParams with 400k stop ids is checked once, not once per prompt and choice
        prepared: dict[int, Prepared] = {}
        for sp in params:
            if id(sp) not in prepared:
                prepared[id(sp)] = self.engine.prepare(sp)
        groups: list[list[str]] = []
        added: list[str] = []
        try:
            for prompt, sp in zip(prompts, params):
                text, ids = _split_prompt(prompt)
                rid = str(next(self._ids))
                group = []
                prep = prepared[id(sp)]
                n = prep.params.n
                for i in range(n):
                    sub = f"{rid}-{i}" if n > 1 else rid
                    self.engine.add_request(sub, text, ids, prep, index=i)
                    added.append(sub)
                    group.append(sub)
                groups.append(group)
        except Exception:
            for sub in added:
                self.engine.abort(sub)
            raise
        return self._run(groups, use_tqdm and len(prompts) > 1)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate.
        Messages are checked as the server checks them (``{"role", "content"}``, content a string
        or text parts; an unknown role or key such as ``name`` or ``tool_calls`` is a
        RequestError, not dropped)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise RequestError("chat() needs a tokenizer")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of messages or of conversations")
        one = isinstance(messages[0], dict)
        convs = [messages] if one else messages
        prompts = []
        for c, conv in enumerate(convs):
            try:
                checked = check_messages(conv)
            except ValueError as e:
                raise RequestError(str(e) if one else f"conversation {c}: {e}") from None
            if chat_template is None and not getattr(tok, "chat_template", None):
                raise RequestError("this tokenizer has no chat template; pass chat_template=...")
            try:
                ids = tok.apply_chat_template(template_messages(checked), chat_template=chat_template,
                                              tokenize=True, add_generation_prompt=add_generation_prompt)
            except Exception as e:  # noqa: BLE001 - a template error is the caller's input
                raise RequestError(f"could not apply the chat template: {type(e).__name__}: {e}") from None
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids),
                            "prompt": tok.decode(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, groups: list[list[str]], show: bool) -> list[RequestOutput]:
        """Step the engine until this call's requests finish. If one of them fails (finish_reason
        "error"), the others of this call are aborted and the error is raised (the request's own
        RequestError when it was at fault, else an EngineError): the engine is
        clean for the next call, and requests of other callers are untouched."""
        finished: dict[str, RequestOutput] = {}
        total = sum(len(g) for g in groups)
        mine = {s for g in groups for s in g}
        bar = progress_bar(total=len(groups), desc="Processed prompts", disable=not show)
        done_groups = 0
        try:
            while len(finished) < total:
                for out in self.engine.step(final_only=True):
                    if out.request_id not in mine:
                        continue
                    if out.outputs[0].finish_reason == "error":
                        if isinstance(out.error, RequestError):   # the request's fault (a grammar's limits)
                            raise out.error
                        raise EngineError(f"request {out.request_id} failed: {type(out.error).__name__}: "
                                          f"{out.error}") from out.error
                    if out.finished:
                        finished[out.request_id] = out
                now = sum(all(s in finished for s in g) for g in groups)
                bar.update(now - done_groups)
                done_groups = now
        except BaseException:
            for rid in mine - set(finished):
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        results = []
        for g in groups:
            first = finished[g[0]]
            outs = [finished[s].outputs[0] for s in g]
            rid = g[0].rsplit("-", 1)[0] if len(g) > 1 else g[0]
            results.append(RequestOutput(rid, first.prompt, first.prompt_token_ids, outs, True, first.metrics,
                                         prompt_logprobs=first.prompt_logprobs))
            if len(g) > 1:
                for s in g[1:]:   # the request's figures: every choice's tokens and drafts
                    m = finished[s].metrics
                    first.metrics.spec.merge(m.spec)
                    first.metrics.num_generated_tokens += m.num_generated_tokens
                    first.metrics.num_target_forwards += m.num_target_forwards
        return results


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        unknown = sorted(str(k) for k in prompt if k not in ("prompt", "prompt_token_ids"))
        if unknown:   # (multi_modal_data, ...: refused, never ignored)
            raise RequestError(f"prompt dict key(s) {unknown} are not supported; give 'prompt' and/or "
                               "'prompt_token_ids'")
        ids = prompt.get("prompt_token_ids")
        text = prompt.get("prompt")
        if ids is None and not isinstance(text, str):
            raise RequestError("a prompt dict needs 'prompt_token_ids' (list of ints) or 'prompt' (str)")
        if ids is not None and (not isinstance(ids, (list, tuple)) or
                                not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise RequestError("'prompt_token_ids' must be a list of integers")
        return text, None if ids is None else list(ids)
    raise RequestError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
