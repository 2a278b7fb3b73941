"""The Grafana dashboard (k8s/dashboards/duoserve.json): valid JSON that queries only the
metrics the services export (vLLM's names, and go-grpc-prometheus's for the gRPC servers),
and every one of them at least once."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from shared.metrics.catalog import ALL_METRICS
from tests.k8s.manifests import K8S_DIR, run, tool

DASHBOARD = K8S_DIR / "dashboards" / "duoserve.json"

# The names Prometheus stores (counters gain _total, histograms their series), per metric the
# services export (shared.metrics.catalog: vLLM's names and go-grpc-prometheus's).
EXPORTED = {series: spec.name for spec in ALL_METRICS for series in spec.series_names}
# Exported but not worth a panel: handled calls already show the call rate.
NOT_ON_DASHBOARD = {"grpc_server_started"}

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
_PROMQL_WORDS |= {"and", "or", "unless", "offset", "inf", "nan"}
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_GRAFANA_VARIABLE = re.compile(r"\$(\{(\w+)[^}]*\}|(\w+))")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (Grafana's label_values() included)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings: label values, regexes
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\w+", "", expr)  # Grafana variables
    label_values = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr)
    if label_values:
        expr = label_values.group(1)
    names = set()
    for match in _IDENTIFIER.finditer(expr):
        rest = expr[match.end() :].lstrip()
        if rest.startswith("(") or match.group().lower() in _PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(match.group())
    return names


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = list(dashboard["panels"])
    for panel in dashboard["panels"]:
        panels += panel.get("panels", [])  # collapsed rows hold theirs
    return panels


def _queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def test_metric_names_are_extracted() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, engine) (rate(vllm:iteration_tokens_total_bucket"
        '{model_name=~"$model_name", engine!="a b"}[$__rate_interval]))) / on (engine) up'
    )
    assert metric_names(expr) == {"vllm:iteration_tokens_total_bucket", "up"}
    assert metric_names('label_values(vllm:x{namespace="n"}, engine)') == {"vllm:x"}


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = _dashboard()
    queried = set().union(*(metric_names(expr) for expr in _queries(dashboard)))
    unknown = queried - set(EXPORTED)
    assert not unknown, f"the dashboard queries metrics nobody exports: {sorted(unknown)}"
    missing = set(EXPORTED.values()) - {EXPORTED[name] for name in queried} - NOT_ON_DASHBOARD
    assert not missing, f"metrics the dashboard never shows: {sorted(missing)}"


def test_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = _panels(dashboard)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    for text in _queries(dashboard):
        for match in _GRAFANA_VARIABLE.finditer(text):
            name = match.group(2) or match.group(3)
            assert name.startswith("__") or name in variables, f"${name} is not defined"


def test_panels_filter_vllm_metrics_by_model() -> None:
    """Every panel selects vLLM series by model_name, so one dashboard serves many models."""
    panels = _panels(_dashboard())
    for expr in (target["expr"] for panel in panels for target in panel.get("targets", [])):
        for selector in re.findall(r"(vllm:\w+)(\{[^}]*\})?", expr):
            assert "model_name" in selector[1], expr


def test_promql_parses(tmp_path: Path) -> None:
    """promtool (Debian's prometheus package) parses every query, as recording rules."""
    promtool = tool("promtool")  # make test installs it; fails, never skips, without it
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for number, expr in enumerate(_queries(_dashboard())):
        label_values = re.fullmatch(r"label_values\((.*),\s*\w+\)", expr)
        if label_values:
            expr = label_values.group(1)
        expr = expr.replace("$__rate_interval", "5m")
        expr = _GRAFANA_VARIABLE.sub(".*", expr)
        rules += [f"      - record: dashboard:query{number}", f"        expr: {json.dumps(expr)}"]
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(rules) + "\n")
    result = run([promtool, "check", "rules", str(path)], 60)
    assert result.returncode == 0, result.stdout + result.stderr
