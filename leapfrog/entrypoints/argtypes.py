"""argparse value types for the CLI's numeric flags: a bad value is argparse's one-line error
(exit 2), not a traceback from deep inside or a silent default."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


def _number(text: str, kind: type) -> float:
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
    if kind is float and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r}: must be finite")
    return v


def positive_int(text: str) -> int:
    v = int(_number(text, int))
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be at least 1")
    return v


def nonneg_int(text: str) -> int:
    v = int(_number(text, int))
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v}: must be at least 0")
    return v


def positive_float(text: str) -> float:
    v = _number(text, float)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v}: must be greater than 0")
    return v


def nonneg_float(text: str) -> float:
    v = _number(text, float)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v}: must be at least 0")
    return v


def probability(text: str) -> float:
    v = _number(text, float)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be in (0, 1)")
    return v


def share(text: str) -> float:
    v = _number(text, float)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"{v}: must be in [0, 1]")
    return v


def output_dir(text: str) -> str:
    """A folder the command will write into, checked before the work (not after an hour of
    training): not an existing file, and below a folder (or folders it can create)."""
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a folder")
    up = next((a for a in p.absolute().parents if a.exists()), None)
    if up is not None and not up.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {up} is a file, not a folder")
    if up is not None and not os.access(up, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {up}")
    return text


def output_file(text: str) -> str:
    """A file the command will write at its end, checked before the work: not a folder, in a
    folder that exists and is writable."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder; give a file name")
    parent = p.absolute().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {parent}")
    return text


def port(text: str) -> int:
    v = int(_number(text, int))
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{v}: a port is in 0..65535")
    return v


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text
