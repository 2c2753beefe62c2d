"""Tensor-parallel execution: rank 0's runner that tells the workers what to run, the workers'
loop, and how rank 0 starts them (and notices when one dies).

Every forward of the target is one collective program: rank 0 broadcasts a ``Command`` (the
chunks of ``ModelRunner.step``, or a KV column move), then every rank runs the same method on its
shard with the same arguments. Only rank 0 tracks KV lengths (kv/manager.py): the chunks carry
every row and column a forward touches, so the workers' caches follow without state of their own.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from leapfrog.model.runner import ModelRunner, SeqChunk, StepOutput
from leapfrog.parallel.group import TPGroup, WorkerDied, free_port

log = logging.getLogger("leapfrog.parallel")


@dataclass
class Command:
    op: str                      # "step" | "move_cols" | "stop"
    args: tuple = ()


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard and runner (picklable: sent to spawned processes)."""
    model: str                   # a local checkpoint directory (the same path on every machine)
    dtype: str                   # torch dtype name, already resolved by rank 0
    device: str
    max_model_len: int
    num_rows: int
    size: int
    allow_pickle: bool = False
    shm_name: str | None = None  # rank 0's shared-memory segment (same-machine CPU ranks)


class TPModelRunner(ModelRunner):
    """Rank 0's runner: each forward (and KV move) is first broadcast to the workers."""

    def __init__(self, model: Any, num_rows: int, max_model_len: int, tp: TPGroup, batch_invariant: bool = False):
        super().__init__(model, num_rows, max_model_len, batch_invariant=batch_invariant)
        self.tp = tp

    def step(self, chunks: list[SeqChunk], hidden: str | tuple[int, ...] | None = None) -> StepOutput:
        t0 = time.perf_counter()
        self._send(Command("step", (chunks, hidden)))
        out = super().step(chunks, hidden)
        self.tp.stats.forwards += 1
        self.tp.stats.forward_seconds += time.perf_counter() - t0
        return out

    def move_cols(self, row: int, src: list[int], dst: list[int]) -> None:
        self._send(Command("move_cols", (row, src, dst)))
        super().move_cols(row, src, dst)


    def _send(self, cmd: Command) -> None:
        self.tp.check_alive()
        try:
            self.tp.broadcast(cmd)
        except Exception as e:  # noqa: BLE001 - a peer went away mid-broadcast
            self.tp.dead = self.tp.dead or f"tensor-parallel broadcast failed: {e}"
            raise WorkerDied(self.tp.dead) from e


def stop_workers(tp: TPGroup) -> None:
    """Tell the workers to exit (they return from ``serve_steps``); nothing when one is dead."""
    if tp.dead is None:
        tp.broadcast(Command("stop"))


def serve_steps(runner: ModelRunner, tp: TPGroup) -> None:
    """A worker's loop: run what rank 0 broadcasts until told to stop."""
    while True:
        cmd: Command = tp.broadcast()
        if cmd.op == "stop":
            return
        if cmd.op == "step":
            runner.step(*cmd.args)
        elif cmd.op == "move_cols":
            runner.move_cols(*cmd.args)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {cmd.op!r}")


def build_shard(ckpt: Any, spec: WorkerSpec, tp: TPGroup) -> ModelRunner:
    """This rank's shard of the target (``ckpt``: spec.model's Checkpoint), packed for inference,
    and its runner."""
    from leapfrog.model.loader import load_model
    model = load_model(ckpt, getattr(torch, spec.dtype), tp.device, spec.max_model_len,
                       spec.allow_pickle, pack=True, tp=tp)
    return ModelRunner(model, spec.num_rows, spec.max_model_len)


def worker_device(device: str, local_rank: int) -> torch.device:
    """A worker's device: its own GPU (by local rank) when the group runs on CUDA."""
    return torch.device(f"cuda:{local_rank}") if device.startswith("cuda") else torch.device(device)


