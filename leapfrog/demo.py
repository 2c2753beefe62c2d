"""Small real checkpoints made on the spot: a BPE tokenizer trained with ``tokenizers`` and a
Llama-family model saved with ``transformers`` (safetensors + config.json + tokenizer files).

``default_model()`` is what ``LLM()`` and ``leapfrog generate`` use when no model is given: the
demo pair shipped in the package (``leapfrog/assets/stdlib-demo``: a target and a draft trained
on the Python standard library's source by ``scripts/train_demo.py``) with the built-in method
measured fastest (``DEMO_EAGLE3``: the EAGLE-3 head's chain when shipped, else draft_model at
K = 4). Should the assets be missing (a build without package data), it falls back
to a tiny *random-init* Llama created once under ``~/.cache/leapfrog`` (or ``$LEAPFROG_CACHE``):
the engine then runs end to end offline, but its text is not meaningful.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
_STDLIB_FILES = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py", "colorsys.py",
                 "keyword.py", "this.py", "queue.py", "shlex.py"]


def stdlib_sample_text(max_chars: int = 400_000) -> str:
    """A few standard-library source files (PSF license), the same on every Python 3.11+."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in _STDLIB_FILES:
        f = root / name
        if f.is_file():
            parts.append(f.read_text(encoding="utf-8", errors="replace"))
    text = "\n".join(parts) or "def f(x):\n    return x + 1\n" * 100
    return text[:max_chars]


