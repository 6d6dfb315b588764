"""Exceptions of the Fence client, and the one place gRPC statuses are mapped to them.

- :class:`FenceRefused`: a domain refusal, with machine-readable ``reason`` and ``recovery``.
  Raised both for a Begin decision that is a refusal (where the caller asked for an exception,
  e.g. in :func:`fence.fenced`) and for a non-Begin RPC answered with a gRPC status whose
  ``grpc-status-details-bin`` trailer carries a ``google.rpc.ErrorInfo`` of domain ``fence.v1``.
- :class:`FenceRpcError`: any other gRPC failure (bad input without a domain reason, auth,
  internal errors...); :class:`FenceUnavailable` for the ambiguous transport failures
  (UNAVAILABLE, DEADLINE_EXCEEDED) after which the request may or may not have been applied.
- :class:`FenceEffectUnknown`: a fenced effect's outcome is unknown and must be reconciled.
- :class:`FenceTimeout`: waited for another attempt's effect longer than allowed.
- :class:`FenceCompletionError`: the tool ran but its outcome could not be recorded.
- :class:`FailedBeforeInputError`: raised *by a fenced function* to say that nothing reached
  the outside world, so the effect is recorded ``FAILED_BEFORE_INPUT`` and may be re-granted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import grpc
from google.rpc import error_details_pb2, status_pb2

from .types import EffectState, ReasonCode, Receipt, RecoveryAction, Refusal, _enum_by_name

__all__ = [
    "ERROR_DOMAIN",
    "FailedBeforeInputError",
    "FenceCompletionError",
    "FenceEffectUnknown",
    "FenceError",
    "FenceRefused",
    "FenceRpcError",
    "FenceTimeout",
    "FenceUnavailable",
    "FieldViolation",
    "StatusDetails",
    "error_from_rpc",
    "parse_status_details",
]

ERROR_DOMAIN = "fence.v1"
"""The ``ErrorInfo.domain`` of Fence's domain refusals."""

STATUS_DETAILS_KEY = "grpc-status-details-bin"

_TRANSPORT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class FieldViolation:
    """One ``google.rpc.BadRequest.FieldViolation``: which field, and what is wrong with it."""

    field: str
    description: str
    reason: str = ""


@dataclass(frozen=True)
class StatusDetails:
    """What the ``grpc-status-details-bin`` trailer said (``google.rpc.Status``)."""

    code: int
    message: str
    error_reason: str = ""
    error_domain: str = ""
    error_metadata: tuple[tuple[str, str], ...] = ()
    field_violations: tuple[FieldViolation, ...] = ()
    retry_delay_ms: int | None = None

    @property
    def metadata(self) -> dict[str, str]:
        """``ErrorInfo.metadata`` as a dict."""
        return dict(self.error_metadata)


def _trailer_items(trailing: Any) -> Iterable[tuple[str, Any]]:
    if trailing is None:
        return ()
    items = []
    for item in trailing:
        if isinstance(item, tuple) and len(item) == 2:
            items.append(item)
        else:  # a mapping-like iterating over keys
            items.append((item, trailing[item]))
    return items


def parse_status_details(trailing_metadata: Any) -> StatusDetails | None:
    """Parses the ``grpc-status-details-bin`` trailer, if present and well-formed."""
    raw = None
    for key, value in _trailer_items(trailing_metadata):
        if key == STATUS_DETAILS_KEY:
            raw = value
            break
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    return parse_status_bytes(raw)


def parse_status_bytes(raw: bytes) -> StatusDetails | None:
    """Parses an encoded ``google.rpc.Status`` (a trailer's value, or a batch ``CallError``'s
    ``details``), if well-formed."""
    if not raw:
        return None
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw)
    except Exception:  # noqa: BLE001 - a malformed trailer is treated as absent
        return None
    reason = domain = ""
    metadata: tuple[tuple[str, str], ...] = ()
    violations: list[FieldViolation] = []
    retry_delay_ms = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain = info.reason, info.domain
            metadata = tuple(sorted(info.metadata.items()))
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            for v in bad.field_violations:
                violations.append(
                    FieldViolation(v.field, v.description, getattr(v, "reason", ""))
                )
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_delay_ms = retry.retry_delay.seconds * 1000 + retry.retry_delay.nanos // 1_000_000
    return StatusDetails(
        code=status.code,
        message=status.message,
        error_reason=reason,
        error_domain=domain,
        error_metadata=metadata,
        field_violations=tuple(violations),
        retry_delay_ms=retry_delay_ms,
    )


class FenceError(Exception):
    """Base class of every error raised by the Fence client."""


