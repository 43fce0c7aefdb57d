"""The polling watcher (``--poll``) keeps to the root's ``step-*`` entries.

A stray process that floods the checkpoint root with files must cost the polling watcher
neither a snapshot of every file nor a stat of each at every poll: it still reports a new step
within a few polls, in bounded memory, and reads no further than the root listing's cap.
"""

from __future__ import annotations

import os
import time
import tracemalloc

from rollout_service.sidecar import watcher as watcher_module
from rollout_service.sidecar.watcher import CheckpointWatcher, step_entries


def wait_for(seen: list[str], want: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if want in seen:
            return True
        time.sleep(0.02)
    return False


def test_a_root_flooded_with_files_costs_the_polling_watcher_neither_memory_nor_latency(tmp_path):
    for i in range(50_000):
        (tmp_path / f"junk-{i}").touch()
    (tmp_path / "step-00000001").mkdir()
    seen: list[str] = []
    tracemalloc.start()
    try:
        watcher = CheckpointWatcher(tmp_path, seen.append, poll_interval_s=0.1)
        watcher.start()
        try:
            time.sleep(0.3)
            (tmp_path / "step-00000002").mkdir()
            found = wait_for(seen, "created:step-00000002", timeout_s=1.5)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            watcher.stop()
    finally:
        tracemalloc.stop()
    assert found, f"the new step was not reported within 1.5 s of 0.1 s polls: {seen}"
    # watchdog's own snapshot of 50,000 entries takes about 76 MB
    assert peak < 5e6, f"the watcher held {peak / 1e6:.1f} MB for a root of 50,000 stray files"
    assert seen == ["created:step-00000002"]


def test_the_polling_watcher_reports_a_step_removed_and_one_republished_under_its_name(tmp_path):
    (tmp_path / "step-00000001").mkdir()
    seen: list[str] = []
    watcher = CheckpointWatcher(tmp_path, seen.append, poll_interval_s=0.05)
    watcher.start()
    try:
        time.sleep(0.2)
        os.rmdir(tmp_path / "step-00000001")
        assert wait_for(seen, "deleted:step-00000001", timeout_s=2.0), seen
        (tmp_path / ".tmp-x").mkdir()
        os.rename(tmp_path / ".tmp-x", tmp_path / "step-00000003")
        assert wait_for(seen, "created:step-00000003", timeout_s=2.0), seen
    finally:
        watcher.stop()


def test_step_entries_yields_only_steps_and_reads_no_further_than_the_cap(tmp_path, monkeypatch):
    for name in ("step-00000001", "step-1", "step-00000002.tmp", ".tmp-step-00000003", "junk", "step-00000004"):
        (tmp_path / name).mkdir()
    assert sorted(e.name for e in step_entries(str(tmp_path))) == ["step-00000001", "step-00000004"]
    monkeypatch.setattr(watcher_module, "MAX_ROOT_ENTRIES", 3)
    with os.scandir(tmp_path) as entries:
        first_three = [e.name for e in entries][:3]
    got = [e.name for e in step_entries(str(tmp_path))]
    assert got == [n for n in first_three if n in ("step-00000001", "step-00000004")]


def test_a_link_named_like_a_step_is_not_followed_by_the_polling_watcher(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    seen: list[str] = []
    watcher = CheckpointWatcher(root, seen.append, poll_interval_s=0.05)
    watcher.start()
    try:
        time.sleep(0.2)
        os.symlink(target / "missing", root / "step-00000001")  # dangling: a stat that follows it fails
        assert wait_for(seen, "created:step-00000001", timeout_s=2.0), seen
    finally:
        watcher.stop()
