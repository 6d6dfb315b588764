"""Typed values of the Fence API: enums mirroring ``fence.v1`` and frozen dataclasses.

The enums carry the proto's numbers (a test checks they match the generated descriptors), and
a value this version does not know (a newer server) converts to a pseudo-member named
``UNKNOWN_<n>`` instead of failing, so deterministic retry logic can still fail closed on it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from .v1 import fence_pb2 as pb

__all__ = [
    "Backup",
    "BackupReport",
    "Compacted",
    "BeginResult",
    "BranchInfo",
    "CheckpointInfo",
    "CheckpointResult",
    "Compensation",
    "CredentialInfo",
    "CredentialRegistration",
    "Decision",
    "DecisionKind",
    "EffectState",
    "EffectsPage",
    "Execute",
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
    "StringNormalization",
    "ToolRegistration",
    "ToolSpec",
    "ToolsPage",
]


class _ProtoEnum(enum.IntEnum):
    """An IntEnum that tolerates values added to the proto after this client was built."""

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            member = int.__new__(cls, value)
            member._name_ = f"UNKNOWN_{value}"
            member._value_ = value
            return member
        return None


class OperationClass(_ProtoEnum):
    """How a tool may be retried (``fence.v1.OperationClass``)."""

    OPERATION_CLASS_UNSPECIFIED = 0
    SAFE_RETRY = 1
    DEDUPLICATE = 2
    REQUIRES_EFFECT_CHECK = 3
    NON_RETRYABLE = 4


class EffectState(_ProtoEnum):
    """The state of a recorded effect (``fence.v1.EffectState``)."""

    EFFECT_STATE_UNSPECIFIED = 0
    ACCEPTED = 1
    RUNNING = 2
    COMPLETED = 3
    FAILED_BEFORE_INPUT = 4
    EFFECT_UNKNOWN = 5
    REJECTED_DUPLICATE = 6
    NOT_FOUND = 7
    COMPENSATED = 8


class ReasonCode(_ProtoEnum):
    """Why a call was refused (``fence.v1.ReasonCode``)."""

    REASON_CODE_UNSPECIFIED = 0
    FORK_REQUIRED = 1
    ARGUMENT_MISMATCH = 2
    DUPLICATE_INTENT = 3
    CREDENTIAL_CONSUMED = 4
    STALE_EPOCH = 5
    EXPIRED = 6
    RECONCILE_REQUIRED = 7
    CREDENTIAL_MISMATCH = 8
    RESULT_CONFLICT = 9
    UNKNOWN_RECORD = 10
    INVALID_TRANSITION = 11
    LEASE_LOST = 12
    EVIDENCE_REQUIRED = 13
    LIMIT_EXCEEDED = 14
    UNKNOWN_EPOCH = 15


class RecoveryAction(_ProtoEnum):
    """What a caller should do about a refusal (``fence.v1.RecoveryAction``)."""

    RECOVERY_ACTION_UNSPECIFIED = 0
    REPLAY_RESULT = 1
    WAIT_AND_QUERY = 2
    RECONCILE = 3
    FORK = 4
    FIX_ARGUMENT = 5
    REAUTHENTICATE = 6
    STOP = 7
    REFRESH_EPOCH = 8
    CONFIRM_REPEAT = 9


class StringNormalization(_ProtoEnum):
    """How normalised intent fields are compared (``fence.v1.StringNormalization``)."""

    STRING_NORMALIZATION_UNSPECIFIED = 0
    TRIM = 1
    TRIM_LOWERCASE = 2


class DecisionKind(enum.Enum):
    """Which arm of ``fence.v1.Decision`` a Begin answered with."""

    EXECUTE = "execute"
    REPLAY = "replay"
    IN_PROGRESS = "in_progress"
    REFUSED = "refused"


def _enum_by_name(cls: type[_ProtoEnum], name: str) -> _ProtoEnum:
    """Parses an enum from its proto name (as carried in ErrorInfo); unknown -> UNSPECIFIED."""
    try:
        return cls[name]
    except KeyError:
        return cls(0)


# ------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IntentSchema:
    """Which argument fields are volatile and how string fields are normalised."""

    volatile_fields: tuple[str, ...] = ()
    normalized_fields: tuple[str, ...] = ()
    string_normalization: StringNormalization = StringNormalization.STRING_NORMALIZATION_UNSPECIFIED

    @classmethod
    def from_proto(cls, m: pb.IntentSchema) -> IntentSchema:
        return cls(
            volatile_fields=tuple(m.volatile_fields),
            normalized_fields=tuple(m.normalized_fields),
            string_normalization=StringNormalization(m.string_normalization),
        )

    def to_proto(self) -> pb.IntentSchema:
        return pb.IntentSchema(
            volatile_fields=list(self.volatile_fields),
            normalized_fields=list(self.normalized_fields),
            string_normalization=int(self.string_normalization),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class ToolSpec:
    """A tool's registration. ``cls`` is the proto's ``class`` field."""

    name: str
    cls: OperationClass
    intent_schema: IntentSchema = field(default_factory=IntentSchema)
    retention_ms: int = 0
    lease_ms: int = 0
    version: int = 0
    registered_at_ms: int = 0

    @classmethod
    def from_proto(cls, m: pb.ToolSpec) -> ToolSpec:
        return cls(
            name=m.name,
            cls=OperationClass(getattr(m, "class")),
            intent_schema=IntentSchema.from_proto(m.intent_schema),
            retention_ms=m.retention_ms,
            lease_ms=m.lease_ms,
            version=m.version,
            registered_at_ms=m.registered_at_ms,
        )

    def to_proto(self) -> pb.ToolSpec:
        m = pb.ToolSpec(
            name=self.name,
            intent_schema=self.intent_schema.to_proto(),
            retention_ms=self.retention_ms,
            lease_ms=self.lease_ms,
        )
        setattr(m, "class", int(self.cls))
        return m


@dataclass(frozen=True)
class ToolRegistration:
    """RegisterTool's answer: the stored definition, and whether this call made a new version."""

    tool: ToolSpec
    created: bool


