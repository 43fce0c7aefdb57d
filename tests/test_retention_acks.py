"""Retention and the ack files it reads: an ack it cannot read stops it, a bool is no step, and
the acks of replicas gone for a day are removed (or ``acks`` outgrows what is read whole)."""

from __future__ import annotations

import errno
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from rollout_service import protocol
from rollout_service.checkpoint_format import ACKS_DIR
from rollout_service.checkpoint_reader import list_checkpoints
from rollout_service.sidecar.acks import write_ack
from rollout_service.untrusted_files import UnreadableFile
from trainer_helpers import bare_publisher
from trainer_hooks.checkpoint_publisher import CheckpointPublisher


def _publisher(root: Path, keep: int) -> CheckpointPublisher:
    return bare_publisher(root, keep, sync_timeout_s=30)


def _publish(publisher: CheckpointPublisher) -> int:
    version = publisher.next_version()
    publisher.publish_and_wait(version, [("w", torch.full((4,), float(version)))])
    return version


def _set_heartbeat(path: Path, heartbeat: float) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), "heartbeat": heartbeat}))


def _steps(root: Path) -> list[int]:
    return [c.step for c in list_checkpoints(root)]


def test_an_ack_the_storage_fails_to_read_stops_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A live replica still on step 3, whose ack read fails once in the storage (ESTALE while its
    sidecar replaces the file over NFS; simulated, as a local file system cannot be made to
    return it): step 3 is kept, with a warning naming the file. It used to be skipped as if it
    were no ack, and step 3 deleted under the replica."""
    publisher = _publisher(tmp_path, keep=1)
    for _ in range(3):
        _publish(publisher)
    write_ack(tmp_path, "lagging", {"loaded_step": 3, "loading_step": None})
    real = protocol.read_small

    def stale(root: Path, path: Path, **kw: object) -> bytes:
        if path.name == "lagging.json":
            raise UnreadableFile(errno.ESTALE, f"{path.name} cannot be read: Stale file handle")
        return real(root, path, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(protocol, "read_small", stale)
    with caplog.at_level(logging.WARNING):
        _publish(publisher)
    assert 3 in _steps(tmp_path)
    assert "lagging.json" in caplog.text and "not deleting old checkpoints" in caplog.text
    monkeypatch.setattr(protocol, "read_small", real)
    _publish(publisher)  # read again: step 3 is still protected by the live ack, the others go
    assert _steps(tmp_path) == [3, 5]
    publisher.close()


def test_a_file_that_is_no_ack_is_skipped_not_blocking(tmp_path: Path) -> None:
    """Only the storage's failures stop retention: a stray file that reads but is no JSON object
    is skipped, and retention goes on."""
    publisher = _publisher(tmp_path, keep=1)
    (tmp_path / ACKS_DIR).mkdir()
    (tmp_path / ACKS_DIR / "stray.json").write_text("not json")
    for _ in range(3):
        _publish(publisher)
    assert _steps(tmp_path) == [3]
    publisher.close()


def test_a_bool_in_an_ack_protects_no_step(tmp_path: Path) -> None:
    """``"loaded_step": true`` is no step (JSON true is Python's ``1``): step 1 is not kept for it."""
    publisher = _publisher(tmp_path, keep=1)
    write_ack(tmp_path, "odd", {"loaded_step": True, "loading_step": None})
    for _ in range(3):
        _publish(publisher)
    assert _steps(tmp_path) == [3]
    publisher.close()


def test_acks_of_replicas_gone_for_a_day_are_removed(tmp_path: Path) -> None:
    """Every pod of a Deployment leaves ``acks/<pod>.json``: those not heard from for
    ``ACK_EXPIRY_S`` are removed at the next retention; a recent one (dead for an hour) and a
    live one stay, and so does a file whose heartbeat is no time (not an ack retention owns)."""
    now = time.time()
    old = write_ack(tmp_path, "pod-a", {"loaded_step": None, "loading_step": None})
    _set_heartbeat(old, now - protocol.ACK_EXPIRY_S - 60)
    hour = write_ack(tmp_path, "pod-b", {"loaded_step": None, "loading_step": None})
    _set_heartbeat(hour, now - 3600)
    live = write_ack(tmp_path, "pod-c", {"loaded_step": None, "loading_step": None})
    odd = write_ack(tmp_path, "pod-d", {"loaded_step": None, "loading_step": None})
    odd.write_text(json.dumps({"heartbeat": "yesterday"}))
    publisher = _publisher(tmp_path, keep=1)
    _publish(publisher)
    assert not old.exists()
    assert hour.exists() and live.exists() and odd.exists()
    publisher.close()


def test_a_flood_of_expired_acks_stops_retention_only_once(tmp_path: Path) -> None:
    """More than ``MAX_ACK_ENTRIES`` ack files of replicas gone for good: the folder is not read
    whole, so that retention keeps everything; but what was read is removed, and retention works
    again at the next publish. It used to stay stopped for good (the root filled)."""
    folder = tmp_path / ACKS_DIR
    folder.mkdir()
    stale = json.dumps({"heartbeat": time.time() - 2 * protocol.ACK_EXPIRY_S, "loaded_step": None})
    for i in range(protocol.MAX_ACK_ENTRIES + 1):
        (folder / f"pod-{i}.json").write_text(stale)
    publisher = _publisher(tmp_path, keep=1)
    for _ in range(3):
        _publish(publisher)
    assert _steps(tmp_path) == [3]
    assert len(list(folder.iterdir())) == 0
    publisher.close()
