"""What the rendered overlays must promise beyond schema validity: the pods are locked down,
probes and ports agree, a drain is never cut short, flags exist and resolve, selectors
select, only the frontend reaches the engine, and the overlays differ only in hardware."""

from __future__ import annotations

import re
import sys

import pytest

from engine_svc.server.serve import ServiceOptions
from tests.k8s.manifests import (
    OVERLAYS,
    REPO_ROOT,
    Manifest,
    assert_locked_down,
    find,
    of_kind,
    pod_spec,
    run,
)

ENGINE = "duoserve-engine"
FRONTEND = "duoserve-frontend"
# engine_svc's own grace for RPCs after a drain (STOP_GRACE_S), plus slack for the exit.
EXIT_MARGIN_S = 5
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _overlays(rendered: dict[str, list[Manifest]]) -> list[tuple[str, list[Manifest]]]:
    return [(overlay, rendered[overlay]) for overlay in OVERLAYS]


def _main_container(deployment: Manifest) -> Manifest:
    container: Manifest = pod_spec(deployment)["containers"][0]
    return container


def _config(manifests: list[Manifest], deployment: Manifest) -> dict[str, str]:
    """The environment a Deployment's main container gets from its ConfigMaps."""
    values: dict[str, str] = {}
    for source in _main_container(deployment).get("envFrom", []):
        name = source["configMapRef"]["name"]
        config_map = next(
            m for m in of_kind(manifests, "ConfigMap") if m["metadata"]["name"] == name
        )
        values.update(config_map["data"])
    return values


def _flag(container: Manifest, flag: str) -> str:
    for arg in container["args"]:
        if arg.startswith(f"{flag}="):
            value: str = arg.partition("=")[2]
            return value
    raise AssertionError(f"{container['name']} has no {flag}=")


def _resolved_flag(manifests: list[Manifest], deployment: Manifest, flag: str) -> str:
    config = _config(manifests, deployment)
    return _VARIABLE.sub(lambda m: config[m.group(1)], _flag(_main_container(deployment), flag))


def _pre_stop_sleep_s(container: Manifest) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def _selects(selector: dict[str, str], deployment: Manifest) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(key) == value for key, value in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_locked_down(overlay: str, rendered: dict[str, list[Manifest]]) -> None:
    for deployment in of_kind(rendered[overlay], "Deployment"):
        assert_locked_down(pod_spec(deployment))


@pytest.mark.parametrize("name", [ENGINE, FRONTEND])
def test_probes_hit_the_served_port(name: str, rendered: dict[str, list[Manifest]]) -> None:
    """Startup and readiness ask grpc.health.v1 on the port the server binds (the kubelet's
    gRPC probe, or under TLS `python -m shared.health_check` on localhost); liveness too,
    or (the frontend, whose health follows the engines) whether that port accepts."""
    service = {ENGINE: "engine.v1.EngineCoreService", FRONTEND: "frontend.v1.GenerationService"}
    for _, manifests in _overlays(rendered):
        container = _main_container(find(manifests, "Deployment", name))
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert int(_flag(container, "--port")) == ports["grpc"]
        assert int(_flag(container, "--metrics-port")) == ports["metrics"]
        assert _probed(container["startupProbe"])[0] == ports["grpc"]
        assert _probed(container["readinessProbe"]) == (ports["grpc"], service[name])
        liveness = container["livenessProbe"]
        if name == FRONTEND and "tcpSocket" in liveness:
            assert liveness["tcpSocket"]["port"] == ports["grpc"]
        else:
            assert _probed(liveness)[0] == ports["grpc"], liveness


def _probed(probe: Manifest) -> tuple[int, str]:
    """The port and the health service a probe asks about."""
    if "grpc" in probe:
        return probe["grpc"]["port"], probe["grpc"].get("service", "")
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "shared.health_check"], command
    options = dict(arg.partition("=")[::2] for arg in command[3:])
    host, _, port = options["--address"].rpartition(":")
    assert host == "localhost", options  # the name the pod's certificate carries
    return int(port), options.get("--service", "")


def _probe_window_s(probe: Manifest) -> int:
    window: int = probe["periodSeconds"] * probe["failureThreshold"]
    return window


def test_startup_probes_outlast_the_servers_own_timeouts(
    rendered: dict[str, list[Manifest]],
) -> None:
    """Each server gives up on starting by itself (and logs why) before the kubelet would."""
    engine_timeout_s = ServiceOptions(model_name="any").startup_timeout_s
    for _, manifests in _overlays(rendered):
        engine = find(manifests, "Deployment", ENGINE)
        assert _probe_window_s(_main_container(engine)["startupProbe"]) > engine_timeout_s
        frontend = find(manifests, "Deployment", FRONTEND)
        frontend_timeout_s = float(_resolved_flag(manifests, frontend, "--startup-timeout"))
        assert _probe_window_s(_main_container(frontend)["startupProbe"]) > frontend_timeout_s


