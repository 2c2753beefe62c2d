"""Bad checkpoints: every one is a CheckpointError (a ValueError) that names the file and, for a
config value, the field; never a raw SafetensorError/JSONDecodeError/AttributeError traceback."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from leapfrog import LLM, SamplingParams
from leapfrog.demo import save_random_llama
from leapfrog.errors import CheckpointError, EngineError
from leapfrog.model.loader import (
    _TensorSource,
    _weight_files,
    check_weights,
    load_tokenizer,
    read_checkpoint,
)
from tests.conftest import BASE

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def copy(src, tmp_path, name="m"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def assert_good_llm_works(llama_dir):
    """After an error, a good checkpoint still loads and generates (no state left half-built)."""
    out = LLM(model=str(llama_dir), dtype="float32").generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    assert len(out[0].outputs[0].token_ids) == 3


def edit_config(d, **change):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------- safetensors files

@pytest.mark.parametrize("keep", ["half", 10, 0])
def test_truncated_safetensors_names_the_file(tmp_path, llama_dir, keep):
    d = copy(llama_dir, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2 if keep == "half" else keep])
    with pytest.raises(CheckpointError, match=re.escape(str(f)) + ".*truncated or corrupt"):
        _weight_files(d, allow_pickle=False)          # listing tensor names
    with pytest.raises(CheckpointError, match=re.escape(str(f))):
        LLM(model=str(d), dtype="float32")
    assert_good_llm_works(llama_dir)


def test_truncated_shard_named_while_listing(tmp_path, tokenizer, llama_dir):
    d = save_random_llama(tmp_path / "sh", tokenizer, seed=1, max_shard_size="20KB", **BASE)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=re.escape(shard.name) + ".*truncated or corrupt"):
        LLM(model=str(d), dtype="float32")
    assert_good_llm_works(llama_dir)


def test_unreadable_tensor_named_when_reading(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    good = d / "model.safetensors"
    bad = d / "broken.bin"
    bad.write_bytes(good.read_bytes()[:50])
    # reading (not listing): a source whose file went bad after listing, and a tensor the file lacks
    src = _TensorSource(d, {"model.norm.weight": bad, "nope.weight": good})
    with pytest.raises(CheckpointError, match=re.escape(str(bad))):
        src.get("model.norm.weight")
    with pytest.raises(CheckpointError, match=re.escape(str(good)) + ".*'nope.weight'"):
        src.get("nope.weight")
    with pytest.raises(CheckpointError, match="'nope.weight'"):
        src.shape("nope.weight")


def test_index_pointing_at_the_wrong_shard(tmp_path, tokenizer):
    d = save_random_llama(tmp_path / "sh", tokenizer, seed=1, max_shard_size="20KB", **BASE)
    index = d / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    name = "model.norm.weight"
    wrong = next(f for f in sorted(set(idx["weight_map"].values())) if f != idx["weight_map"][name])
    idx["weight_map"][name] = wrong
    index.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=re.escape(wrong) + f".*'{name}'"):
        check_weights(read_checkpoint(d))


@pytest.mark.parametrize("text", ["{bad", "[1, 2]", '{"weight_map": [1]}', '{"weight_map": {"a": 3}}'])
def test_malformed_index_named(tmp_path, tokenizer, text):
    d = save_random_llama(tmp_path / "sh", tokenizer, seed=1, max_shard_size="20KB", **BASE)
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        LLM(model=str(d), dtype="float32")


def test_shape_check_reads_headers_only(tmp_path, llama_dir):
    """check_weights (train-draft's preflight) finds a misfit tensor without loading the model."""
    from safetensors.torch import save_file
    d = copy(llama_dir, tmp_path)
    t = load_file(d / "model.safetensors")
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 3)   # trailing dim off
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*k_proj\.weight.*\(16, 3\).*layers\.0\.wqkv"):
        check_weights(read_checkpoint(d))
    check_weights(read_checkpoint(llama_dir))


