// Against a running gateway (see support.mjs): what a user of the library sees.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:net";
import { ApiError, IntakeClient, MAX_BATCH_BYTES, TransportError, prehash } from "../dist/index.js";
import { conversion, liveSkip, requireLive } from "./support.mjs";

const client = () => new IntakeClient(requireLive());

test("send creates, then reports unchanged and updated", { skip: liveSkip }, async () => {
  const c = client();
  const sent = conversion("lead", { value: "12.50", currency: "eur" });
  const first = await c.send(sent);
  assert.equal(first.result, "created");
  assert.match(first.id, /^cnv_/);
  assert.match(first.chain_id, /^chn_/);
  assert.deepEqual([first.event, first.external_id], ["lead", sent.external_id]);
  assert.equal((await c.send(sent)).result, "unchanged");
  const again = await c.send({ ...sent, value: 13 });
  assert.deepEqual([again.result, again.id], ["updated", first.id]);
});

test("send reports warnings", { skip: liveSkip }, async () => {
  const result = await client().send(conversion("lead", { email: "not an email", phone: "12", country: "US" }));
  assert.equal(result.result, "created");
  assert.deepEqual([...result.warnings].sort(), ["email_invalid", "phone_unparseable"]);
});

test("sendMany answers every item in input order", { skip: liveSkip }, async () => {
  const items = Array.from({ length: 1201 }, () => conversion("signed"));
  items[700] = { ...items[700], event: "not valid!" };
  items[1100] = { ...items[20] };
  const report = await client().sendMany(items);
  assert.deepEqual(report.results.map((r) => r.index), items.map((_, i) => i));
  const failed = report.results.filter((r) => !r.ok);
  assert.deepEqual(failed.map((r) => r.index), [700]);
  assert.equal(failed[0].error.code, "validation_failed");
  assert.deepEqual(failed[0].error.details.map((d) => d.path), ["event"]);
  report.results.forEach((r, i) => {
    if (r.ok) assert.equal(r.conversion.external_id, items[i].external_id);
  });
  assert.equal(report.results[1100].conversion.result, "unchanged");
  // A batch retried after a 500 (a loaded machine) reads its first attempt's items as unchanged.
  const { created, updated, unchanged, failed: failedCount } = report.summary;
  assert.deepEqual([created + unchanged, updated, failedCount], [1200, 0, 1]);
  assert.ok(created >= 700, String(created));
});

test("sendMany cuts bodies at one mebibyte", { skip: liveSkip }, async () => {
  const bodies = [];
  const recording = async (url, init) => {
    if (String(url).endsWith("/batch")) bodies.push(new TextEncoder().encode(init.body).length);
    return fetch(url, init);
  };
  const wide = "\u{1f600}"; // four bytes of UTF-8, one character for the API's length limits
  const tags = Object.fromEntries(["a", "b", "c", "d", "e"].map((k) => [`tag_${k}`, wide.repeat(64)]));
  const items = Array.from({ length: 700 }, () =>
    conversion("purchase", { hdyhau: wide.repeat(200), contact_id: wide.repeat(128), tags }),
  );
  const report = await new IntakeClient({ ...requireLive(), fetch: recording }).sendMany(items);
  assert.deepEqual(report.results.filter((r) => !r.ok).slice(0, 3), []);
  assert.equal(report.summary.created + report.summary.unchanged, 700);
  assert.ok(bodies.length >= 2, String(bodies));
  assert.ok(bodies.every((size) => size <= MAX_BATCH_BYTES), String(bodies));
  assert.ok(Math.max(...bodies) > MAX_BATCH_BYTES * 0.99, "a batch is filled up to the limit");
});