class FenceRefused(FenceError):
    """Fence refused the call. Switch on ``reason`` / ``recovery``, never on ``message``.

    Attributes:
        reason: why (:class:`fence.ReasonCode`).
        recovery: what to do about it (:class:`fence.RecoveryAction`).
        receipt: the receipt the refusal refers to (Begin refusals; ``None`` for a gRPC status,
            which only names ``effect_id``).
        message: one short sentence fit to show a model.
        effect_id: the effect referred to, when known.
        checkpoint_id: for ``FORK_REQUIRED``, the checkpoint to fork from.
        current_epoch: for ``STALE_EPOCH`` (Begin), the run's current epoch.
        code: the gRPC status code, or ``None`` for a Begin decision.
        field_violations: ``BadRequest`` violations, if any.
        details: the parsed status details, or ``None`` for a Begin decision.
    """

    def __init__(
        self,
        reason: ReasonCode,
        recovery: RecoveryAction,
        message: str,
        *,
        receipt: Receipt | None = None,
        effect_id: str = "",
        checkpoint_id: str = "",
        current_epoch: int = 0,
        code: grpc.StatusCode | None = None,
        field_violations: tuple[FieldViolation, ...] = (),
        details: StatusDetails | None = None,
    ) -> None:
        # str() is the sentence for a model: frameworks show an exception's text to the model
        # (LangGraph's ToolNode, MCP error results). The codes are in the attributes and repr.
        super().__init__(message or f"{reason.name} ({recovery.name})")
        self.reason = reason
        self.recovery = recovery
        self.message = message
        self.receipt = receipt
        self.effect_id = effect_id or (receipt.effect_id if receipt is not None else "")
        self.checkpoint_id = checkpoint_id
        self.current_epoch = current_epoch
        self.code = code
        self.field_violations = field_violations
        self.details = details

    def __repr__(self) -> str:
        return f"FenceRefused({self.reason.name}, {self.recovery.name}, {self.message!r})"

    @classmethod
    def from_refusal(cls, refusal: Refusal) -> FenceRefused:
        """The exception for a Begin decision that is a refusal."""
        return cls(
            refusal.reason,
            refusal.recovery,
            refusal.message,
            receipt=refusal.receipt,
            checkpoint_id=refusal.checkpoint_id,
            current_epoch=refusal.current_epoch,
        )

    @property
    def refusal(self) -> Refusal:
        """The refusal as a :class:`fence.Refusal` value."""
        return Refusal(
            reason=self.reason,
            recovery=self.recovery,
            receipt=self.receipt,
            message=self.message,
            checkpoint_id=self.checkpoint_id,
            current_epoch=self.current_epoch,
        )


class FenceRpcError(FenceError):
    """A gRPC failure that is not a Fence domain refusal.

    Attributes: ``code`` (grpc.StatusCode), ``details_text`` (the status message),
    ``field_violations`` and ``details`` (the parsed trailer, if any).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details_text: str,
        *,
        field_violations: tuple[FieldViolation, ...] = (),
        details: StatusDetails | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {details_text}")
        self.code = code
        self.details_text = details_text
        self.field_violations = field_violations
        self.details = details


class FenceUnavailable(FenceRpcError):
    """UNAVAILABLE or DEADLINE_EXCEEDED: the request may or may not have been applied."""


class FenceEffectUnknown(FenceError):
    """The effect may or may not have happened; only Reconcile with evidence settles it.

    Attributes: ``receipt`` (the effect's receipt, if known), ``effect_id``.
    """

    def __init__(self, message: str, *, receipt: Receipt | None = None, effect_id: str = "") -> None:
        super().__init__(message)
        self.receipt = receipt
        self.effect_id = effect_id or (receipt.effect_id if receipt is not None else "")
        self.reason = ReasonCode.RECONCILE_REQUIRED
        self.recovery = RecoveryAction.RECONCILE
        self.state = receipt.state if receipt is not None else EffectState.EFFECT_UNKNOWN


class FenceTimeout(FenceError):
    """Waited longer than allowed for another attempt's effect to finish."""

    def __init__(self, message: str, *, receipt: Receipt | None = None) -> None:
        super().__init__(message)
        self.receipt = receipt


class FenceCompletionError(FenceError):
    """The tool ran (its effect happened) but Fence could not record the outcome.

    ``result`` is the function's return value, ``effect_id`` / ``attempt`` / ``epoch`` identify
    the grant, so the caller can ``Reconcile`` it with ``completed_result`` later.
    """

    def __init__(
        self, message: str, *, result: Any, effect_id: str, attempt: int, epoch: int
    ) -> None:
        super().__init__(message)
        self.result = result
        self.effect_id = effect_id
        self.attempt = attempt
        self.epoch = epoch


class FailedBeforeInputError(Exception):
    """Raise this from a fenced function when nothing reached the outside world.

    The effect is then recorded ``FAILED_BEFORE_INPUT`` (it may be granted again, with the same
    effect id and downstream key) instead of ``EFFECT_UNKNOWN``. Any other exception is treated
    as ambiguous: the effect may have happened.
    """


def error_from_rpc(err: grpc.RpcError) -> FenceError:
    """Maps a gRPC error (sync or aio) to a :class:`FenceError`. The one mapping place."""
    code_fn = getattr(err, "code", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    text = (details_fn() if callable(details_fn) else str(err)) or ""
    trailing_fn = getattr(err, "trailing_metadata", None)
    trailing = trailing_fn() if callable(trailing_fn) else None
    return error_from_status(code, text, parse_status_details(trailing))


def error_from_call_error(code: int, message: str, details: bytes) -> FenceError:
    """Maps one call's error inside a batch (``fence.v1.CallError``) to the same
    :class:`FenceError` the call would have raised alone."""
    status_code = _STATUS_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return error_from_status(status_code, message, parse_status_bytes(details))


def error_from_status(code: grpc.StatusCode, text: str, details: StatusDetails | None) -> FenceError:
    """Maps a status (code, message, parsed details) to a :class:`FenceError`."""
    violations = details.field_violations if details is not None else ()
    if details is not None and details.error_domain == ERROR_DOMAIN and details.error_reason:
        meta = details.metadata
        return FenceRefused(
            ReasonCode(_enum_by_name(ReasonCode, details.error_reason)),
            RecoveryAction(_enum_by_name(RecoveryAction, meta.get("recovery", ""))),
            meta.get("message") or details.message or text,
            effect_id=meta.get("effect_id", ""),
            checkpoint_id=meta.get("checkpoint_id", ""),
            current_epoch=int(meta["current_epoch"]) if meta.get("current_epoch", "").isdigit() else 0,
            code=code,
            field_violations=violations,
            details=details,
        )
    cls = FenceUnavailable if code in _TRANSPORT_CODES else FenceRpcError
    return cls(code, text, field_violations=violations, details=details)


_STATUS_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
