"""What strays and earlier runs leave behind cannot silence a sidecar: a stage directory it cannot
take over is a fatal error with a reason, a sync loop that dies says so, and junk dropped under
the root by the thousand neither grows the ack file past what the trainer reads nor outlives its
removal."""

from __future__ import annotations

import asyncio
import os

import pytest

from rollout_service.protocol import MAX_ACK_BYTES, read_acks
from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.staging import Stage, StageError
from rollout_service.sidecar.state import MAX_REPORTED_REJECTIONS
from sidecar_helpers import run_loop_until


def controller_for(root, **kw) -> SyncController:
    root.mkdir(exist_ok=True)
    return SyncController(SidecarSettings(checkpoint_path=root, sglang_url="http://127.0.0.1:9", replica_id="r0", **kw))


def test_a_stage_whose_lock_cannot_be_opened_is_a_stage_error_naming_it(tmp_path):
    stage = tmp_path / "stage"
    (stage / ".lock").mkdir(parents=True)  # a stray directory where the lock file goes
    with pytest.raises(StageError, match=r"cannot open .*\.lock: Is a directory"):
        Stage(stage)


def test_a_sidecar_whose_stage_cannot_be_taken_over_reports_it_as_fatal(tmp_path):
    stage = tmp_path / "stage"
    (stage / ".lock").mkdir(parents=True)
    controller = controller_for(tmp_path / "root", stage_dir=stage, health_interval_s=0.2)
    run_loop_until(controller, lambda: controller.state.fatal is not None)
    ready, why = controller.readiness()
    assert not ready and why.startswith("stage_failed: cannot open") and ".lock" in why, why


def test_a_sync_loop_that_dies_says_so(tmp_path):
    controller = controller_for(tmp_path / "root")

    async def scenario() -> None:
        async def broken() -> None:
            raise RuntimeError("a bug")

        task = asyncio.create_task(broken())
        task.add_done_callback(controller.loop_ended)
        with pytest.raises(RuntimeError):
            await task
        await asyncio.sleep(0)  # done callbacks run on the next turn

    asyncio.run(scenario())
    ready, why = controller.readiness()
    assert not ready and why.startswith("sync_loop_ended: the sync loop ended (RuntimeError: a bug)"), why


def test_junk_rejected_by_the_thousand_keeps_the_ack_readable_and_goes_with_the_junk(tmp_path):
    root = tmp_path / "root"
    controller = controller_for(root)
    junk = [90_000_000 + i for i in range(2500)]
    for step in junk:
        (root / f"step-{step:08d}").write_bytes(b"")  # empty files named like steps
    for step in junk:  # what the loop records when it rejects each of them
        controller.state.rejected[step] = "not_a_directory"
    controller.acks.write(controller.state.report())
    assert os.path.getsize(root / "acks" / "r0.json") < MAX_ACK_BYTES
    assert list(read_acks(root)) == ["r0"], "the trainer no longer sees this replica"
    reported = controller.state.report().rejected
    assert len(reported) == MAX_REPORTED_REJECTIONS and str(junk[-1]) in reported
    assert controller.state.to_dict()["rejected_count"] == 2500

    def a_pass() -> None:  # what each pass of the loop does with its listing of the root
        controller._forget_unlisted(controller._listing()[0])

    a_pass()
    assert len(controller.state.rejected) == 2500, "listed junk stays rejected"
    for step in junk[:-1]:
        os.remove(root / f"step-{step:08d}")
    a_pass()
    assert controller.state.rejected == {junk[-1]: "not_a_directory"}


