// Retries, errors and result parsing against a mock fetch (no network).
import { test } from "node:test";
import assert from "node:assert/strict";
import { ApiError, IntakeClient, TransportError } from "../dist/index.js";

const CONVERSION = { event: "lead", external_id: "1", occurred_at: 1_700_000_000_000 };
const CREATED = { id: "cnv_1", event: "lead", external_id: "1", chain_id: "chn_1", result: "created" };

const json = (status, body, headers = {}) =>
  new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json", ...headers } });
const error = (status, code, headers = {}) =>
  json(status, { error: { code, message: code.replaceAll("_", " "), request_id: "req_1" } }, { "x-request-id": "req_1", ...headers });

function scripted(...answers) {
  const requests = [];
  const sleeps = [];
  const client = new IntakeClient({
    baseUrl: "https://intake.test/v1/",
    apiKey: "svc_live_x",
    fetch: async (url, init) => {
      requests.push({ url, init });
      const answer = answers.shift();
      if (answer instanceof Error) throw answer;
      return answer;
    },
    sleep: async (ms) => void sleeps.push(ms),
  });
  return { client, requests, sleeps };
}

test("request shape", async () => {
  const { client, requests } = scripted(json(201, { conversion: CREATED }));
  const result = await client.send(CONVERSION);
  assert.equal(result.result, "created");
  assert.equal(requests.length, 1);
  const [{ url, init }] = requests;
  assert.equal(url, "https://intake.test/v1/conversions");
  assert.equal(init.method, "POST");
  assert.equal(init.headers.Authorization, "Bearer svc_live_x");
  assert.equal(init.headers["Content-Type"], "application/json");
  assert.deepEqual(JSON.parse(init.body), CONVERSION);
});

for (const [status, code] of [[429, "rate_limited"], [503, "service_unavailable"]]) {
  test(`waits Retry-After on ${status}`, async () => {
    const { client, requests, sleeps } = scripted(error(status, code, { "retry-after": "7" }), json(200, { conversion: CREATED }));
    assert.equal((await client.send(CONVERSION)).id, "cnv_1");
    assert.equal(requests.length, 2);
    assert.equal(sleeps.length, 1);
    assert.ok(sleeps[0] >= 7000 && sleeps[0] <= 7500, String(sleeps[0]));
  });
}

test("backs off on 5xx and connection errors", async () => {
  const { client, requests, sleeps } = scripted(
    error(500, "internal_error"),
    new TypeError("fetch failed"),
    new Response("bad gateway", { status: 502 }),
    new DOMException("timed out", "TimeoutError"),
    json(201, { conversion: CREATED }),
  );
  assert.equal((await client.send(CONVERSION)).result, "created");
  assert.equal(requests.length, 5);
  sleeps.forEach((slept, i) => {
    const full = 500 * 2 ** i;
    assert.ok(slept >= full / 2 && slept <= full, `${i}: ${slept}`);
  });
});

test("gives up after maxAttempts", async () => {
  const { client, requests, sleeps } = scripted(...Array.from({ length: 5 }, () => error(500, "internal_error")));
  await assert.rejects(client.send(CONVERSION), (e) => {
    assert.ok(e instanceof ApiError);
    assert.deepEqual([e.status, e.code, e.requestId, e.message], [500, "internal_error", "req_1", "internal error"]);
    return true;
  });
  assert.equal(requests.length, 5);
  assert.equal(sleeps.length, 4);
});

test("connection errors end in TransportError", async () => {
  const { client, requests } = scripted(...Array.from({ length: 5 }, () => new TypeError("fetch failed")));
  await assert.rejects(client.send(CONVERSION), (e) => e instanceof TransportError && e.cause instanceof TypeError);
  assert.equal(requests.length, 5);
});

for (const [status, code] of [[400, "invalid_json"], [401, "invalid_api_key"], [422, "validation_failed"]]) {
  test(`${status} is not retried`, async () => {
    const { client, requests, sleeps } = scripted(error(status, code));
    await assert.rejects(client.send(CONVERSION), (e) => e instanceof ApiError && e.code === code && e.status === status);
    assert.equal(requests.length, 1);
    assert.equal(sleeps.length, 0);
  });
}

test("error details, and a body that is not the API's", async () => {
  const body = { error: { code: "validation_failed", message: "invalid", request_id: "req_9", details: [{ path: "event", message: "bad" }] } };
  const { client } = scripted(json(422, body), new Response("<html>", { status: 404 }));
  await assert.rejects(client.send(CONVERSION), (e) => {
    assert.deepEqual(e.details, [{ path: "event", message: "bad" }]);
    return true;
  });
  await assert.rejects(client.send(CONVERSION), (e) => e.code === "http_404");
});

function batchFetch(answer) {
  return async (_url, init) => json(200, answer(JSON.parse(init.body).conversions));
}

test("validate reports global indexes across batches", async () => {
  const client = new IntakeClient({
    baseUrl: "https://intake.test/v1",
    apiKey: "svc_live_x",
    fetch: batchFetch((items) => {
      const results = items.map((item, index) =>
        item.event === "bad!"
          ? { index, ok: false, error: { code: "validation_failed", message: "m" } }
          : { index, ok: true, warnings: item.w ?? [] },
      );
      const failed = results.filter((r) => !r.ok).length;
      return { results, summary: { valid: items.length - failed, failed } };
    }),
  });
  const report = await client.validate([{ event: "lead" }, { event: "bad!" }, { event: "lead", w: ["email_invalid"] }], { batchSize: 2 });
  assert.deepEqual(report.results, [
    { index: 0, ok: true, warnings: [] },
    { index: 1, ok: false, error: { code: "validation_failed", message: "m" } },
    { index: 2, ok: true, warnings: ["email_invalid"] },
  ]);
  assert.deepEqual(report.summary, { valid: 2, failed: 1 });
});

test("sendMany reports global indexes and counts", async () => {
  const client = new IntakeClient({
    baseUrl: "https://intake.test/v1",
    apiKey: "svc_live_x",
    fetch: batchFetch((items) => ({
      results: items.map((item, index) => ({ index, ok: true, conversion: { ...CREATED, external_id: String(item.external_id) } })),
      summary: { created: items.length, updated: 0, unchanged: 0, failed: 0 },
    })),
  });
  const items = Array.from({ length: 7 }, (_, n) => ({ ...CONVERSION, external_id: n }));
  const report = await client.sendMany(items, { batchSize: 3 });
  assert.deepEqual(report.results.map((r) => r.index), [0, 1, 2, 3, 4, 5, 6]);
  assert.deepEqual(report.results.map((r) => r.conversion.external_id), ["0", "1", "2", "3", "4", "5", "6"]);
  assert.deepEqual(report.summary, { created: 7, updated: 0, unchanged: 0, failed: 0 });
});
