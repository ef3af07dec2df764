"""Model runner for hybrid models: the engine's configuration, memory sizing, CUDA graphs and one forward per
engine step, speculative rounds included.

Owns: `EngineArgs` (validated once), the memory plan and the state pool behind the scheduler's
`RequestMemory`, the target's CUDA graphs, `HyspecModelRunner` (prefill chunks, decode rows and verify blocks
in one forward; sampling; the decode queued ahead) and the request view it reads (`schedule.RunnerRequest`).
Never schedules, detokenizes or talks HTTP: the server composes it.
"""

from hyspec_runner.config import EngineArgs
from hyspec_runner.model_runner import HyspecModelRunner
from hyspec_runner.runner import ModelRunner, RunnerOutput
from hyspec_runner.schedule import RunnerRequest, ScheduledChunk, SchedulerOutput

__version__ = "0.1.0"

__all__ = [
    "EngineArgs",
    "HyspecModelRunner",
    "ModelRunner",
    "RunnerOutput",
    "RunnerRequest",
    "ScheduledChunk",
    "SchedulerOutput",
]
