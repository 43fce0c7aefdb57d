"""A stage the user did not choose moves to the local disk when the model does not fit /dev/shm.

The default stage is ``/dev/shm/rollout-stage-REPLICA`` whenever /dev/shm has a little room at
start-up, before the model's size is known. A model larger than /dev/shm (or than half of it: a
step is staged beside the copy SGLang serves) was then refused at every step, for ever. Now such
a default stage moves to ``$XDG_CACHE_HOME/rollout-service/stage/REPLICA`` at the first step that
does not fit, keeps the served copy until a step loads from the new folder, then frees /dev/shm.
A ``--stage-dir`` the user gave stays where it was given (a step that does not fit is refused).

/dev/shm is a folder of each test's own whose file system is reported small (``shutil.disk_usage``
answers for it); the room rules, the copies and the loop are the real ones (SGLang is a fake client).
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from delta_helpers import CONFIG, RUN, Model, assert_same_files, publish_both
from rollout_service.checkpoint_format import CheckpointError, Manifest, step_dir_name
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar import stage_folder, staging
from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.staging import LOCK_NAME, SPACE_MARGIN_BYTES, Stage, StageError
from rollout_service.untrusted_files import Deadline
from sidecar_helpers import AcceptingSGLang, run_loop_until

DiskUsage = namedtuple("DiskUsage", "total used free")
REAL_DEFAULT_STAGE_DIR = staging.default_stage_dir


def small_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, total: int) -> Path:
    """A /dev/shm of this test's own whose file system holds ``total`` bytes (what is in it
    counts as used), and ``XDG_CACHE_HOME`` under ``tmp_path``. The default stage picks it when
    it has room beyond the margin (the 8 GiB bar of a real /dev/shm, brought to this scale)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(stage_folder, "SHM_DIR", shm)
    monkeypatch.setattr(staging, "SHM_DIR", shm)
    monkeypatch.setattr(staging, "default_stage_dir", functools.partial(REAL_DEFAULT_STAGE_DIR, needed_bytes=0))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real = shutil.disk_usage

    def usage(path: str | Path) -> DiskUsage:
        if not Path(path).is_relative_to(shm):
            return real(path)
        used = stage_folder.bytes_under(shm)
        return DiskUsage(total, used, max(0, total - used))

    monkeypatch.setattr(shutil, "disk_usage", usage)
    return shm


def disk_default(tmp_path: Path, replica: str = "r0") -> Path:
    return tmp_path / "cache" / "rollout-service" / "stage" / replica


def chain(tmp_path: Path, steps: int) -> tuple[Path, Path, int]:
    """Step 1 (full) and deltas up to ``steps`` under ``tmp_path/root``, each also published in
    full under ``tmp_path/full``; and the model's bytes."""
    root, full_root = tmp_path / "root", tmp_path / "full"
    model, writer = Model(), DeltaCheckpointWriter(full_every=100)
    for step in range(1, steps + 1):
        model.step()
        publish_both(writer, root, full_root, step, model)
    return root, full_root, Manifest.load(root / step_dir_name(1)).total_bytes


def build(stage: Stage, root: Path, step: int) -> staging.StagedBuild:
    path = root / step_dir_name(step)
    return stage.build(root, path, Manifest.load(path), Deadline(60))


def controller_for(tmp_path: Path, root: Path, **kw) -> tuple[SyncController, AcceptingSGLang]:
    reference = tmp_path / "ref"
    publish_checkpoint(reference, 0, Model().tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    settings = SidecarSettings(
        checkpoint_path=root,
        sglang_url="http://127.0.0.1:9",
        replica_id="r0",
        reference_dir=reference / step_dir_name(0),
        health_interval_s=0.05,
        poll_interval_s=0.05,
        **kw,
    )
    client = AcceptingSGLang(reference / step_dir_name(0))
    return SyncController(settings, client=client), client


def served_from(controller: SyncController, step: int, stage_dir: Path) -> bool:
    """``step`` is served and the pass that loaded it ended (its /status names ``stage_dir``)."""
    return controller.state.loaded_step == step and controller.state.stage_dir == str(stage_dir)


def moves_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "No --stage-dir was given" in r.getMessage()]


