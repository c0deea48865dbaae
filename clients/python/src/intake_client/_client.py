"""The HTTP clients, blocking and asyncio: one conversion, many in batches, validation, the
workspace; with retries. Both share everything but the waiting and the I/O: the options and their
checks, the retry policy, and each operation, written once as a generator that yields the
requests it makes and is given their answers (a client's `_run` does the I/O)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Awaitable, Callable, Generator, Generic, Iterable, Mapping, Self, TypeVar

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

# A request an operation makes: method, path, body. It is sent the answer's body back.
_Call = tuple[str, str, bytes | None]
_T = TypeVar("_T")
_Item = TypeVar("_Item", BatchItemResult, ValidationItemResult)
_Http = TypeVar("_Http", httpx.Client, httpx.AsyncClient)
# The waiting between tries: a blocking function, or a coroutine function.
_Sleep = TypeVar("_Sleep")


@dataclass
class _Wait:
    """The outcome of a try that is to be tried again after this many seconds."""

    seconds: float


class _Base(Generic[_Http, _Sleep]):
    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        max_attempts: int = 5,
        timeout: float = 30.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        http_client: _Http | None = None,
        sleep: _Sleep | None = None,
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
        self._sleep: _Sleep = sleep if sleep is not None else self._default_sleep()
        self._owns_http = http_client is None
        self._http: _Http = http_client or self._new_http(timeout)

    @classmethod
    def from_env(cls, **options: Any) -> Self:
        """A client from ``INTAKE_BASE_URL`` and ``INTAKE_API_KEY``."""
        return cls(os.environ["INTAKE_BASE_URL"], os.environ["INTAKE_API_KEY"], **options)

    def _new_http(self, timeout: float) -> _Http:
        raise NotImplementedError

    def _default_sleep(self) -> _Sleep:
        raise NotImplementedError

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


class IntakeClient(_Base[httpx.Client, Callable[[float], None]]):
    """A client of the intake API.

    ``base_url`` is the API's address ending in ``/v1`` (``https://intake.example.com/v1``).
    A request is tried at most ``max_attempts`` times: after a 429 or 503 it waits the
    ``Retry-After`` seconds, after a 408, another 5xx or a connection error an exponential
    backoff with jitter (``backoff_initial`` doubling up to ``backoff_max`` seconds).
    ``timeout`` bounds each try (seconds). ``http_client`` is used instead of a client of its
    own (and not closed); ``sleep`` waits between tries (``time.sleep`` when not given)."""

    def _new_http(self, timeout: float) -> httpx.Client:
        return httpx.Client(timeout=timeout)

    def _default_sleep(self) -> Callable[[float], None]:
        return time.sleep

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
        return self._run(_send(conversion))

    def send_many(self, conversions: Conversions, *, batch_size: int = MAX_BATCH_ITEMS) -> BatchReport:
        """Sends conversions in batches of at most ``batch_size`` items and 1 MiB, in order.
        Returns one result per item in input order, ``index`` counting over the whole input.
        Items fail on their own; an error of a whole batch (after its retries) is raised, and
        re-sending everything is then safe."""
        return _batch_report(self._run(_per_item(conversions, batch_size, "/conversions/batch", BatchItemResult)))

    def validate(self, conversions: Conversions, *, batch_size: int = MAX_BATCH_ITEMS) -> ValidationReport:
        """Validates and normalizes conversions without storing anything (the same batches as
        `send_many`). Per item: ``ok`` with the warnings a send would get, or the error."""
        items = _per_item(conversions, batch_size, "/conversions/validate", ValidationItemResult)
        return _validation_report(self._run(items))

    def get_workspace(self) -> Workspace:
        """The key's workspace (verifies the key; needs the scope ``workspace:read``)."""
        return self._run(_get_workspace())

    def _run(self, operation: Generator[_Call, Any, _T]) -> _T:
        try:
            call = next(operation)
            while True:
                call = operation.send(self._request(*call))
        except StopIteration as done:
            result: _T = done.value
            return result

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


class AsyncIntakeClient(_Base[httpx.AsyncClient, Callable[[float], Awaitable[None]]]):
    """The same client for asyncio (``await client.send(...)``), with the same options
    (``sleep``: ``asyncio.sleep`` when not given); use it as
    ``async with AsyncIntakeClient(...) as client`` or call ``aclose()``."""

    def _new_http(self, timeout: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout)

    def _default_sleep(self) -> Callable[[float], Awaitable[None]]:
        return asyncio.sleep

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
        return await self._run(_send(conversion))

    async def send_many(self, conversions: Conversions, *, batch_size: int = MAX_BATCH_ITEMS) -> BatchReport:
        """As `IntakeClient.send_many`: batches in order, one result per item in input order."""
        items = _per_item(conversions, batch_size, "/conversions/batch", BatchItemResult)
        return _batch_report(await self._run(items))

    async def validate(self, conversions: Conversions, *, batch_size: int = MAX_BATCH_ITEMS) -> ValidationReport:
        """As `IntakeClient.validate`: validates without storing anything."""
        items = _per_item(conversions, batch_size, "/conversions/validate", ValidationItemResult)
        return _validation_report(await self._run(items))

    async def get_workspace(self) -> Workspace:
        """The key's workspace (verifies the key; needs the scope ``workspace:read``)."""
        return await self._run(_get_workspace())

    async def _run(self, operation: Generator[_Call, Any, _T]) -> _T:
        try:
            call = next(operation)
            while True:
                call = operation.send(await self._request(*call))
        except StopIteration as done:
            result: _T = done.value
            return result

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


def _send(conversion: ConversionInput | Mapping[str, Any]) -> Generator[_Call, Any, ConversionResult]:
    body = yield "POST", "/conversions", to_json(conversion)
    return ConversionResult.from_json(body["conversion"])


def _per_item(
    conversions: Conversions, batch_size: int, path: str, result: type[_Item]
) -> Generator[_Call, Any, list[_Item]]:
    """The batches of `send_many` and `validate`: one result per item in input order, an item
    too large for any batch failed without being sent."""
    results: list[_Item] = []
    for part in batches(conversions, batch_size):
        if isinstance(part, Oversized):
            results.append(result(part.index, False, error=_oversized(part)))
            continue
        body = yield "POST", path, part.body()
        results.extend(result.from_json(r, part.offset) for r in _results(body, part))
    return results


def _get_workspace() -> Generator[_Call, Any, Workspace]:
    body: Workspace = yield "GET", "/workspace", None
    return body


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
