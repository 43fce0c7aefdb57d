"""Untrusted input at the sidecar's edges: its HTTP answers render any text, ``POST /sync`` refuses
keys it does not know, and every number, host and token setting is checked where it is given."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import threading
import time
import typing
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollout_service.cli import SERVE_SIDECAR_SETTINGS, SIDECAR_SETTINGS, build_parser
from rollout_service.cli_env import declared_bounds, declared_settings
from rollout_service.http_auth import MAX_TOKEN_CHARS, bearer_headers
from rollout_service.sidecar import app as app_module
from rollout_service.sidecar import request_heads
from rollout_service.sidecar.app import SYNC_BODY_KEYS, SafeJSONResponse, create_app
from rollout_service.sidecar.settings import SidecarSettings
from sidecar_helpers import uvicorn_served

NOT_UTF8 = os.fsdecode(b"\xff.safetensors")
"""A file name that is not UTF-8, as Python reads it: with a lone surrogate."""

BOUNDED = {f.name: declared_bounds(f) for f in dataclasses.fields(SidecarSettings) if declared_bounds(f)}
FLAGS = {f.name: s.flag for f, s in declared_settings(SidecarSettings)}


def settings(root: Path, **overrides: Any) -> SidecarSettings:
    return SidecarSettings(
        checkpoint_path=root, sglang_url="http://127.0.0.1:1", replica_id="r", stage=False, **overrides
    )


def strict_json(content: bytes) -> Any:
    """Parse as a strict client does: UTF-8, and no lone surrogate escapes."""
    text = content.decode("utf-8")
    assert "\\ud" not in text.replace("\\\\", ""), text
    return json.loads(text)


# ------------------------------------------------------------------------ answers render any text


def test_status_renders_error_text_that_is_not_unicode(tmp_path: Path) -> None:
    app = create_app(settings(tmp_path))
    state = app.state.controller.state
    state.last_error = {"reason": "unlisted_file", "message": f"step-00000003/{NOT_UTF8} is not in the manifest"}
    state.rejected = {3: f"unlisted_file: {NOT_UTF8}"}
    response = TestClient(app, base_url="http://127.0.0.1").get("/status")
    assert response.status_code == 200
    body = strict_json(response.content)
    assert body["last_error"]["message"] == "step-00000003/\\udcff.safetensors is not in the manifest"
    assert body["rejected"] == {"3": "unlisted_file: \\udcff.safetensors"}


def test_readyz_renders_a_reason_that_is_not_unicode(tmp_path: Path) -> None:
    app = create_app(settings(tmp_path))
    app.state.controller.state.fatal = {"reason": "stage_failed", "message": f"cannot stage {NOT_UTF8}"}
    response = TestClient(app, base_url="http://127.0.0.1").get("/readyz")
    assert response.status_code == 503
    assert strict_json(response.content)["reason"] == "stage_failed: cannot stage \\udcff.safetensors"


def test_the_response_class_keeps_valid_text_and_escapes_only_surrogates() -> None:
    body = SafeJSONResponse({NOT_UTF8: ["é€😀", "a\\b"]}).body
    assert strict_json(body) == {"\\udcff.safetensors": ["é€😀", "a\\b"]}


# ------------------------------------------------------------------------------ POST /sync bodies


def test_sync_refuses_an_unknown_key_naming_it_and_the_accepted_ones(tmp_path: Path) -> None:
    (tmp_path / "step-00000001").mkdir()
    client = TestClient(create_app(settings(tmp_path)), base_url="http://127.0.0.1")
    refused = client.post("/sync", json={"checkpont": "step-00000001"})
    assert refused.status_code == 400 and refused.json()["error"] == "bad_request"  # every error names its kind
    detail = refused.json()["detail"]
    assert "'checkpont'" in detail and all(key in detail for key in SYNC_BODY_KEYS)
    extra = client.post("/sync", json={"checkpoint": "step-00000001", "force": True})
    assert extra.status_code == 400 and "'force'" in extra.json()["detail"]
    accepted = client.post("/sync", json={"checkpoint": "step-00000001"})
    assert accepted.status_code == 202, accepted.text


def test_sync_names_what_a_step_name_is_when_it_is_no_directory(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "step-00000002")
    (tmp_path / "step-00000003").write_text("not a checkpoint")
    (tmp_path / "step-00000004").symlink_to(tmp_path / "step-00000004")  # a loop
    client = TestClient(create_app(settings(tmp_path)), base_url="http://127.0.0.1")
    for step in (2, 3):
        r = client.post("/sync", json={"checkpoint": f"step-0000000{step}"})
        assert r.status_code == 400 and "is not a directory" in r.json()["detail"], r.text
    r = client.post("/sync", json={"checkpoint": "step-00000004"})
    assert r.status_code == 400 and r.json()["error"] in ("missing_checkpoint", "path_escape", "bad_request"), r.text
    r = client.post("/sync", json={"checkpoint": "step-00000005"})
    assert r.status_code == 400 and "does not exist" in r.json()["detail"], r.text


def test_sync_answers_503_when_the_root_does_not_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    from rollout_service.sidecar import app as app_module

    monkeypatch.setattr(app_module, "ROOT_LOOKUP_TIMEOUT_S", 0.5)
    app = create_app(settings(tmp_path))
    hung, calls = threading.Event(), []

    def blocked(checkpoint: str) -> Path:
        calls.append(checkpoint)
        hung.wait(30)
        return tmp_path / checkpoint

    monkeypatch.setattr(app.state.controller, "request_checkpoint", blocked)
    try:
        with TestClient(
            app, base_url="http://127.0.0.1"
        ) as client:  # one event loop for all the requests, as uvicorn runs
            r = client.post("/sync", json={"checkpoint": "step-00000001"})
            assert r.status_code == 503 and r.json()["error"] == "root_unresponsive", r.text
            assert client.get("/healthz").status_code == 200
            # While that look is still blocked, another request starts no second thread.
            r = client.post("/sync", json={"checkpoint": "step-00000002"})
            assert r.status_code == 503 and "earlier look" in r.json()["detail"] and calls == ["step-00000001"]
            hung.set()
            time.sleep(0.2)
            assert client.post("/sync", json={"checkpoint": "step-00000003"}).status_code == 202
            assert calls == ["step-00000001", "step-00000003"]
    finally:
        hung.set()


# ------------------------------------------------------------------------------------ GET /wait


def test_wait_that_times_out_names_its_kind_under_error_beside_the_status_body(tmp_path: Path) -> None:
    from rollout_service.protocol import ReplicaReport

    with TestClient(create_app(settings(tmp_path)), base_url="http://127.0.0.1") as client:
        r = client.get("/wait?version=1&timeout=0.3")
    assert r.status_code == 504, r.text
    body = r.json()
    assert body["error"] == "wait_timeout"  # every error answer names its kind
    assert body["waited_for"] == 1 and body["waited_for_run"] is None and body["loaded_step"] is None
    assert {"replica_id", "rejected", "rejected_count", "last_error", "root_problem"} <= set(body)  # still /status
    assert ReplicaReport.from_dict(body).replica_id == "r"  # what the trainer's replica wait reads


@pytest.mark.parametrize("text", ["7_0", "\u0667", "+7", " 7", "7 ", "7\n", "-1", "0x7", "123456789", "", "7.0"])
def test_wait_takes_a_step_in_plain_digits_only(tmp_path: Path, text: str) -> None:
    # Python's int() reads "7_0" as 70 and "\u0667" (Arabic-Indic seven) as 7: a /wait for
    # either would wait for a step the client did not name.
    with TestClient(create_app(settings(tmp_path)), base_url="http://127.0.0.1") as client:
        r = client.get("/wait", params={"version": text, "timeout": "0.2"})
        assert r.status_code == 400 and r.json()["error"] == "bad_request", r.text
        assert "query.version" in r.json()["detail"]
        r = client.get("/wait", params={"version": "0070", "timeout": "0.2"})
    assert r.status_code == 504 and r.json()["waited_for"] == 70, r.text


@pytest.mark.parametrize("text", ["1_0", "\u0661", "nan", "inf", "-1", "0", "3601", " 1", "0x1"])
def test_wait_takes_its_timeout_in_plain_decimal_digits_within_its_bound(tmp_path: Path, text: str) -> None:
    with TestClient(create_app(settings(tmp_path)), base_url="http://127.0.0.1") as client:
        r = client.get("/wait", params={"version": "1", "timeout": text})
        assert r.status_code == 400 and r.json()["error"] == "bad_request", r.text
        assert "query.timeout" in r.json()["detail"]
        started = time.monotonic()
        r = client.get("/wait", params={"version": "1", "timeout": ".2"})
    assert r.status_code == 504 and time.monotonic() - started < 5, r.text


def test_step_texts_from_sglang_and_adapter_names_are_plain_digits() -> None:
    from rollout_service.protocol import step_for_adapter_name, step_for_version

    assert [step_for_version(t) for t in ("70", "00000070", "7_0", "\u0667", "\u00b2", " 7", "123456789")] == [
        70,
        70,
        None,
        None,
        None,
        None,
        None,
    ]
    assert [step_for_adapter_name(n) for n in ("v00000007-r", "v0000_007", "v0000000\u0667", "v00000007")] == [
        7,
        None,
        None,
        7,
    ]


# ------------------------------------------------------------------------------- number settings


def test_every_number_setting_declares_a_range() -> None:
    hints = typing.get_type_hints(SidecarSettings)
    numbers = {
        name
        for name, hint in hints.items()
        if {int, float} & set(typing.get_args(hint) or (hint,)) and hint is not bool
    }
    assert numbers == set(BOUNDED)


def _outside(name: str) -> list[Any]:
    low, high = BOUNDED[name]
    kind = int if typing.get_type_hints(SidecarSettings)[name] is int else float
    bad = [kind(low - 1), kind(high + 1), kind(high * 10)]
    return bad + ([math.nan, math.inf, -math.inf, low / 2] if kind is float else [])


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_a_number_setting_outside_its_range_is_refused_naming_its_flag(tmp_path: Path, name: str) -> None:
    label = FLAGS.get(name, name)
    for value in _outside(name):
        with pytest.raises(ValueError, match=f"^{label} must be a finite number from "):
            settings(tmp_path, **{name: value})
    for value in BOUNDED[name]:  # the range is inclusive
        assert getattr(settings(tmp_path, **{name: value}), name) == value


@pytest.mark.parametrize("name", sorted(set(BOUNDED) & set(FLAGS)))
def test_a_flag_or_variable_outside_its_range_exits_2_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    (spec,) = [s for s in SIDECAR_SETTINGS.flags if s.field == name]
    argv = ["sidecar", "--checkpoint-path", str(tmp_path), "--sglang-url", "http://127.0.0.1:1"]
    text = str(_outside(name)[1])
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, spec.flag, text])
    assert exc.value.code == 2
    assert f"argument {spec.flag}: must be a finite number from" in capsys.readouterr().err
    monkeypatch.setenv(spec.env, text)
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert f"environment variable {spec.env}={text!r} is not valid for {spec.flag}: must be" in capsys.readouterr().err


def test_serve_names_its_own_flag_for_the_sidecar_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert [s.flag for s in SERVE_SIDECAR_SETTINGS.flags if s.field == "port"] == ["--sidecar-port"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--checkpoint-path", str(tmp_path), "--sidecar-port", "0"])
    assert "argument --sidecar-port: must be a finite number from 1 to 65535, got 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------- host and tokens


@pytest.mark.parametrize("host", ["999.1.1.1", "bad host", "", "-x", "a..b", "host:80"])
def test_a_host_that_is_no_address_or_name_is_refused(tmp_path: Path, host: str) -> None:
    with pytest.raises(ValueError, match=r"^--host .* is neither an IP address nor a host name"):
        settings(tmp_path, host=host)


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "0.0.0.0", "::", "::1", "localhost", "node-3.cluster.local", "rollout_sglang"]
)
def test_addresses_and_host_names_are_accepted(tmp_path: Path, host: str) -> None:
    assert settings(tmp_path, host=host).host == host


BAD_TOKENS = ["pässwort", "s3cret\n", " s3cret", "two words", "x" * (MAX_TOKEN_CHARS + 1)]


@pytest.mark.parametrize("token", BAD_TOKENS)
@pytest.mark.parametrize("field,flag", [("token", "--token"), ("sglang_api_key", "--sglang-api-key")])
def test_a_token_no_header_can_carry_is_refused(tmp_path: Path, field: str, flag: str, token: str) -> None:
    with pytest.raises(ValueError, match=f"^{flag} "):
        settings(tmp_path, **{field: token})
    with pytest.raises(ValueError, match="bearer token"):
        bearer_headers(token)


def test_a_printable_token_authenticates(tmp_path: Path) -> None:
    token = "A-z_0.9~+/=!#$%&'*^`|" + "x" * 100
    client = TestClient(create_app(settings(tmp_path, token=token)), base_url="http://127.0.0.1")
    wrong = client.post("/sync", headers=bearer_headers("wrong"))
    assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
    assert client.post("/sync", headers=bearer_headers(token)).status_code == 202


# ------------------------------------------------------------------------ connections are bounded


def served(app: Any, settings_: SidecarSettings) -> contextlib.AbstractContextManager[int]:
    """The sidecar's app under uvicorn as ``sidecar`` runs it (its config), on a free port."""
    return uvicorn_served(app, settings_)


