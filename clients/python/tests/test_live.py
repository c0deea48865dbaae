"""Against a running gateway (see conftest.py): what a user of the library sees."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from conftest import conversion, unique
from intake_client import MAX_BATCH_BYTES, ApiError, AsyncIntakeClient, IntakeClient, TransportError, prehash


def test_send_creates_then_reports_unchanged_and_updated(client: IntakeClient) -> None:
    sent = conversion("lead", value="12.50", currency="eur")
    first = client.send(sent)
    assert first.result == "created"
    assert first.id.startswith("cnv_") and first.chain_id.startswith("chn_")
    assert (first.event, first.external_id) == ("lead", sent["external_id"])
    assert client.send(sent).result == "unchanged"
    again = client.send({**sent, "value": 13})
    assert (again.result, again.id) == ("updated", first.id)


def test_send_reports_warnings(client: IntakeClient) -> None:
    result = client.send(conversion("lead", email="not an email", phone="12", country="US"))
    assert result.result == "created"
    assert sorted(result.warnings) == ["email_invalid", "phone_unparseable"]


def test_send_many_answers_every_item_in_input_order(client: IntakeClient) -> None:
    items: list[dict[str, Any]] = [conversion("signed", external_id=unique()) for _ in range(1201)]
    items[700] = {**items[700], "event": "not valid!"}
    items[1100] = dict(items[20])  # the same pair again: unchanged
    report = client.send_many(items)
    assert [r.index for r in report.results] == list(range(1201))
    failed = [r for r in report.results if not r.ok]
    assert [r.index for r in failed] == [700]
    assert failed[0].error is not None and failed[0].error.code == "validation_failed"
    assert [d.path for d in failed[0].error.details] == ["event"]
    for result, item in zip(report.results, items):
        if result.ok:
            assert result.conversion is not None and result.conversion.external_id == item["external_id"]
    assert report.results[1100].conversion is not None and report.results[1100].conversion.result == "unchanged"
    summary = report.summary
    # A batch retried after a 500 (a loaded machine) reads its first attempt's items as unchanged.
    assert (summary.created + summary.unchanged, summary.updated, summary.failed) == (1200, 0, 1)
    assert summary.created >= 700


def test_send_many_cuts_bodies_at_one_mebibyte(live: tuple[str, str]) -> None:
    bodies: list[int] = []

    def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/batch"):
            bodies.append(len(request.content))

    wide = "\U0001f600"  # four bytes of UTF-8, one character for the API's length limits
    with httpx.Client(timeout=60, event_hooks={"request": [record]}) as http:
        client = IntakeClient(*live, http_client=http)
        items = [
            conversion(
                "purchase",
                hdyhau=wide * 200,
                contact_id=wide * 128,
                tags={f"tag_{k}": wide * 64 for k in "abcde"},
            )
            for _ in range(700)
        ]
        report = client.send_many(items)
    assert all(r.ok for r in report.results), [r.error for r in report.results if not r.ok][:3]
    assert report.summary.created + report.summary.unchanged == 700
    assert len(bodies) >= 2, bodies
    assert all(size <= MAX_BATCH_BYTES for size in bodies), bodies
    assert max(bodies) > MAX_BATCH_BYTES * 0.99, "a batch is filled up to the limit"


def test_validate_answers_per_item_and_stores_nothing(client: IntakeClient) -> None:
    good = conversion("lead")
    items = [good, conversion("lead", email="nope"), {**conversion("lead"), "event": "bad event"}]
    report = client.validate(items)
    assert [(r.index, r.ok) for r in report.results] == [(0, True), (1, True), (2, False)]
    assert report.results[0].warnings == [] and report.results[1].warnings == ["email_invalid"]
    error = report.results[2].error
    assert error is not None and error.code == "validation_failed" and [d.path for d in error.details] == ["event"]
    assert (report.summary.valid, report.summary.failed) == (2, 1)
    assert client.send(good).result == "created", "validation wrote nothing"


def test_prehashed_identifiers_equal_the_gateways_own_hashes(client: IntakeClient) -> None:
    raw = conversion(
        "lead",
        email="  Ann.Smith+crm@Example.COM ",
        phone="+14155552671",
        country="GB",
        address={"line1": "10, Downing Street", "zip": "sw1a 2aa"},
    )
    assert client.send(raw).result == "created"
    hashed = prehash(raw)
    assert not {"email", "address"} & set(hashed) and hashed["phone"] == raw["phone"]
    # The gateway hashed the raw values; the same pair sent with the client's hashes changes
    # nothing only if every hash is the same.
    assert client.send(hashed).result == "unchanged"
    assert client.send({**hashed, "email_sha256": "0" * 64}).result == "updated"


@pytest.mark.parametrize(
    ("phone", "country"),
    [("+4402079460958", None), ("+1415555267", None), ("+491701234567", "US")],
)
def test_prehash_stores_a_plus_digits_phone_as_the_gateway_does(
    client: IntakeClient, phone: str, country: str | None
) -> None:
    # `+digits` that the gateway normalizes otherwise or refuses: hashed as it is, it would be
    # stored apart from the same phone sent raw.
    raw = conversion("lead", phone=phone, **({"country": country} if country else {}))
    assert client.send(raw).result == "created"
    assert client.send(prehash(raw)).result == "unchanged"


def test_raw_and_hashed_form_together_is_refused(client: IntakeClient) -> None:
    sent = {**conversion("lead", email="ann@example.com"), "email_sha256": "a" * 64}
    with pytest.raises(ApiError) as raised:
        client.send(sent)
    assert (raised.value.status, raised.value.code) == (422, "validation_failed")
    assert "email_sha256" in [d.path for d in raised.value.details]


def test_get_workspace(client: IntakeClient) -> None:
    workspace = client.get_workspace()
    assert workspace["workspace"]["id"].startswith("ws_")
    assert set(workspace["key"]["scopes"]) == {"workspace:read", "conversions:write"}
    assert isinstance(workspace["script"]["snippet"], str)


def test_api_errors_carry_code_message_request_id_and_details(live: tuple[str, str]) -> None:
    base_url, _ = live
    with IntakeClient(base_url, "svc_live_" + "x" * 40) as stranger:
        with pytest.raises(ApiError) as raised:
            stranger.get_workspace()
    error = raised.value
    assert (error.status, error.code) == (401, "invalid_api_key")
    assert error.message and error.request_id
    with IntakeClient(*live) as client:
        with pytest.raises(ApiError) as raised:
            client.send({"event": "lead", "external_id": "x", "occurred_at": "yesterday", "colour": "red"})
    assert (raised.value.status, raised.value.code) == (422, "validation_failed")
    assert sorted(d.path for d in raised.value.details) == ["colour", "occurred_at"]


def test_connection_errors_are_retried_then_raised() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sleeps: list[float] = []
    client = IntakeClient(f"http://127.0.0.1:{port}/v1", "svc_live_x", max_attempts=3, sleep=sleeps.append)
    with pytest.raises(TransportError):
        client.send(conversion())
    assert len(sleeps) == 2


def test_the_async_client_against_the_service(live: tuple[str, str]) -> None:
    async def run() -> None:
        async with AsyncIntakeClient(*live) as client:
            workspace, sent = await asyncio.gather(client.get_workspace(), client.send(conversion("lead")))
            assert workspace["workspace"]["id"].startswith("ws_") and sent.result == "created"
            items = [conversion("signed") for _ in range(3)] + [{"event": "lead"}]
            report = await client.send_many(items, batch_size=2)
            assert [(r.index, r.ok) for r in report.results] == [(0, True), (1, True), (2, True), (3, False)]
            checked = await client.validate(items)
            assert (checked.summary.valid, checked.summary.failed) == (3, 1)

    asyncio.run(run())
