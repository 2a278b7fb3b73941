"""`make soak` (python -m tests.soak): both services under steady mixed load for a while.

SOAK_MINUTES (default 10) of SOAK_CONCURRENCY (default 16) clients, each sending one request
after another through the frontend: mixed prompt and output lengths, streams cancelled at a
random point, stop strings, structured output (a JSON schema, a choice, a regex), n = 2, chat
messages, bad words, allowed token ids. It prints requests done, unexpected errors, the
resident memory of each service (its processes together) at the start, every minute, after
the warm-up (the first third of the run: the allocators reach their working size over the
first thousand or so requests) and at the end, and the engine's KV blocks still in use once
idle. It fails (exit 1) on any unexpected error, a leaked block, or memory growing more than
5% after warm-up. SOAK_MODEL: another model directory (default: the default model). Not part
of `make test`: it runs for minutes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from shared.model_store import ensure_default_model
from shared.protos import engine_pb2 as epb
from shared.protos import engine_pb2_grpc
from tests.service_processes import (
    FrontendProcess,
    ServiceProcess,
    tree_rss_bytes,
    wait_all_serving,
)

WARM_UP_FRACTION = 1 / 3
MAX_MEMORY_GROWTH = 0.05
# What a client may see besides a full answer: its own cancellation.
EXPECTED_CODES = {grpc.StatusCode.CANCELLED}

WORDS = ("river", "mountain", "engine", "signal", "garden", "silver", "quiet", "number",
         "window", "paper", "orange", "winter", "letter", "forest", "copper", "voice")  # fmt: skip
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
)


@dataclasses.dataclass
class Tally:
    done: int = 0
    cancelled: int = 0  # by the client, on purpose
    tokens: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)


def _request(rng: random.Random, index: int) -> tuple[str, fpb.GenerateRequest]:
    kind = rng.choice(
        ["plain", "plain", "stop", "json", "choice", "regex", "n2", "chat", "bad_words", "allowed"]
    )
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 200)))
    params = fpb.SamplingParams(max_tokens=rng.randint(4, 96), temperature=rng.choice([0.0, 0.8]))
    params.seed = index
    request = fpb.GenerateRequest(request_id=f"soak-{index}", prompt=f"Write about {words}.")
    if kind == "stop":
        params.stop.extend(["\n", "."])
    elif kind == "json":
        params.json_schema = SCHEMA
    elif kind == "choice":
        params.choice.choices.extend(["yes", "no", "maybe"])
    elif kind == "regex":
        params.regex = "[0-9]{1,4}-[a-z]{2,6}"
    elif kind == "n2":
        params.n = 2
    elif kind == "bad_words":
        params.bad_words.extend(rng.sample(WORDS, 3))
    elif kind == "allowed":
        params.allowed_token_ids.extend(rng.sample(range(1000), 100))  # in any vocabulary
    elif kind == "chat":
        request.ClearField("prompt")
        request.messages.add(role="user", content=f"Tell me about {words[:200]}.")
    request.sampling_params.CopyFrom(params)
    return kind, request


async def _client(
    stub: frontend_pb2_grpc.GenerationServiceStub, seed: int, stop_at: float, tally: Tally
) -> None:
    rng = random.Random(seed)
    index = seed * 1_000_000
    while time.monotonic() < stop_at:
        index += 1
        kind, request = _request(rng, index)
        tally.kinds[kind] = tally.kinds.get(kind, 0) + 1
        cancel_after = rng.randint(1, 8) if rng.random() < 0.15 else -1
        call = stub.GenerateStream(request, timeout=600)
        received = 0
        try:
            async for response in call:
                tally.tokens += sum(len(c.token_ids) for c in response.choices)
                received += 1
                if received == cancel_after:
                    call.cancel()
                    break
            if received == cancel_after:
                tally.cancelled += 1
            else:
                tally.done += 1
        except grpc.aio.AioRpcError as error:
            if error.code() in EXPECTED_CODES and cancel_after > 0:
                tally.cancelled += 1
            else:
                tally.errors.append(
                    f"{kind} {request.request_id}: {error.code().name} {error.details()}"
                )


def _kv_blocks_in_use(engine: ServiceProcess) -> tuple[int, int]:
    """Requests still in the engine, and KV blocks not free (cached prefixes count as free:
    any request may take them)."""
    with engine.channel() as channel:
        stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
        loads = stub.GetLoads(epb.GetLoadsRequest(), timeout=10).loads
        per_rank = stub.GetModelInfo(epb.GetModelInfoRequest(), timeout=10).num_kv_blocks
    running = sum(load.num_running + load.num_waiting for load in loads)
    return running, sum(per_rank - load.num_free_kv_blocks for load in loads)


def _memory(services: dict[str, ServiceProcess]) -> dict[str, int]:
    """Each service's resident memory, its engine-core processes included."""
    return {name: tree_rss_bytes(service.process.pid) for name, service in services.items()}