def build_tokenizer(text: str, vocab_size: int):
    """Byte-level BPE (GPT-2 style) -> transformers PreTrainedTokenizerFast with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_random_llama(path: str | os.PathLike, tokenizer, *, arch: str = "llama", seed: int = 0,
                      dtype: str = "float32", max_shard_size: str | None = None, **config: Any) -> Path:
    """A random-init checkpoint of ``arch`` (llama | mistral | qwen2) with ``tokenizer`` saved beside it."""
    import torch
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
    cfg_cls, model_cls = classes[arch]
    defaults = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if tokenizer is not None:
        defaults.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    cfg = cfg_cls(**{**defaults, **config})
    torch.manual_seed(seed)
    model = model_cls(cfg).to(getattr(torch, dtype)).eval()
    path = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if tokenizer is not None:  # tokenizer=None: a token-ids-only checkpoint (skip_tokenizer_init)
        tokenizer.save_pretrained(path)
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("LEAPFROG_CACHE", Path.home() / ".cache" / "leapfrog"))


DEMO_DIR = Path(__file__).resolve().parent / "assets" / "stdlib-demo"


def demo_pair() -> tuple[Path, Path] | None:
    """(target, draft) directories of the shipped demo family, or None when not installed."""
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    if (target / "config.json").is_file() and (draft / "config.json").is_file():
        return target, draft
    return None


#: The built-in method that measured fastest on the demo family (benchmarks/tree_bench.py,
#: fastpath_bench.py; README "Trees and EAGLE"): the EAGLE-3 head as a chain when the head is
#: shipped (the calibrated head's 16-node tree accepts ~1 token more per step but costs as much
#: more: 1.84x against 1.89x at batch 1), else draft_model K=4. Off above 3 sequences: with plain
#: eager decode one C++ call a step (stop 75, tree_bench.py --batch-sizes 2 3 4 8), the chains of 5
#: / 7 ran 1.38x / 1.34x no speculation at batch 2, 1.30x / 1.25x at 3, 1.13x / 1.12x at 4 and
#: 1.06x / 1.02x at 8 at T = 0, but at T = 0.7 1.16x / 1.12x at 2, 1.08x / 1.03x at 3, 0.90x / 0.89x
#: at 4 and 0.86x / 0.82x at 8 (off above 4 where the linears run on AMX tiles:
#: ``demo_disable_by_batch_size``). The chain's depth is ``demo_chain_depth``'s.
DEMO_EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 5, "eagle_topk": 1, "disable_by_batch_size": 3}


def demo_chain_depth(dtype: str = "auto") -> int:
    """The built-in head's chain depth on this CPU: 7 where the target runs in bf16 on the AVX-512
    BF16 linear kernel (``dtype`` "auto" or "bfloat16" there; its register tile holds 8 rows, so a
    chain of 7 is verified in one pass over the target's weights, and a chain of 8 needs a second
    tile), else 5 (the float32 kernel's tile holds 6 rows; on AVX2 CPUs "auto" runs float32).
    Measured with the phase-3 head (stop 75, `fastpath_bench.py --eagle-depth 5 6 7 8 10 12`, bf16,
    8 rounds per engine step): T = 0 chains of 5 / 7 / 8 at 2.22x / 2.41-2.45x / 2.18x compiled no
    speculation (4.75 / 5.8 / 6.04 accepted per round), T = 0.7 level (1.73x / 1.77x), eager steps
    level (2.00x / 1.96x at T = 0, 1.87x / 1.92x at T = 0.7); on an AVX2 VM (float32) chains of 5 /
    7 ran 1.71x / 1.48x."""
    from leapfrog.model.native_linear import kernel_isa
    return 7 if dtype in ("auto", "bfloat16", "bf16") and kernel_isa() == "avx512_bf16" else 5


def demo_disable_by_batch_size(dtype: str = "auto", draft_quantization: str | None = None) -> int:
    """Above how many sequences the built-in head stops drafting: 4 where the bf16 target's linears
    run on AMX tiles (``amx_in_use``, which loads the kernel: verifying 8 rows costs 1.26 one-token
    forwards there, against 1.83 on the vdpbf16ps tiles) and where the head drafts in w8a8 on the
    kernel's AVX2 build (``draft_quantization``, ``demo_draft_quantization``'s); 5 where the bf16
    target runs on the vdpbf16ps tiles of an AMD CPU of family 26 or later with AVX-VNNI too, no
    AMX, and the head drafts in w8a8 (AMD Zen 5, whose server cores run 512-bit units at full width:
    8 rows cost 1.12-1.16 one-token forwards there; its laptop parts, 256-bit units, are
    unmeasured);
    else 3 (DEMO_EAGLE3's: AMD Zen 4, where the chain of 7 ran 1.24x / 1.00x no speculation at
    batch 4, T = 0 / 0.7, and 1.00x / 0.83x at 8, stop 89). Measured on an AMX Xeon (stop 79,
    ``tree_bench.py --only 2 8 --eagle-depths 7 --batch-sizes 1 4 8 16 --temperatures 0 0.7``): the
    chain of 7 ran 1.49x / 1.26x no speculation at batch 4 (T = 0 / 0.7), 1.23x / 0.94x at 8, 1.01x /
    0.65x at 16. On a 2-vCPU AVX2 EPYC with the w8a8 head (stop 118, float32 target, the chain of 5,
    two ``tree_bench.py`` runs): 1.11x / 1.02x and 1.23x / 1.04x at batch 4 (T = 0 / 0.7), 1.19x /
    1.03x at 5 in one run. On a 2-vCPU Zen 5 EPYC (stop 123, the w8a8 chain of 7, two
    ``tree_bench.py --only 13 --eagle-depths 7 --head-quantization w8a8`` runs): 1.41x / 1.14x and
    1.38x / 1.16x at batch 4, 1.33x / 1.09x and 1.31x / 1.09x at 5, 1.25x / 1.02x and 1.24x / 1.05x
    at 6, 1.13x / 0.86x at 8."""
    import torch

    from leapfrog.model.native_linear import (amx_in_use, cpu_flags, cpu_vendor_family, kernel_amx, kernel_isa,
                                              native_linear_supported)
    # (the flags first: elsewhere nothing is loaded here, and the engine builds its ops in parallel)
    bf16 = dtype in ("auto", "bfloat16", "bf16")
    on = bf16 and kernel_amx() and native_linear_supported(torch.bfloat16, "cpu") and amx_in_use()
    on = on or (draft_quantization == "w8a8" and kernel_isa() == "avx2")
    # (an AMD CPU of family 26 or later with AVX-VNNI beside AVX-512 BF16 and no AMX: Zen 5 and
    # later; an Intel Xeon whose AMX tiles are hidden or not lent verifies on the vdpbf16ps tiles at
    # 1.83 one-token forwards for 8 rows, so it keeps 3)
    flags, (vendor, family) = cpu_flags(), cpu_vendor_family()
    full_width = (not on and draft_quantization == "w8a8" and bf16
                  and kernel_isa() == "avx512_bf16" and vendor == "AuthenticAMD" and (family or 0) >= 26
                  and "avx_vnni" in flags and not any("amx" in f for f in flags))
    return 4 if on else 5 if full_width else DEMO_EAGLE3["disable_by_batch_size"]


def demo_draft_quantization(dtype: str = "auto", device: str = "auto") -> str | None:
    """The built-in head's ``draft_quantization``: "w8a8" where the engine runs on the CPU
    (``device``, "auto" resolved as the engine resolves it: a GPU host runs the model there) and
    either its target runs bf16 on the AVX-512 BF16 kernel and the CPU has AMX-INT8 or AVX-512 VNNI,
    or the kernel's AVX2 build serves (no AVX-512 BF16) and the target runs float32 (``dtype``
    "auto" or "float32"; the AVX2 build's vpmaddubsw path: ``w8a8_supported``), else None (bf16).
    On a 2-vCPU AVX2 EPYC (stop 118, ``tree_bench.py --only 2 4 8 10 --head-quantization w8a8``,
    float32 target): the chain of 5 at 2.01x / 1.61x no speculation at batch 1 (T = 0 / 0.7)
    against 1.89x / 1.55x with the bf16 head, 1.11x / 1.02x at batch 4 against 1.05x / 0.96x, the
    same 4.93 tokens a step at T = 0. Measured on an AMX Xeon
    (stop 80, ``step_bench.py``, batch 1; the head's five linears of a chain level, one row: 63
    against 178 us; its drafts the same to within 1 % of tokens a step, 5.26 against 5.30
    accepted): chains of 5 / 7 at 2.71x / 2.89x no speculation against 2.26x / 2.26x with the bf16
    head at T = 0, 2.15x / 2.14x against 1.72x / 1.66x at T = 0.7. With VNNI on a 2-vCPU AVX-512
    EPYC (stop 89; 74 against 105 us): the chain of 7 2.45x against 2.10x in ``step_bench.py``, and
    2.01x / 1.43x against 1.91x / 1.31x at batch 1 / 4 in ``tree_bench.py`` (T = 0; 1.71x / 1.16x
    against 1.70x / 1.04x at T = 0.7)."""
    from leapfrog.config import resolve_device
    from leapfrog.errors import ConfigError
    from leapfrog.model.native_linear import cpu_flags, kernel_isa, w8a8_supported
    try:
        cpu = resolve_device(device).type == "cpu"
    except ConfigError:   # (a bad device: the engine's config says so)
        cpu = False
    # (the flags first: elsewhere nothing is loaded here; w8a8_supported loads the kernel)
    isa = kernel_isa()
    on = cpu and (isa == "avx512_bf16" and dtype in ("auto", "bfloat16", "bf16")
                  and bool({"amx_int8", "avx512_vnni"} & cpu_flags())
                  or isa == "avx2" and dtype in ("auto", "float32", "fp32")) and w8a8_supported()
    return "w8a8" if on else None


def default_model(dtype: str = "auto", device: str = "auto") -> tuple[str, dict[str, Any] | None]:
    """(model path, default speculative_config) of the built-in default model (the same with
    tensor parallelism) for the engine's ``dtype`` (the head's chain depth: ``demo_chain_depth``;
    the batch size it drafts up to: ``demo_disable_by_batch_size``)."""
    pair = demo_pair()
    if pair is not None:
        head = DEMO_DIR / "eagle3"
        if (head / "config.json").is_file():
            quant = demo_draft_quantization(dtype, device)
            spec = {**DEMO_EAGLE3, "num_speculative_tokens": demo_chain_depth(dtype),
                    "disable_by_batch_size": demo_disable_by_batch_size(dtype, quant), "model": str(head)}
            return str(pair[0]), {**spec, "draft_quantization": quant} if quant else spec
        return str(pair[0]), {"method": "draft_model", "model": str(pair[1]), "num_speculative_tokens": 4}
    path = cache_dir() / "tiny-random-llama-v1"
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tok = build_tokenizer(stdlib_sample_text(), vocab_size=1024)
        save_random_llama(tmp, tok, seed=0, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race
            pass
    return str(path), {"method": "ngram", "num_speculative_tokens": 4}
