"""Bearer-token authentication on both services, as subprocesses with the tiny model: the
engine requires a token, and the frontend sends one (its tokenizer fetch and load polls
included); the frontend requires its own, re-read when the file is rewritten. Calls
without a valid token get UNAUTHENTICATED and are counted in the metrics; health and
reflection stay open to probes and grpcurl."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from frontend_svc.engines.router import SUSPEND_AFTER_FAILURE_S
from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from shared.protos import engine_pb2 as epb
from shared.protos import engine_pb2_grpc
from tests.frontend_svc.frontend_helpers import greedy
from tests.interop.test_grpcurl import grpcurl
from tests.service_processes import (
    NOT_SERVING,
    REPO_ROOT,
    SERVING,
    FrontendProcess,
    ServiceProcess,
    run_async,
    wait_all_serving,
)


class Secured:
    def __init__(self, engine: ServiceProcess, frontend: FrontendProcess, folder: Path):
        self.engine = engine
        self.frontend = frontend
        self.frontend_tokens = folder / "frontend-tokens"  # what the frontend accepts
        self.engine_tokens = folder / "engine-tokens"  # what the engine accepts
        self.engine_token = folder / "frontend-to-engine"  # what the frontend sends it


@pytest.fixture(scope="module")
def secured(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    folder = tmp_path_factory.mktemp("bearer-auth")
    (folder / "engine-tokens").write_text("engine-old\nengine-token\n")
    (folder / "frontend-to-engine").write_text("engine-token\n")
    (folder / "frontend-tokens").write_text("alpha\n")
    engine = ServiceProcess(
        tiny_model_dir, folder / "engine.log", "--auth-token-file", str(folder / "engine-tokens")
    )
    frontend = FrontendProcess(
        [engine.address], folder / "frontend.log",
        "--auth-token-file", str(folder / "frontend-tokens"),
        "--engine-auth-token-file", str(folder / "frontend-to-engine"),
    )  # fmt: skip
    wait_all_serving([engine, frontend])  # SERVING needs the tokenizer, fetched with a token
    yield Secured(engine, frontend, folder)
    frontend.stop()
    engine.stop()


def _generate(address: str, token: str | None) -> grpc.StatusCode:
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    request = fpb.GenerateRequest(prompt="Hello", sampling_params=greedy(4))
    with grpc.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.GenerationServiceStub(channel)
        try:
            stub.Generate(request, timeout=60, metadata=metadata)
            list(stub.GenerateStream(request, timeout=60, metadata=metadata))
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def _refused(service: ServiceProcess) -> float:
    return service.metric_total("grpc_server_handled_total", grpc_code="Unauthenticated")


def test_the_frontend_serves_a_valid_token_only(secured: Secured) -> None:
    address = secured.frontend.address
    refused_before = _refused(secured.frontend)
    assert _generate(address, "alpha") == grpc.StatusCode.OK  # and the engine took its token
    assert _generate(address, None) == grpc.StatusCode.UNAUTHENTICATED
    assert _generate(address, "alphax") == grpc.StatusCode.UNAUTHENTICATED
    assert _generate(address, "engine-token") == grpc.StatusCode.UNAUTHENTICATED
    refused = secured.frontend.metric_total_reaching(
        "grpc_server_handled_total", refused_before + 3, grpc_code="Unauthenticated"
    )
    assert refused - refused_before == 3


def test_rewriting_the_token_file_rotates_the_tokens(secured: Secured) -> None:
    address = secured.frontend.address
    fresh = secured.frontend_tokens.with_suffix(".new")
    try:
        fresh.write_text("alpha\nbeta\n")  # both valid while clients move over
        fresh.replace(secured.frontend_tokens)
        assert _generate(address, "beta") == grpc.StatusCode.OK
        assert _generate(address, "alpha") == grpc.StatusCode.OK
        fresh.write_text("beta\n")
        fresh.replace(secured.frontend_tokens)
        assert _generate(address, "alpha") == grpc.StatusCode.UNAUTHENTICATED
        assert _generate(address, "beta") == grpc.StatusCode.OK
    finally:
        secured.frontend_tokens.write_text("alpha\n")


def test_the_frontend_follows_a_rotated_engine_token(secured: Secured) -> None:
    """The engine token rotates as the auth component says: the engine accepts the old and
    the new, the frontend's file gets the new one, the engine drops the old. The last call
    goes through only if the frontend re-read its file (it would still send the old one)."""
    address = secured.frontend.address
    try:
        _rewrite(secured.engine_tokens, "engine-token\nengine-new\n")
        _rewrite(secured.engine_token, "engine-new\n")
        assert _generate(address, "alpha") == grpc.StatusCode.OK
        _rewrite(secured.engine_tokens, "engine-new\n")
        assert _generate(address, "alpha") == grpc.StatusCode.OK
    finally:
        _rewrite(secured.engine_tokens, "engine-old\nengine-token\n")
        _rewrite(secured.engine_token, "engine-token\n")


def _rewrite(path: Path, text: str) -> None:
    """As the kubelet updates a mounted Secret: a new file moved into place."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    fresh.replace(path)


