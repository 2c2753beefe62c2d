"""Train the built-in demo target's EAGLE-3 head (``leapfrog/assets/stdlib-demo/eagle3``).

    python scripts/train_eagle_demo.py --work /tmp/eagle-run [--stage all|train|export]
    python scripts/train_eagle_demo.py --work /tmp/eagle-run --phase 2     # then
    python scripts/train_eagle_demo.py --work /tmp/eagle-run --phase 3     # then
    python scripts/train_eagle_demo.py --work /tmp/eagle-run --phase 4     # then: the shipped head

  1. data: the split of scripts/train_demo.py (the standard library's ``*.py`` by file, seed 0,
     2 % held out; checked against the demo's training_record.json), and the target's own greedy
     continuations of prompts cut from the training files, as the demo draft's phase 2 was trained;
  2. train: ``leapfrog.train.eagle.train_eagle`` (the code path of ``leapfrog train-draft --method
     eagle3``), checkpointed in ``--work``: a rerun resumes;
  3. export: bf16 config.json + model.safetensors + training_loss.png into the package, with
     training_record.json: the configuration, the run's figures, and held-out acceptance at
     temperature 0 (the dynamic tree and a chain), beside the demo draft and n-gram lookup measured
     on the same prompts.

Phase 2 fine-tunes phase 1's head (``init_head``: its draft vocabulary and shape kept) on a mix
of the target's continuations, greedy and sampled (2/5 at temperature 0, 2/5 at 0.7, 1/5 at 1.0),
with 6 unrolled steps instead of 4: phase 1 saw only greedy text, so sampled requests met contexts
it never trained on (stop 73: KL(p || q) on T = 0.7 continuations 0.14 against 0.06 on greedy
ones). Its record keeps phase 1's under "phase1", and phase 1's loss curve as
training_loss_phase1.png.

Phase 3 (``--phase 3``) fine-tunes phase 2's head with phase 2's recipe on new continuations (7
prompts per file: apart from each file's first, cut at other places than phase 2's 5) at a lower
learning rate and another batch order; its record keeps phases 1 and 2 under "phase1" and
"phase2", with both earlier curves.

Phase 4 (``--phase 4``, the shipped head) fine-tunes phase 3's head on new continuations again (8
prompts per file: apart from each file's first and middle, cut at other places than phases 1-3's
6, 5 and 7), with 7 unrolled steps instead of 6 (the built-in chain drafts 7 levels where the
target runs on the AVX-512 BF16 kernel: its last level had never been trained), 300 steps at a
lower learning rate and another batch order; its record keeps phases 1-3 under "phase1".."phase3".

The configuration below is recorded verbatim; the run is deterministic given the seed (on the same
CPU type, torch version and Python standard library).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from leapfrog.train.corpus import split_by_file, stdlib_documents
from leapfrog.train.eagle import EagleData, EagleEval, EagleRecipe, eagle_acceptance, train_eagle
from leapfrog.train.loop import TrainConfig

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "leapfrog" / "assets" / "stdlib-demo"
OUT = DEMO / "eagle3"

SEED = 0
HELDOUT_FRACTION = 0.02          # scripts/train_demo.py's split
DATA = EagleData(mode="generate", heldout_fraction=HELDOUT_FRACTION, split_seed=SEED, gen_tokens=128,
                 gen_temperature=0.0, gen_prompt_tokens=32, gen_prompts_per_doc=6, gen_max_num_seqs=64)
RECIPE = EagleRecipe(ttt_steps=4, step_decay=0.8, draft_vocab_size=4096, intermediate_size=704,
                     num_key_value_heads=2)
# batch_size counts samples (prompt + continuation, about 160 tokens each, trained from position 0);
# 800 steps = about 45 minutes of training on 2 AVX-512 cores
TRAIN = TrainConfig(steps=800, batch_size=24, seq_len=256, lr=4e-3, warmup_steps=30, min_lr_ratio=0.05,
                    weight_decay=0.0, grad_clip=1.0, seed=SEED, checkpoint_every=10, eval_every=40,
                    autocast_bf16=True)
#: phase 2 (module docstring): 5 prompts per file, shared evenly among the temperatures at random
DATA2 = replace(DATA, gen_temperature=(0.0, 0.7, 0.0, 0.7, 1.0), gen_prompts_per_doc=5)
RECIPE2 = EagleRecipe(ttt_steps=6, step_decay=0.8)
# 400 steps = about 31 minutes on 2 AVX-512 cores (6 unrolled steps cost 1.4x phase 1's 4)
TRAIN2 = replace(TRAIN, steps=400, lr=1.5e-3, warmup_steps=10, eval_every=50)
#: phase 3 (module docstring): phase 2's recipe on new continuations (7 prompts per file: apart
#: from each file's first, cut at other places than phase 2's 5), a lower learning rate and another
#: batch order
DATA3 = replace(DATA2, gen_prompts_per_doc=7)
TRAIN3 = replace(TRAIN2, lr=1e-3, seed=1)
#: phase 4 (module docstring): new continuations (8 prompts per file), 7 unrolled steps
DATA4 = replace(DATA2, gen_prompts_per_doc=8)
RECIPE4 = replace(RECIPE2, ttt_steps=7)
TRAIN4 = replace(TRAIN2, steps=300, lr=7e-4, seed=2)


@dataclass(frozen=True)
class Phase:
    train: TrainConfig
    recipe: EagleRecipe
    data: EagleData
    head: str      # the head's output folder in --work
    ckpt: str      # its checkpoint folder in --work
    init: int | None = None   # the phase whose head this one fine-tunes (None: from the target)


PHASES = {1: Phase(TRAIN, RECIPE, DATA, "eagle3", "ckpt"),
          2: Phase(TRAIN2, RECIPE2, DATA2, "eagle3-phase2", "ckpt-phase2", init=1),
          3: Phase(TRAIN3, RECIPE2, DATA3, "eagle3-phase3", "ckpt-phase3", init=2),
          4: Phase(TRAIN4, RECIPE4, DATA4, "eagle3-phase4", "ckpt-phase4", init=3)}
#: the acceptance test: held-out prompts (distill.heldout_prompts: 32 tokens at a line start of each
#: held-out file), temperature 0, fp32, 128 new tokens; (depth, eagle_topk, num_draft_tokens)
EVAL = EagleEval(prompts=36, max_tokens=128, trees=((5, 4, 16), (5, 1, None)), dtype="float32")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def split_check(held_names: list[str]) -> None:
    """The held-out files must be the demo's (the head is measured on text neither model saw)."""
    record = json.loads((DEMO / "training_record.json").read_text())
    if sorted(held_names) != sorted(record["split"]["heldout"]):
        raise SystemExit("this Python's standard library splits differently from the demo's training run "
                         f"(python {record['python']}); the held-out files would not be the demo's")