def test_a_wait_whose_client_left_holds_nothing_and_a_stop_does_not_wait_on_open_waits(tmp_path):
    """An idle long-poll that its client abandoned ends with it, and SIGTERM stops the sidecar
    within its grace period even while another client still holds a /wait of ten minutes."""
    import signal
    import threading
    import time

    import httpx

    from fake_sglang import dead_url
    from rollout_service.sidecar.app import SHUTDOWN_GRACE_S
    from sidecar_helpers import Sidecar

    (tmp_path / "root").mkdir()
    sidecar = Sidecar(tmp_path / "root", dead_url(), tmp_path / "sidecar.log")
    try:

        def open_waits() -> int:
            return httpx.get(f"{sidecar.url}/status", timeout=10).json()["open_waits"]

        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and goes
            httpx.get(f"{sidecar.url}/wait?version=5&timeout=600", timeout=1.0)
        deadline = time.monotonic() + 5
        while open_waits() != 0:  # the sidecar lets go of it within about a second
            assert time.monotonic() < deadline, "a /wait whose client left is still held"
            time.sleep(0.2)
        threading.Thread(
            target=lambda: httpx.get(f"{sidecar.url}/wait?version=5&timeout=600", timeout=700), daemon=True
        ).start()
        time.sleep(1.5)
        assert open_waits() == 1
        t0 = time.monotonic()
        sidecar.proc.send_signal(signal.SIGTERM)
        sidecar.proc.wait(timeout=SHUTDOWN_GRACE_S + 15)
        assert time.monotonic() - t0 < SHUTDOWN_GRACE_S + 10
    finally:
        sidecar.stop()


def test_a_root_with_more_entries_than_are_read_makes_the_replica_unready_with_the_reason(tmp_path, monkeypatch):
    """Past the listing's cap the newest step could go unseen: the replica says so instead of
    reporting that it serves the newest checkpoint."""
    from rollout_service import checkpoint_reader
    from rollout_service.checkpoint_format import CheckpointError
    from rollout_service.checkpoint_reader import list_checkpoints

    monkeypatch.setattr(checkpoint_reader, "MAX_ROOT_ENTRIES", 50)  # a million real files: too slow here
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-00000007").mkdir()
    for i in range(50):
        (root / f"junk-{i}").write_bytes(b"")
    with pytest.raises(CheckpointError, match="holds more than 50 entries") as failed:
        list_checkpoints(root)
    assert failed.value.reason == "too_many_entries"
    controller = controller_for(root, health_interval_s=0.2)
    run_loop_until(controller, lambda: controller.state.loop_heartbeat is not None)
    ready, why = controller.readiness()
    assert not ready and why.startswith("too_many_entries: the checkpoint root"), why
    for i in range(50):
        os.remove(root / f"junk-{i}")
    assert [c.step for c in list_checkpoints(root)] == [7]


def test_a_materialized_step_published_again_stages_and_materializes_as_itself(tmp_path, tiny_model_dir):
    """A pruned step restored from ``materialize``'s output carries ``extra.reconstructed_from``
    (the delta it was rebuilt from). Published again, it stands for itself: the stage's copy of
    it is not taken for a copy of that delta (``changed_while_staging``), and it materializes."""
    import json

    from rollout_service.checkpoint_format import Manifest
    from rollout_service.checkpoint_reader import read_model_specs
    from rollout_service.delta_apply import materialize
    from sidecar_helpers import publish_step

    root = tmp_path / "root"
    root.mkdir()
    path = publish_step(root, tiny_model_dir, 3).path
    data = json.loads((path / "manifest.json").read_text())
    data.setdefault("extra", {})["reconstructed_from"] = {"fingerprint": "ab" * 16, "kind": "delta", "chain_start": 1}
    (path / "manifest.json").write_text(json.dumps(data))
    published = Manifest.load(path, root=root)
    controller = controller_for(root, stage_dir=tmp_path / "stage")
    controller.stage = Stage(tmp_path / "stage")
    controller._reference = read_model_specs(tiny_model_dir)
    report, built = controller._prepare(path)
    assert built is not None and report.manifest.source_fingerprint() == published.fingerprint()
    assert controller.stage.find(3, published.fingerprint()) is not None
    out = materialize(root, 3, tmp_path / "out")
    assert out.source_fingerprint() == published.fingerprint()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()


