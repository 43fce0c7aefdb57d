"""Retention and version numbering with odd entries under the (untrusted) checkpoint root.

A stray process may drop anything there: a file or an empty folder named like a step, a link,
a tree a thousand levels deep, a folder its owner cannot empty. Only published checkpoints
(real folders holding a manifest) count; the rest is logged and left alone, and a removal that
fails is logged with its path, never the trainer's end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollout_service.checkpoint_format import MAX_STEP, Manifest, step_dir_name
from rollout_service.checkpoint_reader import list_checkpoints
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.tree_removal import remove_tree
from trainer_helpers import bare_publisher
from trainer_hooks.checkpoint_publisher import CheckpointPublisher
from trainer_hooks.checkpoint_retention import (
    chain_dependencies,
    list_step_entries,
    newest_checkpoints,
    prune_checkpoints,
)

REPO = Path(__file__).resolve().parents[1]
DEPTH = 3000
"""Deeper than Python's recursion limit (1000): ``shutil.rmtree`` recurses once per level."""


def _publish(root: Path, steps: range) -> None:
    for s in steps:
        publish_checkpoint(root, s, [("w", torch.full((4,), float(s)))], config={"model_type": "x"})


def _publisher(root: Path, keep: int | None = 2) -> CheckpointPublisher:
    return bare_publisher(root, keep)


def _real_steps(root: Path) -> list[int]:
    return [c.step for c in list_checkpoints(root) if (c.path / "manifest.json").is_file()]


def _deep_tree(top: Path, depth: int) -> None:
    """``top/a/a/.../a`` ``depth`` levels deep with a file at the bottom (built by descriptors:
    the path is longer than PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("a", dir_fd=fd)
        child = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(os.open("bottom", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)


def _age(path: Path, seconds: float = 7200.0) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


# (a) a stray file named like a newer step


def test_a_stray_file_named_like_a_step_does_not_stop_retention(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _publish(tmp_path, range(1, 8))
    stray = tmp_path / step_dir_name(500)
    stray.write_text("junk")
    assert chain_dependencies(tmp_path, {500, 7}) == set()  # not a checkpoint: protects nothing
    with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
        assert prune_checkpoints(tmp_path, keep=2, protected={7}) == [1, 2, 3, 4, 5]
        _publish(tmp_path, range(8, 9))
        assert prune_checkpoints(tmp_path, keep=2) == [6]
    assert _real_steps(tmp_path) == [7, 8]
    assert stray.read_text() == "junk"  # not ours: never deleted
    warnings = [r.getMessage() for r in caplog.records if stray.name in r.getMessage()]
    assert len(warnings) == 1, warnings  # named once, not at every publish


# (b) a stray empty folder (or a link) named like a step takes no keep slot


@pytest.mark.parametrize("manifest", [None, "{}", '{"step": 500}'])
def test_a_folder_without_a_manifest_of_its_step_takes_no_keep_slot(tmp_path: Path, manifest: str | None) -> None:
    _publish(tmp_path, range(1, 8))
    stray = tmp_path / step_dir_name(500)
    stray.mkdir()
    if manifest is not None:
        (stray / "manifest.json").write_text(manifest)
    assert prune_checkpoints(tmp_path, keep=2) == [1, 2, 3, 4, 5]
    assert [c.step for c in list_checkpoints(tmp_path)] == [6, 7, 500]
    assert stray.is_dir()


def test_a_link_named_like_a_step_is_neither_counted_nor_followed(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _publish(root, range(1, 5))
    _publish(elsewhere, range(1, 2))
    (root / step_dir_name(2)).rename(root / "moved")
    os.symlink(elsewhere / step_dir_name(1), root / step_dir_name(2))  # old: would be deleted
    os.symlink(elsewhere / step_dir_name(1), root / step_dir_name(600))  # new: would take a slot
    assert prune_checkpoints(root, keep=1) == [1, 3]
    assert [c.step for c in list_checkpoints(root)] == [2, 4, 600]
    assert (root / step_dir_name(2)).is_symlink() and (root / step_dir_name(600)).is_symlink()
    assert _real_steps(elsewhere) == [1]  # never followed out of the root


# (c) version numbering


@pytest.mark.parametrize("kind", ["file", "empty folder", "bad manifest", "link"])
def test_a_stray_entry_at_the_last_step_does_not_steer_numbering(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    _publish(root, range(1, 3))
    stray = root / step_dir_name(MAX_STEP)
    if kind == "file":
        stray.write_text("junk")
    elif kind == "empty folder":
        stray.mkdir()
    elif kind == "bad manifest":
        stray.mkdir()
        (stray / "manifest.json").write_text(json.dumps({"step": 5}))
    else:
        os.symlink(root / step_dir_name(2), stray)
    publisher = _publisher(root)
    assert publisher.next_version() == 3
    publisher.publish_and_wait(3, [("w", torch.zeros(4))])
    assert publisher.next_version() == 4
    assert os.path.lexists(stray)


def test_numbering_skips_a_name_a_stray_entry_holds(tmp_path: Path) -> None:
    _publish(tmp_path, range(1, 2))
    (tmp_path / step_dir_name(2)).write_text("junk")
    (tmp_path / step_dir_name(3)).mkdir()
    publisher = _publisher(tmp_path)
    assert publisher.next_version() == 4
    publisher.publish_and_wait(4, [("w", torch.zeros(4))])
    assert _real_steps(tmp_path) == [1, 4]


def test_folders_holding_another_steps_manifest_are_read_once_not_at_every_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many folders above the newest step, each a copy of another step's checkpoint: numbering
    passes over them, and reads each manifest once per process, not at every sync (thousands of
    reads on shared storage per sync, within the sync's bound); a folder that becomes its step's
    checkpoint is seen at once."""
    _publish(tmp_path, range(1, 2))
    bogus = range(10, 60)
    for s in bogus:
        shutil.copytree(tmp_path / step_dir_name(1), tmp_path / step_dir_name(s))
    loads: list[str] = []
    real_load = Manifest.load.__func__  # type: ignore[attr-defined]

    def counting_load(cls, path, **kw):  # type: ignore[no-untyped-def]
        loads.append(Path(path).name)
        return real_load(cls, path, **kw)

    monkeypatch.setattr(Manifest, "load", classmethod(counting_load))
    publisher = _publisher(tmp_path, keep=None)
    assert publisher.next_version() == 2  # they do not steer the numbering
    assert len(loads) == len(bogus) + 1
    loads.clear()
    assert publisher.next_version() == 2
    assert loads == [step_dir_name(1)]  # only the real one, the newest that counts
    top = tmp_path / step_dir_name(bogus[-1])
    shutil.rmtree(top)
    _publish(tmp_path, range(bogus[-1], bogus[-1] + 1))  # now a real checkpoint of its step
    loads.clear()
    assert publisher.next_version() == bogus[-1] + 1
    assert loads == [top.name]
    published = list_step_entries(tmp_path).published
    assert [c.step for c in newest_checkpoints(tmp_path, published, 3)] == [bogus[-1], 1]
    manifest = json.loads((tmp_path / step_dir_name(1) / "manifest.json").read_text())
    manifest["step"] = bogus[0]
    (tmp_path / step_dir_name(bogus[0]) / "manifest.json").write_text(json.dumps(manifest))
    found = newest_checkpoints(tmp_path, published, 3)  # a rewritten manifest is read again
    assert [c.step for c in found] == [bogus[-1], bogus[0], 1]


