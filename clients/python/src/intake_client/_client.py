"""The HTTP clients, blocking and asyncio: one conversion, many in batches, validation, the
workspace; with retries. Both share everything but the waiting and the I/O."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Awaitable, Callable, Iterable, Mapping

import httpx

from . import __version__
from ._batching import MAX_BATCH_BYTES, MAX_BATCH_ITEMS, Batch, Oversized, batches, to_json
from ._errors import ApiError, TransportError
from ._models import (
    BatchItemResult,
    BatchReport,
    BatchSummary,
    ConversionInput,
    ConversionResult,
    ItemError,
    ValidationItemResult,
    ValidationReport,
    ValidationSummary,
    Workspace,
)

# 429 and 503 say when to come back (Retry-After); 408 and every other 5xx are retried with
# backoff. Re-sending is safe: the pair (event, external_id) turns a repeat into an update.
_RETRY_AFTER_STATUSES = frozenset({429, 503})
_BACKOFF_STATUSES = frozenset({408})

Conversions = Iterable[ConversionInput | Mapping[str, Any]]


@dataclass
class _Wait:
    """The outcome of a try that is to be tried again after this many seconds."""

    seconds: float


class _Base:
    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        max_attempts: int,
        backoff_initial: float,
        backoff_max: float,
    ) -> None:
        if not base_url:
            raise ValueError("base_url is required: the API's address ending in /v1")
        if not api_key:
            raise ValueError("api_key is required: a svc_live_... key")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.max_attempts = max_attempts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._headers = {
            "Authorization": f"Bearer {api_key}",
            "Accept": "application/json",
            "User-Agent": f"intake-client-python/{__version__}",
        }

    def _headers_for(self, body: bytes | None) -> dict[str, str]:
        return {**self._headers, "Content-Type": "application/json"} if body is not None else dict(self._headers)

    def _answer(self, response: httpx.Response, attempt: int) -> Any:
        """The body of a success, a `_Wait` before trying again, or raises the error."""
        if response.status_code < 400:
            return response.json()
        error = ApiError.from_response(response)
        status = response.status_code
        retryable = status in _RETRY_AFTER_STATUSES or status in _BACKOFF_STATUSES or status >= 500
        if attempt >= self.max_attempts or not retryable:
            raise error
        if status in _RETRY_AFTER_STATUSES and error.retry_after is not None:
            # A little jitter, so that clients refused together do not come back together.
            return _Wait(error.retry_after + random.uniform(0, 0.5))
        return _Wait(self._backoff(attempt))

    def _failed(self, method: str, url: str, failure: httpx.TransportError, attempt: int) -> _Wait:
        if attempt >= self.max_attempts:
            raise TransportError(f"{method} {url}: {failure!r} (after {attempt} attempts)") from failure
        return _Wait(self._backoff(attempt))

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff before the retry after attempt ``attempt``, its upper half random."""
        full = min(self.backoff_max, self.backoff_initial * 2.0 ** (attempt - 1))
        return full / 2 + random.uniform(0, full / 2)


def _batch_report(results: list[BatchItemResult]) -> BatchReport:
    counts = {"created": 0, "updated": 0, "unchanged": 0}
    for result in results:
        if result.conversion is not None:
            counts[result.conversion.result] = counts.get(result.conversion.result, 0) + 1
    failed = sum(1 for r in results if not r.ok)
    return BatchReport(results, BatchSummary(failed=failed, **counts))


def _validation_report(results: list[ValidationItemResult]) -> ValidationReport:
    valid = sum(1 for r in results if r.ok)
    return ValidationReport(results, ValidationSummary(valid=valid, failed=len(results) - valid))


