"""Two trainers publishing into one checkpoint root are stopped at the publish, not at generation.

Each replica serves the newest step under the root, whichever run published it, so two runs
sharing a root take turns serving each other's weights. The publisher numbers above the newest
step of any run (a restarted trainer is a new run), and once it has published, a newer step of
another run means a second writer: its next publish refuses, naming both runs and what to do.
Before, this surfaced only at generation, after ``sync_timeout``, as a completion "newer than any
version this run published".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from delta_helpers import Model
from rollout_service.checkpoint_format import MANIFEST_NAME, Manifest, step_dir_name
from rollout_service.delta_writer import DeltaCheckpointWriter
from shared_fs import sshfs_mount
from test_publish_failures import _publisher


@pytest.mark.parametrize("delta", [False, True])
def test_the_run_that_finds_another_runs_newer_step_stops_before_publishing(tmp_path: Path, delta: bool) -> None:
    root = tmp_path / "root"
    first = _publisher(root, DeltaCheckpointWriter(full_every=100) if delta else None)
    model = Model(lr=1e-3)
    first.publish_and_wait(first.next_version(), model.tensors())
    second = _publisher(root)  # a restart (or a second trainer): numbers above the first run's newest
    try:
        assert second.next_version() == 2
        second.publish_and_wait(2, model.tensors())
        with pytest.raises(RuntimeError) as err:
            first.next_version()
        message = str(err.value)
        assert str(root / step_dir_name(2)) in message
        assert first.run_id in message and second.run_id in message
        assert "two trainers are publishing" in message and "checkpoint_path" in message
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
            step_dir_name(1),
            step_dir_name(2),
        ]
        # The newer run goes on: its own steps are no second writer.
        model.step()
        assert second.next_version() == 3
        second.publish_and_wait(3, model.tensors())
        assert second.next_version() == 4
    finally:
        first.close()
        second.close()


def test_a_newer_step_without_a_run_id_is_another_writer_too(tmp_path: Path) -> None:
    """A manifest written without a run id (another tool, an older writer) is not this run's."""
    root = tmp_path / "root"
    publisher = _publisher(root)
    other = _publisher(tmp_path / "other")
    try:
        publisher.publish_and_wait(publisher.next_version(), Model(lr=1e-3).tensors())
        other.publish_and_wait(2, Model(lr=1e-3).tensors())
        manifest = json.loads((tmp_path / "other" / step_dir_name(2) / MANIFEST_NAME).read_text())
        del manifest["run_id"]
        (tmp_path / "other" / step_dir_name(2) / MANIFEST_NAME).write_text(json.dumps(manifest))
        (tmp_path / "other" / step_dir_name(2)).rename(root / step_dir_name(2))
        with pytest.raises(RuntimeError, match=r"another run \(run id not recorded\)"):
            publisher.next_version()
    finally:
        publisher.close()
        other.close()


def test_an_unreadable_newer_manifest_does_not_stop_the_run(tmp_path: Path) -> None:
    """A step whose manifest cannot be read now may be anything: numbering goes on above it."""
    root = tmp_path / "root"
    publisher = _publisher(root)
    try:
        publisher.publish_and_wait(publisher.next_version(), Model(lr=1e-3).tensors())
        stray = root / step_dir_name(2)
        stray.mkdir()
        (stray / MANIFEST_NAME).mkdir()  # a folder where the manifest should be: read fails with EISDIR
        assert publisher.next_version() == 3
    finally:
        publisher.close()


