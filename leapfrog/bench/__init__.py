"""``leapfrog bench``: measure speculation on your own workload (prompts, configs, batch sizes)."""

from leapfrog.bench.runner import BenchResult, run_bench
from leapfrog.bench.workloads import WorkloadItem, load_workload

__all__ = ["BenchResult", "WorkloadItem", "load_workload", "run_bench"]
