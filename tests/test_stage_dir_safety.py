"""The stage touches only what it made, tells its own failures from the checkpoint's, and fits
in the room it documents (no SGLang here: the sync loop runs in-process with a fake client).

- A ``--stage-dir`` that holds other things (the folder around the checkpoint root, ``$HOME``,
  ``/dev/shm`` itself) is refused, never cleaned; a stage only ever removes its own names.
- A write that fails in the stage (ENOSPC) is the stage's fault (``StageError``, tried again),
  a read that fails in the root stays the checkpoint's.
- A replica two deltas behind needs room for three copies and says so; a failed chain leaves
  nothing behind; a re-sync of a step already staged reads nothing from shared storage; the
  spare copy counts as room.
- A FIFO where the stage keeps its own files cannot block the sidecar.
- A killed sidecar's stage in /dev/shm is reclaimed by the next one, whatever its replica id.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import uuid
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from delta_helpers import CONFIG, RUN, Model, assert_same_files, publish_both
from rollout_service import delta_apply, untrusted_files
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar import staging
from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.staging import LOCK_NAME, REFERENCE_NAME, Stage, StageError
from rollout_service.untrusted_files import Deadline
from sidecar_helpers import AcceptingSGLang, run_loop_until

DiskUsage = namedtuple("DiskUsage", "total used free")


# --- helpers ---------------------------------------------------------------------------------
def controller_for(root: Path, stage_dir: Path, reference: Path) -> tuple[SyncController, AcceptingSGLang]:
    settings = SidecarSettings(
        checkpoint_path=root,
        sglang_url="http://127.0.0.1:9",
        replica_id="r0",
        stage_dir=stage_dir,
        reference_dir=reference,
        health_interval_s=0.05,
        poll_interval_s=0.05,
    )
    client = AcceptingSGLang(reference)
    return SyncController(settings, client=client), client


def within(fn: Callable[[], Any], seconds: float = 5.0) -> Any:
    """``fn()``'s result or exception, run in a daemon thread: a call that blocks fails the test
    instead of hanging it."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def copies(stage: Stage) -> list[str]:
    return sorted(p.name for p in stage.path.iterdir() if p.name.startswith("step-"))


def build(stage: Stage, root: Path, step: int, **kw: Any) -> staging.StagedBuild:
    path = root / step_dir_name(step)
    return stage.build(root, path, Manifest.load(path), Deadline(60), **kw)


def delta_chain(tmp_path: Path, steps: int) -> tuple[Path, Path]:
    """Steps 1 (full) .. ``steps`` (deltas) under ``tmp_path/root``, each also published in full
    under ``tmp_path/full`` (what a rebuild must equal)."""
    root, full_root = tmp_path / "root", tmp_path / "full"
    model, writer = Model(lr=1e-6), DeltaCheckpointWriter(full_every=100)
    for step in range(1, steps + 1):
        publish_both(writer, root, full_root, step, model)
        model.step()
    return root, full_root


def model_bytes(root: Path) -> int:
    return Manifest.load(root / step_dir_name(1)).total_bytes


def fake_room(monkeypatch, stage: Stage, total: int, taken: Callable[[], int] = lambda: 0) -> None:
    """The stage's file system holds ``total`` bytes, of which the stage's files (and ``taken()``)
    use some: room measured in model copies without filling a real disk."""

    def usage(path: Any) -> DiskUsage:
        used = stage.usage_bytes() + taken()
        return DiskUsage(total, used, total - used)

    monkeypatch.setattr(staging.shutil, "disk_usage", usage)


