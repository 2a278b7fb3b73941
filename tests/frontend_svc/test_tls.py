"""TLS on both services, as subprocesses with the tiny model: the engine serves mutual TLS
(only frontends holding a certificate its CA signed), the frontend serves TLS and reaches
the engine with its client certificate, and the command-line client speaks TLS. Plaintext
to a TLS port fails, a client without a certificate or with one from another CA is refused,
and a rewritten certificate is served to new connections without a restart."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from shared.protos import engine_pb2 as epb
from shared.protos import engine_pb2_grpc
from tests.frontend_svc.frontend_helpers import greedy
from tests.service_processes import REPO_ROOT, FrontendProcess, ServiceProcess, wait_all_serving
from tests.shared.tls_certs import Authority, Pem, make_authority


class Secured:
    def __init__(
        self, engine: ServiceProcess, frontend: FrontendProcess, folder: Path, ca: Authority
    ) -> None:
        self.engine = engine
        self.frontend = frontend
        self.folder = folder
        self.ca = ca
        self.frontend_cert = Pem(folder / "frontend-serving.crt", folder / "frontend-serving.key")


def _credentials(ca: Path, client: Pem | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=None if client is None else client.key.read_bytes(),
        certificate_chain=None if client is None else client.cert.read_bytes(),
    )


@pytest.fixture(scope="module")
def secured(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    folder = tmp_path_factory.mktemp("tls")
    ca = make_authority(folder, "duoserve-test-ca")
    engine_cert = ca.issue(folder, "engine", server=True)
    frontend_cert = ca.issue(folder, "frontend", server=True)
    frontend_client = ca.issue(folder, "frontend-client", server=False)
    # The frontend serves copies, which a test rewrites.
    shutil.copy(frontend_cert.cert, folder / "frontend-serving.crt")
    shutil.copy(frontend_cert.key, folder / "frontend-serving.key")
    engine = ServiceProcess(
        tiny_model_dir, folder / "engine.log",
        "--tls-cert-file", str(engine_cert.cert), "--tls-key-file", str(engine_cert.key),
        "--tls-client-ca-file", str(ca.pem.cert),
    )  # fmt: skip
    engine.credentials = _credentials(ca.pem.cert, frontend_client)
    frontend = FrontendProcess(
        [engine.address], folder / "frontend.log",
        "--tls-cert-file", str(folder / "frontend-serving.crt"),
        "--tls-key-file", str(folder / "frontend-serving.key"),
        "--engine-tls-ca-file", str(ca.pem.cert),
        "--engine-tls-cert-file", str(frontend_client.cert),
        "--engine-tls-key-file", str(frontend_client.key),
    )  # fmt: skip
    frontend.credentials = _credentials(ca.pem.cert)
    wait_all_serving([engine, frontend])  # SERVING needs the tokenizer, fetched over mTLS
    yield Secured(engine, frontend, folder, ca)
    frontend.stop()
    engine.stop()


def _generate(channel: grpc.Channel) -> str:
    stub = frontend_pb2_grpc.GenerationServiceStub(channel)
    request = fpb.GenerateRequest(prompt="Hello", sampling_params=greedy(4))
    return str(stub.Generate(request, timeout=60).choices[0].text)


def _model_info(channel: grpc.Channel) -> grpc.StatusCode:
    stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
    try:
        stub.GetModelInfo(epb.GetModelInfoRequest(), timeout=10)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_a_tls_call_goes_through_both_services(secured: Secured) -> None:
    with secured.frontend.channel() as channel:
        assert _generate(channel)  # the frontend reached the engine over mutual TLS


def test_plaintext_to_a_tls_port_fails(secured: Secured) -> None:
    with (
        grpc.insecure_channel(secured.frontend.address) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        _generate(channel)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(secured.engine.address) as channel:
        assert _model_info(channel) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(secured: Secured) -> None:
    address, ca = secured.engine.address, secured.ca.pem.cert
    with grpc.secure_channel(address, _credentials(ca)) as channel:
        assert _model_info(channel) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    other = make_authority(secured.folder, "another-ca")
    stranger = other.issue(secured.folder, "stranger", server=False)
    with grpc.secure_channel(address, _credentials(ca, stranger)) as channel:
        assert _model_info(channel) == grpc.StatusCode.UNAVAILABLE
    with secured.engine.channel() as channel:
        assert _model_info(channel) == grpc.StatusCode.OK


def test_a_rewritten_certificate_is_served_to_new_connections(secured: Secured) -> None:
    rotated_ca = make_authority(secured.folder, "rotated-ca")
    rotated = rotated_ca.issue(secured.folder, "frontend-rotated", server=True)
    for source, target in ((rotated.key, secured.frontend_cert.key),
                           (rotated.cert, secured.frontend_cert.cert)):  # fmt: skip
        fresh = target.with_suffix(".new")
        shutil.copy(source, fresh)
        fresh.replace(target)
    address = secured.frontend.address
    with grpc.secure_channel(address, _credentials(rotated_ca.pem.cert)) as channel:
        assert _generate(channel)
    # A client that trusts only the old CA no longer accepts the server.
    old_trust = _credentials(secured.ca.pem.cert)
    with grpc.secure_channel(address, old_trust) as old, pytest.raises(grpc.RpcError) as caught:
        _generate(old)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    secured.frontend.credentials = _credentials(rotated_ca.pem.cert)


def test_the_command_line_client_speaks_tls(secured: Secured) -> None:
    command = [sys.executable, "-m", "frontend_svc.client", "--address",
               secured.frontend.address, "Hello", "--max-tokens", "4"]  # fmt: skip
    trusting = [*command, "--tls-ca-file", str(_frontend_ca(secured))]
    done = subprocess.run(trusting, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr


def test_the_health_check_probe_speaks_mutual_tls(secured: Secured) -> None:
    """`python -m shared.health_check`, the exec probe of pods that serve TLS."""
    client = secured.ca.issue(secured.folder, "probe", server=False)
    command = [sys.executable, "-m", "shared.health_check",
               "--address", f"localhost:{secured.engine.port}",
               "--service", "engine.v1.EngineCoreService",
               "--tls-ca-file", str(secured.ca.pem.cert)]  # fmt: skip
    with_cert = [*command, "--tls-cert-file", str(client.cert), "--tls-key-file", str(client.key)]
    done = subprocess.run(with_cert, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "SERVING" in done.stdout, done.stdout + done.stderr
    refused = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stdout, refused.stdout


def _frontend_ca(secured: Secured) -> Path:
    """The CA of the certificate the frontend serves now (a test may have rotated it)."""
    rotated = secured.folder / "rotated-ca.crt"
    return rotated if rotated.exists() else secured.ca.pem.cert


def _replace(source: Pem, target: Pem) -> None:
    """Rewrite `target`'s files with `source`'s, each by an atomic rename."""
    for old, new in ((source.key, target.key), (source.cert, target.cert)):
        fresh = new.with_suffix(".new")
        shutil.copy(old, fresh)
        fresh.replace(new)


def test_the_frontend_follows_its_rewritten_client_certificate(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The engine accepts only clients of `trusted`; the frontend starts with a certificate
    of another CA, so it reaches no engine, until its files are rewritten: then it opens a
    new channel with them and serves, without a restart."""
    engine_ca = make_authority(tmp_path, "engine-ca")
    trusted = make_authority(tmp_path, "trusted-client-ca")
    engine_cert = engine_ca.issue(tmp_path, "engine", server=True)
    client = Pem(tmp_path / "client.crt", tmp_path / "client.key")
    _replace(make_authority(tmp_path, "other-ca").issue(tmp_path, "refused", server=False), client)
    engine = ServiceProcess(
        tiny_model_dir, tmp_path / "engine.log",
        "--tls-cert-file", str(engine_cert.cert), "--tls-key-file", str(engine_cert.key),
        "--tls-client-ca-file", str(trusted.pem.cert),
    )  # fmt: skip
    engine.credentials = _credentials(
        engine_ca.pem.cert, trusted.issue(tmp_path, "t", server=False)
    )
    frontend = FrontendProcess(
        [engine.address], tmp_path / "frontend.log", "--tokenizer", str(tiny_model_dir),
        "--engine-tls-ca-file", str(engine_ca.pem.cert),
        "--engine-tls-cert-file", str(client.cert), "--engine-tls-key-file", str(client.key),
    )  # fmt: skip
    try:
        engine.wait_serving()
        _wait_listening(frontend)
        with frontend.channel() as channel, pytest.raises(grpc.RpcError) as refused:
            _generate(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no engine took it
        _replace(trusted.issue(tmp_path, "accepted", server=False), client)
        frontend.wait_serving(timeout_s=60)
        with frontend.channel() as channel:
            assert _generate(channel)
        assert "the TLS client files changed" in frontend.log()
    finally:
        frontend.stop()
        engine.stop()


def _wait_listening(process: ServiceProcess, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            process.health()
            return
        except grpc.RpcError:
            assert time.monotonic() < deadline, f"not listening within {timeout_s} s"
            time.sleep(0.1)
