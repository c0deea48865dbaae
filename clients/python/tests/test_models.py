"""The library's models against the OpenAPI document: a field added to or removed from the
API and not here (or the reverse) fails this test."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, get_type_hints

from intake_client import (
    ApiError,
    BatchItemResult,
    BatchSummary,
    ConversionResult,
    ErrorDetail,
    ItemError,
    ValidationItemResult,
    ValidationSummary,
)
from intake_client import _models as models


class Schema:
    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            node: Any = self.document
            for part in schema["$ref"].removeprefix("#/").split("/"):
                node = node[part]
            schema = node
        return schema

    def response(self, path: str, method: str, status: str) -> dict[str, Any]:
        operation = self.document["paths"][path][method]
        response = self.resolve(operation["responses"][status])
        return self.resolve(response["content"]["application/json"]["schema"])

    def request(self, path: str) -> dict[str, Any]:
        body = self.resolve(self.document["paths"][path]["post"]["requestBody"])
        return self.resolve(body["content"]["application/json"]["schema"])

    def properties(self, schema: dict[str, Any]) -> set[str]:
        """Property names of an object schema, or of the union of its oneOf/anyOf branches."""
        schema = self.resolve(schema)
        names = set(schema.get("properties", {}))
        for branch in schema.get("oneOf", []) + schema.get("anyOf", []):
            names |= self.properties(branch)
        return names

    def required(self, schema: dict[str, Any]) -> set[str]:
        """Required names of an object schema, or of the object branches of its oneOf/anyOf."""
        schema = self.resolve(schema)
        names = set(schema.get("required", []))
        for branch in schema.get("oneOf", []) + schema.get("anyOf", []):
            names |= self.required(branch)
        return names

    def child(self, schema: dict[str, Any], name: str) -> dict[str, Any]:
        schema = self.resolve(schema)
        if name == "[]":
            return self.resolve(schema["items"])
        for branch in [schema] + schema.get("oneOf", []) + schema.get("anyOf", []):
            branch = self.resolve(branch)
            if name in branch.get("properties", {}):
                return self.resolve(branch["properties"][name])
        raise KeyError(name)


def typed_dict_keys(cls: Any) -> set[str]:
    return set(get_type_hints(cls))


def dataclass_fields(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_conversion_input(openapi: dict[str, Any]) -> None:
    schema = Schema(openapi)
    single = schema.request("/conversions")
    assert typed_dict_keys(models.ConversionInput) == schema.properties(single)
    assert models.ConversionInput.__required_keys__ == schema.required(single)
    assert typed_dict_keys(models.Address) == schema.properties(schema.child(single, "address"))
    assert models.Address.__required_keys__ == schema.required(schema.child(single, "address"))
    batch_item = schema.child(schema.child(schema.request("/conversions/batch"), "conversions"), "[]")
    assert schema.properties(batch_item) == schema.properties(single)


def test_conversion_result_and_batch(openapi: dict[str, Any]) -> None:
    schema = Schema(openapi)
    for status in ["200", "201"]:
        answer = schema.response("/conversions", "post", status)
        assert dataclass_fields(ConversionResult) == schema.properties(schema.child(answer, "conversion"))
    batch = schema.response("/conversions/batch", "post", "200")
    item = schema.child(schema.child(batch, "results"), "[]")
    assert dataclass_fields(BatchItemResult) == schema.properties(item)
    assert dataclass_fields(ItemError) == schema.properties(schema.child(item, "error"))
    assert dataclass_fields(BatchSummary) == schema.properties(schema.child(batch, "summary"))


def test_validation_result(openapi: dict[str, Any]) -> None:
    schema = Schema(openapi)
    answer = schema.response("/conversions/validate", "post", "200")
    assert schema.properties(answer) == {"results", "summary"}
    item = schema.child(schema.child(answer, "results"), "[]")
    assert dataclass_fields(ValidationItemResult) == schema.properties(item)
    assert dataclass_fields(ItemError) == schema.properties(schema.child(item, "error"))
    assert dataclass_fields(ValidationSummary) == schema.properties(schema.child(answer, "summary"))
    assert schema.properties(schema.request("/conversions/validate")) == {"conversions"}


def test_error_object(openapi: dict[str, Any]) -> None:
    schema = Schema(openapi)
    error = schema.child(schema.response("/conversions", "post", "422"), "error")
    carried = set(inspect.signature(ApiError.__init__).parameters) - {"self", "status", "retry_after"}
    assert carried == schema.properties(error)
    assert dataclass_fields(ErrorDetail) == schema.properties(schema.child(error, "details")["items"])


def test_workspace(openapi: dict[str, Any]) -> None:
    schema = Schema(openapi)
    answer = schema.response("/workspace", "get", "200")
    assert typed_dict_keys(models.Workspace) == schema.properties(answer)
    for name, model in [
        ("workspace", models.WorkspaceInfo),
        ("script", models.Script),
        ("key", models.KeyInfo),
    ]:
        assert typed_dict_keys(model) == schema.properties(schema.child(answer, name)), name
    assert typed_dict_keys(models.Site) == schema.properties(schema.child(schema.child(answer, "sites"), "[]"))