# ------------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------------


@dataclass
class Run:
    """The caller's handle on a run: which run, which branch, which epoch.

    Mutable on purpose: :meth:`fence.Client.restore` and :meth:`fence.Client.fork` update the
    handle they are given (new epoch; new branch), and a fenced call that sent epoch 0 adopts
    the epoch the server answered with. A refusal never changes it (a ``STALE_EPOCH`` refusal
    means this process may be a zombie: it must refresh deliberately, e.g. with ``GetRun``).
    """

    run_id: str
    branch: str = "main"
    epoch: int = 0


@dataclass(frozen=True)
class CheckpointInfo:
    """A named position in a branch's effect log."""

    checkpoint_id: str
    branch: str
    position: int
    epoch: int
    created_at_ms: int

    @classmethod
    def from_proto(cls, m: pb.CheckpointInfo) -> CheckpointInfo:
        return cls(m.checkpoint_id, m.branch, m.position, m.epoch, m.created_at_ms)


@dataclass(frozen=True)
class BranchInfo:
    """A line of a run's history."""

    name: str
    parent: str
    forked_from_checkpoint: str
    fork_position: int
    reason: str
    length: int
    pending_replays: int
    restored_from_checkpoint: str
    created_epoch: int
    created_at_ms: int
    #: Effects carried from the parent (done there after the fork point) not yet re-issued here.
    pending_carried: int = 0
    #: Filled in the answer to ``fork`` only: the carried effects themselves. They stay done: an
    #: equivalent call on the new branch replays one instead of running it again.
    carried: tuple[Receipt, ...] = ()

    @classmethod
    def from_proto(cls, m: pb.BranchInfo) -> BranchInfo:
        return cls(
            name=m.name,
            parent=m.parent,
            forked_from_checkpoint=m.forked_from_checkpoint,
            fork_position=m.fork_position,
            reason=m.reason,
            length=m.length,
            pending_replays=m.pending_replays,
            restored_from_checkpoint=m.restored_from_checkpoint,
            created_epoch=m.created_epoch,
            created_at_ms=m.created_at_ms,
            pending_carried=m.pending_carried,
        )


