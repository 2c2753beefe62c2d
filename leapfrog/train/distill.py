"""Draft distillation (``leapfrog train-draft``): a small Llama trained to match the target.

Loss per token: KL(p || q) over the whole vocabulary, p = the target's next-token
distribution, q = the draft's (the quantity speculative sampling's acceptance depends on:
acceptance = 1 - TV(p, q) and TV is bounded by sqrt(KL / 2)), optionally plus
``ce_weight`` x cross-entropy on the data's own next tokens.

Training data, ``data_mode``:
  * ``"corpus"``: windows of the user's text; the target labels every position with p.
  * ``"generate"``: prompts cut from each document (``gen_prompts_per_doc`` of them, at evenly
    spaced lines); the target's own continuations (from the engine at ``gen_temperature``; 0 =
    greedy; several temperatures: a mix, sharing the prompts evenly) are the text, so
    the draft learns what the target says, not what the corpus says (self-distillation), on the
    states it will meet at inference.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from leapfrog.errors import CheckpointError, ConfigError
from leapfrog.train.corpus import (Document, fingerprint, heldout_or_training, pack_stream, read_documents,
                                   split_by_file)
from leapfrog.train.loop import (CHECKPOINT_NAME, TrainConfig, TrainingDiverged, TrainState, check_finite,
                                 plot_losses, settings_diff, train)


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4

    def __post_init__(self) -> None:
        if min(asdict(self).values()) < 1:
            raise ConfigError(f"draft shape values must be >= 1: {asdict(self)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by "
                              f"num_attention_heads {self.num_attention_heads}")
        if (self.hidden_size // self.num_attention_heads) % 2:   # the engine's RoPE rotates pairs
            raise ConfigError(f"head size hidden_size / num_attention_heads = "
                              f"{self.hidden_size // self.num_attention_heads} must be even")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")


@dataclass
class DraftResult:
    path: Path
    draft_parameters: int
    target_parameters: int
    train_tokens: int
    state: TrainState
    heldout_kl_before: float
    heldout_kl_after: float
    acceptance: dict | None = None     # draft_acceptance() at temperature 0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "state"}
        d["path"] = str(self.path)
        d["steps"] = self.state.step
        d["final_train_loss"] = self.state.losses[-1][1] if self.state.losses else None
        return d


def kl_per_token(q_logits: Tensor, p_logits: Tensor) -> Tensor:
    """KL(p || q) for each position: [..., V] logits -> [...] (nats)."""
    logp = F.log_softmax(p_logits.float(), dim=-1)
    logq = F.log_softmax(q_logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def distill_loss(teacher, ce_weight: float):
    def loss_fn(student, batch: Tensor) -> Tensor:
        with torch.no_grad():
            p_logits = teacher(input_ids=batch).logits          # [B, S, V]
        q_logits = student(input_ids=batch).logits              # [B, S, V]
        loss = kl_per_token(q_logits, p_logits).mean()
        if ce_weight:
            loss = loss + ce_weight * F.cross_entropy(q_logits[:, :-1].flatten(0, 1).float(),
                                                      batch[:, 1:].flatten())
        return loss
    return loss_fn


def heldout_windows(stream: Tensor, n: int, seq_len: int) -> Tensor:
    """Up to ``n`` evenly spaced windows of ``stream`` ([T]) -> [n', seq_len]."""
    if stream.numel() <= seq_len:
        return stream[None, :]
    step = max(seq_len, (stream.numel() - seq_len) // n)
    return torch.stack([stream[i:i + seq_len] for i in range(0, stream.numel() - seq_len + 1, step)][:n])


def line_windows(doc: Document, n: int, lines_per_window: int = 40) -> list[str]:
    """``n`` pieces of ``doc`` starting at evenly spaced line starts (a prompt from each)."""
    lines = doc.text.splitlines(keepends=True)
    out = []
    for j in range(n):
        start = len(lines) * j // n
        text = "".join(lines[start:start + lines_per_window])
        if text.strip():
            out.append(text)
    return out


def heldout_prompts(tokenizer, docs: list[Document], n: int, prompt_tokens: int = 32) -> list[str]:
    """Prompts from held-out documents: ``prompt_tokens`` tokens at the start of a line, spread over files."""
    prompts = []
    for i in range(n):
        d = docs[i % len(docs)]
        lines = d.text.splitlines(keepends=True)
        start = (len(lines) * (1 + 2 * (i // len(docs)))) // (2 * (1 + n // len(docs)) + 1)
        text = "".join(lines[start:start + 40]) or d.text
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_tokens]
        if ids:
            prompts.append(tokenizer.decode(ids))
    return prompts


def resolve_autocast(flag: str, device: torch.device) -> bool:
    if flag in ("on", "off"):
        return flag == "on"
    if device.type == "cuda":
        return True
    from leapfrog.model.packed import can_pack  # native bf16 on this CPU
    return can_pack(torch.bfloat16, device)


def generation_temperatures(temperatures: float | Sequence[float]) -> list[float]:
    """``gen_temperature`` (one number or several) as a checked list."""
    ts = [float(temperatures)] if isinstance(temperatures, (int, float)) else [float(t) for t in temperatures]
    if not ts or any(not math.isfinite(t) or t < 0 for t in ts):
        raise ConfigError(f"gen_temperature must be one or more finite numbers >= 0, got {temperatures!r}")
    return ts


def generation_params(temperatures: float | Sequence[float], n: int, max_tokens: int, seed: int) -> list:
    """SamplingParams of ``n`` prompts continued for training data. Several temperatures share the
    prompts evenly (prompt i gets ``temperatures[perm[i] % len]``, perm a permutation seeded by
    ``seed``, so the share does not follow a prompt's place in its file); each prompt has its own
    seed (seed x 1_000_003 + i: a seeded request's noise depends on its seed and position only, so
    one seed for all would draw every continuation with the same noise)."""
    from leapfrog import SamplingParams
    ts = generation_temperatures(temperatures)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist() if len(ts) > 1 else [0] * n
    return [SamplingParams(temperature=ts[perm[i] % len(ts)], max_tokens=max_tokens, seed=seed * 1_000_003 + i)
            for i in range(n)]


def _generate_stream(target_path: str, tokenizer, docs: list[Document], gen_tokens: int,
                     gen_temperature: float | Sequence[float], seed: int, prompt_tokens: int,
                     prompts_per_doc: int) -> Tensor:
    from leapfrog import LLM
    prompts = [{"prompt_token_ids": tokenizer(w, add_special_tokens=False)["input_ids"][:prompt_tokens]}
               for d in docs for w in line_windows(d, prompts_per_doc)]
    prompts = [p for p in prompts if p["prompt_token_ids"]]
    from leapfrog.model.loader import read_checkpoint
    context = read_checkpoint(target_path).args.max_position_embeddings
    llm = LLM(model=target_path, dtype="float32", seed=seed, max_model_len=min(prompt_tokens + gen_tokens + 8, context))
    outs = llm.generate(prompts, generation_params(gen_temperature, len(prompts), gen_tokens, seed))
    sep = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids: list[int] = []
    for p, o in zip(prompts, outs):
        ids += p["prompt_token_ids"] + list(o.outputs[0].token_ids) + sep
    return torch.tensor(ids, dtype=torch.long)


def check_target(target: str | os.PathLike, init_draft: str | os.PathLike | None = None,
                 require_tokenizer: bool = True):
    """Check, before any data is built or any step trained, what the engine will check after training
    (when it measures acceptance and when the draft is used): the target's config.json and
    generation_config.json with the engine's architecture check, every weight present, readable
    and of the right shape (safetensors headers only: quick), its tokenizer present (unless not
    ``require_tokenizer``: EAGLE heads train on token ids too), loadable and inside the vocabulary;
    an ``init_draft`` the same way, speaking the target's tokens.
    Returns (target Checkpoint, its tokenizer or None)."""
    from leapfrog.model.loader import (
        TOKENIZER_FILES,
        check_weights,
        load_tokenizer,
        read_checkpoint,
        tokenizer_files,
    )
    from leapfrog.spec_decode.proposers.draft_model import check_compatible

    ckpt = read_checkpoint(target)
    check_weights(ckpt)
    tokenizer = None
    if tokenizer_files(ckpt.path):
        tokenizer = load_tokenizer(ckpt.path)
        if len(tokenizer) > ckpt.args.vocab_size:
            raise CheckpointError(
                f"{ckpt.path}: the tokenizer has {len(tokenizer)} tokens but config.json vocab_size is "
                f"{ckpt.args.vocab_size}: they do not belong together")
    elif require_tokenizer:
        raise CheckpointError(
            f"{ckpt.path}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); train-draft "
            "tokenizes the corpus with the target's tokenizer and saves it with the draft: put the "
            "target's tokenizer files (tokenizer.json, tokenizer_config.json, ...) in this directory")
    if init_draft is not None:
        draft = read_checkpoint(init_draft)
        check_weights(draft)
        draft_tok = load_tokenizer(draft.path) if tokenizer_files(draft.path) else None
        check_compatible(tokenizer, draft_tok, ckpt.args.vocab_size, draft.args.vocab_size, f"--init-draft {init_draft}")
    return ckpt, tokenizer


RESUME_NAME = "distill_settings.json"   # beside loop.py's train_state.pt


def _check_resume(ckdir: Path, settings: dict) -> None:
    """draft_model training resumes the checkpoint in ``ckdir``, if there is one, only when it was
    made with these settings (the same target, draft shape, corpus contents and schedule but for
    --steps, which may grow); the settings are written beside it for the next run."""
    f = ckdir / RESUME_NAME
    if (ckdir / CHECKPOINT_NAME).is_file() and f.is_file():   # (a checkpoint of an older version has none)
        try:
            saved = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{f}: unreadable ({e}); remove {ckdir} to start again") from None
        if diff := settings_diff(saved, settings):
            raise ConfigError(f"{ckdir} holds a training checkpoint made with other settings (they differ in "
                              f"{diff}); remove it, or pass another --checkpoint-dir, to start again")
    ckdir.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(settings, indent=1))


def train_draft(target: str | os.PathLike, corpus: str | os.PathLike | list[Document], out: str | os.PathLike,
                *, shape: DraftShape | None = None, init_draft: str | os.PathLike | None = None,
                train_config: TrainConfig | None = None, data_mode: str = "corpus", ce_weight: float = 0.0,
                heldout_fraction: float = 0.05, gen_tokens: int = 128,
                gen_temperature: float | Sequence[float] = 1.0,
                gen_prompt_tokens: int = 32, gen_prompts_per_doc: int = 1, eval_prompts: int = 16, eval_k: int = 4, eval_max_tokens: int = 64,
                save_dtype: str = "float32", bf16: str = "auto", checkpoint_dir: str | os.PathLike | None = None,
                stop_at: int | None = None, split_seed: int = 0, max_shard_size: str | None = None) -> DraftResult:
    """Distil ``target`` (an HF checkpoint dir or hub id) into a draft saved at ``out`` as an HF
    directory that ``speculative_config={"method": "draft_model", "model": out}`` loads."""
    import transformers as tf

    from leapfrog.config import resolve_device
    from leapfrog.model.loader import resolve_model_path
    from leapfrog.train.evaluate import draft_acceptance, mean_kl

    cfg = train_config or TrainConfig()
    if data_mode not in ("corpus", "generate"):
        raise ConfigError(f"data_mode must be 'corpus' or 'generate', got {data_mode!r}")
    if save_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"save_dtype must be float32 or bfloat16, got {save_dtype!r}")
    out = Path(out)
    device = resolve_device(cfg.device)
    cfg.device = str(device)
    cfg.autocast_bf16 = resolve_autocast(bf16, device)
    # Fail in the first second, not after training: the target (and init draft), then the corpus.
    ckpt, tokenizer = check_target(target, init_draft)
    temperatures = generation_temperatures(gen_temperature) if data_mode == "generate" else None
    target_path = str(ckpt.path)
    docs = read_documents(corpus) if not isinstance(corpus, list) else corpus
    train_docs, held = split_by_file(docs, heldout_fraction, split_seed)
    held = heldout_or_training(train_docs, held)
    if data_mode == "generate":
        stream = _generate_stream(target_path, tokenizer, train_docs, gen_tokens, temperatures,
                                  cfg.seed, gen_prompt_tokens, gen_prompts_per_doc)
    else:
        stream = pack_stream(tokenizer, train_docs)
    held_stream = pack_stream(tokenizer, held)
    V = ckpt.args.vocab_size
    if any(x.numel() and int(x.max()) >= V for x in (stream, held_stream)):
        raise ConfigError(f"the corpus has token ids >= the target's vocab_size {V}")
    if stream.numel() <= cfg.seq_len:
        raise ConfigError(f"the corpus gives {stream.numel()} training tokens; need more than "
                          f"seq_len={cfg.seq_len} (pass more text or a smaller --seq-len)")

    teacher = tf.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).to(device).eval()
    teacher.requires_grad_(False)
    tcfg = teacher.config
    if init_draft is not None:
        draft = tf.AutoModelForCausalLM.from_pretrained(str(resolve_model_path(init_draft)), dtype=torch.float32)
    else:
        shape = shape or DraftShape()
        torch.manual_seed(cfg.seed)
        dcfg = tf.LlamaConfig(
            vocab_size=tcfg.vocab_size, bos_token_id=tcfg.bos_token_id, eos_token_id=tcfg.eos_token_id,
            max_position_embeddings=tcfg.max_position_embeddings,
            rope_theta=getattr(tcfg, "rope_theta", None) or 10000.0, tie_word_embeddings=True, **asdict(shape))
        draft = tf.LlamaForCausalLM(dcfg)
    draft.to(device)
    val = heldout_windows(held_stream, 8, min(cfg.seq_len, 256)).to(device)
    kl_before = mean_kl(draft, teacher, val)
    ckdir = Path(checkpoint_dir) if checkpoint_dir is not None else out.with_name(out.name + ".ckpt")
    _check_resume(ckdir, {"target": target_path, "init_draft": str(init_draft) if init_draft else None,
                          "shape": asdict(shape) if init_draft is None and shape else None, "data_mode": data_mode,
                          "ce_weight": ce_weight, "corpus": fingerprint(train_docs + held),
                          # sampled data only: greedy data is what it was before this key existed
                          **({"generation": [gen_tokens, temperatures, gen_prompt_tokens, gen_prompts_per_doc]}
                             if temperatures is not None and any(temperatures) else {}),
                          "train_config": {k: v for k, v in asdict(cfg).items()
                                           if k not in ("steps", "checkpoint_every", "eval_every")}})
    state = train(draft, stream, distill_loss(teacher, ce_weight), cfg, checkpoint_dir=ckdir,
                  eval_fn=lambda m: mean_kl(m, teacher, val), desc="train-draft", stop_at=stop_at)
    kl_after = mean_kl(draft, teacher, val)
    check_finite(draft, "train-draft")
    if not math.isfinite(kl_after):
        raise TrainingDiverged(f"train-draft: held-out KL is {kl_after} after training; nothing saved (lower --lr)")

    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    draft.to(getattr(torch, save_dtype)).save_pretrained(out, safe_serialization=True, **kwargs)
    draft.to(torch.float32)
    tokenizer.save_pretrained(out)
    plot_losses(state, out / "training_loss.png", "train-draft: KL(p_target || q_draft) (nats/token)",
                eval_label="held-out KL")
    result = DraftResult(path=out, draft_parameters=sum(p.numel() for p in draft.parameters()),
                         target_parameters=sum(p.numel() for p in teacher.parameters()),
                         train_tokens=state.tokens_seen, state=state,
                         heldout_kl_before=kl_before, heldout_kl_after=kl_after)
    if eval_prompts > 0:
        prompts = heldout_prompts(tokenizer, held, eval_prompts)
        result.acceptance = draft_acceptance(target_path, str(out), prompts, k=eval_k, max_tokens=eval_max_tokens)
    (out / "train_draft.json").write_text(json.dumps(
        {**result.summary(), "train_config": asdict(cfg), "data_mode": data_mode, "ce_weight": ce_weight,
         "target": str(target), "heldout_files": [d.name for d in held],
         "loss_history": state.losses, "eval_history": state.evals}, indent=1, default=str))
    return result