def test_pickle_weights_split_over_files_all_load(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    torch.save({k: tensors[k] for k in names[::2]}, d / "pytorch_model-00001-of-00002.bin")
    torch.save({k: tensors[k] for k in names[1::2]}, d / "pytorch_model-00002-of-00002.bin")
    p = {"prompt_token_ids": [3, 4, 5]}
    got = LLM(model=str(d), dtype="float32", allow_pickle=True).generate(p, GREEDY)[0].outputs[0].token_ids
    assert got == LLM(model=str(llama_dir), dtype="float32").generate(p, GREEDY)[0].outputs[0].token_ids


def test_truncated_pickle_named(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(tensors, d / "pytorch_model.bin")
    f = d / "pytorch_model.bin"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=re.escape(str(f)) + ".*pickle"):
        LLM(model=str(d), dtype="float32", allow_pickle=True)


# ---------------------------------------------------------------- generation_config.json

@pytest.mark.parametrize("text, pattern", [
    ("{bad", "invalid JSON"),
    ("[1, 2]", r"must be a JSON object .*got a list"),
    ('{"eos_token_id": "x"}', r"field 'eos_token_id' must be an integer >= 0, got 'x'"),
    ('{"eos_token_id": [2, "x"]}', r"field 'eos_token_id\[1\]' must be an integer"),
    ('{"eos_token_id": -1}', r"field 'eos_token_id' must be an integer >= 0, got -1"),
    ('{"eos_token_id": 2.5}', r"field 'eos_token_id' must be an integer >= 0, got 2.5 \(a float\)"),
])
def test_bad_generation_config_named(tmp_path, llama_dir, text, pattern):
    d = copy(llama_dir, tmp_path)
    f = d / "generation_config.json"
    f.write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(str(f)) + ": " + pattern):
        read_checkpoint(d)
    with pytest.raises(ValueError, match="generation_config.json"):   # CheckpointError is a ValueError
        LLM(model=str(d), dtype="float32")


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_eos_outside_the_vocabulary_named(tmp_path, llama_dir, where):
    """An end-of-sequence id the model cannot produce would never stop generation."""
    d = copy(llama_dir, tmp_path)
    if where == "config.json":
        edit_config(d, eos_token_id=99999)
    else:
        (d / where).write_text('{"eos_token_id": [2, 50000]}')
    with pytest.raises(CheckpointError, match=r"eos_token_id \d+ .* is outside the vocabulary \[0, 320\)"):
        read_checkpoint(d)


@pytest.mark.parametrize("kind", ["safetensors", "pickle"])
def test_a_tensor_in_two_weight_files_is_refused(tmp_path, llama_dir, kind):
    """Without an index every weight file is read: a stray second file holding a tensor used to
    replace the real one silently (a zero lm_head: greedy output all token 0)."""
    from safetensors.torch import save_file
    d = copy(llama_dir, tmp_path)
    zero = {"model.norm.weight": torch.zeros_like(load_file(d / "model.safetensors")["model.norm.weight"])}
    if kind == "safetensors":
        save_file(zero, d / "zz-extra.safetensors")
    else:
        torch.save(load_file(d / "model.safetensors"), d / "pytorch_model-00001-of-00002.bin")
        torch.save(zero, d / "pytorch_model-00002-of-00002.bin")
        (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is in both .* and .*(zz-extra|00002)"):
        LLM(model=str(d), dtype="float32", allow_pickle=True)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int8, torch.float8_e4m3fn, torch.complex64])
def test_weights_stored_as_other_than_float_are_refused(tmp_path, llama_dir, dtype):
    """An integer, boolean, complex or fp8 tensor would be cast to the model's dtype silently (a
    boolean final norm generated token 0 over and over): the file, the tensor and its dtype are
    named, from the safetensors header."""
    d = copy(llama_dir, tmp_path)
    f, name = next((f, n) for f in sorted(d.glob("*.safetensors")) for n in load_file(f) if n == "model.norm.weight")
    tensors = load_file(f)
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{f.name}: tensor {name!r} is stored as ")):
        LLM(model=str(d), dtype="float32")


