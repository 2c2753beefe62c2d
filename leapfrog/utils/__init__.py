"""Small helpers shared across the package."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass


def env_off(name: str) -> bool:
    """Whether the environment switch ``name`` (default on) is set to 0, false, off or no."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def env_on(name: str) -> bool:
    """Whether the environment switch ``name`` (default off) is set to 1, true, on or yes."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class FrozenHeap:
    objects: int        # objects in the collector's permanent generation after the freeze
    collect_s: float    # seconds the full collection before it took


def freeze_heap() -> FrozenHeap:
    """Collect once, then move every object still alive into the collector's permanent generation
    (``gc.freeze``; vLLM's engine process and SGLang's server do the same after start-up).

    A loaded engine is mostly long-lived objects: the model, its compiled graphs, the tokenizer and
    the libraries (about 371k tracked objects when `leapfrog serve` has loaded the built-in pair),
    and a full collection walks all of them, 200-240 ms there during which no request makes progress. A server allocates per
    request, so such collections come while it serves. Frozen objects are still freed by
    reference counting; only reference cycles among them are never collected, so call this once,
    after start-up, in a process that keeps its engine (``gc.unfreeze`` undoes it)."""
    t0 = time.perf_counter()
    gc.collect()
    collect_s = time.perf_counter() - t0
    gc.freeze()
    return FrozenHeap(gc.get_freeze_count(), collect_s)
