"""A strict JSON schema for the LeaderWorkerSet fields k8s/overlays/multinode uses
(leaderworkerset.x-k8s.io/v1).

kubernetes-validate has no schema for this CRD kind. Field names, types and enums follow the
LeaderWorkerSet API's Go types; unlike its CRD, unknown fields are refused, so a misspelt field
fails here instead of being pruned by the API server. The two pod templates are checked as
what they are, Pods, by kubernetes-validate and checkov (test_multinode.py).
"""

from __future__ import annotations

from typing import Any

from tests.k8s.servicemonitor_schema import METADATA

_INT_OR_PERCENT = {
    "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]+%$"}]
}
_POD_TEMPLATE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["metadata", "spec"],
    "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}},
}


def _closed(required: list[str], **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": required,
        "properties": properties,
    }


LEADER_WORKER_SET_SCHEMA = _closed(
    ["apiVersion", "kind", "metadata", "spec"],
    apiVersion={"const": "leaderworkerset.x-k8s.io/v1"},
    kind={"const": "LeaderWorkerSet"},
    metadata=METADATA,
    spec=_closed(
        ["leaderWorkerTemplate"],
        replicas={"type": "integer", "minimum": 0},
        startupPolicy={"enum": ["LeaderCreated", "LeaderReady"]},
        rolloutStrategy=_closed(
            ["type"],
            type={"enum": ["RollingUpdate"]},
            rollingUpdateConfiguration=_closed(
                [],
                partition={"type": "integer", "minimum": 0},
                maxUnavailable=_INT_OR_PERCENT,
                maxSurge=_INT_OR_PERCENT,
            ),
        ),
        networkConfig=_closed(
            ["subdomainPolicy"], subdomainPolicy={"enum": ["Shared", "UniquePerReplica"]}
        ),
        leaderWorkerTemplate=_closed(
            ["workerTemplate"],
            size={"type": "integer", "minimum": 1},
            restartPolicy={
                "enum": ["None", "Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart"]
            },
            leaderTemplate=_POD_TEMPLATE,
            workerTemplate=_POD_TEMPLATE,
        ),
    ),
)
