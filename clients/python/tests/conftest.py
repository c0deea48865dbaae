"""Shared fixtures. The live tests need a running gateway: INTAKE_BASE_URL (ending in /v1) and
INTAKE_API_KEY (scopes workspace:read and conversions:write). Without them they are skipped,
unless INTAKE_CLIENTS_REQUIRE_LIVE=1 (the repository's test suite sets it), which fails them."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from intake_client import IntakeClient

REPO = Path(__file__).resolve().parents[3]
VECTORS = REPO / "docs" / "normalization-vectors.json"


def live_settings() -> tuple[str, str] | None:
    base_url, api_key = os.environ.get("INTAKE_BASE_URL"), os.environ.get("INTAKE_API_KEY")
    if base_url and api_key:
        return base_url, api_key
    if os.environ.get("INTAKE_CLIENTS_REQUIRE_LIVE") == "1":
        pytest.fail("INTAKE_BASE_URL and INTAKE_API_KEY are not set")
    pytest.skip("no gateway: set INTAKE_BASE_URL and INTAKE_API_KEY")


@pytest.fixture
def live() -> tuple[str, str]:
    settings = live_settings()
    assert settings is not None
    return settings


@pytest.fixture
def client(live: tuple[str, str]) -> Any:
    with IntakeClient(*live) as c:
        yield c


@pytest.fixture(scope="session")
def openapi() -> dict[str, Any]:
    """The document the running gateway serves, else the one the gateway is built with."""
    base_url = os.environ.get("INTAKE_BASE_URL")
    if base_url:
        return httpx.get(base_url.rstrip("/") + "/openapi.json", timeout=30).raise_for_status().json()
    return json.loads((REPO / "gateway" / "openapi.json").read_text())


@pytest.fixture(scope="session")
def vectors() -> list[dict[str, Any]]:
    assert VECTORS.exists(), f"{VECTORS} is missing"
    document = json.loads(VECTORS.read_text(encoding="utf-8"))
    assert document["version"] == 1
    return list(document["cases"])


def unique(prefix: str = "py") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_ms() -> int:
    return int(time.time() * 1000)


def conversion(event: str = "lead", **fields: Any) -> dict[str, Any]:
    return {"event": event, "external_id": unique(), "occurred_at": now_ms(), **fields}
