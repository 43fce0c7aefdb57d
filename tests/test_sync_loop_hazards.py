"""The sidecar's sync loop under what a real deployment does to it, found by a review of the loop:

- a config copied in after its size (a preallocating copier) lifts its rejection once complete;
- a load SGLang answered but did not confirm ends the pass: no older step is loaded over it;
- a step-named link into another file system that hangs does not stop the replica syncing;
- a sidecar restarted while SGLang loads a staged copy leaves that copy where it is;
- the ack file's heartbeat (and ``loading_step``) goes on during a long load;
- detection times, and the start-up clean-up of the acks folder, stay bounded;
- one failed look at the served step (ESTALE) does not reload it.

SGLang here is an in-process fake client (``FakeSGLang``), because these are failures a real
server cannot be made to show on cue: an answer lost right after a load, a load that lasts
minutes, a load in flight when its sidecar dies. The real server's side of the same paths is
covered by tests/test_sidecar.py and tests/test_hung_root.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_service.checkpoint_format import CONFIG_NAME
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.sidecar import acks as acks_module
from rollout_service.sidecar import controller as controller_module
from rollout_service.sidecar.acks import AckWriter, write_ack
from rollout_service.sidecar.controller import MAX_DETECTED, SyncController
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.sglang_client import ServerView, SGLangErrorAnswer, SGLangLoadTimedOut
from shared_fs import server_frozen, sshfs_mount

CONFIG = {"model_type": "qwen2", "hidden_size": 8}
RUN = "run1"


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(8, 8, generator=g)), ("b.weight", torch.randn(8, generator=g))]


class FakeSGLang:
    """A fake SGLang client (see the module's docstring): loads succeed at once unless a test
    hooks them; ``views`` can hand out one answer that does not come."""

    def __init__(self, model_path: Path | str):
        self.version: str | None = None
        self.model_path = str(model_path)
        self.loads: list[tuple[str, str]] = []
        self.unanswered_views = 0
        self.hung = False
        """Its scheduler hangs: ``/health`` (a deep view) is not answered, ``/model_info`` is."""
        self.deep_views_while_loading = 0
        self.health_waits_on_loads = False
        self.loading = False
        self.load_hook: Callable[[str, str], Awaitable[None]] | None = None

    async def view(self, deep: bool = False) -> ServerView:
        if deep and self.loading:
            self.deep_views_while_loading += 1
        if deep and self.health_waits_on_loads:  # /health queued behind a load call that starts now
            loads = len(self.loads)
            await asyncio.sleep(0.3)
            if self.loading or len(self.loads) != loads:
                return ServerView(False)  # it timed out waiting on the load
        if deep and self.hung:
            return ServerView(False)
        if self.unanswered_views:
            self.unanswered_views -= 1
            return ServerView(False)
        return ServerView(True, self.version, self.model_path)

    async def server_info(self) -> dict[str, Any]:
        return {}

    async def load_from_disk(self, path: str, version: str) -> dict[str, Any]:
        self.loads.append((path, version))
        if self.load_hook is not None:
            self.loading = True
            try:
                await self.load_hook(path, version)
            finally:
                self.loading = False
        self.version, self.model_path = version, path
        return {}

    async def aclose(self) -> None:
        pass

    def loaded_versions(self) -> list[str]:
        return [v for _, v in self.loads]


def make(tmp: Path, **overrides: Any) -> tuple[Path, SyncController, FakeSGLang]:
    root = tmp / "root"
    root.mkdir(exist_ok=True)
    ref = tmp / "ref"
    if not ref.exists():
        publish_checkpoint(tmp / "refroot", 0, tensors(0), config=CONFIG, run_id=RUN)
        shutil.copytree(tmp / "refroot" / "step-00000000", ref)
    settings = SidecarSettings(
        **{
            "checkpoint_path": root,
            "sglang_url": "http://127.0.0.1:9",
            "replica_id": "r0",
            "stage_dir": tmp / "stage",
            "reference_dir": ref,
            "health_interval_s": 0.05,
            "poll_interval_s": 0.05,
            **overrides,
        }
    )
    client = FakeSGLang(ref)
    return root, SyncController(settings, client=client), client  # type: ignore[arg-type]


def run_with(controller: SyncController, during: Callable[[], Awaitable[None]]) -> None:
    async def scenario() -> None:
        task = asyncio.create_task(controller.run())
        try:
            await during()
        finally:
            await controller.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(scenario())


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.05)


def test_a_config_completed_in_place_lifts_its_rejection(tmp_path: Path) -> None:
    root, c, client = make(tmp_path)
    src = tmp_path / "src"
    publish_checkpoint(src, 1, tensors(1), config=CONFIG, run_id=RUN)
    good = (src / "step-00000001" / CONFIG_NAME).read_bytes()
    shutil.copytree(src / "step-00000001", root / "step-00000001")
    config = root / "step-00000001" / CONFIG_NAME
    config.write_bytes(b"\0" * len(good))  # its final size, not yet its bytes

    async def during() -> None:
        await until(lambda: 1 in c.state.rejected)
        assert c.state.rejected[1] == "bad_config"
        with open(config, "r+b") as f:  # the copy completes, in place
            f.write(good)
        await until(lambda: c.state.loaded_step == 1)

    run_with(c, during)


def test_a_load_sglang_did_not_confirm_ends_the_pass_instead_of_loading_an_older_step(tmp_path: Path) -> None:
    root, c, client = make(tmp_path)
    for step in (1, 2, 3):
        publish_checkpoint(root, step, tensors(step), config=CONFIG, run_id=RUN)

    async def lose_the_next_view(path: str, version: str) -> None:
        if version == "3" and client.loaded_versions().count("3") == 1:
            client.unanswered_views = 1  # the confirming look right after the load is lost

    client.load_hook = lose_the_next_view

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 3)
        await asyncio.sleep(0.5)

    run_with(c, during)
    assert "1" not in client.loaded_versions() and "2" not in client.loaded_versions(), client.loaded_versions()
    assert c.state.rejected == {}, c.state.rejected


def test_a_step_named_link_into_a_hung_mount_does_not_stop_syncing(tmp_path: Path) -> None:
    root, c, client = make(tmp_path, root_timeout_s=1.0)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    other = tmp_path / "other"
    with sshfs_mount(other) as (_, mnt):

        async def during() -> None:
            await until(lambda: c.state.loaded_step == 1)
            with server_frozen(other):
                os.symlink(mnt / "somewhere", root / "step-00000099")
                publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
                await until(lambda: c.state.loaded_step == 2 and 99 in c.state.rejected, timeout_s=15)
                assert c.state.rejected[99] == "not_a_checkpoint"  # a link: never followed into the mount
                assert c.readiness()[0], c.readiness()

        run_with(c, during)


def test_a_step_named_link_to_a_valid_step_inside_the_root_is_rejected_not_served(tmp_path: Path) -> None:
    # The trainer's numbering and retention ignore a link named like a step: serving what it
    # points at pinned the replica to a step the trainer never publishes (a review, session 31).
    root, c, client = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    publish_checkpoint(tmp_path / "elsewhere", 99, tensors(99), config=CONFIG, run_id=RUN)

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        os.rename(tmp_path / "elsewhere" / "step-00000099", root / ".aside")  # a valid step 99, inside
        os.symlink(".aside", root / "step-00000099")
        await until(lambda: 99 in c.state.rejected)
        assert c.state.rejected[99] == "not_a_checkpoint"
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: c.state.loaded_step == 2)

    run_with(c, during)
    assert "99" not in client.loaded_versions(), client.loaded_versions()


def test_a_load_that_ends_a_long_pass_is_ready_at_once(tmp_path: Path) -> None:
    # A pass validating and staging a step on slow storage runs no health check: SGLang's last
    # answer was older than /readyz's freshness when the load ended, so /readyz said SGLang had
    # not answered recently right after /wait confirmed the step (CI saw 503 there).
    root, c, client = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1 and c.readiness()[0])
        c.state.sglang_seen_at = time.time() - 60  # the long pass
        await c._wake_after_load(1)
        assert c.readiness()[0], c.readiness()

    run_with(c, during)


def test_a_load_past_a_step_rejected_in_the_same_pass_is_ready_at_once(tmp_path: Path) -> None:
    # An earlier listing saw step 99 (so it is the newest known); the next pass rejected it on the
    # way to loading step 1. The replica serves the newest valid step from that moment, not only
    # after the listing that follows the load (CI saw /readyz unready in that window).
    root, c, client = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1 and c.readiness()[0])
        c.state.newest_known_step = 99
        c.state.rejected[99] = "bad_digest"
        await c._wake_after_load(1)
        assert c.state.ready and c.readiness()[0], c.readiness()
        c.state.newest_known_step, c._passed_over = 99, {5}  # step 5 failed for now, not rejected
        await c._wake_after_load(1)
        assert not c.state.ready, "a newer step the pass passed over is still to load"
        c._passed_over = set()
        del c.state.rejected[99]  # a newer step known and not rejected still makes it unready
        c.state.newest_known_step = 99
        await c._wake_after_load(1)
        assert not c.state.ready and "newest" in c.readiness()[1], c.readiness()

    run_with(c, during)


def test_a_restarted_sidecar_keeps_the_copy_sglang_may_still_be_loading(tmp_path: Path) -> None:
    root, first, client = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    in_flight: list[str] = []

    async def never_ends(path: str, version: str) -> None:
        if version == "2":
            in_flight.append(path)
            await asyncio.sleep(3600)  # SGLang reading the copy; its sidecar dies meanwhile

    client.load_hook = never_ends

    async def load_1_then_die_loading_2() -> None:
        await until(lambda: first.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: bool(in_flight))

    run_with(first, load_1_then_die_loading_2)
    being_loaded = Path(in_flight[0])
    inode = being_loaded.stat().st_ino
    served = client.model_path  # SGLang reports step 1's copy until the load of 2 ends

    second = SyncController(first.settings, client=client)  # type: ignore[arg-type]
    client.loads.clear()

    async def first_passes() -> None:
        await until(lambda: second.state.loaded_step == 1)  # adopted, and the stage pruned
        await asyncio.sleep(0.5)

    run_with(second, first_passes)
    assert being_loaded.is_dir() and being_loaded.stat().st_ino == inode
    assert Path(served).is_dir()


def test_the_ack_heartbeat_and_loading_step_go_on_during_a_long_load(tmp_path: Path) -> None:
    root, c, client = make(tmp_path, ack_interval_s=0.5)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    release = asyncio.Event()

    async def slow(path: str, version: str) -> None:
        if version == "2":
            await release.wait()  # a large model's /update_weights_from_disk

    client.load_hook = slow
    ack_file = root / "acks" / "r0.json"

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: c.state.loading_step == 2)
        await asyncio.sleep(0.3)
        assert json.loads(ack_file.read_text())["loading_step"] == 2  # at once, not at the pass's end
        for _ in range(4):
            await asyncio.sleep(1.0)
            age = time.time() - json.loads(ack_file.read_text())["heartbeat"]
            assert age < 2.0, f"the ack's heartbeat is {age:.1f} s old during the load"
        release.set()
        await until(lambda: c.state.loaded_step == 2)

    run_with(c, during)


def test_detection_times_are_bounded_and_dropped_once_not_needed(tmp_path: Path) -> None:
    root, c, client = make(tmp_path)
    for i in range(3 * MAX_DETECTED):
        c.notify(f"created:step-{10_000 + i:08d}")  # names made (and removed) by anyone
        c.notify(f"deleted:step-{20_000 + i:08d}")
    assert len(c._detected_at) == MAX_DETECTED
    assert all(step < 20_000 for step in c._detected_at)  # a deletion detects nothing
    c.state.loaded_step = 5
    c._detected_at = {3: time.time(), 7: time.time(), 8: time.time() - 120}
    c._forget_unlisted([])
    assert set(c._detected_at) == {7}  # served over, or unlisted for a minute: dropped


def test_the_start_up_clean_up_of_the_acks_folder_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = AckWriter(tmp_path, "r0")
    folder = tmp_path / "acks"
    folder.mkdir()
    for i in range(300):
        (folder / f".tmp-r0-{i:08x}").write_bytes(b"")
    assert writer.clean_up_leftovers(budget_s=0.0) == 0  # out of time before the first
    monkeypatch.setattr(acks_module, "MAX_CLEANUP_ENTRIES", 100)
    assert writer.clean_up_leftovers() == 100  # no more entries looked at than the bound
    monkeypatch.undo()
    assert writer.clean_up_leftovers() == 200


def test_a_replicas_start_up_removes_its_own_temporary_ack_files_not_those_of_a_replica_whose_id_extends_it(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "acks"
    folder.mkdir()
    mine, theirs = ".tmp-a-0123abcd", ".tmp-a-b-0123abcd"  # replica "a-b" writes its ack right now
    for name in (mine, theirs, ".tmp-a-0123abcd0", ".tmp-a-xyz"):
        (folder / name).write_bytes(b"")
    assert AckWriter(tmp_path, "a").clean_up_leftovers() == 1
    assert sorted(p.name for p in folder.iterdir()) == [".tmp-a-0123abcd0", theirs, ".tmp-a-xyz"]
    write_ack(tmp_path, "a-b", {"loaded_step": 1})
    assert AckWriter(tmp_path, "a-b").clean_up_leftovers() == 1 and not (folder / theirs).exists()


def test_a_failed_look_at_the_served_step_does_not_reload_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, c, client = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    stale = {"left": 0}

    def failing_once(real: Callable[..., os.stat_result]) -> Callable[..., os.stat_result]:
        def look(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            if stale["left"] and str(path).endswith("step-00000001"):
                stale["left"] -= 1
                raise OSError(errno.ESTALE, "Stale file handle", str(path))
            return real(path, *args, **kwargs)

        return look

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        for name in ("stat", "lstat"):
            monkeypatch.setattr(controller_module.os, name, failing_once(getattr(os, name)))
        stale["left"] = 1  # an NFS server's failover: one look fails
        await until(lambda: stale["left"] == 0)
        await asyncio.sleep(1.0)

    run_with(c, during)
    assert client.loaded_versions() == ["1"], client.loaded_versions()
    assert c.state.loaded_current


def test_a_proxys_5xx_to_loads_never_rejects_the_step(tmp_path: Path) -> None:
    """A 502 from a proxy in front of SGLang, however often, is not SGLang dying of the step."""
    root, c, client = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)

    async def bad_gateway_thrice(path: str, version: str) -> None:
        if len(client.loads) <= 3:
            raise SGLangErrorAnswer("http://proxy answered the weight update with HTTP 502: Bad Gateway")

    client.load_hook = bad_gateway_thrice

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1, timeout_s=20)

    run_with(c, during)
    assert c.state.rejected == {} and len(client.loads) == 4


@pytest.mark.parametrize("times_out", [1, 2])
def test_a_load_that_outlives_its_timeout_ends_the_pass_and_is_adopted_when_it_finishes(
    tmp_path: Path, times_out: int
) -> None:
    """SGLang finishes a load the sidecar stopped waiting for: no older step is sent meanwhile
    (it would be loaded after it), and once SGLang serves the step it is adopted, not listed as
    rejected (twice timed out is two 'crashes') nor counted as a restart. It is sent again only
    after another --load-timeout (it finishes after 1.5 s: the second try, at 1 s, times out
    too in one case, and is answered in the other)."""
    root, c, client = make(tmp_path, load_timeout_s=1.0)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    finishing: list[asyncio.Task[None]] = []

    async def finish_later(path: str) -> None:
        await asyncio.sleep(1.5)
        client.version, client.model_path = "3", path

    async def time_out(path: str, version: str) -> None:
        if version == "3" and client.loaded_versions().count("3") <= times_out:
            if not finishing:
                finishing.append(asyncio.create_task(finish_later(path)))
            raise SGLangLoadTimedOut("the load of step 3 was not answered within --load-timeout")

    client.load_hook = time_out

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        publish_checkpoint(root, 3, tensors(3), config=CONFIG, run_id=RUN)
        await until(lambda: bool(finishing) and finishing[0].done())
        await until(lambda: c.state.loaded_step == 3)
        await asyncio.sleep(0.3)

    run_with(c, during)
    assert "2" not in client.loaded_versions(), client.loaded_versions()
    assert c.state.rejected == {}, c.state.rejected
    assert c.state.last_error is None, c.state.last_error
    assert c.metrics.sglang_restarts._value.get() == 0
