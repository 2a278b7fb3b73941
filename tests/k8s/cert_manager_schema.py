"""Strict JSON schemas for the cert-manager fields k8s/components/tls uses
(cert-manager.io/v1 Certificate and Issuer).

kubernetes-validate has no schemas for CRD kinds. Field names, types and enums follow
cert-manager's CRDs; unlike them, unknown fields are refused, so a misspelt field fails here
instead of being pruned by the API server. A field k8s/ starts using is added here on purpose.
"""

from __future__ import annotations

from typing import Any

from tests.k8s.servicemonitor_schema import METADATA

_DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"}
# cert-manager's KeyUsage enum.
_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime",
    "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc",
]  # fmt: skip
_ISSUER_REF = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
        "group": {"type": "string"},
    },
}


def _resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
    }


CERTIFICATE_SCHEMA = _resource(
    "Certificate",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["secretName", "issuerRef"],
        "properties": {
            "secretName": {"type": "string"},
            "commonName": {"type": "string", "maxLength": 64},
            "dnsNames": {"type": "array", "items": {"type": "string"}},
            "ipAddresses": {"type": "array", "items": {"type": "string"}},
            "isCA": {"type": "boolean"},
            "usages": {"type": "array", "items": {"enum": _USAGES}},
            "duration": _DURATION,
            "renewBefore": _DURATION,
            "privateKey": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    "rotationPolicy": {"enum": ["Never", "Always"]},
                },
            },
            "issuerRef": _ISSUER_REF,
        },
    },
)

ISSUER_SCHEMA = _resource(
    "Issuer",
    {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "maxProperties": 1,  # exactly one kind of issuer
        "properties": {
            "selfSigned": {"type": "object", "additionalProperties": False},
            "ca": {
                "type": "object",
                "additionalProperties": False,
                "required": ["secretName"],
                "properties": {"secretName": {"type": "string"}},
            },
        },
    },
)