def test_a_step_published_between_the_last_look_and_the_rename_is_another_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename onto a folder another run published meanwhile fails with ENOTEMPTY, not
    EEXIST (the looks before it said the name was free: a network file system's cached absence);
    it said "check the storage"."""
    from rollout_service import checkpoint_writer

    root = tmp_path / "root"
    first, second = _publisher(root), _publisher(root)
    try:
        model = Model(lr=1e-3)
        first.publish_and_wait(first.next_version(), model.tensors())
        version = first.next_version()
        second.publish_and_wait(second.next_version(), model.tensors())  # the other run takes it
        taken = str(root / step_dir_name(version))
        lexists, published = checkpoint_writer.os.path.lexists, checkpoint_writer.is_published_dir
        monkeypatch.setattr(checkpoint_writer.os.path, "lexists", lambda p: str(p) != taken and lexists(p))
        monkeypatch.setattr(checkpoint_writer, "is_published_dir", lambda p: None if str(p) == taken else published(p))
        with pytest.raises(RuntimeError, match="two trainers are publishing") as err:
            first.publish_and_wait(version, model.tensors())
        assert second.run_id in str(err.value)
        assert Manifest.load(root / step_dir_name(version)).run_id == second.run_id
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("cached", [True, False])
def test_two_trainers_on_two_hosts_of_a_network_file_system(tmp_path: Path, cached: bool) -> None:
    """One trainer writes through an sshfs mount, the other on the server's disk (another host).

    With sshfs's default caches the mount's listing still misses the other host's new step for a
    while, so the trainer numbers its next version onto it: the publish finds the name taken, and
    says why. Without caches the numbering sees the step and refuses before anything is written."""
    options = () if cached else ("dir_cache=no", "attr_timeout=0", "entry_timeout=0")
    with sshfs_mount(tmp_path / "fs", *options) as (server, mount):
        (server / "ckpts").mkdir()
        remote = _publisher(mount / "ckpts")
        local = _publisher(server / "ckpts")
        try:
            model = Model(lr=1e-3)
            remote.publish_and_wait(remote.next_version(), model.tensors())
            local.publish_and_wait(local.next_version(), model.tensors())
            model.step()
            with pytest.raises(RuntimeError, match="two trainers are publishing") as err:
                remote.publish_and_wait(remote.next_version(), model.tensors())
            assert local.run_id in str(err.value)
            assert remote.latest_version == (2 if cached else 1), "the listing was not what this test expects"
            published = Manifest.load(server / "ckpts" / step_dir_name(2))
            assert published.run_id == local.run_id  # nothing of the other run's step was replaced
            assert sorted(p.name for p in (server / "ckpts").iterdir() if p.name.startswith("step-")) == [
                step_dir_name(1),
                step_dir_name(2),
            ]
        finally:
            remote.close()
            local.close()


def test_a_first_checkpoint_numbered_onto_another_runs_step_says_so(tmp_path: Path) -> None:
    """A run whose first version was numbered before another run published that step (the
    listing did not show it) stopped with "already published; steps are immutable", which reads
    like a bug of this run: it now names the other run and says a restart numbers above it."""
    root = tmp_path / "root"
    restarted = _publisher(root)
    other = _publisher(root)
    try:
        model = Model(lr=1e-3)
        version = restarted.next_version()
        other.publish_and_wait(other.next_version(), model.tensors())
        with pytest.raises(RuntimeError) as err:
            restarted.publish_and_wait(version, model.tensors())
        message = str(err.value)
        assert other.run_id in message and restarted.run_id in message
        assert "did not show" in message and "Restart the run" in message
        assert Manifest.load(root / step_dir_name(version)).run_id == other.run_id
        fresh = _publisher(root)  # the restart it asks for numbers above the other run's step
        try:
            assert fresh.next_version() == version + 1
        finally:
            fresh.close()
    finally:
        restarted.close()
        other.close()


def test_a_dead_runs_step_hidden_by_a_cached_listing_is_named_at_the_first_publish(tmp_path: Path) -> None:
    """Real sshfs with its default caches: a run that died on the server's host published its
    last step just after the restarted run's mount listed the root; the restart numbers onto it."""
    with sshfs_mount(tmp_path / "fs") as (server, mount):
        (server / "ckpts").mkdir()
        restarted = _publisher(mount / "ckpts")
        dead = _publisher(server / "ckpts")
        try:
            model = Model(lr=1e-3)
            assert restarted.next_version() == 1  # lists the (empty) root through the mount
            dead.publish_and_wait(dead.next_version(), model.tensors())
            version = restarted.next_version()
            assert version == 1, "the mount's listing was not cached as this test expects"
            with pytest.raises(RuntimeError, match="did not show") as err:
                restarted.publish_and_wait(version, model.tensors())
            assert dead.run_id in str(err.value)
            assert Manifest.load(server / "ckpts" / step_dir_name(1)).run_id == dead.run_id
            assert sorted(p.name for p in (server / "ckpts").iterdir() if not p.name.startswith("acks")) == [
                step_dir_name(1)
            ]
        finally:
            restarted.close()
            dead.close()
