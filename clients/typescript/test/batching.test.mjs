// Cutting items into batch bodies within 500 items and 1 MiB.
import { test } from "node:test";
import assert from "node:assert/strict";
import { batches } from "../dist/batching.js";
import { MAX_BATCH_BYTES } from "../dist/index.js";

const bytes = (text) => new TextEncoder().encode(text).length;

test("cut by item count", () => {
  const parts = [...batches(Array.from({ length: 1201 }, (_, n) => ({ n })), 500)];
  assert.deepEqual(parts.map((p) => p.items.length), [500, 500, 201]);
  assert.deepEqual(parts.map((p) => p.offset), [0, 500, 1000]);
});

test("cut by body size exactly at the limit", () => {
  const item = { hdyhau: "x".repeat(90) };
  const size = JSON.stringify(item).length;
  const perBody = 200 * (size + 1) - 1 + '{"conversions":[]}'.length;
  const parts = [...batches(Array(450).fill(item), 500, perBody)];
  assert.deepEqual(parts.map((p) => p.items.length), [200, 200, 50]);
  for (const part of parts) {
    assert.ok(bytes(part.body) <= perBody);
    assert.equal(bytes(part.body), part.bytes);
    assert.equal(JSON.parse(part.body).conversions.length, part.items.length);
  }
  assert.equal(bytes(parts[0].body), perBody, "a body fills up to the limit");
});

test("multi-byte text is counted in bytes", () => {
  const parts = [...batches(Array(2000).fill({ hdyhau: "😀".repeat(600) }))];
  assert.equal(parts.reduce((n, p) => n + p.items.length, 0), 2000);
  for (const part of parts) assert.ok(bytes(part.body) <= MAX_BATCH_BYTES);
  assert.ok(parts[0].items.length < 500);
});

test("an item over the limit alone is not sent", () => {
  const parts = [...batches([{ a: 1 }, { big: "x".repeat(MAX_BATCH_BYTES) }, { b: 2 }])];
  assert.deepEqual(
    parts.map((p) => [p.kind, p.kind === "batch" ? p.offset : p.index]),
    [["batch", 0], ["oversized", 1], ["batch", 2]],
  );
});
