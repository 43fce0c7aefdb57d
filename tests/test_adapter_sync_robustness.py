"""Adapter steps that try the sidecar's limits: an adapter that kills SGLang at every load, a
republished adapter SGLang refuses, a header far larger than any adapter's, and numbers in
``adapter_config.json`` no float can hold. Each is refused with its reason, and what SGLang
served before keeps serving. And the adapters a sidecar keeps track of: a root reused by another
run (lower steps), a sidecar restarted beside an SGLang that has adapters loaded.

The sidecar cases run the real sync loop (``SyncController.run``) against :class:`LoraSGLang`,
a fake SGLang: see its docstring for why a real one cannot show those failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fake_sglang import Answer, CannedServer, canned_reply
from rollout_service import adapter_reader
from rollout_service import checkpoint_reader as cr
from rollout_service.adapter_reader import MAX_ADAPTER_HEADER_BYTES, validate_adapter_step
from rollout_service.adapter_writer import publish_adapter
from rollout_service.checkpoint_format import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, CheckpointError
from rollout_service.protocol import adapter_name_for, step_for_adapter_name
from rollout_service.sidecar.controller import MAX_CRASHES_PER_STEP, SyncController
from rollout_service.sidecar.settings import SidecarSettings
from test_adapter_checkpoints import LIMITS, REFERENCE, check, lora_config, lora_tensors, publish
from test_cli_validate_kinds import vouch_for

RUN_ID = "run1"
"""The run id ``test_adapter_checkpoints.publish`` gives its adapters."""


# --- a fake SGLang's LoRA endpoints -----------------------------------------------------------
def hang_up(conn: Any, stopped: Any) -> None:
    """No answer: the connection closes, as when SGLang's process dies in the middle of a call."""


class LoraSGLang:
    """A fake SGLang 0.5.23, as far as adapter sync calls it (``/model_info``, ``/server_info``,
    ``/v1/models``, ``/load_lora_adapter``, ``/unload_lora_adapter``; ``/health`` answers 200).

    It is fake for the failures a real SGLang cannot be made to show on demand: dying in the
    middle of an adapter load (``die_on_steps``: the connection drops and the server is back at
    once with no adapter, as after its supervisor restarted it), refusing adapter files the
    sidecar's validation accepted (``refuse_loads``), and a ``/server_info`` answer of the wrong
    shape (``server_info_junk``). The validation exists to refuse, before
    SGLang sees them, every adapter SGLang 0.5.23 is known to refuse or die on, so no real
    adapter does either. Like SGLang, it refuses a second adapter under a name it has and the
    unload of a name it does not have.
    """

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}
        """name -> the path it was loaded from."""
        self.die_on_steps: set[int] = set()
        self.refuse_loads = False
        self.server_info_junk: dict[str, Any] = {}
        """Fields of ``/server_info`` replaced by values no SGLang sends (a proxy's, a bug's)."""
        self.loads: list[str] = []
        """The name of every load asked for, in order."""
        self.unloads: list[str] = []
        """The name of every unload asked for, in order."""
        self.server = CannedServer(self._answer)
        self.url = self.server.url

    def _answer(self, path: str, body: Any, count: int) -> Answer | None:
        if path == "/model_info":
            return canned_reply(200, {"weight_version": "default", "model_path": "/models/base"})
        if path == "/server_info":
            modules = sorted(LIMITS.target_modules)
            info = {"enable_lora": True, "max_lora_rank": 16, "lora_target_modules": modules}
            return canned_reply(200, {**info, **self.server_info_junk})
        if path == "/v1/models":
            cards = [{"id": name, "parent": "base", "root": path} for name, path in self.adapters.items()]
            return canned_reply(200, {"data": [{"id": "base"}, *cards]})
        if path == "/load_lora_adapter":
            return self._load(body["lora_name"], body["lora_path"])
        if path == "/unload_lora_adapter":
            self.unloads.append(body["lora_name"])
            found = self.adapters.pop(body["lora_name"], None) is not None
            return canned_reply(200 if found else 400, {"success": found, "error_message": "no such adapter"})
        return None  # /health: 200

    def _load(self, name: str, path: str) -> Answer:
        self.loads.append(name)
        if step_for_adapter_name(name) in self.die_on_steps:
            self.adapters.clear()  # restarted by its supervisor: no adapters
            return hang_up
        if self.refuse_loads or name in self.adapters:
            return canned_reply(400, {"success": False, "error_message": f"Failed to load LoRA adapter {name}"})
        self.adapters[name] = path
        return canned_reply(200, {"success": True})