def test_a_published_last_step_stops_numbering_with_what_to_do(tmp_path: Path) -> None:
    _publish(tmp_path, range(MAX_STEP, MAX_STEP + 1))
    publisher = _publisher(tmp_path)
    with pytest.raises(RuntimeError, match=rf"{step_dir_name(MAX_STEP)}.*fresh checkpoint root"):
        publisher.next_version()


# (d) trees too deep for shutil.rmtree


@pytest.fixture
def scrubbed(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, emptied with ``remove_tree`` after the test: a deep tree a failing test leaves
    would break pytest's own clean-up of old temporary folders (``shutil.rmtree``) in later runs."""
    yield tmp_path
    for entry in tmp_path.iterdir():
        with contextlib.suppress(OSError):
            remove_tree(entry)


def test_a_deep_tree_in_an_old_step_is_deleted_and_retention_goes_on(scrubbed: Path) -> None:
    tmp_path = scrubbed
    _publish(tmp_path, range(1, 5))
    _deep_tree(tmp_path / step_dir_name(1), DEPTH)
    _deep_tree(tmp_path / step_dir_name(2), DEPTH)
    assert prune_checkpoints(tmp_path, keep=1) == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(4)]


def test_a_deep_stale_temp_folder_is_removed_at_the_trainers_start(scrubbed: Path) -> None:
    tmp_path = scrubbed
    stale = tmp_path / ".tmp-step-00000009-x"
    stale.mkdir()
    _deep_tree(stale, DEPTH)
    _age(stale)
    publisher = _publisher(tmp_path)
    publisher.close()  # (waits for the removals it asked for)
    assert not stale.exists()


