export { IntakeClient, VERSION, MAX_BATCH_BYTES, MAX_BATCH_ITEMS } from "./client.js";
export { ApiError, IntakeError, TransportError, API_ERROR_FIELDS } from "./errors.js";
export { hashAddress, hashEmail, normalizeAddress, normalizeEmail, prehash, sha256Hex, } from "./hashing.js";
export { MODEL_FIELDS } from "./models.js";
