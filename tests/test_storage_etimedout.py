"""The storage's own ``ETIMEDOUT`` (an NFS ``softerr`` mount, a FUSE backend) is not the
sidecar's time bound running out.

Python makes ``OSError(errno.ETIMEDOUT, ...)`` a ``TimeoutError``, the class ``asyncio.wait_for``
raises, so every bound around a look at the root took the storage's error for its own: the root
gate said "did not come back within 10 s" after a millisecond, a validation that failed so was
rejected as ``validation_timeout`` ("did not finish within 600 s"), ``POST /sync`` said the lookup
"took more than 4 s". Each now says what happened. The storage is a function raising the error
(no file system here can be made to time out on cue); the sync loop and the app are real.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.sidecar.app import create_app
from rollout_service.sidecar.root_gate import RootGate, RootUnresponsive, StorageTimedOut, in_daemon_thread
from rollout_service.sidecar.settings import SidecarSettings
from test_sync_loop_hazards import CONFIG, RUN, make, run_with, tensors, until


def timed_out(path: Path) -> OSError:
    return OSError(errno.ETIMEDOUT, "Connection timed out", str(path))


def test_the_root_gate_says_the_storage_timed_out_not_its_bound(tmp_path: Path) -> None:
    gate = RootGate(tmp_path, 10.0)

    def look() -> None:
        raise timed_out(tmp_path / "step-00000001")

    async def scenario() -> tuple[BaseException, float]:
        t0 = time.monotonic()
        with pytest.raises(RootUnresponsive) as raised:
            await gate.call(look, what="listing the root")
        return raised.value, time.monotonic() - t0

    exc, took = asyncio.run(scenario())
    assert took < 5
    assert "listing the root timed out in the storage" in str(exc) and "within 10 s" not in str(exc), exc


def test_a_threads_etimedout_is_an_oserror_and_no_timeout(tmp_path: Path) -> None:
    async def scenario() -> BaseException:
        future = in_daemon_thread(lambda: (_ for _ in ()).throw(timed_out(tmp_path)), name="t")
        try:
            await asyncio.wait_for(future, 10)
        except BaseException as exc:
            return exc
        raise AssertionError("no error")

    exc = asyncio.run(scenario())
    assert isinstance(exc, StorageTimedOut) and isinstance(exc, OSError)
    assert not isinstance(exc, TimeoutError) and exc.errno == errno.ETIMEDOUT
    # A bound of the thread's own (asyncio's, no errno) still is one.
    plain = asyncio.run(_raise_in_thread(TimeoutError()))
    assert type(plain) is TimeoutError


async def _raise_in_thread(error: BaseException) -> BaseException:
    def fail() -> None:
        raise error

    try:
        await in_daemon_thread(fail, name="t")
    except BaseException as exc:
        return exc
    raise AssertionError("no error")


def test_a_step_whose_read_times_out_in_the_storage_is_not_called_a_validation_timeout(tmp_path: Path) -> None:
    root, c, fake = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    real_prepare = c._prepare

    def prepare(path: Path):
        if path.name == "step-00000002":
            raise timed_out(path / "model.safetensors")
        return real_prepare(path)

    c._prepare = prepare  # type: ignore[method-assign]

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: 2 in c.state.rejected, timeout_s=30)

    run_with(c, during)
    assert c.state.rejected[2] == "unreadable", c.state.rejected
    assert "Connection timed out" in c.state.last_error["message"], c.state.last_error


def test_post_sync_says_the_lookup_timed_out_in_the_storage(tmp_path: Path, monkeypatch) -> None:
    settings = SidecarSettings(checkpoint_path=tmp_path, sglang_url="http://127.0.0.1:9", replica_id="r", stage=False)
    app = create_app(settings)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        controller = app.state.controller

        def lookup(name: str) -> Path:
            raise timed_out(tmp_path / name)

        monkeypatch.setattr(controller, "request_checkpoint", lookup)
        answer = client.post("/sync", json={"checkpoint": "step-00000001"})
    assert answer.status_code == 503, answer.text
    detail = answer.json()["detail"]
    assert "timed out in the storage" in detail and "took more than" not in detail, detail


def _eio(path: Path) -> OSError:
    from rollout_service.untrusted_files import UnreadableFile

    return UnreadableFile(errno.EIO, f"{path.name} cannot be read: Input/output error (the storage failed)")


def test_one_storage_blip_reading_a_step_costs_no_step(tmp_path: Path) -> None:
    """An EIO on a step's file (a Ceph or FUSE blip) while the root answers rejected the step for
    good, and every trainer waiting for it stopped with CheckpointRejected."""
    root, c, fake = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    real_prepare = c._prepare
    failed: list[str] = []

    def prepare(path: Path):
        if path.name == "step-00000002" and not failed:
            failed.append(path.name)
            raise _eio(path / "model.safetensors")
        return real_prepare(path)

    c._prepare = prepare  # type: ignore[method-assign]

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: c.state.loaded_step == 2 or 2 in c.state.rejected, timeout_s=30)

    run_with(c, during)
    assert failed and 2 not in c.state.rejected and c.state.loaded_step == 2


def test_a_step_the_storage_fails_at_every_read_is_rejected(tmp_path: Path) -> None:
    root, c, fake = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    real_prepare = c._prepare
    tries: list[str] = []

    def prepare(path: Path):
        if path.name == "step-00000002":
            tries.append(path.name)
            raise _eio(path / "model.safetensors")
        return real_prepare(path)

    c._prepare = prepare  # type: ignore[method-assign]
    errors: list[str] = []

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: (c.state.last_error or {}).get("reason") == "storage_error" or 2 in c.state.rejected)
        errors.append((c.state.last_error or {}).get("reason", ""))
        await until(lambda: 2 in c.state.rejected, timeout_s=30)

    run_with(c, during)
    assert errors == ["storage_error"]
    assert c.state.rejected[2] == "unreadable" and len(tries) == 2 and c.state.loaded_step == 1


def test_a_root_whose_own_look_fails_too_rejects_nothing(tmp_path: Path, monkeypatch) -> None:
    """The look at the root after a failed validation counted an OSError (EIO on the root itself:
    a soft mount whose server is gone) as "the root answered", and rejected the step."""
    from rollout_service.sidecar import controller as controller_module

    root, c, fake = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    real_prepare, real_look = c._prepare, controller_module._look_at
    down: list[bool] = []

    def prepare(path: Path):
        if path.name == "step-00000002" and len(down) < 3:
            down.append(True)
            raise _eio(path / "model.safetensors")
        return real_prepare(path)

    def look(path: Path) -> None:
        if down and len(down) < 3:
            raise OSError(errno.EIO, "Input/output error", str(path))
        real_look(path)

    c._prepare = prepare  # type: ignore[method-assign]
    monkeypatch.setattr(controller_module, "_look_at", look)

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: c.state.loaded_step == 2 or 2 in c.state.rejected, timeout_s=30)

    run_with(c, during)
    assert len(down) == 3 and 2 not in c.state.rejected and c.state.loaded_step == 2


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [(errno.EIO, 503, "storage_error"), (errno.ESTALE, 503, "storage_error"), (errno.ENAMETOOLONG, 400, "bad_request")],
)
def test_post_sync_tells_a_storage_fault_from_a_bad_name(tmp_path: Path, monkeypatch, code, status, error) -> None:
    """An EIO looking up the named step was answered 400 "cannot use that checkpoint name", as if
    the client had sent a bad name."""
    settings = SidecarSettings(checkpoint_path=tmp_path, sglang_url="http://127.0.0.1:9", replica_id="r", stage=False)
    app = create_app(settings)
    with TestClient(app, base_url="http://127.0.0.1") as client:

        def lookup(name: str) -> Path:
            raise OSError(code, os.strerror(code), str(tmp_path / name))

        monkeypatch.setattr(app.state.controller, "request_checkpoint", lookup)
        answer = client.post("/sync", json={"checkpoint": "step-00000001"})
    assert answer.status_code == status and answer.json()["error"] == error, answer.text


@pytest.mark.parametrize("staged", [False, True], ids=["no-stage", "staged"])
@pytest.mark.parametrize("call", ["read", "open"])
def test_one_eio_in_the_real_readers_costs_no_step(tmp_path: Path, monkeypatch, call: str, staged: bool) -> None:
    """The readers that do a step's reads (a shard's header and bytes, its open) raised a plain
    ``CheckpointError('unreadable')`` for the storage's EIO: the step was rejected at once."""
    import rollout_service.untrusted_files as untrusted_files

    root, c, fake = make(tmp_path) if staged else make(tmp_path, stage=False, stage_dir=None)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    failed: list[str] = []

    def hit(target: str) -> bool:
        if not failed and "/root/step-00000002/" in target and target.endswith(".safetensors"):
            failed.append(target)
            return True
        return False

    if call == "read":
        real_read = os.preadv

        def read(fd: int, *args: object, **kwargs: object) -> int:
            if hit(os.readlink(f"/proc/self/fd/{fd}")):
                raise OSError(errno.EIO, "Input/output error")
            return real_read(fd, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "preadv", read)
    else:
        real_open = untrusted_files._open_beneath

        def open_(top: str, path: Path, flags: int, where: str) -> int:
            if hit(str(path)):
                raise OSError(errno.EIO, "Input/output error")
            return real_open(top, path, flags, where)

        monkeypatch.setattr(untrusted_files, "_open_beneath", open_)

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: c.state.loaded_step == 2 or 2 in c.state.rejected, timeout_s=30)

    run_with(c, during)
    assert failed, "the blip was never hit"
    assert 2 not in c.state.rejected and c.state.loaded_step == 2, (c.state.rejected, c.state.last_error)