@pytest.fixture
def fake_lora_sglang() -> Iterator[LoraSGLang]:
    fake = LoraSGLang()
    yield fake
    fake.server.stop()


@pytest.fixture
def controller(fake_lora_sglang: LoraSGLang, checkpoint_root: Path, tmp_path: Path) -> SyncController:
    """A sidecar's sync loop (not started) beside the fake, checking against ``REFERENCE``."""
    return sidecar(fake_lora_sglang, checkpoint_root, tmp_path)


def sidecar(fake_lora_sglang: LoraSGLang, checkpoint_root: Path, tmp_path: Path) -> SyncController:
    """A sync loop (not started) beside the fake; another one with the same arguments is the
    same sidecar restarted (its stage, its base model folder)."""
    base = tmp_path / "base"
    if not base.exists():
        base.mkdir()
        save_file({name: torch.zeros(shape) for name, (_, shape) in REFERENCE.items()}, str(base / "model.safetensors"))
    settings = SidecarSettings(
        checkpoint_path=checkpoint_root,
        sglang_url=fake_lora_sglang.url,
        replica_id="robust",
        stage_dir=tmp_path / "stage",
        reference_dir=base,
        health_interval_s=0.05,
        request_timeout_s=5.0,
        load_timeout_s=5.0,
    )
    return SyncController(settings)


@contextlib.asynccontextmanager
async def running(controller: SyncController) -> AsyncIterator[None]:
    task = asyncio.create_task(controller.run())
    try:
        yield
    finally:
        await controller.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.02)


async def passes(controller: SyncController, count: int) -> None:
    """Let the loop run ``count`` more whole passes (health check and sync)."""
    for _ in range(count):
        seen = controller.state.loop_heartbeat
        await until(lambda seen=seen: controller.state.loop_heartbeat != seen, "the loop did not complete a pass")


def restarts(controller: SyncController) -> float | None:
    return controller.metrics.registry.get_sample_value("rollout_sidecar_sglang_restarts_total")


def publish_run(root: Path, step: int, run_id: str) -> None:
    """Publish adapter step ``step`` of run ``run_id`` (weights of its own)."""
    publish_adapter(root, step, lora_tensors(seed=step), lora_config(), run_id=run_id)


def republish(root: Path, step: int, seed: int) -> None:
    """Publish ``step`` again with other weights (the trainer republishing it after a restart)."""
    shutil.rmtree(root / f"step-{step:08d}")
    publish(root, step, tensors=lora_tensors(seed=seed))


# --- finding: SGLang dying during an adapter load ----------------------------------------------
def test_an_adapter_that_kills_sglang_at_every_load_is_rejected_and_the_last_good_one_serves_again(
    controller: SyncController, fake_lora_sglang: LoraSGLang, checkpoint_root: Path
) -> None:
    """(Fake SGLang, see :class:`LoraSGLang`: no real one can be made to die on an adapter load.)
    Like a full checkpoint, an adapter step during whose load SGLang died ``MAX_CRASHES_PER_STEP``
    times is rejected (``sglang_crashed_on_load``), not loaded again after every restart."""
    fake = fake_lora_sglang
    good, bad = adapter_name_for(1, RUN_ID), adapter_name_for(2, RUN_ID)

    async def scenario() -> None:
        publish(checkpoint_root, 1)
        async with running(controller):
            await until(lambda: controller.state.loaded_step == 1, "step 1 was not loaded")
            fake.die_on_steps.add(2)
            publish(checkpoint_root, 2, tensors=lora_tensors(seed=2))
            await until(lambda: 2 in controller.state.rejected, "the adapter that kills SGLang was not rejected")
            await until(lambda: good in fake.adapters, "step 1 was not loaded again after the restart")
            await passes(controller, 3)

    asyncio.run(scenario())
    assert controller.state.rejected[2] == "sglang_crashed_on_load", controller.state.last_error
    assert fake.loads.count(bad) == MAX_CRASHES_PER_STEP, fake.loads
    assert controller.state.loaded_step == 1 and controller.adapters.serving == good


