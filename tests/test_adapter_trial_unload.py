"""The trial name a republished adapter is first loaded under (``<name>.trial``, see
``AdapterSync._replace``) is the sidecar's bookkeeping: whatever happened to an earlier trial
(its unload beside the loop still on its way, refused by SGLang's scheduler, or never unloadable)
never makes a good republished step count as refused by SGLang. Files SGLang does refuse still are.

All cases use :class:`SchedulerSGLang`, a fake: see its docstring for why.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout_service.checkpoint_reader import PublishedCheckpoint
from rollout_service.protocol import adapter_name_for
from rollout_service.sidecar.adapter_sync import TRIAL_SUFFIX
from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.sglang_client import SGLangLoadRejected

RUN_ID = "run1"


class SchedulerSGLang:
    """An in-process fake of SGLang 0.5.23's adapter endpoints, as the sidecar's client sees them,
    modelled on ``tokenizer_control_mixin``: loads and unloads take ``lora_update_lock`` one at a
    time; an unload takes the name off ``/v1/models`` (the registry) first, then unloads it in
    the scheduler; an unload that fails there stays pending (the name is off ``/v1/models`` but a
    load of it is refused, "has an incomplete unload", until an unload is tried again and works);
    the scheduler refuses a load under a name it has ("... because it is already loaded").

    Fake because a real server cannot be made to show these failures on demand: an unload still
    on its way when the next one of the same name is sent (``unload_lag_s``: queued behind other
    adapter updates), and an unload failing in SGLang's scheduler (``failing_unloads``)."""

    def __init__(self, loaded: dict[str, str]) -> None:
        self.registry = dict(loaded)
        """What ``/v1/models`` lists: name -> path."""
        self.scheduler = dict(loaded)
        """What the scheduler has loaded: name -> path."""
        self.pending: set[str] = set()
        self.unload_lag_s = 0.0
        """How long a trial's unload takes to reach the lock (other adapter updates hold it)."""
        self.failing_unloads = 0
        """How many more unloads of a trial fail in the scheduler."""
        self.failing_name_unloads = 0
        """How many more unloads of a served (not trial) name fail in the scheduler."""
        self.refused_paths: set[str] = set()
        """Adapter files the scheduler refuses (bad files)."""
        self.calls: list[tuple[str, str]] = []
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    @staticmethod
    def _refused(route: str, message: str) -> SGLangLoadRejected:
        return SGLangLoadRejected(f"SGLang refused {route} (HTTP 400): {message}")

    async def loaded_adapters(self) -> dict[str, str | None]:
        await asyncio.sleep(0)  # each call is a request: other tasks run meanwhile
        return dict(self.registry)

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        self.calls.append(("load", name))
        await asyncio.sleep(0)
        async with self.lock:
            if name in self.pending:
                raise self._refused(
                    "/load_lora_adapter",
                    f"LoRA adapter '{name}' has an incomplete unload. Retry the unload before loading it again.",
                )
            if name in self.scheduler:
                raise self._refused(
                    "/load_lora_adapter", f"Failed to load LoRA adapter {name} because it is already loaded"
                )
            if path in self.refused_paths:
                raise self._refused("/load_lora_adapter", f"Failed to load LoRA adapter {name}: bad weights")
            self.scheduler[name] = self.registry[name] = path
        return {"success": True}

    async def unload_lora_adapter(self, name: str) -> dict:
        self.calls.append(("unload", name))
        await asyncio.sleep(self.unload_lag_s if name.endswith(TRIAL_SUFFIX) else 0)
        async with self.lock:
            if name not in self.pending:
                if name not in self.registry:
                    raise self._refused(
                        "/unload_lora_adapter",
                        f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.registry)}",
                    )
                del self.registry[name]
                self.pending.add(name)
            if name.endswith(TRIAL_SUFFIX) and self.failing_unloads > 0:
                self.failing_unloads -= 1
                raise self._refused("/unload_lora_adapter", f"failed to unload LoRA adapter {name} in the scheduler")
            if not name.endswith(TRIAL_SUFFIX) and self.failing_name_unloads > 0:
                self.failing_name_unloads -= 1
                raise self._refused("/unload_lora_adapter", f"failed to unload LoRA adapter {name} in the scheduler")
            self.pending.discard(name)
            del self.scheduler[name]
        return {"success": True}


