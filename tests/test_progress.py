"""Progress bars do not flood logs: on a stream that is not a terminal, at most one update per
LOG_INTERVAL seconds (plus the final one); on a terminal, live updates."""

from __future__ import annotations

import io

from leapfrog.progress import progress_bar


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(stream: io.StringIO) -> int:
    return len([x for x in stream.getvalue().replace("\r", "\n").split("\n") if x.strip()])


def test_non_terminal_output_is_throttled():
    log = io.StringIO()
    bar = progress_bar(total=500, desc="work", file=log)
    for _ in range(500):
        bar.update(1)
    bar.close()
    assert _lines(log) <= 3 and "500/500" in log.getvalue()
    tty = _TTY()
    bar = progress_bar(total=500, desc="work", file=tty, mininterval=0, miniters=1)
    for _ in range(500):
        bar.update(1)
    bar.close()
    assert _lines(tty) > 100