# --- finding: republishing the served adapter -----------------------------------------------
def test_a_republished_adapter_sglang_refuses_leaves_the_served_one_and_counts_no_restart(
    controller: SyncController, fake_lora_sglang: LoraSGLang, checkpoint_root: Path
) -> None:
    """(Fake SGLang, see :class:`LoraSGLang`: no real one refuses files the validation passed.)
    The served step republished with files SGLang refuses is rejected, and the adapter it served
    stays loaded under its name (the one the trainer's requests give): it is not unloaded first,
    and its absence is not taken for an SGLang restart. Files SGLang takes then replace it under
    that same name, with no trial name left behind."""
    fake = fake_lora_sglang
    name = adapter_name_for(1, RUN_ID)

    async def scenario() -> None:
        publish(checkpoint_root, 1)
        async with running(controller):
            await until(lambda: name in fake.adapters, "step 1 was not loaded")
            served = fake.adapters[name]
            fake.refuse_loads = True
            republish(checkpoint_root, 1, seed=5)
            await until(lambda: 1 in controller.state.rejected, "the refused replacement was not rejected")
            await passes(controller, 3)
            assert controller.state.rejected[1] == "sglang_rejected"
            assert fake.adapters == {name: served}, "the served adapter was unloaded for one SGLang refused"
            assert controller.state.loaded_step == 1 and controller.adapters.serving == name
            assert not restarts(controller), "a refused replacement was counted as an SGLang restart"
            fake.refuse_loads = False
            republish(checkpoint_root, 1, seed=6)
            await until(lambda: fake.adapters.get(name, served) != served, "the accepted replacement did not load")
            await passes(controller, 2)
            assert set(fake.adapters) == {name} and controller.state.loaded_step == 1
            assert 1 not in controller.state.rejected and not restarts(controller)

    asyncio.run(scenario())


# --- finding: the adapter header cap and the deadline -----------------------------------------
def padded_weights(step_dir: Path, header_bytes: int) -> None:
    """Give the step's weights a header of about ``header_bytes`` (valid: the padding is
    metadata) and have the manifest vouch for the file, as a writer publishing it would."""
    weights = step_dir / ADAPTER_WEIGHTS_NAME
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"] = {"padding": "x" * header_bytes}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    vouch_for(step_dir, ADAPTER_WEIGHTS_NAME, struct.pack("<Q", len(raw)) + raw + data[8 + length :])


@pytest.fixture
def parsed_headers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files whose safetensors header is parsed (``safe_open``), in order, from now on."""
    real_safe_open = cr.safe_open
    parsed: list[str] = []

    def counting(path: str, **kw: Any) -> Any:
        parsed.append(path)
        return real_safe_open(path, **kw)

    monkeypatch.setattr(cr, "safe_open", counting)
    return parsed


def test_an_adapter_header_over_the_adapter_cap_is_refused_from_its_length_before_it_is_read(
    tmp_path: Path, parsed_headers: list[str]
) -> None:
    """The full-model cap (100 MB) let a crafted adapter header take seconds and hundreds of MB;
    an adapter's own cap refuses it (``header_too_large``) before safetensors parses it, in the
    sidecar's check as in ``rollout-service validate``."""
    step_dir = publish(tmp_path, 1).path
    padded_weights(step_dir, MAX_ADAPTER_HEADER_BYTES)
    for validate in (lambda: check(tmp_path), lambda: validate_adapter_step(step_dir, limits=LIMITS)):
        with pytest.raises(CheckpointError) as info:
            validate()
        assert info.value.reason == "header_too_large", info.value
        assert ADAPTER_WEIGHTS_NAME in str(info.value) and f"the {MAX_ADAPTER_HEADER_BYTES}" in str(info.value)
    assert parsed_headers == []


def test_rollout_service_validate_parses_an_adapters_header_once(tmp_path: Path, parsed_headers: list[str]) -> None:
    """Without a reference model, the base weights an adapter's tensors imply come from the header
    the validation reads anyway, not from a second parse of it."""
    report = validate_adapter_step(publish(tmp_path, 1).path, limits=LIMITS)
    assert report.modules == ["q_proj", "v_proj"] and len(parsed_headers) == 1, parsed_headers


