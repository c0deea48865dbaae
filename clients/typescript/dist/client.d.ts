import { MAX_BATCH_BYTES, MAX_BATCH_ITEMS } from "./batching.js";
import type { BatchReport, ConversionInput, ConversionResult, ValidationReport, Workspace } from "./models.js";
export declare const VERSION = "0.1.0";
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
/**
 * A client of the intake API. A request is tried at most `maxAttempts` times: after a 429 or 503
 * it waits the `Retry-After` seconds; after a 408, another 5xx or a connection error an
 * exponential backoff with jitter.
 */
export declare class IntakeClient {
    readonly baseUrl: string;
    readonly maxAttempts: number;
    private readonly apiKey;
    private readonly timeoutMs;
    private readonly backoffInitialMs;
    private readonly backoffMaxMs;
    private readonly fetch;
    private readonly sleep;
    constructor(options: ClientOptions);
    /** A client from `INTAKE_BASE_URL` and `INTAKE_API_KEY`. */
    static fromEnv(options?: Partial<ClientOptions>): IntakeClient;
    /** Creates or updates one conversion; `result` says which (or `unchanged`). */
    send(conversion: ConversionInput): Promise<ConversionResult>;
    /**
     * Sends conversions in batches of at most `batchSize` items and 1 MiB, in order. One result
     * per item in input order, `index` counting over the whole input. Items fail on their own; an
     * error of a whole batch (after its retries) is thrown, and re-sending everything is then safe.
     */
    sendMany(conversions: Iterable<ConversionInput>, options?: BatchOptions): Promise<BatchReport>;
    /**
     * Validates and normalizes conversions without storing anything (the same batches as
     * `sendMany`). Per item: `ok` with the warnings a send would get, or the error.
     */
    validate(conversions: Iterable<ConversionInput>, options?: BatchOptions): Promise<ValidationReport>;
    /** The key's workspace (verifies the key; needs the scope `workspace:read`). */
    getWorkspace(): Promise<Workspace>;
    private request;
    /** Exponential backoff after attempt `attempt`, its upper half random. */
    private backoff;
}
export { MAX_BATCH_BYTES, MAX_BATCH_ITEMS };
