"""Command dispatcher: every command, every error code, idempotent ids, and a hypothesis fuzz.

The daemon is played by `FakeControl` (tests/fixtures_mqtt.py), the only fake here.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.control.commands import COMMANDS, CommandDispatcher
from tests.fixtures_mqtt import FakeControl

LIMIT = 4096
NO_ARGS = ("ping", "status", "rollback", "engines")
OPTIONAL_ARGS = ("restart_pipeline", "promote", "cancel")  # valid without args too


@pytest.fixture
def control() -> FakeControl:
    return FakeControl()


@pytest.fixture
def dispatcher(tmp_path: Path, control: FakeControl) -> Any:
    d = CommandDispatcher(control, tmp_path / "state.db", max_payload_bytes=LIMIT)
    yield d
    d.close()


def _send(dispatcher: CommandDispatcher, command: str, args: Any = None, id: str = "req-1") -> dict:
    body: dict[str, Any] = {"id": id, "command": command}
    if args is not None:
        body["args"] = args
    reply = dispatcher.dispatch(json.dumps(body).encode())
    json.dumps(reply)  # every reply must be sendable
    return reply


def test_table_has_the_contract_commands() -> None:
    assert set(COMMANDS.names()) == {"ping", "status", "deploy", "rollback", "set_config", "engines",
                                     "restart_pipeline", "set_policy", "snapshot", "promote", "cancel", "set_zones"}


@pytest.mark.parametrize(("command", "args", "call", "result_key"), [
    ("ping", None, None, "pong"),
    ("status", {}, ("status", None), "state"),
    ("deploy", {"url": "https://models/m.json"}, ("deploy", ("https://models/m.json", None)), "deployment_id"),
    ("deploy", {"url": "file:///m.json", "timeout_s": 30}, ("deploy", ("file:///m.json", 30.0)), "accepted"),
    ("rollback", None, ("rollback", None), "accepted"),
    ("set_config", {"telemetry_interval_s": 1, "log_level": "DEBUG"},
     ("set_config", {"telemetry_interval_s": 1.0, "log_level": "DEBUG"}), "applied"),
    ("engines", None, ("engines", None), "engines"),
    ("restart_pipeline", None, ("restart_pipeline", None), "restarted"),
    ("restart_pipeline", {"camera": "dock-2"}, ("restart_pipeline", "dock-2"), "restarted"),
])
def test_each_command_runs_its_handler(dispatcher: CommandDispatcher, control: FakeControl, command: str,
                                       args: Any, call: Any, result_key: str) -> None:
    reply = _send(dispatcher, command, args)
    assert reply["ok"] is True and reply["id"] == "req-1" and result_key in reply["result"]
    assert control.calls == ([call] if call else [])


@pytest.mark.parametrize(("payload", "code", "in_message", "echo"), [
    (b"x" * (LIMIT + 1), "PAYLOAD_TOO_LARGE", f"is {LIMIT + 1} bytes; the limit is {LIMIT}", None),
    (b"{not json", "INVALID_JSON", "not valid JSON", None),
    (b"\xff\xfe", "INVALID_JSON", "not UTF-8", None),
    (b"NaN", "INVALID_JSON", "NaN is not valid JSON", None),
    (b"[" * 2000 + b"]" * 2000, "INVALID_JSON", "", None),
    (b'["ping"]', "INVALID_COMMAND", "must be a JSON object", None),
    (b'"ping"', "INVALID_COMMAND", "got a string", None),
    (b'{"command": "ping"}', "INVALID_COMMAND", "id: Field required", None),
    (b'{"id": 7, "command": "ping"}', "INVALID_COMMAND", "id: Input should be a valid string", None),
    (b'{"id": "a"}', "INVALID_COMMAND", "command: Field required", "a"),
    (b'{"id": "a", "command": "ping", "sig": "x"}', "INVALID_COMMAND", "sig: Extra inputs are not permitted", "a"),
    (b'{"id": "a", "command": "ping", "args": []}', "INVALID_COMMAND", "args: Input should be a valid dictionary", "a"),
    (b'{"id": "a", "command": "reboot"}', "UNKNOWN_COMMAND",
     "unknown command 'reboot' (available: cancel, deploy", "a"),
    (b'{"id": "a", "command": "ping", "args": {"x": 1}}', "INVALID_COMMAND", "args.x: Extra inputs", "a"),
    (b'{"id": "a", "command": "deploy", "args": {}}', "INVALID_COMMAND", "args.url: Field required", "a"),
    (b'{"id": "a", "command": "deploy", "args": {"url": "u", "timeout_s": "10"}}', "INVALID_COMMAND",
     "args.timeout_s: Input should be a valid number", "a"),
    (b'{"id": "a", "command": "deploy", "args": {"url": "u", "timeout_s": -1}}', "INVALID_COMMAND",
     "args.timeout_s: Input should be greater than 0", "a"),
    (b'{"id": "a", "command": "set_config", "args": {}}', "INVALID_COMMAND", "give at least one of", "a"),
    (b'{"id": "a", "command": "set_config", "args": {"log_level": "LOUD"}}', "INVALID_COMMAND", "args.log_level", "a"),
    (b'{"id": "a", "command": "set_config", "args": {"prefix": "x"}}', "INVALID_COMMAND",
     "args.prefix: Extra inputs", "a"),
    (b'{"id": "\\ud800", "command": "ping"}', "INVALID_COMMAND", "id:", None),
    (b'{"id": "a", "command": "restart_pipeline", "args": {"camera": "dock 2"}}', "INVALID_COMMAND",
     "args.camera: String should match pattern", "a"),
])
def test_error_codes_and_messages(dispatcher: CommandDispatcher, control: FakeControl, payload: bytes, code: str,
                                  in_message: str, echo: Any) -> None:
    reply = dispatcher.dispatch(payload)
    assert reply["ok"] is False and reply["error"]["code"] == code and reply["id"] == echo
    assert in_message in reply["error"]["message"]
    assert control.calls == []
    json.dumps(reply)


def test_edge_error_keeps_its_code(dispatcher: CommandDispatcher, control: FakeControl) -> None:
    control.fail_rollback = True
    reply = _send(dispatcher, "rollback")
    assert reply["error"] == {"code": "NO_PREVIOUS_MODEL", "message": "no previous model to roll back to"}


def test_other_exceptions_are_internal_and_logged(dispatcher: CommandDispatcher, control: FakeControl,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    control.crash_engines = True
    with caplog.at_level(logging.ERROR, logger="agent.control.commands"):
        reply = _send(dispatcher, "engines")
    assert reply["error"]["code"] == "INTERNAL" and "unreadable" not in reply["error"]["message"]
    ref = reply["error"]["message"].rsplit("ref ", 1)[1]  # the detail is in the log under the same ref
    assert "command engines (id req-1) crashed" in caplog.text and ref in caplog.text


def test_unserialisable_result_is_internal(dispatcher: CommandDispatcher, control: FakeControl) -> None:
    control.status = lambda: {"when": object()}
    assert _send(dispatcher, "status")["error"]["code"] == "INTERNAL"


def test_repeated_id_gets_first_reply_without_running_again(dispatcher: CommandDispatcher,
                                                            control: FakeControl) -> None:
    first = _send(dispatcher, "deploy", {"url": "https://m"}, id="once")
    again = _send(dispatcher, "deploy", {"url": "https://other"}, id="once")
    also = _send(dispatcher, "ping", None, id="once")
    assert first == again == also and control.calls == [("deploy", ("https://m", None))]


def test_replies_survive_a_restart(tmp_path: Path, control: FakeControl) -> None:
    first = CommandDispatcher(control, tmp_path / "s.db")
    reply = _send(first, "rollback", id="r-1")
    first.close()
    second = CommandDispatcher(control, tmp_path / "s.db")
    assert _send(second, "rollback", id="r-1") == reply and len(control.calls) == 1
    second.close()


def test_rejected_request_is_not_remembered(dispatcher: CommandDispatcher, control: FakeControl) -> None:
    assert _send(dispatcher, "deploy", {"url": 5}, id="fix-me")["ok"] is False
    assert _send(dispatcher, "deploy", {"url": "https://m"}, id="fix-me")["ok"] is True


def test_reply_window_is_bounded_by_count_and_age(tmp_path: Path, control: FakeControl) -> None:
    small = CommandDispatcher(control, tmp_path / "s.db", reply_window=3)
    for i in range(5):
        _send(small, "restart_pipeline", id=f"id-{i}")
    _send(small, "restart_pipeline", id="id-0")  # fell out of the window: runs again
    _send(small, "restart_pipeline", id="id-4")  # still inside: not run
    assert len(control.calls) == 6
    small.close()
    old = CommandDispatcher(control, tmp_path / "o.db", reply_max_age_s=0.0)
    _send(old, "restart_pipeline", id="x")
    _send(old, "restart_pipeline", id="x")
    assert len(control.calls) == 8
    old.close()


def test_same_id_while_running_is_busy(dispatcher: CommandDispatcher, control: FakeControl) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_status() -> dict:
        entered.set()
        release.wait(5)
        return {"state": "online"}

    control.status = slow_status
    first: list[dict] = []
    worker = threading.Thread(target=lambda: first.append(_send(dispatcher, "status", id="slow")))
    worker.start()
    assert entered.wait(5)
    assert _send(dispatcher, "status", id="slow")["error"]["code"] == "BUSY"
    release.set()
    worker.join(5)
    assert first[0]["ok"] is True


# --- fuzzing ------------------------------------------------------------------------------------

class Oracle:
    """Independent statement of the rules: which code a payload must get (and which id echoes)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.executed = limit, {}  # type: dict[str, dict]

    def expect(self, payload: bytes) -> tuple[Any, str]:
        if len(payload) > self.limit:
            return None, "PAYLOAD_TOO_LARGE"
        try:
            data = json.loads(payload.decode("utf-8"), parse_constant=_no_constants)
        except (ValueError, RecursionError):
            return None, "INVALID_JSON"
        if not isinstance(data, dict):
            return None, "INVALID_COMMAND"
        rid, cmd, args = data.get("id"), data.get("command"), data.get("args", {})
        readable = isinstance(rid, str) and 1 <= len(rid) <= 128 and _utf8(rid)
        if not (readable and set(data) <= {"id", "command", "args"} and isinstance(cmd, str)
                and 1 <= len(cmd) <= 64 and isinstance(args, dict)):
            return (rid if readable else None), "INVALID_COMMAND"
        if rid in self.executed:
            return rid, self.executed[rid]
        if cmd not in COMMANDS:
            return rid, "UNKNOWN_COMMAND"
        if not _args_ok(cmd, args):
            return rid, "INVALID_COMMAND"
        self.executed[rid] = "OK"
        return rid, "OK"