def test_pickled_weights_stored_as_integers_are_refused(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    torch.save(tensors, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="'model.norm.weight' is stored as torch.int32"):
        LLM(model=str(d), dtype="float32", allow_pickle=True)


def test_nan_weights_fail_with_the_likely_cause(tmp_path, llama_dir):
    """A NaN in a float32 checkpoint's weights: the request fails naming non-finite logits and the
    weights as the likely cause (the hint said "fp16 overflow?" in any dtype)."""
    d = copy(llama_dir, tmp_path)
    f = next(f for f in sorted(d.glob("*.safetensors")) if "model.norm.weight" in load_file(f))
    tensors = load_file(f)
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(EngineError, match="non-finite logits .*NaN or infinite weights"):
        LLM(model=str(d), dtype="float32").generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.complex64])
def test_a_torch_dtype_outside_the_supported_ones_is_refused(llama_dir, dtype):
    """``dtype=torch.float64`` ran silently in float64 (and torch.int8 failed deep in torch), where
    the string "float64" is refused."""
    with pytest.raises(CheckpointError, match="not supported; use auto, float32, bfloat16 or float16"):
        LLM(model=str(llama_dir), dtype=dtype)


def test_tensors_the_config_does_not_read_are_refused(tmp_path, llama_dir):
    """config.json with fewer layers than the checkpoint holds would load a different model
    silently: the unused tensors are named instead."""
    d = copy(llama_dir, tmp_path)
    edit_config(d, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"not used by the model .* 'model\.layers\.1\..*num_hidden_layers \(1\)"):
        LLM(model=str(d), dtype="float32")
    check = copy(llama_dir, tmp_path, "m2")   # (check_weights, which train-draft runs first, too)
    edit_config(check, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match="not used"):
        check_weights(read_checkpoint(check))


def test_sliding_window_is_read_as_transformers_reads_it(tmp_path, llama_dir):
    """Mistral (and Qwen2 with use_sliding_window) attend through a window; Llama's attention in
    transformers ignores a sliding_window field, and so does ours (the outputs would part)."""
    d = copy(llama_dir, tmp_path)
    edit_config(d, sliding_window=16)
    assert read_checkpoint(d).args.sliding_window is None
    edit_config(d, sliding_window=16, model_type="mistral", architectures=["MistralForCausalLM"])
    assert read_checkpoint(d).args.sliding_window == 16


