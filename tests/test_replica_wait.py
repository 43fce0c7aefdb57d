"""Waiting for replicas through ack files: a timeout names the lagging and the dead ones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rollout_service.sidecar.acks import write_ack
from trainer_hooks.replica_wait import AckFileWaiter, CheckpointRejected, ReplicaSyncTimeout


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
        r"\(dead\?\): gone \(last heartbeat 60\d s ago by this host's clock\)",
    ):
        waiter.wait(4, timeout_s=1)


def test_the_ack_wait_stops_at_once_for_a_replica_that_cannot_load_any_checkpoint(tmp_path: Path) -> None:
    """A sidecar whose SGLang restart budget is spent (``fatal``) says so in its ack file now; the
    ack-file wait gave up only at ``sync_timeout``, as if the replica were slow."""
    from rollout_service.sidecar.acks import AckWriter
    from rollout_service.sidecar.state import SidecarState
    from trainer_hooks.replica_wait import ReplicaFailed

    state = SidecarState(replica_id="r0", checkpoint_path=str(tmp_path), sglang_url="http://x", loaded_step=3)
    state.sglang_healthy = True
    state.fatal = {"reason": "restart_budget_spent", "message": "SGLang crashed 5 times in 600 s"}
    AckWriter(tmp_path, "r0").write(state.report())  # what the sidecar writes
    waiter = AckFileWaiter(tmp_path, 1, max_age_s=60)
    t0 = time.monotonic()
    with pytest.raises(ReplicaFailed, match="replica r0 cannot load any checkpoint .restart_budget_spent: SGLang"):
        waiter.wait(4, timeout_s=30)
    assert time.monotonic() - t0 < 5
    state.fatal = None
    state.rejected = {4: "shape_mismatch"}
    AckWriter(tmp_path, "r0").write(state.report())
    with pytest.raises(CheckpointRejected, match="replica r0 rejected checkpoint step-00000004 .shape_mismatch"):
        waiter.wait(4, timeout_s=30)
    assert waiter.wait(3, timeout_s=5)  # what it serves still counts


@pytest.mark.parametrize("spare", ["fatal", "rejected"])
def test_a_spare_replicas_refusal_does_not_stop_a_wait_others_can_satisfy(tmp_path: Path, spare: str) -> None:
    """expected_replicas counts live replicas: one of two that cannot serve the step leaves the
    other to ack it (the wait stopped at once at the first refusal, a single point of failure)."""
    import threading

    from rollout_service.sidecar.acks import AckWriter
    from rollout_service.sidecar.state import SidecarState

    def ack(replica: str, loaded: int, **fields: object) -> None:
        state = SidecarState(replica_id=replica, checkpoint_path=str(tmp_path), sglang_url="http://x")
        state.loaded_step, state.sglang_healthy = loaded, True
        for name, value in fields.items():
            setattr(state, name, value)
        AckWriter(tmp_path, replica).write(state.report())

    ack("good", 3)
    if spare == "fatal":
        ack("spare", 3, fatal={"reason": "restart_budget_spent", "message": "x"})
    else:
        ack("spare", 3, rejected={4: "sglang_crashed_on_load"})
    later = threading.Timer(1.0, lambda: ack("good", 4))
    later.start()
    try:
        views = AckFileWaiter(tmp_path, 1, max_age_s=60).wait(4, timeout_s=20)
    finally:
        later.cancel()
    assert {v.name for v in views} == {"good", "spare"}
    # With two expected, the spare's refusal leaves too few: the wait ends at once, naming it.
    t0 = time.monotonic()
    with pytest.raises((CheckpointRejected, ReplicaSyncTimeout), match="replica spare"):
        AckFileWaiter(tmp_path, 2, max_age_s=60).wait(5 if spare == "fatal" else 4, timeout_s=20)
    assert time.monotonic() - t0 < 5
