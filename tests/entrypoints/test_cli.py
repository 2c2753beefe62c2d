"""`leapfrog generate` end to end: text, stats line, speculation, --compare, errors."""

from __future__ import annotations

import json
import re

from leapfrog.entrypoints.cli import main


def test_generate_with_speculation_and_compare(llama_dir, capsys):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    rc = main(["generate", "def foo(x):", "--model", str(llama_dir), "--dtype", "float32", "--max-tokens", "24",
               "--ignore-eos", "--min-tokens", "10", "--speculative-config", spec, "--compare"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("def foo(x):")
    assert "[24 tokens, finish_reason=length]" in out
    assert "tokens/s" in out and "acceptance rate" in out and "mean acceptance length" in out
    assert "speedup" in out and "identical output: True" in out


def test_prompts_file_and_sampling_flags(llama_dir, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("import os\n{\"prompt\": \"class A:\", \"task_id\": 3}\n{\"prompt_token_ids\": [5, 6, 7]}\n")
    rc = main(["generate", "--model", str(llama_dir), "--prompts-file", str(f), "--temperature", "0.8",
               "--top-k", "5", "--top-p", "0.9", "--max-tokens", "6", "--seed", "3", "--speculative-config", "none"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("finish_reason=") == 3 and "class A:" in out


def test_seed_is_the_engine_seed_not_every_requests(llama_dir, tmp_path, capsys):
    """--seed seeds the engine (vLLM's meaning): the same prompt three times gives three samples,
    and the same command gives the same three again. (It used to seed every request alike, so
    repeated prompts got one identical sample.)"""
    f = tmp_path / "same.txt"
    f.write_text("def f(x):\n" * 3)
    argv = ["generate", "--model", str(llama_dir), "--prompts-file", str(f), "--temperature", "1.0",
            "--max-tokens", "8", "--ignore-eos", "--seed", "5", "--speculative-config", "none"]
    outs = []
    for _ in range(2):
        assert main(argv) == 0
        out = capsys.readouterr().out
        outs.append(re.split(r"--- \[[^\]]*\]\n", out)[:3])   # the three completions
    assert outs[0] == outs[1] and len(set(outs[0])) > 1, outs


def test_speculative_config_flag_checked_before_any_model_loads(llama_dir, capsys, monkeypatch):
    """A repeated key (json.loads kept the last one silently) or a bad field of --speculative-config
    is refused before the target loads (it was refused after: minutes, for a large model)."""
    from leapfrog.entrypoints import llm as llm_mod

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --speculative-config was checked")
    monkeypatch.setattr(llm_mod, "LLMEngine", no_load)
    for cmd in (["generate", "x", "--model", str(llama_dir)], ["check", "--model", str(llama_dir)]):
        for text, msg in (('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens": 4}',
                           "gives 'num_speculative_tokens' twice"),
                          ('{"method": "ngram", "num_speculative_tokens": 2, "method": "eagle"}', "'method' twice"),
                          ('[1]', "must be a JSON object or none"),
                          ('{"method": "ngram", "num_speculative_tokens": 4, "eagle_topk": 2}', "eagle_topk")):
            assert main([*cmd, "--speculative-config", text]) == 2, (cmd, text)
            assert msg in capsys.readouterr().err, (cmd, text)
    from leapfrog.entrypoints.cli import _spec_arg
    assert _spec_arg("null") == _spec_arg("none") == (None, True)   # (JSON's none: json.dumps(None))


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


def test_bad_files_and_numbers_exit_two_with_one_line(llama_dir, tmp_path, capsys):
    """Prompt files that do not parse, and numeric flags out of range, end with exit code 2 and a
    message (no traceback, no silent default); a check that would test nothing is refused."""
    import pytest
    m = ["--model", str(llama_dir)]
    spec = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 2})]
    for i, text in enumerate(['{"prompt": "a"}\n{oops', '{"prompt_token_ids": []}', '{"prompt": 5}', "\n\n",
                              "[1, 2]\n{}",
                              '{"prompt": "a", "prompt_token_id": [5]}']):   # (a typo was ignored: "a" ran)
        f = tmp_path / f"p{i}.jsonl"
        f.write_text(text)
        assert main(["generate", *m, "--prompts-file", str(f), "--speculative-config", "none"]) == 2
        err = capsys.readouterr().err
        assert "--prompts-file" in err and ("line" in err) == (i != 3), err
    f = tmp_path / "missing.txt"
    assert main(["generate", *m, "--prompts-file", str(f)]) == 2
    assert "No such file" in capsys.readouterr().err
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9\n")
    assert main(["generate", *m, "--prompts-file", str(f)]) == 2
    assert "UTF-8" in capsys.readouterr().err
    for bad in ({"prompt_token_ids": 5}, {"prompt_token_ids": ["a"]}):
        f = tmp_path / "c.jsonl"
        f.write_text(json.dumps(bad) + "\n")
        assert main(["check", *m, *spec, "--prompts-file", str(f)]) == 2
        assert "prompt_token_ids" in capsys.readouterr().err
    assert main(["check", *m, *spec, "--max-tokens", "0", "--samples", "0"]) == 2
    assert "nothing to check" in capsys.readouterr().err
    # options that would do nothing or make the check unable to fail (each ran and reported PASS)
    for extra, msg in ((["--samples", "0", "--setting", "temperature=0.5"], "--setting: the sampling part's"),
                       (["--samples", "0", "--thorough", "--sample-tokens", "3"], "--thorough, --sample-tokens"),
                       (["--positions", "0", "--samples", "10"], "--samples: the sampling part's options, and "
                                                                "--positions 0 skips it"),
                       (["--setting", "temperature=0"], "temperature 0 is greedy"),
                       (["--setting", ""], "an empty item"),
                       (["--setting", "temperature=1,,top_k=2"], "an empty item"),
                       (["--num-prompts", "1", "--positions", "5"], "--positions 5: there are 1 prompts"),
                       (["--tie-tol", "1e308"], "must be below 0.1"),
                       (["--seed", str(2**64 - 1)], f"--seed {2**64 - 1}: must be an integer")):
        assert main(["check", *m, *spec, *extra]) == 2, extra
        assert msg in capsys.readouterr().err, extra
    assert main(["bench", *m, *spec, "--greedy-share", "0.5", "--temperature", "0"]) == 2
    assert "every temperature here is 0" in capsys.readouterr().err
    for argv in (["check", *m, "--sample-tokens", "0"], ["check", *m, "--tie-tol", "nan"],
                 ["bench", *m, "--threads", "-1"], ["train-draft", str(llama_dir), "--lr", "nan"],
                 ["train-draft", str(llama_dir), "--eval-k", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert "argument" in capsys.readouterr().err


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
