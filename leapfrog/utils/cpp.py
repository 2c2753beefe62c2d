"""Building leapfrog's C++ ops from their inline sources: the compiler flags per CPU instruction
set, and the generic build that serves where the compiler refuses them.

The ops (attention/native.py's cached attention, model/native_ops.py's norm, RoPE and silu * up)
are written for the compiler to vectorize, and each is built once per instruction set with
``torch.utils.cpp_extension.load_inline`` (cached under ``TORCH_EXTENSIONS_DIR``: a build's name
carries the set, so each set is its own cache entry). model/native_linear.py's kernel is written
with the intrinsics of one set per build and picks its builds itself.
"""

from __future__ import annotations

import atexit
import fcntl
import inspect
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("leapfrog.utils")

#: compiler flags per CPU instruction set (torch.backends.cpu.get_cpu_capability(), what ATen's
#: own kernels dispatch on, so an op's vector width is ATen's: model/native_ops.py's silu * up
#: takes ATen's split between vector and scalar code from it)
ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}


def openmp_flags() -> list[str]:
    """-fopenmp where PyTorch was built with OpenMP (else at::parallel_for runs serially)."""
    return ["-fopenmp"] if torch.backends.openmp.is_available() else []


@contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold an flock on extension ``name``'s build directory, so a process killed while it loads
    the op cannot hang every later load. torch's own guard is a ``lock`` file, made and removed by
    every load (a cached build too: ninja checks it), that the next loader waits on until it is
    gone: forever, once the process that made it died in between (a server rank stopped by a
    signal during start-up, say). The kernel drops an flock with its holder, so a ``lock`` file
    found while holding ours was left by a dead loader, and is removed before torch looks."""
    from torch.utils import cpp_extension
    build_dir = cpp_extension._get_build_directory(name, verbose=False)
    with open(os.path.join(build_dir, "leapfrog.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)   # (released on close, or by the kernel at the holder's death)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            log.warning("%s: removing the build lock a killed build left (%s)", name, stale)
            os.remove(stale)
        yield


def load_inline(name: str, source: str, cflags: list[str], module: bool = False) -> Any:
    """Build (or load from the cache) and load ``source`` as op library ``name`` (torch's
    ``load_inline``) with ``cflags`` and OpenMP's flags, under ``build_lock``; ``module``: a
    Python module the source binds with pybind11 (``PYBIND11_MODULE``) -> that module, else None.
    No implicit ``torch/extension.h``: the ops register through ``TORCH_LIBRARY`` and include
    ``torch/library.h`` and ATen's headers themselves (a module, pybind11's headers). The C++ frontend and pybind11 that
    ``torch/extension.h`` pulls in were most of a build's time: 43 s against 16 s for the attention
    op on a 2-vCPU VM, paid by a user's first run and by every fresh CI machine, once per op.
    (An older torch without ``no_implicit_headers`` adds the header: the same ops, built slower.)"""
    from torch.utils import cpp_extension
    omp = openmp_flags()
    slim = ({"no_implicit_headers": True}
            if "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters else {})
    with build_lock(name), _dlopen_flags_kept():
        return cpp_extension.load_inline(name, cpp_sources=source, is_python_module=module, **slim,
                                         extra_cflags=[*cflags, *omp], extra_ldflags=omp)


_loading = {"count": 0, "flags": 0}   # loads in flight (threads of build_ahead), and the dlopen flags before them
_loading_lock = threading.Lock()


@contextmanager
def _dlopen_flags_kept() -> Iterator[None]:
    """torch.ops.load_library adds RTLD_GLOBAL to the process's dlopen flags around its dlopen and
    puts back the flags it found; two loads overlapping in threads (``build_ahead``) can leave
    RTLD_GLOBAL on for every later extension import. The flags found when the first of overlapping
    loads began are put back when the last of them ends."""
    with _loading_lock:
        if not _loading["count"]:
            _loading["flags"] = sys.getdlopenflags()
        _loading["count"] += 1
    try:
        yield
    finally:
        with _loading_lock:
            _loading["count"] -= 1
            if not _loading["count"]:
                sys.setdlopenflags(_loading["flags"])


def with_namespace(source: str, old: str, new: str) -> str:
    """``source``'s op library ``old`` (its TORCH_LIBRARY and TORCH_LIBRARY_IMPL blocks) registered
    as ``new`` instead: a variant of a library built and loaded beside it, to time side by side."""
    if new == old:
        return source
    return source.replace(f"TORCH_LIBRARY({old},", f"TORCH_LIBRARY({new},").replace(
        f"TORCH_LIBRARY_IMPL({old},", f"TORCH_LIBRARY_IMPL({new},")


def build_inline(name: str, source: str, cflags: list[str]) -> str:
    """Build (or load from the cache) and load ``source`` as ``{name}_{set}`` with this CPU's
    instruction-set flags after ``cflags``; if the compiler refuses them, once more as
    ``{name}_generic`` without them. -> the build's suffix ("avx2", "avx512" or "generic").
    Raises the last build's error (no compiler, no headers: callers fall back to ATen)."""
    isa = torch.backends.cpu.get_cpu_capability()
    builds = ([(isa.lower(), ISA_FLAGS[isa])] if isa in ISA_FLAGS else []) + [("generic", [])]
    for i, (suffix, flags) in enumerate(builds):
        try:
            load_inline(f"{name}_{suffix}", source, [*cflags, *flags])
            return suffix
        except Exception as e:  # noqa: BLE001 - the last build's error goes to the caller
            if i == len(builds) - 1:
                raise
            log.warning("%s: the %s build failed (%s); building it generic", name, suffix, type(e).__name__)
    raise AssertionError("unreachable")


