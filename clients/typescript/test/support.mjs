// Shared by the tests. The live tests need a running gateway: INTAKE_BASE_URL (ending in /v1)
// and INTAKE_API_KEY (scopes workspace:read and conversions:write). Without them they are
// skipped, unless INTAKE_CLIENTS_REQUIRE_LIVE=1 (the repository's test suite sets it), which
// fails them.
import { readFileSync, existsSync } from "node:fs";
import { randomUUID } from "node:crypto";
import { fileURLToPath } from "node:url";
import path from "node:path";

export const PACKAGE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
export const REPO = path.resolve(PACKAGE, "..", "..");
export const VECTORS = path.join(REPO, "docs", "normalization-vectors.json");

const baseUrl = process.env.INTAKE_BASE_URL;
const apiKey = process.env.INTAKE_API_KEY;
export const live = baseUrl && apiKey ? { baseUrl, apiKey } : null;
/** For `test(name, { skip: liveSkip }, ...)`. */
export const liveSkip = live
  ? false
  : process.env.INTAKE_CLIENTS_REQUIRE_LIVE === "1"
    ? false
    : "no gateway: set INTAKE_BASE_URL and INTAKE_API_KEY";

export function requireLive() {
  if (!live) throw new Error("INTAKE_BASE_URL and INTAKE_API_KEY are not set");
  return live;
}

export function vectors() {
  if (!existsSync(VECTORS)) throw new Error(`${VECTORS} is missing`);
  const document = JSON.parse(readFileSync(VECTORS, "utf8"));
  if (document.version !== 1) throw new Error("unknown vectors version");
  return document.cases;
}

/** The document the running gateway serves, else the one the gateway is built with. */
export async function openapi() {
  if (baseUrl) {
    const response = await fetch(`${baseUrl.replace(/\/+$/, "")}/openapi.json`);
    if (!response.ok) throw new Error(`openapi.json: ${response.status}`);
    return response.json();
  }
  return JSON.parse(readFileSync(path.join(REPO, "gateway", "openapi.json"), "utf8"));
}

export function unique(prefix = "js") {
  return `${prefix}-${randomUUID()}`;
}

export function conversion(event = "lead", fields = {}) {
  return { event, external_id: unique(), occurred_at: Date.now(), ...fields };
}
