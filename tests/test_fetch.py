"""Fetching artifacts over a real loopback HTTP(S) server and file:// URLs: resume, retries, refusals."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import shutil
import ssl
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.artifacts import fetch as fetch_module
from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.fetch import TokenBucket, fetch_artifact, file_url
from agent.artifacts.trust import verify_artifact
from deploy.signing import KeyInfo, keygen
from engines.errors import EdgeError
from tests.helpers import wait_for
from tests.http_server import ArtifactServer
from tests.test_package_verify import rewrite_manifest, signed_artifact, write_signed

MODEL = "src-model.onnx"
WEIGHTS = 50_000  # 200 kB of float32: big enough to break mid-file and to throttle


@pytest.fixture(autouse=True)
def no_leaked_threads():  # type: ignore[no-untyped-def]
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and set(threading.enumerate()) - before:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before, "test leaked threads"


@pytest.fixture()
def key(tmp_path: Path) -> KeyInfo:
    return keygen(tmp_path / "keys" / "release.key")


@pytest.fixture()
def published(tmp_path: Path, key: KeyInfo) -> Path:
    """A signed artifact in a directory served as-is (what a static web server would publish)."""
    (tmp_path / "publish").mkdir()
    return signed_artifact(tmp_path / "publish", key, weights=WEIGHTS, name="tiny-1.0.0")


@pytest.fixture()
def server(published: Path):  # type: ignore[no-untyped-def]
    with ArtifactServer(published) as srv:
        yield srv


def config(key: KeyInfo, **fields: object) -> ArtifactsConfig:
    """Device config trusting `key`, with fast retries for tests; the loopback server speaks plain http."""
    base = {"trusted_keys": [str(key.public)], "retry_backoff_s": 0.01, "connect_timeout_s": 5, "read_timeout_s": 5,
            "allow_http": True}
    return ArtifactsConfig(**{**base, **fields})  # type: ignore[arg-type]


def fetch_error(url: str, dest: Path, cfg: ArtifactsConfig, **kwargs: object) -> EdgeError:
    with pytest.raises(EdgeError) as exc:
        fetch_artifact(url, dest, cfg, **kwargs)  # type: ignore[arg-type]
    assert not dest.exists()
    return exc.value


def test_fetch_over_http_verifies_and_reports_progress(tmp_path: Path, key: KeyInfo, server: ArtifactServer) -> None:
    events: list[dict] = []
    dest = tmp_path / "device" / "tiny" / "1.0.0"
    result = fetch_artifact(server.url("manifest.json"), dest, config(key), on_progress=events.append)
    assert result == dest
    assert verify_artifact(dest, config(key)).manifest.name == "tiny"
    assert not dest.with_name("1.0.0.partial").exists()
    finals = [e for e in events if e["bytes"] == e["total"]]
    assert {e["file"] for e in finals} == {MODEL, "labels.txt"}
    assert all(e["stage"] == "fetching" and {"file", "bytes", "total", "rate_bps"} <= e.keys() for e in events)
    assert events[-1]["artifact_bytes"] == events[-1]["artifact_total"]
    assert server.range_requests(MODEL) == []


def test_dropped_connection_resumes_with_range(tmp_path: Path, key: KeyInfo, server: ArtifactServer) -> None:
    server.drop_after(MODEL, 70_000)
    dest = tmp_path / "dest"
    fetch_artifact(server.url("manifest.json"), dest, config(key))
    assert server.count(MODEL) == 2
    ranges = server.range_requests(MODEL)
    assert len(ranges) == 1 and ranges[0].startswith("bytes=") and int(ranges[0][6:-1]) >= 65_536
    resumed = [r for r in server.requests if r.path == MODEL][1]
    assert resumed.status == 206 and resumed.headers.get("If-Range", "").startswith('"')  # strong ETag validator
    verify_artifact(dest, config(key))


def test_server_that_ignores_range_restarts_from_zero(tmp_path: Path, key: KeyInfo, published: Path) -> None:
    with ArtifactServer(published, ignore_range=True) as server:
        server.drop_after(MODEL, 70_000, times=2)
        fetch_artifact(server.url("manifest.json"), tmp_path / "dest", config(key))
        statuses = [r.status for r in server.requests if r.path == MODEL]
    assert statuses == [200, 200, 200]
    verify_artifact(tmp_path / "dest", config(key))


def test_transient_5xx_is_retried(tmp_path: Path, key: KeyInfo, server: ArtifactServer) -> None:
    server.fail_next("manifest.json", 503, times=2)
    server.fail_next(MODEL, 500)
    fetch_artifact(server.url("manifest.json"), tmp_path / "dest", config(key))
    assert server.count("manifest.json") == 3 and server.count(MODEL) == 2


def test_persistent_5xx_gives_up_with_status(tmp_path: Path, key: KeyInfo, server: ArtifactServer) -> None:
    server.fail_next(MODEL, 500, times=100)
    error = fetch_error(server.url("manifest.json"), tmp_path / "dest", config(key, retries=2))
    assert error.code == "ARTIFACT_FETCH_FAILED" and "HTTP 500" in str(error)
    assert server.count(MODEL) == 3


def test_404_is_not_found(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    assert fetch_error(server.url("nope/manifest.json"), tmp_path / "a", config(key)).code == "ARTIFACT_NOT_FOUND"
    (published / "labels.txt").unlink()
    error = fetch_error(server.url("manifest.json"), tmp_path / "b", config(key))
    assert error.code == "ARTIFACT_NOT_FOUND" and "labels.txt" in str(error) and "404" in str(error)
    assert server.count("labels.txt") == 1  # not retried


def test_directory_url_means_its_manifest(tmp_path: Path, key: KeyInfo, server: ArtifactServer) -> None:
    fetch_artifact(server.url(""), tmp_path / "dest", config(key))
    verify_artifact(tmp_path / "dest", config(key))


def test_file_url(tmp_path: Path, key: KeyInfo, published: Path) -> None:
    url = (published / "manifest.json").as_uri()
    dest = fetch_artifact(url, tmp_path / "dest", config(key))
    assert verify_artifact(dest, config(key)).manifest.version == "1.0.0"
    assert (
        fetch_error((tmp_path / "none" / "manifest.json").as_uri(), tmp_path / "x", config(key)).code
        == "ARTIFACT_NOT_FOUND"
    )


def test_fetch_is_idempotent(tmp_path: Path, key: KeyInfo, server: ArtifactServer) -> None:
    dest = tmp_path / "dest"
    fetch_artifact(server.url("manifest.json"), dest, config(key))
    before = len(server.requests)
    assert fetch_artifact(server.url("manifest.json"), dest, config(key)) == dest
    assert len(server.requests) == before


def test_existing_corrupt_destination_is_quarantined_and_refetched(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer
) -> None:
    dest = tmp_path / "dest"
    fetch_artifact(server.url("manifest.json"), dest, config(key))
    (dest / MODEL).write_bytes(b"rotten")
    fetch_artifact(server.url("manifest.json"), dest, config(key))
    verify_artifact(dest, config(key))
    quarantined = list(tmp_path.glob("dest.quarantine-*"))
    assert len(quarantined) == 1 and (quarantined[0] / MODEL).read_bytes() == b"rotten"


@pytest.mark.parametrize(
    "setup, code",
    [("unsigned", "ARTIFACT_UNSIGNED"), ("untrusted", "ARTIFACT_SIGNATURE_INVALID"), ("tampered", "ARTIFACT_SIGNATURE_INVALID"),
     ("escape", "ARTIFACT_PATH_INVALID"), ("absolute", "ARTIFACT_PATH_INVALID"), ("cap", "ARTIFACT_TOO_LARGE"),
     ("nospace", "ARTIFACT_NO_SPACE")],
)  # fmt: skip
def test_refused_before_any_file_is_downloaded(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path, setup: str, code: str
) -> None:
    cfg = config(key)
    if setup == "unsigned":
        (published / "manifest.json.sig").unlink()
    elif setup == "untrusted":
        cfg = config(keygen(tmp_path / "other.key"))
    elif setup == "tampered":
        (published / "manifest.json").write_bytes((published / "manifest.json").read_bytes().replace(b"tiny", b"tinz"))
    elif setup == "escape":
        rewrite_manifest(published, key, lambda d: d["files"][0].update(file="../../keys/release.key"))
    elif setup == "absolute":
        rewrite_manifest(published, key, lambda d: d["model"].update(file="/etc/passwd"))
    elif setup == "cap":
        cfg = config(key, max_artifact_mb=0.1)
    elif setup == "nospace":
        cfg = config(key, min_free_mb=2**40)  # a real check: no disk here has an exbibyte free
    assert fetch_error(server.url("manifest.json"), tmp_path / "dest", cfg).code == code
    assert {r.path for r in server.requests} <= {"manifest.json", "manifest.json.sig"}


def test_full_disk_is_no_space(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # shutil.disk_usage is replaced ONLY to stand in for a full disk (filling a real one is not a unit test).
    monkeypatch.setattr(
        fetch_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096)
    )
    error = fetch_error(server.url("manifest.json"), tmp_path / "dest", config(key, min_free_mb=0))
    assert error.code == "ARTIFACT_NO_SPACE" and "MiB" in str(error)
    assert server.count(MODEL) == 0


def test_server_content_not_matching_the_manifest(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path
) -> None:
    model = published / MODEL
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    assert fetch_error(server.url("manifest.json"), tmp_path / "dest", config(key)).code == "ARTIFACT_SHA256_MISMATCH"
    with open(model, "ab") as fh:
        fh.write(b"more")
    assert fetch_error(server.url("manifest.json"), tmp_path / "dest2", config(key)).code == "ARTIFACT_SIZE_MISMATCH"


def test_model_that_does_not_load_is_refused_and_partial_removed(tmp_path: Path, key: KeyInfo, published: Path) -> None:
    (published / MODEL).write_bytes(b"not onnx at all")
    rewrite_manifest(published, key, lambda d: d["model"].update(
        size=15, sha256=__import__("hashlib").sha256(b"not onnx at all").hexdigest()))  # fmt: skip
    with ArtifactServer(published) as server:
        error = fetch_error(server.url("manifest.json"), tmp_path / "dest", config(key))
    assert error.code == "MODEL_LOAD_FAILED"
    assert not (tmp_path / "dest.partial").exists()


def test_cancel_then_resume_in_a_later_call(tmp_path: Path, key: KeyInfo, server: ArtifactServer) -> None:
    stop = threading.Event()

    def on_progress(event: dict) -> None:
        if event["file"] == MODEL and event["bytes"] >= 64 * 1024:
            stop.set()

    dest = tmp_path / "dest"
    cfg = config(key, bandwidth_limit_kbps=8000)  # slow enough that progress events arrive mid-file
    error = fetch_error(server.url("manifest.json"), dest, cfg, on_progress=on_progress, stop_event=stop)
    assert error.code == "ARTIFACT_FETCH_CANCELLED"
    assert list((tmp_path / "dest.partial" / ".incoming").glob("*.part"))
    fetch_artifact(server.url("manifest.json"), dest, config(key))
    assert server.range_requests(MODEL) and int(server.range_requests(MODEL)[0][6:-1]) >= 64 * 1024
    verify_artifact(dest, config(key))


def test_bandwidth_cap_is_honoured(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    events: list[dict] = []
    size = (published / MODEL).stat().st_size
    kbps = 1600  # 200 kB/s
    started = time.monotonic()
    fetch_artifact(
        server.url("manifest.json"),
        tmp_path / "dest",
        config(key, bandwidth_limit_kbps=kbps),
        on_progress=events.append,
    )
    elapsed = time.monotonic() - started
    burst = kbps * 125 / 4
    assert elapsed >= 0.8 * (size - burst) / (kbps * 125)  # lower bound only: a slow machine may take longer
    assert len(events) <= elapsed * 4 + 4  # progress is rate-limited to a few events per second
    rates = [e["rate_bps"] for e in events if e["rate_bps"]]
    assert rates and max(rates) < kbps * 1000 * 3


def test_token_bucket_with_a_fake_clock() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=1000, capacity=100, clock=lambda: now[0])

    class Clock(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            now[0] += timeout or 0
            return False

    stop = Clock()
    for _ in range(10):
        bucket.consume(100, stop)
    assert now[0] == pytest.approx(0.9)  # first 100 bytes from the full bucket, then 1000 B/s


def test_file_urls_stay_inside_the_artifact() -> None:
    assert file_url("http://h/a/b/manifest.json?t=1", "calibration/x y.jpg") == "http://h/a/b/calibration/x%20y.jpg"
    assert file_url("http://h/a/manifest.json", "q?x#y") == "http://h/a/q%3Fx%23y"
    with pytest.raises(EdgeError):
        file_url("http://h/a/manifest.json", "//evil.example/x")


def test_unsupported_scheme(tmp_path: Path, key: KeyInfo) -> None:
    assert fetch_error("ftp://h/manifest.json", tmp_path / "d", config(key)).code == "ARTIFACT_FETCH_FAILED"


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
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
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
    verify_artifact(dest, config(key))


def test_missing_ca_file_is_a_fetch_error(tmp_path: Path, key: KeyInfo) -> None:
    cfg = config(key, ca_file=tmp_path / "missing.pem")
    error = fetch_error("https://127.0.0.1:9/manifest.json", tmp_path / "d", cfg)
    assert error.code == "ARTIFACT_FETCH_FAILED" and "ca_file" in str(error)


def test_cli_fetch(tmp_path: Path, key: KeyInfo, server: ArtifactServer) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    result = CliRunner().invoke(
        app, ["fetch", server.url("manifest.json"), "-o", str(tmp_path / "d"), "--trust", str(key.public), "--allow-http"]
    )
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["fetch", server.url("manifest.json"), "-o", str(tmp_path / "e"), "--allow-http"])
    assert bad.exit_code == 1 and "ARTIFACT_SIGNATURE_INVALID" in bad.output
    plain = CliRunner().invoke(app, ["fetch", server.url("manifest.json"), "-o", str(tmp_path / "f"),
                                     "--trust", str(key.public)])
    assert plain.exit_code == 1 and "ARTIFACT_URL_REFUSED" in plain.output
    assert json.loads((tmp_path / "d" / "manifest.json").read_bytes())["name"] == "tiny"


def test_unsigned_allowed_over_http(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    write_signed(published, (published / "manifest.json").read_bytes(), None)
    fetch_artifact(server.url("manifest.json"), tmp_path / "d", config(key, allow_unsigned=True))
    assert not (tmp_path / "d" / "manifest.json.sig").exists()


def test_fetch_into_is_content_addressed(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    from agent.artifacts import fetch_into

    store = tmp_path / "store"
    first = fetch_into(server.url("manifest.json"), store, config(key))
    assert first.parent == store and first.name.startswith("tiny-1.0.0-")
    before = len(server.requests)
    assert fetch_into(server.url("manifest.json"), store, config(key)) == first
    assert {r.path for r in server.requests[before:]} == {"manifest.json", "manifest.json.sig"}
    rewrite_manifest(published, key, lambda d: d.update(description="republished under the same URL"))
    second = fetch_into(server.url("manifest.json"), store, config(key))
    assert second != first and first.is_dir()  # the old (maybe active) directory is untouched
    assert verify_artifact(second, config(key)).manifest.description == "republished under the same URL"


def test_unsatisfiable_range_discards_the_partial_file(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path
) -> None:
    stop = threading.Event()
    dest = tmp_path / "dest"
    cfg = config(key, bandwidth_limit_kbps=8000)
    fetch_error(server.url("manifest.json"), dest, cfg, stop_event=stop,
                on_progress=lambda e: stop.set() if e["file"] == MODEL and e["bytes"] >= 64 * 1024 else None)  # fmt: skip
    (published / MODEL).write_bytes(b"short")  # the published file changed under the same manifest
    error = fetch_error(server.url("manifest.json"), dest, config(key))
    assert error.code == "ARTIFACT_SIZE_MISMATCH"
    assert [r.status for r in server.requests if r.path == MODEL][-2:] == [416, 200]


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
            fetch_artifact(url, dest, cfg, **kwargs)  # type: ignore[arg-type]
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
