// Errors thrown by the client: the API's error object (docs/api.md, "Errors"), or a request that could not
// be completed at all.
/** Base class of every error this library throws. */
export class IntakeError extends Error {
    name = "IntakeError";
}
/**
 * The API answered with an error (after the retries, when it was retryable). `code` is the
 * API's stable code (`validation_failed`, `rate_limited`, ...); `requestId` is what to quote to
 * support; `details` names the bad fields on `validation_failed`.
 */
export class ApiError extends IntakeError {
    name = "ApiError";
    status;
    code;
    requestId;
    details;
    retryAfter;
    constructor(status, code, message, requestId = null, details = [], retryAfter = null) {
        super(message);
        this.status = status;
        this.code = code;
        this.requestId = requestId;
        this.details = details;
        this.retryAfter = retryAfter;
    }
    static async fromResponse(response) {
        const headerId = response.headers.get("x-request-id");
        const retryAfter = parseRetryAfter(response.headers.get("retry-after"));
        let body = null;
        try {
            body = JSON.parse(await response.text());
        }
        catch {
            body = null;
        }
        const error = isObject(body) && isObject(body.error) ? body.error : null;
        if (error === null) {
            // Not the API's error object: a proxy or load balancer answered.
            const reason = response.statusText || "unexpected response";
            return new ApiError(response.status, `http_${response.status}`, reason, headerId, [], retryAfter);
        }
        const details = Array.isArray(error.details)
            ? error.details.filter(isObject).map((d) => ({ path: String(d.path ?? ""), message: String(d.message ?? "") }))
            : [];
        return new ApiError(response.status, String(error.code ?? `http_${response.status}`), String(error.message ?? ""), typeof error.request_id === "string" ? error.request_id : headerId, details, retryAfter);
    }
}
/** No answer came (connection refused or reset, timeout) after the retries; see `cause`. */
export class TransportError extends IntakeError {
    name = "TransportError";
}
/** Where the API's error object's fields are on an `ApiError`, for the test against the OpenAPI document. */
export const API_ERROR_FIELDS = {
    code: "code",
    message: "message",
    request_id: "requestId",
    details: "details",
};
/** Retry-After in seconds (the API sends whole seconds); null when absent or unreadable. */
export function parseRetryAfter(value) {
    if (value === null || value.trim() === "")
        return null;
    const seconds = Number(value.trim());
    return Number.isFinite(seconds) && seconds >= 0 ? seconds : null;
}
function isObject(value) {
    return typeof value === "object" && value !== null && !Array.isArray(value);
}
