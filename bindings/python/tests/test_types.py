"""The hand-written enums mirror the generated proto enums exactly (no server needed)."""

from __future__ import annotations

import pytest

import fence
from fence.v1 import fence_pb2 as pb


@pytest.mark.parametrize(
    "py_enum, proto_enum",
    [
        (fence.OperationClass, pb.OperationClass),
        (fence.EffectState, pb.EffectState),
        (fence.ReasonCode, pb.ReasonCode),
        (fence.RecoveryAction, pb.RecoveryAction),
        (fence.StringNormalization, pb.StringNormalization),
    ],
)
def test_enum_matches_proto(py_enum: type, proto_enum: object) -> None:
    proto_values = {v.name: v.number for v in proto_enum.DESCRIPTOR.values}
    assert {m.name: m.value for m in py_enum} == proto_values


def test_unknown_enum_value_is_kept() -> None:
    value = fence.ReasonCode(999)
    assert value == 999 and value.name == "UNKNOWN_999"


def test_receipt_covers_every_proto_field() -> None:
    import dataclasses

    names = {f.name for f in dataclasses.fields(fence.Receipt)}
    proto = {f.name for f in pb.Receipt.DESCRIPTOR.fields}
    assert names == (proto - {"class"}) | {"cls"}


def test_async_client_mirrors_sync_client() -> None:
    import inspect

    sync = {n: inspect.signature(f) for n, f in vars(fence.Client).items() if not n.startswith("_") and callable(f)}
    asyn = {n: inspect.signature(f) for n, f in vars(fence.AsyncClient).items() if not n.startswith("_") and callable(f)}
    assert sync.keys() == asyn.keys()
    for name, sig in sync.items():
        assert list(sig.parameters) == list(asyn[name].parameters), name
        method = getattr(fence.AsyncClient, name)
        # The iter_* methods are async generators; `session` makes an AsyncSession (checked
        # below); every other method is a coroutine.
        assert (
            inspect.iscoroutinefunction(method)
            or (name.startswith("iter_") and inspect.isasyncgenfunction(method))
            or name == "session"
        ), name


def test_async_session_mirrors_sync_session() -> None:
    import inspect

    def public(cls: type) -> dict[str, inspect.Signature]:
        return {n: inspect.signature(f) for n, f in vars(cls).items() if not n.startswith("_") and callable(f)}

    sync, asyn = public(fence.Session), public(fence.AsyncSession)
    assert sync.keys() == asyn.keys() == {"begin", "complete", "heartbeat", "close"}
    for name, sig in sync.items():
        assert list(sig.parameters) == list(asyn[name].parameters), name
        assert inspect.iscoroutinefunction(getattr(fence.AsyncSession, name)), name


def test_every_rpc_has_a_client_method() -> None:
    import re

    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["Fence"].methods]
    for rpc in methods:
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", rpc).lower()
        assert hasattr(fence.Client, snake), rpc
        assert hasattr(fence.AsyncClient, snake), rpc


def test_status_details_trailer_is_parsed() -> None:
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    import grpc

    info = error_details_pb2.ErrorInfo(
        reason="RESULT_CONFLICT",
        domain="fence.v1",
        metadata={"recovery": "STOP", "effect_id": "e1", "message": "A different result is recorded."},
    )
    bad = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field="result", description="differs")]
    )
    status = status_pb2.Status(code=9, message="conflict")
    for detail in (info, bad):
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)

    class FakeError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self) -> str:
            return "conflict"

        def trailing_metadata(self) -> tuple:
            return (("grpc-status-details-bin", status.SerializeToString()),)

    err = fence.errors.error_from_rpc(FakeError())
    assert isinstance(err, fence.FenceRefused)
    assert err.reason == fence.ReasonCode.RESULT_CONFLICT
    assert err.recovery == fence.RecoveryAction.STOP
    assert err.effect_id == "e1" and err.message == "A different result is recorded."
    assert err.field_violations[0].field == "result"

    class Unavailable(FakeError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def trailing_metadata(self) -> tuple:
            return ()

    assert isinstance(fence.errors.error_from_rpc(Unavailable()), fence.FenceUnavailable)
