"""Artifact fetch, the transport half: HTTPS with a private CA, the CLI, unsigned artifacts over plain http,
content-addressed fetches, unsatisfiable ranges, refused connections and redirects, and deadlines and cancels that
reach a server that never answers (tests/test_fetch.py: resume, retries, verification, disk and bandwidth)."""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import ssl
import threading
from pathlib import Path
from typing import Iterator

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.fetch import fetch_artifact
from agent.artifacts.trust import verify_artifact
from deploy.signing import KeyInfo, keygen
from kernel.errors import EdgeError
from tests.helpers import wait_for
from tests.http_server import ArtifactServer
from tests.test_package_verify import rewrite_manifest, write_signed
from tests.fetch_fixtures import MODEL, assert_fetched, config, fetch_error, no_leaked_threads, publish, tree


@pytest.fixture(autouse=True)
def leak_check() -> Iterator[None]:
    with no_leaked_threads():
        yield


@pytest.fixture()
def key(tmp_path: Path) -> KeyInfo:
    return keygen(tmp_path / "keys" / "release.key")


@pytest.fixture()
def published(tmp_path: Path, key: KeyInfo) -> Path:
    return publish(tmp_path, key)


@pytest.fixture()
def server(published: Path) -> Iterator[ArtifactServer]:
    with ArtifactServer(published) as srv:
        yield srv


# --- https with a CA made here ---