class IntakeClient(_Base):
    """A client of the intake API.

    ``base_url`` is the API's address ending in ``/v1`` (``https://intake.example.com/v1``).
    A request is tried at most ``max_attempts`` times: after a 429 or 503 it waits the
    ``Retry-After`` seconds, after a 408, another 5xx or a connection error an exponential
    backoff with jitter (``backoff_initial`` doubling up to ``backoff_max`` seconds).
    ``timeout`` bounds each try (seconds)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        max_attempts: int = 5,
        timeout: float = 30.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        http_client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(
            base_url, api_key, max_attempts=max_attempts, backoff_initial=backoff_initial, backoff_max=backoff_max
        )
        self._sleep = sleep
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(timeout=timeout)

    @classmethod
    def from_env(cls, **options: Any) -> IntakeClient:
        """A client from ``INTAKE_BASE_URL`` and ``INTAKE_API_KEY``."""
        return cls(os.environ["INTAKE_BASE_URL"], os.environ["INTAKE_API_KEY"], **options)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> IntakeClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def send(self, conversion: ConversionInput | Mapping[str, Any]) -> ConversionResult:
        """Creates or updates one conversion; ``result`` says which (or ``unchanged``)."""
        body = self._request("POST", "/conversions", to_json(conversion))
        return ConversionResult.from_json(body["conversion"])

    def send_many(self, conversions: Conversions, *, batch_size: int = MAX_BATCH_ITEMS) -> BatchReport:
        """Sends conversions in batches of at most ``batch_size`` items and 1 MiB, in order.
        Returns one result per item in input order, ``index`` counting over the whole input.
        Items fail on their own; an error of a whole batch (after its retries) is raised, and
        re-sending everything is then safe."""
        results: list[BatchItemResult] = []
        for part in batches(conversions, batch_size):
            if isinstance(part, Oversized):
                results.append(BatchItemResult(part.index, False, error=_oversized(part)))
                continue
            body = self._request("POST", "/conversions/batch", part.body())
            results.extend(BatchItemResult.from_json(r, part.offset) for r in _results(body, part))
        return _batch_report(results)

    def validate(self, conversions: Conversions, *, batch_size: int = MAX_BATCH_ITEMS) -> ValidationReport:
        """Validates and normalizes conversions without storing anything (the same batches as
        `send_many`). Per item: ``ok`` with the warnings a send would get, or the error."""
        results: list[ValidationItemResult] = []
        for part in batches(conversions, batch_size):
            if isinstance(part, Oversized):
                results.append(ValidationItemResult(part.index, False, error=_oversized(part)))
                continue
            body = self._request("POST", "/conversions/validate", part.body())
            results.extend(ValidationItemResult.from_json(r, part.offset) for r in _results(body, part))
        return _validation_report(results)

    def get_workspace(self) -> Workspace:
        """The key's workspace (verifies the key; needs the scope ``workspace:read``)."""
        body: Workspace = self._request("GET", "/workspace", None)
        return body

    def _request(self, method: str, path: str, body: bytes | None) -> Any:
        url = self.base_url + path
        headers = self._headers_for(body)
        attempt = 0
        while True:
            attempt += 1
            try:
                outcome = self._answer(self._http.request(method, url, content=body, headers=headers), attempt)
            except httpx.TransportError as failure:
                outcome = self._failed(method, url, failure, attempt)
            if not isinstance(outcome, _Wait):
                return outcome
            self._sleep(outcome.seconds)


class AsyncIntakeClient(_Base):
    """The same client for asyncio (``await client.send(...)``), with the same options; use it
    as ``async with AsyncIntakeClient(...) as client`` or call ``aclose()``."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        max_attempts: int = 5,
        timeout: float = 30.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        http_client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        super().__init__(
            base_url, api_key, max_attempts=max_attempts, backoff_initial=backoff_initial, backoff_max=backoff_max
        )
        self._sleep = sleep
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(timeout=timeout)

    @classmethod
    def from_env(cls, **options: Any) -> AsyncIntakeClient:
        """A client from ``INTAKE_BASE_URL`` and ``INTAKE_API_KEY``."""
        return cls(os.environ["INTAKE_BASE_URL"], os.environ["INTAKE_API_KEY"], **options)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncIntakeClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.aclose()

    async def send(self, conversion: ConversionInput | Mapping[str, Any]) -> ConversionResult:
        """Creates or updates one conversion; ``result`` says which (or ``unchanged``)."""
        body = await self._request("POST", "/conversions", to_json(conversion))
        return ConversionResult.from_json(body["conversion"])

    async def send_many(self, conversions: Conversions, *, batch_size: int = MAX_BATCH_ITEMS) -> BatchReport:
        """As `IntakeClient.send_many`: batches in order, one result per item in input order."""
        results: list[BatchItemResult] = []
        for part in batches(conversions, batch_size):
            if isinstance(part, Oversized):
                results.append(BatchItemResult(part.index, False, error=_oversized(part)))
                continue
            body = await self._request("POST", "/conversions/batch", part.body())
            results.extend(BatchItemResult.from_json(r, part.offset) for r in _results(body, part))
        return _batch_report(results)

    async def validate(self, conversions: Conversions, *, batch_size: int = MAX_BATCH_ITEMS) -> ValidationReport:
        """As `IntakeClient.validate`: validates without storing anything."""
        results: list[ValidationItemResult] = []
        for part in batches(conversions, batch_size):
            if isinstance(part, Oversized):
                results.append(ValidationItemResult(part.index, False, error=_oversized(part)))
                continue
            body = await self._request("POST", "/conversions/validate", part.body())
            results.extend(ValidationItemResult.from_json(r, part.offset) for r in _results(body, part))
        return _validation_report(results)

    async def get_workspace(self) -> Workspace:
        """The key's workspace (verifies the key; needs the scope ``workspace:read``)."""
        body: Workspace = await self._request("GET", "/workspace", None)
        return body

    async def _request(self, method: str, path: str, body: bytes | None) -> Any:
        url = self.base_url + path
        headers = self._headers_for(body)
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._http.request(method, url, content=body, headers=headers)
                outcome = self._answer(response, attempt)
            except httpx.TransportError as failure:
                outcome = self._failed(method, url, failure, attempt)
            if not isinstance(outcome, _Wait):
                return outcome
            await self._sleep(outcome.seconds)


def _oversized(part: Oversized) -> ItemError:
    return ItemError(
        "payload_too_large",
        f"the item alone ({part.size} bytes) makes a batch body over {MAX_BATCH_BYTES} bytes; not sent",
    )


def _results(body: Mapping[str, Any], part: Batch) -> list[Mapping[str, Any]]:
    results = body.get("results")
    if not isinstance(results, list) or len(results) != len(part.items):
        raise ApiError(200, "unexpected_response", "the batch answer does not have one result per item")
    return results
