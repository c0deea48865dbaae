"""Errors raised by the client: the API's error object (docs/api.md, "Errors"), or a request that could not
be completed at all."""

from __future__ import annotations

import json
from typing import Any

import httpx

from ._models import ErrorDetail


class IntakeError(Exception):
    """Base class of every error this library raises."""


class ApiError(IntakeError):
    """The API answered with an error (after the retries, when it was retryable).

    ``code`` is the API's stable error code (``validation_failed``, ``rate_limited``, ...);
    ``request_id`` is what to quote to support; ``details`` names the bad fields on
    ``validation_failed``."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        request_id: str | None = None,
        details: list[ErrorDetail] | None = None,
        retry_after: float | None = None,
    ) -> None:
        text = f"{status} {code}: {message}"
        if details:
            text += " " + "; ".join(f"{d.path or '(root)'}: {d.message}" for d in details[:5])
        super().__init__(text + (f" (request {request_id})" if request_id else ""))
        self.status = status
        self.code = code
        self.message = message
        self.request_id = request_id
        self.details = details or []
        self.retry_after = retry_after

    @classmethod
    def from_response(cls, response: httpx.Response) -> ApiError:
        header_id = response.headers.get("x-request-id")
        retry_after = parse_retry_after(response.headers.get("retry-after"))
        try:
            body: Any = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            # Not the API's error object: a proxy or load balancer answered.
            reason = response.reason_phrase or "unexpected response"
            return cls(response.status_code, f"http_{response.status_code}", reason, header_id, None, retry_after)
        details = [ErrorDetail.from_json(d) for d in error.get("details") or [] if isinstance(d, dict)]
        return cls(
            response.status_code,
            str(error.get("code", f"http_{response.status_code}")),
            str(error.get("message", "")),
            error.get("request_id") or header_id,
            details,
            retry_after,
        )


class TransportError(IntakeError):
    """The request could not be completed (connection refused or reset, timeout) after the
    retries; the original exception is ``__cause__``."""


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds (the API sends whole seconds); ``None`` when absent or unreadable."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
