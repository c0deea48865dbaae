"""The hashing helper against the repository's normalization vectors (those marked `client`), and
every phone vector sent raw."""

from __future__ import annotations

import re
from typing import Any

import pytest

import intake_client
from intake_client import hash_address, hash_email, prehash
from intake_client.hashing import normalize_address, normalize_email, sha256_hex


def normalized_and_hash(case: dict[str, Any]) -> tuple[str | None, str | None]:
    kind, raw = case["kind"], case["input"]
    if kind == "email":
        return normalize_email(raw), hash_email(raw)
    if kind == "address":
        country = raw.get("country") or case.get("country")
        return normalize_address(raw["line1"], raw["zip"], country), hash_address(raw["line1"], raw["zip"], country)
    raise AssertionError(f"unknown kind {kind}")


def test_every_client_vector(vectors: list[dict[str, Any]]) -> None:
    cases = [c for c in vectors if c.get("client")]
    assert {c["kind"] for c in cases} == {"email", "address"}, "the vectors cover every helper, and no phone"
    failures = []
    for case in cases:
        got = normalized_and_hash(case)
        if got != (case["normalized"], case["sha256"]):
            failures.append(f"{case['name']}: {case['input']!r} gave {got}, expected {case['normalized']!r}")
    assert not failures, "\n".join(failures)
    assert len(cases) >= 30


def test_vector_hashes_are_the_hash_of_the_normalized_text(vectors: list[dict[str, Any]]) -> None:
    for case in vectors:
        if case["normalized"] is not None:
            assert case["sha256"] == sha256_hex(case["normalized"]), case["name"]


def test_trim_is_unicode_white_space_not_pythons_or_javascripts() -> None:
    assert normalize_email("\u3000ann@example.com\u00a0") == "ann@example.com"
    # U+FEFF is no white space to the gateway: it stays, inside the address, which then has
    # no white space and is hashed as it is.
    assert normalize_email("\ufeffann@example.com") == "\ufeffann@example.com"
    # U+001C..U+001F are white space to Python, control characters to the gateway.
    assert normalize_email("ann@example.com\x1f") is None


def test_email_rules() -> None:
    assert normalize_email("  Ann.Smith+crm@Gmail.COM ") == "ann.smith+crm@gmail.com", "dots and plus kept"
    for bad in ["", "ann", "ann@", "@example.com", "ann@example", "a@b@c.com", "ann smith@example.com", "ann@.com"]:
        assert normalize_email(bad) is None, bad


def test_every_phone_is_sent_raw(vectors: list[dict[str, Any]]) -> None:
    phones = [c for c in vectors if c["kind"] == "phone"]
    # The trap is a `+digits` phone that looks like E.164 and is not what the gateway stores.
    e164_form = re.compile(r"\+[1-9][0-9]{1,14}")
    assert any(e164_form.fullmatch(c["input"]) and c["normalized"] != c["input"] for c in phones)
    assert any(e164_form.fullmatch(c["input"]) and c["warning"] == "phone_unparseable" for c in phones)
    for case in phones:
        sent = {"event": "lead", "external_id": 1, "occurred_at": 1, "phone": case["input"]}
        if case["country"] is not None:
            sent["country"] = case["country"]
        assert prehash(sent) == sent, case["name"]
    assert not any(hasattr(intake_client.hashing, name) for name in ["hash_phone", "normalize_phone"])


def test_address_rules() -> None:
    assert normalize_address("1 Main St., Apt 4", "94105-1234", "us") == "1 main st apt 4|94105|US"
    assert normalize_address("10 Downing Street", "SW1A 2AA", "GB") == "10 downing street|sw1a 2aa|GB"
    assert normalize_address("1 Main St", "94105") == "1 main st|94105|US", "US by default"
    assert normalize_address("1 Main St", "ABCDE", "US") is None
    assert normalize_address("1 Main St", "٩٤١٠٥", "US") is None, "ASCII digits only"
    assert normalize_address("Hauptstraße 1", "1010", "AT") == "hauptstraße 1|1010|AT"
    assert normalize_address("ΟΔΟΣ 1", "10431", "GR") == "οδος 1|10431|GR", "final sigma"
    with pytest.raises(ValueError):
        normalize_address("1 Main St", "94105", "USA")


def test_prehash_replaces_raw_identifiers() -> None:
    sent = {
        "event": "lead",
        "external_id": 1,
        "occurred_at": 1_700_000_000_000,
        "email": " Ann@Example.com",
        "phone": "+14155552671",
        "country": "GB",
        "address": {"line1": "10 Downing Street", "zip": "SW1A 2AA"},
    }
    hashed = prehash(sent)
    assert hashed == {
        "event": "lead",
        "external_id": 1,
        "occurred_at": 1_700_000_000_000,
        "phone": "+14155552671",
        "country": "GB",
        "email_sha256": sha256_hex("ann@example.com"),
        "address_sha256": sha256_hex("10 downing street|sw1a 2aa|GB"),
    }
    assert "email" in sent, "the input is left as it was"
    local = prehash({"event": "lead", "external_id": 1, "occurred_at": 1, "phone": "020 7946 0958", "email": "x"})
    assert local == {"event": "lead", "external_id": 1, "occurred_at": 1, "phone": "020 7946 0958"}


def test_lower_case_is_the_gateways_unicode_not_pythons() -> None:
    # Case pairs newer than Python 3.11's Unicode 14: Latin, Garay, Beria Erfe.
    assert normalize_email("\ua7cbnn@example.com") == "\u0264nn@example.com"
    assert normalize_address("\U00010d50 \U00016ea0 \ua7dc", "1010", "AT") == "\U00010d70 \U00016ebb \u019b|1010|AT"
