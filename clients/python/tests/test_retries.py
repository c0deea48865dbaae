"""Retries, errors and result parsing against a mock transport (no network)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import httpx
import pytest

from intake_client import ApiError, AsyncIntakeClient, IntakeClient, TransportError

CONVERSION = {"event": "lead", "external_id": "1", "occurred_at": 1_700_000_000_000}
CREATED = {"id": "cnv_1", "event": "lead", "external_id": "1", "chain_id": "chn_1", "result": "created"}


def error(status: int, code: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"error": {"code": code, "message": code.replace("_", " "), "request_id": "req_1"}}
    return httpx.Response(status, json=body, headers={"X-Request-ID": "req_1", **(headers or {})})


def scripted(*answers: httpx.Response | Exception) -> tuple[IntakeClient, list[httpx.Request], list[float]]:
    requests: list[httpx.Request] = []
    sleeps: list[float] = []
    queue = list(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    http = httpx.Client(transport=httpx.MockTransport(handler))
    client = IntakeClient("https://intake.test/v1/", "svc_live_x", http_client=http, sleep=sleeps.append)
    return client, requests, sleeps


def test_request_shape() -> None:
    client, requests, _ = scripted(httpx.Response(201, json={"conversion": CREATED}))
    result = client.send(CONVERSION)
    assert result.result == "created" and result.id == "cnv_1" and result.warnings == []
    (request,) = requests
    assert request.url == "https://intake.test/v1/conversions"
    assert request.headers["authorization"] == "Bearer svc_live_x"
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.content) == CONVERSION


@pytest.mark.parametrize("status", [429, 503])
def test_waits_retry_after_on_429_and_503(status: int) -> None:
    code = "rate_limited" if status == 429 else "service_unavailable"
    client, requests, sleeps = scripted(
        error(status, code, {"Retry-After": "7"}), httpx.Response(200, json={"conversion": CREATED})
    )
    assert client.send(CONVERSION).id == "cnv_1"
    assert len(requests) == 2
    assert len(sleeps) == 1 and 7 <= sleeps[0] <= 7.5


def test_backs_off_on_5xx_and_connection_errors() -> None:
    client, requests, sleeps = scripted(
        error(500, "internal_error"),
        httpx.ConnectError("refused"),
        httpx.Response(502, text="bad gateway"),
        httpx.ReadTimeout("slow"),
        httpx.Response(201, json={"conversion": CREATED}),
    )
    assert client.send(CONVERSION).result == "created"
    assert len(requests) == 5
    for attempt, slept in enumerate(sleeps, start=1):
        full = 0.5 * 2 ** (attempt - 1)
        assert full / 2 <= slept <= full, (attempt, slept)


def test_gives_up_after_max_attempts() -> None:
    client, requests, sleeps = scripted(*[error(500, "internal_error")] * 5)
    with pytest.raises(ApiError) as raised:
        client.send(CONVERSION)
    assert (raised.value.status, raised.value.code, raised.value.request_id) == (500, "internal_error", "req_1")
    assert len(requests) == 5 and len(sleeps) == 4


def test_connection_errors_end_in_transport_error() -> None:
    client, requests, _ = scripted(*[httpx.ConnectError("refused")] * 5)
    with pytest.raises(TransportError) as raised:
        client.send(CONVERSION)
    assert isinstance(raised.value.__cause__, httpx.ConnectError)
    assert len(requests) == 5


@pytest.mark.parametrize("status,code", [(400, "invalid_json"), (401, "invalid_api_key"), (422, "validation_failed")])
def test_client_errors_are_not_retried(status: int, code: str) -> None:
    client, requests, sleeps = scripted(error(status, code))
    with pytest.raises(ApiError) as raised:
        client.send(CONVERSION)
    assert raised.value.code == code and raised.value.status == status
    assert len(requests) == 1 and sleeps == []


def test_error_details_and_a_body_that_is_not_the_apis() -> None:
    body = {
        "error": {
            "code": "validation_failed",
            "message": "invalid",
            "request_id": "req_9",
            "details": [{"path": "event", "message": "bad"}],
        }
    }
    client, _, _ = scripted(httpx.Response(422, json=body), httpx.Response(404, text="<html>"))
    with pytest.raises(ApiError) as raised:
        client.send(CONVERSION)
    assert [(d.path, d.message) for d in raised.value.details] == [("event", "bad")]
    with pytest.raises(ApiError) as raised:
        client.send(CONVERSION)
    assert raised.value.code == "http_404"


def batch_answer(handler: Callable[[list[Any]], dict[str, Any]]) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=handler(json.loads(request.content)["conversions"]))

    return answer


def test_validate_reports_global_indexes_across_batches() -> None:
    def validate(items: list[Any]) -> dict[str, Any]:
        results: list[dict[str, Any]] = []
        for i, item in enumerate(items):
            if item["event"] == "bad!":
                results.append({"index": i, "ok": False, "error": {"code": "validation_failed", "message": "m"}})
            else:
                results.append({"index": i, "ok": True, "warnings": item.get("w", [])})
        failed = sum(1 for r in results if not r["ok"])
        return {"results": results, "summary": {"valid": len(items) - failed, "failed": failed}}

    http = httpx.Client(transport=httpx.MockTransport(batch_answer(validate)))
    client = IntakeClient("https://intake.test/v1", "svc_live_x", http_client=http)
    items = [{"event": "lead"}, {"event": "bad!"}, {"event": "lead", "w": ["email_invalid"]}]
    report = client.validate(items, batch_size=2)
    assert [(r.index, r.ok, r.warnings) for r in report.results] == [
        (0, True, []),
        (1, False, []),
        (2, True, ["email_invalid"]),
    ]
    assert report.results[1].error is not None and report.results[1].error.code == "validation_failed"
    assert (report.summary.valid, report.summary.failed) == (2, 1)


def test_send_many_reports_global_indexes_and_counts() -> None:
    def batch(items: list[Any]) -> dict[str, Any]:
        results = [
            {"index": i, "ok": True, "conversion": {**CREATED, "external_id": str(item["external_id"])}}
            for i, item in enumerate(items)
        ]
        return {"results": results, "summary": {"created": len(items), "updated": 0, "unchanged": 0, "failed": 0}}

    http = httpx.Client(transport=httpx.MockTransport(batch_answer(batch)))
    client = IntakeClient("https://intake.test/v1", "svc_live_x", http_client=http)
    report = client.send_many(({**CONVERSION, "external_id": i} for i in range(7)), batch_size=3)
    assert [r.index for r in report.results] == list(range(7))
    assert [r.conversion.external_id for r in report.results if r.conversion] == [str(i) for i in range(7)]
    assert report.summary.created == 7 and report.summary.failed == 0


def test_the_async_client_retries_alike() -> None:
    answers: list[httpx.Response | Exception] = [
        error(429, "rate_limited", {"Retry-After": "3"}),
        httpx.ConnectError("refused"),
        httpx.Response(201, json={"conversion": CREATED}),
    ]
    requests: list[httpx.Request] = []
    sleeps: list[float] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def run() -> str:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with AsyncIntakeClient("https://intake.test/v1", "svc_live_x", http_client=http, sleep=sleep) as client:
            result = await client.send(CONVERSION)
        await http.aclose()
        return result.result

    assert asyncio.run(run()) == "created"
    assert len(requests) == 3
    assert 3 <= sleeps[0] <= 3.5 and 0.5 <= sleeps[1] <= 1.0, "the second retry backs off 0.5 to 1 s"
    assert requests[0].headers["authorization"] == "Bearer svc_live_x"
