"""Fetching artifacts over a real loopback HTTP(S) server and file:// URLs: resume, retries, refusals."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent.artifacts import fetch as fetch_module
from agent.artifacts.fetch import TokenBucket, fetch_artifact, file_url
from agent.artifacts.trust import verify_artifact
from deploy.signing import KeyInfo, keygen
from kernel.errors import EdgeError
from tests.http_server import ArtifactServer
from tests.test_package_verify import rewrite_manifest
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


def test_fetch_over_http_verifies_and_reports_progress(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path
) -> None:
    events: list[dict] = []
    dest = tmp_path / "device" / "tiny" / "1.0.0"
    result = fetch_artifact(server.url("manifest.json"), dest, config(key), on_progress=events.append)
    assert result == dest
    assert verify_artifact(dest, config(key)).manifest.name == "tiny"
    assert assert_fetched(dest, published)["name"] == "tiny"
    finals = [e for e in events if e["bytes"] == e["total"]]
    assert {e["file"] for e in finals} == {MODEL, "labels.txt"}
    assert all(e["stage"] == "fetching" and {"file", "bytes", "total", "rate_bps"} <= e.keys() for e in events)
    assert events[-1]["artifact_bytes"] == events[-1]["artifact_total"]
    assert server.range_requests(MODEL) == []


def test_dropped_connection_resumes_with_range(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path
) -> None:
    server.drop_after(MODEL, 70_000)
    dest = tmp_path / "dest"
    fetch_artifact(server.url("manifest.json"), dest, config(key))
    assert server.count(MODEL) == 2
    ranges = server.range_requests(MODEL)
    assert len(ranges) == 1 and ranges[0].startswith("bytes=") and int(ranges[0][6:-1]) >= 65_536
    resumed = [r for r in server.requests if r.path == MODEL][1]
    assert resumed.status == 206 and resumed.headers.get("If-Range", "").startswith('"')  # strong ETag validator
    assert_fetched(dest, published)  # the two halves joined at the right offset


def test_server_that_ignores_range_restarts_from_zero(tmp_path: Path, key: KeyInfo, published: Path) -> None:
    with ArtifactServer(published, ignore_range=True) as server:
        server.drop_after(MODEL, 70_000, times=2)
        fetch_artifact(server.url("manifest.json"), tmp_path / "dest", config(key))
        statuses = [r.status for r in server.requests if r.path == MODEL]
    assert statuses == [200, 200, 200]
    assert_fetched(tmp_path / "dest", published)  # restarted from zero, not appended to the dropped attempt


def test_transient_5xx_is_retried(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    server.fail_next("manifest.json", 503, times=2)
    server.fail_next(MODEL, 500)
    fetch_artifact(server.url("manifest.json"), tmp_path / "dest", config(key))
    assert server.count("manifest.json") == 3 and server.count(MODEL) == 2
    assert_fetched(tmp_path / "dest", published)  # an error page's body never became the model


def test_persistent_5xx_gives_up_with_status(tmp_path: Path, key: KeyInfo, server: ArtifactServer) -> None:
    server.fail_next(MODEL, 500, times=100)
    error = fetch_error(server.url("manifest.json"), tmp_path / "dest", config(key, retries=2))
    assert error.code == "ARTIFACT_FETCH_FAILED" and "HTTP 500" in str(error)
    assert server.count(MODEL) == 3
    assert not (tmp_path / "dest.partial" / MODEL).exists()  # nothing stands in for the file it never got


def test_404_is_not_found(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    assert fetch_error(server.url("nope/manifest.json"), tmp_path / "a", config(key)).code == "ARTIFACT_NOT_FOUND"
    (published / "labels.txt").unlink()
    error = fetch_error(server.url("manifest.json"), tmp_path / "b", config(key))
    assert error.code == "ARTIFACT_NOT_FOUND" and "labels.txt" in str(error) and "404" in str(error)
    assert server.count("labels.txt") == 1  # not retried


def test_directory_url_means_its_manifest(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path
) -> None:
    fetch_artifact(server.url(""), tmp_path / "dest", config(key))
    assert_fetched(tmp_path / "dest", published)
    assert server.count("manifest.json") == 1


def test_file_url(tmp_path: Path, key: KeyInfo, published: Path) -> None:
    url = (published / "manifest.json").as_uri()
    dest = fetch_artifact(url, tmp_path / "dest", config(key))
    assert verify_artifact(dest, config(key)).manifest.version == "1.0.0"
    assert assert_fetched(dest, published)["version"] == "1.0.0"
    assert (
        fetch_error((tmp_path / "none" / "manifest.json").as_uri(), tmp_path / "x", config(key)).code
        == "ARTIFACT_NOT_FOUND"
    )


def test_fetch_is_idempotent(tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path) -> None:
    dest = tmp_path / "dest"
    fetch_artifact(server.url("manifest.json"), dest, config(key))
    stats = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in dest.rglob("*")}
    before = len(server.requests)
    assert fetch_artifact(server.url("manifest.json"), dest, config(key)) == dest
    assert len(server.requests) == before
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in dest.rglob("*")} == stats  # not rewritten either
    assert_fetched(dest, published)


def test_existing_corrupt_destination_is_quarantined_and_refetched(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path
) -> None:
    dest = tmp_path / "dest"
    fetch_artifact(server.url("manifest.json"), dest, config(key))
    (dest / MODEL).write_bytes(b"rotten")
    fetch_artifact(server.url("manifest.json"), dest, config(key))
    assert_fetched(dest, published)
    quarantined = list(tmp_path.glob("dest.quarantine-*"))
    assert len(quarantined) == 1 and (quarantined[0] / MODEL).read_bytes() == b"rotten"


@pytest.mark.parametrize(
    "setup, code",
    [("unsigned", "ARTIFACT_UNSIGNED"), ("untrusted", "ARTIFACT_SIGNATURE_INVALID"),
     ("tampered", "ARTIFACT_SIGNATURE_INVALID"), ("escape", "ARTIFACT_PATH_INVALID"),
     ("absolute", "ARTIFACT_PATH_INVALID"), ("cap", "ARTIFACT_TOO_LARGE"), ("nospace", "ARTIFACT_NO_SPACE")],
)
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
    staged = tree(tmp_path / "dest.partial") if (tmp_path / "dest.partial").exists() else {}
    assert set(staged) <= {"manifest.json", "manifest.json.sig"}  # at most the manifest it refused


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
    staged = set(tree(tmp_path / "dest.partial"))
    assert staged <= {"manifest.json", "manifest.json.sig", "labels.txt"}  # the bad bytes are gone
    with open(model, "ab") as fh:
        fh.write(b"more")
    assert fetch_error(server.url("manifest.json"), tmp_path / "dest2", config(key)).code == "ARTIFACT_SIZE_MISMATCH"


def test_model_that_does_not_load_is_refused_and_partial_removed(tmp_path: Path, key: KeyInfo, published: Path) -> None:
    (published / MODEL).write_bytes(b"not onnx at all")
    rewrite_manifest(published, key, lambda d: d["model"].update(
        size=15, sha256=__import__("hashlib").sha256(b"not onnx at all").hexdigest()))
    with ArtifactServer(published) as server:
        error = fetch_error(server.url("manifest.json"), tmp_path / "dest", config(key))
    assert error.code == "MODEL_LOAD_FAILED"
    assert not (tmp_path / "dest.partial").exists()


def test_cancel_then_resume_in_a_later_call(
    tmp_path: Path, key: KeyInfo, server: ArtifactServer, published: Path
) -> None:
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
    assert_fetched(dest, published)


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
    assert_fetched(tmp_path / "dest", published)


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
