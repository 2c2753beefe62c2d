"""leapfrog/utils: the environment switches, the start-up heap freeze and the C++ builds' fallback."""

from __future__ import annotations

import gc
import weakref

import pytest

import torch

from leapfrog.utils import cpp, env_off, env_on, freeze_heap


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


def test_build_inline_falls_back_to_a_generic_build(monkeypatch):
    """The CPU's instruction-set build first; where the compiler refuses its flags, the generic
    build (its own cache entry, no set flags); the last build's error reaches the caller (who keeps
    ATen's functions). The compiler is replaced by a recorder here: the real builds run in every
    test of the ops (tests/attention, tests/model/test_native_ops.py)."""
    import torch.utils.cpp_extension as ext
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    calls = []

    def load_inline(name, cpp_sources, is_python_module, extra_cflags, extra_ldflags):
        calls.append((name, extra_cflags))
        if "-mavx2" in extra_cflags:
            raise RuntimeError("unknown flag")
    monkeypatch.setattr(ext, "load_inline", load_inline)
    assert cpp.build_inline("op", "src", ["-O3"]) == "generic"
    assert [n for n, _ in calls] == ["op_avx2", "op_generic"]
    assert calls[0][1][:1] == ["-O3"] and set(cpp.ISA_FLAGS["AVX2"]) <= set(calls[0][1])
    assert not set(cpp.ISA_FLAGS["AVX2"]) & set(calls[1][1])

    def broken(name, **kw):
        raise OSError("no compiler")
    monkeypatch.setattr(ext, "load_inline", lambda name, **kw: broken(name))
    with pytest.raises(OSError, match="no compiler"):
        cpp.build_inline("op", "src", [])
