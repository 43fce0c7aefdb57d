"""The polling watcher (``--poll``) keeps to the root's ``step-*`` entries, and stands in for
inotify when inotify has no instance left.

A stray process that floods the checkpoint root with files must cost the polling watcher
neither a snapshot of every file nor a stat of each at every poll: it still reports a new step
within a few polls, in bounded memory, and reads no further than the root listing's cap. A node
whose inotify instances are all taken (128 per user by default, a busy Kubernetes node's usual
state) made the sidecar fail to start; it polls instead and says so in ``/status``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import time
import tracemalloc

import pytest

from rollout_service.sidecar import watcher as watcher_module
from rollout_service.sidecar.watcher import CheckpointWatcher, step_entries


def wait_for(seen: list[str], want: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if want in seen:
            return True
        time.sleep(0.02)
    return False


def test_a_root_flooded_with_files_costs_the_polling_watcher_neither_memory_nor_a_stat_per_file(tmp_path, monkeypatch):
    for i in range(50_000):
        (tmp_path / f"junk-{i}").touch()
    (tmp_path / "step-00000001").mkdir()
    seen: list[str] = []
    stated: list[str] = []
    stat = watcher_module._stat_root_or_entry

    def counting_stat(path: str) -> os.stat_result:
        stated.append(os.path.basename(path))
        return stat(path)

    monkeypatch.setattr(watcher_module, "_stat_root_or_entry", counting_stat)
    tracemalloc.start()
    try:
        watcher = CheckpointWatcher(tmp_path, seen.append, poll_interval_s=0.1)
        watcher.start()
        try:
            time.sleep(0.3)
            (tmp_path / "step-00000002").mkdir()
            # A deadline only (no hang), not a speed measure: the polls' cost is counted below.
            found = wait_for(seen, "created:step-00000002", timeout_s=30)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            watcher.stop()
    finally:
        tracemalloc.stop()
    assert found, f"the new step was not reported within 30 s of 0.1 s polls: {seen}"
    # Every poll stats the root and its step-* entries, never one of the 50,000 stray files.
    assert stated and set(stated) <= {tmp_path.name, "step-00000001", "step-00000002"}, sorted(set(stated))[:5]
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


@contextlib.contextmanager
def inotify_exhausted():
    """Take every inotify instance this user may have (released on exit)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fds = []
    try:
        while len(fds) < 100_000:
            fd = libc.inotify_init1(os.O_CLOEXEC)
            if fd < 0:
                assert ctypes.get_errno() == 24, f"inotify_init1 failed with errno {ctypes.get_errno()}"
                break
            fds.append(fd)
        yield
    finally:
        for fd in fds:
            os.close(fd)


def test_with_no_inotify_instance_left_the_sidecar_polls_and_says_so(tmp_path):
    from fastapi.testclient import TestClient

    from rollout_service.sidecar.app import create_app
    from rollout_service.sidecar.settings import SidecarSettings

    settings = SidecarSettings(checkpoint_path=tmp_path, sglang_url="http://127.0.0.1:1", replica_id="r", stage=False)
    seen: list[str] = []
    with inotify_exhausted():
        watcher = CheckpointWatcher(tmp_path, seen.append)
        watcher.start()
        try:
            assert watcher.mode == "polling (inotify: inotify instance limit reached)"
            (tmp_path / "step-00000001").mkdir()
            assert wait_for(seen, "created:step-00000001", timeout_s=5.0), seen
        finally:
            watcher.stop()
        with TestClient(create_app(settings), base_url="http://127.0.0.1") as client:  # starts the app's own watcher
            assert client.get("/status").json()["watch_mode"].startswith("polling (inotify:")


def test_out_of_inotify_watches_the_failed_observer_is_stopped_before_polling(tmp_path, monkeypatch):
    """Out of watches (ENOSPC), inotify fails only when the watch is added, after its reader
    thread and descriptor were made: they are released, not kept for the sidecar's life. (The
    limit is a system-wide setting a test must not lower: the failure is raised by a subclass.)"""
    import errno as errno_codes

    made = []

    class OutOfWatches(watcher_module.Observer):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def schedule(self, *args, **kwargs):
            raise OSError(errno_codes.ENOSPC, "inotify watch limit reached")

    monkeypatch.setattr(watcher_module, "Observer", OutOfWatches)
    seen: list[str] = []
    watcher = CheckpointWatcher(tmp_path, seen.append)
    watcher.start()
    try:
        assert watcher.mode == "polling (inotify: inotify watch limit reached)"
        assert made and not made[0]._inotify_fd.is_alive(), "the failed inotify observer's thread still runs"
        (tmp_path / "step-00000001").mkdir()
        assert wait_for(seen, "created:step-00000001", timeout_s=5.0), seen
    finally:
        watcher.stop()


@pytest.mark.parametrize("poll", [0.05, None], ids=["polling", "inotify"])
@pytest.mark.parametrize("how", ["removed-and-made-again", "replaced-by-rename"])
def test_a_root_removed_or_replaced_is_watched_anew(tmp_path, monkeypatch, caplog, poll, how):
    """A reused root (``rm -rf root && mkdir root``, or another folder renamed into its place, a
    volume remounted) ended watchdog's watch of it without a word: ``/status`` still named its
    mode, and new steps were found only by the sync loop's own look. The watcher notices within
    ``WATCH_CHECK_S``, says so, and watches the new folder."""
    monkeypatch.setattr(watcher_module, "WATCH_CHECK_S", 0.1, raising=False)
    caplog.set_level("INFO", logger=watcher_module.__name__)
    root = tmp_path / "root"
    root.mkdir()
    seen: list[str] = []
    watcher = CheckpointWatcher(root, seen.append, poll_interval_s=poll)
    watcher.start()
    try:
        (root / "step-00000001").mkdir()
        assert wait_for(seen, "created:step-00000001", 5)
        if how == "removed-and-made-again":
            shutil.rmtree(root)
            time.sleep(0.3)  # (the watch ends with the folder)
            root.mkdir()
        else:
            (tmp_path / "new").mkdir()
            os.rename(root, tmp_path / "old")
            os.rename(tmp_path / "new", root)
        deadline = time.monotonic() + 10
        while "watching" not in caplog.text or "again with" not in caplog.text:  # the guard watches anew
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        assert "watch:anew" in seen  # the loop is woken to look at what came while nothing watched
        (root / "step-00000002").mkdir()
        assert wait_for(seen, "created:step-00000002", 5), seen
        assert "stopped watching it" in caplog.text
    finally:
        watcher.stop()


def test_a_watcher_stopped_while_its_root_is_gone_watches_nothing_again(tmp_path, monkeypatch, caplog):
    """The guard that watches a lost root anew ends with ``stop()``: a root that comes back later
    is not watched by a sidecar that was stopped (its event loop is gone)."""
    import threading

    monkeypatch.setattr(watcher_module, "WATCH_CHECK_S", 0.05)
    caplog.set_level("INFO", logger=watcher_module.__name__)
    root = tmp_path / "root"
    root.mkdir()
    seen: list[str] = []
    modes: list[str] = []
    watcher = CheckpointWatcher(root, seen.append, poll_interval_s=0.05, on_mode=modes.append)
    before = set(threading.enumerate())
    watcher.start()
    shutil.rmtree(root)
    deadline = time.monotonic() + 10
    while "stopped watching it" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.02)
    watcher.stop()
    root.mkdir()
    time.sleep(0.5)  # ten guard periods
    assert "again with" not in caplog.text and "watch:anew" not in seen and modes == []
    assert not [t for t in set(threading.enumerate()) - before if t.name == "watcher-guard"]
