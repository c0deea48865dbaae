// The HTTP client: one conversion, many in batches, validation, the workspace; with retries.

import { batches, MAX_BATCH_BYTES, MAX_BATCH_ITEMS, type Batch, type Oversized } from "./batching.js";
import { ApiError, TransportError } from "./errors.js";
import type {
  BatchItemResult,
  BatchReport,
  ConversionInput,
  ConversionResult,
  ItemError,
  ValidationItemResult,
  ValidationReport,
  Workspace,
} from "./models.js";

export const VERSION = "0.1.0";

export interface ClientOptions {
  /** The API's address ending in `/v1`, e.g. `https://intake.example.com/v1`. */
  baseUrl: string;
  /** A `svc_live_...` key. */
  apiKey: string;
  /** Tries per request, the first included (default 5). */
  maxAttempts?: number;
  /** Per try (default 30 000 ms). */
  timeoutMs?: number;
  /** Backoff after a 5xx or connection error: this doubling per try up to `backoffMaxMs` (500 ms, 30 000 ms). */
  backoffInitialMs?: number;
  backoffMaxMs?: number;
  /** Another fetch (a mock, a proxy agent); default the global fetch. */
  fetch?: typeof globalThis.fetch;
  /** How to wait between tries; default setTimeout. */
  sleep?: (ms: number) => Promise<void>;
}

export interface BatchOptions {
  /** Items per request, 1 to 500 (default 500); bodies stay within 1 MiB whatever it is. */
  batchSize?: number;
}

// 429 and 503 say when to come back (Retry-After); 408 and every other 5xx are retried with
// backoff. Re-sending is safe: the pair (event, external_id) turns a repeat into an update.
const RETRY_AFTER_STATUSES = new Set([429, 503]);

/**
 * A client of the intake API. A request is tried at most `maxAttempts` times: after a 429 or 503
 * it waits the `Retry-After` seconds; after a 408, another 5xx or a connection error an
 * exponential backoff with jitter.
 */
export class IntakeClient {
  readonly baseUrl: string;
  readonly maxAttempts: number;
  private readonly apiKey: string;
  private readonly timeoutMs: number;
  private readonly backoffInitialMs: number;
  private readonly backoffMaxMs: number;
  private readonly fetch: typeof globalThis.fetch;
  private readonly sleep: (ms: number) => Promise<void>;

  constructor(options: ClientOptions) {
    if (!options.baseUrl) throw new TypeError("baseUrl is required: the API's address ending in /v1");
    if (!options.apiKey) throw new TypeError("apiKey is required: a svc_live_... key");
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.apiKey = options.apiKey;
    this.maxAttempts = options.maxAttempts ?? 5;
    if (!Number.isInteger(this.maxAttempts) || this.maxAttempts < 1) throw new RangeError("maxAttempts must be at least 1");
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.backoffInitialMs = options.backoffInitialMs ?? 500;
    this.backoffMaxMs = options.backoffMaxMs ?? 30_000;
    this.fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.sleep = options.sleep ?? ((ms) => new Promise((resolve) => setTimeout(resolve, ms)));
  }

  /** A client from `INTAKE_BASE_URL` and `INTAKE_API_KEY`. */
  static fromEnv(options: Partial<ClientOptions> = {}): IntakeClient {
    const baseUrl = process.env.INTAKE_BASE_URL;
    const apiKey = process.env.INTAKE_API_KEY;
    if (!baseUrl || !apiKey) throw new Error("INTAKE_BASE_URL and INTAKE_API_KEY must be set");
    return new IntakeClient({ baseUrl, apiKey, ...options });
  }

  /** Creates or updates one conversion; `result` says which (or `unchanged`). */
  async send(conversion: ConversionInput): Promise<ConversionResult> {
    const body = (await this.request("POST", "/conversions", JSON.stringify(conversion))) as {
      conversion: ConversionResult;
    };
    return body.conversion;
  }

