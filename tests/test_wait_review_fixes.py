"""Defects a review of the replica waits found, each pinned by the case that showed it:

- a ``/wait`` whose look at the root overlaps an SGLang restart does not confirm the step the
  restart unloaded;
- the trainer's ack-file wait does not count a replica whose SGLang is down (as its ``/wait`` does not);
- a rejection reason of megabytes is cut in the trainer's error message;
- the example files' placeholder credentials are refused as tokens;
- a ``/wait`` that a look at the root ended early names why (not ``wait_timeout``), and the
  trainer's timeout message repeats it.

SGLang is the in-process fake client of tests/test_sync_loop_hazards.py (``FakeSGLang``) and the
trainer's sidecars are canned HTTP answers (tests/fake_sglang.py): a real server cannot be made to
restart in the middle of one ``/wait``'s look at the root, nor a real root to fail one look on cue.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from deploy_files import ENV_EXAMPLE, EXAMPLE_SECRET
from fake_sglang import CannedServer, canned_reply
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.http_auth import check_token
from rollout_service.protocol import ReplicaReport
from rollout_service.sidecar.acks import write_ack
from rollout_service.sidecar.app import create_app
from rollout_service.sidecar.root_gate import RootUnresponsive
from rollout_service.sidecar.settings import SidecarSettings
from test_sync_loop_hazards import CONFIG, RUN, FakeSGLang, make, run_with, tensors, until
from trainer_hooks.replica_wait import (
    AckFileWaiter,
    CheckpointRejected,
    ReplicaSyncTimeout,
    SidecarWaiter,
)

# ------------------------------------------------------------------ A: a restart during /wait's look


def test_a_wait_whose_look_overlaps_an_sglang_restart_does_not_confirm_the_unloaded_step(tmp_path: Path) -> None:
    """/wait checks that step 1 is served, then looks at the root on a thread. SGLang restarts
    during that look (the sync loop sets ``loaded_step`` to None and reloads): the look must not
    answer ``same`` for "nothing served", and the wait must not say step 1 is served."""
    root, c, client = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    real_presence = c._loaded_presence
    raced = threading.Event()
    waits: dict[str, Any] = {}

    def restart_during_the_look(*args: Any) -> str:
        if "/wait" in threading.current_thread().name and not raced.is_set():
            raced.set()
            client.version = None  # SGLang restarted with its start-up weights ...
            deadline = time.monotonic() + 10.0
            while c.state.loaded_step is not None:  # ... and the sync loop noticed, before the look ends
                assert time.monotonic() < deadline, "the sync loop did not notice the restart"
                time.sleep(0.02)
        return real_presence(*args)

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        release = asyncio.Event()

        async def held_reload(path: str, version: str) -> None:
            await release.wait()  # the reload after the restart lasts until the test lets it end

        client.load_hook = held_reload
        c._loaded_presence = restart_during_the_look  # type: ignore[method-assign,assignment]
        waits["during"] = await c.wait_for_step(1, 2.0, run_id=RUN)
        waits["served then"] = c.state.loaded_step
        release.set()
        waits["after the reload"] = await c.wait_for_step(1, 10.0, run_id=RUN)

    run_with(c, during)
    assert raced.is_set(), "the look never overlapped the restart"
    assert waits["served then"] is None, waits
    assert waits["during"] is False, "a /wait confirmed step 1 while SGLang served nothing"
    assert waits["after the reload"] is True, "the wait does not confirm the step once it is reloaded"


# ------------------------------------------------------------- B: an ack of a replica whose SGLang is down


def test_the_ack_wait_does_not_count_a_replica_whose_sglang_is_down(tmp_path: Path) -> None:
    """A sidecar keeps ``loaded_step`` while its SGLang is down (to reload it); its ack then says
    ``sglang_healthy: false``, and its /wait answers 504: the ack wait must not count it either."""
    write_ack(
        tmp_path,
        "r0",
        {
            "loaded_step": 5,
            "run_id": RUN,
            "loaded_current": True,
            "sglang_healthy": False,
            "ready": False,
            "last_error": {"reason": "sglang_down", "message": "SGLang is not answering"},
        },
    )
    waiter = AckFileWaiter(tmp_path, 1, max_age_s=30)
    waiter.run_id = RUN
    with pytest.raises(ReplicaSyncTimeout, match=r"Lagging: r0 \(loaded 5 of run run1, SGLang not healthy"):
        waiter.wait(5, timeout_s=1.0)

    write_ack(tmp_path, "r0", {"loaded_step": 5, "run_id": RUN, "sglang_healthy": True})
    assert [v.name for v in waiter.wait(5, timeout_s=5.0)] == ["r0"]
    write_ack(tmp_path, "r0", {"loaded_step": 5, "run_id": RUN})  # an ack without the field still counts
    assert [v.loaded_step for v in waiter.wait(5, timeout_s=5.0)] == [5]


# ----------------------------------------------------------------- C: a rejection reason of megabytes


def test_a_huge_rejection_reason_is_cut_in_the_trainers_error() -> None:
    huge = "R" * 3_000_000
    sidecar = CannedServer(
        lambda path, body, n: canned_reply(504, {"rejected": {"5": huge}, "loaded_step": 4, "error": "x"})
    )
    try:
        with pytest.raises(CheckpointRejected) as raised:
            SidecarWaiter([sidecar.url]).wait(5, timeout_s=5.0)
    finally:
        sidecar.stop()
    message = str(raised.value)
    assert "rejected checkpoint step-00000005 (RRRR" in message
    assert len(message) < 2_000, len(message)


# --------------------------------------------------------------- D: the example files' placeholders


def _example_credentials() -> dict[str, str]:
    """Every credential the shipped example files hold (the compose .env and the Kubernetes Secret)."""
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        name, _, value = line.partition("=")
        if name in ("ROLLOUT_TOKEN", "ROLLOUT_SGLANG_API_KEY"):
            values[f".env.example {name}"] = value
    for doc in yaml.safe_load_all(EXAMPLE_SECRET.read_text()):
        for key, value in doc["stringData"].items():
            values[f"{EXAMPLE_SECRET.name} {key}"] = value
    return values


def test_the_example_files_placeholder_credentials_are_refused_as_tokens(tmp_path: Path) -> None:
    examples = _example_credentials()
    assert len(examples) == 4, examples
    for where, value in examples.items():
        with pytest.raises(ValueError, match=r"placeholder .*secrets\.token_hex\(32\)"):
            check_token(value, where)
    token, key = examples[".env.example ROLLOUT_TOKEN"], examples[".env.example ROLLOUT_SGLANG_API_KEY"]
    common: dict[str, Any] = {
        "checkpoint_path": tmp_path,
        "sglang_url": "http://127.0.0.1:1",
        "replica_id": "r",
        "stage": False,
    }
    with pytest.raises(ValueError, match="--token is still the example's placeholder"):
        SidecarSettings(**common, host="0.0.0.0", token=token, sglang_api_key=secrets.token_hex(32))
    with pytest.raises(ValueError, match="--sglang-api-key is still the example's placeholder"):
        SidecarSettings(**common, host="0.0.0.0", token=secrets.token_hex(32), sglang_api_key=key)
    # A generated one, as the error says, passes.
    generated = secrets.token_hex(32)
    assert check_token(generated, "--token") == generated
    SidecarSettings(**common, host="0.0.0.0", token=secrets.token_hex(32), sglang_api_key=secrets.token_hex(32))


# ------------------------------------------------------------------ E: why /wait ended early


def _sidecar_app(tmp: Path) -> tuple[Path, Any]:
    root = tmp / "root"
    root.mkdir()
    publish_checkpoint(tmp / "refroot", 0, tensors(0), config=CONFIG, run_id=RUN)
    shutil.copytree(tmp / "refroot" / "step-00000000", tmp / "ref")
    settings = SidecarSettings(
        checkpoint_path=root,
        sglang_url="http://127.0.0.1:9",
        replica_id="r0",
        stage_dir=tmp / "stage",
        reference_dir=tmp / "ref",
        health_interval_s=0.05,
        poll_interval_s=0.05,
    )
    app = create_app(settings)
    app.state.controller.client = FakeSGLang(tmp / "ref")
    return root, app


def test_a_wait_a_look_at_the_root_ended_early_names_why(tmp_path: Path) -> None:
    root, app = _sidecar_app(tmp_path)
    c = app.state.controller
    with TestClient(app, base_url="http://127.0.0.1") as client:
        publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
        assert client.get("/wait", params={"version": 1, "timeout": 30, "run": RUN}).status_code == 200

        c._loaded_presence = lambda *args: "unknown"  # one failed look (EIO, a stale NFS handle)
        r = client.get("/wait", params={"version": 1, "timeout": 30, "run": RUN})
        assert r.status_code == 504
        body = r.json()
        assert body["error"] == "root_read_failed", body.get("error")
        assert "Ask again" in body["detail"] and "step 1" in body["detail"]
        assert ReplicaReport.from_dict(body).loaded_step == 1  # still the /status body the trainer reads

        async def unresponsive(*args: Any, what: str) -> Any:
            raise RootUnresponsive(f"the checkpoint root {root} is not answering: {what} did not come back")

        c.wait_gate.call = unresponsive  # /wait looks at the root through its own gate
        body = client.get("/wait", params={"version": 1, "timeout": 30, "run": RUN}).json()
        assert body["error"] == "root_unresponsive" and "is not answering" in body["detail"], body

        body = client.get("/wait", params={"version": 2, "timeout": 0.3, "run": RUN}).json()
        assert body["error"] == "wait_timeout" and "step 2 was not served" in body["detail"], body


def test_the_trainer_names_why_a_sidecars_wait_ended_early() -> None:
    answer = {
        "loaded_step": 4,
        "error": "root_unresponsive",
        "detail": "/wait's look at the served step 4 could not be made: the checkpoint root is not answering",
    }
    sidecar = CannedServer(lambda path, body, n: canned_reply(504, answer))
    try:
        with pytest.raises(ReplicaSyncTimeout) as raised:
            SidecarWaiter([sidecar.url]).wait(5, timeout_s=1.5)
    finally:
        sidecar.stop()
    assert "GET /wait: root_unresponsive: /wait's look at the served step 4" in str(raised.value)