def run_worker(size: int, rank: int, device: str, master_addr: str | None = None, master_port: int | None = None,
               threads: int | None = None) -> int:
    """A worker rank, start to end: join the group (torchrun's environment when ``master_addr``
    is None), take rank 0's WorkerSpec, load the shard, serve steps. -> an exit code; any failure
    is logged and ends the process (rank 0 notices the closed connection or the exit)."""
    from leapfrog.model.loader import read_checkpoint
    from leapfrog.parallel.group import connect, make_group
    if threads:
        torch.set_num_threads(threads)
    try:
        dev = worker_device(device, int(os.environ.get("LOCAL_RANK", rank)))
        connect(size, rank, dev, master_addr, master_port)
        import torch.distributed as dist
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        spec: WorkerSpec = box[0]
        ckpt = read_checkpoint(spec.model)
        tp = make_group(ckpt.args, size, dev)
        if spec.shm_name is not None:
            from leapfrog.parallel.shm import ShmChannel
            tp.shm = ShmChannel(size, rank, name=spec.shm_name)
        runner = build_shard(ckpt, spec, tp)
        with torch.inference_mode():
            serve_steps(runner, tp)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported, then the process ends with an error code
        log.error("tensor-parallel worker rank %d failed:\n%s", rank, traceback.format_exc())
        return 1
    return 0


@dataclass
class Workers:
    """The worker processes rank 0 started, watched by a thread."""
    processes: list[subprocess.Popen] = field(default_factory=list)
    stopping: bool = False

    def watch(self, tp: TPGroup, on_death: Callable[[str], None] | None) -> None:
        """Mark ``tp`` dead (and call ``on_death``) as soon as a worker exits unasked."""
        def run(rank: int, p: subprocess.Popen) -> None:
            code = p.wait()
            if self.stopping or tp.dead is not None:
                return
            why = f"tensor-parallel worker rank {rank} exited (code {code})"
            log.error("%s; the engine cannot run the sharded model any more", why)
            tp.dead = why
            if on_death is not None:
                on_death(why)

        for rank, p in enumerate(self.processes, start=1):
            threading.Thread(target=run, args=(rank, p), name=f"leapfrog-tp-watch{rank}", daemon=True).start()

    def join(self, timeout: float = 10.0) -> None:
        self.stopping = True
        for p in self.processes:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def spawn_workers(spec: WorkerSpec, threads: int | None = None) -> tuple[Workers, str, int]:
    """Start ranks 1..size-1 on this machine as ``python -m leapfrog.parallel.worker`` processes
    (not multiprocessing: a caller's script needs no ``if __name__ == "__main__"`` guard);
    -> (workers, master address, port) for rank 0 to join."""
    addr, port = "127.0.0.1", free_port()
    workers = Workers()
    for rank in range(1, spec.size):
        cmd = [sys.executable, "-m", "leapfrog.parallel.worker", str(spec.size), str(rank), spec.device, addr,
               str(port), str(threads or 0)]
        workers.processes.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
    return workers, addr, port


def _exit_with_parent(interval: float = 0.5) -> None:
    """A spawned worker ends when rank 0's process does, however it ended (a collective waiting on
    a peer that vanished does not always notice by itself)."""
    parent = os.getppid()

    def run() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                log.error("rank 0 (pid %d) is gone; exiting", parent)
                os._exit(1)

    threading.Thread(target=run, name="leapfrog-tp-parent", daemon=True).start()


def main(argv: list[str]) -> int:
    """``python -m leapfrog.parallel.worker SIZE RANK DEVICE ADDR PORT THREADS`` (rank 0 runs this)."""
    size, rank, device, addr, port, threads = argv
    logging.basicConfig(level=logging.INFO, format=f"[leapfrog tp rank {rank}] %(levelname)s %(message)s")
    _exit_with_parent()
    return run_worker(int(size), int(rank), device, addr, int(port), int(threads) or None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