def _no_constants(name: str) -> Any:
    raise ValueError(name)


def _utf8(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


def _number(value: Any, low: float, high: float, low_open: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return (low < value if low_open else low <= value) and value <= high
    except OverflowError:
        return False


def _args_ok(cmd: str, args: dict) -> bool:
    if cmd in NO_ARGS:
        return args == {}
    if cmd == "restart_pipeline":
        camera = args.get("camera")
        return set(args) <= {"camera"} and (
            camera is None or (isinstance(camera, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", camera) is not None)
        )
    if cmd in ("promote", "cancel"):
        dep = args.get("deployment_id")
        return set(args) <= {"deployment_id"} and (dep is None or (isinstance(dep, str) and 1 <= len(dep) <= 64))
    if cmd == "snapshot":
        camera, overlay = args.get("camera"), args.get("overlay", True)
        return set(args) <= {"camera", "overlay"} and isinstance(overlay, bool) and (
            camera is None or (isinstance(camera, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", camera) is not None))
    if (
        cmd == "set_zones"
    ):  # needs zones, lines or revert, which the fuzzed keys never hold (tests/test_tracking_host.py)
        return False
    if cmd == "deploy":
        url, timeout = args.get("url"), args.get("timeout_s")
        return (set(args) <= {"url", "timeout_s"} and isinstance(url, str) and 1 <= len(url) <= 2048
                and _utf8(url) and (timeout is None or _number(timeout, 0, 86400, low_open=True)))
    allowed = {"telemetry_interval_s": lambda v: _number(v, 0.1, 3600), "results_rate_hz": lambda v: _number(v, 0, 100),
               "log_level": lambda v: v in ("DEBUG", "INFO", "WARNING", "ERROR")}
    if not set(args) <= set(allowed):
        return False
    given_values = {k: v for k, v in args.items() if v is not None}
    return bool(given_values) and all(allowed[k](v) for k, v in given_values.items())


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
arg_keys = st.sampled_from(["url", "timeout_s", "telemetry_interval_s", "results_rate_hz", "log_level", "camera",
                            "overlay", "x"])
arg_values = json_values | st.sampled_from(["INFO", "DEBUG", "LOUD", "https://m/manifest.json", "", "cam0", "dock 2",
                                            "x" * 33]) | st.floats(-1, 5000)
envelopes = st.fixed_dictionaries({}, optional={
    "id": st.text(max_size=140) | st.integers() | st.none() | st.sampled_from(["dup-1", "dup-2"]),
    "command": st.sampled_from(sorted(COMMANDS.names()) + ["reboot", ""]) | st.text(max_size=70),
    "args": st.just({}) | st.dictionaries(arg_keys, arg_values, max_size=3) | json_values,
    "extra": json_values,
})
valid = st.builds(lambda i, c: {"id": str(i), "command": c}, st.uuids(), st.sampled_from(NO_ARGS + OPTIONAL_ARGS))
encoded = (envelopes | valid).map(lambda d: json.dumps(d).encode())
payloads = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    encoded,
    encoded.flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n])),  # truncated
    encoded.map(lambda b: b + b" " * LIMIT),  # oversized
)


def check_reply(reply: dict, expected: tuple[Any, str]) -> None:
    """Assert the reply's shape, code and echoed id against the oracle."""
    rid, code = expected
    json.dumps(reply)
    assert reply["id"] == rid, (reply, expected)
    if code == "OK":
        assert reply["ok"] is True and "result" in reply, reply
    else:
        assert reply["ok"] is False and reply["error"]["code"] == code, (reply, expected)
        assert reply["error"]["message"]


def test_fuzz_dispatch(tmp_path: Path) -> None:
    from agent.control.commands import COMMANDS

    # the oracle models what a command means, not how often it may come (tests/test_storage_faults.py does)
    dispatcher = CommandDispatcher(FakeControl(), tmp_path / "fuzz.db", max_payload_bytes=LIMIT,
                                   limits=dict.fromkeys(COMMANDS.names(), 0))
    oracle = Oracle(LIMIT)

    seen, ok = [0], [0]

    # Lists of payloads amortise hypothesis' per-example cost: ~2,000 payloads in a few seconds.
    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(payloads, min_size=8, max_size=12))
    def check(batch: list[bytes]) -> None:
        for payload in batch:
            reply = dispatcher.dispatch(payload)
            check_reply(reply, oracle.expect(payload))
            ok[0] += reply["ok"]
        seen[0] += len(batch)

    check()
    dispatcher.close()
    assert seen[0] >= 1600
    assert ok[0] > 100  # plenty of valid commands, not only rejections
