"""What SGLang does while a pass validates and stages a step (minutes for a large model) counts at once.

A pass's watch of SGLang used to only keep ``/readyz`` fresh: an SGLang that died, or came back
on its start-up weights, left ``loaded_step`` and ``sglang_healthy`` as they were until the pass
ended, so ``GET /wait`` answered 200 for the step SGLang no longer held and the ack file told the
trainer (and its retention) the same. And the liveness probe counted SGLang alive for the whole
validate-and-stage phase (``loading_step`` is set from its start), though SGLang's ``/health``
waits only on the load call itself: an SGLang that died meanwhile went unrestarted for up to
``--validate-timeout``. The probe now reads ``sglang_loading_step``, set around the load call.

SGLang is the in-process fake client of tests/test_sync_loop_hazards.py (a restart or a death
on cue in the middle of a pass is what a real server cannot be made to show); the sidecar's
``/status`` is served to the real probe by ``fake_sglang.CannedServer``.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from fake_sglang import CannedServer, canned_reply, dead_url
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.liveness import check_liveness
from rollout_service.sidecar.controller import SyncController
from test_sync_loop_hazards import CONFIG, RUN, make, run_with, tensors, until

STAGE_S = 4.0
"""How long step 2's validation and staging lasts here (a large step on network storage)."""


def slow_step_2(c: SyncController) -> None:
    prepare = c._prepare

    def slow(path: Path) -> Any:
        if path.name.endswith("2"):
            time.sleep(STAGE_S)
        return prepare(path)

    c._prepare = slow  # type: ignore[method-assign]


def ack(root: Path) -> dict[str, Any]:
    return json.loads((root / "acks" / "r0.json").read_text())


def serving_step_1(tmp_path: Path, **overrides: Any) -> tuple[Path, SyncController, Any]:
    """A sidecar that loads step 1, then takes ``STAGE_S`` to stage step 2 (see :func:`step_2_staging`)."""
    root, c, sglang = make(tmp_path, **overrides)
    publish_checkpoint(root, 1, tensors(1), config=CONFIG, run_id=RUN)
    slow_step_2(c)
    return root, c, sglang


async def step_2_staging(root: Path, c: SyncController) -> None:
    """(In the loop's run.) Once step 1 is served, publish step 2 and wait until it is being staged."""
    await until(lambda: c.serves(1))
    publish_checkpoint(root, 2, tensors(2), config=CONFIG, run_id=RUN)
    await until(lambda: c.state.loading_step == 2)


def test_sglang_restarted_during_a_pass_stops_wait_and_the_ack_confirming_the_old_step(tmp_path: Path) -> None:
    root, c, sglang = serving_step_1(tmp_path, ack_interval_s=30.0)

    async def during() -> None:
        await step_2_staging(root, c)
        sglang.version = "default"  # SGLang restarted on its start-up weights
        await until(lambda: not c.serves(1), STAGE_S / 2)
        assert await c.wait_for_step(1, 0.5, run_id=RUN) is False
        await until(lambda: ack(root).get("loaded_step") is None, STAGE_S / 2)  # at once, not at the heartbeat
        assert ack(root)["ready"] is False and c.state.loading_step == 2  # the pass goes on
        await until(lambda: c.serves(2), 20)
        assert await c.wait_for_step(2, 1.0, run_id=RUN) is True

    run_with(c, during)
    assert c.metrics.sglang_restarts._value.get() == 1


def test_sglang_down_during_a_pass_stops_wait_confirming_and_comes_back(tmp_path: Path) -> None:
    root, c, sglang = serving_step_1(tmp_path, ack_interval_s=30.0)

    async def during() -> None:
        await step_2_staging(root, c)
        sglang.unanswered_views = 10**9  # SGLang stops answering
        await until(lambda: not c.state.sglang_healthy, STAGE_S / 2)
        assert await c.wait_for_step(1, 0.5, run_id=RUN) is False
        await until(lambda: ack(root).get("sglang_healthy") is False, STAGE_S / 2)
        assert ack(root)["ready"] is False and c.readiness()[0] is False
        sglang.unanswered_views = 0  # back, on the same weights
        await until(lambda: c.serves(1) or c.serves(2), 20)
        await until(lambda: c.serves(2), 20)

    run_with(c, during)


def test_the_liveness_probe_counts_only_sglangs_load_call_not_the_staging_before_it(tmp_path: Path) -> None:
    root, c, sglang = serving_step_1(tmp_path)
    status = CannedServer(lambda path, body, count: canned_reply(200, c.state.to_dict()) if path == "/status" else None)
    dead_sglang = dead_url()
    seen: dict[str, tuple[bool, str]] = {}

    async def probe() -> tuple[bool, str]:
        return await asyncio.to_thread(check_liveness, dead_sglang, status.url, timeout_s=2.0)

    async def in_the_load(path: str, version: str) -> None:
        if version == "2":
            assert c.state.sglang_loading_step == 2
            seen["load"] = await probe()

    sglang.load_hook = in_the_load

    async def during() -> None:
        await step_2_staging(root, c)
        assert c.state.sglang_loading_step is None
        seen["staging"] = await probe()
        await until(lambda: c.serves(2), 20)
        assert c.state.sglang_loading_step is None

    try:
        run_with(c, during)
    finally:
        status.stop()
    alive, why = seen["staging"]
    assert not alive and "/health failed" in why, "a dead SGLang counted alive while its sidecar staged a step"
    alive, why = seen["load"]
    assert alive and "loading step 2" in why


