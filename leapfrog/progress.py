"""Progress bars (tqdm) that do not flood logs: on a terminal a live bar; elsewhere (a file, a
pipe, CI) a line at most every LOG_INTERVAL seconds, in ASCII."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

#: seconds between updates when the output is not a terminal
LOG_INTERVAL = 30.0


def progress_bar(**kw: Any) -> tqdm:
    """tqdm(**kw), throttled when its stream (``file``, default stderr) is not a terminal."""
    stream = kw.get("file") or sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not (isatty is not None and isatty()):
        kw.setdefault("mininterval", LOG_INTERVAL)
        kw.setdefault("ascii", True)
        kw.pop("dynamic_ncols", None)
    return tqdm(**kw)
