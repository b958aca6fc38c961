"""Who may read the dashboard and how it is served: token and basic auth, the Host check against DNS rebinding, the
content security policy, `--bind` and the CLI's store and signals, over a real fleet store and a real uvicorn
server on loopback. The JSON API itself: test_dashboard.py."""

from __future__ import annotations

import base64
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from typer.testing import CliRunner

from deploy.cli import app as deploy_app
from deploy.fleet.dashboard.auth import AuthSettings, allowed_hosts, host_name, settings_from
from deploy.fleet.dashboard.server import exposure_warning, parse_bind
from deploy.fleet.db import open_db
from deploy.fleet.schema import ensure_schema
from tests.dashboard_fixtures import fill_fleet, running_dashboard
from tests.fixtures_mqtt import free_port
from tests.helpers import wait_for


@pytest.fixture
def store(fleet_db_url: str) -> str:
    """The known fleet in a fresh SQLite file or PostgreSQL database (as in test_dashboard.py)."""
    db = open_db(fleet_db_url)
    ensure_schema(db)
    fill_fleet(db, time.time())
    db.close()
    return fleet_db_url


@pytest.fixture
def dash(store: str) -> Iterator[Any]:
    with running_dashboard(store) as dashboard:
        yield dashboard


def test_pages_carry_a_strict_content_security_policy(dash) -> None:
    for path in ("/", "/device?id=x", "/model", "/api/fleet"):
        status, headers, _ = dash.get(path)
        csp = {k.lower(): v for k, v in headers.items()}["content-security-policy"]
        assert status == 200 and "script-src 'self'" in csp and "unsafe-inline" not in csp


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_token_and_basic_auth_guard_everything_but_healthz(store: str) -> None:
    auth = AuthSettings(token="s3cret-token", basic=("ops", "pa:ss"))
    with running_dashboard(store, auth=auth) as dash:
        status, headers, _ = dash.get("/api/fleet")
        assert status == 401 and "Basic" in {k.lower(): v for k, v in headers.items()}["www-authenticate"]
        assert dash.get("/", {"Authorization": "Bearer wrong"})[0] == 401
        assert dash.get("/api/fleet", _basic("ops", "wrong"))[0] == 401
        assert dash.get("/api/fleet", {"Authorization": "Bearer s3cret-token"})[0] == 200
        assert dash.get("/api/fleet", _basic("ops", "pa:ss"))[0] == 200
        assert dash.get("/", _basic("anyone", "s3cret-token"))[0] == 200  # browsers: the token as password
        assert dash.get("/healthz")[0] == 200


def test_a_foreign_host_header_gets_nothing_dns_rebinding(store: str) -> None:
    """Issue 19: with the default set-up (loopback, no token) a web page whose name resolves to 127.0.0.1 could
    read the fleet through the operator's browser. Only loopback names and the ones allowed are answered."""
    with running_dashboard(store) as dash:
        status, _, body = dash.get("/api/fleet", {"Host": f"rebind.example:{dash.port}"})
        assert status == 421 and b"--allow-host" in body and b"orin-01" not in body
        assert dash.get("/", {"Host": "rebind.example"})[0] == 421
        for host in (f"127.0.0.1:{dash.port}", f"localhost:{dash.port}", "LOCALHOST", f"[::1]:{dash.port}"):
            assert dash.get("/api/fleet", {"Host": host})[0] == 200, host
        assert dash.get("/healthz", {"Host": "proxy-probe"})[0] == 200
    with running_dashboard(store, hosts=("fleet.example",)) as dash:
        assert dash.get("/api/fleet", {"Host": "fleet.example"})[0] == 200
        assert dash.get("/api/fleet", {"Host": "other.example"})[0] == 421
    with running_dashboard(store, hosts=("*",)) as dash:
        assert dash.get("/api/fleet", {"Host": "anything.example"})[0] == 200


def test_allowed_hosts_follow_the_bind_address_and_the_environment() -> None:
    assert allowed_hosts("127.0.0.1", (), {}) == ("localhost", "127.0.0.1", "::1")
    assert "10.0.0.5" in allowed_hosts("10.0.0.5", (), {}) and "0.0.0.0" not in allowed_hosts("0.0.0.0", (), {})
    assert {"a.example", "b.example"} <= set(allowed_hosts("0.0.0.0", ("A.example",),
                                                           {"EDGE_DASHBOARD_ALLOWED_HOSTS": "b.example, "}))
    assert host_name("[::1]:8080") == "::1" and host_name("Fleet.Example:443") == "fleet.example"


