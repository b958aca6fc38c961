"""Download an artifact (manifest, signature, files) into place, resumable, verified before it appears.

Layout while fetching `dest_dir`: everything goes to `dest_dir.partial/`, each file first to
`.incoming/<sha256>.part` (resumed with HTTP Range after a broken connection), then fsync'ed and
renamed to its name. Only when the whole directory passes `verify_artifact` is it renamed to
`dest_dir`, so `dest_dir` existing means a complete, verified artifact.

Every URL passes the URL policy of the requesting channel (agent.artifacts.urlpolicy). A whole fetch
has one deadline (`artifacts.fetch_timeout_s`, shortened by `timeout_s`); a watcher thread shuts the
connection down when the deadline passes or the stop event is set, so neither waits for a slow server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import Callable, Iterator
from urllib.parse import quote, urljoin, urlsplit, urlunsplit

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.keys import MAX_SIG_BYTES
from agent.artifacts.layout import MAX_MANIFEST_BYTES, SIG_NAME
from agent.artifacts.throttle import Progress, ProgressCallback, TokenBucket, cancelled
from agent.artifacts.transport import (
    FetchError,
    NotFoundError,
    RangeNotSatisfiable,
    Response,
    Retryable,
    Transport,
)
from agent.artifacts.trust import (
    MIB,
    check_signature,
    check_size_cap,
    parse_verified_manifest,
    unique_entries,
    verify_artifact,
)
from agent.artifacts.urlpolicy import LOCAL, Channel
from kernel.errors import EdgeError
from kernel.fsutil import atomic_write_bytes, fsync_dir
from engines.model.manifest import MANIFEST_NAME, ArtifactHashError, Manifest, ModelFile, sha256_file

log = logging.getLogger(__name__)
CHUNK = 64 * 1024
MAX_BACKOFF_S = 60.0
INCOMING = ".incoming"
# A trusted-key config problem or a signed model that cannot load is not fixed by downloading it again.
NOT_REFETCHABLE = {"KEY_INVALID", "MODEL_LOAD_FAILED"}
WATCH_INTERVAL_S = 0.1
ManifestCheck = Callable[[Manifest], None]


class FetchTimeout(FetchError):
    """The fetch did not finish before its deadline (artifacts.fetch_timeout_s or the command's timeout_s)."""

    code = "ARTIFACT_FETCH_TIMEOUT"


def fetch_artifact(
    manifest_url: str,
    dest_dir: Path,
    config: ArtifactsConfig,
    on_progress: ProgressCallback | None = None,
    stop_event: threading.Event | None = None,
    *,
    channel: Channel = LOCAL,
    timeout_s: float | None = None,
) -> Path:
    """Fetch, verify and atomically publish an artifact at `dest_dir`; an existing verified one is reused."""
    dest_dir = Path(dest_dir)
    if dest_dir.exists() and _reusable(dest_dir, config):
        return dest_dir
    fetcher = _Fetcher(config, stop_event or threading.Event(), channel, timeout_s)
    with fetcher.watching():
        remote = _remote_manifest(fetcher, manifest_url, config)
        return _download_artifact(fetcher, remote, dest_dir, on_progress)


def fetch_into(
    manifest_url: str,
    store_dir: Path,
    config: ArtifactsConfig,
    on_progress: ProgressCallback | None = None,
    stop_event: threading.Event | None = None,
    *,
    channel: Channel = LOCAL,
    timeout_s: float | None = None,
    check_manifest: ManifestCheck | None = None,
) -> Path:
    """Like fetch_artifact into `store_dir/<name>-<version>-<manifest sha256[:16]>` (content-addressed).

    A URL republished with new content gets a new directory instead of reusing (or overwriting) the
    old one, which may be the active model. Costs one manifest request even when nothing changed.
    `check_manifest` sees the verified manifest before any file is downloaded (e.g. the downgrade rule).
    """
    fetcher = _Fetcher(config, stop_event or threading.Event(), channel, timeout_s)
    with fetcher.watching():
        remote = _remote_manifest(fetcher, manifest_url, config)
        if check_manifest is not None:
            check_manifest(remote.manifest)
        dest_dir = Path(store_dir) / artifact_dirname(remote.manifest, remote.manifest_bytes)
        if dest_dir.exists() and _reusable(dest_dir, config):
            return dest_dir
        return _download_artifact(fetcher, remote, dest_dir, on_progress)


def artifact_dirname(manifest: Manifest, manifest_bytes: bytes) -> str:
    """`name-version-<16 hex of sha256(manifest bytes)>`: readable, and unique per signed content."""
    return f"{manifest.name}-{manifest.version}-{hashlib.sha256(manifest_bytes).hexdigest()[:16]}"


@dataclass(frozen=True)
class _Remote:
    url: str
    manifest_bytes: bytes
    sig_bytes: bytes | None
    manifest: Manifest


def _remote_manifest(fetcher: "_Fetcher", manifest_url: str, config: ArtifactsConfig) -> _Remote:
    """Download manifest + signature and refuse them before any artifact file is requested."""
    url = manifest_url if not manifest_url.endswith("/") else manifest_url + MANIFEST_NAME
    manifest_bytes, sig_bytes = fetcher.get_manifest(url)
    check_signature(manifest_bytes, sig_bytes, config)  # before a single byte of JSON is parsed
    manifest = parse_verified_manifest(manifest_bytes, url)
    check_size_cap(manifest, config)
    return _Remote(url, manifest_bytes, sig_bytes, manifest)


def _download_artifact(
    fetcher: "_Fetcher", remote: _Remote, dest_dir: Path, on_progress: ProgressCallback | None
) -> Path:
    """Files into `dest_dir.partial/`, full verification, then one rename to `dest_dir`."""
    partial = _prepare_partial(dest_dir, remote.manifest_bytes, remote.sig_bytes)
    entries = unique_entries(remote.manifest)
    _check_disk(partial, entries, fetcher.config)
    fetcher.progress = Progress(on_progress, sum(e.size for e in entries))
    for entry in entries:
        fetcher.fetch_file(file_url(remote.url, entry.file), partial, entry)
    shutil.rmtree(partial / INCOMING, ignore_errors=True)
    try:
        verify_artifact(partial, fetcher.config)
    except EdgeError as exc:  # every file matched its hash, so refetching cannot help: free the disk
        log.error("fetched artifact %s failed verification (%s); removing %s", remote.url, exc.code, partial)
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, dest_dir)
    fsync_dir(dest_dir.parent)
    log.info("fetched %s@%s from %s into %s", remote.manifest.name, remote.manifest.version, remote.url, dest_dir)
    return dest_dir