def test_a_header_read_that_outlasts_the_deadline_is_a_validation_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header read on storage that slows to a crawl ends as ``validation_timeout`` (the setting
    to raise is named), not as whatever the late answer then makes of the step."""
    step_dir = publish(tmp_path, 1).path
    real_read = adapter_reader.read_safetensors_specs

    def slow(*args: Any, **kw: Any) -> Any:
        time.sleep(0.3)
        return real_read(*args, **kw)

    monkeypatch.setattr(adapter_reader, "read_safetensors_specs", slow)
    with pytest.raises(CheckpointError) as info:
        adapter_reader.validate_adapter(step_dir, root=tmp_path, reference=REFERENCE, limits=LIMITS, timeout_s=0.2)
    assert info.value.reason == "validation_timeout" and ADAPTER_WEIGHTS_NAME in str(info.value), info.value


# --- finding: numbers in adapter_config.json ----------------------------------------------------
@pytest.mark.parametrize("field", ["lora_alpha", "r"])
def test_a_config_number_no_float_holds_is_a_bad_adapter_config_naming_its_field(tmp_path: Path, field: str) -> None:
    """JSON numbers have no size limit: ``10**400`` in ``adapter_config.json`` overflows ``float()``.
    It is refused like any wrong config value (``bad_adapter_config``, the only error the
    validation raises), naming the field, in a message of bounded length."""
    step_dir = publish(tmp_path, 1).path
    config = json.loads((step_dir / ADAPTER_CONFIG_NAME).read_text())
    config[field] = 10**400
    vouch_for(step_dir, ADAPTER_CONFIG_NAME, json.dumps(config).encode())
    for validate in (lambda: check(tmp_path), lambda: validate_adapter_step(step_dir, limits=LIMITS)):
        with pytest.raises(CheckpointError) as info:
            validate()
        message = str(info.value)
        assert info.value.reason == "bad_adapter_config", message
        assert f"{field}=" in message and len(message) < 400, message


# --- finding: a /server_info answer of the wrong shape -----------------------------------------
def test_a_server_info_of_the_wrong_shape_is_sglang_s_fault_not_the_adapter_s(
    controller: SyncController, fake_lora_sglang: LoraSGLang, checkpoint_root: Path
) -> None:
    """(Fake SGLang, see :class:`LoraSGLang`: no real one answers so.) LoRA limits that cannot be
    read are reported and tried again at the next pass; the adapter is not rejected for them, and
    loads once the answer is sane."""
    fake = fake_lora_sglang
    fake.server_info_junk = {"lora_target_modules": 5}

    async def scenario() -> None:
        publish(checkpoint_root, 1)
        async with running(controller):
            await until(
                lambda: (controller.state.last_error or {}).get("reason") == "sglang_unavailable",
                "the unreadable /server_info was not reported",
            )
            await passes(controller, 2)
            assert 1 not in controller.state.rejected and controller.state.loaded_step is None
            assert "/server_info cannot be read" in controller.state.last_error["message"]
            fake.server_info_junk = {}
            await until(lambda: controller.state.loaded_step == 1, "step 1 was not loaded once /server_info was sane")

    asyncio.run(scenario())


# --- finding: a stage that cannot take the adapter ----------------------------------------------
def test_a_stage_that_cannot_take_an_adapter_does_not_cost_the_step(
    controller: SyncController, fake_lora_sglang: LoraSGLang, checkpoint_root: Path
) -> None:
    """(Fake SGLang, see :class:`LoraSGLang`.) A stage without room (or on a failing disk) is the
    replica's fault, not the adapter's: ``stage_failed`` is reported, the step is not rejected,
    and it loads once the stage can take it again."""
    from rollout_service.sidecar.staging import StageError

    fake = fake_lora_sglang
    failures = {"left": 3}

    async def scenario() -> None:
        async with running(controller):
            await until(lambda: controller.stage is not None, "the stage was not opened")
            stage = controller.stage
            assert stage is not None
            real_copy_in = stage.copy_in

            def no_room(*args: Any, **kwargs: Any) -> Any:
                if failures["left"]:
                    failures["left"] -= 1
                    raise StageError("the stage has 1 MiB free: no room for the adapter")
                return real_copy_in(*args, **kwargs)

            stage.copy_in = no_room  # type: ignore[method-assign]
            publish(checkpoint_root, 1)
            await until(lambda: controller.state.loaded_step == 1, "step 1 was not loaded once the stage had room")

    asyncio.run(scenario())
    assert failures["left"] == 0 and 1 not in controller.state.rejected
    assert fake.loads == [adapter_name_for(1, RUN_ID)]
    assert (
        controller.metrics.registry.get_sample_value(
            "rollout_sidecar_syncs_total", {"outcome": "failed", "reason": "stage_failed"}
        )
        == 3
    )


# --- finding: which adapters a sidecar keeps loaded ---------------------------------------------
@pytest.mark.parametrize("old_steps", [(5, 6, 7), (1, 2, 3)], ids=["higher-steps", "same-steps"])
def test_a_root_reused_by_another_run_retires_the_old_runs_adapters_and_keeps_the_new_ones(
    controller: SyncController, fake_lora_sglang: LoraSGLang, checkpoint_root: Path, old_steps: tuple[int, ...]
) -> None:
    """(Fake SGLang, see :class:`LoraSGLang`.) A root emptied and reused by another run starts
    again at step 1: its adapters are the newest loads, whatever their step numbers. Run A's are
    unloaded in turn (also one of the same step number as one of run B's), run B's served one is
    loaded once and never unloaded (nor its absence taken for an SGLang restart)."""
    fake = fake_lora_sglang
    new = [adapter_name_for(step, "runB") for step in (1, 2, 3)]

    async def scenario() -> None:
        async with running(controller):
            for step in old_steps:
                publish_run(checkpoint_root, step, "runA")
                await until(lambda step=step: controller.state.loaded_step == step, f"run A's step {step}")
            for step in old_steps:
                shutil.rmtree(checkpoint_root / f"step-{step:08d}")
            publish_run(checkpoint_root, 1, "runB")
            await until(lambda: controller.state.loaded_run_id == "runB", "run B's step 1 was not loaded")
            await passes(controller, 3)
            assert new[0] in fake.adapters and fake.loads.count(new[0]) == 1, fake.loads
            assert controller.adapters.serving == new[0] and not restarts(controller)
            for step in (2, 3):
                publish_run(checkpoint_root, step, "runB")
                await until(lambda step=step: controller.state.loaded_step == step, f"run B's step {step}")
            await passes(controller, 2)

    asyncio.run(scenario())
    assert set(fake.adapters) == set(new), "run A's adapters were not all unloaded"
    assert list(controller.adapters.loaded) == new and not restarts(controller)
    assert not set(new) & set(fake.unloads), fake.unloads


def test_a_restarted_sidecar_takes_over_the_adapters_an_earlier_process_loaded(
    fake_lora_sglang: LoraSGLang, checkpoint_root: Path, tmp_path: Path
) -> None:
    """(Fake SGLang, see :class:`LoraSGLang`.) A sidecar restarted beside a live SGLang takes over
    the adapters the earlier process loaded: they are unloaded in turn as newer ones load, not
    left loaded for good. A trial a process stopped mid-replacement left is unloaded at once."""
    fake = fake_lora_sglang
    names = {step: adapter_name_for(step, RUN_ID) for step in range(1, 8)}
    trial = names[2] + ".trial"  # a replacement of step 2 cut short

    async def scenario() -> None:
        first = sidecar(fake, checkpoint_root, tmp_path)
        async with running(first):
            for step in (1, 2, 3):
                publish_run(checkpoint_root, step, RUN_ID)
                await until(lambda step=step: first.state.loaded_step == step, f"step {step}")
        fake.adapters[trial] = "/left/over"
        unloads = len(fake.unloads)
        restarted = sidecar(fake, checkpoint_root, tmp_path)
        async with running(restarted):
            await until(lambda: restarted.state.loaded_step == 3, "the restarted sidecar does not serve step 3")
            await passes(restarted, 2)
            assert trial in fake.unloads[unloads:] and trial not in fake.adapters
            # The served adapter was loaded from this publication's staged copy: kept, not unloaded
            # and loaded again (requests for it would fail in between).
            assert names[3] not in fake.unloads[unloads:] and fake.loads.count(names[3]) == 1, fake.loads
            for step in (4, 5, 6, 7):
                publish_run(checkpoint_root, step, RUN_ID)
                await until(lambda step=step: restarted.state.loaded_step == step, f"step {step}")
            await passes(restarted, 2)
            assert not restarts(restarted)

    asyncio.run(scenario())
    assert set(fake.adapters) == {names[5], names[6], names[7]}, "adapters the earlier process loaded were left"
