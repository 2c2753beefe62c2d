"""benchmarks/gpu_bench.py's helpers that run without a GPU (the script itself needs CUDA)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from leapfrog import LLM


def _gpu_bench():
    path = Path(__file__).parents[2] / "benchmarks" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = mod   # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_forward_kernels_are_one_decode_forwards_ops(llama_dir):
    """The per-forward profile cancels the prefill: each decoder layer's linears appear once per
    layer per forward, and the step's ops are counted per forward, not per request."""
    llm = LLM(model=str(llama_dir), dtype="float32", enforce_eager=True, max_num_seqs=1, max_model_len=128)
    layers = llm.engine.model.args.num_hidden_layers
    rows = _gpu_bench().forward_kernels(llm, list(range(5, 21)), n=4, cuda=False)
    assert rows and len(rows) <= 15
    assert all(ms > 0 and calls > 0 for _, ms, calls in rows)
    calls = {key: c for key, _, c in rows}
    linear = [c for key, c in calls.items() if key in ("aten::linear", "aten::mm", "aten::addmm")
              or "linear" in key.lower()]
    assert linear, sorted(calls)
    assert max(linear) >= layers   # at least one linear per layer per forward
    assert max(linear) < 16 * layers   # per forward, not summed over the 4 forwards and the prefill