def _mib(value: int) -> str:
    return f"{value / (1 << 20):.1f} MiB"


async def _soak(
    frontend: FrontendProcess, engine: ServiceProcess, minutes: float, concurrency: int
) -> int:
    tally = Tally()
    services: dict[str, ServiceProcess] = {"frontend": frontend, "engine": engine}
    at_start = _memory(services)
    print(f"at start: frontend {_mib(at_start['frontend'])}, engine {_mib(at_start['engine'])}",
          flush=True)  # fmt: skip
    start = time.monotonic()
    stop_at = start + minutes * 60
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = frontend_pb2_grpc.GenerationServiceStub(channel)
        clients = [
            asyncio.create_task(_client(stub, seed, stop_at, tally)) for seed in range(concurrency)
        ]
        await asyncio.sleep(minutes * 60 * WARM_UP_FRACTION)
        warm = _memory(services)
        print(f"after warm-up: {tally.done} requests done; frontend {_mib(warm['frontend'])}, "
              f"engine {_mib(warm['engine'])}", flush=True)  # fmt: skip
        last_report = time.monotonic()
        while not all(client.done() for client in clients):
            await asyncio.sleep(1)
            if time.monotonic() - last_report >= 60:
                last_report = time.monotonic()
                elapsed = (last_report - start) / 60
                rss = ", ".join(
                    f"{name} {_mib(tree_rss_bytes(service.process.pid))}"
                    for name, service in services.items()
                )
                print(f"{elapsed:.0f} min: {tally.done} done, {tally.cancelled} cancelled, "
                      f"{len(tally.errors)} errors, {tally.tokens} tokens; memory: {rss}",
                      flush=True)  # fmt: skip
        await asyncio.gather(*clients)
    engine.wait_idle(timeout_s=120)
    running, blocks_in_use = _kv_blocks_in_use(engine)
    end = _memory(services)
    elapsed_s = time.monotonic() - start
    print(f"\n{minutes:g} min, {concurrency} clients: {tally.done} requests done, "
          f"{tally.cancelled} cancelled on purpose, {tally.tokens} tokens streamed "
          f"({tally.tokens / elapsed_s:.0f}/s)")  # fmt: skip
    print(f"by kind: {dict(sorted(tally.kinds.items()))}")
    print(f"errors: {len(tally.errors)}")
    for error in tally.errors[:20]:
        print(f"  {error}")
    failed = bool(tally.errors)
    for name in ("frontend", "engine"):
        growth = end[name] / warm[name] - 1
        print(f"{name} resident memory: {_mib(at_start[name])} at start, "
              f"{_mib(warm[name])} after warm-up, {_mib(end[name])} at the end "
              f"({growth:+.1%} after warm-up)")  # fmt: skip
        failed |= growth > MAX_MEMORY_GROWTH
    print(f"engine once idle: {running} requests, {blocks_in_use} leaked KV blocks")
    failed |= running != 0 or blocks_in_use != 0
    print("SOAK FAILED" if failed else "soak passed")
    return 1 if failed else 0


def main() -> int:
    minutes = float(os.environ.get("SOAK_MINUTES", "10"))
    concurrency = int(os.environ.get("SOAK_CONCURRENCY", "16"))
    model_dir = Path(os.environ.get("SOAK_MODEL", "") or ensure_default_model())
    with tempfile.TemporaryDirectory(prefix="duoserve-soak-") as folder:
        logs = Path(folder)
        # 768 blocks of 16 tokens: a default-model request of max_model_len (8192) fits.
        engine = ServiceProcess(model_dir, logs / "engine.log", "--num-kv-blocks", "768")
        frontend = FrontendProcess([engine.address], logs / "frontend.log")
        try:
            wait_all_serving([engine, frontend])
            print(f"soak: {model_dir.name}, {minutes:g} min, {concurrency} clients; engine "
                  f"{engine.address}, frontend {frontend.address}", flush=True)  # fmt: skip
            return asyncio.run(_soak(frontend, engine, minutes, concurrency))
        finally:
            frontend.stop()
            engine.stop()


if __name__ == "__main__":
    sys.exit(main())