@dataclass(frozen=True)
class RestoreEvent:
    """One Restore in a run's history."""

    epoch: int
    checkpoint_id: str
    branch: str
    tape_effect_ids: tuple[str, ...]
    at_ms: int

    @classmethod
    def from_proto(cls, m: pb.RestoreEvent) -> RestoreEvent:
        return cls(m.epoch, m.checkpoint_id, m.branch, tuple(m.tape_effect_ids), m.at_ms)


@dataclass(frozen=True)
class RunInfo:
    """A run's state."""

    run_id: str
    epoch: int
    branches: tuple[BranchInfo, ...]
    checkpoints: tuple[CheckpointInfo, ...]
    restores: tuple[RestoreEvent, ...]
    effect_count: int
    created_at_ms: int

    @classmethod
    def from_proto(cls, m: pb.RunInfo) -> RunInfo:
        return cls(
            run_id=m.run_id,
            epoch=m.epoch,
            branches=tuple(BranchInfo.from_proto(b) for b in m.branches),
            checkpoints=tuple(CheckpointInfo.from_proto(c) for c in m.checkpoints),
            restores=tuple(RestoreEvent.from_proto(r) for r in m.restores),
            effect_count=m.effect_count,
            created_at_ms=m.created_at_ms,
        )

    def branch(self, name: str) -> BranchInfo | None:
        """The branch called ``name``, if any."""
        return next((b for b in self.branches if b.name == name), None)


@dataclass(frozen=True)
class StartedRun:
    """StartRun's answer."""

    run: RunInfo
    created: bool


@dataclass(frozen=True)
class CheckpointResult:
    """Checkpoint's answer."""

    checkpoint: CheckpointInfo
    created: bool


# ------------------------------------------------------------------------------------------
# Effects
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compensation:
    """A saga step's compensation: the call that undoes it."""

    tool: str
    arguments_json: str

    @classmethod
    def from_proto(cls, m: pb.Compensation) -> Compensation:
        return cls(m.tool, m.arguments_json)

    def to_proto(self) -> pb.Compensation:
        return pb.Compensation(tool=self.tool, arguments_json=self.arguments_json)


