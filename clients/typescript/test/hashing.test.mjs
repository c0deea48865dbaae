// The hashing helper against the repository's normalization vectors (those marked `client`), and
// every phone vector sent raw.
import { test } from "node:test";
import assert from "node:assert/strict";
import * as library from "../dist/index.js";
import { hashAddress, hashEmail, normalizeAddress, normalizeEmail, prehash, sha256Hex } from "../dist/index.js";
import { vectors } from "./support.mjs";

function normalizedAndHash(c) {
  if (c.kind === "email") return [normalizeEmail(c.input), hashEmail(c.input)];
  if (c.kind === "address") {
    const country = c.input.country || c.country;
    return [normalizeAddress(c.input.line1, c.input.zip, country), hashAddress(c.input.line1, c.input.zip, country)];
  }
  throw new Error(`unknown kind ${c.kind}`);
}

test("every client vector", () => {
  const cases = vectors().filter((c) => c.client);
  assert.deepEqual(new Set(cases.map((c) => c.kind)), new Set(["email", "address"]), "every helper, and no phone");
  assert.ok(cases.length >= 30, `${cases.length} cases`);
  const failures = [];
  for (const c of cases) {
    const got = normalizedAndHash(c);
    if (got[0] !== c.normalized || got[1] !== c.sha256) {
      failures.push(`${c.name}: ${JSON.stringify(c.input)} gave ${JSON.stringify(got)}, expected ${JSON.stringify(c.normalized)}`);
    }
  }
  assert.deepEqual(failures, []);
});

test("vector hashes are the hash of the normalized text", () => {
  for (const c of vectors()) {
    if (c.normalized !== null) assert.equal(c.sha256, sha256Hex(c.normalized), c.name);
  }
});

test("trim is Unicode White_Space, not JavaScript's", () => {
  assert.equal(normalizeEmail("\u3000ann@example.com\u00a0"), "ann@example.com");
  // U+FEFF is no white space to the gateway: it stays, and the address has no white space.
  assert.equal(normalizeEmail("\ufeffann@example.com"), "\ufeffann@example.com");
  assert.equal(normalizeEmail("ann@example.com\u001f"), null);
});

test("email rules", () => {
  assert.equal(normalizeEmail("  Ann.Smith+crm@Gmail.COM "), "ann.smith+crm@gmail.com");
  for (const bad of ["", "ann", "ann@", "@example.com", "ann@example", "a@b@c.com", "ann smith@example.com", "ann@.com"]) {
    assert.equal(normalizeEmail(bad), null, bad);
  }
});

test("every phone is sent raw", () => {
  const phones = vectors().filter((c) => c.kind === "phone");
  // The trap is a `+digits` phone that looks like E.164 and is not what the gateway stores.
  const e164Form = /^\+[1-9][0-9]{1,14}$/;
  assert.ok(phones.some((c) => e164Form.test(c.input) && c.normalized !== c.input));
  assert.ok(phones.some((c) => e164Form.test(c.input) && c.warning === "phone_unparseable"));
  for (const c of phones) {
    const sent = { event: "lead", external_id: 1, occurred_at: 1, phone: c.input };
    if (c.country !== null) sent.country = c.country;
    assert.deepEqual(prehash(sent), sent, c.name);
  }
  assert.ok(!("hashPhone" in library) && !("normalizePhone" in library));
});

test("address rules", () => {
  assert.equal(normalizeAddress("1 Main St., Apt 4", "94105-1234", "us"), "1 main st apt 4|94105|US");
  assert.equal(normalizeAddress("10 Downing Street", "SW1A 2AA", "GB"), "10 downing street|sw1a 2aa|GB");
  assert.equal(normalizeAddress("1 Main St", "94105"), "1 main st|94105|US");
  assert.equal(normalizeAddress("1 Main St", "ABCDE", "US"), null);
  assert.equal(normalizeAddress("1 Main St", "٩٤١٠٥", "US"), null);
  assert.equal(normalizeAddress("Hauptstraße 1", "1010", "AT"), "hauptstraße 1|1010|AT");
  assert.equal(normalizeAddress("ΟΔΟΣ 1", "10431", "GR"), "οδος 1|10431|GR");
  assert.throws(() => normalizeAddress("1 Main St", "94105", "USA"), RangeError);
});

test("prehash replaces raw identifiers", () => {
  const sent = {
    event: "lead",
    external_id: 1,
    occurred_at: 1_700_000_000_000,
    email: " Ann@Example.com",
    phone: "+14155552671",
    country: "GB",
    address: { line1: "10 Downing Street", zip: "SW1A 2AA" },
  };
  assert.deepEqual(prehash(sent), {
    event: "lead",
    external_id: 1,
    occurred_at: 1_700_000_000_000,
    phone: "+14155552671",
    country: "GB",
    email_sha256: sha256Hex("ann@example.com"),
    address_sha256: sha256Hex("10 downing street|sw1a 2aa|GB"),
  });
  assert.ok("email" in sent, "the input is left as it was");
  assert.deepEqual(prehash({ event: "lead", external_id: 1, occurred_at: 1, phone: "020 7946 0958", email: "x" }), {
    event: "lead",
    external_id: 1,
    occurred_at: 1,
    phone: "020 7946 0958",
  });
});

test("lower case is the gateway's Unicode", () => {
  assert.equal(normalizeEmail("\ua7cbnn@example.com"), "\u0264nn@example.com");
  assert.equal(normalizeAddress("\u{10d50} \u{16ea0} \ua7dc", "1010", "AT"), "\u{10d70} \u{16ebb} \u019b|1010|AT");
});
