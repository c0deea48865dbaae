"""Cutting items into batch bodies within 500 items and 1 MiB."""

from __future__ import annotations

import json

from intake_client import MAX_BATCH_BYTES
from intake_client._batching import Batch, Oversized, batches


def test_cut_by_item_count() -> None:
    parts = list(batches(({"n": i} for i in range(1201)), 500))
    assert [len(p.items) for p in parts if isinstance(p, Batch)] == [500, 500, 201]
    assert [p.offset for p in parts if isinstance(p, Batch)] == [0, 500, 1000]


def test_cut_by_body_size_exactly_at_the_limit() -> None:
    item = {"hdyhau": "x" * 90}
    size = len(json.dumps(item, separators=(",", ":")))
    envelope = len('{"conversions":[]}')
    per_body = (200 * (size + 1) - 1) + envelope  # 200 items and their commas
    parts = list(batches([item] * 450, 500, per_body))
    assert [len(p.items) for p in parts if isinstance(p, Batch)] == [200, 200, 50]
    for part in parts:
        assert isinstance(part, Batch)
        body = part.body()
        assert len(body) <= per_body
        assert len(json.loads(body)["conversions"]) == len(part.items)
    assert len(parts[0].body()) == per_body, "a body fills up to the limit, not one byte short"


def test_multibyte_text_is_counted_in_bytes() -> None:
    item = {"hdyhau": "€" * 800}  # 2400 bytes of UTF-8: 500 of them are over 1 MiB
    parts = [p for p in batches([item] * 2000) if isinstance(p, Batch)]
    assert sum(len(p.items) for p in parts) == 2000
    assert all(len(p.body()) <= MAX_BATCH_BYTES for p in parts)
    assert len(parts[0].items) < 500


def test_an_item_over_the_limit_alone_is_not_sent() -> None:
    parts = list(batches([{"a": 1}, {"big": "x" * MAX_BATCH_BYTES}, {"b": 2}]))
    assert isinstance(parts[0], Batch) and parts[0].offset == 0 and len(parts[0].items) == 1
    assert isinstance(parts[1], Oversized) and parts[1].index == 1
    assert isinstance(parts[2], Batch) and parts[2].offset == 2
