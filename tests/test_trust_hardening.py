"""Issue 12, trust items 6-9: what a device refuses, checked with real agents, real servers and real ONNX files.

- 6: the on-device demo key never signs a deployment (it stays good for the local demo model);
- 7: no downgrade/replay of an older signed version; no plain http unless configured;
- 8: URL policy per channel (file:// only from the local socket, allowed_urls), generic fetch errors on
  the wire, an overall fetch deadline, cancellation inside a blocking read;
- 9: external data in model-local functions and sparse/tensor attributes is checked like the rest.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.fetch import fetch_artifact
from agent.artifacts.trust import demo_trust, deployment_trust, ensure_demo_key, verify_artifact
from agent.artifacts.urlpolicy import UrlRefused, check_url
from agent.config import AgentConfig
from agent.control.control_socket import send_command
from agent.deployments.versions import VersionMemory, is_older
from agent.daemon.runner import Agent
from agent.state import StateStore, state_db_path
from engines.errors import EdgeError
from tests.deploy_fixtures import agent_settings, make_artifact, make_key, wait_terminal
from tests.helpers import wait_for
from tests.http_server import ArtifactServer


# --- helpers -------------------------------------------------------------------------------------


class TrickleServer:
    """Loopback HTTP server that promises a large body and sends one byte every `interval_s` until stopped."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.started = threading.Event()  # a response is being trickled
        self.release = threading.Event()  # set at stop: handlers end
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet test output
                return

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                owner.started.set()
                try:
                    while not owner.release.wait(owner.interval_s):
                        self.wfile.write(b"{")
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client hung up: what the device should do
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False
        self.server.block_on_close = True  # server_close joins the handler threads
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="test-trickle")

    def url(self, path: str = "manifest.json") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{path}"

    def __enter__(self) -> "TrickleServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def _dispatch(agent: Agent, command: str, args: dict[str, Any], id_: str) -> dict[str, Any]:
    """A request as the MQTT command worker hands it to the dispatcher (channel defaults to mqtt)."""
    assert agent.dispatcher is not None
    return agent.dispatcher.dispatch(json.dumps({"id": id_, "command": command, "args": args}).encode())


def _messages(agent: Agent, dep_id: str) -> list[str]:
    """Every text about a deployment that leaves the device: events and the row the status command shows."""
    texts = [json.dumps(e["payload"]) for e in agent.store.events(200) if e["payload"].get("deployment_id") == dep_id]
    return [*texts, json.dumps(agent.deployments.get(dep_id).to_dict())]


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    private, public = make_key(tmp_path / "keys")
    return {"private": private, "public": public}


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Any]:
    agents: list[Agent] = []

    def start(settings: dict[str, Any]) -> Agent:
        agent = Agent(AgentConfig(**settings))
        agents.append(agent)
        agent.start()
        assert wait_for(lambda: agent.stats.frames >= 2, timeout=120), "loop never produced frames"
        return agent

    yield start
    for agent in agents:
        agent.stop()


def _settings(tmp_path: Path, keys: dict[str, Path], **overrides: Any) -> dict[str, Any]:
    bootstrap = make_artifact(tmp_path / "pub" / "v1", "1.0.0", keys["private"])
    return agent_settings(tmp_path, keys["public"], bootstrap, control={"socket": tmp_path / "ctl.sock"}, **overrides)


# --- 6: the demo key ---------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_mode_agent_refuses_a_deployment_signed_with_its_own_demo_key(tmp_path: Path, keys, start_agent) -> None:
    settings = agent_settings(tmp_path, keys["public"], tmp_path / "unused", control={"socket": tmp_path / "ctl.sock"})
    settings["model"] = {"path": None, "warmup_runs": 1}  # demo mode, with a fleet key configured
    agent = start_agent(settings)
    assert agent.active is not None and agent.active.origin == "demo"
    demo_key = agent.config.state_dir / "keys" / "demo.key"
    forged = make_artifact(tmp_path / "pub" / "forged", "9.0.0", demo_key)

    reply = send_command(tmp_path / "ctl.sock", "deploy", {"url": (forged / "manifest.json").as_uri()})
    assert reply["ok"], reply
    dep_id = reply["result"]["deployment_id"]
    assert wait_terminal(agent, dep_id) == "failed"
    assert agent.deployments.get(dep_id).reason == "ARTIFACT_SIGNATURE_INVALID"
    assert "demo key" in agent.deployments.get(dep_id).message
    assert agent.active.origin == "demo" and agent.active.source.manifest.version == "1.0.0"
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames > frames, timeout=60), "the demo model stopped serving"


