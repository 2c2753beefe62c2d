"""Train leapfrog's built-in demo model family from the Python standard library's source.

    python scripts/train_demo.py --work /tmp/demo-run [--stage all|tokenizer|target|draft|export]

Stages (each resumes from what ``--work`` already holds):
  1. corpus + tokenizer: every ``*.py`` of this Python's standard library, split train/held-out
     by file (a hash of the path and the seed); a byte-level BPE tokenizer trained on train files.
  2. target: a Llama trained from scratch on the train split (cross-entropy), checkpointed.
  3. draft: ``leapfrog train-draft`` (the same code path) distils the target into a small Llama.
  4. export: bf16 safetensors (16 MiB shards) + tokenizer + model card into the package
     (``leapfrog/assets/stdlib-demo/{target,draft}``), with held-out bits per byte and the
     draft's acceptance against the target measured on held-out files.
The configuration below is recorded verbatim in the model card; the run is deterministic given
the seed and the Python version whose standard library it reads.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from leapfrog.demo import build_tokenizer
from leapfrog.train.corpus import pack_stream, split_by_file, stdlib_documents
from leapfrog.train.distill import heldout_windows
from leapfrog.train.loop import TrainConfig, plot_losses, train

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "leapfrog" / "assets" / "stdlib-demo"

SEED = 0
HELDOUT_FRACTION = 0.02
VOCAB_SIZE = 8192
TARGET = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=8, max_position_embeddings=2048, rope_theta=10000.0,
              tie_word_embeddings=False)
TARGET_TRAIN = TrainConfig(steps=500, batch_size=16, seq_len=256, lr=1.5e-3, warmup_steps=30,
                           min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0, seed=SEED,
                           checkpoint_every=10, eval_every=50)
DRAFT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4)
DRAFT_TRAIN = TrainConfig(steps=300, batch_size=16, seq_len=256, lr=2e-3, warmup_steps=20,
                          min_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0, seed=SEED + 1,
                          checkpoint_every=10, eval_every=50)
# phase 2: self-distillation on the target's own greedy continuations (the states speculation meets)
DRAFT_SELF = dict(gen_tokens=96, gen_temperature=0.0, gen_prompt_tokens=32, gen_prompts_per_doc=2)
DRAFT_SELF_TRAIN = TrainConfig(steps=300, batch_size=16, seq_len=128, lr=1e-3, warmup_steps=10,
                               min_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0, seed=SEED + 2,
                               checkpoint_every=10, eval_every=50)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage_tokenizer(work: Path):
    from transformers import AutoTokenizer
    tok_dir = work / "tokenizer"
    docs = stdlib_documents()
    train_docs, held = split_by_file(docs, HELDOUT_FRACTION, SEED)
    if not (tok_dir / "tokenizer.json").is_file():
        log(f"corpus: {len(docs)} files, train {len(train_docs)}, held-out {len(held)}")
        tok = build_tokenizer("".join(d.text for d in train_docs), VOCAB_SIZE)
        tok.save_pretrained(tok_dir)
        (work / "split.json").write_text(json.dumps({"train": [d.name for d in train_docs],
                                                     "heldout": [d.name for d in held]}, indent=0))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    stream_file = work / "train_stream.pt"
    if not stream_file.is_file():
        torch.save({"train": pack_stream(tok, train_docs), "heldout": pack_stream(tok, held)}, stream_file)
    streams = torch.load(stream_file)
    log(f"tokens: train {streams['train'].numel():,}, held-out {streams['heldout'].numel():,}; "
        f"bytes train {sum(len(d.text.encode()) for d in train_docs):,}")
    return tok, train_docs, held, streams


def lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def stage_target(work: Path, tok, streams, stop_at: int | None):
    import transformers as tf
    out = work / "target"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(SEED)
    cfg = tf.LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         **TARGET)
    model = tf.LlamaForCausalLM(cfg)
    log(f"target: {sum(p.numel() for p in model.parameters()):,} parameters")
    val = heldout_windows(streams["heldout"], 16, 256)
    state = train(model, streams["train"], lm_loss, TARGET_TRAIN, checkpoint_dir=work / "target_ckpt",
                  eval_fn=lambda m: float(lm_loss(m, val)), desc="target", stop_at=stop_at)
    plot_losses(state, work / "target_loss.png", "demo target: cross-entropy (nats/token)")
    (work / "target_state.json").write_text(json.dumps(asdict(state)))
    if state.step < TARGET_TRAIN.steps:
        log(f"target stopped at step {state.step}/{TARGET_TRAIN.steps}; rerun to continue")
        sys.exit(0)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def stage_draft(work: Path, target: Path, docs):
    from leapfrog.train.distill import DraftShape, train_draft
    out = work / "draft"
    if (out / "train_draft.json").is_file():
        return out
    phase1 = work / "draft_corpus"
    if not (phase1 / "train_draft.json").is_file():
        res = train_draft(target, docs, phase1, shape=DraftShape(**DRAFT), train_config=DRAFT_TRAIN,
                          data_mode="corpus", heldout_fraction=HELDOUT_FRACTION, split_seed=SEED, eval_prompts=24,
                          eval_k=4, eval_max_tokens=64, checkpoint_dir=work / "draft_ckpt", bf16="off")
        log(f"draft phase 1 (corpus): {res.summary()}")
    res = train_draft(target, docs, out, init_draft=phase1, train_config=DRAFT_SELF_TRAIN, data_mode="generate",
                      heldout_fraction=HELDOUT_FRACTION, split_seed=SEED, eval_prompts=24, eval_k=4,
                      eval_max_tokens=64, checkpoint_dir=work / "draft_self_ckpt", bf16="off", **DRAFT_SELF)
    log(f"draft phase 2 (self-distillation): {res.summary()}")
    return out


def stage_export(work: Path, tok, held) -> None:
    """bf16 copies in the package, 16 MiB shards, with held-out bits per byte measured."""
    import transformers as tf

    from leapfrog.train.evaluate import bits_per_byte
    metrics = {}
    for name in ("target", "draft"):
        model = tf.AutoModelForCausalLM.from_pretrained(work / name, dtype=torch.float32)
        metrics[name] = {"parameters": sum(p.numel() for p in model.parameters()),
                         "heldout_bits_per_byte": bits_per_byte(model, tok, held, max_bytes=300_000),
                         "config": {k: model.config.to_dict()[k] for k in ("hidden_size", "intermediate_size",
                                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                    "vocab_size", "tie_word_embeddings")}}
        log(f"{name}: {metrics[name]}")
        dest = ASSETS / name
        if dest.exists():
            shutil.rmtree(dest)
        model.to(torch.bfloat16).save_pretrained(dest, safe_serialization=True, max_shard_size="16MB")
        tok.save_pretrained(dest)
    state = json.loads((work / "target_state.json").read_text())
    draft_log = json.loads((work / "draft" / "train_draft.json").read_text())
    phase1_log = json.loads((work / "draft_corpus" / "train_draft.json").read_text())
    shutil.copy(work / "target_loss.png", ASSETS / "target_loss.png")
    shutil.copy(work / "draft_corpus" / "training_loss.png", ASSETS / "draft_loss_phase1.png")
    shutil.copy(work / "draft" / "training_loss.png", ASSETS / "draft_loss.png")
    record = {
        "python": platform.python_version(), "torch": torch.__version__, "seed": SEED,
        "heldout_fraction": HELDOUT_FRACTION, "vocab_size": VOCAB_SIZE, "target_shape": TARGET,
        "target_train": asdict(TARGET_TRAIN), "draft_shape": DRAFT, "draft_train": asdict(DRAFT_TRAIN),
        "split": json.loads((work / "split.json").read_text()),
        "draft_self_distillation": DRAFT_SELF, "draft_self_train": asdict(DRAFT_SELF_TRAIN),
        "draft_phase1": {k: phase1_log[k] for k in ("steps", "train_tokens", "heldout_kl_before",
                                                     "heldout_kl_after", "acceptance")},
        "target_steps": state["step"], "target_tokens": state["tokens_seen"],
        "target_final_train_loss": state["losses"][-1][1], "target_heldout_loss_history": state["evals"],
        "draft_steps": draft_log["steps"], "draft_tokens": draft_log["train_tokens"],
        "draft_heldout_kl": [draft_log["heldout_kl_before"], draft_log["heldout_kl_after"]],
        "draft_acceptance_train_draft": draft_log["acceptance"], "metrics": metrics,
    }
    (ASSETS / "training_record.json").write_text(json.dumps(record, indent=1))
    log(f"exported to {ASSETS}")


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def stage_card(bench_summary: Path | None) -> None:
    """The model card (README.md in the model folder) from training_record.json and, when given,
    the summary of ``benchmarks/demo_bench.py``."""
    r = json.loads((ASSETS / "training_record.json").read_text())
    m = r["metrics"]
    b = json.loads(bench_summary.read_text()) if bench_summary and bench_summary.is_file() else None
    t_cfg, d_cfg = m["target"]["config"], m["draft"]["config"]
    lines = [
        "# leapfrog stdlib-demo: a target and a draft model trained on the Python standard library",
        "",
        "The built-in default model pair of leapfrog (`leapfrog generate` with no `--model`). Both are",
        "Llama-architecture causal LMs sharing one byte-level BPE tokenizer; the draft exists to be used",
        "with `speculative_config={\"method\": \"draft_model\", \"model\": <draft>}`. They are small demo",
        "models trained for minutes on a 2-core CPU: they write Python-looking code, not correct programs.",
        "",
        "## Data",
        "",
        f"The `*.py` files of the Python {r['python']} standard library (third-party `site-packages` excluded),",
        "whose source is under the **Python Software Foundation License** (PSF-2.0). Split by file:",
        f"{len(r['split']['train'])} training files, {len(r['split']['heldout'])} held-out files (a SHA-256 of "
        f"`seed:path` below {r['heldout_fraction']}; the held-out list is in `training_record.json`).",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (`tokenizers`), vocabulary {r['vocab_size']} including `<unk>`, `<s>`, `</s>`,",
        "trained on the training files only. Documents are separated by `</s>` in training.",
        "",
        "## Models",
        "",
        "| | parameters | hidden | layers | heads (kv) | FFN | tied embeddings | held-out bits/byte |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, c in (("target", t_cfg), ("draft", d_cfg)):
        lines.append(f"| {name} | {m[name]['parameters']:,} | {c['hidden_size']} | {c['num_hidden_layers']} | "
                     f"{c['num_attention_heads']} ({c['num_key_value_heads']}) | {c['intermediate_size']} | "
                     f"{c['tie_word_embeddings']} | {m[name]['heldout_bits_per_byte']:.3f} |")
    ratio = m["draft"]["parameters"] / m["target"]["parameters"]
    lines += [
        "",
        f"The draft has {ratio:.3f} of the target's parameters. Weights are stored in bf16 (safetensors,",
        "shards of at most 16 MB); leapfrog runs them in fp32 on CPUs without native bf16 (`dtype=\"auto\"`).",
        "",
        "## Training (`python scripts/train_demo.py --work DIR`, deterministic given its seed)",
        "",
        f"* Target: from scratch, cross-entropy, {r['target_steps']} steps x {r['target_train']['batch_size']} "
        f"windows of {r['target_train']['seq_len']} tokens = {r['target_tokens']:,} tokens; AdamW "
        f"(lr {r['target_train']['lr']}, warm-up {r['target_train']['warmup_steps']}, cosine to "
        f"{r['target_train']['min_lr_ratio']}x, weight decay {r['target_train']['weight_decay']}), fp32 on "
        f"CPU. Final training loss {r['target_final_train_loss']:.3f} nats/token; held-out loss by step: "
        + ", ".join(f"{s}: {v:.3f}" for s, v in r["target_heldout_loss_history"]) + ".",
        f"* Draft, phase 1: `leapfrog train-draft` from scratch, KL(p_target || q_draft) on the training "
        f"files' text, {r['draft_phase1']['steps']} steps = {r['draft_phase1']['train_tokens']:,} tokens, lr "
        f"{r['draft_train']['lr']}; held-out KL {r['draft_phase1']['heldout_kl_before']:.3f} -> "
        f"{r['draft_phase1']['heldout_kl_after']:.3f} nats/token; acceptance at K=4, temperature 0: "
        f"{r['draft_phase1']['acceptance']['acceptance_rate']:.3f}.",
        f"* Draft, phase 2: `train-draft --init-draft <phase 1> --data-mode generate`: the target's own greedy "
        f"continuations ({r['draft_self_distillation']['gen_tokens']} tokens after "
        f"{r['draft_self_distillation']['gen_prompts_per_doc']} prompts of "
        f"{r['draft_self_distillation']['gen_prompt_tokens']} tokens per training file), {r['draft_steps']} "
        f"steps = {r['draft_tokens']:,} tokens, lr {r['draft_self_train']['lr']}; held-out KL (on file text) "
        f"{r['draft_heldout_kl'][0]:.3f} -> {r['draft_heldout_kl'][1]:.3f} nats/token; acceptance "
        f"{r['draft_acceptance_train_draft']['acceptance_rate']:.3f}.",
        f"* Seed {r['seed']}, torch {r['torch']}; the full configuration is in `training_record.json`;",
        "  loss curves: `target_loss.png`, `draft_loss_phase1.png`, `draft_loss.png`.",
        "",
    ]
    if b:
        dm, ng = b["draft_model"], b["ngram"]
        lines += [
            "## Measured (`python benchmarks/demo_bench.py`)",
            "",
            f"{b['num_prompts']} prompts of held-out files ({b['max_tokens']} new tokens each), batch 1, "
            f"temperature 0, K = {b['k']}, {b['dtype']}, {b['threads']} threads, contenders interleaved:",
            "",
            "| | tokens/s | speedup (95% CI) | acceptance rate | mean acceptance length | output = no-spec |",
            "|---|---:|---:|---:|---:|---:|",
            f"| no speculation | {fmt(b['none_tokens_per_s'], '.1f')} | 1.00 | - | - | - |",
        ]
        for label, x in (("draft_model (this draft)", dm), ("ngram", ng)):
            lines.append(f"| {label} | {fmt(x['tokens_per_s'], '.1f')} | {fmt(x['speedup'], '.2f')} "
                         f"({fmt(x['speedup_ci_low'], '.2f')}-{fmt(x['speedup_ci_high'], '.2f')}) | "
                         f"{fmt(x['acceptance_rate'])} | {fmt(x['mean_acceptance_length'], '.2f')} | "
                         f"{fmt(x['equal_rate'], '.2f')} |")
        hf = b.get("transformers_tokens_per_s") or {}
        if hf:
            lines += ["", "transformers on the same checkpoints, dtype and threads (same run): "
                      + ", ".join(f"{k} {v:.1f} tokens/s" for k, v in hf.items()) + "; leapfrog / transformers: "
                      + ", ".join(f"{k.split(' vs ')[1]} / {k.split(' vs ')[0]} {v:.2f}x"
                                  for k, v in b["transformers"].items()) + "."]
        lines += ["", "Measured on a 2-vCPU AMD EPYC VM (AVX2, no native bf16); absolute rates drift on such",
                  "machines, the ratios come from interleaved runs.", ""]
    (ASSETS / "README.md").write_text("\n".join(lines))
    log(f"wrote {ASSETS / 'README.md'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--stage", default="all", choices=["all", "tokenizer", "target", "draft", "export", "card"])
    ap.add_argument("--bench-summary", type=Path, default=None,
                    help="demo_summary.json of benchmarks/demo_bench.py, for the model card")
    ap.add_argument("--stop-at", type=int, default=None, help="end the target stage early at this step")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stage == "card":
        stage_card(args.bench_summary)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    log(f"python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    tok, train_docs, held, streams = stage_tokenizer(args.work)
    if args.stage == "tokenizer":
        return
    target = stage_target(args.work, tok, streams, args.stop_at)
    if args.stage == "target":
        return
    if args.stage in ("all", "draft"):
        stage_draft(args.work, target, train_docs + held)
    if args.stage in ("all", "export"):
        stage_export(args.work, tok, held)
        stage_card(args.bench_summary)


if __name__ == "__main__":
    main()