# --- the settings ------------------------------------------------------------------------------
def test_only_a_defaulted_shm_stage_has_the_disk_default_to_move_to(tmp_path: Path, monkeypatch) -> None:
    shm = small_shm(tmp_path, monkeypatch, 1 << 30)
    root = tmp_path / "root"
    root.mkdir()
    defaulted = SidecarSettings(checkpoint_path=root, sglang_url="http://127.0.0.1:9", replica_id="r0")
    assert defaulted.stage_dir == shm / "rollout-stage-r0"
    assert defaulted.stage_fallback == disk_default(tmp_path)
    given = SidecarSettings(
        checkpoint_path=root, sglang_url="http://127.0.0.1:9", replica_id="r0", stage_dir=shm / "rollout-stage-r0"
    )
    assert given.stage_dir == shm / "rollout-stage-r0" and given.stage_fallback is None
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(1 << 30, 1 << 30, 0))  # /dev/shm full
    on_disk = SidecarSettings(checkpoint_path=root, sglang_url="http://127.0.0.1:9", replica_id="r0")
    assert on_disk.stage_dir == disk_default(tmp_path) and on_disk.stage_fallback is None


# --- the sync loop -------------------------------------------------------------------------------
def test_a_model_larger_than_the_default_shm_stage_is_loaded_from_the_disk_default(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    root, full_root, size = chain(tmp_path, 2)
    shm = small_shm(tmp_path, monkeypatch, SPACE_MARGIN_BYTES + size // 2)  # less than one copy
    controller, client = controller_for(tmp_path, root)
    assert controller.settings.stage_dir == shm / "rollout-stage-r0"
    disk = disk_default(tmp_path)
    with caplog.at_level(logging.WARNING, logger=staging.__name__):
        run_loop_until(controller, lambda: served_from(controller, 2, disk), timeout_s=20)
    assert controller.state.loaded_step == 2, controller.state.to_dict()
    assert not controller.state.rejected and controller.state.last_error is None
    assert client.loads and all(Path(p).parent == disk for p in client.loads), client.loads
    assert_same_files(Path(client.loads[-1]), full_root / step_dir_name(2))
    assert controller.state.stage_dir == str(disk) and controller.stage is not None
    assert (controller.state.stage_bytes or 0) >= stage_folder.bytes_under(Path(client.loads[-1]))  # counted there
    assert not (shm / "rollout-stage-r0").exists()  # nothing of it is left in /dev/shm
    [warning] = moves_logged(caplog)  # once
    assert "more than the" in warning and str(disk) in warning and "Pass --stage-dir" in warning


def test_a_default_shm_stage_with_room_for_one_copy_moves_when_the_next_step_needs_a_second(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    root, full_root, size = chain(tmp_path, 3)
    shm = small_shm(tmp_path, monkeypatch, SPACE_MARGIN_BYTES + size + size // 2)  # one copy, not two
    (root / step_dir_name(2)).rename(tmp_path / "later-2")  # published one at a time
    (root / step_dir_name(3)).rename(tmp_path / "later-3")
    controller, client = controller_for(tmp_path, root)
    run_loop_until(controller, lambda: controller.state.loaded_step == 1, timeout_s=20)
    assert Path(client.loads[-1]).parent == shm / "rollout-stage-r0"  # it fits there
    (tmp_path / "later-2").rename(root / step_dir_name(2))
    disk = disk_default(tmp_path)
    with caplog.at_level(logging.WARNING, logger=staging.__name__):
        run_loop_until(controller, lambda: served_from(controller, 2, disk), timeout_s=20)
    assert controller.state.loaded_step == 2 and not controller.state.rejected, controller.state.to_dict()
    assert Path(client.loads[-1]).parent == disk
    # The delta's base was staged in /dev/shm: the chain was replayed from its full step on disk.
    record = controller.state.last_sync
    assert record is not None and record.kind == "delta" and record.chain_length == 1
    assert_same_files(Path(client.loads[-1]), full_root / step_dir_name(2))
    assert not (shm / "rollout-stage-r0").exists() and controller.state.stage_dir == str(disk)
    [warning] = moves_logged(caplog)
    assert "MiB free" in warning

    # A restarted sidecar picks /dev/shm again, adopts what SGLang serves, and moves again.
    controller2 = SyncController(controller.settings, client=client)
    (tmp_path / "later-3").rename(root / step_dir_name(3))
    run_loop_until(controller2, lambda: served_from(controller2, 3, disk), timeout_s=20)
    assert controller2.state.loaded_step == 3 and not controller2.state.rejected, controller2.state.to_dict()
    assert Path(client.loads[-1]).parent == disk and len(client.loads) == 3
    assert_same_files(Path(client.loads[-1]), full_root / step_dir_name(3))
    assert not (shm / "rollout-stage-r0").exists()


def test_a_given_stage_dir_of_the_same_size_still_refuses_the_step_naming_stage_dir(
    tmp_path: Path, monkeypatch
) -> None:
    root, _, size = chain(tmp_path, 1)
    shm = small_shm(tmp_path, monkeypatch, SPACE_MARGIN_BYTES + size // 2)
    controller, client = controller_for(tmp_path, root, stage_dir=shm / "rollout-stage-r0")
    run_loop_until(controller, lambda: 1 in controller.state.rejected, timeout_s=20)
    assert controller.state.rejected.get(1) == "too_large_for_stage" and not client.loads
    assert "--stage-dir" in (controller.state.last_error or {}).get("message", "")
    assert not disk_default(tmp_path).exists()


# --- the stage ---------------------------------------------------------------------------------
def test_the_served_copy_stays_in_shm_until_a_step_loads_from_the_disk_default(tmp_path: Path, monkeypatch) -> None:
    root, full_root, size = chain(tmp_path, 2)
    shm = small_shm(tmp_path, monkeypatch, SPACE_MARGIN_BYTES + size + size // 2)
    disk = disk_default(tmp_path)
    stage = Stage(shm / "rollout-stage-r0", fallback=disk)
    try:
        served = build(stage, root, 1)
        stage.prune({served.path})
        stage.save_reference({"w": ("BF16", (2,))}, "the served model")
        built = build(stage, root, 2)  # no room beside the served copy: built on disk
        assert built.path.parent == disk and stage.path == disk
        assert_same_files(built.path, full_root / step_dir_name(2))
        assert served.path.is_dir() and stage.owns(served.path)  # SGLang may still need it
        assert stage.load_reference() == ({"w": ("BF16", (2,))}, "the served model")
        with pytest.raises(StageError, match="another sidecar uses"):  # still this sidecar's
            stage_folder.take_lock(shm / "rollout-stage-r0")
        stage.prune({built.path})  # a load from the new folder: the old one goes, lock and all
        assert not (shm / "rollout-stage-r0").exists() and not stage.owns(served.path)
        assert built.path.is_dir()
    finally:
        stage.remove()
    assert not disk.exists()


def test_a_stage_that_moved_removes_both_folders_when_removed(tmp_path: Path, monkeypatch) -> None:
    root, _, size = chain(tmp_path, 2)
    shm = small_shm(tmp_path, monkeypatch, SPACE_MARGIN_BYTES + size + size // 2)
    stage = Stage(shm / "rollout-stage-r0", fallback=disk_default(tmp_path))
    stage.prune({build(stage, root, 1).path})
    build(stage, root, 2)  # moved; no load from there yet
    stage.close()  # the sidecar stops, then `serve` removes the stage
    assert stage.remove() > 0
    assert not (shm / "rollout-stage-r0").exists() and not disk_default(tmp_path).exists()


def test_a_given_stage_does_not_move(tmp_path: Path, monkeypatch) -> None:
    root, _, size = chain(tmp_path, 2)
    shm = small_shm(tmp_path, monkeypatch, SPACE_MARGIN_BYTES + size + size // 2)
    stage = Stage(shm / "rollout-stage-r0")
    try:
        stage.prune({build(stage, root, 1).path})
        with pytest.raises(StageError, match="give --stage-dir a folder with room for two copies"):
            build(stage, root, 2)
        assert stage.path == shm / "rollout-stage-r0" and not disk_default(tmp_path).exists()
    finally:
        stage.remove()
    small = Stage(tmp_path / "shm" / "small")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(size, 0, size))
    try:
        with pytest.raises(CheckpointError, match="--stage-dir") as err:
            build(small, root, 1)
        assert err.value.reason == "too_large_for_stage"
    finally:
        small.remove()


def test_a_step_too_large_for_shm_is_still_rejected_when_the_disk_default_cannot_be_used(
    tmp_path: Path, monkeypatch
) -> None:
    """The default stage cannot move (its disk default is a file, not a folder it can make): a
    step larger than the whole /dev/shm is rejected as before (``too_large_for_stage``), with the
    move's failure logged; it was a ``StageError`` (tried again at every pass, for ever)."""
    root, _, size = chain(tmp_path, 1)
    shm = small_shm(tmp_path, monkeypatch, size)
    disk = disk_default(tmp_path)
    disk.parent.mkdir(parents=True)
    disk.write_text("not a folder")
    stage = Stage(shm / "rollout-stage-r0", fallback=disk)
    try:
        with pytest.raises(CheckpointError) as err:
            build(stage, root, 1)
        assert err.value.reason == "too_large_for_stage"
        assert stage.path == shm / "rollout-stage-r0"
    finally:
        stage.remove()


# --- hidden work left at exit --------------------------------------------------------------------
def test_a_closed_stage_leaves_no_hidden_work_behind_only_its_copies(tmp_path: Path) -> None:
    """The spare copy (a whole model: RAM in /dev/shm) and work a removal or copy left are of
    no use once the sidecar stops (the next start would remove them): closing removes them."""
    root, _, _ = chain(tmp_path, 2)
    stage = Stage(tmp_path / "stage")
    for step in (1, 2):
        served = build(stage, root, step)
        stage.prune({served.path})
    hidden = sorted(p.name for p in stage.path.iterdir() if p.name.startswith(".tmp-"))
    assert hidden and hidden[0].startswith(staging.SPARE_PREFIX)  # the copy of step 1, kept as the spare
    cut_short = stage.path / f".tmp-deleting-{served.path.name}-0123abcd"
    (cut_short / "sub").mkdir(parents=True)
    (cut_short / "sub" / "model.safetensors").write_bytes(b"x" * 4096)
    stage.close()
    assert sorted(p.name for p in stage.path.iterdir()) == sorted(
        [LOCK_NAME, stage_folder.MARKER_NAME, served.path.name]
    )
    stage.close()  # idempotent
    Stage(tmp_path / "stage").remove()


# --- through a real SGLang -----------------------------------------------------------------------
def test_sglang_serves_a_step_too_large_for_the_default_shm_stage_from_the_disk_default(
    sglang_server_at_base, checkpoint_root: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The sidecar's own loop, in this process, against the real SGLang on the CPU: the step is
    copied to the local-disk default and SGLang loads it from there."""
    import httpx

    from helpers import generate
    from sidecar_helpers import publish_step

    published = publish_step(checkpoint_root, tiny_model_dir, 1)
    size = Manifest.load(published.path).total_bytes
    shm = small_shm(tmp_path, monkeypatch, SPACE_MARGIN_BYTES + size // 2)
    settings = SidecarSettings(
        checkpoint_path=checkpoint_root,
        sglang_url=sglang_server_at_base.url,
        replica_id="r0",
        health_interval_s=0.2,
    )
    assert settings.stage_dir == shm / "rollout-stage-r0"
    controller = SyncController(settings)
    disk = disk_default(tmp_path)
    run_loop_until(controller, lambda: served_from(controller, 1, disk), timeout_s=180)
    assert controller.state.loaded_step == 1 and not controller.state.rejected, controller.state.to_dict()
    served = httpx.get(f"{sglang_server_at_base.url}/model_info", timeout=30).json()["model_path"]
    assert Path(served).parent == disk and Path(served).is_dir()
    assert generate(sglang_server_at_base.url, [11, 42, 7], max_new_tokens=2)["meta_info"]["weight_version"] == "1"
    assert not (shm / "rollout-stage-r0").exists()