def _tls_material(tmp_path: Path) -> tuple[Path, ssl.SSLContext]:
    """A private CA and a 127.0.0.1 server certificate it signed; returns (CA file, server context)."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edge test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = tmp_path / "ca.pem", tmp_path / "srv.pem", tmp_path / "srv.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        srv_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return ca_file, context


def test_https_with_private_ca_and_refusal_without_it(tmp_path: Path, key: KeyInfo, published: Path) -> None:
    ca_file, context = _tls_material(tmp_path)
    with ArtifactServer(published, tls=context) as server:
        assert server.url().startswith("https://")
        error = fetch_error(server.url("manifest.json"), tmp_path / "a", config(key))
        assert error.code == "ARTIFACT_FETCH_FAILED" and "certificate" in str(error)
        assert server.count("manifest.json") == 0  # refused during the handshake: no request was ever sent
        server.drop_after(MODEL, 70_000)
        dest = fetch_artifact(server.url("manifest.json"), tmp_path / "b", config(key, ca_file=ca_file))
        assert server.range_requests(MODEL)
    assert_fetched(dest, published)
    assert not (tmp_path / "a").exists()


def test_missing_ca_file_is_a_fetch_error(tmp_path: Path, key: KeyInfo) -> None:
    cfg = config(key, ca_file=tmp_path / "missing.pem")
    error = fetch_error("https://127.0.0.1:9/manifest.json", tmp_path / "d", cfg)
    assert error.code == "ARTIFACT_FETCH_FAILED" and "ca_file" in str(error)


def test_cli_fetch(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    result = CliRunner().invoke(
        app, ["fetch", server.url("manifest.json"), "-o", str(tmp_path / "d"), "--trust", str(key.public),
              "--allow-http"]
    )
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["fetch", server.url("manifest.json"), "-o", str(tmp_path / "e"), "--allow-http"])
    assert bad.exit_code == 1 and "ARTIFACT_SIGNATURE_INVALID" in bad.output
    plain = CliRunner().invoke(app, ["fetch", server.url("manifest.json"), "-o", str(tmp_path / "f"),
                                     "--trust", str(key.public)])
    assert plain.exit_code == 1 and "ARTIFACT_URL_REFUSED" in plain.output
    assert assert_fetched(tmp_path / "d", published)["name"] == "tiny"
    assert not (tmp_path / "e").exists() and not (tmp_path / "f").exists()


def test_unsigned_allowed_over_http(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    write_signed(published, (published / "manifest.json").read_bytes(), None)
    fetch_artifact(server.url("manifest.json"), tmp_path / "d", config(key, allow_unsigned=True))
    assert not (tmp_path / "d" / "manifest.json.sig").exists()
    assert_fetched(tmp_path / "d", published)


def test_fetch_into_is_content_addressed(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    from agent.artifacts import fetch_into

    store = tmp_path / "store"
    first = fetch_into(server.url("manifest.json"), store, config(key))
    assert first.parent == store and first.name.startswith("tiny-1.0.0-")
    assert first.name.endswith(hashlib.sha256((published / "manifest.json").read_bytes()).hexdigest()[:16])
    assert_fetched(first, published)
    old = tree(first)
    before = len(server.requests)
    assert fetch_into(server.url("manifest.json"), store, config(key)) == first
    assert {r.path for r in server.requests[before:]} == {"manifest.json", "manifest.json.sig"}
    rewrite_manifest(published, key, lambda d: d.update(description="republished under the same URL"))
    second = fetch_into(server.url("manifest.json"), store, config(key))
    assert second != first and tree(first) == old  # the old (maybe active) directory is untouched
    assert verify_artifact(second, config(key)).manifest.description == "republished under the same URL"
    assert assert_fetched(second, published)["description"] == "republished under the same URL"


def test_unsatisfiable_range_discards_the_partial_file(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path
) -> None:
    stop = threading.Event()
    dest = tmp_path / "dest"
    cfg = config(key, bandwidth_limit_kbps=8000)
    fetch_error(server.url("manifest.json"), dest, cfg, stop_event=stop,
                on_progress=lambda e: stop.set() if e["file"] == MODEL and e["bytes"] >= 64 * 1024 else None)
    (published / MODEL).write_bytes(b"short")  # the published file changed under the same manifest
    error = fetch_error(server.url("manifest.json"), dest, config(key))
    assert error.code == "ARTIFACT_SIZE_MISMATCH"
    assert [r.status for r in server.requests if r.path == MODEL][-2:] == [416, 200]
    assert not list((tmp_path / "dest.partial").rglob("*.part"))  # the old partial file was discarded


def test_connection_refused_is_retried_then_fails(tmp_path: Path, key: KeyInfo) -> None:
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    error = fetch_error(f"http://127.0.0.1:{port}/manifest.json", tmp_path / "d", config(key, retries=2))
    assert error.code == "ARTIFACT_FETCH_FAILED" and "3 failed attempts" in str(error)


def test_redirect_from_https_to_http_is_refused() -> None:
    import urllib.request

    from agent.artifacts.transport import FetchError, _PolicyRedirect

    redirect = _PolicyRedirect(ArtifactsConfig(allow_http=True))  # even where http is allowed
    request = urllib.request.Request("https://models.example/a/manifest.json")
    with pytest.raises(FetchError, match="refusing redirect"):
        redirect.redirect_request(request, None, 302, "Found", {}, "http://models.example/a/manifest.json")
    assert redirect.redirect_request(request, None, 302, "Found", {}, "https://cdn.example/m.json")


class SilentServer:
    """Loopback TCP server that accepts and never speaks: a TLS handshake against it never completes."""

    def __init__(self) -> None:
        import socket

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.accepted = threading.Event()
        self.connections: list = []
        self.thread = threading.Thread(target=self._accept, name="test-silent", daemon=True)

    def _accept(self) -> None:
        try:
            while True:
                conn, _ = self.listener.accept()
                self.connections.append(conn)
                self.accepted.set()
        except OSError:
            return  # listener closed

    def url(self, scheme: str) -> str:
        return f"{scheme}://127.0.0.1:{self.listener.getsockname()[1]}/manifest.json"

    def __enter__(self) -> "SilentServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import socket

        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self.listener.close()
        for conn in self.connections:  # a client still in its handshake sees EOF and ends
            conn.close()
        self.thread.join(10)


def _fetch_in_thread(url: str, dest: Path, cfg: ArtifactsConfig, **kwargs: object) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            fetch_artifact(url, dest, cfg, **kwargs)
        except EdgeError as exc:
            outcome["code"] = exc.code

    worker = threading.Thread(target=run, name="test-fetch")
    worker.start()
    return worker, outcome


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_deadline_and_cancel_reach_a_server_that_never_answers(tmp_path: Path, key: KeyInfo, scheme: str) -> None:
    """The socket is registered before the TLS handshake: the watcher closes it at the deadline or on
    cancel, long before the connect timeout (300 s here) would."""
    cfg = config(key, allow_http=True, connect_timeout_s=300, read_timeout_s=300)
    with SilentServer() as server:
        overdue, timed_out = _fetch_in_thread(server.url(scheme), tmp_path / "d1", cfg, timeout_s=0.5)
        ended_at_deadline = wait_for(lambda: not overdue.is_alive(), timeout=60)
        stop = threading.Event()
        server.accepted.clear()
        cancelled, cancel_outcome = _fetch_in_thread(server.url(scheme), tmp_path / "d2", cfg, stop_event=stop)
        assert server.accepted.wait(30), "the fetch never connected"
        stop.set()
        ended_on_cancel = wait_for(lambda: not cancelled.is_alive(), timeout=60)
    overdue.join()
    cancelled.join()
    assert ended_at_deadline and timed_out.get("code") == "ARTIFACT_FETCH_TIMEOUT", timed_out
    assert ended_on_cancel and cancel_outcome.get("code") == "ARTIFACT_FETCH_CANCELLED", cancel_outcome
    assert not (tmp_path / "d1").exists() and not (tmp_path / "d2").exists()
