"""The demo pair shipped in the package: sizes, format, and that it is what `leapfrog generate` uses."""

from __future__ import annotations

import json
import math

from safetensors import safe_open

from leapfrog import demo
from leapfrog.entrypoints.cli import main


def _params(d) -> int:
    n = 0
    for f in d.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                assert sl.get_dtype() == "BF16", (f, k)
                n += math.prod(sl.get_shape())
    return n


def test_demo_pair_is_shipped_and_within_limits():
    pair = demo.demo_pair()
    assert pair is not None, "leapfrog/assets/stdlib-demo is missing"
    target, draft = pair
    files = [f for f in demo.DEMO_DIR.rglob("*") if f.is_file()]
    # target + draft about 60 MiB, the EAGLE-3 head about 10 MiB more
    assert sum(f.stat().st_size for f in files) <= 80 * 2**20
    assert all(f.stat().st_size <= 16 * 2**20 for f in files if f.suffix == ".safetensors")
    nt, nd = _params(target), _params(draft)
    assert 25e6 <= nt <= 40e6
    assert nd <= nt / 8
    assert (target / "tokenizer.json").read_text() == (draft / "tokenizer.json").read_text()
    card = (demo.DEMO_DIR / "README.md").read_text()
    assert "Python Software Foundation License" in card and "bits/byte" in card
    record = json.loads((demo.DEMO_DIR / "training_record.json").read_text())
    assert not set(record["split"]["train"]) & set(record["split"]["heldout"])