def test_generation_config_without_eos_is_fine(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    (d / "generation_config.json").write_text('{"eos_token_id": null, "do_sample": false}')
    assert read_checkpoint(d).eos_token_ids == read_checkpoint(llama_dir).eos_token_ids


# ---------------------------------------------------------------- config.json

@pytest.mark.parametrize("change, pattern", [
    ({"hidden_size": "abc"}, r"field 'hidden_size' must be an integer >= 1, got 'abc' \(a string\)"),
    ({"hidden_size": 64.5}, r"field 'hidden_size' must be an integer >= 1, got 64.5 \(a float\)"),
    ({"hidden_size": 64.0}, r"field 'hidden_size' must be an integer >= 1, got 64.0 \(a float\)"),
    ({"hidden_size": -64}, r"field 'hidden_size' must be an integer >= 1, got -64"),
    ({"hidden_size": 0}, r"field 'hidden_size' must be an integer >= 1, got 0"),
    ({"hidden_size": True}, r"field 'hidden_size' must be an integer >= 1, got True \(a bool\)"),
    ({"hidden_size": None}, r"null value for required field 'hidden_size'"),
    ({"vocab_size": [320]}, r"field 'vocab_size' must be an integer >= 1, got \[320\] \(a list\)"),
    ({"num_hidden_layers": "2"}, r"field 'num_hidden_layers' must be an integer"),
    ({"intermediate_size": 0}, r"field 'intermediate_size' must be an integer >= 1"),
    ({"num_key_value_heads": 0}, r"field 'num_key_value_heads' must be an integer >= 1"),
    ({"max_position_embeddings": "512"}, r"field 'max_position_embeddings' must be an integer"),
    ({"num_attention_heads": 5, "head_dim": None},
     r"hidden_size=64 is not divisible by num_attention_heads=5 and no head_dim is given"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"head_dim": 15}, r"head_dim=15 must be even"),
    ({"rms_norm_eps": "x"}, r"field 'rms_norm_eps' must be a number > 0, got 'x'"),
    ({"rms_norm_eps": 0}, r"field 'rms_norm_eps' must be a number > 0, got 0"),
    ({"rope_theta": "big", "rope_scaling": None}, r"field 'rope_theta' must be a number > 0"),
    ({"rope_parameters": None, "rope_scaling": {"rope_type": "linear", "factor": "x"}},
     r"field 'rope_scaling.factor' must be a number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
     r"field 'rope_parameters.rope_theta' must be a number > 0, got -1.0"),
    ({"rope_scaling": "llama3"}, r"field 'rope_scaling' must be a JSON object"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}},   # (once filled in
     r"llama3 rope needs low_freq_factor, high_freq_factor in rope_parameters"),   # with guesses)
    ({"rope_parameters": None, "rope_scaling": {"rope_type": "linear"}}, r"linear rope needs factor"),
    ({"rope_parameters": None, "rope_scaling": {"rope_type": "linear", "factor": 0.5}},
     r"linear rope needs factor >= 1 .*got 0.5"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 0.25, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}}, r"llama3 rope needs factor >= 1"),
    ({"rope_parameters": None, "rope_scaling": {"rope_type": ["llama3"]}}, r"field 'rope_scaling.rope_type' must be a string"),
    ({"architectures": "LlamaForCausalLM"}, r"field 'architectures' must be a JSON list, got 'LlamaForCausalLM'"),
    ({"architectures": [7]}, r"field 'architectures\[0\]' must be a string"),
    ({"model_type": 3, "architectures": None}, r"field 'model_type' must be a string"),
    ({"tie_word_embeddings": "yes"}, r"field 'tie_word_embeddings' must be true or false, got 'yes'"),
    ({"sliding_window": -1}, r"field 'sliding_window' must be an integer >= 0"),
    ({"bos_token_id": "<s>"}, r"field 'bos_token_id' must be an integer >= 0"),
    ({"eos_token_id": [2, None]}, r"null value for required field 'eos_token_id\[1\]'"),
    ({"mlp_bias": True}, r"unsupported mlp_bias"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, r"quantization_config \(quant_method 'gptq'\)"),
    ({"torch_dtype": "bogus"}, r"torch_dtype 'bogus' is not a dtype leapfrog runs"),
])
def test_bad_config_field_named(tmp_path, llama_dir, change, pattern):
    d = copy(llama_dir, tmp_path)
    edit_config(d, **change)
    with pytest.raises(CheckpointError, match=re.escape(str(d / "config.json")) + ": " + pattern):
        read_checkpoint(d)


@pytest.mark.parametrize("text, pattern", [
    ("[1, 2]", r"must be a JSON object .*got a list"),
    ('"llama"', r"must be a JSON object .*got a string"),
    ("{", "invalid JSON"),
])
def test_config_not_an_object(tmp_path, llama_dir, text, pattern):
    d = copy(llama_dir, tmp_path)
    (d / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(str(d / "config.json")) + ": " + pattern):
        LLM(model=str(d), dtype="float32")
    assert_good_llm_works(llama_dir)


