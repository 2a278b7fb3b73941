"""k8s/overlays/multinode: one engine across machines, as a LeaderWorkerSet of a leader pod
(node 0: the service, its probes, the first ranks) and worker pods (the other ranks).

Its LeaderWorkerSet matches a strict schema; its pod templates, as Pods, go through
kubernetes-validate --strict and checkov with the other overlays (test_manifests.py); the
contract a group needs holds (one command for every pod, every variable defined, the
frontends reach leaders only, the ranks reach each other and nothing else reaches a worker);
and the pods' command lines, with the variables the LeaderWorkerSet controller sets, run here
on 127.0.0.1 as two nodes of one engine whose greedy tokens are Hugging Face's."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from engine_svc.config import EngineConfig
from engine_svc.executor.worker_spawn import executor_ports
from tests.engine_svc.hf_reference import hf_greedy, load_hf_model
from tests.k8s.leaderworkerset_schema import LEADER_WORKER_SET_SCHEMA
from tests.k8s.manifests import (
    LWS_VARIABLES,
    Manifest,
    assert_locked_down,
    find,
    group_pods,
    of_kind,
    run,
)
from tests.k8s.pod_runs import EXIT_SLACK_S, command_of, environment_of, running, wait_serving
from tests.service_processes import (
    engine_stub,
    free_port,
    generate_request,
    run_async,
    three_free_ports,
)

ENGINE = "duoserve-engine"
GROUP = "duoserve-engine-group"
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_MULTINODE_FLAGS = {
    "--nnodes": "$(LWS_GROUP_SIZE)",
    "--node-rank": "$(LWS_WORKER_INDEX)",
    "--master-addr": "$(LWS_LEADER_ADDRESS)",
}


def _group(multinode: list[Manifest]) -> Manifest:
    return find(multinode, "LeaderWorkerSet", GROUP)


def _container(pod: Manifest) -> Manifest:
    container: Manifest = pod["spec"]["containers"][0]
    return container


def _flags(container: Manifest) -> dict[str, str]:
    return dict(arg.partition("=")[::2] for arg in container["args"])


def _selects(selector: Manifest, pod: Manifest) -> bool:
    """A label selector (matchLabels, matchExpressions with In) against a pod's labels."""
    labels = pod["metadata"]["labels"]
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_the_engine_runs_as_a_leader_worker_set(multinode: list[Manifest]) -> None:
    group = _group(multinode)
    jsonschema.validate(group, LEADER_WORKER_SET_SCHEMA)
    template = group["spec"]["leaderWorkerTemplate"]
    with pytest.raises(jsonschema.ValidationError):  # a misspelt field
        jsonschema.validate(
            {**group, "spec": {**group["spec"], "leaderWorkerTemplate": {**template, "sise": 2}}},
            LEADER_WORKER_SET_SCHEMA,
        )
    assert template["size"] >= 2
    # A rank lost is the engine lost: the whole group restarts together.
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    deployments = {d["metadata"]["name"] for d in of_kind(multinode, "Deployment")}
    assert deployments == {"duoserve-frontend"}, deployments
    assert group["metadata"]["namespace"] == "duoserve"


def test_group_pods_are_locked_down(multinode: list[Manifest]) -> None:
    for pod in group_pods(_group(multinode)).values():
        assert_locked_down(pod["spec"])


def test_every_pod_runs_the_same_command_and_its_variables_are_defined(
    multinode: list[Manifest],
) -> None:
    """Node 0 and the others take the same flags (the model's shape, the layout, the
    rendezvous): only LWS_WORKER_INDEX tells them apart. Each $(VAR) resolves from the
    ConfigMap (its hashed name reached the templates), the container's env or the
    variables the LeaderWorkerSet controller sets."""
    pods = group_pods(_group(multinode))
    leader, worker = _container(pods["leader"]), _container(pods["worker"])
    assert leader["args"] == worker["args"]
    assert leader["image"] == worker["image"] and leader["image"].endswith("-cuda")
    flags = _flags(leader)
    assert {flag: flags.get(flag) for flag in _MULTINODE_FLAGS} == _MULTINODE_FLAGS
    config_maps = {m["metadata"]["name"] for m in of_kind(multinode, "ConfigMap")}
    for container in (leader, worker):
        for source in container["envFrom"]:
            assert source["configMapRef"]["name"] in config_maps, source
        defined = set(environment_of(multinode, container)) | set(LWS_VARIABLES)
        used = {name for arg in container["args"] for name in _VARIABLE.findall(arg)}
        assert used <= defined, used - defined
    help_text = run([sys.executable, "-m", "engine_svc", "--help"], 120).stdout
    assert set(flags) <= set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))
    _group_config(multinode)  # the layout spreads evenly over the pods