def test_wait_names_the_rejection_of_the_step_waited_for_whatever_else_was_rejected(tmp_path, tiny_model_dir):
    """Reports name the 64 newest rejections; a trainer waiting for an older rejected step still
    learns at once that it was rejected (else it would wait out its whole sync_timeout)."""
    from fastapi.testclient import TestClient

    from rollout_service.sidecar import controller as controller_module
    from rollout_service.sidecar.app import create_app
    from sidecar_helpers import publish_step

    root = tmp_path / "root"
    root.mkdir()
    path = publish_step(root, tiny_model_dir, 5).path
    settings = SidecarSettings(
        checkpoint_path=root, sglang_url="http://127.0.0.1:9", replica_id="r0", stage_dir=tmp_path / "stage"
    )
    app = create_app(settings)
    controller = app.state.controller
    for step in range(90_000_000, 90_000_100):
        (root / f"step-{step:08d}").mkdir()  # listed (a file is not: its rejection would be dropped)
        controller.state.rejected[step] = "missing_manifest"
    controller.state.rejected[5] = "digest_mismatch"
    controller._rejected_at[5] = controller_module._publication_identity(path)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        answer = client.get("/wait?version=5&timeout=2")
    assert answer.status_code == 504 and answer.json()["error"] == "checkpoint_rejected"
    assert answer.json()["rejected"]["5"] == "digest_mismatch"
    assert len(answer.json()["rejected"]) == MAX_REPORTED_REJECTIONS + 1


def test_a_base_model_kept_under_the_root_is_no_reference_without_reference_dir(tmp_path, tiny_model_dir, caplog):
    """A base model SGLang was started from that sits under the root is as untrusted as the
    root's steps (anyone who can write the root can change it after SGLang read it): the served
    tensors are not learnt from it, a warning names ``--reference-dir``, and with it given the
    reference is that folder (session 26; it was read as a model directory before)."""
    import logging
    import shutil

    from rollout_service.checkpoint_reader import read_model_specs
    from rollout_service.sidecar.served_model import find_reference
    from rollout_service.sidecar.sglang_client import ServerView

    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(tiny_model_dir, root / "base-model")
    base = str(root / "base-model")
    view = ServerView(healthy=True, model_path=base, launch_model_path=base)
    with caplog.at_level(logging.WARNING, logger="rollout_service.sidecar.served_model"):
        assert find_reference(view, root, None, None) is None
    assert any("--reference-dir" in r.getMessage() and base in r.getMessage() for r in caplog.records)
    found = find_reference(view, root, None, tiny_model_dir)
    assert found is not None and found[0] == read_model_specs(tiny_model_dir)