@pytest.mark.parametrize(
    ("name", "drain_flag"), [(ENGINE, "--shutdown-timeout"), (FRONTEND, "--shutdown-grace")]
)
def test_grace_period_outlasts_the_drain(
    name: str, drain_flag: str, rendered: dict[str, list[Manifest]]
) -> None:
    """SIGKILL never cuts a drain short: the grace period covers preStop and the drain."""
    for overlay, manifests in _overlays(rendered):
        deployment = find(manifests, "Deployment", name)
        drain_s = float(_resolved_flag(manifests, deployment, drain_flag))
        sleep_s = _pre_stop_sleep_s(_main_container(deployment))
        grace_s = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert drain_s > 0 and sleep_s > 0, overlay
        assert grace_s >= sleep_s + drain_s + EXIT_MARGIN_S, (overlay, grace_s)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_arg_variables_are_defined(overlay: str, rendered: dict[str, list[Manifest]]) -> None:
    """An undefined $(VAR) would reach the program as the literal text `$(VAR)`."""
    manifests = rendered[overlay]
    for deployment in of_kind(manifests, "Deployment"):
        container = _main_container(deployment)
        defined = set(_config(manifests, deployment)) | {e["name"] for e in container["env"]}
        used = {name for arg in container["args"] for name in _VARIABLE.findall(arg)}
        assert used <= defined, used - defined


def test_servers_bind_every_interface(rendered: dict[str, list[Manifest]]) -> None:
    for _, manifests in _overlays(rendered):
        for name in (ENGINE, FRONTEND):
            deployment = find(manifests, "Deployment", name)
            assert _resolved_flag(manifests, deployment, "--host") == "0.0.0.0", name


def _cli_flags(module: str) -> set[str]:
    result = run([sys.executable, "-m", module, "--help"], 120)
    assert result.returncode == 0, result.stderr
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", result.stdout))


@pytest.mark.parametrize(("name", "module"), [(ENGINE, "engine_svc"), (FRONTEND, "frontend_svc")])
def test_flags_exist_in_the_cli(
    name: str, module: str, rendered: dict[str, list[Manifest]]
) -> None:
    if not (REPO_ROOT / module / "__main__.py").is_file():
        pytest.skip(f"{module} has no command line yet")
    flags = set()
    for _, manifests in _overlays(rendered):
        container = _main_container(find(manifests, "Deployment", name))
        flags |= {arg.partition("=")[0] for arg in container["args"]}
    assert flags <= _cli_flags(module), flags - _cli_flags(module)


def test_fetched_model_is_served_read_only(rendered: dict[str, list[Manifest]]) -> None:
    for _, manifests in _overlays(rendered):
        engine = find(manifests, "Deployment", ENGINE)
        fetch = pod_spec(engine)["initContainers"][0]
        assert fetch["command"] == ["python", "-m", "shared.model_store"]
        cache = {e["name"]: e["value"] for e in fetch["env"]}["DUOSERVE_CACHE"]
        mounts = {m["mountPath"]: m for m in _main_container(engine)["volumeMounts"]}
        assert mounts[cache].get("readOnly") is True
        model_dir = _resolved_flag(manifests, engine, "--model")
        assert model_dir.startswith(f"{cache}/models/"), model_dir


def test_frontend_resolves_the_engine_headless_service(
    rendered: dict[str, list[Manifest]],
) -> None:
    for _, manifests in _overlays(rendered):
        service = find(manifests, "Service", ENGINE)
        assert service["spec"]["clusterIP"] == "None"
        assert not service["spec"].get("publishNotReadyAddresses", False)
        assert _selects(service["spec"]["selector"], find(manifests, "Deployment", ENGINE))
        grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
        frontend = find(manifests, "Deployment", FRONTEND)
        address = _resolved_flag(manifests, frontend, "--engine")
        assert address == f"{service['metadata']['name']}:{grpc_port}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_select(overlay: str, rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered[overlay]
    deployments = list(of_kind(manifests, "Deployment"))
    for service in of_kind(manifests, "Service"):
        [target] = [d for d in deployments if _selects(service["spec"]["selector"], d)]
        port_names = {p["name"] for p in _main_container(target)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        selected = set()
        for manifest in of_kind(manifests, kind):
            selector = manifest["spec"].get("selector") or manifest["spec"]["podSelector"]
            matched = [d for d in deployments if _selects(selector["matchLabels"], d)]
            assert len(matched) == 1, manifest["metadata"]["name"]
            selected.add(matched[0]["metadata"]["name"])
        assert selected == {ENGINE, FRONTEND}, kind
    monitor = next(of_kind(manifests, "ServiceMonitor"))
    monitored = [
        s
        for s in of_kind(manifests, "Service")
        if all(
            s["metadata"]["labels"].get(k) == v
            for k, v in monitor["spec"]["selector"]["matchLabels"].items()
        )
    ]
    assert {s["metadata"]["name"] for s in monitored} == {ENGINE, FRONTEND}
    for service in monitored:
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}