def test_demo_key_is_refused_for_deployments_even_when_listed_or_unsigned_allowed(tmp_path: Path, keys) -> None:
    state = tmp_path / "state"
    private, public = ensure_demo_key(state)
    signed = make_artifact(tmp_path / "pub" / "demo-signed", "2.0.0", private)
    listed = deployment_trust(ArtifactsConfig(trusted_keys=[str(public), str(keys["public"])]), state)
    lax = deployment_trust(ArtifactsConfig(trusted_keys=[str(keys["public"])], allow_unsigned=True), state)
    for trust in (listed, lax):
        with pytest.raises(EdgeError) as info:
            verify_artifact(signed, trust, check_model=False)
        assert info.value.code == "ARTIFACT_SIGNATURE_INVALID"
    # the same artifact is fine for the local demo trust, and fleet-signed ones for the deployment trust
    assert verify_artifact(signed, demo_trust(ArtifactsConfig(), state), check_model=False).manifest.version == "2.0.0"
    fleet = make_artifact(tmp_path / "pub" / "fleet", "2.0.0", keys["private"])
    assert verify_artifact(fleet, listed, check_model=False).manifest.version == "2.0.0"
    with pytest.raises(EdgeError):  # and the demo trust accepts nothing but the demo key
        verify_artifact(fleet, demo_trust(ArtifactsConfig(trusted_keys=[str(keys["public"])]), state), check_model=False)


# --- 7: downgrade and plain http -----------------------------------------------------------------


@pytest.mark.parametrize("older,newer", [
    ("1.9.0", "1.10.0"), ("1.0.0", "2.0.0"), ("2.0.0", "2.0.0.1"), ("v1", "v2"),
    ("2.0.0-rc1", "2.0.0"),  # the release after its canary rc
    ("v2.0", "v10.0"), ("2.0", "v10.0.0"),  # numbers, not text; a leading v stripped
    ("2.0.0-1", "2.0.0-rc1"), ("1.0.0-alpha", "1.0.0-alpha.1"), ("1.0.0-alpha.1", "1.0.0-alpha.beta"),
    ("1.0.0-beta.2", "1.0.0-beta.11"), ("1.0.0-rc.1+build.9", "1.0.0+build.1"),  # SemVer 2.0 section 11
])
def test_versions_follow_semver_precedence(older: str, newer: str) -> None:
    assert is_older(older, newer) and not is_older(newer, older) and not is_older(newer, newer)


def test_build_metadata_and_trailing_zeros_do_not_order() -> None:
    for a, b in (("1.0.0+build.1", "1.0.0+build.2"), ("2.0", "2.0.0"), ("v3", "3.0.0")):
        assert not is_older(a, b) and not is_older(b, a)


def test_a_canary_rc_then_its_release_then_a_replay_of_the_rc(tmp_path: Path) -> None:
    memory = VersionMemory(StateStore(state_db_path(tmp_path)))
    memory.record("det", "2.0.0-rc1")
    memory.check("det", "2.0.0", allow_downgrade=False)  # the real release after the canary
    memory.record("det", "2.0.0")
    for replay in ("2.0.0-rc1", "v2.0.0-rc.9"):
        with pytest.raises(EdgeError) as info:
            memory.check("det", replay, allow_downgrade=False)
        assert info.value.code == "ARTIFACT_DOWNGRADE"
    memory.record("det", "v10.0")
    with pytest.raises(EdgeError):
        memory.check("det", "v2.0", allow_downgrade=False)
    memory.state.close()


@pytest.mark.parametrize("version", ["latest", "2.0.0_rc1", "1.0.0-", "release-2"])
def test_a_version_that_cannot_be_ordered_is_refused_clearly(tmp_path: Path, version: str) -> None:
    memory = VersionMemory(StateStore(state_db_path(tmp_path)))
    for highest in (None, "1.0.0"):
        if highest:
            memory.record("det", highest)
        with pytest.raises(EdgeError) as info:
            memory.check("det", version, allow_downgrade=False)
        assert info.value.code == "ARTIFACT_VERSION_INVALID" and "SemVer" in str(info.value)
    memory.check("det", version, allow_downgrade=True)  # a deliberate, local deploy may still do it
    memory.record("det", version)
    assert memory.highest("det") == "1.0.0"
    memory.state.close()


