"""leapfrog/utils: the environment switches and the start-up heap freeze."""

from __future__ import annotations

import gc
import weakref

import pytest

from leapfrog.utils import env_off, env_on, freeze_heap


@pytest.mark.parametrize("switch,set_values,other", [
    (env_off, ("0", "false", "OFF", " no "), "1"),
    (env_on, ("1", "true", "ON", " yes "), "0"),
])
def test_env_switches(monkeypatch, switch, set_values, other):
    """env_off (a default-on switch set off) and env_on (a default-off switch set on): unset is
    neither, the accepted spellings are case- and space-insensitive, the opposite value is not."""
    monkeypatch.delenv("LEAPFROG_TEST_SWITCH", raising=False)
    assert not switch("LEAPFROG_TEST_SWITCH")
    for value in set_values:
        monkeypatch.setenv("LEAPFROG_TEST_SWITCH", value)
        assert switch("LEAPFROG_TEST_SWITCH")
    monkeypatch.setenv("LEAPFROG_TEST_SWITCH", other)
    assert not switch("LEAPFROG_TEST_SWITCH")


def test_freeze_heap_collects_first_then_freezes_the_survivors():
    """Garbage cycles alive before the freeze are collected, not frozen; surviving objects leave
    the collector's scans (a full collection no longer visits them); unfreeze restores them."""
    class Node:
        pass

    keep = [Node() for _ in range(1000)]
    garbage = Node()
    garbage.me = garbage   # a cycle only the collector frees
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_heap()
        assert gone() is None   # collected before the freeze, not made permanent
        # Frozen objects still die by reference count (other tests' threads free some at any
        # time), so the count can only fall after the freeze, never rise.
        assert len(keep) < gc.get_freeze_count() <= frozen.objects and frozen.collect_s >= 0
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(n) in tracked for n in keep)   # frozen objects are out of every generation
    finally:
        gc.unfreeze()
    tracked = {id(o) for o in gc.get_objects()}
    assert all(id(n) in tracked for n in keep)