def baselines(target: str, prompts: list[str]) -> dict:
    """The demo draft (K = 4) and n-gram lookup (K = 4) on the same prompts, temperature 0, fp32."""
    from leapfrog import LLM, SamplingParams
    out = {}
    for name, spec in (("draft_model_k4", {"method": "draft_model", "model": str(DEMO / "draft"),
                                           "num_speculative_tokens": 4}),
                       ("ngram_k4", {"method": "ngram", "num_speculative_tokens": 4})):
        llm = LLM(model=target, dtype=EVAL.dtype, max_num_seqs=1, speculative_config=spec)
        res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=EVAL.max_tokens), use_tqdm=False)
        m = llm.get_metrics()
        out[name] = {"speculative_config": spec, "acceptance_rate": m["acceptance_rate"],
                     "mean_acceptance_length": m["mean_acceptance_length"], "num_drafts": m["num_drafts"],
                     "accepted_per_depth": [x / max(1, m["num_drafts"]) for x in m["num_accepted_tokens_per_pos"]],
                     "token_ids": [list(o.outputs[0].token_ids) for o in res]}
    return out


def stage_train(work: Path, steps: int | None, stop_at: int | None, phase: int = 1):
    docs = stdlib_documents()
    train_docs, held = split_by_file(docs, HELDOUT_FRACTION, SEED)
    split_check([d.name for d in held])
    log(f"corpus: {len(docs)} files, train {len(train_docs)}, held-out {len(held)}")
    ph = PHASES[phase]
    cfg = replace(ph.train, steps=steps or ph.train.steps)
    out, ckdir = work / ph.head, work / ph.ckpt
    init = None
    if ph.init is not None:
        init = work / PHASES[ph.init].head
        if not (init / "model.safetensors").is_file():
            raise SystemExit(f"phase {phase} fine-tunes phase {ph.init}'s head: run phase {ph.init} first "
                             f"(or copy its head to {init})")
    t0 = time.perf_counter()
    res = train_eagle(DEMO / "target", docs, out, "eagle3", recipe=ph.recipe, train_config=cfg, data=ph.data,
                      evaluation=EagleEval(prompts=0), save_dtype="bfloat16", bf16="on",
                      checkpoint_dir=ckdir, resume=True, stop_at=stop_at, init_head=init,
                      log=lambda m: log(f"train-draft: {m}"))
    total = time.perf_counter() - t0
    log(f"trained {res.state.step}/{cfg.steps} steps, {res.train_tokens:,} tokens: data {res.data_time_s:.0f}s, "
        f"training {res.wall_time_s:.0f}s (this run {total:.0f}s); held-out {res.heldout_before} -> "
        f"{res.heldout_after}; calibration {res.calibration}")
    summary = {**res.summary(), "history": res.history, "loss_history": res.state.losses, "steps_planned": cfg.steps}
    (work / f"summary-phase{phase}.json").write_text(json.dumps(summary, indent=1, default=str))
    return res, held