def _manager(tmp_path: Path, store: StateStore, artifacts: ArtifactsConfig) -> Any:
    from agent.deployments.config import DeploymentConfig
    from agent.deployments.manager import DeploymentManager
    from agent.deployments.store import DeploymentStore

    return DeploymentManager(DeploymentStore(store), None, tmp_path / "artifacts", artifacts,  # type: ignore[arg-type]
                             DeploymentConfig(), lambda *a, **f: None, threading.Event())


def test_the_memory_is_seeded_from_the_active_and_previous_models(tmp_path: Path) -> None:
    """An agent upgraded from one without model_versions (or started on a fresh database) refuses the
    first replay too: the active and previous models count as deployed."""
    store = StateStore(state_db_path(tmp_path))
    store.set_active_model("det", "3.0.0", "/models/det3", "aa" * 32, {"origin": "deployment"})
    store.set_active_model("det", "2.0.0", "/models/det2", "bb" * 32, {"origin": "rollback"})
    assert store.query("SELECT * FROM model_versions") == []
    manager = _manager(tmp_path, store, ArtifactsConfig())
    assert manager.versions.highest("det") == "3.0.0"
    with pytest.raises(EdgeError) as info:
        manager.versions.check("det", "2.5.0", allow_downgrade=False)
    assert info.value.code == "ARTIFACT_DOWNGRADE"
    store.close()


@pytest.mark.parametrize("channel,remote_allowed,honoured", [
    ("mqtt", False, False), ("mqtt", True, True), ("local", False, True)])
def test_allow_downgrade_counts_from_the_broker_only_when_configured(tmp_path: Path, keys, channel: str,
                                                                     remote_allowed: bool, honoured: bool) -> None:
    from agent.deployments.manager import RequestOptions

    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", keys["private"])
    store = StateStore(state_db_path(tmp_path))
    artifacts = ArtifactsConfig(trusted_keys=[str(keys["public"])], allow_http=True,
                                allow_remote_downgrade=remote_allowed)
    manager = _manager(tmp_path, store, artifacts)
    manager.versions.record("demo-det", "2.0.0")
    with ArtifactServer(v1.parent) as server:
        url = server.url("v1/manifest.json") if channel == "mqtt" else (v1 / "manifest.json").as_uri()
        dep = manager.store.create(url)
        options = RequestOptions(channel, allow_downgrade=True)  # type: ignore[arg-type]
        if honoured:
            assert manager._fetch(dep, options).is_dir()
        else:
            with pytest.raises(EdgeError) as info:
                manager._fetch(dep, options)
            assert info.value.code == "ARTIFACT_DOWNGRADE"
            assert "only from the local control socket" in str(info.value)
            assert "allow_remote_downgrade" in str(info.value)
    store.close()


def test_highest_version_survives_a_restart_and_a_deliberate_downgrade(tmp_path: Path) -> None:
    store = StateStore(state_db_path(tmp_path))
    VersionMemory(store).record("det", "2.0.0")
    VersionMemory(store).record("det", "1.0.0")  # deployed with allow_downgrade: the high mark stays
    store.close()
    memory = VersionMemory(StateStore(state_db_path(tmp_path)))
    assert memory.highest("det") == "2.0.0" and memory.highest("other") is None
    with pytest.raises(EdgeError) as info:
        memory.check("det", "1.5.0", allow_downgrade=False)
    assert info.value.code == "ARTIFACT_DOWNGRADE"
    memory.check("det", "1.5.0", allow_downgrade=True)
    memory.check("det", "2.0.0", allow_downgrade=False)  # the same version again is a redeploy, not a downgrade
    memory.state.close()