def test_only_the_frontend_reaches_the_engine(rendered: dict[str, list[Manifest]]) -> None:
    for _, manifests in _overlays(rendered):
        policy = find(manifests, "NetworkPolicy", ENGINE)
        assert "Ingress" in policy["spec"]["policyTypes"]
        frontend_labels = find(manifests, "Deployment", FRONTEND)["spec"]["template"]["metadata"]
        grpc_rules = [
            rule
            for rule in policy["spec"]["ingress"]
            if any(port["port"] in ("grpc", 50061) for port in rule["ports"])
        ]
        assert grpc_rules
        for rule in grpc_rules:
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, peer  # this namespace's pods only
                selector = peer["podSelector"]["matchLabels"]
                assert all(frontend_labels["labels"].get(k) == v for k, v in selector.items())
                assert selector.get("app.kubernetes.io/component") == "frontend"


def test_frontend_scales_out(rendered: dict[str, list[Manifest]]) -> None:
    for _, manifests in _overlays(rendered):
        frontend = find(manifests, "Deployment", FRONTEND)
        autoscaler = find(manifests, "HorizontalPodAutoscaler", FRONTEND)
        assert autoscaler["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": frontend["metadata"]["name"],
        }
        assert frontend["spec"]["replicas"] >= 2
        assert 2 <= autoscaler["spec"]["minReplicas"] < autoscaler["spec"]["maxReplicas"]


def test_gpu_only_in_the_gpu_overlay(rendered: dict[str, list[Manifest]]) -> None:
    def gpus(overlay: str, name: str) -> object:
        container = _main_container(find(rendered[overlay], "Deployment", name))
        return container["resources"]["limits"].get("nvidia.com/gpu")

    assert gpus("gpu", ENGINE) == 1
    assert gpus("cpu", ENGINE) is None
    assert gpus("gpu", FRONTEND) is None and gpus("cpu", FRONTEND) is None
    gpu_engine = find(rendered["gpu"], "Deployment", ENGINE)
    assert _resolved_flag(rendered["gpu"], gpu_engine, "--device") == "cuda"
    cpu_engine = find(rendered["cpu"], "Deployment", ENGINE)
    assert _resolved_flag(rendered["cpu"], cpu_engine, "--device") == "cpu"


def test_overlays_change_only_the_engine(rendered: dict[str, list[Manifest]]) -> None:
    """Everything but the engine's Deployment and flags is the base's, in both overlays."""

    def shared(manifests: list[Manifest]) -> list[Manifest]:
        return [
            m
            for m in manifests
            if not (
                m["kind"] in ("Deployment", "ConfigMap")
                and m["metadata"]["name"].startswith(ENGINE)
            )
        ]

    assert shared(rendered["cpu"]) == shared(rendered["gpu"])


def test_secure_overlay_mounts_every_file_its_flags_name(
    rendered: dict[str, list[Manifest]],
) -> None:
    """Each file a flag or a probe of cpu-secure names is a key of a Secret mounted there:
    a cert-manager Certificate's (tls.crt, tls.key, ca.crt) or duoserve-auth's items."""
    manifests = rendered["cpu-secure"]
    issued = {c["spec"]["secretName"] for c in of_kind(manifests, "Certificate")}
    for name in (ENGINE, FRONTEND):
        deployment = find(manifests, "Deployment", name)
        container = _main_container(deployment)
        volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
        files: dict[str, set[str]] = {}
        for mount in container["volumeMounts"]:
            secret = volumes[mount["name"]].get("secret")
            if secret is None:
                continue
            if "items" in secret:
                keys = {item["path"] for item in secret["items"]}
            else:
                assert secret["secretName"] in issued, secret
                keys = {"tls.crt", "tls.key", "ca.crt"}
            files[mount["mountPath"]] = keys
        probes = [container[p]["exec"]["command"] for p in ("startupProbe", "readinessProbe")]
        named = [
            arg.partition("=")[2]
            for arg in [*container["args"], *(a for command in probes for a in command)]
            if arg.partition("=")[2].startswith("/etc/duoserve/")
        ]
        assert len(named) >= 5, named
        for path in named:
            folder, _, file = path.rpartition("/")
            assert file in files.get(folder, set()), (name, path, files)


def test_certificates_carry_the_names_clients_check(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["cpu-secure"]
    certificates = {c["metadata"]["name"]: c["spec"] for c in of_kind(manifests, "Certificate")}
    issuers = {i["metadata"]["name"]: i["spec"] for i in of_kind(manifests, "Issuer")}
    frontend = find(manifests, "Deployment", FRONTEND)
    engine_name = _flag(_main_container(frontend), "--engine-tls-server-name")
    assert engine_name in certificates["duoserve-engine-tls"]["dnsNames"]
    for name in (ENGINE, FRONTEND):
        spec = certificates[f"{name}-tls"]
        assert {"localhost", name, f"{name}.duoserve.svc"} <= set(spec["dnsNames"])  # probes
        assert {"server auth", "client auth"} <= set(spec["usages"])
        ca_issuer = issuers[spec["issuerRef"]["name"]]
        root = next(
            c for c in certificates.values() if c["secretName"] == ca_issuer["ca"]["secretName"]
        )
        assert root["isCA"] is True and "selfSigned" in issuers[root["issuerRef"]["name"]]
