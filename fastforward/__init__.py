"""fastforward: an LLM inference engine and server on PyTorch."""

from fastforward.engine import EngineArgs, LLMEngine
from fastforward.entrypoints.llm import LLM
from fastforward.outputs import CompletionOutput, Logprob, RequestOutput
from fastforward.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