@pytest.mark.slow
def test_older_signed_version_is_refused_unless_allow_downgrade(tmp_path: Path, keys, start_agent,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from agent.cli.main import app

    agent = start_agent(_settings(tmp_path, keys))
    v2 = make_artifact(tmp_path / "pub" / "v2", "2.0.0", keys["private"])
    first = agent.manager.request((v2 / "manifest.json").as_uri(), channel="local")["deployment_id"]
    assert wait_terminal(agent, first) == "active"
    old_url = (tmp_path / "pub" / "v1" / "manifest.json").as_uri()

    refused = send_command(tmp_path / "ctl.sock", "deploy", {"url": old_url})["result"]["deployment_id"]
    assert wait_terminal(agent, refused) == "failed"
    assert agent.deployments.get(refused).reason == "ARTIFACT_DOWNGRADE"
    deployed = agent.config.state_dir / "artifacts" / "deployed"
    assert not list(deployed.glob("demo-det-1.0.0-*")), "the old model was downloaded before the refusal"
    assert agent.active.source.manifest.version == "2.0.0"

    monkeypatch.setenv("EDGE_AGENT_CONTROL__SOCKET", str(tmp_path / "ctl.sock"))  # what the CLI talks to
    result = CliRunner().invoke(app, ["deploy", old_url, "--allow-downgrade", "--wait", "--timeout", "240"])
    assert result.exit_code == 0, result.output
    assert agent.active.source.manifest.version == "1.0.0"
    assert agent.manager.versions.highest("demo-det") == "2.0.0"
    assert agent.manager.request_rollback()["model"]["version"] == "2.0.0"  # rollback stays allowed

    plain = _dispatch(agent, "deploy", {"url": "http://127.0.0.1:9/manifest.json"}, "plain-http")
    assert plain["ok"] is False and plain["error"]["code"] == "ARTIFACT_URL_REFUSED"
    assert "allow_http" in plain["error"]["message"]


# --- 8: URL policy, generic errors, deadline, cancellation -----------------------------------------


@pytest.mark.parametrize("url,channel,config,allowed", [
    ("file:///etc/passwd", "mqtt", {}, False),
    ("file:///srv/models/manifest.json", "local", {}, True),
    ("https://models.example/m/manifest.json", "mqtt", {}, True),
    ("http://models.example/m/manifest.json", "mqtt", {}, False),
    ("http://models.example/m/manifest.json", "mqtt", {"allow_http": True}, True),
    ("ftp://models.example/m/manifest.json", "local", {}, False),
    ("https://models.example/fleet/a/manifest.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]}, True),
    ("https://models.example/fleet/a/manifest.json", "mqtt", {"allowed_urls": ["https://models.example/fleet"]}, True),
    ("https://models.example/fleet-evil/manifest.json", "mqtt", {"allowed_urls": ["https://models.example/fleet"]}, False),
    ("https://models.example.evil.net/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]}, False),
    ("https://models.example@10.0.0.1/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]}, False),
    ("https://models.example:8443/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]}, False),
    ("https://models.example:443/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]}, True),
    ("https://models.example/fleet/../admin/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]}, False),
    ("https://models.example/fleet/%2e%2e/admin/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]},
     False),
    ("http://models.example/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"],
                                                    "allow_http": True}, False),
])
def test_url_policy(url: str, channel: str, config: dict, allowed: bool) -> None:
    if allowed:
        check_url(url, ArtifactsConfig(**config), channel)  # type: ignore[arg-type]
    else:
        with pytest.raises(UrlRefused) as info:
            check_url(url, ArtifactsConfig(**config), channel)  # type: ignore[arg-type]
        assert info.value.code == "ARTIFACT_URL_REFUSED"


def test_allowed_urls_must_be_url_prefixes() -> None:
    with pytest.raises(ValueError, match="allowed_urls"):
        ArtifactsConfig(allowed_urls=["models.example/fleet"])


def test_redirect_out_of_the_allowed_urls_is_refused() -> None:
    import urllib.request

    from agent.artifacts.transport import _PolicyRedirect

    redirect = _PolicyRedirect(ArtifactsConfig(allowed_urls=["https://models.example/fleet/"]))
    request = urllib.request.Request("https://models.example/fleet/manifest.json")
    with pytest.raises(UrlRefused):
        redirect.redirect_request(request, None, 302, "Found", {}, "https://169.254.169.254/latest/meta-data/")
    assert redirect.redirect_request(request, None, 302, "Found", {}, "https://models.example/fleet/v2/m.json")


def test_fetch_of_a_trickling_server_ends_at_its_deadline(tmp_path: Path, keys) -> None:
    config = ArtifactsConfig(trusted_keys=[str(keys["public"])], allow_http=True)
    with TrickleServer() as server:
        with pytest.raises(EdgeError) as info:
            fetch_artifact(server.url(), tmp_path / "dest", config, timeout_s=1.0)
    assert info.value.code == "ARTIFACT_FETCH_TIMEOUT"
    assert not (tmp_path / "dest").exists()


def test_stop_event_cancels_a_read_in_progress(tmp_path: Path, keys) -> None:
    config = ArtifactsConfig(trusted_keys=[str(keys["public"])], allow_http=True)
    stop, outcome = threading.Event(), {}

    def fetch(url: str) -> None:
        try:
            fetch_artifact(url, tmp_path / "dest", config, stop_event=stop)
        except EdgeError as exc:
            outcome["code"] = exc.code

    with TrickleServer() as server:
        worker = threading.Thread(target=fetch, args=(server.url(),), name="test-fetch")
        worker.start()
        assert server.started.wait(30), "the fetch never reached the server"
        stop.set()
        ended = wait_for(lambda: not worker.is_alive(), timeout=30)
    worker.join()
    assert ended, "the fetch kept reading after it was cancelled"
    assert outcome.get("code") == "ARTIFACT_FETCH_CANCELLED"


@pytest.mark.slow
def test_remote_deploy_refusals_deadline_and_generic_errors(tmp_path: Path, keys, start_agent) -> None:
    agent = start_agent(_settings(tmp_path, keys, artifacts={"allow_http": True}))
    v2 = make_artifact(tmp_path / "pub" / "v2", "2.0.0", keys["private"])

    # file:// from a remote command: refused in the reply, no deployment; the same URL over the socket works
    reply = _dispatch(agent, "deploy", {"url": (v2 / "manifest.json").as_uri()}, "remote-file")
    assert reply["ok"] is False and reply["error"]["code"] == "ARTIFACT_URL_REFUSED"
    assert agent.deployments.latest(5) == []
    missing = _dispatch(agent, "deploy", {"url": "file:///etc/no-such-file/manifest.json"}, "probe")
    assert missing["error"]["code"] == "ARTIFACT_URL_REFUSED"  # same answer whether the file exists or not
    reply = send_command(tmp_path / "ctl.sock", "deploy", {"url": (v2 / "manifest.json").as_uri()})
    assert wait_terminal(agent, reply["result"]["deployment_id"]) == "active"

    # an internal service answering 401: the code is kept, the server's words stay in the local log
    with ArtifactServer(tmp_path / "pub") as server:
        server.fail_next("v2/manifest.json", 401)
        reply = _dispatch(agent, "deploy", {"url": server.url("v2/manifest.json")}, "internal-401")
        dep_id = reply["result"]["deployment_id"]
        assert wait_terminal(agent, dep_id) == "failed"
    assert agent.deployments.get(dep_id).reason == "ARTIFACT_FETCH_FAILED"
    for text in _messages(agent, dep_id):
        # a word on its own: timestamps, ports and hex ids may hold the digits 401
        assert re.search(r"\b401\b", text) is None and "Unauthorized" not in text, text

    # a server trickling one byte every 2 s: the deployment ends at the command's deadline, rollback is free
    with TrickleServer() as trickle:
        reply = _dispatch(agent, "deploy", {"url": trickle.url(), "timeout_s": 2}, "trickle")
        dep_id = reply["result"]["deployment_id"]
        assert wait_terminal(agent, dep_id, timeout=60) == "failed"
    assert agent.deployments.get(dep_id).reason == "ARTIFACT_FETCH_TIMEOUT"
    assert agent.manager.request_rollback()["model"]["version"] == "1.0.0"


# --- 9: ONNX external data everywhere ------------------------------------------------------------


def _external(tensor: Any, location: str) -> Any:
    from onnx import TensorProto

    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.ClearField("int64_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    return tensor


def _model(node_in_function: Any | None = None, extra_node: Any | None = None) -> Any:
    """y = x (+ a Constant from a model-local function, or an extra node in the main graph)."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    if node_in_function is not None:
        function = helper.make_function("local", "AddConst", ["a"], ["b"],
                                        [node_in_function, helper.make_node("Add", ["a", "c"], ["b"])],
                                        [helper.make_opsetid("", 17)])
        graph = helper.make_graph([helper.make_node("AddConst", ["x"], ["y"], domain="local")], "g", [x], [y])
        return helper.make_model(graph, opset_imports=opsets, functions=[function])
    nodes = [extra_node, helper.make_node("Identity", ["x"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=opsets[:1])


def _value_tensor(location: str) -> Any:
    from onnx import numpy_helper

    return _external(numpy_helper.from_array(np.ones(1, np.float32), "c"), location)


def _sparse(location: str) -> Any:
    from onnx import helper, numpy_helper

    values = _external(numpy_helper.from_array(np.ones(1, np.float32), "v"), location)
    return helper.make_sparse_tensor(values, numpy_helper.from_array(np.zeros(1, np.int64), "i"), [1])


def _function_attribute_default(location: str, sparse: bool) -> Any:
    """A function Constant whose value is `@cval`; the default of `cval` (attribute_proto) is external."""
    import onnx
    from onnx import helper

    kind = "sparse_value" if sparse else "value"
    reference = onnx.AttributeProto(name=kind, ref_attr_name="cval",
                                    type=onnx.AttributeProto.SPARSE_TENSOR if sparse else onnx.AttributeProto.TENSOR)
    constant = helper.make_node("Constant", [], ["c"])
    constant.attribute.append(reference)
    model = _model(constant)
    default = _sparse(location) if sparse else _value_tensor(location)
    model.functions[0].attribute_proto.append(helper.make_attribute("cval", default))
    return model


def _cases() -> dict[str, Any]:
    from onnx import helper

    return {
        "function_attribute_default": lambda loc: _function_attribute_default(loc, sparse=False),
        "function_sparse_attribute_default": lambda loc: _function_attribute_default(loc, sparse=True),
        "function_constant": lambda loc: _model(helper.make_node("Constant", [], ["c"], value=_value_tensor(loc))),
        "function_sparse_constant": lambda loc: _model(helper.make_node("Constant", [], ["c"],
                                                                        sparse_value=_sparse(loc))),
        "graph_sparse_constant": lambda loc: _model(extra_node=helper.make_node("Constant", [], ["unused"],
                                                                                 sparse_value=_sparse(loc))),
        "tensors_attribute": lambda loc: _model(extra_node=helper.make_node(
            "Custom", [], ["unused"], domain="x.custom", blobs=[_value_tensor(loc)])),
        "sparse_tensors_attribute": lambda loc: _model(extra_node=helper.make_node(
            "Custom", [], ["unused"], domain="x.custom", blobs=[_sparse(loc)])),
    }


@pytest.mark.parametrize("case", ["function_constant", "function_sparse_constant", "graph_sparse_constant",
                                  "tensors_attribute", "sparse_tensors_attribute", "function_attribute_default",
                                  "function_sparse_attribute_default"])
@pytest.mark.parametrize("location", ["../outside.bin", "unlisted.bin"])
def test_external_data_outside_the_manifest_is_refused_wherever_it_hides(tmp_path: Path, case: str,
                                                                         location: str) -> None:
    import onnx

    from agent.artifacts.onnxcheck import check_loads

    model_dir = tmp_path / "artifact"
    model_dir.mkdir()
    (tmp_path / "outside.bin").write_bytes(np.full(1, 7, np.float32).tobytes())
    (model_dir / "unlisted.bin").write_bytes(np.full(1, 7, np.float32).tobytes())
    path = model_dir / "model.onnx"
    onnx.save(_cases()[case](location), str(path))
    with pytest.raises(EdgeError) as info:
        check_loads(path, "model.onnx", listed=[])
    assert info.value.code == "ARTIFACT_PATH_INVALID" and location in str(info.value)


def test_listed_external_data_in_a_function_still_loads(tmp_path: Path) -> None:
    """The walk refuses only what is unlisted: a function Constant with listed external data is accepted."""
    import onnx

    from agent.artifacts.onnxcheck import check_loads, external_data_locations

    path = tmp_path / "model.onnx"
    (tmp_path / "weights.bin").write_bytes(np.ones(1, np.float32).tobytes())
    from onnx import helper

    model = _model(helper.make_node("Constant", [], ["c"], value=_value_tensor("weights.bin")))
    onnx.save(model, str(path))
    assert external_data_locations(onnx.load(str(path), load_external_data=False)) == {"weights.bin"}
    check_loads(path, "model.onnx", listed=["weights.bin"])