def test_an_engine_refusing_the_frontends_token_is_taken_out_until_it_takes_it(
    secured: Secured,
) -> None:
    """A token rotation done in the wrong order: the engine drops the frontend's token.
    Its health (open to all) still says SERVING; the frontend's authenticated load poll
    sees the refusal, says why in its log, and stops serving; clients get UNAVAILABLE,
    never INTERNAL. Once the engine takes the token again, the frontend serves again."""
    address = secured.frontend.address
    refusal = f"engine {secured.engine.address} refuses this frontend's calls"
    try:
        _rewrite(secured.engine_tokens, "engine-rotated-away\n")
        assert _generate(address, "alpha") == grpc.StatusCode.UNAVAILABLE
        deadline = time.monotonic() + 15
        while refusal not in secured.frontend.log_path.read_text():
            assert time.monotonic() < deadline, secured.frontend.log()
            time.sleep(0.1)
        assert secured.frontend.health() == NOT_SERVING
        assert secured.engine.health() == SERVING
        # Out for the refusal, not for the failed call's suspension, which ends by now.
        time.sleep(SUSPEND_AFTER_FAILURE_S + 1.0)
        assert secured.frontend.health() == NOT_SERVING
        assert _generate(address, "alpha") == grpc.StatusCode.UNAVAILABLE
    finally:
        _rewrite(secured.engine_tokens, "engine-old\nengine-token\n")
    assert secured.frontend.wait_health(SERVING) == SERVING
    assert _generate(address, "alpha") == grpc.StatusCode.OK


def test_a_frontend_without_the_engines_token_says_so_and_gives_up_at_its_timeout(
    secured: Secured, tmp_path: Path
) -> None:
    log_path = tmp_path / "frontend.log"
    frontend = FrontendProcess([secured.engine.address], log_path, "--startup-timeout", "3")
    try:
        assert frontend.wait_exit(timeout_s=60) == 1
    finally:
        frontend.stop()
    log = log_path.read_text()
    refusal = f"engine {secured.engine.address} refuses this frontend's calls"
    assert log.count(refusal) == 1 and "UNAUTHENTICATED" in log  # said once, not every poll
    assert "no tokenizer within 3 s" in log


def test_the_engine_refuses_calls_without_its_token(secured: Secured) -> None:
    with grpc.insecure_channel(secured.engine.address) as channel:
        stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetModelInfo(epb.GetModelInfoRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.GetTokenizer(epb.GetTokenizerRequest(), timeout=10))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = (("authorization", "Bearer engine-old"),)  # any line of its file
        info = stub.GetModelInfo(epb.GetModelInfoRequest(), timeout=10, metadata=metadata)
        assert info.max_model_len > 0


def test_a_revoked_token_lets_a_generate_many_call_abort_but_add_nothing(
    secured: Secured,
) -> None:
    """GenerateMany outlives the token it started with. Once the engine no longer accepts
    it, a message that only aborts is still let in (a frontend whose token rotated cancels
    what it sent on the old call), and the next message adding a request ends the call
    UNAUTHENTICATED, as a new call would be."""
    old = (("authorization", "Bearer engine-old"),)
    current = (("authorization", "Bearer engine-token"),)

    def request(request_id: str) -> epb.GenerateManyRequest:
        params = epb.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        one = epb.GenerateRequest(
            request_id=request_id, prompt_token_ids=[1, 2], sampling_params=params
        )
        return epb.GenerateManyRequest(requests=[one])

    async def body() -> tuple[list[tuple[str, int]], grpc.StatusCode]:
        async with grpc.aio.insecure_channel(secured.engine.address) as channel:
            stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
            await stub.PauseGeneration(epb.PauseGenerationRequest(), metadata=current, timeout=10)
            try:
                call = stub.GenerateMany(metadata=old, timeout=60)
                await call.write(request("before"))
                for _ in range(500):  # one step once the engine has it, then paused again
                    step = epb.ResumeGenerationRequest(max_steps=1)
                    resumed = await stub.ResumeGeneration(step, metadata=current, timeout=10)
                    if sum(resumed.steps_run):
                        break
                    await asyncio.sleep(0.01)
                first = await call.read()
                assert [o.request_id for o in first.outputs] == ["before"]
                _rewrite(secured.engine_tokens, "engine-token\n")
                await call.write(epb.GenerateManyRequest(abort_request_ids=["before"]))
                ends = []
                while not ends:
                    response = await call.read()
                    ends = [(o.request_id, o.finish_reason) for o in response.outputs]
                await call.write(request("after"))
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    while await call.read() != grpc.aio.EOF:
                        pass
            finally:
                await stub.ResumeGeneration(
                    epb.ResumeGenerationRequest(), metadata=current, timeout=10
                )
            return ends, ended.value.code()

    try:
        ends, code = run_async(body)
    finally:
        _rewrite(secured.engine_tokens, "engine-old\nengine-token\n")
    assert ends == [("before", epb.FINISH_REASON_ABORT)]
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_need_no_token(secured: Secured) -> None:
    for address in (secured.frontend.address, secured.engine.address):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
    services = grpcurl(secured.frontend.address, "list")
    assert "frontend.v1.GenerationService" in services


def test_the_command_line_client_sends_its_token(secured: Secured, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("alpha\n")

    def client(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "frontend_svc.client", "--address",
                   secured.frontend.address, "Hello", "--max-tokens", "4", *args]  # fmt: skip
        return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)

    with_token = client("--auth-token-file", str(token_file))
    assert with_token.returncode == 0, with_token.stderr
    without = client()
    assert without.returncode == 1 and "UNAUTHENTICATED" in without.stderr
