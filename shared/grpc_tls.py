"""TLS for the gRPC servers and the clients the project ships.

A server given a certificate and key serves TLS only; given a client CA as well, it serves
mutual TLS: a client must present a certificate that CA signed. The server's files are
re-read when they change (Kubernetes rotates mounted Secrets in place), checked at each new
connection's handshake, so rotation needs no restart and open connections live on. A client
trusts the CA it is given (default: the system's roots) and, for mutual TLS, presents its
own certificate.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import grpc

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TLSConfigError(ValueError):
    """The TLS options do not fit together."""


@dataclasses.dataclass(frozen=True)
class ServerTLS:
    cert_file: Path  # PEM certificate chain
    key_file: Path  # PEM private key
    client_ca_file: Path | None = None  # mutual TLS: clients must hold a cert this CA signed

    @classmethod
    def from_options(
        cls, cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None
    ) -> ServerTLS | None:
        """None (plaintext) when no file is given; the files must exist."""
        if cert_file is None and key_file is None:
            if client_ca_file is not None:
                raise TLSConfigError(
                    "--tls-client-ca-file needs --tls-cert-file and --tls-key-file"
                )
            return None
        if cert_file is None or key_file is None:
            raise TLSConfigError("--tls-cert-file and --tls-key-file go together")
        tls = cls(cert_file, key_file, client_ca_file)
        tls.certificate_configuration()  # unreadable files fail now, not at the first client
        return tls

    def credentials(self) -> grpc.ServerCredentials:
        # gRPC asks at each handshake whether the certificate changed (None: keep it).
        watcher = FilesWatcher(self.files(), self.certificate_configuration)
        return grpc.dynamic_ssl_server_credentials(
            watcher.current,
            watcher.changed,
            require_client_authentication=self.client_ca_file is not None,
        )

    def certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        key_and_cert = [(self.key_file.read_bytes(), self.cert_file.read_bytes())]
        client_ca = None if self.client_ca_file is None else self.client_ca_file.read_bytes()
        return grpc.ssl_server_certificate_configuration(key_and_cert, client_ca)

    def files(self) -> list[Path]:
        return [p for p in (self.cert_file, self.key_file, self.client_ca_file) if p is not None]


class FilesWatcher(Generic[T]):
    """What `read` makes of some files, made again when one of them changed (a rotated
    Kubernetes secret). `changed()`: the new value, or None while nothing changed or while a
    file is briefly missing mid-rotation (the current value serves on)."""

    def __init__(self, files: list[Path], read: Callable[[], T]) -> None:
        self.files = files
        self.read = read
        self._stamps = file_stamps(files)
        self.current = read()

    def changed(self) -> T | None:
        try:
            stamps = file_stamps(self.files)
            if stamps == self._stamps:
                return None
            value = self.read()
        except OSError as error:
            logger.warning("cannot re-read the TLS files (%s); keeping the current ones", error)
            return None
        self._stamps, self.current = stamps, value
        logger.info("TLS files changed: re-read")
        return value


FileStamp = tuple[int, int, int]


def file_stamps(paths: list[Path]) -> list[FileStamp]:
    """What tells a rewritten file (a Kubernetes secret swaps a symlink): its modification
    time, size and inode. Raises OSError while a file is missing."""
    stamps = []
    for path in paths:
        info = os.stat(path)
        stamps.append((info.st_mtime_ns, info.st_size, info.st_ino))
    return stamps


@dataclasses.dataclass(frozen=True)
class ClientTLS:
    ca_file: Path | None = None  # the CA that signed the server's cert (default: system roots)
    cert_file: Path | None = None  # mutual TLS: this client's certificate chain
    key_file: Path | None = None  # and its private key
    # The name to check the server's certificate against, where the address is not it (an
    # engine pod reached by its IP, its certificate made out to the Service's name).
    server_name: str | None = None

    @classmethod
    def from_options(
        cls,
        ca_file: Path | None,
        cert_file: Path | None,
        key_file: Path | None,
        prefix: str,
        server_name: str | None = None,
    ) -> ClientTLS | None:
        """None (plaintext) when no file is given. `prefix` names the flags in errors."""
        if ca_file is None and cert_file is None and key_file is None:
            if server_name is not None:
                raise TLSConfigError(f"{prefix}-server-name needs {prefix}-ca-file")
            return None
        if (cert_file is None) != (key_file is None):
            raise TLSConfigError(f"{prefix}-cert-file and {prefix}-key-file go together")
        tls = cls(ca_file, cert_file, key_file, server_name)
        tls.credentials()  # unreadable files fail now
        return tls

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )

    def files(self) -> list[Path]:
        return [p for p in (self.ca_file, self.cert_file, self.key_file) if p is not None]

    def channel_options(self) -> list[tuple[str, str]]:
        return (
            []
            if self.server_name is None
            else [("grpc.ssl_target_name_override", self.server_name)]
        )


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--tls-cert-file", type=Path, help="serve TLS only, with this PEM certificate chain")
    add("--tls-key-file", type=Path, help="the PEM private key of --tls-cert-file")
    add(
        "--tls-client-ca-file",
        type=Path,
        help="mutual TLS: accept only clients with a certificate this PEM CA signed",
    )


def server_tls(args: argparse.Namespace) -> ServerTLS | None:
    return ServerTLS.from_options(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)


def add_client_arguments(
    parser: argparse.ArgumentParser, prefix: str, server: str, ca_default: str | None = None
) -> None:
    """`{prefix}-ca-file` (`ca_default`: what it defaults to, where something does),
    `{prefix}-cert-file`, `{prefix}-key-file`, `{prefix}-server-name`."""
    add = parser.add_argument
    default = "" if ca_default is None else f" (default: {ca_default})"
    add(
        f"{prefix}-ca-file",
        type=Path,
        help=f"reach {server} over TLS, trusting this PEM CA{default}",
    )
    add(f"{prefix}-cert-file", type=Path, help=f"mutual TLS: the certificate to show {server}")
    add(f"{prefix}-key-file", type=Path, help=f"the PEM private key of {prefix}-cert-file")
    add(
        f"{prefix}-server-name",
        help=f"the name {server}'s certificate must carry (default: the host of its address)",
    )


def client_tls(args: argparse.Namespace, prefix: str) -> ClientTLS | None:
    dest = prefix.lstrip("-").replace("-", "_")
    return ClientTLS.from_options(
        getattr(args, f"{dest}_ca_file"),
        getattr(args, f"{dest}_cert_file"),
        getattr(args, f"{dest}_key_file"),
        prefix,
        getattr(args, f"{dest}_server_name"),
    )
