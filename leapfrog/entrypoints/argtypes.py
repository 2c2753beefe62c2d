"""argparse value types for the CLI's numeric flags: a bad value is argparse's one-line error
(exit 2), not a traceback from deep inside or a silent default."""

from __future__ import annotations

import argparse
import math


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