def _reusable(dest_dir: Path, config: ArtifactsConfig) -> bool:
    """A verified dest_dir is the answer; a damaged one is quarantined (kept for inspection) and fetched again."""
    try:
        verify_artifact(dest_dir, config)
        return True
    except EdgeError as exc:
        if exc.code in NOT_REFETCHABLE:  # same bytes again would fail the same way: report, move nothing
            raise
        aside = dest_dir.with_name(f"{dest_dir.name}.quarantine-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        log.warning("%s exists but fails verification (%s: %s); moved to %s", dest_dir, exc.code, exc, aside)
        os.rename(dest_dir, aside)
        return False


def file_url(manifest_url: str, name: str) -> str:
    """URL of an artifact file, relative to the manifest's directory; the name was checked before."""
    base = urlunsplit(urlsplit(manifest_url)._replace(query="", fragment=""))
    url = urljoin(base, quote(name))
    if not url.startswith(urljoin(base, ".")):
        raise FetchError(f"{name!r} resolves outside the artifact ({url})", code="ARTIFACT_PATH_INVALID")
    return url


def sig_url(manifest_url: str) -> str:
    """`.../manifest.json` -> `.../manifest.json.sig` (query and fragment dropped)."""
    parts = urlsplit(manifest_url)
    return urlunsplit(parts._replace(path=parts.path + ".sig", query="", fragment=""))


def _prepare_partial(dest_dir: Path, manifest_bytes: bytes, sig_bytes: bytes | None) -> Path:
    """The staging directory; leftovers from a fetch of a *different* manifest are discarded."""
    partial = dest_dir.with_name(dest_dir.name + ".partial")
    old = partial / MANIFEST_NAME
    if partial.exists() and (not old.is_file() or old.read_bytes() != manifest_bytes):
        shutil.rmtree(partial)
    (partial / INCOMING).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(partial / MANIFEST_NAME, manifest_bytes)
    if sig_bytes is not None:
        atomic_write_bytes(partial / SIG_NAME, sig_bytes)
    else:
        (partial / SIG_NAME).unlink(missing_ok=True)
    return partial


def _present_bytes(partial: Path, entry: ModelFile) -> int:
    """Bytes of `entry` already on disk (finished file or partial download)."""
    for path in (partial / entry.file, partial / INCOMING / f"{entry.sha256}.part"):
        if path.is_file() and not path.is_symlink():
            return min(path.stat().st_size, entry.size)
    return 0


def _check_disk(partial: Path, entries: list[ModelFile], config: ArtifactsConfig) -> None:
    """Refuse to start a download that would leave less than `min_free_mb` free."""
    needed = sum(entry.size - _present_bytes(partial, entry) for entry in entries)
    free = shutil.disk_usage(partial).free
    if free - needed < config.min_free_mb * MIB:
        raise EdgeError(
            f"not enough disk space in {partial.parent}: the artifact needs {needed / MIB:.1f} MiB more and "
            f"{config.min_free_mb} MiB must stay free (artifacts.min_free_mb); {free / MIB:.1f} MiB free",
            code="ARTIFACT_NO_SPACE",
        )


class _Fetcher:
    """Downloads with retries, backoff, resume and an optional bandwidth cap."""

    def __init__(self, config: ArtifactsConfig, stop: threading.Event, channel: Channel = LOCAL,
                 timeout_s: float | None = None) -> None:
        self.config, self.stop = config, stop
        self.timeout_s = min(config.fetch_timeout_s, timeout_s if timeout_s is not None else config.fetch_timeout_s)
        self.deadline = time.monotonic() + self.timeout_s
        self.transport = Transport(config, channel)
        self.progress = Progress(None, 0)
        self.bucket: TokenBucket | None = None
        if config.bandwidth_limit_kbps:
            rate = config.bandwidth_limit_kbps * 125.0  # kbit/s -> bytes/s
            self.bucket = TokenBucket(rate, capacity=max(1024.0, min(rate / 4, CHUNK)))
        self.chunk = int(min(CHUNK, self.bucket.capacity)) if self.bucket else CHUNK
        self.validators: dict[str, str] = {}

    def check(self) -> None:
        """Raise when the fetch was cancelled (stop event) or its deadline has passed."""
        if self.stop.is_set():
            raise cancelled()
        if time.monotonic() >= self.deadline:
            raise FetchTimeout(f"the artifact download did not finish within {self.timeout_s:g} s "
                               "(deploy timeout_s or artifacts.fetch_timeout_s)")

    def _sleep(self, delay: float) -> None:
        """Wait `delay` seconds, or less when stopped or when the deadline comes first."""
        self.stop.wait(max(0.0, min(delay, self.deadline - time.monotonic())))
        self.check()

    @contextmanager
    def watching(self) -> Iterator[None]:
        """While the block runs, a watcher aborts the connections once cancelled or overdue."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(WATCH_INTERVAL_S):
                if self.stop.is_set() or time.monotonic() >= self.deadline:
                    self.transport.abort()  # again each tick: a new connection may have opened meanwhile

        watcher = threading.Thread(target=watch, name="fetch-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()

    def get_manifest(self, manifest_url: str) -> tuple[bytes, bytes | None]:
        """manifest.json (required) and manifest.json.sig (absent: unsigned, trust decides)."""
        manifest = self._get_small(manifest_url, MAX_MANIFEST_BYTES)
        try:
            sig = self._get_small(sig_url(manifest_url), MAX_SIG_BYTES)
        except NotFoundError:
            sig = None
        return manifest, sig

    def _get_small(self, url: str, cap: int) -> bytes:
        return self._with_retries(url, lambda: self._read_small(url, cap))

    def _read_small(self, url: str, cap: int) -> bytes:
        response = self.transport.open(url)
        try:
            data = bytearray()
            while len(data) <= cap and (block := response.read(CHUNK)):
                data += block
            expected = response.header("Content-Length")
        finally:
            response.close()
        self.check()  # an abort ends the body early; without Content-Length that would look complete
        if len(data) > cap:
            raise EdgeError(f"{url}: over the {cap}-byte limit for this file", code="ARTIFACT_TOO_LARGE")
        if expected is not None and expected.isdigit() and int(expected) != len(data):
            raise Retryable(f"{url}: connection closed after {len(data)} of {expected} bytes")
        return bytes(data)

    def _with_retries(self, url: str, attempt: Callable[[], bytes]) -> bytes:
        failures = 0
        while True:
            self.check()
            try:
                return attempt()
            except Retryable as exc:
                failures += 1
                self._backoff(url, failures, exc)

    def _backoff(self, url: str, failures: int, exc: Exception) -> None:
        """Sleep before the next attempt, or give up once `retries` attempts in a row made no progress."""
        self.check()  # an aborted connection looks like a dropped one: say why it really ended
        if failures > self.config.retries:
            raise FetchError(f"{url}: giving up after {failures} failed attempts: {exc}") from exc
        delay = min(MAX_BACKOFF_S, self.config.retry_backoff_s * 2 ** (failures - 1)) if failures else 0.0
        log.warning("fetch %s: %s; retry %d/%d in %.1fs", url, exc, failures, self.config.retries, delay)
        self._sleep(delay)

    def fetch_file(self, url: str, partial: Path, entry: ModelFile) -> None:
        """One listed file, verified by sha256; a resumed download that does not match is redone from zero."""
        final = partial / entry.file
        if final.is_file() and not final.is_symlink() and final.stat().st_size == entry.size:
            if sha256_file(final) == entry.sha256:
                self.progress.update(entry.file, entry.size, entry.size, final=True)
                return
        part = partial / INCOMING / f"{entry.sha256}.part"
        resumed = self._download(url, part, entry)
        if sha256_file(part) != entry.sha256 and resumed:
            log.warning("%s: resumed download does not match its sha256; downloading again from zero", entry.file)
            part.unlink()
            self._download(url, part, entry)
        if (actual := sha256_file(part)) != entry.sha256:
            part.unlink()
            raise ArtifactHashError(f"{entry.file} from {url}: sha256 {actual[:12]}… != manifest {entry.sha256[:12]}…")
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
        fsync_dir(final.parent)
        self.progress.update(entry.file, entry.size, entry.size, final=True)

    def _download(self, url: str, part: Path, entry: ModelFile) -> bool:
        """Fill `part` up to entry.size; return True when any byte came from a resumed (Range) request."""
        failures, resumed = 0, False
        while True:
            self.check()
            before = _part_size(part, entry.size)
            if before == entry.size:
                return resumed
            try:
                resumed |= self._attempt(url, part, entry, before)
            except RangeNotSatisfiable as exc:  # the partial file cannot be continued: start over
                part.unlink(missing_ok=True)
                failures += 1
                self._backoff(url, failures, exc)
            except Retryable as exc:
                failures = 0 if _part_size(part, entry.size) > before else failures + 1
                self._backoff(url, failures, exc)

    def _attempt(self, url: str, part: Path, entry: ModelFile, offset: int) -> bool:
        """One request; returns whether it continued from `offset` > 0."""
        response = self.transport.open(url, offset, self.validators.get(url))
        try:
            start = self._start_offset(response, url, entry, offset)
            self._remember_validator(url, response)
            self._stream(response, part, entry, start)
        finally:
            response.close()
        return start > 0

    def _start_offset(self, response: Response, url: str, entry: ModelFile, offset: int) -> int:
        """206 continues at `offset`; 200 (Range ignored, or If-Range saw a changed file) restarts at 0."""
        if response.status == 206 and offset:
            if _content_range_start(response.header("Content-Range"), entry.size) != offset:
                raise RangeNotSatisfiable(f"{url}: unexpected Content-Range {response.header('Content-Range')!r}")
            return offset
        length = response.header("Content-Length")
        if length is not None and length.isdigit() and int(length) != entry.size:
            raise ArtifactHashError(
                f"{entry.file}: server sends {length} bytes, manifest says {entry.size}", code="ARTIFACT_SIZE_MISMATCH"
            )
        if offset:
            log.info("%s: server ignored the Range request; restarting from 0", url)
        return 0

    def _remember_validator(self, url: str, response: Response) -> None:
        etag = response.header("ETag")
        if etag and not etag.startswith("W/"):  # If-Range needs a strong validator
            self.validators[url] = etag
        elif last_modified := response.header("Last-Modified"):
            self.validators.setdefault(url, last_modified)

    def _stream(self, response: Response, part: Path, entry: ModelFile, start: int) -> None:
        """Append the body to `part` from `start`; fsync at the end (and on interruption, to keep the bytes)."""
        have = start
        with open(part, "r+b" if part.exists() else "wb") as fh:
            fh.truncate(start)
            fh.seek(start)
            try:
                while have < entry.size:
                    self.check()
                    block = response.read(min(self.chunk, entry.size - have))
                    if not block:
                        raise Retryable(f"{entry.file}: connection closed after {have} of {entry.size} bytes")
                    fh.write(block)
                    have += len(block)
                    if self.bucket is not None:
                        self.bucket.consume(len(block), self.stop)
                    self.progress.update(entry.file, have, entry.size)
            finally:
                fh.flush()
                os.fsync(fh.fileno())


def _part_size(part: Path, size: int) -> int:
    """Bytes already in a partial file; one longer than expected is garbage and starts over."""
    if not part.exists():
        return 0
    have = part.stat().st_size
    if have > size:
        part.unlink()
        return 0
    return have


def _content_range_start(value: str | None, size: int) -> int | None:
    """Start of `bytes START-END/TOTAL`, or None when malformed or for another total size."""
    try:
        unit, _, rest = (value or "").partition(" ")
        span, _, total = rest.partition("/")
        start = int(span.split("-")[0])
    except ValueError:
        return None
    if unit != "bytes" or (total not in ("*", str(size))):
        return None
    return start
