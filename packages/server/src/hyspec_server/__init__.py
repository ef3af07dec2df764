"""Engine with continuous batching, OpenAI-compatible HTTP server, CLI and Python API.

Owns: the engine loop and scheduler (over hyspec_runner's model runner), the `LLM` Python API, the OpenAI
HTTP server and the `hyspec` CLI. Never implements numerics: every op comes from the packages below.
"""

from hyspec_runner.config import EngineArgs

from hyspec_server.engine import LLMEngine
from hyspec_server.llm import LLM
from hyspec_server.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SpecDecodeStats
from hyspec_server.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SpecDecodeStats",
    "StructuredOutputsParams",
]
