"""Checkpoint retention and version numbering of the trainer's publisher."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from rollout_service.checkpoint_reader import list_checkpoints
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.sidecar.acks import write_ack
from trainer_helpers import NoWaiter
from trainer_hooks.checkpoint_publisher import CheckpointPublisher
from trainer_hooks.checkpoint_retention import prune_checkpoints


def test_retention_keeps_the_newest_and_what_a_live_replica_serves(tmp_path: Path) -> None:
    write_ack(tmp_path, "live", {"loaded_step": 1, "loading_step": None})
    write_ack(tmp_path, "dead", {"loaded_step": 2, "loading_step": None})
    dead_ack = tmp_path / "acks" / "dead.json"
    dead_ack.write_text(json.dumps({**json.loads(dead_ack.read_text()), "heartbeat": time.time() - 3600}))
    publisher = CheckpointPublisher(
        tmp_path,
        NoWaiter(),
        config={"model_type": "x"},
        dtype=None,
        max_shard_bytes=1 << 20,
        keep=2,
        sync_timeout_s=5,
        heartbeat_max_age_s=60,
    )
    for _ in range(5):
        version = publisher.next_version()
        publisher.publish_and_wait(version, [("w", torch.full((4,), float(version)))])
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 4, 5]
    assert prune_checkpoints(tmp_path, keep=1, protected={4}) == [1]
    publisher.close()  # waits for the background removal of the steps it deleted
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_versions_continue_above_checkpoints_already_in_the_root(tmp_path: Path) -> None:
    publish_checkpoint(tmp_path, 41, [("w", torch.zeros(2))], config={"model_type": "x"})
    publisher = CheckpointPublisher(
        tmp_path,
        NoWaiter(),
        config={"model_type": "x"},
        dtype=None,
        max_shard_bytes=1 << 20,
        keep=None,
        sync_timeout_s=5,
        heartbeat_max_age_s=60,
    )
    assert publisher.next_version() == 42