@dataclass(frozen=True)
class Receipt:
    """Everything recorded about an effect. ``cls`` is the proto's ``class`` field."""

    effect_id: str
    run_id: str
    branch: str
    epoch: int
    position: int
    tool: str
    tool_version: int
    cls: OperationClass
    step_key: str
    intent_fingerprint: str
    request_fingerprint: str
    occurrence: int
    state: EffectState
    result: bytes
    detail: str
    downstream_key: str
    attempt: int
    lease_expires_at_ms: int
    created_at_ms: int
    updated_at_ms: int
    expires_at_ms: int
    tombstone: bool
    evidence: str
    replays: int
    last_replay_epoch: int
    credential_hashes: tuple[str, ...]
    saga_id: str
    compensation: Compensation | None
    compensates_effect_id: str
    compensated_by_effect_id: str
    arguments_json: str
    deliberate_repeat: bool
    parent_checkpoint_id: str = ""

    @classmethod
    def from_proto(cls, m: pb.Receipt) -> Receipt:
        return cls(
            effect_id=m.effect_id,
            run_id=m.run_id,
            branch=m.branch,
            epoch=m.epoch,
            position=m.position,
            tool=m.tool,
            tool_version=m.tool_version,
            cls=OperationClass(getattr(m, "class")),
            step_key=m.step_key,
            intent_fingerprint=m.intent_fingerprint,
            request_fingerprint=m.request_fingerprint,
            occurrence=m.occurrence,
            state=EffectState(m.state),
            result=bytes(m.result),
            detail=m.detail,
            downstream_key=m.downstream_key,
            attempt=m.attempt,
            lease_expires_at_ms=m.lease_expires_at_ms,
            created_at_ms=m.created_at_ms,
            updated_at_ms=m.updated_at_ms,
            expires_at_ms=m.expires_at_ms,
            tombstone=m.tombstone,
            evidence=m.evidence,
            replays=m.replays,
            last_replay_epoch=m.last_replay_epoch,
            credential_hashes=tuple(m.credential_hashes),
            saga_id=m.saga_id,
            compensation=Compensation.from_proto(m.compensation)
            if m.HasField("compensation")
            else None,
            compensates_effect_id=m.compensates_effect_id,
            compensated_by_effect_id=m.compensated_by_effect_id,
            arguments_json=m.arguments_json,
            deliberate_repeat=m.deliberate_repeat,
            parent_checkpoint_id=m.parent_checkpoint_id,
        )

    @classmethod
    def from_optional(cls, m: Any, present: bool) -> Receipt | None:
        """Converts a sub-message that may be absent."""
        return cls.from_proto(m) if present else None

    def result_json(self) -> Any:
        """The recorded result decoded as JSON (what a fenced function returned)."""
        return json.loads(self.result.decode("utf-8"))


@dataclass(frozen=True)
class Execute:
    """Permission to execute: run the tool now, passing ``downstream_key`` downstream."""

    kind: ClassVar[DecisionKind] = DecisionKind.EXECUTE
    effect_id: str
    downstream_key: str
    lease_expires_at_ms: int
    attempt: int
    receipt: Receipt | None

    @classmethod
    def from_proto(cls, m: pb.Execute) -> Execute:
        return cls(
            effect_id=m.effect_id,
            downstream_key=m.downstream_key,
            lease_expires_at_ms=m.lease_expires_at_ms,
            attempt=m.attempt,
            receipt=Receipt.from_optional(m.receipt, m.HasField("receipt")),
        )

    @property
    def recorded(self) -> bool:
        """False for an unrecorded SAFE_RETRY grant (no Complete is needed)."""
        return bool(self.effect_id)


@dataclass(frozen=True)
class Replay:
    """The recorded outcome is the answer: do not execute."""

    kind: ClassVar[DecisionKind] = DecisionKind.REPLAY
    receipt: Receipt

    @classmethod
    def from_proto(cls, m: pb.Replay) -> Replay:
        return cls(receipt=Receipt.from_proto(m.receipt))


@dataclass(frozen=True)
class InProgress:
    """Another attempt holds the lease: wait, then QueryOutcome."""

    kind: ClassVar[DecisionKind] = DecisionKind.IN_PROGRESS
    receipt: Receipt
    retry_after_ms: int

    @classmethod
    def from_proto(cls, m: pb.InProgress) -> InProgress:
        return cls(receipt=Receipt.from_proto(m.receipt), retry_after_ms=m.retry_after_ms)


@dataclass(frozen=True)
class Refusal:
    """A refusal: nothing was executed or recorded."""

    kind: ClassVar[DecisionKind] = DecisionKind.REFUSED
    reason: ReasonCode
    recovery: RecoveryAction
    receipt: Receipt | None
    message: str
    checkpoint_id: str = ""
    current_epoch: int = 0

    @classmethod
    def from_proto(cls, m: pb.Refusal) -> Refusal:
        return cls(
            reason=ReasonCode(m.reason),
            recovery=RecoveryAction(m.recovery),
            receipt=Receipt.from_optional(m.receipt, m.HasField("receipt")),
            message=m.message,
            checkpoint_id=m.checkpoint_id,
            current_epoch=m.current_epoch,
        )


Decision = Union[Execute, Replay, InProgress, Refusal]
"""The answer to a Begin: exactly one of the four kinds."""


