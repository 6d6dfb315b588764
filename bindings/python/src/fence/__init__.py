"""Fence client for Python: make an AI agent's side effects happen exactly once.

- :class:`Client` / :class:`AsyncClient`: one method per RPC of ``fence.v1.Fence``, typed.
- :func:`fenced`: fence any function (sync or async) as a tool.
- Typed values (:mod:`fence.types`) and exceptions (:mod:`fence.errors`) carrying the
  structured refusal: ``FenceRefused.reason`` / ``.recovery`` / ``.receipt`` / ``.message``.

The generated protobuf stubs live in :mod:`fence.v1` (built from ``proto/fence/v1/fence.proto``).
"""

from ._requests import BeginCall, CompleteCall
from .aio import AsyncClient
from .client import DEFAULT_TARGET, Client
from .errors import (
    ERROR_DOMAIN,
    FailedBeforeInputError,
    FenceCompletionError,
    FenceEffectUnknown,
    FenceError,
    FenceRefused,
    FenceRpcError,
    FenceTimeout,
    FenceUnavailable,
    FieldViolation,
    StatusDetails,
)
from .fenced import Execution, FencedTool, WaitPolicy, current_execution, fenced, use_run
from .types import (
    BeginResult,
    BranchInfo,
    CheckpointInfo,
    CheckpointResult,
    Compensation,
    CredentialInfo,
    CredentialRegistration,
    Decision,
    DecisionKind,
    EffectState,
    EffectsPage,
    Execute,
    InProgress,
    IntentSchema,
    OperationClass,
    Outcome,
    ReasonCode,
    Receipt,
    RecoveryAction,
    Refusal,
    Replay,
    RestoreEvent,
    RestoreResult,
    Run,
    RunInfo,
    RunsPage,
    StartedRun,
    StringNormalization,
    ToolRegistration,
    ToolSpec,
    ToolsPage,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TARGET",
    "ERROR_DOMAIN",
    "AsyncClient",
    "BeginCall",
    "BeginResult",
    "BranchInfo",
    "CheckpointInfo",
    "CheckpointResult",
    "Client",
    "CompleteCall",
    "Compensation",
    "CredentialInfo",
    "CredentialRegistration",
    "Decision",
    "DecisionKind",
    "EffectState",
    "EffectsPage",
    "Execute",
    "Execution",
    "FailedBeforeInputError",
    "FenceCompletionError",
    "FenceEffectUnknown",
    "FenceError",
    "FenceRefused",
    "FenceRpcError",
    "FenceTimeout",
    "FenceUnavailable",
    "FencedTool",
    "FieldViolation",
    "InProgress",
    "IntentSchema",
    "OperationClass",
    "Outcome",
    "ReasonCode",
    "Receipt",
    "RecoveryAction",
    "Refusal",
    "Replay",
    "RestoreEvent",
    "RestoreResult",
    "Run",
    "RunInfo",
    "RunsPage",
    "StartedRun",
    "StatusDetails",
    "StringNormalization",
    "ToolRegistration",
    "ToolSpec",
    "ToolsPage",
    "WaitPolicy",
    "current_execution",
    "fenced",
    "use_run",
]
