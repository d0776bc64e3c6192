"""Kubernetes manifests checked as the API server checks them, for the manifest tests: custom
resources against their CRDs' schemas (``strict``), core ones with kubernetes-validate."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from support import tool

# The Kubernetes versions whose schemas the core manifests are checked against: the oldest
# still widely run .. the newest kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")


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


def kubernetes_validate(docs: list[dict[str, Any]], version: str,
                        tmp: Path) -> subprocess.CompletedProcess:
    """kubernetes-validate --strict on ``docs`` against Kubernetes ``version``'s schemas."""
    path = tmp / "core.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return subprocess.run([tool("kubernetes-validate"), "--strict", "-k", version, str(path)],
                          capture_output=True, text=True, timeout=120)
