"""train-draft checks the target (and an --init-draft) before building data or training: a bad
target fails at once with the engine's own error, not after the training run."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from leapfrog.demo import build_tokenizer, save_random_llama
from leapfrog.entrypoints.cli import main
from leapfrog.errors import CheckpointError, ConfigError
from leapfrog.train import distill
from leapfrog.train.distill import DraftShape, check_target, train_draft
from leapfrog.train.loop import TrainConfig

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1}


@pytest.fixture
def no_training(monkeypatch):
    """Reading the corpus (the first step after the checks) fails the test: the check came too late."""
    def too_late(*a, **k):
        raise AssertionError("the corpus was read before the target was checked")
    monkeypatch.setattr(distill, "read_documents", too_late)


def copy(src, tmp_path):
    dst = tmp_path / "target"
    shutil.copytree(src, dst)
    return dst


def run(target, tmp_path, **kw):
    return train_draft(target, tmp_path / "corpus-never-read", tmp_path / "out",
                       train_config=TrainConfig(steps=2, batch_size=2, seq_len=16), eval_prompts=0, **kw)


def test_unsupported_architecture_fails_before_training(tmp_path, llama_dir, no_training):
    d = copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=re.escape(str(d / "config.json")) + ": unsupported architecture"):
        run(d, tmp_path)


def test_bad_config_field_fails_before_training(tmp_path, llama_dir, no_training):
    d = copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = "2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: field 'num_hidden_layers' must be an integer"):
        run(d, tmp_path)


def test_truncated_weights_fail_before_training(tmp_path, llama_dir, no_training):
    d = copy(llama_dir, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=re.escape(str(f)) + ".*truncated or corrupt"):
        run(d, tmp_path)


def test_missing_or_misfit_tensor_fails_before_training(tmp_path, llama_dir, no_training):
    d = copy(llama_dir, tmp_path)
    t = load_file(d / "model.safetensors")
    del t["model.layers.1.mlp.down_proj.weight"]    # transformers would random-init it and train on that
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' is missing"):
        run(d, tmp_path)


def test_missing_tokenizer_says_train_draft_needs_it(tmp_path, llama_dir, no_training):
    d = copy(llama_dir, tmp_path)
    for f in d.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(d)) + ": no tokenizer files .*train-draft tokenizes"):
        run(d, tmp_path)


def test_tokenizer_larger_than_the_vocabulary(tmp_path, tokenizer, no_training):
    d = save_random_llama(tmp_path / "small_vocab", tokenizer, vocab_size=len(tokenizer) - 20, **SMALL)
    with pytest.raises(CheckpointError, match=rf"tokenizer has {len(tokenizer)} tokens but config\.json vocab_size"):
        run(d, tmp_path)


def test_incompatible_init_draft_fails_before_training(tmp_path, llama_dir, tokenizer, no_training):
    bigger = save_random_llama(tmp_path / "v400", tokenizer, vocab_size=400, **SMALL)
    with pytest.raises(ConfigError, match=r"--init-draft .*vocab_size 400 != target's"):
        run(llama_dir, tmp_path, init_draft=bigger)
    other = build_tokenizer("completely different text " * 200 + "zzz yyy xxx", vocab_size=len(tokenizer))
    foreign = save_random_llama(tmp_path / "foreign", other, vocab_size=len(tokenizer), **SMALL)
    with pytest.raises(ConfigError, match=r"--init-draft .*tokenizer"):
        run(llama_dir, tmp_path, init_draft=foreign)
    unsupported = save_random_llama(tmp_path / "unsup", tokenizer, **SMALL)
    cfg = json.loads((unsupported / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (unsupported / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unsup/config\.json: unsupported hidden_act"):
        run(llama_dir, tmp_path, init_draft=unsupported)


def test_good_target_passes_and_returns_its_tokenizer(llama_dir, tokenizer, draft_dir):
    ckpt, tok = check_target(llama_dir, init_draft=draft_dir)
    assert ckpt.path == llama_dir and len(tok) == len(tokenizer)


def test_odd_head_size_is_refused_up_front():
    # the engine's RoPE needs an even head size: this draft would train, then fail to load
    with pytest.raises(ConfigError, match="must be even"):
        DraftShape(hidden_size=30, num_attention_heads=2)


def test_cli_reports_a_bad_target_at_once(tmp_path, llama_dir, capsys):
    d = copy(llama_dir, tmp_path)
    (d / "config.json").write_text("[]")
    rc = main(["train-draft", str(d), "--corpus", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert rc == 2
    assert re.search(re.escape(str(d / "config.json")) + r": must be a JSON object", capsys.readouterr().err)