def shipped_record() -> dict:
    """The shipped head's training_record.json."""
    return json.loads((OUT / "training_record.json").read_text())


def check_order(phase: int, record: dict | None = None) -> int:
    """Phase ``phase`` exports after the previous one (or again): -> the shipped head's phase (phase 1
    replaces whatever is shipped, or nothing). ``record``: the shipped record, when already read."""
    if phase == 1:
        return 1
    shipped = (shipped_record() if record is None else record).get("phase", 1)
    if shipped not in (phase - 1, phase):
        raise SystemExit(f"the shipped head is phase {shipped}'s: export phases in order (phase {phase - 1} first)")
    return shipped


def earlier_records(work: Path, phase: int) -> dict[int, dict]:
    """The records of the phases before ``phase`` (each without the records nested in it), from the
    shipped head's record: the previous phase's own (its head is what this phase fine-tuned) or,
    exporting ``phase`` again, the ones it kept; their loss curves are copied into ``work`` as
    training_loss_phaseK.png."""
    if phase == 1:
        return {}
    old = shipped_record()
    shipped = check_order(phase, old)
    out = {}
    for k in range(1, phase):
        rec = old if k == shipped else old.get(f"phase{k}")
        if rec is None:
            raise SystemExit(f"the shipped head's record keeps no phase {k} record")
        out[k] = {key: v for key, v in rec.items() if key != "heldout_files" and not re.fullmatch(r"phase\d+", key)}
        curve = OUT / ("training_loss.png" if k == shipped else f"training_loss_phase{k}.png")
        shutil.copy(curve, work / f"training_loss_phase{k}.png")
    return out


