// The library's models against the OpenAPI document: a field added to or removed from the API
// and not here (or the reverse) fails this test. The compiler holds MODEL_FIELDS to the types.
import { test } from "node:test";
import assert from "node:assert/strict";
import { API_ERROR_FIELDS, ApiError, MODEL_FIELDS } from "../dist/index.js";
import { openapi } from "./support.mjs";

class Schema {
  constructor(document) {
    this.document = document;
  }
  resolve(schema) {
    while (schema.$ref) {
      schema = schema.$ref.replace(/^#\//, "").split("/").reduce((node, part) => node[part], this.document);
    }
    return schema;
  }
  response(path, method, status) {
    const response = this.resolve(this.document.paths[path][method].responses[status]);
    return this.resolve(response.content["application/json"].schema);
  }
  request(path) {
    const body = this.resolve(this.document.paths[path].post.requestBody);
    return this.resolve(body.content["application/json"].schema);
  }
  /** Property names of an object schema, or of the union of its oneOf/anyOf branches. */
  properties(schema) {
    schema = this.resolve(schema);
    const names = new Set(Object.keys(schema.properties ?? {}));
    for (const branch of [...(schema.oneOf ?? []), ...(schema.anyOf ?? [])]) {
      for (const name of this.properties(branch)) names.add(name);
    }
    return names;
  }
  /** Required names of an object schema, or of the object branches of its oneOf/anyOf. */
  required(schema) {
    schema = this.resolve(schema);
    const names = new Set(schema.required ?? []);
    for (const branch of [...(schema.oneOf ?? []), ...(schema.anyOf ?? [])]) {
      for (const name of this.required(branch)) names.add(name);
    }
    return names;
  }
  child(schema, name) {
    schema = this.resolve(schema);
    if (name === "[]") return this.resolve(schema.items);
    for (let branch of [schema, ...(schema.oneOf ?? []), ...(schema.anyOf ?? [])]) {
      branch = this.resolve(branch);
      if (branch.properties?.[name]) return this.resolve(branch.properties[name]);
    }
    throw new Error(`no property ${name}`);
  }
}

const fields = (name) => new Set(MODEL_FIELDS[name]);

test("ConversionInput and Address", async () => {
  const schema = new Schema(await openapi());
  const single = schema.request("/conversions");
  assert.deepEqual(fields("conversionInput"), schema.properties(single));
  assert.deepEqual(fields("conversionInputRequired"), schema.required(single));
  const address = schema.child(single, "address");
  assert.deepEqual(fields("address"), schema.properties(address));
  assert.deepEqual(fields("addressRequired"), schema.required(address));
  const item = schema.child(schema.child(schema.request("/conversions/batch"), "conversions"), "[]");
  assert.deepEqual(schema.properties(item), schema.properties(single));
});

test("ConversionResult and the batch answer", async () => {
  const schema = new Schema(await openapi());
  for (const status of ["200", "201"]) {
    const answer = schema.response("/conversions", "post", status);
    assert.deepEqual(fields("conversionResult"), schema.properties(schema.child(answer, "conversion")));
  }
  const batch = schema.response("/conversions/batch", "post", "200");
  const item = schema.child(schema.child(batch, "results"), "[]");
  assert.deepEqual(fields("batchItem"), schema.properties(item));
  assert.deepEqual(fields("itemError"), schema.properties(schema.child(item, "error")));
  assert.deepEqual(fields("batchSummary"), schema.properties(schema.child(batch, "summary")));
});

test("the validation answer", async () => {
  const schema = new Schema(await openapi());
  const answer = schema.response("/conversions/validate", "post", "200");
  assert.deepEqual(schema.properties(answer), new Set(["results", "summary"]));
  const item = schema.child(schema.child(answer, "results"), "[]");
  assert.deepEqual(fields("validationItem"), schema.properties(item));
  assert.deepEqual(fields("itemError"), schema.properties(schema.child(item, "error")));
  assert.deepEqual(fields("validationSummary"), schema.properties(schema.child(answer, "summary")));
  assert.deepEqual(schema.properties(schema.request("/conversions/validate")), new Set(["conversions"]));
});

test("the error object", async () => {
  const schema = new Schema(await openapi());
  const error = schema.child(schema.response("/conversions", "post", "422"), "error");
  assert.deepEqual(new Set(Object.keys(API_ERROR_FIELDS)), schema.properties(error));
  const sample = new ApiError(422, "c", "m", "r", []);
  for (const property of Object.values(API_ERROR_FIELDS)) assert.ok(property in sample, property);
  assert.deepEqual(fields("errorDetail"), schema.properties(schema.child(error, "details").items));
});

test("the workspace", async () => {
  const schema = new Schema(await openapi());
  const answer = schema.response("/workspace", "get", "200");
  assert.deepEqual(fields("workspace"), schema.properties(answer));
  for (const [name, model] of [["workspace", "workspaceInfo"], ["script", "script"], ["key", "key"]]) {
    assert.deepEqual(fields(model), schema.properties(schema.child(answer, name)), name);
  }
  assert.deepEqual(fields("site"), schema.properties(schema.child(schema.child(answer, "sites"), "[]")));
});