test("validate answers per item and stores nothing", { skip: liveSkip }, async () => {
  const c = client();
  const good = conversion("lead");
  const report = await c.validate([good, conversion("lead", { email: "nope" }), { ...conversion("lead"), event: "bad event" }]);
  assert.deepEqual(report.results.map((r) => [r.index, r.ok]), [[0, true], [1, true], [2, false]]);
  assert.deepEqual(report.results[0].warnings, []);
  assert.deepEqual(report.results[1].warnings, ["email_invalid"]);
  assert.equal(report.results[2].error.code, "validation_failed");
  assert.deepEqual(report.results[2].error.details.map((d) => d.path), ["event"]);
  assert.deepEqual(report.summary, { valid: 2, failed: 1 });
  assert.equal((await c.send(good)).result, "created", "validation wrote nothing");
});

test("prehashed identifiers equal the gateway's own hashes", { skip: liveSkip }, async () => {
  const c = client();
  const raw = conversion("lead", {
    email: "  Ann.Smith+crm@Example.COM ",
    phone: "+14155552671",
    country: "GB",
    address: { line1: "10, Downing Street", zip: "sw1a 2aa" },
  });
  assert.equal((await c.send(raw)).result, "created");
  const hashed = prehash(raw);
  assert.ok(!("email" in hashed) && !("address" in hashed) && hashed.phone === raw.phone);
  // The gateway hashed the raw values; the same pair sent with the client's hashes changes
  // nothing only if every hash is the same.
  assert.equal((await c.send(hashed)).result, "unchanged");
  assert.equal((await c.send({ ...hashed, email_sha256: "0".repeat(64) })).result, "updated");
});

for (const [phone, country] of [["+4402079460958", null], ["+1415555267", null], ["+491701234567", "US"]]) {
  test(`prehash stores ${phone} (country ${country}) as the gateway does`, { skip: liveSkip }, async () => {
    // `+digits` that the gateway normalizes otherwise or refuses: hashed as it is, it would be
    // stored apart from the same phone sent raw.
    const c = client();
    const raw = conversion("lead", country === null ? { phone } : { phone, country });
    assert.equal((await c.send(raw)).result, "created");
    assert.equal((await c.send(prehash(raw))).result, "unchanged");
  });
}

test("raw and hashed form together is refused", { skip: liveSkip }, async () => {
  const sent = { ...conversion("lead", { email: "ann@example.com" }), email_sha256: "a".repeat(64) };
  await assert.rejects(client().send(sent), (e) => {
    assert.ok(e instanceof ApiError);
    assert.deepEqual([e.status, e.code], [422, "validation_failed"]);
    assert.ok(e.details.some((d) => d.path === "email_sha256"), JSON.stringify(e.details));
    return true;
  });
});

test("getWorkspace", { skip: liveSkip }, async () => {
  const workspace = await client().getWorkspace();
  assert.match(workspace.workspace.id, /^ws_/);
  assert.deepEqual(new Set(workspace.key.scopes), new Set(["workspace:read", "conversions:write"]));
  assert.equal(typeof workspace.script.snippet, "string");
});

test("API errors carry code, message, request id and details", { skip: liveSkip }, async () => {
  const { baseUrl } = requireLive();
  await assert.rejects(new IntakeClient({ baseUrl, apiKey: `svc_live_${"x".repeat(40)}` }).getWorkspace(), (e) => {
    assert.ok(e instanceof ApiError);
    assert.deepEqual([e.status, e.code], [401, "invalid_api_key"]);
    assert.ok(e.message && e.requestId);
    return true;
  });
  await assert.rejects(client().send({ event: "lead", external_id: "x", occurred_at: "yesterday", colour: "red" }), (e) => {
    assert.deepEqual([e.status, e.code], [422, "validation_failed"]);
    assert.deepEqual(e.details.map((d) => d.path).sort(), ["colour", "occurred_at"]);
    return true;
  });
});

test("connection errors are retried, then thrown", async () => {
  const server = createServer();
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  const sleeps = [];
  const c = new IntakeClient({
    baseUrl: `http://127.0.0.1:${port}/v1`,
    apiKey: "svc_live_x",
    maxAttempts: 3,
    sleep: async (ms) => void sleeps.push(ms),
  });
  await assert.rejects(c.send(conversion()), TransportError);
  assert.equal(sleeps.length, 2);
});

