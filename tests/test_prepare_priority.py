"""The sidecar prepares checkpoints below SGLang's CPU priority (``--prepare-nice``): the thread
that validates, stages and rebuilds a step, and the rebuild's own threads, run at the raised
nice value; the event loop (the HTTP API, health checks) and the process do not."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from delta_helpers import CONFIG, RUN, Model
from rollout_service import delta_apply
from rollout_service.checkpoint_format import step_dir_name
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar import staging
from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.cpu_priority import MAX_NICENESS, lower_this_thread
from rollout_service.sidecar.settings import SidecarSettings
from sidecar_helpers import run_loop_until
from test_stage_dir_safety import FakeClient

pytestmark = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread nice values here")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _on_a_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()))
    thread.start()
    thread.join(10)
    return out["value"]


def test_lowering_a_thread_touches_that_thread_and_the_threads_it_starts_only() -> None:
    base = _nice()

    def lowered() -> tuple[int, int, int]:
        got = lower_this_thread(4)
        return got, _nice(), _on_a_thread(_nice)

    assert _on_a_thread(lowered) == (min(MAX_NICENESS, base + 4),) * 3
    assert _nice() == base and os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller and the process
    assert _on_a_thread(lambda: (lower_this_thread(0), _nice())) == (base, base)
    assert _on_a_thread(lambda: (lower_this_thread(50), _nice())) == (MAX_NICENESS, MAX_NICENESS)


@pytest.mark.parametrize("niceness", [0, 7])
def test_a_delta_is_validated_staged_and_rebuilt_at_the_prepare_niceness(
    tmp_path: Path, monkeypatch, niceness: int
) -> None:
    root, reference = tmp_path / "root", tmp_path / "ref"
    model, writer = Model(lr=1e-6), DeltaCheckpointWriter(full_every=100)
    publish_checkpoint(reference, 0, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    for step in (1, 2):
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    seen: dict[str, set[int]] = {"build": set(), "rebuild": set(), "loop": set()}
    real_build, real_part = staging.Stage.build, delta_apply._rebuild_part

    def build(self, *args, **kw):
        seen["build"].add(_nice())
        return real_build(self, *args, **kw)

    def rebuild_part(*args, **kw):
        seen["rebuild"].add(_nice())
        return real_part(*args, **kw)

    monkeypatch.setattr(staging.Stage, "build", build)
    monkeypatch.setattr(delta_apply, "_rebuild_part", rebuild_part)
    settings = SidecarSettings(
        checkpoint_path=root,
        sglang_url="http://127.0.0.1:9",
        replica_id="r0",
        stage_dir=tmp_path / "stage",
        reference_dir=reference / step_dir_name(0),
        health_interval_s=0.05,
        rescan_interval_s=0.05,
        poll_interval_s=0.05,
        prepare_niceness=niceness,
    )
    client = FakeClient(reference / step_dir_name(0))
    controller = SyncController(settings, client=client)
    base = _nice()

    def loaded() -> bool:
        seen["loop"].add(_nice())
        return controller.state.loaded_step == 2

    run_loop_until(controller, loaded, timeout_s=20)
    assert controller.state.loaded_step == 2, controller.state.last_error
    assert controller.state.last_sync is not None and controller.state.last_sync.kind == "delta"
    want = min(MAX_NICENESS, base + niceness)
    assert seen == {"build": {want}, "rebuild": {want}, "loop": {base}}, seen
    assert _nice() == base
