"""AsyncEngine: the engine loop in one background thread, per-request output queues for asyncio.

Requests join and leave between steps (continuous batching). Only the engine thread touches
the LLMEngine: callers send commands (add, abort) through a queue, and outputs come back on
each request's asyncio.Queue through ``loop.call_soon_threadsafe``. The waiting queue is
bounded (``max_waiting``): the server admits a whole request's sequences against it before
calling ``generate`` (``OpenAIServing.admit``). A request's text prompt is tokenized, and its
structured-output matcher compiled, on threads of their own before it reaches the engine's
queue: a 2.5 MB prompt takes about 4 s to tokenize and a large JSON schema about a second to
compile, and on the engine's thread either would stall every running request for that long.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from leapfrog.engine.engine import LLMEngine
from leapfrog.errors import LeapfrogError, RequestError
from leapfrog.outputs import IterationStats, RequestOutput
from leapfrog.request import Prepared
from leapfrog.sampling.grammar import GrammarState
from leapfrog.sampling_params import SamplingParams

log = logging.getLogger("leapfrog.engine")

#: text (characters) above which a prompt tokenizes on the long texts' thread (about 0.1 s of
#: tokenizing on a 2-core EPYC; a 2.5 MB prompt takes about 4 s)
LONG_TEXT_CHARS = 1 << 16


def _text_chars(params: SamplingParams) -> int:
    """How much text ``LLMEngine.prepare(params)`` tokenizes or indexes, an id counted as a
    character (which thread it runs on)."""
    n = 0
    if not isinstance(params, SamplingParams):
        return n
    for v in (params.bad_words, params.stop, params.prediction):
        try:
            n += len(v) if isinstance(v, str) else sum(map(len, v or ()))
        except TypeError:   # (token ids; a wrong type: prepare says why)
            pass
    for v in (params.stop_token_ids, params.allowed_token_ids, params.logit_bias, params.prediction):
        if isinstance(v, (list, tuple, dict)):   # (ids are checked there too: 600k take ~0.1 s)
            n += len(v)
    return n


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class EngineOverloaded(LeapfrogError):
    """More sequences are waiting than the queue bound allows (retry later)."""


@dataclass
class Reservation:
    left: int   # places held in the waiting queue and not yet used by a generate()


class EngineStopped(LeapfrogError):
    """The engine is shutting down."""


class _Worker:
    """One daemon thread running submitted calls in order (tokenizing, compiling grammars).
    Not a ThreadPoolExecutor: the interpreter joins those at exit, so a 4 MB prompt still
    tokenizing (seconds) held the server's exit after its requests had been answered."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.cancel()
                return fut
            if self._thread.ident is None:   # (started with the first call, as a pool's threads are)
                self._thread.start()
            self._jobs.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        """Take no more calls; those queued run unless cancelled (``_in_thread`` cancels its call
        when the engine stops), the running one finishes (or the process exits under it)."""
        with self._lock:
            self._closed = True
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)