def decision_from_proto(m: pb.Decision) -> Decision:
    """Converts ``fence.v1.Decision``; a missing arm is a protocol error."""
    which = m.WhichOneof("outcome")
    if which == "execute":
        return Execute.from_proto(m.execute)
    if which == "replay":
        return Replay.from_proto(m.replay)
    if which == "in_progress":
        return InProgress.from_proto(m.in_progress)
    if which == "refused":
        return Refusal.from_proto(m.refused)
    raise ValueError("fence: BeginResponse.decision has no outcome set")


@dataclass(frozen=True)
class BeginResult:
    """Begin's answer: the decision and the run's current epoch."""

    decision: Decision
    epoch: int

    @property
    def kind(self) -> DecisionKind:
        """Which kind of decision this is."""
        return self.decision.kind


@dataclass(frozen=True)
class Outcome:
    """QueryOutcome's answer: a state and, unless NOT_FOUND, the receipt."""

    state: EffectState
    receipt: Receipt | None


@dataclass(frozen=True)
class RestoreResult:
    """Restore's answer: the new epoch, the rewound branch and the replay tape."""

    epoch: int
    branch: str
    tape: tuple[Receipt, ...]


@dataclass(frozen=True)
class EffectsPage:
    """One page of ListEffects."""

    effects: tuple[Receipt, ...]
    next_page_token: str


@dataclass(frozen=True)
class RunsPage:
    """One page of ListRuns: runs in run-id order, without their checkpoints and restores
    (``get_run`` has those)."""

    runs: tuple[RunInfo, ...]
    next_page_token: str


@dataclass(frozen=True)
class ToolsPage:
    """One page of ListTools: registered tools at their current version."""

    tools: tuple[ToolSpec, ...]
    next_page_token: str


# ------------------------------------------------------------------------------------------
# Credentials
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CredentialInfo:
    """A credential's use state (the raw value is never returned: it is never stored)."""

    credential_hash: str
    budget: int
    uses: int
    bound_tool: str
    bound_intent_fingerprint: str
    spent_by_effect_ids: tuple[str, ...]
    created_at_ms: int

    @classmethod
    def from_proto(cls, m: pb.CredentialInfo) -> CredentialInfo:
        return cls(
            credential_hash=m.credential_hash,
            budget=m.budget,
            uses=m.uses,
            bound_tool=m.bound_tool,
            bound_intent_fingerprint=m.bound_intent_fingerprint,
            spent_by_effect_ids=tuple(m.spent_by_effect_ids),
            created_at_ms=m.created_at_ms,
        )


@dataclass(frozen=True)
class CredentialRegistration:
    """RegisterCredential's answer."""

    credential: CredentialInfo
    created: bool


# ------------------------------------------------------------------------------------------
# Backups
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackupReport:
    """What verifying a backup (or any data dir) found; sound when ``problem_count`` is 0."""

    format_version: int
    records: int
    runs: int
    effects: int
    tools: int
    credentials: int
    problems: tuple[str, ...]
    problem_count: int

    @classmethod
    def from_proto(cls, m: pb.BackupReport) -> BackupReport:
        return cls(
            format_version=m.format_version,
            records=m.records,
            runs=m.runs,
            effects=m.effects,
            tools=m.tools,
            credentials=m.credentials,
            problems=tuple(m.problems),
            problem_count=m.problem_count,
        )

    @property
    def sound(self) -> bool:
        """True when nothing is wrong."""
        return self.problem_count == 0


@dataclass(frozen=True)
class Compacted:
    """What ``compact_store`` did: the store's bytes before and after, and how long it took."""

    bytes_before: int
    bytes_after: int
    took_ms: int


@dataclass(frozen=True)
class Backup:
    """A backup written by ``create_backup``: a data dir on the server's machine."""

    dir: str
    bytes: int
    created_at_ms: int
    report: BackupReport

