"""Issue 12, trust items 8-9: where a device fetches from and what it loads, with real servers and real ONNX files.

- 8: URL policy per channel (file:// only from the local socket, allowed_urls), generic fetch errors on
  the wire, an overall fetch deadline, cancellation inside a blocking read;
- 9: external data in model-local functions and sparse/tensor attributes is checked like the rest.
(Items 6-7, the demo key and downgrades: test_trust_hardening.py.)
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.fetch import fetch_artifact
from agent.artifacts.urlpolicy import UrlRefused, check_url
from agent.control.control_socket import send_command
from kernel.errors import EdgeError
from tests.deploy_fixtures import make_artifact, wait_terminal
from tests.helpers import wait_for
from tests.http_server import ArtifactServer
from tests.trust_fixtures import agent_starter, deployment_messages, dispatch, key_pair, trust_settings


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


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    return key_pair(tmp_path)


@pytest.fixture
def start_agent() -> Iterator[Any]:
    with agent_starter() as start:
        yield start


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
    ("https://models.example/fleet-evil/manifest.json", "mqtt", {"allowed_urls": ["https://models.example/fleet"]},
     False),
    ("https://models.example.evil.net/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]},
     False),
    ("https://models.example@10.0.0.1/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]},
     False),
    ("https://models.example:8443/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]}, False),
    ("https://models.example:443/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]}, True),
    ("https://models.example/fleet/../admin/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]},
     False),
    ("https://models.example/fleet/%2e%2e/admin/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"]},
     False),
    ("http://models.example/fleet/m.json", "mqtt", {"allowed_urls": ["https://models.example/fleet/"],
                                                    "allow_http": True}, False),
])
def test_url_policy(url: str, channel: str, config: dict, allowed: bool) -> None:
    if allowed:
        check_url(url, ArtifactsConfig(**config), channel)
    else:
        with pytest.raises(UrlRefused) as info:
            check_url(url, ArtifactsConfig(**config), channel)
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
    agent = start_agent(trust_settings(tmp_path, keys, artifacts={"allow_http": True}))
    v2 = make_artifact(tmp_path / "pub" / "v2", "2.0.0", keys["private"])

    # file:// from a remote command: refused in the reply, no deployment; the same URL over the socket works
    reply = dispatch(agent, "deploy", {"url": (v2 / "manifest.json").as_uri()}, "remote-file")
    assert reply["ok"] is False and reply["error"]["code"] == "ARTIFACT_URL_REFUSED"
    assert agent.deployments.latest(5) == []
    missing = dispatch(agent, "deploy", {"url": "file:///etc/no-such-file/manifest.json"}, "probe")
    assert missing["error"]["code"] == "ARTIFACT_URL_REFUSED"  # same answer whether the file exists or not
    reply = send_command(tmp_path / "ctl.sock", "deploy", {"url": (v2 / "manifest.json").as_uri()})
    assert wait_terminal(agent, reply["result"]["deployment_id"]) == "active"

    # an internal service answering 401: the code is kept, the server's words stay in the local log
    with ArtifactServer(tmp_path / "pub") as server:
        server.fail_next("v2/manifest.json", 401)
        reply = dispatch(agent, "deploy", {"url": server.url("v2/manifest.json")}, "internal-401")
        dep_id = reply["result"]["deployment_id"]
        assert wait_terminal(agent, dep_id) == "failed"
    assert agent.deployments.get(dep_id).reason == "ARTIFACT_FETCH_FAILED"
    for text in deployment_messages(agent, dep_id):
        # a word on its own: timestamps, ports and hex ids may hold the digits 401
        assert re.search(r"\b401\b", text) is None and "Unauthorized" not in text, text

    # a server trickling one byte every 2 s: the deployment ends at the command's deadline, rollback is free
    with TrickleServer() as trickle:
        reply = dispatch(agent, "deploy", {"url": trickle.url(), "timeout_s": 2}, "trickle")
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
