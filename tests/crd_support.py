"""Custom resources checked as the API server checks them, for the manifest tests."""

from __future__ import annotations

from typing import Any


def strict(schema: Any) -> Any:
    """An openAPIV3Schema as JSON Schema, as the API server reads it: int-or-string, nullable,
    and unknown fields refused where the schema lists the fields and does not keep unknown
    ones."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in ("items", "additionalProperties", "not") else v
           for k, v in schema.items() if k != "properties"}
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = strict(schema[key])
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out
