"""The call lifecycle every front uses: keys, admission, ids, deadlines, recording; and one kind
per failure, which every front turns into its own status."""

from __future__ import annotations

import logging

import pytest

from nograd.batching import BatcherClosed, DeadlineExceeded, QueueFull, SampleTooLarge
from nograd.core.errors import DecodeError
from nograd.grpc.failures import CODES
from nograd.grpc.rpc import Code
from nograd.http.error_bodies import status_of
from nograd.observability.metrics import UNKNOWN_MODEL, Metrics
from nograd.serving.calls.access import MODEL_REPOSITORY, SHARED_MEMORY, TRACE, Access
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import (
    ControlRefused,
    Draining,
    Forbidden,
    InferenceFailed,
    InvalidInput,
    Kind,
    LimitExceeded,
    LoadFailed,
    ModelNotFound,
    Overloaded,
    Unauthenticated,
    kind_of,
)
from nograd.settings import Settings


def calls_with(keys: tuple[str, ...] = (), **settings: object) -> Calls:
    metrics = Metrics()
    plane = DataPlane(Settings(**settings), metrics)  # type: ignore[arg-type]
    return Calls(plane, metrics, keys)


def rejected(calls: Calls, reason: str) -> float:
    value = calls.metrics.registry.get_sample_value(
        "nograd_rejected_total", {"model": UNKNOWN_MODEL, "reason": reason}
    )
    return value or 0.0


def test_keys_are_checked_and_refusals_counted_without_the_key() -> None:
    calls = calls_with(("k-one", "k-two"))
    calls.authorize(["Bearer k-two"], "http", None)
    calls.authorize([b"bearer k-one"], "grpc", None)
    with pytest.raises(Unauthenticated, match="missing API key: send one 'Authorization"):
        calls.authorize([], "http", None)
    with pytest.raises(Unauthenticated, match="invalid API key: send metadata 'authorization"):
        calls.authorize(["Bearer wrong"], "grpc", "digits")
    with pytest.raises(Unauthenticated, match="invalid"):  # which of two would count is unclear
        calls.authorize(["Bearer k-one", "Bearer k-one"], "http", None)
    with pytest.raises(Unauthenticated):
        calls.authorize(["Basic k-one"], "http", None)
    assert rejected(calls, "unauthorized") == 4
    calls_with().authorize([], "http", None)  # no keys configured: every call passes


def test_operator_groups_take_operator_keys_only() -> None:
    metrics = Metrics()
    plane = DataPlane(Settings(), metrics)
    access = Access(("infer-key",), ("operator-key",), (MODEL_REPOSITORY, TRACE))
    calls = Calls(plane, metrics, access)
    calls.authorize(["Bearer operator-key"], "http", None)  # an operator key opens every route
    calls.authorize(["Bearer operator-key"], "grpc", None, MODEL_REPOSITORY)
    calls.authorize(["Bearer infer-key"], "http", None, SHARED_MEMORY)  # not an operator group
    with pytest.raises(Forbidden, match=r"This API is restricted.*the model-repository API"):
        calls.authorize(["Bearer infer-key"], "http", None, MODEL_REPOSITORY)
    with pytest.raises(Forbidden, match=r"This protocol is restricted.*the trace API"):
        calls.authorize(["Bearer infer-key"], "grpc", None, TRACE)
    with pytest.raises(Unauthenticated, match="missing API key"):  # no key: 401 first
        calls.authorize([], "http", None, TRACE)
    assert rejected(calls, "forbidden") == 2 and rejected(calls, "unauthorized") == 1
    assert kind_of(Forbidden("x")) is Kind.FORBIDDEN
    assert (status_of(Forbidden("x")), CODES[Kind.FORBIDDEN]) == (403, Code.PERMISSION_DENIED)


def test_without_operator_keys_the_operator_groups_are_refused_to_every_key() -> None:
    api_only = Access(("infer-key",), (), (MODEL_REPOSITORY,))
    with pytest.raises(Forbidden, match="none is configured \\(NOGRAD_OPERATOR_API_KEYS\\)"):
        api_only.check(["Bearer infer-key"], "http", MODEL_REPOSITORY)
    api_only.check(["Bearer infer-key"], "http", None)
    # Operator keys alone guard their groups only; no keys at all: every route is open.
    operator_only = Access((), ("operator-key",), (MODEL_REPOSITORY,))
    operator_only.check([], "http", None)
    with pytest.raises(Unauthenticated):
        operator_only.check([], "http", MODEL_REPOSITORY)
    Access((), (), (MODEL_REPOSITORY,)).check([], "http", MODEL_REPOSITORY)
    # No operator group: API keys open every route, as before operator keys existed.
    Access(("infer-key",), (), ()).check(["Bearer infer-key"], "grpc", MODEL_REPOSITORY)


