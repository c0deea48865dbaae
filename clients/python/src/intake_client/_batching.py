"""Items cut into batch requests within the endpoint's limits (docs/api.md, "Limits"): at most 500 items
and 1 MiB of JSON body. Each item is serialized once; a batch's body is those exact bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

MAX_BATCH_ITEMS = 500
MAX_BATCH_BYTES = 1024 * 1024
_OPEN = b'{"conversions":['
_CLOSE = b"]}"


def to_json(value: Any) -> bytes:
    """Compact UTF-8 JSON; NaN and infinities are refused here rather than by the gateway."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


@dataclass
class Batch:
    offset: int
    """Index in the whole input of the batch's first item."""
    items: list[bytes]

    def body(self) -> bytes:
        return _OPEN + b",".join(self.items) + _CLOSE


@dataclass
class Oversized:
    """An item that alone makes a body over the limit: it is answered without being sent."""

    index: int
    size: int


def batches(
    items: Iterable[Any], max_items: int = MAX_BATCH_ITEMS, max_bytes: int = MAX_BATCH_BYTES
) -> Iterator[Batch | Oversized]:
    """Batches in input order, lazily, so a long iterable is never held whole."""
    if not 1 <= max_items <= MAX_BATCH_ITEMS:
        raise ValueError(f"max_items must be 1 to {MAX_BATCH_ITEMS}")
    empty = len(_OPEN) + len(_CLOSE)
    current: list[bytes] = []
    offset = 0
    size = empty
    for index, item in enumerate(items):
        encoded = to_json(item)
        if empty + len(encoded) > max_bytes:
            if current:
                yield Batch(offset, current)
                current, size = [], empty
            yield Oversized(index, len(encoded))
            continue
        # A comma before every item but the first.
        added = len(encoded) + (1 if current else 0)
        if current and (size + added > max_bytes or len(current) >= max_items):
            yield Batch(offset, current)
            current, size = [], empty
            added = len(encoded)
        if not current:
            offset = index
        current.append(encoded)
        size += added
    if current:
        yield Batch(offset, current)