#: build_ahead's queues and threads (wait_for_builds; at exit, builds not started are dropped and
#: the process waits for those under way: a compiler left running would race the next load)
_ahead: list[tuple[deque, list[threading.Thread]]] = []


def build_ahead(loaders: Sequence[Callable[[], object]], workers: int | None = None) -> list[threading.Thread]:
    """Start building (or loading from the cache) op libraries in background threads, in the
    order given, ``workers`` at a time (default: this process's CPUs, at most 4) -> the threads.

    Each loader is a library's own memoised, locked loader (``load_native_ops``,
    ``OpLibrary.available``, ...): a caller that needs a library while a thread builds it waits on
    that loader's lock for the result, and a library the caller reached first is built once, by the
    caller. The compiler runs in a process of its own, so the builds run side by side: one after
    another, on first use, the built-in model's five libraries took 42 s of a fresh machine's first
    ``leapfrog generate`` (2 vCPUs; about 8 s each). A loader that fails logs it and returns False
    (its callers take their Python path); these threads swallow anything else it raises, for the
    caller's own call to raise. A process that ends (or fails) first waits at exit for the builds
    under way, not for those queued behind them (``wait_for_builds``)."""
    pending = deque(loaders)
    if not pending:
        return []
    # torch._dynamo is imported lazily, by the caller's thread too (building a model on "meta":
    # torch._refs' normal_), and a package two threads import at once can hand one of them a
    # partially initialized module ("cannot import name 'aot_compile' from partially initialized
    # module 'torch._dynamo'": one tree_bench.py process in some 30 failed so at LLM()): imported
    # here first, whole, before any thread starts
    import torch._dynamo  # noqa: F401

    def run() -> None:
        while True:
            try:
                load = pending.popleft()   # (atomic: the other threads, and wait_for_builds' clear)
            except IndexError:
                return
            try:
                load()
            except Exception:  # noqa: BLE001 - the caller's own call raises it where it matters
                log.debug("building %s ahead failed", getattr(load, "__name__", load), exc_info=True)

    # (no sched_getaffinity on macOS)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(len(pending), workers or min(cpus, 4))
    threads = [threading.Thread(target=run, name=f"leapfrog-build-{i}", daemon=True) for i in range(n)]
    if not _ahead:
        atexit.register(wait_for_builds, cancel=True)
    _ahead[:] = [(p, ts) for p, ts in _ahead if any(t.is_alive() for t in ts)] + [(pending, threads)]
    for t in threads:
        t.start()
    return threads


def wait_for_builds(cancel: bool = False) -> None:
    """Wait for ``build_ahead``'s threads to finish (``cancel``: after dropping the builds they have
    not started)."""
    for pending, threads in list(_ahead):
        if cancel:
            pending.clear()
        for t in threads:
            t.join()


class OpLibrary:
    """An op library of one inline source (``load_inline``), built on first use, once per process:
    ``available()`` -> whether it loaded. A build that fails (no compiler, no headers) is logged
    once, naming ``fallback`` (what serves instead), and the callers take their Python path.
    ``isa``: built with this CPU's instruction-set flags (``build_inline``: a source whose vector
    code must match another library's lanes, such as model/native_ops.py's row kernels).
    ``module``: the source binds a Python module (pybind11), ``module`` once loaded."""

    def __init__(self, name: str, source: str, cflags: list[str], what: str, fallback: str,
                 isa: bool = False, module: bool = False) -> None:
        self.name, self.source, self.cflags, self.what, self.fallback = name, source, cflags, what, fallback
        self.isa, self.binds = isa, module
        self.module: Any = None   # (``module``: the loaded Python module)
        self.build: str | None = None   # (isa: the instruction-set build that loaded, build_inline's suffix)
        self._ok: bool | None = None
        self._lock = threading.Lock()

    def available(self) -> bool:
        if self._ok is not None:   # (decided: no lock on the steps that ask)
            return self._ok
        with self._lock:
            if self._ok is None:
                try:
                    log.info("loading leapfrog's %s (built once)", self.what)
                    self._build()
                    self._ok = True
                except Exception as e:  # noqa: BLE001 - no compiler, headers, ...: the Python path serves
                    log.warning("%s unavailable (%s: %s); %s", self.what, type(e).__name__,
                                str(e).splitlines()[0][:200] if str(e) else "", self.fallback)
                    self._ok = False
        return self._ok

    def loaded(self) -> bool:
        """Whether the library is loaded (never builds it)."""
        return self._ok is True

    def _build(self) -> None:
        if self.isa:
            self.build = build_inline(self.name, self.source, self.cflags)
        else:
            self.module = load_inline(self.name, self.source, self.cflags, module=self.binds)
