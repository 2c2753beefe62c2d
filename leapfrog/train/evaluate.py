"""Held-out measurements for trained models: bits per byte and draft acceptance."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leapfrog.train.corpus import Document


@torch.no_grad()
def bits_per_byte(model: nn.Module, tokenizer, docs: list[Document], seq_len: int = 256,
                  max_bytes: int = 400_000, device: str = "cpu") -> float:
    """Cross-entropy of ``model`` (an HF causal LM) on ``docs`` in bits per UTF-8 byte.

    Each document (up to ``max_bytes`` in total, documents taken in order) is cut into windows
    of ``seq_len`` tokens scored independently; the first token of each window is not scored
    and its bytes are not counted."""
    model.eval()
    nats, nbytes, used = 0.0, 0, 0
    for d in docs:
        if used >= max_bytes:
            break
        text = d.text[: max_bytes - used]
        used += len(text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids) - 1, seq_len):
            window = ids[s:s + seq_len]
            if len(window) < 2:
                continue
            x = torch.tensor([window], device=device)
            logits = model(input_ids=x).logits.float()[0, :-1]
            nats += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            nbytes += len(tokenizer.decode(window[1:]).encode("utf-8"))
    return nats / math.log(2) / max(1, nbytes)


@torch.no_grad()
def mean_kl(student: nn.Module, teacher: nn.Module, windows: Tensor) -> float:
    """Mean KL(p_teacher || q_student) per token over ``windows`` ([N, S] token ids)."""
    from leapfrog.train.distill import kl_per_token
    student.eval()
    teacher.eval()
    tot = 0.0
    for row in windows.split(4):
        tot += kl_per_token(student(input_ids=row).logits, teacher(input_ids=row).logits).sum().item()
    return tot / windows.numel()


def draft_acceptance(target: str, draft: str, prompts: list[str], k: int = 4, max_tokens: int = 64,
                     max_model_len: int | None = None) -> dict:
    """Greedy (temperature 0) draft_model speculation with K = ``k`` over ``prompts``:
    acceptance rate and mean acceptance length (counting the bonus token), vLLM's definitions."""
    from leapfrog import LLM, SamplingParams
    llm = LLM(model=target, dtype="float32", max_model_len=max_model_len, max_num_seqs=1,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": k})
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    m = llm.get_metrics()
    return {"k": k, "acceptance_rate": m["acceptance_rate"], "mean_acceptance_length": m["mean_acceptance_length"],
            "num_drafts": m["num_drafts"], "prompts": len(prompts), "max_tokens": max_tokens}
