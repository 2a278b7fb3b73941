"""A strict JSON schema for the ServiceMonitor fields k8s/ uses (monitoring.coreos.com/v1).

kubernetes-validate ships schemas for built-in kinds only, so it cannot check this CRD kind.
Field names and types follow the Prometheus Operator's ServiceMonitor CRD; unlike the CRD,
unknown fields are refused, so a misspelt field fails here instead of being dropped by the
API server. A field k8s/ starts using has to be added here, on purpose.
"""

from __future__ import annotations

from typing import Any

_DURATION = {
    "type": "string",
    "pattern": "^(0|"
    + "".join(f"(([0-9]+){unit})?" for unit in ("y", "w", "d", "h", "m", "s", "ms"))
    + ")$",
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# The metadata fields k8s/ sets on a custom resource (cert_manager_schema.py uses it too).
METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
    },
}

SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["endpoints", "selector"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
                "jobLabel": {"type": "string"},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
            },
        },
    },
}
