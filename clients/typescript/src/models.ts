// The API's shapes (docs/api.md, "Conversion fields"). A test holds the field lists at the end of this file to
// the OpenAPI document the gateway serves; the compiler holds them to the types.

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
export type BatchItemResult =
  | { index: number; ok: true; conversion: ConversionResult }
  | { index: number; ok: false; error: ItemError };

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
export type ValidationItemResult =
  | { index: number; ok: true; warnings: string[] }
  | { index: number; ok: false; error: ItemError };

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
  script: { src: string; snippet: string };
  sites: Site[];
  key: { id: string; scopes: string[] };
}

type KeysOfUnion<T> = T extends unknown ? keyof T : never;
/** Every key of T, no more, no less: the compiler refuses a list that drifts from its type. */
type Fields<T> = Record<KeysOfUnion<T>, true>;
/** The keys T requires. */
type RequiredKeys<T> = { [K in keyof T]-?: object extends Pick<T, K> ? never : K }[keyof T];

const conversionInput: Fields<ConversionInput> = {
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
const conversionInputRequired: Record<RequiredKeys<ConversionInput>, true> = {
  event: true,
  external_id: true,
  occurred_at: true,
};
const address: Fields<Address> = { line1: true, zip: true, country: true };
const addressRequired: Record<RequiredKeys<Address>, true> = { line1: true, zip: true };
const conversionResult: Fields<ConversionResult> = {
  id: true,
  event: true,
  external_id: true,
  chain_id: true,
  result: true,
  warnings: true,
};
const itemError: Fields<ItemError> = { code: true, message: true, details: true };
const errorDetail: Fields<ErrorDetail> = { path: true, message: true };
const batchItem: Fields<BatchItemResult> = { index: true, ok: true, conversion: true, error: true };
const batchSummary: Fields<BatchSummary> = { created: true, updated: true, unchanged: true, failed: true };
const validationItem: Fields<ValidationItemResult> = { index: true, ok: true, warnings: true, error: true };
const validationSummary: Fields<ValidationSummary> = { valid: true, failed: true };
const workspace: Fields<Workspace> = { workspace: true, script: true, sites: true, key: true };
const workspaceInfo: Fields<WorkspaceInfo> = {
  id: true,
  name: true,
  projectId: true,
  status: true,
  siteRestriction: true,
};
const script: Fields<Workspace["script"]> = { src: true, snippet: true };
const site: Fields<Site> = { host: true, lastSeenAt: true };
const key: Fields<Workspace["key"]> = { id: true, scopes: true };

/** The field names of each model, for the test that compares them with the OpenAPI document. */
export const MODEL_FIELDS: Readonly<Record<string, readonly string[]>> = Object.fromEntries(
  Object.entries({
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
  }).map(([name, fields]) => [name, Object.keys(fields)]),
);