def test_an_empty_token_variable_is_refused_not_read_as_no_auth() -> None:
    for name in ("EDGE_DASHBOARD_TOKEN", "EDGE_DASHBOARD_BASIC_AUTH"):
        with pytest.raises(ValueError, match=f"{name} is set but empty"):
            settings_from({name: "  "})


def test_auth_settings_from_environment_and_file(tmp_path: Path) -> None:
    assert not settings_from({}).enabled
    assert settings_from({"EDGE_DASHBOARD_BASIC_AUTH": "ops:pw"}).basic == ("ops", "pw")
    with pytest.raises(ValueError, match="EDGE_DASHBOARD_BASIC_AUTH must be 'user:password'"):
        settings_from({"EDGE_DASHBOARD_BASIC_AUTH": "no-colon"})
    token = tmp_path / "token"
    token.write_text("abc\n")
    assert settings_from({}, token_file=token).token == "abc"
    token.write_text("")
    with pytest.raises(ValueError, match="the file is empty"):
        settings_from({}, token_file=token)


def test_bind_parsing_and_exposure_warning() -> None:
    assert parse_bind("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_bind("[::1]:9000") == ("::1", 9000)
    for bad, why in (("8080", "expected HOST:PORT"), ("h:x", "not a number"), ("h:70000", "outside")):
        with pytest.raises(ValueError, match=why):
            parse_bind(bad)
    assert exposure_warning("127.0.0.1", AuthSettings()) is None and exposure_warning("::1", AuthSettings()) is None
    assert "without authentication" in exposure_warning("0.0.0.0", AuthSettings())
    assert "TLS reverse proxy" in exposure_warning("10.0.0.5", AuthSettings(token="t"))


def test_cli_refuses_a_missing_store_and_a_bad_bind(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(deploy_app, ["dashboard", "--db", f"sqlite:///{tmp_path / 'none.db'}"])
    assert result.exit_code == 2 and "no fleet database" in result.stderr
    assert not (tmp_path / "none.db").exists()  # read-only: never creates the store
    (tmp_path / "f.db").touch()
    result = runner.invoke(deploy_app, ["dashboard", "--db", f"sqlite:///{tmp_path / 'f.db'}", "--bind", "nohost"])
    assert result.exit_code == 2 and "expected HOST:PORT" in result.stderr


def test_cli_takes_the_store_from_the_environment_or_a_file_and_masks_passwords(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(deploy_app, ["dashboard"], env={"EDGE_FLEET_DB": f"sqlite:///{tmp_path / 'none.db'}"})
    assert result.exit_code == 2 and "no fleet database" in result.stderr  # the URL came from EDGE_FLEET_DB
    url_file = tmp_path / "db.url"
    url_file.write_text("mysql://fleet:hunter2@db/fleet\n")
    for args, env in ((["--db", "mysql://fleet:hunter2@db/fleet"], {}), (["--db-file", str(url_file)], {}),
                      ([], {"EDGE_FLEET_DB": "mysql://fleet:hunter2@db/fleet"})):
        result = runner.invoke(deploy_app, ["dashboard", *args], env=env)
        assert result.exit_code == 2 and "'mysql://***@db/fleet'" in result.stderr, result.output
        assert "hunter2" not in result.output
    result = runner.invoke(deploy_app, ["dashboard"], env={"EDGE_FLEET_DB": ""})
    assert result.exit_code == 2 and "no fleet store" in result.stderr


def test_pages_load_nothing_from_other_origins() -> None:
    static = Path(__file__).resolve().parents[1] / "deploy" / "fleet" / "dashboard" / "static"
    for page in static.glob("*.html"):
        text = page.read_text()
        refs = re.findall(r'(?:src|href)="([^"]+)"', text)
        assert refs and all(ref.startswith("/") for ref in refs), f"{page.name}: {refs}"
    assert (static / "vendor" / "uplot" / "LICENSE").read_text().startswith("The MIT License")
    assert "1.6.32" in (static / "vendor" / "uplot" / "README.md").read_text()


def test_the_cli_serves_on_loopback_and_stops_on_sigterm(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(store)
    ensure_schema(db)
    fill_fleet(db, time.time())
    db.close()
    port = free_port()
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "dashboard", "--db", store, "--bind",
                             f"127.0.0.1:{port}", "--token-file", str(token)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def fleet_status() -> int | None:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/api/fleet",
                                                 headers={"Authorization": "Bearer t0ken"})
                return urllib.request.urlopen(request, timeout=5).status
            except OSError:
                return None

        assert wait_for(lambda: fleet_status() == 200 or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down cleanly, then re-raises SIGTERM (systemd counts that as a clean stop).
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert f"dashboard on http://127.0.0.1:{port}" in out and "Application shutdown complete" in out
