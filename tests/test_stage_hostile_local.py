"""The stage against what other local processes do to it (it lives in ``/dev/shm`` by default,
where every user may write):

- a stage folder another user made first (its name is predictable) is refused: its owner could
  replace the verified copies SGLang loads;
- a file of the spare copy with a second name (a hard link made from outside the stage) or of
  another owner is not written over: the new copy's bytes would land outside the stage, and could
  be changed there after they were verified;
- a stage folder or lock file that a cleaner removed while the sidecar ran is made and locked
  again at the next build (before, every try failed, and a second sidecar could take the folder);
- something at the name a copy is about to take (a file, a FIFO) is removed, not a reason for
  every try to fail with a misleading "free room" message.

Real files and processes throughout (the sidecar's Stage on tmp folders; ``chown`` needs root,
which the test machines run as).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from delta_helpers import assert_same_files
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.sidecar import staging
from rollout_service.sidecar.staging import LOCK_NAME, Stage, StageError
from test_stage_dir_safety import build, copies, delta_chain

OTHER_UID = 12345


def test_a_stage_folder_another_user_made_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "rollout-stage-r0"
    folder.mkdir()
    os.chown(folder, OTHER_UID, OTHER_UID)
    with pytest.raises(StageError, match=rf"belongs to user id {OTHER_UID}, not to this sidecar's"):
        Stage(folder)
    assert os.listdir(folder) == []  # nothing written into it
    os.chown(folder, os.geteuid(), os.getegid())
    Stage(folder).close()


def _spare_files(stage: Stage) -> list[Path]:
    [spare] = [p for p in stage.path.iterdir() if p.name.startswith(staging.SPARE_PREFIX)]
    return sorted(p for p in spare.iterdir() if p.name.endswith(".safetensors"))


@pytest.mark.parametrize("how", ["hard-link", "other-owner", "group-writable"])
def test_a_spare_file_with_another_name_or_owner_is_not_written_over(tmp_path: Path, how: str) -> None:
    root, full_root = delta_chain(tmp_path, 3)
    stage = Stage(tmp_path / "stage")
    try:
        for step in (1, 2):
            stage.prune({build(stage, root, step).path})
        target = _spare_files(stage)[0]
        outside = tmp_path / "snapshot.safetensors"
        if how == "hard-link":
            os.link(target, outside)
            before = outside.read_bytes()
        elif how == "other-owner":
            os.chown(target, OTHER_UID, OTHER_UID)
        else:
            os.chmod(target, 0o664)
        # Held open, the suspect file keeps its inode number once unlinked: a fresh file cannot
        # be given the same number (the file system reuses a freed one at once).
        held = os.open(target, os.O_RDONLY)
        try:
            inode = os.fstat(held).st_ino
            served = build(stage, root, 3).path
            assert_same_files(served, full_root / step_dir_name(3))
            assert os.stat(served / target.name).st_ino != inode  # a fresh file, not the suspect one
        finally:
            os.close(held)
        if how == "hard-link":
            assert outside.read_bytes() == before  # nothing was written outside the stage
            assert os.stat(served / target.name).st_nlink == 1
    finally:
        stage.close()


@pytest.mark.parametrize("removed", ["folder", "lock"])
def test_a_stage_removed_while_the_sidecar_runs_is_made_and_locked_again(
    tmp_path: Path, removed: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, full_root = delta_chain(tmp_path, 2)
    stage = Stage(tmp_path / "stage")
    try:
        stage.prune({build(stage, root, 1).path})
        if removed == "folder":
            shutil.rmtree(stage.path)
        else:
            (stage.path / LOCK_NAME).unlink()
        served = build(stage, root, 2)  # rebuilt from the published full step when the copy is gone
        assert_same_files(served.path, full_root / step_dir_name(2))
        assert "making and locking it again" in caplog.text
        with pytest.raises(StageError, match="another sidecar"):
            Stage(stage.path)  # the stage is locked again: no second sidecar takes it over
        stage.prune({served.path})
        assert copies(stage) == [served.path.name]
    finally:
        stage.close()


@pytest.mark.parametrize("thing", ["file", "fifo", "link"])
def test_something_at_a_copys_name_is_removed_and_the_copy_made(tmp_path: Path, thing: str) -> None:
    root, full_root = delta_chain(tmp_path, 2)
    stage = Stage(tmp_path / "stage")
    try:
        for step in (1, 2):
            path = root / step_dir_name(step)
            final = stage._name_for(step, Manifest.load(path).fingerprint())
            if thing == "file":
                final.write_bytes(b"junk")
            elif thing == "fifo":
                os.mkfifo(final)
            else:
                final.symlink_to(tmp_path)
            served = build(stage, root, step)
            assert served.path == final and final.is_dir() and not final.is_symlink()
            assert_same_files(final, full_root / step_dir_name(step))
            stage.prune({served.path})
        assert tmp_path.exists() and (tmp_path / "root").is_dir()  # a link's target is never followed
    finally:
        stage.close()
