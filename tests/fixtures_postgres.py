"""A real PostgreSQL server for tests (Debian's `postgresql` package), one per test session.

initdb and postgres refuse to run as root, and the tests run as root in CI: the server then runs as
`nobody` (setpriv) in a temp directory it owns. It listens on 127.0.0.1 on a free port and on a unix
socket in that directory; trust authentication, fsync off (a test server, thrown away at the end).

Fixtures: `postgres_server` (session; stop()/start() for outage tests), `postgres_url` (session: the URL
of a fresh database), `fleet_db_url` (function: a fresh `sqlite:///` file or PostgreSQL database,
parametrized over both; narrow it with `@pytest.mark.parametrize("fleet_db_url", ["sqlite"], indirect=True)`).
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.fixtures_mqtt import free_port

SKIP_REASON = "PostgreSQL is not installed (apt-get install postgresql; `make test` installs it)"
RUN_AS = "nobody"


def postgres_bin_dir() -> Path | None:
    """The newest /usr/lib/postgresql/<version>/bin with initdb, or the directory of initdb on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    """One postgres process on a throw-away data directory; stop()/start() keep port and data."""

    def __init__(self, bin_dir: Path, *, durable: bool = False) -> None:
        self.bin_dir, self.port, self.durable = bin_dir, free_port(), durable
        self.root = Path(tempfile.mkdtemp(prefix="edge-pg-"))
        self.data = self.root / "data"
        self.log_path = self.root / "postgres.log"
        self.proc: subprocess.Popen | None = None
        self._names = itertools.count(1)
        self._user = pwd.getpwnam(RUN_AS) if os.geteuid() == 0 else None
        if self._user is not None:
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        self._run([str(bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                   "--no-sync", "--no-instructions"])

    def _as_user(self, argv: list[str]) -> list[str]:
        if self._user is None:
            return argv
        return ["setpriv", f"--reuid={self._user.pw_uid}", f"--regid={self._user.pw_gid}", "--clear-groups",
                "--reset-env", *argv]

    def _run(self, argv: list[str]) -> None:
        result = subprocess.run(self._as_user(argv), capture_output=True, text=True, timeout=120, cwd=self.root)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {result.stdout}{result.stderr}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self, timeout: float = 30.0) -> None:
        """Start postgres and wait until it accepts connections."""
        assert self.proc is None, "postgres already running"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self._as_user([
            str(self.bin_dir / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.root),
            "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=50", *self._speed_settings(),
        ]), stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"postgres exited at start:\n{self.log_text()}")
            if self._ready():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"postgres did not accept connections within {timeout} s\n{self.log_text()}")

    def _speed_settings(self) -> list[str]:
        """Tests trade durability for speed; a benchmark (durable=True) keeps PostgreSQL's defaults."""
        if self.durable:
            return ["-c", "shared_buffers=128MB"]
        return ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                "-c", "shared_buffers=32MB"]

    def _ready(self) -> bool:
        import psycopg

        try:
            psycopg.connect(self.url(), connect_timeout=1).close()
            return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        """Fast shutdown (SIGINT): connections are cut, like a database restart in production."""
        if self.proc is None:
            return
        self.proc.send_signal(2)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def create_database(self) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        name = f"fleet_test_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop a database made by create_database (closing what is still connected to it)."""
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the whole session (skips when PostgreSQL or psycopg is missing)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip(SKIP_REASON)
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[fleet]')")
    server = PostgresServer(bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        server.remove()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """`postgresql://...` of a fresh database, shared by the session."""
    return postgres_server.create_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def fleet_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty fleet store URL for one test: SQLite file or PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fleet.db'}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    url = server.create_database()
    yield url
    if server.proc is not None:
        server.drop_database(url)
