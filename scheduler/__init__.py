"""The scheduler: which sequences run in the next step, and with what storage."""

from pdserve.scheduler.block_pool import AllocStatus, BlockPool
from pdserve.scheduler.config import EngineType, SchedulerConfig
from pdserve.scheduler.output import ScheduledRow, SchedulerOutput, StepKind, StepResult
from pdserve.scheduler.positions import query_positions, ring_destinations
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.sequence import Sequence, SequenceStatus
from pdserve.scheduler.votes import Communicator, SingleRankCommunicator

__all__ = [
    "AllocStatus", "BlockPool", "Communicator", "EngineType", "SamplingParams",
    "ScheduledRow", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Sequence",
    "SequenceStatus", "SingleRankCommunicator", "StepKind", "StepResult", "query_positions",
    "ring_destinations",
]
