"""A weight update that never reached SGLang is no crash of the step.

``died_during_load`` counts a load SGLang stopped answering in against the step (rejected as
``sglang_crashed_on_load`` at the second), so that a step SGLang dies of is not sent forever. A
load refused at the connection (SGLang restarting, its accept queue full) was counted the same:
two such moments rejected a good step for good, and the trainer stopped with
``CheckpointRejected``. And a load was sent even when the pass's own watch had seen SGLang fall
silent while the step was validated.

The sync loop is real and so is the HTTP client of the refused loads (to a port nothing listens
on); the SGLang of the other calls is ``test_sync_loop_hazards``'s in-process fake client, named
as such: a real SGLang's restart cannot be timed to fall between validation and load.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest

from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.sidecar.sglang_client import SGLangClient, SGLangNotReached
from test_sync_loop_hazards import CONFIG, RUN, make, run_with, tensors, until


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_real_client_says_a_refused_connection_never_reached_sglang() -> None:
    client = SGLangClient(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(SGLangNotReached, match="never reached SGLang"):
        asyncio.run(client.load_from_disk("/x", "2"))
    with pytest.raises(SGLangNotReached, match="never reached SGLang"):
        asyncio.run(client.load_lora_adapter("v00000002-run1", "/x"))


def test_loads_refused_at_the_connection_do_not_reject_a_good_step(tmp_path: Path) -> None:
    root, c, fake = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    down = SGLangClient(f"http://127.0.0.1:{closed_port()}")
    real_load = fake.load_from_disk
    refused: list[str] = []

    async def load(path: str, version: str) -> dict:
        if version == "2" and len(refused) < 4:  # more than MAX_CRASHES_PER_STEP
            refused.append(version)
            return await down.load_from_disk(path, version)
        return await real_load(path, version)

    fake.load_from_disk = load

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: c.state.loaded_step == 2 or 2 in c.state.rejected, timeout_s=30)

    run_with(c, during)
    assert len(refused) == 4
    assert 2 not in c.state.rejected, c.state.rejected
    assert c.state.loaded_step == 2


def test_no_load_is_sent_to_an_sglang_that_fell_silent_during_validation(tmp_path: Path) -> None:
    root, c, fake = make(tmp_path)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    real_prepare, real_load = c._prepare, fake.load_from_disk
    healthy_when_sent: list[tuple[str, bool]] = []
    silent, seen_silent = threading.Event(), threading.Event()

    def slow_prepare(path: Path):  # a large step's validation; SGLang goes silent meanwhile
        out = real_prepare(path)
        if path.name == "step-00000002" and not silent.is_set():
            fake.unanswered_views = 10**9
            silent.set()
            assert seen_silent.wait(10)  # the pass's watch (every 0.05 s) has seen it
        return out

    async def load(path: str, version: str) -> dict:
        healthy_when_sent.append((version, c.state.sglang_healthy))
        return await real_load(path, version)

    c._prepare = slow_prepare  # type: ignore[method-assign]
    fake.load_from_disk = load

    async def during() -> None:
        await until(lambda: c.state.loaded_step == 1)
        publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
        await until(lambda: silent.is_set() and not c.state.sglang_healthy, timeout_s=30)
        seen_silent.set()
        await asyncio.sleep(0.5)  # the validation ends with SGLang still silent
        fake.unanswered_views = 0  # it answers again
        await until(lambda: c.state.loaded_step == 2, timeout_s=30)

    run_with(c, during)
    assert healthy_when_sent == [("1", True), ("2", True)], healthy_when_sent
