"""The sidecar's HTTP edge against what a browser page, a careless client or a log can do: query
strings stay out of the access log, cross-site and DNS-rebinding requests are refused, repeated
query parameters and JSON keys are refused; ``publish`` refuses roots inside a step or the model;
an empty token is refused."""

from __future__ import annotations

import contextlib
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollout_service.cli import main
from rollout_service.http_auth import check_token
from rollout_service.sidecar.app import create_app
from rollout_service.sidecar.settings import SidecarSettings
from sidecar_helpers import uvicorn_served

SECRET = "s3cret-query-value-4711"
LOOPBACK_BASE = "http://127.0.0.1:8100"
"""What a local client (the trainer, curl) sends as Host to a sidecar bound to 127.0.0.1."""


def settings(root: Path, **overrides: Any) -> SidecarSettings:
    return SidecarSettings(
        checkpoint_path=root, sglang_url="http://127.0.0.1:1", replica_id="r", stage=False, **overrides
    )


def client(root: Path, *, base_url: str = LOOPBACK_BASE, **overrides: Any) -> TestClient:
    (root / "step-00000001").mkdir(exist_ok=True)
    return TestClient(create_app(settings(root, **overrides)), base_url=base_url)


# ------------------------------------------------------------------------------ 1: the access log


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def served(settings_: SidecarSettings) -> contextlib.AbstractContextManager[int]:
    """The app under uvicorn with the sidecar's own config, on a free port."""
    return uvicorn_served(create_app(settings_), settings_)