def test_past_the_cap_of_held_waits_a_wait_is_refused_with_the_reason_and_later_accepted(tmp_path):
    """MAX_WAITERS long-polls are held; the next one gets 503 ``too_many_waits`` at once (not a
    held connection nor a crash), and once they end a /wait is held again."""
    import asyncio
    import time

    import httpx

    from fake_sglang import dead_url
    from rollout_service.sidecar.app import MAX_WAITERS, TOKEN_WAITERS
    from sidecar_helpers import Sidecar

    (tmp_path / "root").mkdir()
    token = "trainer-token-123456"
    sidecar = Sidecar(tmp_path / "root", dead_url(), tmp_path / "sidecar.log", "--token", token)
    try:

        async def go() -> None:
            limits = httpx.Limits(max_connections=MAX_WAITERS + 10, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits, timeout=120) as client:
                held = [
                    asyncio.ensure_future(client.get(f"{sidecar.url}/wait", params={"version": 5, "timeout": 600}))
                    for _ in range(MAX_WAITERS)
                ]
                deadline = time.monotonic() + 60
                while (await client.get(f"{sidecar.url}/status")).json()["open_waits"] < MAX_WAITERS:
                    assert time.monotonic() < deadline, "the sidecar did not hold MAX_WAITERS waits"
                    await asyncio.sleep(0.2)
                t0 = time.monotonic()
                refused = await client.get(f"{sidecar.url}/wait", params={"version": 5, "timeout": 600})
                assert time.monotonic() - t0 < 10
                assert refused.status_code == 503 and refused.json()["error"] == "too_many_waits", refused.text
                # The trainer (it sends the token) still has slots: held, not refused.
                trainer = asyncio.ensure_future(
                    client.get(
                        f"{sidecar.url}/wait",
                        params={"version": 5, "timeout": 600},
                        headers={"Authorization": f"Bearer {token}"},
                    )
                )
                held.append(trainer)
                while (await client.get(f"{sidecar.url}/status")).json()["open_waits"] < MAX_WAITERS + 1:
                    assert not trainer.done(), trainer.result().text
                    assert time.monotonic() < deadline, "the trainer's wait was not held"
                    await asyncio.sleep(0.2)
                assert TOKEN_WAITERS >= 1
                for task in held:
                    task.cancel()
                await asyncio.gather(*held, return_exceptions=True)
                while (await client.get(f"{sidecar.url}/status")).json()["open_waits"] != 0:
                    assert time.monotonic() < deadline + 30, "waits whose clients left are still held"
                    await asyncio.sleep(0.2)
                again = await client.get(f"{sidecar.url}/wait", params={"version": 5, "timeout": 0.5})
                assert again.status_code == 504 and again.json()["waited_for"] == 5, again.text

        asyncio.run(go())
        assert sidecar.proc.poll() is None, "the sidecar died"
    finally:
        sidecar.stop()


def test_a_wait_on_a_sidecar_with_a_fatal_error_ends_at_once(tmp_path):
    """Once a fatal error stops all loading, a /wait for a step not served answers at once instead
    of looking at the root again and again until its timeout."""
    import time

    controller = controller_for(tmp_path / "root")
    looks: list[str] = []
    real_call = controller.root_gate.call

    async def counted(*args, what: str = "", **kw):
        looks.append(what)
        return await real_call(*args, what=what, **kw)

    controller.root_gate.call = counted

    async def scenario() -> tuple[bool, float]:
        controller._changed = asyncio.Condition()
        controller.report_fatal("stage_failed", "cannot stage")
        t0 = time.monotonic()
        ok = await controller.wait_for_step(1, 3.0)
        return ok, time.monotonic() - t0

    ok, took = asyncio.run(scenario())
    assert ok is False and took < 1.0, took
    assert len(looks) <= 1, f"{len(looks)} looks at the root"


def test_a_trainer_waiting_on_a_replica_that_cannot_recover_stops_at_once(tmp_path):
    """A sidecar whose stage folder holds someone else's files stops loading for good (fatal
    stage_failed); the trainer's wait on it ends at once, naming why, instead of at sync_timeout.
    (A real sidecar process; no SGLang is needed for it to fail so.)"""
    import time

    from sidecar_helpers import Sidecar
    from trainer_hooks.replica_wait import ReplicaFailed, SidecarWaiter

    root, stage = tmp_path / "root", tmp_path / "not-a-stage"
    root.mkdir()
    stage.mkdir()
    (stage / "notes.txt").write_text("someone else's")
    sidecar = Sidecar(root, "http://127.0.0.1:9", tmp_path / "sidecar.log", "--stage-dir", str(stage))
    try:
        deadline = time.monotonic() + 30
        while sidecar.status().get("fatal") is None:
            assert time.monotonic() < deadline, sidecar.status()
            time.sleep(0.1)
        wait = sidecar.get("/wait?version=1&timeout=30", timeout=60)
        assert wait.status_code == 504 and wait.json()["error"] == "replica_fatal", wait.text
        t0 = time.monotonic()
        with pytest.raises(ReplicaFailed, match="cannot load any checkpoint \\(stage_failed"):
            SidecarWaiter([sidecar.url]).wait(1, timeout_s=120)
        assert time.monotonic() - t0 < 15
        assert (stage / "notes.txt").read_text() == "someone else's"
    finally:
        sidecar.stop()
