export interface Address {
    line1: string;
    zip: string;
    country?: string | null;
}
export interface ConversionInput {
    event: string;
    external_id: string | number;
    occurred_at: string | number;
    parent_external_id?: string | number | null;
    visitor_id?: string | null;
    click_id?: string | null;
    contact_id?: string | null;
    email?: string | null;
    email_sha256?: string | null;
    phone?: string | null;
    phone_sha256?: string | null;
    country?: string | null;
    address?: Address | null;
    address_sha256?: string | null;
    value?: number | string | null;
    currency?: string | null;
    hdyhau?: string | null;
    tags?: Record<string, string> | null;
}
export type ResultKind = "created" | "updated" | "unchanged";
export interface ConversionResult {
    id: string;
    event: string;
    external_id: string;
    chain_id: string;
    result: ResultKind;
    warnings?: string[];
}
export interface ErrorDetail {
    path: string;
    message: string;
}
/** Why one item of a batch or of a validation failed. */
export interface ItemError {
    code: string;
    message: string;
    details?: ErrorDetail[];
}
/** One item of `sendMany`; `index` is its position in the whole input, not in its batch. */
export type BatchItemResult = {
    index: number;
    ok: true;
    conversion: ConversionResult;
} | {
    index: number;
    ok: false;
    error: ItemError;
};
export interface BatchSummary {
    created: number;
    updated: number;
    unchanged: number;
    failed: number;
}
export interface BatchReport {
    results: BatchItemResult[];
    summary: BatchSummary;
}
/** One item of `validate`; `index` is its position in the whole input. */
export type ValidationItemResult = {
    index: number;
    ok: true;
    warnings: string[];
} | {
    index: number;
    ok: false;
    error: ItemError;
};
export interface ValidationSummary {
    valid: number;
    failed: number;
}
export interface ValidationReport {
    results: ValidationItemResult[];
    summary: ValidationSummary;
}
export interface WorkspaceInfo {
    id: string;
    name: string;
    projectId: string;
    status: string;
    siteRestriction: "any" | "listed";
}
export interface Site {
    host: string;
    lastSeenAt: string | null;
}
/** GET /workspace, as the JSON reads. */
export interface Workspace {
    workspace: WorkspaceInfo;
    script: {
        src: string;
        snippet: string;
    };
    sites: Site[];
    key: {
        id: string;
        scopes: string[];
    };
}
/** The field names of each model, for the test that compares them with the OpenAPI document. */
export declare const MODEL_FIELDS: Readonly<Record<string, readonly string[]>>;
