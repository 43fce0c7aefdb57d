"""The stage against another local user's entries where it works (``/dev/shm`` is every user's):

- a link another user made at the stage's (predictable) name is refused; a link of this user's
  is followed once, and the stage stays in the folder it pointed to when it opened;
- a folder named like a staged copy that is not this user's alone (another user's folder or file,
  a link, a file others may write) is never reused nor rebuilt from: the step is staged anew, and
  only a copy of this user's is handed on; copies the stage makes are its user's alone whatever
  the umask, so they are reused;
- reclaiming the ``/dev/shm`` stage of a dead sidecar works through one descriptor of its folder:
  a folder swapped for a link after it was looked at cannot redirect the removal to another
  folder, and another user's stage is left alone.

Real files and processes throughout; ``chown`` stands for another user (it needs root, which the
test machines run as).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

import pytest

from delta_helpers import assert_same_files
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.sidecar import stage_folder, staging
from rollout_service.sidecar.staging import LOCK_NAME, MARKER_NAME, Stage, StageError
from test_stage_dir_safety import build, delta_chain

OTHER_UID = 4242


@pytest.fixture(autouse=True)
def _as_root() -> None:
    """Another user is simulated with ``chown``, which needs root (CI runs as root): said, not skipped."""
    assert os.geteuid() == 0, "these tests chown files to another user id: run them as root, as CI does"


def chown_tree(path: Path, uid: int = OTHER_UID) -> None:
    """Give ``path`` and everything under it (links themselves, not followed) to ``uid``."""
    os.lchown(path, uid, uid)
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                os.lchown(os.path.join(dirpath, name), uid, uid)


def world_writable(folder: Path) -> Path:
    """A folder every user may write into, as ``/dev/shm`` or ``/var/tmp`` (root's, mode 1777)."""
    folder.mkdir(parents=True)
    os.chmod(folder, 0o1777)
    return folder


def own_copy(path: Path) -> None:
    """``path`` is a staged copy of this user's alone: a real folder and regular files, writable
    by nobody else."""
    for p in (path, *path.iterdir()):
        st = os.lstat(p)
        assert stat.S_ISDIR(st.st_mode) if p == path else stat.S_ISREG(st.st_mode), p
        assert st.st_uid == os.geteuid(), p
        assert not st.st_mode & 0o022, (p, oct(st.st_mode))


def staged_elsewhere(tmp_path: Path, root: Path, step: int) -> Path:
    """A genuine staged copy of ``step`` made by a stage of its own (what another user can make)."""
    other = Stage(tmp_path / "other-users-stage")
    try:
        return build(other, root, step).path
    finally:
        other.close()


# --- A. a link at the stage's name --------------------------------------------------------------
def test_a_link_another_user_made_at_the_default_stage_name_is_refused(tmp_path: Path, monkeypatch) -> None:
    """Another user makes /dev/shm/rollout-stage-<replica> first, as a link to a folder root owns
    (so that it passes the owner check), and points it at a folder of its own once the sidecar
    staged there: the stage used to follow it (check_owner stat'ed through the link)."""
    shm = world_writable(tmp_path / "shm")
    monkeypatch.setattr(stage_folder, "SHM_DIR", shm)
    monkeypatch.setattr(staging, "SHM_DIR", shm)
    shared = world_writable(tmp_path / "var-tmp")
    link = shm / "rollout-stage-r0"
    link.symlink_to(shared)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(StageError, match=rf"{link} is a symbolic link made by user id {OTHER_UID}, not by this"):
        Stage(link)
    assert os.listdir(shared) == []  # nothing was written where it points
    assert link.is_symlink()  # and the link is left alone


def test_a_link_of_this_users_is_followed_once_and_its_target_must_be_this_users(tmp_path: Path) -> None:
    root, full_root = delta_chain(tmp_path, 2)
    real = tmp_path / "real-stage"
    real.mkdir()
    link = tmp_path / "stage-link"
    link.symlink_to(real)
    stage = Stage(link)
    try:
        assert stage.path == real  # resolved once, when the stage opened
        first = build(stage, root, 1)
        assert first.path.parent == real
        # Whoever can change the link later does not move the stage, nor what it hands on.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        link.unlink()
        link.symlink_to(elsewhere)
        second = build(stage, root, 2)
        assert second.path.parent == real and os.listdir(elsewhere) == []
        assert_same_files(second.path, full_root / step_dir_name(2))
    finally:
        stage.close()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    link.unlink()
    link.symlink_to(theirs)
    with pytest.raises(StageError, match=rf"\(where the link {link} points\) belongs to user id {OTHER_UID}"):
        Stage(link)
    assert os.listdir(theirs) == []


# --- A. a copy that is not this user's alone ------------------------------------------------------
def test_another_users_copy_in_a_shared_stage_folder_is_not_reused_nor_handed_on(tmp_path: Path) -> None:
    """A stage in a folder root owns and every user may write into (as /var/tmp, or an emptyDir):
    another user drops there a genuine-looking copy of the step about to be published (its
    fingerprint is in the root's manifest). It used to be "reused" after its bytes were checked,
    and handed to SGLang, in a folder its owner could change after the check."""
    root, full_root = delta_chain(tmp_path, 1)
    shared = world_writable(tmp_path / "var-tmp")
    genuine = staged_elsewhere(tmp_path, root, 1)
    planted = shared / genuine.name
    os.rename(genuine, planted)
    chown_tree(planted)
    stage = Stage(shared)
    try:
        built = build(stage, root, 1)
        assert built.path == planted and built.bytes_read > 0  # copied anew, not adopted
        own_copy(built.path)
        assert_same_files(built.path, full_root / step_dir_name(1))
    finally:
        stage.close()


@pytest.mark.parametrize(
    "how", ["their-folder", "their-file", "group-writable-file", "world-writable-folder", "link-file", "link-folder"]
)
def test_a_staged_copy_not_this_users_alone_is_staged_anew(tmp_path: Path, how: str) -> None:
    root, full_root = delta_chain(tmp_path, 1)
    stage = Stage(tmp_path / "stage")
    try:
        copy = build(stage, root, 1).path
        shard = sorted(copy.glob("*.safetensors"))[0]
        outside = tmp_path / "outside"
        if how == "their-folder":
            os.chown(copy, OTHER_UID, OTHER_UID)
        elif how == "their-file":
            os.chown(shard, OTHER_UID, OTHER_UID)
        elif how == "group-writable-file":
            os.chmod(shard, 0o664)
        elif how == "world-writable-folder":
            os.chmod(copy, 0o777)
        elif how == "link-file":  # the same bytes, in a file someone else may change later
            outside.write_bytes(shard.read_bytes())
            shard.unlink()
            shard.symlink_to(outside)
        else:
            os.rename(copy, outside)
            copy.symlink_to(outside)
        before = sorted(os.listdir(outside)) if outside.is_dir() else None
        again = build(stage, root, 1)
        assert again.path == copy and again.bytes_read > 0, how  # not reused
        own_copy(again.path)
        assert_same_files(again.path, full_root / step_dir_name(1))
        if before is not None:  # a link's target is never entered nor removed
            assert sorted(os.listdir(outside)) == before
        elif how == "link-file":
            assert outside.is_file()
    finally:
        stage.close()


def test_another_users_copy_is_not_a_base_for_a_delta(tmp_path: Path) -> None:
    """A foreign copy of the delta's base is not rebuilt from: the chain is replayed from its full
    step in the root (its bytes checked as it is copied), and the new copy is this user's."""
    root, full_root = delta_chain(tmp_path, 2)
    stage = Stage(tmp_path / "stage")
    try:
        base = build(stage, root, 1).path
        chown_tree(base)
        built = build(stage, root, 2)
        full_bytes = Manifest.load(root / step_dir_name(1)).total_bytes
        delta_bytes = Manifest.load(root / step_dir_name(2)).total_bytes
        assert (built.chain_length, built.bytes_read) == (1, full_bytes + delta_bytes)
        own_copy(built.path)
        assert_same_files(built.path, full_root / step_dir_name(2))
    finally:
        stage.close()


def test_copies_are_this_users_alone_whatever_the_umask_and_so_are_reused(tmp_path: Path) -> None:
    root, full_root = delta_chain(tmp_path, 2)
    old = os.umask(0o002)  # group-writable files and folders by default
    try:
        stage = Stage(tmp_path / "stage")
        try:
            for step in (1, 2):  # a copy, then a rebuild
                built = build(stage, root, step)
                own_copy(built.path)
                again = build(stage, root, step)
                assert (again.path, again.bytes_read) == (built.path, 0)  # reused
                stage.prune({again.path})
            assert_same_files(again.path, full_root / step_dir_name(2))
        finally:
            stage.close()
    finally:
        os.umask(old)


def test_an_entry_at_a_copys_name_that_cannot_be_removed_is_refused_saying_whose(tmp_path: Path, monkeypatch) -> None:
    """In a stage folder others may write into, as another user than root, another user's entry at
    the name of the copy cannot be removed: the stage says so, not "free room there"."""
    root, _ = delta_chain(tmp_path, 1)
    stage = Stage(tmp_path / "stage")
    try:
        final = stage._name_for(1, Manifest.load(root / step_dir_name(1)).fingerprint())
        final.mkdir()
        os.chown(final, OTHER_UID, OTHER_UID)

        def not_permitted(path: Path) -> None:  # what a sidecar not run as root meets
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

        monkeypatch.setattr(staging, "remove_entry", not_permitted)
        with pytest.raises(
            StageError, match=rf"{final} is where .* cannot be removed .*belongs to user id {OTHER_UID}"
        ):
            build(stage, root, 1)
        assert final.is_dir()
    finally:
        monkeypatch.undo()
        stage.close()


# --- B. reclaiming a dead sidecar's /dev/shm stage -------------------------------------------------
def _shm(tmp_path: Path, monkeypatch) -> Path:
    shm = world_writable(tmp_path / "shm")  # a /dev/shm of this test's own
    monkeypatch.setattr(stage_folder, "SHM_DIR", shm)
    monkeypatch.setattr(staging, "SHM_DIR", shm)
    return shm


def _victim(tmp_path: Path) -> Path:
    """A folder holding entries named as a stage names its own (a checkpoint root's work folder,
    another sidecar's staged copy, a published step)."""
    victim = tmp_path / "victim"
    for name in (".tmp-step-00000042-abc", "step-00000007-0123456789ab", "step-00000008"):
        (victim / name).mkdir(parents=True)
        (victim / name / "model.safetensors").write_bytes(b"weights")
    (victim / "reference.json").write_text("{}")
    return victim


def test_a_dead_stage_swapped_for_a_link_while_reclaimed_removes_nothing_elsewhere(tmp_path: Path, monkeypatch) -> None:
    """The sibling is looked at (a folder, marked, its lock free), then its owner renames it away
    and puts a link to another folder at its name (deterministically here: right after its lock is
    taken; in practice on an inotify event). The removal used to follow the link."""
    root, _ = delta_chain(tmp_path, 1)
    shm = _shm(tmp_path, monkeypatch)
    victim = _victim(tmp_path)
    before = sorted(os.listdir(victim))
    gone = shm / "rollout-stage-gone"
    dead = Stage(gone)
    build(dead, root, 1)
    dead.close()  # what SIGKILL leaves: a marked stage whose lock nobody holds
    lock_inode = os.stat(gone / LOCK_NAME).st_ino
    moved = shm / "moved-away"
    real_flock = fcntl.flock
    swapped: list[bool] = []

    def flock_then_swap(fd: int, op: int) -> None:
        real_flock(fd, op)
        if not swapped and os.fstat(fd).st_ino == lock_inode:
            os.rename(gone, moved)
            gone.symlink_to(victim)
            swapped.append(True)

    monkeypatch.setattr(stage_folder.fcntl, "flock", flock_then_swap)
    stage_folder.reclaim_shm_leftovers(shm / "rollout-stage-new")
    monkeypatch.setattr(stage_folder.fcntl, "flock", real_flock)
    assert swapped
    assert sorted(os.listdir(victim)) == before  # nothing removed through the link
    assert (victim / "step-00000007-0123456789ab" / "model.safetensors").read_bytes() == b"weights"
    assert gone.is_symlink()  # the link itself is not removed either
    assert not [n for n in os.listdir(moved) if n.startswith("step-")]  # the folder looked at was emptied


def test_another_users_dead_stage_in_shm_is_left_alone(tmp_path: Path, monkeypatch) -> None:
    root, _ = delta_chain(tmp_path, 1)
    shm = _shm(tmp_path, monkeypatch)
    theirs, mine = shm / "rollout-stage-theirs", shm / "rollout-stage-mine"
    for folder in (theirs, mine):  # each stage opened reclaims the dead ones before it
        dead = Stage(folder)
        build(dead, root, 1)
        dead.close()
        if folder == theirs:
            chown_tree(theirs)
            before = sorted(os.listdir(theirs))
    new = Stage(shm / "rollout-stage-new")
    try:
        assert not mine.exists()  # this user's dead stage is reclaimed, as before
        assert sorted(os.listdir(theirs)) == before and (theirs / MARKER_NAME).is_file()
    finally:
        new.remove()


# --- D. the group a umask of 002 lets in ---------------------------------------------------------
def test_the_stage_folder_and_its_work_folders_are_closed_to_the_group_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made under a umask of 002 (multi-user and HPC nodes), the stage folder was group-writable: a
    user of the group could rename a verified copy away between its check and SGLang's load and
    put its own folder under that name. The folder (an existing one of this user's too) and the
    hidden work folders copies are made in are closed to others now."""
    root, full_root = delta_chain(tmp_path, 1)
    existing = tmp_path / "existing"
    existing.mkdir()
    os.chmod(existing, 0o777)
    work_modes: list[int] = []
    copy = staging.copy_verified

    def watching(root_: Path, source: Path, target: Path, **kw: object) -> object:
        work_modes.append(stat.S_IMODE(os.stat(target.parent).st_mode))
        return copy(root_, source, target, **kw)

    monkeypatch.setattr(staging, "copy_verified", watching)
    old = os.umask(0o002)
    try:
        for folder in (tmp_path / "made", existing):
            stage = Stage(folder)
            try:
                assert not os.stat(stage.path).st_mode & 0o022, oct(os.stat(stage.path).st_mode)
                built = build(stage, root, 1)
                own_copy(built.path)
                assert_same_files(built.path, full_root / step_dir_name(1))
            finally:
                stage.close()
    finally:
        os.umask(old)
    assert work_modes and all(not mode & 0o022 for mode in work_modes), [oct(m) for m in work_modes]


def test_a_file_another_user_put_into_a_copy_being_made_fails_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of another user's in the hidden folder a copy is being made in (written there while
    the copy ran) used to be sealed and renamed into place with the rest; the copy now fails, and
    nothing appears under the copy's name. The next try, undisturbed, makes the copy."""
    root, full_root = delta_chain(tmp_path, 1)
    copy = staging.copy_verified
    tampered: list[Path] = []

    def tampering(root_: Path, source: Path, target: Path, **kw: object) -> object:
        result = copy(root_, source, target, **kw)
        if not tampered:
            os.chown(target, OTHER_UID, OTHER_UID)  # stands for a file another user swapped in
            tampered.append(target)
        return result

    monkeypatch.setattr(staging, "copy_verified", tampering)
    stage = Stage(tmp_path / "stage")
    try:
        with pytest.raises(StageError, match="not this user's alone.*belongs to user id 4242"):
            build(stage, root, 1)
        assert not any(stage_folder.COPY_NAME_RE.match(name) for name in os.listdir(stage.path))
        assert not any(name.startswith(".tmp-") for name in os.listdir(stage.path))
        built = build(stage, root, 1)
        own_copy(built.path)
        assert_same_files(built.path, full_root / step_dir_name(1))
    finally:
        stage.close()


def test_a_folder_refused_as_a_stage_keeps_its_mode(tmp_path: Path) -> None:
    """The stage folder is closed to the group only once it is known to be a stage: a group's
    shared folder given as ``--stage-dir`` by mistake (or ``/dev/shm`` itself, to a sidecar running
    as root) is refused as it is, not first made unwritable for everyone else."""
    for mode in (0o2775, 0o1777):
        shared = tmp_path / f"shared-{mode:o}"
        shared.mkdir()
        os.chmod(shared, mode)
        (shared / "notes.txt").write_text("the group's")
        with pytest.raises(StageError, match="not a stage folder"):
            Stage(shared)
        assert stat.S_IMODE(os.stat(shared).st_mode) == mode