def test_a_slow_removal_of_leftovers_does_not_stop_the_trainer_from_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start removed killed writers' leftovers inside its bounded look at the root: a removal
    slower than ``sync_timeout`` (a large model's folder on NFS) made the trainer refuse to start,
    saying the root does not answer, at every restart until the removal was done."""
    from rollout_service import checkpoint_writer
    from trainer_hooks import checkpoint_retention

    stale = tmp_path / ".tmp-deleting-step-00000001-abcd1234"
    (stale / "d").mkdir(parents=True)
    _age(stale)
    real = checkpoint_retention.remove_tree

    def slow(path: Path) -> None:
        time.sleep(3.0)
        real(path)

    monkeypatch.setattr(checkpoint_retention, "remove_tree", slow)
    monkeypatch.setattr(checkpoint_writer, "remove_tree", slow)
    t0 = time.monotonic()
    publisher = bare_publisher(tmp_path, 2, sync_timeout_s=1.0)
    assert time.monotonic() - t0 < 2.0  # started; the removal goes on beside it
    assert publisher.next_version() == 1
    assert publisher._remover.join(30) == 0 and not stale.exists()
    publisher.close()


def test_remove_tree_never_follows_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep").write_text("x")
    doomed = tmp_path / "doomed"
    (doomed / "d").mkdir(parents=True)
    os.symlink(outside, doomed / "d" / "link")
    os.symlink(outside / "sub", doomed / "top-link")
    remove_tree(doomed)
    assert not os.path.lexists(doomed)
    assert (outside / "sub" / "keep").read_text() == "x"
    link = tmp_path / "link"
    os.symlink(outside, link)
    remove_tree(link)  # a link: unlinked, what it points to untouched
    assert not os.path.lexists(link) and (outside / "sub" / "keep").exists()


# (e) folders that cannot be emptied (needs a process without root's override of permissions)

_UNREMOVABLE = """
import json, logging, os, sys, time
from pathlib import Path
import torch
from rollout_service.checkpoint_reader import list_checkpoints
from rollout_service.checkpoint_writer import publish_checkpoint
from trainer_helpers import NoWaiter
from trainer_hooks.checkpoint_publisher import CheckpointPublisher

logging.basicConfig(level=logging.WARNING, format="%(message)s")
root = Path(sys.argv[1])
def locked(top):
    (top / "f").mkdir(parents=True)
    (top / "f" / "x").write_text("x")
    os.chmod(top / "f", 0o555)
stale = root / ".tmp-step-00000003-hdeadbeefp1-000000000000"
locked(stale)
other = root / ".tmp-step-00000004-dead"
other.mkdir()
for p in (stale, other):
    os.utime(p, (0, 0))
for s in range(1, 5):
    publish_checkpoint(root, s, [("w", torch.zeros(4))], config={"model_type": "x"})
locked(root / "step-00000001")
publisher = CheckpointPublisher(root, NoWaiter(), config={"model_type": "x"}, dtype=None,
                                max_shard_bytes=1 << 20, keep=1, sync_timeout_s=5, heartbeat_max_age_s=60)
publisher.publish_and_wait(5, [("w", torch.zeros(4))])
publisher.close()  # (waits for the removal of the deleted steps' files, which logs its failures)
print(json.dumps({
    "steps": [c.step for c in list_checkpoints(root)],
    "stale_left": stale.exists(),
    "other_left": other.exists(),
    "pruned": publisher.drain_records()[-1].pruned,
}))
"""


def _unprivileged() -> list[str]:
    """The command prefix that runs a child without root's override of file permissions."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise AssertionError(
            "running as root without setpriv (util-linux): no folder can be made that this process cannot empty"
        )
    caps = "-dac_override,-dac_read_search,-fowner"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}"]


def test_folders_that_cannot_be_emptied_are_logged_and_the_rest_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    try:
        done = subprocess.run(
            [*_unprivileged(), sys.executable, "-c", textwrap.dedent(_UNREMOVABLE), str(root)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        for path in root.rglob("f"):
            os.chmod(path, 0o755)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"steps": [5], "stale_left": True, "other_left": False, "pruned": 4}
    log = done.stderr
    assert "removing the files of .tmp-step-00000003" in log and "remove it by hand" in log
    assert "removing the files of step-00000001 failed" in log and "remove it by hand" in log


def test_a_root_too_full_to_list_does_not_end_a_run_that_has_published(tmp_path: Path, monkeypatch) -> None:
    """Past the listing's cap (a million entries; 20 here) a run numbers on from its own last
    version; a run that has published nothing yet cannot, and says why."""
    from rollout_service import checkpoint_reader

    _publish(tmp_path, range(1, 3))
    publisher = _publisher(tmp_path)
    assert publisher.next_version() == 3
    monkeypatch.setattr(checkpoint_reader, "MAX_ROOT_ENTRIES", 20)
    for i in range(20):
        (tmp_path / f"junk-{i}").write_bytes(b"")
    with pytest.raises(RuntimeError, match="cannot number the first checkpoint of this run: .*more than 20 entries"):
        publisher.next_version()
    publisher.latest_version = 7
    assert publisher.next_version() == 8