class Replica:
    """A sidecar's controller beside the fake, which serves step 7's adapter (loaded by an earlier
    sidecar process), and a way to republish step 7 (new files at a new path) and load it."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "root"
        self.root.mkdir()
        self.name = adapter_name_for(7, RUN_ID)
        self.trial = self.name + TRIAL_SUFFIX
        self.fake = SchedulerSGLang({self.name: str(tmp_path / "earlier")})
        settings = SidecarSettings(
            checkpoint_path=self.root, sglang_url="http://127.0.0.1:9", replica_id="trial", stage=False
        )
        self.controller = SyncController(settings, client=self.fake)  # type: ignore[arg-type]
        self.republished = 0

    async def republish_and_load(self) -> tuple[bool, str]:
        """Load step 7 republished once more (other files: another path); (loaded, its path)."""
        self.republished += 1
        path = str(self.root / f"step-00000007-{self.republished}")
        ckpt = PublishedCheckpoint(step=7, path=Path(path))
        loaded = await self.controller.adapters._load(ckpt, self.name, path, f"{self.republished:032x}")
        return loaded, path

    async def unloads_done(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.controller.adapters._unloads), 5)

    def assert_not_rejected(self) -> None:
        assert self.controller.state.rejected == {}, self.controller.state.last_error


@pytest.fixture
def replica(tmp_path: Path) -> Replica:
    return Replica(tmp_path)


def test_a_republish_while_the_last_trials_unload_is_on_its_way_is_loaded(replica: Replica) -> None:
    """(a) Step 7 republished twice in a row: the first replacement's trial unload, beside the
    loop, has not reached SGLang when the second replacement reads the adapter list, which still
    names the trial. The second one waits for it rather than sending an unload of its own that
    SGLang refuses ("does not exist") once the first went through: both republications load."""
    fake = replica.fake
    fake.unload_lag_s = 0.3

    async def scenario() -> None:
        assert (await replica.republish_and_load())[0], replica.controller.state.last_error
        assert replica.trial in fake.registry  # its unload is still on its way
        loaded, path = await replica.republish_and_load()
        assert loaded, replica.controller.state.last_error
        await replica.unloads_done()
        assert fake.registry == {replica.name: path} == fake.scheduler
        assert fake.calls.count(("unload", replica.trial)) == 2, fake.calls

    asyncio.run(scenario())
    replica.assert_not_rejected()


def test_a_leftover_trial_that_went_after_the_list_was_read_does_not_refuse_the_step(replica: Replica) -> None:
    """(a) The adapter list named the trial, whose unload then went through before the sidecar's
    own unload of it (SGLang refuses that one: "does not exist"): the trial is gone, so the
    replacement goes on and the new files are served."""
    fake = replica.fake
    path = str(replica.root / "step-00000007-new")

    async def scenario() -> None:
        await replica.controller.adapters._replace(replica.name, path, {replica.name, replica.trial})
        await replica.unloads_done()

    asyncio.run(scenario())
    assert fake.registry == {replica.name: path} == fake.scheduler, fake.calls


def test_a_trial_whose_unload_failed_in_sglang_does_not_refuse_the_next_republish(replica: Replica) -> None:
    """(b) The first replacement's trial unload, beside the loop, failed in SGLang's scheduler (only
    logged): the trial is off ``/v1/models`` but still taken, and SGLang refuses its next load
    ("incomplete unload"). The next republish unloads it again and loads: not a refusal of its
    files."""
    fake = replica.fake
    fake.failing_unloads = 1

    async def scenario() -> None:
        assert (await replica.republish_and_load())[0], replica.controller.state.last_error
        await replica.unloads_done()
        assert replica.trial in fake.pending and replica.trial not in fake.registry
        loaded, path = await replica.republish_and_load()
        assert loaded, replica.controller.state.last_error
        await replica.unloads_done()
        assert fake.registry == {replica.name: path} == fake.scheduler
        assert not fake.pending

    asyncio.run(scenario())
    replica.assert_not_rejected()


def test_a_trial_sglang_will_not_unload_is_tried_again_not_held_against_the_step(replica: Replica) -> None:
    """(b) SGLang keeps failing to unload the trial: the republished step is not rejected but left
    with an error saying what is in the way (``adapter_trial_in_the_way``), the served adapter
    untouched; once the trial can be unloaded, the next pass loads the step."""
    fake = replica.fake
    fake.failing_unloads = 1_000

    async def scenario() -> None:
        assert (await replica.republish_and_load())[0], replica.controller.state.last_error
        await replica.unloads_done()
        served = dict(fake.registry)
        loaded, _ = await replica.republish_and_load()
        assert not loaded
        error = replica.controller.state.last_error
        assert error is not None and error["reason"] == "adapter_trial_in_the_way", error
        assert replica.trial in error["message"] and "/unload_lora_adapter" in error["message"], error
        assert fake.registry == served
        replica.assert_not_rejected()
        fake.failing_unloads = 0
        loaded, path = await replica.republish_and_load()
        assert loaded, replica.controller.state.last_error
        await replica.unloads_done()
        assert fake.registry == {replica.name: path} == fake.scheduler

    asyncio.run(scenario())
    replica.assert_not_rejected()


def test_files_sglang_refuses_are_still_rejected_and_the_served_adapter_stays(replica: Replica) -> None:
    """The trial name's bookkeeping takes nothing away from a real refusal: files SGLang refuses
    under the trial name reject the step, and the adapter served before stays."""
    fake = replica.fake
    served = dict(fake.registry)
    fake.refused_paths.add(str(replica.root / "step-00000007-1"))

    loaded, _ = asyncio.run(replica.republish_and_load())
    assert not loaded
    assert replica.controller.state.rejected == {7: "sglang_rejected"}, replica.controller.state.last_error
    assert fake.registry == served == fake.scheduler


def test_a_served_adapter_whose_unload_fails_once_is_still_replaced(replica: Replica) -> None:
    """The served name's own unload fails once in SGLang's scheduler (its new files loaded fine
    under the trial name): SGLang then refuses its load ("incomplete unload"), which is the name's
    state, not the files'. The next round unloads it again and loads the new files; the step is
    not rejected (it was: the unload's refusal was taken for the files')."""
    fake = replica.fake
    fake.failing_name_unloads = 1

    async def scenario() -> None:
        loaded, path = await replica.republish_and_load()
        assert loaded, replica.controller.state.last_error
        await replica.unloads_done()
        assert fake.registry == {replica.name: path} == fake.scheduler
        assert fake.calls.count(("unload", replica.name)) == 2, fake.calls

    asyncio.run(scenario())
    replica.assert_not_rejected()


def test_a_served_adapter_sglang_will_not_unload_is_tried_again_and_forgotten(replica: Replica) -> None:
    """The served name's unload keeps failing in SGLang's scheduler: the step is tried again at the
    next pass (``adapter_replace_raced``), not rejected, and the name SGLang no longer lists is
    not taken for served (the health check would count its absence as an SGLang restart)."""
    fake = replica.fake
    fake.failing_name_unloads = 10

    async def scenario() -> None:
        loaded, _ = await replica.republish_and_load()
        assert not loaded
        await replica.unloads_done()

    asyncio.run(scenario())
    replica.assert_not_rejected()
    assert replica.controller.state.last_error is not None
    assert "adapter_replace_raced" in str(replica.controller.state.last_error)
    assert replica.name not in replica.controller.adapters.loaded
