"""EngineConfig refuses every bad option at construction, naming it, the way `LLM(...)` and
the service's flags report it (`--scheduling-policy: ...`)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from engine_svc.config import EngineConfig
from shared.errors import InvalidRequestError

BAD_OPTIONS: list[tuple[dict[str, Any], str]] = [
    ({"block_size": 12}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"max_concurrent_batches": 0}, "max_concurrent_batches"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"grammar_cache_bytes": -1}, "grammar_cache_bytes"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
    ({"master_port": 70000}, "master_port"),
    ({"nnodes": 0}, "nnodes"),
    ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2, "master_port": 29500}, "node_rank"),
    ({"nnodes": 2, "tensor_parallel_size": 3, "master_port": 29500}, "nnodes"),
    ({"nnodes": 2, "tensor_parallel_size": 2}, "master_port"),
    ({"nnodes": 2, "tensor_parallel_size": 2, "master_port": 65534}, "master_port"),
]


@pytest.mark.parametrize(("options", "field"), BAD_OPTIONS)
def test_a_bad_option_is_refused_by_name(options: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        EngineConfig(model="unused", **options)
    assert refused.value.field == field


def test_the_ranks_spread_evenly_over_the_nodes() -> None:
    config = EngineConfig(
        model="unused", tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
        master_port=29500,
    )  # fmt: skip
    assert config.world_size == 4
    assert [list(config.node_ranks(node)) for node in (0, 1)] == [[0, 1], [2, 3]]


def test_a_cpu_worker_s_budget_is_its_share_of_the_configured_or_default_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine_svc.core.kv_cache import sizing

    GiB = sizing.GiB
    assert sizing.cpu_budget_bytes(8 * GiB, 2) == 4 * GiB
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 8 * GiB // 4096}  # an 8 GiB machine
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert sizing.cpu_budget_bytes(None, 1) == 2 * GiB  # a quarter of it, under 4 GiB
    assert sizing.cpu_budget_bytes(None, 4) == GiB // 2
    pages["SC_PHYS_PAGES"] = 64 * GiB // 4096
    assert sizing.cpu_budget_bytes(None, 2) == 2 * GiB  # 4 GiB at most, shared
    # What a worker is told before the KV cache is sized: nothing when num_kv_blocks sizes it.
    ranks = EngineConfig(model="unused", kv_cache_memory_bytes=8 * GiB, tensor_parallel_size=2)
    assert sizing.cpu_worker_budget_bytes(ranks) == 4 * GiB
    assert sizing.cpu_worker_budget_bytes(EngineConfig(model="unused", num_kv_blocks=64)) is None


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/nonexistent/dir", "--model: no such file or directory: /nonexistent/dir"),
        ("/nonexistent/model.gguf", "--model: no such file or directory: /nonexistent/model.gguf"),
        ("/", "--model: / has no config.json: not a Hugging Face model dir"),
    ],
)
def test_a_model_that_is_not_there_is_a_usage_error_naming_the_flag(
    model: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine_svc.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--model", model])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
