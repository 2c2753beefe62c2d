"""``python -m leapfrog`` behaves as the ``leapfrog`` console command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapfrog", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_help_exits_zero_and_lists_the_commands():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: leapfrog")
    for cmd in ("generate", "serve", "check", "bench", "train-draft"):
        assert cmd in r.stdout


def test_bad_flag_is_an_argparse_error():
    r = run("generate", "--no-such-flag")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: leapfrog") and "error: unrecognized arguments: --no-such-flag" in r.stderr
    r = run()
    assert r.returncode == 2 and "arguments are required: command" in r.stderr


def test_leapfrog_errors_exit_two_with_the_message(tmp_path):
    r = run("train-draft", str(tmp_path), "--corpus", str(tmp_path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.startswith("leapfrog: error:") and "no config.json" in r.stderr


def test_same_as_the_console_script():
    script = Path(sys.executable).with_name("leapfrog")
    script = str(script) if script.is_file() else shutil.which("leapfrog")
    if script is None:
        pytest.skip("the leapfrog console script is not installed")
    for args in (["--help"], ["generate", "--max-tokens", "x"]):
        a = run(*args)
        b = subprocess.run([script, *args], capture_output=True, text=True, timeout=120, check=False)
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)