@dataclass
class _Add:
    request_id: str
    prompt: str | None
    prompt_ids: list[int] | None
    prepared: Prepared                    # the params, checked and their lists built off the engine's thread
    index: int                            # the choice's (n > 1: its seed is the params' + index)
    num_speculative_tokens: int | None
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    accepted: asyncio.Future
    grammar: GrammarState | None = None   # compiled off the engine's thread (structured outputs)
    arrival_time: float | None = None     # time.monotonic() when generate() was called


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, _Add] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending = 0  # adds sent but not yet drained (guarded by _lock)
        self._closed = False  # set by the engine thread before its final drain (guarded by _lock)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="leapfrog-engine", daemon=True)
        # a thread each: prompts tokenize one at a time and grammars compile one at a time (a slow
        # grammar never holds a plain request back); at most three such threads run beside the
        # engine's (a long text, a normal one, a grammar), each one core
        self._tokenize_pool = _Worker("leapfrog-tokenize")
        # texts over LONG_TEXT_CHARS tokenize on a lane of their own: a 4 MB prompt (seconds, and
        # refused anyway when it can never fit the context) never holds a normal request back
        self._long_tokenize_pool = _Worker("leapfrog-tokenize-long")
        self._grammar_pool = _Worker("leapfrog-grammar")
        #: futures (one per call waiting on a worker) that begin_shutdown resolves: the call's
        #: caller hears EngineStopped at once, not after the prompt ahead of it has tokenized
        self._stop_waiters: set[asyncio.Future] = set()
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self.on_iteration: Callable[[IterationStats], None] | None = None

    # ------------------------------------------------------------------ caller side (asyncio)
    def start(self) -> None:
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every in-flight one with finish_reason "abort" at the
        engine's next step boundary; returns at once (safe in a signal handler: no lock). Calls
        waiting on the tokenizer's or the grammar's thread raise EngineStopped now."""
        self._stop.set()
        self._wake.set()
        for w in list(self._stop_waiters):   # (added and removed on their loop's thread only)
            try:
                w.get_loop().call_soon_threadsafe(_resolve, w)
            except RuntimeError:   # (its loop closed: nobody waits on it)
                pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop and wait for it; in-flight requests end with finish_reason "abort"."""
        self.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for pool in (self._tokenize_pool, self._long_tokenize_pool, self._grammar_pool):
            pool.shutdown()

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending

    def reserve(self, n: int) -> Reservation:
        """Hold ``n`` places in the waiting queue for one API request's sequences, all or none
        (raises EngineOverloaded). Each ``generate`` given the reservation uses one place;
        ``release`` returns the unused ones."""
        with self._lock:
            if self.num_waiting + n > self.max_waiting:
                raise EngineOverloaded(f"{self.num_waiting} sequences are already waiting (limit {self.max_waiting})")
            self._pending += n
        return Reservation(n)

    def release(self, r: Reservation) -> None:
        with self._lock:
            self._pending -= r.left
            r.left = 0

    async def generate(self, request_id: str, prompt: str | None, prompt_ids: list[int] | None,
                       params: SamplingParams | Prepared, num_speculative_tokens: int | None = None,
                       reservation: Reservation | None = None,
                       on_accepted: Callable[[], None] | None = None, index: int = 0,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs until finished; leaving early (even before the engine
        accepted the request) aborts the request. ``on_accepted`` is called (on the event loop)
        once the engine has accepted the request, before its first output: a caller running
        several requests as one answer holds its first bytes until every one is accepted.
        ``params``: a SamplingParams, or ``prepare(params)``'s result, shared by one API request's
        choices and prompts (else prepared here); ``index``: the choice's (``LLMEngine.add_request``);
        ``arrival_time`` (time.monotonic()): when the request arrived, if before this call (its
        params prepared: TTFT counts it), default now."""
        loop = asyncio.get_running_loop()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        # prepared off the engine's thread (a bad prompt or constraint raises its RequestError here;
        # leaving now leaves nothing in the engine to abort)
        prepared = params if isinstance(params, Prepared) else await self.prepare(params)
        params = prepared.params
        if prompt_ids is None and isinstance(prompt, str):
            prompt_ids = await self.in_tokenizer_thread(self.engine.encode_prompt, prompt, chars=len(prompt))
        grammar = None
        if params.structured_outputs is not None:
            grammar = await self._in_thread(self._grammar_pool, self.engine.compile_grammar, params)
        cmd = _Add(request_id, prompt, prompt_ids, prepared, index, num_speculative_tokens, loop, asyncio.Queue(),
                   loop.create_future(), grammar, arrival)
        with self._lock:  # the engine thread's final drain takes this lock after setting _closed
            if self._closed or self._stop.is_set():
                raise EngineStopped("the server is shutting down")
            if reservation is not None and reservation.left > 0:
                reservation.left -= 1   # its place was counted in _pending already
            else:
                self._pending += 1
            self._cmds.put(cmd)
        self._wake.set()
        finished = False
        try:
            await cmd.accepted  # raises the engine's RequestError for bad requests
            if on_accepted is not None:
                on_accepted()
            while True:
                out = await cmd.out.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        except RequestError:
            finished = True   # refused at the door: never added, nothing to abort
            raise
        finally:
            if not finished:
                self.abort(request_id)   # queued after the add, so it always finds the request

    async def prepare(self, params: SamplingParams) -> Prepared:
        """``LLMEngine.prepare(params)`` on the tokenizer's thread: the params validated and checked
        against the model, bad words tokenized (100k take 9 s), stop strings indexed (4 MiB of
        them a quarter of a second), a text prediction tokenized. A caller running several
        choices or prompts of one request passes the result to each one's ``generate``."""
        return await self.in_tokenizer_thread(self.engine.prepare, params, chars=_text_chars(params))

    async def in_tokenizer_thread(self, fn: Callable, *args, chars: int = 0):
        """``fn(*args)`` on the tokenizer's thread: tokenizing (a prompt, a chat template) on the
        event loop would hold every stream's chunks, on the engine's thread every request.
        ``chars``: how much text it tokenizes; over LONG_TEXT_CHARS, on the long texts' thread (the
        two share the tokenizer: HF tokenizers encode concurrently without truncation settings)."""
        pool = self._long_tokenize_pool if chars > LONG_TEXT_CHARS else self._tokenize_pool
        return await self._in_thread(pool, fn, *args)

    async def _in_thread(self, pool: _Worker, fn: Callable, *args):
        """``fn(*args)`` on ``pool``'s thread; EngineStopped as soon as the engine begins to shut
        down (the call, if it runs already, finishes unheard; if queued, never runs)."""
        if self._closed or self._stop.is_set():   # the pools shut down with the engine
            raise EngineStopped("the server is shutting down")
        loop = asyncio.get_running_loop()
        fut = asyncio.wrap_future(pool.submit(fn, *args))
        stop = loop.create_future()
        self._stop_waiters.add(stop)
        try:
            if self._stop.is_set():   # (begun between the check above and the add)
                _resolve(stop)
            await asyncio.wait({fut, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not fut.done() or fut.cancelled():   # (cancelled: the pool shut down under it)
                raise EngineStopped("the server is shutting down")
            return fut.result()
        finally:
            self._stop_waiters.discard(stop)
            fut.cancel()   # (done: no effect; left early: a queued call never runs)

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _resolve(self, cmd: _Add, exc: BaseException | None) -> None:
        def set_() -> None:
            if cmd.accepted.done():
                return
            if exc is None:
                cmd.accepted.set_result(True)
            else:
                cmd.accepted.set_exception(exc)
        cmd.loop.call_soon_threadsafe(set_)

    def _deliver(self, out: RequestOutput | BaseException, cmd: _Add) -> None:
        cmd.loop.call_soon_threadsafe(cmd.out.put_nowait, out)

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.prompt_ids, cmd.prepared, cmd.index,
                                            num_speculative_tokens=cmd.num_speculative_tokens,
                                            grammar=cmd.grammar, arrival_time=cmd.arrival_time)
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    self._resolve(cmd, e)
                else:
                    self._streams[cmd.request_id] = cmd
                    self._resolve(cmd, None)
                finally:
                    with self._lock:   # after the add: num_waiting never under-counts
                        self._pending -= 1
            else:
                _, rid = cmd
                out = self.engine.abort(rid)
                stream = self._streams.pop(rid, None)
                if out is not None:
                    self._finished(out)
                if out is not None and stream is not None:
                    self._deliver(out, stream)

    def _finished(self, out: RequestOutput) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:  # noqa: BLE001 - metrics must not take the engine down
                log.exception("on_finished callback failed")

    def _fail_all(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s failed", rid)
            self._deliver(exc, stream)
        self._streams.clear()

    def _run(self) -> None:
        """The engine loop. Anything that escapes a step (a bug: the engine isolates request
        failures itself) fails the running requests; the loop itself never dies."""
        while not self._stop.is_set():
            try:
                self._drain()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if self.on_iteration is not None:
                    try:
                        self.on_iteration(self.engine.iteration)
                    except Exception:  # noqa: BLE001 - metrics must not take the engine down
                        log.exception("on_iteration callback failed")
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                        self._finished(out)
                    if stream is not None:
                        self._deliver(out, stream)
            except Exception as e:  # noqa: BLE001
                log.exception("engine loop failed")
                self._fail_all(e)
        # shutting down: refuse new adds, take the ones already queued, abort everything, tell every caller
        with self._lock:
            self._closed = True
        try:
            self._drain()
        except Exception:  # noqa: BLE001
            log.exception("final drain failed")
        for rid, stream in list(self._streams.items()):
            out = self.engine.abort(rid)
            self._deliver(out if out is not None else EngineStopped("shutdown"), stream)
        self._streams.clear()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()