def test_config_not_utf8(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    (d / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError, match=r"config\.json: not UTF-8"):
        read_checkpoint(d)


def test_valid_variants_still_load(tmp_path, llama_dir):
    """Nulls for optional fields mean 'derive'/'default', as in transformers."""
    d = copy(llama_dir, tmp_path)
    edit_config(d, head_dim=None, num_key_value_heads=None, sliding_window=None, bos_token_id=None,
                rms_norm_eps=1e-5)
    a = read_checkpoint(d).args
    assert (a.head_dim, a.num_key_value_heads, a.sliding_window, a.bos_token_id) == (16, 4, None, None)
    assert a.rms_norm_eps == 1e-5 and isinstance(a.rms_norm_eps, float)
    # llama3 rope's original context: its own, else config.json's top level, else (rope.py)
    # max_position_embeddings, as transformers 5 reads it
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}
    for top, want in ((None, None), (128, 128)):
        edit_config(d, rope_parameters=rope, rope_scaling=None, original_max_position_embeddings=top)
        assert read_checkpoint(d).args.rope.original_max_position_embeddings == want


# ---------------------------------------------------------------- tokenizer files

def strip_tokenizer(d):
    for f in d.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()


def test_no_tokenizer_files_says_so_and_how_to_go_on(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    strip_tokenizer(d)
    with pytest.raises(CheckpointError) as e:
        LLM(model=str(d), dtype="float32")
    msg = str(e.value)
    assert f"{d}: no tokenizer files" in msg
    assert "tokenizer.json" in msg and "tokenizer.model" in msg          # what it looked for
    assert "tokenizer=" in msg and "--tokenizer" in msg
    assert "skip_tokenizer_init=True" in msg and "--skip-tokenizer-init" in msg
    assert "sentencepiece" not in msg and "tiktoken" not in msg.replace("*.tiktoken", "")
    # both ways on work
    ids = LLM(model=str(d), dtype="float32", skip_tokenizer_init=True).generate(
        {"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].outputs[0].token_ids
    llm = LLM(model=str(d), dtype="float32", tokenizer=str(llama_dir))
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].outputs[0].token_ids == ids
    assert llm.generate("def f(x):", GREEDY)[0].outputs[0].text is not None


def test_a_tokenizer_of_another_model_is_refused_at_load(tmp_path, llama_dir):
    """A tokenizer with more tokens than the model's vocabulary (a bigger model's), or whose EOS
    lies past it: a CheckpointError naming both sizes, not prompts refused one by one."""
    from leapfrog.demo import build_tokenizer, stdlib_sample_text
    big = build_tokenizer(stdlib_sample_text(60_000), vocab_size=1000)
    assert big.vocab_size > 320
    big.save_pretrained(tmp_path / "big")
    with pytest.raises(CheckpointError, match=rf"has {big.vocab_size} tokens but the model's vocabulary has 320"):
        LLM(model=str(llama_dir), dtype="float32", tokenizer=str(tmp_path / "big"))
    small = load_tokenizer(llama_dir)
    small.add_special_tokens({"eos_token": "<|the-end|>"})   # (id 320: past the model's 320)
    small.save_pretrained(tmp_path / "eos")
    with pytest.raises(CheckpointError, match=r"eos_token_id 320 is outside the model's vocabulary"):
        LLM(model=str(llama_dir), dtype="float32", tokenizer=str(tmp_path / "eos"))


def test_only_tokenizer_config_is_reported(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"no tokenizer files .*found only tokenizer_config\.json"):
        load_tokenizer(d)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_tokenizer_file_named(tmp_path, llama_dir, name):
    d = copy(llama_dir, tmp_path)
    (d / name).write_text("{not json")
    with pytest.raises(CheckpointError, match=re.escape(str(d / name)) + ": invalid JSON"):
        LLM(model=str(d), dtype="float32")
    assert_good_llm_works(llama_dir)


def test_tokenizer_json_of_the_wrong_shape_lists_the_files(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    (d / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(CheckpointError, match=re.escape(str(d)) + ": could not load the tokenizer from tokenizer.json"):
        load_tokenizer(d)


def test_tokenizer_path_is_a_file(llama_dir):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is a file; pass the directory"):
        load_tokenizer(llama_dir / "tokenizer.json")