def test_a_caller_is_an_opaque_id_of_its_key() -> None:
    access = Access(("infer-key",), ("operator-key",), (MODEL_REPOSITORY,))
    one, other = access.caller(["Bearer infer-key"]), access.caller(["Bearer operator-key"])
    assert len(one) == 16 and one != other and "infer" not in one
    # The same in every worker: it depends on the key alone.
    assert Access(("infer-key",)).caller([b"bearer infer-key"]) == one
    assert access.caller(["Bearer wrong"]) == access.caller([]) == ""


def test_admission_refuses_past_the_bound_and_counts_the_reason() -> None:
    calls = calls_with(max_requests_in_flight=2)
    calls.admit(None)
    calls.admit("absent")
    with pytest.raises(Overloaded):
        calls.admit(None)
    assert rejected(calls, "in_flight") == 1
    calls.release()
    calls.admit(None)


def test_a_call_is_counted_in_flight_until_recorded_once(caplog: pytest.LogCaptureFixture) -> None:
    calls = calls_with()
    inflight = calls.metrics.inflight
    call = calls.open("grpc", "/inference.GRPCInferenceService/ModelInfer")
    assert inflight._value.get() == 1  # type: ignore[attr-defined]
    assert len(call.request_id) == 32 and not call.id_given
    call.adopt_request_id("v2-7")
    assert call.request_id == "v2-7"
    call.adopt_request_id("not <safe>")
    assert call.request_id == "v2-7"
    call.shorten_deadline(5.0)
    call.shorten_deadline(9.0)
    assert call.timeout_s == 5.0
    with caplog.at_level(logging.DEBUG, "nograd.requests"):
        calls.close(call, 503)
    assert inflight._value.get() == 0  # type: ignore[attr-defined]
    total = calls.metrics.registry.get_sample_value(
        "nograd_requests_total", {"model": UNKNOWN_MODEL, "protocol": "grpc", "code": "503"}
    )
    assert total == 1
    assert "grpc /inference.GRPCInferenceService/ModelInfer -> 503" in caplog.text
    given = calls.open("v2", "/v2/models/m/infer", "abc-1")
    given.adopt_request_id("other")  # the caller's own id wins
    assert given.request_id == "abc-1"


@pytest.mark.parametrize(
    ("failure", "kind", "status", "code"),
    [
        (DecodeError("x"), Kind.INVALID, 400, Code.INVALID_ARGUMENT),
        (InvalidInput("x"), Kind.INVALID, 400, Code.INVALID_ARGUMENT),
        (ControlRefused("x"), Kind.REFUSED, 400, Code.FAILED_PRECONDITION),
        (LoadFailed("x"), Kind.REFUSED, 400, Code.FAILED_PRECONDITION),
        (Unauthenticated("x"), Kind.UNAUTHENTICATED, 401, Code.UNAUTHENTICATED),
        (ModelNotFound("x"), Kind.NOT_FOUND, 404, Code.NOT_FOUND),
        (LimitExceeded("x"), Kind.OVER_LIMIT, 422, Code.RESOURCE_EXHAUSTED),
        (Draining("x"), Kind.UNAVAILABLE, 503, Code.UNAVAILABLE),
        (QueueFull("x"), Kind.UNAVAILABLE, 503, Code.UNAVAILABLE),
        (BatcherClosed("x"), Kind.UNAVAILABLE, 503, Code.UNAVAILABLE),
        (DeadlineExceeded("x"), Kind.DEADLINE, 504, Code.DEADLINE_EXCEEDED),
        (SampleTooLarge("x"), Kind.TOO_LARGE_FOR_MEMORY, 507, Code.RESOURCE_EXHAUSTED),
        (InferenceFailed("x"), Kind.FAILED, 500, Code.INTERNAL),
        (RuntimeError("x"), Kind.FAILED, 500, Code.INTERNAL),
    ],
)
def test_every_failure_has_one_kind_and_each_front_its_status(
    failure: Exception, kind: Kind, status: int, code: Code
) -> None:
    assert kind_of(failure) is kind
    assert status_of(failure) == status == kind.status
    assert CODES[kind] is code


def test_the_grpc_table_names_every_kind() -> None:
    assert set(CODES) == set(Kind)


def test_the_byte_budget_refuses_what_does_not_fit_and_a_closed_call_gives_back() -> None:
    mib = 1024 * 1024
    calls = calls_with(
        max_request_bytes=mib, max_decoded_bytes=mib, max_body_bytes_in_flight=3 * mib
    )
    admission = calls.plane.admission
    calls.take_bytes(2 * mib, None)
    call = calls.open("http", "/v2/models/digits/infer")
    calls.hold_bytes(call, mib)
    with pytest.raises(QueueFull, match="NOGRAD_MAX_BODY_BYTES_IN_FLIGHT") as refused:
        calls.take_bytes(1, "absent")
    assert kind_of(refused.value) is Kind.UNAVAILABLE
    assert rejected(calls, "bytes_in_flight") == 1
    calls.close(call, 200)
    assert admission.bytes_in_flight == 2 * mib
    calls.give_bytes(2 * mib)
    assert admission.bytes_in_flight == 0