def test_post_sync_on_a_step_the_storage_fails_to_look_at_is_a_503(tmp_path: Path, monkeypatch) -> None:
    """The lookup's own look at the named step (not a stub of it): an EIO there is the storage's."""
    publish_checkpoint(tmp_path, 1, tensors(1), config=CONFIG, run_id=RUN)
    settings = SidecarSettings(checkpoint_path=tmp_path, sglang_url="http://127.0.0.1:9", replica_id="r", stage=False)
    target = str(tmp_path / "step-00000001")
    real_stat = os.stat

    def failing_stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.fspath(path) == target:
            raise OSError(errno.EIO, "Input/output error", target)
        return real_stat(path, *args, **kwargs)

    def lenient_is_dir(self: Path) -> bool:  # Python 3.13's: any OSError is "not a directory"
        try:
            return stat.S_ISDIR(os.stat(self).st_mode)
        except OSError:
            return False

    with TestClient(create_app(settings), base_url="http://127.0.0.1") as client:
        monkeypatch.setattr(os, "stat", failing_stat)
        monkeypatch.setattr(Path, "is_dir", lenient_is_dir)  # (3.11's raises the EIO itself)
        answer = client.post("/sync", json={"checkpoint": "step-00000001"})
        monkeypatch.undo()
    assert answer.status_code == 503 and answer.json()["error"] == "storage_error", answer.text