def stage_export(work: Path, held, phase: int = 1) -> None:
    from leapfrog.model.loader import load_tokenizer
    from leapfrog.train.distill import heldout_prompts
    s = json.loads((work / f"summary-phase{phase}.json").read_text())
    ph = PHASES[phase]
    head_dir = work / ph.head
    ck = json.loads((work / ph.ckpt / "eagle_meta.json").read_text())
    if s["steps"] != s["steps_planned"]:
        raise SystemExit(f"training stopped at step {s['steps']}/{s['steps_planned']}; rerun to finish it")
    target = str(DEMO / "target")
    prompts = heldout_prompts(load_tokenizer(target), held, EVAL.prompts)
    t0 = time.perf_counter()
    acc = eagle_acceptance(target, str(head_dir), "eagle3", prompts, EVAL.trees, EVAL.max_tokens, EVAL.dtype)
    base = baselines(target, prompts)
    same = all(a["token_ids"] == base["ngram_k4"]["token_ids"] for a in [*acc, base["draft_model_k4"]])
    for a in [*acc, *base.values()]:
        a.pop("token_ids")
    log(f"acceptance ({time.perf_counter() - t0:.0f}s): " + "; ".join(
        f"{a['speculative_config']}: {a['mean_acceptance_length']:.2f}" for a in [*acc, *base.values()]))
    if not same:
        log("WARNING: greedy outputs differ between methods (fp32): see outputs_equal_across_methods")
    earlier = earlier_records(work, phase)   # (read before OUT is replaced)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "training_loss.png"):
        shutil.copy(head_dir / f, OUT / f)
    for k in earlier:
        shutil.copy(work / f"training_loss_phase{k}.png", OUT / f"training_loss_phase{k}.png")
    record = {
        "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "seed": SEED,
        "command": "python scripts/train_eagle_demo.py --work DIR" + (f" --phase {phase}" if phase > 1 else ""),
        "phase": phase,
        **({"init_head": f"phase {ph.init}'s head (its record: phase{ph.init})"} if ph.init is not None else {}),
        "kind": "eagle3", "target": "stdlib-demo/target", "data": asdict(ph.data), "recipe": asdict(ph.recipe),
        "train_config": ck["settings"]["train_config"], "heldout_files": [d.name for d in held],
        "head_parameters": s["head_parameters"], "target_parameters": s["target_parameters"],
        "file_bytes": (OUT / "model.safetensors").stat().st_size, "draft_vocab_size": s["draft_vocab_size"],
        "draft_vocab_coverage": s["draft_vocab_coverage"], "steps": s["steps"], "train_tokens": s["train_tokens"],
        "data_wall_time_s": s["data_time_s"], "train_wall_time_s": s["wall_time_s"],
        "eval_wall_time_s": time.perf_counter() - t0, "greedy_calibration": s["calibration"],
        "final_train_loss": s["final_train_loss"],
        "final_train_loss_mean_last_10": sum(v for _, v in s["loss_history"][-10:]) / 10,
        "heldout_before": s["heldout_before"], "heldout_after": s["heldout_after"], "heldout_history": s["history"],
        "acceptance": {"prompts": len(prompts), "max_tokens": EVAL.max_tokens, "temperature": 0.0,
                       "dtype": EVAL.dtype, "eagle3": acc, "baselines": base,
                       "outputs_equal_across_methods": same},
        **{f"phase{k}": rec for k, rec in earlier.items()},
    }
    (OUT / "training_record.json").write_text(json.dumps(record, indent=1))
    log(f"exported to {OUT}: {record['file_bytes'] / 1e6:.1f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--stage", default="all", choices=["all", "train", "export"])
    ap.add_argument("--steps", type=int, default=None, help="override the step count (experiments)")
    ap.add_argument("--stop-at", type=int, default=None, help="end the training early at this step (resumable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--phase", type=int, default=1, choices=sorted(PHASES),
                    help="1: train from the target; 2-4: fine-tune the previous phase's head (module docstring)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage != "train":
        check_order(args.phase)   # (before training and the acceptance test, not after)
    log(f"python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    res, held = stage_train(args.work, args.steps, args.stop_at, args.phase)
    if args.stage in ("all", "export") and res.state.step == (args.steps or PHASES[args.phase].train.steps):
        stage_export(args.work, held, args.phase)
    elif args.stage != "train":
        log("training not finished: rerun to continue")
        sys.exit(0)


if __name__ == "__main__":
    main()
