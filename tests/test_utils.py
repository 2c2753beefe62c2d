"""leapfrog/utils: the environment switches, the start-up heap freeze, the C++ builds' fallback and
their lock."""

from __future__ import annotations

import gc
import subprocess
import sys
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


def test_build_inline_falls_back_to_a_generic_build(monkeypatch, tmp_path):
    """The CPU's instruction-set build first; where the compiler refuses its flags, the generic
    build (its own cache entry, no set flags); the last build's error reaches the caller (who keeps
    ATen's functions). The compiler is replaced by a recorder here: the real builds run in every
    test of the ops (tests/attention, tests/model/test_native_ops.py)."""
    import torch.utils.cpp_extension as ext
    cpp.wait_for_builds()   # (an earlier test's engine may still build ahead: not with this recorder)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))   # (the lock's directories go there)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    calls = []

    def load_inline(name, cpp_sources, is_python_module, no_implicit_headers, extra_cflags, extra_ldflags):
        assert no_implicit_headers and not is_python_module   # (no torch/extension.h, no pybind11)
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


def test_op_sources_include_no_extension_header():
    """The ops' sources include torch/library.h and ATen, not torch/extension.h (the whole C++
    frontend and pybind11: a build took 2.7x as long with it). That load_inline adds no header of
    its own is checked by the recorder in test_build_inline_falls_back_to_a_generic_build."""
    from leapfrog.attention import native
    from leapfrog.model import native_linear, native_ops
    sources = [native._SOURCE, native_ops._SOURCE, *(s for s, _ in native_linear._BUILDS.values())]
    assert all("torch/library.h" in s and "torch/extension.h" not in s for s in sources)


@pytest.mark.timeout(300)
def test_a_build_killed_mid_way_does_not_hang_the_next(monkeypatch, tmp_path):
    """A process killed while it builds an op leaves torch's ``lock`` file behind (torch's
    FileBaton, made before it compiles), on which every later build of that op would wait forever;
    the next build removes it (the dead builder's flock went with it) and builds."""
    from torch.utils import cpp_extension
    cpp.wait_for_builds()   # (an earlier test's engine may still build ahead: not into tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "leapfrog_test_tiny"
    lock = tmp_path / name / "lock"
    mid_build = ("import time; from torch.utils.file_baton import FileBaton; from leapfrog.utils import cpp\n"
                 f"with cpp.build_lock({name!r}):\n"
                 f"    assert FileBaton({str(lock)!r}).try_acquire()\n"
                 "    print('building', flush=True); time.sleep(600)")
    builder = subprocess.Popen([sys.executable, "-c", mid_build], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline() == "building\n"
    finally:
        builder.kill()
        builder.wait()
    assert lock.exists()   # what the killed builder left
    source = tmp_path / "tiny.cpp"
    source.write_text("int leapfrog_test_tiny() { return 1; }\n")
    with cpp.build_lock(name):
        cpp_extension.load(name, sources=[str(source)], is_python_module=False)
    assert not lock.exists() and (tmp_path / name / f"{name}.so").exists()


def test_build_ahead_builds_side_by_side_once_and_callers_wait():
    """build_ahead starts the libraries' builds in order, ``workers`` at a time; a caller that asks
    for a library mid-build waits for that build's result (no second build), one asked for before
    its thread reached it is built by the caller alone, and a failing build reaches only its own
    callers (False); wait_for_builds joins the threads. The build is replaced by a recorder that
    takes 0.3 s (the real builds run in every test of the ops)."""
    import threading
    import time
    spans: dict[str, list[tuple[float, float, str]]] = {}

    class Recorded(cpp.OpLibrary):
        def _build(self):
            t0 = time.monotonic()
            time.sleep(0.3)
            spans.setdefault(self.name, []).append((t0, time.monotonic(), threading.current_thread().name))
            if self.name == "broken":
                raise RuntimeError("no compiler")

    libs = {n: Recorded(n, "src", [], n, "Python") for n in ("a", "b", "broken", "c", "d")}
    threads = cpp.build_ahead([libs[n].available for n in ("a", "b", "broken", "c")], workers=2)
    assert len(threads) == 2 and all(t.daemon for t in threads)
    time.sleep(0.05)
    assert libs["b"].available()                  # (mid-build: waits for the thread's result)
    assert libs["d"].available()                  # (never queued: this thread builds it)
    cpp.wait_for_builds()
    assert not any(t.is_alive() for t in threads)
    assert not libs["broken"].available() and libs["c"].available()
    assert {n: len(s) for n, s in spans.items()} == dict.fromkeys(("a", "b", "broken", "c", "d"), 1)   # (once each)
    (a,), (b,), (c,), (d,) = spans["a"], spans["b"], spans["c"], spans["d"]
    assert a[0] < b[1] and b[0] < a[1]            # (side by side)
    assert d[2] == threading.current_thread().name and b[2].startswith("leapfrog-build-")
    assert c[0] >= min(a[1], b[1]) - 0.01         # (two at a time)
    assert cpp.build_ahead([]) == []


def test_overlapping_loads_leave_the_dlopen_flags_as_they_found_them():
    """torch.ops.load_library adds RTLD_GLOBAL around its dlopen and puts back what it found; two
    loads overlapping in build_ahead's threads interleave so (replayed here in one thread) that the
    second puts back the first's RTLD_GLOBAL; the loads' guard restores the flags from before both."""
    import os
    import sys
    flags = sys.getdlopenflags()
    first, second = cpp._dlopen_flags_kept(), cpp._dlopen_flags_kept()
    try:
        first.__enter__()
        sys.setdlopenflags(flags | os.RTLD_GLOBAL)     # load 1: torch's guard adds RTLD_GLOBAL
        second.__enter__()
        found = sys.getdlopenflags()                     # load 2: torch's guard finds it on
        sys.setdlopenflags(flags)                        # load 1 ends: its guard puts back what it found
        first.__exit__(None, None, None)
        sys.setdlopenflags(found)                        # load 2 ends: RTLD_GLOBAL back on
        second.__exit__(None, None, None)
        assert sys.getdlopenflags() == flags
    finally:
        sys.setdlopenflags(flags)


def test_build_ahead_without_cpu_affinity(monkeypatch):
    """Where os has no sched_getaffinity (macOS), the CPU count sizes the threads."""
    import os
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    done = []
    threads = cpp.build_ahead([lambda i=i: done.append(i) for i in range(5)])
    for t in threads:
        t.join(5)
    assert len(threads) == 3 and sorted(done) == list(range(5))


def test_build_ahead_imports_torch_dynamo_before_its_threads_start():
    """The caller's thread and the builds both import torch._dynamo lazily; a package two threads
    import at once can leave one a partially initialized module (an LLM() failed so in one
    benchmark process in some 30). build_ahead imports it whole before any thread starts (a fresh
    interpreter: the first import is build_ahead's)."""
    code = ("import sys, threading; from leapfrog.utils import cpp\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "seen = []\n"
            "cpp.build_ahead([lambda: seen.append('torch._dynamo' in sys.modules)])\n"
            "cpp.wait_for_builds()\n"
            "assert seen == [True], seen\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