def test_a_hung_model_folder_is_named_and_keeps_no_look_at_the_root_waiting(tmp_path: Path, monkeypatch) -> None:
    """The served model's files (its folder, the Hugging Face cache, --reference-dir) may be on
    another mount than the checkpoint root: a look there that hung went through the root's gate,
    so the root was reported "not answering" and every look at it refused behind the blocked one."""
    import threading

    from rollout_service.sidecar import controller as controller_module

    root, c, fake = make(tmp_path)
    c.settings.root_timeout_s = 0.5
    c.root_gate.timeout_s = c.wait_gate.timeout_s = c.model_gate.timeout_s = 0.5
    release = threading.Event()
    real_find = controller_module.find_reference

    def hung_find(*args, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(30)
        return real_find(*args, **kwargs)

    monkeypatch.setattr(controller_module, "find_reference", hung_find)

    async def during() -> None:
        await until(lambda: (c.state.last_error or {}).get("reason") == "model_unresponsive", timeout_s=30)
        heartbeat = c.state.loop_heartbeat
        await until(lambda: c.state.loop_heartbeat != heartbeat, timeout_s=30)  # the loop goes on
        assert c.root_gate.problem is None and c.state.root_problem is None
        assert "the served model's files" in c.state.last_error["message"]
        await c._publish_state()  # a listing of the root: not refused behind the model's look
        release.set()
        publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
        await until(lambda: c.state.loaded_step == 1, timeout_s=30)

    try:
        run_with(c, during)
    finally:
        release.set()
