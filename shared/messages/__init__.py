"""Message Structs, one module per subject family.

Names tell the kind: commands are imperatives (`Generate`, `Vacate`), events are
past tense (`TrajectoryCompleted`, `WeightsPublished`). New fields get defaults
and are appended, so old and new services can talk during a rolling upgrade.
"""

from shared.messages.chat import (
    ChatCancel,
    ChatDelta,
    ChatDone,
    ChatFailed,
    ChatReply,
    ChatRequest,
    TokenLogprob,
    ToolCall,
    Usage,
)
from shared.messages.rollout import (
    Generate,
    GenerateDone,
    RolloutControl,
    RolloutReply,
    Sampling,
    TokenDelta,
    WorkerStatus,
)
from shared.messages.scheduler import (
    HostAssignment,
    HostHeartbeat,
    HostModeChanged,
    SchedulerControl,
    SchedulerReply,
    TrainerControl,
    TrainerStatus,
    TrainGate,
    TrainGateReply,
)
from shared.messages.session import SessionReply, SessionRequest
from shared.messages.trajectory import Sample, TrajectoryCompleted
from shared.messages.weights import WeightsPublished

__all__ = [
    "ChatCancel", "ChatDelta", "ChatDone", "ChatFailed", "ChatReply", "ChatRequest", "TokenLogprob", "ToolCall",
    "Usage",
    "Generate", "GenerateDone", "RolloutControl", "RolloutReply", "Sampling", "TokenDelta",
    "WorkerStatus", "SessionReply", "SessionRequest", "Sample", "TrajectoryCompleted",
    "WeightsPublished",
    "HostAssignment", "HostHeartbeat", "HostModeChanged", "SchedulerControl", "SchedulerReply", "TrainerControl",
    "TrainerStatus", "TrainGate", "TrainGateReply",
]
