"""`leapfrog generate` end to end: text, stats line, speculation, --compare, errors."""

from __future__ import annotations

import json

from leapfrog.entrypoints.cli import main


def test_generate_with_speculation_and_compare(llama_dir, capsys):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    rc = main(["generate", "def foo(x):", "--model", str(llama_dir), "--dtype", "float32", "--max-tokens", "24",
               "--ignore-eos", "--speculative-config", spec, "--compare"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("def foo(x):")
    assert "[24 tokens, finish_reason=length]" in out
    assert "tokens/s" in out and "acceptance rate" in out and "mean acceptance length" in out
    assert "speedup" in out and "identical output: True" in out


def test_prompts_file_and_sampling_flags(llama_dir, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("import os\n{\"prompt\": \"class A:\"}\n")
    rc = main(["generate", "--model", str(llama_dir), "--prompts-file", str(f), "--temperature", "0.8",
               "--top-k", "5", "--top-p", "0.9", "--max-tokens", "6", "--seed", "3", "--speculative-config", "none"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("finish_reason=") == 2 and "class A:" in out


def test_bad_input_clear_errors(llama_dir, capsys):
    assert main(["generate", "x", "--model", str(llama_dir), "--speculative-config", "{not json"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(llama_dir), "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": -1}']) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "/nonexistent/model/dir"]) == 2
    assert main(["generate", "x", "--model", str(llama_dir), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(llama_dir), "--num-scheduler-steps", "4"]) == 2
    assert "num_scheduler_steps=4 needs the compiled fast path" in capsys.readouterr().err


def test_default_model_fallback_without_the_demo_assets(tmp_path, monkeypatch, capsys):
    from leapfrog import demo
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path / "not-installed")
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path))
    rc = main(["generate", "def quicksort(arr):", "--max-tokens", "12"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.startswith("def quicksort(arr):")
    assert "built-in default model" in out.err
    assert "speculation ngram" in out.out or "tokens/s" in out.out
    assert (tmp_path / "tiny-random-llama-v1" / "config.json").is_file()


def test_load_format_dummy_needs_no_weight_files(llama_dir, tmp_path, capsys):
    """--load-format dummy: config.json and tokenizer files, no weights, and generate runs."""
    import shutil
    for f in llama_dir.iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            shutil.copy(f, tmp_path / f.name)
    assert main(["generate", "x", "--model", str(tmp_path), "--max-tokens", "4", "--ignore-eos"]) == 2
    assert "no weights" in capsys.readouterr().err
    rc = main(["generate", "def foo(x):", "--model", str(tmp_path), "--load-format", "dummy", "--max-tokens", "4",
               "--ignore-eos", "--speculative-config", "none"])
    assert rc == 0 and "[4 tokens, finish_reason=length]" in capsys.readouterr().out
