"""Waiting for replicas through ack files: a timeout names the lagging and the dead ones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rollout_service.sidecar.acks import write_ack
from trainer_hooks.replica_wait import AckFileWaiter, ReplicaSyncTimeout


def test_ack_file_timeout_names_lagging_and_dead_replicas(tmp_path: Path) -> None:
    write_ack(tmp_path, "alive", {"loaded_step": 3, "loading_step": 4})
    write_ack(tmp_path, "gone", {"loaded_step": 3})
    gone = tmp_path / "acks" / "gone.json"
    gone.write_text(json.dumps({**json.loads(gone.read_text()), "heartbeat": time.time() - 600}))
    waiter = AckFileWaiter(tmp_path, expected=2, max_age_s=60)
    with pytest.raises(
        ReplicaSyncTimeout,
        match=r"only 0 of expected_replicas=2 replica\(s\) acknowledged checkpoint "
        r"step-00000004 within sync_timeout=1 s\. Live replicas: 1\. Lagging: "
        r"alive \(loaded 3, loading 4\)\. Replicas without a fresh heartbeat "
        r"\(dead\?\): gone \(last heartbeat 60\d s ago\)",
    ):
        waiter.wait(4, timeout_s=1)