def exchange(port: int, head: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(10)
        conn.sendall(head.encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


def test_the_access_log_never_shows_a_query_strings_text(tmp_path: Path) -> None:
    lines = Lines()
    access = logging.getLogger("uvicorn.access")
    with served(settings(tmp_path, token="the-configured-token-1")) as port:
        access.addHandler(lines)
        try:
            for target in (f"/sync?token={SECRET}", f"/sync?access_token={SECRET}&x={SECRET}"):
                answer = exchange(port, f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
            answer = exchange(port, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        finally:
            access.removeHandler(lines)
    assert len(lines.lines) == 3, lines.lines
    assert not [line for line in lines.lines if SECRET in line], lines.lines
    assert sum('"POST /sync?... HTTP/1.1" 400' in line for line in lines.lines) == 2, lines.lines
    assert '"GET /healthz HTTP/1.1" 200' in lines.lines[2], lines.lines


def test_a_logged_target_keeps_its_path_and_hides_its_query() -> None:
    from rollout_service.redaction import shown_request_target

    assert shown_request_target("/wait?version=3&timeout=5") == "/wait?..."
    assert shown_request_target("/status") == "/status"
    assert shown_request_target("/sync?") == "/sync?..."


# --------------------------------------------------------------------- 2a: a body must be JSON


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx"],
)
def test_a_sync_body_that_is_not_sent_as_json_is_refused_415(tmp_path: Path, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    with client(tmp_path) as c:
        r = c.post("/sync", content=b'{"checkpoint": "step-00000001"}', headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"] == "unsupported_media_type"
    assert "Content-Type: application/json" in r.json()["detail"]


def test_json_bodies_and_empty_bodies_still_sync(tmp_path: Path) -> None:
    with client(tmp_path) as c:
        assert c.post("/sync", json={"checkpoint": "step-00000001"}).status_code == 202  # the trainer's call
        r = c.post(
            "/sync",
            content=b'{"checkpoint":"step-00000001"}',
            headers={"content-type": "Application/JSON; charset=utf-8"},
        )
        assert r.status_code == 202, r.text
        assert c.post("/sync").status_code == 202  # no body: the newest step, no type needed


# ------------------------------------------------------------- 2b: DNS rebinding and cross-site


@pytest.mark.parametrize("host", ["rebind.evil.example", "127.0.0.1.evil.example:8100", "10.0.0.5:8100", "testserver"])
def test_a_loopback_sidecar_refuses_a_host_that_is_not_loopback(tmp_path: Path, host: str) -> None:
    with client(tmp_path) as c:
        r = c.get("/status", headers={"host": host})
    assert r.status_code == 421, r.text
    assert r.json()["error"] == "misdirected_request"
    assert "answers only loopback names" in r.json()["detail"] and "--host" in r.json()["detail"]
    assert "replica_id" not in r.json()


@pytest.mark.parametrize(
    "host", ["127.0.0.1:8100", "localhost", "LOCALHOST:1", "[::1]:8100", "127.9.8.7", "localhost."]
)
def test_a_loopback_sidecar_answers_loopback_hosts(tmp_path: Path, host: str) -> None:
    with client(tmp_path) as c:
        r = c.get("/status", headers={"host": host})
    assert r.status_code == 200, r.text


def test_a_sidecar_bound_to_all_addresses_answers_any_host(tmp_path: Path) -> None:
    with client(tmp_path, host="0.0.0.0", token="a-token-for-all-1") as c:
        assert c.get("/status", headers={"host": "rollout-0.cluster.local:8100"}).status_code == 200


@pytest.mark.parametrize(
    ("value", "loopback"),
    [
        ("127.0.0.1", True),
        ("[::1]", True),
        ("localhost:65535", True),
        ("evil@127.0.0.1", False),
        ("127.0.0.1:abc", False),
        ("[::1", False),
        ("localhost/x", False),
        ("", False),
        ("local host", False),
    ],
)
def test_loopback_authorities(value: str, loopback: bool) -> None:
    from rollout_service.http_auth import is_loopback_authority

    assert is_loopback_authority(value) is loopback


def test_without_a_token_a_cross_site_post_is_refused_403(tmp_path: Path) -> None:
    with client(tmp_path) as c:
        r = c.post("/sync", headers={"origin": "http://evil.example"})
        assert r.status_code == 403, r.text
        assert r.json()["error"] == "forbidden" and "without a token" in r.json()["detail"]
        r = c.post("/sync", json={"checkpoint": "step-00000001"}, headers={"origin": "null"})
        assert r.status_code == 403, r.text
        assert c.get("/status", headers={"origin": "http://evil.example"}).status_code == 200  # reads: Host guards


def test_the_reviewers_cross_site_text_plain_post_is_refused(tmp_path: Path) -> None:
    with client(tmp_path) as c:
        r = c.post(
            "/sync",
            content=b'{"checkpoint":"step-00000001"}',
            headers={"content-type": "text/plain", "origin": "http://evil.example", "host": "rebind.evil.example"},
        )
        assert r.status_code == 421, r.text
        r = c.post(
            "/sync",
            content=b'{"checkpoint":"step-00000001"}',
            headers={"content-type": "text/plain", "origin": "http://evil.example"},
        )
        assert r.status_code == 403, r.text


def test_with_a_token_an_origin_is_no_reason_to_refuse(tmp_path: Path) -> None:
    token = "a-configured-token-2"
    with client(tmp_path, token=token) as c:
        headers = {"origin": "http://ui.example", "authorization": f"Bearer {token}"}
        assert c.post("/sync", json={"checkpoint": "step-00000001"}, headers=headers).status_code == 202
        assert c.post("/sync", headers={"origin": "http://ui.example"}).status_code == 401


# ---------------------------------------------------------------- 3: repeated names are refused


@pytest.mark.parametrize(
    ("query", "named"), [("version=1&version=2", "'version'"), ("version=1&timeout=0.2&timeout=5", "'timeout'")]
)
def test_a_query_parameter_given_twice_is_refused(tmp_path: Path, query: str, named: str) -> None:
    with client(tmp_path) as c:
        r = c.get(f"/wait?{query}")
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "bad_request"
    assert named in r.json()["detail"] and "more than once" in r.json()["detail"]


def test_a_body_key_given_twice_is_refused(tmp_path: Path) -> None:
    with client(tmp_path) as c:
        r = c.post(
            "/sync",
            content=b'{"checkpoint": "../x", "checkpoint": "step-00000001"}',
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 400, r.text
    assert "'checkpoint'" in r.json()["detail"] and "more than once" in r.json()["detail"]


# ------------------------------------------------------------------ 4: publish's checkpoint root


def tiny_model(path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({"model.norm.weight": torch.ones(16), "lm_head.weight": torch.zeros(32, 16)}, path / "model.safetensors")
    (path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 16}')
    return path


def snapshot(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_publish_refuses_a_root_inside_a_published_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, root = tiny_model(tmp_path / "model"), tmp_path / "root"
    assert main(["publish", "--model-dir", str(model), "--checkpoint-path", str(root), "--step", "1"]) == 0
    before = snapshot(tmp_path)
    capsys.readouterr()
    for inside in (root / "step-00000001", root / "step-00000001" / "deeper"):
        assert main(["publish", "--model-dir", str(model), "--checkpoint-path", str(inside), "--step", "3"]) == 2
        err = capsys.readouterr().err
        assert "manifest.json" in err and "checkpoint root itself" in err, err
    assert snapshot(tmp_path) == before


def test_publish_refuses_a_root_that_is_or_is_inside_the_model_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model(tmp_path / "model")
    before = snapshot(tmp_path)
    for root in (model, model / "checkpoints", tmp_path / "." / "model"):
        assert main(["publish", "--model-dir", str(model), "--checkpoint-path", str(root), "--step", "3"]) == 2
        err = capsys.readouterr().err
        assert "inside it" in err and "--model-dir" in err, err
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------- 5: an empty token


def test_an_empty_token_is_refused_not_taken_for_none(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^--token is empty"):
        settings(tmp_path, token="")
    with pytest.raises(ValueError, match="^--sglang-api-key is empty"):
        settings(tmp_path, sglang_api_key="")
    with pytest.raises(ValueError, match="empty"):
        check_token("", "sidecar_token")
    assert check_token(None, "--token") is None


def test_an_empty_token_flag_is_refused_by_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_service.cli import SIDECAR_SETTINGS, build_parser

    monkeypatch.delenv("ROLLOUT_TOKEN", raising=False)
    argv = [
        "sidecar",
        "--checkpoint-path",
        str(tmp_path),
        "--sglang-url",
        "http://127.0.0.1:1",
        "--no-stage",
        "--token",
        "",
    ]
    args = build_parser().parse_args(argv)
    assert args.token == ""
    with pytest.raises(ValueError, match="^--token is empty"):
        SIDECAR_SETTINGS.build(args)


@pytest.mark.parametrize(
    "authority",
    ["127.1:8100", "[::ffff:127.0.0.1]:8100", "localhost.localdomain", "LOCALHOST.:8100", "[::1]", "127.0.0.2"],
)
def test_every_spelling_of_a_loopback_host_is_this_machine(authority: str) -> None:
    """Short IPv4 forms (``curl http://127.1:8100``), IPv4-mapped IPv6 and /etc/hosts' loopback
    names reach a loopback-bound sidecar: refusing them (421) broke clients the DNS-rebinding
    guard has no reason to refuse."""
    from rollout_service.http_auth import is_loopback_authority

    assert is_loopback_authority(authority)


@pytest.mark.parametrize("authority", ["127.0.0.1.evil.example", "evil.example:8100", "[::ffff:10.0.0.1]", "1.2"])
def test_names_that_only_look_loopback_are_not(authority: str) -> None:
    from rollout_service.http_auth import is_loopback_authority

    assert not is_loopback_authority(authority)


# ---------------------------------------------- 5: what POST /sync promises, and trailing slashes


def test_a_trailing_slash_is_no_redirect_that_names_a_foreign_host(tmp_path: Path) -> None:
    """Starlette's trailing-slash redirect was answered before the Host guard ran: a 307 to
    ``http://<any Host>/wait``. No redirect now: a 404 that names nothing."""
    with client(tmp_path) as c:
        for path in ("/wait/", "/status/", "/sync/"):
            r = c.get(path, headers={"host": "attacker.example:8100"}, follow_redirects=False)
            assert r.status_code in (404, 405, 421), (path, r.status_code)
            assert "attacker.example" not in r.headers.get("location", "") and "attacker.example" not in r.text


def test_sync_naming_a_step_the_loop_would_not_load_is_a_409_saying_why(tmp_path: Path) -> None:
    """``POST /sync`` naming an older step than the served one answered 202 "triggered", and
    nothing loaded it (the sidecar serves the newest valid step). Such a step, and a rejected
    step unchanged since, is a 409 naming why; a rejected step republished since is looked at."""
    from rollout_service.sidecar import controller as controller_module

    for step in (1, 2, 3):
        (tmp_path / f"step-0000000{step}").mkdir(exist_ok=True)
        (tmp_path / f"step-0000000{step}" / "manifest.json").write_text("{}")
    app = create_app(settings(tmp_path))
    controller = app.state.controller
    controller.state.loaded_step = 2
    controller.state.rejected[3] = "shape_mismatch"
    controller._rejected_at[3] = controller_module._read_identity(tmp_path / "step-00000003")
    with TestClient(app, base_url=LOOPBACK_BASE) as c:
        older = c.post("/sync", json={"checkpoint": "step-00000001"})
        assert older.status_code == 409 and older.json()["error"] == "older_than_served", older.text
        assert "newest valid step" in older.json()["detail"] and "new step" in older.json()["detail"]
        rejected = c.post("/sync", json={"checkpoint": "step-00000003"})
        assert rejected.status_code == 409 and rejected.json()["error"] == "checkpoint_rejected", rejected.text
        assert "shape_mismatch" in rejected.json()["detail"]
        (tmp_path / "step-00000003" / "manifest.json").unlink()  # republished: looked at anew
        (tmp_path / "step-00000003" / "manifest.json").write_text('{"step": 3}')
        assert c.post("/sync", json={"checkpoint": "step-00000003"}).status_code == 202
        assert c.post("/sync", json={"checkpoint": "step-00000002"}).status_code == 202  # the served one: a rescan
        controller.state.loaded_current = False  # republished: the loop still does not go back
        assert c.post("/sync", json={"checkpoint": "step-00000001"}).status_code == 409
        import shutil

        shutil.rmtree(tmp_path / "step-00000002")  # gone (the loop's test, made now): it goes back
        assert c.post("/sync", json={"checkpoint": "step-00000001"}).status_code == 202
