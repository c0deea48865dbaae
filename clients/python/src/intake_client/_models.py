"""The API's shapes (docs/api.md, "Conversion fields"). Inputs are TypedDicts, so plain dicts
type-check; results are dataclasses built from the JSON, ignoring fields this version does not
know (docs/api.md, "Versioning"). A test holds every field list here to the OpenAPI document the
gateway serves."""

# No `from __future__ import annotations` here: TypedDict must see `Required` at class creation.
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Required, TypedDict


class Address(TypedDict, total=False):
    line1: Required[str]
    zip: Required[str]
    country: str | None


class ConversionInput(TypedDict, total=False):
    event: Required[str]
    external_id: Required[str | int]
    occurred_at: Required[str | int]
    parent_external_id: str | int | None
    visitor_id: str | None
    click_id: str | None
    contact_id: str | None
    email: str | None
    email_sha256: str | None
    phone: str | None
    phone_sha256: str | None
    country: str | None
    address: Address | None
    address_sha256: str | None
    value: float | int | str | None
    currency: str | None
    hdyhau: str | None
    tags: dict[str, str] | None


ResultKind = Literal["created", "updated", "unchanged"]


@dataclass(frozen=True)
class ConversionResult:
    id: str
    event: str
    external_id: str
    chain_id: str
    result: ResultKind
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ConversionResult":
        return cls(
            id=data["id"],
            event=data["event"],
            external_id=data["external_id"],
            chain_id=data["chain_id"],
            result=data["result"],
            warnings=list(data.get("warnings") or []),
        )


@dataclass(frozen=True)
class ErrorDetail:
    path: str
    message: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ErrorDetail":
        return cls(path=str(data.get("path", "")), message=str(data.get("message", "")))


def _details(data: Mapping[str, Any]) -> list[ErrorDetail]:
    return [ErrorDetail.from_json(d) for d in data.get("details") or [] if isinstance(d, Mapping)]


@dataclass(frozen=True)
class ItemError:
    """Why one item of a batch or of a validation failed."""

    code: str
    message: str
    details: list[ErrorDetail] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ItemError":
        return cls(code=str(data.get("code", "")), message=str(data.get("message", "")), details=_details(data))


@dataclass(frozen=True)
class BatchItemResult:
    """One item of `send_many`; ``index`` is its position in the whole input, not in its batch."""

    index: int
    ok: bool
    conversion: ConversionResult | None = None
    error: ItemError | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any], offset: int = 0) -> "BatchItemResult":
        ok = bool(data["ok"])
        return cls(
            index=int(data["index"]) + offset,
            ok=ok,
            conversion=ConversionResult.from_json(data["conversion"]) if ok else None,
            error=None if ok else ItemError.from_json(data.get("error") or {}),
        )


@dataclass(frozen=True)
class BatchSummary:
    created: int = 0
    updated: int = 0
    unchanged: int = 0
    failed: int = 0


@dataclass(frozen=True)
class BatchReport:
    """Per-item results in input order, and their counts."""

    results: list[BatchItemResult]
    summary: BatchSummary


@dataclass(frozen=True)
class ValidationItemResult:
    """One item of `validate`; ``index`` is its position in the whole input."""

    index: int
    ok: bool
    warnings: list[str] = field(default_factory=list)
    error: ItemError | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any], offset: int = 0) -> "ValidationItemResult":
        ok = bool(data["ok"])
        return cls(
            index=int(data["index"]) + offset,
            ok=ok,
            warnings=list(data.get("warnings") or []),
            error=None if ok else ItemError.from_json(data.get("error") or {}),
        )


@dataclass(frozen=True)
class ValidationSummary:
    valid: int = 0
    failed: int = 0


@dataclass(frozen=True)
class ValidationReport:
    results: list[ValidationItemResult]
    summary: ValidationSummary


class WorkspaceInfo(TypedDict):
    id: str
    name: str
    projectId: str
    status: str
    siteRestriction: Literal["any", "listed"]


class Script(TypedDict):
    src: str
    snippet: str


class Site(TypedDict):
    host: str
    lastSeenAt: str | None


class KeyInfo(TypedDict):
    id: str
    scopes: list[str]


class Workspace(TypedDict):
    """GET /workspace, as the JSON reads (camelCase names included)."""

    workspace: WorkspaceInfo
    script: Script
    sites: list[Site]
    key: KeyInfo
