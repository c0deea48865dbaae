// The API's shapes (docs/api.md, "Conversion fields"). A test holds the field lists at the end of this file to
// the OpenAPI document the gateway serves; the compiler holds them to the types.
const conversionInput = {
    event: true,
    external_id: true,
    occurred_at: true,
    parent_external_id: true,
    visitor_id: true,
    click_id: true,
    contact_id: true,
    email: true,
    email_sha256: true,
    phone: true,
    phone_sha256: true,
    country: true,
    address: true,
    address_sha256: true,
    value: true,
    currency: true,
    hdyhau: true,
    tags: true,
};
const conversionInputRequired = {
    event: true,
    external_id: true,
    occurred_at: true,
};
const address = { line1: true, zip: true, country: true };
const addressRequired = { line1: true, zip: true };
const conversionResult = {
    id: true,
    event: true,
    external_id: true,
    chain_id: true,
    result: true,
    warnings: true,
};
const itemError = { code: true, message: true, details: true };
const errorDetail = { path: true, message: true };
const batchItem = { index: true, ok: true, conversion: true, error: true };
const batchSummary = { created: true, updated: true, unchanged: true, failed: true };
const validationItem = { index: true, ok: true, warnings: true, error: true };
const validationSummary = { valid: true, failed: true };
const workspace = { workspace: true, script: true, sites: true, key: true };
const workspaceInfo = {
    id: true,
    name: true,
    projectId: true,
    status: true,
    siteRestriction: true,
};
const script = { src: true, snippet: true };
const site = { host: true, lastSeenAt: true };
const key = { id: true, scopes: true };
/** The field names of each model, for the test that compares them with the OpenAPI document. */
export const MODEL_FIELDS = Object.fromEntries(Object.entries({
    conversionInput,
    conversionInputRequired,
    address,
    addressRequired,
    conversionResult,
    itemError,
    errorDetail,
    batchItem,
    batchSummary,
    validationItem,
    validationSummary,
    workspace,
    workspaceInfo,
    script,
    site,
    key,
}).map(([name, fields]) => [name, Object.keys(fields)]));
