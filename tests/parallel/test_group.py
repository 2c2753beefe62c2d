"""The process group's life: leaving it must free gloo's threads before Python exits."""

from __future__ import annotations

import subprocess
import sys

from leapfrog.parallel.group import free_port

# One rank: join, build a model on "meta" (which imports torch._dynamo), exchange a command as the
# engine does, leave; print the thread count before joining and after leaving.
RANK = """
import os, sys, torch, torch.distributed as dist
from leapfrog.model.args import LlamaArgs
from leapfrog.model.llama import LlamaModel
from leapfrog.parallel.group import connect
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
connect(2, int(sys.argv[1]), torch.device("cpu"), "127.0.0.1", int(sys.argv[2]))
with torch.device("meta"):
    LlamaModel(LlamaArgs(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64))
box = [{"op": "stop"}]
dist.broadcast_object_list(box, src=0)
dist.destroy_process_group()
print(before, threads())
"""


def test_leaving_the_group_stops_gloos_threads():
    """Threads that outlive destroy_process_group can free a work item while the interpreter
    finalizes, which aborts the process (SIGABRT at exit, about 1 torchrun run in 3)."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        before, after = map(int, out.split())
        assert after == before, f"{after - before} thread(s) left after destroy_process_group"
