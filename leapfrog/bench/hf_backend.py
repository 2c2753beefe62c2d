"""The peer backend of ``leapfrog bench --backend transformers``: Hugging Face ``generate`` on the
same checkpoints, dtype and thread count, shaped like ``LLM.generate`` so the runner interleaves it
with leapfrog's contenders.

leapfrog config -> transformers counterpart:
  * none          -> ``generate`` (greedy or sampling)
  * draft_model K -> assisted generation, ``assistant_model`` = the same draft,
                     ``num_assistant_tokens=K`` with the ``"constant"`` schedule (same K as ours)
  * ngram K       -> prompt lookup decoding, ``prompt_lookup_num_tokens=K``,
                     ``max_matching_ngram_size`` = our ``prompt_lookup_max``
Each prompt runs alone (transformers' assisted generation takes batch size 1), so at batch
sizes > 1 these contenders are sequential; compare them at batch size 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from leapfrog.outputs import CompletionOutput, RequestMetrics, RequestOutput
from leapfrog.sampling_params import SamplingParams

HF_PREFIX = "hf-"


@dataclass(frozen=True)
class HFMode:
    kind: str                    # "plain" | "assisted" | "prompt_lookup"
    k: int = 0
    draft: str | None = None
    ngram_max: int = 0


def hf_mode_for(spec: dict | None) -> HFMode | None:
    """transformers' counterpart of a leapfrog speculative config (None: it has none)."""
    if spec is None:
        return HFMode("plain")
    k = int(spec.get("num_speculative_tokens", 0))
    if spec.get("method") == "draft_model" and spec.get("model"):
        return HFMode("assisted", k, str(spec["model"]))
    if spec.get("method") == "ngram":
        return HFMode("prompt_lookup", k, ngram_max=int(spec.get("prompt_lookup_max") or 5))
    return None


def hf_name(leapfrog_name: str, mode: HFMode) -> str:
    if mode.kind == "plain":
        return HF_PREFIX + "none"
    return f"{HF_PREFIX}{mode.kind}-k{mode.k}" + leapfrog_name.split(f"-k{mode.k}", 1)[-1]


class HFGenerator:
    """transformers ``generate`` behind ``generate(prompts, sampling_params, use_tqdm)``."""

    def __init__(self, model: str, mode: HFMode, dtype: torch.dtype, device: torch.device,
                 eos_token_ids: tuple[int, ...]) -> None:
        import transformers as tf

        from leapfrog.model.loader import resolve_model_path
        self.mode = mode
        self.device = device
        self.model = tf.AutoModelForCausalLM.from_pretrained(str(resolve_model_path(model)), dtype=dtype)
        self.model.to(device).eval()
        self.assistant = None
        if mode.kind == "assisted":
            self.assistant = tf.AutoModelForCausalLM.from_pretrained(str(resolve_model_path(mode.draft)),
                                                                     dtype=dtype).to(device).eval()
        self.eos = list(eos_token_ids)

    def _kwargs(self, sp: SamplingParams) -> dict:
        kw: dict = dict(max_new_tokens=sp.max_tokens, eos_token_id=None if sp.ignore_eos else self.eos,
                        pad_token_id=self.eos[0] if self.eos else 0)
        if sp.temperature > 0:
            kw.update(do_sample=True, temperature=sp.temperature, top_k=sp.top_k if sp.top_k > 0 else 0,
                      top_p=sp.top_p)
            if sp.min_p > 0:
                kw["min_p"] = sp.min_p
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if self.mode.kind == "assisted":
            self.assistant.generation_config.num_assistant_tokens = self.mode.k
            self.assistant.generation_config.num_assistant_tokens_schedule = "constant"
            kw["assistant_model"] = self.assistant
        elif self.mode.kind == "prompt_lookup":
            kw.update(prompt_lookup_num_tokens=self.mode.k, max_matching_ngram_size=self.mode.ngram_max)
        return kw

    @torch.inference_mode()
    def generate(self, prompts: list[dict], sampling_params: SamplingParams,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        kw = self._kwargs(sampling_params)
        outs = []
        for i, p in enumerate(prompts):
            ids = list(p["prompt_token_ids"])
            x = torch.tensor([ids], device=self.device)
            t0 = time.time()
            y = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
            t1 = time.time()
            gen = y[0, len(ids):].tolist()
            reason = "stop" if gen and gen[-1] in self.eos and not sampling_params.ignore_eos else "length"
            m = RequestMetrics(arrival_time=t0, finished_time=t1, num_prompt_tokens=len(ids),
                               num_generated_tokens=len(gen))
            outs.append(RequestOutput(f"hf-{i}", p.get("prompt"), ids, [CompletionOutput(0, "", gen, reason)],
                                      True, m))
        return outs
