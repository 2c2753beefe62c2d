"""train-draft's bad input: flags a method never reads, outputs that cannot be written, runs that
diverge, checkpoints that cannot be resumed or were made with other settings or another corpus.
Each is an exit code 2 with one line before the work (or a refusal to save), never a traceback
after an hour of training, a silently ignored flag or a draft of NaN weights."""

from __future__ import annotations

import json

import pytest

from leapfrog.entrypoints.cli import main
from leapfrog.train.corpus import Document, fingerprint

TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-prompts", "0"]
DRAFT = ["--hidden-size", "32", "--intermediate-size", "64", "--num-layers", "1", "--num-heads", "2"]


def run(capsys, *argv) -> tuple[int, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:   # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr().err


def test_flags_and_paths_refused_before_any_work(tmp_path, llama_dir, corpus_dir, capsys):
    base = ["train-draft", llama_dir, "--corpus", corpus_dir]
    (tmp_path / "afile").write_text("x")
    cases = [
        (["--out", tmp_path / "afile"], "not a folder"),
        (["--out", tmp_path / "afile" / "sub"], "is a file"),
        (["--out", tmp_path / "o", "--json", tmp_path], "is a folder"),
        (["--out", tmp_path / "o", "--json", tmp_path / "no" / "s.json"], "does not exist"),
        (["--out", tmp_path / "o", "--method", "eagle3", "--hidden-size", "64"], "--hidden-size"),
        (["--out", tmp_path / "o", "--method", "eagle3", "--ce-weight", "1"], "--ce-weight"),
        (["--out", tmp_path / "o", "--eagle-topk", "2"], "EAGLE options"),
        (["--out", tmp_path / "o", "--calibration", "none"], "EAGLE options"),
        (["--out", tmp_path / "o", "--method", "eagle", "--draft-vocab-size", "100"], "EAGLE-3 options"),
        (["--out", tmp_path / "o", "--method", "eagle3", "--draft-vocab-size", "1"], "at least 2"),
        (["--out", tmp_path / "o", "--method", "eagle3", "--draft-vocab-size", "0"], "at least 1"),
        (["--out", tmp_path / "o", "--method", "eagle3", "--eagle-topk", "0"], "at least 1"),
        (["--out", tmp_path / "o", "--method", "eagle3", "--eval-k", "40"], "--eval-k 40"),
        (["--out", tmp_path / "o", "--eval-max-tokens", "-1"], "at least 1"),
        (["--out", tmp_path / "o", "--seed", str(2**70)], "must be an integer in [-2**32, 2**32)"),   # (a traceback)
        (["--out", tmp_path / "o", "--method", "eagle3", "--ttt-steps", "33"], "at most 32"),   # (ran for ever)
        (["--out", tmp_path / "o", "--method", "eagle3", "--ttt-steps", "20", "--seq-len", "16"],
         "below seq_len=16"),                                   # (a nan loss blamed on --lr)
        (["--out", tmp_path / "o", "--checkpoint-dir", tmp_path / "afile"], "not a folder"),   # (after loading)
    ]
    for extra, msg in cases:
        rc, err = run(capsys, *base, *extra)
        assert rc == 2 and msg in err, (extra, err)
    assert not (tmp_path / "o").exists()
    for argv, msg in ((["bench", "--model", llama_dir, "--out", tmp_path / "afile"], "not a folder"),
                      (["check", "--model", llama_dir, "--json", tmp_path], "is a folder")):
        rc, err = run(capsys, *argv)
        assert rc == 2 and msg in err, (argv, err)


def test_corrupt_or_foreign_checkpoints_and_divergence(tmp_path, llama_dir, corpus_dir, capsys):
    out = tmp_path / "d"
    base = ["train-draft", llama_dir, "--corpus", corpus_dir, "--out", out, *TINY, *DRAFT]
    assert run(capsys, *base)[0] == 0
    # another corpus (or another draft shape) against the finished run's checkpoint: refused, not resumed
    other = tmp_path / "other"
    other.mkdir()
    for f in sorted(corpus_dir.iterdir())[:6]:
        (other / f.name).write_text(f.read_text()[::-1])
    rc, err = run(capsys, "train-draft", llama_dir, "--corpus", other, "--out", out, *TINY, *DRAFT)
    assert rc == 2 and "other settings" in err and "corpus" in err, err
    rc, err = run(capsys, *base[:-len(DRAFT)], "--hidden-size", "64", "--num-heads", "2")
    assert rc == 2 and "shape" in err, err
    # a truncated checkpoint is named, with the way out
    ck = tmp_path / "d.ckpt" / "train_state.pt"
    ck.write_bytes(ck.read_bytes()[:100])
    rc, err = run(capsys, *base)
    assert rc == 2 and "cannot resume" in err and "train_state.pt" in err, err
    # a run that diverges saves nothing
    rc, err = run(capsys, "train-draft", llama_dir, "--corpus", corpus_dir, "--out", tmp_path / "nan", *TINY,
                  *DRAFT, "--lr", "1e30")
    assert rc == 2 and "lower --lr" in err and not (tmp_path / "nan").exists(), err
    assert not (tmp_path / "nan.ckpt" / "train_state.pt").exists()   # (its NaN weights were kept and resumed)
    rc, err = run(capsys, "train-draft", llama_dir, "--corpus", corpus_dir, "--out", tmp_path / "nan", *TINY,
                  *DRAFT, "--lr", "1e-3")   # as the message says
    assert rc == 0 and (tmp_path / "nan" / "config.json").is_file(), err
    # token ids past the vocabulary
    (tmp_path / "ids.jsonl").write_text("\n".join(json.dumps({"token_ids": list(range(300, 340)) * 3 + [100000]})
                                                  for _ in range(4)))
    rc, err = run(capsys, "train-draft", llama_dir, "--corpus", tmp_path / "ids.jsonl", "--out", tmp_path / "i",
                  *TINY, *DRAFT)
    assert rc == 2 and "vocab_size" in err, err


def test_corpus_fingerprint_reads_contents_not_names():
    a = [Document("train.jsonl:1", "def f(): pass"), Document("train.jsonl:2", "x = 1")]
    b = [Document("train.jsonl:1", "def g(): pass"), Document("train.jsonl:2", "x = 1")]
    assert fingerprint(a) != fingerprint(b) and fingerprint(a) == fingerprint(list(a))
    assert fingerprint([Document("t", "", (1, 2))]) != fingerprint([Document("t", "", (1, 3))])