def test_generate_uses_the_demo_pair_offline(capsys):
    rc = main(["generate", "def quicksort(arr):", "--max-tokens", "24"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.startswith("def quicksort(arr):")
    assert "built-in default model" in out.err and "stdlib-demo" in out.err
    method = demo.default_model()[1]["method"]
    assert f"speculation {method}: acceptance rate" in out.out
    assert "speedup" in out.out and "identical output: True" in out.out


def test_the_built_in_chain_fills_the_kernels_row_tile(monkeypatch):
    """A chain of 7 where the target runs bf16 on the AVX-512 BF16 kernel (8-row tiles: K + 1 rows
    verified in one pass over the weights), 5 where it runs float32 (6-row tiles)."""
    import leapfrog.model.native_linear as nl

    if demo.demo_pair() is None or not (demo.DEMO_DIR / "eagle3" / "config.json").is_file():
        return
    for isa, dtype, depth in [("avx512_bf16", "auto", 7), ("avx512_bf16", "bfloat16", 7),
                              ("avx512_bf16", "float32", 5), ("avx2", "auto", 5), ("avx2", "bfloat16", 5),
                              (None, "auto", 5)]:
        for amx, int8, vnni in ((False, False, False), (False, False, True), (True, False, False),
                                (True, True, False)):
            flags = frozenset({"amx_int8"} if int8 else ()) | frozenset({"avx512_vnni"} if vnni else ())
            monkeypatch.setattr(nl, "kernel_isa", lambda isa=isa: isa)
            monkeypatch.setattr(nl, "native_linear_supported", lambda dtype, device, isa=isa: isa is not None)
            monkeypatch.setattr(nl, "amx_in_use", lambda amx=amx, isa=isa: amx and isa == "avx512_bf16")
            monkeypatch.setattr(nl, "kernel_amx", lambda amx=amx, isa=isa: amx and isa == "avx512_bf16")
            monkeypatch.setattr(nl, "cpu_flags", lambda flags=flags: flags)
            monkeypatch.setattr(nl, "w8a8_supported", lambda amx=amx, int8=int8, vnni=vnni, isa=isa:
                                ((amx and int8) or vnni) and isa == "avx512_bf16" or isa == "avx2")
            spec = demo.default_model(dtype)[1]
            assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == depth, (isa, dtype, spec)
            assert spec["eagle_topk"] == 1
            # off above 3 sequences: sampled requests at batch 4-8 ran 0.82-0.90x plain decode (stop 75);
            # above 4 where bf16 rows run on AMX tiles (batch 4: 1.49x / 1.26x at T = 0 / 0.7, stop 79)
            # and above 4 where the head drafts in w8a8 on AVX2 (stop 118: batch 4 1.11-1.23x / 1.02-1.04x)
            want = 4 if ((amx and isa == "avx512_bf16" and dtype != "float32")
                         or (isa == "avx2" and dtype == "auto")) else 3
            assert spec["disable_by_batch_size"] == want, (isa, dtype, amx, spec)
            # the head's linears in w8a8 where the bf16 target runs on the AVX-512 BF16 kernel and the
            # CPU has AMX-INT8 (stop 80: chains of 7 at 2.89x no speculation against 2.26x with the
            # bf16 head) or AVX-512 VNNI (stop 89: 2.45x against 2.10x)
            # or, on AVX2 CPUs, where the target runs float32 (stop 118: 2.01x against 1.89x at batch 1)
            w8a8 = (((amx and int8) or vnni) and isa == "avx512_bf16" and dtype != "float32"
                    or isa == "avx2" and dtype == "auto")
            assert spec.get("draft_quantization") == ("w8a8" if w8a8 else None), (isa, dtype, amx, int8, vnni, spec)


def test_cli_and_llm_pass_their_dtype_to_the_default(monkeypatch, tmp_path, capsys):
    import pytest

    from leapfrog import LLM
    from leapfrog.errors import LeapfrogError

    seen = []
    missing = str(tmp_path / "no-model")
    monkeypatch.setattr(demo, "default_model",
                        lambda dtype="auto", device="auto": (seen.append((dtype, device)), (missing, None))[1])
    with pytest.raises(LeapfrogError):
        LLM(dtype="float32", device="cpu")
    for cmd in (["generate", "x"], ["serve", "--port", "0"], ["check"], ["bench"]):
        assert main([*cmd, "--dtype", "bfloat16"]) != 0
    assert seen == [("float32", "cpu")] + [("bfloat16", "auto")] * 4, seen
    capsys.readouterr()


def test_explicit_none_turns_the_built_in_speculation_off(monkeypatch, llama_dir):
    """``LLM()`` takes the built-in model's default speculation; ``speculative_config=None`` given
    explicitly means none, as in vLLM (it took the default too: a baseline that speculated)."""
    from leapfrog import LLM

    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    monkeypatch.setattr(demo, "default_model", lambda dtype="auto", device="auto": (str(llama_dir), ngram))
    assert LLM().config.speculative_config == ngram
    assert LLM(speculative_config=None).config.speculative_config is None
    other = {"method": "ngram", "num_speculative_tokens": 2}
    assert LLM(speculative_config=other).config.speculative_config == other
    assert LLM(model=str(llama_dir)).config.speculative_config is None


def test_the_built_in_head_drafts_for_more_sequences_where_verifying_costs_less(monkeypatch):
    """The built-in head stops drafting above 4 sequences on AMX tiles and with the w8a8 head on
    AVX2, above 5 with the w8a8 head on an AMD CPU of family 26 or later with AVX-512 BF16, AVX-VNNI
    and no AMX (Zen 5), else above 3 (Zen 4; a Xeon whose AMX is hidden or not lent; a bf16 head)."""
    import leapfrog.model.native_linear as nl

    def cpu(isa: str, flags: set[str], amx: bool = False, in_use: bool | None = None,
            vendor: tuple[str, int] = ("AuthenticAMD", 26)) -> None:
        for name, value in (("kernel_amx", amx), ("amx_in_use", amx if in_use is None else in_use),
                            ("native_linear_supported", True), ("kernel_isa", isa),
                            ("cpu_flags", frozenset(flags)), ("cpu_vendor_family", vendor)):
            monkeypatch.setattr(nl, name, lambda *a, value=value: value)

    zen4 = {"avx512_bf16", "avx512_vnni"}
    amx = {"amx_bf16", "amx_int8", "amx_tile"}
    cpu("avx512_bf16", zen4 | {"avx_vnni"})                       # Zen 5
    assert demo.demo_disable_by_batch_size("auto", "w8a8") == 5
    assert demo.demo_disable_by_batch_size("auto", None) == 3     # (the bf16 head: unmeasured there)
    assert demo.demo_disable_by_batch_size("float32", "w8a8") == 3
    cpu("avx512_bf16", zen4, vendor=("AuthenticAMD", 25))         # Zen 4
    assert demo.demo_disable_by_batch_size("auto", "w8a8") == 3
    intel = ("GenuineIntel", 6)
    cpu("avx512_bf16", zen4 | {"avx_vnni"}, vendor=intel)         # a Xeon whose AMX the hypervisor hides
    assert demo.demo_disable_by_batch_size("auto", "w8a8") == 3
    cpu("avx512_bf16", zen4 | {"avx_vnni"} | amx, amx=True, in_use=False, vendor=intel)   # tiles not lent
    assert demo.demo_disable_by_batch_size("auto", "w8a8") == 3
    cpu("avx512_bf16", zen4 | {"avx_vnni"} | amx, amx=True, vendor=intel)
    assert demo.demo_disable_by_batch_size("auto", "w8a8") == 4
    cpu("avx2", {"avx2", "fma"})
    assert demo.demo_disable_by_batch_size("auto", "w8a8") == 4


def test_the_w8a8_head_only_where_the_engine_runs_on_the_cpu(monkeypatch):
    """On an AMX-INT8 or AVX-512 VNNI host (or an AVX2 one with a float32 target) the built-in head
    drafts in w8a8 on the CPU, but not when the engine runs on a GPU (device "cuda", or "auto" with
    one): the int8 kernel is the CPU's."""
    import leapfrog.model.native_linear as nl

    for name, value in (("kernel_amx", True), ("native_linear_supported", True), ("w8a8_supported", True),
                        ("kernel_isa", "avx512_bf16")):
        monkeypatch.setattr(nl, name, lambda *a, value=value: value)
    for flags in ({"amx_int8"}, {"avx512_vnni"}):
        monkeypatch.setattr(nl, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert demo.demo_draft_quantization("auto", "cpu") == "w8a8"
    monkeypatch.setattr(nl, "cpu_flags", lambda: frozenset())
    assert demo.demo_draft_quantization("auto", "cpu") is None   # (an AVX-512 BF16 CPU without either)
    monkeypatch.setattr(nl, "kernel_isa", lambda: "avx2")   # AVX2: the float32 target's head (vpmaddubsw)
    assert demo.demo_draft_quantization("auto", "cpu") == "w8a8"
    assert demo.demo_draft_quantization("float32", "cpu") == "w8a8"
    assert demo.demo_draft_quantization("bfloat16", "cpu") is None   # (unmeasured: bf16 emulated there)
    assert demo.demo_draft_quantization("auto", "cuda") is None
    monkeypatch.setattr(nl, "w8a8_supported", lambda: False)   # (no compiler, LEAPFROG_NATIVE_LINEAR=0)
    assert demo.demo_draft_quantization("auto", "cpu") is None
    monkeypatch.setattr(nl, "w8a8_supported", lambda: True)
    monkeypatch.setattr(nl, "kernel_isa", lambda: "avx512_bf16")
    monkeypatch.setattr(nl, "cpu_flags", lambda: frozenset({"avx512_vnni"}))
    assert demo.demo_draft_quantization("auto", "cuda") is None   # (no CUDA here: a ConfigError, so not the CPU)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert demo.demo_draft_quantization("auto", "auto") is None   # auto -> cuda where one is present
    assert demo.demo_draft_quantization("float32", "cpu") is None