  /**
   * Sends conversions in batches of at most `batchSize` items and 1 MiB, in order. One result
   * per item in input order, `index` counting over the whole input. Items fail on their own; an
   * error of a whole batch (after its retries) is thrown, and re-sending everything is then safe.
   */
  async sendMany(conversions: Iterable<ConversionInput>, options: BatchOptions = {}): Promise<BatchReport> {
    const results: BatchItemResult[] = [];
    for (const part of batches(conversions, options.batchSize)) {
      if (part.kind === "oversized") {
        results.push({ index: part.index, ok: false, error: oversized(part) });
        continue;
      }
      const answer = await this.request("POST", "/conversions/batch", part.body);
      for (const item of itemsOf(answer, part)) results.push({ ...item, index: item.index + part.offset } as BatchItemResult);
    }
    const summary = { created: 0, updated: 0, unchanged: 0, failed: 0 };
    for (const result of results) {
      if (result.ok) summary[result.conversion.result] += 1;
      else summary.failed += 1;
    }
    return { results, summary };
  }

  /**
   * Validates and normalizes conversions without storing anything (the same batches as
   * `sendMany`). Per item: `ok` with the warnings a send would get, or the error.
   */
  async validate(conversions: Iterable<ConversionInput>, options: BatchOptions = {}): Promise<ValidationReport> {
    const results: ValidationItemResult[] = [];
    for (const part of batches(conversions, options.batchSize)) {
      if (part.kind === "oversized") {
        results.push({ index: part.index, ok: false, error: oversized(part) });
        continue;
      }
      const answer = await this.request("POST", "/conversions/validate", part.body);
      for (const item of itemsOf(answer, part)) {
        const index = Number(item.index) + part.offset;
        results.push(
          item.ok === true
            ? { index, ok: true, warnings: Array.isArray(item.warnings) ? (item.warnings as string[]) : [] }
            : { index, ok: false, error: item.error as ItemError },
        );
      }
    }
    const valid = results.filter((r) => r.ok).length;
    return { results, summary: { valid, failed: results.length - valid } };
  }

  /** The key's workspace (verifies the key; needs the scope `workspace:read`). */
  async getWorkspace(): Promise<Workspace> {
    return (await this.request("GET", "/workspace", undefined)) as Workspace;
  }

  private async request(method: string, path: string, body: string | undefined): Promise<unknown> {
    const headers: Record<string, string> = {
      Authorization: `Bearer ${this.apiKey}`,
      Accept: "application/json",
      "User-Agent": `intake-client-js/${VERSION}`,
    };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const url = this.baseUrl + path;
    for (let attempt = 1; ; attempt++) {
      const last = attempt >= this.maxAttempts;
      let response: Response;
      try {
        response = await this.fetch(url, { method, headers, body, signal: AbortSignal.timeout(this.timeoutMs) });
      } catch (cause) {
        if (last) throw new TransportError(`${method} ${url}: ${describe(cause)} (after ${attempt} attempts)`, { cause });
        await this.sleep(this.backoff(attempt));
        continue;
      }
      if (response.status < 400) return response.json();
      const error = await ApiError.fromResponse(response);
      const retryable = RETRY_AFTER_STATUSES.has(response.status) || response.status === 408 || response.status >= 500;
      if (last || !retryable) throw error;
      if (RETRY_AFTER_STATUSES.has(response.status) && error.retryAfter !== null) {
        // A little jitter, so that clients refused together do not come back together.
        await this.sleep(error.retryAfter * 1000 + Math.random() * 500);
      } else {
        await this.sleep(this.backoff(attempt));
      }
    }
  }

  /** Exponential backoff after attempt `attempt`, its upper half random. */
  private backoff(attempt: number): number {
    const full = Math.min(this.backoffMaxMs, this.backoffInitialMs * 2 ** (attempt - 1));
    return full / 2 + Math.random() * (full / 2);
  }
}

function oversized(part: Oversized): ItemError {
  return {
    code: "payload_too_large",
    message: `the item alone (${part.bytes} bytes) makes a batch body over ${MAX_BATCH_BYTES} bytes; not sent`,
  };
}

function itemsOf(answer: unknown, part: Batch): Array<Record<string, unknown> & { index: number }> {
  const results = (answer as { results?: unknown }).results;
  if (!Array.isArray(results) || results.length !== part.items.length) {
    throw new ApiError(200, "unexpected_response", "the batch answer does not have one result per item");
  }
  return results as Array<Record<string, unknown> & { index: number }>;
}

function describe(cause: unknown): string {
  if (cause instanceof Error) {
    const inner = cause.cause instanceof Error ? `: ${cause.cause.message}` : "";
    return `${cause.message}${inner}`;
  }
  return String(cause);
}

export { MAX_BATCH_BYTES, MAX_BATCH_ITEMS };
