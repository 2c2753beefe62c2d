"""The tensor-parallel process group: its collectives, and how it is started.

Rank 0 runs everything a request touches (engine loop, scheduler, proposer, sampler, server) and
the sharded target like every rank; worker ranks run only the target's forwards, told what to run
by rank 0 (``broadcast``). Per verify/decode step the wire carries:

- rank 0 -> all: the step's chunks (token ids, rows, columns: a few hundred bytes, pickled);
- all-reduce of [tokens, hidden_size] activations twice per layer (o_proj, down_proj) and once
  for the embedding lookup;
- all -> rank 0: the LM head's vocabulary slices, only for the rows the sampler reads.

Ranks on one machine with CPU tensors exchange through shared memory (parallel/shm.py: 55 us per
all-reduce against gloo's 1.1-1.5 ms on 2 cores); across machines, gloo (CPU) or NCCL (GPU).

Started in one of two ways: ``spawn`` (one machine: rank 0 starts N - 1 worker processes itself)
or the environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: several machines).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from leapfrog.errors import ConfigError, LeapfrogError
from leapfrog.model.args import LlamaArgs
from leapfrog.parallel.shard import Shard
from leapfrog.parallel.shm import ShmChannel

log = logging.getLogger("leapfrog.parallel")

#: collectives wait this long for a peer; a dead peer closes its sockets and fails them at once,
#: so this only bounds a peer that hangs. Idle workers wait for rank 0's next command in a
#: collective too, hence no short timeout.
TIMEOUT = datetime.timedelta(days=7)


class WorkerDied(LeapfrogError):
    """A tensor-parallel rank exited: the sharded model cannot run any more."""


def backend_for(device: torch.device) -> str:
    """nccl on CUDA, gloo on CPU; a clear error when torch.distributed lacks it."""
    if not dist.is_available():
        raise ConfigError("tensor parallelism needs torch.distributed, which this PyTorch build lacks")
    name = "nccl" if device.type == "cuda" else "gloo"
    ok = dist.is_nccl_available() if name == "nccl" else dist.is_gloo_available()
    if not ok:
        raise ConfigError(f"tensor parallelism on {device.type} needs the {name} backend, which this PyTorch "
                          "build lacks")
    return name


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


@dataclass
class CommStats:
    """Rank 0's counters: collectives, the bytes they carried from this rank, the time spent in
    them (wire time plus waiting for the slower rank), and the target forwards they served.
    ``commands``/``command_seconds``: the part of those that were rank 0's broadcast commands (the
    chunks of a step, drafts included)."""
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    forwards: int = 0
    forward_seconds: float = 0.0
    commands: int = 0
    command_seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.seconds += seconds

    def snapshot(self) -> dict[str, float]:
        return {"calls": self.calls, "bytes": self.bytes, "seconds": self.seconds,
                "forward_seconds": self.forward_seconds, "commands": self.commands,
                "command_seconds": self.command_seconds}


@dataclass
class TPGroup:
    """One rank's view: its shard of the model and the collectives over the default group."""
    shard: Shard
    device: torch.device
    dead: str | None = None   # set (by rank 0's watchdog) when a rank exited
    stats: CommStats = field(default_factory=CommStats)
    shm: ShmChannel | None = None   # same-machine CPU ranks: collectives through shared memory

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum of every rank's ``t``, in place."""
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.fits(t):
            self.shm.all_reduce(t)
        else:
            dist.all_reduce(t)
        self.stats.add(t.numel() * t.element_size(), time.perf_counter() - t0)
        return t

    def gather_vocab(self, local: Tensor) -> Tensor:
        """Per-rank logits [N, V/n] -> rank 0: [N, V] (padding columns cut); other ranks get their
        own slice back (they never sample)."""
        local = local.contiguous()
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.fits(local):
            parts = self.shm.gather(local)
        else:
            parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(local, parts, dst=0)
        self.stats.add(local.numel() * local.element_size(), time.perf_counter() - t0)
        if self.rank != 0:
            return local
        assert parts is not None
        return torch.cat(parts, dim=-1)[..., :self.shard.args.vocab_size]

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj`` (pickled) to every rank; every rank returns it."""
        t0 = time.perf_counter()
        if self.shm is not None:
            if self.rank == 0:
                self.shm.send(obj)
            else:
                obj = self.shm.recv()
        else:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            obj = box[0]
        dt = time.perf_counter() - t0
        self.stats.add(0, dt)   # (pickled size unknown here: a few hundred bytes)
        self.stats.commands += 1
        self.stats.command_seconds += dt
        return obj

    def check_alive(self) -> None:
        if self.dead is not None:
            raise WorkerDied(self.dead)


def connect(size: int, rank: int, device: torch.device, master_addr: str | None = None,
            master_port: int | None = None) -> int:
    """Join the default process group as ``rank`` of ``size`` (from torchrun's environment when
    ``master_addr`` is None); -> this process's rank."""
    backend = backend_for(device)
    # torch._dynamo must be imported before the group exists (building the model on "meta"
    # imports it otherwise): imported after, it keeps references to the default group that
    # destroy_process_group cannot drop, so gloo's threads outlive the interpreter and one that
    # frees its last broadcast while Python finalizes aborts the process ("terminate called
    # without an active exception", exit -6; about 1 torchrun run in 3).
    import torch._dynamo  # noqa: F401
    if not dist.is_initialized():
        if master_addr is None:
            dist.init_process_group(backend, timeout=TIMEOUT)
        else:
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                    world_size=size, timeout=TIMEOUT)
    if dist.get_world_size() != size:
        n = dist.get_world_size()
        dist.destroy_process_group()
        raise ConfigError(f"tensor_parallel_size={size} but the process group has {n} ranks "
                          "(torchrun's --nnodes x --nproc-per-node must equal --tensor-parallel-size)")
    return dist.get_rank()


def make_group(args: LlamaArgs, size: int, device: torch.device) -> TPGroup:
    """This rank's TPGroup (after ``connect``)."""
    return TPGroup(Shard(dist.get_rank(), size, args), device)
