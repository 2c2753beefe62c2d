"""leapfrog: a speculative-decoding LLM inference engine."""

from leapfrog.entrypoints.llm import LLM
from leapfrog.outputs import CompletionOutput, RequestOutput
from leapfrog.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