# --- 1. only what the stage made --------------------------------------------------------------
def test_a_folder_holding_other_files_is_refused_and_left_untouched(tmp_path: Path) -> None:
    base = tmp_path / "work"
    publish_checkpoint(base / "ckpts", 1, Model().tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    (base / "precious.txt").write_text("user data")
    (base / "other-model").mkdir()
    (base / "other-model" / "w.bin").write_bytes(b"x" * 100)
    before = names(base)
    with pytest.raises(StageError, match=rf"--stage-dir {base} holds entries the stage did not make") as info:
        Stage(base)
    assert "'precious.txt'" in str(info.value) and "marker" in str(info.value)
    assert "Pass a new or empty folder" in str(info.value)
    assert names(base) == before  # not even a lock file was made there
    assert (base / "ckpts" / step_dir_name(1) / "manifest.json").is_file()


def test_the_settings_refuse_a_stage_dir_around_the_root_the_reference_or_home(tmp_path: Path, monkeypatch) -> None:
    base = tmp_path / "work"
    (base / "ckpts").mkdir(parents=True)
    (base / "model").mkdir()
    with pytest.raises(ValueError, match=r"--stage-dir .* holds the checkpoint root \(--checkpoint-path .*ckpts\)"):
        SidecarSettings(checkpoint_path=base / "ckpts", sglang_url="http://127.0.0.1:9", stage_dir=base)
    elsewhere = tmp_path / "ckpts2"
    elsewhere.mkdir()
    with pytest.raises(ValueError, match=r"--stage-dir .* holds --reference-dir .*model"):
        SidecarSettings(
            checkpoint_path=elsewhere, sglang_url="http://127.0.0.1:9", stage_dir=base, reference_dir=base / "model"
        )
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for shared in (tmp_path / "home", Path("/dev/shm")):
        with pytest.raises(ValueError, match="is a folder other programs keep files in"):
            SidecarSettings(checkpoint_path=elsewhere, sglang_url="http://127.0.0.1:9", stage_dir=shared)
    with pytest.raises(ValueError, match="is inside the checkpoint root"):  # as before
        SidecarSettings(checkpoint_path=base, sglang_url="http://127.0.0.1:9", stage_dir=base / "ckpts" / "st")
    fine = SidecarSettings(checkpoint_path=elsewhere, sglang_url="http://127.0.0.1:9", stage_dir=base / "stage")
    assert fine.stage_dir == base / "stage"


def test_a_sidecar_pointed_at_a_foreign_folder_stops_with_a_reason_and_deletes_nothing(tmp_path: Path) -> None:
    root, reference = tmp_path / "root", tmp_path / "ref"
    model = Model()
    publish_checkpoint(reference, 0, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    publish_checkpoint(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    foreign = tmp_path / "home-like"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone's file")
    (foreign / ".tmp-editor-swap").write_text("a name like the stage's own work")
    controller, client = controller_for(root, foreign, reference / step_dir_name(0))
    run_loop_until(controller, lambda: controller.state.fatal is not None)
    ready, why = controller.readiness()
    assert not ready and why.startswith(f"stage_failed: --stage-dir {foreign} holds entries"), why
    assert names(foreign) == [".tmp-editor-swap", "notes.txt"] and not client.loads


def test_prune_and_remove_touch_only_the_stages_own_names(tmp_path: Path) -> None:
    root, _ = delta_chain(tmp_path, 2)
    stage = Stage(tmp_path / "stage")
    first = build(stage, root, 1)
    (stage.path / "notes.txt").write_text("put here by hand")
    (stage.path / "base-model").mkdir()
    (stage.path / "base-model" / "model.safetensors").write_bytes(b"weights")
    second = build(stage, root, 2)
    stage.prune({second.path}, keep_spare=False)
    assert copies(stage) == [second.path.name] and not first.path.exists()
    assert (stage.path / "notes.txt").is_file() and (stage.path / "base-model" / "model.safetensors").is_file()
    assert stage.remove() > 0
    assert names(stage.path) == ["base-model", "notes.txt"]  # the folder stays with what it did not make


def test_a_stage_an_older_version_made_is_adopted(tmp_path: Path) -> None:
    """No marker, only names a stage makes: taken over (the marker added), its copy kept."""
    root, _ = delta_chain(tmp_path, 1)
    old = Stage(tmp_path / "stage")
    built = build(old, root, 1)
    old.close()
    (old.path / staging.MARKER_NAME).unlink()  # what an older version left
    (old.path / ".tmp-step-00000002-abc-1234").mkdir()
    (old.path / REFERENCE_NAME).write_text("{}")
    stage = Stage(old.path)
    try:
        assert (stage.path / staging.MARKER_NAME).is_file()
        assert names(stage.path) == sorted([LOCK_NAME, staging.MARKER_NAME, REFERENCE_NAME, built.path.name])
    finally:
        stage.close()


# --- 2. a failing write in the stage is the stage's fault ------------------------------------
def _fd_under(fd: int, folder: Path) -> bool:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(os.path.realpath(folder))
    except OSError:
        return False


def _full_disk_for(monkeypatch, folder: Path, full: dict[str, bool]) -> None:
    """While ``full["on"]``, writes into the weights files under ``folder`` fail with ENOSPC
    (``os.write``: ``copy_verified``; ``os.pwrite``: the rebuild): the room runs out while a copy
    is made, after the stage's own small files were written. A real full file system that stays full for one
    build and has room for the next is hard to make in a test (one that writes short for real:
    tests/test_full_writes.py); everything else is real."""
    real_write, real_pwrite = os.write, os.pwrite

    def write(fd: int, data: Any) -> int:
        if full["on"] and _fd_under(fd, folder) and os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if full["on"] and _fd_under(fd, folder):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)


def test_enospc_while_staging_is_a_stage_error_and_the_next_try_builds(tmp_path: Path, monkeypatch) -> None:
    root, full_root = delta_chain(tmp_path, 2)
    stage = Stage(tmp_path / "stage")
    full = {"on": True}
    _full_disk_for(monkeypatch, stage.path, full)
    try:
        with pytest.raises(StageError, match=rf"writing in the stage directory {stage.path} failed.*No space left"):
            build(stage, root, 1)  # a full copy: copy_verified's writes
        full["on"] = False
        served = build(stage, root, 1)
        stage.prune({served.path})
        full["on"] = True
        with pytest.raises(StageError, match="No space left on device"):
            build(stage, root, 2)  # a delta: the rebuild's pwrite
        assert copies(stage) == [served.path.name]
        assert not [n for n in names(stage.path) if n.startswith(".tmp-") and "spare" not in n]
        full["on"] = False
        assert_same_files(build(stage, root, 2).path, full_root / step_dir_name(2))
    finally:
        stage.close()


def test_a_read_error_in_the_root_stays_the_checkpoints(tmp_path: Path, monkeypatch) -> None:
    """EIO reading the root's delta file is not the stage's fault (the controller then rejects
    the step, unless the root stopped answering); EIO writing the stage while the stage cannot
    write a page any more is."""
    root, _ = delta_chain(tmp_path, 2)
    stage = Stage(tmp_path / "stage")
    served = build(stage, root, 1)
    stage.prune({served.path})
    real_readv, real_pwrite, real_fsync = os.readv, os.pwrite, os.fsync

    def readv(fd: int, buffers: Any) -> int:
        if _fd_under(fd, root):
            raise OSError(errno.EIO, "Input/output error")
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)
    with pytest.raises(OSError, match="Input/output error") as info:
        build(stage, root, 2)
    assert not isinstance(info.value, StageError)
    monkeypatch.setattr(os, "readv", real_readv)

    def broken_disk(fd: int, *args: Any) -> Any:
        if _fd_under(fd, stage.path):
            raise OSError(errno.EIO, "Input/output error")
        return (real_pwrite if args else real_fsync)(fd, *args)

    monkeypatch.setattr(os, "pwrite", broken_disk)
    monkeypatch.setattr(os, "fsync", broken_disk)  # the stage's probe page cannot be synced either
    with pytest.raises(StageError, match="Input/output error"):
        build(stage, root, 2)
    stage.close()


def test_a_full_stage_does_not_cost_the_step_and_it_loads_once_there_is_room(tmp_path: Path, monkeypatch) -> None:
    root, reference = tmp_path / "root", tmp_path / "ref"
    model = Model()
    publish_checkpoint(reference, 0, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    model.step()
    publish_checkpoint(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    full = {"on": True}
    _full_disk_for(monkeypatch, tmp_path / "stage", full)
    controller, client = controller_for(root, tmp_path / "stage", reference / step_dir_name(0))
    run_loop_until(controller, lambda: controller.state.loop_errors >= 2, timeout_s=5)
    assert not client.loads and 1 not in controller.state.rejected
    error = controller.state.last_error or {}
    assert error.get("reason") == "stage_failed" and "No space left on device" in error.get("message", ""), error
    full["on"] = False
    run_loop_until(controller, lambda: bool(client.loads), timeout_s=10)
    assert controller.state.loaded_step == 1 and not controller.state.rejected


# --- 3. room for a chain, and nothing left by a failed one ------------------------------------
def test_a_replica_two_deltas_behind_says_it_needs_three_copies_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    root, full_root = delta_chain(tmp_path, 3)
    size = model_bytes(root)
    stage = Stage(tmp_path / "stage")
    fake_room(monkeypatch, stage, 2 * size + staging.SPACE_MARGIN_BYTES + size // 2)  # two copies, not three
    served = build(stage, root, 1)
    stage.prune({served.path})
    for _ in range(2):  # every try says the same, and leaves nothing
        with pytest.raises(StageError, match="room for three copies of the model, or wait for the next full step"):
            build(stage, root, 3)
        assert copies(stage) == [served.path.name]
    model = Model(seed=1)
    four = publish_checkpoint(root, 4, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    assert build(stage, root, 4).path.name.startswith(four.path.name)  # a full step fits beside the served one


def test_a_chain_holds_at_most_two_new_copies_beside_the_served_one(tmp_path: Path, monkeypatch) -> None:
    root, full_root = delta_chain(tmp_path, 5)
    stage = Stage(tmp_path / "stage")
    served = build(stage, root, 1)
    stage.prune({served.path}, keep_spare=False)
    held: list[int] = []
    real = delta_apply.reconstruct

    def counting(*args: Any, **kw: Any) -> Any:
        held.append(len(copies(stage)) + 1)  # the copies on disk, and the one being written
        return real(*args, **kw)

    monkeypatch.setattr(staging, "reconstruct", counting)
    built = build(stage, root, 5)
    assert built.chain_length == 4 and max(held) == 3, held  # served + the last rebuilt + the next
    assert_same_files(built.path, full_root / step_dir_name(5))


def test_a_chain_that_fails_midway_removes_the_copies_it_made(tmp_path: Path) -> None:
    root, _ = delta_chain(tmp_path, 3)
    delta_file = next((root / step_dir_name(3)).glob("delta-*"))
    data = bytearray(delta_file.read_bytes())
    data[-100] ^= 0xFF
    delta_file.write_bytes(bytes(data))
    stage = Stage(tmp_path / "stage")  # empty: the chain is replayed from full step 1
    try:
        with pytest.raises(Exception, match="digest"):
            build(stage, root, 3)
        assert copies(stage) == []
    finally:
        stage.close()


# --- 4. a step staged before is not fetched again ---------------------------------------------
def test_a_resync_of_a_staged_step_reads_nothing_from_shared_storage(tmp_path: Path, monkeypatch) -> None:
    root, full_root = delta_chain(tmp_path, 4)
    stage = Stage(tmp_path / "stage")
    for step in range(1, 5):
        served = build(stage, root, step)
        stage.prune({served.path})
    fake_room(monkeypatch, stage, 2 * model_bytes(root) + staging.SPACE_MARGIN_BYTES)  # no room for a replay
    again = build(stage, root, 4)
    assert (again.path, again.bytes_read, again.chain_length, again.kind) == (served.path, 0, 0, "delta")
    # A copy that no longer matches (a flipped bit, a file added) is staged anew.
    monkeypatch.undo()
    shard = sorted(served.path.glob("model*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    rebuilt = build(stage, root, 4)
    assert rebuilt.chain_length == 3 and rebuilt.bytes_read > 0
    assert_same_files(rebuilt.path, full_root / step_dir_name(4))
    (rebuilt.path / "extra.safetensors").write_bytes(b"x")
    assert build(stage, root, 4).bytes_read > 0
    # A full step too.
    one = build(stage, root, 1)
    assert build(stage, root, 1).bytes_read == 0 and one.bytes_read > 0
    stage.close()


# --- 5. FIFOs where the stage keeps its files -------------------------------------------------
@pytest.mark.parametrize("name", [LOCK_NAME, ".rollout-stage"])
def test_a_fifo_at_the_lock_or_marker_is_a_stage_error_not_a_hang(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "stage"
    folder.mkdir()
    os.mkfifo(folder / name)
    with pytest.raises(StageError, match=rf"cannot open {folder / name}: .*\(a FIFO, not a regular file\)"):
        within(lambda: Stage(folder))


def test_a_reference_that_is_a_fifo_or_too_large_is_a_stage_error_not_a_hang(tmp_path: Path) -> None:
    stage = Stage(tmp_path / "stage")
    try:
        os.mkfifo(stage.path / REFERENCE_NAME)
        with pytest.raises(StageError, match=rf"cannot read {stage.path / REFERENCE_NAME} \(not_a_regular_file\)"):
            within(stage.load_reference)
        os.remove(stage.path / REFERENCE_NAME)
        with open(stage.path / REFERENCE_NAME, "wb") as f:
            f.truncate(untrusted_files.MAX_SMALL_FILE_BYTES + 1)  # sparse: no RAM, no disk
        with pytest.raises(StageError, match=r"\(too_large\)"):
            within(stage.load_reference)
        os.remove(stage.path / REFERENCE_NAME)
        assert stage.load_reference() is None
        stage.save_reference({"w": ("BF16", (2, 2))}, "model")
        assert stage.load_reference() == ({"w": ("BF16", (2, 2))}, "model")
    finally:
        stage.close()


# --- 6. the spare counts as room --------------------------------------------------------------
def test_the_spare_copy_counts_as_room_for_the_next_one(tmp_path: Path, monkeypatch) -> None:
    root, full_root = delta_chain(tmp_path, 3)
    size = model_bytes(root)
    stage = Stage(tmp_path / "stage")
    total = 3 * size + 2 * staging.SPACE_MARGIN_BYTES
    other = {"bytes": 0}
    fake_room(monkeypatch, stage, total, lambda: other["bytes"])
    for step in (1, 2):
        served = build(stage, root, step)
        stage.prune({served.path})
    assert [n for n in names(stage.path) if n.startswith(staging.SPARE_PREFIX)]
    other["bytes"] = total - 3 * size - staging.SPACE_MARGIN_BYTES + size // 2  # free: half a copy short
    assert_same_files(build(stage, root, 3).path, full_root / step_dir_name(3))
    stage.close()


# --- 7. a killed sidecar's stage in /dev/shm ---------------------------------------------------
def test_a_new_sidecar_reclaims_the_shm_stages_nobody_holds_and_only_those(tmp_path: Path, caplog, monkeypatch) -> None:
    from rollout_service.sidecar import stage_folder

    root, _ = delta_chain(tmp_path, 1)
    tag = uuid.uuid4().hex[:8]
    shm = tmp_path / "shm"  # a /dev/shm of this test's own: never skipped, never touching the node's
    shm.mkdir()
    monkeypatch.setattr(stage_folder, "SHM_DIR", shm)
    gone, alive, foreign = (shm / f"rollout-stage-test-{tag}-{n}" for n in ("gone", "alive", "foreign"))
    holder = Stage(alive)
    killed = Stage(gone)
    build(killed, root, 1)
    killed.close()  # what SIGKILL leaves: a marked stage whose lock nobody holds
    foreign.mkdir()
    (foreign / "data").write_text("not a stage")
    new = None
    try:
        with caplog.at_level(logging.WARNING, logger=staging.__name__):
            new = Stage(shm / f"rollout-stage-test-{tag}-new")
        assert not gone.exists()
        assert f"removed {gone}" in caplog.text
        assert (alive / LOCK_NAME).is_file() and (foreign / "data").is_file()
    finally:
        for stage in (new, holder):
            if stage is not None:
                stage.remove()
        (foreign / "data").unlink()
        foreign.rmdir()


def test_a_sidecar_opening_its_stage_waits_for_a_sibling_reclaiming_it(tmp_path: Path, monkeypatch) -> None:
    """Replicas restarting together on one node: while sidecar A reclaims B's old /dev/shm stage
    (it holds B's lock and empties the folder), B opening that stage under its old replica id
    waits for A and makes its folder again, instead of failing as 'another sidecar uses' it."""
    import fcntl
    import threading

    from rollout_service.sidecar import stage_folder

    monkeypatch.setattr(stage_folder, "SHM_DIR", tmp_path)  # a /dev/shm of this test's own
    b = tmp_path / "rollout-stage-b"
    Stage(b).close()  # B's stage from an earlier run: marked, its lock free
    with open(tmp_path / stage_folder.RECLAIM_LOCK_NAME, "a") as reclaim, open(b / LOCK_NAME, "a") as lock:
        fcntl.flock(reclaim, fcntl.LOCK_EX)  # A, reclaiming
        fcntl.flock(lock, fcntl.LOCK_EX)
        opened: dict[str, object] = {}

        def open_b() -> None:
            try:
                opened["stage"] = Stage(b)
            except Exception as exc:  # reported below
                opened["error"] = exc

        thread = threading.Thread(target=open_b)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and not opened, opened  # B waits for A
        stage_folder.empty_stage(b)  # A removes B's old folder, lock last
    thread.join(10)
    stage = opened.get("stage")
    assert isinstance(stage, Stage), opened
    try:
        assert (b / stage_folder.MARKER_NAME).is_file() and (b / LOCK_NAME).is_file()
    finally:
        stage.close()


def test_the_default_stage_dir_needs_no_home_when_xdg_cache_home_is_set_and_says_what_to_do_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's user id often has no passwd entry and no HOME, and its /dev/shm is 64 MiB:
    the default stage was looked up under ~ even with XDG_CACHE_HOME set (a traceback)."""
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "no-shm")

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(staging.Path, "home", staticmethod(no_home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert staging.default_stage_dir("r0") == tmp_path / "cache" / "rollout-service" / "stage" / "r0"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty: unset, as the XDG spec says
    with pytest.raises(ValueError, match="--stage-dir"):
        staging.default_stage_dir("r0")


def test_a_copy_the_prune_cannot_remove_does_not_keep_it_from_removing_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model, writer = Model(lr=1e-6), DeltaCheckpointWriter(full_every=1)
    stage = staging.Stage(tmp_path / "stage")
    try:
        built = []
        for step in (1, 2, 3):
            publish_both(writer, root, full_root, step, model)
            model.step()
            path = root / step_dir_name(step)
            built.append(stage.build(root, path, Manifest.load(path), untrusted_files.Deadline(60)).path)
        real = staging.remove_entry
        stuck = min(built[:2])  # whichever the listing meets first, one of them fails

        def failing(path: Path) -> None:
            if Path(path) == stuck:
                raise OSError(errno.EBUSY, "Device or resource busy", str(path))
            real(path)

        monkeypatch.setattr(staging, "remove_entry", failing)
        stage.prune({built[2]}, keep_spare=False)
        left = sorted(p for p in stage.path.iterdir() if p.name.startswith("step-"))
        assert left == sorted([stuck, built[2]]), left
    finally:
        stage.close()


def test_a_staged_copy_whose_manifest_the_stage_disk_cannot_read_is_the_stages_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error reading a staged copy's manifest is the stage's disk failing: raised as such
    (the build then reports stage_failed when the stage cannot write), not taken for a copy that
    is absent and made again on the same failing disk; the reference's, the same."""
    root, full_root = tmp_path / "root", tmp_path / "full"
    model, writer = Model(lr=1e-6), DeltaCheckpointWriter(full_every=1)
    publish_both(writer, root, full_root, 1, model)
    stage = staging.Stage(tmp_path / "stage")
    try:
        manifest = Manifest.load(root / step_dir_name(1))
        built = stage.build(root, root / step_dir_name(1), manifest, untrusted_files.Deadline(60))
        stage.save_reference({"w": ("BF16", (4,))}, "test")
        failing = {str(built.path / "manifest.json"), str(stage.path / staging.REFERENCE_NAME)}
        real_read = os.read

        def read(fd: int, n: int) -> bytes:
            if os.readlink(f"/proc/self/fd/{fd}") in failing:
                raise OSError(errno.EIO, "Input/output error")
            return real_read(fd, n)

        monkeypatch.setattr(untrusted_files.os, "read", read)
        with pytest.raises(OSError) as err:
            stage.find(1, manifest.fingerprint())
        assert err.value.errno == errno.EIO
        with pytest.raises(staging.StageError, match="check the stage directory's disk"):
            stage.load_reference()
    finally:
        stage.close()
