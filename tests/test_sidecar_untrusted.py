"""Crafted checkpoints against a real sidecar and a real SGLang: nothing unverified reaches
SGLang, nothing wedges the loop, and /wait answers only for what SGLang serves."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from helpers import generate
from rollout_service.checkpoint_writer import publish_checkpoint
from sidecar_helpers import perturbed_state, publish_step, transformers_greedy
from trainer_hooks.replica_wait import AckFileWaiter, CheckpointRejected, ReplicaSyncTimeout, SidecarWaiter

pytestmark = pytest.mark.sglang

PROMPT = [11, 42, 7, 99, 256, 3]


def publish_crafted(
    root: Path, staging: Path, model_dir: Path, step: int, spoil, state=None, run_id: str | None = None
) -> Path:
    """Publish step ``step`` elsewhere, let ``spoil(path)`` damage it, then rename it in."""
    path = publish_checkpoint(
        staging,
        step,
        (state or perturbed_state(model_dir, step)).items(),
        config=model_dir / "config.json",
        run_id=run_id,
        check_finite=False,  # a writer that does not check (NaN weights): the sidecar must
    ).path
    spoil(path)
    final = root / path.name
    os.rename(path, final)
    return final


def resized_state(model_dir: Path, step: int) -> dict:
    """What `resize_token_embeddings(vocab + 8)` produces: consistent files, other shapes."""
    state = perturbed_state(model_dir, step)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state:
            state[name] = torch.cat([state[name], torch.zeros(8, state[name].shape[1])])
    return state


def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


def sglang_health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=60).status_code


def test_first_checkpoint_is_checked_against_the_served_model_and_after_a_restart(
    sglang_server_at_base, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path
):
    url = sglang_server_at_base.url
    stage = tmp_path / "stage"
    sidecar = sidecar_factory("--stage-dir", str(stage), replica_id="ref")
    wait_until(lambda: sidecar.status()["reference"], 60, "the reference learnt from SGLang")
    assert sidecar.status()["reference"] == str(tiny_model_dir)
    t0 = time.monotonic()
    publish_checkpoint(
        checkpoint_root, 1, resized_state(tiny_model_dir, 1).items(), config=tiny_model_dir / "config.json"
    )
    wait_until(lambda: "1" in sidecar.status()["rejected"], 60, "rejection of step 1")
    rejection_s = time.monotonic() - t0
    status = sidecar.status()
    assert status["rejected"] == {"1": "shape_mismatch"}, status
    assert "resized embeddings" in status["last_error"]["message"]
    assert sglang_health(url) == 200, "SGLang must never see the resized checkpoint"
    assert sidecar.metric("rollout_sidecar_sglang_restarts_total") == 0
    print(f"rejecting a resized first checkpoint took {rejection_s:.2f} s (publish -> rejected)")
    publish_step(checkpoint_root, tiny_model_dir, 2)
    sidecar.wait_step(2)
    served = httpx.get(f"{url}/model_info", timeout=30).json()["model_path"]
    assert Path(served).parent == stage, f"SGLang must read the verified stage copy, not {served}"
    sidecar.kill(signal.SIGKILL)
    again = sidecar_factory("--stage-dir", str(stage), replica_id="ref")
    wait_until(lambda: again.status()["loaded_step"] == 2, 60, "adoption of step 2")
    assert again.status()["reference"] == str(tiny_model_dir), "the reference survives a restart"
    publish_checkpoint(
        checkpoint_root, 3, resized_state(tiny_model_dir, 3).items(), config=tiny_model_dir / "config.json"
    )
    wait_until(lambda: "3" in again.status()["rejected"], 60, "rejection of step 3")
    assert again.status()["rejected"]["3"] == "shape_mismatch"
    assert sglang_health(url) == 200
    assert again.metric("rollout_sidecar_syncs_total", outcome="loaded", reason="ok") == 0


def _fifo_manifest(path: Path) -> None:
    (path / "manifest.json").unlink()
    os.mkfifo(path / "manifest.json")


def _nested_manifest(path: Path) -> None:
    (path / "manifest.json").write_text("[" * 50_000 + "]" * 50_000)


def _huge_listed_file(path: Path) -> None:
    """A consistent manifest that lists a sparse 1 TiB file: every size matches, only staging
    it would need more room than the stage's file system has."""
    manifest = json.loads((path / "manifest.json").read_text())
    with open(path / "extra.bin", "wb") as f:
        f.truncate(1 << 40)
    manifest["files"]["extra.bin"] = {"size": 1 << 40, "digest": "xxh3_128:" + "0" * 32, "tensors": 0}
    manifest["total_bytes"] += 1 << 40
    (path / "manifest.json").write_text(json.dumps(manifest))