def test_a_scheduler_hung_during_a_pass_counts_as_silence_not_as_answers(tmp_path: Path) -> None:
    """SGLang's HTTP front still answers ``/model_info`` while its scheduler hangs (a wedged GPU):
    the pass's watch asked only that, so the sidecar kept SGLang counted alive, ready and served,
    and ``serve``'s hang check (``--hang-timeout``, from ``sglang_seen_at``) saw nothing until the
    pass ended (up to ``--validate-timeout``). The watch asks ``/health`` too, at its interval."""
    from rollout_service.serve import hang_reason

    root, c, sglang = serving_step_1(tmp_path, ack_interval_s=30.0, deep_health_interval_s=0.2)

    async def during() -> None:
        await step_2_staging(root, c)
        sglang.hung = True
        await until(lambda: not c.state.sglang_healthy, STAGE_S / 2)
        assert c.state.loading_step == 2, "seen by the pass's watch, while the pass stages step 2"
        assert await c.wait_for_step(1, 0.3, run_id=RUN) is False and c.readiness()[0] is False
        seen = c.state.sglang_seen_at
        await asyncio.sleep(0.5)
        assert c.state.sglang_seen_at == seen, "answers of the HTTP front alone count as SGLang's"
        assert hang_reason(c.state, 0.0, 0.4, time.monotonic()) is not None
        sglang.hung = False
        await until(lambda: c.serves(2), 20)

    run_with(c, during)


def test_the_watch_does_not_ask_health_during_the_load_call(tmp_path: Path) -> None:
    """SGLang's ``/health`` waits on a load in flight: asked then, it would time out and count
    SGLang silent for the length of a load."""
    root, c, sglang = serving_step_1(tmp_path, deep_health_interval_s=0.05)

    async def slow_load(path: str, version: str) -> None:
        if version == "2":
            await asyncio.sleep(1.0)

    sglang.load_hook = slow_load

    async def during() -> None:
        await step_2_staging(root, c)
        await until(lambda: c.serves(2), 20)

    run_with(c, during)
    assert sglang.deep_views_while_loading == 0
    assert c.state.sglang_healthy


def test_a_health_check_caught_behind_a_load_call_is_not_silence(tmp_path: Path) -> None:
    """The watch asks /health only while no load call is in flight, but a load can start while
    /health is on its way: SGLang then answers /health after the load (or the call times out),
    which said nothing about SGLang's health and counted it silent, unready, mid-load."""
    root, c, sglang = serving_step_1(tmp_path, deep_health_interval_s=0.05)
    sglang.health_waits_on_loads = True

    async def slow_load(path: str, version: str) -> None:
        if version == "2":
            await asyncio.sleep(1.0)

    sglang.load_hook = slow_load
    silent: list[float] = []
    real = c._sglang_silent

    def counted(was_healthy: bool) -> None:
        silent.append(time.monotonic())
        real(was_healthy)

    c._sglang_silent = counted  # type: ignore[method-assign]

    async def during() -> None:
        await step_2_staging(root, c)
        await until(lambda: c.serves(2), 20)

    run_with(c, during)
    assert silent == [], "SGLang counted silent because /health waited on a load"


def test_one_lost_answer_during_a_pass_does_not_leave_the_replica_unready_for_the_rest_of_it(tmp_path: Path) -> None:
    """SGLang misses a few /model_info answers (a busy CPU) and answers again on the same weights:
    the replica is ready again at once and a /wait for the served step answers, not only once
    the pass (up to --validate-timeout) has ended."""
    root, c, sglang = serving_step_1(tmp_path, ack_interval_s=30.0)

    async def during() -> None:
        await until(lambda: c.serves(1) and c.readiness()[0])
        await step_2_staging(root, c)
        sglang.unanswered_views = 2
        await until(lambda: not c.state.sglang_healthy, STAGE_S / 4)
        waiting = asyncio.create_task(c.wait_for_step(1, STAGE_S / 2, run_id=RUN))
        await until(lambda: c.state.sglang_healthy, STAGE_S / 4)
        assert c.state.loading_step == 2, "the pass is still staging step 2"
        assert await waiting is True, "a /wait for the served step waited past SGLang's return"
        assert c.readiness()[0] is True and c.state.loading_step == 2

    run_with(c, during)


def test_a_root_that_did_not_answer_the_base_model_look_is_asked_again(tmp_path: Path) -> None:
    """The look for the base model's folder (once SGLang serves its base again) was given up on
    for good when the gate refused it once; it is asked again at the next check. (The look goes
    through the model files' own gate: a hung model mount keeps no look at the root waiting.)"""
    from rollout_service.sidecar import controller as controller_module
    from rollout_service.sidecar.root_gate import RootUnresponsive

    root, c, sglang = make(tmp_path)
    sglang.version = "default"  # SGLang serves its base model
    looks: list[str] = []
    real = c.model_gate.call

    async def call(fn: Any, *args: Any, what: str) -> Any:
        if fn is controller_module.base_model_dir:
            looks.append(what)
            if len(looks) == 1:
                raise RootUnresponsive("an earlier look at the model's files has not come back")
        return await real(fn, *args, what=what)

    c.model_gate.call = call  # type: ignore[method-assign]

    async def checks() -> None:
        c._changed, c._ack_now = asyncio.Condition(), asyncio.Event()
        c._reference = {}  # learnt earlier, while SGLang served a full step
        c.base_dir, c._base_dir_pending = None, True
        try:
            await c._check_server()
        except RootUnresponsive:
            pass
        await c._check_server()

    asyncio.run(checks())
    assert len(looks) == 2 and c._base_dir_pending is False
