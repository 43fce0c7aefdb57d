"""Adapter steps that cannot load now, with older full steps under them in the same root (an
earlier run of the trainer synced merged weights, or its start-up fell back to merged syncs).

A full step loaded over SGLang's base model leaves every later adapter refused
(``adapter_base_replaced``) until SGLang is restarted by hand. So when the newest adapter step
fails, for its own fault (rejected) or for SGLang's (``/server_info`` unreadable), the sidecar
waits instead of falling back to an older full step; an adapter list that does not come right
after SGLang took a load is looked at again, not counted as SGLang dying of the step.

The sync loop is real (``SyncController.run``); SGLang is :class:`FullAndLora`, a fake SGLang
(``test_adapter_sync_robustness.LoraSGLang`` plus full weight loads), for failures a real
SGLang does not show on cue: refusing an adapter the validation accepted, an odd
``/server_info``, a 503 of its adapter list right after a load.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from fake_sglang import Answer, canned_reply
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.protocol import adapter_name_for
from test_adapter_checkpoints import REFERENCE, lora_tensors, publish
from test_adapter_sync_robustness import RUN_ID, LoraSGLang, passes, running, sidecar, until


class FullAndLora(LoraSGLang):
    """:class:`LoraSGLang` that also loads full checkpoints (``/update_weights_from_disk``) and,
    with ``glitch_after_load``, answers its adapter list with a proxy's 503 once after each load
    of a served (not trial) adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.version = "default"
        self.glitch_after_load = False
        self._glitch = False
        self.glitches = 0

    def _answer(self, path: str, body: Any, count: int) -> Answer | None:
        if path == "/model_info":
            return canned_reply(200, {"weight_version": self.version, "model_path": "/models/base"})
        if path == "/update_weights_from_disk":
            self.version = body["weight_version"]
            return canned_reply(200, {"success": True, "message": "ok"})
        if path == "/v1/models" and self._glitch:
            self._glitch = False
            self.glitches += 1
            return canned_reply(503, {"detail": "Service Unavailable"})
        answer = super()._answer(path, body, count)
        if path == "/load_lora_adapter" and self.glitch_after_load and not body["lora_name"].endswith(".trial"):
            self._glitch = True
        return answer


@pytest.fixture
def fake() -> Any:
    server = FullAndLora()
    yield server
    server.server.stop()


def merged_run_step(root: Path, step: int) -> None:
    """A full checkpoint of an earlier run that synced merged weights."""
    tensors = [(name, torch.zeros(shape)) for name, (_, shape) in REFERENCE.items()]
    publish_checkpoint(root, step, tensors, config={"model_type": "x"}, run_id="merged-run")


def test_a_rejected_newest_adapter_does_not_bring_an_older_full_step_over_the_base(tmp_path: Path, fake) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    merged_run_step(root, 1)
    publish(root, 2, tensors=lora_tensors(seed=2))
    fake.refuse_loads = True  # SGLang refuses adapter step 2
    c = sidecar(fake, root, tmp_path)

    async def scenario() -> None:
        async with running(c):
            await until(lambda: c.state.rejected.get(2) == "sglang_rejected", "step 2 rejected")
            await passes(c, 3)
            assert fake.version == "default", "a full step was loaded over SGLang's base model"
            assert c.state.loaded_step is None
            fake.refuse_loads = False
            publish(root, 3, tensors=lora_tensors(seed=3))  # the run's next, good adapter
            await until(lambda: c.state.loaded_step == 3, "adapter step 3 served")

    asyncio.run(scenario())
    assert fake.version == "default"
    assert adapter_name_for(3, RUN_ID) in fake.adapters
    assert not any(v.startswith("adapter_base_replaced") for v in c.state.rejected.values())


def test_sglangs_odd_server_info_neither_rejects_the_adapter_nor_loads_an_older_full_step(tmp_path: Path, fake) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    merged_run_step(root, 1)
    publish(root, 2, tensors=lora_tensors(seed=2))
    fake.server_info_junk = {"max_lora_rank": "sixteen"}  # not the step's fault
    c = sidecar(fake, root, tmp_path)

    async def scenario() -> None:
        async with running(c):
            await until(lambda: (c.state.last_error or {}).get("reason") == "sglang_unavailable", "the error")
            await passes(c, 3)
            assert fake.version == "default" and c.state.loaded_step is None
            fake.server_info_junk = {}
            await until(lambda: c.state.loaded_step == 2, "adapter step 2 served once SGLang answers well")

    asyncio.run(scenario())
    assert fake.version == "default" and 2 not in c.state.rejected


def test_an_older_adapter_step_is_still_tried_under_a_rejected_newer_one(tmp_path: Path, fake) -> None:
    """Only full steps are held back: an older adapter loads on the same base."""
    root = tmp_path / "ckpts"
    root.mkdir()
    merged_run_step(root, 1)
    publish(root, 2, tensors=lora_tensors(seed=2))
    publish(root, 3, tensors=lora_tensors(seed=3))
    c = sidecar(fake, root, tmp_path)
    real_load = c.client.load_lora_adapter

    async def refuse_step_3(name: str, path: str) -> dict:
        if name.startswith(adapter_name_for(3, RUN_ID)):
            from rollout_service.sidecar.sglang_client import SGLangLoadRejected

            raise SGLangLoadRejected(f"SGLang refused {name}")
        return await real_load(name, path)

    c.client.load_lora_adapter = refuse_step_3  # type: ignore[method-assign]

    async def scenario() -> None:
        async with running(c):
            await until(lambda: c.state.loaded_step == 2, "adapter step 2 served")

    asyncio.run(scenario())
    assert c.state.rejected.get(3) == "sglang_rejected" and fake.version == "default"


def test_an_adapter_list_that_fails_right_after_a_load_is_no_crash_of_the_step(tmp_path: Path, fake) -> None:
    """A proxy's 503 for ``/v1/models`` right after every load counted as SGLang dying of the
    step: twice, and a good adapter was rejected (``sglang_crashed_on_load``) while SGLang held it."""
    root = tmp_path / "ckpts"
    root.mkdir()
    publish(root, 1)
    fake.glitch_after_load = True
    c = sidecar(fake, root, tmp_path)

    async def scenario() -> None:
        async with running(c):
            await until(lambda: c.state.loaded_step == 1 or 1 in c.state.rejected, "step 1 served or rejected")
            await passes(c, 2)

    asyncio.run(scenario())
    assert fake.glitches >= 1
    assert 1 not in c.state.rejected, c.state.rejected
    assert c.state.loaded_step == 1
    name = adapter_name_for(1, RUN_ID)
    assert fake.loads.count(name) == 1, fake.loads  # looked at again, not loaded again
