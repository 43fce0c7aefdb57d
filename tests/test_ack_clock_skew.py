"""A replica whose host clock runs behind the trainer's (a review of the ack files' readers).

A heartbeat was judged by comparing the sidecar's wall clock with the trainer's: one running more
than ``replica_heartbeat_max_age`` (60 s) behind looked dead however often it rewrote its ack, so
``expected_replicas`` waits timed out ("last heartbeat 70 s ago") and retention could delete the
step it served. A heartbeat the trainer sees *change* now shows a live replica, timed on the
trainer's own clock, and retention keeps what a replica up to ``MAX_CLOCK_SKEW_S`` behind serves.
Real ack files, rewritten by a thread as a sidecar does (heartbeats shifted as a slow clock would).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_service.checkpoint_format import ACKS_DIR
from rollout_service.protocol import ReplicaReport
from trainer_hooks.replica_wait import AckFileWaiter, ReplicaSyncTimeout


def write_skewed_ack(root: Path, behind_s: float, **fields: object) -> None:
    """The ack a sidecar writes, its heartbeat from a clock ``behind_s`` seconds slow."""
    report = ReplicaReport(replica_id="r1", run_id="R", ready=True, sglang_healthy=True, **fields)  # type: ignore[arg-type]
    payload = dict(report.to_dict(), heartbeat=time.time() - behind_s)
    folder = root / ACKS_DIR
    folder.mkdir(exist_ok=True)
    tmp = folder / ".r1.json.tmp"
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, folder / "r1.json")


@pytest.fixture
def skewed_replica(tmp_path: Path) -> Iterator[Path]:
    """A live replica serving step 3, rewriting its ack every 0.2 s with a clock 70 s behind."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            write_skewed_ack(tmp_path, 70.0, loaded_step=3)
            stop.wait(0.2)

    thread = threading.Thread(target=beat, daemon=True)
    write_skewed_ack(tmp_path, 70.0, loaded_step=3)
    thread.start()
    try:
        yield tmp_path
    finally:
        stop.set()
        thread.join()


def test_a_live_replica_whose_clock_is_behind_acks(skewed_replica: Path) -> None:
    waiter = AckFileWaiter(skewed_replica, 1, max_age_s=60.0)
    waiter.run_id = "R"
    views = waiter.wait(3, timeout_s=10.0)
    assert [v.name for v in views] == ["r1"]


def test_what_a_replica_whose_clock_is_behind_serves_is_kept_from_its_first_read(skewed_replica: Path) -> None:
    waiter = AckFileWaiter(skewed_replica, 1, max_age_s=60.0)
    assert waiter.protected_versions() == {3}  # one read: not yet seen to change


def test_an_ack_that_stops_changing_is_dead_whatever_its_clock(tmp_path: Path) -> None:
    write_skewed_ack(tmp_path, 70.0, loaded_step=3)
    waiter = AckFileWaiter(tmp_path, 1, max_age_s=60.0)
    waiter.run_id = "R"
    with pytest.raises(ReplicaSyncTimeout, match=r"r1 \(last heartbeat 7\d s ago by this host's clock\)"):
        waiter.wait(3, timeout_s=1.5)
    write_skewed_ack(tmp_path, 60.0 + 300.0 + 10.0, loaded_step=3)  # further back than any skew allowed
    assert waiter.protected_versions() == set()


def test_a_file_servers_clock_ahead_gives_no_negative_sync_time() -> None:
    """A step's rename time comes from the file server's clock: 30 s ahead of the sidecar's, the
    sync's ``total_s`` was -30 s (``detect_s`` was clamped to 0, ``total_s`` was not)."""
    from rollout_service.sidecar.sync_record import SyncRecord

    now = time.time()
    record = SyncRecord.ended_now(
        published=now + 30.5, detected=now, validate_s=0.1, load_s=0.2, step=1, weight_version="1", path="p"
    )
    assert record.detect_s == 0.0
    assert record.total_s is not None and record.total_s >= 0.0
    assert record.total_s >= time.time() - now - 1e-3  # at least from when it was seen


class _Clocks:
    """The trainer's wall and monotonic clocks, moved by hand."""

    def __init__(self) -> None:
        self.wall, self.mono = 1_800_000_000.0, 1000.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def test_a_heartbeat_seen_to_move_long_ago_or_far_behind_shows_no_live_replica() -> None:
    """What moved between two reads far apart may have died since; a heartbeat a day behind that
    moves is no clock skew (the allowance is MAX_CLOCK_SKEW_S, as for one in the future)."""
    from rollout_service.protocol import MAX_CLOCK_SKEW_S, HeartbeatClock

    clocks = _Clocks()
    clock = HeartbeatClock(monotonic=lambda: clocks.mono)

    def problem(heartbeat: float) -> str | None:
        return clock.problem("r1", heartbeat, now=clocks.wall, max_age_s=60)

    behind = 70.0  # a replica 70 s slow, writing every 5 s: live once seen to move
    assert problem(clocks.wall - behind) is not None  # first read: its age decides
    clocks.advance(5)
    assert problem(clocks.wall - behind) is None
    clocks.advance(5)
    assert problem(clocks.wall - behind) is None
    # It writes once more just after this read, then dies; the next read is 10 minutes later.
    last = clocks.wall + 1 - behind
    clocks.advance(600)
    assert problem(last) is not None, "moved since a read 600 s ago: not a live replica now"
    # A heartbeat a day behind, moving between reads 5 s apart: beyond any clock skew allowed.
    day = HeartbeatClock(monotonic=lambda: clocks.mono)
    for _ in range(3):
        assert day.problem("r2", clocks.wall - 86_400, now=clocks.wall, max_age_s=60) is not None
        clocks.advance(5)
    near = HeartbeatClock(monotonic=lambda: clocks.mono)  # just inside the allowance: live once it moves
    near.problem("r3", clocks.wall - 60 - MAX_CLOCK_SKEW_S + 20, now=clocks.wall, max_age_s=60)
    clocks.advance(5)
    assert near.problem("r3", clocks.wall - 60 - MAX_CLOCK_SKEW_S + 20, now=clocks.wall, max_age_s=60) is None


def test_a_heartbeat_that_stops_moving_is_dead_after_max_age() -> None:
    from rollout_service.protocol import HeartbeatClock

    clocks = _Clocks()
    clock = HeartbeatClock(monotonic=lambda: clocks.mono)
    heartbeat = clocks.wall - 70
    clock.problem("r1", heartbeat, now=clocks.wall, max_age_s=60)
    clocks.advance(5)
    heartbeat += 5
    assert clock.problem("r1", heartbeat, now=clocks.wall, max_age_s=60) is None
    for _ in range(11):  # the replica is gone: the same heartbeat, read every 5 s
        clocks.advance(5)
        assert clock.problem("r1", heartbeat, now=clocks.wall, max_age_s=60) is None
    clocks.advance(10)
    assert clock.problem("r1", heartbeat, now=clocks.wall, max_age_s=60) is not None
