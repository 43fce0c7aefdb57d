"""The trainer's reads of the ack files are bounded: a checkpoint root whose network file system
stops answering (a real one: the sshd serving an sshfs mount is frozen, as a hung NFS server)
and an acks folder flooded with stray files both end ``AckFileWaiter.wait`` at its deadline with
``ReplicaSyncTimeout`` saying why, never a hang, and a hung root holds one thread, not one per poll."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import rollout_service.protocol as protocol
import trainer_hooks.replica_wait as replica_wait
from rollout_service.protocol import list_acks, read_acks
from rollout_service.sidecar.acks import write_ack
from rollout_service.sidecar.root_gate import RootUnresponsive
from shared_fs import server_frozen, sshfs_mount
from trainer_hooks.replica_wait import AckFileWaiter, ReplicaSyncTimeout, RootLooks

SLACK_S = 1.5
"""How far past its timeout a wait may end (the read's grace, the last poll, a loaded machine)."""


def ends_within(fn: Callable[[], object], limit_s: float) -> BaseException | None:
    """Run ``fn`` on a daemon thread (so that a hang fails the test instead of holding it);
    assert it ended within ``limit_s`` and return what it raised (None if nothing)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still running after {time.monotonic() - t0:.1f} s (limit {limit_s} s)"
    return raised[0] if raised else None


def reads_of(root: Path) -> int:
    """Threads reading ``root`` for a RootLooks (alive, blocked or not)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith(f"reading {root}:"))


def test_a_wait_on_a_hung_root_ends_at_its_deadline_naming_the_root_and_recovers(tmp_path: Path) -> None:
    fs = tmp_path / "fs"
    with sshfs_mount(fs, "dcache_timeout=1", "attr_timeout=1") as (srv, mnt):
        write_ack(srv, "r0", {"loaded_step": 1})
        waiter = AckFileWaiter(mnt, 1, max_age_s=60)
        assert [v.name for v in waiter.wait(1, timeout_s=10)] == ["r0"]
        with server_frozen(fs):
            time.sleep(2.5)  # past the mount's caches: every look reaches the frozen server
            for _ in range(3):  # a blocked read is waited for, never joined by another thread
                error = ends_within(lambda: waiter.wait(2, timeout_s=2.0), 2.0 + SLACK_S)
                assert isinstance(error, ReplicaSyncTimeout), error
                message = str(error)
                assert f"the checkpoint root {mnt} is not answering" in message, message
                assert "Check its file system" in message and "sync_timeout=2 s" in message
                assert reads_of(mnt) == 1
            old_bound = replica_wait.ROOT_LOOK_TIMEOUT_S
            replica_wait.ROOT_LOOK_TIMEOUT_S = 1.0
            try:
                error = ends_within(waiter.protected_versions, 1.0 + SLACK_S)
            finally:
                replica_wait.ROOT_LOOK_TIMEOUT_S = old_bound
            assert isinstance(error, RootUnresponsive) and str(mnt) in str(error), error
            write_ack(srv, "r0", {"loaded_step": 2})  # the sidecar goes on on the server's side
        assert [v.loaded_step for v in waiter.wait(2, timeout_s=30)] == [2]
        assert reads_of(mnt) == 0
        assert waiter.protected_versions() == {2}


def test_root_looks_start_no_second_thread_behind_a_blocked_one(tmp_path: Path) -> None:
    looks = RootLooks(tmp_path)
    release = threading.Event()
    started: list[float] = []

    def blocks(deadline: float) -> str:
        started.append(deadline)
        release.wait()
        return "late"

    with pytest.raises(RootUnresponsive, match=r"listing did not come back within .* Check its file system"):
        looks.run(blocks, time.monotonic() + 0.2, "listing")
    t0 = time.monotonic()
    with pytest.raises(RootUnresponsive, match=r"an earlier read \(listing\) has been blocked"):
        looks.run(blocks, time.monotonic() + 1.0, "another listing")
    # The blocked read is waited for until the caller's deadline (1 s), and no longer: the bound
    # RootLooks.run promises, with SLACK_S for a loaded machine.
    took = time.monotonic() - t0
    assert 0.95 < took < 1.0 + SLACK_S, f"{took:.2f} s for a caller's bound of 1 s"
    assert len(started) == 1 and reads_of(tmp_path) == 1
    release.set()
    assert looks.run(lambda deadline: "fresh", time.monotonic() + 1.0, "a look after") == "fresh"


def make_strays(acks: Path, count: int, name: str = "stray-{}.json") -> None:
    """``count`` empty files in ``acks`` named like ack files (or like ``name``)."""
    acks.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        os.close(os.open(acks / name.format(i), os.O_WRONLY | os.O_CREAT, 0o644))


def test_a_flood_of_stray_ack_files_ends_the_wait_on_time_saying_what_to_remove(tmp_path: Path) -> None:
    make_strays(tmp_path / "acks", 50_000)
    error = ends_within(lambda: AckFileWaiter(tmp_path, 1, max_age_s=60).wait(1, timeout_s=0.5), 0.5 + SLACK_S)
    assert isinstance(error, ReplicaSyncTimeout), error
    assert f"{tmp_path / 'acks'}" in str(error) and "remove the other files from it" in str(error), str(error)


def test_the_acks_folder_is_read_up_to_a_cap_and_an_ack_among_strays_is_found_below_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(protocol, "MAX_ACK_ENTRIES", 1000)
    acks = tmp_path / "acks"
    make_strays(acks, 900, "junk-{}.txt")
    write_ack(tmp_path, "r0", {"loaded_step": 3})
    listing = list_acks(tmp_path)
    assert list(listing.acks) == ["r0"] and listing.cut_short is None
    assert [v.name for v in AckFileWaiter(tmp_path, 1, max_age_s=60).wait(3, timeout_s=5)] == ["r0"]

    make_strays(acks, 1200, "junk-{}.txt")
    listing = list_acks(tmp_path)
    assert listing.cut_short is not None and len(listing.acks) <= 1
    assert f"{acks} holds more than 1000 entries" in listing.cut_short
    with caplog.at_level(logging.WARNING, logger="rollout_service.protocol"):
        read_acks(tmp_path)
    assert "remove the other files from it" in caplog.text and str(acks) in caplog.text


def test_only_names_of_ack_files_are_read(tmp_path: Path) -> None:
    write_ack(tmp_path, "r0.a_b-1", {"loaded_step": 1})
    acks = tmp_path / "acks"
    for name in (".hidden.json", "with space.json", "-dash.json", f"{'x' * 129}.json", "r1.json.tmp"):
        (acks / name).write_text('{"loaded_step": 1, "heartbeat": 1e9}')
    assert list(read_acks(tmp_path)) == ["r0.a_b-1"]