def answer_status(conn: socket.socket, timeout_s: float) -> int:
    conn.settimeout(timeout_s)
    head = conn.recv(4096)
    return int(head.split(b" ", 2)[1])


def test_a_sync_body_that_stops_coming_is_answered_408(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 1.0)
    app = create_app(settings(tmp_path))
    with served(app, settings(tmp_path)) as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(
            b"POST /sync HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{"
        )
        t0 = time.monotonic()
        assert answer_status(conn, 10) == 408
        assert time.monotonic() - t0 < 5


def test_connections_past_the_limit_are_answered_503(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_module, "MAX_CONNECTIONS", 8)
    app = create_app(settings(tmp_path))
    with served(app, settings(tmp_path)) as port:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        time.sleep(0.5)
        try:
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert answer_status(conn, 10) == 503
            for conn in idle:
                conn.close()
            time.sleep(0.5)
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert answer_status(conn, 10) == 200
        finally:
            for conn in idle:
                conn.close()


def closed_by_server(conn: socket.socket) -> bool:
    conn.settimeout(5)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_connections_that_send_no_request_head_in_time_are_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Connections that sent nothing, or dripped a header line now and then (each byte restarted
    # uvicorn's keep-alive timer), held every slot for ever: /healthz answered 503 to everyone.
    monkeypatch.setattr(app_module, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(request_heads, "REQUEST_HEAD_TIMEOUT_S", 1.0)
    app = create_app(settings(tmp_path))
    with served(app, settings(tmp_path)) as port:
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        dripping = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for conn in dripping:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            deadline = time.monotonic() + 30
            while True:
                for conn in dripping:
                    with contextlib.suppress(OSError):
                        conn.sendall(b"X-Slow: 1\r\n")
                with socket.create_connection(("127.0.0.1", port)) as conn:
                    conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    if answer_status(conn, 10) == 200:
                        break
                assert time.monotonic() < deadline, "connections that send no request kept every slot"
                time.sleep(0.3)
            assert all(closed_by_server(conn) for conn in silent + dripping)
        finally:
            for conn in silent + dripping:
                conn.close()


def request_on(conn: socket.socket, path: str) -> int:
    """One request on a kept-alive connection; its status once the whole answer is read."""
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    conn.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        assert chunk, "the server closed a connection that was in use"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:]) if k.lower() == b"content-length"
    )
    while len(body) < length:
        chunk = conn.recv(4096)
        assert chunk, "the server closed a connection that was in use"
        body += chunk
    return int(head.split(b" ", 2)[1])


def test_a_request_being_answered_and_a_kept_alive_connection_in_use_are_not_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(request_heads, "REQUEST_HEAD_TIMEOUT_S", 1.0)
    app = create_app(settings(tmp_path))
    with served(app, settings(tmp_path)) as port, socket.create_connection(("127.0.0.1", port)) as conn:
        # A /wait longer than the bound is answered (at its own timeout), on a connection that then
        # serves requests spaced within the bound for three times as long.
        assert request_on(conn, "/wait?version=5&timeout=2.5") == 504
        for _ in range(8):
            assert request_on(conn, "/healthz") == 200
            time.sleep(0.4)
        time.sleep(3)  # idle past the bound (and uvicorn's keep-alive): closed
        assert closed_by_server(conn)