def _zero_manifest(path: Path) -> None:
    (path / "manifest.json").unlink()
    (path / "manifest.json").symlink_to("/dev/zero")


def _bad_index_types(path: Path) -> None:
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text.replace('"total_bytes": ', '"total_bytes": 1e999, "x": '))


def _flip_a_weight_byte(path: Path) -> None:
    shard = path / "model.safetensors"
    with open(shard, "r+b") as f:  # same size, header intact: only every byte can tell
        f.seek(shard.stat().st_size - 1000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def test_poison_entries_are_each_rejected_and_the_loop_keeps_serving(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path
):
    sidecar = sidecar_factory()
    publish_step(checkpoint_root, tiny_model_dir, 1)
    sidecar.wait_step(1)
    nan_state = perturbed_state(tiny_model_dir, 7)
    nan_state["model.norm.weight"][3] = float("nan")
    staging = tmp_path / "staging"
    spoilers = {
        2: (_fifo_manifest, None),
        3: (_nested_manifest, None),
        4: (_zero_manifest, None),
        5: (_bad_index_types, None),
        6: (_flip_a_weight_byte, None),
        7: (lambda p: None, nan_state),
        8: (_huge_listed_file, None),
    }
    expected = {
        "2": "not_a_regular_file",
        "3": "bad_manifest",
        "4": "path_escape",
        "5": "bad_manifest",
        "6": "digest_mismatch",
        "7": "non_finite",
        "8": "too_large_for_stage",
    }
    t0 = time.monotonic()
    for step, (spoil, state) in spoilers.items():
        publish_crafted(checkpoint_root, staging, tiny_model_dir, step, spoil, state)
    wait_until(lambda: len(sidecar.status()["rejected"]) == len(expected), 90, "every rejection")
    print(f"{len(expected)} poisoned steps rejected in {time.monotonic() - t0:.2f} s")
    status = sidecar.status()
    assert status["rejected"] == expected, status["rejected"]
    assert status["loaded_step"] == 1 and status["ready"] is True
    # The copies of the steps rejected after they were staged (7: NaN found in the copy) are gone:
    # each would hold a model's worth of the stage until a later load, and leave no room meanwhile.
    assert sidecar.stage_dir is not None
    copies = sorted(p.name for p in sidecar.stage_dir.iterdir() if p.name.startswith("step-"))
    assert copies and all(n.startswith("step-00000001") for n in copies), copies
    assert generate(sglang_server.url, PROMPT, max_new_tokens=4)["meta_info"]["weight_version"] == "1"
    assert sidecar.get("/readyz").status_code == 200
    for reason in expected.values():
        assert sidecar.metric("rollout_sidecar_syncs_total", outcome="rejected", reason=reason) >= 1
    # Heartbeats go on (the trainer's ack-file wait needs them) ...
    ack = checkpoint_root / "acks" / "r0.json"
    first = ack.stat().st_mtime
    wait_until(lambda: ack.stat().st_mtime > first, 30, "a new ack heartbeat")
    # ... and a trainer waiting for a rejected step fails at once instead of timing out.
    t0 = time.monotonic()
    with pytest.raises(CheckpointRejected, match="non_finite"):
        SidecarWaiter([sidecar.url]).wait(7, timeout_s=120)
    assert time.monotonic() - t0 < 15
    # So does one that reads the ack files (expected_replicas): it waited out sync_timeout.
    t0 = time.monotonic()
    with pytest.raises(CheckpointRejected, match="replica r0 rejected checkpoint step-00000007 \\(non_finite\\)"):
        AckFileWaiter(checkpoint_root, 1, max_age_s=60).wait(7, timeout_s=120)
    assert time.monotonic() - t0 < 15
    log = sidecar.log_path.read_text()
    assert log.count("Traceback") == 0, "rejections are log lines, not tracebacks"
    # A step copied in file by file, seen while its manifest was half written, is rejected; once
    # the manifest is complete (rewritten in place: the directory itself does not change) it loads.
    whole = {}

    def half_written_manifest(path: Path) -> None:
        whole["text"] = (path / "manifest.json").read_text()
        (path / "manifest.json").write_text(whole["text"][: len(whole["text"]) // 2])

    copied = publish_crafted(checkpoint_root, staging, tiny_model_dir, 9, half_written_manifest)
    wait_until(lambda: sidecar.status()["rejected"].get("9") == "bad_manifest", 60, "the half-written step rejected")
    (copied / "manifest.json").write_text(whole["text"])
    sidecar.wait_step(9)
    assert "9" not in sidecar.status()["rejected"]
    assert sidecar.status()["last_error"] is None or sidecar.status()["last_error"]["step"] != 9


def test_wait_answers_only_for_the_run_and_bytes_sglang_serves(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir
):
    sidecar = sidecar_factory()
    for step in (1, 2, 3):
        publish_checkpoint(
            checkpoint_root,
            step,
            perturbed_state(tiny_model_dir, step).items(),
            config=tiny_model_dir / "config.json",
            run_id="runA",
        )
    sidecar.wait_step(3)
    assert sidecar.status()["loaded_run_id"] == "runA"
    # A new run reuses the root: emptied, then its own step 1.
    for step in (1, 2, 3):
        shutil.rmtree(checkpoint_root / f"step-{step:08d}")
    r = sidecar.get("/wait?version=1&timeout=3")
    assert r.status_code == 504, "step 3 of the old run is gone: /wait must not say step 1 is served"
    new_state = perturbed_state(tiny_model_dir, 101)
    answers: dict = {}

    def wait_new_run():
        r = sidecar.get("/wait?version=1&run=runB&timeout=120", timeout=150)
        answers["wait"] = r
        answers["served_then"] = httpx.get(f"{sglang_server.url}/model_info", timeout=30).json()

    t = threading.Thread(target=wait_new_run)
    t.start()
    time.sleep(1.0)
    publish_checkpoint(checkpoint_root, 1, new_state.items(), config=tiny_model_dir / "config.json", run_id="runB")
    t.join(180)
    assert answers["wait"].status_code == 200, answers["wait"].text
    assert answers["wait"].json()["loaded_run_id"] == "runB"
    assert answers["served_then"]["weight_version"] == "1"
    assert generate(sglang_server.url, PROMPT, max_new_tokens=8, ignore_eos=True)["output_ids"] == transformers_greedy(
        tiny_model_dir, new_state, PROMPT, 8
    )
    # The same step republished with other bytes is loaded again.
    before = sidecar.status()["loaded_fingerprint"]
    shutil.rmtree(checkpoint_root / "step-00000001")
    republished = perturbed_state(tiny_model_dir, 202)
    publish_checkpoint(checkpoint_root, 1, republished.items(), config=tiny_model_dir / "config.json", run_id="runB")
    wait_until(
        lambda: sidecar.status()["loaded_fingerprint"] not in (None, before) and sidecar.status()["loaded_current"],
        60,
        "the republished step 1",
    )
    assert generate(sglang_server.url, PROMPT, max_new_tokens=8, ignore_eos=True)["output_ids"] == transformers_greedy(
        tiny_model_dir, republished, PROMPT, 8
    )
    assert sidecar.get("/wait?version=1&run=runA&timeout=1").status_code == 504
    # The trainer's waiters carry the run id their publisher stamps into every manifest.
    for waiter in (SidecarWaiter([sidecar.url]), AckFileWaiter(checkpoint_root, 1, max_age_s=60)):
        waiter.run_id = "runA"
        with pytest.raises(ReplicaSyncTimeout):
            waiter.wait(1, timeout_s=3)
        waiter.run_id = "runB"
        [view] = waiter.wait(1, timeout_s=30)
        assert view.run_id == "runB" and view.loaded_step == 1


def test_sync_api_bounds_bodies_and_answers_bad_input_with_400(sidecar_factory, checkpoint_root, tmp_path):
    """POST /sync refuses a body over its 4 KiB bound (streamed or not) with 413 without buffering it,
    stays healthy, and answers every malformed body or /wait query with 400."""
    sidecar = sidecar_factory("--token", "tok")
    auth = {"Authorization": "Bearer tok"}
    proc = psutil.Process(sidecar.proc.pid)
    rss_before = proc.memory_info().rss
    blocks = 300
    sent = 0

    def chunks():
        nonlocal sent
        block = b"x" * (1 << 20)
        for _ in range(blocks):
            sent += 1
            yield block

    try:
        r = httpx.post(f"{sidecar.url}/sync", content=chunks(), headers=auth, timeout=60)
    except httpx.HTTPError:
        # The sidecar closed the connection instead of answering: that must have been once it had
        # refused the body (only what the loopback socket buffers hold, a few MiB, got out of the
        # generator), and it must still answer.
        assert sent < blocks // 5, f"the connection closed only after {sent} of {blocks} MiB were uploaded"
        assert sidecar.get("/healthz").status_code == 200
    else:
        # uvicorn reads and drops the rest of a refused body, and httpx sends a whole body before it
        # reads the answer, so this 413 comes after all of it (not buffered: the RSS check below).
        assert r.status_code == 413 and len(r.content) < 1000, (r.status_code, r.content[:200])
    r = httpx.post(
        f"{sidecar.url}/sync",
        content=b"y" * (300 << 10),
        headers={**auth, "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and b"yyyy" not in r.content
    assert proc.memory_info().rss - rss_before < 50 << 20, "a large body must not be buffered"
    as_json = {**auth, "content-type": "application/json"}
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b'{"checkpoint": 5}', b"[" * 3000):
        r = httpx.post(f"{sidecar.url}/sync", content=body, headers=as_json, timeout=30)
        assert r.status_code == 400, (body[:20], r.status_code, r.text)
    r = httpx.post(f"{sidecar.url}/sync", content=b'{"checkpoint": "step-00000001"}', headers=auth, timeout=30)
    assert r.status_code == 415, (r.status_code, r.text)  # a body not sent as JSON (a browser's text/plain)
    outside = tmp_path / "secret-place"
    outside.mkdir()
    (checkpoint_root / "step-00000004").symlink_to(outside)
    r = httpx.post(f"{sidecar.url}/sync", json={"checkpoint": "step-00000004"}, headers=auth, timeout=30)
    assert r.status_code == 400 and "secret-place" not in r.text
    for query in ("version=abc", "version=-1", "version=1&timeout=nan", "version=1&run=../x", "version=100000000"):
        assert sidecar.get(f"/wait?{query}").status_code == 400, query
    assert sidecar.get("/healthz").status_code == 200


def test_readyz_follows_a_frozen_sglang_and_a_freeze_is_not_a_restart(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir
):
    sidecar = sidecar_factory()
    publish_step(checkpoint_root, tiny_model_dir, 1)
    sidecar.wait_step(1)
    assert sidecar.get("/readyz").status_code == 200
    group = sglang_server.pgid
    os.killpg(group, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        wait_until(lambda: sidecar.get("/readyz", timeout=5).status_code == 503, 30, "readyz 503")
        frozen_s = time.monotonic() - t0
        body = sidecar.get("/readyz").json()
        assert "not answered" in body["reason"], body
        # /status never waits on SGLang: a call to the frozen SGLang takes the sidecar's 10 s request
        # timeout (SidecarSettings.request_timeout_s) to fail, so /status must answer before that
        # (8 s, not less: a loaded 2-core machine may be slow, but never 8 s slow for a local answer).
        assert sidecar.get("/status", timeout=8).status_code == 200
    finally:
        os.killpg(group, signal.SIGCONT)
    print(f"/readyz turned 503 {frozen_s:.1f} s after SGLang froze")
    wait_until(lambda: sidecar.get("/readyz").status_code == 200, 90, "readyz 200 again")
    assert sidecar.metric("rollout_sidecar_sglang_restarts_total") == 0
    assert sidecar.status()["loaded_step"] == 1


def test_a_failing_loop_backs_off_logs_once_and_recovers(sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path):
    sidecar = sidecar_factory()
    publish_step(checkpoint_root, tiny_model_dir, 1)
    sidecar.wait_step(1)
    moved = tmp_path / "moved-away"
    os.rename(checkpoint_root, moved)
    checkpoint_root.write_text("not a directory")  # every listing of the root now fails
    try:
        wait_until(lambda: (sidecar.status()["last_error"] or {}).get("reason") == "loop_error", 30, "a loop error")
        first = sidecar.status()["loop_errors"]
        time.sleep(6)
        status = sidecar.status()
        # Without back-off the loop would fail every 0.5 s health interval (or faster): 2 phases x 12.
        assert status["loop_errors"] - first <= 8, status["loop_errors"] - first
        assert "NotADirectoryError" in status["last_error"]["message"]
        assert sidecar.get("/healthz").status_code == 200
        log = sidecar.log_path.read_text()
        assert 1 <= log.count("Traceback") <= 3, "one traceback per distinct error, not one per pass"
    finally:
        checkpoint_root.unlink()
        os.rename(moved, checkpoint_root)
    publish_step(checkpoint_root, tiny_model_dir, 2)
    sidecar.wait_step(2, timeout_s=90)
    assert sidecar.get("/readyz").status_code == 200


def test_a_writer_changing_files_during_the_sync_never_reaches_sglang(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path
):
    """Time of check to time of use: a stray writer keeps corrupting and restoring a published
    shard's header while the sidecar syncs. SGLang only ever reads the verified stage copy."""
    sidecar = sidecar_factory()
    publish_step(checkpoint_root, tiny_model_dir, 1)
    sidecar.wait_step(1)
    state = perturbed_state(tiny_model_dir, 2)
    path = publish_checkpoint(tmp_path / "side", 2, state.items(), config=tiny_model_dir / "config.json").path
    shard = path / "model.safetensors"
    good = shard.read_bytes()[:8]
    bad = (10**9).to_bytes(8, "little")  # a header length beyond the file
    stop = threading.Event()

    def stray_writer():
        fd = os.open(final / "model.safetensors", os.O_WRONLY)
        try:
            while not stop.is_set():
                for head in (bad, good):
                    os.pwrite(fd, head, 0)
        finally:
            os.pwrite(fd, good, 0)
            os.close(fd)

    final = checkpoint_root / path.name
    os.rename(path, final)
    writer = threading.Thread(target=stray_writer)
    writer.start()
    try:
        time.sleep(5)
    finally:
        stop.set()
        writer.join()
    assert sglang_health(sglang_server.url) == 200
    assert sidecar.metric("rollout_sidecar_sglang_restarts_total") == 0
    status = sidecar.status()
    if status["loaded_step"] == 2:  # it staged a moment when the bytes were whole: those are served
        assert generate(sglang_server.url, PROMPT, max_new_tokens=8, ignore_eos=True)[
            "output_ids"
        ] == transformers_greedy(tiny_model_dir, state, PROMPT, 8)
    else:
        assert status["rejected"].get("2") in ("digest_mismatch", "header_invalid", "changed_while_staging")
    served = httpx.get(f"{sglang_server.url}/model_info", timeout=30).json()["model_path"]
    assert not served.startswith(str(checkpoint_root))


def test_a_validation_blocked_past_its_deadline_holds_off_the_next_until_it_ends(
    sglang_server, checkpoint_root, tiny_model_dir, tmp_path
):
    # The sidecar's own loop, in this process, against the real SGLang; what is simulated is
    # storage that hangs: reading step 2 blocks until the test lets it go. Its validation is
    # given up on at its deadline (step 2 rejected), but its thread still works in the stage,
    # so no other validation may start there until it ends.
    import asyncio

    from rollout_service.sidecar.controller import SyncController
    from rollout_service.sidecar.settings import SidecarSettings

    settings = SidecarSettings(
        checkpoint_path=checkpoint_root,
        sglang_url=sglang_server.url,
        replica_id="straggler",
        stage_dir=tmp_path / "stage",
        health_interval_s=0.2,
        validate_timeout_s=1.0,
    )
    controller = SyncController(settings)
    release, started = threading.Event(), []
    real_prepare = controller._prepare

    def prepare(path: Path):
        started.append(path.name)
        if path.name == "step-00000002":
            release.wait(120)
        return real_prepare(path)

    controller._prepare = prepare  # type: ignore[method-assign]

    async def until(predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"{what}: {controller.state.to_dict()}"
            await asyncio.sleep(0.1)

    async def scenario() -> None:
        loop = asyncio.create_task(controller.run())
        try:
            publish_step(checkpoint_root, tiny_model_dir, 1)
            await until(lambda: controller.state.loaded_step == 1, 120, "step 1 loaded")
            publish_step(checkpoint_root, tiny_model_dir, 2)
            await until(lambda: controller.state.rejected.get(2) == "validation_timeout", 60, "step 2 given up on")
            publish_step(checkpoint_root, tiny_model_dir, 3)
            await until(
                lambda: (controller.state.last_error or {}).get("reason") == "validation_stuck", 30, "step 3 held off"
            )
            await asyncio.sleep(1.0)
            assert "step-00000003" not in started and controller.state.loaded_step == 1
            release.set()
            await until(lambda: controller.state.loaded_step == 3, 120, "step 3 loaded once step 2's read ended")
            assert started.count("step-00000002") == 1
        finally:
            release.set()
            await controller.stop()
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop

    asyncio.run(scenario())
    assert generate(sglang_server.url, PROMPT, max_new_tokens=2)["meta_info"]["weight_version"] == "3"


def test_a_rejection_stands_while_its_step_cannot_be_looked_at(checkpoint_root, tiny_model_dir, monkeypatch):
    """A rejection lifts when its step is republished or gone, not when a look at it fails (EIO,
    ESTALE on a network file system: simulated, as no real one fails on demand): a step that
    crashed SGLang is not loaded again, nor its crash count reset, by a passing storage error."""
    import errno

    from rollout_service.sidecar import controller as controller_module
    from rollout_service.sidecar.controller import SyncController
    from rollout_service.sidecar.settings import SidecarSettings

    controller = SyncController(
        SidecarSettings(checkpoint_path=checkpoint_root, sglang_url="http://127.0.0.1:9", replica_id="eio")
    )
    path = publish_step(checkpoint_root, tiny_model_dir, 2).path
    controller.state.rejected[2] = "sglang_crashed_on_load"
    controller._rejected_at[2] = controller_module._read_identity(path)
    controller._crashes[2] = 2
    real_stat = os.stat
    failing: dict[str, OSError] = {}

    def stat(p, *args, **kw):
        if str(p) in failing:
            raise failing[str(p)]
        return real_stat(p, *args, **kw)

    monkeypatch.setattr(controller_module.os, "stat", stat)

    def still_rejected() -> bool:
        candidates, identities = controller._listing()
        assert [c.step for c in candidates] == [2]
        return controller._still_rejected(2, identities)

    assert still_rejected()  # unchanged
    failing[str(path)] = OSError(errno.EIO, "Input/output error")
    assert still_rejected() and controller._crashes[2] == 2
    failing[str(path)] = OSError(errno.ESTALE, "Stale file handle")
    assert still_rejected() and controller._crashes[2] == 2
    failing.clear()
    assert still_rejected()
    shutil.rmtree(path)
    publish_step(checkpoint_root, tiny_model_dir, 2)  # republished: looked at anew
    assert not still_rejected() and 2 not in controller.state.rejected and 2 not in controller._crashes


def test_a_rejection_about_a_files_contents_ends_when_that_file_is_completed(checkpoint_root, tiny_model_dir):
    """A checkpoint copied in file by file with its manifest first is seen with a shard cut short
    (``truncated``); once the copy completes the shard in place, the step is looked at anew.
    A rejection about the manifest itself (``bad_manifest``) stands whatever the other files do."""
    from rollout_service.sidecar import controller as controller_module
    from rollout_service.sidecar.controller import SyncController
    from rollout_service.sidecar.settings import SidecarSettings

    controller = SyncController(
        SidecarSettings(checkpoint_path=checkpoint_root, sglang_url="http://127.0.0.1:9", replica_id="copy")
    )
    path = publish_step(checkpoint_root, tiny_model_dir, 2).path
    shard = next(path.glob("*.safetensors"))
    whole = shard.read_bytes()
    with open(shard, "r+b") as f:  # the copy so far: the manifest and half the shard
        f.truncate(len(whole) // 2)

    def rejected_now(reason: str) -> None:
        controller.state.rejected[2] = reason
        controller._rejected_at[2] = controller_module._publication_identity(path)  # as _try_load records it

    def still_rejected() -> bool:
        return controller._still_rejected(2, controller._listing()[1])

    rejected_now("truncated")
    assert still_rejected()
    time.sleep(0.01)
    with open(shard, "r+b") as f:  # the copy goes on, in place
        f.write(whole)
    assert not still_rejected() and 2 not in controller.state.rejected
    rejected_now("bad_manifest")
    with open(shard, "r+b") as f:
        f.write(whole[:16])
    os.utime(shard)
    assert still_rejected()


def test_a_restarted_sidecar_without_a_stage_learns_the_served_tensors_from_the_launch_model_only(
    sglang_server_at_base, sidecar_factory, checkpoint_root, tiny_model_dir
):
    """Without a stage SGLang serves a step of the root itself; a sidecar restarted beside it
    learns the served tensors from the model SGLang was started from (``/server_info``), never
    from the step's folder, which may have changed since SGLang read it: not from a stray
    ``.safetensors`` file dropped there meanwhile (whose shapes would then reject every good step,
    or let a bad one through; session 26: nor from the step's own, republished, shards)."""
    from safetensors.torch import save_file

    sidecar = sidecar_factory("--no-stage", replica_id="nostage")
    publish_step(checkpoint_root, tiny_model_dir, 1)
    sidecar.wait_step(1)
    sidecar.stop()
    stray = {name: torch.zeros(3, 3) for name in perturbed_state(tiny_model_dir, 1)}
    save_file(stray, str(checkpoint_root / "step-00000001" / "zz-stray.safetensors"))
    again = sidecar_factory("--no-stage", replica_id="nostage")
    publish_step(checkpoint_root, tiny_model_dir, 2)
    status = again.wait_step(2)
    assert status["rejected"] == {} and str(tiny_model_dir) in status["reference"], status


def test_without_a_stage_a_materialized_step_published_again_loads_once_and_stays_served(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir
):
    """A published manifest that carries ``extra.reconstructed_from`` (a materialized step copied
    back into the root) stands for itself when SGLang reads it in place: it loads once, /wait
    confirms it, and the loop does not take it for a changed step and reload it at every pass."""
    path = publish_step(checkpoint_root, tiny_model_dir, 1).path
    data = json.loads((path / "manifest.json").read_text())
    data.setdefault("extra", {})["reconstructed_from"] = {"fingerprint": "cd" * 16, "kind": "delta", "chain_start": 1}
    (path / "manifest.json").write_text(json.dumps(data))
    sidecar = sidecar_factory("--no-stage", replica_id="restored")
    status = sidecar.wait_step(1)
    assert status["loaded_current"] and status["rejected"] == {}, status
    time.sleep(3.0)  # several passes (--health-interval 0.5)
    assert sidecar.metric("rollout_sidecar_syncs_total", outcome="loaded", reason="ok") == 1
    assert sidecar.wait_step(1, timeout_s=10)["loaded_current"]


def test_a_step_named_link_is_rejected_and_never_reaches_sglang(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path
):
    """A link named like a step, to a valid step inside the root (a review, session 31): the
    trainer's numbering and retention never count it, so serving it would pin the replica to a
    step the trainer does not know of. Refused as not_a_checkpoint; the served step stays, and
    the trainer's next step loads."""
    sidecar = sidecar_factory()
    publish_step(checkpoint_root, tiny_model_dir, 1)
    sidecar.wait_step(1)
    aside = checkpoint_root / ".aside"
    os.rename(publish_step(tmp_path / "elsewhere", tiny_model_dir, 99).path, aside)
    os.symlink(aside.name, checkpoint_root / "step-00000099")
    wait_until(lambda: "99" in sidecar.status()["rejected"], 60, "the step-named link rejected")
    status = sidecar.status()
    assert status["rejected"]["99"] == "not_a_checkpoint" and status["loaded_step"] == 1, status
    assert generate(sglang_server.url, PROMPT, max_new_tokens=4)["meta_info"]["weight_version"] == "1"
    publish_step(checkpoint_root, tiny_model_dir, 2)
    assert sidecar.wait_step(2)["loaded_step"] == 2
