import type { ErrorDetail } from "./models.js";
/** Base class of every error this library throws. */
export declare class IntakeError extends Error {
    name: string;
}
/**
 * The API answered with an error (after the retries, when it was retryable). `code` is the
 * API's stable code (`validation_failed`, `rate_limited`, ...); `requestId` is what to quote to
 * support; `details` names the bad fields on `validation_failed`.
 */
export declare class ApiError extends IntakeError {
    name: string;
    readonly status: number;
    readonly code: string;
    readonly requestId: string | null;
    readonly details: ErrorDetail[];
    readonly retryAfter: number | null;
    constructor(status: number, code: string, message: string, requestId?: string | null, details?: ErrorDetail[], retryAfter?: number | null);
    static fromResponse(response: Response): Promise<ApiError>;
}
/** No answer came (connection refused or reset, timeout) after the retries; see `cause`. */
export declare class TransportError extends IntakeError {
    name: string;
}
/** Where the API's error object's fields are on an `ApiError`, for the test against the OpenAPI document. */
export declare const API_ERROR_FIELDS: Readonly<Record<string, keyof ApiError>>;
/** Retry-After in seconds (the API sends whole seconds); null when absent or unreadable. */
export declare function parseRetryAfter(value: string | null): number | null;
