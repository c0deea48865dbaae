"""Client of the intake conversion API."""

__version__ = "0.1.0"

from ._batching import MAX_BATCH_BYTES, MAX_BATCH_ITEMS
from ._client import AsyncIntakeClient, IntakeClient
from ._errors import ApiError, IntakeError, TransportError
from ._models import (
    Address,
    BatchItemResult,
    BatchReport,
    BatchSummary,
    ConversionInput,
    ConversionResult,
    ErrorDetail,
    ItemError,
    ValidationItemResult,
    ValidationReport,
    ValidationSummary,
    Workspace,
)
from .hashing import hash_address, hash_email, prehash

__all__ = [
    "MAX_BATCH_BYTES",
    "MAX_BATCH_ITEMS",
    "Address",
    "ApiError",
    "AsyncIntakeClient",
    "BatchItemResult",
    "BatchReport",
    "BatchSummary",
    "ConversionInput",
    "ConversionResult",
    "ErrorDetail",
    "IntakeClient",
    "IntakeError",
    "ItemError",
    "TransportError",
    "ValidationItemResult",
    "ValidationReport",
    "ValidationSummary",
    "Workspace",
    "hash_address",
    "hash_email",
    "prehash",
]
