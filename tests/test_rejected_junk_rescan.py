"""Junk step folders that stay rejected do not make every later pass of the sync loop slower.

A rejection stands until its step may have been fixed: its folder or manifest changed, or (for a
rejection about what the files hold) any of its files, e.g. a shard completed in place. Telling
the last apart takes a ``stat`` of each entry of the step, and each listing (twice a pass, under
``--root-timeout``) used to do that for every rejected step: hundreds of junk steps of 10^4
files each made the listing outlast the root gate's bound, and the replica went unready blaming
the storage (``root_unresponsive``) while a valid newer step never loaded. Now a listing looks at
a bounded number of rejected steps' entries, all together, taking turns; rejections for too many
entries (which only a change of the folder itself can end) are not read entry by entry at all.

The entries read are counted by wrapping ``os.scandir``: the counts, not timings, are asserted.
SGLang is the in-process fake client of tests/test_sync_loop_hazards.py.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.sidecar import controller as controller_module
from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.settings import SidecarSettings
from test_sync_loop_hazards import CONFIG, RUN, make, run_with, tensors, until

JUNK_FILES, SHARE = 200, 500
"""Empty files added to each junk step, and the entries one listing reads of rejected steps
(``RESCAN_ENTRIES``: 10^4, made 20 times smaller here, as the junk is, so that fewer files are
made): 8 junk steps hold more entries than one listing reads."""


@pytest.fixture
def small_share(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(controller_module, "RESCAN_ENTRIES", SHARE, raising=False)
    return SHARE


class EntryCounter:
    """Counts the entries ``os.scandir`` hands out from the step folders of ``root`` (not the
    root's own listing), in the threads where :attr:`on` is set (or everywhere: ``everywhere``)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, everywhere: bool = True):
        self.root = os.path.realpath(root)
        self.count = 0
        self.everywhere = everywhere
        self.local = threading.local()
        self.lock = threading.Lock()
        real = os.scandir

        counter = self

        class Counted:
            def __init__(self, it: Any):
                self.it = it

            def __enter__(self) -> Counted:
                return self

            def __exit__(self, *exc: object) -> None:
                self.it.close()

            def close(self) -> None:
                self.it.close()

            def __iter__(self) -> Iterator[Any]:
                for entry in self.it:
                    counter.seen()
                    yield entry

        def scandir(path: Any = ".") -> Any:
            it = real(path)
            if isinstance(path, int) or os.path.dirname(os.path.realpath(path)) != self.root:
                return it
            return Counted(it)

        monkeypatch.setattr(os, "scandir", scandir)

    def seen(self) -> None:
        if getattr(self.local, "on", False):
            self.local.count += 1
        elif self.everywhere:
            with self.lock:
                self.count += 1

    def start(self) -> None:
        """Count this thread's reads from now on (see :meth:`stop`)."""
        self.local.on, self.local.count = True, 0

    def stop(self) -> int:
        """This thread's reads since :meth:`start`."""
        self.local.on = False
        return int(self.local.count)

    def take(self) -> int:
        with self.lock:
            n, self.count = self.count, 0
        return n


def junk_step(root: Path, step: int, files: int = JUNK_FILES) -> Path:
    """A step with a valid manifest whose shard is cut short (rejected ``truncated``: about what
    a file holds, so a file completed in place ends it) and ``files`` empty files beside it."""
    path = publish_checkpoint(root, step, tensors(step), config=CONFIG, run_id=RUN).path
    shard = next(path.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(16)
    for i in range(files):
        os.close(os.open(path / f"junk{i}", os.O_CREAT | os.O_WRONLY))
    return path


def controller_for(root: Path) -> SyncController:
    return SyncController(SidecarSettings(checkpoint_path=root, sglang_url="http://127.0.0.1:9", replica_id="r0"))


def reject(controller: SyncController, path: Path, reason: str) -> None:
    """Reject ``path``'s step as the loop does: with the identity read before its validation."""
    step = int(path.name.split("-")[1])
    controller.state.rejected[step] = reason
    controller._rejected_at[step] = controller_module._publication_identity(path)


def test_a_listing_reads_a_bounded_number_of_rejected_entries_however_much_junk_was_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_share: int
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    controller = controller_for(root)
    paths = [junk_step(root, step) for step in range(10, 18)]  # 8 x 203 entries: past one listing's share
    for path in paths:
        reject(controller, path, "truncated")
    counter = EntryCounter(root, monkeypatch)
    bound = small_share + 1  # (+1: the entry that shows a folder holds more than is left)
    for _ in range(6):
        candidates, identities = controller._listing()
        assert counter.take() <= bound
        assert all(controller._still_rejected(c.step, identities) for c in candidates)
    assert set(controller.state.rejected) == set(range(10, 18))  # nothing changed: all stand
    paths += [junk_step(root, step) for step in range(18, 26)]  # twice the junk
    for path in paths[8:]:
        reject(controller, path, "truncated")
    counter.take()
    for _ in range(6):
        controller._listing()
        assert counter.take() <= bound, "a listing reads more as more junk is rejected"


def test_every_rejected_step_gets_its_turn_so_a_file_completed_in_place_still_lifts_its_rejection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_share: int
) -> None:
    """What the files' look is for: a step rejected for a shard seen half copied is looked at
    anew once the copy completes it in place (the folder's own stat does not change), however
    much junk was rejected beside it: within the listings it takes to read all of them once."""
    root = tmp_path / "root"
    root.mkdir()
    controller = controller_for(root)
    paths = [junk_step(root, step) for step in range(10, 18)]
    for path in paths:
        reject(controller, path, "truncated")
    time.sleep(0.01)
    for path in (paths[0], paths[-1], paths[3]):  # the oldest, the newest, one between
        shard = next(path.glob("*.safetensors"))
        with open(shard, "r+b") as f:
            f.write(b"\1" * 16)  # in place: same name, inode and size
    counter = EntryCounter(root, monkeypatch)
    turns = -(-len(paths) * (JUNK_FILES + 3) // small_share) + 1
    for _ in range(turns):
        candidates, identities = controller._listing()
        for c in candidates:
            controller._still_rejected(c.step, identities)
        assert counter.take() <= small_share + 1
    assert set(controller.state.rejected) == {11, 12, 14, 15, 16}


def test_steps_rejected_for_too_many_entries_are_not_read_entry_by_entry_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a change of the folder itself (an entry added, removed, renamed) can end a
    ``too_many_entries`` rejection: its 10^4 entries are not read at every listing; removing one
    is seen at once."""
    root = tmp_path / "root"
    root.mkdir()
    controller = controller_for(root)
    paths = [junk_step(root, step) for step in (10, 11)]  # (fewer entries than such steps hold: same look)
    for path in paths:
        reject(controller, path, "too_many_entries")
    counter = EntryCounter(root, monkeypatch)
    for _ in range(3):
        candidates, identities = controller._listing()
        assert all(controller._still_rejected(c.step, identities) for c in candidates)
        assert counter.take() == 0
    time.sleep(0.01)
    (paths[1] / "junk0").unlink()
    candidates, identities = controller._listing()
    assert not controller._still_rejected(11, identities) and controller._still_rejected(10, identities)


def test_a_valid_step_loads_past_junk_rejected_before_it_with_each_listing_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_share: int
) -> None:
    """The loop itself: junk steps are rejected once; the passes after read a bounded number of
    their entries per listing, and a valid newer step then loads."""
    root, c, client = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    junk = list(range(2, 10))
    for step in junk:
        junk_step(root, step)
    counter = EntryCounter(root, monkeypatch, everywhere=False)
    per_listing: list[int] = []
    listing = c._listing

    def counted_listing() -> Any:
        counter.start()
        try:
            return listing()
        finally:
            per_listing.append(counter.stop())

    monkeypatch.setattr(c, "_listing", counted_listing)

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1 and set(c.state.rejected) == set(junk), 60)
        assert set(c.state.rejected.values()) == {"truncated"}
        per_listing.clear()
        seen = c.state.loop_heartbeat
        await until(lambda: c.state.loop_heartbeat != seen and len(per_listing) >= 4, 30)
        publish_checkpoint(root, 50, tensors(50), config=CONFIG, run_id=RUN)
        await until(lambda: c.state.loaded_step == 50, 30)

    run_with(c, during)
    assert per_listing and max(per_listing) <= small_share + 1, per_listing
    assert set(c.state.rejected) == set(junk) and client.loaded_versions()[-1] == "50"


def test_a_wait_on_a_rejected_step_reads_none_of_its_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GET /wait`` needs no token: each call on a rejected step used to read every entry of its
    folder (10^4 for junk), so a client asking again and again made the root do the listing's
    work per request. A wait looks at the folder and manifest only (a file changed in place is
    the loop's budgeted rescan's to see); a folder replaced since still ends the rejection."""
    import asyncio

    root = tmp_path / "root"
    root.mkdir()
    controller = controller_for(root)
    path = junk_step(root, 7)
    reject(controller, path, "truncated")
    counter = EntryCounter(root, monkeypatch)

    async def waits() -> list[bool]:
        controller._changed = asyncio.Condition()
        return [await controller.wait_for_step(7, 5.0) for _ in range(20)]

    assert asyncio.run(waits()) == [False] * 20  # the rejection stands: answered at once
    assert counter.take() == 0, "a /wait on a rejected step read its folder's entries"
    time.sleep(0.01)
    (path / "junk0").unlink()  # the folder changed: looked at anew by the wait (which then waits on)

    async def one() -> bool:
        controller._changed = asyncio.Condition()
        return await controller.wait_for_step(7, 0.5)

    assert asyncio.run(one()) is False and 7 not in controller.state.rejected
