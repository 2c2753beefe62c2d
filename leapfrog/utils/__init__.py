"""Small helpers shared across the package."""

from __future__ import annotations

import os


def env_off(name: str) -> bool:
    """Whether the environment switch ``name`` (default on) is set to 0, false, off or no."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")
