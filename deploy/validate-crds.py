"""Validates Kubernetes resources of custom kinds against the CRDs vendored in a directory.

validate-crds.py SCHEMA_DIR MANIFEST...: every document of the manifests whose apiVersion and
kind a vendored CRD defines is validated against that CRD's openAPIV3Schema, strictly: a field
the schema does not name is an error, as the API server's strict field validation would make
it, except where the schema keeps unknown fields (x-kubernetes-preserve-unknown-fields).
metadata may hold name, namespace, labels and annotations only. Prints one line per validated
resource and exits 1 on any error.

validate-crds.py SCHEMA_DIR --kinds: prints the "KIND APIVERSION" pairs the CRDs define, so that
deploy/validate.sh can refuse every other kind kubernetes-validate has no schema for.

Run by deploy/validate.sh with the jsonschema and PyYAML of kubernetes-validate's virtualenv.
"""

import copy
import pathlib
import re
import sys

import jsonschema
import yaml

NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": NAME.pattern},
        "namespace": {"type": "string", "maxLength": 63, "pattern": NAME.pattern},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def strict(schema):
    """The schema with every object that lists its properties closed to others."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def load_crds(directory):
    schemas = {}
    for path in sorted(pathlib.Path(directory).rglob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if not version.get("served", True):
                    continue
                schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
                schema["properties"]["metadata"] = METADATA
                schema.setdefault("required", [])
                schema["required"] = sorted(set(schema["required"]) | {"apiVersion", "kind", "metadata"})
                schemas[(f"{group}/{version['name']}", kind)] = strict(schema)
    return schemas


def main(args):
    schemas = load_crds(args[0])
    if args[1:] == ["--kinds"]:
        for api_version, kind in sorted(schemas):
            print(kind, api_version)
        return 0
    failed = False
    for manifest in args[1:]:
        for document in yaml.safe_load_all(pathlib.Path(manifest).read_text()):
            if not document:
                continue
            key = (document.get("apiVersion"), document.get("kind"))
            schema = schemas.get(key)
            if schema is None:
                continue
            name = f"{manifest}: {key[1]} {document.get('metadata', {}).get('name')}"
            validator = jsonschema.Draft7Validator(schema)
            errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
            for error in errors:
                path = ".".join(str(part) for part in error.absolute_path) or "(root)"
                print(f"{name}: {path}: {error.message}", file=sys.stderr)
            failed |= bool(errors)
            if not errors:
                print(f"valid: {name} ({key[0]})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