def _group_config(multinode: list[Manifest]) -> EngineConfig:
    """The engine options the leader's flags give, LWS_GROUP_SIZE being the group's size
    (EngineConfig refuses a layout the pods do not share evenly)."""
    leader = _container(group_pods(_group(multinode))["leader"])
    environment = environment_of(multinode, leader)
    flags = _flags(leader)
    return EngineConfig(
        model="unused",
        tensor_parallel_size=int(environment["TENSOR_PARALLEL_SIZE"]),
        pipeline_parallel_size=int(environment["PIPELINE_PARALLEL_SIZE"]),
        nnodes=_group(multinode)["spec"]["leaderWorkerTemplate"]["size"],
        master_addr=f"{GROUP}-0.{GROUP}.duoserve",
        master_port=int(flags["--master-port"]),
    )


def test_frontends_reach_the_leaders_and_the_leader_listens_for_its_workers(
    multinode: list[Manifest],
) -> None:
    pods = group_pods(_group(multinode))
    service = find(multinode, "Service", ENGINE)
    assert _selects({"matchLabels": service["spec"]["selector"]}, pods["leader"])
    assert not _selects({"matchLabels": service["spec"]["selector"]}, pods["worker"])
    leader = _container(pods["leader"])
    ports = {port["name"]: port["containerPort"] for port in leader["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    config = _group_config(multinode)
    calls, replies = executor_ports(config)
    assert (ports["rendezvous"], ports["calls"], ports["replies"]) == (
        config.master_port, calls, replies,
    )  # fmt: skip
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe]["grpc"]["port"] == ports["grpc"], probe
    worker = _container(pods["worker"])
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(worker)
    # One budget over leaders and workers: evicting any pod restarts its whole group.
    budget = find(multinode, "PodDisruptionBudget", ENGINE)
    assert _selects(budget["spec"]["selector"], pods["leader"])
    assert _selects(budget["spec"]["selector"], pods["worker"])
    assert budget["spec"]["maxUnavailable"] == 1
    budgets = list(of_kind(multinode, "PodDisruptionBudget"))
    for pod in pods.values():  # the eviction API refuses a pod under two budgets
        assert sum(_selects(b["spec"]["selector"], pod) for b in budgets) == 1
        # Each role spreads over the nodes among its own kind.
        [spread] = pod["spec"]["topologySpreadConstraints"]
        assert _selects(spread["labelSelector"], pod)
        assert not _selects(spread["labelSelector"], pods["worker" if pod is pods["leader"]
                                                              else "leader"])  # fmt: skip
        # NCCL's shared memory: /dev/shm in memory, beyond the runtime's 64 MiB.
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        [shm] = [m for m in _container(pod)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


def test_the_ranks_reach_each_other_and_nothing_else_reaches_a_worker(
    multinode: list[Manifest],
) -> None:
    pods = group_pods(_group(multinode))
    frontend = {"metadata": {"labels": find(multinode, "Deployment", "duoserve-frontend")[
        "spec"]["template"]["metadata"]["labels"]}}  # fmt: skip

    def admitted(peer: Manifest, target: Manifest) -> bool:
        """Whether some policy selecting `target` admits `peer`'s TCP on every port."""
        for policy in of_kind(multinode, "NetworkPolicy"):
            if not _selects(policy["spec"]["podSelector"], target):
                continue
            for rule in policy["spec"]["ingress"]:
                all_ports = all(set(port) == {"protocol"} for port in rule["ports"])
                sources = [s["podSelector"] for s in rule.get("from", []) if "podSelector" in s]
                if all_ports and any(_selects(s, peer) for s in sources):
                    return True
        return False

    leader, worker = pods["leader"], pods["worker"]
    assert admitted(worker, leader) and admitted(leader, worker) and admitted(worker, worker)
    assert not admitted(frontend, worker) and not admitted(frontend, leader)
    worker_policies = [
        p for p in of_kind(multinode, "NetworkPolicy") if _selects(p["spec"]["podSelector"], worker)
    ]
    assert len(worker_policies) == 1 and worker_policies[0]["spec"]["policyTypes"] == ["Ingress"]
    for rule in worker_policies[0]["spec"]["ingress"]:
        assert all(set(source) == {"podSelector"} for source in rule["from"]), rule


def _group_command(
    multinode: list[Manifest], role: str, model_dir: Path, ports: dict[str, int], tmp: Path
) -> tuple[list[str], dict[str, str]]:
    """A group pod's command line as its container runs it, with the variables the
    LeaderWorkerSet controller sets (the leader at 127.0.0.1), on this machine's ports, the
    tiny model, the CPU, and a KV cache of 256 blocks."""
    pod = group_pods(_group(multinode))[role]
    injected = {
        "LWS_LEADER_ADDRESS": "127.0.0.1",
        "LWS_GROUP_SIZE": str(_group(multinode)["spec"]["leaderWorkerTemplate"]["size"]),
        "LWS_WORKER_INDEX": "0" if role == "leader" else "1",
    }
    overrides = {
        "--host": "127.0.0.1",
        "--port": str(ports["grpc"]),
        "--metrics-port": str(ports["metrics"]),
        "--master-port": str(ports["rendezvous"]),
        "--model": str(model_dir),
        "--device": "cpu",
        "--dtype": "float32",
    }
    args, environment = command_of(multinode, _container(pod), overrides, injected)
    environment["HOME"] = str(tmp)
    return [*args, "--num-kv-blocks=256"], environment


def test_group_command_lines_serve_as_two_nodes(
    multinode: list[Manifest], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The leader's and a worker's command lines, LWS_* as the controller sets them: the
    leader becomes SERVING on its probe's service once the worker's ranks joined, greedy
    tokens are Hugging Face's, and on SIGTERM the leader drains and exits 0, and so does the
    worker (node 0 shut its ranks down)."""
    ports = {"grpc": free_port(), "metrics": free_port(), "rendezvous": three_free_ports()}
    prompts = [[3 + (11 * i + 5 * j) % 4000 for j in range(5 + 7 * i)] for i in range(4)]
    logs = {role: tmp_path / f"{role}.log" for role in ("leader", "worker")}
    commands = {
        role: _group_command(multinode, role, tiny_model_dir, ports, tmp_path) for role in logs
    }
    with (
        running("engine_svc", *commands["worker"], logs["worker"]) as worker,
        running("engine_svc", *commands["leader"], logs["leader"]) as leader,
    ):
        probe = _container(group_pods(_group(multinode))["leader"])["readinessProbe"]["grpc"]
        address = f"127.0.0.1:{ports['grpc']}"
        wait_serving(address, probe["service"], leader, logs["leader"])
        tokens = _generate(address, prompts, 8)
        leader.send_signal(signal.SIGTERM)
        grace_s = float(commands["leader"][1]["SHUTDOWN_TIMEOUT_S"]) + EXIT_SLACK_S
        assert leader.wait(timeout=grace_s) == 0, logs["leader"].read_text()[-3000:]
        assert worker.wait(timeout=60) == 0, logs["worker"].read_text()[-3000:]
    assert tokens == hf_greedy(load_hf_model(tiny_model_dir), prompts, [8] * len(prompts))


def _generate(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def body() -> list[list[int]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_stub(channel)

            async def one(i: int, prompt: list[int]) -> list[int]:
                request = generate_request(f"group-{i}", prompt, max_tokens, ignore_eos=True)
                return [t async for r in stub.Generate(request) for t in r.token_ids]

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    result: Any = run_async(body, timeout_s=300)
    return list(result)
